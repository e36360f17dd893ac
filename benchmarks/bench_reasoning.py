"""The GPU learning result of `recipe=k3_m2_reasoning`, from its runs' files: held-out accuracy per eval (avg@k with
its standard error), the gain per seed, the RL minutes to +15 points, where a step's time goes, response lengths.

    python benchmarks/bench_reasoning.py RUN_DIR [RUN_DIR ...] [--sft SFT_RUN_DIR ...] [--device NAME] [--out FILE]
                                         [--note TEXT] [--seeds S:R ...] [--prior FILE ...]

Each RUN_DIR is one seed's `python -m miles_k3.train recipe=k3_m2_reasoning ...` run directory (metrics.jsonl; a run
continued over several calls with resume=auto appends to the same file). RL minutes are the sum of the steps'
perf/step_s and the evals' eval/seconds up to that eval (the work itself: a call's start, model build and CUDA-graph
capture are not counted, and are reported apart as `wall_overhead_s` where the train.log shows them). The step-time
breakdown is the median over the run's steps of each perf/ figure (rollout: prefill, decode, of which the tail;
reward; train: forward/backward, optimizer; sync) and their shares of perf/step_s; on CUDA, the steps that added
Triton cache entries (perf/triton_new_*: kernels compiled or tuned in them), their summed time and the entries.
`--sft` adds the bases' SFT figures (tokens/s and step time per log window, and their medians after the first
window, which holds the kernels' compiles; the teacher-forced held-out exact match by step); with two or more,
rebuilds of one base, how close they are (`rebuild_closeness`). Two or more runs (seeds) add the mean gain and its
spread (`seeds`), with each run's `seed` and `rollout_seed` (from RUN_DIR/config.yaml, or `--seeds S:R` per run
where that file did not come back): runs that share a rollout seed drew the same prompts with the same sampling
seeds, so their spread is not a seed's. `--prior FILE` joins the runs and bases of an earlier result file (another
session's; each keeps its `source`), before these. Writes benchmarks/results/bench_reasoning.json (or --out) and,
beside it, <stem>_curves.png (held-out accuracy by RL minutes with its standard error, and the training reward by
step, of every run).
"""
import argparse
import json
import statistics
from pathlib import Path

from record import compile_figures, write_result

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
    seed, rollout_seed = run_seeds(run_dir)
    return {"run_dir": str(run_dir), "seed": seed, "rollout_seed": rollout_seed,
            "metric": key.removeprefix("eval/"), "evals": evals,
            "accuracy_before": base, "accuracy_after": evals[-1]["accuracy"],
            "gain_points": evals[-1]["gain_points"], "best_gain_points": max(e["gain_points"] for e in evals),
            "rl_minutes_to_plus_15": reached, "steps": len(steps),
            "rl_minutes_total": evals[-1]["rl_minutes"] if evals else None,
            "step_time_median_s": breakdown, "step_time_shares": shares,
            "response_len_mean_by_step": [round(x, 1) for x in lengths],
            "truncated_frac_by_step": [r.get("rollout/truncated_frac") for r in steps
                                       if "rollout/truncated_frac" in r],
            "reward_by_step": [[r["step"], round(r["rollout/reward_mean"], 4)] for r in steps
                               if "rollout/reward_mean" in r], **compile_figures(steps)}


def run_seeds(run_dir: Path) -> tuple[int | None, int | None]:
    """The run's `seed` and `rollout.seed` from the config.yaml train writes into its run directory (None, None
    without it). A config without rollout.seed ran before it defaulted to `seed`: the dataclass default, 0."""
    path = run_dir / "config.yaml"
    if not path.is_file():
        return None, None
    import yaml

    cfg = yaml.safe_load(path.read_text()) or {}
    return cfg.get("seed"), (cfg.get("rollout") or {}).get("seed", 0)


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
    rollout_seeds = [r.get("rollout_seed") for r in runs]
    known = [s for s in rollout_seeds if s is not None]
    return {"at_step": last, "gain_points": gains, "mean": round(statistics.mean(gains), 2),
            "sd": round(statistics.stdev(gains), 2), "min": min(gains),
            "reached_plus_15": sum(g >= GOAL_POINTS for g in gains), "rollout_seeds": rollout_seeds,
            "shared_rollout_seed": len(set(known)) < len(known)}


