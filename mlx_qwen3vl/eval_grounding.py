"""`python -m mlx_qwen3vl.eval_grounding`: ScreenSpot / ScreenSpot-Pro style grounding accuracy.

    python -m mlx_qwen3vl.eval_grounding --model PATH --data screenspot.jsonl [--limit N] [--zoom [FRACTION]]

Each JSONL record: `image` (or ScreenSpot-Pro's `img_filename`; a path relative to the JSONL's
folder unless absolute), `instruction`,
`bbox` = [x1, y1, x2, y2] in that image's pixels, optional `id`, `type` (or `ui_type` /
`data_type`), `platform`; a negative sample (target absent) has `"negative": true` (or
`"gt_type": "negative"`) and needs no bbox. A positive is right when the predicted point lies
inside the box, borders included; a negative is right when the model refuses ([-1,-1], an empty
JSON list, a `terminate` call); a malformed answer is wrong for both.

Per-sample results go to --output (JSONL, one line per sample as it finishes; by default beside
the data, named after it, the model and the format); rerunning with the same --output resumes where
it stopped. Each result names the sample it scores (a digest of its image, instruction, box, ...)
and the settings that produced it, so results of other data or other settings are refused, naming
what differs. The report (JSON) goes to stdout.

`--zoom` evaluates two-stage grounding (mlx_qwen3vl.agent.zoom): each sample's pass 1 on the
screenshot, then pass 2 on a window around its point. Pass 1 is the one-pass run (the same prompt),
so one report gives both side by side: overall, per type and per platform, with the samples pass 2
fixed and broke and the extra seconds per sample it cost. The fraction is one of the settings.
"""

import hashlib
import json
import os
import sys
import time
from typing import Callable, List, Optional

import mlx.core as mx

from . import batch_generate, generate, load
from .agent import (GROUNDING_FORMATS, ZOOM_FRACTION, choose, covers, crop, grounding_messages, parse_grounding,
                    zoom_fraction, zoom_window)
from .cli import FLAGS, Parser, check_max_tokens, check_media_flags, run
from .errors import InputError, Qwen3VLError
from .hub import resolve_model_path
from .media import load_image
from .processor import image_budget


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------
def _sample_type(record):
    for key in ("type", "ui_type", "data_type"):
        if record.get(key) is not None:
            return str(record[key])
    return None


def read_records(path: str) -> List[dict]:
    """Validated records of a grounding JSONL file (image paths resolved); InputError names the
    line of the first bad record."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise InputError(f"--data {path!r} could not be read ({e.strerror or e}); check the path") from None
    root = os.path.dirname(os.path.abspath(path))
    records = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path} line {n}"
        try:
            r = json.loads(line)
        except ValueError as e:
            raise InputError(f"{where} is not valid JSON ({e}); fix or remove the line") from None
        if isinstance(r, dict) and "image" not in r and "img_filename" in r:
            r["image"] = r["img_filename"]
        if not isinstance(r, dict) or not isinstance(r.get("image"), str) or not isinstance(r.get("instruction"), str):
            raise InputError(f"{where} needs string fields 'image' (or 'img_filename') and 'instruction'")
        negative = r.get("negative") is True or r.get("gt_type") == "negative"
        bbox = r.get("bbox")
        if not negative:
            if not (isinstance(bbox, list) and len(bbox) == 4 and all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) for v in bbox)):
                raise InputError(f"{where} needs 'bbox' = [x1, y1, x2, y2] in pixels "
                                 "(or \"negative\": true for a sample whose target is absent)")
        image = r["image"]
        if not image.startswith(("http://", "https://", "data:")) and not os.path.isabs(image):
            image = os.path.join(root, image)
        if not image.startswith(("http://", "https://", "data:")) and not os.path.isfile(image):
            raise InputError(f"{where}: image {r['image']!r} not found (paths are relative to the JSONL's folder)")
        record = {"index": len(records), "id": r.get("id", len(records)), "image": image,
                  "instruction": r["instruction"], "bbox": None if negative else bbox,
                  "negative": negative, "type": _sample_type(r),
                  "platform": None if r.get("platform") is None else str(r["platform"])}
        records.append(dict(record, sample=sample_key(record)))
    if not records:
        raise InputError(f"--data {path!r} has no records")
    return records


def sample_key(record) -> str:
    """What identifies a sample whatever file lists it: its image (the real path of a file), its
    instruction, box, negative flag and id. A result carries it, so results of another dataset
    that happen to share an index and an instruction are never taken for this one's."""
    image = record["image"]
    if not image.startswith(("http://", "https://", "data:")):
        image = os.path.realpath(image)
    identity = [image, record["instruction"], record["bbox"], record["negative"], record["id"]]
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:24]


