"""The one-launch MoE router (`miles_k3.kernels.router.topk_route`) against its pure-torch reference, and the
reference against today's `TopKRouter`.

CPU: `topk_route_reference` equals `TopKRouter.forward`'s torch path bit for bit (and differentiates alike);
every kernel case runs once under the Triton interpreter, in one subprocess (TRITON_INTERPRET=1 must be set
before the kernel module is imported), each case reported as its own test: fp32 and fp16 inputs (the
interpreter's bf16 `tl.dot` is wrong; bf16 x only through the fp32 path of mixed dtypes), E = 64, 48 (not a
power of two), 384 and 896, D = 768 and D not a multiple of the tile, K = 1, 4, 8, 16, renormalize on / off,
scaling != 1, a bias that changes the selection, N = 1 and N not a multiple of the 16-token block, strided
views, exact ties, -inf biases, a NaN row, and `TopKRouter`'s kernel branch; argument validation.
GPU (`python -m pytest -m gpu tests/kernels/test_router_kernel.py`): bf16 at k3_m shapes (N = 1, 64, 256, 512; D = 768,
E = 64, K = 4), at D = 7168, E = 384, K = 8 and at the real K3 config (E = 896, K = 16); fp32 / fp16; one launch
(profiler); CUDA-graph capture / replay equals eager bit for bit; `TopKRouter` takes the kernel under no_grad /
inference_mode and the torch path with autograd or under `reference_kernels()`.

References are evaluated on CPU copies of the inputs (plain fp32 GEMM, never TF32).

Criteria (`check_route`), per token:
  * ids: int64, K distinct values in [0, E), in descending order of the reference's biased score (up to
    `tie_tol`).
  * the set of ids equals the reference's, except where the reference's K-th and (K+1)-th largest biased scores
    are within `tie_tol` (a near-tie: both sides compute the logits in fp32 in different orders, ~1e-6 apart
    at D = 7168, so either choice is the top-K up to rounding). There every chosen id must still be within
    `tie_tol` of the reference's K-th score, and such tokens may be at most max(2, N / 50).
  * weights: within `rel_tol` relative of the reference's weight for the same id (tokens with the reference's
    set), or of the reference formula on the kernel's ids (near-tie tokens). fp32 inputs in the interpreter:
    1e-6 (measured <= 4e-7); GPU: 1e-5 (simulated blocked-fp32 accumulation at D = 7168: <= 3e-7; the selected
    scores are large, so d(sigmoid) / sigmoid = (1 - s) d(logit) is small).
"""
from __future__ import annotations

import pytest
import torch
from kernel_testing import capture, cuda_kernels, gpu_test, print_results
from torch import nn

from miles_k3.kernels.router import topk_route_reference
from miles_k3.model.moe import TopKRouter

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
K3M = {"d": 768, "e": 64, "k": 4}  # k3_m: hidden 768, 64 experts, top-4, renormalised, scaling 1
K2 = {"d": 7168, "e": 384, "k": 8}  # the brief's "K3" shape (Kimi-K2 / DeepSeek-V3 sized router)
K3 = {"d": 7168, "e": 896, "k": 16}  # miles_k3/model/configs/k3.json


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _inputs(n: int, d: int, e: int, dtype: torch.dtype, w_dtype: torch.dtype | None = None,
            bias_dtype: torch.dtype = F32, bias: float = 0.1, logit_std: float = 2.0, seed: int = 0):
    """x ~ N(0, 1) [N, D], W ~ N(0, logit_std^2 / D) [E, D] (logits of std ~logit_std), bias ~ N(0, bias^2)."""
    g = _gen(seed)
    x = torch.randn(n, d, generator=g).to(dtype)
    w = (torch.randn(e, d, generator=g) * (logit_std / d ** 0.5)).to(w_dtype or dtype)
    b = (torch.randn(e, generator=g) * bias).to(bias_dtype)
    return x, w, b


