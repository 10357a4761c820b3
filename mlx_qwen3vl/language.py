"""The Qwen3 decoder of Qwen3-VL: q/k RMSNorm on the head dim, GQA, SwiGLU, interleaved mRoPE, and
DeepStack (vision features from early ViT blocks added after the first decoder layers)."""

import mlx.core as mx
import mlx.nn as nn

from . import cpu_kernels
from .cpu_kernels import Linear, attention, silu_mul
from .config import TextConfig
from .rope import TextRotary, apply_rotary


class Attention(nn.Module):
    def __init__(self, config: TextConfig):
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        bias = config.attention_bias
        self.q_proj = Linear(config.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(config.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(config.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.n_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def __call__(self, x, rope, mask, cache=None):
        B, L, _ = x.shape
        cos, sin = rope
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)
        k = self.k_norm(self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        if mask is None or isinstance(mask, str):  # unpadded: causal for a chunk, none for one query
            out = attention(q, k, v, self.scale, causal=mask == "causal")
        else:
            out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = Linear(dim, hidden, bias=False)
        self.up_proj = Linear(dim, hidden, bias=False)
        self.down_proj = Linear(hidden, dim, bias=False)

    def __call__(self, x):
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: TextConfig):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def __call__(self, x, rope, mask, cache=None):
        if cpu_kernels.decode_layer_applies(self, x, mask, cache):
            return cpu_kernels.decode_layer(self, x, rope, cache)
        h = x + self.self_attn(self.input_layernorm(x), rope, mask, cache)
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
        self.layers = [DecoderLayer(config) for _ in range(config.num_hidden_layers)]
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary = TextRotary(config.head_dim, config.rope_theta, config.mrope_section)

    def __call__(self, inputs_embeds, position_ids, mask=None, cache=None, deepstack_embeds=None):
        """inputs_embeds (B, L, D); position_ids (3, B, L), or (B,) for a text-only chunk (see
        TextRotary.cos_sin); mask None / "causal" / boolean (B, 1, L, S); deepstack_embeds: list of
        (B, L, D) arrays, zero except at visual positions.

        DeepStack: the k-th tapped vision feature is added right after decoder layer k, i.e. to
        layers 0, 1, 2 for three taps — the LLM layer index, not the ViT block index it came from.
        Adding zeros elsewhere is exact, which keeps this correct across prefill chunks."""
        h = inputs_embeds
        cache = cache or [None] * len(self.layers)
        deepstack_embeds = deepstack_embeds or []
        rope = self.rotary.cos_sin(position_ids, h.shape[1], h.dtype)
        if cache[0] is not None and cpu_kernels.decode_layer_applies(self.layers[0], h, mask, cache[0]):
            cpu_kernels.settle_caches(cache)  # the previous token's queued cache writes, in one sync
            if cpu_kernels.decode_tokens_apply(h, cache):
                return cpu_kernels.decode_tokens(self.layers, h, rope, cache, deepstack_embeds, self.norm)
        for i, (layer, c) in enumerate(zip(self.layers, cache)):
            h = layer(h, rope, mask, c)
            if i < len(deepstack_embeds):
                h = h + deepstack_embeds[i].astype(h.dtype)
        return self.norm(h)
