"""One policy update (`miles_k3.trainer.step.train_step`) on k3_tiny with LoRA: the adapter moves and the base
does not, micro-batching changes neither the update nor any metric, a non-finite loss skips it and a step with
nothing to train on is empty (not skipped), masked samples take no part, the no-grad forwards run without
dropout, the KL reference is the adapter-off base, and the trainer's log-probs of engine rollouts match the
engine's own.

Hand-worked values use `_samples()`: six samples with n_i = 2 + i response tokens (N = 27) and advantages
A = -0.5, 0.6, -0.7, 0.8, -0.9, 1.0; `DELTAS` are per-sample log-prob offsets given to the engine's log-probs."""
import math

import pytest
import torch
from engine_helpers import small_engine

from miles_k3.model import K3Config, K3ForCausalLM
from miles_k3.model.lora import LoRAConfig, apply_lora, lora_parameters, lora_state_dict
from miles_k3.trainer.batch import Sample
from miles_k3.trainer.logprobs import token_logprobs
from miles_k3.trainer.losses import LossConfig
from miles_k3.trainer.optim import BadStepGuard, OptimConfig, build_optimizer, build_scheduler
from miles_k3.trainer.step import TrainerConfig, fill_old_logprobs, sequence_logprobs, train_step

LORA = LoRAConfig(rank=4, alpha=8.0)
CPU = torch.device("cpu")
DELTAS = [0.1, -0.3, -0.3, 0.2, -0.02, 0.3]  # sample i's engine log-probs: the trainer's - DELTAS[i], every token


def _policy(seed=0, dropout=0.0, lr=1e-2):
    torch.manual_seed(seed)
    model = K3ForCausalLM(K3Config.from_name("k3_tiny"), expert_format="mxfp4")
    model.requires_grad_(False)
    apply_lora(model, LoRAConfig(rank=LORA.rank, alpha=LORA.alpha, dropout=dropout))
    with torch.no_grad():  # B != 0 so that A gets gradients too, and the adapter already differs from the base
        for n, p in lora_parameters(model).items():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    params = lora_parameters(model)
    opt = build_optimizer(params, OptimConfig(lr=lr, grad_clip=0.0))
    return model, params, opt, build_scheduler(opt, OptimConfig(lr=lr))


def _with_engine_logprobs(model, samples, deltas=DELTAS):
    """`samples` with engine log-probs: `model`'s own log-prob of each response token minus deltas[i]."""
    for s, d in zip(samples, deltas, strict=True):
        own = sequence_logprobs(model, s.prompt_ids + s.response_ids)[len(s.prompt_ids) - 1:]
        s.rollout_logprobs = [lp - d for lp in own]
    return samples


def _capture_grads(monkeypatch):
    """The adapter gradients of every optimizer update train_step makes, in order."""
    import miles_k3.trainer.step as step_mod

    grads = []
    real = step_mod.optimizer_step
    monkeypatch.setattr(step_mod, "optimizer_step", lambda opt, sched, params, cfg, **kw: grads.append(
        {n: p.grad.clone() for n, p in params.items()}) or real(opt, sched, params, cfg, **kw))
    return grads


def _samples():
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(6):
        prompt = torch.randint(1, 250, (3 + i % 3,), generator=g).tolist()
        resp = torch.randint(1, 250, (2 + i,), generator=g).tolist()
        out.append(Sample(prompt, resp, advantage=(1.0 if i % 2 else -1.0) * (0.5 + i / 10)))
    return out


def _step(cfg, samples=None, seed=0):
    model, params, opt, sched = _policy(seed)
    base = {n: t.clone() for n, t in model.state_dict().items() if "lora_" not in n}
    before = {n: t.clone() for n, t in lora_state_dict(model).items()}
    m = train_step(model, samples or _samples(), cfg, opt, sched, params, pad_id=0, device=torch.device("cpu"))
    return model, base, before, m


