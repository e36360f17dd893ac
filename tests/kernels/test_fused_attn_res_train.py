"""The Block-AttnRes mixer in training: `miles_k3.kernels.fused_attn_res_train.attn_res_mix_train` (forward = the
inference kernel `fused.attn_res_mix`, backward = one more kernel + one `.sum(0)`) against an fp64 truth.

CPU: every case runs once under the Triton interpreter, in one subprocess (TRITON_INTERPRET=1 must be set before
the kernel modules are imported), and each case reports its own test; plus the refusals (no launch).
GPU (`python -m pytest -m gpu tests/kernels/test_fused_attn_res_train.py`): the same checks on CUDA, one K3-width
mixer (N = 8 sources, 4,096 rows x 7168, bf16) with the fused and torch times, and the launch counts.

The forward is bitwise `fused.attn_res_mix`'s output. The gradients (every source, both weights) are checked
against fp64 autograd of the defining formula (`_mix64`), not against torch's fp32 autograd, with a per-element bound
C * 2^-24 * S (`attn_res_grad_bounds` says how S is built from the magnitudes of the terms: the softmax backward
cancels, da_i - sum_j alpha_j da_j, so no relative criterion holds), plus half an ulp of a 16-bit result; torch's
fp32 autograd of `_attn_res_mix_torch` is held to the same bound, so the two are within twice the bound of each
other. Plus values worked by hand (two sources with equal scores, alpha = 1/2 each) and N = 1 (alpha = 1: the source
gradient is grad_out itself, bit for bit, and the weight gradients are 0).
"""
from __future__ import annotations

import pytest
import torch
from kernel_testing import HALF_ULP, SUBNORMAL_FLOOR, cuda_kernels, gpu_test, print_results, seeded

from miles_k3.model.layers import _attn_res_mix_torch

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
ATTN_BWD_C = 16  # fp32 roundings allowed, in units of 2^-24 * S (see attn_res_grad_bounds)


# ---- the truth and the bounds ---------------------------------------------------------------------------------
def _mix64(v_NRD: torch.Tensor, nw: torch.Tensor, pw: torch.Tensor, eps: float) -> torch.Tensor:
    """The defining formula (fp64 inputs): out = sum_i softmax_i(<nw * pw, v_i * rsqrt(mean(v_i^2) + eps)>) v_i."""
    q = nw * pw.reshape(-1)
    k = v_NRD * torch.rsqrt(v_NRD.pow(2).mean(-1, keepdim=True) + eps)
    return (torch.softmax(k @ q, dim=0).unsqueeze(-1) * v_NRD).sum(0)


