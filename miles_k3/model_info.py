"""`python -m miles_k3.model_info model=k3 [parallel.tp=8 parallel.ep=64 gpus=64] [model.path=DIR]`: one JSON object
of sizing figures, of the whole model and of one rank of a mesh.

Every figure is computed from the instantiated modules on the meta device (no memory is allocated, so the
full 2.78T K3 works anywhere), not from a second formula:
* params_total: all parameters (tied weights once; A_log counted per head, as the model holds it);
* params_active_per_token: what one token touches: everything except the input embedding table (a row
  lookup) and the routed experts it is not sent to (top-k of E);
* kda_state_bytes_per_request: fp32 recurrent state of all KDA layers, per rank, at tp=1 and at the given tp
  (heads per rank = ceil(H / tp)); kda_conv_state_bytes_per_request: the conv windows, bf16, tp=1;
* mla_kv_bytes_per_token: (kv_lora_rank + rope dims) bf16 values over all MLA layers;
* base_bytes: the base's tensors as stored (routed experts in `model.experts` format, MXFP4 by default: 4.25
  bits per weight; fp32 families 4 bytes; everything else bf16), and base_bytes_bf16_experts for comparison;
* adapter_params: trainable LoRA parameters for the `lora` section (targets, rank);
* per_rank: rank 0 of the `parallel` mesh, planned by the build training runs (`weights.build_k3` on the meta
  device, `parallelize`): its base shard (experts and the rest, as stored), `device_bytes` (what the loader
  allocates on the rank: the base shard in the run's dtype and the fp32 adapter), the optimizer state (fp32
  gradient and AdamW's two moments: 12 bytes per adapter parameter), the engine's KDA state (`batch` requests) and
  MLA latent KV (`batch` x `context` tokens, replicated over tp), their total against `gpu_gib`, an estimate of a
  micro-batch's activations (`activation_bytes`), `checkpoint_transient_bytes` (what rank 0 holds at once beyond
  its parameters while it writes the PEFT adapter of a checkpoint, streamed one tensor at a time: the largest whole
  adapter tensor plus one received piece, `adapter_stream.transient_bytes`; the other ranks hold nothing more; the
  gather it replaced held the whole adapter, `adapter_whole_bytes`, on every rank) and whether it all fits (a
  checkpoint is written between steps: the larger of the activations and the checkpoint's transient counts); the load: `load_bytes` (stored bytes
  the rank reads from the checkpoint: its slices' own), `load_page_bytes` (the file pages those reads touch, each
  once, as a run reads them: row-parallel columns exchanged within the TP group; `load_ranges` contiguous ranges,
  `load_exchanged_bytes` sent to the TP group; `load_page_ratio_max`: the largest pages / bytes of any rank),
  `files_opened` (model.path's index; null for the published layout without a directory) and, in `ranks`, every
  rank's; the all-to-all bytes per token per MoE layer (bf16 latent rows).
"""
import json
import sys
from pathlib import Path

import torch

from miles_k3.config import compose_cli
from miles_k3.model.adapter_stream import export_layout, transient_bytes
from miles_k3.model.build import load_k3_config, num_params
from miles_k3.model.expert_parallel import alltoall_bytes_per_token
from miles_k3.model.experts import RoutedExperts
from miles_k3.model.file_reads import exchanged
from miles_k3.model.hollow import checkpoint_tensors, payload_ranges, published_payload_ranges
from miles_k3.model.k3 import K3ForCausalLM
from miles_k3.model.kda import KDAAttention
from miles_k3.model.lora import adapter_num_params, apply_lora
from miles_k3.model.mla import MLAAttention
from miles_k3.model.parallelize import check_mesh, shard_plan
from miles_k3.model.routing import route_bytes_per_token
from miles_k3.model.weight_files import (
    INDEX_FILE,
    SINGLE_FILE,
    STORED_BYTES,
    expected_tensors,
    meta_model,
    open_weights,
    skip_meta_init,
    spec_bytes,
    stored_dtype,
)
from miles_k3.model.weight_sources import RandomInit
from miles_k3.model.weights import ModelLayout, build_k3, device_bytes, plan_ranges, plan_reads, read_bytes
from miles_k3.parallel.mesh import ParallelContext

