"""The OpenAI API's request and response shapes as this server takes them: `ApiError` (a refusal: its status and
OpenAI's error body), the request body (`parse_body`: a JSON object, integers bounded), its fields (`int_field`,
`float_field`, `refuse_set`), chat messages (`normalize_messages`) and how they become prompt text
(`render_messages`, by chat_format). No HTTP and no engine here: `endpoints.Server` uses them."""
from __future__ import annotations

import json
from typing import Any

from miles_k3.evals.templates import render_prompt

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


# ---- prompts ------------------------------------------------------------------------------------------------
def render_messages(tokenizer, messages: list[dict], chat_format: str = "auto") -> str:
    """The prompt text of `messages` under `chat_format` (ServerConfig.chat_format), ending where the reply starts:
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


def describe_message(m: dict) -> str:
    text = m["content"] if len(m["content"]) <= 60 else m["content"][:57] + "..."
    return f"{m['role']} {text!r}"


# ---- request fields -----------------------------------------------------------------------------------------
def int_field(body: dict, key: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in {lo}..{hi}"
        raise ApiError(400, f"{key}: must be an integer {rng}, got {v!r}", "invalid_value")
    return v


def float_field(body: dict, key: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (lo < v if lo_open else lo <= v) or v > hi:
        raise ApiError(400, f"{key}: must be a number in {'(' if lo_open else '['}{lo}, {hi}], got {v!r}",
                       "invalid_value")
    return float(v)


def refuse_set(body: dict, key: str, allowed: tuple, why: str) -> None:
    if body.get(key) not in allowed:
        raise ApiError(400, f"{key}: {body[key]!r} is not supported: {why}", "unsupported_value")


# ---- the body ------------------------------------------------------------------------------------------------
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
