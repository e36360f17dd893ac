"""Absorbed-MLA decode attention over a paged latent cache: a pure-torch reference and a Triton kernel.

In MLA's absorbed form (`miles_k3.model.mla`) one decode token of request b attends, per head h, over the
request's cached latents: key_j = latent_j = [c_j (R) | k_r,j (P)], value_j = c_j, with the query already folded
through W_UK: q = [q_lat (R) | q_rope (P)]. The latents live in pages: position j of request b is row j % Z of
page table[b, j // Z] of `storage` [G, Z, L]. Only the first lens[b] positions are valid.

    o_lat[b, h] = sum_j softmax_j(scale * <q[b, h], latent_j>) c_j          (fp32 softmax)

The kernel reads each request's pages straight from the pool (no gathered copy, no full-capacity padding), with
an online softmax over blocks of positions, optionally split over the positions (flash-decoding: partial
results merged by a second small kernel) so that few long requests still fill the GPU. It runs on CUDA for
bf16/fp16 latents; `paged_latent_attention` falls back to the reference elsewhere.

Legend: B requests, H heads, R kv_lora_rank, P rope dims, L = R + P, G pages, Z tokens per page, T table width
(pages per request), S position splits.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

KERNEL_DTYPES = (torch.bfloat16, torch.float16)
_BLOCK_H = 16  # heads per program (tl.dot needs >= 16 rows; fewer heads are masked)
_BLOCK_N = 32  # positions per inner step
_TARGET_PROGRAMS = 264  # about two programs per SM on an H200 (132 SMs)


def _check(q_lat_BHR, q_rope_BHP, storage_GZL, table_BT, lens_B) -> None:
    b, h, r = q_lat_BHR.shape
    if q_rope_BHP.shape[:2] != (b, h):
        raise ValueError(f"q_rope {tuple(q_rope_BHP.shape)} must be [B={b}, H={h}, P]")
    if storage_GZL.dim() != 3 or storage_GZL.shape[-1] != r + q_rope_BHP.shape[-1]:
        raise ValueError(f"storage {tuple(storage_GZL.shape)} must be [G, Z, R + P = {r + q_rope_BHP.shape[-1]}]")
    if table_BT.dim() != 2 or table_BT.shape[0] != b or tuple(lens_B.shape) != (b,):
        raise ValueError(f"table {tuple(table_BT.shape)} must be [B={b}, T] and lens {tuple(lens_B.shape)} [B]")


def paged_latent_attention_reference(q_lat_BHR: torch.Tensor, q_rope_BHP: torch.Tensor, storage_GZL: torch.Tensor,
                                     table_BT: torch.Tensor, lens_B: torch.Tensor, scale: float) -> torch.Tensor:
    """The definition, in fp32: gather every request's T pages, mask positions >= lens[b], softmax, weighted
    sum of the c part. Returns o_lat [B, H, R] fp32. Rows with lens 0 are not allowed (nothing to attend)."""
    _check(q_lat_BHR, q_rope_BHP, storage_GZL, table_BT, lens_B)
    r = q_lat_BHR.shape[-1]
    latent_BSL = storage_GZL[table_BT].flatten(1, 2).float()
    q_BHL = torch.cat([q_lat_BHR, q_rope_BHP], dim=-1).float()
    scores_BHS = torch.einsum("bhl,bsl->bhs", q_BHL, latent_BSL) * scale
    valid_BS = torch.arange(latent_BSL.shape[1], device=lens_B.device) < lens_B[:, None]
    p_BHS = torch.softmax(scores_BHS.masked_fill(~valid_BS[:, None, :], float("-inf")), dim=-1)
    return torch.einsum("bhs,bsr->bhr", p_BHS, latent_BSL[..., :r])


@triton.jit
def _paged_mla_partial_kernel(
    q_lat, q_rope, kv, table, lens, o_part, lse_part,
    stride_ql_b, stride_ql_h, stride_qr_b, stride_qr_h, stride_kv_g, stride_kv_z, stride_t_b,
    H, scale,
    R: tl.constexpr, P: tl.constexpr, BR: tl.constexpr, BP: tl.constexpr, Z: tl.constexpr,
    S: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Program (b, head block, split s): online softmax over split s of request b's valid positions; writes
    the split's normalised output o_part[b, s, h, :R] and its log-sum-exp lse_part[b, s, h] (-inf if empty)."""
    b = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    s = tl.program_id(2)
    h_ok = h < H
    r = tl.arange(0, BR)
    p = tl.arange(0, BP)
    q_c = tl.load(q_lat + b * stride_ql_b + h[:, None] * stride_ql_h + r[None, :],
                  mask=h_ok[:, None] & (r[None, :] < R), other=0.0)
    q_r = tl.load(q_rope + b * stride_qr_b + h[:, None] * stride_qr_h + p[None, :],
                  mask=h_ok[:, None] & (p[None, :] < P), other=0.0)
    n = tl.load(lens + b).to(tl.int32)
    per_split = tl.cdiv(tl.cdiv(n, S), BLOCK_N) * BLOCK_N
    start = s * per_split
    end = tl.minimum(start + per_split, n)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BR], tl.float32)
    for pos0 in range(start, end, BLOCK_N):
        pos = pos0 + tl.arange(0, BLOCK_N)
        pos_ok = pos < end
        page = tl.load(table + b * stride_t_b + pos // Z, mask=pos_ok, other=0).to(tl.int64)
        row = page * stride_kv_g + (pos % Z).to(tl.int64) * stride_kv_z
        c = tl.load(kv + row[:, None] + r[None, :], mask=pos_ok[:, None] & (r[None, :] < R), other=0.0)
        k_r = tl.load(kv + row[:, None] + R + p[None, :], mask=pos_ok[:, None] & (p[None, :] < P), other=0.0)
        scores = (tl.dot(q_c, tl.trans(c)) + tl.dot(q_r, tl.trans(k_r))) * scale
        scores = tl.where(pos_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp(m_i - m_new)
        prob = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(prob, 1)
        acc = acc * alpha[:, None] + tl.dot(prob.to(c.dtype), c)
        m_i = m_new
    empty = l_i == 0.0
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    base = (b * S + s) * H + h
    tl.store(o_part + base[:, None] * BR + r[None, :], out, mask=h_ok[:, None])
    tl.store(lse_part + base, lse, mask=h_ok)


@triton.jit
def _paged_mla_merge_kernel(o_part, lse_part, out, stride_o_b, stride_o_h, H,
                            R: tl.constexpr, BR: tl.constexpr, S: tl.constexpr, BS: tl.constexpr):
    """Program (b, h): merge the S partial outputs by their log-sum-exp weights; writes out[b, h, :R]."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BS)
    r = tl.arange(0, BR)
    idx = (b * S + s) * H + h
    lse = tl.load(lse_part + idx, mask=s < S, other=float("-inf"))
    w = tl.exp(lse - tl.max(lse, 0))
    w = w / tl.sum(w, 0)
    parts = tl.load(o_part + idx[:, None] * BR + r[None, :], mask=(s < S)[:, None], other=0.0)
    o = tl.sum(parts * w[:, None], 0)
    tl.store(out + b * stride_o_b + h * stride_o_h + r, o.to(out.dtype.element_ty), mask=r < R)


def num_splits_for(batch: int, heads: int, max_positions: int) -> int:
    """Position splits so that batch x head blocks x splits reaches ~2 programs per SM, each split keeping at
    least 4 blocks of positions. Depends only on shapes (static under CUDA-graph capture)."""
    programs = batch * -(-heads // _BLOCK_H)
    by_work = max(1, max_positions // (4 * _BLOCK_N))
    return max(1, min(-(-_TARGET_PROGRAMS // programs), by_work, 16))


def paged_latent_attention(q_lat_BHR: torch.Tensor, q_rope_BHP: torch.Tensor, storage_GZL: torch.Tensor,
                           table_BT: torch.Tensor, lens_B: torch.Tensor, scale: float,
                           num_splits: int | None = None) -> torch.Tensor:
    """o_lat [B, H, R] in storage's dtype (see the module docstring). lens_B [B] int64 >= 1 on the device,
    table_BT [B, T] int64 page ids covering ceil(lens / Z) pages. On CUDA with bf16/fp16 storage: the Triton
    kernel (no host sync: capturable in a CUDA graph); elsewhere the fp32 reference, cast. `num_splits`:
    position splits (default from the shapes, `num_splits_for`)."""
    _check(q_lat_BHR, q_rope_BHP, storage_GZL, table_BT, lens_B)
    if storage_GZL.device.type != "cuda" or storage_GZL.dtype not in KERNEL_DTYPES:
        return paged_latent_attention_reference(q_lat_BHR, q_rope_BHP, storage_GZL, table_BT, lens_B,
                                                scale).to(storage_GZL.dtype)
    return _launch(q_lat_BHR, q_rope_BHP, storage_GZL, table_BT, lens_B, scale, num_splits)


def _launch(q_lat_BHR, q_rope_BHP, storage_GZL, table_BT, lens_B, scale, num_splits):
    """The two kernels (any device Triton can run them on: CUDA, or the CPU under TRITON_INTERPRET=1)."""
    b, h, r = q_lat_BHR.shape
    p = q_rope_BHP.shape[-1]
    z = storage_GZL.shape[1]
    splits = num_splits or num_splits_for(b, h, table_BT.shape[1] * z)
    q_lat_BHR = q_lat_BHR.to(storage_GZL.dtype)
    q_rope_BHP = q_rope_BHP.to(storage_GZL.dtype)
    if q_lat_BHR.stride(-1) != 1 or q_rope_BHP.stride(-1) != 1 or storage_GZL.stride(-1) != 1:
        q_lat_BHR, q_rope_BHP = q_lat_BHR.contiguous(), q_rope_BHP.contiguous()
        storage_GZL = storage_GZL.contiguous()
    lens_B = lens_B.contiguous()
    if table_BT.stride(1) != 1:
        table_BT = table_BT.contiguous()
    br, bp = max(16, triton.next_power_of_2(r)), max(16, triton.next_power_of_2(p))
    o_part = torch.empty(b, splits, h, br, device=storage_GZL.device, dtype=torch.float32)
    lse_part = torch.empty(b, splits, h, device=storage_GZL.device, dtype=torch.float32)
    _paged_mla_partial_kernel[(b, -(-h // _BLOCK_H), splits)](
        q_lat_BHR, q_rope_BHP, storage_GZL, table_BT, lens_B, o_part, lse_part,
        q_lat_BHR.stride(0), q_lat_BHR.stride(1), q_rope_BHP.stride(0), q_rope_BHP.stride(1),
        storage_GZL.stride(0), storage_GZL.stride(1), table_BT.stride(0), h, float(scale),
        R=r, P=p, BR=br, BP=bp, Z=z, S=splits, BLOCK_H=_BLOCK_H, BLOCK_N=_BLOCK_N, num_warps=4, num_stages=2)
    out = torch.empty(b, h, r, device=storage_GZL.device, dtype=storage_GZL.dtype)
    _paged_mla_merge_kernel[(b, h)](o_part, lse_part, out, out.stride(0), out.stride(1), h,
                                    R=r, BR=br, S=splits, BS=max(2, triton.next_power_of_2(splits)))
    return out
