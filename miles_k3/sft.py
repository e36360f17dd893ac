"""`python -m miles_k3.sft data.source=FILE [mode=full|lora] [recipe=NAME] [overrides]`: supervised
fine-tuning on (problem, answer) pairs (Hydra app): full-parameter (e.g. a small shipped config trained from
its random init on a generated task) or a LoRA adapter on a frozen base, with the model, data, eval and
tracking machinery of `python -m miles_k3.train`.

It composes `recipes/sft.yaml`, validates every field (a bad value fails before any work, naming the field),
seeds torch/python/numpy, and runs:

    load problems -> build the model (full: bf16 routed experts, every parameter trains; lora: the adapter
    trains, the base stays frozen) -> AdamW + LR schedule -> per step: `batch_size` problems from a seeded
    stream -> prompt ids (the template rendered and tokenized exactly as the RL rollouts do) + target ids (the
    gold answer + eos) -> mean cross-entropy over the target tokens -> clipped AdamW step -> log every
    `log_every` -> eval every `eval.every_n_steps` and at the end (eval.at_start: also before step 1) -> save

With `env=guess transcripts=guess_random` an example is instead a multi-turn transcript of the environment played by
an imperfect policy (`sft_examples.guess_transcript`: the tokens an episode of the same guesses holds, observations tokenized on
their own and masked out of the loss), and the eval plays held-out episodes (`trainer.episode_eval`).

Evaluation runs the eval harness through the rollout engine, which shares the trained model's base tensors:
in full mode the engine sees every update in place; in lora mode the current adapter is pushed into the engine
before each evaluation. The result goes to `run_dir` (default runs/sft-<date>-<time>): `model/` in full
mode (a checkpoint directory with its tokenizer: `model.path=<run_dir>/model` loads it for train, eval or
more SFT), `adapter/` in lora mode (PEFT; `python -m miles_k3.eval adapter=<run_dir>/adapter`), plus
`config.yaml`, `metrics.jsonl`, `curves.png`, eval reports (`eval/step_N`) and Hydra's record (`.hydra/`,
`sft.log`). With the same seed, config and thread count on the CPU, two runs write bit-identical weights.

On CUDA, `model.dtype=auto` trains in bf16; for full-parameter training set `model.dtype=fp32` to keep fp32
master weights (the forward then runs under bf16 autocast).

Under torchrun (`torchrun --nproc-per-node N -m miles_k3.sft mode=lora parallel.tp=... parallel.ep=...`; full mode
runs in one process) every rank builds its shard of the base and of the adapter as training does (planned on the
meta device, only its slices of the checkpoint read; one line per rank on rank 0). Every rank draws the same batch
and DP replica r trains on its examples r, r + dp, ...: the loss is normalised by the whole batch's target tokens
and the adapter's gradients summed over the ranks that share them (`optimizer_step`), so a step is the one-process
step; in lockstep where an EP group spans replicas. The held-out figures are counted over the replicas' shares (the
same on every rank, so every rank stops together), the eval generates each replica's share, and rank 0 alone writes
the run directory, the metrics and the whole adapter.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from miles_k3.cli import hydra_app
from miles_k3.config import ConfigFieldError, exit_on_user_error, register_schemas, typed_or_exit
from miles_k3.envs.env import build_env
from miles_k3.evals.datasets import load_problems
from miles_k3.evals.harness import EvalHook, check_prompt_lengths, prompt_ids
from miles_k3.launch import StopFlag, seed_everything, silence_fla_cpu_warning
from miles_k3.model.adapter_stream import save_adapter_streamed
from miles_k3.model.build import ModelConfig, build_model, build_tokenizer, num_params, weights_dir
from miles_k3.model.config import ConfigError
from miles_k3.model.kernel_config import apply_kernels
from miles_k3.model.layers import reference_kernels
from miles_k3.model.lora import lora_parameters
from miles_k3.model.parallelize import vocab_shard
from miles_k3.model.ranks import end_ranks, start_ranks
from miles_k3.model.weight_writer import save_weights
from miles_k3.parallel.lockstep import Lockstep
from miles_k3.parallel.mesh import SINGLE, ParallelContext, naming_rank
from miles_k3.parallel.reduce import broadcast, sum_over, world_of
from miles_k3.parallel.vocab import vocab_argmax
from miles_k3.quantize import quantize_checkpoint
from miles_k3.rollout.engine import RolloutEngine
from miles_k3.rollout.factory import POLICY, build_engine
from miles_k3.sft_examples import encode_examples
from miles_k3.trainer.batch import Sample, TrainBatch, micro_batches, pack
from miles_k3.trainer.episode_eval import EpisodeEvalHook
from miles_k3.trainer.logprobs import token_logprobs
from miles_k3.trainer.optim import BadStepGuard, OptimConfig, build_optimizer, build_scheduler, optimizer_step
from miles_k3.trainer.rollouts import PromptStream
from miles_k3.utils.atomic import atomic_write_text
from miles_k3.utils.runtime import CompileCounter, kernel_list, resolve_dtype, set_threads
from miles_k3.utils.tracking import NullTracker, Tracker

log = logging.getLogger("miles_k3.sft")
register_schemas()


@dataclass
class SFTResult:
    """What `train_sft` did: per-step losses, the last eval's metrics, where the result went."""

    run_dir: Path
    saved: Path
    """`run_dir/model` (full mode) or `run_dir/adapter` (lora mode)."""
    losses: list[float]
    """The training loss of every step (NaN for a step whose update was skipped)."""
    evals: dict[int, dict[str, float]]
    """eval/ metrics by step (0: before training, with eval.at_start); empty without eval."""
    seconds: float
    model: nn.Module
    tokenizer: Any
    engine: RolloutEngine | None
    is_main: bool = True
    """Rank 0 of a torchrun launch, or one process: the rank that wrote the run directory and holds `evals`."""

    @property
    def final_loss(self) -> float:
        return self.losses[-1]

    @property
    def eval_metrics(self) -> dict[str, float] | None:
        """The last evaluation's eval/ metrics (after the last step); None without eval."""
        return self.evals[max(self.evals)] if self.evals else None

    def summary_line(self) -> str:
        acc = ""
        key = next((k for k in self.eval_metrics or {} if k.startswith("eval/avg@")), None)
        if key:
            series = " -> ".join(f"{self.evals[s][key]:.4f}" for s in sorted(self.evals))
            acc = f", eval {key.removeprefix('eval/')} {series}"
        return (f"sft: {len(self.losses)} steps, loss {self.losses[0]:.4f} -> {self.final_loss:.4f}{acc}; "
                f"saved {self.saved}; {self.seconds:.1f}s")


