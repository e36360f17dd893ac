"""The tests' small native rollout engine: one set of sizes for k3_tiny-scale models, each caller passing only what
differs (its decode mode, stop ids, a smaller context, its LoRA config, tokenizer or rank context).

Why these sizes: on k3_tiny, 4 MiB of state pools holds 26 requests at the full 64-token context (26 KDA slots,
416 latent pages), and pages and prefill chunks of 4 tokens make even a short test prompt span several pages and
several prefill forwards, so paging and chunked prefill run in every engine test. Import-light (no pytest): the
spawned ranks of the parallel tests build their engines here too.
"""
from __future__ import annotations

from typing import Any

from miles_k3.model.lora import LoRAConfig
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
