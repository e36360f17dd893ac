"""`model.fp32_residual`: a bf16 K3 whose residual sources (block sums, partial sum) are carried in fp32, on both sides
of a run (the engine's decode, the trainer's forward), on the CPU. The fused RMSNorm's fp32 -> bf16 output is
checked in tests/kernels/test_fused_kernels.py (interpreter and GPU)."""
import pytest
import torch
from bench_module import load_benchmark
from precision_helpers import BASE, final_hidden, write_problems

from miles_k3.config_checks import check_backend
from miles_k3.model import K3Config, K3ForCausalLM
from miles_k3.model.build import ModelConfig, build_model
from miles_k3.model.k3 import K3DecoderLayer
from miles_k3.rollout.adapters import share_base

SMALL = 2.0**-9  # below half of bf16's step at 1.0 (2**-7): 1 + SMALL rounds to 1 in bf16, is exact in fp32


def _quiet_layer(layer_id: int) -> K3DecoderLayer:
    """A k3_tiny layer in bf16 whose FFN outputs 0 and whose depth mixers weigh their sources equally (zero
    pseudo-queries), so that its output is worked out by hand from its sources and the attention stub's output."""
    torch.manual_seed(0)
    layer = K3DecoderLayer(K3Config.from_name("k3_tiny"), layer_id, expert_format="bf16").to(torch.bfloat16)
    with torch.no_grad():
        for p in layer.ffn.parameters():
            p.zero_()
        layer.self_attention_res_proj.weight.zero_()
        layer.mlp_res_proj.weight.zero_()
    return layer.eval().requires_grad_(False)


def _stub(seen: list):
    def attn_fn(_layer, x):  # records the sublayer's input, returns SMALL everywhere (in the sublayer's dtype)
        seen.append(x)
        return torch.full_like(x, SMALL)
    return attn_fn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_small_sublayer_output_survives_in_an_fp32_sum_and_is_lost_in_bf16(dtype):
    layer = _quiet_layer(1)  # 1 % attn_res_block_size (4) != 0: adds to the partial sum
    d = layer.input_layernorm.weight.numel()
    bank, partial, seen = [torch.full((2, 3, d), 2.0, dtype=dtype)], torch.ones(2, 3, d, dtype=dtype), []
    out = layer(bank, partial, _stub(seen))
    # the mixer averages 2 and 1 to 1.5; RMSNorm of a constant row is 1 (weight 1): the sublayer reads bf16 ones
    assert seen[0].dtype == torch.bfloat16 and torch.equal(seen[0], torch.ones_like(seen[0]))
    assert out.dtype == dtype
    # by hand: 1 + 2**-9 (+ an FFN of 0) is exact in fp32 and rounds back to 1 in bf16
    assert torch.equal(out, torch.full_like(out, 1.0 + SMALL if dtype == torch.float32 else 1.0))


def test_a_sealing_layer_starts_an_fp32_partial_sum_from_its_bf16_output():
    layer = _quiet_layer(4)  # 4 % 4 == 0: seals the partial sum into the bank
    d = layer.input_layernorm.weight.numel()
    partial = torch.full((1, 2, d), 3.0)
    bank, seen = [torch.ones(1, 2, d)], []
    out = layer(bank, partial, _stub(seen))
    assert len(bank) == 2 and bank[-1] is partial  # sealed as it was, fp32
    assert seen[0].dtype == torch.bfloat16
    assert out.dtype == torch.float32 and torch.equal(out, torch.full_like(out, SMALL))


def _tiny(flag: bool) -> K3ForCausalLM:
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.from_name("k3_tiny")).cast(torch.bfloat16).eval().requires_grad_(False)
    model.model.fp32_residual = flag
    return model


def test_the_model_carries_fp32_sources_feeds_bf16_sublayers_and_decodes_as_it_prefills():
    model = _tiny(True)
    dtypes = []
    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(lambda _m, args: dtypes.append(args[0].dtype))
    ids = torch.randint(0, 512, (2, 6), generator=torch.Generator().manual_seed(1))
    hidden, logits = final_hidden(model, ids)
    assert set(dtypes) == {torch.bfloat16}  # every attention sublayer reads bf16
    assert hidden.dtype == torch.float32 and logits.dtype == torch.bfloat16  # the bf16 head rounds its input once
    torch.testing.assert_close(logits, model.lm_head(hidden.to(torch.bfloat16)), rtol=0, atol=0)
    out = model(ids[:, :-1], return_state=True)
    step = model.step(ids[:, -1], out.state).logits
    torch.testing.assert_close(step, logits[:, -1], rtol=0, atol=0.05)  # recurrent vs chunked KDA, bf16 sublayers
    twin = share_base(model)
    assert twin.model.fp32_residual and torch.equal(twin(ids).logits, logits)
    model.fp32_lm_head = True  # the fp32 head reads the fp32 hidden state as it is
    torch.testing.assert_close(model(ids).logits, hidden.double().matmul(model.lm_head.weight.double().T).float(),
                               rtol=0, atol=2e-5)


