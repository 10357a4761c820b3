"""The plain MLX graph against mlx-vlm's, layer for layer, at the 2B preset's shapes: one decoder
layer over a 273-token prompt (prefill) and for one token over that cache (decode), one vision
block over a 448x448 image's 1024 patches, and each layer's matmuls alone (what bounds it). Both
engines' modules get the same random float32 weights; MKL serves MLX's matmuls in both (our BLAS
loader runs first). Variants alternate rep by rep; medians per round, best of `--rounds`.

    python benchmarks/layer_speed.py [--reps 7] [--rounds 2] [--out benchmarks/results/layer-speed-2b.json]

Needs ~1 GB, not the whole 2B model, so it runs where a full bench cannot.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import mlx_qwen3vl  # noqa: E402,F401  (loads the BLAS before mlx.core)
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten, tree_unflatten  # noqa: E402

PROMPT, PATCHES = 273, 1024


def same_weights(a: nn.Module, b: nn.Module, seed=0):
    """Random float32 weights into a, then the same arrays into b (matching parameter names)."""
    rng = np.random.default_rng(seed)
    params = {k: mx.array(rng.standard_normal(v.shape, dtype=np.float32) * np.float32(0.02))
              if "norm" not in k else mx.ones(v.shape) for k, v in tree_flatten(a.parameters())}
    a.update(tree_unflatten(list(params.items())))
    b.update(tree_unflatten(list(params.items())))
    mx.eval(a.parameters(), b.parameters())


def build():
    from mlx_vlm.models.cache import KVCache as VlmKVCache
    from mlx_vlm.models.qwen3_vl import language as vlm_language, vision as vlm_vision
    from mlx_vlm.models.qwen3_vl.config import TextConfig as VlmTextConfig, VisionConfig as VlmVisionConfig
    from mlx_lm.models.cache import KVCache

    from harness.presets import preset_config
    from mlx_qwen3vl import language, vision
    from mlx_qwen3vl.config import ModelConfig

    raw = preset_config("2b")
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(raw))
        cfg = ModelConfig.from_pretrained(tmp)
    tc, vc = cfg.text_config, cfg.vision_config
    vlm_tc = VlmTextConfig(**{k: v for k, v in raw["text_config"].items()
                              if k in VlmTextConfig.__dataclass_fields__})
    vlm_vc = VlmVisionConfig(**{k: v for k, v in raw["vision_config"].items()
                                if k in VlmVisionConfig.__dataclass_fields__})

    ours_layer, vlm_layer = language.DecoderLayer(tc), vlm_language.Qwen3VLDecoderLayer(vlm_tc, 0)
    same_weights(ours_layer, vlm_layer)
    ours_block, vlm_block = vision.VisionBlock(vc), vlm_vision.Qwen3VLMoEVisionBlock(vlm_vc)
    same_weights(ours_block, vlm_block, seed=1)
    rotary = language.TextRotary(tc.head_dim, tc.rope_theta, tc.mrope_section)

    x = mx.random.normal((1, PROMPT, tc.hidden_size), key=mx.random.key(0))
    x1 = mx.random.normal((1, 1, tc.hidden_size), key=mx.random.key(1))
    pos3 = mx.broadcast_to(mx.arange(PROMPT)[None, None], (3, 1, PROMPT))
    pos_next = mx.full((3, 1, 1), PROMPT)
    h = mx.random.normal((PATCHES, vc.hidden_size), key=mx.random.key(2))
    mx.eval(x, x1, pos3, pos_next, h)

    def filled(cache_type, fill):
        c = cache_type()
        fill(c)
        mx.eval(c.state)
        return c

    ours_cache = filled(KVCache, lambda c: ours_layer(x, rotary(pos3, PROMPT), "causal", c))
    vlm_cache = filled(VlmKVCache, lambda c: vlm_layer(x, "causal", c, pos3))

    def decode(layer_call, cache):
        def run():
            mx.eval(layer_call())
            cache.trim(1)
        return run

    grid = np.array([[1, 32, 32]])
    vis = vision.VisionModel(vc)  # only for its host-side layout and rotary (weights never evaluated)
    layout = vis.layout(grid)
    cos, sin = vis._rotary.cos_sin(layout.hw_positions)
    vlm_rot = vlm_vision.VisionModel(vlm_vc).rot_pos_emb(mx.array(grid)).reshape(PATCHES, -1)  # as its __call__
    cu = mx.array([0, PATCHES], dtype=mx.int32)
    mx.eval(cos, sin, vlm_rot, cu)

    lin = lambda layer: [m for _, m in layer.named_modules() if isinstance(m, nn.Linear)]

    def matmuls(linears, rows):
        xs = {m.weight.shape[1]: mx.random.normal((rows, m.weight.shape[1])) for m in linears}
        mx.eval(list(xs.values()))
        return lambda: mx.eval([m(xs[m.weight.shape[1]]) for m in linears])

    return {
        "decoder_layer_prefill_273": {
            "ours": lambda: mx.eval(ours_layer(x, rotary(pos3, PROMPT), "causal", KVCache())),
            "mlx-vlm": lambda: mx.eval(vlm_layer(x, "causal", VlmKVCache(), pos3)),
            "matmuls only": matmuls(lin(ours_layer), PROMPT),
        },
        "decoder_layer_decode_ctx273": {
            "ours": decode(lambda: ours_layer(x1, rotary(mx.array([PROMPT]), 1), None, ours_cache), ours_cache),
            "mlx-vlm": decode(lambda: vlm_layer(x1, None, vlm_cache, pos_next), vlm_cache),
            "matmuls only": matmuls(lin(ours_layer), 1),
        },
        "vision_block_1024": {
            "ours": lambda: mx.eval(ours_block(h, cos, sin, layout.segments)),
            "mlx-vlm": lambda: mx.eval(vlm_block(h, cu_seqlens=cu, rotary_pos_emb=vlm_rot)),
            "matmuls only": matmuls(lin(ours_block), PATCHES),
        },
    }


def interleaved(variants, reps):
    times = {name: [] for name in variants}
    for name, fn in variants.items():
        fn()  # warm
    for _ in range(reps):
        for name, fn in variants.items():
            tic = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - tic)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from harness.measure import machine_info

    cases = build()
    rounds = [{case: interleaved(v, args.reps) for case, v in cases.items()} for _ in range(args.rounds)]
    best = {case: {name: min(r[case][name] for r in rounds) for name in cases[case]} for case in cases}
    out = {"machine": machine_info(), "note": "seconds, medians of interleaved reps; best of rounds", "rounds": rounds,
           "best": best, "ours_speedup": {c: b["mlx-vlm"] / b["ours"] for c, b in best.items()},
           "matmul_share_ours": {c: b["matmuls only"] / b["ours"] for c, b in best.items()}}
    for case, b in best.items():
        print(f"{case:30s} ours {b['ours'] * 1e3:8.1f} ms  mlx-vlm {b['mlx-vlm'] * 1e3:8.1f} ms  "
              f"-> {b['mlx-vlm'] / b['ours']:.2f}x   matmuls alone {b['matmuls only'] * 1e3:8.1f} ms "
              f"({b['matmuls only'] / b['ours']:.0%} of ours)")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1, default=float) + "\n")


if __name__ == "__main__":
    main()
