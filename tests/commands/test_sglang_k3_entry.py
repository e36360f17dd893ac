"""The entry points with engine.backend=sglang serving our K3 (`miles_k3.train`, `miles_k3.eval`) on the CPU, against
the K3 path of `tests/sglang_double.py` (IT IS NOT SGLANG; see test_sglang_k3.py): the training loop with merged
pushes, a refused push that stops the run without losing its step, and the eval entry point's LoRA and merged
adapters, on the `k3_dir` fixture of conftest."""
import copy
import json

import pytest
import torch
from sglang_helpers import greedy
from sglang_k3_helpers import K3_DEFAULT, K3_MLA, k3_model

from miles_k3.model.lora import LoRAConfig, lora_parameters
from miles_k3.weight_sync.push import SyncError
from tests.sglang_double import FakeSGLangEngine


def _serve_doubles(monkeypatch, model, patch=None) -> list[FakeSGLangEngine]:
    """Every SGLang engine the run starts is a double serving a copy of `model` (after `patch(double)`, when given);
    returns the list they are appended to."""
    import miles_k3.rollout.sglang_backend as backend

    made = []

    def double(**args):
        made.append(FakeSGLangEngine(model=copy.deepcopy(model), **args))
        if patch is not None:
            patch(made[-1])
        return made[-1]

    monkeypatch.setattr(backend, "import_engine_class", lambda: double)
    return made


def _run_overrides(k3_dir, run_dir) -> list[str]:
    """A tiny GRPO run of the K3 checkpoint through SGLang: the default (KDA + MLA + MLP) targets push merged, 2
    prompts x 2 samples of 3 tokens, every push's parity within 1e-3."""
    return [f"run_dir={run_dir}", "engine.backend=sglang", f"model.path={k3_dir}", "lora.rank=4", "lora.alpha=8",
            f"lora.targets=[{','.join(K3_DEFAULT.targets)}]", "sglang.cuda_graph=false", "rollout.prompts_per_step=2",
            "rollout.group_size=2", "rollout.max_new_tokens=3", "rollout.dynamic_sampling=false", "data.size=16",
            "eval.every_n_steps=0", "sglang.parity_tolerance=1e-3", "sglang.probe_tokens=12", "trainer.optim.lr=1e-2"]


def test_three_grpo_steps_with_sglang_serving_k3(k3_dir, tmp_path, monkeypatch):
    """The loop with engine.backend=sglang model.path=<K3 dir> (the trainer our native K3, the double serving its own
    copy): the default targets push merged (sglang.cuda_graph=false), one update call per push, the first push
    verified, and the trainer's log-probs of the rollouts equal to the engine's."""
    from miles_k3.config import compose_config
    from miles_k3.train import train

    made = _serve_doubles(monkeypatch, k3_model(k3_dir))
    cfg = compose_config("train", [*_run_overrides(k3_dir, tmp_path / "run"), "steps=3",
                                   "rollout.release_tags=[kv_cache]"])
    run = train(cfg, "")
    eng = made[0]
    assert eng.server_args["enable_multimodal"] is False and eng.server_args["dtype"] == "bfloat16"
    assert "enable_lora" not in eng.server_args and not eng.calls_of("load_lora_adapter_from_tensors")
    updates = eng.calls_of("update_weights_from_tensor")
    assert len(updates) == 4 and all(c["flush_cache"] for c in updates)  # the initial write + 3 pushes, one call each
    assert all(n.startswith("language_model.model.layers.") and n.endswith(".weight") for n in updates[0]["names"])
    rows = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/rollout_logprob_abs_diff" in r]
    assert len(steps) == 3 and all(r["train/rollout_logprob_abs_diff"] < 1e-4 for r in steps)
    assert steps[0]["sync/parity_logprob_abs_diff"] < 1e-3 and steps[0]["sync/bytes"] > 0
    assert run.summary["steps"] == 3 and not eng.alive
    # the parity probe (sglang.probe=completions, 12 tokens): the first prompt and the base's greedy completion of
    # it, asked of SGLang before anything was written (no adapter, temperature 0), then the next prompt
    first, writes = eng.calls[0], [i for i, (m, _) in enumerate(eng.calls) if m == "update_weights_from_tensor"]
    assert first[0] == "generate" and first[1]["lora_path"] is None and writes[0] > 0
    assert all(sp["temperature"] == 0.0 and sp["max_new_tokens"] == 12 for sp in first[1]["sampling_params"])
    probes = [c["input_ids"][0] for m, c in eng.calls if m == "generate" and c["logprob_start_len"] == 0]
    p0, p1 = first[1]["input_ids"][:2]
    done = greedy(k3_model(k3_dir), p0, 12, cfg.engine.eos_token_ids[0])
    assert len(p0) < 12 and probes and all(p == probes[0] for p in probes)
    assert probes[0] == (p0 + done + p1)[:12] and done[0] != p0[0]


