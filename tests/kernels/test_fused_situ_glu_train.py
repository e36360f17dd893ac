"""SiTU-GLU in training: `miles_k3.kernels.fused.situ_glu_train` (forward = the inference kernel, backward = one
more kernel) against an fp64 truth, and `layers.situ_glu`'s dispatch to it.

CPU: every case runs once under the Triton interpreter, in one subprocess (TRITON_INTERPRET=1 must be set before
the kernel module is imported), and each case reports its own test; plus the refusals and the dispatch rules.
GPU (`python -m pytest -m gpu tests/kernels/test_fused_situ_glu_train.py`): the same checks on CUDA, and one K3 MoE
layer's routed rows (65,536 x 3072 bf16) through `layers.situ_glu`.

SiTU-GLU in training (`situ_glu_train`): the forward is bitwise the inference kernel's output (so trainer and
engine see the same activations). The gradients are checked against an fp64 autograd evaluation of the formula,
not against torch's fp32 autograd, with a per-element bound of fp32 roundings times the magnitudes of the terms
(`situ_glu_grad_bounds`: dgate cancels to 0 near g ~ -1.3, where no relative criterion holds), plus half an ulp of
a 16-bit output; torch's fp32 autograd of `_situ_glu_torch` is held to the same bound, so the kernel is within twice
the bound of it. Plus values worked by hand (g = 0, u = 0, saturated g, g = ln 3 with beta = 2).
"""
from __future__ import annotations

import math

import pytest
import torch
from kernel_testing import DTYPES, HALF_ULP, SITU_SPECIALS, SUBNORMAL_FLOOR, gpu_test, print_results, seeded
from kernel_testing import assert_ulps16 as _assertulps16

from miles_k3.model import layers
from miles_k3.model.layers import _situ_glu_torch, reference_kernels, situ_glu

F32, BF16 = torch.float32, torch.bfloat16


