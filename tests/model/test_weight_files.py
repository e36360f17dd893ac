"""K3 model-weights directories (`miles_k3.model.weight_files`, `weight_writer`) on k3_tiny (CPU): save/load
round trips in both expert formats, the sharded layout, the published naming quirks, every validation error,
atomic writes, the quantize / init_checkpoint CLIs, and build_model with a model.path."""
import json
import os
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from miles_k3.kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from miles_k3.model import K3Config, K3ForCausalLM, weight_writer
from miles_k3.model.build import ModelConfig, build_model, weights_dir
from miles_k3.model.config import ConfigError
from miles_k3.model.weight_files import (
    EXPERT_NAME,
    INDEX_FILE,
    WeightsError,
    mxfp4_quantization_config,
)
from miles_k3.model.weight_writer import config_with_quantization, save_weights
from miles_k3.model.weights import load_k3
from miles_k3.quantize import main as quantize_main
from miles_k3.quantize import quantize_checkpoint

P = "language_model."
# Tiny tensors: one thread is as fast, and avoids OpenMP spin-waits when the 2 cores are shared.
ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
FP32 = ("A_log", "dt_bias", "conv1d.weight", "o_norm.weight", "e_score_correction_bias")
SMALL_SHARD = 400_000  # bytes: k3_tiny (~4.3 MB in bf16) splits into ~10 shards


def _model(fmt: str, seed: int = 0) -> K3ForCausalLM:
    """k3_tiny with bf16-representable values held in fp32 (so a bf16 round trip is exact), non-zero AttnRes
    queries and a non-zero router bias, so every tensor matters."""
    torch.manual_seed(seed)
    model = K3ForCausalLM(K3Config.from_name("k3_tiny"), expert_format=fmt)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("_res_proj.weight", "e_score_correction_bias")):
                p.normal_(0, 0.5)
    return model.cast(torch.bfloat16).cast(torch.float32).eval().requires_grad_(False)


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(seed))


def _logits(model: K3ForCausalLM) -> torch.Tensor:
    with torch.no_grad():
        return model(_ids()).logits


def _assert_same_state(a: K3ForCausalLM, b: K3ForCausalLM) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def models():
    return {fmt: _model(fmt) for fmt in ("bf16", "mxfp4")}


@pytest.fixture(scope="module")
def saved(models, tmp_path_factory):
    """Sharded checkpoints of both formats (module scope; tests copy before modifying)."""
    root = tmp_path_factory.mktemp("ckpt")
    return {fmt: save_weights(m, root / fmt, max_shard_bytes=SMALL_SHARD) for fmt, m in models.items()}


def _all_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    index = json.loads((ckpt / INDEX_FILE).read_text())["weight_map"]
    out = {}
    for file in sorted(set(index.values())):
        out.update(load_file(ckpt / file))
    return out


def _single_file_copy(src: Path, dst: Path, edit) -> Path:
    """A copy of checkpoint `src` as one model.safetensors whose tensors went through `edit(dict)`."""
    tensors = _all_tensors(src)
    edit(tensors)
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    save_file(tensors, dst / "model.safetensors")
    return dst


# ---- round trips and layout ----------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_save_load_round_trip(models, saved, fmt):
    loaded = load_k3(saved[fmt], "cpu", torch.float32)
    assert loaded.expert_format == fmt
    _assert_same_state(models[fmt], loaded)
    assert torch.equal(_logits(models[fmt]), _logits(loaded))
    assert not any(p.requires_grad for p in loaded.parameters())
    # the compute dtype does not change what is stored: a bf16 model writes the same bytes
    again = save_weights(load_k3(saved[fmt], "cpu", torch.bfloat16),
                         saved[fmt].parent / f"{fmt}_bf16", max_shard_bytes=SMALL_SHARD)
    for file in sorted(p.name for p in saved[fmt].iterdir()):
        assert (saved[fmt] / file).read_bytes() == (again / file).read_bytes(), file


