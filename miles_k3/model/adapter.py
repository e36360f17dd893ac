"""PEFT-format LoRA adapter directories: `save_adapter` writes what vLLM / SGLang / PEFT load, and
`load_adapter` reads one back into a K3 model, validating every field, key and shape at this boundary.

A directory holds `adapter_config.json` (written by `peft.LoraConfig.save_pretrained`: peft_type LORA,
task_type CAUSAL_LM, r, lora_alpha, lora_dropout, target_modules = the configured names, use_rslora; no DoRA,
no modules_to_save, no bias) and `adapter_model.safetensors` (fp32, metadata {"format": "pt"}) with keys
`base_model.model.language_model.<module path>.lora_A.weight` [r, In] / `.lora_B.weight` [Out, r], the
module path being the published checkpoint's (`...model.layers.1.self_attn.q_proj.lora_A.weight`). Routed
experts use the per-expert 2-D form the checkpoint's `experts.{e}.w1` names imply:
`...block_sparse_moe.experts.{e}.w1.lora_A.weight` [r, Dl] / `.lora_B.weight` [I, r] (w3 likewise; w2:
[r, I] / [Dl, r]). PEFT's scaling (alpha / r, or alpha / sqrt(r) with rsLoRA) equals ours, so tensors are
stored as trained. peft is imported lazily (GPU hosts may not have it): saving needs it; loading uses it to
cross-check the config when it is installed.

Legend: E experts, r rank, Dl latent width, I expert width.
"""
from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from miles_k3.model.k3 import CHECKPOINT_PREFIX
from miles_k3.model.lora import (
    ALLOWED_TARGETS,
    LoRAConfig,
    applied_lora_config,
    apply_lora,
    expert_loras,
    lora_linears,
    remove_lora,
)
from miles_k3.utils.atomic import atomic_directory

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model." + CHECKPOINT_PREFIX
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")  # safetensors' names of floating-point dtypes
# adapter_config.json fields whose other values would change what the tensors mean -> accepted values.
PLAIN_LORA_FIELDS = {
    "use_dora": (False, None), "modules_to_save": (None, []), "bias": ("none", None),
    "fan_in_fan_out": (False, None), "rank_pattern": ({}, None), "alpha_pattern": ({}, None),
    "target_parameters": (None, []), "layers_to_transform": (None,), "lora_bias": (False, None),
}


def peft_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """PEFT key -> the adapter tensor it names, as a view into the model's Parameter (experts: A[e] [r, In],
    B[e] [Out, r]). Writing into a view writes the Parameter in place."""
    prefix = getattr(model, "peft_prefix", PEFT_PREFIX)  # an HF model (model.hf_path): its own module paths
    table = {}
    for path, m in lora_linears(model):
        table[f"{prefix}{path}.lora_A.weight"] = m.lora_A.weight
        table[f"{prefix}{path}.lora_B.weight"] = m.lora_B.weight
    for path, name, m in expert_loras(model):
        for e in range(m.lora_A.shape[0]):
            table[f"{prefix}{path}.{e}.{name}.lora_A.weight"] = m.lora_A[e]
            table[f"{prefix}{path}.{e}.{name}.lora_B.weight"] = m.lora_B[e]
    return table


def _first_mismatch(want: LoRAConfig, have: LoRAConfig) -> tuple[str, object, object] | None:
    """(PEFT field, want's value, have's value) of the first weight-relevant difference (dropout is none)."""
    pairs = [("r", want.rank, have.rank), ("lora_alpha", float(want.alpha), float(have.alpha)),
             ("use_rslora", want.use_rslora, have.use_rslora),
             ("target_modules", sorted(want.targets), sorted(have.targets))]
    return next(((f, a, b) for f, a, b in pairs if a != b), None)


# ---- save --------------------------------------------------------------------------------------------
def check_config_matches(model: nn.Module, lora_cfg: LoRAConfig) -> None:
    """`lora_cfg` is valid and the one the model's LoRA was built with (what an adapter file says it is); ValueError
    naming the field otherwise."""
    lora_cfg.validate()
    have = applied_lora_config(model)
    if have is None:
        raise ValueError("save_adapter: the model has no LoRA adapters; apply_lora(model, cfg) first")
    bad = _first_mismatch(lora_cfg, have)
    if bad:
        raise ValueError(f"lora_cfg: {bad[0]}={bad[1]} but the model's LoRA has {bad[2]}; pass the "
                         "LoRAConfig the model's LoRA was built with")


