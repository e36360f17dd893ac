"""Where the train/rollout log-prob gap left under routing replay comes from: one checkpoint, GRPO-shaped rollouts,
the engine's log-probs against the trainer's under several kernel choices, each side also against the exact answer.

    python benchmarks/bench_gap_sources.py --model-dir DIR --data FILE.jsonl [--template equation] [--prompts 16]
        [--n 8] [--max-new-tokens 16]
        [--variants default,engine_reference,engine_eager,torch_kda,fp32_head,torch_kda_fp32_head,fp32_res,
                    fp32_res_head,torch_kda_fp32_res_head,fp32]
        [--budget-gib 4] [--device cuda] [--dtype auto] [--fp32-gemm-reduction] [--seed 0] [--json OUT]

The first `--prompts` problems of FILE (id / problem / answer rows) rendered with `--template`, `--n` samples each
at temperature 1 from the policy adapter (LoRA at its initialisation, B = 0, as a run's first step: the policy is
the base, and the trainer's activations need gradients past the adapters), the engine returning its log-probs and
routes (`return_routed_experts`), as a training step's rollout does. The trainer's log-probs of the same tokens come
from the training forward (autograd on, eval mode, no autocast) with the engine's experts replayed
(`trainer.routing_replay`), all samples in one forward: what `train/rollout_logprob_abs_diff` compares. Variants
(each draws its own rollouts from the same prompts and sampling seeds):

* `default`: the run's setting (`--dtype`, auto: bf16 on CUDA; KDA by fla on CUDA, the engine's decode kernels and
  CUDA graphs);
* `engine_reference`: the engine under `reference_kernels()`: RMSNorm, SiTU, the attention-residual mix, the router
  and the KDA decode's short conv and gated norm in their torch forms (the forms the training forward runs);
* `engine_eager`: the engine with `decode=eager` (`model.step` on pooled copies: no paged-latent kernel, no graph);
* `torch_kda`: both sides with `model.kda_backend=torch_chunk` (the chunked form and its one-token step in torch,
  fp32 inside, on both sides: no fla kernel);
* `fp32_head`: the default with `model.fp32_lm_head=true` on both sides (the bf16 hidden state times the bf16
  lm_head weight in fp32, the logits not rounded to bf16);
* `torch_kda_fp32_head`: both of the above;
* `fp32_res`: the default with `model.fp32_residual=true` on both sides (the residual sources summed and mixed in
  fp32, each sublayer's normed input rounded to bf16 once); `fp32_res_head`: with fp32 logits as well;
  `torch_kda_fp32_res_head`: with KDA in torch as well;
* `fp32`: both sides in fp32 with torch_chunk (cuBLAS fp32 products, no TF32): a run's `model.dtype=fp32
  model.kda_backend=torch_chunk` (the trainer in fp32: trainer.autocast_bf16=off, the default).

`--fp32-gemm-reduction`: every model of the run built with `model.fp32_gemm_reduction=true` (process-wide: bf16
GEMMs reduce split-K partial sums in fp32; compare with a run without it).

Per variant (mean |a - b| per response token, nats): `gap` engine vs trainer (train/rollout_logprob_abs_diff) and
its p99; `engine_vs_exact` and `trainer_vs_exact`, each side against `exact`: the fp32 torch_chunk model's log-probs
of the same tokens with the same routes replayed (each side's own rounding; the gap is at most their sum);
`trainer_batch`: the trainer's log-probs with each sample alone in its forward against all samples in one
(batch variance: nonzero where a kernel's reduction order depends on the batch's shape); `nograd_gap`: the engine
against the trainer's no-gradient forward (`fill_old_logprobs`, the fused kernels where the engine has them);
`tokens`: the response tokens compared; `route_mismatch_frac`: the response tokens whose own top-k in the trainer's
replayed forward differs from the engine's routes in >= 1 MoE layer (train/route_mismatch_frac under replay). One
JSON line per variant (`--json OUT`: all of them).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
from dataclasses import replace

import torch
from record import write_result

from miles_k3.evals.datasets import DatasetConfig, load_problems
from miles_k3.evals.templates import render_prompt
from miles_k3.model.build import ModelConfig, build_model, build_tokenizer
from miles_k3.model.layers import reference_kernels
from miles_k3.model.lora import LoRAConfig, apply_lora, lora_parameters
from miles_k3.model.routing import replaying
from miles_k3.rollout.engine import RolloutEngine
from miles_k3.rollout.engine_config import EngineConfig
from miles_k3.trainer.batch import Sample, micro_batches, pack
from miles_k3.trainer.logprobs import token_logprobs
from miles_k3.trainer.rollouts import RolloutConfig
from miles_k3.trainer.scoring import to_sample as _sample
from miles_k3.trainer.step import _eval_mode, _mismatch_frac
from miles_k3.utils.runtime import resolve_device, resolve_dtype

POLICY = "policy"
VARIANTS = ("default", "engine_reference", "engine_eager", "torch_kda", "fp32_head", "torch_kda_fp32_head",
            "fp32_res", "fp32_res_head", "torch_kda_fp32_res_head", "fp32")
ONE_FORWARD = 1 << 40  # micro_batch_tokens: every sample in one forward
ALONE = 1  # micro_batch_tokens: each sample in a forward of its own


def rollouts(engine: RolloutEngine, prompts: list[list[int]], n: int, max_new_tokens: int, stops: list[int],
             seed: int) -> list[Sample]:
    """n samples per prompt at temperature 1 from the policy adapter, with the engine's log-probs and routes."""
    params = [{"max_new_tokens": max_new_tokens, "temperature": 1.0, "stop_token_ids": list(stops),
               "sampling_seed": seed + 1000 * i} for i in range(len(prompts))]
    outs = engine.generate(input_ids=prompts, sampling_params=params, n=n, return_logprob=True, lora=POLICY,
                           return_routed_experts=True)
    bad = next((o for o in outs if "error" in o), None)
    if bad is not None:
        raise RuntimeError(f"the engine rejected a request: {bad['error']}")
    plain = RolloutConfig()  # no overlong handling: every sample in the loss, as the loop builds it by default
    return [_sample(list(prompts[i // n]), o, 0.0, plain) for i, o in enumerate(outs)]


def trainer_logprobs(model, samples: list[Sample], pad_id: int, micro_batch_tokens: int,
                     grad: bool = True) -> tuple[list[list[float]], float]:
    """Each sample's response log-probs from the trainer's forward with the engine's routes replayed, in eval mode
    and without autocast, and the share of response tokens whose own top-k in that forward differs from the
    engine's routes in >= 1 MoE layer (train/route_mismatch_frac, as the loop measures it under replay).
    grad=True: the training forward (`_micro_step`'s, whose log-probs the loop compares with the engine's): autograd
    on, so past the adapters every activation needs a gradient and the fused inference kernels step aside for the
    torch forms; grad=False: the no-gradient forward (`fill_old_logprobs`), which takes the fused kernels where the
    engine does."""
    device = next(model.parameters()).device
    out: list[list[float]] = [[] for _ in samples]
    differ = tokens = 0.0
    for idx in micro_batches(samples, micro_batch_tokens):
        mb = pack([samples[i] for i in idx], pad_id, model.config.vocab_size).to(device)
        with torch.set_grad_enabled(grad), replaying(model, mb.routes_NLK) as own, _eval_mode(model):
            logits = model(mb.input_ids_BT, seq_lens=mb.seq_lens_B).logits
            logp_BT = token_logprobs(logits, mb.targets_BT).detach().float().cpu()
        differ += _mismatch_frac(own, mb) * mb.num_tokens
        tokens += mb.num_tokens
        for row, i in enumerate(idx):
            p, n = len(samples[i].prompt_ids), samples[i].length - 1
            out[i] = logp_BT[row, p - 1:n].tolist()
    return out, differ / tokens


def abs_diffs(a: list[list[float]], b: list[list[float]]) -> list[float]:
    """|a - b| per token over all samples; raises if the samples' token counts differ."""
    out = []
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if len(x) != len(y):
            raise ValueError(f"sample {i}: {len(x)} log-probs against {len(y)}")
        out += [abs(u - v) for u, v in zip(x, y)]
    return out


def p99(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, int(0.99 * len(xs)))]


def summary(engine_lp, trainer_lp, exact_lp, alone_lp, nograd_lp) -> dict:
    gap = abs_diffs(engine_lp, trainer_lp)
    return {"tokens": len(gap), "gap": statistics.fmean(gap), "gap_p99": p99(gap),
            "engine_vs_exact": statistics.fmean(abs_diffs(engine_lp, exact_lp)),
            "trainer_vs_exact": statistics.fmean(abs_diffs(trainer_lp, exact_lp)),
            "trainer_batch": statistics.fmean(abs_diffs(trainer_lp, alone_lp)),
            "nograd_gap": statistics.fmean(abs_diffs(engine_lp, nograd_lp))}


def run(argv: list[str]) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--data", required=True, help="a .jsonl of id / problem / answer rows")
    ap.add_argument("--template", default="equation")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--budget-gib", type=float, default=4.0, help="each engine's memory budget")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp32"),
                    help="the run's dtype (auto: bf16 on CUDA, fp32 on the CPU); `fp32` is always fp32")
    ap.add_argument("--fp32-gemm-reduction", action="store_true",
                    help="model.fp32_gemm_reduction=true for every model (bf16 GEMMs reduce in fp32; process-wide)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, metavar="OUT")
    a = ap.parse_args(argv)
    variants = a.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"--variants: {unknown} not among {list(VARIANTS)}")
    device = resolve_device(a.device)
    run_dtype = resolve_dtype(a.dtype, device)
    base_cfg = ModelConfig(path=a.model_dir, fp32_gemm_reduction=a.fp32_gemm_reduction)
    tokenizer, stops = build_tokenizer(base_cfg)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0  # as the train loop packs
    problems = load_problems(DatasetConfig(source=a.data, problem_field=None, limit=a.prompts))
    prompts = [tokenizer.encode(render_prompt(a.template, p.problem, tokenizer), add_special_tokens=False)
               for p in problems]
    models: dict[tuple, torch.nn.Module] = {}
    lora = LoRAConfig()

    def model(key: tuple):  # (kda backend, dtype, fp32 lm_head, fp32 residual): built once each, on first use
        if key not in models:
            backend, dtype, head, res = key
            built = build_model(replace(base_cfg, kda_backend=backend, fp32_lm_head=head, fp32_residual=res), device,
                                dtype)
            apply_lora(built, lora)  # as the train loop: B = 0, the policy is the base
            models[key] = built
        return models[key]

    run_key, torch_key = ("auto", run_dtype, False, False), ("torch_chunk", run_dtype, False, False)
    exact_key = ("torch_chunk", torch.float32, False, False)
    # variant -> (model of both sides, engine decode, reference kernels in the engine)
    plan = {"default": (run_key, "auto", False), "engine_reference": (run_key, "auto", True),
            "engine_eager": (run_key, "eager", False), "torch_kda": (torch_key, "auto", False),
            "fp32_head": (("auto", run_dtype, True, False), "auto", False),
            "torch_kda_fp32_head": (("torch_chunk", run_dtype, True, False), "auto", False),
            "fp32_res": (("auto", run_dtype, False, True), "auto", False),
            "fp32_res_head": (("auto", run_dtype, True, True), "auto", False),
            "torch_kda_fp32_res_head": (("torch_chunk", run_dtype, True, True), "auto", False),
            "fp32": (exact_key, "auto", False)}
    results = []
    for v in variants:
        key, decode, ref = plan[v]
        m = model(key)
        econf = EngineConfig(memory_budget_bytes=int(a.budget_gib * 2**30), decode=decode,
                             max_context=max(map(len, prompts)) + a.max_new_tokens + 1)
        engine = RolloutEngine(m, econf, lora=lora, tokenizer=tokenizer)
        engine.load_lora_adapter_from_tensors(POLICY, {k: p.detach() for k, p in lora_parameters(m).items()},
                                              lora)
        with reference_kernels() if ref else contextlib.nullcontext():
            samples = rollouts(engine, prompts, a.n, a.max_new_tokens, stops, a.seed)
        del engine
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        engine_lp = [s.rollout_logprobs for s in samples]
        trainer_lp, mismatch = trainer_logprobs(m, samples, pad_id, ONE_FORWARD)
        alone_lp, _ = trainer_logprobs(m, samples, pad_id, ALONE)
        nograd_lp, _ = trainer_logprobs(m, samples, pad_id, ONE_FORWARD, grad=False)
        exact_lp, _ = trainer_logprobs(model(exact_key), samples, pad_id, ONE_FORWARD)
        row = {"variant": v, "engine_decode": decode, "dtype": str(m.lm_head.weight.dtype),
               "fp32_gemm_reduction": a.fp32_gemm_reduction,
               **summary(engine_lp, trainer_lp, exact_lp, alone_lp, nograd_lp), "route_mismatch_frac": mismatch}
        print(json.dumps(row), flush=True)
        results.append(row)
        if a.json:
            with open(a.json, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in results)
    return results


if __name__ == "__main__":
    write_result("bench_gap_sources", run(sys.argv[1:]))
