"""benchmarks/bench_partial.py: the alternating run order, the counted steps (warm-up and the first step of each
continuing call left out, a step logged twice counted once), each run's figures and the pairs' summary on
hand-written rows, and one tiny CPU measurement of two pairs continued by a second call."""
import json

import pytest
from bench_module import load_benchmark

bench = load_benchmark("bench_partial")


def _row(step, seqs=8, tokens=800, step_s=2.0, reward=0.1, **more):
    return {"step": step, "train/num_seqs": seqs, "train/num_tokens": tokens, "perf/step_s": step_s,
            "rollout/reward_mean": reward, "rollout/response_len_mean": tokens / seqs, **more}


def test_pairs_alternate_their_order():
    assert bench.run_order(["sync", "partial"], 3) == [(0, "sync"), (0, "partial"), (1, "partial"), (1, "sync"),
                                                       (2, "sync"), (2, "partial")]


def test_counted_rows_leave_out_the_warmup_and_each_continuing_calls_first_step():
    """Steps 1-6; step 4 logged twice (a call cut after it, resumed from step 3's checkpoint: the second row is the
    one trained); skip 1, the second call began at step 4: steps 2, 3, 5, 6 count. Eval-only rows are not steps."""
    rows = [_row(1), _row(2), _row(3), _row(4, reward=0.9), {"step": 4, "eval/avg@4": 0.5}, _row(4, reward=0.4),
            _row(5), _row(6)]
    kept = bench.counted_rows(rows, 1, [4])
    assert [r["step"] for r in kept] == [2, 3, 5, 6]
    assert [r["step"] for r in bench.counted_rows(rows, 0, [])] == [1, 2, 3, 4, 5, 6]
    assert bench.counted_rows(rows, 0, [])[3]["rollout/reward_mean"] == 0.4


def test_run_figures_by_hand():
    """Three steps: 8 samples each; tokens 800, 1600, 800; seconds 2, 4, 2; tail 0.5, 2.0, 0.5 s; decode 10, 30,
    10 steps of 40, 90, 40 rows. tokens/s = 3200 / 8 = 400; equal samples 12 are reached at the second step (16),
    after 6 s; tail share 3 / 8; mean decode batch 170 / 50 = 3.4; mean phases: step 8/3, rollout (1+3+1)/3."""
    rows = [_row(1, tokens=800, step_s=2.0, reward=0.1), _row(2, tokens=1600, step_s=4.0, reward=0.2),
            _row(3, tokens=800, step_s=2.0, reward=0.3)]
    for r, tail, steps, n, roll in zip(rows, (0.5, 2.0, 0.5), (10, 30, 10), (40, 90, 40), (1.0, 3.0, 1.0)):
        r |= {"perf/rollout_tail_s": tail, "perf/rollout_decode_steps": steps, "perf/rollout_decode_rows": n,
              "perf/rollout_s": roll}
    f = bench.run_figures(rows, 12)
    assert f["trained_tokens_per_s"] == 400.0 and f["trained_samples"] == 24 and f["steps"] == 3
    assert f["time_to_samples_s"] == 6.0
    assert f["tail_share"] == 0.375 and f["decode_batch_mean"] == 3.4
    assert f["breakdown_s"] == {"step": 2.6667, "rollout": 1.6667, "rollout_tail": 1.0}
    assert f["reward_by_samples"] == [[8, 0.1], [16, 0.2], [24, 0.3]] and f["reward_mean"] == 0.2
    assert f["response_len_mean"] == 133.3 and "retracted_mib_max" not in f
    assert "compiling_steps" not in f  # no compile counts logged (the CPU)
    for r, new in zip(rows, (0.0, 14.0, 0.0)):  # the second step (4 s) compiled 14 kernels in its train phase
        r |= {"perf/triton_new_train": new, "perf/triton_new_rollout": 0.0}
    f = bench.run_figures(rows, 12)
    assert f["compiling_steps"] == 1 and f["compiling_seconds"] == 4.0 and f["triton_new"] == 14


def test_pairs_and_their_summary_by_hand():
    """Sync 1,000 tokens/s in every pair (8 samples, 1,000 tokens a 1 s step); partial 1,200 / 1,500 / 1,400 tokens
    a 1 s step with 8 samples: ratios 1.2, 1.5, 1.4, median 1.4; time to the equal 16 samples 2 s each (ratio 1)."""
    pairs = []
    for i, ptok in enumerate((1200, 1500, 1400)):
        runs = {"sync": [_row(s, tokens=1000, step_s=1.0) for s in (2, 3)],
                "partial": [_row(s, tokens=ptok, step_s=1.0, **{"rollout/retracted_mib": 5.0 * s,
                                                                  "rollout/reprefill_tokens": 100 * s})
                            for s in (2, 3)]}
        pairs.append({"pair": i, **bench.pair_figures(runs)})
    assert [p["partial_over_sync_tokens_per_s"] for p in pairs] == [1.2, 1.5, 1.4]
    assert pairs[0]["partial"]["retracted_mib_max"] == 15.0 and pairs[0]["partial"]["reprefill_tokens_per_step"] == 250
    s = bench.summary(pairs, ["sync", "partial"])
    assert s["pairs"] == 3
    assert s["partial_over_sync_tokens_per_s"] == {"median": 1.4, "min": 1.2, "max": 1.5, "values": [1.2, 1.5, 1.4]}
    assert s["sync_over_partial_time_to_samples"]["median"] == 1.0
    assert s["sync_tokens_per_s"] == {"median": 1000.0, "min": 1000.0, "max": 1000.0}
    assert s["partial_tokens_per_s"]["median"] == 1400.0


