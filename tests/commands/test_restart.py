"""A rank that dies does not lose the run: the real `torchrun --max-restarts 2` CLI (a subprocess) runs the GRPO loop
on 2 gloo ranks (parallel.dp left to its default, world / tp = 2; CPU) with `resume=auto checkpoint_every=1`, and the test kills rank 1 with SIGKILL
twice, from outside (no fault injection in the project):

1. mid-step: 0.15 s after the checkpoint of step 2 is published, inside step 3 (before its metrics row);
2. between a step's logged row and its published checkpoint (after the first restart's resume): rank 1 dies before,
   while or after writing its checkpoint files, so the step is either published whole or left as a staging
   directory, and rank 0 has already logged its row.

torchrun restarts both ranks each time, every restart resumes from its last complete checkpoint (train.log:
"resumed from"), the rows logged past it are cut, and the run finishes with the adapter of the uninterrupted run
bit for bit: the final PEFT adapter (the last checkpoint's `adapter/`), every rank's adapter shard and optimizer
state, and the logged losses and rewards."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from run_helpers import (
    assert_bitwise_equal,
    checkpoint_adapter,
    latest_checkpoint,
    metrics_rows,
    rank_state,
    resumed_steps,
    tiny_run_overrides,
    write_sum_data,
)

pytestmark = pytest.mark.slow
STEPS = 5
FIRST_KILL_AFTER = 2  # kill 1: inside step 3, once the checkpoint of step 2 is published
RUN_TIMEOUT_S = 150


def _command(data: str, run_dir: Path) -> list[str]:
    """torchrun, 2 ranks on this node (a free rendezvous port: --standalone), 2 restarts; the tiny dp=2 run of
    test_parallel_loop without its eval, rewarded by the shipped coin (a test reward registered here would not
    exist in the workers) so every step trains."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--max-restarts", "2", "--monitor-interval", "0.1",
            "-m", "miles_k3.train", *tiny_run_overrides(data, run_dir, STEPS)]  # parallel.dp: world / tp = 2


def _env() -> dict:
    """1 thread per rank (2 cores); torchrun's INFO log (its restarts); TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: the
    workers of each attempt get a fresh TCPStore (rank 0's, on a new port). Without it torch 2.13's c10d rendezvous
    hands every attempt the agent's one store, which still holds the previous attempt's gloo addresses
    (default_pg/...): a restarted rank may read a dead peer's address and fail "Gloo connectFullMesh failed ...
    Connection refused" (pytorch/pytorch#135712; the static rendezvous has the same race)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "MASTER_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")}
    return env | {"OMP_NUM_THREADS": "1", "LOGLEVEL": "INFO", "PYTHONUNBUFFERED": "1",
                  "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def _start(data: str, run_dir: Path, log_dir: Path) -> tuple[subprocess.Popen, Path]:
    log = log_dir / f"{run_dir.name}.torchrun.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(_command(data, run_dir), cwd=log_dir, env=_env(), stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return proc, log


def _wait(proc: subprocess.Popen, log: Path) -> str:
    try:
        rc = proc.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the test's own torchrun and its workers (their own session)
        proc.wait()
        pytest.fail(f"torchrun still running after {RUN_TIMEOUT_S} s:\n{log.read_text()[-6000:]}")
    text = log.read_text()
    assert rc == 0, f"torchrun exited {rc}:\n{text[-6000:]}"
    return text


# ---- the run directory, read while it runs -----------------------------------------------------------------
def _published(run_dir: Path) -> set[int]:
    root = run_dir / "checkpoints"
    return {int(p.name[5:]) for p in root.iterdir() if re.fullmatch(r"step_\d+", p.name)} if root.is_dir() else set()


def _logged_steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in metrics_rows(run_dir, partial_ok=True)]


# ---- torchrun's workers ---------------------------------------------------------------------------------------
def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            pass
    return out


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return {}
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def _worker(agent: int, rank: int, attempt: int) -> int | None:
    """The pid of torchrun's worker of global `rank` in restart `attempt` (TORCHELASTIC_RESTART_COUNT), if running."""
    for pid in _children(agent):
        env = _environ(pid)
        if env.get("RANK") == str(rank) and env.get("TORCHELASTIC_RESTART_COUNT") == str(attempt):
            return pid
    return None


