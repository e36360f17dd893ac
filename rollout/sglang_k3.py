"""Kimi K3 checkpoints on SGLang 0.5.17 (`engine.backend=sglang model.path=<K3 dir>`): what its
KimiK3ForConditionalGeneration needs of a checkpoint directory (`k3_checkpoint`: the nested config.json, the shapes
its kernels serve, `k3_shape_problems`), the MoE runner it needs (`moe_runner`) and how an adapter reaches it
(`resolve_push`: LoRA for the targets its K3 LoRA serves, else merged base weights). Everything here was read in
SGLang's source, not run; `rollout.sglang_backend` builds the engine from it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from miles_k3.model.config import ConfigError, K3Config
from miles_k3.model.lora import EXPERT_TARGETS
from miles_k3.model.weight_files import WeightsError

if TYPE_CHECKING:
    from miles_k3.rollout.sglang_config import SGLangConfig

# File:line references are to SGLang 0.5.17's python/sglang/srt/.
K3_LORA_TARGETS = ("q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "kv_b_proj")
"""The lora.targets SGLang 0.5.17's LoRA serves on KimiK3ForConditionalGeneration (the MLA projections)."""
_CRASH = "SGLang does not start (no LoRA buffer shape for it: lora/utils.py:224-226 raises NotImplementedError)"
K3_LORA_FAULTS = {
    **dict.fromkeys(("q_proj", "k_proj", "v_proj"), "silently dropped: KDA fuses them into fused_qkvg_proj, so "
                    "the adapter's qkv_proj matches no module (lora/mem_pool.py:1015-1070)"),
    **dict.fromkeys(("g_proj", "f_a_proj", "f_b_proj", "b_proj", "routed_expert_down_proj",
                     "routed_expert_up_proj"), _CRASH),
    "o_proj": "silently removes MLA's output gate (the LoRA wrapper bypasses K3's o_proj.forward override: "
              "models/kimi_k3.py:1808-1836, lora/layers.py:771-786)",
    **dict.fromkeys(("gate_proj", "up_proj", "down_proj"), "KeyError at startup (no gate_up_proj buffer beside a "
                    "FusedMoE: lora/mem_pool.py:574-611), and the fused MoE front bypasses shared-expert LoRA "
                    "(models/kimi_k3.py:1014-1025)"),
    **dict.fromkeys(EXPERT_TARGETS, "wrong buffer widths (sized by hidden_size; K3's experts run in "
                    "routed_expert_hidden_size: lora/utils.py:203-214)"),
}
"""Why SGLang 0.5.17's K3 LoRA cannot serve each other lora.target."""
# Merged pushes write base weights through update_weights_from_tensor, whose post_load_weights re-derives some
# tensors into NEW storage: a captured CUDA graph keeps reading the old (stale or freed) buffers. Targets whose
# weights feed one (f_b_proj, q_a/q_b/kv_a, KDA q/k/v/g, o_proj, dense and shared down_proj and
# routed_expert_up_proj are read in place and stay graph-safe):
K3_GRAPH_UNSAFE = {
    "kv_b_proj": "w_kc / w_vc are re-derived by assignment (models/kimi_k3.py:2870-2874)",
    "f_a_proj": "f_a_proj and b_proj are re-merged into a new _bfa_w (models/kimi_k3.py:1525-1540)",
    "b_proj": "f_a_proj and b_proj are re-merged into a new _bfa_w (models/kimi_k3.py:1525-1540)",
    "routed_expert_down_proj": "it is re-merged with the router gate (and the shared experts' gate/up) into a new "
                               "_front_w (models/kimi_k3.py:593-626, _merge_weights_as_views :176-196)",
}
_SHARED_FRONT = ("the shared experts' gate_up_proj is re-merged into a new _front_w (models/kimi_k3.py:600-626, "
                 "_merge_weights_as_views :176-196)")
FLAT_CONFIG_FIX = (
    "python -c \"import json,sys; from miles_k3.model.weight_files import nested_config; "
    "f=sys.argv[1]+'/config.json'; r=json.load(open(f)); t=r.get('text_config',r); "
    "json.dump(nested_config(t,t.get('quantization_config',r.get('quantization_config'))),open(f,'w'),indent=2)\" "
    "DIR")
"""Rewrites DIR/config.json in place in the published nested form (`nested_config`, what init_checkpoint and
quantize write); the tensors are unchanged, and the trainer reads either form."""


@dataclass(frozen=True)
class K3Checkpoint:
    """A K3 checkpoint directory that SGLang 0.5.17 can serve (`k3_checkpoint`)."""

    config: K3Config
    mxfp4: bool  # the routed experts are stored MXFP4 (config.json has a quantization_config)


