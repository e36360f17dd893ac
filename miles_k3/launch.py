"""Everything a training run holds, built once from the validated config (`build_run`): the trainer's model with
its LoRA adapter, the colocated rollout engine sharing the base, the weight-sync channel, optimizer and LR
schedule, the reward, the prompt stream, the rollout producer (`build_rollouts`: the one place that reads rollout.mode
and env.name at run time), the eval hook, the tracker and the run directory, restored from a checkpoint when
`resume` names one (the run directory's metrics.jsonl and tables cut back to its step). `miles_k3/train.py` then
only runs the loop over these.

Under torchrun (`parallel:`) every rank plans the model for its place in the mesh on the meta device, allocates and
reads only its shard (`build_model`: the same weights and adapter as one process), and colocates its own engine
over that shard; rank 0 alone writes the run directory's
logs, metrics, tables and eval reports (the others get a `NullTracker`; each DP replica generates its share of
the eval, which rank 0 grades), and every rank checkpoints its own state into one directory
(`trainer.checkpoint`, the same code path as one process).
"""
from __future__ import annotations

import logging
import os
import random
import signal
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf

from miles_k3.agent import AgentRollouts, load_agent
from miles_k3.envs.env import build_env
from miles_k3.evals.datasets import load_problems
from miles_k3.evals.harness import EvalHook, check_prompt_lengths, prompt_ids
from miles_k3.evals.rewards import build_reward
from miles_k3.model.build import build_model, build_tokenizer, load_k3_config
from miles_k3.model.kernel_config import apply_kernels
from miles_k3.model.lora import apply_lora, lora_parameters
from miles_k3.model.parallelize import check_mesh
from miles_k3.parallel.mesh import SINGLE, ParallelContext, init_parallel
from miles_k3.parallel.reduce import broadcast, max_over, world_of
from miles_k3.rollout.api import Engine, capabilities
from miles_k3.rollout.factory import POLICY, build_engine
from miles_k3.rollout.sglang_backend import checkpoint_context
from miles_k3.trainer.checkpoint import (
    STATE_FILE,
    ResumeError,
    load_checkpoint,
    resolve_resume,
    rng_file,
    rollout_state_of,
    set_rng_state,
)
from miles_k3.trainer.episode_eval import EpisodeEvalHook
from miles_k3.trainer.fleet import FleetRollouts, served_adapter
from miles_k3.trainer.optim import BadStepGuard, build_optimizer, build_scheduler
from miles_k3.trainer.partial import PartialRollouts
from miles_k3.trainer.rollouts import PromptStream, SyncRollouts
from miles_k3.trainer.sources import RolloutSource
from miles_k3.utils.runtime import resolve_device, resolve_dtype, set_threads
from miles_k3.utils.tracking import NullTracker, Tracker, truncate_after
from miles_k3.weight_sync.channel import open_sender

log = logging.getLogger("miles_k3.train")
FLA_CPU_WARNING = "Triton is not supported on current platform"
"""fla-core's UserWarning at import on a machine without a Triton GPU (its Triton kernels are not used on CPU)."""


def silence_fla_cpu_warning() -> None:
    """An entry point's first call, before fla is imported: on CPU the KDA backend is torch (logged as kda=...)
    and fla's Triton kernels are not used, so its "roll back to CPU" warning says nothing to act on."""
    warnings.filterwarnings("ignore", message=FLA_CPU_WARNING, category=UserWarning)


@dataclass
class Run:
    cfg: Any
    run_dir: Path
    device: torch.device
    model: Any
    tokenizer: Any
    engine: Engine
    params: dict
    opt: torch.optim.Optimizer
    sched: Any
    channel: Any
    reward: Any
    stream: PromptStream
    rollouts: RolloutSource  # the step's rollouts (`build_rollouts`): collect(version), state() for checkpoints
    eval_hook: EvalHook | None
    tracker: Tracker | NullTracker
    guard: BadStepGuard
    start_step: int = 0
    pad_id: int = 0
    version: int = 0  # the weight version of the trainer's adapter: what the engine serves, pushed as version + 1
    last_checkpoint: Path | None = None
    summary: dict | None = None
    ctx: ParallelContext = SINGLE  # this process's place in the run's ranks (SINGLE: one process)

    def lora_tensors(self) -> dict[str, torch.Tensor]:
        """What a push carries: the adapter parameters by name (native engine, and SGLang's merged pushes, which
        merge them on the trainer), or their PEFT-named views, the names SGLang's LoRA loads (sglang.push=lora)."""
        if self.engine.push == "lora":
            from miles_k3.model.adapter import peft_tensors

            return {n: t.detach() for n, t in peft_tensors(self.model).items()}
        return {n: p.detach() for n, p in self.params.items()}

    def close(self) -> None:
        self.rollouts.close()
        _close_parts(self.reward, self.channel, self.engine)
        self.tracker.finish()


