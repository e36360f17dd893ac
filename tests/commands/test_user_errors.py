"""A new user's first mistakes fail at once with one line naming the field and the fix, before any data or model
loads: device=cuda without CUDA, a generation budget that fills the engine's context, rollout.group_size=1 (no
GRPO signal); `python -m miles_k3.eval` evaluates the shipped base by default; `python -m miles_k3.grade` names
the file and line of a non-UTF-8 row and cannot lose its summary to a lone surrogate or an unwritable --out.

Entry points run as subprocesses where the user's view matters: exit status, no traceback, and the last stderr
line `miles_k3.<prog>: <field>: ...`.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from miles_k3.config import ConfigFieldError, compose_config
from miles_k3.grade import main as grade_main
from miles_k3.trainer.rollouts import RolloutConfig


def _entry(prog: str, *overrides: str, cwd=None, timeout: int = 300, env=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})}
    return subprocess.run([sys.executable, "-m", f"miles_k3.{prog}", *overrides], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=timeout, check=False)


def _assert_user_error(proc: subprocess.CompletedProcess, prog: str, message: str, status: int = 1) -> None:
    assert proc.returncode == status and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(f"miles_k3.{prog}: {message}"), proc.stderr[-3000:]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


# ---- the entry points, as a user runs them ---------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("prog, overrides, message", [
    # the data file is missing too: the device is checked first, with the config, before any data loads
    ("train", ["device=cuda", "steps=1", "data.source={tmp}/missing.jsonl"],
     "device: cuda but CUDA is not available here ("),
    ("eval", ["device=cuda", "eval.data.source={tmp}/missing.jsonl"],
     "device: cuda but CUDA is not available here ("),
    # a prompt too long for the context with the budget: found before generating, one line as well
    ("eval", ["eval.data.source={tmp}/p.jsonl", "eval.max_new_tokens=2040", "eval.template=boxed", "device=cpu"],
     "problem 0: its prompt is "),
])
def test_entry_points_refuse_bad_settings_with_one_line(prog, overrides, message, tmp_path):
    _write_jsonl(tmp_path / "p.jsonl", [{"problem": "12+5=", "answer": "17"}])
    proc = _entry(prog, *[o.format(tmp=tmp_path) for o in overrides], f"run_dir={tmp_path}/out",
                  f"hydra.run.dir={tmp_path}/hydra", env={"CUDA_VISIBLE_DEVICES": ""})
    _assert_user_error(proc, prog, message)
    if "prompt is" in message:
        assert "with eval.max_new_tokens=2040 that exceeds the engine's max_context=2048" in proc.stderr
    if message.startswith("device"):
        assert proc.stderr.strip().splitlines()[-1].endswith("; use device=cpu or device=auto")


@pytest.mark.parametrize("overrides, message", [
    (["rollout.max_new_tokens=64"],  # the quickstart's engine.max_context is 64
     "rollout.max_new_tokens: 64 leaves no room for the prompt in engine.max_context=64"),
    (["rollout.group_size=1"], "rollout.group_size: must be >= 2, got 1: GRPO-family advantages"),
    (["kernels.mxfp4_experts=triton"],  # the quickstart runs on the CPU
     "kernels.mxfp4_experts: triton is a CUDA kernel and device=cpu runs on the CPU here; use "),
])
def test_the_quickstart_refuses_bad_settings_with_the_config(overrides, message):
    """More of the refusals above, each in the config train composes (`config.to_typed`, which its main runs
    before anything loads: typed_or_exit); the entry point's one-line exit for such an error is the device case
    above, run as a user runs it."""
    with pytest.raises(ConfigFieldError) as err:
        compose_config("train", overrides)
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)


OLD_NAMES = [
    ("eval", "output_dir=x", "output_dir", "EvalRunConfig", None),  # renamed run_dir
    ("sft", "output_dir=x", "output_dir", "SFTConfig", None),
    ("train", "rollout.backend=sglang", "rollout.backend", "RolloutConfig", None),  # now engine.backend
    ("eval", "backend=sglang", "backend", "EvalRunConfig", None),
    ("train", "sync.transport=local", "sync.transport", "WeightSyncConfig", None),  # removed with ipc/dist
    # the engine's kept state of a multi-turn conversation ("session" is the server's conversation)
    ("train", "engine.session_snapshot_bytes=1024", "engine.session_snapshot_bytes", "EngineConfig",
     "engine.state_snapshot_bytes"),
]


def _added_refusal(key: str, schema: str) -> str:
    return f"{key}: not a field of {schema}, so it would do nothing; remove the +{key} override"


@pytest.mark.parametrize("prog, override, key, schema, new", OLD_NAMES)
def test_old_names_fail_naming_the_key(prog, override, key, schema, new, monkeypatch, tmp_path):
    """run_dir and engine.backend are the one name of each in train, eval and sft: an old name is refused before
    Hydra composes (one line naming the key, not Hydra's advice to add it with a +: `cli.check_overrides`, run
    here by the command's own main), before anything is written; added with a +, by the config's validation
    (`config.to_typed`, as the command composes it). A renamed key's message names the new one. In-process;
    test_an_old_name_fails_on_the_command_line runs one of them as a user does."""
    import importlib

    main = importlib.import_module(f"miles_k3.{prog}").main
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [f"miles_k3.{prog}", override])
    with pytest.raises(SystemExit) as refused:
        main()
    message = str(refused.value)
    assert message.startswith(f"miles_k3.{prog}: {key}: not a field of ") and "\n" not in message, message
    assert f"+{key}" not in message and "Could not override" not in message
    assert not list(tmp_path.iterdir())
    # Hydra's message suggests +KEY=VALUE, which adds the key: refused too (OmegaConf would drop it silently)
    with pytest.raises(ConfigFieldError) as added:
        compose_config(prog, [f"+{override}"])
    assert str(added.value).startswith(_added_refusal(key, schema)), str(added.value)
    if new is not None:
        assert f"; did you mean {new}?" in message and f"; did you mean {new}?" in str(added.value)


@pytest.mark.slow
def test_an_old_name_fails_on_the_command_line(tmp_path):
    """One of OLD_NAMES as a user runs it, with and without the +: exit status 1, no traceback, one last line
    `miles_k3.train: <key>: ...` naming the new key, nothing written in the working directory."""
    prog, override, key, schema, new = OLD_NAMES[-1]
    proc = _entry(prog, override, cwd=tmp_path)
    _assert_user_error(proc, prog, f"{key}: not a field of ")
    assert f"+{key}" not in proc.stderr and "Could not override" not in proc.stderr
    assert not list(tmp_path.iterdir())
    added = _entry(prog, f"+{override}", f"hydra.run.dir={tmp_path}/hydra", cwd=tmp_path)
    _assert_user_error(added, prog, _added_refusal(key, schema))
    assert f"; did you mean {new}?" in proc.stderr and f"; did you mean {new}?" in added.stderr


@pytest.mark.parametrize("overrides, message", [
    (["data.source=long.jsonl", "eval.every_n_steps=0"],
     ("training problem long: its prompt is 201 tokens, and with rollout.max_new_tokens=8 that exceeds the "
      "engine's max_context=64; raise engine.max_context or lower rollout.max_new_tokens")),
    (["data.source=short.jsonl", "eval.every_n_steps=5", "eval.data.source=long.jsonl",
      "eval.data.problem_field=problem", "eval.data.split=null"],
     ("eval problem long: its prompt is 201 tokens, and with eval.max_new_tokens=8 that exceeds the engine's "
      "max_context=64; raise engine.max_context or lower eval.max_new_tokens")),
])
def test_a_prompt_too_long_for_the_context_fails_when_the_data_loads(overrides, message, tmp_path):
    """The quickstart (engine.max_context=64, 8 new tokens) with one 200-character problem: one line naming the
    problem, its prompt's tokens (the equation template adds "=") and the fields, before the model is built (not
    mid-run, as the engine's refusal of the request)."""
    _write_jsonl(tmp_path / "long.jsonl", [{"id": "short", "problem": "1+2", "answer": "3"},
                                           {"id": "long", "problem": "1+" * 100, "answer": "0"}])
    _write_jsonl(tmp_path / "short.jsonl", [{"id": "a", "problem": "1+2", "answer": "3"}])
    proc = _entry("train", *overrides, "data.problem_field=problem", "steps=2", "device=cpu",
                  f"run_dir={tmp_path}/run", cwd=tmp_path)
    _assert_user_error(proc, "train", message)
    assert "parameters, experts" not in proc.stderr  # build_model's line: the model was never built


@pytest.mark.slow
def test_the_readme_eval_command_evaluates_the_shipped_base(tmp_path):
    """`python -m miles_k3.eval eval.data.source=problems.jsonl eval.samples=4` scores the quickstart's trained
    base (not a random init), and says nothing about random weights."""
    _write_jsonl(tmp_path / "problems.jsonl", [{"problem": "12+5=", "answer": "17"},
                                               {"problem": "3+4=", "answer": "7"}])
    proc = _entry("eval", "eval.data.source=problems.jsonl", "eval.samples=4", "device=cpu",
                  f"run_dir={tmp_path}/out", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["model"] == "builtin:k3_nano_chain_sum" and summary["samples_per_problem"] == 4
    assert "random weights" not in proc.stderr


# ---- device ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("app", ["train", "eval", "sft"])
def test_device_cuda_without_cuda_fails_with_the_config(app, no_cuda):
    with pytest.raises(ConfigFieldError, match=r"^device: cuda but CUDA is not available here \((this torch build "
                                               r"has no CUDA|no CUDA device is visible)\); use device=cpu or "
                                               r"device=auto$"):
        compose_config(app, ["device=cuda"])
    with pytest.raises(ConfigFieldError, match=r"^device: cuda:0 but CUDA is not available here"):
        compose_config(app, ["device=cuda:0"])
    assert compose_config(app, ["device=auto"]).device == "auto"


def test_device_index_and_name_are_checked(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert compose_config("eval", ["device=cuda:1"]).device == "cuda:1"
    with pytest.raises(ConfigFieldError, match=r"^device: cuda:2 but this machine has 2 CUDA device\(s\) "
                                               r"\(cuda:0..cuda:1\); use device=cuda:0..cuda:1"):
        compose_config("eval", ["device=cuda:2"])
    for bad in ("cuda:x", "cuda:", "gpu"):
        with pytest.raises(ConfigFieldError, match=rf"^device: '{bad}' is not one of auto, cpu, cuda, cuda:N"):
            compose_config("eval", [f"device={bad}"])


def test_runtime_keeps_its_own_device_check(no_cuda):
    from miles_k3.utils.runtime import resolve_device

    with pytest.raises(ValueError, match="device=cuda but CUDA is not available here; use device=cpu or device=auto"):
        resolve_device("cuda")


# ---- generation budget vs the engine's context -----------------------------------------------------------------
@pytest.mark.parametrize("app, overrides, field, value, limit", [
    ("train", ["rollout.max_new_tokens=64"], "rollout.max_new_tokens", 64, "engine.max_context=64"),
    ("train", ["rollout.max_new_tokens=100"], "rollout.max_new_tokens", 100, "engine.max_context=64"),
    ("train", ["eval.max_new_tokens=64"], "eval.max_new_tokens", 64, "engine.max_context=64"),  # eval every 100
    ("eval", ["eval.max_new_tokens=2048"], "eval.max_new_tokens", 2048, "engine.max_context=2048"),
    ("eval", ["engine.backend=sglang", "model.hf_path=/ckpt/qwen3", "sglang.context_length=512"], "eval.max_new_tokens",
     1024, "sglang.context_length=512"),
    ("sft", ["eval.every_n_steps=10", "eval.max_new_tokens=2048"], "eval.max_new_tokens", 2048,
     "engine.max_context=2048"),
])
def test_max_new_tokens_must_leave_room_for_a_prompt(app, overrides, field, value, limit):
    with pytest.raises(ConfigFieldError) as err:
        compose_config(app, overrides)
    limit_name = limit.split("=")[0]
    assert str(err.value) == (f"{field}: {value} leaves no room for the prompt in {limit} (a request holds its "
                              f"prompt plus up to {field} tokens); raise {limit_name} to at least the longest "
                              f"prompt + {value}, or lower {field}")


@pytest.mark.parametrize("app, overrides", [
    ("train", ["rollout.max_new_tokens=63"]),  # a 1-token prompt fits; longer prompts are checked as they run
    ("train", ["eval.every_n_steps=0", "eval.max_new_tokens=64"]),  # no eval: its budget does not matter
    ("sft", ["eval.max_new_tokens=4096"]),  # sft evaluates only with eval.every_n_steps > 0
    ("eval", ["engine.backend=sglang", "model.hf_path=/ckpt/qwen3", "eval.max_new_tokens=100000"]),  # the checkpoint's
])
def test_budgets_that_fit_or_are_checked_later_are_accepted(app, overrides):
    compose_config(app, overrides)


# ---- group size --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("advantage", ["grpo", "dr_grpo", "rloo"])
def test_group_size_1_is_refused_for_every_advantage(advantage):
    with pytest.raises(ValueError, match=r"^group_size: must be >= 2, got 1: GRPO-family advantages \(grpo/dr_grpo/"
                                         r"rloo\) compare each sample with the other samples of its prompt, so a "
                                         r"group of one has advantage 0 and no step trains; set "
                                         r"rollout.group_size=2 or more"):
        RolloutConfig(group_size=1, advantage=advantage).validate()
    RolloutConfig(group_size=2, advantage=advantage).validate()


# ---- python -m miles_k3.grade -------------------------------------------------------------------------------------
@pytest.fixture
def gold(tmp_path):
    return _write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "problem": "x", "answer": "7"},
                                               {"id": "b", "problem": "y", "answer": "8"}])


