"""Sharded loading: every rank plans its shard on the meta device and reads only its slices of the checkpoint.

One process, ranks placed by `ParallelContext.layout` (planning and loading need no process group):
* every mesh builds, on every rank, exactly the tensors that cutting the one-process model gives ("load then
  shard", the old path), from a checkpoint and from a seeded random init; by hand: which rows / columns / experts
  a rank holds;
* a seeded random init is the checkpoint init_checkpoint writes for the seed, bit for bit;
* a rank asks the checkpoint only for its slices (a recording source), never opens a file it needs nothing from
  (a vision shard), and stages at most STAGING_BYTES per copy;
* model_info's per-rank device bytes are the bytes the loader allocates;
* bad input: a tensor missing from the file its index names, a slice outside a stored tensor, a shard that does
  not fit the device (refused before anything is allocated), a mesh that does not divide a tensor.
Two ranks (slow; gloo, or NCCL with MILES_K3_TEST_BACKEND=nccl): a tensor only rank 1 reads is missing, and both ranks refuse before reading (rank 0
naming rank 1); a good load logs one line per rank on rank 0. Launch UX: parallel.dp defaults to world / tp and
EP groups exist only for ep > 1.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import dist_helpers
import pytest
import torch
from dist_helpers import DEVICE_TYPE, run_ranks
from safetensors.torch import load_file, save_file

from miles_k3.init_checkpoint import init_checkpoint
from miles_k3.model import weight_sources, weights
from miles_k3.model.build import ModelConfig, build_model
from miles_k3.model.config import K3Config
from miles_k3.model.lora import LoRAConfig
from miles_k3.model.parallelize import parallelize
from miles_k3.model.weight_files import INDEX_FILE, WeightsError, open_weights
from miles_k3.parallel.config import ParallelConfig, ParallelConfigError
from miles_k3.parallel.mesh import SINGLE, ParallelContext

LORA = LoRAConfig(rank=2, alpha=4.0, targets=["q_proj", "o_proj", "q_b_proj", "gate_proj", "down_proj", "w1", "w2"])
MESHES = [(1, 2, 1), (2, 1, 2), (2, 2, 4)]  # (dp, tp, ep)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """k3_tiny with MXFP4 experts, one shard per layer (seed 7)."""
    return init_checkpoint(K3Config.from_name("k3_tiny"), tmp_path_factory.mktemp("ck") / "tiny", seed=7,
                           expert_format="mxfp4")


def _build(cfg: ModelConfig, ctx: ParallelContext = SINGLE, seed: int = 7) -> torch.nn.Module:
    return build_model(cfg, torch.device("cpu"), torch.float32, ctx, LORA, seed)


def _assert_same_tensors(got: torch.nn.Module, want: torch.nn.Module, what: str) -> None:
    a, b = got.state_dict(), want.state_dict()
    assert a.keys() == b.keys(), what
    for key in a:
        assert torch.equal(a[key], b[key]), f"{what}: {key}"


@pytest.mark.slow
@pytest.mark.parametrize("source", ["checkpoint", "random"])
def test_every_rank_of_every_mesh_holds_the_slices_of_the_one_process_model(checkpoint, source):
    cfg = ModelConfig(path=str(checkpoint)) if source == "checkpoint" else ModelConfig(name="k3_tiny")
    whole = _build(cfg)
    for dp, tp, ep in MESHES:
        for rank in range(dp * tp):
            ctx = ParallelContext.layout(dp, tp, ep, rank)
            reference = _build(cfg)  # load, then shard: the old path
            parallelize(reference, ctx)
            _assert_same_tensors(_build(cfg, ctx), reference, f"{source} dp={dp} tp={tp} ep={ep} rank {rank}")
    # by hand, tp=2 x ep=2, rank 1: the second half of q_proj's rows (4 heads of 32: heads 2, 3), of o_proj's
    # columns and of the vocabulary; experts 8..15 of 16
    rank1 = _build(cfg, ParallelContext.layout(1, 2, 2, 1)).state_dict()
    full = whole.state_dict()
    q, o = "model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.o_proj.weight"
    assert torch.equal(rank1[q], full[q][64:128]) and torch.equal(rank1[o], full[o][:, 64:128])
    assert torch.equal(rank1["lm_head.weight"], full["lm_head.weight"][256:512])
    experts = "model.layers.2.block_sparse_moe.experts"
    held = sorted({int(k[len(experts) + 1:].split(".")[0]) for k in rank1 if k.startswith(experts + ".")
                   and k[len(experts) + 1].isdigit()})
    assert held == list(range(8, 16))
    assert torch.equal(rank1[f"{experts}.9.w2.weight_packed"], full[f"{experts}.9.w2.weight_packed"])
    assert torch.equal(rank1[f"{experts}.lora.w1.lora_A"], full[f"{experts}.lora.w1.lora_A"][8:16])


@pytest.mark.parametrize("fmt", ["mxfp4", "bf16"])
def test_a_random_init_is_the_checkpoint_of_its_seed(tmp_path, fmt):
    directory = init_checkpoint(K3Config.from_name("k3_tiny"), tmp_path / fmt, seed=3, expert_format=fmt)
    _assert_same_tensors(_build(ModelConfig(name="k3_tiny", experts=fmt), seed=3),
                         _build(ModelConfig(path=str(directory)), seed=3), fmt)
    other = _build(ModelConfig(name="k3_tiny", experts=fmt), seed=4).state_dict()
    q = "model.layers.1.self_attn.q_proj.weight"
    assert not torch.equal(other[q], _build(ModelConfig(name="k3_tiny", experts=fmt), seed=3).state_dict()[q])


class _Recording:
    """A checkpoint reader that records what it is asked for (name, index) and the bytes each call returns."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[str, tuple, int]] = []
        read = weight_sources.WeightFileReader.read

        def recorded(reader, name, index, device=None):
            t = read(reader, name, index, device)
            self.calls.append((name, index, t.numel() * t.element_size()))
            return t

        monkeypatch.setattr(weight_sources.WeightFileReader, "read", recorded)


