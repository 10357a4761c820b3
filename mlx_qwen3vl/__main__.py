"""Command line: `python -m mlx_qwen3vl --model PATH|HUB_ID --prompt TEXT [--image P ...]`.

Bad input ends in one `error: ...` line on stderr and exit status 2; a run on good input prints
the answer on stdout and only the statistics lines on stderr.
"""

import argparse
import signal
import sys
from dataclasses import fields

from . import load
from .backend import backend_of
from .chat_session import ChatSession
from .cli import FLAGS, Parser, check_media_flags, run
from .distributed import quiet_other_ranks
from .errors import InputError, Qwen3VLError
from .generate import stream_generate
from .hub import resolve_model_path
from .kv_settings import KVSettings, resolve
from .media import load_image
from .prompt_cache import PromptCache
from .sampling import SamplingParams, check_sampling

DEFAULT_PROMPT = "Describe this image."


def _sampling_fields():
    return [f for f in fields(SamplingParams) if f.metadata.get("flag")]


def build_parser():
    p = Parser(prog="python -m mlx_qwen3vl", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                description="Generate text from images/videos and a prompt with Qwen3-VL.")
    # Required, as in mlx-lm / mlx-vlm's usage line: a silent multi-GB download of a default model
    # surprised a user who had only forgotten the flag.
    p.add_argument("--model", required=True, help="local checkpoint folder or Hugging Face repo id")
    p.add_argument("--prompt", default=None,
                   help=f"the user's text; none = {DEFAULT_PROMPT!r}, or with --chat no first turn (the prompt, "
                        "with --image / --video, is the chat's first turn)")
    p.add_argument("--image", nargs="+", default=[], metavar="IMAGE", help="image paths, URLs or data URLs")
    p.add_argument("--video", nargs="+", default=[], metavar="VIDEO", help="video files (needs the `video` extra)")
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
    p.add_argument(FLAGS["fps"], type=float, default=None,
                   help="video frames sampled per second of video (as qwen-vl-utils' fps); none = the checkpoint's "
                        "video config (2)")
    p.add_argument(FLAGS["source_fps"], type=float, default=None,
                   help="the video files' own frame rate, overriding what their container says (timestamps and "
                        "sampling follow it); none = the container's")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="compute dtype; none = float32 on the CPU, the checkpoint's on a GPU")
    p.add_argument("--parallel", choices=["tensor", "pipeline"], default="tensor",
                   help="under mlx.launch: split every layer over the ranks (tensor) or the layers (pipeline)")
    p.add_argument("--prefill-step-size", type=int, default=2048, help="prompt tokens per prefill chunk")
    p.add_argument("--kv-bits", type=int, default=None,
                   help="store the KV cache quantized to 4 or 8 bits once it holds --quantized-kv-start positions "
                        "(mlx-lm's kv_bits); none = float")
    p.add_argument("--kv-group-size", type=int, default=64,
                   help="quantization group size of the KV cache (32, 64 or 128); one that does not divide the "
                        "model's head dimension is chosen down")
    p.add_argument("--quantized-kv-start", type=int, default=5000,
                   help="cache length (positions) at which the KV cache is quantized")
    p.add_argument("--prompt-lookup", type=int, default=0, metavar="N",
                   help="speculative decoding from the prompt: draft what followed the longest n-gram (n from N "
                        "down to 1) the prompt and answer already hold; lossless; 0 = off")
    p.add_argument("--num-draft-tokens", type=int, default=None,
                   help="draft tokens checked per step with --prompt-lookup or --draft-model (mlx-lm's name; "
                        "default 4)")
    p.add_argument("--draft-model", default=None, metavar="PATH",
                   help="speculative decoding by a smaller checkpoint with the same tokenizer (e.g. the 2B for the "
                        "8B): it prefills the same prompt and media and drafts tokens the model checks; lossless")
    p.add_argument("--blas-threads", default=None, metavar="auto|N",
                   help="BLAS threads of the CPU path: auto (every core while no other process wants them, fewer "
                        "while others run) or a fixed N; none = $MLX_QWEN3VL_BLAS_THREADS, else auto")
    p.add_argument("--chat", action="store_true", help="interactive multi-turn chat with prefix reuse")
    p.add_argument("--verbose", action="store_true",
                   help="print the backend (and BLAS) in use, the prompt and the KV bytes in use")
    return p


