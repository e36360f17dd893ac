"""The MoE router (`TopKRouter`, `miles_k3.model.moe`) in one forward-only Triton launch.

Today's router is ~10 launches per MoE layer (x.float(), weight.float(), an fp32 GEMM, sigmoid, + bias, topk,
gather, sum, div, * scaling); in the captured decode step, which is launch-bound, that is ~20 us per layer. This
kernel does the whole chain in one launch, for inference only (no autograd: `TopKRouter.forward` uses it on
CUDA when no gradient is needed; training keeps the torch code).

| kernel (one launch) | reference (pure torch, here) = today's `TopKRouter.forward` math |
| --- | --- |
| `topk_route(x_ND, weight_ED, bias_E, top_k, renormalize, scaling)` | `topk_route_reference` (same arguments) |

Legend for tensor suffixes: N tokens (flattened B*T), D hidden size, E experts, K = top_k experts per token.
Accepted dtypes: x and weight float32, bfloat16 or float16 (`ACT_DTYPES`, independently); the selection bias
(`e_score_correction_bias`, fp32 in the checkpoint) any of those too. Outputs: ids int64 [N, K], weights fp32
[N, K].

Definition (both): logits = x32 @ W32^T (fp32), scores = sigmoid(logits), biased = scores + bias (selection
only), ids = the K experts of largest biased score, w = scores[ids], renormalised w / (sum_K w + 1e-20) if
`renormalize`, times `scaling`.

Kernel: one program per block of BLOCK_N (16) tokens. It accumulates logits [BLOCK_N, E_PAD] (E padded to a
power of two >= 16, the padding masked out) with `tl.dot` over D in tiles of BLOCK_D, then runs K rounds of
(max of the biased scores still available, the lowest expert id among the ties, take it out) and writes
ids / weights. Ids come out in descending biased-score order (ties: lower id first). The reference's order
is torch.topk(sorted=False)'s, which is unspecified; downstream (`RoutedExperts`) only the set and each id's
weight matter, up to the fp32 summation order of the expert outputs.

Numerics: the dot accumulates in fp32. x and weight of one 16-bit dtype are fed to the tensor cores as they are
(16-bit x 16-bit products are exact in fp32, as in the reference's fp32 GEMM of the same values); any other
combination (fp32, or mixed dtypes) is cast to fp32 in registers and multiplied with input_precision="ieee" (no
TF32). The sum over D runs in another order than torch's GEMM, so the logits differ by ~1e-6 absolute (D = 7168,
logits of std ~2); sigmoid / division use the GPU's fast approximations. Hence: weights within ~1e-6 relative
of the reference on the same ids, and the selected set equals the reference's except where the reference's
K-th and (K+1)-th biased scores are within ~1e-5 (near-ties: either choice is "the" top-K up to rounding).
NaN scores (a NaN input row) sort above everything, like torch.topk; every token always gets K distinct ids in
[0, E) (biases of -inf included).
Batch invariance: the tile shapes do not depend on N, so a token's ids and weights do not depend on which
other tokens share its launch.

Cost: every program reads all of W (from L2 after the first): E * D * 2 bytes, 98 KB at k3_m (D = 768, E = 64),
5.5 MB at D = 7168, E = 384 (14 MB at E = 896). At k3_m that is ~1-2 us. At K3 sizes a single-token decode
step is bound by one SM streaming W (the grid has cdiv(N, 16) programs): likely tens of microseconds, possibly
slower than the cuBLAS GEMM it replaces (unmeasured; a split-E / split-D variant would fix it). Large N
(prefill under no_grad) re-reads W once per 16 tokens from L2.

This module imports torch and triton only; launching the kernel needs CUDA tensors (or `TRITON_INTERPRET=1`,
set before this module is imported, for CPU tensors; note that the interpreter's bf16 `tl.dot` is wrong, so
interpreter tests use fp32 / fp16 inputs).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from miles_k3.kernels.fused import ACT_DTYPES, _interpreting, _on_device, _sigmoid

MAX_EXPERTS = 1024  # E_PAD <= 1024: the [BLOCK_N, E_PAD] fp32 logits tile lives in registers (K3: E = 896)
MAX_TOP_K = 32  # K selection rounds, unrolled
BLOCK_N = 16  # tokens per program (tl.dot needs M >= 16); fixed, so routing is batch invariant
_W_TILE = 16384  # weight elements per D tile: E_PAD * BLOCK_D (32 KB of bf16 per pipeline stage)


# ---- reference ---------------------------------------------------------------------------------------------
def topk_route_reference(x_ND: torch.Tensor, weight_ED: torch.Tensor, bias_E: torch.Tensor, top_k: int,
                         renormalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure torch, any device, differentiable in x and weight: `TopKRouter.forward`, op for op.

    x_ND [N, D], weight_ED [E, D], bias_E [E] (selection only) -> (ids [N, K] int64 in torch.topk(sorted=False)
    order, weights [N, K] fp32)."""
    scores_NE = torch.sigmoid(x_ND.float() @ weight_ED.float().t())
    biased_NE = scores_NE.detach() + bias_E.float()
    ids_NK = torch.topk(biased_NE, top_k, dim=-1, sorted=False).indices
    w_NK = scores_NE.gather(-1, ids_NK)
    if renormalize:
        w_NK = w_NK / (w_NK.sum(-1, keepdim=True) + 1e-20)
    return ids_NK, w_NK * scaling


