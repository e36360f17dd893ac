"""`python -m miles_k3.train [recipe=aime_grpo] [overrides]`: colocated LoRA GRPO on the frozen MXFP4 base (Hydra).

It composes `recipes/train.yaml`, validates every field, builds the run (`miles_k3.launch.build_run`: model +
adapter, engine sharing the base, sync channel, optimizer, reward, prompts, the rollout producer, eval, tracker;
resumed from a checkpoint with `resume=auto|PATH`) and runs the loop (docs/concepts/loop.md):

    rollouts (run.rollouts.collect: samples, rewards, advantages, versions checked) -> release engine memory ->
    train step -> weight sync (version + 1) -> resume engine memory -> log -> eval every N -> checkpoint every N
    (and on SIGINT / SIGTERM; the producer's state with it)

A push the engine refuses or fails to take (SyncError) stops the run without losing the step: the step's metrics
are logged (sync/refused = 1, with the parity figures of a refused SGLang check) and the trainer's state after it is
checkpointed, its adapter recorded as the version the push carried, so `resume=auto` continues from there.

(with engine.backend=sglang the memory is resumed before the weight sync, whose parity probe runs a request).

`steps=0` validates the config, builds the base model and attaches the adapter (logging its size), then stops: no
data is loaded and no engine, optimizer or checkpoint is built. Everything a run writes, Hydra's record
(`.hydra/`, `train.log`) included, goes into `run_dir`; log lines are written above the progress bar.

On many ranks (`torchrun --nproc-per-node N -m miles_k3.train parallel.dp=N ...`) every rank runs this loop over its
part of each step's prompts; the metrics, the step line, the bar and the summary are rank 0's (global values),
and an error is raised naming the rank that saw it.
"""
import logging
import time
from pathlib import Path
from typing import NoReturn

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from miles_k3.cli import hydra_app
from miles_k3.config import exit_on_user_error, register_schemas, typed_or_exit
from miles_k3.launch import POLICY, Run, StopFlag, build_run, seed_everything, silence_fla_cpu_warning
from miles_k3.model.build import build_model
from miles_k3.model.lora import adapter_num_params
from miles_k3.model.ranks import start_ranks
from miles_k3.parallel.mesh import naming_rank, shutdown
from miles_k3.trainer.checkpoint import ADAPTER_DIR, rollout_checkpoint, save_checkpoint
from miles_k3.trainer.step import train_step
from miles_k3.utils.runtime import CompileCounter, kernel_list, resolve_dtype
from miles_k3.utils.tracking import logged_evals
from miles_k3.weight_sync.push import SyncError

log = logging.getLogger("miles_k3.train")
register_schemas()


def train(cfg, raw_yaml: str = "") -> Run:
    t0 = time.perf_counter()
    run = build_run(cfg)
    log_adapter(cfg.lora, run.model, f"; run dir {run.run_dir}")
    if (mismatch := eval_task_mismatch(cfg)) and run.ctx.is_main:
        log.warning(mismatch)
    try:
        with naming_rank(run.ctx):
            step, evals = run_loop(run, raw_yaml)
    finally:
        run.close()
    run.summary = final_summary(run, step, evals, time.perf_counter() - t0)
    if run.ctx.is_main:
        print(format_summary(run.summary), flush=True)
    return run


def eval_task_mismatch(cfg) -> str | None:
    """A warning when the held-out eval draws the training source with other task_args (an override of
    data.task_args without eval.data.task_args: the eval then measures a task the policy never trained on), naming
    the keys that differ and the overrides that align them; None when they agree or nothing is evaluated."""
    if not (cfg.eval.every_n_steps > 0 or cfg.eval.at_start) or cfg.eval.data.source != cfg.data.source:
        return None
    train_args, eval_args = dict(cfg.data.task_args or {}), dict(cfg.eval.data.task_args or {})
    keys = sorted(k for k in train_args.keys() | eval_args.keys() if train_args.get(k) != eval_args.get(k))
    if not keys:
        return None
    diff = ", ".join(f"{k}: {train_args.get(k)} vs {eval_args.get(k)}" for k in keys)
    fix = " ".join(f"eval.data.task_args.{k}={train_args[k]}" if k in train_args else f"~eval.data.task_args.{k}"
                   for k in keys)
    return (f"eval.data.task_args differ from data.task_args on {cfg.data.source} ({diff}: training vs eval): the "
            f"held-out eval measures another task than the one trained; to evaluate the trained task set {fix}")


