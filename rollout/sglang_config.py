"""The typed `sglang:` config of `engine.backend=sglang` (`SGLangConfig`: SGLang's server arguments and how pushes
are verified), kept apart from `sglang_backend.py` so that composing a config imports neither the engine nor SGLang.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

VERIFY_MODES = ("never", "every_n", "every")
PUSH_MODES = ("auto", "lora", "merged")
PROBE_MODES = ("completions", "prompt")  # sglang.probe (weight_sync.sglang.parity_probe builds it)


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
    """A push is refused when the mean |trainer - engine| log-prob (nats/token) over the probe exceeds their mean
    difference on the base (no adapter) by more than this."""
    parity_min_effect: float = 0.01
    """Noise floor (nats/token): a check is conclusive only when the adapter moves the trainer's probe log-probs by
    at least this on average (and by 10x the engine-trainer gap on the base, the bf16 noise). Below 0.01 the
    adapter changes the probe's token probabilities by ~1% on average: too little to tell a dropped or mis-scaled
    adapter from noise, and too little to matter to the rollouts yet. > 0."""
    probe: str = "completions"
    """The parity probe's text: completions (the first training prompts, each followed by the base policy's greedy
    completion from the engine, taken once at start: text the policy reads and writes) or prompt (the first
    training prompt repeated: text a trained policy never writes, where bf16 noise grows with the adapter's
    effect; a 240-step run at lr 1e-3 was refused at push 21 on it while its rollouts agreed to 0.004 nats/token)."""
    probe_tokens: int = 128
    """Length of the parity probe in tokens (with probe=completions, more than the first training prompt's)."""
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
        if self.probe not in PROBE_MODES:
            raise ValueError(f"probe: '{self.probe}' is not one of {', '.join(PROBE_MODES)}")
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
    "enable_multimodal": "(false for a K3 checkpoint)", "enable_fp32_lm_head": "model.fp32_lm_head",
}
