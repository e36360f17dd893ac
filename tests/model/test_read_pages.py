"""File pages a rank's load reads (`miles_k3.model.file_reads`, `weights.plan_ranges`), measured by the kernel's own
page accounting: on a real k3_tiny checkpoint written to disk, the page cache of its files is emptied
(fsync'd files, POSIX_FADV_DONTNEED: no root needed), a rank loads, and `mincore` says which pages of each file are
now resident. With readahead off (the reader opens files POSIX_FADV_RANDOM) those are exactly the pages the
rank's reads touched, and the test asserts they are exactly the pages the plan lists:
* one process, a rank of tp=2 x ep=2 planned without process groups: the column slices read per row (or over their
  span where the rows are shorter than a page);
* two gloo ranks at tp=2: the row-parallel columns exchanged within the TP group, each rank reading a contiguous
  half of the rows; the union of both ranks' planned pages is what the cache holds, and each rank's pages are
  ~ its own bytes; the exchanged slices equal the one-process model's.
By hand: extents, ranges and page counts of small tensors; our own checkpoints store each EP rank's experts of a
layer as one contiguous run (the published layout orders experts as strings and scatters them).
"""
from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
from bench_module import load_benchmark
from dist_helpers import run_ranks

from miles_k3.init_checkpoint import init_checkpoint
from miles_k3.model import weights
from miles_k3.model.build import ModelConfig, build_model
from miles_k3.model.config import K3Config
from miles_k3.model.file_reads import (
    PAGE_BYTES,
    SPAN_BYTES,
    Extent,
    coalesce,
    exchanged,
    extent,
    page_bytes,
    page_set,
)
from miles_k3.model.hollow import payload_ranges, published_payload_ranges
from miles_k3.model.parallelize import Slice
from miles_k3.parallel.mesh import ParallelContext


# ---- by hand ----------------------------------------------------------------------------------------------------
def test_extents_ranges_and_pages_by_hand():
    # a [8, 6] bf16 tensor at file offset 100: rows 2..5 are one piece of 4 x 12 bytes
    assert extent(100, (8, 6), 2, (slice(2, 6),)) == Extent(124, 48, 48, 1)
    # columns 2..3 of every row: 8 pieces of 4 bytes, 12 apart, read as one span (gap 8 < GAP_BYTES)
    cols = extent(100, (8, 6), 2, (slice(None), slice(2, 4)))
    assert cols == Extent(104, 4, 12, 8) and cols.nbytes == 32 and cols.span == 88
    starts, ends = cols.ranges()
    assert starts.tolist() == [104] and ends.tolist() == [192]
    # a row-parallel weight of K3 at tp=8: 1536 of 12288 bf16 columns, 24 KiB rows: one range per row
    o = extent(0, (7168, 12288), 2, (slice(0, 2), slice(1536, 3072)))
    assert o == Extent(3072, 3072, 24576, 2) and not o.whole_span()
    starts, ends = o.ranges()
    assert starts.tolist() == [3072, 27648] and ends.tolist() == [6144, 30720]
    assert page_bytes(starts, ends) == 4 * PAGE_BYTES  # pages 0-1 and 6-7: 6 KiB of pieces, 16 KiB of pages
    # a span holds whole pieces and at most SPAN_BYTES
    step = SPAN_BYTES // 16
    long = Extent(0, 10, 16, 3 * step)
    first, stop = long.groups()
    assert first.tolist() == [0, step, 2 * step] and stop.tolist() == [step, 2 * step, 3 * step]
    # pages: a page shared by two ranges counts once; coalescing merges overlapping and touching ranges
    assert page_bytes(np.array([0, 4095]), np.array([1, 4097])) == 2 * PAGE_BYTES
    assert page_bytes(np.array([8192]), np.array([8193])) == PAGE_BYTES
    s, e = coalesce(np.array([50, 0, 10]), np.array([60, 10, 20]))
    assert s.tolist() == [0, 50] and e.tolist() == [20, 60]
    assert coalesce(np.array([50, 0]), np.array([60, 10]), gap=41)[0].tolist() == [0]
    # exchanged: tp's column slice of a 2-D tensor whose rows divide by tp
    assert exchanged((7168, 12288), Slice(1, 1536, 1536, 12288), 8)
    assert not exchanged((7168, 12288), Slice(0, 896, 896, 7168), 8)  # rows: contiguous already
    assert not exchanged((7, 12), Slice(1, 3, 3, 12), 4)  # 7 rows do not divide by 4


def _expert_runs(ranges: dict, layer: int, first: int, count: int) -> int:
    """Contiguous runs the tensors of experts [first, first + count) of `layer` form in their file."""
    prefix = f"language_model.model.layers.{layer}.block_sparse_moe.experts."
    mine = sorted((r.begin, r.end) for n, r in ranges.items()
                  if n.startswith(prefix) and first <= int(n[len(prefix):].split(".")[0]) < first + count)
    assert len(mine) == 6 * count
    return 1 + sum(b[0] != a[1] for a, b in itertools.pairwise(mine))


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    """k3_tiny, MXFP4 experts, one shard per layer (seed 7), as init_checkpoint writes it."""
    return init_checkpoint(K3Config.from_name("k3_tiny"), tmp_path_factory.mktemp("pages") / "tiny", seed=7,
                           expert_format="mxfp4")


