"""The `dist` weight-sync transport between two real processes over gloo (CPU), and over NCCL on two GPUs.

One spawned pair runs a scripted sequence (rank 0: trainer + DistSender, rank 1: engine + DistReceiver with
readback) and writes what it saw to a JSON file per rank; the tests assert on those results:
  push1 (v1) / push2 (v2)      good pushes through a transfer buffer smaller than the adapter (several chunks)
  corrupt (v3)                 one byte flipped in the transfer buffer after packing + checksumming, before send
  after_corrupt (v3)           the same version again, unharmed
  missing / shape (v4)         a tensor left out / a tensor of the wrong shape
  sender_abort (v4)            packing fails on the sender after the first chunk: the push is aborted in step
  stale2 / stale3              versions 2 and 3 again (not newer than the engine's 3)
  group2 (v4) + close          a push over a second group (no checksums; the receiver forced onto its bounce
                               buffer, the CUDA-engine-over-gloo path), in serve_forever until the sender closes
  killed (v5)                  the sender os._exit(1)s right after broadcasting the first chunk
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import multiprocessing
import os
import sys
import traceback
from dataclasses import asdict
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from kernel_testing import gpu_test

from miles_k3.weight_sync.protocol import Manifest, SyncError, byte_view

BUFFER = 256 * 1024  # bytes: the k3_tiny adapter (~0.85 MB of payload) crosses in 4 chunks
TIMEOUT = timedelta(seconds=60)  # > the longest gap between two collectives (rank 0 computing model outputs)


# ---- helpers (both processes) -------------------------------------------------------------------------------
def _helpers():
    """sync_helpers, importable in a spawned child too."""
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    if tests_dir not in sys.path:
        sys.path.insert(0, tests_dir)
    import sync_helpers
    return sync_helpers


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(byte_view(tensors[name]).cpu().numpy().tobytes())
    return h.hexdigest()


def _error(fn) -> dict | None:
    """Run fn; the SyncError it raised as a dict (None if it raised nothing)."""
    try:
        fn()
    except SyncError as e:
        return {"message": str(e), "tensor": e.tensor}
    return None


@contextlib.contextmanager
def _hooked(sender, hook):
    """Monkeypatch sender._send_chunk: hook(chunk_u8, offset, send) runs instead of each broadcast."""
    send = sender._send_chunk
    sender._send_chunk = lambda chunk, offset: hook(chunk, offset, send)
    try:
        yield
    finally:
        del sender._send_chunk


def _init(rank: int, init_file: str, backend: str) -> None:
    torch.set_num_threads(1)  # two processes on two cores
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=TIMEOUT)


def _write(out_dir: str, rank: int, results: dict) -> None:
    path = os.path.join(out_dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(results, f)
    os.replace(path + ".tmp", path)


def _worker(rank: int, init_file: str, out_dir: str, script: str, backend: str = "gloo") -> None:
    """Spawned entry: run SCRIPTS[script][rank], write its results (or the traceback) for the parent."""
    results: dict = {}
    try:
        _init(rank, init_file, backend)
        SCRIPTS[script][rank](results, lambda: _write(out_dir, rank, results))
    except BaseException:  # noqa: BLE001 - reported to the parent test
        results["crash"] = traceback.format_exc()
    _write(out_dir, rank, results)


# ---- the scripted gloo sequence -----------------------------------------------------------------------------
def _trainer_script(res: dict, dump) -> None:
    from miles_k3.weight_sync.dist import DistSender
    h = _helpers()
    trainer = h.trainer_model(1)
    sender = DistSender(src=0, buffer_bytes=BUFFER)

    for version in (1, 2):  # adapter seed = version
        h.set_adapter(trainer, version)
        tensors = h.adapter_tensors(trainer)
        res[f"digest{version}"] = _digest(tensors)
        res[f"push{version}"] = asdict(sender.push(tensors, version))
        res[f"expected{version}"] = h.model_outputs(trainer)  # overlaps with rank 1 generating
    res["manifest_bytes"] = Manifest.of(tensors).total_bytes
    res["num_tensors"] = len(tensors)
    h.set_adapter(trainer, 3)
    t3 = h.adapter_tensors(trainer)
    res["digest3"] = _digest(t3)
    res["corrupt"] = _corrupted_push(sender, t3, 3)
    res["after_corrupt"] = asdict(sender.push(t3, 3))
    missing = next(iter(t3))
    res["missing"] = _error(lambda: sender.push({n: t for n, t in t3.items() if n != missing}, 4))
    res["missing_name"] = missing
    wrong = list(t3)[5]
    bad = dict(t3)
    bad[wrong] = torch.zeros(t3[wrong].shape[0] + 1, *t3[wrong].shape[1:])
    res["shape"] = _error(lambda: sender.push(bad, 4))
    res["shape_name"] = wrong
    res["sender_abort"] = _failing_pack_push(sender, t3, 4)
    res["stale2"] = _error(lambda: sender.push(t3, 2))
    res["stale3"] = _error(lambda: sender.push(t3, 3))
    _group2_push(res, trainer, h)
    dump()

    def die_after_first_chunk(chunk, offset, send):
        send(chunk, offset)
        os._exit(1)

    h.set_adapter(trainer, 5)
    with _hooked(sender, die_after_first_chunk):
        sender.push(h.adapter_tensors(trainer), 5)
    res["killed"] = "the sender survived its own kill"


def _corrupted_push(sender, tensors: dict, version: int) -> dict | None:
    """Push with one byte of the second chunk flipped after it was packed and checksummed; the error, and which
    tensor that byte belongs to."""
    m = Manifest.of(tensors)
    spec = next(s for s in m.specs if s.offset + s.nbytes > BUFFER + 8)
    at = max(spec.offset, BUFFER) + 5  # a byte of that tensor's data in the chunk starting at BUFFER

    def flip(chunk, offset, send):
        if offset == BUFFER:
            chunk[at - offset:at - offset + 1].bitwise_xor_(0xFF)
        send(chunk, offset)

    with _hooked(sender, flip):
        err = _error(lambda: sender.push(tensors, version))
    return {"error": err, "corrupted_tensor": spec.name}


def _failing_pack_push(sender, tensors: dict, version: int) -> dict | None:
    """Push while packing raises from the second chunk on (protocol.pack_range monkeypatched)."""
    from miles_k3.weight_sync import protocol
    pack = protocol.pack_range

    def failing(manifest, tensors, dst_u8, start):
        if start >= BUFFER:
            raise MemoryError("simulated failure while packing")
        pack(manifest, tensors, dst_u8, start)

    protocol.pack_range = failing
    try:
        return _error(lambda: sender.push(tensors, version))
    finally:
        protocol.pack_range = pack


def _group2_push(res: dict, trainer, h) -> None:
    """A push over a second group (the `group` argument), then close: the receiver's serve_forever returns."""
    from miles_k3.weight_sync.dist import DistSender
    group = dist.new_group([0, 1])
    sender = DistSender(src=0, group=group, buffer_bytes=BUFFER, checksum=False)
    h.set_adapter(trainer, 4)
    tensors = h.adapter_tensors(trainer)
    res["digest4"] = _digest(tensors)
    res["group2"] = asdict(sender.push(tensors, 4))
    sender.close()
    res["after_close"] = _error(lambda: sender.push(tensors, 5))


