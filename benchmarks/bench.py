"""Benchmark mlx_qwen3vl, side by side with mlx-vlm and transformers.

    python benchmarks/bench.py --preset 2b                          # our engine, every workload
    python benchmarks/bench.py --preset 2b --compare mlx-vlm,transformers --out benchmarks/results/x.json
    python benchmarks/bench.py --model Qwen/Qwen3-VL-2B-Instruct --workloads image448,text256
    python benchmarks/bench.py --preset tiny --workloads text256 --decode-tokens 4   # smoke test

`--preset 2b|4b|8b|30b-a3b` builds the published Qwen3-VL Instruct architecture with random weights once,
as a hub folder (bfloat16 safetensors, hub key names, transformers-4.57 config layout, the test
fixture's tokenizer and chat template) under benchmarks/models/, so every engine loads the same
files and nothing is downloaded. `tiny` is a small one for the test suite; `moe-small` is
30B-A3B's layer shapes (128 experts of 768, top-8, hidden 2048) with two layers. A preset whose
weights do not fit the memory available is refused up front.

Every engine runs in its own worker process started by this one (same machine, same run, same
inputs): peak memory is per engine, and a "default" engine loads only what its users get. Inputs
are preprocessed once, here, with our processor; each worker times from ready inputs to tokens:

  vision_s      images/videos through the vision tower (evaluated, timed on its own)
  ttft_s        ready inputs → first token (vision + prompt prefill + first sample)
  prefill_tps   prompt tokens / (ttft_s - vision_s)
  decode_tps    (decode_tokens - 1) / (time of last token - time of first token), EOS ignored, greedy
  peak_memory_gb  MLX's peak allocation (mx.get_peak_memory) for MLX engines; for torch the
                process's peak resident set
  peak_rss_gb   the process's peak resident set (VmHWM, reset per workload), for every engine:
                the figure memory ratios use (our CPU kernels' numpy arrays are outside MLX's count)
  roofline      decode_tps × bytes read per token (weights + KV cache) ÷ memory bandwidth, the
                bandwidth measured in the same worker right after the workload (best of a large
                MLX reduction, a large GEMV in MLX and the same GEMV through numpy's BLAS)

The agent loop is 5 turns, each a new 1280×720 screenshot plus a short instruction with the
history kept: ours once with ChatSession (KV cache reused between turns) and once with a fresh
generate over the whole conversation each turn (`--agent-variants`); mlx-vlm (`--compare-workloads
agent`) as its users can run it: a fresh generate over the whole conversation each turn, since it
reuses a multi-turn prefix only when the new turn has no image. Total seconds each, including
preprocessing (our processor for every engine).
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # this checkout's mlx_qwen3vl, which harness/ builds on

from harness.worker_mlx_vlm import worker_mlx_vlm  # noqa: E402
from harness.worker_ours import worker_ours  # noqa: E402
from harness.worker_transformers import worker_transformers  # noqa: E402
from harness.measure import log, machine_info  # noqa: E402
from harness.preset_folders import MODELS, PRESETS, ROOT, build_preset, memory_available_gb, preset_gb  # noqa: E402
from harness.analysis import analyze, available, print_tables, run_worker  # noqa: E402
from harness.workloads import ALL_WORKLOADS, WARMUP, prepare_inputs  # noqa: E402

WORKERS = {"ours": worker_ours, "mlx-vlm": worker_mlx_vlm, "transformers": worker_transformers}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="local checkpoint folder or Hugging Face repo id")
    src.add_argument("--preset", choices=list(PRESETS), help="random-weight published architecture")
    p.add_argument("--workloads", default=",".join(ALL_WORKLOADS), help=f"comma list of {', '.join(ALL_WORKLOADS)}")
    p.add_argument("--decode-tokens", type=int, default=32, help="tokens decoded per workload (EOS ignored)")
    p.add_argument("--agent-turns", type=int, default=5)
    p.add_argument("--agent-tokens", type=int, default=8, help="answer tokens per agent turn")
    p.add_argument("--agent-variants", default="reuse,no_reuse",
                   help="our agent loop: with KV-cache reuse (ChatSession) and/or a fresh generate each turn")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="our compute dtype (default: the engine's, float32 on a CPU)")
    p.add_argument("--backend", choices=["auto", "mlx", "cpu"], default="auto",
                   help="our backend: the CPU path where it fits (auto), the plain MLX graph a GPU runs, or cpu")
    p.add_argument("--prefill-step-size", type=int, default=2048)
    p.add_argument("--bandwidth-gb", type=float, default=1.0, help="array size of the bandwidth measurement")
    p.add_argument("--warmup", type=int, default=0, help="untimed 2-token runs per workload first")
    p.add_argument("--compare", default="", help="comma list of mlx-vlm, transformers")
    p.add_argument("--compare-dtypes", default="default,float32",
                   help="for each compared engine: 'default' (what its users get: the checkpoint's dtype, "
                        "nothing preloaded) and/or a dtype run like for like (our BLAS loaded into mlx-vlm)")
    p.add_argument("--compare-workloads", default=None, help="workloads for compared engines (default: all but agent; mlx-vlm also runs agent)")
    p.add_argument("--extrapolate", default="", help="mlx-vlm workloads too slow to run whole in bfloat16: "
                                                     "timed per block and summed by depth (e.g. image1080)")
    p.add_argument("--skip-ours", action="store_true", help="only run the compared engines")
    p.add_argument("--ours-from", default=None, help="take our results from this earlier results JSON "
                                                     "(same model) instead of running our engine again")
    p.add_argument("--python", default=None, help="interpreter for the workers (default: this one)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per worker")
    p.add_argument("--out", default=None, help="results JSON (default: benchmarks/results/<model>.json)")
    p.add_argument("--models-dir", default=str(MODELS))
    p.add_argument("--verbose", action="store_true", help="print the BLAS in use and each step")
    p.add_argument("--reanalyze", metavar="FILE", help="recompute rooflines and ratios of a results JSON in place")
    p.add_argument("--worker", nargs=3, metavar=("ENGINE", "SPEC", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:
        engine, spec_path, out_path = args.worker
        if engine == "ours":
            import mlx_qwen3vl  # noqa: F401  (loads the optimized BLAS before mlx.core)
        result = WORKERS[engine](args, json.loads(Path(spec_path).read_text()))
        Path(out_path).write_text(json.dumps(result, indent=1, default=float))
        return 0

    if args.reanalyze:
        report = json.loads(Path(args.reanalyze).read_text())
        cfg = json.loads((Path(report["path"]) / "config.json").read_text())
        text_cfg = cfg.get("text_config", cfg)
        analyze(report, text_cfg, cfg.get("tie_word_embeddings", text_cfg.get("tie_word_embeddings", False)))
        Path(args.reanalyze).write_text(json.dumps(report, indent=1, default=float))
        print_tables(report)
        return 0

    import mlx_qwen3vl
    from mlx_qwen3vl import blas as _blas
    from mlx_qwen3vl.config import ModelConfig
    from mlx_qwen3vl.hub import resolve_model_path

    if args.verbose:
        log(f"[mlx_qwen3vl] BLAS: {_blas.describe()}")
    if args.preset:
        dtype_bytes = 2 if args.dtype in ("float16", "bfloat16") else 4
        need, have = preset_gb(args.preset, dtype_bytes), memory_available_gb()
        if need > 0.8 * have:
            p.error(f"preset {args.preset} holds {need:.1f} GB of weights in {args.dtype or 'float32'} and this machine "
                    f"has {have:.1f} GB available: run it where memory allows (or a smaller preset)")
        path = build_preset(args.preset, args.models_dir, log)
        label = f"preset {args.preset} (random weights)"
    else:
        path = resolve_model_path(args.model or "Qwen/Qwen3-VL-2B-Instruct")
        label = str(args.model)
    path = Path(path)
    config = ModelConfig.from_pretrained(path)
    processor = mlx_qwen3vl.Processor.from_pretrained(path)
    names = [w for w in args.workloads.split(",") if w]
    for w in names:
        if w not in ALL_WORKLOADS:
            p.error(f"unknown workload {w!r}; one of {', '.join(ALL_WORKLOADS)}")
    for v in args.agent_variants.split(","):
        if v and v not in ("reuse", "no_reuse"):
            p.error(f"unknown agent variant {v!r}; one of reuse, no_reuse")
    compare = [e for e in args.compare.split(",") if e]
    compare_names = [w for w in (args.compare_workloads.split(",") if args.compare_workloads else
                                 [n for n in names if n != "agent"]) if w]
    inputs, pre = prepare_inputs(sorted(set(names) | set(compare_names)) + [WARMUP], processor)
    report = dict(model=label, path=str(path), machine=machine_info(), started=time.strftime("%Y-%m-%d %H:%M:%S"),
                  settings=dict(backend=args.backend, decode_tokens=args.decode_tokens, agent_turns=args.agent_turns,
                                agent_tokens=args.agent_tokens, prefill_step_size=args.prefill_step_size,
                                workloads=names, compare=compare, compare_workloads=compare_names),
                  engines={}, ratios={}, notes=[])
    text_cfg = dict(config.text_config.__dict__)
    with tempfile.TemporaryDirectory() as tmp:
        npz = Path(tmp) / "inputs.npz"
        np.savez(npz, **{f"{w}/{k}": v for w, d in inputs.items() for k, v in d.items()})
        base = dict(model=str(path), inputs=str(npz), decode_tokens=args.decode_tokens, warmup=args.warmup,
                    bandwidth_gb=args.bandwidth_gb,
                    prefill_step_size=args.prefill_step_size, agent_turns=args.agent_turns, agent_tokens=args.agent_tokens,
                    agent_variants=[v for v in args.agent_variants.split(",") if v])
        if args.ours_from:
            report["engines"]["ours"] = json.loads(Path(args.ours_from).read_text())["engines"]["ours"]
            report["notes"].append(f"our results are those of {Path(args.ours_from).name} (same machine, earlier run)")
        elif not args.skip_ours:
            backend = None if args.backend == "auto" else args.backend
            res, note = run_worker("ours", dict(base, workloads=names, dtype=args.dtype, backend=backend), args.python,
                                   args.timeout)
            if res:
                for name, r in res["results"].items():
                    if name in pre:
                        r["preprocess_s"] = pre[name]
                report["engines"]["ours"] = res
            else:
                report["notes"].append(note)
        for engine in compare:
            missing = available(engine) if not args.python else None
            if missing:
                report["notes"].append(f"{engine} skipped: {missing}")
                log(f"[bench] {engine} skipped: {missing}")
                continue
            for mode in [m for m in args.compare_dtypes.split(",") if m]:
                dtype = None if mode == "default" else mode
                label = f"{engine}[{mode if dtype else 'default'}]"
                spec = dict(base, workloads=compare_names, dtype=dtype, same_blas=dtype is not None,
                            extrapolate=[w for w in args.extrapolate.split(",") if w] if engine == "mlx-vlm" and not dtype else [])
                log(f"[bench] running {label}")
                res, note = run_worker(engine, spec, args.python, args.timeout)
                if res:
                    report["engines"][label] = res
                else:
                    report["notes"].append(note)
    analyze(report, text_cfg, config.tie_word_embeddings)
    report["machine"]["load_average_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"{(args.preset or path.name)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=float))
    print_tables(report)
    log(f"[bench] wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