# ---- the comparison (device-agnostic) ----------------------------------------------------------------------
def compare_route(ids: torch.Tensor, w: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                  k: int, renormalize: bool, scaling: float, tie_tol: float, rel_tol: float,
                  what: str) -> int:
    """Checks the kernel's (ids, w) against the reference on CPU copies (criteria: module docstring). Returns
    the number of near-tie tokens whose set differs from the reference's."""
    x, weight, bias, ids, w = (t.detach().cpu() for t in (x, weight, bias, ids, w))
    n, e = x.shape[0], weight.shape[0]
    assert ids.dtype == torch.int64 and w.dtype == torch.float32, (what, ids.dtype, w.dtype)
    assert ids.shape == (n, k) and w.shape == (n, k), (what, ids.shape, w.shape)
    if n == 0:
        return 0
    assert bool(((ids >= 0) & (ids < e)).all()), f"{what}: ids out of [0, {e})"
    srt = ids.sort(1).values
    assert bool((srt[:, 1:] != srt[:, :-1]).all()), f"{what}: repeated ids within a token"
    scores = torch.sigmoid(x.float() @ weight.float().t())
    biased = scores + bias.float()
    ref_ids, ref_w = topk_route_reference(x, weight, bias, k, renormalize, scaling)
    got_b = biased.gather(1, ids)
    assert bool((got_b[:, 1:] <= got_b[:, :-1] + tie_tol).all()), f"{what}: ids not in descending biased order"
    top = biased.sort(1, descending=True).values
    kth = top[:, k - 1]
    gap = kth - top[:, k] if k < e else torch.full((n,), float("inf"))
    same = (srt == ref_ids.sort(1).values).all(1)
    near = ~(gap > tie_tol)
    bad = ~same & ~near
    if bool(bad.any()):
        t = int(bad.nonzero()[0])
        raise AssertionError(f"{what}: {int(bad.sum())} of {n} tokens select another set; first token {t}: "
                             f"got {sorted(ids[t].tolist())}, ref {sorted(ref_ids[t].tolist())}, K-th gap "
                             f"{gap[t].item():.3g}")
    flips = ~same & near
    assert bool((got_b[flips] >= kth[flips, None] - tie_tol).all()), f"{what}: a near-tie choice is not top-K"
    assert int(flips.sum()) <= max(2, n // 50), f"{what}: {int(flips.sum())} of {n} near-tie tokens differ"
    # expected weights: the reference's per id where the sets agree, its formula on our ids elsewhere
    order, ref_order = ids.argsort(1), ref_ids.argsort(1)
    want = torch.empty_like(w).scatter_(1, order, ref_w.gather(1, ref_order))  # the ref's weights, our order
    if bool(flips.any()):
        s = scores[flips].gather(1, ids[flips])
        if renormalize:
            s = s / (s.sum(-1, keepdim=True) + 1e-20)
        want[flips] = s * scaling
    assert not bool(w.isnan().any()), f"{what}: NaN weights"
    err = (w - want).abs()
    bad_w = err > rel_tol * want.abs() + 1e-30
    if bool(bad_w.any()):
        i = int(bad_w.reshape(-1).nonzero()[0])
        raise AssertionError(f"{what}: {int(bad_w.sum())} of {w.numel()} weights out of {rel_tol} relative "
                             f"(max {float((err / want.abs()).max()):.3g}); first at {divmod(i, k)}: got "
                             f"{w.reshape(-1)[i].item()!r}, want {want.reshape(-1)[i].item()!r}")
    return int(flips.sum())


# ---- the checks (device-agnostic: run under the interpreter on CPU, and on CUDA) ---------------------------
def check_route(device: str, dtype: torch.dtype, n: int, d: int, e: int, k: int, renormalize: bool = True,
                scaling: float = 1.0, w_dtype: torch.dtype | None = None, bias_dtype: torch.dtype = F32,
                bias: float = 0.1, strided: bool = False, block_d: int | None = None,
                block_n: int | None = None, tie_tol: float = 1e-6, rel_tol: float = 1e-6,
                seed: int = 0) -> int:
    """One topk_route call on random inputs (bias 0.1: it changes the selection of many tokens, asserted for
    N >= 16 when K < E), compared by `compare_route`. strided: x and weight are column slices of wider tensors
    (row strides != D)."""
    from miles_k3.kernels.router import topk_route

    x, w, b = _inputs(n, d, e, dtype, w_dtype, bias_dtype, bias, seed=seed)
    if strided:
        x = torch.cat([torch.zeros(n, 5, dtype=x.dtype), x, torch.zeros(n, 3, dtype=x.dtype)], 1)[:, 5:5 + d]
        w = torch.cat([w, torch.zeros(e, 7, dtype=w.dtype)], 1)[:, :d]
        assert x.stride(0) != d and w.stride(0) != d
    xd, wd, bd = x.to(device), w.to(device), b.to(device)
    if strided:  # .to(device) may not keep the strides: build the views on the device
        xd = torch.zeros(n, d + 8, dtype=x.dtype, device=device)[:, 5:5 + d].copy_(x)
        wd = torch.zeros(e, d + 7, dtype=w.dtype, device=device)[:, :d].copy_(w)
    ids, wt = topk_route(xd, wd, bd, k, renormalize, scaling, block_d=block_d, block_n=block_n)
    assert ids.device == xd.device and wt.device == xd.device
    what = (f"topk_route x={dtype} w={w_dtype or dtype} bias={bias_dtype} N={n} D={d} E={e} K={k} "
            f"renorm={renormalize} scaling={scaling} strided={strided} block_d={block_d} block_n={block_n}")
    if bias and n >= 16 and k < e:
        plain = topk_route_reference(x, w, torch.zeros_like(b), k, renormalize, scaling)[0].sort(1).values
        biased = topk_route_reference(x, w, b, k, renormalize, scaling)[0].sort(1).values
        assert bool((plain != biased).any(1).any()), f"{what}: the bias changes no selection (weak test)"
    return compare_route(ids, wt, x, w, b, k, renormalize, scaling, tie_tol, rel_tol, what)


def check_special_values(device: str, dtype: torch.dtype = F32) -> None:
    """The documented choices where the reference's order is unspecified: exact ties go to the lowest ids (in
    increasing order), -inf biases are chosen last (lowest ids first), a NaN row gets ids 0..K-1 (NaN sorts
    above everything, as in torch.topk) with NaN weights and leaves the other rows alone."""
    from miles_k3.kernels.router import topk_route

    n, d, e, k = 5, 40, 24, 6
    # all-zero weight: every score is sigmoid(0) = 0.5, all tied
    x = torch.randn(n, d, generator=_gen(0)).to(dtype).to(device)
    ids, w = topk_route(x, torch.zeros(e, d, dtype=dtype, device=device), torch.zeros(e, device=device), k,
                        True, 2.0)
    assert torch.equal(ids.cpu(), torch.arange(k).expand(n, k)), ids
    assert torch.equal(w.cpu(), torch.full((n, k), 2.0 / k)), w  # (0.5 / (6 * 0.5)) * 2, exactly
    # biases: three finite experts (ids 20, 3, 11, in this order of biased score), the rest -inf
    xs, ws, _ = _inputs(n, d, e, dtype, seed=1)
    bias = torch.full((e,), float("-inf"))
    bias[[20, 3, 11]] = torch.tensor([30.0, 20.0, 10.0])
    ids, w = topk_route(xs.to(device), ws.to(device), bias.to(device), k, False, 1.5)
    assert torch.equal(ids.cpu(), torch.tensor([20, 3, 11, 0, 1, 2]).expand(n, k)), ids
    scores = torch.sigmoid(xs.float() @ ws.float().t())
    torch.testing.assert_close(w.cpu(), scores.gather(1, ids.cpu()) * 1.5, rtol=1e-6, atol=0)
    # a NaN row
    xn = xs.clone()
    xn[2, 7] = float("nan")
    b = torch.randn(e, generator=_gen(2)) * 0.1
    ids, w = topk_route(xn.to(device), ws.to(device), b.to(device), k, True, 1.0)
    ids, w = ids.cpu(), w.cpu()
    assert torch.equal(ids[2], torch.arange(k)) and bool(w[2].isnan().all()), (ids[2], w[2])
    keep = torch.tensor([0, 1, 3, 4])
    compare_route(ids[keep], w[keep], xs[keep], ws, b, k, True, 1.0, 1e-6, 1e-6, "NaN row: other rows")


def check_router_module_branch(device: str) -> None:
    """`TopKRouter.forward`'s kernel branch (use_fused_kernels patched to True, as on CUDA under no_grad) gives
    the module's torch path up to the kernel's criteria; the kernel gets the module's own arguments."""
    from miles_k3.model import moe

    torch.manual_seed(0)
    router = TopKRouter(hidden=96, num_experts=48, top_k=4, renormalize=True, scaling=2.5)
    nn.init.normal_(router.weight, std=2 / 96 ** 0.5)
    with torch.no_grad():
        router.e_score_correction_bias.normal_(0, 0.1)
    router = router.to(device)
    x = torch.randn(21, 96).to(device)
    with torch.no_grad():
        want = router(x)  # torch path (CPU)
        real = moe.use_fused_kernels
        moe.use_fused_kernels = lambda *a: True
        try:
            ids, w = router(x)
        finally:
            moe.use_fused_kernels = real
    assert torch.equal(ids.sort(1).values, want[0].sort(1).values)  # the order may differ, not the set
    compare_route(ids, w, x, router.weight, router.e_score_correction_bias, 4, True, 2.5, 1e-6, 1e-6,
                  "TopKRouter kernel branch")


# ---- CPU: the checks under the Triton interpreter, in one subprocess ---------------------------------------
INTERPRETER_CASES: dict[str, tuple] = {}  # name -> (check, kwargs); on CPU tensors under TRITON_INTERPRET=1
for _n, _dt in (("fp32", F32), ("fp16", F16)):
    INTERPRETER_CASES |= {
        f"{_n}-k3m-N1": (check_route, {"dtype": _dt, "n": 1, **K3M}),
        f"{_n}-k3m-N37-norenorm-scaled": (check_route, {"dtype": _dt, "n": 37, **K3M, "renormalize": False,
                                                        "scaling": 2.5, "seed": 1}),
        f"{_n}-E48-D100-K8-N33-scaled": (check_route, {"dtype": _dt, "n": 33, "d": 100, "e": 48, "k": 8,
                                                       "scaling": 2.5, "seed": 2}),
        f"{_n}-E384-D768-K8-N17": (check_route, {"dtype": _dt, "n": 17, "d": 768, "e": 384, "k": 8,
                                                 "seed": 3}),
        f"{_n}-E48-D768-K1-N20": (check_route, {"dtype": _dt, "n": 20, "d": 768, "e": 48, "k": 1,
                                                "scaling": 2.5, "seed": 4}),
        f"{_n}-E64-D200-K1-N16-norenorm": (check_route, {"dtype": _dt, "n": 16, "d": 200, "e": 64, "k": 1,
                                                         "renormalize": False, "seed": 5}),
    }
INTERPRETER_CASES |= {
    "fp32-E896-K16-D96-N18": (check_route, {"dtype": F32, "n": 18, "d": 96, "e": 896, "k": 16, "seed": 6}),
    "fp32-k3m-blocks-d16-n32": (check_route, {"dtype": F32, "n": 45, **K3M, "block_d": 16, "block_n": 32,
                                              "seed": 7}),
    "fp16-E48-D100-block_d64-tail": (check_route, {"dtype": F16, "n": 19, "d": 100, "e": 48, "k": 4,
                                                   "block_d": 64, "renormalize": False, "seed": 8}),
    "bf16x-fp32w-bf16bias": (check_route, {"dtype": BF16, "w_dtype": F32, "bias_dtype": BF16, "n": 23, **K3M,
                                           "seed": 9}),
    "fp16x-bf16w": (check_route, {"dtype": F16, "w_dtype": BF16, "n": 17, "d": 100, "e": 48, "k": 8,
                                  "seed": 10}),
    "fp32-strided": (check_route, {"dtype": F32, "n": 18, "d": 100, "e": 48, "k": 4, "strided": True,
                                   "seed": 11}),
    "fp32-K-equals-E": (check_route, {"dtype": F32, "n": 5, "d": 64, "e": 8, "k": 8, "scaling": 0.5,
                                      "seed": 12}),
    "fp32-no-bias": (check_route, {"dtype": F32, "n": 21, **K3M, "bias": 0.0, "seed": 13}),
    "special-values-fp32": (check_special_values, {"dtype": F32}),
    "special-values-fp16": (check_special_values, {"dtype": F16}),
    "router-module-branch": (check_router_module_branch, {}),
}


@pytest.mark.parametrize("case", list(INTERPRETER_CASES))
def test_kernel_under_interpreter(case, interpreter_results):
    assert interpreter_results[case] == "ok", interpreter_results[case]


# ---- CPU: the reference is today's TopKRouter ----------------------------------------------------------------
def _router(dtype: torch.dtype, renormalize: bool, scaling: float, e: int = 16, k: int = 4, d: int = 32,
            seed: int = 0) -> TopKRouter:
    torch.manual_seed(seed)
    router = TopKRouter(hidden=d, num_experts=e, top_k=k, renormalize=renormalize, scaling=scaling)
    nn.init.normal_(router.weight, std=2 / d ** 0.5)
    with torch.no_grad():
        router.e_score_correction_bias.normal_(0, 0.1)
    router.weight.data = router.weight.data.to(dtype)  # as K3Model: gate weight in the model dtype, bias fp32
    return router


@pytest.mark.parametrize("renormalize,scaling", [(True, 1.0), (False, 1.0), (True, 2.5)],
                         ids=["renorm", "no-renorm", "scaled"])
@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=["fp32", "bf16", "fp16"])
def test_reference_is_topk_router_bitwise(dtype, renormalize, scaling):
    router = _router(dtype, renormalize, scaling)
    x = torch.randn(37, 32, generator=_gen(1)).to(dtype)
    with torch.no_grad():
        ids, w = router(x)
        rids, rw = topk_route_reference(x, router.weight, router.e_score_correction_bias, router.top_k,
                                        renormalize, scaling)
    assert ids.dtype == rids.dtype == torch.int64 and w.dtype == rw.dtype == F32
    assert torch.equal(ids, rids) and torch.equal(w.view(torch.int32), rw.view(torch.int32))
    # with autograd: same values, same gradients in x and weight (the bias gets none)
    router.weight.data = router.weight.data.float()
    xg = x.float().requires_grad_()
    ids, w = router(xg)
    gx, gw = torch.autograd.grad((w * torch.arange(4.0)).sum(), [xg, router.weight])
    xr = x.float().requires_grad_()
    wr = router.weight.detach().clone().requires_grad_()
    rids, rw = topk_route_reference(xr, wr, router.e_score_correction_bias, router.top_k, renormalize, scaling)
    rgx, rgw = torch.autograd.grad((rw * torch.arange(4.0)).sum(), [xr, wr])
    assert torch.equal(ids, rids) and torch.equal(w, rw) and torch.equal(gx, rgx) and torch.equal(gw, rgw)


