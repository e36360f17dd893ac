"""Fused forward-only Triton kernels for the two eager chains of a KDA decode step (`miles_k3.model.kda`).

The rollout engine's decode step (one token per request, captured in a CUDA graph) is launch-bound; each
KDA layer spends ~20 launches on two small chains. These kernels do each chain in one launch, for inference
only (no autograd; the training / prefill paths keep the torch code).

| kernel (one launch each) | reference (pure torch, here) = today's `KDAAttention` code |
| --- | --- |
| `short_conv_step(qkv_BC, pool_NCW, slots_B, weight_CW)` | `short_conv_step_reference`: `_short_conv` for |
| | T = 1 on a gathered pool window, then the `index_copy_` scatter |
| `gated_head_norm(o_BTHV, gate_BTP, norm_weight_V, eps, out_dtype)` | `gated_head_norm_reference`: |
| | `_gated_output` up to (not including) o_proj |

Legend for tensor suffixes: B requests (decode rows, padding included), T tokens, N pool slots,
C = 3 * H * K conv channels (q | k | v), W conv taps (the window holds the last W-1 inputs, oldest first),
H heads, V head dim, P = H * V.
Accepted dtypes: activations, pools and weights float32, bfloat16 or float16 (`ACT_DTYPES`); slots int32 or
int64.

short_conv_step: out[b, c] = silu(sum_{j<W-1} w[c, j] * win[c, j] + w[c, W-1] * x[c]) in fp32, where win is
pool row slots_B[b] cast to the activation dtype first (as the reference's `torch.cat([window.to(qkv.dtype),
...])`); the pool row becomes [win[:, 1:], x] cast to the pool dtype (a pool in the activation dtype just
shifts). Padding rows may all point at one scratch slot: their outputs and that slot's contents are then
undefined (the programs race on it), other rows are unaffected. Slots outside [0, N) read a zero window and
write nothing (a bounds check would need a host sync, impossible under graph capture); real rows must have
distinct slots.

Numerics: fp32 math like the references; results are rounded (to nearest even, like torch) exactly where the
reference rounds: the window to the activation dtype, the conv output once, the stored window to the pool
dtype, the gated norm once at the end. Rounding to bf16 uses integer ops (`fused._round`): the interpreter's
fp32 -> bf16 cast truncates. What differs from torch: reductions run in another order (and may use FMA),
rsqrt / exp / division use the GPU's fast approximations. So fp32 outputs agree to ~1e-6 relative (the conv,
where its sum cancels, to ~3e-7 of sum_j |w_j x_j| instead) and 16-bit outputs are within 1 ulp (the tests,
tests/kernels/test_kda_decode_kernels.py, state the exact criteria). The pool update is pure data movement plus those
casts: bitwise equal to the reference.

This module imports torch and triton only; launching a kernel needs CUDA tensors (or `TRITON_INTERPRET=1`, set
before this module is imported, for CPU tensors).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from miles_k3.kernels.fused import _ROUND_KIND, ACT_DTYPES, _interpreting, _on_device, _round, _sigmoid

SLOT_DTYPES = (torch.int32, torch.int64)

MAX_CONV_BLOCK_C = 64  # channels per program; H200, B=256, C=3072: 14.5 us vs 20 at 512 (benchmarks/micro_decode_gpu.py)
MAX_NORM_TILE = 4096  # fp32 values per gated-norm program (heads x head dim); K3 / k3_m: 8 heads x 128 = 1024
MAX_HEAD_DIM = 8192  # a head must fit one program's tile


# ---- validation helpers ------------------------------------------------------------------------------------
def _check_tensor(fn: str, name: str, t, dims: int, dtypes=ACT_DTYPES, what: str = "") -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{fn}: {name} must be one of {names}, got {t.dtype}; "
                         f"use {fn}_reference for other dtypes")
    if dims and t.dim() != dims:
        raise ValueError(f"{fn}: {name} must be {what} ({dims} dims), got shape {tuple(t.shape)}")
    if not _interpreting() and not t.is_cuda:
        raise ValueError(f"{fn}: {name} must be a CUDA tensor, got {t.device}; use {fn}_reference on other "
                         "devices")


def _same_device(fn: str, ref_name: str, ref: torch.Tensor, **others: torch.Tensor) -> None:
    for name, t in others.items():
        if t.device != ref.device:
            raise ValueError(f"{fn}: {name} ({t.device}) must be on {ref_name}'s device ({ref.device})")


def _conv_weights(fn: str, weight, c: int) -> tuple[list[torch.Tensor], int, int]:
    """The conv weight as three [P, W] tensors with unit stride along W (views where possible), P and W.

    `weight`: one tensor [C, W] / [C, 1, W] (the q, k, v conv1d weights concatenated), or a sequence of the
    three conv1d weights [C/3, 1, W] (or [C/3, W]) in q, k, v order, read in place (no concatenation)."""
    if isinstance(weight, torch.Tensor):
        parts, p = [weight], c
    elif (isinstance(weight, Sequence) and len(weight) == 3
          and all(isinstance(t, torch.Tensor) for t in weight)):
        if c % 3:
            raise ValueError(f"{fn}: three conv weights (q, k, v) need C divisible by 3, got C = {c}")
        parts, p = list(weight), c // 3
    else:
        raise TypeError(f"{fn}: weight_CW must be a tensor [C, W] / [C, 1, W] or a sequence of the three "
                        f"(q, k, v) conv1d weights [C/3, 1, W], got {type(weight).__name__}")
    out, w = [], None
    for i, t in enumerate(parts):
        name = "weight_CW" if len(parts) == 1 else f"weight_CW[{i}]"
        _check_tensor(fn, name, t, 0)
        taps = t.shape[-1] if t.dim() in (2, 3) else -1
        if t.dim() not in (2, 3) or (t.dim() == 3 and t.shape[1] != 1) or t.shape[0] != p:
            raise ValueError(f"{fn}: {name} must have shape [{p}, W] or [{p}, 1, W] (C = {c}), "
                             f"got {tuple(t.shape)}")
        if w is None:
            w = taps
        if taps != w:
            raise ValueError(f"{fn}: {name} has {taps} taps, expected W = {w} (the window holds W-1)")
        t2 = t.reshape(p, w)
        out.append(t2 if t2.stride(-1) == 1 or w == 1 else t2.contiguous())
    while len(out) < 3:
        out.append(out[0])  # one [C, W] tensor: P = C, so the k and v pointers are never read
    return out, p, w


# ---- short conv step ---------------------------------------------------------------------------------------
def short_conv_step_reference(qkv_BC: torch.Tensor, pool_NCW: torch.Tensor, slots_B: torch.Tensor,
                              weight_CW) -> torch.Tensor:
    """Pure torch, any device: `KDAAttention._short_conv` for one decode token on a pooled state, op for op.

    qkv_BC [B, C] (the q|k|v projections of the new token), pool_NCW [N, C, W-1] updated in place at rows
    slots_B [B], weight_CW [C, W] / [C, 1, W] or the three conv1d weights (q, k, v) -> act_BC [B, C] in qkv's
    dtype. Duplicate slots: index_copy_ keeps one of the rows (on CUDA an unspecified one).
    """
    if isinstance(weight_CW, torch.Tensor):
        weight = weight_CW
    else:
        weight = torch.cat(list(weight_CW))
    c = qkv_BC.shape[1]
    weight = weight.reshape(c, 1, -1).float()  # as kda.py: the concatenated conv1d weights, cast to fp32
    window_BCW = pool_NCW[slots_B]
    seq_BCX = torch.cat([window_BCW.to(qkv_BC.dtype), qkv_BC[:, :, None]], dim=2)  # X = W
    act_BC = F.silu(F.conv1d(seq_BCX.float(), weight, groups=c))[:, :, 0]
    pool_NCW.index_copy_(0, slots_B, seq_BCX[:, :, 1:].to(pool_NCW.dtype))
    return act_BC.to(qkv_BC.dtype)


@triton.jit
def _short_conv_step_kernel(x_ptr, pool_ptr, slots_ptr, wq_ptr, wk_ptr, wv_ptr, out_ptr, C, P, N, stride_xb,
                            stride_pn, stride_pc, stride_pw, stride_wq, stride_wk, stride_wv,
                            W: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr,
                            ACT_ROUND: tl.constexpr, POOL_ROUND: tl.constexpr):
    """Program (b, channel block): a [BLOCK_C, BLOCK_W] tile seq[c, j] = window (taps j < W-1, from pool
    row slots[b], rounded to the activation dtype) | x (tap W-1); out = silu(sum_j w * seq) in fp32. The new
    window new[c, j] = seq[c, j+1] is loaded as a second (shifted) tile, and stored over the row after a
    block barrier: no thread can overwrite a window entry that another thread of the program has yet to
    read. Channel blocks of one row are disjoint, so distinct slots never race. Weights: channel c < P from
    wq, c < 2P from wk, else from wv (one [C, W] tensor is passed with P = C)."""
    odt = out_ptr.dtype.element_ty
    pdt = pool_ptr.dtype.element_ty
    b = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    c2 = cols[:, None]
    j2 = tl.arange(0, BLOCK_W)[None, :]
    slot = tl.load(slots_ptr + b).to(tl.int64)
    row = pool_ptr + slot * stride_pn
    slot_c = slot + tl.zeros([BLOCK_C], dtype=tl.int64)  # vector: interpreter rejects scalar&tile masks
    cvalid = (cmask & (slot_c >= 0) & (slot_c < N))[:, None]  # out-of-range slots: zero window, no write
    x = tl.load(x_ptr + b * stride_xb + cols, mask=cmask, other=0.0).to(tl.float32)
    in_win = cvalid & (j2 < W - 1)
    win = tl.load(row + c2 * stride_pc + j2 * stride_pw, mask=in_win, other=0.0).to(tl.float32)
    seq = tl.where(j2 == W - 1, x[:, None], _round(win, ACT_ROUND))
    shifted_mask = cvalid & (j2 + 1 < W - 1)
    shifted = tl.load(row + c2 * stride_pc + (j2 + 1) * stride_pw, mask=shifted_mask,
                      other=0.0).to(tl.float32)
    new = tl.where(j2 + 1 == W - 1, x[:, None], _round(shifted, ACT_ROUND))

    wmask = cmask[:, None] & (j2 < W)
    is_q = (cols < P)[:, None]
    is_k = ((cols >= P) & (cols < 2 * P))[:, None]
    wq = tl.load(wq_ptr + c2 * stride_wq + j2, mask=wmask & is_q, other=0.0).to(tl.float32)
    wk = tl.load(wk_ptr + (c2 - P) * stride_wk + j2, mask=wmask & is_k, other=0.0).to(tl.float32)
    wv = tl.load(wv_ptr + (c2 - 2 * P) * stride_wv + j2, mask=wmask & (c2 >= 2 * P), other=0.0).to(tl.float32)
    w = tl.where(is_q, wq, tl.where(is_k, wk, wv))
    acc = tl.sum(w * seq, axis=1)
    act = acc * _sigmoid(acc)
    tl.store(out_ptr + b * C + cols, _round(act, ACT_ROUND).to(odt), mask=cmask)
    tl.debug_barrier()  # every read of the row above happens before any write below
    tl.store(row + c2 * stride_pc + j2 * stride_pw, _round(new, POOL_ROUND).to(pdt), mask=in_win)


def short_conv_step(qkv_BC: torch.Tensor, pool_NCW: torch.Tensor, slots_B: torch.Tensor, weight_CW, *,
                    block_c: int | None = None) -> torch.Tensor:
    """Fused decode step of the KDA short conv on a pooled window (one launch).

    qkv_BC [B, C]: the new token's q|k|v projections (activation dtype; rows need unit stride along C).
    pool_NCW [N, C, W-1]: the conv window pool (any strides, any of ACT_DTYPES); rows slots_B [B] (int32 or
    int64) are read and shifted in place: row <- [window[:, 1:], x].
    weight_CW: the q, k, v conv1d weights concatenated, [C, W] or [C, 1, W] (`torch.cat([q_conv1d.weight,
    k_conv1d.weight, v_conv1d.weight])` as is), or those three tensors [C/3, 1, W] as a sequence, read in
    place (no per-call concatenation or cast). Any of ACT_DTYPES; used in fp32.
    Returns act_BC [B, C] = silu(conv) in qkv_BC's dtype, contiguous. W >= 2. `block_c` (a power of two)
    overrides the channel tile (tests of partial blocks).
    Equals `short_conv_step_reference` (see the module docstring for the numerics and for duplicate slots).
    """
    fn = "short_conv_step"
    _check_tensor(fn, "qkv_BC", qkv_BC, 2, what="[B, C]")
    _check_tensor(fn, "pool_NCW", pool_NCW, 3, what="[N, C, W-1]")
    _check_tensor(fn, "slots_B", slots_B, 1, dtypes=SLOT_DTYPES, what="[B]")
    b, c = qkv_BC.shape
    n, pc, w1 = pool_NCW.shape
    if pc != c:
        raise ValueError(f"{fn}: pool_NCW must be [N, C, W-1] with C = {c} (qkv_BC's channels), got "
                         f"{tuple(pool_NCW.shape)}")
    if slots_B.shape[0] != b:
        raise ValueError(f"{fn}: slots_B must have one slot per row of qkv_BC ({b}), "
                         f"got {tuple(slots_B.shape)}")
    weights, p, w = _conv_weights(fn, weight_CW, c)
    if w < 2 or w1 != w - 1:
        raise ValueError(f"{fn}: the conv has W = {w} taps (W >= 2), so pool_NCW must hold W-1 = {w - 1} "
                         f"inputs per channel; got pool shape {tuple(pool_NCW.shape)}")
    _same_device(fn, "qkv_BC", qkv_BC, pool_NCW=pool_NCW, slots_B=slots_B, weight_CW=weights[0],
                 weight_k=weights[1], weight_v=weights[2])
    if block_c is not None and (block_c < 1 or block_c & (block_c - 1)):
        raise ValueError(f"{fn}: block_c must be a power of two, got {block_c}")
    out = torch.empty(b, c, dtype=qkv_BC.dtype, device=qkv_BC.device)
    if out.numel() == 0:
        return out
    x = qkv_BC if qkv_BC.stride(1) == 1 else qkv_BC.contiguous()
    slots = slots_B if slots_B.stride(0) == 1 else slots_B.contiguous()
    block = block_c or min(MAX_CONV_BLOCK_C, triton.next_power_of_2(c))
    block_w = triton.next_power_of_2(w)
    with _on_device(qkv_BC):
        _short_conv_step_kernel[(b, triton.cdiv(c, block))](
            x, pool_NCW, slots, *weights, out, c, p, n, x.stride(0), *pool_NCW.stride(),
            *(t.stride(0) for t in weights), W=w, BLOCK_C=block, BLOCK_W=block_w,
            ACT_ROUND=_ROUND_KIND[qkv_BC.dtype], POOL_ROUND=_ROUND_KIND[pool_NCW.dtype],
            num_warps=max(1, min(4, block * block_w // 256)))
    return out


# ---- gated per-head RMSNorm --------------------------------------------------------------------------------
def gated_head_norm_reference(o_BTHV: torch.Tensor, gate_BTP: torch.Tensor, norm_weight_V: torch.Tensor,
                              eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    """Pure torch, any device: `KDAAttention._gated_output` up to (not including) o_proj, op for op.

    o_BTHV [..., H, V], gate_BTP [..., H*V] (g_proj x, before the sigmoid), norm_weight_V [V] ->
    y [..., H*V] in out_dtype: (o32 * rsqrt(mean_v(o32^2) + eps) * w32) * sigmoid(gate32), cast once.
    """
    o = o_BTHV.float()
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * norm_weight_V.float()
    gate = torch.sigmoid(gate_BTP.float()).view_as(o)
    return (o * gate).reshape(*o_BTHV.shape[:-2], -1).to(out_dtype)


@triton.jit
def _gated_head_norm_kernel(o_ptr, g_ptr, w_ptr, out_ptr, H, V, stride_or, stride_oh, stride_gr, eps,
                            BLOCK_H: tl.constexpr, BLOCK_V: tl.constexpr, ROUND: tl.constexpr):
    """Program (row r, head block): a [BLOCK_H, BLOCK_V] tile of o; per head rstd = rsqrt(sum(o^2) / V +
    eps); y = (o * rstd * w) * sigmoid(gate) in fp32, multiplied in the reference's order, rounded once."""
    odt = out_ptr.dtype.element_ty
    r = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    vs = tl.arange(0, BLOCK_V)
    vmask = vs < V
    mask = (heads < H)[:, None] & vmask[None, :]
    o = tl.load(o_ptr + r * stride_or + heads[:, None] * stride_oh + vs[None, :], mask=mask,
                other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(o * o, axis=1) / V + eps)
    w = tl.load(w_ptr + vs, mask=vmask, other=0.0).to(tl.float32)
    offs = heads[:, None] * V + vs[None, :]
    gate = tl.load(g_ptr + r * stride_gr + offs, mask=mask, other=0.0).to(tl.float32)
    y = (o * rstd[:, None] * w[None, :]) * _sigmoid(gate)
    tl.store(out_ptr + r * H * V + offs, _round(y, ROUND).to(odt), mask=mask)


