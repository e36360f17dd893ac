"""The eval harness end to end on CPU: a scripted engine (a test double of `RolloutEngine.generate`, not the
engine) pins down seeds, batching, grading and reports exactly; the real engine on k3_tiny checks the plumbing
(reproducible samples, batching invariance, truncation, an adapter changes what is generated); the
`python -m miles_k3.eval` and `python -m miles_k3.grade` entry points run on files the test writes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from miles_k3.config import compose_config
from miles_k3.evals import harness
from miles_k3.evals.harness import EvalConfig, EvalHook, evaluate, write_reports
from miles_k3.evals.problems import Problem
from miles_k3.grade import main as grade_main
from miles_k3.model.tokenizer import small_tokenizer, stop_token_ids

TOK = small_tokenizer(300)
PROBLEMS = [Problem("p0", "What is 30 + 3?", "033"), Problem("p1", "What is 2 + 5?", "7"),
            Problem("p2", "What is 100 - 1?", "99")]


class ScriptedEngine:
    """Answers problem i's sample with seed s: the gold if s is even, else 500; records every call."""

    max_context = 4096  # as engine.max_context (the native engine's and the SGLang backend's)

    def __init__(self, golds: dict[str, str]):
        self.golds, self.calls = golds, []

    def generate(self, input_ids, sampling_params, n, return_logprob, lora):
        self.calls.append((len(input_ids), n, lora, [p["sampling_seed"] for p in sampling_params]))
        out = []
        for ids, sp in zip(input_ids, sampling_params):
            text = TOK.decode(ids)
            gold = next(a for q, a in self.golds.items() if q in text)
            for j in range(n):
                ans = gold if (sp["sampling_seed"] + j) % 2 == 0 else "500"
                body = f"Let me think. \\boxed{{{ans}}}" + ("" if j != 1 else " and more")
                out.append({"output_ids": TOK.encode(body), "meta_info": {
                    "finish_reason": {"type": "length" if j == 1 else "stop"}, "weight_version": 3}})
        return out


def _scripted_eval(**kw):
    engine = ScriptedEngine({p.problem: p.answer for p in PROBLEMS})
    cfg = EvalConfig(samples=4, seed=10, **kw)
    return engine, evaluate(engine, TOK, PROBLEMS, cfg, lora="policy", progress=False)


def test_scripted_engine_seeds_grades_and_metrics():
    engine, res = _scripted_eval(batch_problems=2)
    assert [c[:3] for c in engine.calls] == [(2, 4, "policy"), (1, 4, "policy")]
    assert [c[3] for c in engine.calls] == [[10, 14], [18]]  # seed + i * samples
    assert len(res.records) == 12 and [r.sample for r in res.records[:4]] == [0, 1, 2, 3]
    for r in res.records:  # even seed -> gold (correct, "033" == 33), odd -> 500 (wrong)
        seed = 10 + int(r.id[1]) * 4 + r.sample
        assert r.score == (1.0 if seed % 2 == 0 else 0.0), r
        assert r.extracted == ("500" if seed % 2 else r.gold) and r.weight_version == 3
    s = res.summary
    assert s["num_problems"] == 3 and s["samples_per_problem"] == 4
    assert s["avg@4"] == pytest.approx(0.5) and s["pass@1"] == pytest.approx(0.5)
    assert s["pass@4"] == pytest.approx(1.0) and s["truncation_rate"] == pytest.approx(0.25)
    assert res.metrics()["eval/avg@4"] == pytest.approx(0.5)


def test_batching_does_not_change_samples():
    _, a = _scripted_eval(batch_problems=1)
    _, b = _scripted_eval(batch_problems=32)
    assert [(r.id, r.sample, r.response) for r in a.records] == [(r.id, r.sample, r.response) for r in b.records]


def test_reports_and_hook(tmp_path):
    _, res = _scripted_eval()
    out = write_reports(res, tmp_path / "r", {"step": 5})
    rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 12 and {"id", "response", "extracted", "score", "reason"} <= set(rows[0])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["step"] == 5 and summary["avg@4"] == pytest.approx(0.5)
    engine = ScriptedEngine({p.problem: p.answer for p in PROBLEMS})
    hook = EvalHook(EvalConfig(samples=2, every_n_steps=3), engine, TOK, PROBLEMS, tmp_path / "run")
    assert hook.maybe_run(2, "policy") is None and not engine.calls
    metrics = hook.maybe_run(3, "policy")
    assert metrics["eval/avg@2"] == pytest.approx(0.5) and (tmp_path / "run/eval/step_000003/summary.json").is_file()


