"""CPU-path decode against BLAS thread counts, on a quiet machine and under induced contention.

    python benchmarks/cpu_threads.py --preset 2b --busy 0,2,4 --out benchmarks/results/cpu-threads-2b.json

For each contention level the script starts that many busy-loop processes (each bounded by
`timeout`, killed when the level is done), then alternates, step by step, a decode step of the CPU
path with 1 and with 2 BLAS threads, the same step under the thread policy as shipped
(mlx_qwen3vl.cpu.threads), and the plain MLX graph's step; and a 1 GB numpy GEMV with 1 and 2
threads. Medians of `--reps`, seconds. Beside each level it records what the policy reads (the
machine's runnable tasks and CPU pressure) so its thresholds can be checked against the timings.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402

import mlx_qwen3vl  # noqa: E402,F401  (loads the BLAS before mlx.core)
import mlx.core as mx  # noqa: E402


def busy_loops(n, seconds):
    """n single-core busy loops, each killed by `timeout` after `seconds` at the latest."""
    return [subprocess.Popen(["timeout", str(int(seconds)), "sh", "-c", "while :; do :; done"]) for _ in range(n)]


def stop(procs):
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait()


def main(argv=None):
    from harness.measure import dump, machine_info
    from harness.preset_folders import PRESETS, build_preset
    from profile_cpu import decode_step_at

    from mlx_qwen3vl.cpu import threads
    from mlx_qwen3vl.model import Qwen3VLForConditionalGeneration
    from mlx_qwen3vl.weights import load_model
    from mlx_qwen3vl import cpu

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="2b", choices=list(PRESETS))
    p.add_argument("--busy", default="0,2,4", help="busy-loop processes per level")
    p.add_argument("--ctx", type=int, default=273)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="decode steps in a row per variant and rep (seconds per step reported)")
    p.add_argument("--no-mlx", action="store_true", help="skip the plain MLX graph's step")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    path = build_preset(args.preset)
    base = load_model(path, dtype=mx.float32, backend="mlx")
    model = Qwen3VLForConditionalGeneration(base.config)
    model.update(base.parameters())
    cpu.install(model)
    step_cpu = decode_step_at(model, args.ctx)
    step_mlx = decode_step_at(base, args.ctx)
    big = np.random.default_rng(0).random((int(1e9 / 4) // 4096, 4096), dtype=np.float32)
    xb = np.ones((1, 4096), np.float32)
    cores = threads.cores()

    def with_threads(n, fn, k=1):
        def run():
            threads.configure(n)
            for _ in range(k):
                fn()
        return run

    def policy_steps():  # as in a generation: the policy re-reads the machine between and within steps
        threads.configure("auto")
        for _ in range(args.steps):
            step_cpu()
            chosen.append(threads.blas_pool().current)

    k = args.steps
    variants = {"cpu_1_thread": with_threads(1, step_cpu, k), f"cpu_{cores}_threads": with_threads(cores, step_cpu, k),
                "cpu_policy": policy_steps,
                "gemv_1gb_1_thread": with_threads(1, lambda: np.matmul(xb, big.T)),
                f"gemv_1gb_{cores}_threads": with_threads(cores, lambda: np.matmul(xb, big.T))}
    if not args.no_mlx:
        variants["mlx_graph"] = with_threads(cores, step_mlx, k)
    env = {k: os.environ[k] for k in ("OPENBLAS_THREAD_TIMEOUT", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MKL_THREADING_LAYER",
                                      "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS") if k in os.environ}
    out = dict(machine=machine_info(), preset=args.preset, ctx=args.ctx, blas=threads.describe(), env=env, levels={},
               note="seconds, medians of reps alternated variant by variant; cpu_policy = the thread count "
                    "mlx_qwen3vl.cpu.threads picks at each step; signals = what the policy read between steps")
    for n in [int(b) for b in args.busy.split(",") if b.strip()]:
        procs = busy_loops(n, 600)
        try:
            time.sleep(2.0)  # let the scheduler and the pressure average see them
            times = {k: [] for k in variants}
            signals, chosen = [], []
            for rep in range(args.reps + 1):
                for name, fn in variants.items():
                    tic = time.perf_counter()
                    fn()
                    if rep:
                        times[name].append(time.perf_counter() - tic)
                signals.append(threads.signals())
            level = {name: statistics.median(v) / (1 if name.startswith("gemv") else k) for name, v in times.items()}
            level["gemv_gbs"] = {name: big.nbytes / v / 1e9 for name, v in level.items() if name.startswith("gemv")}
            level["decode_tps"] = {name: 1 / v for name, v in level.items()
                                   if not name.startswith("gemv") and isinstance(v, float)}
            level["signals"] = signals
            level["policy_threads"] = chosen
            level["load_average"] = os.getloadavg()
            out["levels"][f"busy_{n}"] = level
            print(f"busy {n}: " + ", ".join(f"{k} {v:.1f}" for k, v in level["decode_tps"].items())
                  + " tok/s; GEMV " + ", ".join(f"{k} {v:.1f}" for k, v in level["gemv_gbs"].items()) + " GB/s; "
                  + f"policy {chosen}; runnable others {[g['runnable_others'] for g in signals]}, "
                  + f"pressure {[g['cpu_pressure'] for g in signals]}", file=sys.stderr, flush=True)
        finally:
            stop(procs)
        time.sleep(1.0)
    threads.configure(None)
    dump(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
