"""The SGLang backend's own logic on the CPU, against `tests/sglang_double.py`: a recorded-interface test double of
sglang.Engine. THE DOUBLE IS NOT SGLANG: these tests check what our code sends and how it maps what comes back
(server arguments, per-sample seeds, versioned adapter names and their unloading, result records, errors, a
3-step loop, the eval entry point; the log-prob parity check of a push: test_sglang_push_parity.py). SGLang itself is exercised by the gpu-marked tests in
test_gpu_sglang.py."""
import json
import sys

import pytest
import torch
from sglang_helpers import LORA, double_engine, greedy, peft_of, policy

from miles_k3.model.lora import apply_lora
from miles_k3.rollout.sglang_backend import (
    INSTALL_HINT,
    SGLangConfig,
    import_engine_class,
    server_args,
    version_of,
)
from tests.sglang_double import FakeSGLangEngine


def test_server_args_map_the_typed_config():
    cfg = SGLangConfig(mem_fraction_static=0.3, cuda_graph=False, max_lora_rank=16, lora_backend="triton",
                       enable_weights_cpu_backup=True, extra_args={"chunked_prefill_size": 512})
    args = server_args(cfg, "/ckpt", LORA, seed=3)
    assert args == {"model_path": "/ckpt", "skip_tokenizer_init": True, "random_seed": 3,
                    "attention_backend": "triton", "sampling_backend": "pytorch", "mem_fraction_static": 0.3,
                    "disable_cuda_graph": True, "enable_memory_saver": True, "enable_weights_cpu_backup": True,
                    "dtype": "auto", "log_level": "error", "enable_lora": True, "max_lora_rank": 16,
                    "lora_target_modules": LORA.targets, "max_loras_per_batch": 3, "lora_backend": "triton",
                    "chunked_prefill_size": 512}
    no_lora = server_args(SGLangConfig(), "/ckpt", None)
    assert "enable_lora" not in no_lora and no_lora["disable_cuda_graph"] is False
    assert server_args(SGLangConfig(), "/ckpt", LORA)["max_lora_rank"] == LORA.rank  # null: lora.rank


@pytest.mark.parametrize(("field", "value", "message"), [
    ("mem_fraction_static", 1.0, "mem_fraction_static: must be in"),
    ("max_loras_per_batch", 2, "max_loras_per_batch: must be >= 3"),
    ("verify_push", "sometimes", "verify_push: 'sometimes' is not one of never, every_n, every"),
    ("verify_push", "first", "verify_push: 'first' was replaced by every_n .* set sglang.verify_push=every_n"),
    ("verify_every", 0, "verify_every: must be an integer >= 1"),
    ("verify_every", True, "verify_every: must be an integer >= 1"),
    ("parity_min_effect", 0.0, "parity_min_effect: must be finite and > 0"),
    ("parity_min_effect", float("inf"), "parity_min_effect: must be finite and > 0"),
    ("parity_tolerance", float("nan"), "parity_tolerance"),
    ("extra_args", {"enable_lora": False}, r"extra_args: \['enable_lora'\] are set by typed fields"),
])
def test_bad_sglang_config_is_refused(field, value, message):
    with pytest.raises(ValueError, match=message):
        SGLangConfig(**{field: value}).validate()


def test_missing_sglang_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)  # import sglang raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'miles-k3\[sglang\]'"):
        import_engine_class()
    assert "engine.backend=native" in INSTALL_HINT


def test_generate_sends_per_sample_seeds_and_maps_results():
    eng = double_engine()
    eng.load_lora_adapter_from_tensors("policy", {"a.lora_A.weight": torch.zeros(2, 3)}, LORA)
    outs = eng.generate(input_ids=[[1, 2, 3], [4, 5]], sampling_params=[
        {"max_new_tokens": 3, "temperature": 1.0, "sampling_seed": 10}, {"max_new_tokens": 2, "sampling_seed": 20}],
        n=2, lora="policy")
    call = eng.engine.calls_of("generate")[0]
    assert call["input_ids"] == [[1, 2, 3], [1, 2, 3], [4, 5], [4, 5]]
    assert [sp["sampling_seed"] for sp in call["sampling_params"]] == [10, 11, 20, 21]  # the native engine's rule
    assert all(sp["stop_token_ids"] == [257] for sp in call["sampling_params"])
    assert call["lora_path"] == ["policy@v0"] * 4 and call["return_logprob"] is True
    assert [len(o["output_ids"]) for o in outs] == [3, 3, 2, 2]
    for o in outs:
        meta = o["meta_info"]
        assert [t for _, t in meta["output_token_logprobs"]] == o["output_ids"]  # (logprob, id) pairs
        assert meta["weight_version"] == 0 and meta["finish_reason"]["type"] == "length"
    base = eng.generate(input_ids=[[1]], sampling_params={"max_new_tokens": 1}, lora=None)
    assert eng.engine.calls_of("generate")[1]["lora_path"] is None and "output_ids" in base[0]
    with pytest.raises(ValueError, match="adapter 'other' is not loaded"):
        eng.generate(input_ids=[[1]], lora="other")


