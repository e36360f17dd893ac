"""Expert parallelism of the routed experts: k3_tiny (fp32, 16 experts, top-4) sharded over spawned gloo ranks
equals the single-process model on the same tokens (the reference, built in the parent with the same seed and
adapters): forward logits, every LoRA gradient after `reduce_gradients` (expert LoRA: the rank's slice), the
global gradient norm, prefill + eager decode (also on the rollout engine's `share_base` twin), MXFP4 experts, a
rank with zero tokens, an owner that receives no rows, the token split over tp, expert replicas (dp=4, ep=2) and
an EP group spanning two TP groups; the rollout engine over an EP group that spans both DP replicas, in lockstep
(uneven calls, a rank with no requests: the greedy samples of one process, and the idle forwards counted by hand). CPU unit tests: refusals, state-dict keys with global expert ids, shard
storage bytes, zero-row gradients, the all-to-all bytes by hand.

Tolerances, relative to each tensor's scale (`_assert_close`): one MoE layer on the same inputs 1e-5 (seen:
<= 6e-7; the sharded layer groups each expert's rows from several ranks into one matmul); end to end 5e-4, as
test_lora's LOGIT_TOL (seen: <= 6e-5 logits, decode and gradients with bf16-format experts, <= 2e-4 gradients
with MXFP4 experts): the 8 layers of random k3_tiny amplify that last-bit regrouping ~100x.
"""
import contextlib
import copy
import os

import dist_helpers
import pytest
import torch
from dist_helpers import DEVICE_TYPE, run_ranks
from lora_helpers import ALL_TARGETS, ids, randomize_adapters, tiny

from miles_k3.model.experts import sync_free_experts
from miles_k3.model.lora import LoRAConfig, apply_lora, lora_parameters
from miles_k3.model.moe import LatentMoE
from miles_k3.parallel.config import ParallelConfig, ParallelConfigError
from miles_k3.parallel.mesh import ParallelContext

LAYER_TOL = 1e-5  # one MoE layer on the same inputs
MODEL_TOL = 5e-4  # end to end, as test_lora's LOGIT_TOL: 8 layers amplify the regrouped roundoff ~100x
TARGETS = [*ALL_TARGETS, "routed_expert_down_proj", "routed_expert_up_proj"]
NUM_EXPERTS = 16  # k3_tiny
DECODE_STEPS = 3


