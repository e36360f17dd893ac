"""engine.merge_lora: the native engine serves its adapter through merged dense weights W' = round(W + s * B @ A)
(one GEMM per adapted linear) while the routed experts' adapters stay unmerged. On CPU (k3_nano, fp32 and bf16):
the merged engine computes exactly with W', matches the unmerged engine up to fp32 rounding, re-merges in place on
a push and on every switch of adapter, gives the base alone under `adapters_disabled`, never writes the shared base
weights, and leaves everything as it was when off (kv_b_proj's forward included). On CUDA (`gpu`): captured decode
graphs read the merged buffers refreshed in place."""
import copy

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import (
    cuda_tiny_adapted,
    random_adapter,
    samples_before_and_after_a_push,
    small_engine,
    teacher_forced_gaps,
)
from torch import nn

from miles_k3.model import K3Config, K3ForCausalLM
from miles_k3.model.lora import (
    LINEAR_TARGETS,
    ExpertLoRA,
    InferenceCopies,
    LoRAConfig,
    LoRALinear,
    adapters_disabled,
    lora_linears,
    lora_state_dict,
    remove_lora,
)
from miles_k3.rollout.engine import EngineConfig, RolloutEngine

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [5, 6, 7], [300]]
SEQ = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 50, 60, 70, 80, 90]])
LORA = LoRAConfig(rank=4, alpha=8.0, targets=[*LINEAR_TARGETS, "w1"])  # every dense linear, and one expert proj
SCALE = 2.0  # s = alpha / rank = 8 / 4
GREEDY = {"temperature": 0, "max_new_tokens": 6}
SAMPLED = {"temperature": 1.0, "max_new_tokens": 6, "sampling_seed": 5}
# fp32, merged vs unmerged: two evaluation orders of (W + s B A) x, so their log-probs differ by fp32 rounding only
# (2^-24 relative per operation); a random model amplifies a perturbation about twice per layer (measured on
# k3_tiny's 9 layers: ~1e-3 at the logits), hence k3_nano's 4 layers, where six seeds gave <= 2.1e-5. The adapter
# itself moves them by ~1 nat.
FP32_ATOL = 1e-4


def _nano(seed: int = 1) -> K3ForCausalLM:
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.from_name("k3_nano"), expert_format="mxfp4").eval()
    with torch.no_grad():  # non-zero AttnRes queries so the mixers are exercised
        for name, p in model.named_parameters():
            if name.endswith("_res_proj.weight"):
                p.normal_(0, 0.5)
    return random_adapter(model, LORA, seed=seed)


@pytest.fixture(scope="module")
def nano():
    return _nano()


@pytest.fixture(scope="module")
def nano_bf16(nano):
    return copy.deepcopy(nano).cast(torch.bfloat16)


def _engine(model, merge: bool, tensors=None, **fields) -> RolloutEngine:
    engine = small_engine(model, lora=LORA, merge_lora=merge, **fields)
    engine.load_lora_adapter_from_tensors("policy", lora_state_dict(model) if tensors is None else tensors, LORA)
    return engine


def _runs(outs) -> list[tuple[list[int], list[float]]]:
    return [(o["output_ids"], [lp for lp, _ in o["meta_info"]["output_token_logprobs"]]) for o in outs]


@torch.no_grad()
def _logits(engine: RolloutEngine, name: str | None) -> torch.Tensor:
    """The engine model's full-sequence logits of SEQ with adapter `name` bound (the prefill path)."""
    engine.adapters.bind(name, engine.weight_version)
    return engine.model(SEQ).logits


def test_merge_lora_is_off_by_default_and_refused_with_sglang():
    from miles_k3.config import ConfigFieldError, compose_config

    assert EngineConfig().merge_lora is False
    EngineConfig(merge_lora=True).validate()
    overrides = ["engine.backend=sglang", "model.hf_path=/ckpt/qwen3", "engine.merge_lora=true"]
    with pytest.raises(ConfigFieldError, match=r"^engine.merge_lora: does nothing with backend=sglang .*"
                                               r"sglang.push=merged.* use backend=native$"):
        compose_config("train", overrides)


