"""Sync vs partial rollouts on a long-tailed workload, in alternating pairs: trained tokens per second, wall time to
the same number of trained samples, reward curves side by side, where each mode's step time goes, peak GPU memory.

    python benchmarks/bench_partial.py [--model k3_m2] [--steps 20] [--repeats 3] [--work-dir DIR]
                                       [--prompts-per-step 8] [--group-size 8] [--max-new-tokens 2048]
                                       [--mean-length 250] [--modes sync,partial] [--out FILE]

The base is random (`model.path=null`), so its next token is close to uniform over the vocabulary: the engine
stops a response at any of V / `--mean-length` token ids (`engine.eos_token_ids`), which makes response lengths
geometric with mean ~`--mean-length` tokens and a long tail up to `--max-new-tokens` (with the defaults, ~87% end
under 512 tokens). The reward is the share of digits in the response text (`digit_share`, registered here), a
signal a LoRA policy can learn.

Runs. `--repeats` pairs, each one run per mode of `--steps` steps of the training loop (`miles_k3.train.train`, eval
off) from the same seed; the pairs alternate their order (sync, partial / partial, sync / ...), so that a drift of
the machine over the measurement falls on both modes. `--work-dir` keeps the runs (DIR/pair<i>_<mode>, each with
`resume=auto` and a checkpoint every `--checkpoint-every` steps): the same command run again skips the finished runs
and continues the unfinished one, so a measurement longer than one sitting is several calls of one command.
Without it the runs live in a temporary directory. `--merge A.json B.json ...` runs nothing: it writes the pairs of
results files measured in separate sessions (on separate machines: each pair's ratio is of one machine) as one.
After every run the results file is rewritten with what has finished.

Counted steps: each run's first `--skip-steps` steps (default 1: on a fresh GPU host fla-core's kernels compile and
the decode graphs are captured in them; seen: a first sync step of 372 s on k3_m2 against ~23 s for the next ones)
and the first step of every later call that continued the run (graphs captured again) are left out. Per run:

  trained_tokens_per_s  sum of train/num_tokens / sum of perf/step_s (every phase of every counted step);
  time_to_samples_s     counted step time summed until the counted trained samples reach the pair's equal share (the
                        smaller of the two runs' totals);
  reward_by_samples     (cumulative trained samples, rollout/reward_mean) per counted step, for the curves;
  breakdown_s           mean seconds per counted step of each phase: rollout (of it: prefill, decode, tail), release,
                        train (of it: forward/backward, optimizer), sync, resume, and the step;
  decode_batch_mean     the engine's decoded rows per decode step (perf/rollout_decode_rows / decode_steps);
  tail_share            the tail's share of the step (perf/rollout_tail_s / perf/step_s);
  response lengths, peak_gb, and for partial the retracted MiB and re-prefilled tokens per step;
  compiling_steps, compiling_seconds, triton_new (CUDA; `record.compile_figures`)  the counted steps that added
                        Triton cache entries (kernels compiled or tuned, seconds each), their summed step time and
                        the entries: a mode whose steps bring new shapes pays it, and a ratio that rests on it says so.
Per pair: partial / sync trained tokens/s and sync / partial time to the equal samples. Summary: the median of the
pairs' ratios, their smallest and largest, and the per-mode medians. `--out` (default benchmarks/results/
bench_partial.json) gets the figures and, beside it, <stem>_curves.png (reward by trained samples, every run).
Partial mode keeps 1.5 x prompts_per_step groups in flight, max_staleness 1, policy wait (`--staleness`, `--policy`;
`--partial-override` for any other field of the partial runs, e.g. rollout.partial.refill=true).
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
from pathlib import Path

import torch
from record import compile_figures, write_result

from miles_k3.evals.rewards import RewardResult, register_reward

# the breakdown: name -> the metric averaged over counted steps (perf/train_s holds the forward/backward and the
# optimizer; perf/rollout_s the engine's prefill and decode, the decode the tail)
PHASES = {"step": "perf/step_s", "rollout": "perf/rollout_s", "rollout_prefill": "perf/rollout_prefill_s",
          "rollout_decode": "perf/rollout_decode_s", "rollout_tail": "perf/rollout_tail_s",
          "release": "perf/release_s", "train": "perf/train_s", "train_fwd_bwd": "perf/train_fwd_bwd_s",
          "optimizer": "perf/optimizer_s", "sync": "perf/sync_s", "resume": "perf/resume_s"}


@register_reward("digit_share")
def _digit_share(cfg):
    def fn(responses, golds):
        return [RewardResult(sum(c.isdigit() for c in r) / max(len(r), 1), False, {}) for r in responses]
    return fn


def run_order(modes: list[str], repeats: int) -> list[tuple[int, str]]:
    """(pair, mode) in the order they run: pair 0 in `modes` order, pair 1 reversed, and so on."""
    return [(p, m) for p in range(repeats) for m in (modes if p % 2 == 0 else modes[::-1])]


def counted_rows(rows: list[dict], skip_steps: int, call_starts: list[int]) -> list[dict]:
    """The trained steps' rows, one per step (a step logged twice: its last row), in step order, without the first
    `skip_steps` steps and the first step of each call that continued the run (`call_starts`)."""
    by_step = {r["step"]: r for r in rows if "train/num_tokens" in r}
    left_out = set(call_starts)
    return [by_step[s] for s in sorted(by_step) if s > skip_steps and s not in left_out]


def _mean(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if key in r]
    return round(sum(vals) / len(vals), 4) if vals else None


def run_figures(rows: list[dict], equal_samples: float) -> dict:
    """One run's figures over its counted rows (module docstring)."""
    tokens = sum(r["train/num_tokens"] for r in rows)
    seconds = sum(r["perf/step_s"] for r in rows)
    done, t, to_equal, curve = 0.0, 0.0, None, []
    for r in rows:
        done, t = done + r["train/num_seqs"], t + r["perf/step_s"]
        curve.append([done, r["rollout/reward_mean"]])
        if to_equal is None and done >= equal_samples:
            to_equal = round(t, 2)
    key = "rollout/trained_len_mean" if "rollout/trained_len_mean" in rows[0] else "rollout/response_len_mean"
    out = {"steps": len(rows), "trained_samples": done, "trained_tokens": tokens, "seconds": round(seconds, 2),
           "trained_tokens_per_s": round(tokens / seconds, 1), "time_to_samples_s": to_equal,
           "response_len_mean": round(sum(r[key] for r in rows) / len(rows), 1),
           "reward_mean": round(sum(r["rollout/reward_mean"] for r in rows) / len(rows), 4),
           "peak_gb": max((r.get("mem/peak_gb", 0.0) for r in rows), default=0.0), "reward_by_samples": curve,
           "breakdown_s": {name: v for name, key in PHASES.items() if (v := _mean(rows, key)) is not None}}
    steps = sum(r.get("perf/rollout_decode_steps", 0) for r in rows)
    if steps and all("perf/rollout_decode_rows" in r for r in rows):
        out["decode_batch_mean"] = round(sum(r["perf/rollout_decode_rows"] for r in rows) / steps, 2)
    if all("perf/rollout_tail_s" in r for r in rows):
        out["tail_share"] = round(sum(r["perf/rollout_tail_s"] for r in rows) / seconds, 4)
    out |= compile_figures(rows)  # CUDA: steps that waited on the compiler
    if "rollout/retracted_mib" in rows[0]:  # partial: what the stop's retract recomputes, and what resident would hold
        out |= {"retracted_mib_max": round(max(r["rollout/retracted_mib"] for r in rows), 1),
                "reprefill_tokens_per_step": round(sum(r["rollout/reprefill_tokens"] for r in rows) / len(rows))}
    return out


