"""The GPU learning result of `recipe=k3_m2_reasoning`, from its runs' files: held-out accuracy per eval (avg@k with
its standard error), the gain per seed, the RL minutes to +15 points, where a step's time goes, response lengths.

    python benchmarks/bench_reasoning.py RUN_DIR [RUN_DIR ...] [--sft SFT_RUN_DIR ...] [--device NAME] [--out FILE]
                                         [--note TEXT]

Each RUN_DIR is one seed's `python -m miles_k3.train recipe=k3_m2_reasoning ...` run directory (metrics.jsonl; a run
continued over several calls with resume=auto appends to the same file). RL minutes are the sum of the steps'
perf/step_s and the evals' eval/seconds up to that eval (the work itself: a call's start, model build and CUDA-graph
capture are not counted, and are reported apart as `wall_overhead_s` where the train.log shows them). The step-time
breakdown is the median over the run's steps of each perf/ figure (rollout: prefill, decode, of which the tail;
reward; train: forward/backward, optimizer; sync) and their shares of perf/step_s. `--sft` adds the bases' SFT
figures (tokens/s and step time per log window, and their medians after the first window, which holds the kernels'
compiles; the teacher-forced held-out exact match by step); with two or more, rebuilds of one base, how close they
are (`rebuild_closeness`). Two or more runs (seeds) add the mean gain and its spread (`seeds`). Writes
benchmarks/results/bench_reasoning.json (or --out).
"""
import argparse
import json
import statistics
from pathlib import Path

from record import write_result

STEP_PARTS = ("perf/rollout_s", "perf/rollout_prefill_s", "perf/rollout_decode_s", "perf/rollout_tail_s",
              "perf/train_s", "perf/train_fwd_bwd_s", "perf/optimizer_s", "perf/sync_s", "perf/release_s",
              "perf/resume_s", "perf/step_s")
GOAL_POINTS = 15.0


def read_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    by_key: dict[tuple, dict] = {}
    for r in rows:  # a step logged twice (a call cut after logging it, resumed from an older checkpoint): the last
        kind = "eval" if any(k.startswith("eval/") for k in r) else "step"
        by_key[(r.get("step"), kind)] = by_key.get((r.get("step"), kind), {}) | r
    return [by_key[k] for k in sorted(by_key, key=lambda k: (k[0] or 0, k[1] == "eval"))]  # step N, then its eval


def accuracy_key(rows: list[dict]) -> str:
    return next(k for r in rows for k in r if k.startswith("eval/avg@") and not k.endswith("_se"))


def run_figures(run_dir: Path) -> dict:
    rows = read_rows(run_dir)
    key = accuracy_key(rows)
    evals, elapsed = [], 0.0
    for r in rows:
        elapsed += r.get("perf/step_s", 0.0) + r.get("eval/seconds", 0.0)
        if key in r:
            evals.append({"step": r["step"], "accuracy": r[key], "se": r.get(key + "_se"),
                          "rl_minutes": round(elapsed / 60, 2)})
    base = evals[0]["accuracy"]
    for e in evals:
        e["gain_points"] = round(100 * (e["accuracy"] - base), 2)
    reached = next((e["rl_minutes"] for e in evals if e["gain_points"] >= GOAL_POINTS), None)
    steps = [r for r in rows if "perf/step_s" in r]
    breakdown = {k.removeprefix("perf/"): round(statistics.median(r[k] for r in steps if k in r), 3)
                 for k in STEP_PARTS if any(k in r for r in steps)}
    step_s = breakdown.get("step_s") or 1.0
    shares = {k: round(v / step_s, 3) for k, v in breakdown.items() if k != "step_s"}
    lengths = [r["rollout/response_len_mean"] for r in steps if "rollout/response_len_mean" in r]
    return {"run_dir": str(run_dir), "metric": key.removeprefix("eval/"), "evals": evals,
            "accuracy_before": base, "accuracy_after": evals[-1]["accuracy"],
            "gain_points": evals[-1]["gain_points"], "best_gain_points": max(e["gain_points"] for e in evals),
            "rl_minutes_to_plus_15": reached, "steps": len(steps),
            "rl_minutes_total": evals[-1]["rl_minutes"] if evals else None,
            "step_time_median_s": breakdown, "step_time_shares": shares,
            "response_len_mean_by_step": [round(x, 1) for x in lengths],
            "truncated_frac_by_step": [r.get("rollout/truncated_frac") for r in steps
                                       if "rollout/truncated_frac" in r]}


