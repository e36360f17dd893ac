"""Where a model's weights come from (`WeightSource`), read as stored tensors by checkpoint name, a slice at a time:
a checkpoint directory (`WeightFileReader`: the byte ranges of a rank's slices, read with `os.preadv` from only
the files it needs, and counted as file pages: `file_reads.py`) or the random init a seed defines (`RandomInit`:
what `python -m miles_k3.init_checkpoint` writes for that seed, drawn only where a read asks). `weights.py` plans
and executes the reads.
"""
from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path
from typing import Protocol

import torch

from miles_k3.kernels.mxfp4 import quantize_mxfp4
from miles_k3.model.config import K3Config
from miles_k3.model.file_reads import GAP_BYTES, Extent, FileRanges, extent, region_shape
from miles_k3.model.hollow import PayloadRange, file_payload_ranges
from miles_k3.model.k3 import fill_init_, init_rule
from miles_k3.model.weight_files import (
    STORED_BYTES,
    TORCH_DTYPES,
    TensorSpec,
    WeightIndex,
    WeightsError,
    expected_tensors,
    spec_bytes,
)

INIT_BLOCK_ELEMS = 1 << 22
"""Random init draws a stored tensor in blocks of rows of at most this many elements (one row when a row is
larger), each block from its own seeded generator."""
INIT_STD = 0.02
WILLNEED_BYTES = 2**20
"""Ranges at least this long are announced to the kernel (POSIX_FADV_WILLNEED) before they are read: with
readahead off (POSIX_FADV_RANDOM) it then reads the whole range asynchronously instead of a few pages at a time."""


class WeightSource(Protocol):
    """Stored tensors by checkpoint name: a checkpoint directory or a seeded random init."""

    config: K3Config
    expert_format: str
    total_bytes: int

    def spec(self, name: str) -> TensorSpec: ...
    def file(self, name: str) -> Path | None: ...
    def offset(self, name: str) -> int:
        """Where the stored tensor's bytes start in its file (0 without a file): reads are sorted by it."""
    def check(self, names: list[str]) -> None: ...
    def read(self, name: str, index: tuple[slice, ...], device: torch.device | None = None) -> torch.Tensor:
        """Stored tensor `name` at `index` (slices of step 1 along dim 0 and at most one later dim), in its stored
        dtype, on the CPU or on `device` (a hint: where the values go)."""
    def pages(self) -> tuple[int, int]:
        """(bytes of the file pages read so far, contiguous ranges they form); (0, 0) without files."""
    def close(self) -> None: ...


