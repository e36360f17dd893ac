"""K3 on SGLang (`rollout/sglang_k3.py` and the K3 paths of the backend and its channels) on the CPU, against the
K3 path of `tests/sglang_double.py`, which mimics SGLang 0.5.17's KimiK3ForConditionalGeneration as its source reads
(IT IS NOT SGLANG): the checkpoint checks and server arguments, push-mode resolution, merged pushes and their
checks, on a 2-layer K3 of hidden 1024 (the smallest one SGLang's K3 kernels serve; the `k3_dir` fixture of
conftest). The training loop and the eval entry point over it: test_sglang_k3_entry.py."""
import functools
import json
import sys

import pytest
import torch
from sglang_helpers import LORA, peft_of, set_lora_b, trainer_logprobs
from sglang_k3_helpers import K3_DEFAULT, K3_MLA, K3_PROBE, k3_model, servable_raw

from miles_k3.model.lora import LoRAConfig, apply_lora, lora_parameters
from miles_k3.rollout.sglang_backend import SGLangConfig, SGLangEngine, server_args
from miles_k3.weight_sync.push import SyncError
from miles_k3.weight_sync.sglang import SGLangChannel
from tests.sglang_double import FakeSGLangEngine


def _write_config(directory, raw):
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(raw))
    return directory


def test_k3_server_args(k3_dir, tmp_path):
    """A K3 directory: multimodal off, bf16 under dtype=auto, Marlin for MXFP4 experts (absent for bf16), LoRA only
    for a LoRA push."""
    from miles_k3.init_checkpoint import init_checkpoint
    from miles_k3.model.config import K3Config
    from miles_k3.rollout.sglang_k3 import k3_checkpoint

    eng = SGLangEngine(SGLangConfig(), str(k3_dir), lora=K3_MLA, engine_cls=FakeSGLangEngine)
    assert eng.push == "lora" and eng.k3 is not None and not eng.k3.mxfp4
    assert eng.engine.server_args == {
        "model_path": str(k3_dir), "skip_tokenizer_init": True, "random_seed": 0, "attention_backend": "triton",
        "sampling_backend": "pytorch", "mem_fraction_static": 0.4, "disable_cuda_graph": False,
        "enable_memory_saver": True, "enable_weights_cpu_backup": False, "dtype": "bfloat16", "log_level": "error",
        "enable_multimodal": False, "enable_lora": True, "max_lora_rank": 4, "lora_target_modules": K3_MLA.targets,
        "max_loras_per_batch": 3}
    merged = SGLangEngine(SGLangConfig(cuda_graph=False), str(k3_dir), lora=K3_DEFAULT, engine_cls=FakeSGLangEngine)
    assert merged.push == "merged" and "enable_lora" not in merged.engine.server_args  # the base serves it
    mx = init_checkpoint(K3Config.from_dict(servable_raw(routed_expert_hidden_size=256, moe_intermediate_size=128)),
                         tmp_path / "mx", expert_format="mxfp4")
    args = server_args(SGLangConfig(dtype="float32"), str(mx), None, k3=k3_checkpoint(str(mx), SGLangConfig()))
    assert args["moe_runner_backend"] == "marlin" and args["dtype"] == "float32" and not args["enable_multimodal"]
    own = SGLangConfig(moe_runner_backend="triton")
    assert server_args(own, str(mx), None, k3=k3_checkpoint(str(mx), own))["moe_runner_backend"] == "triton"