def k3_checkpoint(path: str, cfg: SGLangConfig) -> K3Checkpoint | None:
    """The K3 checkpoint directory `path`, checked for SGLang 0.5.17 with `cfg`; None when `path` holds no K3
    config.json (an HF architecture, or not a local directory). Raises WeightsError listing every problem with its
    fix: a flat config.json (SGLang builds Kimi Linear from it) and each shape SGLang's kernels cannot serve."""
    raw = _read_config(path)
    if raw is None:
        return None
    nested = isinstance(raw.get("text_config"), dict)
    text = raw["text_config"] if nested else raw
    if raw.get("model_type") != "kimi_k3" and "attn_res_block_size" not in text:
        return None
    k3 = K3Config.from_dict(raw, source=f"{path}/config.json")
    quant = text.get("quantization_config") or raw.get("quantization_config")
    problems = []
    if not nested or raw.get("model_type") != "kimi_k3" or (raw.get("architectures") or [None])[0] != \
            "KimiK3ForConditionalGeneration":
        problems.append(f"config.json is not the published nested form (model_type kimi_k3, architectures "
                        f"[KimiK3ForConditionalGeneration], text keys under text_config; it has model_type "
                        f"{raw.get('model_type')!r}): SGLang picks the config class by model_type and the model by "
                        "architectures[0], so it would build Kimi Linear (models/kimi_linear.py: no attention "
                        f"residuals, latent MoE or output gate), not K3. Rewrite it: {FLAT_CONFIG_FIX}")
    problems += k3_shape_problems(k3, bool(quant), moe_runner(cfg, K3Checkpoint(k3, bool(quant))),
                                  cfg.attention_backend)
    if problems:
        raise WeightsError(f"model.path: SGLang 0.5.17 cannot serve the K3 checkpoint {path} "
                              f"({len(problems)} problem{'s' if len(problems) > 1 else ''}):\n  - "
                              + "\n  - ".join(problems) + "\nor train and evaluate it with engine.backend=native")
    return K3Checkpoint(k3, bool(quant))


def _read_config(path: str) -> dict | None:
    try:
        raw = json.loads((Path(path) / "config.json").read_text())
    except OSError:
        return None
    except ValueError as e:
        raise WeightsError(f"model.path: {path}/config.json is not valid JSON ({e})") from None
    return raw if isinstance(raw, dict) else None


