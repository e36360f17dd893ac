"""One optimizer step of the policy on a step's rollouts: micro-batches by token budget, the trainer's own
log-probs of every response token, the policy loss (with the engine's log-probs for TIS and the mismatch metric,
and the adapter-off base as the KL reference), backward, then guarded AdamW updates over the LoRA parameters.

The loss of each micro-batch is computed with its update's totals (response tokens, sequences), so the
micro-batches' gradients add up to the gradient of the whole update (`losses.policy_loss`). Only samples in the
loss count: one with `in_loss=False` (overlong=mask) is left out of the update's forwards, its loss and both
normalisers. The metrics of an update do not depend on how it is cut into micro-batches (`_merge`).

By default a step is one on-policy update: the "old" log-probs are the trainer's own, detached, so the PPO ratio
is 1 and the engine's log-probs enter only through TIS (`loss.tis`) and `train/rollout_logprob_abs_diff`.
`minibatches: N` splits the step's groups into N minibatches, one update each (one pass, in order, as verl's
PPO minibatches and Miles' several steps per rollout do): every update after the first is off-policy, so the
ratio is taken against the policy before the step's first update, which `old_logprobs` names: `recompute` (one
no-grad forward over the step's samples before the first update) or `rollout` (the engine's sampling
log-probs, no extra forward; the ratio then also carries any trainer/engine mismatch). Under top-p / top-k those
are the engine's unfiltered log-probs (`pack`), so the ratio starts at 1 up to that mismatch, not below it.
With one minibatch and LoRA dropout on (`lora.dropout` > 0) under TIS, `recompute` makes that no-grad forward
too: the TIS weight exp(proximal - engine) must compare the policy with the engine, not one dropout sample of it
(measured on k3_tiny, adapter B ~ N(0, 0.02), dropout 0.1: the gradient forward's log-probs were 0.08 nats/token
from the policy's, so on-policy tokens, whose weight is 1, got weights from 0.66 to 1.38); the ratio then carries
the dropout noise, as it does with several minibatches. A non-finite loss or gradient skips that update (the adapter keeps its last good values) and is reported (train/skipped); a step with
no sample in the loss (no samples at all, e.g. dynamic sampling kept no group, or every one masked) makes no
update and is reported apart from it (train/empty_step).

Every no-grad forward of the policy (the old log-probs, the KL reference, `sequence_logprobs`) runs with the model
in eval mode, so LoRA dropout is off and they are deterministic; the gradient forward runs in the model's own mode
(train mode: dropout on).

Routes (`rollout.return_routed_experts`, `routing_replay`): with the engine's routes on every sample, each forward
over a micro-batch records the trainer's own top-k, and train/route_mismatch_frac is the share of loss tokens
whose experts differ from the engine's in at least one MoE layer; with routing_replay the forwards use the
engine's routes instead (`_routes`: the replay spans the backward, which may recompute layers).

Expert parallelism across DP replicas (`parallel.lockstep`): a forward is a collective of ranks that hold different
samples, so every loop over micro-batches runs as many iterations on every rank (the max of the ranks' counts); a
rank past its own micro-batches runs an idle micro-step (one pad token, the same forwards and backward as a
micro-step, loss zero), and a micro-step whose loss is not finite still runs its backward (the update is skipped
on every rank anyway).
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field

import torch

from miles_k3.model.lora import adapters_disabled
from miles_k3.model.parallelize import vocab_shard
from miles_k3.model.routing import mismatched_tokens, recording, replaying
from miles_k3.parallel.lockstep import Lockstep
from miles_k3.parallel.mesh import SINGLE, ParallelContext
from miles_k3.parallel.reduce import all_ranks, gather, max_over, sum_over, world_of
from miles_k3.trainer.batch import Sample, micro_batches, pack
from miles_k3.trainer.logprobs import token_logprobs, token_logprobs_and_entropy
from miles_k3.trainer.losses import LossConfig, policy_loss
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
    autocast_bf16: str = "off"
    """off: the trainer computes in the model's dtype (`model.dtype`), as the native engine decodes; on: its forwards
    run under bf16 autocast (bf16 matmuls over the model's weights) whatever the model's dtype. With an fp32 model
    autocast makes the trainer bf16 against an fp32 engine: on one H200, an SFT'd k3_m2 with routing replay, the
    on-policy gap was 0.0059 nats/token under autocast and 3.1e-7 without (docs/concepts/train-rollout-gap.md). Once `auto`,
    which turned autocast on for any fp32 model on CUDA: refused now, with that reason."""
    activation_checkpointing: bool = False
    """Keep only each decoder layer's inputs in the forward pass and recompute the rest in backward: activation
    memory of one layer instead of all, for about one more forward pass of time."""
    minibatches: int = 1
    """Optimizer updates per step: the step's GRPO groups split in order into this many minibatches of whole
    groups, one update each (fewer when fewer groups are kept). The LR schedule counts updates."""
    old_logprobs: str = "recompute"
    """The ratio's old policy: recompute (the trainer's log-probs before the step's first update; with one
    minibatch they are the current ones, no extra forward, unless LoRA dropout is on under TIS: then an eval-mode
    forward, so the TIS weights carry no dropout noise) or rollout (the engine's log-probs of its tokens under
    the whole vocabulary: the unfiltered ones under rollout.top_p < 1 or top_k; refused with engine.backend=sglang
    there, which reports only the filtered ones)."""
    routing_replay: bool = False
    """Rollout routing replay (R3): every forward over a sample (the gradient forward, the old log-probs, the KL
    reference) routes each token to the experts the engine chose for it (the engine returns them: implies
    rollout.return_routed_experts), the gate weights computed from the trainer's own router scores at those
    experts. train/route_mismatch_frac then counts the tokens whose own top-k differs."""

    def validate(self) -> None:
        if self.micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens: must be >= 1, got {self.micro_batch_tokens}")
        if isinstance(self.minibatches, bool) or not isinstance(self.minibatches, int) or self.minibatches < 1:
            raise ValueError(f"minibatches: must be an integer >= 1 (optimizer updates per step), got "
                             f"{self.minibatches!r}")
        if self.old_logprobs not in OLD_LOGPROBS:
            raise ValueError(f"old_logprobs: '{self.old_logprobs}' is not one of {', '.join(OLD_LOGPROBS)}")
        if self.autocast_bf16 == "auto":
            raise ValueError("autocast_bf16: 'auto' is gone: it ran an fp32 model's trainer under bf16 autocast "
                             "while the engine decoded in fp32 (an on-policy gap of 0.0059 nats/token against "
                             "3.1e-7); use off (the default: the model's dtype) or on (bf16 autocast)")
        if self.autocast_bf16 not in ("on", "off"):
            raise ValueError(f"autocast_bf16: '{self.autocast_bf16}' is not one of on, off")


def train_step(model, samples: list[Sample], cfg: TrainerConfig, opt, sched, params: dict, pad_id: int,
               device: torch.device, temperature: float = 1.0, ctx: ParallelContext = SINGLE) -> dict[str, float]:
    """Backward over every micro-batch of each minibatch of `samples`, one optimizer update per minibatch (see the
    module docstring). Log-probs are of logits / `temperature` (the rollouts' sampling temperature; 0 = greedy
    counts as 1), the policy the engine sampled from and whose log-probs it reports (without top-p / top-k
    filtering).

    Metrics under train/ (of one update: see `_update`; of several: `_combine`), always with
    train/updates (updates applied), train/num_tokens and train/num_seqs (response tokens and sequences in the
    loss), train/skipped (1.0 when there was something to train on but no update was applied: non-finite loss
    or gradients) and train/empty_step (1.0 when no sample is in the loss, `samples` may be empty: nothing is
    computed, train/skipped is 0.0; else 0.0).

    Data parallel (ctx.dp_size > 1): `samples` are this replica's part of the step's (Sample.group: the group's
    index in the whole step, `collect_rollouts`). Every rank takes part in every update, with or without samples
    of its own in it: the loss normalisers are the totals over all replicas, the gradients are summed over them
    (`grads.reduce_gradients`) and clipped by their global norm, so the update is the one a single process makes
    over all the samples; whether a step is empty, which minibatches are updates and whether an update is
    skipped are decided on global values, the same on every rank; the metrics are the global ones."""
    cfg.validate()
    temperature = temperature if temperature > 0 else 1.0
    if not sum_over([float(sum(map(_in_loss, samples)))], ctx.dp_group)[0]:
        return {"train/skipped": 0.0, "train/empty_step": 1.0, "train/num_tokens": 0.0, "train/num_seqs": 0.0,
                "train/updates": 0.0}
    old = "current"
    if cfg.old_logprobs == "rollout":
        missing = [i for i, s in enumerate(samples) if not s.rollout_logprobs]
        if missing:
            raise ValueError(f"trainer.old_logprobs=rollout: sample {missing[0]} has no engine log-probs (the rollout "
                             "must return them); use trainer.old_logprobs=recompute")
        old = "rollout"
    elif cfg.minibatches > 1 or (cfg.loss.tis != "none" and _dropout_on(model)):
        fill_old_logprobs(model, [s for s in samples if _in_loss(s)], cfg, pad_id, device, temperature, ctx)
        old = "old"
    results = [_update(model, part, cfg, opt, sched, params, pad_id, device, temperature, old, ctx)
               for part in split_minibatches(samples, cfg.minibatches, ctx)]
    return _combine(results) | {"train/empty_step": 0.0}


def _dropout_on(model) -> bool:
    """The gradient forward drops out (LoRA dropout > 0, the model in train mode): its log-probs are one dropout
    sample of the policy, so TIS weights taken from them would carry that noise (`train_step` then takes the
    proximal log-probs from an eval-mode forward)."""
    return any(isinstance(m, torch.nn.Dropout) and m.p > 0 and m.training for m in model.modules())


def _in_loss(s: Sample) -> bool:
    """The sample has response tokens that count in the loss."""
    return s.in_loss and bool(s.response_ids)


def split_minibatches(samples: list[Sample], n: int, ctx: ParallelContext = SINGLE) -> list[list[Sample]]:
    """`samples` in order as up to `n` minibatches of whole groups (consecutive runs of equal Sample.group), the
    groups shared out as evenly as possible; minibatches with no token in the loss are left out. Data parallel:
    the step's groups over all replicas are shared out (by Sample.group, the global index), each replica's
    minibatch k holds its part of the global minibatch k (possibly none), and a minibatch is left out when no
    replica has a token in the loss in it."""
    groups: list[list[Sample]] = []
    for s in samples:
        if groups and groups[-1][0].group == s.group:
            groups[-1].append(s)
        else:
            groups.append([s])
    if ctx.dp_size == 1:
        index, num_groups = list(range(len(groups))), len(groups)
    else:
        index = [g[0].group for g in groups]
        num_groups = int(max_over([float(max(index, default=-1) + 1)], ctx.dp_group)[0])
    n = min(n, num_groups)
    bounds = [num_groups * k // n for k in range(n + 1)]
    parts = [[s for g, i in zip(groups, index) if bounds[k] <= i < bounds[k + 1] for s in g] for k in range(n)]
    has_loss = sum_over([float(any(_in_loss(s) for s in p)) for p in parts], ctx.dp_group)
    return [p for p, h in zip(parts, has_loss) if h]


@torch.no_grad()
def sequence_logprobs(model, ids: list[int], cfg: TrainerConfig | None = None) -> list[float]:
    """The policy's log-probs of ids[1:] given their prefixes, computed as the training forward computes them
    (adapter on, `cfg`'s autocast) but in eval mode (no dropout; the modules' training flags are restored after):
    what an engine's log-probs of the same tokens are checked against."""
    cfg = cfg or TrainerConfig()
    device = next(model.parameters()).device
    x = torch.tensor([ids], device=device)
    with _eval_mode(model), _autocast(model, cfg):
        logits = model(x[:, :-1], seq_lens=torch.tensor([len(ids) - 1], device=device)).logits
    return token_logprobs(logits.float(), x[:, 1:], vocab_shard=vocab_shard(model))[0].tolist()


