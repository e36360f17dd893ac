"""The optimizer over the LoRA adapters: `OptimConfig` (the `optim` config section), AdamW over adapter
Parameters only (the frozen base is refused), the learning-rate schedule (linear warmup, then constant or cosine
decay), `optimizer_step` (global grad-norm clipping, and skipping an update whose gradients are not finite) and
`BadStepGuard`, which stops a run after too many consecutive skipped steps (non-finite values) or too many
consecutive steps with nothing to train on (no training signal), each with its own limit and diagnosis.

Step numbering: optimizer updates are counted from 1, and `lr_at(step)` is the learning rate of update `step`.
With W = warmup_steps, T = total_steps and m = min_lr_ratio:
  step <= W:              lr * step / W              (lr / W at step 1, lr at step W)
  W < step, T is None:    lr
  W < step <= T:          lr * (m + (1 - m) * (1 + cos(pi * (step - W) / (T - W))) / 2)   (lr * m at step T)
  step > T:               lr * m
`build_scheduler` makes a LambdaLR whose value after k scheduler steps is lr_at(k + 1): the rate of the next
update. `optimizer_step` steps the scheduler only when the optimizer stepped, so a skipped update does not
advance the schedule.
"""
from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from miles_k3.parallel.grads import global_grad_norm, reduce_gradients
from miles_k3.parallel.mesh import SINGLE, ParallelContext
from miles_k3.parallel.reduce import max_over, world_of

ADAPTER_MARK = "lora_"  # every adapter Parameter name contains it (`...q_proj.lora_A.weight`)


