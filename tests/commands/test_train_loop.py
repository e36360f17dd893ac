"""The colocated loop (`miles_k3.train.train`) for 3 steps on k3_tiny (CPU): the adapter changes and the base
does not, weight-sync versions advance with the steps, every metric namespace is logged (metrics.jsonl and a W&B
offline run), the final checkpoint is written. The reward is a test reward on the response bytes (a random base
rarely answers anything), registered like any user reward."""
import json

import pytest
import torch

from miles_k3.config import compose_config
from miles_k3.evals.rewards import RewardResult, register_reward
from miles_k3.model.lora import lora_state_dict


@register_reward("first_byte_even")
def _first_byte_even(cfg):
    def fn(responses, golds):
        return [RewardResult(float(bool(r) and ord(r[0]) % 2 == 0), False, {}) for r in responses]
    return fn


def _overrides(tmp_path, *extra) -> list[str]:
    """The small run's Hydra overrides (its data file written into tmp_path, its run dir tmp_path/run)."""
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "question": f"{i} + {i} = ?", "answer": str(2 * i)}) + "\n"
                            for i in range(6)))
    return ["steps=3", f"data.source={data}", "data.problem_field=null", f"run_dir={tmp_path}/run",
            "model=k3_tiny", "model.path=null", "eval.every_n_steps=0", "rollout.dynamic_sampling=false",
            "trainer.optim.betas=[0.9,0.999]", "reward.name=first_byte_even",
            "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=6", "rollout.template=plain",
            "engine.max_context=128", "engine.memory_budget_bytes=4194304", "trainer.optim.lr=0.01", "lora.rank=4",
            "trainer.optim.total_steps=null", *extra]  # a constant lr: runs of 2 and 3 steps share a schedule


def _cfg(tmp_path, *extra):
    return compose_config("train", _overrides(tmp_path, *extra))


def test_three_steps_train_the_adapter_sync_versions_and_log(tmp_path, monkeypatch):
    from miles_k3.train import train

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = _cfg(tmp_path, "tracking.logger=wandb")
    seen = {}
    from miles_k3 import launch

    real = launch.build_run

    def spy(c):
        run = real(c)
        seen["base"] = {n: t.clone() for n, t in run.model.state_dict().items() if "lora_" not in n}
        seen["adapter"] = {n: t.clone() for n, t in lora_state_dict(run.model).items()}
        return run
    monkeypatch.setattr("miles_k3.train.build_run", spy)
    run = train(cfg, "steps: 3\n")
    rows = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and [r["sync/version"] for r in rows] == [1, 2, 3]
    assert run.engine.weight_version == 3
    for prefix in ("rollout/", "train/", "sync/", "perf/"):
        assert any(k.startswith(prefix) for k in rows[0]), prefix
    assert any(r["train/skipped"] == 0.0 for r in rows)
    after = lora_state_dict(run.model)
    assert any(not torch.equal(after[n], t) for n, t in seen["adapter"].items())
    assert all(torch.equal(t, seen["base"][n]) for n, t in run.model.state_dict().items() if "lora_" not in n)
    engine_bytes = run.engine.adapters.buffers("policy")
    assert all(torch.equal(engine_bytes[n], p.detach()) for n, p in run.params.items())  # the last push landed
    assert (tmp_path / "run/checkpoints/latest").read_text().strip() == "step_00000003"
    assert any(p.name.startswith("offline-run-") for p in (tmp_path / "run/wandb").iterdir())
    assert (tmp_path / "run/curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = [json.loads(x) for x in (tmp_path / "run/tables/rollout_samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in table] == [1] * 4 + [2] * 4 + [3] * 4 and {"prompt", "response"} <= set(table[0])