def save_adapter(model: nn.Module, lora_cfg: LoRAConfig, path: str | os.PathLike,
                 base_model_name_or_path: str, overwrite: bool = False) -> Path:
    """Write the model's adapters as a PEFT LoRA directory at `path` (atomically: a temp dir renamed into
    place). `lora_cfg` must be the config the model's LoRA was built with. Refuses an existing `path` unless
    `overwrite`. Returns the directory."""
    from peft import LoraConfig  # lazy: GPU hosts may not have peft

    check_config_matches(model, lora_cfg)
    tensors = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in peft_tensors(model).items()}
    with atomic_directory(path, overwrite) as tmp:
        LoraConfig(r=lora_cfg.rank, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
                   target_modules=list(lora_cfg.targets), use_rslora=lora_cfg.use_rslora, bias="none",
                   modules_to_save=None, use_dora=False, fan_in_fan_out=False, init_lora_weights=True,
                   inference_mode=True, task_type="CAUSAL_LM",
                   base_model_name_or_path=base_model_name_or_path).save_pretrained(str(tmp))
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    return Path(path)


# ---- load --------------------------------------------------------------------------------------------
def load_adapter(model: nn.Module, path: str | os.PathLike) -> LoRAConfig:
    """Load a PEFT LoRA directory into `model`, copying into its adapter Parameters in place (their storage
    never moves). If the model has LoRA, its rank, alpha, use_rslora and targets must equal the file's
    (dropout may differ: it does not affect the weights); if it has none, load applies LoRA with the file's
    config first (freezing the base) and removes it again should the load fail. Everything is validated
    (from the safetensors header: keys, shapes, dtypes, and that the data covers the file) before any tensor
    is written. Returns the file's config.

    A model cut for a mesh (`build_model(..., ctx, lora)`: one rank's shard) is checked against the whole adapter
    (every key, experts by global id, whole shapes) and reads only its rank's slice of each tensor, the slice its
    shard plan records (a column-parallel base's B rows, a row-parallel base's A columns, its experts' A and B):
    no rank holds more than its shard plus one tensor's slice in flight. It must have been built with LoRA (the
    plan cuts each adapter with its base).

    Raises FileNotFoundError for a missing file, and ValueError naming the field or key and the fix for: a
    non-LORA peft_type, DoRA or another non-plain LoRA option, a config that differs from the model's LoRA,
    a missing, unexpected or wrongly shaped tensor, and an unreadable (truncated/corrupt) safetensors file.
    """
    adapter_dir = Path(path)
    file_cfg = read_adapter_config(adapter_dir)
    with _open_weights(adapter_dir / WEIGHTS_FILE) as weights:
        have = applied_lora_config(model)
        if have is not None:
            bad = _first_mismatch(file_cfg, have)
            if bad:
                raise ValueError(f"{adapter_dir / CONFIG_FILE}: {bad[0]}={bad[1]} but the model's LoRA has "
                                 f"{bad[2]}; build the model's LoRA with the adapter's settings, or load into a "
                                 "model without LoRA (load_adapter then applies it)")
            _copy_checked(model, weights, adapter_dir / WEIGHTS_FILE)
            return file_cfg
        plan = getattr(model, "shard_plan", None)
        if plan is not None and not plan.whole:  # LoRA attached now would not be cut with its base
            raise ValueError(f"{adapter_dir}: this model is cut for a mesh (tp={plan.ctx.tp_size}, "
                             f"ep={plan.ctx.ep_size}) and has no LoRA; build it with the adapter's (build_model(..., "
                             "lora=read_adapter_config(dir))), so that its plan cuts each adapter with its base, "
                             "then load")
        apply_lora(model, file_cfg)
        try:
            _copy_checked(model, weights, adapter_dir / WEIGHTS_FILE)
        except BaseException:
            remove_lora(model)
            raise
    return file_cfg


