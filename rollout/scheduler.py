"""The native engine's scheduler: which requests run, in which order, on which slots. Bookkeeping only, no torch
(unit-tested with a fake runner, `tests/rollout/test_scheduler.py`); the tensors are the runner's (`runner.py`).

A call's prompts arrive as groups (a prompt's `n` samples, in order) in a waiting queue. Every step: admit waiting
groups in order while their state slots fit (prefill each group's head once, in batched chunks, then fork it into
its samples: the forks share the head's prefill, its routes and its weight version); make room for one more
position per running request, preempting the youngest (last admitted) while pages are short (it goes back to the
front of the queue alone and is recomputed from its tokens later); decode one token for every running request;
hand the finished ones to the caller. A group that gets no pages goes back to the front of the queue, in order.

A run may stop early (`stop`, a partial rollout's end): the running requests are then retracted (slot and pages
freed, tokens kept) back to the front of the queue, each alone, in their running order; the next run re-admits them
first and recomputes their state from their tokens, as after a preemption.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger("miles_k3.rollout.engine")


class StepRunner(Protocol):
    """What the scheduler asks of a runner: state slots, latent pages and the two model steps. A request is the
    runner's `Request` (rid, slot, tokens; `fork_from` copies a head's shared prefill into a fork)."""

    @property
    def num_free_slots(self) -> int: ...

    def alloc_slots(self, k: int) -> list[int] | None: ...

    def fork_slots(self, slot: int, k: int) -> list[int] | None: ...

    def new_request(self, rid: int) -> None: ...

    def reserve(self, rid: int, num_tokens: int) -> bool: ...

    def fork_pages(self, rid: int, children: list[int]) -> bool: ...

    def free_slot(self, slot: int) -> None: ...

    def restore(self, req: Any) -> None:
        """Copy a snapshotted kept state (`req.restore`) into the slot `req` was just given."""
        ...

    def unhold(self, req: Any) -> None:
        """Take the slot of a queued turn on a kept state (`req.slot`) for a request ahead of it: its state snapshotted into
        `req.restore`, or its slot and pages freed (`req.kept` 0: it recomputes)."""
        ...

    def free(self, req: Any) -> None: ...

    def finish(self, req: Any) -> None:
        """A finished request's slot and pages: freed, or parked for its conversation's next turn (a kept state)."""
        ...

    def retract(self, req: Any) -> None:
        """Free a running request's slot and pages like `free`, keeping its tokens and moving whatever it holds in
        the runner's per-run state (its route rows) onto the request: it continues in a later run."""
        ...

    def prefill(self, heads: list[Any]) -> set[int]:
        """Prefill every head's tokens but the last (pages reserved per chunk); the rids that got no pages."""
        ...

    def decode(self, running: list[Any]) -> list[Any]:
        """One token for every running request (positions reserved); the finished ones."""
        ...

    def drain(self) -> None:
        """After the run: this rank's part in other ranks' remaining forwards (lockstep), else nothing."""
        ...


@dataclass
class RunTiming:
    """Wall seconds of the scheduler's calls over the engine's life (a caller takes differences): `prefill_s` in
    admission (prefill and forks), `decode_s` in decode steps, of which `tail_s` in the steps a run took with fewer
    than a quarter of its requests unfinished (the long tail of a batch: a few long samples decoding alone), and
    `decode_rows` the requests those steps decoded (one token each: decode_rows / decode_steps is the mean decode
    batch). A GPU's work is counted where the scheduler waits for it (a decode step reads its tokens back), so the
    split is of wall time, not of kernel time."""

    prefill_s: float = 0.0
    decode_s: float = 0.0
    tail_s: float = 0.0
    decode_steps: int = 0
    tail_steps: int = 0
    decode_rows: int = 0

    def as_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in dataclasses.asdict(self).items()}


