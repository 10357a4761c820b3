"""One model on 1 rank against the same model split over 2 ranks (`mlx.launch --backend ring`).

    python benchmarks/bench_distributed.py --preset 2b                 # 1 rank vs 2 ranks, text and image
    python benchmarks/bench_distributed.py --preset 2b --configs 2:heads --workloads image448
    python benchmarks/bench_distributed.py --preset tiny --decode-tokens 4   # smoke test

Configurations (`--configs`, comma separated): `1:cpu` (one process, the CPU fast path as `load`
installs it), `1:mlx` (one process, the plain MLX graph: what the ranks run), `2:replicate` (two
ranks, vision tower replicated), `2:heads` (two ranks, vision tower split by heads), `2:pipeline`
(two ranks, the layers split: pipeline.py). Every rank is
one process on this machine, talking over 127.0.0.1. Each worker reports, per rank:

  load_s, load_peak_gb    loading time; MLX's peak allocation and the process's peak RSS after load
  weights_gb              bytes of the parameters this rank holds
  bytes_read_gb           tensor bytes this rank read from the safetensors files (sharded_load.read_stats;
                          one process reads them all: the files' tensor bytes)
  ttft_s, vision_s        ready inputs → first token; the vision tower alone (timed apart)
  decode_tps              greedy decode, EOS ignored, (N - 1) / (time of token N - time of token 1)
  peak_rss_gb             the process's peak resident set over everything it did
  comm                    measured on one decode step, and on a 64-token text prefill (comm.prefill):
                          the collectives it calls (counted by wrapping
                          mx.distributed.all_sum / all_gather / send / recv_like while the step's
                          graph is built: number and bytes per rank), the step's time with them and
                          with each replaced by a local stand-in of the same shape, and those
                          collectives alone, chained as in the step, on this ring

Workloads are bench.py's (text256, image448, ...) and textN (a text prompt of N tokens);
`--load-only` loads and reports memory and bytes read, nothing else.
The preset's folder is bench.py's (benchmarks/models/, built once). 2B in float32 needs ~10 GB for
one process and ~6 GB per rank: the driver refuses to start when less than --min-free-gb is free.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

CONFIGS = ["1:cpu", "1:mlx", "2:replicate", "2:heads", "2:pipeline"]


# ------------------------------------------------------------------------------------- worker
def _rss_peak_gb():
    from harness.measure import rss_peak_gb

    return rss_peak_gb()


def _file_tensor_bytes(path):
    from mlx_qwen3vl.sharded_load import open_views
    from mlx_qwen3vl.weights import weight_files

    files, _ = weight_files(Path(path))
    return sum(v.size * v.stored_itemsize for f in files for v in open_views(f).values())


def _collectives_measured(step, group, steps):
    """The collectives `step()` calls (and their bytes), its time with them and with local stand-ins
    of the same shapes, and those collectives alone, chained as in the step (median of `steps` - 1
    after a warm one)."""
    import mlx.core as mx

    from harness.measure import repeat_times

    # send / recv_like: the pipeline's hand-off between stages (tensor parallel calls neither).
    real = {name: getattr(mx.distributed, name) for name in ("all_sum", "all_gather", "send", "recv_like")}
    calls = []

    def recording(name):
        def call(x, *args, **kwargs):
            calls.append((name, tuple(x.shape), x.dtype, x.nbytes, args))
            return real[name](x, *args, **kwargs)
        return call

    local = {"all_sum": lambda x, *a, **kw: x,
             "all_gather": lambda x, *a, **kw: mx.concatenate([x] * group.size()),
             "send": lambda x, *a, **kw: x,
             "recv_like": lambda x, *a, **kw: mx.zeros_like(x)}

    def step_times(fns):
        for name, fn in fns.items():
            setattr(mx.distributed, name, fn)
        try:
            times = []
            for _ in range(steps):
                tic = time.perf_counter()
                step()
                times.append(time.perf_counter() - tic)
        finally:
            for name, fn in real.items():
                setattr(mx.distributed, name, fn)
        return times[1:]

    step_times({name: recording(name) for name in real})
    per_step = calls[: len(calls) // steps]
    with_comm = step_times(real)
    without = step_times(local)

    def collectives():
        x = None
        for name, shape, dtype, _, args in per_step:
            z = mx.zeros(shape, dtype) if x is None else mx.zeros(shape, dtype) + x.reshape(-1)[0].astype(dtype)
            x = real[name](z, *args, group=group)
        mx.eval(x)

    alone = repeat_times(collectives, 10)
    kinds = {}
    for name, shape, dtype, nbytes, _ in per_step:
        k = kinds.setdefault(f"{name} {shape} {str(dtype).split('.')[-1]}", dict(count=0, bytes=0))
        k["count"] += 1
        k["bytes"] += nbytes
    return dict(collectives=len(per_step), bytes=sum(c[3] for c in per_step), kinds=kinds,
                step_ms=1e3 * float(np.median(with_comm)), step_without_ms=1e3 * float(np.median(without)),
                alone_ms=1e3 * float(np.median(alone)), alone_min_ms=1e3 * float(np.min(alone)),
                step_all_ms=[1e3 * t for t in with_comm], step_without_all_ms=[1e3 * t for t in without])


def _comm_measured(model, processor, group, prompt_tokens=64, steps=6):
    """Communication measured (_collectives_measured) on one decode step, and on the prefill of a
    text prompt of `prompt_tokens` (what bounds TTFT)."""
    import mlx.core as mx

    from mlx_qwen3vl.generate import decode_step, encode_prompt, prefill

    inputs = encode_prompt(processor, messages=_messages(f"text{prompt_tokens}", processor)[0])
    cache = model.make_cache()
    logits, positions = prefill(model, inputs, cache)
    state = dict(y=mx.argmax(logits, axis=-1), positions=positions)
    mx.eval(state["y"])

    def decode():
        # Each step takes the last one's token, as decoding does: a pipeline's stages cannot then
        # overlap one step with the next.
        state["y"] = mx.argmax(decode_step(model, state["y"], cache, state["positions"]), axis=-1)
        mx.eval(state["y"])
        state["positions"] = state["positions"] + 1

    def prompt():
        mx.eval(prefill(model, inputs, model.make_cache())[0])

    per_token = _collectives_measured(decode, group, steps)
    out = dict(per_token, collectives_per_token=per_token.pop("collectives"),
               bytes_per_token=per_token.pop("bytes"))
    out["prefill"] = dict(_collectives_measured(prompt, group, 4), prompt_tokens=prompt_tokens)
    return out


def _messages(name, processor):
    """bench.py's workloads, plus textN: a text prompt of N tokens (short runs on a busy machine)."""
    from harness.workloads import ALL_WORKLOADS, _text_prompt, workload_messages

    if name.startswith("text") and name not in ALL_WORKLOADS:
        return [{"role": "user", "content": [{"type": "text", "text": _text_prompt(processor, int(name[4:]))}]}], {}
    return workload_messages(name, processor)


