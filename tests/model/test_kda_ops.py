"""CPU tests of miles_k3.model.kda_ops against fla-core's reference recurrences (fp32 throughout).

Tolerances: outputs and states are compared relative to their largest entry; fp32 chunked vs recurrent differ
by ~1e-6 relative, so RTOL = 2e-5 leaves a margin without hiding a wrong term (a 1e-4 relative error in one
factor already fails).
"""
from __future__ import annotations

import warnings

import pytest
import torch

warnings.filterwarnings("ignore", message=".*Triton is not supported.*")
from fla.ops.kda.naive import naive_chunk_kda, naive_recurrent_kda

from miles_k3.model.kda_ops import (
    DEFAULT_CHUNK_SIZE,
    KDABackend,
    _prefill_fla,
    chunk_size_for_bound,
    fla_batch_bucket,
    l2norm,
    pad_batch,
    resolve_kda_backend,
    torch_chunk_kda,
    torch_decode_step,
)

RTOL = 2e-5
CPU_BACKENDS = ("torch_chunk", "naive_recurrent", "naive_chunk")


def make_inputs(batch=2, seq=16, heads=2, dim_k=16, dim_v=8, heads_v=None, seed=0, raw=False, g_min=-5.0):
    """Realistic KDA inputs: q, k unit rows (or raw, scaled randn), g = g_min * sigmoid(randn) in (g_min, 0),
    beta = sigmoid(randn), a random initial state. Returns a dict keyed like torch_chunk_kda's arguments."""
    gen = torch.Generator().manual_seed(seed)
    heads_v = heads_v or heads
    q, k = (torch.randn(batch, seq, heads, dim_k, generator=gen) * 3 for _ in range(2))
    return {
        "q": q if raw else l2norm(q), "k": k if raw else l2norm(k),
        "v": torch.randn(batch, seq, heads_v, dim_v, generator=gen),
        "g": g_min * torch.sigmoid(torch.randn(batch, seq, heads_v, dim_k, generator=gen)),
        "beta": torch.sigmoid(torch.randn(batch, seq, heads_v, generator=gen)),
        "initial_state": torch.randn(batch, heads_v, dim_k, dim_v, generator=gen)}


def assert_close(actual, expected, rtol=RTOL, what=""):
    """Max abs error relative to the largest reference entry."""
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    err = (actual.double() - expected.double()).abs().max().item()
    ref = expected.double().abs().max().item()
    assert err <= rtol * max(ref, 1e-30), f"{what}: max abs err {err:.3g} > {rtol} * {ref:.3g}"


@pytest.mark.parametrize("seq", [1, 7, 64, 100])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("chunk", [16, 32])
def test_matches_naive_recurrent(seq, with_state, chunk):
    x = make_inputs(batch=2, seq=seq, heads=3, seed=seq)
    if not with_state:
        x["initial_state"] = None
    o_ref, s_ref = naive_recurrent_kda(**x, output_final_state=True)
    o, s = torch_chunk_kda(**x, output_final_state=True, chunk_size=chunk)
    assert o.dtype == x["v"].dtype and s.dtype == torch.float32
    assert_close(o, o_ref, what="o")
    assert_close(s, s_ref, what="state")


@pytest.mark.parametrize("seq", [64, 128])
@pytest.mark.parametrize("with_state", [False, True])
def test_matches_naive_chunk(seq, with_state):
    x = make_inputs(batch=2, seq=seq, heads=2, seed=1)
    if not with_state:
        x["initial_state"] = None
    o_ref, s_ref = naive_chunk_kda(**x, output_final_state=True)
    o, s = torch_chunk_kda(**x, output_final_state=True)
    assert_close(o, o_ref, what="o")
    assert_close(s, s_ref, what="state")


def test_grouped_value_heads_match_naive_recurrent():
    x = make_inputs(batch=2, seq=21, heads=2, heads_v=4, seed=2)
    o_ref, s_ref = naive_recurrent_kda(**x, output_final_state=True)
    o, s = torch_chunk_kda(**x, output_final_state=True)
    assert_close(o, o_ref, what="o")
    assert_close(s, s_ref, what="state")