def run_loop(run: Run, raw_yaml: str) -> tuple[int, dict[int, dict]]:
    """The steps after run.start_step up to cfg.steps (fewer on SIGINT / SIGTERM); returns (last step, eval
    metrics by step: a resumed run's include those its metrics.jsonl holds from before the checkpoint, step 0's
    eval of the base among them)."""
    cfg = run.cfg
    evals = logged_evals(run.run_dir, run.start_step) if run.start_step > 0 and run.ctx.is_main else {}
    if run.eval_hook is not None and cfg.eval.at_start and run.start_step == 0:
        result = run.eval_hook.maybe_run(0, POLICY, force=True)  # the adapter starts as a no-op: the base
        if result is not None:  # None: a rank other than 0 (it reports nothing)
            evals[0] = result
    stop = StopFlag()
    bar = tqdm(total=cfg.steps, initial=run.start_step, desc="train", unit="step", disable=not run.ctx.is_main)
    step = run.start_step
    try:
        with logging_redirect_tqdm(tqdm_class=tqdm):  # log lines go above the bar, not into it
            for step in range(run.start_step + 1, cfg.steps + 1):
                try:
                    metrics, samples, refused = *one_step(run, step), None
                except PushFailed as failed:
                    metrics, samples, refused = failed.metrics, failed.samples, failed.error
                run.tracker.log(metrics, step=step)
                log_samples(run, samples, step)
                if refused is not None:
                    _save_and_stop(run, step, raw_yaml, refused)
                log.info(step_line(step, cfg.steps, metrics))
                bar.update(1)
                if run.eval_hook is not None:
                    result = run.eval_hook.maybe_run(step, POLICY, force=step == cfg.steps)
                    if result is not None:
                        evals[step] = result
                every, stopping = cfg.checkpoint_every, stop.agreed(run.ctx)
                if stopping or step == cfg.steps or (every and step % every == 0):
                    checkpoint(run, step, raw_yaml)
                if stopping:
                    log.warning("stopping at step %d on %s; resume with resume=auto run_dir=%s", step, stopping,
                                run.run_dir)
                    break
    finally:
        bar.close()
        stop.restore()
    return step, evals


class PushFailed(Exception):
    """A step whose push was refused or failed (`error`, a SyncError) after its rollouts and its train step: the
    step's metrics and samples, for the loop to log before it saves the run and stops."""

    def __init__(self, metrics: dict[str, float], samples: list, error: SyncError):
        super().__init__(str(error))
        self.metrics, self.samples, self.error = metrics, samples, error


def _save_and_stop(run: Run, step: int, raw_yaml: str, error: SyncError) -> NoReturn:
    """The step trained (and is logged, sync/refused = 1) but the engine did not take its adapter: checkpoint the
    trainer's state after it (its adapter as weight version run.version + 1, the version the push carried: a resumed
    run's engine starts serving it) and raise the push's SyncError with where the checkpoint is. On many ranks every
    rank gets the same SyncError (the push is collective), so every rank reaches the checkpoint's collectives."""
    path = checkpoint(run, step, raw_yaml, version=run.version + 1)
    raise SyncError(f"step {step}: {error}. The trainer's state after step {step} is saved in {path}: fix the cause, "
                    f"then resume with resume=auto run_dir={run.run_dir} (the engine starts serving that step's "
                    "adapter)", error.tensor, error.metrics) from error


