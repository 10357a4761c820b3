"""Random-weight presets of the published Qwen3-VL Instruct architectures (their shapes live in
mlx_qwen3vl/architectures.py, which the memory planner sizes too), written once as hub
folders (bfloat16 safetensors, hub key names, the transformers-4.57 config layout, the test
fixture's tokenizer and chat template) under benchmarks/models/, so every engine loads the same
files and nothing is downloaded."""

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np

from mlx_qwen3vl.architectures import PRESETS, preset_config as _preset_config  # noqa: F401  (bench.py: PRESETS)

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "tiny-a"
MODELS = ROOT / "benchmarks" / "models"

PRESET_FORMAT = 1  # bump when the files a preset writes change


SHARD_BYTES = 2 << 30


TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "preprocessor_config.json",
                   "video_preprocessor_config.json"]


def preset_config(name):
    """config.json of a preset (mlx_qwen3vl.architectures) with the fixture tokenizer's special token ids."""
    fx = json.loads((FIXTURE / "config.json").read_text())
    tokens = {k: fx[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")}
    tokens.update(bos_token_id=fx["text_config"]["bos_token_id"], eos_token_id=fx["text_config"]["eos_token_id"])
    return _preset_config(name, tokens)


def preset_gb(name, dtype_bytes=4) -> float:
    """Weights of a preset in GB at `dtype_bytes` per weight, counted on a lazily built model
    (nothing allocated)."""
    from mlx.utils import tree_flatten

    from mlx_qwen3vl.config import ModelConfig
    from mlx_qwen3vl.model import Qwen3VLForConditionalGeneration

    model = Qwen3VLForConditionalGeneration(ModelConfig.from_dict(preset_config(name)))
    return sum(p.size for _, p in tree_flatten(model.parameters())) * dtype_bytes / 1e9


def memory_available_gb() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1e6
    except OSError:
        pass
    return float("inf")  # not Linux: let the run find out


def _hub_experts(key, value, pending):
    """Our SwitchGLU weights (E, out, in) → the hub's fused experts (transformers 4.57 files):
    gate_up_proj (E, D, 2I) from gate then up, down_proj (E, I, D). Returns (hub key, value) or
    None while the gate waits for its up."""
    prefix, _, name = key.rpartition(".switch_mlp.")
    if name == "gate_proj.weight":
        pending[prefix] = value
        return None
    if name == "up_proj.weight":
        fused = np.concatenate([pending.pop(prefix), value], axis=1)
        return _hub_name(prefix + ".experts.gate_up_proj"), np.ascontiguousarray(fused.transpose(0, 2, 1))
    return _hub_name(prefix + ".experts.down_proj"), np.ascontiguousarray(value.transpose(0, 2, 1))


def _hub_name(name):
    for ours, hub in (("visual.", "model.visual."), ("language_model.", "model.language_model."), ("lm_head.", "lm_head.")):
        if name.startswith(ours):
            return hub + name[len(ours):]
    raise ValueError(name)


def build_preset(name, root=MODELS, log=print):
    """Write the preset's hub folder once (random bf16 weights); return its path."""
    out = Path(root) / f"qwen3vl-{name}-random"
    marker = out / "bench_preset.json"
    stamp = {"preset": name, "format": PRESET_FORMAT, "spec": PRESETS[name]}
    if marker.is_file() and json.loads(marker.read_text()) == json.loads(json.dumps(stamp)):
        return out
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlx_qwen3vl.config import ModelConfig
    from mlx_qwen3vl.model import Qwen3VLForConditionalGeneration

    tic = time.perf_counter()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cfg = preset_config(name)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    fx_gen = json.loads((FIXTURE / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps(fx_gen, indent=2))
    for f in TOKENIZER_FILES:
        shutil.copy(FIXTURE / f, out / f)
    n_tok = len(json.loads((FIXTURE / "tokenizer.json").read_text())["model"]["vocab"])
    n_tok += len(json.loads((FIXTURE / "tokenizer.json").read_text())["added_tokens"])

    # Names and shapes from our module tree (lazy: nothing is allocated), renamed to hub keys.
    config = ModelConfig.from_pretrained(out)
    params = tree_flatten(Qwen3VLForConditionalGeneration(config).parameters())
    vc = config.vision_config
    rng = np.random.default_rng(0)
    shards, current, size, total, pending = [], {}, 0, 0, {}

    def flush():
        nonlocal current, size
        if current:
            shards.append(current)
            path = out / f"shard-{len(shards)}.tmp.safetensors"
            mx.save_safetensors(str(path), current, metadata={"format": "pt"})
            current, size = {}, 0

    for key, p in params:
        shape = tuple(p.shape)
        leaf = key.rsplit(".", 1)[-1]
        if leaf == "bias":
            value = np.zeros(shape, np.float32)
        elif "norm" in key.rsplit(".", 2)[-2]:  # LayerNorm / RMSNorm scales
            value = np.ones(shape, np.float32)
        else:
            value = rng.standard_normal(shape, dtype=np.float32)
            value *= np.float32(0.02)
            if key in ("language_model.embed_tokens.weight", "lm_head.weight") and shape[0] > n_tok:
                # Rows past the tokenizer's vocabulary (real checkpoints pad the vocab too) are kept
                # small, so greedy decoding of random weights emits tokens the tokenizer can decode.
                value[n_tok:] *= np.float32(1e-3)
        if key == "visual.patch_embed.proj.weight":
            value = value.reshape(shape[0], vc.in_channels, vc.temporal_patch_size, vc.patch_size, vc.patch_size)
        hub_key = _hub_name(key)
        if ".switch_mlp." in key:
            fused = _hub_experts(key, value, pending)
            if fused is None:
                continue
            hub_key, value = fused
        arr = mx.array(value).astype(mx.bfloat16)
        mx.eval(arr)
        del value
        current[hub_key] = arr
        size += arr.nbytes
        total += arr.nbytes
        if size >= SHARD_BYTES:
            flush()
    flush()
    n = len(shards)
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{n:05d}.safetensors"
        os.replace(out / f"shard-{i}.tmp.safetensors", out / fname)
        weight_map.update({k: fname for k in shard})
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    marker.write_text(json.dumps(stamp))
    log(f"[bench] wrote preset {name}: {total / 1e9:.2f} GB of bf16 weights in {time.perf_counter() - tic:.0f} s → {out}")
    return out