def _engine_script(res: dict, dump) -> None:
    from miles_k3.weight_sync.dist import DistReceiver
    h = _helpers()
    engine = h.engine_with_adapter()
    recv = DistReceiver(engine, h.ADAPTER, src=0, readback=True)
    res["base"] = h.engine_outputs(engine)

    def record(name: str, result, outputs: bool = False) -> None:
        res[name] = {"result": result, "last_error": recv.last_error, "version": engine.weight_version,
                     "digest": _digest(engine.adapters.buffers(h.ADAPTER)), "broken": recv.broken}
        if outputs:
            res[name]["outputs"] = h.engine_outputs(engine)

    for name, outputs in [("push1", True), ("push2", True), ("corrupt", True), ("after_corrupt", False),
                          ("missing", False), ("shape", False), ("sender_abort", False),
                          ("stale2", False), ("stale3", False)]:
        record(name, recv.serve_one(), outputs)
    recv2 = DistReceiver(engine, h.ADAPTER, src=0, group=dist.new_group([0, 1]), readback=True)
    recv2.direct = False  # receive into the bounce buffer + Receiver.write, as a CUDA engine over gloo does
    record("group2", recv2.serve_forever(), outputs=True)
    res["group2"]["closed"] = recv2.closed
    record("killed", recv.serve_one(), outputs=True)


