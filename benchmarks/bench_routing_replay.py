"""The train/rollout on-policy gap with and without rollout routing replay: the same GRPO run three ways (same seed),
then the per-step medians side by side.

    python benchmarks/bench_routing_replay.py --out DIR [--steps 24] [--modes plain,measure,replay] [--rounds 1]
                                              [-- extra train overrides ...]

Modes: `plain` (no routes: the step-time baseline), `measure` (rollout.return_routed_experts=true: the engine's
routes recorded, the trainer's own top-k compared with them: train/route_mismatch_frac), `replay`
(trainer.routing_replay=true), `fp32_head` (model.fp32_lm_head=true, no replay: the cost of fp32 logits against
plain), `fp32_res` (model.fp32_residual=true, no replay) and `fp32_res_head` (both flags, no replay); the last three
not with --alternate, whose engine keeps the decode graphs it captured with one setting. Each mode is one
`python -m miles_k3.train` with its run directory DIR/<mode>; the default recipe is the quickstart's (the trained
k3_nano base) on `--device` with eval off. Printed per mode (medians over the steps after the first `--skip`):
train/rollout_logprob_abs_diff (mean per token) and its _p99, train/route_mismatch_frac, perf/step_s,
perf/rollout_s, perf/train_s, step_s_per_1k_tokens (the median of step time per 1,000 trained tokens,
train/num_tokens), and each mode's step time over plain's (step_s_over_plain; per token: per_token_over_plain).
Pass `data.source=FILE.jsonl data.problem_field=null` after `--` to train on a local file (id / question / answer
rows) instead of the recipe's generated problems.

`--rounds R` runs the modes R times, interleaved (plain, replay, plain, replay, ...; run directories DIR/<mode>.<r>),
so that a drift of the machine's speed during the runs falls on every mode alike: the medians pool every round's
steps, and `step_s_over_plain_rounds` lists each round's ratio to that round's plain run.

`--alternate` measures the cost in ONE run instead (one process, one model, one engine, warm kernels and graphs):
the modes take turns step by step in blocks of plain, replay, replay, plain (`schedule`: each block the modes and
then the modes reversed, so that a trend within a block falls on both alike), the adapter training on through all
of them; `--steps` is then the number of blocks, `--skip` the blocks left out (the first compiles every mode's
kernels). Printed per mode as above, plus `step_s_over_plain_blocks`: the median over blocks of each block's
mean step time of the mode over its mean plain step time. The modes' steps see different prompts here, of
different lengths, so the cost to read is `per_token_over_plain`: the median step time per 1,000 trained tokens
(`step_s_per_1k_tokens`, train/num_tokens) over plain's (both printed in every mode), and `blocks_over_plain`: per
block, the mode's step time per trained token and its rollout and train phases over plain's in that block, as the
mean, standard error and median over blocks; `stalled_blocks` and `blocks_over_plain_unstalled`: the same without
the blocks where a step of either mode had a rollout phase over twice the median (a slow step landing on one mode of
a block by the schedule). DIR/alternate holds
the run's metrics (each row with `bench/mode_index`: its mode's place in --modes).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
from pathlib import Path

from record import write_result

MODES = {"plain": [], "measure": ["rollout.return_routed_experts=true"], "replay": ["trainer.routing_replay=true"],
         "fp32_head": ["model.fp32_lm_head=true"], "fp32_res": ["model.fp32_residual=true"],
         "fp32_res_head": ["model.fp32_lm_head=true", "model.fp32_residual=true"]}
STEPWISE = ("plain", "measure", "replay")  # the modes --alternate can switch between steps of one run
TOKENS = "train/num_tokens"  # the loss tokens of a step
KEYS = ("train/rollout_logprob_abs_diff", "train/rollout_logprob_abs_diff_p99", "train/route_mismatch_frac",
        "perf/step_s", "perf/rollout_s", "perf/train_s")
STALL = 2.0  # stalled_blocks: a rollout phase over this times the median one
GRACE_S = 10.0  # seconds a stopped run gets to end on SIGTERM before its process group is killed


def run_mode(mode: str, args, extra: list[str], name: str) -> Path:
    run_dir = Path(args.out) / name
    cmd = [sys.executable, "-m", "miles_k3.train", f"device={args.device}", f"steps={args.steps}",
           "eval.every_n_steps=0", f"seed={args.seed}", f"rollout.seed={args.seed}", f"run_dir={run_dir}",
           *MODES[mode], *extra]
    print(" ".join(cmd), flush=True)
    run_logged(cmd, Path(args.out) / f"{name}.log")
    return run_dir / "metrics.jsonl"


def run_logged(cmd: list[str], log_path: Path, grace_s: float = GRACE_S) -> None:
    """Runs `cmd` to its end, its output into `log_path`, in a process group of its own. If this script is stopped
    (SIGINT, or SIGTERM: `stop_on_sigterm`, as `timeout` sends), the run and whatever it started (Triton's ptxas,
    workers) are stopped with it: SIGTERM to the group, then SIGKILL after `grace_s` (the train loop's own SIGTERM
    handling would first finish its step, which can be minutes of compiling), so that no run is left on the GPU
    to skew the next measurement. A failed run raises CalledProcessError."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait()
        except BaseException:
            stop_group(proc, grace_s)
            raise
    if rc:
        raise subprocess.CalledProcessError(rc, cmd)


