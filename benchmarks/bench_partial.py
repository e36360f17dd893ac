"""Sync vs partial rollouts on a long-tailed workload: trained tokens per second, wall time to the same number of
trained samples, reward curves side by side, peak GPU memory.

    python benchmarks/bench_partial.py [--model k3_m2] [--steps 30] [--prompts-per-step 8] [--group-size 8]
                                       [--max-new-tokens 2048] [--mean-length 250] [--modes sync,partial]

The base is random (`model.path=null`), so its next token is close to uniform over the vocabulary: the engine
stops a response at any of V / `--mean-length` token ids (`engine.eos_token_ids`), which makes response lengths
geometric with mean ~`--mean-length` tokens and a long tail up to `--max-new-tokens` (with the defaults, ~87% end
under 512 tokens). The reward is the share of digits in the response text (`digit_share`, registered here), a
signal a LoRA policy can learn. Each mode runs `--steps` steps of the training loop (`miles_k3.train.train`, eval
off) from the same seed; the figures come from each run's metrics.jsonl, leaving out each run's first
`--skip-steps` steps (default 1: on a fresh GPU host fla-core's kernels compile and the decode graphs are captured
in them; seen: a first sync step of 372 s on k3_m2 against ~23 s for the next ones):

  trained_tokens_per_s  sum of train/num_tokens / sum of perf/step_s (every phase of every step);
  time_to_samples_s     step time summed until the cumulative trained samples reach the smaller of the two runs'
                        totals (equal samples);
  reward_by_samples     (cumulative trained samples, rollout/reward_mean) per step, for the curves;
  response lengths      mean and p90 of the trained responses, the longest seen;
  peak_gb               the largest mem/peak_gb (CUDA);
  retracted_mib_max     partial: the most MiB of KDA slots and latent pages the requests retracted at a step's stop
                        held (what keeping them resident through the train step would keep allocated, at least);
  reprefill_tokens_per_step  partial: tokens of state recomputed per step for the retracted requests.
Partial mode keeps 1.5 x prompts_per_step groups in flight, max_staleness 1, policy wait (`--staleness`,
`--policy`). The ratio trained_tokens_per_s partial / sync is printed and written to benchmarks/results.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from record import write_result

from miles_k3.evals.rewards import RewardResult, register_reward


@register_reward("digit_share")
def _digit_share(cfg):
    def fn(responses, golds):
        return [RewardResult(sum(c.isdigit() for c in r) / max(len(r), 1), False, {}) for r in responses]
    return fn


def _run(mode: str, args, root: Path) -> dict:
    """One mode's run; its metric rows after the first --skip-steps, and the seconds those took."""
    from miles_k3.config import compose_config
    from miles_k3.model.config import K3Config
    from miles_k3.train import train

    vocab = K3Config.from_name(args.model).vocab_size
    stops = max(1, round(vocab / args.mean_length))
    data = root / "problems.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "question": f"Count to {i}.", "answer": str(i)}) + "\n"
                            for i in range(1000)))
    overrides = [f"model={args.model}", "model.path=null", f"device={args.device}", f"steps={args.steps}",
                 f"run_dir={root / mode}", f"data.source={data}", "data.problem_field=null", "reward.name=digit_share",
                 "eval.every_n_steps=0", "rollout.template=plain", "rollout.dynamic_sampling=false",
                 f"rollout.prompts_per_step={args.prompts_per_step}", f"rollout.group_size={args.group_size}",
                 f"rollout.max_new_tokens={args.max_new_tokens}", f"engine.max_context={args.max_new_tokens + 64}",
                 f"engine.memory_budget_bytes={int(args.engine_gb * 2**30)}", "rollout.release_tags=[]",
                 f"engine.eos_token_ids=[{','.join(str(vocab - 1 - i) for i in range(stops))}]",
                 "trainer.loss.tis=token_truncate", "trainer.optim.total_steps=null", *args.override]
    if mode == "partial":
        overrides += ["rollout.mode=partial", f"rollout.partial.max_staleness={args.staleness}",
                      f"rollout.partial.policy={args.policy}"]
    train(compose_config("train", overrides), "")
    rows = [json.loads(x) for x in (root / mode / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "train/num_tokens" in r]
    return {"rows": rows[args.skip_steps:], "warmup_s": sum(r["perf/step_s"] for r in rows[:args.skip_steps]),
            "stop_ids": stops}


def _figures(rows: list[dict], equal_samples: float) -> dict:
    tokens = sum(r["train/num_tokens"] for r in rows)
    seconds = sum(r["perf/step_s"] for r in rows)
    done, t, to_equal, curve = 0.0, 0.0, None, []
    for r in rows:
        done, t = done + r["train/num_seqs"], t + r["perf/step_s"]
        curve.append([done, r["rollout/reward_mean"]])
        if to_equal is None and done >= equal_samples:
            to_equal = t
    key = "rollout/trained_len_mean" if "rollout/trained_len_mean" in rows[0] else "rollout/response_len_mean"
    resident = {}
    if "rollout/retracted_mib" in rows[0]:  # partial: what the stop's retract recomputes, and what resident would hold
        resident = {"retracted_mib_max": round(max(r["rollout/retracted_mib"] for r in rows), 1),
                    "reprefill_tokens_per_step": round(sum(r["rollout/reprefill_tokens"] for r in rows) / len(rows))}
    return {**resident, "steps": len(rows), "trained_samples": done, "trained_tokens": tokens, "seconds": round(seconds, 2),
            "trained_tokens_per_s": round(tokens / seconds, 1), "time_to_samples_s": to_equal,
            "response_len_mean": round(sum(r[key] for r in rows) / len(rows), 1),
            "peak_gb": max((r.get("mem/peak_gb", 0.0) for r in rows), default=0.0), "reward_by_samples": curve}


def _all_figures(runs: dict, args) -> dict:
    equal = min(sum(r["train/num_seqs"] for r in run["rows"]) for run in runs.values())
    return {"model": args.model, "max_new_tokens": args.max_new_tokens, "mean_length": args.mean_length,
            "skip_steps": args.skip_steps, "stop_ids": next(iter(runs.values()))["stop_ids"], "equal_samples": equal,
            **{m: _figures(run["rows"], equal) | {"warmup_s": round(run["warmup_s"], 1)} for m, run in runs.items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="k3_m2")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--prompts-per-step", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=2048)
    ap.add_argument("--mean-length", type=float, default=250.0)
    ap.add_argument("--staleness", type=int, default=1)
    ap.add_argument("--policy", default="wait")
    ap.add_argument("--engine-gb", type=float, default=8.0, help="engine.memory_budget_bytes, in GiB")
    ap.add_argument("--modes", default="sync,partial")
    ap.add_argument("--skip-steps", type=int, default=1, help="first steps of each mode left out of the figures "
                    "(kernel compilation and graph capture land in them)")
    ap.add_argument("--override", action="append", default=[], help="one more Hydra override (repeatable)")
    args = ap.parse_args()
    modes = args.modes.split(",")
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for m in modes:  # a result after each mode: a run stopped in the next one keeps this one's figures
            runs[m] = _run(m, args, Path(tmp))
            figures = _all_figures(runs, args)
            write_result("bench_partial", figures)
    equal = figures["equal_samples"]
    for m in modes:
        f = figures[m]
        print(f"{m:>8}: {f['trained_tokens_per_s']:,.0f} trained tokens/s, {f['trained_samples']:.0f} samples in "
              f"{f['seconds']:.1f} s ({equal:.0f} in {f['time_to_samples_s']:.1f} s), mean response "
              f"{f['response_len_mean']:.0f} tokens, peak {f['peak_gb']:.1f} GB", flush=True)
    if {"sync", "partial"} <= set(modes):
        ratio = figures["partial"]["trained_tokens_per_s"] / figures["sync"]["trained_tokens_per_s"]
        figures["partial_over_sync_tokens_per_s"] = round(ratio, 3)
        print(f"partial / sync trained tokens/s: {ratio:.2f}x", flush=True)
    write_result("bench_partial", figures)


if __name__ == "__main__":
    main()