def inside(point, bbox) -> bool:
    """The point lies in the box, borders included (box corners in any order)."""
    x, y = point
    x1, x2 = sorted(bbox[0::2])
    y1, y2 = sorted(bbox[1::2])
    return x1 <= x <= x2 and y1 <= y <= y2


def judge(record, g) -> bool:
    """A Grounding is right: a refusal on a negative, a point inside the box on a positive."""
    return g.status == "refused" if record["negative"] else (g.point is not None and inside(g.point, record["bbox"]))


def _row(record, g, width, height) -> dict:
    return {"index": record["index"], "sample": record.get("sample"), "id": record["id"],
            "instruction": record["instruction"], "type": record["type"], "platform": record["platform"],
            "negative": record["negative"], "bbox": record["bbox"], "image_size": [width, height], "answer": g.answer,
            "point": list(g.point) if g.point else None, "status": g.status, "correct": bool(judge(record, g))}


def score(record, answer: str, width: int, height: int, window=None) -> dict:
    """One sample's result line: the parsed answer and whether it is right (`window`: the answer
    is about that crop of the image, as parse_grounding reads it)."""
    return _row(record, parse_grounding(answer, width, height, window=window), width, height)


def _pass(record, g, seconds) -> dict:
    return {"answer": g.answer, "status": g.status, "point": list(g.point) if g.point else None,
            "correct": bool(judge(record, g)), "seconds": round(seconds, 6)}


def zoom_rows(batch: List[dict], answers: List[str], seconds: float, predictor, fraction, min_pixels: int = 0):
    """Result lines of two-stage grounding for a batch whose pass 1 `answers` are known (`seconds`
    per sample): pass 2 runs, as one predictor call, on the window of each sample whose pass 1
    gave a point (unless the window is the whole screenshot); each line is the chosen answer's
    (agent.zoom.choose), with both passes under "zoom"."""
    firsts, windows, asks = [], [], []
    for i, (r, answer) in enumerate(zip(batch, answers)):
        height, width = r["pixels"].shape[:2]
        g = parse_grounding(answer, width, height)
        window = zoom_window(g.relative, width, height, fraction, min_pixels) if g.status == "ok" else None
        firsts.append(g)
        windows.append(window)
        if window is not None and not covers(window, width, height):
            asks.append(i)
    second, second_seconds = {}, 0.0
    if asks:
        tic = time.perf_counter()
        got = predictor([dict(batch[i], pixels=crop(batch[i]["pixels"], windows[i]), window=windows[i]) for i in asks])
        second_seconds = (time.perf_counter() - tic) / len(asks)
        second = dict(zip(asks, got))
    rows = []
    for i, (r, first, window) in enumerate(zip(batch, firsts, windows)):
        height, width = r["pixels"].shape[:2]
        passes, final, used = [_pass(r, first, seconds)], first, 1
        if i in second:
            g = parse_grounding(second[i], width, height, window=window)
            passes.append(_pass(r, g, second_seconds))
            final, used = choose(first, g)
        row = _row(r, final, width, height)
        row["zoom"] = {"fraction": float(fraction), "window": list(window.box) if window else None, "pass": used,
                       "passes": passes}
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------
# Results file (resumable)
# ---------------------------------------------------------------------------------------------
# The flag each setting is given by, for the message naming a setting that differs.
SETTING_FLAGS = {"model": "--model", "format": "--format", "refusal": "refusal clause (--no-refusal)",
                 "min_pixels": "--min-pixels", "max_pixels": "--max-pixels", "max_tokens": "--max-tokens",
                 "dtype": "--dtype", "zoom": "--zoom"}


def _settings_differ(found, wanted) -> str:
    """"--format 'qwen' (this run: 'venus'), ..." for each setting that differs."""
    found, wanted = found or {}, wanted or {}
    order = list(SETTING_FLAGS)
    names = sorted(set(found) | set(wanted), key=lambda k: order.index(k) if k in order else len(order))
    return ", ".join(f"{SETTING_FLAGS.get(k, k)} {found.get(k)!r} (this run: {wanted.get(k)!r})"
                     for k in names if found.get(k) != wanted.get(k)) or "no settings recorded"