class Scheduler:
    """Admission, forks, preemption and the run loop over a `StepRunner`. `lock`: held through each step (other
    threads push weights or release memory between steps); `unpaused`: cleared, the loop waits before its next
    step."""

    def __init__(self, runner: StepRunner, lock: threading.RLock | None = None,
                 unpaused: threading.Event | None = None):
        self.runner = runner
        self.lock = lock or threading.RLock()
        self.unpaused = unpaused or threading.Event()
        if unpaused is None:
            self.unpaused.set()
        self.num_preempted = 0  # requests preempted (and later recomputed) for lack of latent pages
        self.timing = RunTiming()

    def run(self, waiting: deque, done: Callable[[Any], None], stop: Callable[[], bool] | None = None) -> None:
        """Serve every group of `waiting` to the end, calling `done(req)` for each request as it finishes. `stop`:
        checked before the first step and after every decode step (after that step's `done` calls); once it returns
        True, every running request is retracted to the front of `waiting` as a group of its own, in running order
        (oldest first), and the run ends."""
        running: list = []
        stopped = stop is not None and stop()
        total = sum(map(len, waiting))  # requests this run serves (the tail: fewer than a quarter still running)
        clock = self.timing
        while (waiting or running) and not stopped:
            self.unpaused.wait()
            with self.lock:
                t = time.perf_counter()
                self.admit(waiting, running)
                if not running and waiting:  # admitted together, the groups may have starved each other
                    self.admit(waiting, running, max_groups=1)
                if not running:
                    raise RuntimeError("rollout engine: a request cannot be admitted into empty pools "
                                       "(memory too small for one request); raise memory_budget_bytes")
                self.make_room(running, waiting)
                t_decode = time.perf_counter()
                clock.prefill_s += t_decode - t
                finished = self.runner.decode(running)
                dt = time.perf_counter() - t_decode
                clock.decode_s += dt
                clock.decode_steps += 1
                clock.decode_rows += len(running)
                if 4 * (len(running) + sum(map(len, waiting))) < total:
                    clock.tail_s += dt
                    clock.tail_steps += 1
                for req in finished:
                    running.remove(req)
                    self.runner.finish(req)
                    done(req)
                if stop is not None and stop():
                    self.retract(running, waiting)
                    stopped = True
        self.runner.drain()

    def retract(self, running: list, waiting: deque) -> None:
        """Every running request back to the front of `waiting`, alone, in running order (slot and pages freed)."""
        for req in running:
            self.runner.retract(req)
        waiting.extendleft([req] for req in reversed(running))
        running.clear()

    def admit(self, waiting: deque, running: list, max_groups: int | None = None) -> None:
        """Admit waiting groups in order while their slots fit: prefill their heads (batched), then fork each group
        into its requests. A head that holds a slot already (a turn on its kept state) needs no new one.
        The slots held by queued heads behind the admitted groups count as free: they are taken (`unhold`), from
        the back of the queue, when the admitted groups need them (else kept states continued together in one call,
        more than the slots, would wait on each other). A group that gets no pages goes back to the front of the
        queue, in order."""
        taken, want, free = [], 0, self.runner.num_free_slots
        held = sum(map(_holds, waiting))
        while waiting and want + len(waiting[0]) <= free + held and len(taken) != max_groups:
            group = waiting.popleft()
            want += len(group)
            if not group[0].kept:  # a turn on a kept state holds its pages already (and its slot or a snapshot)
                self.runner.new_request(group[0].rid)
            taken.append(group)
        fresh = [g for g in taken if not _holds(g)]
        short = sum(len(g) - _holds(g) for g in taken) - free  # slots to take from queued heads
        for group in reversed(waiting):
            if short <= 0:
                break
            if _holds(group):
                self.runner.unhold(group[0])
                short -= 1
        for group, slot in zip(fresh, (self.runner.alloc_slots(len(fresh)) or ()) if fresh else ()):
            group[0].slot = slot
            if group[0].restore is not None:  # a snapshotted kept state's turn: its state back into the new slot
                self.runner.restore(group[0])
        failed = self.runner.prefill([g[0] for g in taken]) if taken else set()
        back = []
        for group in taken:
            if group[0].rid in failed or not self.fork(group):
                self.runner.free(group[0])
                back.append(group)
            else:
                running.extend(group)
        waiting.extendleft(reversed(back))

    def fork(self, group: list) -> bool:
        """Give the group's other requests slots copied from the head's and its pages, shared; False (nothing
        taken) when slots or pages are short."""
        head = group[0]
        if len(group) == 1:
            return True
        slots = self.runner.fork_slots(head.slot, len(group) - 1)
        if slots is None or not self.runner.fork_pages(head.rid, [r.rid for r in group[1:]]):
            for s in slots or ():
                self.runner.free_slot(s)
            return False
        for req, s in zip(group[1:], slots):
            req.fork_from(head, s)
        return True

    def make_room(self, running: list, waiting: deque) -> None:
        """Reserve one more position per running request, preempting the youngest while pages are short."""
        i = 0
        while i < len(running):
            if self.runner.reserve(running[i].rid, 1):
                i += 1
                continue
            victim = running.pop()
            self.runner.free(victim)
            waiting.appendleft([victim])  # recomputed from its tokens when pages free up
            self.num_preempted += 1
            log.info("preempted request %d (%d tokens) for lack of latent pages", victim.rid, len(victim.tokens))
            i = min(i, len(running))


def _holds(group: list) -> bool:
    """Whether the group's head holds its slot (and pages) already: a turn on its kept state."""
    return group[0].slot is not None
