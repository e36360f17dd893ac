"""The rollout engine's configuration (`engine:` of the train/eval configs): which backend generates, and the native
engine's sizes and limits. Kept apart from `engine.py` so that composing a config does not import the engine."""
from __future__ import annotations

from dataclasses import dataclass, field

from miles_k3.rollout.api import BACKEND_CAPABILITIES, capabilities

BACKENDS = tuple(BACKEND_CAPABILITIES)
"""The rollout engines `EngineConfig.backend` names (`rollout.api.BACKEND_CAPABILITIES`: what each can do)."""


@dataclass
class EngineConfig:
    """Which rollout engine generates (`backend`), and the native engine's sizes and limits."""

    backend: str = "native"
    """native (miles_k3's K3 engine in this process, sized by the fields below) or sglang (sglang.Engine serving
    model.hf_path or model.path, its scheduler in SGLang's subprocess, configured by the sglang: section; needs the
    sglang extra and a CUDA GPU). One switch for python -m miles_k3.train and python -m miles_k3.eval."""
    memory_budget_bytes: int = 256 * 2**20
    """Bytes for the KDA state slots and MLA latent pages together (sized by `memory.plan_memory`)."""
    page_size: int = 16
    """Tokens per MLA latent page."""
    max_context: int = 2048
    """Longest prompt + completion a request may reach (backend=sglang: only where neither sglang.context_length
    nor the checkpoint's max_position_embeddings says)."""
    prefill_chunk: int = 256
    """Tokens per request per prefill forward (chunked prefill bounds activation memory)."""
    max_prefill_tokens: int = 16384
    """Tokens (rows x chunk) per batched prefill forward."""
    num_slots: int | None = None
    """Override the planned number of KDA slots (max running requests); None: from the budget."""
    num_pages: int | None = None
    """Override the planned number of latent pages (fewer than slots x context: preemption); None: planned."""
    eos_token_ids: list[int] = field(default_factory=list)
    """Token ids that end a sample unless `ignore_eos`."""
    state_snapshot_bytes: int = 0
    """Host (CPU) memory for snapshots of kept states (a multi-turn conversation's, `kept_state.py`). When state
    slots are short, a parked state gives up its slot, its KDA state is copied here and its latent pages stay; its
    next turn copies it back and prefills only its new tokens. 0: such a state is dropped and its next turn
    recomputes the whole conversation."""
    decode: str = "auto"
    """Decode step: eager (model.step on pooled copies), static (fixed-shape step writing the pools directly,
    `graph_decode.py`), graph (static, captured as CUDA graphs per batch bucket); auto = graph on CUDA, else
    eager."""
    merge_lora: bool = False
    """Serve the LoRA adapter through merged weights: every adapted dense linear (attention, dense and shared-expert
    MLPs; not the routed experts, whose MXFP4 base keeps its adapter apart) computes with W' = round(W + s * B @ A),
    one GEMM, instead of x W^T + s * B(A x) (two GEMMs, a scale and an add more per linear per call). Costs one
    more copy of every adapted dense weight in the engine (the trainer's base weights are shared and never
    written), re-merged whenever another adapter or version is bound: for one RL adapter served across many
    steps. Numerics: the engine samples from the merged weight rounded to the base dtype, so in bf16 its log-probs
    differ from the trainer's by that rounding as well (the importance correction, trainer.loss.tis, covers it
    where on). Off by default: the unmerged engine reproduces the trainer's log-probs more closely. Native engine
    only."""

    fuse_projections: bool | None = None
    """Decode steps compute the linears that read one input as one GEMM (`miles_k3.model.fused_projections`): KDA's
    q, k, v, g, b and f_a; MLA's q_a, kv_a and g; a dense MLP's gate and up; a latent MoE's routed down projection
    with its shared expert's gate and up. With an unmerged adapter, one GEMM more over their A and one over their B
    (block-diagonal), added with the scale inside the GEMM: 3 kernels per group against 5 per adapted linear; every
    other adapted linear adds its delta inside its B GEMM the same way (3 kernels instead of 5; in every engine
    forward, prefill included). A decode step at small batch is bound by its kernel launches. Costs one more copy
    of the grouped base weights in the engine (the trainer's are shared and never written; the engine logs the
    bytes; summed `FusedProjections.nbytes` of a meta-device model's groups: k3_m2 220 MiB, a whole K3 70.5 GiB),
    refreshed when another adapter or version is bound. Skipped for modules split by tensor or expert parallelism.
    Numerics: the same dot products, but the adapter's delta is added before one rounding (and a wider GEMM may
    split its sums differently), so in bf16 log-probs differ from the unfused engine's by rounding. None: on for
    the native engine of a model that is not sharded (tp = ep = 1), off otherwise (full-mode SFT turns it off: its
    eval engine reads the weights being trained in place). Native engine only."""

    def fuses_projections(self, tp_size: int, ep_size: int) -> bool:
        """Whether the native engine of a model planned for tp_size x ep_size fuses projections: the field when
        set, else on for a model that is not sharded (its stacked copies are of the whole dense model)."""
        if self.fuse_projections is not None:
            return self.fuse_projections
        return tp_size == 1 and ep_size == 1

    def validate(self) -> None:
        caps = capabilities(self.backend)  # ValueError naming the backends
        for name in ("memory_budget_bytes", "page_size", "max_context", "prefill_chunk", "max_prefill_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.decode not in ("auto", "eager", "static", "graph"):
            raise ValueError(f"decode: '{self.decode}' is not one of auto, eager, static, graph")
        if self.state_snapshot_bytes < 0:
            raise ValueError(f"state_snapshot_bytes: must be >= 0 (0: no snapshots), got {self.state_snapshot_bytes}")
        if self.state_snapshot_bytes and not caps.keeps_state:
            raise ValueError(f"state_snapshot_bytes: does nothing with backend={self.backend} (it keeps no state "
                             "between requests: the native engine's kept states only); remove it or use "
                             "backend=native")
        if self.fuse_projections and not caps.in_process_model:
            raise ValueError(f"fuse_projections: does nothing with backend={self.backend} (the native engine's "
                             "decode step); remove it or use backend=native")
        if self.merge_lora and not caps.in_process_model:
            raise ValueError(f"merge_lora: does nothing with backend={self.backend} (the native engine's merged "
                             "weights; SGLang merges through sglang.push=merged); remove it or use backend=native")
        for name in ("num_slots", "num_pages"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1 or null, got {getattr(self, name)}")
