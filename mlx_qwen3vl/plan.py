"""Will it fit? The memory a Qwen3-VL checkpoint needs, from its config.json alone.

    python -m mlx_qwen3vl.plan --model Qwen/Qwen3-VL-8B-Instruct        # fetches config.json only
    python -m mlx_qwen3vl.plan --model path/to/checkpoint --screenshot 2560x1440 --context 32768
    python -m mlx_qwen3vl.plan --preset 30b-a3b --json plan.json          # a published architecture

No weights are read. The model is built lazily from the config (MLX allocates nothing until an
array is evaluated, and nothing is), so the figures are this engine's own module tree:

- parameters: total, vision tower, language model, and per token for mixture-of-experts models;
- weight bytes as bfloat16/float16, float32 (what the CPU backend computes in) and quantized at 8,
  6, 4 and 3 bits, each built by mlx_qwen3vl.convert's own rules (nn.quantize on the lazy model:
  affine, groups of 64, scales and biases in bfloat16, the vision tower, norms and biases left
  float, MoE routers at 8 bits);
- KV cache bytes per 1,024 tokens from mlx-lm's own cache classes: KVCache in bfloat16 and
  float32, and QuantizedKVCache at 8 and 4 bits (groups of 64), the layout this engine's quantized
  KV cache (kv_bits) takes;
- the vision tower at a screenshot size: the image as the checkpoint's processor resizes it, its
  patches and LLM tokens, an estimate of the activations live at once, and the size of the full
  attention-score matrix (fused away on Apple GPUs, computed in bounded chunks by the CPU path);
- whether each weight format fits this machine: weights + KV cache of --context tokens + the
  larger of the vision tower's working memory (its activations, and the attention scores this
  device holds at once: none where an Apple GPU's fused kernel runs, else one query chunk's, the
  CPU path's or the plain graph's, attention.py) and a prefill chunk's activations, against MLX's recommended working set on an
  Apple GPU (mx.device_info(), the wired limit mlx-lm sets while generating), else the memory the
  OS reports available. "fits" leaves 10% free, "tight" fits only without it.

Estimates, not measurements: MLX's allocator caches freed buffers, and the OS, other programs and
the Python process take their own share.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import mlx.core as mx
from huggingface_hub import hf_hub_download
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from . import attention
from .architectures import HUB_IDS, PRESETS, QWEN3VL_PREPROCESSOR, preset_config
from .cli import Parser, run
from .config import ModelConfig
from .convert import quant_spec, quantize_layers
from .errors import ConfigError, InputError, ModelNotFoundError
from .hub import HUB_ID, HubUnavailable, hub_fetch
from .memory import memory_limits
from .model import Qwen3VLForConditionalGeneration
from .moe import weight_counts
from .processor import ImageConfig, image_budget, read_media_configs
from .video import smart_resize

SCHEMA = 1
KV_TOKENS = 1024
FLOAT_ROWS = (("bfloat16", 2), ("float32", 4))  # (name, bytes per weight)
QUANT_BITS = (8, 6, 4, 3)
GROUP_SIZE = 64  # the converter's default (mlx-lm's)
KV_BITS = (8, 4)
KV_GROUP_SIZE = 64  # mlx-lm's default --kv-group-size
PREFILL_CHUNK = 2048  # the token loop's default prefill_step_size
DEFAULT_SCREENSHOT = (1920, 1080)
DEFAULT_CONTEXT = 8192
HEADROOM = 0.9  # "fits" keeps this share of the budget in use at most


def size_label(n):
    if n is None:
        return "-"
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


# ---------------------------------------------------------------------------------------------
# Sources: a folder, a config.json, a hub id (config.json only) or a preset
# ---------------------------------------------------------------------------------------------
def read_config(model=None, preset=None, flag="--model"):
    """(config dict, label, folder or None). A hub id downloads config.json and nothing else."""
    if preset is not None:
        return preset_config(preset), f"preset {preset} ({HUB_IDS.get(preset, 'test architecture')})", None
    path = Path(str(model)).expanduser()
    if path.is_dir():
        folder, file = path, path / "config.json"
        if not file.is_file():
            raise ConfigError(f"{flag} {model}: {file} not found; pass a checkpoint folder or its config.json")
    elif path.is_file():
        folder, file = (path.parent if path.name == "config.json" else None), path
    else:
        if not HUB_ID.match(str(model)):
            raise ModelNotFoundError(f"{flag} {model!r} is neither a local folder, a config.json nor a Hugging Face "
                                     "repo id (owner/name)")
        try:
            file = Path(hub_fetch(str(model), lambda **kw: hf_hub_download(str(model), "config.json", **kw)))
            folder = None
        except HubUnavailable as e:
            raise ModelNotFoundError(f"could not fetch config.json of {model!r} from the Hugging Face hub ({e}); "
                                     f"pass {flag} a local folder or config.json, or --preset") from None
    try:
        raw = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{file} is not a readable JSON config ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{file} is not a JSON object")
    return raw, str(model), folder


# ---------------------------------------------------------------------------------------------
# Counting on the lazily built model
# ---------------------------------------------------------------------------------------------
def lazy_model(config, dtype=None):
    """The model of `config` with unevaluated parameters (no memory is allocated)."""
    model = Qwen3VLForConditionalGeneration(config)
    if dtype is not None:
        model.set_dtype(dtype)
    return model


def parameter_counts(config) -> dict:
    """total, vision, language (embedding and LM head included) and `active`: the language model's
    weights one token runs through (all of them in a dense model; k of E experts in an MoE one)."""

    model = lazy_model(config)
    params = tree_flatten(model.parameters())
    total = sum(p.size for _, p in params)
    vision = sum(p.size for k, p in params if k.startswith("visual."))
    language = weight_counts(model)
    return dict(total=total, vision=vision, language=total - vision,
                active=language["active"])


def weight_rows(config) -> list:
    """Weight bytes as each format stores them, the quantized ones as mlx_qwen3vl.convert makes them."""

    n = parameter_counts(config)["total"]
    rows = [dict(name=name, bits=8 * size, bytes=n * size, bits_per_weight=8.0 * size, dtype=name,
                 note="what the CPU backend computes in" if name == "float32" else "the published checkpoints' dtype")
            for name, size in FLOAT_ROWS]
    for bits in QUANT_BITS:
        model = lazy_model(config, mx.bfloat16)
        try:
            summary = quantize_layers(model, config, quant_spec(True, bits, GROUP_SIZE), allow_float_layers=True)
        except InputError as e:
            rows.append(dict(name=f"{bits}-bit", bits=bits, group_size=GROUP_SIZE, bytes=None, note=str(e)))
            continue
        nbytes = sum(p.nbytes for _, p in tree_flatten(model.parameters()))
        rows.append(dict(name=f"{bits}-bit", bits=bits, group_size=GROUP_SIZE, bytes=nbytes,
                         bits_per_weight=8.0 * nbytes / n, dtype="bfloat16", note=summary))
    return rows


def kv_rows(config, tokens=KV_TOKENS) -> list:
    """KV cache bytes of `tokens` tokens, from mlx-lm's cache classes fed lazy zeros (nothing computed)."""
    t = config.text_config
    layers = t.num_hidden_layers

    def nbytes(cache, dtype):
        k = mx.zeros((1, t.num_key_value_heads, tokens, t.head_dim), dtype)
        cache.update_and_fetch(k, k)
        return cache.nbytes * layers

    rows = [dict(name=name, bits=16 if name != "float32" else 32, bytes=nbytes(KVCache(), getattr(mx, name)),
                 note="mlx-lm KVCache")
            for name in ("bfloat16", "float32")]
    for bits in KV_BITS:
        name = f"{bits}-bit"
        if t.head_dim % KV_GROUP_SIZE:
            rows.append(dict(name=name, bits=bits, bytes=None,
                             note=f"head_dim {t.head_dim} is not a multiple of the group size {KV_GROUP_SIZE}"))
            continue
        rows.append(dict(name=name, bits=bits, group_size=KV_GROUP_SIZE,
                         bytes=nbytes(QuantizedKVCache(KV_GROUP_SIZE, bits), mx.bfloat16),
                         note=f"mlx-lm QuantizedKVCache layout, groups of {KV_GROUP_SIZE}, scales in bfloat16 "
                              "(--kv-bits 8|4)"))
    return rows


