"""Graders: a response and a gold answer in, a `Grade` (score, reason, extracted and normalised answer) out.

Graders are registered by name (`register_grader`, `get_grader`, `grader_names`) and all share the signature
`grade(response, gold, *, channel="auto", max_chars=MAX_RESPONSE_CHARS) -> Grade`. Built in: `aime` (the
final answer must state an integer in 0..999 equal to the gold), `math` (math-verify's symbolic
equivalence) and `integer` (the response is exactly the gold integer: short-answer generated tasks). The same graders compute the training reward and the eval metrics, so a grader never raises
for any response string (a policy failure is a score of 0 with a reason) and raises `GoldError` only for a
gold answer the grader cannot use (a dataset bug). They are plain functions: time limits are the job of
`grading_pool.GradingPool`, which runs them in worker processes. Nothing here evaluates model output.
"""
from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass

from miles_k3.evals.answers import extract_answer, final_segment, normalize_integer
from miles_k3.utils.registry import check_unclaimed

MAX_RESPONSE_CHARS = 32_000
AIME_RANGE = (0, 999)
_SHOWN_CHARS = 60


@dataclass(frozen=True)
class Grade:
    """One graded response. `score` is in [0, 1] for the built-in graders; `reason` is a short, greppable
    string ("correct", "wrong answer 34 (gold 33)", "no final answer", ...); `extracted` is the answer as
    written (None when none was found); `normalized` is its canonical key for majority voting ("33"; None when
    nothing was extracted or it did not parse); `how` says where the answer came from: "boxed",
    "answer_line" or "none" (the format bonus of `rewards` reads it)."""

    score: float
    reason: str
    extracted: str | None = None
    normalized: str | None = None
    how: str = "none"


class GoldError(ValueError):
    """The gold answer is unusable by the grader (a dataset bug, not a policy failure); names the value."""


Grader = Callable[..., Grade]


@dataclass(frozen=True)
class _Entry:
    fn: Grader
    warmup: tuple[str, str] | None


_GRADERS: dict[str, _Entry] = {}


def register_grader(name: str, *, warmup: tuple[str, str] | None = None) -> Callable[[Grader], Grader]:
    """Decorator: register `fn(response, gold, *, channel, max_chars) -> Grade` as grader `name`.

    `warmup` is a (response, gold) pair a grading worker grades once before it takes work, so that lazy imports
    and caches do not count against the first item's time limit. Worker processes import the grader's module
    by name, so register graders at the top level of an importable module. One function per name (the same
    function registering again, e.g. its module imported twice, is fine); another one is a ValueError.
    """
    def deco(fn: Grader) -> Grader:
        old = _GRADERS.get(name)
        check_unclaimed("grader", name, old.fn if old is not None else None, fn)
        _GRADERS[name] = _Entry(fn, warmup)
        return fn
    return deco


def get_grader(name: str) -> Grader:
    """The grader registered as `name`; ValueError listing the registered names otherwise."""
    if name not in _GRADERS:
        raise ValueError(f"grader: '{name}' is not a registered grader; registered: {', '.join(grader_names())}")
    return _GRADERS[name].fn


def grader_names() -> list[str]:
    """The registered grader names, sorted."""
    return sorted(_GRADERS)


def grader_module(name: str) -> str:
    """The module that defines grader `name` (a worker process imports it to find the grader)."""
    return get_grader(name).__module__


def warm_up(name: str) -> None:
    """Grade the grader's warm-up pair once, if it has one (lazy imports, caches); errors are ignored."""
    pair = _GRADERS[name].warmup if name in _GRADERS else None
    if pair is not None:
        with contextlib.suppress(Exception):  # a warm-up failure shows again, with its reason, on real items
            get_grader(name)(*pair)


# ---- shared steps ----------------------------------------------------------------------------------------------
def _short(text: str) -> str:
    return repr(text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "...")


def _graded_part(response: str, channel: str, max_chars: int) -> tuple[str | None, str]:
    """(the final segment, at most its last max_chars characters, or None; a note for the reason)."""
    segment = final_segment(response, channel)
    if segment is None or len(segment) <= max_chars:
        return segment, ""
    return segment[-max_chars:], f"; graded the last {max_chars} of {len(segment)} chars"


