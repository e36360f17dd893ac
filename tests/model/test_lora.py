"""LoRA on the frozen K3 base (k3_tiny, CPU): MXFP4 vs dequantized parity, merging, a frozen base under
training, MLA absorbed decode, config. The PEFT adapter directory is tested in test_adapter.py."""
import copy

import pytest
import torch
from lora_helpers import ALL_TARGETS
from lora_helpers import ids as _ids
from lora_helpers import randomize_adapters as _randomize_adapters
from lora_helpers import tiny as _tiny
from omegaconf import OmegaConf
from torch import nn

import miles_k3.model.mla as mla_mod
from miles_k3.model import K3Config, K3ForCausalLM
from miles_k3.model.experts import PROJS, RoutedExperts
from miles_k3.model.lora import (
    ALLOWED_TARGETS,
    LoRAConfig,
    LoRALinear,
    adapter_num_params,
    applied_lora_config,
    apply_lora,
    lora_parameters,
    lora_state_dict,
    merge_lora_into_bf16,
)

# fp32 agreement of two mathematically equal evaluation orders through 9 layers (merged vs unmerged weights;
# decode vs full forward) on logits of magnitude ~1. This fixture (AttnRes queries N(0, 0.5)) amplifies fp32
# rounding ~100x: without any LoRA its decode-vs-forward gap is already 3.9e-5; with adapters we observe
# 2.7e-5 (merge) and 9.3e-5 (decode). The errors these tests guard against move logits by ~1.
LOGIT_TOL = {"rtol": 5e-4, "atol": 5e-4}
# One sublayer, no amplification: fp32 rounding of two evaluation orders.
LAYER_TOL = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(scope="module")
def mxfp4_base():
    """k3_tiny with MXFP4 experts (built once: quantizing the experts takes seconds); tests deep-copy it."""
    return _tiny("mxfp4")


@pytest.fixture(scope="module")
def bf16_base():
    return _tiny("bf16")


def _dequantized_twin(q):
    """A bf16-format (unquantized) copy of an MXFP4-experts model: same tensors, experts decoded exactly."""
    ref = K3ForCausalLM(q.config, expert_format="bf16").eval()
    ref.load_state_dict({k: v for k, v in q.state_dict().items() if ".experts." not in k}, strict=False)
    for mq, mr in zip(q.modules(), ref.modules(), strict=True):
        if isinstance(mq, RoutedExperts):
            with torch.no_grad():
                for n in PROJS:
                    getattr(mr, n).copy_(mq.dequantized(n, torch.float32))
    return ref


def _cross_entropy(logits_BTV, ids_BT):
    """Mean next-token cross-entropy of logits over ids (position t predicts ids[t + 1])."""
    logits = logits_BTV[:, :-1].float()
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids_BT[:, 1:].reshape(-1))


# ---- the frozen base -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_on_mxfp4_base_equals_lora_on_dequantized_base(mxfp4_base, dtype):
    q = copy.deepcopy(mxfp4_base)
    ref = _dequantized_twin(q)
    q.cast(dtype), ref.cast(dtype)
    cfg = LoRAConfig(rank=4, alpha=8.0, targets=ALL_TARGETS)
    assert apply_lora(q, cfg) == apply_lora(ref, cfg)
    _randomize_adapters(q), _randomize_adapters(ref)
    ids = _ids(2, 16)
    logits_q, logits_r = q(ids).logits, ref(ids).logits
    # Same decoded weights, same adapter values, same kernels: bitwise equal, not merely close.
    assert torch.equal(logits_q, logits_r)
    loss_q, loss_r = (_cross_entropy(lg, ids) for lg in (logits_q, logits_r))
    loss_q.backward()
    loss_r.backward()
    grads_q, grads_r = lora_parameters(q), lora_parameters(ref)
    for name, p in grads_q.items():
        assert p.grad is not None and torch.equal(p.grad, grads_r[name].grad), name
    expert_a = grads_q["model.layers.1.block_sparse_moe.experts.lora.w2.lora_A"]
    assert expert_a.grad.abs().sum() > 0 and expert_a.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_b_at_init_gives_the_base_output_exactly(mxfp4_base, dtype):
    model = copy.deepcopy(mxfp4_base).cast(dtype)
    ids = _ids(2, 16, seed=2)
    with torch.no_grad():
        base = model(ids).logits
        apply_lora(model, LoRAConfig(rank=8, targets=ALL_TARGETS))
        assert torch.equal(model(ids).logits, base)
    lin = model.model.layers[1].self_attn.q_proj
    assert isinstance(lin, LoRALinear) and lin.lora_A.weight.dtype == torch.float32
    assert lin.lora_B.weight.abs().sum() == 0
    assert lin.lora_A.weight.abs().max() <= 128 ** -0.5  # kaiming-uniform(a=sqrt(5)): U(+-1/sqrt(In))
    experts = model.model.layers[1].block_sparse_moe.experts.lora
    assert experts["w2"].lora_A.shape == (16, 8, 64) and experts["w2"].lora_B.shape == (16, 64, 8)
    assert experts["w1"].lora_A.abs().max() <= 64 ** -0.5 and experts["w1"].lora_B.abs().sum() == 0


