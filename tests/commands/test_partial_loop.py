"""rollout.mode=partial through the whole loop on the shipped quickstart base (k3_nano answers in 2-4 tokens, so
groups finish at different times and some are carried across a push): a run killed with SIGKILL in step 3, after its
step-2 checkpoint, and resumed with resume=auto from step 2 ends with the adapter bytes, the optimizer and scheduler
state and the metrics of the uninterrupted run, with groups in flight in the checkpoint it resumed from; a partial
checkpoint cannot be resumed as sync; a sync one resumes as partial with nothing in flight."""
import json
import subprocess
import sys

import pytest
import torch
from run_helpers import assert_bitwise_equal, rank_state
from safetensors.torch import load_file

from miles_k3.config import compose_config

pytest.importorskip("reasoning_gym")
TIMING = ("perf/", "sync/seconds", "sync/gbps")
# The run killed from inside, at a fixed point: SIGKILL right after step 3's rollouts were collected (the engine's
# queue and the pool moved on in memory, nothing of step 3 trained or written), so the resume is always from step 2.
KILLED_IN_STEP_3 = """
import os, runpy, signal, sys
from miles_k3.trainer.partial import PartialRollouts
collect, calls = PartialRollouts.collect, []
def killed_in_step_3(self, version):
    out = collect(self, version)
    calls.append(version)
    if len(calls) == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return out
PartialRollouts.collect = killed_in_step_3
sys.argv = ["miles_k3.train", *sys.argv[1:]]
runpy.run_module("miles_k3.train", run_name="__main__")
"""


def _overrides(run_dir, *extra):
    # cosine decay over 5 updates, so step 4 (update 4) still has lr > 0 and resuming needs the scheduler's state
    return ["steps=4", f"run_dir={run_dir}", "eval.every_n_steps=0", "data.size=200", "rollout.prompts_per_step=8",
            "checkpoint_every=1", "rollout.mode=partial", "trainer.loss.tis=token_truncate",
            "trainer.optim.total_steps=5", *extra]


def _rows(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


def _adapter(run_dir, step):
    return load_file(str(run_dir / f"checkpoints/step_{step:08d}/adapter/adapter_model.safetensors"))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    from miles_k3.train import train

    run_dir = tmp_path_factory.mktemp("a") / "run"
    train(compose_config("train", _overrides(run_dir)))
    return run_dir


@pytest.mark.slow
def test_kill_9_with_groups_in_flight_then_resume_is_bit_identical(uninterrupted, tmp_path):
    from miles_k3.train import train

    rows = _rows(uninterrupted)
    assert any(r["rollout/groups_carried"] > 0 for r in rows[1:3])  # the resumed-from checkpoint holds groups
    assert any(r["rollout/offpolicy_token_frac"] > 0 for r in rows[2:])  # trained tokens spanning a push
    # the resumed steps train: lr 1e-3 * (1 + cos(pi * k / 5)) / 2 at update k = 3, 4: 3.455e-4, 9.549e-5
    assert [r["train/lr"] for r in rows[2:]] == pytest.approx([3.4549e-4, 9.5492e-5], rel=1e-4)
    a3, a4 = _adapter(uninterrupted, 3), _adapter(uninterrupted, 4)
    assert any(not torch.equal(a3[k], a4[k]) for k in a4)  # the last step moved the adapter
    ckpt = uninterrupted / "checkpoints/step_00000002/rank-00000/rollout.pt"
    state = torch.load(ckpt, weights_only=True)
    assert state["groups"] and state["engine"]["requests"]
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", KILLED_IN_STEP_3, *_overrides(run_dir)], cwd=tmp_path, check=False,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=600)
    assert proc.returncode == -9, proc.stderr.decode()[-3000:]
    assert (run_dir / "checkpoints/latest").read_text().strip() == "step_00000002"
    resumed = train(compose_config("train", _overrides(run_dir, "resume=auto")))
    assert resumed.start_step == 2
    a, b = _adapter(uninterrupted, 4), _adapter(run_dir, 4)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert_bitwise_equal(rank_state(uninterrupted / "checkpoints/step_00000004", 0),
                         rank_state(run_dir / "checkpoints/step_00000004", 0), "step 4's rank 0")
    assert _rows(run_dir) == rows


def test_a_partial_checkpoint_is_not_resumed_as_sync(uninterrupted, tmp_path):
    import shutil

    from miles_k3.train import train
    from miles_k3.trainer.checkpoint import ResumeError

    run_dir = tmp_path / "run"
    shutil.copytree(uninterrupted, run_dir)
    overrides = [o for o in _overrides(run_dir, "resume=auto", "steps=5") if not o.startswith("rollout.mode")]
    with pytest.raises(ResumeError, match="written by a rollout.mode=partial run, with rollouts in flight"):
        train(compose_config("train", overrides))


def test_a_sync_checkpoint_resumes_as_partial_with_nothing_in_flight(tmp_path):
    from miles_k3.train import train

    sync = [o for o in _overrides(tmp_path / "run", "steps=1") if not o.startswith("rollout.mode")]
    train(compose_config("train", sync))
    resumed = train(compose_config("train", _overrides(tmp_path / "run", "steps=2", "resume=auto")))
    assert resumed.start_step == 1 and resumed.summary["last_step"] == 2
    row = _rows(tmp_path / "run")[-1]
    assert row["step"] == 2 and row["rollout/groups_carried"] == 0.0 and row["rollout/staleness_max"] == 0.0


@pytest.mark.slow
def test_refill_keeps_the_pool_full_in_the_real_engine_and_resumes_exactly(tmp_path):
    """rollout.partial.refill on the native engine: every step queues as many groups as finished in its run, so 12
    groups (1.5 x 8) are in flight at each step's end; a run stopped after step 2 and resumed with resume=auto ends
    step 3 with the adapter bytes and metrics of the run that went straight through (the refilled groups, queued
    mid-run, are in the checkpoint's pool)."""
    from miles_k3.train import train

    refill = ("rollout.partial.refill=true", "steps=3")
    train(compose_config("train", _overrides(tmp_path / "a", *refill)))
    rows = _rows(tmp_path / "a")
    assert all(r["rollout/groups_inflight"] == 12.0 for r in rows)
    assert all(r["rollout/groups_refilled"] >= 8.0 for r in rows)  # at least the step's finished groups
    train(compose_config("train", _overrides(tmp_path / "b", "rollout.partial.refill=true", "steps=2")))
    resumed = train(compose_config("train", _overrides(tmp_path / "b", *refill, "resume=auto")))
    assert resumed.start_step == 2
    a, b = _adapter(tmp_path / "a", 3), _adapter(tmp_path / "b", 3)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _rows(tmp_path / "b") == rows
