"""`model.fp32_lm_head`: the logits of a bf16 K3 computed in fp32 and not rounded back to bf16, on both sides of a run
(the engine's decode, the trainer's forward; SGLang's enable_fp32_lm_head), on the CPU."""
import pytest
import torch
from bench_module import load_benchmark
from precision_helpers import BASE, final_hidden, write_problems

from miles_k3.model import K3Config, K3ForCausalLM
from miles_k3.model.build import ModelConfig
from miles_k3.rollout.adapters import share_base
from miles_k3.rollout.sglang_backend import SGLangConfig, SGLangEngine, server_args


def _bf16_tiny_with_large_logits():
    """k3_tiny in bf16 whose lm_head rows are scaled so that logits reach ~10, where bf16's step is 2**-4."""
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.from_name("k3_tiny")).cast(torch.bfloat16).eval().requires_grad_(False)
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    return model


def test_fp32_logits_are_the_unrounded_product_and_bf16_logits_its_rounding():
    model = _bf16_tiny_with_large_logits()
    ids = torch.randint(0, 512, (2, 7), generator=torch.Generator().manual_seed(1))
    hidden, bf16_logits = final_hidden(model, ids)
    assert hidden.dtype == torch.bfloat16 and bf16_logits.dtype == torch.bfloat16
    # by hand: bf16 x bf16 products are exact in fp32; the sum over 128 dims in fp64, then fp32
    want = (hidden.double() @ model.lm_head.weight.double().T).float()
    assert want.abs().max() > 8.0  # large enough that bf16 rounding moves a logit by up to 2**-5

    model.fp32_lm_head = True
    hidden32, logits = final_hidden(model, ids)
    assert torch.equal(hidden32, hidden)  # the flag changes nothing before the head
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, want, rtol=0, atol=2e-5)
    # without the flag the same values, each rounded to bf16: off by up to half a bf16 step (plus the fp32 sum order)
    err = (bf16_logits.float() - want).abs()
    half_step = want.abs().clamp_min(2**-126).log2().floor().exp2() * 2.0**-8
    assert (err <= half_step + 2e-5).all()
    assert err.max() > 0.01  # and the rounding is large at these logits: 0.01 nats and more

    # under bf16 autocast (which changes the layers' arithmetic) the head is still the fp32 product of its input
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden_auto, auto = final_hidden(model, ids)
    assert auto.dtype == torch.float32
    want_auto = (hidden_auto.double() @ model.lm_head.weight.double().T).float()
    torch.testing.assert_close(auto, want_auto, rtol=0, atol=2e-5)


def test_decode_step_and_the_engines_twin_compute_fp32_logits():
    model = _bf16_tiny_with_large_logits()
    model.fp32_lm_head = True
    ids = torch.randint(0, 512, (2, 6), generator=torch.Generator().manual_seed(2))
    full = model(ids).logits
    out = model(ids[:, :-1], return_state=True)
    step = model.step(ids[:, -1], out.state).logits
    assert step.dtype == torch.float32
    torch.testing.assert_close(step, full[:, -1], rtol=0, atol=0.3)  # bf16 recurrent vs chunked: same logits
    twin = share_base(model)
    assert twin.fp32_lm_head and twin(ids).logits.dtype == torch.float32
    assert torch.equal(twin(ids).logits, full)


def test_an_fp32_model_is_unchanged_by_the_flag():
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.from_name("k3_tiny")).eval().requires_grad_(False)
    ids = torch.randint(0, 512, (2, 5), generator=torch.Generator().manual_seed(3))
    plain = model(ids).logits
    model.fp32_lm_head = True
    assert torch.equal(model(ids).logits, plain)