def _print_stats(last, out=None, kv=None):
    if last is None:
        return
    print(f"Prompt: {last.prompt_tokens} tokens ({last.cached_tokens} cached), {last.prompt_tps:.1f} tokens/s"
          f"\nGeneration: {last.generation_tokens} tokens, {last.generation_tps:.2f} tokens/s"
          f"\nPeak memory: {last.peak_memory:.2f} GB", file=out or sys.stderr)  # stderr as it is now
    if last.draft_proposed:
        print(f"Drafts: {last.draft_accepted} of {last.draft_proposed} accepted", file=out or sys.stderr)
    if kv is not None:  # --verbose
        print(f"KV cache: {last.kv_cache_bytes / 1e6:.2f} MB in use for "
              f"{last.prompt_tokens + max(last.generation_tokens - 1, 0)} positions ({kv.describe()})",
              file=out or sys.stderr)


def main(argv=None):
    args = build_parser().parse_args(argv)
    quiet_other_ranks()  # under mlx.launch only rank 0 prints
    return run(lambda: _main(args))


def _main(args):
    flags = {f.name: f.metadata["flag"] for f in _sampling_fields()}
    values = {name: getattr(args, name) for name in flags}
    check_sampling(values, name=flags.get)
    if args.prefill_step_size < 1:
        raise InputError(f"--prefill-step-size = {args.prefill_step_size} is not allowed; use an integer >= 1")
    kv_flags = {"kv_bits": "--kv-bits", "kv_group_size": "--kv-group-size", "quantized_kv_start": "--quantized-kv-start"}
    kv_args = {name: getattr(args, name) for name in kv_flags}
    KVSettings.build(**kv_args, name=kv_flags.get)
    sampling = SamplingParams(**values)
    from .engine.draft_model import DraftModel
    from .engine.drafting import drafting

    drafts = dict(prompt_lookup=args.prompt_lookup, num_draft_tokens=args.num_draft_tokens)
    drafting(**drafts)  # checked before the models load
    if args.draft_model and args.prompt_lookup:
        raise InputError("--draft-model and --prompt-lookup were both given; drafts come from one of them")
    draft_path = resolve_model_path(args.draft_model, flag="--draft-model") if args.draft_model else None
    if args.blas_threads is not None:
        from .cpu import threads

        threads.configure(args.blas_threads, "--blas-threads")

    path = resolve_model_path(args.model, flag="--model")
    check_media_flags(path, args.min_pixels, args.max_pixels, args.fps, args.source_fps)
    model, processor = load(path, dtype=args.dtype, parallel=args.parallel)
    if draft_path is not None:
        draft = DraftModel.of(load(draft_path, dtype=args.dtype, parallel=args.parallel))
        draft.check(model, processor.tokenizer)
        drafts["draft_model"] = draft
    kv = resolve(model, KVSettings.build(**kv_args))
    if args.verbose:
        print(f"[mlx_qwen3vl] model: {args.model}; backend: {backend_of(model).describe()}; KV cache: "
              f"{kv.describe()}", file=sys.stderr)
    args.kv = kv if args.verbose else None
    media = dict(min_pixels=args.min_pixels, max_pixels=args.max_pixels, fps=args.fps, source_fps=args.source_fps)
    if args.chat:
        session = ChatSession(model, processor, system=args.system, sampling=sampling,
                              prefill_step_size=args.prefill_step_size, **kv_args, **media, **drafts)
        return _chat(session, args)
    prompt = DEFAULT_PROMPT if args.prompt is None else args.prompt
    if args.verbose:
        print(f"[mlx_qwen3vl] prompt: {prompt!r}, {len(args.image)} image(s), {len(args.video)} video(s)",
              file=sys.stderr)
    last = None
    for last in stream_generate(model, processor, prompt, images=args.image, videos=args.video,
                                system=args.system, sampling=sampling,
                                prefill_step_size=args.prefill_step_size, **kv_args, **media, **drafts):
        print(last.text, end="", flush=True)
    print()
    _print_stats(last, kv=args.kv)
    return 0


