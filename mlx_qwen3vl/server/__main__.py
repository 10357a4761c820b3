"""python -m mlx_qwen3vl.server --model PATH|HUB_ID [--host 127.0.0.1] [--port 8080] ..."""

import argparse
import os
import sys
import traceback

GB = 1 << 30
KEY_ENV = "MLX_QWEN3VL_API_KEY"


class _Help(argparse.HelpFormatter):
    """Every option's help ends with its default (or says it itself)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if not action.option_strings or "(default" in text or "(required" in text or action.default is argparse.SUPPRESS:
            return text
        default = action.default
        shown = "off" if default is False else "none" if default in (None, []) else "%(default)s"
        return f"{text} (default: {shown})"


def _positive(kind):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not value > 0 or value != value or value == float("inf"):
            raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
        return value

    parse.__name__ = kind.__name__
    return parse


def build_parser():
    from .limits import (DEFAULT_BODY_TIMEOUT_S, DEFAULT_GRAMMAR_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S,
                         DEFAULT_KEEP_ALIVE_TIMEOUT_S, DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_REQUEST_PIXELS,
                         DEFAULT_MAX_VIDEO_FRAMES)
    from ..media_access import DEFAULT_MAX_REQUEST_MEDIA_BYTES, DEFAULT_REQUEST_MEDIA_TIMEOUT_S

    p = argparse.ArgumentParser(prog="python -m mlx_qwen3vl.server", formatter_class=_Help,
                                description="Qwen3-VL behind OpenAI chat completions and Responses, and Anthropic Messages.")
    p.add_argument("--model", required=True, help="local checkpoint folder or Hugging Face repo id (required)")
    p.add_argument("--served-model-name", default=None, help="the id /v1/models reports (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080, help="port to bind")
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' (default: ${KEY_ENV} if set, else no key: then only "
                        "requests naming this machine as Host, and no cross-origin ones, are served)")
    p.add_argument("--no-ui", action="store_true", help="do not serve the playground page at /")
    p.add_argument("--max-body-bytes", type=_positive(int), default=64 << 20, help="request size limit in bytes")
    p.add_argument("--cors-allow-origin", action="append", default=[], metavar="ORIGIN",
                   help="allow browser requests from ORIGIN (repeatable; '*' for any)")
    p.add_argument("--allowed-local-media-path", action="append", default=[], metavar="DIR",
                   help="serve file:// image/video URLs from under DIR (repeatable)")
    p.add_argument("--no-http-media", action="store_true", help="refuse http(s) image/video URLs")
    p.add_argument("--allow-media-host", action="append", default=[], metavar="HOST|CIDR",
                   help="also fetch http(s) media from this host name, address or network (repeatable); by "
                        "default loopback, private, link-local, multicast and reserved addresses are refused")
    p.add_argument("--media-timeout", type=_positive(float), default=10.0,
                   help="seconds for the whole fetch of one http(s) URL (DNS, connect, redirects, every byte)")
    p.add_argument("--max-media-bytes", type=_positive(int), default=64 << 20, help="size cap of one fetched URL")
    p.add_argument("--max-media-fetches", type=_positive(int), default=8,
                   help="http(s) fetches in flight at once; a request needing another gets 503")
    p.add_argument("--max-request-media-bytes", type=_positive(int), default=DEFAULT_MAX_REQUEST_MEDIA_BYTES,
                   help="bytes all of one request's media may come to together (fetched, read and data URLs); "
                        "reading stops at the first byte over (413)")
    p.add_argument("--request-media-timeout", type=_positive(float), default=DEFAULT_REQUEST_MEDIA_TIMEOUT_S,
                   help="seconds all of one request's media may take together (every fetch and read)")
    p.add_argument("--max-request-pixels", type=_positive(int), default=DEFAULT_MAX_REQUEST_PIXELS,
                   help="pixels one request may bring: each image as stored, and all images as resized plus "
                        "sampled video frames as decoded; a request's min_pixels / max_pixels may not exceed it")
    p.add_argument("--max-video-frames", type=_positive(int), default=DEFAULT_MAX_VIDEO_FRAMES,
                   help="frames one video may hold, and all of a request's videos together (from their headers, "
                        "before decoding)")
    p.add_argument("--grammar-timeout", type=_positive(float), default=DEFAULT_GRAMMAR_TIMEOUT_S,
                   help="seconds a json_schema or forced tool call may take to compile")
    p.add_argument("--max-connections", type=_positive(int), default=DEFAULT_MAX_CONNECTIONS,
                   help="open connections; more are answered 503 and closed")
    p.add_argument("--header-timeout", type=_positive(float), default=DEFAULT_HEADER_TIMEOUT_S,
                   help="seconds for a request's headers to arrive (the first from the connection's start)")
    p.add_argument("--body-timeout", type=_positive(float), default=DEFAULT_BODY_TIMEOUT_S,
                   help="seconds for a request's body to arrive after its headers")
    p.add_argument("--keep-alive-timeout", type=_positive(float), default=DEFAULT_KEEP_ALIVE_TIMEOUT_S,
                   help="seconds an idle connection stays open between requests")
    p.add_argument("--max-batch", type=_positive(int), default=8, help="requests decoded together")
    p.add_argument("--max-queue", type=_positive(int), default=64, help="waiting requests before answering 503")
    p.add_argument("--max-tokens", type=_positive(int), default=512,
                   help="default answer limit when a request sets none")
    p.add_argument("--agent-format", choices=["qwen", "venus"], default="qwen",
                   help="the trained prompt a request declaring a computer-use tool is rendered with: Qwen3-VL's "
                        "computer_use prompt (qwen) or UI-Venus-1.5's navigation prompt (venus)")
    p.add_argument("--responses-store", type=int, default=256, metavar="N",
                   help="recent /v1/responses answers kept for previous_response_id (0: none)")
    p.add_argument("--responses-store-mb", type=_positive(float), default=256.0,
                   help="memory those kept responses' conversations may take (least recently used out first)")
    p.add_argument("--agent-history", type=int, default=None, metavar="N",
                   help="earlier steps a computer-use prompt replays (default: the format's own, 4 for qwen with "
                        "their screenshots, 5 for venus); with more, a long loop's prompts keep extending the last "
                        "one, so the prefix cache serves each turn's history")
    p.add_argument("--computer-answers", type=int, default=1024, metavar="N",
                   help="computer-use answers kept by the ids of the calls they became, so a replayed call is "
                        "shown to the model as it wrote it (0: none)")
    p.add_argument("--computer-answers-mb", type=_positive(float), default=16.0,
                   help="memory those kept answers may take (least recently used out first)")
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
    p.add_argument("--kv-bits", type=int, default=None, choices=[4, 8],
                   help="store the KV cache quantized to 4 or 8 bits once it holds --quantized-kv-start positions "
                        "(mlx-lm's kv_bits); a request may set kv_bits / kv_group_size / quantized_kv_start itself "
                        "(extra_body); none = float")
    p.add_argument("--kv-group-size", type=int, default=64, choices=[32, 64, 128],
                   help="quantization group size of the KV cache; one that does not divide the model's head "
                        "dimension is chosen down")
    p.add_argument("--quantized-kv-start", type=int, default=5000, metavar="N",
                   help="cache length at which the KV cache is quantized (mlx-lm's default)")
    p.add_argument("--prefix-cache-dir", default=None, metavar="DIR",
                   help="keep cached KV prefixes in DIR too (created private to this user), so a restarted server's "
                        "first turn of a known conversation reuses its history; one process only")
    p.add_argument("--prefix-cache-dir-gb", type=_positive(float), default=8.0,
                   help="disk budget of --prefix-cache-dir; the least recently used entries go first")
    p.add_argument("--draft-model", default=None, metavar="PATH",
                   help="speculative decoding by a smaller checkpoint with the same tokenizer (e.g. the 2B for the "
                        "8B), prefilling each request's prompt and media itself; lossless (answers unchanged)")
    p.add_argument("--prompt-lookup", type=int, default=0, metavar="N",
                   help="speculative decoding from the prompt: draft what followed the longest n-gram (n from N "
                        "down to 1) the prompt and answer hold; a request may set prompt_lookup itself; 0 = off")
    p.add_argument("--num-draft-tokens", type=int, default=None, metavar="K",
                   help="draft tokens checked per step (default 4); a request may set num_draft_tokens itself")
    p.add_argument("--max-request-seconds", type=float, default=600.0,
                   help="a request still generating after this many seconds ends with finish_reason "
                        "'time_limit' (0: no limit)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="compute dtype (default: float32 on the CPU, the checkpoint's on a GPU)")
    p.add_argument("--parallel", choices=["tensor", "pipeline"], default="tensor",
                   help="under mlx.launch: split every layer over the ranks (tensor) or give each rank "
                        "a range of layers (pipeline); ignored in one process")
    p.add_argument("--blas-threads", default="1", metavar="auto|N",
                   help="BLAS (MKL / OpenBLAS) threads; with the HTTP and model threads beside it, spinning "
                        "BLAS threads slowed decode up to 100x on a busy 2-core machine; auto: the CPU path's "
                        "policy (every core while no other process wants them)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level")
    return p


def _api_key(args):
    """The key from --api-key or the environment; an empty or blank one is an error, not 'no key'."""
    if args.api_key is not None:
        key, name = args.api_key, "--api-key"
    elif os.environ.get(KEY_ENV) is not None:
        key, name = os.environ[KEY_ENV], f"${KEY_ENV}"
    else:
        return None, None
    if not key:
        return None, f"{name} is empty; pass a key, or leave it out to serve this machine only without one"
    if not (key.isascii() and key.isprintable()) or " " in key:
        return None, f"{name} must be printable ASCII without spaces (it is compared with the Bearer token)"
    return key, None


BLAS_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")  # what tests set for in-process references


def main(argv=None):
    args = build_parser().parse_args(argv)
    api_key, problem = _api_key(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        import uvicorn  # noqa: F401

        from .. import load
        from ..engine.core import auto_kv_budget, kv_bytes_per_token, weight_bytes
        from ..engine.draft_model import DraftModel
        from ..engine.drafting import drafting
        from ..errors import InputError, Qwen3VLError
        from ..hub import resolve_model_path
        from . import build_server
        from .connections import bind, check_file_limit, serve
        from .fetch import MediaPolicy, check_allowed_hosts
        from .limits import Limits
    except ImportError as e:
        print(f"error: {e.name} is missing; install the server extra: pip install 'mlx-qwen3vl[server]'",
              file=sys.stderr)
        return 2
    for flag, value, ok in (("--prefill-budget", args.prefill_budget, args.prefill_budget >= 0),
                            ("--responses-store", args.responses_store, args.responses_store >= 0),
                            ("--computer-answers", args.computer_answers, args.computer_answers >= 0),
                            ("--agent-history", args.agent_history, args.agent_history is None or args.agent_history >= 0),
                            ("--max-request-seconds", args.max_request_seconds, args.max_request_seconds >= 0),
                            ("--kv-cache-gb", args.kv_cache_gb, args.kv_cache_gb is None or args.kv_cache_gb > 0)):
        if not ok:
            print(f"error: {flag} {value} is not allowed; use a number >= 0 (> 0 for --kv-cache-gb)", file=sys.stderr)
            return 2
    if args.quantized_kv_start < 0:
        print(f"error: --quantized-kv-start {args.quantized_kv_start} is not allowed; use an integer >= 0",
              file=sys.stderr)
        return 2
    if args.prefix_cache_dir is not None and not args.prefix_cache_gb > 0:
        print("error: --prefix-cache-dir needs the in-memory prefix cache too (--prefix-cache-gb > 0)", file=sys.stderr)
        return 2
    for d in args.allowed_local_media_path:
        if not os.path.isdir(d):
            print(f"error: --allowed-local-media-path {d!r} is not a directory", file=sys.stderr)
            return 2
    bad = check_allowed_hosts(args.allow_media_host)
    if bad is not None:
        print(f"error: --allow-media-host {bad!r} is not a host name, an address or a network (CIDR)", file=sys.stderr)
        return 2
    from .. import distributed

    group = distributed.world()  # under `mlx.launch -n N`: rank 0 serves, every rank computes
    if group is not None and args.prefix_cache_dir is not None:
        if group.rank() == 0:
            print("error: --prefix-cache-dir is not available under mlx.launch (every rank would have to hold the same "
                  "entries of its own part of the cache); leave it out", file=sys.stderr)
        return 2
    sock = None
    if group is None or group.rank() == 0:  # the port first: a busy one is said before the model loads
        sock, problem = bind(args.host, args.port)
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
    try:
        from ..cpu import threads

        threads.configure(args.blas_threads, "--blas-threads")  # set at run time: no restart needed
        drafting(prompt_lookup=args.prompt_lookup, num_draft_tokens=args.num_draft_tokens)  # before any load
        if args.draft_model and args.prompt_lookup:
            raise InputError("--draft-model and --prompt-lookup were both given; drafts come from one of them")
        draft_path = resolve_model_path(args.draft_model, "--draft-model") if args.draft_model else None
        path = resolve_model_path(args.model, "--model")
        model, processor = load(path, dtype=args.dtype, parallel=args.parallel)
        drafts = drafting(prompt_lookup=args.prompt_lookup, num_draft_tokens=args.num_draft_tokens)
        kv_cache = "auto"
        if draft_path is not None:
            draft = DraftModel.of(load(draft_path, dtype=args.dtype, parallel=args.parallel))
            draft.check(model, processor.tokenizer)
            # its prefix cache holds as many positions as the model's; its weights leave less for KV caches
            draft.prefix.max_bytes = int(args.prefix_cache_gb * GB * kv_bytes_per_token(draft.model)
                                         / kv_bytes_per_token(model))
            kv_cache = max(0, auto_kv_budget(model) - weight_bytes(draft.model))
            drafts = drafting(draft_model=draft, num_draft_tokens=args.num_draft_tokens)
    except Qwen3VLError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    engine_kwargs = dict(max_batch=args.max_batch, max_queue=args.max_queue, default_max_tokens=args.max_tokens,
                         prefix_cache_bytes=int(args.prefix_cache_gb * GB),
                         feature_cache_bytes=int(args.vision_cache_gb * GB), prefill_step_size=args.prefill_step_size,
                         prefill_budget=args.prefill_budget,
                         kv_cache_bytes=kv_cache if args.kv_cache_gb is None else int(args.kv_cache_gb * GB),
                         max_request_seconds=args.max_request_seconds or None, kv_bits=args.kv_bits,
                         kv_group_size=args.kv_group_size, quantized_kv_start=args.quantized_kv_start, drafting=drafts)
    if args.prefix_cache_dir is not None:
        engine_kwargs.update(prefix_cache_dir=args.prefix_cache_dir,
                             prefix_cache_dir_bytes=int(args.prefix_cache_dir_gb * GB))
    where = ""
    if group is not None:
        import signal

        from .replica import Leader

        if group.rank() != 0:
            return _follow(model, processor, group, engine_kwargs)
        processor = processor.local  # the HTTP side reads media here, for every rank
        engine_kwargs["replicas"] = Leader(group)
        where = f" (rank 0 of {group.size()}, pid {os.getpid()}, {args.parallel} parallel)"
    problem = check_file_limit(args.max_connections)  # after load: mlx-lm lowers the limit when imported
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    policy = MediaPolicy(allow_http=not args.no_http_media, http_timeout_s=args.media_timeout,
                         max_media_bytes=args.max_media_bytes, allowed_local_paths=args.allowed_local_media_path,
                         allowed_hosts=args.allow_media_host, max_fetches=args.max_media_fetches,
                         max_request_media_bytes=args.max_request_media_bytes,
                         request_media_timeout_s=args.request_media_timeout)
    limits = Limits(max_request_pixels=args.max_request_pixels, max_video_frames=args.max_video_frames)
    try:
        app, engine = build_server(
            model, processor, model_id=args.served_model_name or args.model, api_key=api_key,
            max_body_bytes=args.max_body_bytes, cors_origins=args.cors_allow_origin, media_policy=policy,
            limits=limits, grammar_timeout_s=args.grammar_timeout, bound_host=args.host, ui=not args.no_ui,
            agent_format=args.agent_format, responses_store=args.responses_store,
            responses_store_bytes=int(args.responses_store_mb * (1 << 20)), computer_answers=args.computer_answers, agent_history=args.agent_history,
            computer_answers_bytes=int(args.computer_answers_mb * (1 << 20)), **engine_kwargs)
    except Qwen3VLError as e:  # e.g. a --prefix-cache-dir of another user, a KV group size the model cannot take
        print(f"error: {e}", file=sys.stderr)
        return 2
    port = sock.getsockname()[1]  # --port 0: the one the system chose
    print(f"[mlx_qwen3vl] serving {args.model} on http://{args.host}:{port}/v1{where}"
          + ("" if args.no_ui else f"; playground: http://{args.host}:{port}/"), file=sys.stderr, flush=True)
    run = dict(sock=sock, log_level=args.log_level, max_connections=args.max_connections,
               header_timeout=args.header_timeout, body_timeout=args.body_timeout,
               keep_alive_timeout=args.keep_alive_timeout, on_stop=app.state.stop)
    if group is None:
        try:
            serve(app, **run)  # returns once SIGTERM / SIGINT has stopped it: a success
        finally:
            engine.close()  # joins the model thread (its last disk-tier writes), as the rank's below
        _leave(0)  # MLX's teardown sometimes aborted here too (status -6 after a clean SIGINT stop, 1 CI run in 4)

    # Stopped on request (Ctrl-C, SIGTERM) is a success (serve returns); these handlers cover a
    # signal outside serve: a rank dying of it would make mlx.launch report a failure and kill the
    # other ranks while they end on their own.
    def stopped(sig, frame):
        raise SystemExit(0)

    signal.signal(signal.SIGINT, stopped)
    signal.signal(signal.SIGTERM, stopped)
    status = 1
    try:
        serve(app, **run)
        status = 0
    except SystemExit as e:  # the signal above (0), or uvicorn's own exit (1: the port was taken)
        status = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    finally:
        engine.close()  # tells the other ranks to stop (even if the port was taken) and joins the model thread
    _leave(status)


def _leave(status):
    """End the process at once, once its model thread has ended (on a rank of several, no
    collective is then in flight): the interpreter's own teardown destroys MLX's runtime (streams,
    and a rank's distributed group) with its threads still joinable on some runs ("terminate
    called without an active exception", status -6), and a rank's can wait on ranks that are
    leaving too."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _follow(model, processor, group, engine_kwargs):
    """A rank other than 0: no HTTP; run the iterations rank 0 sends until it stops."""
    import signal

    from .model_thread import ModelThread
    from .grammar import GrammarFactory
    from .replica import Follower

    # Ctrl-C (and a service manager's SIGTERM) reaches every rank: this one ends when rank 0, shutting
    # down, says so; ending at once would leave rank 0's last messages nobody to go to.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    tok = processor.tokenizer
    grammars = GrammarFactory(tok, model.config.text_config.vocab_size, tok.eos_token_id)
    engine = ModelThread(model, processor, replicas=Follower(group, grammars), **engine_kwargs)
    print(f"[mlx_qwen3vl] rank {group.rank()} of {group.size()} (pid {os.getpid()}): running rank 0's requests",
          file=sys.stderr, flush=True)
    engine.join()
    print(f"[mlx_qwen3vl] rank {group.rank()} of {group.size()}: rank 0 stopped serving; exiting", file=sys.stderr,
          flush=True)
    _leave(0)


if __name__ == "__main__":
    sys.exit(main())