def read_results(path: str, records: List[dict], settings: Optional[dict] = None) -> dict:
    """Results already in `path`, by record index. A partial last line (an interrupted write) is
    cut off; results of other data (another sample at that index) or of a run with other settings
    (model, format, pixel budget, ...) are refused rather than mixed in, naming what differs."""
    if not os.path.exists(path):
        return {}
    with open(path, "rb") as f:
        data = f.read()
    good_end = data.rfind(b"\n") + 1
    done = {}
    for n, line in enumerate(data[:good_end].decode("utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            i = r["index"]
            same = 0 <= i < len(records) and r["sample"] == records[i]["sample"]
        except (ValueError, KeyError, TypeError):
            same = False
        if not same:
            raise InputError(f"--output {path!r} line {n} is not a result for this --data's samples (another "
                             "dataset's, or an older file); pass another --output or delete the file to start over")
        if r.get("settings") != settings:
            raise InputError(f"--output {path!r} line {n} was written with other settings: "
                             f"{_settings_differ(r.get('settings'), settings)}; rerun with those, pass another "
                             "--output, or delete the file to start over")
        done[i] = r
    if good_end < len(data):
        with open(path, "r+b") as f:
            f.truncate(good_end)
    return done


def summarize(results: List[dict]) -> dict:
    """Accuracy overall, on positives / negatives, per type and per platform."""
    def acc(rows):
        n, c = len(rows), sum(r["correct"] for r in rows)
        return {"samples": n, "correct": c, "accuracy": round(c / n, 4) if n else None}

    def split(key):
        groups = {}
        for r in results:
            if r.get(key) is not None:
                groups.setdefault(r[key], []).append(r)
        return {k: acc(v) for k, v in sorted(groups.items())}

    report = acc(results)
    report.update(positive=acc([r for r in results if not r["negative"]]),
                  negative=acc([r for r in results if r["negative"]]),
                  refused=sum(r["status"] == "refused" for r in results),
                  malformed=sum(r["status"] == "malformed" for r in results),
                  by_type=split("type"), by_platform=split("platform"))
    return report


def summarize_zoom(results: List[dict], fraction) -> dict:
    """Two-stage results: one-pass (pass 1 alone) and two-pass accuracy side by side, overall, on
    positives / negatives, per type and per platform; how often pass 2 ran and was used; the samples
    it fixed and broke; seconds per sample of each."""
    one_rows = [dict(r, correct=r["zoom"]["passes"][0]["correct"], status=r["zoom"]["passes"][0]["status"])
                for r in results]
    one, two = summarize(one_rows), summarize(results)

    def side(a, b):
        return {"samples": a["samples"], "one_pass": a["accuracy"], "two_pass": b["accuracy"]}

    ran = sum(len(r["zoom"]["passes"]) == 2 for r in results)
    used = sum(r["zoom"]["pass"] == 2 for r in results)
    n = max(1, len(results))
    first_s = sum(r["zoom"]["passes"][0]["seconds"] for r in results) / n
    extra_s = sum(p["seconds"] for r in results for p in r["zoom"]["passes"][1:]) / n
    return {"fraction": float(fraction), "one_pass": one, "two_pass": two,
            "side_by_side": {"all": side(one, two), "positive": side(one["positive"], two["positive"]),
                             "negative": side(one["negative"], two["negative"]),
                             "by_type": {k: side(v, two["by_type"][k]) for k, v in one["by_type"].items()},
                             "by_platform": {k: side(v, two["by_platform"][k]) for k, v in one["by_platform"].items()}},
            "second_pass": {"ran": ran, "used": used, "fell_back": ran - used, "not_run": len(results) - ran},
            "changed": {"fixed": sum(r["correct"] and not o["correct"] for r, o in zip(results, one_rows)),
                        "broken": sum(o["correct"] and not r["correct"] for r, o in zip(results, one_rows))},
            "seconds_per_sample": {"one_pass": round(first_s, 6), "two_pass": round(first_s + extra_s, 6),
                                   "extra": round(extra_s, 6)}}


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------
class ModelPredictor:
    """Answers grounding samples with a loaded model: one generate() call for a single sample, one
    left-padded batch_generate() call for several (each answer equals that sample run alone)."""

    def __init__(self, model, processor, format="venus", allow_refusal=True, min_pixels=None,
                 max_pixels=None, max_tokens=128):
        self.model, self.processor = model, processor
        self.format, self.allow_refusal = format, allow_refusal
        self.options = dict(max_tokens=max_tokens, min_pixels=min_pixels, max_pixels=max_pixels)

    def __call__(self, samples: List[dict]) -> List[str]:
        msgs = [grounding_messages(s["pixels"], s["instruction"], self.format, self.allow_refusal) for s in samples]
        if len(msgs) == 1:
            return [generate(self.model, self.processor, messages=msgs[0], **self.options).text]
        return [r.text for r in batch_generate(self.model, self.processor, [dict(messages=m) for m in msgs],
                                               **self.options)]


def evaluate(records: List[dict], predictor: Callable[[List[dict]], List[str]], output: str, *,
             limit: Optional[int] = None, batch_size: int = 1, progress: bool = True,
             settings: Optional[dict] = None, zoom=None, window_min_pixels: int = 0) -> dict:
    """Run `predictor` on the records not yet in `output` (the first `limit` of them), appending
    one result line per sample as its batch finishes; return the report over those records.

    `predictor(samples) -> answers` gets dicts with the record fields plus `pixels` (the loaded
    RGB array); ModelPredictor wraps a model, and a test can pass any function. `settings` (what
    produced the answers: model, format, ...) is stored with each result, and a resumed file must
    have been written with the same.

    `zoom` (a window fraction): two-stage grounding (zoom_rows); the predictor is called a second
    time per batch with the crops, each sample's `pixels` the crop and `window` its Window (left,
    top, width, height in the screenshot's pixels), at least `window_min_pixels` pixels. The
    report then also carries "zoom" (summarize_zoom), its main figures being the two-pass ones."""
    fraction = None if zoom is None else zoom_fraction(zoom)

    done = read_results(output, records, settings)
    records = records[:limit] if limit is not None else records
    todo = [r for r in records if r["index"] not in done]
    if done and todo:
        print(f"resuming {output}: {len(done)} of {len(records)} samples done", file=sys.stderr)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(records), initial=len(done), unit="sample", file=sys.stderr, dynamic_ncols=True)
    tic = time.perf_counter()
    try:
        with open(output, "a", encoding="utf-8") as out:
            for s in range(0, len(todo), max(1, batch_size)):
                batch = [dict(r, pixels=load_image(r["image"])) for r in todo[s: s + max(1, batch_size)]]
                tic_batch = time.perf_counter()
                answers = predictor(batch)
                if fraction is None:
                    rows = [score(r, a, r["pixels"].shape[1], r["pixels"].shape[0]) for r, a in zip(batch, answers)]
                else:
                    rows = zoom_rows(batch, answers, (time.perf_counter() - tic_batch) / len(batch), predictor,
                                     fraction, window_min_pixels)
                for r, row in zip(batch, rows):
                    done[r["index"]] = result = dict(row, settings=settings)
                    out.write(json.dumps(result, ensure_ascii=False) + "\n")
                out.flush()
                if bar is not None:
                    bar.update(len(batch))
    finally:
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - tic
    results = [done[r["index"]] for r in records]
    report = summarize(results)
    if fraction is not None:
        report["zoom"] = summarize_zoom(results, fraction)
    report.update(evaluated_now=len(todo), resumed=len(records) - len(todo),
                  samples_per_s=round(len(todo) / seconds, 3) if todo and seconds > 0 else None,
                  results=output)
    return report


def model_identity(model: Optional[str]) -> Optional[str]:
    """The model a result was produced by: a local folder by its real path (the same checkpoint
    named by another relative path, or through a link, is the same model), a hub id as it is."""
    if model and os.path.isdir(model):
        return os.path.realpath(model)
    return model


def default_output(data: str, model: Optional[str], format: str, zoom=None) -> str:
    """<data name>.<model name>.<format>[.zoom<fraction>].results.jsonl beside the data: a rerun
    from any folder finds (and resumes) it, and another model, format or zoom gets a file of its own."""
    folder, name = os.path.split(os.path.abspath(data))
    stem = os.path.splitext(name)[0]
    if model:
        stem += "." + (os.path.basename(os.path.normpath(model)) or "model").replace("/", "_")
    suffix = "" if zoom is None else f".zoom{float(zoom):g}"
    return os.path.join(folder, f"{stem}.{format}{suffix}.results.jsonl")


def build_parser():
    p = Parser(prog="python -m mlx_qwen3vl.eval_grounding",
                                description="Grounding accuracy on ScreenSpot-style JSONL data.")
    p.add_argument("--model", help="local folder or Hugging Face repo id")
    p.add_argument("--data", required=True, help="JSONL: image, instruction, bbox [x1,y1,x2,y2] px, "
                                                 "optional type, platform, negative")
    p.add_argument("--output", help="per-sample results JSONL (default: <data name>.<model name>.<format>"
                                    ".results.jsonl beside --data); an existing file of the same run is resumed")
    p.add_argument("--report", help="also write the report JSON to this file")
    p.add_argument("--limit", type=int, default=None, help="only the first N records")
    p.add_argument("--format", choices=GROUNDING_FORMATS, default="venus")
    p.add_argument("--no-refusal", action="store_true", help="venus format: no [-1,-1] clause in the prompt")
    p.add_argument("--zoom", nargs="?", const=float(ZOOM_FRACTION), type=float, metavar="FRACTION",
                   help="two-stage grounding: also ask on a window around each first point, FRACTION of the "
                        f"screenshot's sides (default {float(ZOOM_FRACTION)}); reports one and two passes side by side")
    p.add_argument("--batch-size", type=int, default=None,
                   help="samples per batch (default: 8 on a GPU, 1 on the CPU, where batching does not pay)")
    p.add_argument(FLAGS["max_tokens"], type=int, default=128)
    p.add_argument(FLAGS["min_pixels"], type=int, default=None)
    p.add_argument(FLAGS["max_pixels"], type=int, default=None)
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None)
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def main(argv=None, predictor=None):
    """CLI entry point. `predictor` (samples -> answers) replaces loading --model: tests use it to
    evaluate scripted answers through the same command line."""
    args = build_parser().parse_args(argv)

    def body():
        try:
            report = _main(args, predictor)
        except Qwen3VLError:  # ModelNotFoundError is an OSError too: its own line
            raise
        except OSError as e:
            raise InputError(f"{e.filename or ''}: {e.strerror or e}; check the path") from None
        print(json.dumps(report, indent=2))
        return 0

    return run(body, interrupted="interrupted; rerun the same command to resume")