def test_sharded_layout_index_and_names(saved):
    for fmt, ckpt in saved.items():
        index = json.loads((ckpt / INDEX_FILE).read_text())
        files = sorted(set(index["weight_map"].values()))
        assert len(files) >= 4, files
        assert files == sorted(p.name for p in ckpt.glob("*.safetensors"))
        assert all(f == f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i, f in enumerate(files))
        total = 0
        for file in files:
            with safe_open(ckpt / file, "pt") as f:
                names = list(f.keys())
                total += sum(f.get_tensor(n).numel() * f.get_tensor(n).element_size() for n in names)
            assert all(index["weight_map"][n] == file for n in names)
        assert index["metadata"]["total_size"] == total
        assert all(n.startswith(P) for n in index["weight_map"])
        assert index["weight_map"][P + "model.layers.1.self_attn.A_log"]
        with safe_open(ckpt / index["weight_map"][P + "model.layers.1.self_attn.A_log"], "pt") as f:
            a_log = f.get_tensor(P + "model.layers.1.self_attn.A_log")
        assert a_log.shape == (128,) and a_log.dtype == torch.float32  # padded as published
        assert not a_log[4:].any()
        config = json.loads((ckpt / "config.json").read_text())
        assert "quantization_config" not in config  # under text_config, as published
        if fmt == "mxfp4":
            assert config["text_config"]["quantization_config"] == mxfp4_quantization_config()
            packed = [n for n in index["weight_map"] if n.endswith(".weight_packed")]
            assert len(packed) == 8 * 16 * 3
            for n in packed:  # each pair in one shard, and each expert's six tensors together
                base = n.removesuffix(".weight_packed")
                assert index["weight_map"][base + ".weight_scale"] == index["weight_map"][n]
                assert index["weight_map"][base[:-2] + "w1.weight_packed"] == index["weight_map"][n]
        else:
            assert "quantization_config" not in config["text_config"]


def test_single_file_when_it_fits(models, tmp_path):
    ckpt = save_weights(models["bf16"], tmp_path / "one", max_shard_bytes=None)
    assert sorted(p.name for p in ckpt.iterdir()) == ["config.json", "model.safetensors"]
    _assert_same_state(models["bf16"], load_k3(ckpt, "cpu", torch.float32))


def test_format_conversion_on_load(models, saved):
    mx = models["mxfp4"]
    deq = load_k3(saved["mxfp4"], "cpu", torch.float32, expert_format="bf16")
    assert deq.expert_format == "bf16"
    experts = deq.model.layers[1].block_sparse_moe.experts
    decoded = mx.model.layers[1].block_sparse_moe.experts.dequantized("w2", torch.float32)
    assert torch.equal(experts.w2.data, decoded)
    assert torch.equal(_logits(deq), _logits(mx))
    quant = load_k3(saved["bf16"], "cpu", torch.float32, expert_format="mxfp4")
    w1 = models["bf16"].model.layers[2].block_sparse_moe.experts.w1.data[5]
    packed, scale = quantize_mxfp4(w1.bfloat16(), "floor")
    state = quant.state_dict()
    assert torch.equal(state["model.layers.2.block_sparse_moe.experts.5.w1.weight_packed"], packed)
    assert torch.equal(state["model.layers.2.block_sparse_moe.experts.5.w1.weight_scale"], scale)