def _close_parts(*parts) -> None:
    """Close each part that has something to close (a remote reward's client, a channel, the engine)."""
    for part in parts:
        close = getattr(part, "close", None)
        if close is not None:
            close()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_run(cfg) -> Run:
    """The run of `cfg`, seeded first (`cfg.seed`: the random base of a shipped config and the adapter's init
    are the same in every run with that seed; a resumed run then restores the checkpoint's RNG states). Under
    torchrun the process group starts first (`init_parallel`: the world size must be parallel.dp x parallel.tp)
    and the mesh is checked against the model's shapes before any weight is built."""
    seed_everything(cfg.seed)
    quiet_other_ranks()
    set_threads(cfg.threads)
    check_mesh_fits_model(cfg)
    device = resolve_device(cfg.device)
    ctx = init_parallel(cfg.parallel, device.type)
    device = rank_device(device, ctx)
    if cfg.model.hf_path is None:  # an HF model runs transformers' kernels (kernels: is refused with it)
        apply_kernels(cfg.kernels, device)
    problems = load_problems(cfg.data)  # bad data fails before the model is built
    eval_problems = load_problems(cfg.eval.data) if cfg.eval.every_n_steps > 0 else None
    tokenizer, stop_ids = build_tokenizer(cfg.model)  # the model config's: a prompt too long fails before it
    check_prompts_fit(cfg, tokenizer, problems, eval_problems)
    run_dir = Path(broadcast(cfg.run_dir or f"runs/train-{time.strftime('%Y%m%d-%H%M%S')}", world_of(ctx)))
    model = _build_model(cfg, device, ctx)
    params = lora_parameters(model)
    opt = build_optimizer(params, cfg.trainer.optim)
    sched = build_scheduler(opt, cfg.trainer.optim)
    stream = PromptStream(problems, cfg.rollout.seed)
    ckpt = resolve_resume(cfg.resume, run_dir)
    start, version, saved = _resume(ckpt, model, opt, sched, ctx)
    _warn_filtered_logprobs(cfg.rollout, cfg.engine.backend)
    engine, channel = _build_engine(cfg, model, tokenizer, stop_ids, problems, params, version, ctx)
    reward = build_reward(cfg.reward)
    try:  # a checkpoint its producer cannot continue fails here, before the run directory's logs are touched
        rollouts, episodes = build_rollouts(cfg, engine, tokenizer, stream, reward, ctx)
        _load_rollouts(rollouts, saved, ckpt)
    except BaseException:
        _close_parts(reward, channel, engine)
        raise
    if ckpt is not None and ctx.is_main:  # before the tracker appends: the rows a killed run logged past it go
        dropped = truncate_after(run_dir, start)
        if dropped:
            log.info("resume: dropped %d logged rows of steps after %d from %s", dropped, start, run_dir)
    tracker = (Tracker(cfg.tracking, run_dir, config=OmegaConf.to_container(OmegaConf.structured(cfg)))
               if ctx.is_main else NullTracker())
    hook = None
    if eval_problems is not None:  # every rank generates its replica's share; rank 0 grades, writes and logs
        hook = build_eval_hook(cfg, engine, tokenizer, eval_problems, run_dir, tracker if ctx.is_main else None,
                               ctx, episodes)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    if ckpt is not None:  # building the engine may draw random numbers: the loop starts from the saved state
        set_rng_state(torch.load(rng_file(ckpt, ctx), weights_only=True))
    guard = BadStepGuard(cfg.trainer.optim.max_bad_steps, max_empty_steps=cfg.trainer.optim.max_empty_steps)
    return Run(cfg, run_dir, device, model, tokenizer, engine, params, opt, sched, channel, reward, stream, rollouts,
               hook, tracker, guard, start, pad, version, ctx=ctx)


