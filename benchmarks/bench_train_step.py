"""One GRPO train step per setting (micro-batch tokens, activation checkpointing, kernels): peak memory and time.

    python benchmarks/bench_train_step.py [--model k3_m] [--seqs 64] [--prompt 128] [--response 896]
                                          [--micro-batch-tokens 32768] [--checkpointing off,on]
                                          [--kernels fused] [--repeats 3] [--profile-steps 0] [--out FILE]

Builds the base (random init, MXFP4 routed experts; bf16 on CUDA, fp32 on CPU), LoRA rank 32 on the default
targets, and `--seqs` synthetic samples of `--prompt` + `--response` tokens with random advantages; then runs
`train_step` `--repeats` times per setting (after one warm-up step that compiles kernels) and prints, per setting,
the median step time and the peak memory allocated during a step (CUDA; on CPU only the time), and the ratios
checkpointed / plain measured in the same run. kernels=reference forces the torch references of the fused Triton
kernels (`miles_k3.model.layers.reference_kernels`). `--profile-steps N` profiles N more steps of the first setting
that ran (`gpu_measure.step_profile`: the top ops and kernels, kernels per step, the share of the wall time the GPU
was busy). `recipe=k3_m2_reasoning`'s train step is about `--model k3_m2 --seqs 256 --prompt 60 --response 140
--micro-batch-tokens 12288 --checkpointing off`.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from gpu_measure import step_profile
from record import write_result

from miles_k3.model.build import ModelConfig, build_model
from miles_k3.model.layers import set_reference_kernels
from miles_k3.model.lora import LoRAConfig, apply_lora, lora_parameters
from miles_k3.trainer.batch import Sample
from miles_k3.trainer.optim import OptimConfig, build_optimizer, build_scheduler
from miles_k3.trainer.step import TrainerConfig, train_step
from miles_k3.utils.runtime import resolve_device, resolve_dtype


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="k3_m")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--response", type=int, default=896)
    ap.add_argument("--micro-batch-tokens", default="32768")
    ap.add_argument("--checkpointing", default="off,on")
    ap.add_argument("--kernels", default="fused")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile-steps", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = resolve_device(args.device)
    torch.manual_seed(0)
    model = build_model(ModelConfig(name=args.model), device, resolve_dtype("auto", device))
    apply_lora(model, LoRAConfig(rank=32, alpha=64))
    params = lora_parameters(model)
    opt = build_optimizer(params, OptimConfig(lr=1e-6))
    sched = build_scheduler(opt, OptimConfig(lr=1e-6))
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    samples = [Sample(torch.randint(1, vocab, (args.prompt,), generator=g).tolist(),
                      torch.randint(1, vocab, (args.response,), generator=g).tolist(),
                      advantage=float(torch.randn((), generator=g))) for _ in range(args.seqs)]
    tokens = args.seqs * (args.prompt + args.response)
    print(f"{args.model} on {device}: {args.seqs} x ({args.prompt} + {args.response}) = {tokens:,} tokens per step",
          flush=True)
    settings = [(int(m), c == "on", k) for m in args.micro_batch_tokens.split(",")
                for c in args.checkpointing.split(",") for k in args.kernels.split(",")]
    results, ran = {}, []
    for micro, ckpt, kern in settings:
        cfg = TrainerConfig(micro_batch_tokens=micro, activation_checkpointing=ckpt)
        name = f"micro={micro} checkpointing={'on' if ckpt else 'off'} kernels={kern}"
        set_reference_kernels(kern == "reference")
        try:
            train_step(model, samples, cfg, opt, sched, params, 0, device)  # warm-up: kernel compiles, allocator
        except torch.OutOfMemoryError:
            print(f"{name}: out of memory", flush=True)
            results[name] = {"oom": True}
            opt.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            continue
        times, peaks = [], []
        for _ in range(args.repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            t0 = time.perf_counter()
            train_step(model, samples, cfg, opt, sched, params, 0, device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                peaks.append((torch.cuda.max_memory_allocated(device) - base) / 2**30)
            times.append(time.perf_counter() - t0)
        results[name] = {"step_s": statistics.median(times), "step_times_s": [round(t, 3) for t in times],
                         "tokens_per_s": round(tokens / statistics.median(times)),
                         "peak_step_gib": max(peaks) if peaks else None}
        ran.append((name, cfg, kern))
        print(f"{name}: step {results[name]['step_s']:.3f} s ({results[name]['tokens_per_s']:,} tokens/s), "
              f"peak step memory {results[name]['peak_step_gib'] or float('nan'):.2f} GiB", flush=True)
    profile = gpu_busy = None
    if args.profile_steps and ran:
        name, cfg, kern = ran[0]
        set_reference_kernels(kern == "reference")

        def step() -> None:
            train_step(model, samples, cfg, opt, sched, params, 0, device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        profile, gpu_busy = step_profile(step, args.profile_steps, device.type == "cuda")
        print(f"profile of {name}:\n{profile}\n{gpu_busy}", flush=True)
    write_result("bench_train_step", {"model": args.model, "device": str(device), "tokens_per_step": tokens,
                                      "settings": results, "profile_setting": ran[0][0] if profile else None,
                                      "profile_top": profile, "gpu_busy": gpu_busy}, out=args.out)
    for micro in args.micro_batch_tokens.split(","):
        plain, ckpt = (results.get(f"micro={micro} checkpointing={c} kernels={args.kernels.split(',')[0]}", {})
                       for c in ("off", "on"))
        if "step_s" in plain and "step_s" in ckpt:
            ratio_m = (ckpt["peak_step_gib"] / plain["peak_step_gib"]) if plain["peak_step_gib"] else float("nan")
            print(f"micro={micro}: checkpointed / plain: time {ckpt['step_s'] / plain['step_s']:.2f}x, "
                  f"peak step memory {ratio_m:.2f}x", flush=True)


if __name__ == "__main__":
    main()
