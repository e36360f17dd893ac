"""Tensor parallelism of K3's dense parts (k3_tiny, fp32, CPU gloo): one spawned tp=2 run checks, against the
single-process model built with the same seed and the same (non-zero) LoRA, the full-sequence logits (gathered
here from the ranks' vocabulary shards), every LoRA gradient after `reduce_gradients` (the rank's slice of the
single-process gradient), the global gradient norm, a decode step from a prefilled state, the rollout engine's
greedy tokens and log-probs (eager and static decode), a drawn-seed sample that both ranks agree on, and the
vocab-parallel token_logprobs_and_entropy (values and gradients; the one-process side is the same function with no
vocab_shard). Plus CPU unit tests of the refusals.

Tolerance: fp32 in another reduction order (row-parallel partial sums, vocab-parallel log-softmax), 1e-5
(gradients: 5e-5 of each tensor's largest entry, after backward through 9 layers). Observed, max |tp - single|:
logits 2.1e-6 (magnitude 1.0), log-probs 9.5e-7 and entropy 1.4e-6 (magnitude ~6.5), decode logits 1.8e-6,
grad norm 1.2e-6 relative, LoRA gradients 1.3e-5 of their tensor's largest entry, engine log-probs 9.5e-7
(tokens equal); the vocab-parallel losses alone (float64) 7e-16. K3's init (AttnRes queries 0): the N(0, 0.5)
queries of other fixtures amplify any evaluation-order difference ~50x (1.2e-4 on the logits here; see
test_lora.LOGIT_TOL for the same effect in one process).
"""
import dataclasses

import dist_helpers
import pytest
import torch
from dist_helpers import DEVICE_TYPE, run_ranks

from miles_k3.model import K3Config, K3ForCausalLM
from miles_k3.model.lora import LINEAR_TARGETS, LoRAConfig, apply_lora, lora_parameters, lora_state_dict
from miles_k3.parallel.config import ParallelConfigError
from miles_k3.parallel.mesh import ParallelContext

TP = 2
TOL = {"rtol": 1e-5, "atol": 1e-5}
LORA = LoRAConfig(rank=4, alpha=8.0, targets=list(LINEAR_TARGETS))
IDS = [[3, 17, 250, 411, 9, 77, 500, 12], [480, 2, 33, 260, 5, 0, 0, 0]]  # row 1: 5 real tokens
SEQ_LENS = [8, 5]
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [5, 6, 7], [300, 499]]
NEW_TOKENS = 5
CHUNK = 3  # token positions per chunk of the log-prob/entropy kernels: several chunks per row
COLUMN = ("q_proj", "k_proj", "v_proj", "g_proj", "f_b_proj", "b_proj", "q_b_proj", "kv_b_proj", "gate_proj",
          "up_proj")  # output rows split: their lora_B is split on dim 0
ROW = ("o_proj", "down_proj")  # input columns split: lora_A split on dim 1


def _model() -> K3ForCausalLM:
    """k3_tiny fp32 (K3's init), LoRA on every linear with B != 0 (the adapters change every output)."""
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.from_name("k3_tiny"), expert_format="bf16")
    apply_lora(model, LORA)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, p in sorted(lora_parameters(model).items()):
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


