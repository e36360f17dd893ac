"""RMSNorm in training: `miles_k3.kernels.fused_norm_train.rms_norm_train` (forward = the inference kernel
`fused.rms_norm`, backward = two more launches) against an fp64 truth and torch's autograd of `_rms_norm_torch`.

CPU: every case runs once under the Triton interpreter, in one subprocess (TRITON_INTERPRET=1 must be set before
the kernel module is imported), and each case reports its own test; plus the refusals. GPU
(`python -m pytest -m gpu tests/kernels/test_fused_norm_train.py`): the same checks on CUDA, K3's width
(16,384 x 7168 bf16; on an H100, forward + backward 0.84 ms fused, 5.96 ms torch), and the launch counts
(forward 1, forward + backward 3, 2 without a weight gradient).

The forward is bitwise `fused.rms_norm` (so trainer and engine see the same values). The gradients are checked
against fp64 autograd of the defining formula, y = st(round(n)) * round(w) with st() a straight-through rounding
(the forward value is rounded, the gradient passes as through the identity) and round(w) the weight as x.dtype,
so grad_x = rstd (dn - n mean(dn n)), dn = g round(w), and grad_w = sum_rows g round(n). Per element,
|got - truth| <= C 2^-24 S + (16-bit outputs) half an ulp of the value, with the magnitudes S of
`rms_norm_grad_bounds`; torch's autograd of the reference in the same dtypes is held to that bound plus its own
16-bit roundings (fp32: the same bound), so the kernel is within the sum of the two bounds of torch. Plus values
worked by hand, the multi-tile path (forced small row tile), multi-row programs with a partial last one, leading
shapes, 16-bit and fp32 weights, out_dtype != x.dtype, needs_input_grad, and the create_graph refusal.
"""
from __future__ import annotations

import math

import pytest
import torch
from kernel_testing import DTYPES, HALF_ULP, SUBNORMAL_FLOOR, cuda_kernels, gpu_test, print_results, seeded

from miles_k3.model.layers import _rms_norm_torch

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
NORM_BWD_C = 16  # fp32 roundings allowed, in units of 2^-24 * S (see rms_norm_grad_bounds)
_NEAR_MID = 2.0**-18  # n's fp32 relative error budget when telling whether round(n) may differ from the truth's


