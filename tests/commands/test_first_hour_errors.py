"""A new user's first hour, the errors and summaries of issue 57 item 4: a misspelled key is refused with the closest
field names (not Hydra's "+key" advice) by every entry point; a hub dataset fails in seconds when the hub cannot be
reached; a resumed run's summary compares with step 0's eval from metrics.jsonl; a step whose reward no grader gave
prints accuracy=-; httpx's per-request INFO lines are off in an entry point; rollout.mode=partial alone composes,
with the importance weight the docs recommend."""
import json
import logging
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import httpx
import pytest

from miles_k3.cli import HTTP_LOGGERS, check_overrides, closest_fields, field_hint, hydra_app, quiet_http_logs
from miles_k3.config import ConfigFieldError, TrainConfig, compose_config, register_schemas
from miles_k3.evals.datasets import DatasetConfig, hub_unreachable, load_problems
from miles_k3.evals.problems import DatasetError
from miles_k3.evals.rewards import RewardResult, register_reward
from miles_k3.train import format_summary

register_schemas()


# ---- a key that is not a field ---------------------------------------------------------------------------------
@pytest.mark.parametrize("key, hint", [
    ("rollout.prompt_per_step", ("rollout.prompt_per_step: not a field of rollout; did you mean "
                                 "rollout.prompts_per_step?")),
    ("trainr.lr", "trainr.lr: trainr is not a section of the config; did you mean trainer.optim.lr?"),
    ("trainer.optim.lrr", "trainer.optim.lrr: not a field of trainer.optim; did you mean trainer.optim.lr?"),
    ("rollout.backend", "rollout.backend: not a field of rollout; did you mean engine.backend?"),  # another section
    ("stepz", "stepz: not a field of the config; did you mean steps?"),
    ("xyzzy", "xyzzy: not a field of the config"),  # nothing close: no suggestion
])
def test_a_key_that_is_not_a_field_names_the_closest_fields(key, hint):
    assert field_hint(TrainConfig, key) == hint


@pytest.mark.parametrize("key", ["rollout.prompts_per_step", "model", "data.task_args.max_terms", "trainer.optim.lr",
                                 "eval.data.source"])
def test_fields_and_free_form_dict_keys_pass(key):
    assert field_hint(TrainConfig, key) is None  # data.task_args is a free-form dict: its keys are the user's


@pytest.mark.parametrize("module, prog", [("train", "miles_k3.train"), ("eval", "miles_k3.eval"),
                                          ("sft", "miles_k3.sft"), ("serve", "miles_k3.serve")])
def test_every_entry_point_refuses_a_misspelled_key_before_hydra_composes(module, prog, monkeypatch, tmp_path):
    """The check runs in each command's main before hydra.main: nothing is composed or written."""
    import importlib

    main = importlib.import_module(f"miles_k3.{module}").main
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [prog, "seed=1", "engine.max_contxt=64"])  # every command has engine.*
    with pytest.raises(SystemExit) as done:
        main()
    assert str(done.value) == (f"{prog}: engine.max_contxt: not a field of engine; did you mean engine.max_context? "
                               f"(python -m {prog} --help; --cfg job prints every field)")
    assert not list(tmp_path.iterdir())


def test_groups_hydra_keys_and_additions_are_left_to_hydra():
    check_overrides("miles_k3.train", "train", ["recipe=quickstart", "model=k3_tiny", "hydra.verbose=true",
                                                "hydra/job_logging=disabled", "+data.task_args.x=1", "--cfg", "job",
                                                "model@x=k3_tiny"], "")


def test_an_added_key_is_refused_with_the_closest_field():
    with pytest.raises(ConfigFieldError, match=r"^rollout.prompt_per_step: not a field of RolloutConfig, so it would do "
                                               r"nothing; remove the \+rollout.prompt_per_step override; did you mean "
                                               r"rollout.prompts_per_step\?"):
        compose_config("train", ["+rollout.prompt_per_step=8"])
    assert closest_fields(TrainConfig, "lora.rnk") == ["lora.rank"]


def test_the_command_line_gets_one_line_not_hydras_advice(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "miles_k3.train", "rollout.prompt_per_step=8"], capture_output=True,
                          text=True, cwd=tmp_path, timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"},
                          check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and "+rollout" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        ("miles_k3.train: rollout.prompt_per_step: not a field of rollout; did you mean rollout.prompts_per_step? "
         "(python -m miles_k3.train --help; --cfg job prints every field)")]
    assert not list(tmp_path.iterdir())