def test_update_moves_only_the_adapter_and_micro_batching_does_not_change_it(monkeypatch):
    grads = _capture_grads(monkeypatch)
    whole, base, before, m = _step(TrainerConfig(micro_batch_tokens=10_000))
    assert m["train/skipped"] == 0.0 and m["train/num_tokens"] == sum(2 + i for i in range(6))
    after = lora_state_dict(whole)
    assert all(not torch.equal(after[n], before[n]) for n in after)  # every adapter tensor moved
    assert all(torch.equal(t, base[n]) for n, t in whole.state_dict().items() if "lora_" not in n)
    _, _, _, m2 = _step(TrainerConfig(micro_batch_tokens=12))  # one or two samples per micro-batch
    assert len(grads) == 2
    for n, g in grads[0].items():  # the same gradient, up to fp32 summation order (observed <= 2e-6)
        assert (grads[1][n] - g).norm() <= 1e-5 * g.norm(), n
    # (the updated tensors are not compared element-wise: Adam's first step is lr * g / (|g| + eps), which turns
    # rounding noise in a near-zero gradient into an O(lr) difference)
    assert m2["train/loss"] == pytest.approx(m["train/loss"], rel=1e-5)


def test_non_finite_loss_skips_the_update():
    samples = _samples()
    samples[3].advantage = float("nan")
    model, _, before, m = _step(TrainerConfig(), samples)
    assert (m["train/skipped"], m["train/empty_step"], m["train/updates"]) == (1.0, 0.0, 0.0)
    assert all(torch.equal(t, before[n]) for n, t in lora_state_dict(model).items())
    assert all(p.grad is None for p in lora_parameters(model).values())


def test_kl_reference_is_the_adapter_off_base():
    cfg = TrainerConfig(loss=LossConfig(kl_coef=0.1))
    _, _, _, m = _step(cfg)
    assert m["train/kl"] > 0  # the adapter (B != 0) differs from the base
    model, params, opt, sched = _policy()
    with torch.no_grad():
        for n, p in params.items():
            if "lora_B" in n:
                p.zero_()  # adapter == base: the k3 KL is exactly 0
    m0 = train_step(model, _samples(), cfg, opt, sched, params, 0, torch.device("cpu"))
    assert m0["train/kl"] == pytest.approx(0.0, abs=1e-7)


def test_trainer_logprobs_match_the_engines_rollout_logprobs():
    from miles_k3.rollout.engine import EngineConfig

    model, params, opt, sched = _policy()
    engine = small_engine(model, LORA, memory_budget_bytes=8 * 2**20, page_size=EngineConfig.page_size,
                          prefill_chunk=EngineConfig.prefill_chunk)  # EngineConfig's pages and chunks
    engine.load_lora_adapter_from_tensors("policy", lora_state_dict(model), LORA)
    prompts = [[5, 6, 7, 8], [9, 10]]
    outs = engine.generate(input_ids=prompts, sampling_params={"temperature": 0.7, "max_new_tokens": 6,
                                                               "sampling_seed": 3}, n=2, lora="policy")
    samples = [Sample(prompts[i // 2], o["output_ids"], [lp for lp, _ in o["meta_info"]["output_token_logprobs"]],
                      advantage=1.0) for i, o in enumerate(outs)]
    m = train_step(model, samples, TrainerConfig(), opt, sched, params, 0, torch.device("cpu"), temperature=0.7)
    assert m["train/rollout_logprob_abs_diff"] < 1e-5  # same fp32 math: chunked prefill + steps vs one forward
    model, params, opt, sched = _policy()  # the same policy scored at the wrong temperature: a visible gap
    m1 = train_step(model, samples, TrainerConfig(), opt, sched, params, 0, torch.device("cpu"), temperature=1.0)
    assert m1["train/rollout_logprob_abs_diff"] > 100 * max(m["train/rollout_logprob_abs_diff"], 1e-7)


def _saved_bytes_and_grads(checkpointing: bool, dropout: float):
    """(bytes autograd saved for backward in one forward, LoRA gradients) of a k3_tiny forward+backward."""
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.from_name("k3_tiny"), expert_format="mxfp4")
    model.requires_grad_(False)
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, dropout=dropout))
    with torch.no_grad():
        for n, p in lora_parameters(model).items():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    model.activation_checkpointing = checkpointing
    ids = torch.randint(1, 250, (3, 24), generator=torch.Generator().manual_seed(2))
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    torch.manual_seed(5)  # the dropout masks
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(ids, seq_lens=torch.tensor([24, 17, 9])).logits
    forward_saved = sum(saved)
    logits.float().log_softmax(-1)[..., 7].sum().backward()
    return forward_saved, {n: p.grad.clone() for n, p in lora_parameters(model).items()}


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_activation_checkpointing_keeps_gradients_and_saves_less(dropout):
    plain_bytes, plain = _saved_bytes_and_grads(False, dropout)
    ckpt_bytes, ckpt = _saved_bytes_and_grads(True, dropout)
    assert plain.keys() == ckpt.keys() and all(g.abs().sum() > 0 for g in plain.values())
    for n in plain:  # recomputation replays the same ops and the same dropout masks (RNG state restored)
        torch.testing.assert_close(ckpt[n], plain[n], rtol=1e-5, atol=1e-7, msg=n)
    assert ckpt_bytes < 0.25 * plain_bytes, (ckpt_bytes, plain_bytes)


