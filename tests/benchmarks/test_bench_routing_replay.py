"""benchmarks/bench_routing_replay.py's pooling of interleaved rounds, on hand-worked step rows (the runs themselves
are GPU work: the script's GRPO runs)."""
from pathlib import Path

import pytest
from bench_module import load_benchmark

bench = load_benchmark("bench_routing_replay")


def _rows(*steps):
    return [{"perf/step_s": s, "train/rollout_logprob_abs_diff": 0.001 * s} for s in steps]


def test_rounds_pool_steps_and_ratio_per_round():
    # round 0: plain median 1.0, replay 1.1; round 1 (the machine slower): plain 2.0, replay 2.1
    runs = {"plain": [_rows(0.9, 1.0, 1.2), _rows(2.0, 2.0, 1.9)], "replay": [_rows(1.2, 1.1, 1.1), _rows(2.1, 2.2, 2.0)]}
    res = bench.compare(runs)
    assert res["plain"]["perf/step_s"] == pytest.approx(1.55)  # median of 0.9 1.0 1.2 2.0 2.0 1.9: (1.2 + 1.9) / 2
    assert res["replay"]["perf/step_s"] == pytest.approx(1.6)  # of 1.2 1.1 1.1 2.1 2.2 2.0: (1.2 + 2.0) / 2
    assert res["replay"]["steps"] == 6
    assert res["replay"]["step_s_over_plain_rounds"] == pytest.approx([1.1, 2.1 / 2.0])
    assert res["plain"]["step_s_over_plain_rounds"] == pytest.approx([1.0, 1.0])


def test_one_round_has_no_per_round_list(tmp_path):
    (tmp_path / "m.jsonl").write_text('{"perf/step_s": 5}\n{"eval/acc": 1}\n{"perf/step_s": 1}\n{"perf/step_s": 3}\n')
    rows = bench.step_rows(tmp_path / "m.jsonl", skip=1)  # the first step row left out, the eval row skipped
    assert [r["perf/step_s"] for r in rows] == [1, 3]
    res = bench.compare({"plain": [rows], "replay": [_rows(4.0)]})
    assert res["replay"]["step_s_over_plain"] == pytest.approx(2.0) and "step_s_over_plain_rounds" not in res["replay"]


def test_schedule_is_modes_then_reversed_per_block():
    assert bench.schedule(["plain", "replay"], 2) == ["plain", "replay", "replay", "plain"] * 2
    assert bench.schedule(["plain", "measure", "replay"], 1) == ["plain", "measure", "replay", "replay", "measure",
                                                                  "plain"]


def test_compare_blocks_pairs_each_block_with_its_own_plain_steps():
    def row(mode, block, s):
        return {"bench/mode": mode, "bench/block": block, "perf/step_s": s}
    # block 0: plain 1.0, 1.2 (mean 1.1), replay 1.1, 1.3 (1.2); block 1 (slower): plain 2.0, 2.2, replay 2.2, 2.2
    rows = [row("plain", 0, 1.0), row("replay", 0, 1.1), row("replay", 0, 1.3), row("plain", 0, 1.2),
            row("plain", 1, 2.0), row("replay", 1, 2.2), row("replay", 1, 2.2), row("plain", 1, 2.2)]
    res = bench.compare_blocks(rows, ["plain", "replay"])
    assert res["replay"]["step_s_over_plain_blocks"] == pytest.approx((1.2 / 1.1 + 2.2 / 2.1) / 2)
    assert res["replay"]["step_s_over_plain"] == pytest.approx(((1.3 + 2.2) / 2) / ((1.2 + 2.0) / 2))
    assert res["plain"]["step_s_over_plain_blocks"] == pytest.approx(1.0)


