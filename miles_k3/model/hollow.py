"""Hollow checkpoints: the published Kimi K3 directory with real safetensors headers and index, no payload.

`write_hollow_checkpoint(cfg, out)` writes `config.json` (`config_json(cfg, "mxfp4")`),
`model.safetensors.index.json` (`metadata.total_size` = payload bytes of every tensor written, `weight_map`)
and the shards of the published layout (`published_layout`). Each shard is an 8-byte little-endian header
length, the JSON header, and then the payload as a *hole*: the file is `truncate`d to its full length, so the
1.56 TB K3 takes ~136 MB of disk (76 MB of headers, a 60 MB index; on a filesystem with sparse files) and
reads back as zeros. Loaders and read planners can then work out, from the headers alone, which bytes each
rank of a mesh would read (`payload_ranges`, which works on any safetensors checkpoint directory).

The headers are byte-identical to what `safetensors` writes for the same tensors without metadata, which is
what the published shards hold: with that serializer's order (below) and no `__metadata__` entry, every
published shard size (8 + header + payload, e.g. 00002 = 16,990,911,504 B with an 818,696-byte header) and
the total of 1,560,936,091,448 B are reproduced exactly; a `{"format": "pt"}` entry would add 32 bytes to
every header. So the byte ranges computed here are the real checkpoint's.

Published layout (`num_hidden_layers` = L): file i holds layer i-1 (i = 1..L), file L+1 the five model-level
text tensors (embed_tokens, lm_head, model.norm, output_attn_res_norm, output_attn_res_proj), then, with
vision, file L+2 the 3 `mm_projector.*` and file L+3 the 165 `vision_tower.*` tensors. Names are
`model-{i:05d}-of-{n:06d}.safetensors` (5-digit index, 6-digit total; K3: 96 files).

Order within a file (= header order = data order): safetensors' own, by dtype descending in its enum order
(F32 before BF16 before U8) and then by name as a plain string. In an MXFP4 shard the U8 tensors are exactly
the routed experts, so they come last, each expert's six tensors (w1, w2, w3 x weight_packed, weight_scale)
form one contiguous run, and experts follow back to back in string order of their id (0, 1, 10, 100, ..., 2,
...).

Vision tensors exist only for the real K3 widths: the projector maps to hidden_size 7168. `vision=None`
(default) writes them iff `cfg.hidden_size` is 7168; `vision=True` on another config is an error. Only
MXFP4 experts are written (the published format).
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from miles_k3.model.config import K3Config
from miles_k3.model.k3 import CHECKPOINT_PREFIX
from miles_k3.model.weight_files import (
    CONFIG_FILE,
    INDEX_FILE,
    TensorSpec,
    WeightsError,
    config_json,
    expected_tensors,
    layer_of,
    spec_bytes,
    tensor_locations,
)
from miles_k3.utils.atomic import atomic_directory

EXPERT_FORMAT = "mxfp4"
HEADER_LEN_BYTES = 8  # little-endian u64 before the JSON header
HEADER_ALIGN = 8  # safetensors pads the JSON header with spaces to a multiple of this
MAX_HEADER_BYTES = 100_000_000  # safetensors refuses larger headers

# safetensors dtypes in its `Dtype` enum order (the sort order of its serializer, descending).
_DTYPES = ("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "I16", "U16", "F16", "BF16", "I32", "U32",
           "F32", "C64", "F64", "I64", "U64")
_DTYPE_RANK = {d: i for i, d in enumerate(_DTYPES)}

# ---- the published vision tower and projector (moonshotai/Kimi-K3, all BF16, no biases) ----------------
VISION_PREFIXES = ("mm_projector.", "vision_tower.")
PROJECTOR_OUT_DIM = 7168  # mm_projector.proj.2 maps into the text hidden size of the real K3
VISION_BLOCKS = 27
_VISION_BLOCK_SHAPES = {"wqkv.weight": (4608, 1024), "wo.weight": (1024, 1536),
                        "mlp.fc0.weight": (4096, 1024), "mlp.fc1.weight": (1024, 4096),
                        "norm0.weight": (1024,), "norm1.weight": (1024,)}
_PROJECTOR_SHAPES = {"mm_projector.proj.0.weight": (4096, 4096), "mm_projector.proj.2.weight": (7168, 4096),
                     "mm_projector.post_norm.weight": (7168,)}



class PayloadRange(NamedTuple):
    """Where one tensor's bytes lie: absolute offsets [begin, end) in `file` (8 + header length +
    data_offsets), its safetensors dtype name and shape."""

    file: Path
    begin: int
    end: int
    dtype: str
    shape: tuple[int, ...]


def projector_tensors() -> dict[str, TensorSpec]:
    """The 3 published `mm_projector.*` tensors (BF16, 92,289,024 payload bytes)."""
    return {name: TensorSpec(shape, "BF16") for name, shape in _PROJECTOR_SHAPES.items()}


def vision_tower_tensors() -> dict[str, TensorSpec]:
    """The 165 published `vision_tower.*` tensors (BF16, 802,428,928 payload bytes)."""
    shapes = {"vision_tower.patch_embed.proj.weight": (1024, 3, 14, 14),
              "vision_tower.patch_embed.pos_emb.weight": (64, 64, 1024)}
    for k in range(VISION_BLOCKS):
        shapes.update({f"vision_tower.encoder.blocks.{k}.{suffix}": shape
                       for suffix, shape in _VISION_BLOCK_SHAPES.items()})
    shapes["vision_tower.encoder.final_layernorm.weight"] = (1024,)
    return {name: TensorSpec(shape, "BF16") for name, shape in shapes.items()}


def resolve_vision(cfg: K3Config, vision: bool | None) -> bool:
    """Whether to write the vision tower and projector: `None` means iff `cfg` has the real K3 width (7168,
    the projector's output). Raises ValueError for `vision=True` on a config the projector cannot feed."""
    fits = cfg.hidden_size == PROJECTOR_OUT_DIM
    if vision and not fits:
        raise ValueError(f"vision=True: the published mm_projector outputs {PROJECTOR_OUT_DIM} features, but "
                         f"this config has hidden_size={cfg.hidden_size}; pass vision=False (or None) for "
                         "configs other than the full K3")
    return fits if vision is None else vision


def checkpoint_tensors(cfg: K3Config, *, vision: bool | None = None,
                       text: Mapping[str, TensorSpec] | None = None) -> dict[str, TensorSpec]:
    """Every tensor of the hollow checkpoint of `cfg`: the text tensors (`text`, default
    `expected_tensors(cfg, "mxfp4")`, which builds a meta model: seconds for the full K3), then the
    projector and vision tower when `resolve_vision(cfg, vision)`."""
    out = dict(expected_tensors(cfg, EXPERT_FORMAT) if text is None else text)
    if resolve_vision(cfg, vision):
        out.update(projector_tensors())
        out.update(vision_tower_tensors())
    return out


def shard_name(index: int, count: int) -> str:
    """The published shard file name: 1-based `index` in 5 digits, `count` in 6 (`model-00001-of-000096`)."""
    return f"model-{index:05d}-of-{count:06d}.safetensors"


def storage_order(specs: Mapping[str, TensorSpec]) -> list[str]:
    """Names in the order safetensors stores them in one file: dtype descending (F32, BF16, U8), then name."""
    return sorted(specs, key=lambda name: (-_DTYPE_RANK[specs[name].dtype], name))


def published_layout(cfg: K3Config, tensors: Mapping[str, TensorSpec] | None = None, *,
                     vision: bool | None = None) -> dict[str, list[str]]:
    """File name -> tensor names in storage order, for every file of the published layout (module docstring),
    in file order. `tensors` defaults to `checkpoint_tensors(cfg, vision=vision)`; `num_hidden_layers + 3`
    files with vision, `+ 1` without. Raises ValueError for a name that has no place in the layout."""
    with_vision = resolve_vision(cfg, vision)
    if tensors is None:
        tensors = checkpoint_tensors(cfg, vision=with_vision)
    layers = cfg.num_hidden_layers
    count = layers + (3 if with_vision else 1)
    groups: list[dict[str, TensorSpec]] = [{} for _ in range(count)]
    for name, spec in tensors.items():
        groups[_file_index(name, layers, with_vision) - 1][name] = spec
    return {shard_name(i + 1, count): storage_order(group) for i, group in enumerate(groups)}


def _file_index(name: str, layers: int, vision: bool) -> int:
    """1-based published file of a tensor (layer l -> l + 1, model-level -> layers + 1, projector, tower)."""
    layer = layer_of(name)
    if layer is not None:
        if layer >= layers:
            raise ValueError(f"tensor '{name}': layer {layer} >= num_hidden_layers={layers}")
        return layer + 1
    if name.startswith(CHECKPOINT_PREFIX):
        return layers + 1
    if vision and name.startswith(VISION_PREFIXES):
        return layers + (2 if name.startswith("mm_projector.") else 3)
    raise ValueError(f"tensor '{name}' has no file in the published layout (text tensors start with "
                     f"'{CHECKPOINT_PREFIX}'; vision ones with {' or '.join(VISION_PREFIXES)} and need "
                     "vision)")


def published_payload_ranges(cfg: K3Config, tensors: Mapping[str, TensorSpec] | None = None, *,
                             vision: bool | None = None) -> dict[str, PayloadRange]:
    """Tensor name -> `PayloadRange` of every tensor of the published layout of `cfg` (`published_layout`),
    computed from the headers it would have, no file written (`file` is the bare shard name): the offsets of
    `write_hollow_checkpoint`'s files, byte for byte."""
    if tensors is None:
        tensors = checkpoint_tensors(cfg, vision=vision)
    out: dict[str, PayloadRange] = {}
    with gc_paused():
        for file, names in published_layout(cfg, tensors, vision=vision).items():
            specs = {name: tensors[name] for name in names}
            header, _ = safetensors_header(specs)
            start = HEADER_LEN_BYTES + len(header)
            offset = 0
            for name, spec in specs.items():
                end = offset + spec_bytes(spec)
                out[name] = PayloadRange(Path(file), start + offset, start + end, spec.dtype, spec.shape)
                offset = end
    return out


def safetensors_header(specs: Mapping[str, TensorSpec], metadata: Mapping[str, str] | None = None
                       ) -> tuple[bytes, int]:
    """(header, payload bytes) of a safetensors file holding `specs` in their iteration order, back to back:
    the compact JSON (`__metadata__` first when given, as safetensors writes it), space-padded to a multiple
    of 8. The header excludes the 8-byte length prefix. With `specs` in `storage_order` and no metadata the
    bytes equal `safetensors.torch.save`'s."""
    entries: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata is not None else {}
    offset = 0
    for name, spec in specs.items():
        end = offset + spec_bytes(spec)
        entries[name] = {"dtype": spec.dtype, "shape": list(spec.shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode()
    return raw + b" " * (-len(raw) % HEADER_ALIGN), offset


def write_hollow_file(file: str | Path, specs: Mapping[str, TensorSpec]) -> int:
    """Write a safetensors file of `specs` (in their iteration order) whose payload is a hole; returns the
    payload bytes. The file has its full length and reads back as zeros."""
    header, payload = safetensors_header(specs)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        f.truncate(HEADER_LEN_BYTES + len(header) + payload)
    return payload


def write_hollow_checkpoint(cfg: K3Config, out: str | Path, *, vision: bool | None = None,
                            overwrite: bool = False) -> Path:
    """Write the hollow MXFP4 checkpoint of `cfg` to the directory `out` (atomically: a temporary sibling
    renamed into place; an existing `out` is an error unless `overwrite`). Returns `out`.

    `vision`: see `resolve_vision` (None: the tower and projector iff the config is K3-wide). The full K3
    takes ~10 s (about half in `expected_tensors`), ~0.7 GB of memory and ~136 MB of disk; 497,220 tensors.
    """
    with_vision = resolve_vision(cfg, vision)
    try:
        with gc_paused(), atomic_directory(out, overwrite) as staging:
            tensors = checkpoint_tensors(cfg, vision=with_vision)
            layout = published_layout(cfg, tensors, vision=with_vision)
            _write_json(staging / CONFIG_FILE, config_json(cfg, EXPERT_FORMAT))
            total, weight_map = 0, {}
            for file, names in layout.items():
                total += write_hollow_file(staging / file, {name: tensors[name] for name in names})
                weight_map.update(dict.fromkeys(names, file))
            _write_json(staging / INDEX_FILE, {"metadata": {"total_size": total},
                                               "weight_map": dict(sorted(weight_map.items()))})
    except FileExistsError as e:
        raise WeightsError(str(e)) from None
    return Path(out)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector: building ~500k small acyclic objects (specs, header entries)
    otherwise triggers collections that scan them all, over and over (2-3x the run time for the full K3)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _write_json(file: Path, obj: dict[str, Any]) -> None:
    file.write_text(json.dumps(obj, indent=2) + "\n")


# ---- reading byte ranges back --------------------------------------------------------------------------
def read_header(file: str | Path) -> tuple[int, dict[str, Any]]:
    """(JSON header length, parsed header) of a safetensors file, without reading any payload.
    Raises WeightsError when the file is too short or the header is not a JSON object."""
    file = Path(file)
    with open(file, "rb") as f:
        prefix = f.read(HEADER_LEN_BYTES)
        if len(prefix) < HEADER_LEN_BYTES:
            raise WeightsError(f"{file}: {len(prefix)} bytes, shorter than the 8-byte safetensors header "
                                  "length; re-download or re-write it")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES:
            raise WeightsError(f"{file}: header length {length} is implausible (> {MAX_HEADER_BYTES}); "
                                  "not a safetensors file, or corrupt")
        raw = f.read(length)
    try:
        header = json.loads(raw) if len(raw) == length else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        header = None
    if not isinstance(header, dict):
        raise WeightsError(f"{file}: the {length}-byte safetensors header is truncated or not a JSON "
                              "object; re-download or re-write it")
    return length, header


def payload_ranges(path: str | Path, *, missing_ok: bool = False) -> dict[str, PayloadRange]:
    """Tensor name -> `PayloadRange` for every tensor of a safetensors checkpoint directory (the
    `model.safetensors.index.json` weight_map, or the single `model.safetensors`), from headers only, ordered
    by file then offset. Raises WeightsError when a mapped tensor is not in its file's header or lies
    beyond the file's end; a file the index names but that is absent is an error unless `missing_ok` (then
    its tensors are left out, as in a text-only copy)."""
    path = Path(path)
    with gc_paused():
        weight_map = {name: file.name for name, file in tensor_locations(path).items()}
        return _payload_ranges(path, weight_map, missing_ok)


def _payload_ranges(path: Path, weight_map: dict[str, str], missing_ok: bool) -> dict[str, PayloadRange]:
    """`payload_ranges` of the tensors in `weight_map`, one header read per file."""
    by_file: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        by_file.setdefault(file, []).append(name)
    out: dict[str, PayloadRange] = {}
    for file, names in sorted(by_file.items()):
        if not (path / file).is_file() and missing_ok:
            continue
        out.update(sorted(file_payload_ranges(path / file, names).items(), key=lambda item: item[1].begin))
    return out


def file_payload_ranges(file: Path, names: list[str]) -> dict[str, PayloadRange]:
    """The ranges of `names` in one safetensors file (its header only), checked against its header and size."""
    if not file.is_file():
        raise WeightsError(f"{file}: missing, but the index maps {len(names)} tensor(s) to it (e.g. "
                              f"'{names[0]}'); download it, or pass missing_ok=True for a partial copy")
    length, header = read_header(file)
    start, size = HEADER_LEN_BYTES + length, os.path.getsize(file)
    ranges = {}
    for name in names:
        entry = header.get(name)
        if not isinstance(entry, dict):
            raise WeightsError(f"{file}: the index maps '{name}' here, but its header has no such tensor; "
                                  "fix the index or re-download the file")
        begin, end = entry["data_offsets"]
        if start + end > size:
            raise WeightsError(f"{file}: tensor '{name}' ends at byte {start + end}, beyond the file's "
                                  f"{size} bytes (truncated); re-download it")
        ranges[name] = PayloadRange(file, start + begin, start + end, entry["dtype"], tuple(entry["shape"]))
    return ranges
