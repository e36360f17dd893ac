"""One GRPO train step with and without activation checkpointing: peak memory and time.

    python benchmarks/bench_train_step.py [--model k3_m] [--seqs 64] [--prompt 128] [--response 896]
                                          [--micro-batch-tokens 32768] [--repeats 3]

Builds the base (random init, MXFP4 routed experts; bf16 on CUDA, fp32 on CPU), LoRA rank 32 on the default
targets, and `--seqs` synthetic samples of `--prompt` + `--response` tokens with random advantages; then runs
`train_step` `--repeats` times per setting (after one warm-up step that compiles kernels) and prints, per setting,
the median step time and the peak memory allocated during a step (CUDA; on CPU only the time), and the ratios
checkpointed / plain measured in the same run.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from record import write_result

from miles_k3.model.build import ModelConfig, build_model
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
    ap.add_argument("--micro-batch-tokens", type=int, default=32768)
    ap.add_argument("--repeats", type=int, default=3)
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
    print(f"{args.model} on {device}: {args.seqs} x ({args.prompt} + {args.response}) = {tokens:,} tokens per step, "
          f"micro-batches of {args.micro_batch_tokens:,} tokens", flush=True)
    results = {}
    for ckpt in (False, True):
        cfg = TrainerConfig(micro_batch_tokens=args.micro_batch_tokens, activation_checkpointing=ckpt)
        name = "checkpointed" if ckpt else "plain"
        try:
            train_step(model, samples, cfg, opt, sched, params, 0, device)  # warm-up: kernel compiles, allocator
        except torch.OutOfMemoryError:
            print(f"{name:>12}: out of memory", flush=True)
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
        results[ckpt] = (statistics.median(times), max(peaks) if peaks else float("nan"))
        print(f"{name:>12}: step {results[ckpt][0]:.3f} s ({tokens / results[ckpt][0]:,.0f} tokens/s), "
              f"peak step memory {results[ckpt][1]:.2f} GiB", flush=True)
    write_result("bench_train_step", {"model": args.model, "device": str(device), "tokens_per_step": tokens,
                                      "micro_batch_tokens": args.micro_batch_tokens,
                                      **{("checkpointed" if c else "plain"): {"step_s": t, "peak_step_gib": m}
                                         for c, (t, m) in results.items()}})
    if len(results) < 2:
        return
    (t_plain, m_plain), (t_ckpt, m_ckpt) = results[False], results[True]
    print(f"checkpointed / plain: time {t_ckpt / t_plain:.2f}x, peak step memory {m_ckpt / m_plain:.2f}x",
          flush=True)


if __name__ == "__main__":
    main()
