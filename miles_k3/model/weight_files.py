"""The K3 model-weights directory (Hugging Face layout; the trainer's run checkpoints are
`miles_k3.trainer.checkpoint`): read and validate it. A weights directory is
`config.json` (written in the published nested form: `kimi_k3` / `KimiK3ForConditionalGeneration` with
the text keys under `text_config`, and there a compressed-tensors `quantization_config` when the routed
experts are MXFP4; read flat or nested) plus `model.safetensors` or shards listed by
`model.safetensors.index.json` (`metadata.total_size`, `weight_map`; any shard names). Tensor names are
`language_model.` + the `K3ForCausalLM.state_dict()` key; top-level `vision_tower.*` / `mm_projector.*`
tensors are skipped (text-only model). Stored dtypes: bf16, except the fp32 families (`FP32_PARAM_SUFFIXES`)
and the uint8 MXFP4 experts (`…experts.{e}.w{1,2,3}.weight_packed` [out, in/2] + `.weight_scale`
[out, in/32]). `A_log` is stored padded with zeros to a multiple of 128 entries (the published [128] for 96
heads); the model holds one per head. `open_weights` validates a directory by its names (no shard opened),
`WeightIndex.headers` the specs of the tensors a rank reads (opening only their files); loading them, as slices
into a model planned on the meta device, is `weights.py`.
Writing (atomic: a temporary sibling directory renamed into place when complete) is in
`weight_writer.py`.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import json
import logging
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from torch.overrides import TorchFunctionMode

from miles_k3.kernels.mxfp4 import GROUP_SIZE
from miles_k3.model.config import K3Config
from miles_k3.model.experts import RoutedExperts
from miles_k3.model.k3 import CHECKPOINT_PREFIX, FP32_PARAM_SUFFIXES, K3ForCausalLM

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SKIPPED_PREFIXES = ("vision_tower.", "mm_projector.")  # multimodal towers: not part of the text model
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
A_LOG_PAD = 128  # the published A_log is padded with zeros to a multiple of this
MXFP4_FORMAT = "mxfp4-pack-quantized"
LAYER_NAME = re.compile(rf"^{re.escape(CHECKPOINT_PREFIX)}model\.layers\.(\d+)\.")
EXPERT_NAME = re.compile(r"^(?P<base>.*\.experts\.\d+\.w[123])\.(?P<kind>weight|weight_packed|weight_scale)$")
_MAX_LISTED = 8


class WeightsError(ValueError):
    """A checkpoint directory is unusable; the message names the tensor and file and says how to fix it."""


def mxfp4_quantization_config() -> dict[str, Any]:
    """The published K3 `quantization_config` (compressed-tensors `mxfp4-pack-quantized`), verbatim."""
    weights = {"actorder": None, "block_structure": None, "dynamic": False, "group_size": GROUP_SIZE,
               "num_bits": 4, "observer": "minmax", "observer_kwargs": {}, "scale_dtype": "torch.uint8",
               "strategy": "group", "symmetric": True, "type": "float", "zp_dtype": None}
    return {
        "config_groups": {"group_0": {"format": MXFP4_FORMAT, "input_activations": None,
                                      "output_activations": None, "targets": ["Linear"], "weights": weights}},
        "format": MXFP4_FORMAT,
        "global_compression_ratio": None,
        "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                   "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }


# The published config.json (moonshotai/Kimi-K3) nests the text keys, and SGLang (0.5.17) builds K3 only from
# that form: its `model_type` picks the config class (KimiK3Config, whose `text_config` dict becomes a
# KimiLinearConfig), its `architectures[0]` the model; a flat kimi_linear config builds Kimi Linear instead.
MODEL_TYPE = "kimi_k3"
ARCHITECTURE = "KimiK3ForConditionalGeneration"
TEXT_MODEL_TYPE = "kimi_linear"  # the published text_config's model_type and architectures
TEXT_ARCHITECTURE = "KimiLinearForCausalLM"
CONFIG_DTYPE = "bfloat16"
# SGLang takes the dtype from the text config (`_get_and_verify_dtype(hf_text_config)`, reading `.dtype`; it
# copies the top level's down when the text config has none), and with none its dtype=auto runs fp16.
# `dtype` is the published key and the transformers >= 4.56 name (SGLang ships 5.12.1); `torch_dtype` is the
# older name, which 5.x still maps onto `dtype` (keeping `dtype` when both are given) and older readers need.
# Both names, at both levels: every reader finds bfloat16.
DTYPE_KEYS = ("dtype", "torch_dtype")
# Text keys the published config repeats at its top level (SGLang also syncs these between the two levels).
TOP_LEVEL_TEXT_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings")
_PLACED_TEXT_KEYS = ("model_type", "architectures", *DTYPE_KEYS, "quantization_config")


def nested_config(text: dict[str, Any], quantization_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """The published nested `config.json` around the flat text keys `text` (a flat config.json or
    `K3Config.to_dict()`): `text_config` holds every text key (its model_type, architectures and dtype set as
    published, any old quantization_config replaced by `quantization_config`, which goes there as published:
    SGLang's KimiK3Config copies it up to where `_parse_quant_hf_config` looks); the top level gets the K3
    model_type, architectures, dtype and the repeated keys (token ids, tie_word_embeddings). No vision_config:
    SGLang defaults it (text-only checkpoint). Keys are sorted at both levels, as in the published file, so a
    config read back and written again is the same bytes."""
    text_config = {k: copy.deepcopy(v) for k, v in text.items() if k not in _PLACED_TEXT_KEYS}
    text_config.update(model_type=TEXT_MODEL_TYPE, architectures=[TEXT_ARCHITECTURE],
                       **dict.fromkeys(DTYPE_KEYS, CONFIG_DTYPE))
    if quantization_config is not None:
        text_config["quantization_config"] = copy.deepcopy(quantization_config)
    out: dict[str, Any] = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
                           **dict.fromkeys(DTYPE_KEYS, CONFIG_DTYPE)}
    out.update({k: copy.deepcopy(text_config[k]) for k in TOP_LEVEL_TEXT_KEYS if k in text_config})
    out["text_config"] = dict(sorted(text_config.items()))
    return dict(sorted(out.items()))


def config_json(cfg: K3Config, expert_format: str, token_ids: dict[str, int] | None = None
                ) -> dict[str, Any]:
    """`config.json` contents: the published nested form (`nested_config`) of `cfg`'s keys, with the
    quantization_config iff experts are MXFP4; `token_ids` (bos/eos/pad_token_id) override the config's."""
    text = cfg.to_dict()
    text.update(token_ids or {})
    return nested_config(text, mxfp4_quantization_config() if expert_format == "mxfp4" else None)


# ---- the expected tensors of a config --------------------------------------------------------------------
@dataclass(frozen=True)
class TensorSpec:
    """A stored tensor: shape and safetensors dtype name (BF16, F32, U8)."""

    shape: tuple[int, ...]
    dtype: str


def layer_of(name: str) -> int | None:
    """The decoder layer of a checkpoint name (`language_model.model.layers.{L}.…`); None for the others."""
    m = LAYER_NAME.match(name)
    return int(m[1]) if m else None


def stored_dtype(name: str, tensor_dtype: torch.dtype) -> str:
    """Stored dtype of a model tensor: U8 for MXFP4 storage, F32 for the fp32 families, else BF16."""
    if tensor_dtype == torch.uint8:
        return "U8"
    return "F32" if name.endswith(FP32_PARAM_SUFFIXES) else "BF16"


def padded_a_log_len(num_heads: int) -> int:
    """Stored length of `A_log`: num_heads rounded up to a multiple of 128 (K3: 96 -> 128)."""
    return -(-num_heads // A_LOG_PAD) * A_LOG_PAD


class _SkipMetaInit(TorchFunctionMode):
    """In-place init ops on meta tensors become no-ops. They compute nothing there anyway, but several are
    Python decompositions whose first call imports torch._dynamo: seconds per process for an empty model."""

    OPS = frozenset(("normal_", "uniform_", "log_", "exp_", "fill_", "zero_", "mul_", "add_", "sub_", "div_",
                     "neg_", "clamp_", "copy_", "erfinv_"))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
        if getattr(func, "__name__", "") in self.OPS and isinstance(target, torch.Tensor) and target.is_meta:
            return target
        return func(*args, **kwargs)


@contextlib.contextmanager
def skip_meta_init() -> Iterator[None]:
    """Within the block, modules built on the meta device (and adapters attached there) skip their init ops."""
    with torch.device("meta"), _SkipMetaInit():
        yield


def meta_model(cfg: K3Config, expert_format: str = "bf16", kda_backend: str = "auto") -> K3ForCausalLM:
    """A `K3ForCausalLM` on the meta device (shapes and dtypes only, no memory), built without init."""
    with skip_meta_init():
        return K3ForCausalLM(cfg, kda_backend=kda_backend, expert_format=expert_format)


def expected_tensors(cfg: K3Config, expert_format: str) -> dict[str, TensorSpec]:
    """Checkpoint name -> stored spec of every text tensor of `cfg` with experts in `expert_format`, in state-dict
    order (a new dict; the specs of one config are computed once per process: the real K3's 497,052 take seconds).

    Computed from a model on the meta device (no memory; routed experts listed from their stacked storage, no
    per-expert views). `A_log` has its padded stored shape; a tied LM head is stored once (as the embedding).
    """
    return dict(_expected_tensors(cfg, expert_format))


@functools.lru_cache(maxsize=4)
def _expected_tensors(cfg: K3Config, expert_format: str) -> dict[str, TensorSpec]:
    specs = {}
    for key, shape, dtype in state_dict_shapes(meta_model(cfg, expert_format)):
        if key == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if key.endswith("A_log"):
            shape = (padded_a_log_len(shape[0]),)
        specs[CHECKPOINT_PREFIX + key] = TensorSpec(shape, stored_dtype(key, dtype))
    return specs


def state_dict_shapes(model: nn.Module) -> Iterator[tuple[str, tuple[int, ...], torch.dtype]]:
    """(key, shape, dtype) of every `model.state_dict()` entry, in its order, without making the entries: routed
    experts give one entry per held expert (global ids) from their stacked storage."""
    for path, module in model.named_modules():
        prefix = f"{path}." if path else ""
        if isinstance(module, RoutedExperts):
            for suffix, stacked in module.stored_tensors().items():
                for e in range(module.expert_offset, module.expert_offset + module.num_experts):
                    yield f"{prefix}{e}.{suffix}", tuple(stacked.shape[1:]), stacked.dtype
            continue
        for name, t in module._parameters.items():
            if t is not None:
                yield prefix + name, tuple(t.shape), t.dtype
        for name, t in module._buffers.items():
            if t is not None and name not in module._non_persistent_buffers_set:
                yield prefix + name, tuple(t.shape), t.dtype


# ---- reading ----------------------------------------------------------------------------------------------
@dataclass
class WeightsInfo:
    """What a checkpoint directory holds, validated against its config (headers only, no tensor data).

    `tensors`: text tensor name -> (file, stored spec); `other_tensors`: skipped (vision) name -> file, for
    the files that are present; `expert_format`: "bf16" or "mxfp4" as stored.
    """

    path: Path
    raw_config: dict[str, Any]
    config: K3Config
    expert_format: str
    tensors: dict[str, tuple[Path, TensorSpec]]
    other_tensors: dict[str, Path] = field(default_factory=dict)


@dataclass
class WeightIndex:
    """A checkpoint directory validated by its tensor names (config.json, and the index or the single file's
    header): which file holds each text tensor, every expected name present and nothing else, every file present,
    the stored expert format. No shard file is opened; `headers(names)` opens only the files holding `names`."""

    path: Path
    raw_config: dict[str, Any]
    config: K3Config
    expert_format: str
    locations: dict[str, Path]
    """Text tensor name -> the file that holds it."""
    expected: dict[str, TensorSpec]
    """Text tensor name -> the stored spec the config implies."""
    skipped: dict[str, Path] = field(default_factory=dict)
    """Vision / projector tensor name -> file (not part of the text model)."""

    @property
    def total_bytes(self) -> int:
        """Payload bytes of every stored text tensor."""
        return sum(spec_bytes(self.expected[n]) for n in self.locations)

    def headers(self, names) -> dict[str, tuple[Path, TensorSpec]]:
        """Name -> (file, stored spec) of `names`, read from the headers of the files that hold them and validated
        against the config (shape, dtype; A_log's zero padding). All problems in one WeightsError."""
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.locations[name], []).append(name)
        headers = _read_headers(by_file)
        _check_specs(self.config, self.expected, headers)
        _check_a_log_padding(self.config, headers)
        return headers


def spec_bytes(spec: TensorSpec) -> int:
    """Payload bytes of a stored tensor."""
    return math.prod(spec.shape) * STORED_BYTES[spec.dtype]


STORED_BYTES = {"U8": 1, "BF16": 2, "F32": 4}
TORCH_DTYPES = {"U8": torch.uint8, "BF16": torch.bfloat16, "F32": torch.float32}
"""The torch dtype of each stored dtype (safetensors name)."""


def open_weights(path: str | Path) -> WeightIndex:
    """Read config.json and the index (or the single file's header) of a checkpoint directory and validate what
    the names alone tell: every text tensor the config implies is listed and nothing else, every listed file
    exists, one expert format (and its quantization_config). Raises WeightsError naming tensor and file."""
    path = Path(path)
    if not path.is_dir():
        raise WeightsError(f"{path}: not a directory; pass a checkpoint directory (config.json + "
                              f"{SINGLE_FILE} or {INDEX_FILE} and shards)")
    raw = _read_json(path / CONFIG_FILE, "the model config")
    cfg = K3Config.from_dict(raw, source=str(path / CONFIG_FILE))
    locations = tensor_locations(path)
    text = {n: f for n, f in locations.items() if n.startswith(CHECKPOINT_PREFIX)}
    skipped = {n: f for n, f in locations.items() if n.startswith(SKIPPED_PREFIXES)}
    for name, file in locations.items():
        if name not in text and name not in skipped:
            raise WeightsError(f"unexpected tensor '{name}' in {file}: neither a text tensor "
                                  f"('{CHECKPOINT_PREFIX}…') nor a skipped vision tensor "
                                  f"({', '.join(SKIPPED_PREFIXES)}…); remove it or fix its name")
    _check_files_exist(path, text)
    fmt = _stored_expert_format(text)
    if fmt == "mxfp4":
        _check_quantization_config(raw, path / CONFIG_FILE, next(n for n in text if n.endswith("_packed")))
    expected = expected_tensors(cfg, fmt)
    _check_names(cfg, fmt, expected, text)
    present = {n: f for n, f in skipped.items() if f.is_file()}
    if len(present) < len(skipped):
        log.info("%s: %d vision/projector tensors are in files not present here (text-only copy); skipped",
                 path, len(skipped) - len(present))
    return WeightIndex(path, raw, cfg, fmt, {n: text[n] for n in expected if n in text}, expected, present)


def inspect_weights(path: str | Path) -> WeightsInfo:
    """Read config, index and every safetensors header of a checkpoint directory and validate every text tensor's
    name, shape and dtype (and the zero padding of `A_log`). Raises WeightsError naming tensor and file."""
    index = open_weights(path)
    return WeightsInfo(index.path, index.raw_config, index.config, index.expert_format,
                          index.headers(list(index.locations)), index.skipped)


def _read_json(file: Path, what: str) -> dict[str, Any]:
    try:
        raw = json.loads(file.read_text())
    except FileNotFoundError:
        raise WeightsError(f"{file}: missing ({what}); a checkpoint directory must contain it") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise WeightsError(f"{file}: not valid JSON ({e}); re-download or re-write it") from None
    if not isinstance(raw, dict):
        raise WeightsError(f"{file}: expected a JSON object, got {type(raw).__name__}; re-write it")
    return raw


def tensor_locations(path: Path) -> dict[str, Path]:
    """Tensor name -> file, from the index's weight_map, or from the single model.safetensors' header."""
    index_file = path / INDEX_FILE
    if index_file.is_file():
        weight_map = _read_json(index_file, "the shard index").get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise WeightsError(f"{index_file}: 'weight_map' must map tensor names to shard file names; "
                                  "re-download or re-write the index")
        files = {file: path / file for file in set(weight_map.values())}  # one Path per file (K3: 497k names)
        for file in files:
            if Path(file).name != file:
                name = next(n for n, f in weight_map.items() if f == file)
                raise WeightsError(f"{index_file}: tensor '{name}' maps to '{file}', which is not a file "
                                      "name in the checkpoint directory; fix the index")
        return {name: files[file] for name, file in weight_map.items()}
    single = path / SINGLE_FILE
    if not single.is_file():
        raise WeightsError(f"{path}: no weights: expected {SINGLE_FILE} or {INDEX_FILE} (with its "
                              "shards); pass a complete checkpoint directory")
    with open_safetensors(single, []) as f:
        return dict.fromkeys(f.keys(), single)


def _check_files_exist(path: Path, text: dict[str, Path]) -> None:
    first: dict[Path, str] = {}
    for name, file in text.items():
        first.setdefault(file, name)
    missing = {file: name for file, name in first.items() if not file.is_file()}  # one stat per file
    if missing:
        file, name = next(iter(missing.items()))
        raise WeightsError(f"{path / INDEX_FILE} maps tensor '{name}' to {file.name}, which does not "
                              f"exist ({len(missing)} shard file(s) missing in {path}); download the missing "
                              "shards or re-write the checkpoint")


@contextlib.contextmanager
def open_safetensors(file: Path, names: list[str]) -> Iterator[Any]:
    """safe_open(file), turning a truncated/corrupt file into a WeightsError that names its tensors."""
    try:
        handle = safe_open(str(file), framework="pt")
    except (SafetensorError, OSError) as e:
        held = f" (holds {_listed(names)})" if names else ""
        raise WeightsError(f"{file}{held}: cannot read the safetensors file, truncated or corrupt ({e}); "
                              "re-download or re-write it") from None
    with handle as f:
        yield f


def _read_headers(by_file: dict[Path, list[str]]) -> dict[str, tuple[Path, TensorSpec]]:
    """Name -> (file, stored spec) from the headers; every name the index maps to a file must be in it."""
    headers = {}
    for file, names in sorted(by_file.items()):
        with open_safetensors(file, names) as f:
            present = set(f.keys())
            for name in names:
                if name not in present:
                    raise WeightsError(f"{file.parent / INDEX_FILE} maps tensor '{name}' to {file.name}, "
                                          "but that file has no such tensor; re-download the shard or fix "
                                          "the index")
                piece = f.get_slice(name)
                headers[name] = (file, TensorSpec(tuple(piece.get_shape()), piece.get_dtype()))
    return headers


def _stored_expert_format(text: dict[str, Path]) -> str:
    """bf16 or mxfp4 from the expert tensor names; a mix, or packed without scale (or back), is an error."""
    kinds: dict[str, dict[str, str]] = {"weight": {}, "weight_packed": {}, "weight_scale": {}}
    for name in text:
        m = EXPERT_NAME.match(name)
        if m:
            kinds[m["kind"]][m["base"]] = name
    plain, packed, scale = kinds["weight"], kinds["weight_packed"], kinds["weight_scale"]
    if plain and (packed or scale):
        a, b = next(iter(plain.values())), next(iter((packed or scale).values()))
        raise WeightsError(f"mixed routed-expert formats: '{a}' ({text[a]}) is bf16 but '{b}' "
                              f"({text[b]}) is MXFP4; a checkpoint must store all experts one way: "
                              "re-export it (python -m miles_k3.quantize turns a bf16 checkpoint into MXFP4)")
    for have, other, want in ((packed, scale, "weight_scale"), (scale, packed, "weight_packed")):
        lonely = sorted(set(have) - set(other))
        if lonely:
            name = have[lonely[0]]
            raise WeightsError(f"'{name}' ({text[name]}) has no matching '{lonely[0]}.{want}' "
                                  f"({len(lonely)} such expert projections); an MXFP4 weight needs both "
                                  "weight_packed and weight_scale: re-download or re-export the checkpoint")
    return "mxfp4" if packed else "bf16"


def _check_quantization_config(raw: dict[str, Any], source: Path, example: str) -> None:
    """MXFP4 tensors need a compressed-tensors quantization_config: 4-bit float, group 32 (flat or nested)."""
    text = raw["text_config"] if isinstance(raw.get("text_config"), dict) else raw
    qc = text.get("quantization_config", raw.get("quantization_config"))
    how = ("use the published block (miles_k3.model.weight_files.mxfp4_quantization_config(); "
           "python -m miles_k3.quantize writes it)")
    if not isinstance(qc, dict):
        raise WeightsError(f"{source}: MXFP4 tensors are present (e.g. '{example}') but there is no "
                              f"quantization_config (top level or under text_config); {how}")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise WeightsError(f"{source}: quantization_config.config_groups is missing or empty; {how}")
    want = {"num_bits": 4, "type": "float", "group_size": GROUP_SIZE}
    for gname, group in groups.items():
        weights = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(weights, dict):
            raise WeightsError(f"{source}: quantization_config.config_groups.{gname}.weights is missing; "
                                  f"{how}")
        for key, value in want.items():
            if weights.get(key) != value:
                raise WeightsError(f"{source}: quantization_config.config_groups.{gname}.weights.{key} is "
                                      f"{weights.get(key)!r}, but the MXFP4 tensors (e.g. '{example}') need "
                                      f"{value!r} (MXFP4: num_bits 4, type float, group_size 32); {how}")


def _problems_error(problems: list[str]) -> WeightsError:
    more = f"\n  ... and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
    return WeightsError(f"{len(problems)} problem(s) in the checkpoint tensors; check that config.json matches "
                           "the weights, or re-export the checkpoint:\n  " + "\n  ".join(problems[:_MAX_LISTED]) + more)


def _check_names(cfg: K3Config, fmt: str, expected: dict[str, TensorSpec], text: dict[str, Path]) -> None:
    """Every expected tensor listed, nothing else (a tied LM head may be stored or not); all problems at once."""
    tied_head = CHECKPOINT_PREFIX + "lm_head.weight" if cfg.tie_word_embeddings else None
    problems = [f"missing tensor '{name}' (no file in the checkpoint holds it; expected {spec.dtype} "
                f"{list(spec.shape)})" for name, spec in expected.items() if name not in text]
    problems += [f"unexpected tensor '{name}' in {file}: not a tensor of the K3 text model that config.json "
                 f"describes (num_hidden_layers={cfg.num_hidden_layers}, num_experts={cfg.num_experts}, experts "
                 f"stored as {fmt})" for name, file in text.items() if name not in expected and name != tied_head]
    if problems:
        raise _problems_error(problems)


def _check_specs(cfg: K3Config, expected: dict[str, TensorSpec], headers: dict[str, tuple[Path, TensorSpec]]
                 ) -> None:
    """Every header's shape and dtype is the one the config implies (A_log: per head, or padded as published)."""
    num_heads = cfg.linear_attn_config.num_heads
    problems = []
    for name, (file, got) in headers.items():
        spec = expected[name]
        shapes = [(num_heads,), spec.shape] if name.endswith("A_log") else [spec.shape]
        if got.shape not in shapes:
            problems.append(f"tensor '{name}' in {file} has shape {list(got.shape)}, expected "
                            f"{' or '.join(str(list(s)) for s in shapes)} for this config.json")
        if got.dtype != spec.dtype:
            problems.append(f"tensor '{name}' in {file} is stored as {got.dtype}, expected {spec.dtype} (K3 "
                            "stores bf16; fp32 for A_log, dt_bias, conv1d, o_norm, e_score_correction_bias; "
                            "uint8 for MXFP4 experts)")
    if problems:
        raise _problems_error(problems)


def _check_a_log_padding(cfg: K3Config, tensors: dict[str, tuple[Path, TensorSpec]]) -> None:
    """A padded A_log is accepted only when the entries beyond num_heads are zero."""
    n = cfg.linear_attn_config.num_heads
    for name, (file, spec) in tensors.items():
        if not name.endswith("A_log") or spec.shape == (n,):
            continue
        with open_safetensors(file, [name]) as f:
            tail = f.get_slice(name)[n:]
        if bool((tail != 0).any()):
            raise WeightsError(f"tensor '{name}' in {file}: entries {n}..{spec.shape[0] - 1} (padding "
                                  f"beyond linear_attn_config.num_heads={n}) must be zero, found max |x| = "
                                  f"{tail.abs().max().item():.4g}; num_heads does not match this A_log, so "
                                  "check config.json against the weights")


def _listed(names: list[str]) -> str:
    shown = ", ".join(f"'{n}'" for n in names[:3])
    return shown + (f" and {len(names) - 3} more tensors" if len(names) > 3 else "")
