"""The trainer's optimizer (CPU): AdamW over adapters only, the warmup + cosine schedule against hand-computed
values, skipped updates on non-finite gradients or loss, the bad-step guard, and gradient clipping."""
import copy
import math

import pytest
import torch
from lora_helpers import ids as _ids
from lora_helpers import tiny as _tiny
from torch import nn

from miles_k3.model.lora import LoRAConfig, apply_lora, lora_parameters
from miles_k3.trainer.optim import (
    BadStepGuard,
    OptimConfig,
    build_optimizer,
    build_scheduler,
    lr_at,
    optimizer_step,
)


class Toy(nn.Module):
    """Two adaptable linears: a model small enough to drive the optimizer directly."""

    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(6, 5)
        self.o_proj = nn.Linear(5, 3)

    def forward(self, x):
        return self.o_proj(torch.tanh(self.q_proj(x)))


def _toy(seed=0):
    torch.manual_seed(seed)
    model = Toy()
    apply_lora(model, LoRAConfig(rank=2, alpha=4.0, targets=["q_proj", "o_proj"]))
    with torch.no_grad():
        for p in lora_parameters(model).values():
            p.normal_(0, 0.5)  # non-zero B too, so every adapter gets a gradient
    return model, lora_parameters(model)


def _backward(model, seed=0, scale=1.0):
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed))
    loss = model(x).pow(2).mean() * scale
    loss.backward()
    return loss


def _setup(cfg, seed=0):
    model, params = _toy(seed)
    opt = build_optimizer(params, cfg)
    return model, params, opt, build_scheduler(opt, cfg)


# ---- config -------------------------------------------------------------------------------------------
def test_defaults_validate():
    cfg = OptimConfig()
    cfg.validate()
    assert cfg.betas == [0.9, 0.999] and cfg.betas is not OptimConfig().betas


@pytest.mark.parametrize("field,value", [
    ("lr", 0.0), ("lr", float("nan")), ("betas", [0.9]), ("betas", [0.9, 1.0]), ("eps", 0.0),
    ("weight_decay", -0.1), ("warmup_steps", -1), ("warmup_steps", 1.5), ("total_steps", 0),
    ("min_lr_ratio", 1.5), ("grad_clip", -1.0), ("grad_clip", float("inf")), ("max_bad_steps", 0),
])
def test_invalid_values_name_the_field(field, value):
    cfg = OptimConfig(**{field: value})
    with pytest.raises(ValueError, match=f"^{field}: "):
        cfg.validate()


def test_total_steps_must_exceed_warmup():
    with pytest.raises(ValueError, match="^total_steps: must be > warmup_steps"):
        OptimConfig(warmup_steps=10, total_steps=10).validate()


# ---- which parameters ----------------------------------------------------------------------------------
def test_refuses_base_and_frozen_parameters():
    model, params = _toy()
    with pytest.raises(ValueError, match=r"q_proj\.weight is not a LoRA adapter.*base model must stay frozen"):
        build_optimizer({**params, "q_proj.weight": model.q_proj.weight}, OptimConfig())
    frozen = dict(params)
    name = next(iter(frozen))
    frozen[name] = nn.Parameter(frozen[name].detach().clone(), requires_grad=False)
    with pytest.raises(ValueError, match=f"{name} has requires_grad=False"):
        build_optimizer(frozen, OptimConfig())
    with pytest.raises(ValueError, match="params: empty"):
        build_optimizer({}, OptimConfig())


def test_only_adapters_change_on_k3_tiny():
    """Several AdamW steps with weight decay on k3_tiny + LoRA: every base tensor keeps its exact bytes."""
    model = _tiny("bf16")
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0))
    params = lora_parameters(model)
    base_before = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}
    lora_before = {k: v.detach().clone() for k, v in params.items()}
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1)
    opt = build_optimizer(params, cfg)
    sched = build_scheduler(opt, cfg)
    assert [len(g["params"]) for g in opt.param_groups] == [len(params)]
    for step in range(3):
        model(_ids(1, 6, seed=step)).logits.float().pow(2).mean().backward()
        assert optimizer_step(opt, sched, params, cfg)["train/skipped"] == 0.0
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base_before.items())
    assert all(p.grad is None for p in model.parameters())
    assert sum(not torch.equal(params[k], v) for k, v in lora_before.items()) == len(params)