def test_lora_linear_shares_the_base_weight_and_keeps_checkpoint_keys(mxfp4_base):
    model = copy.deepcopy(mxfp4_base)
    base_sd = model.state_dict()
    weight = model.model.layers[3].self_attn.kv_b_proj.weight
    paths = apply_lora(model, LoRAConfig(rank=4, targets=ALL_TARGETS))
    assert model.model.layers[3].self_attn.kv_b_proj.weight is weight
    assert "model.layers.3.self_attn.kv_b_proj" in paths
    assert "model.layers.1.block_sparse_moe.experts.w3" in paths
    assert not any(p.endswith(("block_sparse_moe.gate", "lm_head")) for p in paths)
    keys = set(model.state_dict())
    assert keys == set(base_sd) | set(lora_state_dict(model))
    assert "model.layers.3.self_attn.kv_b_proj.lora_B.weight" in keys
    assert "model.layers.2.block_sparse_moe.experts.lora.w1.lora_A" in keys
    # A base checkpoint still loads by its own names; only adapter keys are missing.
    result = model.load_state_dict(base_sd, strict=False)
    assert set(result.missing_keys) == set(lora_state_dict(model)) and not result.unexpected_keys


def test_training_changes_adapters_and_leaves_every_base_byte_unchanged(mxfp4_base):
    model = copy.deepcopy(mxfp4_base)
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, dropout=0.1, targets=ALL_TARGETS))
    adapters = lora_parameters(model)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(adapters)
    base_before = {k: v.clone() for k, v in model.state_dict().items() if k not in adapters}
    assert any(v.dtype == torch.uint8 for v in base_before.values())  # the MXFP4 expert storage is covered
    adapters_before = {n: p.detach().clone() for n, p in adapters.items()}
    opt = torch.optim.AdamW(adapters.values(), lr=1e-2)
    ids = _ids(4, 24, seed=3)
    model.train()
    losses = []
    for _ in range(4):
        loss = _cross_entropy(model(ids).logits, ids)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    for n, p in adapters.items():
        assert not torch.equal(p.detach(), adapters_before[n]), f"{n} did not change"
    after = model.state_dict()
    assert set(after) == set(base_before) | set(adapters)
    for k, v in base_before.items():
        assert torch.equal(v.view(torch.uint8), after[k].view(torch.uint8)), f"base tensor {k} changed"
    assert all(p.grad is None for n, p in model.named_parameters() if n not in adapters)


