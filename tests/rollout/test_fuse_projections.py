"""engine.fuse_projections: the native engine's decode step computes the linears that read one input as one GEMM
(`miles_k3.model.fused_projections`). On CPU (k3_nano, an adapter on every dense linear): the groups attached by
default and where they belong, the GEMMs one decode step saves (counted by hand from the architecture), the same
samples as the unfused engine (fp32: to rounding; bf16: to the tolerance below), the groups following a push and a
switch of adapter, with merged adapters too, and the configurations refused. On CUDA (`gpu`): captured decode
graphs read the groups refreshed in place."""
import collections
import copy

import pytest
import torch
from engine_helpers import (
    cuda_tiny_adapted,
    random_adapter,
    samples_before_and_after_a_push,
    small_engine,
    teacher_forced_gaps,
)
from torch.utils._python_dispatch import TorchDispatchMode

from miles_k3.model import K3Config, K3ForCausalLM
from miles_k3.model.kda import KDAAttention
from miles_k3.model.layers import SiTUMLP
from miles_k3.model.lora import LINEAR_TARGETS, LoRAConfig, lora_state_dict
from miles_k3.model.mla import MLAAttention
from miles_k3.model.moe import LatentMoE
from miles_k3.rollout.engine import EngineConfig, RolloutEngine

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [5, 6, 7], [300]]
LORA = LoRAConfig(rank=4, alpha=8.0, targets=[*LINEAR_TARGETS, "w1"])  # every dense linear, and one expert proj
GREEDY = {"temperature": 0, "max_new_tokens": 6}
SAMPLED = {"temperature": 1.0, "max_new_tokens": 6, "sampling_seed": 5}
# k3_nano: layers kda/mlp, kda/moe, kda/moe, mla/moe (one shared expert, MLA output gate): 3 KDA groups (q|k|v, g,
# b, f_a), 1 MLA (q_a, kv_a, g), 1 dense MLP (gate, up) and 3 MoE groups (routed down, shared gate, shared up).
NANO_GROUPS = {KDAAttention: 3, MLAAttention: 1, SiTUMLP: 1, LatentMoE: 3}
# What one decode step saves. With the adapter, an unfused adapted linear is 3 mm (x W^T, A x, B (A x)), a mul (the
# scale) and an add. A group is 2 mm (the stacked W and A) + 1 addmm_ (B): KDA 6 * 3 - 2 = 16 mm fewer, MLA
# 3 * 3 - 2 = 7, MLP 2 * 3 - 2 = 4, MoE 3 * 3 - 2 = 7, so 3 * 16 + 7 + 4 + 3 * 7 = 80 and 8 addmm_. The 15 adapted
# linears outside the groups (KDA f_b and o: 6, MLA q_b and o: 2 (kv_b is read merged), MLP down: 1, MoE routed up
# and shared down: 6) each turn their B mm into an addmm_: 15 mm fewer, 15 addmm_. None of the 47 adapted linears
# (KDA 3 * 8, MLA 5, MLP 3, MoE 3 * 5) keeps its mul and add. Without an adapter a linear is 1 mm and a group 1:
# KDA 5, MLA 2, MLP 1, MoE 2: 3 * 5 + 2 + 1 + 3 * 2 = 24 mm fewer, nothing else.
SAVED = {"adapter": {"mm": 95, "mul": 47, "add": 47, "addmm_": -23},
         "base": {"mm": 24, "mul": 0, "add": 0, "addmm_": 0}}
# fp32, fused vs unfused: the same dot products summed by one GEMM or several (another blocking, another order:
# 2^-24 relative per operation), which a random model amplifies about twice per layer; as in test_merge_lora.py.
# Measured on k3_nano: 0 to 1.2e-5.
FP32_ATOL = 1e-4


def _nano(seed: int | None = 1) -> K3ForCausalLM:
    """k3_nano with random AttnRes queries and (seed not None) a random adapter."""
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.from_name("k3_nano"), expert_format="mxfp4").eval()
    with torch.no_grad():  # non-zero AttnRes queries so the mixers are exercised
        for name, p in model.named_parameters():
            if name.endswith("_res_proj.weight"):
                p.normal_(0, 0.5)
    return model if seed is None else random_adapter(model, LORA, seed=seed)


