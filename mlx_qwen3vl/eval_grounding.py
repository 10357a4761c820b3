"""`python -m mlx_qwen3vl.eval_grounding`: the evaluation command, whose code is mlx_qwen3vl/agent/eval_grounding.py."""

import sys

from .agent.eval_grounding import *  # noqa: F401,F403
from .agent.eval_grounding import main

if __name__ == "__main__":
    sys.exit(main())
