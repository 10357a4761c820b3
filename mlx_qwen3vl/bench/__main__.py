"""Benchmark this engine on your machine and your model, in one command.

    python -m mlx_qwen3vl.bench --model mlx-community/Qwen3-VL-4B-Instruct-4bit --quick
    python -m mlx_qwen3vl.bench --model path/to/UI-Venus-1.5-8B --json bench.json --compare mlx-vlm
    python -m mlx_qwen3vl.bench --plan --model Qwen/Qwen3-VL-8B-Instruct     # will it fit? (config.json only)

(`mlx-qwen3vl-bench` is the same command.) It prints the chip, OS, MLX version, dtype and
quantization, then: prompt and decode tokens/s for a text prompt, time to first token for a
synthetic 1280x720 and 1920x1080 screenshot, an agent loop of N turns (a new screenshot each turn)
that reuses its KV cache, and peak memory. `--compare mlx-vlm` runs mlx-vlm on the same inputs in
its own process, after ours (so the two models are never loaded at once). `--json PATH` writes
everything as a file to attach to an issue (schema: docs/bench.md).

--quick: one run per workload, a 256-token prompt, 32 decoded tokens, 3 agent turns of 8 tokens.
Our estimate, from FLOP and memory-bandwidth counts rather than a measurement (the project has not
run it on a Mac): about 30-40 s on a base M1 for a 2B 4-bit model, model load included, and less
on larger chips. The full run (median of 3, a 1024-token prompt, 128 tokens, 5 agent turns of 16)
takes about three times as long.
"""

import argparse
import gc
import sys
import time
from datetime import datetime, timezone

import mlx.core as mx
from mlx.utils import tree_flatten

from .. import __version__, load
from ..architectures import PRESETS
from ..backend import backend_of
from ..cli import FLAGS, Parser, check_media_flags, run
from ..config import ModelConfig
from ..engine.draft_model import DraftModel
from ..engine.speculative import DEFAULT_DRAFT, MAX_DRAFT
from ..errors import InputError
from ..hub import resolve_model_path
from ..plan import (add_json_argument, add_plan_arguments, check_json_path, parameter_counts, quant_label, run_plan,
                    write_json)
from . import engine_mlx_vlm
from .machine import log, machine_info
from .report import KIND, OURS, SCHEMA, format_report, validate
from .run import prepare, run_ours

QUICK = dict(prompt_tokens=256, decode_tokens=32, repeats=1, agent_turns=3, agent_tokens=8)
FULL = dict(prompt_tokens=1024, decode_tokens=128, repeats=3, agent_turns=5, agent_tokens=16)
LIMITS = dict(prompt_tokens=(32, 32768), decode_tokens=(2, 4096), repeats=(1, 20), agent_turns=(0, 20),
              agent_tokens=(1, 1024))
SCREENSHOTS = [(1280, 720), (1920, 1080)]
ENGINES = ("mlx-vlm",)
PROMPT_LOOKUP = 3  # the longest n-gram prompt lookup matches in the --speculative workload


def build_parser():
    p = Parser(prog="python -m mlx_qwen3vl.bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="local checkpoint folder or Hugging Face repo id (the model you have)")
    p.add_argument("--quick", action="store_true", help="one short run per workload (see above)")
    for name in QUICK:
        lo, hi = LIMITS[name]
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None,
                       help=f"{lo}..{hi}; default {FULL[name]}, {QUICK[name]} with --quick")
    p.add_argument(FLAGS["max_pixels"], type=int, default=None,
                   help="largest image area (as agents cap screenshots); none = the checkpoint's")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="compute dtype; none = float32 on the CPU, the checkpoint's on a GPU")
    p.add_argument("--speculative", action="store_true",
                   help="also time speculative decoding: plain against prompt lookup (and --draft-model) on an agent "
                        "conversation whose tool calls are resent")
    p.add_argument("--num-draft-tokens", type=int, default=None, metavar="K",
                   help=f"with --speculative: draft tokens per step, 1..{MAX_DRAFT}; default {DEFAULT_DRAFT}")
    p.add_argument("--draft-model", default=None, metavar="MODEL",
                   help="with --speculative: also a draft model (a smaller checkpoint with the same tokenizer)")
    p.add_argument("--compare", default="", metavar="ENGINE", help="also run " + ", ".join(ENGINES) + " on the same inputs")
    add_json_argument(p, "bench.json", "the results (schema in docs/bench.md)")
    p.add_argument("--plan", action="store_true", help="only plan the memory (python -m mlx_qwen3vl.plan) and exit")
    p.add_argument("--preset", choices=list(PRESETS), help="with --plan: a published architecture instead of --model")
    add_plan_arguments(p)
    return p


