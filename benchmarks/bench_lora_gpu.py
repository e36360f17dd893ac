"""k3_m + LoRA training step on one GPU: frozen MXFP4 routed experts vs the same model with a bf16 base.

    python benchmarks/bench_lora_gpu.py [--shapes 8x4096,1x2048] [--iters 5] [--experts-lora] [--json out.json]

For each batch x seq shape and each base (mxfp4, bf16; everything but the experts is bf16 in both, the base is
frozen in both), one step = forward + token cross-entropy + backward into the LoRA tensors (no optimizer).
Tokens/s = batch * seq / median step time; peak = torch.cuda.max_memory_allocated over the timed steps, and
base_bytes = the bytes of the model's base tensors as held. Reported as ratios mxfp4 / bf16 from the same run.
"""
import argparse
import json
import statistics
import time

import torch
from record import write_result

from miles_k3.model import K3Config, K3ForCausalLM
from miles_k3.model.lora import LoRAConfig, apply_lora


def base_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for n, t in model.state_dict().items() if "lora_" not in n)


def run_one(fmt: str, batch: int, seq: int, iters: int, lora: LoRAConfig) -> dict:
    cfg = K3Config.from_name("k3_m")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = K3ForCausalLM(cfg, kda_backend="fla", expert_format=fmt).cast(torch.bfloat16)
    apply_lora(model, lora)
    model.cuda()
    ids = torch.randint(0, cfg.vocab_size, (batch, seq + 1), device="cuda")

    def step():
        logits = model(ids[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                 ids[:, 1:].reshape(-1))
        loss.backward()
        model.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    warm = time.perf_counter() - t0
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    out = {"base": fmt, "batch": batch, "seq": seq, "warmup_s": round(warm, 1), "step_s_median": med,
           "step_s_min": min(times), "step_s_max": max(times), "tokens_per_s": batch * seq / med,
           "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30, "base_bytes": base_bytes(model),
           "lora_params": sum(p.numel() for p in model.parameters() if p.requires_grad)}
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1x2048,8x4096")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--experts-lora", action="store_true", help="also put LoRA on the routed experts")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    lora = LoRAConfig()
    if args.experts_lora:
        lora.targets = [*lora.targets, "w1", "w2", "w3"]
    results = []
    for shape in args.shapes.split(","):
        batch, seq = map(int, shape.split("x"))
        q = run_one("mxfp4", batch, seq, args.iters, lora)
        torch.cuda.empty_cache()
        b = run_one("bf16", batch, seq, args.iters, lora)
        torch.cuda.empty_cache()
        results.append({"batch": batch, "seq": seq, "mxfp4": q, "bf16": b,
                        "throughput_ratio": q["tokens_per_s"] / b["tokens_per_s"],
                        "peak_mem_ratio": q["peak_mem_gib"] / b["peak_mem_gib"],
                        "base_bytes_ratio": q["base_bytes"] / b["base_bytes"]})
        print(json.dumps({k: v for k, v in results[-1].items() if "ratio" in k or k in ("batch", "seq")}),
              flush=True)
    write_result("bench_lora_gpu", {"experts_lora": args.experts_lora, "results": results}, out=args.json)


if __name__ == "__main__":
    main()
