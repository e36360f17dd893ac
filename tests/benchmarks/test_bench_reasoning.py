"""benchmarks/bench_reasoning.py on hand-written run files: the gain per eval against the first, the RL minutes
(steps' perf/step_s + evals' seconds), the minutes to +15, a step logged twice by a resumed run, the seeds' summary
and how close two rebuilds of a base are."""
import json

import pytest
from bench_module import load_benchmark

bench = load_benchmark("bench_reasoning")


def _write(run_dir, rows):
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def _run(tmp_path, name, accuracies, step_s=6.0, eval_s=12.0):
    """Evals every 10 steps with the given avg@4 accuracies; 10 steps of step_s seconds between them."""
    rows = []
    for i, acc in enumerate(accuracies):
        if i:
            rows += [{"step": 10 * (i - 1) + j, "perf/step_s": step_s, "perf/train_s": step_s / 2,
                      "rollout/response_len_mean": 130.0, "rollout/truncated_frac": 0.0} for j in range(1, 11)]
        rows.append({"step": 10 * i, "eval/avg@4": acc, "eval/avg@4_se": 0.02, "eval/seconds": eval_s})
    return _write(tmp_path / name, rows)


def test_gain_minutes_and_the_step_to_plus_15(tmp_path):
    fig = bench.run_figures(_run(tmp_path, "a", [0.43, 0.575, 0.664]))
    assert [e["gain_points"] for e in fig["evals"]] == [0.0, 14.5, 23.4]
    # minutes: 12 s eval; + 10 x 6 s + 12 s = 84 s; + another 72 s = 156 s
    assert [e["rl_minutes"] for e in fig["evals"]] == [0.2, 1.4, 2.6]
    assert fig["rl_minutes_to_plus_15"] == 2.6  # +14.5 at step 10 is short of +15
    assert fig["step_time_median_s"]["step_s"] == 6.0 and fig["step_time_shares"]["train_s"] == 0.5
    assert fig["steps"] == 20 and "compiling_steps" not in fig  # no compile counts logged (the CPU)


def test_steps_that_compiled_and_their_time(tmp_path):
    """Steps 3 and 7 of ten added 14 and 2 Triton cache entries (train, rollout) and took 9 s and 7 s."""
    rows = [{"step": s, "perf/step_s": {3: 9.0, 7: 7.0}.get(s, 2.0), "perf/triton_new_train": 14.0 if s == 3 else 0.0,
             "perf/triton_new_rollout": 2.0 if s == 7 else 0.0} for s in range(1, 11)]
    rows = [{"step": 0, "eval/avg@4": 0.4, "eval/seconds": 1.0}, *rows,
            {"step": 10, "eval/avg@4": 0.5, "eval/seconds": 1.0}]
    fig = bench.run_figures(_write(tmp_path / "c", rows))
    assert (fig["compiling_steps"], fig["compiling_seconds"], fig["triton_new"]) == (2, 16.0, 16)


def test_a_step_logged_twice_counts_once(tmp_path):
    """A call cut after logging step 11 and resumed from step 10's checkpoint logs step 11 again: once in the sum."""
    rows = [{"step": 0, "eval/avg@4": 0.5, "eval/seconds": 0.0},
            {"step": 11, "perf/step_s": 60.0}, {"step": 11, "perf/step_s": 60.0},
            {"step": 20, "eval/avg@4": 0.6, "eval/seconds": 0.0}]
    fig = bench.run_figures(_write(tmp_path / "r", rows))
    assert fig["evals"][-1]["rl_minutes"] == 1.0 and fig["steps"] == 1


def test_seeds_at_the_last_eval_all_reached(tmp_path):
    runs = [bench.run_figures(_run(tmp_path, f"s{i}", acc)) for i, acc in
            enumerate([[0.4, 0.5, 0.6], [0.4, 0.45, 0.52, 0.7], [0.42, 0.6, 0.58]])]
    s = bench.seeds_summary(runs)
    assert s["at_step"] == 20  # the third eval (step 30) only one seed reached
    assert s["gain_points"] == [20.0, 12.0, 16.0]
    assert s["mean"] == 16.0 and s["sd"] == 4.0 and s["min"] == 12.0 and s["reached_plus_15"] == 2


