"""The SGLang backend's own logic on the CPU, against `tests/sglang_double.py`: a recorded-interface test double of
sglang.Engine. THE DOUBLE IS NOT SGLANG: these tests check what our code sends and how it maps what comes back
(server arguments, per-sample seeds, versioned adapter names and their unloading, result records, errors, the
logprob-parity check of a push, a 3-step loop). SGLang itself is exercised by the gpu-marked tests in
test_gpu_sglang.py."""
import functools
import json
import sys

import pytest
import torch
from lora_helpers import hf_policy

from miles_k3.model.lora import LoRAConfig, apply_lora, lora_parameters
from miles_k3.rollout.sglang_backend import (
    INSTALL_HINT,
    SGLangConfig,
    SGLangEngine,
    import_engine_class,
    server_args,
    version_of,
)
from miles_k3.weight_sync.protocol import SyncError
from miles_k3.weight_sync.sglang import Parity, SGLangChannel
from tests.sglang_double import FakeSGLangEngine

LORA = LoRAConfig(rank=4, alpha=8.0, targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                              "down_proj"])


def _policy(qwen3_dir, seed=0):
    return hf_policy(qwen3_dir, LORA, seed=seed)


def _peft(model):
    from miles_k3.adapter import peft_tensors

    return {n: t.detach() for n, t in peft_tensors(model).items()}


def _engine(model=None, cfg=None, **kw):
    factory = functools.partial(FakeSGLangEngine, model=model, **kw)
    return SGLangEngine(cfg or SGLangConfig(), "/ckpt/tiny", lora=LORA, seed=7, stop_token_ids=[257],
                        engine_cls=factory)


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
    eng = _engine()
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
    eng = _engine()
    eng.engine.generate = lambda **kw: [{"meta_info": {"finish_reason": {"type": "abort", "message": "too long"}}}]
    assert eng.generate(input_ids=[[1]])[0]["error"] == "too long"
    eng.engine.generate = lambda **kw: [{"output_ids": [5, 6], "meta_info": {
        "finish_reason": {"type": "length"}, "output_token_logprobs": [(-1.0, 5, None)]}}]
    with pytest.raises(RuntimeError, match="log-probs of 1 tokens for 2 output ids"):
        eng.generate(input_ids=[[1]])


def test_pushes_serve_versioned_names_and_unload_the_old_once_drained():
    eng = _engine()
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
    eng = _engine()
    with pytest.raises(ValueError, match="enable_weights_cpu_backup=true would resume them as garbage"):
        eng.release_memory_occupation(["weights"])
    eng.release_memory_occupation(["kv_cache", "cuda_graph"])
    with pytest.raises(RuntimeError, match="resume_memory_occupation"):
        eng.generate(input_ids=[[1]])
    eng.resume_memory_occupation(["kv_cache", "cuda_graph"])
    assert eng.engine.calls_of("release_memory_occupation") == [{"tags": ["kv_cache", "cuda_graph"]}]
    eng.generate(input_ids=[[1]], sampling_params={"max_new_tokens": 1})
    backed = _engine(cfg=SGLangConfig(enable_weights_cpu_backup=True))
    backed.release_memory_occupation(None)
    assert backed.engine.calls_of("release_memory_occupation") == [{"tags": ["kv_cache", "weights", "cuda_graph"]}]
    with pytest.raises(ValueError, match="needs sglang.enable_memory_saver=true"):
        _engine(cfg=SGLangConfig(enable_memory_saver=False)).release_memory_occupation(["kv_cache"])


PROBE = [256, 49, 53, 45, 52, 51, 61, 49, 50]


def _trainer_logprobs(trainer, ids, adapter=True):
    from miles_k3.model.lora import adapters_disabled
    from miles_k3.trainer.step import sequence_logprobs

    if adapter:
        return sequence_logprobs(trainer, ids)
    with adapters_disabled(trainer):
        return sequence_logprobs(trainer, ids)