# ---- the truth and the bounds ---------------------------------------------------------------------------------
def rms_norm_grad_bounds(x, weight, g, eps):
    """fp64 (grad_x, grad_w) truth and per-element bounds for the fused kernel, and the extra allowance for torch's
    16-bit autograd: ((tx, bx, ex), (tw, bw, ew)).

    Truth: fp64 autograd of y = st(round(n)) * w16, n = x rsqrt(mean(x^2) + eps), w16 = weight.to(x.dtype).
    Why these S. The kernel computes, per row, the sums sum(x^2) and sum(dn x) and, per element, a handful of
    products, each in fp32: every step is good to a few 2^-24 relative to the magnitudes it combines (rsqrt, GPU
    approximate or not, to ~2^-23), and the sums' errors grow with their length only as sums of magnitudes do. So
    grad_x = rstd (dn - n proj) errs by ~2^-24 S_x, S_x = rstd (|dn| + |n| mean(|dn n|)) (not by a relative amount:
    dn - n proj cancels, e.g. to 0 when g is parallel to x), and grad_w = sum_rows g round(n) by ~2^-24 S_w,
    S_w = sum_rows |g n|, plus one more term for 16-bit x: where n is within 2^-18 (relative) of a midpoint
    between two 16-bit values, the kernel's fp32 n may round to the other one (a step |hi - lo| of that row's
    product |g| |hi - lo|). Torch's autograd of the reference in 16-bit x rounds g to x.dtype (out_dtype fp32),
    dn = g w16 and each g round(n) to x.dtype, and sums grad_w in x.dtype: at most three 16-bit roundings of terms
    bounded by S, e = 3 * half-ulp * S (0 for fp32 x).
    Measured with fp32 x (the GPU tests print err / allowance): max |err| / (2^-24 S) = 4.8 for the kernel's grad_x
    on an H100 (3.8 under the interpreter) and 4.5 for torch's, <= 0.5 for both grad_w; so C = NORM_BWD_C = 16.
    With 16-bit x the allowance is mostly the half ulp (or a straddle's step), which both use in full where they
    occur; there, at 4,096 x 7168 on an H100, the kernel's grad_x was the rounded truth in 99.99% of elements
    (bf16 100%; the rest near cancellation), torch's in 74%; bf16 grad_w 99.8% (torch 58%)."""
    xdt = x.dtype
    x64 = x.detach().double().requires_grad_()
    w16 = weight.detach().to(xdt).double().reshape(-1).requires_grad_()
    g64 = g.detach().double()
    rstd = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    n = x64 * rstd
    n_rounded = n.detach().to(xdt).double()
    (n + (n_rounded - n).detach()).mul(w16).backward(g64)
    with torch.no_grad():
        n, rstd, an = n.detach(), rstd.detach(), n.detach().abs()
        adn = (g64 * w16).abs()
        s_x = rstd * (adn + an * (adn * an).mean(-1, keepdim=True))
        lead = tuple(range(x.dim() - 1))
        s_w = (g64.abs() * an).sum(lead)
        lo, hi = (n * (1 - _NEAR_MID)).to(xdt).double(), (n * (1 + _NEAR_MID)).to(xdt).double()
        straddle = (g64.abs() * (hi - lo).abs()).sum(lead)  # 0 for fp32 x (round() is the identity)
    eps32 = NORM_BWD_C * 2.0**-24
    h16 = 3 * HALF_ULP[xdt]
    return ((x64.grad, eps32 * s_x, h16 * s_x),
            (w16.grad.reshape(weight.shape), eps32 * s_w + straddle, (h16 * s_w).reshape(weight.shape)))


def _assert_within(got: torch.Tensor, truth: torch.Tensor, bound: torch.Tensor, what: str) -> float:
    """|got - truth| <= bound + half an ulp of got's dtype (its last rounding) + a subnormal floor; returns the
    largest |got - truth| / that allowance (the fraction of it used; fp32 outputs: of the bound)."""
    assert not bool(got.isnan().any()), f"{what}: NaN"
    got64 = got.double()
    allowed = (bound.reshape(got.shape) + HALF_ULP[got.dtype] * torch.maximum(got64.abs(), truth.abs())
               + SUBNORMAL_FLOOR[got.dtype])
    err = (got64 - truth).abs()
    bad = err > allowed
    if bool(bad.any()):
        i = int(bad.reshape(-1).nonzero()[0])
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} beyond the bound (max err/allowed "
                             f"{float((err / allowed).max()):.3g}); first at {i}: got {got.reshape(-1)[i].item()!r}, "
                             f"truth {truth.reshape(-1)[i].item()!r}, allowed {allowed.reshape(-1)[i].item():.3g}")
    return float((err / allowed).max()) if err.numel() else 0.0


# ---- the checks (device-agnostic: run under the interpreter on CPU, and on CUDA) --------------------------------
def _inputs(shape, dtype, weight_dtype, out_dtype, device, seed, strided=False, scale=3.0):
    """x (row scales 1e-3 .. 1e3, so eps matters in some rows), weight in [0.5, 1.5], and g (out's dtype);
    with `strided`, x's rows are a view with row stride D + 5."""
    gen = seeded(seed)
    d = shape[-1]
    x = torch.randn(*shape[:-1], d + 5 if strided else d, generator=gen) * scale
    rows = x.reshape(-1, x.shape[-1])
    rows[::3] *= 1e-3
    rows[1::4] *= 1e3
    x = x.to(device=device, dtype=dtype)
    if strided:
        x = x[..., 2:d + 2]
    w = torch.empty(d).uniform_(0.5, 1.5, generator=gen).to(device=device, dtype=weight_dtype)
    g = (torch.randn(*shape, generator=gen) * 2).to(device=device, dtype=out_dtype or dtype)
    return x, w, g


