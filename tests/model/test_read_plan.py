"""The read plan of the real K3 at scale, without its bytes: a hollow checkpoint (the published 96-file layout,
real headers and index, payload a hole) planned for tp=8 x ep=64 over 64 ranks (dp=8).

* every stored text byte is read by exactly one rank of each replica that shares it: a tensor-parallel tensor's
  slices tile it once within every TP group (8 times in all), each routed expert is read by exactly one rank
  (ep = world), and every other text tensor whole by every rank; A_log's padding (heads 96..127 of its stored
  [128]) by no rank's plan;
* every rank opens the 94 text files and never the projector and vision files;
* the loader itself, executed for one rank against the hollow files (a reader that records the ranges it is asked
  to read and reads nothing; the model on the meta device), asks for exactly that rank's `load_bytes` as model_info
  prints it, and reads the file pages model_info prints, which the test's own page accounting of the reads
  confirms: <= 1.1 x its bytes (row-parallel columns exchanged within the TP group), on every rank;
* the kernel's own page accounting (`mincore` after each file, its cache evicted before: benchmarks/
  bench_read_pages.py) of the loader reading three of that rank's files for real: exactly the pages the test's
  accounting lists, <= 1.1 x the rank's bytes (the whole rank: `python benchmarks/bench_read_pages.py`).
"""
from __future__ import annotations

import dataclasses
import itertools
from collections import Counter, defaultdict
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from bench_module import load_benchmark

from miles_k3.model import weights
from miles_k3.model.build import ModelConfig
from miles_k3.model.config import K3Config
from miles_k3.model.hollow import payload_ranges
from miles_k3.model.lora import LoRAConfig, apply_lora
from miles_k3.model.weight_files import meta_model, open_weights, skip_meta_init
from miles_k3.model.weight_sources import WeightFileReader
from miles_k3.model.weights import build_k3, check_reads, load_weights
from miles_k3.model_info import rank_loads
from miles_k3.parallel.config import ParallelConfig
from miles_k3.parallel.mesh import ParallelContext

pytestmark = pytest.mark.slow
DP, TP, EP = 8, 8, 64


@pytest.fixture(scope="module")
def hollow(hollow_k3):
    return hollow_k3[0]  # conftest.py: written once per session


@pytest.fixture(scope="module")
def loads(hollow):
    cfg = SimpleNamespace(parallel=ParallelConfig(dp=DP, tp=TP, ep=EP), model=ModelConfig(path=str(hollow)),
                          lora=LoRAConfig(rank=16))
    with skip_meta_init():
        whole = meta_model(K3Config.from_name("k3"), "mxfp4")
        apply_lora(whole, cfg.lora)
    return rank_loads(cfg, whole, with_reads=True)


def test_every_stored_text_byte_is_read_once_per_replica_that_shares_it(hollow, loads):
    index = open_weights(hollow)
    whole = Counter()  # stored name -> ranks reading it whole
    pieces = defaultdict(list)  # stored name -> [(rank, slice)]
    for load in loads:
        for read in load["reads"]:
            (name,) = read.names
            if read.slice is None:
                whole[name] += 1
            else:
                pieces[name].append((load["rank"], read.slice))
    assert whole.keys() | pieces.keys() == index.locations.keys() and not whole.keys() & pieces.keys()
    experts = [n for n in whole if ".experts." in n]
    assert len(experts) == 92 * 896 * 6 and all(whole[n] == 1 for n in experts)  # ep = world: one rank each
    assert all(whole[n] == DP * TP for n in whole if ".experts." not in n)  # replicated: every rank
    heads = K3Config.from_name("k3").linear_attn_config.num_heads
    for name, got in pieces.items():
        full = heads if name.endswith("A_log") else index.expected[name].shape[got[0][1].dim]
        _tiles(name, got, full)
    assert sum(n.endswith("A_log") for n in pieces) == 69  # padding (heads 96..127) in no rank's plan
    files = {f.name for f in index.locations.values()}
    assert len(files) == 94 and "model-00095-of-000096.safetensors" not in files
    assert all(load["files"] == 94 for load in loads)


def _tiles(name: str, got: list, full: int) -> None:
    """Within every TP group (dp replica) the slices of `name` cover [0, full) once; over the mesh, 8 times."""
    by_replica = defaultdict(list)
    for rank, s in got:
        by_replica[rank // TP].append((s.start, s.start + s.length))
    assert sorted(by_replica) == list(range(DP)), name
    for spans in by_replica.values():
        spans.sort()
        assert spans[0][0] == 0 and spans[-1][1] == full, name
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans)), name


class _RecordingReader(WeightFileReader):
    """The hollow checkpoint's reader with the payload left unread: every range the loader asks for is recorded, as
    the real reader records what it reads, and the buffer is left as it is (the model is on the meta device)."""

    def _pread(self, fd, name, buf, offset):
        self.ranges.add_range(self._open[0], offset, offset + buf.numel())