def test_k3_shapes_sglang_cannot_serve_are_refused_naming_each_key(tmp_path):
    from miles_k3.config import ConfigFieldError, compose_config
    from miles_k3.model.weight_files import WeightsError, mxfp4_quantization_config, nested_config
    from miles_k3.rollout.sglang_k3 import k3_checkpoint

    raw = servable_raw(hidden_size=768, num_hidden_layers=16, attn_res_block_size=1, intermediate_size=260,
                        moe_intermediate_size=36, kv_lora_rank=32, qk_rope_head_dim=72)
    raw["linear_attn_config"].update(head_dim=32, kda_layers=list(range(1, 16)), full_attn_layers=[16])
    bad = _write_config(tmp_path / "bad", nested_config(raw, mxfp4_quantization_config()))
    with pytest.raises(WeightsError) as err:
        k3_checkpoint(str(bad), SGLangConfig(attention_backend="fa3"))
    message = str(err.value)
    assert message.startswith(f"model.path: SGLang 0.5.17 cannot serve the K3 checkpoint {bad} (9 problems)")
    for named in ["hidden_size = 768: must be a multiple of 1024",
                  "linear_attn_config.head_dim = 32: must equal v_head_dim (16)",
                  "num_hidden_layers / attn_res_block_size = 16 / 1: ceil(", "+ 1 = 17 attention-residual bank rows",
                  "intermediate_size = 260: must be a multiple of 8",
                  "moe_intermediate_size * num_shared_experts = 36: must be a multiple of 8",
                  "routed_expert_hidden_size = 64: must be a multiple of 256 for MXFP4 experts on Marlin",
                  "moe_intermediate_size = 36: must be a multiple of 128", "kv_lora_rank = 32: must be >= 256",
                  "qk_rope_head_dim = 72: must be <= 64"]:
        assert named in message, named
    # the Marlin and FA3 rules apply only there: bf16 experts on triton attention leave the first five
    bf16 = _write_config(tmp_path / "bf16", nested_config(raw))
    with pytest.raises(WeightsError, match=r"\(5 problems\)"):
        k3_checkpoint(str(bf16), SGLangConfig())
    with pytest.raises(ConfigFieldError, match=r"^model.path: SGLang 0.5.17 cannot serve the K3 checkpoint"):
        compose_config("train", ["engine.backend=sglang", f"model.path={bf16}"])
    with pytest.raises(ConfigFieldError, match=r"^model.path: engine.backend=sglang serves a local K3 checkpoint"):
        compose_config("train", ["engine.backend=sglang", "model.path=moonshotai/Kimi-K3"])
    # no MLA layer at all (a K3 cut to its first KDA layers): SGLang's memory pool fails to start
    raw = servable_raw()
    n = raw["num_hidden_layers"]
    raw["linear_attn_config"].update(kda_layers=list(range(1, n + 1)), full_attn_layers=[])
    no_mla = _write_config(tmp_path / "no_mla", nested_config(raw))
    with pytest.raises(WeightsError, match=r"\(1 problem\):[\s\S]*linear_attn_config.full_attn_layers = \(\): "
                                              r"must name at least one MLA layer"):
        k3_checkpoint(str(no_mla), SGLangConfig())


def test_a_flat_k3_config_is_refused_with_the_command_that_rewrites_it(tmp_path, monkeypatch):
    from miles_k3.model.weight_files import WeightsError, mxfp4_quantization_config
    from miles_k3.rollout.sglang_k3 import FLAT_CONFIG_FIX, k3_checkpoint

    quant = mxfp4_quantization_config()
    raw = servable_raw(routed_expert_hidden_size=256, moe_intermediate_size=128, quantization_config=quant)
    flat = _write_config(tmp_path / "flat", raw)
    with pytest.raises(WeightsError, match=r"\(1 problem\):\n  - config.json is not the published nested form") \
            as err:
        k3_checkpoint(str(flat), SGLangConfig())
    assert "it would build Kimi Linear" in str(err.value) and FLAT_CONFIG_FIX in str(err.value)
    code = FLAT_CONFIG_FIX.removeprefix('python -c "').removesuffix('" DIR')
    monkeypatch.setattr(sys, "argv", ["-c", str(flat)])
    exec(code, {})  # noqa: S102 - the command, as the message gives it
    served = k3_checkpoint(str(flat), SGLangConfig())
    assert served.mxfp4 and served.config.hidden_size == 1024
    nested = json.loads((flat / "config.json").read_text())
    assert nested["model_type"] == "kimi_k3" and nested["text_config"]["quantization_config"] == quant
    assert "quantization_config" not in nested


