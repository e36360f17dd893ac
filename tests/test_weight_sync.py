"""The weight-sync channel's transaction (manifest, payload, checksums, Receiver), the `local` transport and the
on k3_tiny (fp32, CPU). The ipc and dist transports have their own files."""
import pytest
import sync_helpers as sh
import torch

from miles_k3.weight_sync.local import LocalChannel
from miles_k3.weight_sync.protocol import ALIGN, Manifest, PayloadWriter, SyncError, payload_checksums
from miles_k3.weight_sync.receiver import Receiver


@pytest.fixture(scope="module")
def engine():
    return sh.engine_with_adapter()


@pytest.fixture(scope="module")
def base_out(engine):
    return sh.engine_outputs(engine, None)


def _payload(tensors, buffer_bytes=1024, algo=None):
    """The whole payload a PayloadWriter produces through a small buffer, and its (algorithm, checksums)."""
    w = PayloadWriter(tensors, algo=algo)
    buf = torch.empty(buffer_bytes, dtype=torch.uint8)
    payload = torch.empty(w.manifest.total_bytes, dtype=torch.uint8)
    chunks = 0
    for off, n in w.chunks(buf):
        payload[off:off + n] = buf[:n]
        chunks += 1
    return w.manifest, payload, w.checksums(), chunks


