"""One entry point per side of the channel, chosen by `sync.transport` (`WeightSyncConfig`):

    sender = open_sender(cfg.sync, engine=engine)                       # local: the engine is in this process
    sender = open_sender(cfg.sync, address=addr, authkey=key)           # ipc: the engine serves `addr`
    sender = open_sender(cfg.sync, src=0)                               # dist: on the trainer rank
    report = sender.push(trainer_lora_tensors, version=version + 1)     # PushReport, or SyncError (nothing applied)

    server = open_receiver(cfg.sync, engine, address=addr, authkey=key)  # ipc, in the engine's process (serving)
    server = open_receiver(cfg.sync, engine, src=0)                      # dist: call server.serve_forever()

Every sender has `transport`, `push(tensors, version) -> PushReport` and `close()`. The imports of the ipc and dist
transports are lazy (torch.distributed and multiprocessing are only loaded by the transport that uses them).
"""
from __future__ import annotations

from miles_k3.weight_sync.config import WeightSyncConfig

DEFAULT_ADAPTER = "policy"


def open_sender(cfg: WeightSyncConfig, *, engine=None, adapter: str = DEFAULT_ADAPTER, address: str | None = None,
                authkey: bytes | None = None, src: int = 0, group=None, device=None, ctx=None):
    """The trainer's side of the `cfg.transport` channel (config validated first). `ctx` (local transport, a
    ParallelContext): the run's ranks, each pushing into its own engine, one transaction across them all."""
    cfg.validate()
    if cfg.transport == "local":
        if engine is None:
            raise ValueError("sync.transport=local pushes into an engine in this process: pass engine=")
        from miles_k3.parallel.mesh import SINGLE
        from miles_k3.weight_sync.local import LocalChannel
        return LocalChannel(engine, adapter, readback=cfg.readback, ctx=SINGLE if ctx is None else ctx)
    if cfg.transport == "ipc":
        if not address or not authkey:
            raise ValueError("sync.transport=ipc needs the engine process's address= and the shared authkey=")
        from miles_k3.weight_sync.ipc import IPCSender
        return IPCSender(address, authkey, buffer_bytes=cfg.buffer_bytes, device=device or "cpu",
                         checksum=cfg.checksum, timeout_s=cfg.timeout_s)
    from miles_k3.weight_sync.dist import DistSender
    return DistSender(src, group, buffer_bytes=cfg.buffer_bytes, device=device, checksum=cfg.checksum)


def open_receiver(cfg: WeightSyncConfig, engine, *, adapter: str = DEFAULT_ADAPTER, address: str | None = None,
                  authkey: bytes | None = None, src: int = 0, group=None):
    """The engine's side: a started IPCReceiverServer (ipc) or a DistReceiver (dist; run its serve_forever).
    A local channel has no receiver: the sender writes into the engine directly."""
    cfg.validate()
    if cfg.transport == "local":
        raise ValueError("sync.transport=local has no receiver side: open_sender(cfg, engine=engine)")
    if cfg.transport == "ipc":
        if not address or not authkey:
            raise ValueError("sync.transport=ipc needs the address= to serve and the shared authkey=")
        from miles_k3.weight_sync.ipc import IPCReceiverServer
        return IPCReceiverServer(engine, adapter, address, authkey, readback=cfg.readback,
                                 timeout_s=cfg.timeout_s).start()
    from miles_k3.weight_sync.dist import DistReceiver
    return DistReceiver(engine, adapter, src, group, readback=cfg.readback)