def test_k3_push_modes_resolve_and_refuse(k3_dir, qwen3_dir, tmp_path):
    from miles_k3.config import ConfigFieldError, compose_config
    from miles_k3.model.config import ConfigError, K3Config
    from miles_k3.rollout.sglang_k3 import K3Checkpoint, resolve_push

    k3 = K3Checkpoint(K3Config.from_dict(servable_raw()), mxfp4=False)
    graphs, eager = SGLangConfig(), SGLangConfig(cuda_graph=False)
    assert resolve_push("auto", LORA, None, graphs)[0] == "lora"  # an HF model
    assert resolve_push("auto", K3_MLA, k3, graphs)[0] == "lora"
    assert resolve_push("auto", K3_DEFAULT, k3, eager)[0] == "merged"
    assert resolve_push("merged", K3_MLA, k3, eager)[0] == "merged"
    assert resolve_push("auto", None, k3, graphs) == (None, "no adapter")
    graph_safe = LoRAConfig(rank=4, alpha=8.0, targets=["q_proj", "o_proj", "f_b_proj", "down_proj"])
    assert resolve_push("auto", graph_safe, k3, graphs)[0] == "merged"  # weights SGLang reads in place
    with pytest.raises(ConfigError, match=r"^sglang.push: merged writes K3 checkpoint names"):
        resolve_push("merged", LORA, None, graphs)
    with pytest.raises(ConfigError) as err:
        resolve_push("lora", K3_DEFAULT, k3, graphs)
    message = str(err.value)
    assert message.startswith("sglang.push: lora cannot serve lora.targets q_proj (silently dropped")
    assert "g_proj (SGLang does not start" in message and "o_proj (silently removes MLA's output gate" in message
    assert "gate_proj (KeyError at startup" in message and "set sglang.push=merged" in message
    experts = LoRAConfig(rank=4, alpha=8.0, targets=["q_b_proj", "w1", "w3"])
    with pytest.raises(ConfigError, match=r"^sglang.push: merged cannot serve lora.targets \['w1', 'w3'\]: K3's "
                                          "routed experts are MXFP4"):
        resolve_push("auto", experts, k3, eager)
    with pytest.raises(ConfigError) as err:
        resolve_push("auto", K3_DEFAULT, k3, graphs)
    message = str(err.value)
    assert message.startswith("sglang.cuda_graph: a merged push re-derives tensors of lora.targets kv_b_proj (w_kc")
    assert "gate_proj (the shared experts' gate_up_proj is re-merged into a new _front_w" in message
    assert "set sglang.cuda_graph=false or drop those targets (sglang.push=auto chose merged for" in message
    bfa = LoRAConfig(rank=4, alpha=8.0, targets=["f_a_proj", "b_proj", "routed_expert_down_proj"])
    with pytest.raises(ConfigError, match=r"f_a_proj \(f_a_proj and b_proj are re-merged into a new _bfa_w"):
        resolve_push("merged", bfa, k3, graphs)
    # the same rules when the config is composed, naming the field (quickstart's targets include the experts)
    with pytest.raises(ConfigFieldError, match=r"^sglang.push: merged cannot serve lora.targets \['w1', 'w2', 'w3'\]"):
        compose_config("train", ["engine.backend=sglang", f"model.path={k3_dir}"])
    served = ["engine.backend=sglang", f"model.path={k3_dir}", f"lora.targets=[{','.join(K3_DEFAULT.targets)}]"]
    with pytest.raises(ConfigFieldError, match=r"^sglang.cuda_graph: a merged push re-derives"):
        compose_config("train", served)
    assert compose_config("train", [*served, "sglang.cuda_graph=false"]).sglang.push == "auto"
    with pytest.raises(ConfigFieldError, match=r"^sglang.push: merged writes K3 checkpoint names"):
        compose_config("train", ["engine.backend=sglang", "model.path=null", f"model.hf_path={qwen3_dir}",
                                 "sglang.push=merged"])
    assert compose_config("eval", ["engine.backend=sglang", f"model.path={k3_dir}", "sglang.push=merged",
                                   "sglang.cuda_graph=false"]).sglang.push == "merged"  # eval merges a saved adapter
    with pytest.raises(ConfigFieldError, match=r"^sglang.push: 'both' is not one of auto, lora, merged"):
        compose_config("eval", ["engine.backend=sglang", f"model.path={k3_dir}", "sglang.push=both"])


def test_rslora_is_sent_as_the_alpha_sglang_scales_by():
    """SGLang 0.5.17 scales by lora_alpha / r whatever use_rslora says: the alpha sent is alpha * sqrt(r)."""
    from miles_k3.rollout.sglang_backend import peft_config_dict

    rs = peft_config_dict(LoRAConfig(rank=16, alpha=8.0, use_rslora=True, targets=["q_b_proj"]))
    assert rs["lora_alpha"] == 32.0 and rs["use_rslora"] is False and rs["r"] == 16  # 8 / sqrt(16) = 32 / 16
    plain = peft_config_dict(LoRAConfig(rank=3, alpha=8.0, targets=["q_b_proj"]))
    assert plain["lora_alpha"] == 8.0 and plain["use_rslora"] is False


