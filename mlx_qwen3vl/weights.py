"""Checkpoint folders → a ready Qwen3-VL model.

Three kinds of folder load, each recognised by its contents (weight names and config.json):

- a hub folder (what `save_pretrained` writes): `model.visual.*`, `model.language_model.*` and
  `lm_head.weight`, the patch embedding as the torch Conv3d kernel (E, C, T, P, P);
- a folder written by mlx-vlm (mlx-community's Qwen3-VL uploads): `vision_tower.*`,
  `language_model.model.*`, `language_model.lm_head.*`, the Conv3d kernel channels-last
  (E, T, P, P, C), and mlx-vlm's `quantization` section;
- a folder written by this package's converter (`python -m mlx_qwen3vl.convert`): mlx-vlm's layout (format 2,
  so mlx-vlm and LM Studio read it too) plus a `mlx_qwen3vl` marker in config.json; format-1
  folders (this package's module names, the patch kernel flattened to (E, C*T*P*P)) still load.

Weights are in `model.safetensors` or shards listed by `model.safetensors.index.json` (each tensor
is read from the shard the index names; without an index a name in two files is an error). Keys
are renamed onto this package's module tree and the patch kernel is flattened for the matmul. A
tied config's LM head: dropped when it equals the embedding, otherwise used (untied, with a
warning), as transformers does. Quantized folders: the model is built, the layers that the checkpoint holds quantized
(a `<layer>.scales` tensor, or a per-layer entry in `quantization`) are swapped for MLX's quantized
layers with the config's group size, bits and mode (per-layer overrides first), then the weights
load. Loading is strict: every missing, unexpected or mis-shaped weight is reported together, in
one line.
"""

import warnings
from collections import Counter
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from .backend import plain_graph_on_cpu
from .checkpoint import _short_list, read_raw_config, read_weights, weight_files  # noqa: F401
from .config import ModelConfig
from .errors import ConfigError, WeightsError
from .model import Qwen3VLForConditionalGeneration
from .moe import check_device_dtype


DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}

# Folder kinds.
HUB = "hub"
CONVERTED = "mlx_qwen3vl"
MLX_VLM = "mlx-vlm"

# config.json key that marks a folder written by mlx_qwen3vl.convert, and its format version
# (1: this package's module names; 2: mlx-vlm's names and patch kernel, readable by mlx-vlm).
FORMAT_KEY = "mlx_qwen3vl"
FORMAT_VERSION = 2

# Weight-name layouts: checkpoint name prefix → module name prefix (first match wins). A prefix
# also matches the bare module path (mlx-vlm's per-layer override `language_model.lm_head`).
OURS = "modules"  # this package's module names (format-1 conversions)
RENAMES = {
    HUB: [("model.visual.", "visual."), ("model.language_model.", "language_model.")],
    MLX_VLM: [("vision_tower.", "visual."), ("language_model.model.", "language_model."),
              ("language_model.lm_head.", "lm_head.")],
    OURS: [],
}
QUANT_MODES = ("affine", "mxfp4", "nvfp4", "mxfp8")
AFFINE_BITS = (2, 3, 4, 5, 6, 8)
AFFINE_GROUP_SIZES = (32, 64, 128)
# Modes with a fixed (bits, group_size).
FIXED_MODES = {"mxfp4": (4, 32), "nvfp4": (4, 16), "mxfp8": (8, 32)}
# Layers read as plain tables or whose dtype the vision tower relies on: never quantized.
NEVER_QUANTIZED = ("visual.patch_embed.proj", "visual.pos_embed")


def check_dtypes(weights: dict, origin: dict, config: ModelConfig, path: Path):
    """Float tensors must be in the dtype config.json states (or float32, which loses nothing): a
    float16 shard in a bfloat16 folder is a file from another conversion, with another range."""
    stated = DTYPES.get(str(config.torch_dtype))
    if stated is None:
        return
    wrong = {k: v.dtype for k, v in weights.items()
             if mx.issubdtype(v.dtype, mx.floating) and v.dtype not in (stated, mx.float32)}
    if wrong:
        found = sorted({str(d).split(".")[-1] for d in wrong.values()})
        files = sorted({origin[k] for k in wrong})
        raise WeightsError(f"{path}: {_short_list(files)} hold{'s' if len(files) == 1 else ''} {'/'.join(found)} "
                           f"tensors ({_short_list(wrong, 2)}) but config.json says {config.torch_dtype}: the file "
                           "belongs to another checkpoint; re-download or re-convert it")


