"""The native engine's scheduler (`miles_k3.rollout.scheduler`) without a model: a fake runner with counted slots
and one-token pages logs every step, and each test states the order a hand run of the rules gives."""
import subprocess
import sys
from collections import deque
from dataclasses import dataclass, field

import pytest

from miles_k3.rollout.scheduler import Scheduler


@dataclass(eq=False)
class Req:
    name: str
    rid: int
    prompt: list[int]
    max_new: int
    output: list[int] = field(default_factory=list)
    slot: int | None = None
    cached: int = 0
    weight_versions: set[int] = field(default_factory=set)
    kept: int = 0  # no multi-turn conversations here: never a kept state or a snapshot to restore
    restore: list | None = None

    @property
    def tokens(self):
        return self.prompt + self.output

    def fork_from(self, head, slot):
        self.slot, self.cached, self.weight_versions = slot, len(head.tokens) - 1, set(head.weight_versions)


class FakeRunner:
    """`num_slots` state slots and `num_pages` pages of one token; a request holds its tokens but the last."""

    def __init__(self, num_slots, num_pages):
        self.free_slots, self.num_pages = list(range(num_slots)), num_pages
        self.pages: dict[int, int] = {}
        self.events: list[tuple] = []
        self.version = 0

    @property
    def num_free_slots(self):
        return len(self.free_slots)

    def alloc_slots(self, k):
        taken, self.free_slots = self.free_slots[:k], self.free_slots[k:]
        return taken if len(taken) == k else None

    def fork_slots(self, slot, k):
        return self.alloc_slots(k)

    def new_request(self, rid):
        self.pages[rid] = 0

    def reserve(self, rid, num_tokens):
        if sum(self.pages.values()) + num_tokens > self.num_pages:
            return False
        self.pages[rid] += num_tokens
        return True

    def fork_pages(self, rid, children):
        for c in children:
            self.pages[c] = 0  # the head's pages are shared
        return True

    def free_slot(self, slot):
        self.free_slots.append(slot)

    def free(self, req):
        self.free_slot(req.slot)
        self.pages.pop(req.rid)
        req.slot = None
        self.events.append(("free", req.name))

    def finish(self, req):  # no kept states here: a finished request is freed
        self.free(req)

    def retract(self, req):
        self.free_slot(req.slot)
        self.pages.pop(req.rid)
        req.slot = None
        self.events.append(("retract", req.name))

    def prefill(self, heads):
        failed = set()
        for h in heads:
            if self.reserve(h.rid, len(h.tokens) - 1):
                h.weight_versions.add(self.version)
                self.events.append(("prefill", h.name))
            else:
                failed.add(h.rid)
        return failed

    def decode(self, running):
        self.events.append(("decode", *[r.name for r in running]))
        for r in running:
            r.output.append(7)
            r.weight_versions.add(self.version)
        return [r for r in running if len(r.output) == r.max_new]

    def drain(self):
        self.events.append(("drain",))


def _run(runner, groups):
    done = []
    sched = Scheduler(runner)
    sched.run(deque(groups), lambda r: done.append(r.name))
    return sched, done


def test_groups_are_admitted_in_order_while_their_slots_fit_and_forks_share_the_prefill():
    """3 slots: A (2 samples) takes 2, B (2 samples) does not fit the one left and waits until A finishes; each
    group is prefilled once (its head) and forked, the fork's cached tokens are the prompt's but the last."""
    runner = FakeRunner(num_slots=3, num_pages=100)
    a = [Req("A0", 0, [1, 2, 3], 2), Req("A1", 1, [1, 2, 3], 2)]
    b = [Req("B0", 2, [4, 5], 2), Req("B1", 3, [4, 5], 2)]
    sched, done = _run(runner, [a, b])
    assert runner.events == [
        ("prefill", "A0"), ("decode", "A0", "A1"), ("decode", "A0", "A1"), ("free", "A0"), ("free", "A1"),
        ("prefill", "B0"), ("decode", "B0", "B1"), ("decode", "B0", "B1"), ("free", "B0"), ("free", "B1"),
        ("drain",)]
    assert done == ["A0", "A1", "B0", "B1"] and sched.num_preempted == 0
    assert (a[1].cached, b[1].cached) == (2, 1)


def test_a_fork_copies_the_version_its_prefill_ran_under():
    """A push (version 0 -> 1) between the prefill and the first decode: head and fork both saw {0, 1}, so the
    sample's oldest version is the prefill's 0 (the on-policy check's min), not the decode's 1."""
    runner = FakeRunner(num_slots=2, num_pages=100)
    real = runner.decode

    def push_then_decode(running):
        runner.version = 1
        return real(running)

    runner.decode = push_then_decode
    group = [Req("A0", 0, [1, 2, 3], 1), Req("A1", 1, [1, 2, 3], 1)]
    _run(runner, [group])
    assert [sorted(r.weight_versions) for r in group] == [[0, 1], [0, 1]]
    assert min(group[1].weight_versions) == 0