def _with_vision_shard(checkpoint: Path, tmp_path: Path) -> Path:
    """A copy of `checkpoint` whose index also lists a vision tensor in a file of its own."""
    import shutil
    directory = Path(shutil.copytree(checkpoint, tmp_path / "with_vision"))
    save_file({"vision_tower.patch_embed.proj.weight": torch.zeros(4, 4)}, str(directory / "vision.safetensors"))
    index = json.loads((directory / INDEX_FILE).read_text())
    index["weight_map"]["vision_tower.patch_embed.proj.weight"] = "vision.safetensors"
    (directory / INDEX_FILE).write_text(json.dumps(index))
    return directory


def test_a_rank_reads_only_its_slices_and_opens_only_the_files_it_needs(checkpoint, tmp_path, monkeypatch):
    directory = _with_vision_shard(checkpoint, tmp_path)
    opened = []
    open_file = weight_sources.open_file
    monkeypatch.setattr(weight_sources, "open_file", lambda f: opened.append(Path(f).name) or open_file(f))
    recording = _Recording(monkeypatch)
    monkeypatch.setattr(weights, "STAGING_BYTES", 4096)  # small chunks: a 128 x 128 fp32-sized read is 8 copies
    model = _build(ModelConfig(path=str(directory)), ParallelContext.layout(1, 2, 2, 1))
    calls = {}
    for name, index, nbytes in recording.calls:
        calls.setdefault(name, []).append(index)
        assert nbytes <= 4096 or index[0].stop - index[0].start == 1, (name, index, nbytes)  # a chunk, or one row
    prefix = "language_model.model.layers.1.self_attn."
    q = calls[prefix + "q_proj.weight"]  # [128 rows, 128] bf16: 256 B a row, 16 rows a chunk, rows 64..127
    assert [(i[0].start, i[0].stop) for i in q] == [(64 + 16 * c, 80 + 16 * c) for c in range(4)]
    o = calls[prefix + "o_proj.weight"]  # [128, 128]: columns 64..127 of every row, 32 rows a chunk
    assert {(i[1].start, i[1].stop) for i in o} == {(64, 128)} and sum(i[0].stop - i[0].start for i in o) == 128
    experts = {int(n.split(".experts.")[1].split(".")[0]) for n in calls if ".experts." in n}
    assert experts == set(range(8, 16))
    assert all(len(idx) == 1 for n, idx in calls.items() if ".experts." in n)  # one whole read per tensor
    assert "vision.safetensors" not in opened and len(set(opened)) == len(list(checkpoint.glob("*.safetensors")))
    assert model.state_dict()[prefix[len("language_model."):] + "q_proj.weight"].shape == (64, 128)