def check_rms_norm_train(device: str, dtype: torch.dtype, shape: tuple[int, ...], weight_dtype: torch.dtype = F32,
                         out_dtype: torch.dtype | None = None, eps: float = 1e-5, block_d: int | None = None,
                         block_rows: int | None = None, strided: bool = False, seed: int = 0,
                         report: dict | None = None) -> None:
    """rms_norm_train: forward bitwise `fused.rms_norm`; gradients (x's and weight's dtypes and shapes) within
    `rms_norm_grad_bounds` of the fp64 truth, as are torch's (with its 16-bit allowance); a second backward gives
    the same bits (deterministic). `report` collects the errors in bound units."""
    from miles_k3.kernels import fused
    from miles_k3.kernels.fused_norm_train import rms_norm_train

    x, w, g = _inputs(shape, dtype, weight_dtype, out_dtype, device, seed, strided)
    what = f"rms_norm_train x {dtype} w {weight_dtype} out {out_dtype} {tuple(shape)} block_d={block_d}"
    leaf, b = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    if strided:  # the kernel reads a strided view (x's layout) of a leaf that collects its gradient
        leaf = torch.zeros(*x.shape[:-1], x.shape[-1] + 5, device=device, dtype=dtype)
        leaf[..., 2:-3] = x
        leaf.requires_grad_()
    a = leaf[..., 2:-3] if strided else leaf
    assert a.is_contiguous() != strided, what
    out = rms_norm_train(a, b, eps, out_dtype=out_dtype, block_d=block_d, block_rows=block_rows)
    assert out.requires_grad and out.dtype == (out_dtype or dtype) and out.shape == x.shape, what
    want = fused.rms_norm(x, w, eps, out_dtype=out_dtype, block_d=block_d)
    assert torch.equal(out, want), f"{what}: forward is not the inference kernel's"
    out.backward(g)
    grad_x = leaf.grad[..., 2:-3] if strided else leaf.grad
    assert grad_x.dtype == dtype and grad_x.shape == x.shape and b.grad.dtype == weight_dtype, what
    if strided:
        assert not bool(leaf.grad[..., :2].any() or leaf.grad[..., -3:].any()), f"{what}: gradient off the view"
    (tx, bx, ex), (tw, bw, ew) = rms_norm_grad_bounds(x, w, g, eps)
    ra, rb = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    _rms_norm_torch(ra, rb, eps, out_dtype).backward(g)
    errs = {"kernel grad_x": _assert_within(grad_x, tx, bx, what + " grad_x"),
            "kernel grad_w": _assert_within(b.grad, tw, bw, what + " grad_w"),
            "torch grad_x": _assert_within(ra.grad, tx, bx + ex, what + " torch reference grad_x"),
            "torch grad_w": _assert_within(rb.grad, tw, bw + ew, what + " torch reference grad_w")}
    if report is not None:
        for k, v in errs.items():
            report[k] = max(report.get(k, 0.0), v)
    c, e = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()  # contiguous
    rms_norm_train(c, e, eps, out_dtype=out_dtype, block_d=block_d, block_rows=block_rows).backward(g)
    assert torch.equal(c.grad, grad_x) and torch.equal(e.grad, b.grad), f"{what}: not deterministic"