@torch.no_grad()
def fill_old_logprobs(model, samples: list[Sample], cfg: TrainerConfig, pad_id: int, device: torch.device,
                      temperature: float, ctx: ParallelContext = SINGLE) -> None:
    """Sets each sample's old_logprobs: the current policy's log-prob of every response token (the forward the
    training pass makes, without gradients and in eval mode: no dropout). In lockstep, idle forwards after this
    rank's own micro-batches."""
    batches = micro_batches(samples, cfg.micro_batch_tokens)
    total = Lockstep(ctx).steps(len(batches))  # agreed before any forward (each forward is a collective)
    for idx in batches:
        mb = pack([samples[i] for i in idx], pad_id, model.config.vocab_size).to(device)
        logp = _batch_logprobs(model, mb, cfg, temperature).float().cpu()
        for row, i in enumerate(idx):
            s = samples[i]
            p, n = len(s.prompt_ids), s.length - 1
            s.old_logprobs = logp[row, p - 1:n].tolist()
    for _ in range(len(batches), total):
        _batch_logprobs(model, _idle_batch(pad_id, device), cfg, temperature)


def _update(model, samples: list[Sample], cfg: TrainerConfig, opt, sched, params: dict, pad_id: int,
            device: torch.device, temperature: float, old: str, ctx: ParallelContext) -> dict[str, float]:
    """One guarded optimizer update over the samples of `samples` that are in the loss (all their micro-batches;
    the others take no part). Its metrics: train/loss and train/pg_loss (each micro-batch's is normalised by
    the update's totals, so they are summed), the rest of `policy_loss`'s merged over micro-batches by `_merge`
    (the values one micro-batch of the whole update would give), optimizer_step's, train/num_tokens and
    train/num_seqs (the update's loss denominators: response tokens and sequences in the loss). Data parallel:
    all of them over every replica's samples (see `train_step`); a non-finite loss on any rank skips the update
    on every rank."""
    samples = [s for s in samples if _in_loss(s)]
    num_tokens, num_seqs = sum_over([float(sum(s.num_loss_tokens for s in samples)), float(len(samples))],
                                    ctx.dp_group)
    counts = {"train/num_tokens": num_tokens, "train/num_seqs": num_seqs}
    totals = {"num_tokens": num_tokens, "num_seqs": num_seqs, "temperature": temperature}
    has_rollout = all(s.rollout_logprobs for s in samples)  # per update: every micro-batch gets the same terms
    parts: list[tuple[dict[str, float], float, float]] = []
    loss_total, finite = 0.0, True
    batches, lockstep = micro_batches(samples, cfg.micro_batch_tokens), Lockstep(ctx)
    for k in range(lockstep.steps(len(batches))):
        if k >= len(batches) or not finite:  # lockstep: this rank's part in the others' micro-steps
            _idle_micro_step(model, _idle_batch(pad_id, device), cfg, totals["temperature"])
            continue
        idx = batches[k]
        mb = pack([samples[i] for i in idx], pad_id, model.config.vocab_size).to(device)
        loss, m = _micro_step(model, mb, cfg, totals, has_rollout, old, backward_always=lockstep.active)
        if not math.isfinite(loss):
            finite = False
            if lockstep.active:
                continue
            break
        loss_total += loss
        parts.append((m, float(sum(samples[i].num_loss_tokens for i in idx)), float(len(idx))))  # no device sync
    if not all_ranks(finite, world_of(ctx)):
        opt.zero_grad(set_to_none=True)  # nothing of this update may reach the adapter
        return {"train/skipped": 1.0, "train/loss": float("nan"), **counts}
    _synchronize(device)  # the backward's kernels finish before the optimizer's clock starts
    t = time.perf_counter()
    out = optimizer_step(opt, sched, params, cfg.optim, ctx=ctx)
    _synchronize(device)
    out["perf/optimizer_s"] = time.perf_counter() - t
    merged = _merge_replicas(_merge(parts, summed=("train/pg_loss",)), loss_total, parts, ctx)
    loss_total = merged.pop("train/loss")
    return {**merged, **out, "train/loss": loss_total, **counts}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _merge_replicas(metrics: dict[str, float], loss: float, parts: list, ctx: ParallelContext) -> dict[str, float]:
    """One update's micro-batch metrics (`metrics`, merged over this rank's `parts`) and its loss over every DP
    replica: the loss and train/pg_loss summed (each rank's is normalised by the global totals), the others
    merged as `_merge` merges micro-batches (weighted by each replica's tokens and rows in the loss)."""
    metrics = {**metrics, "train/loss": loss}
    if ctx.dp_size == 1:
        return metrics
    mine = (metrics, sum(p[1] for p in parts), sum(p[2] for p in parts))
    return _merge(gather(mine, ctx.dp_group), summed=("train/pg_loss", "train/loss"))