def test_router_on_cpu_never_calls_the_kernel(monkeypatch):
    import miles_k3.kernels.router as router_mod

    def boom(*a, **kw):
        raise AssertionError("kernel called on CPU")

    monkeypatch.setattr(router_mod, "topk_route", boom)
    router = _router(BF16, True, 1.0)
    with torch.no_grad():
        router(torch.randn(5, 32).to(BF16))
    router(torch.randn(5, 32).to(BF16))


def test_entry_point_validates(monkeypatch):
    from miles_k3.kernels import router as rk

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, w, b = torch.zeros(3, 8), torch.zeros(6, 8), torch.zeros(6)
    with pytest.raises(ValueError, match="CUDA"):
        rk.topk_route(x, w, b, 2, True, 1.0)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # past the device check: shape / argument errors (no launch)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        rk.topk_route(x.double(), w, b, 2, True, 1.0)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        rk.topk_route(x, w, b.double(), 2, True, 1.0)
    with pytest.raises(TypeError, match="torch.Tensor"):
        rk.topk_route(x.numpy(), w, b, 2, True, 1.0)
    with pytest.raises(ValueError, match=r"\[N, D\]"):
        rk.topk_route(x[None], w, b, 2, True, 1.0)
    with pytest.raises(ValueError, match="D = 8"):
        rk.topk_route(x, torch.zeros(6, 9), b, 2, True, 1.0)
    with pytest.raises(ValueError, match=r"bias_E must have shape \[6\]"):
        rk.topk_route(x, w, torch.zeros(5), 2, True, 1.0)
    for k in (0, 7, 2.0, True):
        with pytest.raises(ValueError, match="top_k"):
            rk.topk_route(x, w, b, k, True, 1.0)
    with pytest.raises(ValueError, match="top_k"):
        rk.topk_route(torch.zeros(1, 8), torch.zeros(64, 8), torch.zeros(64), rk.MAX_TOP_K + 1, True, 1.0)
    with pytest.raises(ValueError, match="MAX_EXPERTS"):
        rk.topk_route(x, torch.zeros(rk.MAX_EXPERTS + 1, 8), torch.zeros(rk.MAX_EXPERTS + 1), 2, True, 1.0)
    with pytest.raises(ValueError, match="scaling"):
        rk.topk_route(x, w, b, 2, True, float("inf"))
    with pytest.raises(ValueError, match="block_d"):
        rk.topk_route(x, w, b, 2, True, 1.0, block_d=24)
    with pytest.raises(ValueError, match="block_n"):
        rk.topk_route(x, w, b, 2, True, 1.0, block_n=8)
    ids, wt = rk.topk_route(x[:0], w, b, 2, True, 1.0)  # empty: no launch
    assert ids.shape == wt.shape == (0, 2) and ids.dtype == torch.int64 and wt.dtype == F32


