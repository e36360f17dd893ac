"""Final-answer extraction and normalisation: the pure string functions every grader is built from.

A response is cut to the part that is graded (`final_segment`: Kimi K3's final-answer channel, the text after
`</think>`, or all of it), the answer is pulled out of that part (`extract_answer`: the last `\\boxed{...}`, else
the last "Answer: ..." line) and, for integer-answer benchmarks such as AIME, reduced to an int
(`normalize_integer`). The same functions score training rollouts and evaluations, so they must accept any
string a policy can emit: all of them run in time linear in the input (single scans, and regular expressions
without nested or adjacent ambiguous quantifiers), never raise on odd input, and never evaluate it.
"""
from __future__ import annotations

import re

RESPONSE_CHANNELS = ("auto", "none", "k3", "think")
K3_RESPONSE_MARKER = "<|open|>response<|sep|>"
K3_END_MARKERS = ("<|close|>", "<|end_of_msg|>")
THINK_END = "</think>"
MAX_INTEGER_DIGITS = 1000
"""`normalize_integer` rejects integers with more significant digits than this (no answer is that long)."""


# ---- the graded part of a response ---------------------------------------------------------------------------
def final_segment(response: str, channel: str = "auto") -> str | None:
    """The part of `response` to grade under `channel` (one of RESPONSE_CHANNELS).

    k3: the text after the last `<|open|>response<|sep|>`, cut at the first `<|close|>` or `<|end_of_msg|>`
    after it; None when the marker is absent (the model never reached its answer). think: the text after the
    last `</think>`; None when absent. none: the whole response. auto: k3 when its marker is present, else think
    when `</think>` is present, else the whole response. Raises ValueError for an unknown channel.
    """
    if channel not in RESPONSE_CHANNELS:
        raise ValueError(f"channel: '{channel}' is not one of {', '.join(RESPONSE_CHANNELS)}")
    if channel == "none":
        return response
    if channel in ("k3", "auto") and K3_RESPONSE_MARKER in response:
        return _k3_answer(response)
    if channel in ("think", "auto") and THINK_END in response:
        return response[response.rfind(THINK_END) + len(THINK_END):]
    return response if channel == "auto" else None


def _k3_answer(response: str) -> str:
    start = response.rfind(K3_RESPONSE_MARKER) + len(K3_RESPONSE_MARKER)
    ends = [i for i in (response.find(m, start) for m in K3_END_MARKERS) if i >= 0]
    return response[start:min(ends)] if ends else response[start:]


# ---- \boxed{...} -----------------------------------------------------------------------------------------------
# One left-to-right tokenisation: a box command, an escaped character (`\{`, `\}`, `\\` do not group) or a brace.
_BOX_TOKENS = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])|\\.|[{}]", re.DOTALL)
_INLINE_SPACE = " \t"
_BRACELESS_TRAILING = ".,$"


def last_boxed(text: str) -> str | None:
    """The stripped content of the last complete `\\boxed{...}` / `\\fbox{...}` in `text`, or None.

    Braces are counted (`\\boxed{\\frac{1}{2}}` -> `\\frac{1}{2}`; `\\{`, `\\}` do not count), whitespace may
    separate the command from its brace, and the brace-less form `\\boxed 33` gives the run of non-space
    characters after the space(s) with trailing `.`, `,`, `$` dropped. A box whose brace is never closed, or
    whose content is empty, is skipped: an earlier complete box is returned instead, or None.
    """
    if "\\boxed" not in text and "\\fbox" not in text:
        return None
    boxes, closes = _scan_boxes(text)
    for command_end, brace in reversed(boxes):
        value = _box_content(text, command_end, brace, closes)
        if value:
            return value
    return None


def _scan_boxes(text: str) -> tuple[list[tuple[int, int]], dict[int, int]]:
    """[(end of the box command, position of its opening brace or -1)] and {box brace: its closing brace}."""
    boxes: list[tuple[int, int]] = []
    box_braces: set[int] = set()
    closes: dict[int, int] = {}
    stack: list[int] = []
    for m in _BOX_TOKENS.finditer(text):
        tok = m.group()
        if tok == "{":
            stack.append(m.start())
        elif tok == "}":
            if stack and (opened := stack.pop()) in box_braces:
                closes[opened] = m.start()
        elif len(tok) > 2:  # \boxed or \fbox
            brace = _brace_after(text, m.end())
            boxes.append((m.end(), brace))
            box_braces.add(brace)
    return boxes, closes