def test_model_info_per_rank_bytes_are_what_the_loader_allocates(checkpoint):
    from miles_k3.model_info import main as model_info
    figures = model_info([f"model.path={checkpoint}", "model.dtype=fp32", "parallel.tp=2", "parallel.ep=2",
                          "gpus=4", f"lora.rank={LORA.rank}", f"lora.targets=[{','.join(LORA.targets)}]"])["per_rank"]
    model = _build(ModelConfig(path=str(checkpoint)), ParallelContext.layout(2, 2, 2, 0))
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in [*model.parameters(), *model.buffers()]}
    assert figures["device_bytes"] == sum(storages.values())
    ranks = {r["rank"]: r for r in figures["ranks"]}
    stored = open_weights(checkpoint)
    files = len({f for f in stored.locations.values()})
    assert len(ranks) == 4 and all(r["files"] == files for r in ranks.values())
    assert ranks[0]["load_bytes"] == figures["load_bytes"] < figures["checkpoint_bytes"] == stored.total_bytes


def test_a_tensor_missing_from_the_file_its_index_names_is_refused_before_any_read(checkpoint, tmp_path,
                                                                                 monkeypatch):
    directory = _drop_tensor(checkpoint, tmp_path, "model.layers.3.block_sparse_moe.experts.12.w3.weight_scale")
    reads = []
    monkeypatch.setattr(weight_sources.WeightFileReader, "read", lambda *a: reads.append(a) or None)
    with pytest.raises(WeightsError, match=r"maps tensor 'language_model\.model\.layers\.3\.block_sparse_moe\."
                                              r"experts\.12\.w3\.weight_scale' to model-00004-of-00010\.safetensors, "
                                              r"but that file has no such tensor"):
        _build(ModelConfig(path=str(directory)), ParallelContext.layout(2, 1, 2, 1))
    assert not reads
    monkeypatch.undo()
    _build(ModelConfig(path=str(directory)), ParallelContext.layout(2, 1, 2, 0))  # rank 0 never needs it


def _drop_tensor(checkpoint: Path, tmp_path: Path, key: str) -> Path:
    """A copy of `checkpoint` whose shard holding `language_model.<key>` lost it (the index still names it)."""
    import shutil
    directory = Path(shutil.copytree(checkpoint, tmp_path / "dropped"))
    name = "language_model." + key
    file = directory / json.loads((directory / INDEX_FILE).read_text())["weight_map"][name]
    tensors = load_file(str(file))
    del tensors[name]
    save_file(tensors, str(file))
    return directory


def test_a_slice_outside_its_stored_tensor_is_refused_naming_it(checkpoint):
    meta = build_model(ModelConfig(path=str(checkpoint)), torch.device("meta"), torch.float32,
                       ParallelContext.layout(1, 2, 1, 1))
    stored = open_weights(checkpoint)
    name = "language_model.model.layers.1.self_attn.q_proj.weight"

    class Shorter:  # the checkpoint as if its q_proj had 100 rows
        @staticmethod
        def spec(n):
            spec = stored.expected[n]
            return type(spec)((100, 128), spec.dtype) if n == name else spec

        file = staticmethod(stored.locations.get)

    with pytest.raises(WeightsError, match=r"q_proj\.weight' in .*: this rank reads \[64, 128\) along dim 0, "
                                              r"outside its stored shape \[100, 128\]"):
        weights._check_slices(weights.plan_reads(meta, meta.shard_plan, stored.expert_format), Shorter())


def test_a_shard_that_does_not_fit_the_device_is_refused_before_anything_is_allocated(checkpoint, monkeypatch):
    monkeypatch.setattr(weights, "available_bytes", lambda device: 1_000_000)
    monkeypatch.setattr(weights, "materialize", lambda *a: pytest.fail("allocated"))
    with pytest.raises(ParallelConfigError, match=r"rank 1 \(dp 0, tp 1, ep 1\): its shard of the model needs "
                                                  r"\d\.\d\d GB on cpu but 0\.00 GB are free"):
        _build(ModelConfig(path=str(checkpoint)), ParallelContext.layout(1, 2, 2, 1))