def test_a_refused_push_stops_the_run_with_its_step_logged_and_checkpointed(k3_dir, tmp_path, monkeypatch):
    """Step 3's merged push reaches the double with every name but one misspelt (SGLang skips names it does not
    know): the check refuses it and the run stops, but loses nothing. Step 3 is logged with the refused check's
    figures (sync/refused = 1), the trainer's state after step 3 is checkpointed (its adapter is exactly the one the
    refused push carried; weight version 3), the error says where, and resume=auto continues at step 4 with the
    engine serving that adapter."""
    from miles_k3.config import compose_config
    from miles_k3.model.adapter import load_adapter
    from miles_k3.train import train
    from miles_k3.weight_sync.sglang import merged_weights

    pushed, misspell = [], [3]

    def misspelling(eng):
        update = eng.update_weights_from_tensor

        def write(named_tensors, **kw):  # write 0 is the initial adapter, write k push k (then the restore)
            named_tensors = list(named_tensors)
            pushed.append(dict(named_tensors))
            if len(pushed) - 1 in misspell:
                keep = named_tensors[0][0]
                named_tensors = [(n if n == keep else n.replace(".weight", ".wieght"), t) for n, t in named_tensors]
            return update(named_tensors=named_tensors, **kw)

        eng.update_weights_from_tensor = write

    run_dir = tmp_path / "run"
    overrides = [*_run_overrides(k3_dir, run_dir), "sglang.verify_push=every", "steps=5",
                 "reward=coin"]  # a coin: every step has advantages, so every step moves the adapter
    made = _serve_doubles(monkeypatch, k3_model(k3_dir), misspelling)
    with pytest.raises(SyncError, match=r"^step 3: push of version 3 refused: .*the engine serves version 2 again\. "
                                        r"The trainer's state after step 3 is saved in .*step_00000003: fix the cause, "
                                        r"then resume with resume=auto run_dir="):
        train(compose_config("train", overrides), "")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert "sync/refused" not in rows[1] and rows[2]["sync/refused"] == 1.0
    assert rows[2]["sync/parity_logprob_abs_diff"] > 1e-3 > rows[1]["sync/parity_logprob_abs_diff"]
    assert rows[2]["train/num_tokens"] > 0  # the step trained before its push
    ckpt = run_dir / "checkpoints/step_00000003"
    assert json.loads((ckpt / "state.json").read_text())["extra_state"]["weight_version"] == 3
    trainer = k3_model(k3_dir, K3_DEFAULT)
    load_adapter(trainer, ckpt / "adapter")
    saved = merged_weights(trainer)  # the checkpoint's adapter merged as the trainer merges (fp32 here)
    refused = pushed[3]  # what push 3 carried, before the misspelling
    assert sorted(saved) == sorted(refused)
    assert all(torch.equal(saved[n], refused[n]) for n in saved)
    assert not made[0].alive

    misspell.clear()
    pushed.clear()
    run = train(compose_config("train", [*overrides, "resume=auto"]), "")
    assert run.summary["first_step"] == 4 and run.summary["last_step"] == 5
    assert all(torch.equal(pushed[0][n], refused[n]) for n in refused)  # the resumed engine starts with it
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and all(r["sync/parity_logprob_abs_diff"] < 1e-3
                                                                 for r in rows[3:])


