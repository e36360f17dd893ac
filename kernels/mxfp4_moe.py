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
  * FAST (constexpr; "asm" and "tl"): ONE multiply per bf16x2 pair instead of two: the nibble pattern
    E2M1(code) * 2^-126 times 2^(s-1), whose bf16 pattern (s + 126) << 7 is computed once per scale group
    (`_DECODE_ASM_FAST`; the bytes are also placed so that a hi nibble's sign is already bf16 bit 15). Exact
    for scale bytes 0..128 (2^(s-1) is a bf16 number); the kernel keeps the running max of the scale bytes a
    tile read, and a tile that read any byte above 128 (a weight above 2^2 * 6, or a NaN block) is computed
    again by the general decode: bit for bit the general decode's result, no host check (capturable).
  * SPLIT (constexpr): the lo/hi-nibble halves are not interleaved; they feed two dots, forward over the even
    and the odd reduction columns of x (two accumulators, summed at the end), transposed into the even and the
    odd output columns (interleaved once, at the store).
The decode costs integer-ALU time per weight element per M-tile, so BM is as large as the rows per expert allow
(`pick_config`). In a decode step (a few rows per expert) it is the kernel's limit, ahead of HBM: the compiled
sm_90 loop issues ~6.9 instructions per weight element with the general decode and interleave, ~4.0 with
FAST + SPLIT (what `pick_config` takes there).

Decode (CUDA graphs): the same kernel with BM = 16, BN = 256, FAST + SPLIT (a decode step routes a few rows to
each expert); `ends_E` on
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
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from miles_k3.kernels.mxfp4 import GROUP_SIZE, dequantize_mxfp4_reference

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
    fast: bool = False  # one-multiply decode, exact for scale bytes <= 128, other tiles recomputed (needs scale_2d)
    split: bool = False  # lo/hi-nibble halves into two dots, no interleave (`_mma_step`)


def pick_config(m: int, num_experts: int, n: int, k: int, transpose: bool, decode: str) -> TileConfig:
    """The tiling of `mxfp4_moe_matmul` (`_tiling`)."""
    return _tiling(m, num_experts, n, k, transpose, decode)


def _tiling(m: int, num_experts: int, n: int, k: int, transpose: bool, decode: str) -> TileConfig:
    """The tiling for M rows over E experts: a function of the shapes only, so an eager step and a captured
    one use the same kernel and give the same bits. BM: 16 for decode-sized groups (a few rows per expert), up
    to 128 when experts get many rows (each weight tile is decoded once per M-tile). Tiles of BM >= 64 (Hopper
    wgmma) are computed transposed (`swap`): there the decoded weights must be the dot's first operand, which
    wgmma reads from registers (Triton 3.6 fails to stage a register-computed second operand in shared
    memory). Every tiling takes the one-multiply decode (`fast`); the decode-sized forward also feeds the
    lo/hi-nibble halves to two dots (`split`): the weight decode is the kernel's critical path there (an
    instruction-issue limit, not HBM: ~6.9 SASS instructions per weight element in the compiled sm_90 loop
    before, ~4.0 after). Sizes from benchmarks/bench_k3_layers_gpu.py --parts kernels on an H200 (K3 widths,
    one projection O 3072 x In 3584): decode forward at batch 64 / 256, 2.20 / 3.21 ms before (BN 128, general
    decode), 1.78 / 2.56 ms (BN 256, fast, split); training (4,096 tokens, BM 128) forward 8.73 -> 8.26 ms
    (BN 128, 8 warps, fast), input gradient 9.80 -> 8.72 ms (fast)."""
    rows_per_expert = m / max(1, num_experts)
    bm = 16 if rows_per_expert <= 16 else 32 if rows_per_expert <= 32 else 64 if rows_per_expert <= 48 else 128
    if bm <= 32 and not transpose:
        return TileConfig(bm, 256, 128, num_warps=4, num_stages=3, decode=decode, scale_2d=True, prefetch=False,
                          fast=True, split=True)
    if bm <= 32:
        return TileConfig(bm, 64, 128, num_warps=4, num_stages=4, decode=decode, swap=True, scale_2d=True,
                          prefetch=False, fast=True)
    if bm == 128 and not transpose:
        return TileConfig(bm, 128, 128, num_warps=8, num_stages=3, decode=decode, swap=True, scale_2d=True,
                          prefetch=False, fast=True)
    return TileConfig(bm, 64, 128, num_warps=4, num_stages=3, decode=decode, swap=True, scale_2d=True,
                      prefetch=False, fast=True)


def legacy_config(m: int, num_experts: int, n: int, k: int, transpose: bool, decode: str) -> TileConfig:
    """`pick_config` before the fast decode (two multiplies per pair, interleaved halves): kept for the
    benchmark's before/after rows and the parity tests."""
    cfg = replace(_tiling(m, num_experts, n, k, transpose, decode), fast=False, split=False)
    if cfg.bm <= 32 and not transpose:
        cfg = replace(cfg, bn=128, num_stages=4)
    if cfg.bm == 128 and not transpose:
        cfg = replace(cfg, bn=64, num_warps=4)
    return cfg


# ---- reference ---------------------------------------------------------------------------------------------
def _counts_list(counts: list[int] | torch.Tensor) -> list[int]:
    if isinstance(counts, torch.Tensor):
        return torch.diff(counts.cpu().long(), prepend=counts.new_zeros(1, device="cpu").long()).tolist()
    return list(counts)


def mxfp4_moe_matmul_reference(x_MK: torch.Tensor, counts: list[int] | torch.Tensor, packed_EOH: torch.Tensor,
                               scale_EOG: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """The definition on any device: per expert with rows, dequantize W_e to bf16 (the pure-torch
    `dequantize_mxfp4_reference`, bitwise equal to the Triton decode), then an fp32 matmul of the bf16 x and
    W_e values; y [M, N] in x's dtype. counts: rows per expert (host list) or int32 cumulative ends [E]."""
    counts = _counts_list(counts)
    n = packed_EOH.shape[2] * 2 if transpose else packed_EOH.shape[1]
    y = torch.zeros(x_MK.shape[0], n, dtype=torch.float32, device=x_MK.device)
    r0 = 0
    for e, c in enumerate(counts):
        if c:
            w = dequantize_mxfp4_reference(packed_EOH[e], scale_EOG[e], torch.bfloat16).float()
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


# The fast decode (FAST): 4 bytes ($4) and their 4 per-byte scale words ($5..$8, int32: the bf16 pattern of
# 2^(s-1), (s + 126) << 7, in both halves) -> the same four bf16x2 outputs as _DECODE_ASM with ONE multiply per
# pair: the nibble pattern E2M1 * 2^-126 times 2^(s-1) (exact; representable for s <= 128, the kernel recomputes
# a tile with any larger scale byte by the general decode). t0 = b0 << 8 | b1 << 24 (t1: b2, b3): a hi nibble's
# sign is then bf16 bit 15 already and its magnitude goes down by 6; a lo nibble's sign up by 4, magnitude down
# by 2 (the hi nibble of byte 0 that t0 << 4 carries into bits 16-19 is masked off). prmt pairs byte i's and
# byte i+1's scale words.
_DECODE_ASM_FAST = tl.constexpr("""
{
.reg .b32 t0, t1, f0, f1, u, v, z;
mov.b32 z, 0;
prmt.b32 t0, $4, z, 0x1404;
prmt.b32 t1, $4, z, 0x3424;
prmt.b32 f0, $5, $6, 0x5410;
prmt.b32 f1, $7, $8, 0x5410;
shl.b32 v, t0, 4; shr.b32 u, t0, 2; and.b32 u, u, 0x01C001C0; and.b32 v, v, 0x80008000; or.b32 u, u, v;
mul.rn.bf16x2 $0, u, f0;
shl.b32 v, t1, 4; shr.b32 u, t1, 2; and.b32 u, u, 0x01C001C0; and.b32 v, v, 0x80008000; or.b32 u, u, v;
mul.rn.bf16x2 $1, u, f1;
shr.b32 u, t0, 6; and.b32 u, u, 0x01C001C0; and.b32 v, t0, 0x80008000; or.b32 u, u, v;
mul.rn.bf16x2 $2, u, f0;
shr.b32 u, t1, 6; and.b32 u, u, 0x01C001C0; and.b32 v, t1, 0x80008000; or.b32 u, u, v;
mul.rn.bf16x2 $3, u, f1;
}
""")


@triton.jit
def _load_weight_tile(p_e, s_e, rows, row_mask, c0, groups_row, row_bytes, R: tl.constexpr, C: tl.constexpr,
                      SCALE_2D: tl.constexpr, FAST: tl.constexpr):
    """(bytes uint8 [R, C/2], each byte's scale, the scale bytes) of rows `rows` (masked by row_mask), columns
    c0 .. c0+C (multiples of 32) of one expert's weight (rows of row_bytes bytes, groups_row scale groups).
    SCALE_2D: the [R, C/32] scale bytes are loaded once (contiguous, so Triton's cp.async pipeliner takes them)
    and broadcast to their 16 bytes in registers; else each byte's scale is loaded beside it (a 16-fold
    repeated address served by L1, no reshape). FAST (needs SCALE_2D): each byte's scale is the int32 word of
    the fast decode (bf16 2^(s-1) in both halves), computed once per group. Masked bytes are 0 (they decode
    to 0 whatever their scale)."""
    cb = c0 // 2 + tl.arange(0, C // 2)
    mask = row_mask[:, None] & (cb < row_bytes)[None, :]
    b = tl.load(p_e + rows[:, None] * row_bytes + cb[None, :], mask=mask, other=0)
    if SCALE_2D:
        g = c0 // 32 + tl.arange(0, C // 32)
        s_ptrs = s_e + rows[:, None] * groups_row + g[None, :]
        s_mask = row_mask[:, None] & (g < groups_row)[None, :]
        if FAST:
            sg = tl.load(s_ptrs, mask=s_mask, other=0)
            f = ((sg.to(tl.int32) << 7) + 0x3F00) * 0x10001
            s = tl.reshape(tl.broadcast_to(f[:, :, None], (R, C // 32, 16)), (R, C // 2))
        else:
            sg = tl.load(s_ptrs, mask=s_mask, other=127)
            s = tl.reshape(tl.broadcast_to(sg[:, :, None], (R, C // 32, 16)), (R, C // 2))
    else:
        s = tl.load(s_e + rows[:, None] * groups_row + (cb // 16)[None, :], mask=mask, other=127)
        sg = s
    return b, s, sg


@triton.jit
def _decode_tl_fast(b, f):
    """The "tl" twin of _DECODE_ASM_FAST (the interpreter's): E2M1(code) as a normal bf16 number (as
    `_decode_tl`; the interpreter flushes bf16 subnormals) times 2^(s-1) (f's low half, bf16) times 2^-126 in
    fp32: the same value as the GPU's one bf16 multiply whenever that is exact (s <= 128)."""
    bi = b.to(tl.int32)
    ml = bi & 7
    mh = (bi >> 4) & 7
    lo = tl.where(ml < 2, ml * 0x3F00, 0x3F00 + (ml << 6)) | ((bi & 8) << 12)
    hi = tl.where(mh < 2, mh * 0x3F00, 0x3F00 + (mh << 6)) | ((bi & 0x80) << 8)
    fs = (f & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True).to(tl.float32) * 1.1754943508222875e-38
    lo = (lo.to(tl.int16).to(tl.bfloat16, bitcast=True).to(tl.float32) * fs).to(tl.bfloat16)
    hi = (hi.to(tl.int16).to(tl.bfloat16, bitcast=True).to(tl.float32) * fs).to(tl.bfloat16)
    return lo, hi


@triton.jit
def _decode_halves(b, s, ASM: tl.constexpr, FAST: tl.constexpr):
    """bf16 (lo-nibble, hi-nibble) values [R, C2] of bytes b (uint8 [R, C2]) and their scales s (uint8 bytes,
    or FAST: int32 factor words): elements 2j and 2j+1 of the tile."""
    if ASM:
        if FAST:
            lo, hi = tl.inline_asm_elementwise(_DECODE_ASM_FAST, "=r,=r,=r,=r,r,r,r,r,r", [b, s],
                                               dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        else:
            lo, hi = tl.inline_asm_elementwise(_DECODE_ASM, "=r,=r,=r,=r,r,r", [b, s],
                                               dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        if FAST:
            lo, hi = _decode_tl_fast(b, s)
        else:
            lo, hi = _decode_tl(b, s)
    return lo, hi


@triton.jit
def _decode_tile(b, s, ASM: tl.constexpr, FAST: tl.constexpr):
    """bf16 [R, 2 * C2] of bytes b (uint8 [R, C2]) and their scales s (`_decode_halves`), in element order."""
    lo, hi = _decode_halves(b, s, ASM, FAST)
    return tl.interleave(lo, hi)


@triton.jit
def _load_step(x_rows, p_e, s_e, m_mask, offs_n, n_mask, n0, k0, n_red, groups_row, row_bytes,
               TRANS: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, SCALE_2D: tl.constexpr,
               FAST: tl.constexpr):
    """The loads of reduction step k0: (x tile [BM, BK], weight bytes, scales, scale bytes); masked past n_red."""
    offs_k = k0 + tl.arange(0, BK)
    k_mask = offs_k < n_red
    a = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
    if TRANS:  # W_e[k-tile, n-tile]: rows along O (the reduction), scale groups along the output columns
        b, s, sg = _load_weight_tile(p_e, s_e, offs_k, k_mask, n0, groups_row, row_bytes, BK, BN, SCALE_2D, FAST)
    else:  # W_e[n-tile, k-tile]: rows along O (the outputs), scale groups along the reduction
        b, s, sg = _load_weight_tile(p_e, s_e, offs_n, n_mask, k0, groups_row, row_bytes, BN, BK, SCALE_2D, FAST)
    return a, b, s, sg


@triton.jit
def _mma_step(acc0, acc1, a, b, s, TRANS: tl.constexpr, SWAP: tl.constexpr, ASM: tl.constexpr,
              FAST: tl.constexpr, SPLIT: tl.constexpr, DOT_F32: tl.constexpr, BM: tl.constexpr,
              BK: tl.constexpr):
    """One reduction step: decode the weight tile and accumulate. SPLIT: no interleave of the lo/hi-nibble
    halves; forward: two dots over the even and odd reduction columns (acc0 + acc1 is the result); transposed:
    acc0/acc1 hold the even/odd output columns. Else one dot of the interleaved tile into acc0."""
    if SPLIT:
        lo, hi = _decode_halves(b, s, ASM, FAST)  # forward: [BN, BK/2]; TRANS: [BK, BN/2]
        if DOT_F32:
            lo = lo.to(tl.float32)
            hi = hi.to(tl.float32)
        if TRANS:
            if DOT_F32:
                a = a.to(tl.float32)
            if SWAP:
                acc0 = tl.dot(tl.trans(lo), tl.trans(a), acc0)
                acc1 = tl.dot(tl.trans(hi), tl.trans(a), acc1)
            else:
                acc0 = tl.dot(a, lo, acc0)
                acc1 = tl.dot(a, hi, acc1)
        else:
            a_even, a_odd = tl.split(tl.reshape(a, (BM, BK // 2, 2)))
            if DOT_F32:
                a_even = a_even.to(tl.float32)
                a_odd = a_odd.to(tl.float32)
            if SWAP:
                acc0 = tl.dot(lo, tl.trans(a_even), acc0)
                acc1 = tl.dot(hi, tl.trans(a_odd), acc1)
            else:
                acc0 = tl.dot(a_even, tl.trans(lo), acc0)
                acc1 = tl.dot(a_odd, tl.trans(hi), acc1)
    else:
        w = _decode_tile(b, s, ASM, FAST)  # TRANS: [BK, BN]; else [BN, BK]
        if DOT_F32:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        if TRANS:
            if SWAP:
                acc0 = tl.dot(tl.trans(w), tl.trans(a), acc0)
            else:
                acc0 = tl.dot(a, w, acc0)
        else:
            if SWAP:
                acc0 = tl.dot(w, tl.trans(a), acc0)
            else:
                acc0 = tl.dot(a, tl.trans(w), acc0)
    return acc0, acc1


@triton.jit
def _accumulate(x_rows, p_e, s_e, m_mask, offs_n, n_mask, n0, n_red, groups_row, row_bytes,
                TRANS: tl.constexpr, SWAP: tl.constexpr, ASM: tl.constexpr, FAST: tl.constexpr,
                SPLIT: tl.constexpr, DOT_F32: tl.constexpr, SCALE_2D: tl.constexpr, PREFETCH: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """The reduction loop: (acc0, acc1, the running max of the scale bytes read; FAST only)."""
    if TRANS and SPLIT:  # even / odd output columns
        if SWAP:
            acc0 = tl.zeros([BN // 2, BM], dtype=tl.float32)
        else:
            acc0 = tl.zeros([BM, BN // 2], dtype=tl.float32)
    else:
        if SWAP:
            acc0 = tl.zeros([BN, BM], dtype=tl.float32)
        else:
            acc0 = tl.zeros([BM, BN], dtype=tl.float32)
    acc1 = tl.zeros_like(acc0)
    if TRANS:
        smax = tl.zeros([BK, BN // 32], dtype=tl.uint8)
    else:
        smax = tl.zeros([BN, BK // 32], dtype=tl.uint8)
    if PREFETCH:
        a, b, s, sg = _load_step(x_rows, p_e, s_e, m_mask, offs_n, n_mask, n0, 0, n_red, groups_row, row_bytes,
                                 TRANS, BK, BN, SCALE_2D, FAST)
    for k0 in range(0, n_red, BK):
        if PREFETCH:
            a_next, b_next, s_next, sg_next = _load_step(x_rows, p_e, s_e, m_mask, offs_n, n_mask, n0, k0 + BK,
                                                         n_red, groups_row, row_bytes, TRANS, BK, BN, SCALE_2D,
                                                         FAST)
        else:
            a, b, s, sg = _load_step(x_rows, p_e, s_e, m_mask, offs_n, n_mask, n0, k0, n_red, groups_row,
                                     row_bytes, TRANS, BK, BN, SCALE_2D, FAST)
        if FAST:
            smax = tl.maximum(smax, sg)
        acc0, acc1 = _mma_step(acc0, acc1, a, b, s, TRANS, SWAP, ASM, FAST, SPLIT, DOT_F32, BM, BK)
        if PREFETCH:
            a, b, s, sg = a_next, b_next, s_next, sg_next
    return acc0, acc1, smax


@triton.jit
def _mxfp4_moe_kernel(x_ptr, ends_ptr, packed_ptr, scale_ptr, y_ptr, num_experts, n_cols, n_red, row_bytes,
                      groups_row, expert_bytes, expert_groups,
                      TRANS: tl.constexpr, SWAP: tl.constexpr, ASM: tl.constexpr, DOT_F32: tl.constexpr,
                      SCALE_2D: tl.constexpr, PREFETCH: tl.constexpr, FAST: tl.constexpr, SPLIT: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BLOCK_E: tl.constexpr):
    """Program (n-tile, M-tile t): y[rows of t, n-tile] = x[rows, :] @ W_e^T (TRANS: @ W_e). x [M, n_red],
    y [M, n_cols], both row-major; W_e at packed_ptr + e * expert_bytes (rows of row_bytes), scales likewise.
    PREFETCH pipelines the loop by hand: step k+1's loads are issued before step k's decode and dot (1-byte
    scale loads are too narrow for Triton's cp.async pipeliner); otherwise Triton pipelines it (num_stages).
    SWAP computes the transposed tile (W x^T), the decoded weights as the dot's first operand.
    FAST: the one-multiply decode (exact for scale bytes <= 128); a tile that read a larger scale byte is
    computed again by the general decode (no host check, so capturable). SPLIT: the lo/hi-nibble halves feed
    two dots (no interleave in the loop; `_mma_step`).
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
    acc0, acc1, smax = _accumulate(x_rows, p_e, s_e, m_mask, offs_n, n_mask, n0, n_red, groups_row, row_bytes,
                                   TRANS, SWAP, ASM, FAST, SPLIT, DOT_F32, SCALE_2D, PREFETCH, BM, BN, BK)
    if FAST:  # noqa: SIM102 - a constexpr branch: the reduction exists only in FAST kernels
        if tl.max(smax) > 128:  # 2^(s-1) is not a bf16 number: this tile again, by the general decode
            acc0, acc1, smax = _accumulate(x_rows, p_e, s_e, m_mask, offs_n, n_mask, n0, n_red, groups_row,
                                           row_bytes, TRANS, SWAP, ASM, False, SPLIT, DOT_F32, SCALE_2D,
                                           PREFETCH, BM, BN, BK)
    if SWAP:
        acc0 = tl.trans(acc0)
        acc1 = tl.trans(acc1)
    if SPLIT:
        if TRANS:  # even and odd output columns
            acc = tl.interleave(acc0, acc1)
        else:
            acc = acc0 + acc1
    else:
        acc = acc0
    out = y_ptr + offs_m.to(tl.int64)[:, None] * n_cols + offs_n[None, :]
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
    if cfg.fast and not cfg.scale_2d:
        raise ValueError(f"{fn}: the fast decode needs scale_2d, got {cfg}")
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
            "SCALE_2D": cfg.scale_2d, "PREFETCH": cfg.prefetch, "FAST": cfg.fast, "SPLIT": cfg.split, "BM": cfg.bm, "BN": cfg.bn, "BK": cfg.bk,
            "BLOCK_E": triton.next_power_of_2(num_experts), "num_warps": cfg.num_warps,
            "num_stages": cfg.num_stages}
    if x.is_cuda:
        with torch.cuda.device(x.device):
            _mxfp4_moe_kernel[grid](*args, **meta)
    else:
        _mxfp4_moe_kernel[grid](*args, **meta)
    return y