def read_adapter_config(adapter_dir: Path) -> LoRAConfig:
    """adapter_config.json as a validated LoRAConfig (also parsed by peft's LoraConfig when installed)."""
    file = adapter_dir / CONFIG_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{file}: missing; an adapter directory holds {CONFIG_FILE} and "
                                f"{WEIGHTS_FILE}")
    try:
        raw = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON ({e}); re-export the adapter") from None
    if raw.get("peft_type") != "LORA":
        raise ValueError(f"{file}: peft_type is {raw.get('peft_type')!r}; only LORA adapters can be loaded")
    for key, accepted in PLAIN_LORA_FIELDS.items():
        if key in raw and raw[key] not in accepted:
            raise ValueError(f"{file}: {key}={raw[key]!r} is not supported (plain LoRA only); export the "
                             f"adapter with {key}={accepted[0]!r}")
    for key in ("r", "lora_alpha", "target_modules"):
        if key not in raw:
            raise ValueError(f"{file}: required field {key} is missing; re-export the adapter")
    if not isinstance(raw["target_modules"], list):  # a bad file value, reported like every other one
        raise ValueError(  # noqa: TRY004
            f"{file}: target_modules={raw['target_modules']!r} must be a list of module names "
            "(regex strings are not supported)")
    _peft_cross_check(adapter_dir)
    cfg = LoRAConfig(rank=raw["r"], alpha=float(raw["lora_alpha"]),
                     dropout=float(raw.get("lora_dropout") or 0.0), targets=list(raw["target_modules"]),
                     use_rslora=bool(raw.get("use_rslora", False)))
    try:
        cfg.validate()
    except ValueError as e:
        raise ValueError(f"{file}: {e}") from None
    cfg.targets = [t for t in ALLOWED_TARGETS if t in cfg.targets]  # PEFT stores a set: use our order
    return cfg


def read_adapter(path: str | os.PathLike) -> tuple[LoRAConfig, dict[str, torch.Tensor]]:
    """(config, PEFT-named tensors) of an adapter directory, for an engine that loads the tensors itself
    (SGLang) rather than a model of ours. Checked without a model: every key is a `.lora_A.weight` /
    `.lora_B.weight` of a module named in target_modules, each A has its B, A is [r, In] and B [Out, r] with the
    config's r, and every tensor is floating point and finite. Errors name the file and key."""
    adapter_dir = Path(path)
    cfg = read_adapter_config(adapter_dir)
    file = adapter_dir / WEIGHTS_FILE
    tensors = _read_tensors(file)
    if not tensors:
        raise ValueError(f"{file}: holds no tensors; re-export the adapter")
    for key, t in tensors.items():
        module, dot, part = key.rpartition(".lora_")
        if not dot or part not in ("A.weight", "B.weight"):
            raise ValueError(f"{file}: unexpected key {key}; an adapter holds only <module>.lora_A.weight and "
                             "<module>.lora_B.weight")
        if module.rpartition(".")[2] not in cfg.targets:
            raise ValueError(f"{file}: {key} adapts a module that is not in target_modules {cfg.targets}; "
                             "re-export the adapter")
        if t.dim() != 2 or not t.is_floating_point() or not bool(torch.isfinite(t).all()):
            raise ValueError(f"{file}: {key} must be a 2-D finite floating-point tensor, got "
                             f"{t.dtype} {tuple(t.shape)}; re-export the adapter")
    for module, ab in lora_pairs(tensors).items():
        if set(ab) != {"A", "B"}:
            lacking = "B" if "A" in ab else "A"
            raise ValueError(f"{file}: {module}.lora_{lacking}.weight is missing; the file is incomplete: "
                             "re-export the adapter")
        if ab["A"].shape[0] != cfg.rank or ab["B"].shape[1] != cfg.rank:
            raise ValueError(f"{file}: {module} has lora_A {tuple(ab['A'].shape)} and lora_B "
                             f"{tuple(ab['B'].shape)}, but r={cfg.rank} in {CONFIG_FILE}; the files do not "
                             "belong together")
    return cfg, tensors