def check_rms_norm_train_by_hand(device: str) -> None:
    """Worked values, eps = 0, w = 1. x = [3, 4]: mean(x^2) = 12.5, rstd = 1/sqrt(12.5) = sqrt(2)/5,
    n = sqrt(2) [3, 4] / 5. g = [1, 0]: dn = g, mean(dn n) = 3 sqrt(2) / 10, grad_x = rstd (g - n mean(dn n)) =
    (sqrt(2)/5) ([1, 0] - [3, 4] * 6/50) = sqrt(2) [0.128, -0.096] (orthogonal to x: RMSNorm is scale-invariant),
    grad_w = g n = [3 sqrt(2)/5, 0]. g = [4, -3] (orthogonal to x): mean(dn n) = 0, so grad_x = rstd g. g = x:
    grad_x = rstd (x - n rstd 12.5) = 0. A constant row x = 2 (D = 4): n = 1, rstd = 1/2, so grad_x = (g - mean(g))
    / 2 = [-0.75, -0.25, 0.25, 0.75] for g = [1, 2, 3, 4], and grad_w = g. A zero row with eps = 1/4: rstd = 2,
    n = 0, so grad_x = 2 g w and the row adds nothing to grad_w."""
    from miles_k3.kernels.fused_norm_train import rms_norm_train

    r2 = math.sqrt(2.0)

    def grads(xv, gv, eps=0.0, wv=None, dtype=F32):
        x = torch.tensor(xv, device=device, dtype=dtype).requires_grad_()
        w = torch.tensor(wv or [1.0] * len(xv[0]), device=device).requires_grad_()
        rms_norm_train(x, w, eps).backward(torch.tensor(gv, device=device, dtype=dtype))
        return x.grad.float().cpu(), w.grad.cpu()

    def close(got, want, msg):
        torch.testing.assert_close(got, torch.tensor(want), rtol=1e-6, atol=1e-6, msg=lambda m: f"{msg}: {m}")

    gx, gw = grads([[3.0, 4.0]], [[1.0, 0.0]])
    close(gx[0], [0.128 * r2, -0.096 * r2], "x=[3,4] g=[1,0] grad_x")
    close(gw, [3 * r2 / 5, 0.0], "x=[3,4] g=[1,0] grad_w")
    assert abs(float(gx[0] @ torch.tensor([3.0, 4.0]))) < 1e-6  # orthogonal to x
    gx, gw = grads([[3.0, 4.0]], [[4.0, -3.0]])
    close(gx[0], [4 * r2 / 5, -3 * r2 / 5], "x=[3,4] g=[4,-3] grad_x")
    close(gw, [12 * r2 / 5, -12 * r2 / 5], "x=[3,4] g=[4,-3] grad_w")
    gx, _ = grads([[3.0, 4.0]], [[3.0, 4.0]])
    close(gx[0], [0.0, 0.0], "x=[3,4] g=x grad_x")
    gx, gw = grads([[0.0] * 4], [[1.0, -1.0, 2.0, -2.0]], eps=0.25, wv=[1.0, 1.0, 0.5, 2.0])
    close(gx[0], [2.0, -2.0, 2.0, -8.0], "zero row, eps=1/4, grad_x")
    close(gw, [0.0] * 4, "zero row, eps=1/4, grad_w")
    gx, gw = grads([[2.0] * 4], [[1.0, 2.0, 3.0, 4.0]])
    close(gx[0], [-0.75, -0.25, 0.25, 0.75], "constant row grad_x")
    close(gw, [1.0, 2.0, 3.0, 4.0], "constant row grad_w")
    # bf16, exact: x = [2, 2, 2, 2] and g = [1, 2, 3, 4] as above, grad_x in bf16 is exactly those quarters
    gx, gw = grads([[2.0] * 4], [[1.0, 2.0, 3.0, 4.0]], dtype=BF16)
    assert gx[0].tolist() == [-0.75, -0.25, 0.25, 0.75] and gw.tolist() == [1.0, 2.0, 3.0, 4.0], (gx, gw)