def stop_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM to `proc`'s process group; SIGKILL to whatever is left of it once `proc` has ended or `grace_s`
    has passed (what the run started gets no grace of its own)."""
    with contextlib.suppress(ProcessLookupError):  # the group may be gone already
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def stop_on_sigterm() -> None:
    """SIGTERM ends this script as SIGINT does, by an exception, so that `run_logged` and --alternate's run clean up
    on the way out (the default action would end it at once, leaving its run going)."""
    def _exit(signum, _frame):
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, _exit)


def schedule(modes: list[str], blocks: int) -> list[str]:
    """The modes of --alternate's steps: each block the modes, then the modes reversed."""
    return [m for _ in range(blocks) for m in (*modes, *reversed(modes))]


def alternate(args, extra: list[str]) -> tuple[dict[str, dict], list[dict]]:
    """--alternate: one train run whose steps take the modes in turn (`schedule`); returns (the per-mode summary,
    the step rows: metrics + bench/mode, bench/block, bench/routes: whether every sample carried routes)."""
    import dataclasses

    from miles_k3.config import compose_config
    from miles_k3.launch import build_rollouts, build_run
    from miles_k3.parallel.mesh import naming_rank
    from miles_k3.train import one_step

    modes = args.modes.split(",")
    fixed = [m for m in modes if m not in STEPWISE]
    if fixed:
        raise SystemExit(f"--alternate: modes {fixed} change the model (its captured decode graphs), not a step's "
                         f"settings; measure them with --rounds R (separate runs, interleaved); --alternate takes "
                         f"{list(STEPWISE)}")
    base = compose_config("train", [f"device={args.device}", f"steps={args.steps * 2 * len(modes)}",
                                    "eval.every_n_steps=0", f"seed={args.seed}", f"rollout.seed={args.seed}",
                                    f"run_dir={Path(args.out) / 'alternate'}", *extra])
    if base.rollout.return_routed_experts or base.trainer.routing_replay:
        raise SystemExit("--alternate: the modes set rollout.return_routed_experts and trainer.routing_replay; "
                         "leave both out of the overrides")
    cfgs = {m: dataclasses.replace(base, rollout=dataclasses.replace(base.rollout, return_routed_experts=m == "measure"),
                                   trainer=dataclasses.replace(base.trainer, routing_replay=m == "replay"))
            for m in modes}
    order = schedule(modes, args.steps)
    run = build_run(base)
    # each mode's rollout producer (routes or not, as its config says), all drawing from the run's prompt stream
    producers = {m: build_rollouts(cfgs[m], run.engine, run.tokenizer, run.stream, run.reward, run.ctx)[0]
                 for m in modes}
    rows = []
    try:
        with naming_rank(run.ctx):
            for i, mode in enumerate(order):
                run.cfg, run.rollouts = cfgs[mode], producers[mode]
                metrics, samples = one_step(run, i + 1)
                routed = bool(samples) and all(s.routed_experts is not None for s in samples)
                row = metrics | {"bench/mode": mode, "bench/block": i // (2 * len(modes)), "bench/routes": routed}
                run.tracker.log(metrics | {"bench/mode_index": float(modes.index(mode))}, step=i + 1)
                print(json.dumps({"step": i + 1, **{k: row[k] for k in ("bench/mode", *KEYS) if k in row}}),
                      flush=True)
                rows.append(row)
    finally:
        run.cfg = base
        run.close()
    kept = [r for r in rows if r["bench/block"] >= args.skip]
    if not kept:
        raise SystemExit(f"--alternate: --skip {args.skip} leaves none of --steps {args.steps} blocks")
    return compare_blocks(kept, modes), rows


def compare_blocks(rows: list[dict], modes: list[str]) -> dict[str, dict]:
    """Per mode: the medians over its steps in `rows`, and (beside plain) the step time over plain's, pooled and
    paired by block (the median over blocks of mean mode step / mean plain step in that block)."""
    results = {m: summarize([r for r in rows if r["bench/mode"] == m]) for m in modes}
    if "plain" in results:
        blocks = sorted({r["bench/block"] for r in rows})

        def mean_step(m, b):
            return statistics.fmean(r["perf/step_s"] for r in rows if r["bench/mode"] == m and r["bench/block"] == b)

        over_plain(results)
        stalled = stalled_blocks(rows)
        calm = [b for b in blocks if b not in stalled]
        for m, r in results.items():
            r["step_s_over_plain_blocks"] = statistics.median(mean_step(m, b) / mean_step("plain", b) for b in blocks)
            r["blocks_over_plain"] = paired_ratios(rows, m, blocks)
            r["stalled_blocks"] = stalled
            r["blocks_over_plain_unstalled"] = paired_ratios(rows, m, calm) if calm else None
    return results


def stalled_blocks(rows: list[dict]) -> list[int]:
    """The blocks holding a step (of any mode) whose rollout phase took more than STALL times the median rollout
    phase of all `rows`: slow steps that fall on one mode of a block by the schedule and swing its paired ratio (on
    the H200 they fell on the same steps in runs of other settings: the data's, most likely shapes met first
    there, docs/concepts/train-rollout-gap.md)."""
    if not all("perf/rollout_s" in r for r in rows):
        return []
    median = statistics.median(r["perf/rollout_s"] for r in rows)
    return sorted({r["bench/block"] for r in rows if r["perf/rollout_s"] > STALL * median})


def paired_ratios(rows: list[dict], mode: str, blocks: list[int]) -> dict[str, dict]:
    """Per block, `mode` over plain: step time per trained token (the block's summed step time over its summed
    train/num_tokens, when every row has them) and each phase's mean time. Returns, per quantity, the mean, its
    standard error and the median over blocks (the standard error needs two blocks)."""
    def per_block(b, m, key):
        rs = [r for r in rows if r["bench/mode"] == m and r["bench/block"] == b]
        if key == "per_token":
            return sum(r["perf/step_s"] for r in rs) / sum(r[TOKENS] for r in rs)
        return statistics.fmean(r[key] for r in rs)

    keys = [k for k in ("perf/rollout_s", "perf/train_s") if all(k in r for r in rows)]
    if all(r.get(TOKENS) for r in rows):
        keys.insert(0, "per_token")
    out = {}
    for key in keys:
        ratios = [per_block(b, mode, key) / per_block(b, "plain", key) for b in blocks]
        se = statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else None
        out[key] = {"mean": statistics.fmean(ratios), "se": se, "median": statistics.median(ratios)}
    return out


def step_rows(path: Path, skip: int) -> list[dict]:
    """The metrics rows of one run's steps, less the first `skip`."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in rows if "perf/step_s" in r][skip:]


def summarize(rows: list[dict]) -> dict[str, float]:
    out = {k: statistics.median(r[k] for r in rows) for k in KEYS if all(k in r for r in rows)} | {"steps": len(rows)}
    if all(r.get(TOKENS) for r in rows):  # steps differ in length: the time per trained token compares fairly
        out["step_s_per_1k_tokens"] = statistics.median(1000 * r["perf/step_s"] / r[TOKENS] for r in rows)
    return out


def over_plain(results: dict[str, dict]) -> None:
    """Each mode's pooled step time (and time per trained token) over plain's, in place."""
    base = results["plain"]
    for r in results.values():
        r["step_s_over_plain"] = r["perf/step_s"] / base["perf/step_s"]
        if "step_s_per_1k_tokens" in r and "step_s_per_1k_tokens" in base:
            r["per_token_over_plain"] = r["step_s_per_1k_tokens"] / base["step_s_per_1k_tokens"]


def compare(runs: dict[str, list[list[dict]]]) -> dict[str, dict]:
    """Per mode: the medians over every round's steps, and (beside a plain mode) the step time over plain's, pooled
    and per round (round r's median over round r's plain median)."""
    results = {m: summarize([row for rnd in rounds for row in rnd]) for m, rounds in runs.items()}
    if "plain" in results:
        over_plain(results)
        plain = [statistics.median(r["perf/step_s"] for r in rnd) for rnd in runs["plain"]]
        for m, r in results.items():
            if len(plain) > 1:
                r["step_s_over_plain_rounds"] = [statistics.median(x["perf/step_s"] for x in rnd) / p
                                                 for rnd, p in zip(runs[m], plain)]
    return results


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
    ap.add_argument("--rounds", type=int, default=1, help="run the modes this many times, interleaved")
    ap.add_argument("--alternate", action="store_true",
                    help="one run, the modes taking turns step by step (--steps: blocks; --skip: blocks left out)")
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    stop_on_sigterm()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    modes = args.modes.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"--modes: {bad} not among {list(MODES)}")
    if args.rounds < 1:
        ap.error(f"--rounds: {args.rounds}; give 1 or more")
    if args.alternate:
        if args.rounds != 1:
            ap.error("--alternate takes no --rounds (its modes alternate within one run)")
        results, _ = alternate(args, extra)
        for m, r in results.items():
            print(json.dumps({"mode": m, **r}), flush=True)
        (Path(args.out) / "summary.json").write_text(json.dumps(results, indent=2) + "\n")
        write_result("bench_routing_replay", results)
        return
    runs: dict[str, list[list[dict]]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for m in modes:
            name = m if args.rounds == 1 else f"{m}.{r}"
            runs[m].append(step_rows(run_mode(m, args, extra, name), args.skip))
    results = compare(runs)
    for m, r in results.items():
        print(json.dumps({"mode": m, **r}), flush=True)
    (Path(args.out) / "summary.json").write_text(json.dumps(results, indent=2) + "\n")
    write_result("bench_routing_replay", results)


if __name__ == "__main__":
    main()
