"""The graders on the forms models write (tables, right and wrong, with invented numbers), their reasons and
registry, gold errors, the response-size cap, and random / huge / nested responses (never raise, right type)."""
from __future__ import annotations

import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_k3.evals.answers import normalize_integer
from miles_k3.evals.graders import (
    MAX_RESPONSE_CHARS,
    GoldError,
    Grade,
    get_grader,
    grade_aime,
    grade_math,
    grader_names,
    register_grader,
)

K3_RESPONSE = ("<|open|>think<|sep|>Trying n=12 gives \\boxed{12}, no.<|close|>"
               "<|open|>response<|sep|>The answer is \\boxed{33}.<|close|>")
K3_NO_RESPONSE = "<|open|>think<|sep|>Trying n=12 gives \\boxed{12}, no.<|close|>"

RIGHT_33 = [
    "\\boxed{33}", "\\boxed{033}", "so \\boxed 33.", "\\fbox{33}", "\\boxed{33.0}", "\\boxed{\\text{33}}",
    "\\boxed{33 \\text{ degrees}}", "\\boxed{\\$33}", "\\boxed{x=33}", "$\\boxed{33}$", "\\boxed{+33}",
    "\\boxed{33^\\circ}", "\\boxed{\\textbf{33}}", "Answer: 33", "**Answer:** 33", "The final answer is 33",
    "Final answer: $33$.", "\\boxed{34} wait, no: \\boxed{33}", "\\boxed{33} and \\boxed{12",
    "<think>maybe \\boxed{12}</think> \\boxed{33}", "lots of work\n\nAnswer: 033\n",
]
WRONG_33 = [
    ("\\boxed{33} no wait \\boxed{34}", "wrong answer 34 (gold 33)"),
    ("\\boxed{34}", "wrong answer 34 (gold 33)"),
    ("Answer: 3", "wrong answer 3 (gold 33)"),
    ("\\boxed{330}", "wrong answer 330 (gold 33)"),
    ("\\boxed{33.5}", "not an integer: '33.5'"),
    ("\\boxed{\\frac{1}{2}}", "not an integer: '\\\\frac{1}{2}'"),
    ("\\boxed{33 or 34}", "not an integer: '33 or 34'"),
    ("\\boxed{3 3}", "not an integer: '3 3'"),
    ("\\boxed{33", "no final answer"),  # unbalanced
    ("the answer is probably 33", "no final answer"),
    ("", "no final answer"),
    ("\\boxed{-33}", "out of range: -33 is not in 0..999"),
    ("\\boxed{1,033}", "out of range: 1033 is not in 0..999"),
]


@pytest.mark.parametrize("gold", ["33", "033", " 33 ", "33.0"])
@pytest.mark.parametrize("response", RIGHT_33)
def test_aime_right_forms(response, gold):
    g = grade_aime(response, gold)
    assert (g.score, g.reason, g.normalized) == (1.0, "correct", "33")
    assert g.extracted is not None and g.how in ("boxed", "answer_line")


@pytest.mark.parametrize("gold", ["33", "033"])
@pytest.mark.parametrize("response, reason", WRONG_33)
def test_aime_wrong_forms(response, reason, gold):
    g = grade_aime(response, gold)
    assert (g.score, g.reason) == (0.0, reason)


def test_aime_how_and_keys():
    assert grade_aime("\\boxed{033}", "33") == Grade(1.0, "correct", "033", "33", "boxed")
    assert grade_aime("**Answer:** 34", "33") == Grade(0.0, "wrong answer 34 (gold 33)", "34", "34", "answer_line")
    assert grade_aime("no answer", "33") == Grade(0.0, "no final answer", None, None, "none")
    assert grade_aime("\\boxed{1/2}", "33") == Grade(0.0, "not an integer: '1/2'", "1/2", None, "boxed")


def test_aime_out_of_range_even_when_equal_to_the_gold():
    g = grade_aime("\\boxed{1,000}", "1000")
    assert (g.score, g.reason, g.normalized) == (0.0, "out of range: 1000 is not in 0..999", "1000")
    assert normalize_integer("1,000") == 1000  # the normaliser itself reads it


@pytest.mark.parametrize("channel, want", [
    ("k3", (1.0, "correct")), ("auto", (1.0, "correct")),
    ("none", (1.0, "correct")),  # the last box of all is still 33
    ("think", (0.0, "no final-answer channel (think)")),
])
def test_aime_k3_channel(channel, want):
    assert (grade_aime(K3_RESPONSE, "33", channel=channel).score, grade_aime(K3_RESPONSE, "33",
            channel=channel).reason) == want