def model_config_for(cfg) -> ModelConfig:
    """cfg.model as built for cfg.mode: full mode trains the routed experts, so experts=auto becomes bf16
    (MXFP4 storage is frozen; `SFTConfig.validate` refuses experts=mxfp4 in full mode)."""
    if cfg.mode == "full" and cfg.model.experts == "auto":
        return dataclasses.replace(cfg.model, experts="bf16")
    if cfg.mode == "full" and cfg.model.experts != "bf16":
        raise ConfigFieldError(f"model.experts: mode=full trains the routed experts and needs bf16, got "
                               f"{cfg.model.experts}")
    return cfg.model


def sft_loss(model: nn.Module, batch: TrainBatch, num_targets: float | None = None) -> torch.Tensor:
    """Cross-entropy summed over the target tokens of the batch (`mask_BT`) divided by `num_targets` (None: the
    batch's own target tokens, the mean -log p(target | prefix)). Under tensor parallelism the softmax is
    vocab-parallel (the logits stay split); every rank of the TP group gets the same loss."""
    with _autocast(model):
        logits = model(batch.input_ids_BT, seq_lens=batch.seq_lens_B).logits
    logp_BT = token_logprobs(logits, batch.targets_BT, vocab_shard=vocab_shard(model))
    denominator = batch.mask_BT.sum() if num_targets is None else num_targets
    return -(logp_BT * batch.mask_BT).sum() / denominator


