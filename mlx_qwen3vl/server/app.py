"""The HTTP layer (Starlette): routes, API key, body limit, Host / Origin checks, CORS, OpenAI
error bodies, SSE, and ending running requests when the server stops."""

import asyncio
import contextlib
import os
import sys
import time
import traceback
from typing import Optional

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from . import chat, messages, responses
from . import grounding as G
from .prepared import ErrorEvent
from .protocol import APIError
from .service import Service, shutting_down
from .store import ResponseStore
from .ui import routes as ui_routes


def _error_response(e: APIError, path: str = "") -> JSONResponse:
    """An error in the shape of the protocol the path speaks (Anthropic's under /v1/messages)."""
    body = messages.error_body(e) if path.startswith(ANTHROPIC_PATHS) else e.body()
    return JSONResponse(body, status_code=e.status, headers=e.headers)


ANTHROPIC_PATHS = ("/v1/messages",)

LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")


def _host_name(host: str) -> str:
    """A Host header's name, without port or IPv6 brackets, lower-cased."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class LocalOnly:
    """With no API key, the server answers only this machine's own names: a `Host` header naming
    another (a DNS-rebinding page that resolves its own name to 127.0.0.1) is refused, and so is a
    browser request from another origin (a page the user visits posting `text/plain` to
    127.0.0.1) unless --cors-allow-origin names it. Same-origin requests (the server's own pages)
    and clients that send no Origin (SDKs, curl) are served. A pure ASGI middleware: streams pass
    through untouched."""

    def __init__(self, app, bound_host=None, cors_origins=()):
        self.app = app
        # No Host at all is an HTTP/1.0 client, never a browser (which always names the page's host).
        self.names = {"", *LOCAL_NAMES, *([_host_name(bound_host)] if bound_host else [])}
        self.origins = set(cors_origins or ())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get("host", "")
        server = scope.get("server") or ("",)
        if _host_name(host) not in self.names | {str(server[0]).lower()}:
            return await _refuse(scope, receive, send, 421, f"Host {host[:100]!r} does not name this server; with no "
                                 "--api-key it answers only requests for localhost, 127.0.0.1, ::1 or its own "
                                 "address", "forbidden_host")
        origin = headers.get("origin")
        if origin is not None and origin.lower() != f"{scope.get('scheme', 'http')}://{host}".lower() \
                and origin not in self.origins and "*" not in self.origins:
            return await _refuse(scope, receive, send, 403, f"cross-origin request from {origin[:100]!r} refused; "
                                 "start the server with --cors-allow-origin ORIGIN to allow it", "forbidden_origin")
        await self.app(scope, receive, send)


async def _refuse(scope, receive, send, status, message, code):
    error = APIError(status, message, type="permission_error", code=code)
    await _error_response(error, scope.get("path", ""))(scope, receive, send)


def create_app(engine, builder, *, model_id: str, api_key: Optional[str] = None, max_body_bytes: int = 64 << 20,
               cors_origins=None, bound_host=None, ui: bool = True, agent_format: str = "qwen",
               response_store=None, computer_answers=None, agent_history=None) -> Starlette:
    service = Service(engine, builder, model_id=model_id, api_key=api_key, max_body_bytes=max_body_bytes,
                      agent_format=agent_format, computer_answers=computer_answers,
                      agent_history=agent_history)
    store = response_store if response_store is not None else ResponseStore()
    running = service.running  # handles of the requests being answered (ended with an error when the server stops)
    stopping = []

    def stop():
        """The server is stopping (on the event loop): refuse new requests, end running ones with
        an error event (and free their rows)."""
        stopping.append(True)
        service.stopping = True
        for handle in list(running):
            handle.cancel()
            handle.queue.put_nowait(ErrorEvent(shutting_down()))

    check_auth = service.check_auth

    async def health(request):
        return JSONResponse({"status": "ok", "model": model_id})

    async def models(request):
        check_auth(request)
        return JSONResponse({"object": "list", "data": [
            {"id": model_id, "object": "model", "created": int(engine.started), "owned_by": "mlx_qwen3vl"}]})

    async def metrics(request):
        check_auth(request)
        return JSONResponse({**engine.stats(), **store.stats(), **service.computer_answers.stats(),
                             "requests_built": service.built})

    async def ground(request: Request):
        """POST /v1/ground (grounding.py): the same admission, then each pass a request through the
        engine, on a worker thread; the job holds its place in the queue from before the image is read."""
        async with service.queued(request, G.parse_ground_request) as (req, slot):
            hit = await G.GroundJob(service, req, request, asyncio.get_running_loop(), slot).serve()
        if hit is None:  # the client went away
            return JSONResponse({}, status_code=499)
        return JSONResponse(G.response(hit, req.model or model_id))

    async def api_error(request, exc: APIError):
        return _error_response(exc, request.url.path)

    async def http_error(request, exc: HTTPException):
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        error = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", type=kind)
        return _error_response(error, request.url.path)

    async def internal_error(request, exc: Exception):
        return _error_response(_as_error(exc), request.url.path)

    middleware = [Middleware(OneLineErrors)]
    if api_key is None:
        middleware.append(Middleware(LocalOnly, bound_host=bound_host, cors_origins=cors_origins))
    if cors_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                                     allow_headers=["Authorization", "Content-Type", "x-api-key", "anthropic-version",
                                                    "anthropic-beta"]))
    engine.started = getattr(engine, "started", time.time())
    app = Starlette(
        routes=[Route("/health", health), Route("/v1/models", models), Route("/metrics", metrics),
                *chat.routes(service),
                Route("/v1/ground", ground, methods=["POST"]), *responses.routes(service, store),
                *messages.routes(service), *(ui_routes() if ui else [])],
        middleware=middleware,
        exception_handlers={APIError: api_error, HTTPException: http_error, Exception: internal_error},
        lifespan=_lifespan(engine),
    )
    app.state.stop = stop
    return app


def _as_error(e) -> APIError:
    """An exception as the API's error; an unexpected one is a 500 naming only its type (its text
    may hold server paths), told to the log in one line."""
    if isinstance(e, APIError):
        return e
    log_internal(e)
    return APIError(500, f"internal error ({type(e).__name__}); the server's log has a line about it",
                    code="internal_error")


def log_internal(e: BaseException, what: str = ""):
    """One line in the log for an unexpected exception: its type, message and where it was raised."""
    frames = traceback.extract_tb(e.__traceback__) if e.__traceback__ else []
    where = f" at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""
    text = " ".join(str(e).split())[:300]
    print(f"[mlx_qwen3vl] {what}internal error {type(e).__name__}{where}: {text}", file=sys.stderr, flush=True)


class OneLineErrors:
    """Inside Starlette's last-resort handler: an unexpected exception becomes the 500 of _as_error
    and one log line, and is not raised on (Starlette would re-raise it for uvicorn to print its
    whole traceback)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def sending(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as e:  # noqa: BLE001 — answered and logged here
            error = _as_error(e)
            if not started:
                await _error_response(error, scope.get("path", ""))(scope, receive, send)


def _lifespan(engine):
    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await run_in_threadpool(engine.close)

    return lifespan
