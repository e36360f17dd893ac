"""Grouped W4A16 matmuls over frozen MXFP4 experts: a pure-torch reference and a Triton kernel that reads the
packed FP4 codes and E8M0 scales and dequantizes them in registers (no bf16 copy of any weight in memory).

Rows arrive grouped by expert (rows of expert 0, then expert 1, ...), given by `ends_E` (int32 cumulative row
ends: rows ends[e-1] .. ends[e] belong to expert e) or a host list of counts. Expert e's weight W_e [O, In] is
stored as `packed` uint8 [E, O, In/2] (element 2j in the LOW nibble of byte j) and `scale` uint8 [E, O, In/32]
(`miles_k3.kernels.mxfp4` for the format). Two products, both with fp32 accumulation and the result rounded once
to x's dtype (bf16):

    forward / prefill       y[rows of e] = x[rows of e] @ W_e^T      x [M, In]  -> y [M, O]
    input gradient          y[rows of e] = x[rows of e] @ W_e        x [M, O]   -> y [M, In]  (`transpose=True`)

Design. One program computes a [BM, BN] tile of y: BM rows of ONE expert (an "M-tile") by BN output columns,
looping over the reduction in steps of BK. The M-tiles are each expert's rows cut into ceil(count/BM) pieces,
experts in order; every program finds its (expert, first row) itself from `ends_E` (one vectorised pass over
the E row ends: cumsum of the per-expert tile counts), so the launch needs no host-side schedule, no padding of
rows to BM (rows past an expert's end are masked) and no host sync: the grid is an upper bound on the number of
M-tiles (ceil(M/BM) + min(E, M)) and programs past the last tile exit at once. Experts without rows own no tile,
so their weights are never read. The grid's fast axis is the N-tile, so the programs sharing an x tile run
together (x from L2).

The weight tile is dequantized in registers from [rows, C] of W's natural layout (bytes and scale groups along
In): packed bytes [R, C/2] and scales [R, C/32], both contiguous loads that Triton's pipeliner keeps
`num_stages` deep (cp.async; what a decode step needs: ~3x faster than loads issued one step ahead by hand,
`prefetch`), the scales broadcast to their 16 bytes in registers, decoded to bf16 lo/hi-nibble halves that
`tl.interleave` puts in element order. Forward: the tile is W_e[n-tile, k-tile] (R = BN outputs, C = BK along
In) and the product is x @ tile^T. Backward: the reduction runs over O, so the tile is W_e[k-tile, n-tile]
(R = BK, C = BN along In: the scale groups now lie along the OUTPUT columns) and the product is x @ tile: the
same decode, read along the other axis, no transposed copy of the weights. value = E2M1(code) * 2^(s-127)
(scale 0 = 2^-127, scale 255 = NaN block), exact in bf16. Two implementations, selected by the constexpr
DECODE:
  * "tl": Triton integer ops build the bf16 of E2M1(code) (normal numbers only), then one fp32 multiply by the
    block's power of two. Exact for every scale byte; runs under the Triton interpreter (the CPU test).
  * "asm" (CUDA only): inline PTX on 4 bytes at a time: `prmt` puts two bytes in the two halves of a word,
    shifts and masks place each nibble as a bf16 bit pattern equal to E2M1(code) * 2^-126 (code 1 becomes a
    bf16 subnormal), and two `mul.rn.bf16x2` (IEEE, subnormals kept) scale by 2^126 and by 2^(s-127) (built
    as s << 7, max 0x0040 for s = 0): ~3 integer and 1 fp op per element. Exact for scale bytes 0..254; a NaN
    block (255) decodes to +-Inf (NaN for code 0) instead of all NaN, so outputs that reduce over it are still
    non-finite (Inf or NaN) as in the reference.
The decode costs integer-ALU time per weight element per M-tile, so BM is as large as the rows per expert allow
(`pick_config`).

Decode (CUDA graphs): the same kernel with BM = 16 (a decode step routes a few rows to each expert); `ends_E` on
the device, a grid fixed by (M, E) alone, so `sync_free_experts()` steps capture it, and only the experts that
received rows are read.

Numerics: the products of bf16 x and exact bf16 weights are exact in fp32; only the order of the fp32
accumulation differs from the reference (dequantize, then an fp32 matmul of the same bf16 values), so results
agree to fp32 accumulation error before the single rounding to bf16 (tests/test_gpu_mxfp4_moe.py states the
criterion).

Legend: M rows (token-expert pairs), E experts, O/In a projection's output/input width, K the reduction width
(In forward, O backward), N the output width (O forward, In backward), G scale groups of 32.
This module imports torch and triton only; launching the kernel needs CUDA (or `TRITON_INTERPRET=1`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

GROUP_SIZE = 32  # elements per E8M0 scale
DECODES = ("tl", "asm")
ACT_DTYPES = (torch.bfloat16,)


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes and launch parameters of one kernel specialisation."""

    bm: int  # rows per program (one expert's rows)
    bn: int  # output columns per program
    bk: int  # reduction step (a multiple of 32 forward: whole scale groups)
    num_warps: int = 4
    num_stages: int = 3
    decode: str = "asm"  # "tl" or "asm" (module docstring)
    swap: bool = False  # compute the tile as (W x^T)^T: the decoded weights are the dot's first operand
    scale_2d: bool = False  # scales loaded per group and broadcast in registers (else one load per byte)
    prefetch: bool = True  # hand-pipelined loads (else Triton's pipeliner, num_stages)


