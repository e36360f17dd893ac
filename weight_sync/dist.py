"""The `dist` transport: torch.distributed broadcasts (gloo on CPU, NCCL on GPU) from the trainer rank `src` to
rollout engines on the other ranks of a process group, for disaggregated placements.

Protocol (one transaction per push; every rank of the group but `src` is a receiver, `DistReceiver`):
  1. src broadcasts the header ("begin", version, manifest.to_wire(), chunk_bytes, num_chunks) as an object;
     every receiver opens the push (`Receiver.begin`: names, shapes, dtypes, version checked).
  2. Every rank all-gathers a status: ("ok", None) or ("error", message, tensor). If any receiver refused,
     every receiver drops the push and the sender raises SyncError with the first refusal (its rank, message
     and tensor). Nothing else is sent for that push.
  3. src packs the payload chunk by chunk into its bounded transfer buffer (`PayloadWriter`: per-tensor
     checksums of exactly the packed bytes) and broadcasts each chunk; receivers receive it straight into their
     staging buffer (`Receiver.chunk_view` + `mark_received`, no extra copy) or, when the backend cannot reach
     the engine's device, into a bounce buffer that is then copied in (`Receiver.write`).
  4. src broadcasts ("commit", version, checksums) (or ("abort", version, reason) when packing failed on its
     side); receivers verify and apply (`Receiver.commit`), and statuses are all-gathered again: the sender
     raises SyncError naming the first receiver that refused, or returns a PushReport.
A close is the single header ("close",): receivers stop serving. Every step is a collective, so a push blocks
until every receiver is in `serve_one` (a receiver busy elsewhere delays it, up to the group's timeout).
Headers and statuses travel pickled (`broadcast_object_list`): the group must be trusted.

All-or-nothing holds per receiver: a receiver that refuses applies nothing and keeps serving its previous
version. With several receivers, one may apply a push that another refuses at commit; the sender's error then
lists the ranks that applied it. Versions only move forward on every receiver.

Devices: the transfer buffer lives where the backend communicates: the current CUDA device for NCCL (call
`torch.cuda.set_device` on every rank first; object collectives use it too), CPU (pinned when CUDA is present)
for gloo. A receiver whose engine lives on a device the backend does not serve (a CUDA engine over gloo, a CPU
engine over NCCL) receives into a bounce buffer of one chunk on the backend's device and copies it into
staging.

Failures of the group itself (a killed peer: gloo raises "connection closed"; a peer that stops answering: the
collective times out after the `timeout` given to init_process_group, which must therefore exceed the longest
gap between pushes) leave the group unusable: the receiver aborts the open push (the engine keeps its version),
records the cause in `last_error` and sets `broken`; the sender raises SyncError and refuses later pushes. A new
process group (and new sender/receivers) is needed to continue.
"""
from __future__ import annotations

import time
from collections.abc import Mapping

import torch
import torch.distributed as dist

from miles_k3.weight_sync.protocol import (
    ALIGN,
    Manifest,
    PayloadWriter,
    PushReport,
    SyncError,
    clear_pack_cache,
    sync_devices,
)
from miles_k3.weight_sync.receiver import Receiver

DEFAULT_BUFFER_BYTES = 64 * 2**20


# ---- group helpers ---------------------------------------------------------------------------------------
def backend_device_types(group=None) -> set[str]:
    """The device types the group's backend communicates on: {"cpu"} for gloo, {"cuda"} for NCCL, both for a
    mixed backend such as "cpu:gloo,cuda:nccl"."""
    backend = str(dist.get_backend(group)).lower()
    kinds = set()
    for part in backend.split(","):
        if ":" in part:
            kinds.add(part.split(":", 1)[0].strip())
        elif "nccl" in part:
            kinds.add("cuda")
        else:
            kinds.add("cpu")
    return kinds


def comm_device(group=None) -> torch.device:
    """Where a transfer buffer should live for this group: the current CUDA device when the backend
    communicates on CUDA (NCCL), else CPU."""
    if "cuda" in backend_device_types(group) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _byte_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    pin = device.type == "cpu" and torch.cuda.is_available()  # faster host <-> device copies
    return torch.empty(nbytes, dtype=torch.uint8, device=device, pin_memory=pin)


def _chunks(total: int, chunk_bytes: int) -> list[tuple[int, int]]:
    return [(off, min(chunk_bytes, total - off)) for off in range(0, total, chunk_bytes)]