def _poll(what: str, cond, proc: subprocess.Popen, log: Path, timeout_s: float = 120.0, every_s: float = 0.002):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        if proc.poll() is not None:
            pytest.fail(f"torchrun exited ({proc.returncode}) while waiting for {what}:\n{log.read_text()[-6000:]}")
        time.sleep(every_s)
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail(f"timed out waiting for {what}:\n{log.read_text()[-6000:]}")


def test_a_rank_killed_mid_step_is_restarted_and_the_run_ends_bitwise_as_the_uninterrupted_one(tmp_path):
    data = write_sum_data(tmp_path / "train.jsonl")
    run_a, run_b = tmp_path / "A", tmp_path / "B"

    t0 = time.monotonic()
    proc, log_a = _start(data, run_a, tmp_path)
    text_a = _wait(proc, log_a)
    t_a = time.monotonic() - t0
    assert "attempts left" not in text_a and resumed_steps(run_a) == []

    t0 = time.monotonic()
    proc, log_b = _start(data, run_b, tmp_path)
    try:
        # kill 1, mid-step: step 3 is running (its checkpoint's predecessor is published, its row not logged)
        _poll("the checkpoint of step 2", lambda: latest_checkpoint(run_b) == f"step_{FIRST_KILL_AFTER:08d}", proc, log_b)
        time.sleep(0.15)
        victim = _poll("rank 1 of the first attempt", lambda: _worker(proc.pid, 1, 0), proc, log_b, every_s=0.01)
        assert max(_published(run_b)) == FIRST_KILL_AFTER and max(_logged_steps(run_b)) == FIRST_KILL_AFTER, \
            "the first kill came too late: step 3 had already ended"
        os.kill(victim, signal.SIGKILL)

        # kill 2, after the restart resumed: a step's row is logged, its checkpoint not yet published
        _poll("the first restart's resume", lambda: len(resumed_steps(run_b)) == 1, proc, log_b, every_s=0.05)
        first_resume = resumed_steps(run_b)[0]
        victim = _poll("rank 1 of the second attempt", lambda: _worker(proc.pid, 1, 1), proc, log_b, every_s=0.01)

        def logged_not_published():
            steps = _logged_steps(run_b)
            last = steps[-1] if steps else 0
            return last if last > first_resume and last < STEPS and latest_checkpoint(run_b) != f"step_{last:08d}" else None
        cut = _poll("a step logged before its checkpoint", logged_not_published, proc, log_b, every_s=0.001)
        os.kill(victim, signal.SIGKILL)
        text_b = _wait(proc, log_b)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    t_b = time.monotonic() - t0
    print(f"\nrun A (uninterrupted) {t_a:.1f} s; run B (2 kills, 2 restarts) {t_b:.1f} s; second kill after step "
          f"{cut} was logged")

    # torchrun restarted the worker group twice; each restart resumed from its last complete checkpoint
    assert text_b.count("will restart worker group") == 2, text_b[-6000:]
    resumes = resumed_steps(run_b)
    assert resumes[0] == FIRST_KILL_AFTER, resumes
    assert len(resumes) == 2 and resumes[1] in (cut - 1, cut), (resumes, cut)  # cut: rank 1 had written its files
    assert "the run was resumed from an earlier checkpoint" not in text_b  # no newer published step was left behind
    assert not [p.name for p in (run_b / "checkpoints").iterdir() if p.name.startswith(".")]  # staging pruned
    _assert_same_rows(run_a, run_b)
    _assert_same_final_state(run_a, run_b, text_a, text_b)


def _assert_same_rows(run_a: Path, run_b: Path) -> None:
    """Every step logged once, in order (the rows logged past a resumed checkpoint were cut), with run A's losses,
    rewards and sample tables."""
    rows_a, rows_b = metrics_rows(run_a), metrics_rows(run_b)
    assert [r["step"] for r in rows_a] == [r["step"] for r in rows_b] == list(range(1, STEPS + 1))
    for a, b in zip(rows_a, rows_b):
        for key in a:
            if key.startswith(("rollout/", "train/")):
                assert a[key] == b[key], (a["step"], key)
    tables_a, tables_b = ([json.loads(line)["step"] for line in (r / "tables/rollout_samples.jsonl").read_text()
                           .splitlines()] for r in (run_a, run_b))
    assert tables_a == tables_b == [s for s in range(1, STEPS + 1) for _ in range(2)]


