"""`sync:` in the run config: which transport carries the trainer's LoRA tensors to the engine, how big its
transfer buffer is and what is verified.

The training loop is synchronous (rollouts, then the update, then the push): every sample is drawn with the
adapter the trainer has, so there is no staleness bound to configure; the loop checks that every sample's oldest
weight version is the trainer's."""
from __future__ import annotations

from dataclasses import dataclass

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

    def validate(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport: '{self.transport}' is not one of {', '.join(TRANSPORTS)}")
        if self.buffer_mb < 1:
            raise ValueError(f"buffer_mb: must be >= 1, got {self.buffer_mb}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s: must be > 0, got {self.timeout_s}")

    @property
    def buffer_bytes(self) -> int:
        return self.buffer_mb * 2**20