def sft_backward(model: nn.Module, examples: list[Sample], pad_id: int, device: torch.device,
                 micro_batch_tokens: int = 0, checkpointing: bool = False, num_targets: float | None = None,
                 ctx: ParallelContext = SINGLE) -> tuple[float, int]:
    """The step's mean target cross-entropy over `examples`, its gradient accumulated into the parameters one
    micro-batch (`micro_batch_tokens` padded tokens; 0: all at once) at a time, each micro-batch's loss normalised by
    `num_targets`, the whole step's target tokens (None: those of `examples`), so the gradients add up to the
    one-batch gradient. The backward runs whatever the loss: the host reads the losses once, after the last
    backward (a read after each forward held the host until the GPU had caught up); a non-finite loss makes
    `optimizer_step` skip the update, on every rank. Returns (the loss, the step's tokens).

    On many ranks (`ctx`) `examples` are this DP replica's share of the step and `num_targets` the whole step's: the
    loss and the tokens returned are summed over the replicas, the same on every rank. Where an EP group spans
    replicas (`Lockstep`) every rank runs as many micro-batches as the rank with the most, past its own an idle
    one (one pad token, a loss of zero)."""
    parts = micro_batches(examples, micro_batch_tokens) if micro_batch_tokens else [list(range(len(examples)))]
    batches = [pack([examples[i] for i in idx], pad_id, model.config.vocab_size) for idx in parts if idx]
    num_targets = float(sum(s.num_loss_tokens for s in examples)) if num_targets is None else num_targets
    lockstep = Lockstep(ctx)
    losses, was = [], model.activation_checkpointing
    model.activation_checkpointing = checkpointing
    try:
        for k in range(lockstep.steps(len(batches))):
            if k >= len(batches):  # lockstep only: this rank's part in the others' micro-batches
                _idle_step(model, pad_id, device)
                continue
            loss = sft_loss(model, batches[k].to(device), num_targets)
            loss.backward()
            losses.append(loss.detach())
    finally:
        model.activation_checkpointing = was
    total = float(torch.stack(losses).double().sum()) if losses else 0.0  # the step's one read of its loss
    tokens = sum(int(b.seq_lens_B.sum()) for b in batches)
    if ctx.dp_size == 1:
        return total, tokens
    total, tokens = sum_over([total, float(tokens)], ctx.dp_group)
    return total, int(tokens)


def _idle_step(model: nn.Module, pad_id: int, device: torch.device, backward: bool = True) -> None:
    """The forward (and, with `backward`, the backward) of one pad token with a loss of zero: in lockstep, this
    rank's part in another rank's forward and backward; every gradient it adds is zero."""
    batch = pack([Sample([pad_id], [pad_id])], pad_id, model.config.vocab_size).to(device)
    with _autocast(model), torch.set_grad_enabled(backward):
        logits = model(batch.input_ids_BT, seq_lens=batch.seq_lens_B).logits
    if backward:
        (logits.float().sum() * 0.0).backward()


def trainable_parameters(model: nn.Module, cfg) -> dict[str, nn.Parameter]:
    """full: every parameter of the model, made trainable; lora: the Parameters of the adapter `build_model`
    attached (`cfg.lora`; the base frozen)."""
    if cfg.mode == "lora":
        return lora_parameters(model)
    model.requires_grad_(True)
    return dict(model.named_parameters())


def build_full_optimizer(params: dict[str, nn.Parameter], cfg: OptimConfig,
                         fused: bool | None = None) -> torch.optim.AdamW:
    """AdamW over every parameter (`trainer.optim.build_optimizer` takes adapters only, on purpose), with the
    OptimConfig's lr, betas, eps; weight decay on the matrices only (not on norms, biases, A_log, ...). `fused` (None:
    on CUDA) takes the fused implementation: one pass over each tensor (the foreach one makes one per arithmetic
    step) and no host read of each parameter's step count (~900 a k3_m2 step)."""
    cfg.validate()
    decay = [p for p in params.values() if p.ndim >= 2]
    rest = [p for p in params.values() if p.ndim < 2]
    groups = [{"params": ps, "weight_decay": wd} for ps, wd in ((decay, cfg.weight_decay), (rest, 0.0)) if ps]
    if fused is None:
        fused = bool(params) and all(p.is_cuda for p in params.values())
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.betas[0], cfg.betas[1]), eps=cfg.eps, fused=fused)


