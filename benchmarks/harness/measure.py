"""What a worker measures besides tokens: memory peaks, read bandwidth (the roofline's
denominator), CPU time, the machine; and the per-workload summary every engine reports."""

import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def repeat_times(fn, reps):
    """Seconds of each of `reps` calls of fn, after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        tic = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tic)
    return times


def dump(result, path=None):
    """Print a result as JSON, and write it to `path` when given."""
    text = json.dumps(result, indent=1, default=float)
    print(text)
    if path:
        Path(path).write_text(text)


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def fmt(r):
    parts = []
    for key, f in (("vision_s", "vision {:.2f}s"), ("ttft_s", "TTFT {:.2f}s"), ("prefill_tps", "prefill {:.1f} tok/s"),
                   ("decode_tps", "decode {:.2f} tok/s"), ("peak_memory_gb", "MLX peak {:.2f} GB"),
                   ("peak_rss_gb", "peak RSS {:.2f} GB")):
        if r.get(key) is not None:
            parts.append(f.format(r[key]))
    return f"{r['prompt_tokens']} prompt tokens, " + ", ".join(parts)


def fresh_mlx_measurement():
    """Free what earlier work left and restart the peak-memory counters (MLX's and the RSS)."""
    import mlx.core as mx

    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    rss_reset()


def rss_reset():
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def rss_peak_gb():
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    import resource

    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 1e9


def measure_bandwidth(gb=1.0, reps=7):
    """Read bandwidth (GB/s): a GEMV over a large float32 matrix (what decode does) in MLX, the same
    GEMV through numpy's BLAS, and an MLX reduction, median of `reps` each. The best of them is the
    roofline: MLX's CPU matmul reaches only what MKL's sgemm gives a matrix-vector product (about
    20 GB/s on the 2-core EPYC), numpy's OpenBLAS GEMV over 30, and the machine is what it is.
    Without MLX (the transformers worker), the numpy GEMV alone."""
    try:
        import mlx.core as mx
    except ImportError:
        mx = None
    n = int(gb * 1e9 / 4)
    cols = 4096
    rng = np.random.default_rng(0)
    an = rng.random((n // cols, cols), dtype=np.float32)
    xn = rng.random((1, cols), dtype=np.float32)

    def timed(fn, sync=lambda r: r):
        sync(fn())
        ts = []
        for _ in range(reps):
            tic = time.perf_counter()
            sync(fn())
            ts.append(time.perf_counter() - tic)
        return an.nbytes / statistics.median(ts) / 1e9

    out = {"numpy_gemv_gbs": timed(lambda: xn @ an.T)}
    if mx is not None:
        a, x = mx.array(an), mx.array(xn)
        mx.eval(a, x)
        out.update(sum_gbs=timed(lambda: a.sum(), mx.eval), gemv_gbs=timed(lambda: x @ a.T, mx.eval))
        a = x = None
    an = xn = None  # free the matrix before the model loads / the next workload runs
    gc.collect()
    if mx is not None:
        mx.clear_cache()
    out["bandwidth_gbs"] = max(v for k, v in out.items() if k.endswith("_gbs"))
    return out


def workload_bandwidth(spec):
    """The bandwidth again, right after a workload's decode: on a shared machine it drifts within
    minutes (21-41 GB/s here within one 17-minute run), so the roofline compares each decode with
    the bandwidth of the same moment. Taken after the workload's peak memory was read."""
    return measure_bandwidth(spec.get("bandwidth_gb", 1.0), reps=5)["bandwidth_gbs"]


def decode_bytes_per_token(cfg_text, tie, dtype_bytes, context):
    """Bytes read per decoded token: every decoder weight, the LM head (the embedding table when
    tied; one embedding row otherwise, ignored) and the KV cache at `context` tokens. An MoE
    layer's weights read are its router and the k experts a token selects (the active weights)."""
    d, L, f = cfg_text["hidden_size"], cfg_text["num_hidden_layers"], cfg_text["intermediate_size"]
    hq, hkv, hd, V = cfg_text["num_attention_heads"], cfg_text["num_key_value_heads"], cfg_text["head_dim"], cfg_text["vocab_size"]
    experts = cfg_text.get("num_experts") or cfg_text.get("num_local_experts") or 0
    step, dense_only = cfg_text.get("decoder_sparse_step") or 1, cfg_text.get("mlp_only_layers") or []
    weights = d + V * d
    for i in range(L):
        sparse = experts and i not in dense_only and (i + 1) % step == 0
        mlp = d * experts + cfg_text["num_experts_per_tok"] * 3 * d * cfg_text["moe_intermediate_size"] if sparse \
            else 3 * d * f
        weights += d * hq * hd * 2 + d * hkv * hd * 2 + mlp + 2 * d + 2 * hd
    kv = 2 * L * hkv * hd * context
    return (weights + kv) * dtype_bytes


_cpu_mark = [0.0]


def start_clock():
    """Mark the start of a workload: CPU seconds of this process (all threads) from here on show
    how much of the machine it actually got (the machine may be shared)."""
    _cpu_mark[0] = time.process_time()


def summarize(name, n_prompt, vision_s, ttft, token_times, peak_gb, extra=None):
    n = len(token_times)
    decode = (n - 1) / (token_times[-1] - token_times[0]) if n > 1 else 0.0
    llm = max(ttft - vision_s, 1e-9)
    out = dict(workload=name, prompt_tokens=int(n_prompt), vision_s=vision_s, ttft_s=ttft,
               prefill_tps=n_prompt / llm, decode_tokens=n, decode_tps=decode, peak_memory_gb=peak_gb,
               peak_rss_gb=rss_peak_gb(), cpu_s=time.process_time() - _cpu_mark[0],
               load_average=os.getloadavg()[0] if hasattr(os, "getloadavg") else None)
    out["wall_s"] = token_times[-1] - token_times[0] + ttft if n else ttft
    out.update(extra or {})
    return out


def engine_info(name, module=None):
    info = {"engine": name}
    try:
        import mlx.core as mx

        info["mlx"] = mx.__version__
        info["backend"] = str(mx.default_device())
    except ImportError:
        pass
    if module:
        import importlib.metadata as md

        try:
            info["version"] = md.version(module.replace("_", "-"))
        except md.PackageNotFoundError:
            pass
    return info


def machine_info():
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        try:
            cpu = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True).stdout.strip() or cpu
        except OSError:
            pass
    mem = None
    try:
        mem = int(Path("/proc/meminfo").read_text().split()[1]) * 1024 / 1e9
    except OSError:
        pass
    import mlx.core as mx

    from mlx_qwen3vl import blas as _blas

    gpu = None
    try:
        if mx.metal.is_available():
            gpu = mx.metal.device_info().get("device_name") if hasattr(mx.metal, "device_info") else "Metal"
    except Exception:
        pass
    return dict(cpu=cpu, cores=os.cpu_count(), memory_gb=mem, platform=platform.platform(),
                python=platform.python_version(), mlx=mx.__version__, backend=str(mx.default_device()),
                gpu=gpu, blas=_blas.describe(), mkl_threading_layer=os.environ.get("MKL_THREADING_LAYER"),
                load_average=os.getloadavg() if hasattr(os, "getloadavg") else None)


def time_workload(engine, name, n_prompt, vision_time, tokens, spec):
    """One workload's figures: `tokens()` yields once per generated token (each already computed);
    `vision_time` is the list the engine's vision timer appends to. Memory peaks restart first,
    and the bandwidth is measured again right after."""
    import mlx.core as mx

    fresh_mlx_measurement()
    vision_time.clear()
    times = []
    start_clock()
    tic = time.perf_counter()
    for _ in tokens():
        times.append(time.perf_counter())
    peak = mx.get_peak_memory() / 1e9
    result = summarize(name, n_prompt, sum(vision_time), times[0] - tic, times, peak)
    result["bandwidth_gbs"] = workload_bandwidth(spec)
    log(f"[{engine}] {name}: {fmt(result)}")
    return result
