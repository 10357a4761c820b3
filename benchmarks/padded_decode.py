"""One decode step of rows of different lengths (left-padded: the server's continuous batch of
agents with different histories) on the CPU path, through the decode stack against the per-module
path it used to take (the stack refusing a padding mask, as before), interleaved rep by rep.

    python benchmarks/padded_decode.py MODEL_DIR [--rows 12] [--reps 5] [--kv-bits 0|4|8]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mlx_qwen3vl as M  # noqa: E402  (loads the BLAS before mlx.core)
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from mlx_qwen3vl.cpu import decode  # noqa: E402
from mlx_qwen3vl.engine.prefill import prefill  # noqa: E402
from mlx_qwen3vl.engine.step import decode_step  # noqa: E402
from mlx_qwen3vl.kv_settings import KVSettings  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--rows", type=int, default=12)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--kv-bits", type=int, default=0)
    args = ap.parse_args()
    model, _ = M.load(args.model, backend="cpu")
    kv = KVSettings(args.kv_bits, 64, 0).fit(64) if args.kv_bits else KVSettings()
    rng = np.random.default_rng(0)
    lengths = [int(n) for n in np.linspace(50, 300, args.rows)]  # turns of 50-300 tokens
    caches, positions = [], []
    for n in lengths:
        cache = model.make_cache()
        ids = rng.integers(1000, 50000, (1, n))
        _, pos = prefill(model, {"input_ids": mx.array(ids), "attention_mask": mx.ones((1, n))}, cache, kv=kv)
        caches.append(cache)
        positions.append(pos)
    merged = [type(layer[0]).merge(layer) for layer in zip(*caches)]
    positions = mx.concatenate(positions)
    tokens = mx.array(rng.integers(1000, 50000, args.rows))
    stack = decode.applies
    ways = {"decode stack": stack, "per-module (before)": lambda x, p, mask, c: mask is None and stack(x, p, mask, c)}
    times, logits = {name: [] for name in ways}, {}
    for rep in range(args.reps + 1):
        for name, rule in ways.items():
            decode.applies = rule
            start = time.perf_counter()
            logits[name] = decode_step(model, tokens, merged, positions, merged[0].key_mask(1))
            mx.eval(logits[name])
            if rep:  # the first is a warm-up
                times[name].append(time.perf_counter() - start)
            for c in merged:  # back to the same cache for the next step
                c.trim(1)
    decode.applies = stack
    print(f"{args.rows} rows of {lengths[0]}-{lengths[-1]} tokens, kv_bits {args.kv_bits or 'float'}")
    a, b = (np.array(v) for v in logits.values())
    print(f"  logits: max difference {np.abs(a - b).max():.2e} (of max {np.abs(b).max():.2f}), "
          f"argmax equal in {int((a.argmax(-1) == b.argmax(-1)).sum())} of {len(a)} rows")
    for name, t in times.items():
        print(f"  {name}: median {statistics.median(t):.3f} s, best {min(t):.3f} s a step")


if __name__ == "__main__":
    main()