def _assert_same_final_state(run_a: Path, run_b: Path, text_a: str, text_b: str) -> None:
    """The final adapter (the last checkpoint's PEFT directory) and every rank's state of both runs, bitwise."""
    last_a, last_b = (r / f"checkpoints/step_{STEPS:08d}" for r in (run_a, run_b))
    for run, text in ((run_a, text_a), (run_b, text_b)):
        assert (run / "checkpoints/latest").read_text().strip() == f"step_{STEPS:08d}"
        mesh = json.loads((run / f"checkpoints/step_{STEPS:08d}/mesh.json").read_text())
        assert mesh == {"dp": 2, "tp": 1, "ep": 1, "world": 2}  # dp defaulted to torchrun's world / tp
        summary = re.findall(r"^\s*adapter:\s+(\S+)$", text, re.MULTILINE)  # rank 0's summary, once: the last attempt's
        assert summary == [str(run / f"checkpoints/step_{STEPS:08d}/adapter")], summary
    adapter_a, adapter_b = (checkpoint_adapter(r, STEPS) for r in (run_a, run_b))
    assert sorted(adapter_a) == sorted(adapter_b) and adapter_a
    for name, t in adapter_a.items():
        assert torch.equal(adapter_b[name], t), name
    assert any(t.abs().sum() > 0 for n, t in adapter_a.items() if "lora_B" in n)  # it trained
    for rank in (0, 1):
        assert_bitwise_equal(rank_state(last_a, rank), rank_state(last_b, rank), f"rank {rank}")
    for step in range(FIRST_KILL_AFTER, STEPS + 1):  # every checkpoint B (re)wrote is A's
        a, b = (checkpoint_adapter(r, step) for r in (run_a, run_b))
        assert all(torch.equal(a[n], b[n]) for n in a), step
        assert json.loads((run_a / f"checkpoints/step_{step:08d}/state.json").read_text()) == \
            json.loads((run_b / f"checkpoints/step_{step:08d}/state.json").read_text()), step


def test_restarts_sharing_one_store_end_at_once_saying_why(tmp_path):
    """The same command with --max-restarts 1 and without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (torch 2.13 then hands
    every attempt the agent's one store; it failed "Connection refused" at the first restart and hung over 11
    minutes at the next): rank 1 is killed by SIGKILL as soon as it runs, torchrun restarts the group, and every
    rank refuses before its process group with one line naming the variable, so torchrun gives up within the
    deadline, nothing trained."""
    data = write_sum_data(tmp_path / "train.jsonl")
    run_dir, log = tmp_path / "shared", tmp_path / "shared.torchrun.log"
    command = _command(data, run_dir)
    command[command.index("--max-restarts") + 1] = "1"
    env = {k: v for k, v in _env().items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    t0 = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    killed = None
    while proc.poll() is None and time.monotonic() - t0 < 90:
        if killed is None and (pid := _worker(proc.pid, 1, 0)) is not None:
            os.kill(pid, signal.SIGKILL)
            killed = pid
        time.sleep(0.005)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)  # the test's own torchrun and its workers (their own session)
        proc.wait()
        pytest.fail(f"torchrun still running after 90 s:\n{log.read_text()[-6000:]}")
    text = log.read_text()
    assert proc.returncode != 0 and killed is not None, text[-6000:]
    assert "1/1 attempts left" in text, text[-6000:]  # the kill was answered by a restart
    # the restart refuses (the first rank to, at least: torchrun stops the other as soon as one exits)
    assert re.search(r"miles_k3\.train: rank [01]: torchrun --max-restarts 1 with one rendezvous store shared", text)
    assert "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in text and not (run_dir / "metrics.jsonl").exists()
    print(f"\ntorchrun ended in {time.monotonic() - t0:.1f} s (rc {proc.returncode})")
