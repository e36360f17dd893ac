"""The native engine's queue of partial rollouts (`RolloutEngine.queue`, `rollout.api.PartialQueue`; off-policy mode,
rollout.mode=partial).

`submit` queues groups (a prompt's `n` samples) in a queue kept across calls; `run` serves it until K groups have
finished, then retracts the unfinished requests (their slots and pages freed, their tokens, log-probs, versions and
routes kept on the host) to the front of the queue, and the next `run`, after a push, recomputes them from their
tokens under the new weights. Each output token records the weight version that sampled it
(`output_token_weight_versions`). `queue_state` / `load_queue_state` carry the queue through a checkpoint.

The queue is a part of its engine, not an engine of its own: requests are checked and built by the engine's own
code, as `generate`'s are (`RolloutEngine._checked`, `_make_group`, `_attach_state`, records by `_result`), and
served by its scheduler under its lock; the engine's `generate` never serves or touches the queue. A `run` counts as
a call in flight, as a `generate` does: memory is released only when none is.
"""
from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from miles_k3.rollout.api import Record
from miles_k3.rollout.requests import Request
from miles_k3.rollout.runner import Retracted
from miles_k3.rollout.sampling import FinishReason, SamplingParams

if TYPE_CHECKING:
    from miles_k3.rollout.engine import RolloutEngine