def _combine(results: list[dict[str, float]]) -> dict[str, float]:
    """The step's metrics from its updates': one update's as they are; else, over the applied updates, `_merge`
    with the updates' train/num_tokens and train/num_seqs as weights: train/loss, train/pg_loss and
    train/grad_norm are token-weighted means of the updates' (each normalised by its own update's totals),
    train/ratio_max the max, train/tis_masked_frac row-weighted; train/lr is the first applied update's, train/num_tokens and train/num_seqs the
    sums over all updates."""
    applied = [r for r in results if r["train/skipped"] == 0.0]
    counts = {k: sum(r.get(k, 0.0) for r in results) for k in ("train/num_tokens", "train/num_seqs",
                                                               "perf/optimizer_s")}
    if len(results) == 1:
        return {**results[0], "train/updates": float(len(applied))}
    if not applied:
        return {"train/skipped": 1.0, "train/loss": float("nan"), **counts, "train/updates": 0.0}
    out = _merge([({k: v for k, v in r.items() if k != "perf/optimizer_s"}, r["train/num_tokens"],
                   r["train/num_seqs"]) for r in applied])
    return out | {"train/lr": applied[0]["train/lr"], **counts, "train/skipped": 0.0,
                  "train/updates": float(len(applied))}


_MAXED = ("train/ratio_max", "train/rollout_logprob_abs_diff_p99")  # p99: the largest micro-batch's (exact for one)
_PER_ROW = ("train/tis_masked_frac",)  # a fraction of the rows with tokens in the loss