def final_summary(run: Run, step: int, evals: dict[int, dict], wall_s: float) -> dict:
    """What this call did (steps: those run now, first_step..last_step; a resumed run starts after its checkpoint)
    and where its outputs are; with evals, the accuracy (avg@n) at the first and the last eval of the run (a resumed
    run's first is from before it resumed: step 0's, the base)."""
    out = {"steps": step - run.start_step, "first_step": run.start_step + 1, "last_step": step,
           "wall_s": round(wall_s, 1), "run_dir": str(run.run_dir),
           "metrics": str(run.run_dir / "metrics.jsonl"), "curves": str(run.run_dir / "curves.png")}
    if run.last_checkpoint is not None:
        out["adapter"] = str(run.last_checkpoint / ADAPTER_DIR)
    if evals:
        last = max(evals)
        key = next(k for k in evals[last] if k.startswith("eval/avg@") and not k.endswith("_se"))
        first = min(s for s in evals if key in evals[s])  # the same avg@n (eval.samples may differ across resumes)
        out |= {"accuracy_metric": key.removeprefix("eval/"), "accuracy_before": evals[first][key],
                "accuracy_before_step": first, "accuracy_after": evals[last][key], "accuracy_after_step": last}
        fmt = "eval/answer_rate"
        if fmt in evals[first] and fmt in evals[last]:
            out |= {"answer_rate_before": evals[first][fmt], "answer_rate_after": evals[last][fmt]}
    return out


def format_summary(s: dict) -> str:
    n = s["steps"]
    steps = f"{n} step{'s' * (n != 1)}" + (f" ({s['first_step']}-{s['last_step']})" if n else "")
    lines = [f"miles_k3.train: {steps} in {s['wall_s']:.0f} s"]
    if "accuracy_before" in s:
        gain = 100 * (s["accuracy_after"] - s["accuracy_before"])
        lines.append(f"  held-out {s['accuracy_metric']}: {100 * s['accuracy_before']:.1f}% (step "
                     f"{s['accuracy_before_step']}) -> {100 * s['accuracy_after']:.1f}% (step "
                     f"{s['accuracy_after_step']}), {gain:+.1f} points")
    if "answer_rate_before" in s:
        lines.append(f"  well-formed answers: {100 * s['answer_rate_before']:.1f}% -> "
                     f"{100 * s['answer_rate_after']:.1f}%")
    for key in ("run_dir", "adapter", "metrics", "curves"):
        if key in s:
            lines.append(f"  {key + ':':<9} {s[key]}")
    return "\n".join(lines)


def one_step(run: Run, step: int) -> tuple[dict[str, float], list]:
    cfg, tags = run.cfg, list(run.cfg.rollout.release_tags)
    on_cuda = torch.cuda.is_available() and run.device.type == "cuda"
    timer = _Timer(count_compiles=on_cuda)
    engine_before = engine_timing(run.engine)
    samples, metrics = run.rollouts.collect(run.version)  # sync, partial, agent episodes: versions checked there
    timer.lap("rollout")
    engine_after = engine_timing(run.engine)
    metrics |= {f"perf/rollout_{k}": engine_after[k] - engine_before[k] for k in engine_before}
    if tags:
        run.engine.release_memory_occupation(tags)
    timer.lap("release")
    metrics |= train_step(run.model, samples, cfg.trainer, run.opt, run.sched, run.params, run.pad_id,
                          run.device, temperature=cfg.rollout.temperature, ctx=run.ctx)  # none: an empty step
    run.guard.record(metrics)
    timer.lap("train")
    resume_first = run.engine.push_needs_memory  # SGLang: a push's parity probe generates
    if tags and resume_first:
        run.engine.resume_memory_occupation(tags)
        timer.lap("resume")
    try:
        report = run.channel.push(run.lora_tensors(), version=run.version + 1)
    except SyncError as e:  # the step trained: the loop logs it and saves its state before the run stops
        timer.lap("sync")
        raise PushFailed(metrics | e.metrics | {"sync/refused": 1.0} | timer.metrics(), samples, e) from e
    run.version += 1
    timer.lap("sync")
    if tags and not resume_first:
        run.engine.resume_memory_occupation(tags)
    timer.lap("resume")
    metrics |= report.metrics()
    metrics |= timer.metrics()
    if timer.kernels:  # a step that waited on the compiler: which kernels (new shapes specialise anew)
        log.info("step %d compiled Triton kernels: %s", step, timer.compiled_line())
    if "perf/optimizer_s" in metrics:
        metrics["perf/train_fwd_bwd_s"] = metrics["perf/train_s"] - metrics["perf/optimizer_s"]
    if on_cuda:
        metrics |= cuda_memory_metrics(run.device)
    return metrics, samples