def attn_res_grad_bounds(sources, nw, pw, grad_out, eps: float, chunk: int = 1 << 30):
    """fp64 truth and per-element bounds (for fp32 results) C * 2^-24 * S: [(grad_i, bound_i) per source],
    (grad_norm_weight, bound), (grad_proj_weight, bound), rows taken `chunk` at a time (the weights' sums add up).

    Why this S (first-order error propagation; 1 unit = one fp32 rounding of the named magnitude): per row, with
    Q_i = r_i sum_k |q_k v_ik| (the score's magnitude: s_i's rounding error, the GPU's rsqrt and its exp, whose
    argument s_i - max s is rounded, are each a few units of it) and Ds = max_i Q_i, alpha_i is good to ~alpha_i Ds.
    da_i = <g, v_i> is good to ~G_i = sum_k |g_k v_ik|; then ds_i = alpha_i (da_i - sum_j alpha_j da_j), which
    cancels, is good to E_i - |ds_i| with E_i = |ds_i| + alpha_i (Ds (|da_i - A| + sum_j alpha_j |da_j|) + G_i
    + sum_j alpha_j G_j). So grad_v_i = alpha_i g + (ds_i r_i) q - (ds_i r_i^2 s_i / D) v_i has
    S = alpha_i |g| (1 + Ds) + r_i E_i |q| + r_i^2 Q_i E_i |v_i| / D, and dq = sum over rows and i of ds_i r_i v_i
    has S_dq = sum r_i E_i |v_i| (its sum runs up to 16 rows deep in a program, then a tree over the programs: past
    ~64 programs that is deeper than C below allows, but S_dq grows linearly with the rows, the typical error only as
    their square root);
    grad_norm_weight = dq * proj_weight: S_dq |proj_weight|, grad_proj_weight: S_dq |norm_weight|. C covers the
    small constants and the depth of the fp32 sums: in the worst case a tree sum of D <= 8192 terms is off by
    log2 D = 13 roundings of the sum of their magnitudes, plus ~3 roundings after it, hence C = 16. Typical errors are
    far smaller (the roundings of a sum do not all go one way): measured max error / (2^-24 S) over the fp32 results
    of this file's cases, kernel / torch's fp32 autograd of `_attn_res_mix_torch`: 0.71 / 0.85 under the interpreter;
    0.76 / 0.92 on an H100 (N = 2..9, 300..4097 rows x 768, 64 x 7168, 4096 x 7168 with N = 8, 40 x 9000 tiled; the
    most, 0.92, at 4097 x 768 with N = 9); 1.9 / 1.9 in a trial at D = 8 (S sums few terms there).
    16-bit results add their own rounding: half an ulp of the value."""
    d = sources[-1].shape[-1]
    v = torch.stack([s.detach().reshape(-1, d).double() for s in sources])  # [N, R, D]
    g = grad_out.detach().reshape(-1, d).double()
    nw64, pw64 = nw.detach().double().reshape(d), pw.detach().double().reshape(d)
    q = (nw64 * pw64).abs()
    t_v, s_v = torch.empty_like(v), torch.empty_like(v)
    t_nw, t_pw, s_dq = (torch.zeros(d, dtype=torch.float64, device=v.device) for _ in range(3))
    for r0 in range(0, v.shape[1], chunk):
        vc, gc = v[:, r0:r0 + chunk].clone().requires_grad_(), g[r0:r0 + chunk]
        nwc, pwc = nw64.clone().requires_grad_(), pw64.clone().requires_grad_()
        _mix64(vc, nwc, pwc, eps).backward(gc)
        t_v[:, r0:r0 + chunk], t_nw, t_pw = vc.grad, t_nw + nwc.grad, t_pw + pwc.grad
        with torch.no_grad():
            vc, va = vc.detach(), vc.detach().abs()
            r = torch.rsqrt(vc.pow(2).mean(-1) + eps)  # [N, Rc]
            alpha = torch.softmax(r * (vc @ (nw64 * pw64)), dim=0)
            da = (vc * gc).sum(-1)
            a_da = (alpha * da).sum(0)
            ds = alpha * (da - a_da)
            big_q = r * (va @ q)
            ds_max = big_q.amax(0)
            big_g = (va * gc.abs()).sum(-1)
            e = ds.abs() + alpha * (ds_max * ((da - a_da).abs() + (alpha * da.abs()).sum(0)) + big_g
                                    + (alpha * big_g).sum(0))
            s_v[:, r0:r0 + chunk] = ((alpha * (1 + ds_max)).unsqueeze(-1) * gc.abs() + (r * e).unsqueeze(-1) * q
                                     + (r * r * big_q * e / d).unsqueeze(-1) * va)
            s_dq += ((r * e).unsqueeze(-1) * va).sum((0, 1))
    unit = ATTN_BWD_C * 2.0**-24
    shape = sources[-1].shape
    return ([(t_v[i].reshape(shape), unit * s_v[i].reshape(shape)) for i in range(len(sources))],
            (t_nw.reshape(nw.shape), unit * (s_dq * pw64.abs()).reshape(nw.shape)),
            (t_pw.reshape(pw.shape), unit * (s_dq * nw64.abs()).reshape(pw.shape)))