# ---- merging -------------------------------------------------------------------------------------------
def test_merged_bf16_experts_model_equals_the_unmerged_forward(bf16_base):
    model = copy.deepcopy(bf16_base)
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets=ALL_TARGETS))
    _randomize_adapters(model)
    base_keys = {k for k in model.state_dict() if k not in lora_parameters(model)}
    merged = copy.deepcopy(model)
    merged_paths = merge_lora_into_bf16(merged)
    assert len(merged_paths) == len(lora_parameters(model)) // 2 and not lora_parameters(merged)
    assert set(merged.state_dict()) == base_keys
    ids = _ids(2, 16, seed=4)
    with torch.no_grad():
        unmerged_logits, merged_logits = model(ids).logits, merged(ids).logits
        base_logits = bf16_base(ids).logits
    torch.testing.assert_close(merged_logits, unmerged_logits, **LOGIT_TOL)
    assert (unmerged_logits - base_logits).abs().max() > 0.1  # the adapters really move the output
    assert lora_parameters(model)  # the merge worked on a copy; the original keeps its adapters


def test_merge_in_bf16_is_within_bf16_rounding_of_the_unmerged_forward():
    """The bf16 claim, per module (a whole bf16 model at random init amplifies rounding chaotically, see
    tests/parity.py): merged W + s*B@A is rounded once to bf16, the unmerged forward rounds x@W^T and the delta
    separately, so they differ by a few bf16 roundings (unit roundoff 2^-9 = 2e-3). Observed relative L2:
    3.5e-3 (linear), 7.3e-3 (experts, through SiTU and three projections); bound 2e-2. The adapters move the
    output by >10% relative, so a wrong merge (transposed, unscaled, missing) fails by far."""
    torch.manual_seed(0)
    lin = LoRALinear(nn.Linear(128, 96, bias=False).to(torch.bfloat16), rank=8, alpha=16.0)
    experts = RoutedExperts(6, 64, 32, 4.0, 25.0, expert_format="bf16").to(torch.bfloat16)
    experts.reset_parameters(std=0.05)
    apply_lora(experts, LoRAConfig(rank=8, alpha=16.0, targets=["w1", "w2", "w3"]))
    for m in (lin, experts):
        _randomize_adapters(m, std=0.05)
    x = torch.randn(40, 128, dtype=torch.bfloat16)
    z = torch.randn(40, 64, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(6)[:2] for _ in range(40)])
    w = torch.full((40, 2), 0.5)
    with torch.no_grad():
        lin_base = nn.functional.linear(x, lin.weight)
        triples = [(lin(x), nn.functional.linear(x, lin.merged_weight()), lin_base)]
        unmerged = experts(z, ids, w)
        lora, experts.lora = experts.lora, None
        experts_base = experts(z, ids, w)
        experts.lora = lora
        merge_lora_into_bf16(experts)
        triples.append((unmerged, experts(z, ids, w), experts_base))

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    for unmerged_out, merged_out, base_out in triples:
        assert rel(merged_out, unmerged_out) < 2e-2
        assert rel(base_out, unmerged_out) > 0.1


def test_merge_refuses_mxfp4_experts(mxfp4_base):
    model = copy.deepcopy(mxfp4_base)
    apply_lora(model, LoRAConfig(rank=4, targets=["q_proj", "w2"]))
    with pytest.raises(ValueError, match="re-quantize.*expert_format=bf16"):
        merge_lora_into_bf16(model)
    assert applied_lora_config(model).targets == ["q_proj", "w2"]  # nothing was merged or removed


# ---- MLA absorbed decode ---------------------------------------------------------------------------------
def test_mla_absorbed_decode_with_kv_b_lora_equals_full_forward(bf16_base, monkeypatch):
    model = copy.deepcopy(bf16_base)
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets=["kv_b_proj"]))
    _randomize_adapters(model)
    ids = _ids(2, 8, seed=5)

    def decode_logits():
        state, out = model.empty_state(2), []
        for t in range(ids.shape[1]):
            step = model.step(ids[:, t], state)
            state = step.state
            out.append(step.logits)
        return torch.stack(out, dim=1)

    with torch.no_grad():
        full = model(ids).logits
    torch.testing.assert_close(decode_logits(), full, **LOGIT_TOL)
    # The MLA sublayer alone: naive forward over T tokens vs T absorbed steps.
    mla = model.model.layers[3].self_attn
    assert isinstance(mla.kv_b_proj, LoRALinear)
    x = torch.randn(2, 12, 128, generator=torch.Generator().manual_seed(0))

    def absorbed_steps():
        state, out = mla.empty_state(2, x.device, x.dtype), []
        for t in range(x.shape[1]):
            y, state = mla.step(x[:, t: t + 1], state, torch.full((2,), t))
            out.append(y)
        return torch.cat(out, dim=1)

    with torch.no_grad():
        naive = mla(x)[0]
        torch.testing.assert_close(absorbed_steps(), naive, **LAYER_TOL)
        # Control: an absorbed path that read the raw kv_b weight (ignoring the adapter) would disagree.
        monkeypatch.setattr(mla_mod, "effective_weight", lambda linear: linear.weight)
        assert (absorbed_steps() - naive).abs().max() > 1e-2


