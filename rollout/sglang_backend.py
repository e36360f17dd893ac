"""`engine.backend=sglang`: the rollout-engine interface of `RolloutEngine` over a real `sglang.Engine`.

The engine is built in the training process (SGLang runs its scheduler and model in its own subprocesses) from
the typed `sglang:` config (`SGLangConfig`), token in / token out (`skip_tokenizer_init`). What the loop sees is
the same as with the native engine:

* `generate(input_ids, sampling_params, n, return_logprob, lora)` -> one record per sample, prompt i's sample j at
  i * n + j: `output_ids`, `meta_info` {finish_reason, prompt_tokens, completion_tokens, cached_tokens,
  weight_version, output_token_logprobs [(logprob, token_id)]}, or `error` for a rejected request. Sample j of a
  prompt with `sampling_seed` s is sent with seed s + j (the native engine's rule), so groups are reproducible.
* The trained adapter is pushed from tensors under versioned names: `load_lora_adapter_from_tensors(name=policy)`
  serves `policy@v<N>` (SGLang cannot update an adapter in place: a reused name is refused), requests for `policy`
  go to the newest version, and the previous version is unloaded once no request of this engine uses it.
  `update_weights_from_tensor(tensors)` without `lora_name` updates base weights (SGLang's own call).
* `stage_adapter` / `commit_adapter` / `discard_adapter` split a push so the channel can check a staged version by
  logprob parity before it serves (`miles_k3.weight_sync.sglang`): SGLang cannot read adapter weights back.
* `release_memory_occupation` / `resume_memory_occupation` (kv_cache, cuda_graph, weights): needs
  `enable_memory_saver`; releasing `weights` needs `enable_weights_cpu_backup` (otherwise SGLang resumes them as
  garbage).
* A K3 checkpoint directory (`k3_checkpoint`) is checked before SGLang starts (the nested config, the shapes SGLang
  0.5.17's kernels need), served with K3's server arguments, and pushed as a LoRA adapter only when every target is
  one SGLang's K3 LoRA serves (`resolve_push`); otherwise (`sglang.push=merged`) the channel writes merged base
  weights (`write_base_weights`: one `update_weights_from_tensor` call per push) and requests for the adapter go to
  the base (`serve_merged`).

SGLang is an optional extra (`pip install 'miles-k3[sglang]'`), imported only when this engine is built.
"""
from __future__ import annotations

import json
import logging
import math
import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from miles_k3.model.checkpoint import CheckpointError
from miles_k3.model.config import ConfigError, K3Config
from miles_k3.model.lora import EXPERT_TARGETS, lora_scale
from miles_k3.rollout.engine import generate_requests

log = logging.getLogger("miles_k3.rollout")

MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")
VERIFY_MODES = ("never", "every_n", "every")
PUSH_MODES = ("auto", "lora", "merged")
INSTALL_HINT = ("engine.backend=sglang needs SGLang: pip install 'miles-k3[sglang]' (SGLang serves on CUDA GPUs; "
                "releases pinning torch 2.11 end at sglang 0.5.17), or set engine.backend=native")


