"""Where the CPU time of the 2B preset goes, on the CPU path and on the plain MLX graph.

    python benchmarks/profile_cpu.py --preset 2b --out benchmarks/results/profile-2b-cpu-kernels.json

Measured in one process, the variants interleaved (the machine may be shared): matrix-vector and
matrix-matrix products over the decoder's real weights through MLX (cblas_sgemm of whatever BLAS
blas.py loaded) and through numpy's own BLAS; a decode step at two context lengths; one
decoder layer over a 256-token prefill chunk. Each backend variant is a model of its own over the
same weight arrays (loaded once). Medians of `--reps`; seconds.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402

import mlx_qwen3vl  # noqa: E402,F401  (loads the BLAS before mlx.core)
import mlx.core as mx  # noqa: E402


def median_time(fn, reps):
    from harness.measure import repeat_times

    return statistics.median(repeat_times(fn, reps))


def interleaved(variants, reps):
    """{name: median seconds} for {name: (setup, fn)}, the variants alternated rep by rep."""
    times = {name: [] for name in variants}
    for _ in range(reps + 1):
        for name, (setup, fn) in variants.items():
            setup()
            tic = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - tic)
    return {name: statistics.median(t[1:]) for name, t in times.items()}


def variants(path):
    """{name: model}: the backends, each a model of its own over one set of weights."""
    from mlx_qwen3vl import cpu, language
    from mlx_qwen3vl.model import Qwen3VLForConditionalGeneration
    from mlx_qwen3vl.weights import load_model

    base = load_model(path, dtype=mx.float32, backend="mlx")

    def twin(ops=None, decode_stack=True):
        model = Qwen3VLForConditionalGeneration(base.config)
        model.update(base.parameters())  # the same arrays, no copy
        cpu.install(model, ops)
        if not decode_stack:  # the CPU path's linears, attention and activations, the layers in MLX
            model.language_model.__class__ = language.TextModel
        return model

    return {"mlx": base, "numpy linears, layer in MLX": twin(decode_stack=False),
            "numpy, no C extension": twin("numpy"), "numpy": twin()}


def decode_step_at(model, ctx):
    """A greedy decode step over a random KV cache of `ctx` tokens, the same context every call."""
    gen = sys.modules["mlx_qwen3vl.generate"]
    cfg = model.language_model.config
    shape = (1, cfg.num_key_value_heads, ctx, cfg.head_dim)
    cache = model.make_cache()
    for c in cache:
        c.update_and_fetch(mx.random.normal(shape), mx.random.normal(shape))
    mx.eval([c.state for c in cache])
    token, pos = mx.array([100]), mx.array([ctx])

    def step():
        mx.eval(mx.argmax(gen.decode_step(model, token, cache, pos), -1))
        for c in cache:
            c.trim(1)  # the same context every time
    return step


def main(argv=None):
    from harness.measure import decode_bytes_per_token, dump, machine_info
    from harness.preset_folders import PRESETS, build_preset
    from mlx_qwen3vl import blas as _blas

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="2b", choices=list(PRESETS))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    path = build_preset(args.preset)
    models = variants(path)
    model = models["numpy"]
    text = model.language_model
    out = {"machine": machine_info(), "blas": _blas.describe(), "preset": args.preset,
           "note": "seconds, medians; 'mlx' = the plain MLX graph (backend='mlx'), "
                   "'numpy' = the CPU path as shipped (a decode step's stack in numpy and the C extension), "
                   "'numpy linears, layer in MLX' = the CPU path without its decode stack, "
                   "'numpy, no C extension' = MLX_QWEN3VL_CPU_KERNELS=numpy (the C extension's work in numpy)"}

    # Every decoder weight (and the tied LM head) once: what a decode step must read.
    weights = [w for layer in text.layers for w in (
        layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight,
        layer.self_attn.o_proj.weight, layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight,
        layer.mlp.down_proj.weight)] + [text.embed_tokens.weight]
    nbytes = sum(w.nbytes for w in weights)
    xs = {k: mx.random.normal((1, k)) for k in {w.shape[1] for w in weights}}
    mx.eval(*xs.values())
    np_w = [np.asarray(w) for w in weights]
    np_x = {k: np.asarray(v) for k, v in xs.items()}

    def numpy_gemvs():  # every weight a decode step reads, once, back to back
        for w in np_w:
            np.matmul(np_x[w.shape[1]], w.T)

    gemv = interleaved({
        "mlx": (lambda: None, lambda: mx.eval([xs[w.shape[1]] @ w.T for w in weights])),
        "numpy": (lambda: None, numpy_gemvs),
    }, args.reps)
    out["decode_gemvs_all_weights_s"] = gemv
    out["decode_gemvs_gbs"] = {k: nbytes / v / 1e9 for k, v in gemv.items()}
    out["decode_bytes"] = nbytes

    w = text.layers[0].mlp.gate_proj.weight
    x = mx.random.normal((256, w.shape[1]))
    mx.eval(x)
    gemm = interleaved({
        "mlx": (lambda: None, lambda: mx.eval(x @ w.T)),
        "numpy": (lambda: None, lambda: np.matmul(np.asarray(x), np.asarray(w).T)),
    }, args.reps)
    flops = 2 * x.shape[0] * w.size
    out["gemm_256x2048x6144_s"] = gemm
    out["gemm_256x2048x6144_gflops"] = {k: flops / v / 1e9 for k, v in gemm.items()}

    for ctx in (273, 2117):
        out[f"decode_step_ctx{ctx}_s"] = interleaved(
            {name: (lambda: None, decode_step_at(m, ctx)) for name, m in models.items()}, args.reps)

    # Decode against the bandwidth of the same moment: this shared VM's bandwidth drifts by ±15% or
    # more within minutes, so a decode step (the CPU kernels as shipped), the step's GEMVs alone
    # (every weight once, back to back) and a 1 GB numpy GEMV alternate rep by rep, and each triple
    # gives one share; medians are reported. The share splits into how fast the step's GEMVs
    # stream against the 1 GB one (`gemvs_vs_bandwidth`) and how much of the step they are
    # (`gemvs_of_step`; the rest is everything around them).
    big = np.random.default_rng(0).random((int(1e9 / 4) // 4096, 4096), dtype=np.float32)
    xb = np.ones((1, 4096), np.float32)
    for ctx in (273, 2117):
        step = decode_step_at(model, ctx)
        per_token = decode_bytes_per_token(dict(text.config.__dict__), model.config.tie_word_embeddings, 4, ctx)
        rows = []
        for rep in range(2 * args.reps + 1):
            times = []
            for fn in (step, numpy_gemvs, lambda: np.matmul(xb, big.T)):
                tic = time.perf_counter()
                fn()
                times.append(time.perf_counter() - tic)
            if rep:  # the first triple warms up
                step_s, gemvs_s, big_s = times
                bw = big.nbytes / big_s / 1e9
                rows.append(dict(share=per_token / (bw * 1e9) / step_s, step=step_s, bw=bw,
                                 gemvs_vs_bw=nbytes / gemvs_s / 1e9 / bw, gemvs_of_step=gemvs_s / step_s))
        col = lambda key: [r[key] for r in rows]
        out[f"decode_roofline_interleaved_ctx{ctx}"] = dict(
            share_median=statistics.median(col("share")), share_min=min(col("share")), share_max=max(col("share")),
            gemvs_vs_bandwidth_median=statistics.median(col("gemvs_vs_bw")),
            gemvs_of_step_median=statistics.median(col("gemvs_of_step")),
            step_s_median=statistics.median(col("step")), bandwidth_gbs_median=statistics.median(col("bw")),
            bandwidth_gbs_max=max(col("bw")), bytes_per_token=per_token, pairs=len(rows))
    big = None

    h = mx.random.normal((1, 256, text.config.hidden_size))
    mx.eval(h)

    def prefill_layer(m):
        lm = m.language_model
        layer = lm.layers[min(3, len(lm.layers) - 1)]
        return lambda: mx.eval(layer(h, lm.rotary(mx.array([0]), h.shape[1]), "causal", m.make_cache()[0]))

    out["prefill_layer_L256_s"] = interleaved({name: (lambda: None, prefill_layer(models[name]))
                                               for name in ("mlx", "numpy")}, args.reps)
    dump(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