def _assert_within(got: torch.Tensor, truth: torch.Tensor, bound: torch.Tensor, what: str) -> tuple[float, float]:
    """|got - truth| <= bound (fp32 computation) + half an ulp of got's dtype (its final rounding) + subnormals;
    returns (max |got - truth| / (2^-24 S + subnormal floor): the error in units of one fp32 rounding of S, for fp32
    results (0 for 16-bit ones, where half an ulp dominates); max |got - truth| / allowed)."""
    assert got.shape == truth.shape, (what, got.shape, truth.shape)
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
    if err.numel() == 0:
        return 0.0, 0.0
    units = float((err / (bound / ATTN_BWD_C + SUBNORMAL_FLOOR[got.dtype])).max()) if got.dtype == F32 else 0.0
    return units, float((err / allowed).max())


# ---- the checks (device-agnostic: run under the interpreter on CPU, and on CUDA) --------------------------------
def _inputs(device, dtypes, shape, w_dtype, q_scale, seed):
    """Sources (source i scaled by i + 1, rows at scales 1e-3..30 so that eps matters for some), weights, grad_out."""
    gen = seeded(seed)
    d = shape[-1]
    sources = []
    for i, dt in enumerate(dtypes):
        x = torch.randn(*shape, generator=gen) * (i + 1)
        rows = x.reshape(-1, d)
        rows[::3] *= 1e-3
        rows[1::5] *= 30
        sources.append(x.to(device=device, dtype=dt))
    nw = torch.empty(d).uniform_(0.5, 1.5, generator=gen).to(device=device, dtype=w_dtype)
    pw = (torch.randn(1, d, generator=gen) * q_scale).to(device=device, dtype=w_dtype)  # scores ~ q_scale sqrt(D)
    go = torch.randn(*shape, generator=gen).to(device=device, dtype=dtypes[-1])
    return sources, nw, pw, go


def check_attn_res_mix_train(device: str, dtype: torch.dtype, shape: tuple[int, ...], n: int, eps: float = 1e-5,
                             q_scale: float = 0.1, w_dtype: torch.dtype = F32, block_d: int | None = None,
                             rows_per_program: int | None = None, src_dtypes: list | None = None,
                             need: list | None = None, seed: int = 0, chunk: int = 1 << 30) -> dict[str, float]:
    """attn_res_mix_train: forward bitwise `fused.attn_res_mix`; every gradient within `attn_res_grad_bounds` of the
    fp64 truth, as are those of `_attn_res_mix_torch`'s fp32 autograd; sources with need[i] False get no gradient.
    Returns the max errors: of the fp32 results in units of 2^-24 S ("kernel", "torch"), of all results as a
    fraction of what is allowed ("kernel/allowed", "torch/allowed")."""
    from miles_k3.kernels import fused
    from miles_k3.kernels.fused_attn_res_train import attn_res_mix_train

    dtypes = src_dtypes or [dtype] * n
    need = need or [True] * n
    sources, nw, pw, go = _inputs(device, dtypes, shape, w_dtype, q_scale, seed)
    what = f"attn_res_mix_train {dtypes[-1]} {tuple(shape)} N={n} weights {w_dtype} eps={eps}"
    leaves = [s.clone().requires_grad_(x) for s, x in zip(sources, need)]
    a, b = nw.clone().requires_grad_(), pw.clone().requires_grad_()
    out = attn_res_mix_train(leaves, a, b, eps, block_d=block_d, rows_per_program=rows_per_program)
    assert out.requires_grad and out.dtype == dtypes[-1] and out.shape == sources[-1].shape, what
    assert torch.equal(out, fused.attn_res_mix(sources, nw, pw, eps, block_d=block_d)), \
        f"{what}: forward is not the inference kernel's"
    out.backward(go)
    refs = [s.clone().requires_grad_(x) for s, x in zip(sources, need)]
    ra, rb = nw.clone().requires_grad_(), pw.clone().requires_grad_()
    _attn_res_mix_torch(refs, ra, rb, eps).backward(go)
    per_src, (t_nw, b_nw), (t_pw, b_pw) = attn_res_grad_bounds(sources, nw, pw, go, eps, chunk)
    worst = dict.fromkeys(("kernel", "torch", "kernel/allowed", "torch/allowed"), 0.0)
    pairs = [(f"source {i}", s, x.grad, r.grad, *tb, nd)
             for i, (s, x, r, tb, nd) in enumerate(zip(sources, leaves, refs, per_src, need))]
    pairs += [("norm_weight", nw, a.grad, ra.grad, t_nw, b_nw, True), ("proj_weight", pw, b.grad, rb.grad, t_pw, b_pw,
                                                                         True)]
    for name, tensor, got, ref, truth, bound, needed in pairs:
        if not needed:
            assert got is None and ref is None, f"{what} {name}: a gradient for a source that needs none"
            continue
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, (what, name, got.dtype, got.shape)
        for who, x in (("kernel", got), ("torch", ref)):
            units, frac = _assert_within(x, truth, bound, f"{what} {who} grad {name}")
            worst[who], worst[who + "/allowed"] = max(worst[who], units), max(worst[who + "/allowed"], frac)
    return worst


