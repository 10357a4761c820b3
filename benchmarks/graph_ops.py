"""Ops in the MLX graph of one decode step and of one vision block: ours (the plain MLX graph,
backend="mlx") against mlx-vlm's, on the same tiny weights (tests/fixtures/tiny-a and its
mlx-vlm conversion, tests/fixtures/mlxvlm-float). The graph of a step is the same at any width,
so the tiny model's counts are those of the 2B model per layer.

    python benchmarks/graph_ops.py [--out benchmarks/results/graph-ops.json]

Each graph is written with mx.export_to_dot and its primitives counted by kind (weights and
evaluated cache buffers are inputs, not ops). MLX's CPU backend builds each mx.fast op (rms_norm,
layer_norm, rope, scaled_dot_product_attention) from its fallback, several primitives; on a GPU it
is one kernel. So each graph is counted twice: as built here ("cpu"), and with every mx.fast call
counted as one op ("fused", what Metal runs), from the fast calls made while it was built.
"""

import argparse
import collections
import io
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FIXTURES = ROOT / "tests" / "fixtures"

import mlx_qwen3vl  # noqa: E402,F401  (loads the BLAS before mlx.core)
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402


FAST = ("rms_norm", "layer_norm", "rope", "scaled_dot_product_attention")
_fast_calls = []  # (name, primitives of its CPU fallback) for each mx.fast call since the last count


def _primitives(*outputs):
    dot = io.StringIO()
    mx.export_to_dot(dot, *outputs)
    return collections.Counter(re.findall(r'label ="([^"]+)", shape=rectangle', dot.getvalue()))


def _watch_fast_ops():
    """Record, for every mx.fast call, how many primitives its CPU fallback adds: the same call on
    evaluated stand-ins of its array arguments, counted alone."""
    for name in FAST:
        original = getattr(mx.fast, name)

        def watched(*args, _original=original, _name=name, **kwargs):
            stand_in = lambda a: mx.zeros(a.shape, a.dtype) if isinstance(a, mx.array) else a
            args2 = [stand_in(a) for a in args]
            kwargs2 = {k: stand_in(v) for k, v in kwargs.items()}
            mx.eval([a for a in args2 + list(kwargs2.values()) if isinstance(a, mx.array)])
            alone = _original(*args2, **kwargs2)
            _fast_calls.append((_name, sum(_primitives(alone).values())))
            return _original(*args, **kwargs)

        setattr(mx.fast, name, watched)


def count_ops(*outputs, settle=()):
    """Primitives in the graph of outputs, as built here and with each mx.fast call as one op;
    then outputs and `settle` (e.g. cache states) are evaluated, so the next count starts from
    evaluated inputs."""
    kinds = _primitives(*outputs)
    mx.eval(outputs, settle)
    total = sum(kinds.values())
    fast = collections.Counter(name for name, _ in _fast_calls)
    fused = total - sum(n for _, n in _fast_calls) + len(_fast_calls)
    _fast_calls.clear()
    return {"cpu": total, "fused": fused, "fast_calls": dict(fast), "by_kind": dict(kinds.most_common())}


def prompt_ids(n=20):
    return np.arange(100, 100 + n, dtype=np.int32)[None]


