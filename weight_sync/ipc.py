"""The `ipc` transport: trainer and engine in two processes of one host. Bytes travel through ONE persistent
transfer buffer owned by the sender (POSIX shared memory on CPU, a CUDA IPC allocation on GPU); a
`multiprocessing.connection` socket (AF_UNIX, authenticated with `authkey`) carries only small control messages.

Protocol (sender -> receiver, every message answered exactly once, so the two sides never lose step):
  ("hello", info)                 -> ("ok", {"engine_version", "device"})  once per connection: announces the buffer
  ("begin", version, manifest)    -> ("ok",)                              Receiver.begin checks names/shapes/version
  ("chunk", offset, nbytes)       -> ("ack",)                             Receiver.write(offset, buffer[:nbytes])
  ("commit", version, checksums)  -> ("ok", result)                       verify, apply in place, set weight_version
  ("abort", reason)               -> ("ok",)                              the sender gave up mid-push
  ("bye",)                        -> ("ok",)                              the receiver drops its buffer mapping
Any request may instead be answered ("error", message, tensor): the push is refused (nothing applied, the engine
keeps serving its previous version) and the sender raises SyncError(message, tensor).

Buffer lifetime: the sender creates the buffer once (first push) and announces it once per connection (the
receiver maps it once and keeps it until "bye" or a disconnect); every chunk is packed into buffer[:nbytes] and
reused only after the receiver's "ack" (the receiver has copied it into its staging buffer, device work
synchronized), so one bounded buffer carries pushes of any size. The buffer is never re-exported per push: a fresh
export per push races the consumer's release of the previous one (the producer may free or reuse memory the
consumer still maps) and costs an IPC open per push. On CUDA the buffer is a plain caching-allocator tensor
(cudaMalloc storage, exportable with cudaIpcGetMemHandle): memory from VMM/cuMem pools (e.g. expandable segments)
is not exportable through legacy CUDA IPC, so keep such allocator settings off for this buffer. Only the owner
(sender) unlinks the shared memory, in `close()` (also run at garbage collection and interpreter exit); the
receiver maps it without registering it with its resource tracker (which would unlink it when the engine exits).
The receiver serves one sender at a time. Anyone holding `authkey` can make the engine unpickle messages (and the
socket file's permissions admit only its owner's user): keep the key secret, never log it.
"""
from __future__ import annotations

import contextlib
import logging
import mmap
import os
import re
import secrets
import socket
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing import AuthenticationError, resource_tracker, shared_memory
from multiprocessing.connection import Connection, Listener, answer_challenge, deliver_challenge
from typing import TYPE_CHECKING

import torch

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

if TYPE_CHECKING:
    from typing_extensions import Self

log = logging.getLogger("miles_k3.weight_sync")

DEFAULT_BUFFER_BYTES = 64 * 2**20
_SLICE_S = 0.2  # the server's polling granularity (how fast stop() is noticed)
_SHM_NAME = re.compile(r"/?[A-Za-z0-9_.-]{1,200}")


# ---- the sender (trainer process) ------------------------------------------------------------------------------
@dataclass
class _Resources:
    """What an IPCSender owns, kept apart from it so that weakref.finalize can release it without a reference
    cycle: the connection, the shared memory segment (CPU) and the transfer buffer tensor."""

    conn: Connection | None = None
    shm: shared_memory.SharedMemory | None = None
    buffer: torch.Tensor | None = None


def _release(res: _Resources) -> None:
    """Say bye, close the connection, drop the buffer, close and unlink the shared memory. Never raises."""
    _drop_connection(res, say_bye=True)
    clear_pack_cache()  # its views of the buffer would keep the shared memory mapped
    res.buffer = None  # the frombuffer view holds an export of shm.buf: drop it before shm.close()
    shm, res.shm = res.shm, None
    if shm is not None:
        with contextlib.suppress(BufferError):  # a view of the buffer is still alive: unmapped when it goes
            shm.close()
        with contextlib.suppress(FileNotFoundError):
            shm.unlink()


def _drop_connection(res: _Resources, say_bye: bool = False) -> None:
    conn, res.conn = res.conn, None
    if conn is None:
        return
    with contextlib.suppress(OSError, EOFError):
        if say_bye:  # lets the receiver unmap the buffer now; best effort
            conn.send(("bye",))
            if conn.poll(1.0):
                conn.recv()
    conn.close()