class SlowEngine(ScriptedEngine):
    """The scripted engine, taking `seconds` per generate call (as a real batch of long samples does)."""

    def __init__(self, golds, seconds):
        super().__init__(golds)
        self.seconds = seconds

    def generate(self, **kw):
        time.sleep(self.seconds)
        return super().generate(**kw)


def test_progress_bar_keeps_moving_while_a_batch_generates(monkeypatch, capsys):
    """One generate call per eval.batch_problems problems (no smaller calls: they would cost throughput); while
    it runs the bar is redrawn, so its clock moves, and it counts the samples when the call returns."""
    monkeypatch.setattr(harness, "REDRAW_S", 0.02)
    engine = SlowEngine({p.problem: p.answer for p in PROBLEMS}, seconds=0.5)
    res = evaluate(engine, TOK, PROBLEMS, EvalConfig(samples=4, batch_problems=32), progress=True)
    assert len(engine.calls) == 1 and len(res.records) == 12  # the engine's batching is unchanged
    frames = capsys.readouterr().err.split("\r")
    waiting = [f for f in frames if "0/12 [" in f]
    assert len(waiting) >= 5, frames  # redrawn while the call ran (tqdm alone draws 0/12 once)
    assert "generating batch 1/1 (12 samples)" in waiting[-1] and any("12/12 [" in f for f in frames)
    evaluate(engine, TOK, PROBLEMS, EvalConfig(samples=4), progress=False)
    assert capsys.readouterr().err == ""  # the training loop's eval (progress=False) draws nothing


def test_reports_keep_a_lone_surrogate_readable(tmp_path):
    """A response read from JSON may hold a lone surrogate ("\\ud800"): results.jsonl escapes it, other text is
    written as it is, and every row reads back unchanged."""
    _, res = _scripted_eval()
    res.records[0].response = "caf\u00e9 \ud800 \U0001f600"
    write_reports(res, tmp_path)
    text = (tmp_path / "results.jsonl").read_text(encoding="utf-8")
    assert "\\ud800" in text and "caf\u00e9" in text and "\U0001f600" in text
    assert json.loads(text.splitlines()[0])["response"] == "caf\u00e9 \ud800 \U0001f600"


def test_prompt_too_long_for_the_engine_fails_naming_the_problem():
    engine = ScriptedEngine({})
    engine.max_context = 64
    with pytest.raises(ValueError, match="problem p0: its prompt is .* exceeds the engine's max_context=64"):
        evaluate(engine, TOK, PROBLEMS, EvalConfig(samples=1, max_new_tokens=32), progress=False)


@pytest.mark.parametrize("override, field", [("eval.samples=0", "eval.samples"), ("eval.grader=nope", "eval.grader"),
                                             ("eval.template=nope", "eval.template"), ("eval.ks=[8]", "eval.ks"),
                                             ("tracking.logger=tensorboard", "tracking.logger")])
def test_eval_config_errors_name_the_field(override, field):
    from miles_k3.config import ConfigFieldError

    with pytest.raises(ConfigFieldError, match=rf"^{field}: "):
        compose_config("eval", ["eval.samples=4", override] if override != "eval.samples=0" else [override])


# ---- the real engine ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    from miles_k3.model import K3Config, K3ForCausalLM

    torch.manual_seed(0)
    return K3ForCausalLM(K3Config.from_name("k3_tiny"), expert_format="mxfp4").eval().requires_grad_(False)


def _real_engine(model, lora=None):
    from miles_k3.rollout.engine import EngineConfig, RolloutEngine

    cfg = EngineConfig(memory_budget_bytes=8 * 2**20, max_context=256, eos_token_ids=stop_token_ids(TOK))
    return RolloutEngine(model, cfg, lora=lora, tokenizer=TOK)


def test_real_engine_samples_are_reproducible_and_batch_invariant(tiny):
    cfg = EvalConfig(samples=2, max_new_tokens=6, temperature=1.0, top_p=1.0, seed=3, template="plain")
    a = evaluate(_real_engine(tiny), TOK, PROBLEMS, cfg, progress=False)
    cfg.batch_problems = 1
    b = evaluate(_real_engine(tiny), TOK, PROBLEMS, cfg, progress=False)
    assert [r.response for r in a.records] == [r.response for r in b.records]
    assert len({r.response for r in a.records}) > 1  # different seeds sample differently
    assert all(r.num_tokens <= 6 for r in a.records)
    trunc = sum(r.finish_reason == "length" for r in a.records) / len(a.records)
    assert a.summary["truncation_rate"] == pytest.approx(trunc)