def test_merged_weights_by_hand():
    """W0 = [[1, 2], [3, 4]], A = [[1, -1]], B = [[0.5], [2]]: B @ A = [[0.5, -0.5], [2, -2]]; alpha 2, r 1 gives s 2
    and W = [[2, 1], [7, 0]]; rsLoRA r 4, alpha 4 gives s = 4 / 2 = 2 on a rank-4 A / B."""
    from torch import nn

    from miles_k3.weight_sync.sglang import base_weights, merged_weights

    layer = nn.ModuleDict({"q_b_proj": nn.Linear(2, 2, bias=False)})
    with torch.no_grad():
        layer.q_b_proj.weight.copy_(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    apply_lora(layer, LoRAConfig(rank=1, alpha=2.0, targets=["q_b_proj"]))
    adapter = {"q_b_proj.lora_A.weight": torch.tensor([[1.0, -1.0]]),
               "q_b_proj.lora_B.weight": torch.tensor([[0.5], [2.0]])}
    merged = merged_weights(layer, adapter)
    assert list(merged) == ["language_model.q_b_proj.weight"]
    assert merged["language_model.q_b_proj.weight"].tolist() == [[2.0, 1.0], [7.0, 0.0]]
    assert layer.q_b_proj.weight.tolist() == [[1.0, 2.0], [3.0, 4.0]]  # W0 untouched: never cumulative
    assert base_weights(layer)["language_model.q_b_proj.weight"].tolist() == [[1.0, 2.0], [3.0, 4.0]]
    assert merged_weights(layer)["language_model.q_b_proj.weight"].tolist() == [[1.0, 2.0], [3.0, 4.0]]  # B = 0
    rs = nn.ModuleDict({"q_b_proj": nn.Linear(2, 2, bias=False, dtype=torch.bfloat16)})
    with torch.no_grad():
        rs.q_b_proj.weight.copy_(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    apply_lora(rs, LoRAConfig(rank=4, alpha=4.0, use_rslora=True, targets=["q_b_proj"]))
    quarter = {"q_b_proj.lora_A.weight": torch.full((4, 2), 0.5), "q_b_proj.lora_B.weight": torch.full((2, 4), 0.25)}
    out = merged_weights(rs, quarter)["language_model.q_b_proj.weight"]  # B @ A = 0.5 everywhere, s = 2: + 1
    assert out.dtype == torch.bfloat16 and out.tolist() == [[2.0, 3.0], [4.0, 5.0]]
    with pytest.raises(ValueError, match="adapter tensor q_b_proj.lora_B.weight is missing"):
        merged_weights(rs, {"q_b_proj.lora_A.weight": torch.zeros(4, 2)})


def _merged_setup(k3_dir, **cfg):
    """(trainer, engine, channel): the trainer's K3 with the default targets and B = 0, the engine over the double's
    own copy of the checkpoint serving it merged (b measured here, on W0)."""
    from miles_k3.weight_sync.sglang import SGLangMergedChannel

    trainer = k3_model(k3_dir, K3_DEFAULT)
    engine = SGLangEngine(SGLangConfig(cuda_graph=False), str(k3_dir), lora=K3_DEFAULT,
                          engine_cls=functools.partial(FakeSGLangEngine, model=k3_model(k3_dir)))
    cfg = SGLangConfig(**({"cuda_graph": False, "verify_push": "every", "parity_tolerance": 1e-3} | cfg))
    channel = SGLangMergedChannel(engine, "policy", cfg, trainer, probe_ids=K3_PROBE,
                                  trainer_logprobs=lambda ids: trainer_logprobs(trainer, ids),
                                  trainer_base_logprobs=lambda ids: trainer_logprobs(trainer, ids, False))
    channel.serve_initial({n: p.detach() for n, p in lora_parameters(trainer).items()})
    return trainer, engine, channel


def _engine_weights(engine):
    return {n: p.detach().clone() for n, p in engine.engine.model.named_parameters()}


def _adapter(trainer):
    return {n: p.detach() for n, p in lora_parameters(trainer).items()}


def test_merged_pushes_serve_the_trainers_policy_and_restore_on_refusal(k3_dir):
    """Merged pushes through the double: each is W0 + s * B @ A from the frozen W0 (push 3 equals it exactly, not
    push 2's plus more), in one update call; the double's log-probs become the trainer's. A push whose names the
    engine skips, or whose update call fails, is refused and the engine serves the previous weights bitwise."""
    from miles_k3.model.lora import lora_linears

    trainer, engine, channel = _merged_setup(k3_dir)
    double = engine.engine
    assert engine.push == "merged" and not double.calls_of("load_lora_adapter_from_tensors")
    w0 = {path: m.weight.detach().clone() for path, m in lora_linears(trainer)}
    set_lora_b(trainer, 0.02, seed=5)
    first = channel.push(_adapter(trainer), version=1)
    assert first.parity.gap < 1e-4 and not first.parity.inconclusive and first.parity.effect_engine > 0.01
    assert first.num_tensors == len(w0) and first.bytes == sum(w.numel() * 4 for w in w0.values())
    assert len(double.calls_of("update_weights_from_tensor")) == 2  # the initial write and this push: one call each
    out = engine.generate(input_ids=[K3_PROBE], sampling_params={"max_new_tokens": 1}, lora="policy")
    assert out[0]["meta_info"]["weight_version"] == 1
    assert double.calls_of("generate")[-1]["lora_path"] is None  # the base serves the merged adapter
    served_v1 = _engine_weights(engine)
    set_lora_b(trainer, 0.03, seed=6)
    real = engine.write_base_weights
    skipped = {}

    def renaming(tensors):  # the fault: SGLang skips names it does not know; all but one module's are renamed
        skipped.update(tensors)
        keep = next(iter(tensors))
        real({(k if k == keep else k.replace(".weight", ".wieght")): v for k, v in tensors.items()})
        engine.write_base_weights = real  # the restore goes through unharmed

    engine.write_base_weights = renaming
    with pytest.raises(SyncError, match=r"push of version 2 refused: the engine's log-probs differ .* the engine "
                                        "serves version 1 again"):
        channel.push(_adapter(trainer), version=2)
    assert skipped and engine.weight_version == 1
    assert all(torch.equal(served_v1[n], t) for n, t in _engine_weights(engine).items())  # restored bitwise
    third = channel.push(_adapter(trainer), version=3)
    assert third.parity.gap < 1e-4 and engine.weight_version == 3
    params = dict(double.model.named_parameters())
    for path, m in lora_linears(trainer):  # push 3 = W0 + s * B3 @ A3, computed here independently
        expected = w0[path] + (m.lora_B.weight.detach() @ m.lora_A.weight.detach()) * (8.0 / 4)
        assert torch.equal(params[f"{path}.weight"].detach(), expected), path
    served_v3 = _engine_weights(engine)
    fails = iter([(False, "simulated update failure")])
    update = double.update_weights_from_tensor
    double.update_weights_from_tensor = lambda **kw: next(fails, None) or update(**kw)
    set_lora_b(trainer, 0.01, seed=7)
    with pytest.raises(SyncError, match=r"push of version 4 failed in sglang: RuntimeError: sglang "
                                        "update_weights_from_tensor failed: simulated update failure; the engine "
                                        "serves version 3 again"):
        channel.push(_adapter(trainer), version=4)
    assert all(torch.equal(served_v3[n], t) for n, t in _engine_weights(engine).items())


def test_base_weights_are_not_written_while_requests_run(k3_dir):
    trainer, engine, channel = _merged_setup(k3_dir, verify_push="never")
    real = engine.engine.generate

    def generate_during_a_write(**kw):
        with pytest.raises(RuntimeError, match="base weights cannot be updated while 1 requests run"):
            engine.write_base_weights({"language_model.model.norm.weight": torch.ones(1024)})
        with pytest.raises(SyncError, match="refused: 1 requests run .* nothing written, the engine serves version 0"):
            channel.push(_adapter(trainer), version=1)
        return real(**kw)

    engine.engine.generate = generate_during_a_write
    engine.generate(input_ids=[[1, 2]], sampling_params={"max_new_tokens": 1}, lora="policy")
    double = FakeSGLangEngine(model=k3_model(k3_dir))
    double.in_flight = 1  # the double refuses too, as SGLang's flush does
    assert double.update_weights_from_tensor(named_tensors=[])[0] is False


def test_a_kda_adapter_the_double_drops_is_refused_by_parity(k3_dir, monkeypatch):
    """The double's K3 LoRA drops KDA q/k/v as SGLang's does: pushed as LoRA anyway (resolve_push, which refuses
    it, bypassed), the adapter's effect is missing in the engine and the parity check refuses it."""
    import miles_k3.rollout.sglang_backend as backend

    kda = LoRAConfig(rank=4, alpha=8.0, targets=["q_proj", "k_proj", "v_proj", "q_b_proj"])
    trainer = k3_model(k3_dir, kda, std=0.0)
    monkeypatch.setattr(backend, "resolve_push", lambda *args: ("lora", "forced by the test"))
    engine = SGLangEngine(SGLangConfig(), str(k3_dir), lora=kda,
                          engine_cls=functools.partial(FakeSGLangEngine, model=k3_model(k3_dir, kda)))
    engine.load_lora_adapter_from_tensors("policy", peft_of(trainer), kda)
    channel = SGLangChannel(engine, "policy", SGLangConfig(verify_push="every", parity_tolerance=0.5),
                            probe_ids=K3_PROBE, trainer_logprobs=lambda ids: trainer_logprobs(trainer, ids),
                            trainer_base_logprobs=lambda ids: trainer_logprobs(trainer, ids, False))
    set_lora_b(trainer, 0.05)
    with torch.no_grad():  # the MLA adapter off: what is left is KDA's, which the engine drops
        for name, p in lora_parameters(trainer).items():
            if "q_b_proj" in name and "lora_B" in name:
                p.zero_()
    with pytest.raises(SyncError, match="SGLang dropped or mis-scaled the adapter|differ from the trainer's"):
        channel.push(peft_of(trainer), version=1)
    assert engine.serving("policy") == "policy@v0"
    # the targets SGLang's K3 LoRA has no buffer for fail its startup, as SGLang's do
    with pytest.raises(NotImplementedError, match=r"get_hidden_dim not implemented for \['g_proj'\]"):
        FakeSGLangEngine(model=k3_model(k3_dir), enable_lora=True, lora_target_modules=["q_b_proj", "g_proj"])


def test_merged_from_checkpoint_equals_the_trainers_merge_and_names_bad_adapters(k3_dir, tmp_path):
    """merged_from_checkpoint (eval's merge, from the adapter file and the checkpoint's W0) gives bit for bit what
    merged_weights gives on the trainer's model in the checkpoint's bf16; expert, foreign and mis-shaped adapters
    are refused by name."""
    from miles_k3.model.adapter import read_adapter, save_adapter
    from miles_k3.model.weights import load_k3
    from miles_k3.weight_sync.sglang import merged_from_checkpoint, merged_weights

    lora = LoRAConfig(rank=4, alpha=8.0, use_rslora=True, targets=["q_proj", "q_b_proj", "o_proj"])
    trainer = load_k3(k3_dir, "cpu", torch.bfloat16).eval()
    apply_lora(trainer, lora)
    set_lora_b(trainer, 0.2, 7)
    save_adapter(trainer, lora, tmp_path / "a", base_model_name_or_path=str(k3_dir))
    cfg, tensors = read_adapter(tmp_path / "a")
    got = merged_from_checkpoint(k3_dir, cfg, tensors)
    want = merged_weights(trainer)
    assert sorted(got) == sorted(want) and len(got) >= 3
    assert all(got[n].dtype == torch.bfloat16 and torch.equal(got[n], want[n]) for n in want)
    name = next(iter(tensors))
    with pytest.raises(ValueError, match="expert adapters cannot be merged"):
        merged_from_checkpoint(k3_dir, cfg, {name.replace("self_attn.", "mlp.experts.0."): tensors[name]})
    with pytest.raises(ValueError, match="has no such weight"):
        merged_from_checkpoint(k3_dir, cfg, {name.replace("layers.", "layers.9"): tensors[name]})
    a_name = next(n for n in tensors if n.endswith("lora_A.weight"))
    bad = dict(tensors) | {a_name: torch.zeros(4, 3)}
    with pytest.raises(ValueError, match=r"B @ A is \d+ x 3"):
        merged_from_checkpoint(k3_dir, cfg, bad)


def test_k3_m2_is_the_one_gpu_config_sglang_serves_and_k3_m_is_not():
    """k3_m2 exists for K3 on SGLang: hidden 1024, KDA 12 x 128 (= v_head_dim 128), MXFP4 experts 512 x 256, 16
    layers in blocks of 2 (9 bank rows), kv_lora 512 + rope 64: nothing to refuse even under Marlin and FA3; k3_m
    (hidden 768, latent 384) fails exactly those two rules."""
    from miles_k3.model.config import K3Config
    from miles_k3.rollout.sglang_k3 import k3_shape_problems

    assert k3_shape_problems(K3Config.from_name("k3_m2"), True, "marlin", "fa3") == []
    problems = k3_shape_problems(K3Config.from_name("k3_m"), True, "marlin", "fa3")
    assert [p.split(":")[0] for p in problems] == ["hidden_size = 768", "routed_expert_hidden_size = 384"]
