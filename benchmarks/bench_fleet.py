"""The CPU quickstart in rollout.mode=fleet against colocated rollout.mode=partial (the same run: seed 0, the same
steps of the 1,000-step schedule, held-out avg@4 at step 0 and at the end), and what a dead engine costs.

    python benchmarks/bench_fleet.py --steps 200              # both learning runs, then the kill run
    python benchmarks/bench_fleet.py --steps 200 --modes fleet
    python benchmarks/bench_fleet.py --modes --kill_steps 200 --kill_eval --out F   # learning through a dead engine

Each learning run is `python -m miles_k3.train steps=N eval.every_n_steps=N trainer.optim.total_steps=1000
rollout.mode=MODE` in a subprocess (the fleet's run starts a local Ray cluster on this machine: 2 engine actors of
1 CPU each). Trained tokens/s: the loss's tokens (train/num_tokens) summed over the steps, over the steps' own
seconds (perf/step_s: rollouts, train step, push; the evals left out). The kill run (in this process, --kill_steps
steps, no eval): engine 0 SIGKILLs itself while decoding its --kill_call-th call (`trainer.fleet.FAULTS`); it
reports the groups and tokens sampled again, the step the death was seen in against the median step, and how
long Ray took to bring the engine back (its log line). Writes benchmarks/results/quickstart_fleet.json (or --out).
"""
import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

from record import write_result

ROOT = Path(__file__).resolve().parent.parent


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def learning_run(mode: str, steps: int, tmp: Path) -> dict:
    run_dir = tmp / mode
    argv = [sys.executable, "-m", "miles_k3.train", f"steps={steps}", f"eval.every_n_steps={steps}",
            "trainer.optim.total_steps=1000", f"rollout.mode={mode}", f"run_dir={run_dir}"]
    t0 = time.perf_counter()
    subprocess.run(argv, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    rows = _rows(run_dir)
    train = [r for r in rows if "train/num_tokens" in r]
    evals = [r for r in rows if "eval/avg@4" in r]
    tokens, seconds = sum(r["train/num_tokens"] for r in train), sum(r["perf/step_s"] for r in train)
    return {"held_out_avg4": {f"step_{r['step']}": r["eval/avg@4"] for r in evals},
            "gain_points": round(100 * (evals[-1]["eval/avg@4"] - evals[0]["eval/avg@4"]), 1),
            "trained_tokens": tokens, "step_s_sum": round(seconds, 1), "trained_tokens_per_s": round(tokens / seconds, 1),
            "step_s_mean": round(seconds / len(train), 3), "wall_s": round(wall, 1),
            "trained_seqs_per_step_mean": round(sum(r["rollout/groups_kept"] for r in train) * 8 / len(train), 1),
            "offpolicy_token_frac_mean": round(sum(r["rollout/offpolicy_token_frac"] for r in train) / len(train), 3)}


def kill_run(steps: int, call: int, tmp: Path, evaluate: bool = False) -> dict:
    import logging

    from miles_k3.config import compose_config
    from miles_k3.rollout.fleet_actor import Fault
    from miles_k3.train import train
    from miles_k3.trainer import fleet

    lines: list[tuple[float, str]] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append((record.created, record.getMessage()))

    handler = Keep(level=logging.INFO)
    logging.getLogger("miles_k3.rollout").addHandler(handler)
    logging.getLogger("miles_k3.rollout").setLevel(logging.INFO)
    fleet.FAULTS = {0: (Fault("decode", call),)}
    try:
        every = steps if evaluate else 0  # --kill_eval: held-out avg@4 at step 0 and at the end, as a learning run
        train(compose_config("train", [f"steps={steps}", f"eval.every_n_steps={every}", "rollout.mode=fleet",
                                       "trainer.optim.total_steps=1000", f"run_dir={tmp / 'kill'}"]), "")
    finally:
        fleet.FAULTS = {}
        logging.getLogger("miles_k3.rollout").removeHandler(handler)
    rows = _rows(tmp / "kill")
    evals = [r for r in rows if "eval/avg@4" in r]
    rows = [r for r in rows if "train/num_tokens" in r]
    seen = next(r for r in rows if r["rollout/fleet_failovers"] > 0)
    back = [float(m.group(1)) for _, text in lines if (m := re.search(r"is back .* ([0-9.]+) s after it died", text))]
    return {"steps": steps, "killed": f"engine 0, while decoding its call {call}",
            "failovers": sum(r["rollout/fleet_failovers"] for r in rows),
            "requeued_groups": sum(r["rollout/fleet_requeued_groups"] for r in rows),
            "requeued_tokens": sum(r["rollout/fleet_requeued_tokens"] for r in rows),
            "trained_tokens": sum(r["train/num_tokens"] for r in rows),
            "death_seen_at_step": seen["step"], "that_step_s": round(seen["perf/step_s"], 3),
            "median_step_s": round(median(r["perf/step_s"] for r in rows), 3),
            "engine_back_after_s": back[0] if back else None,
            **({"held_out_avg4": {f"step_{r['step']}": r["eval/avg@4"] for r in evals},
                "gain_points": round(100 * (evals[-1]["eval/avg@4"] - evals[0]["eval/avg@4"]), 1)} if evals else {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--kill_steps", type=int, default=30, help="0: no kill run")
    ap.add_argument("--kill_call", type=int, default=20)
    ap.add_argument("--kill_eval", action="store_true", help="the kill run evaluates at step 0 and at its end")
    ap.add_argument("--modes", dest="modes", nargs="*", default=["partial", "fleet"], choices=["partial", "fleet"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    figures: dict = {"model": f"k3_nano (shipped quickstart base), seed 0, {args.steps} steps of the 1,000-step "
                              "cosine schedule; 48 groups in flight, max_staleness 1, policy wait, token TIS",
                     "fleet": "2 engine actors x 1 CPU on a local Ray cluster; the trainer's 1 thread beside them"}
    with tempfile.TemporaryDirectory(prefix="bench_fleet_") as tmp:
        for mode in args.modes:
            figures[mode] = learning_run(mode, args.steps, Path(tmp))
            print(mode, figures[mode], flush=True)
        if args.kill_steps:
            figures["dead_engine"] = kill_run(args.kill_steps, args.kill_call, Path(tmp), args.kill_eval)
            print("dead_engine", figures["dead_engine"], flush=True)
    write_result("bench_fleet", figures, out=args.out or ROOT / "benchmarks" / "results" / "quickstart_fleet.json")


if __name__ == "__main__":
    main()
