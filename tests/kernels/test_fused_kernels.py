"""Fused Triton kernels (`miles_k3.kernels.fused`) against their pure-torch references in `miles_k3.model.layers`.

CPU: every case runs once under the Triton interpreter, in one subprocess (TRITON_INTERPRET=1 must be set before
the kernel module is imported), and each case reports its own test. Plus the dispatch rules that need no kernel.
GPU (`python -m pytest -m gpu tests/kernels/test_fused_kernels.py`): the same checks at k3_m shapes (and a few real-K3
ones) on CUDA against the reference on CUDA, that `RMSNorm` / `attn_res_mix` / `situ_glu` take the fused path under
`torch.no_grad()` (and, when autograd needs it, the torch path, or for `situ_glu` the differentiable
`fused.situ_glu_train`), and that the fused calls capture in a CUDA graph.

Tolerances. fp32 outputs: 1e-5 relative (plus an absolute floor for AttnRes, below, and 1e-30 for subnormal SiTU
outputs, which the GPU flushes to zero). 16-bit outputs: at most 1 ulp from the reference, with these reasons for the two spots
where 1 ulp of the output is not the right unit:
  * rms_norm rounds twice (normed -> x.dtype, then normed * weight -> x.dtype), so a 1-ulp tie-break difference
    in `normed` can become 2 ulps of the product. Checked exactly instead: with weight = 1 the kernel is within
    1 ulp of the reference, and with any weight it is bitwise `rms_norm(x, 1) * weight.to(x.dtype)`.
  * attn_res_mix: out is a convex combination of the sources, and fp32 rounding in the scores (which grows with
    |score|, up to ~30 at k3_m width with a unit-scale query) perturbs the softmax weights by ~1e-6..1e-5
    relative, so its error scales with max|v| rather than |out|: where out cancels to ~0 neither 1e-5 of |out|
    nor 1 ulp holds. The absolute floor is 1e-5 * max|v| (the fp32 torch reference itself is up to ~5e-6 * max|v|
    from an fp64 evaluation at N=9, D=768, unit-scale query; on an H200 the kernel was within 2.7e-6 * max|v| of
    the reference).
SiTU-GLU in training (`situ_glu_train`, its backward kernel): tests/kernels/test_fused_situ_glu_train.py.
"""
from __future__ import annotations

import pytest
import torch
from kernel_testing import DTYPES, SITU_SPECIALS, capture, cuda_kernels, gpu_test, print_results, seeded
from kernel_testing import assert_ulps16 as _assertulps16
from torch import nn

from miles_k3.model import layers
from miles_k3.model.layers import (
    RMSNorm,
    _attn_res_mix_torch,
    _rms_norm_torch,
    _situ_glu_torch,
    attn_res_mix,
    reference_kernels,
    situ_glu,
)

BITS16 = {torch.bfloat16, torch.float16}


# ---- comparison helpers ---------------------------------------------------------------------------------------
def _assert_fp32(got: torch.Tensor, ref: torch.Tensor, atol: float, what: str = "") -> None:
    assert got.dtype == ref.dtype == torch.float32 and got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=atol, msg=lambda m: f"{what}: {m}")



