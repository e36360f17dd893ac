"""Routed experts: frozen MXFP4 storage equals its dequantized bf16 reference, forward and input gradients,
never saves a dequantized weight for backward, and loads/saves under the checkpoint's per-expert names."""
import pytest
import torch

import miles_k3.model.experts as experts_mod
from miles_k3.kernels.mxfp4 import dequantize_mxfp4
from miles_k3.model import K3Config, K3ForCausalLM
from miles_k3.model.experts import PROJS, RoutedExperts, grouped_linear


def _pair(num_experts=6, latent=64, inter=32, dtype=torch.float32, seed=0):
    """An MXFP4 experts module and a bf16-format one holding its exactly dequantized weights."""
    torch.manual_seed(seed)
    q = RoutedExperts(num_experts, latent, inter, 4.0, 25.0, expert_format="mxfp4")
    q.reset_parameters(std=0.5)
    ref = RoutedExperts(num_experts, latent, inter, 4.0, 25.0, expert_format="bf16")
    with torch.no_grad():
        for name in PROJS:
            getattr(ref, name).copy_(q.dequantized(name, torch.float32))
    return q, ref.to(dtype).requires_grad_(False)


def _routing(n_tok, num_experts, top_k=2, seed=1, skip=()):
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(num_experts) if e not in skip])
    ids = torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:top_k]] for _ in range(n_tok)])
    w = torch.rand(n_tok, top_k, generator=g)
    return ids, w / w.sum(-1, keepdim=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_experts_equal_dequantized_reference_forward_and_input_grad(dtype):
    q, ref = _pair(dtype=dtype)
    ids, w = _routing(40, 6, skip=(3,))  # expert 3 gets no tokens
    z = torch.randn(40, 64, dtype=dtype)
    z_q, z_r = z.clone().requires_grad_(), z.clone().requires_grad_()
    out_q, out_r = q(z_q, ids, w), ref(z_r, ids, w)
    # Same dequantized values, same matmuls: bitwise equal, not merely close.
    assert torch.equal(out_q, out_r)
    grad = torch.randn_like(out_q)
    out_q.backward(grad)
    out_r.backward(grad)
    assert torch.equal(z_q.grad, z_r.grad)
    assert z_q.grad.abs().sum() > 0


def test_chunked_dequant_matches_unchunked(monkeypatch):
    q, ref = _pair(num_experts=11)
    ids, w = _routing(30, 11, top_k=3, skip=(0, 4, 5, 6, 7))  # a whole chunk (4..7) without tokens
    z = torch.randn(30, 64, requires_grad=True)
    expected = ref(z, ids, w)
    monkeypatch.setattr(experts_mod, "DEQUANT_CHUNK", 4)
    calls = []
    real = experts_mod.dequantize_mxfp4
    monkeypatch.setattr(experts_mod, "dequantize_mxfp4", lambda p, s, dtype: calls.append(p.shape[0]) or
                        real(p, s, dtype=dtype))
    got = q(z, ids, w)
    assert torch.equal(got, expected)
    # chunks [0,4) -> experts 1..3, [4,8) -> skipped, [8,11) -> 8..10; three projections each
    assert sorted(calls) == sorted([3, 3] * 3)


def test_mxfp4_backward_saves_no_dequantized_weight():
    """Everything autograd keeps for backward, by bytes: the MXFP4 path keeps references to the uint8
    storage only; the bf16 path keeps its weights (the reference the 4-bit saving is measured against)."""
    q, ref = _pair(num_experts=8, latent=128, inter=64)
    ref.requires_grad_(True)
    ids, w = _routing(16, 8)

    def saved_weight_bytes(module, weight_shapes):
        saved = []

        def pack(t):
            saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            module(torch.randn(16, 128, requires_grad=True), ids, w).sum().backward()
        float_weights = [t for t in saved if t.is_floating_point() and tuple(t.shape[-2:]) in weight_shapes]
        uint8 = {t.data_ptr() for t in saved if t.dtype == torch.uint8}
        return sum(t.numel() * t.element_size() for t in float_weights), uint8

    shapes = {q.proj_shape(n) for n in PROJS} | {q.proj_shape(n)[::-1] for n in PROJS}
    q_bytes, q_uint8 = saved_weight_bytes(q, shapes)
    r_bytes, _ = saved_weight_bytes(ref, shapes)
    assert q_bytes == 0
    assert r_bytes >= sum(getattr(ref, n).numel() for n in PROJS) * 4 // 8  # at least the used experts
    storage = {getattr(q, f"{n}_{k}").data_ptr() for n in PROJS for k in ("packed", "scale")}
    assert q_uint8 == storage  # references to the module's own buffers, not copies


def test_grouped_linear_matches_per_row_reference():
    torch.manual_seed(0)
    w = torch.randn(5, 7, 12)
    counts = [3, 0, 4, 1, 0]
    x = torch.randn(8, 12)
    expert_of_row = torch.repeat_interleave(torch.arange(5), torch.tensor(counts))
    expected = torch.einsum("mi,moi->mo", x, w[expert_of_row])
    torch.testing.assert_close(grouped_linear(x, counts, w), expected, rtol=1e-6, atol=1e-6)
    assert grouped_linear(x[:0], [0] * 5, w).shape == (0, 7)


def test_mxfp4_state_dict_uses_checkpoint_names_and_round_trips():
    q, _ = _pair()
    sd = q.state_dict()
    assert set(sd) == {f"{e}.{n}.weight_{k}" for e in range(6) for n in PROJS for k in ("packed", "scale")}
    assert sd["2.w1.weight_packed"].shape == (32, 32) and sd["2.w1.weight_packed"].dtype == torch.uint8
    assert sd["2.w2.weight_scale"].shape == (64, 1)
    assert torch.equal(dequantize_mxfp4(sd["5.w3.weight_packed"], sd["5.w3.weight_scale"], torch.float32),
                       q.dequantized("w3", torch.float32)[5])
    other = RoutedExperts(6, 64, 32, 4.0, 25.0, expert_format="mxfp4")
    other.load_state_dict({k: v.clone() for k, v in sd.items()})
    for n in PROJS:
        assert torch.equal(other.get_buffer(f"{n}_packed"), q.get_buffer(f"{n}_packed"))
        assert torch.equal(other.get_buffer(f"{n}_scale"), q.get_buffer(f"{n}_scale"))
    bad = {k: v.float() if k == "1.w2.weight_packed" else v for k, v in sd.items()}
    with pytest.raises(RuntimeError, match="dtype mismatch for 1.w2.weight_packed"):
        other.load_state_dict(bad)


def test_mxfp4_storage_is_the_only_expert_copy():
    q, _ = _pair(num_experts=4, latent=64, inter=32)
    assert list(q.parameters()) == []
    stored = sum(b.numel() * b.element_size() for b in q.buffers())
    assert stored == q.num_params() * 17 // 32  # 4 bits + one scale byte per 32 values = 4.25 bits
    with pytest.raises(ValueError, match="multiple of the MXFP4 group size"):
        RoutedExperts(2, 48, 32, 4.0, None, expert_format="mxfp4")
    with pytest.raises(ValueError, match="expert_format: 'fp4'"):
        RoutedExperts(2, 64, 32, 4.0, None, expert_format="fp4")


def test_k3_tiny_with_mxfp4_experts_equals_dequantized_model():
    cfg = K3Config.from_name("k3_tiny")
    torch.manual_seed(0)
    q = K3ForCausalLM(cfg, expert_format="mxfp4").eval()
    ref = K3ForCausalLM(cfg, expert_format="bf16").eval()
    sd = {k: v for k, v in q.state_dict().items() if ".experts." not in k}
    ref.load_state_dict(sd, strict=False)
    for mq, mr in zip(q.modules(), ref.modules()):
        if isinstance(mq, RoutedExperts):
            with torch.no_grad():
                for n in PROJS:
                    getattr(mr, n).copy_(mq.dequantized(n, torch.float32))
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(q(ids).logits, ref(ids).logits)
    # Random init draws real MXFP4 weights: every scale byte is set, and they decode to N(0, 0.02)-sized values.
    experts = q.model.layers[1].block_sparse_moe.experts
    w1 = experts.dequantized("w1", torch.float32)
    assert 0.015 < w1.std().item() < 0.025 and (experts.w1_scale > 0).all()
