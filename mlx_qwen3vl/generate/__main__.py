"""`python -m mlx_qwen3vl.generate`: the spelling mlx-vlm users know for `python -m mlx_qwen3vl`."""

import sys

from ..__main__ import main

if __name__ == "__main__":
    sys.exit(main())
