"""The plain MLX graph against mlx-vlm's, layer for layer, at the 2B preset's shapes: one decoder
layer over a 273-token prompt (prefill) and for one token over that cache (decode), one vision
block over 1024 patches (a 512x512 image), and each layer's matmuls alone (what bounds it). Both
engines' modules get the same random float32 weights; MKL serves MLX's matmuls in both (our BLAS
loader runs first). Variants alternate rep by rep; medians per round, best of `--rounds`.

    python benchmarks/layer_speed.py [--reps 7] [--rounds 2] [--out benchmarks/results/layer-speed-2b.json]
    python benchmarks/layer_speed.py --profile [--out benchmarks/results/layer-profile-2b.json]

`--profile` times each layer op group by op group instead, for both engines: every stage of the
layer (a norm, the projections, RoPE, the KV-cache write, attention split into its CPU fallback's
parts, the activation, the residual adds...) is evaluated alone on evaluated inputs, the stages
interleaved rep by rep, and the sum of the stages is set beside the whole layer.

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


def build(models=False):
    from mlx_vlm.models.cache import KVCache as VlmKVCache
    from mlx_vlm.models.qwen3_vl import language as vlm_language, vision as vlm_vision
    from mlx_vlm.models.qwen3_vl.config import TextConfig as VlmTextConfig, VisionConfig as VlmVisionConfig
    from mlx_lm.models.cache import KVCache

    from harness.preset_folders import preset_config
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

    if models:
        return dict(ours_layer=ours_layer, vlm_layer=vlm_layer, ours_block=ours_block, vlm_block=vlm_block, x=x, pos3=pos3,
                    rotary=rotary, h=h, cos=cos, sin=sin, layout=layout, vlm_rot=vlm_rot, cu=cu)
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


def _run_stages(stages, env):
    for _, _, fn in stages:
        out = fn(env)
        mx.eval(list(out.values()))
        env.update(out)


def interleaved_medians(items, reps):
    """Median seconds of each fn of `items` ({key: fn() -> arrays}), evaluated alone, one warm-up
    call each, then every fn once per rep in turn (so a disturbance hits all alike)."""
    times = {key: [] for key in items}
    for fn in items.values():
        mx.eval(fn())
    for _ in range(reps):
        for key, fn in items.items():
            tic = time.perf_counter()
            mx.eval(fn())
            times[key].append(time.perf_counter() - tic)
    return {key: statistics.median(t) for key, t in times.items()}


def stage_items(prefix, stages, env):
    """Timed items for each stage on the evaluated inputs a first pass leaves in `env`."""
    _run_stages(stages, env)
    return {(prefix, g, n): (lambda fn=fn: list(fn(env).values())) for g, n, fn in stages}


def _fallback_attention(prefix, scale, causal):
    """The stages of MLX's SDPA as its CPU backend runs it (its fallback): scale q, q k^T over
    grouped heads, the causal mask, a precise softmax, p v."""
    def grouped(env):
        q, k = env[prefix + "q"], env[prefix + "k"]
        rep = q.shape[1] // k.shape[1]
        q = (q * scale).reshape(q.shape[0], k.shape[1], rep, q.shape[2], q.shape[3]) if rep > 1 else q * scale
        return {"sq": q}

    def scores(env):
        k = env[prefix + "k"]
        k = k[:, :, None] if env["sq"].ndim == 5 else k
        return {"s": env["sq"] @ k.swapaxes(-1, -2)}

    def mask(env):
        s = env["s"]
        L, S = s.shape[-2], s.shape[-1]
        allowed = mx.arange(S - L, S)[:, None] >= mx.arange(S)[None]
        return {"sm": mx.where(allowed, s, mx.array(-float("inf"), s.dtype))}

    def softmax(env):
        return {"p": mx.softmax(env["sm" if causal else "s"], axis=-1, precise=True)}

    def pv(env):
        v = env[prefix + "v"]
        v = v[:, :, None] if env["p"].ndim == 5 else v
        o = env["p"] @ v
        return {"pv": o.reshape(o.shape[0], -1, o.shape[-2], o.shape[-1]) if o.ndim == 5 else o}

    parts = [("attention", "scale q (SDPA fallback)", grouped), ("attention", "q k^T (SDPA fallback)", scores)]
    if causal:
        parts.append(("attention", "causal mask (SDPA fallback)", mask))
    return parts + [("attention", "softmax (SDPA fallback)", softmax), ("attention", "p v (SDPA fallback)", pv)]


def profile_cases(reps):
    """Op-group profiles of a 2B prefill decoder layer (273 tokens) and vision block (1024 patches),
    ours and mlx-vlm's, on the same weights and inputs."""
    from mlx_vlm.models.activations import swiglu
    from mlx_vlm.models.cache import KVCache as VlmKVCache
    from mlx_vlm.models.qwen3_vl import vision as vlm_vision
    from mlx_vlm.models.qwen3_vl.language import apply_multimodal_rotary_pos_emb
    from mlx_lm.models.cache import KVCache
    from mlx_qwen3vl import language
    from mlx_qwen3vl.rope import apply_rotary
    from mlx_qwen3vl.vision import ACTIVATIONS

    m = build(models=True)
    ours, vlm, blk, vblk = m["ours_layer"], m["vlm_layer"], m["ours_block"], m["vlm_block"]
    x, pos3, rotary, h = m["x"], m["pos3"], m["rotary"], m["h"]
    B, L, _ = x.shape
    a, va = ours.self_attn, vlm.self_attn
    heads = lambda t, n: t.reshape(B, L, n, -1)
    T = lambda t: t.transpose(0, 2, 1, 3)

    def cache_write(cache_type, prefix):
        def fn(env):
            k, v = cache_type().update_and_fetch(env[prefix + "rk"], env[prefix + "v"])
            return {prefix + "k": k, prefix + "v": v}
        return fn

    ours_prefill = [
        ("norms", "input RMSNorm", lambda e: {"xn": ours.input_layernorm(x)}),
        ("matmuls", "q/k/v proj", lambda e: {"q": a.q_proj(e["xn"]), "k": a.k_proj(e["xn"]), "v0": a.v_proj(e["xn"])}),
        ("norms", "q/k RMSNorm", lambda e: {"qn": T(a.q_norm(heads(e["q"], a.n_heads))),
                                            "kn": T(a.k_norm(heads(e["k"], a.n_kv_heads)))}),
        ("rope", "cos/sin tables (once per forward; /28 per layer)", lambda e: dict(zip(("cos", "sin"), rotary.cos_sin(pos3, L)))),
        ("rope", "rotate q, k", lambda e: {"q": apply_rotary(e["qn"], e["cos"], e["sin"]), "rk": apply_rotary(e["kn"], e["cos"], e["sin"]),
                                           "v": T(heads(e["v0"], a.n_kv_heads))}),
        ("kv cache", "update_and_fetch", cache_write(KVCache, "")),
        ("attention", "SDPA (whole)", lambda e: {"o": a.attend(e["q"], e["k"], e["v"], "causal")}),
        ("copies", "heads back to rows", lambda e: {"o2": T(e["o"]).reshape(B, L, -1)}),
        ("matmuls", "o proj", lambda e: {"ao": a.o_proj(e["o2"])}),
        ("residual adds", "x + attn", lambda e: {"h1": x + e["ao"]}),
        ("norms", "post-attention RMSNorm", lambda e: {"hn": ours.post_attention_layernorm(e["h1"])}),
        ("matmuls", "gate/up proj", lambda e: {"g": ours.mlp.gate_proj(e["hn"]), "u": ours.mlp.up_proj(e["hn"])}),
        ("activation", "swiglu", lambda e: {"gu": language.swiglu(e["g"], e["u"])}),
        ("matmuls", "down proj", lambda e: {"d": ours.mlp.down_proj(e["gu"])}),
        ("residual adds", "h + mlp", lambda e: {"out": e["h1"] + e["d"]}),
    ]
    vrot = va.rotary_emb
    vlm_prefill = [
        ("norms", "input RMSNorm", lambda e: {"xn": vlm.input_layernorm(x)}),
        ("matmuls", "q/k/v proj", lambda e: {"q": va.q_proj(e["xn"]), "k": va.k_proj(e["xn"]), "v0": va.v_proj(e["xn"])}),
        ("norms", "q/k RMSNorm", lambda e: {"qn": T(va.q_norm(heads(e["q"], va.n_heads))),
                                            "kn": T(va.k_norm(heads(e["k"], va.n_kv_heads)))}),
        ("rope", "cos/sin tables (once per forward; /28 per layer)", lambda e: dict(zip(("cos", "sin"), vrot(e["kn"], pos3)))),
        ("rope", "rotate q, k", lambda e: dict(zip(("q", "rk"), apply_multimodal_rotary_pos_emb(e["qn"], e["kn"], e["cos"], e["sin"])),
                                                v=T(heads(e["v0"], va.n_kv_heads)))),
        ("kv cache", "update_and_fetch", cache_write(VlmKVCache, "")),
        ("attention", "SDPA (whole)", lambda e: {"o": mx.fast.scaled_dot_product_attention(e["q"], e["k"], e["v"], scale=va.scale, mask="causal")}),
        ("copies", "heads back to rows", lambda e: {"o2": T(e["o"]).reshape(B, L, -1)}),
        ("matmuls", "o proj", lambda e: {"ao": va.o_proj(e["o2"])}),
        ("residual adds", "x + attn", lambda e: {"h1": x + e["ao"]}),
        ("norms", "post-attention RMSNorm", lambda e: {"hn": vlm.post_attention_layernorm(e["h1"])}),
        ("matmuls", "gate/up proj", lambda e: {"g": vlm.mlp.gate_proj(e["hn"]), "u": vlm.mlp.up_proj(e["hn"])}),
        ("activation", "swiglu (compiled)", lambda e: {"gu": swiglu(e["g"], e["u"])}),
        ("matmuls", "down proj", lambda e: {"d": vlm.mlp.down_proj(e["gu"])}),
        ("residual adds", "h + mlp", lambda e: {"out": e["h1"] + e["d"]}),
    ]
    N = h.shape[0]
    cos, sin, layout = m["cos"], m["sin"], m["layout"]
    ba, vba = blk.attn, vblk.attn
    nh, hd = ba.num_heads, ba.head_dim
    win = lambda t: t.reshape(1, N, nh, hd).transpose(0, 2, 1, 3)
    ours_vision = [
        ("norms", "norm1 LayerNorm", lambda e: {"xn": blk.norm1(h)}),
        ("matmuls", "qkv proj", lambda e: {"qkv": ba.qkv(e["xn"])}),
        ("rope", "rotate q, k", lambda e: (lambda q, k, v: {"qr": apply_rotary(q, cos, sin), "kr": apply_rotary(k, cos, sin), "v0": v})(
            *e["qkv"].reshape(N, 3, nh, hd).transpose(1, 0, 2, 3))),
        ("attention", "SDPA (whole)", lambda e: {"o": ba.attend(win(e["qr"]), win(e["kr"]), win(e["v0"]))}),
        ("copies", "heads back to rows", lambda e: {"o2": e["o"].transpose(0, 2, 1, 3).reshape(N, -1)}),
        ("matmuls", "out proj", lambda e: {"ao": ba.proj(e["o2"])}),
        ("residual adds", "x + attn", lambda e: {"h1": h + e["ao"]}),
        ("norms", "norm2 LayerNorm", lambda e: {"hn": blk.norm2(e["h1"])}),
        ("matmuls", "fc1", lambda e: {"f": blk.mlp.linear_fc1(e["hn"])}),
        ("activation", "gelu_tanh", lambda e: {"fa": ACTIVATIONS[blk.mlp.hidden_act](e["f"])}),
        ("matmuls", "fc2", lambda e: {"d": blk.mlp.linear_fc2(e["fa"])}),
        ("residual adds", "h + mlp", lambda e: {"out": e["h1"] + e["d"]}),
    ]
    rot = m["vlm_rot"]

    def vlm_rope(e):
        qkv = e["qkv"].reshape(N, 3, nh, -1).transpose(1, 0, 2, 3)
        q, k, v = mx.split(qkv, 3)
        q = vlm_vision.apply_rotary_pos_emb_vision(mx.expand_dims(q, 0), rot)[0]
        k = vlm_vision.apply_rotary_pos_emb_vision(mx.expand_dims(k, 0), rot)[0]
        return {"qr": q.transpose(0, 2, 1, 3), "kr": k.transpose(0, 2, 1, 3), "v0": v.transpose(0, 2, 1, 3)}

    vlm_vis = [
        ("norms", "norm1 LayerNorm", lambda e: {"xn": vblk.norm1(h)}),
        ("matmuls", "qkv proj", lambda e: {"qkv": vba.qkv(e["xn"])}),
        ("rope", "rotate q, k (cos/sin per call)", vlm_rope),
        ("attention", "SDPA (whole)", lambda e: {"o": mx.concatenate([mlx_vlm_sdpa(e["qr"], e["kr"], e["v0"], vba.scale)], axis=2)}),
        ("copies", "heads back to rows", lambda e: {"o2": e["o"].transpose(0, 2, 1, 3).reshape(N, -1)}),
        ("matmuls", "out proj", lambda e: {"ao": vba.proj(e["o2"])}),
        ("residual adds", "x + attn", lambda e: {"h1": h + e["ao"]}),
        ("norms", "norm2 LayerNorm", lambda e: {"hn": vblk.norm2(e["h1"])}),
        ("matmuls", "fc1", lambda e: {"f": vblk.mlp.linear_fc1(e["hn"])}),
        ("activation", "gelu tanh", lambda e: {"fa": vblk.mlp.act_fn(e["f"])}),
        ("matmuls", "fc2", lambda e: {"d": vblk.mlp.linear_fc2(e["fa"])}),
        ("residual adds", "h + mlp", lambda e: {"out": e["h1"] + e["d"]}),
    ]
    # The attention is also split into its CPU fallback's parts (timed too; not in the sums).
    scale_t, scale_v = a.scale, ba.head_dim**-0.5
    cases = {
        "decoder_layer_prefill_273": {
            "ours": (ours_prefill, lambda: ours(x, rotary(pos3, L), "causal", KVCache())),
            "mlx-vlm": (vlm_prefill, lambda: vlm(x, "causal", VlmKVCache(), pos3)),
        },
        "vision_block_1024": {
            "ours": (ours_vision, lambda: blk(h, cos, sin, layout.segments)),
            "mlx-vlm": (vlm_vis, lambda: vblk(h, cu_seqlens=m["cu"], rotary_pos_emb=rot)),
        },
    }
    out = {}
    for case, engines in cases.items():
        causal = case.startswith("decoder")
        items = {}
        for engine, (stages, whole) in engines.items():
            env = {}
            items.update(stage_items((engine, "stage"), stages, env))
            items[(engine, "whole", "whole")] = whole
            # the attention again, as the parts of MLX's CPU fallback, on the same inputs
            pre = {"q": env["q"], "k": env["k"], "v": env["v"]} if causal else \
                {k: env[k + "r" if k != "v" else "v0"] for k in "qkv"}
            if not causal and engine == "ours":
                pre = {k: win(a) for k, a in pre.items()}
            parts = _fallback_attention("", scale_t if causal else scale_v, causal)
            items.update(stage_items((engine, "attention part"), [("x", "inputs", lambda e, pre=pre: dict(pre))] + parts, {}))
            if engine == "ours":  # formulations tried, on the same inputs
                items.update({(engine, "alternative", n): (lambda f=f, env=env: list(f(env).values()))
                              for n, f in ALTERNATIVES[case](env).items()})
        med = interleaved_medians(items, reps)
        out[case] = {}
        for engine in engines:
            stages, groups = {}, {}
            for (key, g, n), t in med.items():
                if key == (engine, "stage"):
                    stages[f"{g}: {n}"] = t
                    groups[g] = groups.get(g, 0.0) + t
            out[case][engine] = dict(
                stages=stages, groups=groups, sum_of_stages=sum(groups.values()), whole=med[(engine, "whole", "whole")],
                attention_parts={n: t for (key, g, n), t in med.items() if key == (engine, "attention part") and g == "attention"},
                alternatives={n: t for (key, g, n), t in med.items() if key == engine and g == "alternative"})
    return out


