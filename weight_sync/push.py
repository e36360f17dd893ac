"""What every channel's push shares, whatever carries it (`local.LocalChannel`, `sglang.SGLangChannel`,
`sglang.SGLangMergedChannel`): a push of adapter version v is all-or-nothing, so a refused one raises `SyncError`
with nothing applied (the engine keeps serving its previous version; versions only move forward), and a push that
went through returns a `PushReport` (what it moved and how long it took, logged under `sync/`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


class SyncError(RuntimeError):
    """A push was refused; nothing was applied and the engine still serves its previous version. `tensor` names
    the offending tensor when there is one; `metrics` holds what the push measured before it was refused (an SGLang
    parity check's figures, `sync/parity_*`), which the training loop logs with the step."""

    def __init__(self, message: str, tensor: str | None = None, metrics: dict[str, float] | None = None):
        super().__init__(message)
        self.tensor = tensor
        self.metrics = dict(metrics or {})


def sync_devices(devices) -> None:
    """Wait for the current stream of every CUDA device in `devices` (CPU devices need no wait): a push's time
    starts after the trainer's pending work and ends when its copies are done."""
    for d in devices:
        if d.type == "cuda":
            torch.cuda.current_stream(d).synchronize()


@dataclass
class PushReport:
    """What one push did (logged under `sync/`)."""

    version: int
    transport: str
    bytes: int
    seconds: float
    num_tensors: int
    readback_match: bool | None = None  # the debug readback (sync.readback): every engine byte equals the trainer's

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else math.inf

    def metrics(self) -> dict[str, float]:
        m = {"sync/version": self.version, "sync/bytes": self.bytes, "sync/seconds": self.seconds,
             "sync/gbps": self.gbps, "sync/num_tensors": self.num_tensors}
        if self.readback_match is not None:
            m["sync/readback_match"] = float(self.readback_match)
        return m