@dataclass
class SGLangConfig:
    """The SGLang engine of `engine.backend=sglang` (its server arguments, typed) and how pushes are verified."""

    attention_backend: str = "triton"
    """SGLang attention backend (triton, flashinfer, fa3, ...)."""
    sampling_backend: str = "pytorch"
    """SGLang sampling backend (pytorch or flashinfer)."""
    mem_fraction_static: float = 0.4
    """Fraction of GPU memory SGLang takes for weights + KV cache; the rest is the trainer's. In (0, 1)."""
    cuda_graph: bool = True
    """Capture decode CUDA graphs (false: SGLang's disable_cuda_graph)."""
    enable_lora: bool = True
    """Serve LoRA adapters (needed to train LoRA; false only for full-weight updates or eval of the base)."""
    max_lora_rank: int | None = None
    """Largest adapter rank SGLang allocates for; null: lora.rank."""
    lora_target_modules: list[str] | None = None
    """Modules SGLang adds LoRA to; null: lora.targets."""
    max_loras_per_batch: int = 3
    """Adapter slots on the GPU. The base takes one, and a push serves a new version while the old one drains:
    at least 3."""
    lora_backend: str | None = None
    """SGLang LoRA kernels (triton, csgmv, ...); null: SGLang's default."""
    enable_memory_saver: bool = True
    """torch_memory_saver regions, so release/resume_memory_occupation can free and restore memory."""
    enable_weights_cpu_backup: bool = False
    """Keep a CPU copy of the weights so that releasing `weights` is safe (resume restores them)."""
    dtype: str = "auto"
    """SGLang model dtype (auto, bfloat16, float16, float32)."""
    context_length: int | None = None
    """Maximum prompt + completion tokens; null: the model config's."""
    log_level: str = "error"
    """SGLang's log level."""
    moe_runner_backend: str | None = None
    """SGLang's MoE runner (marlin, triton, ...); null: marlin for a K3 checkpoint with MXFP4 experts (on Hopper the
    only runner with K3's SiTU activation), SGLang's default otherwise."""
    push: str = "auto"
    """How a push reaches SGLang: lora (a versioned adapter; for K3 only when every lora.target is one SGLang's K3
    LoRA serves: q_a_proj, kv_a_proj_with_mqa, q_b_proj, kv_b_proj), merged (K3 only: W0 + s * B @ A of every
    adapted linear written into SGLang's base weights, one update_weights_from_tensor call per push) or auto (lora
    for an HF model and for K3 with only those targets, merged for other K3 targets)."""
    verify_push: str = "every_n"
    """Check a pushed adapter on the probe before it serves (`miles_k3.weight_sync.sglang` gives the rule): never,
    every_n (push 1, then every verify_every-th push after a conclusive check) or every push. A check too small to
    decide (the adapter's effect below the noise floor) and a refused push make the next push checked too."""
    verify_every: int = 10
    """With verify_push=every_n: a check that is conclusive and passes at push k makes push k + verify_every the next
    one checked (all conclusive: pushes 1, 1 + n, 1 + 2n, ...). >= 1."""
    parity_tolerance: float = 0.05
    """Mean |trainer - engine| log-prob (nats/token) over the probe above which a push is refused."""
    parity_min_effect: float = 0.01
    """Noise floor (nats/token): a check is conclusive only when the adapter moves the trainer's probe log-probs by
    at least this on average (and by 10x the engine-trainer gap on the base, the bf16 noise). Below 0.01 the
    adapter changes the probe's token probabilities by ~1% on average: too little to tell a dropped or mis-scaled
    adapter from noise, and too little to matter to the rollouts yet. > 0."""
    probe_tokens: int = 32
    """Length of the parity probe (token ids drawn from the first training prompt, repeated to this length)."""
    extra_args: dict[str, Any] = field(default_factory=dict)
    """Further sglang.Engine arguments passed as given (e.g. {chunked_prefill_size: 4096}); a key that a typed
    field above sets is refused."""

    def validate(self) -> None:
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"mem_fraction_static: must be in (0, 1), got {self.mem_fraction_static}")
        if self.enable_lora and self.max_loras_per_batch < 3:
            raise ValueError(f"max_loras_per_batch: must be >= 3 with LoRA (the base takes a slot and a push "
                             f"serves two versions while the old drains), got {self.max_loras_per_batch}")
        if self.max_lora_rank is not None and self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank: must be >= 1 or null, got {self.max_lora_rank}")
        if self.enable_weights_cpu_backup and not self.enable_memory_saver:
            raise ValueError("enable_weights_cpu_backup: needs enable_memory_saver=true (the backup is what "
                             "resume restores after a release)")
        if self.verify_push == "first":
            raise ValueError("verify_push: 'first' was replaced by every_n (push 1, then every sglang.verify_every-th "
                             "push, and the next push whenever a check is inconclusive): the first push alone, when "
                             "LoRA B is ~0, cannot tell an applied adapter from an ignored one; set "
                             "sglang.verify_push=every_n (or every, or never)")
        if self.verify_push not in VERIFY_MODES:
            raise ValueError(f"verify_push: '{self.verify_push}' is not one of {', '.join(VERIFY_MODES)}")
        if isinstance(self.verify_every, bool) or not isinstance(self.verify_every, int) or self.verify_every < 1:
            raise ValueError(f"verify_every: must be an integer >= 1 (pushes between checks), got "
                             f"{self.verify_every!r}")
        if not (math.isfinite(self.parity_tolerance) and self.parity_tolerance > 0):
            raise ValueError(f"parity_tolerance: must be finite and > 0, got {self.parity_tolerance}")
        if not (math.isfinite(self.parity_min_effect) and self.parity_min_effect > 0):
            raise ValueError(f"parity_min_effect: must be finite and > 0 (nats/token), got {self.parity_min_effect}")
        if self.probe_tokens < 2:
            raise ValueError(f"probe_tokens: must be >= 2, got {self.probe_tokens}")
        if self.push not in PUSH_MODES:
            raise ValueError(f"push: '{self.push}' is not one of {', '.join(PUSH_MODES)}")
        if self.moe_runner_backend is not None and not self.moe_runner_backend:
            raise ValueError("moe_runner_backend: empty; name an SGLang MoE runner (marlin, triton, ...) or null")
        clash = sorted(set(self.extra_args) & set(TYPED_ARGS))
        if clash:
            raise ValueError(f"extra_args: {clash} are set by typed fields (sglang.{TYPED_ARGS[clash[0]]}); set "
                             "those instead")


