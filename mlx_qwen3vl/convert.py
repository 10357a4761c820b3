"""Convert a Qwen3-VL checkpoint into this package's MLX layout, optionally quantized.

    python convert.py --hf-path Qwen/Qwen3-VL-2B-Instruct --mlx-path qwen3vl-2b-4bit -q
    python -m mlx_qwen3vl.convert --hf-path ./Qwen3-VL-8B-Instruct --mlx-path out -q --quant-predicate mixed_4_8

The source may be a hub folder, a hub repo id (downloaded with huggingface_hub), an mlx-vlm
(mlx-community) folder or an earlier conversion. The output holds the weights under this
package's module names (the Conv3d patch kernel already in matmul form, no `lm_head` when tied) in
safetensors shards of at most 5 GB with `model.safetensors.index.json`, a config.json with a
`quantization` section (group_size, bits, mode and per-layer overrides) and an `mlx_qwen3vl`
marker, and the tokenizer, chat template, processor and generation configs of the source.

Quantization uses MLX's modes (affine 2/3/4/5/6/8 bits with groups of 32/64/128; mxfp4, nvfp4 and
mxfp8 with their fixed group sizes). The decoder's linear layers, the token embedding and the LM
head are quantized (as mlx-community does); the vision tower only with --quantize-vision (never its
patch embedding and learned position table); norms and biases never; a layer whose input width
is not a multiple of the group size stays float. Mixed recipes (`mixed_L_H`, as in mlx-lm and
mlx-vlm) quantize at L bits and keep v_proj/down_proj of the first/last eighth and every third
decoder layer, the embedding, the LM head (and the vision tower, when quantized) at H bits.

The run is atomic: everything is written into a hidden temporary folder next to the output
(config.json last, so an unfinished one never loads) and renamed at the end; an existing output
is refused unless --force. Progress goes to stderr; errors are one line and exit with status 2.
"""

import argparse
import fnmatch
import json
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

from .errors import InputError, Qwen3VLError
from .hub import SIDECAR_FILES, resolve_model_path
from .moe import weight_counts
from .weights import (DTYPES, FORMAT_KEY, FORMAT_VERSION, NEVER_QUANTIZED, QUANTIZED_TYPES, build_model,
                      describe_quantization, read_raw_config)

AFFINE_BITS = (2, 3, 4, 5, 6, 8)
AFFINE_GROUP_SIZES = (32, 64, 128)
# Modes with a fixed (bits, group_size); affine defaults to 4 bits in groups of 64, as mlx-lm.
FIXED_MODES = {"mxfp4": (4, 32), "nvfp4": (4, 16), "mxfp8": (8, 32)}
MODES = ("affine",) + tuple(FIXED_MODES)
RECIPES = ("mixed_2_6", "mixed_3_4", "mixed_3_5", "mixed_3_6", "mixed_3_8", "mixed_4_6", "mixed_4_8")
MAX_SHARD_BYTES = 5 * 10**9

COPY_PATTERNS = SIDECAR_FILES  # copied next to the weights


def _stderr(msg: str):
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Quantization settings
# ---------------------------------------------------------------------------------------------
@dataclass
class QuantSpec:
    bits: int
    group_size: int
    mode: str = "affine"
    recipe: Optional[str] = None  # mixed_L_H
    vision: bool = False

    @property
    def low_high(self):
        if self.recipe is None:
            return self.bits, self.bits
        low, high = (int(b) for b in self.recipe.split("_")[1:])
        return low, high

    def describe(self) -> str:
        what = f"{self.recipe} (affine, groups of {self.group_size})" if self.recipe else \
            f"{self.bits}-bit {self.mode}, groups of {self.group_size}"
        return what + (", vision tower included" if self.vision else "")


