"""Random-weight presets of the published Qwen3-VL Instruct architectures, written once as hub
folders (bfloat16 safetensors, hub key names, the transformers-4.57 config layout, the test
fixture's tokenizer and chat template) under benchmarks/models/, so every engine loads the same
files and nothing is downloaded."""

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np


ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "tiny-a"
MODELS = ROOT / "benchmarks" / "models"

# Published Qwen3-VL Instruct architectures (config.json of Qwen/Qwen3-VL-{2B,4B,8B}-Instruct).
_TEXT = dict(head_dim=128, num_key_value_heads=8, vocab_size=151936, rope_theta=5_000_000,
             mrope_section=[24, 20, 20], max_position_embeddings=262144)


_VISION_2B = dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16,
                  deepstack_visual_indexes=[5, 11, 17])
_VISION_8B = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, deepstack_visual_indexes=[8, 16, 24])
_MOE_30B = dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=32, num_key_value_heads=4,
                moe=dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768))


PRESETS = {
    "tiny": dict(text=dict(_TEXT, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=32, vocab_size=448, mrope_section=[6, 5, 5]),
                 vision=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=4,
                             deepstack_visual_indexes=[0, 1]), tie=True),
    "2b": dict(text=dict(_TEXT, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                         num_attention_heads=16), vision=dict(_VISION_2B), tie=True),
    "4b": dict(text=dict(_TEXT, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                         num_attention_heads=32), vision=dict(_VISION_2B), tie=True),
    "8b": dict(text=dict(_TEXT, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                         num_attention_heads=32), vision=dict(_VISION_8B), tie=False),
    # Qwen/Qwen3-VL-30B-A3B-Instruct (UI-Venus-1.5-30B-A3B's base): 48 sparse layers of 128 experts.
    # Its bf16 files are 61 GB and it needs ~17 GB at 4-bit: build it only where memory allows.
    "30b-a3b": dict(text=dict(_TEXT, **_MOE_30B, num_hidden_layers=48), vision=dict(_VISION_8B), tie=False),
    # 30B-A3B's layer shapes (experts, router, attention, vocabulary, vision tower) with two layers:
    # ~9 GB in float32, so it runs on a 24 GB machine; decode reads 2 x 8 of the 128 experts.
    "moe-small": dict(text=dict(_TEXT, **_MOE_30B, num_hidden_layers=2), vision=dict(_VISION_8B), tie=False),
}


PRESET_FORMAT = 1  # bump when the files a preset writes change


SHARD_BYTES = 2 << 30


TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "preprocessor_config.json",
                   "video_preprocessor_config.json"]


def preset_config(name):
    """config.json of a preset in the transformers-4.57 layout (what the hub serves; mlx-vlm
    rejects the 5.x layout), with the fixture tokenizer's special token ids."""
    spec = PRESETS[name]
    fx = json.loads((FIXTURE / "config.json").read_text())
    t = dict(spec["text"])
    text = dict(
        attention_bias=False, attention_dropout=0.0, bos_token_id=fx["text_config"]["bos_token_id"],
        eos_token_id=fx["text_config"]["eos_token_id"], head_dim=t["head_dim"], hidden_act="silu",
        hidden_size=t["hidden_size"], initializer_range=0.02, intermediate_size=t["intermediate_size"],
        max_position_embeddings=t["max_position_embeddings"], model_type="qwen3_vl_text",
        num_attention_heads=t["num_attention_heads"], num_hidden_layers=t["num_hidden_layers"],
        num_key_value_heads=t["num_key_value_heads"], rms_norm_eps=1e-6,
        rope_scaling=dict(mrope_interleaved=True, mrope_section=t["mrope_section"], rope_type="default"),
        rope_theta=t["rope_theta"], tie_word_embeddings=spec["tie"], use_cache=True, vocab_size=t["vocab_size"],
        torch_dtype="bfloat16",
    )
    vision = dict(spec["vision"], hidden_act="gelu_pytorch_tanh", in_channels=3, initializer_range=0.02,
                  model_type="qwen3_vl", num_position_embeddings=2304, out_hidden_size=t["hidden_size"],
                  patch_size=16, spatial_merge_size=2, temporal_patch_size=2)
    arch, model_type = "Qwen3VLForConditionalGeneration", "qwen3_vl"
    if "moe" in t:  # the published 30B-A3B's text_config keys (4.57 layout)
        arch, model_type = "Qwen3VLMoeForConditionalGeneration", "qwen3_vl_moe"
        text.update(t["moe"], model_type="qwen3_vl_moe_text", decoder_sparse_step=1, mlp_only_layers=[],
                    norm_topk_prob=True)
        vision["model_type"] = "qwen3_vl_moe"
    return dict(architectures=[arch], model_type=model_type,
                image_token_id=fx["image_token_id"], video_token_id=fx["video_token_id"],
                vision_start_token_id=fx["vision_start_token_id"], vision_end_token_id=fx["vision_end_token_id"],
                text_config=text, vision_config=vision, tie_word_embeddings=spec["tie"], torch_dtype="bfloat16",
                transformers_version="4.57.0")


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
