"""`python -m mlx_qwen3vl.ground`: the grounding command, whose code is mlx_qwen3vl/agent/ground_cli.py."""

import sys

from .agent.ground_cli import *  # noqa: F401,F403
from .agent.ground_cli import main

if __name__ == "__main__":
    sys.exit(main())