class IPCSender:
    """Pushes adapter tensors to an `IPCReceiverServer` on this host. `buffer_bytes` (a positive multiple of
    protocol.ALIGN) bounds the transfer buffer, on `device` ("cpu": shared memory, "cuda[:i]": CUDA IPC).
    `timeout_s` bounds every wait for an answer (and the first connection). Not thread-safe: one push at a time."""

    transport = "ipc"

    def __init__(self, address: str, authkey: bytes, buffer_bytes: int = DEFAULT_BUFFER_BYTES,
                 device: str | torch.device = "cpu", checksum: bool = True, timeout_s: float = 60.0):
        if not isinstance(buffer_bytes, int) or buffer_bytes <= 0 or buffer_bytes % ALIGN:
            raise ValueError(f"buffer_bytes: {buffer_bytes!r} is not a positive multiple of {ALIGN} (ALIGN)")
        if not isinstance(authkey, bytes) or not authkey:
            raise ValueError("authkey: a non-empty bytes key is required (the channel unpickles messages)")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"device: {self.device} is neither cpu nor cuda")
        self.address, self._authkey = address, authkey
        self.buffer_bytes, self.checksum, self.timeout_s = buffer_bytes, checksum, timeout_s
        self.exports = 0  # times the transfer buffer was announced: once per connection, never per push
        self._res = _Resources()
        self._finalizer = weakref.finalize(self, _release, self._res)  # runs on close(), GC or interpreter exit

    @property
    def buffer(self) -> torch.Tensor | None:
        """The transfer buffer, uint8 [buffer_bytes] on `device` (None before the first push and after close)."""
        return self._res.buffer

    @property
    def buffer_name(self) -> str | None:
        """The shared memory segment's name (CPU buffer; None before the first push or on CUDA)."""
        return None if self._res.shm is None else self._res.shm.name

    def push(self, tensors: Mapping[str, torch.Tensor], version: int) -> PushReport:
        """One transaction: begin(version) -> chunks through the transfer buffer -> commit(version, checksums).
        Raises SyncError (naming the tensor when there is one) when the receiver refuses or does not answer;
        the engine then still serves its previous version."""
        if not self._finalizer.alive:
            raise SyncError("ipc sender is closed")
        writer = PayloadWriter(tensors, self.checksum)
        self._connect()
        sync_devices({t.device for t in writer.tensors.values()} | {self.device})  # pending trainer work: not timed
        t0 = time.perf_counter()
        self._request(("begin", version, writer.manifest.to_wire()), "ok", f"begin of version {version}")
        chunks = 0
        try:
            for offset, nbytes in writer.chunks(self._res.buffer):
                sync_devices({self.device})  # the chunk is packed (cross-device copies too) before it is read
                self._request(("chunk", offset, nbytes), "ack", f"chunk {chunks} of version {version}")
                chunks += 1
            checksums = writer.checksums()
        except SyncError:
            raise
        except Exception as e:  # packing failed on our side: tell the receiver, which drops the push
            self._abort(f"sender failed mid-push of version {version}: {type(e).__name__}: {e}")
            raise
        reply = self._request(("commit", version, checksums), "ok", f"commit of version {version}")
        seconds = time.perf_counter() - t0
        result = reply[1]
        return PushReport(version, self.transport, writer.manifest.total_bytes, seconds,
                          len(writer.manifest.specs), chunks, result.get("checksum_match"),
                          result.get("readback_match"))

    def close(self) -> None:
        """Release the connection and the buffer (unlinks the shared memory). Idempotent."""
        self._finalizer()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals ---------------------------------------------------------------------------------------
    def _connect(self) -> None:
        """Connect (retrying until timeout_s while the engine's socket does not exist yet) and say hello."""
        if self._res.conn is not None:
            return
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                self._res.conn = _open_connection(self.address, self._authkey, self.timeout_s)
                break
            except (FileNotFoundError, ConnectionRefusedError, BlockingIOError, TimeoutError) as e:
                if time.monotonic() > deadline:  # no socket yet, or a full queue (one sender at a time)
                    what = "accepted (busy with another sender?)" if isinstance(e, BlockingIOError) else "found"
                    raise SyncError(f"no ipc receiver at {self.address!r} {what} within {self.timeout_s}s: "
                                    f"{type(e).__name__}: {e}") from None
                time.sleep(0.05)
            except AuthenticationError:
                raise SyncError(f"the ipc receiver at {self.address!r} refused our authkey") from None
        try:
            self._request(("hello", self._announce()), "ok", "hello")
        except BaseException:
            _drop_connection(self._res)  # the receiver holds no buffer for this connection: start over next time
            raise

    def _announce(self) -> dict:
        """The transfer buffer (created on the first call) described for a new connection: the shared memory's
        name, or a CUDA IPC export (rebuild_fn, args). A CUDA export carries one reference that the receiver's
        rebuild takes and its unmap releases, so an export serves exactly one connection, never replayed."""
        n, res = self.buffer_bytes, self._res
        if res.buffer is None and self.device.type == "cpu":
            res.shm = shared_memory.SharedMemory(create=True, size=n)
            res.buffer = torch.frombuffer(res.shm.buf, dtype=torch.uint8, count=n)
        elif res.buffer is None:
            res.buffer = torch.empty(n, dtype=torch.uint8, device=self.device)  # caching allocator (cudaMalloc)
        if self.device.type == "cpu":
            info = {"kind": "shm", "name": res.shm.name, "size": n}
        else:
            from torch.multiprocessing.reductions import reduce_tensor
            try:
                info = {"kind": "cuda", "rebuild": reduce_tensor(res.buffer), "size": n}
            except RuntimeError as e:
                raise SyncError(f"cannot export the CUDA transfer buffer through CUDA IPC ({e}); it needs "
                                f"caching-allocator (cudaMalloc) storage, not expandable segments/VMM") from None
        self.exports += 1
        return info

    def _request(self, msg: tuple, expect: str, what: str) -> tuple:
        """Send `msg`, wait (timeout_s) for its one answer; SyncError on an error answer, a timeout or a lost
        connection (the last two drop the connection: the next push reconnects and says hello again)."""
        conn = self._res.conn
        try:
            conn.send(msg)
            answered = conn.poll(self.timeout_s)
            reply = conn.recv() if answered else None
        except (OSError, EOFError) as e:
            _drop_connection(self._res)
            raise SyncError(f"lost the ipc receiver during {what}: {type(e).__name__}: {e}") from None
        except BaseException:  # e.g. KeyboardInterrupt: an answer may be in flight, so the stream is out of step
            _drop_connection(self._res)
            raise
        if not answered:
            _drop_connection(self._res)
            maybe = "; it may still apply this push: check the engine's weight_version" if msg[0] == "commit" else ""
            raise SyncError(f"receiver did not answer within {self.timeout_s}s ({what}){maybe}")
        if reply[0] == "error":
            raise SyncError(reply[1], reply[2])
        if reply[0] != expect:
            _drop_connection(self._res)
            raise SyncError(f"protocol error during {what}: expected {expect!r}, got {reply[0]!r}")
        return reply

    def _abort(self, reason: str) -> None:
        with contextlib.suppress(SyncError):
            self._request(("abort", reason), "ok", "abort")