USAGE = """
python -m miles_k3.model_info [model=NAME | model.path=DIR] [parallel.tp=N parallel.ep=M gpus=G] [key=value ...]
Sizing figures of a K3 config as one JSON object on stdout: parameters (total, active per token, routed
experts), base bytes as stored (MXFP4 routed experts) and with bf16 experts, KDA state bytes per request (at
tp=1 and tp=N), MLA KV bytes per token, the routes a routing-replay rollout records per token (int16 ids),
layer counts, the LoRA adapter's trainable parameters, and per_rank:
one rank's bytes on the mesh (base shard, LoRA + optimizer, KDA state and MLA KV for batch x context) and the
all-to-all bytes per token per MoE layer. Computed from the modules on the meta device: no memory, no weights,
any size (the full 2.78T K3 included).

Fields (ModelInfoConfig in miles_k3/config.py):
  model=k3|k3_m|k3_m2|k3_nano|k3_tiny   the shipped architecture (default k3)
  model.path=DIR|HUB_ID           a checkpoint's config.json instead (a directory: its index gives each rank's
                                  reads and files; no payload is read, so a hollow checkpoint will do)
  model.experts=auto|mxfp4|bf16   routed-expert storage counted in base_bytes (auto: mxfp4)
  parallel.tp=1                   tensor-parallel degree (also of the per-rank KDA state figure)
  parallel.ep=1                   expert-parallel degree (divides gpus)
  gpus=64                         GPUs (parallel.dp = gpus / parallel.tp; default: parallel.dp=1)
  batch=32                        requests per DP replica's engine (KDA state, MLA KV)
  context=20480                   tokens per request (MLA KV)
  micro_batch_tokens=32768        tokens of a training micro-batch (the activation estimate)
  lora.rank=8                     the adapter adapter_params counts (lora.targets=[q_proj,...]: its modules)

Example:  python -m miles_k3.model_info model=k3 parallel.tp=8 parallel.ep=64 gpus=64
"""


def stored_bytes(model: torch.nn.Module) -> int:
    """Bytes of the base tensors as the checkpoint stores them: uint8 as is, fp32 families 4, others bf16."""
    total = 0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:  # stacked experts: few entries
        if "lora_" in name:
            continue
        total += t.numel() * STORED_BYTES[stored_dtype(name, t.dtype)]
    return total


def conv_state_bytes(m: KDAAttention) -> int:
    """The short-conv windows of one KDA layer per request: 3 x (its) heads x head dim channels x (W - 1) taps,
    bf16."""
    return 3 * m.num_heads * m.head_dim * (m.conv_size - 1) * 2


def model_figures(model: K3ForCausalLM, tp: int) -> dict:
    """Sizing figures of an instantiated K3 (any device, meta included; LoRA tensors are not counted)."""
    layers = model.model.layers
    kda = [m for m in model.modules() if isinstance(m, KDAAttention)]
    mla = [m for m in model.modules() if isinstance(m, MLAAttention)]
    routed = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    total = num_params(model)
    skipped_experts = sum(m.num_params() * (1 - model.config.num_experts_per_token / m.num_experts)
                          for m in routed)
    embed = 0 if model.config.tie_word_embeddings else model.model.embed_tokens.weight.numel()
    conv_bytes = sum(map(conv_state_bytes, kda))
    return {
        "params_total": total,
        "params_active_per_token": round(total - embed - skipped_experts),
        "params_routed_experts": sum(m.num_params() for m in routed),
        "expert_format": routed[0].expert_format if routed else None,
        "base_bytes": stored_bytes(model),
        "kda_state_bytes_per_request": {f"tp{d}": sum(m.state_bytes_per_request(d) for m in kda)
                                        for d in sorted({1, tp})},
        "kda_conv_state_bytes_per_request": conv_bytes,
        "mla_kv_bytes_per_token": sum(m.cache_bytes_per_token() for m in mla),
        "num_kda_layers": len(kda),
        "num_mla_layers": len(mla),
        "num_moe_layers": sum(layer.is_moe for layer in layers),
        "num_layers": len(layers),
        "routes_bytes_per_token": route_bytes_per_token(sum(layer.is_moe for layer in layers),
                                                        model.config.num_experts_per_token),
    }


