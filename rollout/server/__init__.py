"""The OpenAI-compatible server over a rollout engine, as a library: `python -m miles_k3.serve` serves it over the
engine it builds, and training's agent episodes (`miles_k3.agent`) over the engine it trains with
(docs/concepts/serve.md).

Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET and DELETE /v1/sessions/{id}, and
an agent episode's POST /episodes/{id}/v1/chat/completions.

Every generation belongs to a session (`session_id` in the request, else a new one, returned in the response) that
keeps the exact token sequence the engine saw (`sessions.Session`). A turn's prompt is the session's tokens so far
+ the ids of the new messages (chat: the chat format's rendering of just the new messages, tokenised on its own;
completions: the new prompt text or ids), so the engine sees exactly that concatenation.

Limits (`ServerConfig`), all refused with a 4xx naming the field: a body past max_body_bytes or holding an integer
past MAX_INT_DIGITS digits, `n` past max_n, and new sessions past max_sessions when too few are idle (a session is
evicted only when no turn is running on it and it has gone unused for session_idle_s, least recently used first:
no client's live session gives way to another's request).

Chat messages become the prompt by `chat_format` (`protocol.render_messages`): the tokenizer's chat template,
`role: content` lines, or a prompt template applied to each user message; auto is the chat template when the
tokenizer has one, else role_lines (the command resolves auto first to the template the model was trained with).

The modules, each importing only those listed before it: `config` (`ServerConfig`), `protocol` (errors, request fields,
messages, prompts), `sessions`, `endpoints` (`Server`: the endpoints' logic and the engine calls), `app`
(`build_app`: FastAPI, imported only when an app is built).
"""
from miles_k3.rollout.server.app import build_app
from miles_k3.rollout.server.config import ServerConfig, ServerConfigError
from miles_k3.rollout.server.endpoints import Server, generate_turn
from miles_k3.rollout.server.protocol import ApiError, encode, render_messages
from miles_k3.rollout.server.sessions import Session, Sessions

__all__ = ["ApiError", "Server", "ServerConfig", "ServerConfigError", "Session", "Sessions", "build_app", "encode",
           "generate_turn", "render_messages"]
