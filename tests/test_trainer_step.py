"""One policy update (`miles_k3.trainer.step.train_step`) on k3_tiny with LoRA: the adapter moves and the base
does not, micro-batching does not change the update, a non-finite loss skips it, the KL reference is the
adapter-off base, and the trainer's log-probs of engine rollouts match the engine's own."""
import pytest
import torch

from miles_k3.model import K3Config, K3ForCausalLM
from miles_k3.model.lora import LoRAConfig, apply_lora, lora_parameters, lora_state_dict
from miles_k3.trainer.batch import Sample
from miles_k3.trainer.losses import LossConfig
from miles_k3.trainer.optim import OptimConfig, build_optimizer, build_scheduler
from miles_k3.trainer.step import TrainerConfig, train_step

LORA = LoRAConfig(rank=4, alpha=8.0)


def _policy(seed=0):
    torch.manual_seed(seed)
    model = K3ForCausalLM(K3Config.from_name("k3_tiny"), expert_format="mxfp4")
    model.requires_grad_(False)
    apply_lora(model, LORA)
    with torch.no_grad():  # B != 0 so that A gets gradients too, and the adapter already differs from the base
        for n, p in lora_parameters(model).items():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    params = lora_parameters(model)
    opt = build_optimizer(params, OptimConfig(lr=1e-2, grad_clip=0.0))
    return model, params, opt, build_scheduler(opt, OptimConfig(lr=1e-2))


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
    import miles_k3.trainer.step as step_mod

    grads = []
    real = step_mod.optimizer_step
    monkeypatch.setattr(step_mod, "optimizer_step", lambda opt, sched, params, cfg: grads.append(
        {n: p.grad.clone() for n, p in params.items()}) or real(opt, sched, params, cfg))
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
    assert m["train/skipped"] == 1.0
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
    from miles_k3.rollout.engine import EngineConfig, RolloutEngine

    model, params, opt, sched = _policy()
    engine = RolloutEngine(model, EngineConfig(memory_budget_bytes=8 * 2**20, max_context=64), lora=LORA)
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
    import miles_k3.trainer.step as step_mod

    grads = []
    real = step_mod.optimizer_step
    monkeypatch.setattr(step_mod, "optimizer_step", lambda opt, sched, params, cfg: grads.append(
        {n: p.grad.clone() for n, p in params.items()}) or real(opt, sched, params, cfg))
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
    assert m3["train/rollout_logprob_abs_diff"] == 0.0
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
