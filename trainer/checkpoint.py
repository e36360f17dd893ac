"""Trainer checkpoints: everything a run needs to continue bit-for-bit, written whole or not at all, one code path
for one rank and many (`ctx`; SINGLE: one process, a mesh of one). The layout, finding and resolving a checkpoint,
and the checks of its files: `checkpoint_files.py`.

Saving is a transaction over the world: rank 0 stages the step directory (`atomic.stage_directory`, a hidden
`.step_*.tmp-*` sibling) and sends its path; every rank writes its rank-<RRRRR>/ files (optimizer and scheduler,
RNG states, its adapter parameters: its shard, only its slices); their verdicts are reduced (that is the barrier: no
rank goes on before every rank has written); then the whole adapter is written as a PEFT directory by rank 0, one
tensor at a time, each received from the rank that holds it (`adapter_stream.save_adapter_streamed`: no rank holds
more than its shard and one tensor); then rank 0 writes the other shared members (state.json, config.yaml,
mesh.json), publishes the directory (renamed into place), points `latest` at it (`atomic_write_text`) and prunes;
its verdict is sent to every rank. A failure anywhere leaves the previous checkpoint and `latest` as they were and
raises CheckpointWriteError on every rank, naming the rank.

Loading checks everything on every rank first (mesh, LoRA config, state, the whole adapter's file, this rank's
files against its parameters and optimizer), reduces the verdicts, and only then does every rank restore its
state (or none does). The directory must be on a file system every rank sees (one node, or a shared one).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from miles_k3.model.adapter import WEIGHTS_FILE
from miles_k3.model.adapter_stream import save_adapter_streamed
from miles_k3.model.lora import LoRAConfig, applied_lora_config, lora_parameters
from miles_k3.parallel.mesh import SINGLE, ParallelContext
from miles_k3.parallel.reduce import broadcast, gather, ranks_where, world_of
from miles_k3.trainer.checkpoint_files import (  # noqa: F401 - re-exported: the trainer's checkpoint API
    ADAPTER_DIR,
    CONFIG_YAML,
    LATEST,
    MESH_FILE,
    OPTIMIZER_FILE,
    OPTIMIZER_KEYS,
    RNG_FILE,
    RNG_KEYS,
    ROLLOUT_FILE,
    ROLLOUT_KEYS,
    SHARD_FILE,
    STATE_FILE,
    ResumeError,
    check_lora_matches,
    check_mesh,
    check_optimizer_matches,
    check_rng,
    checkpoints_dir,
    corrupt,
    find_latest,
    is_complete,
    member_files,
    mesh_of,
    prune,
    rank_dir_name,
    read_pt,
    read_state,
    resolve_resume,
    rng_state,
    set_rng_state,
    state_json,
    step_dir_name,
)
from miles_k3.utils.atomic import atomic_write_text, publish_directory, stage_directory


class CheckpointWriteError(RuntimeError):
    """A rank could not write its part of a checkpoint; nothing was published (the message names the ranks)."""


def save_checkpoint(run_dir, step: int, model: nn.Module, lora_cfg: LoRAConfig, optimizer: torch.optim.Optimizer,
                    scheduler, data_state: dict, extra_state: dict, config_text: str, keep: int = 3,
                    base_model_name_or_path: str | None = None, ctx: ParallelContext = SINGLE,
                    rollout_state: dict | None = None) -> Path:
    """Write `<run_dir>/checkpoints/step_<step>/` on every rank of `ctx` together (each passes its own model,
    optimizer and scheduler; data_state, extra_state and config_text are rank 0's), then point `latest` at it,
    then delete all but the newest `keep` step directories (never the new one). An existing directory for the
    same step is replaced. `data_state` and `extra_state` must be JSON-serialisable (checked before anything is
    written). `base_model_name_or_path` goes into the adapter's adapter_config.json. `rollout_state`: this rank's
    rollouts in flight (rollout.mode=partial: `rollout_checkpoint` of `PartialRollouts.state`), written as
    rank-<RRRRR>/rollout.pt and returned by `load_checkpoint` as "rollout_state". Returns the step directory
    on every rank once it is published; CheckpointWriteError on every rank when any rank failed (nothing
    published, the previous checkpoint and `latest` kept)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step: must be an int >= 0, got {step!r}")
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep: must be an int >= 1 (checkpoints to keep), got {keep!r}")
    state_text = state_json(step, data_state, extra_state)  # a bad value fails on every rank, before any write
    world = world_of(ctx)
    dest = checkpoints_dir(run_dir) / step_dir_name(step)
    staging = broadcast(_attempt(lambda: stage_directory(dest, overwrite=True)) if ctx.is_main else None, world)
    if isinstance(staging, str):
        raise CheckpointWriteError(f"checkpoint of step {step}: rank 0 could not stage {dest} ({staging}); nothing "
                                   "was written")
    error = _attempt(lambda: _write_rank_files(staging / rank_dir_name(ctx.rank), model, optimizer, scheduler,
                                               rollout_state))
    _raise_if_any(error, world, ctx, f"checkpoint of step {step}: could not write rank files under {staging}",
                  staging)
    error = _attempt(lambda: save_adapter_streamed(model, lora_cfg, staging / ADAPTER_DIR, base_model_name_or_path,
                                                   ctx))  # every rank: rank 0 writes, the others send their pieces
    _raise_if_any(error, world, ctx, f"checkpoint of step {step}: could not write the adapter under {staging}",
                  staging)
    published = None
    if ctx.is_main:
        published = _attempt(lambda: _publish(staging, dest, step, state_text, config_text, ctx, keep))
    published = broadcast(published, world)
    if isinstance(published, str):
        raise CheckpointWriteError(f"checkpoint of step {step}: rank 0 could not publish {dest}: {published}; the "
                                   "previous checkpoint is kept")
    return dest


def _attempt(fn):
    """fn()'s result, or its error as a one-line string: a rank that fails must still take part in the
    collective that tells the others."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - any failure to write is reported to every rank, then raised there
        return f"{type(e).__name__}: {e}"


def _raise_if_any(error, world, ctx: ParallelContext, what: str, staging: Path) -> None:
    failed = ranks_where(isinstance(error, str), world)
    if not failed:
        return
    reasons = gather(error if isinstance(error, str) else None, world)
    if ctx.is_main:
        shutil.rmtree(staging, ignore_errors=True)
    raise CheckpointWriteError(f"{what}: " + "; ".join(f"rank {r}: {reasons[r]}" for r in failed) +
                               "; nothing was published, the previous checkpoint is kept")


def _write_rank_files(own: Path, model: nn.Module, optimizer, scheduler, rollout_state: dict | None) -> Path:
    own.mkdir()
    if rollout_state is not None:
        torch.save(rollout_state, own / ROLLOUT_FILE)
    shard = {n: p.detach().to("cpu") for n, p in lora_parameters(model).items()}  # on the CPU: the parameters
    torch.save(shard, own / SHARD_FILE)
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, own / OPTIMIZER_FILE)
    torch.save(rng_state(), own / RNG_FILE)
    return own


def _publish(staging: Path, dest: Path, step: int, state_text: str, config_text: str, ctx: ParallelContext,
             keep: int) -> Path:
    """Rank 0: the other shared members (the adapter is written), then the directory published and `latest` moved
    to it (a failure before the rename deletes the staging directory: the previous checkpoint stays the latest)."""
    try:
        (staging / STATE_FILE).write_text(state_text, encoding="utf-8")
        (staging / CONFIG_YAML).write_text(config_text, encoding="utf-8")
        (staging / MESH_FILE).write_text(json.dumps(mesh_of(ctx)) + "\n", encoding="utf-8")
        publish_directory(staging, dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    atomic_write_text(dest.parent / LATEST, dest.name + "\n")
    prune(dest.parent, step, keep)
    return dest


def rng_file(ckpt: Path, ctx: ParallelContext = SINGLE) -> Path:
    """This rank's RNG states in checkpoint `ckpt`."""
    return Path(ckpt) / rank_dir_name(ctx.rank) / RNG_FILE


def load_checkpoint(path, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler,
                    ctx: ParallelContext = SINGLE) -> dict:
    """Restore a step directory on every rank of `ctx` together: this rank's adapter tensors into `model`'s LoRA
    Parameters in place, its optimizer and scheduler states and every RNG state, from its rank-<RRRRR>/ files,
    once every rank has checked everything. `model` must already have LoRA (same rank, alpha, targets) and
    `optimizer` must be built over its adapters (`build_optimizer(lora_parameters(model), ...)`). Returns the
    state.json dict (with "rollout_state": this rank's rollout.pt, when the checkpoint has one; the rollout
    producer's state is `rollout_state_of` it).

    Raises ResumeError (on every rank, nothing restored anywhere) naming the file for a missing directory or a
    missing, truncated or corrupt member (with the earlier checkpoint to resume from instead), for a run
    configured with another LoRA rank, alpha, targets or use_rslora than the checkpoint was written with (both
    named, and how to resume or start over), for an optimizer that does not match, for a checkpoint of another
    mesh (both meshes named: `check_mesh`) or one in the old one-process layout."""
    path, world = Path(path), world_of(ctx)
    if applied_lora_config(model) is None:
        raise ValueError("model: has no LoRA adapters; apply_lora(model, lora_cfg) and build the optimizer "
                         "over lora_parameters(model) before load_checkpoint")
    try:
        loaded, error = _read_rank_state(ctx, path, model, optimizer), None
    except ResumeError as e:
        loaded, error = None, str(e)
    failed = ranks_where(error is not None, world)
    if failed:
        reasons = gather(error, world)
        if len(failed) == ctx.world_size and len(set(reasons)) == 1:  # the same on every rank (another mesh...)
            raise ResumeError(error)
        raise ResumeError("; ".join(f"rank {r}: {reasons[r]}" for r in failed))
    state, blobs, rng, shard, rollout = loaded
    if rollout is not None:
        state["rollout_state"] = rollout
    params = lora_parameters(model)
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(shard[name])
    optimizer.load_state_dict(blobs["optimizer"])
    scheduler.load_state_dict(blobs["scheduler"])
    set_rng_state(rng)
    return state


def _read_rank_state(ctx: ParallelContext, path: Path, model: nn.Module, optimizer) -> tuple:
    """Everything this rank restores from `path`, checked; ResumeError naming the file."""
    if not path.is_dir():
        raise ResumeError(f"{path}: checkpoint directory does not exist")
    mesh = mesh_of(ctx)
    check_mesh(path, mesh)
    for member in member_files(mesh):
        if not (path / member).is_file():
            raise corrupt(path, path / member, "missing: the checkpoint is incomplete")
    check_lora_matches(path, applied_lora_config(model))
    _check_adapter_file(path)
    state = read_state(path)
    own = path / rank_dir_name(ctx.rank)
    blobs = read_pt(path, own / OPTIMIZER_FILE, OPTIMIZER_KEYS)
    rng = read_pt(path, own / RNG_FILE, RNG_KEYS)
    shard = read_pt(path, own / SHARD_FILE, ())
    check_optimizer_matches(own / OPTIMIZER_FILE, blobs["optimizer"], optimizer)
    check_rng(path, own / RNG_FILE, rng)
    _check_shard(path, own / SHARD_FILE, shard, lora_parameters(model))
    rollout = read_pt(path, own / ROLLOUT_FILE, ROLLOUT_KEYS) if (own / ROLLOUT_FILE).is_file() else None
    return state, blobs, rng, shard, rollout


def rollout_checkpoint(state: dict) -> tuple[dict, dict | None]:
    """A rollout producer's `state()` as a checkpoint holds it: (data_state for state.json: its "rollout_mode" and
    the prompt stream's position, "stream", rank 0's; this rank's rank-<R>/rollout.pt: everything else with its own
    stream, or None when there is nothing else, as for rollout.mode=sync). `rollout_state_of` is its inverse."""
    data = {"stream": state["stream"], "rollout_mode": state["mode"]}
    rest = {k: v for k, v in state.items() if k != "mode"}
    return data, (rest if set(rest) != {"stream"} else None)


def rollout_state_of(state: dict) -> dict:
    """The rollout producer's state (`RolloutSource.state()`, what `load_state` takes) in a checkpoint loaded by
    `load_checkpoint`: the mode and prompt stream of state.json's data_state, updated with this rank's rollout.pt
    (a partial run's pool and its replica's stream). ResumeError when the checkpoint has no prompt stream."""
    data = state.get("data_state", {})
    if "stream" not in data:
        raise ResumeError("state.json's data_state holds no prompt stream (data_state.stream); the checkpoint is "
                          "not a training run's")
    return {"mode": data.get("rollout_mode", "sync"), "stream": data["stream"]} | state.get("rollout_state", {})


def _check_shard(path: Path, file: Path, shard: dict, params: dict) -> None:
    if sorted(shard) != sorted(params):
        missing, unknown = sorted(set(params) - set(shard)), sorted(set(shard) - set(params))
        raise corrupt(path, file, f"holds other adapter parameters than this rank's (missing {missing[:3]}, "
                                  f"unknown {unknown[:3]})")
    for name, p in params.items():
        t = shard[name]
        if not isinstance(t, torch.Tensor) or t.shape != p.shape or not t.is_floating_point():
            raise corrupt(path, file, f"{name} is not a floating tensor of this rank's shape {tuple(p.shape)}")


def _check_adapter_file(path: Path) -> None:
    """The whole adapter's weights (servable as is, not read back: each rank restores its own shard) are a
    readable safetensors file."""
    file = path / ADAPTER_DIR / WEIGHTS_FILE
    try:
        with safe_open(file, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - a safe_open handle is not iterable
                f.get_slice(key)
    except Exception as e:  # noqa: BLE001 - a truncated header, a bad offset: the file is unusable
        raise corrupt(path, file, f"unreadable, the file is truncated or corrupt ({type(e).__name__}: {e})"
                      ) from None
