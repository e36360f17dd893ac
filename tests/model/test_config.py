"""K3Config: published key names, 1-based layer lists, round trips, and bad files failing with the key named."""
import json

import pytest

from miles_k3.model.config import SHIPPED_CONFIGS, ConfigError, K3Config
from miles_k3.model.weight_files import config_json, nested_config


@pytest.mark.parametrize("name", SHIPPED_CONFIGS)
def test_round_trip_is_exact(tmp_path, name):
    cfg = K3Config.from_name(name)
    cfg.save(tmp_path / "config.json")
    again = K3Config.from_json_file(tmp_path / "config.json")
    assert again == cfg
    assert again.to_dict() == cfg.to_dict()
    assert not (tmp_path / "config.json.tmp").exists()


def test_k3_layer_schedule_converted_once_to_zero_based():
    cfg = K3Config.from_name("k3")
    mla = [i for i in range(93) if (i + 1) % 4 == 0 or i == 92]
    assert list(cfg.mla_layer_ids) == mla
    assert len(cfg.kda_layer_ids) == 69 and len(mla) == 24
    assert set(cfg.kda_layer_ids) | set(mla) == set(range(93))
    assert [i for i in range(93) if cfg.is_moe_layer(i)] == list(range(1, 93))
    # written back 1-based, as published
    lac = cfg.to_dict()["linear_attn_config"]
    assert lac["full_attn_layers"][-2:] == [92, 93] and lac["kda_layers"][:3] == [1, 2, 3]


def test_published_nested_text_config_and_extra_keys_are_kept(tmp_path):
    flat = K3Config.from_name("k3").to_dict()
    flat["rope_theta"] = 10000.0
    flat["quantization_config"] = {"quant_method": "compressed-tensors"}
    published = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
                 "text_config": flat, "vision_config": {"vt_hidden_size": 1024}}
    (tmp_path / "config.json").write_text(json.dumps(published))
    cfg = K3Config.from_json_file(tmp_path / "config.json")
    assert cfg.hidden_size == 7168
    assert cfg.extra["rope_theta"] == 10000.0
    assert cfg.to_dict()["quantization_config"] == {"quant_method": "compressed-tensors"}


@pytest.mark.parametrize("name", SHIPPED_CONFIGS)
def test_flat_to_nested_round_trip_keeps_every_text_key(tmp_path, name):
    """The published nested form we write (`config_json`) holds every flat text key, extra ones
    included, under text_config; it reads back to the same config and is written again byte for byte."""
    flat = K3Config.from_name(name).to_dict()
    flat.update(rope_theta=10000.0, rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
                num_nextn_predict_layers=0)
    cfg = K3Config.from_dict(flat)
    nested = config_json(cfg, "bf16")
    assert nested == nested_config(flat)
    text = nested.pop("text_config")
    assert text == {**flat, "dtype": "bfloat16", "torch_dtype": "bfloat16"}
    assert text["model_type"] == "kimi_linear" and text["architectures"] == ["KimiLinearForCausalLM"]
    ids = {k: flat[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in flat}
    assert nested == {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
                      "dtype": "bfloat16", "torch_dtype": "bfloat16", "tie_word_embeddings": False, **ids}
    written = json.dumps(config_json(cfg, "bf16"), indent=2)
    (tmp_path / "config.json").write_text(written)
    again = K3Config.from_json_file(tmp_path / "config.json")
    assert again == cfg and again.extra["rope_parameters"] == flat["rope_parameters"]
    assert json.dumps(config_json(again, "bf16"), indent=2) == written


def _write(tmp_path, d):
    (tmp_path / "config.json").write_text(json.dumps(d))
    return tmp_path / "config.json"


@pytest.mark.parametrize("mutate, key", [
    (lambda d: d.pop("kv_lora_rank"), "kv_lora_rank"),
    (lambda d: d.update(hidden_size="7168"), "hidden_size"),
    (lambda d: d.update(num_experts_per_token=0), "num_experts_per_token"),
    (lambda d: d.update(num_experts_per_token=99), "num_experts_per_token"),
    (lambda d: d.update(hidden_act="silu"), "hidden_act"),
    (lambda d: d.update(mla_use_nope=False), "mla_use_nope"),
    (lambda d: d.update(rms_norm_eps=-1.0), "rms_norm_eps"),
    (lambda d: d.update(tie_word_embeddings="no"), "tie_word_embeddings"),
    (lambda d: d["linear_attn_config"].update(full_attn_layers=[4, 8]), "linear_attn_config"),
    (lambda d: d["linear_attn_config"].update(kda_layers=[0, 1, 2, 3, 5, 6, 7]), "kda_layers"),
    (lambda d: d["linear_attn_config"].update(full_attn_layers=[3, 4, 8, 9]), "linear_attn_config"),
    (lambda d: d["linear_attn_config"].update(gate_lower_bound=None), "gate_lower_bound"),
    (lambda d: d["linear_attn_config"].pop("head_dim"), "head_dim"),
    (lambda d: d["linear_attn_config"].update(use_full_rank_gate=False), "use_full_rank_gate"),
])
def test_bad_values_fail_naming_the_key(tmp_path, mutate, key):
    d = K3Config.from_name("k3_tiny").to_dict()
    mutate(d)
    with pytest.raises(ConfigError, match=key) as err:
        K3Config.from_json_file(_write(tmp_path, d))
    assert "config.json" in str(err.value)


def test_typo_is_pointed_out(tmp_path):
    d = K3Config.from_name("k3_tiny").to_dict()
    d["num_expert"] = d.pop("num_experts")
    with pytest.raises(ConfigError, match=r"missing key 'num_experts'.*'num_expert'"):
        K3Config.from_json_file(_write(tmp_path, d))


def test_unreadable_files(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        K3Config.from_json_file(tmp_path / "config.json")
    (tmp_path / "config.json").write_text('{"vocab_size": 5,')
    with pytest.raises(ConfigError, match="not valid JSON"):
        K3Config.from_json_file(tmp_path / "config.json")
    with pytest.raises(ConfigError, match="unknown model config"):
        K3Config.from_name("k4")