TYPED_ARGS = {  # sglang.Engine argument -> the SGLangConfig field (or what this backend fixes) that sets it
    "attention_backend": "attention_backend", "sampling_backend": "sampling_backend",
    "mem_fraction_static": "mem_fraction_static", "disable_cuda_graph": "cuda_graph",
"enable_lora": "enable_lora", "max_lora_rank": "max_lora_rank",
    "lora_target_modules": "lora_target_modules", "max_loras_per_batch": "max_loras_per_batch",
    "lora_backend": "lora_backend", "enable_memory_saver": "enable_memory_saver",
    "enable_weights_cpu_backup": "enable_weights_cpu_backup", "dtype": "dtype", "context_length": "context_length",
    "log_level": "log_level", "model_path": "model.hf_path", "skip_tokenizer_init": "(always true)",
    "random_seed": "seed", "moe_runner_backend": "moe_runner_backend",
    "enable_multimodal": "(false for a K3 checkpoint)",
}


def server_args(cfg: SGLangConfig, model_path: str, lora=None, seed: int = 0,
                k3: K3Checkpoint | None = None) -> dict[str, Any]:
    """The keyword arguments of `sglang.Engine(...)` for `cfg` serving `model_path` with adapters like `lora`
    (a LoRAConfig, or None for no adapter); `k3`: the directory is this K3 checkpoint (`k3_checkpoint`)."""
    cfg.validate()
    args: dict[str, Any] = {
        "model_path": model_path, "skip_tokenizer_init": True, "random_seed": seed,
        "attention_backend": cfg.attention_backend, "sampling_backend": cfg.sampling_backend,
        "mem_fraction_static": cfg.mem_fraction_static, "disable_cuda_graph": not cfg.cuda_graph,
        "enable_memory_saver": cfg.enable_memory_saver, "enable_weights_cpu_backup": cfg.enable_weights_cpu_backup,
        "dtype": cfg.dtype, "log_level": cfg.log_level,
    }
    if cfg.context_length is not None:
        args["context_length"] = cfg.context_length
    if k3 is not None:
        # K3 is a VLM class in SGLang: multimodal on builds the K3 image processor, which our tokenizer directory
        # lacks (managers/tokenizer_manager.py:468-490, multimodal/processors/kimi_k3.py:306-326).
        args["enable_multimodal"] = False
        if cfg.dtype == "auto":  # a config.json without a dtype makes SGLang's auto fp16 (configs/model_config.py
            args["dtype"] = "bfloat16"  # :1663-1684); K3 is bf16 whatever the file says
    runner = moe_runner(cfg, k3)
    if runner is not None:
        args["moe_runner_backend"] = runner
    if cfg.enable_lora and lora is not None:
        args |= {"enable_lora": True, "max_lora_rank": cfg.max_lora_rank or lora.rank,
                 "lora_target_modules": list(cfg.lora_target_modules or lora.targets),
                 "max_loras_per_batch": cfg.max_loras_per_batch}
        if cfg.lora_backend is not None:
            args["lora_backend"] = cfg.lora_backend
    return args | dict(cfg.extra_args)