def test_real_k3_naming_quirks(models, tmp_path):
    """Nested text_config with quantization_config, a 6-digit shard total, vision tensors at top level (one
    vision shard absent, as in a text-only download), A_log padded to 128 with a zero tail."""
    model = models["mxfp4"]
    cfg = model.config.to_dict()
    cfg["quantization_config"] = mxfp4_quantization_config()
    raw = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "text_config": cfg,
           "vision_config": {"vt_hidden_size": 1024}}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    layers, rest = {}, {}
    for key, t in model.state_dict().items():
        if key.endswith("A_log"):
            t = torch.cat([t, torch.zeros(128 - t.shape[0])])
        if t.dtype != torch.uint8:
            t = t.to(torch.float32 if key.endswith(FP32) else torch.bfloat16)
        (layers if key.startswith("model.layers.") else rest)[P + key] = t.clone()
    vision = {"vision_tower.patch_embed.proj.weight": torch.randn(8, 3, 2, 2).bfloat16(),
              "mm_projector.proj.0.weight": torch.randn(4, 4).bfloat16()}
    shards = {"model-00001-of-000004.safetensors": layers, "model-00002-of-000004.safetensors": rest,
              "model-00003-of-000004.safetensors": {k: v for k, v in vision.items() if k.startswith("mm_")}}
    for file, tensors in shards.items():
        save_file(tensors, tmp_path / file)
    weight_map = {n: f for f, ts in shards.items() for n in ts}
    weight_map["vision_tower.patch_embed.proj.weight"] = "model-00004-of-000004.safetensors"  # not downloaded
    (tmp_path / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    loaded = load_k3(tmp_path, "cpu", torch.float32)
    assert loaded.expert_format == "mxfp4"
    _assert_same_state(model, loaded)
    # a non-zero padding entry means A_log does not match num_heads
    layers[P + "model.layers.0.self_attn.A_log"][100] = 0.5
    save_file(layers, tmp_path / "model-00001-of-000004.safetensors")
    with pytest.raises(WeightsError, match=r"model\.layers\.0\.self_attn\.A_log.*model-00001-of-000004.*"
                                              r"must be zero"):
        load_k3(tmp_path)


# ---- config.json: written in the published nested form (what SGLang builds K3 from), read flat or nested ---
NESTED_TOP = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
              "dtype": "bfloat16", "torch_dtype": "bfloat16", "tie_word_embeddings": False}
SMALL_TOKEN_IDS = {"bos_token_id": 256, "eos_token_id": 259, "pad_token_id": 258}  # BOS, END_OF_MSG, PAD


def _shipped_flat(name: str) -> dict:
    """A shipped config file as written: the flat form (kimi_linear), as our old checkpoints' config.json."""
    return json.loads(resources.files("miles_k3.model").joinpath(f"configs/{name}.json").read_text())


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_init_checkpoint_writes_the_published_nested_config(tmp_path, fmt):
    from miles_k3.init_checkpoint import init_checkpoint

    out = init_checkpoint(K3Config.from_name("k3_tiny"), tmp_path / fmt, expert_format=fmt)
    config = json.loads((out / "config.json").read_text())
    text = config.pop("text_config")
    assert config == {**NESTED_TOP, **SMALL_TOKEN_IDS}  # no top-level quantization_config, no vision_config
    assert text["model_type"] == "kimi_linear" and text["architectures"] == ["KimiLinearForCausalLM"]
    assert text["dtype"] == "bfloat16" and text["torch_dtype"] == "bfloat16"
    expected = {**_shipped_flat("k3_tiny"), "dtype": "bfloat16", "torch_dtype": "bfloat16", **SMALL_TOKEN_IDS}
    if fmt == "mxfp4":
        assert text["quantization_config"]["format"] == "mxfp4-pack-quantized"
        assert text["quantization_config"]["quant_method"] == "compressed-tensors"
        expected["quantization_config"] = mxfp4_quantization_config()
    assert text == expected  # every shipped text key, unchanged
    assert list(text) == sorted(text)  # sorted, as published: a reload writes the same bytes
    assert load_k3(out, "cpu", torch.float32).expert_format == fmt


def test_old_flat_checkpoints_load_and_quantize_to_the_nested_form(models, saved, tmp_path):
    """An old checkpoint of ours (flat kimi_linear config.json, quantization_config at its top level) loads
    unchanged; quantize rewrites a flat bf16 one as the nested MXFP4 form."""
    flat = {}
    for fmt in ("bf16", "mxfp4"):
        flat[fmt] = tmp_path / f"flat_{fmt}"
        shutil.copytree(saved[fmt], flat[fmt])
        old = _shipped_flat("k3_tiny")
        if fmt == "mxfp4":
            old["quantization_config"] = mxfp4_quantization_config()
        (flat[fmt] / "config.json").write_text(json.dumps(old, indent=2))
        loaded = load_k3(flat[fmt], "cpu", torch.float32)
        assert loaded.expert_format == fmt
        _assert_same_state(models[fmt], loaded)
    dst = quantize_checkpoint(flat["bf16"], tmp_path / "q")
    config = json.loads((dst / "config.json").read_text())
    text = config.pop("text_config")
    assert config == NESTED_TOP
    assert text == {**_shipped_flat("k3_tiny"), "dtype": "bfloat16", "torch_dtype": "bfloat16",
                    "quantization_config": mxfp4_quantization_config()}
    native = load_k3(dst, "cpu", torch.float32)
    assert native.expert_format == "mxfp4"
    _assert_same_state(native, load_k3(flat["bf16"], "cpu", torch.float32, expert_format="mxfp4"))
    with pytest.raises(WeightsError, match="already MXFP4"):
        quantize_checkpoint(flat["mxfp4"], tmp_path / "again")