def check_attn_res_mix_train_by_hand(device: str) -> None:
    """Two sources, D = 2, eps = 0, grad_out g = (1, 0); mean(v_i^2) is 1 or 4, so r_i = 1 or 1/2 and every value is
    dyadic. grad_v_i = alpha_i g + r_i ds_i (q - k_i s_i / D), ds_i = alpha_i (da_i - sum_j alpha_j da_j).
    A: v1 = (1, -1), v2 = (2, 2): k1 = (1, -1), k2 = (1, 1); nw = (2, 1), pw = (1/2, 0): q = (1, 0), s1 = s2 = 1,
       alpha = 1/2 each; out = (3/2, 1/2); da = (1, 2), mean 3/2, ds = (-1/4, 1/4);
       grad_v1 = (1/2, 0) - 1/4 ((1, 0) - (1, -1)/2) = (3/8, -1/8), grad_v2 = (1/2, 0) + 1/2 * 1/4 ((1, 0) - (1, 1)/2)
       = (9/16, -1/16); dq = -1/4 k1 + 1/4 k2 = (0, 1/2): grad_nw = dq * pw = (0, 0), grad_pw = dq * nw = (0, 1/2).
    B: v1 = (1, -1), v2 = (-2, 2): k1 = (1, -1), k2 = (-1, 1); nw = (2, 1/2), pw = (1/2, 2): q = (1, 1), s = 0 both,
       alpha = 1/2; out = (-1/2, 1/2); da = (1, -2), mean -1/2, ds = (3/4, -3/4); grad_v1 = (1/2, 0) + 3/4 (1, 1)
       = (5/4, 3/4), grad_v2 = (1/2, 0) - 1/2 * 3/4 (1, 1) = (1/8, -3/8); dq = 3/4 k1 - 3/4 k2 = (3/2, -3/2):
       grad_nw = (3/4, -3), grad_pw = (3, -3/4). Also in bf16 (all exact there), compared for equality."""
    from miles_k3.kernels.fused_attn_res_train import attn_res_mix_train

    cases = {
        "A": ([[1.0, -1.0], [2.0, 2.0]], [2.0, 1.0], [[0.5, 0.0]],
              ([1.5, 0.5], [[0.375, -0.125], [0.5625, -0.0625]], [0.0, 0.0], [[0.0, 0.5]])),
        "B": ([[1.0, -1.0], [-2.0, 2.0]], [2.0, 0.5], [[0.5, 2.0]],
              ([-0.5, 0.5], [[1.25, 0.75], [0.125, -0.375]], [0.75, -3.0], [[3.0, -0.75]])),
    }
    for name, (vs, nwv, pwv, (w_out, w_gv, w_nw, w_pw)) in cases.items():
        for dt in (F32, BF16):
            srcs = [torch.tensor(x, device=device, dtype=dt).requires_grad_() for x in vs]
            nw = torch.tensor(nwv, device=device, dtype=dt).requires_grad_()
            pw = torch.tensor(pwv, device=device, dtype=dt).requires_grad_()
            out = attn_res_mix_train(srcs, nw, pw, 0.0)
            out.backward(torch.tensor([1.0, 0.0], device=device, dtype=dt))
            got = [out, srcs[0].grad, srcs[1].grad, nw.grad, pw.grad]
            want = [w_out, w_gv[0], w_gv[1], w_nw, w_pw]
            for i, (x, w) in enumerate(zip(got, want)):
                assert x.dtype == dt, (name, i, x.dtype)
                w = torch.tensor(w, dtype=torch.float32)
                if dt == F32:  # a GPU's rsqrt is an approximation: 1e-7 relative
                    torch.testing.assert_close(x.detach().float().cpu(), w, rtol=0, atol=1e-6,
                                               msg=lambda m, name=name, i=i: f"by hand {name}, result {i}: {m}")
                else:
                    assert torch.equal(x.detach().float().cpu(), w), (name, i, x, w)