def test_eval_entry_point_with_sglang_serving_k3(k3_dir, tmp_path, monkeypatch):
    """python -m miles_k3.eval engine.backend=sglang model.path=<K3 dir>: an adapter of the MLA targets is served as
    LoRA (greedy completions = the trainer model's with it); one with a KDA target is merged into the base weights
    (sglang.push=auto: one write of W0 + s * B @ A from the checkpoint file before the first request) and refused
    before SGLang starts under sglang.push=lora."""
    from miles_k3.config import compose_config
    from miles_k3.eval import run
    from miles_k3.model.adapter import save_adapter
    from miles_k3.model.build import build_tokenizer
    from miles_k3.model.config import ConfigError
    from miles_k3.weight_sync.sglang import merged_weights

    trainer = k3_model(k3_dir, K3_MLA, std=0.2)
    save_adapter(trainer, K3_MLA, tmp_path / "mla", base_model_name_or_path=str(k3_dir))
    kda = LoRAConfig(rank=4, alpha=8.0, targets=["q_proj", "q_b_proj"])
    kda_trainer = k3_model(k3_dir, kda, std=0.2, seed=5)
    save_adapter(kda_trainer, kda, tmp_path / "kda", base_model_name_or_path=str(k3_dir))
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"problem": q, "answer": a}) + "\n"
                                              for q, a in [("1+2", "3"), ("9*9", "81")]))
    made = _serve_doubles(monkeypatch, k3_model(k3_dir, K3_MLA))
    common = ["engine.backend=sglang", f"model.path={k3_dir}", f"eval.data.source={tmp_path}/p.jsonl",
              "eval.samples=1", "eval.max_new_tokens=3", "eval.template=plain", "eval.temperature=0"]
    summary = run(compose_config("eval", [*common, f"adapter={tmp_path}/mla", f"run_dir={tmp_path}/out"]))
    eng = made[0]
    assert summary["backend"] == "sglang" and sorted(eng.server_args["lora_target_modules"]) == sorted(K3_MLA.targets)
    assert eng.server_args["enable_multimodal"] is False and not eng.alive
    tokenizer, stops = build_tokenizer(compose_config("eval", common).model, 0)
    rows = [json.loads(x) for x in (tmp_path / "out/results.jsonl").read_text().splitlines()]
    calls = eng.calls_of("generate")
    assert len(rows) == 2 and all(c["lora_path"] == ["policy@v0"] * 2 for c in calls)
    assert calls[0]["input_ids"] == [tokenizer.encode(r["prompt"], add_special_tokens=False) for r in rows]
    for r, ids in zip(rows, calls[0]["input_ids"]):  # the trained adapter's own greedy tokens
        out = greedy(trainer, ids, 3, stops[0])
        assert r["response"] == tokenizer.decode([t for t in out if t not in stops], skip_special_tokens=False)

    run(compose_config("eval", [*common, f"adapter={tmp_path}/kda", f"run_dir={tmp_path}/kda_out"]))
    eng = made[1]
    assert "lora_target_modules" not in eng.server_args and not eng.adapters  # no LoRA in SGLang
    expected = merged_weights(k3_model(k3_dir, kda), {n: p.detach() for n, p in lora_parameters(kda_trainer).items()})
    writes = eng.calls_of("update_weights_from_tensor")
    assert len(writes) == 1 and sorted(writes[0]["names"]) == sorted(expected)  # every q_proj / q_b_proj, once
    served = dict(eng.model.named_parameters())
    for name, w in expected.items():  # the file's bf16 W0 + s * B @ A, rounded to bf16 (the trainer's fp32: within it)
        got = served[name.removeprefix("language_model.")]
        assert torch.allclose(got, w, rtol=2**-7, atol=1e-6) and not torch.equal(got, k3_model(k3_dir).state_dict()[
            name.removeprefix("language_model.")])
    calls = eng.calls_of("generate")
    assert calls and all(c.get("lora_path") in (None, [None] * 2) for c in calls)  # requests go to the base
    merged_model = k3_model(k3_dir)
    merged_model.load_state_dict({k: v for k, v in eng.model.state_dict().items() if "lora_" not in k})
    rows = [json.loads(x) for x in (tmp_path / "kda_out/results.jsonl").read_text().splitlines()]
    for r, ids in zip(rows, calls[0]["input_ids"]):
        out = greedy(merged_model, ids, 3, stops[0])
        assert r["response"] == tokenizer.decode([t for t in out if t not in stops], skip_special_tokens=False)
    with pytest.raises(ConfigError, match=r"^sglang.push: lora cannot serve lora.targets q_proj \(silently dropped"):
        run(compose_config("eval", [*common, "sglang.push=lora", f"adapter={tmp_path}/kda",
                                    f"run_dir={tmp_path}/kda_lora"]))
    assert len(made) == 2  # refused before SGLang starts


def test_a_probe_that_cannot_be_built_is_refused_before_sglang_starts(k3_dir, tmp_path, monkeypatch):
    """sglang.probe=completions needs room after the first prompt; the probe must fit the context; an unknown probe
    is a config error."""
    from miles_k3.config import compose_config
    from miles_k3.train import train

    made = _serve_doubles(monkeypatch, k3_model(k3_dir))
    base = [*_run_overrides(k3_dir, tmp_path / "run"), "steps=1"]
    with pytest.raises(ValueError, match=r"sglang.probe=completions: the first training prompt has \d+ tokens, >= "
                                         r"sglang.probe_tokens=2, .* set sglang.probe_tokens above it"):
        train(compose_config("train", [*base, "sglang.probe_tokens=2"]), "")
    with pytest.raises(ValueError, match=r"sglang.probe_tokens=65: longer than the context of 64 tokens "
                                         r"\(sglang.context_length"):
        train(compose_config("train", [*base, "sglang.probe_tokens=65", "sglang.context_length=64"]), "")
    assert made == []
    with pytest.raises(Exception, match="probe: 'rollout' is not one of completions, prompt"):
        train(compose_config("train", [*base, "sglang.probe=rollout"]), "")
