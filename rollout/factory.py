"""The one place a rollout engine is built (training, `python -m miles_k3.eval`, SFT's eval): `build_engine` sets
the default stop tokens, builds the engine `engine.backend` names (native: over the caller's model, sharing its
base; sglang: SGLang serving the checkpoint directory), loads the adapter it is to serve, and logs what it built
(`engine_line`)."""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from miles_k3.parallel.mesh import SINGLE, ParallelContext
from miles_k3.rollout.api import Engine

log = logging.getLogger("miles_k3.rollout")
POLICY = "policy"
"""The engine's name for the served adapter (the trained one in training, a saved one in eval)."""


def build_engine(cfg, model, tokenizer, stop_ids: list[int], *, lora=None, adapter: Mapping[str, Any] | None = None,
                 version: int = 0, merge: Callable[[Mapping[str, Any]], dict] | None = None,
                 ctx: ParallelContext = SINGLE) -> Engine:
    """The engine of `cfg.engine.backend` serving `adapter` (tensors by name, the engine's naming: the model's for
    native, PEFT's for sglang; None: the base alone) as adapter `POLICY` at weight version `version`.

    `cfg`: a run config with `engine` (its `eos_token_ids` defaults to `stop_ids`, the tokenizer's, when empty), and
    for sglang `sglang`, `model` and `seed`. `model`: the native engine's model (unused by sglang); `lora`: the
    adapters' LoRAConfig (None: no adapter). `merge`: sglang with push=merged, the base weights that serve
    `adapter` merged (`weight_sync.sglang.merged_from_checkpoint`). An engine whose adapter fails to load is
    closed before the error propagates (SGLang's scheduler runs in subprocesses)."""
    if not cfg.engine.eos_token_ids:
        cfg.engine.eos_token_ids = list(stop_ids)
    if cfg.engine.backend == "sglang":
        from miles_k3.rollout.sglang_backend import serve_checkpoint

        engine = serve_checkpoint(cfg.sglang, cfg.model, tokenizer, cfg.engine.eos_token_ids, lora=lora,
                                  seed=cfg.seed, fallback_context=cfg.engine.max_context)
    else:
        from miles_k3.rollout.engine import RolloutEngine

        engine = RolloutEngine(model, cfg.engine, lora=lora, tokenizer=tokenizer, ctx=ctx)
    log.info(engine_line(engine))
    if adapter is None:
        return engine
    try:
        _load(engine, adapter, lora, merge)
        engine.weight_version = version
    except BaseException:
        engine.close()
        raise
    return engine


def _load(engine, adapter: Mapping[str, Any], lora, merge) -> None:
    if engine.push == "merged":
        if merge is None:
            raise ValueError("build_engine: sglang.push=merged serves an adapter merged into the base weights; pass "
                             "merge (the base weights for the adapter tensors)")
        engine.serve_merged(POLICY)
        engine.write_base_weights(merge(adapter))
    else:
        engine.load_lora_adapter_from_tensors(POLICY, dict(adapter), lora)


def engine_line(engine: Engine) -> str:
    """What was built, in one line: the native engine's sizes (its full memory plan is logged at DEBUG), or the
    SGLang engine's push mode (its server arguments are logged as it starts)."""
    if engine.backend == "sglang":
        return f"rollout engine: sglang, push={engine.push or 'none'}, max_context={engine.max_context}"
    return (f"rollout engine: {engine.num_slots} slots, {engine.cache.num_pages} pages of "
            f"{engine.cache.page_size} tokens, decode={engine.decode_mode}")