# ---- K3 checkpoints on SGLang 0.5.17 ---------------------------------------------------------------------
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
    "python -c \"import json,sys; from miles_k3.model.checkpoint import nested_config; "
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
    config.json (an HF architecture, or not a local directory). Raises CheckpointError listing every problem with its
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
        raise CheckpointError(f"model.path: SGLang 0.5.17 cannot serve the K3 checkpoint {path} "
                              f"({len(problems)} problem{'s' if len(problems) > 1 else ''}):\n  - "
                              + "\n  - ".join(problems) + "\nor train and evaluate it with engine.backend=native")
    return K3Checkpoint(k3, bool(quant))


def _read_config(path: str) -> dict | None:
    try:
        raw = json.loads((Path(path) / "config.json").read_text())
    except OSError:
        return None
    except ValueError as e:
        raise CheckpointError(f"model.path: {path}/config.json is not valid JSON ({e})") from None
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
                f"{list(K3_LORA_TARGETS)} only; set sglang.push=merged (or auto) or keep lora.targets within those (an "
                f"adapter file with other targets evaluates with engine.backend=native)")
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


def import_engine_class():
    """sglang.Engine, or ImportError saying how to install it."""
    try:
        import sglang
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} (import failed: {e})") from None
    return sglang.Engine


def versioned_name(adapter: str, version: int) -> str:
    return f"{adapter}@v{version}"


def version_of(name: str) -> int | None:
    """The version a versioned adapter name carries (`policy@v12` -> 12), else None."""
    head, sep, tail = name.rpartition("@v")
    return int(tail) if sep and head and tail.isdigit() else None


def peft_config_dict(lora) -> dict[str, Any]:
    """adapter_config.json as a dict (what SGLang's load_lora_adapter_from_tensors takes) for a LoRAConfig. SGLang
    0.5.17 ignores use_rslora (its scaling is lora_alpha / r: lora/lora.py:71), so the alpha sent is the one whose
    alpha / r is our scale (alpha * sqrt(r) with rsLoRA), with use_rslora false."""
    alpha = lora_scale(lora.rank, lora.alpha, True) * lora.rank if lora.use_rslora else lora.alpha
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": float(alpha),
            "lora_dropout": 0.0, "target_modules": list(lora.targets), "use_rslora": False,
            "bias": "none", "use_dora": False, "modules_to_save": None, "fan_in_fan_out": False}


def check_result(result, what: str) -> None:
    """SGLang reports a failed control call in its return value ((success, message), or an object with success and
    error_message): raise RuntimeError with its message."""
    if result is None:
        return
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], bool):
        ok, message = result
    elif hasattr(result, "success"):
        ok, message = result.success, getattr(result, "error_message", None)
    else:
        return
    if not ok:
        raise RuntimeError(f"sglang {what} failed: {message}")


def serve_checkpoint(cfg: SGLangConfig, model_cfg, tokenizer, stop_token_ids: list[int], lora=None, seed: int = 0,
                     fallback_context: int = 4096, push: str | None = None) -> SGLangEngine:
    """The SGLangEngine serving the checkpoint directory `model_cfg` names (`hf_path`, else `path`), with adapters
    like `lora` (None: the base alone) pushed as `push` (None: sglang.push), ending every sample at
    `stop_token_ids`. A request may hold `sglang.context_length`, else the checkpoint's max_position_embeddings (its
    config.json), else `fallback_context` tokens."""
    if not stop_token_ids:
        raise ValueError("engine.eos_token_ids: the model directory names no stop token (no eos_token_id in "
                         "generation_config.json or the tokenizer); set engine.eos_token_ids=[ID, ...]")
    path = model_cfg.hf_path or model_cfg.path
    return SGLangEngine(cfg, path, lora=lora, seed=seed, tokenizer=tokenizer, stop_token_ids=list(stop_token_ids),
                        max_context=checkpoint_context(path) or fallback_context, push=push)


def checkpoint_context(path: str) -> int | None:
    """max_position_embeddings of the checkpoint directory `path` (config.json, or its text_config), or None."""
    file = Path(path) / "config.json"
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    value = raw.get("max_position_embeddings") or (raw.get("text_config") or {}).get("max_position_embeddings")
    return int(value) if isinstance(value, int) and value > 0 else None