def test_activation_checkpointing_leaves_inference_alone():
    model, _, _, _ = _policy()
    model.activation_checkpointing = True
    ids = torch.randint(1, 250, (2, 12), generator=torch.Generator().manual_seed(3))
    out = model(ids, return_state=True)  # grad enabled but a state is returned: no recomputation
    model.activation_checkpointing = False
    ref = model(ids, return_state=True)
    assert torch.equal(out.logits, ref.logits)
    assert len(out.state.layers) == len(ref.state.layers) == model.config.num_hidden_layers


def test_train_step_with_activation_checkpointing_matches(monkeypatch):
    from miles_k3.model.k3 import K3DecoderLayer

    calls = []
    real = K3DecoderLayer.forward
    monkeypatch.setattr(K3DecoderLayer, "forward", lambda self, *a: calls.append(self.layer_id) or real(self, *a))
    plain_model, _, _, plain = _step(TrainerConfig(micro_batch_tokens=16))
    plain_calls = len(calls)
    ckpt_model, _, _, ckpt = _step(TrainerConfig(micro_batch_tokens=16, activation_checkpointing=True))
    assert len(calls) - plain_calls == 2 * plain_calls  # every layer ran again in backward
    assert not ckpt_model.activation_checkpointing  # the step's setting does not outlive it
    for k in ("train/loss", "train/grad_norm"):
        assert ckpt[k] == pytest.approx(plain[k], rel=1e-5), k
    for (n, a), b in zip(lora_state_dict(plain_model).items(), lora_state_dict(ckpt_model).values()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7, msg=n)


def _grouped(n_groups=3, per_group=2):
    """_samples() shaped as GRPO groups: consecutive samples share Sample.group."""
    out = _samples()[:n_groups * per_group]
    for i, s in enumerate(out):
        s.group = i // per_group
    return out


def test_split_minibatches_keeps_groups_whole_and_drops_empty_ones():
    from miles_k3.trainer.step import split_minibatches

    samples = _grouped(3)
    parts = split_minibatches(samples, 2)
    assert [[s.group for s in p] for p in parts] == [[0, 0], [1, 1, 2, 2]]
    assert [[s.group for s in p] for p in split_minibatches(samples, 5)] == [[0, 0], [1, 1], [2, 2]]
    assert split_minibatches(samples, 1) == [samples]
    for s in samples[2:4]:
        s.in_loss = False  # group 1 is masked out (overlong=mask): its minibatch would be an empty update
    assert [[s.group for s in p] for p in split_minibatches(samples, 3)] == [[0, 0], [2, 2]]


