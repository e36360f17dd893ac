"""Training rewards: a named reward turns a batch of rollout responses and their gold answers into scores.

`build_reward(cfg)` returns the reward registered as `cfg.name` (`register_reward`, `reward_names`), a callable
`(responses, golds) -> list[RewardResult]` with an optional `close()`. The built-ins `aime` and `math` grade in a
`GradingPool` with the grader of the same name (the one the evals use, so reward and eval cannot disagree):
1.0 for a correct answer, 0.0 otherwise, plus `cfg.format_bonus` when the answer was written in a box. The
built-in `integer` (a response that is exactly the gold integer) is for short-answer generated tasks; `coin` is a
control that ignores the answer (a fair coin per response), for measuring what training without signal does.
The built-in `remote` asks a judge server over HTTP (`remote_reward`: its wire protocol, retries and failure
budget; configured by `cfg.remote`).
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from miles_k3.evals.answers import RESPONSE_CHANNELS
from miles_k3.evals.graders import MAX_RESPONSE_CHARS, Grade
from miles_k3.evals.grading_pool import GradingPool
from miles_k3.evals.remote_reward import RemoteReward, RemoteRewardConfig
from miles_k3.utils.registry import check_unclaimed


@dataclass
class RewardConfig:
    """The reward of the RL loop: which one, its format bonus, and how its grading runs."""

    name: str = "aime"
    """A registered reward: aime (integer answers 0..999), math (math-verify), integer (the response is exactly the
    gold integer), answer_integer (the final answer line states the gold integer, any size), coin (a control: a fair coin that ignores the answer), remote (a judge server's scores over HTTP:
    reward.remote.*), or one added by register_reward."""
    format_bonus: float = 0.0
    """Added when the final answer was written in \\boxed{} (correct or not); 0 = off."""
    timeout_s: float = 5.0
    """Grading time limit per response (a response over it scores 0, reason 'timeout')."""
    workers: int = 1
    """Grading worker processes."""
    channel: str = "auto"
    """The part of a response graded: auto, none (all), k3 (after <|open|>response<|sep|>), think (after </think>)."""
    max_chars: int = MAX_RESPONSE_CHARS
    """A longer final segment is graded on its last max_chars characters."""
    remote: RemoteRewardConfig = field(default_factory=RemoteRewardConfig)
    """reward.name=remote only: the judge server (remote.url, required), batching, a total deadline per
    attempt, bounded responses, retries with backoff, a circuit breaker, the share of failed samples a call tolerates, and the bearer token's environment
    variable; format_bonus, timeout_s, workers, channel and max_chars do nothing for it."""

    def validate(self) -> None:
        if self.name not in _REWARDS:
            raise ValueError(f"name: '{self.name}' is not a registered reward; registered: "
                             f"{', '.join(reward_names())}")
        if not (math.isfinite(self.format_bonus) and self.format_bonus >= 0):
            raise ValueError(f"format_bonus: must be a finite number >= 0, got {self.format_bonus}")
        if self.name == "coin" and self.format_bonus:
            raise ValueError("format_bonus: the coin reward ignores the response (a control); set format_bonus=0")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"timeout_s: must be a finite number of seconds > 0, got {self.timeout_s}")
        if self.workers < 1:
            raise ValueError(f"workers: must be >= 1, got {self.workers}")
        if self.channel not in RESPONSE_CHANNELS:
            raise ValueError(f"channel: '{self.channel}' is not one of {', '.join(RESPONSE_CHANNELS)}")
        if self.max_chars < 1:
            raise ValueError(f"max_chars: must be >= 1, got {self.max_chars}")
        self._validate_remote()

    def _validate_remote(self) -> None:
        """`remote` is used (and its url required) with name=remote, and left at its defaults otherwise."""
        if self.name != "remote":
            if self.remote != RemoteRewardConfig():
                raise ValueError(f"remote: reward.remote.* is set but reward.name={self.name}, where it does "
                                 "nothing; set reward.name=remote or leave reward.remote at its defaults")
            return
        if not self.remote.url:
            raise ValueError("remote.url: reward.name=remote needs the judge's URL, e.g. "
                             "reward.remote.url=http://127.0.0.1:8001/score")
        if self.format_bonus:
            raise ValueError("format_bonus: the remote reward's scores come from the judge as they are; set "
                             "format_bonus=0 (score formatting in the judge)")
        for name in ("timeout_s", "workers", "channel", "max_chars"):  # the local grading pool's, unused here
            if getattr(self, name) != getattr(RewardConfig, name):
                raise ValueError(f"{name}: reward.name=remote grades in the judge server, not in a local grading "
                                 f"pool; leave reward.{name} at its default (reward.remote.timeout_s is the "
                                 "per-request limit)")
        try:
            self.remote.validate()
        except ValueError as e:
            raise ValueError(f"remote.{e}") from None


@dataclass(frozen=True)
class RewardResult:
    """One response's reward: `score` (what the RL loop optimises), whether the answer was `correct`, and
    `reasons` for logging: {"grade": the grader's reason, "extracted": the answer found, "format": boxed?}.
    `failed`: no reward could be computed (a remote call failed): the sample is left out of the loss, not
    scored 0 (its score is 0.0 and correct False only as placeholders)."""

    score: float
    correct: bool
    reasons: dict
    failed: bool = False


GRADE_TIMEOUT_PREFIX = "timeout"
"""`GradingPool`'s reason for a response whose grading ran past its time limit ("timeout after 5.0s")."""
GRADE_ERROR_PREFIXES = ("grader error", "gold error", "math-verify error")
"""Reasons of grades that failed rather than judged: the grader raised or its worker died, the gold was unusable,
math-verify failed on the gold or on the response (`GradingPool`, `graders.grade_math`)."""


def grade_outcome(result: RewardResult) -> str:
    """"timeout", "error" or "ok" (the grader judged the answer, right or wrong) from a reward's grade reason;
    "ok" for rewards that record no grade; "error" for a result that `failed` (no reward computed)."""
    if result.failed:
        return "error"
    reason = str(result.reasons.get("grade", ""))
    if reason.startswith(GRADE_TIMEOUT_PREFIX):
        return "timeout"
    return "error" if reason.startswith(GRADE_ERROR_PREFIXES) else "ok"


class RewardFn(Protocol):
    """`(responses, golds) -> one RewardResult per response, in order`; may have `close()` (call it when done)."""

    def __call__(self, responses: list[str], golds: list[str]) -> list[RewardResult]: ...


RewardFactory = Callable[[RewardConfig], RewardFn]
_REWARDS: dict[str, RewardFactory] = {}


def register_reward(name: str) -> Callable[[RewardFactory], RewardFactory]:
    """Decorator: register `factory(cfg: RewardConfig) -> RewardFn` as reward `name` (one factory per name; the
    same function registering again, e.g. its module imported twice, is fine)."""
    def deco(factory: RewardFactory) -> RewardFactory:
        check_unclaimed("reward", name, _REWARDS.get(name), factory)
        _REWARDS[name] = factory
        return factory
    return deco


def reward_names() -> list[str]:
    """The registered reward names, sorted."""
    return sorted(_REWARDS)


def build_reward(cfg: RewardConfig) -> RewardFn:
    """The reward `cfg` describes (validated first: a bad field raises ValueError naming it)."""
    cfg.validate()
    return _REWARDS[cfg.name](cfg)


def reward_from_grade(grade: Grade, format_bonus: float) -> RewardResult:
    """1.0 for a fully correct grade, else 0.0, plus `format_bonus` when the answer came from a box."""
    correct = grade.score >= 1.0
    boxed = grade.how == "boxed"
    score = (1.0 if correct else 0.0) + (format_bonus if boxed else 0.0)
    return RewardResult(score, correct, {"grade": grade.reason, "extracted": grade.extracted, "format": boxed})


class GraderReward:
    """A reward that grades in a `GradingPool` with grader `grader` (workers start on the first call)."""

    def __init__(self, grader: str, cfg: RewardConfig):
        self.format_bonus = cfg.format_bonus
        self.pool = GradingPool(grader, timeout_s=cfg.timeout_s, workers=cfg.workers, channel=cfg.channel,
                                max_chars=cfg.max_chars)

    def __call__(self, responses: list[str], golds: list[str]) -> list[RewardResult]:
        return [reward_from_grade(g, self.format_bonus) for g in self.pool.grade(responses, golds)]

    def close(self) -> None:
        self.pool.close()


@register_reward("aime")
def aime_reward(cfg: RewardConfig) -> RewardFn:
    return GraderReward("aime", cfg)


@register_reward("math")
def math_reward(cfg: RewardConfig) -> RewardFn:
    return GraderReward("math", cfg)


@register_reward("integer")
def integer_reward(cfg: RewardConfig) -> RewardFn:
    return GraderReward("integer", cfg)


@register_reward("answer_integer")
def answer_integer_reward(cfg: RewardConfig) -> RewardFn:
    return GraderReward("answer_integer", cfg)


class CoinReward:
    """The control reward: 1.0 or 0.0 by a fair coin keyed by a hash of (response, gold), so it ignores whether
    the answer is right but is reproducible; nothing is graded (`correct` is False, rollout/accuracy reads 0).
    Training on it measures drift without signal."""

    def __call__(self, responses: list[str], golds: list[str]) -> list[RewardResult]:
        return [RewardResult(float(_coin(r, g)), False, {"grade": "coin (not graded)"})
                for r, g in zip(responses, golds)]


def _coin(response: str, gold: str) -> bool:
    digest = hashlib.sha256(f"{response}\0{gold}".encode("utf-8", "surrogatepass")).digest()
    return bool(digest[0] & 1)


@register_reward("coin")
def coin_reward(cfg: RewardConfig) -> RewardFn:
    return CoinReward()


@register_reward("remote")
def remote_reward(cfg: RewardConfig) -> RewardFn:
    return RemoteReward(cfg.remote)
