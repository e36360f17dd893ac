"""Shared by the LoRA and adapter tests: k3_tiny builders, token ids, deterministic adapter values."""
import torch

from miles_k3.model import K3Config, K3ForCausalLM
from miles_k3.model.lora import DEFAULT_TARGETS, lora_parameters

ALL_TARGETS = [*DEFAULT_TARGETS, "w1", "w2", "w3"]


def ids(b, t, seed=0):
    return torch.randint(0, 512, (b, t), generator=torch.Generator().manual_seed(seed))


def tiny(expert_format="mxfp4", seed=0):
    """k3_tiny in fp32 with non-zero AttnRes queries (so the depth mixers are exercised)."""
    torch.manual_seed(seed)
    model = K3ForCausalLM(K3Config.from_name("k3_tiny"), expert_format=expert_format)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_res_proj.weight"):
                p.normal_(0, 0.5)
    return model.eval()


def randomize_adapters(model, seed=1, std=0.1):
    """Deterministic non-zero adapter values (B too), identical for models with the same adapters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(lora_parameters(model).items()):
            p.copy_(torch.randn(p.shape, generator=g) * std)


def hf_policy(directory, lora, device="cpu", seed=0, std=0.05):
    """The HF checkpoint at `directory` in fp32 on `device` with LoRA `lora` applied and random B (std `std`, after
    torch.manual_seed(seed)): an adapter that changes the outputs. In training mode, as the trainer holds it
    (`load_hf_model`); sequence_logprobs scores in eval mode."""
    from miles_k3.model.hf import load_hf_model
    from miles_k3.model.lora import apply_lora

    model = load_hf_model(str(directory), torch.device(device), torch.float32)
    torch.manual_seed(seed)
    apply_lora(model, lora)
    with torch.no_grad():
        for n, p in lora_parameters(model).items():
            if "lora_B" in n:
                p.normal_(0, std)
    return model