def pair_figures(runs: dict[str, list[dict]]) -> dict:
    """One pair's figures: each mode's `run_figures` at the pair's equal samples, and the ratios when both a sync
    and a partial run are there."""
    equal = min(sum(r["train/num_seqs"] for r in rows) for rows in runs.values())
    out = {"equal_samples": equal, **{m: run_figures(rows, equal) for m, rows in runs.items()}}
    if {"sync", "partial"} <= runs.keys():
        s, p = out["sync"], out["partial"]
        out["partial_over_sync_tokens_per_s"] = round(p["trained_tokens_per_s"] / s["trained_tokens_per_s"], 3)
        out["sync_over_partial_time_to_samples"] = round(s["time_to_samples_s"] / p["time_to_samples_s"], 3)
    return out


def summary(pairs: list[dict], modes: list[str]) -> dict:
    """Over the pairs with both modes: the ratios' medians, smallest and largest, and per mode the median and the
    range of trained tokens/s."""
    out: dict = {"pairs": len(pairs)}
    for key in ("partial_over_sync_tokens_per_s", "sync_over_partial_time_to_samples"):
        vals = [p[key] for p in pairs if key in p]
        if vals:
            out[key] = {"median": round(statistics.median(vals), 3), "min": min(vals), "max": max(vals),
                        "values": vals}
    for m in modes:
        vals = [p[m]["trained_tokens_per_s"] for p in pairs if m in p]
        if vals:
            out[f"{m}_tokens_per_s"] = {"median": round(statistics.median(vals), 1), "min": min(vals),
                                        "max": max(vals)}
    return out


