"""Writing K3 model-weights directories (Hugging Face layout) atomically: `WeightWriter` (used by `save_weights`,
`miles_k3.quantize` and `miles_k3.init_checkpoint`) writes shards, the index and config into a temporary
sibling directory, fsyncs it and renames it into place only when complete, so a crash never leaves a
half-written directory under the destination name and an existing checkpoint is replaced only by a complete
one (`miles_k3.utils.atomic`). Layout and validation rules are in `weight_files.py`.

Within a shard (`write_safetensors`) the tensors outside the routed experts come first, in safetensors' own order,
then the routed experts by layer and numeric id, each expert's tensors back to back: an EP rank's experts of a layer
are one contiguous run of the file (one read), where the published files order experts as strings (0, 1, 10, 100,
..., 2, ...) and scatter a rank's ids. Any safetensors reader reads the file (the header gives every offset).
"""
from __future__ import annotations

import copy
import json
import re
import shutil
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from miles_k3.model.hollow import HEADER_ALIGN, HEADER_LEN_BYTES, storage_order
from miles_k3.model.k3 import CHECKPOINT_PREFIX, K3ForCausalLM
from miles_k3.model.weight_files import (
    CONFIG_FILE,
    DEFAULT_MAX_SHARD_BYTES,
    EXPERT_NAME,
    INDEX_FILE,
    SINGLE_FILE,
    TORCH_DTYPES,
    TensorSpec,
    WeightsError,
    config_json,
    expected_tensors,
    layer_of,
    mxfp4_quantization_config,
    nested_config,
)
from miles_k3.utils.atomic import publish_directory, stage_directory

if TYPE_CHECKING:
    from typing_extensions import Self


class WeightWriter:
    """Write a checkpoint directory atomically (a context manager; `commit` on success, `abort` on error).

    Everything goes into a temporary sibling directory `.NAME.tmp-*`; `commit` names the shards
    (`model.safetensors`, or `model-0000i-of-0000n.safetensors` + index), fsyncs every file and the directory,
    and renames it to `path`. An existing `path` is refused unless `overwrite`, and then replaced only after
    the new directory is complete. A crash never leaves a partial directory under `path`.
    `add(group)` keeps a group of tensors in one shard; a shard closes when the next group would exceed
    `max_shard_bytes` (None: only at `flush()`).
    """

    def __init__(self, path: str | Path, overwrite: bool = False, max_shard_bytes: int | None = None):
        self.path = Path(path)
        if max_shard_bytes is not None and max_shard_bytes <= 0:
            raise WeightsError(f"max_shard_bytes: must be > 0 or None, got {max_shard_bytes}")
        try:
            self.staging = stage_directory(self.path, overwrite)
        except FileExistsError as e:
            raise WeightsError(str(e)) from None
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[tuple[Path, list[str]]] = []
        self._names: set[str] = set()
        self._total_bytes = 0

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
            return
        try:
            self.commit()
        except BaseException:
            self.abort()
            raise

    def add(self, group: dict[str, torch.Tensor]) -> None:
        """Queue tensors (stored as given: dtype, shape) that must share one shard."""
        nbytes = sum(t.numel() * t.element_size() for t in group.values())
        if self._pending and self.max_shard_bytes is not None \
                and self._pending_bytes + nbytes > self.max_shard_bytes:
            self.flush()
        for name, t in group.items():
            assert name not in self._names, f"tensor {name} written twice"
            self._names.add(name)
            t = t.detach().to("cpu").contiguous()
            if t.untyped_storage().nbytes() != t.numel() * t.element_size():
                t = t.clone()  # a view into a larger tensor: safetensors stores only whole storages
            self._pending[name] = t
        self._pending_bytes += nbytes

    def flush(self) -> None:
        """Close the current shard (no-op when empty)."""
        if not self._pending:
            return
        file = self.staging / f".shard-{len(self._shards):06d}.safetensors"
        write_safetensors(self._pending, file, metadata={"format": "pt"})
        self._shards.append((file, list(self._pending)))
        self._total_bytes += self._pending_bytes
        self._pending, self._pending_bytes = {}, 0

    def write_json(self, name: str, obj: dict[str, Any]) -> None:
        (self.staging / name).write_text(json.dumps(obj, indent=2) + "\n")

    def copy_in(self, src: Path, name: str) -> None:
        """Copy a file or directory tree `src` to `name` in the checkpoint."""
        if src.is_dir():
            shutil.copytree(src, self.staging / name)
        else:
            shutil.copy2(src, self.staging / name)

    def commit(self) -> Path:
        """Finish the shards and index, fsync, and move the directory into place; returns `path`."""
        self.flush()
        n = len(self._shards)
        weight_map = {}
        for i, (file, names) in enumerate(self._shards):
            final = SINGLE_FILE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            file.rename(self.staging / final)
            weight_map.update((name, final) for name in names)
        if n > 1:
            self.write_json(INDEX_FILE, {"metadata": {"total_size": self._total_bytes},
                                         "weight_map": dict(sorted(weight_map.items()))})
        return publish_directory(self.staging, self.path)

    def abort(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)


SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}
_EXPERT_ID = re.compile(r"\.layers\.(\d+)\..*\.experts\.(\d+)\.")


def layout_order(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """The names of one shard in the order `write_safetensors` stores them: the tensors outside the routed experts
    in safetensors' order (dtype descending: F32, BF16, ...; then by name), then the routed experts by layer and
    numeric expert id, each expert's tensors (by name: w1, w2, w3, packed before scale) back to back."""
    experts, other = [], {}
    for name, t in tensors.items():
        m = _EXPERT_ID.search(name)
        if m:
            experts.append((int(m[1]), int(m[2]), name))
        else:
            other[name] = TensorSpec(tuple(t.shape), SAFETENSORS_DTYPES[t.dtype])
    return storage_order(other) + [name for *_, name in sorted(experts)]


def write_safetensors(tensors: Mapping[str, torch.Tensor], file: str | Path,
                      metadata: Mapping[str, str] | None = None) -> None:
    """A safetensors file of `tensors` (contiguous CPU tensors) in `layout_order`: the 8-byte header length, the
    JSON header (`__metadata__` first, as safetensors writes it; space-padded to a multiple of 8), the payload."""
    names = layout_order(tensors)
    entries: dict = {"__metadata__": dict(metadata)} if metadata is not None else {}
    offset = 0
    for name in names:
        t = tensors[name]
        end = offset + t.numel() * t.element_size()
        entries[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % HEADER_ALIGN)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name in names:
            t = tensors[name]
            if t.numel():
                f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    assert HEADER_LEN_BYTES + len(raw) + offset == Path(file).stat().st_size, file


def to_stored(name: str, t: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """A model tensor as stored: a CPU copy in the stored dtype; `A_log` zero-padded to its stored length."""
    out = t.detach().to("cpu", TORCH_DTYPES[spec.dtype], copy=True)
    if name.endswith("A_log") and tuple(out.shape) != spec.shape:
        out = torch.cat([out, out.new_zeros(spec.shape[0] - out.shape[0])])
    assert tuple(out.shape) == spec.shape, (name, out.shape, spec.shape)
    return out


def write_groups(specs: dict[str, TensorSpec]) -> list[list[str]]:
    """Checkpoint names in write order: layers 0..L-1 then the model-level tensors (as published); each
    routed expert's tensors (all projections, packed with scale) form one group that is never split."""
    groups: dict[str, list[str]] = {}
    last = 1 << 30  # the model-level tensors come after every layer
    for name in sorted(specs, key=lambda n: (last if layer_of(n) is None else layer_of(n), n)):
        m = EXPERT_NAME.match(name)
        key = m["base"].rsplit(".", 1)[0] if m else name  # `…experts.{e}`
        groups.setdefault(key, []).append(name)
    return list(groups.values())


TOKENIZER_FILE_PATTERNS = ("tokenizer*", "generation_config.json", "special_tokens_map.json",
                           "added_tokens.json", "chat_template*", "*.jinja", "*.model", "tokenization_*.py",
                           "vocab.*", "merges.txt")
"""Files of a model directory that belong to its tokenizer (`save_weights(tokenizer_from=...)` copies
them)."""


def save_weights(model: K3ForCausalLM, path: str | Path,
                 max_shard_bytes: int | None = DEFAULT_MAX_SHARD_BYTES, overwrite: bool = False, *,
                 small_tokenizer: bool = False, tokenizer_from: str | Path | None = None) -> Path:
    """Write `model`'s base weights as a checkpoint directory (the inverse of `load_k3`).

    Stored dtypes are the checkpoint's (bf16, fp32 families, uint8 MXFP4 experts) whatever the model's compute
    dtype; LoRA or other non-base tensors are not written. Atomic; see `WeightWriter`.
    The tokenizer can go into the same directory (and so appear with it, atomically): `small_tokenizer` writes
    the project's byte-level tokenizer (`miles_k3.model.tokenizer.save_small_tokenizer`) and its bos/eos/pad ids
    into config.json, as `miles_k3.init_checkpoint` does for random-init checkpoints; `tokenizer_from` copies
    the tokenizer files (TOKENIZER_FILE_PATTERNS) of a model directory. Without either, no tokenizer is
    written.
    """
    if small_tokenizer and tokenizer_from is not None:
        raise ValueError("save_weights: pass small_tokenizer or tokenizer_from, not both")
    fmt = getattr(model, "expert_format", "bf16")
    specs = expected_tensors(model.config, fmt)
    views = {CHECKPOINT_PREFIX + k: v for k, v in model.state_dict().items()}
    with WeightWriter(path, overwrite=overwrite, max_shard_bytes=max_shard_bytes) as writer:
        token_ids = None
        if small_tokenizer:
            from miles_k3.model.tokenizer import BOS, END_OF_MSG, PAD, save_small_tokenizer, special_token_ids

            save_small_tokenizer(writer.staging, model.config.vocab_size)
            ids = special_token_ids()  # like K3's config.json: bos [BOS], eos <|end_of_msg|>, pad [PAD]
            token_ids = {"bos_token_id": ids[BOS], "eos_token_id": ids[END_OF_MSG], "pad_token_id": ids[PAD]}
        elif tokenizer_from is not None:
            _copy_tokenizer_files(writer, Path(tokenizer_from))
        writer.write_json(CONFIG_FILE, config_json(model.config, fmt, token_ids))
        for group in write_groups(specs):
            writer.add({name: to_stored(name, views[name], specs[name]) for name in group})
    return Path(path)


def _copy_tokenizer_files(writer: WeightWriter, src: Path) -> None:
    if not src.is_dir():
        raise WeightsError(f"tokenizer_from={src}: not a directory; pass the model directory that holds "
                              "the tokenizer files")
    names = sorted({f.name for pattern in TOKENIZER_FILE_PATTERNS for f in src.glob(pattern) if f.is_file()})
    for name in names:
        writer.copy_in(src / name, name)


def config_with_quantization(raw: dict[str, Any]) -> dict[str, Any]:
    """The MXFP4 config.json of a raw one: a flat config (an old checkpoint of ours) becomes the published
    nested form (`nested_config`); a nested one keeps its structure. The quantization_config goes into
    `text_config`, as published (a top-level one is dropped: SGLang's KimiK3Config would let it override)."""
    if not isinstance(raw.get("text_config"), dict):
        return nested_config(raw, mxfp4_quantization_config())
    out = copy.deepcopy(raw)
    out.pop("quantization_config", None)
    out["text_config"]["quantization_config"] = mxfp4_quantization_config()
    return out