def test_alternate_toggles_routes_step_by_step_in_one_run(tmp_path):
    """The tiny K3 on the CPU, one block: the engine returns routes on the replay steps only, and replaying
    steps train on them (the run goes on from the adapter the plain step left)."""
    import argparse
    import json

    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "question": f"{i} + {i} = ?", "answer": str(2 * i)}) + "\n"
                            for i in range(6)))
    args = argparse.Namespace(out=str(tmp_path), steps=1, skip=0, device="cpu", seed=0, modes="plain,replay")
    extra = [f"data.source={data}", "data.problem_field=null", "model=k3_tiny", "model.path=null",
             "model.dtype=fp32", "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=3",
             "rollout.template=plain", "engine.max_context=64", "engine.memory_budget_bytes=2097152",
             "lora.rank=2", "reward=coin"]
    results, rows = bench.alternate(args, extra)
    assert [r["bench/mode"] for r in rows] == ["plain", "replay", "replay", "plain"]
    assert [r["bench/routes"] for r in rows] == [False, True, True, False]
    assert results["plain"]["steps"] == 2 and results["replay"]["steps"] == 2
    logged = [json.loads(x) for x in (tmp_path / "alternate" / "metrics.jsonl").read_text().splitlines()]
    assert [r["bench/mode_index"] for r in logged if "bench/mode_index" in r] == [0, 1, 1, 0]


def test_time_per_trained_token_corrects_for_longer_steps():
    # replay's steps happen to train twice the tokens in twice the time: per token it costs nothing
    plain = [{"perf/step_s": 1.0, "train/num_tokens": 100}, {"perf/step_s": 1.2, "train/num_tokens": 100}]
    replay = [{"perf/step_s": 2.0, "train/num_tokens": 200}, {"perf/step_s": 2.6, "train/num_tokens": 200}]
    res = bench.compare({"plain": [plain], "replay": [replay]})
    assert res["plain"]["step_s_per_1k_tokens"] == pytest.approx(11.0)  # per 1k tokens: 10 s and 12 s
    assert res["replay"]["step_s_per_1k_tokens"] == pytest.approx(11.5)  # 10 and 13
    assert res["replay"]["step_s_over_plain"] == pytest.approx(2.3 / 1.1)
    assert res["replay"]["per_token_over_plain"] == pytest.approx(11.5 / 11.0)


def test_blocks_over_plain_pairs_time_per_token_and_phases_by_block():
    def row(mode, block, s, tokens, rollout):
        return {"bench/mode": mode, "bench/block": block, "perf/step_s": s, "train/num_tokens": tokens,
                "perf/rollout_s": rollout, "perf/train_s": s - rollout}
    # block 0: plain 2 s / 100 tokens, replay 3 s / 120 tokens: per token 0.025 / 0.02 = 1.25; rollout 1.5 / 1.0
    # block 1: plain 4 s / 200 tokens, replay 4.2 s / 200 tokens: 1.05; rollout 1.0 / 1.0; train 3.2 / 3.0
    rows = [row("plain", 0, 1.0, 50, 0.5), row("replay", 0, 1.4, 60, 0.7), row("replay", 0, 1.6, 60, 0.8),
            row("plain", 0, 1.0, 50, 0.5), row("plain", 1, 2.0, 100, 0.5), row("replay", 1, 2.1, 100, 0.5),
            row("replay", 1, 2.1, 100, 0.5), row("plain", 1, 2.0, 100, 0.5)]
    got = bench.compare_blocks(rows, ["plain", "replay"])["replay"]["blocks_over_plain"]
    assert got["per_token"]["mean"] == pytest.approx((1.25 + 1.05) / 2)
    assert got["per_token"]["median"] == pytest.approx(1.15)
    assert got["per_token"]["se"] == pytest.approx(0.1)  # stdev of (1.25, 1.05) is 0.1414, over sqrt(2)
    assert got["perf/rollout_s"]["mean"] == pytest.approx((1.5 + 1.0) / 2)
    assert got["perf/train_s"]["mean"] == pytest.approx((0.75 / 0.5 + 1.6 / 1.5) / 2)


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state, parent pid, ...), or None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return None


def _alive(pid: int) -> bool:
    """True while `pid` runs (a zombie, ended but not yet reaped, counts as ended)."""
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


