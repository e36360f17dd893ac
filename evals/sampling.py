"""An engine request's sampling parameters, built from any settings that carry the sampling fields, and the eval's
sampling seeds: defined here, in the lowest layer that samples (the eval harness), and used by the trainer's
rollouts and episode evals through `trainer.seeds`, which defines the rollouts' own seeds.

Problem i of an eval with `eval.seed` s and n samples per problem samples with seed `s + i * n` (its sample j,
the engine's fork j: + j), whatever the batching, single-turn (`harness`) or episodes (`trainer.episode_eval`).
"""
from __future__ import annotations


def sampling_params(settings, seed: int | None, max_new_tokens: int | None = None) -> dict:
    """One request's engine sampling_params: `settings`' temperature, top_p, top_k and max_new_tokens (or
    `max_new_tokens`: a later turn's cap, the room left in the context), and `seed` as its sampling_seed (None: the
    engine draws one). `settings`: anything with those four fields (RolloutConfig, EvalConfig, PlaySettings)."""
    return {"max_new_tokens": settings.max_new_tokens if max_new_tokens is None else max_new_tokens,
            "temperature": settings.temperature, "top_p": settings.top_p, "top_k": settings.top_k,
            "sampling_seed": seed}


def eval_seed(seed: int, problem: int, samples: int) -> int:
    """The sampling seed of problem `problem`'s group in an eval of `samples` samples (or episodes) per problem."""
    return seed + problem * samples