def test_no_final_state_unless_asked():
    x = make_inputs(seq=5)
    assert torch_chunk_kda(**x)[1] is None


def test_gradients_match_naive_recurrent():
    x = make_inputs(batch=2, seq=37, heads=2, dim_k=8, dim_v=4, seed=3)
    gen = torch.Generator().manual_seed(4)
    w_o = torch.randn(2, 37, 2, 4, generator=gen)
    w_s = torch.randn(2, 2, 8, 4, generator=gen)

    def grads(fn):
        leaves = {name: t.clone().requires_grad_() for name, t in x.items()}
        o, s = fn(**leaves, output_final_state=True)
        ((o * w_o).sum() + (s * w_s).sum()).backward()
        return {name: t.grad for name, t in leaves.items()}

    ref, ours = grads(naive_recurrent_kda), grads(torch_chunk_kda)
    for name in x:
        assert ours[name] is not None, name
        assert_close(ours[name], ref[name], rtol=5e-5, what=f"d{name}")  # measured ~1e-6


@pytest.mark.parametrize("split", [13, 16])
def test_split_sequence_equals_one_call(split):
    x = make_inputs(batch=2, seq=37, seed=5)
    o_all, s_all = torch_chunk_kda(**x, output_final_state=True)
    first = {name: t if name == "initial_state" else t[:, :split] for name, t in x.items()}
    second = {name: t if name == "initial_state" else t[:, split:] for name, t in x.items()}
    o1, s1 = torch_chunk_kda(**first, output_final_state=True)
    o2, s2 = torch_chunk_kda(**{**second, "initial_state": s1}, output_final_state=True)
    assert_close(torch.cat([o1, o2], dim=1), o_all, what="o")
    assert_close(s2, s_all, what="state")


def test_right_padding_keeps_the_last_real_state():
    """Rows padded with g = 0, beta = 0 (and junk q/k/v) end in the state after their last real token."""
    x = make_inputs(batch=3, seq=40, seed=6)
    lens = [40, 23, 5]
    for b, n in enumerate(lens):
        x["g"][b, n:] = 0.0
        x["beta"][b, n:] = 0.0
        x["v"][b, n:] *= 100.0  # junk the padded values: beta = 0 must keep them out
    o, s = torch_chunk_kda(**x, output_final_state=True)
    for b, n in enumerate(lens):
        row = {name: t[b:b + 1, :n] if name != "initial_state" else t[b:b + 1] for name, t in x.items()}
        o_ref, s_ref = naive_recurrent_kda(**row, output_final_state=True)
        assert_close(s[b:b + 1], s_ref, what=f"state of row {b}")
        assert_close(o[b:b + 1, :n], o_ref, what=f"real outputs of row {b}")


