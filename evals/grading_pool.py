"""A pool of grading worker processes: a registered grader applied off the caller's thread with a time limit per
response, so that no response string can hang or crash the trainer or the eval.

`GradingPool(grader, timeout_s=5.0, workers=1, channel="auto", max_chars=...)` grades lists of responses against
gold answers (`grade(responses, golds) -> list[Grade]`, in order). Workers are "spawn" processes (safe next to
torch's threads; a worker imports `miles_k3.evals.graders` and the module that registered the grader, no
torch), started on the first `grade` call and reused. Items go out in small batches to idle workers and each
item has a wall-clock limit: a worker past it is killed and replaced and the item gets
`Grade(0.0, "timeout after {timeout_s}s")`; a worker that dies, or a grader that raises, gives
`Grade(0.0, "grader error: ...")` for that item only. `grade` therefore returns for any response string; it
raises only for misuse (ValueError naming the argument), for a gold answer the grader cannot use
(`graders.GoldError`, after the whole list is graded) and for workers that cannot start at all (RuntimeError).
No signals are used, so a pool works from any thread; calls on one pool are serialised.
"""
from __future__ import annotations

import contextlib
import importlib
import math
import multiprocessing as mp
import signal
import threading
import time
from collections import deque
from multiprocessing.connection import wait
from typing import TYPE_CHECKING

from miles_k3.evals import graders
from miles_k3.evals.answers import RESPONSE_CHANNELS
from miles_k3.evals.graders import MAX_RESPONSE_CHARS, GoldError, Grade

if TYPE_CHECKING:
    from typing_extensions import Self

MAX_BATCH = 16
"""Items sent to a worker at once (fewer when there are few items per worker)."""
STARTUP_TIMEOUT_S = 120.0
"""A worker that has not imported its grader and warmed up by then is a broken setup (RuntimeError)."""
MAX_STARTUP_DEATHS = 3
"""Workers of one `grade` call that may die before they are ready (e.g. killed) before it gives up."""
_CLOSE_WAIT_S = 1.0


