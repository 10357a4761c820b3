"""The MCP protocol around tools.py, with the official SDK's low-level Server: tools/list answers
the hand-written declarations, tools/call checks and runs a tool on the one model thread, and every
failure is a tool error of one line. Transports: stdio, and streamable HTTP behind the HTTP
server's rules (a Bearer key when one is set; without one, only this machine's Host names and no
foreign Origin), its body limit and its connection guards, with sessions capped: in all, per
client address, and closed after an idle timeout (SessionCaps)."""

import asyncio
import hmac
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import mcp_types as types
from mcp.server.lowlevel import Server
from mcp.server.transport_security import TransportSecuritySettings
from starlette.responses import JSONResponse

from .. import __version__
from ..errors import Qwen3VLError
from ..server.app import LocalOnly
from .tools import (DEFAULT_MAX_SESSIONS, DEFAULT_MAX_SESSIONS_PER_CLIENT, DEFAULT_SESSION_IDLE_TIMEOUT_S,
                    TOOL_DECLARATIONS, TOOLS, Settings, answer, prepare)

DEFAULT_MAX_QUEUE = 16  # tool calls waiting for the model; more are refused at once


def _error(message: str) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text=" ".join(message.split())[:2000])],
                                is_error=True)


def _result(name: str, result: dict) -> types.CallToolResult:
    text = result["answer"] if name == "ask" else json.dumps(result, ensure_ascii=False)
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)], structured_content=result)


def model_thread() -> ThreadPoolExecutor:
    """The one thread that loads and runs the model: MLX arrays belong to the thread whose stream
    made them, so the model is loaded where it runs (`model_thread().submit(load, path).result()`)."""
    return ThreadPoolExecutor(1, thread_name_prefix="mlx_qwen3vl-mcp-model")


PREPARE_WORKERS = 2  # calls whose arguments and screenshots are read at once (off the model's thread)