def test_minibatches_make_one_update_each_against_the_pre_step_policy(monkeypatch):
    grads = _capture_grads(monkeypatch)
    one, _, _, m1 = _step(TrainerConfig(), _grouped())
    assert (m1["train/updates"], m1["train/ratio_max"]) == (1.0, 1.0)  # on-policy: the ratio is exactly 1
    samples = _grouped()
    model, params, opt, sched = _policy()
    m2 = train_step(model, samples, TrainerConfig(minibatches=3), opt, sched, params, 0, torch.device("cpu"))
    assert m2["train/updates"] == 3.0 and len(grads) == 4 and sched.last_epoch == 3  # the schedule counts updates
    assert m2["train/num_tokens"] == m1["train/num_tokens"]
    assert m2["train/ratio_max"] > 1.0 + 1e-4  # updates 2 and 3 see a policy that moved since the rollout
    # the old log-probs are the pre-step policy's: a step with them given as the engine's (old_logprobs=rollout)
    # makes exactly the same updates
    ref = [Sample(s.prompt_ids, s.response_ids, rollout_logprobs=list(s.old_logprobs), advantage=s.advantage,
                  group=s.group) for s in samples]
    model_r, params_r, opt_r, sched_r = _policy()
    m3 = train_step(model_r, ref, TrainerConfig(minibatches=3, old_logprobs="rollout"), opt_r, sched_r, params_r, 0,
                    torch.device("cpu"))
    for k in ("train/loss", "train/pg_loss", "train/ratio_mean", "train/ratio_max", "train/clip_frac",
              "train/grad_norm"):  # the same ratios, hence the same losses (the engine gap: see the next test)
        assert m3[k] == pytest.approx(m2[k], rel=1e-5, abs=1e-7), k
    for (n, a), b in zip(lora_state_dict(model).items(), lora_state_dict(model_r).values()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7, msg=n)
    assert all(not torch.equal(a, b) for a, b in zip(lora_state_dict(model).values(),
                                                     lora_state_dict(one).values()))
    # the first minibatch's update is the on-policy update of its samples alone: the same gradient, up to the
    # rounding of the old log-probs' separate forward (the ratio is 1 +- 1e-7; observed <= 1e-6 relative)
    _step(TrainerConfig(), _grouped()[:2])
    for n, g in grads[1].items():
        assert (grads[-1][n] - g).norm() <= 1e-5 * g.norm(), n


def test_one_non_finite_minibatch_skips_only_its_update():
    samples = _grouped()
    samples[2].advantage = float("nan")  # group 1: the second of three minibatches
    model, params, opt, sched = _policy()
    m = train_step(model, samples, TrainerConfig(minibatches=3), opt, sched, params, 0, torch.device("cpu"))
    assert (m["train/updates"], m["train/skipped"]) == (2.0, 0.0) and sched.last_epoch == 2
    for s in samples:
        s.advantage = float("nan")
    m = train_step(model, samples, TrainerConfig(minibatches=3), opt, sched, params, 0, torch.device("cpu"))
    assert (m["train/updates"], m["train/skipped"]) == (0.0, 1.0) and sched.last_epoch == 2


def test_minibatch_settings_are_checked():
    with pytest.raises(ValueError, match="minibatches: must be an integer >= 1"):
        TrainerConfig(minibatches=0).validate()
    with pytest.raises(ValueError, match="old_logprobs: 'engine' is not one of recompute, rollout"):
        TrainerConfig(old_logprobs="engine").validate()
    model, params, opt, sched = _policy()
    with pytest.raises(ValueError, match="sample 0 has no engine log-probs"):
        train_step(model, _grouped(), TrainerConfig(old_logprobs="rollout"), opt, sched, params, 0,
                   torch.device("cpu"))


