"""Command line: `python -m mlx_qwen3vl --model PATH|HUB_ID --prompt TEXT [--image P ...]`.

Bad input ends in one `error: ...` line on stderr and exit status 2; a run on good input prints
the answer on stdout and only the statistics lines on stderr.
"""

import argparse
import sys
from dataclasses import fields

from .cli import FLAGS, Parser, check_media_flags, run

DEFAULT_MODEL = "Qwen/Qwen3-VL-2B-Instruct"
DEFAULT_PROMPT = "Describe this image."


def _sampling_fields():
    from .sampling import SamplingParams

    return [f for f in fields(SamplingParams) if f.metadata.get("flag")]


def build_parser():
    p = Parser(prog="python -m mlx_qwen3vl", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                description="Generate text from images/videos and a prompt with Qwen3-VL.")
    p.add_argument("--model", default=DEFAULT_MODEL, help="local checkpoint folder or Hugging Face repo id")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="the user's text")
    p.add_argument("--image", nargs="+", default=[], help="image paths, URLs or data URLs")
    p.add_argument("--video", nargs="+", default=[], help="video files (needs the `video` extra)")
    p.add_argument("--system", default=None, help="system message")
    types = {"max_tokens": int, "top_k": int, "repetition_context_size": int, "seed": int,
             "presence_context_size": int, "frequency_context_size": int}
    for f in _sampling_fields():
        if f.name == "stop":
            p.add_argument(f.metadata["flag"], nargs="+", default=None, help=f.metadata["help"])
        elif f.type is bool:
            p.add_argument(f.metadata["flag"], dest=f.name, action="store_true", help=f.metadata["help"])
        else:
            p.add_argument(f.metadata["flag"], dest=f.name, type=types.get(f.name, float), default=f.default,
                           help=f.metadata["help"])
    p.add_argument(FLAGS["min_pixels"], type=int, default=None, help="smallest image area; none = the checkpoint's")
    p.add_argument(FLAGS["max_pixels"], type=int, default=None, help="largest image area; none = the checkpoint's")
    p.add_argument(FLAGS["video_fps"], type=float, default=None, help="source fps for videos given as frames")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="compute dtype; none = float32 on the CPU, the checkpoint's on a GPU")
    p.add_argument("--parallel", choices=["tensor", "pipeline"], default="tensor",
                   help="under mlx.launch: split every layer over the ranks (tensor) or the layers (pipeline)")
    p.add_argument("--prefill-step-size", type=int, default=2048, help="prompt tokens per prefill chunk")
    p.add_argument("--blas-threads", default=None, metavar="auto|N",
                   help="BLAS threads of the CPU path: auto (every core while no other process wants them, fewer "
                        "while others run) or a fixed N; none = $MLX_QWEN3VL_BLAS_THREADS, else auto")
    p.add_argument("--chat", action="store_true", help="interactive multi-turn chat with prefix reuse")
    p.add_argument("--verbose", action="store_true", help="print the backend (and BLAS) in use and the prompt")
    return p


def _print_stats(last, out=sys.stderr):
    if last is None:
        return
    print(f"\nPrompt: {last.prompt_tokens} tokens ({last.cached_tokens} cached), {last.prompt_tps:.1f} tokens/s"
          f"\nGeneration: {last.generation_tokens} tokens, {last.generation_tps:.2f} tokens/s"
          f"\nPeak memory: {last.peak_memory:.2f} GB", file=out)


def main(argv=None):
    args = build_parser().parse_args(argv)
    from .distributed import quiet_other_ranks

    quiet_other_ranks()  # under mlx.launch only rank 0 prints
    return run(lambda: _main(args))


def _main(args):
    from .errors import InputError
    from .sampling import SamplingParams, check_sampling

    flags = {f.name: f.metadata["flag"] for f in _sampling_fields()}
    values = {name: getattr(args, name) for name in flags}
    check_sampling(values, name=flags.get)
    if args.prefill_step_size < 1:
        raise InputError(f"--prefill-step-size = {args.prefill_step_size} is not allowed; use an integer >= 1")
    sampling = SamplingParams(**values)
    if args.blas_threads is not None:
        from .cpu import threads

        threads.configure(args.blas_threads, "--blas-threads")

    from . import load
    from .backend import backend_of
    from .hub import resolve_model_path
    from .generate import stream_generate
    from .prompt_cache import ChatSession

    path = resolve_model_path(args.model, flag="--model")
    check_media_flags(path, args.min_pixels, args.max_pixels, args.fps)
    model, processor = load(path, dtype=args.dtype, parallel=args.parallel)
    if args.verbose:
        print(f"[mlx_qwen3vl] model: {args.model}; backend: {backend_of(model).describe()}", file=sys.stderr)
    media = dict(min_pixels=args.min_pixels, max_pixels=args.max_pixels)
    if args.chat:
        session = ChatSession(model, processor, system=args.system, sampling=sampling,
                              prefill_step_size=args.prefill_step_size, **media)
        return _chat(session, args)
    if args.verbose:
        print(f"[mlx_qwen3vl] prompt: {args.prompt!r}, {len(args.image)} image(s), {len(args.video)} video(s)",
              file=sys.stderr)
    last = None
    for last in stream_generate(model, processor, args.prompt, images=args.image, videos=args.video,
                                video_fps=args.fps, system=args.system, sampling=sampling,
                                prefill_step_size=args.prefill_step_size, **media):
        print(last.text, end="", flush=True)
    print()
    _print_stats(last)
    return 0


def _chat(session, args):
    from .errors import Qwen3VLError

    images, videos = list(args.image), list(args.video)
    print("Chat with the model; /image PATH attaches an image to the next turn, Ctrl-D quits.", file=sys.stderr)
    while True:
        try:
            line = input(">> ").strip()
        except EOFError:
            print(file=sys.stderr)
            return 0
        if line.startswith("/image "):
            images.append(line.split(maxsplit=1)[1])
            continue
        if not line:
            continue
        try:
            for piece in session.stream(line, images=images, videos=videos, video_fps=args.fps):
                print(piece.text, end="", flush=True)
        except Qwen3VLError as e:
            print(f"error: {e}", file=sys.stderr)
            continue
        finally:
            images, videos = [], []
        print()
        _print_stats(session.last)


if __name__ == "__main__":
    sys.exit(main())