def train_sft(cfg, raw_yaml: str = "") -> SFTResult:
    """The whole SFT run of a validated SFTConfig (see the module docstring). Under torchrun every rank calls it
    (its place in the mesh from `start_ranks`); the process group stays up (`end_ranks` at the command's end)."""
    t0 = time.perf_counter()
    seed_everything(cfg.seed)
    ctx, device = start_ranks(cfg.model, cfg.parallel, cfg.device)  # first: the other ranks then log warnings only
    set_threads(cfg.threads)
    with naming_rank(ctx):
        return _train_sft(cfg, raw_yaml, ctx, device, t0)


def _train_sft(cfg, raw_yaml: str, ctx: ParallelContext, device: torch.device, t0: float) -> SFTResult:
    run_dir = Path(broadcast(cfg.run_dir or f"runs/sft-{time.strftime('%Y%m%d-%H%M%S')}", world_of(ctx)))
    target = run_dir / ("model" if cfg.mode == "full" else "adapter")
    if target.exists():
        raise ConfigFieldError(f"run_dir: {target} already exists; choose another run_dir (a result is never "
                               "overwritten)")
    problems = load_problems(cfg.data)  # bad data fails before the model is built
    eval_problems = load_problems(cfg.eval.data) if cfg.eval.every_n_steps > 0 else None
    heldout = load_problems(heldout_data(cfg.data, cfg.heldout_size)) if cfg.heldout_every else None
    model_cfg = model_config_for(cfg)
    tokenizer, stop_ids = build_tokenizer(model_cfg)  # the model config's: data problems fail before the model
    if not stop_ids:
        raise ConfigError(f"model={model_cfg.path or model_cfg.name}: the tokenizer has no eos token to end "
                          "the targets with; give the model directory a generation_config.json eos_token_id")
    if eval_problems is not None:  # the harness checks this too, but only after training
        check_prompt_lengths(eval_problems, prompt_ids(eval_problems, cfg.eval.template, tokenizer),
                             "eval.max_new_tokens", cfg.eval.max_new_tokens, cfg.engine.max_context,
                             "engine.max_context", what="eval problem")
    apply_kernels(cfg.kernels, device)
    model = build_model(model_cfg, device, resolve_dtype(model_cfg.dtype, device), ctx,
                        lora=cfg.lora if cfg.mode == "lora" else None, seed=cfg.seed)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    examples = encode_examples(problems, cfg, tokenizer, stop_ids[0])
    heldout_examples = None if heldout is None else list(encode_examples(heldout, cfg, tokenizer,
                                                                         stop_ids[0]).values())
    params = trainable_parameters(model, cfg)
    build = build_full_optimizer if cfg.mode == "full" else build_optimizer
    opt = build(params, cfg.optim)
    sched = build_scheduler(opt, cfg.optim)
    stream = PromptStream(problems, cfg.seed)
    log.info("sft mode=%s: %s trainable of %s parameters, %d problems, %d steps of %d", cfg.mode,
             f"{sum(p.numel() for p in params.values()):,}", f"{num_params(model):,}", len(problems),
             cfg.steps, cfg.batch_size)
    tracker = (Tracker(cfg.tracking, run_dir, config=OmegaConf.to_container(OmegaConf.structured(cfg)))
               if ctx.is_main else NullTracker())  # rank 0 writes the run directory
    if raw_yaml and ctx.is_main:
        atomic_write_text(run_dir / "config.yaml", raw_yaml)
    try:
        engine = hook = None
        if eval_problems is not None:
            engine, hook = _build_eval(cfg, model, tokenizer, stop_ids, params, eval_problems, run_dir,
                                       tracker, ctx)
        losses, evals = _loop(cfg, model, params, opt, sched, stream, examples, pad_id, device, tracker,
                              engine, hook, heldout_examples, ctx)
        saved = _save(cfg, model_cfg, model, target, ctx)
        if cfg.quantize:
            log.info("quantized base (MXFP4 routed experts): %s",
                     quantize_checkpoint(saved, run_dir / "base", device=device))
    finally:
        tracker.finish()
    log.info("saved the %s to %s", "model" if cfg.mode == "full" else "adapter", saved)
    result = SFTResult(run_dir, saved, losses, evals, time.perf_counter() - t0, model, tokenizer, engine,
                       ctx.is_main)
    log.info(result.summary_line())
    return result


