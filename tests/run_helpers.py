"""The tiny two-rank training run that the restart tests kill and resume (torchrun's restarts in test_restart, Ray's in
test_ray_launch), and readers of what a run leaves in its run directory, to compare two runs bit for bit.

Readers that run while the run does (`metrics_rows(..., partial_ok=True)`, `latest_checkpoint`, `resumed_steps`)
take a missing file as "nothing yet" and skip a metrics row still being written; after the run everything must be
there.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file


def write_sum_data(path: Path) -> str:
    """Ten "i + i + ... = ?" problems (1 to 3 terms) as a JSONL data file at `path`; returns its path."""
    rows = [{"id": f"q{i}", "question": " + ".join([str(i)] * (1 + i % 3)) + " = ?", "answer": str(i * (1 + i % 3))}
            for i in range(10)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def tiny_run_overrides(data: str, run_dir: Path, steps: int) -> list[str]:
    """The train overrides of the tiny run: k3_tiny in fp32 on the CPU, no eval, the shipped coin reward (a test
    reward registered in the test's process would not exist in the workers) without dynamic sampling so every step
    trains, 4 prompts x 2 samples in 2 minibatches, a constant lr, a checkpoint every step and resume=auto. The
    ranks (2 data-parallel ones) and threads are the launcher's."""
    return [f"steps={steps}", f"data.source={data}", "data.problem_field=null", f"run_dir={run_dir}",
            "model=k3_tiny", "model.path=null", "model.dtype=fp32", "device=cpu", "eval.every_n_steps=0",
            "reward=coin", "rollout.prompts_per_step=4", "rollout.group_size=2", "rollout.max_new_tokens=8",
            "rollout.template=plain", "rollout.log_samples=2", "rollout.dynamic_sampling=false",
            "engine.max_context=64", "trainer.minibatches=2", "trainer.optim.lr=0.01", "trainer.optim.eps=1e-3",
            "trainer.optim.total_steps=null", "lora.rank=2", "checkpoint_every=1", "keep_checkpoints=10",
            "resume=auto"]


# ---- what a run left ------------------------------------------------------------------------------------------
def metrics_rows(run_dir: Path, partial_ok: bool = False) -> list[dict]:
    """The rows of run_dir/metrics.jsonl. With `partial_ok` (reading a running run): [] before the file exists and a
    line that does not parse (a row being written) is skipped; without it both raise."""
    try:
        text = (run_dir / "metrics.jsonl").read_text()
    except FileNotFoundError:
        if partial_ok:
            return []
        raise
    rows = []
    for line in text.splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if not partial_ok:
                raise
    return rows


def latest_checkpoint(run_dir: Path) -> str | None:
    """The name in run_dir/checkpoints/latest (e.g. "step_00000002"), None before the first checkpoint."""
    try:
        return (run_dir / "checkpoints/latest").read_text().strip()
    except FileNotFoundError:
        return None


def resumed_steps(run_dir: Path) -> list[int]:
    """The steps of train.log's "resumed from ... at step N" lines, in order ([] without a train.log)."""
    path = run_dir / "train.log"
    text = path.read_text() if path.exists() else ""
    return [int(s) for s in re.findall(r"resumed from \S+ at step (\d+)", text)]


def checkpoint_adapter(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """The PEFT adapter tensors of the checkpoint of `step`."""
    return load_file(str(run_dir / f"checkpoints/step_{step:08d}/adapter/adapter_model.safetensors"))


def rank_state(ckpt: Path, rank: int) -> dict:
    """One rank's part of a checkpoint directory: its adapter shard and its optimizer state."""
    own = ckpt / f"rank-{rank:05d}"
    return {"shard": torch.load(own / "adapter_shard.pt", weights_only=True),
            "optimizer": torch.load(own / "optimizer.pt", weights_only=True)}


def assert_bitwise_equal(a, b, where: str) -> None:
    """Nested dicts / lists / tuples of tensors and plain values are equal, tensors bitwise and of one dtype;
    `where` names the first difference (e.g. "rank 1.optimizer.state.0.exp_avg")."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a, key=str) == sorted(b, key=str), where
        for k in a:
            assert_bitwise_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where