def _merge(parts: list[tuple[dict[str, float], float, float]], summed: tuple[str, ...] = ()) -> dict[str, float]:
    """Metrics of parts (micro-batches, or updates) as (metrics, tokens in the loss, rows in the loss) merged
    into the whole's: a key of `summed` is summed, train/ratio_max is the max, train/tis_masked_frac the
    row-weighted mean, every other key the token-weighted mean (each over the parts that report it)."""
    out: dict[str, float] = {}
    for k in dict.fromkeys(k for m, _, _ in parts for k in m):
        have = [(m[k], tokens, rows) for m, tokens, rows in parts if k in m]
        if k in summed:
            out[k] = sum(v for v, _, _ in have)
        elif k in _MAXED:
            out[k] = max(v for v, _, _ in have)
        else:
            col = 2 if k in _PER_ROW else 1
            weight = sum(p[col] for p in have)
            out[k] = sum(p[0] * p[col] for p in have) / weight if weight else 0.0
    return out


def _micro_step(model, mb, cfg: TrainerConfig, totals: dict, has_rollout: bool,
                old: str = "current", backward_always: bool = False) -> tuple[float, dict[str, float]]:
    """Forward, loss and backward of one micro-batch; a non-finite loss skips the backward unless
    `backward_always` (lockstep: the backward's all-to-alls pair with the other ranks')."""
    routes = _routes(model, mb, cfg)
    with routes as recorder, _autocast(model, cfg), _recompute(model, cfg.activation_checkpointing):
        logits = model(mb.input_ids_BT, seq_lens=mb.seq_lens_B).logits
    if totals["temperature"] != 1.0:
        logits = logits / totals["temperature"]
    logp, entropy = token_logprobs_and_entropy(logits, mb.targets_BT, vocab_shard=vocab_shard(model),
                                               with_entropy=cfg.loss.entropy_coef > 0)
    ref = _reference_logprobs(model, mb, cfg, totals["temperature"]) if cfg.loss.kl_coef > 0 else None
    old_logp = {"current": logp.detach(), "old": mb.old_logp_BT, "rollout": mb.rollout_logp_BT}[old]
    mask_BT = mb.mask_BT.bool()  # pack makes it 0/1: as bool, policy_loss has no values to check (no device sync)
    loss, metrics = policy_loss(logp, old_logp, mb.adv_B, mask_BT, cfg.loss,
                                rollout_logp_BT=mb.rollout_logp_BT if has_rollout else None,
                                ref_logp_BT=ref, entropy_BT=entropy, num_tokens=totals["num_tokens"],
                                num_seqs=totals["num_seqs"])
    if old == "rollout" and has_rollout:  # the old log-probs ARE the engine's: the gap is the current policy's
        gap_BT = torch.where(mask_BT, logp.detach().float() - mb.rollout_logp_BT.float(), 0.0).abs()
        metrics["train/rollout_logprob_abs_diff"] = float(gap_BT.sum() / mask_BT.sum().clamp(min=1))
    if recorder is not None:
        metrics["train/route_mismatch_frac"] = _mismatch_frac(recorder, mb)
    value = float(loss.detach())
    if math.isfinite(value) or backward_always:
        with _routes(model, mb, cfg, replay_only=True):  # a recomputed layer replays the same routes
            loss.backward()
    return value, metrics


