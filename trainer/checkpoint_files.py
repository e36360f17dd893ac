"""The files of a trainer checkpoint (`checkpoint.py` writes and reads them): names and layout, the step
directories, `latest`, pruning, finding and resolving the one to resume from (`find_latest`, `resolve_resume`),
RNG states, and the checks of each member (`ResumeError` names the file and what to do).

Layout under `<run_dir>/checkpoints/`, one for one rank and many:
  step_<NNNNNNNN>/          one per saved step (8-digit, zero-padded)
    adapter/                the whole PEFT LoRA directory (`miles_k3.model.adapter.save_adapter`), servable as is
    state.json              {"step", "data_state" (the data cursor), "extra_state" (weight version, metrics...)}
    config.yaml             the run's resolved config, as given
    mesh.json               the mesh that wrote it: {"dp", "tp", "ep", "world"} (one process: all 1)
    rank-<RRRRR>/           per rank:
      optimizer.pt          {"optimizer": AdamW state dict (with param_names), "scheduler": LambdaLR state dict}
      rng.pt                torch CPU and CUDA RNG states, python `random` and numpy global states
      adapter_shard.pt      the rank's LoRA parameters by name (its shards under TP/EP)
  latest                    text: the name of the newest published step directory

A checkpoint resumes only on the mesh that wrote it. One in the one-process layout of before (optimizer.pt and
rng.pt beside adapter/, no mesh.json) is refused on resume (`OLD_LAYOUT`). The .pt files hold only tensors,
numbers, strings, lists, tuples and dicts, and are read with `torch.load(weights_only=True)`.
"""
from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from miles_k3.model.adapter import CONFIG_FILE, WEIGHTS_FILE, read_adapter_config
from miles_k3.model.lora import LoRAConfig

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
LATEST = "latest"
ADAPTER_DIR = "adapter"
OPTIMIZER_FILE = "optimizer.pt"
RNG_FILE = "rng.pt"
STATE_FILE = "state.json"
CONFIG_YAML = "config.yaml"
MESH_FILE = "mesh.json"
SHARD_FILE = "adapter_shard.pt"
ROLLOUT_FILE = "rollout.pt"  # rollout.mode=partial: the groups in flight (optional: a sync run has none)
ROLLOUT_KEYS = ("groups", "engine")
RANK_FILES = (OPTIMIZER_FILE, RNG_FILE, SHARD_FILE)
"""Each rank's files in its rank-<RRRRR>/ directory."""
TOP_FILES = (f"{ADAPTER_DIR}/{CONFIG_FILE}", f"{ADAPTER_DIR}/{WEIGHTS_FILE}", STATE_FILE, CONFIG_YAML,
                   MESH_FILE)
MESH_KEYS = ("dp", "tp", "ep", "world")
OLD_LAYOUT = ("a checkpoint in the one-process layout of before (optimizer.pt and rng.pt beside adapter/, no mesh.json); "
              "this trainer writes one layout for one and many ranks (mesh.json, rank-00000/...) and cannot resume "
              "it: start a new run (resume=none, or another run_dir) from the same base; its adapter/ directory "
              "holds the trained adapter, servable as is")
STEP_DIR = re.compile(r"step_(\d{8,})")  # published directories only: staging ones start with "."
LEFTOVER = re.compile(r"\.(step_\d{8,}|latest)\.(tmp|old)-.*")


