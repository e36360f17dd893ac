"""Shared by the K3-on-SGLang tests (test_sglang_k3, test_sglang_k3_entry): the smallest K3 SGLang's kernels serve,
its model with an adapter, and the LoRA configs and probe they use."""
import torch
from sglang_helpers import set_lora_b

from miles_k3.model.lora import LoRAConfig, apply_lora

K3_MLA = LoRAConfig(rank=4, alpha=8.0, targets=["q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "kv_b_proj"])
K3_DEFAULT = LoRAConfig(rank=4, alpha=8.0)  # KDA + MLA + MLP targets: SGLang's K3 LoRA cannot serve them
K3_PROBE = [256, 49, 53, 45, 52, 51, 61, 49, 50, 43, 52]


def servable_raw(**edits):
    """k3_nano cut to what SGLang 0.5.17 serves (hidden 1024, KDA head_dim = v_head_dim) and to 2 layers (KDA +
    dense MLP, then MLA + MoE): the smallest K3 its kernels take. k3_tiny / k3_nano themselves are refused."""
    from miles_k3.model.config import K3Config

    raw = K3Config.from_name("k3_nano").to_dict()
    raw.update(hidden_size=1024, num_hidden_layers=2)
    raw["linear_attn_config"].update(head_dim=16, kda_layers=[1], full_attn_layers=[2])
    return raw | edits


def k3_model(k3_dir, lora=None, std=0.0, seed=3):
    """The checkpoint in fp32 on the CPU, with `lora` applied and its B drawn from N(0, std) (0: zeros)."""
    from miles_k3.model.weights import load_k3

    model = load_k3(k3_dir, "cpu", torch.float32).eval()
    if lora is not None:
        apply_lora(model, lora)
        set_lora_b(model, std, seed)
    return model