# ---- manifest, payload, checksum ---------------------------------------------------------------------------
@pytest.mark.parametrize("algo", ["crc32", "block16"])
def test_payload_layout_is_aligned_grouped_by_dtype_and_round_trips(algo):
    g = torch.Generator().manual_seed(0)
    ts = {"a": torch.randn(3, 5, generator=g), "b": torch.randn(100, generator=g).bfloat16(),
          "c": torch.randn(300, 7, generator=g)[:, ::2], "d": torch.randn(7, generator=g).half()}
    m, payload, (name, sums), chunks = _payload(ts, algo=algo)
    assert name == algo and len(sums) == len(ts)
    assert [s.dtype for s in m.specs] == ["bfloat16", "float16", "float32", "float32"]
    assert all(s.offset % ALIGN == 0 for s in m.specs) and m.total_bytes % ALIGN == 0
    assert chunks == -(-m.total_bytes // 1024) > 1
    for s in m.specs:  # every tensor's bytes (a strided one too) at its offset, zeros in its padding
        got = payload[s.offset:s.offset + s.nbytes].view(s.torch_dtype).view(s.shape)
        assert torch.equal(got, ts[s.name])
        assert not payload[s.offset + s.nbytes:s.offset + (len(s.blocks)) * ALIGN].any()
    assert sums == payload_checksums(m, payload, algo)  # chunked sums = sums over the whole payload
    assert Manifest.from_wire(m.to_wire()) == m


def test_manifest_is_reused_only_for_the_same_names_shapes_and_dtypes():
    ts = {"a": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.bfloat16)}
    m = Manifest.of(ts)
    assert Manifest.of({"a": torch.ones(3, 4), "b": torch.ones(5, dtype=torch.bfloat16)}) is m  # new values
    for changed in ({"a": torch.zeros(4, 3), "b": ts["b"]}, {"a": ts["a"], "b": torch.zeros(5)},
                    {"a": ts["a"], "c": ts["b"]}):
        m2 = Manifest.of(changed)
        assert m2 is not m and m2 != m
        assert [(s.name, s.shape, s.dtype) for s in m2.specs] == sorted(
            ((n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in changed.items()),
            key=lambda x: x[2])
    wire = Manifest.of(ts).to_wire()
    assert Manifest.from_wire(list(wire)) is Manifest.from_wire(list(wire))  # a receiver's repeated layout
    moved = [(n, shape, dt, off + ALIGN, nb) for n, shape, dt, off, nb in wire]
    assert [s.offset for s in Manifest.from_wire(moved).specs] == [off + ALIGN for _, _, _, off, _ in wire]
    with pytest.raises(SyncError, match="tensor b: expected a torch.Tensor, got list"):
        Manifest.of({"a": ts["a"], "b": [1.0]})
    with pytest.raises(SyncError, match="tensor b: expected a torch.Tensor, got ndarray"):
        Manifest.of({"a": ts["a"], "b": ts["a"].numpy()})


@pytest.mark.parametrize("algo", ["crc32", "block16"])
def test_checksum_names_exactly_the_tensor_with_a_changed_word_or_swapped_blocks(algo):
    g = torch.Generator().manual_seed(1)
    ts = {f"t{i}": torch.randn(int(n), generator=g) for i, n in enumerate([5, 700, 128, 1000])}
    m, payload, (_, sums), _ = _payload(ts, algo=algo)
    for s in m.specs:
        for pos in (s.offset, s.offset + s.nbytes - 1):  # first and last byte of each tensor
            bad = payload.clone()
            bad[pos] ^= 0x10
            diff = [a != b for a, b in zip(sums, payload_checksums(m, bad, algo))]
            assert diff == [x.name == s.name for x in m.specs]
    s = m.specs[1]  # t1: 2800 bytes = 6 blocks; swap its first two blocks (same words, other order)
    bad = payload.clone()
    bad[s.offset:s.offset + ALIGN], bad[s.offset + ALIGN:s.offset + 2 * ALIGN] = (
        payload[s.offset + ALIGN:s.offset + 2 * ALIGN].clone(), payload[s.offset:s.offset + ALIGN].clone())
    assert [a != b for a, b in zip(sums, payload_checksums(m, bad, algo))] == [x.name == "t1" for x in m.specs]


def test_bad_pushes_are_refused_before_any_byte_moves():
    with pytest.raises(SyncError, match="empty push"):
        Manifest.of({})
    with pytest.raises(ValueError, match="multiple of 512"):
        next(PayloadWriter({"a": torch.ones(3)}).chunks(torch.empty(1000, dtype=torch.uint8)))
    with pytest.raises(ValueError, match="not one of crc32, block16"):
        PayloadWriter({"a": torch.ones(3)}, algo="md5")
    assert PayloadWriter({"a": torch.ones(3)}, checksum=False).checksums() is None


# ---- the Receiver, in process --------------------------------------------------------------------------------
def _push(receiver, tensors, version, corrupt=None, chunks=None, algo="crc32"):
    m, payload, sums, _ = _payload(tensors, algo=algo)
    if corrupt is not None:
        payload[corrupt] ^= 1
    receiver.begin(version, m)
    end = m.total_bytes if chunks is None else chunks * 1024
    for off in range(0, end, 1024):
        receiver.write(off, payload[off:off + 1024])
    return receiver.commit(version, sums)


def test_receiver_applies_only_whole_verified_pushes(engine, base_out):
    trainer = sh.trainer_model(seed=1)
    r = Receiver(engine, sh.ADAPTER, readback=True)
    v0 = engine.weight_version
    good = sh.adapter_tensors(trainer)
    res = _push(r, good, v0 + 1, algo="block16")  # the GPU algorithm, here on CPU
    assert res["checksum_match"] is True and res["readback_match"] is True and res["version"] == v0 + 1
    want = _expected(1)
    assert sh.engine_outputs(engine) == want != base_out and engine.weight_version == v0 + 1
    names = sorted(good)
    nxt = sh.adapter_tensors(sh.trainer_model(seed=2))
    victim = Manifest.of(nxt).specs[len(nxt) // 2]
    cases = {  # each: what goes wrong (push arguments), and the tensor the error must name
        "corrupted byte": ({"tensors": nxt, "corrupt": victim.offset + 3}, victim.name),
        "missing": ({"tensors": {n: t for n, t in nxt.items() if n != names[3]}}, names[3]),
        "wrong shape": ({"tensors": {**nxt, names[5]: good[names[5]][:, :1]}}, names[5]),
        "NaN": ({"tensors": {**nxt, names[2]: good[names[2]] * float("nan")}}, names[2]),
        "truncated": ({"tensors": nxt, "chunks": 2}, next(s.name for s in Manifest.of(nxt).specs
                                                          if s.offset + s.nbytes > 2048)),
        "old version": ({"tensors": nxt, "version": v0 + 1}, None),
    }
    for what, (kw, tensor) in cases.items():
        version = kw.pop("version", v0 + 2)
        with pytest.raises(SyncError) as e:
            _push(r, version=version, **kw)
        assert e.value.tensor == tensor, what
        if tensor:
            assert tensor in str(e.value), what
        assert r.last_error and r.open_version is None, what
        assert engine.weight_version == v0 + 1 and sh.engine_outputs(engine) == want, what
    assert "incomplete" in str(_raised(lambda: _push(r, nxt, v0 + 2, chunks=2)))
    assert "forward" in str(_raised(lambda: _push(r, nxt, v0 + 1)))
    _push(r, nxt, v0 + 2)  # the channel still works after every refusal
    assert sh.engine_outputs(engine) == _expected(2) and engine.weight_version == v0 + 2


def _expected(seed):
    return [list(o) for o in sh.trainer_outputs(seed)]


def _raised(fn) -> Exception:
    with pytest.raises(SyncError) as e:
        fn()
    return e.value


def test_receiver_refuses_out_of_order_chunks_and_a_commit_of_another_version(engine):
    r = Receiver(engine, sh.ADAPTER)
    tensors = sh.adapter_tensors(sh.trainer_model(seed=3))
    m, payload, sums, _ = _payload(tensors)
    v = engine.weight_version + 1
    gap = [list(row) for row in m.to_wire()]  # a manifest with a 1 TB hole: refused before any allocation
    gap[-1][3] += 2**40
    with pytest.raises(SyncError, match="not the next aligned range") as e:
        r.begin(v, Manifest.from_wire(gap))
    assert e.value.tensor == gap[-1][0] and r._staging is None
    r.begin(v, m)
    with pytest.raises(SyncError, match="out of order"):
        r.write(1024, payload[1024:2048])
    assert r.open_version is None  # the push was dropped
    r.begin(v, m)
    r.write(0, payload)
    with pytest.raises(SyncError, match="commit of version"):
        r.commit(v + 1, sums)
    assert engine.weight_version == v - 1


# ---- local ---------------------------------------------------------------------------------------------------
def test_local_zero_the_buffers_then_sync_restores_every_byte(engine):
    trainer = sh.trainer_model(seed=4)
    ch = LocalChannel(engine, sh.ADAPTER, readback=True)
    bufs = engine.adapters.buffers(sh.ADAPTER)
    addresses = {n: t.data_ptr() for n, t in bufs.items()}
    for t in bufs.values():
        t.zero_()
    v = engine.weight_version + 1
    rep = ch.push(sh.adapter_tensors(trainer), v)
    assert rep.readback_match is True and rep.checksum_match is None and rep.version == v
    assert rep.bytes == sum(t.numel() * 4 for t in sh.adapter_tensors(trainer).values())
    assert all(torch.equal(bufs[n], t) for n, t in sh.adapter_tensors(trainer).items())
    assert {n: t.data_ptr() for n, t in bufs.items()} == addresses  # in place
    assert sh.engine_outputs(engine) == _expected(4)
    assert rep.metrics()["sync/version"] == v and rep.gbps > 0


def test_local_refusals_name_the_tensor_and_keep_the_old_version(engine):
    trainer = sh.trainer_model(seed=5)
    ch = LocalChannel(engine, sh.ADAPTER)
    v = engine.weight_version + 1
    ch.push(sh.adapter_tensors(trainer), v)
    want = sh.engine_outputs(engine)
    good = sh.adapter_tensors(sh.trainer_model(seed=6))
    name = sorted(good)[4]
    for bad, match in [({**good, name: good[name] * float("inf")}, "NaN/Inf"),
                       ({**good, name: good[name].flatten()}, "shape"), ({**good, "x.lora_A.weight": good[name]}, "unknown")]:
        with pytest.raises(SyncError, match=match):
            ch.push(bad, v + 1)
        assert engine.weight_version == v and sh.engine_outputs(engine) == want
    with pytest.raises(SyncError, match="forward"):
        ch.push(good, v)
    with pytest.raises(ValueError, match="unknown adapter"):
        LocalChannel(engine, "nope")


def test_engine_samples_carry_the_version_they_were_sampled_with(engine):
    trainer = sh.trainer_model(seed=7)
    v = engine.weight_version + 3  # versions may skip, never go back
    LocalChannel(engine, sh.ADAPTER).push(sh.adapter_tensors(trainer), v)
    out = engine.generate(input_ids=sh.PROMPTS, sampling_params=sh.GREEDY, lora=sh.ADAPTER)
    assert all(r["meta_info"]["weight_version"] == v and r["meta_info"]["weight_versions"] == [v] for r in out)


# ---- the config-selected channel -----------------------------------------------------------------------------
def test_config_selects_the_transport_and_both_sides_work(engine):
    import secrets

    from miles_k3.weight_sync.channel import open_receiver, open_sender
    from miles_k3.weight_sync.config import WeightSyncConfig
    from miles_k3.weight_sync.ipc import socket_address

    tensors = sh.adapter_tensors(sh.trainer_model(seed=8))
    local = open_sender(WeightSyncConfig(readback=True), engine=engine)
    v = engine.weight_version + 1
    assert local.transport == "local" and local.push(tensors, v).readback_match is True
    cfg = WeightSyncConfig(transport="ipc", buffer_mb=1, readback=True, timeout_s=30)
    address, key = socket_address("cfg"), secrets.token_bytes(16)
    server = open_receiver(cfg, engine, address=address, authkey=key)  # in this process, on its own thread
    try:
        sender = open_sender(cfg, address=address, authkey=key)
        tensors = sh.adapter_tensors(sh.trainer_model(seed=9))
        rep = sender.push(tensors, v + 1)
        assert (sender.transport, rep.checksum_match, rep.readback_match, rep.version) == ("ipc", True, True, v + 1)
        assert rep.num_chunks == 1 and engine.weight_version == v + 1
        assert sh.engine_outputs(engine) == _expected(9)
        sender.close()
    finally:
        server.stop()
    with pytest.raises(ValueError, match="pass engine="):
        open_sender(WeightSyncConfig())
    with pytest.raises(ValueError, match="address= and the shared authkey="):
        open_sender(WeightSyncConfig(transport="ipc"))
    with pytest.raises(ValueError, match="no receiver side"):
        open_receiver(WeightSyncConfig(), engine)
    with pytest.raises(ValueError, match="transport: 'smoke'"):
        open_sender(WeightSyncConfig(transport="smoke"), engine=engine)
