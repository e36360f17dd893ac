"""The `ipc` weight-sync transport between real processes (spawned): the engine (k3_tiny, CPU) serves pushes in a
child process; the trainer pushes from the test process (or from a child that gets SIGKILLed mid-push). A good push
makes the engine generate exactly what the trainer's model generates; every refused or broken push leaves the
previous version serving (same weight_version, same adapter bytes, same outputs) and names the cause."""
import hashlib
import math
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from multiprocessing import shared_memory
from multiprocessing.connection import Listener

import pytest
import sync_helpers as sh
import torch
from kernel_testing import gpu_test

from miles_k3.weight_sync.ipc import IPCReceiverServer, IPCSender, socket_address
from miles_k3.weight_sync.local import LocalChannel
from miles_k3.weight_sync.protocol import ALIGN, Manifest, PayloadWriter, SyncError

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
AUTHKEY = b"weight-sync-ipc-test-key"
BUFFER = 256 * 1024  # < the adapter's 852480 bytes: a push takes 4 chunks
SERVER_TIMEOUT_S = 2.0  # the engine aborts a push whose sender is silent this long
_SPAWN = mp.get_context("spawn")


# ---- child processes (module level: spawn pickles them by name) ---------------------------------------------
def _child_setup() -> None:
    if TESTS_DIR not in sys.path:
        sys.path.insert(0, TESTS_DIR)
    torch.set_num_threads(1)  # 2 cores shared by 2+ processes


def _digest(tensors: dict) -> str:
    """sha256 over the tensors' names and bytes, in name order (equal digests: byte-identical adapters)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _engine_main(conn, address: str, device: str, timeout_s: float) -> None:
    """The engine process: serves pushes over ipc and answers the test's commands ("generate", "state", "stop")
    on `conn` with ("ok", value) or ("error", traceback)."""
    _child_setup()
    import traceback
    try:
        engine = sh.engine_with_adapter(device=device)
        server = IPCReceiverServer(engine, sh.ADAPTER, address, AUTHKEY, readback=True, timeout_s=timeout_s).start()
        conn.send(("ok", sh.engine_outputs(engine, None)))  # base outputs (also warms the engine up)
        while True:
            cmd = conn.recv()
            if cmd == "stop":
                server.stop()
                conn.send(("ok", None))
                return
            if cmd == "generate":
                conn.send(("ok", sh.engine_outputs(engine)))
            elif cmd == "state":
                conn.send(("ok", {"version": engine.weight_version, "last_error": server.last_error,
                                  "open_version": server.receiver.open_version,
                                  "buffer_imports": server.buffer_imports, "connections": server.connections,
                                  "digest": _digest(engine.adapters.buffers(sh.ADAPTER))}))
    except BaseException:  # noqa: BLE001 - reported to the test
        conn.send(("error", traceback.format_exc()))


def _doomed_sender_main(address: str, seed: int, version: int, report) -> None:
    """A trainer that dies by SIGKILL right after the engine acked its first chunk (the push is open)."""
    _child_setup()
    trainer = sh.trainer_model(seed)
    sender = IPCSender(address, AUTHKEY, buffer_bytes=BUFFER)
    original = PayloadWriter.chunks

    def chunks_then_die(self, buffer_u8):
        for i, chunk in enumerate(original(self, buffer_u8)):
            if i == 1:  # the generator resumes only after chunk 0 was acked
                report.send(("acked", sender.buffer_name))
                os.kill(os.getpid(), signal.SIGKILL)
            yield chunk

    PayloadWriter.chunks = chunks_then_die
    sender.push(sh.adapter_tensors(trainer), version)
    report.send(("survived", None))


# ---- the engine process, seen from the test ------------------------------------------------------------------
class EngineProc:
    """A spawned engine serving `address`; `last` is the last good push: (version, tensors, outputs)."""

    def __init__(self, device: str = "cpu", timeout_s: float = SERVER_TIMEOUT_S):
        self.address = socket_address("test")
        self._conn, child = _SPAWN.Pipe()
        self.proc = _SPAWN.Process(target=_engine_main, args=(child, self.address, device, timeout_s), daemon=True)
        self.proc.start()
        self.base_outputs = self.result(timeout=300)
        self.last = (0, None, self.base_outputs)

    def send(self, cmd: str) -> None:
        self._conn.send(cmd)

    def result(self, timeout: float = 120):
        if not self._conn.poll(timeout):
            raise AssertionError(f"engine process did not answer within {timeout}s (alive: {self.proc.is_alive()})")
        status, value = self._conn.recv()
        assert status == "ok", f"engine process failed:\n{value}"
        return value

    def call(self, cmd: str):
        self.send(cmd)
        return self.result()

    def stop(self) -> None:
        if self.proc.is_alive():
            self.call("stop")
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.terminate()


@pytest.fixture(scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # the engine process computes at the same time on the other core
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def trainer(one_thread):
    return sh.trainer_model(seed=1)


@pytest.fixture(scope="module")
def engine(one_thread):
    proc = EngineProc()
    yield proc
    proc.stop()


def _tensors(trainer, seed: int) -> dict[str, torch.Tensor]:
    """The trainer's adapter after an 'optimizer step' to `seed` (cloned: later steps do not change it)."""
    sh.set_adapter(trainer, seed)
    return {n: t.detach().clone() for n, t in sh.adapter_tensors(trainer).items()}


