"""Trainer checkpoints (k3_tiny + LoRA, CPU): a bit-identical resume (adapters, AdamW moments, schedule and every
RNG), the directory layout, `keep` pruning, the `latest` pointer, crash safety of a save, clear errors for
truncated files, and the `resume` setting."""
import copy
import hashlib
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from lora_helpers import ids as _ids
from lora_helpers import tiny as _tiny

import miles_k3.utils.atomic
from miles_k3.model.lora import LoRAConfig, apply_lora, lora_parameters
from miles_k3.trainer import checkpoint as ckpt
from miles_k3.trainer.checkpoint import (
    CheckpointWriteError,
    ResumeError,
    find_latest,
    load_checkpoint,
    resolve_resume,
    save_checkpoint,
)
from miles_k3.trainer.optim import OptimConfig, build_optimizer, build_scheduler, lr_at, optimizer_step

LORA = LoRAConfig(rank=4, alpha=8.0, dropout=0.1)  # dropout: the forward draws from torch's RNG
OPTIM = OptimConfig(lr=1e-2, warmup_steps=1, total_steps=10, min_lr_ratio=0.1, weight_decay=0.01)
CONFIG_TEXT = "optim:\n  lr: 0.01\n"


@pytest.fixture(scope="module")
def base():
    """k3_tiny with MXFP4 experts and no LoRA (built once); every run deep-copies it."""
    return _tiny("mxfp4")


class Run:
    """A model with fresh LoRA, its AdamW and schedule."""

    def __init__(self, base):
        self.model = copy.deepcopy(base)
        apply_lora(self.model, LORA)
        self.model.train()
        self.params = lora_parameters(self.model)
        self.opt = build_optimizer(self.params, OPTIM)
        self.sched = build_scheduler(self.opt, OPTIM)

    def train_step(self, k):
        """A dummy loss that draws from torch (dropout, randn), python `random` and numpy."""
        logits = self.model(_ids(1, 6, seed=k)).logits.float()
        noise = torch.randn(logits.shape)
        weight = random.random() + float(np.random.rand())
        loss = (logits * noise).mean() * weight + logits.pow(2).mean() * 1e-2
        loss.backward()
        assert optimizer_step(self.opt, self.sched, self.params, OPTIM, loss=loss)["train/skipped"] == 0.0

    def save(self, run_dir, step, keep=3):
        return save_checkpoint(run_dir, step, self.model, LORA, self.opt, self.sched,
                               data_state={"cursor": step, "epoch": 0},
                               extra_state={"weight_version": step, "metrics": {"train/loss": 0.5}},
                               config_text=CONFIG_TEXT, keep=keep, base_model_name_or_path="k3_tiny")

    def load(self, path):
        return load_checkpoint(path, self.model, self.opt, self.sched)

    def snapshot(self):
        return ({k: p.detach().clone() for k, p in self.params.items()}, copy.deepcopy(self.opt.state_dict()),
                self.sched.state_dict())


def _seed_all(seed):
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def _assert_identical(a, b):
    (pa, oa, sa), (pb, ob, sb) = a, b
    assert pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)
    assert oa["param_groups"] == ob["param_groups"] and oa["state"].keys() == ob["state"].keys()
    for i in oa["state"]:
        assert all(torch.equal(v, ob["state"][i][key]) for key, v in oa["state"][i].items())
    assert sa == sb


def _differs(a, b):
    return any(not torch.equal(a[0][k], b[0][k]) for k in a[0])


def _tree_digest(path):
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def _latest_text(run_dir):
    return (run_dir / "checkpoints" / "latest").read_text().strip()


# ---- bit-identical resume ------------------------------------------------------------------------------
def test_resume_is_bit_identical(base, tmp_path):
    _seed_all(1)
    a = Run(base)
    a.train_step(0)
    a.train_step(1)
    path = a.save(tmp_path, 2)
    a.train_step(2)
    a.train_step(3)
    expected = a.snapshot()
    trained = a.model.state_dict()
    assert all(torch.equal(trained[k], v) for k, v in base.state_dict().items())  # the base is untouched

    _seed_all(123)  # another RNG stream and another LoRA init: only the checkpoint can make them agree
    b = Run(base)
    state = b.load(path)
    assert state == {"step": 2, "data_state": {"cursor": 2, "epoch": 0},
                     "extra_state": {"weight_version": 2, "metrics": {"train/loss": 0.5}}}
    assert b.sched.last_epoch == 2 and b.opt.param_groups[0]["lr"] == lr_at(3, OPTIM)
    b.train_step(2)
    b.train_step(3)
    _assert_identical(expected, b.snapshot())

    # each RNG matters: re-seeding one of them after the load changes the result
    for reseed in (torch.manual_seed, random.seed, np.random.seed):
        c = Run(base)
        c.load(path)
        reseed(7)
        c.train_step(2)
        c.train_step(3)
        assert _differs(expected, c.snapshot()), reseed