class ResumeError(ValueError):
    """A run cannot resume from the checkpoint asked for: the message names the file and what to do."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def checkpoints_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / CHECKPOINTS


def rank_dir_name(rank: int) -> str:
    return f"rank-{rank:05d}"


# ---- the mesh that wrote a checkpoint --------------------------------------------------------------------
def mesh_of(ctx) -> dict[str, int]:
    """The mesh of a ParallelContext as a checkpoint records it."""
    return {"dp": ctx.dp_size, "tp": ctx.tp_size, "ep": ctx.ep_size, "world": ctx.world_size}


def is_old_layout(path: Path) -> bool:
    """`path` is a step directory in the one-process layout of before (see OLD_LAYOUT)."""
    return (path / OPTIMIZER_FILE).is_file() and not (path / MESH_FILE).exists()


def checkpoint_mesh(path: Path) -> dict[str, int] | None:
    """The mesh that wrote step directory `path`; None for a mesh.json that is missing, unreadable or not a
    mesh."""
    file = path / MESH_FILE
    if not file.exists():
        return None
    try:
        mesh = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    ok = isinstance(mesh, dict) and all(isinstance(mesh.get(k), int) and mesh[k] >= 1 for k in MESH_KEYS)
    return {k: mesh[k] for k in MESH_KEYS} if ok else None


def member_files(mesh: dict[str, int]) -> tuple[str, ...]:
    """The files a complete step directory written by `mesh` holds."""
    return TOP_FILES + tuple(f"{rank_dir_name(r)}/{f}" for r in range(mesh["world"]) for f in RANK_FILES)


def mesh_text(mesh: dict[str, int]) -> str:
    n = mesh["world"]
    return f"dp={mesh['dp']} x tp={mesh['tp']}, ep={mesh['ep']} ({n} rank{'s' * (n != 1)})"


def check_mesh(path: Path, have: dict[str, int]) -> None:
    """The checkpoint at `path` was written by the mesh `have` (this run's): its optimizer, adapter and RNG
    states are per rank of its mesh. ResumeError naming both meshes and how to resume otherwise, or saying that
    the checkpoint is in the old one-process layout."""
    if is_old_layout(path):
        raise ResumeError(f"{path}: {OLD_LAYOUT}")
    saved = checkpoint_mesh(path)
    if saved is None:
        raise corrupt(path, path / MESH_FILE, "unreadable or not a mesh (dp, tp, ep, world)")
    if saved == have:
        return
    how = ("in one process (no torchrun)" if saved["world"] == 1 else
           f"under torchrun with {saved['world']} processes in all")
    raise ResumeError(f"{path}: the checkpoint was written by the mesh {mesh_text(saved)} and this run's mesh is "
                      f"{mesh_text(have)}; its optimizer, adapter and RNG states are per rank of its mesh: resume "
                      f"with parallel.dp={saved['dp']} parallel.tp={saved['tp']} parallel.ep={saved['ep']} {how}, "
                      "or start a new run in another run_dir (its adapter/ directory holds the whole adapter, "
                      "servable as is)")


# ---- save helpers ------------------------------------------------------------------------------------
def state_json(step: int, data_state: dict, extra_state: dict) -> str:
    for name, value in (("data_state", data_state), ("extra_state", extra_state)):
        if not isinstance(value, dict):
            raise TypeError(f"{name}: must be a dict, got {type(value).__name__}")
        try:
            json.dumps(value)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{name}: not JSON-serialisable ({e}); pass plain dicts, lists, strings and "
                             "numbers (convert tensors with .item() / .tolist())") from None
    return json.dumps({"step": step, "data_state": data_state, "extra_state": extra_state}, indent=2) + "\n"


def prune(root: Path, step: int, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints at or below `step` (the new one among them) and delete the
    other step directories at or below it (incomplete ones too), and staging leftovers. Directories of later
    steps (left by a run that was resumed from an earlier checkpoint) are left alone."""
    steps = sorted(_published_steps(root), reverse=True)
    later = [s for s, _ in steps if s > step]
    if later:
        log.warning("%s: keeping step directories %s newer than the step just saved (%d): the run was resumed "
                    "from an earlier checkpoint; delete them by hand if they are no longer wanted",
                    root, later, step)
    current = [p for s, p in steps if s <= step]
    kept = {root / step_dir_name(step)} | set([p for p in current if is_complete(p)][:keep])
    for path in current:
        if path not in kept:
            shutil.rmtree(path, ignore_errors=True)
    for leftover in root.iterdir():
        if LEFTOVER.fullmatch(leftover.name):
            if leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)