# ---- the checks (device-agnostic: run under the interpreter on CPU, and on CUDA) --------------------------------
def _situ_glu64(g: torch.Tensor, u: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """SiTU-GLU in fp64 (the truth the gradients are measured against: fp64 autograd of the defining formula)."""
    h = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    return h * (u if linear_beta is None else linear_beta * torch.tanh(u / linear_beta))


SITU_BWD_C = 16  # fp32 roundings allowed, in units of eps32 * S (see situ_glu_grad_bounds)


def situ_glu_grad_bounds(g, u, grad_out, beta, linear_beta):
    """fp64 (grad_g, grad_u) truth and the per-element bounds (for fp32 outputs) |got - truth| <= C * 2^-24 * S.

    Why this S: the backward is a handful of fp32 operations on tanh / sigmoid values that are each good to a few
    eps32 in absolute terms (|tanh|, sigmoid <= 1; 1 - t^2 then has an absolute, not relative, error ~eps32: where
    t saturates, 1 - t^2 is far below eps32 and both torch and the kernel return 0 or ~1e-7 for it), so the error of
    grad_g = go * up * ((1 - t^2) s + h (1 - s)) is ~eps32 * |go| |up| (s + |h|), that of grad_u = go * h * dup is
    ~eps32 * |go| |h| -- sums of the terms' magnitudes, not of their values, because dgate cancels to 0 near
    g ~ -1.3 (where a relative criterion would fail for any fp32 evaluation, torch's included). One more term: a
    GPU's exp is 2^(x log2 e) with x log2 e rounded, a relative error ~|g| eps32 in e = exp(-|g|), which moves
    sigmoid by s (1 - s) |g| eps32 (the fused forward's own tests allow 1e-5 relative for the same reason); it
    enters dgate with a factor <= 1 + beta and gate with beta. Measured under the interpreter (200k random points,
    beta 4, linear_beta 25 and None): max error / (eps32 * S) = 6.8 for the kernel and 6.4 for torch's fp32
    autograd of `_situ_glu_torch`, so C = 16. 16-bit outputs add their own rounding: half an ulp of the value."""
    g64, u64, go64 = (t.detach().double().requires_grad_(i < 2) for i, t in enumerate((g, u, grad_out)))
    _situ_glu64(g64, u64, beta, linear_beta).backward(go64)
    with torch.no_grad():
        s = torch.sigmoid(g64)
        h = beta * torch.tanh(g64 / beta) * s
        up = u64 if linear_beta is None else linear_beta * torch.tanh(u64 / linear_beta)
        exp_err = s * (1 - s) * g64.abs()  # the GPU exp's argument rounding, through sigmoid
        s_g = go64.abs() * up.abs() * (s + h.abs() + (1 + beta) * exp_err)
        s_u = go64.abs() * (h.abs() + beta * exp_err)
    eps = SITU_BWD_C * 2.0**-24
    return (g64.grad, eps * s_g), (u64.grad, eps * s_u)


def _assert_within(got: torch.Tensor, truth: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    """|got - truth| <= bound (fp32 computation) + half an ulp of got's dtype (its final rounding) + subnormals."""
    assert not bool(got.isnan().any()), f"{what}: NaN"
    got64 = got.double()
    allowed = bound + HALF_ULP[got.dtype] * torch.maximum(got64.abs(), truth.abs()) + SUBNORMAL_FLOOR[got.dtype]
    err = (got64 - truth).abs()
    bad = err > allowed
    if bool(bad.any()):
        i = int(bad.reshape(-1).nonzero()[0])
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} beyond the bound (max err/allowed "
                             f"{float((err / allowed).max()):.3g}); first at {i}: got {got.reshape(-1)[i].item()!r}, "
                             f"truth {truth.reshape(-1)[i].item()!r}, allowed {allowed.reshape(-1)[i].item():.3g}")


def _situ_inputs(shape, dtype, up_dtype, device, scale, seed, strided=False):
    """g, u (SITU_SPECIALS up front, many small |g|) and grad_out (gate's dtype), on `device`; with `strided`,
    g and u are non-contiguous (transposed) views."""
    gen = seeded(seed)
    stored = (*shape[:-2], shape[-1], shape[-2]) if strided else shape
    g = torch.randn(*stored, generator=gen) * scale
    u = torch.randn(*stored, generator=gen) * scale
    g[..., ::5] *= 1e-2
    sp = torch.tensor(SITU_SPECIALS)
    k = min(sp.numel(), g.numel())
    g.view(-1)[:k], u.view(-1)[:k] = sp[:k], sp.flip(0)[:k]
    go = torch.randn(*shape, generator=gen) * 3
    g, u = g.to(device=device, dtype=dtype), u.to(device=device, dtype=up_dtype or dtype)
    if strided:
        g, u = g.transpose(-1, -2), u.transpose(-1, -2)
    return g, u, go.to(device=device, dtype=dtype)


def check_situ_glu_train(device: str, dtype: torch.dtype, shape: tuple[int, ...], linear_beta: float | None,
                         beta: float = 4.0, scale: float = 30.0, up_dtype: torch.dtype | None = None,
                         seed: int = 0, strided: bool = False) -> None:
    """situ_glu_train: forward bitwise `fused.situ_glu`; gradients within the bounds of `situ_glu_grad_bounds`
    of the fp64 truth, as are those of `_situ_glu_torch`'s autograd (so the two are within twice the bound)."""
    from miles_k3.kernels import fused

    g, u, go = _situ_inputs(shape, dtype, up_dtype, device, scale, seed, strided)
    what = f"situ_glu_train {dtype} up {u.dtype} {tuple(shape)} linear_beta={linear_beta} beta={beta}"
    a, b = g.detach().clone().requires_grad_(), u.detach().clone().requires_grad_()  # clone keeps the strides
    assert a.is_contiguous() != strided, what
    out = fused.situ_glu_train(a, b, beta, linear_beta)
    assert out.requires_grad and out.dtype == dtype and out.shape == g.shape, what
    assert torch.equal(out, fused.situ_glu(g, u, beta, linear_beta)), f"{what}: forward is not the inference kernel's"
    out.backward(go)
    assert a.grad.dtype == dtype and b.grad.dtype == u.dtype and a.grad.shape == g.shape, what
    ra, rb = g.detach().clone().requires_grad_(), u.detach().clone().requires_grad_()
    _situ_glu_torch(ra, rb, beta, linear_beta).backward(go)
    (tg, bg), (tu, bu) = situ_glu_grad_bounds(g, u, go, beta, linear_beta)
    _assert_within(a.grad, tg, bg, what + " grad_g")
    _assert_within(b.grad, tu, bu, what + " grad_u")
    _assert_within(ra.grad, tg, bg, what + " torch reference grad_g")  # the bound is what fp32 torch meets
    _assert_within(rb.grad, tu, bu, what + " torch reference grad_u")
    if strided:  # the same values as from contiguous copies, bit for bit
        c, d = g.contiguous().requires_grad_(), u.contiguous().requires_grad_()
        fused.situ_glu_train(c, d, beta, linear_beta).backward(go)
        assert torch.equal(c.grad, a.grad) and torch.equal(d.grad, b.grad), what


def check_situ_glu_train_by_hand(device: str) -> None:
    """Worked values. beta = 2, g = ln 3: tanh(g / 2) = (3 - 1) / (3 + 1) = 1/2 and sigmoid(g) = 3/4, so
    gate = 2 * 1/2 * 3/4 = 3/4 and dgate = (1 - 1/4) * 3/4 + 3/4 * (1 - 3/4) = 3/4; likewise up(ln 3) = 1 and
    dup = 3/4 with linear_beta = 2. g = 0: gate 0, dgate 1/2. u = 0: up 0, dup 1. g = 100: tanh and sigmoid are 1
    in fp32, so gate = beta and dgate = 0 exactly. g = -100: gate ~ -2 e^-100 and dgate ~ the same (below 1e-30)."""
    from miles_k3.kernels import fused

    ln3 = math.log(3.0)
    gv = [0.0, ln3, ln3, 100.0, -100.0, 0.0, ln3]
    uv = [ln3, 0.0, ln3, ln3, ln3, 0.0, ln3]
    gov = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 2.0]
    want = {  # (out, grad_g, grad_u), linear_beta = 2
        "out": [0.0, 0.0, 0.75, 2.0, 0.0, 0.0, 0.75],
        "g": [0.5, 0.0, 0.75, 0.0, 0.0, 0.0, 1.5],
        "u": [0.0, 0.75, 0.5625, 1.5, 0.0, 0.0, 1.125],
    }
    g = torch.tensor(gv, device=device).requires_grad_()
    u = torch.tensor(uv, device=device).requires_grad_()
    out = fused.situ_glu_train(g, u, 2.0, 2.0)
    out.backward(torch.tensor(gov, device=device))
    for name, got in (("out", out), ("g", g.grad), ("u", u.grad)):  # ln 3 in fp32 is 3e-8 relative off
        torch.testing.assert_close(got.detach().cpu(), torch.tensor(want[name]), rtol=0, atol=1e-6,
                                   msg=lambda m, name=name: f"by hand, {name}: {m}")
    assert g.grad[3].item() == 0.0  # saturated: exactly 0
    # bf16, linear_beta None, exact in bf16: g = 0, u = 1.5: out 0, grad_g = 1.5 * 1/2, grad_u = 0;
    # g = 100, u = 1.5 (beta 2): out = 2 * 1.5, grad_g = 0, grad_u = gate = 2; grad_out 1 and 2
    g = torch.tensor([0.0, 100.0, 100.0], device=device, dtype=torch.bfloat16).requires_grad_()
    u = torch.tensor([1.5, 1.5, 1.5], device=device, dtype=torch.bfloat16).requires_grad_()
    out = fused.situ_glu_train(g, u, 2.0, None)
    out.backward(torch.tensor([1.0, 1.0, 2.0], device=device, dtype=torch.bfloat16))
    assert out.tolist() == [0.0, 3.0, 3.0] and g.grad.tolist() == [0.75, 0.0, 0.0] and u.grad.tolist() == [0.0, 2.0, 4.0]
    assert g.grad.dtype == u.grad.dtype == torch.bfloat16


