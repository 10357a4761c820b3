"""python -m mlx_qwen3vl.mcp --model PATH|HUB_ID [--transport stdio|http] [--host 127.0.0.1] [--port 8765] ..."""

import os
import signal
import sys

from ..cli import FLAGS, Parser

KEY_ENV = "MLX_QWEN3VL_API_KEY"  # the HTTP server's


def build_parser():
    from ..agent import GROUNDING_FORMATS
    from ..agent.computer_use import AGENT_FORMATS
    from ..media_access import DEFAULT_REQUEST_MEDIA_TIMEOUT_S
    from .tools import (DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_REQUEST_PIXELS, DEFAULT_MAX_SESSIONS,
                        DEFAULT_MAX_SESSIONS_PER_CLIENT, DEFAULT_SESSION_IDLE_TIMEOUT_S)

    p = Parser(prog="python -m mlx_qwen3vl.mcp",
               description="MCP server (stdio or streamable HTTP) with the tools ground, next_action and ask on a "
                           "local Qwen3-VL / UI-Venus model.")
    p.add_argument("--model", required=True, help="local checkpoint folder or Hugging Face repo id (required)")
    p.add_argument("--transport", choices=["stdio", "http"], default="stdio",
                   help="stdio (an MCP client starts the server) or streamable HTTP at http://HOST:PORT/mcp")
    p.add_argument("--host", default="127.0.0.1", help="http: address to bind (127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8765, help="http: port to bind")
    p.add_argument("--api-key", default=None,
                   help=f"http: require 'Authorization: Bearer KEY' (default: ${KEY_ENV} if set, else no key: then "
                        "only requests naming this machine as Host, and no cross-origin ones, are served)")
    p.add_argument("--max-body-bytes", type=int, default=64 << 20, help="http: request size limit in bytes")
    p.add_argument("--max-sessions", type=int, default=DEFAULT_MAX_SESSIONS,
                   help="http: MCP sessions open at once, in all (503 for a new one past it)")
    p.add_argument("--max-sessions-per-client", type=int, default=DEFAULT_MAX_SESSIONS_PER_CLIENT,
                   help="http: MCP sessions one client address may hold (503 to that address past it)")
    p.add_argument("--session-idle-timeout", type=float, default=DEFAULT_SESSION_IDLE_TIMEOUT_S,
                   help="http: seconds without a request after which a session is closed")
    p.add_argument("--agent-format", choices=AGENT_FORMATS, default="qwen",
                   help="next_action's trained prompt: Qwen3-VL computer use or UI-Venus navigation")
    p.add_argument("--ground-format", choices=GROUNDING_FORMATS, default="venus",
                   help="ground's trained prompt when a call names none (as python -m mlx_qwen3vl.ground's --format)")
    p.add_argument("--allowed-local-media-path", "--allowed-image-dir", dest="allowed_dirs", action="append",
                   default=[], metavar="DIR",
                   help="accept screenshots as paths (or file:// URLs) of files under DIR (repeatable; none by "
                        "default); --allowed-image-dir is the older spelling, still accepted")
    p.add_argument("--max-image-bytes", type=int, default=DEFAULT_MAX_IMAGE_BYTES, help="size cap of one screenshot")
    p.add_argument("--request-media-timeout", type=float, default=DEFAULT_REQUEST_MEDIA_TIMEOUT_S,
                   help="seconds one call's screenshot may take to read (as the HTTP server's flag)")
    p.add_argument("--max-request-pixels", type=int, default=DEFAULT_MAX_REQUEST_PIXELS,
                   help="pixels one screenshot may have, as stored and as resized for the model")
    p.add_argument("--max-queue", type=int, default=16, help="tool calls waiting for the model before refusing more")
    p.add_argument(FLAGS["max_tokens"], type=int, default=512, help="answer limit of next_action (qwen) and ask")
    p.add_argument(FLAGS["min_pixels"], type=int, default=None, help="screenshot pixel budget's floor (default: the "
                   "checkpoint's)")
    p.add_argument(FLAGS["max_pixels"], type=int, default=None,
                   help="screenshot pixel budget (default: the checkpoint's)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None)
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                   help="http: uvicorn's log level")
    return p


def _api_key(args):
    """(key or None, problem or None): an empty or blank key is an error, not "no key"."""
    key, name = (args.api_key, "--api-key") if args.api_key is not None else (os.environ.get(KEY_ENV), f"${KEY_ENV}")
    if key is not None and (not key or not (key.isascii() and key.isprintable()) or " " in key):
        return None, f"{name} must be a non-empty printable ASCII key without spaces"
    return key, None


def main(argv=None):
    args = build_parser().parse_args(argv)
    api_key, problem = _api_key(args)
    if problem:
        return _fail(problem)
    for flag, value in (("--max-body-bytes", args.max_body_bytes), ("--max-image-bytes", args.max_image_bytes),
                        ("--max-request-pixels", args.max_request_pixels), ("--max-queue", args.max_queue),
                        ("--max-sessions", args.max_sessions),
                        ("--max-sessions-per-client", args.max_sessions_per_client),
                        ("--session-idle-timeout", args.session_idle_timeout),
                        ("--request-media-timeout", args.request_media_timeout)):
        if value < 1:
            return _fail(f"{flag} must be at least 1")
    if not 1 <= args.port <= 65535:
        return _fail(f"--port must be from 1 to 65535; got {args.port}")
    for d in args.allowed_dirs:
        if not os.path.isdir(d):
            return _fail(f"--allowed-local-media-path {d!r} is not a directory")
    if args.max_pixels is not None and args.max_pixels > args.max_request_pixels:
        return _fail(f"--max-pixels {args.max_pixels} is over --max-request-pixels {args.max_request_pixels}")
    try:
        import anyio
        import mcp  # noqa: F401
    except ImportError as e:
        return _fail(f"{e.name} is missing; install the mcp extra: pip install 'mlx-qwen3vl[mcp]'")

    from .. import cli, load
    from ..hub import resolve_model_path
    from .server import create_server, http_app, model_thread, serve_stdio
    from .tools import Settings

    def body():
        path = resolve_model_path(args.model, "--model")
        cli.check_max_tokens(args.max_tokens)
        cli.check_media_flags(path, args.min_pixels, args.max_pixels)
        settings = Settings(agent_format=args.agent_format, ground_format=args.ground_format,
                            allowed_dirs=args.allowed_dirs, max_request_pixels=args.max_request_pixels,
                            max_image_bytes=args.max_image_bytes, min_pixels=args.min_pixels,
                            max_pixels=args.max_pixels, max_tokens=args.max_tokens,
                            media_timeout_s=args.request_media_timeout)
        sock = None
        if args.transport != "stdio":  # a busy port is said before the model loads
            from ..errors import InputError
            from ..server.connections import bind

            sock, problem = bind(args.host, args.port)
            if problem:
                raise InputError(problem)
        worker = model_thread()
        try:
            model, processor = worker.submit(load, path, dtype=args.dtype).result()
            server = create_server(model, processor, settings, worker=worker, max_queue=args.max_queue)
            if args.transport == "stdio":
                print(f"[mlx_qwen3vl.mcp] serving {args.model} over stdio", file=sys.stderr, flush=True)
                anyio.run(serve_stdio, server)
                return 0
            from ..server.connections import serve

            app = http_app(server, api_key=api_key, bound_host=args.host, max_body_bytes=args.max_body_bytes,
                           max_sessions=args.max_sessions, max_sessions_per_client=args.max_sessions_per_client,
                           session_idle_timeout_s=args.session_idle_timeout)

            def stopped(sig, frame):  # a signal before uvicorn's own handlers are in place: a clean stop too
                raise SystemExit(0)

            signal.signal(signal.SIGTERM, stopped)
            signal.signal(signal.SIGINT, stopped)
            print(f"[mlx_qwen3vl.mcp] serving {args.model} on http://{args.host}:{sock.getsockname()[1]}/mcp",
                  file=sys.stderr, flush=True)
            try:
                serve(app, sock=sock, log_level=args.log_level)
            except SystemExit as e:
                return e.code if isinstance(e.code, int) else 0
            return 0
        finally:
            worker.shutdown(wait=True, cancel_futures=True)  # the model thread ends before the interpreter does

    status = cli.run(body)
    # Stopped (SIGTERM, or stdin closed) and its model thread joined: end here, as the server's ranks
    # do (server/__main__.py _leave), since the interpreter's teardown of MLX after a model thread
    # sometimes aborts ("terminate called without an active exception", status 134) instead.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _fail(message):
    print(f"error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