def test_rebuild_closeness_over_the_steps_both_measured(tmp_path):
    def base(name, held):
        return bench.sft_figures(_write(tmp_path / name, [{"step": s, "sft/heldout_exact": e, "sft/heldout_token": t}
                                                          for s, e, t in held]))
    a = base("a", [(50, 0.0, 0.75), (100, 0.1, 0.82), (150, 0.2, 0.85)])
    b = base("b", [(50, 0.0, 0.76), (100, 0.05, 0.80)])
    c = bench.rebuild_closeness([a, b])
    assert c["steps_compared"] == 2
    assert c["rows"] == [{"step": 50, "token_spread": 0.01, "exact_spread": 0.0},
                         {"step": 100, "token_spread": 0.02, "exact_spread": 0.05}]
    assert c["max_token_spread"] == 0.02 and c["max_exact_spread"] == 0.05


def test_seeds_need_a_common_eval(tmp_path):
    runs = [bench.run_figures(_run(tmp_path, "x", [0.4, 0.5])),
            {"evals": [{"step": 5, "gain_points": 1.0}]}]
    with pytest.raises(ValueError):
        bench.seeds_summary(runs)


def test_seeds_from_the_run_config_and_a_shared_rollout_seed(tmp_path):
    """Runs that share rollout.seed drew the same prompts and sampling seeds: the summary says so. A config written
    before rollout.seed followed seed has no rollout.seed: the dataclass default, 0."""
    a, b = _run(tmp_path, "a", [0.3, 0.5]), _run(tmp_path, "b", [0.3, 0.6])
    (a / "config.yaml").write_text("seed: 1\nrollout:\n  seed: 7\n")
    (b / "config.yaml").write_text("seed: 2\nrollout:\n  group_size: 8\n")
    runs = [bench.run_figures(a), bench.run_figures(b)]
    assert [(r["seed"], r["rollout_seed"]) for r in runs] == [(1, 7), (2, 0)]
    s = bench.seeds_summary(runs)
    assert s["rollout_seeds"] == [7, 0] and s["shared_rollout_seed"] is False
    c = bench.run_figures(_run(tmp_path, "c", [0.3, 0.4]))
    assert (c["seed"], c["rollout_seed"]) == (None, None)  # no config.yaml came back
    s = bench.seeds_summary([runs[1], bench.with_seeds(c, "3:0")])
    assert s["rollout_seeds"] == [0, 0] and s["shared_rollout_seed"] is True


def test_seeds_given_must_agree_with_the_run(tmp_path):
    a = _run(tmp_path, "a", [0.3, 0.5])
    (a / "config.yaml").write_text("seed: 1\nrollout:\n  seed: 1\n")
    run = bench.run_figures(a)
    assert bench.with_seeds(run, "1:1")["rollout_seed"] == 1
    with pytest.raises(SystemExit, match="rollout_seed=1"):
        bench.with_seeds(run, "1:0")
    with pytest.raises(SystemExit, match="SEED:ROLLOUT_SEED"):
        bench.with_seeds(run, "1")


def test_prior_file_runs_and_bases_keep_their_source(tmp_path):
    record = {"name": "bench_reasoning_h100", "figures": {"runs": [{"run_dir": "/r/0", "evals": []}],
                                                          "bases": [{"run_dir": "/b/0"}]}}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(record))
    runs, bases = bench.prior(path)
    assert runs == [{"run_dir": "/r/0", "evals": [], "source": "old.json"}]
    assert bases == [{"run_dir": "/b/0", "source": "old.json"}]
    path.write_text(json.dumps({"name": "bench_partial", "figures": {}}))
    with pytest.raises(SystemExit, match="not a bench_reasoning result"):
        bench.prior(path)


def test_reward_by_step_for_the_curves(tmp_path):
    rows = [{"step": 0, "eval/avg@4": 0.5, "eval/seconds": 1.0},
            {"step": 1, "perf/step_s": 5.0, "rollout/reward_mean": 0.25},
            {"step": 2, "perf/step_s": 5.0, "rollout/reward_mean": 0.375}]
    fig = bench.run_figures(_write(tmp_path / "r", rows))
    assert fig["reward_by_step"] == [[1, 0.25], [2, 0.375]]
    bench.plot_curves([fig], tmp_path / "c.png")
    assert (tmp_path / "c.png").stat().st_size > 1000