def _main(args, predictor):
    if args.limit is not None and args.limit < 1:
        raise InputError(f"--limit {args.limit}: give a positive number of records")
    if args.batch_size is not None and args.batch_size < 1:
        raise InputError(f"--batch-size {args.batch_size}: give a positive number")
    zoom = None if args.zoom is None else zoom_fraction(args.zoom, "--zoom")
    records = read_records(args.data)
    settings = None
    if predictor is None or args.model:
        settings = {"model": model_identity(args.model), "format": args.format, "refusal": not args.no_refusal,
                    "min_pixels": args.min_pixels, "max_pixels": args.max_pixels, "max_tokens": args.max_tokens,
                    "dtype": args.dtype}
    if zoom is not None:  # a one-pass run's settings stay as they were: its files still resume
        settings = dict(settings or {}, zoom=float(zoom))
    output = args.output or default_output(args.data, args.model, args.format, zoom)
    batch_size = args.batch_size
    window_min_pixels = args.min_pixels or 0  # a given predictor stands in for the model: only the flag
    if predictor is None:
        if not args.model:
            raise InputError("give --model: the checkpoint to evaluate")
        path = resolve_model_path(args.model, flag="--model")
        check_max_tokens(args.max_tokens)
        check_media_flags(path, args.min_pixels, args.max_pixels)
        model, processor = load(path, dtype=args.dtype)
        window_min_pixels = image_budget(processor.image_config, args.min_pixels, args.max_pixels)[0]
        predictor = ModelPredictor(model, processor, args.format, not args.no_refusal, args.min_pixels,
                                   args.max_pixels, args.max_tokens)
        if batch_size is None:
            batch_size = 8 if mx.default_device().type == mx.gpu else 1
    if not args.output:
        print(f"results: {output} (--output to choose)", file=sys.stderr)
    report = evaluate(records, predictor, output, limit=args.limit, batch_size=batch_size or 1,
                      progress=not args.no_progress, settings=settings, zoom=zoom,
                      window_min_pixels=window_min_pixels)
    if args.report:
        with open(args.report, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    sys.exit(main())
