"""Where a rollout-engine decode step spends its time on one GPU (k3_m, MXFP4 experts, bf16).

    python benchmarks/profile_decode_gpu.py [--batches 1,64,256] [--prompt 32] [--new 32] [--out DIR]

Per batch: the replay time of the captured decode graph alone, the sampling time, the engine's wall time per
generated token (decode + sampling + scheduling), and the top GPU kernels of one graph replay
(torch.profiler); a cProfile of the host side of one `generate` at the largest batch. Writes profile.json
(and the kernel / host tables as text) into --out.
"""
import argparse
import cProfile
import io
import json
import pathlib
import pstats
import time

import torch
from bench_engine_gpu import build

from miles_k3.rollout.engine import EngineConfig, RolloutEngine
from miles_k3.rollout.sampling import SamplingParams, sample


def cuda_time(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    cfg, model = build()
    engine = RolloutEngine(model, EngineConfig(memory_budget_bytes=24 * 2**30, page_size=64, max_context=1088,
                                               prefill_chunk=1024))
    params = {"temperature": 1.0, "max_new_tokens": args.new, "ignore_eos": True}
    report = {"rows": []}
    with torch.no_grad():
        for b in map(int, args.batches.split(",")):
            prompts = torch.randint(0, cfg.vocab_size, (b, args.prompt)).tolist()
            engine.generate(input_ids=prompts, sampling_params={**params, "max_new_tokens": 2})  # capture
            t0 = time.perf_counter()
            engine.generate(input_ids=prompts, sampling_params=params)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            t0 = time.perf_counter()
            engine.generate(input_ids=prompts, sampling_params={**params, "max_new_tokens": 1})
            torch.cuda.synchronize()
            first = time.perf_counter() - t0  # prefill + one step
            row = {"batch": b, "engine_s_per_step": wall / args.new, "prefill_and_first_token_s": first,
                   "engine_decode_s_per_step": (wall - first) / (args.new - 1)}
            if engine._graph is not None:
                width = max(k[1] for k in engine._graph._graphs)  # the page bucket the run ended in
                graph, _, _ = engine._graph._graph(next(x for x in engine._graph.buckets if x >= b), width)
                row["graph_replay_s"] = cuda_time(graph.replay, 20)
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    graph.replay()
                    torch.cuda.synchronize()
                (out / f"kernels_b{b}_p{args.prompt}.txt").write_text(
                    prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=90))
                row["graph_kernels"] = sum(e.count for e in prof.key_averages())
            logits = torch.randn(b, cfg.vocab_size, device="cuda")
            sp = [SamplingParams.from_dict(params, "bench")] * b
            keys, pos = torch.arange(b), torch.zeros(b, dtype=torch.long)
            row["sample_s"] = cuda_time(lambda a=(logits, sp, keys, pos): sample(*a), 20)
            print(json.dumps(row), flush=True)
            report["rows"].append(row)
        b = int(args.batches.split(",")[-1])
        prompts = torch.randint(0, cfg.vocab_size, (b, args.prompt)).tolist()
        prof = cProfile.Profile()
        prof.enable()
        engine.generate(input_ids=prompts, sampling_params=params)
        torch.cuda.synchronize()
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
        (out / f"host_b{b}_p{args.prompt}.txt").write_text(s.getvalue())
    (out / f"profile_p{args.prompt}.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