def test_the_flag_changes_the_bf16_arithmetic_and_not_an_fp32_models():
    ids = torch.randint(0, 512, (2, 6), generator=torch.Generator().manual_seed(2))
    assert not torch.equal(_tiny(True)(ids).logits, _tiny(False)(ids).logits)
    torch.manual_seed(0)
    fp32 = K3ForCausalLM(K3Config.from_name("k3_tiny")).eval().requires_grad_(False)
    plain = fp32(ids).logits
    fp32.model.fp32_residual = True
    assert torch.equal(fp32(ids).logits, plain)


def test_gradients_flow_through_the_fp32_stream_with_and_without_recompute():
    grads = []
    for recompute in (False, True):
        model = _tiny(True)
        model.activation_checkpointing = recompute
        weight = model.model.layers[1].input_layernorm.weight.requires_grad_(True)
        ids = torch.randint(0, 512, (2, 5), generator=torch.Generator().manual_seed(3))
        model(ids).logits.float().logsumexp(-1).sum().backward()
        assert weight.grad is not None and weight.grad.abs().sum() > 0 and weight.grad.isfinite().all()
        grads.append(weight.grad.clone())
    assert torch.equal(grads[0], grads[1])  # recomputing a layer repeats its fp32 arithmetic exactly


def test_config_sets_the_flag_and_refuses_what_cannot_honour_it(tmp_path):
    model = build_model(ModelConfig(name="k3_tiny", fp32_residual=True), torch.device("cpu"), torch.bfloat16)
    assert model.model.fp32_residual
    assert not build_model(ModelConfig(name="k3_tiny"), torch.device("cpu"), torch.bfloat16).model.fp32_residual
    with pytest.raises(ValueError, match="fp32_residual: expected true or false"):
        ModelConfig(fp32_residual="yes").validate()
    with pytest.raises(ValueError, match="fp32_residual: applies to K3 models"):
        ModelConfig(fp32_residual=True, hf_path="/ckpt/qwen3").validate()
    with pytest.raises(ValueError, match="model.fp32_residual: engine.backend=sglang"):
        check_backend(ModelConfig(path=str(tmp_path), fp32_residual=True), "sglang")
    check_backend(ModelConfig(fp32_residual=True), "native")


def test_an_fp32_residual_shrinks_the_engine_trainer_gap_of_a_trained_bf16_model(tmp_path):
    """The shipped trained k3_nano (chain_sum) in bf16 on the CPU, GRPO-shaped rollouts with replay, both with fp32
    logits: carrying the residual in fp32 as well brings the engine and the trainer nearer each other. Measured
    here: gap 2.2e-4 -> 6.6e-5, p99 0.0027 -> 0.00054 (8 prompts x 4 samples, 80 tokens; with 16 prompts 2.2e-4 ->
    7.8e-5). Each side's distance from the exact fp32 answer stays ~3.3e-3: the flag removes roundings the two sides
    make at slightly different values, not the sublayers' bf16 arithmetic."""
    data = write_problems(tmp_path / "rl.jsonl")
    head, res = load_benchmark("bench_gap_sources").run([
        "--model-dir", str(BASE), "--data", str(data), "--device", "cpu", "--dtype", "bf16", "--prompts", "8",
        "--n", "4", "--max-new-tokens", "16", "--budget-gib", "0.25", "--variants", "fp32_head,fp32_res_head"])
    assert (head["variant"], res["variant"]) == ("fp32_head", "fp32_res_head")
    assert res["tokens"] > 40
    assert res["gap"] < 0.5 * head["gap"] and res["gap_p99"] < 0.5 * head["gap_p99"]


@pytest.fixture
def fresh_gemm_reduction():
    """torch's bf16 GEMM setting at its default for the test, and given back afterwards."""
    before = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True  # torch's default
    yield
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = before


def test_fp32_gemm_reduction_turns_torchs_bf16_reduced_precision_reduction_off_once(fresh_gemm_reduction, tmp_path):
    matmul = torch.backends.cuda.matmul
    build_model(ModelConfig(name="k3_tiny"), torch.device("cpu"), torch.bfloat16)
    assert matmul.allow_bf16_reduced_precision_reduction is True  # the default leaves torch's setting alone
    build_model(ModelConfig(name="k3_tiny", fp32_gemm_reduction=True), torch.device("cpu"), torch.bfloat16)
    assert matmul.allow_bf16_reduced_precision_reduction is False
    build_model(ModelConfig(name="k3_tiny", fp32_gemm_reduction=True), torch.device("cpu"), torch.float32)  # agrees
    with pytest.raises(ValueError, match="model.fp32_gemm_reduction=false: bf16 GEMMs' reduced-precision reduction is already off"):
        build_model(ModelConfig(name="k3_tiny"), torch.device("cpu"), torch.bfloat16)
    assert matmul.allow_bf16_reduced_precision_reduction is False
    with pytest.raises(ValueError, match="fp32_gemm_reduction: expected true or false"):
        ModelConfig(fp32_gemm_reduction="on").validate()
    with pytest.raises(ValueError, match="model.fp32_gemm_reduction: engine.backend=sglang"):
        check_backend(ModelConfig(path=str(tmp_path), fp32_gemm_reduction=True), "sglang")
