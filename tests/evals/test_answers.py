"""Answer extraction and integer normalisation: tables of the forms models write, properties on random
LaTeX-ish strings, and time bounds on huge and deeply nested inputs (every function must be linear)."""
from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from miles_k3.evals.answers import (
    K3_RESPONSE_MARKER,
    RESPONSE_CHANNELS,
    answer_line,
    extract_answer,
    final_segment,
    last_boxed,
    normalize_integer,
)

K3 = "<|open|>think<|sep|>so maybe \\boxed{12}<|close|><|open|>response<|sep|>It is \\boxed{33}.<|close|>"


# ---- final_segment ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("response, channel, want", [
    (K3, "k3", "It is \\boxed{33}."),
    (K3, "auto", "It is \\boxed{33}."),
    (K3, "none", K3),
    ("<|open|>response<|sep|>a<|end_of_msg|>b", "k3", "a"),
    ("<|open|>response<|sep|>a<|close|>x<|end_of_msg|>", "k3", "a"),  # the first end marker after it
    ("<|open|>response<|sep|>a<|close|><|open|>response<|sep|>b", "k3", "b"),  # the last marker
    ("<|open|>response<|sep|>still writing", "k3", "still writing"),
    ("<|open|>think<|sep|>\\boxed{12}<|close|>", "k3", None),  # never reached its answer
    ("<|open|>think<|sep|>\\boxed{12}<|close|>", "auto", "<|open|>think<|sep|>\\boxed{12}<|close|>"),
    ("<think>\\boxed{12}</think> \\boxed{33}", "think", " \\boxed{33}"),
    ("<think>\\boxed{12}</think> \\boxed{33}", "auto", " \\boxed{33}"),
    ("<think>a</think>b</think>c", "think", "c"),
    ("no tags \\boxed{1}", "think", None),
    ("no tags \\boxed{1}", "auto", "no tags \\boxed{1}"),
    ("</think>t" + K3_RESPONSE_MARKER + "r", "auto", "r"),  # k3 wins over think
    ("", "auto", ""),
])
def test_final_segment(response, channel, want):
    assert final_segment(response, channel) == want


def test_final_segment_rejects_unknown_channel_naming_the_valid_ones():
    with pytest.raises(ValueError, match="channel: 'kimi' is not one of auto, none, k3, think"):
        final_segment("x", "kimi")


# ---- last_boxed ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, want", [
    ("\\boxed{33}", "33"),
    ("so $\\boxed{ 33 }$.", "33"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\fbox{33}", "33"),
    ("\\boxed {33}", "33"),
    ("\\boxed 33.", "33"),
    ("\\boxed 33$, done", "33"),
    ("\\boxed{34} then \\boxed{33}", "33"),
    ("\\boxed{33} then \\boxed{34}", "34"),
    ("\\fbox{34} then \\boxed 33", "33"),
    ("\\boxed{33", None),  # unbalanced: ignored
    ("\\boxed{12} and \\boxed{33", "12"),  # ... an earlier complete box is taken
    ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),  # escaped braces do not count
    ("\\boxed{a\\}", None),
    ("\\boxed{\\boxed{33}}", "33"),
    ("\\boxed{}", None),
    ("\\boxed{7} \\boxed{ }", "7"),  # an empty box is skipped
    ("\\boxed33", None),  # not the brace-less form
    ("\\boxedx{3}", None),  # another command
    ("\\\\boxed{3}", None),  # `\\` is a line break, then the word "boxed"
    ("\\boxed \n 3", None),  # the brace-less form stays on its line
    ("no box at all {33}", None),
    ("", None),
])
def test_last_boxed(text, want):
    assert last_boxed(text) == want