def _channel(qwen3_dir, std=0.05, engine_kw=None, **cfg):
    """(trainer, engine, channel): the trainer's policy with random B of std `std`, an engine over the double's own
    copy (another adapter until the trainer's is loaded), and a channel configured by SGLangConfig(**cfg)."""
    trainer = hf_policy(qwen3_dir, LORA, seed=0, std=std)
    engine = _engine(model=_policy(qwen3_dir, seed=1), **(engine_kw or {}))
    engine.load_lora_adapter_from_tensors("policy", _peft(trainer), LORA)
    cfg = SGLangConfig(**({"verify_push": "every", "parity_tolerance": 1e-3} | cfg))
    return trainer, engine, SGLangChannel(engine, "policy", cfg, probe_ids=PROBE,
                                          trainer_logprobs=lambda ids: _trainer_logprobs(trainer, ids),
                                          trainer_base_logprobs=lambda ids: _trainer_logprobs(trainer, ids, False))


def _set_b(trainer, std, seed=3):
    """LoRA B of `trainer` set to N(0, std) (0: zeros): the adapter's effect, an optimizer step's worth."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in sorted(lora_parameters(trainer).items()):
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * std)


def test_push_is_verified_by_logprob_parity(qwen3_dir):
    trainer, engine, channel = _channel(qwen3_dir)
    with torch.no_grad():
        for p in lora_parameters(trainer).values():
            p.add_(0.01)  # an optimizer step
    report = channel.push(_peft(trainer), version=1)
    assert report.parity is not None and report.parity.gap < 1e-5  # same fp32 math on both sides
    assert engine.serving("policy") == "policy@v1" and report.metrics()["sync/parity_logprob_abs_diff"] < 1e-5
    # a push whose tensors do not act as the trainer's (here: layouts swapped) is refused and never served
    bad = _peft(trainer)
    a_key = next(k for k in bad if k.endswith("q_proj.lora_B.weight"))
    bad[a_key] = bad[a_key].flip(0)
    with pytest.raises(SyncError, match="differ from the trainer's by .* nats/token"):
        channel.push(bad, version=2)
    assert engine.serving("policy") == "policy@v1" and "policy@v2" not in engine.engine.adapters
    assert engine.weight_version == 1


def test_failed_or_bad_pushes_leave_the_served_version(qwen3_dir):
    trainer, engine, channel = _channel(qwen3_dir, verify_push="every_n", engine_kw={"fail_load": "@v3"})
    assert channel.push(_peft(trainer), version=1).parity.inconclusive is False
    checks = len(engine.engine.calls_of("generate"))
    channel.push(_peft(trainer), version=2)  # verify_every=10 after a conclusive check: no probe
    assert len(engine.engine.calls_of("generate")) == checks
    with pytest.raises(SyncError, match=r"failed in sglang: RuntimeError: sglang load_lora_adapter_from_tensors\(policy@v3\) "
                       "failed: simulated load failure"):
        channel.push(_peft(trainer), version=3)
    nan = _peft(trainer)
    key = next(iter(nan))
    nan[key] = torch.full_like(nan[key], float("nan"))
    with pytest.raises(SyncError, match="non-finite") as err:
        channel.push(nan, version=4)
    assert err.value.tensor == key
    with pytest.raises(SyncError, match="versions only move forward"):
        channel.push(_peft(trainer), version=2)
    assert engine.serving("policy") == "policy@v2" and sorted(engine.engine.adapters) == ["policy@v2"]


def test_hf_model_adapters_are_peft_adapters(qwen3_dir, tmp_path):
    """The trainer's LoRA on an HF Qwen3 saves as an adapter that PEFT applies to transformers' own model with the
    same outputs; right-padded rows score like unpadded ones."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from miles_k3.adapter import peft_tensors, save_adapter

    model = _policy(qwen3_dir)
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


def test_a_failing_parity_probe_refuses_the_push(qwen3_dir):
    trainer, engine, channel = _channel(qwen3_dir)

    def broken(ids, adapter):
        raise RuntimeError("probe request aborted")

    engine.prompt_logprobs = broken
    with pytest.raises(SyncError, match="the parity probe failed .RuntimeError: probe request aborted."):
        channel.push(_peft(trainer), version=1)
    assert engine.serving("policy") == "policy@v0" and sorted(engine.engine.adapters) == ["policy@v0"]


