"""The sparse mixture-of-experts block of Qwen3-VL-MoE (30B-A3B, 235B-A22B, UI-Venus-1.5-30B-A3B).

Each token's router logits go through a float32 softmax; the top-k experts are kept and their
weights renormalised to sum to one (transformers' Qwen3VLMoeTextTopKRouter). The experts are
stacked weights run by mlx-lm's `SwitchGLU`: `mx.gather_mm` (or `mx.gather_qmm` once quantized)
reads only the selected experts' rows, so a decode token costs the active parameters, not all of
them, and there is no loop over experts in Python.

Module names follow mlx-lm / mlx-vlm (`gate`, `switch_mlp.{gate,up,down}_proj`); weights.py maps the
hub's fused `experts.gate_up_proj` / `experts.down_proj` onto them.
"""

import mlx.core as mx
import mlx.nn as nn

from .config import TextConfig
from .errors import InputError


def route(logits, top_k: int, normalize: bool = True):
    """(indices, weights) of the top-k experts per token from router logits (..., E); the softmax
    and the renormalisation in float32, the weights returned in the logits' dtype (as transformers)."""
    probs = mx.softmax(logits.astype(mx.float32), axis=-1)
    inds = mx.argpartition(-probs, kth=top_k - 1, axis=-1)[..., :top_k]
    weights = mx.take_along_axis(probs, inds, axis=-1)
    if normalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return inds, weights.astype(logits.dtype)


class SparseMoeBlock(nn.Module):
    def __init__(self, config: TextConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        # mlx-lm is imported when an MoE model is built: importing it pulls in transformers (seconds).
        from mlx_lm.models.switch_layers import SwitchGLU

        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.switch_mlp = SwitchGLU(config.hidden_size, config.moe_intermediate_size, config.num_experts)

    def __call__(self, x):
        inds, weights = route(self.gate(x), self.top_k, self.norm_topk_prob)
        y = self.switch_mlp(x, inds)  # (..., k, D)
        return (y * weights[..., None]).sum(axis=-2)


def check_device_dtype(model: nn.Module, where: str):
    """MLX's CPU backend runs float experts (gather_mm) in float32 only: refuse, at load, a float16 /
    bfloat16 MoE model there instead of failing at its first token. Quantized experts
    (gather_qmm) run in any float dtype."""
    if mx.default_device().type != mx.DeviceType.cpu:
        return
    for path, m in model.named_modules():
        if isinstance(m, SparseMoeBlock) and "weight" in m.switch_mlp.gate_proj and "scales" not in m.switch_mlp.gate_proj:
            dtype = m.switch_mlp.gate_proj.weight.dtype
            if dtype != mx.float32:
                name = str(dtype).rpartition(".")[2]
                raise InputError(f"{where}: the experts are float ({name}), which MLX's CPU backend runs in float32 "
                                 "only: load with dtype float32 (the CPU default) or convert with -q")
            return


def weight_counts(model: nn.Module) -> dict:
    """The language model's weights (LM head included): `total` and per-token `active` counts (a token runs through k of
    E experts), as original weights (a packed quantized weight counts unpacked), and the bytes they
    are stored in. Equal for a dense model."""
    from mlx.utils import tree_flatten

    shares = {f"{path}.switch_mlp.": m.top_k / m.gate.weight.shape[0]
              for path, m in model.named_modules() if isinstance(m, SparseMoeBlock)}
    counts = dict(total=0.0, active=0.0, total_bytes=0.0, active_bytes=0.0)
    for path, module in model.named_modules():
        if not path.startswith(("language_model.", "lm_head")) or module.children():
            continue  # leaf modules of the language model and its head
        share = next((v for prefix, v in shares.items() if path.startswith(prefix)), 1.0)
        bits = getattr(module, "bits", None)  # quantized: weight packed, scales/biases are overhead
        for name, value in tree_flatten(module.parameters()):
            if bits and name == "weight":
                n = value.size * 32 // bits
            else:
                n = 0 if bits and name in ("scales", "biases") else value.size
            counts["total"] += n
            counts["active"] += n * share
            counts["total_bytes"] += value.nbytes
            counts["active_bytes"] += value.nbytes * share
    return {k: int(v) for k, v in counts.items()}