def test_a_mesh_that_does_not_divide_a_tensor_is_refused_naming_it():
    from miles_k3.model.weight_files import meta_model
    model = meta_model(K3Config.from_name("k3_tiny"))
    with pytest.raises(ParallelConfigError, match=r"parallel.tp: 8 does not divide the model's KDA heads"):
        parallelize(model, ParallelContext.layout(1, 8, 1, 0))


def test_dp_defaults_to_the_world_over_tp_and_a_wrong_explicit_dp_names_the_field(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    cfg = ParallelConfig(tp=2, ep=4)
    cfg.validate()
    assert cfg.dp == 2
    with pytest.raises(ParallelConfigError, match=r"parallel.dp x parallel.tp = 3 x 2 = 6 but torchrun started 4"):
        ParallelConfig(dp=3, tp=2).check_world(4, launched=True)
    with pytest.raises(ParallelConfigError, match=r"parallel.tp: 3 does not divide the 4 processes torchrun"):
        ParallelConfig(tp=3).validate()
    monkeypatch.delenv("WORLD_SIZE")
    one = ParallelConfig(tp=2)
    one.validate()
    assert one.dp == 1  # no torchrun: the start refuses tp=2 on one process (check_world)


# ---- two gloo ranks ------------------------------------------------------------------------------------------
def _load_rank(rank: int, good: str, broken: str) -> dict:
    import torch.distributed as dist

    from miles_k3.parallel.mesh import build_context, init_parallel
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("miles_k3.model.weights").addHandler(handler)
    logging.getLogger("miles_k3.model.weights").setLevel(logging.INFO)
    ctx = init_parallel(ParallelConfig(ep=2), DEVICE_TYPE)
    out = {"dp": ctx.dp_size, "new_groups": {}}
    new_group = dist.new_group
    for ep in (1, 2):  # the groups a context makes: EP and expert-replica groups only for ep > 1
        made = []
        dist.new_group = lambda *a, _made=made, **k: _made.append(a) or new_group(*a, **k)
        build_context(ParallelConfig(ep=ep), rank, 2, DEVICE_TYPE)
        out["new_groups"][ep] = len(made)
    dist.new_group = new_group
    device = dist_helpers.test_device(rank)
    model = build_model(ModelConfig(path=good), device, torch.float32, ctx, LORA, 7)
    out["lines"] = [m for m in records if " checkpoint bytes from " in m]
    out["held"] = model.model.layers[2].block_sparse_moe.experts.expert_offset
    try:
        build_model(ModelConfig(path=broken), device, torch.float32, ctx, LORA, 7)
        out["error"] = None
    except WeightsError as err:
        out["error"] = str(err)
    return out


@pytest.mark.slow
def test_two_ranks_refuse_a_tensor_only_one_needs_together_and_log_a_line_per_rank(checkpoint, tmp_path):
    broken = _drop_tensor(checkpoint, tmp_path, "model.layers.3.block_sparse_moe.experts.12.w3.weight_scale")
    r0, r1 = run_ranks(2, _load_rank, str(checkpoint), str(broken))
    assert r0["dp"] == r1["dp"] == 2 and r0["held"] == 0 and r1["held"] == 8  # dp from the world; ep=2 experts
    for r in (r0, r1):  # ep=2 over 2 ranks: one EP group and two expert-replica groups more than ep=1
        assert r["new_groups"][2] - r["new_groups"][1] == 3, r["new_groups"]
    assert "experts.12.w3.weight_scale" in r1["error"] and "but that file has no such tensor" in r1["error"]
    assert r0["error"].startswith("rank 1: ") and "experts.12.w3.weight_scale" in r0["error"]
    total = open_weights(checkpoint).total_bytes
    assert len(r0["lines"]) == 2 and not r1["lines"]  # rank 0 logs for every rank; the others stay quiet
    for r, line in enumerate(r0["lines"]):
        assert line.startswith(f"rank {r} read ") and f" of {total:,} checkpoint bytes from 10 files" in line
