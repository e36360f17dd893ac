"""launcher=ray: the training loop on Ray Train's workers (`miles_k3/ray_launch.py`), on one local Ray cluster of 2
CPUs for the module (the driver is this test process, as `python -m miles_k3.train launcher=ray` is):

* 2 workers (dp=2, gloo), one of them killed by its PID (SIGKILL, after the checkpoint of step 2, inside step 3):
  Ray restarts the group (ray.max_failures=1), which resumes from that checkpoint, and the run ends with the
  adapter, optimizer state and logged rows of the same run on 2 torchrun-style ranks (`run_ranks`: the environment
  torchrun gives its processes), bit for bit; the time from the kill back to the checkpoint is printed. (One Ray
  run serves both claims: its first group trained steps 1-3 and the restarted one steps 3-4, so Ray's workers
  train as torchrun's ranks do and a restart loses nothing; an uninterrupted Ray run beside it cost ~40 s of CI.)
* a cluster without the requested resources (a GPU per worker on 2 CPUs) is refused within ray.start_timeout_s,
  naming the GPUs it lacks;
* a cluster address nobody answers at is refused naming it (ray.init would wait without end);
* without Ray installed, launcher=ray stops with one line holding the install command.
"""
from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from importlib.util import find_spec
from pathlib import Path

import pytest
from dist_helpers import run_ranks
from repo_helpers import REPO as ROOT
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

from miles_k3.config import ConfigFieldError, compose_config
from miles_k3.ray_config import RAY_INSTALL
from miles_k3.ray_launch import launch_on_ray
from miles_k3.train import train

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

STEPS = 4
KILL_AFTER = 2  # the checkpoint of step 2 is published: kill rank 1 inside step 3
RUN_TIMEOUT_S = 300
needs_ray = pytest.mark.skipif(find_spec("ray") is None, reason=f"Ray is not installed ({RAY_INSTALL})")


def _overrides(data: str, run_dir: Path, *extra: str) -> list[str]:
    """test_restart's tiny run (`run_helpers.tiny_run_overrides`) on 2 data-parallel ranks, one CPU thread each."""
    return [*tiny_run_overrides(data, run_dir, STEPS), "threads=1", *extra]


def _ray(data: str, run_dir: Path, *extra: str):
    return compose_config("train", _overrides(data, run_dir, "launcher=ray", "ray.num_workers=2", *extra))


def _torchrun_rank(rank: int, overrides: list[str]) -> None:
    train(compose_config("train", overrides))


# ---- what a run left --------------------------------------------------------------------------------------------
def _final(run_dir: Path) -> dict:
    """The last checkpoint's PEFT adapter and every rank's adapter shard and optimizer state."""
    ckpt = run_dir / f"checkpoints/step_{STEPS:08d}"
    return {"adapter": checkpoint_adapter(run_dir, STEPS), **{f"rank{r}": rank_state(ckpt, r) for r in (0, 1)}}


def _trained(rows: list[dict]) -> list[tuple]:
    return [(r["step"], r["train/loss"], r["train/grad_norm"], r["rollout/reward_mean"]) for r in rows]


def _log(run_dir: Path) -> str:
    path = run_dir / "train.log"
    return path.read_text() if path.exists() else ""


def _groups(run_dir: Path) -> list[dict[int, int]]:
    """The pid of every rank of each worker group that started, in order (rank 0's `ray: worker group` line)."""
    return [{int(r): int(p) for r, p in re.findall(r"rank (\d+) pid (\d+)", m)}
            for m in re.findall(r"ray: worker group of \d+: (.*)", _log(run_dir))]


class _Driver:
    """launch_on_ray in a thread (the test watches the run directory meanwhile): its error, its wall time."""

    def __init__(self, cfg):
        self.error: BaseException | None = None
        self.t0 = time.monotonic()
        self.wall_s: float | None = None
        self.thread = threading.Thread(target=self._run, args=(cfg,), daemon=True)
        self.thread.start()

    def _run(self, cfg) -> None:
        try:
            launch_on_ray(cfg, "", train)
        except BaseException as e:  # noqa: BLE001 - reported by wait()
            self.error = e
        self.wall_s = time.monotonic() - self.t0

    def wait(self) -> float:
        self.thread.join(RUN_TIMEOUT_S)
        assert not self.thread.is_alive(), f"the Ray run still runs after {RUN_TIMEOUT_S} s"
        if self.error is not None:
            raise self.error
        return self.wall_s

    def poll(self, what: str, cond, timeout_s: float = 120.0, every_s: float = 0.005):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = cond()
            if value:
                return value
            assert self.thread.is_alive(), f"the Ray run ended ({self.error!r}) while waiting for {what}"
            time.sleep(every_s)
        pytest.fail(f"timed out waiting for {what}")


# ---- the cluster and the runs -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster():
    """One local Ray cluster of 2 CPUs for the module (no dashboard: nothing here reads it)."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The reference: the run on 2 torchrun-style ranks (T); the data file; the root directory."""
    root = tmp_path_factory.mktemp("ray")
    data = write_sum_data(root / "train.jsonl")
    run_ranks(2, _torchrun_rank, _overrides(data, root / "T"), timeout_s=RUN_TIMEOUT_S)
    return {"root": root, "data": data, "T": root / "T"}