def _overrides(mode: str, args, run_dir: Path, data: Path) -> list[str]:
    from miles_k3.model.config import K3Config

    vocab = K3Config.from_name(args.model).vocab_size
    stops = max(1, round(vocab / args.mean_length))
    out = [f"model={args.model}", "model.path=null", f"device={args.device}", f"steps={args.steps}",
           f"run_dir={run_dir}", "resume=auto", f"checkpoint_every={args.checkpoint_every}", f"data.source={data}",
           "data.problem_field=null", "reward.name=digit_share", "eval.every_n_steps=0", "rollout.template=plain",
           "rollout.dynamic_sampling=false", f"rollout.prompts_per_step={args.prompts_per_step}",
           f"rollout.group_size={args.group_size}", f"rollout.max_new_tokens={args.max_new_tokens}",
           f"engine.max_context={args.max_new_tokens + 64}", f"engine.memory_budget_bytes={int(args.engine_gb * 2**30)}",
           "rollout.release_tags=[]", f"engine.eos_token_ids=[{','.join(str(vocab - 1 - i) for i in range(stops))}]",
           "trainer.loss.tis=token_truncate", "trainer.optim.total_steps=null", *args.override]
    if mode == "partial":
        out += ["rollout.mode=partial", f"rollout.partial.max_staleness={args.staleness}",
                f"rollout.partial.policy={args.policy}", *args.partial_override]
    return out


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _last_step(run_dir: Path) -> int:
    return max((r["step"] for r in _rows(run_dir) if "train/num_tokens" in r), default=0)


def _checkpoint_step(run_dir: Path) -> int:
    """The step of the run's latest checkpoint (where resume=auto continues it), 0 without one."""
    latest = run_dir / "checkpoints" / "latest"
    return int(latest.read_text().strip().removeprefix("step_")) if latest.exists() else 0


def _run(mode: str, args, run_dir: Path, data: Path) -> bool:
    """Run (or continue) one run to --steps; whether it got there. The first step of a continuing call (the one
    after the latest checkpoint: steps logged after it are trained again) is noted in run_dir/calls.json and left
    out of the figures."""
    from miles_k3.config import compose_config
    from miles_k3.train import train

    if _last_step(run_dir) >= args.steps:
        return True
    calls, start = run_dir / "calls.json", _checkpoint_step(run_dir)
    if start > 0:
        starts = json.loads(calls.read_text()) if calls.exists() else []
        calls.write_text(json.dumps([*starts, start + 1]))
    train(compose_config("train", _overrides(mode, args, run_dir, data)), "")
    gc.collect()  # the run's model and engine, before the next run builds its own
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return _last_step(run_dir) >= args.steps


def figures_of(root: Path, args, modes: list[str]) -> dict:
    """The figures of every run under `root` that reached --steps: per pair, and the summary."""
    pairs = []
    for p in range(args.repeats):
        runs = {}
        for m in modes:
            run_dir = root / f"pair{p}_{m}"
            rows = _rows(run_dir)
            if _last_step(run_dir) < args.steps:
                continue
            calls = run_dir / "calls.json"
            runs[m] = counted_rows(rows, args.skip_steps, json.loads(calls.read_text()) if calls.exists() else [])
        if runs:
            pairs.append({"pair": p, "order": [m for q, m in run_order(modes, args.repeats) if q == p],
                          **pair_figures(runs)})
    return {"model": args.model, "steps": args.steps, "repeats": args.repeats, "max_new_tokens": args.max_new_tokens,
            "mean_length": args.mean_length, "prompts_per_step": args.prompts_per_step,
            "group_size": args.group_size, "skip_steps": args.skip_steps, "staleness": args.staleness,
            "policy": args.policy, "partial_overrides": args.partial_override, "summary": summary(pairs, modes),
            "pair_figures": pairs}


def merged(results: list[dict], modes: list[str]) -> dict:
    """Several results files' pairs as one measurement: every pair keeps its own figures (a pair's two runs ran on
    one machine, so its ratio stands) and where it came from (the file's command, commit, date and GPU); the
    summary is taken over all of them. The files must measure one workload (the same figures apart from the
    pairs)."""
    same = ("model", "steps", "max_new_tokens", "mean_length", "prompts_per_step", "group_size", "skip_steps",
            "staleness", "policy", "partial_overrides")
    first = results[0]["figures"]
    for r in results[1:]:
        diff = [f"{k}: {r['figures'].get(k)!r} vs {first.get(k)!r}" for k in same if r["figures"].get(k) != first.get(k)]
        if diff:
            raise ValueError(f"--merge: {r.get('command')} measured another workload than {results[0].get('command')} "
                             f"({', '.join(diff)})")
    pairs = []
    for r in results:
        source = {"command": r.get("command"), "commit": r.get("commit"), "date": r.get("date"),
                  "device": (r.get("hardware") or {}).get("device")}
        pairs += [{**p, "pair": len(pairs) + i, "source": source} for i, p in enumerate(r["figures"]["pair_figures"])]
    return {**{k: first.get(k) for k in same}, "repeats": len(pairs), "summary": summary(pairs, modes),
            "pair_figures": pairs}