def check_attn_res_mix_train_single_source(device: str) -> None:
    """N = 1: alpha = 1 exactly, so ds = 1 * (da - 1 * da) = 0: the source's gradient is grad_out bit for bit and
    both weight gradients are exactly 0 (fp32 and bf16, leading shape [B, T, D], two rows per backward program)."""
    from miles_k3.kernels.fused_attn_res_train import attn_res_mix_train

    for dt in (F32, BF16):
        (x,), nw, pw, go = _inputs(device, [dt], (3, 5, 40), dt, 1.0, 11)
        x.requires_grad_()
        nw.requires_grad_()
        pw.requires_grad_()
        out = attn_res_mix_train([x], nw, pw, 1e-5, rows_per_program=2)
        assert torch.equal(out, x.detach()), "N = 1: out = v"
        out.backward(go)
        assert torch.equal(x.grad, go) and x.grad.dtype == dt
        assert not bool(nw.grad.any()) and not bool(pw.grad.any()) and pw.grad.shape == (1, 40)


def check_attn_res_mix_train_autograd(device: str) -> None:
    """Autograd plumbing: weights that need no gradient, a source that needs none, one tensor as two sources (its
    gradients add up), an expanded grad_out (`.sum()`), non-contiguous sources, no rows, the sources' gradients as
    contiguous views of one buffer (no copies), and a backward that would build a graph (second-order gradients)
    refused rather than silently giving first-order values that do not differentiate further."""
    from miles_k3.kernels.fused_attn_res_train import attn_res_mix_train

    srcs, nw, pw, go = _inputs(device, [F32] * 3, (6, 24), F32, 0.3, 5)

    x = srcs[0].clone().requires_grad_()  # weights and sources[1] need no gradient; x is sources 0 and 2
    attn_res_mix_train([x, srcs[1], x], nw, pw, 1e-5).backward(go)
    kx, x.grad = x.grad, None
    _attn_res_mix_torch([x, srcs[1], x], nw, pw, 1e-5).backward(go)
    torch.testing.assert_close(kx, x.grad, rtol=1e-5, atol=1e-5)
    got, ref = ([s.t().contiguous().t().requires_grad_() for s in srcs] for _ in range(2))  # column-major
    attn_res_mix_train(got, nw, pw, 1e-5).sum().backward()  # grad_out expanded (stride 0): copied
    _attn_res_mix_torch(ref, nw, pw, 1e-5).sum().backward()
    for g, r in zip(got, ref):
        assert not g.is_contiguous() and g.grad.shape == g.shape
        torch.testing.assert_close(g.grad, r.grad, rtol=1e-5, atol=1e-5)
    got = [s.clone().requires_grad_() for s in srcs]
    attn_res_mix_train(got, nw, pw, 1e-5).backward(go)
    assert all(g.grad.is_contiguous() for g in got)
    base = got[0].grad.data_ptr()
    assert [g.grad.data_ptr() - base for g in got] == [i * 6 * 24 * 4 for i in range(3)], "not views of one buffer"
    e = [torch.zeros(0, 8, device=device, requires_grad=True) for _ in range(2)]
    w, p = torch.ones(8, device=device, requires_grad=True), torch.ones(1, 8, device=device, requires_grad=True)
    out = attn_res_mix_train(e, w, p, 1e-5)
    out.sum().backward()
    assert out.shape == (0, 8) and e[0].grad.shape == (0, 8) and not bool(w.grad.any()) and p.grad.shape == (1, 8)
    y = srcs[0].clone().requires_grad_()
    try:
        torch.autograd.grad(attn_res_mix_train([y, srcs[1]], nw, pw, 1e-5).sum(), y, create_graph=True)
    except RuntimeError as err:
        assert "not twice differentiable" in str(err), err
    else:
        raise AssertionError("create_graph through attn_res_mix_train (a second-order gradient) was not refused")


