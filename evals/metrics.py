"""Eval metrics over n graded samples per problem: avg@n, unbiased pass@k, maj@k, with standard errors.

`pass_at_k(n, c, k)` is the unbiased estimator of the chance that at least one of k samples drawn without
replacement from n (c of them correct) is correct. `majority_answer` picks the voted answer. `summarize` turns
per-problem `SampleOutcome`s into a flat, JSON-serialisable dict of every metric; each metric is a mean over
problems of a per-problem value, and its `_se` key is the standard error of that mean across problems. Pure
Python and numpy.
"""
from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

CORRECT_SCORE = 0.5
"""A sample counts as correct (for pass@k and maj@k) when its score is at least this."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k), computed as
    1 - prod_{j=n-c+1}^{n} (1 - k/j) (no huge binomials); 1.0 when n - c < k. Integers; ValueError when any is
    negative, or k > n, or c > n."""
    n, c, k = (_as_int(v, name) for v, name in ((n, "n"), (c, "c"), (k, "k")))
    if min(n, c, k) < 0:
        raise ValueError(f"pass_at_k: n, c, k must be >= 0, got n={n}, c={c}, k={k}")
    if k > n or c > n:
        raise ValueError(f"pass_at_k: need k <= n and c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / j for j in range(n - c + 1, n + 1))


def _as_int(value, name: str) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"pass_at_k: {name} must be an integer, got {value!r}") from None


def majority_answer(answers: Sequence[str | None]) -> str | None:
    """The most frequent non-None answer; of tied answers, the one that reached the top count first in
    order (["a", "b", "b", "a"] -> "b"); None when every answer is None (or there are none)."""
    counts: dict[str, int] = {}
    best, best_count = None, 0
    for a in answers:
        if a is None:
            continue
        counts[a] = counts.get(a, 0) + 1
        if counts[a] > best_count:
            best, best_count = a, counts[a]
    return best


@dataclass(frozen=True)
class SampleOutcome:
    """One graded sample: `score` 1.0 correct / 0.0 wrong (in [0, 1]); `answer` the normalised answer key
    used for voting (None: no answer); `truncated` it hit the token cap; `num_tokens` its response length."""

    score: float
    answer: str | None
    truncated: bool
    num_tokens: int


def default_ks(n: int) -> list[int]:
    """The powers of two below n, then n: 16 -> [1, 2, 4, 8, 16]; 6 -> [1, 2, 4, 6]; 1 -> [1]."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def summarize(outcomes: dict[str, list[SampleOutcome]], golds: dict[str, str | None] | None = None,
              ks: list[int] | None = None) -> dict:
    """Every metric of `outcomes` (problem id -> its n samples in order; the same n >= 1 for every problem).

    Keys (N problems, n samples each; means are over problems, `_se` = sample std (ddof=1) of the per-problem
    values / sqrt(N), 0.0 when N == 1):
      num_problems (int N); samples_per_problem (int n);
      avg@n, avg@n_se: mean score of a problem's n samples (n is the number, e.g. "avg@16");
      pass@k, pass@k_se for each k in ks: unbiased pass@k from the problem's n samples, c of them correct;
      maj@k, maj@k_se for each k in ks: 1.0 when the majority answer of the problem's FIRST k samples equals
        the answer of a correct sample among those k, else 0.0 (no answer at all: 0.0);
      answer_rate: fraction of all N*n samples with a well-formed final answer (answer not None);
      truncation_rate: fraction of all N*n samples truncated; mean_response_tokens: mean num_tokens of all.
    A sample is correct when score >= CORRECT_SCORE. ks default: `default_ks(n)`; each k must be in 1..n.
    `golds` (id -> gold answer) is optional: when given it must cover every problem id. The maj@k rule uses
    the samples' own grades (gold answers are raw strings and normalising them is the grader's job).
    """
    n = _check_outcomes(outcomes, golds)
    ks = _check_ks(ks, n)
    per_problem = list(outcomes.values())
    summary: dict = {"num_problems": len(per_problem), "samples_per_problem": n}
    _add_mean(summary, f"avg@{n}", [float(np.mean([s.score for s in ss])) for ss in per_problem])
    for k in ks:
        _add_mean(summary, f"pass@{k}", [pass_at_k(n, _num_correct(ss), k) for ss in per_problem])
    for k in ks:
        _add_mean(summary, f"maj@{k}", [_maj_score(ss[:k]) for ss in per_problem])
    samples = [s for ss in per_problem for s in ss]
    summary["answer_rate"] = float(np.mean([s.answer is not None for s in samples]))
    summary["truncation_rate"] = float(np.mean([s.truncated for s in samples]))
    summary["mean_response_tokens"] = float(np.mean([s.num_tokens for s in samples]))
    return summary


def _check_outcomes(outcomes: dict[str, list[SampleOutcome]], golds: dict[str, str | None] | None) -> int:
    """n, after checking there are problems, each with the same n >= 1 samples with scores in [0, 1]."""
    if not outcomes:
        raise ValueError("summarize: no problems (outcomes is empty)")
    first_id, first = next(iter(outcomes.items()))
    n = len(first)
    for pid, samples in outcomes.items():
        if len(samples) != n or n < 1:
            raise ValueError(f"summarize: problem {pid!r} has {len(samples)} samples but problem {first_id!r} has "
                             f"{n}; every problem needs the same number n >= 1")
        bad = next((s for s in samples if not 0.0 <= s.score <= 1.0), None)
        if bad is not None:
            raise ValueError(f"summarize: problem {pid!r} has a sample with score {bad.score!r}; scores must be "
                             "in [0, 1]")
    if golds is not None:
        missing = next((pid for pid in outcomes if pid not in golds), None)
        if missing is not None:
            raise ValueError(f"summarize: problem {missing!r} has no entry in golds")
    return n


def _check_ks(ks: list[int] | None, n: int) -> list[int]:
    if ks is None:
        return default_ks(n)
    bad = [k for k in ks if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= n]
    if bad or not ks:
        raise ValueError(f"summarize: ks must be integers in 1..n (n = {n}), got {ks}")
    return list(dict.fromkeys(int(k) for k in ks))


def _num_correct(samples: list[SampleOutcome]) -> int:
    return sum(s.score >= CORRECT_SCORE for s in samples)


def _maj_score(samples: list[SampleOutcome]) -> float:
    """1.0 when the majority answer of `samples` is the answer of one of its correct samples."""
    voted = majority_answer([s.answer for s in samples])
    correct = {s.answer for s in samples if s.score >= CORRECT_SCORE}
    return 1.0 if voted is not None and voted in correct else 0.0


def _add_mean(summary: dict, key: str, values: list[float]) -> None:
    """summary[key] = mean of values, summary[key + "_se"] = its standard error across problems."""
    arr = np.asarray(values, dtype=np.float64)
    summary[key] = float(arr.mean())
    summary[key + "_se"] = float(arr.std(ddof=1) / math.sqrt(len(arr))) if len(arr) > 1 else 0.0