# ---- GPU ---------------------------------------------------------------------------------------------------
GPU_TOL = {"tie_tol": 1e-5, "rel_tol": 1e-5}


@pytest.mark.parametrize("n", [1, 64, 256, 512])
@gpu_test
def test_gpu_topk_route_k3m_bf16(n):
    flips = check_route("cuda", BF16, n, **K3M, seed=n, **GPU_TOL)
    flips += check_route("cuda", BF16, n, **K3M, bias=0.3, scaling=2.5, seed=n + 1, **GPU_TOL)
    print(f"k3_m N={n}: {flips} near-tie tokens chose another set")


@pytest.mark.parametrize("n", [1, 64, 256, 512])
@pytest.mark.parametrize("shape", ["K2", "K3"])
@gpu_test
def test_gpu_topk_route_big_bf16(shape, n):
    dims = {"K2": K2, "K3": K3}[shape]
    flips = check_route("cuda", BF16, n, **dims, scaling=2.5, seed=n, **GPU_TOL)
    flips += check_route("cuda", BF16, n, **dims, renormalize=False, seed=n + 1, **GPU_TOL)
    print(f"{shape} N={n}: {flips} near-tie tokens chose another set")


@pytest.mark.parametrize("dtypes", [(F32, F32), (F16, F16), (BF16, F32), (F16, BF16)],
                         ids=["fp32", "fp16", "bf16x-fp32w", "fp16x-bf16w"])