# ---- A: a step with nothing to train on -------------------------------------------------------------------
EMPTY = {"train/skipped": 0.0, "train/empty_step": 1.0, "train/num_tokens": 0.0, "train/num_seqs": 0.0,
         "train/updates": 0.0}


@pytest.mark.parametrize("cfg", [TrainerConfig(), TrainerConfig(minibatches=3),
                                 TrainerConfig(old_logprobs="rollout")], ids=["one", "minibatches", "rollout"])
def test_a_step_with_nothing_to_train_on_is_empty_not_skipped(cfg):
    masked = _grouped()
    for s in masked:
        s.in_loss = False  # overlong=mask hit every sample
    model, params, opt, sched = _policy()
    before = {n: t.clone() for n, t in lora_state_dict(model).items()}
    for samples in ([], masked):  # dynamic sampling kept no group: no samples at all
        assert train_step(model, samples, cfg, opt, sched, params, 0, CPU) == EMPTY
    assert sched.last_epoch == 0 and all(torch.equal(t, before[n]) for n, t in lora_state_dict(model).items())
    guard = BadStepGuard(1, max_empty_steps=2)  # the loop's guard: an empty step is no bad step
    guard.record(EMPTY)
    with pytest.raises(RuntimeError, match="^stopping: 2 consecutive steps .*no training signal"):
        guard.record(EMPTY)


def test_a_step_that_trains_is_not_empty():
    _, _, _, m = _step(TrainerConfig(minibatches=3), _grouped())
    assert (m["train/empty_step"], m["train/skipped"], m["train/updates"]) == (0.0, 0.0, 3.0)
    _, _, _, m = _step(TrainerConfig())
    assert (m["train/empty_step"], m["train/skipped"], m["train/updates"]) == (0.0, 0.0, 1.0)


# ---- B: metrics do not depend on micro-batching -------------------------------------------------------------
@pytest.mark.parametrize("micro_batch_tokens", [10_000, 12, 1])
@pytest.mark.parametrize("aggregation, want", [
    ("token_mean", -3.6 / 27),  # -sum_i n_i A_i / N = -(-1.0 + 1.8 - 2.8 + 4.0 - 5.4 + 7.0) / 27
    ("seq_mean", -0.3 / 6),  # -sum_i A_i / 6 = -(-0.5 + 0.6 - 0.7 + 0.8 - 0.9 + 1.0) / 6
])
def test_pg_loss_is_the_update_s_whatever_the_micro_batching(aggregation, want, micro_batch_tokens):
    # on-policy the ratio is exactly 1 and the clip never binds, so every token's loss is -A_i
    cfg = TrainerConfig(loss=LossConfig(aggregation=aggregation), micro_batch_tokens=micro_batch_tokens)
    _, _, _, m = _step(cfg)
    assert m["train/pg_loss"] == pytest.approx(want, rel=1e-6)
    assert m["train/loss"] == pytest.approx(want, rel=1e-6)


# old_logprobs=rollout: ratio exp(DELTAS[i]) on sample i's tokens and no engine gap; recompute: ratio 1, the gap
# DELTAS[i]. Together every metric is non-trivial (the clip, dual clip, TIS truncation and TIS masking all bind).
MODES = {"rollout": {"old_logprobs": "rollout", "tis": "token_truncate"},
         "recompute": {"old_logprobs": "recompute", "tis": "seq_mask"}}


def _loss_cfg(aggregation, tis):
    return LossConfig(aggregation=aggregation, seq_sum_norm_len=8, kl_coef=0.1, entropy_coef=0.01, tis=tis,
                      tis_clip=3.0, tis_mask_bound=1.25, dual_clip_c=1.05)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean", "seq_sum_norm"])