def test_the_youngest_request_is_preempted_while_pages_are_short_and_recomputed_later():
    """2 slots, 5 one-token pages; X and Y: 3-token prompts (2 pages each after prefill), 3 new tokens each.
    Step 1: X and Y prefilled (4 pages), X takes the 5th, Y gets none -> Y preempted; X decodes.
    Step 2: Y prefilled again (5 pages), X needs a 6th -> Y preempted; X decodes (4 pages).
    Step 3: Y's prefill finds 1 page of 2 -> it goes back; X takes the 5th and finishes.
    Then Y runs alone: prefill, 3 decodes."""
    runner = FakeRunner(num_slots=2, num_pages=5)
    x, y = Req("X", 0, [1, 2, 3], 3), Req("Y", 1, [4, 5, 6], 3)
    sched, done = _run(runner, [[x], [y]])
    assert runner.events == [
        ("prefill", "X"), ("prefill", "Y"), ("free", "Y"), ("decode", "X"),
        ("prefill", "Y"), ("free", "Y"), ("decode", "X"),
        ("free", "Y"), ("decode", "X"), ("free", "X"),
        ("prefill", "Y"), ("decode", "Y"), ("decode", "Y"), ("decode", "Y"), ("free", "Y"), ("drain",)]
    assert done == ["X", "Y"] and sched.num_preempted == 2 and runner.pages == {}


def test_a_group_larger_than_the_empty_pools_is_an_error_naming_the_fix():
    runner = FakeRunner(num_slots=1, num_pages=100)
    with pytest.raises(RuntimeError, match="cannot be admitted into empty pools.*raise memory_budget_bytes"):
        _run(runner, [[Req("A0", 0, [1, 2], 1), Req("A1", 1, [1, 2], 1)]])


def test_a_stop_retracts_the_running_requests_to_the_front_of_the_queue_and_a_later_run_continues_them():
    """4 slots, 100 pages. A (2 samples, 1 token), B (2 samples, 3 tokens), C (1 sample, 2 tokens); the run stops
    once A has finished. Step 1: A and B admitted (4 slots; C needs a 5th and waits), one decode of all four; A0, A1
    finish and are freed; the stop holds -> B0, B1 retracted (1 token each, slots and pages freed) and queued alone
    in front of C. The second run (no stop) admits B0, B1 and C together (3 slots), prefills B's prompt + output
    but its last token (2 tokens, 2 pages each), then decodes twice: B reaches its 3rd token as C its 2nd, and the
    step's finished requests are freed in running order."""
    runner = FakeRunner(num_slots=4, num_pages=100)
    a = [Req("A0", 0, [1, 2], 1), Req("A1", 1, [1, 2], 1)]
    b = [Req("B0", 2, [4, 5], 3), Req("B1", 3, [4, 5], 3)]
    c = [Req("C0", 4, [6, 7, 8], 2)]
    sched, waiting, done = Scheduler(runner), deque([a, b, c]), []
    sched.run(waiting, lambda r: done.append(r.name), stop=lambda: {"A0", "A1"} <= set(done))
    assert runner.events == [
        ("prefill", "A0"), ("prefill", "B0"), ("decode", "A0", "A1", "B0", "B1"), ("free", "A0"), ("free", "A1"),
        ("retract", "B0"), ("retract", "B1"), ("drain",)]
    assert done == ["A0", "A1"]
    assert [[r.name for r in g] for g in waiting] == [["B0"], ["B1"], ["C0"]]
    assert [(r.output, r.slot) for r in b] == [([7], None), ([7], None)]
    assert runner.num_free_slots == 4 and runner.pages == {}
    runner.events.clear()
    sched.run(waiting, lambda r: done.append(r.name))
    assert runner.events == [
        ("prefill", "B0"), ("prefill", "B1"), ("prefill", "C0"), ("decode", "B0", "B1", "C0"),
        ("decode", "B0", "B1", "C0"), ("free", "B0"), ("free", "B1"), ("free", "C0"), ("drain",)]
    assert done == ["A0", "A1", "B0", "B1", "C0"] and not waiting
    assert [r.output for r in b] == [[7, 7, 7]] * 2 and runner.pages == {} and runner.num_free_slots == 4


def test_a_stop_that_holds_before_the_first_step_runs_nothing():
    runner = FakeRunner(num_slots=2, num_pages=100)
    waiting = deque([[Req("A0", 0, [1, 2], 1)]])
    Scheduler(runner).run(waiting, lambda r: None, stop=lambda: True)
    assert runner.events == [("drain",)] and [[r.name for r in g] for g in waiting] == [["A0"]]


def test_the_scheduler_imports_no_torch():
    code = "import sys, miles_k3.rollout.scheduler, miles_k3.rollout.api; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_tail_is_the_decode_steps_with_fewer_than_a_quarter_of_the_requests_unfinished():
    """8 one-sample groups, max_new 1,1,1,1,1,1,3,10 tokens, slots for all: decode step 1 runs with 8 unfinished
    (6 finish), step 2 with 2, then 1 request decodes alone until step 10. A step is tail when 4 x unfinished < 8,
    i.e. unfinished <= 1: steps 4..10 (after step 3 only the 10-token one is left), 7 of 10 steps. Each decode step
    sleeps 10 ms, so tail_s is about 7/10 of decode_s. The steps decoded 8 + 2 + 2 + 7 x 1 = 19 rows."""
    import time

    runner = FakeRunner(num_slots=8, num_pages=1000)
    real = runner.decode

    def slow_decode(running):
        time.sleep(0.01)
        return real(running)

    runner.decode = slow_decode
    groups = [[Req(f"R{i}", i, [1, 2], n)] for i, n in enumerate([1, 1, 1, 1, 1, 1, 3, 10])]
    sched, done = _run(runner, groups)
    t = sched.timing
    assert len(done) == 8 and (t.decode_steps, t.tail_steps, t.decode_rows) == (10, 7, 19)
    assert 0.6 < t.tail_s / t.decode_s < 0.8
    assert t.prefill_s >= 0.0 and t.decode_s >= 0.1