def detect_layout(keys) -> str:
    """Which names the weights carry: hub, mlx-vlm or this package's module names."""
    keys = list(keys)
    if any(k.startswith(("vision_tower.", "language_model.model.", "language_model.lm_head.")) for k in keys):
        return MLX_VLM
    if any(k.startswith(("model.visual.", "model.language_model.")) for k in keys):
        return HUB
    if any(k.startswith(("visual.", "language_model.")) for k in keys):
        return OURS
    return HUB  # nothing recognisable: the strict check reports what is wrong


def detect_kind(raw_config: dict, keys) -> str:
    """hub, mlx_qwen3vl (converted) or mlx-vlm, from the weight names (and our marker)."""
    keys = list(keys)
    marker = raw_config.get(FORMAT_KEY)
    if marker is not None:
        version = marker.get("format_version") if isinstance(marker, dict) else None
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise ConfigError(
                f"config.json says it was written by a newer mlx_qwen3vl converter (format {version!r}, "
                f"this version reads {FORMAT_VERSION}): upgrade mlx_qwen3vl or re-convert"
            )
        return CONVERTED
    layout = detect_layout(keys)
    return CONVERTED if layout == OURS else layout  # our names without the marker: a hand-edited config


def _swap_prefix(name: str, pairs) -> str:
    """The first (from, to) prefix pair that matches `name`, or the bare path `from` without its dot."""
    for old, new in pairs:
        if name.startswith(old):
            return new + name[len(old):]
        if name == old[:-1]:
            return new[:-1]
    return name


def rename_key(key: str, layout: str) -> str:
    """A weight name or module path of `layout` → this package's module name."""
    return _swap_prefix(key, RENAMES[layout])


def _patch_kernel(value, layout: str, vision):
    """The patch embedding as (E, C*T*P*P) in torch (C, T, P, P) order, from any stored layout."""
    if value.ndim != 5:
        return value
    C, T, P = vision.in_channels, vision.temporal_patch_size, vision.patch_size
    channels_last = (value.shape[0], T, P, P, C)
    if layout == MLX_VLM and tuple(value.shape) == channels_last:
        value = value.transpose(0, 4, 1, 2, 3)  # MLX Conv3d (E, T, P, P, C) → torch (E, C, T, P, P)
    return value.reshape(value.shape[0], -1)


def export_key(name: str, layout: str) -> str:
    """A module name or path → its name in `layout` (the inverse of rename_key)."""
    return _swap_prefix(name, [(new, old) for old, new in RENAMES[layout]])


def export_patch_kernel(value, layout: str, vision):
    """The matmul-form patch kernel (E, C*T*P*P) as `layout` stores it: MLX's channels-last Conv3d
    (E, T, P, P, C) for mlx-vlm, torch's (E, C, T, P, P) for the hub."""
    if value.ndim != 2 or layout == OURS:
        return value
    C, T, P = vision.in_channels, vision.temporal_patch_size, vision.patch_size
    value = value.reshape(value.shape[0], C, T, P, P)
    return value.transpose(0, 2, 3, 4, 1) if layout == MLX_VLM else value


def sanitize(weights: dict, config: ModelConfig, layout: str = HUB) -> dict:
    """Checkpoint names → module names; Conv3d kernel → matmul weight."""
    out = {}
    for key, value in weights.items():
        key = rename_key(key, layout)
        if key == "visual.patch_embed.proj.weight":
            value = _patch_kernel(value, layout, config.vision_config)
        out[key] = value
    return out


# Fused expert tensors of MoE hub checkpoints come in two orientations: the published files (written
# by transformers 4.57) hold gate_up_proj (E, D, 2I) and down_proj (E, I, D); transformers 5's
# save_pretrained writes its in-memory layout, (E, 2I, D) and (E, D, I). Both split into mlx-lm's
# SwitchGLU weights (E, out, in): gate the first I rows of gate_up, up the rest.
EXPERTS_HUB = "hub (transformers 4.57)"
EXPERTS_T5 = "transformers 5"
FUSED_EXPERTS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def _expert_shapes(config: ModelConfig) -> dict:
    t = config.text_config
    E, D, I = t.num_experts, t.hidden_size, t.moe_intermediate_size
    return {EXPERTS_HUB: {"gate_up_proj": (E, D, 2 * I), "down_proj": (E, I, D)},
            EXPERTS_T5: {"gate_up_proj": (E, 2 * I, D), "down_proj": (E, D, I)}}