def _mean_abs(xs, ys):
    return sum(abs(x - y) for x, y in zip(xs, ys)) / len(xs)


def test_parity_probe_by_hand():
    """completions: prompt, its completion, the next prompt, ... cut at the length (starting over when the prompts
    run out); prompts are taken until they alone would fill it; prompt: the first prompt repeated."""
    from miles_k3.weight_sync.sglang import parity_probe

    asked = []

    def complete(prompts, max_new):
        asked.append((prompts, max_new))
        return [[70 + i] * (2 - i) for i in range(len(prompts))]  # 2, 1 and 0 tokens

    assert parity_probe("completions", 10, [[1, 2, 3], [4, 5], [6]], complete) == [1, 2, 3, 70, 70, 4, 5, 71, 6, 1]
    assert asked == [([[1, 2, 3], [4, 5], [6]], 10)]  # 3 + 2 + 1 < 10: all three, then from the start
    assert parity_probe("completions", 5, [[1, 2, 3], [4, 5], [6]], complete) == [1, 2, 3, 70, 70]
    assert asked[-1] == ([[1, 2, 3], [4, 5]], 5)  # 3 + 2 fill 5: the third prompt is not asked for
    assert parity_probe("prompt", 7, [[1, 2, 3], [4]]) == [1, 2, 3, 1, 2, 3, 1]
    with pytest.raises(ValueError, match=r"first training prompt has 3 tokens, >= sglang.probe_tokens=3.*e\.g\. 67"):
        parity_probe("completions", 3, [[1, 2, 3]], complete)
    with pytest.raises(ValueError, match="1 completions for 2 prompts"):
        parity_probe("completions", 5, [[1, 2, 3], [4, 5]], lambda p, n: [[9]])
    with pytest.raises(ValueError, match="sglang.probe: 'rollout' is not one of completions, prompt"):
        parity_probe("rollout", 5, [[1]])


def test_parity_rule_on_hand_worked_values():
    """Four probe tokens, base log-probs b = d; the trainer's adapter moves them by (0.4, -0.4, 0.2, -0.2), so its
    effect is 0.3 nats/token; an engine at half scale moves them by half that."""
    d = [-2.0, -3.0, -1.0, -4.0]
    c = [-1.6, -3.4, -0.8, -4.2]
    half = Parity.of([-1.8, -3.2, -0.9, -4.1], d, c, d, min_effect=0.01)
    assert half.gap == pytest.approx(0.15) and half.base_gap == 0.0 and half.floor == 0.01
    assert half.effect_trainer == pytest.approx(0.3) and half.effect_engine == pytest.approx(0.15)
    assert half.effect_diff == pytest.approx(0.15) and not half.inconclusive
    assert "0.15 (> 0.25 x the trainer's effect)" in half.refusal(tolerance=0.2)  # 0.15 > 0.25 * 0.3
    assert "differ from the trainer's by 0.15 nats/token" in half.refusal(tolerance=0.1)
    faithful = Parity.of([-1.61, -3.39, -0.8, -4.2], d, c, d, min_effect=0.01)
    assert faithful.effect_diff == pytest.approx(0.005) and faithful.refusal(tolerance=0.05) is None
    # the engine and the trainer disagree on the base by 0.1 nats/token: an effect of 0.3 is below the floor
    # (10 x 0.1), so even an engine that drops the adapter (a = b) is served, flagged inconclusive
    b = [-2.1, -2.9, -1.1, -3.9]
    dropped = Parity.of(b, b, c, d, min_effect=0.01)
    assert dropped.base_gap == pytest.approx(0.1) and dropped.floor == pytest.approx(1.0)
    assert dropped.inconclusive and dropped.refusal(tolerance=0.5) is None
    assert dropped.metrics()["sync/parity_inconclusive"] == 1.0
    # a model on which they already differ by 0.45 (a random-init MoE's flipped routes): the gap is judged beyond
    # that; an adapter the engine applies where the trainer's does nothing adds 0.2 to it and is refused
    far = [-2.45, -2.55, -1.45, -3.55]
    same = Parity.of(far, far, d, d, min_effect=0.01)
    assert same.gap == pytest.approx(0.45) and same.base_gap == pytest.approx(0.45) and same.inconclusive
    assert same.refusal(tolerance=0.05) is None
    stray = Parity.of([-2.65, -2.35, -1.65, -3.35], far, d, d, min_effect=0.01)
    assert stray.gap == pytest.approx(0.65) and stray.effect_engine == pytest.approx(0.2)
    assert "by 0.65 nats/token on the probe, 0.2 more than on the base (0.45;" in stray.refusal(tolerance=0.05)
    assert stray.refusal(tolerance=0.25) is None


