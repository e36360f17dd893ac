"""Full-parameter SFT steps of a shipped config on worked sums: tokens per second per setting, and where a step's
time goes (the top CUDA kernels and CPU ops by time, torch.profiler).

    python benchmarks/bench_sft_gpu.py [--model k3_m2] [--batch 64] [--micro-batch-tokens 6144,16384]
                                       [--checkpointing off,on] [--kernels fused,reference] [--steps 6]
                                       [--profile-steps 2] [--out FILE]

Builds `--model` from its random init (bf16 weights and routed experts, every parameter trained, as
`recipe=reasoning_base` trains it), draws `--batch` worked_sum problems per step (the recipe's task_args) and runs,
for every (micro-batch tokens, checkpointing) setting: one warm-up step (kernel compiles, the allocator), then
`--steps` timed steps of `miles_k3.sft.sft_backward` + the optimizer step, each synchronised; then `--profile-steps`
more under torch.profiler for the first setting. Prints every step's time as it runs (slow first steps show compiles
or autotuning) and records them, the median step time, tokens/s and peak memory per setting, and the profile's top
rows. What `recipe=reasoning_base` needs to know: how fast a base can be built.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from gpu_measure import step_profile
from record import write_result

from miles_k3.evals.datasets import DatasetConfig, load_problems
from miles_k3.model.build import ModelConfig, build_model, build_tokenizer
from miles_k3.model.layers import set_reference_kernels
from miles_k3.sft import build_full_optimizer, sft_backward
from miles_k3.sft_examples import encode_batch
from miles_k3.trainer.optim import OptimConfig, build_scheduler, optimizer_step
from miles_k3.utils.runtime import resolve_device

TASK_ARGS = {"min_terms": 6, "max_terms": 12, "min_value": 1, "max_value": 19}  # recipe=reasoning_base's


def worked_examples(n: int, tokenizer, eos_id: int) -> list:
    """`n` worked_sum training examples (seed 0) as recipe=reasoning_base draws and encodes them."""
    problems = load_problems(DatasetConfig(source="worked_sum", answer_field="solution", size=n, seed=0,
                                           distinct=False, task_args=TASK_ARGS))
    return encode_batch(problems, "worked", tokenizer, eos_id)


def _step(model, params, opt, sched, optim, examples, pad_id, device, micro, ckpt) -> tuple[float, int]:
    t = time.perf_counter()
    _, tokens = sft_backward(model, examples, pad_id, device, micro, ckpt)
    optimizer_step(opt, sched, params, optim)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="k3_m2")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--micro-batch-tokens", default="6144,16384")
    ap.add_argument("--checkpointing", default="off,on")
    ap.add_argument("--kernels", default="fused")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--profile-steps", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = resolve_device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = ModelConfig(name=args.model, experts="bf16", dtype="bf16" if device.type == "cuda" else "fp32")
    model = build_model(cfg, device, dtype, seed=0)
    model.requires_grad_(True)
    params = dict(model.named_parameters())
    optim = OptimConfig(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01, grad_clip=1.0)
    opt = build_full_optimizer(params, optim)
    sched = build_scheduler(opt, optim)
    tokenizer, stop_ids = build_tokenizer(cfg)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    n = args.batch * (args.steps + args.profile_steps + 1)
    examples = worked_examples(n, tokenizer, stop_ids[0])
    batches = [examples[i:i + args.batch] for i in range(0, n, args.batch)]
    settings = [(int(m), c == "on", k) for m in args.micro_batch_tokens.split(",")
                for c in args.checkpointing.split(",") for k in args.kernels.split(",")]
    results = []
    for micro, ckpt, kern in settings:
        name = f"micro={micro} checkpointing={'on' if ckpt else 'off'} kernels={kern}"
        set_reference_kernels(kern == "reference")
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        try:
            warm, _ = _step(model, params, opt, sched, optim, batches[0], pad_id, device, micro, ckpt)
            print(f"{name}: warm-up step {warm:.2f} s", flush=True)
            times, tokens = [], []
            for i, b in enumerate(batches[1:args.steps + 1]):
                dt, tok = _step(model, params, opt, sched, optim, b, pad_id, device, micro, ckpt)
                times.append(dt)
                tokens.append(tok)
                print(f"{name}: step {i + 1} {dt:.2f} s, {tok} tokens", flush=True)
        except torch.OutOfMemoryError:
            print(f"{name}: out of memory", flush=True)
            results.append({"setting": name, "oom": True})
            torch.cuda.empty_cache()
            continue
        step_s = statistics.median(times)
        row = {"setting": name, "step_s": round(step_s, 3), "tokens_per_step": round(statistics.mean(tokens)),
               "tokens_per_s": round(sum(tokens) / sum(times)), "warmup_s": round(warm, 2),
               "step_times_s": [round(t, 3) for t in times],
               "peak_gb": round(torch.cuda.max_memory_allocated(device) / 1e9, 2) if device.type == "cuda" else None}
        results.append(row)
        print(row, flush=True)
    profile = gpu_busy = None
    ok = next((s for s, r in zip(settings, results) if not r.get("oom")), None)
    if args.profile_steps and ok is not None:
        set_reference_kernels(ok[2] == "reference")
        rest = iter(batches[args.steps + 1:])
        profile, gpu_busy = step_profile(
            lambda: _step(model, params, opt, sched, optim, next(rest), pad_id, device, *ok[:2]),
            len(batches) - args.steps - 1, device.type == "cuda")
        print(profile, gpu_busy, flush=True)
    write_result("bench_sft_gpu", {"model": args.model, "batch": args.batch, "settings": results,
                                   "profile_setting": None if ok is None else f"micro={ok[0]} checkpointing={ok[1]} kernels={ok[2]}",
                                   "profile_top": profile,
                                   "gpu_busy": gpu_busy}, out=args.out)


if __name__ == "__main__":
    main()