def build_rollouts(cfg, engine, tokenizer, stream: PromptStream, reward, ctx: ParallelContext = SINGLE
                   ) -> tuple[RolloutSource, tuple | None]:
    """The run's rollout producer, and what plays its held-out eval's episodes: the one place that reads
    rollout.mode and env.name at run time (everything after asks the objects).

    * The episodes: of the environment env.name names (`envs.build_env`: single, guess, tools, ...), their turns
      through the engine; env=agent: played by the agent code env.agent names over the in-process server
      (`miles_k3.agent.AgentRollouts`, the producer too: sync rollouts, as validation requires), for the training
      rollouts and the eval alike.
    * The producer (`trainer.sources.RolloutSource`): rollout.mode=sync, `SyncRollouts` (every sample drawn with
      the trainer's adapter); partial, `PartialRollouts` (groups in flight across weight updates, each of the
      ctx.dp_size replicas keeping its share: `check_replica_share`, `check_pool_fits`); fleet, `FleetRollouts`
      (the groups sampled by engine actors on Ray, each with its own base, under the partial-mode rules). The
      samples carry the engine's routes with rollout.return_routed_experts or trainer.routing_replay (not
      env=agent's nor the fleet's: refused).

    Returns (producer, eval episodes): None for env=single (the eval answers in one turn, `EvalHook`), else
    (the environment's factory or the agent's player, EnvConfig) for `EpisodeEvalHook`. A new producer (a fleet of
    remote engines, a fully asynchronous one, SFT data as rollouts) is one more branch here."""
    routes = cfg.rollout.return_routed_experts or cfg.trainer.routing_replay
    if cfg.env.name == "agent":  # agent code plays the episodes over an in-process server (sync: validated)
        agents = AgentRollouts(load_agent(cfg.env.agent), engine, tokenizer, cfg.env, POLICY, stream, reward,
                               cfg.rollout)
        return agents, (agents, cfg.env)
    env = (build_env(cfg.env), cfg.env)  # unknown tools, or a python tool without a sandbox, fail here
    if cfg.rollout.mode == "fleet":  # engine actors on Ray (validated: native, env=single, one process)
        source = FleetRollouts(cfg, served_adapter(engine, POLICY), tokenizer, stream, reward, env=env)
    elif cfg.rollout.mode == "partial":
        check_replica_share(cfg.rollout, ctx.dp_size)
        check_pool_fits(cfg.rollout, engine.num_slots, ctx.dp_size)
        source = PartialRollouts(engine, tokenizer, stream, reward, cfg.rollout, POLICY, routes=routes, ctx=ctx,
                                 env=env)
    else:
        source = SyncRollouts(engine, tokenizer, stream, reward, cfg.rollout, POLICY, ctx=ctx, routes=routes, env=env)
    return source, None if cfg.env.name == "single" else env


def _load_rollouts(rollouts: RolloutSource, saved: dict | None, ckpt: Path | None) -> None:
    """The checkpoint's producer state (`rollout_state_of`) continued by this run's producer; ResumeError naming
    the checkpoint when it cannot be."""
    if ckpt is None:
        return
    try:
        rollouts.load_state(saved)
    except ResumeError as e:
        raise ResumeError(f"{ckpt}: {e}") from None


def build_eval_hook(cfg, engine, tokenizer, problems, run_dir, tracker, ctx, episodes: tuple | None) -> EvalHook:
    """The loop's eval: held-out problems answered in one turn (`episodes` None: env=single), or played as episodes
    (`episodes`: as `build_rollouts` returns them; `trainer.episode_eval`: success, turns per episode, invalid
    turns), with the eval's sampling."""
    if episodes is None:
        return EvalHook(cfg.eval, engine, tokenizer, problems, run_dir, tracker, ctx=ctx)
    return EpisodeEvalHook(cfg.eval, engine, tokenizer, problems, run_dir, tracker, ctx=ctx, env=episodes)