def _loss_weights(b: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randn(b, t, generator=g), torch.randn(b, t, generator=g)


def _engine_outputs(model: K3ForCausalLM, decode: str, ctx=None) -> list[dict]:
    from engine_helpers import small_engine

    from miles_k3.parallel.mesh import SINGLE
    engine = small_engine(model, LORA, decode=decode, ctx=ctx or SINGLE)
    engine.load_lora_adapter_from_tensors("policy", lora_state_dict(model), LORA)
    return engine.generate(input_ids=PROMPTS, sampling_params={"temperature": 0, "max_new_tokens": NEW_TOKENS},
                           lora="policy")


def _tokens_and_logprobs(results: list[dict]) -> list[tuple[list[int], list[float]]]:
    return [(r["output_ids"], [lp for lp, _ in r["meta_info"]["output_token_logprobs"]]) for r in results]


def _run(model: K3ForCausalLM, vocab_shard=None) -> dict:
    """Everything both sides compute: logits, log-probs/entropy, the LoRA gradients, a decode step."""
    from miles_k3.trainer.logprobs import token_logprobs_and_entropy
    device = model.lm_head.weight.device
    ids, lens = torch.tensor(IDS, device=device), torch.tensor(SEQ_LENS, device=device)
    logits = model(ids, seq_lens=lens).logits
    targets = torch.roll(ids, -1, dims=1)
    logp, ent = token_logprobs_and_entropy(logits, targets, CHUNK, vocab_shard=vocab_shard)
    w_logp, w_ent = (w.to(device) for w in _loss_weights(*ids.shape))
    ((logp * w_logp).sum() + (ent * w_ent).sum()).backward()
    with torch.no_grad():
        state = model(ids[:, :5], seq_lens=torch.tensor([5, 4], device=device), return_state=True,
                      return_logits=False).state
        step = model.step(torch.tensor([77, 5], device=device), state).logits
    return {"logits": logits.detach().cpu(), "logp": logp.detach().cpu(), "ent": ent.detach().cpu(),
            "step": step.cpu(), "grads": {n: p.grad.cpu().clone() for n, p in lora_parameters(model).items()}}


def _leaf_logits() -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [2, 7, 512] with a -inf entry (entropy and log-softmax stay finite) and target ids."""
    g = torch.Generator().manual_seed(3)
    z = torch.randn(2, 7, 512, generator=g, dtype=torch.float64) * 3
    z[0, 1, 300] = float("-inf")
    return z, torch.randint(0, 512, (2, 7), generator=g)


def _losses_alone(z: torch.Tensor, tokens: torch.Tensor, vocab_shard=None) -> dict:
    from miles_k3.trainer.logprobs import token_logprobs_and_entropy
    z = z.clone().requires_grad_()  # on the device of the caller's logits
    logp, ent = token_logprobs_and_entropy(z, tokens, CHUNK, vocab_shard=vocab_shard)
    w_logp, w_ent = (w.to(z.device).double() for w in _loss_weights(*tokens.shape))
    ((logp * w_logp).sum() + (ent * w_ent).sum()).backward()
    return {"logp": logp.detach().cpu(), "ent": ent.detach().cpu(), "grad": z.grad.cpu()}


def _tp_rank(rank: int) -> dict:
    from miles_k3.model.parallelize import parallelize
    from miles_k3.parallel.config import ParallelConfig
    from miles_k3.parallel.grads import global_grad_norm, reduce_gradients
    from miles_k3.parallel.mesh import init_parallel
    ctx = init_parallel(ParallelConfig(tp=TP), DEVICE_TYPE)
    model = _model()
    parallelize(model, ctx)
    model.to(dist_helpers.test_device(rank))
    out = _run(model, model.vocab_shard)
    params = lora_parameters(model)
    reduce_gradients(params.values(), ctx)
    out["grads"] = {n: p.grad.cpu().clone() for n, p in params.items()}
    out["norm"] = float(global_grad_norm(params.values(), ctx))
    out["vocab"] = (model.vocab_shard.start, model.vocab_shard.end)
    out["kda_heads"] = model.model.layers[1].self_attn.num_heads
    model.zero_grad(set_to_none=True)
    out["engine"] = {d: _tokens_and_logprobs(_engine_outputs(model, d, ctx)) for d in ("eager", "static")}
    from miles_k3.rollout.engine import EngineConfig, RolloutEngine
    engine = RolloutEngine(model, EngineConfig(memory_budget_bytes=2**20, max_context=32, page_size=4), ctx=ctx)
    out["kda_pool_heads"] = engine.kda.recurrent_NHKV[0].shape[1]
    torch.manual_seed(100 + rank)  # the ranks' RNGs differ: the drawn seed must still be one for the group
    out["drawn"] = engine.generate(input_ids=[PROMPTS[0]], sampling_params={"temperature": 1.0,
                                                                            "max_new_tokens": 4})[0]["output_ids"]
    z, tokens = _leaf_logits()
    start, end = out["vocab"]
    device = dist_helpers.test_device(rank)
    out["losses"] = _losses_alone(z[..., start:end].to(device), tokens.to(device), model.vocab_shard)
    return out


def _rank_slice(full: torch.Tensor, shard: torch.Tensor, rank: int) -> torch.Tensor:
    """This rank's part of `full`, found from the shapes alone: the one dimension where they differ."""
    dims = [d for d in range(full.dim()) if full.shape[d] != shard.shape[d]]
    if not dims:
        return full
    (d,) = dims
    n = shard.shape[d]
    assert full.shape[d] == n * TP
    return full.narrow(d, rank * n, n)


def _split_dim(name: str) -> int | None:
    module = name.rsplit(".", 3)[-3]
    if module in COLUMN and name.endswith("lora_B.weight"):
        return 0
    if module in ROW and name.endswith("lora_A.weight"):
        return 1
    return None


def _assert_lora_grads(ranks: list[dict], ref_grads: dict) -> None:
    """Each rank's reduced gradient is its slice of the single-process one: split adapters (by the layout above)
    have the shard's shape, replicated ones the whole shape."""
    for rank, r in enumerate(ranks):
        assert r["grads"].keys() == ref_grads.keys()
        for name, grad in r["grads"].items():
            full = ref_grads[name]
            split = _split_dim(name)
            want_shape = list(full.shape)
            if split is not None:
                want_shape[split] //= TP
            assert list(grad.shape) == want_shape, name
            scale = full.abs().max().item()
            torch.testing.assert_close(grad, _rank_slice(full, grad, rank), rtol=1e-5, atol=5e-5 * scale)


@pytest.mark.slow
def test_tp2_equals_the_single_process_model():
    ranks = run_ranks(TP, _tp_rank)
    ref_model = _model()
    ref = _run(ref_model)
    ref_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in ref["grads"].values()]))
    ref_engine = {d: _tokens_and_logprobs(_engine_outputs(ref_model, d)) for d in ("eager", "static")}
    z, tokens = _leaf_logits()
    ref_losses = _losses_alone(z, tokens)

    assert [r["vocab"] for r in ranks] == [(0, 256), (256, 512)]
    assert [r["kda_heads"] for r in ranks] == [2, 2] and [r["kda_pool_heads"] for r in ranks] == [2, 2]
    torch.testing.assert_close(torch.cat([r["logits"] for r in ranks], dim=-1), ref["logits"], **TOL)
    for r in ranks:
        for key in ("logp", "ent", "step"):  # every rank holds the whole (replicated) result
            torch.testing.assert_close(r[key], ref[key], **TOL)
        assert r["norm"] == pytest.approx(float(ref_norm), rel=1e-5)
    _assert_lora_grads(ranks, ref["grads"])
    for r in ranks:  # greedy tokens and their log-probs, eager (contiguous states) and static (the pools in place)
        for decode in ("eager", "static"):
            for (tok, lp), (ref_tok, ref_lp) in zip(r["engine"][decode], ref_engine[decode]):
                assert tok == ref_tok
                assert lp == pytest.approx(ref_lp, abs=1e-5)
    assert ranks[0]["drawn"] == ranks[1]["drawn"]
    full_grad = torch.cat([r["losses"]["grad"] for r in ranks], dim=-1)
    torch.testing.assert_close(full_grad, ref_losses["grad"], rtol=1e-9, atol=1e-12)
    for r in ranks:
        for key in ("logp", "ent"):
            torch.testing.assert_close(r["losses"][key], ref_losses[key], rtol=1e-9, atol=1e-12)