def test_gradients_reach_the_hidden_state_through_the_fp32_head():
    model = _bf16_tiny_with_large_logits()
    model.fp32_lm_head = True
    hidden = torch.randn(3, model.config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    logits = model._logits(hidden)
    logits.logsumexp(-1).sum().backward()
    # d logsumexp / d h = softmax(z) @ W, by hand in fp64
    p = torch.softmax(hidden.detach().double() @ model.lm_head.weight.double().T, -1)
    want = p @ model.lm_head.weight.double()
    assert hidden.grad.dtype == torch.bfloat16
    torch.testing.assert_close(hidden.grad.double(), want, rtol=2e-2, atol=2e-2)


def test_config_refuses_a_non_bool_and_hf_models():
    ModelConfig(fp32_lm_head=True).validate()
    with pytest.raises(ValueError, match="fp32_lm_head: expected true or false"):
        ModelConfig(fp32_lm_head="yes").validate()
    with pytest.raises(ValueError, match="fp32_lm_head: applies to K3 models"):
        ModelConfig(fp32_lm_head=True, hf_path="/ckpt/qwen3").validate()


def test_build_model_sets_the_flag():
    from miles_k3.model.build import build_model

    model = build_model(ModelConfig(name="k3_tiny", fp32_lm_head=True), torch.device("cpu"), torch.bfloat16)
    assert model.fp32_lm_head
    assert model(torch.zeros(1, 3, dtype=torch.long)).logits.dtype == torch.float32


def test_sglang_gets_enable_fp32_lm_head(k3_dir, monkeypatch):
    from sglang_k3_helpers import K3_MLA, k3_model

    from miles_k3.rollout import sglang_backend
    from tests.sglang_double import FakeSGLangEngine

    assert "enable_fp32_lm_head" not in server_args(SGLangConfig(), "/ckpt", None)
    assert server_args(SGLangConfig(), "/ckpt", None, fp32_lm_head=True)["enable_fp32_lm_head"] is True
    with pytest.raises(ValueError, match=r"extra_args: \['enable_fp32_lm_head'\].*model.fp32_lm_head"):
        SGLangConfig(extra_args={"enable_fp32_lm_head": True}).validate()

    def engine_cls(**args):
        return FakeSGLangEngine(model=k3_model(k3_dir).to(torch.bfloat16), **args)

    monkeypatch.setattr(sglang_backend, "import_engine_class", lambda: engine_cls)
    for flag in (True, False):
        eng = sglang_backend.serve_checkpoint(SGLangConfig(), ModelConfig(path=str(k3_dir), fp32_lm_head=flag),
                                              None, [1], lora=K3_MLA)
        assert isinstance(eng, SGLangEngine)
        assert eng.engine.server_args.get("enable_fp32_lm_head", False) is flag
        assert eng.engine.model.fp32_lm_head is flag


@pytest.mark.slow
def test_fp32_logits_shrink_the_engine_trainer_gap_of_a_trained_bf16_model(tmp_path):
    """The shipped trained k3_nano (chain_sum) in bf16 on the CPU, GRPO-shaped rollouts with replay: with fp32 logits
    each side is nearer the exact (fp32) answer and the two nearer each other. Measured here: gap 8.6e-4 -> 2.2e-4
    (p99 0.017 -> 0.0027), engine from exact 6.0e-3 -> 3.2e-3, trainer 6.3e-3 -> 3.2e-3 (8 prompts x 4 samples, 80
    tokens; with 16 prompts the same ratios)."""
    data = write_problems(tmp_path / "rl.jsonl")
    default, head = load_benchmark("bench_gap_sources").run([
        "--model-dir", str(BASE), "--data", str(data), "--device", "cpu", "--dtype", "bf16", "--prompts", "8",
        "--n", "4", "--max-new-tokens", "16", "--budget-gib", "0.25", "--variants", "default,fp32_head"])
    assert (default["variant"], head["variant"]) == ("default", "fp32_head")
    assert head["tokens"] > 40
    assert head["gap"] < 0.6 * default["gap"] and head["gap_p99"] < 0.6 * default["gap_p99"]
    assert head["engine_vs_exact"] < 0.7 * default["engine_vs_exact"]  # the engine's logits are fp32 too
    assert head["trainer_vs_exact"] < 0.7 * default["trainer_vs_exact"]