def decode_all(backend: KDABackend, x: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Run `backend.decode` token by token from x's initial state; checks the input state is never written."""
    state, outs = x["initial_state"], []
    for t in range(x["q"].shape[1]):
        kept = state.clone()
        o, new_state = backend.decode(x["q"][:, t:t + 1], x["k"][:, t:t + 1], x["v"][:, t:t + 1],
                                      x["g"][:, t:t + 1], x["beta"][:, t:t + 1], state)
        assert torch.equal(state, kept), "decode modified its input state"
        assert o.shape == x["v"][:, :1].shape and new_state.dtype == torch.float32
        outs.append(o)
        state = new_state
    return torch.cat(outs, dim=1), state


def test_cpu_backends_agree_prefill_and_decode():
    """Every CPU backend's prefill and token-by-token decode equal the reference, given RAW q, k."""
    x = make_inputs(batch=3, seq=9, heads=2, raw=True, seed=7)
    unit = {**x, "q": l2norm(x["q"]), "k": l2norm(x["k"])}
    o_ref, s_ref = naive_recurrent_kda(**unit, output_final_state=True)
    for name in CPU_BACKENDS:
        backend = resolve_kda_backend(name, torch.device("cpu"))
        o, s = backend.prefill(**x, output_final_state=True)
        assert_close(o, o_ref, what=f"{name} prefill o")
        assert_close(s, s_ref, what=f"{name} prefill state")
        o, s = decode_all(backend, x)
        assert_close(o, o_ref, what=f"{name} decode o")
        assert_close(s, s_ref, what=f"{name} decode state")


def test_prefill_normalises_raw_q_k():
    """The backend owns the L2 norm: rescaling the raw q, k rows changes nothing."""
    x = make_inputs(batch=2, seq=11, raw=True, seed=8)
    backend = resolve_kda_backend("torch_chunk", "cpu")
    o, s = backend.prefill(**x, output_final_state=True)
    o2, s2 = backend.prefill(**{**x, "q": x["q"] * 7.0, "k": x["k"] * 0.25}, output_final_state=True)
    assert_close(o2, o, what="o")
    assert_close(s2, s, what="state")
    assert not torch.allclose(o, torch_chunk_kda(**x)[0], rtol=1e-2), "raw q/k were not normalised"


def test_torch_decode_step_matches_fla_one_step():
    x = make_inputs(batch=4, seq=1, heads=2, heads_v=4, raw=True, seed=9)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    o_ref, s_ref = naive_recurrent_kda(l2norm(args[0]), l2norm(args[1]), *args[2:],
                                       initial_state=x["initial_state"], output_final_state=True)
    o, s = torch_decode_step(*args, x["initial_state"])
    assert_close(o, o_ref, what="o")
    assert_close(s, s_ref, what="state")
    with pytest.raises(ValueError, match="one token"):
        torch_decode_step(*[t.repeat(1, 2, 1, 1) if t.dim() == 4 else t.repeat(1, 2, 1) for t in args],
                          x["initial_state"])


def test_low_precision_inputs_keep_fp32_state():
    x = make_inputs(seq=20, raw=True, seed=10)
    x16 = {n: t.bfloat16() if n in ("q", "k", "v") else t for n, t in x.items()}
    o, s = resolve_kda_backend("torch_chunk", "cpu").prefill(**x16, output_final_state=True)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32


def test_resolve_auto_and_errors():
    backend = resolve_kda_backend("auto", torch.device("cpu"))
    assert backend.name == "torch_chunk" and backend.reason.startswith("cpu:") and "fastest" in backend.reason
    assert "prefill" not in repr(backend)  # logs show name and reason only
    assert resolve_kda_backend("auto", torch.device("cuda")).name == "fla"  # resolving needs no GPU
    with pytest.raises(ValueError, match="valid choices are auto, torch_chunk"):
        resolve_kda_backend("flash", "cpu")
    with pytest.raises(ValueError, match="needs a CUDA device.*use 'auto' or 'torch_chunk'"):
        resolve_kda_backend("fla", torch.device("cpu"))
    with pytest.raises(ValueError, match="'fla_fp32' runs Triton kernels and needs a CUDA device"):
        resolve_kda_backend("fla_fp32", torch.device("cpu"))
    fp32 = resolve_kda_backend("fla_fp32", torch.device("cuda"))
    assert fp32.name == "fla_fp32" and "fp32 inputs" in fp32.reason
    assert fp32.decode_into is resolve_kda_backend("fla", torch.device("cuda")).decode_into  # decode unchanged


def test_fla_fp32_hands_fla_fp32_inputs_and_returns_the_activation_dtype(monkeypatch):
    """fla_fp32's chunked form: fla's chunk_kda (here a stand-in computing the torch form, since fla runs on CUDA
    only) receives fp32 q, k, v and beta, so its intermediates are fp32; the output comes back rounded once to v's
    dtype, and gradients reach the bf16 inputs in bf16. Plain fla passes the bf16 tensors through."""
    import fla.ops.kda

    seen = []

    def fake_chunk_kda(q, k, v, g, beta, initial_state=None, output_final_state=False, **_):
        seen.append((q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype))
        return torch_chunk_kda(l2norm(q), l2norm(k), v.float(), g, beta.float(), initial_state=initial_state,
                               output_final_state=output_final_state)

    monkeypatch.setattr(fla.ops.kda, "chunk_kda", fake_chunk_kda)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 20, 2, 16, generator=gen).bfloat16().requires_grad_(True) for _ in range(3))
    g = -5 * torch.sigmoid(torch.randn(1, 20, 2, 16, generator=gen))
    beta = torch.sigmoid(torch.randn(1, 20, 2, generator=gen)).bfloat16().requires_grad_(True)
    o, state = _prefill_fla(q, k, v, g, beta, output_final_state=True, gate_lower_bound=-5.0, fp32=True)
    assert seen == [(torch.float32,) * 5]
    ref, ref_state = torch_chunk_kda(l2norm(q.float()), l2norm(k.float()), v.float(), g, beta.float(),
                                     output_final_state=True)
    assert o.dtype == torch.bfloat16 and torch.equal(o, ref.bfloat16()) and torch.equal(state, ref_state)
    o.float().sum().backward()
    assert all(x.grad.dtype == torch.bfloat16 for x in (q, k, v, beta))
    _prefill_fla(q, k, v, g, beta, gate_lower_bound=-5.0)
    assert seen[1] == (torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.float32, torch.bfloat16)


