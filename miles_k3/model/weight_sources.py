"""Where a model's weights come from (`WeightSource`), read as stored tensors by checkpoint name, a slice at a time:
a checkpoint directory (`WeightFileReader`: safetensors' `get_slice`, only the files a rank reads) or the random
init a seed defines (`RandomInit`: what `python -m miles_k3.init_checkpoint` writes for that seed, drawn only
where a read asks). `weights.py` plans and executes the reads.
"""
from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Protocol

import torch
from safetensors import SafetensorError

from miles_k3.kernels.mxfp4 import quantize_mxfp4
from miles_k3.model.config import K3Config
from miles_k3.model.k3 import fill_init_, init_rule
from miles_k3.model.weight_files import (
    TORCH_DTYPES,
    TensorSpec,
    WeightIndex,
    WeightsError,
    expected_tensors,
    open_safetensors,
    spec_bytes,
)

INIT_BLOCK_ELEMS = 1 << 22
"""Random init draws a stored tensor in blocks of rows of at most this many elements (one row when a row is
larger), each block from its own seeded generator."""
INIT_STD = 0.02


class WeightSource(Protocol):
    """Stored tensors by checkpoint name: a checkpoint directory or a seeded random init."""

    config: K3Config
    expert_format: str
    total_bytes: int

    def spec(self, name: str) -> TensorSpec: ...
    def file(self, name: str) -> Path | None: ...
    def check(self, names: list[str]) -> None: ...
    def read(self, name: str, index: tuple[slice, ...], device: torch.device | None = None) -> torch.Tensor:
        """Stored tensor `name` at `index` (safetensors slice indexing), in its stored dtype, on the CPU or on
        `device` (a hint: where the values go)."""
    def close(self) -> None: ...


# ---- checkpoint directories --------------------------------------------------------------------------------------------------
class WeightFileReader:
    """A weights directory (`weight_files.open_weights`) as a WeightSource: specs from its index and the headers of the files a rank reads
    (`check` opens only those), slices through safetensors' `get_slice`, one file open at a time (reads arrive
    sorted by file)."""

    def __init__(self, index: WeightIndex):
        self.index, self.config, self.expert_format = index, index.config, index.expert_format
        self.total_bytes = index.total_bytes
        self._headers: dict[str, tuple[Path, TensorSpec]] = {}
        self._open: tuple[Path, object, object] | None = None  # (file, context manager, handle)

    def spec(self, name: str) -> TensorSpec:
        return self._headers[name][1] if name in self._headers else self.index.expected[name]

    def file(self, name: str) -> Path | None:
        return self.index.locations.get(name)

    def check(self, names: list[str]) -> None:
        """Every name listed by the index, and its header's spec the config's (only the files holding `names`
        are opened)."""
        missing = [n for n in names if n not in self.index.locations]
        if missing:
            raise WeightsError(f"{self.index.path}: no file in the checkpoint holds tensor '{missing[0]}' "
                                  f"({len(missing)} missing); re-download or re-write the checkpoint")
        self._headers = self.index.headers(names)

    def read(self, name: str, index: tuple[slice, ...], device: torch.device | None = None) -> torch.Tensor:
        file = self.index.locations[name]
        if self._open is None or self._open[0] != file:
            self.close()
            cm = open_safetensors(file, [name])
            self._open = (file, cm, cm.__enter__())
        try:
            return self._open[2].get_slice(name)[index]
        except (SafetensorError, OSError) as e:
            raise WeightsError(f"tensor '{name}' in {file}: cannot be read ({e}); re-download or re-write the "
                                  "file") from None

    def close(self) -> None:
        if self._open is not None:
            self._open[1].__exit__(None, None, None)
            self._open = None