# ---- schedule ------------------------------------------------------------------------------------------
def test_lr_at_warmup_then_cosine():
    cfg = OptimConfig(lr=1e-3, warmup_steps=4, total_steps=12, min_lr_ratio=0.1)
    # warmup: lr * k / 4; cosine over steps 4..12: lr * (0.1 + 0.9 * (1 + cos(pi * (k - 4) / 8)) / 2)
    expected = {1: 2.5e-4, 2: 5e-4, 4: 1e-3, 6: 1e-3 * (0.1 + 0.45 * (1 + math.sqrt(0.5))), 8: 5.5e-4,
                10: 1e-3 * (0.1 + 0.45 * (1 - math.sqrt(0.5))), 12: 1e-4, 13: 1e-4, 100: 1e-4}
    for step, lr in expected.items():
        assert lr_at(step, cfg) == pytest.approx(lr, rel=1e-12), step
    assert lr_at(6, cfg) == pytest.approx(8.681980515339464e-4, rel=1e-12)
    with pytest.raises(ValueError, match="^step: "):
        lr_at(0, cfg)


def test_lr_at_constant_after_warmup():
    assert [lr_at(k, OptimConfig(lr=0.3, warmup_steps=3)) for k in (1, 2, 3, 4, 50)] == \
        pytest.approx([0.1, 0.2, 0.3, 0.3, 0.3])
    assert lr_at(1, OptimConfig(lr=0.3)) == 0.3 and lr_at(10**6, OptimConfig(lr=0.3)) == 0.3
    # no warmup, cosine from the first update: step 1 of 4 is 1/4 of the way down
    assert lr_at(1, OptimConfig(lr=1.0, total_steps=4)) == pytest.approx((1 + math.cos(math.pi / 4)) / 2)


def test_scheduler_gives_each_update_lr_at_its_step():
    cfg = OptimConfig(lr=1e-2, warmup_steps=2, total_steps=5, min_lr_ratio=0.2, grad_clip=0.0)
    model, params, opt, sched = _setup(cfg)
    seen = []
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(o.param_groups[0]["lr"]))
    reported = []
    for k in range(7):
        _backward(model, seed=k)
        reported.append(optimizer_step(opt, sched, params, cfg)["train/lr"])
    assert seen == reported == [lr_at(k, cfg) for k in range(1, 8)]


# ---- skipping non-finite updates -----------------------------------------------------------------------
def _snapshot(params, opt, sched):
    return ({k: p.detach().clone() for k, p in params.items()}, copy.deepcopy(opt.state_dict()),
            sched.last_epoch, opt.param_groups[0]["lr"])


def _assert_same(snap, params, opt, sched):
    values, opt_state, last_epoch, lr = snap
    assert all(torch.equal(params[k], v) for k, v in values.items())
    now = opt.state_dict()["state"]
    assert now.keys() == opt_state["state"].keys()
    for i, st in opt_state["state"].items():
        assert all(torch.equal(now[i][key], val) for key, val in st.items())
    assert sched.last_epoch == last_epoch and opt.param_groups[0]["lr"] == lr


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_gradient_skips_the_update(bad):
    cfg = OptimConfig(lr=1e-2, warmup_steps=3)
    model, params, opt, sched = _setup(cfg)
    _backward(model)
    assert optimizer_step(opt, sched, params, cfg)["train/skipped"] == 0.0  # moments exist now
    snap = _snapshot(params, opt, sched)
    _backward(model, seed=1)
    next(iter(params.values())).grad.view(-1)[3] = bad
    out = optimizer_step(opt, sched, params, cfg)
    assert out["train/skipped"] == 1.0 and math.isnan(out["train/grad_norm"])
    assert out["train/lr"] == lr_at(2, cfg)
    assert all(p.grad is None for p in params.values())
    _assert_same(snap, params, opt, sched)
    _backward(model, seed=1)  # the next good update is update 2 of the schedule, not 3
    out = optimizer_step(opt, sched, params, cfg)
    assert out["train/skipped"] == 0.0 and out["train/lr"] == lr_at(2, cfg)
    assert sched.last_epoch == 2


def test_non_finite_loss_skips_even_with_finite_gradients():
    cfg = OptimConfig()
    model, params, opt, sched = _setup(cfg)
    _backward(model)
    snap = _snapshot(params, opt, sched)
    out = optimizer_step(opt, sched, params, cfg, loss=torch.tensor(float("nan")))
    assert out["train/skipped"] == 1.0
    _assert_same(snap, params, opt, sched)


# ---- clipping ------------------------------------------------------------------------------------------
def _norm_at_step(cfg, scale):
    """(the norm optimizer_step reports, the norm of the gradients the optimizer actually steps with)."""
    model, params, opt, sched = _setup(cfg)
    at_step = []
    opt.register_step_pre_hook(lambda o, args, kwargs: at_step.append(
        float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params.values()])))))
    _backward(model, scale=scale)
    out = optimizer_step(opt, sched, params, cfg)
    return out["train/grad_norm"], at_step[0]