def check_rms_norm_train_autograd(device: str) -> None:
    """Autograd plumbing: only x or only the weight needing a gradient (the same bits as when both do), a [1, D]
    weight (its gradient [1, D]), a 1-d x, an expanded grad_out (`.sum()`), no rows, and a backward that would
    build a graph (second-order gradients) refused rather than silently giving first-order values."""
    from miles_k3.kernels.fused_norm_train import rms_norm_train

    x, w, g = _inputs((2, 3, 40), BF16, F32, None, device, 7)
    a, b = x.clone().requires_grad_(), w.clone().requires_grad_()
    rms_norm_train(a, b, 1e-5).backward(g)
    ax = x.clone().requires_grad_()
    out = rms_norm_train(ax, w, 1e-5)
    out.backward(g)
    assert torch.equal(ax.grad, a.grad), "grad_x alone differs"
    bw = w.clone().requires_grad_()
    rms_norm_train(x, bw, 1e-5).backward(g)
    assert torch.equal(bw.grad, b.grad), "grad_w alone differs"
    with torch.no_grad():
        assert not rms_norm_train(a, b, 1e-5).requires_grad
    w1 = w.reshape(1, -1).clone().requires_grad_()
    rms_norm_train(x, w1, 1e-5).backward(g)
    assert w1.grad.shape == (1, 40) and torch.equal(w1.grad[0], b.grad)
    v = x[1, 2].clone().requires_grad_()
    rms_norm_train(v, w, 1e-5).backward(g[1, 2])
    assert v.grad.shape == (40,) and torch.equal(v.grad, a.grad[1, 2])
    s, sw = x.float().clone().requires_grad_(), w.clone().requires_grad_()
    rms_norm_train(s, sw, 1e-5).sum().backward()  # grad_out expanded (stride 0): copied
    rs, rsw = x.float().clone().requires_grad_(), w.clone().requires_grad_()
    _rms_norm_torch(rs, rsw, 1e-5).sum().backward()
    torch.testing.assert_close(s.grad, rs.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sw.grad, rsw.grad, rtol=1e-5, atol=1e-5)
    e, ew = torch.zeros(0, 8, device=device, requires_grad=True), torch.ones(8, device=device, requires_grad=True)
    out = rms_norm_train(e, ew, 1e-5)
    out.sum().backward()
    assert out.shape == (0, 8) and e.grad.shape == (0, 8) and ew.grad.tolist() == [0.0] * 8
    y = x.clone().requires_grad_()
    try:
        torch.autograd.grad(rms_norm_train(y, w, 1e-5).float().sum(), y, create_graph=True)
    except RuntimeError as err:
        assert "not twice differentiable" in str(err), err
    else:
        raise AssertionError("create_graph through rms_norm_train (a second-order gradient) was not refused")


# ---- CPU: the checks under the Triton interpreter, in one subprocess --------------------------------------------
INTERPRETER_CASES: dict[str, tuple] = {}  # name -> (check, kwargs); run on CPU tensors under TRITON_INTERPRET=1
# 15 rows on the interpreter's 4 programs: 4 rows each, the last program 3 (a partial one)
for _n, _dt in (("fp32", F32), ("bf16", BF16)):
    INTERPRETER_CASES |= {
        f"rms_norm_train-{_n}-D96": (check_rms_norm_train, {"dtype": _dt, "shape": (3, 5, 96)}),
        f"rms_norm_train-{_n}-D700-tiled": (check_rms_norm_train, {"dtype": _dt, "shape": (7, 700), "block_d": 128,
                                                                   "seed": 1}),
        f"rms_norm_train-{_n}-bf16w-strided": (check_rms_norm_train, {"dtype": _dt, "shape": (2, 3, 96),
                                                                      "weight_dtype": BF16, "strided": True,
                                                                      "seed": 2}),
    }