@dataclass
class OptimConfig:
    """AdamW over the LoRA adapters, its learning-rate schedule, gradient clipping and bad- and empty-step
    tolerance."""

    lr: float = 2e-5
    """Peak learning rate (reached at the end of warmup); > 0."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW (beta1, beta2): decay rates of the first and second moment estimates; each in [0, 1)."""
    eps: float = 1e-8
    """AdamW denominator epsilon; > 0."""
    weight_decay: float = 0.0
    """Decoupled (AdamW) weight decay on the adapters; >= 0."""
    warmup_steps: int = 0
    """Linear warmup: update k (counted from 1) uses lr * k / warmup_steps while k <= warmup_steps; 0: none."""
    total_steps: int | None = None
    """None: constant lr after warmup. Else cosine decay from lr right after warmup to min_lr_ratio * lr at
    update total_steps (and that value after it); must be > warmup_steps."""
    min_lr_ratio: float = 0.0
    """The cosine schedule's final lr as a fraction of lr; in [0, 1]."""
    grad_clip: float = 1.0
    """Maximum global L2 norm of the adapter gradients (they are scaled down to it when larger); 0: off."""
    max_bad_steps: int = 5
    """Consecutive updates skipped for non-finite loss or gradients before the run stops; >= 1."""
    max_empty_steps: int = 20
    """Consecutive steps with no training signal (every kept group's rewards were equal, or every sample was
    masked out of the loss: train/empty_step) before the run stops; >= 1. They do not count as bad steps."""

    def validate(self) -> None:
        _check_positive("lr", self.lr)
        if not isinstance(self.betas, (list, tuple)) or len(self.betas) != 2:
            raise ValueError(f"betas: must be a list of two floats [beta1, beta2], got {self.betas!r}")
        if not all(_is_real(b) and 0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas: each must be in [0, 1), got {list(self.betas)}")
        _check_positive("eps", self.eps)
        if not (_is_real(self.weight_decay) and self.weight_decay >= 0.0):
            raise ValueError(f"weight_decay: must be finite and >= 0, got {self.weight_decay!r}")
        _check_int("warmup_steps", self.warmup_steps, 0)
        if self.total_steps is not None:
            _check_int("total_steps", self.total_steps, 1)
            if self.total_steps <= self.warmup_steps:
                raise ValueError(f"total_steps: must be > warmup_steps ({self.warmup_steps}) so the cosine "
                                 f"decay has steps, got {self.total_steps}; or None for a constant lr")
        if not (_is_real(self.min_lr_ratio) and 0.0 <= self.min_lr_ratio <= 1.0):
            raise ValueError(f"min_lr_ratio: must be in [0, 1], got {self.min_lr_ratio!r}")
        if not (_is_real(self.grad_clip) and self.grad_clip >= 0.0):
            raise ValueError(f"grad_clip: must be finite and >= 0 (0 turns clipping off), got {self.grad_clip!r}")
        _check_int("max_bad_steps", self.max_bad_steps, 1)
        _check_int("max_empty_steps", self.max_empty_steps, 1)


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_positive(name: str, value: object) -> None:
    if not (_is_real(value) and value > 0):
        raise ValueError(f"{name}: must be finite and > 0, got {value!r}")


def _check_int(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}: must be an int >= {low}, got {value!r}")


# ---- optimizer and schedule ----------------------------------------------------------------------------
def build_optimizer(params: dict[str, nn.Parameter], cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over exactly `params` (normally `lora_parameters(model)`), one group, the names recorded in the
    optimizer (its state dict carries them as `param_names`). Raises ValueError naming the parameter for one
    that is frozen or is not an adapter: the base model must stay frozen."""
    cfg.validate()
    if not params:
        raise ValueError("params: empty; apply_lora(model, cfg) first and pass lora_parameters(model)")
    seen: dict[int, str] = {}
    for name, p in params.items():
        if ADAPTER_MARK not in name:
            raise ValueError(f"params: {name} is not a LoRA adapter parameter (its name lacks "
                             f"'{ADAPTER_MARK}'); the base model must stay frozen: pass lora_parameters(model)")
        if not p.requires_grad:
            raise ValueError(f"params: {name} has requires_grad=False; a frozen tensor cannot be trained. "
                             "Pass lora_parameters(model) of a model after apply_lora")
        if id(p) in seen:
            raise ValueError(f"params: {name} is the same Parameter as {seen[id(p)]}; list each once")
        seen[id(p)] = name
    return torch.optim.AdamW(list(params.items()), lr=cfg.lr, betas=(cfg.betas[0], cfg.betas[1]),
                             eps=cfg.eps, weight_decay=cfg.weight_decay)


def lr_factor(step: int, cfg: OptimConfig) -> float:
    """lr_at(step, cfg) / cfg.lr (the schedule's multiplier of update `step`, counted from 1)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step: optimizer updates are counted from 1, got {step!r}")
    w, t = cfg.warmup_steps, cfg.total_steps
    if step <= w:
        return step / w
    if t is None:
        return 1.0
    progress = min(1.0, (step - w) / (t - w))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def lr_at(step: int, cfg: OptimConfig) -> float:
    """The learning rate of optimizer update `step` (counted from 1); see the module docstring."""
    return cfg.lr * lr_factor(step, cfg)


def build_scheduler(opt: torch.optim.Optimizer, cfg: OptimConfig) -> LambdaLR:
    """LambdaLR following `lr_at`: after k scheduler steps the optimizer's lr is lr_at(k + 1, cfg). Build it
    right after the optimizer (it sets the group's lr for update 1). Its state dict holds only numbers."""
    cfg.validate()
    return LambdaLR(opt, lambda done: lr_factor(done + 1, cfg))


# ---- one update ------------------------------------------------------------------------------------------
def optimizer_step(opt: torch.optim.Optimizer, sched: LambdaLR, params: dict[str, nn.Parameter],
                   cfg: OptimConfig, loss: float | torch.Tensor | None = None,
                   ctx: ParallelContext = SINGLE) -> dict[str, float]:
    """Clip the global grad norm of `params` to cfg.grad_clip, step the optimizer and the scheduler, zero the
    gradients. When the norm is not finite (a NaN/Inf gradient), or `loss` is given and is not finite, the
    update is skipped: gradients are zeroed and neither the optimizer (parameters and moments stay as they
    were) nor the scheduler steps. Returns train/grad_norm (before clipping; NaN when skipped), train/lr (the
    lr of this update, or of the next one when skipped) and train/skipped (1.0 or 0.0).

    One code path for one rank and many (`ctx`; SINGLE: one process): the gradients are summed over their groups
    (`grads.reduce_gradients`; a parameter without a gradient here but with one on another rank takes part with
    zeros; nothing to sum in one process) and clipped by the global norm (`grads.global_grad_norm`, in one
    process the norm `torch.nn.utils.clip_grad_norm_` computes), the same on every rank, so every rank steps or
    skips together."""
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf  # inf: scales by exactly 1.0
    norm = _reduced_clipped_norm(list(params.values()), max_norm, ctx)
    lr = float(opt.param_groups[0]["lr"])
    loss_ok = loss is None or math.isfinite(float(loss.detach() if torch.is_tensor(loss) else loss))
    if not (math.isfinite(norm) and loss_ok):
        opt.zero_grad(set_to_none=True)
        return {"train/grad_norm": math.nan, "train/lr": lr, "train/skipped": 1.0}
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return {"train/grad_norm": norm, "train/lr": lr, "train/skipped": 0.0}


def _reduced_clipped_norm(params: list[nn.Parameter], max_norm: float, ctx: ParallelContext) -> float:
    """Sum the gradients over their groups, clip them to `max_norm` by their global norm and return that norm.
    Every rank passes the same parameters (their shards); one with no gradient on any rank keeps none (AdamW
    leaves it alone, as in one process)."""
    anywhere = max_over([float(p.grad is not None) for p in params], world_of(ctx))
    for p, has in zip(params, anywhere):
        if has and p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p for p in params if p.grad is not None]
    reduce_gradients(grads, ctx)
    norm = global_grad_norm(grads, ctx)
    if grads and math.isfinite(float(norm)):
        torch.nn.utils.clip_grads_with_norm_(grads, max_norm, norm)
    return float(norm) if grads else 0.0


class BadStepGuard:
    """Counts consecutive bad steps (train/skipped: an update skipped for non-finite loss or gradients) and,
    apart from them, consecutive empty steps (train/empty_step: nothing to train on); `record` raises
    RuntimeError when either count reaches its limit, each with its own diagnosis. A step that applied an
    update resets both counts; a bad step leaves the empty count as it is, and an empty step the bad count.
    Tell it where the last checkpoint went (`last_good`) so the message can say."""

    def __init__(self, max_bad_steps: int, last_good: str | os.PathLike | None = None, max_empty_steps: int = 20):
        _check_int("max_bad_steps", max_bad_steps, 1)
        _check_int("max_empty_steps", max_empty_steps, 1)
        self.max_bad_steps = max_bad_steps
        self.max_empty_steps = max_empty_steps
        self.last_good = last_good
        self.consecutive = 0  # bad steps
        self.consecutive_empty = 0

    def record(self, metrics: Mapping[str, float]) -> None:
        """Note one step's outcome from its metrics: train/skipped == 1.0 (required) is a bad step,
        train/empty_step == 1.0 (absent: 0.0, as in optimizer_step's metrics) an empty one, else an update."""
        if not isinstance(metrics, Mapping):
            raise TypeError(f"BadStepGuard.record: takes the step's metrics dict (with train/skipped and "
                            f"train/empty_step), got {type(metrics).__name__}")
        if metrics["train/skipped"] == 1.0:
            self.consecutive += 1
            if self.consecutive >= self.max_bad_steps:
                raise RuntimeError(
                    f"stopping: {self.consecutive} consecutive steps had non-finite loss or gradients; the last "
                    f"good adapter is kept at {self._where()}; lower optim.lr or optim.grad_clip, or raise "
                    "optim.warmup_steps, check the rewards/data for NaN, then resume from that checkpoint "
                    "(resume=<its path>)")
            return
        if metrics.get("train/empty_step", 0.0) == 1.0:
            self.consecutive_empty += 1
            if self.consecutive_empty >= self.max_empty_steps:
                raise RuntimeError(
                    f"stopping: {self.consecutive_empty} consecutive steps (optim.max_empty_steps) had no training "
                    "signal (every group's rewards were equal, or every sample was masked out of the loss); the "
                    f"last adapter is kept at {self._where()}; make the problems easier or better matched to the "
                    "policy, raise rollout.group_size, or enable rollout.dynamic_sampling / raise "
                    "rollout.max_sampling_rounds, then resume from that checkpoint (resume=<its path>)")
            return
        self.consecutive = self.consecutive_empty = 0

    def _where(self) -> str:
        return str(self.last_good) if self.last_good is not None else "no checkpoint saved yet"
