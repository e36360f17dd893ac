"""Per-rank adapter checkpoints and the streamed PEFT export (issue 59, item 1), on gloo with k3_tiny and expert LoRA.

* the export's layout (which rank sends which piece of which tensor) at tp=2 x ep=2, by hand, and model_info's
  checkpoint figure at that mesh, by hand;
* one process: `save_adapter_streamed` writes `save_adapter`'s files byte for byte;
* 4 gloo ranks (dp=2 x tp=2, ep=2): each rank-<R>/adapter_shard.pt holds only the rank's slices; the checkpoint's PEFT file
  is byte for byte the one-process adapter's; resuming from the shards gives the uninterrupted run's adapter and
  optimizer bitwise; and the bytes torch's CPU allocator holds at once during `save_checkpoint` (torch.profiler's
  allocation events) stay under one streamed tensor plus a small allowance, by hand, where the gather it replaced held
  the whole adapter on every rank; and `load_adapter` of the checkpoint's PEFT file into a fresh cut model gives each
  rank its saved slices bitwise, reading (counted at `safe_open`) only its shard's elements, by hand.
* `load_adapter` into a model cut for each rank of dp=2 x tp=2, ep=2 in one process: the slice of the one-process load,
  read element for element; a truncated file or a wrongly shaped tensor (of an expert another rank holds) fails with
  load_adapter's message and every Parameter as it was.
"""
from __future__ import annotations

import re
import shutil

import pytest
import torch
from dist_helpers import DEVICE_TYPE, run_ranks
from lora_helpers import randomize_adapters, tiny
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from miles_k3.model import adapter as adapter_module
from miles_k3.model.adapter import PEFT_PREFIX, WEIGHTS_FILE, load_adapter, save_adapter
from miles_k3.model.adapter_stream import export_layout, save_adapter_streamed, transient_bytes
from miles_k3.model.lora import LoRAConfig, apply_lora, lora_parameters
from miles_k3.model.parallelize import parallelize
from miles_k3.parallel.config import ParallelConfig
from miles_k3.parallel.mesh import ParallelContext
from miles_k3.trainer.optim import OptimConfig

R = 16
LORA = LoRAConfig(rank=R, alpha=32.0, targets=["q_proj", "o_proj", "w1", "w2", "w3"])
OPTIM = OptimConfig(lr=1e-2, warmup_steps=1, total_steps=10, min_lr_ratio=0.1, weight_decay=0.01)
# k3_tiny by hand: hidden 128; KDA q_proj [128, 128] (column-parallel: B [128, r] cut to rows), o_proj [128, 128]
# (row-parallel: A [r, 128] cut to columns); routed experts: 16 per layer, latent Dl = 64, width I = 64, 8 MoE layers.
EXPERT_TENSOR_BYTES = R * 64 * 4  # one expert's A [r, Dl] or B [I, r], fp32: 4 KiB
TP_TENSOR_BYTES = 128 * R * 4  # q_proj's B / o_proj's A whole: 8 KiB, assembled from two 4 KiB pieces
TRANSIENT = TP_TENSOR_BYTES + TP_TENSOR_BYTES // 2  # 12 KiB
EXPERT_ADAPTER_BYTES = 8 * 16 * 3 * 2 * EXPERT_TENSOR_BYTES  # 3 MiB: every expert's A and B
# Adapter elements by hand (k3_tiny: layers 0, 1, 2, 4, 5, 6 are KDA with q_proj and o_proj [128, 128]; layers 3, 7, 8
# are MLA, whose o_proj is [128, 4 heads x v 16 = 64] and which have no q_proj; layers 1..8 are MoE):
# whole: KDA 6 x (q 16*128 + 128*16, o 16*128 + 128*16) = 49,152; MLA 3 x (16*64 + 128*16) = 9,216; experts
# 8 x 3 x 16 x (16*64 + 64*16) = 786,432.
WHOLE_ELEMENTS = 49_152 + 9_216 + 786_432  # 844,800
# one rank of tp=2, ep=2: q_proj's B rows and o_proj's A columns halved, the other half whole: KDA 6 x (2048 + 1024 +
# 1024 + 2048) = 36,864; MLA 3 x (16*32 + 128*16) = 7,680; 8 of the 16 experts: 393,216.
RANK_ELEMENTS = 36_864 + 7_680 + 393_216  # 437,760