def test_merged_engine_matches_the_unmerged_one_in_fp32_and_applies_the_adapter(nano):
    """One call serves the adapter and the base (rows of both: the bound adapter switches, and is re-merged, at
    every step). The adapter's rows agree with the unmerged engine's to fp32 rounding; the base's are bitwise the
    unmerged engine's (B = 0: W + 0 rounds back to W exactly); the adapter does move the logits."""
    loras = ["policy"] * len(PROMPTS) + [None] * len(PROMPTS)
    runs = {merge: _runs(_engine(nano, merge).generate(input_ids=PROMPTS * 2, sampling_params=GREEDY, lora=loras))
            for merge in (False, True)}
    adapted = slice(0, len(PROMPTS))
    assert [t for t, _ in runs[True][adapted]] == [t for t, _ in runs[False][adapted]]
    gap = max(abs(a - b) for (_, la), (_, lb) in zip(runs[True][adapted], runs[False][adapted])
              for a, b in zip(la, lb))
    assert gap < FP32_ATOL
    assert runs[True][len(PROMPTS):] == runs[False][len(PROMPTS):]
    engine = _engine(nano, merge=True)
    assert (_logits(engine, "policy") - _logits(engine, None)).abs().max() > 0.1


def _merged_by_hand(model: K3ForCausalLM) -> K3ForCausalLM:
    """A copy of `model` whose adapted linears hold W' = round(W + s * B @ A) (summed in fp32) and B = 0, so they
    compute x W'^T + 0; the routed experts' adapters are left as they are."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for _, lin in lora_linears(ref):
            exact = lin.weight.float() + SCALE * (lin.lora_B.weight.float() @ lin.lora_A.weight.float())
            lin.weight.copy_(exact.to(lin.weight.dtype))
            lin.lora_B.weight.zero_()
    return ref


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_merged_engine_computes_with_round_w_plus_s_b_a_exactly(nano, nano_bf16, dtype):
    """The merged engine is, bit for bit, the engine of a model whose dense weights were merged by hand: its
    full-sequence logits and its sampled tokens and log-probs (decode: MLA's absorbed kv_b_proj too)."""
    model = nano if dtype == "fp32" else nano_bf16
    ref = _merged_by_hand(model)
    merged, by_hand = _engine(model, merge=True), _engine(ref, merge=False)
    assert torch.equal(_logits(merged, "policy"), _logits(by_hand, "policy"))
    outs = [_runs(e.generate(input_ids=PROMPTS, sampling_params=SAMPLED, lora="policy")) for e in (merged, by_hand)]
    assert outs[0] == outs[1]
    unmerged = _engine(model, merge=False)  # and that is not what the unmerged engine computes
    assert not torch.equal(_logits(merged, "policy"), _logits(unmerged, "policy"))


def _bf16_linear() -> LoRALinear:
    torch.manual_seed(7)
    lin = LoRALinear(nn.Linear(64, 48, bias=True, dtype=torch.bfloat16), rank=4, alpha=8.0)
    with torch.no_grad():
        lin.lora_B.weight.normal_(0, 0.3)
        lin.bias.normal_(0, 0.1)
    return lin.eval()


def test_a_merged_bf16_linear_is_one_gemm_over_the_rounded_sum_within_its_rounding_bound():
    """bf16 LoRALinear with forward_merged copies: the output is exactly F.linear(x, round(W + s B A), bias). Bound
    on its error against the exact fp64 product, per output, with bf16's unit roundoff u = 2^-8 (8 significant
    bits): each W' element is within u (relative) of W + sBA, the GEMM accumulates in fp32 (~2^-24, negligible)
    and rounds once (u of |y|): |y - y_exact| <= u M + u (1 + u) M <= 1.01 * 2^-7 M, M = |x| |W + sBA|^T + |bias|.
    The unmerged forward rounds A, B, A x and B(A x) (4 u of the delta's magnitude), x W^T + bias and the final add
    (s = 2 scales exactly): within 5 u M' of exact, M' = |x| (|W| + s |B||A|)^T + |bias| >= M; so the two differ by
    at most 7 u M' < 2^-5 M'."""
    lin = _bf16_linear()
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    w, a, b, bias = (t.detach().double() for t in (lin.weight, lin.lora_A.weight, lin.lora_B.weight, lin.bias))
    exact_w = w + SCALE * b @ a
    y_exact = x.double() @ exact_w.T + bias
    m = x.double().abs() @ exact_w.abs().T + bias.abs()
    m_sum = x.double().abs() @ (w.abs() + SCALE * b.abs() @ a.abs()).T + bias.abs()
    with torch.no_grad():
        unmerged = lin(x)  # no copies: the per-call casts
        InferenceCopies.attach(lin, torch.bfloat16, forward_merged=True)
        merged = lin(x)
        w_merged = (lin.weight.float() + SCALE * lin.lora_B.weight @ lin.lora_A.weight).to(torch.bfloat16)
        assert torch.equal(merged, F.linear(x, w_merged, lin.bias))
        assert ((merged.double() - y_exact).abs() <= 1.01 * 2**-7 * m).all()
        assert ((merged.double() - unmerged.double()).abs() <= 2**-5 * m_sum).all()
        assert not torch.equal(merged, unmerged)  # two roundings, not the same bits
        lin.enabled = False
        assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))  # disabled: the base alone
        lin.enabled = True
    with torch.enable_grad():  # a forward with gradients (the trainer's) ignores the copies
        lin.lora_B.weight.requires_grad_(True)
        assert torch.equal(lin(x).detach(), unmerged)


