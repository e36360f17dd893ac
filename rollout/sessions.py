"""Sessions: a multi-turn conversation's state kept in the native engine between its turns.

A request made with `keep_state` does not free its KDA state slot and latent pages when it finishes: they are
parked under its session id, with the tokens they cover (the request's prompt and output, all but the last token,
as always) and the weight versions and adapter they were computed under. The session's next turn is a request whose
prompt extends those tokens (token in, token out: the caller appends the observation's ids to the ids it got); it
takes the parked slot and pages over and prefills only the new tokens (the last sampled token, then the new ones).
A first turn of n samples parks n sessions: the forks share their prompt's full pages copy-on-write, as a group's
samples always do, and each sample's own pages and slot are its session's.

When the pools are short (admitting a request, forking, or a page for a running request), parked sessions give way,
oldest first (least recently parked): their slot and pages are freed and the session is `dropped`. A dropped
session's next turn, a session whose adapter, weights (a push landed) or route recording differs from its next
turn's, or one whose state the memory release took, is recomputed from its tokens: the same result, more prefill.
Counters (`SessionStats`): sessions parked, continued on kept state, recomputed (dropped, stale) and the tokens each
path prefilled.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

log = logging.getLogger("miles_k3.rollout.engine")


@dataclass
class Parked:
    """A finished turn's state, parked: slot and cache rid, the tokens the state covers (all but the last of
    `tokens`), how it was computed, and the routes of those positions (when the turn recorded them)."""

    rid: int
    slot: int
    tokens: list[int]
    versions: set[int]
    lora: str | None
    record: bool
    routes: list[torch.Tensor] = field(default_factory=list)
    num_routed: int = 0


@dataclass
class SessionStats:
    parked: int = 0
    """Turns whose state was parked at their end."""
    continued: int = 0
    """Turns that continued a session on its kept state (prefilling only their new tokens)."""
    dropped: int = 0
    """Parked states freed for memory (the session's next turn recomputes it)."""
    recomputed: int = 0
    """Turns of a known session recomputed from their tokens: dropped, released, or stale (weights / adapter /
    route recording changed since it was parked)."""
    kept_tokens: int = 0
    """Positions of state the continued turns did not prefill again."""

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


class SessionStore:
    """The parked sessions of one engine (in parking order: the oldest gives way first), the ids of sessions whose
    state is gone (dropped or released: their next turn recomputes), and the next session id."""

    def __init__(self, free_state: Callable[[int, int], None]):
        """`free_state(slot, rid)` frees a parked state's slot and pages (the runner's pools)."""
        self._free_state = free_state
        self._parked: OrderedDict[int, Parked] = OrderedDict()
        self._gone: set[int] = set()
        self._running: set[int] = set()  # claimed by a turn in flight
        self._next = 0
        self.stats = SessionStats()

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    def new_id(self) -> int:
        sid = self._next
        self._next += 1
        self._gone.add(sid)  # known, no state yet (its first turn parks it)
        return sid

    def known(self, sid: int) -> bool:
        return sid in self._parked or sid in self._gone or sid in self._running

    def park(self, sid: int, state: Parked) -> None:
        if sid in self._parked:
            raise RuntimeError(f"session {sid} already has parked state; one turn of a session runs at a time")
        self._gone.discard(sid)
        self._running.discard(sid)
        self._parked[sid] = state
        self.stats.parked += 1

    def peek(self, sid: int) -> Parked | None:
        return self._parked.get(sid)

    def claim(self, sid: int) -> Parked | None:
        """Session `sid`'s parked state, taken out of the store (its next turn owns the slot and pages now); None
        when it has none (dropped or released). ValueError for an id never given or closed."""
        if not self.known(sid):
            raise ValueError(f"session {sid} is not open (never created, or closed); open sessions: "
                             f"{sorted(self._parked.keys() | self._gone | self._running)[:20]}")
        if sid in self._running:
            raise ValueError(f"session {sid} has a turn running; a session's turns run one at a time")
        self._gone.discard(sid)
        self._running.add(sid)
        return self._parked.pop(sid, None)

    def give_way(self) -> bool:
        """Free the oldest parked state for memory; False when none is parked."""
        if not self._parked:
            return False
        sid, p = self._parked.popitem(last=False)
        self._free_state(p.slot, p.rid)
        self._gone.add(sid)
        self.stats.dropped += 1
        log.info("session %d: its kept state (%d tokens) gave way for memory; its next turn recomputes it", sid,
                 len(p.tokens) - 1)
        return True

    def close(self, sid: int) -> None:
        """End session `sid`: its parked state freed, the id forgotten. ValueError for an id not open."""
        if not self.known(sid):
            raise ValueError(f"session {sid} is not open (never created, or closed)")
        p = self._parked.pop(sid, None)
        if p is not None:
            self._free_state(p.slot, p.rid)
        self._gone.discard(sid)
        self._running.discard(sid)

    def adopt(self, ids: list[int]) -> None:
        """Open sessions `ids` without state (a queue loaded from a checkpoint: their turns recompute), and give
        new ids past them."""
        for sid in ids:
            if not self.known(sid):
                self._gone.add(sid)
            self._next = max(self._next, sid + 1)

    def forget_states(self) -> None:
        """The pools were released: every parked state is gone (the sessions stay open and recompute)."""
        self._gone |= self._parked.keys()
        self._parked.clear()