def _build_model(cfg, device: torch.device, ctx: ParallelContext):
    """The trainer's model with its LoRA adapter: a K3 config's planned for this rank's place in the mesh (only its
    shard allocated and read), or a Hugging Face model (`model.hf_path`)."""
    dtype = resolve_dtype(cfg.model.dtype, device)
    if cfg.model.hf_path is None:
        return build_model(cfg.model, device, dtype, ctx, cfg.lora, cfg.seed)
    from miles_k3.model.hf import load_hf_model

    model = load_hf_model(cfg.model.hf_path, device, dtype)
    apply_lora(model, cfg.lora)
    return model


def _build_engine(cfg, model, tokenizer, stop_ids: list[int], problems, params: dict, version: int,
                  ctx: ParallelContext):
    """The rollout engine serving the trainer's adapter as weight version `version` (a checkpoint's on resume), and
    the weight-sync channel into it: the native engine colocated over the model's own base tensors (pushed through
    the `sync:` channel), or SGLang (its own verified channel)."""
    if not capabilities(cfg.engine.backend).in_process_model:
        return _sglang_engine(cfg, model, tokenizer, stop_ids, problems, version)
    engine = build_engine(cfg, model, tokenizer, stop_ids, lora=cfg.lora, version=version, ctx=ctx,
                          adapter={n: p.detach() for n, p in params.items()})
    return engine, open_sender(cfg.sync, engine=engine, adapter=POLICY, ctx=ctx)


def check_replica_share(rollout, dp: int) -> None:
    """rollout.mode=partial: each of the `dp` data-parallel replicas finishes prompts_per_step / dp groups per step."""
    if rollout.prompts_per_step % dp:
        raise ValueError(f"rollout.prompts_per_step={rollout.prompts_per_step}: rollout.mode=partial shares a step's "
                         f"groups equally among the {dp} data-parallel replicas; set it to a multiple of {dp}")


