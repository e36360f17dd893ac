"""PEFT-format adapter directories (k3_tiny, CPU): layout and key names, PEFT's own loaders, exact round
trips, and rejections that name the offending key or field."""
import copy
import json
import re
import shutil

import pytest
import torch
from lora_helpers import ALL_TARGETS
from lora_helpers import ids as _ids
from lora_helpers import randomize_adapters as _randomize_adapters
from lora_helpers import tiny as _tiny
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from miles_k3.model.adapter import (
    PEFT_PREFIX,
    WEIGHTS_FILE,
    load_adapter,
    peft_tensors,
    read_adapter,
    save_adapter,
)
from miles_k3.model.lora import (
    DEFAULT_TARGETS,
    LoRAConfig,
    LoRALinear,
    applied_lora_config,
    apply_lora,
    lora_parameters,
)

BASE = "moonshotai/Kimi-K3"


@pytest.fixture(scope="module")
def mxfp4_base():
    """k3_tiny with MXFP4 experts (built once: quantizing the experts takes seconds); tests deep-copy it."""
    return _tiny("mxfp4")


# ---- PEFT adapter directory -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def exported(mxfp4_base, tmp_path_factory):
    """(base model without LoRA, the trained-looking LoRA model, its config, the adapter directory)."""
    base = mxfp4_base
    model = copy.deepcopy(base)
    cfg = LoRAConfig(rank=4, alpha=8.0, targets=ALL_TARGETS)
    apply_lora(model, cfg)
    _randomize_adapters(model)
    path = save_adapter(model, cfg, tmp_path_factory.mktemp("adapters") / "k3-lora", BASE)
    return base, model, cfg, path