# ---- kernel ------------------------------------------------------------------------------------------------
@triton.jit
def _topk_route_kernel(x_ptr, w_ptr, bias_ptr, ids_ptr, out_ptr, N, D, E, stride_xn, stride_we, scaling,
                       K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
                       BLOCK_D: tl.constexpr, NUM_D_TILES: tl.constexpr, EVEN_D: tl.constexpr,
                       DOT_F32: tl.constexpr, RENORM: tl.constexpr):
    """Program p: tokens p*BLOCK_N .. +BLOCK_N. logits [BLOCK_N, BLOCK_E] = x @ W^T over NUM_D_TILES tiles of
    BLOCK_D (a constexpr trip count; the tail tile is masked unless EVEN_D); then K selection rounds on the
    biased scores. Padded experts (e >= E) are never available; padded tokens (n >= N) are not stored."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    rows64 = rows.to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    emask = experts < E
    ds = tl.arange(0, BLOCK_D)
    x_rows = x_ptr + rows64[:, None] * stride_xn  # [BLOCK_N, 1]
    w_cols = w_ptr + experts.to(tl.int64)[None, :] * stride_we  # [1, BLOCK_E]: W^T tiles [BLOCK_D, BLOCK_E]
    acc = tl.zeros([BLOCK_N, BLOCK_E], dtype=tl.float32)
    for t in range(NUM_D_TILES):
        d = t * BLOCK_D + ds
        if EVEN_D:
            xt = tl.load(x_rows + d[None, :], mask=rmask[:, None], other=0.0)
            wt = tl.load(w_cols + d[:, None], mask=emask[None, :], other=0.0)
        else:
            dmask = d < D
            xt = tl.load(x_rows + d[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0)
            wt = tl.load(w_cols + d[:, None], mask=dmask[:, None] & emask[None, :], other=0.0)
        if DOT_F32:
            acc = tl.dot(xt.to(tl.float32), wt.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(xt, wt, acc)

    scores = _sigmoid(acc)
    bias = tl.load(bias_ptr + experts, mask=emask, other=0.0).to(tl.float32)
    key = scores + bias[None, :]
    key = tl.where(key != key, float("inf"), key)  # noqa: PLR0124 - NaN sorts above everything (torch.topk)
    eid = experts[None, :] + tl.zeros([BLOCK_N, BLOCK_E], dtype=tl.int32)
    avail = eid < E
    ks = tl.arange(0, K_PAD)[None, :]
    ids_t = tl.zeros([BLOCK_N, K_PAD], dtype=tl.int32)
    w_t = tl.zeros([BLOCK_N, K_PAD], dtype=tl.float32)
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k in tl.static_range(K):
        best = tl.max(tl.where(avail, key, float("-inf")), axis=1)
        # the lowest available id holding the maximum (K <= E: some expert is always available, and every
        # available key compares equal to itself, -inf included)
        idx = tl.min(tl.where(avail & (key == best[:, None]), eid, BLOCK_E), axis=1)
        sel = eid == idx[:, None]
        wk = tl.sum(tl.where(sel, scores, 0.0), axis=1)
        avail = avail & (eid != idx[:, None])
        ids_t = tl.where(ks == k, idx[:, None], ids_t)
        w_t = tl.where(ks == k, wk[:, None], w_t)
        total += wk
    if RENORM:
        w_t = w_t / (total + 1e-20)[:, None]
    w_t = w_t * scaling
    omask = rmask[:, None] & (ks < K)
    offs = rows64[:, None] * K + ks
    tl.store(ids_ptr + offs, ids_t.to(tl.int64), mask=omask)
    tl.store(out_ptr + offs, w_t, mask=omask)


# ---- entry point -------------------------------------------------------------------------------------------
def _check_tensor(fn: str, name: str, t, dims: int, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in ACT_DTYPES:
        raise ValueError(f"{fn}: {name} must be float32, bfloat16 or float16, got {t.dtype}; "
                         f"use {fn}_reference for other dtypes")
    if t.dim() != dims:
        raise ValueError(f"{fn}: {name} must be {what} ({dims} dims), got shape {tuple(t.shape)}")
    if not _interpreting() and not t.is_cuda:
        raise ValueError(f"{fn}: {name} must be a CUDA tensor, got {t.device}; use {fn}_reference on other "
                         "devices")


def _pow2(fn: str, name: str, v: int | None) -> None:
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 16 or v & (v - 1)):
        raise ValueError(f"{fn}: {name} must be a power of two >= 16, got {v!r}")


def topk_route(x_ND: torch.Tensor, weight_ED: torch.Tensor, bias_E: torch.Tensor, top_k: int,
               renormalize: bool, scaling: float, *, block_d: int | None = None,
               block_n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid top-k routing in one Triton launch: (ids [N, K] int64, weights [N, K] fp32).

    x_ND [N, D] (rows need unit stride along D, else copied), weight_ED [E, D] (the gate weight; likewise),
    bias_E [E] (the selection-only correction bias), each float32 / bfloat16 / float16, on one CUDA device (any
    device under TRITON_INTERPRET=1). 1 <= top_k <= min(E, MAX_TOP_K), E <= MAX_EXPERTS. Ids are in
    descending biased-score order, ties to the lower id (module docstring: how this relates to the reference's
    order, and the numerics). No host synchronisation: capturable in a CUDA graph once compiled.
    `block_d` / `block_n` (powers of two >= 16) override the tiles, for tests.
    """
    fn = "topk_route"
    _check_tensor(fn, "x_ND", x_ND, 2, "[N, D]")
    _check_tensor(fn, "weight_ED", weight_ED, 2, "[E, D]")
    _check_tensor(fn, "bias_E", bias_E, 1, "[E]")
    n, d = x_ND.shape
    e = weight_ED.shape[0]
    if weight_ED.shape[1] != d:
        raise ValueError(f"{fn}: weight_ED must be [E, D] with D = {d} (x_ND's width), got "
                         f"{tuple(weight_ED.shape)}")
    if d < 1 or e < 1:
        raise ValueError(f"{fn}: need D >= 1 and E >= 1, got D = {d}, E = {e}")
    if e > MAX_EXPERTS:
        raise ValueError(f"{fn}: E = {e} experts exceeds MAX_EXPERTS = {MAX_EXPERTS}; use {fn}_reference")
    if bias_E.shape[0] != e:
        raise ValueError(f"{fn}: bias_E must have shape [{e}] (E), got {tuple(bias_E.shape)}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= min(e, MAX_TOP_K):
        raise ValueError(f"{fn}: top_k must be an int in [1, min(E, {MAX_TOP_K})] = [1, {min(e, MAX_TOP_K)}], "
                         f"got {top_k!r}")
    scaling = float(scaling)
    if not math.isfinite(scaling):
        raise ValueError(f"{fn}: scaling must be a finite number, got {scaling}")
    _pow2(fn, "block_d", block_d)
    _pow2(fn, "block_n", block_n)
    for name, t in (("weight_ED", weight_ED), ("bias_E", bias_E)):
        if t.device != x_ND.device:
            raise ValueError(f"{fn}: {name} ({t.device}) must be on x_ND's device ({x_ND.device})")
    dev = x_ND.device
    ids = torch.empty(n, top_k, dtype=torch.int64, device=dev)
    w = torch.empty(n, top_k, dtype=torch.float32, device=dev)
    if n == 0:
        return ids, w
    x = x_ND if x_ND.stride(1) == 1 or d == 1 else x_ND.contiguous()
    wt = weight_ED if weight_ED.stride(1) == 1 or d == 1 else weight_ED.contiguous()
    bias = bias_E if bias_E.stride(0) == 1 or e == 1 else bias_E.contiguous()
    block_e = max(16, triton.next_power_of_2(e))
    bd = block_d or max(16, min(128, _W_TILE // block_e, triton.next_power_of_2(d)))
    bn = block_n or BLOCK_N
    dot_f32 = x.dtype != wt.dtype or x.dtype == torch.float32
    with _on_device(x_ND):
        _topk_route_kernel[(triton.cdiv(n, bn),)](
            x, wt, bias, ids, w, n, d, e, x.stride(0), wt.stride(0), scaling,
            K=top_k, K_PAD=max(2, triton.next_power_of_2(top_k)), BLOCK_N=bn, BLOCK_E=block_e, BLOCK_D=bd,
            NUM_D_TILES=triton.cdiv(d, bd), EVEN_D=d % bd == 0, DOT_F32=dot_f32, RENORM=bool(renormalize),
            num_warps=max(4, min(16, bn * block_e // 1024)), num_stages=2 if dot_f32 else 3)
    return ids, w
