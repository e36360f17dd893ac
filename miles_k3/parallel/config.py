"""The `parallel:` config section and its checks against the world size (the model's shapes are checked by the
model's own plan, `miles_k3.model.parallelize.check_mesh`).

Ranks are laid out dp-major: rank = dp_rank * tp + tp_rank (the DeviceMesh `("dp", "tp")`). Expert parallelism
groups `ep` consecutive ranks (an EP group spans whole TP groups or a part of one) and each of its ranks owns
num_experts / ep routed experts; with ep < world the world / ep EP groups hold the same experts (the expert
replica groups: ranks with the same position in their EP group).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional


class ParallelConfigError(ValueError):
    """A `parallel.*` value that does not fit the world size or the model; the message names the field."""


@dataclass
class ParallelConfig:
    dp: Optional[int] = None  # noqa: UP045 (OmegaConf 2.3 structured configs need Optional)
    """Data-parallel replicas: each samples its own prompt groups; LoRA gradients are summed over them. Default
    (null): torchrun's world size / tp (1 without torchrun); set when the config is validated."""
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
        if self.dp is None:
            self.dp = self._default_dp()
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

    def _default_dp(self) -> int:
        """world / tp under torchrun (WORLD_SIZE); 1 without it (a tp > 1 is then refused at start, `check_world`)."""
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            return 1
        world = int(os.environ["WORLD_SIZE"])
        if not isinstance(self.tp, int) or self.tp < 1:
            return 1  # the tp check names the field
        if world % self.tp:
            raise ParallelConfigError(f"parallel.tp: {self.tp} does not divide the {world} processes torchrun "
                                      f"started (parallel.dp defaults to their number / tp); use a tp among "
                                      f"{divisors(world)}")
        return world // self.tp

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


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