def test_aime_k3_channel_ignores_boxes_in_the_reasoning():
    assert grade_aime(K3_RESPONSE, "12", channel="k3").reason == "wrong answer 33 (gold 12)"
    assert grade_aime(K3_NO_RESPONSE, "12", channel="k3") == Grade(0.0, "no final-answer channel (k3)")
    assert grade_aime(K3_NO_RESPONSE, "12", channel="auto").score == 1.0  # auto falls back to the whole text
    think = "<think>\\boxed{12}</think> so \\boxed{33}"
    assert grade_aime(think, "33", channel="think").score == 1.0
    assert grade_aime(think, "12", channel="think").score == 0.0


@pytest.mark.parametrize("gold", ["1/2", "\\frac{1}{2}", "x", "", "33.5", "33 or 34", None, 3.5, True])
def test_aime_gold_that_is_not_an_integer_is_a_dataset_error(gold):
    with pytest.raises(GoldError, match=re.escape(f"gold {gold!r} is not an integer")):
        grade_aime("\\boxed{33}", gold)


def test_aime_takes_int_golds():
    assert grade_aime("\\boxed{033}", 33).score == 1.0


def test_long_responses_are_graded_on_their_tail():
    filler = "x" * 40_000
    g = grade_aime("\\boxed{33}" + filler, "33")
    assert g.reason == f"no final answer; graded the last {MAX_RESPONSE_CHARS} of {40_010} chars"
    g = grade_aime(filler + "\\boxed{33}", "33")
    assert (g.score, g.reason) == (1.0, f"correct; graded the last {MAX_RESPONSE_CHARS} of 40010 chars")
    assert grade_aime("\\boxed{33}" + "x" * 90, "33", max_chars=100).score == 1.0
    assert grade_aime("\\boxed{33}" + "x" * 91, "33", max_chars=100).score == 0.0


def test_non_string_response_scores_zero():
    for grader in (grade_aime, grade_math):
        assert grader(None, "33") == Grade(0.0, "response is not a string")
        assert grader(b"\\boxed{33}", "33") == Grade(0.0, "response is not a string")


def test_unknown_channel_and_bad_max_chars_raise():
    with pytest.raises(ValueError, match="channel: 'x' is not one of auto, none, k3, think"):
        grade_aime("\\boxed{1}", "1", channel="x")
    with pytest.raises(ValueError, match="max_chars: must be an int >= 1"):
        grade_aime("\\boxed{1}", "1", max_chars=0)


# ---- math ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("response, gold, score", [
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\frac{1}{2}}", "\\frac12", 1.0),
    ("\\boxed{\\dfrac{1}{2}}", "$\\frac{1}{2}$", 1.0),
    ("\\boxed{x^2+1}", "1+x^2", 1.0),  # bare gold: read as LaTeX, not as "1"
    ("Answer: 1 + x^2", "x^2+1", 1.0),
    ("we get $x^2 + 1$", "x^2+1", 1.0),  # no box, no label: math-verify reads the final segment
    ("\\boxed{33}", "033", 1.0),
    ("\\boxed{x^2-1}", "x^2+1", 0.0),
    ("\\boxed{2}", "2\\pi", 0.0),  # bare "2\pi" must not parse as 2
    ("\\boxed{3}", "x=3", 1.0),
    ("\\boxed{\\frac{1}{3}}", "0.5", 0.0),
    ("no math here", "0.5", 0.0),
    ("<think>\\boxed{0.5}</think>\\boxed{0.25}", "\\frac{1}{2}", 0.0),
])
def test_math_table(response, gold, score):
    g = grade_math(response, gold)
    assert g.score == score, g
    assert g.reason == "correct" if score else g.reason.startswith(("wrong answer", "no final answer"))


def test_math_keys_and_reasons():
    g = grade_math("\\boxed{\\frac{1}{2}}", "0.5")
    assert (g.extracted, g.normalized, g.how) == ("\\frac{1}{2}", "1/2", "boxed")
    g = grade_math("so $x = 7$ at the end", "7")
    assert (g.score, g.how, g.extracted is not None, g.normalized is not None) == (1.0, "none", True, True)
    assert grade_math("nothing", "7") == Grade(0.0, "no final answer", None, None, "none")
    assert grade_math(K3_NO_RESPONSE, "7", channel="k3") == Grade(0.0, "no final-answer channel (k3)")


@pytest.mark.parametrize("gold", ["", "   ", None, 5])
def test_math_unusable_gold_raises(gold):
    with pytest.raises(GoldError, match="gold"):
        grade_math("\\boxed{1}", gold)


def test_math_never_raises_on_a_math_verify_failure(monkeypatch):
    import math_verify

    def boom(*a, **k):
        raise RecursionError("too deep")

    monkeypatch.setattr(math_verify, "verify", boom)
    g = grade_math("\\boxed{1}", "1")
    assert (g.score, g.reason) == (0.0, "math-verify error: RecursionError: too deep")