def _good_push(engine: EngineProc, sender: IPCSender, trainer, seed: int):
    """Push the adapter of `seed` as the next version; the engine must then generate what the trainer does."""
    tensors = _tensors(trainer, seed)
    version = engine.last[0] + 1
    report = sender.push(tensors, version)
    engine.send("generate")
    want = sh.model_outputs(trainer)  # meanwhile, on the other core
    assert engine.result() == want
    engine.last = (version, tensors, want)
    return report


def _assert_previous_version_serves(engine: EngineProc) -> dict:
    version, tensors, outputs = engine.last
    state = engine.call("state")
    assert state["version"] == version and state["open_version"] is None
    if tensors is not None:
        assert state["digest"] == _digest(tensors)
    assert engine.call("generate") == outputs
    return state


def _served(engine: EngineProc, trainer) -> None:
    """Make sure some adapter version is serving (so that 'the previous version' means something)."""
    if engine.last[1] is None:
        with IPCSender(engine.address, AUTHKEY, buffer_bytes=BUFFER) as s:
            _good_push(engine, s, trainer, seed=1)


# ---- tests ---------------------------------------------------------------------------------------------------
def test_push_through_a_small_buffer_then_the_engine_generates_like_the_trainer(engine, trainer):
    with IPCSender(engine.address, AUTHKEY, buffer_bytes=BUFFER) as sender:
        v0 = engine.last[0]
        rep = _good_push(engine, sender, trainer, seed=1)
        tensors = engine.last[1]
        total = Manifest.of(tensors).total_bytes
        assert total == sum(t.numel() * t.element_size() for t in tensors.values()) > BUFFER
        assert (rep.version, rep.transport, rep.bytes, rep.num_tensors) == (v0 + 1, "ipc", total, len(tensors))
        assert rep.num_chunks == math.ceil(total / BUFFER) == 4
        assert rep.checksum_match is True and rep.readback_match is True  # the server runs with readback=True
        assert rep.seconds > 0 and rep.metrics()["sync/gbps"] == rep.gbps > 0
        v1_outputs = engine.last[2]
        assert v1_outputs != engine.base_outputs
        state = _assert_previous_version_serves(engine)
        assert state["buffer_imports"] == 1

        rep2 = _good_push(engine, sender, trainer, seed=2)
        assert rep2.version == v0 + 2 and rep2.checksum_match and engine.last[2] not in (v1_outputs,
                                                                                          engine.base_outputs)
        state = engine.call("state")
        assert state["version"] == v0 + 2 and state["last_error"] is None
        assert state["buffer_imports"] == 1 and sender.exports == 1  # one buffer, announced once, two pushes
        name = sender.buffer_name
    assert sender.buffer is None
    with pytest.raises(FileNotFoundError):  # close() unlinked the shared memory
        shared_memory.SharedMemory(name=name)