def test_peft_directory_layout(exported):
    from peft import LoraConfig, PeftType

    _, model, cfg, path = exported
    assert sorted(p.name for p in path.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    peft_cfg = LoraConfig.from_pretrained(str(path))
    assert peft_cfg.peft_type == PeftType.LORA and peft_cfg.task_type == "CAUSAL_LM"
    assert (peft_cfg.r, peft_cfg.lora_alpha, peft_cfg.use_rslora, peft_cfg.use_dora) == (4, 8.0, False, False)
    assert set(peft_cfg.target_modules) == set(ALL_TARGETS) and peft_cfg.base_model_name_or_path == BASE
    raw = json.loads((path / "adapter_config.json").read_text())
    assert raw["modules_to_save"] is None and raw["bias"] == "none" and raw["inference_mode"] is True
    with safe_open(path / WEIGHTS_FILE, "pt") as f:
        assert f.metadata() == {"format": "pt"}
    tensors = load_file(path / WEIGHTS_FILE)
    layers = model.model.layers
    num_linears = sum(isinstance(m, LoRALinear) for m in model.modules())
    assert len(tensors) == 2 * num_linears + 2 * 3 * 16 * 8  # 16 experts x 3 projections x 8 MoE layers
    shapes = {
        "model.layers.1.self_attn.q_proj.lora_A.weight": (4, 128),
        "model.layers.1.self_attn.q_proj.lora_B.weight": (128, 4),
        "model.layers.3.self_attn.kv_b_proj.lora_B.weight": (4 * (16 + 16), 4),
        "model.layers.0.mlp.down_proj.lora_A.weight": (4, 384),
        "model.layers.2.block_sparse_moe.shared_experts.gate_proj.lora_B.weight": (128, 4),
        "model.layers.1.block_sparse_moe.experts.3.w1.lora_A.weight": (4, 64),   # [r, Dl]
        "model.layers.1.block_sparse_moe.experts.3.w1.lora_B.weight": (64, 4),   # [I, r]
        "model.layers.8.block_sparse_moe.experts.15.w2.lora_A.weight": (4, 64),  # [r, I]
        "model.layers.8.block_sparse_moe.experts.15.w2.lora_B.weight": (64, 4),  # [Dl, r]
    }
    for key, shape in shapes.items():
        assert tensors[PEFT_PREFIX + key].shape == shape and PEFT_PREFIX == "base_model.model.language_model."
    assert torch.equal(tensors[PEFT_PREFIX + "model.layers.1.self_attn.q_proj.lora_A.weight"],
                       layers[1].self_attn.q_proj.lora_A.weight)
    # Orientation guard (Dl == I here, so shapes cannot catch a transposition): the delta rebuilt from the
    # file's 2-D tensors, s * x @ A^T @ B^T, equals the expert LoRA's own output for expert 3 of layer 1.
    w2 = layers[1].block_sparse_moe.experts.lora["w2"]
    a = tensors[PEFT_PREFIX + "model.layers.1.block_sparse_moe.experts.3.w2.lora_A.weight"]
    b = tensors[PEFT_PREFIX + "model.layers.1.block_sparse_moe.experts.3.w2.lora_B.weight"]
    x = torch.randn(5, 64)
    counts = [0] * 16
    counts[3] = 5
    with torch.no_grad():
        torch.testing.assert_close(w2(x, counts), cfg.scale * x @ a.t() @ b.t(), rtol=1e-5, atol=1e-6)


def test_save_refuses_existing_dir_and_a_config_that_differs_from_the_model(exported, tmp_path):
    _, model, cfg, path = exported
    with pytest.raises(FileExistsError, match="overwrite=True"):
        save_adapter(model, cfg, path, BASE)
    with pytest.raises(ValueError, match=r"lora_cfg: r=8 but the model's LoRA has 4"):
        save_adapter(model, LoRAConfig(rank=8, alpha=8.0, targets=ALL_TARGETS), tmp_path / "x", BASE)
    out = save_adapter(model, cfg, tmp_path / "again", BASE)
    (out / "stale.txt").write_text("old")
    save_adapter(model, cfg, out, BASE, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again"]  # no temp or old dirs left behind
    assert not (out / "stale.txt").exists()


def test_load_adapter_round_trip_is_exact(exported):
    base, model, cfg, path = exported
    ids = _ids(2, 16, seed=6)
    with torch.no_grad():
        want = model(ids).logits
    fresh = copy.deepcopy(base)
    assert load_adapter(fresh, path) == cfg  # no LoRA yet: load applies it from the file's config
    prepared = copy.deepcopy(base)
    apply_lora(prepared, cfg)
    addresses = {n: p.data_ptr() for n, p in lora_parameters(prepared).items()}
    load_adapter(prepared, path)
    assert {n: p.data_ptr() for n, p in lora_parameters(prepared).items()} == addresses  # copied in place
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, want)
        assert torch.equal(prepared(ids).logits, want)


def test_peft_loads_our_directory_into_the_same_logits(mxfp4_base, tmp_path):
    """PEFT's own loader (PeftModel.from_pretrained on a module holding our base under `language_model`)
    maps our keys onto its LoRA layers and reproduces our logits: names, A/B orientation and scaling agree.
    Attention/MLP targets only: PEFT has no module for our stacked MXFP4 experts."""
    from peft import PeftModel

    class Holder(nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.language_model = lm

        def forward(self, ids):
            return self.language_model(ids).logits

        def prepare_inputs_for_generation(self, *args, **kwargs):  # PeftModelForCausalLM wants one
            return kwargs

    base = mxfp4_base
    ours = copy.deepcopy(base)
    cfg = LoRAConfig(rank=4, alpha=8.0, use_rslora=True)
    apply_lora(ours, cfg)
    _randomize_adapters(ours)
    holder = Holder(copy.deepcopy(base))
    PeftModel.from_pretrained(holder, str(save_adapter(ours, cfg, tmp_path / "a", BASE)))
    ids = _ids(2, 16, seed=7)
    with torch.no_grad():
        theirs = holder(ids)
        assert torch.equal(theirs, ours(ids).logits)
        assert (theirs - base(ids).logits).abs().max() > 0.1


def _edit_tensors(path, fn):
    tensors = load_file(path / WEIGHTS_FILE)
    fn(tensors)
    save_file(tensors, path / WEIGHTS_FILE, metadata={"format": "pt"})


def _edit_config(path, **fields):
    cfg_file = path / "adapter_config.json"
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), **fields}))


