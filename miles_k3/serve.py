"""`python -m miles_k3.serve [model=k3_nano] [model.path=...] [adapter=DIR] [host=127.0.0.1] [port=8000] ...`: an
OpenAI-compatible HTTP endpoint over the native rollout engine, for agent code (docs/concepts/serve.md).

Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET and DELETE /v1/sessions/{id}.

Sessions, token in / token out. Every generation belongs to a session (`session_id` in the request, else a new
one, returned in the response). A session keeps the exact token sequence the engine saw: the first prompt's ids,
each turn's output ids as sampled (never re-tokenised from the text the client got), and the ids of each later
message (chat: the chat template's rendering of just the new messages, tokenised on its own; completions: the new
prompt text or ids), with a loss mask (1: sampled, 0: prompt and observations), the engine's log-prob of each
sampled token (0.0 elsewhere: of the distribution sampled from, and under top-p / top-k also of the unfiltered
one, which the trainer's log-probs are comparable with) and the weight version that sampled it (null elsewhere). A
turn's prompt is the session's tokens so far + the new ids, so the engine sees exactly that concatenation.

Limits, all refused with a 4xx naming the field: a body past max_body_bytes or holding an integer past
MAX_INT_DIGITS digits, `n` past max_n, and new sessions past max_sessions when too few are idle (a session is
evicted only when no turn is running on it and it has gone unused for session_idle_s, least recently used first:
no client's live session gives way to another's request). Tokenising and rendering prompts run on a thread of
their own, never on the event loop.

Chat messages become the prompt by `chat_format` (`render_messages`): the tokenizer's chat template, `role: content`
lines, or a prompt template applied to each user message. The command resolves `auto` once at start to the template
the model was trained with when its tokenizer has no chat template (`resolve_chat_format`), so the shipped base is
asked "15-43-75=" as in training, not "user: 15-43-75\nassistant: ", after which it stops at once.

`build_app(engine, tokenizer, cfg)` builds the FastAPI app over an engine already built (training may run it
for agent rollouts); `serving_app(cfg)` is the command's app (engine, adapter, chat format); `main` is the Hydra
command (uvicorn). Engine calls run one at a time on a single worker
thread, each through `generate_turn`; requests that arrive while the engine is busy share its next call. On the
native engine each session's KDA state and latent pages stay in the engine between its turns (an engine session:
`rollout/sessions.py`), so a turn prefills only its new tokens; a session deleted, evicted or ended frees them.

Agent episodes (training, `miles_k3.agent`): `open_episode` serves one conversation at /episodes/{id}/v1, the id a
random token that is the episode's credential; the in-training server requires the run's random key (`api_key`)
on every other endpoint. An episode's session is never evicted, and is deleted when the episode closes (when its
running turn ends, if one is running then).
"""

import asyncio
import concurrent.futures as cf
import contextlib
import dataclasses
import hmac
import ipaddress
import json
import logging
import os
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
from omegaconf import DictConfig

from miles_k3.cli import hydra_app
from miles_k3.config import ConfigFieldError, ServeConfig, exit_on_user_error, register_schemas, typed_or_exit
from miles_k3.eval import check_adapter, eval_engine, prompt_template, trained_config, warn_random_weights
from miles_k3.evals.templates import render_prompt, response_text
from miles_k3.launch import silence_fla_cpu_warning

log = logging.getLogger("miles_k3.serve")
register_schemas()

ROLES = ("system", "developer", "user", "assistant", "tool")
"""Message roles accepted (the chat template may refuse some of them)."""
NULL_MESSAGE_KEYS = ("refusal", "tool_calls", "function_call", "audio", "annotations")
"""Keys of an OpenAI response message that a client may echo back: accepted when null, refused otherwise."""
COMMON_FIELDS = frozenset({"model", "n", "max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs",
                           "stop", "stream", "session_id"})
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo"}
MAX_INT_DIGITS = 64
"""Digits of a JSON integer a request may hold: every integer field is far below it (n, max_tokens, seed < 2**62,
token ids). A longer one is refused with 400 naming where it is (Python's int() refuses past 4,300 digits, and
its time grows with the square of the length)."""


