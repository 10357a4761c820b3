"""python -m mlx_qwen3vl.server --model PATH|HUB_ID [--host 127.0.0.1] [--port 8080] ..."""

import argparse
import os
import sys
import traceback

GB = 1 << 30


def build_parser():
    p = argparse.ArgumentParser(prog="python -m mlx_qwen3vl.server",
                                description="OpenAI-compatible chat-completions server for Qwen3-VL.")
    p.add_argument("--model", required=True, help="local checkpoint folder or Hugging Face repo id")
    p.add_argument("--served-model-name", default=None, help="the id /v1/models reports (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--api-key", default=os.environ.get("MLX_QWEN3VL_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $MLX_QWEN3VL_API_KEY, else no key)")
    p.add_argument("--max-body-bytes", type=int, default=64 << 20, help="request size limit (default 64 MiB)")
    p.add_argument("--cors-allow-origin", action="append", default=[], metavar="ORIGIN",
                   help="allow browser requests from ORIGIN (repeatable; '*' for any); CORS is off by default")
    p.add_argument("--allowed-local-media-path", action="append", default=[], metavar="DIR",
                   help="serve file:// image/video URLs from under DIR (repeatable); off by default")
    p.add_argument("--no-http-media", action="store_true", help="refuse http(s) image/video URLs")
    p.add_argument("--media-timeout", type=float, default=10.0, help="seconds to fetch one http(s) URL")
    p.add_argument("--max-media-bytes", type=int, default=64 << 20, help="size cap of one fetched URL")
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded together")
    p.add_argument("--max-queue", type=int, default=64, help="waiting requests before answering 503")
    p.add_argument("--max-tokens", type=int, default=512, help="default answer limit when a request sets none")
    p.add_argument("--prefix-cache-gb", type=float, default=2.0, help="memory for cached KV prefixes")
    p.add_argument("--vision-cache-gb", type=float, default=0.5, help="memory for cached vision features")
    p.add_argument("--prefill-step-size", type=int, default=2048, help="most prompt tokens per decoder chunk")
    p.add_argument("--prefill-budget", type=int, default=256, metavar="TOKENS",
                   help="prefill work per decode step while requests decode, in prompt tokens (vision work "
                        "counted by its FLOPs), so running streams keep getting tokens while a new screenshot "
                        "is encoded; 0: prefill each request whole before decoding on")
    p.add_argument("--kv-cache-gb", type=float, default=None,
                   help="KV cache the running requests may take; a request waits until it fits, one that never "
                        "can is refused (default: 3/4 of the memory less the weights)")
    p.add_argument("--max-request-seconds", type=float, default=600.0,
                   help="a request still generating after this many seconds ends with finish_reason "
                        "'time_limit' (default 600; 0: no limit)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None)
    p.add_argument("--parallel", choices=["tensor", "pipeline"], default="tensor",
                   help="under mlx.launch: split every layer over the ranks (tensor, default) or give each rank "
                        "a range of layers (pipeline); ignored in one process")
    p.add_argument("--blas-threads", default="1", metavar="auto|N",
                   help="BLAS (MKL / OpenBLAS) threads; 1 by default: with the HTTP and model threads "
                        "beside it, spinning BLAS threads slowed decode up to 100x on a busy 2-core machine; "
                        "auto: the CPU path's policy (every core while no other process wants them)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return p


BLAS_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")  # what tests set for in-process references


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        import uvicorn

        from .. import load
        from ..errors import Qwen3VLError
        from . import build_server
        from .fetch import MediaPolicy
    except ImportError as e:
        print(f"error: {e.name} is missing; install the server extra: pip install 'mlx-qwen3vl[server]'",
              file=sys.stderr)
        return 2
    for flag, value, ok in (("--prefill-budget", args.prefill_budget, args.prefill_budget >= 0),
                            ("--max-request-seconds", args.max_request_seconds, args.max_request_seconds >= 0),
                            ("--kv-cache-gb", args.kv_cache_gb, args.kv_cache_gb is None or args.kv_cache_gb > 0)):
        if not ok:
            print(f"error: {flag} {value} is not allowed; use a number >= 0 (> 0 for --kv-cache-gb)", file=sys.stderr)
            return 2
    for d in args.allowed_local_media_path:
        if not os.path.isdir(d):
            print(f"error: --allowed-local-media-path {d!r} is not a directory", file=sys.stderr)
            return 2
    from .. import distributed

    group = distributed.world()  # under `mlx.launch -n N`: rank 0 serves, every rank computes
    try:
        from ..cpu import threads

        threads.configure(args.blas_threads, "--blas-threads")  # set at run time: no restart needed
        model, processor = load(args.model, dtype=args.dtype, parallel=args.parallel)
    except Qwen3VLError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    engine_kwargs = dict(max_batch=args.max_batch, max_queue=args.max_queue, default_max_tokens=args.max_tokens,
                         prefix_cache_bytes=int(args.prefix_cache_gb * GB),
                         feature_cache_bytes=int(args.vision_cache_gb * GB), prefill_step_size=args.prefill_step_size,
                         prefill_budget=args.prefill_budget,
                         kv_cache_bytes="auto" if args.kv_cache_gb is None else int(args.kv_cache_gb * GB),
                         max_request_seconds=args.max_request_seconds or None)
    where = ""
    if group is not None:
        import signal

        from .replica import Leader

        if group.rank() != 0:
            return _follow(model, processor, group, engine_kwargs)
        processor = processor.local  # the HTTP side reads media here, for every rank
        engine_kwargs["replicas"] = Leader(group)
        where = f" (rank 0 of {group.size()}, pid {os.getpid()}, {args.parallel} parallel)"
    policy = MediaPolicy(allow_http=not args.no_http_media, http_timeout_s=args.media_timeout,
                         max_media_bytes=args.max_media_bytes, allowed_local_paths=args.allowed_local_media_path)
    app, engine = build_server(
        model, processor, model_id=args.served_model_name or args.model, api_key=args.api_key,
        max_body_bytes=args.max_body_bytes, cors_origins=args.cors_allow_origin, media_policy=policy,
        **engine_kwargs)
    print(f"[mlx_qwen3vl] serving {args.model} on http://{args.host}:{args.port}/v1{where}", file=sys.stderr,
          flush=True)
    if group is None:
        try:
            uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
        finally:
            engine.close()
        return 0

    # Stopped on request (Ctrl-C, SIGTERM) is a success: uvicorn re-raises the signal after its
    # graceful shutdown, and a rank dying of it would make mlx.launch report a failure and kill the
    # other ranks while they end on their own.
    def stopped(sig, frame):
        raise SystemExit(0)

    signal.signal(signal.SIGINT, stopped)
    signal.signal(signal.SIGTERM, stopped)
    status = 1
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
        status = 0
    except SystemExit as e:  # the signal above (0), or uvicorn's own exit (1: the port was taken)
        status = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    finally:
        engine.close()  # tells the other ranks to stop (even if the port was taken) and joins the model thread
    _leave(status)


def _leave(status):
    """End a rank of several at once, once its model thread has ended (no collective is then in
    flight): the interpreter's own teardown destroys MLX's distributed runtime with its threads
    still joinable on some runs ("terminate called without an active exception", status -6),
    and can wait on ranks that are leaving too."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _follow(model, processor, group, engine_kwargs):
    """A rank other than 0: no HTTP; run the iterations rank 0 sends until it stops."""
    import signal

    from .engine import Engine
    from .grammar import GrammarFactory
    from .replica import Follower

    # Ctrl-C (and a service manager's SIGTERM) reaches every rank: this one ends when rank 0, shutting
    # down, says so; ending at once would leave rank 0's last messages nobody to go to.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    tok = processor.tokenizer
    grammars = GrammarFactory(tok, model.config.text_config.vocab_size, tok.eos_token_id)
    engine = Engine(model, processor, replicas=Follower(group, grammars), **engine_kwargs)
    print(f"[mlx_qwen3vl] rank {group.rank()} of {group.size()} (pid {os.getpid()}): running rank 0's requests",
          file=sys.stderr, flush=True)
    engine.join()
    print(f"[mlx_qwen3vl] rank {group.rank()} of {group.size()}: rank 0 stopped serving; exiting", file=sys.stderr,
          flush=True)
    _leave(0)


if __name__ == "__main__":
    sys.exit(main())
