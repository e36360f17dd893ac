"""GRPO-family policy losses: the PPO clipped surrogate with asymmetric (DAPO clip-higher) bounds, token- or
sequence-level (GSPO) ratios, optional dual clip, truncated importance sampling (TIS) against the rollout engine's
log-probs, a KL penalty to a reference policy (k1 / k2 / k3), an entropy bonus and three aggregations over tokens.
The per-token log-probs and entropies they take are computed from the logits in `trainer.logprobs`.

The policy term is an extension point: a function registered by name (`register_policy_loss`, the signature is
`PolicyLossFn`) and selected by `LossConfig.policy`; the built-in ones are `token_clip` (the PPO / GRPO / DAPO
clipped surrogate) and `sequence_clip` (GSPO). `policy_loss` dispatches to it and adds what every policy term shares:
TIS, the aggregation (GRPO, Dr. GRPO, DAPO), KL and entropy.

`policy_loss` works on one micro-batch of right-padded rows; `mask_BT` marks the response tokens that count and
every value outside it is ignored (it may be anything, even non-finite). The loss is micro-batch additive: when
each call gets the step's totals (`num_tokens` for token_mean, `num_seqs` for seq_mean and seq_sum_norm), the
losses (and gradients) of the micro-batches sum to the loss of the whole step computed in one call. Under data
parallelism the trainer SUMS the ranks' gradients (`parallel.grads.reduce_gradients`), so every rank passes the
global totals (over all replicas) and the sum is the gradient of the one global loss.
Computation is float32 (float64 when logp_BT is float64); old, rollout and reference log-probs and advantages
are constants (detached).

Legend: B sequences (rows), T token positions; a trailing 1 is a broadcast dimension (adv_B1 is [B, 1]).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from miles_k3.utils.registry import check_unclaimed

AGGREGATIONS = ("token_mean", "seq_mean", "seq_sum_norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
TIS_MODES = ("none", "token_truncate", "seq_mask")


@dataclass
class LossConfig:
    """The policy loss (`policy_loss`): clipping, ratio level, aggregation, KL, entropy and TIS."""

    eps_low: float = 0.2
    """Lower clip: the ratio is clipped below at 1 - eps_low (binds for A < 0); in [0, 1)."""
    eps_high: float = 0.28
    """Upper clip: the ratio is clipped above at 1 + eps_high (binds for A > 0); DAPO clip-higher uses 0.28
    against eps_low 0.2; >= 0."""
    policy: str = "token_clip"
    """The policy term, a registered policy loss: token_clip: the clipped surrogate with the ratio exp(logp -
    old_logp) per token (PPO / GRPO / DAPO); sequence_clip (GSPO): the same with s_i = exp(mean over the sequence's
    masked tokens of (logp - old_logp)) used for every token of sequence i; or one added by
    register_policy_loss."""
    aggregation: str = "token_mean"
    """How the masked per-token losses L_it reduce to a scalar. token_mean (DAPO): sum_it L_it / num_tokens;
    seq_mean (original GRPO): sum_i (mean_t L_it) / num_seqs; seq_sum_norm (Dr. GRPO): sum_it L_it /
    (num_seqs * seq_sum_norm_len)."""
    seq_sum_norm_len: int = 1024
    """The constant per-sequence denominator of seq_sum_norm (normally the generation cap); >= 1."""
    entropy_coef: float = 0.0
    """Entropy bonus: the loss gets - entropy_coef * (entropy aggregated like the policy term); >= 0."""
    kl_coef: float = 0.0
    """KL penalty: the loss gets + kl_coef * (KL estimate aggregated like the policy term); >= 0; > 0 needs
    ref_logp_BT."""
    kl_estimator: str = "k3"
    """Per-token KL estimate from d = logp - ref_logp: k1 = d, k2 = d^2 / 2, k3 = exp(-d) + d - 1."""
    tis: str = "none"
    """Rollout-mismatch correction (needs rollout_logp_BT), a constant weight on the policy term only: none;
    token_truncate: w_it = min(exp(old_logp - rollout_logp), tis_clip); seq_mask: w_i = 1 when the sequence's
    geometric-mean ratio exp(mean_t (old_logp - rollout_logp)) is in [1 / tis_mask_bound, tis_mask_bound], else 0
    (per token, so a long sample and a short one that drifted alike are treated alike). python -m miles_k3.train
    defaults it to auto, which its config resolves by rollout.mode before validation: token_truncate under partial,
    none under sync (`config_checks.tis_for_mode`)."""
    tis_clip: float = 2.0
    """The truncation bound of token_truncate; >= 1."""
    tis_mask_bound: float = 1.05
    """The range bound of seq_mask on the geometric-mean (per-token) ratio: a sequence whose mean log-ratio exceeds
    ln(tis_mask_bound) = 0.049 nats per token either way is masked; >= 1."""
    dual_clip_c: float | None = None
    """Dual clip: for A < 0 the per-token loss is capped at -c * A (so at most c * |A|); None: off; > 1."""

    def validate(self) -> None:
        if not (math.isfinite(self.eps_low) and 0.0 <= self.eps_low < 1.0):
            raise ValueError(f"eps_low: must be in [0, 1), got {self.eps_low}")
        if not (math.isfinite(self.eps_high) and self.eps_high >= 0.0):
            raise ValueError(f"eps_high: must be finite and >= 0, got {self.eps_high}")
        if self.policy not in _POLICY_LOSSES:
            raise ValueError(f"policy: '{self.policy}' is not a registered policy loss; registered: "
                             f"{', '.join(policy_loss_names())} (add one with register_policy_loss)")
        _check_choice("aggregation", self.aggregation, AGGREGATIONS)
        if isinstance(self.seq_sum_norm_len, bool) or not isinstance(self.seq_sum_norm_len, int) \
                or self.seq_sum_norm_len < 1:
            raise ValueError(f"seq_sum_norm_len: must be an int >= 1, got {self.seq_sum_norm_len!r}")
        if not (math.isfinite(self.entropy_coef) and self.entropy_coef >= 0.0):
            raise ValueError(f"entropy_coef: must be finite and >= 0, got {self.entropy_coef}")
        if not (math.isfinite(self.kl_coef) and self.kl_coef >= 0.0):
            raise ValueError(f"kl_coef: must be finite and >= 0, got {self.kl_coef}")
        _check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _check_choice("tis", self.tis, TIS_MODES)
        for name in ("tis_clip", "tis_mask_bound"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 1.0):
                raise ValueError(f"{name}: must be finite and >= 1, got {value}")
        c = self.dual_clip_c
        if c is not None and not (math.isfinite(c) and c > 1.0):
            raise ValueError(f"dual_clip_c: must be None or finite and > 1, got {c}")


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}: '{value}' is not one of {', '.join(choices)}")


# ------------------------------------------------------------------------------------------------ registry


@dataclass(frozen=True, eq=False)
class PolicyInputs:
    """What a registered policy loss gets for one micro-batch: every tensor in the compute dtype (float32, or float64
    when policy_loss's logp_BT is) except the mask."""

    logp_BT: Tensor
    """The current policy's log-probs [B, T], differentiable; outside mask_BT any value, even non-finite."""
    old_logp_BT: Tensor
    """The old policy's log-probs [B, T], detached."""
    adv_B1: Tensor
    """The advantages [B, 1], detached."""
    mask_BT: Tensor
    """bool [B, T]: the response tokens that count."""
    cfg: LossConfig
    """The whole loss config: a loss reads the fields it uses (the built-in ones: eps_low, eps_high, dual_clip_c)."""

    def token_mean(self, x_BT: Tensor) -> Tensor:
        """The mean of x over the masked tokens ([] tensor; 0 when there is none): the metrics' convention."""
        return _masked(x_BT, self.mask_BT).sum() / self.mask_BT.sum().clamp(min=1)


PolicyLossFn = Callable[[PolicyInputs], tuple[Tensor, dict[str, Tensor]]]
"""`fn(inputs) -> (loss_BT, metrics)`: the per-token policy loss L_it [B, T] (differentiable wrt inputs.logp_BT;
values outside the mask are ignored, non-finite ones too) and its metrics, name ("train/...") -> [] tensor, each a
mean over the masked tokens (the trainer merges micro-batches weighted by their tokens). policy_loss then weights
L by TIS, aggregates it by cfg.aggregation with the step's denominators (so a registered loss is micro-batch
additive without doing anything) and adds the KL and entropy terms: a loss defines the policy term only."""
_POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: register `fn(inputs: PolicyInputs) -> (loss_BT, metrics)` (`PolicyLossFn`) as the policy loss
    `name`, selected by `trainer.loss.policy=name` (one function per name; the same function registering
    again, e.g. its module imported twice, is fine)."""
    def deco(fn: PolicyLossFn) -> PolicyLossFn:
        check_unclaimed("policy loss", name, _POLICY_LOSSES.get(name), fn)
        _POLICY_LOSSES[name] = fn
        return fn
    return deco


def policy_loss_names() -> list[str]:
    """The registered policy loss names, sorted."""
    return sorted(_POLICY_LOSSES)


@register_policy_loss("token_clip")
def token_clip_loss(x: PolicyInputs) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped surrogate with the per-token ratio r_it = exp(logp_it - old_logp_it) (GRPO; DAPO's
    clip-higher is eps_high > eps_low). Loss and metrics: `_clip_loss`."""
    return _clip_loss(x, torch.exp(_masked(x.logp_BT - x.old_logp_BT, x.mask_BT)))


@register_policy_loss("sequence_clip")
def sequence_clip_loss(x: PolicyInputs) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: the clipped surrogate with the sequence ratio s_i = exp(sum_t (logp_it - old_logp_it) / |o_i|) for
    every token of row i (|o_i| its masked tokens; 1 for a row without tokens). Loss and metrics: `_clip_loss`."""
    log_ratio_BT = _masked(x.logp_BT - x.old_logp_BT, x.mask_BT)
    n_B = x.mask_BT.sum(dim=1).clamp(min=1)
    seq_B = torch.exp(log_ratio_BT.sum(dim=1) / n_B)
    return _clip_loss(x, seq_B[:, None].expand_as(log_ratio_BT))


def _clip_loss(x: PolicyInputs, ratio_BT: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """L_it = -min(r_it A_i, clip(r_it, 1 - eps_low, 1 + eps_high) A_i), capped at -c A_i for A_i < 0 under dual
    clip; metrics train/clip_frac, train/ratio_mean, train/ratio_max (and train/dual_clip_frac): see policy_loss."""
    pg_BT, clipped_BT, dual_BT = _clipped_surrogate(ratio_BT, x.adv_B1, x.cfg)
    stats: dict[str, Tensor] = {
        "train/clip_frac": x.token_mean(clipped_BT.to(ratio_BT.dtype)),
        "train/ratio_mean": x.token_mean(ratio_BT.detach()),
        "train/ratio_max": _masked_max(ratio_BT.detach(), x.mask_BT),
    }
    if dual_BT is not None:
        stats["train/dual_clip_frac"] = x.token_mean(dual_BT.to(ratio_BT.dtype))
    return pg_BT, stats


# ---------------------------------------------------------------------------------------------------- loss


def policy_loss(logp_BT: Tensor, old_logp_BT: Tensor, adv_B: Tensor, mask_BT: Tensor, cfg: LossConfig,
                rollout_logp_BT: Tensor | None = None, ref_logp_BT: Tensor | None = None,
                entropy_BT: Tensor | None = None, num_tokens: float | None = None, num_seqs: float | None = None,
                ) -> tuple[Tensor, dict[str, float]]:
    """The scalar loss of one micro-batch (differentiable wrt logp_BT and entropy_BT) and its metrics.

    Per masked token the policy loss registered as cfg.policy gives L_it (`register_policy_loss`); the
    built-in ones: L_it = -min(r_it * A_i, clip(r_it, 1 - eps_low, 1 + eps_high) * A_i), with r the token
    (`token`) or sequence (`sequence`, GSPO) ratio; dual clip caps it at -c * A_i for A_i < 0. The TIS weight (no
    gradient) multiplies L_it (the KL and entropy terms are not weighted, and TIS-masked rows still count in the
    denominators). loss = agg(L) + kl_coef * agg(k(logp - ref_logp)) - entropy_coef * agg(entropy), with agg
    the configured aggregation, whose denominators are:
      token_mean: num_tokens (default: this call's masked-token count);
      seq_mean: num_seqs (default: B, so an all-masked row counts as a sequence with loss 0);
      seq_sum_norm: num_seqs * seq_sum_norm_len (num_seqs default B).
    Pass the whole optimizer step's totals to make micro-batch losses add up to the step's loss. A row with no
    masked token contributes 0 (no NaN).

    Shapes: [B, T] for logp_BT, old_logp_BT, mask_BT and the optional rollout_logp_BT (needed when cfg.tis is
    not none), ref_logp_BT (needed when kl_coef > 0; without it no KL) and entropy_BT (needed when
    entropy_coef > 0); adv_B [B]. Floating dtypes; mask bool or 0/1 of any dtype. Raises ValueError naming the
    argument on bad input (TypeError for a non-tensor).

    Returns (loss [] float32, or float64 when logp_BT is; metrics as python floats):
      train/pg_loss: the policy term, same denominator as the loss (adds up over micro-batches like the loss);
      the policy loss's own metrics (the built-in ones' below); means over this call's masked tokens (0.0 when
      there is none):
      train/clip_frac: the clip binds (the clipped surrogate is the smaller; the token gets no gradient);
      train/ratio_mean, train/ratio_max: the ratio used (the sequence ratio under GSPO);
      train/kl (with ref_logp_BT), train/entropy (with entropy_BT);
      train/rollout_logprob_abs_diff: |old_logp - rollout_logp| (with rollout_logp_BT), and its 99th percentile
        over the tokens (train/rollout_logprob_abs_diff_p99; merged over micro-batches as their max);
      train/tis_weight_mean (tis not none), train/dual_clip_frac (dual clip on);
      train/tis_masked_frac (seq_mask): the fraction of rows with tokens whose weight is 0.
    """
    cfg.validate()
    _check_inputs(logp_BT, old_logp_BT, adv_B, mask_BT, cfg, rollout_logp_BT, ref_logp_BT, entropy_BT)
    dt = torch.float64 if logp_BT.dtype == torch.float64 else torch.float32
    _check_count("num_tokens", num_tokens)
    _check_count("num_seqs", num_seqs)
    x = PolicyInputs(logp_BT.to(dt), old_logp_BT.detach().to(dt), adv_B.detach().to(dt)[:, None], mask_BT.bool(),
                     cfg)

    def agg(x_BT: Tensor) -> Tensor:
        return _aggregate(x_BT, x.mask_BT, cfg, num_tokens, num_seqs)

    pg_BT, stats = _policy_term(x)
    if rollout_logp_BT is not None:
        pg_BT = _rollout_terms(pg_BT, x, x.old_logp_BT - rollout_logp_BT.detach().to(dt), stats)
    pg_loss = agg(pg_BT)
    stats["train/pg_loss"] = pg_loss.detach()
    loss = _with_penalties(pg_loss, x, agg, ref_logp_BT, entropy_BT, stats)
    values = torch.stack(list(stats.values())).tolist()  # one device sync for all metrics
    return loss, dict(zip(stats, values))


def _policy_term(x: PolicyInputs) -> tuple[Tensor, dict[str, Tensor]]:
    """The registered policy loss cfg.policy on x: its per-token loss [B, T] and a copy of its metrics."""
    pg_BT, stats = _POLICY_LOSSES[x.cfg.policy](x)
    if not isinstance(pg_BT, Tensor) or tuple(pg_BT.shape) != tuple(x.mask_BT.shape):
        got = tuple(pg_BT.shape) if isinstance(pg_BT, Tensor) else type(pg_BT).__name__
        raise ValueError(f"policy loss '{x.cfg.policy}' returned a per-token loss of shape {got}; it must "
                         f"return [B, T] = {tuple(x.mask_BT.shape)} (PolicyLossFn)")
    return pg_BT, dict(stats)


def _rollout_terms(pg_BT: Tensor, x: PolicyInputs, diff_BT: Tensor, stats: dict[str, Tensor]) -> Tensor:
    """The per-token policy loss weighted by TIS (as is for tis=none), from the old - rollout log-prob differences
    diff_BT; adds the train/rollout_logprob_abs_diff metrics (and TIS's) to `stats`."""
    m_BT = x.mask_BT
    stats["train/rollout_logprob_abs_diff"] = x.token_mean(diff_BT.abs())
    gap_BT = torch.where(m_BT, diff_BT.detach().abs().float(), math.nan)  # NaN: not a loss token
    p99 = torch.nanquantile(gap_BT.reshape(-1), 0.99) if gap_BT.numel() else gap_BT.new_zeros(())
    stats["train/rollout_logprob_abs_diff_p99"] = torch.nan_to_num(p99, nan=0.0).to(diff_BT.dtype)  # no bool index
    weight_BT = _tis_weights(_masked(diff_BT, m_BT), m_BT, x.cfg, stats, x.token_mean)
    return pg_BT if weight_BT is None else pg_BT * weight_BT


def _with_penalties(loss: Tensor, x: PolicyInputs, agg: Callable[[Tensor], Tensor], ref_logp_BT: Tensor | None,
                    entropy_BT: Tensor | None, stats: dict[str, Tensor]) -> Tensor:
    """loss + kl_coef * agg(KL estimate) - entropy_coef * agg(entropy) (each term with its tensor and coef > 0);
    adds train/kl and train/entropy (with their tensors) to `stats`."""
    cfg, dt = x.cfg, x.logp_BT.dtype
    if ref_logp_BT is not None:
        kl_BT = _kl(_masked(x.logp_BT - ref_logp_BT.detach().to(dt), x.mask_BT), cfg.kl_estimator)
        stats["train/kl"] = x.token_mean(kl_BT.detach())
        if cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * agg(kl_BT)
    if entropy_BT is not None:
        ent_BT = entropy_BT.to(dt)
        stats["train/entropy"] = x.token_mean(ent_BT.detach())
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * agg(ent_BT)
    return loss


def _masked(x_BT: Tensor, m_BT: Tensor) -> Tensor:
    """x where the mask is set, 0 elsewhere (also when x is non-finite there; its gradient there is 0)."""
    return torch.where(m_BT, x_BT, torch.zeros((), dtype=x_BT.dtype, device=x_BT.device))


def _masked_max(x_BT: Tensor, m_BT: Tensor) -> Tensor:
    """The max of x over masked entries; 0 when there is none."""
    zero = torch.zeros((), dtype=x_BT.dtype, device=x_BT.device)
    if x_BT.numel() == 0:
        return zero
    return torch.where(m_BT.any(), torch.where(m_BT, x_BT, -math.inf).amax(), zero)


def _clipped_surrogate(ratio_BT: Tensor, adv_B1: Tensor, cfg: LossConfig) -> tuple[Tensor, Tensor, Tensor | None]:
    """Per-token loss [B, T], where the clip binds (bool [B, T]) and, with dual clip, where the cap binds."""
    surr_BT = ratio_BT * adv_B1
    clipped_surr_BT = ratio_BT.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high) * adv_B1
    loss_BT = -torch.minimum(surr_BT, clipped_surr_BT)
    clipped_BT = (clipped_surr_BT < surr_BT).detach()
    if cfg.dual_clip_c is None:
        return loss_BT, clipped_BT, None
    cap_B1 = -cfg.dual_clip_c * adv_B1
    dual_BT = ((adv_B1 < 0) & (loss_BT > cap_B1)).detach()
    return torch.where(dual_BT, cap_B1.expand_as(loss_BT), loss_BT), clipped_BT, dual_BT


