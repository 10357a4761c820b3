"""Convert a Qwen3-VL checkpoint to mlx_qwen3vl's MLX layout: `python convert.py --help`.

A thin wrapper around `python -m mlx_qwen3vl.convert` (same flags)."""

import sys

from mlx_qwen3vl.convert import main

if __name__ == "__main__":
    sys.exit(main())