@pytest.mark.parametrize("n", [1, 64, 512])
@gpu_test
def test_gpu_topk_route_other_dtypes(n, dtypes):
    check_route("cuda", dtypes[0], n, **K3M, w_dtype=dtypes[1], seed=n, **GPU_TOL)
    check_route("cuda", dtypes[0], n, **K2, w_dtype=dtypes[1], seed=n + 1, **GPU_TOL)


@pytest.mark.parametrize("case", [{"d": 100, "e": 48, "k": 8}, {"d": 768, "e": 48, "k": 1},
                                  {"d": 200, "e": 64, "k": 1, "renormalize": False},
                                  {**K3M, "strided": True}, {**K3M, "block_d": 16, "block_n": 32},
                                  {"d": 100, "e": 48, "k": 4, "block_d": 64},
                                  {"d": 64, "e": 8, "k": 8}, {**K3M, "bias_dtype": BF16}],
                         ids=["E48-D100-K8", "K1", "K1-norenorm", "strided", "blocks", "tail-tile", "K-eq-E",
                              "bf16-bias"])
@gpu_test
def test_gpu_topk_route_odd_shapes(case):
    check_route("cuda", BF16, 37, seed=3, **{**GPU_TOL, **case})
    check_route("cuda", F32, 37, seed=4, **{**GPU_TOL, **case})