def test_a_push_re_merges_in_place_and_the_base_is_never_written(nano):
    """A push into the served adapter: the merged buffers (their addresses unchanged) then hold round(W + s B A) of
    the pushed tensors, and the next generate equals a fresh merged engine built with them, bit for bit, and an
    unmerged one to fp32 rounding; the trainer's base weights, which the engine shares, are untouched."""
    base_before = {n: t.clone() for n, t in nano.state_dict().items() if "lora_" not in n}
    g = torch.Generator().manual_seed(11)
    pushed = {n: torch.randn(t.shape, generator=g) * 0.3 if "lora_B" in n else t.clone()
              for n, t in lora_state_dict(nano).items()}
    engine = _engine(nano, merge=True)
    first = _runs(engine.generate(input_ids=PROMPTS, sampling_params=SAMPLED, lora="policy"))
    mods = [m for _, m in lora_linears(engine.model)]
    addresses = [m.inference_copies.merged.data_ptr() for m in mods]
    assert all(a != m.weight.data_ptr() for a, m in zip(addresses, mods))  # buffers of their own
    engine.update_weights_from_tensor(pushed, lora_name="policy")
    second = _runs(engine.generate(input_ids=PROMPTS, sampling_params=SAMPLED, lora="policy"))
    fresh = _runs(_engine(nano, merge=True, tensors=pushed).generate(input_ids=PROMPTS, sampling_params=SAMPLED,
                                                                      lora="policy"))
    assert second == fresh and second != first
    unmerged = _runs(_engine(nano, merge=False, tensors=pushed).generate(input_ids=PROMPTS, sampling_params=SAMPLED,
                                                                         lora="policy"))
    assert [t for t, _ in second] == [t for t, _ in unmerged]
    assert max(abs(a - b) for (_, la), (_, lb) in zip(second, unmerged) for a, b in zip(la, lb)) < FP32_ATOL
    assert [m.inference_copies.merged.data_ptr() for m in mods] == addresses
    for path, m in lora_linears(engine.model):
        a, b = pushed[f"{path}.lora_A.weight"], pushed[f"{path}.lora_B.weight"]
        assert torch.equal(m.inference_copies.merged, (m.weight + SCALE * (b @ a)).to(m.weight.dtype)), path
    assert all(torch.equal(t, base_before[n]) for n, t in nano.state_dict().items() if "lora_" not in n)


def test_disabled_adapters_give_the_base_alone_with_merge_on(nano):
    """`adapters_disabled` over the merged engine's model: its forward is the plain base model's, bit for bit
    (x W^T, not x W'^T), and generating "policy" inside it gives the base's (lora=None) tokens and log-probs."""
    plain = copy.deepcopy(nano)
    remove_lora(plain)
    engine = _engine(nano, merge=True)
    with torch.no_grad():
        base = plain(SEQ).logits
    assert not torch.equal(_logits(engine, "policy"), base)
    with adapters_disabled(engine.model):
        assert torch.equal(_logits(engine, "policy"), base)
        disabled = _runs(engine.generate(input_ids=PROMPTS, sampling_params=SAMPLED, lora="policy"))
    assert disabled == _runs(engine.generate(input_ids=PROMPTS, sampling_params=SAMPLED, lora=None))