def cuda_memory_metrics(device: torch.device) -> dict[str, float]:
    """The process's CUDA memory after a step: its peak allocation, what the caching allocator holds, how often it
    had to free its cache and retry a cudaMalloc (each retry synchronises the device: steps that slow down with the
    same work show it), and the device's memory in use by every process (more than `mem/reserved_gb` plus the
    engine's pools: another process holds the rest)."""
    free, total = torch.cuda.mem_get_info(device)
    return {"mem/peak_gb": torch.cuda.max_memory_allocated(device) / 1e9,
            "mem/reserved_gb": torch.cuda.memory_reserved(device) / 1e9,
            "mem/alloc_retries": float(torch.cuda.memory_stats(device).get("num_alloc_retries", 0)),
            "mem/device_used_gb": (total - free) / 1e9}


def engine_timing(engine) -> dict[str, float]:
    """The native engine's prefill / decode / tail seconds and decode steps so far (`RolloutEngine.timing`); {} for
    an engine that does not keep them (SGLang: `capabilities.timing`)."""
    return engine.timing if engine.capabilities.timing else {}


class _Timer:
    """Seconds per named phase (a name lapped twice adds up), and the total since construction. With
    `count_compiles` (CUDA), also the kernels Triton compiled in each phase (`CompileCounter` at every lap): a
    step seconds slower than its neighbours with the same work, and compiles, waited on the compiler (new shapes
    specialise kernels anew: fla's cumsums per batch size, `kda_ops.fla_batch_bucket`)."""

    def __init__(self, count_compiles: bool = False):
        self.start = self.last = time.perf_counter()
        self.laps: dict[str, float] = {}
        self.counter = CompileCounter(count_compiles)
        self.compiles: dict[str, int] | None = {} if self.counter.counting else None
        self.kernels: dict[str, list[str]] = {}  # phase -> the kernels compiled in it, by name

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = self.laps.get(name, 0.0) + now - self.last
        self.last = now
        if self.compiles is not None:
            new = self.counter.take()
            if new is None:  # the cache went away: no figures rather than wrong ones
                self.compiles = None
                return
            self.compiles[name] = self.compiles.get(name, 0) + new
            if new:
                self.kernels.setdefault(name, []).extend(self.counter.names)

    def total(self) -> float:
        return self.last - self.start

    def compiled_line(self, show: int = 6) -> str:
        """The kernels compiled in each phase, for the log ("" when none): "train 14 (name, ...), rollout 2
        (...)", the first `show` distinct names of each phase with their counts."""
        return ", ".join(f"{phase} {len(names)} ({kernel_list(names, show)})" for phase, names in self.kernels.items())

    def metrics(self) -> dict[str, float]:
        """perf/<phase>_s of every phase lapped so far, perf/step_s (their total), and with compiles counted
        perf/triton_new_<phase>."""
        compiles = {f"perf/triton_new_{k}": float(v) for k, v in (self.compiles or {}).items()}
        return {f"perf/{k}_s": v for k, v in self.laps.items()} | {"perf/step_s": self.total()} | compiles


def log_samples(run: Run, samples: list, step: int) -> None:
    """The step's first completions as the rollout/samples table."""
    rows = [[step, run.tokenizer.decode(s.prompt_ids), run.tokenizer.decode(s.response_ids), s.reward,
             s.advantage] for s in samples[:run.cfg.rollout.log_samples]]
    if rows:
        run.tracker.log_table("rollout/samples", ["step", "prompt", "response", "reward", "advantage"], rows, step)