# ---- CPU: the checks under the Triton interpreter, in one subprocess --------------------------------------------
INTERPRETER_CASES: dict[str, tuple] = {}  # name -> (check, kwargs); run on CPU tensors under TRITON_INTERPRET=1
for _n, _dt in (("fp32", F32), ("bf16", BF16)):
    INTERPRETER_CASES |= {
        f"attn_res_mix_train-{_n}-N2-BTD": (check_attn_res_mix_train, {"dtype": _dt, "shape": (2, 5, 96), "n": 2}),
        f"attn_res_mix_train-{_n}-N5-peaky": (check_attn_res_mix_train, {"dtype": _dt, "shape": (9, 96), "n": 5,
                                                                         "q_scale": 1.0, "seed": 1}),
        # D = 200 in tiles of 64 (the last partial), 2 rows per program (the last program half empty), eps 0
        f"attn_res_mix_train-{_n}-N3-tiled": (check_attn_res_mix_train, {"dtype": _dt, "shape": (5, 200), "n": 3,
                                                                        "block_d": 64, "rows_per_program": 2,
                                                                        "eps": 0.0, "seed": 2}),
    }
INTERPRETER_CASES |= {
    # one tile, 4 rows per program over 7 rows (the last program: 3 rows and one past R), eps 0, N = 9 (16 lanes)
    "attn_res_mix_train-fp32-N9-rows-per-program": (check_attn_res_mix_train, {
        "dtype": F32, "shape": (7, 48), "n": 9, "rows_per_program": 4, "eps": 0.0, "seed": 3}),
    "attn_res_mix_train-fp32-residual-bf16-weights": (check_attn_res_mix_train, {  # model.fp32_residual
        "dtype": F32, "shape": (2, 3, 64), "n": 4, "w_dtype": BF16, "seed": 4}),
    "attn_res_mix_train-bf16-bf16-weights": (check_attn_res_mix_train, {
        "dtype": BF16, "shape": (6, 64), "n": 3, "w_dtype": BF16, "q_scale": 0.5, "seed": 5}),
    "attn_res_mix_train-fp16": (check_attn_res_mix_train, {"dtype": F16, "shape": (4, 33), "n": 2, "seed": 6}),
    "attn_res_mix_train-mixed-dtypes": (check_attn_res_mix_train, {  # bf16 blocks, an fp32 partial sum
        "dtype": F32, "shape": (5, 40), "n": 3, "src_dtypes": [BF16, BF16, F32], "seed": 7}),
    "attn_res_mix_train-some-sources-need-no-grad": (check_attn_res_mix_train, {
        "dtype": BF16, "shape": (5, 40), "n": 4, "need": [False, True, False, True], "seed": 8}),
    "attn_res_mix_train-only-the-weights-need-grad": (check_attn_res_mix_train, {
        "dtype": F32, "shape": (3, 40), "n": 3, "need": [False] * 3, "seed": 10}),
    "attn_res_mix_train-by-hand": (check_attn_res_mix_train_by_hand, {}),
    "attn_res_mix_train-single-source": (check_attn_res_mix_train_single_source, {}),
    "attn_res_mix_train-autograd": (check_attn_res_mix_train_autograd, {}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(INTERPRETER_CASES))
def test_kernel_under_interpreter(case, interpreter_results):
    assert interpreter_results[case] == "ok", interpreter_results[case]


# ---- CPU: validation (no kernel launch) -------------------------------------------------------------------------
def test_attn_res_mix_train_refuses_what_attn_res_mix_refuses(monkeypatch):
    """Every refusal of `fused.attn_res_mix`, with its message (under this function's name), before any launch."""
    from miles_k3.kernels import fused
    from miles_k3.kernels.fused_attn_res_train import attn_res_mix_train

    x, w, p = torch.zeros(2, 8, requires_grad=True), torch.ones(8), torch.ones(1, 8)
    bad = {
        "cpu": ([x, x], w, p, 1e-5),
        "empty": ([], w, p, 1e-5),
        "not a list": (x, w, p, 1e-5),
        "fp64": ([x, x.double()], w, p, 1e-5),
        "not a tensor": ([x, [1.0]], w, p, 1e-5),
        "0-d": ([torch.zeros(())], torch.ones(1), torch.ones(1), 1e-5),
        "shapes": ([x, torch.zeros(8, 2)], w, p, 1e-5),
        "norm_weight shape": ([x], torch.ones(7), p, 1e-5),
        "proj_weight shape": ([x], w, torch.ones(1, 9), 1e-5),
        "weight dtype": ([x], w.long(), p, 1e-5),
        "eps < 0": ([x], w, p, -1.0),
        "eps nan": ([x], w, p, float("nan")),
    }
    for name, args in bad.items():
        monkeypatch.setenv("TRITON_INTERPRET", "0" if name == "cpu" else "1")  # past the device check but "cpu"
        errors = []
        for fn in (fused.attn_res_mix, attn_res_mix_train):
            with pytest.raises((ValueError, TypeError)) as info:
                fn(*args)
            errors.append((info.type, str(info.value)))
        (t0, m0), (t1, m1) = errors
        assert m1.startswith("attn_res_mix_train: "), (name, m1)
        assert t1 is t0 and m1.replace("attn_res_mix_train", "attn_res_mix", 1) == m0, (name, m0, m1)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="attn_res_mix_train: sources\\[0\\] must be a CUDA tensor"):
        attn_res_mix_train([x], w, p, 1e-5)


