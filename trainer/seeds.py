"""Every seed a rollout or an episode eval derives, and the engine's sampling parameters, defined once.

A run's `rollout.seed` s orders the prompts (epoch e is shuffled by `random.Random(s * SEED_STRIDE + e)`), seeds the
group of draw d (sampling seed `s * SEED_STRIDE + d * group_size`; the engine gives fork j seed + j; after the prompt's
r-th drop under rollout.partial.policy=drop, that + r * RETRY_STRIDE) and resets the environments of draw d (`random.Random(s * SEED_STRIDE + d)`). An episode whose first turn had seed e samples its
turn k >= 1 with `e * TURN_STRIDE + k` (an agent's episode e, whose turns the server counts from 0: `e * TURN_STRIDE
+ k` from k = 0). Problem i of an eval with `eval.seed` s and n samples (or episodes) per problem starts with
`s + i * n` (`eval_seed`). The strides are primes far apart, so the seeds of different draws, groups and turns do
not collide in practice.

`sampling_params(settings, seed)` is the engine's `sampling_params` of one request, from anything that carries
max_new_tokens, temperature, top_p and top_k (RolloutConfig, EvalConfig, `sources.PlaySettings`); it and `eval_seed`
are the eval harness's (`evals.sampling`, the layer below, whose single-turn evals use them too), here with the rest.
"""
from __future__ import annotations

from miles_k3.evals.sampling import eval_seed, sampling_params  # noqa: F401 - the trainer's seeds module has them all

SEED_STRIDE = 1_000_003
"""A run seed's stride: prompt order, group sampling seeds and environment resets of two seeds never meet."""
TURN_STRIDE = 1_009
"""An episode seed's stride: the sampling seeds of its turns after the first."""
RETRY_STRIDE = 1_000_000_000_039
"""A dropped prompt's stride (rollout.partial.policy=drop): the sampling seeds of its retries."""


def order_seed(seed: int, epoch: int) -> int:
    """The shuffle seed of the prompt stream's epoch `epoch`."""
    return seed * SEED_STRIDE + epoch


def group_seed(seed: int, draw: int, group_size: int) -> int:
    """The sampling seed of the group of stream draw `draw` (its fork j samples with this + j)."""
    return seed * SEED_STRIDE + draw * group_size


def retry_seed(seed: int, draw: int, group_size: int, retry: int) -> int:
    """The sampling seed of draw `draw`'s group queued again after its prompt's `retry`-th drop (0: `group_seed`):
    fresh noise, so a retry does not regrow the dropped trajectory token for token, and the same in a resumed run."""
    return group_seed(seed, draw, group_size) + retry * RETRY_STRIDE


def reset_seed(seed: int, draw: int) -> int:
    """The seed of the rng every environment of draw `draw`'s group is reset with (one prompt per group)."""
    return seed * SEED_STRIDE + draw


def turn_seed(episode_seed: int, turn: int) -> int:
    """The sampling seed of an episode's turn `turn` (engine episodes: turn >= 1, the first is `episode_seed`)."""
    return episode_seed * TURN_STRIDE + turn