def main(argv: list[str]) -> dict:
    """The figures of `argv`'s config (key=value overrides of recipes/model_info.yaml; --help: USAGE)."""
    cfg = compose_cli("model_info", argv, "miles_k3.model_info", USAGE)
    k3 = load_k3_config(cfg.model)
    fmt = "mxfp4" if cfg.model.experts == "auto" else cfg.model.experts
    model = meta_model(k3, fmt)
    routed = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    expert_bytes = sum(stored_bytes(m) for m in routed)
    tp = cfg.parallel.tp
    figures = {"model": cfg.model.path or cfg.model.name, "tp": tp, **model_figures(model, tp),
               "base_bytes_bf16_experts": stored_bytes(model) - expert_bytes + sum(2 * m.num_params()
                                                                                  for m in routed)}
    with skip_meta_init():
        apply_lora(model, cfg.lora)
    figures["adapter_params"] = adapter_num_params(model)
    figures["lora"] = {"rank": cfg.lora.rank, "targets": list(cfg.lora.targets)}
    figures["per_rank"] = rank_figures(k3, fmt, cfg, model)
    return figures


def rank_figures(k3, fmt: str, cfg, whole: K3ForCausalLM) -> dict:
    """Rank 0 of `cfg.parallel` as training builds it (`build_k3` on the meta device: the same plan, so
    `device_bytes` is what the loader allocates), and every rank's load from the read plan of the checkpoint of
    model.path (its index; a hollow checkpoint will do), else of the published layout (no files). `whole`: the
    meta model with `cfg.lora`, uncut."""
    p = cfg.parallel
    check_mesh(k3, p.tp, p.ep)
    dtype = torch.float32 if cfg.model.dtype == "fp32" else torch.bfloat16  # a GPU run: bf16
    ctx = ParallelContext.layout(p.dp, p.tp, p.ep, 0)
    model = build_k3(RandomInit(k3, fmt), fmt, torch.device("meta"), dtype, ctx, cfg.lora)  # no weights read
    routed = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    experts = sum(stored_bytes(m) for m in routed)
    adapter = adapter_num_params(model)
    kda = [m for m in model.modules() if isinstance(m, KDAAttention)]
    mla = [m for m in model.modules() if isinstance(m, MLAAttention)]
    allocated = device_bytes(model)
    figures = {"mesh": {"gpus": p.world_size, "dp": p.dp, "tp": p.tp, "ep": p.ep},
               "experts_per_rank": routed[0].num_experts if routed else 0,
               "base_bytes": stored_bytes(model), "base_expert_bytes": experts,
               "base_other_bytes": stored_bytes(model) - experts, "adapter_params": adapter,
               "device_bytes": allocated,
               "optimizer_bytes": 12 * adapter,  # the fp32 gradient and AdamW's two moments (the master: above)
               "batch": cfg.batch, "context": cfg.context,
               "kda_state_bytes": cfg.batch * sum(m.state_bytes_per_request() + conv_state_bytes(m) for m in kda),
               "mla_kv_bytes": cfg.batch * cfg.context * sum(m.cache_bytes_per_token() for m in mla),
               "micro_batch_tokens": cfg.micro_batch_tokens,
               "activation_bytes_estimate": activation_bytes(k3, p.tp, cfg.micro_batch_tokens),
               "checkpoint_transient_bytes": transient_bytes(export_layout(model, ctx)),
               "adapter_whole_bytes": 4 * adapter_num_params(whole),  # fp32
               "alltoall_bytes_per_token_per_moe_layer": alltoall_bytes_per_token(k3, 2)}
    total = sum(figures[k] for k in ("device_bytes", "optimizer_bytes", "kda_state_bytes", "mla_kv_bytes"))
    gpu = cfg.gpu_gib * 2**30
    figures.update(total_bytes_before_activations=total, gpu_bytes=round(gpu),
                   headroom_bytes_for_activations=round(gpu - total),
                   fits=total + max(figures["activation_bytes_estimate"], figures["checkpoint_transient_bytes"]) <= gpu)
    loads = rank_loads(cfg, whole)
    figures.update(load_bytes=loads[0]["load_bytes"], load_page_bytes=loads[0]["page_bytes"],
                   load_ranges=loads[0]["ranges"], load_exchanged_bytes=loads[0]["exchanged_bytes"],
                   files_opened=loads[0]["files"], checkpoint_bytes=loads[0]["checkpoint_bytes"],
                   load_page_ratio_max=max(r["page_bytes"] / r["load_bytes"] for r in loads))
    figures["ranks"] = [{k: r[k] for k in ("rank", "load_bytes", "page_bytes", "ranges", "exchanged_bytes", "files")}
                        for r in loads]
    return figures


