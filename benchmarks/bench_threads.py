"""The default job's step time by CPU thread setting, alone and beside a busy process (what a laptop with a browser
open sees): which default stays near the best in both.

    python benchmarks/bench_threads.py [--steps 12] [--repeats 2] [--settings 1,2,2p] [--out FILE]

For each setting (`1`, `2`: `threads=N`; a `p` suffix also sets OMP_WAIT_POLICY=PASSIVE, OpenMP's idle threads
sleeping instead of spinning) and each load (`alone`; `busy`: one process spinning on a core for the whole run),
runs `python -m miles_k3.train steps=N eval.every_n_steps=0 eval.at_start=false` (the quickstart, its evals off) in
a fresh process and takes the median perf/step_s of its steps after the first two (warm-up). Settings and loads
alternate in rounds (`--repeats`), so a drift in the machine's speed falls on all of them. Prints and records the
median step time per (setting, load), each one's ratio to the best of its load, and the worst such ratio per
setting: the setting whose worst ratio is smallest is the robust default.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from record import write_result

SPIN = "while True:\n    pass\n"


def run_job(setting: str, steps: int) -> float:
    """Median perf/step_s of a quickstart run of `steps` steps under `setting`, its first two steps left out."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    threads = setting.rstrip("p")
    if setting.endswith("p"):
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "miles_k3.train", f"steps={steps}", "eval.every_n_steps=0", "eval.at_start=false",
               f"threads={threads}", f"run_dir={tmp}/run", "checkpoint_every=0", "tracking.logger=none"]
        subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=3600)
        rows = [json.loads(line) for line in Path(f"{tmp}/run/metrics.jsonl").read_text().splitlines()]
    times = [r["perf/step_s"] for r in rows if "perf/step_s" in r][2:]
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--settings", default="1,2,2p")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    settings = args.settings.split(",")
    loads = ("alone", "busy")
    times: dict[tuple[str, str], list[float]] = {(s, load): [] for s in settings for load in loads}
    for _ in range(args.repeats):
        for load in loads:
            spinner = subprocess.Popen([sys.executable, "-c", SPIN]) if load == "busy" else None
            try:
                for s in settings:
                    times[(s, load)].append(run_job(s, args.steps))
                    print(f"threads={s} {load}: {times[(s, load)][-1]:.3f} s/step", flush=True)
            finally:
                if spinner is not None:
                    spinner.kill()
                    spinner.wait()
    median = {k: statistics.median(v) for k, v in times.items()}
    best = {load: min(median[(s, load)] for s in settings) for load in loads}
    rows = [{"setting": s, "load": load, "step_s": round(median[(s, load)], 3),
             "runs": [round(t, 3) for t in times[(s, load)]],
             "vs_best_of_load": round(median[(s, load)] / best[load], 2)} for s in settings for load in loads]
    worst = {s: max(median[(s, load)] / best[load] for load in loads) for s in settings}
    print(json.dumps(rows, indent=1))
    print("worst ratio to the best, per setting:", {s: round(w, 2) for s, w in worst.items()})
    write_result("bench_threads", {"steps": args.steps, "repeats": args.repeats, "cpu_count": os.cpu_count(),
                                   "rows": rows, "worst_ratio": {s: round(w, 2) for s, w in worst.items()},
                                   "robust": min(worst, key=worst.get)}, out=args.out)


if __name__ == "__main__":
    main()
