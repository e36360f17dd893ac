"""Staleness accounting: how many weight versions behind the trainer a rollout sample is, and what the trainer
does with samples older than `max_staleness` (drop them, or down-weight them).

A sample's version is the oldest weight version it was sampled with (`meta_info["weight_versions"][0]`, or
`meta_info["weight_version"]`): a sample whose generation spanned a push is as stale as its oldest token.
Staleness = trainer version - sample version (>= 0).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

POLICIES = ("drop", "downweight")


def sample_version(sample: dict) -> int:
    """The oldest weight version a rollout sample (an engine `generate` result) was sampled with."""
    meta = sample.get("meta_info", {})
    if meta.get("weight_versions"):
        return int(min(meta["weight_versions"]))
    if "weight_version" in meta:
        return int(meta["weight_version"])
    raise ValueError("rollout sample has no meta_info.weight_version: it did not come from the engine")


@dataclass
class StalenessReport:
    """Per batch: sample weights (1 fresh enough, 0 dropped, in (0, 1) down-weighted) and the counts."""

    weights: list[float]
    staleness: list[int]
    histogram: dict[int, int] = field(default_factory=dict)
    num_stale: int = 0  # samples older than max_staleness (dropped or down-weighted)

    def metrics(self) -> dict[str, float]:
        n = max(1, len(self.staleness))
        return {"sync/staleness_mean": sum(self.staleness) / n, "sync/staleness_max": max(self.staleness, default=0),
                "sync/stale_fraction": self.num_stale / n}


def account(samples: list[dict], trainer_version: int, max_staleness: int, policy: str = "drop",
            downweight: float = 0.5) -> StalenessReport:
    """Weigh `samples` by staleness: staleness s <= max_staleness -> 1; older -> 0 (`drop`) or
    downweight ** (s - max_staleness) (`downweight`). A sample newer than the trainer is an error (the trainer
    pushed a version it does not have)."""
    if max_staleness < 0:
        raise ValueError(f"max_staleness: must be >= 0, got {max_staleness}")
    if policy not in POLICIES:
        raise ValueError(f"policy: '{policy}' is not one of {', '.join(POLICIES)}")
    if not 0.0 < downweight <= 1.0:
        raise ValueError(f"downweight: must be in (0, 1], got {downweight}")
    stale = []
    for i, s in enumerate(samples):
        v = sample_version(s)
        if v > trainer_version:
            raise ValueError(f"sample {i}: weight version {v} is newer than the trainer's {trainer_version}")
        stale.append(trainer_version - v)
    weights = [1.0 if s <= max_staleness else (0.0 if policy == "drop" else downweight ** (s - max_staleness))
               for s in stale]
    return StalenessReport(weights, stale, dict(sorted(Counter(stale).items())),
                           sum(s > max_staleness for s in stale))