def check_situ_glu_train_autograd(device: str) -> None:
    """Autograd plumbing: one input needing grad, one tensor as both inputs (the two gradients add up), an expanded
    grad_out (`.sum()`), no elements, and a backward that would build a graph (second-order gradients) refused
    rather than silently giving first-order values that do not differentiate further."""
    from miles_k3.kernels import fused

    g, u, go = _situ_inputs((5, 37), torch.float32, None, device, 3.0, 7)
    a = g.clone().requires_grad_()
    fused.situ_glu_train(a, u, 4.0, 25.0).backward(go)  # up needs no grad
    ra = g.clone().requires_grad_()
    _situ_glu_torch(ra, u, 4.0, 25.0).backward(go)
    torch.testing.assert_close(a.grad, ra.grad, rtol=1e-5, atol=1e-6)
    x = g.clone().requires_grad_()
    fused.situ_glu_train(x, x, 4.0, None).sum().backward()  # grad_out expanded (stride 0): copied
    rx = g.clone().requires_grad_()
    _situ_glu_torch(rx, rx, 4.0, None).sum().backward()
    torch.testing.assert_close(x.grad, rx.grad, rtol=1e-5, atol=1e-6)
    e = torch.zeros(0, 8, device=device, requires_grad=True)
    out = fused.situ_glu_train(e, e, 4.0, 25.0)
    out.sum().backward()
    assert out.shape == (0, 8) and e.grad.shape == (0, 8)
    y = g.clone().requires_grad_()
    try:
        torch.autograd.grad(fused.situ_glu_train(y, u, 4.0, None).sum(), y, create_graph=True)
    except RuntimeError as err:
        assert "not twice differentiable" in str(err), err
    else:
        raise AssertionError("create_graph through situ_glu_train (a second-order gradient) was not refused")