def vision_worker(spec):
    """The vision tower alone (random weights, the preset's shapes), replicated and split by heads,
    on one image: median seconds of a few forwards per mode."""
    import mlx.core as mx

    from mlx_qwen3vl import distributed
    from mlx_qwen3vl.config import ModelConfig
    from mlx_qwen3vl.vision import VisionModel

    group = mx.distributed.init()
    cfg = ModelConfig.from_pretrained(Path(spec["model"])).vision_config
    side = spec["image_side"] // 16
    pixels = mx.random.normal((side * side, 3 * 2 * 16 * 16))  # one image: (1, side, side) patches
    grid = np.array([[1, side, side]])
    out = dict(config=spec["config"], rank=group.rank(), image_side=spec["image_side"], results={})
    for mode in ("replicate", "heads"):
        mx.random.seed(0)
        model = VisionModel(cfg)
        model.set_dtype(mx.float32)
        if mode == "heads" and group.size() > 1:
            distributed._shard_vision(model, group)
        mx.eval(model.parameters())
        times = []
        for _ in range(spec["reps"] + 1):
            tic = time.perf_counter()
            merged, deepstack = model(pixels, grid)
            mx.eval(merged, *deepstack)
            times.append(time.perf_counter() - tic)
        out["results"][mode] = dict(vision_s=float(np.min(times[1:])), all_s=times,
                                    load_average=os.getloadavg()[0])
        del model
    Path(spec["out"], f"rank{group.rank()}.json").write_text(json.dumps(out))


