"""Worked multi-step sums, generated: `data.source=worked_sum` (the reasoning task of `recipe=k3_m2_reasoning`).

A problem is a chain of signed terms, "48 + 27 - 93 + 15"; its worked solution folds the first two terms of the
chain into their sum, one line per step, rewriting the rest of the chain each time, and ends with an answer line:

    = 75 - 93 + 15
    = -18 + 15
    = -3
    Answer: -3

A row is {"id", "question", "answer", "solution", "terms"}: `answer` is the final integer ("-3", what the reward
grades), `solution` the worked text above (what SFT trains on: `data.answer_field=solution`). Each line is one step
whose inputs are all on the line before it: add its first two numbers, copy the rest. (An earlier form, one
"total + term = new total" line per term, made every step look its term up in the problem: a byte-level k3_m2 with
three linear-attention layers in four learned it too slowly for a base in minutes, teacher-forced exact 0 after 61
steps.) A policy that gets a step right with probability p solves an n-term problem with about p^(n-1), so
accuracy falls with length and RL has a per-step error rate to drive down. Lengths: a line of k numbers is about
5k bytes, so an n-term solution is about 2.5 n^2 bytes (one token per byte with the byte-level tokenizer; 8 terms:
~160, 16 terms: ~640).

`generate_rows(split, size, seed, task_args, distinct)` draws the number of terms uniformly from
`min_terms..max_terms`, each term's value uniformly from `min_value..max_value` and its sign (+ or -, the first term
always +) by a fair coin, with a `random.Random` seeded by `seed`: a (split, size, seed, task_args, distinct) tuple
always gives the same rows. A problem belongs to `test` when the first 8 bytes of the SHA-1 of its question text fall
in one bucket of TEST_BUCKETS, else to `train`: no training draw, whatever its seed, is a held-out problem.
"""
from __future__ import annotations

import hashlib
import random
from typing import Any

WORKED_SOURCE = "worked_sum"
"""`data.source=worked_sum`."""
TEST_BUCKETS = 8
"""One hash bucket of TEST_BUCKETS is the test split (1/8 of the problems)."""
SPLITS = ("train", "test")
TASK_ARGS = {"min_terms": 8, "max_terms": 16, "min_value": 1, "max_value": 49}
"""The task_args it takes, with their defaults."""
_DRAW_FACTOR = 64
"""Draws allowed per kept row before giving up (a split, or distinct rows, with too few problems)."""


class WorkedSourceError(ValueError):
    """The rows asked for cannot be made: the message names the setting to change."""


def is_worked(source: str) -> bool:
    return source == WORKED_SOURCE


def question(terms: list[int]) -> str:
    """The problem text of signed `terms` (the first positive): [48, 27, -93] -> "48 + 27 - 93"."""
    return chain(terms)


def chain(terms: list[int]) -> str:
    """`terms` written as a chain: the first as it is (its own sign), each later one as " + v" or " - v"."""
    out = str(terms[0])
    for t in terms[1:]:
        out += f" {'-' if t < 0 else '+'} {abs(t)}"
    return out


def solution(terms: list[int]) -> str:
    """The worked solution of `terms`: per step, "= " and the chain with its first two numbers folded into their
    sum, then "Answer: N"."""
    rest, lines = list(terms), []
    while len(rest) > 1:
        rest = [rest[0] + rest[1], *rest[2:]]
        lines.append(f"= {chain(rest)}")
    return "\n".join([*lines, f"Answer: {rest[0]}"])


def in_split(text: str, split: str) -> bool:
    """Whether the problem `text` is in `split`, by the first 8 bytes of the SHA-1 of its text."""
    bucket = int.from_bytes(hashlib.sha1(text.encode()).digest()[:8], "big") % TEST_BUCKETS
    return (bucket == 0) == (split == "test")


def task_args_of(task_args: dict[str, Any]) -> dict[str, int]:
    """`task_args` over TASK_ARGS's defaults, checked: known keys only, integers, 2 <= min_terms <= max_terms,
    1 <= min_value <= max_value."""
    unknown = sorted(set(task_args) - set(TASK_ARGS))
    if unknown:
        raise WorkedSourceError(f"data.task_args: data.source={WORKED_SOURCE} takes {', '.join(TASK_ARGS)}, not "
                                f"{', '.join(unknown)}")
    args = TASK_ARGS | dict(task_args)
    for k, v in args.items():
        if isinstance(v, bool) or not isinstance(v, int):
            raise WorkedSourceError(f"data.task_args.{k}: must be an integer, got {v!r}")
    if not 2 <= args["min_terms"] <= args["max_terms"]:
        raise WorkedSourceError(f"data.task_args: need 2 <= min_terms <= max_terms, got min_terms="
                                f"{args['min_terms']}, max_terms={args['max_terms']}")
    if not 1 <= args["min_value"] <= args["max_value"]:
        raise WorkedSourceError(f"data.task_args: need 1 <= min_value <= max_value, got min_value="
                                f"{args['min_value']}, max_value={args['max_value']}")
    return args


def generate_rows(split: str, size: int, seed: int, task_args: dict[str, Any], distinct: bool = True) -> list[dict]:
    """`size` rows {"id", "question", "answer", "solution", "terms"} of `split`, in draw order; `distinct`: each
    problem once."""
    if split not in SPLITS:
        raise WorkedSourceError(f"data.split={split!r}: data.source={WORKED_SOURCE} has the splits "
                                f"{', '.join(SPLITS)}")
    a = task_args_of(task_args)
    rng = random.Random(f"{WORKED_SOURCE}:{seed}")
    rows, seen = [], set()
    for i in range(size * _DRAW_FACTOR):
        n = rng.randint(a["min_terms"], a["max_terms"])
        terms = [rng.randint(a["min_value"], a["max_value"]) * (1 if j == 0 or rng.random() < 0.5 else -1)
                 for j in range(n)]
        text = question(terms)
        if not in_split(text, split) or (distinct and text in seen):
            continue
        seen.add(text)
        rows.append({"id": f"{WORKED_SOURCE}-{seed}-{i}", "question": text, "answer": str(sum(terms)),
                     "solution": solution(terms), "terms": n})
        if len(rows) == size:
            return rows
    raise WorkedSourceError(f"data.source={WORKED_SOURCE}: only {len(rows)} of data.size={size} "
                            f"{'distinct ' * distinct}problems of split {split!r} in {size * _DRAW_FACTOR} draws; "
                            "lower data.size, set data.distinct=false, or widen data.task_args")