def _own_spans(reads, payload, tp_rank: int) -> dict:
    """The test's own page accounting of a run's reads (independent of `file_reads`): a whole tensor, or a slice of
    its rows, is one byte range; a column slice of a 2-D tensor is exchanged, so the rank reads its 1/TP of the
    rows, all columns; pages are 4 KiB. File name -> the [first, last] page spans, merged (each page once)."""
    pages = defaultdict(list)
    for read in reads:
        for name in read.names:
            p, s = payload[name], read.slice
            row = (p.end - p.begin) // p.shape[0]
            if s is None:
                begin, end = p.begin, p.end
            elif s.dim == 0:
                begin, end = p.begin + s.start * row, p.begin + (s.start + s.length) * row
            else:
                assert s.dim == 1 and len(p.shape) == 2, name
                block = p.shape[0] // TP
                begin, end = p.begin + tp_rank * block * row, p.begin + (tp_rank + 1) * block * row
            pages[p.file.name].append((begin // 4096, (end - 1) // 4096))
    merged = {}
    for file, spans in pages.items():
        spans.sort()
        out = [list(spans[0])]
        for first, last in spans[1:]:
            if first <= out[-1][1] + 1:
                out[-1][1] = max(out[-1][1], last)
            else:
                out.append([first, last])
        merged[file] = out
    return merged


def _own_pages(reads, payload, tp_rank: int) -> int:
    """Bytes of the pages `_own_spans` lists."""
    return sum(last - first + 1 for spans in _own_spans(reads, payload, tp_rank).values()
               for first, last in spans) * 4096


def test_one_rank_reads_its_bytes_in_about_as_many_file_pages(hollow, loads, monkeypatch):
    """The loader executed for one rank against the hollow files, in a run's way (a TP group: the group itself
    stubbed, its all-to-all a no-op on meta tensors): the bytes it asks for are model_info's `load_bytes`, the
    ranges it reads model_info's pages and ranges, and the test's own page accounting of them; pages <= 1.1 x
    bytes on every rank. For the docs: the same rank without a TP group (columns read per row) and reading whole
    rows (safetensors' mmap with readahead, before this loader)."""
    rank = 19  # dp 2, tp 3, ep 19
    reader = _RecordingReader(open_weights(hollow))
    ctx = dataclasses.replace(ParallelContext.layout(DP, TP, EP, rank), tp_group="the TP group of rank 19")
    monkeypatch.setattr(weights, "_all_to_all", lambda out, inp, group: None)
    model = build_k3(reader, "mxfp4", torch.device("meta"), torch.bfloat16, ctx, LoRAConfig(rank=16))
    reads = check_reads(model, model.shard_plan, reader)  # the headers of this rank's files, validated
    stats = load_weights(model, reads, reader, ctx)
    load = loads[rank]
    assert stats.bytes_read == load["load_bytes"] and len(stats.files) == 94
    assert (stats.page_bytes, stats.ranges, stats.exchanged_bytes) == (load["page_bytes"], load["ranges"],
                                                                        load["exchanged_bytes"])
    assert _own_pages(reads, payload_ranges(hollow), ctx.tp_rank) == stats.page_bytes
    # the rank's share by hand: its 14 experts of every MoE layer, 1/8 of each tensor-parallel tensor, the rest
    experts = 92 * 14 * 17_547_264
    assert experts < load["load_bytes"] < experts + 25e9
    assert max(r["page_bytes"] / r["load_bytes"] for r in loads) <= 1.1
    print(f"\n{stats.line(rank)}")
    direct = weights.plan_ranges(reads, reader._payload, TP, ctx.tp_rank, exchange=False).cost()[0]
    rows = weights.plan_ranges(reads, reader._payload, TP, ctx.tp_rank, exchange=False, gap=2**40).cost()[0]
    for what, pages in (("exchanged (a run)", stats.page_bytes), ("per row, no TP group", direct),
                        ("whole rows", rows)):
        print(f"  {what}: {pages:,} bytes of pages, {pages / stats.bytes_read:.4f}x")
    assert stats.page_bytes < direct < rows and rows > 1.4 * stats.bytes_read


def test_the_kernel_pages_in_what_the_plan_says_on_the_hollow_k3(hollow):
    """The loader executed for real on three of rank 19's files (those holding layer 0's dense MLP, layers 1-3's KDA
    and MLA o_proj and a MoE layer's shared down_proj: every exchanged kind), with the kernel's page accounting
    (benchmarks/bench_read_pages.py: cache evicted before each file, `mincore` after): the resident pages are
    exactly the test's own accounting of the reads, and <= 1.1 x the bytes the rank holds."""
    payload = payload_ranges(hollow)
    wanted = ["model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.o_proj.weight",
              "model.layers.3.self_attn.o_proj.weight", "model.layers.5.block_sparse_moe.shared_experts.down_proj.weight"]
    files = {payload["language_model." + n].file.name for n in wanted}
    got = load_benchmark("bench_read_pages").measure_rank(hollow, DP, TP, EP, 19, files)
    assert got["files"] == len(files) and set(got["resident"]) == files
    own = _own_spans(got["reads"], payload, 19 % TP)
    assert own.keys() == files
    for file, spans in own.items():
        listed = set(np.concatenate([np.arange(first, last + 1) for first, last in spans]).tolist())
        resident = got["resident"][file]
        missing, extra = sorted(listed - resident), sorted(resident - listed)
        why = f"{len(missing)} listed pages never resident ({missing[:4]}), {len(extra)} not listed ({extra[:4]})"
        assert not missing and not extra, (file, why)
    assert got["kernel_page_bytes"] == got["planned_page_bytes"] == _own_pages(got["reads"], payload, 19 % TP)
    assert got["exchanged_bytes"] > 0 and got["kernel_ratio"] <= 1.1
    print(f"\n{got['line']}\n  kernel: {got['kernel_page_bytes']:,} bytes of pages, {got['kernel_ratio']:.4f}x")