def _published_steps(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = STEP_DIR.fullmatch(p.name)
        if m and p.is_dir():
            out.append((int(m.group(1)), p))
    return out


# ---- RNG states ------------------------------------------------------------------------------------------
def rng_state() -> dict[str, Any]:
    """Every global RNG state, as weights_only-loadable values (tensors, ints, floats, strings, lists)."""
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_internal, py_gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": {"version": py_version, "internal": list(py_internal), "gauss_next": py_gauss},
        "numpy": {"name": np_name, "keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
                  "has_gauss": int(np_has_gauss), "cached_gaussian": float(np_gauss)},
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` returned. CUDA states are restored for the devices both runs have."""
    torch.set_rng_state(state["torch"])
    cuda = state["cuda"]
    if cuda:
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have != len(cuda):
            log.warning("checkpoint has CUDA RNG states for %d device(s), this process sees %d; restoring %d",
                        len(cuda), have, min(have, len(cuda)))
        for i in range(min(have, len(cuda))):
            torch.cuda.set_rng_state(cuda[i], i)
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss_next"]))
    npst = state["numpy"]
    np.random.set_state((npst["name"], npst["keys"].numpy().astype(np.uint32), npst["pos"], npst["has_gauss"],
                         npst["cached_gaussian"]))


# ---- find, resolve ---------------------------------------------------------------------------------------
def is_complete(path: str | os.PathLike) -> bool:
    """Whether `path` is a step directory with every member file and a state.json that parses (its step
    matching the directory name)."""
    path = Path(path)
    mesh = checkpoint_mesh(path)
    if mesh is None or not all((path / f).is_file() for f in member_files(mesh)):
        return False
    try:
        state = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    m = STEP_DIR.fullmatch(path.name)
    return isinstance(state, dict) and m is not None and state.get("step") == int(m.group(1))


def find_latest(run_dir: str | os.PathLike) -> Path | None:
    """The checkpoint to resume from: the one `latest` names when it is complete, else the highest-step
    complete step directory; hidden staging leftovers are ignored. None when there is none; ResumeError when
    there is none but there are checkpoints in the old one-process layout (OLD_LAYOUT)."""
    root = checkpoints_dir(run_dir)
    pointer = root / LATEST
    if pointer.is_file():
        name = pointer.read_text(encoding="utf-8").strip()
        if STEP_DIR.fullmatch(name) and is_complete(root / name):
            return root / name
        log.warning("%s names %r, which is not a complete checkpoint; using the newest complete one", pointer,
                    name)
    steps = sorted(_published_steps(root), reverse=True)
    for _, path in steps:
        if is_complete(path):
            return path
    old = [path for _, path in steps if is_old_layout(path)]
    if old:  # not silently a fresh start over the old run's checkpoints
        raise ResumeError(f"{old[0]}: {OLD_LAYOUT}")
    return None


def resolve_resume(resume: str, run_dir: str | os.PathLike) -> Path | None:
    """The `resume` setting as a checkpoint directory: "auto" -> find_latest(run_dir) (None when there is
    none), "none" or "" -> None, else a checkpoint directory, which must exist (ResumeError naming it)."""
    value = (resume or "").strip()
    if value.lower() == "auto":
        return find_latest(run_dir)
    if value.lower() in ("", "none"):
        return None
    path = Path(value).expanduser()
    if not path.exists():
        raise ResumeError(f"resume={resume}: {path} does not exist; pass a checkpoint directory "
                          f"({checkpoints_dir(run_dir)}/step_NNNNNNNN), auto (the newest in run_dir) "
                          "or none (start fresh)")
    if not path.is_dir() or not (path / STATE_FILE).is_file():
        raise ResumeError(f"resume={resume}: {path} is not a checkpoint directory (no {STATE_FILE}); pass a "
                         f"step directory such as {checkpoints_dir(run_dir)}/step_NNNNNNNN")
    return path


# ---- checks of the members -----------------------------------------------------------------------------
OPTIMIZER_KEYS = ("optimizer", "scheduler")
RNG_KEYS = ("torch", "cuda", "python", "numpy")
LORA_FIELDS = ("rank", "alpha", "targets", "use_rslora")
"""The LoRA settings a checkpoint's tensors and optimizer state depend on (dropout does not matter)."""


def check_lora_matches(path: Path, have: LoRAConfig) -> None:
    """The run's LoRA is the one the checkpoint was written with; a difference is a config change, not damage."""
    try:
        saved = read_adapter_config(path / ADAPTER_DIR)
    except (ValueError, FileNotFoundError) as e:  # its message starts with the adapter file's path
        raise ResumeError(f"{e}. This checkpoint cannot be resumed; {_earlier_hint(path)}") from None
    differ = [f for f in LORA_FIELDS if _lora_value(saved, f) != _lora_value(have, f)]
    if differ:
        was = ", ".join(f"lora.{f}={_lora_value(saved, f)}" for f in differ)
        now = ", ".join(f"lora.{f}={_lora_value(have, f)}" for f in differ)
        raise ResumeError(f"{path}: the checkpoint was written with {was} and this run is configured with {now}; "
                          f"set {was} to resume from it, or start a new run in another run_dir (its adapter "
                          "and optimizer state hold the LoRA it was written with)")


def _lora_value(cfg: LoRAConfig, name: str) -> str:
    """A LoRA setting as a Hydra override value (targets sorted: their order does not matter)."""
    value = getattr(cfg, name)
    if name == "targets":
        return "[" + ",".join(sorted(value)) + "]"
    if name == "use_rslora":
        return str(bool(value)).lower()
    return str(float(value)) if name == "alpha" else str(value)


def check_rng(path: Path, file: Path, rng: dict) -> None:
    """Try the RNG states of `file` in checkpoint `path` (then put the current ones back), so a bad rng.pt fails
    before anything changes."""
    current = rng_state()
    try:
        set_rng_state(rng)
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as e:
        raise corrupt(path, file, f"not a valid RNG state ({type(e).__name__}: {e})") from None
    finally:
        set_rng_state(current)


def read_state(path: Path) -> dict:
    file = path / STATE_FILE
    try:
        state = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise corrupt(path, file, f"unreadable ({e})") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise corrupt(path, file, "not a checkpoint state (a JSON object with an int 'step')")
    return state


def read_pt(path: Path, file: Path, keys: tuple[str, ...]) -> dict:
    """The dict `file` (a .pt member of checkpoint `path`) holds, with `keys`; ResumeError naming the file."""
    try:
        blob = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - truncated zip, bad pickle, a refused type: the file is unusable
        raise corrupt(path, file, f"unreadable, the file is truncated or corrupt ({type(e).__name__}: {e})"
                       ) from None
    if not isinstance(blob, dict) or any(k not in blob for k in keys):
        raise corrupt(path, file, f"does not hold the expected entries {list(keys)}")
    return blob


def check_optimizer_matches(file: Path, saved: dict, optimizer: torch.optim.Optimizer) -> None:
    """The saved optimizer state must be for the same parameters, by name, in the same order."""
    try:
        saved_names = [g.get("param_names") for g in saved["param_groups"]]
        saved_counts = [len(g["params"]) for g in saved["param_groups"]]
    except (KeyError, TypeError, AttributeError):
        raise ResumeError(f"{file}: the optimizer state has no valid param_groups; the file is corrupt: resume "
                          "from an earlier checkpoint") from None
    names = [g.get("param_names") for g in optimizer.param_groups]
    counts = [len(g["params"]) for g in optimizer.param_groups]
    if saved_counts != counts or saved_names != names:
        diff = _first_difference(saved_names, names)
        raise ResumeError(f"{file}: the optimizer state is for other parameters (groups of {saved_counts} "
                          f"parameters vs {counts}{diff}); build the optimizer with "
                          "build_optimizer(lora_parameters(model), cfg) on a model with the checkpoint's LoRA "
                          "config")


def _first_difference(saved: list, have: list) -> str:
    flat_saved = [n for g in saved for n in (g or [])]
    flat_have = [n for g in have for n in (g or [])]
    for i, (a, b) in enumerate(zip(flat_saved, flat_have)):
        if a != b:
            return f"; parameter {i} is {a} in the checkpoint, {b} here"
    return ""


def corrupt(ckpt: Path, file: Path, why: str) -> ResumeError:
    """The error for an unusable checkpoint member: names the file and an earlier checkpoint to use."""
    return ResumeError(f"{file}: {why}. This checkpoint cannot be resumed; {_earlier_hint(ckpt)}")


def _earlier_hint(ckpt: Path) -> str:
    m = STEP_DIR.fullmatch(ckpt.name)
    if m:
        earlier = [p for s, p in sorted(_published_steps(ckpt.parent), reverse=True)
                   if s < int(m.group(1)) and is_complete(p)]
        if earlier:
            return f"resume from the previous one instead: resume={earlier[0]}"
    return "resume from an earlier checkpoint (resume=<its step directory>), or start over with resume=none"