def _tis_weights(
    diff_BT: Tensor, m_BT: Tensor, cfg: LossConfig, stats: dict[str, Tensor], token_mean: Callable[[Tensor], Tensor]
) -> Tensor | None:
    """The TIS weights [B, T] from masked old - rollout log-prob differences (None for tis=none); adds their
    metrics to `stats`."""
    if cfg.tis == "none":
        return None
    if cfg.tis == "token_truncate":
        weight_BT = torch.exp(diff_BT).clamp(max=cfg.tis_clip)
    else:
        # the geometric mean over the row's tokens: a sum would mask long rows at a per-token drift that short rows
        # pass (in partial mode the long rows are the stale ones); ratio in [1/b, b], in log space
        n_B = m_BT.sum(dim=1).clamp(min=1)
        keep_B = (diff_BT.sum(dim=1) / n_B).abs() <= math.log(cfg.tis_mask_bound)
        weight_BT = keep_B.to(diff_BT.dtype)[:, None].expand_as(diff_BT)
        has_B = m_BT.any(dim=1)
        stats["train/tis_masked_frac"] = (has_B & ~keep_B).sum().to(diff_BT.dtype) / has_B.sum().clamp(min=1)
    stats["train/tis_weight_mean"] = token_mean(weight_BT)
    return weight_BT