def _loop(cfg, model, params, opt, sched, stream, examples, pad_id, device, tracker, engine, hook, heldout=None,
          ctx: ParallelContext = SINGLE):
    guard = BadStepGuard(cfg.optim.max_bad_steps)
    losses: list[float] = []
    evals: dict[int, dict[str, float]] = {}
    if hook is not None and cfg.eval.at_start:
        _evaluate(cfg, hook, engine, params, 0, evals)  # the initial weights (lora: the no-op adapter)
    window = _Window()
    compiles = CompileCounter(device.type == "cuda")  # a fresh machine compiles what its Triton cache lacks
    stop = StopFlag()
    for step in range(1, cfg.steps + 1):
        stopping = stop.agreed(ctx)  # a signal to any rank stops them all
        if stopping is not None:
            log.warning("stopping after step %d of %d on %s: saving the model as it is now", step - 1, cfg.steps,
                        stopping)
            break
        t = time.perf_counter()
        step_examples = [examples[id(p)] for _, p in stream.take(cfg.batch_size)]  # the same batch on every rank
        value, num_tokens = sft_backward(model, step_examples[ctx.dp_rank::ctx.dp_size], pad_id, device,
                                         cfg.micro_batch_tokens, cfg.activation_checkpointing,
                                         float(sum(s.num_loss_tokens for s in step_examples)), ctx)
        metrics = optimizer_step(opt, sched, params, cfg.optim, loss=value, ctx=ctx)
        guard.record(metrics)
        losses.append(value)
        new = compiles.take()
        window.add(value, metrics, num_tokens, time.perf_counter() - t, new, compiles.names if new else [])
        if step % cfg.log_every == 0 or step == cfg.steps:
            kernels = window.kernels
            row = window.flush() | {"train/epoch": float(stream.epoch)}
            tracker.log(row, step=step)
            log.info("step %d/%d loss=%.4f lr=%.3g grad_norm=%.3g tok/s=%.0f%s", step, cfg.steps,
                     row["train/loss"], row["train/lr"], row["train/grad_norm"], row["perf/tokens_per_s"],
                     _compiled(row.get("perf/triton_new"), kernels))
        if heldout is not None and (step % cfg.heldout_every == 0 or step == cfg.steps):
            t = time.perf_counter()
            row = heldout_figures(model, heldout, pad_id, device, ctx=ctx)  # the same on every rank
            row["perf/heldout_s"] = time.perf_counter() - t
            if (new := compiles.take()) is not None:
                row["perf/heldout_triton_new"] = float(new)
            kernels = compiles.names if new else []
            tracker.log(row, step=step)
            log.info("step %d/%d held-out (teacher-forced): exact=%.4f token=%.4f (%.1f s%s)", step, cfg.steps,
                     row["sft/heldout_exact"], row["sft/heldout_token"], row["perf/heldout_s"],
                     _compiled(row.get("perf/heldout_triton_new"), kernels))
            if cfg.stop_at_heldout_exact and row["sft/heldout_exact"] >= cfg.stop_at_heldout_exact:
                log.info("stopping at step %d: held-out exact %.4f >= stop_at_heldout_exact=%g", step,
                         row["sft/heldout_exact"], cfg.stop_at_heldout_exact)
                break
        if hook is not None and (hook.due(step) or step == cfg.steps):
            _evaluate(cfg, hook, engine, params, step, evals)
    stop.restore()
    return losses, evals