def _model(seed=5):
    model = tiny("bf16")
    apply_lora(model, LORA)
    randomize_adapters(model, seed=seed)
    return model


class CountingOpen:
    """Stands in for `safe_open` in miles_k3.model.adapter and counts the elements of every tensor read through it,
    whole (`get_tensor`) or a slice (`get_slice(key)[index]`); the header (keys, shapes, dtypes) is free."""

    def __init__(self):
        self.elements = 0

    def __call__(self, *args, **kwargs):
        return _Counted(self, safe_open(*args, **kwargs))


class _Counted:
    def __init__(self, counter, inner):
        self.counter, self.inner = counter, inner

    def __enter__(self):
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)

    def __getattr__(self, name):  # keys(), get_shape(), get_dtype()
        return getattr(self.inner, name)

    def get_tensor(self, key):
        return self._count(self.inner.get_tensor(key))

    def get_slice(self, key):
        return _Counted(self.counter, self.inner.get_slice(key))

    def __getitem__(self, index):
        return self._count(self.inner[index])

    def _count(self, t):
        self.counter.elements += t.numel()
        return t


def test_layout_at_tp2_ep2_by_hand():
    model = _model()
    ctx = ParallelContext.layout(2, 2, 2, 3)  # rank 3: dp 1, tp 1, ep 1
    parallelize(model, ctx)
    entries = {e.key: e for e in export_layout(model, ctx)}
    q_b = next(e for k, e in entries.items() if k.endswith("layers.1.self_attn.q_proj.lora_B.weight"))
    assert q_b.shape == (128, R) and [(p.src, p.start, p.dim) for p in q_b.pieces] == [(0, 0, 0), (1, 64, 0)]
    o_a = next(e for k, e in entries.items() if k.endswith("layers.1.self_attn.o_proj.lora_A.weight"))
    assert o_a.shape == (R, 128) and [(p.src, p.start, p.dim) for p in o_a.pieces] == [(0, 0, 1), (1, 64, 1)]
    for e in (7, 8):  # expert 7: ep rank 0 (global rank 0); expert 8: ep rank 1, first held by global rank 1
        w1 = next(x for k, x in entries.items() if k.endswith(f"layers.2.block_sparse_moe.experts.{e}.w1.lora_A.weight"))
        assert w1.shape == (R, 64) and [(p.src, p.row) for p in w1.pieces] == [(e // 8, e % 8)]
    assert list(entries) == sorted(entries) and transient_bytes(list(entries.values())) == TRANSIENT


def test_model_info_checkpoint_memory_by_hand():
    from miles_k3.model_info import main as model_info
    rank0 = model_info(["model=k3_tiny", "parallel.tp=2", "parallel.ep=2", "gpus=4", "lora.rank=16",
                        "lora.targets=[q_proj,o_proj,w1,w2,w3]"])["per_rank"]
    assert rank0["checkpoint_transient_bytes"] == TRANSIENT
    whole = _model()
    assert rank0["adapter_whole_bytes"] == 4 * sum(p.numel() for p in lora_parameters(whole).values())


def test_streamed_file_is_save_adapter_s_in_one_process(tmp_path):
    model = _model()
    save_adapter(model, LORA, tmp_path / "a", base_model_name_or_path="k3_tiny")
    assert save_adapter_streamed(model, LORA, tmp_path / "b", "k3_tiny") == tmp_path / "b"
    for name in (WEIGHTS_FILE, "adapter_config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    with pytest.raises(FileExistsError):
        save_adapter_streamed(model, LORA, tmp_path / "b", "k3_tiny")


# ---- load_adapter into a cut model: the rank's slices only --------------------------------------------------------
@pytest.fixture(scope="module")
def whole_adapter(tmp_path_factory):
    """(the one-process model's adapter Parameters, its PEFT directory)."""
    model = _model()
    path = save_adapter(model, LORA, tmp_path_factory.mktemp("whole") / "adapter", base_model_name_or_path="k3_tiny")
    return {n: p.detach() for n, p in lora_parameters(model).items()}, path


def _cut(rank: int):
    """k3_tiny with other adapter values (seed 9), cut for `rank` of dp=2 x tp=2, ep=2."""
    model = _model(seed=9)
    parallelize(model, ParallelContext.layout(2, 2, 2, rank))
    return model


def test_each_rank_of_a_cut_model_reads_only_its_slices(whole_adapter, monkeypatch):
    want, path = whole_adapter
    assert sum(t.numel() for t in want.values()) == WHOLE_ELEMENTS
    for rank in range(4):
        cut = _cut(rank)
        params = lora_parameters(cut)
        storage = {n: p.data_ptr() for n, p in params.items()}
        counter = CountingOpen()
        monkeypatch.setattr(adapter_module, "safe_open", counter)
        load_adapter(cut, path)
        for n, p in params.items():
            part = cut.shard_plan.slice_of(n)
            assert torch.equal(p, want[n] if part is None else part.of(want[n])), (rank, n)
            assert p.data_ptr() == storage[n], (rank, n)
        assert counter.elements == RANK_ELEMENTS == sum(p.numel() for p in params.values()), rank


def _edit(path, fn):
    tensors = load_file(path / WEIGHTS_FILE)
    fn(tensors)
    save_file(tensors, path / WEIGHTS_FILE, metadata={"format": "pt"})


W2_B0 = PEFT_PREFIX + "model.layers.3.block_sparse_moe.experts.0.w2.lora_B.weight"  # rank 3 holds experts 8..15
REFUSALS = {
    "truncated": (lambda p: (p / WEIGHTS_FILE).write_bytes((p / WEIGHTS_FILE).read_bytes()[:-100]),
                  r"adapter_model.safetensors: unreadable .* truncated or corrupt"),
    "shape": (lambda p: _edit(p, lambda t: t.update({W2_B0: torch.zeros(64, 5)})),
              re.escape(W2_B0) + r" has shape \(64, 5\), the model expects \(64, 16\)"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_bad_file_leaves_a_cut_model_untouched(whole_adapter, tmp_path, case):
    edit, match = REFUSALS[case]
    path = shutil.copytree(whole_adapter[1], tmp_path / "adapter")
    edit(path)
    cut = _cut(3)
    before = {n: p.detach().clone() for n, p in lora_parameters(cut).items()}
    with pytest.raises(ValueError, match=match):
        load_adapter(cut, path)
    assert all(torch.equal(p, before[n]) for n, p in lora_parameters(cut).items())


# ---- 4 gloo ranks --------------------------------------------------------------------------------------------------
def _loss(params):
    """A loss that needs no forward: every adapter tensor pulled towards a fixed pattern (gradients local)."""
    return sum(((p - 0.01 * torch.arange(p.numel()).view_as(p).cos()) ** 2).sum() for p in params.values())


def _step(params, opt, sched, ctx):
    from miles_k3.trainer.optim import optimizer_step
    _loss(params).backward()
    optimizer_step(opt, sched, params, OPTIM, ctx=ctx)


def _ranks(rank, run_dir):
    from test_random_init_slices import peak_allocated

    from miles_k3.parallel.mesh import init_parallel
    from miles_k3.trainer.checkpoint import load_checkpoint, save_checkpoint
    from miles_k3.trainer.checkpoint_files import ADAPTER_DIR
    from miles_k3.trainer.optim import build_optimizer, build_scheduler

    ctx = init_parallel(ParallelConfig(dp=2, tp=2, ep=2), DEVICE_TYPE)
    runs = []
    for _ in range(2):
        model = _model()
        parallelize(model, ctx)
        params = lora_parameters(model)
        opt = build_optimizer(params, OPTIM)
        runs.append((model, params, opt, build_scheduler(opt, OPTIM)))
    (model, params, opt, sched), (model2, params2, opt2, sched2) = runs
    _step(params, opt, sched, ctx)
    saved = {n: p.detach().clone() for n, p in params.items()}
    path, peak = peak_allocated(lambda: save_checkpoint(run_dir, 1, model, LORA, opt, sched, {"cursor": 1}, {}, "x: 1\n",
                                                        base_model_name_or_path="k3_tiny", ctx=ctx))
    _step(params, opt, sched, ctx)  # the uninterrupted run
    load_checkpoint(path, model2, opt2, sched2, ctx)
    resumed_equal = all(torch.equal(params2[n], saved[n]) for n in saved)
    _step(params2, opt2, sched2, ctx)
    loaded, read = _load_counted(path / ADAPTER_DIR, ctx)
    return {"path": str(path), "peak": peak, "resumed_equal": resumed_equal, "saved": saved, "read": read,
            "loaded_equal": all(torch.equal(loaded[n], saved[n]) for n in saved),
            "slices": {n: s for n, s in model.shard_plan.slices.items() if n in params},
            "same_after_step": all(torch.equal(params[n], params2[n]) for n in params),
            "same_optimizer": _same_optimizer(opt, opt2)}


def _load_counted(adapter_dir, ctx):
    """The checkpoint's PEFT adapter loaded into a fresh cut model (other adapter values): its Parameters, and the
    elements the load read from the file."""
    model = _model(seed=9)
    parallelize(model, ctx)
    counter = CountingOpen()
    adapter_module.safe_open = counter  # this process is the rank's own: nothing else loads here
    try:
        load_adapter(model, adapter_dir)
    finally:
        adapter_module.safe_open = safe_open
    return lora_parameters(model), counter.elements


def _same_optimizer(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa["state"].keys() == sb["state"].keys() and all(
        torch.equal(v, sb["state"][i][k]) for i in sa["state"] for k, v in sa["state"][i].items())


@pytest.mark.slow
def test_four_ranks_write_their_shards_stream_the_adapter_and_resume_bitwise(tmp_path):
    from pathlib import Path

    results = run_ranks(4, _ranks, str(tmp_path))
    path = Path(results[0]["path"])
    one = _model()  # holds, below, the whole adapter assembled from the ranks' slices
    params = lora_parameters(one)
    # each rank's adapter_shard.pt: exactly its parameters (its slices), nothing of the others'
    for rank, r in enumerate(results):
        shard = torch.load(path / f"rank-{rank:05d}" / "adapter_shard.pt", weights_only=True)
        assert shard.keys() == r["saved"].keys()
        for n, t in shard.items():
            assert torch.equal(t, r["saved"][n]), n
            s = r["slices"].get(n)
            if s is not None:
                assert t.shape[s.dim] == s.length < s.full, n
        experts = sum(t.numel() * 4 for n, t in shard.items() if ".experts.lora." in n)
        assert experts == EXPERT_ADAPTER_BYTES // 2  # ep=2: half of every layer's experts
        assert r["resumed_equal"] and r["same_after_step"] and r["same_optimizer"], rank
        # the PEFT file loaded back on the rank: its saved slices, bitwise, from its shard's elements only
        assert r["loaded_equal"] and r["read"] == RANK_ELEMENTS < WHOLE_ELEMENTS, (rank, r["read"])
    # the PEFT file equals the whole adapter assembled from the ranks' saved slices (dp replica 0: ranks 0 and 1)
    whole = {}
    for n, p in params.items():
        s = results[0]["slices"].get(n)
        if s is None:
            whole[n] = results[0]["saved"][n]
        elif ".experts.lora." in n:
            whole[n] = torch.cat([results[0]["saved"][n], results[1]["saved"][n]], dim=0)
        else:
            whole[n] = torch.cat([results[0]["saved"][n], results[1]["saved"][n]], dim=s.dim)
        assert whole[n].shape == p.shape, n
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(whole[n])
    ref = tmp_path / "ref"
    save_adapter(one, LORA, ref, base_model_name_or_path="k3_tiny")
    assert (ref / WEIGHTS_FILE).read_bytes() == (path / "adapter" / WEIGHTS_FILE).read_bytes()
    # memory: rank 0 held at most one assembled tensor and a piece (+ the small rng / pickling allocations)
    allowance = 8 * 2**10  # RNG states and pickling: ~4 KiB measured on every rank
    print("peak bytes allocated during save_checkpoint per rank:", [r["peak"] for r in results])
    for rank, r in enumerate(results):
        assert r["peak"] <= TRANSIENT + allowance < EXPERT_ADAPTER_BYTES, (rank, r["peak"])