def check_pool_fits(rollout, num_slots: int, dp: int = 1) -> None:
    """rollout.mode=partial: each of the `dp` replicas keeps its share of the groups in flight; a group runs all its samples at once (its forks share
    the prompt's prefill), so a replica's engine must hold one group; the groups in flight beyond what its slots
    hold wait in its queue (logged)."""
    inflight = -(-rollout.partial.groups(rollout.prompts_per_step) // dp)
    if rollout.group_size > num_slots:
        raise ValueError(f"rollout.group_size={rollout.group_size}: the engine has {num_slots} request slots, so no "
                         "group could ever run; raise engine.memory_budget_bytes or lower rollout.group_size")
    running = num_slots // rollout.group_size
    if running < inflight:
        log.info("rollout.mode=partial: %d groups in flight per replica, %d run at once (%d engine slots); the others "
                 "wait in the engine's queue (engine.memory_budget_bytes raises the slots)", inflight, running,
                 num_slots)


def check_mesh_fits_model(cfg) -> None:
    """Every dimension parallel.tp / parallel.ep shard divides by its degree (`parallelize.check_mesh`), from the
    K3 config alone: before a process group starts or a weight is built. Data parallelism shards nothing."""
    if cfg.model.hf_path is None and (cfg.parallel.tp > 1 or cfg.parallel.ep > 1):
        check_mesh(load_k3_config(cfg.model), cfg.parallel.tp, cfg.parallel.ep)


def rank_device(device: torch.device, ctx: ParallelContext) -> torch.device:
    """This rank's device: cuda:LOCAL_RANK (made current by `init_parallel`) for a CUDA run on many ranks, else
    `device` as resolved."""
    return torch.device("cuda", torch.cuda.current_device()) if ctx.distributed and device.type == "cuda" \
        else device


def quiet_other_ranks() -> None:
    """Ranks other than 0 of a torchrun launch (RANK, as `init_parallel` reads it) log warnings and errors only:
    rank 0's lines say what every rank does."""
    if os.environ.get("RANK", "0") != "0":
        logging.getLogger("miles_k3").setLevel(logging.WARNING)


def check_prompts_fit(cfg, tokenizer, problems: list, eval_problems: list | None) -> None:
    """Every training prompt (rendered with rollout.template and tokenized as the rollouts do) plus
    rollout.max_new_tokens fits the engine's context, and every eval prompt plus eval.max_new_tokens when the run
    evaluates: checked once, at start (a prompt too long would otherwise fail its step mid-run). PromptLengthError
    names the first problem that does not fit."""
    limit, raise_hint = engine_context(cfg)
    check_prompt_lengths(problems, prompt_ids(problems, cfg.rollout.template, tokenizer), "rollout.max_new_tokens",
                         cfg.rollout.max_new_tokens, limit, raise_hint, what="training problem")
    if eval_problems is not None:
        check_prompt_lengths(eval_problems, prompt_ids(eval_problems, cfg.eval.template, tokenizer),
                             "eval.max_new_tokens", cfg.eval.max_new_tokens, limit, raise_hint, what="eval problem")


def engine_context(cfg) -> tuple[int, str]:
    """(tokens a request may hold, the field that raises it) of the engine engine.backend names: engine.max_context
    (native); sglang.context_length, else the checkpoint's max_position_embeddings, else engine.max_context
    (sglang: what `serve_checkpoint` gives the engine)."""
    if capabilities(cfg.engine.backend).in_process_model:
        return cfg.engine.max_context, "engine.max_context"
    served = checkpoint_context(cfg.model.hf_path or cfg.model.path)
    limit = cfg.sglang.context_length or served or cfg.engine.max_context
    return limit, "sglang.context_length" + (" (up to the model's)" if served else "")


def _warn_filtered_logprobs(cfg, backend: str) -> None:
    """top-p / top-k: the engine samples from the filtered distribution. The native engine also reports its tokens'
    unfiltered log-probs, which the loss and train/rollout_logprob_abs_diff use (`trainer.batch.pack`); SGLang
    reports only the filtered ones (config validation refuses them in the loss: `check_filtered_logprobs`)."""
    if cfg.top_p < 1.0 or cfg.top_k > 0:
        if not capabilities(backend).unfiltered_logprobs:
            log.warning("rollout.top_p=%s rollout.top_k=%s: the engine reports log-probs of the filtered, renormalised "
                        "distribution it samples from (SGLang: not the unfiltered ones), the trainer computes them "
                        "over the full vocabulary, so train/rollout_logprob_abs_diff includes the filtering",
                        cfg.top_p, cfg.top_k)
        else:
            log.warning("rollout.top_p=%s rollout.top_k=%s: the engine reports log-probs of the filtered, renormalised "
                        "distribution it samples from, and its unfiltered ones, which the loss (old_logprobs=rollout, "
                        "TIS) and train/rollout_logprob_abs_diff use; rollout/logprob_filter_gap logs the "
                        "filtering's part", cfg.top_p, cfg.top_k)


def _sglang_engine(cfg, model, tokenizer, stop_ids: list[int], problems, version: int):
    """The SGLang engine serving the run's checkpoint with the trainer's adapter as weight version `version`, and its
    verified channel: a LoRA adapter (sglang.push=lora), or merged into SGLang's base weights (merged: a K3 adapter
    SGLang's K3 LoRA cannot serve; the engine's base log-probs on the probe are taken first, while it serves W0).
    The parity probe (`parity_probe`, sglang.probe) is checked before SGLang starts and built before it serves any
    adapter (its completions are the base policy's); SGLang is shut down when what follows its start fails."""
    from miles_k3.evals.templates import render_prompt
    from miles_k3.weight_sync.sglang import check_probe

    verified = cfg.sglang.verify_push != "never"
    prompts = [tokenizer.encode(render_prompt(cfg.rollout.template, p.problem, tokenizer), add_special_tokens=False)
               for p in problems[:64]] if verified else []
    if verified:  # before SGLang starts
        limit, field = engine_context(cfg)
        if cfg.sglang.probe_tokens > limit:
            raise ValueError(f"sglang.probe_tokens={cfg.sglang.probe_tokens}: longer than the context of {limit} "
                             f"tokens ({field}); lower it")
        check_probe(cfg.sglang.probe, cfg.sglang.probe_tokens, prompts)
    engine = build_engine(cfg, None, tokenizer, stop_ids, lora=cfg.lora)  # the channel loads the adapter
    try:
        return engine, _sglang_channel(cfg, engine, model, prompts, version)
    except BaseException:
        engine.shutdown()  # its scheduler runs in subprocesses
        raise


def _sglang_channel(cfg, engine, model, prompts: list[list[int]], version: int):
    """The verified channel into `engine`, which serves the trainer's adapter as version `version` on return."""
    from miles_k3.model.adapter import peft_tensors
    from miles_k3.model.lora import adapters_disabled
    from miles_k3.trainer.step import sequence_logprobs
    from miles_k3.weight_sync.sglang import SGLangChannel, SGLangMergedChannel, parity_probe

    engine.weight_version = version  # the trainer's adapter (a checkpoint's on resume) is what it serves
    probe = None
    if prompts:

        def complete(ids: list[list[int]], max_new: int) -> list[list[int]]:  # greedy, the base (no adapter yet)
            outs = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": max_new, "temperature": 0.0},
                                   return_logprob=False)
            bad = next((o["error"] for o in outs if "error" in o), None)
            if bad is not None:
                raise RuntimeError(f"parity probe: sglang failed a base completion: {bad}")
            return [o["output_ids"] for o in outs]

        probe = parity_probe(cfg.sglang.probe, cfg.sglang.probe_tokens, prompts, complete)
        log.info("sglang parity probe (%s): %d tokens", cfg.sglang.probe, len(probe))

    def base_logprobs(ids: list[int]) -> list[float]:
        with adapters_disabled(model):
            return sequence_logprobs(model, ids, cfg.trainer)

    checks = {"probe_ids": probe, "trainer_logprobs": lambda ids: sequence_logprobs(model, ids, cfg.trainer),
              "trainer_base_logprobs": base_logprobs}
    if engine.push == "merged":
        channel = SGLangMergedChannel(engine, POLICY, cfg.sglang, model, **checks)
        channel.serve_initial({n: p.detach() for n, p in lora_parameters(model).items()})
        return channel
    engine.load_lora_adapter_from_tensors(POLICY, {n: t.detach() for n, t in peft_tensors(model).items()},
                                          cfg.lora)
    return SGLangChannel(engine, POLICY, cfg.sglang, **checks)


