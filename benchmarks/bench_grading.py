"""Grading throughput: responses per second of the `aime` and `math` graders, called in-process and through a
`GradingPool` (worker processes with a per-response time limit) of 1 and 2 workers.

    python benchmarks/bench_grading.py [--n 1024]

Responses are ~1 KB of filler reasoning ending in a boxed random integer; golds are random integers (so about
0.1 % are correct: the cost is extraction and comparison, not the verdict).
"""
from __future__ import annotations

import argparse
import random
import time

from record import write_result

from miles_k3.evals.graders import get_grader
from miles_k3.evals.grading_pool import GradingPool


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1024)
    n = ap.parse_args().n
    rng = random.Random(0)
    responses = [("Let me think step by step. " * 40) + f"\\boxed{{{rng.randint(0, 999)}}}" for _ in range(n)]
    golds = [str(rng.randint(0, 999)) for _ in range(n)]
    figures = {"responses": n}
    for name in ("aime", "math"):
        grade = get_grader(name)
        grade(responses[0], golds[0])  # imports and first-call costs are not measured
        t0 = time.perf_counter()
        for r, g in zip(responses, golds):
            grade(r, g)
        figures[f"{name}_in_process_us"] = (time.perf_counter() - t0) * 1e6 / n
        print(f"{name}: in-process {1e6 / figures[f'{name}_in_process_us']:,.0f} responses/s", flush=True)
        for workers in (1, 2):
            with GradingPool(name, workers=workers) as pool:
                pool.grade(responses[:8], golds[:8])  # workers started and warm
                t0 = time.perf_counter()
                pool.grade(responses, golds)
                dt = time.perf_counter() - t0
            figures[f"{name}_pool_{workers}_us"] = dt * 1e6 / n
            print(f"{name}: pool of {workers}: {n / dt:,.0f} responses/s ({dt * 1e6 / n:,.0f} us each)", flush=True)
    write_result("bench_grading", figures)


if __name__ == "__main__":
    main()