CHAT_HELP = """Commands (anything else is sent to the model):
  /image PATH   attach an image to your next message (read now; /image again for more)
  /help         this list
  //TEXT        send TEXT starting with one /
Ctrl-D quits."""


class _stop_on_interrupt:
    """While active, the first SIGINT sets `requested` and the second raises KeyboardInterrupt."""

    def __enter__(self):
        self.requested = False
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self._previous)


def _chat(session, args):
    """The interactive loop. The `>> ` prompt, commands' replies and errors go to stderr, so stdout
    holds the answers alone; commands never reach the model."""

    images, videos = list(args.image), list(args.video)

    def send(text):
        """One turn. Ctrl-C stops its answer (as in ollama's chat): the turn is left out of the
        history, the earlier turns and their cache stay. The first Ctrl-C asks the loop to stop at
        the next token; a second one, during a long prefill, interrupts at once, and the cache (its
        state then unknown) is rebuilt from the history on the next turn."""
        nonlocal images, videos
        answer = session.stream(text, images=images, videos=videos)
        stopped = True
        with _stop_on_interrupt() as stop:
            try:
                for piece in answer:
                    print(piece.text, end="", flush=True)
                    if stop.requested:
                        break
                else:
                    stopped = False
            except Qwen3VLError as e:
                print(f"error: {e}", file=sys.stderr)
                return
            except KeyboardInterrupt:
                session.prompt_cache = PromptCache(session.model.make_cache())
            finally:
                answer.close()  # an unfinished turn leaves the conversation as it was
                images, videos = [], []
        print(flush=True)
        if stopped:
            print("[stopped: this message and its answer are left out of the chat; the earlier turns stay]",
                  file=sys.stderr)
            return
        _print_stats(session.last, kv=args.kv)

    print("Chat with the model; /image PATH attaches an image to the next message, /help lists the commands, "
          "Ctrl-D quits.", file=sys.stderr)
    if args.prompt is not None:  # the first turn, with the media given on the command line
        send(args.prompt)
    while True:
        print(">> ", end="", file=sys.stderr, flush=True)
        try:
            line = input().strip()
            if not sys.stdin.isatty():  # end the prompt's line, as a terminal's echo of the typed line does
                print(file=sys.stderr)
        except EOFError:
            print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:  # at the prompt, as in Python's own: a new line, Ctrl-D quits
            print("\n(Ctrl-D quits)", file=sys.stderr)
            continue
        command, _, rest = line.partition(" ")
        if line.startswith("//"):
            line = line[1:]
        elif command == "/image":
            try:  # read now: a missing or unreadable file is refused here, not with the next message
                images.append(load_image(rest.strip(), "/image"))
            except Qwen3VLError as e:
                print(f"error: {e}", file=sys.stderr)
            else:
                print(f"(image attached to your next message; {len(images)} so far)", file=sys.stderr)
            continue
        elif command in ("/help", "/?"):
            print(CHAT_HELP, file=sys.stderr)
            continue
        elif line.startswith("/") and " " not in line:
            print(f"error: unknown command {line}; /help lists the commands (//TEXT sends TEXT starting "
                  "with one /)", file=sys.stderr)
            continue
        if line:
            send(line)


if __name__ == "__main__":
    sys.exit(main())