def worker(spec_path):
    # mlx_qwen3vl before mlx.core: the package loads MKL for MLX's cblas calls only if it comes
    # first (blas.py). The other order left every rank on netlib's reference BLAS (9 against
    # 210 GFLOP/s for a 1024² float32 matmul here): 2B's 448² image on 2 ranks ran past 460 s.
    import mlx_qwen3vl as M
    from mlx_qwen3vl import blas

    if blas.describe().startswith("reference"):
        print(f"[bench-dist] warning: MLX runs on {blas.describe()}", file=sys.stderr, flush=True)
    spec = json.loads(Path(spec_path).read_text())
    if spec.get("vision_only"):
        return vision_worker(spec)
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlx_qwen3vl import distributed, sharded_load
    from mlx_qwen3vl.generate import encode_prompt, generate_tokens
    from harness.workloads import WARMUP

    group = mx.distributed.init()
    rank = group.rank()
    sharded_load.reset_read_stats()
    tic = time.perf_counter()
    if group.size() > 1:
        model, processor = distributed.load_sharded(spec["model"], group, vision=spec["vision"],
                                                    parallel=spec.get("parallel", "tensor"))
    else:
        model, processor = M.load(spec["model"])
    load_s = time.perf_counter() - tic
    out = dict(config=spec["config"], rank=rank, load_s=load_s, load_peak_mlx_gb=mx.get_peak_memory() / 1e9,
               load_peak_rss_gb=_rss_peak_gb(),
               weights_gb=sum(v.nbytes for _, v in tree_flatten(model.parameters())) / 1e9,
               bytes_read_gb=(sharded_load.read_stats()["bytes"] if group.size() > 1
                              else _file_tensor_bytes(spec["model"])) / 1e9,
               file_tensor_gb=_file_tensor_bytes(spec["model"]) / 1e9,
               backend=getattr(model, "backend", None) and model.backend.name, blas=blas.describe(), results={})
    for name in [] if spec.get("load_only") else [WARMUP] + spec["workloads"]:
        messages, kw = _messages(name, processor)
        inputs = encode_prompt(processor, messages=messages, **kw)
        n_tokens = 4 if name == WARMUP else spec["decode_tokens"]
        vision_s = 0.0
        if "pixel_values" in inputs and name != WARMUP:  # the vision tower alone, before the timed run
            tic = time.perf_counter()
            feats = model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
            mx.eval(feats.embeds, *feats.deepstack)
            vision_s = time.perf_counter() - tic
        if group.size() > 1:  # start together: a rank without the vision tower skipped the timing above
            mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group))
        times = []
        tic = time.perf_counter()
        for y in generate_tokens(model, processor, inputs, max_tokens=n_tokens):
            y.item()
            times.append(time.perf_counter())
        if name == WARMUP:
            continue
        n = len(times)
        out["results"][name] = dict(
            prompt_tokens=int(np.asarray(inputs["input_ids"]).shape[1]), ttft_s=times[0] - tic,
            vision_s=vision_s, decode_tps=(n - 1) / (times[-1] - times[0]) if n > 1 else 0.0,
            load_average=os.getloadavg()[0])
    out["peak_rss_gb"] = _rss_peak_gb()
    out["peak_mlx_gb"] = mx.get_peak_memory() / 1e9
    if group.size() > 1 and not spec.get("load_only"):
        out["comm"] = _comm_measured(model, processor, group)
    Path(spec["out"], f"rank{rank}.json").write_text(json.dumps(out))


# ------------------------------------------------------------------------------------- driver
def _available_gb():
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1e6
    return float("inf")