def quant_spec(quantize=False, bits=None, group_size=None, mode="affine", recipe=None, quantize_vision=False):
    """Validated quantization settings (None when not quantizing); InputError on a bad combination."""
    mode = mode or "affine"
    if bits is not None and bits not in AFFINE_BITS:
        raise InputError(f"--q-bits {bits} is not supported: choose one of {', '.join(map(str, AFFINE_BITS))}")
    if mode not in MODES:
        raise InputError(f"--q-mode {mode!r} is not one of {', '.join(MODES)}")
    if recipe is not None:
        m = re.fullmatch(r"mixed_(\d)_(\d)", recipe)
        if not m or int(m[1]) not in AFFINE_BITS or int(m[2]) not in AFFINE_BITS or int(m[1]) >= int(m[2]):
            raise InputError(f"--quant-predicate {recipe!r} is not a mixed recipe: use one of {', '.join(RECIPES)} "
                             "(mixed_LOW_HIGH with LOW < HIGH bits)")
        if mode != "affine":
            raise InputError(f"--quant-predicate {recipe} mixes affine bit widths; it cannot be used with --q-mode {mode}")
        if bits is not None:
            raise InputError(f"--quant-predicate {recipe} sets the bits itself; drop --q-bits {bits}")
    if mode in FIXED_MODES:
        fixed_bits, fixed_group = FIXED_MODES[mode]
        if bits not in (None, fixed_bits) or group_size not in (None, fixed_group):
            raise InputError(f"--q-mode {mode} always uses {fixed_bits} bits in groups of {fixed_group}: "
                             "drop --q-bits/--q-group-size or use --q-mode affine")
        bits, group_size = fixed_bits, fixed_group
    elif group_size is not None and group_size not in AFFINE_GROUP_SIZES:
        raise InputError(f"--q-group-size {group_size} is not supported: choose one of "
                         f"{', '.join(map(str, AFFINE_GROUP_SIZES))}")
    if not quantize:
        given = [flag for flag, v in (("--q-bits", bits if mode == "affine" else None),
                                      ("--q-group-size", group_size if mode == "affine" else None),
                                      ("--q-mode", None if mode == "affine" else mode),
                                      ("--quant-predicate", recipe), ("--quantize-vision", quantize_vision or None))
                 if v is not None]
        if given:
            raise InputError(f"{', '.join(given)} given without -q: add -q (--quantize) to quantize")
        return None
    if recipe is not None:
        bits = int(recipe.split("_")[1])
    return QuantSpec(bits=bits or 4, group_size=group_size or 64, mode=mode, recipe=recipe,
                     vision=bool(quantize_vision))


def make_predicate(config, spec: QuantSpec) -> Callable:
    """class_predicate for nn.quantize: which layers to quantize, and with which parameters."""
    n_layers = config.text_config.num_hidden_layers
    low, high = spec.low_high

    def more_bits(index: int) -> bool:  # llama.cpp Q4_K_M's choice, as mlx-lm/mlx-vlm recipes make it
        return index < n_layers // 8 or index >= 7 * n_layers // 8 or (index - n_layers // 8) % 3 == 2

    def predicate(path: str, module: nn.Module):
        if not hasattr(module, "to_quantized") or path in NEVER_QUANTIZED:
            return False  # norms have no quantized form; the patch kernel/position table stay float
        if path.startswith("visual.") and not spec.vision:
            return False
        if path.endswith(".mlp.gate"):  # an MoE router: 8-bit affine (its choice of experts is worth the bytes)
            group = spec.group_size if spec.mode == "affine" else 64
            return False if module.weight.shape[-1] % group else {"group_size": group, "bits": 8, "mode": "affine"}
        if module.weight.shape[-1] % spec.group_size:
            return False  # input width not a multiple of the group: stays float
        bits = low
        if spec.recipe is not None:
            parts = path.split(".")
            if path.startswith("visual.") or path in ("lm_head", "language_model.embed_tokens"):
                bits = high
            elif parts[:2] == ["language_model", "layers"] and parts[3:4] and parts[-1] in ("v_proj", "down_proj"):
                bits = high if more_bits(int(parts[2])) else low
        return {"group_size": spec.group_size, "bits": bits, "mode": spec.mode}

    return predicate


def bits_per_weight(model: nn.Module) -> float:
    """Stored bits (packed weights, scales, biases, float tensors) per original weight."""
    quantized = {p: m for p, m in model.named_modules() if isinstance(m, QUANTIZED_TYPES)}
    n_bits = n_weights = 0
    for key, value in tree_flatten(model.parameters()):
        n_bits += value.nbytes * 8
        layer, _, name = key.rpartition(".")
        if layer in quantized and name == "weight":
            n_weights += value.size * 32 // quantized[layer].bits
        elif not (layer in quantized and name in ("scales", "biases")):
            n_weights += value.size
    return n_bits / max(n_weights, 1)


def describe_experts(model: nn.Module) -> str:
    """Total vs per-token active weights of a mixture-of-experts language model, and their storage."""
    c, t = weight_counts(model), model.config.text_config

    def size(n, unit=""):
        scale, prefix = next((s, p) for s, p in ((1e9, "G"), (1e6, "M"), (1e3, "k"), (1, "")) if n >= s or s == 1)
        return f"{n / scale:.3g} {prefix}{unit}".rstrip()

    return (f"mixture of experts (top-{t.num_experts_per_tok} of {t.num_experts}): language model "
            f"{size(c['total'])} weights in {size(c['total_bytes'], 'B')}, {size(c['active'])} active per token in "
            f"{size(c['active_bytes'], 'B')} ({8 * c['active_bytes'] / max(c['active'], 1):.2f} bits per active weight)")