# ---- the checks (device-agnostic: run under the interpreter on CPU, and on CUDA) --------------------------------
def check_rms_norm(device: str, dtype: torch.dtype, shape: tuple[int, ...], eps: float = 1e-5,
                   weight_dtype: torch.dtype = torch.float32, block_d: int | None = None, strided: bool = False,
                   seed: int = 0, out_dtype: torch.dtype | None = None) -> None:
    from miles_k3.kernels import fused

    g = seeded(seed)
    d = shape[-1]
    x = torch.randn(*shape[:-1], d + 5 if strided else d, generator=g) * 3
    rows = x.reshape(-1, x.shape[-1])
    rows[::3] *= 1e-3  # a range of row scales (eps matters for the small ones)
    rows[1::4] *= 1e3
    x = x.to(device=device, dtype=dtype)
    if strided:
        x = x[..., 2:d + 2]  # rows with a stride != D, read in place
    w = torch.empty(d).uniform_(0.5, 1.5, generator=g).to(device=device, dtype=weight_dtype)
    if out_dtype is not None:  # fp32 x read by a bf16 sublayer (model.fp32_residual): the fp32 result rounded once
        got = fused.rms_norm(x, w, eps, out_dtype=out_dtype, block_d=block_d)
        ref32 = _rms_norm_torch(x, w, eps)
        assert got.shape == x.shape and got.dtype == out_dtype and ref32.dtype == dtype == torch.float32
        _assertulps16(got, _rms_norm_torch(x, w, eps, out_dtype), 1, what=f"rms_norm {dtype} -> {out_dtype}")
        assert bool(((got.float() - ref32).abs() <= ref32.abs() * 2.0**-8 + 1e-30).all())  # half a bf16 step
        return
    got = fused.rms_norm(x, w, eps, block_d=block_d)
    ref = _rms_norm_torch(x, w, eps)
    what = f"rms_norm {dtype} {tuple(shape)}"
    assert got.shape == x.shape and got.dtype == dtype
    if dtype == torch.float32:
        _assert_fp32(got, ref, atol=1e-6, what=what)
        return
    ones = torch.ones(d, device=device, dtype=weight_dtype)
    n_got = fused.rms_norm(x, ones, eps, block_d=block_d)
    _assertulps16(n_got, _rms_norm_torch(x, ones, eps), 1, what=what + " (weight 1)")
    assert torch.equal(got, n_got * w.to(dtype)), f"{what}: weight multiply is not x.dtype's rounded product"
    _assertulps16(got, ref, 2, what=what)  # follows from the two lines above; kept as an end-to-end bound


def check_attn_res_mix(device: str, dtype: torch.dtype, shape: tuple[int, ...], n: int, eps: float = 1e-5,
                       q_scale: float = 0.1, block_d: int | None = None, seed: int = 0) -> None:
    from miles_k3.kernels import fused

    g = seeded(seed)
    d = shape[-1]
    sources = [(torch.randn(*shape, generator=g) * (i + 1)).to(device=device, dtype=dtype) for i in range(n)]
    nw = torch.empty(d).uniform_(0.5, 1.5, generator=g).to(device)
    pw = (torch.randn(1, d, generator=g) * q_scale).to(device)  # score std ~ q_scale * sqrt(D)
    got = fused.attn_res_mix(sources, nw, pw, eps, block_d=block_d)
    ref32 = _attn_res_mix_torch([s.float() for s in sources], nw, pw, eps)
    what = f"attn_res_mix {dtype} {tuple(shape)} N={n}"
    assert got.shape == sources[-1].shape and got.dtype == dtype
    floor = 1e-5 * max(float(s.abs().max()) for s in sources)  # see the module docstring
    if dtype == torch.float32:
        _assert_fp32(got, _attn_res_mix_torch(sources, nw, pw, eps), atol=floor, what=what)
    else:
        _assertulps16(got, _attn_res_mix_torch(sources, nw, pw, eps), 1, ref32=ref32, floor=floor, what=what)


