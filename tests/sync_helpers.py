"""Shared by the weight-sync tests (tests/weight_sync/test_weight_sync.py, and the spawned ranks of
tests/parallel/test_parallel_loop.py: import-light, no pytest): one deterministic k3_tiny base, a trainer copy with
a non-zero adapter, an engine serving adapter "policy", greedy outputs."""
import functools

import torch
from engine_helpers import small_engine

from miles_k3.model import K3Config, K3ForCausalLM
from miles_k3.model.lora import LoRAConfig, apply_lora, lora_parameters, lora_state_dict
from miles_k3.rollout.engine import RolloutEngine

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [5, 6, 7], [300, 17]]
LORA = LoRAConfig(rank=4, alpha=8.0, targets=["q_proj", "o_proj", "kv_b_proj", "w1", "w2", "w3"])
GREEDY = {"temperature": 0, "max_new_tokens": 4}
ADAPTER = "policy"


def base_model() -> K3ForCausalLM:
    """The same k3_tiny (fp32, CPU) in every process: seeded, non-zero AttnRes queries."""
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.from_name("k3_tiny"), expert_format="mxfp4").eval().requires_grad_(False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_res_proj.weight"):
                p.normal_(0, 0.5)
    return model


def trainer_model(seed: int = 1, std: float = 0.3) -> K3ForCausalLM:
    """The base with LoRA applied and every adapter tensor random (B included): outputs differ from the base."""
    model = base_model()
    apply_lora(model, LORA)
    set_adapter(model, seed, std)
    return model


def set_adapter(model, seed: int, std: float = 0.3) -> None:
    """Deterministic adapter values (an 'optimizer step'): the same seed gives the same tensors anywhere."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(lora_parameters(model).items()):
            p.copy_(torch.randn(p.shape, generator=g) * std)


def adapter_tensors(model) -> dict[str, torch.Tensor]:
    return lora_state_dict(model)


def engine_with_adapter() -> RolloutEngine:
    """An eager engine over the base (CPU), adapter "policy" registered with all-zero tensors (serves the base
    model)."""
    trainer = base_model()
    apply_lora(trainer, LORA)  # lora_B = 0: the adapter starts as the identity
    engine = small_engine(trainer, LORA, decode="eager")
    engine.load_lora_adapter_from_tensors(ADAPTER, {n: torch.zeros_like(t) for n, t in
                                                    adapter_tensors(trainer).items()}, LORA)
    return engine


def engine_outputs(engine, adapter: str | None = ADAPTER) -> list[list[int]]:
    return [r["output_ids"] for r in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, lora=adapter)]


@torch.no_grad()
def model_outputs(model) -> list[list[int]]:
    """Greedy continuations of PROMPTS by a plain full-sequence loop over `model`."""
    outs = []
    for prompt in PROMPTS:
        tokens, out = list(prompt), []
        for _ in range(GREEDY["max_new_tokens"]):
            nxt = int(model(torch.tensor([tokens])).logits[0, -1].argmax())
            out.append(nxt)
            tokens.append(nxt)
        outs.append(out)
    return outs


@functools.cache
def trainer_outputs(seed: int) -> tuple:
    """model_outputs(trainer_model(seed)), computed once per process (a full-sequence loop costs seconds)."""
    return tuple(map(tuple, model_outputs(trainer_model(seed))))