def test_merged_copies_where_merge_lora_says_and_kv_b_proj_unchanged_when_off(nano_bf16):
    """Off: kv_b_proj alone keeps a merged weight (for MLA's absorbed decode), and its forward still computes
    x W^T + s B(A x), bitwise the per-call casts' result, not x W'^T (with fuse_projections off: on, the delta is
    added inside the B GEMM, `test_fuse_projections.py`). On: every dense adapted linear has a merged weight its
    forward reads; the routed experts' adapters never do."""
    x = torch.randn(3, nano_bf16.config.kv_lora_rank, generator=torch.Generator().manual_seed(5)).bfloat16()
    for merge in (False, True):
        engine = _engine(nano_bf16, merge, fuse_projections=False)
        engine.adapters.bind("policy", engine.weight_version)
        for path, lin in lora_linears(engine.model):
            copies = lin.inference_copies
            is_kv_b = path.endswith("kv_b_proj")
            assert copies.forward_merged == merge and (copies.merged is not None) == (merge or is_kv_b), path
            if is_kv_b and not merge:
                with torch.no_grad():
                    kept = lin(x)
                    lin.inference_copies = None
                    per_call = lin(x)
                    lin.inference_copies = copies
                    assert torch.equal(kept, per_call)
                    assert not torch.equal(kept, F.linear(x, copies.merged))  # what a merged forward would give
        experts = [m for m in engine.model.modules() if isinstance(m, ExpertLoRA)]
        assert experts and all(m.inference_copies.merged is None for m in experts)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_decode_reads_the_merged_weights_refreshed_in_place():
    """k3_tiny in bf16 with fla's KDA and CUDA-graph decode, merge_lora on: graph and static decode agree bitwise
    before and after a push (the graphs captured before it read the re-merged buffers), the pushed engine equals a
    fresh one, and every sampled token's log-prob is within 0.5 of a teacher-forced forward of the bf16 trainer
    (unmerged): on CPU the same model and adapter gave max gaps of 0.15-0.21 merged and 0.04-0.13 unmerged over
    three seeds (random weights amplify bf16 rounding about twice per layer); leaving the adapter out moves
    log-probs by ~1 nat. Greedy tokens are not compared: on these near-uniform random models bf16 rounding flips
    near-tied greedy choices from the first token for some seeds (seen on CPU)."""
    lora = LoRAConfig(rank=8, alpha=16.0, targets=["q_proj", "o_proj", "kv_b_proj", "gate_proj", "up_proj",
                                                   "down_proj", "w1", "w2", "w3"])
    model, pushed = cuda_tiny_adapted(lora)
    prompts = [*PROMPTS, list(range(40, 70))]
    params = {"temperature": 1.0, "max_new_tokens": 12, "sampling_seed": 5}

    def engine(decode, tensors=None):
        e = RolloutEngine(model, EngineConfig(memory_budget_bytes=64 * 2**20, max_context=128, page_size=16,
                                              decode=decode, merge_lora=True), lora=lora)
        e.load_lora_adapter_from_tensors("policy", lora_state_dict(model) if tensors is None else tensors, lora)
        return e

    runs = {}
    for decode in ("static", "graph"):
        e = engine(decode)
        runs[decode] = samples_before_and_after_a_push(e, prompts, params, pushed)
        assert e.decode_mode == decode
    assert _runs(runs["graph"][0]) == _runs(runs["static"][0])
    assert _runs(runs["graph"][1]) == _runs(runs["static"][1]) != _runs(runs["graph"][0])
    fresh = engine("graph", pushed).generate(input_ids=prompts, sampling_params=params, lora="policy")
    assert _runs(fresh) == _runs(runs["graph"][1])
    gaps = teacher_forced_gaps(model, prompts, runs["graph"][0])
    print(f"max |merged graph engine - bf16 trainer forward| log-prob: {max(gaps):.4f}")
    assert max(gaps) < 0.5
