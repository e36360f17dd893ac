"""Guess-the-number problems, generated: `data.source=guess` (the problems of `env=guess`).

A problem is a range 1..n and a secret in it: the row's question is "Guess my number from 1 to {n}:" and its answer
the secret ("7"). `generate_rows(split, size, seed, task_args, distinct)` draws n uniformly from
`task_args.min_n..max_n` and then the secret uniformly from 1..n, with a `random.Random` seeded by `seed`, so a
(split, size, seed, task_args, distinct) tuple always gives the same rows.

Held out by a hash of the prompt: a range belongs to `test` when the first 8 bytes of the SHA-1 of its question text
("Guess my number from 1 to 19:") fall in one bucket of TEST_BUCKETS, to `train` otherwise; every draw whose range is
the other split's is skipped. So no training draw, whatever its seed, size or task_args, has a held-out prompt: the
held-out episodes are searches of ranges the policy never saw (in 8..32: 10, 11, 19, 26, 27 and 30), their secrets
uniform like the training ones. (A split of (range, secret) pairs instead leaks: the training secrets of a range are
then exactly the ones the eval never asks for, and RL learns to avoid guessing the held-out ones: held-out success
fell from 39% to 32% in 20 steps.)
"""
from __future__ import annotations

import hashlib
import random
from typing import Any

GUESS_SOURCE = "guess"
"""`data.source=guess`."""
TEST_BUCKETS = 4
"""One hash bucket of TEST_BUCKETS is the test split: about 1/4 of the ranges."""
SPLITS = ("train", "test")
TASK_ARGS = {"min_n": 8, "max_n": 32}
"""The task_args it takes, with their defaults: the range's upper bound n is drawn from min_n..max_n."""
_DRAW_FACTOR = 64
"""Draws allowed per kept row before giving up (a split, or distinct rows, with too few pairs)."""


class GuessSourceError(ValueError):
    """The rows asked for cannot be made: the message names the setting to change."""


def is_guess(source: str) -> bool:
    return source == GUESS_SOURCE


def question(n: int) -> str:
    return f"Guess my number from 1 to {n}:"


def in_split(n: int, split: str) -> bool:
    """Whether the range 1..n is in `split`, by the first 8 bytes of the SHA-1 of its question text."""
    digest = hashlib.sha1(question(n).encode()).digest()
    return (int.from_bytes(digest[:8], "big") % TEST_BUCKETS == 0) == (split == "test")


def task_args_of(task_args: dict[str, Any]) -> tuple[int, int]:
    """(min_n, max_n) of `task_args`, checked: known keys only, integers with 1 <= min_n <= max_n."""
    unknown = sorted(set(task_args) - set(TASK_ARGS))
    if unknown:
        raise GuessSourceError(f"data.task_args: data.source=guess takes {', '.join(TASK_ARGS)}, not "
                               f"{', '.join(unknown)}")
    args = TASK_ARGS | dict(task_args)
    for k, v in args.items():
        if isinstance(v, bool) or not isinstance(v, int):
            raise GuessSourceError(f"data.task_args.{k}: must be an integer, got {v!r}")
    if not 1 <= args["min_n"] <= args["max_n"]:
        raise GuessSourceError(f"data.task_args: need 1 <= min_n <= max_n, got min_n={args['min_n']}, "
                               f"max_n={args['max_n']}")
    return args["min_n"], args["max_n"]


def generate_rows(split: str, size: int, seed: int, task_args: dict[str, Any], distinct: bool = True) -> list[dict]:
    """`size` rows {"id", "question", "answer", "n"} of `split`, in draw order; `distinct`: each pair once."""
    if split not in SPLITS:
        raise GuessSourceError(f"data.split={split!r}: data.source=guess has the splits {', '.join(SPLITS)}")
    lo, hi = task_args_of(task_args)
    rng = random.Random(f"guess:{seed}")
    rows, seen = [], set()
    for i in range(size * _DRAW_FACTOR):
        n = rng.randint(lo, hi)
        secret = rng.randint(1, n)
        if not in_split(n, split) or (distinct and (n, secret) in seen):
            continue
        seen.add((n, secret))
        rows.append({"id": f"guess-{seed}-{i}", "question": question(n), "answer": str(secret), "n": n})
        if len(rows) == size:
            return rows
    raise GuessSourceError(f"data.source=guess: only {len(rows)} of data.size={size} {'distinct ' * distinct}"
                           f"problems of split {split!r} in {size * _DRAW_FACTOR} draws (ranges up to {hi}); lower "
                           "data.size, set data.distinct=false, or widen data.task_args")
