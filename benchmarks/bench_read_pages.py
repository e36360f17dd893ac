"""The file pages one rank of the real K3 reads at load, measured by the kernel, beside its own (logical) bytes.

    python benchmarks/bench_read_pages.py [--hollow DIR] [--dp 8] [--tp 8] [--ep 64] [--rank 19] [--out FILE]

On the hollow K3 (`python -m miles_k3.init_checkpoint model=k3 out=DIR format=mxfp4 hollow=true`; written to a
temporary directory when --hollow is not given, ~20 s: the published 96-file layout, real headers, the payload a
hole, which the kernel reads as zero pages into its page cache like any other), rank R of dp x tp x ep executes its
load as a run does: the K3 planned on the meta device (`weights.build_k3`), its reads checked and executed by the
loader (`weights.load_weights`) with the real file reader, row-parallel columns exchanged in its TP group (the
group's all-to-all stubbed: what the other ranks send changes nothing this rank reads). Files are read one at a time
(the reads are sorted by file); before a file's first read its cached pages are evicted (fsync, then
POSIX_FADV_DONTNEED: no root needed); `mincore` lists the pages resident right after each read and after the
file's last read: those are the physical bytes the rank read from it (a page the kernel reclaims mid-load under
memory pressure still counts; one read outside every planned range would show), compared page by page with the
plan: `planned_pages_never_resident` (reclaimed before they were looked at) and `resident_pages_not_planned`.
Beside them: the logical bytes (`LoadStats.bytes_read`, model_info's `load_bytes`), the planned pages
(`LoadStats.page_bytes`, model_info's `load_page_bytes`), the bytes the read syscalls returned (/proc/self/io
`rchar`), and for comparison the planned pages of the same reads without a TP group (columns read per row) and read
as whole rows (the span of every column slice: safetensors' memory-mapped slices with readahead, the loader before
this one). Reading the rank's 47 GB of holes took 40 s on 2 cores (the kernel zeroes each page).

The tests run `measure_rank` on a few files of the hollow K3 (tests/model/test_read_plan.py) and use `resident_pages` /
`drop_cache` on a real k3_tiny checkpoint (tests/model/test_read_pages.py).
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import mmap
import os
import tempfile
import time
from pathlib import Path

import numpy as np

PAGE = 4096

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def resident_pages(file: Path, start: int = 0, end: int | None = None) -> set[int]:
    """The pages (4 KiB indices) of `file` that hold bytes [start, end) (default: all) and are in the page cache:
    mincore on a fresh mapping of them, which itself faults nothing in."""
    size = Path(file).stat().st_size
    end = size if end is None else min(end, size)
    first = start // PAGE
    length = end - first * PAGE
    if length <= 0:
        return set()
    fd = os.open(file, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, first * PAGE)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        vec = (ctypes.c_ubyte * (-(-length // PAGE)))()
        try:
            assert _libc.mincore(ctypes.c_void_p(addr), length, vec) == 0, os.strerror(ctypes.get_errno())
        finally:
            _libc.munmap(ctypes.c_void_p(addr), length)
    finally:
        os.close(fd)
    return set((first + np.nonzero(np.frombuffer(vec, np.uint8) & 1)[0]).tolist())


def drop_cache(files) -> None:
    """Evict the (clean, unmapped) pages of `files` from the page cache."""
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def rchar() -> int:
    """Bytes this process's read syscalls have returned (/proc/self/io)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no rchar")


def _kernel_counted_reader():
    from miles_k3.model.weight_sources import WeightFileReader

    class KernelCountedReader(WeightFileReader):
        """The loader's file reader; each file's cache evicted before its first read. `resident`: file -> the
        pages found in the cache right after each read (the pages it brought in; `mincore` of its range at once,
        so a page the kernel reclaims later in the load, under another process's memory pressure, still counts)
        and, after the file's last read, of the whole file (pages read outside any range would show there)."""

        def __init__(self, index):
            super().__init__(index)
            self.resident: dict[Path, set[int]] = {}

        def _descriptor(self, name):
            file = self.index.locations[name]
            if self._open is None or self._open[0] != file:
                self.close()
                assert file not in self.resident, f"{file} opened twice: the reads are not sorted by file"
                drop_cache([file])
                self.resident[file] = set()
            return super()._descriptor(name)

        def _pread(self, fd, name, buf, offset):
            super()._pread(fd, name, buf, offset)
            self.resident[self._open[0]] |= resident_pages(self._open[0], offset, offset + buf.numel())

        def close(self):
            if self._open is not None:
                file = self._open[0]
                super().close()
                self.resident[file] |= resident_pages(file)
                drop_cache([file])

    return KernelCountedReader


