"""Kept state: a multi-turn conversation's state kept in the native engine between its turns
(`generate(keep_state=True, states=[...])`, `rollout.api.KeptStateEngine`). "Session" is the OpenAI-compatible
server's word (`rollout/server/sessions.py`: a conversation an agent talks in); the engine keeps *states*.

A request made with `keep_state` does not free its KDA state slot and latent pages when it finishes: they are
parked under its state id (`meta_info["state_id"]`), with the tokens they cover (the request's prompt and output,
all but the last token, as always) and the weight versions and adapter they were computed under. The
conversation's next turn is a request whose prompt extends those tokens (token in, token out: the caller appends
the observation's ids to the ids it got) and names the state id; it takes the parked slot and pages over and
prefills only the new tokens (the last sampled token, then the new ones). A first turn of n samples parks n states:
the forks share their prompt's full pages copy-on-write, as a group's samples always do, and each sample's own
pages and slot are its state's.

When the pools are short (admitting a request, forking, or a page for a running request), parked states give way,
oldest first (least recently parked): their slot and pages are freed and the state is `dropped`. The next turn of
a dropped state, of a state whose adapter, weights (a push landed) or route recording differs from that turn's, or
of one the memory release took, is recomputed from its tokens: the same result, more prefill.

Snapshots (`EngineConfig.state_snapshot_bytes` > 0). When it is slots that are short, the oldest parked state
holding one gives up only its slot: its KDA state is copied to host memory (a snapshot) and its latent pages stay
parked, by reference. Its next turn gets a free slot when admitted, the snapshot is copied back into it, and the turn
prefills only its new tokens, as on a kept slot. Snapshots take host memory up to the budget; a state that would
pass it is dropped instead. Short pages still drop states (snapshotted ones too), oldest first.

Counters (`KeptStateStats`): states parked, snapshotted, continued on (restored ones included), recomputed
(dropped, stale) and the tokens each path prefilled.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from miles_k3.model.state import KDALayerState

log = logging.getLogger("miles_k3.rollout.engine")


@dataclass
class Parked:
    """A finished turn's state, parked: slot and cache rid, the tokens the state covers (all but the last of
    `tokens`), how it was computed, and the routes of those positions (when the turn recorded them). A snapshotted
    state has no slot (`slot` None): its KDA state is `snapshot`, on the host."""

    rid: int
    slot: int | None
    tokens: list[int]
    versions: set[int]
    lora: str | None
    record: bool
    routes: list[torch.Tensor] = field(default_factory=list)
    num_routed: int = 0
    snapshot: list[KDALayerState] | None = None


@dataclass
class KeptStateStats:
    parked: int = 0
    """Turns whose state was parked at their end."""
    continued: int = 0
    """Turns that continued on a kept state (prefilling only their new tokens)."""
    dropped: int = 0
    """Parked states freed for memory (the conversation's next turn recomputes it)."""
    snapshotted: int = 0
    """Parked states whose slot gave way while their KDA state was copied to the host (their pages kept)."""
    restored: int = 0
    """Turns that continued from a snapshot (the KDA state copied back into a slot; counted in `continued`)."""
    snapshot_bytes: int = 0
    """Host bytes the snapshots hold now (parked, or queued for their next turn)."""
    recomputed: int = 0
    """Turns of a known state recomputed from their tokens: dropped, released, or stale (weights / adapter / route
    recording changed since it was parked)."""
    kept_tokens: int = 0
    """Positions of state the continued turns did not prefill again."""

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


class KeptStates:
    """The parked states of one engine (in parking order: the oldest gives way first), the ids of the states that
    are gone (dropped or released: their next turn recomputes), and the next state id."""

    def __init__(self, free_slot: Callable[[int], None], free_pages: Callable[[int], None],
                 copy_out: Callable[[int], list[KDALayerState]] | None = None, slot_bytes: int = 0,
                 snapshot_budget: int = 0):
        """`free_slot(slot)` / `free_pages(rid)` free a parked state's slot / latent pages (the runner's pools);
        `copy_out(slot)`: the slot's KDA state as host copies, `slot_bytes` host bytes, for a snapshot; at most
        `snapshot_budget` bytes of snapshots are held (0: never snapshot)."""
        self._free_slot, self._free_pages, self._copy_out = free_slot, free_pages, copy_out
        self.slot_bytes, self.snapshot_budget = slot_bytes, snapshot_budget
        self._parked: OrderedDict[int, Parked] = OrderedDict()
        self._gone: set[int] = set()
        self._running: set[int] = set()  # claimed by a turn in flight
        self._next = 0
        self.stats = KeptStateStats()

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    @property
    def num_parked_slots(self) -> int:
        """Slots the parked states hold (snapshotted ones hold none)."""
        return sum(p.slot is not None for p in self._parked.values())

    def new_id(self) -> int:
        sid = self._next
        self._next += 1
        self._gone.add(sid)  # known, no state yet (its first turn parks it)
        return sid

    def known(self, sid: int) -> bool:
        return sid in self._parked or sid in self._gone or sid in self._running

    def park(self, sid: int, state: Parked) -> None:
        if sid in self._parked:
            raise RuntimeError(f"kept state {sid} is parked already; one turn of a conversation runs at a time")
        self._gone.discard(sid)
        self._running.discard(sid)
        self._parked[sid] = state
        self.stats.parked += 1

    def peek(self, sid: int) -> Parked | None:
        return self._parked.get(sid)

    def claim(self, sid: int) -> Parked | None:
        """Kept state `sid`, taken out of the store (its next turn owns the slot or snapshot and the pages now); None
        when it is gone (dropped or released). ValueError for an id never given or released."""
        if not self.known(sid):
            raise ValueError(f"kept state {sid} is not open (never created, or released); open ones: "
                             f"{sorted(self._parked.keys() | self._gone | self._running)[:20]}")
        if sid in self._running:
            raise ValueError(f"kept state {sid} has a turn running; a conversation's turns run one at a time")
        self._gone.discard(sid)
        self._running.add(sid)
        return self._parked.pop(sid, None)  # a snapshot goes with its turn (`Request.restore`), its bytes counted

    def give_slot(self) -> bool:
        """Free one slot held by a parked state, the oldest: snapshotted when the budget has room for it (its pages
        stay parked), else dropped. False when no parked state holds a slot."""
        sid = next((s for s, p in self._parked.items() if p.slot is not None), None)
        if sid is None:
            return False
        p = self._parked[sid]
        if self._copy_out is None or not self.take_snapshot_bytes():
            return self._drop(sid)
        p.snapshot = self._copy_out(p.slot)
        self._free_slot(p.slot)
        p.slot = None
        self.snapshotted(sid, len(p.tokens) - 1)
        return True

    def take_snapshot_bytes(self) -> bool:
        """Count one more snapshot's bytes against the budget; False (nothing counted) when it has no room."""
        if self.stats.snapshot_bytes + self.slot_bytes > self.snapshot_budget:
            return False
        self.stats.snapshot_bytes += self.slot_bytes
        return True

    def snapshot_gone(self) -> None:
        """A snapshot was restored into a slot or freed: its bytes back to the budget."""
        self.stats.snapshot_bytes -= self.slot_bytes

    def snapshotted(self, sid: int, tokens: int) -> None:
        self.stats.snapshotted += 1
        log.info("kept state %d: its KDA state slot gave way for memory; the state (%d tokens) is copied to the host "
                 "(%d of %d snapshot bytes) and its pages kept", sid, tokens, self.stats.snapshot_bytes,
                 self.snapshot_budget)

    def give_way(self) -> bool:
        """Free the oldest parked state (slot or snapshot, and pages) for memory; False when none is parked."""
        if not self._parked:
            return False
        return self._drop(next(iter(self._parked)))

    def _drop(self, sid: int) -> bool:
        p = self._parked.pop(sid)
        self.free(p)
        self._gone.add(sid)
        self.stats.dropped += 1
        log.info("kept state %d (%d tokens) gave way for memory; its next turn recomputes it", sid,
                 len(p.tokens) - 1)
        return True

    def free(self, p: Parked) -> None:
        """Free a state's slot (if it holds one), pages and snapshot: one given way, released, or claimed and not
        used (its turn recomputes: stale weights, adapter, route recording)."""
        if p.slot is not None:
            self._free_slot(p.slot)
        self._free_pages(p.rid)
        if p.snapshot is not None:
            self.snapshot_gone()
        p.slot, p.snapshot = None, None

    def release(self, sid: int) -> None:
        """Release kept state `sid`: its parked slot, pages or snapshot freed, the id forgotten. ValueError for an id
        not open."""
        if not self.known(sid):
            raise ValueError(f"kept state {sid} is not open (never created, or released)")
        p = self._parked.pop(sid, None)
        if p is not None:
            self.free(p)
        self._gone.discard(sid)
        self._running.discard(sid)

    def adopt(self, ids: list[int]) -> None:
        """Open state ids `ids` with nothing parked (a queue loaded from a checkpoint: their turns recompute), and
        give new ids past them."""
        for sid in ids:
            if not self.known(sid):
                self._gone.add(sid)
            self._next = max(self._next, sid + 1)

    def forget_states(self) -> None:
        """The pools were released: every parked state is gone, snapshots too (their pages were released); the ids
        stay open and their next turns recompute."""
        self._gone |= self._parked.keys()
        self.stats.snapshot_bytes -= self.slot_bytes * sum(p.snapshot is not None for p in self._parked.values())
        self._parked.clear()