@pytest.fixture(scope="module")
def nano():
    return _nano()


def _engine(model, fuse: bool | None, tensors=None, **fields) -> RolloutEngine:
    engine = small_engine(model, lora=LORA, fuse_projections=fuse, **fields)
    engine.load_lora_adapter_from_tensors("policy", lora_state_dict(model) if tensors is None else tensors, LORA)
    return engine


def _runs(outs) -> list[tuple[list[int], list[float]]]:
    return [(o["output_ids"], [lp for lp, _ in o["meta_info"]["output_token_logprobs"]]) for o in outs]


def _gap(a, b) -> float:
    assert [t for t, _ in a] == [t for t, _ in b]
    return max(abs(x - y) for (_, la), (_, lb) in zip(a, b) for x, y in zip(la, lb))


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _step_ops(engine: RolloutEngine, lora: str | None) -> collections.Counter:
    """The aten ops of the third decode step of a 1-request generate (static decode: the captured step's code)."""
    graph, ops, calls = engine.runner.graph, _Ops(), [0]
    step = graph._step

    def counted(packed):
        calls[0] += 1
        if calls[0] != 3:
            return step(packed)
        with ops:
            return step(packed)

    graph._step = counted
    try:
        engine.generate(input_ids=[PROMPTS[0]], sampling_params=GREEDY, lora=lora)
    finally:
        graph._step = step
    assert calls[0] >= 3
    return ops.count


def test_groups_by_default_where_they_belong_and_none_when_off(nano):
    assert EngineConfig().fuse_projections is None
    on = _engine(nano, None)
    kinds = collections.Counter()
    for m in on.model.modules():
        if m.fused_projections is not None if hasattr(m, "fused_projections") else False:
            kinds[type(m)] += 1
    assert dict(kinds) == NANO_GROUPS and len(on.adapters.fused) == 8
    moe = next(m for m in on.model.modules() if isinstance(m, LatentMoE))
    assert moe.shared_experts.fused_projections is None  # its gate and up are in the MoE's group
    off = _engine(nano, False)
    assert off.adapters.fused == [] and all(getattr(m, "fused_projections", None) is None
                                            for m in off.model.modules())


@pytest.mark.parametrize("adapter", [True, False], ids=["adapter", "no-lora"])
def test_a_decode_step_saves_the_kernels_counted_by_hand(nano, adapter):
    """With the engine's LoRA config (the base, adapter None, is B = 0 and computes the same GEMMs) and without."""
    if adapter:
        ops = {fuse: _step_ops(_engine(nano, fuse, decode="static"), "policy") for fuse in (False, True)}
    else:
        base = _nano(seed=None)
        ops = {fuse: _step_ops(small_engine(base, fuse_projections=fuse, decode="static"), None)
               for fuse in (False, True)}
    saved = {op: ops[False][op] - ops[True][op] for op in ("mm", "mul", "add", "addmm_")}
    assert saved == SAVED["adapter" if adapter else "base"], saved


@pytest.mark.parametrize("decode", ["static", "eager"])
def test_the_same_samples_as_the_unfused_engine_in_fp32(nano, decode):
    """fp32: the samples are the same and the log-probs agree to fp32 rounding; the adapter's rows and the base's."""
    loras = ["policy"] * len(PROMPTS) + [None] * len(PROMPTS)
    runs = {fuse: _runs(_engine(nano, fuse, decode=decode).generate(input_ids=PROMPTS * 2, sampling_params=SAMPLED,
                                                                    lora=loras))
            for fuse in (False, True)}
    assert _gap(runs[True], runs[False]) <= FP32_ATOL


