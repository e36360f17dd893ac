"""The grading pool: order, timeouts (the worker is killed and replaced, the rest still graded, in about
timeout + startup), crashes and external kills, gold errors, non-main threads, argument checks, cleanup, and the
real graders on pathological responses. The test grader `_test_script` lives in tests/evals/grader_helpers.py,
which the spawned workers import by name."""
from __future__ import annotations

import gc
import os
import signal
import threading
import time

import grader_helpers
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from miles_k3.evals.graders import GoldError, Grade, register_grader
from miles_k3.evals.grading_pool import GradingPool

SCRIPT = grader_helpers.SCRIPT
TIMEOUT = 1.0
SLACK = 4.0  # worker restart (spawn + imports) and scheduling on a loaded 2-core machine


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a reaped pid is gone; a zombie would still answer kill(0)
        return f.read().split()[2] != "Z"


def _wait_dead(pids, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def pool():
    with GradingPool(SCRIPT, timeout_s=TIMEOUT, workers=2) as p:
        yield p


def test_order_is_preserved_across_workers(pool):
    responses = [f"r{i}" for i in range(100)]
    golds = [f"r{i}" if i % 3 else "other" for i in range(100)]
    grades = pool.grade(responses, golds)
    assert [g.reason for g in grades] == responses
    assert [g.score for g in grades] == [0.0 if i % 3 == 0 else 1.0 for i in range(100)]
    assert len(pool.worker_pids()) == 2
    assert pool.grade([], []) == []


def test_non_strings_are_graded_zero_without_a_worker(pool):
    grades = pool.grade(["a", None, b"a", 3, "a"], ["a"] * 5)
    assert [g.reason for g in grades] == ["a"] + ["response is not a string"] * 3 + ["a"]
    assert [g.score for g in grades] == [1.0, 0.0, 0.0, 0.0, 1.0]


def test_a_slow_item_times_out_and_the_rest_are_still_graded(pool):
    pids = set(pool.worker_pids())
    responses = ["a", "sleep:60", "b", "c", "sleep:60", "d"] + [f"e{i}" for i in range(20)]
    t0 = time.monotonic()
    grades = pool.grade(responses, responses)
    elapsed = time.monotonic() - t0
    assert [g.reason for g in grades] == [
        r if not r.startswith("sleep") else f"timeout after {TIMEOUT}s" for r in responses]
    assert [g.score for g in grades] == [0.0 if r.startswith("sleep") else 1.0 for r in responses]
    assert elapsed < TIMEOUT + SLACK  # the two sleeps run side by side on the two workers
    assert _wait_dead(pids - set(pool.worker_pids()))  # the timed-out workers were killed
    assert [g.reason for g in pool.grade(["x", "y"], ["x", "y"])] == ["x", "y"]  # and replaced


def test_a_grader_that_raises_or_misbehaves_fails_only_its_item(pool):
    grades = pool.grade(["a", "raise", "not-a-grade", "exit", "b"], ["a", "a", "a", "a", "b"])
    assert grades[0] == Grade(1.0, "a") and grades[4] == Grade(1.0, "b")
    assert grades[1] == Grade(0.0, "grader error: RuntimeError: boom")
    assert grades[2] == Grade(0.0, "grader error: returned int, not a Grade")
    assert grades[3] == Grade(0.0, "grader error: worker process died (exit code 3)")


def test_a_bad_gold_raises_after_the_batch_and_the_pool_keeps_working(pool):
    with pytest.raises(GoldError, match="gold 'g' is unusable"):
        pool.grade(["a", "gold", "b"], ["a", "g", "b"])
    assert [g.score for g in pool.grade(["a", "b"], ["a", "b"])] == [1.0, 1.0]


def test_a_worker_killed_while_idle_is_replaced(pool):
    pool.grade(["a", "b"], ["a", "b"])
    victim = pool.worker_pids()[0]
    os.kill(victim, signal.SIGKILL)
    assert _wait_dead([victim])
    grades = pool.grade([f"r{i}" for i in range(10)], [f"r{i}" for i in range(10)])
    assert all(g.score == 1.0 for g in grades)
    assert victim not in pool.worker_pids() and len(pool.worker_pids()) == 2


def test_a_worker_killed_while_busy_fails_only_its_item():
    with GradingPool(SCRIPT, timeout_s=30.0, workers=1) as p:
        pid = int(p.grade(["pid"], [""])[0].reason)
        threading.Timer(0.5, os.kill, (pid, signal.SIGKILL)).start()
        t0 = time.monotonic()
        grades = p.grade(["sleep:20", "a", "b"], ["", "a", "b"])
        assert time.monotonic() - t0 < 0.5 + SLACK
    assert grades[0] == Grade(0.0, "grader error: worker process died (exit code -9)")
    assert grades[1:] == [Grade(1.0, "a"), Grade(1.0, "b")]


def test_a_pool_works_from_non_main_threads():
    out: dict[str, list[Grade]] = {}

    def create_and_grade():
        with GradingPool(SCRIPT, timeout_s=TIMEOUT) as p:
            out["own"] = p.grade(["a", "sleep:30", "b"], ["a", "", "b"])

    shared = GradingPool(SCRIPT, timeout_s=TIMEOUT)
    threads = [threading.Thread(target=create_and_grade),
               threading.Thread(target=lambda: out.update(shared=shared.grade(["c"] * 5, ["c"] * 5)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    shared.close()
    assert [g.reason for g in out["own"]] == ["a", f"timeout after {TIMEOUT}s", "b"]
    assert [g.score for g in out["shared"]] == [1.0] * 5


@pytest.mark.parametrize("kwargs, arg", [
    ({"grader": "nope"}, "grader"), ({"timeout_s": 0}, "timeout_s"), ({"timeout_s": -1.0}, "timeout_s"),
    ({"timeout_s": float("inf")}, "timeout_s"), ({"workers": 0}, "workers"), ({"workers": 1.5}, "workers"),
    ({"channel": "kimi"}, "channel"), ({"max_chars": 0}, "max_chars"),
])
def test_bad_arguments_are_rejected_by_name(kwargs, arg):
    kwargs = {"grader": "aime", **kwargs}
    with pytest.raises(ValueError, match=f"^{arg}: "):
        GradingPool(kwargs.pop("grader"), **kwargs)


def test_a_grader_the_workers_cannot_import_is_an_error_not_a_zero_score():
    def orphan(response, gold, **kw):
        return Grade(1.0, "never")

    orphan.__module__ = "no_such_module_for_grading_tests"
    register_grader("_test_orphan")(orphan)
    with GradingPool("_test_orphan") as p, pytest.raises(
            RuntimeError, match="'_test_orphan' failed to start in a worker process: ModuleNotFoundError"):
        p.grade(["a"], ["a"])
    assert p.worker_pids() == []


def test_mismatched_lengths_and_a_closed_pool_are_rejected():
    p = GradingPool("aime")
    with pytest.raises(ValueError, match="^responses/golds: need one gold per response, got 2 responses and 1"):
        p.grade(["a", "b"], ["1"])
    p.close()
    p.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        p.grade(["a"], ["1"])


def test_workers_start_lazily_and_stop_on_close_and_on_drop():
    p = GradingPool(SCRIPT, workers=3)
    assert p.worker_pids() == []
    p.grade(["a"], ["a"])
    assert len(p.worker_pids()) == 1  # no more workers than items
    with p:
        pids = p.worker_pids()
    assert p.worker_pids() == [] and _wait_dead(pids)
    dropped = GradingPool(SCRIPT)
    dropped.grade(["a"], ["a"])
    pids = dropped.worker_pids()
    del dropped
    gc.collect()
    assert _wait_dead(pids)


# ---- the real graders ------------------------------------------------------------------------------------------
def test_aime_through_the_pool_on_huge_responses():
    responses = ["x" * 5_000_000 + "\\boxed{33}", "\\boxed{" * 100_000 + "33" + "}" * 100_000, "\\boxed{033}",
                 "<|open|>think<|sep|>\\boxed{33}<|close|>"]
    with GradingPool("aime", timeout_s=5.0, workers=2, channel="k3") as p:
        grades = p.grade(responses, ["33"] * 4)
    assert [g.reason for g in grades] == [
        "no final-answer channel (k3)", "no final-answer channel (k3)", "no final-answer channel (k3)",
        "no final-answer channel (k3)"]
    with GradingPool("aime", timeout_s=5.0, max_chars=10**6) as p:
        grades = p.grade(responses, ["33"] * 4)
    assert [g.score for g in grades] == [1.0, 1.0, 1.0, 1.0]


@pytest.fixture(scope="module")
def math_pool():
    with GradingPool("math", timeout_s=2.0, workers=2) as p:
        p.grade(["\\boxed{1}", "\\boxed{2}"], ["1", "2"])  # start (and warm up) both workers
        yield p


def test_math_through_the_pool_times_out_pathological_answers(math_pool):
    """math-verify takes minutes on some short inputs (a few thousand "(" in math mode): the pool bounds it."""
    responses = ["\\boxed{\\frac{1}{2}}", "$" + "(" * 5000 + "$", "Answer: x^2+1", "\\boxed{0.25}"]
    t0 = time.monotonic()
    grades = math_pool.grade(responses, ["0.5", "0.5", "1+x^2", "0.5"])
    assert time.monotonic() - t0 < 2.0 + SLACK
    assert [g.score for g in grades] == [1.0, 0.0, 1.0, 0.0]
    assert grades[1].reason == "timeout after 2.0s"


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.lists(st.sampled_from(
    ["\\boxed{", "{", "}", "$", " ", "1", "2", "\\frac", "^", "x", "(", "\\sqrt", "=", ",", "Answer:", "\\text{"]),
    max_size=40).map("".join), min_size=1, max_size=8))
def test_math_through_the_pool_takes_any_response(math_pool, responses):
    t0 = time.monotonic()
    grades = math_pool.grade(responses, ["1/2"] * len(responses))
    assert time.monotonic() - t0 < len(responses) * (2.0 + SLACK)
    assert all(isinstance(g, Grade) and g.score in (0.0, 1.0) for g in grades)