def test_rows_per_program():
    """Rows per backward program: powers of two up to 16, as many as keep >= 256 programs (fewer partials of dq)."""
    from miles_k3.kernels.fused_attn_res_train import _rows_per_program

    got = {r: _rows_per_program(r) for r in (0, 1, 511, 512, 1023, 1024, 4096, 4097, 8191, 10**6)}
    assert got == {0: 1, 1: 1, 511: 1, 512: 2, 1023: 2, 1024: 4, 4096: 16, 4097: 16, 8191: 16, 10**6: 16}, got


# ---- GPU ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("n", [1, 2, 5, 9])
@pytest.mark.parametrize("rows", [7, 512, 4097])
@gpu_test
def test_gpu_attn_res_mix_train(rows, n, dtype):
    dt = {"fp32": F32, "bf16": BF16}[dtype]
    check_attn_res_mix_train("cuda", dt, (rows, 768), n, seed=rows * 10 + n)
    check_attn_res_mix_train("cuda", dt, (rows, 768), n, q_scale=1.0, w_dtype=BF16, seed=rows * 10 + n + 1)


@pytest.mark.parametrize("case", [
    {"shape": (64, 7168), "n": 8}, {"shape": (2, 33, 7168), "n": 3, "w_dtype": BF16},
    {"shape": (40, 9000), "n": 4, "eps": 0.0}, {"shape": (300, 768), "n": 9, "block_d": 128, "rows_per_program": 8},
    {"shape": (2, 3, 768), "n": 4, "need": [True, False, False, True]},
    {"shape": (9, 768), "n": 2, "need": [False] * 2},
    {"shape": (100, 768), "n": 3, "src_dtypes": [BF16, BF16, F32]},
], ids=["k3-D7168", "k3-BTD-bf16-weights", "D9000-tiled", "forced-tiles", "need", "weights-only", "mixed-dtypes"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@gpu_test
def test_gpu_attn_res_mix_train_wide(dtype, case):
    check_attn_res_mix_train("cuda", {"fp32": F32, "bf16": BF16}[dtype], **case)


@gpu_test
def test_gpu_attn_res_mix_train_by_hand_and_autograd():
    check_attn_res_mix_train_by_hand("cuda")
    check_attn_res_mix_train_single_source("cuda")
    check_attn_res_mix_train_autograd("cuda")


def _k3_mixer(rows: int = 4096, n: int = 8, d: int = 7168):
    """K3's mixer inputs: N sources [rows, D] bf16 (leaves), bf16 weights, grad_out."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    srcs = [(torch.randn(rows, d, device="cuda", generator=gen) * (i + 1)).to(BF16).requires_grad_()
            for i in range(n)]
    nw = torch.empty(d, device="cuda").uniform_(0.5, 1.5, generator=gen).to(BF16).requires_grad_()
    pw = (torch.randn(1, d, device="cuda", generator=gen) * 0.02).to(BF16).requires_grad_()
    go = (torch.randn(rows, d, device="cuda", generator=gen) * 1e-3).to(BF16)
    return srcs, nw, pw, go


@gpu_test
def test_gpu_attn_res_mix_train_at_k3_width():
    """N = 8 sources of 4,096 rows x 7168 (bf16, K3's hidden size), bf16 weights: the fused gradients within
    `attn_res_grad_bounds` of the fp64 truth (512 rows at a time), as are torch's. Prints forward + backward times
    of both (CUDA events, after a warm-up; on an H100: fused 1.3 ms, of which the backward kernel 0.6 ms at 96
    registers and no spills, torch 14.3 ms) and the errors as fractions of the allowed."""
    from miles_k3.kernels.fused_attn_res_train import attn_res_mix_train

    srcs, nw, pw, go = _k3_mixer()
    worst = check_attn_res_mix_train("cuda", BF16, (4096, 7168), 8, q_scale=0.02, w_dtype=BF16, chunk=512)
    times = {}
    for name, fn in (("fused", attn_res_mix_train), ("torch", _attn_res_mix_torch)):
        def step(fn=fn):
            for t in (*srcs, nw, pw):
                t.grad = None
            fn(srcs, nw, pw, 1e-5).backward(go)
        step()  # warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            step()
        end.record()
        torch.cuda.synchronize()
        times[name] = start.elapsed_time(end) / 5
    print(f"attn_res_mix fwd+bwd, N = 8 x 4096 x 7168 bf16: fused {times['fused']:.2f} ms, torch "
          f"{times['torch']:.2f} ms; max errors: {worst}")


def _launches(w_dtype: torch.dtype) -> tuple[list[str], list[str], list[str]]:
    """CUDA kernels of (the fused forward, fused forward + backward, torch's forward + backward) at k3_m width."""
    from miles_k3.kernels.fused_attn_res_train import attn_res_mix_train

    srcs, nw, pw, go = _k3_mixer(rows=64, n=5, d=768)
    nw, pw = nw.detach().to(w_dtype).requires_grad_(), pw.detach().to(w_dtype).requires_grad_()
    with torch.no_grad():
        fwd = cuda_kernels(lambda: attn_res_mix_train(srcs, nw, pw, 1e-5))

    def step(fn):  # fresh gradients each call (cuda_kernels calls twice: a second call would accumulate)
        for t in (*srcs, nw, pw):
            t.grad = None
        fn(srcs, nw, pw, 1e-5).backward(go)

    return fwd, cuda_kernels(lambda: step(attn_res_mix_train)), cuda_kernels(lambda: step(_attn_res_mix_torch))


@gpu_test
def test_gpu_attn_res_mix_train_launch_counts():
    """torch.profiler: the forward is 2 kernels (stack, mix); forward + backward at most 5 (the backward kernel, the
    weight gradients' .sum(0), one cast for bf16 weights; the leaves adopt the gradient views without a copy)."""
    for w_dtype in (F32, BF16):
        fwd, got, ref = _launches(w_dtype)
        assert len(fwd) == 2 and "_attn_res_mix_kernel" in fwd[1], fwd
        assert len(got) <= 5 and any("_attn_res_mix_bwd_kernel" in k for k in got), (w_dtype, got)
        print(f"weights {w_dtype}: fused {len(got)} kernels {got}; torch {len(ref)}")
        assert len(ref) > len(got), ref


if __name__ == "__main__":  # the interpreter subprocess of `interpreter_results`
    print_results(INTERPRETER_CASES)
