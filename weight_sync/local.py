"""The native engine's channel (`engine.backend=native`): trainer and engine in the same process (colocated). A
push copies the trainer's tensors straight into the engine's adapter buffers (one multi-tensor copy, cast to the
buffers' dtype where it differs): no transfer buffer and no staging copy. Repeated pushes of the same tensors (the
trainer's LoRA parameters) skip the per-tensor checks and, on CUDA, run as one captured graph of a checked copy
(`miles_k3.rollout.push_copy`, `miles_k3.kernels.checked_copy`). All-or-nothing comes from checking everything
before any byte moves (names, shapes, dtypes, finite values: `RolloutEngine.update_weights_from_tensor`); nothing
can corrupt bytes between two tensors of one process, so no checksum is computed. `readback=True`
(`sync.readback`, debug) compares every byte of the engine's buffers with the trainer's tensors after the push.

On many ranks (`ctx`: each rank's trainer pushes its own adapter shard into its own colocated engine) a push is one
transaction across the world: every rank checks its push without applying it
(`RolloutEngine.check_weights_from_tensor`), the verdicts are reduced over every rank, and then every rank applies
it or none does. So the ranks' engines always serve the same weight version; a refusal anywhere raises SyncError on
every rank, naming the refusing rank(s) and their reasons.
"""
from __future__ import annotations

import operator
import time
from collections.abc import Mapping

import torch

from miles_k3.parallel.mesh import SINGLE, ParallelContext
from miles_k3.parallel.reduce import gather, ranks_where, world_of
from miles_k3.weight_sync.push import PushReport, SyncError, sync_devices


class LocalChannel:
    """Sender and receiver in one: `push(tensors, version)` into `engine`'s adapter `adapter`."""

    transport = "local"

    def __init__(self, engine, adapter: str, readback: bool = False, ctx: ParallelContext = SINGLE):
        self.engine, self.adapter, self.readback, self.ctx = engine, adapter, readback, ctx
        self.engine.adapters.buffers(adapter)  # an unknown adapter fails here, naming the loaded ones
        self._bytes_of: list[torch.Tensor] = []
        self._bytes = 0

    def push(self, tensors: Mapping[str, torch.Tensor], version: int) -> PushReport:
        """Copy `tensors` (the adapter's lora_parameters() names -> tensors) in place and serve them as
        `version` (> the engine's current version). Raises SyncError (nothing applied) on any mismatch; on many
        ranks on every rank when any rank's push does not pass (see the module docstring)."""
        if not tensors:
            raise SyncError("empty push: no tensors given (a push must carry the whole adapter)")
        devices = {next(iter(tensors.values())).device}
        sync_devices(devices)  # pending trainer work is not the push's time
        t0 = time.perf_counter()
        if self.ctx.distributed:
            self._check_everywhere(tensors, version)
        try:
            self.engine.update_weights_from_tensor(tensors, lora_name=self.adapter, weight_version=version)
        except ValueError as e:
            raise SyncError(f"push of version {version} refused: {e}",
                            next((n for n in tensors if n in str(e)), None)) from None
        sync_devices(devices)
        seconds = time.perf_counter() - t0
        readback = None
        if self.readback:
            readback = readback_matches(self.engine.adapters.buffers(self.adapter), tensors)
        return PushReport(version, self.transport, self._nbytes(tensors), seconds, len(tensors), readback)

    def _check_everywhere(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Phase one of a push across ranks: this rank's check, then every rank's verdict; raises SyncError on every
        rank unless every rank passed (nothing applied anywhere), naming the refusing ranks and their reasons."""
        try:
            self.engine.check_weights_from_tensor(tensors, lora_name=self.adapter, weight_version=version)
            error = None
        except ValueError as e:
            error = str(e)
        refusing = ranks_where(error is not None, world_of(self.ctx))
        if not refusing:
            return
        reasons = gather(error, world_of(self.ctx))
        why = "; ".join(f"rank {r}: {reasons[r]}" for r in refusing)
        raise SyncError(f"push of version {version} refused by rank{'s' * (len(refusing) > 1)} "
                        f"{', '.join(map(str, refusing))} of {self.ctx.world_size} ({why}); no rank applied it, "
                        f"every engine still serves version {self.engine.weight_version}",
                        next((n for n in tensors if error is not None and n in error), None))

    def _nbytes(self, tensors: Mapping[str, torch.Tensor]) -> int:
        """Bytes of the pushed tensors, cached for a push of the same tensor objects as last time."""
        vals = list(tensors.values())
        if len(vals) != len(self._bytes_of) or not all(map(operator.is_, vals, self._bytes_of)):
            self._bytes_of = vals  # held, so that no other tensor can take their ids
            self._bytes = sum(t.numel() * t.element_size() for t in vals)
        return self._bytes

    def close(self) -> None:
        """Nothing to release: a local channel holds no buffer and no connection."""


def readback_matches(buffers: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]) -> bool:
    """Debug readback: every byte of the engine's `buffers` equals `tensors` cast to the buffers' dtypes."""
    return all(torch.equal(buffers[n], t.to(buffers[n].dtype)) for n, t in tensors.items())
