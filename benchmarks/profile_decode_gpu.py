"""Where a rollout-engine decode step spends its time on one GPU (MXFP4 experts, bf16).

    python benchmarks/profile_decode_gpu.py [--model k3_m|k3_4layers] [--batches 1,64,256] [--prompt 32]
                                            [--new 32] [--out DIR]

Per batch: the replay time of the captured decode graph alone, the sampling time, the engine's wall time per
generated token (decode + sampling + scheduling), and the top GPU kernels of one graph replay
(torch.profiler); a cProfile of the host side of one `generate` at the largest batch. Writes profile.json
(and the kernel / host tables as text) into --out, again after every batch, so that a run cut short (a cold
machine compiles the engine's kernels for minutes in the first batch) keeps what it measured; each phase's start
is printed with the seconds since the start.

`--model k3_4layers`: the real-width 4-layer K3 of `bench_k3_layers_gpu.py` (random MXFP4 experts, LoRA rank
32, adapter "policy") in that benchmark's engine configuration; per batch it also reports the benchmark's
tokens/s (a warm-up of 8 new tokens, then `--new` timed: the graphs of the longer page bucket are captured
inside the timed call) next to the same call with every graph already captured, the prefill share (a
one-token `generate`: prefill + one step) and the top kernels of that prefill, and each replayed kernel in
launch order (kernels_seq_*.txt) so that kernels can be attributed to layers.
"""
import argparse
import cProfile
import io
import json
import pathlib
import pstats
import time

import torch
from bench_engine_gpu import build, timed
from record import write_result

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


def kernel_events(prof) -> list[tuple[float, float, str]]:
    """(start us, duration us, name) of every GPU kernel / memcpy / memset the profiler saw, in start order."""
    evs = [(e.time_range.start, e.device_time_total, e.name) for e in prof.events()
           if e.device_type == torch.autograd.DeviceType.CUDA]
    return sorted(evs)


def by_name(events, n: int = 40) -> list[dict]:
    per: dict[str, list] = {}
    for _, us, name in events:
        acc = per.setdefault(name, [0.0, 0])
        acc[0] += us
        acc[1] += 1
    rows = sorted(per.items(), key=lambda kv: -kv[1][0])[:n]
    return [{"ms": round(us / 1e3, 4), "count": c, "name": name[:140]} for name, (us, c) in rows]


def profile_gpu(fn) -> list[tuple[float, float, str]]:
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return kernel_events(prof)