def test_fla_batch_buckets():
    """Worked by hand: powers of two up to 8 rows, then the next multiple of 8."""
    got = {b: fla_batch_bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 16, 17, 50, 56, 57)}
    assert got == {1: 1, 2: 2, 3: 4, 4: 4, 5: 8, 8: 8, 9: 16, 16: 16, 17: 24, 50: 56, 56: 56, 57: 64}
    x = torch.ones(3, 2)
    assert pad_batch(x, 3) is x and pad_batch(None, 8) is None
    assert torch.equal(pad_batch(x, 4), torch.tensor([[1.0, 1], [1, 1], [1, 1], [0, 0]]))


def test_fla_prefill_pads_the_batch_and_returns_the_unpadded_rows(monkeypatch):
    """fla's chunk_kda (a stand-in computing the torch form) gets 5 rows padded to 8 with zero rows (q, k, v, g,
    beta and the initial state); the outputs, final states and gradients of the 5 are those of the torch form run on
    the 5 alone."""
    import fla.ops.kda

    seen = []

    def fake_chunk_kda(q, k, v, g, beta, initial_state=None, output_final_state=False, **_):
        seen.append([x.shape[0] for x in (q, k, v, g, beta, initial_state)])
        pads = (q[5:], k[5:], v[5:], g[5:], beta[5:], initial_state[5:])
        assert all(bool((x == 0).all()) for x in pads)
        return torch_chunk_kda(l2norm(q), l2norm(k), v, g, beta, initial_state=initial_state,
                               output_final_state=output_final_state)

    monkeypatch.setattr(fla.ops.kda, "chunk_kda", fake_chunk_kda)
    x = make_inputs(batch=5, seq=20, heads=2, dim_k=8, dim_v=8, seed=4, raw=True)
    x = {n: t.requires_grad_(True) for n, t in x.items()}
    o, state = _prefill_fla(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                            output_final_state=True, gate_lower_bound=-5.0)
    assert seen == [[8] * 6] and o.shape[0] == 5 and state.shape[0] == 5
    w_o, w_s = torch.randn_like(o), torch.randn_like(state)
    ((o * w_o).sum() + (state * w_s).sum()).backward()
    grads = [x[n].grad.clone() for n in ("q", "k", "v", "g", "beta", "initial_state")]
    y = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
    ref, ref_state = torch_chunk_kda(l2norm(y["q"]), l2norm(y["k"]), y["v"], y["g"], y["beta"],
                                     initial_state=y["initial_state"], output_final_state=True)
    ((ref * w_o).sum() + (ref_state * w_s).sum()).backward()
    torch.testing.assert_close(o, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state, ref_state, rtol=1e-5, atol=1e-6)
    for got, n in zip(grads, ("q", "k", "v", "g", "beta", "initial_state")):
        torch.testing.assert_close(got, y[n].grad, rtol=1e-5, atol=1e-6, msg=n)


def test_chunk_size_for_bound():
    assert chunk_size_for_bound(-5.0) == DEFAULT_CHUNK_SIZE == 16
    assert chunk_size_for_bound(None) == 16
    assert chunk_size_for_bound(-20.0) == 8  # 15 * 20 / 2 = 150 would overflow; 7 * 20 / 2 = 70 does not