# ---- answer_line -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, want", [
    ("Answer: 33", "33"),
    ("answer:33 ", "33"),
    ("**Answer:** 33", "33"),
    ("**Answer**: 33", "33"),
    ("**Final Answer:** **33**", "33"),
    ("Final answer: 33", "33"),
    ("The final answer is 33", "33"),
    ("The answer is: 33", "33"),
    ("The final answer is $33$. I hope it is correct.", "$33$. I hope it is correct."),
    ("Answer: 12\nwait, no.\nAnswer: 33\n", "33"),
    ("Answer: 33\nAnswer:", "33"),  # an empty label is skipped
    ("the answer is 33", None),  # reasoning says this mid-thought: not a label
    ("Answers: 3", None),
    ("Reanswer: 3", None),
    ("Answer:\n33", None),  # the value must be on the label's line
    ("İİ ẞ Answer: 33", "33"),  # characters whose lower case is longer do not shift the value
    ("the final answer issue: none", None),
    ("", None),
])
def test_answer_line(text, want):
    assert answer_line(text) == want


@pytest.mark.parametrize("text, want", [
    ("Answer: 12 but \\boxed{33}", ("33", "boxed")),
    ("\\boxed{33} and Answer: 12", ("33", "boxed")),
    ("Final answer: 33", ("33", "answer_line")),
    ("\\boxed{33 and Answer: 12", ("12", "answer_line")),
    ("nothing here", (None, "none")),
])
def test_extract_answer_prefers_the_box(text, want):
    assert extract_answer(text) == want


# ---- normalize_integer -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, want", [
    ("33", 33), ("033", 33), ("0033", 33), ("33.0", 33), ("33.000", 33), ("+33", 33), ("-33", -33), ("-0", 0),
    ("0", 0), ("000", 0), ("33.", 33), ("$33$", 33), ("\\(33\\)", 33), ("(33)", 33), ("33,", 33),
    ("\\text{33}", 33), ("\\textbf{033}", 33), ("\\mathrm{33}", 33), ("33 \\text{ degrees}", 33),
    ("33 degrees", 33), ("33^\\circ", 33), ("33^{\\circ}", 33), ("33°", 33), ("\\$33", 33), ("33 dollars", 33),
    ("x = 33", 33), ("n=33", 33), ("m + n = 33", 33), ("x=3+30=33", 33), ("33\\!", 33), ("~33~", 33),
    ("3\\,3\\,", None), ("1,000", 1000), ("1{,}000", 1000), ("1\\,000", 1000), ("1 000 000", 1000000),
    ("12,345,678", 12345678), ("1,000.0", 1000), ("33, 33", 33), ("the answer 33 again 33", 33),
    ("33\\qquad\\text{apples}", 33), ("- 33", -33), ("−33", -33),
    # rejected: fractions, operators, other commands, several numbers, non-integers, nothing
    ("\\frac{1}{2}", None), ("\\dfrac{66}{2}", None), ("1/2", None), ("33.5", None), (".5", None),
    ("0.33e2", None), ("3.3e1", None), ("1e3", None), ("5!", None), ("33\\%", None), ("33%", None),
    ("2^5", None), ("33 cm^2", None), ("\\sqrt{33}", None), ("33\\pi", None), ("33 \\cdot 1", None),
    ("33 - 1", None), ("33-", None), ("--33", None), ("33 or 34", None), ("1,2", None), ("1,00", None),
    ("1234,567", None), ("1 2", None), ("x \\approx 33", None), ("33 \\pm 1", None), ("x", None), ("", None),
    ("=", None), ("33 = x", None), ("\\infty", None), ("1" + "0" * 1000, None), ("1" + "0" * 998, 10 ** 998),
])
def test_normalize_integer(text, want):
    assert normalize_integer(text) == want


def test_normalize_integer_of_a_non_string_is_none():
    assert normalize_integer(None) is None and normalize_integer(33) is None


# ---- properties ------------------------------------------------------------------------------------------------
LATEXISH = st.lists(st.sampled_from(
    ["\\boxed{", "\\fbox{", "\\boxed ", "{", "}", "$", " ", "\n", "0", "1", "3", "9", ",", ".", "-", "+", "=", "^",
     "\\frac", "\\text{", "\\", "x", "Answer:", "**", "final answer is", "</think>", K3_RESPONSE_MARKER,
     "<|close|>", "é", "\u0663", "\x00"]), max_size=40).map("".join)
FORMATS = ["{}", "0{}", "\\boxed{{{}}}", "${}$", "{}.0", "\\text{{{}}}", "{} \\text{{ units}}", "x = {}", "{}."]