def activation_bytes(k3, tp: int, tokens: int) -> int:
    """An estimate (arithmetic, not a measurement) of one training micro-batch's activations on a rank, with
    activation checkpointing: each layer's saved input and the Block-AttnRes block sums (bf16, tokens x hidden),
    plus this rank's fp32 logits and their gradient (tokens x vocab / tp x 4 B x 2). The recompute of one layer in
    backward comes on top and is not counted."""
    layers = k3.num_hidden_layers
    saved = tokens * k3.hidden_size * 2 * (layers + -(-layers // k3.attn_res_block_size))
    return saved + tokens * (k3.vocab_size // tp) * 4 * 2


def rank_loads(cfg, whole: K3ForCausalLM, with_reads: bool = False) -> list[dict]:
    """Every rank's load of `cfg.parallel`: stored bytes it reads (its slices' own), the files it opens, the file
    pages its reads touch (`page_bytes`, each page once; `ranges`: contiguous ranges) and the bytes it sends its TP
    group (`exchanged_bytes`) as a run loads them (`weights.plan_ranges`: row-parallel columns exchanged within the
    TP group), and with `with_reads` the reads themselves, from the read plan (`weights.plan_reads`) of its
    `shard_plan` on `whole`, the uncut meta model (no payload read, no allocation)."""
    p = cfg.parallel
    specs, files, stored_format, payload = stored_layout(cfg, whole.config)
    sizes = {n: spec_bytes(s) for n, s in specs.items()}
    total, layout = sum(sizes.values()), ModelLayout(whole)
    out = []
    for r in range(p.world_size):
        ctx = ParallelContext.layout(p.dp, p.tp, p.ep, r)
        reads = plan_reads(layout, shard_plan(whole, ctx), stored_format)
        opened = {files[n] for read in reads for n in read.names if n in files}
        pages, ranges = plan_ranges(reads, payload, ctx.tp_size, ctx.tp_rank).cost()
        sent = sum(sizes[read.names[0]] // p.tp * (p.tp - 1) // p.tp for read in reads
                   if read.convert is None and exchanged(specs[read.names[0]].shape, read.slice, p.tp))
        out.append({"rank": r, "load_bytes": sum(read_bytes(read, specs, sizes) for read in reads),
                    "page_bytes": pages, "ranges": ranges, "exchanged_bytes": sent,
                    "files": len(opened) if files else None, "checkpoint_bytes": total}
                   | ({"reads": reads} if with_reads else {}))
    return out


def stored_layout(cfg, k3) -> tuple[dict, dict, str, dict]:
    """(stored spec by name, file by name, stored expert format, `PayloadRange` by name) of model.path's checkpoint
    when it is a local directory with weights (its index, config and headers: no payload read), else of the
    published K3 format (MXFP4 experts, the published 96-file layout's offsets computed in memory), where no file is
    known."""
    path = Path(cfg.model.path).expanduser() if cfg.model.path is not None else None
    if path is not None and ((path / INDEX_FILE).is_file() or (path / SINGLE_FILE).is_file()):
        index = open_weights(path)
        return (index.expected, {n: f.name for n, f in index.locations.items()}, index.expert_format,
                payload_ranges(path, missing_ok=True))
    text = expected_tensors(k3, "mxfp4")
    return text, {}, "mxfp4", published_payload_ranges(k3, checkpoint_tensors(k3, vision=False, text=text),
                                                       vision=False)


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