def ours():
    from mlx_qwen3vl import activations, spread
    from mlx_qwen3vl.generate import decode_step
    from mlx_qwen3vl.weights import load_model

    model = load_model(FIXTURES / "tiny-a", backend="mlx")
    ids = prompt_ids()
    cache = model.make_cache()
    mx.eval(model(ids, cache=cache))
    _fast_calls.clear()
    token, pos = mx.array([7]), mx.array([ids.shape[1]])

    def step(token):
        logits = decode_step(model, token, cache, pos, None)
        for c in cache:
            c.trim(1)  # the same context every trace
        return mx.argmax(logits, -1)

    layer = model.language_model.layers[0]
    x = mx.random.normal((1, 1, model.config.text_config.hidden_size))
    mx.eval(x)

    def decode_graphs():
        counts = {"decode_step": count_ops(step(token), settle=[c.state for c in cache])}
        rope = model.language_model.rotary(pos, 1)  # built once per step, for every layer
        counts["decoder_layer"] = count_ops(layer(x, rope, None, cache[0]), settle=[cache[0].state])
        cache[0].trim(1)
        return counts

    # "cpu" as built on this device (decode matmuls split over CPU streams, activations.py);
    # "fused" what a GPU runs: no split, each mx.fast call one kernel.
    out = decode_graphs()
    few_rows, activations.FEW_ROWS = activations.FEW_ROWS, 0
    try:
        for key, unsplit in decode_graphs().items():
            out[key]["cpu_unsplit"], out[key]["fused"] = unsplit["cpu"], unsplit["fused"]
    finally:
        activations.FEW_ROWS = few_rows
    inputs = np.load(FIXTURES / "cases" / "image.npz")
    visual = model.visual
    layout = visual.layout(inputs["image_grid_thw"])
    h = mx.random.normal((layout.hw_positions.shape[0], visual.config.hidden_size))
    cos, sin = visual._rotary.cos_sin(layout.hw_positions)
    mx.eval(h, cos, sin)
    block = lambda h: visual.blocks[0](h, cos, sin, layout.segments)
    out["vision_block"] = count_ops(block(h))
    # over this image its attention's softmax is split over CPU streams (spread.py); a GPU's block is whole
    least, spread.MIN_ELEMENTS = spread.MIN_ELEMENTS, 1 << 62
    try:
        whole = count_ops(block(h))
        out["vision_block"]["cpu_unsplit"], out["vision_block"]["fused"] = whole["cpu"], whole["fused"]
    finally:
        spread.MIN_ELEMENTS = least
    out["decoder_layers"] = len(model.language_model.layers)
    return out


def mlx_vlm():
    from mlx_vlm import load
    from mlx_vlm.models.cache import KVCache

    model, _ = load(str(FIXTURES / "mlxvlm-float"))
    lm = model.language_model
    ids = mx.array(prompt_ids())
    cache = [KVCache() for _ in lm.model.layers]
    mx.eval(model(ids, cache=cache).logits)
    _fast_calls.clear()

    def step(token):
        logits = lm(token[None], cache=cache).logits[:, -1]
        for c in cache:
            c.trim(1)
        return mx.argmax(logits, -1)

    token = mx.array([7])
    out = {"decode_step": count_ops(step(token), settle=[c.state for c in cache])}
    layer = lm.model.layers[0]
    x = mx.random.normal((1, 1, lm.model.embed_tokens.weight.shape[1]))
    positions = mx.broadcast_to(mx.array([[[20]]]), (3, 1, 1))
    mx.eval(x, positions)
    out["decoder_layer"] = count_ops(layer(x, None, cache[0], positions), settle=[cache[0].state])
    cache[0].trim(1)
    inputs = np.load(FIXTURES / "cases" / "image.npz")
    vt = model.vision_tower
    grid = mx.array(inputs["image_grid_thw"])
    n = int(np.prod(inputs["image_grid_thw"], -1).sum())
    h = mx.random.normal((n, vt.blocks[0].norm1.weight.shape[0]))
    rot = vt.rot_pos_emb(grid)
    cu = mx.array([0, n], dtype=mx.int32)
    mx.eval(h, rot, cu)
    block = lambda h: vt.blocks[0](h, cu_seqlens=cu, rotary_pos_emb=rot)
    out["vision_block"] = count_ops(block(h))
    out["decoder_layers"] = len(lm.model.layers)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    _watch_fast_ops()
    report = {"mlx": mx.__version__, "device": str(mx.default_device()), "ours": ours(), "mlx-vlm": mlx_vlm()}
    print(f"{'':14s} {'ours cpu':>9s} {'mlx-vlm cpu':>12s} {'ours fused':>11s} {'mlx-vlm fused':>14s}")
    for key in ("decode_step", "decoder_layer", "vision_block"):
        a, b = report["ours"][key], report["mlx-vlm"][key]
        print(f"{key:14s} {a['cpu']:9d} {b['cpu']:12d} {a['fused']:11d} {b['fused']:14d}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
