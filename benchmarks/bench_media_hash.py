"""What content-keyed prefix reuse costs: hashing one screenshot's preprocessed pixels against
preprocessing it, per turn (prompt_cache.content_hash, issue #19).

Input: bench_preprocess's 1920x1080 UI-like screenshot with the Qwen3-VL Instruct processor
configs (tests/fixtures/tokenizer). Median and min of --repeat runs after one warm-up.

    PYTHONPATH=.:benchmarks python benchmarks/bench_media_hash.py [--repeat 7]
"""

import argparse
import hashlib
import statistics

from bench_preprocess import MODEL, screenshot
from harness.measure import repeat_times


def timed(fn, repeat):
    out = repeat_times(fn, repeat)
    return statistics.median(out) * 1e3, min(out) * 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=7)
    args = p.parse_args()
    from mlx_qwen3vl import Processor
    from mlx_qwen3vl.prompt_cache import content_hash

    processor = Processor.from_pretrained(MODEL)
    image = screenshot()
    pixels, grid = processor.process_images([image])
    pre = timed(lambda: processor.process_images([image]), args.repeat)
    hashed = timed(lambda: content_hash(pixels, grid[0]), args.repeat)
    fallback = timed(lambda: hashlib.blake2b(memoryview(pixels).cast("B"), digest_size=16).hexdigest(), args.repeat)
    print(f"1920x1080 screenshot -> grid {grid[0].tolist()}, pixel_values {pixels.shape} {pixels.dtype} "
          f"({pixels.nbytes / 1e6:.1f} MB)")
    print(f"preprocess  median {pre[0]:.1f} ms, min {pre[1]:.1f} ms")
    print(f"hash        median {hashed[0]:.1f} ms, min {hashed[1]:.1f} ms ({hashed[0] / pre[0]:.1%} of preprocessing)")
    print(f"blake2b     median {fallback[0]:.1f} ms, min {fallback[1]:.1f} ms (hashlib, the fallback without blake3)")


if __name__ == "__main__":
    main()
