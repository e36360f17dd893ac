"""Procedurally generated problems from `reasoning-gym` (offline, verifiable): `data.source=reasoning_gym:<name>`.

`generate_rows(name, split, size, seed, task_args)` draws problems from reasoning-gym's generator `name` (e.g.
`chain_sum`, `basic_arithmetic`) configured by `task_args` (its own parameters: `min_terms`, `max_digits`, ...)
and returns `size` rows `{"id", "question", "answer", "metadata"}` that `evals.datasets` then maps like any other
data (`data.problem_field=metadata.expression` takes the bare expression of an arithmetic task). Every problem
appears once (unless distinct=False), and belongs to exactly one split by a hash of its question text: `test` keeps the problems whose hash falls in one
bucket of `TEST_BUCKETS`, `train` all the others, so a held-out set never shares a problem with training data,
whatever the seeds and sizes. Draw i of a generator seeded `seed` is always the same problem, so a
(name, split, size, seed, task_args) tuple reproduces the same rows. reasoning-gym is imported lazily.
"""
from __future__ import annotations

import hashlib
from typing import Any

TASK_PREFIX = "reasoning_gym:"
"""`data.source` prefix naming a reasoning-gym generator."""
TEST_BUCKETS = 8
"""One question hash bucket in TEST_BUCKETS is the `test` split (1/8 of the problem space)."""
SPLITS = ("train", "test")
_DRAW_FACTOR = 64
"""Draws allowed per kept row before giving up (a split or a task_args with too few distinct problems)."""


class TaskError(ValueError):
    """The generator cannot make the rows asked for: the message names the setting to change."""


def is_task(source: str) -> bool:
    return isinstance(source, str) and source.startswith(TASK_PREFIX)


def task_name(source: str) -> str:
    return source[len(TASK_PREFIX):]


def in_split(question: str, split: str) -> bool:
    """Whether `question` belongs to `split` (train or test), by the first 8 bytes of its SHA-1."""
    bucket = int.from_bytes(hashlib.sha1(question.encode("utf-8")).digest()[:8], "big") % TEST_BUCKETS
    return (bucket == 0) == (split == "test")


def generate_rows(name: str, split: str, size: int, seed: int, task_args: dict[str, Any],
                  distinct: bool = True) -> list[dict]:
    """`size` rows of generator `name` in `split`, in draw order (see the module docstring). `distinct`: skip a
    problem already drawn (a set of distinct problems over-represents the rare, harder ones); False keeps the
    generator's own distribution, repeats included."""
    if split not in SPLITS:
        raise TaskError(f"data.split={split!r}: a reasoning_gym source has the splits {', '.join(SPLITS)}")
    dataset = _dataset(name, seed, size * _DRAW_FACTOR, task_args)
    rows, seen = [], set()
    for i in range(len(dataset)):
        entry = dataset[i]
        if (distinct and entry["question"] in seen) or not in_split(entry["question"], split):
            continue
        seen.add(entry["question"])
        rows.append({"id": f"{name}-{seed}-{i}", "question": entry["question"], "answer": str(entry["answer"]),
                     "metadata": _plain(entry.get("metadata", {}))})
        if len(rows) == size:
            return rows
    raise TaskError(f"data.source={TASK_PREFIX}{name}: only {len(rows)} of data.size={size} distinct problems "
                    f"of split {split!r} in {len(dataset)} draws; lower data.size or widen data.task_args")


def _dataset(name: str, seed: int, size: int, task_args: dict[str, Any]):
    try:
        import reasoning_gym
    except ImportError:
        raise TaskError(f"data.source={TASK_PREFIX}{name} needs reasoning-gym: pip install reasoning-gym") from None
    try:
        return reasoning_gym.create_dataset(name, seed=seed, size=size, **dict(task_args))
    except (ValueError, TypeError, KeyError, AssertionError) as e:  # unknown name or parameter, invalid value
        raise TaskError(f"data.source={TASK_PREFIX}{name} with data.task_args={dict(task_args)}: reasoning-gym "
                        f"refused it ({type(e).__name__}: {e})") from None


def _plain(value: Any) -> Any:
    """Metadata as JSON-like values with one type per key (tuples become lists) so that Arrow stores it."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
