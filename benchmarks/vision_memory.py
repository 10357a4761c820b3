"""Peak memory and time to first token for one big screenshot (1080p, 4K) on the plain MLX graph
(what a Mac runs), our default path and mlx-vlm, at vision head dims 64 and 72.

Checkpoints (random weights, written once by the benchmark harness's preset generator under
benchmarks/models/): `h-mid`, Qwen3-VL-2B's layer shapes cut to 6 decoder layers and 6 vision
blocks; `h72-mid`, the same decoder with the 4B/8B/30B-A3B vision tower's shapes (1152 wide, 16
heads of 72), 6 blocks. Each (checkpoint, screenshot, engine) runs in a process of its own, in
--dtype (float32 here: mlx-vlm cast to it too, MKL loaded into its process as into ours), after an
untimed warm-up; figures: ready inputs → first token (vision, prefill, one greedy sample), MLX's peak allocation
and the process's peak resident set over that run.

    python benchmarks/vision_memory.py [--presets h-mid,h72-mid] [--sizes 1080p,4k]
        [--engines mlx,cpu,mlx-vlm] [--depth 6] [--layers 6] [--dtype float32] [--out FILE.json]

mlx-vlm is optional (skipped when it cannot be imported). The 4K screenshot is 32,640 patches:
unchunked, one vision layer's scores alone are 68 GB.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

SIZES = {"1080p": (1920, 1080), "4k": (3840, 2160)}
ENGINES = ("mlx", "cpu", "mlx-vlm")


def log(*a):
    print("[vision_memory]", *a, file=sys.stderr, flush=True)


def register(depth, layers):
    """The h-mid shapes as presets of the harness's generator (built once, then reused)."""
    from mlx_qwen3vl.architectures import PRESETS

    taps = [i for i in (1, 3, 5) if i < depth] or [0]
    text = dict(PRESETS["2b"]["text"], num_hidden_layers=layers)
    PRESETS["h-mid"] = dict(text=text, vision=dict(PRESETS["2b"]["vision"], depth=depth, deepstack_visual_indexes=taps),
                            tie=True)
    PRESETS["h72-mid"] = dict(text=text, vision=dict(PRESETS["8b"]["vision"], depth=depth,
                                                     deepstack_visual_indexes=taps), tie=True)


def folder(preset, depth, layers):
    from harness.preset_folders import MODELS, build_preset

    register(depth, layers)
    return build_preset(preset, root=MODELS / "vision-memory" / f"{depth}x{layers}", log=log)


def worker(path, engine, size, dtype="float32"):
    import mlx_qwen3vl as M  # loads the BLAS before mlx.core, in every engine's process
    import mlx.core as mx
    import numpy as np

    from mlx_qwen3vl.bench import engine_mlx_vlm as vlm
    from mlx_qwen3vl.bench import run
    from mlx_qwen3vl.bench.inputs import screenshot_messages

    model, processor = M.load(str(path), dtype=dtype, backend="mlx" if engine == "mlx" else None)
    describe = model.backend.describe()
    inputs, preprocess_s = run.encode(processor, screenshot_messages(*SIZES[size]))
    if engine == "mlx-vlm":
        del model
        theirs, vlm_processor = vlm.load_ignoring_eos(path)
        theirs.set_dtype(getattr(mx, dtype))
        mx.eval(theirs.parameters())
        small, _ = run.encode(processor, screenshot_messages(320, 200))
        list(vlm.tokens(theirs, vlm_processor, {k: np.asarray(v) for k, v in small.items()}, 2))  # warm-up
        result = vlm.timed_run(theirs, vlm_processor, {k: np.asarray(v) for k, v in inputs.items()}, 1)
        describe = f"mlx-vlm {vlm.version()}"
    else:
        run.warm_up(model, processor)
        result = run.timed_run(model, processor, inputs, 1)
    grid = np.asarray(inputs["image_grid_thw"])[0].tolist()
    return dict(result, engine=engine, backend=describe, size=size, patches=int(np.prod(grid)), grid=grid,
                preprocess_s=preprocess_s, load_average=os.getloadavg()[0])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", default="h-mid,h72-mid")
    p.add_argument("--sizes", default="1080p,4k")
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--depth", type=int, default=6, help="vision blocks (6: h-mid)")
    p.add_argument("--layers", type=int, default=6, help="decoder layers (6: h-mid)")
    p.add_argument("--dtype", default="float32", help="compute dtype of every engine (a GPU: bfloat16)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "vision-memory.json"))
    p.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)  # PATH ENGINE SIZE DTYPE
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker)))
        return
    rows = []
    for preset in args.presets.split(","):
        path = folder(preset, args.depth, args.layers)
        for size in args.sizes.split(","):
            for engine in args.engines.split(","):
                if engine == "mlx-vlm":
                    from mlx_qwen3vl.bench import engine_mlx_vlm

                    if engine_mlx_vlm.missing():
                        log(engine_mlx_vlm.missing())
                        continue
                env = dict(os.environ)
                if engine != "cpu":
                    env.pop("MLX_QWEN3VL_CPU_KERNELS", None)
                tic = time.perf_counter()
                proc = subprocess.run([sys.executable, __file__, "--worker", str(path), engine, size, args.dtype],
                                      env=env, capture_output=True, text=True, timeout=args.timeout)
                if proc.returncode != 0:
                    row = dict(engine=engine, size=size, error=(proc.stderr.strip().splitlines() or ["?"])[-1],
                               returncode=proc.returncode)
                else:
                    row = json.loads(proc.stdout.strip().splitlines()[-1])
                row.update(preset=preset, dtype=args.dtype, depth=args.depth, layers=args.layers,
                           wall_s=time.perf_counter() - tic)
                rows.append(row)
                log(json.dumps({k: row.get(k) for k in ("preset", "size", "engine", "ttft_s", "peak_memory_gb",
                                                         "peak_rss_gb", "load_average", "error")}))
                Path(args.out).write_text(json.dumps(rows, indent=1))
    print(f"{'checkpoint':10} {'screenshot':10} {'engine':8} {'patches':>8} {'TTFT s':>8} {'MLX peak GB':>12} "
          f"{'peak RSS GB':>12} {'load':>5}")
    for r in rows:
        if "error" in r:
            print(f"{r['preset']:10} {r['size']:10} {r['engine']:8} failed: {r['error']}")
            continue
        print(f"{r['preset']:10} {r['size']:10} {r['engine']:8} {r['patches']:8d} {r['ttft_s']:8.1f} "
              f"{r['peak_memory_gb']:12.2f} {r['peak_rss_gb']:12.2f} {r['load_average']:5.1f}")


if __name__ == "__main__":
    main()
