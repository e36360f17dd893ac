"""Rollout engine decode throughput on one GPU (k3_m, MXFP4 experts, bf16) against a plain decode loop over the
same model and against the HBM roofline.

    python benchmarks/bench_engine_gpu.py [--batches 1,64,256] [--prompt 32] [--new 64] [--grpo 64x8:512+512]
                                          [--decode auto|eager|static] [--lora-rank R [--merge-lora]]
                                          [--mxfp4-experts auto|torch|triton] [--no-fuse-projections]
                                          [--repeats N] [--no-plain] [--json out.json]

* engine: `RolloutEngine.generate` of B prompts (n=1), `max_new_tokens` new tokens each, temperature 1,
  ignore_eos; tokens/s = B * new / wall time of the call (prefill included). Decode: CUDA graphs by default
  (captured during the warm-up, per batch bucket), `--decode eager` for the eager engine.
* plain loop: one batched prefill of the same prompts into a contiguous `K3State`, then `model.step` +
  multinomial sampling in a Python loop; tokens/s measured the same way.
* roofline: one decode step must read every weight it touches (non-expert bf16 weights except the embedding
  table, all MXFP4 experts once B * top-k covers them, else the expected distinct experts), the KDA state of
  every request (fp32 recurrent, read and written, plus the conv window) and its MLA latents at the mean
  context; tokens/s = B / (bytes / 4.25 TB/s).
* grpo: P prompts x n samples, prompt + new tokens, through the engine (group fork).
* `--lora-rank R`: as in RL, an adapter of rank R (alpha 2R) on every linear target (LINEAR_TARGETS, as
  recipe=k3_m2_reasoning adapts), its B random, served by the engine as "policy" and applied to the plain loop's
  model too; without it, the base alone (no adapter modules at all).
* `--merge-lora` (with `--lora-rank`): the engine serves the adapter through merged dense weights
  (`engine.merge_lora`: one GEMM per adapted linear; the routed experts' adapters stay unmerged); the plain loop
  keeps the unmerged adapter. The figures record `merge_lora` and `rebind_s`, the wall time of re-merging (or
  recasting) every adapter module after a push (`AdapterBank.bind`).
* `--no-fuse-projections`: the decode step computes every linear on its own (`engine.fuse_projections=false`);
  by default the linears that read one input are one GEMM (+ 2 for an unmerged adapter). Recorded as
  `fuse_projections`.
* `--mxfp4-experts`: the routed experts' backend (`kernels.mxfp4_experts`; auto takes the fused kernel for a
  projection of at most 64 rows (`FUSED_MAX_ROWS`) and keeps k3_m's small projections of more rows on dequantize +
  grouped matmul, triton forces the fused kernel, which reads only the experts a step routes to).
* `--repeats N`: each batch's engine call timed N times; the row keeps the median and every time. `--no-plain`
  skips the plain loop (about 18 s a batch at 256 new tokens), so the ratio to it is not recorded.
"""
import argparse
import json
import statistics
import time

import torch
from record import write_result

from miles_k3.model import K3Config, K3ForCausalLM
from miles_k3.model.experts import RoutedExperts, set_mxfp4_experts_backend
from miles_k3.model.lora import LINEAR_TARGETS, LoRAConfig, apply_lora, lora_parameters, lora_state_dict
from miles_k3.rollout.engine import EngineConfig, RolloutEngine

HBM_BYTES_PER_S = 4.25e12


def build():
    cfg = K3Config.from_name("k3_m")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = K3ForCausalLM(cfg, kda_backend="fla", expert_format="mxfp4").cast(torch.bfloat16)
    return cfg, model.eval().requires_grad_(False)