def measure_rank(hollow: Path, dp: int, tp: int, ep: int, rank: int, files: set[str] | None = None) -> dict:
    """Load rank `rank` of dp x tp x ep from `hollow` (only the reads in `files`, bare file names, when given) as
    the module docstring says; returns the figures, with `reads`, `payload` and `resident` (file name -> pages) for
    the tests."""
    import torch

    from miles_k3.model import weights
    from miles_k3.model.lora import LoRAConfig
    from miles_k3.model.weight_files import open_weights
    from miles_k3.parallel.mesh import ParallelContext

    reader = _kernel_counted_reader()(open_weights(hollow))
    ctx = dataclasses.replace(ParallelContext.layout(dp, tp, ep, rank), tp_group="stubbed")
    model = weights.build_k3(reader, "mxfp4", torch.device("meta"), torch.bfloat16, ctx, LoRAConfig(rank=16))
    reads = weights.check_reads(model, model.shard_plan, reader)
    if files is not None:
        reads = [r for r in reads if reader.file(r.names[0]).name in files]
    exchange, weights._all_to_all = weights._all_to_all, lambda out, inp, group: None
    try:
        start, chars = time.perf_counter(), rchar()
        stats = weights.load_weights(model, reads, reader, ctx)
        seconds, chars = time.perf_counter() - start, rchar() - chars
    finally:
        weights._all_to_all = exchange
    physical = sum(map(len, reader.resident.values())) * PAGE
    unseen, unplanned = _compare(weights.plan_ranges(reads, reader._payload, tp, ctx.tp_rank), reader.resident)
    per_row = weights.plan_ranges(reads, reader._payload, tp, ctx.tp_rank, exchange=False).cost()[0]
    rows = weights.plan_ranges(reads, reader._payload, tp, ctx.tp_rank, exchange=False, gap=2**40).cost()[0]
    return {"mesh": {"dp": dp, "tp": tp, "ep": ep, "rank": rank}, "files": len(reader.resident),
            "logical_bytes": stats.bytes_read, "kernel_page_bytes": physical,
            "kernel_ratio": physical / stats.bytes_read, "planned_page_bytes": stats.page_bytes,
            "ranges": stats.ranges, "exchanged_bytes": stats.exchanged_bytes, "rchar_bytes": chars,
            "planned_pages_never_resident": unseen, "resident_pages_not_planned": unplanned,
            "planned_per_row_page_bytes": per_row, "planned_per_row_ratio": per_row / stats.bytes_read,
            "planned_whole_rows_page_bytes": rows, "planned_whole_rows_ratio": rows / stats.bytes_read,
            "seconds": round(seconds, 1), "line": stats.line(rank),
            "reads": reads, "payload": reader._payload,
            "resident": {f.name: pages for f, pages in reader.resident.items()}}


def _compare(planned, resident: dict[Path, set[int]]) -> tuple[int, int]:
    """(planned pages never seen resident, resident pages not planned), over every file: `planned` a
    `file_reads.FileRanges`, `resident` file -> page indices."""
    from miles_k3.model.file_reads import coalesce

    unseen = unplanned = 0
    ranges = planned.per_file()
    for file in ranges.keys() | resident.keys():
        starts, ends = coalesce(*ranges[file]) if file in ranges else (np.zeros(0, np.int64),) * 2
        pages = [np.arange(s // PAGE, (e - 1) // PAGE + 1) for s, e in zip(starts.tolist(), ends.tolist())]
        listed = np.unique(np.concatenate(pages)) if pages else np.zeros(0, np.int64)
        seen = np.fromiter(resident.get(file, ()), np.int64)
        unseen += len(np.setdiff1d(listed, seen))
        unplanned += len(np.setdiff1d(seen, listed))
    return unseen, unplanned


def main() -> None:
    from record import write_result

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hollow", type=Path, default=None, help="a hollow K3 directory (default: write one)")
    for name, default in (("dp", 8), ("tp", 8), ("ep", 64), ("rank", 19)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        hollow = args.hollow
        if hollow is None:
            from miles_k3.model.config import K3Config
            from miles_k3.model.hollow import write_hollow_checkpoint
            hollow = write_hollow_checkpoint(K3Config.from_name("k3"), Path(tmp) / "kimi-k3")
        figures = measure_rank(hollow, args.dp, args.tp, args.ep, args.rank)
    for key in ("reads", "payload", "resident"):
        figures.pop(key)
    print(figures.pop("line"))
    for key, value in figures.items():
        print(f"  {key}: {value:,.4f}" if isinstance(value, float) else f"  {key}: {value}")
    print(write_result("bench_read_pages", figures, args.out))


if __name__ == "__main__":
    main()