@pytest.mark.parametrize("chunk", [16, 32])
def test_gates_at_the_lower_bound_over_a_long_sequence(chunk):
    """g = -5 everywhere for 300 tokens: the widest exponents the factored decay sees; finite and exact."""
    x = make_inputs(batch=1, seq=300, heads=2, dim_k=32, dim_v=16, seed=11)
    x["g"] = torch.full_like(x["g"], -5.0)
    o_ref, s_ref = naive_recurrent_kda(**x, output_final_state=True)
    leaves = {name: t.clone().requires_grad_() for name, t in x.items()}
    o, s = torch_chunk_kda(**leaves, output_final_state=True, chunk_size=chunk)
    (o.square().sum() + s.square().sum()).backward()
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert all(torch.isfinite(t.grad).all() for t in leaves.values())
    assert_close(o.detach(), o_ref, what="o")
    assert_close(s.detach(), s_ref, what="state")


def test_unbounded_gates_use_the_data_and_refuse_overflow():
    x = make_inputs(seq=50, seed=12, g_min=-10.0)
    o_ref, s_ref = naive_recurrent_kda(**x, output_final_state=True)
    o, s = torch_chunk_kda(**x, output_final_state=True, gate_lower_bound=None)
    assert_close(o, o_ref, what="o")
    assert_close(s, s_ref, what="state")
    with pytest.raises(ValueError, match="smaller chunk_size"):
        torch_chunk_kda(**make_inputs(seq=70, seed=13), chunk_size=64)  # 63 * 5 / 2 > 80


def test_lowerbound_gate_is_flas_naive_gate_bitwise():
    """`lowerbound_gate` restates fla's naive_kda_lowerbound_gate (so the CPU path never imports fla): the same fp32
    values bit for bit, for fp32 and bf16 inputs; and one value by hand: f = 0, dt_bias = 0, A_log = 0 gives
    lower_bound * sigmoid(0) = -2.5 at lower_bound -5."""
    from fla.ops.kda.gate import naive_kda_lowerbound_gate

    from miles_k3.model.kda_ops import lowerbound_gate

    torch.manual_seed(0)
    h, k = 3, 8
    a_log, dt_bias = torch.randn(h), torch.randn(h * k)
    for dtype in (torch.float32, torch.bfloat16):
        f = torch.randn(2, 5, h, k).to(dtype)
        ours = lowerbound_gate(f, a_log, dt_bias, -5.0)
        assert ours.dtype == torch.float32
        assert torch.equal(ours, naive_kda_lowerbound_gate(f, a_log, dt_bias, lower_bound=-5.0))
    zero = lowerbound_gate(torch.zeros(1, h, k), torch.zeros(h), torch.zeros(h * k), -5.0)
    assert torch.equal(zero, torch.full((1, h, k), -2.5))


def test_fp32_dots_sets_tritons_precision_once_and_refuses_a_change(monkeypatch):
    """model.fp32_dots writes TRITON_F32_DEFAULT (read when a Triton kernel compiles); auto leaves it alone; a
    process that already holds another value refuses, naming both, since its compiled kernels would be reused."""
    import os

    from miles_k3.model.build import ModelConfig, build_model
    from miles_k3.utils.runtime import FP32_DOTS_ENV, set_fp32_dots

    monkeypatch.delenv(FP32_DOTS_ENV, raising=False)
    set_fp32_dots("auto")
    assert FP32_DOTS_ENV not in os.environ
    build_model(ModelConfig(name="k3_tiny", fp32_dots="tf32x3"), torch.device("cpu"), torch.float32)
    assert os.environ[FP32_DOTS_ENV] == "tf32x3"
    set_fp32_dots("tf32x3")
    set_fp32_dots("auto")
    with pytest.raises(ValueError, match=r"^model.fp32_dots=ieee: .*TRITON_F32_DEFAULT=tf32x3.*new process"):
        set_fp32_dots("ieee")
    assert os.environ[FP32_DOTS_ENV] == "tf32x3"
    monkeypatch.setenv(FP32_DOTS_ENV, "ieee")  # set by the user outside: the same value is fine, auto keeps it
    set_fp32_dots("ieee")
    set_fp32_dots("auto")
    assert os.environ[FP32_DOTS_ENV] == "ieee"