def test_our_checkpoints_store_each_ep_rank_s_experts_as_one_run(written):
    """init_checkpoint (and save_weights, quantize: the same writer) orders experts by id; the published layout
    (string order: 0, 1, 10, 11, ..., 15, 2, ...) splits rank 0's experts 0..7 of 16 in two runs at ep=2."""
    cfg = K3Config.from_name("k3_tiny")
    ours = payload_ranges(written)
    published = published_payload_ranges(cfg)
    for ep in (2, 4, 8, 16):
        count = cfg.num_experts // ep
        for rank in range(ep):
            assert _expert_runs(ours, 1, rank * count, count) == 1, (ep, rank)
    assert _expert_runs(published, 1, 0, 8) == 2 and _expert_runs(published, 1, 8, 8) == 2
    assert ours.keys() == published.keys()  # the same tensors, only their order in the file differs


# ---- the kernel's page accounting ------------------------------------------------------------------------------
_pages = load_benchmark("bench_read_pages")  # mincore and eviction, shared with the hollow K3's measurement
resident_pages, drop_cache = _pages.resident_pages, _pages.drop_cache


def _files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


@pytest.fixture(scope="module")
def checkpoint(written) -> Path:
    """`written`, its pages evicted; skips where the page cache cannot be emptied."""
    out = written
    drop_cache(_files(out))
    if any(resident_pages(f) for f in _files(out)):
        pytest.skip(f"the page cache of {out} cannot be emptied (tmpfs?): no page accounting there")
    return out


def _cold_load(monkeypatch, directory: Path, before=None, after=None) -> dict:
    """Patch `weights.load_weights` so that the files' pages are evicted right before the payload is read (the
    headers were read by check_reads), and the reads and stats are kept."""
    seen = {}
    load = weights.load_weights

    def cold(model, reads, source, ctx=weights.SINGLE):
        if before is not None:
            before()
        else:
            drop_cache(_files(directory))
        seen["reads"], seen["source"] = reads, source
        seen["stats"] = load(model, reads, source, ctx)
        if after is not None:
            after()
        return seen["stats"]

    monkeypatch.setattr(weights, "load_weights", cold)
    return seen


def _planned_pages(ranges) -> dict[str, set[int]]:
    return {Path(f).name: page_set(*coalesce(s, e)) for f, (s, e) in ranges.per_file().items()}


def test_one_rank_pages_in_exactly_the_pages_its_plan_lists(checkpoint, monkeypatch):
    seen = _cold_load(monkeypatch, checkpoint)
    ctx = ParallelContext.layout(1, 2, 2, 1)  # no process groups: columns read per row / over their span
    model = build_model(ModelConfig(path=str(checkpoint)), torch.device("cpu"), torch.float32, ctx)
    resident = {f.name: resident_pages(f) for f in _files(checkpoint)}
    payload = payload_ranges(checkpoint)
    plan = weights.plan_ranges(seen["reads"], payload, ctx.tp_size, ctx.tp_rank, exchange=False)
    planned = _planned_pages(plan)
    assert {f: p for f, p in resident.items() if p} == planned
    stats = seen["stats"]
    assert stats.page_bytes == plan.cost()[0] == sum(map(len, planned.values())) * PAGE_BYTES
    assert stats.exchanged_bytes == 0 and stats.bytes_read < stats.page_bytes
    print(f"\n{stats.line(1)}")
    whole = build_model(ModelConfig(path=str(checkpoint)), torch.device("cpu"), torch.float32)
    o = "model.layers.1.self_attn.o_proj.weight"
    assert torch.equal(model.state_dict()[o], whole.state_dict()[o][:, 64:])


def _tp_rank(rank: int, directory: str) -> dict:
    import torch.distributed as dist

    from miles_k3.parallel.config import ParallelConfig
    from miles_k3.parallel.mesh import init_parallel

    files = _files(Path(directory))
    ctx = init_parallel(ParallelConfig(tp=2), "cpu")

    def before():  # both ranks wait while rank 0 empties the cache
        dist.barrier()
        if rank == 0:
            drop_cache(files)
        dist.barrier()

    resident = {}

    def after():  # both ranks have read everything: rank 0 looks at the cache before anything else reads a file
        dist.barrier()
        if rank == 0:
            resident.update({f.name: resident_pages(f) for f in files})
        dist.barrier()

    seen = _cold_load(pytest.MonkeyPatch(), Path(directory), before, after)
    model = build_model(ModelConfig(path=directory), torch.device("cpu"), torch.float32, ctx)
    plan = weights.plan_ranges(seen["reads"], payload_ranges(Path(directory)), 2, ctx.tp_rank)
    keys = ["model.layers.1.self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight",
            "model.layers.2.block_sparse_moe.shared_experts.down_proj.weight"]
    return {"stats": seen["stats"], "planned": _planned_pages(plan), "cost": plan.cost(),
            "resident": resident,
            "tensors": {k: model.state_dict()[k] for k in keys}}


@pytest.mark.slow
def test_two_tp_ranks_exchange_columns_and_page_in_their_row_blocks(checkpoint):
    r0, r1 = run_ranks(2, _tp_rank, str(checkpoint))
    union = {f: r0["planned"].get(f, set()) | r1["planned"].get(f, set()) for f in r0["resident"]}
    assert {f: p for f, p in r0["resident"].items() if p} == {f: p for f, p in union.items() if p}
    whole = build_model(ModelConfig(path=str(checkpoint)), torch.device("cpu"), torch.float32).state_dict()
    for t, r in enumerate((r0, r1)):
        stats = r["stats"]
        assert (stats.page_bytes, stats.ranges) == r["cost"]
        assert stats.exchanged_bytes > 0
        for key, got in r["tensors"].items():
            half = whole[key].shape[1] // 2
            assert torch.equal(got, whole[key][:, t * half:(t + 1) * half]), (t, key)
        print(f"\n{stats.line(t)}")