def with_seeds(run: dict, spec: str | None) -> dict:
    """`--seeds S:R` for a run whose config.yaml did not come back (or an earlier file's run that did not record
    them); refused where the run says otherwise."""
    if spec is None:
        return run
    try:
        seed, rollout_seed = (int(x) for x in spec.split(":"))
    except ValueError:
        raise SystemExit(f"--seeds {spec!r}: expected SEED:ROLLOUT_SEED, e.g. 1:1") from None
    for key, value in (("seed", seed), ("rollout_seed", rollout_seed)):
        if run.get(key) not in (None, value):
            raise SystemExit(f"--seeds {spec!r} for {run['run_dir']}: the run says {key}={run[key]}")
    return run | {"seed": seed, "rollout_seed": rollout_seed}


def prior(path: Path) -> tuple[list[dict], list[dict]]:
    """The runs and bases of an earlier result file of this benchmark, each tagged with its source file."""
    record = json.loads(path.read_text())
    if not str(record.get("name", "")).startswith("bench_reasoning"):
        raise SystemExit(f"--prior {path}: not a bench_reasoning result (name {record.get('name')!r})")
    figures = record["figures"]
    tag = {"source": path.name}
    return [r | tag for r in figures["runs"]], [b | tag for b in figures.get("bases", [])]


def plot_curves(runs: list[dict], path: Path) -> None:
    """Held-out accuracy by RL minutes (error bars: its standard error) and training reward by step, every run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc, rew) = plt.subplots(1, 2, figsize=(11, 4))
    for i, r in enumerate(runs):
        label = f"seed {r.get('seed')}/{r.get('rollout_seed')}" + (f" ({r['source']})" if "source" in r else "")
        ev = r["evals"]
        acc.errorbar([e["rl_minutes"] for e in ev], [e["accuracy"] for e in ev],
                     yerr=[e.get("se") or 0.0 for e in ev], marker="o", capsize=3, color=f"C{i}", label=label)
        if r.get("reward_by_step"):
            xs, ys = zip(*r["reward_by_step"])
            rew.plot(xs, ys, color=f"C{i}", label=label)
    acc.set_xlabel("RL minutes (steps + evals)")
    acc.set_ylabel(f"held-out {runs[0]['metric']}")
    rew.set_xlabel("step")
    rew.set_ylabel("rollout/reward_mean")
    acc.legend(fontsize=7)
    rew.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--sft", nargs="*", type=Path, default=[])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--note", default="")
    ap.add_argument("--seeds", nargs="*", default=None, help="SEED:ROLLOUT_SEED per run (--prior files' runs "
                    "first, then each RUN_DIR), for runs whose config.yaml did not come back (one that did must agree)")
    ap.add_argument("--prior", nargs="*", type=Path, default=[], help="earlier bench_reasoning result files whose "
                    "runs and bases join these (before them)")
    ap.add_argument("--device", default=None, help="the GPU the runs ran on, as torch named it there (the files "
                    "may be read on another machine, whose hardware the record's own block describes)")
    args = ap.parse_args()
    earlier = [prior(p) for p in args.prior]
    runs = [r for rs, _ in earlier for r in rs] + [run_figures(r) for r in args.runs]
    if args.seeds is not None and len(args.seeds) != len(runs):
        raise SystemExit(f"--seeds: {len(args.seeds)} given for {len(runs)} runs (the --prior files' first, then "
                         "each RUN_DIR); one SEED:ROLLOUT_SEED each")
    runs = [with_seeds(r, s) for r, s in zip(runs, args.seeds or [None] * len(runs))]
    bases = [b for _, bs in earlier for b in bs] + [sft_figures(s) for s in args.sft]
    figures = {"model": "k3_m2", "recipe": "k3_m2_reasoning", "gpu": args.device, "runs": runs,
               "gain_points": [r["gain_points"] for r in runs],
               "rl_minutes_to_plus_15": [r["rl_minutes_to_plus_15"] for r in runs],
               "bases": bases, "note": args.note}
    if len(runs) > 1:
        figures["seeds"] = seeds_summary(runs)
    if len(bases) > 1:
        figures["rebuild_closeness"] = rebuild_closeness(bases)
    path = write_result("bench_reasoning", figures, out=args.out)
    plot_curves(runs, path.with_name(path.stem + "_curves.png"))
    print(json.dumps({k: figures[k] for k in ("gain_points", "rl_minutes_to_plus_15")}), path)


if __name__ == "__main__":
    main()
