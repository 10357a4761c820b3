"""One mixture-of-experts block at 30B-A3B's shapes (128 experts of 768, top-8, hidden 2048, float32):
the plain MLX graph (mlx-lm's SwitchGLU over mx.gather_mm, what mlx-vlm runs too) against the
CPU path's experts (cpu/experts.py), decode against the roofline of its active weights.

    python benchmarks/moe_layer.py [--tokens 256] [--reps 9]

Decode: one token, ms per block, and the share of the roofline (the router plus the 8 chosen
experts' weights, 151 MB, read at the bandwidth measured in the same process). Prefill: `--tokens`
tokens through the block. Runs alternate between the two paths (the machine may be shared).
Needs ~3 GB.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import mlx_qwen3vl  # noqa: E402,F401  (the optimized BLAS before mlx.core)
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_map  # noqa: E402

from harness.measure import measure_bandwidth  # noqa: E402
from mlx_qwen3vl.config import TextConfig  # noqa: E402
from mlx_qwen3vl.cpu import layers  # noqa: E402
from mlx_qwen3vl.moe import SparseMoeBlock  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args()
    config = TextConfig(hidden_size=2048, intermediate_size=6144, num_hidden_layers=1, num_attention_heads=32,
                        vocab_size=16, head_dim=128, num_experts=128, num_experts_per_tok=8,
                        moe_intermediate_size=768)
    plain = SparseMoeBlock(config)
    mx.random.seed(0)
    plain.update(tree_map(lambda w: mx.random.normal(w.shape) * 0.02, plain.parameters()))
    mx.eval(plain.parameters())
    cpu = SparseMoeBlock(config)
    cpu.update(plain.parameters())
    cpu.__class__ = layers.SparseMoeBlock
    D, k, E, I = 2048, 8, 128, 768
    active = (D * E + k * 3 * D * I) * 4

    def timed(block, x):
        tic = time.perf_counter()
        mx.eval(block(x))
        return time.perf_counter() - tic

    decode = {"mlx": [], "cpu": []}
    for i in range(args.reps + 1):
        x = mx.random.normal((1, 1, D), key=mx.random.key(100 + i))
        mx.eval(x)
        for name, block in (("mlx", plain), ("cpu", cpu)) if i % 2 else (("cpu", cpu), ("mlx", plain)):
            t = timed(block, x)
            if i:  # the first round warms up
                decode[name].append(t)
    bw = measure_bandwidth(1.0, reps=5)["bandwidth_gbs"]
    x = mx.random.normal((1, args.tokens, D), key=mx.random.key(7))
    mx.eval(x)
    prefill = {name: timed(block, x) for name, block in (("cpu", cpu), ("mlx", plain))}
    same = float(np.abs(np.array(cpu(x)) - np.array(plain(x))).max())
    import os

    print(f"bandwidth {bw:.1f} GB/s, active weights {active / 1e6:.0f} MB per token, load average "
          f"{os.getloadavg()[0]:.1f}")
    for name in ("mlx", "cpu"):
        ms = statistics.median(decode[name]) * 1e3
        print(f"{name:>4}: decode {ms:7.1f} ms/token ({active / (ms / 1e3) / 1e9 / bw:5.0%} of the roofline), "
              f"prefill {args.tokens} tokens {prefill[name]:6.2f} s")
    print(f"max |cpu - mlx| over the prefill output: {same:.2e}")


if __name__ == "__main__":
    main()
