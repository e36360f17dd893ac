"""The `parallel:` config section and its checks against the world size and the model's shapes.

Ranks are laid out dp-major: rank = dp_rank * tp + tp_rank (the DeviceMesh `("dp", "tp")`). Expert parallelism
groups `ep` consecutive ranks (an EP group spans whole TP groups or a part of one) and each of its ranks owns
num_experts / ep routed experts; with ep < world the world / ep EP groups hold the same experts (the expert
replica groups: ranks with the same position in their EP group).
"""
from __future__ import annotations

from dataclasses import dataclass

from miles_k3.model.config import K3Config


class ParallelConfigError(ValueError):
    """A `parallel.*` value that does not fit the world size or the model; the message names the field."""


@dataclass
class ParallelConfig:
    dp: int = 1
    """Data-parallel replicas: each samples its own prompt groups; LoRA gradients are summed over them."""
    tp: int = 1
    """Tensor-parallel degree of every dense part (KDA and MLA heads, dense/shared MLPs, vocabulary)."""
    ep: int = 1
    """Expert-parallel degree: each rank of an EP group owns num_experts / ep routed experts (divides dp x tp)."""
    timeout_s: float = 600.0
    """A collective that waits longer than this fails, naming the rank (process-group timeout)."""

    @property
    def world_size(self) -> int:
        return self.dp * self.tp

    def validate(self) -> None:
        for name in ("dp", "tp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ParallelConfigError(f"parallel.{name}: must be an integer >= 1, got {value!r}")
        if not self.timeout_s > 0:
            raise ParallelConfigError(f"parallel.timeout_s: must be > 0, got {self.timeout_s}")
        if self.world_size % self.ep:
            raise ParallelConfigError(
                f"parallel.ep: {self.ep} does not divide the dp x tp = {self.dp} x {self.tp} = {self.world_size} "
                f"ranks (an EP group is ep consecutive ranks); use an ep among {divisors(self.world_size)}")

    def check_world(self, world_size: int, launched: bool) -> None:
        """The launcher started dp x tp processes (`world_size`; `launched`: under torchrun)."""
        if world_size != self.world_size:
            how = (f"torchrun started {world_size} processes" if launched
                   else "this process was not started by torchrun (one process)")
            fix = (f"launch torchrun --nproc-per-node {self.world_size} (x nodes) or set parallel.dp x parallel.tp "
                   f"= {world_size}" if launched else
                   f"launch it with torchrun --nproc-per-node {self.world_size} -m ..., or leave parallel.dp and "
                   "parallel.tp at 1")
            raise ParallelConfigError(f"parallel.dp x parallel.tp = {self.dp} x {self.tp} = {self.world_size} but "
                                      f"{how}; {fix}")

    def check_model(self, cfg: K3Config) -> None:
        """Every sharded dimension of `cfg` divides by its degree (before any weight is built)."""
        lac = cfg.linear_attn_config
        tp_dims = [("KDA heads (linear_attn_config.num_heads)", lac.num_heads),
                   ("MLA heads (num_attention_heads)", cfg.num_attention_heads),
                   ("vocab_size", cfg.vocab_size),
                   ("dense MLP width (intermediate_size)", cfg.intermediate_size)]
        if cfg.num_shared_experts:
            tp_dims.append(("shared-expert width (num_shared_experts x moe_intermediate_size)",
                            cfg.num_shared_experts * cfg.moe_intermediate_size))
        for what, size in tp_dims:
            if size % self.tp:
                raise ParallelConfigError(f"parallel.tp: {self.tp} does not divide the model's {what} = {size}; "
                                          f"use a tp among {divisors(size)}")
        if cfg.num_experts % self.ep:
            raise ParallelConfigError(f"parallel.ep: {self.ep} does not divide the model's num_experts = "
                                      f"{cfg.num_experts}; use an ep among {divisors(cfg.num_experts)} that also "
                                      f"divides dp x tp = {self.world_size}")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
