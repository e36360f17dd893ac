"""The chunked tiling of the grouped MXFP4 expert matmul (`miles_k3.kernels.mxfp4_moe`, `TileConfig.chunks`): one
program per (row group of one expert, n-tile) decodes each weight tile once and applies it to up to three row
chunks of widths C1 >= C2 >= C3 (powers of two), each with its own [BN, Ci] accumulator, so that a group of n rows
pays for an MMA about n wide instead of the next power of two (`mxfp4_moe` module docstring: why, and the rule).

Only the swap orientation (the decoded weights are the dot's first operand, forward and transposed), the FAST
decode with its recompute, per-group or per-byte scale loads and Triton's own pipelining (no hand prefetch, no
split halves); the launcher refuses the rest. The weight loads and decodes are `mxfp4_moe_kernel`'s.

Legend: M rows (token-expert pairs), E experts, K the reduction width, N the output width, G = C1 + C2 + C3 the rows
of a group. This module imports triton only; launching the kernel needs CUDA (or `TRITON_INTERPRET=1`).
"""
from __future__ import annotations

import triton
import triton.language as tl

from miles_k3.kernels.mxfp4_moe_kernel import _decode_tile, _load_weight_tile, _tile_of


@triton.jit
def _chunk_rule(n, C1, C2, C3):
    """(use1, use2, use3, base, base2) for a group of n rows (1 <= n <= C1 + C2 + C3): chunk 1 covers rows
    [0, C1), chunk 2 [base, base + C2), chunk 3 [base2, base2 + C3); the used ones are disjoint and cover [0, n).
    Plain arithmetic and comparisons, so the launcher's `chunk_plan` runs this very function on Python ints."""
    use1 = n > C2 + C3  # chunks 2 and 3 together are too narrow
    base = use1 * C1
    use2 = n - base > C3  # what chunk 1 leaves does not fit chunk 3 alone
    base2 = base + use2 * C2
    use3 = n - base2 > 0
    return use1, use2, use3, base, base2


@triton.jit
def _decoded_weights(p_e, s_e, offs_n, n_mask, n0, k0, offs_k, k_mask, groups_row, row_bytes, TRANS: tl.constexpr,
                     ASM: tl.constexpr, FAST: tl.constexpr, DOT_F32: tl.constexpr, SCALE_2D: tl.constexpr,
                     BN: tl.constexpr, BK: tl.constexpr):
    """(decoded weight tile [BN, BK] of reduction step k0 (offs_k, masked by k_mask), its scale bytes): the dot's
    first operand for every chunk. Forward W_e[n-tile, k-tile]; TRANS: W_e[k-tile, n-tile] decoded along its rows,
    then transposed."""
    if TRANS:
        b, s, sg = _load_weight_tile(p_e, s_e, offs_k, k_mask, n0, groups_row, row_bytes, BK, BN, SCALE_2D, FAST)
        w = tl.trans(_decode_tile(b, s, ASM, FAST))
    else:
        b, s, sg = _load_weight_tile(p_e, s_e, offs_n, n_mask, k0, groups_row, row_bytes, BN, BK, SCALE_2D, FAST)
        w = _decode_tile(b, s, ASM, FAST)
    if DOT_F32:  # the interpreter multiplies bf16 bit patterns as integers
        w = w.to(tl.float32)
    return w, sg


@triton.jit
def _chunk_dot(acc, w, x_ptr, row_c, row_end, offs_k, k_mask, n_red, DOT_F32: tl.constexpr, C: tl.constexpr):
    """acc [BN, C] + w [BN, BK] @ x[rows row_c .. row_c + C (masked by row_end), k-tile]^T."""
    offs_m = row_c + tl.arange(0, C)
    a = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * n_red + offs_k[None, :],
                mask=(offs_m < row_end)[:, None] & k_mask[None, :], other=0.0)
    if DOT_F32:
        a = a.to(tl.float32)
    return tl.dot(w, tl.trans(a), acc)