def k3_shape_problems(c: K3Config, mxfp4: bool, runner: str | None, attention_backend: str) -> list[str]:
    """Each shape of `c` that SGLang 0.5.17 serves wrongly or not at all (key, value, rule and where), for MXFP4
    experts or not, on MoE runner `runner` and MLA attention backend `attention_backend`."""
    lac, out = c.linear_attn_config, []

    def need(ok: bool, key: str, value, rule: str) -> None:
        if not ok:
            out.append(f"{key} = {value}: {rule}")

    need(c.hidden_size % 1024 == 0, "hidden_size", c.hidden_size, "must be a multiple of 1024 (the attention-"
         "residual Triton kernel reads the hidden size in unmasked blocks of 1024: layers/attn_residual.py:135-137, "
         ":212; otherwise its output is garbage, with no error)")
    need(lac.head_dim == c.v_head_dim, "linear_attn_config.head_dim", lac.head_dim, f"must equal v_head_dim "
         f"({c.v_head_dim}): SGLang's KDA takes its value head size from v_head_dim (models/kimi_k3.py:1247, "
         "layers/radix_linear_attention.py:67-69) and fails at the first prefill otherwise")
    need(len(c.mla_layer_ids) > 0, "linear_attn_config.full_attn_layers", lac.full_attn_layers, "must name at "
         "least one MLA layer: SGLang sizes its hybrid memory pool's value head from the first MLA layer's buffer "
         "(mem_cache/memory_pool.py:3872, :4014) and fails to start otherwise (IndexError: seen on the H200)")
    rows = -(-c.num_hidden_layers // c.attn_res_block_size) + 1
    need(rows <= 16, "num_hidden_layers / attn_res_block_size", f"{c.num_hidden_layers} / {c.attn_res_block_size}",
         f"ceil(num_hidden_layers / attn_res_block_size) + 1 = {rows} attention-residual bank rows; SGLang's kernel "
         "holds at most 16 (_MAX_ROWS, layers/attn_residual.py:30) and silently ignores the rest")
    need(c.intermediate_size % 8 == 0, "intermediate_size", c.intermediate_size, "must be a multiple of 8 (SGLang's "
         "SiTU kernel: sglang/kernels/jit/csrc/kimi_k3/situ_and_mul.cuh:150-152)")
    shared = c.moe_intermediate_size * c.num_shared_experts
    need(shared % 8 == 0, "moe_intermediate_size * num_shared_experts", shared, "must be a multiple of 8 (SGLang's "
         "SiTU kernel: sglang/kernels/jit/csrc/kimi_k3/situ_and_mul.cuh:150-152)")
    if mxfp4 and runner == "marlin":
        need(c.routed_expert_hidden_size % 256 == 0, "routed_expert_hidden_size", c.routed_expert_hidden_size,
             "must be a multiple of 256 for MXFP4 experts on Marlin (the weights are padded to 256 along it, the "
             "loader pads only the shard dim: layers/quantization/mxfp4.py:394-403; a load error otherwise)")
        # Marlin's own check asks for % 32 (marlin_utils.py:245-281), but create_weights pads the expert width to
        # 128 (mxfp4.py:394-403), which the loader does not fill: 128, what the GPU probe of the issue saw.
        need(c.moe_intermediate_size % 128 == 0, "moe_intermediate_size", c.moe_intermediate_size, "must be a "
             "multiple of 128 for MXFP4 experts on Marlin (Marlin checks % 32, marlin_utils.py:245-281, and "
             "create_weights pads it to 128, layers/quantization/mxfp4.py:394-403)")
    if attention_backend == "fa3":
        need(c.kv_lora_rank >= 256, "kv_lora_rank", c.kv_lora_rank, "must be >= 256 with sglang.attention_backend="
             "fa3 (FA3's q_v path: 'q_v is only supported for hdim_v >= 256'); use sglang.attention_backend=triton")
        need(c.qk_rope_head_dim <= 64, "qk_rope_head_dim", c.qk_rope_head_dim, "must be <= 64 with sglang."
             "attention_backend=fa3 ('q_v is only supported for head_size <= 64'); use sglang.attention_backend="
             "triton")
    return out


def moe_runner(cfg: SGLangConfig, k3: K3Checkpoint | None) -> str | None:
    """sglang.moe_runner_backend, else marlin for K3's MXFP4 experts (on Hopper the only MXFP4 runner with SiTU:
    fused_moe_triton/triton_kernels_moe.py:185-190, moe_runner/flashinfer_cutlass.py:113-134), else None (SGLang's
    default)."""
    if cfg.moe_runner_backend is not None:
        return cfg.moe_runner_backend
    return "marlin" if k3 is not None and k3.mxfp4 else None


def resolve_push(requested: str, lora, k3: K3Checkpoint | None, cfg: SGLangConfig) -> tuple[str | None, str]:
    """(push mode, why) for adapters like `lora` (None: no adapter, mode None) on the checkpoint `k3` (None: an HF
    architecture): `requested` (sglang.push) resolved to lora or merged by the rules of SGLangConfig.push. Raises
    ConfigError when the mode cannot serve the targets, naming them and why."""
    if lora is None:
        return None, "no adapter"
    if k3 is None:
        if requested == "merged":
            raise ConfigError("sglang.push: merged writes K3 checkpoint names into SGLang's base weights; an HF "
                              "architecture pushes its adapter as LoRA: set sglang.push=auto or lora")
        return "lora", "an HF architecture: SGLang's LoRA serves its adapters"
    unserved = [t for t in lora.targets if t not in K3_LORA_TARGETS]
    if requested == "lora" or (requested == "auto" and not unserved):
        if unserved:
            raise ConfigError("sglang.push: lora cannot serve lora.targets " + "; ".join(
                f"{t} ({K3_LORA_FAULTS[t]})" for t in unserved) + f" on SGLang 0.5.17's K3 LoRA, which serves "
                f"{list(K3_LORA_TARGETS)} only; set sglang.push=merged (or auto) or keep lora.targets within those")
        return "lora", f"K3 with lora.targets within {list(K3_LORA_TARGETS)} (SGLang's K3 LoRA serves them)"
    experts = [t for t in lora.targets if t in EXPERT_TARGETS]
    if experts:
        raise ConfigError(f"sglang.push: merged cannot serve lora.targets {experts}: K3's routed experts are MXFP4 "
                          "(re-quantizing a merged expert rounds the LoRA update away) and under Marlin SGLang "
                          "cannot update them at all (layers/quantization/marlin_utils_fp4.py:386-389); remove "
                          "w1/w2/w3 from lora.targets")
    unsafe = dict(K3_GRAPH_UNSAFE)
    if k3.config.num_shared_experts > 0:
        unsafe |= {"gate_proj": _SHARED_FRONT, "up_proj": _SHARED_FRONT}
    stale = [t for t in lora.targets if t in unsafe]
    if cfg.cuda_graph and stale:
        raise ConfigError("sglang.cuda_graph: a merged push re-derives tensors of lora.targets " + "; ".join(
            f"{t} ({unsafe[t]})" for t in stale) + " into new storage, which captured CUDA graphs never read; set "
            "sglang.cuda_graph=false or drop those targets" + ("" if requested == "merged" else
                                                                 f" (sglang.push=auto chose merged for {unserved})"))
    return "merged", (f"K3 with lora.targets {unserved} that SGLang's K3 LoRA cannot serve" if requested == "auto"
                      else "sglang.push=merged")
