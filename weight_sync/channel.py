"""The trainer's channel into a native engine in its own process, from the run's `sync:` config
(`WeightSyncConfig`):

    channel = open_sender(cfg.sync, engine=engine, adapter="policy", ctx=ctx)
    report = channel.push(trainer_lora_tensors, version=version + 1)    # PushReport, or SyncError (nothing applied)

A channel has `transport`, `push(tensors, version) -> PushReport` and `close()`; the SGLang backend's channels
(`miles_k3.weight_sync.sglang`) are built from `sglang:` instead.
"""
from __future__ import annotations

from miles_k3.parallel.mesh import SINGLE, ParallelContext
from miles_k3.weight_sync.config import WeightSyncConfig
from miles_k3.weight_sync.local import LocalChannel

DEFAULT_ADAPTER = "policy"


def open_sender(cfg: WeightSyncConfig, *, engine, adapter: str = DEFAULT_ADAPTER,
                ctx: ParallelContext | None = None) -> LocalChannel:
    """A `LocalChannel` pushing into `engine`'s adapter `adapter`. `ctx`: the run's ranks, each pushing into its
    own engine, one transaction across them all (None: one process)."""
    return LocalChannel(engine, adapter, readback=cfg.readback, ctx=SINGLE if ctx is None else ctx)