def _alternatives():
    import math

    from mlx_qwen3vl import language
    from mlx_qwen3vl.rope import apply_rotary
    from mlx_qwen3vl.vision import gelu_tanh

    rotary_c = mx.compile(apply_rotary)
    tanh_products = mx.compile(lambda x: 0.5 * x * (1 + mx.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x * x * x))))
    return {
        "decoder_layer_prefill_273": lambda env: {
            "nn.silu(g) * u": lambda e: {"a": nn.silu(e["g"]) * e["u"]},
            "compiled g * sigmoid(g) * u (mlx-vlm's swiglu)": lambda e: {"a": _vlm_swiglu(e["g"], e["u"])},
            "swiglu: g / (1 + exp(-g)) * u, compiled": lambda e: {"a": language.swiglu(e["g"], e["u"])},
            "rotate q, k: apply_rotary": lambda e: {"a": apply_rotary(e["qn"], e["cos"], e["sin"]), "b": apply_rotary(e["kn"], e["cos"], e["sin"])},
            "rotate q, k: apply_rotary compiled": lambda e: {"a": rotary_c(e["qn"], e["cos"], e["sin"]), "b": rotary_c(e["kn"], e["cos"], e["sin"])},
        },
        "vision_block_1024": lambda env: {
            "nn.gelu_approx": lambda e: {"a": nn.gelu_approx(e["f"])},
            "tanh form, x^3 as products, compiled": lambda e: {"a": tanh_products(e["f"])},
            "gelu_tanh: x / (1 + exp(-2u)), compiled": lambda e: {"a": gelu_tanh(e["f"])},
        },
    }