def expert_layout(weights: dict, config: ModelConfig, where: str):
    """Which orientation a checkpoint's fused experts are stored in (None when it has none): by
    shape, which decides whenever hidden != 2*I or I != hidden; otherwise by the config's
    transformers_version; a WeightsError when neither does."""
    fused = {k: v for k, v in weights.items() if k.endswith(FUSED_EXPERTS)}
    if not fused:
        return None
    shapes = _expert_shapes(config)
    candidates = set(shapes)
    for key, value in sorted(fused.items()):
        name = key.rpartition(".")[2]
        fits = {layout for layout, expected in shapes.items() if tuple(value.shape) == expected[name]}
        if not fits:
            t = config.text_config
            raise WeightsError(
                f"{where}: {key} has shape {tuple(value.shape)}, neither the hub's {shapes[EXPERTS_HUB][name]} nor "
                f"transformers 5's {shapes[EXPERTS_T5][name]} for num_experts {t.num_experts}, hidden_size "
                f"{t.hidden_size}, moe_intermediate_size {t.moe_intermediate_size}: check config.json")
        candidates &= fits
    if len(candidates) == 1:
        return candidates.pop()
    if not candidates:
        raise WeightsError(f"{where}: the expert tensors mix the hub's and transformers 5's layouts: re-save the "
                           "checkpoint with one version of transformers")
    version = str(config.transformers_version or "")
    major = version.split(".")[0]
    if not major.isdigit():
        raise WeightsError(f"{where}: the expert tensors have the same shape in the hub's and transformers 5's "
                           "layouts and config.json has no transformers_version to tell them apart: add the "
                           "transformers_version that wrote the weights (e.g. \"4.57.0\" or \"5.0.0\") to config.json")
    return EXPERTS_T5 if int(major) >= 5 else EXPERTS_HUB


def split_fused_experts(weights: dict, config: ModelConfig, where: str) -> dict:
    """Fused hub expert tensors (either orientation) -> mlx-lm SwitchGLU weights; other keys kept."""
    layout = expert_layout(weights, config, where)
    if layout is None:
        return weights
    I = config.text_config.moe_intermediate_size
    out = {}
    for key, value in weights.items():
        if not key.endswith(FUSED_EXPERTS):
            out[key] = value
            continue
        if layout == EXPERTS_HUB:
            value = value.swapaxes(1, 2)  # (E, in, out) -> (E, out, in)
        prefix, _, name = key.rpartition(".experts.")
        if name == "gate_up_proj":
            out[f"{prefix}.switch_mlp.gate_proj.weight"] = value[:, :I]
            out[f"{prefix}.switch_mlp.up_proj.weight"] = value[:, I:]
        else:
            out[f"{prefix}.switch_mlp.down_proj.weight"] = value
    return out


def resolve_tied_head(weights: dict, config: ModelConfig, where: str):
    """A tied config whose files also hold an `lm_head`: dropped when it is the embedding again,
    otherwise used, as transformers does (the config is untied, with a warning)."""
    head = {k: v for k, v in weights.items() if k.startswith("lm_head.")}
    if not config.tie_word_embeddings or not head:
        return
    embed = {k.replace("language_model.embed_tokens.", "lm_head."): v for k, v in weights.items()
             if k.startswith("language_model.embed_tokens.")}
    whole = lambda v: v.read() if hasattr(v, "read_raw") else v  # noqa: E731  (a sharded_load.TensorView: read it)
    same = set(head) == set(embed) and all(
        head[k].shape == embed[k].shape and bool(mx.array_equal(whole(head[k]), whole(embed[k]))) for k in head)
    if same:
        for k in head:
            del weights[k]
        return
    warnings.warn(f"{where}: config.json ties the LM head to the embedding but the weights hold a different "
                  "lm_head; using that head (as transformers does): set tie_word_embeddings to false, or drop "
                  "lm_head from the files if the tie is right", UserWarning, stacklevel=3)
    config.tie_word_embeddings = config.text_config.tie_word_embeddings = False


