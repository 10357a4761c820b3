"""Does the engine's decode overlap the host's work? A GPU computes a queued decode step while the
host hands out the last step's tokens and does whatever its caller does with them (a server's
streaming, an agent's parsing); if the engine waits for the step before handing its tokens out,
those host milliseconds add to every step instead.

Here the caller's work is a sleep of --host-ms per token: it takes no CPU, so on the CPU device it
stands for a GPU machine's host work without competing with the step for cores. Per decode step,
with the step queued ahead (lookahead, the plain graph's default) and without:

    python benchmarks/host_overlap.py --model FOLDER [--host-ms 0,40,80] [--tokens 24] [--rounds 3] [--dtype D]

Overlapped, a step takes max(forward, host work); serial, forward + host work.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mlx_qwen3vl as M  # noqa: E402  (loads the BLAS before mlx.core)
import numpy as np  # noqa: E402

from mlx_qwen3vl.engine import Engine, Request, Token  # noqa: E402
from mlx_qwen3vl.generate import encode_prompt  # noqa: E402


def step_seconds(model, processor, inputs, tokens, host_s, lookahead):
    """Seconds per decoded token of one greedy request, the caller sleeping host_s after each token."""
    engine = Engine(model, processor, max_batch=1, lookahead=lookahead)
    engine.add(Request(inputs, M.SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)))
    times = []
    while engine.busy:
        for ev in engine.step():
            if isinstance(ev, Token):
                times.append(time.perf_counter())
                if host_s:
                    time.sleep(host_s)
    return (times[-1] - times[1]) / (len(times) - 2)  # from the second token: the decode steps alone


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--host-ms", default="0,40,80")
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default=None, help="compute dtype (default: the engine's, float32 on a CPU)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    model, processor = M.load(args.model, dtype=args.dtype, backend="mlx")
    inputs = {k: np.asarray(v) for k, v in encode_prompt(processor, prompt="Describe a login form. " * 8).items()}
    step_seconds(model, processor, inputs, 4, 0, True)  # warm
    rows = []
    for host_ms in [float(h) for h in args.host_ms.split(",")]:
        best = {}
        for r in range(args.rounds):
            for lookahead in ((True, False) if r % 2 == 0 else (False, True)):
                s = step_seconds(model, processor, inputs, args.tokens, host_ms / 1000, lookahead)
                best[lookahead] = min(best.get(lookahead, s), s)
        rows.append({"host_ms": host_ms, "step_ms_queued_ahead": 1000 * best[True],
                     "step_ms_serial": 1000 * best[False], "load": os.getloadavg()[0]})
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"model": args.model, "tokens": args.tokens, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