def resolve_settings(args) -> dict:
    base = QUICK if args.quick else FULL
    settings = dict(quick=bool(args.quick), max_pixels=args.max_pixels, screenshots=[list(s) for s in SCREENSHOTS])
    for name, default in base.items():
        value = getattr(args, name)
        value = default if value is None else value
        lo, hi = LIMITS[name]
        if not lo <= value <= hi:
            raise InputError(f"--{name.replace('_', '-')} {value} is not allowed; use {lo} to {hi}")
        settings[name] = value
    compare = [e.strip() for e in args.compare.split(",") if e.strip()]
    for engine in compare:
        if engine not in ENGINES:
            raise InputError(f"--compare {engine!r} is not one of {', '.join(ENGINES)}")
    settings["compare"] = compare
    settings["speculative"] = None
    if args.speculative:
        k = DEFAULT_DRAFT if args.num_draft_tokens is None else args.num_draft_tokens
        if not 1 <= k <= MAX_DRAFT:
            raise InputError(f"--num-draft-tokens {k} is not allowed; use 1 to {MAX_DRAFT}")
        settings["speculative"] = dict(num_draft_tokens=k, prompt_lookup=PROMPT_LOOKUP,
                                       draft_model=args.draft_model)
    elif args.num_draft_tokens is not None or args.draft_model:
        raise InputError("--num-draft-tokens and --draft-model go with --speculative")
    return settings


def model_info(model, config, source, path, load_s) -> dict:
    return dict(source=str(source), path=str(path), model_type=config.model_type,
                parameters=parameter_counts(config)["total"],
                weights_gb=sum(p.nbytes for _, p in tree_flatten(model.parameters())) / 1e9,
                dtype=str(model.language_model.norm.weight.dtype).replace("mlx.core.", ""),
                quantization=quant_label(config.quantization), load_s=load_s)


def _bench(args, argv) -> int:
    wall = time.perf_counter()
    settings = resolve_settings(args)
    out = check_json_path(args.json)
    if args.preset:
        raise InputError("--preset is for --plan (a preset has no weights to run); benchmarks/bench.py --preset runs "
                         "random weights in a checkout")
    if not args.model:
        raise InputError("give --model (a local folder or a Hugging Face repo id)")
    notes = []
    if "mlx-vlm" in settings["compare"] and engine_mlx_vlm.missing():
        notes.append(engine_mlx_vlm.missing())
        log(f"[bench] {notes[-1]}")
    spec = settings["speculative"]
    path = resolve_model_path(args.model, flag="--model")
    draft_path = resolve_model_path(spec["draft_model"], flag="--draft-model") if spec and spec["draft_model"] else None
    check_media_flags(path, None, args.max_pixels)
    config = ModelConfig.from_pretrained(path)
    limit = config.text_config.max_position_embeddings
    if settings["prompt_tokens"] + settings["decode_tokens"] >= limit:
        raise InputError(f"--prompt-tokens plus --decode-tokens must stay below the model's context ({limit})")
    tic = time.perf_counter()
    model, processor = load(path, dtype=args.dtype)
    load_s = time.perf_counter() - tic
    report = dict(schema=SCHEMA, kind=KIND, created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  package=dict(name="mlx-qwen3vl", version=__version__), command=list(argv),
                  machine=machine_info(), model=model_info(model, config, args.model, path, load_s),
                  settings=settings, engines={}, notes=notes)
    log(f"[bench] {args.model}: loaded in {load_s:.1f} s; {report['model']['dtype']}, {report['model']['quantization']}")
    draft = None
    if draft_path:  # loaded once; its tokenizer and vision settings are checked against the model's
        draft = DraftModel.of(load(draft_path, dtype=args.dtype))
        draft.check(model, processor.tokenizer)
    prepared = prepare(processor, settings)
    report["engines"][OURS] = dict(info=dict(engine=OURS, version=__version__, backend=backend_of(model).describe()),
                                   results=run_ours(model, processor, prepared, settings, log, draft))
    del draft
    if "mlx-vlm" in settings["compare"] and not engine_mlx_vlm.missing():
        del model
        gc.collect()
        mx.clear_cache()  # ours is freed before mlx-vlm loads: the two never share the memory
        log("[bench] running mlx-vlm on the same inputs")
        res, note = engine_mlx_vlm.run_compare(path, {k: v[0] for k, v in prepared.items()}, settings)
        if res:
            report["engines"]["mlx-vlm"] = res
        else:
            notes.append(note)
    report["wall_s"] = time.perf_counter() - wall
    problems = validate(report)
    if problems:  # a bug of ours, not the user's: say so rather than write a file that does not conform
        notes.append("the report does not conform to its schema: " + "; ".join(problems))
    print(format_report(report), file=sys.stderr if out == "-" else sys.stdout)
    write_json(out, report)
    return 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    if args.plan:
        return run(lambda: run_plan(args))
    return run(lambda: _bench(args, ["python", "-m", "mlx_qwen3vl.bench"] + argv), interrupted="interrupted")


if __name__ == "__main__":
    sys.exit(main())