def heldout_data(data, size: int):
    """`data` read from its test split, `size` problems (the held-out set of heldout_every)."""
    return dataclasses.replace(data, split="test", size=size, limit=None)


@torch.no_grad()
def heldout_figures(model: nn.Module, examples: list[Sample], pad_id: int, device: torch.device,
                    batch_size: int = 64, ctx: ParallelContext = SINGLE) -> dict[str, float]:
    """Teacher-forced figures of `examples`: sft/heldout_exact, the share whose every target token is the argmax
    of the model's logits at its position (what greedy decoding would reproduce, ties aside), and
    sft/heldout_token, the share of all target tokens that are. On many ranks (`ctx`) DP replica r counts examples
    r, r + dp, ... (the argmax over the TP group's vocabulary shards: `vocab_argmax`) and the counts are summed over
    the replicas: the same figures on every rank. In lockstep a replica with fewer batches runs idle forwards.
    The forwards take the torch references of the kernels that run only without gradients (RMSNorm, SiTU-GLU,
    the AttnRes mix, the router: `reference_kernels`), so that nothing is compiled for a measurement of a few
    forwards."""
    was_training = model.training
    model.eval()
    mine = examples[ctx.dp_rank::ctx.dp_size]
    starts = range(0, len(mine), batch_size)
    exact = hits = total = 0
    with reference_kernels():
        for k in range(Lockstep(ctx).steps(len(starts))):
            if k >= len(starts):  # lockstep: this rank's part in another replica's forward
                _idle_step(model, pad_id, device, backward=False)
                continue
            batch = pack(mine[starts[k]:starts[k] + batch_size], pad_id, model.config.vocab_size).to(device)
            with _autocast(model):
                logits = model(batch.input_ids_BT, seq_lens=batch.seq_lens_B).logits
            mask_BT = batch.mask_BT > 0
            right_BT = (vocab_argmax(logits, vocab_shard(model)) == batch.targets_BT) & mask_BT
            hits += int(right_BT.sum())
            total += int(mask_BT.sum())
            exact += int((right_BT.sum(-1) == mask_BT.sum(-1)).sum())
    model.train(was_training)
    exact, hits, total = sum_over([float(exact), float(hits), float(total)], ctx.dp_group)
    return {"sft/heldout_exact": exact / len(examples), "sft/heldout_token": hits / max(total, 1)}


def _compiled(new: float | None, kernels: list[str], show: int = 6) -> str:
    """", compiled N Triton kernels (names)" for a log line when N > 0 (`kernel_list`), else nothing."""
    return f", compiled {new:.0f} Triton kernels ({kernel_list(kernels, show)})" if new else ""


class _Window:
    """Sums since the last log: the mean loss of those steps, the last lr / grad norm, tokens per second, and the
    Triton kernels compiled in them (perf/triton_new; CUDA only)."""

    def __init__(self):
        self.losses: list[float] = []
        self.tokens, self.seconds, self.skipped, self.last = 0, 0.0, 0, {}
        self.compiles: int | None = None
        self.kernels: list[str] = []

    def add(self, loss: float, metrics: dict, tokens: int, seconds: float, compiles: int | None = None,
            kernels: list[str] = ()) -> None:
        self.losses.append(loss)
        self.tokens += tokens
        self.seconds += seconds
        self.skipped += int(metrics["train/skipped"])
        self.last = metrics
        if compiles is not None:
            self.compiles = (self.compiles or 0) + compiles
        self.kernels.extend(kernels)

    def flush(self) -> dict[str, float]:
        finite = [x for x in self.losses if math.isfinite(x)]
        row = {"train/loss": sum(finite) / len(finite) if finite else math.nan,
               "train/lr": self.last["train/lr"], "train/grad_norm": self.last["train/grad_norm"],
               "train/skipped_steps": float(self.skipped), "perf/tokens_per_s": self.tokens / self.seconds,
               "perf/step_s": self.seconds / len(self.losses)}
        if self.compiles is not None:
            row["perf/triton_new"] = float(self.compiles)
        self.__init__()
        return row


