"""The MCP protocol around tools.py, with the official SDK's low-level Server: tools/list answers
the hand-written declarations, tools/call checks and runs a tool on the one model thread, and every
failure is a tool error of one line. Transports: stdio, and streamable HTTP behind the HTTP
server's rules (a Bearer key when one is set; without one, only this machine's Host names and no
foreign Origin), its body limit and its connection guards."""

import asyncio
import hmac
import json
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import mcp_types as types
from mcp.server.lowlevel import Server
from mcp.server.transport_security import TransportSecuritySettings
from starlette.responses import JSONResponse

from .. import __version__
from ..errors import Qwen3VLError
from ..server.app import LocalOnly
from .tools import TOOL_DECLARATIONS, TOOLS, Settings

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


def create_server(model, processor, settings: Settings, *, worker: ThreadPoolExecutor,
                  max_queue: int = DEFAULT_MAX_QUEUE) -> Server:
    """An MCP Server (not yet running) serving ground / next_action / ask on (model, processor).
    Tool calls run one at a time on `worker`, the model's thread (model_thread); at most
    `max_queue` wait."""
    waiting = [0]
    lock = threading.Lock()
    tools = [types.Tool(name=d["name"], description=d["description"], input_schema=d["inputSchema"])
             for d in TOOL_DECLARATIONS]

    async def list_tools(ctx, params) -> types.ListToolsResult:
        return types.ListToolsResult(tools=tools)

    def run(fn, args):
        with lock:
            waiting[0] -= 1
        return fn(model, processor, settings, args)

    async def call_tool(ctx, params: types.CallToolRequestParams) -> types.CallToolResult:
        fn = TOOLS.get(params.name)
        if fn is None:
            return _error(f"unknown tool {params.name[:80]!r}; this server has {', '.join(TOOLS)}")
        with lock:
            if waiting[0] >= max_queue:
                return _error(f"the server is busy ({max_queue} calls are waiting for the model); retry shortly")
            waiting[0] += 1
        try:
            future = worker.submit(run, fn, params.arguments or {})
        except RuntimeError:  # the worker is shutting down
            with lock:
                waiting[0] -= 1
            return _error("the server is shutting down")
        try:
            result = await asyncio.wrap_future(future)
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


def http_app(server: Server, *, api_key=None, bound_host=None, max_body_bytes: int = 64 << 20, path: str = "/mcp"):
    """The streamable-HTTP ASGI app at `path`: the key rule (or, with no key, the local-only Host and
    Origin rule), then the SDK's transport with its body limit (413 past it)."""
    app = server.streamable_http_app(
        streamable_http_path=path, max_request_body_size=max_body_bytes,
        # Host / Origin are checked by the guard below, by the HTTP server's rule
        transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False))
    return BearerKey(app, api_key) if api_key else LocalOnly(app, bound_host=bound_host)


async def serve_stdio(server: Server):
    from mcp.server.stdio import stdio_server

    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())
