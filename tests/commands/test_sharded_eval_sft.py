"""eval, SFT and the training dry run (steps=0) build the model as training does: each rank plans its shard on the
meta device and reads only its slices of the checkpoint (`model.ranks.start_ranks` + `build_model(..., ctx)`).

One process (fast): a PEFT adapter loaded into a model cut for a mesh holds, on both ranks of tp=2 x ep=2, the
plan's slice of each tensor of the one-process load (TP halves, experts by global id), and a cut model without LoRA
is refused; full-parameter SFT on several ranks is refused at validation, in one line.

Two gloo ranks (slow; one spawn, `sharded`), against the one-process runs on the same k3_tiny checkpoint (MXFP4
experts) and data:
* `python -m miles_k3.eval` with a random non-zero adapter (expert LoRA too) at tp=2 x ep=2 and at dp=2 x ep=2 (the
  EP group spanning both replicas: lockstep): the same summary and the same samples of the same problems, and
  the model it evaluates gives the one-process logits (5e-4 of their scale, test_parallel_ep's end-to-end
  tolerance);
* `python -m miles_k3.sft mode=lora` (held-out figures every step, an eval at the end) at tp=2 x ep=2 and
  dp=2 x ep=2: the one-process losses, held-out figures (the same on both ranks), eval and PEFT adapter (5e-4 of
  each tensor's norm, as test_parallel_loop's adapters), the replica with fewer micro-batches running idle ones;
* each build's per-rank load line (rank 0 logs one per rank) says it read exactly model_info's `load_bytes` for
  that rank of that mesh (model_info plans them independently, from the checkpoint's index), less than the
  checkpoint; so does `python -m miles_k3.train steps=0` at ep=2 (it used to read the whole model on every rank);
* `vocab_argmax` over two vocabulary shards is torch.argmax of the whole logits, ties included.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import dist_helpers
import pytest
import torch
from dist_helpers import DEVICE_TYPE, run_ranks
from lora_helpers import randomize_adapters

from miles_k3.init_checkpoint import init_checkpoint
from miles_k3.model.adapter import load_adapter, save_adapter
from miles_k3.model.build import ModelConfig, build_model
from miles_k3.model.config import K3Config
from miles_k3.model.lora import LoRAConfig, lora_parameters
from miles_k3.parallel.mesh import SINGLE, ParallelContext

LORA = LoRAConfig(rank=2, alpha=4.0, targets=["q_proj", "o_proj", "q_b_proj", "gate_proj", "down_proj", "w1", "w2"])
MESHES = {"tp2_ep2": ["parallel.tp=2", "parallel.ep=2"], "dp2_ep2": ["parallel.dp=2", "parallel.ep=2"]}
MODEL_INFO = {"tp2_ep2": ["parallel.tp=2", "parallel.ep=2", "gpus=2"], "dp2_ep2": ["parallel.ep=2", "gpus=2"]}
TOL = 5e-4  # end to end, relative to the scale: test_parallel_ep's MODEL_TOL, test_parallel_loop's adapters
EVAL_PROBLEMS = [{"id": f"p{i}", "problem": f"{i}+{i + 1}=", "answer": str(2 * i + 1)} for i in range(5)]
READ_LINE = re.compile(r"rank (\d+) read ([\d,]+) of ([\d,]+) checkpoint bytes")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """k3_tiny with MXFP4 experts (seed 7), written as init_checkpoint writes it (with its small tokenizer)."""
    return init_checkpoint(K3Config.from_name("k3_tiny"), tmp_path_factory.mktemp("ck") / "tiny", seed=7,
                           expert_format="mxfp4")


def _adapter(checkpoint: Path, out: Path) -> Path:
    """A PEFT adapter for `checkpoint` with random non-zero A and B on every LORA target (expert LoRA too)."""
    model = build_model(ModelConfig(path=str(checkpoint)), torch.device("cpu"), torch.float32, SINGLE, LORA, 7)
    randomize_adapters(model, seed=3, std=0.05)
    return save_adapter(model, LORA, out, base_model_name_or_path=str(checkpoint))


# ---- one process ------------------------------------------------------------------------------------------------
def test_an_adapter_loaded_into_a_cut_model_holds_each_ranks_slice_of_it(checkpoint, tmp_path):
    adapter = _adapter(checkpoint, tmp_path / "adapter")
    cfg = ModelConfig(path=str(checkpoint))
    whole = build_model(cfg, torch.device("cpu"), torch.float32, SINGLE, LORA, 0)
    load_adapter(whole, adapter)
    want = lora_parameters(whole)
    for rank in range(2):
        ctx = ParallelContext.layout(1, 2, 2, rank)
        cut = build_model(cfg, torch.device("cpu"), torch.float32, ctx, LORA, 0)  # A drawn from seed 0: replaced
        storage = {n: p.data_ptr() for n, p in lora_parameters(cut).items()}
        load_adapter(cut, adapter)
        plan = cut.shard_plan
        for name, p in lora_parameters(cut).items():
            part = plan.slice_of(name)
            expected = want[name] if part is None else part.of(want[name])
            assert torch.equal(p, expected), f"rank {rank}: {name}"
            assert p.data_ptr() == storage[name], f"rank {rank}: {name} moved"  # in place: the engine shares it
        assert plan.slice_of("model.layers.2.block_sparse_moe.experts.lora.w1.lora_A").start == 8 * (rank % 2)


def test_a_cut_model_without_lora_and_full_sft_on_several_ranks_are_refused(checkpoint, tmp_path):
    from miles_k3.config import ConfigFieldError, compose_config

    adapter = _adapter(checkpoint, tmp_path / "adapter")
    cut = build_model(ModelConfig(path=str(checkpoint)), torch.device("cpu"), torch.float32,
                      ParallelContext.layout(1, 2, 1, 0))
    with pytest.raises(ValueError, match=r"is cut for a mesh \(tp=2, ep=1\) and has no LoRA; build it with the "
                                         r"adapter's"):
        load_adapter(cut, adapter)
    with pytest.raises(ConfigFieldError, match=r"^mode: full-parameter SFT runs in one process, not on the 2 ranks "
                                               r"of parallel.dp x parallel.tp; under torchrun train an adapter "
                                               r"\(mode=lora\)$"):
        compose_config("sft", ["data.source=x.jsonl", "mode=full", "parallel.dp=2"])
    compose_config("sft", ["data.source=x.jsonl", "mode=lora", "parallel.dp=2"])  # an adapter: sharded


# ---- two ranks ---------------------------------------------------------------------------------------------------
def _eval_overrides(checkpoint: Path, adapter: Path, data: Path, run_dir: Path, *mesh: str) -> list[str]:
    """k3_tiny's checkpoint with the adapter, fp32, 5 problems x 2 sampled answers of 4 tokens."""
    return [f"model.path={checkpoint}", "model.dtype=fp32", f"device={DEVICE_TYPE}", f"adapter={adapter}",
            f"eval.data.source={data}", "eval.template=plain", "eval.grader=integer", "eval.samples=2",
            "eval.temperature=1.0", "eval.max_new_tokens=4", "engine.max_context=64",
            "engine.memory_budget_bytes=4194304", f"run_dir={run_dir}", *mesh]