# ---- a hub dataset without the hub -------------------------------------------------------------------------------
def test_a_hub_dataset_fails_in_seconds_when_the_hub_is_unreachable(monkeypatch, tmp_path):
    """HF_ENDPOINT at a closed port (what the variable sets: huggingface_hub's ENDPOINT) and an empty cache: one
    probe, then the local cache in offline mode, then the error; `datasets` alone retries for ~30 s."""
    import datasets
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    offline = datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE
    start = time.perf_counter()
    with pytest.raises(DatasetError) as failed:
        load_problems(DatasetConfig(source="HuggingFaceH4/aime_2024"))
    assert time.perf_counter() - start < 5
    assert str(failed.value).startswith("data.source: hub dataset 'HuggingFaceH4/aime_2024' split 'train' is not in "
                                        "the local datasets cache and the Hugging Face hub cannot be reached "
                                        "(http://127.0.0.1:9: ")
    assert "eval.data.source=/path/file.jsonl" in str(failed.value)
    assert (datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE) == offline  # the modes are restored


def test_a_hub_that_answers_is_reachable_whatever_the_status(monkeypatch):
    class NotFound(BaseHTTPRequestHandler):
        def do_HEAD(self):
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass

    from huggingface_hub import constants

    server = HTTPServer(("127.0.0.1", 0), NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.server_port}")
        assert hub_unreachable() is None
    finally:
        server.shutdown()
        server.server_close()
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    assert "Connection refused" in hub_unreachable()


# ---- the summary of a resumed run --------------------------------------------------------------------------------
@register_reward("first_hour_half")
def _half(cfg):
    return lambda responses, golds: [RewardResult(0.5, False, {}) for _ in responses]


def _train_overrides(tmp_path, *extra) -> list[str]:
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "problem": f"{i}+{i}=", "answer": str(2 * i)}) + "\n"
                            for i in range(4)))
    return [f"data.source={data}", "data.problem_field=null", f"eval.data.source={data}", "eval.data.split=null",
            "eval.data.problem_field=null", "eval.every_n_steps=1", "eval.at_start=true", f"run_dir={tmp_path}/run",
            "model=k3_tiny", "model.path=null", "rollout.prompts_per_step=2", "rollout.group_size=2",
            "rollout.max_new_tokens=2", "rollout.template=plain", "rollout.dynamic_sampling=false",
            "reward.name=first_hour_half", "engine.max_context=64", "engine.memory_budget_bytes=4194304", "lora.rank=2",
            "trainer.optim.total_steps=null", *extra]


@pytest.mark.slow
def test_a_resumed_runs_summary_starts_from_step_0s_eval(tmp_path, monkeypatch):
    """Step 1 with evals at 0 and 1, then resume=auto to step 2 (eval at 2): the resumed process's summary compares
    step 2 with step 0's eval of the base, which only metrics.jsonl holds. The eval is stood in for by one that
    logs avg@1 = step / 100 the way the harness logs (the loop, the log and the resume are the real ones)."""
    from miles_k3.evals.harness import EvalHook
    from miles_k3.train import train

    def maybe_run(self, step, lora, force=False):
        if not (force or self.due(step)):
            return None
        metrics = {"eval/avg@1": step / 100, "eval/answer_rate": 1.0 - step / 100}
        self.tracker.log(metrics, step=step)
        return metrics

    monkeypatch.setattr(EvalHook, "maybe_run", maybe_run)
    first = train(compose_config("train", _train_overrides(tmp_path, "steps=1")))
    assert (first.summary["accuracy_before_step"], first.summary["accuracy_after_step"]) == (0, 1)
    resumed = train(compose_config("train", _train_overrides(tmp_path, "steps=2", "resume=auto")))
    s = resumed.summary
    assert (s["first_step"], s["last_step"], s["accuracy_before_step"], s["accuracy_after_step"]) == (2, 2, 0, 2)
    assert (s["accuracy_before"], s["accuracy_after"], s["answer_rate_before"]) == (0.0, 0.02, 1.0)
    assert "held-out avg@1: 0.0% (step 0) -> 2.0% (step 2), +2.0 points" in format_summary(s)