@pytest.mark.slow
def test_grade_with_a_lone_surrogate_writes_its_reports_and_prints_the_summary(gold, tmp_path):
    resp = _write_jsonl(tmp_path / "r.jsonl", [{"id": "a", "response": "\\boxed{7} \ud800"},
                                               {"id": "b", "response": "\\boxed{9}"}])
    proc = _entry("grade", "--data", str(gold), "--responses", str(resp), "--out", str(tmp_path / "o"))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["avg@1"] == pytest.approx(0.5)
    rows = [json.loads(x) for x in (tmp_path / "o/results.jsonl").read_text(encoding="utf-8").splitlines()]
    assert rows[0]["response"] == "\\boxed{7} \ud800" and rows[0]["score"] == 1.0


def test_grade_names_the_file_and_line_of_bad_utf8(gold, tmp_path):
    resp = tmp_path / "r.jsonl"
    bad_line = b'{"id": "b", "response": "caf\xe9"}'  # latin-1, not UTF-8
    resp.write_bytes(b'{"id": "a", "response": "7"}\n' + bad_line + b"\n")
    at = bad_line.index(b"\xe9") + 1
    proc = _entry("grade", "--data", str(gold), "--responses", str(resp))
    _assert_user_error(proc, "grade", f"{resp} line 2: not UTF-8 (byte 0xe9 at byte {at} of the line: invalid "
                                      "continuation byte); save the file as UTF-8", status=2)
    assert proc.stdout == ""