@pytest.mark.parametrize("scale", [0.0, 0.5, 2.0])
def test_an_adapter_the_engine_drops_or_misscales_is_refused(qwen3_dir, scale):
    """An engine that ignores the pushed adapter (scale 0) or applies it at half / double scale, with an adapter
    whose effect is conclusive (> parity_min_effect) yet so small that |engine - trainer| alone stays under
    parity_tolerance: the effect check refuses the push and the engine keeps serving the previous version."""
    trainer, engine, channel = _channel(qwen3_dir, std=0.0, verify_push="every_n", parity_tolerance=0.05)
    first = channel.push(_peft(trainer), version=1)  # B = 0: the adapter has no effect to check
    assert first.metrics()["sync/parity_inconclusive"] == 1.0
    engine.engine.adapter_scale = scale  # from here on the engine mis-loads what it is pushed
    _set_b(trainer, 0.008)
    effect = _mean_abs(_trainer_logprobs(trainer, PROBE), _trainer_logprobs(trainer, PROBE, adapter=False))
    assert 0.015 < effect < 0.035, effect  # conclusive; at double scale |a - c| ~ effect < 0.05
    with pytest.raises(SyncError, match=r"push of version 2 refused: the adapter moves the engine's log-probs by "
                       r".* SGLang dropped or mis-scaled the adapter .* keeps serving version 1"):
        channel.push(_peft(trainer), version=2)  # verified: the last check was inconclusive
    assert engine.serving("policy") == "policy@v1" and engine.weight_version == 1
    assert sorted(engine.engine.adapters) == ["policy@v1"]
    engine.engine.adapter_scale = 1.0  # the fault fixed: the push after a refusal is verified, and passes
    third = channel.push(_peft(trainer), version=3)
    assert third.parity is not None and not third.parity.inconclusive and engine.serving("policy") == "policy@v3"


