"""Real-width K3 layers on one GPU: the MXFP4 experts, each layer of a 4-layer K3, and engine decode, with the
fused expert matmul (`--backends triton`) and the old dequantize-then-grouped-mm path (`torch`) side by side,
each against its bound measured in the same run.

    python benchmarks/bench_k3_layers_gpu.py [--parts kernels,experts,kda,model,engine] [--backends triton,torch]
                                             [--tokens 4096] [--batches 64,256] [--engine-backends triton]
                                             [--engine-variants fla,kda]
                                             [--configs new,nochunk,legacy] [--elementwise fused,reference]
                                             [--no-train] [--no-tune-train] [--json OUT]

`--configs`: the fused kernel's tilings, `pick_config` ("new") and/or `legacy_config` ("legacy": before the
one-multiply decode and split dots), each run in turn in the experts and engine parts (before/after rows of one
run); "nochunk": `pick_config` without the chunked kernel. `--elementwise`: the experts part with the fused
SiTU-GLU (forward and, in training, backward: "fused") and/or its torch reference ("reference"), each in turn.
`--no-train`: the experts part's decode steps only; `--no-tune-train`: the kernels part's decode batches
only.

* kernels: one projection's fused kernel (O 3072 x In 3584, forward and input gradient) per candidate tile
  config at `--tokens` (training) and each decode batch, against that projection's bound.
* experts: one MoE layer's routed experts at K3 width (896 MXFP4 experts, latent 3584 x 3072, top-16; random
  codes and scales, random routing): training forward and backward (input gradient) over `--tokens` tokens, and
  a decode step at each of `--batches` (captured CUDA graph under `sync_free_experts()`), plus a kernel profile
  of one triton forward+backward and of one decode step per batch (its launches run eagerly). Bounds: expert GEMM FLOPs / the measured bf16 GEMM rate (8192^3 torch.mm), and
  the MXFP4 bytes of the experts that received rows / the measured copy bandwidth (a 4 GiB device copy, read +
  write bytes per second); the bound is the larger of the two.
* model: `K3Config.from_name("k3")` cut to 4 layers (0: KDA + dense MLP, 1-2: KDA + MoE, 3: MLA + MoE; fla KDA
  kernels), MXFP4 experts, LoRA rank 32 on the default targets. Per layer: forward and backward over 1 x
  `--tokens` (each layer run alone on the inputs the model gives it), the MoE block alone, its decode step per
  batch, and one whole-model training step; peak memory.
* kda: one layer's KDA decode recurrence at each decode batch (96 heads of 128 x 128 fp32 state), fla's kernel
  (today's path) and `kernels.kda_decode.kda_recurrent_step` per tile config, against the state's read + write
  bound; the fastest config is used by the engine's `kda` rows.
* engine: `RolloutEngine` graph decode of `max(--batches)` prompts (32 tokens, 64 new, LoRA "policy"):
  tokens/s (prefill included; after an 8-token warm-up, and again with every graph captured), the prefill share
  and peak reserved memory, per `--engine-backends` and `--engine-variants` (`ENGINE_VARIANTS`: `fla`, the
  engine's KDA decode as it is; `kda`: `kernels.kda_decode.kda_recurrent_step` swapped in for the run). The
  engine holds num_slots = b requests at once (its graph decoder's padding row has a slot of its own).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch
from gpu_measure import capture, copy_bandwidth, gemm_rate, timed_ms, top_kernels
from record import write_result

from miles_k3.kernels.mxfp4 import mxfp4_nbytes
from miles_k3.model import K3Config, K3ForCausalLM
from miles_k3.model.experts import RoutedExperts, mxfp4_experts_backend, sync_free_experts
from miles_k3.model.layers import reference_kernels

TOP_K, NUM_EXPERTS, LATENT, INTER = 16, 896, 3584, 3072


@contextlib.contextmanager
def kernel_configs(name: str):
    """Within the block the fused kernel takes its tilings from `pick_config` ("new"), `pick_config` without the
    chunked kernel ("nochunk") or `legacy_config` ("legacy": the kernel before the one-multiply decode and split
    dots), for before/after rows in one run."""
    import miles_k3.kernels.mxfp4_moe as mk

    before = mk.pick_config
    mk.pick_config = {"new": before, "legacy": mk.legacy_config,
                      "nochunk": lambda *a: mk._tiling(*a, chunked=False)}[name]
    try:
        yield
    finally:
        mk.pick_config = before


# ---- building ----------------------------------------------------------------------------------------------
@torch.no_grad()
def fill_random_mxfp4(experts: RoutedExperts, seed: int = 0) -> None:
    """Random FP4 codes and E8M0 scales 117..121 (|w| up to 6 * 2^-6: a trained model's range) in place."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    for name in ("w1", "w2", "w3"):
        packed, scale = experts.get_buffer(f"{name}_packed"), experts.get_buffer(f"{name}_scale")
        for e0 in range(0, packed.shape[0], 128):  # chunks: bounds the int64 temporaries of randint
            packed[e0:e0 + 128] = torch.randint(0, 256, packed[e0:e0 + 128].shape, generator=g, device="cuda",
                                                dtype=torch.int16).to(torch.uint8)
            scale[e0:e0 + 128] = torch.randint(117, 122, scale[e0:e0 + 128].shape, generator=g, device="cuda",
                                               dtype=torch.int16).to(torch.uint8)


def routing(n_tok: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.rand(n_tok, NUM_EXPERTS, device="cuda", generator=g).topk(TOP_K, dim=-1).indices
    w = torch.rand(n_tok, TOP_K, device="cuda", generator=g)
    return ids, w / w.sum(-1, keepdim=True)


def expert_bound(ids: torch.Tensor, bw: float, rate: float, latent: int = LATENT, inter: int = INTER) -> dict:
    """Bound of one experts forward (or input-gradient) pass for routing ids: max(FLOPs / rate, bytes / bw)."""
    rows = ids.numel()
    hit = int(torch.unique(ids).numel())
    flops = 2 * rows * 3 * latent * inter
    nbytes = hit * (2 * mxfp4_nbytes(inter, latent) + mxfp4_nbytes(latent, inter))
    return {"flops": flops, "mxfp4_bytes_read": nbytes, "experts_hit": hit, "gemm_ms": flops / rate * 1e3,
            "read_ms": nbytes / bw * 1e3, "bound_ms": max(flops / rate, nbytes / bw) * 1e3}


def k3_four_layers() -> K3Config:
    raw = K3Config.from_name("k3").to_dict()
    raw["num_hidden_layers"] = 4
    raw["linear_attn_config"] = {**raw["linear_attn_config"], "kda_layers": [1, 2, 3], "full_attn_layers": [4]}
    return K3Config.from_dict(raw, source="k3 cut to 4 layers")


def build_model(cfg: K3Config) -> K3ForCausalLM:
    """Random-init bf16 model with random MXFP4 experts, built on the meta device first: no bf16 expert weights
    and no per-expert quantization are ever materialised."""
    with torch.device("meta"):
        model = K3ForCausalLM(cfg, kda_backend="fla", expert_format="mxfp4")
    model.to_empty(device="cuda")
    for i, m in enumerate(mod for mod in model.modules() if isinstance(mod, RoutedExperts)):
        m.reset_parameters = lambda *a, m=m, i=i, **k: fill_random_mxfp4(m, seed=i)  # instead of quantizing
    model.reset_parameters()
    return model.cast(torch.bfloat16)


# ---- parts ---------------------------------------------------------------------------------------------------
# bm,bn,bk,warps,stages,decode[,swap][,s2d: per-group scale loads][,nopf: Triton's pipeliner, no hand prefetch]
# [,fast: one-multiply decode][,split: lo/hi halves into two dots][,chunks=C1-C2-C3: the chunked kernel, bm their
# sum]; the first of each list is the legacy pick
TUNE_TRAIN = ["128,64,128,4,3,asm,swap,s2d,nopf", "128,64,128,4,3,asm,swap,s2d,nopf,fast",
              "128,128,128,8,3,asm,swap,s2d,nopf,fast", "128,64,128,4,4,asm,swap,s2d,nopf,fast",
              "112,128,128,8,3,asm,swap,s2d,nopf,fast,chunks=64-32-16",
              "112,64,128,4,3,asm,swap,s2d,nopf,fast,chunks=64-32-16",
              "112,128,64,8,4,asm,swap,s2d,nopf,fast,chunks=64-32-16",
              "112,64,256,4,3,asm,swap,s2d,nopf,fast,chunks=64-32-16",
              "112,64,128,4,4,asm,swap,s2d,nopf,fast,chunks=64-32-16",
              "112,64,64,4,4,asm,swap,s2d,nopf,fast,chunks=64-32-16",
              "96,64,128,4,3,asm,swap,s2d,nopf,fast,chunks=64-16-16"]
TUNE_DECODE = ["16,128,128,4,4,asm,s2d,nopf", "16,256,128,4,3,asm,s2d,nopf,fast,split",
               "16,256,128,4,4,asm,s2d,nopf,fast,split", "16,256,128,4,2,asm,s2d,nopf,fast,split",
               "16,256,64,4,4,asm,s2d,nopf,fast,split", "16,512,64,4,3,asm,s2d,nopf,fast,split",
               "16,256,256,8,2,asm,s2d,nopf,fast,split", "16,512,128,8,3,asm,s2d,nopf,fast,split"]


def tile_config(spec: str):
    """The TileConfig of a spec string (the TUNE_* lists' syntax above)."""
    from miles_k3.kernels.mxfp4_moe import TileConfig

    bm, bn, bk, nw, ns, dec, *flags = spec.split(",")
    chunks = [tuple(int(c) for c in f.removeprefix("chunks=").split("-")) for f in flags if f.startswith("chunks=")]
    return TileConfig(int(bm), int(bn), int(bk), int(nw), int(ns), dec, "swap" in flags, "s2d" in flags,
                      "nopf" not in flags, "fast" in flags, "split" in flags, chunks[0] if chunks else None)


def kernels_part(args, bw: float, rate: float) -> list[dict]:
    """One projection's kernel (w1/w3 shape O=3072, In=3584; forward and input gradient) per tile config."""
    from miles_k3.kernels.mxfp4_moe import mxfp4_moe_matmul

    with torch.device("cuda"):
        m = RoutedExperts(NUM_EXPERTS, LATENT, INTER, 4.0, 25.0, expert_format="mxfp4")
    fill_random_mxfp4(m)
    packed, scale = m.w1_packed, m.w1_scale
    rows = []
    for n_tok, configs in [(args.tokens, TUNE_TRAIN)] * bool(args.tune_train) + [(b, TUNE_DECODE)
                                                                                 for b in args.batches]:
        ids, _ = routing(n_tok, 3)
        counts = torch.bincount(ids.view(-1), minlength=NUM_EXPERTS).tolist()
        ends = torch.tensor(counts, device="cuda").cumsum(0).int()
        hit = sum(1 for c in counts if c)
        m_rows = ids.numel()
        bound = max(2 * m_rows * INTER * LATENT / rate, hit * mxfp4_nbytes(INTER, LATENT) / bw) * 1e3
        for transpose in (False, True) if n_tok not in args.batches else (False,):  # decode: forward only
            x = torch.randn(m_rows, INTER if transpose else LATENT, device="cuda", dtype=torch.bfloat16)
            for spec in configs:
                cfg = tile_config(spec)
                try:
                    rows_of = ends if n_tok in args.batches else counts  # decode: device ends, as captured
                    ms = timed_ms(lambda x=x, cfg=cfg, t=transpose, r=rows_of: mxfp4_moe_matmul(
                        x, r, packed, scale, transpose=t, config=cfg), iters=5)
                except Exception as e:  # noqa: BLE001 - a config that does not compile is reported, not fatal
                    ms = float("nan")
                    print(f"config {spec} t={transpose}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                row = {"tokens": n_tok, "transpose": transpose, "config": spec, "ms": ms, "bound_ms": bound,
                       "over_bound": ms / bound}
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def experts_part(args, bw: float, rate: float) -> dict:
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = RoutedExperts(NUM_EXPERTS, LATENT, INTER, 4.0, 25.0, expert_format="mxfp4")
    fill_random_mxfp4(m)
    ids, w = routing(args.tokens, 1)
    z = torch.randn(args.tokens, LATENT, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(args.tokens, LATENT, device="cuda", dtype=torch.bfloat16)
    bound = expert_bound(ids, bw, rate)
    out = {"train_bound": bound, "rows": []}
    print(f"experts bound at {args.tokens} tokens: {json.dumps(bound)}", flush=True)
    runs = [(b, c, e) for b in args.backends for c in (args.configs if b == "triton" else ["new"])
            for e in args.elementwise]
    for backend, configs, elementwise in runs:
        with mxfp4_experts_backend(backend), kernel_configs(configs), reference_kernels(elementwise == "reference"):
            holder: dict = {}

            def fwd(holder=holder):
                holder["y"] = m(z, ids, w)

            def bwd(holder=holder):
                holder["y"].backward(grad)

            row = {"backend": backend, "configs": configs, "elementwise": elementwise, "tokens": args.tokens}
            if args.train:
                fwd(), bwd()  # compile
                fwd_ms, bwd_ms = [], []
                for _ in range(3):
                    fwd_ms.append(timed_ms(fwd, iters=1, warmup=0))
                    bwd_ms.append(timed_ms(bwd, iters=1, warmup=0))
                torch.cuda.reset_peak_memory_stats()
                fwd(), bwd()
                row.update({"fwd_ms": statistics.median(fwd_ms), "bwd_ms": statistics.median(bwd_ms),
                            "fwd_bwd_peak_gib": torch.cuda.max_memory_allocated() / 2**30})
                row["fwd_over_bound"] = row["fwd_ms"] / bound["bound_ms"]
                row["bwd_over_bound"] = row["bwd_ms"] / bound["bound_ms"]
                holder.clear()
                if backend == "triton":
                    row["profile_fwd_bwd_ms"] = top_kernels(lambda: (fwd(), bwd()))
                    holder.clear()
            for b in args.batches:
                ids_b, w_b = routing(b, 2)
                z_b = torch.randn(b, LATENT, device="cuda", dtype=torch.bfloat16)
                with torch.no_grad(), sync_free_experts():
                    graph, _ = capture(lambda z_b=z_b, ids_b=ids_b, w_b=w_b: m(z_b, ids_b, w_b))
                    if backend == "triton":  # the same launches as the graph, eager: GPU ms per kernel
                        row[f"profile_decode_b{b}_ms"] = top_kernels(lambda z_b=z_b, ids_b=ids_b, w_b=w_b:
                                                                     m(z_b, ids_b, w_b))
                dec = expert_bound(ids_b, bw, rate)
                ms = timed_ms(graph.replay, iters=10)
                row[f"decode_b{b}_ms"] = ms
                row[f"decode_b{b}_bound_ms"] = dec["read_ms"]
                row[f"decode_b{b}_over_bound"] = ms / dec["read_ms"]
                del graph
                torch.cuda.empty_cache()
            print(json.dumps(row), flush=True)
            out["rows"].append(row)
    return out


def model_part(args, bw: float, rate: float) -> dict:
    from miles_k3.model.lora import LoRAConfig, apply_lora

    cfg = k3_four_layers()
    torch.cuda.reset_peak_memory_stats()
    model = build_model(cfg)
    apply_lora(model, LoRAConfig(rank=32, alpha=64))
    base_gib = torch.cuda.memory_allocated() / 2**30
    print(f"4-layer K3 built: {base_gib:.1f} GiB allocated", flush=True)
    backend = model.kda_backend(torch.device("cuda"))

    def attn_fn(layer, x):
        return (layer.self_attn(x, None, None) if layer.is_mla else layer.self_attn(x, backend, None, None))[0]

    ids = torch.randint(0, cfg.vocab_size, (1, args.tokens + 1), device="cuda")
    with torch.no_grad():  # each layer's inputs, as the model gives them
        partial, bank, inputs = model.model.embed_tokens(ids[:, :-1]), [], []
        for layer in model.model.layers:
            inputs.append(([b.clone() for b in bank], partial.clone()))
            partial = layer(bank, partial, attn_fn)
    result = {"base_gib": base_gib, "layers": [], "step": {}}
    for name in args.backends:
        with mxfp4_experts_backend(name):
            for i, layer in enumerate(model.model.layers):
                bank_in = [b.requires_grad_() for b in inputs[i][0]]
                part_in = inputs[i][1].requires_grad_()
                holder: dict = {}

                def fwd(layer=layer, bank_in=bank_in, part_in=part_in, holder=holder):
                    holder["y"] = layer(list(bank_in), part_in, attn_fn)

                def bwd(holder=holder):
                    holder["y"].float().square().mean().backward()

                fwd(), bwd()
                row = {"backend": name, "layer": i, "kind": ("MLA" if layer.is_mla else "KDA")
                       + (" + MoE" if layer.is_moe else " + MLP"),
                       "fwd_ms": timed_ms(fwd), "fwd_bwd_ms": timed_ms(lambda: (fwd(), bwd()))}
                row["bwd_ms"] = row["fwd_bwd_ms"] - row["fwd_ms"]
                if layer.is_moe:
                    moe = layer.block_sparse_moe
                    x = torch.randn(1, args.tokens, cfg.hidden_size, device="cuda", dtype=torch.bfloat16,
                                    requires_grad=True)
                    row["moe_fwd_ms"] = timed_ms(lambda moe=moe, x=x: moe(x))
                    row["moe_fwd_bwd_ms"] = timed_ms(lambda moe=moe, x=x: moe(x).float().square().mean().backward())
                    with torch.no_grad():
                        bound = expert_bound(moe.gate(x.view(-1, cfg.hidden_size))[0], bw, rate)
                    row["moe_experts_fwd_bwd_bound_ms"] = 2 * bound["bound_ms"]
                    row["moe_fwd_bwd_over_experts_bound"] = row["moe_fwd_bwd_ms"] / (2 * bound["bound_ms"])
                    for b in args.batches:
                        xb = torch.randn(b, 1, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
                        with torch.no_grad(), sync_free_experts():
                            graph, _ = capture(lambda moe=moe, xb=xb: moe(xb))
                            ids_b = moe.gate(xb.view(-1, cfg.hidden_size))[0]
                        row[f"moe_decode_b{b}_ms"] = timed_ms(graph.replay, iters=10)
                        row[f"moe_decode_b{b}_read_bound_ms"] = expert_bound(ids_b, bw, rate)["read_ms"]
                        row[f"moe_decode_b{b}_over_bound"] = (row[f"moe_decode_b{b}_ms"]
                                                              / row[f"moe_decode_b{b}_read_bound_ms"])
                        del graph
                holder.clear()
                print(json.dumps(row), flush=True)
                result["layers"].append(row)
                torch.cuda.empty_cache()

            def step():
                logits = model(ids[:, :-1]).logits
                torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]).float(),
                                                  ids[0, 1:]).backward()

            torch.cuda.reset_peak_memory_stats()
            result["step"][name] = {"fwd_bwd_ms": timed_ms(step),
                                    "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30}
            model.zero_grad(set_to_none=True)
            print(json.dumps({"backend": name, "model_step": result["step"][name]}), flush=True)
    result["model"] = model
    return result


def kda_part(args, bw: float) -> list[dict]:
    """The KDA decode recurrence of one K3 layer at each decode batch (H = 96, K = V = 128, fp32 state pool of
    batch + 1 slots, bf16 inputs): fla's fused_recurrent_kda in the engine's in-place form (today's path) and
    `kernels.kda_decode.kda_recurrent_step` per tile config, each replayed in a CUDA graph of 10 calls; bound =
    the state read + written once / the measured copy bandwidth. The fastest config becomes KDA_STEP_CONFIG for
    the engine part's `kda` variants (printed)."""
    import miles_k3.kernels.kda_decode as kd
    from miles_k3.model.kda_ops import _decode_into_fla

    h, dk = 96, 128
    rows, best = [], {}
    for b in args.batches:
        g = torch.Generator(device="cuda").manual_seed(b)
        q, k, v, f = (torch.randn(b, 1, h, dk, device="cuda", generator=g).bfloat16() for _ in range(4))
        beta = torch.randn(b, 1, h, device="cuda", generator=g).bfloat16()
        a_log = torch.rand(h, device="cuda", generator=g).mul(15).add(1).log()
        dt_bias = torch.zeros(h * dk, device="cuda")
        pool = torch.randn(b + 1, h, dk, dk, device="cuda", generator=g)
        slots = torch.randperm(b + 1, device="cuda", generator=g)[:b]
        bound_ms = 2 * b * h * dk * dk * 4 / bw * 1e3
        a = (q, k, v, f, beta, a_log, dt_bias, -5.0, pool, slots)
        fns = {"fla": lambda a=a: _decode_into_fla(*a)}
        for bv, nw in [(32, 4), (32, 2), (64, 4), (64, 8), (128, 8), (128, 4)]:
            fns[f"triton bv{bv} w{nw}"] = (lambda bv=bv, nw=nw, a=a: kd.kda_recurrent_step(
                *a, block_v=bv, num_warps=nw))
        for name, fn in fns.items():
            graph, _ = capture(lambda fn=fn: [fn() for _ in range(10)])
            ms = timed_ms(graph.replay, iters=10) / 10
            row = {"part": "kda", "batch": b, "impl": name, "ms": ms, "bound_ms": bound_ms, "over_bound": ms / bound_ms}
            print(json.dumps(row), flush=True)
            rows.append(row)
            if name != "fla" and b == max(args.batches) and ms < best.get("ms", float("inf")):
                best = {"ms": ms, "name": name}
            del graph
    if best:
        bv, nw = (int(x.lstrip("bvw")) for x in best["name"].split()[1:])
        kd.KDA_STEP_CONFIG.update(block_v=bv, num_warps=nw)
        print(json.dumps({"kda_step_config": kd.KDA_STEP_CONFIG, "from": best}), flush=True)
    return rows


@contextlib.contextmanager
def kda_decode(model, name: str):
    """Within the block the model's KDA decode step (`KDABackend.decode_into`) is fla's in-place kernel ("fla",
    the default before) or `kernels.kda_decode.kda_recurrent_step` ("triton", the engine's default now), for
    before/after rows of one run."""
    import dataclasses

    from miles_k3.kernels.kda_decode import kda_recurrent_step
    from miles_k3.model.kda_ops import _decode_into_fla

    dev = torch.device("cuda")
    before = model.kda_backend(dev)
    step = {"triton": kda_recurrent_step, "fla": _decode_into_fla}[name]
    model._backends[dev.type] = dataclasses.replace(before, decode_into=step)
    try:
        yield
    finally:
        model._backends[dev.type] = before


# engine variants: the KDA decode step (fla's in-place kernel, the engine's path before; or the Triton step, now)
ENGINE_VARIANTS = {"fla": "fla", "kda": "triton"}


def engine_part(args, model) -> list[dict]:
    """Per variant: `tok_s` = b x 64 / the wall time of one generate (32-token prompts, prefill included) after a
    warm-up of 8 new tokens (as before: the graphs of the second page bucket are captured inside the timed call),
    `tok_s_graphs_warm` the same call again (every graph captured, as bench_engine_gpu.py measures), `prefill_s`
    a one-token generate (prefill + one step)."""
    from miles_k3.model.lora import LoRAConfig, lora_state_dict
    from miles_k3.rollout.engine import EngineConfig, RolloutEngine

    lora = LoRAConfig(rank=32, alpha=64)
    b = max(args.batches)
    rows = []
    runs = [(n, c, v) for n in args.engine_backends for c in args.configs for v in args.engine_variants]
    for name, configs, variant in runs:
        kda = ENGINE_VARIANTS[variant]
        with mxfp4_experts_backend(name), kernel_configs(configs), kda_decode(model, kda), torch.no_grad():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            engine = RolloutEngine(model, EngineConfig(memory_budget_bytes=12 * 2**30, page_size=64,
                                                       max_context=256, prefill_chunk=1024, num_slots=b),
                                   lora=lora)
            engine.load_lora_adapter_from_tensors("policy", lora_state_dict(model), lora)
            params = {"temperature": 1.0, "max_new_tokens": 64, "ignore_eos": True}
            prompts = torch.randint(0, model.config.vocab_size, (b, 32)).tolist()

            def gen(new, engine=engine, params=params, prompts=prompts):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                engine.generate(input_ids=prompts, sampling_params={**params, "max_new_tokens": new},
                                lora="policy")
                torch.cuda.synchronize()
                return time.perf_counter() - t0

            gen(8)
            wall = gen(64)
            warm = gen(64)
            row = {"backend": name, "configs": configs, "variant": variant, "slots": engine.num_slots, "kda": kda,
                   "batch": b, "decode": engine.decode_mode, "tok_s": b * 64 / wall,
                   "tok_s_graphs_warm": b * 64 / warm, "prefill_s": gen(1),
                   "max_reserved_gib": torch.cuda.max_memory_reserved() / 2**30}
            print(json.dumps(row), flush=True)
            rows.append(row)
            del engine
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="experts,model,engine")
    ap.add_argument("--backends", default="triton,torch")
    ap.add_argument("--engine-backends", default="triton")
    ap.add_argument("--engine-variants", default="fla,kda",
                    help=f"engine rows, comma-separated, of {list(ENGINE_VARIANTS)}")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--json", default=None)
    ap.add_argument("--configs", default="new",
                    help="fused-kernel tilings, comma-separated: new (pick_config), nochunk (pick_config without the "
                         "chunked kernel), legacy (before the fast decode)")
    ap.add_argument("--elementwise", default="fused",
                    help="experts part, comma-separated: fused (the Triton SiTU-GLU, in training too) and/or reference "
                         "(its pure-torch reference: reference_kernels()), each row in turn")
    ap.add_argument("--no-train", dest="train", action="store_false",
                    help="experts part: decode steps only (no training forward/backward)")
    ap.add_argument("--no-tune-train", dest="tune_train", action="store_false",
                    help="kernels part: decode batches only")
    args = ap.parse_args()
    args.backends = args.backends.split(",")
    args.engine_backends = [b for b in args.engine_backends.split(",") if b]
    args.batches = [int(b) for b in args.batches.split(",")]
    args.configs = args.configs.split(",")
    args.elementwise = args.elementwise.split(",")
    if set(args.elementwise) - {"fused", "reference"}:
        ap.error(f"--elementwise: fused and/or reference, got {','.join(args.elementwise)}")
    args.engine_variants = args.engine_variants.split(",")
    parts = args.parts.split(",")
    bw, rate = copy_bandwidth(), gemm_rate()
    results = {"copy_bytes_per_s": bw, "bf16_gemm_flop_per_s": rate, "device": torch.cuda.get_device_name()}
    print(f"measured: copy {bw / 1e12:.2f} TB/s (read + write), bf16 GEMM {rate / 1e12:.0f} TFLOP/s", flush=True)
    if "kernels" in parts:
        results["kernels"] = kernels_part(args, bw, rate)
        torch.cuda.empty_cache()
    if "experts" in parts:
        results["experts"] = experts_part(args, bw, rate)
        torch.cuda.empty_cache()
    if "kda" in parts:
        results["kda"] = kda_part(args, bw)
        torch.cuda.empty_cache()
    if "model" in parts or "engine" in parts:
        if "model" in parts:
            res = model_part(args, bw, rate)
            model = res.pop("model")
            results["model"] = res
        else:
            model = build_model(k3_four_layers())
            from miles_k3.model.lora import LoRAConfig, apply_lora
            apply_lora(model, LoRAConfig(rank=32, alpha=64))
        if "engine" in parts:
            results["engine"] = engine_part(args, model)
    write_result("bench_k3_layers_gpu", results, out=args.json)


if __name__ == "__main__":
    main()
