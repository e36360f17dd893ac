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
* per_rank: rank 0 of the `parallel` mesh, from the same meta model sharded by the real sharding code
  (`shard_model_tp`, `shard_experts_ep`): its base shard (experts and the rest), its LoRA and AdamW state (fp32
  master, gradient and two moments: 16 bytes per adapter parameter), the engine's KDA state (`batch` requests)
  and MLA latent KV (`batch` x `context` tokens, replicated over tp), their total against `gpu_gib`, and the
  all-to-all bytes per token per MoE layer (bf16 latent rows). Activations are not included: they depend on
  micro_batch_tokens and activation checkpointing.
"""
import json
import sys

import torch

from miles_k3.config import compose_cli
from miles_k3.model.build import load_k3_config, num_params
from miles_k3.model.checkpoint import meta_model, stored_dtype
from miles_k3.model.experts import RoutedExperts
from miles_k3.model.k3 import K3ForCausalLM
from miles_k3.model.kda import KDAAttention
from miles_k3.model.lora import adapter_num_params, apply_lora
from miles_k3.model.mla import MLAAttention
from miles_k3.model.routing import route_bytes_per_token

STORED_BYTES = {"U8": 1, "BF16": 2, "F32": 4}
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
  model.path=DIR|HUB_ID           a checkpoint's config.json instead (its weights are not read)
  model.experts=auto|mxfp4|bf16   routed-expert storage counted in base_bytes (auto: mxfp4)
  parallel.tp=1                   tensor-parallel degree (also of the per-rank KDA state figure)
  parallel.ep=1                   expert-parallel degree (divides gpus)
  gpus=64                         GPUs (parallel.dp = gpus / parallel.tp; default: parallel.dp=1)
  batch=32                        requests per DP replica's engine (KDA state, MLA KV)
  context=20480                   tokens per request (MLA KV)
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
    with torch.device("meta"):
        apply_lora(model, cfg.lora)
    figures["adapter_params"] = adapter_num_params(model)
    figures["lora"] = {"rank": cfg.lora.rank, "targets": list(cfg.lora.targets)}
    figures["per_rank"] = rank_figures(k3, fmt, cfg)
    return figures


def rank_figures(k3, fmt: str, cfg) -> dict:
    """Rank 0 of `cfg.parallel`: a meta model with `cfg.lora`, sharded by the sharding code itself (a context of
    the mesh's sizes whose groups are None: slicing needs no process group)."""
    from miles_k3.parallel.expert_parallel import alltoall_bytes_per_token, shard_experts_ep
    from miles_k3.parallel.mesh import ParallelContext
    from miles_k3.parallel.tensor_parallel import shard_model_tp

    p = cfg.parallel
    p.check_model(k3)
    ctx = ParallelContext(world_size=p.world_size, dp_size=p.dp, tp_size=p.tp, ep_size=p.ep)
    model = meta_model(k3, fmt)
    with torch.device("meta"):
        apply_lora(model, cfg.lora)
    shard_model_tp(model, ctx)
    shard_experts_ep(model, ctx)
    routed = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    experts = sum(stored_bytes(m) for m in routed)
    base = stored_bytes(model)
    adapter = adapter_num_params(model)
    kda = [m for m in model.modules() if isinstance(m, KDAAttention)]
    mla = [m for m in model.modules() if isinstance(m, MLAAttention)]
    kda_state = cfg.batch * sum(m.state_bytes_per_request() + conv_state_bytes(m) for m in kda)
    mla_kv = cfg.batch * cfg.context * sum(m.cache_bytes_per_token() for m in mla)
    optimizer = 16 * adapter  # fp32 master, gradient, AdamW's two moments
    total = base + optimizer + kda_state + mla_kv
    gpu = cfg.gpu_gib * 2**30
    return {"mesh": {"gpus": p.world_size, "dp": p.dp, "tp": p.tp, "ep": p.ep},
            "experts_per_rank": routed[0].num_experts if routed else 0,
            "base_bytes": base, "base_expert_bytes": experts, "base_other_bytes": base - experts,
            "adapter_params": adapter, "lora_and_optimizer_bytes": optimizer,
            "batch": cfg.batch, "context": cfg.context,
            "kda_state_bytes": kda_state, "mla_kv_bytes": mla_kv,
            "total_bytes_before_activations": total, "gpu_bytes": round(gpu), "fits": total <= gpu,
            "headroom_bytes_for_activations": round(gpu - total),
            "alltoall_bytes_per_token_per_moe_layer": alltoall_bytes_per_token(k3, 2)}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