def test_grade_errors_name_the_data_line_and_the_json_column(gold, tmp_path, capsys):
    bad_gold = tmp_path / "g.jsonl"
    bad_line = b'{"id": "b", "problem": "\xff", "answer": "8"}'
    bad_gold.write_bytes(b'{"id": "a", "problem": "x", "answer": "7"}\n\n' + bad_line + b"\n")
    good = _write_jsonl(tmp_path / "ok.jsonl", [{"id": "a", "response": "7"}])
    at = bad_line.index(b"\xff") + 1
    assert grade_main(["--data", str(bad_gold), "--responses", str(good)]) == 2
    assert capsys.readouterr().err == (f"miles_k3.grade: {bad_gold} line 3: not UTF-8 (byte 0xff at byte {at} of "
                                       "the line: invalid start byte); save the file as UTF-8\n")
    (tmp_path / "j.jsonl").write_text('{"id": "a", "response": "7"}\n{"id": "b" "response": "8"}\n')
    assert grade_main(["--data", str(gold), "--responses", str(tmp_path / "j.jsonl")]) == 2
    assert f"{tmp_path / 'j.jsonl'} line 2: not valid JSON (Expecting ',' delimiter at column 12)" in \
        capsys.readouterr().err


def test_grade_prints_the_summary_even_when_out_cannot_be_written(gold, tmp_path, capsys):
    resp = _write_jsonl(tmp_path / "r.jsonl", [{"id": "a", "response": "\\boxed{7}"}, {"id": "b", "response": "8"}])
    (tmp_path / "file").write_text("not a directory")
    assert grade_main(["--data", str(gold), "--responses", str(resp), "--out", str(tmp_path / "file/o")]) == 1
    out, err = capsys.readouterr()
    assert json.loads(out)["num_problems"] == 2
    assert err.startswith(f"miles_k3.grade: --out {tmp_path / 'file/o'}: the reports could not be written (")


