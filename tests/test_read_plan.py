"""The read plan of the real K3 at scale, without its bytes: a hollow checkpoint (the published 96-file layout,
real headers and index, payload a hole) planned for tp=8 x ep=64 over 64 ranks (dp=8).

* every stored text byte is read by exactly one rank of each replica that shares it: a tensor-parallel tensor's
  slices tile it once within every TP group (8 times in all), each routed expert is read by exactly one rank
  (ep = world), and every other text tensor whole by every rank; A_log's padding (heads 96..127 of its stored
  [128]) by no rank's plan;
* every rank opens the 94 text files and never the projector and vision files;
* the loader itself, executed for one rank against the hollow files (a reader that counts the bytes each request
  asks for, and hands back meta tensors), asks for exactly that rank's `load_bytes` as model_info prints it.
"""
from __future__ import annotations

import itertools
import math
from collections import Counter, defaultdict
from types import SimpleNamespace

import pytest
import torch

from miles_k3.model.build import ModelConfig
from miles_k3.model.config import K3Config
from miles_k3.model.lora import LoRAConfig, apply_lora
from miles_k3.model.weight_files import meta_model, open_weights, skip_meta_init, spec_bytes
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


class _CountingReader(WeightFileReader):
    """The hollow checkpoint's reader, asked for slices but reading nothing: it counts the stored bytes of each
    request and returns a meta tensor of the requested shape."""

    requested = 0

    def read(self, name, index, device=None):
        spec = self.spec(name)
        shape = [len(range(*i.indices(n))) for i, n in zip(index + (slice(None),) * len(spec.shape), spec.shape)]
        self.requested += math.prod(shape) * spec_bytes(spec) // max(1, math.prod(spec.shape))
        return torch.empty(shape, dtype=torch.uint8 if spec.dtype == "U8" else torch.float32, device="meta")


def test_the_loader_asks_one_rank_for_exactly_its_load_bytes(hollow, loads):
    rank = 19  # dp 2, tp 3, ep 19
    reader = _CountingReader(open_weights(hollow))
    model = build_k3(reader, "mxfp4", torch.device("meta"), torch.bfloat16,
                     ParallelContext.layout(DP, TP, EP, rank), LoRAConfig(rank=16))
    reads = check_reads(model, model.shard_plan, reader)  # the headers of this rank's files, validated
    stats = load_weights(model, reads, reader)
    assert reader.requested == stats.bytes_read == loads[rank]["load_bytes"]
    assert len(stats.files) == 94
    # the rank's share by hand: its 14 experts of every MoE layer, 1/8 of each tensor-parallel tensor, the rest
    experts = 92 * 14 * 17_547_264
    assert experts < loads[rank]["load_bytes"] < experts + 25e9