def test_every_metric_is_the_same_with_one_or_several_micro_batches(aggregation, mode):
    runs = []
    for micro_batch_tokens in (10_000, 12):  # one micro-batch; five ([0, 1], [2], [3], [4], [5])
        model, params, opt, sched = _policy()
        samples = _with_engine_logprobs(model, _samples())
        cfg = TrainerConfig(loss=_loss_cfg(aggregation, MODES[mode]["tis"]), micro_batch_tokens=micro_batch_tokens,
                            old_logprobs=MODES[mode]["old_logprobs"])
        runs.append(train_step(model, samples, cfg, opt, sched, params, 0, CPU))
    one, several = runs
    assert one.keys() == several.keys()
    for k in ("train/pg_loss", "train/kl", "train/entropy", "train/clip_frac", "train/ratio_max",
              "train/tis_weight_mean", "train/rollout_logprob_abs_diff", "train/dual_clip_frac"):
        assert k in one, k
    for k, v in one.items():
        if not k.startswith("perf/"):  # seconds: measured, not computed
            assert several[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    if mode == "rollout":  # ratio r_i = exp(DELTAS[i]): 1.105 0.741 0.741 1.221 0.980 1.350
        # the clip binds for sample 2 (A < 0, r < 0.8; 4 tokens) and 5 (A > 0, r > 1.28; 7 tokens), the dual clip
        # (A < 0, r > 1.05) for sample 0 (2 tokens)
        assert one["train/ratio_max"] == pytest.approx(math.exp(0.3), rel=1e-5)
        assert (one["train/clip_frac"], one["train/dual_clip_frac"]) == pytest.approx((11 / 27, 2 / 27))
        if aggregation == "token_mean":  # sum_i n_i L_i: 2 * 0.525 (dual cap 1.05 * 0.5) - 3 * 0.6 * 0.74082
            # + 4 * 0.7 * 0.8 - 5 * 0.8 * 1.22140 + 6 * 0.9 * 0.98020 - 7 * 1.0 * 1.28 = -6.59601
            assert one["train/pg_loss"] == pytest.approx(-6.59601 / 27, rel=1e-5)
    else:  # the gap |DELTAS[i]|; tis_mask_bound 1.25: sample i is masked when its per-token gap |DELTAS[i]| > ln 1.25
        # = 0.2231, which holds for samples 1, 2 and 5 (0.3): 3 of 6 rows, 14 of 27 tokens
        assert one["train/rollout_logprob_abs_diff"] == pytest.approx(5.52 / 27, rel=1e-5)
        assert one["train/tis_masked_frac"] == pytest.approx(3 / 6)
        assert one["train/tis_weight_mean"] == pytest.approx(13 / 27)
        assert one["train/ratio_max"] == 1.0


@pytest.mark.parametrize("mode", list(MODES))
def test_a_step_of_several_updates_merges_their_metrics(mode):
    # lr 1e-9: the updates move the policy by ~1e-8, so the ratios stay exp(DELTAS[i]) (rollout) or 1 (recompute)
    # across the step's three updates: samples {0, 1}, {2, 3}, {4, 5}, of 5, 9 and 13 tokens
    model, params, opt, sched = _policy(lr=1e-9)
    samples = _with_engine_logprobs(model, _grouped())
    cfg = TrainerConfig(loss=_loss_cfg("token_mean", MODES[mode]["tis"]), minibatches=3,
                        old_logprobs=MODES[mode]["old_logprobs"])
    m = train_step(model, samples, cfg, opt, sched, params, 0, CPU)
    if mode == "rollout":
        # the largest ratio is in the third update; pg_loss: the updates' token-weighted mean, which for token_mean
        # is the whole step's (see the single-update values above)
        assert m["train/ratio_max"] == pytest.approx(math.exp(0.3), rel=1e-5)
        assert m["train/pg_loss"] == pytest.approx(-6.59601 / 27, rel=1e-5)
        assert m["train/clip_frac"] == pytest.approx(11 / 27, rel=1e-5)
    else:  # masked rows per update: 1 of 2, 1 of 2, 1 of 2 -> 3 of 6 (a token-weighted mean would give 14/27)
        assert m["train/tis_masked_frac"] == pytest.approx(3 / 6)
        # kept samples 0, 3, 4 at ratio 1: -(2 * -0.5 + 5 * 0.8 + 6 * -0.9) / 27
        assert m["train/pg_loss"] == pytest.approx(2.4 / 27, rel=1e-5)
    assert m["train/updates"] == 3.0 and (m["train/num_tokens"], m["train/num_seqs"]) == (27.0, 6.0)


@pytest.mark.parametrize("minibatches, old", [(1, "recompute"), (3, "recompute"), (1, "rollout")])
def test_the_reported_engine_gap_is_the_offset_the_engine_had(minibatches, old):
    # the trainer's log-probs minus the engine's are DELTAS[i] on sample i's n_i = 2 + i tokens, so the mean gap
    # is (2 * 0.1 + 3 * 0.3 + 4 * 0.3 + 5 * 0.2 + 6 * 0.02 + 7 * 0.3) / 27 = 5.52 / 27; with several updates it is
    # the gap to the pre-step policy in every one, though the policy moves between them; with old_logprobs=rollout
    # (the ratio's old log-probs are the engine's) it is measured on the policy of the update
    model, params, opt, sched = _policy()
    samples = _with_engine_logprobs(model, _grouped())
    m = train_step(model, samples, TrainerConfig(minibatches=minibatches, old_logprobs=old), opt, sched, params, 0,
                   CPU)
    assert m["train/updates"] == minibatches
    assert m["train/rollout_logprob_abs_diff"] == pytest.approx(5.52 / 27, rel=1e-5)


# ---- D: masked samples take no part ------------------------------------------------------------------------
def test_a_masked_sample_takes_no_part_in_the_loss_or_its_normalisers(monkeypatch):
    grads = _capture_grads(monkeypatch)
    cfg = TrainerConfig(loss=LossConfig(aggregation="seq_mean"), micro_batch_tokens=12)
    samples = _samples()
    samples[2].in_loss = False  # overlong=mask
    _, _, _, m = _step(cfg, samples)
    # seq_mean on-policy: -sum_i A_i / num_seqs over the five samples in the loss: -(0.3 - -0.7) / 5 = -0.2 (a
    # denominator counting the masked sample would give -1.0 / 6)
    assert m["train/pg_loss"] == pytest.approx(-0.2, rel=1e-6) and m["train/loss"] == pytest.approx(-0.2, rel=1e-6)
    assert (m["train/num_seqs"], m["train/num_tokens"]) == (5.0, 27.0 - 4)
    _, _, _, m_without = _step(cfg, [s for i, s in enumerate(_samples()) if i != 2])
    assert m_without["train/loss"] == pytest.approx(m["train/loss"], rel=1e-6)
    assert len(grads) == 2
    for n, g in grads[1].items():
        assert (grads[0][n] - g).norm() <= 1e-5 * g.norm(), n


# ---- C: deterministic no-grad forwards ---------------------------------------------------------------------
def _training_flags(model):
    return {n: m.training for n, m in model.named_modules()}


def test_no_grad_forwards_run_without_dropout_and_restore_the_training_flags():
    model, _, _, _ = _policy(dropout=0.5)
    plain, _, _, _ = _policy(dropout=0.0)
    plain.load_state_dict(model.state_dict())  # the same weights (B != 0), no dropout
    model.train()
    next(m for m in model.modules() if isinstance(m, torch.nn.Dropout)).eval()  # flags restored one by one
    flags = _training_flags(model)
    s = _samples()[5]
    ids = s.prompt_ids + s.response_ids
    first, second = sequence_logprobs(model, ids), sequence_logprobs(model, ids)
    assert first == second == sequence_logprobs(plain, ids)  # bitwise
    assert _training_flags(model) == flags
    runs = []
    for m in (model, model, plain):
        samples = _samples()
        fill_old_logprobs(m, samples, TrainerConfig(micro_batch_tokens=12), 0, CPU, 1.0)
        runs.append([x.old_logprobs for x in samples])
    assert runs[0] == runs[1] == runs[2]
    assert _training_flags(model) == flags


def test_the_gradient_forward_keeps_dropout(monkeypatch):
    grads = _capture_grads(monkeypatch)
    cfg = TrainerConfig(loss=LossConfig(kl_coef=0.1))  # the reference forward runs between forward and backward
    for seed in (1, 2):
        model, params, opt, sched = _policy(dropout=0.5)  # the same weights
        torch.manual_seed(seed)  # other dropout masks
        train_step(model, _samples(), cfg, opt, sched, params, 0, CPU)
        assert all(m.training for m in model.modules())
    assert any(not torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


def test_the_trainer_computes_in_the_models_dtype_unless_autocast_is_on():
    """autocast_bf16=off (the default) leaves an fp32 model in fp32: its log-probs are bitwise the plain forward's,
    as the fp32 engine's decode computes them; on runs the matmuls in bf16 (8 mantissa bits: log-probs move by far
    more than fp32 rounding). The old `auto` turned autocast on for any fp32 model on CUDA and is refused."""
    model, *_ = _policy()
    ids = list(range(3, 40))
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model(x[:, :-1], seq_lens=torch.tensor([len(ids) - 1])).logits
    plain = token_logprobs(logits.float(), x[:, 1:])[0].tolist()
    assert sequence_logprobs(model, ids) == plain
    assert TrainerConfig().autocast_bf16 == "off"
    bf16 = sequence_logprobs(model, ids, TrainerConfig(autocast_bf16="on"))
    assert max(abs(a - b) for a, b in zip(bf16, plain)) > 1e-4
    with pytest.raises(ValueError, match=r"^autocast_bf16: 'auto' is gone: .*bf16 autocast.*fp32.*use off"):
        TrainerConfig(autocast_bf16="auto").validate()


class _FourTokenPolicy(torch.nn.Module):
    """A policy over a 4-token vocabulary that ignores its input: p = [0.4, 0.3, 0.2, 0.1] at every position (plus a
    trainable logit bias named like an adapter, zero at the start)."""

    def __init__(self):
        super().__init__()
        from types import SimpleNamespace

        self.config = SimpleNamespace(vocab_size=4)
        self.activation_checkpointing = False
        self.lora_bias = torch.nn.Parameter(torch.zeros(4))

    def forward(self, ids_BT, seq_lens=None):
        from types import SimpleNamespace

        base = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
        return SimpleNamespace(logits=(base + self.lora_bias).expand(*ids_BT.shape, 4))


@pytest.mark.parametrize("unfiltered, ratio", [(True, 1.0), (False, 0.7)])
def test_old_logprobs_rollout_under_top_k_starts_at_ratio_1_with_the_unfiltered_logprobs(unfiltered, ratio):
    # top_k=2 keeps tokens 0 and 1: the engine samples token 1 from [0.4, 0.3] / 0.7, filtered log-prob ln(3/7);
    # under the whole vocabulary it is ln 0.3. The trainer's log-prob is ln 0.3, so the step-0 ratio against the
    # unfiltered old log-prob is exactly 1; against the filtered one it would be exp(ln 0.3 - ln 3/7) = 0.7 < 1.
    model = _FourTokenPolicy()
    params = {"head.lora_bias": model.lora_bias}
    opt = build_optimizer(params, OptimConfig(lr=1e-2))
    sample = Sample([0], [1], rollout_logprobs=[math.log(3 / 7)], advantage=1.0,
                    unfiltered_logprobs=[math.log(0.3)] if unfiltered else [])
    m = train_step(model, [sample], TrainerConfig(old_logprobs="rollout"), opt, build_scheduler(opt, OptimConfig()),
                   params, 0, CPU)
    assert m["train/ratio_mean"] == pytest.approx(ratio, rel=1e-6)
    assert m["train/skipped"] == 0.0