def sft_figures(run_dir: Path) -> dict:
    rows = read_rows(run_dir)
    held = [{"step": r["step"], "exact": r["sft/heldout_exact"], "token": r["sft/heldout_token"]}
            for r in rows if "sft/heldout_exact" in r]
    windows = [{"step": r["step"], "tokens_per_s": round(r["perf/tokens_per_s"]), "step_s": round(r["perf/step_s"], 3)}
               for r in rows if "perf/tokens_per_s" in r]
    warm = windows[1:] or windows  # the first log window holds the kernels' compiles and the allocator's growth
    return {"run_dir": str(run_dir), "heldout_teacher_forced": held, "log_windows": windows,
            "tokens_per_s_after_first_window": round(statistics.median(w["tokens_per_s"] for w in warm))
            if warm else None,
            "step_s_after_first_window": round(statistics.median(w["step_s"] for w in warm), 3) if warm else None}


def rebuild_closeness(bases: list[dict]) -> dict:
    """How close rebuilds of one base are: at every step all of them measured, the spread (largest minus smallest)
    of their teacher-forced held-out token accuracy and exact share, and the largest spreads."""
    by_step = [{h["step"]: h for h in b["heldout_teacher_forced"]} for b in bases]
    rows = []
    for step in sorted(set.intersection(*(set(d) for d in by_step))):
        token = [d[step]["token"] for d in by_step]
        exact = [d[step]["exact"] for d in by_step]
        rows.append({"step": step, "token_spread": round(max(token) - min(token), 4),
                     "exact_spread": round(max(exact) - min(exact), 4)})
    return {"bases": len(bases), "steps_compared": len(rows),
            "max_token_spread": max((r["token_spread"] for r in rows), default=None),
            "max_exact_spread": max((r["exact_spread"] for r in rows), default=None), "rows": rows}


def seeds_summary(runs: list[dict]) -> dict:
    """Gain over seeds at the last eval step every run has: mean, sample standard deviation, smallest; and how many
    reached +15 points by then."""
    last = max(set.intersection(*({e["step"] for e in r["evals"]} for r in runs)))
    gains = [next(e["gain_points"] for e in r["evals"] if e["step"] == last) for r in runs]
    return {"at_step": last, "gain_points": gains, "mean": round(statistics.mean(gains), 2),
            "sd": round(statistics.stdev(gains), 2), "min": min(gains),
            "reached_plus_15": sum(g >= GOAL_POINTS for g in gains)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--sft", nargs="*", type=Path, default=[])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--note", default="")
    ap.add_argument("--device", default=None, help="the GPU the runs ran on, as torch named it there (the files "
                    "may be read on another machine, whose hardware the record's own block describes)")
    args = ap.parse_args()
    runs = [run_figures(r) for r in args.runs]
    figures = {"model": "k3_m2", "recipe": "k3_m2_reasoning", "gpu": args.device, "runs": runs,
               "gain_points": [r["gain_points"] for r in runs],
               "rl_minutes_to_plus_15": [r["rl_minutes_to_plus_15"] for r in runs],
               "bases": [sft_figures(s) for s in args.sft], "note": args.note}
    if len(runs) > 1:
        figures["seeds"] = seeds_summary(runs)
    if len(args.sft) > 1:
        figures["rebuild_closeness"] = rebuild_closeness(figures["bases"])
    path = write_result("bench_reasoning", figures, out=args.out)
    print(json.dumps({k: figures[k] for k in ("gain_points", "rl_minutes_to_plus_15")}), path)


if __name__ == "__main__":
    main()
