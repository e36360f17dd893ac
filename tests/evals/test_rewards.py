"""Rewards: config validation names the field, scores and the format bonus (boxed answers only), the reasons
logged, the built-in aime and math rewards through their grading pools, and registering a custom reward."""
from __future__ import annotations

import itertools
import re

import pytest

from miles_k3.evals.graders import Grade
from miles_k3.evals.rewards import (
    RewardConfig,
    RewardResult,
    build_reward,
    register_reward,
    reward_from_grade,
    reward_names,
)


@pytest.mark.parametrize("field, value, message", [
    ("name", "foo", "name: 'foo' is not a registered reward; registered: (.*, )?aime, (.*, )?math"),
    ("format_bonus", -0.1, "format_bonus: must be a finite number >= 0"),
    ("format_bonus", float("nan"), "format_bonus: must be a finite number >= 0"),
    ("timeout_s", 0.0, "timeout_s: must be a finite number of seconds > 0"),
    ("workers", 0, "workers: must be >= 1"),
    ("channel", "kimi", "channel: 'kimi' is not one of auto, none, k3, think"),
    ("max_chars", 0, "max_chars: must be >= 1"),
])
def test_validation_names_the_field(field, value, message):
    cfg = RewardConfig(**{field: value})
    with pytest.raises(ValueError) as e:
        cfg.validate()
    assert re.match(message, str(e.value))
    with pytest.raises(ValueError, match=f"^{field}: "):
        build_reward(cfg)  # validated before anything starts


def test_defaults_are_valid_and_every_field_is_documented():
    import ast
    import inspect

    from miles_k3.evals import rewards

    RewardConfig().validate()
    body = next(n for n in ast.parse(inspect.getsource(rewards)).body
                if isinstance(n, ast.ClassDef) and n.name == "RewardConfig").body
    fields = [n.target.id for n in body if isinstance(n, ast.AnnAssign)]
    documented = [a.target.id for a, b in itertools.pairwise(body) if isinstance(a, ast.AnnAssign)
                  and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)]
    assert fields == documented == ["name", "format_bonus", "timeout_s", "workers", "channel", "max_chars", "remote"]


@pytest.mark.parametrize("grade, bonus, want", [
    (Grade(1.0, "correct", "33", "33", "boxed"), 0.1, (1.1, True, True)),
    (Grade(0.0, "wrong answer 34 (gold 33)", "34", "34", "boxed"), 0.1, (0.1, False, True)),  # correct or not
    (Grade(1.0, "correct", "33", "33", "answer_line"), 0.1, (1.0, True, False)),  # boxed only
    (Grade(0.0, "no final answer"), 0.1, (0.0, False, False)),
    (Grade(0.0, "timeout after 5.0s"), 0.1, (0.0, False, False)),
    (Grade(1.0, "correct", "33", "33", "boxed"), 0.0, (1.0, True, True)),
    (Grade(0.5, "partial", "x", "x", "boxed"), 0.0, (0.0, False, True)),  # only a full score is correct
])
def test_reward_from_grade(grade, bonus, want):
    r = reward_from_grade(grade, bonus)
    assert (pytest.approx(r.score), r.correct, r.reasons["format"]) == want
    assert r.reasons == {"grade": grade.reason, "extracted": grade.extracted, "format": want[2]}


def test_aime_reward_with_a_format_bonus():
    reward = build_reward(RewardConfig(name="aime", format_bonus=0.1))
    try:
        results = reward(["\\boxed{033}", "\\boxed{34}", "Answer: 33", "no idea", None], ["33"] * 5)
    finally:
        reward.close()
    assert [round(r.score, 6) for r in results] == [1.1, 0.1, 1.0, 0.0, 0.0]
    assert [r.correct for r in results] == [True, False, True, False, False]
    assert results[1].reasons == {"grade": "wrong answer 34 (gold 33)", "extracted": "34", "format": True}
    assert results[4].reasons["grade"] == "response is not a string"


def test_math_reward_on_the_k3_channel():
    reward = build_reward(RewardConfig(name="math", channel="k3"))
    try:
        results = reward(["<|open|>response<|sep|>\\boxed{\\frac{1}{2}}<|close|>", "\\boxed{0.5}"],
                         ["0.5", "0.5"])
    finally:
        reward.close()
    assert [(r.score, r.correct) for r in results] == [(1.0, True), (0.0, False)]
    assert results[1].reasons["grade"] == "no final-answer channel (k3)"


def test_a_custom_reward_registers_builds_and_validates():
    @register_reward("_test_length")
    def length_reward(cfg: RewardConfig):
        def fn(responses, golds):
            return [RewardResult(float(len(r) <= len(g)) + cfg.format_bonus, len(r) <= len(g), {}) for r, g in
                    zip(responses, golds)]
        return fn

    assert "_test_length" in reward_names()
    fn = build_reward(RewardConfig(name="_test_length", format_bonus=0.5))
    assert [r.score for r in fn(["ab", "abcd"], ["abc", "abc"])] == [1.5, 0.5]
    with pytest.raises(ValueError, match="reward '_test_length' is already registered"):
        register_reward("_test_length")(lambda cfg: None)
    assert "_test_length" in str(pytest.raises(ValueError, RewardConfig(name="zzz").validate).value)