def test_a_faithful_push_reports_the_adapter_effect(qwen3_dir, tmp_path):
    """The effect metrics of a faithful push against PEFT's own LoRA on transformers' Qwen3 (the adapter saved and
    loaded as a PEFT adapter; disable_adapter for the base): an independent computation of c and d."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from miles_k3.adapter import save_adapter

    trainer, engine, channel = _channel(qwen3_dir, std=0.05, verify_push="every_n", parity_tolerance=0.05)
    report = channel.push(_peft(trainer), version=1)
    save_adapter(trainer, LORA, tmp_path / "adapter", base_model_name_or_path=str(qwen3_dir))
    ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(qwen3_dir), dtype=torch.float32),
                                    str(tmp_path / "adapter")).eval()
    ids = torch.tensor([PROBE])

    def logprobs():
        with torch.no_grad():
            logp = torch.log_softmax(ref(input_ids=ids[:, :-1]).logits.float(), -1)
        return logp[0].gather(-1, ids[0, 1:, None])[:, 0].tolist()

    with_adapter = logprobs()
    with ref.disable_adapter():
        base = logprobs()
    effect = _mean_abs(with_adapter, base)
    m = report.metrics()
    assert effect > 0.05  # well above the floor (parity_min_effect=0.01; the fp32 base gap is ~0)
    assert m["sync/parity_effect_trainer"] == pytest.approx(effect, abs=1e-5)
    assert m["sync/parity_effect_engine"] == pytest.approx(effect, abs=1e-5)
    assert m["sync/parity_effect_diff"] < 1e-5 and m["sync/parity_logprob_abs_diff"] < 1e-5
    assert m["sync/parity_base_abs_diff"] < 1e-5 and m["sync/parity_inconclusive"] == 0.0
    assert engine.serving("policy") == "policy@v1"


def _pushes(channel, trainer, versions):
    """The versions among `versions` whose push was verified (a refused push counts as verified)."""
    verified = []
    for v in versions:
        try:
            if channel.push(_peft(trainer), version=v).parity is not None:
                verified.append(v)
        except SyncError:
            verified.append(v)
    return verified


def test_verify_every_n_checks_push_1_then_every_nth(qwen3_dir):
    """verify_every=3 with conclusive checks: pushes 1, 4, 7, 10; push 10 is refused (an engine that drops the
    adapter), so push 11 is verified, then 14."""
    trainer, engine, channel = _channel(qwen3_dir, std=0.05, verify_push="every_n", verify_every=3)
    assert _pushes(channel, trainer, range(1, 10)) == [1, 4, 7]
    assert len(engine.engine.calls_of("generate")) == 2 * 3  # each check: the staged version and the base
    engine.engine.adapter_scale = 0.0
    with pytest.raises(SyncError, match="push of version 10 refused"):
        channel.push(_peft(trainer), version=10)
    engine.engine.adapter_scale = 1.0
    assert _pushes(channel, trainer, range(11, 15)) == [11, 14]
    assert engine.serving("policy") == "policy@v14" and channel.pushes == 13
    quiet = SGLangChannel(engine, "policy", SGLangConfig(verify_push="never"))  # needs no probe
    calls = len(engine.engine.calls_of("generate"))
    assert quiet.push(_peft(trainer), version=15).parity is None
    assert len(engine.engine.calls_of("generate")) == calls


def test_an_inconclusive_check_makes_the_next_push_verified(qwen3_dir):
    """B = 0 (the first pushes of a run): the adapter changes nothing, so the check cannot decide; pushes are
    verified until a check is conclusive (push 3, once B is non-zero), then every verify_every-th (6)."""
    trainer, engine, channel = _channel(qwen3_dir, std=0.0, verify_push="every_n", verify_every=3,
                                        parity_tolerance=0.05)
    reports = {v: channel.push(_peft(trainer), version=v) for v in (1, 2)}
    _set_b(trainer, 0.05)
    reports |= {v: channel.push(_peft(trainer), version=v) for v in range(3, 8)}
    checked = {v: r.metrics()["sync/parity_inconclusive"] for v, r in reports.items() if r.parity is not None}
    assert checked == {1: 1.0, 2: 1.0, 3: 0.0, 6: 0.0}
    m = reports[1].metrics()  # B = 0: trainer and engine with the adapter are exactly their bases
    assert m["sync/parity_effect_trainer"] == 0.0 and m["sync/parity_effect_engine"] == 0.0
    assert engine.serving("policy") == "policy@v7"


def _greedy(model, ids, max_new, stop):
    seq = list(ids)
    with torch.no_grad():
        for _ in range(max_new):
            tok = int(model(torch.tensor([seq]), seq_lens=torch.tensor([len(seq)])).logits[0, -1].argmax())
            seq.append(tok)
            if tok == stop:
                break
    return seq[len(ids):]


def test_eval_entry_point_with_the_sglang_backend(qwen3_dir, tmp_path, monkeypatch):
    """python -m miles_k3.eval engine.backend=sglang (over the double): SGLang gets the checkpoint directory and the adapter
    file's tensors as stored, every eval request names the adapter, the greedy completions are the trainer model's
    with that adapter (and differ from the base's), and the engine is shut down at the end."""
    import miles_k3.rollout.sglang_backend as backend
    from miles_k3.adapter import save_adapter
    from miles_k3.config import compose_config
    from miles_k3.eval import run
    from miles_k3.model.build import build_tokenizer
    from miles_k3.model.hf import load_hf_model

    trainer = _policy(qwen3_dir)
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
    stored = _peft(trainer)
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
        assert out == _greedy(trainer, ids, 5, stops[0])  # the trained adapter's own greedy tokens
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
