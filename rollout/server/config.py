"""The OpenAI-compatible server's own settings (`ServerConfig`): its limits, its chat format, its model id and
key. `python -m miles_k3.serve`'s `ServeConfig` extends it with the model, engine and address it serves, so these
fields keep their flat names there (`max_sessions=...`); training's agent server builds one over its own engine."""
from __future__ import annotations

import os
from dataclasses import dataclass

from miles_k3.evals.templates import template_names

CHAT_FORMATS = ("auto", "tokenizer", "role_lines")
"""The `chat_format`s besides the prompt templates' names."""
NEEDS_CHAT_TEMPLATE = ("tokenizer", "chat", "chat_plain")
"""The `chat_format`s that render through the tokenizer's chat template."""


class ServerConfigError(ValueError):
    """The server's settings do not fit what it serves (a chat format the tokenizer cannot render); the message
    starts with the field's name and says what to use instead."""


@dataclass
class ServerConfig:
    """The server's limits and prompt rendering (docs/concepts/serve.md): every request past a limit is refused
    with a 4xx naming the field."""

    max_body_bytes: int = 2**20
    """Largest request body accepted; a larger one is refused with 413 before it is parsed."""
    default_max_tokens: int = 256
    """max_tokens of a request that gives none (capped by the room left in engine.max_context)."""
    max_sessions: int = 1024
    """Sessions kept. A request that starts new ones beyond this evicts idle ones (none generating, none used for
    session_idle_s), least recently used first (their ids then answer 404); when too few are idle it is refused
    with 429, and no live session is evicted."""
    session_idle_s: float = 300.0
    """Seconds a session must go unused before a new session may evict it (an agent between turns, calling its
    tools, keeps its session this long); 0: any session that is not generating may be evicted."""
    max_n: int = 64
    """Samples (`n`) one request may ask for, each a new session: a larger n is refused with 400."""
    served_model_name: str | None = None
    """The model id /v1/models lists and requests must name; None: model.name (a server built over an engine of
    its own, with no model name: "policy")."""
    api_key_env: str | None = None
    """Name of an environment variable holding a bearer token every request must carry (Authorization: Bearer
    ...); None: no authentication (the loopback default). The token is never logged."""
    chat_format: str = "auto"
    """How a chat request's messages become the prompt: tokenizer (the tokenizer's chat template), role_lines
    (`role: content` lines, then `assistant: `), or a prompt template's name (equation, plain, boxed, ...: each
    user message rendered as training rendered a problem, other messages as their text); auto: the tokenizer's
    chat template if it has one, else the template a single-turn model was trained with (its adapter's run
    config, or the recipe of a shipped base: equation for k3_nano), else role_lines. An app built over an engine
    of its own (`rollout.server.build_app`: training's agent server) knows no trained template: auto is then the
    chat template or role_lines."""

    def model_id(self) -> str:
        """The model id the server lists and requests must name: served_model_name, else "policy" (a command's
        config that knows its model's name gives that instead)."""
        return self.served_model_name or "policy"

    def validate(self) -> None:
        for name in ("max_body_bytes", "default_max_tokens", "max_sessions", "max_n"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_n > self.max_sessions:
            raise ValueError(f"max_n: {self.max_n} exceeds max_sessions={self.max_sessions} (each sample of a request "
                             "starts a session); lower max_n or raise max_sessions")
        if not self.session_idle_s >= 0:
            raise ValueError(f"session_idle_s: must be >= 0 seconds, got {self.session_idle_s}")
        if self.served_model_name is not None and not self.served_model_name:
            raise ValueError("served_model_name: must be non-empty or null (model.name)")
        if self.api_key_env is not None and not os.environ.get(self.api_key_env):
            raise ValueError(f"api_key_env: the environment variable {self.api_key_env} is unset or empty; set it "
                             "to the bearer token clients send, or leave api_key_env null")
        formats = (*CHAT_FORMATS, *template_names())
        if self.chat_format not in formats:
            raise ValueError(f"chat_format: '{self.chat_format}' is not one of {', '.join(formats)}")

    def check_tokenizer(self, tokenizer) -> None:
        """ServerConfigError when chat_format renders through a chat template and `tokenizer` has none."""
        if self.chat_format in NEEDS_CHAT_TEMPLATE and not getattr(tokenizer, "chat_template", None):
            raise ServerConfigError(f"chat_format: {self.chat_format} needs a tokenizer with a chat template, and "
                                    "this one has none; use chat_format=auto, role_lines or a prompt template "
                                    "(equation, plain, ...)")