class RandomInit:
    """The random init of (config, expert format, seed) as a WeightSource: the stored tensors
    `python -m miles_k3.init_checkpoint` writes for the seed, drawn on demand, only the rows a read asks for
    (block b of tensor `name`: a generator seeded by (seed, name, b); MXFP4 experts: their bf16 draw quantized by
    the floor rule). Values are in the stored dtype. They are drawn on the device they go to (CUDA's generator
    differs from the CPU's): every mesh of one device type gets the same weights, and on the CPU they are
    init_checkpoint's."""

    def __init__(self, config: K3Config, expert_format: str, seed: int = 0, std: float = INIT_STD):
        self.config, self.expert_format, self.seed, self.std = config, expert_format, seed, std
        self._specs: dict[str, TensorSpec] | None = None
        self._quantized: tuple | None = None  # (base name, rows, device, packed, scale) of the last MXFP4 draw

    @property
    def specs(self) -> dict[str, TensorSpec]:
        """Stored name -> spec of every tensor (computed on first use: a meta model's state dict)."""
        if self._specs is None:
            self._specs = expected_tensors(self.config, self.expert_format)
        return self._specs

    @property
    def total_bytes(self) -> int:
        return sum(map(spec_bytes, self.specs.values()))

    def spec(self, name: str) -> TensorSpec:
        return self.specs[name]

    def file(self, name: str) -> Path | None:
        return None

    def check(self, names: list[str]) -> None:
        unknown = [n for n in names if n not in self.specs]
        assert not unknown, unknown[:3]  # the plan comes from the same config: an internal invariant

    def close(self) -> None:
        self._quantized = None

    def read(self, name: str, index: tuple[slice, ...], device: torch.device | None = None) -> torch.Tensor:
        spec = self.specs[name]
        device = torch.device("cpu") if device is None else torch.device(device)
        r0, r1, _ = index[0].indices(spec.shape[0])
        if name.endswith(("weight_packed", "weight_scale")):
            base, _, kind = name.rpartition(".")
            packed, scale = self._mxfp4_rows(base, spec, r0, r1, device)
            t = packed if kind == "weight_packed" else scale
        else:
            t = self.rows(name, spec.shape, r0, r1, device).to(TORCH_DTYPES[spec.dtype])
        return t[(slice(None), *index[1:])]

    def _mxfp4_rows(self, base: str, spec: TensorSpec, r0: int, r1: int, device: torch.device
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows r0..r1 of an MXFP4 expert projection: its bf16 draw (`base + ".weight"`) quantized."""
        if self._quantized is None or self._quantized[:3] != (base, (r0, r1), device):
            in_features = self.specs[f"{base}.weight_packed"].shape[1] * 2
            w = self.rows(f"{base}.weight", (spec.shape[0], in_features), r0, r1, device).to(torch.bfloat16)
            self._quantized = (base, (r0, r1), device, *quantize_mxfp4(w, "floor"))
        return self._quantized[3], self._quantized[4]

    def rows(self, name: str, shape: tuple[int, ...], r0: int, r1: int, device: torch.device | None = None
             ) -> torch.Tensor:
        """Rows r0..r1 of tensor `name` of `shape` (fp32, on `device`), drawn block by block. A_log's padding rows
        (beyond num_heads, the published [128] for 96 heads) are zero."""
        device = torch.device("cpu") if device is None else device
        per_block = max(1, INIT_BLOCK_ELEMS // math.prod(shape[1:]))
        rule = init_rule(name, len(shape))
        heads = self.config.linear_attn_config.num_heads if rule == "a_log" else shape[0]
        parts = []
        for b in range(r0 // per_block, -(-r1 // per_block)):
            lo, hi = b * per_block, min(shape[0], (b + 1) * per_block)
            new = torch.empty if hi <= heads else torch.zeros  # rows past `heads` (A_log's padding) stay zero
            block = new((hi - lo, *shape[1:]), device=device)
            if lo < heads:
                fill_init_(block[: heads - lo], rule, self.std, seeded_generator(self.seed, name, b, device))
            parts.append(block[max(r0, lo) - lo: min(r1, hi) - lo])
        if len(parts) == 1:
            return parts[0]
        return torch.cat(parts) if parts else torch.zeros((0, *shape[1:]), device=device)


def seeded_generator(seed: int, name: str, block: int, device: torch.device | None = None) -> torch.Generator:
    """A generator on `device` (default CPU) for block `block` of tensor `name` under `seed` (the same on every
    rank and machine of that device type)."""
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return torch.Generator(device=device or "cpu").manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
