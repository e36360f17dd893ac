"""LoRA push latency on one GPU: SGLang (engine.backend=sglang: the adapter loaded from tensors under a new
versioned name, the previous version unloaded) against the native engine (its local channel: an in-place copy
into the engine's adapter buffers), each pushing the trainer's fp32 LoRA tensors after every "step".

    python benchmarks/bench_sglang_push.py [--hidden 1024] [--layers 8] [--rank 16] [--pushes 20]

SGLang serves a random Qwen3 written by miles_k3.model.hf.write_tiny_qwen3 (hidden/layers as given, LoRA on
q/k/v/o/gate/up/down); the native engine serves k3_m with LoRA of the same rank on its default targets. Both
adapters' sizes are printed: compare per byte as well as per push. Needs SGLang (pip install 'miles-k3[sglang]').
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
from record import write_result


def _time_pushes(push, tensors_fn, n: int) -> list[float]:
    out = []
    for step in range(1, n + 1):
        tensors = tensors_fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        push(tensors, step)
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def bench_sglang(hidden: int, layers: int, rank: int, pushes: int) -> dict:
    from miles_k3.model.adapter import peft_tensors
    from miles_k3.model.hf import load_hf_model, write_tiny_qwen3
    from miles_k3.model.lora import LoRAConfig, apply_lora, lora_parameters
    from miles_k3.rollout.sglang_backend import SGLangConfig, SGLangEngine

    lora = LoRAConfig(rank=rank, alpha=2.0 * rank,
                      targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    directory = write_tiny_qwen3(tempfile.mkdtemp() + "/qwen3", hidden_size=hidden, num_layers=layers)
    model = load_hf_model(str(directory), torch.device("cuda"), torch.bfloat16)
    apply_lora(model, lora)
    engine = SGLangEngine(SGLangConfig(mem_fraction_static=0.3), str(directory), lora=lora)
    try:
        def tensors():
            with torch.no_grad():
                for p in lora_parameters(model).values():
                    p.add_(1e-3)  # an optimizer step
            return {k: v.detach() for k, v in peft_tensors(model).items()}

        engine.load_lora_adapter_from_tensors("policy", tensors(), lora)
        times = _time_pushes(lambda t, v: engine.update_weights_from_tensor(t, lora_name="policy", weight_version=v),
                             tensors, pushes)
        nbytes = sum(t.numel() * t.element_size() for t in tensors().values())
    finally:
        engine.shutdown()
    return {"engine": "sglang", "model": f"qwen3 h{hidden} l{layers}", "bytes": nbytes, "push_s": times}


def bench_native(rank: int, pushes: int) -> dict:
    from miles_k3.model import K3Config, K3ForCausalLM
    from miles_k3.model.lora import LoRAConfig, apply_lora, lora_parameters
    from miles_k3.rollout.engine import EngineConfig, RolloutEngine
    from miles_k3.weight_sync.local import LocalChannel

    lora = LoRAConfig(rank=rank, alpha=2.0 * rank)
    with torch.device("cuda"):
        model = K3ForCausalLM(K3Config.from_name("k3_m"), expert_format="mxfp4").cast(torch.bfloat16)
    model.requires_grad_(False)
    apply_lora(model, lora)
    params = lora_parameters(model)
    engine = RolloutEngine(model, EngineConfig(memory_budget_bytes=2**30, max_context=1024), lora=lora)
    engine.load_lora_adapter_from_tensors("policy", {n: p.detach() for n, p in params.items()}, lora)
    channel = LocalChannel(engine, "policy")

    def tensors():
        with torch.no_grad():
            for p in params.values():
                p.add_(1e-3)
        return {n: p.detach() for n, p in params.items()}

    times = _time_pushes(lambda t, v: channel.push(t, version=v), tensors, pushes)
    nbytes = sum(p.numel() * p.element_size() for p in params.values())
    return {"engine": "native", "model": "k3_m", "bytes": nbytes, "push_s": times}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--pushes", type=int, default=20)
    args = ap.parse_args()
    rows = [bench_native(args.rank, args.pushes), bench_sglang(args.hidden, args.layers, args.rank, args.pushes)]
    for r in rows:
        warm = r["push_s"][2:]  # the first pushes include one-time setup (graph capture, allocations)
        r |= {"median_s": statistics.median(warm), "max_s": max(warm), "gb_per_s": r["bytes"] / statistics.median(warm)
              / 1e9}
        print(f"{r['engine']:>6} {r['model']:<16} {r['bytes'] / 2**20:7.2f} MiB  push median {1e3 * r['median_s']:8.3f} ms"
              f"  max {1e3 * r['max_s']:8.3f} ms  {r['gb_per_s']:7.2f} GB/s")
    native, sgl = rows
    print(f"sglang / native: {sgl['median_s'] / native['median_s']:.1f}x per push, "
          f"{(sgl['median_s'] / sgl['bytes']) / (native['median_s'] / native['bytes']):.1f}x per byte")
    print(json.dumps(rows))
    write_result("bench_sglang_push", [{k: v for k, v in r.items() if k != "push_s"} for r in rows])


if __name__ == "__main__":
    main()