def build_k3_4layers():
    """The 4-layer real-width K3 of bench_k3_layers_gpu.py with LoRA rank 32, and that benchmark's engine."""
    from bench_k3_layers_gpu import build_model, k3_four_layers

    from miles_k3.model.lora import LoRAConfig, apply_lora, lora_state_dict

    cfg = k3_four_layers()
    model = build_model(cfg)
    lora = LoRAConfig(rank=32, alpha=64)
    apply_lora(model, lora)
    return cfg, model, lora, lora_state_dict


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="k3_m", choices=["k3_m", "k3_4layers"])
    ap.add_argument("--batches", default=None, help="default 1,64,256 (k3_m), 256 (k3_4layers)")
    ap.add_argument("--new", type=int, default=None, help="default 32 (k3_m), 64 (k3_4layers)")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    real = args.model == "k3_4layers"
    args.batches = args.batches or ("256" if real else "1,64,256")
    args.new = args.new or (64 if real else 32)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    def phase(what: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f} s] {what}", flush=True)

    lora = None
    phase(f"build {args.model}")
    if real:
        cfg, model, lora, lora_state_dict = build_k3_4layers()
    else:
        cfg, model = build()
    report = {"model": args.model, "rows": []}
    params = {"temperature": 1.0, "max_new_tokens": args.new, "ignore_eos": True}
    with torch.no_grad():
        for b in map(int, args.batches.split(",")):
            if real:  # bench_k3_layers_gpu.engine_part's engine, one per batch
                engine = RolloutEngine(model, EngineConfig(memory_budget_bytes=12 * 2**30, page_size=64,
                                                           max_context=256, prefill_chunk=1024, num_slots=b),
                                       lora=lora)
                engine.load_lora_adapter_from_tensors("policy", lora_state_dict(model), lora)
                name = "policy"
            elif not report["rows"]:
                engine = RolloutEngine(model, EngineConfig(memory_budget_bytes=24 * 2**30, page_size=64,
                                                           max_context=1088, prefill_chunk=1024))
                name = None
            prompts = torch.randint(0, cfg.vocab_size, (b, args.prompt)).tolist()

            def gen(new, prompts=prompts, name=name, engine=engine):
                engine.generate(input_ids=prompts, sampling_params={**params, "max_new_tokens": new}, lora=name)

            row = {"batch": b}
            phase(f"batch {b}: first generate (kernel compiles, graph capture)")
            gen(8 if real else 2)  # capture (the shorter page buckets)
            phase(f"batch {b}: timed generates")
            if real:
                row["bench_style_s"] = timed(lambda: gen(args.new))  # captures the longer buckets inside
                row["bench_style_tok_s"] = b * args.new / row["bench_style_s"]
            gen(args.new)  # every page bucket of this run captured
            wall = timed(lambda: gen(args.new))
            first = timed(lambda: gen(1))  # prefill + one step
            row.update({"graphs_warm_s": wall, "graphs_warm_tok_s": b * args.new / wall,
                        "engine_s_per_step": wall / args.new, "prefill_and_first_token_s": first,
                        "engine_decode_s_per_step": (wall - first) / (args.new - 1)})
            print(json.dumps(row), flush=True)
            if engine.runner.graph is not None:
                for width in sorted({k[1] for k in engine.runner.graph._graphs}):
                    bucket = next(x for x in engine.runner.graph.buckets if x >= b)
                    if (bucket, width) not in engine.runner.graph._graphs:
                        continue
                    entry = engine.runner.graph._graph(bucket, width)  # (graph, packed, logits, ...)
                    graph, logits = entry[0], entry[2]
                    row[f"graph_replay_s_p{width}"] = cuda_time(graph.replay, 20)
                    evs = profile_gpu(graph.replay)
                    row[f"graph_kernels_p{width}"] = len(evs)
                    row[f"graph_kernel_sum_ms_p{width}"] = sum(e[1] for e in evs) / 1e3
                    row[f"top_kernels_p{width}"] = by_name(evs)
                    (out / f"kernels_seq_b{b}_p{width}.txt").write_text(
                        "\n".join(f"{us:9.1f} {nm[:160]}" for _, us, nm in evs))
                    print(json.dumps({"batch": b, "pages": width, "replay_ms": row[f"graph_replay_s_p{width}"] * 1e3,
                                      "kernels": len(evs), "top": row[f"top_kernels_p{width}"][:25]}, indent=1),
                          flush=True)
                row["graph_replay_s"] = row[f"graph_replay_s_p{width}"]
                sample_logits = logits[:b]
            else:
                sample_logits = torch.randn(b, cfg.vocab_size, device="cuda")
            if real:
                evs = profile_gpu(lambda: gen(1))
                row["prefill_top_kernels"] = by_name(evs, 30)
                row["prefill_gpu_kernel_ms"] = sum(e[1] for e in evs) / 1e3
                print(json.dumps({"prefill_and_first_token_s": first, "gpu_kernel_ms": row["prefill_gpu_kernel_ms"],
                                  "top": row["prefill_top_kernels"][:20]}, indent=1), flush=True)
            sp = [SamplingParams.from_dict(params, "bench")] * b
            keys, pos = torch.arange(b), torch.zeros(b, dtype=torch.long)
            row["sample_s"] = cuda_time(lambda a=(sample_logits, sp, keys, pos): sample(*a), 20)
            row["sample_top_kernels"] = by_name(profile_gpu(lambda a=(sample_logits, sp, keys, pos): sample(*a)), 5)
            print(json.dumps({k: v for k, v in row.items() if "top_kernels" not in k}), flush=True)
            report["rows"].append(row)
            (out / f"profile_{args.model}_p{args.prompt}.json").write_text(json.dumps(report, indent=2))
        phase("host profile")
        b = int(args.batches.split(",")[-1])
        prompts = torch.randint(0, cfg.vocab_size, (b, args.prompt)).tolist()
        prof = cProfile.Profile()
        prof.enable()
        engine.generate(input_ids=prompts, sampling_params=params, lora="policy" if real else None)
        torch.cuda.synchronize()
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
        (out / f"host_b{b}_p{args.prompt}.txt").write_text(s.getvalue())
    (out / f"profile_{args.model}_p{args.prompt}.json").write_text(json.dumps(report, indent=2))
    write_result("profile_decode_gpu", {k: v for k, v in report.items() if k != "rows"}
                 | {"rows": [{k: v for k, v in r.items() if "top_kernels" not in k} for r in report["rows"]]})


if __name__ == "__main__":
    main()