class ApiError(Exception):
    """A request refused: its HTTP status and a message saying what to fix (OpenAI's error body)."""

    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code

    def body(self) -> dict:
        kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                409: "conflict_error", 413: "request_too_large", 429: "rate_limit_error"}.get(self.status,
                                                                                               "server_error")
        return {"error": {"message": self.message, "type": kind, "param": None, "code": self.code}}


# ---- the engine call --------------------------------------------------------------------------------------
def generate_turn(engine, prompts: list[list[int]], params: list[dict], n: int, lora: str | None,
                  sessions: list[int | None] | None = None) -> list[dict]:
    """The one engine call of a turn (of every turn batched into it): `n` samples of each prompt (the whole token
    sequence of its session so far) under its own sampling params, with log-probs; prompt i's sample j at
    i * n + j. On an engine with sessions (the native one) every sample's state is kept between its turns
    (`meta_info["session_id"]`): `sessions[i]`, the engine session prompt i continues, prefills only its new
    tokens."""
    if not getattr(engine, "keeps_sessions", False):
        return engine.generate(input_ids=prompts, sampling_params=params, n=n, return_logprob=True, lora=lora)
    return engine.generate(input_ids=prompts, sampling_params=params, n=n, return_logprob=True, lora=lora,
                           keep_state=True, sessions=sessions or [None] * len(prompts))


