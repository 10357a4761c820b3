"""The CPU path's versions of the model's modules, and `install`, which puts them in place.

Each class here subclasses a module of the plain MLX model and changes only how it computes
(numpy and C instead of MLX ops), never its parameters, so `install` swaps classes on the loaded
modules in place, as nn.quantize swaps modules by a class predicate. The decoder layer of this
path is decode.decode_tokens (one token through the whole stack); longer inputs (prefill) run the
MLX layers with these linears, attentions and activations inside.
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .. import language, moe, vision
from .. import activations, blas
from . import decode, experts, kernels, threads


class Linear(nn.Linear):
    def __call__(self, x):
        return kernels.linear(x, self.weight, self.get("bias"))


class Embedding(nn.Embedding):
    def as_linear(self, x):  # the tied LM head: the largest GEMV of a decode step
        return kernels.linear(x, self.weight)


class Attention(language.Attention):
    def attend(self, q, k, v, mask):
        return kernels.attention(q, k, v, self.scale, mask)

    def attend_quantized(self, q, k, v, mask, bits, group_size):
        """A prefill chunk over a quantized cache: MLX's quantized matmuls on the CPU device are far
        slower than BLAS for many queries (benchmarks/README.md, "Quantized KV cache and the disk tier"), so this
        layer's keys and values are unpacked for the chunk and dropped after it, one layer at a
        time, never the whole cache. One query of a decode step reads the packed cache as it is;
        a prefill chunk of one token (mask "causal") is a chunk like any other, so its numbers are
        the ones a longer chunk gives that position."""
        if q.shape[2] == 1 and not isinstance(mask, str):
            return super().attend_quantized(q, k, v, mask, bits, group_size)
        k, v = (mx.dequantize(*t, group_size=group_size, bits=bits).astype(q.dtype) for t in (k, v))
        return self.attend(q, k, v, mask)


class MLP(activations.MLP):  # the plain graph's module on the CPU device (a language.MLP)
    def __call__(self, x):
        return self.down_proj(kernels.silu_mul(self.gate_proj(x), self.up_proj(x)))


class SparseMoeBlock(moe.SparseMoeBlock):
    def __call__(self, x):
        if "scales" in self.switch_mlp.gate_proj or x.dtype != mx.float32:  # quantized: MLX's gather_qmm
            return super().__call__(x)
        mx.eval(x)
        flat = np.asarray(x).reshape(-1, x.shape[-1])
        return mx.array(experts.experts_into(flat, self, np.empty_like(flat)).reshape(x.shape))


class VisionAttention(vision.VisionAttention):
    def attend(self, q, k, v):
        return kernels.attention(q, k, v, self.head_dim**-0.5)


class VisionMLP(activations.VisionMLP):
    def __call__(self, x):
        if vision.ACTIVATIONS[self.hidden_act] is not vision.gelu_tanh:  # a config's exact GELU: MLX's
            return super().__call__(x)
        return self.linear_fc2(kernels.gelu_approx(self.linear_fc1(x)))


class TextModel(language.TextModel):
    """One token per sequence goes through decode.decode_tokens; anything else through the layers."""

    ops = None  # the C extension or decode.NumpyOps, set by `install`

    def __call__(self, inputs_embeds, position_ids, mask=None, cache=None, deepstack_embeds=None, last=None):
        if decode.applies(inputs_embeds, mask, cache):
            return decode.decode_tokens(self, inputs_embeds, position_ids, cache, deepstack_embeds or [], self.ops)
        return super().__call__(inputs_embeds, position_ids, mask, cache, deepstack_embeds, last)


TWINS = {
    language.Attention: Attention,
    language.MLP: MLP,
    activations.MLP: MLP,  # the plain graph's CPU activations, as weights.empty_model installs them
    activations.VisionMLP: VisionMLP,
    moe.SparseMoeBlock: SparseMoeBlock,
    vision.VisionAttention: VisionAttention,
    vision.VisionMLP: VisionMLP,
}


class CPUBackend:
    """The CPU path as the token loop sees it (see backend.py): eager, numpy log-softmax, the
    KV cache its decode stack reads and writes."""

    name = "cpu"
    eager = True
    log_softmax = staticmethod(kernels.log_softmax)

    def __init__(self, ops):
        self.ops = ops

    @staticmethod
    def make_cache(model):
        return [decode.KVCache() for _ in model.language_model.layers]

    def describe(self) -> str:
        ops = "C extension" if self.ops is decode.native else "numpy (no C extension)"
        return (f"cpu path (numpy + {ops}; numpy's BLAS: {blas.numpy_blas()}); BLAS for MLX: {blas.describe()}; "
                f"{threads.describe()}")


def choose_ops(ops=None):
    """ops None: the C extension where it is built, else numpy; "c" (an error where it is not
    built) or "numpy"."""
    if ops == "numpy" or (ops is None and decode.native is None):
        return decode.NumpyOps
    if decode.native is None:
        from ..errors import ConfigError

        raise ConfigError("the C extension of the CPU path (mlx_qwen3vl/cpu/_decode.c) is not built: "
                          "reinstall with a C compiler at hand, or set MLX_QWEN3VL_CPU_KERNELS=numpy")
    return decode.native


def install(model, ops=None):
    """Swap a float32 model's modules for their CPU versions, in place, once; returns the model.
    Linears (and the tied embedding's LM head) only from kernels.LINEAR_MIN_WEIGHT elements."""
    ops = choose_ops(ops)
    threads.policy()  # a bad MLX_QWEN3VL_BLAS_THREADS is an error at load, not mid-generation
    big = lambda m: m.weight.size >= kernels.LINEAR_MIN_WEIGHT and m.weight.dtype == mx.float32
    for _, module in model.named_modules():
        kind = type(module)
        if kind in TWINS:
            module.__class__ = TWINS[kind]
        elif kind is nn.Linear and big(module):
            module.__class__ = Linear
        elif kind is nn.Embedding and big(module):
            module.__class__ = Embedding
    text = model.language_model
    # The decode stack runs dense and float32 expert layers; anything else keeps the MLX loop.
    if type(text) is language.TextModel and all(decode.runs(layer.mlp) for layer in text.layers):
        text.__class__ = TextModel
        text.ops = ops
    model.backend = CPUBackend(ops)
    return model
