"""Our K3 against itself: prompt log-probs of one checkpoint in bf16 against fp32, the rounding floor that
bench_sglang_k3.py judges SGLang's gap by (its `floor_mean`), here without SGLang, on any device:

    python benchmarks/bench_rounding_floor.py --model-dir DIR [--pin-routes DIR2] [--prompts 2] [--tokens 256]
                                              [--device cpu] [--seed 0]

Prompts are bench_sglang_k3's seeded random ids; `--pin-routes` serves its pinned copy (every MoE layer's routers
pick the same top_k experts whatever the rounding). One JSON line: mean / max |bf16 - fp32| per prompt token
(nats/token), the share of positions whose argmax agrees, and the fp32 log-probs' spread.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from logprob_compare import logprob_gap, our_argmax, pin_routes, random_prompts, spread
from record import write_result

from miles_k3.model.build import ModelConfig, build_model, build_tokenizer
from miles_k3.model.weight_files import inspect_weights
from miles_k3.trainer.step import sequence_logprobs
from miles_k3.utils.runtime import resolve_device


def run(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--pin-routes", default=None, metavar="DIR")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    model_dir, pinned = a.model_dir, None
    if a.pin_routes:
        top_k = inspect_weights(model_dir).config.num_experts_per_token
        pinned = len(pin_routes(model_dir, a.pin_routes, top_k, a.seed))
        model_dir = a.pin_routes
    device, mcfg = resolve_device(a.device), ModelConfig(path=model_dir)
    tokenizer, stops = build_tokenizer(mcfg)
    models = {dt: build_model(mcfg, device, dt).eval() for dt in (torch.bfloat16, torch.float32)}
    prompts = random_prompts(a.prompts, a.tokens, models[torch.float32].config.vocab_size,
                             set(tokenizer.all_special_ids) | set(stops), a.seed)
    lp = {dt: [sequence_logprobs(m, p) for p in prompts] for dt, m in models.items()}
    top = {dt: [our_argmax(m, p) for p in prompts] for dt, m in models.items()}
    agree = [x == y for a_, b_ in zip(top[torch.bfloat16], top[torch.float32]) for x, y in zip(a_, b_)]
    return {"model_dir": str(model_dir), "pinned_moe_layers": pinned, "device": str(device),
            **logprob_gap(lp[torch.float32], lp[torch.bfloat16]), "argmax_agree": sum(agree) / len(agree),
            "fp32_spread": spread(lp[torch.float32])}


if __name__ == "__main__":
    result = run(sys.argv[1:])
    print(json.dumps(result), flush=True)
    write_result("bench_rounding_floor", result)
