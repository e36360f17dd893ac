"""The rollout engine's model and LoRA buffers: the trainer's base tensors shared as they are, and one fixed set
of adapter buffers per adapter name, copied into the model's LoRA parameters when a batch uses that adapter.

`share_base(model)` builds the engine's K3ForCausalLM from the trainer's base Parameter / buffer objects (no copy,
no adapters). `AdapterBank(model, lora)` attaches LoRA parameters to it (their addresses never change: captured
CUDA graphs read them) and keeps each adapter's tensors in buffers allocated once at registration; pushes are
checked in full (names, shapes, finiteness) before any byte is copied, so a bad push changes nothing.
"""
from __future__ import annotations

import torch
from torch import nn

from miles_k3.model.checkpoint import meta_model
from miles_k3.model.k3 import K3ForCausalLM
from miles_k3.model.lora import LoRAConfig, applied_lora_config, apply_lora, lora_parameters


def share_base(model: K3ForCausalLM) -> K3ForCausalLM:
    """A K3ForCausalLM whose base tensors ARE `model`'s (same Parameter / buffer objects, no copy), without
    `model`'s adapters: the engine attaches its own LoRA buffers."""
    twin = meta_model(model.config, model.expert_format, model.kda_backend_name)
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, t in tensors:
        if "lora_" in name:
            continue
        owner, _, leaf = name.rpartition(".")
        module: nn.Module = twin.get_submodule(owner)
        if leaf in module._parameters:
            module._parameters[leaf] = t
        else:
            module._buffers[leaf] = t
    return twin.eval()


class AdapterBank:
    """Adapters by name over one model's LoRA parameters. Name None is the base model (every lora_B zero);
    without a LoRA config the bank is empty and only None is served."""

    def __init__(self, model: K3ForCausalLM, lora: LoRAConfig | None):
        self.model, self.config = model, lora
        self._buffers: dict[str | None, dict[str, torch.Tensor]] = {}
        self._params: dict[str, torch.Tensor] = {}
        if lora is not None:
            apply_lora(model, lora)
            self._params = lora_parameters(model)
            self._buffers[None] = {n: torch.zeros_like(p) for n, p in self._params.items()}  # base: B = 0
        self._bound: tuple | None = None  # (adapter name, version) copied into the LoRA parameters

    def names(self) -> list[str]:
        """The registered adapter names (None, the base model, excluded)."""
        return [a for a in self._buffers if a is not None]

    def buffers(self, name: str | None) -> dict[str, torch.Tensor]:
        """Adapter `name`'s buffers by parameter name (the live tensors: read them back to verify a push)."""
        if name not in self._buffers:
            raise ValueError(f"unknown adapter {name!r}; loaded: {self.names()}")
        return self._buffers[name]

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
        _copy_checked(buffers, tensors, f"adapter {name!r}", require_all=True)
        self._buffers[name] = buffers

    def update(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        """Copy tensors in place into adapter `name`'s buffers (addresses never change); all checked first."""
        if name is None or name not in self._buffers:
            raise ValueError(f"unknown adapter {name!r}; load it with load_lora_adapter_from_tensors")
        _copy_checked(self._buffers[name], tensors, f"adapter {name!r}", require_all=False)
        self._bound = None  # the parameters may hold this adapter's old values

    @torch.no_grad()
    def bind(self, name: str | None, version: int) -> None:
        """Copy adapter `name`'s buffers into the LoRA parameters; skipped when that adapter at this version is
        bound already."""
        if self.config is None or self._bound == (name, version):
            return
        for pname, p in self._params.items():
            p.copy_(self._buffers[name][pname])
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


def _copy_checked(buffers: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], what: str,
                  require_all: bool) -> None:
    """Check every name, shape, dtype kind and value, then copy; on any error nothing is copied. The value check
    is one batched pass (one host sync for the whole push) and the copy a multi-tensor copy (a few launches)."""
    unknown = sorted(set(tensors) - set(buffers))
    missing = sorted(set(buffers) - set(tensors)) if require_all else []
    if unknown or missing:
        raise ValueError(f"{what}: unknown tensors {unknown[:3]}, missing tensors {missing[:3]}; names must "
                         "be the trainer's lora_parameters() names")
    names = list(tensors)
    src, dst = list(tensors.values()), [buffers[n] for n in names]
    ok = [s.shape == d.shape and s.is_floating_point() for s, d in zip(src, dst)]
    if not all(ok):
        name, t = names[ok.index(False)], src[ok.index(False)]
        raise ValueError(f"{what}: tensor {name} has {t.dtype} {tuple(t.shape)}, expected a floating "
                         f"tensor of shape {tuple(buffers[name].shape)}")
    if not names:
        return
    device = dst[0].device
    src = [s if s.device == device else s.to(device) for s in src]
    with torch.no_grad():
        bad = _first_non_finite(src)
        if bad is not None:
            raise ValueError(f"{what}: tensor {names[bad]} has NaN/Inf values; refusing the whole push")
        torch._foreach_copy_(dst, src)


def _first_non_finite(tensors: list[torch.Tensor]) -> int | None:
    """Index of the first tensor holding a NaN/Inf, or None, with one host sync. On CUDA one multi-tensor
    max-abs pass; on CPU per-tensor sums (6x faster than max-abs there; NaN/Inf propagate into a sum), where a
    non-finite sum is confirmed with isfinite (a sum of huge finite values may overflow)."""
    if tensors[0].is_cuda:
        stat = torch.stack(torch._foreach_norm(tensors, float("inf")))
    else:
        stat = torch.stack([t.sum(dtype=torch.float32) for t in tensors])
    suspects = (~torch.isfinite(stat)).nonzero().flatten().tolist()
    return next((i for i in suspects if not bool(torch.isfinite(tensors[i]).all())), None)
