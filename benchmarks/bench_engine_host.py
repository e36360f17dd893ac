"""Host-side cost of the rollout engine's scheduler per decode step, with the model and the sampler stubbed out
(CPU, no GPU needed): what the engine adds around each captured decode graph.

    python benchmarks/bench_engine_host.py [--batch 256] [--prompt 512] [--new 64]

The static decode step is replaced by a constant-logits stub, prefill by a no-op and sampling by a constant
draw, so the time left is scheduling: page reservation, block tables, the packed input row per request,
per-request bookkeeping and stop checks. Prints ms per step (median of 5 runs).
"""
import argparse
import statistics
import time

import torch
from record import write_result

from miles_k3.model import K3Config, K3ForCausalLM
from miles_k3.rollout import runner as runner_module
from miles_k3.rollout.engine import EngineConfig, RolloutEngine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=64)
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = K3Config.from_name("k3_tiny")
    model = K3ForCausalLM(cfg).eval().requires_grad_(False)
    engine = RolloutEngine(model, EngineConfig(memory_budget_bytes=2**30, page_size=16,
                                               max_context=args.prompt + args.new, decode="static"))
    logits = torch.zeros(engine.runner.graph.buckets[-1], cfg.vocab_size)
    ids, logprobs = torch.zeros(args.batch, dtype=torch.long), torch.zeros(args.batch)
    engine.runner.graph._step = lambda packed: (logits[: packed.shape[0]], None)
    engine.runner.prefill_rows = lambda rows, start, chunk: None
    runner_module.sample = lambda lg, params, keys, pos: (ids[: lg.shape[0]], logprobs[: lg.shape[0]])
    prompts = torch.randint(0, cfg.vocab_size, (args.batch, args.prompt)).tolist()
    params = {"max_new_tokens": args.new, "ignore_eos": True}
    times = []
    for _ in range(6):
        t0 = time.perf_counter()
        engine.generate(input_ids=prompts, sampling_params=params)
        times.append(time.perf_counter() - t0)
    host_ms = statistics.median(times[1:]) / args.new * 1e3
    print(f"host ms per decode step, batch {args.batch}, prompt {args.prompt}: {host_ms:.2f}")
    write_result("bench_engine_host", {"batch": args.batch, "prompt": args.prompt, "new": args.new,
                                       "host_ms_per_decode_step": host_ms})


if __name__ == "__main__":
    main()