def check_situ_glu(device: str, dtype: torch.dtype, shape: tuple[int, ...], linear_beta: float | None,
                   beta: float = 4.0, scale: float = 30.0, up_dtype: torch.dtype | None = None,
                   seed: int = 0, sliced: bool = False) -> None:
    """`sliced`: gate and up are column slices of one wider [..., 2 * D + 3] tensor (a fused projection's output,
    rows of unit stride, read in place) rather than tensors of their own."""
    from miles_k3.kernels import fused

    gen = seeded(seed)
    g = torch.randn(*shape, generator=gen) * scale
    u = torch.randn(*shape, generator=gen) * scale
    g[..., ::5] *= 1e-2  # plenty of small |g / beta| (the polynomial branch of tanh)
    sp = torch.tensor(SITU_SPECIALS)
    k = min(sp.numel(), g.numel())
    g.view(-1)[:k], u.view(-1)[:k] = sp[:k], sp.flip(0)[:k]  # large magnitudes, the 0.3 switch, zeros
    g, u = g.to(device=device, dtype=dtype), u.to(device=device, dtype=up_dtype or dtype)
    if sliced:  # the same values, at column 3 and D + 3 of one wider row; NaNs in the columns around them
        d = shape[-1]
        wide = torch.full((*shape[:-1], 2 * d + 3), float("nan"), device=device, dtype=dtype)
        wide[..., 3:d + 3], wide[..., d + 3:] = g, u
        g, u = wide[..., 3:d + 3], wide[..., d + 3:]
        assert not g.is_contiguous() and g.stride(-1) == 1
    got = fused.situ_glu(g, u, beta, linear_beta)
    ref = _situ_glu_torch(g, u, beta, linear_beta)
    what = f"situ_glu {dtype} {tuple(shape)} linear_beta={linear_beta}"
    assert got.shape == g.shape and got.dtype == dtype
    assert bool(got.isfinite().all()), f"{what}: non-finite output for finite inputs"
    if dtype == torch.float32:
        _assert_fp32(got, ref, atol=1e-30, what=what)  # floor: subnormal products (the GPU flushes them)
    else:
        _assertulps16(got, ref, 1, ref32=_situ_glu_torch(g.float(), u.float(), beta, linear_beta), floor=1e-30,
                     what=what)




# ---- CPU: the checks under the Triton interpreter, in one subprocess --------------------------------------------
F32, BF16 = torch.float32, torch.bfloat16
INTERPRETER_CASES: dict[str, tuple] = {}  # name -> (check, kwargs); run on CPU tensors under TRITON_INTERPRET=1
for _n, _dt in (("fp32", F32), ("bf16", BF16)):
    INTERPRETER_CASES |= {
        f"rms_norm-{_n}-D96": (check_rms_norm, {"dtype": _dt, "shape": (3, 5, 96)}),
        f"rms_norm-{_n}-D700": (check_rms_norm, {"dtype": _dt, "shape": (3, 5, 700), "seed": 1}),
        f"rms_norm-{_n}-D700-tiled": (check_rms_norm, {"dtype": _dt, "shape": (4, 700), "block_d": 128,
                                                       "seed": 2}),
        f"rms_norm-{_n}-strided-bf16w": (check_rms_norm, {"dtype": _dt, "shape": (2, 3, 96), "strided": True,
                                                          "weight_dtype": BF16, "seed": 3}),
        f"attn_res_mix-{_n}-N1": (check_attn_res_mix, {"dtype": _dt, "shape": (3, 5, 96), "n": 1}),
        f"attn_res_mix-{_n}-N2": (check_attn_res_mix, {"dtype": _dt, "shape": (3, 5, 96), "n": 2, "seed": 1}),
        f"attn_res_mix-{_n}-N5": (check_attn_res_mix, {"dtype": _dt, "shape": (3, 5, 96), "n": 5,
                                                       "q_scale": 1.0, "seed": 2}),
        f"attn_res_mix-{_n}-N3-D200-tiled": (check_attn_res_mix, {"dtype": _dt, "shape": (4, 200), "n": 3,
                                                                  "block_d": 64, "seed": 3}),
        f"situ_glu-{_n}-lin25": (check_situ_glu, {"dtype": _dt, "shape": (8, 100), "linear_beta": 25.0}),
        f"situ_glu-{_n}-linNone": (check_situ_glu, {"dtype": _dt, "shape": (8, 100), "linear_beta": None,
                                                    "seed": 1}),
    }
INTERPRETER_CASES["rms_norm-fp32-to-bf16"] = (check_rms_norm, {"dtype": F32, "shape": (3, 5, 96), "weight_dtype": BF16,
                                                               "out_dtype": BF16, "seed": 4})
INTERPRETER_CASES["rms_norm-fp32-to-bf16-tiled"] = (check_rms_norm, {"dtype": F32, "shape": (4, 700), "block_d": 128,
                                                                     "weight_dtype": BF16, "out_dtype": BF16,
                                                                     "seed": 5})
INTERPRETER_CASES["situ_glu-bf16-sliced"] = (check_situ_glu, {"dtype": BF16, "shape": (5, 2, 60), "linear_beta": 25.0,
                                                              "sliced": True, "seed": 4})