def test_a_byte_flipped_in_the_transfer_buffer_is_refused_naming_its_tensor(engine, trainer, monkeypatch):
    _served(engine, trainer)
    tensors = _tensors(trainer, seed=3)
    victim = next(s for s in Manifest.of(tensors).specs if s.offset >= 2 * BUFFER)  # chunks 0, 1 are good
    original = PayloadWriter.chunks

    def corrupting(self, buffer_u8):  # after packing and checksumming: a flip "in transit"
        for offset, nbytes in original(self, buffer_u8):
            if offset <= victim.offset + 3 < offset + nbytes:
                buffer_u8[victim.offset + 3 - offset] ^= 0x04
            yield offset, nbytes

    with IPCSender(engine.address, AUTHKEY, buffer_bytes=BUFFER) as sender:
        monkeypatch.setattr(PayloadWriter, "chunks", corrupting)
        with pytest.raises(SyncError, match="checksum mismatch") as e:
            sender.push(tensors, engine.last[0] + 1)
        assert e.value.tensor == victim.name and victim.name in str(e.value)
        state = _assert_previous_version_serves(engine)
        assert "checksum mismatch" in state["last_error"]
        monkeypatch.setattr(PayloadWriter, "chunks", original)
        _good_push(engine, sender, trainer, seed=3)  # the same channel works for the next good push


def test_a_missing_tensor_or_a_wrong_shape_is_refused_naming_the_tensor(engine, trainer):
    _served(engine, trainer)
    good = _tensors(trainer, seed=4)
    names = sorted(good)
    cases = [({n: t for n, t in good.items() if n != names[7]}, names[7], "missing"),
             ({**good, names[9]: good[names[9]][:, :-1]}, names[9], "shape")]
    with IPCSender(engine.address, AUTHKEY, buffer_bytes=BUFFER) as sender:
        for bad, name, match in cases:
            with pytest.raises(SyncError, match=match) as e:
                sender.push(bad, engine.last[0] + 1)
            assert e.value.tensor == name and name in str(e.value)
            state = _assert_previous_version_serves(engine)
            assert name in state["last_error"]
        _good_push(engine, sender, trainer, seed=4)


def test_a_sender_killed_mid_push_leaves_the_previous_version_serving(engine, trainer):
    _served(engine, trainer)
    version = engine.last[0] + 1
    report, child_end = _SPAWN.Pipe(duplex=False)
    proc = _SPAWN.Process(target=_doomed_sender_main, args=(engine.address, 5, version, child_end), daemon=True)
    proc.start()
    proc.join(120)
    assert proc.exitcode == -signal.SIGKILL and report.poll(5)
    status, shm_name = report.recv()
    assert status == "acked"
    shared_memory.SharedMemory(name=shm_name).unlink()  # what the dead owner could not do (the engine unmapped it)
    deadline = time.monotonic() + 10
    while "disconnected" not in (engine.call("state")["last_error"] or "") and time.monotonic() < deadline:
        time.sleep(0.1)
    state = _assert_previous_version_serves(engine)
    assert f"sender disconnected mid-push of version {version}" in state["last_error"]
    with IPCSender(engine.address, AUTHKEY, buffer_bytes=BUFFER) as sender:  # the next sender is served
        rep = _good_push(engine, sender, trainer, seed=5)
    assert rep.version == version and rep.checksum_match


def test_a_sender_silent_mid_push_is_aborted_by_the_engine(engine, trainer, monkeypatch):
    _served(engine, trainer)
    original = PayloadWriter.chunks

    def stalling(self, buffer_u8):
        for i, chunk in enumerate(original(self, buffer_u8)):
            if i == 1:
                time.sleep(SERVER_TIMEOUT_S + 1.5)
            yield chunk

    with IPCSender(engine.address, AUTHKEY, buffer_bytes=BUFFER) as sender:
        monkeypatch.setattr(PayloadWriter, "chunks", stalling)
        version = engine.last[0] + 1
        with pytest.raises(SyncError, match=f"sender silent for more than {SERVER_TIMEOUT_S}s mid-push of "
                                            f"version {version}"):
            sender.push(_tensors(trainer, seed=6), version)
        _assert_previous_version_serves(engine)
        monkeypatch.setattr(PayloadWriter, "chunks", original)
        _good_push(engine, sender, trainer, seed=6)


