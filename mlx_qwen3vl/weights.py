"""Checkpoint folders → a ready Qwen3-VL model.

A hub folder (what `save_pretrained` writes) names weights `model.visual.*`,
`model.language_model.*` and `lm_head.weight`, in `model.safetensors` or shards listed by
`model.safetensors.index.json`. Keys are renamed onto this package's module tree, the Conv3d
patch kernel is flattened for the matmul, and a tied LM head is dropped. Loading is strict: every
missing, unexpected or mis-shaped weight is reported together, in one line.
"""

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from .config import ModelConfig
from .errors import WeightsError
from .model import Qwen3VLForConditionalGeneration

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def _short_list(names, limit=4):
    names = sorted(names)
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def weight_files(path: Path):
    """The safetensors files of a folder, from its index when it has one."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise WeightsError(f"{index} is not a valid safetensors index ({e})") from None
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise WeightsError(f"{path}: shard(s) listed in the index are missing: {_short_list(missing)}")
        return [path / f for f in files], weight_map
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"{path} has no *.safetensors weights: download or convert the checkpoint first")
    return files, None


def read_weights(path: Path) -> dict:
    files, weight_map = weight_files(path)
    weights = {}
    for f in files:
        try:
            weights.update(mx.load(str(f)))
        except Exception as e:  # mlx raises RuntimeError/ValueError for truncated or foreign files
            raise WeightsError(f"{f} could not be read ({str(e).splitlines()[0]}); re-download or re-convert it") from None
    if weight_map is not None:
        unlisted = set(weight_map) - set(weights)
        if unlisted:
            raise WeightsError(f"{path}: weights named in the index are missing from the shards: {_short_list(unlisted)}")
        not_in_index = set(weights) - set(weight_map)
        if not_in_index:
            raise WeightsError(f"{path}: shards hold weights missing from the index: {_short_list(not_in_index)}")
    return weights


def sanitize(weights: dict, config: ModelConfig) -> dict:
    """Hub names → module names; Conv3d kernel → matmul weight; tied head dropped."""
    out = {}
    for key, value in weights.items():
        if key.startswith("model.visual."):
            key = "visual." + key[len("model.visual."):]
        elif key.startswith("model.language_model."):
            key = "language_model." + key[len("model.language_model."):]
        if key == "visual.patch_embed.proj.weight" and value.ndim == 5:
            # torch Conv3d (E, C, T, P, P): rows of pixel_values are flattened in (C, T, P, P) order.
            value = value.reshape(value.shape[0], -1)
        out[key] = value
    if config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def check_and_load(model: nn.Module, weights: dict, where: str):
    expected = dict(tree_flatten(model.parameters()))
    missing = set(expected) - set(weights)
    unexpected = set(weights) - set(expected)
    mismatched = [
        f"{k} {tuple(weights[k].shape)} != {tuple(expected[k].shape)}"
        for k in set(expected) & set(weights)
        if tuple(weights[k].shape) != tuple(expected[k].shape)
    ]
    problems = []
    if missing:
        problems.append(f"missing {len(missing)}: {_short_list(missing)}")
    if unexpected:
        problems.append(f"unexpected {len(unexpected)}: {_short_list(unexpected)}")
    if mismatched:
        problems.append(f"wrong shape {len(mismatched)}: {_short_list(mismatched, 3)}")
    if problems:
        raise WeightsError(f"{where} does not match the Qwen3-VL architecture in its config.json — " + "; ".join(problems))
    model.update(tree_unflatten(list(weights.items())))


def default_dtype(config: ModelConfig):
    """float32 on the CPU backend (its bf16/fp16 matmuls never reach BLAS and run ~40x slower);
    the checkpoint's dtype on a GPU."""
    if mx.default_device().type == mx.DeviceType.cpu:
        return mx.float32
    return DTYPES.get(str(config.torch_dtype), mx.bfloat16)


def load_model(path, dtype=None) -> Qwen3VLForConditionalGeneration:
    path = Path(path)
    config = ModelConfig.from_pretrained(path)
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise WeightsError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    dtype = dtype or default_dtype(config)
    model = Qwen3VLForConditionalGeneration(config)
    weights = sanitize(read_weights(path), config)
    weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    check_and_load(model, weights, str(path))
    model.eval()
    mx.eval(model.parameters())
    return model
