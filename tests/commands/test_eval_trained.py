"""`python -m miles_k3.eval adapter=DIR` evaluates a model as it was trained: eval.template, eval.grader and eval.data
that the command line leaves unset come from the run's config.yaml beside the adapter (a training checkpoint's
step_N/), or from the recipe that made a shipped base; explicit overrides and recipes win; an adapter from elsewhere
keeps the defaults. A missing adapter is one line naming the path, for eval and serve.

The quickstart run is built without training: the shipped base with a fresh LoRA (B = 0, so it answers as the base)
saved where training saves it, beside the quickstart's composed config."""
import json
import logging
import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf
from trained_run_helpers import BASE, save_run, train_yaml

from miles_k3.config import ConfigFieldError
from miles_k3.eval import check_adapter, compose_eval, run, trained_settings

SMALL = ["device=cpu", "engine.memory_budget_bytes=8388608"]
PROBLEMS = [{"id": "a", "problem": "15-43-75", "answer": "-103"}, {"id": "b", "problem": "12+5", "answer": "17"},
            {"id": "c", "problem": "8-31", "answer": "-23"}]


@pytest.fixture(scope="module")
def quickstart_adapter(tmp_path_factory):
    return save_run(tmp_path_factory.mktemp("quickstart"), train_yaml("steps=1"))


def _problems(tmp_path):
    path = tmp_path / "problems.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in PROBLEMS))
    return path


def test_an_adapter_is_evaluated_with_its_runs_template_grader_and_data(quickstart_adapter, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="miles_k3.eval"):
        cfg = compose_eval([f"adapter={quickstart_adapter}"])
    assert (cfg.eval.template, cfg.eval.grader) == ("equation", "integer")
    data = cfg.eval.data
    assert (data.source, data.split, data.size, data.problem_field) == ("reasoning_gym:chain_sum", "test", 300,
                                                                       "metadata.expression")
    assert data.task_args == {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("evaluated as trained")]
    assert f"the adapter's run config {quickstart_adapter.parent / 'config.yaml'}" in line
    assert "eval.template=equation (its eval.template), eval.grader=integer (its eval.grader), " \
           "eval.data.source=reasoning_gym:chain_sum split=test (its eval.data)" in line
    # your own file: the run's template and grader, none of its data fields (problem_field is the file's own)
    cfg = compose_eval([f"adapter={quickstart_adapter}", f"eval.data.source={_problems(tmp_path)}"])
    assert (cfg.eval.template, cfg.eval.grader, cfg.eval.data.problem_field) == ("equation", "integer", None)
    # explicit overrides win, and other eval.data.* overrides apply on top of the run's data
    cfg = compose_eval([f"adapter={quickstart_adapter}", "eval.template=plain", "eval.data.limit=7",
                        "+eval.data.task_args.allow_negation=true"])
    assert (cfg.eval.template, cfg.eval.grader, cfg.eval.data.source) == ("plain", "integer", "reasoning_gym:chain_sum")
    assert cfg.eval.data.limit == 7 and cfg.eval.data.task_args["allow_negation"] is True
    assert cfg.eval.data.task_args["max_terms"] == 3
    # a recipe's fields are explicit too
    cfg = compose_eval([f"adapter={quickstart_adapter}", "recipe=aime_eval"])
    assert (cfg.eval.template, cfg.eval.grader, cfg.eval.data.source) == ("chat", "aime", "HuggingFaceH4/aime_2024")


def test_the_shipped_base_and_adapters_from_elsewhere(tmp_path):
    """No adapter: the shipped base's recipe (chain_sum_base); an adapter with no run config beside it, or a base
    that is not shipped: today's defaults."""
    cfg = compose_eval([])
    assert (cfg.model.path, cfg.eval.template, cfg.eval.grader) == (BASE, "equation", "integer")
    assert (cfg.eval.data.source, cfg.eval.data.split) == ("reasoning_gym:chain_sum", "test")
    cfg = compose_eval([f"adapter={save_run(tmp_path / 'elsewhere', None)}"])
    assert (cfg.eval.template, cfg.eval.grader, cfg.eval.data.source) == ("boxed", "aime", "HuggingFaceH4/aime_2024")
    cfg = compose_eval(["model=k3_tiny"])
    assert (cfg.eval.template, cfg.eval.grader) == ("boxed", "aime")