def _run_group(cmd, env, timeout):
    """Run `cmd` in its own process group; past `timeout`, kill the whole group (mlx.launch's ranks
    too: killing only the launcher left workers running, which took the machine's 2 cores)."""
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        print(f"[bench-dist] timed out after {timeout} s; killed its process group", file=sys.stderr)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def run_config(config, model, args):
    ranks, mode = config.split(":")
    out = tempfile.mkdtemp(prefix="bench-dist-")
    spec = dict(config=config, model=str(model), workloads=args.workloads.split(","),
                decode_tokens=args.decode_tokens, vision=mode if mode in ("replicate", "heads") else "replicate",
                parallel="pipeline" if mode == "pipeline" else "tensor",
                out=out, vision_only=args.vision_only, image_side=args.image_side, reps=args.reps,
                load_only=args.load_only)
    spec_path = Path(out, "spec.json")
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if mode == "mlx":
        env["MLX_QWEN3VL_CPU_KERNELS"] = "mlx"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(spec_path)]
    if int(ranks) > 1:
        # Tensor parallel: one BLAS thread per rank (the ranks compute at once on this machine's
        # cores). A pipeline's stages run one after another, so --rank-threads 2 may suit it.
        n = str(args.rank_threads)
        env.update(MKL_NUM_THREADS=n, OMP_NUM_THREADS=n, OPENBLAS_NUM_THREADS=n)
        from mlx_qwen3vl.distributed import local_launch_command

        cmd = local_launch_command(int(ranks), cmd)
    print(f"[bench-dist] {config}: {' '.join(cmd[:6])} ...", file=sys.stderr, flush=True)
    p = _run_group(cmd, env, args.timeout)
    results = []
    for r in range(int(ranks)):
        f = Path(out, f"rank{r}.json")
        if not f.is_file():
            raise RuntimeError(f"{config}: rank {r} wrote no result\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
        results.append(json.loads(f.read_text()))
    return results


def print_table(report):
    print("| config | rank | load s | weights GB | bytes read GB (of the files') | load peak MLX / RSS GB "
          "| peak RSS GB |")
    print("|---|---|---|---|---|---|---|")
    for config, ranks in report["runs"].items():
        for r in ranks:
            print(f"| {config} | {r['rank']} | {r['load_s']:.1f} | {r['weights_gb']:.2f} | {r['bytes_read_gb']:.2f} "
                  f"({r['file_tensor_gb']:.2f}) | {r['load_peak_mlx_gb']:.2f} / {r['load_peak_rss_gb']:.2f} "
                  f"| {r.get('peak_rss_gb', 0):.2f} |")
    print("\n| config | rank | workload | prompt | TTFT s | vision s | decode tok/s |")
    print("|---|---|---|---|---|---|---|")
    for config, ranks in report["runs"].items():
        for r in ranks:
            for name, w in r["results"].items():
                print(f"| {config} | {r['rank']} | {name} | {w['prompt_tokens']} | {w['ttft_s']:.2f} | "
                      f"{w['vision_s']:.2f} | {w['decode_tps']:.2f} |")
    comm = [(c, r) for c, ranks in report["runs"].items() for r in ranks if "comm" in r]
    if comm:
        print("\n| config | rank | step | collectives | KB | step ms | step without ms | alone ms (min) |")
        print("|---|---|---|---|---|---|---|---|")
        for config, r in comm:
            m, p = r["comm"], r["comm"].get("prefill")
            rows = [("decode 1 token", m["collectives_per_token"], m["bytes_per_token"], m)]
            rows += [(f"prefill {p['prompt_tokens']} tokens", p["collectives"], p["bytes"], p)] if p else []
            for what, n, nbytes, t in rows:
                print(f"| {config} | {r['rank']} | {what} | {n} | {nbytes / 1e3:.0f} | {t['step_ms']:.1f} | "
                      f"{t['step_without_ms']:.1f} | {t['alone_ms']:.1f} ({t['alone_min_ms']:.1f}) |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--preset", default="2b")
    p.add_argument("--model", help="a checkpoint folder instead of a preset")
    p.add_argument("--configs", default="1:mlx,2:replicate", help=f"comma separated, of {', '.join(CONFIGS)}")
    p.add_argument("--workloads", default="text256,image448")
    p.add_argument("--decode-tokens", type=int, default=16)
    p.add_argument("--min-free-gb", type=float, default=16.0)
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--out", help="write the report (JSON) here")
    p.add_argument("--vision-only", action="store_true",
                   help="time the vision tower alone, replicated and split by heads (random weights, no checkpoint read)")
    p.add_argument("--image-side", type=int, default=448, help="--vision-only: one square image of this side")
    p.add_argument("--reps", type=int, default=2, help="--vision-only: timed forwards per mode (the best is kept)")
    p.add_argument("--rank-threads", type=int, default=1, help="BLAS threads per rank (several ranks)")
    p.add_argument("--load-only", action="store_true", help="load, report memory and bytes read, stop")
    args = p.parse_args(argv)
    if args.worker:
        return worker(args.worker)
    from harness.preset_folders import build_preset

    model = Path(args.model) if args.model else build_preset(args.preset)
    report = dict(argv=sys.argv[1:] if argv is None else list(argv), model=str(model),
                  preset=None if args.model else args.preset, runs={},
                  decode_tokens=args.decode_tokens, rank_threads=args.rank_threads, machine=dict(cpus=os.cpu_count()))
    for config in args.configs.split(","):
        if config not in CONFIGS:
            p.error(f"unknown config {config!r}; one of {', '.join(CONFIGS)}")
        free = _available_gb()
        if free < args.min_free_gb:
            print(f"[bench-dist] skipping {config}: {free:.1f} GB available < --min-free-gb {args.min_free_gb}",
                  file=sys.stderr)
            continue
        report["runs"][config] = run_config(config, model, args)
    if args.vision_only:
        print(json.dumps({c: [r["results"] for r in ranks] for c, ranks in report["runs"].items()}, indent=1))
    else:
        print_table(report)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