@triton.jit
def _accumulate_chunks(x_ptr, p_e, s_e, row0, row_end, base, base2, offs_n, n_mask, n0, n_red, groups_row, row_bytes,
                       TRANS: tl.constexpr, ASM: tl.constexpr, FAST: tl.constexpr, DOT_F32: tl.constexpr,
                       SCALE_2D: tl.constexpr, U1: tl.constexpr, U2: tl.constexpr, U3: tl.constexpr,
                       C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """The reduction loop of one set of chunks (U1, U2, U3: which ones): (acc1 [BN, C1], acc2 [BN, C2],
    acc3 [BN, C3], the running max of the scale bytes read; FAST only). The unused accumulators stay zero."""
    acc1 = tl.zeros([BN, C1], dtype=tl.float32)
    acc2 = tl.zeros([BN, C2], dtype=tl.float32)
    acc3 = tl.zeros([BN, C3], dtype=tl.float32)
    if TRANS:
        smax = tl.zeros([BK, BN // 32], dtype=tl.uint8)
    else:
        smax = tl.zeros([BN, BK // 32], dtype=tl.uint8)
    for k0 in range(0, n_red, BK):
        offs_k = k0 + tl.arange(0, BK)
        k_mask = offs_k < n_red
        w, sg = _decoded_weights(p_e, s_e, offs_n, n_mask, n0, k0, offs_k, k_mask, groups_row, row_bytes, TRANS, ASM,
                                 FAST, DOT_F32, SCALE_2D, BN, BK)
        if FAST:
            smax = tl.maximum(smax, sg)
        if U1:
            acc1 = _chunk_dot(acc1, w, x_ptr, row0, row_end, offs_k, k_mask, n_red, DOT_F32, C1)
        if U2:
            acc2 = _chunk_dot(acc2, w, x_ptr, row0 + base, row_end, offs_k, k_mask, n_red, DOT_F32, C2)
        if U3:
            acc3 = _chunk_dot(acc3, w, x_ptr, row0 + base2, row_end, offs_k, k_mask, n_red, DOT_F32, C3)
    return acc1, acc2, acc3, smax


@triton.jit
def _accumulate_group(x_ptr, p_e, s_e, row0, row_end, offs_n, n_mask, n0, n_red, groups_row, row_bytes,
                      TRANS: tl.constexpr, ASM: tl.constexpr, FAST: tl.constexpr, DOT_F32: tl.constexpr,
                      SCALE_2D: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr,
                      BN: tl.constexpr, BK: tl.constexpr):
    """`_accumulate_chunks` of the chunks this group uses (`_chunk_rule`). The choice is made once, outside the
    k-loop, among 7 loops each specialised to its chunks: a runtime branch around the dots inside the loop stops
    Triton's software pipeliner for the whole loop (no cp.async loads, synchronous wgmma: the sm_90 TTGIR of
    Triton 3.6 and 3.9), so a skipped chunk loads nothing and multiplies nothing without costing the others."""
    n = tl.minimum(row_end - row0, C1 + C2 + C3)
    use1, use2, use3, base, base2 = _chunk_rule(n, C1, C2, C3)
    args = (x_ptr, p_e, s_e, row0, row_end, base, base2, offs_n, n_mask, n0, n_red, groups_row, row_bytes)
    if use1:
        if use2:
            if use3:
                acc1, acc2, acc3, smax = _accumulate_chunks(*args, TRANS, ASM, FAST, DOT_F32, SCALE_2D, True, True,
                                                            True, C1, C2, C3, BN, BK)
            else:
                acc1, acc2, acc3, smax = _accumulate_chunks(*args, TRANS, ASM, FAST, DOT_F32, SCALE_2D, True, True,
                                                            False, C1, C2, C3, BN, BK)
        elif use3:
            acc1, acc2, acc3, smax = _accumulate_chunks(*args, TRANS, ASM, FAST, DOT_F32, SCALE_2D, True, False,
                                                        True, C1, C2, C3, BN, BK)
        else:
            acc1, acc2, acc3, smax = _accumulate_chunks(*args, TRANS, ASM, FAST, DOT_F32, SCALE_2D, True, False,
                                                        False, C1, C2, C3, BN, BK)
    elif use2:
        if use3:
            acc1, acc2, acc3, smax = _accumulate_chunks(*args, TRANS, ASM, FAST, DOT_F32, SCALE_2D, False, True,
                                                        True, C1, C2, C3, BN, BK)
        else:
            acc1, acc2, acc3, smax = _accumulate_chunks(*args, TRANS, ASM, FAST, DOT_F32, SCALE_2D, False, True,
                                                        False, C1, C2, C3, BN, BK)
    else:  # n >= 1: chunk 3 alone
        acc1, acc2, acc3, smax = _accumulate_chunks(*args, TRANS, ASM, FAST, DOT_F32, SCALE_2D, False, False, True,
                                                    C1, C2, C3, BN, BK)
    return acc1, acc2, acc3, smax


@triton.jit
def _store_chunk(y_ptr, acc, row_c, row_end, offs_n, n_mask, n_cols, C: tl.constexpr):
    """y[rows row_c .. row_c + C (masked by row_end), n-tile] = acc^T ([BN, C], the swap orientation)."""
    offs_m = row_c + tl.arange(0, C)
    out = y_ptr + offs_m.to(tl.int64)[:, None] * n_cols + offs_n[None, :]
    tl.store(out, tl.trans(acc).to(y_ptr.dtype.element_ty), mask=(offs_m < row_end)[:, None] & n_mask[None, :])


@triton.jit
def _mxfp4_moe_chunked_kernel(x_ptr, ends_ptr, packed_ptr, scale_ptr, y_ptr, num_experts, n_cols, n_red, row_bytes,
                              groups_row, expert_bytes, expert_groups,
                              TRANS: tl.constexpr, ASM: tl.constexpr, DOT_F32: tl.constexpr,
                              SCALE_2D: tl.constexpr, FAST: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr,
                              C3: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BLOCK_E: tl.constexpr):
    """Program (n-tile, group t): y[rows of group t, n-tile] = x[rows, :] @ W_e^T (TRANS: @ W_e), arguments as
    `_mxfp4_moe_kernel`'s. Groups are each expert's rows cut into pieces of G = C1 + C2 + C3 rows (`_tile_of` with
    BM = G: no arange over G, so G need not be a power of two). FAST: a group that read a scale byte above 128 is
    computed again by the general decode, as in `_mxfp4_moe_kernel`."""
    pid_n = tl.program_id(0)
    t = tl.program_id(1)
    expert, row0, row_end = _tile_of(ends_ptr, t, num_experts, C1 + C2 + C3, BLOCK_E)
    if expert >= num_experts:
        return
    p_e = packed_ptr + expert.to(tl.int64) * expert_bytes
    s_e = scale_ptr + expert.to(tl.int64) * expert_groups
    n0 = pid_n * BN
    offs_n = n0 + tl.arange(0, BN)
    n_mask = offs_n < n_cols
    acc1, acc2, acc3, smax = _accumulate_group(x_ptr, p_e, s_e, row0, row_end, offs_n, n_mask, n0, n_red,
                                               groups_row, row_bytes, TRANS, ASM, FAST, DOT_F32, SCALE_2D, C1, C2, C3,
                                               BN, BK)
    if FAST:  # noqa: SIM102 - a constexpr branch: the reduction exists only in FAST kernels
        if tl.max(smax) > 128:  # 2^(s-1) is not a bf16 number: this group again, by the general decode
            acc1, acc2, acc3, smax = _accumulate_group(x_ptr, p_e, s_e, row0, row_end, offs_n, n_mask, n0, n_red,
                                                       groups_row, row_bytes, TRANS, ASM, False, DOT_F32, SCALE_2D,
                                                       C1, C2, C3, BN, BK)
    n = tl.minimum(row_end - row0, C1 + C2 + C3)
    use1, use2, use3, base, base2 = _chunk_rule(n, C1, C2, C3)
    if use1:
        _store_chunk(y_ptr, acc1, row0, row_end, offs_n, n_mask, n_cols, C1)
    if use2:
        _store_chunk(y_ptr, acc2, row0 + base, row_end, offs_n, n_mask, n_cols, C2)
    if use3:
        _store_chunk(y_ptr, acc3, row0 + base2, row_end, offs_n, n_mask, n_cols, C3)
