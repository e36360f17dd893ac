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
    (`mxfp4_moe_kernel._DECODE_ASM_FAST`; the bytes are also placed so that a hi nibble's sign is already bf16 bit 15). Exact
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

Chunked tiling (`TileConfig.chunks`; the kernel is `mxfp4_moe_chunked.py`). Triton's block shapes are
powers of two, so at K3 training width (4,096 tokens, top-16 over 896 experts: ~73 rows per expert) a BM = 128 tile
pads the MMA 1.75x. With chunks (C1, C2, C3), powers of two >= 16 with C1 >= C2 >= C3 (e.g. 64, 32, 16), a program
takes a group of up to G = C1 + C2 + C3 rows of one expert (bm = G, which need not be a power of two: the groups are
cut as the M-tiles above), decodes each weight tile once and multiplies it with up to three row chunks, each with
its own [BN, Ci] accumulator (swap orientation). For a group of n rows: chunk 1, rows [0, C1), is used when
n > C2 + C3; chunk 2 starts after chunk 1 if that is used (else at row 0) and is used when the rows left exceed C3;
chunk 3 takes what is left (`chunk_plan`, the kernel's own rule run on ints). With (64, 32, 16) the MMA width is n
rounded up to a multiple of 16: 73 rows -> chunks 1 and 3 (80 wide, not 128), 40 -> 2 and 3 (48), 50 -> 1 (64).
A chunk a group does not use loads and multiplies nothing: the choice is made once per group, outside the k-loop,
among 7 loops specialised to their chunks (a runtime branch around the dots inside the k-loop turns Triton's
software pipeliner off for the whole loop: no cp.async loads and synchronous wgmma in the sm_90 TTGIR of Triton 3.6
and 3.9); the price is compile time (~6-12 s a kernel on a CPU, ~1.5 s for the M-tile kernel). Swap tiles only, no
SPLIT, no hand prefetch (refused). `pick_config` takes it for 49..112 rows per expert, where an H100 measured it
faster than every BM = 128 tiling (benchmarks/bench_k3_layers_gpu.py --parts kernels; numbers in `_tiling`).

Numerics: the products of bf16 x and exact bf16 weights are exact in fp32; only the order of the fp32
accumulation differs from the reference (dequantize, then an fp32 matmul of the same bf16 values), so results
agree to fp32 accumulation error before the single rounding to bf16 (tests/kernels/test_gpu_mxfp4_moe.py states the
criterion).

Legend: M rows (token-expert pairs), E experts, O/In a projection's output/input width, K the reduction width
(In forward, O backward), N the output width (O forward, In backward), G scale groups of 32.
The Triton kernels themselves are `mxfp4_moe_kernel.py` and `mxfp4_moe_chunked.py`. This module imports torch and
triton only; launching a kernel needs CUDA (or `TRITON_INTERPRET=1`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import triton

from miles_k3.kernels.mxfp4 import GROUP_SIZE, dequantize_mxfp4_reference
from miles_k3.kernels.mxfp4_moe_chunked import _chunk_rule, _mxfp4_moe_chunked_kernel
from miles_k3.kernels.mxfp4_moe_kernel import _mxfp4_moe_kernel

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
    split: bool = False  # lo/hi-nibble halves into two dots, no interleave (`mxfp4_moe_kernel._mma_step`)
    chunks: tuple[int, int, int] | None = None  # the chunked kernel's row chunks (C1, C2, C3), bm = their sum


def chunk_plan(n: int, chunks: tuple[int, int, int]) -> tuple[tuple[int, int], ...]:
    """The row chunks the chunked kernel multiplies for a group of n rows (1 <= n <= sum(chunks)): (first row in
    the group, width) of each chunk used, in order; the widths sum to the group's MMA width. The kernel's own rule
    (`mxfp4_moe_chunked._chunk_rule`) run on Python ints."""
    if not 1 <= n <= sum(chunks):
        raise ValueError(f"chunk_plan: a group has 1..{sum(chunks)} rows for chunks {chunks}, got n={n}")
    use1, use2, use3, base, base2 = _chunk_rule.fn(n, *chunks)
    return tuple((int(r), c) for used, r, c in zip((use1, use2, use3), (0, base, base2), chunks) if used)


def pick_config(m: int, num_experts: int, n: int, k: int, transpose: bool, decode: str) -> TileConfig:
    """The tiling of `mxfp4_moe_matmul` (`_tiling`)."""
    return _tiling(m, num_experts, n, k, transpose, decode)


def _tiling(m: int, num_experts: int, n: int, k: int, transpose: bool, decode: str,
            chunked: bool = True) -> TileConfig:
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
    (BN 128, 8 warps, fast), input gradient 9.80 -> 8.72 ms (fast). Groups of 49..112 rows per expert (training
    at 4,096 tokens: ~73) take the chunked kernel (`chunks` 64 + 32 + 16, BN 64, 4 warps): on an H100, one
    projection forward 8.16 -> 6.64 ms (best BM-128 tiling -> chunked), input gradient 8.65 -> 7.50 ms; above 112
    rows per expert (not measured with chunks) BM stays 128. `chunked=False`: the tiling before the chunks."""
    rows_per_expert = m / max(1, num_experts)
    bm = 16 if rows_per_expert <= 16 else 32 if rows_per_expert <= 32 else 64 if rows_per_expert <= 48 else 128
    if bm <= 32 and not transpose:
        return TileConfig(bm, 256, 128, num_warps=4, num_stages=3, decode=decode, scale_2d=True, prefetch=False,
                          fast=True, split=True)
    if bm <= 32:
        return TileConfig(bm, 64, 128, num_warps=4, num_stages=4, decode=decode, swap=True, scale_2d=True,
                          prefetch=False, fast=True)
    if chunked and bm == 128 and rows_per_expert <= 112:
        return TileConfig(112, 64, 128, num_warps=4, num_stages=3, decode=decode, swap=True, scale_2d=True,
                          prefetch=False, fast=True, chunks=(64, 32, 16))
    if bm == 128 and not transpose:
        return TileConfig(bm, 128, 128, num_warps=8, num_stages=3, decode=decode, swap=True, scale_2d=True,
                          prefetch=False, fast=True)
    return TileConfig(bm, 64, 128, num_warps=4, num_stages=3, decode=decode, swap=True, scale_2d=True,
                      prefetch=False, fast=True)


def legacy_config(m: int, num_experts: int, n: int, k: int, transpose: bool, decode: str) -> TileConfig:
    """`pick_config` before the fast decode (two multiplies per pair, interleaved halves): kept for the
    benchmark's before/after rows and the parity tests."""
    cfg = replace(_tiling(m, num_experts, n, k, transpose, decode, chunked=False), fast=False, split=False)
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
    _check_config(fn, cfg, transpose)
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
    kernel, meta = _kernel_and_meta(cfg, transpose, num_experts)
    if x.is_cuda:
        with torch.cuda.device(x.device):
            kernel[grid](*args, **meta)
    else:
        kernel[grid](*args, **meta)
    return y


def _check_config(fn: str, cfg: TileConfig, transpose: bool) -> None:
    """Refuse tile configs the kernels cannot run, naming the TileConfig field."""
    if cfg.fast and not cfg.scale_2d:
        raise ValueError(f"{fn}: the fast decode needs scale_2d, got {cfg}")
    if (cfg.bk if not transpose else cfg.bn) % GROUP_SIZE:
        raise ValueError(f"{fn}: the tile's extent along In must be a multiple of 32, got {cfg}")
    if cfg.chunks is None:
        return
    c = tuple(cfg.chunks)
    if len(c) != 3 or any(not isinstance(v, int) or v < 16 or v & (v - 1) for v in c) or not c[0] >= c[1] >= c[2]:
        raise ValueError(f"{fn}: TileConfig.chunks must be three powers of two >= 16 with C1 >= C2 >= C3 "
                         f"(e.g. (64, 32, 16)), got chunks={cfg.chunks}")
    if cfg.bm != sum(c):
        raise ValueError(f"{fn}: TileConfig.bm must equal sum(chunks) = {sum(c)} (the rows of a group) with "
                         f"chunks={c}, got bm={cfg.bm}")
    for field, bad in (("swap", not cfg.swap), ("split", cfg.split), ("prefetch", cfg.prefetch)):
        if bad:
            raise ValueError(f"{fn}: the chunked kernel (TileConfig.chunks) has only swap tiles, no split dots and "
                             f"no hand prefetch: set swap=True, split=False, prefetch=False; got {field}="
                             f"{getattr(cfg, field)} in {cfg}")


def _kernel_and_meta(cfg: TileConfig, transpose: bool, num_experts: int) -> tuple:
    """The Triton kernel of a (checked) config and its constexpr / launch arguments."""
    meta = {"TRANS": transpose, "ASM": cfg.decode == "asm", "DOT_F32": _interpreting(), "SCALE_2D": cfg.scale_2d,
            "FAST": cfg.fast, "BN": cfg.bn, "BK": cfg.bk, "BLOCK_E": triton.next_power_of_2(num_experts),
            "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    if cfg.chunks is not None:
        c1, c2, c3 = cfg.chunks
        return _mxfp4_moe_chunked_kernel, {**meta, "C1": c1, "C2": c2, "C3": c3}
    return _mxfp4_moe_kernel, {**meta, "SWAP": cfg.swap, "PREFETCH": cfg.prefetch, "SPLIT": cfg.split,
                               "BM": cfg.bm}
