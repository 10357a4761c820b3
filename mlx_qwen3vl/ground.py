"""`python -m mlx_qwen3vl.ground`: where is the element on this screenshot? One JSON object out.

    python -m mlx_qwen3vl.ground --model PATH --image shot.png --instruction "the Apply button" \
        [--format venus|qwen|computer_use] [--zoom [FRACTION]] [--annotate out.png]

The point (and box, if the answer gave one) is in pixels of the image as given, whatever
--min-pixels / --max-pixels did to it for the model (see mlx_qwen3vl.agent.to_pixel for the
rounding); an answer without a point is drawn framed in red, with a "no point" band below the
screenshot. `--zoom` asks twice: on the screenshot, then on a window around the first point
(FRACTION of each side, 0.5 by default; see mlx_qwen3vl.agent.zoom); the JSON's "zoom" holds both
passes, and --annotate draws the window too. `--answer TEXT` skips the model and parses / draws an
answer obtained elsewhere.
"""

import json
import os
import sys
import tempfile

from . import cli, load
from .agent import (GROUNDING_FORMATS, ZOOM_FRACTION, GroundingResult, annotate, ground, missing_point_note,
                    parse_grounding, zoom_fraction)
from .cli import FLAGS, Parser, check_max_tokens, check_media_flags
from .errors import InputError
from .hub import resolve_model_path
from .media import load_image


def build_parser():
    p = Parser(prog="python -m mlx_qwen3vl.ground",
                                description="Locate a UI element on a screenshot; prints one JSON object.")
    p.add_argument("--model", help="local folder or Hugging Face repo id (not needed with --answer)")
    p.add_argument("--image", required=True, help="screenshot: path, URL or data: URL")
    p.add_argument("--instruction", required=True, help='what to find, e.g. "the Apply button"')
    p.add_argument("--format", choices=GROUNDING_FORMATS, default="venus",
                   help="prompt and answer format: UI-Venus [x,y] (default), Qwen3-VL bbox_2d JSON, "
                        "or Qwen3-VL computer_use tool call")
    p.add_argument("--no-refusal", action="store_true",
                   help="venus format: leave out the clause that allows [-1,-1] for an absent target")
    p.add_argument("--zoom", nargs="?", const=float(ZOOM_FRACTION), type=float, metavar="FRACTION",
                   help="two-stage grounding: ask again on a window around the first point, FRACTION of the "
                        f"screenshot's width and height (default {float(ZOOM_FRACTION)}); costs a second pass")
    p.add_argument("--annotate", metavar="OUT.png",
                   help="write the screenshot with the point / box (and the zoom window) drawn")
    p.add_argument("--answer", help="parse this answer instead of running a model")
    p.add_argument(FLAGS["max_tokens"], type=int, default=128)
    p.add_argument(FLAGS["min_pixels"], type=int, default=None)
    p.add_argument(FLAGS["max_pixels"], type=int, default=None)
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None)
    return p


def write_png_atomically(image, path):
    """Write a PIL image as PNG via a temporary file in the same folder, so an interrupted write
    never leaves a half file under `path`."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise InputError(f"--annotate {path!r}: folder {folder!r} does not exist; create it or pick another path")
    fd, tmp = tempfile.mkstemp(prefix=".annotate-", suffix=".png", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            image.save(f, format="PNG")
        umask = os.umask(0)  # mkstemp makes the file private; give it the usual permissions
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except OSError as e:
        raise InputError(f"--annotate {path!r} could not be written ({e.strerror or e}); check the path") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def run(args) -> dict:

    if args.annotate and os.path.exists(args.image) and os.path.exists(args.annotate) \
            and os.path.samefile(args.image, args.annotate):
        raise InputError(f"--annotate {args.annotate!r} is the input screenshot; write the drawing elsewhere")
    if args.answer is None and not args.model:
        raise InputError("give --model to run a model, or --answer to parse an answer you already have")
    if args.zoom is not None:
        zoom_fraction(args.zoom, "--zoom")
        if args.answer is not None:
            raise InputError("--zoom runs the model a second time, on the crop; it cannot go with --answer")
    if args.answer is None:
        args.model = resolve_model_path(args.model, flag="--model")
        check_max_tokens(args.max_tokens)
        check_media_flags(args.model, args.min_pixels, args.max_pixels)
    rgb = load_image(args.image)
    if args.answer is not None:
        height, width = rgb.shape[:2]
        g = parse_grounding(args.answer, width, height)
        result = GroundingResult(g.point, g.box, g.status, args.answer, width, height, args.format)
    else:
        model, processor = load(args.model, dtype=args.dtype)
        result = ground(model, processor, rgb, args.instruction, format=args.format,
                        allow_refusal=not args.no_refusal, zoom=args.zoom, min_pixels=args.min_pixels,
                        max_pixels=args.max_pixels, max_tokens=args.max_tokens)
    out = {"instruction": args.instruction, **result.to_dict()}
    if args.annotate:
        note = None if result.point else missing_point_note(result.status)
        write_png_atomically(annotate(rgb, result.point, result.box, note=note, window=result.window), args.annotate)
        out["annotated"] = args.annotate
    return out


def main(argv=None):
    args = build_parser().parse_args(argv)

    def body():
        print(json.dumps(run(args), ensure_ascii=False))
        return 0

    return cli.run(body)


if __name__ == "__main__":
    sys.exit(main())