def _brace_after(text: str, pos: int) -> int:
    """The position of a `{` that follows `pos` after optional whitespace, or -1."""
    n = len(text)
    while pos < n and text[pos].isspace():
        pos += 1
    return pos if pos < n and text[pos] == "{" else -1


def _box_content(text: str, command_end: int, brace: int, closes: dict[int, int]) -> str | None:
    if brace >= 0:
        close = closes.get(brace)
        return None if close is None else text[brace + 1:close].strip()
    start = command_end
    while start < len(text) and text[start] in _INLINE_SPACE:
        start += 1
    if start == command_end:  # `\boxed33`: not the brace-less form
        return None
    end = start
    while end < len(text) and not text[end].isspace():
        end += 1
    return text[start:end].rstrip(_BRACELESS_TRAILING)


# ---- "Answer: ..." lines ---------------------------------------------------------------------------------------
_MARKUP = "*_ "
_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")  # keeps every index
_MAX_MARKUP = 8


def answer_line(text: str) -> str | None:
    """The rest of the line after the last answer label in `text`, stripped (with `*` markup), or None.

    Labels (case-insensitive, `answer` a whole word): "Answer: 33", "**Answer:** 33", "**Answer**: 33",
    "Final answer: 33", "The answer is: 33", "The final answer is 33" (a bare "the answer is" is not a label:
    reasoning says it mid-thought). A label with nothing after it on its line is skipped.
    """
    low = text.translate(_ASCII_LOWER)  # str.lower() may change the length ("İ" -> "i̇")
    end = len(low)
    while (i := low.rfind("answer", 0, end)) >= 0:
        end = i
        if i > 0 and low[i - 1].isalpha():
            continue
        value_start = _label_end(low, i)
        if value_start >= 0:
            line_end = low.find("\n", value_start)
            value = text[value_start:line_end if line_end >= 0 else len(text)].strip().strip("*").strip()
            if value:
                return value
    return None


def _label_end(low: str, i: int) -> int:
    """Where the value starts when `low[i:]` is an answer label ("answer:", "answer is:", or after "final",
    "answer is"), else -1. Only a bounded number of markup characters is skipped: each candidate costs O(1)."""
    pos = _skip_markup(low, i + len("answer"))
    if low.startswith(":", pos):
        return _skip_markup(low, pos + 1)
    if not (low.startswith("is", pos) and not low[pos + 2:pos + 3].isalpha()):
        return -1
    after = _skip_markup(low, pos + 2)
    if low.startswith(":", after):
        return _skip_markup(low, after + 1)
    return after if low[max(0, i - 8):i].rstrip(_MARKUP).endswith("final") else -1


def _skip_markup(low: str, pos: int) -> int:
    stop = min(len(low), pos + _MAX_MARKUP)
    while pos < stop and low[pos] in _MARKUP:
        pos += 1
    return pos