def test_curves_png_draws_only_the_curve_metrics(tmp_path):
    from miles_k3.utils.tracking import write_curves

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "sync/seconds": 0.1}\n')
    assert write_curves(metrics, tmp_path / "c.png") is None and not (tmp_path / "c.png").exists()
    metrics.write_text('{"step": 1, "rollout/reward_mean": 0.1, "eval/avg@4": 0.2}\n'
                       '{"step": 2, "rollout/reward_mean": 0.3, "train/loss": "nan"}\n')
    assert write_curves(metrics, tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("override, field", [("steps=-1", "steps"), ("keep_checkpoints=0", "keep_checkpoints"),
                                             ("rollout.group_size=0", "rollout.group_size"),
                                             ("trainer.micro_batch_tokens=0", "trainer.micro_batch_tokens"),
                                             ("trainer.loss.eps_low=2", "trainer.loss.eps_low"),
                                             ("rollout.release_tags=[weights]", "rollout.release_tags"),
                                             ("rollout.log_samples=-1", "rollout.log_samples")])
def test_invalid_config_fails_before_any_work_naming_the_field(override, field):
    from miles_k3.config import ConfigFieldError

    with pytest.raises(ConfigFieldError, match=rf"^{field}: "):
        compose_config("train", [override])


def _final_adapter(run_dir):
    from safetensors.torch import load_file

    return load_file(str(run_dir / "checkpoints/step_00000003/adapter/adapter_model.safetensors"))


@pytest.mark.slow
def test_resume_after_a_stop_is_bit_identical_to_an_uninterrupted_run(tmp_path):
    from miles_k3.train import train

    (tmp_path / "a").mkdir()
    train(_cfg(tmp_path / "a", "checkpoint_every=1"))
    (tmp_path / "b").mkdir()
    train(_cfg(tmp_path / "b", "steps=2", "checkpoint_every=1"))
    with open(tmp_path / "b/run/metrics.jsonl", "a") as f:  # what a run killed after logging step 3 leaves
        f.write(json.dumps({"step": 3, "train/loss": 9.0}) + "\n")
    with open(tmp_path / "b/run/tables/rollout_samples.jsonl", "a") as f:
        f.write(json.dumps({"step": 3, "response": "killed"}) + "\n")
    resumed = train(_cfg(tmp_path / "b", "resume=auto"))
    assert resumed.start_step == 2
    assert (resumed.summary["steps"], resumed.summary["first_step"], resumed.summary["last_step"]) == (1, 3, 3)
    a, b = _final_adapter(tmp_path / "a/run"), _final_adapter(tmp_path / "b/run")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = [json.loads(x) for x in (tmp_path / "b/run/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["train/skipped"] == 0.0 for r in rows)
    assert any(r["train/grad_norm"] > 0 for r in rows)  # the updates were real, not zero steps
    table = [json.loads(x) for x in (tmp_path / "b/run/tables/rollout_samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in table] == [1] * 4 + [2] * 4 + [3] * 4 and "killed" not in {r["response"] for r in table}


@pytest.mark.slow
def test_resume_restores_the_checkpoints_weight_version(tmp_path):
    """The version comes from the checkpoint's extra_state, not from the step: a checkpoint of step 2 whose
    adapter is version 7 (edited here; a run whose pushes and steps do not count alike) resumes pushing 8."""
    from miles_k3.train import train
    from miles_k3.trainer.checkpoint import ResumeError

    train(_cfg(tmp_path, "steps=2", "checkpoint_every=1"))
    state_file = tmp_path / "run/checkpoints/step_00000002/state.json"
    state = json.loads(state_file.read_text())
    assert state["extra_state"]["weight_version"] == 2
    state["extra_state"]["weight_version"] = 7
    state_file.write_text(json.dumps(state))
    resumed = train(_cfg(tmp_path, "resume=auto"))
    assert resumed.start_step == 2 and resumed.engine.weight_version == 8 and resumed.version == 8
    rows = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 3 and rows[-1]["sync/version"] == 8
    final = json.loads((tmp_path / "run/checkpoints/step_00000003/state.json").read_text())
    assert final["extra_state"]["weight_version"] == 8
    del state["extra_state"]["weight_version"]
    state_file.write_text(json.dumps(state))
    with pytest.raises(ResumeError, match="extra_state.weight_version must be an int >= 0"):
        train(_cfg(tmp_path, f"resume={state_file.parent}"))


DRIVER = """
import sys
sys.argv = ["miles_k3.train", *sys.argv[1:]]
import test_train_loop  # registers the test reward
from miles_k3.train import main
main()
"""


@pytest.mark.slow
def test_kill_9_mid_run_then_resume_is_bit_identical(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    from miles_k3.train import train

    (tmp_path / "a").mkdir()
    train(_cfg(tmp_path / "a", "checkpoint_every=1"))
    (tmp_path / "b").mkdir()
    overrides = _overrides(tmp_path / "b", "checkpoint_every=1", f"hydra.run.dir={tmp_path}/b/h")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, *overrides], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    latest = tmp_path / "b/run/checkpoints/latest"
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if latest.exists() and latest.read_text().strip() >= "step_00000002":
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
    os.kill(proc.pid, signal.SIGKILL)  # mid-step 3 (or mid-write of its checkpoint)
    proc.wait()
    resumed = train(_cfg(tmp_path / "b", "resume=auto"))
    assert resumed.start_step == 2
    a, b = _final_adapter(tmp_path / "a/run"), _final_adapter(tmp_path / "b/run")
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows = [json.loads(x) for x in (tmp_path / "b/run/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]  # whatever the killed run had logged of step 3 is gone


CHAT_TEMPLATE = ("{% for m in messages %}<|im_{{ m.role }}|>{{ m.content }}<|im_end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|im_assistant|>{% endif %}")


def test_aime_grpo_recipe_scaled_down_trains_on_verl_format_data(tmp_path, monkeypatch):
    """recipe=aime_grpo with the model and sizes made small: DAPO-Math-17k-format rows (the problem at
    prompt.0.content, the answer at reward_model.ground_truth) become prompts and golds, sent as the user turn of
    the checkpoint's chat template (chat_plain), graded by the math reward, and the step's loss runs with the
    recipe's clip bounds, TIS and activation checkpointing."""
    from miles_k3.init_checkpoint import init_checkpoint
    from miles_k3.model.config import K3Config
    from miles_k3.train import train
    from miles_k3.trainer import step as step_module

    ckpt = init_checkpoint(K3Config.from_name("k3_tiny"), tmp_path / "base")
    tok_config = json.loads((ckpt / "tokenizer_config.json").read_text())
    (ckpt / "tokenizer_config.json").write_text(json.dumps({**tok_config, "chat_template": CHAT_TEMPLATE}))
    data = tmp_path / "dapo.jsonl"
    rows = [{"data_source": "math_dapo", "prompt": [{"content": f"Compute {i} + {i}. Answer: $Answer", "role": "user"}],
             "ability": "MATH", "reward_model": {"ground_truth": str(2 * i), "style": "rule-lm"},
             "extra_info": {"index": f"u{i}"}} for i in range(4)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    losses, checkpointed = [], []
    real_loss, real_recompute = step_module.policy_loss, step_module._recompute

    def spy_loss(*args, **kw):
        losses.append((args[4], kw))  # (the LossConfig, the keyword inputs)
        return real_loss(*args, **kw)

    def spy_recompute(model, on):
        checkpointed.append(on)
        return real_recompute(model, on)
    monkeypatch.setattr(step_module, "policy_loss", spy_loss)
    monkeypatch.setattr(step_module, "_recompute", spy_recompute)
    cfg = compose_config("train", [
        "recipe=aime_grpo", "model=k3_tiny", f"model.path={ckpt}", "device=cpu", "steps=1", f"data.source={data}",
        f"run_dir={tmp_path}/run", "rollout.prompts_per_step=2", "rollout.group_size=2",
        "rollout.max_new_tokens=6", "rollout.overlong_buffer=2", "rollout.dynamic_sampling=false", "reward.workers=1",
        "eval.every_n_steps=0", "engine.max_context=128", "engine.memory_budget_bytes=4194304", "lora.rank=4",
        "tracking.logger=none"])
    run = train(cfg, "")
    table = [json.loads(x) for x in (tmp_path / "run/tables/rollout_samples.jsonl").read_text().splitlines()]
    assert table and all(r["prompt"].startswith("<|im_user|>Compute ")
                         and r["prompt"].endswith("Answer: $Answer<|im_end|><|im_assistant|>") for r in table)
    assert {p.answer for p in run.stream.problems} == {"0", "2", "4", "6"}
    assert run.reward.pool.grader == "math"
    loss_cfg, inputs = losses[0]
    assert (loss_cfg.eps_low, loss_cfg.eps_high, loss_cfg.tis, loss_cfg.tis_clip) == (0.2, 0.28, "token_truncate", 2.0)
    assert inputs["rollout_logp_BT"] is not None and checkpointed and all(checkpointed)
    row = json.loads((tmp_path / "run/metrics.jsonl").read_text().splitlines()[0])
    assert "train/tis_weight_mean" in row and row["sync/version"] == 1


def test_filtered_sampling_is_announced_at_start(caplog):
    """top-p / top-k: the run says at start that the engine's log-probs are of the filtered distribution."""
    from miles_k3.launch import _warn_filtered_logprobs
    from miles_k3.trainer.rollouts import RolloutConfig

    with caplog.at_level("WARNING", logger="miles_k3.train"):
        _warn_filtered_logprobs(RolloutConfig(), "native")
    assert caplog.text == ""
    with caplog.at_level("WARNING", logger="miles_k3.train"):
        _warn_filtered_logprobs(RolloutConfig(top_p=0.9), "native")
        _warn_filtered_logprobs(RolloutConfig(top_k=20), "native")
    assert caplog.text.count("the engine reports log-probs of the filtered") == 2
    assert caplog.text.count("and its unfiltered ones, which the loss") == 2
    assert "rollout/logprob_filter_gap" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="miles_k3.train"):
        _warn_filtered_logprobs(RolloutConfig(top_k=20), "sglang")
    assert "SGLang: not the unfiltered ones" in caplog.text


def test_cuda_memory_metrics_name_what_holds_the_device(monkeypatch):
    """A step's CUDA memory figures from torch's allocator counters (stubbed with hand values: no GPU here)."""
    from miles_k3 import train

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (30e9, 80e9))  # (free, total)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: 50.5e9)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 54e9)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda d: {"num_alloc_retries": 7})
    assert train.cuda_memory_metrics(torch.device("cuda")) == {
        "mem/peak_gb": 50.5, "mem/reserved_gb": 54.0, "mem/alloc_retries": 7.0, "mem/device_used_gb": 50.0}
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda d: {})  # an allocator that never retried has no key
    assert train.cuda_memory_metrics(torch.device("cuda"))["mem/alloc_retries"] == 0.0


def test_triton_compile_metrics_count_the_cache_entries_each_phase_added(monkeypatch, tmp_path):
    """Kernels compiled in a step's phases: directories added to Triton's cache dir (one per compiled kernel
    variant) between the timer's laps; files beside them are not kernels, a phase lapped twice adds up, and an
    unreadable cache gives no figures."""
    import triton

    from miles_k3 import train
    from miles_k3.utils import runtime

    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path))
    for key in ("k1", "k2"):
        (tmp_path / key).mkdir()
    (tmp_path / "lockfile").write_text("")
    assert len(runtime.triton_cache_dirs()) == 2
    timer = train._Timer(count_compiles=True)
    (tmp_path / "k3").mkdir()  # one kernel compiled during the rollout
    timer.lap("rollout")
    for key in ("k4", "k5", "k6"):  # three during the train step, two of them variants of one kernel
        (tmp_path / key).mkdir()
    for key in ("k4", "k5"):
        (tmp_path / key / "chunk_fwd.json").write_text("{}")
        (tmp_path / key / "__grp__chunk_fwd.json").write_text("{}")
    timer.lap("train")
    timer.lap("sync")  # none
    (tmp_path / "k7").mkdir()
    timer.lap("train")  # a second train lap adds its one
    m = timer.metrics()
    assert {k: v for k, v in m.items() if k.startswith("perf/triton_new_")} == {
        "perf/triton_new_rollout": 1.0, "perf/triton_new_train": 4.0, "perf/triton_new_sync": 0.0}
    # kernels by the name of their <name>.json (an entry without one yet by its directory), repeats counted once
    # with their number; phases in the order they first compiled
    assert timer.compiled_line() == "rollout 1 (k3), train 4 (chunk_fwd x2, k6, k7)"
    assert train._Timer(count_compiles=True).compiled_line() == ""
    assert runtime.kernel_list(["a", "b", "a", "c"], show=2) == "a x2, b, ..."  # the first 2 distinct, a counted
    assert not any(k.startswith("perf/triton_new_") for k in train._Timer().metrics())  # not counted off CUDA
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path / "absent"))
    assert runtime.triton_cache_dirs() is None
    assert not any(k.startswith("perf/triton_new_") for k in train._Timer(count_compiles=True).metrics())
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path))
    gone = train._Timer(count_compiles=True)  # a cache readable at the start that vanishes mid-step
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path / "absent"))
    gone.lap("rollout")
    assert not any(k.startswith("perf/triton_new_") for k in gone.metrics())

