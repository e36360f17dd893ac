"""SiTU, the AttnRes mixer, the router and the routed experts against their definitions and references."""
import pytest
import torch
from fla.ops.attnres.naive import naive_attnres
from torch import nn

from miles_k3.model.config import K3Config
from miles_k3.model.experts import RoutedExperts
from miles_k3.model.layers import RMSNorm, SiTUMLP, attn_res_mix, situ_gate, situ_glu, situ_up
from miles_k3.model.moe import LatentMoE, TopKRouter


def test_situ_definition_and_caps():
    g = torch.linspace(-50, 50, 2001, dtype=torch.float64)
    beta, lin = 4.0, 25.0
    want = beta * torch.tanh(g / beta) * torch.sigmoid(g) * (lin * torch.tanh(g / lin))
    torch.testing.assert_close(situ_glu(g, g, beta, lin).double(), want.float().double(), rtol=1e-6, atol=1e-5)
    gate = situ_gate(g, beta)
    assert gate.max() <= beta and gate.min() > -0.28  # soft cap: gate_act in (-0.27, 4]
    assert situ_gate(torch.tensor(10.0), beta) < beta
    assert situ_up(g, lin).abs().max() < lin
    assert torch.equal(situ_up(g, None), g.float())  # no linear cap when the config's value is null
    small = torch.linspace(-0.1, 0.1, 101)
    assert (situ_gate(small, beta) - nn.functional.silu(small)).abs().max() < 1e-4  # ~SiLU near 0


def test_situ_mlp_matches_formula():
    torch.manual_seed(0)
    mlp = SiTUMLP(16, 24, 4.0, 25.0)
    x = torch.randn(3, 5, 16)
    g, u = mlp.gate_proj(x), mlp.up_proj(x)
    want = mlp.down_proj(4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25))
    torch.testing.assert_close(mlp(x), want)


@pytest.mark.parametrize("num_sources", [1, 3, 9])
def test_attn_res_mix_matches_fla_naive_attnres(num_sources):
    torch.manual_seed(num_sources)
    d, eps = 32, 1e-5
    norm, proj = RMSNorm(d, eps), nn.Linear(d, 1, bias=False)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        proj.weight.normal_()
    sources = [torch.randn(2, 7, d) * (i + 1) for i in range(num_sources)]
    got = attn_res_mix(sources, norm, proj)
    want = naive_attnres(proj.weight[0], sources, norm.weight, rms_eps=eps)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_attn_res_mix_zero_query_is_uniform_average():
    d = 8
    sources = [torch.randn(2, 3, d) for _ in range(4)]
    proj = nn.Linear(d, 1, bias=False)
    nn.init.zeros_(proj.weight)
    torch.testing.assert_close(attn_res_mix(sources, RMSNorm(d, 1e-5), proj), torch.stack(sources).mean(0))


def test_router_topk_renormalisation_and_selection_bias():
    torch.manual_seed(0)
    router = TopKRouter(hidden=12, num_experts=8, top_k=3, renormalize=True, scaling=1.0)
    nn.init.normal_(router.weight)
    x = torch.randn(20, 12)
    ids, w = router(x)
    scores = torch.sigmoid(x @ router.weight.t())
    for n in range(20):
        want_ids = torch.topk(scores[n], 3).indices
        assert set(ids[n].tolist()) == set(want_ids.tolist())
        torch.testing.assert_close(w[n], scores[n, ids[n]] / scores[n, ids[n]].sum())
    torch.testing.assert_close(w.sum(-1), torch.ones(20))
    # the correction bias changes which experts are chosen, never the weights' source scores
    with torch.no_grad():
        router.e_score_correction_bias[5] = 10.0
    ids_b, w_b = router(x)
    assert (ids_b == 5).any(-1).all()
    torch.testing.assert_close(w_b, scores.gather(-1, ids_b) / scores.gather(-1, ids_b).sum(-1, keepdim=True))