def test_aborted_and_inconsistent_results():
    eng = double_engine()
    eng.engine.generate = lambda **kw: [{"meta_info": {"finish_reason": {"type": "abort", "message": "too long"}}}]
    assert eng.generate(input_ids=[[1]])[0]["error"] == "too long"
    eng.engine.generate = lambda **kw: [{"output_ids": [5, 6], "meta_info": {
        "finish_reason": {"type": "length"}, "output_token_logprobs": [(-1.0, 5, None)]}}]
    with pytest.raises(RuntimeError, match="log-probs of 1 tokens for 2 output ids"):
        eng.generate(input_ids=[[1]])


def test_pushes_serve_versioned_names_and_unload_the_old_once_drained():
    eng = double_engine()
    tensors = {"a.lora_A.weight": torch.zeros(2, 3)}
    eng.load_lora_adapter_from_tensors("policy", tensors, LORA)
    eng.update_weights_from_tensor(tensors, lora_name="policy", weight_version=1)
    assert eng.serving("policy") == "policy@v1" and eng.weight_version == 1
    assert [c["lora_name"] for c in eng.engine.calls_of("unload_lora_adapter")] == ["policy@v0"]
    assert eng.engine.calls_of("load_lora_adapter_from_tensors")[1]["config_dict"]["r"] == LORA.rank
    real = eng.engine.generate

    def generate_during_a_push(**kw):  # another thread pushes while these requests run on policy@v1
        eng.update_weights_from_tensor(tensors, lora_name="policy", weight_version=2)
        assert "policy@v1" in eng.engine.adapters  # still in use: not unloaded yet
        return real(**kw)

    eng.engine.generate = generate_during_a_push
    outs = eng.generate(input_ids=[[1, 2]], sampling_params={"max_new_tokens": 1}, n=2, lora="policy")
    assert [o["meta_info"]["weight_version"] for o in outs] == [1, 1]  # the version that produced them
    assert sorted(eng.engine.adapters) == ["policy@v2"]  # v1 unloaded as its last request finished
    with pytest.raises(ValueError, match="versions only move forward"):
        eng.update_weights_from_tensor(tensors, lora_name="policy", weight_version=2)
    eng.update_weights_from_tensor({"model.norm.weight": torch.ones(3)})  # no lora_name: base weights
    assert eng.engine.calls_of("update_weights_from_tensor")[0]["names"] == ["model.norm.weight"]
    assert eng.weight_version == 3 and version_of("policy@v12") == 12 and version_of("policy") is None


def test_memory_handoff_checks_its_preconditions():
    eng = double_engine()
    with pytest.raises(ValueError, match="enable_weights_cpu_backup=true would resume them as garbage"):
        eng.release_memory_occupation(["weights"])
    eng.release_memory_occupation(["kv_cache", "cuda_graph"])
    with pytest.raises(RuntimeError, match="resume_memory_occupation"):
        eng.generate(input_ids=[[1]])
    eng.resume_memory_occupation(["kv_cache", "cuda_graph"])
    assert eng.engine.calls_of("release_memory_occupation") == [{"tags": ["kv_cache", "cuda_graph"]}]
    eng.generate(input_ids=[[1]], sampling_params={"max_new_tokens": 1})
    backed = double_engine(cfg=SGLangConfig(enable_weights_cpu_backup=True))
    backed.release_memory_occupation(None)
    assert backed.engine.calls_of("release_memory_occupation") == [{"tags": ["kv_cache", "weights", "cuda_graph"]}]
    with pytest.raises(ValueError, match="needs sglang.enable_memory_saver=true"):
        double_engine(cfg=SGLangConfig(enable_memory_saver=False)).release_memory_occupation(["kv_cache"])


