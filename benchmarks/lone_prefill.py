"""A lone request's prefill on the default CPU path, phase by phase, for one checkout of this
repo (run it once per checkout, alternating, to compare commits: `--root`): the vision tower
alone, the library's whole prefill (vision + decoder, no engine), and the entry point
(`stream_generate(inputs=..., max_tokens=1)`: whatever the runtime adds around the prefill),
each after an untimed warm-up, best of `--repeat`, in wall and process CPU seconds (every thread).

    python benchmarks/lone_prefill.py --model <h-mid folder> --root . --out a.json
    python benchmarks/lone_prefill.py --model <h-mid folder> --root <other checkout> --out b.json

Runs in a fresh process per call (the checkout's package is imported from `--root`)."""

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def worker(args):
    sys.path.insert(0, args.root)
    import mlx_qwen3vl as M  # before mlx.core: it loads the optimized BLAS
    import mlx.core as mx
    import numpy as np
    from PIL import Image

    try:
        from mlx_qwen3vl.engine.prefill import prefill
    except ImportError:  # the commit before the engine
        from mlx_qwen3vl.generate import prefill
    from mlx_qwen3vl.generate import encode_prompt, stream_generate

    model, processor = M.load(args.model)
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 255, (args.size, args.size, 3), np.uint8))
    inputs = encode_prompt(processor, "Describe the picture.", images=[img])
    n = int(np.asarray(inputs["input_ids"]).shape[1])

    def vision():
        f = model.get_image_features(mx.array(inputs["pixel_values"]), mx.array(inputs["image_grid_thw"]))
        mx.eval(f.embeds, f.deepstack)

    def whole():
        logits, _ = prefill(model, inputs, model.make_cache())
        mx.eval(logits)

    def entry():
        for _ in stream_generate(model, processor, inputs=inputs, max_tokens=1):
            pass

    phases = {"vision": vision, "prefill": whole, "stream_generate": entry}
    for fn in phases.values():
        fn()  # warm-up
    out = {}
    for _ in range(args.repeat):
        for name, fn in phases.items():
            w, c = time.perf_counter(), time.process_time()
            fn()
            w, c = time.perf_counter() - w, time.process_time() - c
            best = out.setdefault(name, {"wall_s": [], "cpu_s": []})
            best["wall_s"].append(w)
            best["cpu_s"].append(c)
    from mlx_qwen3vl.cpu import threads

    print(json.dumps({"root": args.root, "prompt_tokens": n, "phases": out, "load": os.getloadavg(),
                      "threads": getattr(threads, "describe", lambda: None)()}))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--root", default=os.path.dirname(HERE))
    p.add_argument("--size", type=int, default=448)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--worker", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    root = os.path.abspath(args.root)
    cmd = [sys.executable, __file__, "--worker", "--model", args.model, "--root", root, "--size", str(args.size),
           "--repeat", str(args.repeat)]
    res = subprocess.run(cmd, cwd=root, env={**os.environ, "PYTHONPATH": root}, capture_output=True, text=True)
    if res.returncode:
        sys.exit(res.stderr[-3000:])
    row = json.loads(res.stdout.strip().splitlines()[-1])
    for name, r in row["phases"].items():
        print(f"{name:16s} wall best {min(r['wall_s']):6.2f} s  cpu best {min(r['cpu_s']):6.2f} s  "
              f"({row['prompt_tokens']} tokens, load {row['load'][0]:.2f})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