def _kl(delta_BT: Tensor, estimator: str) -> Tensor:
    """Per-token KL estimate [B, T] from d = logp - ref_logp: k1 d, k2 d^2 / 2, k3 exp(-d) + d - 1."""
    if estimator == "k1":
        return delta_BT
    if estimator == "k2":
        return 0.5 * delta_BT.square()
    return torch.expm1(-delta_BT) + delta_BT


def _aggregate(x_BT: Tensor, m_BT: Tensor, cfg: LossConfig, num_tokens: float | None,
               num_seqs: float | None) -> Tensor:
    """The masked per-token values reduced to a scalar by cfg.aggregation (denominators: see policy_loss)."""
    x_BT = _masked(x_BT, m_BT)
    seqs = num_seqs if num_seqs is not None else max(m_BT.shape[0], 1)
    if cfg.aggregation == "token_mean":
        tokens = num_tokens if num_tokens is not None else m_BT.sum().clamp(min=1)
        return x_BT.sum() / tokens
    if cfg.aggregation == "seq_mean":
        return (x_BT.sum(dim=1) / m_BT.sum(dim=1).clamp(min=1)).sum() / seqs
    return x_BT.sum() / (seqs * cfg.seq_sum_norm_len)


def _check_count(name: str, value: float | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}: must be None or a finite number > 0, got {value!r}")