INTERPRETER_CASES |= {
    "rms_norm_train-fp16-D300": (check_rms_norm_train, {"dtype": F16, "shape": (6, 300), "weight_dtype": F16,
                                                        "seed": 3}),
    "rms_norm_train-bf16-to-fp32": (check_rms_norm_train, {"dtype": BF16, "shape": (3, 5, 96), "out_dtype": F32,
                                                           "seed": 4}),
    "rms_norm_train-fp32-to-bf16-tiled": (check_rms_norm_train, {"dtype": F32, "shape": (5, 200), "out_dtype": BF16,
                                                                 "weight_dtype": BF16, "block_d": 64,
                                                                 "block_rows": 2, "seed": 5}),
    "rms_norm_train-bf16-rows1": (check_rms_norm_train, {"dtype": BF16, "shape": (3, 64), "block_rows": 1,
                                                         "seed": 6}),
    "rms_norm_train-by-hand": (check_rms_norm_train_by_hand, {}),
    "rms_norm_train-autograd": (check_rms_norm_train_autograd, {}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(INTERPRETER_CASES))
def test_kernel_under_interpreter(case, interpreter_results):
    assert interpreter_results[case] == "ok", interpreter_results[case]


# ---- CPU: validation (no kernel launch) -------------------------------------------------------------------------
def test_rms_norm_train_refuses_bad_input(monkeypatch):
    """The training RMSNorm and its backward refuse what `fused.rms_norm` refuses, in its words, before any
    launch."""
    from miles_k3.kernels.fused_norm_train import rms_norm_backward, rms_norm_train

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, w = torch.zeros(2, 8, requires_grad=True), torch.ones(8, requires_grad=True)
    with pytest.raises(ValueError, match="rms_norm_train: x must be a CUDA tensor"):
        rms_norm_train(x, w, 1e-5)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # past the device check
    with pytest.raises(ValueError, match="rms_norm_train: x must be float32, bfloat16 or float16, got torch.float64"):
        rms_norm_train(x.double(), w, 1e-5)
    with pytest.raises(ValueError, match="rms_norm_train: weight must be a float32, bfloat16 or float16 tensor, got "
                                         "torch.float64"):
        rms_norm_train(x, w.double(), 1e-5)
    with pytest.raises(ValueError, match=r"rms_norm_train: weight must have shape \[8\] or \[1, 8\] .* got \(7,\)"):
        rms_norm_train(x, torch.ones(7), 1e-5)
    with pytest.raises(ValueError, match=r"rms_norm_train: weight must have shape .* got \(1, 1, 8\)"):
        rms_norm_train(x, torch.ones(1, 1, 8), 1e-5)
    with pytest.raises(ValueError, match="rms_norm_train: eps must be a finite number >= 0, got -1.0"):
        rms_norm_train(x, w, -1.0)
    with pytest.raises(ValueError, match="rms_norm_train: eps must be a finite number >= 0, got nan"):
        rms_norm_train(x, w, float("nan"))
    with pytest.raises(ValueError, match="rms_norm_train: out_dtype must be float32, bfloat16 or float16, got "
                                         "torch.float64"):
        rms_norm_train(x, w, 1e-5, out_dtype=torch.float64)
    with pytest.raises(ValueError, match="rms_norm_train: x must have at least one dim"):
        rms_norm_train(torch.zeros(()), w, 1e-5)
    with pytest.raises(TypeError, match="rms_norm_train: x must be a torch.Tensor"):
        rms_norm_train([1.0], w, 1e-5)
    with pytest.raises(ValueError, match=r"rms_norm_backward: grad_out must have x's shape .* \(2, 7\)"):
        rms_norm_backward(x, w, torch.zeros(2, 7), 1e-5)
    with pytest.raises(ValueError, match="rms_norm_backward: grad_out must be float32, bfloat16 or float16"):
        rms_norm_backward(x, w, torch.zeros(2, 8, dtype=torch.float64), 1e-5)


# ---- GPU ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("weight_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("shape", [(4, 256, 768), (1000, 7168), (3, 9000), (33, 100)],
                         ids=lambda s: "x".join(map(str, s)))
@gpu_test
def test_gpu_rms_norm_train(shape, dtype, weight_dtype):
    report = {}
    kw = {"dtype": DTYPES[dtype], "shape": shape, "weight_dtype": DTYPES[weight_dtype], "report": report}
    check_rms_norm_train("cuda", seed=sum(shape), **kw)
    check_rms_norm_train("cuda", block_rows=3, strided=True, seed=sum(shape) + 1, **kw)
    check_rms_norm_train("cuda", block_d=512, seed=sum(shape) + 2, **kw)
    out = {"fp32": BF16, "bf16": F32, "fp16": F32}[dtype]
    check_rms_norm_train("cuda", out_dtype=out, seed=sum(shape) + 3, **kw)
    print(f"{shape} x {dtype} w {weight_dtype}: max err / bound " + ", ".join(f"{k} {v:.2f}" for k, v in
                                                                             report.items()))