def roofline_tokens_per_s(model: K3ForCausalLM, batch: int, context: int) -> float:
    cfg = model.config
    dense = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    experts = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    touched = 1 - (1 - cfg.num_experts_per_token / cfg.num_experts) ** batch  # expected share of experts hit
    expert_bytes = sum(b.numel() for m in experts for b in m.buffers()) * touched
    lac = cfg.linear_attn_config
    kda = len(cfg.kda_layer_ids) * (2 * lac.num_heads * lac.head_dim ** 2 * 4
                                   + 3 * lac.num_heads * lac.head_dim * (lac.short_conv_kernel_size - 1) * 2)
    mla = len(cfg.mla_layer_ids) * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2 * context
    step_bytes = dense + expert_bytes + batch * (kda + mla)
    return batch / (step_bytes / HBM_BYTES_PER_S)


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def plain_loop(model, prompts: torch.Tensor, new: int) -> None:
    out = model(prompts[:, :-1], return_state=True)
    state, ids = out.state, prompts[:, -1]
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for _ in range(new):
            step = model.step(ids, state)
            state = step.state
            ids = torch.multinomial(torch.softmax(step.logits.float(), -1), 1, generator=g)[:, 0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--grpo", default="64x8:512+512", help="PxN:prompt+new, or 'none'")
    ap.add_argument("--budget-gib", type=float, default=24.0)
    ap.add_argument("--decode", default="auto", help="engine decode mode: auto (graph on CUDA), eager, static")
    ap.add_argument("--lora-rank", type=int, default=0, help="an RL-shaped adapter of this rank (0: none)")
    ap.add_argument("--merge-lora", action="store_true", help="serve the adapter merged (engine.merge_lora)")
    ap.add_argument("--mxfp4-experts", default="auto", choices=["auto", "torch", "triton"])
    ap.add_argument("--no-fuse-projections", action="store_true", help="engine.fuse_projections=false")
    ap.add_argument("--repeats", type=int, default=1, help="timed engine calls per batch (the median is kept)")
    ap.add_argument("--no-plain", action="store_true", help="skip the plain model.step loop")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.merge_lora and not args.lora_rank:
        ap.error("--merge-lora needs an adapter: give --lora-rank R")
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    set_mxfp4_experts_backend(args.mxfp4_experts)
    cfg, model = build()
    econf = EngineConfig(memory_budget_bytes=int(args.budget_gib * 2**30), page_size=64, max_context=1088,
                         prefill_chunk=1024, decode=args.decode, merge_lora=args.merge_lora,
                         fuse_projections=not args.no_fuse_projections)
    lora, name = None, None
    if args.lora_rank:
        lora, name = LoRAConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank, targets=list(LINEAR_TARGETS)), "policy"
        apply_lora(model, lora)
        with torch.no_grad():
            for n, p in lora_parameters(model).items():
                if "lora_B" in n:
                    p.normal_(0, 0.01)
    engine = RolloutEngine(model, econf, lora=lora)
    if lora:
        engine.load_lora_adapter_from_tensors(name, lora_state_dict(model), lora)
    params = {"temperature": 1.0, "max_new_tokens": args.new, "ignore_eos": True}
    results = {"model": "k3_m", "experts": "mxfp4", "slots": engine.num_slots, "decode": engine.decode_mode,
               "lora_rank": args.lora_rank, "merge_lora": args.merge_lora, "mxfp4_experts": args.mxfp4_experts,
               "fuse_projections": not args.no_fuse_projections, "repeats": args.repeats, "rows": []}
    with torch.no_grad():
        for b in map(int, args.batches.split(",")):  # warm up: kernels compiled, graphs captured per bucket
            engine.generate(input_ids=[[1] * args.prompt] * b, sampling_params=params, lora=name)
        if not args.no_plain:
            plain_loop(model, torch.randint(0, cfg.vocab_size, (2, 4), device="cuda"), 4)
        for b in map(int, args.batches.split(",")):
            prompts = torch.randint(0, cfg.vocab_size, (b, args.prompt), device="cuda")
            times = [timed(lambda p=prompts: engine.generate(input_ids=p.tolist(), sampling_params=params, lora=name))
                     for _ in range(args.repeats)]
            t_engine = statistics.median(times)
            row = {"batch": b, "engine_tok_s": b * args.new / t_engine, "engine_s": times,
                   "roofline_tok_s": roofline_tokens_per_s(model, b, args.prompt + args.new // 2)}
            if not args.no_plain:
                row["plain_tok_s"] = b * args.new / timed(lambda p=prompts: plain_loop(model, p, args.new))
                row["engine_over_plain"] = row["engine_tok_s"] / row["plain_tok_s"]
            row["engine_over_roofline"] = row["engine_tok_s"] / row["roofline_tok_s"]
            print(json.dumps(row), flush=True)
            results["rows"].append(row)
        if lora:  # a push of the same values: the next bind re-merges (or recasts) every adapter module
            engine.update_weights_from_tensor(lora_state_dict(model), lora_name=name)
            results["rebind_s"] = timed(lambda: engine.adapters.bind(name, engine.weight_version))
            print(json.dumps({"rebind_s": results["rebind_s"]}), flush=True)
        if args.grpo != "none":
            shape, lens = args.grpo.split(":")
            p, n = map(int, shape.split("x"))
            plen, new = map(int, lens.split("+"))
            prompts = torch.randint(0, cfg.vocab_size, (p, plen)).tolist()
            gp = {**params, "max_new_tokens": new}
            engine.generate(input_ids=prompts, sampling_params=gp, n=n, lora=name)  # warm up: every bucket it meets
            t = timed(lambda: engine.generate(input_ids=prompts, sampling_params=gp, n=n, lora=name))
            results["grpo"] = {"prompts": p, "n": n, "prompt_len": plen, "new": new, "wall_s": t,
                               "new_tok_s": p * n * new / t}
            print(json.dumps(results["grpo"]), flush=True)
    write_result("bench_engine_gpu", results, out=args.json)


if __name__ == "__main__":
    main()
