"""The Triton kernel of the grouped MXFP4 expert matmul (`miles_k3.kernels.mxfp4_moe`, which launches it and
holds its pure-torch reference, tile choice and the design notes): finding a program's (expert, first row) tile,
the "tl" and "asm" weight decodes (general and FAST), the weight-tile loads and the MMA steps. Split from the
launcher along that seam so that neither file passes ~500 lines.

Legend: M rows (token-expert pairs), E experts, K the reduction width, N the output width, G scale groups of 32.
This module imports triton only; launching the kernel needs CUDA (or `TRITON_INTERPRET=1`).
"""
from __future__ import annotations

import triton
import triton.language as tl


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