def _check_inputs(logp_BT: Tensor, old_logp_BT: Tensor, adv_B: Tensor, mask_BT: Tensor, cfg: LossConfig,
                  rollout_logp_BT: Tensor | None, ref_logp_BT: Tensor | None, entropy_BT: Tensor | None) -> None:
    _check_float("logp_BT", logp_BT, 2)
    shape = tuple(logp_BT.shape)
    _check_float("old_logp_BT", old_logp_BT, 2, shape)
    _check_float("adv_B", adv_B, 1, shape[:1])
    _check_mask(mask_BT, shape)
    optional = (  # (name, tensor, the setting that requires it or None)
        ("rollout_logp_BT", rollout_logp_BT, f"cfg.tis={cfg.tis}" if cfg.tis != "none" else None),
        ("ref_logp_BT", ref_logp_BT, f"cfg.kl_coef={cfg.kl_coef}" if cfg.kl_coef > 0 else None),
        ("entropy_BT", entropy_BT, f"cfg.entropy_coef={cfg.entropy_coef}" if cfg.entropy_coef > 0 else None),
    )
    for name, x, required_by in optional:
        if x is not None:
            _check_float(name, x, 2, shape)
        elif required_by is not None:
            raise ValueError(f"{name}: required with {required_by}")


def _check_float(name: str, x: Tensor, ndim: int, shape: tuple[int, ...] | None = None) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: must be a tensor, got {type(x).__name__}")
    if x.dim() != ndim or (shape is not None and tuple(x.shape) != shape):
        want = f"{ndim}-D" if shape is None else f"shape {shape}"
        raise ValueError(f"{name}: must have {want}, got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{name}: must be a floating dtype, got {x.dtype}")


def _check_mask(mask_BT: Tensor, shape: tuple[int, ...]) -> None:
    if not isinstance(mask_BT, Tensor) or tuple(mask_BT.shape) != shape:
        got = tuple(mask_BT.shape) if isinstance(mask_BT, Tensor) else type(mask_BT).__name__
        raise ValueError(f"mask_BT: must have shape {shape}, got {got}")
    # a bool mask needs no check; a 0/1 one costs a device sync (the trainer passes bool masks)
    if mask_BT.dtype != torch.bool and not bool(((mask_BT == 0) | (mask_BT == 1)).all()):
        raise ValueError("mask_BT: values must be 0 or 1 (or a bool tensor)")
