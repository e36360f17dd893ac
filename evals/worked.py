"""Worked multi-step sums, generated: `data.source=worked_sum` (the reasoning task of `recipe=k3_m2_reasoning`).

A problem is a sum of signed terms; its worked solution adds them one step per line and ends with an answer line
(`data.task_args.form`):

    form=named (the default)              form=chain
    question: a+b+c+d with a=48, b=27,    question: 48 + 27 - 93 + 15
              c=-93, d=15
    a=48                                  = 75 - 93 + 15
    48 + b=27 = 75                        = -18 + 15
    75 + c=-93 = -18                      = -3
    -18 + d=15 = -3                       Answer: -3
    Answer: -3

A row is {"id", "question", "answer", "solution", "terms"}: `answer` is the final integer ("-3", what the reward
grades), `solution` the worked text above (what SFT trains on: `data.answer_field=solution`). In the named form
each term has a letter and each line starts with the running total (the end of the line before), names the next
letter and copies that term's value from the question (found by its letter: "c=" is written in both places), then
the new total. In the chain form each line folds the first two numbers of the chain before it and copies the rest.
Measured on the CPU (k3_tiny from its random init, 3-5 terms of 1-9, 300 steps of 16, lr 1e-3; 64 held-out
problems, benchmarks/results/worked_form_cpu.json): teacher-forced token accuracy 0.88 and 0.90 in two runs of the
named form against 0.77 in the chain form (0.84 after 600 steps), whose copies go wrong where the chain's numbers
repeat; whole solutions right: 1 of 64 in one named run, none in the others; on one GPU a k3_m2 of the chain form stalled at
0.6-0.77 (exact 0) within 6 minutes. (The first form, "total + term = new total" without letters, made every step
find its term by position: exact 0 after 61 steps on the GPU.) A policy that gets a step right with probability p
solves an n-term problem with about p^(n-1), so accuracy falls with length and RL has a per-step error rate to
drive down. Lengths (one token per byte with the byte-level tokenizer): named, about 4 + 17 (n - 1) bytes for
two-digit terms (8 terms: ~125, 16 terms: ~270); chain, about 2.5 n^2 (8 terms: ~160, 16 terms: ~640).

`generate_rows(split, size, seed, task_args, distinct)` draws the number of terms uniformly from
`min_terms..max_terms`, each term's value uniformly from `min_value..max_value` and its sign (+ or -, the first term
always +) by a fair coin, with a `random.Random` seeded by `seed`: a (split, size, seed, task_args, distinct) tuple
always gives the same rows, whatever the form. A problem belongs to `test` when the first 8 bytes of the SHA-1 of its
chain text ("48 + 27 - 93 + 15") fall in one bucket of TEST_BUCKETS, else to `train`: no training draw, whatever its
seed or form, is a held-out problem.
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
TASK_ARGS = {"min_terms": 8, "max_terms": 16, "min_value": 1, "max_value": 49, "form": "named"}
"""The task_args it takes, with their defaults."""
FORMS = ("named", "chain")
"""The forms of a worked solution (task_args.form)."""
LETTERS = "abcdefghijklmnopqrstuvwxyz"
"""The names of the terms in the named form: 26 terms at most."""
_DRAW_FACTOR = 64
"""Draws allowed per kept row before giving up (a split, or distinct rows, with too few problems)."""


class WorkedSourceError(ValueError):
    """The rows asked for cannot be made: the message names the setting to change."""


def is_worked(source: str) -> bool:
    return source == WORKED_SOURCE


def question(terms: list[int], form: str = "named") -> str:
    """The problem text of signed `terms` (the first positive): [48, 27, -93] -> "a+b+c with a=48, b=27, c=-93"
    (named) or "48 + 27 - 93" (chain)."""
    if form == "chain":
        return chain(terms)
    names = LETTERS[:len(terms)]
    return "+".join(names) + " with " + ", ".join(f"{x}={t}" for x, t in zip(names, terms))


def chain(terms: list[int]) -> str:
    """`terms` written as a chain: the first as it is (its own sign), each later one as " + v" or " - v"."""
    out = str(terms[0])
    for t in terms[1:]:
        out += f" {'-' if t < 0 else '+'} {abs(t)}"
    return out


def solution(terms: list[int], form: str = "named") -> str:
    """The worked solution of `terms`, then "Answer: N". named: "a=v", then per term "total + x=v = new total";
    chain: per step, "= " and the chain with its first two numbers folded into their sum."""
    if form != "chain":
        total, lines = terms[0], [f"{LETTERS[0]}={terms[0]}"]
        for x, t in zip(LETTERS[1:], terms[1:]):
            lines.append(f"{total} + {x}={t} = {total + t}")
            total += t
        return "\n".join([*lines, f"Answer: {total}"])
    rest, lines = list(terms), []
    while len(rest) > 1:
        rest = [rest[0] + rest[1], *rest[2:]]
        lines.append(f"= {chain(rest)}")
    return "\n".join([*lines, f"Answer: {rest[0]}"])


def in_split(text: str, split: str) -> bool:
    """Whether the problem `text` is in `split`, by the first 8 bytes of the SHA-1 of its text."""
    bucket = int.from_bytes(hashlib.sha1(text.encode()).digest()[:8], "big") % TEST_BUCKETS
    return (bucket == 0) == (split == "test")


def task_args_of(task_args: dict[str, Any]) -> dict[str, Any]:
    """`task_args` over TASK_ARGS's defaults, checked: known keys only, integers, 2 <= min_terms <= max_terms (<= 26
    in the named form), 1 <= min_value <= max_value, form one of FORMS."""
    unknown = sorted(set(task_args) - set(TASK_ARGS))
    if unknown:
        raise WorkedSourceError(f"data.task_args: data.source={WORKED_SOURCE} takes {', '.join(TASK_ARGS)}, not "
                                f"{', '.join(unknown)}")
    args = TASK_ARGS | dict(task_args)
    if args["form"] not in FORMS:
        raise WorkedSourceError(f"data.task_args.form: {args['form']!r} is not one of {', '.join(FORMS)}")
    for k, v in args.items():
        if k != "form" and (isinstance(v, bool) or not isinstance(v, int)):
            raise WorkedSourceError(f"data.task_args.{k}: must be an integer, got {v!r}")
    if not 2 <= args["min_terms"] <= args["max_terms"]:
        raise WorkedSourceError(f"data.task_args: need 2 <= min_terms <= max_terms, got min_terms="
                                f"{args['min_terms']}, max_terms={args['max_terms']}")
    if args["form"] == "named" and args["max_terms"] > len(LETTERS):
        raise WorkedSourceError(f"data.task_args.max_terms: the named form has {len(LETTERS)} letters, got "
                                f"{args['max_terms']}; lower it or set data.task_args.form=chain")
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
        text = chain(terms)  # the split and distinctness by the terms, whatever the form
        if not in_split(text, split) or (distinct and text in seen):
            continue
        seen.add(text)
        rows.append({"id": f"{WORKED_SOURCE}-{seed}-{i}", "question": question(terms, a["form"]),
                     "answer": str(sum(terms)), "solution": solution(terms, a["form"]), "terms": n})
        if len(rows) == size:
            return rows
    raise WorkedSourceError(f"data.source={WORKED_SOURCE}: only {len(rows)} of data.size={size} "
                            f"{'distinct ' * distinct}problems of split {split!r} in {size * _DRAW_FACTOR} draws; "
                            "lower data.size, set data.distinct=false, or widen data.task_args")