def extract_answer(text: str) -> tuple[str | None, str]:
    """(answer, how): the last boxed answer ("boxed"), else the last answer line ("answer_line"), else
    (None, "none")."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed, "boxed"
    line = answer_line(text)
    if line is not None:
        return line, "answer_line"
    return None, "none"


# ---- integers ------------------------------------------------------------------------------------------------
# A "filler" run is everything that may surround the number: letters (words, units, variable names), spacing,
# braces, `$`, punctuation (a "." not before a digit), wrapper commands whose content is kept, degree marks. One
# filler run is one token and each position matches exactly one unit, so the regex is linear and the tokens
# that remain (numbers, signs, rejected characters) are few: a scan stops at the first rejected one.
_WRAPPERS = ("text|textbf|textrm|textit|textsf|mathrm|mathbf|mathit|mbox|boxed|fbox|displaystyle|left|right"
             "|q?quad|circ|degree")
_FILLER_UNIT = (r"[^\W\d_]|\s|[{}$(),;:\[\]~°]|\.(?![0-9])|\\[,!;: $()\[\]\\]"
                rf"|\\(?:{_WRAPPERS})(?![A-Za-z])|\^\{{?\\circ(?![A-Za-z])\}}?")
_INT_TOKENS = re.compile(
    r"(?P<num>[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])(?:\.[0-9]+)?|[0-9]+(?:\.[0-9]+)?|\.[0-9]+)"
    rf"|(?P<fill>(?:{_FILLER_UNIT})+)"
    r"|(?P<other>\\[A-Za-z]+|.)", re.DOTALL)
_SPACING = re.compile(r"(?:\s|~|\\[,!;: ]|\\q?quad(?![A-Za-z]))*")
_SIGNS = {"+": "", "-": "-", "\u2212": "-"}
MAX_NUMBERS = 8
"""`normalize_integer` accepts the same integer stated up to this many times ("x = 33, so 33")."""


def normalize_integer(s: str) -> int | None:
    """The integer `s` states, or None when it states anything else (AIME normalisation).

    Stripped: `$`, wrappers such as `\\text{..}`, `\\textbf{..}`, `\\mathrm{..}` (their content is kept), spacing
    (`\\!`, `\\,`, `~`, whitespace), thousands separators ("1,000", "1{,}000", "1\\,000", "1 000"), punctuation
    such as a trailing ".", words and units around the number ("33 degrees", "33^\\circ", "\\$33"), and
    everything up to the last "=" ("x = 33", "m+n=33"). Accepted: one integer, possibly signed, zero-padded or
    with an all-zero fraction ("033" = "33" = "33.0" = "+33"), or the same integer restated (at most
    MAX_NUMBERS times). None: fractions, other operators and commands (`/`, `^`, `!`, `%`, `\\frac`, `\\sqrt`,
    ...), two different numbers, numbers split by spacing alone ("3 3"), "33.5", no number, more than
    MAX_INTEGER_DIGITS digits. Linear time in len(s).
    """
    if not isinstance(s, str):
        return None
    s = s.replace("{,}", ",")
    scan = _IntegerScan()
    for m in _INT_TOKENS.finditer(s, s.rfind("=") + 1):
        if not scan.feed(m.lastgroup, m.group()):
            return None
    return scan.result()


class _IntegerScan:
    """`normalize_integer`'s token-by-token state: the numbers seen (canonical strings), a pending sign, the
    last number's raw text while it may still take a space-separated thousands group ("1 000"), and whether
    only spacing followed it (numbers split by spacing alone are rejected unless they group)."""

    def __init__(self):
        self.numbers: list[str] = []
        self.group = ""
        self.adjacent = False
        self.sign: str | None = None

    def feed(self, kind: str, tok: str) -> bool:
        """Take one token; False as soon as the string cannot be a plain integer."""
        if kind == "num":
            return self._number(tok)
        if kind == "fill":
            if _SPACING.fullmatch(tok):
                return True
            self.group, self.adjacent = "", False
            return self.sign is None
        if tok in _SIGNS and self.sign is None:
            self.sign = _SIGNS[tok]
            self.group, self.adjacent = "", False
            return True
        return False  # an operator ("/", "^", "!", "%", "*"), another command ("\frac", "\pi"), a second sign

    def _number(self, tok: str) -> bool:
        if self.group and self.sign is None and len(tok) == 3 and tok.isdigit():
            raw = self.group = self.group + tok  # "1 000", "1\,000": one number
            self.numbers.pop()
        elif self.adjacent:  # "3 3", "12 34": neither one number nor two separate statements
            return False
        else:
            raw = (self.sign or "") + tok
            self.group = raw if tok.isdigit() and len(tok) <= 3 else ""
        self.sign, self.adjacent = None, True
        value = _canonical(raw)
        if value is None or len(self.numbers) >= MAX_NUMBERS:
            return False
        self.numbers.append(value)
        return value == self.numbers[0]

    def result(self) -> int | None:
        if self.sign is not None or not self.numbers:
            return None
        return int(self.numbers[0])


def _canonical(raw: str) -> str | None:
    """'-033.00' -> '-33', '1,000' -> '1000'; None for a non-integral value or too many digits."""
    sign = "-" if raw.startswith("-") else ""
    whole, _, fraction = raw.lstrip("+-").replace(",", "").partition(".")
    if fraction.strip("0"):
        return None
    whole = whole.lstrip("0") or "0"
    if len(whole) > MAX_INTEGER_DIGITS:
        return None
    return whole if whole == "0" else sign + whole
