"""The rollout engine's host bookkeeping of recorded routes (return_routed_experts), without a model: per decode
step, then per finished request, for the engine's RouteLog against keeping a view of each request's row (the
engine's previous way), in one run.

    python benchmarks/bench_route_bookkeeping.py [--batch 128,512] [--steps 64] [--prompt 512] [--layers 15] [--top-k 4]

Each case: `--batch` recording requests with `--prompt`-token prompts (their prefill routes one chunk), `--steps`
decode steps of [batch, layers, top_k] int16 host rows (k3_m2: 15 MoE layers, top 4); printed: ms per decode step
(`RouteLog.keep_step`) and ms to assemble every request's routes at its end, median of `--repeats`, and the ratios.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from record import write_result

from miles_k3.rollout.requests import Request as _Request
from miles_k3.rollout.route_log import RouteLog


def _requests(batch: int, prompt: int, log: RouteLog, shape: tuple[int, int]) -> list[_Request]:
    reqs = []
    for i in range(batch):
        r = _Request(rid=i, index=i, prompt=list(range(prompt)), params=None, key=0, lora=None, record=True)
        r.add_routes(0, torch.zeros(prompt - 1, *shape, dtype=torch.int16), log)
        reqs.append(r)
    return reqs


def route_log_case(batch: int, steps: int, prompt: int, shape: tuple[int, int]) -> tuple[float, float]:
    log = RouteLog()
    reqs = _requests(batch, prompt, log, shape)
    rows = torch.zeros(batch, *shape, dtype=torch.int16)
    t0 = time.perf_counter()
    for _ in range(steps):
        log.keep_step(reqs, rows)
        for r in reqs:
            r.output.append(1)
    t1 = time.perf_counter()
    for r in reqs:
        r.routed(log)
    return (t1 - t0) / steps, time.perf_counter() - t1


def per_request_views_case(batch: int, steps: int, prompt: int, shape: tuple[int, int]) -> tuple[float, float]:
    """The previous way: each request appends a view of its row of the step (`host[b:b + 1]`, after checking its
    position against len(prompt + output)), and its chunks are concatenated at its end."""
    chunks = [[torch.zeros(prompt - 1, *shape, dtype=torch.int16)] for _ in range(batch)]
    outputs: list[list[int]] = [[] for _ in range(batch)]
    prompt_ids = list(range(prompt))
    rows = torch.zeros(batch, *shape, dtype=torch.int16)
    routed = [prompt - 1] * batch  # positions with routes
    t0 = time.perf_counter()
    for _ in range(steps):
        host = rows.cpu()
        for b in range(batch):
            pos = len(prompt_ids + outputs[b]) - 1
            if pos >= routed[b]:  # a position not routed yet
                chunks[b].append(host[b:b + 1])
                routed[b] = pos + 1
        for o in outputs:
            o.append(1)
    t1 = time.perf_counter()
    for c in chunks:
        torch.cat(c)
    return (t1 - t0) / steps, time.perf_counter() - t1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", default="128,512")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--layers", type=int, default=15)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    shape = (a.layers, a.top_k)
    rows = []
    for batch in (int(x) for x in a.batch.split(",")):
        res = {}
        for name, fn in (("route_log", route_log_case), ("per_request_views", per_request_views_case)):
            runs = [fn(batch, a.steps, a.prompt, shape) for _ in range(a.repeats)]
            res[name] = {"step_ms": 1e3 * statistics.median(r[0] for r in runs),
                         "results_ms": 1e3 * statistics.median(r[1] for r in runs)}
        old, new = res["per_request_views"], res["route_log"]
        rows.append({"batch": batch, "steps": a.steps, "prompt": a.prompt, **res,
                     "step_speedup": old["step_ms"] / new["step_ms"],
                     "results_speedup": old["results_ms"] / new["results_ms"]})
        print(json.dumps(rows[-1]), flush=True)
    write_result("bench_route_bookkeeping", rows)


if __name__ == "__main__":
    main()
