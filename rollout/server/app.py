"""The HTTP face of a `Server`: `build_app` routes the OpenAI endpoints, the sessions' and the agent episodes' to
its methods and turns an `ApiError` into OpenAI's error body. FastAPI is imported when an app is built (the serve
extra), so `miles_k3.rollout` imports without it. No `from __future__ import annotations` here: FastAPI reads the
routes' `Request` annotation, a name local to `_add_routes`."""

import asyncio
import contextlib
import logging

from miles_k3.rollout.server.config import ServerConfig
from miles_k3.rollout.server.endpoints import Server
from miles_k3.rollout.server.protocol import ApiError

log = logging.getLogger(__name__)


def build_app(engine, tokenizer, cfg: ServerConfig, lora: str | None = None, api_key: str | None = None):
    """The FastAPI app serving `engine` (a native `RolloutEngine`, or anything with its `generate` and
    `max_context`) and `tokenizer` under `cfg`'s limits; `lora`: the engine's adapter name to generate with (None:
    the base); `api_key`: the bearer token required (None: cfg.api_key_env's, if set), except on the agent
    episodes' URLs, whose random ids are their credentials. `app.state.server` is the `Server` (its sessions)."""
    try:
        from fastapi import FastAPI
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
    _add_routes(app, server)
    return app


def _add_routes(app, server: Server) -> None:
    """The endpoints of `app`, each answered by `server` (docs/concepts/serve.md, The API)."""
    from fastapi import Request
    from fastapi.responses import JSONResponse

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
