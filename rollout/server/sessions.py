"""A server's sessions, token in / token out: `Session` keeps the exact token sequence the engine saw (the first
prompt's ids, each turn's output ids as sampled, never re-tokenised from the text the client got, and the ids of
each later message), with a loss mask (1: sampled, 0: prompt and observations), the engine's log-prob of each
sampled token (0.0 elsewhere: of the distribution sampled from, and under top-p / top-k also of the unfiltered one,
which the trainer's log-probs are comparable with) and the weight version that sampled it (null elsewhere).
`Sessions` bounds them: least recently used idle ones are evicted, never a live one. Bookkeeping only: the state the
engine keeps for a session between its turns (KDA slot, latent pages: a kept state, `miles_k3.rollout.kept_state`)
is released through `Sessions.on_drop`. "Session" means this, a conversation on the server, and nothing in the
engine."""
from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from miles_k3.rollout.server.protocol import ApiError

log = logging.getLogger(__name__)


@dataclass
class Session:
    """One conversation's exact token sequence (see the module docstring) and its turns."""

    id: str
    kind: str  # "chat" or "completion": how later requests extend it
    prompt_ids: list[int]
    messages: list[dict] = field(default_factory=list)  # chat: every message so far, the replies included
    ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # of the distribution each token was sampled from
    unfiltered_logprobs: list[float] = field(default_factory=list)  # the same tokens under the unfiltered one
    weight_versions: list[int | None] = field(default_factory=list)
    turns: list[dict] = field(default_factory=list)
    end: str | None = None  # "truncated": a request ran past the engine's context; the session takes no more
    state_id: int | None = None  # the engine's kept state of the conversation between turns (native engine)
    busy: bool = False  # a turn is being generated (or its prompt tokenised)
    episode: str | None = None  # the agent episode it belongs to: never evicted, not counted in max_sessions
    drop_when_idle: bool = False  # its episode closed during a turn: deleted when the turn ends
    last_used: float = 0.0  # Sessions.clock() of its last request
    created: int = field(default_factory=lambda: int(time.time()))

    def append_context(self, ids: list[int]) -> None:
        self.ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.unfiltered_logprobs += [0.0] * len(ids)
        self.weight_versions += [None] * len(ids)

    def append_turn(self, context_start: int, out: dict) -> None:
        """Add a turn's engine record: its output ids, their log-probs (`output_token_logprobs`; a turn that
        filtered by top-p / top-k also reports `output_token_logprobs_unfiltered`, else the two are the same) and
        weight versions."""
        meta, ids = out["meta_info"], list(out["output_ids"])
        lps = [float(lp) for lp, _ in meta.get("output_token_logprobs", [])]
        lps = lps if len(lps) == len(ids) else [0.0] * len(ids)
        unf = [float(lp) for lp in meta.get("output_token_logprobs_unfiltered", [])]
        filtered = len(unf) == len(ids) and bool(ids)
        versions = list(meta.get("output_token_weight_versions", []))
        start = len(self.ids)
        self.ids += ids
        self.loss_mask += [1] * len(ids)
        self.logprobs += lps
        self.unfiltered_logprobs += unf if filtered else lps
        self.weight_versions += versions if len(versions) == len(ids) else [meta.get("weight_version")] * len(ids)
        self.turns.append({"context_start": context_start, "output_start": start, "output_end": len(self.ids),
                           "finish_reason": meta["finish_reason"].get("type"), "filtered": filtered,
                           "weight_versions": list(meta.get("weight_versions", []))})

    def record(self) -> dict:
        return {"id": self.id, "object": "session", "kind": self.kind, "created": self.created,
                "prompt_ids": list(self.prompt_ids), "ids": list(self.ids), "loss_mask": list(self.loss_mask),
                "logprobs": list(self.logprobs), "unfiltered_logprobs": list(self.unfiltered_logprobs),
                "weight_versions": list(self.weight_versions), "turns": [dict(t) for t in self.turns],
                "messages": [dict(m) for m in self.messages], "end": self.end, "truncated": self.end == "truncated"}