def _routes(model, mb, cfg: TrainerConfig, replay_only: bool = False):
    """The routing context of a forward over `mb`: replaying its routes (routing_replay), recording the trainer's
    own top-k beside them (routes known, no replay; not for `replay_only`, the backward), or nothing (yields
    None)."""
    routes = mb.routes_NLK
    if routes is None:
        if cfg.routing_replay:
            raise ValueError("trainer.routing_replay: a sample has no routes (the engine must return them: "
                             "rollout.return_routed_experts, implied by routing_replay in the loop)")
        return contextlib.nullcontext()
    if cfg.routing_replay:
        return replaying(model, routes)
    return contextlib.nullcontext() if replay_only else recording(model)


def _mismatch_frac(recorder, mb) -> float:
    """The share of mb's loss tokens whose own experts (recorded) differ from its routes in >= 1 layer."""
    m_N = mb.mask_BT.reshape(-1).bool()
    if not m_N.any():
        return 0.0
    differ = mismatched_tokens(recorder.routes()[m_N], mb.routes_NLK.to(m_N.device)[m_N])
    return float(differ.float().mean())


def _idle_batch(pad_id: int, device: torch.device):
    """The micro-batch of an idle micro-step: one row of one pad token."""
    return pack([Sample([pad_id], [pad_id], [], 0.0)], pad_id, pad_id + 1).to(device)