def create_server(model, processor, settings: Settings, *, worker: ThreadPoolExecutor,
                  max_queue: int = DEFAULT_MAX_QUEUE) -> Server:
    """An MCP Server (not yet running) serving ground / next_action / ask on (model, processor).
    A call takes a place in the queue first (at most `max_queue` wait: past it, a busy error before
    anything is read), then is prepared on a small pool (arguments, the screenshot under the call's
    media budget: tools.prepare) and answered on `worker`, the model's thread (model_thread), one
    at a time."""
    waiting = [0]
    lock = threading.Lock()
    prepare_pool = ThreadPoolExecutor(PREPARE_WORKERS, thread_name_prefix="mlx_qwen3vl-mcp-prepare")
    tools = [types.Tool(name=d["name"], description=d["description"], input_schema=d["inputSchema"])
             for d in TOOL_DECLARATIONS]

    async def list_tools(ctx, params) -> types.ListToolsResult:
        return types.ListToolsResult(tools=tools)

    def leave(place):
        """The call stops waiting (it starts on the model's thread, fails or is cancelled): once."""
        with lock:
            if place:
                place.pop()
                waiting[0] -= 1

    def run(call, place):
        leave(place)
        return answer(model, processor, settings, call)

    async def admitted(name, args):
        """The call's prepared form, then its answer on the model's thread (its place held until
        it starts, or until it ends unstarted: failed, or cancelled by its client)."""
        place = [True]
        try:
            call = await asyncio.get_running_loop().run_in_executor(prepare_pool, prepare, name, processor,
                                                                    settings, args)
            return await asyncio.wrap_future(worker.submit(run, call, place))
        finally:
            leave(place)

    async def call_tool(ctx, params: types.CallToolRequestParams) -> types.CallToolResult:
        if params.name not in TOOLS:
            return _error(f"unknown tool {params.name[:80]!r}; this server has {', '.join(TOOLS)}")
        with lock:
            if waiting[0] >= max_queue:
                return _error(f"the server is busy ({max_queue} calls are waiting for the model); retry shortly")
            waiting[0] += 1
        try:
            result = await admitted(params.name, params.arguments or {})
        except RuntimeError as e:
            if "shutdown" not in str(e):  # a pool shutting down refuses new work with this
                print(f"[mlx_qwen3vl.mcp] {params.name} failed: RuntimeError: {e}", file=sys.stderr, flush=True)
                return _error(f"{params.name}: internal error (RuntimeError)")
            return _error("the server is shutting down")
        except Qwen3VLError as e:
            return _error(f"{params.name}: {e}")
        except Exception as e:  # noqa: BLE001 — one line to the client; the details stay on this side
            print(f"[mlx_qwen3vl.mcp] {params.name} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            return _error(f"{params.name}: internal error ({type(e).__name__})")
        return _result(params.name, result)

    server = Server("mlx_qwen3vl", version=__version__,
                    instructions="Local Qwen3-VL / UI-Venus GUI grounding: ground an element, choose the next "
                                 "action, or ask about a screenshot.",
                    on_list_tools=list_tools, on_call_tool=call_tool)
    return server


class BearerKey:
    """With an API key, every HTTP request must carry `Authorization: Bearer KEY` (as the HTTP
    server's rule: then any Host is served, and the key does the protecting)."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode("latin-1"), self.key):
                body = {"error": {"message": "missing or wrong API key; send 'Authorization: Bearer <key>'",
                                  "type": "authentication_error", "param": None, "code": "invalid_api_key"}}
                return await JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})(
                    scope, receive, send)
        await self.app(scope, receive, send)


class SessionCaps:
    """Streamable-HTTP sessions per client address: a request that would open another session
    (POST without Mcp-Session-Id) while the client already holds `per_client` (open or being
    opened) gets 503, so a flood from one address is refused to that address while the SDK's
    overall cap (`max_sessions`, which no single client can fill) still admits everyone else.
    A session counts until the SDK forgets it (DELETE, its idle timeout, a failed opening)."""

    def __init__(self, app, manager, *, per_client: int, idle_timeout_s: float):
        self.app, self.manager, self.per_client, self.idle_timeout_s = app, manager, per_client, idle_timeout_s
        self.sessions = {}  # session id → [client, last request's time]
        self.opening = {}  # client → sessions being opened now

    def _alive(self, sid, now) -> bool:
        live = getattr(self.manager, "_server_instances", None)  # the SDK's own table, where it has one
        if live is not None:
            return sid in live
        return now - self.sessions[sid][1] < self.idle_timeout_s

    def held(self, client) -> int:
        now = time.monotonic()
        for sid in [sid for sid in self.sessions if not self._alive(sid, now)]:
            del self.sessions[sid]
        return sum(1 for c, _ in self.sessions.values() if c == client) + self.opening.get(client, 0)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        sid = dict(scope["headers"]).get(b"mcp-session-id")
        if sid is not None:
            entry = self.sessions.get(sid.decode("latin-1"))
            if entry is not None:
                entry[1] = time.monotonic()
            return await self.app(scope, receive, send)
        if scope["method"] != "POST":
            return await self.app(scope, receive, send)
        client = (scope.get("client") or ("?", 0))[0]
        if self.held(client) >= self.per_client:
            message = (f"this client already holds {self.per_client} MCP sessions (--max-sessions-per-client); "
                       "reuse one, end one (DELETE), or wait for one to idle out")
            body = {"jsonrpc": "2.0", "id": None, "error": {"code": -32000, "message": message}}
            return await JSONResponse(body, status_code=503, headers={"Retry-After": "10"})(scope, receive, send)
        self.opening[client] = self.opening.get(client, 0) + 1

        async def sent(message):
            if message["type"] == "http.response.start" and message["status"] < 400:
                for name, value in message.get("headers", []):
                    if name.lower() == b"mcp-session-id":
                        self.sessions[value.decode("latin-1")] = [client, time.monotonic()]
            await send(message)

        try:
            await self.app(scope, receive, sent)
        finally:
            self.opening[client] -= 1
            if not self.opening[client]:
                del self.opening[client]


def http_app(server: Server, *, api_key=None, bound_host=None, max_body_bytes: int = 64 << 20, path: str = "/mcp",
             max_sessions: int = DEFAULT_MAX_SESSIONS, max_sessions_per_client: int = DEFAULT_MAX_SESSIONS_PER_CLIENT,
             session_idle_timeout_s: float = DEFAULT_SESSION_IDLE_TIMEOUT_S):
    """The streamable-HTTP ASGI app at `path`: the key rule (or, with no key, the local-only Host and
    Origin rule), then the session caps, then the SDK's transport with its body limit (413 past
    it), its overall session cap and idle timeout."""
    app = server.streamable_http_app(
        streamable_http_path=path, max_request_body_size=max_body_bytes, max_sessions=max_sessions,
        session_idle_timeout=session_idle_timeout_s,
        # Host / Origin are checked by the guard below, by the HTTP server's rule
        transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False))
    manager = getattr(server, "session_manager", None)
    app = SessionCaps(app, manager, per_client=max_sessions_per_client, idle_timeout_s=session_idle_timeout_s)
    return BearerKey(app, api_key) if api_key else LocalOnly(app, bound_host=bound_host)


async def serve_stdio(server: Server):
    from mcp.server.stdio import stdio_server

    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())