def _resume(ckpt: Path | None, model, opt, sched, ctx: ParallelContext) -> tuple[int, int, dict | None]:
    """(step, weight version, this rank's rollout producer state: `rollout_state_of`) of the checkpoint restored
    into the model and optimizer; (0, 0, None) without one. The version is the checkpoint's own
    (extra_state.weight_version), not recomputed from the step. Every rank restores its own state
    (`trainer.checkpoint.load_checkpoint`, one rank or many); the checkpoint's mesh must be this run's."""
    if ckpt is None:
        return 0, 0, None
    state = load_checkpoint(ckpt, model, opt, sched, ctx=ctx)
    try:
        saved = rollout_state_of(state)
    except ResumeError as e:
        raise ResumeError(f"{ckpt}: {e}") from None
    version = state.get("extra_state", {}).get("weight_version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ResumeError(f"{ckpt / STATE_FILE}: extra_state.weight_version must be an int >= 0 (the adapter's "
                          f"weight version), got {version!r}; the checkpoint is not a training run's")
    log.info("resumed from %s at step %d (weight version %d)", ckpt, state["step"], version)
    return int(state["step"]), version, saved


class StopFlag:
    """SIGINT / SIGTERM set `requested`: a loop (train, sft) finishes its step, saves and stops, instead of losing
    what it trained. `restore` puts the previous handlers back."""

    def __init__(self):
        self.requested: str | None = None
        self._old = {}
        if threading.current_thread() is threading.main_thread():  # Python installs handlers there only: a loop
            # in another thread (a Ray Train worker) leaves its signals to whoever runs it
            self._old = {s: signal.signal(s, self._set) for s in (signal.SIGINT, signal.SIGTERM)}

    def _set(self, signum, _frame) -> None:
        self.requested = signal.Signals(signum).name

    def agreed(self, ctx) -> str | None:
        """What stops the run after this step, the same on every rank: a signal on any rank stops them all."""
        if not ctx.distributed:
            return self.requested
        anywhere = max_over([float(self.requested is not None)], world_of(ctx))[0]
        return (self.requested or "a signal to another rank") if anywhere else None

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