def _precheck(response, channel: str, max_chars: int) -> Grade | tuple[str, str]:
    """A failing Grade when there is nothing to grade, else (the graded text, the reason's note)."""
    if not isinstance(response, str):
        return Grade(0.0, "response is not a string")
    if not isinstance(max_chars, int) or max_chars < 1:
        raise ValueError(f"max_chars: must be an int >= 1, got {max_chars!r}")
    text, note = _graded_part(response, channel, max_chars)
    if text is None:
        return Grade(0.0, f"no final-answer channel ({channel})")
    return text, note


# ---- aime ------------------------------------------------------------------------------------------------------
def _gold_integer(gold) -> int:
    value = normalize_integer(str(gold)) if isinstance(gold, (str, int)) and not isinstance(gold, bool) else None
    if value is None:
        raise GoldError(f"gold {gold!r} is not an integer: the aime grader needs integer gold answers (fix the "
                        "dataset's answer field, or use the math grader)")
    return value


@register_grader("aime")
def grade_aime(response: str, gold: str, *, channel: str = "auto", max_chars: int = MAX_RESPONSE_CHARS) -> Grade:
    """1.0 when the final answer (last box, else answer line) states the gold integer and is in 0..999."""
    return _grade_final_integer(response, gold, channel, max_chars, AIME_RANGE)


@register_grader("answer_integer")
def grade_answer_integer(response: str, gold: str, *, channel: str = "auto",
                         max_chars: int = MAX_RESPONSE_CHARS) -> Grade:
    """1.0 when the final answer (last box, else the last answer line, "Answer: -3") states the gold integer, of
    any sign and size (worked solutions that end with an answer line; `aime` also bounds it to 0..999)."""
    return _grade_final_integer(response, gold, channel, max_chars, None)


def _grade_final_integer(response: str, gold: str, channel: str, max_chars: int,
                         bounds: tuple[int, int] | None) -> Grade:
    """The final answer (last box, else answer line) against the integer gold, within `bounds` when given."""
    want = _gold_integer(gold)
    checked = _precheck(response, channel, max_chars)
    if isinstance(checked, Grade):
        return checked
    text, note = checked
    answer, how = extract_answer(text)
    if answer is None:
        return Grade(0.0, "no final answer" + note)
    value = normalize_integer(answer)
    if value is None:
        return Grade(0.0, f"not an integer: {_short(answer)}{note}", answer, None, how)
    return Grade(*_compare_integer(value, want, note, bounds), answer, str(value), how)


def _compare_integer(value: int, want: int, note: str, bounds: tuple[int, int] | None) -> tuple[float, str]:
    if bounds is not None and not bounds[0] <= value <= bounds[1]:
        return 0.0, f"out of range: {value} is not in {bounds[0]}..{bounds[1]}{note}"
    if value != want:
        return 0.0, f"wrong answer {value} (gold {want}){note}"
    return 1.0, "correct" + note


# ---- math (math-verify) ----------------------------------------------------------------------------------------
_MATH_DELIMITERS = ("$", "\\(", "\\[", "\\boxed", "\\fbox")


