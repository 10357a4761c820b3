"""Convert a Qwen3-VL checkpoint into this package's MLX layout, optionally quantized.

    python convert.py --hf-path Qwen/Qwen3-VL-2B-Instruct --mlx-path qwen3vl-2b-4bit -q
    python -m mlx_qwen3vl.convert --hf-path ./Qwen3-VL-8B-Instruct --mlx-path out -q --quant-predicate mixed_4_8

The source may be a hub folder, a hub repo id (downloaded with huggingface_hub), an mlx-vlm
(mlx-community) folder or an earlier conversion. The output is in mlx-vlm's layout, so mlx-vlm and
LM Studio open it too: its weight names (`vision_tower.*`, `language_model.model.*`,
`language_model.lm_head.*`, no head when tied), the Conv3d patch kernel channels-last, safetensors
shards of at most 5 GB with `model.safetensors.index.json`, a config.json with a `quantization`
section (group_size, bits, mode and per-layer overrides, under mlx-vlm's names), the rope keys
mlx-vlm reads and an `mlx_qwen3vl` marker, and the tokenizer, chat template, processor and
generation configs of the source.

Quantization uses MLX's modes (affine 2/3/4/5/6/8 bits with groups of 32/64/128; mxfp4, nvfp4 and
mxfp8 with their fixed group sizes). The decoder's linear layers, the token embedding and the LM
head are quantized (as mlx-community does); the vision tower only with --quantize-vision (never its
patch embedding and learned position table); norms and biases never; a layer whose input width
is not a multiple of the group size stays float (mlx-lm's rule). When that leaves nothing, or
less than half of the weights meant for quantization, the run stops with an error unless
--allow-float-layers; the summary says how many layers were quantized. Mixed recipes
(`mixed_L_H`, as in mlx-lm and mlx-vlm) quantize at L bits and keep v_proj/down_proj of the
first/last eighth and every third decoder layer, the embedding, the LM head (and the vision
tower, when quantized) at H bits.

The run is atomic: everything is written into a hidden temporary folder next to the output
(config.json last, so an unfinished one never loads) and renamed at the end. An existing output
is refused unless --force, and --force replaces only an empty folder or one holding a checkpoint
(config.json and *.safetensors, no sub-folders); a file, a link or any other folder is refused.
Progress goes to stderr; errors are one line and exit with status 2.
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

from .cli import Parser, run
from .errors import InputError
from .hub import SIDECAR_FILES, resolve_model_path
from .moe import weight_counts
from .weights import (AFFINE_BITS, AFFINE_GROUP_SIZES, DTYPES, FIXED_MODES, FORMAT_KEY, FORMAT_VERSION, MLX_VLM,
                      NEVER_QUANTIZED, build_model, describe_quantization, export_key, export_patch_kernel,
                      read_raw_config)

# Affine defaults to 4 bits in groups of 64, as mlx-lm; the fp modes have fixed parameters.
MODES = ("affine",) + tuple(FIXED_MODES)
# The output's weight names: mlx-vlm's, which mlx-vlm (and LM Studio, on top of it) read.
OUTPUT_LAYOUT = MLX_VLM
# Below this share of the weights meant for quantization, a run stops unless --allow-float-layers.
MIN_QUANTIZED_SHARE = 0.5
FLOAT16_MAX = 65504.0
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


def make_predicate(config, spec: QuantSpec, check_width: bool = True) -> Callable:
    """class_predicate for nn.quantize: which layers to quantize, and with which parameters. With
    check_width=False it also accepts layers whose input width the group size does not divide
    (the layers the recipe means to quantize)."""
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
        if check_width and module.weight.shape[-1] % spec.group_size:
            return False  # input width not a multiple of the group: stays float (mlx-lm's rule)
        bits = low
        if spec.recipe is not None:
            parts = path.split(".")
            if path.startswith("visual.") or path in ("lm_head", "language_model.embed_tokens"):
                bits = high
            elif parts[:2] == ["language_model", "layers"] and parts[3:4] and parts[-1] in ("v_proj", "down_proj"):
                bits = high if more_bits(int(parts[2])) else low
        return {"group_size": spec.group_size, "bits": bits, "mode": spec.mode}

    return predicate


def quantize_layers(model: nn.Module, config, spec: QuantSpec, allow_float_layers: bool = False) -> str:
    """Quantize what the group size allows; refuse (InputError) when that is nothing, or less than
    MIN_QUANTIZED_SHARE of the weights meant for it, unless allow_float_layers. Returns the summary."""
    wanted = make_predicate(config, spec, check_width=False)
    meant = {p: m for p, m in model.named_modules() if wanted(p, m)}
    fits = {p: m for p, m in meant.items() if m.weight.shape[-1] % spec.group_size == 0}
    share = sum(m.weight.size for m in fits.values()) / max(sum(m.weight.size for m in meant.values()), 1)
    left = sorted({m.weight.shape[-1] for p, m in meant.items() if p not in fits})
    why = (f"input widths {', '.join(map(str, left))} are not multiples of the group size {spec.group_size}"
           if left else "")
    hint = ("use --q-mode affine with --q-group-size 32" if spec.mode in FIXED_MODES
            else "choose a --q-group-size that divides them")
    if not fits:
        raise InputError(f"-q would quantize none of the {len(meant)} layers ({why}): {hint}")
    if share < MIN_QUANTIZED_SHARE and not allow_float_layers:
        raise InputError(f"-q could quantize only {len(fits)} of {len(meant)} layers ({share:.0%} of their weights; "
                         f"{why}): {hint}, or pass --allow-float-layers to keep the rest float")
    nn.quantize(model, spec.group_size, spec.bits, mode=spec.mode, class_predicate=make_predicate(config, spec))
    from mlx_lm.utils import compute_bits_per_weight

    summary = (f"quantized {len(fits)} of {len(meant)} layers ({spec.describe()}), "
               f"{compute_bits_per_weight(model):.2f} bits per weight")
    if len(fits) < len(meant):
        summary += f"; {len(meant) - len(fits)} stay float ({why})"
    return summary


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
    """Consecutive groups of tensors of at most max_bytes each (a larger tensor gets its own).
    mlx-lm's make_shards takes whole gigabytes; --max-shard-size takes any size."""
    shards, size = [], 0
    for key in sorted(weights):
        nbytes = weights[key].nbytes
        if not shards or (size + nbytes > max_bytes and shards[-1]):
            shards.append({})
            size = 0
        shards[-1][key] = weights[key]
        size += nbytes
    return shards


