"""What content-keyed prefix reuse costs: hashing one screenshot's preprocessed pixels against
preprocessing it, per turn (prompt_cache.content_hash, issue #19); and what ChatSession adds per
new screenshot by reading each turn's media when the turn is sent (issue #27): the file read and
decoded (as it always was), a private read-only copy of the RGB pixels, and one BLAKE3 hash of
them, its content key (chat_session.snapshot_image).

Input: bench_preprocess's 1920x1080 UI-like screenshot with the Qwen3-VL Instruct processor
configs (tests/fixtures/tokenizer). Median and min of --repeat runs after one warm-up.

    PYTHONPATH=.:benchmarks python benchmarks/bench_media_hash.py [--repeat 7]
"""

import argparse
import hashlib
import os
import statistics
import tempfile

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
    from mlx_qwen3vl.media import load_image
    from mlx_qwen3vl.chat_session import content_hash, snapshot_image

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

    with tempfile.TemporaryDirectory() as tmp:  # the agent's screen.png
        path = os.path.join(tmp, "screen.png")
        image.save(path, format="PNG")
        rgb = load_image(path)
        read = timed(lambda: load_image(path), args.repeat)
        snap = timed(lambda: snapshot_image(path), args.repeat)
        key = timed(lambda: content_hash(rgb, rgb.shape), args.repeat)
        from_pil = timed(lambda: snapshot_image(image), args.repeat)
        print(f"turn read   PNG file ({os.path.getsize(path) / 1e6:.2f} MB) -> RGB {rgb.shape}: "
              f"read+decode median {read[0]:.1f} ms, min {read[1]:.1f} ms")
        print(f"snapshot    read+decode+copy+hash median {snap[0]:.1f} ms, min {snap[1]:.1f} ms; "
              f"from a PIL image median {from_pil[0]:.1f} ms")
        print(f"content key BLAKE3 of the {rgb.nbytes / 1e6:.1f} MB RGB median {key[0]:.1f} ms, min {key[1]:.1f} ms "
              f"({key[0] / pre[0]:.1%} of preprocessing)")


if __name__ == "__main__":
    main()