class _DropTimeoutNotice(logging.Filter):
    """math-verify warns once per process that its SIGALRM timeouts are off; they are off on purpose (the
    grading pool enforces time limits), so the notice is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutNotice())


def _as_latex(value: str) -> str:
    """`value` with math delimiters: a bare "1+x^2" parsed without them reads as just "1"."""
    return value if any(d in value for d in _MATH_DELIMITERS) else f"${value}$"


def _mv_parse(text: str) -> list:
    from math_verify import parse

    return parse(text, parsing_timeout=None)


def _parse_gold(gold) -> list:
    if not isinstance(gold, str) or not gold.strip():
        raise GoldError(f"gold {gold!r} is not a non-empty string: the math grader needs a LaTeX or plain answer")
    parsed = _mv_parse(_as_latex(gold)) or _mv_parse(gold)
    if not parsed:
        raise GoldError(f"gold {gold!r} does not parse with math-verify: fix the dataset's answer field")
    return parsed


def _parse_answer(text: str, answer: str | None, how: str) -> list:
    if how == "boxed":
        return _mv_parse(f"\\boxed{{{answer}}}")
    if how == "answer_line":
        return _mv_parse(_as_latex(answer)) or _mv_parse(answer)
    return _mv_parse(text)


# ---- integer ---------------------------------------------------------------------------------------------------
_INTEGER = re.compile(r"[+-]?[0-9]+")
_MAX_INTEGER_CHARS = 64


def _exact_gold_integer(gold) -> int:
    text = str(gold).strip() if isinstance(gold, (str, int)) and not isinstance(gold, bool) else ""
    if len(text) > _MAX_INTEGER_CHARS or not _INTEGER.fullmatch(text):
        raise GoldError(f"gold {gold!r} is not an integer: the integer grader needs integer gold answers (fix the "
                        "dataset's answer field, or use the math grader)")
    return int(text)


@register_grader("integer")
def grade_integer(response: str, gold: str, *, channel: str = "auto",
                  max_chars: int = MAX_RESPONSE_CHARS) -> Grade:
    """1.0 when the final segment is exactly the gold integer: optional sign and digits, surrounding whitespace
    allowed, nothing else (for short-answer tasks such as reasoning-gym arithmetic; any integer, negative too).
    `how` is "integer" for a well-formed answer (right or wrong), "none" otherwise."""
    want = _exact_gold_integer(gold)
    checked = _precheck(response, channel, max_chars)
    if isinstance(checked, Grade):
        return checked
    text, note = checked
    answer = text.strip()
    if len(answer) > _MAX_INTEGER_CHARS or not _INTEGER.fullmatch(answer):
        return Grade(0.0, f"not a bare integer: {_short(answer)}{note}")
    value = int(answer)
    if value != want:
        return Grade(0.0, f"wrong answer {value} (gold {want}){note}", answer, str(value), "integer")
    return Grade(1.0, "correct" + note, answer, str(value), "integer")


@register_grader("math", warmup=("\\boxed{\\frac{1}{2}}", "0.5"))
def grade_math(response: str, gold: str, *, channel: str = "auto", max_chars: int = MAX_RESPONSE_CHARS) -> Grade:
    """1.0 when math-verify finds the final answer (the last box, else the answer line, else whatever it finds
    in the final segment) equivalent to the gold. The gold is parsed first: an unusable gold is a GoldError
    whatever the response; an exception inside math-verify on the response is a score of 0, never raised."""
    try:
        gold_parsed = _parse_gold(gold)
    except GoldError:
        raise
    except Exception as e:  # noqa: BLE001 - math-verify's own failure modes are many
        return Grade(0.0, f"math-verify error on the gold: {type(e).__name__}: {e}")
    checked = _precheck(response, channel, max_chars)
    if isinstance(checked, Grade):
        return checked
    return _verify(gold_parsed, *checked)


def _verify(gold_parsed: list, text: str, note: str) -> Grade:
    from math_verify import verify

    answer, how = extract_answer(text)
    try:
        parsed = _parse_answer(text, answer, how)
        if not parsed:
            reason = "no final answer" if answer is None else f"unparseable answer: {_short(answer)}"
            return Grade(0.0, reason + note, answer, None, how)
        ok = verify(gold_parsed, parsed, timeout_seconds=None)
    except Exception as e:  # noqa: BLE001 - any math-verify failure is a 0 with its reason, never a crash
        return Grade(0.0, f"math-verify error: {type(e).__name__}: {str(e)[:200]}{note}", answer, None, how)
    if answer is None and len(parsed) > 1 and isinstance(parsed[1], str):
        answer = parsed[1]  # math-verify found it in the unmarked final segment
    normalized = str(parsed[0])
    reason = "correct" if ok else f"wrong answer {_short(normalized)} (gold {_short(str(gold_parsed[0]))})"
    return Grade(1.0 if ok else 0.0, reason + note, answer, normalized, how)