def _overflowed(shard: dict) -> list:
    """float16 tensors holding inf: values beyond float16's ±65504 (in the source or once cast)."""
    return [k for k, v in shard.items() if v.dtype == mx.float16 and bool(mx.isinf(v).any())]


def write_weights(out: Path, weights: dict, max_bytes: int = MAX_SHARD_BYTES, log=_stderr):
    """Save `weights` as shards plus index. The dict is emptied as shards are written, so a lazily
    computed (loaded, cast, quantized) model is held in memory about one shard at a time. float16
    tensors that overflowed to inf are refused (InputError naming them) once every shard is seen.
    (mlx-lm's save_model writes a module's own parameter names in whole-GB shards; these are
    mlx-vlm's names and layout, in shards of any size.)"""
    total = sum(v.nbytes for v in weights.values())
    shards = make_shards(weights, max_bytes)
    weights.clear()
    n = len(shards)
    weight_map, overflowed = {}, []
    for i in range(n):
        shard, shards[i] = shards[i], None
        name = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        mx.eval(shard)
        overflowed += _overflowed(shard)
        mx.save_safetensors(str(out / name), shard, metadata={"format": "mlx"})
        weight_map.update({k: name for k in shard})
        log(f"convert: wrote {name} ({sum(v.nbytes for v in shard.values()) / 1e6:.1f} MB, {len(shard)} tensors)")
        del shard
    if overflowed:
        raise InputError(f"{len(overflowed)} tensor(s) exceed float16's range (±{FLOAT16_MAX:g}) and would be inf: "
                         f"{', '.join(sorted(overflowed)[:4])}{' ...' if len(overflowed) > 4 else ''}; "
                         "use --dtype bfloat16 or float32")
    index = {"metadata": {"total_size": total, "format": "mlx"}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def copy_side_files(src: Path, out: Path) -> list:
    copied = []
    for f in sorted(src.iterdir()):
        if f.is_file() and any(fnmatch.fnmatch(f.name, p) for p in COPY_PATTERNS):
            shutil.copyfile(f, out / f.name)
            copied.append(f.name)
    return copied


def export_weights(weights: dict, config, layout: str = OUTPUT_LAYOUT) -> dict:
    """Module-named weights → `layout`'s names and patch-kernel shape (the dict is emptied)."""
    out = {}
    for key in list(weights):
        value = weights.pop(key)
        if key == "visual.patch_embed.proj.weight":
            value = export_patch_kernel(value, layout, config.vision_config)
        out[export_key(key, layout)] = value
    return out


def export_quantization(quantization, layout: str = OUTPUT_LAYOUT):
    if quantization is None:
        return None
    return {export_key(k, layout) if isinstance(v, dict) else k: v for k, v in quantization.items()}


# transformers 5's vision model_type → the one mlx-vlm 0.7 checks for (its qwen3_vl_moe VisionModel
# raises on anything but "qwen3_vl_moe").
MLX_VLM_VISION_TYPES = {"qwen3_vl_vision": "qwen3_vl", "qwen3_vl_moe_vision": "qwen3_vl_moe"}


def config_for_mlx_vlm(cfg: dict):
    """mlx-vlm 0.7 reads transformers 4.57's config keys and fails on what transformers 5 writes
    (rope_parameters only; vision model_type `qwen3_vl_vision` / `qwen3_vl_moe_vision`; MoE's
    `num_local_experts`, where its TextConfig requires `num_experts`): write the 4.57 keys beside
    the newer ones (this package and transformers read either)."""
    text, vision = cfg.get("text_config"), cfg.get("vision_config")
    if isinstance(text, dict) and isinstance(text.get("rope_parameters"), dict):
        params = text["rope_parameters"]
        text.setdefault("rope_theta", params.get("rope_theta"))
        text.setdefault("rope_scaling", {k: v for k, v in params.items() if k != "rope_theta"})
    if isinstance(text, dict) and "num_local_experts" in text:
        text.setdefault("num_experts", text["num_local_experts"])
    if isinstance(vision, dict) and vision.get("model_type") in MLX_VLM_VISION_TYPES:
        vision["model_type"] = MLX_VLM_VISION_TYPES[vision["model_type"]]


def output_config(src: Path, dtype: str, quantization, hf_path: str, quantize_vision: bool,
                  tied: Optional[bool] = None) -> dict:
    cfg = read_raw_config(src)
    for key in ("quantization", "quantization_config", FORMAT_KEY):
        cfg.pop(key, None)
    config_for_mlx_vlm(cfg)
    if tied is not None:  # a tied config whose files held their own head is written untied
        for where in (cfg, cfg.get("text_config")):
            if isinstance(where, dict) and (where is cfg or "tie_word_embeddings" in where):
                where["tie_word_embeddings"] = tied
    # Record the stored dtype where the source's layout keeps it (transformers 5: dtype, 4.57: torch_dtype).
    if "dtype" in cfg or "torch_dtype" not in cfg:
        cfg["dtype"] = dtype
    if "torch_dtype" in cfg:
        cfg["torch_dtype"] = dtype
    for sub in ("text_config", "vision_config"):
        for key in ("dtype", "torch_dtype"):
            if isinstance(cfg.get(sub), dict) and key in cfg[sub]:
                cfg[sub][key] = dtype
    if quantization is not None:  # both keys, as mlx-lm and mlx-vlm write them
        cfg["quantization"] = cfg["quantization_config"] = export_quantization(quantization)
    cfg[FORMAT_KEY] = {"format_version": FORMAT_VERSION, "converted_from": str(hf_path), "dtype": dtype,
                       "quantized_vision": bool(quantize_vision)}
    return cfg


def _folder_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def _is_checkpoint_folder(path: Path) -> bool:
    """What --force may replace: an empty folder, or one holding only a checkpoint's files
    (config.json and *.safetensors, no sub-folders)."""
    entries = list(path.iterdir())
    if not entries:
        return True
    return ((path / "config.json").is_file() and any(path.glob("*.safetensors"))
            and not any(e.is_dir() and not e.is_symlink() for e in entries))


def check_output(out: Path, force: bool):
    """Refuse an --mlx-path that exists, unless --force and it is a checkpoint folder."""
    if not out.exists() and not out.is_symlink():
        return
    if not force:
        raise InputError(f"--mlx-path {out} already exists: choose a new folder or pass --force to replace it")
    if out.is_symlink():
        raise InputError(f"--mlx-path {out} is a symbolic link; --force only replaces a model folder: choose a new path")
    if not out.is_dir():
        raise InputError(f"--mlx-path {out} is a file, not a model folder; --force only replaces a model folder: "
                         "choose a new path")
    if not _is_checkpoint_folder(out):
        raise InputError(f"--mlx-path {out} holds files but no checkpoint (config.json and *.safetensors, no "
                         "sub-folders); --force only replaces a model folder: choose a new folder")


def _inside(a: Path, b: Path) -> bool:
    """a is b or lies inside b."""
    a, b = a.resolve(), b.resolve()
    return a == b or b in a.parents


def convert(hf_path, mlx_path, dtype: Optional[str] = None, quantize: bool = False, q_bits: Optional[int] = None,
            q_group_size: Optional[int] = None, q_mode: str = "affine", quant_predicate: Optional[str] = None,
            quantize_vision: bool = False, force: bool = False, max_shard_bytes: int = MAX_SHARD_BYTES,
            allow_float_layers: bool = False, log=_stderr) -> Path:
    """Convert `hf_path` (folder or hub id) into `mlx_path`; returns the output folder."""
    if dtype is not None and dtype not in DTYPES:
        raise InputError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    spec = quant_spec(quantize, q_bits, q_group_size, q_mode, quant_predicate, quantize_vision)
    out = Path(mlx_path).expanduser()
    check_output(out, force)
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
        log(f"convert: {quantize_layers(model, config, spec, allow_float_layers)}")
    if config.text_config.is_moe:
        log(f"convert: {describe_experts(model)}")
    quantization = describe_quantization(model)
    tied = model.config.tie_word_embeddings
    weights = export_weights(dict(tree_flatten(model.parameters())), config)
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
        cfg = output_config(src, dtype, quantization, hf_path, bool(spec and spec.vision),
                            tied=None if tied == config.tie_word_embeddings else tied)
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
    check_output(out, force)  # appeared or changed while converting
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
    p = Parser(prog="convert.py", description="Convert a Qwen3-VL checkpoint (hub folder or repo id, "
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
    p.add_argument("--allow-float-layers", action="store_true",
                   help="go on when the group size divides less than half of the weights to quantize (the rest "
                        "stay float); without it such a run stops with an error")
    p.add_argument("--force", action="store_true",
                   help="replace --mlx-path if it is an empty folder or a model folder (never a file or other folder)")
    p.add_argument("--max-shard-size", type=_size, default=MAX_SHARD_BYTES, help="largest shard (default: 5GB)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    def body():
        convert(args.hf_path, args.mlx_path, dtype=args.dtype, quantize=args.quantize, q_bits=args.q_bits,
                q_group_size=args.q_group_size, q_mode=args.q_mode, quant_predicate=args.quant_predicate,
                quantize_vision=args.quantize_vision, force=args.force, max_shard_bytes=args.max_shard_size,
                allow_float_layers=args.allow_float_layers)
        return 0

    return run(body, interrupted="error: interrupted; nothing was written to --mlx-path")


if __name__ == "__main__":
    sys.exit(main())