# ---- refusals and sizing (one process, no groups: the checks run before any collective) ----------------------
def _ranks_without_groups(tp: int) -> ParallelContext:
    return ParallelContext(world_size=tp, tp_size=tp)


@pytest.mark.parametrize("tp, change, message", [
    (3, {}, (r"parallel.tp: 3 does not divide the model's KDA heads \(linear_attn_config.num_heads\) = 4; "
            r"use a tp among \[1, 2, 4\]")),
    (2, {"vocab_size": 511}, r"parallel.tp: 2 does not divide the model's vocab_size = 511"),
    (4, {"intermediate_size": 390}, r"parallel.tp: 4 does not divide the model's dense MLP width"),
])
def test_a_tp_that_does_not_divide_a_split_dimension_is_refused(tp, change, message):
    from miles_k3.model.parallelize import parallelize
    from miles_k3.model.weight_files import meta_model
    cfg = dataclasses.replace(K3Config.from_name("k3_tiny"), **change)
    model = meta_model(cfg)
    with pytest.raises(ParallelConfigError, match=message):
        parallelize(model, _ranks_without_groups(tp))
    assert model.shard_plan is None and model.lm_head.weight.shape[0] == cfg.vocab_size  # nothing sliced


def test_sharding_a_model_twice_is_refused():
    from miles_k3.model.parallelize import parallelize
    from miles_k3.model.weight_files import meta_model
    model = meta_model(K3Config.from_name("k3_tiny"))
    parallelize(model, _ranks_without_groups(2))
    assert model.lm_head.weight.shape[0] == 256 and model.model.layers[1].self_attn.num_heads == 2
    with pytest.raises(ValueError, match=r"already cut for tp=2, ep=1; parallelize a whole model"):
        parallelize(model, _ranks_without_groups(2))


def test_logits_of_another_shard_are_refused():
    from miles_k3.parallel.comm import VocabShard
    from miles_k3.trainer.logprobs import token_logprobs
    with pytest.raises(ValueError, match=r"logits_BTV: 512 vocabulary rows, but vocab_shard holds rows "
                                         r"\[0, 256\) of 512"):
        token_logprobs(torch.zeros(1, 2, 512), torch.zeros(1, 2, dtype=torch.long), vocab_shard=VocabShard(
            0, 256, 512, None))


def test_kda_pools_hold_one_ranks_heads():
    from miles_k3.rollout.memory import KDAStatePool, slot_bytes
    cfg = K3Config.from_name("k3_tiny")  # 4 KDA heads of 32: per rank of tp=2, 2 heads
    pool = KDAStatePool(cfg, 3, "cpu", torch.float32, tp=2)
    assert pool.recurrent_NHKV[0].shape == (3, 2, 32, 32) and pool.conv_NCW[0].shape == (3, 3 * 2 * 32, 3)
    assert 2 * slot_bytes(cfg, torch.float32, tp=2) == slot_bytes(cfg, torch.float32)