class _Peers:
    """The group's members and its object collectives, shared by sender and receivers."""

    def __init__(self, src: int, group):
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call init_process_group first")
        self.src, self.group = src, group
        self.ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        if src not in self.ranks:
            raise ValueError(f"src rank {src} is not a member of the group (ranks {self.ranks})")
        if len(self.ranks) < 2:
            raise ValueError("the group has no receiver: it needs at least one rank besides src")

    def bcast_object(self, obj=None):
        """src sends `obj`; every other rank gets it back."""
        box = [obj]
        dist.broadcast_object_list(box, src=self.src, group=self.group)
        return box[0]

    def bcast(self, t: torch.Tensor) -> None:
        dist.broadcast(t, src=self.src, group=self.group)

    def gather_status(self, status: tuple) -> list[tuple[int, tuple]]:
        """All-gather every rank's status: [(global rank, status)] in group order."""
        out = [None] * len(self.ranks)
        dist.all_gather_object(out, status, group=self.group)
        return list(zip(self.ranks, out))


def _errors(statuses: list[tuple[int, tuple]]) -> list[tuple[int, str, str | None]]:
    return [(rank, s[1], s[2]) for rank, s in statuses if s[0] != "ok"]


# ---- sender ------------------------------------------------------------------------------------------------
class DistSender:
    """The trainer side (rank `src`): `push(tensors, version)` broadcasts one transaction to every other rank
    of `group` (default: the world), each running a DistReceiver. `buffer_bytes` bounds the transfer buffer
    (rounded up to a multiple of ALIGN); `device` overrides where it lives (default: `comm_device(group)`);
    `checksum=False` skips the per-tensor checksums (the report's checksum_match is then None).

    PushReport: bytes = payload bytes sent (the manifest's total_bytes, alignment padding included); seconds =
    from the moment every receiver has opened the push (the begin exchange, which waits for receivers busy
    elsewhere) to the last commit status; checksum_match / readback_match = all receivers agree (None when the
    check was off)."""

    transport = "dist"

    def __init__(self, src: int, group=None, buffer_bytes: int = DEFAULT_BUFFER_BYTES,
                 device: torch.device | str | None = None, checksum: bool = True):
        self.peers = _Peers(src, group)
        if dist.get_rank() != src:
            raise ValueError(f"DistSender must run on the src rank {src}, not rank {dist.get_rank()}")
        self.device = torch.device(device) if device is not None else comm_device(group)
        if self.device.type not in backend_device_types(group):
            raise ValueError(f"transfer buffer on {self.device}: backend {dist.get_backend(group)} communicates "
                             f"on {sorted(backend_device_types(group))}")
        size = max(ALIGN, (buffer_bytes + ALIGN - 1) // ALIGN * ALIGN)
        self.buffer = _byte_buffer(size, self.device)
        self.checksum = checksum
        self.closed = False
        self.broken: str | None = None  # why the group became unusable
        self._t0 = 0.0  # when the current push's transfer started

    def push(self, tensors: Mapping[str, torch.Tensor], version: int) -> PushReport:
        """Send `tensors` (the adapter's lora_parameters() names -> tensors, any device) to every receiver as
        `version`. Raises SyncError naming the refusing rank (and tensor, when there is one) if any receiver
        refused; that receiver applied nothing and still serves its previous version."""
        self._check_usable()
        writer = PayloadWriter(tensors, self.checksum)  # an empty or malformed push fails here, before any send
        chunks = _chunks(writer.manifest.total_bytes, self.buffer.numel())
        try:
            statuses = self._transact(writer, chunks, version)
        except SyncError:
            raise
        except RuntimeError as e:  # torch.distributed failures: a receiver died or timed out
            self.broken = f"{type(e).__name__}: {e}"
            raise SyncError(f"dist push of version {version} failed: the process group broke ({self.broken}); "
                            f"receivers may not have applied it; a new group is needed") from e
        sync_devices({self.device})
        seconds = time.perf_counter() - self._t0
        results = [s[1] for rank, s in statuses if rank != self.peers.src]
        return PushReport(version, self.transport, writer.manifest.total_bytes, seconds,
                          len(writer.manifest.specs), len(chunks), _all_of(r["checksum_match"] for r in results),
                          _all_of(r["readback_match"] for r in results))

    def close(self) -> None:
        """Tell every receiver to stop serving (idempotent; does not destroy the process group)."""
        if not self.closed and self.broken is None:
            self.peers.bcast_object(("close",))
        self.closed = True
        clear_pack_cache()

    # ---- steps -------------------------------------------------------------------------------------------
    def _transact(self, writer: PayloadWriter, chunks: list[tuple[int, int]], version: int) -> list:
        m = writer.manifest
        self.peers.bcast_object(("begin", version, m.to_wire(), self.buffer.numel(), len(chunks)))
        self._raise_refusal(self.peers.gather_status(("ok", None)), version, "at begin")
        self._t0 = time.perf_counter()  # every receiver is ready: the report times the transfer, not the wait
        failure = self._stream(writer, chunks)
        checksums = None
        if failure is None:
            try:
                checksums = writer.checksums()
            except Exception as e:  # noqa: BLE001 - reported to the receivers, then raised
                failure = f"computing the checksums failed: {type(e).__name__}: {e}"
        if failure is not None:
            self.peers.bcast_object(("abort", version, failure))
            raise SyncError(f"dist push of version {version} aborted on the sender (nothing applied): {failure}")
        self.peers.bcast_object(("commit", version, checksums))
        statuses = self.peers.gather_status(("ok", None))
        self._raise_refusal(statuses, version, "at commit")
        return statuses

    def _stream(self, writer: PayloadWriter, chunks: list[tuple[int, int]]) -> str | None:
        """Pack and broadcast every chunk. A packing failure is returned (not raised) after the remaining
        chunks were still broadcast, so that the receivers stay in step and the group stays usable."""
        packed, failure = writer.chunks(self.buffer), None
        for offset, nbytes in chunks:
            if failure is None:
                try:
                    got = next(packed)
                    assert got == (offset, nbytes), f"chunk {got} != {(offset, nbytes)}"
                except Exception as e:  # noqa: BLE001 - reported to the receivers, then raised by push
                    failure = f"packing payload bytes [{offset}, {offset + nbytes}) failed: {type(e).__name__}: {e}"
            self._send_chunk(self.buffer[:nbytes], offset)
        return failure

    def _send_chunk(self, chunk_u8: torch.Tensor, offset: int) -> None:
        """Broadcast one packed chunk (payload bytes [offset, offset + len(chunk_u8)))."""
        self.peers.bcast(chunk_u8)

    def _raise_refusal(self, statuses: list, version: int, stage: str) -> None:
        errors = _errors(statuses)
        if not errors:
            return
        rank, message, tensor = errors[0]
        applied = [r for r, s in statuses if r != self.peers.src and s[0] == "ok"] if stage == "at commit" else []
        more = f" ({len(errors)} receivers refused)" if len(errors) > 1 else ""
        note = f"; applied on ranks {applied}" if applied else ""
        raise SyncError(f"dist push of version {version} refused by rank {rank} {stage}{more}, which still serves "
                        f"its previous version: {message}{note}", tensor)

    def _check_usable(self) -> None:
        if self.closed:
            raise SyncError("dist sender is closed: the receivers stopped serving")
        if self.broken is not None:
            raise SyncError(f"dist sender unusable: the process group broke ({self.broken}); create a new group")


def _all_of(values) -> bool | None:
    """None when any receiver reported None (the check was off), else whether all are True."""
    values = list(values)
    return None if any(v is None for v in values) else all(values)


# ---- receiver ----------------------------------------------------------------------------------------------
class DistReceiver:
    """The engine side (any rank of `group` but `src`): serves pushes from `src` into adapter `adapter` of
    `engine` through a `Receiver` (staging on the engine's device; `readback=True` verifies every byte after
    apply). `serve_one` / `serve_forever` may run in a thread beside the engine's generate (an apply takes the
    engine's lock between scheduler steps). `last_error` holds the cause of the last refused or failed push."""

    def __init__(self, engine, adapter: str, src: int, group=None, readback: bool = False):
        self.peers = _Peers(src, group)
        if dist.get_rank() == src:
            raise ValueError(f"DistReceiver cannot run on the src rank {src}")
        self.receiver = Receiver(engine, adapter, readback)
        kinds = backend_device_types(group)
        self.direct = self.receiver.device.type in kinds  # broadcast straight into staging
        self.comm_device = self.receiver.device if self.direct else comm_device(group)
        self._bounce: torch.Tensor | None = None
        self.closed = False
        self.broken = False

    @property
    def last_error(self) -> str | None:
        return self.receiver.last_error

    def serve_one(self) -> dict | None:
        """Handle exactly one message from src: a push (returns the commit result dict, or None when the push was
        refused or failed: see `last_error`) or a close (returns None, sets `closed`). Raises nothing: a broken
        group aborts the open push, is recorded in `last_error` and sets `broken`."""
        if self.closed or self.broken:
            return None
        version = None
        try:
            msg = self.peers.bcast_object()
            if msg[0] == "close":
                self.closed = True
                return None
            version = msg[1]
            return self._serve_push(msg)
        except Exception as e:  # noqa: BLE001 - the group itself failed (peer killed, timeout, bad message)
            self._on_broken(version, e)
            return None

    def serve_forever(self) -> int:
        """Serve pushes until src closes or the group breaks; returns the number of pushes applied."""
        applied = 0
        while not (self.closed or self.broken):
            applied += self.serve_one() is not None
        return applied

    # ---- steps -------------------------------------------------------------------------------------------
    def _serve_push(self, msg: tuple) -> dict | None:
        kind, version, wire, chunk_bytes, num_chunks = msg
        if kind != "begin":
            raise RuntimeError(f"protocol error: expected a begin or close header, got {kind!r}")
        opened = self._attempt(self._begin, version, wire, chunk_bytes, num_chunks)
        errors = _errors(self.peers.gather_status(("ok", None) if opened[0] == "ok" else opened))
        if errors:
            if opened[0] == "ok":
                rank, message, _ = errors[0]
                self.receiver.abort(f"push of version {version} refused by rank {rank}: {message}")
            return None
        status = self._receive(opened[1])
        end = self.peers.bcast_object()
        if end[0] == "abort":
            if status[0] == "ok":
                self.receiver.abort(f"push of version {version} aborted by the sender: {end[2]}")
            return None
        if end[0] != "commit" or end[1] != version:
            raise RuntimeError(f"protocol error: expected the commit of version {version}, got {end[:2]!r}")
        if status[0] == "ok":
            status = self._attempt(self._commit, version, end[2])
        self.peers.gather_status(status)
        return status[1] if status[0] == "ok" else None

    def _begin(self, version: int, wire: list, chunk_bytes: int, num_chunks: int) -> tuple:
        """Open the push; ("ok", its chunks [(offset, nbytes)])."""
        manifest = Manifest.from_wire(wire)
        chunks = _chunks(manifest.total_bytes, chunk_bytes)
        if len(chunks) != num_chunks:
            raise SyncError(f"header says {num_chunks} chunks, the manifest and chunk size give {len(chunks)}")
        self.receiver.begin(version, manifest)
        return ("ok", chunks)

    def _receive(self, chunks: list[tuple[int, int]]) -> tuple:
        """Receive every chunk (always all of them, to stay in step with src); the first failure to stage one
        is returned as an error status (the push is then already aborted)."""
        status = ("ok", None)
        for offset, nbytes in chunks:
            target = None
            if status[0] == "ok" and self.direct:
                status = self._attempt(self._view, offset, nbytes)
                target = status[1] if status[0] == "ok" else None
            if target is None:
                target = self._bounce_buffer(nbytes)
            self.peers.bcast(target)
            if status[0] == "ok":
                status = self._attempt(self._stage, offset, target)
        return status

    def _view(self, offset: int, nbytes: int) -> tuple:
        return ("ok", self.receiver.chunk_view(offset, nbytes))

    def _commit(self, version: int, checksums: list[int] | None) -> tuple:
        return ("ok", self.receiver.commit(version, checksums))

    def _stage(self, offset: int, received: torch.Tensor) -> tuple:
        if self.direct:
            self.receiver.mark_received(offset, received.numel())
        else:
            self.receiver.write(offset, received)
        return ("ok", None)

    def _bounce_buffer(self, nbytes: int) -> torch.Tensor:
        if self._bounce is None or self._bounce.numel() < nbytes:
            self._bounce = None
            self._bounce = _byte_buffer(nbytes, self.comm_device)
        return self._bounce[:nbytes]

    def _attempt(self, step, *args) -> tuple:
        """Run a local step of the push; its failure becomes an error status (the push aborted, nothing
        applied) instead of an exception, so that this rank keeps following the protocol."""
        try:
            return step(*args)
        except SyncError as e:
            if self.receiver.open_version is not None:
                self.receiver.abort(str(e))
            self.receiver.last_error = str(e)
            return ("error", str(e), e.tensor)
        except Exception as e:  # noqa: BLE001 - e.g. the engine ran out of memory applying the push
            message = f"{type(e).__name__}: {e}"
            self.receiver.abort(message)
            return ("error", message, None)

    def _on_broken(self, version: int | None, e: Exception) -> None:
        src = self.peers.src
        cause = f"{type(e).__name__}: {e}"
        if version is not None:
            reason = f"sender (rank {src}) failed mid-push of version {version}: {cause}"
        else:
            reason = f"the process group broke while waiting for a push from rank {src}: {cause}"
        self.receiver.abort(reason + " (the previous version keeps serving; a new process group is needed)")
        self.broken = True