class Sessions:
    """The sessions kept, least recently used first. At most `limit` of them (those of agent episodes aside: one
    per open episode, ended with it): a request that starts new ones beyond it evicts idle ones, sessions with no
    turn running that went unused for `idle_s` seconds, least recently used first; when too few are idle it is
    refused with 429 and nothing is evicted. So one client's requests never take another's live session."""

    def __init__(self, limit: int, idle_s: float, on_drop=lambda session: None, clock=time.monotonic):
        """`on_drop(session)`: called for a session evicted or deleted (its kept state is released there);
        `clock()`: seconds, for idleness (tests pass their own)."""
        self.limit, self.idle_s, self.on_drop, self.clock = limit, idle_s, on_drop, clock
        self._items: OrderedDict[str, Session] = OrderedDict()
        self.counted = 0  # sessions that count against `limit` (not an episode's)
        self.reserved = 0  # sessions that requests now at the engine will start

    def __len__(self) -> int:
        return len(self._items)

    @contextlib.contextmanager
    def reserve(self, k: int):
        """Room for the `k` sessions a request will start (`new` inside the block), made by evicting idle ones;
        ApiError(429) when too few are idle."""
        over = self.counted + self.reserved + k - self.limit
        if over > 0:
            now = self.clock()
            idle = [s for s in self._items.values()
                    if s.episode is None and not s.busy and now - s.last_used >= self.idle_s][:over]
            if len(idle) < over:
                raise ApiError(429, f"max_sessions={self.limit}: this request needs {k} new session(s), and only "
                                    f"{len(idle)} of the {self.counted} kept can be evicted; a session is evicted "
                                    f"only when idle (no turn running, unused for session_idle_s={self.idle_s:g} s), "
                                    "least recently used first, so no live session is. Retry later, end finished "
                                    "sessions (DELETE /v1/sessions/{id}), or ask for fewer (n)", "too_many_sessions")
            for s in idle:
                self._drop(s)
                log.info("session %s evicted (idle; max_sessions=%d)", s.id, self.limit)
        self.reserved += k
        try:
            yield
        finally:
            self.reserved -= k

    def new(self, kind: str, prompt_ids: list[int], episode: str | None = None) -> Session:
        s = Session(uuid.uuid4().hex, kind, list(prompt_ids), episode=episode, last_used=self.clock())
        s.append_context(prompt_ids)
        self._items[s.id] = s
        self.counted += episode is None
        return s

    def get(self, sid: Any) -> Session:
        if not isinstance(sid, str) or sid not in self._items:
            raise ApiError(404, f"session {sid!r}: unknown or ended (deleted, or evicted after session_idle_s idle "
                                "when max_sessions were kept); leave session_id out to start a new one",
                           "session_not_found")
        self._items.move_to_end(sid)
        s = self._items[sid]
        s.last_used = self.clock()
        return s

    def find(self, sid: str) -> Session | None:
        """The session `sid`, or None (not a use: its place in the eviction order stays)."""
        return self._items.get(sid)

    def close(self, s: Session) -> None:
        """Delete `s` now, or when its running turn ends (its agent episode closed during it)."""
        if s.busy:
            s.drop_when_idle = True
        else:
            self._drop(s)

    def release(self, s: Session) -> None:
        """A turn on `s` ended (or was refused): it is idle from now, or deleted if its episode has closed."""
        s.busy, s.last_used = False, self.clock()
        if s.drop_when_idle:
            self._drop(s)

    def delete(self, sid: str) -> Session:
        s = self.get(sid)
        self._drop(s)
        return s

    def _drop(self, s: Session) -> None:
        if self._items.pop(s.id, None) is not None:
            self.counted -= s.episode is None
            self.on_drop(s)