def lora_pairs(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """PEFT module key (`...<module path>`) -> {"A": its lora_A.weight, "B": its lora_B.weight} (either may be
    missing) of an adapter file's tensors whose keys `read_adapter` checked."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        module, _, part = key.rpartition(".lora_")
        pairs.setdefault(module, {})[part[0]] = t
    return pairs


def _peft_cross_check(adapter_dir: Path) -> None:
    """Let peft parse the config too, when it is installed (it is optional on GPU hosts)."""
    try:
        from peft import LoraConfig
    except ImportError:
        return
    try:
        LoraConfig.from_pretrained(str(adapter_dir))
    except (TypeError, ValueError, KeyError) as e:
        raise ValueError(f"{adapter_dir / CONFIG_FILE}: peft cannot parse it: {e}") from None


def _read_tensors(file: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a weights file (`read_adapter`: one process, for an engine that takes the whole adapter)."""
    _check_exists(file)
    try:
        return load_file(str(file))
    except (SafetensorError, OSError) as e:
        raise _unreadable(file, e) from None


def _check_exists(file: Path) -> None:
    if not file.is_file():
        raise FileNotFoundError(f"{file}: missing; an adapter directory holds {CONFIG_FILE} and "
                                f"{WEIGHTS_FILE}")


def _unreadable(file: Path, e: Exception) -> ValueError:
    return ValueError(f"{file}: unreadable ({e}); the file is truncated or corrupt: re-export or re-download the "
                      "adapter")


@contextlib.contextmanager
def _open_weights(file: Path) -> Iterator:
    """The weights file opened with `safe_open`: its header parsed, nothing read yet. safetensors refuses a header
    whose data offsets do not cover the file exactly, so a truncated file fails here, before any tensor is read."""
    _check_exists(file)
    try:
        handle = safe_open(str(file), framework="pt")
    except (SafetensorError, OSError) as e:
        raise _unreadable(file, e) from None
    with handle:
        yield handle


def _listing(keys: list[str], limit: int = 5) -> str:
    more = f" (+{len(keys) - limit} more)" if len(keys) > limit else ""
    return ", ".join(sorted(keys)[:limit]) + more


@dataclass(frozen=True)
class _Target:
    """One tensor of the whole adapter's PEFT file, as the model expects it: its key and whole shape, where this
    rank keeps it (`dst`, a view of the Parameter; None: an expert another EP rank holds, checked but not read)
    and which part of the file's tensor that is (`index` per dim; None: all of it)."""

    key: str
    shape: tuple[int, ...]
    dst: torch.Tensor | None
    index: tuple[slice, ...] | None


def _targets(model: nn.Module) -> list[_Target]:
    """Every tensor of the whole adapter, in `peft_tensors`' order (linears, then experts by global id), from the
    model's Parameters and its shard plan's slices (`part.full` along `part.dim`): nothing whole is allocated."""
    plan = getattr(model, "shard_plan", None)  # an HF model has none
    prefix = getattr(model, "peft_prefix", PEFT_PREFIX)
    out = []
    for path, m in lora_linears(model):
        for name, p in ((f"{path}.lora_A.weight", m.lora_A.weight), (f"{path}.lora_B.weight", m.lora_B.weight)):
            part = None if plan is None else plan.slice_of(name)
            if part is None:
                out.append(_Target(prefix + name, tuple(p.shape), p, None))
                continue
            shape = list(p.shape)
            shape[part.dim] = part.full
            index = (slice(None),) * part.dim + (slice(part.start, part.start + part.length),)
            out.append(_Target(prefix + name, tuple(shape), p, index))
    for path, proj, m in expert_loras(model):
        for ab, p in (("A", m.lora_A), ("B", m.lora_B)):
            part = None if plan is None else plan.slice_of(f"{path}.lora.{proj}.lora_{ab}")
            first, total = (0, p.shape[0]) if part is None else (part.start, part.full)
            for e in range(total):
                held = first <= e < first + p.shape[0]
                out.append(_Target(f"{prefix}{path}.{e}.{proj}.lora_{ab}.weight", tuple(p.shape[1:]),
                                   p[e - first] if held else None, None))
    return out


@torch.no_grad()
def _copy_checked(model: nn.Module, weights, file: Path) -> None:
    """Check keys, shapes and dtypes (the header of `weights`, a `safe_open` handle) against the whole adapter the
    model expects, then read each tensor's part this rank holds straight into its Parameter: a model cut for a mesh
    (`model.shard_plan`: TP halves, EP expert ranges) reads its slices only, one at a time."""
    targets = _targets(model)
    _check_header(targets, weights, file, getattr(model, "peft_prefix", PEFT_PREFIX))
    try:
        for t in targets:
            if t.dst is not None:
                t.dst.copy_(weights.get_tensor(t.key) if t.index is None else weights.get_slice(t.key)[t.index])
    except (SafetensorError, OSError) as e:  # the header was sound: the data changed under us
        raise _unreadable(file, e) from None


def _check_header(targets: list[_Target], weights, file: Path, prefix: str) -> None:
    expected = {t.key for t in targets}
    stored = set(weights.keys())
    missing = [t.key for t in targets if t.key not in stored]
    if missing:
        raise ValueError(f"{file}: missing key(s) {_listing(missing)}; the adapter does not cover this "
                         "model's LoRA modules (another model config, or other target_modules)")
    unexpected = [k for k in stored if k not in expected]
    if unexpected:
        raise ValueError(f"{file}: unexpected key(s) {_listing(unexpected)}; the model has no such adapter "
                         f"(another model config, or keys not under {prefix})")
    for t in targets:
        info = weights.get_slice(t.key)
        shape, dtype = tuple(info.get_shape()), info.get_dtype()
        if shape != t.shape:
            raise ValueError(f"{file}: {t.key} has shape {shape}, the model expects {t.shape}; the adapter was made "
                             "for another rank or model config")
        if dtype not in FLOAT_DTYPES:
            raise ValueError(f"{file}: {t.key} has dtype {dtype}; adapter tensors must be floating point")
