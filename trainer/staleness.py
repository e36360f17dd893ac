"""The off-policy rules and measures that rollout.mode=partial (`trainer/partial.py`) and rollout.mode=fleet
(`trainer/fleet.py`) share: `check_versions`, the staleness rule every trained sample must keep, and the measures of
what a step trained: `length_bias` (how much dropping groups shortens the step's samples) and `p90`.
"""
from __future__ import annotations

import bisect
import math

from miles_k3.trainer.batch import Sample
from miles_k3.trainer.rollouts import RolloutConfig


def length_bias(finished: list[int], dropped: list[int]) -> tuple[float, float]:
    """How much the drop (policy drop) shortens the step's samples, from the response lengths of the samples that
    finished in the step and of those dropped in it (their lengths so far). (bias, rank):
    bias = the mean length over both minus the mean over the finished ones, in tokens: what the step's samples would
      have averaged without the drop less what they do;
    rank = the mean over (dropped, finished) pairs of sign(dropped - finished), in [-1, 1] (Cliff's delta): +1 when
      every dropped sample is longer than every finished one.
    Both read 0 with no drop, or a drop blind to length, and > 0 when the drop takes the long samples. A dropped
    sample's length is a lower bound of the one it would have reached, so both understate the bias (never
    overstate it). (A share of dropped groups past the trained p90 length, the metric these replace, read ~57% for a
    drop blind to length at group size 8: the longest of 8 samples reaches a p90 that often.)"""
    if not dropped or not finished:
        return 0.0, 0.0
    bias = (sum(finished) + sum(dropped)) / (len(finished) + len(dropped)) - sum(finished) / len(finished)
    order = sorted(finished)
    signs = sum(bisect.bisect_left(order, d) - (len(order) - bisect.bisect_right(order, d)) for d in dropped)
    return bias, signs / (len(dropped) * len(order))


def p90(values: list[int]) -> int:
    """The 90th percentile by nearest rank (0 for none)."""
    if not values:
        return 0
    return sorted(values)[math.ceil(0.9 * len(values)) - 1]


def check_versions(samples: list[Sample], version: int, cfg: RolloutConfig) -> None:
    """rollout.mode=partial's on-policy check: every response token's weight version is recorded, none is newer than
    the adapter being trained (`version`), and (policy wait or drop) none is more than max_staleness versions older.
    RuntimeError naming the first sample that breaks it."""
    bound, keep = cfg.partial.max_staleness, cfg.partial.policy == "keep"
    for i, s in enumerate(samples):
        if len(s.token_versions) != len(s.response_ids):
            raise RuntimeError(f"rollout: sample {i} has weight versions for {len(s.token_versions)} of its "
                               f"{len(s.response_ids)} tokens; the engine must record the version of every token")
        if not s.token_versions:
            continue
        if max(s.token_versions) > version:
            raise RuntimeError(f"rollout: sample {i} has a token of weight version {max(s.token_versions)}, newer than "
                               f"the trainer's adapter (version {version})")
        if not keep and version - min(s.token_versions) > bound:
            raise RuntimeError(f"rollout: sample {i} has a token of weight version {min(s.token_versions)}, "
                               f"{version - min(s.token_versions)} versions behind the trainer's adapter (version "
                               f"{version}); rollout.partial.max_staleness is {bound}")