def _sft_overrides(checkpoint: Path, data: Path, run_dir: Path, *mesh: str) -> list[str]:
    """LoRA SFT on worked sums (a generated task: held-out figures from its test split, every step), 3 steps of 3
    problems of 42-57 tokens in micro-batches of one (under dp=2 one replica runs 2, the other 1 and, at dp=2 x
    ep=2, an idle one in lockstep), an eval of the 5 problems (greedy) at the end. AdamW eps=1e-3: its first update
    of a zero B is lr * g / (|g| + eps), which at eps=1e-8 turns roundoff in a near-zero gradient into an O(lr)
    difference."""
    return [f"model.path={checkpoint}", "model.dtype=fp32", f"device={DEVICE_TYPE}", "mode=lora", "lora.rank=2",
            f"lora.targets=[{','.join(LORA.targets)}]", "data.source=worked_sum", "data.answer_field=solution",
            "data.size=16", "+data.task_args.min_terms=2", "+data.task_args.max_terms=3",
            "+data.task_args.max_value=9", "+data.task_args.form=chain", "template=worked", "steps=3", "batch_size=3",
            "micro_batch_tokens=60",
            "log_every=1",
            "heldout_every=1", "heldout_size=4", "optim.lr=0.01", "optim.eps=1e-3", "eval.every_n_steps=3",
            f"eval.data.source={data}", "eval.template=plain", "eval.grader=integer", "eval.max_new_tokens=3",
            "engine.max_context=256", "engine.memory_budget_bytes=4194304", f"run_dir={run_dir}", *mesh]


