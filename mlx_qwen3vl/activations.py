"""SwiGLU and the tanh GELU as MLX's CPU device computes them fastest, put in place of the model's
standard ones when its plain MLX graph runs on the CPU (backend.plain_graph_on_cpu); with them the
decoder's text rotary by its tables (TextRotary below).

MLX's CPU backend evaluates exp with vectorized code but sigmoid and tanh with scalar code, so
both are written through exp, each one compiled kernel in float32 inside (benchmarks/README.md,
"plain graph: fused swiglu and gelu_tanh"). The subclasses change how the modules compute, never
their parameters (as cpu/layers.py does for the CPU path, which has its own activations).
"""

import math
from functools import partial

import mlx.core as mx

from . import language, rope, vision


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


class MLP(language.MLP):
    def __call__(self, x):
        return self.down_proj(swiglu(*self.gate_up(x)))


class VisionMLP(vision.VisionMLP):
    def __call__(self, x):
        if vision.ACTIVATIONS[self.hidden_act] is not vision.gelu_tanh:  # a config's exact GELU
            return super().__call__(x)
        return self.linear_fc2(gelu_tanh(self.linear_fc1(x)))


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