class RolloutQueue:
    """submit / run / cancel / queued_groups / queue_state / load_queue_state (`rollout.api.PartialQueue`) over the
    engine that owns it."""

    def __init__(self, engine: RolloutEngine):
        self._engine = engine
        # the queued groups' entries (a group, or a retracted request alone), the samples already finished of each
        # group not finished yet (by group id: n and {index: request}), the next group id, and whether a run() is
        # serving the queue
        self._queue: deque[list[Request]] = deque()
        self._groups: dict[int, tuple[int, dict[int, Request]]] = {}
        self._next_group = 0
        self._serving = False

    @property
    def retracted(self) -> Retracted:
        """The requests the last `run` retracted at its stop (how many, the tokens of state the next run recomputes,
        the bytes of the slots and pages they held)."""
        return self._engine.runner.retracted

    def submit(self, input_ids: list[list[int]], sampling_params: dict | list[dict] | None = None, n: int = 1,
               lora: str | list[str | None] | None = None, return_routed_experts: bool = False,
               keep_state: bool = False, states: list[int | None] | None = None) -> list[int]:
        """Queue each prompt's `n` samples as a group (behind the groups queued already) for `run`; returns the new
        group ids (increasing from 0 over the engine's life). The arguments are checked as `generate` checks them;
        a bad prompt (empty, a token outside the vocabulary, prompt + max_new_tokens over max_context, bad sampling
        params, an unknown adapter, a bad continuation of a kept state) is a ValueError naming it ("request i", i its place
        in this call), and then nothing is queued. A prompt without `sampling_seed` draws its seed here.
        `keep_state` / `states`: as `generate`'s (a multi-turn episode's turns)."""
        engine = self._engine
        ids, params, loras = engine._checked(input_ids, None, sampling_params, n, lora, return_routed_experts,
                                             states)
        with engine._lock:
            groups = [engine._make_group(i, n, p, sp, name, return_routed_experts)
                      for i, (p, sp, name) in enumerate(zip(ids, params, loras))]
            for i, group in enumerate(groups):
                engine._attach_state(group, None if states is None else states[i], keep_state)
            new = []
            for group in groups:
                gid = self._next_group
                self._next_group += 1
                for j, req in enumerate(group):
                    req.index, req.group = j, gid
                self._groups[gid] = (n, {})
                self._queue.append(group)
                new.append(gid)
            return new

    def run(self, finished_groups: int | None = None, must_finish: Iterable[int] = (),
            return_logprob: bool = True, until: Callable[[], bool] | None = None,
            on_finished: Callable[[int, list[Record]], None] | None = None) -> list[tuple[int, list[Record]]]:
        """Serve the queue (`submit`) until at least `finished_groups` groups have finished all their samples in
        this run and every group id in `must_finish` has (None: until the queue is empty); then the running requests
        are retracted (their slots and pages freed, their tokens kept) and stay queued, first, for the next run,
        which recomputes their state from their tokens under the weights it serves (each output token records the
        version that sampled it: `output_token_weight_versions`). Returns (group id, the group's n records in sample
        order) for each group finished in this run, in the order they finished (with their last sample). A condition
        that holds before the first step runs nothing; a queue that empties first returns what finished.

        `until`: the stop condition instead (checked at the same points). `on_finished(group id, records)`: called
        for each group as it finishes, within the run, instead of returning it; it may `submit` groups, which join
        the queue this run serves (a multi-turn episode's next turn)."""
        must = list(must_finish)
        if finished_groups is not None and finished_groups < 0:
            raise ValueError(f"run: finished_groups must be >= 0 or None, got {finished_groups}")
        self._start_run(must)
        finished: list[tuple[int, list[Record]]] = []
        left = set(must)
        route_log = self._engine.runner.route_log

        def done(req: Request) -> None:
            req.keep_routes(route_log)  # its records may be built after the log is cleared
            n, samples = self._groups[req.group]
            samples[req.index] = req
            if len(samples) == n:
                del self._groups[req.group]
                records = [self._engine._result(samples[j], return_logprob) for j in range(n)]
                left.discard(req.group)
                if on_finished is not None:
                    on_finished(req.group, records)
                else:
                    finished.append((req.group, records))

        stop = until
        if until is None and finished_groups is not None:
            def stop() -> bool:
                return len(finished) >= finished_groups and not left
        try:
            self._engine.scheduler.run(self._queue, done, stop)
        finally:
            self._end_run()
        return finished

    def _start_run(self, must: list[int]) -> None:
        """A run begins: refused while memory is released, while another run serves, or for a must_finish group not
        queued; then it counts as a call in flight and the retract counters restart."""
        engine = self._engine
        if engine._released:
            raise RuntimeError(f"run: memory {sorted(engine._released)} is released; call "
                               "resume_memory_occupation() first")
        with engine._lock:
            if self._serving:
                raise RuntimeError("run: another run() is serving the queue")
            self._check_queued(must, "run: must_finish groups")
            self._serving = True
            engine._active += 1
            engine.runner.retracted.reset()

    def _end_run(self) -> None:
        """A run ends: the requests left queued keep their routes on the host (preempted ones still hold rows of the
        route log), and a turn on a kept state never admitted frees that state (it recomputes when it runs)."""
        engine = self._engine
        with engine._lock:
            for entry in self._queue:
                for req in entry:
                    req.keep_routes(engine.runner.route_log)
                if entry[0].kept:
                    engine.runner.free(entry[0])
            self._serving = False
            engine._call_ends()

    def cancel(self, group_ids: Iterable[int]) -> None:
        """Drop these groups from the queue (all their requests, and their samples finished already); an id not
        queued is a ValueError naming it (and nothing is dropped). Only between runs."""
        ids = list(group_ids)
        with self._engine._lock:
            if self._serving:
                raise RuntimeError("cancel: a run() is serving the queue; cancel between runs")
            self._check_queued(ids, "cancel: groups")
            drop = set(ids)
            self._queue = deque(e for e in self._queue if e[0].group not in drop)
            for g in drop:
                del self._groups[g]

    def _check_queued(self, ids: list[int], what: str) -> None:
        """ValueError `what` {ids not queued} naming the queued ones (none taken)."""
        queued = set(self.queued_groups())
        unknown = [g for g in ids if g not in queued]
        if unknown:
            raise ValueError(f"{what} {unknown} are not queued; queued: {sorted(queued)}")

    def queued_groups(self) -> list[int]:
        """The ids of the queued groups, in queue order (a group once, at its first entry)."""
        with self._engine._lock:
            return list(dict.fromkeys(e[0].group for e in self._queue))

    def queue_state(self) -> dict:
        """The queue as plain data and host tensors (`torch.save` / `torch.load(weights_only=True)`), for
        `load_queue_state` in another engine over the same model: {"next_group": int, "groups": [{"group", "n"}]
        (every group not finished, in id order), "requests": [request dicts] (the queued requests, then the
        finished samples of unfinished groups), "entries": [[indices into requests]] (the queue's entries in
        order)}. A request: {group, index (its sample in the group), prompt, output, logprobs, unfiltered,
        token_versions, weight_versions (sorted), finish (None while queued, else {type, matched}), key, lora,
        record, routes (int16 [num_routed, L, K] or None), num_routed, cached, params (the SamplingParams fields),
        state_id (the kept state its turn continues and parks, or None)}. Only between runs."""
        with self._engine._lock:
            if self._serving:
                raise RuntimeError("queue_state: a run() is serving the queue; save between runs")
            reqs, entries = [], []
            for entry in self._queue:
                entries.append(list(range(len(reqs), len(reqs) + len(entry))))
                reqs.extend(entry)
            for _, (_, samples) in sorted(self._groups.items()):
                reqs.extend(samples[j] for j in sorted(samples))
            for req in reqs:
                req.keep_routes(self._engine.runner.route_log)
            return {"next_group": self._next_group,
                    "groups": [{"group": g, "n": n} for g, (n, _) in sorted(self._groups.items())],
                    "requests": [_request_state(r) for r in reqs], "entries": entries}

    def load_queue_state(self, state: dict) -> None:
        """Rebuild a queue saved by `queue_state` (request ids renumbered). RuntimeError unless this engine's queue
        is empty (no queued group, no unfinished group) and no run is serving; ValueError for an adapter this
        engine does not serve."""
        with self._engine._lock:
            if self._serving or self._queue or self._groups:
                raise RuntimeError(f"load_queue_state: the queue is not empty (groups {sorted(self._groups)}); "
                                   "cancel them or load into a fresh engine")
            reqs = [self._request_from_state(d, i) for i, d in enumerate(state["requests"])]
            groups = {g["group"]: (g["n"], {}) for g in state["groups"]}
            in_queue = {i for e in state["entries"] for i in e}
            for i, req in enumerate(reqs):
                if req.group not in groups:
                    raise ValueError(f"load_queue_state: request {i} belongs to group {req.group}, not listed in "
                                     "the state's groups")
                if i not in in_queue:
                    if req.finish is None:
                        raise ValueError(f"load_queue_state: request {i} is neither queued nor finished")
                    groups[req.group][1][req.index] = req
            self._groups = groups
            self._queue = deque([reqs[i] for i in e] for e in state["entries"])
            self._engine.runner.kept_states.adopt([r.state_id for r in reqs if r.state_id is not None])
            self._next_group = max(self._next_group, state["next_group"])

    def _request_from_state(self, d: dict, i: int) -> Request:
        adapters = self._engine.adapters
        if not adapters.serves(d["lora"]):
            raise ValueError(f"load_queue_state: request {i}: unknown LoRA adapter {d['lora']!r}; loaded: "
                             f"{adapters.names()}")
        finish = None if d["finish"] is None else FinishReason(**d["finish"])
        return Request(next(self._engine._rids), d["index"], list(d["prompt"]),
                       SamplingParams.from_dict(d["params"], f"load_queue_state: request {i}"), d["key"], d["lora"],
                       cached=d["cached"], output=list(d["output"]), logprobs=list(d["logprobs"]),
                       unfiltered=list(d["unfiltered"]), finish=finish, weight_versions=set(d["weight_versions"]),
                       record=d["record"], routes=[] if d["routes"] is None else [d["routes"]],
                       num_routed=d["num_routed"], token_versions=list(d["token_versions"]), group=d["group"],
                       state_id=d.get("state_id", d.get("session")))  # "session": saved before the rename


def _request_state(req: Request) -> dict:
    """A queued request as plain data (its routes, moved to the host before, as one int16 tensor or None)."""
    assert not req.log_rows and req.slot is None, "a queued request holds no slot and no route-log rows"
    return {"group": req.group, "index": req.index, "prompt": list(req.prompt), "output": list(req.output),
            "logprobs": list(req.logprobs), "unfiltered": list(req.unfiltered),
            "token_versions": list(req.token_versions), "weight_versions": sorted(req.weight_versions),
            "finish": None if req.finish is None else req.finish.to_dict(), "key": req.key, "lora": req.lora,
            "record": req.record, "routes": torch.cat(req.routes) if req.routes else None, "state_id": req.state_id,
            "num_routed": req.num_routed, "cached": req.cached, "params": dataclasses.asdict(req.params)}