def _model(expert_format="bf16", far_bias=False):
    """k3_tiny fp32 with LoRA on every target (experts and the routed latent projections too) and non-zero
    random adapters. `far_bias`: a selection bias that routes every token to experts 8..15 only."""
    model = tiny(expert_format)
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets=TARGETS))
    randomize_adapters(model)
    if far_bias:
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, LatentMoE):
                    m.gate.e_score_correction_bias[NUM_EXPERTS // 2:] = 10.0
    return model


def _loss(logits_BTV, ids_BT):
    """Summed next-token NLL: the global loss is the sum of the ranks' losses."""
    logp = logits_BTV[:, :-1].log_softmax(-1)
    return -logp.gather(-1, ids_BT[:, 1:, None]).sum()


def _tokens(rank):
    """Different tokens (and shapes) on every rank."""
    return ids(1 + rank % 2, 5 + rank, seed=100 + rank)


def _grads(model):
    return {n: p.grad.cpu().clone() for n, p in lora_parameters(model).items()}


def _device(model):
    return model.lm_head.weight.device


def _train_step(model, tokens, ctx):
    from miles_k3.parallel.grads import global_grad_norm, reduce_gradients
    params = list(lora_parameters(model).values())
    for p in params:
        p.grad = None
    tokens = tokens.to(_device(model))
    logits = model(tokens).logits
    shard = model.vocab_shard
    if shard is not None:  # tensor-parallel dense layers: the whole vocabulary (gradient: this rank's slice)
        from miles_k3.parallel.comm import gather_from
        logits = gather_from(logits, shard.group, -1, shard.size)
    _loss(logits, tokens).backward()
    reduce_gradients(params, ctx)
    return logits.detach().cpu(), _grads(model), float(global_grad_norm(params, ctx))


def _decode(model, tokens):
    """Engine-style: prefill all but the last DECODE_STEPS tokens, then one eager `step` per remaining token."""
    tokens = tokens.to(_device(model))
    with torch.no_grad():
        out = model(tokens[:, :-DECODE_STEPS], return_state=True)
        logits = [out.logits[:, -1]]
        for t in range(tokens.shape[1] - DECODE_STEPS, tokens.shape[1]):
            out = model.step(tokens[:, t], out.state)
            logits.append(out.logits)
    return [t.cpu() for t in logits]


def _sharded(ctx, rank, **kw):
    """The full model built as in one process (same seed), cut to the rank's shard by `parallelize` (experts over
    ep, and under tp > 1 the dense layers over tp too), then moved to the rank's test device."""
    from miles_k3.model.parallelize import parallelize
    model = _model(**kw)
    parallelize(model, ctx)
    return model.to(dist_helpers.test_device(rank))


def _engine_twin(model, ctx):
    """The rollout engine's view of a sharded model: `share_base` (its base tensors, the twin planned for the same
    ctx), then its own adapters (sized for the held experts), given the model's values."""
    from miles_k3.rollout.adapters import share_base
    twin = share_base(model, ctx)
    apply_lora(twin, LoRAConfig(rank=4, alpha=8.0, targets=TARGETS))
    source = lora_parameters(model)
    with torch.no_grad():
        for name, p in lora_parameters(twin).items():
            p.copy_(source[name])  # shapes agree: the twin's expert LoRA holds this rank's experts only
    return twin


# Engine calls of the lockstep test (dp=2, ep=2: the EP group spans both replicas): per call, each rank's
# (prompt length, max_new_tokens) requests; a rank with none still calls generate. The forwards each rank makes,
# by hand (one prefill forward for a call's prompts, one decode forward per new token of its longest request):
# call 1: rank 0 7 (1 + 6), rank 1 none; call 2: rank 0 none, rank 1 4 (1 + 3); call 3: 3 (1 + 2) and 5 (1 + 4).
ENGINE_CALLS = [[[(5, 6), (3, 2)], []], [[], [(4, 3)]], [[(2, 2)], [(6, 4)]]]
IDLE_FORWARDS = [[0, 7], [4, 0], [2, 0]]  # per call, per rank: the other rank's forwards beyond its own


def _engine_prompts(requests, seed):
    return [ids(1, n, seed=seed + i)[0].tolist() for i, (n, _) in enumerate(requests)]


def _engine_outputs(engine, requests, seed, lora="policy"):
    """Greedy samples of `requests` (with the engine's log-probs), through the public generate."""
    params = [{"temperature": 0.0, "max_new_tokens": m} for _, m in requests]
    outs = engine.generate(input_ids=_engine_prompts(requests, seed), sampling_params=params, lora=lora)
    return [(o["output_ids"], [lp for lp, _ in o["meta_info"]["output_token_logprobs"]]) for o in outs]


def _engine(model, ctx=None):
    from miles_k3.parallel.mesh import SINGLE
    from miles_k3.rollout.engine import EngineConfig, RolloutEngine
    engine = RolloutEngine(model, EngineConfig(memory_budget_bytes=2 * 2**20, max_context=32, page_size=4),
                           lora=LoRAConfig(rank=4, alpha=8.0, targets=TARGETS), ctx=ctx or SINGLE)
    engine.load_lora_adapter_from_tensors("policy", {n: p.detach() for n, p in lora_parameters(model).items()},
                                          LoRAConfig(rank=4, alpha=8.0, targets=TARGETS))
    return engine


def _lockstep_engine(model, ctx, rank):
    """Every call of ENGINE_CALLS on this rank's engine: its outputs and the idle forwards it ran."""
    engine, out = _engine(model, ctx), []
    for k, call in enumerate(ENGINE_CALLS):
        before = engine.lockstep.idle_forwards
        got = _engine_outputs(engine, call[rank], seed=10 * k + 100 * rank)
        out.append((got, engine.lockstep.idle_forwards - before))
    try:  # both busy at once, serving different adapters: the rows of one would meet the other's expert LoRA
        _engine_outputs(engine, [(3, 2)], seed=7, lora="policy" if rank == 0 else None)
        out.append("no error")
    except RuntimeError as err:
        out.append(str(err))
    return out


# The trainer in lockstep (dp=2, ep=2): rank 0 holds 3 samples, rank 1 one; with micro_batch_tokens=8 each sample
# is a micro-batch of its own (8 or fewer positions), so rank 1 runs 2 idle micro-steps beside rank 0's last two.
# (prompt length, response length, advantage) per rank; a group per rank.
TRAIN_SAMPLES = [[(5, 4, 0.7), (3, 6, -0.7), (4, 2, 0.3)], [(6, 3, -0.3)]]


def _lockstep_trainer_cfg():
    from miles_k3.trainer.losses import LossConfig
    from miles_k3.trainer.optim import OptimConfig
    from miles_k3.trainer.step import TrainerConfig
    return TrainerConfig(micro_batch_tokens=8, activation_checkpointing=True, loss=LossConfig(kl_coef=0.1),
                         optim=OptimConfig(lr=0.01, eps=1e-3))


def _train_samples(rank, nan=False):
    from miles_k3.trainer.batch import Sample
    out = []
    for i, (p, r, adv) in enumerate(TRAIN_SAMPLES[rank]):
        seq = ids(1, p + r, seed=300 + 10 * rank + i)[0].tolist()
        out.append(Sample(seq[:p], seq[p:], advantage=float("nan") if nan else adv, group=rank))
    return out


def _lockstep_train(model, ctx, rank):
    """One train_step of this rank's samples, then one whose rank-1 sample has a NaN advantage (skipped on every
    rank): the adapter after each and the step's metrics."""
    from miles_k3.trainer.optim import build_optimizer, build_scheduler
    from miles_k3.trainer.step import train_step
    cfg, params = _lockstep_trainer_cfg(), lora_parameters(model)
    opt = build_optimizer(params, cfg.optim)
    sched = build_scheduler(opt, cfg.optim)
    out = []
    for nan in (False, True):
        metrics = train_step(model, _train_samples(rank, nan=nan and rank == 1), cfg, opt, sched, params, 0,
                             _device(model), ctx=ctx)
        out.append(({n: p.detach().cpu().clone() for n, p in params.items()}, metrics["train/skipped"]))
    return out


def _random_routes(tokens, seed):
    """Distinct random experts for every token of `tokens` in each of k3_tiny's 8 MoE layers: [N, 8, 4]."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(tokens.numel(), 8, NUM_EXPERTS, generator=g).argsort(-1)[..., :4].to(torch.int16)


def _routed(model, tokens, seed):
    """(logits replaying random routes, the model's own recorded routes of a plain forward) over `tokens`."""
    from miles_k3.model.routing import recording, replaying
    tokens = tokens.to(_device(model))
    with torch.no_grad():
        with replaying(model, _random_routes(tokens, seed)):
            logits = model(tokens).logits
        shard = model.vocab_shard
        if shard is not None:
            from miles_k3.parallel.comm import gather_from
            logits = gather_from(logits, shard.group, -1, shard.size)
        with recording(model) as rec:
            model(tokens)
    return logits.cpu(), rec.routes().cpu()


def _moe_zero_tokens(model, ctx, rank, empty_ranks):
    """One LatentMoE on its own; the ranks in `empty_ranks` feed zero tokens."""
    from miles_k3.parallel.grads import reduce_gradients
    moe = model.model.layers[1].block_sparse_moe
    params = [p for p in moe.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    y = moe(_moe_input(rank, empty_ranks).to(_device(model)))
    (y * y).sum().backward()
    reduce_gradients(params, ctx)
    return y.detach().cpu(), {n: p.grad.cpu().clone() for n, p in moe.named_parameters() if p.requires_grad}


def _moe_input(rank, empty_ranks):
    return torch.randn(0 if rank in empty_ranks else 3 + rank, 128, generator=torch.Generator().manual_seed(rank))


def _ranks_world2(rank):
    from miles_k3.parallel.mesh import build_context, init_parallel
    ctx = init_parallel(ParallelConfig(dp=2, ep=2), DEVICE_TYPE)
    out = {}
    model = _sharded(ctx, rank)
    out["train"] = _train_step(model, _tokens(rank), ctx)
    out["decode"] = _decode(model, _tokens(rank))
    out["twin_decode"] = _decode(_engine_twin(model, ctx), _tokens(rank))
    out["moe_zero"] = _moe_zero_tokens(model, ctx, rank, empty_ranks={1})
    with sync_free_experts():
        try:
            model(_tokens(rank).to(_device(model)))
            out["sync_free"] = "no error"
        except RuntimeError as err:
            out["sync_free"] = str(err)
    out["lockstep_engine"] = _lockstep_engine(model, ctx, rank)
    out["routed"] = _routed(model, _tokens(rank), seed=rank)
    out["lockstep_train"] = _lockstep_train(_sharded(ctx, rank), ctx, rank)
    out["far"] = _train_step(_sharded(ctx, rank, far_bias=True), _tokens(rank), ctx)  # rank 0 receives no rows
    out["mxfp4"] = _train_step(_sharded(ctx, rank, expert_format="mxfp4"), _tokens(rank), ctx)
    # tp = 2: tokens split over tp, EP group = TP group, the dense layers tensor-parallel
    ctx_tp = build_context(ParallelConfig(tp=2, ep=2), rank, 2, DEVICE_TYPE)
    both = _sharded(ctx_tp, rank)
    out["tp_dense"] = _train_step(both, _tokens(0), ctx_tp)
    out["tp_routed"] = _routed(both, _tokens(0), seed=0)  # the MoE input split over tp: ids split and gathered
    from miles_k3.parallel.grads import whole  # the unsharded adapter (what the PEFT export writes)
    out["whole"] = {n: whole(p, ctx_tp).cpu() for n, p in lora_parameters(both).items()}
    return out


def _ranks_world4(rank):
    from miles_k3.parallel.mesh import build_context, init_parallel
    ctx = init_parallel(ParallelConfig(dp=4, ep=2), DEVICE_TYPE)  # expert replica groups {0, 2} and {1, 3}
    model = _sharded(ctx, rank)
    out = {"train": _train_step(model, _tokens(rank), ctx),
           "moe_zero": _moe_zero_tokens(model, ctx, rank, empty_ranks={2, 3})}  # rank 2 gets no rows, rank 0 does
    ctx4 = build_context(ParallelConfig(dp=2, tp=2, ep=4), rank, 4, DEVICE_TYPE)  # one EP group, both TP groups
    out["ep4"] = _train_step(_sharded(ctx4, rank), _tokens(rank // 2), ctx4)
    return out


# ---- references: the single-process model on the same tokens --------------------------------------------
@contextlib.contextmanager
def _one_thread():
    """The ranks' thread count, so the dense layers take the same BLAS paths as theirs."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _assert_close(got, want, tol, msg=""):
    """|got - want| <= tol * (|want| + max |want|): relative to the tensor's scale (a gradient's small entries
    carry the absolute roundoff of its large ones). EP_TEST_REPORT=1 prints the error seen."""
    scale = want.abs().max().item() if want.numel() else 0.0
    if os.environ.get("EP_TEST_REPORT"):
        err = (got - want).abs().max().item() / max(scale, 1e-30) if want.numel() else 0.0
        print(f"[ep tol] {msg}: max |d| / max |ref| = {err:.2e}")
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * max(scale, 1e-30), msg=msg)


@_one_thread()
def _reference_step(token_sets, **kw):
    """Logits of each token set, the LoRA gradients of the summed loss, and their norm (one process)."""
    model = _model(**kw)
    logits = []
    for tokens in token_sets:
        out = model(tokens).logits
        _loss(out, tokens).backward()
        logits.append(out.detach())
    grads = _grads(model)
    norm = float(torch.sqrt(sum(g.pow(2).sum() for g in grads.values())))
    return logits, grads, norm


def _expert_slice(name, full, ep_rank, ep, tp_rank=0, shape=None):
    """The part of the reference gradient `full` that rank holds: expert LoRA its ep slice (dim 0); a tensor of
    a tensor-parallel layer (`shape` differs from full's) its tp slice along the dimension that differs."""
    if ".experts.lora." in name:
        per = full.shape[0] // ep
        return full[ep_rank * per: (ep_rank + 1) * per]
    for dim, (n, m) in enumerate(zip(shape or full.shape, full.shape)):
        if n != m:
            return full.narrow(dim, tp_rank * n, n)
    return full


def _check_step(case, results, token_of_rank, ep, tp=1, **kw):
    """Every rank's logits equal the reference on its tokens, its gradients the reference's (its expert slice; its
    tp slice of tensor-parallel layers), its global gradient norm the reference's."""
    sets = sorted(set(token_of_rank))
    ref_logits, ref_grads, ref_norm = _reference_step([_tokens(s) for s in sets], **kw)
    for rank, (logits, grads, norm) in enumerate(results):
        want = ref_logits[sets.index(token_of_rank[rank])]
        _assert_close(logits, want, MODEL_TOL, f"{case}: rank {rank} logits")
        assert grads.keys() == ref_grads.keys()
        for name, g in grads.items():
            _assert_close(g, _expert_slice(name, ref_grads[name], rank % ep, ep, rank % tp, g.shape), MODEL_TOL,
                          f"{case}: rank {rank} {name}")
        assert norm == pytest.approx(ref_norm, rel=MODEL_TOL)


@_one_thread()
def _check_moe_zero(results, ep, empty_ranks):
    model = _model()
    moe = model.model.layers[1].block_sparse_moe
    for rank, (y, _) in enumerate(results):
        ref_y = moe(_moe_input(rank, empty_ranks))
        (ref_y * ref_y).sum().backward()
        _assert_close(y, ref_y.detach(), LAYER_TOL, f"rank {rank} moe output")
    ref = {n: p.grad for n, p in moe.named_parameters() if p.requires_grad}
    for rank, (_, grads) in enumerate(results):
        assert grads.keys() == ref.keys()
        for name, g in grads.items():
            full = ref[name]
            if name.startswith("experts.lora."):
                per = full.shape[0] // ep
                full = full[rank % ep * per: (rank % ep + 1) * per]
            _assert_close(g, full, LAYER_TOL, f"rank {rank} moe {name}")


@_one_thread()
def _check_lockstep_train(results):
    """Every rank's adapter after the step equals the one-process step over all 4 samples (its expert slice); the
    NaN step is skipped on both ranks and changes nothing."""
    from miles_k3.trainer.optim import build_optimizer, build_scheduler
    from miles_k3.trainer.step import train_step
    model, cfg = _model(), _lockstep_trainer_cfg()
    params = lora_parameters(model)
    before = {n: p.detach().clone() for n, p in params.items()}
    opt = build_optimizer(params, cfg.optim)
    train_step(model, _train_samples(0) + _train_samples(1), cfg, opt, build_scheduler(opt, cfg.optim), params, 0,
               torch.device("cpu"))
    for rank, ((after, skipped), (after_nan, skipped_nan)) in enumerate(results):
        assert skipped == 0.0 and skipped_nan == 1.0
        for name, got in after.items():
            want = _expert_slice(name, params[name].detach(), rank, 2)
            start = _expert_slice(name, before[name], rank, 2)
            # the update itself (AdamW's first step: about lr per element) to the one-process update's
            assert (got - want).norm() <= 1e-3 * (want - start).norm() + 1e-7, name
            assert torch.equal(after_nan[name], got), name


@pytest.mark.slow
def test_dp2_ep2_equals_one_process():
    results = run_ranks(2, _ranks_world2)
    _check_step("dp2 ep2", [r["train"] for r in results], [0, 1], ep=2)
    ref = _model()
    for rank, r in enumerate(results):
        with _one_thread():
            want = _decode(ref, _tokens(rank))
        for step, (got, twin, w) in enumerate(zip(r["decode"], r["twin_decode"], want, strict=True)):
            _assert_close(got, w, MODEL_TOL, f"rank {rank} decode {step}")
            _assert_close(twin, w, MODEL_TOL, f"rank {rank} engine twin decode {step}")
        assert "parallel.ep=2" in r["sync_free"] and "decode eagerly" in r["sync_free"], r["sync_free"]
    _check_moe_zero([r["moe_zero"] for r in results], ep=2, empty_ranks={1})
    with _one_thread():  # the engine over the whole model, each rank's calls in turn
        engine = _engine(_model())
        want = [[_engine_outputs(engine, call[rank], seed=10 * k + 100 * rank) for rank in range(2)]
                for k, call in enumerate(ENGINE_CALLS)]
    for k in range(len(ENGINE_CALLS)):
        for rank, r in enumerate(results):
            got, idle = r["lockstep_engine"][k]
            assert idle == IDLE_FORWARDS[k][rank], (k, rank)
            assert len(got) == len(want[k][rank])
            for (tokens, logps), (want_tokens, want_logps) in zip(got, want[k][rank]):
                assert tokens == want_tokens, (k, rank)
                assert logps == pytest.approx(want_logps, abs=MODEL_TOL), (k, rank)
    for r in results:
        assert "serving different LoRA adapters in one forward (adapter numbers 0 and 1)" in r["lockstep_engine"][-1]
    _check_lockstep_train([r["lockstep_train"] for r in results])
    with _one_thread():  # routing replay and recording, sharded (dp2 x ep2; tp2 x ep2) = one process
        full = _model()
        for key, token_of_rank in (("routed", [0, 1]), ("tp_routed", [0, 0])):
            for rank, r in enumerate(results):
                t = token_of_rank[rank]
                want_logits, want_routes = _routed(full, _tokens(t), seed=t)
                got_logits, got_routes = r[key]
                _assert_close(got_logits, want_logits, MODEL_TOL, f"{key}: rank {rank} replayed logits")
                assert torch.equal(got_routes, want_routes), (key, rank)
    _check_step("no rows", [r["far"] for r in results], [0, 1], ep=2, far_bias=True)
    far = results[0]["far"][1]  # rank 0 holds experts 0..7, which no token chose: zero gradients, not missing
    assert all(not g.any() for n, g in far.items() if ".experts.lora." in n and "lora_B" in n)
    _check_step("mxfp4", [r["mxfp4"] for r in results], [0, 1], ep=2, expert_format="mxfp4")
    # tp = 2: both ranks feed the same tokens and hold the loss of those tokens once
    _check_step("tp2 ep2, dense layers tensor-parallel", [r["tp_dense"] for r in results], [0, 0], ep=2, tp=2)
    full = lora_parameters(_model())  # TP halves and expert slices gathered back: the one-process adapter exactly
    for r in results:
        assert r["whole"].keys() == full.keys()
        for name, t in full.items():
            assert torch.equal(r["whole"][name], t.detach()), name


@pytest.mark.slow
def test_dp4_ep2_expert_replicas_and_ep4_over_tp_groups():
    results = run_ranks(4, _ranks_world4)
    _check_step("dp4 ep2", [r["train"] for r in results], [0, 1, 2, 3], ep=2)
    _check_moe_zero([r["moe_zero"] for r in results], ep=2, empty_ranks={2, 3})
    _check_step("dp2 tp2 ep4, dense layers tensor-parallel", [r["ep4"] for r in results], [0, 0, 1, 1], ep=4, tp=2)


# ---- one process --------------------------------------------------------------------------------------
def _fake_ctx(ep_rank, ep_size):
    """A context that places the experts (no groups: storage and state-dict checks only, no forward)."""
    return ParallelContext(rank=ep_rank, world_size=ep_size, dp_size=ep_size, ep_rank=ep_rank, ep_size=ep_size)


def test_ep_that_does_not_divide_the_experts_and_sharding_twice_are_refused():
    from miles_k3.model.parallelize import parallelize
    model = _model()
    with pytest.raises(ParallelConfigError, match=r"parallel.ep: 3 does not divide the model's num_experts = 16; "
                                                  r"use an ep among \[1, 2, 4, 8, 16\]"):
        parallelize(model, _fake_ctx(0, 3))
    parallelize(model, _fake_ctx(1, 2))
    with pytest.raises(ValueError, match=r"already cut for tp=1, ep=2; parallelize a whole model"):
        parallelize(model, _fake_ctx(1, 2))


@pytest.mark.parametrize("expert_format", ["bf16", "mxfp4"])
def test_a_shard_keeps_its_slice_of_the_storage_under_global_expert_ids(expert_format):
    from miles_k3.model.parallelize import parallelize
    full = _model(expert_format)
    shard = copy.deepcopy(full)
    parallelize(shard, _fake_ctx(1, 4))  # experts 4..7
    full_sd, shard_sd = full.state_dict(), shard.state_dict()
    prefix = "model.layers.1.block_sparse_moe.experts."
    held = sorted({int(k[len(prefix):].split(".")[0]) for k in shard_sd if k.startswith(prefix)
                   and k[len(prefix)].isdigit()})
    assert held == [4, 5, 6, 7]
    for key, t in shard_sd.items():  # same bytes under the same (global) key; expert LoRA is stacked (below)
        if ".experts.lora." not in key:
            torch.testing.assert_close(t, full_sd[key], rtol=0, atol=0)
    experts, whole = shard.model.layers[1].block_sparse_moe.experts, full.model.layers[1].block_sparse_moe.experts
    names = ["w1", "w2", "w3"] if expert_format == "bf16" else [f"w{i}_{k}" for i in (1, 2, 3)
                                                              for k in ("packed", "scale")]
    for name in names:  # native storage, and only the slice of it is kept alive
        t, w = getattr(experts, name), getattr(whole, name)
        assert t.dtype == w.dtype == (torch.float32 if expert_format == "bf16" else torch.uint8)
        assert t.untyped_storage().nbytes() == w[4:8].numel() * w.element_size() == w.untyped_storage().nbytes() // 4
    lora = experts.lora["w1"]
    torch.testing.assert_close(lora.lora_A, whole.lora["w1"].lora_A[4:8], rtol=0, atol=0)
    assert lora.lora_B.requires_grad and lora.lora_B.untyped_storage().nbytes() == lora.lora_B.numel() * 4


def test_loading_a_shard_checks_the_expert_ids():
    from miles_k3.model.parallelize import parallelize
    rank1, again, rank0 = _model(), _model(), _model()
    for m, r in ((rank1, 1), (again, 1), (rank0, 0)):
        parallelize(m, _fake_ctx(r, 2))
    again.load_state_dict(rank1.state_dict())  # the same ep rank's shard loads
    with pytest.raises(RuntimeError, match=r"experts\.8\.w1\.weight \(and \d+ more\): experts this module does "
                                           r"not hold: it holds experts 0\.\.7 of 16 \(a parallel.ep shard\)"):
        rank0.load_state_dict(rank1.state_dict())
    base = {k: v for k, v in _model().state_dict().items() if "lora" not in k}
    with pytest.raises(RuntimeError, match=r"experts\.8\.w1\.weight .* load into a model not cut by parallelize"):
        rank0.load_state_dict(base, strict=False)  # a full model's experts: refused too, not silently sliced


def test_sync_free_decode_refuses_expert_parallel_dispatch():
    from miles_k3.model.expert_parallel import ExpertParallel
    experts = _model().model.layers[1].block_sparse_moe.experts
    ep = ExpertParallel(tp_group=None, ep_group=object(), ep_size=2)  # refused before any collective
    with sync_free_experts(), pytest.raises(RuntimeError, match=r"parallel.ep=2.*CUDA-graph.*decode eagerly"):
        ep.run_experts(experts, torch.zeros(2, 64), torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4))


def test_an_expert_shard_that_gets_no_rows_has_zero_lora_gradients():
    """Not None: its expert-replica peers all-reduce the same gradient tensors (sizes must agree)."""
    experts = _model().model.layers[1].block_sparse_moe.experts
    experts.grouped_glu(torch.zeros(0, 64, requires_grad=True), [0] * NUM_EXPERTS).sum().backward()
    for name in ("w1", "w2", "w3"):
        for p in (experts.lora[name].lora_A, experts.lora[name].lora_B):
            assert p.grad is not None and p.grad.shape == p.shape and not p.grad.any()


def test_alltoall_bytes_per_token_by_hand():
    from miles_k3.model.config import K3Config
    from miles_k3.model.expert_parallel import alltoall_bytes_per_token
    # k3_tiny: 4 experts per token, latent width 64. bf16: 4 rows x 64 x 2 B = 512 B each way.
    got = alltoall_bytes_per_token(K3Config.from_name("k3_tiny"), 2)
    assert got == {"dispatch": 512, "combine": 512, "forward": 1024, "backward": 1024}
    # K3: 16 x 3584 x 2 B = 114,688 B each way, 229,376 B forward per token per MoE layer.
    assert alltoall_bytes_per_token(K3Config.from_name("k3"), 2)["forward"] == 229_376