# ---------------------------------------------------------------------------------------------
# Source resolution
# ---------------------------------------------------------------------------------------------
def resolve_source(hf_path: str, log=_stderr) -> Path:
    """A local folder as it is; otherwise a hub repo id, downloaded (weights, configs, tokenizer and
    templates only)."""
    folder = resolve_model_path(hf_path, flag="--hf-path")
    if not Path(hf_path).expanduser().is_dir():
        log(f"convert: fetched {hf_path} from the Hugging Face Hub into {folder}")
    return folder


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------
def make_shards(weights: dict, max_bytes: int) -> list:
    """Consecutive groups of tensors of at most max_bytes each (a larger tensor gets its own)."""
    shards, size = [], 0
    for key in sorted(weights):
        nbytes = weights[key].nbytes
        if not shards or (size + nbytes > max_bytes and shards[-1]):
            shards.append({})
            size = 0
        shards[-1][key] = weights[key]
        size += nbytes
    return shards


def write_weights(out: Path, weights: dict, max_bytes: int = MAX_SHARD_BYTES, log=_stderr):
    """Save `weights` as shards plus index. The dict is emptied as shards are written, so a lazily
    computed (loaded, cast, quantized) model is held in memory about one shard at a time."""
    total = sum(v.nbytes for v in weights.values())
    shards = make_shards(weights, max_bytes)
    weights.clear()
    n = len(shards)
    weight_map = {}
    for i in range(n):
        shard, shards[i] = shards[i], None
        name = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        mx.save_safetensors(str(out / name), shard, metadata={"format": "mlx"})
        weight_map.update({k: name for k in shard})
        log(f"convert: wrote {name} ({sum(v.nbytes for v in shard.values()) / 1e6:.1f} MB, {len(shard)} tensors)")
        del shard
    index = {"metadata": {"total_size": total, "format": "mlx"}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def copy_side_files(src: Path, out: Path) -> list:
    copied = []
    for f in sorted(src.iterdir()):
        if f.is_file() and any(fnmatch.fnmatch(f.name, p) for p in COPY_PATTERNS):
            shutil.copyfile(f, out / f.name)
            copied.append(f.name)
    return copied


def output_config(src: Path, dtype: str, quantization, hf_path: str, quantize_vision: bool) -> dict:
    cfg = read_raw_config(src)
    for key in ("quantization", "quantization_config", FORMAT_KEY):
        cfg.pop(key, None)
    # Record the stored dtype where the source's layout keeps it (transformers 5: dtype, 4.57: torch_dtype).
    if "dtype" in cfg or "torch_dtype" not in cfg:
        cfg["dtype"] = dtype
    if "torch_dtype" in cfg:
        cfg["torch_dtype"] = dtype
    for sub in ("text_config", "vision_config"):
        for key in ("dtype", "torch_dtype"):
            if isinstance(cfg.get(sub), dict) and key in cfg[sub]:
                cfg[sub][key] = dtype
    if quantization is not None:
        cfg["quantization"] = quantization
    cfg[FORMAT_KEY] = {"format_version": FORMAT_VERSION, "converted_from": str(hf_path), "dtype": dtype,
                       "quantized_vision": bool(quantize_vision)}
    return cfg


def _folder_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def _inside(a: Path, b: Path) -> bool:
    """a is b or lies inside b."""
    a, b = a.resolve(), b.resolve()
    return a == b or b in a.parents


def convert(hf_path, mlx_path, dtype: Optional[str] = None, quantize: bool = False, q_bits: Optional[int] = None,
            q_group_size: Optional[int] = None, q_mode: str = "affine", quant_predicate: Optional[str] = None,
            quantize_vision: bool = False, force: bool = False, max_shard_bytes: int = MAX_SHARD_BYTES,
            log=_stderr) -> Path:
    """Convert `hf_path` (folder or hub id) into `mlx_path`; returns the output folder."""
    if dtype is not None and dtype not in DTYPES:
        raise InputError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    spec = quant_spec(quantize, q_bits, q_group_size, q_mode, quant_predicate, quantize_vision)
    out = Path(mlx_path).expanduser()
    if out.exists() and not force:
        raise InputError(f"--mlx-path {out} already exists: choose a new folder or pass --force to replace it")
    if out.is_dir() and any(out.iterdir()) and not ((out / "config.json").exists() or any(out.glob("*.safetensors"))):
        raise InputError(f"--mlx-path {out} holds files but no checkpoint; --force only replaces a model folder: "
                         "choose a new folder")
    local = Path(hf_path).expanduser()
    if local.exists() and _inside(local, out):
        raise InputError(f"--mlx-path {out} would replace the source checkpoint {local}: choose another folder")

    t0 = time.perf_counter()
    src = resolve_source(hf_path, log)
    from .config import ModelConfig

    config = ModelConfig.from_pretrained(src)
    dtype = dtype or (config.torch_dtype if config.torch_dtype in DTYPES else "bfloat16")
    model, kind = build_model(src, dtype, lazy=True)
    already = describe_quantization(model)
    log(f"convert: read {src} ({kind} layout{', quantized' if already else ''}), weights as {dtype}")
    if spec is not None:
        if already:
            raise InputError(f"{src} is already quantized ({already.get('bits')}-bit): convert from the float "
                             "checkpoint to quantize, or drop -q to re-layout it as it is")
        nn.quantize(model, spec.group_size, spec.bits, mode=spec.mode, class_predicate=make_predicate(config, spec))
        log(f"convert: quantized {spec.describe()}: {bits_per_weight(model):.2f} bits per weight")
    if config.text_config.is_moe:
        log(f"convert: {describe_experts(model)}")
    quantization = describe_quantization(model)
    weights = dict(tree_flatten(model.parameters()))
    model.update(tree_map(lambda _: mx.array([]), model.parameters()))  # `weights` holds the only references
    del model

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.converting-", dir=out.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the output is an ordinary folder
        write_weights(tmp, weights, max_shard_bytes, log)
        copied = copy_side_files(src, tmp)
        cfg = output_config(src, dtype, quantization, hf_path, bool(spec and spec.vision))
        # config.json last: a folder without it is never taken for a checkpoint.
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        _replace(tmp, out, force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"convert: copied {', '.join(copied) if copied else 'no tokenizer/processor files (none in the source)'}")
    log(f"convert: {out} ready, {_folder_size(out) / 1e6:.1f} MB, in {time.perf_counter() - t0:.2f} s")
    return out


def _replace(tmp: Path, out: Path, force: bool):
    """Rename the finished temporary folder onto `out`; an old `out` (with --force) is removed only
    once the new one is in place."""
    if not out.exists() and not out.is_symlink():
        os.rename(tmp, out)
        return
    if not force:  # appeared while converting
        raise InputError(f"--mlx-path {out} already exists: choose a new folder or pass --force to replace it")
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    old.rmdir()
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)
        raise
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old, ignore_errors=True)
    else:
        old.unlink()


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, like every other error of this tool
        self.exit(2, f"{self.prog}: error: {message}\n")


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def _size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)B?\s*", text.upper())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 5GB or 400KB")
    return int(float(m[1]) * {"": 1, "K": 10**3, "M": 10**6, "G": 10**9}[m[2]])


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="convert.py", description="Convert a Qwen3-VL checkpoint (hub folder or repo id, "
                "or an mlx-vlm folder) into mlx_qwen3vl's MLX layout, optionally quantized.")
    p.add_argument("--hf-path", "--model", required=True, help="local checkpoint folder or Hugging Face repo id")
    p.add_argument("--mlx-path", default="mlx_model", help="output folder (default: mlx_model)")
    p.add_argument("--dtype", help="float16, bfloat16 or float32 for the float weights (default: the checkpoint's)")
    p.add_argument("-q", "--quantize", action="store_true", help="quantize (4-bit affine, groups of 64, by default)")
    p.add_argument("--q-bits", type=_int, help=f"bits per weight: {', '.join(map(str, AFFINE_BITS))}")
    p.add_argument("--q-group-size", type=_int, help=f"group size: {', '.join(map(str, AFFINE_GROUP_SIZES))}")
    p.add_argument("--q-mode", default="affine", help=f"quantization mode: {', '.join(MODES)}")
    p.add_argument("--quant-predicate", help=f"mixed-bit recipe: {', '.join(RECIPES)}")
    p.add_argument("--quantize-vision", action="store_true", help="quantize the vision tower too")
    p.add_argument("--force", action="store_true", help="replace --mlx-path if it exists")
    p.add_argument("--max-shard-size", type=_size, default=MAX_SHARD_BYTES, help="largest shard (default: 5GB)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        convert(args.hf_path, args.mlx_path, dtype=args.dtype, quantize=args.quantize, q_bits=args.q_bits,
                q_group_size=args.q_group_size, q_mode=args.q_mode, quant_predicate=args.quant_predicate,
                quantize_vision=args.quantize_vision, force=args.force, max_shard_bytes=args.max_shard_size)
    except Qwen3VLError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted; nothing was written to --mlx-path", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
