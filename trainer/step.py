"""One optimizer step of the policy on a step's rollouts: micro-batches by token budget, the trainer's own
log-probs of every response token, the policy loss (with the engine's log-probs for TIS and the mismatch metric,
and the adapter-off base as the KL reference), backward, then guarded AdamW updates over the LoRA parameters.

The loss of each micro-batch is computed with its update's totals (response tokens, sequences), so the
micro-batches' gradients add up to the gradient of the whole update (`losses.policy_loss`).

By default a step is one on-policy update: the "old" log-probs are the trainer's own, detached, so the PPO ratio
is 1 and the engine's log-probs enter only through TIS (`loss.tis`) and `train/rollout_logprob_abs_diff`.
`minibatches: N` splits the step's groups into N minibatches, one update each (one pass, in order, as verl's
PPO minibatches and Miles' several steps per rollout do): every update after the first is off-policy, so the
ratio is taken against the policy before the step's first update, which `old_logprobs` names: `recompute` (one
no-grad forward over the step's samples before the first update) or `rollout` (the engine's sampling
log-probs, no extra forward; the ratio then also carries any trainer/engine mismatch). A non-finite loss or
gradient skips that update (the adapter keeps its last good values) and is reported.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch

from miles_k3.model.lora import adapters_disabled
from miles_k3.trainer.batch import Sample, micro_batches, pack
from miles_k3.trainer.losses import LossConfig, policy_loss, token_entropy, token_logprobs
from miles_k3.trainer.optim import OptimConfig, optimizer_step

OLD_LOGPROBS = ("recompute", "rollout")


@dataclass
class TrainerConfig:
    """The policy update: loss, optimizer, micro-batching and precision."""

    loss: LossConfig = field(default_factory=LossConfig)
    """Clipping, aggregation, KL, entropy and TIS."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """AdamW over the adapter, LR schedule, gradient clipping, bad-step limit."""
    micro_batch_tokens: int = 8192
    """Padded tokens (rows x longest row) per forward/backward."""
    autocast_bf16: str = "auto"
    """auto (bf16 autocast on CUDA with an fp32 model), on, off."""
    activation_checkpointing: bool = False
    """Keep only each decoder layer's inputs in the forward pass and recompute the rest in backward: activation
    memory of one layer instead of all, for about one more forward pass of time."""
    minibatches: int = 1
    """Optimizer updates per step: the step's GRPO groups split in order into this many minibatches of whole
    groups, one update each (fewer when fewer groups are kept). The LR schedule counts updates."""
    old_logprobs: str = "recompute"
    """The ratio's old policy: recompute (the trainer's log-probs before the step's first update; with one
    minibatch they are the current ones, no extra forward) or rollout (the engine's sampling log-probs)."""

    def validate(self) -> None:
        if self.micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens: must be >= 1, got {self.micro_batch_tokens}")
        if isinstance(self.minibatches, bool) or not isinstance(self.minibatches, int) or self.minibatches < 1:
            raise ValueError(f"minibatches: must be an integer >= 1 (optimizer updates per step), got "
                             f"{self.minibatches!r}")
        if self.old_logprobs not in OLD_LOGPROBS:
            raise ValueError(f"old_logprobs: '{self.old_logprobs}' is not one of {', '.join(OLD_LOGPROBS)}")
        if self.autocast_bf16 not in ("auto", "on", "off"):
            raise ValueError(f"autocast_bf16: '{self.autocast_bf16}' is not one of auto, on, off")


def train_step(model, samples: list[Sample], cfg: TrainerConfig, opt, sched, params: dict, pad_id: int,
               device: torch.device, temperature: float = 1.0) -> dict[str, float]:
    """Backward over every micro-batch of each minibatch of `samples`, one optimizer update per minibatch (see the
    module docstring); metrics under train/, each update's token-weighted mean, with train/updates (applied)
    and train/skipped (1.0 when no update was applied). Log-probs are of logits / `temperature` (the rollouts'
    sampling temperature; 0 = greedy counts as 1), the policy the engine sampled from and whose log-probs it
    reports (without top-p / top-k filtering)."""
    cfg.validate()
    temperature = temperature if temperature > 0 else 1.0
    if not any(s.in_loss and s.response_ids for s in samples):
        return {"train/skipped": 1.0, "train/num_tokens": 0.0, "train/updates": 0.0}
    old = "current"
    if cfg.old_logprobs == "rollout":
        missing = [i for i, s in enumerate(samples) if not s.rollout_logprobs]
        if missing:
            raise ValueError(f"trainer.old_logprobs=rollout: sample {missing[0]} has no engine log-probs (the rollout "
                             "must return them); use trainer.old_logprobs=recompute")
        old = "rollout"
    elif cfg.minibatches > 1:
        fill_old_logprobs(model, samples, cfg, pad_id, device, temperature)
        old = "old"
    results = [_update(model, part, cfg, opt, sched, params, pad_id, device, temperature, old)
               for part in split_minibatches(samples, cfg.minibatches)]
    return _combine(results)


def split_minibatches(samples: list[Sample], n: int) -> list[list[Sample]]:
    """`samples` in order as up to `n` minibatches of whole groups (consecutive runs of equal Sample.group), the
    groups shared out as evenly as possible; minibatches with no token in the loss are left out."""
    groups: list[list[Sample]] = []
    for s in samples:
        if groups and groups[-1][0].group == s.group:
            groups[-1].append(s)
        else:
            groups.append([s])
    n = min(n, len(groups))
    parts = [[s for g in groups[len(groups) * k // n:len(groups) * (k + 1) // n] for s in g] for k in range(n)]
    return [p for p in parts if any(s.in_loss and s.response_ids for s in p)]


@torch.no_grad()
def sequence_logprobs(model, ids: list[int], cfg: TrainerConfig | None = None) -> list[float]:
    """The policy's log-probs of ids[1:] given their prefixes, computed as the training forward computes them
    (adapter on, `cfg`'s autocast): what an engine's log-probs of the same tokens are checked against."""
    cfg = cfg or TrainerConfig()
    device = next(model.parameters()).device
    x = torch.tensor([ids], device=device)
    with _autocast(model, cfg):
        logits = model(x[:, :-1], seq_lens=torch.tensor([len(ids) - 1], device=device)).logits
    return token_logprobs(logits.float(), x[:, 1:])[0].tolist()


@torch.no_grad()
def fill_old_logprobs(model, samples: list[Sample], cfg: TrainerConfig, pad_id: int, device: torch.device,
                      temperature: float) -> None:
    """Sets each sample's old_logprobs: the current policy's log-prob of every response token (the forward the
    training pass makes, without gradients)."""
    for idx in micro_batches(samples, cfg.micro_batch_tokens):
        mb = pack([samples[i] for i in idx], pad_id).to(device)
        logp = _batch_logprobs(model, mb, cfg, temperature).float().cpu()
        for row, i in enumerate(idx):
            s = samples[i]
            p, n = len(s.prompt_ids), s.length - 1
            s.old_logprobs = logp[row, p - 1:n].tolist()


def _update(model, samples: list[Sample], cfg: TrainerConfig, opt, sched, params: dict, pad_id: int,
            device: torch.device, temperature: float, old: str) -> dict[str, float]:
    """One guarded optimizer update over `samples` (all their micro-batches)."""
    num_tokens = sum(len(s.response_ids) for s in samples if s.in_loss)
    totals = {"num_tokens": float(num_tokens), "num_seqs": float(len(samples)), "temperature": temperature}
    sums: dict[str, float] = {}
    loss_total, finite = 0.0, True
    for idx in micro_batches(samples, cfg.micro_batch_tokens):
        mb = pack([samples[i] for i in idx], pad_id).to(device)
        weight = mb.num_tokens / num_tokens
        has_rollout = all(samples[i].rollout_logprobs for i in idx)
        loss, m = _micro_step(model, mb, cfg, totals, has_rollout, old)
        if not math.isfinite(loss):
            finite = False
            break
        loss_total += loss
        for k, v in m.items():
            sums[k] = sums.get(k, 0.0) + v * weight
    if not finite:
        opt.zero_grad(set_to_none=True)  # nothing of this update may reach the adapter
        return {"train/skipped": 1.0, "train/loss": float("nan"), "train/num_tokens": float(num_tokens)}
    out = optimizer_step(opt, sched, params, cfg.optim)
    return {**sums, **out, "train/loss": loss_total, "train/num_tokens": float(num_tokens)}


def _combine(results: list[dict[str, float]]) -> dict[str, float]:
    """The step's metrics from its updates': one update's as they are; else token-weighted means over the
    applied updates (train/lr: the first applied update's), train/num_tokens summed."""
    applied = [r for r in results if r["train/skipped"] == 0.0]
    tokens = sum(r["train/num_tokens"] for r in results)
    if len(results) == 1:
        return {**results[0], "train/updates": float(len(applied))}
    if not applied:
        return {"train/skipped": 1.0, "train/loss": float("nan"), "train/num_tokens": tokens, "train/updates": 0.0}
    weight = sum(r["train/num_tokens"] for r in applied)
    out = {k: sum(r[k] * r["train/num_tokens"] for r in applied) / weight for k in applied[0]}
    return out | {"train/lr": applied[0]["train/lr"], "train/num_tokens": tokens, "train/skipped": 0.0,
                  "train/updates": float(len(applied))}


def _micro_step(model, mb, cfg: TrainerConfig, totals: dict, has_rollout: bool,
                old: str = "current") -> tuple[float, dict[str, float]]:
    with _autocast(model, cfg), _recompute(model, cfg.activation_checkpointing):
        logits = model(mb.input_ids_BT, seq_lens=mb.seq_lens_B).logits
    if totals["temperature"] != 1.0:
        logits = logits / totals["temperature"]
    logp = token_logprobs(logits, mb.targets_BT)
    entropy = token_entropy(logits) if cfg.loss.entropy_coef > 0 else None
    ref = _reference_logprobs(model, mb, cfg, totals["temperature"]) if cfg.loss.kl_coef > 0 else None
    old_logp = {"current": logp.detach(), "old": mb.old_logp_BT, "rollout": mb.rollout_logp_BT}[old]
    loss, metrics = policy_loss(logp, old_logp, mb.adv_B, mb.mask_BT, cfg.loss,
                                rollout_logp_BT=mb.rollout_logp_BT if has_rollout else None,
                                ref_logp_BT=ref, entropy_BT=entropy, num_tokens=totals["num_tokens"],
                                num_seqs=totals["num_seqs"])
    value = float(loss.detach())
    if math.isfinite(value):
        loss.backward()
    return value, metrics


@torch.no_grad()
def _reference_logprobs(model, mb, cfg: TrainerConfig, temperature: float) -> torch.Tensor:
    """The frozen base's log-probs (the adapter switched off: no second copy of the model)."""
    with adapters_disabled(model):
        return _batch_logprobs(model, mb, cfg, temperature)


@torch.no_grad()
def _batch_logprobs(model, mb, cfg: TrainerConfig, temperature: float) -> torch.Tensor:
    """The model's log-prob [B, T] of each target of `mb`, from the forward the training pass makes (without
    gradients)."""
    with _autocast(model, cfg):
        logits = model(mb.input_ids_BT, seq_lens=mb.seq_lens_B).logits
    return token_logprobs(logits / temperature, mb.targets_BT)


@contextlib.contextmanager
def _recompute(model, on: bool):
    """The model's activation checkpointing set to `on` for the forward (the backward recomputes by itself)."""
    was = model.activation_checkpointing
    model.activation_checkpointing = on
    try:
        yield
    finally:
        model.activation_checkpointing = was


def _autocast(model, cfg: TrainerConfig):
    device = next(model.parameters()).device
    on = cfg.autocast_bf16 == "on" or (cfg.autocast_bf16 == "auto" and device.type == "cuda"
                                       and next(model.parameters()).dtype == torch.float32)
    return torch.autocast(device.type, dtype=torch.bfloat16) if on else contextlib.nullcontext()
