"""The tokenizing that `recipe=reasoning_base` does before its first step: its `--size` worked_sum problems (the
recipe's task_args, k3_m2's tokenizer) encoded one `tokenizer.encode` per text (how `miles_k3.sft` did it) and in
two batched calls (`sft_examples.encode_batch`, what it does now), alternating, `--repeats` times each.

    python benchmarks/bench_sft_encode.py [--size 60000] [--repeats 2] [--out FILE]

Records the seconds of every run, the median of each way and their ratio, and whether the two ways gave the same
ids for every problem (they must). The host's core count is in the result: a batched call spreads over the cores.
"""
from __future__ import annotations

import argparse
import statistics
import time

from record import write_result

from miles_k3.evals.datasets import DatasetConfig, load_problems
from miles_k3.evals.templates import render_prompt
from miles_k3.model.build import ModelConfig, build_tokenizer
from miles_k3.sft_examples import encode_batch
from miles_k3.trainer.batch import Sample

TASK_ARGS = {"min_terms": 6, "max_terms": 12, "min_value": 1, "max_value": 19}  # recipe=reasoning_base's


def one_at_a_time(problems: list, tokenizer, eos_id: int) -> list[Sample]:
    """The encoding as sft did it before `encode_batch`: one `encode` call per prompt and per answer."""
    return [Sample(tokenizer.encode(render_prompt("worked", p.problem, tokenizer), add_special_tokens=False),
                   tokenizer.encode(p.answer, add_special_tokens=False) + [eos_id]) for p in problems]


def measure(size: int, repeats: int) -> dict:
    """The figures of `repeats` alternating pairs (one-at-a-time first in even pairs, batched first in odd ones)."""
    problems = load_problems(DatasetConfig(source="worked_sum", answer_field="solution", size=size, seed=0,
                                           distinct=False, task_args=TASK_ARGS))
    tokenizer, stop_ids = build_tokenizer(ModelConfig(name="k3_m2"))
    ways = {"one_at_a_time": lambda: one_at_a_time(problems, tokenizer, stop_ids[0]),
            "batched": lambda: encode_batch(problems, "worked", tokenizer, stop_ids[0])}
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    results = {}
    for r in range(repeats):
        for name in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
            t = time.perf_counter()
            results[name] = ways[name]()
            seconds[name].append(round(time.perf_counter() - t, 3))
            print(f"pair {r + 1}: {name} {seconds[name][-1]:.2f} s", flush=True)
    same = all(a.prompt_ids == b.prompt_ids and a.response_ids == b.response_ids
               for a, b in zip(results["one_at_a_time"], results["batched"]))
    median = {name: statistics.median(s) for name, s in seconds.items()}
    return {"size": size, "repeats": repeats, "seconds": seconds, "median_s": median,
            "speedup": round(median["one_at_a_time"] / median["batched"], 2), "same_ids": same,
            "tokens": sum(len(s.prompt_ids) + len(s.response_ids) for s in results["batched"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=60000)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    figures = measure(args.size, args.repeats)
    print(figures, flush=True)
    write_result("bench_sft_encode", figures, out=args.out)


if __name__ == "__main__":
    main()