# ---- CPU: the checks under the Triton interpreter, in one subprocess --------------------------------------------
INTERPRETER_CASES: dict[str, tuple] = {}  # name -> (check, kwargs); run on CPU tensors under TRITON_INTERPRET=1
# SiTU-GLU training (differentiable): 800 = 1024 - 224 elements, so a partial block; the fp16 and strided cases
# are smaller still (7 x 33 = 231, 5 x 41 = 205)
for _n, _dt in (("fp32", F32), ("bf16", BF16)):
    INTERPRETER_CASES |= {
        f"situ_glu_train-{_n}-lin25": (check_situ_glu_train, {"dtype": _dt, "shape": (8, 100), "linear_beta": 25.0}),
        f"situ_glu_train-{_n}-linNone": (check_situ_glu_train, {"dtype": _dt, "shape": (8, 100),
                                                                "linear_beta": None, "seed": 1}),
        f"situ_glu_train-{_n}-beta1-lin2-unit": (check_situ_glu_train, {"dtype": _dt, "shape": (8, 100), "beta": 1.0,
                                                                         "linear_beta": 2.0, "scale": 1.0,
                                                                         "seed": 2}),
    }
INTERPRETER_CASES |= {
    "situ_glu_train-fp16-lin25": (check_situ_glu_train, {"dtype": torch.float16, "shape": (7, 33),
                                                         "linear_beta": 25.0, "scale": 3.0, "seed": 3}),
    "situ_glu_train-bf16-gate-fp32-up": (check_situ_glu_train, {"dtype": BF16, "shape": (3, 70), "linear_beta": 25.0,
                                                                "beta": 2.5, "up_dtype": F32, "seed": 4}),
    "situ_glu_train-bf16-strided": (check_situ_glu_train, {"dtype": BF16, "shape": (5, 41), "linear_beta": None,
                                                           "strided": True, "seed": 5}),
    "situ_glu_train-by-hand": (check_situ_glu_train_by_hand, {}),
    "situ_glu_train-autograd": (check_situ_glu_train_autograd, {}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(INTERPRETER_CASES))
def test_kernel_under_interpreter(case, interpreter_results):
    assert interpreter_results[case] == "ok", interpreter_results[case]


# ---- CPU: validation and dispatch (no kernel launch) ------------------------------------------------------------
def test_situ_glu_train_refuses_bad_input(monkeypatch):
    """The training SiTU-GLU and its backward refuse what `situ_glu` refuses, in its words, before any launch."""
    from miles_k3.kernels import fused

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.zeros(2, 8, requires_grad=True)
    with pytest.raises(ValueError, match="situ_glu_train: gate must be a CUDA tensor"):
        fused.situ_glu_train(x, x, 4.0, None)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # past the device check
    with pytest.raises(ValueError, match="situ_glu_train: up must be float32, bfloat16 or float16, got torch.float64"):
        fused.situ_glu_train(x, x.double(), 4.0, None)
    with pytest.raises(ValueError, match=r"situ_glu_train: gate and up must have one shape .* \(2, 8\) .* \(8, 2\)"):
        fused.situ_glu_train(x, torch.zeros(8, 2), 4.0, None)
    with pytest.raises(ValueError, match="situ_glu_train: beta must be > 0, got -1.0"):
        fused.situ_glu_train(x, x, -1.0, None)
    with pytest.raises(ValueError, match="situ_glu_train: beta must be > 0, got nan"):
        fused.situ_glu_train(x, x, float("nan"), None)
    with pytest.raises(ValueError, match="situ_glu_train: linear_beta must be > 0 or None, got 0.0"):
        fused.situ_glu_train(x, x, 4.0, 0.0)
    with pytest.raises(TypeError, match="situ_glu_train: gate must be a torch.Tensor"):
        fused.situ_glu_train([1.0], x, 4.0, None)
    with pytest.raises(ValueError, match=r"situ_glu_backward: grad_out must have gate's shape .* \(2, 7\)"):
        fused.situ_glu_backward(x, x, torch.zeros(2, 7), 4.0, None)
    with pytest.raises(ValueError, match="situ_glu_backward: grad_out must be float32, bfloat16 or float16"):
        fused.situ_glu_backward(x, x, torch.zeros(2, 8, dtype=torch.float64), 4.0, None)


def test_situ_glu_dispatch_with_and_without_autograd(monkeypatch):
    """`layers.situ_glu` where the fused kernels are eligible (CUDA, simulated here: `_fused_eligible` made to
    answer as it does on CUDA, keeping the reference switch): the differentiable fused function when autograd
    needs a gradient, the inference kernel otherwise, the torch reference under reference_kernels() either way."""
    from miles_k3.kernels import fused

    calls = []
    monkeypatch.setattr(fused, "situ_glu", lambda *a: calls.append("situ_glu") or _situ_glu_torch(*a))
    monkeypatch.setattr(fused, "situ_glu_train", lambda *a: calls.append("situ_glu_train") or _situ_glu_torch(*a))
    monkeypatch.setattr(layers, "_fused_eligible", lambda *t: layers.fused_kernels_active())
    g, u = torch.randn(3, 8), torch.randn(3, 8)
    gg = g.clone().requires_grad_()
    situ_glu(gg, u, 4.0, 25.0)
    situ_glu(g, u, 4.0, 25.0)  # grad mode on, nothing needs a gradient
    with torch.no_grad():
        situ_glu(gg, u, 4.0, 25.0)
    assert calls == ["situ_glu_train", "situ_glu", "situ_glu"]
    with reference_kernels():
        situ_glu(gg, u, 4.0, 25.0)
        with torch.no_grad():
            situ_glu(g, u, 4.0, 25.0)
    situ_glu(gg, torch.randn(1, 8), 4.0, 25.0)  # broadcasting: the fused kernels need one shape
    assert calls == ["situ_glu_train", "situ_glu", "situ_glu"]


# ---- GPU ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("linear_beta", [None, 25.0])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(256, 4, 128), (3, 3072), (5, 1000)], ids=lambda s: "x".join(map(str, s)))
@gpu_test
def test_gpu_situ_glu_train(shape, dtype, linear_beta):
    check_situ_glu_train("cuda", DTYPES[dtype], shape, linear_beta, seed=sum(shape))
    check_situ_glu_train("cuda", DTYPES[dtype], shape, linear_beta, scale=1.0, seed=sum(shape) + 1)
    check_situ_glu_train("cuda", DTYPES[dtype], shape, linear_beta, scale=3.0, strided=True, seed=sum(shape) + 2)


@gpu_test
def test_gpu_situ_glu_train_by_hand_and_autograd():
    check_situ_glu_train_by_hand("cuda")
    check_situ_glu_train_autograd("cuda")


@gpu_test
def test_gpu_situ_glu_train_at_k3_expert_width():
    """One K3 MoE layer's routed rows in training (4,096 tokens x top-16 = 65,536 rows, expert width 3072, bf16,
    K3's beta 4 and linear_beta 25), through `layers.situ_glu` with autograd: it takes the fused training path,
    its output is bitwise what the engine's no-grad call (the inference kernel) gives, and its gradients are within
    `situ_glu_grad_bounds` of the fp64 truth (checked 8,192 rows at a time), as are the torch reference's. Prints
    forward + backward times of both paths (CUDA events, after a warm-up)."""
    from miles_k3.kernels import fused

    rows, width, beta, lin = 65536, 3072, 4.0, 25.0
    gen = torch.Generator(device="cuda").manual_seed(0)
    g = (torch.randn(rows, width, device="cuda", generator=gen) * 3).to(BF16)
    u = (torch.randn(rows, width, device="cuda", generator=gen) * 3).to(BF16)
    go = (torch.randn(rows, width, device="cuda", generator=gen) * 1e-3).to(BF16)
    with torch.no_grad():
        engine_out = situ_glu(g, u, beta, lin)
    assert torch.equal(engine_out, fused.situ_glu(g, u, beta, lin))

    def fwd_bwd(reference: bool):
        a, b = g.clone().requires_grad_(), u.clone().requires_grad_()
        with reference_kernels(reference):
            out = situ_glu(a, b, beta, lin)
        out.backward(go)
        return out, a.grad, b.grad

    out, grad_g, grad_u = fwd_bwd(False)
    assert out.grad_fn is not None and "SiTUGLU" in type(out.grad_fn).__name__, out.grad_fn
    assert torch.equal(out, engine_out), "training forward differs from the engine's (inference kernel) output"
    ref_out, ref_g, ref_u = fwd_bwd(True)
    _assertulps16(out.detach(), ref_out.detach(), 1, ref32=_situ_glu_torch(g.float(), u.float(), beta, lin),
                  floor=1e-30, what="k3 width forward vs torch")
    del ref_out
    chunk = 8192
    for r in range(0, rows, chunk):
        sl = slice(r, r + chunk)
        (tg, bg), (tu, bu) = situ_glu_grad_bounds(g[sl], u[sl], go[sl], beta, lin)
        _assert_within(grad_g[sl], tg, bg, f"k3 width grad_g rows {r}+")
        _assert_within(grad_u[sl], tu, bu, f"k3 width grad_u rows {r}+")
        _assert_within(ref_g[sl], tg, bg, f"k3 width torch reference grad_g rows {r}+")
        _assert_within(ref_u[sl], tu, bu, f"k3 width torch reference grad_u rows {r}+")
    same = {"grad_g": (grad_g == ref_g).float().mean().item(), "grad_u": (grad_u == ref_u).float().mean().item()}
    del tg, bg, tu, bu, grad_g, grad_u, ref_g, ref_u, out
    times = {}
    for name, reference in (("fused", False), ("torch", True)):
        fwd_bwd(reference)  # warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            fwd_bwd(reference)
        end.record()
        torch.cuda.synchronize()
        times[name] = start.elapsed_time(end) / 3
    print(f"situ_glu fwd+bwd at {rows} x {width} bf16 (incl. two input clones): fused {times['fused']:.2f} ms, "
          f"torch {times['torch']:.2f} ms; gradients bitwise equal to torch's: {same}")


if __name__ == "__main__":
    print_results(INTERPRETER_CASES)