def test_a_stopped_bench_stops_its_run_and_what_the_run_started(tmp_path):
    """`timeout` stops the bench with SIGTERM: its train run (here a stand-in that ignores SIGTERM, as the train loop
    defers it to the end of a step, and that has started a process of its own, as Triton starts ptxas) must not
    outlive it, or it keeps the GPU busy under the next measurement."""
    import signal
    import subprocess
    import sys
    import time

    pids = tmp_path / "pids"
    run = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
           "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
           f"open({str(pids)!r}, 'w').write(f'{{c.pid}}'); time.sleep(60)")
    script = (f"import importlib.util, sys; sys.path.insert(0, {str(Path(bench.__file__).parent)!r}); "
              f"s = importlib.util.spec_from_file_location('b', {bench.__file__!r}); "
              "b = importlib.util.module_from_spec(s); s.loader.exec_module(b); b.stop_on_sigterm(); "
              f"b.run_logged([sys.executable, '-c', {run!r}], b.Path({str(tmp_path / 'run.log')!r}), grace_s=1.0)")
    bench_proc = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.monotonic() + 30
    while not (pids.exists() and pids.read_text()):
        assert time.monotonic() < deadline and bench_proc.poll() is None, "the stand-in run never started"
        time.sleep(0.05)
    grandchild = int(pids.read_text())
    run_pid = next(int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()
                   and (_stat(int(p.name)) or [None, None])[1] == str(bench_proc.pid))
    assert _alive(run_pid) and _alive(grandchild)
    bench_proc.send_signal(signal.SIGTERM)
    assert bench_proc.wait(timeout=20) == 128 + signal.SIGTERM
    deadline = time.monotonic() + 10
    while (_alive(run_pid) or _alive(grandchild)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(run_pid), "the run outlived the bench"
    assert not _alive(grandchild), "what the run started outlived the bench"


def test_blocks_with_a_stalled_rollout_are_also_paired_without_them():
    def row(mode, block, s, rollout):
        return {"bench/mode": mode, "bench/block": block, "perf/step_s": s, "train/num_tokens": 100,
                "perf/rollout_s": rollout, "perf/train_s": s - rollout}
    # rollouts 0.5 s but block 1's replay step (3.0 s: over 2 x the median 0.5); block 2's plain one 1.2 s
    # per token: block 0 1.1, block 1 (1.0 + 3.5) / (2 x 1.0) = 2.25, block 2 2.0 / (1.0 + 1.7) = 0.7407...
    rows = [row("plain", 0, 1.0, 0.5), row("replay", 0, 1.1, 0.5), row("replay", 0, 1.1, 0.5), row("plain", 0, 1.0, 0.5),
            row("plain", 1, 1.0, 0.5), row("replay", 1, 3.5, 3.0), row("replay", 1, 1.0, 0.5), row("plain", 1, 1.0, 0.5),
            row("plain", 2, 1.7, 1.2), row("replay", 2, 1.0, 0.5), row("replay", 2, 1.0, 0.5), row("plain", 2, 1.0, 0.5)]
    got = bench.compare_blocks(rows, ["plain", "replay"])["replay"]
    assert got["stalled_blocks"] == [1, 2]
    assert got["blocks_over_plain"]["per_token"]["mean"] == pytest.approx((1.1 + 2.25 + 2.0 / 2.7) / 3)
    assert got["blocks_over_plain_unstalled"]["per_token"] == {"mean": pytest.approx(1.1), "se": None,
                                                               "median": pytest.approx(1.1)}


def test_fp32_head_mode_runs_with_its_override_and_only_as_separate_runs(tmp_path, monkeypatch):
    import argparse

    cmds = []
    monkeypatch.setattr(bench, "run_logged", lambda cmd, log_path: cmds.append(cmd))
    args = argparse.Namespace(out=str(tmp_path), steps=3, skip=0, device="cpu", seed=0, modes="plain,fp32_head")
    bench.run_mode("fp32_head", args, ["model=k3_tiny"], "fp32_head.0")
    assert "model.fp32_lm_head=true" in cmds[0] and "trainer.routing_replay=true" not in cmds[0]
    with pytest.raises(SystemExit, match=r"--alternate: modes \['fp32_head'\] change the model"):
        bench.alternate(args, [])
