"""What the precision switches of the train/rollout gap cost, measured in ONE process: a GRPO train step and an
engine rollout per setting, the settings taking turns round after round (so that a drift of the machine's speed
falls on all alike; separate runs of the loop differ by more than these switches cost, docs/concepts/train-rollout-gap.md).

    python benchmarks/bench_precision_switches.py [--model k3_m2] [--device auto] [--rounds 10]
        [--settings plain,fp32_head,fp32_res,fp32_res_head,fp32_gemm,all] [--seqs 128] [--prompt 16] [--response 16]
        [--new-tokens 16] [--micro-batch-tokens 16384] [--budget-gib 2] [--json OUT]

Settings (each a combination of `model.fp32_lm_head`, `model.fp32_residual` and `model.fp32_gemm_reduction`):
`plain` (none), `fp32_head`, `fp32_res`, `fp32_res_head`, `fp32_gemm` (torch's bf16 reduced-precision reduction
off) and `all`. The model's two flags are attributes read at every forward, so the trainer switches them between
steps; torch's GEMM setting is process-wide and read at every eager GEMM, so it is set before each step (the
config's one-way rule is for runs, not for this bench). The engine captures its decode graphs with the setting it
was built under, so each setting has its own engine over the one shared base (built while its setting holds).

The base is a random init (MXFP4 routed experts; bf16 on CUDA, fp32 on CPU, where every switch but the logits'
dtype is a no-op), LoRA rank 32 at its init. Per round and setting: one `train_step` over `--seqs` synthetic samples
of `--prompt` + `--response` tokens, and one rollout of `--seqs` prompts x `--new-tokens` tokens (ignore_eos) at
temperature 1 through that setting's engine; the first round warms every setting up and is not counted. Printed
per setting: median train step and rollout time, and their ratios to plain's paired by round (mean, standard
error, median).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from record import write_result

from miles_k3.model.build import ModelConfig, build_model, build_tokenizer
from miles_k3.model.lora import LoRAConfig, apply_lora, lora_parameters
from miles_k3.rollout.engine import RolloutEngine
from miles_k3.rollout.engine_config import EngineConfig
from miles_k3.trainer.batch import Sample
from miles_k3.trainer.optim import OptimConfig, build_optimizer, build_scheduler
from miles_k3.trainer.step import TrainerConfig, train_step
from miles_k3.utils.runtime import resolve_device, resolve_dtype

POLICY = "policy"
SETTINGS = {  # name -> (fp32_lm_head, fp32_residual, fp32_gemm_reduction)
    "plain": (False, False, False), "fp32_head": (True, False, False), "fp32_res": (False, True, False),
    "fp32_res_head": (True, True, False), "fp32_gemm": (False, False, True), "all": (True, True, True)}


def apply_setting(model, name: str) -> None:
    """Put `model` (and the process's bf16 GEMM reduction) in setting `name`."""
    head, res, gemm = SETTINGS[name]
    model.fp32_lm_head, model.model.fp32_residual = head, res
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = not gemm


def paired(ratios: list[float]) -> dict:
    """Mean, standard error and median of per-round ratios."""
    se = statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else 0.0
    return {"mean": statistics.fmean(ratios), "se": se, "median": statistics.median(ratios)}


def run(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="k3_m2")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--rounds", type=int, default=10, help="timed rounds (plus one warm-up round)")
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--seqs", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--response", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--micro-batch-tokens", type=int, default=16384)
    ap.add_argument("--budget-gib", type=float, default=2.0, help="each setting's engine memory budget")
    ap.add_argument("--json", default=None, metavar="OUT")
    a = ap.parse_args(argv)
    names = a.settings.split(",")
    unknown = sorted(set(names) - set(SETTINGS))
    if unknown or "plain" not in names:
        raise SystemExit(f"--settings: {unknown} not among {list(SETTINGS)}" if unknown else
                         "--settings: include plain (the ratios are to it)")
    if a.rounds < 1:
        raise SystemExit("--rounds: at least 1")
    device = resolve_device(a.device)
    cuda = device.type == "cuda"
    before = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    torch.manual_seed(0)
    cfg = ModelConfig(name=a.model)
    model = build_model(cfg, device, resolve_dtype("auto", device))
    tokenizer, _ = build_tokenizer(cfg)
    lora = LoRAConfig(rank=32, alpha=64)
    apply_lora(model, lora)
    params = lora_parameters(model)
    opt = build_optimizer(params, OptimConfig(lr=1e-9))
    sched = build_scheduler(opt, OptimConfig(lr=1e-9))
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    samples = [Sample(torch.randint(1, vocab, (a.prompt,), generator=g).tolist(),
                      torch.randint(1, vocab, (a.response,), generator=g).tolist(),
                      advantage=float(torch.randn((), generator=g))) for _ in range(a.seqs)]
    prompts = [s.prompt_ids for s in samples]
    tcfg = TrainerConfig(micro_batch_tokens=a.micro_batch_tokens)
    params_sampling = {"max_new_tokens": a.new_tokens, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 0}
    engines = {}
    try:
        for name in names:  # each engine captures its graphs under its own setting
            apply_setting(model, name)
            econf = EngineConfig(memory_budget_bytes=int(a.budget_gib * 2**30), max_context=a.prompt + a.new_tokens + 1)
            engine = RolloutEngine(model, econf, lora=lora, tokenizer=tokenizer)
            engine.load_lora_adapter_from_tensors(POLICY, {k: p.detach() for k, p in params.items()}, lora)
            engines[name] = engine

        def timed(fn) -> float:
            if cuda:
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize(device)
            return time.perf_counter() - t0

        times = {n: {"train_s": [], "rollout_s": []} for n in names}
        for r in range(a.rounds + 1):
            for name in names if r % 2 == 0 else names[::-1]:  # alternate the order: no setting always first
                apply_setting(model, name)
                train = timed(lambda: train_step(model, samples, tcfg, opt, sched, params, 0, device))
                rollout = timed(lambda n=name: engines[n].generate(input_ids=prompts, sampling_params=params_sampling,
                                                                   lora=POLICY))
                if r:  # round 0 warms up: compiles, graph captures, allocator
                    times[name]["train_s"].append(train)
                    times[name]["rollout_s"].append(rollout)
    finally:
        apply_setting(model, "plain")
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = before
        engines.clear()
    report = {"model": a.model, "device": str(device), "rounds": a.rounds, "seqs": a.seqs,
              "tokens_per_step": a.seqs * (a.prompt + a.response), "new_tokens": a.new_tokens, "settings": {}}
    for name in names:
        row = {k: statistics.median(v) for k, v in times[name].items()}
        for k in ("train_s", "rollout_s"):
            row[f"{k}_over_plain"] = paired([x / p for x, p in zip(times[name][k], times["plain"][k])])
        report["settings"][name] = row
        print(json.dumps({"setting": name, **row}), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    write_result("bench_precision_switches", run())
