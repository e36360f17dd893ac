"""One optimizer step of the policy on a step's rollouts: micro-batches by token budget, the trainer's own
log-probs of every response token, the policy loss (with the engine's log-probs for TIS and the mismatch metric,
and the adapter-off base as the KL reference), backward, then one guarded AdamW step over the LoRA parameters.

The loss of each micro-batch is computed with the step's totals (response tokens, sequences), so the
micro-batches' gradients add up to the gradient of the whole step (`losses.policy_loss`). Training is on-policy
with one update per batch of rollouts: the "old" log-probs are the trainer's own, detached, so the PPO ratio is
1 and the engine's log-probs enter only through TIS (`loss.tis`) and `train/rollout_logprob_abs_diff`. A
non-finite loss or gradient skips the update (the adapter keeps its last good values) and is reported.
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

    def validate(self) -> None:
        if self.micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens: must be >= 1, got {self.micro_batch_tokens}")
        if self.autocast_bf16 not in ("auto", "on", "off"):
            raise ValueError(f"autocast_bf16: '{self.autocast_bf16}' is not one of auto, on, off")


def train_step(model, samples: list[Sample], cfg: TrainerConfig, opt, sched, params: dict, pad_id: int,
               device: torch.device, temperature: float = 1.0) -> dict[str, float]:
    """Backward over every micro-batch of `samples`, then one optimizer step; metrics under train/. Log-probs
    are of logits / `temperature` (the rollouts' sampling temperature; 0 = greedy counts as 1), the policy the
    engine sampled from and whose log-probs it reports (without top-p / top-k filtering)."""
    in_loss = [s for s in samples if s.in_loss]
    num_tokens = sum(len(s.response_ids) for s in in_loss)
    if not num_tokens:
        return {"train/skipped": 1.0, "train/num_tokens": 0.0}
    totals = {"num_tokens": float(num_tokens), "num_seqs": float(len(samples)),
              "temperature": temperature if temperature > 0 else 1.0}
    sums: dict[str, float] = {}
    loss_total, finite = 0.0, True
    for idx in micro_batches(samples, cfg.micro_batch_tokens):
        mb = pack([samples[i] for i in idx], pad_id).to(device)
        weight = mb.num_tokens / num_tokens
        has_rollout = all(samples[i].rollout_logprobs for i in idx)
        loss, m = _micro_step(model, mb, cfg, totals, has_rollout)
        if not math.isfinite(loss):
            finite = False
            break
        loss_total += loss
        for k, v in m.items():
            sums[k] = sums.get(k, 0.0) + v * weight
    if not finite:
        opt.zero_grad(set_to_none=True)  # nothing of this step may reach the adapter
        return {"train/skipped": 1.0, "train/loss": float("nan"), "train/num_tokens": float(num_tokens)}
    out = optimizer_step(opt, sched, params, cfg.optim)
    return {**sums, **out, "train/loss": loss_total, "train/num_tokens": float(num_tokens)}


def _micro_step(model, mb, cfg: TrainerConfig, totals: dict, has_rollout: bool) -> tuple[float, dict[str, float]]:
    with _autocast(model, cfg), _recompute(model, cfg.activation_checkpointing):
        logits = model(mb.input_ids_BT, seq_lens=mb.seq_lens_B).logits
    if totals["temperature"] != 1.0:
        logits = logits / totals["temperature"]
    logp = token_logprobs(logits, mb.targets_BT)
    entropy = token_entropy(logits) if cfg.loss.entropy_coef > 0 else None
    ref = _reference_logprobs(model, mb, cfg, totals["temperature"]) if cfg.loss.kl_coef > 0 else None
    loss, metrics = policy_loss(logp, logp.detach(), mb.adv_B, mb.mask_BT, cfg.loss,
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
    with adapters_disabled(model), _autocast(model, cfg):
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