def pick_config(m: int, num_experts: int, n: int, k: int, transpose: bool, decode: str) -> TileConfig:
    """The tiling for M rows over E experts: a function of the shapes only, so an eager step and a captured
    one use the same kernel and give the same bits. BM: 16 for decode-sized groups (a few rows per expert), up
    to 128 when experts get many rows (each weight tile is decoded once per M-tile). Tiles of BM >= 64 (Hopper
    wgmma) are computed transposed (`swap`): there the decoded weights must be the dot's first operand, which
    wgmma reads from registers (Triton 3.6 fails to stage a register-computed second operand in shared
    memory). Sizes from benchmarks/bench_k3_layers_gpu.py --parts kernels on an H200 (K3 widths)."""
    rows_per_expert = m / max(1, num_experts)
    bm = 16 if rows_per_expert <= 16 else 32 if rows_per_expert <= 32 else 64 if rows_per_expert <= 48 else 128
    if bm <= 32 and not transpose:
        return TileConfig(bm, 128, 128, num_warps=4, num_stages=4, decode=decode, scale_2d=True, prefetch=False)
    if bm <= 32:
        return TileConfig(bm, 64, 128, num_warps=4, num_stages=4, decode=decode, swap=True, scale_2d=True,
                          prefetch=False)
    return TileConfig(bm, 64, 128, num_warps=4, num_stages=3, decode=decode, swap=True, scale_2d=True,
                      prefetch=False)


# ---- reference ---------------------------------------------------------------------------------------------
def _counts_list(counts: list[int] | torch.Tensor) -> list[int]:
    if isinstance(counts, torch.Tensor):
        return torch.diff(counts.cpu().long(), prepend=counts.new_zeros(1, device="cpu").long()).tolist()
    return list(counts)