class DtypedQuantizedEmbedding(nn.QuantizedEmbedding):
    """A quantized embedding that returns the model's compute dtype. The fp modes (mxfp4, nvfp4,
    mxfp8) store no float scales for mx.dequantize to take a dtype from, so it returns bfloat16:
    a float32 model would then run its first layer and scattered vision features in bfloat16."""

    compute_dtype = "float32"  # a name (mx.Dtype does not deepcopy)

    def __call__(self, x):
        biases = self.get("biases")
        return mx.dequantize(self["weight"][x], scales=self["scales"][x],
                             biases=biases[x] if biases is not None else None, group_size=self.group_size,
                             bits=self.bits, mode=self.mode, dtype=DTYPES[self.compute_dtype])


def set_embedding_dtype(model: nn.Module, dtype):
    """Make fp-mode quantized embeddings return `dtype` (affine ones follow their scales' dtype)."""
    for _, m in model.named_modules():
        if isinstance(m, nn.QuantizedEmbedding) and m.mode != "affine":
            m.__class__ = DtypedQuantizedEmbedding
            m.compute_dtype = next(name for name, d in DTYPES.items() if d == dtype)


def _quant_params(params: dict, where: str) -> dict:
    try:
        q = {"group_size": int(params["group_size"]), "bits": int(params["bits"]),
             "mode": str(params.get("mode", "affine"))}
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{where}: quantization entry {params!r} needs integer group_size and bits ({e})") from None
    if q["mode"] not in QUANT_MODES:
        raise ConfigError(f"{where}: quantization mode {q['mode']!r} is not one of {', '.join(QUANT_MODES)}")
    if q["mode"] in FIXED_MODES and (q["bits"], q["group_size"]) != FIXED_MODES[q["mode"]]:
        bits, group = FIXED_MODES[q["mode"]]
        raise ConfigError(f"{where}: quantization mode {q['mode']} stores {bits} bits in groups of {group}, not "
                          f"{q['bits']} bits in groups of {q['group_size']}: fix the quantization section")
    if q["mode"] == "affine" and (q["bits"] not in AFFINE_BITS or q["group_size"] not in AFFINE_GROUP_SIZES):
        raise ConfigError(f"{where}: affine quantization with {q['bits']} bits in groups of {q['group_size']} is not "
                          f"supported (bits {', '.join(map(str, AFFINE_BITS))}; groups "
                          f"{', '.join(map(str, AFFINE_GROUP_SIZES))})")
    return q


def apply_quantization(model: nn.Module, quantization: dict, weights: dict, layout: str, where: str):
    """Swap the layers the checkpoint stores quantized for MLX quantized layers, as its config says."""
    if not isinstance(quantization, dict):
        raise ConfigError(f"{where}: quantization must be an object with group_size and bits, not {quantization!r}")
    if "quant_method" in quantization and "bits" not in quantization:
        raise ConfigError(f"{where}: weights quantized with {quantization['quant_method']!r} (a transformers "
                          "quantization) are not supported: convert the unquantized checkpoint with "
                          "python -m mlx_qwen3vl.convert -q")
    default = _quant_params({k: v for k, v in quantization.items() if k in ("group_size", "bits", "mode")}, where)
    overrides = {}
    for key, value in quantization.items():
        if isinstance(value, dict):
            overrides[rename_key(key, layout)] = _quant_params({**default, **value}, where)
        elif isinstance(value, bool):
            overrides[rename_key(key, layout)] = value
    unsupported = [p for p in NEVER_QUANTIZED if f"{p}.scales" in weights or overrides.get(p)]
    if unsupported:
        raise WeightsError(f"{where}: {_short_list(unsupported)} is stored quantized, which this engine does not "
                           "support (it is read as a float table): re-convert with python -m mlx_qwen3vl.convert")

    def stored_quantized(path):  # scales, or a packed weight whose scales went missing
        weight = weights.get(f"{path}.weight")
        return f"{path}.scales" in weights or (weight is not None and weight.dtype == mx.uint32)

    def predicate(path, module):
        if not hasattr(module, "to_quantized") or path in NEVER_QUANTIZED:
            return False
        choice = overrides.get(path, stored_quantized(path))
        if choice is True:
            return dict(default)
        return choice

    nn.quantize(model, default["group_size"], default["bits"], mode=default["mode"], class_predicate=predicate)