class _Lines(logging.Handler):
    """The per-rank load lines rank 0 logs (`rank R read B of T checkpoint bytes ...`)."""

    def __init__(self):
        super().__init__()
        self.lines: list[str] = []
        logger = logging.getLogger("miles_k3.model.weights")
        logger.addHandler(self)
        logger.setLevel(logging.INFO)

    def emit(self, record: logging.LogRecord) -> None:
        if READ_LINE.match(record.getMessage()):
            self.lines.append(record.getMessage())

    def take(self) -> list[str]:
        lines, self.lines = self.lines, []
        return lines


def _logits(cfg, ids: torch.Tensor) -> torch.Tensor:
    """The whole-vocabulary logits of the model `python -m miles_k3.eval` evaluates (this rank's shard, its TP
    group's vocabulary shards gathered)."""
    import torch.distributed as dist

    from miles_k3.eval import eval_model
    from miles_k3.model.ranks import start_ranks

    ctx, device = start_ranks(cfg.model, cfg.parallel, cfg.device)
    model, _ = eval_model(cfg, ctx, device)
    with torch.no_grad():
        logits = model(ids.to(device)).logits.float().cpu()
    if ctx.tp_size == 1:
        return logits
    parts = [torch.empty_like(logits) for _ in range(ctx.tp_size)]
    dist.all_gather(parts, logits, group=ctx.tp_group)
    return torch.cat(parts, dim=-1)


def _vocab_argmax_rank(rank: int) -> bool:
    """tp=2 over two ranks: vocab_argmax of each rank's half of random logits (with ties across and within the
    halves) is torch.argmax of the whole."""
    from miles_k3.parallel.comm import VocabShard
    from miles_k3.parallel.config import ParallelConfig
    from miles_k3.parallel.mesh import init_parallel
    from miles_k3.parallel.vocab import vocab_argmax

    ctx = init_parallel(ParallelConfig(tp=2), DEVICE_TYPE)
    whole = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(0))
    whole[0, 0] = 1.0  # every entry ties: the first
    whole[1, 2, 5] = whole[1, 2, 1] = 9.0  # a tie across the halves: index 1
    whole[2, 4, 6] = whole[2, 4, 7] = 9.0  # a tie within rank 1's half: index 6
    shard = VocabShard(4 * rank, 4 * rank + 4, 8, ctx.tp_group)
    got = vocab_argmax(whole[..., 4 * rank: 4 * rank + 4].to(dist_helpers.test_device(rank)), shard)
    return bool(torch.equal(got.cpu(), whole.argmax(-1)))


