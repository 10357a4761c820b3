"""Ops in the MLX graph of one decode step and of one vision block: ours (the plain MLX graph,
backend="mlx") against mlx-vlm's, on the same tiny weights (tests/fixtures/tiny-a and its
mlx-vlm conversion, tests/fixtures/mlxvlm-float). The graph of a step is the same at any width,
so the tiny model's counts are those of the 2B model per layer.

    python benchmarks/graph_ops.py [--out benchmarks/results/graph-ops.json]

Each graph is written with mx.export_to_dot and its primitives counted by kind (weights and
evaluated cache buffers are inputs, not ops).
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


def count_ops(*outputs, settle=()):
    """Primitives in the graph of outputs; then outputs and `settle` (e.g. cache states) are
    evaluated, so the next count starts from evaluated inputs."""
    dot = io.StringIO()
    mx.export_to_dot(dot, *outputs)
    mx.eval(outputs, settle)
    kinds = collections.Counter(re.findall(r'label ="([^"]+)", shape=rectangle', dot.getvalue()))
    return {"total": sum(kinds.values()), "by_kind": dict(kinds.most_common())}


def prompt_ids(n=20):
    return np.arange(100, 100 + n, dtype=np.int32)[None]


def ours():
    from mlx_qwen3vl.generate import decode_step
    from mlx_qwen3vl.weights import load_model

    model = load_model(FIXTURES / "tiny-a", backend="mlx")
    ids = prompt_ids()
    cache = model.make_cache()
    mx.eval(model(ids, cache=cache))
    token, pos = mx.array([7]), mx.array([ids.shape[1]])

    def step(token):
        logits = decode_step(model, token, cache, pos, None)
        for c in cache:
            c.trim(1)  # the same context every trace
        return mx.argmax(logits, -1)

    out = {"decode_step": count_ops(step(token), settle=[c.state for c in cache])}
    layer = model.language_model.layers[0]
    x = mx.random.normal((1, 1, model.config.text_config.hidden_size))
    mx.eval(x)
    rope = model.language_model.rotary(pos, 1)  # built once per step, for every layer
    out["decoder_layer"] = count_ops(layer(x, rope, None, cache[0]), settle=[cache[0].state])
    cache[0].trim(1)
    inputs = np.load(FIXTURES / "cases" / "image.npz")
    visual = model.visual
    layout = visual.layout(inputs["image_grid_thw"])
    h = mx.random.normal((layout.hw_positions.shape[0], visual.config.hidden_size))
    cos, sin = visual._rotary.cos_sin(layout.hw_positions)
    mx.eval(h, cos, sin)
    block = lambda h: visual.blocks[0](h, cos, sin, layout.segments)
    out["vision_block"] = count_ops(block(h))
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
    report = {"mlx": mx.__version__, "ours": ours(), "mlx-vlm": mlx_vlm()}
    for key in ("decode_step", "decoder_layer", "vision_block"):
        print(f"{key:14s} ours {report['ours'][key]['total']:5d}   mlx-vlm {report['mlx-vlm'][key]['total']:5d}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