@gpu_test
def test_gpu_rms_norm_train_by_hand_and_autograd():
    check_rms_norm_train_by_hand("cuda")
    check_rms_norm_train_autograd("cuda")


@pytest.mark.parametrize("weight_dtype", ["fp32", "bf16"])
@gpu_test
def test_gpu_rms_norm_train_launches(weight_dtype):
    """One launch forward (the inference kernel), three forward + backward (the backward kernel and the
    grad_weight reduction), at K3's width; two with only x needing a gradient."""
    from miles_k3.kernels.fused_norm_train import rms_norm_train

    x, w, g = _inputs((256, 7168), BF16, DTYPES[weight_dtype], None, "cuda", 0)
    x.requires_grad_()
    w.requires_grad_()

    def fwd():
        with torch.no_grad():
            rms_norm_train(x, w, 1e-5)

    def fwd_bwd(weight_grad=True):
        x.grad = w.grad = None
        w.requires_grad_(weight_grad)
        rms_norm_train(x, w, 1e-5).backward(g)

    assert len(cuda_kernels(fwd)) == 1, cuda_kernels(fwd)
    names = cuda_kernels(fwd_bwd)
    assert len(names) <= 3, names
    names = cuda_kernels(lambda: fwd_bwd(False))
    assert len(names) <= 2, names


@gpu_test
def test_gpu_rms_norm_train_at_k3_width():
    """K3's hidden width in training: 16,384 rows x 7168 bf16 (a bf16 weight): forward bitwise `fused.rms_norm`,
    gradients within `rms_norm_grad_bounds` of the fp64 truth (checked 2,048 rows at a time for grad_x; grad_w
    over all rows), as are torch's. Prints forward + backward times of both (CUDA events, after a warm-up)."""
    from miles_k3.kernels import fused
    from miles_k3.kernels.fused_norm_train import rms_norm_train

    rows, d, eps = 16384, 7168, 1e-5
    x, w, g = _inputs((rows, d), BF16, BF16, None, "cuda", 0)
    g = g * 1e-3

    def fwd_bwd(fn):
        a, b = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = fn(a, b, eps)
        out.backward(g)
        return out, a.grad, b.grad

    out, gx, gw = fwd_bwd(rms_norm_train)
    assert torch.equal(out, fused.rms_norm(x, w, eps))
    _, rgx, rgw = fwd_bwd(_rms_norm_torch)
    errs = {}
    for r in range(0, rows, 2048):
        sl = slice(r, r + 2048)
        (tx, bx, ex), _ = rms_norm_grad_bounds(x[sl], w, g[sl], eps)
        errs["kernel grad_x"] = max(errs.get("kernel grad_x", 0), _assert_within(gx[sl], tx, bx, f"grad_x {r}+"))
        errs["torch grad_x"] = max(errs.get("torch grad_x", 0),
                                   _assert_within(rgx[sl], tx, bx + ex, f"torch grad_x {r}+"))
    del tx, bx, ex
    _, (tw, bw, ew) = rms_norm_grad_bounds(x, w, g, eps)
    errs["kernel grad_w"] = _assert_within(gw, tw, bw, "grad_w")
    errs["torch grad_w"] = _assert_within(rgw, tw, bw + ew, "torch grad_w")
    times = {}
    for name, fn in (("fused", rms_norm_train), ("torch", _rms_norm_torch)):
        fwd_bwd(fn)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            fwd_bwd(fn)
        end.record()
        torch.cuda.synchronize()
        times[name] = start.elapsed_time(end) / 5
    print(f"rms_norm fwd+bwd at {rows} x {d} bf16 (incl. two input clones): fused {times['fused']:.2f} ms, "
          f"torch {times['torch']:.2f} ms; max err / bound: " + ", ".join(f"{k} {v:.2f}" for k, v in errs.items()))


if __name__ == "__main__":
    print_results(INTERPRETER_CASES)