def _sharded_rank(rank: int, checkpoint: str, adapter: str, data: str, root: str) -> dict:
    """On each of 2 ranks: eval and LoRA SFT at tp=2 x ep=2 and dp=2 x ep=2, the eval model's logits, the dry run
    at ep=2 (last: it leaves the process group), and rank 0's load lines of each build."""
    from miles_k3 import sft
    from miles_k3.config import compose_config
    from miles_k3.eval import compose_eval, run
    from miles_k3.train import dry_run

    torch.set_num_threads(1)
    lines, out, idle, heldout = _Lines(), {}, [], []
    idle_step, figures = sft._idle_step, sft.heldout_figures
    sft._idle_step = lambda *a, **k: idle.append(1) or idle_step(*a, **k)
    sft.heldout_figures = lambda *a, **k: heldout.append(figures(*a, **k)) or heldout[-1]
    ids = torch.randint(1, 500, (2, 7), generator=torch.Generator().manual_seed(1))
    for name, mesh in MESHES.items():
        cfg = compose_eval(_eval_overrides(Path(checkpoint), Path(adapter), Path(data), Path(root, f"eval_{name}"),
                                           *mesh))
        out[f"eval_{name}"] = run(cfg)
        out[f"eval_{name}_lines"] = lines.take()
        out[f"logits_{name}"] = _logits(cfg, ids)
        lines.take()
        idle.clear()
        heldout.clear()
        result = sft.train_sft(compose_config("sft", _sft_overrides(Path(checkpoint), Path(data),
                                                                    Path(root, f"sft_{name}"), *mesh)))
        out[f"sft_{name}"] = {"losses": result.losses, "evals": result.evals, "idle": len(idle),
                              "heldout": list(heldout)}
        out[f"sft_{name}_lines"] = lines.take()
    out["argmax"] = _vocab_argmax_rank(rank)
    dry_run(compose_config("train", [f"model.path={checkpoint}", "model.dtype=fp32", f"device={DEVICE_TYPE}",
                                     "steps=0", "parallel.ep=2"]))
    out["dry_run_lines"] = lines.take()
    return out


@pytest.fixture(scope="module")
def sharded(checkpoint, tmp_path_factory):
    """(the one-process eval summary, logits and SFT result, every rank's `_sharded_rank`, the root dir)."""
    from miles_k3.config import compose_config
    from miles_k3.eval import compose_eval, eval_model, run
    from miles_k3.sft import train_sft

    root = tmp_path_factory.mktemp("sharded")
    adapter = _adapter(checkpoint, root / "adapter")
    data = root / "problems.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in EVAL_PROBLEMS))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 cores shared: more threads only contend
    try:
        cfg = compose_eval(_eval_overrides(checkpoint, adapter, data, root / "eval_single"))
        single_eval = run(cfg)
        with torch.no_grad():
            ids = torch.randint(1, 500, (2, 7), generator=torch.Generator().manual_seed(1))
            single_logits = eval_model(cfg)[0](ids).logits.float()
        single_sft = train_sft(compose_config("sft", _sft_overrides(checkpoint, data, root / "sft_single")))
    finally:
        torch.set_num_threads(threads)
    ranks = run_ranks(2, _sharded_rank, str(checkpoint), str(adapter), str(data), str(root), timeout_s=900)
    return {"eval": single_eval, "logits": single_logits, "sft": single_sft}, ranks, root


def _records(run_dir: Path) -> list[tuple]:
    rows = [json.loads(x) for x in (run_dir / "results.jsonl").read_text().splitlines()]
    return [(r["id"], r["sample"], r["response"]) for r in rows]


def _close(got: torch.Tensor, want: torch.Tensor, msg: str) -> None:
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL * scale, msg=msg)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", list(MESHES))
def test_eval_on_two_ranks_scores_the_samples_and_logits_of_one_process(sharded, mesh):
    single, ranks, root = sharded
    summary = ranks[0][f"eval_{mesh}"]
    assert ranks[1][f"eval_{mesh}"] is None  # rank 0 grades, writes and returns
    keys = [k for k in single["eval"] if k.startswith(("avg@", "pass@", "maj@", "answer_rate", "num_"))]
    assert keys and {k: summary[k] for k in keys} == {k: single["eval"][k] for k in keys}
    assert _records(root / f"eval_{mesh}") == _records(root / "eval_single")
    for rank, r in enumerate(ranks):
        _close(r[f"logits_{mesh}"], single["logits"], f"{mesh}: rank {rank} logits")