def test_hf_model_adapters_are_peft_adapters(qwen3_dir, tmp_path):
    """The trainer's LoRA on an HF Qwen3 saves as an adapter that PEFT applies to transformers' own model with the
    same outputs; right-padded rows score like unpadded ones."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from miles_k3.model.adapter import peft_tensors, save_adapter

    model = policy(qwen3_dir)
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in peft_tensors(model)
    save_adapter(model, LORA, tmp_path / "adapter", base_model_name_or_path=str(qwen3_dir))
    ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(qwen3_dir), dtype=torch.float32),
                                    str(tmp_path / "adapter"))
    ids = torch.tensor([[256, 49, 43, 50, 61, 51, 258, 258], [256, 52, 45, 51, 61, 49, 50, 259]])
    lens = torch.tensor([6, 8])
    with torch.no_grad():
        ours = model(ids, seq_lens=lens).logits
        theirs = ref(input_ids=ids[1:]).logits
        alone = model(ids[:1, :6], seq_lens=lens[:1]).logits
    torch.testing.assert_close(ours[1:], theirs, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours[0, :6], alone[0], rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_three_grpo_steps_with_the_sglang_backend(qwen3_dir, tmp_path, monkeypatch):
    """The loop with engine.backend=sglang (over the double, with its own copy of the tiny Qwen3): versions v0..v3
    served in turn and the old ones unloaded, the first push checked by parity (and the next while checks are
    inconclusive), the trainer's log-probs equal to the engine's, and the checkpoint a PEFT adapter of the HF model."""
    import miles_k3.rollout.sglang_backend as backend
    from miles_k3.config import compose_config
    from miles_k3.model.hf import load_hf_model
    from miles_k3.train import train

    made = []

    def double(**args):
        model = load_hf_model(str(qwen3_dir), torch.device("cpu"), torch.float32)
        apply_lora(model, LORA)
        made.append(FakeSGLangEngine(model=model, **args))
        return made[-1]

    monkeypatch.setattr(backend, "import_engine_class", lambda: double)
    cfg = compose_config("train", [
        "steps=3", f"run_dir={tmp_path}/run", "engine.backend=sglang", "model.path=null",
        f"model.hf_path={qwen3_dir}", "lora.rank=4", "lora.alpha=8",
        "lora.targets=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]", "rollout.prompts_per_step=4",
        "rollout.group_size=4", "rollout.max_new_tokens=4", "rollout.dynamic_sampling=false", "data.size=64",
        "eval.data.size=8", "eval.batch_problems=8", "eval.every_n_steps=3", "eval.samples=2",
        "sglang.parity_tolerance=1e-3", "rollout.release_tags=[kv_cache]", "trainer.optim.lr=1e-2"])
    run = train(cfg, "")
    eng = made[0]
    assert [c["lora_name"] for c in eng.calls_of("load_lora_adapter_from_tensors")] == [
        "policy@v0", "policy@v1", "policy@v2", "policy@v3"]
    assert [c["lora_name"] for c in eng.calls_of("unload_lora_adapter")] == ["policy@v0", "policy@v1", "policy@v2"]
    assert eng.server_args["model_path"] == str(qwen3_dir) and eng.server_args["skip_tokenizer_init"] is True
    assert len(eng.calls_of("release_memory_occupation")) == 3 and not eng.alive  # shut down with the run
    rows = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/rollout_logprob_abs_diff" in r]
    assert len(steps) == 3 and all(r["train/rollout_logprob_abs_diff"] < 1e-4 for r in steps)
    assert "sync/parity_logprob_abs_diff" in steps[0] and steps[0]["sync/parity_logprob_abs_diff"] < 1e-3
    # verify_push=every_n: the push after step 1 is verified again only if step 1's check was inconclusive
    assert ("sync/parity_logprob_abs_diff" in steps[1]) == (steps[0]["sync/parity_inconclusive"] == 1.0)
    assert any("eval/avg@2" in r for r in rows) and run.summary["steps"] == 3
    adapter = json.loads((run.last_checkpoint / "adapter/adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(qwen3_dir)


def test_eval_entry_point_with_the_sglang_backend(qwen3_dir, tmp_path, monkeypatch):
    """python -m miles_k3.eval engine.backend=sglang (over the double): SGLang gets the checkpoint directory and the adapter
    file's tensors as stored, every eval request names the adapter, the greedy completions are the trainer model's
    with that adapter (and differ from the base's), and the engine is shut down at the end."""
    import miles_k3.rollout.sglang_backend as backend
    from miles_k3.config import compose_config
    from miles_k3.eval import run
    from miles_k3.model.adapter import save_adapter
    from miles_k3.model.build import build_tokenizer
    from miles_k3.model.hf import load_hf_model

    trainer = policy(qwen3_dir)
    save_adapter(trainer, LORA, tmp_path / "adapter", base_model_name_or_path=str(qwen3_dir))
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"problem": q, "answer": a}) + "\n"
                                              for q, a in [("1+2", "3"), ("40-7", "033"), ("9*9", "81")]))
    made = []

    class Recording(FakeSGLangEngine):
        def generate(self, **kw):
            out = super().generate(**kw)
            self.outputs.extend(zip(kw["input_ids"], (o["output_ids"] for o in out)))
            return out

    def double(**args):
        model = load_hf_model(str(qwen3_dir), torch.device("cpu"), torch.float32)
        apply_lora(model, LORA)
        made.append(Recording(model=model, **args))
        made[-1].outputs = []
        return made[-1]

    monkeypatch.setattr(backend, "import_engine_class", lambda: double)
    common = ["engine.backend=sglang", "model.path=null", f"model.hf_path={qwen3_dir}",
              f"eval.data.source={tmp_path}/p.jsonl", "eval.samples=2", "eval.max_new_tokens=5", "eval.template=plain", "eval.temperature=0"]
    tuned = run(compose_config("eval", [*common, f"adapter={tmp_path}/adapter", f"run_dir={tmp_path}/tuned"]))
    base = run(compose_config("eval", [*common, f"run_dir={tmp_path}/base"]))
    assert base["adapter"] is None and base["model"] == str(qwen3_dir)
    eng, base_eng = made
    assert eng.server_args["model_path"] == str(qwen3_dir) and eng.server_args["max_lora_rank"] == LORA.rank
    assert "enable_lora" not in base_eng.server_args  # no adapter: SGLang serves the base alone
    assert [c["lora_name"] for c in eng.calls_of("load_lora_adapter_from_tensors")] == ["policy@v0"]
    stored = peft_of(trainer)
    assert sorted(eng.adapters["policy@v0"]) == sorted(stored)
    assert all(torch.equal(eng.adapters["policy@v0"][k], stored[k]) for k in stored)
    assert all(c["lora_path"] == ["policy@v0"] * 6 for c in eng.calls_of("generate"))
    assert not eng.alive and not base_eng.alive
    tokenizer, stops = build_tokenizer(compose_config("eval", common).model, 0)
    rows = [json.loads(x) for x in (tmp_path / "tuned/results.jsonl").read_text().splitlines()]
    base_rows = [json.loads(x) for x in (tmp_path / "base/results.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and tuned["backend"] == "sglang" and tuned["samples_per_problem"] == 2
    assert len(eng.outputs) == 6
    for r, (ids, out) in zip(rows, eng.outputs):
        assert ids == tokenizer.encode(r["prompt"], add_special_tokens=False)
        assert out == greedy(trainer, ids, 5, stops[0])  # the trained adapter's own greedy tokens
        assert r["response"] == tokenizer.decode([t for t in out if t not in stops], skip_special_tokens=False)
    assert [o for _, o in eng.outputs] != [o for _, o in base_eng.outputs]
    assert len(base_rows) == 6


@pytest.mark.parametrize(("overrides", "match"), [
    (["model.hf_path=/ckpt/qwen3"],
     r"^model.hf_path: an HF architecture is served by SGLang only; set engine.backend=sglang"),
    (["engine.backend=sglang", "model=k3_tiny"],
     r"^engine.backend: sglang serves a checkpoint directory; set model.hf_path"),
    (["engine.backend=vllm"], r"^engine.backend: 'vllm' is not one of native, sglang"),
])
def test_eval_backend_config_errors(overrides, match):
    from miles_k3.config import ConfigFieldError, compose_config

    with pytest.raises(ConfigFieldError, match=match):
        compose_config("eval", overrides)


def test_checkpoint_context_reads_the_model_config(tmp_path):
    from miles_k3.rollout.sglang_backend import checkpoint_context

    (tmp_path / "flat").mkdir()
    (tmp_path / "flat/config.json").write_text(json.dumps({"max_position_embeddings": 40960}))
    (tmp_path / "nested").mkdir()
    (tmp_path / "nested/config.json").write_text(json.dumps({"text_config": {"max_position_embeddings": 8192}}))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad/config.json").write_text("{not json")
    assert checkpoint_context(str(tmp_path / "flat")) == 40960
    assert checkpoint_context(str(tmp_path / "nested")) == 8192
    assert checkpoint_context(str(tmp_path / "bad")) is None  # the fallback (engine.max_context) applies
    assert checkpoint_context("moonshotai/Kimi-K3") is None  # a hub id: no local config