# ---- config ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("change", "match"), [
    ({"rank": 0}, r"rank: must be >= 1"),
    ({"alpha": 0.0}, r"alpha: must be > 0"),
    ({"dropout": 1.0}, r"dropout: must be in \[0, 1\)"),
    ({"dropout": -0.1}, r"dropout: must be in \[0, 1\)"),
    ({"targets": ["q_proj", "gate"]}, r"targets: unknown \['gate'\]; allowed names are \[.*'kv_b_proj'.*'w3"),
    ({"targets": ["q_proj", "w1", "q_proj"]}, r"targets: \['q_proj'\] listed more than once"),
    ({"targets": []}, r"targets: empty"),
])
def test_config_validation_errors(change, match):
    with pytest.raises(ValueError, match=match):
        LoRAConfig(**change).validate()


def test_config_is_a_structured_config_and_apply_checks_the_model(bf16_base):
    override = {"rank": 8, "targets": ["w1"]}
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(LoRAConfig), override))
    assert isinstance(cfg, LoRAConfig) and cfg.rank == 8 and cfg.targets == ["w1"] and cfg.scale == 4.0
    assert LoRAConfig(rank=16, alpha=32.0, use_rslora=True).scale == 8.0
    LoRAConfig(targets=list(ALLOWED_TARGETS)).validate()
    model = copy.deepcopy(bf16_base)
    with pytest.raises(ValueError, match=r"targets: \['w1'\] match no module"):
        apply_lora(model.model.layers[0], LoRAConfig(targets=["q_proj", "w1"]))  # layer 0 is dense
    assert applied_lora_config(model) is None  # nothing attached on failure
    apply_lora(model, LoRAConfig(rank=2))
    with pytest.raises(ValueError, match="already has LoRA"):
        apply_lora(model, LoRAConfig(rank=2))


def test_adapter_num_params_on_the_meta_device():
    with torch.device("meta"):
        model = K3ForCausalLM(K3Config.from_name("k3_tiny"), expert_format="mxfp4")
    apply_lora(model, LoRAConfig(rank=4, targets=ALL_TARGETS))
    linears = [m for m in model.modules() if isinstance(m, LoRALinear)]
    experts = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    want = sum(4 * (m.in_features + m.out_features) for m in linears)
    want += sum(e.num_experts * 4 * sum(e.proj_shape(n)) for e in experts for n in PROJS)
    assert adapter_num_params(model) == want == 1_083_264 // 4


def test_adapters_disabled_gives_the_base_model_exactly_and_restores():
    from miles_k3.model.lora import adapters_disabled

    torch.manual_seed(0)
    cfg = K3Config.from_name("k3_tiny")
    model = K3ForCausalLM(cfg, expert_format="mxfp4").eval().requires_grad_(False)
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    with torch.no_grad():
        base = model(ids).logits
        apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets=list(ALLOWED_TARGETS)))
        for p in lora_parameters(model).values():
            p.normal_(0, 0.2)
        adapted = model(ids).logits
        with adapters_disabled(model):
            off = model(ids).logits
        again = model(ids).logits
    assert not torch.equal(adapted, base)
    assert torch.equal(off, base) and torch.equal(again, adapted)
    with pytest.raises(RuntimeError, match="boom"), adapters_disabled(model):
        raise RuntimeError("boom")
    assert all(m.enabled for m in model.modules() if hasattr(m, "enabled"))
