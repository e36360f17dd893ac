"""`python -m miles_k3.serve [model=k3_nano] [model.path=...] [adapter=DIR] [host=127.0.0.1] [port=8000] ...`: an
OpenAI-compatible HTTP endpoint over the native rollout engine, for agent code (docs/concepts/serve.md).

The server is the library `miles_k3.rollout.server` (sessions that keep the exact tokens, the endpoints, the app:
`build_app(engine, tokenizer, cfg)`); this command composes `ServeConfig` (Hydra), builds the engine with the
adapter as eval does (`eval.eval_engine`), resolves chat_format, and runs uvicorn until interrupted.

`chat_format=auto` is resolved once at start (`resolve_chat_format`) to the template the model was trained with when
its tokenizer has no chat template, so the shipped base is asked "15-43-75=" as in training, not
"user: 15-43-75\nassistant: ", after which it stops at once. `serving_app(cfg)` is the command's app (engine,
adapter, chat format); `main` is the Hydra command.
"""

import dataclasses
import ipaddress
import logging

import torch
from omegaconf import DictConfig

from miles_k3.cli import hydra_app
from miles_k3.config import ServeConfig, exit_on_user_error, register_schemas, typed_or_exit
from miles_k3.eval import check_adapter, eval_engine, prompt_template, trained_config, warn_random_weights
from miles_k3.launch import silence_fla_cpu_warning
from miles_k3.rollout.server import Server, build_app  # noqa: F401 (Server: tests/commands/test_agent.py's import)

log = logging.getLogger("miles_k3.serve")
register_schemas()


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server to this machine (localhost, 127.0.0.0/8, ::1)."""
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