def test_shipped_flat_base_still_loads():
    directory = weights_dir(ModelConfig(path="builtin:k3_nano_chain_sum"))
    raw = json.loads((directory / "config.json").read_text())
    assert "text_config" not in raw and raw["model_type"] == "kimi_linear"  # the old flat form
    assert load_k3(directory, "cpu", torch.float32).expert_format == "mxfp4"


def test_config_with_quantization_keeps_a_nested_config():
    text = {**_shipped_flat("k3_tiny"), "dtype": "bfloat16"}
    raw = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "dtype": "bfloat16",
           "media_placeholder_token_id": 163605, "vision_config": {"vt_hidden_size": 1024},
           "text_config": text,
           "quantization_config": {"format": "stale"}}  # a top-level block would override the text_config one
    out = config_with_quantization(raw)
    assert out == {**{k: v for k, v in raw.items() if k != "quantization_config"},
                   "text_config": {**text, "quantization_config": mxfp4_quantization_config()}}
    assert raw["quantization_config"] == {"format": "stale"} and "quantization_config" not in text  # a copy


# ---- validation errors ----------------------------------------------------------------------------------
def _error(path: Path) -> str:
    with pytest.raises(WeightsError) as info:
        load_k3(path)
    return str(info.value)


EDITS = {
    "missing": (lambda t: t.pop(P + "model.layers.3.self_attn.kv_b_proj.weight"),
                ["missing tensor", "model.layers.3.self_attn.kv_b_proj.weight"]),
    "unexpected": (lambda t: t.update({P + "model.layers.0.mlp.extra_proj.weight": torch.zeros(2, 2)}),
                   ["unexpected tensor", "model.layers.0.mlp.extra_proj.weight", "model.safetensors"]),
    "shape": (lambda t: t.update({P + "model.norm.weight": torch.ones(64).bfloat16()}),
              ["model.norm.weight", "model.safetensors", "shape [64], expected [128]"]),
    "dtype": (lambda t: t.update({P + "lm_head.weight": t[P + "lm_head.weight"].half()}),
              ["lm_head.weight", "model.safetensors", "stored as F16, expected BF16"]),
    "dtype_fp32_family": (lambda t: t.update({P + "model.layers.1.self_attn.dt_bias":
                                              t[P + "model.layers.1.self_attn.dt_bias"].bfloat16()}),
                          ["model.layers.1.self_attn.dt_bias", "stored as BF16, expected F32"]),
}


@pytest.mark.parametrize("kind", sorted(EDITS))
def test_tensor_errors_name_the_tensor_and_file(saved, tmp_path, kind):
    edit, needles = EDITS[kind]
    message = _error(_single_file_copy(saved["bf16"], tmp_path / kind, edit))
    for needle in needles:
        assert needle in message, message


def test_mixed_and_incomplete_expert_formats(saved, tmp_path):
    def mix(t):
        base = P + "model.layers.2.block_sparse_moe.experts.7.w3"
        packed, scale = t.pop(base + ".weight_packed"), t.pop(base + ".weight_scale")
        t[base + ".weight"] = dequantize_mxfp4(packed, scale)

    message = _error(_single_file_copy(saved["mxfp4"], tmp_path / "mixed", mix))
    assert "mixed routed-expert formats" in message and "experts.7.w3.weight" in message, message
    lone = _single_file_copy(saved["mxfp4"], tmp_path / "lone",
                             lambda t: t.pop(P + "model.layers.4.block_sparse_moe.experts.0.w2.weight_scale"))
    message = _error(lone)
    for needle in ("experts.0.w2.weight_packed", "no matching", "model.safetensors"):
        assert needle in message, message