def mxfp4_moe_matmul_reference(x_MK: torch.Tensor, counts: list[int] | torch.Tensor, packed_EOH: torch.Tensor,
                               scale_EOG: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """The definition on any device: per expert with rows, dequantize W_e to bf16 (`dequantize_mxfp4`), then an
    fp32 matmul of the bf16 x and W_e values; y [M, N] in x's dtype. counts: rows per expert (host list) or
    int32 cumulative ends [E]."""
    from miles_k3.mxfp4 import dequantize_mxfp4

    counts = _counts_list(counts)
    n = packed_EOH.shape[2] * 2 if transpose else packed_EOH.shape[1]
    y = torch.zeros(x_MK.shape[0], n, dtype=torch.float32, device=x_MK.device)
    r0 = 0
    for e, c in enumerate(counts):
        if c:
            w = dequantize_mxfp4(packed_EOH[e], scale_EOG[e], torch.bfloat16).float()
            xe = x_MK[r0:r0 + c].to(torch.bfloat16).float()
            y[r0:r0 + c] = xe @ w if transpose else xe @ w.t()
        r0 += c
    return y.to(x_MK.dtype)


# ---- kernel ------------------------------------------------------------------------------------------------
@triton.jit
def _tile_of(ends_ptr, t, num_experts, BM: tl.constexpr, BLOCK_E: tl.constexpr):
    """(expert, first row, row end) of M-tile t: experts' rows cut into ceil(count / BM) tiles, in expert
    order. expert >= num_experts when t is past the last tile."""
    e = tl.arange(0, BLOCK_E)
    ends = tl.load(ends_ptr + e, mask=e < num_experts, other=0)
    starts = tl.load(ends_ptr + e - 1, mask=(e >= 1) & (e < num_experts), other=0)
    tiles = (ends - starts + BM - 1) // BM
    cum = tl.cumsum(tiles, 0)
    expert = tl.sum((cum <= t).to(tl.int32), 0)
    sel = e == expert
    first_tile = tl.sum(tl.where(sel, cum - tiles, 0), 0)
    start = tl.sum(tl.where(sel, starts, 0), 0)
    end = tl.sum(tl.where(sel, ends, 0), 0)
    return expert, start + (t - first_tile) * BM, end


@triton.jit
def _decode_tl(b, s):
    """bf16 (lo-nibble, hi-nibble) values of bytes b (uint8) in blocks of scale bytes s (uint8, per byte):
    E2M1 magnitudes 2..7 are bf16 0x3F00 + (mag << 6), 0 and 1 (0.5) are 0 and 0x3F00; times 2^(s-127) in fp32
    (s = 0: 2^-127, a subnormal; s = 255: NaN)."""
    bi = b.to(tl.int32)
    ml = bi & 7
    mh = (bi >> 4) & 7
    lo = tl.where(ml < 2, ml * 0x3F00, 0x3F00 + (ml << 6)) | ((bi & 8) << 12)
    hi = tl.where(mh < 2, mh * 0x3F00, 0x3F00 + (mh << 6)) | ((bi & 0x80) << 8)
    si = s.to(tl.int32)
    f = tl.where(si == 0, 0x00400000, tl.where(si == 255, 0x7FC00000, si << 23)).to(tl.float32, bitcast=True)
    lo = (lo.to(tl.int16).to(tl.bfloat16, bitcast=True).to(tl.float32) * f).to(tl.bfloat16)
    hi = (hi.to(tl.int16).to(tl.bfloat16, bitcast=True).to(tl.float32) * f).to(tl.bfloat16)
    return lo, hi


# 4 bytes ($4) and their 4 scale bytes ($5) -> lo-nibble values ($0: bytes 0-1, $1: bytes 2-3, bf16x2) and
# hi-nibble values ($2, $3). t0 = b0 | b1 << 16, t1 = b2 | b3 << 16; each nibble's magnitude bits go to bf16 bits
# 6-8 and its sign to bit 15: the bf16 pattern of E2M1 * 2^-126 (code 1 becomes a subnormal); then
# * 2^126 and * 2^(s-127) (bf16 s << 7; max with 0x0040 makes s = 0 the subnormal 2^-127), both exact.
_DECODE_ASM = tl.constexpr("""
{
.reg .b32 t0, t1, f0, f1, u, v, z, k, m;
mov.b32 z, 0;
mov.b32 k, 0x7E807E80;
mov.b32 m, 0x00400040;
prmt.b32 t0, $4, z, 0x4140;
prmt.b32 t1, $4, z, 0x4342;
prmt.b32 f0, $5, z, 0x4140;
prmt.b32 f1, $5, z, 0x4342;
shl.b32 f0, f0, 7; max.u16x2 f0, f0, m;
shl.b32 f1, f1, 7; max.u16x2 f1, f1, m;
shl.b32 u, t0, 6;  and.b32 u, u, 0x01C001C0; shl.b32 v, t0, 12; and.b32 v, v, 0x80008000; or.b32 u, u, v;
mul.rn.bf16x2 u, u, k; mul.rn.bf16x2 $0, u, f0;
shl.b32 u, t1, 6;  and.b32 u, u, 0x01C001C0; shl.b32 v, t1, 12; and.b32 v, v, 0x80008000; or.b32 u, u, v;
mul.rn.bf16x2 u, u, k; mul.rn.bf16x2 $1, u, f1;
shl.b32 u, t0, 2;  and.b32 u, u, 0x01C001C0; shl.b32 v, t0, 8;  and.b32 v, v, 0x80008000; or.b32 u, u, v;
mul.rn.bf16x2 u, u, k; mul.rn.bf16x2 $2, u, f0;
shl.b32 u, t1, 2;  and.b32 u, u, 0x01C001C0; shl.b32 v, t1, 8;  and.b32 v, v, 0x80008000; or.b32 u, u, v;
mul.rn.bf16x2 u, u, k; mul.rn.bf16x2 $3, u, f1;
}
""")


@triton.jit
def _load_weight_tile(p_e, s_e, rows, row_mask, c0, groups_row, row_bytes, R: tl.constexpr, C: tl.constexpr,
                      SCALE_2D: tl.constexpr):
    """(bytes uint8 [R, C/2], each byte's scale byte uint8 [R, C/2]) of rows `rows` (masked by row_mask),
    columns c0 .. c0+C (multiples of 32) of one expert's weight (rows of row_bytes bytes, groups_row scale
    groups). SCALE_2D: the [R, C/32] scales are loaded once (contiguous, so Triton's cp.async pipeliner takes
    them) and broadcast to their 16 bytes in registers; else each byte's scale is loaded beside it (a 16-fold
    repeated address served by L1, no reshape). Masked bytes are 0 (they decode to 0)."""
    cb = c0 // 2 + tl.arange(0, C // 2)
    mask = row_mask[:, None] & (cb < row_bytes)[None, :]
    b = tl.load(p_e + rows[:, None] * row_bytes + cb[None, :], mask=mask, other=0)
    if SCALE_2D:
        g = c0 // 32 + tl.arange(0, C // 32)
        sg = tl.load(s_e + rows[:, None] * groups_row + g[None, :],
                     mask=row_mask[:, None] & (g < groups_row)[None, :], other=127)
        s = tl.reshape(tl.broadcast_to(sg[:, :, None], (R, C // 32, 16)), (R, C // 2))
    else:
        s = tl.load(s_e + rows[:, None] * groups_row + (cb // 16)[None, :], mask=mask, other=127)
    return b, s


@triton.jit
def _decode_tile(b, s, ASM: tl.constexpr):
    """bf16 [R, 2 * C2] of bytes b and scale bytes s (both uint8 [R, C2]), in element order."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(_DECODE_ASM, "=r,=r,=r,=r,r,r", [b, s],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        lo, hi = _decode_tl(b, s)
    return tl.interleave(lo, hi)


@triton.jit
def _load_step(x_rows, p_e, s_e, m_mask, offs_n, n_mask, n0, k0, n_red, groups_row, row_bytes,
               TRANS: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, SCALE_2D: tl.constexpr):
    """The loads of reduction step k0: (x tile [BM, BK], weight bytes, scale bytes); all masked past n_red."""
    offs_k = k0 + tl.arange(0, BK)
    k_mask = offs_k < n_red
    a = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
    if TRANS:  # W_e[k-tile, n-tile]: rows along O (the reduction), scale groups along the output columns
        b, s = _load_weight_tile(p_e, s_e, offs_k, k_mask, n0, groups_row, row_bytes, BK, BN, SCALE_2D)
    else:  # W_e[n-tile, k-tile]: rows along O (the outputs), scale groups along the reduction
        b, s = _load_weight_tile(p_e, s_e, offs_n, n_mask, k0, groups_row, row_bytes, BN, BK, SCALE_2D)
    return a, b, s


@triton.jit
def _mxfp4_moe_kernel(x_ptr, ends_ptr, packed_ptr, scale_ptr, y_ptr, num_experts, n_cols, n_red, row_bytes,
                      groups_row, expert_bytes, expert_groups,
                      TRANS: tl.constexpr, SWAP: tl.constexpr, ASM: tl.constexpr, DOT_F32: tl.constexpr,
                      SCALE_2D: tl.constexpr, PREFETCH: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                      BK: tl.constexpr, BLOCK_E: tl.constexpr):
    """Program (n-tile, M-tile t): y[rows of t, n-tile] = x[rows, :] @ W_e^T (TRANS: @ W_e). x [M, n_red],
    y [M, n_cols], both row-major; W_e at packed_ptr + e * expert_bytes (rows of row_bytes), scales likewise.
    PREFETCH pipelines the loop by hand: step k+1's loads are issued before step k's decode and dot (1-byte
    scale loads are too narrow for Triton's cp.async pipeliner); otherwise Triton pipelines it (num_stages).
    SWAP computes the transposed tile (W x^T), the decoded weights as the dot's first operand.
    DOT_F32 (the interpreter only, whose tl.dot multiplies bf16 bit patterns as integers): both dot operands
    are widened to fp32 first, which leaves every product exact as on the GPU."""
    pid_n = tl.program_id(0)
    t = tl.program_id(1)
    expert, row0, row_end = _tile_of(ends_ptr, t, num_experts, BM, BLOCK_E)
    if expert >= num_experts:
        return
    p_e = packed_ptr + expert.to(tl.int64) * expert_bytes
    s_e = scale_ptr + expert.to(tl.int64) * expert_groups
    offs_m = row0 + tl.arange(0, BM)
    m_mask = offs_m < row_end
    n0 = pid_n * BN
    offs_n = n0 + tl.arange(0, BN)
    n_mask = offs_n < n_cols
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * n_red
    if SWAP:
        acc = tl.zeros([BN, BM], dtype=tl.float32)
    else:
        acc = tl.zeros([BM, BN], dtype=tl.float32)
    if PREFETCH:
        a, b, s = _load_step(x_rows, p_e, s_e, m_mask, offs_n, n_mask, n0, 0, n_red, groups_row, row_bytes,
                             TRANS, BK, BN, SCALE_2D)
    for k0 in range(0, n_red, BK):
        if PREFETCH:
            a_next, b_next, s_next = _load_step(x_rows, p_e, s_e, m_mask, offs_n, n_mask, n0, k0 + BK, n_red,
                                                groups_row, row_bytes, TRANS, BK, BN, SCALE_2D)
        else:
            a, b, s = _load_step(x_rows, p_e, s_e, m_mask, offs_n, n_mask, n0, k0, n_red, groups_row, row_bytes,
                                 TRANS, BK, BN, SCALE_2D)
        w = _decode_tile(b, s, ASM)  # TRANS: [BK, BN]; else [BN, BK]
        if DOT_F32:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        if TRANS:
            if SWAP:
                acc = tl.dot(tl.trans(w), tl.trans(a), acc)
            else:
                acc = tl.dot(a, w, acc)
        else:
            if SWAP:
                acc = tl.dot(w, tl.trans(a), acc)
            else:
                acc = tl.dot(a, tl.trans(w), acc)
        if PREFETCH:
            a, b, s = a_next, b_next, s_next
    out = y_ptr + offs_m.to(tl.int64)[:, None] * n_cols + offs_n[None, :]
    if SWAP:
        tl.store(out, tl.trans(acc).to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])
    else:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


# ---- launcher ----------------------------------------------------------------------------------------------
def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check_inputs(fn: str, x_MK: torch.Tensor, packed_EOH: torch.Tensor, scale_EOG: torch.Tensor,
                  transpose: bool) -> tuple[int, int]:
    """Validate dtypes, shapes and devices; return (N, K)."""
    if not isinstance(x_MK, torch.Tensor) or x_MK.dim() != 2 or x_MK.dtype not in ACT_DTYPES:
        raise ValueError(f"{fn}: x_MK must be a 2-d torch.bfloat16 tensor [M, K], got "
                         f"{getattr(x_MK, 'dtype', type(x_MK))} {tuple(getattr(x_MK, 'shape', ()))}; "
                         "use mxfp4_moe_matmul_reference for other dtypes")
    if packed_EOH.dtype != torch.uint8 or scale_EOG.dtype != torch.uint8 or packed_EOH.dim() != 3:
        raise ValueError(f"{fn}: packed must be uint8 [E, O, In/2] and scale uint8 [E, O, In/32], got "
                         f"{packed_EOH.dtype} {tuple(packed_EOH.shape)}, {scale_EOG.dtype} {tuple(scale_EOG.shape)}")
    e, o, half = packed_EOH.shape
    if half % 16 or tuple(scale_EOG.shape) != (e, o, half * 2 // GROUP_SIZE):
        raise ValueError(f"{fn}: scale {tuple(scale_EOG.shape)} must be [E, O, In/32] = {(e, o, half * 2 // 32)} "
                         f"for packed {tuple(packed_EOH.shape)} (In a multiple of 32)")
    if not packed_EOH.is_contiguous() or not scale_EOG.is_contiguous():
        raise ValueError(f"{fn}: packed and scale must be contiguous; call .contiguous()")
    n, k = (half * 2, o) if transpose else (o, half * 2)
    if x_MK.shape[1] != k:
        raise ValueError(f"{fn}: x_MK has {x_MK.shape[1]} columns, the {'O' if transpose else 'In'} width of the "
                         f"weights is {k} (transpose={transpose})")
    if not _interpreting() and not x_MK.is_cuda:
        raise ValueError(f"{fn}: x_MK must be a CUDA tensor, got {x_MK.device}; use mxfp4_moe_matmul_reference")
    if not (x_MK.device == packed_EOH.device == scale_EOG.device):
        raise ValueError(f"{fn}: x ({x_MK.device}), packed ({packed_EOH.device}) and scale ({scale_EOG.device}) "
                         "must be on one device")
    return n, k


def mxfp4_moe_matmul(x_MK: torch.Tensor, counts: list[int] | torch.Tensor, packed_EOH: torch.Tensor,
                     scale_EOG: torch.Tensor, transpose: bool = False, decode: str | None = None,
                     config: TileConfig | None = None) -> torch.Tensor:
    """y [M, N] (bf16) = grouped x @ W_e^T (or x @ W_e with `transpose`), equal to
    `mxfp4_moe_matmul_reference` up to fp32 accumulation order (module docstring).

    x_MK: bf16 [M, In] (transpose: [M, O]) on CUDA, rows grouped by expert; counts: rows per expert (host list
    of E ints summing to M) or the int32 cumulative row ends [E] on x's device (sync-free: nothing is read on
    the host, capturable in a CUDA graph once compiled). packed_EOH uint8 [E, O, In/2], scale_EOG uint8
    [E, O, In/32], contiguous. decode: "asm" (CUDA default) or "tl" (the interpreter's); config: a TileConfig
    (default `pick_config`).
    """
    fn = "mxfp4_moe_matmul"
    n, k = _check_inputs(fn, x_MK, packed_EOH, scale_EOG, transpose)
    num_experts, o, half = packed_EOH.shape
    m = x_MK.shape[0]
    if isinstance(counts, torch.Tensor):
        if counts.dtype != torch.int32 or tuple(counts.shape) != (num_experts,) or counts.device != x_MK.device:
            raise ValueError(f"{fn}: device counts must be the int32 cumulative row ends [E={num_experts}] on "
                             f"{x_MK.device}, got {counts.dtype} {tuple(counts.shape)} on {counts.device}")
        ends_E, num_tiles = counts, None
    else:
        if len(counts) != num_experts or sum(counts) != m or min(counts, default=0) < 0:
            raise ValueError(f"{fn}: counts must be {num_experts} non-negative ints summing to M={m}, got "
                             f"{len(counts)} summing to {sum(counts)}")
        ends_E = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(x_MK.device,
                                                                                        non_blocking=True)
        num_tiles = counts  # resolved below, once BM is known
    decode = decode or ("tl" if _interpreting() else "asm")
    if decode not in DECODES:
        raise ValueError(f"{fn}: decode must be one of {DECODES}, got {decode!r}")
    cfg = config or pick_config(m, num_experts, n, k, transpose, decode)
    if cfg.decode == "asm" and _interpreting():
        raise ValueError(f"{fn}: decode='asm' (inline PTX) cannot run under TRITON_INTERPRET=1; use 'tl'")
    if (cfg.bk if not transpose else cfg.bn) % GROUP_SIZE:
        raise ValueError(f"{fn}: the tile's extent along In must be a multiple of 32, got {cfg}")
    y = torch.empty(m, n, dtype=x_MK.dtype, device=x_MK.device)
    if m == 0:
        return y
    if num_tiles is not None:
        grid_m = sum(-(-c // cfg.bm) for c in num_tiles)
    else:
        grid_m = -(-m // cfg.bm) + min(num_experts, m)
    grid = (triton.cdiv(n, cfg.bn), grid_m)
    x = x_MK.contiguous()
    args = (x, ends_E, packed_EOH, scale_EOG, y, num_experts, n, k, half, half * 2 // GROUP_SIZE, o * half,
            o * half * 2 // GROUP_SIZE)
    meta = {"TRANS": transpose, "SWAP": cfg.swap, "ASM": cfg.decode == "asm",
            "DOT_F32": _interpreting(),
            "SCALE_2D": cfg.scale_2d, "PREFETCH": cfg.prefetch, "BM": cfg.bm, "BN": cfg.bn, "BK": cfg.bk,
            "BLOCK_E": triton.next_power_of_2(num_experts), "num_warps": cfg.num_warps,
            "num_stages": cfg.num_stages}
    if x.is_cuda:
        with torch.cuda.device(x.device):
            _mxfp4_moe_kernel[grid](*args, **meta)
    else:
        _mxfp4_moe_kernel[grid](*args, **meta)
    return y