def _run(args, tmp_path, env_extra=None):
    env = {**os.environ, "PYTHONWARNINGS": "ignore", **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", *args, f"hydra.run.dir={tmp_path}/hydra"], capture_output=True,
                          text=True, env=env, timeout=600, check=False)


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.slow
def test_eval_entry_point_with_an_adapter_and_wandb_offline(tiny, tmp_path):
    from miles_k3.model.adapter import save_adapter
    from miles_k3.model.lora import LoRAConfig, apply_lora, lora_parameters, remove_lora

    data = _write_jsonl(tmp_path / "p.jsonl", [{"id": p.id, "question": p.problem, "answer": p.answer}
                                                for p in PROBLEMS])
    lora = LoRAConfig(rank=4, alpha=8.0)
    apply_lora(tiny, lora)
    with torch.no_grad():
        for p in lora_parameters(tiny).values():
            p.normal_(0, 0.5)
    save_adapter(tiny, lora, tmp_path / "adapter", base_model_name_or_path="k3_tiny")
    remove_lora(tiny)
    common = ["device=cpu", "model=k3_tiny", f"eval.data.source={data}", "eval.samples=2", "eval.max_new_tokens=5",
              "engine.max_context=256", "eval.template=plain", "eval.temperature=0"]
    base = _run(["miles_k3.eval", *common, f"run_dir={tmp_path}/base"], tmp_path)
    assert base.returncode == 0, base.stderr[-3000:]
    assert "random weights: model.path and model.hf_path are unset, so model=k3_tiny" in base.stderr
    tuned = _run(["miles_k3.eval", *common, f"run_dir={tmp_path}/tuned", f"adapter={tmp_path}/adapter",
                  "tracking.logger=wandb"], tmp_path, {"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    summary = json.loads((tmp_path / "tuned/summary.json").read_text())
    assert summary["num_problems"] == 3 and summary["samples_per_problem"] == 2
    assert summary["adapter"] == f"{tmp_path}/adapter" and json.loads(tuned.stdout)["avg@2"] == summary["avg@2"]
    rows = [json.loads(x) for x in (tmp_path / "tuned/results.jsonl").read_text().splitlines()]
    base_rows = [json.loads(x) for x in (tmp_path / "base/results.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and [r["response"] for r in rows] != [r["response"] for r in base_rows]
    assert (tmp_path / "tuned/metrics.jsonl").is_file() and (tmp_path / "tuned/tables/eval_samples.jsonl").is_file()
    assert any(p.name.startswith("offline-run-") for p in (tmp_path / "tuned/wandb").iterdir())
    bad = _run(["miles_k3.eval", *common, f"adapter={tmp_path}/missing"], tmp_path)
    assert bad.returncode != 0 and "missing" in bad.stderr


def test_grade_entry_point_regrades_saved_responses(tmp_path, capsys):
    data = _write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "problem": "x", "answer": "033"},
                                               {"id": "b", "problem": "y", "answer": "7"}])
    resp = _write_jsonl(tmp_path / "r.jsonl", [{"id": "a", "response": "\\boxed{33}"},
                                               {"id": "a", "response": "Answer: 34"},
                                               {"id": "b", "response": "so \\boxed{7}."},
                                               {"id": "b", "response": "\\boxed{7.0}"}])
    assert grade_main(["--data", str(data), "--responses", str(resp), "--out", str(tmp_path / "o")]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["avg@2"] == pytest.approx(0.75) and summary["pass@2"] == pytest.approx(1.0)
    assert summary["maj@2"] == pytest.approx(1.0)  # b: 7 twice; a: a tie 33/34 -> the first (33), correct
    assert len((tmp_path / "o/results.jsonl").read_text().splitlines()) == 4
    (tmp_path / "bad.jsonl").write_text('{"id": "a", "response": "x"}\n{oops\n')
    assert grade_main(["--data", str(data), "--responses", str(tmp_path / "bad.jsonl")]) == 2
    assert "bad.jsonl line 2: not valid JSON" in capsys.readouterr().err
    _write_jsonl(tmp_path / "u.jsonl", [{"id": "zz", "response": "x"}])
    assert grade_main(["--data", str(data), "--responses", str(tmp_path / "u.jsonl")]) == 2
    assert "response id 'zz' is not in" in capsys.readouterr().err
    _write_jsonl(tmp_path / "c.jsonl", [{"id": "a", "response": "x"}, {"id": "a", "response": "x"},
                                        {"id": "b", "response": "x"}])
    assert grade_main(["--data", str(data), "--responses", str(tmp_path / "c.jsonl")]) == 2
    assert "id 'b' has 1 responses but others have 2" in capsys.readouterr().err
