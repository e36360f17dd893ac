"""Weight-sync push latency: a LoRA adapter on every k3_m target (ranks 8, 32, 64) pushed from a trainer model
into the native rollout engine's buffers (the local channel), against the physical copy bound and the disk round
trip.

    python benchmarks/bench_weight_sync.py [--device auto|cpu|cuda] [--ranks 8,32,64] [--repeats 20]
                                           [--json out.json]

* adapter: `apply_lora(k3_m, LoRAConfig(rank=r, alpha=2r, targets=ALLOWED_TARGETS))` (attention, MLPs, latent
  MoE projections and every routed expert's w1/w2/w3); fp32 master tensors, as the trainer holds them.
* copy bound: bytes / the device's copy bandwidth, measured here as one contiguous `dst.copy_(src)` of the
  adapter's size (median of `repeats`); also reported: the bandwidth of a 1 GiB copy.
* local: `LocalChannel.push` (checks, then one multi-tensor copy into the engine's buffers; the engine in this
  process). Goal: <= 2 x copy bound + 100 us.
* disk: what file-based frameworks do: `save_adapter` (PEFT directory, written atomically) then `load_adapter`
  into the engine's model. Goal: local >= 100 x faster.
Every figure is a median over `repeats` pushes after one warm-up push; each push has a new version.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
from record import write_result

from miles_k3.model import K3Config, K3ForCausalLM
from miles_k3.model.adapter import load_adapter, save_adapter
from miles_k3.model.lora import ALLOWED_TARGETS, LoRAConfig, apply_lora, lora_state_dict
from miles_k3.rollout.engine import EngineConfig, RolloutEngine
from miles_k3.weight_sync.local import LocalChannel
from miles_k3.weight_sync.push import sync_devices


def median_s(fn, repeats: int, device: torch.device) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        sync_devices({device})
        t0 = time.perf_counter()
        fn()
        sync_devices({device})
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def build(device: torch.device, rank: int):
    """k3_m (bf16 on CUDA, fp32 on CPU) with a rank-`rank` adapter on every target, and an engine over it with
    adapter "policy" registered (zeros)."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = K3ForCausalLM(K3Config.from_name("k3_m"), expert_format="mxfp4").cast(dtype)
    model.eval().requires_grad_(False)
    cfg = LoRAConfig(rank=rank, alpha=2.0 * rank, targets=list(ALLOWED_TARGETS))
    apply_lora(model, cfg)
    with torch.no_grad():
        for p in lora_state_dict(model).values():
            p.normal_(0, 0.01)
    engine = RolloutEngine(model, EngineConfig(memory_budget_bytes=64 * 2**20, max_context=256, decode="eager"),
                           lora=cfg)
    engine.load_lora_adapter_from_tensors("policy", {n: torch.zeros_like(t) for n, t in
                                                     lora_state_dict(model).items()}, cfg)
    return model, cfg, engine


def copy_bound_s(nbytes: int, device: torch.device, repeats: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return median_s(lambda: dst.copy_(src), repeats, device)


def bench_rank(device: torch.device, rank: int, repeats: int) -> dict:
    model, cfg, engine = build(device, rank)
    tensors = lora_state_dict(model)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    row = {"rank": rank, "tensors": len(tensors), "bytes": nbytes,
           "copy_bound_s": copy_bound_s(nbytes, device, repeats)}
    version = iter(range(1, 10**9))
    ch = LocalChannel(engine, "policy")
    row["local_s"] = median_s(lambda: ch.push(tensors, next(version)), repeats, device)
    assert LocalChannel(engine, "policy", readback=True).push(tensors, next(version)).readback_match
    with tempfile.TemporaryDirectory() as tmp:
        def disk():
            save_adapter(model, cfg, f"{tmp}/adapter", base_model_name_or_path="k3_m", overwrite=True)
            load_adapter(engine.model, f"{tmp}/adapter")
        row["disk_s"] = median_s(disk, max(3, repeats // 4), device)
    bound = row["copy_bound_s"]
    row["local_over_bound"] = row["local_s"] / bound
    row["disk_over_local"] = row["disk_s"] / row["local_s"]  # >= 100 meets the goal
    row["local_over_goal"] = row["local_s"] / (2 * bound + 100e-6)  # <= 1 meets the goal
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="auto")
    ap.add_argument("--ranks", default="8,32,64")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    gib = 2**30
    out = {"device": str(dev), "bandwidth_1gib_bytes_per_s": gib / copy_bound_s(gib, dev, 10), "rows": []}
    print(json.dumps({k: v for k, v in out.items() if k != "rows"}), flush=True)
    for r in (int(x) for x in args.ranks.split(",")):
        row = bench_rank(dev, r, args.repeats)
        out["rows"].append(row)
        print(json.dumps(row), flush=True)
    write_result("bench_weight_sync", out, out=args.json)


if __name__ == "__main__":
    main()