# ---- the engine's filtered log-probs in the loss -------------------------------------------------------------------
SGLANG_QWEN = ["engine.backend=sglang", "model.hf_path=/ckpt/qwen3"]


@pytest.mark.parametrize("overrides, field", [
    (["rollout.top_p=0.9", "trainer.old_logprobs=rollout"], "trainer.old_logprobs=rollout"),
    (["rollout.top_k=20", "trainer.loss.tis=token_truncate"], "trainer.loss.tis=token_truncate"),
])
def test_sglang_filtered_sampling_is_refused_where_its_logprobs_enter_the_loss(overrides, field):
    with pytest.raises(ConfigFieldError, match=rf"^{field}: with engine.backend=sglang and rollout.top_p=.* the "
                                               r"engine's log-probs are of the filtered distribution .* set "
                                               r"rollout.top_p=1.0 rollout.top_k=-1, or engine.backend=native"):
        compose_config("train", SGLANG_QWEN + overrides)


@pytest.mark.parametrize("overrides", [
    SGLANG_QWEN + ["rollout.top_p=0.9"],  # recompute, no TIS: the engine's log-probs only feed metrics
    SGLANG_QWEN + ["trainer.old_logprobs=rollout"], SGLANG_QWEN + ["trainer.loss.tis=token_truncate"],  # unfiltered
    ["rollout.top_k=20", "trainer.old_logprobs=rollout"], ["rollout.top_p=0.9", "trainer.loss.tis=seq_mask"],  # native
])
def test_engine_logprobs_of_the_whole_vocabulary_are_accepted(overrides):
    compose_config("train", overrides)
