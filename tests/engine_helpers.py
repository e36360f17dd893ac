"""The tests' small native rollout engine: one set of sizes for k3_tiny-scale models, each caller passing only what
differs (its decode mode, stop ids, a smaller context, its LoRA config, tokenizer or rank context).

Why these sizes: on k3_tiny, 4 MiB of state pools holds 26 requests at the full 64-token context (26 KDA slots,
416 latent pages), and pages and prefill chunks of 4 tokens make even a short test prompt span several pages and
several prefill forwards, so paging and chunked prefill run in every engine test. Import-light (no pytest): the
spawned ranks of the parallel tests build their engines here too.
"""
from __future__ import annotations

from typing import Any

import torch

from miles_k3.model.lora import LoRAConfig, apply_lora, lora_parameters
from miles_k3.parallel.mesh import SINGLE, ParallelContext
from miles_k3.rollout.engine import EngineConfig, RolloutEngine

SMALL_ENGINE: dict[str, Any] = {"memory_budget_bytes": 4 * 2**20, "max_context": 64, "page_size": 4,
                                "prefill_chunk": 4}
"""The `EngineConfig` fields `small_engine` sets; every other field keeps EngineConfig's default."""


def small_engine(model, lora: LoRAConfig | None = None, tokenizer: Any = None, ctx: ParallelContext = SINGLE,
                 **fields: Any) -> RolloutEngine:
    """A native `RolloutEngine` over `model` with `SMALL_ENGINE`'s sizes, `fields` (any `EngineConfig` field)
    replacing or adding to them; `lora`, `tokenizer` and `ctx` as `RolloutEngine` takes them."""
    return RolloutEngine(model, EngineConfig(**{**SMALL_ENGINE, **fields}), lora=lora, tokenizer=tokenizer, ctx=ctx)


def random_adapter(model, lora: LoRAConfig, seed: int, std: float = 0.3):
    """`model` with `lora` applied and every lora_B drawn N(0, std^2) from a generator seeded `seed` (in
    `lora_parameters` order): an adapter that changes the outputs (a fresh one, B = 0, would not)."""
    apply_lora(model, lora)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in lora_parameters(model).items():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


def cuda_tiny_adapted(lora: LoRAConfig, seed: int = 0, std: float = 0.2):
    """(model, pushed): k3_tiny on CUDA (fla's KDA, MXFP4 experts) in bf16 with `random_adapter(lora, seed, std)`,
    and the tensors of another adapter to push (the same A, B ~ N(0, std^2) from a CUDA generator seeded seed + 1):
    what the GPU tests of the engine's adapter forms (merged, fused) serve before and after a push."""
    from miles_k3.model import K3Config, K3ForCausalLM
    from miles_k3.model.lora import lora_state_dict

    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = K3ForCausalLM(K3Config.from_name("k3_tiny"), kda_backend="fla", expert_format="mxfp4")
    random_adapter(model.eval(), lora, seed=seed, std=std)
    model.cast(torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    pushed = {n: torch.randn(t.shape, generator=g, device="cuda") * std if "lora_B" in n else t.clone()
              for n, t in lora_state_dict(model).items()}
    return model, pushed


def samples_before_and_after_a_push(engine: RolloutEngine, prompts, params: dict, pushed: dict) -> list:
    """[engine's samples of `prompts` with adapter "policy", the same after `pushed` is pushed into it]."""
    before = engine.generate(input_ids=prompts, sampling_params=params, lora="policy")
    engine.update_weights_from_tensor(pushed, lora_name="policy")
    return [before, engine.generate(input_ids=prompts, sampling_params=params, lora="policy")]


@torch.no_grad()
def teacher_forced_gaps(model, prompts, outs) -> list[float]:
    """|engine log-prob - log-prob of a teacher-forced forward of `model`| for every sampled token of `outs`."""
    gaps = []
    for p, out in zip(prompts, outs):
        logits = model(torch.tensor([p + out["output_ids"]], device=model.lm_head.weight.device)).logits[0]
        logp = torch.log_softmax(logits.float(), -1)
        gaps += [abs(lp - logp[len(p) - 1 + i, t].item())
                 for i, (lp, t) in enumerate(out["meta_info"]["output_token_logprobs"])]
    return gaps
