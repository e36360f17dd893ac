"""The train/rollout on-policy gap with and without rollout routing replay: the same GRPO run three ways (same seed),
then the per-step medians side by side.

    python benchmarks/bench_routing_replay.py --out DIR [--steps 24] [--modes plain,measure,replay]
                                              [-- extra train overrides ...]

Modes: `plain` (no routes: the step-time baseline), `measure` (rollout.return_routed_experts=true: the engine's
routes recorded, the trainer's own top-k compared with them: train/route_mismatch_frac), `replay`
(trainer.routing_replay=true). Each mode is one `python -m miles_k3.train` with its run directory DIR/<mode>; the
default recipe is the quickstart's (the trained k3_nano base) on `--device` with eval off. Printed per mode (medians
over the steps after the first `--skip`): train/rollout_logprob_abs_diff (mean per token) and its _p99,
train/route_mismatch_frac, perf/step_s, perf/rollout_s, perf/train_s, and each mode's step time over plain's.
Pass `data.source=FILE.jsonl data.problem_field=null` after `--` to train on a local file (id / question / answer
rows) instead of the recipe's generated problems.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

MODES = {"plain": [], "measure": ["rollout.return_routed_experts=true"], "replay": ["trainer.routing_replay=true"]}
KEYS = ("train/rollout_logprob_abs_diff", "train/rollout_logprob_abs_diff_p99", "train/route_mismatch_frac",
        "perf/step_s", "perf/rollout_s", "perf/train_s")


def run_mode(mode: str, args, extra: list[str]) -> Path:
    run_dir = Path(args.out) / mode
    cmd = [sys.executable, "-m", "miles_k3.train", f"device={args.device}", f"steps={args.steps}",
           "eval.every_n_steps=0", f"seed={args.seed}", f"rollout.seed={args.seed}", f"run_dir={run_dir}",
           *MODES[mode], *extra]
    print(" ".join(cmd), flush=True)
    with open(Path(args.out) / f"{mode}.log", "w") as log:
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT)
    return run_dir / "metrics.jsonl"


def summarize(path: Path, skip: int) -> dict[str, float]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows = [r for r in rows if "perf/step_s" in r][skip:]
    return {k: statistics.median(r[k] for r in rows) for k in KEYS if all(k in r for r in rows)} | {"steps": len(rows)}


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--skip", type=int, default=2, help="first steps left out of the medians (compiles, captures)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default="plain,measure,replay")
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    modes = args.modes.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"--modes: {bad} not among {list(MODES)}")
    results = {m: summarize(run_mode(m, args, extra), args.skip) for m in modes}
    base = results.get("plain", {}).get("perf/step_s")
    for m, r in results.items():
        if base:
            r["step_s_over_plain"] = r["perf/step_s"] / base
        print(json.dumps({"mode": m, **r}), flush=True)
    (Path(args.out) / "summary.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