@settings(max_examples=200, deadline=1000, suppress_health_check=[HealthCheck.too_slow])
@given(LATEXISH)
def test_every_function_takes_any_string(text):
    for channel in RESPONSE_CHANNELS:
        seg = final_segment(text, channel)
        assert seg is None or (isinstance(seg, str) and seg in text)
    boxed, line = last_boxed(text), answer_line(text)
    assert boxed is None or (isinstance(boxed, str) and boxed and boxed in text)
    assert line is None or (isinstance(line, str) and line and line in text)
    answer, how = extract_answer(text)
    assert (answer, how) == ((boxed, "boxed") if boxed is not None else
                             (line, "answer_line") if line is not None else (None, "none"))
    value = normalize_integer(text)
    assert value is None or (type(value) is int and normalize_integer(str(value)) == value)


@settings(max_examples=200, deadline=1000)
@given(st.integers(min_value=-10**12, max_value=10**12), st.sampled_from(FORMATS))
def test_normalize_integer_reads_every_written_form(n, fmt):
    text = fmt.format(n)
    if fmt.startswith("0") and n < 0:
        return  # "0-5" is not a way to write -5
    assert normalize_integer(text) == n
    assert normalize_integer(f"{text} or {n + 1}") is None  # a hedge between two numbers is no answer


@settings(max_examples=200, deadline=1000)
@given(LATEXISH, LATEXISH, st.integers(min_value=0, max_value=999))
def test_the_last_complete_box_wins(prefix, suffix, n):
    if (len(prefix) - len(prefix.rstrip("\\"))) % 2:  # a trailing backslash would escape the box's backslash
        prefix += " "
    suffix = suffix.replace("\\boxed", "").replace("\\fbox", "")
    assert last_boxed(f"{prefix}\\boxed{{{n}}}{suffix}") == str(n)
    assert extract_answer(f"{prefix}\\boxed{{{n}}}{suffix}") == (str(n), "boxed")


# ---- huge, deep, pathological ----------------------------------------------------------------------------------
MB = 1_000_000
PATHOLOGICAL = {
    "open boxes": "\\boxed{" * (MB // 7),
    "deep nesting": "\\boxed{" * 100_000 + "33" + "}" * 100_000,
    "braces": "{" * (MB // 2) + "}" * (MB // 2),
    "backslashes": "\\" * MB,
    "digits": "9" * MB,
    "thousands": "1" + ",000" * (MB // 4),
    "spaced groups": "1" + " 000" * (MB // 4),
    "signs": "-" * MB,
    "words and numbers": "a 1 " * (MB // 4),
    "answer labels": "Answer:" * (MB // 7),
    "answer spaces": "answer" + " " * MB + "x",
    "final answer is": "final answer is " * (MB // 16),
    "brace-less boxes": "\\boxed " * (MB // 7),
    "carets": "^" * MB,
    "markers": K3_RESPONSE_MARKER * (MB // 23) + "<|close|>" * (MB // 9),
}


@pytest.mark.parametrize("name", list(PATHOLOGICAL))
def test_one_megabyte_inputs_take_under_a_second(name):
    text = PATHOLOGICAL[name]
    for fn in (last_boxed, answer_line, extract_answer, normalize_integer, final_segment):
        t0 = time.perf_counter()
        out = fn(text)
        assert time.perf_counter() - t0 < 1.0, (fn.__name__, name)
        assert out is None or isinstance(out, (str, int, tuple))


def test_deep_nesting_finds_the_innermost_box():
    assert last_boxed(PATHOLOGICAL["deep nesting"]) == "33"
    assert normalize_integer(PATHOLOGICAL["thousands"]) is None  # over MAX_INTEGER_DIGITS


def test_five_megabytes_stay_linear():
    text = ("\\boxed{1} {x} \\frac{a}{b} Answer: 2 " * 200_000)[:5 * MB] + "\\boxed{33}"
    t0 = time.perf_counter()
    assert extract_answer(text) == ("33", "boxed")
    assert normalize_integer(text) is None
    assert time.perf_counter() - t0 < 5.0