def image_config_for(folder):
    """The checkpoint's image preprocessing (its pixel budget), else the published Qwen3-VL one."""
    if folder is not None and ((folder / "preprocessor_config.json").is_file()
                               or (folder / "processor_config.json").is_file()):
        return read_media_configs(folder)[0], "the checkpoint's preprocessor config"
    return ImageConfig.from_dict(QWEN3VL_PREPROCESSOR), "Qwen3-VL's published preprocessor config"


def vision_plan(config, image_config, size, max_pixels=None, dtype_bytes=2) -> dict:
    """The screenshot as the processor resizes it, its patches and tokens, and an estimate of the
    vision tower's working memory: pixels in, the larger of one block's attention and MLP phases
    (everything a phase holds at once: residual, norm, q/k/v, q and k rotated in float32, outputs),
    and the DeepStack features kept for the decoder. The full attention-score matrix is given
    apart: Apple GPUs run a fused kernel that never holds it (head dims 64/80/128), and elsewhere
    this engine computes it in query chunks of bounded memory (attention_working_bytes)."""
    vc = config.vision_config
    w, h = size
    lo, hi = image_budget(image_config, None, max_pixels, names={"max_pixels": "--max-pixels"})
    rh, rw = smart_resize(h, w, image_config.factor, lo, hi)
    patch = image_config.patch_size
    n = (rh // patch) * (rw // patch)
    tokens = n // image_config.merge_size ** 2
    e, i = vc.hidden_size, vc.intermediate_size
    pixels = n * vc.in_channels * vc.temporal_patch_size * patch * patch * 4  # float32 from the processor
    attention_phase = n * e * (1 + 1 + 3 + 1 + 1) * dtype_bytes + 2 * n * e * 4
    mlp_phase = n * (3 * e + 2 * i) * dtype_bytes
    deepstack = (len(vc.deepstack_visual_indexes) + 1) * tokens * vc.out_hidden_size * dtype_bytes
    return dict(screenshot=[w, h], resized=[rw, rh], patches=n, tokens=tokens,
                activation_bytes=pixels + max(attention_phase, mlp_phase) + deepstack,
                attention_scores_bytes=vc.num_heads * n * n * dtype_bytes)


CPU_PATH_SCORES = 2 * 128 * 10**6  # cpu/kernels.py: query chunks of 2**25 float32 scores, and their softmax


def attention_working_bytes(scores_bytes, device=None, head_dim=None, cpu_path=False) -> int:
    """What the vision tower's attention holds beyond its activations: nothing where MLX's fused
    kernel runs (an Apple GPU at head dims attention.FUSED_HEAD_DIMS); else one query chunk's
    scores, the CPU path's (`cpu_path`: float32 weights on the CPU) or the plain graph's (chunks
    sized so that scores and softmax fit attention.SCORE_BUDGET; MLX's softmax overwrites the
    scores, so one chunk holds half of it); the whole matrix where that is smaller."""
    if device is None:
        device = ("metal" if mx.metal.is_available() else "gpu") if mx.default_device().type == mx.DeviceType.gpu else "cpu"
    if device == "metal" and head_dim in attention.FUSED_HEAD_DIMS:
        return 0
    return min(scores_bytes, CPU_PATH_SCORES if cpu_path and device == "cpu" else attention.SCORE_BUDGET // 2)


def prefill_bytes(config, tokens, dtype_bytes=2) -> int:
    """Activations of one prefill chunk (at most PREFILL_CHUNK tokens): hidden states, q/k/v and
    the feed-forward's intermediates (the k experts' for MoE layers), one layer at a time."""
    t = config.text_config
    c = min(tokens, PREFILL_CHUNK)
    ff = t.num_experts_per_tok * t.moe_intermediate_size if t.is_moe else t.intermediate_size
    q = t.num_attention_heads * t.head_dim
    kv = t.num_key_value_heads * t.head_dim
    return c * (4 * t.hidden_size + q + 2 * kv + 3 * ff) * dtype_bytes


def quant_label(q):
    if not q:
        return "none (float weights)"
    if not isinstance(q, dict):
        return str(q)
    base = f"{q.get('bits')}-bit {q.get('mode', 'affine')}, groups of {q.get('group_size')}"
    others = sum(1 for v in q.values() if isinstance(v, dict))
    return base + (f" ({others} layers at other settings)" if others else "")


def checkpoint_info(raw, folder) -> dict:
    """What the checkpoint itself is: its quantization, dtype and (for a local folder) the bytes of
    its safetensors files on disk."""
    files = sorted(folder.glob("*.safetensors")) if folder is not None else []
    q = raw.get("quantization") or raw.get("quantization_config")
    return dict(quantization=quant_label(q), dtype=raw.get("torch_dtype") or raw.get("dtype"),
                file_bytes=sum(f.stat().st_size for f in files) if files else None)


def verdict(need, budget):
    if not need or not budget:
        return "unknown"
    if need <= HEADROOM * budget:
        return "fits"
    return "tight" if need <= budget else "does not fit"


def make_plan(raw, label="model", folder=None, *, screenshot=DEFAULT_SCREENSHOT, context=DEFAULT_CONTEXT,
              max_pixels=None, limits=None, device=None) -> dict:
    """The whole plan as a JSON-ready dict (see the module docstring). `limits` (memory.
    memory_limits) and `device` ("metal", "gpu" or "cpu") default to this machine's."""

    config = ModelConfig.from_dict(raw)
    image_config, pixels_from = image_config_for(folder)
    limits = memory_limits() if limits is None else limits
    weights, kv = weight_rows(config), kv_rows(config)
    kv_per_token = {r["name"]: r["bytes"] / KV_TOKENS for r in kv if r["bytes"]}
    fits = []
    for row in weights:
        if row["bytes"] is None:
            continue
        float_bytes = 4 if row["name"] == "float32" else 2
        vis = vision_plan(config, image_config, screenshot, max_pixels, float_bytes)
        kv_bytes = kv_per_token["float32" if float_bytes == 4 else "bfloat16"] * context
        vc = config.vision_config
        scores = attention_working_bytes(vis["attention_scores_bytes"], device, vc.hidden_size // vc.num_heads,
                                         cpu_path=row["name"] == "float32")
        vision_work = vis["activation_bytes"] + scores
        work = max(vision_work, prefill_bytes(config, context, float_bytes))
        need = row["bytes"] + kv_bytes + work
        fits.append(dict(weights=row["name"], weight_bytes=row["bytes"], kv_bytes=int(kv_bytes), working_bytes=work,
                         need_bytes=int(need), verdict=verdict(need, limits.get("budget"))))
    return dict(schema=SCHEMA, kind="mlx_qwen3vl.plan", model=label, model_type=raw.get("model_type"),
                moe=config.text_config.is_moe, parameters=parameter_counts(config),
                checkpoint=checkpoint_info(raw, folder), weights=weights,
                kv_cache=dict(tokens=KV_TOKENS, rows=kv), context_tokens=context,
                vision=dict(vision_plan(config, image_config, screenshot, max_pixels), pixel_budget_from=pixels_from,
                            max_pixels=max_pixels),
                machine=limits, fits=fits)


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------
def count_label(n):
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M" if n >= 1e5 else str(n)


def format_plan(plan) -> str:
    p, v, m, c = plan["parameters"], plan["vision"], plan["machine"], plan["checkpoint"]
    fits = {f["weights"]: f for f in plan["fits"]}
    kv = {r["name"]: r for r in plan["kv_cache"]["rows"]}
    lines = [f"{plan['model']}  ·  {plan['model_type']}" + ("  ·  mixture of experts" if plan["moe"] else ""),
             f"parameters: {count_label(p['total'])} (vision tower {count_label(p['vision'])}, language model "
             f"{count_label(p['language'])})" + (f"; {count_label(p['active'])} of the language model active per token" if plan["moe"] else ""),
             f"this checkpoint: {c['quantization']}"
             + (f", {size_label(c['file_bytes'])} of safetensors on disk" if c["file_bytes"] else ""), "",
             f"{'weights':<10}{'size':>10}{'bits/weight':>13}{'need*':>11}   on this machine: {size_label(m.get('budget'))} "
             f"({m.get('budget_name')})"]
    for row in plan["weights"]:
        f = fits.get(row["name"])
        if row["bytes"] is None:
            lines.append(f"{row['name']:<10}{'n/a':>10}   {row['note']}")
            continue
        extra = "   (what the CPU backend computes in)" if row["name"] == "float32" else ""
        lines.append(f"{row['name']:<10}{size_label(row['bytes']):>10}{row['bits_per_weight']:>13.2f}"
                     f"{size_label(f['need_bytes']):>11}   {f['verdict']}{extra}")
    first = plan["fits"][0] if plan["fits"] else None
    if first:
        lines.append(f"* need = weights + KV cache of {plan['context_tokens']} tokens ({size_label(first['kv_bytes'])} in "
                     f"bfloat16) + working memory ({size_label(first['working_bytes'])}: the vision tower or a prefill chunk); "
                     "estimates. \"fits\" leaves 10% free.")
    if m.get("working_set") and any(f["verdict"] != "fits" for f in plan["fits"]):
        lines.append("  macOS can wire more memory for the GPU until the next restart: sudo sysctl iogpu.wired_limit_mb=N")
    quantized = [f"{n} {size_label(r['bytes'])}" if r["bytes"] else f"{n} n/a ({r['note']})"
                 for n, r in kv.items() if n.endswith("-bit")]
    lines += ["", f"KV cache per {plan['kv_cache']['tokens']:,} tokens: bfloat16 {size_label(kv['bfloat16']['bytes'])}, float32 "
                  f"{size_label(kv['float32']['bytes'])}; quantized as mlx-lm's QuantizedKVCache would hold it: "
                  + ", ".join(quantized) + " (this engine: --kv-bits, docs/kv-cache.md)",
              f"screenshot {v['screenshot'][0]}x{v['screenshot'][1]} -> {v['resized'][0]}x{v['resized'][1]} "
              f"({v['pixel_budget_from']}): {v['patches']} patches, {v['tokens']} tokens; vision activations "
              f"~{size_label(v['activation_bytes'])} in bfloat16, attention scores {size_label(v['attention_scores_bytes'])} if "
              "unfused (Apple GPUs fuse them away at head dims 64/80/128; elsewhere they are computed in "
              f"query chunks of at most {size_label(attention.SCORE_BUDGET)})",
              f"total memory {size_label(m.get('total'))}" + (f", available {size_label(m['available'])}" if m.get("available") else "")
              + (f", GPU working set {size_label(m['working_set'])}" if m.get("working_set") else "")]
    return "\n".join(lines)


README_HEADER = ("| model | parameters | bf16 GB | 8-bit GB | 6-bit GB | 4-bit GB | 3-bit GB | "
                 "KV per 1,024 tokens (bf16) | 1920×1080 screenshot |\n|---|---|---|---|---|---|---|---|---|")


def readme_row(plan, name) -> str:
    """One row of the README's table (tests/test_mac_bench.py checks the README against this)."""
    w = {r["name"]: r["bytes"] for r in plan["weights"]}
    kv = next(r["bytes"] for r in plan["kv_cache"]["rows"] if r["name"] == "bfloat16")
    p = plan["parameters"]
    params = count_label(p["total"]) + (f" ({count_label(p['active'])} active)" if plan["moe"] else "")
    cells = [name, params] + [f"{w[k] / 1e9:.2f}" for k in ("bfloat16", "8-bit", "6-bit", "4-bit", "3-bit")]
    cells += [f"{kv / 1e6:.0f} MB", f"{plan['vision']['tokens']} tokens"]
    return "| " + " | ".join(cells) + " |"


def _size(text, flag):
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise InputError(f"{flag} {text!r} is not WIDTHxHEIGHT (e.g. 1920x1080)") from None
    if not (16 <= w <= 16384 and 16 <= h <= 16384):
        raise InputError(f"{flag} {text}: width and height must be between 16 and 16384 pixels")
    return w, h


def add_plan_arguments(p):
    """The planner's own flags (`python -m mlx_qwen3vl.bench --plan` takes them too)."""
    p.add_argument("--screenshot", default="1920x1080", metavar="WxH", help="screenshot size for the vision tower")
    p.add_argument("--context", type=int, default=DEFAULT_CONTEXT, help="tokens of conversation the KV cache holds")


def build_parser():
    p = Parser(prog="python -m mlx_qwen3vl.plan", description=__doc__.split("\n\n")[0],
               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="checkpoint folder, its config.json, or a Hugging Face repo id "
                                     "(only config.json is downloaded)")
    src.add_argument("--preset", choices=list(PRESETS), help="a published Qwen3-VL architecture")
    add_plan_arguments(p)
    p.add_argument("--max-pixels", type=int, default=None, help="the largest image area the agent sends; "
                                                                "none = the checkpoint's")
    add_json_argument(p, "plan.json", "the plan")
    return p


def add_json_argument(p, default, what):
    """--json [PATH]: a file (`default` in the current folder when no PATH is given), or - for
    stdout, where the JSON then goes alone (the table goes to stderr)."""
    p.add_argument("--json", nargs="?", const=default, metavar="PATH",
                   help=f"write {what} as JSON to PATH ({default} when none is given; - for stdout)")


def check_json_path(value, flag="--json"):
    """--json PATH as a Path ("-": stdout), refused before any work when it cannot be written."""
    if value is None or value == "-":
        return value
    out = Path(value).expanduser()
    if out.is_dir() or not out.parent.is_dir():
        raise InputError(f"{flag} {value}: not a file path in an existing folder")
    return out


def run_plan(args) -> int:
    screenshot = _size(args.screenshot, "--screenshot")
    if not 1 <= args.context <= 1 << 24:
        raise InputError(f"--context {args.context} is not allowed; use 1 to {1 << 24} tokens")
    if args.model is None and args.preset is None:
        raise InputError("give --model (a folder, config.json or hub id) or --preset")
    out = check_json_path(args.json)
    raw, label, folder = read_config(args.model, args.preset)
    plan = make_plan(raw, label, folder, screenshot=screenshot, context=args.context,
                     max_pixels=getattr(args, "max_pixels", None))
    print(format_plan(plan), file=sys.stderr if out == "-" else sys.stdout)
    write_json(out, plan)
    return 0


def write_json(out, obj):
    """Write obj to out (from check_json_path): a file (and say so on stderr), stdout, or nowhere."""
    if out is None:
        return
    text = json.dumps(obj, indent=1, default=float)
    if out == "-":
        print(text)
    else:
        out.write_text(text)
        print(f"wrote {out}", file=sys.stderr)


def main(argv=None):
    args = build_parser().parse_args(argv)
    return run(lambda: run_plan(args))


if __name__ == "__main__":
    sys.exit(main())