# ---- checkpoint directories ------------------------------------------------------------------------------------
def open_file(file: Path) -> int:
    """A read-only descriptor of `file` with the kernel's readahead off (POSIX_FADV_RANDOM): a read then pages in
    exactly the pages of its range, so the pages a rank's reads touch are the pages it reads."""
    fd = os.open(file, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    return fd


class WeightFileReader:
    """A weights directory (`weight_files.open_weights`) as a WeightSource: specs from its index and the headers of
    the files a rank reads (`check` opens only those; it also takes each tensor's byte offsets from them), a slice
    read as its byte ranges (`file_reads.Extent`: one range for rows, per row or over the span for columns) with
    `os.preadv` straight into a host buffer, one file open at a time (reads arrive sorted by file and offset). Every
    range read is recorded (`pages()`: the file pages they touch, each once)."""

    def __init__(self, index: WeightIndex, gap_bytes: int = GAP_BYTES):
        self.index, self.config, self.expert_format = index, index.config, index.expert_format
        self.total_bytes = index.total_bytes
        self.gap_bytes = gap_bytes
        self._headers: dict[str, tuple[Path, TensorSpec]] = {}
        self._payload: dict[str, PayloadRange] = {}
        self._open: tuple[Path, int] | None = None  # (file, descriptor)
        self.ranges = FileRanges()
        """Every byte range read, per file."""

    def spec(self, name: str) -> TensorSpec:
        return self._headers[name][1] if name in self._headers else self.index.expected[name]

    def file(self, name: str) -> Path | None:
        return self.index.locations.get(name)

    def offset(self, name: str) -> int:
        return self.payload(name).begin

    def check(self, names: list[str]) -> None:
        """Every name listed by the index, and its header's spec the config's (only the files holding `names`
        are opened)."""
        missing = [n for n in names if n not in self.index.locations]
        if missing:
            raise WeightsError(f"{self.index.path}: no file in the checkpoint holds tensor '{missing[0]}' "
                                  f"({len(missing)} missing); re-download or re-write the checkpoint")
        self._headers = self.index.headers(names)
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.index.locations[name], []).append(name)
        self._payload = {}
        for file, held in sorted(by_file.items()):
            self._payload.update(file_payload_ranges(file, held))

    def payload(self, name: str) -> PayloadRange:
        """Where `name`'s bytes lie (from its file's header; read on first use when `check` did not)."""
        if name not in self._payload:
            self._payload.update(file_payload_ranges(self.index.locations[name], [name]))
        return self._payload[name]

    def read(self, name: str, index: tuple[slice, ...], device: torch.device | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """As `WeightSource.read`; `out` (optional): a contiguous uint8 host tensor of the read's bytes to read into
        (the result is a view of it)."""
        p = self.payload(name)
        shape = region_shape(p.shape, index)
        raw = self.read_extent(name, extent(p.begin, p.shape, STORED_BYTES[p.dtype], index), out)
        return raw.view(TORCH_DTYPES[p.dtype]).view(shape)

    def read_extent(self, name: str, ext: Extent, out: torch.Tensor | None = None) -> torch.Tensor:
        """The bytes of `ext` (of tensor `name`, for messages), its pieces back to back: a uint8 host tensor (`out`
        when given). Reads exactly the ranges `ext.ranges(self.gap_bytes)` lists."""
        if out is None:
            out = torch.empty(ext.nbytes, dtype=torch.uint8)
        assert out.dtype == torch.uint8 and out.numel() == ext.nbytes and out.is_contiguous(), (name, ext)
        if ext.nbytes == 0:
            return out
        fd = self._descriptor(name)
        if ext.contiguous:
            self._pread(fd, name, out, ext.offset)
            return out
        pieces = out.view(ext.count, ext.length)
        for i0, i1 in zip(*(g.tolist() for g in ext.groups(self.gap_bytes)), strict=True):
            if i1 - i0 == 1:
                self._pread(fd, name, pieces[i0], ext.offset + i0 * ext.stride)
                continue
            span = torch.empty((i1 - i0 - 1) * ext.stride + ext.length, dtype=torch.uint8)  # the gaps read too
            self._pread(fd, name, span, ext.offset + i0 * ext.stride)
            pieces[i0:i1] = span.as_strided((i1 - i0, ext.length), (ext.stride, 1))
        return out

    def _descriptor(self, name: str) -> int:
        file = self.index.locations[name]
        if self._open is None or self._open[0] != file:
            self.close()
            try:
                self._open = (file, open_file(file))
            except OSError as e:
                raise WeightsError(f"tensor '{name}' in {file}: cannot open the file ({e}); re-download or "
                                      "re-write it") from None
        return self._open[1]

    def _pread(self, fd: int, name: str, buf: torch.Tensor, offset: int) -> None:
        """Fill the contiguous uint8 tensor `buf` from `offset` of the open file (short reads continued)."""
        file, n = self._open[0], buf.numel()
        view = memoryview(buf.numpy())
        if n >= WILLNEED_BYTES and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, offset, n, os.POSIX_FADV_WILLNEED)
        done = 0
        try:
            while done < n:
                got = os.preadv(fd, [view[done:]], offset + done)
                if got == 0:
                    raise WeightsError(f"tensor '{name}' in {file}: the file ends at byte {offset + done}, inside "
                                          f"the tensor's bytes (truncated); re-download or re-write it")
                done += got
        except OSError as e:
            raise WeightsError(f"tensor '{name}' in {file}: cannot be read ({e}); re-download or re-write the "
                                  "file") from None
        self.ranges.add_range(file, offset, offset + n)

    def pages(self) -> tuple[int, int]:
        return self.ranges.cost(self.gap_bytes)

    def close(self) -> None:
        if self._open is not None:
            os.close(self._open[1])
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

    def offset(self, name: str) -> int:
        return 0

    def pages(self) -> tuple[int, int]:
        return 0, 0

    def read(self, name: str, index: tuple[slice, ...], device: torch.device | None = None) -> torch.Tensor:
        spec = self.specs[name]
        device = torch.device("cpu") if device is None else torch.device(device)
        r0, r1, _ = index[0].indices(spec.shape[0])
        if name.endswith(("weight_packed", "weight_scale")):
            base, _, kind = name.rpartition(".")
            packed, scale = self._mxfp4_rows(base, spec, r0, r1, device)
            t = packed if kind == "weight_packed" else scale
            return t[(slice(None), *index[1:])]
        return self.rows(name, spec.shape, r0, r1, device, tuple(index[1:]), TORCH_DTYPES[spec.dtype])

    def _mxfp4_rows(self, base: str, spec: TensorSpec, r0: int, r1: int, device: torch.device
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows r0..r1 of an MXFP4 expert projection: its bf16 draw (`base + ".weight"`) quantized."""
        if self._quantized is None or self._quantized[:3] != (base, (r0, r1), device):
            in_features = self.specs[f"{base}.weight_packed"].shape[1] * 2
            w = self.rows(f"{base}.weight", (spec.shape[0], in_features), r0, r1, device, dtype=torch.bfloat16)
            self._quantized = (base, (r0, r1), device, *quantize_mxfp4(w, "floor"))
        return self._quantized[3], self._quantized[4]

    def rows(self, name: str, shape: tuple[int, ...], r0: int, r1: int, device: torch.device | None = None,
             cols: tuple[slice, ...] = (), dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows r0..r1 of tensor `name` of `shape`, only their part `cols` (slices of dims 1.., default whole), in
        `dtype` (each value drawn in fp32 and rounded once), on `device`. Drawn block by block: each block's fp32
        draw (at most INIT_BLOCK_ELEMS, or one row) is cut to `cols` and copied into the result at once, so a
        rank's column slice of a row-parallel weight costs its slice plus one block, whatever the whole rows'
        size (the values are the one-process model's: blocks are whole rows, as before). A_log's padding rows
        (beyond num_heads, the published [128] for 96 heads) are zero."""
        device = torch.device("cpu") if device is None else device
        per_block = max(1, INIT_BLOCK_ELEMS // math.prod(shape[1:]))
        rule = init_rule(name, len(shape))
        heads = self.config.linear_attn_config.num_heads if rule == "a_log" else shape[0]
        part = (slice(None), *cols)
        out = torch.empty((max(0, r1 - r0), *region_shape(shape[1:], tuple(cols))), dtype=dtype, device=device)
        for b in range(r0 // per_block, -(-r1 // per_block)):
            lo, hi = b * per_block, min(shape[0], (b + 1) * per_block)
            new = torch.empty if hi <= heads else torch.zeros  # rows past `heads` (A_log's padding) stay zero
            block = new((hi - lo, *shape[1:]), device=device)
            if lo < heads:
                fill_init_(block[: heads - lo], rule, self.std, seeded_generator(self.seed, name, b, device))
            a, z = max(r0, lo), min(r1, hi)
            out[a - r0: z - r0] = block[a - lo: z - lo][part]
            del block
        return out


def seeded_generator(seed: int, name: str, block: int, device: torch.device | None = None) -> torch.Generator:
    """A generator on `device` (default CPU) for block `block` of tensor `name` under `seed` (the same on every
    rank and machine of that device type)."""
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return torch.Generator(device=device or "cpu").manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
