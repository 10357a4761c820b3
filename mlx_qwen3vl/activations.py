"""SwiGLU and the tanh GELU as MLX's CPU device computes them fastest, put in place of the model's
standard ones when its plain MLX graph runs on the CPU (backend.plain_graph_on_cpu); with them the
decoder's text rotary by its tables (TextRotary below), the vision blocks' GELU by blocks of rows
on two CPU streams (spread.by_rows), and, once the plain graph is chosen, the decode step's
matmuls over row blocks of their weights on two CPU streams (split_matmuls).

MLX's CPU backend evaluates exp with vectorized code but sigmoid and tanh with scalar code, so
both are written through exp, each one compiled kernel in float32 inside (benchmarks/README.md,
"plain graph: fused swiglu and gelu_tanh"). The subclasses change how the modules compute, never
their parameters (as cpu/layers.py does for the CPU path, which has its own activations).
"""

import math
from functools import partial

import mlx.core as mx
import mlx.nn as nn

from . import language, rope, spread, vision


@partial(mx.compile, shapeless=True)
def swiglu(gate, up):
    """silu(gate) * up with the sigmoid as 1 / (1 + exp(-gate)) in float32; rounding it to the
    input dtype keeps nn.silu's bf16 result."""
    sigmoid = 1 / (1 + mx.exp(-gate.astype(mx.float32)))
    return gate * sigmoid.astype(gate.dtype) * up


@partial(mx.compile, shapeless=True)
def gelu_tanh(x):
    """gelu_pytorch_tanh: 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), as the equal
    x / (1 + exp(-2u)), x^3 as products; within 5e-7 of torch's float32 result."""
    y = x.astype(mx.float32)
    return (y / (1 + mx.exp(-2 * math.sqrt(2 / math.pi) * (y + 0.044715 * y * y * y)))).astype(x.dtype)


# A decode step's matmul (a few rows of x) is one BLAS call on one core, bound by that core's
# memory bandwidth; its weight's row blocks on separate CPU streams (each its own thread) are read
# by every core. Each output element is the same dot product, so the result is bit for bit the
# same (benchmarks/README.md, "The plain MLX graph").
FEW_ROWS = 4  # beyond this many rows BLAS threads the product itself
# Narrower weights stay whole: a narrow product goes to other BLAS kernels (their sums in another
# order, so not bit for bit: a 4 x 17 product split 9 + 8) and gains nothing from a second core.
MIN_ROWS = 64


def row_blocks(w):
    """w's spread.PARTS row blocks, views of it (no copy); a tuple, which nn.Module neither counts
    among its parameters nor walks as children. None for a weight of fewer than MIN_ROWS rows."""
    if w.shape[0] < MIN_ROWS:
        return None
    blocks = tuple(w[a:b] for a, b, _ in spread.blocks(w.shape[0]))
    mx.eval(blocks)
    return blocks


def matmul(x, w, blocks=None):
    """x @ w.T; for a few rows of x, as one product per row block of w, each on its own CPU stream."""
    if blocks is None or x.size // x.shape[-1] > FEW_ROWS:
        return x @ w.T
    return mx.concatenate([mx.matmul(x, b.T, stream=s) for b, s in zip(blocks, spread.streams())], axis=-1)


class MLP(language.MLP):
    def __call__(self, x):
        return self.down_proj(swiglu(*self.gate_up(x)))

    def gate_up(self, x):
        blocks = self.get("_gate_up_blocks")
        if blocks is None:
            return super().gate_up(x)
        return mx.split(matmul(x, self._gate_up, blocks), 2, axis=-1)


class Attention(language.Attention):
    def project(self, x):
        blocks = self.get("_qkv_blocks")
        if blocks is None:
            return super().project(x)
        return mx.split(matmul(x, self._qkv, blocks), self._qkv_split, axis=-1)


class Linear(nn.Linear):
    def __call__(self, x):
        return matmul(x, self.weight, self._blocks)


class Embedding(nn.Embedding):
    def as_linear(self, x):
        return matmul(x, self.weight, self._blocks)


class VisionMLP(vision.VisionMLP):
    def __call__(self, x):
        if vision.ACTIVATIONS[self.hidden_act] is not vision.gelu_tanh:  # a config's exact GELU
            return super().__call__(x)
        return spread.by_rows(gelu_tanh, self.linear_fc1(x), then=self.linear_fc2)


class TextRotary(rope.TextRotary):
    """A float32 text-only chunk (a decode step) rotated by cos/sin tables built once per forward
    instead of by mx.fast.rope in every layer: on the CPU device that op is its fallback, more ops
    than the tables' product (benchmarks/README.md, "The plain MLX graph"); bit for bit the same."""

    def __call__(self, position_ids, length, dtype=mx.float32):
        if position_ids.ndim != 1 or dtype != mx.float32:
            return super().__call__(position_ids, length, dtype)
        cos, sin = self.cos_sin(position_ids, length, dtype)
        return lambda x: rope.apply_rotary(x, cos, sin)


TWINS = {language.MLP: MLP, vision.VisionMLP: VisionMLP}


def split_matmuls(model):
    """The plain graph's decoder and LM head (float, unquantized, unbiased: what backend.fuse stacks)
    with their decode matmuls split as `matmul` does, in place; returns the model."""
    def linear(m):
        if type(m) is nn.Linear and "bias" not in m:
            m.__class__, m._blocks = Linear, row_blocks(m.weight)

    text = model.language_model
    for layer in text.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if type(attn) is language.Attention and attn.get("_qkv") is not None:
            attn.__class__, attn._qkv_blocks = Attention, row_blocks(attn._qkv)
            linear(attn.o_proj)
        if type(mlp) is MLP and mlp.get("_gate_up") is not None:
            mlp._gate_up_blocks = row_blocks(mlp._gate_up)
            linear(mlp.down_proj)
    if model.config.tie_word_embeddings:
        if type(text.embed_tokens) is nn.Embedding:
            text.embed_tokens.__class__, text.embed_tokens._blocks = Embedding, row_blocks(text.embed_tokens.weight)
    else:
        linear(model.lm_head)
    return model


def install(model):
    """Swap the model's MLPs for their exp-based forms and its text rotary for TextRotary, in
    place; returns the model."""
    for _, module in model.named_modules():
        twin = TWINS.get(type(module))
        if twin is not None:
            module.__class__ = twin
        if type(getattr(module, "rotary", None)) is rope.TextRotary:
            module.rotary.__class__ = TextRotary
    return model