def test_math_verify_is_called_without_its_signal_timeouts(monkeypatch):
    """SIGALRM only works on the main thread: the grader must pass parsing_timeout=None / timeout_seconds=None."""
    import inspect

    import math_verify

    assert "parsing_timeout" in inspect.signature(math_verify.parse).parameters
    assert "timeout_seconds" in inspect.signature(math_verify.verify).parameters
    seen = []
    real_parse, real_verify = math_verify.parse, math_verify.verify
    monkeypatch.setattr(math_verify, "parse", lambda *a, **k: seen.append(k) or real_parse(*a, **k))
    monkeypatch.setattr(math_verify, "verify", lambda *a, **k: seen.append(k) or real_verify(*a, **k))
    assert grade_math("\\boxed{2}", "2").score == 1.0
    assert seen and all(k.get("parsing_timeout", 0) is None or k.get("timeout_seconds", 0) is None for k in seen)
    assert {tuple(k) for k in seen} == {("parsing_timeout",), ("timeout_seconds",)}


def test_math_grades_off_the_main_thread():
    import threading

    out = []
    t = threading.Thread(target=lambda: out.append(grade_math("\\boxed{\\frac{2}{4}}", "0.5")))
    t.start()
    t.join()
    assert out[0].score == 1.0


# ---- registry --------------------------------------------------------------------------------------------------
def test_registry():
    assert {"aime", "math"} <= set(grader_names()) and grader_names() == sorted(grader_names())
    assert get_grader("aime") is grade_aime
    with pytest.raises(ValueError, match="grader: 'nope' is not a registered grader; registered: .*aime.*math"):
        get_grader("nope")


def test_register_a_grader_and_refuse_a_second_one_under_the_same_name():
    @register_grader("_test_exact")
    def exact(response, gold, *, channel="auto", max_chars=MAX_RESPONSE_CHARS):
        return Grade(float(response == gold), "exact")

    assert get_grader("_test_exact")("a", "a") == Grade(1.0, "exact")
    with pytest.raises(ValueError, match="grader '_test_exact' is already registered"):
        register_grader("_test_exact")(lambda response, gold, **kw: Grade(0.0, "other"))


# ---- any response ----------------------------------------------------------------------------------------------
RESPONSES = st.lists(st.sampled_from(
    ["\\boxed{", "\\fbox{", "\\boxed ", "{", "}", "$", " ", "\n", "0", "3", "33", ",", ".", "-", "=", "^",
     "\\frac", "\\text{", "\\", "Answer:", "</think>", "<|open|>response<|sep|>", "<|close|>", "x"]),
    max_size=60).map("".join)


@settings(max_examples=200, deadline=1000)
@given(RESPONSES, st.sampled_from(["auto", "none", "k3", "think"]))
def test_aime_takes_any_response(response, channel):
    g = grade_aime(response, "33", channel=channel)
    assert isinstance(g, Grade) and g.score in (0.0, 1.0) and isinstance(g.reason, str)
    assert (g.score == 1.0) == (g.normalized == "33" and g.reason == "correct")
    assert g.how in ("boxed", "answer_line", "none") and (g.extracted is None) == (g.how == "none")


@pytest.mark.parametrize("response, max_chars, score", [
    ("\\boxed{" * 100_000 + "33" + "}" * 100_000, 10**6, 1.0),  # the innermost box is the last one
    ("\\boxed{" * 100_000 + "33" + "}" * 100_000, MAX_RESPONSE_CHARS, 0.0),  # its tail holds no box
    ("\\boxed{" * 700_000, MAX_RESPONSE_CHARS, 0.0),
    ("{" * 2_500_000 + "}" * 2_500_000, 10**7, 0.0),
    ("9" * 5_000_000, MAX_RESPONSE_CHARS, 0.0),
    ("Answer: " * 600_000, 10**7, 0.0),
    ("Answer: 33" * 500_000, 10**7, 1.0),  # the last label's value
    ("Answer: " + "33, " * 1_000_000, 10**7, 0.0),  # one 4 MB value restating 33 more than MAX_NUMBERS times
    ("<|open|>response<|sep|>" * 200_000 + "\\boxed{33}", MAX_RESPONSE_CHARS, 1.0),
    ("x" * 5_000_000 + "\\boxed{33}", MAX_RESPONSE_CHARS, 1.0),
])
def test_aime_on_huge_and_nested_responses(response, max_chars, score):
    t0 = time.perf_counter()
    g = grade_aime(response, "33", max_chars=max_chars)
    assert time.perf_counter() - t0 < 5.0  # 0.11 s at most on 2 quiet cores, 1.9 s once in a loaded CI; a
    # quadratic scan of these inputs takes minutes
    assert isinstance(g, Grade) and g.score == score
