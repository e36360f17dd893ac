"""Where a rank's reads lie in the checkpoint files, and what they cost in file pages.

A read of a stored tensor (whole, or this rank's slice of it) is an `Extent` of its file: `count` pieces of `length`
bytes, `stride` bytes apart. safetensors stores row-major, so a slice along dim 0 (a column-parallel linear's output
rows, the vocabulary rows, a routed expert) is one piece, and a slice along a later dim (a row-parallel linear's
input columns: `o_proj`, `down_proj`) is one piece per row.

The kernel reads files a page (PAGE_BYTES) at a time, so what a read costs is the pages its pieces touch
("physical" bytes), not its own bytes ("logical": what the rank holds). A rank's column slice of K3's `o_proj`
[7168, 12288] bf16 at tp=8 is 3 KiB of every 24 KiB row: its pieces touch 1 or 2 pages per row (~1.5-2x, and
3.7x for the shared experts' `down_proj`, 1.5 KiB of a 12 KiB row), and reading the whole rows, as safetensors'
memory-mapped slices and the kernel's readahead do, pages in all 8 ranks' columns (8x).

How the loader reads each extent (`Extent.ranges`, `exchange_rows`):
* contiguous: one range;
* strided, pieces less than GAP_BYTES apart: one range over the span (the gaps are read too, and dropped);
* strided, farther apart: one range per piece (page-granular, no readahead: files are opened POSIX_FADV_RANDOM);
* exchanged: a row-parallel tensor's column slice in a run with a TP process group: TP rank t reads rows
  [t R/tp, (t+1) R/tp), all columns, one contiguous range of exactly its logical bytes, and an all-to-all within the
  TP group hands every rank its columns of each row block (`weights._exchange`). This is what takes the published
  K3 to ~1.0x (a 2-D tensor whose rows divide by tp; every row-parallel weight of K3).

`page_bytes` is the union of the pages of a file's ranges, counted once however many reads touch a page;
`weights.plan_ranges` lists a rank's ranges from its read plan and the stored tensors' file offsets, without
reading payload (a hollow checkpoint will do), and the loader reads exactly those ranges.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

PAGE_BYTES = 4096
"""The page the kernel reads a file by (x86-64 and aarch64 Linux with 4 KiB pages)."""
GAP_BYTES = 4096
"""Pieces of a strided read closer than this are read as one range, their gaps with them (a gap under a page
costs no more pages than the pieces themselves touch)."""
SPAN_BYTES = 16 * 2**20
"""Such a range holds whole pieces and at most this many bytes (more pieces: more ranges)."""


@dataclass(frozen=True)
class Extent:
    """Bytes of one read in its file: `count` pieces of `length` bytes, piece i at `offset + i * stride`."""

    offset: int
    length: int
    stride: int
    count: int

    @property
    def nbytes(self) -> int:
        """The read's own (logical) bytes."""
        return self.length * self.count

    @property
    def span(self) -> int:
        """Bytes from the first piece's start to the last one's end."""
        return 0 if self.count == 0 else (self.count - 1) * self.stride + self.length

    @property
    def contiguous(self) -> bool:
        return self.count <= 1 or self.stride == self.length

    def whole_span(self, gap: int = GAP_BYTES) -> bool:
        """Whether the loader reads the span as one range (contiguous, or pieces less than `gap` apart)."""
        return self.contiguous or self.stride - self.length < gap

    def groups(self, gap: int = GAP_BYTES) -> tuple[np.ndarray, np.ndarray]:
        """The pieces read together: (first, stop) piece indices of each range the loader reads, in order: all
        pieces at once when contiguous; runs of whole pieces of at most SPAN_BYTES when the gaps are read too; one
        piece at a time otherwise."""
        if self.count == 0 or self.length == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        if self.contiguous:
            return np.array([0], np.int64), np.array([self.count], np.int64)
        step = max(1, SPAN_BYTES // self.stride) if self.whole_span(gap) else 1
        first = np.arange(0, self.count, step, dtype=np.int64)
        return first, np.minimum(first + step, self.count)

    def ranges(self, gap: int = GAP_BYTES) -> tuple[np.ndarray, np.ndarray]:
        """(starts, ends) of the file ranges the loader reads for this extent (int64 arrays), one per group."""
        first, stop = self.groups(gap)
        return self.offset + first * self.stride, self.offset + (stop - 1) * self.stride + self.length


def bounds(shape: tuple[int, ...], index: tuple[slice, ...]) -> list[tuple[int, int]]:
    """[start, stop) per dim of `index` (slices of step 1, trailing dims whole) into a tensor of `shape`."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    out = []
    for s, n in zip(index, shape, strict=True):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"a read takes contiguous slices (step 1), got {s}")
        out.append((start, max(start, stop)))
    return out


def extent(begin: int, shape: tuple[int, ...], itemsize: int, index: tuple[slice, ...]) -> Extent:
    """The `Extent` of `index` (rows along dim 0 and at most one narrowed later dim) of a row-major tensor of
    `shape` whose payload starts at file offset `begin`."""
    if not shape:
        return Extent(begin, itemsize, itemsize, 1)
    b = bounds(shape, index)
    narrowed = [d for d in range(1, len(shape)) if b[d] != (0, shape[d])]
    if len(narrowed) > 1:
        raise ValueError(f"a read narrows at most one dim after the first, got {index} of {list(shape)}")
    (r0, r1) = b[0]
    row = math.prod(shape[1:]) * itemsize
    if not narrowed:
        return Extent(begin + r0 * row, (r1 - r0) * row, (r1 - r0) * row, 1)
    d = narrowed[0]
    c0, c1 = b[d]
    inner = math.prod(shape[d + 1:]) * itemsize
    return Extent(begin + r0 * row + c0 * inner, (c1 - c0) * inner, shape[d] * inner,
                  (r1 - r0) * math.prod(shape[1:d]))


def region_shape(shape: tuple[int, ...], index: tuple[slice, ...]) -> tuple[int, ...]:
    """The shape `index` selects of a tensor of `shape`."""
    return tuple(stop - start for start, stop in bounds(shape, index))


def exchanged(shape: tuple[int, ...], part, tp: int) -> bool:
    """Whether a read of `part` (a `parallelize.Slice`, or None) of a stored tensor of `shape` is exchanged within the
    TP group (module docstring): tp's column slice (dim 1) of a 2-D tensor with several rows that divide by tp."""
    return (tp > 1 and part is not None and part.dim == 1 and len(shape) == 2 and shape[0] > 1
            and shape[0] % tp == 0 and part.full == shape[1] and part.length * tp == part.full)


def exchange_rows(rows: int, tp: int, tp_rank: int) -> tuple[int, int]:
    """The rows [start, stop) TP rank `tp_rank` reads of an exchanged tensor of `rows` rows."""
    block = rows // tp
    return tp_rank * block, (tp_rank + 1) * block


def coalesce(starts: np.ndarray, ends: np.ndarray, gap: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Ranges of one file merged where they overlap or lie less than `gap` bytes apart (any order in; sorted out)."""
    if len(starts) == 0:
        return starts, ends
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], ends[order]
    reach = np.maximum.accumulate(ends)
    cut = np.nonzero(starts[1:] - reach[:-1] >= max(gap, 1))[0]  # a new range starts past the reach (+gap)
    return np.concatenate([starts[:1], starts[cut + 1]]), np.concatenate([reach[cut], reach[-1:]])


def page_bytes(starts: np.ndarray, ends: np.ndarray) -> int:
    """Bytes of the file pages ranges of one file touch, each page once."""
    if len(starts) == 0:
        return 0
    starts, ends = coalesce(starts, ends)
    first, last = starts // PAGE_BYTES, (ends - 1) // PAGE_BYTES
    shared = np.maximum(0, last[:-1] - first[1:] + 1)  # a page the previous range ends in (0 or 1)
    return int((last - first + 1).sum() - shared.sum()) * PAGE_BYTES


def page_set(starts: np.ndarray, ends: np.ndarray) -> set[int]:
    """The page indices ranges of one file touch (tests: compared with the pages the kernel holds)."""
    pages: set[int] = set()
    for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
        pages.update(range(s // PAGE_BYTES, (e - 1) // PAGE_BYTES + 1))
    return pages


class FileRanges:
    """Byte ranges read per file, accumulated (arrays from a plan, or one range at a time from a reader);
    `cost()` sums them as pages and contiguous ranges."""

    def __init__(self):
        self._arrays: dict = {}  # file -> [(starts, ends)]
        self._single: dict = {}  # file -> ([start], [end])

    def add(self, file, starts: np.ndarray, ends: np.ndarray) -> None:
        self._arrays.setdefault(file, []).append((np.asarray(starts, np.int64), np.asarray(ends, np.int64)))

    def add_range(self, file, start: int, end: int) -> None:
        one = self._single.setdefault(file, ([], []))
        one[0].append(start)
        one[1].append(end)

    def per_file(self) -> dict:
        """file -> (starts, ends), every range added (unsorted, unmerged)."""
        out = {}
        for f in self._arrays.keys() | self._single.keys():
            parts = self._arrays.get(f, [])
            if f in self._single:
                parts = [*parts, tuple(np.array(x, np.int64) for x in self._single[f])]
            out[f] = (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
        return out

    def cost(self, gap: int = GAP_BYTES) -> tuple[int, int]:
        """(bytes of the pages touched, contiguous ranges once those less than `gap` apart are merged)."""
        pages = ranges = 0
        for starts, ends in self.per_file().values():
            pages += page_bytes(starts, ends)
            ranges += len(coalesce(starts, ends, gap)[0])
        return pages, ranges
