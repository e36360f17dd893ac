"""The rollout engine's model and LoRA buffers: the trainer's base tensors shared as they are, and one fixed set
of adapter buffers per adapter name, copied into the model's LoRA parameters when a batch uses that adapter.

`share_base(model)` builds the engine's K3ForCausalLM from the trainer's base Parameter / buffer objects (no copy,
no adapters). `AdapterBank(model, lora)` attaches LoRA parameters to it (their addresses never change: captured
CUDA graphs read them) and keeps each adapter's tensors in buffers allocated once at registration; pushes are
checked in full (names, shapes, finiteness) before any byte is copied, so a bad push changes nothing
(`push_copy.py`). Every adapter module also keeps `InferenceCopies` (A and B in the compute dtype; kv_b_proj's
merged weight, which MLA's absorbed decode reads), refreshed when an adapter is bound: a decode step does not
recast or re-merge the adapter it serves. With `merge_lora` (`EngineConfig.merge_lora`) every adapted dense linear
keeps its merged weight W + s * B @ A and its forward is one GEMM over it; the routed experts' adapters (their base
is MXFP4) are applied unmerged as before. The base Parameters are the trainer's and are never written: the merged
weights are buffers of their own (one more copy of each adapted dense weight), re-merged whenever `bind` copies in
another adapter or version. With `fuse_projections` (`EngineConfig.fuse_projections`) the decode step's groups of
linears that read one input (`miles_k3.model.fused_projections`) are attached after the copies and refreshed with
them.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from miles_k3.model.fused_projections import FusedProjections, attach_fused_projections
from miles_k3.model.k3 import K3ForCausalLM
from miles_k3.model.lora import (
    ExpertLoRA,
    InferenceCopies,
    LoRAConfig,
    LoRALinear,
    applied_lora_config,
    apply_lora,
    lora_parameters,
)
from miles_k3.model.parallelize import parallelize
from miles_k3.model.weight_files import meta_model
from miles_k3.parallel.mesh import SINGLE, ParallelContext
from miles_k3.rollout.push_copy import PushCopier, copy_checked

log = logging.getLogger(__name__)


def share_base(model: K3ForCausalLM, ctx: ParallelContext = SINGLE) -> K3ForCausalLM:
    """A K3ForCausalLM whose base tensors ARE `model`'s (same Parameter / buffer objects, no copy), without
    `model`'s adapters: the engine attaches its own LoRA buffers. The twin is planned for `ctx` as the model was
    (`parallelize` on the meta device: its shapes, head counts, held experts and groups), and each shared tensor is
    checked to have the shape that plan gives. Its residual stream and logits are computed as `model`'s
    (`fp32_residual`, `fp32_lm_head`)."""
    twin = meta_model(model.config, model.expert_format, model.kda_backend_name)
    parallelize(twin, ctx)
    twin._backends = model._backends  # the same KDA backends, resolved (and logged) once for both
    twin.fp32_lm_head = model.fp32_lm_head  # the same logits dtype as the trainer's
    twin.model.fp32_residual = model.model.fp32_residual  # and the same residual dtype
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, t in tensors:
        if "lora_" in name:
            continue
        owner, _, leaf = name.rpartition(".")
        module: nn.Module = twin.get_submodule(owner)
        planned = module._parameters[leaf] if leaf in module._parameters else module._buffers[leaf]
        if planned.shape != t.shape:
            raise ValueError(f"share_base: '{name}' is {list(t.shape)} in the model but {list(planned.shape)} in "
                             f"the plan of {ctx.name()} (tp={ctx.tp_size}, ep={ctx.ep_size}): give the engine the "
                             "context the model was built for")
        if leaf in module._parameters:
            module._parameters[leaf] = t
        else:
            module._buffers[leaf] = t
    return twin.eval()


class AdapterBank:
    """Adapters by name over one model's LoRA parameters. Name None is the base model (every lora_B zero);
    without a LoRA config the bank is empty and only None is served. `merge_lora`: the adapted dense linears
    compute with merged weights (`attach_inference_copies`); binding another adapter (or another version of one)
    re-merges each of them, so one adapter served across many steps is what it is for."""

    def __init__(self, model: K3ForCausalLM, lora: LoRAConfig | None, merge_lora: bool = False,
                 fuse_projections: bool = False):
        self.model, self.config = model, lora
        self._buffers: dict[str | None, dict[str, torch.Tensor]] = {}
        self._params: dict[str, torch.Tensor] = {}
        self._adapted: list[nn.Module] = []  # the adapter modules, whose InferenceCopies `bind` refreshes
        self.fused: list[FusedProjections] = []  # the decode step's fused projections, which `bind` refreshes
        if lora is not None:
            apply_lora(model, lora)
            model.eval()  # the new LoRA modules are built in training mode: lora.dropout is for training only
            self._adapted = attach_inference_copies(model, merge_lora)
            self._params = lora_parameters(model)
            self._buffers[None] = {n: torch.zeros_like(p) for n, p in self._params.items()}  # base: B = 0
        if fuse_projections:
            for module in self._adapted:  # the adapted linears outside the groups: the B GEMM adds in place
                if isinstance(module, LoRALinear):
                    module.inference_copies.add_in_gemm = True
            self.fused = attach_fused_projections(model)
            log.info("engine: %d fused projection groups, %.1f MiB of stacked weights", len(self.fused),
                     sum(g.nbytes() for g in self.fused) / 2**20)
        self._bound: tuple | None = None  # (adapter name, version) copied into the LoRA parameters
        self._copiers: dict[str, PushCopier] = {}

    def names(self) -> list[str]:
        """The registered adapter names (None, the base model, excluded)."""
        return [a for a in self._buffers if a is not None]

    def buffers(self, name: str | None) -> dict[str, torch.Tensor]:
        """Adapter `name`'s buffers by parameter name (the live tensors: read them back to verify a push)."""
        if name not in self._buffers:
            raise ValueError(f"unknown adapter {name!r}; loaded: {self.names()}")
        return self._buffers[name]

    def index(self, name: str | None) -> int:
        """A number for adapter `name`, the same on every rank that registered the same adapters in the same order
        (None, the base: 0); what the engines of a lockstep agree on (`parallel.lockstep`)."""
        return list(self._buffers).index(name) if name in self._buffers else 0

    def name_at(self, index: int) -> str | None:
        """The adapter of `index` (see `index`)."""
        return list(self._buffers)[index] if self._buffers else None

    @property
    def bound_name(self) -> str | None:
        """The adapter whose values the LoRA parameters hold now (None: the base, or nothing bound yet)."""
        return None if self._bound is None else self._bound[0]

    def serves(self, name: str | None) -> bool:
        return name in self._buffers or (name is None and self.config is None)

    def load(self, name: str, tensors: dict[str, torch.Tensor], config: LoRAConfig) -> None:
        """Register adapter `name`: its buffers are allocated here, once, and updated in place later."""
        if self.config is None:
            raise ValueError("this engine was built without a LoRA config (RolloutEngine(..., lora=...))")
        if name is None or name in self._buffers:
            raise ValueError(f"adapter name {name!r} is taken; use update_weights_from_tensor to change it")
        self._check_config(config)
        buffers = {n: torch.empty_like(p) for n, p in self._params.items()}
        copy_checked(buffers, tensors, f"adapter {name!r}", require_all=True)
        self._buffers[name] = buffers
        self._copiers[name] = PushCopier(buffers, f"adapter {name!r}")

    def update(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        """Copy tensors in place into adapter `name`'s buffers (addresses never change); all checked first."""
        if name is None or name not in self._buffers:
            raise ValueError(f"unknown adapter {name!r}; load it with load_lora_adapter_from_tensors")
        self._copiers[name].copy(tensors)
        self._bound = None  # the parameters may hold this adapter's old values

    @torch.no_grad()
    def bind(self, name: str | None, version: int) -> None:
        """Copy adapter `name`'s buffers into the LoRA parameters and refresh every module's InferenceCopies in
        place (casts, merged weights); skipped when that adapter at this version is bound already."""
        if self.config is None or self._bound == (name, version):
            return
        torch._foreach_copy_(list(self._params.values()), [self._buffers[name][n] for n in self._params])
        for module in self._adapted:
            module.inference_copies.refresh(module)
        for group in self.fused:
            group.refresh()
        self._bound = (name, version)

    def _check_config(self, config: LoRAConfig) -> None:
        have = applied_lora_config(self.model)
        for f in ("rank", "alpha", "use_rslora"):
            if getattr(config, f) != getattr(have, f):
                raise ValueError(f"adapter config {f}={getattr(config, f)} but the engine's LoRA buffers have "
                                 f"{f}={getattr(have, f)}; build the engine with the trainer's LoRAConfig")
        if sorted(config.targets) != sorted(have.targets):
            raise ValueError(f"adapter targets {sorted(config.targets)} differ from the engine's "
                             f"{sorted(have.targets)}")


MERGED_READS = ("kv_b_proj",)
"""Adapted linears whose weight is read through `effective_weight` (MLA's absorbed decode) rather than called."""


def attach_inference_copies(model: nn.Module, merge_lora: bool = False) -> list[nn.Module]:
    """`InferenceCopies` on every adapter module of the engine's `model`: A and B in the dtype the module computes
    in (a LoRALinear's weight dtype; routed experts' adapters: the embeddings' dtype, the activations'), plus the
    merged weight for MERGED_READS, and with `merge_lora` for every LoRALinear, whose forward then reads it
    (`forward_merged`). Returns the modules, whose copies are refreshed after every change of the adapter."""
    act_dtype = model.model.embed_tokens.weight.dtype
    out = []
    for path, m in model.named_modules():
        if isinstance(m, LoRALinear):
            InferenceCopies.attach(m, m.weight.dtype, merged=path.rsplit(".", 1)[-1] in MERGED_READS,
                                   forward_merged=merge_lora)
        elif isinstance(m, ExpertLoRA):
            InferenceCopies.attach(m, act_dtype)
        else:
            continue
        out.append(m)
    return out