SCRIPTS = {"gloo": (_trainer_script, _engine_script)}


def _run_pair(tmp_dir, script: str, backend: str = "gloo", target=None, timeout: float = 240) -> tuple:
    """Spawn ranks 0 and 1 on `script`; their results and exit codes (a hung pair is killed)."""
    ctx = multiprocessing.get_context("spawn")
    init_file, out_dir = str(tmp_dir / "pg_init"), str(tmp_dir)
    procs = [ctx.Process(target=target or _worker, args=(r, init_file, out_dir, script, backend)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    results = []
    for r in range(2):
        path = tmp_dir / f"rank{r}.json"
        results.append(json.loads(path.read_text()) if path.exists() else {"crash": "no results written"})
    return results, [p.exitcode for p in procs]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    (trainer, engine), codes = _run_pair(tmp_path_factory.mktemp("dist"), "gloo")
    assert "crash" not in trainer and "crash" not in engine, (trainer.get("crash"), engine.get("crash"))
    assert codes == [1, 0], codes  # rank 0 killed itself mid-push on purpose; rank 1 exited cleanly
    return trainer, engine


# ---- tests --------------------------------------------------------------------------------------------------
def test_push_serves_the_pushed_adapter(pair):
    trainer, engine = pair
    assert engine["push1"]["outputs"] == trainer["expected1"] != engine["base"]
    assert engine["push2"]["outputs"] == trainer["expected2"] != trainer["expected1"]
    for v in (1, 2):
        assert engine[f"push{v}"]["version"] == v and engine[f"push{v}"]["last_error"] is None
        assert engine[f"push{v}"]["digest"] == trainer[f"digest{v}"]  # every engine byte is the trainer's
        assert engine[f"push{v}"]["result"]["checksum_match"] is True


def test_push_report_metrics(pair):
    trainer, _ = pair
    for v in (1, 2):
        r = trainer[f"push{v}"]
        assert r["version"] == v and r["transport"] == "dist"
        assert r["bytes"] == trainer["manifest_bytes"] > BUFFER
        assert r["num_chunks"] == math.ceil(trainer["manifest_bytes"] / BUFFER) >= 3
        assert r["num_tensors"] == trainer["num_tensors"]
        assert r["checksum_match"] is True and r["readback_match"] is True
        assert r["seconds"] > 0
    group2 = trainer["group2"]  # checksum=False on that sender: nothing to match, readback still on
    assert group2["checksum_match"] is None and group2["readback_match"] is True


def test_corrupted_byte_is_refused_naming_the_tensor(pair):
    trainer, engine = pair
    err, name = trainer["corrupt"]["error"], trainer["corrupt"]["corrupted_tensor"]
    assert err is not None and err["tensor"] == name
    assert "checksum mismatch" in err["message"] and name in err["message"] and "rank 1" in err["message"]
    seen = engine["corrupt"]
    assert seen["result"] is None and "checksum mismatch" in seen["last_error"]
    assert seen["version"] == 2 and seen["digest"] == trainer["digest2"]
    assert seen["outputs"] == engine["push2"]["outputs"]
    # the same version again, unharmed: accepted (a refused version is not used up)
    assert trainer["after_corrupt"]["version"] == 3 and trainer["after_corrupt"]["readback_match"] is True
    assert engine["after_corrupt"]["version"] == 3 and engine["after_corrupt"]["digest"] == trainer["digest3"]


@pytest.mark.parametrize("case", ["missing", "shape"])
def test_missing_tensor_or_wrong_shape_is_refused(pair, case):
    trainer, engine = pair
    err, name = trainer[case], trainer[f"{case}_name"]
    assert err is not None and err["tensor"] == name and name in err["message"]
    assert ("is missing from the push" if case == "missing" else "shape") in err["message"]
    assert engine[case]["result"] is None and name in engine[case]["last_error"]
    assert engine[case]["version"] == 3 and engine[case]["digest"] == trainer["digest3"]


def test_sender_side_failure_aborts_the_push_in_step(pair):
    trainer, engine = pair
    err = trainer["sender_abort"]
    assert err is not None and "aborted on the sender" in err["message"] and "MemoryError" in err["message"]
    seen = engine["sender_abort"]
    assert seen["result"] is None and not seen["broken"] and "aborted by the sender" in seen["last_error"]
    assert seen["version"] == 3 and seen["digest"] == trainer["digest3"]
    assert engine["stale2"]["last_error"] != seen["last_error"]  # the group stayed in step: the next push ran


def test_versions_only_move_forward(pair):
    trainer, engine = pair
    for case in ("stale2", "stale3"):
        assert trainer[case] is not None and "versions only move forward" in trainer[case]["message"]
        assert engine[case]["result"] is None and engine[case]["version"] == 3
        assert engine[case]["digest"] == trainer["digest3"]


def test_second_group_and_close(pair):
    trainer, engine = pair
    seen = engine["group2"]
    assert seen["result"] == 1 and seen["closed"] and seen["version"] == 4  # serve_forever: one push applied
    assert seen["digest"] == trainer["digest4"] and seen["outputs"] != engine["push2"]["outputs"]
    assert trainer["after_close"] is not None and "closed" in trainer["after_close"]["message"]


def test_killed_sender_leaves_the_previous_version_serving(pair):
    _, engine = pair
    seen = engine["killed"]
    assert seen["result"] is None and seen["broken"]
    assert "sender (rank 0) failed mid-push of version 5" in seen["last_error"]
    assert seen["version"] == 4 and seen["digest"] == engine["group2"]["digest"]
    assert seen["outputs"] == engine["group2"]["outputs"]


# ---- NCCL: ranks on cuda:0 and cuda:1 -----------------------------------------------------------------------
def _nccl_trainer(res: dict, dump) -> None:
    from miles_k3.weight_sync.dist import DistSender
    h = _helpers()
    device = torch.device("cuda", 0) if dist.get_backend() == "nccl" else torch.device("cpu")
    tensors = {n: t.to(device) for n, t in h.adapter_tensors(h.trainer_model(1)).items()}
    sender = DistSender(src=0, buffer_bytes=BUFFER)
    res["device"] = str(sender.device)
    res["digest"] = _digest(tensors)
    res["push"] = asdict(sender.push(tensors, 1))
    sender.close()
    dist.destroy_process_group()


def _nccl_engine(res: dict, dump) -> None:
    from miles_k3.weight_sync.dist import DistReceiver
    from miles_k3.weight_sync.local import LocalChannel
    h = _helpers()
    device = torch.device("cuda", 1) if dist.get_backend() == "nccl" else torch.device("cpu")
    engine = h.engine_with_adapter(device=device)
    res["base"] = h.engine_outputs(engine)
    recv = DistReceiver(engine, h.ADAPTER, src=0, readback=True)
    res["direct"] = recv.direct
    res["applied"] = recv.serve_forever()
    res["closed"], res["last_error"], res["version"] = recv.closed, recv.last_error, engine.weight_version
    res["digest"] = _digest(engine.adapters.buffers(h.ADAPTER))
    res["outputs"] = h.engine_outputs(engine)
    ref = h.engine_with_adapter(device=device)  # the same adapter pushed in-process: the same kernels on the same device
    LocalChannel(ref, h.ADAPTER).push({n: t.to(device) for n, t in h.adapter_tensors(h.trainer_model(1)).items()}, 1)
    res["reference"] = h.engine_outputs(ref)
    dist.destroy_process_group()


def _nccl_worker(rank: int, init_file: str, out_dir: str, script: str, backend: str = "nccl") -> None:
    if backend == "nccl":
        torch.cuda.set_device(rank)
    _worker(rank, init_file, out_dir, script, backend)


SCRIPTS["nccl"] = (_nccl_trainer, _nccl_engine)


@gpu_test
def test_nccl_push_then_generate(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL between two processes needs two GPUs (one device per rank)")
    (trainer, engine), codes = _run_pair(tmp_path, "nccl", "nccl", target=_nccl_worker, timeout=300)
    assert "crash" not in trainer and "crash" not in engine, (trainer.get("crash"), engine.get("crash"))
    assert trainer["device"] == "cuda:0" and engine["direct"] is True  # NCCL straight into CUDA staging
    report = trainer["push"]
    assert report["version"] == 1 and report["num_chunks"] >= 3
    assert report["checksum_match"] is True and report["readback_match"] is True
    assert engine["applied"] == 1 and engine["closed"] and engine["version"] == 1 and engine["last_error"] is None
    assert engine["digest"] == trainer["digest"]
    assert engine["outputs"] == engine["reference"] != engine["base"]
    assert codes == [0, 0], codes
