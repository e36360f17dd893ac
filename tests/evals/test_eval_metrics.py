"""Eval metrics: pass@k against exact binomials and its properties, majority voting, and `summarize` on a
hand-computed example (values and standard errors)."""
import json
import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_k3.evals.metrics import SampleOutcome, default_ks, majority_answer, pass_at_k, summarize


def exact_pass_at_k(n: int, c: int, k: int) -> float:
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


# ---- pass@k -----------------------------------------------------------------------------------------------------
def test_worked_example_n16_c4():
    assert pass_at_k(16, 4, 1) == pytest.approx(0.25, abs=1e-12)
    assert round(pass_at_k(16, 4, 4), 3) == 0.728
    assert round(pass_at_k(16, 4, 8), 4) == 0.9615
    assert pass_at_k(16, 4, 13) == 1.0  # n - c = 12 < 13: every draw of 13 holds a correct sample


@pytest.mark.parametrize("n", [1, 2, 5, 16, 64, 100, 1024])
def test_matches_exact_binomials(n):
    cs = sorted({0, 1, 2, n // 3, n // 2, n - 1, n} & set(range(n + 1)))
    ks = sorted({1, 2, 4, 8, n // 4, n // 2, n - 1, n} & set(range(1, n + 1)))
    for c in cs:
        for k in ks:
            assert pass_at_k(n, c, k) == pytest.approx(exact_pass_at_k(n, c, k), rel=1e-9, abs=1e-12), (n, c, k)


def test_edges():
    assert pass_at_k(10, 0, 5) == 0.0
    assert pass_at_k(10, 10, 1) == 1.0
    assert pass_at_k(1024, 1, 1) == pytest.approx(1 / 1024, rel=1e-9)
    assert pass_at_k(np.int64(8), np.int64(2), np.int64(2)) == pytest.approx(exact_pass_at_k(8, 2, 2))


@pytest.mark.parametrize("n, c, k, msg", [(4, 1, 5, "k <= n"), (4, 5, 1, "c <= n"), (-1, 0, 0, ">= 0"),
                                          (4, -1, 1, ">= 0"), (4, 1, -2, ">= 0")])
def test_rejects_impossible_counts(n, c, k, msg):
    with pytest.raises(ValueError, match=msg):
        pass_at_k(n, c, k)


def test_rejects_non_integers():
    with pytest.raises(ValueError, match="k must be an integer"):
        pass_at_k(4, 1, 1.5)


counts = st.integers(1, 80).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n)))


@settings(max_examples=200, deadline=None, database=None)
@given(counts)
def test_pass_at_k_properties(nck):
    n, c, k = nck
    p = pass_at_k(n, c, k)
    assert 0.0 <= p <= 1.0
    assert pass_at_k(n, c, 1) == pytest.approx(c / n, abs=1e-12)
    if k < n:
        assert pass_at_k(n, c, k + 1) >= p - 1e-12  # more draws never lower the chance
    if c < n:
        assert pass_at_k(n, c + 1, k) >= p - 1e-12  # more correct samples never lower it
    assert p == pytest.approx(exact_pass_at_k(n, c, k), rel=1e-9, abs=1e-12)


# ---- majority ---------------------------------------------------------------------------------------------------
def test_majority_answer():
    assert majority_answer(["1", "2", "2"]) == "2"
    assert majority_answer([None, None, "5", None]) == "5"
    assert majority_answer([None, None]) is None and majority_answer([]) is None
    assert majority_answer(["a", "b", "b", "a"]) == "b"  # tie 2-2: "b" got to 2 first
    assert majority_answer(["a", "b"]) == "a"  # tie 1-1: "a" got to 1 first
    assert majority_answer(["a", "b", "a", "b", "b"]) == "b"
    assert majority_answer([None, "x", None, "y", "y", "x"]) == "y"


def reference_majority(answers):
    """The answer with the top count; of ties, the one whose top-count occurrence comes first."""
    real = [a for a in answers if a is not None]
    if not real:
        return None
    top = max(real.count(a) for a in real)

    def reached_top_at(a):
        seen = 0
        for i, x in enumerate(answers):
            seen += x == a
            if seen == top:
                return i

    return min((a for a in set(real) if real.count(a) == top), key=reached_top_at)


@settings(max_examples=200, deadline=None, database=None)
@given(st.lists(st.one_of(st.none(), st.sampled_from("abcd")), max_size=12))
def test_majority_matches_reference(answers):
    assert majority_answer(answers) == reference_majority(answers)


# ---- summarize --------------------------------------------------------------------------------------------------
def outcomes(scores, answers, truncated, tokens):
    return [SampleOutcome(float(s), a, t, n) for s, a, t, n in zip(scores, answers, truncated, tokens)]


THREE = {
    "A": outcomes([1, 0, 1, 0], ["33", "12", "33", "12"], [0, 0, 1, 0], [10, 20, 30, 40]),
    "B": outcomes([0, 0, 0, 1], ["5", "5", None, "7"], [0, 1, 1, 0], [100, 100, 100, 100]),
    "C": outcomes([0, 1, 1, 1], ["8", "9", "9", "9"], [0, 0, 0, 0], [1, 2, 3, 4]),
}


def test_summarize_hand_computed():
    s = summarize(THREE)
    third = 1 / math.sqrt(3)
    expected = {
        "num_problems": 3, "samples_per_problem": 4,
        # per problem: A 0.5, B 0.25, C 0.75 -> sample std 0.25
        "avg@4": 0.5, "avg@4_se": 0.25 * third,
        "pass@1": 0.5, "pass@1_se": 0.25 * third,
        # A: 1 - C(2,2)/C(4,2) = 5/6, B: 1 - C(3,2)/C(4,2) = 1/2, C: n - c = 1 < 2 -> 1; mean 7/9, se sqrt(7)/18
        "pass@2": 7 / 9, "pass@2_se": math.sqrt(7) / 18,
        "pass@4": 1.0, "pass@4_se": 0.0,
        # maj@1: A "33" right, B "5" wrong, C "8" wrong; maj@2: A tie -> "33" right, B "5", C tie -> "8" wrong;
        # maj@4: A "33" (reached 2 first) right, B "5" wrong, C "9" right. Per-problem [1,0,0] has se 1/3.
        "maj@1": 1 / 3, "maj@1_se": 1 / 3, "maj@2": 1 / 3, "maj@2_se": 1 / 3, "maj@4": 2 / 3, "maj@4_se": 1 / 3,
        "answer_rate": 11 / 12,  # one sample (B3) has no answer
        "truncation_rate": 3 / 12, "mean_response_tokens": 510 / 12,
    }
    assert set(s) == set(expected)
    for key, value in expected.items():
        assert s[key] == pytest.approx(value, abs=1e-12), key
    assert json.loads(json.dumps(s)) == s
    assert summarize(THREE, golds={"A": "33", "B": "7", "C": "009"}) == s


def test_summarize_custom_ks_and_one_problem():
    s = summarize({"A": THREE["A"]}, ks=[2, 2, 1])
    assert [k for k in s if k.startswith("pass@") and not k.endswith("_se")] == ["pass@2", "pass@1"]
    assert s["pass@2"] == pytest.approx(5 / 6) and s["avg@4"] == 0.5 and "pass@4" not in s
    assert s["avg@4_se"] == 0.0 and s["pass@2_se"] == 0.0 and s["maj@2_se"] == 0.0


def test_maj_counts_a_voted_answer_right_only_if_a_correct_sample_gave_it():
    # "7" wins the vote, but no sample answering "7" is correct (the correct sample had no parseable answer)
    wrong = outcomes([0, 0, 1], ["7", "7", None], [0, 0, 0], [1, 1, 1])
    assert summarize({"p": wrong})["maj@3"] == 0.0
    # "7" wins and one of its samples is correct (another timed out at score 0): right
    right = outcomes([0, 1, 0], ["7", "7", "6"], [0, 0, 0], [1, 1, 1])
    assert summarize({"p": right})["maj@3"] == 1.0
    # the first k samples only: maj@1 looks at "6" alone
    s = summarize({"p": outcomes([0, 1, 1], ["6", "7", "7"], [0] * 3, [1] * 3)}, ks=[1, 3])
    assert s["maj@1"] == 0.0 and s["maj@3"] == 1.0

def test_default_ks():
    assert default_ks(16) == [1, 2, 4, 8, 16]
    assert default_ks(6) == [1, 2, 4, 6]
    assert default_ks(1) == [1]
    assert [k for k in summarize({"p": outcomes([1] * 6, ["1"] * 6, [0] * 6, [1] * 6)})
            if k.startswith("maj@") and not k.endswith("_se")] == ["maj@1", "maj@2", "maj@4", "maj@6"]


def test_summarize_errors():
    one = outcomes([1], ["1"], [0], [1])
    with pytest.raises(ValueError, match="problem 'B' has 4 samples but problem 'A' has 1"):
        summarize({"A": one, "B": THREE["B"]})
    with pytest.raises(ValueError, match="no problems"):
        summarize({})
    with pytest.raises(ValueError, match="problem 'A' has 0 samples"):
        summarize({"A": []})
    with pytest.raises(ValueError, match=r"ks must be integers in 1..n \(n = 4\)"):
        summarize(THREE, ks=[8])
    with pytest.raises(ValueError, match="ks must be"):
        summarize(THREE, ks=[0])
    with pytest.raises(ValueError, match="problem 'C' has no entry in golds"):
        summarize(THREE, golds={"A": "1", "B": "2"})
    with pytest.raises(ValueError, match="problem 'x' has a sample with score 2.0"):
        summarize({"x": outcomes([2], ["1"], [0], [1])})