def _open_connection(address: str, authkey: bytes, timeout_s: float) -> Connection:
    """`Client(address, "AF_UNIX", authkey)` with its waits bounded by timeout_s: the receiver serves one sender
    at a time, so a second sender would otherwise wait in the handshake until the first one leaves."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout_s)  # a full accept queue: BlockingIOError instead of blocking
        sock.connect(address)
        sock.settimeout(None)
        conn = Connection(sock.detach())
    finally:
        sock.close()
    try:
        if not conn.poll(timeout_s):
            raise SyncError(f"the ipc receiver at {address!r} did not start the handshake within {timeout_s}s: "
                            f"it serves one sender at a time, is another one connected?")
        answer_challenge(conn, authkey)
        deliver_challenge(conn, authkey)
    except BaseException:
        conn.close()
        raise
    return conn


# ---- the receiver (engine process) -----------------------------------------------------------------------------
class _Attached:
    """The receiver's mapping of the sender's transfer buffer: `buffer` uint8 [size]; close() unmaps it."""

    def __init__(self, info: dict):
        self._mapping = None
        size = int(info["size"])
        if info.get("kind") == "shm":
            self.buffer = torch.frombuffer(self._map_shm(str(info["name"]), size), dtype=torch.uint8, count=size)
        elif info.get("kind") == "cuda":
            rebuild_fn, args = info["rebuild"]
            self.buffer = rebuild_fn(*args)
            if self.buffer.dtype != torch.uint8 or self.buffer.numel() != size:
                raise SyncError(f"CUDA transfer buffer: got {self.buffer.dtype} x {self.buffer.numel()}, "
                                f"announced uint8 x {size}")
        else:
            raise SyncError(f"unknown transfer buffer kind {info.get('kind')!r}")

    def _map_shm(self, name: str, size: int):
        """Map the sender's shared memory without leaving it registered with a resource tracker (which would
        unlink it when this process exits). Python < 3.13 registers every attach (bpo-38119); unregistering
        afterwards is wrong when both processes share one tracker (one spawned by the other: the sender's own
        registration would go), so on Linux the segment is mapped straight from /dev/shm; unregistering is
        the last resort elsewhere."""
        if not _SHM_NAME.fullmatch(name) or name.strip("/") in (".", ".."):
            raise SyncError(f"bad shared memory name {name!r}")
        dev_shm = os.path.join("/dev/shm", name.lstrip("/"))
        if sys.version_info < (3, 13) and os.path.exists(dev_shm):
            fd = os.open(dev_shm, os.O_RDWR)
            try:
                have = os.fstat(fd).st_size
                self._mapping = mmap.mmap(fd, size) if have >= size else None
            finally:
                os.close(fd)
            buf = self._mapping
        else:
            track = {"track": False} if sys.version_info >= (3, 13) else {}
            self._mapping = shared_memory.SharedMemory(name=name, **track)
            if not track:
                resource_tracker.unregister(self._mapping._name, "shared_memory")
            have, buf = self._mapping.size, self._mapping.buf
        if have < size:
            raise SyncError(f"shared memory {name!r} holds {have} bytes, announced {size}")
        return buf

    def close(self) -> None:
        self.buffer = None  # the frombuffer view exports the mapping: drop it first
        mapping, self._mapping = self._mapping, None
        if mapping is not None:
            with contextlib.suppress(BufferError):  # a view is still alive somewhere: unmapped when it goes
                mapping.close()


class IPCReceiverServer:
    """Serves pushes into `engine`'s adapter `adapter` from a daemon thread: listens on the AF_UNIX `address`,
    serves one sender connection at a time and accepts the next once it disconnects. A sender silent for more
    than `timeout_s` mid-push, or one that disconnects mid-push, aborts that push (the engine keeps serving its
    previous version; `last_error` says why). `buffer_imports` counts transfer-buffer mappings made."""

    def __init__(self, engine, adapter: str, address: str, authkey: bytes, readback: bool = False,
                 timeout_s: float = 60.0):
        if not isinstance(authkey, bytes) or not authkey:
            raise ValueError("authkey: a non-empty bytes key is required (the channel unpickles messages)")
        self.receiver = Receiver(engine, adapter, readback=readback)
        self.address, self._authkey, self.timeout_s = address, authkey, timeout_s
        self.buffer_imports = 0
        self.connections = 0
        self._listener: Listener | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def last_error(self) -> str | None:
        """Why the last push was refused or aborted (None if none was)."""
        return self.receiver.last_error

    def start(self) -> IPCReceiverServer:
        """Bind the socket (now: a sender may connect as soon as this returns) and serve in a daemon thread."""
        self._listener = Listener(self.address, family="AF_UNIX", authkey=self._authkey)
        self._thread = threading.Thread(target=self._serve_forever, name="weight-sync-ipc", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop serving (an open push is aborted) and remove the socket. Idempotent."""
        if self._thread is None:
            return
        self._stop.set()
        with contextlib.suppress(OSError, EOFError, AuthenticationError, SyncError):  # wake a blocked accept()
            _open_connection(self.address, self._authkey, timeout_s=1.0).close()  # (refused once it closed)
        self._thread.join(timeout_s)
        self._thread = None

    # ---- the serving thread ------------------------------------------------------------------------------
    def _serve_forever(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    conn = self._listener.accept()
                except (OSError, EOFError, AuthenticationError) as e:  # a stranger, or a broken handshake
                    if not self._stop.is_set():
                        log.warning("weight sync: refused an ipc connection: %s", type(e).__name__)
                        self._stop.wait(0.05)  # no busy loop on a persistent accept error
                    continue
                if self._stop.is_set():
                    conn.close()
                    break
                self.connections += 1
                self._serve(conn)
        finally:
            self._listener.close()

    def _serve(self, conn: Connection) -> None:
        """Answer one sender's messages until it says bye, disconnects, or the server stops."""
        attached: list[_Attached] = []  # at most one; a list so that _handle can set it
        try:
            while not self._stop.is_set():
                if not self._wait(conn):
                    continue
                msg = conn.recv()
                reply = self._handle(msg, attached)
                conn.send(reply)
                if msg[0] == "bye":
                    break
        except (OSError, EOFError) as e:
            v = self.receiver.open_version
            if v is not None:
                detail = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                self.receiver.abort(f"sender disconnected mid-push of version {v}: {detail}")
        finally:
            if self.receiver.open_version is not None:
                self.receiver.abort("ipc server stopped mid-push")
            for a in attached:
                a.close()
            conn.close()

    def _wait(self, conn: Connection) -> bool:
        """Wait for the next message: without limit between pushes, at most timeout_s while a push is open
        (then the push is aborted). Returns True when a message is there, False on stop or abort."""
        start = time.monotonic()
        while not self._stop.is_set():
            if conn.poll(_SLICE_S):
                return True
            v = self.receiver.open_version
            if v is not None and time.monotonic() - start > self.timeout_s:
                self.receiver.abort(f"sender silent for more than {self.timeout_s}s mid-push of version {v}")
                return False
        return False

    def _handle(self, msg: tuple, attached: list[_Attached]) -> tuple:
        """One request -> its one answer; every failure becomes ("error", message, tensor)."""
        kind = msg[0] if isinstance(msg, tuple) and msg else None
        try:
            if kind == "hello":
                for a in attached:
                    a.close()
                attached[:] = [_Attached(msg[1])]
                self.buffer_imports += 1
                return ("ok", {"engine_version": self.receiver.engine.weight_version,
                               "device": str(self.receiver.device)})
            if kind == "begin":
                self.receiver.begin(int(msg[1]), Manifest.from_wire(msg[2]))
                return ("ok",)
            if kind in ("chunk", "commit") and self.receiver.open_version is None:
                return ("error", f"no push is open (last error: {self.receiver.last_error})", None)
            if kind == "chunk":
                return self._chunk(int(msg[1]), int(msg[2]), attached)
            if kind == "commit":
                return ("ok", self.receiver.commit(int(msg[1]), msg[2]))
            if kind in ("abort", "bye"):
                if self.receiver.open_version is not None:
                    self.receiver.abort(str(msg[1]) if kind == "abort" else "sender said bye mid-push")
                if kind == "bye":  # unmap before answering: the sender frees the buffer once answered
                    for a in attached:
                        a.close()
                    attached.clear()
                return ("ok",)
            return ("error", f"unknown ipc message {kind!r}", None)
        except SyncError as e:
            if kind == "hello" or self.receiver.open_version is not None:  # not raised (and recorded) by Receiver
                self.receiver.abort(str(e))
            return ("error", str(e), e.tensor)
        except Exception as e:  # noqa: BLE001 - any failure refuses the push, the server keeps serving
            message = f"{kind} failed: {type(e).__name__}: {e}"
            self.receiver.abort(message)
            return ("error", message, None)

    def _chunk(self, offset: int, nbytes: int, attached: list[_Attached]) -> tuple:
        if not attached:
            raise SyncError("chunk before hello: no transfer buffer announced")
        a = attached[0]
        if not 0 < nbytes <= a.buffer.numel():
            raise SyncError(f"chunk of {nbytes} bytes does not fit the {a.buffer.numel()}-byte transfer buffer")
        self.receiver.write(offset, a.buffer[:nbytes])
        sync_devices({a.buffer.device, self.receiver.device})  # copied before the sender reuses the buffer
        return ("ack",)


def socket_address(name: str = "policy") -> str:
    """A fresh AF_UNIX socket path under the temp directory (short: AF_UNIX paths are limited to ~107 bytes)."""
    return os.path.join(tempfile.gettempdir(), f"mk3-sync-{name}-{os.getpid()}-{secrets.token_hex(4)}.sock")