def plot_curves(figures: dict, path: Path) -> None:
    """Reward by trained samples of every run: sync solid, partial dashed, one colour per pair."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for p in figures["pair_figures"]:
        for m, style in (("sync", "-"), ("partial", "--")):
            if m in p:
                xs, ys = zip(*p[m]["reward_by_samples"])
                ax.plot(xs, ys, style, color=f"C{p['pair']}", label=f"pair {p['pair']} {m}")
    ax.set_xlabel("trained samples (counted steps)")
    ax.set_ylabel("rollout/reward_mean")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _print(figures: dict) -> None:
    for p in figures["pair_figures"]:
        for m in p["order"]:
            if m in p:
                f = p[m]
                print(f"pair {p['pair']} {m:>8}: {f['trained_tokens_per_s']:,.0f} trained tokens/s, "
                      f"{f['trained_samples']:.0f} samples in {f['seconds']:.1f} s, mean response "
                      f"{f['response_len_mean']:.0f} tokens, tail {f.get('tail_share', 0):.0%} of the step, "
                      f"peak {f['peak_gb']:.1f} GB", flush=True)
    ratio = figures["summary"].get("partial_over_sync_tokens_per_s")
    if ratio:
        print(f"partial / sync trained tokens/s over {len(ratio['values'])} pairs: median {ratio['median']:.2f}x "
              f"(min {ratio['min']:.2f}x, max {ratio['max']:.2f}x)", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="k3_m2")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3, help="pairs of runs, their order alternating")
    ap.add_argument("--work-dir", default=None, help="where the runs live; the same command again continues them")
    ap.add_argument("--checkpoint-every", type=int, default=5)
    ap.add_argument("--prompts-per-step", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=2048)
    ap.add_argument("--mean-length", type=float, default=250.0)
    ap.add_argument("--staleness", type=int, default=1)
    ap.add_argument("--policy", default="wait")
    ap.add_argument("--engine-gb", type=float, default=8.0, help="engine.memory_budget_bytes, in GiB")
    ap.add_argument("--modes", default="sync,partial")
    ap.add_argument("--skip-steps", type=int, default=1, help="first steps of each run left out of the figures "
                    "(kernel compilation and graph capture land in them)")
    ap.add_argument("--override", action="append", default=[], help="one more Hydra override (repeatable)")
    ap.add_argument("--partial-override", action="append", default=[],
                    help="one more Hydra override of the partial runs only (repeatable): rollout.partial.refill=true")
    ap.add_argument("--out", default=None, help="results file (default benchmarks/results/bench_partial.json)")
    ap.add_argument("--merge", nargs="+", default=None, metavar="FILE",
                    help="run nothing: the pairs of these results files (one workload, measured in separate calls or "
                    "on separate machines) as one measurement, written to --out")
    args = ap.parse_args(argv)
    if args.steps <= args.skip_steps:
        ap.error(f"--steps ({args.steps}) must exceed --skip-steps ({args.skip_steps}): no step would be counted")
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    modes = args.modes.split(",")
    if args.merge:
        figures = merged([json.loads(Path(f).read_text()) for f in args.merge], modes)
        path = write_result("bench_partial", figures, out=args.out)
        plot_curves(figures, path.with_name(path.stem + "_curves.png"))
        _print(figures)
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.work_dir) if args.work_dir else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        data = root / "problems.jsonl"
        data.write_text("".join(json.dumps({"id": f"q{i}", "question": f"Count to {i}.", "answer": str(i)}) + "\n"
                                for i in range(1000)))
        for p, m in run_order(modes, args.repeats):
            finished = _run(m, args, root / f"pair{p}_{m}", data)
            figures = figures_of(root, args, modes)
            path = write_result("bench_partial", figures, out=args.out)  # after each run: a stopped call keeps them
            if figures["pair_figures"]:
                plot_curves(figures, path.with_name(path.stem + "_curves.png"))
            if not finished:
                print(f"pair {p} {m} stopped before step {args.steps}; run the same command again to continue it"
                      + ("" if args.work_dir else " (with --work-dir, to keep the runs)"), flush=True)
                return
    _print(figures)


if __name__ == "__main__":
    main()