def test_routed_experts_match_per_token_loop_and_expose_checkpoint_keys():
    torch.manual_seed(0)
    experts = RoutedExperts(num_experts=6, latent=16, inter=8, beta=4.0, linear_beta=25.0)
    for p in experts.parameters():
        nn.init.normal_(p, std=0.3)
    z = torch.randn(11, 16)
    ids = torch.stack([torch.randperm(6)[:2] for _ in range(11)])
    w = torch.rand(11, 2)
    want = torch.zeros(11, 16)
    for n in range(11):
        for j in range(2):
            e = ids[n, j]
            h = situ_glu(z[n] @ experts.w1[e].t(), z[n] @ experts.w3[e].t(), 4.0, 25.0)
            want[n] += w[n, j] * (h @ experts.w2[e].t())
    torch.testing.assert_close(experts(z, ids, w), want, rtol=1e-5, atol=1e-5)

    sd = experts.state_dict()
    assert set(sd) == {f"{e}.{p}.weight" for e in range(6) for p in ("w1", "w2", "w3")}
    assert sd["3.w2.weight"].shape == (16, 8)
    other = RoutedExperts(6, 16, 8, 4.0, 25.0)
    other.load_state_dict(sd)
    assert torch.equal(other.w2, experts.w2)
    bad = dict(sd)
    bad["1.w1.weight"] = torch.zeros(8, 15)
    with pytest.raises(RuntimeError, match=r"1\.w1\.weight"):
        other.load_state_dict(bad)
    del bad["1.w1.weight"]
    with pytest.raises(RuntimeError, match=r"Missing key.*1\.w1\.weight"):
        other.load_state_dict(bad)


def test_latent_moe_composition():
    torch.manual_seed(0)
    cfg = K3Config.from_name("k3_tiny")
    moe = LatentMoE(cfg)
    for p in moe.parameters():
        if p.ndim > 1:
            nn.init.normal_(p, std=0.1)
    x = torch.randn(2, 5, cfg.hidden_size)
    xf = x.reshape(-1, cfg.hidden_size)
    ids, w = moe.gate(xf)
    u = moe.experts(moe.routed_expert_down_proj(xf), ids, w)
    want = moe.routed_expert_up_proj(moe.routed_expert_norm(u)) + moe.shared_experts(xf)
    torch.testing.assert_close(moe(x), want.view_as(x))
    assert moe.shared_experts.gate_proj.weight.shape == (2 * cfg.moe_intermediate_size, cfg.hidden_size)


def test_kda_layer_matches_its_definition_with_fla_references():
    """KDAAttention = projections, causal depthwise conv (explicit loop) + SiLU, L2-normalised q/k, the
    lower-bound gate (fla naive_kda_lowerbound_gate), sigmoid beta, fla naive_recurrent_kda, per-head RMSNorm
    gated by sigmoid(g_proj x), o_proj."""
    from fla.ops.kda.gate import naive_kda_lowerbound_gate
    from fla.ops.kda.naive import naive_recurrent_kda

    from miles_k3.model.kda import KDAAttention
    from miles_k3.model.kda_ops import resolve_kda_backend

    torch.manual_seed(0)
    cfg = K3Config.from_name("k3_tiny")
    kda = KDAAttention(cfg)
    for p in kda.parameters():
        nn.init.normal_(p, std=0.2)
    b, t, h, d = 2, 11, 4, 32
    x = torch.randn(b, t, cfg.hidden_size)

    def conv_silu(proj, conv):
        z = proj(x)  # [B, T, P]
        w = conv.weight[:, 0]  # [P, W]
        out = torch.zeros_like(z)
        for step in range(t):
            for j in range(4):  # tap j sees token step - 3 + j
                if step - 3 + j >= 0:
                    out[:, step] += w[:, j] * z[:, step - 3 + j]
        return torch.nn.functional.silu(out).view(b, t, h, d)

    q, k, v = (conv_silu(getattr(kda, f"{c}_proj"), getattr(kda, f"{c}_conv1d")) for c in "qkv")
    q, k = (z / torch.sqrt((z * z).sum(-1, keepdim=True) + 1e-6) for z in (q, k))
    g = naive_kda_lowerbound_gate(kda.f_b_proj(kda.f_a_proj(x)).view(b, t, h, d), kda.A_log, kda.dt_bias, -5.0)
    beta = torch.sigmoid(kda.b_proj(x))
    o, state = naive_recurrent_kda(q, k, v, g, beta, output_final_state=True)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * kda.o_norm.weight
    want = kda.o_proj((o * torch.sigmoid(kda.g_proj(x)).view(b, t, h, d)).reshape(b, t, -1))
    got, got_state = kda(x, resolve_kda_backend("torch_chunk", "cpu"))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_state.recurrent_BHKV, state, rtol=1e-4, atol=1e-5)
    assert (g > -5).all() and (g < 0).all()


