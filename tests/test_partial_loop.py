"""rollout.mode=partial through the whole loop on the shipped quickstart base (k3_nano answers in 2-4 tokens, so
groups finish at different times and some are carried across a push): a run killed with SIGKILL after its step-2
checkpoint and resumed with resume=auto ends with the adapter bytes and the metrics of the uninterrupted run, with
groups in flight in the checkpoint it resumed from; a partial checkpoint cannot be resumed as sync; a sync one
resumes as partial with nothing in flight."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from miles_k3.config import compose_config

pytest.importorskip("reasoning_gym")
TIMING = ("perf/", "sync/seconds", "sync/gbps")


def _overrides(run_dir, *extra):
    return ["steps=4", f"run_dir={run_dir}", "eval.every_n_steps=0", "data.size=200", "rollout.prompts_per_step=8",
            "checkpoint_every=1", "rollout.mode=partial", "trainer.loss.tis=token_truncate", *extra]


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
    ckpt = uninterrupted / "checkpoints/step_00000002/rank-00000/rollout.pt"
    state = torch.load(ckpt, weights_only=True)
    assert state["groups"] and state["engine"]["requests"]
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "miles_k3.train", *_overrides(run_dir)], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    latest = run_dir / "checkpoints/latest"
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if latest.exists() and latest.read_text().strip() >= "step_00000002":
            break
        time.sleep(0.02)
    assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
    os.kill(proc.pid, signal.SIGKILL)  # mid-step 3 (or mid-write of its checkpoint)
    proc.wait()
    resumed = train(compose_config("train", _overrides(run_dir, "resume=auto")))
    assert resumed.start_step in (2, 3)
    a, b = _adapter(uninterrupted, 4), _adapter(run_dir, 4)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
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
