"""The Qwen3 decoder of Qwen3-VL: q/k RMSNorm on the head dim, GQA, SwiGLU, interleaved mRoPE, and
DeepStack (vision features from early ViT blocks added after the first decoder layers)."""

from functools import partial

import mlx.core as mx
import mlx.nn as nn

from .attention import PROMPT_BUDGET, scaled_dot_product_attention
from .config import TextConfig
from .moe import SparseMoeBlock
from .packed import PackedRows
from .rope import TextRotary


class Attention(nn.Module):
    def __init__(self, config: TextConfig):
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def __call__(self, x, rope, mask, cache=None, last=None):
        """`last`: only the last `last` positions' outputs are wanted, of each packed row when
        `cache` is a PackedRows (every position's keys and values still go to the cache)."""
        B, L, _ = x.shape
        q, k, v = self.project(x)
        q = self.q_norm(q.reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)
        k = self.k_norm(k.reshape(B, L, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = v.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        q, k = rope(q), rope(k)
        if isinstance(cache, PackedRows):  # several rows' tokens in one sequence: each attends to its own cache
            out = cache.attend(self.attend_cached, q, k, v, last)
            L = out.shape[2]
        else:
            if last is not None and last < L:
                q, L = q[:, :, -last:], last
                mask = mask[..., -last:, :] if isinstance(mask, mx.array) else mask  # "causal" is lower-right aligned
            out = self.attend_cached(q, k, v, mask, cache)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def attend_cached(self, q, k, v, mask, cache):
        """The new keys and values into `cache` (when given), then attention over all it holds."""
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        if isinstance(k, tuple):  # a quantized cache: (data, scales, biases), read as it is
            return self.attend_quantized(q, k, v, mask, *cache.kind)
        return self.attend(q, k, v, mask)

    def project(self, x):
        """q, k, v: one matmul when backend.fuse built their stacked weight at load."""
        qkv = self.get("_qkv")
        if qkv is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return mx.split(x @ qkv.T, self._qkv_split, axis=-1)

    def attend(self, q, k, v, mask):
        """softmax(q k^T * scale, masked) v over grouped heads; mask None, "causal" (lower-right
        aligned, so it holds with a KV cache) or boolean (B, 1, L, S); in query chunks of bounded
        memory over a long prompt (attention.py)."""
        return scaled_dot_product_attention(q, k, v, self.scale, mask, budget=PROMPT_BUDGET)

    def attend_quantized(self, q, k, v, mask, bits, group_size):
        """`attend` over quantized keys and values: mlx-lm's quantized attention (MLX's quantized
        matmuls read the packed cache; nothing is dequantized whole)."""
        from mlx_lm.models.base import quantized_scaled_dot_product_attention  # the cache type loaded it

        return quantized_scaled_dot_product_attention(q, k, v, self.scale, mask, group_size=group_size, bits=bits)


@partial(mx.compile, shapeless=True)
def swiglu(gate, up):
    """silu(gate) * up as one kernel (mlx-lm's); compiled once for every shape."""
    return nn.silu(gate) * up


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x):
        return self.down_proj(swiglu(*self.gate_up(x)))

    def gate_up(self, x):
        """gate and up projections: one matmul when backend.fuse built their stacked weight at load."""
        w = self.get("_gate_up")
        if w is None:
            return self.gate_proj(x), self.up_proj(x)
        return mx.split(x @ w.T, 2, axis=-1)


def make_mlp(config: TextConfig, index: int) -> nn.Module:
    """Layer `index`'s feed-forward block: the experts on sparse layers of an MoE model, else dense."""
    return SparseMoeBlock(config) if config.is_sparse_layer(index) else MLP(config.hidden_size, config.intermediate_size)


class DecoderLayer(nn.Module):
    def __init__(self, config: TextConfig, index: int = 0):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = make_mlp(config, index)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def __call__(self, x, rope, mask, cache=None, last=None):
        h = self.self_attn(self.input_layernorm(x), rope, mask, cache, last)
        h = kept(x, h.shape[1], cache, last) + h
        return h + self.mlp(self.post_attention_layernorm(h))


def attention_mask_for(key_mask, query_len: int):
    """Boolean (B, 1, L, S) mask: causal (lower-right aligned, so it holds with a KV cache) and
    hiding padded keys. Each query may always see itself, so a padding row never becomes an
    all-masked row (NaN) that could leak into real rows through 0 * NaN."""
    S = key_mask.shape[-1]
    q_pos = mx.arange(S - query_len, S)[:, None]
    k_pos = mx.arange(S)[None, :]
    allowed = (k_pos <= q_pos) & key_mask[:, None, None, :].astype(mx.bool_)
    return allowed | (k_pos == q_pos)


class TextModel(nn.Module):
    def __init__(self, config: TextConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = [DecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary = TextRotary(config.head_dim, config.rope_theta, config.mrope_section)

    def __call__(self, inputs_embeds, position_ids, mask=None, cache=None, deepstack_embeds=None, last=None):
        """inputs_embeds (B, L, D); position_ids (3, B, L), or (B,) for a text-only chunk (see
        TextRotary); mask None / "causal" / boolean (B, 1, L, S); cache: one per layer, or a
        packed.PackedRows per layer for several rows packed into one sequence (B = 1, mask
        unused); deepstack_embeds: list of (B, L, D) arrays, zero except at visual positions.
        `last`: return only the last `last` positions (of each packed row; the end of a prefill
        wants one): the final layer then attends, projects out and runs its MLP for those positions
        alone (its q/k/v projection still covers every position: one stacked matmul).

        DeepStack: the k-th tapped vision feature is added right after decoder layer k, i.e. to
        layers 0, 1, 2 for three taps — the LLM layer index, not the ViT block index it came from.
        Adding zeros elsewhere is exact, which keeps this correct across prefill chunks."""
        h = inputs_embeds
        cache = cache or [None] * len(self.layers)
        deepstack_embeds = deepstack_embeds or []
        rope = self.rotary(position_ids, h.shape[1], h.dtype)
        final = len(self.layers) - 1
        for i, (layer, c) in enumerate(zip(self.layers, cache)):
            h = layer(h, rope, mask, c, last if i == final else None)
            if i < len(deepstack_embeds):
                h = h + kept(deepstack_embeds[i], h.shape[1], c, last).astype(h.dtype)
        return self.norm(h)


def kept(a, n: int, cache, last):
    """The positions of `a` (B, L, ...) that a layer called with `last` kept (n of them): the last
    `last` of each packed row (PackedRows), else of the sequence; all when it kept all."""
    if a.shape[1] == n:
        return a
    return cache.last_positions(a, last) if isinstance(cache, PackedRows) else a[:, -n:]