def _idle_micro_step(model, mb, cfg: TrainerConfig, temperature: float) -> None:
    """The forwards and backward a micro-step makes (`_micro_step`: the policy forward under the same autocast and
    activation checkpointing, the KL reference forward when kl_coef > 0, one backward), on one pad token and with a
    loss of zero: in lockstep, this rank's part in another rank's micro-step. Every gradient it adds is zero."""
    with _autocast(model, cfg), _recompute(model, cfg.activation_checkpointing):
        logits = model(mb.input_ids_BT, seq_lens=mb.seq_lens_B).logits
    if cfg.loss.kl_coef > 0:
        _reference_logprobs(model, mb, cfg, temperature)
    (logits.float().sum() * 0.0).backward()


@torch.no_grad()
def _reference_logprobs(model, mb, cfg: TrainerConfig, temperature: float) -> torch.Tensor:
    """The frozen base's log-probs (the adapter switched off: no second copy of the model)."""
    with adapters_disabled(model):
        return _batch_logprobs(model, mb, cfg, temperature)


@torch.no_grad()
def _batch_logprobs(model, mb, cfg: TrainerConfig, temperature: float) -> torch.Tensor:
    """The model's log-prob [B, T] of each target of `mb`, from the forward the training pass makes (without
    gradients, and in eval mode: no dropout; replaying mb's routes under routing_replay)."""
    with _routes(model, mb, cfg, replay_only=True), _eval_mode(model), _autocast(model, cfg):
        logits = model(mb.input_ids_BT, seq_lens=mb.seq_lens_B).logits
    return token_logprobs(logits / temperature, mb.targets_BT, vocab_shard=vocab_shard(model))


@contextlib.contextmanager
def _eval_mode(model):
    """The model in eval mode (LoRA dropout off: a deterministic forward) for the block; every module's training
    flag is restored after it, as it was (a model partly in eval mode stays so)."""
    was = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in was:
            m.training = training


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
    """bf16 autocast on the model's device with autocast_bf16=on; nothing with off."""
    if cfg.autocast_bf16 != "on":
        return contextlib.nullcontext()
    return torch.autocast(next(model.parameters()).device.type, dtype=torch.bfloat16)