def test_bf16_log_probs_are_no_further_from_fp32_than_the_unfused_engines(nano):
    """bf16: the adapter's delta is added before one rounding where the unfused form rounds three times, so the
    fused engine's log-probs differ from the unfused one's by bf16 rounding; against the fp32 engine they are no
    further off. 64 random prompts, the log-probs of decode steps 1 and 2 where all three engines chose the same
    tokens (measured, printed under `pytest -s`: mean |bf16 - fp32| 0.0071 fused, 0.0093 unfused, over 63 shared
    positions)."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 500, (int(torch.randint(2, 12, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(64)]
    greedy3 = {"temperature": 0, "max_new_tokens": 3}
    bf16 = copy.deepcopy(nano).cast(torch.bfloat16)
    ref, unfused, fused = (_runs(_engine(m, f, decode="static").generate(input_ids=prompts, sampling_params=greedy3,
                                                                           lora="policy"))
                           for m, f in ((nano, False), (bf16, False), (bf16, True)))
    err = {"unfused": [], "fused": []}
    for (t0, l0), (t1, l1), (t2, l2) in zip(ref, unfused, fused):
        for i in (1, 2):  # token 0 comes from the prefill, which has no groups
            if t0[:i + 1] == t1[:i + 1] == t2[:i + 1]:
                err["unfused"].append(abs(l1[i] - l0[i]))
                err["fused"].append(abs(l2[i] - l0[i]))
    n = len(err["fused"])
    mean = {k: sum(v) / n for k, v in err.items()}
    print(f"mean |bf16 - fp32| log-prob over {n} shared positions: fused {mean['fused']:.4f}, "
          f"unfused {mean['unfused']:.4f}")
    assert n >= 50 and mean["fused"] <= 1.25 * mean["unfused"], (n, mean)


def test_groups_follow_a_push_and_a_switch_of_adapter(nano):
    """After a push of other adapter values (bound at the next step) and while rows of the base and the adapter
    alternate, the fused engine samples what an unfused engine built with the pushed values samples."""
    pushed = {n: (t * -0.5 if "lora_B" in n else t) for n, t in lora_state_dict(_nano(seed=2)).items()}
    engine = _engine(nano, True, decode="static")
    first = _runs(engine.generate(input_ids=PROMPTS, sampling_params=SAMPLED, lora="policy"))
    engine.update_weights_from_tensor(pushed, lora_name="policy")
    loras = ["policy", None, "policy"]
    got = _runs(engine.generate(input_ids=PROMPTS, sampling_params=SAMPLED, lora=loras))
    fresh = _runs(_engine(nano, False, tensors=pushed, decode="static").generate(
        input_ids=PROMPTS, sampling_params=SAMPLED, lora=loras))
    assert _gap(got, fresh) <= FP32_ATOL
    assert [t for t, _ in got] != [t for t, _ in first]  # the push did change what is sampled


def test_with_merged_adapters(nano):
    """merge_lora and fuse_projections together: a group of merged linears is one GEMM over the merged weights;
    it samples what the merged engine without groups samples."""
    runs = {fuse: _runs(_engine(nano, fuse, decode="static", merge_lora=True).generate(
        input_ids=PROMPTS, sampling_params=SAMPLED, lora="policy")) for fuse in (False, True)}
    assert _gap(runs[True], runs[False]) <= FP32_ATOL
    engine = _engine(nano, True, merge_lora=True)
    assert all(g.merged and g.a is None for g in engine.adapters.fused)


def test_on_by_default_only_for_a_model_that_is_not_sharded():
    """None: on at tp = ep = 1, off for a sharded model (its stacked copies would be of the whole dense model: a
    K3 70.5 GiB); set, the field decides."""
    cases = [(None, 1, 1, True), (None, 2, 1, False), (None, 1, 8, False), (True, 2, 8, True), (False, 1, 1, False)]
    for field_value, tp, ep, want in cases:
        assert EngineConfig(fuse_projections=field_value).fuses_projections(tp, ep) is want, (field_value, tp, ep)


def test_a_module_split_by_tensor_parallelism_gets_no_group(nano):
    from miles_k3.model.fused_projections import attach_fused_projections

    model = copy.deepcopy(nano)
    kda = next(m for m in model.modules() if isinstance(m, KDAAttention))
    kda.tp_group = object()  # what `parallelize` sets under tp > 1
    groups = attach_fused_projections(model)
    assert len(groups) == 7 and kda.fused_projections is None


def test_refused_with_sglang_and_in_full_mode_sft():
    from miles_k3.config import ConfigFieldError, compose_config

    overrides = ["engine.backend=sglang", "model.hf_path=/ckpt/qwen3", "engine.fuse_projections=true"]
    with pytest.raises(ConfigFieldError, match=r"^engine.fuse_projections: does nothing with backend=sglang .*"
                                               r"use backend=native$"):
        compose_config("train", overrides)
    with pytest.raises(ConfigFieldError, match=r"^engine.fuse_projections: in mode=full the eval engine reads the "
                                               r"weights being trained in place"):
        compose_config("sft", ["mode=full", "engine.fuse_projections=true"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_graph_decode_reads_the_groups_refreshed_in_place_and_launches_fewer_kernels():
    """k3_tiny in bf16 with fla's KDA and CUDA-graph decode, an adapter on every dense linear, groups on: graph and
    static decode agree bitwise before and after a push (graphs captured before it read the refreshed groups), the
    pushed engine equals a fresh one, and every sampled token's log-prob is within 0.5 of a teacher-forced forward
    of the bf16 trainer (the bound test_merge_lora.py's GPU test uses; printed beside the unfused engine's gap).
    One static decode step at batch 1 launches at least 90% of the kernels counted by hand fewer than the
    unfused step: k3_tiny has 6 KDA, 3 MLA, 1 dense MLP and 8 MoE groups; an adapted linear is 5 kernels (x W^T,
    A x, B (A x), the scale, the add) and a group 3, and KDA's q|k|v concatenation goes: 6 * 28 + 3 * 12 + 7 +
    8 * 12 = 307; the 35 adapted linears outside the groups (KDA f_b, o; MLA q_b, o; MLP down; MoE routed up,
    shared down) take 3 instead of 5: 70 more, 377 in all (cuBLAS may split a GEMM in two kernels, hence 90%)."""
    from kernel_testing import cuda_kernels

    lora = LoRAConfig(rank=8, alpha=16.0, targets=list(LINEAR_TARGETS))
    model, pushed = cuda_tiny_adapted(lora)
    prompts = [*PROMPTS, list(range(40, 70))]
    params = {"temperature": 1.0, "max_new_tokens": 12, "sampling_seed": 5}

    def engine(decode, tensors=None, fuse=True):
        e = RolloutEngine(model, EngineConfig(memory_budget_bytes=64 * 2**20, max_context=128, page_size=16,
                                              decode=decode, fuse_projections=fuse), lora=lora)
        e.load_lora_adapter_from_tensors("policy", lora_state_dict(model) if tensors is None else tensors, lora)
        return e

    runs = {}
    for decode in ("static", "graph"):
        e = engine(decode)
        runs[decode] = samples_before_and_after_a_push(e, prompts, params, pushed)
        assert e.decode_mode == decode and len(e.adapters.fused) == 18
    assert _runs(runs["graph"][0]) == _runs(runs["static"][0])
    assert _runs(runs["graph"][1]) == _runs(runs["static"][1]) != _runs(runs["graph"][0])
    assert _runs(engine("graph", pushed).generate(input_ids=prompts, sampling_params=params,
                                                  lora="policy")) == _runs(runs["graph"][1])
    unfused = engine("graph", fuse=False).generate(input_ids=prompts, sampling_params=params, lora="policy")
    gaps = {name: teacher_forced_gaps(model, prompts, outs)
            for name, outs in (("fused", runs["graph"][0]), ("unfused", unfused))}
    print("max |graph engine - bf16 trainer forward| log-prob: "
          + ", ".join(f"{k} {max(v):.4f}" for k, v in gaps.items()))
    assert max(gaps["fused"]) < 0.5
    launches = {}
    for fuse in (False, True):
        e = engine("static", fuse=fuse)
        e.adapters.bind("policy", e.weight_version)
        graph = e.runner.graph
        _, packed, _, _ = graph._graph(graph.buckets[0], 1)
        launches[fuse] = len(cuda_kernels(lambda graph=graph, packed=packed: graph._step(packed)))
    print(f"kernels per static decode step at batch 1: unfused {launches[False]}, fused {launches[True]}")
    assert launches[False] - launches[True] >= 0.9 * 377