def test_versions_only_move_forward_and_bad_configs_fail_clearly(engine, trainer):
    _served(engine, trainer)
    version = engine.last[0]
    with IPCSender(engine.address, AUTHKEY, buffer_bytes=BUFFER) as sender:
        for v in (version, version - 1):
            with pytest.raises(SyncError, match=f"version {v}: versions only move forward"):
                sender.push(_tensors(trainer, seed=7), v)
            _assert_previous_version_serves(engine)
    for bad in (1000, 0, -ALIGN, 1.5 * ALIGN):
        with pytest.raises(ValueError, match=f"not a positive multiple of {ALIGN}"):
            IPCSender(engine.address, AUTHKEY, buffer_bytes=bad)
    with pytest.raises(ValueError, match="authkey"):
        IPCSender(engine.address, b"", buffer_bytes=BUFFER)
    with IPCSender(engine.address, b"not-the-key", buffer_bytes=BUFFER) as stranger, \
            pytest.raises(SyncError, match="refused our authkey"):
        stranger.push(_tensors(trainer, seed=7), version + 1)
    with pytest.raises(SyncError, match="no ipc receiver"):
        IPCSender(socket_address("nobody"), AUTHKEY, buffer_bytes=BUFFER, timeout_s=0.2).push(engine.last[1], 1)
    _assert_previous_version_serves(engine)  # the engine survived the stranger


def test_one_sender_at_a_time_a_second_one_fails_within_its_timeout(engine, trainer):
    _served(engine, trainer)
    connections = engine.call("state")["connections"]
    with IPCSender(engine.address, AUTHKEY, buffer_bytes=BUFFER) as first:
        _good_push(engine, first, trainer, seed=9)  # first is connected (between pushes) from now on
        with IPCSender(engine.address, AUTHKEY, buffer_bytes=BUFFER, timeout_s=0.5) as second, \
                pytest.raises(SyncError, match="one sender at a time"):
            second.push(_tensors(trainer, seed=10), engine.last[0] + 1)
        _good_push(engine, first, trainer, seed=10)  # the first one is still served
    with IPCSender(engine.address, AUTHKEY, buffer_bytes=BUFFER) as third:  # the next one once the first left
        _good_push(engine, third, trainer, seed=11)
    assert engine.call("state")["connections"] == connections + 2  # the second one was never served


def test_the_sender_times_out_on_a_receiver_that_does_not_answer(trainer):
    address = socket_address("mute")
    with Listener(address, family="AF_UNIX", authkey=AUTHKEY) as listener:
        held = []
        mute = threading.Thread(target=lambda: held.append(listener.accept()), daemon=True)
        mute.start()
        sender = IPCSender(address, AUTHKEY, buffer_bytes=BUFFER, timeout_s=0.3)
        t0 = time.monotonic()
        with pytest.raises(SyncError, match=r"receiver did not answer within 0.3s \(hello\)"):
            sender.push(_tensors(trainer, seed=8), 1)
        assert time.monotonic() - t0 < 5
        sender.close()
        sender.close()  # idempotent
        mute.join(5)
        for c in held:
            c.close()


# ---- CUDA IPC --------------------------------------------------------------------------------------------------
@gpu_test
def test_cuda_ipc_buffer_is_exported_once_and_pushes_apply():
    """Two pushes through one CUDA transfer buffer (exported once): the engine process ends with the trainer's
    bytes and generates what a reference engine in this process generates with the same tensors pushed locally
    (same kernels, same device: the same tokens; a CPU-vs-CUDA comparison would test numerics, not transport)."""
    engine = EngineProc(device="cuda", timeout_s=30.0)
    reference = sh.engine_with_adapter(device="cuda")
    try:
        trainer = sh.trainer_model(seed=1).to("cuda")
        with IPCSender(engine.address, AUTHKEY, buffer_bytes=BUFFER, device="cuda") as sender:
            for version, seed in ((1, 11), (2, 12)):
                tensors = _tensors(trainer, seed)
                assert all(t.is_cuda for t in tensors.values())
                rep = sender.push(tensors, version)
                assert rep.checksum_match is True and rep.readback_match is True and rep.num_chunks == 4
                state = engine.call("state")
                assert state["version"] == version and state["digest"] == _digest(tensors)
                LocalChannel(reference, sh.ADAPTER).push(tensors, version)
                assert engine.call("generate") == sh.engine_outputs(reference) != engine.base_outputs
            assert sender.buffer.is_cuda and sender.exports == 1
            assert state["buffer_imports"] == 1  # rebuilt once in the engine, reused by both pushes
    finally:
        engine.stop()
