"""`sync:` in the run config: what the native engine's weight-sync channel (`miles_k3.weight_sync.local`) verifies.

The training loop is synchronous (rollouts, then the update, then the push): every sample is drawn with the
adapter the trainer has, so no staleness bound exists to configure; the loop checks that every
sample's oldest weight version is the trainer's."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class WeightSyncConfig:
    """The weight-sync channel (`miles_k3.weight_sync`) into the native engine (engine.backend=native; the SGLang
    backend's pushes are checked as `sglang:` says)."""

    readback: bool = False
    """Debug: after each push the engine compares every byte of its buffers with the pushed tensors."""