def _rng_isolated(device: torch.device):
    """Engine building and evaluation leave the training RNG as it was (a run with eval draws the same
    numbers for training as one without)."""
    return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])


def _build_eval(cfg, model, tokenizer, stop_ids, params, problems, run_dir, tracker, ctx: ParallelContext = SINGLE):
    """The rollout engine over the model's own base tensors (no copy; on many ranks each rank's engine over its
    shard) and the eval hook (the prompts' lengths are checked by `train_sft` before the model is built; each DP
    replica generates its share, rank 0 grades, writes and logs)."""
    device = next(model.parameters()).device
    lora = cfg.mode == "lora"  # full mode: the engine serves the model's own (trained) weights
    if not lora:  # ... in place, so no fused copy of them (`SFTConfig.validate` refuses fuse_projections=true)
        cfg.engine.fuse_projections = False
    with _rng_isolated(device), torch.no_grad():
        engine = build_engine(cfg, model, tokenizer, stop_ids, lora=cfg.lora if lora else None, ctx=ctx,
                              adapter={n: p.detach() for n, p in params.items()} if lora else None)
    tracker = tracker if ctx.is_main else None
    if cfg.env.name != "single":  # held-out episodes of the environment
        return engine, EpisodeEvalHook(cfg.eval, engine, tokenizer, problems, run_dir, tracker, ctx=ctx,
                                       env=(build_env(cfg.env), cfg.env))
    return engine, EvalHook(cfg.eval, engine, tokenizer, problems, run_dir, tracker, ctx=ctx)


def _evaluate(cfg, hook: EvalHook, engine: RolloutEngine, params: dict, step: int, evals: dict) -> None:
    """Evaluate the weights of `step` into evals[step] (rank 0; the other ranks generate their share and keep
    nothing): full mode, the engine already holds them (shared tensors, updated in place); lora mode, the current
    adapter (each rank its shard) is pushed into the engine first."""
    with _rng_isolated(engine.device), torch.no_grad():
        if cfg.mode == "lora" and step > engine.weight_version:  # step 0: the adapter loaded at build
            engine.update_weights_from_tensor({n: p.detach() for n, p in params.items()}, POLICY,
                                              weight_version=step)
        else:
            engine.weight_version = step
        result = hook.maybe_run(step, POLICY if cfg.mode == "lora" else None, force=True)
    if result is not None:
        evals[step] = result


def _save(cfg, model_cfg: ModelConfig, model, target: Path, ctx: ParallelContext = SINGLE) -> Path:
    """full: a checkpoint directory with the tokenizer (the small byte-level one for a shipped config, else
    the source directory's files); lora: a PEFT adapter directory, the whole adapter (written by rank 0 one tensor
    at a time, each from the rank that holds it: `save_adapter_streamed`). Both atomic."""
    if cfg.mode == "lora":
        save_adapter_streamed(model, cfg.lora, target, cfg.model.path or cfg.model.name, ctx)  # every rank
        return target
    if model_cfg.path is None:
        return save_weights(model, target, small_tokenizer=True)
    return save_weights(model, target, tokenizer_from=weights_dir(model_cfg))


def _autocast(model: nn.Module):
    """bf16 autocast for an fp32 model on CUDA (fp32 master weights); nothing otherwise."""
    p = next(model.parameters())
    if p.device.type == "cuda" and p.dtype == torch.float32:
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@hydra_app("miles_k3.sft", "sft")
def main(raw: DictConfig) -> None:
    silence_fla_cpu_warning()
    cfg = typed_or_exit(raw, "miles_k3.sft")
    with exit_on_user_error("miles_k3.sft"):
        result = train_sft(cfg, OmegaConf.to_yaml(raw, resolve=True))  # the run's own run_dir
    end_ranks()
    if result.is_main:  # under torchrun the other ranks print nothing
        print(result.summary_line())


if __name__ == "__main__":
    main()