def _peft(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(path / "adapter_model.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("mesh", list(MESHES))
def test_lora_sft_on_two_ranks_trains_the_adapter_of_one_process(sharded, mesh):
    single, ranks, root = sharded
    want = single["sft"]
    for rank, r in enumerate(ranks):  # the global loss on every rank
        assert r[f"sft_{mesh}"]["losses"] == pytest.approx(want.losses, rel=1e-5), f"rank {rank}"
    untimed = {step: {k: v for k, v in m.items() if k != "eval/seconds"} for step, m in want.evals.items()}
    assert sorted(untimed) == [3] and untimed == {step: {k: v for k, v in m.items() if k != "eval/seconds"}
                                                  for step, m in ranks[0][f"sft_{mesh}"]["evals"].items()}
    assert not ranks[1][f"sft_{mesh}"]["evals"]  # rank 0 grades
    # dp=2 x ep=2: replica 1 trained 1 of each step's 3 micro-batches and ran an idle one beside replica 0's second
    assert [r[f"sft_{mesh}"]["idle"] for r in ranks] == ([0, 3] if mesh == "dp2_ep2" else [0, 0])
    assert _records(root / f"sft_{mesh}/eval/step_000003") == _records(root / "sft_single/eval/step_000003")
    rows = {name: [json.loads(x) for x in (root / name / "metrics.jsonl").read_text().splitlines()]
            for name in ("sft_single", f"sft_{mesh}")}
    heldout = {name: [(r["step"], r["sft/heldout_exact"], r["sft/heldout_token"]) for r in got
                      if "sft/heldout_exact" in r] for name, got in rows.items()}
    assert len(heldout["sft_single"]) == 3 and heldout[f"sft_{mesh}"] == heldout["sft_single"]
    for rank, r in enumerate(ranks):  # every rank computed the figures rank 0 logged (a stop is everyone's)
        assert [(f["sft/heldout_exact"], f["sft/heldout_token"]) for f in r[f"sft_{mesh}"]["heldout"]] == \
            [h[1:] for h in heldout["sft_single"]], f"rank {rank}"
    got, expected = _peft(root / f"sft_{mesh}" / "adapter"), _peft(root / "sft_single" / "adapter")
    assert got.keys() == expected.keys()  # the whole adapter, expert keys by global id
    for key, t in expected.items():
        assert got[key].shape == t.shape, key
        assert (got[key] - t).norm() <= TOL * t.norm() + 1e-7, key
    assert any(t.abs().max() > 0 for k, t in expected.items() if "lora_B" in k)  # it trained


def _model_info_loads(checkpoint: Path, mesh: str) -> dict[int, int]:
    from miles_k3.model_info import main as model_info
    figures = model_info([f"model.path={checkpoint}", *MODEL_INFO[mesh]])["per_rank"]
    return {r["rank"]: r["load_bytes"] for r in figures["ranks"]}


def _read_bytes(lines: list[str]) -> tuple[dict[int, int], int]:
    """({rank: bytes read}, the checkpoint's bytes) of rank 0's load lines."""
    parsed = [READ_LINE.match(line) for line in lines]
    totals = {int(m.group(3).replace(",", "")) for m in parsed}
    assert len(totals) == 1, lines
    return {int(m.group(1)): int(m.group(2).replace(",", "")) for m in parsed}, totals.pop()


@pytest.mark.slow
def test_each_rank_of_eval_sft_and_the_dry_run_reads_only_its_slices(sharded, checkpoint):
    from miles_k3.model.weight_files import open_weights

    _, ranks, _ = sharded
    total = open_weights(checkpoint).total_bytes
    builds = {f"{kind}_{mesh}_lines": mesh for kind in ("eval", "sft") for mesh in MESHES}
    builds["dry_run_lines"] = "dp2_ep2"  # steps=0 parallel.ep=2 on 2 ranks: dp 2 x ep 2
    for key, mesh in builds.items():
        assert not ranks[1][key], key  # rank 0 logs a line for every rank
        read, checkpoint_bytes = _read_bytes(ranks[0][key])
        assert checkpoint_bytes == total
        assert read == _model_info_loads(checkpoint, mesh), key
        assert all(b < total for b in read.values()), (key, read, total)
    assert ranks[0]["argmax"] and ranks[1]["argmax"]
