"""The native engine's weight-sync channel (`LocalChannel`, `open_sender`) on k3_tiny (fp32, CPU): in-place,
all-or-nothing pushes and the version every sample carries. Its many-rank transaction:
tests/parallel/test_parallel_loop.py."""
import pytest
import sync_helpers as sh
import torch

from miles_k3.weight_sync.local import LocalChannel
from miles_k3.weight_sync.push import SyncError


@pytest.fixture(scope="module")
def engine():
    return sh.engine_with_adapter()


def _expected(seed):
    return [list(o) for o in sh.trainer_outputs(seed)]


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
    assert rep.readback_match is True and rep.version == v
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


# ---- the config's channel -----------------------------------------------------------------------------------
def test_open_sender_builds_the_local_channel_from_sync_config(engine):
    from miles_k3.weight_sync.channel import open_sender
    from miles_k3.weight_sync.config import WeightSyncConfig

    tensors = sh.adapter_tensors(sh.trainer_model(seed=8))
    v = engine.weight_version + 1
    checked = open_sender(WeightSyncConfig(readback=True), engine=engine)
    rep = checked.push(tensors, v)
    assert checked.transport == "local" and rep.readback_match is True and engine.weight_version == v
    assert "sync/readback_match" in rep.metrics()
    plain = open_sender(WeightSyncConfig(), engine=engine).push(tensors, v + 1)
    assert plain.readback_match is None and "sync/readback_match" not in plain.metrics()
    with pytest.raises(ValueError, match="unknown adapter"):
        open_sender(WeightSyncConfig(), engine=engine, adapter="nope")