@gpu_test
def test_gpu_special_values():
    check_special_values("cuda", F32)
    check_special_values("cuda", BF16)


@pytest.mark.parametrize("shape", ["k3m", "K2"])
@gpu_test
def test_gpu_one_launch(shape):
    """torch.profiler: a topk_route call is exactly one kernel at both shapes. TopKRouter under no_grad is that one
    kernel for a gate within ROUTER_KERNEL_MAX_WEIGHT (k3m) and the torch path (several kernels, no router
    kernel) for a larger one (K2's 384 x 7168), as for reference_kernels()."""
    from miles_k3.kernels.router import topk_route
    from miles_k3.model.layers import reference_kernels
    from miles_k3.model.moe import ROUTER_KERNEL_MAX_WEIGHT

    dims = {"k3m": K3M, "K2": K2}[shape]
    x, w, b = (t.cuda() for t in _inputs(64, dims["d"], dims["e"], BF16))
    kernels = cuda_kernels(lambda: topk_route(x, w, b, dims["k"], True, 2.5))
    assert len(kernels) == 1 and "_topk_route_kernel" in kernels[0], kernels
    router = _router(BF16, True, 2.5, e=dims["e"], k=dims["k"], d=dims["d"]).cuda()
    with torch.no_grad():
        kernels = cuda_kernels(lambda: router(x))
        if router.weight.numel() <= ROUTER_KERNEL_MAX_WEIGHT:
            assert shape == "k3m"
            assert len(kernels) == 1 and "_topk_route_kernel" in kernels[0], kernels
        else:
            assert shape == "K2"
            assert len(kernels) >= 5 and not any("_topk_route_kernel" in k for k in kernels), kernels
        with reference_kernels():
            torch_kernels = cuda_kernels(lambda: router(x))
    assert len(torch_kernels) >= 5 and not any("_topk_route_kernel" in k for k in torch_kernels), torch_kernels