def test_quantization_config_is_checked(saved, tmp_path):
    ckpt = tmp_path / "q"
    shutil.copytree(saved["mxfp4"], ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 8
    (ckpt / "config.json").write_text(json.dumps(config))
    assert "weights.num_bits is 8" in _error(ckpt)
    del config["text_config"]["quantization_config"]
    (ckpt / "config.json").write_text(json.dumps(config))
    assert "no quantization_config" in _error(ckpt)


def test_truncated_shard_and_missing_shard(saved, tmp_path):
    ckpt = tmp_path / "cut"
    shutil.copytree(saved["bf16"], ckpt)
    shard = min(ckpt.glob("model-00003-of-*.safetensors"))
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 1000])
    message = _error(ckpt)
    assert shard.name in message and "truncated or corrupt" in message and P in message, message
    shard.unlink()
    message = _error(ckpt)
    assert shard.name in message and "does not exist" in message and P in message, message


# ---- atomic writes --------------------------------------------------------------------------------------
def test_failed_write_leaves_existing_destination_intact(models, tmp_path, monkeypatch):
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "marker.txt").write_text("old")
    with pytest.raises(WeightsError, match="already exists.*overwrite"):
        save_weights(models["bf16"], dest)
    real_save, calls = weight_writer.write_safetensors, []

    def failing_save(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) > 1:
            raise OSError("disk full (simulated)")
        real_save(tensors, filename, metadata=metadata)

    monkeypatch.setattr(weight_writer, "write_safetensors", failing_save)
    with pytest.raises(OSError, match="simulated"):
        save_weights(models["bf16"], dest, max_shard_bytes=SMALL_SHARD, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dest"]  # no partial directory left anywhere
    assert sorted(p.name for p in dest.iterdir()) == ["marker.txt"]
    monkeypatch.setattr(weight_writer, "write_safetensors", real_save)
    save_weights(models["bf16"], dest, overwrite=True, max_shard_bytes=None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dest"]
    assert sorted(p.name for p in dest.iterdir()) == ["config.json", "model.safetensors"]


# ---- the CLIs ---------------------------------------------------------------------------------------------
def test_quantize_cli(models, saved, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(saved["bf16"], src)
    (src / "tokenizer_config.json").write_text("{}")
    (src / "assets").mkdir()
    (src / "assets" / "logo.txt").write_text("logo")
    dst = tmp_path / "dst"
    proc = subprocess.run([sys.executable, "-m", "miles_k3.quantize", str(src), str(dst)],
                          capture_output=True, text=True, env=ENV, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (dst / "tokenizer_config.json").read_text() == "{}" and (dst / "assets" / "logo.txt").is_file()
    config = json.loads((dst / "config.json").read_text())
    assert config["text_config"]["quantization_config"] == mxfp4_quantization_config()
    assert "quantization_config" not in config
    # every non-expert tensor is byte-identical; experts are packed + scale
    src_t, dst_t = _all_tensors(src), _all_tensors(dst)
    for name, t in src_t.items():
        m = EXPERT_NAME.match(name)
        if m is None:
            assert dst_t[name].dtype == t.dtype, name
            assert torch.equal(dst_t[name].view(torch.uint8), t.view(torch.uint8)), name
        else:
            assert name not in dst_t and dst_t[m["base"] + ".weight_packed"].dtype == torch.uint8
    native = load_k3(dst, "cpu", torch.float32)
    assert native.expert_format == "mxfp4"
    # = the bf16 source with every expert replaced by dequantize(quantize(.)), and = a dequantized load of DST
    reference = load_k3(src, "cpu", torch.float32)
    for layer in reference.model.layers[1:]:
        experts = layer.block_sparse_moe.experts
        for proj in ("w1", "w2", "w3"):
            w = getattr(experts, proj).data
            w.copy_(dequantize_mxfp4(*quantize_mxfp4(w.bfloat16(), "floor"), dtype=torch.float32))
    assert torch.equal(_logits(native), _logits(reference))
    decoded = load_k3(dst, "cpu", torch.float32, expert_format="bf16")
    assert torch.equal(_logits(native), _logits(decoded))
    # the ceil rule picks different scales for some blocks
    quantize_main([str(src), str(tmp_path / "ceil"), "--scale-rule", "ceil"])
    ceil_t = _all_tensors(tmp_path / "ceil")
    scales = [n for n in dst_t if n.endswith(".weight_scale")]
    assert any(not torch.equal(dst_t[n], ceil_t[n]) for n in scales)
    with pytest.raises(SystemExit, match="already MXFP4"):
        quantize_main([str(dst), str(tmp_path / "again")])
    with pytest.raises(SystemExit, match="already exists"):
        quantize_main([str(src), str(dst)])


def test_init_checkpoint_cli_is_reproducible(tmp_path):
    from miles_k3.init_checkpoint import init_checkpoint
    from miles_k3.init_checkpoint import main as init_main

    out = tmp_path / "init"
    proc = subprocess.run([sys.executable, "-m", "miles_k3.init_checkpoint", "model=k3_tiny", f"out={out}",
                           "seed=3", "format=mxfp4"], capture_output=True, text=True, env=ENV, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    names = sorted(p.name for p in out.iterdir())
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", INDEX_FILE} <= set(names)
    shards = [n for n in names if n.endswith(".safetensors")]
    assert len(shards) == 9 + 1  # one per layer, then embedding/head/norms
    model = load_k3(out, "cpu", torch.float32)
    assert model.expert_format == "mxfp4" and torch.isfinite(_logits(model)).all()
    cfg = K3Config.from_name("k3_tiny")
    same = init_checkpoint(cfg, tmp_path / "same", seed=3, expert_format="mxfp4")
    for name in names:
        assert (out / name).read_bytes() == (same / name).read_bytes(), name
    other = init_checkpoint(cfg, tmp_path / "other", seed=4, expert_format="mxfp4")
    assert all((out / s).read_bytes() != (other / s).read_bytes() for s in shards)
    with pytest.raises(SystemExit, match="already exists.*overwrite"):
        init_main([f"out={out}"])
    with pytest.raises(SystemExit, match="^miles_k3.init_checkpoint: format: "):  # one line, as on the CLI
        init_main([f"out={tmp_path / 'x'}", "format=fp8"])


# ---- build_model --------------------------------------------------------------------------------------
def test_build_model_loads_model_path(saved):
    built = build_model(ModelConfig(path=str(saved["mxfp4"])), torch.device("cpu"), torch.float32)
    assert built.expert_format == "mxfp4"
    assert torch.equal(_logits(built), _logits(load_k3(saved["mxfp4"], "cpu", torch.float32)))
    as_bf16 = build_model(ModelConfig(path=str(saved["mxfp4"]), experts="bf16"), torch.device("cpu"),
                          torch.float32)
    assert as_bf16.expert_format == "bf16"
    random = build_model(ModelConfig(), torch.device("cpu"), torch.float32)
    assert random.expert_format == "mxfp4"


def test_build_model_hub_id_fetches_config_tokenizer_and_text_shards(saved, tmp_path, monkeypatch):
    """Two snapshot_download calls: non-weight files first, then only the shards holding text tensors."""
    import types

    repo = tmp_path / "snapshot"
    shutil.copytree(saved["mxfp4"], repo)
    index = json.loads((repo / INDEX_FILE).read_text())
    index["weight_map"]["vision_tower.patch_embed.proj.weight"] = "model-vision.safetensors"  # never fetched
    (repo / INDEX_FILE).write_text(json.dumps(index))
    calls = []
    fake = types.ModuleType("huggingface_hub")
    fake.snapshot_download = lambda repo_id, allow_patterns: calls.append((repo_id, allow_patterns)) or repo
    monkeypatch.setitem(sys.modules, "huggingface_hub", fake)
    built = build_model(ModelConfig(path="moonshotai/Kimi-K3"), torch.device("cpu"), torch.float32)
    assert built.expert_format == "mxfp4"
    (first_repo, first), (_, second) = calls
    assert first_repo == "moonshotai/Kimi-K3" and not any("safetensors" in p for p in first if p != "*.json")
    shards = sorted(set(index["weight_map"].values()) - {"model-vision.safetensors"})
    assert sorted(p for p in second if p.endswith(".safetensors")) == shards


def test_build_model_hub_id_offline(monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ConfigError, match="could not be fetched.*HF_HUB_OFFLINE.*local checkpoint directory"):
        build_model(ModelConfig(path="moonshotai/Kimi-K3"), torch.device("cpu"), torch.float32)