def describe_quantization(model: nn.Module):
    """The `quantization` config section of a quantized model: the most common (group_size, bits,
    mode) as the default, and an entry for each layer that differs; None when nothing is quantized."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear  # mlx-lm imports transformers: on use

    layers = {
        path: {"group_size": m.group_size, "bits": m.bits, "mode": m.mode}
        for path, m in model.named_modules()
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear))
    }
    if not layers:
        return None
    counts = Counter(tuple(p.items()) for p in layers.values())
    default = dict(counts.most_common(1)[0][0])
    section = dict(default)
    for path in sorted(layers):
        if layers[path] != default:
            section[path] = layers[path]
    return section


def check_weights(model: nn.Module, weights: dict, where: str):
    """One WeightsError naming every missing, unexpected and mis-shaped weight."""
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


def check_and_load(model: nn.Module, weights: dict, where: str):
    check_weights(model, weights, where)
    model.update(tree_unflatten(list(weights.items())))


def default_dtype(config: ModelConfig):
    """float32 on the CPU backend (its bf16/fp16 matmuls never reach BLAS and run far slower:
    benchmarks/README.md); the checkpoint's dtype on a GPU."""
    if mx.default_device().type == mx.DeviceType.cpu:
        return mx.float32
    return DTYPES.get(str(config.torch_dtype), mx.bfloat16)


def _as_dtype(dtype):
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise WeightsError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        return DTYPES[dtype]
    return dtype


def assemble(path: Path, dtype=None, views=False):
    """(config, module name → weight, dtype, layout) of a checkpoint folder: every rename, expert
    split and tied-head choice made, floating weights cast to `dtype` (lazily). views=True gives
    sharded_load.TensorView's (read by parts later) instead of lazily loaded arrays."""
    config = ModelConfig.from_pretrained(path)
    dtype = _as_dtype(dtype) or default_dtype(config)
    raw, origin = read_weights(path, with_files=True, views=views)
    kind = detect_kind(read_raw_config(path), raw)
    if kind != MLX_VLM:  # mlx-vlm drops torch_dtype but can leave a stale "dtype" after --dtype
        check_dtypes(raw, origin, config, path)
    layout = detect_layout(raw)
    weights = split_fused_experts(sanitize(raw, config, layout), config, str(path))
    resolve_tied_head(weights, config, str(path))
    weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    return config, weights, dtype, layout, kind


def empty_model(config: ModelConfig, weights: dict, layout: str, path: Path, dtype):
    """The model of `config` with the layers `weights` holds quantized swapped for quantized ones,
    its parameters not yet loaded."""
    model = Qwen3VLForConditionalGeneration(config)
    if config.quantization is not None:
        apply_quantization(model, config.quantization, weights, layout, str(path / "config.json"))
        set_embedding_dtype(model, dtype)
    elif any(k.endswith(".scales") for k in weights):
        example = next(k for k in sorted(weights) if k.endswith(".scales"))
        raise WeightsError(f"{path} holds quantized weights ({example}) but its config.json has no quantization "
                           "section: restore the config.json that came with these weights")
    plain_graph_on_cpu(model)
    model.eval()
    return model


def build_model(path, dtype=None, lazy=False):
    """(model, kind) for a checkpoint folder of any kind; floating weights cast to `dtype`.
    With lazy=True the weights are left unevaluated (the converter streams them to disk)."""
    path = Path(path)
    config, weights, dtype, layout, kind = assemble(path, dtype)
    model = empty_model(config, weights, layout, path, dtype)
    check_and_load(model, weights, str(path))
    if not lazy:
        mx.eval(model.parameters())
    return model, kind


def load_model(path, dtype=None, backend=None) -> Qwen3VLForConditionalGeneration:
    """Load a hub, converted or mlx-vlm checkpoint folder (see the module docstring), with its
    backend installed: "mlx", "cpu" or None (automatic, see backend.install)."""
    from .backend import install

    model = build_model(path, dtype)[0]
    check_device_dtype(model, str(path))
    return install(model, backend)