def test_a_run_that_did_not_evaluate_gives_its_rollout_template_and_reward():
    own_file = OmegaConf.create(train_yaml("eval.every_n_steps=0", "rollout.template=boxed", "reward=aime",
                                           "data.source=problems.jsonl", "data.problem_field=null"))
    assert {k: (v, key) for k, (v, key) in trained_settings(own_file).items()} == {
        "template": ("boxed", "rollout.template"), "grader": ("aime", "reward.name")}  # no held-out data to take
    task = trained_settings(OmegaConf.create(train_yaml("eval.every_n_steps=0")))
    assert task["template"] == ("equation", "rollout.template") and task["grader"] == ("integer", "reward.name")
    assert (task["data"][0].source, task["data"][0].split, task["data"][0].seed) == ("reasoning_gym:chain_sum",
                                                                                    "test", 1000000)
    multi_turn = OmegaConf.create({"env": {"name": "guess"}, "rollout": {"template": "plain"}})
    assert trained_settings(multi_turn) == {}


def test_the_quickstart_adapter_scores_real_answers_on_a_file(quickstart_adapter, tmp_path):
    """Issue 57: `eval.data.source=FILE adapter=<quickstart adapter>` scored 0% with "no final answer" everywhere
    (the boxed template and the AIME grader); evaluated as trained, every sample is an integer answer."""
    cfg = compose_eval([f"adapter={quickstart_adapter}", f"eval.data.source={_problems(tmp_path)}", "eval.samples=2",
                        f"run_dir={tmp_path}/out", *SMALL])
    summary = run(cfg)
    assert summary["answer_rate"] > 0.5, summary
    rows = [json.loads(x) for x in (tmp_path / "out/results.jsonl").read_text().splitlines()]
    assert rows[0]["prompt"] == "15-43-75="
    assert any(r["reason"] != "no final answer" for r in rows)
    assert all(r["response"] == str(int(r["response"])) for r in rows if r["extracted"] is not None)  # bare integers


def test_a_missing_adapter_is_one_line_naming_the_path(tmp_path):
    """eval and serve (as subprocesses: the user's view) exit 1 with one line, no traceback."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    procs = {prog: subprocess.Popen([sys.executable, "-m", f"miles_k3.{prog}", f"adapter={tmp_path}/no/such/dir",
                                     "device=cpu", *([f"run_dir={tmp_path}/out"] if prog == "eval" else [])],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
             for prog in ("eval", "serve")}
    for prog, proc in procs.items():
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 1 and "Traceback" not in err, err[-3000:]
        assert err.strip().splitlines()[-1] == (
            f"miles_k3.{prog}: adapter: {tmp_path}/no/such/dir does not exist; give a PEFT adapter directory (it "
            "holds adapter_config.json), e.g. a training run's <run_dir>/checkpoints/step_N/adapter, or no adapter "
            "for the base alone"), err[-3000:]


def test_a_run_directory_for_an_adapter_names_the_adapter_inside(quickstart_adapter):
    run_dir = quickstart_adapter.parents[2]
    with pytest.raises(ConfigFieldError, match=rf"^adapter: {run_dir} holds no adapter_config.json, so it is not an "
                                               rf"adapter directory; did you mean adapter={quickstart_adapter}\?$"):
        check_adapter(str(run_dir))
    with pytest.raises(ConfigFieldError, match=rf"^adapter: {quickstart_adapter.parent} holds no .*; did you mean "
                                               rf"adapter={quickstart_adapter}\?$"):
        check_adapter(str(quickstart_adapter.parent))
    check_adapter(str(quickstart_adapter))
    check_adapter(None)