def _truncate(path):
    data = (path / WEIGHTS_FILE).read_bytes()
    (path / WEIGHTS_FILE).write_bytes(data[: len(data) // 2])


Q_A = PEFT_PREFIX + "model.layers.2.self_attn.q_proj.lora_A.weight"
W2_B = PEFT_PREFIX + "model.layers.3.block_sparse_moe.experts.5.w2.lora_B.weight"
B_PROJ = PEFT_PREFIX + "model.layers.1.self_attn.b_proj.lora_A.weight"
REJECTIONS = {
    "rank": (None, {"rank": 8}, r"r=4 but the model's LoRA has 8"),
    "alpha": (None, {"alpha": 16.0}, r"lora_alpha=8.0 but the model's LoRA has 16.0"),
    "targets": (None, {"targets": list(DEFAULT_TARGETS)}, r"target_modules=.* but the model's LoRA has"),
    "shape": (lambda p: _edit_tensors(p, lambda t: t.update({W2_B: torch.zeros(64, 5)})), None,
              re.escape(W2_B) + r" has shape \(64, 5\), the model expects \(64, 4\)"),
    "missing": (lambda p: _edit_tensors(p, lambda t: t.pop(Q_A)), None,
                r"missing key\(s\) " + re.escape(Q_A)),
    "unexpected": (lambda p: _edit_tensors(p, lambda t: t.update({B_PROJ: torch.zeros(4, 128)})), None,
                   r"unexpected key\(s\) " + re.escape(B_PROJ)),
    "dtype": (lambda p: _edit_tensors(p, lambda t: t.update({Q_A: torch.zeros(4, 128, dtype=torch.int64)})), None,
              re.escape(Q_A) + r" has dtype I64; adapter tensors must be floating point"),
    "truncated": (_truncate, None, r"adapter_model.safetensors: unreadable .* truncated or corrupt"),
    "peft_type": (lambda p: _edit_config(p, peft_type="PREFIX_TUNING"), None,
                  r"peft_type is 'PREFIX_TUNING'; only LORA"),
    "dora": (lambda p: _edit_config(p, use_dora=True), None, r"use_dora=True is not supported"),
    "regex": (lambda p: _edit_config(p, target_modules=".*proj"), None,
              r"target_modules='\.\*proj' must be a list"),
}


@pytest.mark.parametrize("case", list(REJECTIONS))
def test_load_adapter_rejects_with_the_offending_key_or_field(exported, tmp_path, case):
    base, _, cfg, path = exported
    edit_dir, model_lora, match = REJECTIONS[case]
    adapter = shutil.copytree(path, tmp_path / "adapter")
    model = copy.deepcopy(base)
    if edit_dir is not None:
        edit_dir(adapter)
    if model_lora is not None:
        apply_lora(model, LoRAConfig(**{**vars(cfg), **model_lora}))
    before = {n: p.detach().clone() for n, p in lora_parameters(model).items()}
    with pytest.raises(ValueError, match=match):
        load_adapter(model, adapter)
    if model_lora is None:
        assert applied_lora_config(model) is None  # the LoRA that load applied itself was removed again
    else:
        assert all(torch.equal(p, before[n]) for n, p in lora_parameters(model).items())  # nothing written


def test_load_adapter_missing_files(exported, tmp_path):
    base, _, _, path = exported
    adapter = shutil.copytree(path, tmp_path / "adapter")
    (adapter / WEIGHTS_FILE).unlink()
    with pytest.raises(FileNotFoundError, match="adapter_model.safetensors: missing"):
        load_adapter(copy.deepcopy(base), adapter)
    with pytest.raises(FileNotFoundError, match="adapter_config.json: missing"):
        load_adapter(copy.deepcopy(base), tmp_path / "nowhere")


# ---- read_adapter: the tensors as stored, for an engine that loads them itself (SGLang) -------------------------
def test_read_adapter_returns_the_config_and_the_stored_tensors(exported):
    _, model, cfg, path = exported
    got_cfg, tensors = read_adapter(path)
    assert (got_cfg.rank, got_cfg.alpha, sorted(got_cfg.targets)) == (cfg.rank, cfg.alpha, sorted(cfg.targets))
    want = peft_tensors(model)
    assert sorted(tensors) == sorted(want)
    assert all(torch.equal(tensors[k], want[k].detach()) for k in want)


READ_REJECTIONS = {
    "no pair": (lambda t: t.pop(Q_A), re.escape(Q_A) + r" is missing; the file is incomplete"),
    "rank": (lambda t: t.update({W2_B: torch.zeros(64, 5)}), r"experts.5.w2 has lora_A .* but r=4"),
    "not a target": (lambda t: t.update({B_PROJ: torch.zeros(4, 128), B_PROJ.replace("lora_A", "lora_B"):
                                         torch.zeros(128, 4)}), re.escape(B_PROJ) + " adapts a module that is not"),
    "odd key": (lambda t: t.update({PEFT_PREFIX + "model.norm.weight": torch.zeros(4)}),
                r"unexpected key .*model.norm.weight; an adapter holds only"),
    "nan": (lambda t: t[Q_A].view(-1).__setitem__(0, float("nan")), re.escape(Q_A) + r" must be a 2-D finite"),
}


@pytest.mark.parametrize("case", list(READ_REJECTIONS))
def test_read_adapter_rejects_a_file_that_is_not_its_configs_lora(exported, tmp_path, case):
    _, _, _, path = exported
    adapter = shutil.copytree(path, tmp_path / "adapter")
    edit, match = READ_REJECTIONS[case]
    _edit_tensors(adapter, edit)
    with pytest.raises(ValueError, match=r"adapter_model.safetensors: .*" + match):
        read_adapter(adapter)
