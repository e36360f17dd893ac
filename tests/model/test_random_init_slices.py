"""Random initialisation (no model.path) draws only a rank's slice (`weight_sources.RandomInit`, issue 59 item 5).

A stored tensor's random values are drawn in blocks of whole rows (block b from a generator seeded by
(seed, name, b)); a rank's column slice of a row-parallel weight (`o_proj`, `down_proj`: tp's columns of every row)
keeps only its columns of each block as the block is drawn. Checked with blocks much smaller than the tensors (so
a tensor spans many blocks and a rank's rows start inside one):
* every rank of tp=4 and rank 1 of tp=2 hold, bit for bit, its rows / columns of the one-process model's tensors;
* the bytes allocated while a rank's slice is drawn (torch.profiler's record of every CPU allocation and free,
  with the bytes held after each) peak at the slice plus one fp32 block, by hand, never the whole rows'; at the default block size a slice of a
  [256, 65536] weight peaks at its 4 MiB plus one 16 MiB block where the whole rows are 64 MiB.
"""
from __future__ import annotations

import pytest
import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from miles_k3.model import weight_sources
from miles_k3.model.build import ModelConfig, build_model
from miles_k3.model.config import K3Config
from miles_k3.model.weight_sources import RandomInit
from miles_k3.parallel.mesh import SINGLE, ParallelContext

BLOCK_ELEMS = 768  # 128-column rows (o_proj, q_proj): 6 rows a block; the dense down_proj's 384: 2 rows
O_PROJ = "model.layers.1.self_attn.o_proj.weight"  # [128, 128], row-parallel
DOWN = "model.layers.0.mlp.down_proj.weight"  # [128, 384], row-parallel
SHARED_DOWN = "model.layers.2.block_sparse_moe.shared_experts.down_proj.weight"  # [128, 128], row-parallel
Q_PROJ = "model.layers.1.self_attn.q_proj.weight"  # [128, 128], column-parallel (rows)


def peak_allocated(fn) -> tuple[object, int]:
    """(fn(), the most CPU bytes held at once by the allocations made during it): the profiler's allocation events
    (every allocation and free of torch's CPU allocator, each with the bytes the profiler has seen allocated and
    not freed after it: a running total, carried over from earlier profiles, so taken from the first event's)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()

    def walk(events):
        for e in events:
            yield e
            yield from walk(e.children)

    events = sorted((e for e in walk(prof.profiler.kineto_results.experimental_event_tree())
                     if e.tag == _EventType.Allocation and str(e.extra_fields.device) == "cpu"),
                    key=lambda e: e.start_time_ns)
    assert events, "no allocation recorded"
    before = events[0].extra_fields.total_allocated - events[0].extra_fields.alloc_size
    return out, max(e.extra_fields.total_allocated for e in events) - before


@pytest.mark.slow
def test_every_tp_rank_holds_the_one_process_model_s_slice_bitwise(monkeypatch):
    monkeypatch.setattr(weight_sources, "INIT_BLOCK_ELEMS", BLOCK_ELEMS)
    cfg = ModelConfig(name="k3_tiny")
    whole = build_model(cfg, torch.device("cpu"), torch.float32, SINGLE, seed=11).state_dict()
    assert whole[O_PROJ].abs().max() > 0  # drawn, not zeros
    for tp, t in [(2, 1), (4, 0), (4, 1), (4, 2), (4, 3)]:
        got = build_model(cfg, torch.device("cpu"), torch.float32, ParallelContext.layout(1, tp, 1, t),
                          seed=11).state_dict()
        for key in (O_PROJ, DOWN, SHARED_DOWN):
            cols = whole[key].shape[1] // tp
            assert torch.equal(got[key], whole[key][:, t * cols:(t + 1) * cols]), (tp, t, key)
        rows = 128 // tp  # q_proj's rows, this rank's heads: rank 1 of tp=4 starts at row 32, inside block 5
        assert torch.equal(got[Q_PROJ], whole[Q_PROJ][t * rows:(t + 1) * rows]), (tp, t)


def test_drawing_a_column_slice_allocates_the_slice_and_one_block(monkeypatch):
    monkeypatch.setattr(weight_sources, "INIT_BLOCK_ELEMS", BLOCK_ELEMS)
    source = RandomInit(K3Config.from_name("k3_tiny"), "mxfp4", seed=11)
    assert source.specs  # the stored specs computed (a meta model) before anything is measured
    name = "language_model." + O_PROJ  # stored [128, 128] bf16
    got, peak = peak_allocated(lambda: source.read(name, (slice(None), slice(32, 64))))  # tp=4, rank 1
    # by hand: the slice 128 x 32 bf16 = 8,192 B; one block 6 rows x 128 fp32 = 3,072 B; whole rows 65,536 B
    assert got.shape == (128, 32) and got.dtype == torch.bfloat16
    assert 8_192 <= peak <= 8_192 + 3_072, peak
    whole = source.read(name, (slice(None),))
    assert torch.equal(got, whole[:, 32:64])
    # the dense down_proj [128, 384] at tp=2, rank 0: 128 x 192 bf16 = 49,152 B; a block 2 x 384 fp32 = 3,072 B
    name = "language_model." + DOWN
    got, peak = peak_allocated(lambda: source.read(name, (slice(None), slice(0, 192))))
    assert 49_152 <= peak <= 49_152 + 3_072, peak
    assert torch.equal(got, source.read(name, (slice(None),))[:, :192])


def test_at_the_default_block_size_a_slice_of_long_rows_costs_its_bytes_and_one_block():
    source = RandomInit(K3Config.from_name("k3_tiny"), "mxfp4", seed=11)
    name = "language_model." + DOWN  # drawn as the down_proj rule (normal), at a made-up [256, 65536]
    got, peak = peak_allocated(lambda: source.rows(name, (256, 65536), 0, 256, cols=(slice(8192, 16384),),
                                                   dtype=torch.bfloat16))
    # by hand: the slice 256 x 8192 bf16 = 4 MiB; a block 2^22 fp32 elements (64 rows) = 16 MiB; whole rows 64 MiB
    assert got.shape == (256, 8192)
    assert 4 * 2**20 <= peak <= 20 * 2**20, peak
