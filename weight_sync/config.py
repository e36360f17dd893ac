"""`sync:` in the run config: which transport carries the trainer's LoRA tensors to the engine, how big its
transfer buffer is, what is verified, and how stale a rollout sample may be."""
from __future__ import annotations

from dataclasses import dataclass

from miles_k3.weight_sync.staleness import POLICIES

TRANSPORTS = ("local", "ipc", "dist")


@dataclass
class WeightSyncConfig:
    """The weight-sync channel (`miles_k3.weight_sync`)."""

    transport: str = "local"
    """local (engine in the trainer's process: copy straight into its buffers), ipc (engine in another process
    of this host: shared memory on CPU, CUDA IPC on GPU), dist (engines on other torch.distributed ranks)."""
    buffer_mb: int = 512
    """Transfer buffer of ipc / dist in MiB (allocated once, reused by every push); pushes larger than it go
    in several chunks."""
    checksum: bool = True
    """ipc / dist: per-tensor checksums over the bytes sent, verified by the engine before applying."""
    readback: bool = False
    """Debug: after each push the engine compares every byte of its buffers with the pushed tensors."""
    timeout_s: float = 300.0
    """ipc: seconds to wait for the other side before the push fails (the engine keeps its version)."""
    max_staleness: int = 0
    """Rollout samples more than this many weight versions behind the trainer are stale (0: on-policy only)."""
    stale_policy: str = "drop"
    """What happens to stale samples: drop (weight 0) or downweight (weight downweight ** excess)."""
    downweight: float = 0.5
    """Per version of excess staleness, with stale_policy=downweight; in (0, 1]."""

    def validate(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport: '{self.transport}' is not one of {', '.join(TRANSPORTS)}")
        if self.buffer_mb < 1:
            raise ValueError(f"buffer_mb: must be >= 1, got {self.buffer_mb}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s: must be > 0, got {self.timeout_s}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness: must be >= 0, got {self.max_staleness}")
        if self.stale_policy not in POLICIES:
            raise ValueError(f"stale_policy: '{self.stale_policy}' is not one of {', '.join(POLICIES)}")
        if not 0.0 < self.downweight <= 1.0:
            raise ValueError(f"downweight: must be in (0, 1], got {self.downweight}")

    @property
    def buffer_bytes(self) -> int:
        return self.buffer_mb * 2**20
