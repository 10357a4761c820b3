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
from mlx_lm.models.switch_layers import SwitchGLU

from .config import TextConfig


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
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.switch_mlp = SwitchGLU(config.hidden_size, config.moe_intermediate_size, config.num_experts)

    def __call__(self, x):
        inds, weights = route(self.gate(x), self.top_k, self.norm_topk_prob)
        y = self.switch_mlp(x, inds)  # (..., k, D)
        return (y * weights[..., None]).sum(axis=-2)


def active_parameters(config: TextConfig) -> dict:
    """Decoder parameter counts of a (possibly sparse) text config: `total` and `active` per token
    (the experts a token does not select are not read). Embeddings and LM head included once each."""
    D, E = config.hidden_size, config.num_experts
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    attn = D * (q + 2 * kv) + q * D + 2 * config.head_dim + 2 * D
    dense_mlp = 3 * D * config.intermediate_size
    expert = 3 * D * config.moe_intermediate_size
    total = active = 0
    for i in range(config.num_hidden_layers):
        if config.is_sparse_layer(i):
            total += attn + D * E + E * expert
            active += attn + D * E + config.num_experts_per_tok * expert
        else:
            total += attn + dense_mlp
            active += attn + dense_mlp
    head = config.vocab_size * D * (1 if config.tie_word_embeddings else 2) + D
    return {"total": total + head, "active": active + head}
