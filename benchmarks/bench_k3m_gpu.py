"""Forward+backward throughput of k3_m on one GPU (bf16, fla KDA kernels) and the share of GPU time in KDA.

    python benchmarks/bench_k3m_gpu.py [--batch 8] [--seq 4096] [--iters 5] [--json out.json]

Tokens/s = batch * seq / median wall time of one training forward+backward (loss = token cross-entropy over the
full vocabulary; no optimizer step). The KDA share is measured with torch.profiler over one step: GPU kernel time
of the kernels that fla's chunk_kda launches (their names collected by profiling chunk_kda alone at the same
shape), divided by all GPU kernel time of the step.
"""
import argparse
import json
import statistics
import time

import torch
from record import write_result
from torch.profiler import ProfilerActivity, profile

from miles_k3.model import K3Config, K3ForCausalLM
from miles_k3.model.kda_ops import resolve_kda_backend


def kernel_times(prof) -> dict[str, float]:
    """GPU time per kernel name, microseconds."""
    out: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.name] = out.get(e.name, 0.0) + e.device_time_total
    return out


def kda_kernel_names(batch: int, seq: int, heads: int, dim: int) -> set[str]:
    backend = resolve_kda_backend("fla", "cuda")
    q, k, v = (torch.randn(batch, seq, heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    g = (-5 * torch.sigmoid(torch.randn(batch, seq, heads, dim, device="cuda"))).requires_grad_(True)
    beta = torch.rand(batch, seq, heads, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
    h0 = torch.zeros(batch, heads, dim, dim, device="cuda", requires_grad=True)

    def fwd_bwd():
        o, s = backend.prefill(q, k, v, g, beta, initial_state=h0, output_final_state=True)
        (o.float().sum() + s.sum()).backward()
        torch.cuda.synchronize()

    fwd_bwd()  # compile / autotune outside the profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fwd_bwd()
    # fla's Triton kernels only: drop the ATen kernels of the surrounding sum/backward glue
    return {n for n in kernel_times(prof) if "at::" not in n and not n.startswith("void ")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cfg = K3Config.from_name("k3_m")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = K3ForCausalLM(cfg, kda_backend="fla").cast(torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), device="cuda")

    def step():
        logits = model(ids[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                 ids[:, 1:].reshape(-1))
        loss.backward()
        model.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    for _ in range(2):  # compiles / autotunes fla's kernels on a fresh machine (minutes without a cache)
        step()
    torch.cuda.synchronize()
    print(f"warmup (2 steps, incl. Triton compile/autotune): {time.perf_counter() - t0:.1f} s", flush=True)
    times = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    per_kernel = kernel_times(prof)
    kda_names = kda_kernel_names(args.batch, args.seq, cfg.linear_attn_config.num_heads,
                                 cfg.linear_attn_config.head_dim)
    total_us = sum(per_kernel.values())
    kda_us = sum(t for n, t in per_kernel.items() if n in kda_names)
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:12]
    med = statistics.median(times)
    result = {
        "model": "k3_m", "dtype": "bf16", "batch": args.batch, "seq": args.seq,
        "step_s_median": med, "step_s_min": min(times), "step_s_max": max(times),
        "tokens_per_s": args.batch * args.seq / med,
        "gpu_kernel_ms_per_step": total_us / 1e3, "kda_kernel_ms_per_step": kda_us / 1e3,
        "kda_share_of_gpu_time": kda_us / total_us, "gpu_busy_fraction": total_us / 1e6 / med,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
        "top_kernels_ms": {n[:80]: round(t / 1e3, 2) for n, t in top},
    }
    print(json.dumps(result, indent=2))
    write_result("bench_k3m_gpu", result, out=args.json)


if __name__ == "__main__":
    main()