INTERPRETER_CASES["situ_glu-fp32-sliced"] = (check_situ_glu, {"dtype": F32, "shape": (3, 70), "linear_beta": None,
                                                              "sliced": True, "seed": 5})
INTERPRETER_CASES["situ_glu-fp16-lin25"] = (check_situ_glu, {"dtype": torch.float16, "shape": (4, 50),
                                                             "linear_beta": 25.0, "scale": 3.0, "seed": 2})
INTERPRETER_CASES["situ_glu-bf16-gate-fp32-up"] = (check_situ_glu, {"dtype": BF16, "shape": (3, 70),
                                                                    "linear_beta": 25.0, "beta": 2.5,
                                                                    "up_dtype": F32, "seed": 3})


@pytest.mark.slow
@pytest.mark.parametrize("case", list(INTERPRETER_CASES))
def test_kernel_under_interpreter(case, interpreter_results):
    assert interpreter_results[case] == "ok", interpreter_results[case]


# ---- CPU: dispatch rules and validation (no kernel launch) ------------------------------------------------------
def test_cpu_calls_take_the_torch_path_bitwise():
    """On CPU the public functions are the references, bit for bit, with and without grad."""
    torch.manual_seed(0)
    x = torch.randn(3, 4, 32, dtype=torch.bfloat16)
    norm, proj = RMSNorm(32, 1e-5), nn.Linear(32, 1, bias=False)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        assert torch.equal(norm(x), _rms_norm_torch(x, norm.weight, 1e-5))
        srcs = [x, x * 2, x - 1]
        want = _attn_res_mix_torch(srcs, norm.weight, proj.weight, 1e-5)
        assert torch.equal(attn_res_mix(srcs, norm, proj), want)
        assert torch.equal(situ_glu(x * 9, x, 4.0, 25.0), _situ_glu_torch(x * 9, x, 4.0, 25.0))
    assert norm(x).requires_grad


def test_reference_kernels_switch():
    before = layers.fused_kernels_active()
    with reference_kernels():
        assert not layers.fused_kernels_active()
        with reference_kernels(False):
            assert layers.fused_kernels_active()
        assert not layers.fused_kernels_active()
    assert layers.fused_kernels_active() == before