def test_layout_and_weights_only_files(base, tmp_path):
    path = Run(base).save(tmp_path, 5)
    assert path == tmp_path / "checkpoints" / "step_00000005"
    assert sorted(p.name for p in path.iterdir()) == ["adapter", "config.yaml", "mesh.json", "rank-00000",
                                                      "state.json"]  # one layout for one rank and many
    assert json.loads((path / "mesh.json").read_text()) == {"dp": 1, "tp": 1, "ep": 1, "world": 1}
    own = path / "rank-00000"
    assert sorted(p.name for p in own.iterdir()) == ["adapter_shard.pt", "optimizer.pt", "rng.pt"]
    assert sorted(p.name for p in (path / "adapter").iterdir()) == ["adapter_config.json",
                                                                    "adapter_model.safetensors"]
    assert json.loads((path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] \
        == "k3_tiny"
    assert (path / "config.yaml").read_text() == CONFIG_TEXT
    assert json.loads((path / "state.json").read_text())["step"] == 5
    assert _latest_text(tmp_path) == "step_00000005"
    rng = torch.load(own / "rng.pt", weights_only=True)
    assert torch.equal(rng["torch"], torch.get_rng_state())
    assert rng["numpy"]["keys"].shape == (624,) and len(rng["python"]["internal"]) == 625
    blob = torch.load(own / "optimizer.pt", weights_only=True)
    assert blob["scheduler"]["last_epoch"] == 0
    assert blob["optimizer"]["param_groups"][0]["param_names"][0].endswith("lora_A.weight")
    shard = torch.load(own / "adapter_shard.pt", weights_only=True)
    assert sorted(shard) == sorted(Run(base).params) and all(t.device.type == "cpu" for t in shard.values())


def test_refuses_state_that_is_not_json(base, tmp_path):
    run = Run(base)
    with pytest.raises(ValueError, match="^data_state: not JSON-serialisable"):
        save_checkpoint(tmp_path, 1, run.model, LORA, run.opt, run.sched, {"t": torch.zeros(1)}, {}, "")
    assert not (tmp_path / "checkpoints").exists()
    path = save_checkpoint(tmp_path, 1, run.model, LORA, run.opt, run.sched, {}, {}, "")  # defaults
    assert json.loads((path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] is None


# ---- keep, latest, find_latest -------------------------------------------------------------------------
def test_keep_prunes_older_checkpoints(base, tmp_path):
    run = Run(base)
    for step in range(1, 6):
        run.save(tmp_path, step, keep=2)
        assert _latest_text(tmp_path) == f"step_{step:08d}"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == \
        ["latest", "step_00000004", "step_00000005"]
    assert find_latest(tmp_path) == tmp_path / "checkpoints" / "step_00000005"
    # an incomplete directory does not count as one of the kept checkpoints, and is deleted
    (tmp_path / "checkpoints" / "step_00000005" / "rank-00000" / "rng.pt").unlink()
    run.save(tmp_path, 6, keep=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == \
        ["latest", "step_00000004", "step_00000006"]
    with pytest.raises(ValueError, match="^keep: "):
        run.save(tmp_path, 6, keep=0)


def test_resaving_an_earlier_step_keeps_later_ones_and_points_latest_at_it(base, tmp_path):
    run = Run(base)
    for step in (1, 2, 3):
        run.save(tmp_path, step, keep=2)
    run.save(tmp_path, 2, keep=1)  # resumed from step 2 and saved it again
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest", "step_00000002", "step_00000003"]
    assert find_latest(tmp_path).name == "step_00000002"


def test_find_latest_ignores_staging_leftovers_and_incomplete_dirs(base, tmp_path):
    root = tmp_path / "checkpoints"
    assert find_latest(tmp_path) is None
    run = Run(base)
    run.save(tmp_path, 1)
    run.save(tmp_path, 2)
    # a complete-looking staging leftover and two incomplete published dirs of later steps
    leftover = root / ".step_00000009.tmp-abc123"
    ckpt.shutil.copytree(root / "step_00000002", leftover)
    (leftover / "state.json").write_text(json.dumps({"step": 9}))
    no_optimizer = root / "step_00000007"
    ckpt.shutil.copytree(root / "step_00000002", no_optimizer)
    (no_optimizer / "state.json").write_text(json.dumps({"step": 7}))
    (no_optimizer / "rank-00000" / "optimizer.pt").unlink()
    bad_state = root / "step_00000008"
    ckpt.shutil.copytree(root / "step_00000002", bad_state)
    (bad_state / "state.json").write_text('{"step": 8, "data_st')
    assert find_latest(tmp_path) == root / "step_00000002"
    # without a usable pointer: the highest complete step directory
    (root / "latest").write_text("step_00000008\n")
    assert find_latest(tmp_path) == root / "step_00000002"
    (root / "latest").write_text("../../elsewhere\n")
    assert find_latest(tmp_path) == root / "step_00000002"
    (root / "latest").unlink()
    assert find_latest(tmp_path) == root / "step_00000002"
    ckpt.shutil.rmtree(root / "step_00000002")
    assert find_latest(tmp_path) == root / "step_00000001"
    # the pointer wins over a higher complete step (a run resumed from an earlier checkpoint)
    run.save(tmp_path, 3)
    (root / "latest").write_text("step_00000001\n")
    assert find_latest(tmp_path) == root / "step_00000001"


# ---- crash safety --------------------------------------------------------------------------------------
def _fail_fsync(monkeypatch):
    def crash(root):
        raise OSError("simulated crash while publishing")
    monkeypatch.setattr(miles_k3.utils.atomic, "_fsync_tree", crash)


def _fail_torch_save_midway(monkeypatch):
    real = torch.save

    def half_then_crash(obj, f, *args, **kwargs):
        if str(f).endswith("rng.pt"):
            real(obj, f, *args, **kwargs)
            data = Path(f).read_bytes()
            Path(f).write_bytes(data[: len(data) // 2])
            raise OSError("simulated crash while writing rng.pt")
        real(obj, f, *args, **kwargs)
    monkeypatch.setattr(torch, "save", half_then_crash)


@pytest.mark.parametrize("fail", [_fail_fsync, _fail_torch_save_midway])
def test_crash_during_save_keeps_previous_checkpoint_and_latest(base, tmp_path, monkeypatch, fail):
    run = Run(base)
    first = run.save(tmp_path, 1)
    before = _tree_digest(first)
    fail(monkeypatch)
    with pytest.raises(CheckpointWriteError, match=r"checkpoint of step 2: .*rank 0.*simulated crash.*the previous "
                                                   r"checkpoint is kept"):
        run.save(tmp_path, 2)
    monkeypatch.undo()
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001"]  # no staging dir left
    assert _latest_text(tmp_path) == "step_00000001" and _tree_digest(first) == before
    assert find_latest(tmp_path) == first
    assert run.save(tmp_path, 2) == root / "step_00000002"  # the next attempt works


def test_crash_before_the_pointer_moves_resumes_from_the_previous_checkpoint(base, tmp_path, monkeypatch):
    run = Run(base)
    first = run.save(tmp_path, 1)

    def crash(dest, text):
        raise OSError("simulated crash before latest was updated")
    monkeypatch.setattr(ckpt, "atomic_write_text", crash)
    with pytest.raises(CheckpointWriteError, match="simulated"):
        run.save(tmp_path, 2)
    monkeypatch.undo()
    assert ckpt.is_complete(tmp_path / "checkpoints" / "step_00000002")
    assert _latest_text(tmp_path) == "step_00000001" and find_latest(tmp_path) == first
    run.save(tmp_path, 2)  # resaving the same step replaces the directory
    assert find_latest(tmp_path).name == "step_00000002"


# ---- corrupt files -------------------------------------------------------------------------------------
@pytest.mark.parametrize("member", ["rank-00000/optimizer.pt", "rank-00000/rng.pt", "rank-00000/adapter_shard.pt",
                                    "adapter/adapter_model.safetensors"])
def test_truncated_file_gives_a_clear_error_and_changes_nothing(base, tmp_path, member):
    run = Run(base)
    run.save(tmp_path, 1)
    second = run.save(tmp_path, 2)
    file = second / member
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    _seed_all(5)
    fresh = Run(base)
    before = fresh.snapshot()
    rng_before = torch.get_rng_state()
    with pytest.raises(ValueError) as err:
        fresh.load(second)
    message = str(err.value)
    assert message.startswith(f"{file}: ") and "cannot be resumed" in message
    assert f"resume={tmp_path / 'checkpoints' / 'step_00000001'}" in message
    _assert_identical(before, fresh.snapshot())
    assert torch.equal(torch.get_rng_state(), rng_before)


def test_truncated_first_checkpoint_suggests_starting_over(base, tmp_path):
    run = Run(base)
    only = run.save(tmp_path, 1)
    (only / "rank-00000" / "optimizer.pt").write_bytes(b"PK\x03\x04")
    with pytest.raises(ValueError, match=r"optimizer\.pt: unreadable, the file is truncated or corrupt.*resume=none"):
        run.load(only)


def test_optimizer_over_other_parameters_is_refused(base, tmp_path):
    run = Run(base)
    path = run.save(tmp_path, 1)
    fewer = dict(list(run.params.items())[2:])
    opt = build_optimizer(fewer, OPTIM)
    with pytest.raises(ValueError, match=r"optimizer\.pt: the optimizer state is for other parameters"):
        load_checkpoint(path, run.model, opt, build_scheduler(opt, OPTIM))


@pytest.mark.parametrize("change, was, now", [
    ({"rank": 8}, "lora.rank=4", "lora.rank=8"),
    ({"alpha": 16.0}, "lora.alpha=8.0", "lora.alpha=16.0"),
    ({"targets": ["q_proj", "o_proj"]}, f"lora.targets=[{','.join(sorted(LORA.targets))}]",
     "lora.targets=[o_proj,q_proj]"),
    ({"rank": 8, "use_rslora": True}, "lora.rank=4, lora.use_rslora=false", "lora.rank=8, lora.use_rslora=true"),
])
def test_resume_with_another_lora_config_names_both_and_is_not_called_corrupt(base, tmp_path, change, was, now):
    """A changed lora.rank (alpha, targets) is a config mismatch, not a damaged checkpoint: resuming from an
    earlier checkpoint of the same run would fail the same way."""
    run = Run(base)
    run.save(tmp_path, 1)
    second = run.save(tmp_path, 2)
    other = copy.deepcopy(base)
    apply_lora(other, LoRAConfig(**{**vars(LORA), **change}))
    params = lora_parameters(other)
    opt = build_optimizer(params, OPTIM)
    before = {k: p.detach().clone() for k, p in params.items()}
    with pytest.raises(ResumeError) as err:
        load_checkpoint(second, other, opt, build_scheduler(opt, OPTIM))
    assert str(err.value) == (f"{second}: the checkpoint was written with {was} and this run is configured with "
                              f"{now}; set {was} to resume from it, or start a new run in another run_dir (its "
                              "adapter and optimizer state hold the LoRA it was written with)")
    assert "earlier" not in str(err.value) and "previous" not in str(err.value)
    assert all(torch.equal(p, before[k]) for k, p in params.items())  # nothing was loaded
    run.load(second)  # the run's own LoRA config resumes


# ---- resume setting ------------------------------------------------------------------------------------
def test_resolve_resume(base, tmp_path):
    assert resolve_resume("auto", tmp_path) is None
    assert resolve_resume("none", tmp_path) is None and resolve_resume("", tmp_path) is None
    path = Run(base).save(tmp_path, 4)
    assert resolve_resume("auto", tmp_path) == path
    assert resolve_resume(str(path), tmp_path) == path
    assert resolve_resume("none", tmp_path) is None
    missing = tmp_path / "checkpoints" / "step_00000099"
    with pytest.raises(ResumeError, match=f"resume={missing}: .*does not exist"):
        resolve_resume(str(missing), tmp_path)
    with pytest.raises(ValueError, match="is not a checkpoint directory"):
        resolve_resume(str(tmp_path), tmp_path)


# ---- the old one-process layout ---------------------------------------------------------------------------
OLD_LAYOUT_MESSAGE = (r"a checkpoint in the one-process layout of before \(optimizer.pt and rng.pt beside adapter/, no "
                      r"mesh.json\); .* cannot resume it: start a new run")


def _old_layout(path):
    """`path` (a checkpoint of this layout) rewritten in the one-process layout of before."""
    own = path / "rank-00000"
    for name in ("optimizer.pt", "rng.pt"):
        (own / name).rename(path / name)
    ckpt.shutil.rmtree(own)
    (path / "mesh.json").unlink()
    return path


def test_a_checkpoint_in_the_old_one_process_layout_is_refused_saying_what_it_is(base, tmp_path):
    run = Run(base)
    old = _old_layout(run.save(tmp_path, 1))
    before = run.snapshot()
    with pytest.raises(ResumeError, match=rf"^{old}: {OLD_LAYOUT_MESSAGE}"):
        run.load(old)
    _assert_identical(before, run.snapshot())
    with pytest.raises(ResumeError, match=rf"^{old}: {OLD_LAYOUT_MESSAGE}"):  # auto does not start over silently
        resolve_resume("auto", tmp_path)
    assert resolve_resume("none", tmp_path) is None