def checkpoint(run: Run, step: int, raw_yaml: str, version: int | None = None) -> Path:
    """One checkpoint of the run at `step` (on many ranks every rank's state in one directory, together); the
    adapter's weight version is `version` (None: run.version, the one the engine serves), and the rollout producer's
    state goes with it (`RolloutSource.state`: its mode and prompt stream in state.json, a partial pool in each
    rank's rollout.pt, `rollout_checkpoint`)."""
    data_state, in_flight = rollout_checkpoint(run.rollouts.state())
    path = save_checkpoint(run.run_dir, step, run.model, run.cfg.lora, run.opt, run.sched, data_state,
                           {"weight_version": run.version if version is None else version}, raw_yaml,
                           keep=run.cfg.keep_checkpoints,
                           base_model_name_or_path=run.cfg.model.hf_path or run.cfg.model.path or run.cfg.model.name,
                           ctx=run.ctx, rollout_state=in_flight)
    run.guard.last_good = path
    run.last_checkpoint = path
    log.info("checkpoint: %s", path)
    return path


STEP_LINE = (("reward", "rollout/reward_mean"), ("accuracy", "rollout/accuracy"), ("loss", "train/loss"),
             ("grad_norm", "train/grad_norm"), ("logprob_gap", "train/rollout_logprob_abs_diff"),
             ("sync_s", "sync/seconds"), ("step_s", "perf/step_s"))
"""The step line's fields, in order: (label, metric key); a metric the step did not log prints as "-"."""


def step_line(step: int, total: int, m: dict) -> str:
    """`step 3/500 reward=0.19 accuracy=19.5% loss=... grad_norm=... logprob_gap=... sync_s=... step_s=...`, plus
    `empty=1` on a step with nothing to train on (train/empty_step)."""
    fields = [f"{label}={_value(key, m.get(key))}" for label, key in STEP_LINE]
    if m.get("train/empty_step") == 1.0:
        fields.append("empty=1")
    return f"step {step}/{total} " + " ".join(fields)


def _value(key: str, v) -> str:
    if v is None:
        return "-"
    return f"{100 * v:.1f}%" if key == "rollout/accuracy" else f"{v:.4g}"


def log_adapter(lora, model, suffix: str = "") -> None:
    """One INFO line on the adapter (rank, how many target module names, trainable parameters); the names at
    DEBUG."""
    log.info("LoRA rank %d on %d target module names: %s trainable params (the base is frozen)%s", lora.rank,
             len(lora.targets), f"{adapter_num_params(model):,}", suffix)
    log.debug("LoRA targets: %s", ",".join(lora.targets))


@hydra_app("miles_k3.train", "train")
def main(raw: DictConfig) -> None:
    silence_fla_cpu_warning()
    cfg = typed_or_exit(raw, "miles_k3.train")
    with exit_on_user_error("miles_k3.train"):
        if cfg.steps == 0:
            seed_everything(cfg.seed)
            dry_run(cfg)
            return
        if cfg.launcher == "ray":  # this process is the driver: Ray Train's workers run the loop
            from miles_k3.ray_launch import launch_on_ray
            launch_on_ray(cfg, OmegaConf.to_yaml(raw, resolve=True), train)
            return
        run = train(cfg, OmegaConf.to_yaml(raw, resolve=True))  # the run's own run_dir, not ${now:...}
        shutdown(run.ctx)


def dry_run(cfg) -> None:
    """steps=0: build the frozen base with the adapter as training does (under torchrun this rank's shard: only its
    slices read, one line per rank on rank 0), report, stop."""
    ctx, device = start_ranks(cfg.model, cfg.parallel, cfg.device)
    model = build_model(cfg.model, device, resolve_dtype(cfg.model.dtype, device), ctx, cfg.lora, cfg.seed)
    log_adapter(cfg.lora, model)
    log.warning("steps=0: built the model and adapter and stopping; set steps=N and data.source=... to train")
    shutdown(ctx)


if __name__ == "__main__":
    main()