@pytest.mark.parametrize("shape", ["k3m", "K3"])
@gpu_test
def test_gpu_cuda_graph_capture_and_replay(shape):
    """topk_route (and TopKRouter) captured in one graph; replays with new inputs pass the reference check, and
    the kernel's outputs equal what eager calls give, bit for bit. K3's gate is past ROUTER_KERNEL_MAX_WEIGHT,
    so its TopKRouter runs the torch path (cuBLAS may pick another algorithm under capture, and topk's order is
    unspecified): checked against the reference only."""
    from miles_k3.kernels.router import topk_route
    from miles_k3.model.moe import ROUTER_KERNEL_MAX_WEIGHT

    dims = {"k3m": K3M, "K3": K3}[shape]
    n, d, e, k = 96, dims["d"], dims["e"], dims["k"]
    x, w, b = (t.cuda() for t in _inputs(n, d, e, BF16))
    router = _router(BF16, True, 1.0, e=e, k=k, d=d, seed=1).cuda()

    def step():
        return topk_route(x, w, b, k, True, 2.5), router(x)

    with torch.no_grad():
        graph, outs = capture(step)
        g = _gen(5)
        for _ in range(3):
            x.copy_(torch.randn(n, d, generator=g).to(BF16))
            b.copy_(torch.randn(e, generator=g) * 0.1)
            graph.replay()
            torch.cuda.synchronize()
            got = [t.clone() for pair in outs for t in pair]
            want = [t for pair in step() for t in pair]
            bitwise = 4 if router.weight.numel() <= ROUTER_KERNEL_MAX_WEIGHT else 2
            assert (bitwise == 4) == (shape == "k3m")
            for a, c in zip(got[:bitwise], want[:bitwise]):
                assert torch.equal(a, c)
            compare_route(got[0], got[1], x, w, b, k, True, 2.5, 1e-5, 1e-5, "graph replay topk_route")
            ids, wts = got[2], got[3]
            if bitwise == 2:  # the torch path's topk(sorted=False) leaves ids in no order: sort them as the kernel
                scores = torch.sigmoid(x.float() @ router.weight.float().t()) + router.e_score_correction_bias
                order = scores.gather(1, ids).argsort(1, descending=True)
                ids, wts = ids.gather(1, order), wts.gather(1, order)
            compare_route(ids, wts, x, router.weight, router.e_score_correction_bias, k, True, 1.0, 1e-5,
                          1e-5, "graph replay TopKRouter")