class SGLangEngine:
    """The `RolloutEngine` interface over `sglang.Engine` (see the module docstring). Adapter tensors are pushed
    under their PEFT names (`miles_k3.adapter.peft_tensors`), which SGLang loads, or merged into the base weights
    (`push`: the resolved mode, `resolve_push`). A K3 checkpoint directory is checked (`k3_checkpoint`) before
    SGLang starts. `stop_token_ids` end every sample (added to each request's sampling params unless it names its
    own). `engine_cls` replaces sglang.Engine (tests pass a double)."""

    backend = "sglang"
    push_needs_memory = True  # a push's parity probe runs a request: the loop resumes memory before it

    def __init__(self, cfg: SGLangConfig, model_path: str, lora=None, seed: int = 0, tokenizer: Any = None,
                 stop_token_ids: list[int] | None = None, max_context: int = 4096, engine_cls=None,
                 push: str | None = None):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.max_context = cfg.context_length or max_context  # prompt + completion tokens a request may hold
        self.stop_token_ids = list(stop_token_ids or [])
        cfg.validate()
        self.k3 = k3_checkpoint(model_path, cfg)
        self.push, why = resolve_push(push or cfg.push, lora, self.k3, cfg)
        args = server_args(cfg, model_path, lora if self.push == "lora" else None, seed, self.k3)
        engine_cls = engine_cls or import_engine_class()
        if self.push is not None:
            log.info("sglang push=%s (%s)", self.push, why)
        log.info("sglang engine: %s", ", ".join(f"{k}={v}" for k, v in args.items() if k != "model_path"))
        self.engine = engine_cls(**args)
        self.weight_version = 0
        self._serving: dict[str, str] = {}  # adapter name -> the versioned SGLang name requests go to
        self._configs: dict[str, Any] = {}
        self._in_flight: Counter[str] = Counter()  # versioned name -> requests of ours running on it
        self._retired: set[str] = set()  # replaced versions, unloaded once their requests finish
        self._released: set[str] = set()
        self._merged: set[str] = set()  # adapters served merged into the base (push=merged)
        self._running = 0  # requests of ours in SGLang now (a base-weight update needs none)
        self._lock = threading.RLock()

    # ---- generation ------------------------------------------------------------------------------------
    def generate(self, input_ids: list[list[int]] | None = None, prompts: list[str] | None = None,
                 sampling_params: dict | list[dict] | None = None, n: int = 1, return_logprob: bool = True,
                 lora: str | list[str | None] | None = None) -> list[dict]:
        """Samples for every prompt, `n` each, prompt i's sample j at i * n + j (see the module docstring)."""
        ids, params, loras = generate_requests(input_ids, prompts, sampling_params, n, lora, self.tokenizer,
                                               self._released)
        with self._lock:
            names = [self._route(name) for name in loras]
            used = Counter(name for name in names for _ in range(n) if name is not None)
            self._in_flight.update(used)
            self._running += len(names) * n
        reqs, sps, paths = [], [], []
        for p, sp, name in zip(ids, params, names):
            for j in range(n):
                one = dict(sp)
                if self.stop_token_ids and "stop_token_ids" not in one:
                    one["stop_token_ids"] = list(self.stop_token_ids)
                if one.get("sampling_seed") is not None:
                    one["sampling_seed"] = int(one["sampling_seed"]) + j
                reqs.append(list(p))
                sps.append(one)
                paths.append(name)
        try:
            outs = self.engine.generate(input_ids=reqs, sampling_params=sps, return_logprob=return_logprob,
                                        lora_path=paths if any(paths) else None) if reqs else []
        finally:
            with self._lock:
                self._in_flight.subtract(used)
                self._running -= len(names) * n
                self._unload_drained()
        if len(outs) != len(reqs):
            raise RuntimeError(f"sglang returned {len(outs)} results for {len(reqs)} requests")
        return [self._record(o, name, return_logprob) for o, name in zip(outs, paths)]

    def prompt_logprobs(self, ids: list[int], adapter: str | None) -> list[float]:
        """SGLang's log-probs of ids[1:] given their prefixes (prompt log-probs), with the adapter as served under
        the versioned or plain SGLang name `adapter` (None: the base)."""
        out = self.engine.generate(input_ids=[list(ids)], sampling_params=[{"max_new_tokens": 1,
                                                                             "temperature": 0.0}],
                                   return_logprob=True, logprob_start_len=0,
                                   lora_path=[adapter] if adapter is not None else None)
        rows = out[0]["meta_info"]["input_token_logprobs"]
        values = [row[0] for row in rows]
        if len(values) == len(ids) and values[0] is None:
            values = values[1:]  # the first prompt token has no log-prob
        if len(values) != len(ids) - 1 or any(v is None for v in values):
            raise RuntimeError(f"sglang returned {len(values)} prompt log-probs for a {len(ids)}-token probe")
        return [float(v) for v in values]

    # ---- adapters and weights --------------------------------------------------------------------------
    def load_lora_adapter_from_tensors(self, name: str, tensors: Mapping[str, torch.Tensor], config) -> None:
        """Serve adapter `name` (config: its LoRAConfig) from the trainer's tensors, as version weight_version."""
        if self.push != "lora":
            raise ValueError(f"adapter '{name}': this engine pushes {self.push or 'no adapter'}, not a LoRA "
                             "adapter (sglang.push)")
        self._configs[name] = config
        staged = self.stage_adapter(name, tensors, self.weight_version)
        self.commit_adapter(name, staged)

    def update_weights_from_tensor(self, named_tensors: Mapping[str, torch.Tensor] | list[tuple[str, torch.Tensor]],
                                   lora_name: str | None = None, weight_version: int | None = None) -> None:
        """With `lora_name`: serve a new version of that adapter from `named_tensors` (the trainer's names). Without:
        update base weights in place (HF names; SGLang's update_weights_from_tensor). The engine's weight_version
        becomes `weight_version` (default: one more); versions only move forward."""
        version = self._next_version(weight_version)
        if lora_name is None:
            self.write_base_weights(dict(named_tensors))
            self.weight_version = version
            return
        staged = self.stage_adapter(lora_name, named_tensors, version)
        self.commit_adapter(lora_name, staged)

    def write_base_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        """Write base weights by checkpoint name in ONE update_weights_from_tensor call (flush_cache=True), the
        weight_version unchanged. Refused (RuntimeError, nothing sent) while requests of ours run: SGLang's flush
        after an update asserts an idle scheduler (managers/scheduler.py:4137-4160), and a request would mix
        weights. SGLang skips names its model lacks without a word (models/kimi_k3.py:2824-2825, :2846-2847)."""
        with self._lock:
            if self._running:
                raise RuntimeError(f"base weights cannot be updated while {self._running} requests run")
            check_result(self.engine.update_weights_from_tensor(named_tensors=list(named_tensors.items()),
                                                                flush_cache=True), "update_weights_from_tensor")

    def running(self) -> int:
        """Requests of ours in SGLang now."""
        with self._lock:
            return self._running

    def serve_merged(self, name: str) -> None:
        """Serve adapter `name` merged into the base weights (push=merged): requests for it go to the base, whose
        weights the channel writes (`write_base_weights`)."""
        if self.push != "merged":
            raise ValueError(f"adapter '{name}': this engine pushes {self.push}, not merged (sglang.push)")
        self._merged.add(name)

    def stage_adapter(self, name: str, tensors: Mapping[str, torch.Tensor], version: int) -> str:
        """Load the tensors as `name@v<version>` without serving it yet; returns the staged SGLang name. Refuses
        (ValueError, nothing loaded) an unknown adapter, an empty push or a non-finite tensor."""
        if name not in self._configs:
            raise ValueError(f"adapter '{name}' is not loaded; load_lora_adapter_from_tensors first (loaded: "
                             f"{sorted(self._configs)})")
        if not tensors:
            raise ValueError("empty push: no tensors given (a push must carry the whole adapter)")
        finite = torch.stack([torch.isfinite(t).all() for t in tensors.values()]).tolist()  # one device sync
        bad = next((key for key, ok in zip(tensors, finite) if not ok), None)
        if bad is not None:
            raise ValueError(f"tensor {bad} has non-finite values; the push is refused")
        staged = versioned_name(name, version)
        peft = {key: t.detach().contiguous() for key, t in tensors.items()}
        check_result(self.engine.load_lora_adapter_from_tensors(staged, peft, peft_config_dict(self._configs[name])),
                     f"load_lora_adapter_from_tensors({staged})")
        return staged

    def commit_adapter(self, name: str, staged: str) -> None:
        """Route new requests for `name` to the staged version; the one it replaces is unloaded once drained."""
        with self._lock:
            old = self._serving.get(name)
            self._serving[name] = staged
            self.weight_version = version_of(staged)
            if old is not None and old != staged:
                self._retired.add(old)
            self._unload_drained()

    def discard_adapter(self, staged: str) -> None:
        """Unload a staged version that never served (a push that failed its check)."""
        check_result(self.engine.unload_lora_adapter(staged), f"unload_lora_adapter({staged})")

    def serving(self, name: str) -> str | None:
        """The versioned SGLang name requests for adapter `name` go to."""
        return self._serving.get(name)

    # ---- memory and lifecycle --------------------------------------------------------------------------
    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Free SGLang's memory for `tags` (None = all three) while no request runs."""
        tags = self._check_tags(tags)
        check_result(self.engine.release_memory_occupation(tags=tags), "release_memory_occupation")
        self._released |= set(tags)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        tags = self._check_tags(tags)
        check_result(self.engine.resume_memory_occupation(tags=tags), "resume_memory_occupation")
        self._released -= set(tags)

    def flush_cache(self) -> bool:
        out = self.engine.flush_cache()
        return bool(getattr(out, "success", True if out is None else out))

    def shutdown(self) -> None:
        self.engine.shutdown()

    close = shutdown

    # ---- internals -------------------------------------------------------------------------------------
    def _route(self, name: str | None) -> str | None:
        if name is None or name in self._merged:  # merged: the base serves the adapter
            return None
        if name in self._serving:
            return self._serving[name]
        raise ValueError(f"lora: adapter '{name}' is not loaded (loaded: {sorted(self._serving)})")

    def _unload_drained(self) -> None:
        for old in sorted(self._retired):
            if self._in_flight[old] <= 0:
                check_result(self.engine.unload_lora_adapter(old), f"unload_lora_adapter({old})")
                self._retired.discard(old)
                del self._in_flight[old]

    def _next_version(self, weight_version: int | None) -> int:
        if weight_version is None:
            return self.weight_version + 1
        if weight_version <= self.weight_version:
            raise ValueError(f"weight_version: versions only move forward; the engine serves version "
                             f"{self.weight_version}, the push has {weight_version}")
        return weight_version

    def _record(self, out: dict, name: str | None, return_logprob: bool) -> dict:
        """One SGLang result as the native engine's record."""
        meta = out.get("meta_info", {})
        finish = meta.get("finish_reason") or {"type": "abort", "message": "no finish reason"}
        if isinstance(finish, dict) and finish.get("type") == "abort":
            return {"error": finish.get("message", "aborted by sglang"), "meta_info": {"finish_reason": finish}}
        ids = list(out.get("output_ids", []))
        version = version_of(name) if name is not None else self.weight_version
        record_meta = {"finish_reason": finish, "prompt_tokens": meta.get("prompt_tokens", 0),
                       "completion_tokens": meta.get("completion_tokens", len(ids)),
                       "cached_tokens": meta.get("cached_tokens", 0), "weight_version": version,
                       "weight_versions": [version]}
        if return_logprob:
            rows = meta.get("output_token_logprobs") or []
            pairs = [(float(row[0]), int(row[1])) for row in rows]
            if [t for _, t in pairs] != ids:
                raise RuntimeError(f"sglang returned log-probs of {len(pairs)} tokens for {len(ids)} output ids "
                                   "(or of other tokens): the sample cannot be trained on")
            record_meta["output_token_logprobs"] = pairs
        return {"output_ids": ids, "meta_info": record_meta}

    def _check_tags(self, tags: list[str] | None) -> list[str]:
        tags = list(MEMORY_TAGS) if tags is None else list(tags)
        bad = [t for t in tags if t not in MEMORY_TAGS]
        if bad:
            raise ValueError(f"memory tags {bad} are not SGLang's ({', '.join(MEMORY_TAGS)})")
        if not self.cfg.enable_memory_saver:
            raise ValueError("release/resume_memory_occupation: needs sglang.enable_memory_saver=true")
        if "weights" in tags and not self.cfg.enable_weights_cpu_backup:
            raise ValueError("releasing 'weights' without sglang.enable_weights_cpu_backup=true would resume them as "
                             "garbage; enable the backup or release only kv_cache and cuda_graph")
        return tags