def test_fused_entry_points_validate(monkeypatch):
    from miles_k3.kernels import fused

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="CUDA"):
        fused.rms_norm(x, torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        fused.situ_glu(x.double(), x.double(), 4.0, None)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # past the device check: shape and argument errors
    with pytest.raises(ValueError, match=r"shape \[8\] or \[1, 8\]"):
        fused.rms_norm(x, torch.ones(7), 1e-5)
    with pytest.raises(ValueError, match="non-empty list"):
        fused.attn_res_mix([], torch.ones(8), torch.ones(1, 8), 1e-5)
    with pytest.raises(ValueError, match="share one shape"):
        fused.attn_res_mix([x, torch.zeros(3, 8)], torch.ones(8), torch.ones(1, 8), 1e-5)
    with pytest.raises(ValueError, match="one shape"):
        fused.situ_glu(x, torch.zeros(2, 9), 4.0, None)
    with pytest.raises(ValueError, match="beta must be > 0"):
        fused.situ_glu(x, x, 0.0, None)
    with pytest.raises(TypeError, match="torch.Tensor"):
        fused.situ_glu(x.numpy(), x, 4.0, None)
    assert fused.ACT_DTYPES == layers._FUSED_DTYPES
    assert fused.rms_norm(torch.zeros(0, 8), torch.ones(8), 1e-5).shape == (0, 8)  # empty: no launch



# ---- GPU ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 7, 64, 512])
@gpu_test
def test_gpu_rms_norm(rows, dtype):
    check_rms_norm("cuda", DTYPES[dtype], (rows, 768), seed=rows)
    check_rms_norm("cuda", DTYPES[dtype], (rows, 512), eps=1e-6, seed=rows + 1)  # an MLA latent norm


@pytest.mark.parametrize("case", [{"shape": (4, 7168)}, {"shape": (3, 9000)}, {"shape": (2, 5, 768),
                                  "strided": True, "weight_dtype": BF16}, {"shape": (16, 768), "block_d": 256}],
                         ids=["k3-D7168", "D9000-tiled", "strided", "forced-tiles"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@gpu_test
def test_gpu_rms_norm_wide_and_strided(dtype, case):
    check_rms_norm("cuda", DTYPES[dtype], **case)


@pytest.mark.parametrize("rows", [1, 7, 512])
@gpu_test
def test_gpu_rms_norm_of_an_fp32_residual_into_bf16(rows):
    check_rms_norm("cuda", F32, (rows, 768), weight_dtype=BF16, out_dtype=BF16, seed=rows)
    check_rms_norm("cuda", F32, (rows, 7168), weight_dtype=BF16, out_dtype=BF16, seed=rows + 1)  # tiled at K3 width


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("n", [1, 2, 5, 9])
@pytest.mark.parametrize("rows", [1, 7, 64, 512])
@gpu_test
def test_gpu_attn_res_mix(rows, n, dtype):
    check_attn_res_mix("cuda", DTYPES[dtype], (rows, 768), n, seed=rows * 10 + n)
    check_attn_res_mix("cuda", DTYPES[dtype], (rows, 768), n, q_scale=1.0, seed=rows * 10 + n + 1)  # peaky


@pytest.mark.parametrize("case", [{"shape": (4, 7168), "n": 64}, {"shape": (2, 3, 7168), "n": 17, "q_scale": 0.02},
                                  {"shape": (8, 9000), "n": 4}, {"shape": (8, 768), "n": 9, "block_d": 128}],
                         ids=["k3-N64", "k3-N17", "D9000-tiled", "forced-tiles"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@gpu_test
def test_gpu_attn_res_mix_wide(dtype, case):
    check_attn_res_mix("cuda", DTYPES[dtype], **case)


@pytest.mark.parametrize("linear_beta", [None, 25.0])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(256, 4, 128), (512, 256), (3, 3072)], ids=lambda s: "x".join(map(str, s)))
@gpu_test
def test_gpu_situ_glu(shape, dtype, linear_beta):
    check_situ_glu("cuda", DTYPES[dtype], shape, linear_beta, seed=sum(shape))
    check_situ_glu("cuda", DTYPES[dtype], shape, linear_beta, scale=1.0, seed=sum(shape) + 1)
    check_situ_glu("cuda", DTYPES[dtype], shape, linear_beta, seed=sum(shape) + 2, sliced=True)



def _k3m_modules(dtype: torch.dtype):
    torch.manual_seed(0)
    norm, mix_norm, proj = RMSNorm(768, 1e-5).cuda(), RMSNorm(768, 1e-5).cuda(), nn.Linear(768, 1, bias=False)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        mix_norm.weight.uniform_(0.5, 1.5)
        proj.weight.normal_(0, 0.1)
    x = torch.randn(64, 768, device="cuda", dtype=dtype)
    srcs = [torch.randn(64, 768, device="cuda", dtype=dtype) for _ in range(4)]
    g, u = torch.randn(64, 4, 128, device="cuda", dtype=dtype) * 5, torch.randn(64, 4, 128, device="cuda",
                                                                                 dtype=dtype) * 5
    return norm, mix_norm, proj.cuda(), x, srcs, g, u


@gpu_test
def test_gpu_layers_dispatch_to_fused(monkeypatch):
    """Under no_grad (and for inputs that need no grad) the layers call the fused kernels; with autograd RMSNorm
    and the AttnRes mix call the torch references and situ_glu the differentiable fused function (backward
    works); reference_kernels() forces the references."""
    from miles_k3.kernels import fused

    calls: dict[str, int] = {}

    def counting(name):
        real = getattr(fused, name)

        def wrapper(*a, **kw):
            calls[name] = calls.get(name, 0) + 1
            return real(*a, **kw)
        return wrapper

    for name in ("rms_norm", "attn_res_mix", "situ_glu", "situ_glu_train"):
        monkeypatch.setattr(fused, name, counting(name))
    norm, mix_norm, proj, x, srcs, g, u = _k3m_modules(torch.bfloat16)

    def run_all():
        return norm(x), attn_res_mix(srcs, mix_norm, proj), situ_glu(g, u, 4.0, 25.0)

    with torch.no_grad():
        fused_out = run_all()
        assert calls == {"rms_norm": 1, "attn_res_mix": 1, "situ_glu": 1}
        with reference_kernels():
            ref_out = run_all()
        assert calls == {"rms_norm": 1, "attn_res_mix": 1, "situ_glu": 1}
    for a, b in zip(fused_out, ref_out):
        torch.testing.assert_close(a, b)  # bf16 defaults; the precise checks are in the tests above
    with torch.inference_mode():
        run_all()
    assert calls == {"rms_norm": 2, "attn_res_mix": 2, "situ_glu": 2}
    run_all()  # grad enabled, but the inputs need none: the weights are parameters, so this is the torch path
    assert calls == {"rms_norm": 2, "attn_res_mix": 2, "situ_glu": 3}  # situ_glu alone has no parameters
    xg = x.float().requires_grad_()
    y = norm(xg).sum() + attn_res_mix([xg, xg * 2], mix_norm, proj).sum() + situ_glu(xg, xg, 4.0, None).sum()
    y.backward()
    assert calls == {"rms_norm": 2, "attn_res_mix": 2, "situ_glu": 3, "situ_glu_train": 1} and xg.grad is not None
    assert norm.weight.grad is not None and proj.weight.grad is not None
    with reference_kernels():
        situ_glu(xg, xg, 4.0, None).sum().backward()
    assert calls == {"rms_norm": 2, "attn_res_mix": 2, "situ_glu": 3, "situ_glu_train": 1}


@gpu_test
def test_gpu_fused_path_launch_counts():
    """torch.profiler: the fused RMSNorm and SiTU-GLU are one kernel, AttnRes two (stack + mix); SiTU-GLU in training
    is two (forward, backward; a leaf's first gradient is assigned, not added: no kernel)."""
    norm, mix_norm, proj, x, srcs, g, u = _k3m_modules(torch.bfloat16)
    calls = {"rms_norm": lambda: norm(x), "attn_res_mix": lambda: attn_res_mix(srcs, mix_norm, proj),
             "situ_glu": lambda: situ_glu(g, u, 4.0, 25.0)}
    expected = {"rms_norm": 1, "attn_res_mix": 2, "situ_glu": 1}

    def kernels(fn, reference: bool) -> list[str]:
        with torch.no_grad(), reference_kernels(reference):
            return cuda_kernels(fn)

    for name, fn in calls.items():
        got, ref = kernels(fn, False), kernels(fn, True)
        assert len(got) == expected[name], (name, got)
        assert any(f"_{name}_kernel" in k for k in got), (name, got)
        assert len(ref) > len(got), (name, ref)
    gg, uu, grad = g.clone().requires_grad_(), u.clone().requires_grad_(), torch.randn_like(g)

    def step():  # fresh leaves' gradients each call (cuda_kernels calls twice: a second call would accumulate)
        gg.grad = uu.grad = None
        situ_glu(gg, uu, 4.0, 25.0).backward(grad)

    def train(reference: bool):  # SiTU-GLU in training: the forward kernel, then the backward kernel
        with reference_kernels(reference):
            return cuda_kernels(step)

    got, ref = train(False), train(True)
    assert len(got) == 2 and "_situ_glu_kernel" in got[0] and "_situ_glu_bwd_kernel" in got[1], got
    assert len(ref) > len(got), ref


@gpu_test
def test_gpu_fused_calls_capture_in_a_cuda_graph():
    norm, mix_norm, proj, x, srcs, g, u = _k3m_modules(torch.bfloat16)

    def step():
        h = attn_res_mix(srcs + [x], mix_norm, proj)
        return norm(h), situ_glu(g, u, 4.0, 25.0)

    with torch.no_grad():
        graph, outs = capture(step)
        for t in [x, g, u, *srcs]:
            t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(outs, step()):
            assert torch.equal(a, b)


if __name__ == "__main__":  # the interpreter subprocess of `interpreter_results`
    print_results(INTERPRETER_CASES)