@needs_ray
@pytest.mark.slow
def test_ray_workers_one_killed_mid_run_are_restarted_and_end_as_two_torchrun_ranks_bit_for_bit(cluster, runs):
    b = runs["root"] / "B"
    driver = _Driver(_ray(runs["data"], b, "ray.max_failures=1"))
    driver.poll("the checkpoint of step 2", lambda: latest_checkpoint(b) == f"step_{KILL_AFTER:08d}")
    victim = driver.poll("the first worker group's pids", lambda: _groups(b) and _groups(b)[0][1])
    time.sleep(0.1)  # inside step 3
    assert max(r["step"] for r in metrics_rows(b, partial_ok=True)) == KILL_AFTER, \
        "the kill came too late: step 3 had already ended"
    os.kill(victim, signal.SIGKILL)
    t_kill = time.monotonic()
    driver.poll("the second worker group", lambda: len(_groups(b)) == 2, every_s=0.05)
    t_group = time.monotonic()
    resumed = driver.poll("the restarted group's resume", lambda: resumed_steps(b), every_s=0.05)
    t_resumed = time.monotonic()
    driver.poll("the first step after the resume",
                lambda: [r for r in metrics_rows(b, partial_ok=True) if r["step"] > resumed[0]], every_s=0.05)
    t_step = time.monotonic()
    wall = driver.wait()
    print(f"\nthe Ray run (rank 1 killed in step {KILL_AFTER + 1}) {wall:.1f} s; from the kill: a new worker group "
          f"{t_group - t_kill:.1f} s, resumed from the step-{resumed[0]} checkpoint {t_resumed - t_kill:.1f} s, "
          f"step {resumed[0] + 1} logged {t_step - t_kill:.1f} s")

    groups = _groups(b)
    assert len(groups) == 2 and sorted(groups[0]) == [0, 1] and groups[1][1] != victim  # Ray restarted it, once
    assert resumed in ([KILL_AFTER], [KILL_AFTER + 1]), resumed  # (+1: step 3's checkpoint beat the kill)
    t = runs["T"]
    assert_bitwise_equal(_final(b), _final(t), "final")
    assert _trained(metrics_rows(b)) == _trained(metrics_rows(t))  # every step logged once, as on torchrun
    assert [s for s, *_ in _trained(metrics_rows(b))] == list(range(1, STEPS + 1))
    assert "parallel: rank 0 (dp 0, tp 0, ep 0) of 2 (dp=2 x tp=1, ep=1; gloo)" in _log(b)
    assert any(p.name == ".validate_storage_marker" for p in (b / "ray").iterdir())  # Ray Train's records


@needs_ray
@pytest.mark.slow
def test_a_cluster_without_the_resources_is_refused_within_the_timeout_naming_them(cluster, tmp_path):
    cfg = compose_config("train", _overrides(write_sum_data(tmp_path / "d.jsonl"), tmp_path / "run", "launcher=ray",
                                             "ray.num_workers=2", "ray.gpus_per_worker=1", "device=auto",
                                             "ray.start_timeout_s=2"))
    t0 = time.monotonic()
    with pytest.raises(ConfigFieldError) as e:
        launch_on_ray(cfg, "", train)
    took = time.monotonic() - t0
    assert took < 2 + 20, took
    assert "2 workers x {CPU: 1, GPU: 1} within ray.start_timeout_s=2: it has GPU 0 of the 2 needed" in str(e.value)
    assert not (tmp_path / "run/metrics.jsonl").exists()


def test_launcher_ray_without_ray_installed_is_one_line_with_the_install_command(monkeypatch, tmp_path):
    cfg = compose_config("train", ["launcher=ray", "ray.num_workers=2", "device=cpu", f"run_dir={tmp_path}"])
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(SystemExit) as e:
        launch_on_ray(cfg, "", train)
    message = str(e.value)
    assert message.startswith("miles_k3.train: launcher=ray needs Ray Train") and "\n" not in message
    assert message.endswith(f"install it with {RAY_INSTALL}")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert RAY_INSTALL == "pip install 'miles-k3[ray]'" and "ray" in extras  # the command installs the pinned extra
    assert [d for d in extras["ray"] if re.fullmatch(r"ray\[[a-z,]*train[a-z,]*\]==[\d.]+", d)], extras["ray"]


@needs_ray
def test_a_cluster_address_nobody_answers_is_refused_naming_it(monkeypatch):
    """ray.init would wait for it without end; the driver refuses it within ray.start_timeout_s."""
    import socket

    from miles_k3.ray_launch import check_reachable

    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    t0 = time.monotonic()
    with pytest.raises(ConfigFieldError, match=rf"ray.address: no Ray cluster answers at 127.0.0.1:{port} "
                                              rf"\(ray.address=127.0.0.1:{port}\) within ray.start_timeout_s=5"):
        check_reachable(f"127.0.0.1:{port}", 5.0)
    assert time.monotonic() - t0 < 5
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")  # as `ray job submit` sets it: it wins, as in ray.init
    with pytest.raises(ConfigFieldError, match=rf"127.0.0.1:{port} \(RAY_ADDRESS\)"):
        check_reachable(None, 5.0)