def gated_head_norm(o_BTHV: torch.Tensor, gate_BTP: torch.Tensor, norm_weight_V: torch.Tensor, eps: float,
                    out_dtype: torch.dtype, *, block_h: int | None = None) -> torch.Tensor:
    """Fused per-head RMSNorm times o_norm.weight, gated by sigmoid(gate) (one launch): the o_proj input.

    o_BTHV [..., H, V] (any leading dims; unit stride along V, else copied), gate_BTP [..., H*V] (same leading
    dims; rows need unit stride along P), norm_weight_V [V] (fp32 in the checkpoint; any of ACT_DTYPES) ->
    y [..., H*V] in out_dtype, contiguous. Equals `gated_head_norm_reference`. `block_h` (a power of two)
    overrides the heads per program (tests).
    """
    fn = "gated_head_norm"
    _check_tensor(fn, "o_BTHV", o_BTHV, 0)
    _check_tensor(fn, "gate_BTP", gate_BTP, 0)
    _check_tensor(fn, "norm_weight_V", norm_weight_V, 0)
    if o_BTHV.dim() < 2:
        raise ValueError(f"{fn}: o_BTHV must be [..., H, V], got shape {tuple(o_BTHV.shape)}")
    *lead, h, v = o_BTHV.shape
    if tuple(gate_BTP.shape) != (*lead, h * v):
        raise ValueError(f"{fn}: gate_BTP must have shape {(*lead, h * v)} ([..., H*V] for o "
                         f"{tuple(o_BTHV.shape)}), got {tuple(gate_BTP.shape)}")
    if norm_weight_V.numel() != v or norm_weight_V.dim() != 1:
        raise ValueError(f"{fn}: norm_weight_V must have shape [{v}] (V), got {tuple(norm_weight_V.shape)}")
    if v > MAX_HEAD_DIM:
        raise ValueError(f"{fn}: head dim V = {v} exceeds {MAX_HEAD_DIM}; use gated_head_norm_reference")
    if out_dtype not in ACT_DTYPES:
        raise ValueError(f"{fn}: out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    eps = float(eps)
    if not eps >= 0.0:
        raise ValueError(f"{fn}: eps must be a finite number >= 0, got {eps}")
    if block_h is not None and (block_h < 1 or block_h & (block_h - 1)):
        raise ValueError(f"{fn}: block_h must be a power of two, got {block_h}")
    _same_device(fn, "o_BTHV", o_BTHV, gate_BTP=gate_BTP, norm_weight_V=norm_weight_V)
    out = torch.empty(*lead, h * v, dtype=out_dtype, device=o_BTHV.device)
    if out.numel() == 0:
        return out
    o3 = o_BTHV.reshape(-1, h, v)
    if o3.stride(-1) != 1 and v > 1:
        o3 = o3.contiguous()
    g2 = gate_BTP.reshape(-1, h * v)
    if g2.stride(-1) != 1:
        g2 = g2.contiguous()
    w = norm_weight_V.contiguous()
    block_v = triton.next_power_of_2(v)
    block = block_h or min(triton.next_power_of_2(h), max(1, MAX_NORM_TILE // block_v))
    with _on_device(o_BTHV):
        _gated_head_norm_kernel[(o3.shape[0], triton.cdiv(h, block))](
            o3, g2, w, out, h, v, o3.stride(0), o3.stride(1), g2.stride(0), eps, BLOCK_H=block,
            BLOCK_V=block_v, ROUND=_ROUND_KIND[out_dtype], num_warps=max(1, min(8, block * block_v // 256)))
    return out


# ---- the KDA recurrence, one decode token, in place on the slot pool ----------------------------------------
# Program (V block, head, row); fp32 state tile [K, BLOCK_V]. Default (block_v, num_warps) from
# `python benchmarks/bench_k3_layers_gpu.py --parts kda --batches 256` on one H200 at K3 width (B = 256, H = 96,
# K = V = 128): 0.81 ms per layer (1.07x the state's read + write bound) against 0.87 for (32, 4), 1.06 for
# (64, 8), 1.36 for (128, 8), and 1.24 ms (1.64x) for fla's fused_recurrent_kda in the same run.
KDA_STEP_CONFIG: dict[str, int] = {"block_v": 64, "num_warps": 4}


def kda_recurrent_step_reference(q, k, v, f, beta_logit, A_log, dt_bias, lower_bound: float, pool_NHKV: torch.Tensor,
                                 slots_B: torch.Tensor) -> torch.Tensor:
    """Pure torch, any device: one KDA decode token per row on a pooled fp32 state, updated in place.

    q, k [B, 1, H, K] (raw: L2-normalised here, eps 1e-6; q scaled by K^-0.5), v [B, 1, HV, V], f [B, 1, HV, K]
    the raw decay-gate input, beta_logit [B, 1, HV]; A_log [HV], dt_bias [HV * K]; pool_NHKV [N, HV, K, V] fp32,
    rows slots_B [B]. Per row b and head h (q/k head h // (HV / H)), in fp32:
        g = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias[h]));  beta = sigmoid(beta_logit)
        S = S * exp(g)[:, None];  u = beta * (v - k^T S);  S = S + k u^T;  o = q^T S
    Returns o [B, 1, HV, V] in v's dtype; pool rows slots_B hold the new S. This is fla's fused_recurrent_kda
    with the gate, beta's sigmoid and the L2 norm in the kernel (`kda_ops._decode_into_fla`), restated.
    """
    _, _, h, kd = q.shape
    hv = v.shape[2]
    group = hv // h
    qf = q[:, 0].float()
    kf = k[:, 0].float()
    qf = qf / torch.sqrt((qf * qf).sum(-1, keepdim=True) + 1e-6) * kd ** -0.5
    kf = kf / torch.sqrt((kf * kf).sum(-1, keepdim=True) + 1e-6)
    if group > 1:
        qf, kf = qf.repeat_interleave(group, dim=1), kf.repeat_interleave(group, dim=1)
    g = f[:, 0].float() + dt_bias.float().view(hv, kd)
    g = lower_bound * torch.sigmoid(torch.exp(A_log.float())[:, None] * g)  # [B, HV, K]
    beta = torch.sigmoid(beta_logit[:, 0].float())  # [B, HV]
    s = pool_NHKV.index_select(0, slots_B).float() * torch.exp(g)[..., None]
    u = (v[:, 0].float() - torch.einsum("bhkv,bhk->bhv", s, kf)) * beta[..., None]
    s = s + kf[..., None] * u[..., None, :]
    o = torch.einsum("bhkv,bhk->bhv", s, qf)
    pool_NHKV.index_copy_(0, slots_B, s.to(pool_NHKV.dtype))
    return o[:, None].to(v.dtype)


@triton.jit
def _kda_recurrent_step_kernel(q_ptr, k_ptr, v_ptr, f_ptr, beta_ptr, a_log_ptr, dt_bias_ptr, pool_ptr, slots_ptr,
                               o_ptr, N, lower_bound, scale, stride_qb, stride_kb, stride_vb, stride_fb, stride_bb,
                               H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                               BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    """Program (V block i_v, head i_hv, row b): the [K, BLOCK_V] tile of S of pool row slots[b], head i_hv.
    The state tile is loaded first (the only large read), then the per-head vectors and the gate; S is read and
    written once (evict-first: streamed, never reused by this step). Out-of-range slots read a zero state and
    write nothing (a bounds check on the host would sync)."""
    i_v = tl.program_id(0)
    i_hv = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    i_h = i_hv // (HV // H)
    o_k = tl.arange(0, BLOCK_K)
    o_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mk = o_k < K
    mv = o_v < V
    slot = tl.load(slots_ptr + b).to(tl.int64)
    slot_k = slot + tl.zeros([BLOCK_K], dtype=tl.int64)  # vector: the interpreter rejects scalar & tile masks
    mh = (mk & (slot_k >= 0) & (slot_k < N))[:, None] & mv[None, :]
    p_h = pool_ptr + slot_k[:, None] * (HV * K * V) + i_hv * (K * V) + o_k[:, None] * V + o_v[None, :]
    s = tl.load(p_h, mask=mh, other=0.0, eviction_policy="evict_first").to(tl.float32)

    q = tl.load(q_ptr + b * stride_qb + i_h * K + o_k, mask=mk, other=0.0).to(tl.float32)
    kk = tl.load(k_ptr + b * stride_kb + i_h * K + o_k, mask=mk, other=0.0).to(tl.float32)
    vv = tl.load(v_ptr + b * stride_vb + i_hv * V + o_v, mask=mv, other=0.0).to(tl.float32)
    f = tl.load(f_ptr + b * stride_fb + i_hv * K + o_k, mask=mk, other=0.0).to(tl.float32)
    bias = tl.load(dt_bias_ptr + i_hv * K + o_k, mask=mk, other=0.0).to(tl.float32)
    a = tl.exp(tl.load(a_log_ptr + i_hv).to(tl.float32))
    beta = tl.sigmoid(tl.load(beta_ptr + b * stride_bb + i_hv).to(tl.float32))
    q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
    kk = kk / tl.sqrt(tl.sum(kk * kk, axis=0) + 1e-6)
    g = lower_bound * tl.sigmoid(a * (f + bias))

    s = s * tl.exp(g)[:, None]
    u = (vv - tl.sum(s * kk[:, None], axis=0)) * beta
    s = s + kk[:, None] * u[None, :]
    o = tl.sum(s * q[:, None], axis=0)
    tl.store(o_ptr + b * (HV * V) + i_hv * V + o_v, o.to(o_ptr.dtype.element_ty), mask=mv)
    tl.store(p_h, s, mask=mh, eviction_policy="evict_first")


def kda_recurrent_step(q, k, v, f, beta_logit, A_log, dt_bias, lower_bound: float, pool_NHKV: torch.Tensor,
                       slots_B: torch.Tensor, *, block_v: int | None = None, num_warps: int | None = None
                       ) -> torch.Tensor:
    """One KDA decode token per row, the pooled fp32 state updated in place, in one launch (no host sync:
    capturable in a CUDA graph). Arguments, result and math as `kda_recurrent_step_reference` (the signature
    of `KDABackend.decode_into`); q/k/v/f/beta_logit need unit stride inside a row (else copied), pool_NHKV
    contiguous fp32. Rows of slots_B must be distinct except padding rows that share one scratch slot (whose
    contents are then undefined). `block_v` / `num_warps` override KDA_STEP_CONFIG.

    Numerics against the reference: the same fp32 operations in the same order per element, but the K sums
    run in another order and exp / sigmoid / sqrt / division are the GPU's (Triton's) approximations, so the
    state agrees to ~1e-6 relative and o to ~1 ulp of its dtype (tests/kernels/test_gpu_kda_recurrent.py states the
    tolerances)."""
    fn = "kda_recurrent_step"
    for name, t in (("q", q), ("k", k), ("v", v), ("f", f), ("beta_logit", beta_logit)):
        _check_tensor(fn, name, t, 4 if name != "beta_logit" else 3)
    _check_tensor(fn, "pool_NHKV", pool_NHKV, 4, dtypes=(torch.float32,), what="[N, HV, K, V] fp32")
    _check_tensor(fn, "slots_B", slots_B, 1, dtypes=SLOT_DTYPES, what="[B]")
    b, t, h, kd = q.shape
    hv, vd = v.shape[2], v.shape[3]
    n = pool_NHKV.shape[0]
    if t != 1 or tuple(k.shape) != (b, 1, h, kd) or tuple(v.shape[:2]) != (b, 1) or hv % h:
        raise ValueError(f"{fn}: q, k must be [B, 1, H, K] and v [B, 1, HV, V] with HV a multiple of H, got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if tuple(f.shape) != (b, 1, hv, kd) or tuple(beta_logit.shape) != (b, 1, hv):
        raise ValueError(f"{fn}: f must be [B, 1, HV, K] = {(b, 1, hv, kd)} and beta_logit [B, 1, HV], got "
                         f"{tuple(f.shape)} and {tuple(beta_logit.shape)}")
    if tuple(pool_NHKV.shape[1:]) != (hv, kd, vd) or not pool_NHKV.is_contiguous():
        raise ValueError(f"{fn}: pool_NHKV must be a contiguous [N, {hv}, {kd}, {vd}] fp32 tensor, got "
                         f"{tuple(pool_NHKV.shape)}")
    if A_log.numel() != hv or dt_bias.numel() != hv * kd or slots_B.shape[0] != b:
        raise ValueError(f"{fn}: A_log must hold HV = {hv} values, dt_bias HV * K = {hv * kd}, slots_B B = {b}; "
                         f"got {A_log.numel()}, {dt_bias.numel()}, {slots_B.shape[0]}")
    _same_device(fn, "q", q, k=k, v=v, f=f, beta_logit=beta_logit, A_log=A_log, dt_bias=dt_bias,
                 pool_NHKV=pool_NHKV, slots_B=slots_B)
    rows = [x.reshape(b, -1) for x in (q, k, v, f, beta_logit)]
    rows = [x if x.stride(-1) == 1 else x.contiguous() for x in rows]
    out = torch.empty(b, 1, hv, vd, dtype=v.dtype, device=v.device)
    if b == 0:
        return out
    bv = min(block_v or KDA_STEP_CONFIG["block_v"], triton.next_power_of_2(vd))
    warps = num_warps or KDA_STEP_CONFIG["num_warps"]
    with _on_device(q):
        _kda_recurrent_step_kernel[(triton.cdiv(vd, bv), hv, b)](
            *rows[:4], rows[4], A_log.contiguous(), dt_bias.contiguous(), pool_NHKV, slots_B.contiguous(), out,
            n, float(lower_bound), kd ** -0.5, *(x.stride(0) for x in rows),
            H=h, HV=hv, K=kd, V=vd, BLOCK_K=triton.next_power_of_2(kd), BLOCK_V=bv, num_warps=warps)
    return out