# ---- the worker process ----------------------------------------------------------------------------------------
def _worker_main(conn, grader: str, module: str, channel: str, max_chars: int) -> None:
    """Import the grader, warm it up, say "ready", then grade batches [(index, response, gold)] until None or
    EOF, sending one ("done" | "gold", index, payload) message per item as it finishes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it then kills us
    try:
        if module not in ("__main__", "__mp_main__"):  # spawn re-imports the parent's main module itself
            importlib.import_module(module)
        grade = graders.get_grader(grader)
        graders.warm_up(grader)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("fatal", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready",))
    while (batch := _recv_or_none(conn)) is not None:
        for index, response, gold in batch:
            conn.send(_grade_item(grade, index, response, gold, channel, max_chars))


def _recv_or_none(conn):
    try:
        return conn.recv()
    except (EOFError, OSError):  # the parent is gone
        return None


def _grade_item(grade, index: int, response: str, gold, channel: str, max_chars: int) -> tuple:
    try:
        result = grade(response, gold, channel=channel, max_chars=max_chars)
    except GoldError as e:
        return ("gold", index, str(e))
    except Exception as e:  # noqa: BLE001 - any grader failure is that item's 0, never the pool's
        return ("done", index, Grade(0.0, f"grader error: {type(e).__name__}: {str(e)[:200]}"))
    if not isinstance(result, Grade):
        return ("done", index, Grade(0.0, f"grader error: returned {type(result).__name__}, not a Grade"))
    return ("done", index, result)


# ---- the parent's side -----------------------------------------------------------------------------------------
class _Worker:
    """One worker process, its pipe, whether it is ready, the items it holds (in order: the first is being
    graded) and the deadline of the current item (or of its startup)."""

    def __init__(self, ctx, args: tuple):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, *args), name="miles_k3-grading", daemon=True)
        self.proc.start()
        child.close()
        self.ready = False
        self.items: deque[int] = deque()
        self.deadline = time.monotonic() + STARTUP_TIMEOUT_S

    def waiting(self) -> bool:
        return bool(self.items) or not self.ready

    def stop(self, graceful: bool) -> None:
        """Ask it to exit (graceful, when idle), else kill it; always reaps the process and closes the pipe."""
        if graceful and self.ready and not self.items:
            with contextlib.suppress(OSError):  # it died meanwhile: the kill below reaps it
                self.conn.send(None)
            self.proc.join(_CLOSE_WAIT_S)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(_CLOSE_WAIT_S)
        self.conn.close()


class _Run:
    """One `grade` call: its inputs, the results so far, the items still to send, the first gold error."""

    def __init__(self, responses: list, golds: list):
        self.responses, self.golds = responses, golds
        self.results: list[Grade | None] = [None] * len(responses)
        self.todo: deque[int] = deque()
        for i, r in enumerate(responses):
            if isinstance(r, str):
                self.todo.append(i)
            else:
                self.results[i] = Grade(0.0, "response is not a string")
        self.gold_error: str | None = None
        self.startup_deaths = 0

    def take(self, workers: int) -> list[int]:
        size = max(1, min(MAX_BATCH, math.ceil(len(self.todo) / (2 * workers))))
        return [self.todo.popleft() for _ in range(min(size, len(self.todo)))]

    def requeue(self, items) -> None:
        self.todo.extendleft(reversed(list(items)))


class GradingPool:
    """Grade responses with registered grader `grader` in worker processes, `timeout_s` wall-clock seconds per
    item at most. Use as a context manager, or call `close()`; a dropped pool closes itself."""

    def __init__(self, grader: str, *, timeout_s: float = 5.0, workers: int = 1, channel: str = "auto",
                 max_chars: int = MAX_RESPONSE_CHARS):
        _check_args(grader, timeout_s, workers, channel, max_chars)
        self.grader, self.timeout_s, self.workers = grader, float(timeout_s), workers
        self.channel, self.max_chars = channel, max_chars
        self._args = (grader, graders.grader_module(grader), channel, max_chars)
        self._ctx = mp.get_context("spawn")
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._closed = False

    # ---- public ----
    def grade(self, responses: list[str], golds: list[str]) -> list[Grade]:
        """One Grade per response, in order; a non-string response gets Grade(0, "response is not a string").

        Raises ValueError when the lengths differ, GoldError (once every item is graded) when the grader
        rejected a gold answer, RuntimeError when the pool is closed or its workers cannot start at all.
        """
        if len(responses) != len(golds):
            raise ValueError(f"responses/golds: need one gold per response, got {len(responses)} responses and "
                             f"{len(golds)} golds")
        with self._lock:
            if self._closed:
                raise RuntimeError("GradingPool.grade: the pool is closed; create a new GradingPool")
            run = _Run(list(responses), list(golds))
            try:
                self._grade_all(run)
            except BaseException:
                self._stop_all(graceful=False)  # workers may hold items of the abandoned run
                raise
        if run.gold_error is not None:
            raise GoldError(run.gold_error)
        return run.results

    def worker_pids(self) -> list[int]:
        """The process ids of the live workers (none before the first `grade` call)."""
        return [w.proc.pid for w in self._workers]

    def close(self) -> None:
        """Stop the workers (idempotent); `grade` after `close` raises RuntimeError."""
        with self._lock:
            self._closed = True
            self._stop_all(graceful=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        with contextlib.suppress(Exception):  # interpreter shutdown may have torn the modules down
            if getattr(self, "_workers", None):
                self._stop_all(graceful=False)

    # ---- the event loop ----
    def _grade_all(self, run: _Run) -> None:
        while run.todo or any(w.items for w in self._workers):
            self._start_workers(run)
            self._dispatch(run)
            self._wait()
            for w in list(self._workers):
                self._collect(w, run)
            self._expire(run)

    def _start_workers(self, run: _Run) -> None:
        busy = sum(bool(w.items) for w in self._workers)
        while len(self._workers) < min(self.workers, busy + len(run.todo)):
            self._workers.append(_Worker(self._ctx, self._args))

    def _dispatch(self, run: _Run) -> None:
        for w in list(self._workers):
            if not (run.todo and w.ready and not w.items):
                continue
            if not w.proc.is_alive():  # died while idle (killed): replace it, nothing to blame
                self._remove(w)
                continue
            items = run.take(len(self._workers))
            try:
                w.conn.send([(i, run.responses[i], run.golds[i]) for i in items])
            except OSError:  # it died just now: same as above
                run.requeue(items)
                self._remove(w)
                continue
            w.items.extend(items)
            w.deadline = time.monotonic() + self.timeout_s

    def _wait(self) -> None:
        waiting = [w for w in self._workers if w.waiting()]
        if waiting:
            timeout = max(0.0, min(w.deadline for w in waiting) - time.monotonic())
            wait([o for w in waiting for o in (w.conn, w.proc.sentinel)], timeout)

    def _collect(self, w: _Worker, run: _Run) -> None:
        """Take the worker's finished items; a worker that exited gets its current item blamed and replaced."""
        alive = self._drain(w, run)
        if alive and not w.proc.is_alive():
            self._drain(w, run)  # results it wrote before it exited
            alive = False
        if not alive:
            self._died(w, run)

    def _drain(self, w: _Worker, run: _Run) -> bool:
        try:
            while w.conn.poll():
                self._handle(w, w.conn.recv(), run)
        except (EOFError, OSError):
            return False
        return True

    def _handle(self, w: _Worker, msg: tuple, run: _Run) -> None:
        kind = msg[0]
        if kind == "fatal":
            raise RuntimeError(f"grader '{self.grader}' failed to start in a worker process: {msg[1]} (is its "
                               f"module {self._args[1]!r} importable by a fresh Python process?)")
        if kind == "ready":
            w.ready = True
            w.deadline = math.inf
            return
        index = w.items.popleft()
        assert index == msg[1], f"grading worker answered item {msg[1]}, expected {index}"
        if kind == "gold":
            run.gold_error = run.gold_error or msg[2]
            run.results[index] = Grade(0.0, f"gold error: {msg[2]}")
        else:
            run.results[index] = msg[2]
        w.deadline = time.monotonic() + self.timeout_s if w.items else math.inf

    def _died(self, w: _Worker, run: _Run) -> None:
        self._remove(w)
        code = w.proc.exitcode
        if not w.ready:
            run.startup_deaths += 1
            if run.startup_deaths > MAX_STARTUP_DEATHS:
                raise RuntimeError(f"grading workers keep dying during startup (last exit code {code}); see "
                                   "their traceback above. A script that grades at import time needs an "
                                   "`if __name__ == '__main__':` guard: spawn re-imports the main module")
        if w.items:
            run.results[w.items.popleft()] = Grade(0.0, f"grader error: worker process died (exit code {code})")
            run.requeue(w.items)

    def _expire(self, run: _Run) -> None:
        now = time.monotonic()
        for w in [w for w in self._workers if w.deadline <= now]:
            if not w.ready:
                raise RuntimeError(f"a grading worker did not start within {STARTUP_TIMEOUT_S}s (importing "
                                   f"{self._args[1]!r} and warming up grader '{self.grader}')")
            run.results[w.items.popleft()] = Grade(0.0, f"timeout after {self.timeout_s}s")
            run.requeue(w.items)
            self._remove(w)

    def _remove(self, w: _Worker) -> None:
        self._workers.remove(w)
        w.stop(graceful=False)

    def _stop_all(self, graceful: bool) -> None:
        workers, self._workers = self._workers, []
        for w in workers:
            w.stop(graceful)


def _check_args(grader: str, timeout_s: float, workers: int, channel: str, max_chars: int) -> None:
    if grader not in graders.grader_names():
        raise ValueError(f"grader: '{grader}' is not a registered grader; registered: "
                         f"{', '.join(graders.grader_names())}")
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0 and math.isfinite(timeout_s)):
        raise ValueError(f"timeout_s: must be a finite number of seconds > 0, got {timeout_s!r}")
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ValueError(f"workers: must be an int >= 1, got {workers!r}")
    if channel not in RESPONSE_CHANNELS:
        raise ValueError(f"channel: '{channel}' is not one of {', '.join(RESPONSE_CHANNELS)}")
    if not isinstance(max_chars, int) or isinstance(max_chars, bool) or max_chars < 1:
        raise ValueError(f"max_chars: must be an int >= 1, got {max_chars!r}")