def test_logged_evals_are_the_eval_rows_up_to_the_checkpoint(tmp_path):
    from miles_k3.utils.tracking import logged_evals

    rows = [{"step": 0, "eval/avg@4": 0.25, "eval/answer_rate": "nan"}, {"step": 1, "train/loss": 0.1},
            {"step": 2, "eval/avg@4": 0.5}, {"step": 3, "eval/avg@4": 0.75}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "ev')
    assert logged_evals(tmp_path, 2) == {0: {"eval/avg@4": 0.25}, 2: {"eval/avg@4": 0.5}}
    assert logged_evals(tmp_path / "none", 2) == {}


# ---- the step line of a multi-turn step -------------------------------------------------------------------------
def test_a_step_no_sample_of_which_the_reward_graded_prints_no_accuracy():
    """env=guess: the environment gives every episode's reward, so the run's reward graded nothing; the step logs
    no rollout/accuracy (it would read 0.0% beside reward 0.34) and the line prints accuracy=-."""
    from miles_k3.train import step_line
    from miles_k3.trainer.scoring import rollout_metrics as _metrics

    totals = {"samples": 8, "reward": 2.75, "reward_failed": 0, "response_len": 40, "truncated": 0, "gaps": 0,
              "gap": 0.0, "graded": 0, "timeouts": 0, "errors": 0, "correct": 0}
    counts = {"groups_kept": 2, "groups_drawn": 2, "rounds": 1, "flat": 0}
    m = _metrics(totals, counts)
    assert "rollout/accuracy" not in m and m["rollout/reward_mean"] == pytest.approx(0.34375)
    assert step_line(3, 10, m).startswith("step 3/10 reward=0.3438 accuracy=- loss=-")
    graded = _metrics(totals | {"graded": 8, "correct": 2}, counts)  # one turn graded by the reward: as before
    assert graded["rollout/accuracy"] == 0.25 and "accuracy=25.0%" in step_line(3, 10, graded)


# ---- httpx's request lines ---------------------------------------------------------------------------------------
@pytest.fixture
def http_loggers():
    loggers = [logging.getLogger(name) for name in HTTP_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.NOTSET)
    yield
    for lg, level in zip(loggers, levels):
        lg.setLevel(level)


def _request() -> None:
    with httpx.Client(transport=httpx.MockTransport(lambda r: httpx.Response(200))) as client:
        client.post("http://127.0.0.1/episodes/x/v1/chat/completions", json={})


def test_an_entry_point_logs_no_httpx_request_lines(http_loggers, monkeypatch, tmp_path):
    """Through hydra_app (the entry points' decorator), after Hydra has configured logging: an agent's request
    through httpx writes no INFO record."""
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record)

    def task(raw):
        logging.getLogger("httpx").addHandler(keep := Keep())
        try:
            _request()
        finally:
            logging.getLogger("httpx").removeHandler(keep)

    monkeypatch.setattr(sys, "argv", ["miles_k3.train", f"hydra.run.dir={tmp_path}", "hydra.output_subdir=null"])
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        hydra_app("miles_k3.train", "train")(task)()  # Hydra's job logging: the root logger at INFO
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    assert not [r for r in seen if r.levelno < logging.WARNING]
    assert compose_config("train").steps >= 0  # Hydra's global state is free again for the next composition


def test_http_request_lines_stay_when_verbose_asks_for_them(http_loggers, caplog):
    with caplog.at_level(logging.INFO):
        quiet_http_logs()
        _request()
    assert not [r for r in caplog.records if r.name == "httpx"]
    for verbose in ("httpx", True):  # hydra.verbose=httpx sets the logger's level; hydra.verbose=true the root's
        logging.getLogger("httpx").setLevel(logging.DEBUG if verbose == "httpx" else logging.NOTSET)
        caplog.clear()
        with caplog.at_level(logging.DEBUG if verbose is True else logging.INFO):
            quiet_http_logs()
            _request()
        assert [r for r in caplog.records if r.name == "httpx" and r.levelno == logging.INFO], verbose


# ---- rollout.mode=partial alone -----------------------------------------------------------------------------------
def test_partial_mode_alone_composes_with_the_documented_importance_weight():
    """trainer.loss.tis defaults to auto: token_truncate under partial (docs/concepts/off-policy.md), none under
    sync; an explicit choice is kept, an explicit none under partial refused."""
    assert compose_config("train", ["rollout.mode=partial"]).trainer.loss.tis == "token_truncate"
    assert compose_config("train").trainer.loss.tis == "none"
    assert compose_config("train", ["rollout.mode=partial", "trainer.loss.tis=seq_mask"]).trainer.loss.tis == "seq_mask"
    with pytest.raises(ConfigFieldError, match="or leave it unset .auto: token_truncate in partial mode"):
        compose_config("train", ["rollout.mode=partial", "trainer.loss.tis=none"])
