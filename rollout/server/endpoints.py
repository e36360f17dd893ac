"""The endpoints' logic over one engine and tokenizer (`Server`; no HTTP here: `app.build_app` wraps it), and the
one engine call of a turn (`generate_turn`).

Engine calls run one at a time on a single worker thread; requests that arrive while the engine is busy share its
next call. On the native engine each session's KDA state and latent pages stay in the engine between its turns (its
kept state: `miles_k3.rollout.kept_state`), so a turn prefills only its new tokens; a session deleted, evicted or
ended releases them. Rendering and tokenising prompts run on a thread of their own, never on the event loop.

Agent episodes (training, `miles_k3.agent`): `open_episode` serves one conversation at /episodes/{id}/v1, the id a
random token that is the episode's credential; the in-training server requires the run's random key (`api_key`)
on every other endpoint. An episode's session is never evicted, and is deleted when the episode closes (when its
running turn ends, if one is running then).
"""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import hmac
import os
import time
import uuid

from miles_k3.evals.templates import response_text
from miles_k3.rollout.server.config import ServerConfig, ServerConfigError
from miles_k3.rollout.server.protocol import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    ApiError,
    describe_message,
    encode,
    float_field,
    int_field,
    normalize_messages,
    parse_body,
    refuse_set,
    render_messages,
)
from miles_k3.rollout.server.sessions import Session, Sessions


def generate_turn(engine, prompts: list[list[int]], params: list[dict], n: int, lora: str | None,
                  states: list[int | None] | None = None) -> list[dict]:
    """The one engine call of a turn (of every turn batched into it): `n` samples of each prompt (the whole token
    sequence of its session so far) under its own sampling params, with log-probs; prompt i's sample j at
    i * n + j. On an engine that keeps state (`capabilities.keeps_state`: the native one) every sample's state is
    kept between its turns (`meta_info["state_id"]`): `states[i]`, the kept state prompt i continues, prefills only
    its new tokens."""
    if not engine.capabilities.keeps_state:
        return engine.generate(input_ids=prompts, sampling_params=params, n=n, return_logprob=True, lora=lora)
    return engine.generate(input_ids=prompts, sampling_params=params, n=n, return_logprob=True, lora=lora,
                           keep_state=True, states=states or [None] * len(prompts))


class Server:
    """The endpoints' logic over one engine and tokenizer (no HTTP here: `app.build_app` wraps it)."""

    def __init__(self, engine, tokenizer, cfg: ServerConfig, lora: str | None = None, api_key: str | None = None):
        """`engine`: a native `RolloutEngine`, or anything with its `generate`, `max_context`, `capabilities` and
        (with `capabilities.keeps_state`) `release_states`; `lora`: the engine's adapter name to generate with
        (None: the base); `api_key`: the bearer token every request but an episode's must carry (the in-training
        server's random one); None: the value of cfg.api_key_env's variable, if set. ServerConfigError when cfg.chat_format needs a chat template the
        tokenizer lacks."""
        cfg.check_tokenizer(tokenizer)
        self.engine, self.tokenizer, self.lora = engine, tokenizer, lora
        self.model_id = cfg.model_id()
        self.chat_format = cfg.chat_format
        self.max_body_bytes = cfg.max_body_bytes
        self.default_max_tokens = cfg.default_max_tokens
        self.max_n = cfg.max_n
        self.sessions = Sessions(cfg.max_sessions, cfg.session_idle_s, self.release_state)
        self.api_key = api_key or (os.environ.get(cfg.api_key_env) if cfg.api_key_env else None)
        if cfg.api_key_env and not self.api_key:
            raise ServerConfigError(f"api_key_env: the environment variable {cfg.api_key_env} is unset or empty")
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
        n = int_field(body, "n", 1, 1)
        if n > self.max_n:
            raise ApiError(400, f"n: {n} exceeds max_n={self.max_n}, the samples one request may ask for (each "
                                "starts a session); ask for fewer", "invalid_value")
        max_tokens = int_field(body, max_tokens_key, None, 1)
        if max_tokens_key == "max_completion_tokens" and max_tokens is None:
            max_tokens = int_field(body, "max_tokens", None, 1)
        params = {"temperature": float_field(body, "temperature", 1.0, 0.0, 100.0),
                  "top_p": float_field(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
                  "top_k": int_field(body, "top_k", -1, -1)}
        seed = int_field(body, "seed", None, 0, 2**62)
        if seed is not None:
            params["sampling_seed"] = seed
        refuse_set(body, "stream", (None, False), "responses are returned whole")
        refuse_set(body, "stop", (None, [], ""), "generation stops at the model's end tokens only")
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
            self.release_state(session)
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

    def release_state(self, session: Session) -> None:
        """Release a session's kept state in the engine (on the worker thread, after the engine calls queued
        before)."""
        if session.state_id is not None:
            self.worker.submit(self.engine.release_states, [session.state_id])
            session.state_id = None

    async def run_engine(self, prompt: list[int], params: dict, n: int, state_id: int | None = None
                         ) -> list[dict]:
        """The `n` records of one prompt (continuing kept state `state_id`). Requests that arrive while
        the engine is busy wait together and go into its next call as one batch (those with the same n; `drain`)."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self.pending.append((prompt, params, n, state_id, done))
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
                s.state_id = out["meta_info"].get("state_id")
                s.append_turn(0, out)
            return sessions, outs
        try:
            added = await self.off_loop(new_ids, session)
            prompt = session.ids + added
            params["max_new_tokens"] = self.room(prompt, max_tokens, session)
            outs = await self.run_engine(prompt, params, 1, session.state_id)
            session.state_id = outs[0]["meta_info"].get("state_id")
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
        refuse_set(body, "top_logprobs", (None, 0), "only the sampled tokens' log-probs are reported")
        holder: dict = {}

        def new_ids(s: Session) -> list[int]:
            old = s.messages
            for i, (have, got) in enumerate(zip(old, messages)):
                if have != got:
                    raise ApiError(409, f"messages[{i}] differs from session {s.id}'s message {i}: it has "
                                        f"{describe_message(have)}, the request {describe_message(got)}; a session's request "
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
        refuse_set(body, "echo", (None, False), "the prompt is not repeated (its ids: GET /v1/sessions/{id})")
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