def test_a_measurement_without_a_counted_step_is_refused():
    with pytest.raises(SystemExit):
        bench.parse_args(["--steps", "1", "--skip-steps", "1"])


@pytest.mark.slow
def test_two_pairs_on_the_cpu_continued_by_a_second_call(tmp_path):
    """k3_nano on the CPU, 2 pairs of 2 steps, then the same command at 3 steps: every run continues from its step-2
    checkpoint, its step 3 is the first of a continuing call and is left out, so each run still counts step 2 only
    (skip 1); the file holds both pairs in alternating order, each with its ratio."""
    work, out = tmp_path / "work", tmp_path / "res.json"
    common = ["--model", "k3_nano", "--device", "cpu", "--repeats", "2", "--work-dir", str(work), "--out", str(out),
              "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "24", "--mean-length", "8",
              "--checkpoint-every", "1", "--engine-gb", "0.05"]
    bench.main([*common, "--steps", "2"])
    first = json.loads(out.read_text())["figures"]
    assert [p["order"] for p in first["pair_figures"]] == [["sync", "partial"], ["partial", "sync"]]
    assert all(p[m]["steps"] == 1 for p in first["pair_figures"] for m in ("sync", "partial"))
    bench.main([*common, "--steps", "3"])
    fig = json.loads(out.read_text())["figures"]
    for p in range(2):
        for m in ("sync", "partial"):
            assert json.loads((work / f"pair{p}_{m}" / "calls.json").read_text()) == [3]
            rows = [json.loads(x) for x in (work / f"pair{p}_{m}" / "metrics.jsonl").read_text().splitlines()]
            assert sorted(r["step"] for r in rows if "train/num_tokens" in r) == [1, 2, 3]
    assert all(p[m]["steps"] == 1 for p in fig["pair_figures"] for m in ("sync", "partial"))
    assert len(fig["summary"]["partial_over_sync_tokens_per_s"]["values"]) == 2
    assert "partial_over_sync_tokens_per_s" in fig["pair_figures"][1]
    assert (tmp_path / "res_curves.png").stat().st_size > 0


def _result(ratios, device, **workload):
    figures = {"model": "k3_m2", "steps": 20, "max_new_tokens": 2048, "mean_length": 250.0, "prompts_per_step": 8,
               "group_size": 8, "skip_steps": 1, "staleness": 1, "policy": "wait", "partial_overrides": [],
               **workload, "pair_figures": []}
    for i, r in enumerate(ratios):
        figures["pair_figures"].append({"pair": i, "order": ["sync", "partial"], "partial_over_sync_tokens_per_s": r,
                                        "sync": {"trained_tokens_per_s": 1000.0},
                                        "partial": {"trained_tokens_per_s": 1000.0 * r}})
    return {"command": f"python bench_partial.py on {device}", "commit": "abc", "date": "2026-12-08",
            "hardware": {"device": device}, "figures": figures}


def test_merged_files_are_one_measurement_of_their_pairs():
    """Two pairs from an H100 session (1.3, 1.6) and one from an H200 session (1.5): three pairs, median 1.5,
    numbered 0-2, each with its source machine."""
    m = bench.merged([_result([1.3, 1.6], "NVIDIA H100"), _result([1.5], "NVIDIA H200")], ["sync", "partial"])
    assert m["repeats"] == 3 and [p["pair"] for p in m["pair_figures"]] == [0, 1, 2]
    assert [p["source"]["device"] for p in m["pair_figures"]] == ["NVIDIA H100", "NVIDIA H100", "NVIDIA H200"]
    assert m["summary"]["partial_over_sync_tokens_per_s"] == {"median": 1.5, "min": 1.3, "max": 1.6,
                                                             "values": [1.3, 1.6, 1.5]}
    assert m["summary"]["sync_tokens_per_s"]["median"] == 1000.0


def test_files_of_another_workload_are_not_merged():
    with pytest.raises(ValueError, match="measured another workload.*max_new_tokens: 1024 vs 2048"):
        bench.merged([_result([1.3], "H100"), _result([1.5], "H100", max_new_tokens=1024)], ["sync", "partial"])


def test_a_run_cut_after_its_checkpoint_continues_from_the_checkpoint(tmp_path, monkeypatch):
    """A call cut at step 13 with its latest checkpoint at step 10: the next call resumes from step 10, so its first
    step is 11 (trained again, graphs captured again): noted in calls.json, and steps 11-13 count once (their last
    rows)."""
    import miles_k3.train

    run_dir = tmp_path / "pair0_sync"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "latest").write_text("step_00000010\n")
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(_row(s, reward=0.9)) + "\n" for s in range(1, 14)))

    def resumed(cfg, raw_yaml):
        with open(run_dir / "metrics.jsonl", "a") as f:
            f.writelines(json.dumps(_row(s, reward=0.5)) + "\n" for s in range(11, 21))

    monkeypatch.setattr(miles_k3.train, "train", resumed)
    args = bench.parse_args(["--steps", "20", "--repeats", "1", "--modes", "sync", "--model", "k3_nano"])
    assert bench._run("sync", args, run_dir, tmp_path / "problems.jsonl")
    assert json.loads((run_dir / "calls.json").read_text()) == [11]
    rows = bench.counted_rows(bench._rows(run_dir), 1, [11])
    assert [r["step"] for r in rows] == [2, 3, 4, 5, 6, 7, 8, 9, 10, *range(12, 21)]
    assert [r["rollout/reward_mean"] for r in rows if r["step"] in (12, 13)] == [0.5, 0.5]