def test_grad_clip_caps_the_global_norm():
    reported, stepped = _norm_at_step(OptimConfig(grad_clip=1.0), scale=1e4)
    assert reported > 100.0 and stepped == pytest.approx(1.0, rel=1e-5)
    reported_off, stepped_off = _norm_at_step(OptimConfig(grad_clip=0.0), scale=1e4)
    assert stepped_off == pytest.approx(reported_off, rel=1e-6) and reported_off == pytest.approx(reported)
    # below the cap the gradients are left exactly as they are
    small, stepped_small = _norm_at_step(OptimConfig(grad_clip=1e6), scale=1.0)
    assert stepped_small == pytest.approx(small, rel=1e-6) and small < 1e6


# ---- bad-step guard ------------------------------------------------------------------------------------
GOOD = {"train/skipped": 0.0, "train/empty_step": 0.0}
BAD = {"train/skipped": 1.0, "train/empty_step": 0.0}
EMPTY = {"train/skipped": 0.0, "train/empty_step": 1.0}


def test_bad_step_guard_raises_after_consecutive_skips_and_resets():
    guard = BadStepGuard(3, last_good="/runs/x/checkpoints/step_00000007")
    guard.record(BAD)
    guard.record(BAD)
    guard.record(GOOD)  # a good step resets the count
    guard.record(BAD)
    guard.record(BAD)
    with pytest.raises(RuntimeError, match=r"3 consecutive steps had non-finite loss or gradients; the last "
                                           r"good adapter is kept at /runs/x/checkpoints/step_00000007; "
                                           r"lower optim.lr"):
        guard.record(BAD)
    with pytest.raises(RuntimeError, match="1 consecutive steps.*no checkpoint saved yet"):
        BadStepGuard(1).record({"train/skipped": 1.0})  # optimizer_step's metrics (SFT) have no empty_step
    BadStepGuard(1).record({"train/skipped": 0.0})
    with pytest.raises(ValueError, match="^max_bad_steps: "):
        BadStepGuard(0)


def test_empty_steps_are_counted_apart_from_bad_steps_with_their_own_limit_and_message():
    guard = BadStepGuard(2, last_good="/runs/x/checkpoints/step_00000004", max_empty_steps=3)
    for m in (EMPTY, EMPTY, BAD, GOOD):  # 2 empty and 1 bad, then a good update resets both counts ...
        guard.record(m)
    guard.record(BAD)  # ... so this is the first bad step (else: the second, raising) ...
    for _ in range(2):
        guard.record(EMPTY)  # ... and these the first empty ones (else: the 3rd and 4th); they neither reset nor
        # advance the bad count ...
    with pytest.raises(RuntimeError, match=r"^stopping: 2 consecutive steps had non-finite"):
        guard.record(BAD)  # ... so this is the second bad step in a row
    guard = BadStepGuard(2, last_good="/runs/x/checkpoints/step_00000004", max_empty_steps=3)
    for m in (EMPTY, BAD, EMPTY):  # a bad step neither resets nor advances the empty count
        guard.record(m)
    with pytest.raises(RuntimeError) as err:
        guard.record(EMPTY)
    msg = str(err.value)
    assert msg.startswith("stopping: 3 consecutive steps (optim.max_empty_steps) had no training signal (every "
                          "group's rewards were equal, or every sample was masked out of the loss)")
    assert "non-finite" not in msg and "/runs/x/checkpoints/step_00000004" in msg
    for fix in ("easier", "rollout.group_size", "rollout.dynamic_sampling", "rollout.max_sampling_rounds"):
        assert fix in msg, fix
    with pytest.raises(RuntimeError, match="1 consecutive steps .*no training signal.*no checkpoint saved yet"):
        BadStepGuard(5, max_empty_steps=1).record(EMPTY)
    guard = BadStepGuard(1)  # the default empty limit is OptimConfig's
    for _ in range(OptimConfig().max_empty_steps - 1):
        guard.record(EMPTY)
    with pytest.raises(RuntimeError, match="^stopping: 20 consecutive steps"):
        guard.record(EMPTY)


def test_bad_step_guard_checks_its_arguments():
    with pytest.raises(ValueError, match="^max_empty_steps: must be an int >= 1, got 0"):
        BadStepGuard(3, max_empty_steps=0)
    with pytest.raises(TypeError, match="takes the step's metrics dict"):
        BadStepGuard(3).record(True)  # the old API (skipped: bool)
    assert OptimConfig().max_empty_steps == 20
    with pytest.raises(ValueError, match="^max_empty_steps: must be an int >= 1, got 0"):
        OptimConfig(max_empty_steps=0).validate()