# ---- prompts ------------------------------------------------------------------------------------------------
def render_messages(tokenizer, messages: list[dict], chat_format: str = "auto") -> str:
    """The prompt text of `messages` under `chat_format` (ServeConfig.chat_format), ending where the reply starts:
    tokenizer: the chat template (add_generation_prompt=True); role_lines: each message as `role: content\\n`
    (`role (name): ` with a name), then `assistant: `; a prompt template's name: each user message's content
    through that template (as training rendered a problem: equation makes "15-43-75" "15-43-75="), the other
    messages' content as it is, concatenated; auto: the chat template when the tokenizer has one, else
    role_lines."""
    if chat_format == "auto":
        chat_format = "tokenizer" if getattr(tokenizer, "chat_template", None) else "role_lines"
    if chat_format not in ("tokenizer", "role_lines"):
        return "".join(render_prompt(chat_format, m["content"], tokenizer) if m["role"] == "user" else m["content"]
                       for m in messages)
    if chat_format == "tokenizer":
        try:
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 (a template that refuses the messages: e.g. roles must alternate)
            raise ApiError(400, f"the chat template refused these messages: {type(e).__name__}: {e}",
                           "template_error") from None
    lines = [f"{m['role']}{' (' + m['name'] + ')' if 'name' in m else ''}: {m['content']}\n" for m in messages]
    return "".join(lines) + "assistant: "


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def normalize_messages(raw: Any) -> list[dict]:
    """The request's messages as {role, content[, name]} with text content (a list of text parts is joined);
    ApiError(400) naming the message for anything else."""
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "messages: give a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(400, f"{where}: not an object")
        unknown = sorted(set(m) - {"role", "content", "name", *NULL_MESSAGE_KEYS})
        set_nulls = sorted(k for k in NULL_MESSAGE_KEYS if m.get(k) is not None)
        if unknown or set_nulls:
            raise ApiError(400, f"{where}: unsupported key(s) {unknown + set_nulls} (this server takes role, "
                                "content and name; tool calls are not supported)")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ApiError(400, f"{where}.role: {role!r} is not one of {', '.join(ROLES)}")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ApiError(400, f"{where}.content: only text parts ({{type: text, text: ...}}) are supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ApiError(400, f"{where}.content: give a string (or a list of text parts)")
        msg = {"role": role, "content": content}
        if m.get("name") is not None:
            if not isinstance(m["name"], str) or not m["name"]:
                raise ApiError(400, f"{where}.name: give a non-empty string")
            msg["name"] = m["name"]
        out.append(msg)
    return out


def _describe(m: dict) -> str:
    text = m["content"] if len(m["content"]) <= 60 else m["content"][:57] + "..."
    return f"{m['role']} {text!r}"


# ---- request fields -----------------------------------------------------------------------------------------
def _int(body: dict, key: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in {lo}..{hi}"
        raise ApiError(400, f"{key}: must be an integer {rng}, got {v!r}", "invalid_value")
    return v


def _float(body: dict, key: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (lo < v if lo_open else lo <= v) or v > hi:
        raise ApiError(400, f"{key}: must be a number in {'(' if lo_open else '['}{lo}, {hi}], got {v!r}",
                       "invalid_value")
    return float(v)


def _refuse_set(body: dict, key: str, allowed: tuple, why: str) -> None:
    if body.get(key) not in allowed:
        raise ApiError(400, f"{key}: {body[key]!r} is not supported: {why}", "unsupported_value")


# ---- sessions ---------------------------------------------------------------------------------------------------
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
    engine_session: int | None = None  # the engine session holding its state between turns (native engine)
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
        """`on_drop(session)`: called for a session evicted or deleted (its engine state is freed there);
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


# ---- the server ---------------------------------------------------------------------------------------------
class Server:
    """The endpoints' logic over one engine and tokenizer (no HTTP here: `build_app` wraps it)."""

    def __init__(self, engine, tokenizer, cfg: ServeConfig, lora: str | None = None, api_key: str | None = None):
        """`api_key`: the bearer token every request but an episode's must carry (the in-training server's random
        one); None: the value of cfg.api_key_env's variable, if set."""
        self.engine, self.tokenizer, self.lora = engine, tokenizer, lora
        self.model_id = cfg.served_model_name or cfg.model.name
        self.chat_format = cfg.chat_format
        if cfg.chat_format in ("tokenizer", "chat", "chat_plain") and not getattr(tokenizer, "chat_template", None):
            raise ConfigFieldError(f"chat_format: {cfg.chat_format} needs a tokenizer with a chat template, and this "
                                   "one has none; use chat_format=auto, role_lines or a prompt template (equation, "
                                   "plain, ...)")
        self.max_body_bytes = cfg.max_body_bytes
        self.default_max_tokens = cfg.default_max_tokens
        self.max_n = cfg.max_n
        self.sessions = Sessions(cfg.max_sessions, cfg.session_idle_s, self.end_engine_session)
        self.api_key = api_key or (os.environ.get(cfg.api_key_env) if cfg.api_key_env else None)
        if cfg.api_key_env and not self.api_key:
            raise ValueError(f"api_key_env: the environment variable {cfg.api_key_env} is unset or empty")
        self.worker = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="serve-engine")
        # Rendering and tokenising prompts (a large one takes a while) run here, off the event loop and not queued
        # behind the engine's calls.
        self.tokenize_pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="serve-tokenize")
        self.pending: list[tuple[list[int], dict, int, int | None, asyncio.Future]] = []  # waiting for the engine
        self.drainer: asyncio.Task | None = None  # the task feeding them to the engine, while there are any
        self.created = int(time.time())
        self.episodes: dict[str, dict] = {}  # agent episodes (`open_episode`)

    # -- checks shared by every request
    def check_auth(self, header: str | None) -> None:
        if self.api_key is None:
            return
        token = (header or "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(token.encode(), self.api_key.encode()):
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer ...)", "invalid_api_key")

    def check_model(self, body: dict) -> None:
        model = body.get("model", self.model_id)
        if model != self.model_id:
            raise ApiError(404, f"model {model!r} is not served here; this server serves {self.model_id!r} "
                                "(GET /v1/models)", "model_not_found")

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_id, "object": "model", "created": self.created,
                                            "owned_by": "miles_k3"}]}

    def sampling(self, body: dict, max_tokens_key: str) -> tuple[dict, int | None, int]:
        """(sampling params without max_new_tokens, the requested max_tokens or None, n)."""
        n = _int(body, "n", 1, 1)
        if n > self.max_n:
            raise ApiError(400, f"n: {n} exceeds max_n={self.max_n}, the samples one request may ask for (each "
                                "starts a session); ask for fewer", "invalid_value")
        max_tokens = _int(body, max_tokens_key, None, 1)
        if max_tokens_key == "max_completion_tokens" and max_tokens is None:
            max_tokens = _int(body, "max_tokens", None, 1)
        params = {"temperature": _float(body, "temperature", 1.0, 0.0, 100.0),
                  "top_p": _float(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
                  "top_k": _int(body, "top_k", -1, -1)}
        seed = _int(body, "seed", None, 0, 2**62)
        if seed is not None:
            params["sampling_seed"] = seed
        _refuse_set(body, "stream", (None, False), "responses are returned whole")
        _refuse_set(body, "stop", (None, [], ""), "generation stops at the model's end tokens only")
        return params, max_tokens, n

    def room(self, prompt: list[int], max_tokens: int | None, session: Session | None) -> int:
        """max_new_tokens of a request: the requested max_tokens (else the default, capped by the room left);
        ApiError(400) when prompt + max_tokens exceed the engine's max_context (a session ends truncated)."""
        ctx = self.engine.max_context
        left = ctx - len(prompt)
        if max_tokens is None and left >= 1:
            return min(self.default_max_tokens, left)
        if max_tokens is not None and max_tokens <= left:
            return max_tokens
        msg = (f"the prompt ({len(prompt)} tokens{', the whole session' if session else ''}) + max_tokens "
               f"({max_tokens if max_tokens is not None else 1}) exceed the engine's max_context {ctx}")
        if session is not None:
            session.end = "truncated"
            self.end_engine_session(session)
            msg += f"; session {session.id} has ended truncated (its record: GET /v1/sessions/{session.id})"
        else:
            msg += "; shorten the prompt or lower max_tokens"
        raise ApiError(400, msg, "context_length_exceeded")

    def open_session(self, body: dict, kind: str, n: int) -> Session | None:
        """The session the request continues (marked busy), or None for a new one."""
        sid = body.get("session_id")
        if sid is None:
            return None
        s = self.sessions.get(sid)
        if s.end is not None:
            raise ApiError(404, f"session {sid!r} has ended ({s.end}); its record stays readable at "
                                f"GET /v1/sessions/{sid} until DELETE", "session_ended")
        if s.kind != kind:
            raise ApiError(409, f"session {sid!r} is a {s.kind} session; continue it with "
                                f"/v1/{'chat/completions' if s.kind == 'chat' else 'completions'}")
        if s.busy:
            raise ApiError(409, f"session {sid!r} is generating a turn; send its next request after the reply")
        if n != 1:
            raise ApiError(400, f"n: a session continues with one sample (n=1), got {n}; forks (n > 1) start "
                                "new sessions", "invalid_value")
        s.busy = True
        return s

    def end_engine_session(self, session: Session) -> None:
        """Free a session's engine state (on the worker thread, after the engine calls queued before)."""
        if session.engine_session is not None:
            self.worker.submit(self.engine.close_sessions, [session.engine_session])
            session.engine_session = None

    async def run_engine(self, prompt: list[int], params: dict, n: int, engine_session: int | None = None
                         ) -> list[dict]:
        """The `n` records of one prompt (continuing `engine_session`'s kept state). Requests that arrive while
        the engine is busy wait together and go into its next call as one batch (those with the same n; `drain`)."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self.pending.append((prompt, params, n, engine_session, done))
        if self.drainer is None:
            self.drainer = loop.create_task(self.drain())
        try:
            outs = await done
        except ValueError as e:  # a call the engine refuses as a whole
            raise ApiError(400, str(e)) from None
        bad = next((o for o in outs if "error" in o), None)
        if bad is not None:
            raise ApiError(400, f"the engine rejected the request: {bad['error']}")
        return outs

    async def drain(self) -> None:
        """Run the waiting requests, one engine call at a time on the worker thread: each call takes every
        waiting request with the first one's n (in arrival order); the others wait for the next call."""
        loop = asyncio.get_running_loop()
        try:
            while self.pending:
                n = self.pending[0][2]
                batch = [p for p in self.pending if p[2] == n]
                self.pending = [p for p in self.pending if p[2] != n]
                try:
                    outs = await loop.run_in_executor(self.worker, generate_turn, self.engine, [b[0] for b in batch],
                                                      [b[1] for b in batch], n, self.lora, [b[3] for b in batch])
                except Exception as e:  # noqa: BLE001 (every request of the call gets the error)
                    for *_, done in batch:
                        if not done.done():
                            done.set_exception(e)
                    continue
                for i, (*_, done) in enumerate(batch):
                    if not done.done():
                        done.set_result(outs[i * n:(i + 1) * n])
        finally:
            self.drainer = None

    async def off_loop(self, fn, *args):
        """fn(*args) on the tokenizing thread (rendering and tokenising a prompt); the event loop serves the other
        requests meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, fn, *args)

    async def turn(self, body: dict, kind: str, new_ids, max_tokens_key: str, first_ids, episode: str | None = None
                   ) -> tuple[list[Session], list[dict]]:
        """Generate one turn: continue the body's session (new_ids(session) appended) or start n sessions
        (first_ids(); room made for them first, `Sessions.reserve`, unless they are agent episode `episode`'s);
        returns (the sessions, the engine's records). Prompts are tokenised off the event loop."""
        params, max_tokens, n = self.sampling(body, max_tokens_key)
        session = self.open_session(body, kind, n)
        if session is None:
            prompt = await self.off_loop(first_ids)
            params["max_new_tokens"] = self.room(prompt, max_tokens, None)
            with contextlib.nullcontext() if episode is not None else self.sessions.reserve(n):
                outs = await self.run_engine(prompt, params, n)
                sessions = [self.sessions.new(kind, prompt, episode) for _ in outs]
            for s, out in zip(sessions, outs):
                s.engine_session = out["meta_info"].get("session_id")
                s.append_turn(0, out)
            return sessions, outs
        try:
            added = await self.off_loop(new_ids, session)
            prompt = session.ids + added
            params["max_new_tokens"] = self.room(prompt, max_tokens, session)
            outs = await self.run_engine(prompt, params, 1, session.engine_session)
            session.engine_session = outs[0]["meta_info"].get("session_id")
            start = len(session.ids)
            session.append_context(added)
            session.append_turn(start, outs[0])
        finally:
            self.sessions.release(session)  # deleted here if its episode closed meanwhile
        return [session], outs

    # -- the endpoints
    async def chat(self, body: dict, episode: str | None = None) -> dict:
        """POST /v1/chat/completions (`episode`: the agent episode whose session it starts or continues)."""
        self.check_fields(body, CHAT_FIELDS)
        self.check_model(body)
        messages = normalize_messages(body.get("messages"))
        want_logprobs = body.get("logprobs") not in (None, False)
        if body.get("logprobs") not in (None, False, True):
            raise ApiError(400, f"logprobs: give true or false, got {body['logprobs']!r}", "invalid_value")
        _refuse_set(body, "top_logprobs", (None, 0), "only the sampled tokens' log-probs are reported")
        holder: dict = {}

        def new_ids(s: Session) -> list[int]:
            old = s.messages
            for i, (have, got) in enumerate(zip(old, messages)):
                if have != got:
                    raise ApiError(409, f"messages[{i}] differs from session {s.id}'s message {i}: it has "
                                        f"{_describe(have)}, the request {_describe(got)}; a session's request "
                                        "repeats its messages (the replies as returned) and adds new ones",
                                   "session_mismatch")
            if len(messages) <= len(old):
                raise ApiError(409, f"session {s.id} has {len(old)} messages; the request gives {len(messages)}, "
                                    "so it adds none: append the new messages after the last reply",
                               "session_mismatch")
            holder["new"] = messages[len(old):]
            return encode(self.tokenizer, render_messages(self.tokenizer, holder["new"], self.chat_format))

        def first_ids() -> list[int]:
            return encode(self.tokenizer, render_messages(self.tokenizer, messages, self.chat_format))

        sessions, outs = await self.turn(body, "chat", new_ids, "max_completion_tokens", first_ids, episode)
        choices = []
        for i, (s, out) in enumerate(zip(sessions, outs)):
            text = response_text(self.tokenizer, out)
            if "new" in holder:
                s.messages += holder["new"]
            elif not s.messages:
                s.messages = [dict(m) for m in messages]
            s.messages.append({"role": "assistant", "content": text})
            choice = {"index": i, "message": {"role": "assistant", "content": text},
                      "finish_reason": self.finish(out), "logprobs": None, "session_id": s.id}
            if want_logprobs:
                choice["logprobs"] = {"content": [self.token_logprob(t, lp) for lp, t in
                                                  out["meta_info"].get("output_token_logprobs", [])]}
            choices.append(choice)
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": self.model_id, "choices": choices, "usage": self.usage(outs),
                "session_id": sessions[0].id}

    async def completions(self, body: dict) -> dict:
        self.check_fields(body, COMPLETION_FIELDS)
        self.check_model(body)
        _refuse_set(body, "echo", (None, False), "the prompt is not repeated (its ids: GET /v1/sessions/{id})")
        logprobs = body.get("logprobs")
        if logprobs not in (None, 0) or isinstance(logprobs, bool):
            raise ApiError(400, f"logprobs: {logprobs!r} is not supported: give 0 (the sampled tokens' log-probs; "
                                "no alternatives) or leave it out", "unsupported_value")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            if not prompt:
                raise ApiError(400, "prompt: empty; give text or token ids")
            text = prompt

            def ids_of(*session) -> list[int]:  # on the tokenizing thread (`turn`)
                return encode(self.tokenizer, text)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                         for t in prompt):
            ids = list(prompt)

            def ids_of(*session) -> list[int]:
                return ids
        else:
            raise ApiError(400, "prompt: give one prompt, as text or a list of token ids (batches: one request "
                                "each)")
        sessions, outs = await self.turn(body, "completion", ids_of, "max_tokens", ids_of)
        choices = []
        for i, (s, out) in enumerate(zip(sessions, outs)):
            choice = {"index": i, "text": response_text(self.tokenizer, out), "finish_reason": self.finish(out),
                      "logprobs": None, "session_id": s.id}
            if logprobs is not None:
                pairs = out["meta_info"].get("output_token_logprobs", [])
                choice["logprobs"] = {"tokens": [self.tokenizer.decode([t]) for _, t in pairs],
                                      "token_logprobs": [float(lp) for lp, _ in pairs], "top_logprobs": None,
                                      "text_offset": None}
            choices.append(choice)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_id, "choices": choices, "usage": self.usage(outs),
                "session_id": sessions[0].id}

    # -- agent episodes (training: `miles_k3.agent`): one conversation per base URL /episodes/{id}/v1
    def open_episode(self, eid: str, params: dict) -> None:
        """Serve episode `eid` at /episodes/{eid}/v1 (`eid`: a random token, the episode's credential): its chat
        requests, one at a time, continue one session (the first starts it) and take `params` (temperature, top_p,
        top_k, max_tokens, seed: the trainer's rollout settings, replacing the request's; turn k samples with
        seed + k) and at most params["max_turns"] turns."""
        self.episodes[eid] = {"params": dict(params), "session": None, "turns": 0, "busy": False}

    def close_episode(self, eid: str) -> dict | None:
        """End episode `eid`: its session's record (None if it made no request), the session deleted (when its
        running turn ends, if one runs: the record is the one before that turn). A first turn still running makes
        no session (`episode_chat` deletes it)."""
        ep = self.episodes.pop(eid, None)
        if ep is None or ep["session"] is None:
            return None
        s = self.sessions.find(ep["session"])
        if s is None:  # deleted by a key holder (DELETE /v1/sessions/{id})
            return None
        record = s.record()
        self.sessions.close(s)
        return record

    async def episode_chat(self, body: dict, eid: str) -> dict:
        ep = self.episodes.get(eid)
        if ep is None:
            raise ApiError(404, "this episode is not open (it ended, or was never started)", "episode_not_found")
        if ep["busy"]:
            raise ApiError(409, "this episode is generating a turn; send its next request after the reply")
        p = ep["params"]
        if ep["turns"] >= p["max_turns"]:
            raise ApiError(400, f"this episode has had its {p['max_turns']} turns (env.max_turns)", "max_turns")
        body = {k: v for k, v in body.items() if k not in ("max_completion_tokens", "session_id")}
        body |= {"temperature": p["temperature"], "top_p": p["top_p"], "top_k": p["top_k"],
                 "max_tokens": p["max_tokens"], "seed": p["seed"] + ep["turns"], "n": 1,
                 "model": self.model_id}  # an agent names its own model: the episode's is the policy
        if ep["session"] is not None:
            body["session_id"] = ep["session"]
        ep["busy"] = True
        try:
            result = await self.chat(body, eid)
        finally:
            ep["busy"] = False
        if self.episodes.get(eid) is not ep:  # it closed during its first turn: nobody will read this session
            s = self.sessions.find(result["session_id"])
            if s is not None:
                self.sessions.close(s)
        ep["session"], ep["turns"] = result["session_id"], ep["turns"] + 1
        return result

    def session_record(self, sid: str) -> dict:
        return self.sessions.get(sid).record()

    def delete_session(self, sid: str) -> dict:
        s = self.sessions.get(sid)
        if s.busy:
            raise ApiError(409, f"session {sid!r} is generating a turn; delete it after the reply")
        self.sessions.delete(sid)
        return {"id": sid, "object": "session.deleted", "deleted": True}

    # -- helpers
    @staticmethod
    def check_fields(body: dict, known: frozenset) -> None:
        unknown = sorted(set(body) - known)
        if unknown:
            raise ApiError(400, f"unknown or unsupported field(s) {unknown}; this endpoint takes "
                                f"{', '.join(sorted(known))}", "unknown_field")

    @staticmethod
    def finish(out: dict) -> str:
        kind = out["meta_info"]["finish_reason"].get("type")
        return kind if kind in ("stop", "length") else "stop"

    @staticmethod
    def usage(outs: list[dict]) -> dict:
        prompt = outs[0]["meta_info"].get("prompt_tokens", 0)
        completion = sum(len(o["output_ids"]) for o in outs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def token_logprob(self, token: int, lp: float) -> dict:
        text = self.tokenizer.decode([token])
        return {"token": text, "logprob": float(lp),
                "bytes": None if "\ufffd" in text else list(text.encode("utf-8")), "top_logprobs": []}

    async def read_json(self, request) -> dict:
        """The request body as a JSON object: 413 over max_body_bytes (by its Content-Length, else as read),
        400 for anything but a JSON object, or for one holding an integer past MAX_INT_DIGITS digits."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise ApiError(413, f"request body of {declared} bytes exceeds max_body_bytes={self.max_body_bytes}")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise ApiError(413, f"request body exceeds max_body_bytes={self.max_body_bytes}")
            chunks.append(chunk)
        return parse_body(b"".join(chunks))


class LongInt(str):
    """A JSON integer literal past MAX_INT_DIGITS digits, kept as its text until `parse_body` says where it is."""


def parse_body(raw: bytes) -> dict:
    """A request body as a JSON object; ApiError(400) for anything else: not JSON, nested too deep, not an object,
    or holding an integer of more than MAX_INT_DIGITS digits (naming where it is: `n`, `prompt[3]`, ...)."""
    long: list[LongInt] = []

    def parse_int(text: str) -> int | LongInt:
        if len(text) - text.startswith("-") <= MAX_INT_DIGITS:
            return int(text)
        long.append(LongInt(text))
        return long[-1]

    try:
        body = json.loads(raw, parse_int=parse_int)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ApiError(400, f"the body is not JSON: {e}", "invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", "invalid_json")
    stack: list[tuple[str, Any]] = [(k, v) for k, v in body.items()] if long else []
    while stack:  # where the long integer is (no recursion: a body may nest as deep as json.loads allows)
        where, v = stack.pop()
        if isinstance(v, LongInt):
            raise ApiError(400, f"{where}: an integer of {len(v) - v.startswith('-')} digits; this server reads "
                                f"integers of up to {MAX_INT_DIGITS} digits", "invalid_value")
        if isinstance(v, dict):
            stack += [(f"{where}.{k}", x) for k, x in v.items()]
        elif isinstance(v, list):
            stack += [(f"{where}[{i}]", x) for i, x in enumerate(v)]
    return body


def build_app(engine, tokenizer, cfg: ServeConfig, lora: str | None = None, api_key: str | None = None):
    """The FastAPI app serving `engine` (a native `RolloutEngine`, or anything with its `generate` and
    `max_context`) and `tokenizer` under `cfg`'s limits; `lora`: the engine's adapter name to generate with (None:
    the base); `api_key`: the bearer token required (None: cfg.api_key_env's, if set), except on the agent
    episodes' URLs, whose random ids are their credentials. `app.state.server` is the `Server` (its sessions)."""
    try:
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(f"python -m miles_k3.serve needs FastAPI and uvicorn: pip install -e '.[serve]' "
                                  f"({e})") from None

    server = Server(engine, tokenizer, cfg, lora, api_key)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        server.worker.shutdown(wait=True)
        server.tokenize_pool.shutdown(wait=True)

    app = FastAPI(title="miles_k3.serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server

    async def answer(request: Request, handler, *args, body: bool = False, auth: bool = True):
        try:
            if auth:  # an episode's URL is its credential (`Server.open_episode`)
                server.check_auth(request.headers.get("authorization"))
            result = handler(await server.read_json(request), *args) if body else handler(*args)
            if asyncio.iscoroutine(result):
                result = await result
            return JSONResponse(result)
        except ApiError as e:
            return JSONResponse(e.body(), status_code=e.status)
        except Exception:  # a bug answers 500 and is logged; the server keeps serving
            log.exception("serve: %s %s failed", request.method, request.url.path)
            return JSONResponse(ApiError(500, "internal error (logged by the server)").body(), status_code=500)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await answer(request, server.chat, body=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(request, server.completions, body=True)

    @app.post("/episodes/{eid}/v1/chat/completions")
    async def episode_chat(request: Request, eid: str):
        return await answer(request, server.episode_chat, eid, body=True, auth=False)

    @app.get("/v1/models")
    async def models(request: Request):
        return await answer(request, server.models)

    @app.get("/v1/sessions/{sid}")
    async def get_session(request: Request, sid: str):
        return await answer(request, server.session_record, sid)

    @app.delete("/v1/sessions/{sid}")
    async def delete_session(request: Request, sid: str):
        return await answer(request, server.delete_session, sid)

    return app


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def resolve_chat_format(cfg: ServeConfig, tokenizer) -> str:
    """cfg.chat_format, with auto resolved once at start and logged with the reason: the tokenizer's chat template
    when it has one; else the prompt template a single-turn model was trained with (`eval.trained_config`: the
    adapter's run config, or the recipe that made a shipped base); else role_lines."""
    if cfg.chat_format != "auto":
        return cfg.chat_format
    if getattr(tokenizer, "chat_template", None):
        log.info("chat_format=tokenizer (auto: the tokenizer has a chat template)")
        return "tokenizer"
    found = trained_config(cfg.adapter, cfg.model.path)
    template = None if found is None else prompt_template(found[0])
    if template is None:
        log.info("chat_format=role_lines (auto: the tokenizer has no chat template and no single-turn prompt "
                 "template is known for this model)")
        return "role_lines"
    log.info("chat_format=%s (auto: the prompt template of %s, its %s): a user message is a problem as training "
             "saw it; chat_format=role_lines for 'role: content' lines", template[0], found[1], template[1])
    return template[0]


def serving_app(cfg: ServeConfig):
    """(the FastAPI app, its engine) that `python -m miles_k3.serve` serves for `cfg`: the adapter checked, the
    engine built with it, chat_format resolved (`resolve_chat_format`). The caller closes the engine."""
    torch.manual_seed(cfg.seed)
    check_adapter(cfg.adapter)
    warn_random_weights(cfg.model)
    engine, tokenizer, lora = eval_engine(cfg)
    try:
        cfg = dataclasses.replace(cfg, chat_format=resolve_chat_format(cfg, tokenizer))
        return build_app(engine, tokenizer, cfg, lora), engine
    except BaseException:
        engine.close()
        raise


def serve(cfg: ServeConfig) -> None:
    """Build the engine (and adapter) of `cfg` and serve it until interrupted."""
    try:
        import uvicorn
    except ModuleNotFoundError as e:
        raise SystemExit(f"miles_k3.serve: needs FastAPI and uvicorn: pip install -e '.[serve]' ({e})") from None
    app, engine = serving_app(cfg)
    try:
        if not is_loopback(cfg.host):
            log.warning("serving on %s, reachable from other machines%s", cfg.host,
                        "" if cfg.api_key_env else "; no api_key_env is set, so anyone who reaches it can use it")
        log.info("serving %s on http://%s:%d/v1 (max_context %d)", app.state.server.model_id, cfg.host, cfg.port,
                 engine.max_context)
        uvicorn.run(app, host=cfg.host, port=cfg.port, log_config=None)  # its logs through Hydra's: stderr
    finally:
        engine.close()


@hydra_app("miles_k3.serve", "serve")
def main(raw: DictConfig) -> None:
    silence_fla_cpu_warning()
    cfg = typed_or_exit(raw, "miles_k3.serve")
    with exit_on_user_error("miles_k3.serve"):
        serve(cfg)


if __name__ == "__main__":
    main()