def test_kda_pooled_decode_updates_slot_rows_in_place_and_equals_the_gathered_step():
    """The engine's pooled KDA state: one decode step on pool rows `slots` gives the output of the step on the
    gathered rows, writes the new conv window and recurrent state into those rows only, returns the pool."""
    from miles_k3.model.kda import KDAAttention
    from miles_k3.model.kda_ops import resolve_kda_backend
    from miles_k3.model.state import KDALayerState

    torch.manual_seed(0)
    cfg = K3Config.from_name("k3_tiny")
    kda = KDAAttention(cfg)
    backend = resolve_kda_backend("torch_chunk", "cpu")
    pool = kda.empty_state(6, "cpu", torch.float32)
    pool.conv_BCW.normal_()
    pool.recurrent_BHKV.normal_(0, 0.1)
    before = KDALayerState(pool.conv_BCW.clone(), pool.recurrent_BHKV.clone())
    slots = torch.tensor([4, 1, 3])
    x = torch.randn(3, 1, cfg.hidden_size)
    want, want_state = kda(x, backend, KDALayerState(before.conv_BCW[slots], before.recurrent_BHKV[slots]),
                           decode=True)
    got, got_state = kda(x, backend, KDALayerState(pool.conv_BCW, pool.recurrent_BHKV, slots), decode=True)
    assert got_state.recurrent_BHKV is pool.recurrent_BHKV
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(pool.conv_BCW[slots], want_state.conv_BCW)
    assert torch.equal(pool.recurrent_BHKV[slots], want_state.recurrent_BHKV)
    for other in (0, 2, 5):
        assert torch.equal(pool.recurrent_BHKV[other], before.recurrent_BHKV[other])
        assert torch.equal(pool.conv_BCW[other], before.conv_BCW[other])
    with pytest.raises(ValueError, match="only for decode"):
        kda(torch.randn(3, 2, cfg.hidden_size), backend, KDALayerState(pool.conv_BCW, pool.recurrent_BHKV, slots))


def test_norm_eps_follow_sglang_k3():
    """SGLang's Kimi K3 (0.5.17): the MLA latent norms (q_a/kv_a) use rms_norm_eps, the KDA gated output norm a
    fixed 1e-5 whatever rms_norm_eps says. With rms_norm_eps = 1e-3 and a latent vector of equal entries 0.01 (RMS
    0.01), the latent norm gives 0.01 / sqrt(1e-4 + 1e-3) = 0.301511 per entry (1e-6 would give 0.995037); the KDA
    output of equal entries 0.003 normalises to 0.003 / sqrt(9e-6 + 1e-5) = 0.688247 (rms_norm_eps would give
    0.094733), before the unit weight and the gate."""
    from miles_k3.model.kda import KDAAttention
    from miles_k3.model.mla import MLAAttention

    raw = K3Config.from_name("k3_tiny").to_dict() | {"rms_norm_eps": 1e-3}
    cfg = K3Config.from_dict(raw)
    mla = MLAAttention(cfg)
    nn.init.ones_(mla.q_a_layernorm.weight)
    nn.init.ones_(mla.kv_a_layernorm.weight)
    for norm, width in ((mla.q_a_layernorm, cfg.q_lora_rank), (mla.kv_a_layernorm, cfg.kv_lora_rank)):
        out = norm(torch.full((1, width), 0.01))
        torch.testing.assert_close(out, torch.full((1, width), 0.301511), rtol=1e-5, atol=0)
    kda = KDAAttention(cfg)
    kda.o_norm.weight.data.fill_(1.0)
    h, v = kda.num_heads, kda.head_dim
    nn.init.zeros_(kda.g_proj.weight)  # gate sigmoid(0) = 0.5
    captured = {}
    kda.o_proj.register_forward_hook(lambda m, args, out: captured.setdefault("x", args[0]))
    kda._gated_output(torch.full((1, 1, h, v), 0.003), torch.zeros(1, 1, cfg.hidden_size))
    torch.testing.assert_close(captured["x"], torch.full((1, 1, h * v), 0.688247 * 0.5), rtol=1e-5, atol=0)