@gpu_test
def test_gpu_router_dispatch(monkeypatch):
    """TopKRouter on CUDA: the kernel under no_grad / inference_mode (and when nothing needs grad); the torch
    path when x requires grad (backward works) and under reference_kernels(); both agree."""
    import miles_k3.kernels.router as router_mod
    from miles_k3.model.layers import reference_kernels

    calls = []
    real = router_mod.topk_route

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(router_mod, "topk_route", counting)
    router = _router(BF16, True, 2.5, **K3M, seed=2).cuda()
    x = torch.randn(64, K3M["d"], device="cuda").to(BF16)
    with torch.no_grad():
        ids, w = router(x)
        assert len(calls) == 1
        with reference_kernels():
            rids, _ = router(x)
        assert len(calls) == 1
    compare_route(ids, w, x, router.weight, router.e_score_correction_bias, 4, True, 2.5, 1e-5, 1e-5,
                  "TopKRouter kernel path")
    same = (ids.sort(1).values == rids.sort(1).values).all(1)  # vs the torch path on CUDA: near-ties aside
    assert int((~same).sum()) <= 2, f"{int((~same).sum())} of 64 tokens: kernel and torch path sets differ"
    with torch.inference_mode():
        router(x)
    assert len(calls) == 2
    _, w_g = router(x)  # grad enabled and the gate weight requires grad: torch path
    assert len(calls) == 2 and w_g.requires_grad
    router.weight.requires_grad_(False)  # a frozen base (LoRA): nothing needs grad, so the kernel
    router(x)
    assert len(calls) == 3
    xg = x.float().requires_grad_()  # activations that need grad: torch path, differentiable in x
    _, w_g = router(xg)
    assert len(calls) == 3
    (w_g * torch.arange(4.0, device="cuda")).sum().backward()
    assert xg.grad is not None and bool(xg.grad.isfinite().all()) and bool(xg.grad.abs().sum() > 0)
    big = TopKRouter(hidden=7168, num_experts=896, top_k=16, renormalize=True, scaling=1.0).cuda().to(BF16)
    with torch.no_grad():  # K3's gate is past ROUTER_KERNEL_MAX_WEIGHT: cuBLAS (the torch path) serves it
        big(torch.randn(4, 7168, device="cuda").to(BF16))
    assert len(calls) == 3


if __name__ == "__main__":  # the interpreter subprocess of `interpreter_results`
    print_results(INTERPRETER_CASES)