def _vlm_swiglu(g, u):
    from mlx_vlm.models.activations import swiglu

    return swiglu(g, u)


class _Alternatives(dict):
    def __missing__(self, case):
        return _alternatives()[case]


ALTERNATIVES = _Alternatives()


def mlx_vlm_sdpa(q, k, v, scale):
    from mlx_vlm.models.base import ensure_fused_sdpa

    return ensure_fused_sdpa(q, k, v, scale)


def print_profile(prof):
    for case, engines in prof.items():
        print(f"\n{case}  (ms; median of interleaved reps)")
        names = list(engines)
        groups = list(dict.fromkeys(g for e in engines.values() for g in e["groups"]))
        print(f"{'op group':22s}" + "".join(f"{n:>12s}" for n in names))
        for g in groups:
            print(f"{g:22s}" + "".join(f"{engines[n]['groups'].get(g, 0) * 1e3:12.2f}" for n in names))
        for key in ("sum_of_stages", "whole"):
            print(f"{key:22s}" + "".join(f"{engines[n][key] * 1e3:12.2f}" for n in names))
        for n in names:
            print(f"  {n} stages: " + ", ".join(f"{k.split(': ', 1)[1]} {v * 1e3:.2f}" for k, v in engines[n]["stages"].items()
                                              if k != "whole layer"))
            for k, v in engines[n].get("alternatives", {}).items():
                print(f"  {n} alternative: {k} {v * 1e3:.2f}")
            print(f"  {n} attention as its CPU fallback: " + ", ".join(f"{k.split(' (')[0]} {v * 1e3:.2f}"
                                                                   for k, v in engines[n]["attention_parts"].items()))


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
    p.add_argument("--profile", action="store_true", help="time each layer op group by op group, both engines")
    args = p.parse_args(argv)
    from harness.measure import machine_info

    if args.profile:
        prof = profile_cases(args.reps)
        print_profile(prof)
        if args.out:
            Path(args.out).write_text(json.dumps({"machine": machine_info(), "note": "seconds, medians of interleaved "
                                                  "reps; each stage on evaluated inputs", "profile": prof},
                                                 indent=1, default=float) + "\n")
        return

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
