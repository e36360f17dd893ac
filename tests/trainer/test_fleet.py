"""rollout.mode=fleet: the rollouts of 2 engine actors on one local Ray cluster of 2 CPUs for the module
(`trainer/fleet.py`, `rollout/fleet.py`, `rollout/fleet_actor.py`), on the quickstart's k3_nano base: 4 prompts x 8
samples a step, 6 groups in the pool (rollout.partial.inflight_groups' default, ceil(1.5 x 4)), max_staleness 1,
policy wait, no dynamic sampling (every finished group is trained), 4 steps.

By hand, the schedule of the uninterrupted run (A): step 1 (adapter version 0) queues groups 0-5, sent as 2 calls
of 3 under version 0, and trains the 4 oldest (0-3); before returning it tops the pool up with groups 6-9 (2 calls
of 2, version 0), which the engines sample while the trainer trains. Step 2 (version 1) trains every group at the
bound: 4-9, all sampled under version 0 (staleness 1), and sends 10-15 under version 1; steps 3 and 4 likewise
train 6 groups one version behind. So groups_kept 4, 6, 6, 6, staleness 0, 1, 1, 1, and group ids 0-21 each
trained once.

Chaos (B: engine 0 SIGKILLs itself while decoding its 2nd call, the call of groups 6-7, and engine 1 while loading
its 3rd adapter version, version 2): the run ends, no group or prompt is trained twice, 2 failovers are counted and
the 2 groups of the lost call were sent again. A run resumed from A's step-2 checkpoint (C) sends the 2 calls that
were in flight there again under version 1 and ends with A's adapter and rows bit for bit; resumed with engine 0
killed while it replays its call (D: 3 groups sent again), it ends with no group trained twice over both runs.
Policy drop and keep follow their own schedules, worked out in their tests. An engine that cannot build its base
(a bad model.path) stops the fleet's start with that error, once; engines the cluster cannot place are refused
within rollout.fleet.start_timeout_s. The config refuses what the fleet cannot use.
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from miles_k3.config import compose_config

pytest.importorskip("reasoning_gym")
pytest.importorskip("ray")
TIMING = ("perf/", "sync/seconds", "sync/gbps")
STEPS = 4


def _overrides(run_dir: Path, *extra: str) -> list[str]:
    return [f"steps={STEPS}", f"run_dir={run_dir}", "eval.every_n_steps=0", "data.size=200",
            "rollout.prompts_per_step=4", "rollout.dynamic_sampling=false", "rollout.mode=fleet",
            "trainer.optim.total_steps=8", "checkpoint_every=1", "keep_checkpoints=10", *extra]


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _trained(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


def _adapter(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run_dir / f"checkpoints/step_{STEPS:08d}/adapter/adapter_model.safetensors"))


def _run(run_dir: Path, *extra: str, faults: dict | None = None) -> list[dict]:
    """The fleet run of `_overrides`; each step's (version, the token versions of each trained group, the (group
    id, draw) of each group trained)."""
    from miles_k3.train import train
    from miles_k3.trainer import fleet

    steps: list[dict] = []
    collect = fleet.FleetRollouts.collect

    def spy(self, version):
        before = len(self.trained)
        samples, metrics = collect(self, version)
        groups: dict[int, set] = {}
        for s in samples:
            groups.setdefault(s.group, set()).update(s.token_versions)
        steps.append({"version": version, "groups": [groups[k] for k in sorted(groups)],
                      "trained": self.trained[before:]})
        return samples, metrics

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fleet.FleetRollouts, "collect", spy)
        mp.setattr(fleet, "FAULTS", faults or {})
        train(compose_config("train", _overrides(run_dir, *extra)), "")
    return steps


def _resume_copy(src: Path, dst: Path, step: int) -> Path:
    """`src`'s run directory up to its checkpoint of `step` (later checkpoints removed); that checkpoint's path."""
    shutil.copytree(src, dst)
    for ckpt in (dst / "checkpoints").glob("step_*"):
        if int(ckpt.name.removeprefix("step_")) > step:
            shutil.rmtree(ckpt)
    return dst / f"checkpoints/step_{step:08d}"


def _ids(steps: list[dict]) -> list[tuple[int, int]]:
    return [t for s in steps for t in s["trained"]]


@pytest.fixture(scope="module")
def cluster():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def uninterrupted(cluster, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("fleet") / "A"
    return run_dir, _run(run_dir)


@pytest.mark.slow
def test_a_fleet_run_trains_each_group_once_under_one_version(uninterrupted):
    run_dir, steps = uninterrupted
    rows = _rows(run_dir)
    assert [r["rollout/groups_kept"] for r in rows] == [4, 6, 6, 6]
    assert [r["rollout/staleness_mean"] for r in rows] == [0, 1, 1, 1]
    assert [r["rollout/offpolicy_token_frac"] for r in rows] == [0, 1, 1, 1]
    assert [r["rollout/groups_inflight"] for r in rows] == [6, 6, 6, 6]  # sampled while the trainer trains
    assert all(r["rollout/fleet_failovers"] == 0 and r["rollout/fleet_engines_up"] == 2 for r in rows)
    # every group sampled under one version: step 1's under 0, then each step's under the one before it
    expected = [0, 0, 1, 2]
    for s, v in zip(steps, expected):
        assert s["groups"] == [{v}] * len(s["groups"]), s
    assert [g for g, _ in _ids(steps)] == list(range(22))
    assert len({d for _, d in _ids(steps)}) == 22
    assert rows[-1]["train/loss"] != 0 and all(r["train/grad_norm"] > 0 for r in rows)


@pytest.mark.slow
def test_engines_killed_while_decoding_and_while_loading_lose_nothing(cluster, tmp_path):
    from miles_k3.rollout.fleet_actor import Fault

    faults = {0: (Fault("decode", 2),), 1: (Fault("load", 3),)}
    steps = _run(tmp_path / "B", faults=faults)
    rows = _rows(tmp_path / "B")
    assert len(rows) == STEPS and [r["step"] for r in rows] == [1, 2, 3, 4]
    ids = _ids(steps)
    assert len({g for g, _ in ids}) == len(ids) and len({d for _, d in ids}) == len(ids)  # nothing trained twice
    assert sum(r["rollout/fleet_failovers"] for r in rows) == 2
    assert rows[1]["rollout/fleet_failovers"] >= 1  # engine 0 died with the call of groups 6-7, seen in step 2
    requeued = sum(r["rollout/fleet_requeued_groups"] for r in rows)
    assert requeued >= 2  # that call's 2 groups (and any call queued behind the load that killed engine 1)
    # requeued tokens are counted when a requeued group finishes: engine 0's 2 groups (seen in step 2) finish in the
    # run, 8 samples of >= 1 token each; groups queued behind engine 1's load may finish after the last step
    assert sum(r["rollout/fleet_requeued_tokens"] for r in rows) >= 2 * 8
    for s in steps:
        assert all(len(g) == 1 and s["version"] - next(iter(g)) in (0, 1) for g in s["groups"]), s


@pytest.mark.slow
def test_policy_drop_requeues_the_groups_past_the_bound(cluster, tmp_path):
    """By hand: step 2 (version 1) trains groups 4-7 only, so 8-9 (version 0) are past the bound at step 3 (version
    2): dropped, their prompts (draws 8, 9) queued again as groups 14-15, which step 4 trains with 16-17."""
    steps = _run(tmp_path / "drop", "rollout.partial.policy=drop")
    rows = _rows(tmp_path / "drop")
    assert [r["rollout/groups_dropped"] for r in rows] == [0, 0, 2, 0]
    assert [r["rollout/groups_kept"] for r in rows] == [4, 4, 4, 4]
    assert [r["rollout/staleness_mean"] for r in rows] == [0, 1, 1, 1]
    assert [s["trained"] for s in steps] == [[(g, g) for g in range(4)], [(g, g) for g in range(4, 8)],
                                             [(g, g) for g in range(10, 14)], [(14, 8), (15, 9), (16, 14), (17, 15)]]


@pytest.mark.slow
def test_policy_keep_trains_past_the_bound(cluster, tmp_path):
    """By hand: from step 3 on, each step trains 2 groups sampled 2 versions back (8-9, then 12-13) and 2 sampled one
    version back: staleness 1.5 on average, half the samples past max_staleness 1."""
    steps = _run(tmp_path / "keep", "rollout.partial.policy=keep")
    rows = _rows(tmp_path / "keep")
    assert [r["rollout/staleness_mean"] for r in rows] == [0, 1, 1.5, 1.5]
    assert [r["rollout/staleness_max"] for r in rows] == [0, 1, 2, 2]
    assert [r["rollout/staleness_frac_over"] for r in rows] == [0, 0, 0.5, 0.5]
    assert [[g for g, _ in s["trained"]] for s in steps] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11],
                                                            [12, 13, 14, 15]]


@pytest.mark.slow
def test_a_resumed_fleet_replays_its_calls_and_continues_exactly(uninterrupted, tmp_path):
    a_dir, _ = uninterrupted
    ckpt = _resume_copy(a_dir, tmp_path / "C", 2)
    state = torch.load(ckpt / "rank-00000/rollout.pt", weights_only=True)
    calls = state["engine"]["calls"]
    assert [c["version"] for c in calls] == [1, 1] and set(state["engine"]["adapters"]) == {1}
    assert [c["gids"] for c in calls] == [[10, 11, 12], [13, 14, 15]]
    steps = _run(tmp_path / "C", f"resume={ckpt}")
    assert [s["version"] for s in steps] == [2, 3]
    a, c = _adapter(a_dir), _adapter(tmp_path / "C")
    assert a.keys() == c.keys() and all(torch.equal(a[k], c[k]) for k in a)
    rows_a, rows_c = _rows(a_dir), _rows(tmp_path / "C")
    push = "rollout/fleet_push_mib"  # step 3 of C puts the saved version 1 again, then its own version 2
    assert rows_c[2][push] == 2 * rows_a[2][push]
    assert _trained([{k: v for k, v in r.items() if k != push} for r in rows_c]) == \
        _trained([{k: v for k, v in r.items() if k != push} for r in rows_a])


@pytest.mark.slow
def test_an_engine_killed_while_a_resumed_run_replays_loses_nothing(uninterrupted, tmp_path):
    from miles_k3.rollout.fleet_actor import Fault

    a_dir, a_steps = uninterrupted
    ckpt = _resume_copy(a_dir, tmp_path / "D", 2)
    steps = _run(tmp_path / "D", f"resume={ckpt}", faults={0: (Fault("decode", 1),)})
    rows = _rows(tmp_path / "D")[2:]
    assert [r["step"] for r in rows] == [3, 4]
    assert sum(r["rollout/fleet_failovers"] for r in rows) == 1
    assert rows[0]["rollout/fleet_requeued_groups"] == 3  # the replayed call of groups 10-12
    ids = _ids(a_steps[:2]) + _ids(steps)
    assert len({g for g, _ in ids}) == len(ids) == 4 + 6 + 6 + 6 and len({d for _, d in ids}) == len(ids)


def test_an_engine_that_cannot_build_its_base_stops_the_start_with_its_error(cluster, tmp_path):
    from miles_k3.model.config import ConfigError
    from miles_k3.trainer.fleet import FleetRollouts

    bad = tmp_path / "no-such-checkpoint"
    cfg = compose_config("train", _overrides(tmp_path / "E"))
    cfg.model.path = str(bad)  # the trainer's own base is fine; the engines' is not there
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=f"model.path={bad}: not a directory"):  # the engine's own error
        FleetRollouts(cfg, lambda version: {}, None, None, None)
    assert time.monotonic() - t0 < 60  # once: a failed build is not restarted
    deadline = time.monotonic() + 30
    while cluster.available_resources().get("CPU") != 2 and time.monotonic() < deadline:
        time.sleep(0.1)  # the engines' CPUs come back as Ray reaps them
    assert cluster.available_resources().get("CPU") == 2  # the engines were stopped


def test_engines_the_cluster_cannot_place_are_refused_within_the_timeout(cluster, tmp_path):
    from miles_k3.trainer.fleet import FleetRollouts

    cfg = compose_config("train", _overrides(tmp_path / "F", "rollout.fleet.cpus_per_engine=3",
                                             "rollout.fleet.start_timeout_s=2"))
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"2 engines x \{CPU: 3, GPU: 0\} did not start within "
                                           r"rollout.fleet.start_timeout_s=2 \(the cluster has \{CPU: 2"):
        FleetRollouts(cfg, lambda version: {}, None, None, None)
    assert time.monotonic() - t0 < 20


# ---- the config's refusals (no Ray cluster) -----------------------------------------------------------------------
BASE = ["eval.every_n_steps=0", "data.size=200", "rollout.mode=fleet"]


def test_fleet_mode_defaults_to_the_partial_correction():
    cfg = compose_config("train", BASE)
    assert (cfg.trainer.loss.tis, cfg.trainer.old_logprobs) == ("token_truncate", "recompute")
    assert (cfg.rollout.fleet.engines, cfg.rollout.partial.groups(cfg.rollout.prompts_per_step)) == (2, 48)


@pytest.mark.parametrize("extra, match", [
    (["env=guess"], "env: guess: rollout.mode=fleet plays single-turn groups"),
    (["parallel.dp=2"], "parallel.dp: parallel.dp x parallel.tp = 2 ranks, and rollout.mode=fleet is driven by one"),
    (["launcher=ray", "ray.num_workers=1"], "launcher: ray runs the loop on Ray Train's workers"),
    (["rollout.return_routed_experts=true"], "rollout.return_routed_experts: rollout.mode=fleet's engines do not"),
    (["trainer.loss.tis=none"], "trainer.loss.tis: rollout.mode=fleet trains tokens sampled under older adapters"),
    (["trainer.old_logprobs=rollout", "trainer.loss.tis=none"], "trainer.old_logprobs: rollout.mode=fleet takes"),
    (["rollout.fleet.engines=0"], "rollout.fleet.engines: must be an integer >= 1, got 0"),
    (["rollout.fleet.cpus_per_engine=0"], "rollout.fleet.cpus_per_engine: must be > 0"),
    (["rollout.mode=sync", "rollout.fleet.engines=3"], "rollout.fleet: rollout.fleet.\\* is set but rollout.mode=sync"),
])
def test_fleet_settings_it_cannot_use_are_refused(extra, match):
    from miles_k3.config import ConfigFieldError

    with pytest.raises(ConfigFieldError, match=match):
        compose_config("train", BASE + extra)


def test_fleet_refuses_other_engines_and_a_missing_ray(monkeypatch):
    from miles_k3 import ray_config

    cfg = compose_config("train", BASE)
    cfg.engine.backend = "sglang"
    with pytest.raises(ValueError, match="engine.backend: rollout.mode=fleet's engines are native ones"):
        ray_config.check_fleet(cfg)
    monkeypatch.setattr(ray_config, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"Ray is not installed; install it with pip install 'miles-k3\[ray\]'"):
        ray_config.check_fleet(cfg)
