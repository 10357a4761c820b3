"""Which backend runs a model's forward: the seam between the model and the token loop.

A backend is installed on the model once, at load (`install`), as `model.backend`. The token loop
(generate/) asks it for the two things it does differently per backend: whether the forward is
eager (it evaluates as it goes, so the next token is computed after this one is handed out) and
the log-softmax of the sampler; `model.make_cache()` asks it for the KV caches its forward reads.

Two backends exist: the plain MLX graph (every device, dtype and quantization) and the Linux CPU
path (mlx_qwen3vl/cpu/), which `install` puts in place of some of the model's modules when the
model computes in float32 on the CPU. MLX_QWEN3VL_CPU_KERNELS chooses: auto (the default), c or
numpy (the CPU path, its per-layer decode work in the C extension or in numpy), mlx (the plain
graph everywhere).
"""

import os

import mlx.core as mx
import mlx.nn as nn

from . import language
from .errors import ConfigError

ENV = "MLX_QWEN3VL_CPU_KERNELS"
ENV_CHOICES = ("auto", "c", "numpy", "mlx")


class MLXBackend:
    """The plain MLX graph: lazy, so the next decode step is queued before a token is handed out."""

    name = "mlx"
    eager = False

    @staticmethod
    def log_softmax(logits):
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    @staticmethod
    def make_cache(model):
        from .kv_cache import KVCache  # imports mlx-lm (and transformers): seconds, so on first use

        return [KVCache() for _ in model.language_model.layers]

    def describe(self) -> str:
        if mx.default_device().type != mx.DeviceType.cpu:
            return f"mlx graph on {mx.default_device()}"
        from . import blas  # on the CPU, MLX's matmuls run on the BLAS blas.py loaded (or not)

        return f"mlx graph on {mx.default_device()}; BLAS for MLX: {blas.describe()}"


MLX = MLXBackend()


def backend_of(model):
    return getattr(model, "backend", MLX)


def env_choice() -> str:
    """MLX_QWEN3VL_CPU_KERNELS, checked: an unknown value is an error, never ignored."""
    value = os.environ.get(ENV, "").strip().lower() or "auto"
    if value not in ENV_CHOICES:
        raise ConfigError(f"{ENV}={os.environ[ENV]!r} is not one of {', '.join(ENV_CHOICES)}: unset it (auto) "
                          "or pick one of those")
    return value


def cpu_path_fits(model) -> str:
    """Why the CPU path cannot run this model ('' when it can): it computes in float32 and
    unquantized, and it is only faster on the CPU device."""
    if mx.default_device().type != mx.DeviceType.cpu:
        return f"the default device is {mx.default_device()}"
    if any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules()):
        return "the model is quantized"
    dtype = model.language_model.embed_tokens.weight.dtype
    if dtype != mx.float32:
        return f"the model computes in {dtype}, not float32"
    return ""


def plain_graph_on_cpu(model):
    """A model just built (weights.empty_model, before any backend): on MLX's CPU device, its
    activations in the exp-based forms that device computes fastest (activations.py; the CPU path,
    if installed later, replaces them with its own); elsewhere unchanged. Returns the model."""
    if mx.default_device().type == mx.DeviceType.cpu:
        from . import activations

        activations.install(model)
    return model


def _stack(modules):
    """One weight of unbiased float linears' rows, stacked, with each linear's weight rebound to a
    view of it (so the memory is not doubled); None where any is quantized, biased or sharded."""
    if any(type(m) is not nn.Linear or "bias" in m for m in modules):
        return None
    stacked = mx.concatenate([m.weight for m in modules])
    mx.eval(stacked)
    start = 0
    for m in modules:
        n = m.weight.shape[0]
        m.weight = stacked[start:start + n]
        start += n
    mx.eval([m.weight for m in modules])
    return stacked


def fuse(model):
    """Stack each decoder layer's q/k/v and gate/up weights into one matmul each (the plain graph,
    at load). The checkpoint's names and parameters stay as they are (views of the stacked
    weight); the stacked ones are private (`_qkv`, `_gate_up`), outside parameters()."""
    for layer in model.language_model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = _stack([attn.q_proj, attn.k_proj, attn.v_proj])
        if qkv is not None:
            nq, nk = attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0]
            attn._qkv, attn._qkv_split = qkv, [nq, nq + nk]
        if isinstance(mlp, language.MLP):
            gate_up = _stack([mlp.gate_proj, mlp.up_proj])
            if gate_up is not None:
                mlp._gate_up = gate_up
    return model


def plain_graph(model):
    """The plain graph's load-time work: stacked projections (fuse), and on the CPU device the
    decode matmuls split over its cores (activations.split_matmuls)."""
    fuse(model)
    if mx.default_device().type == mx.DeviceType.cpu:
        from . import activations

        activations.split_matmuls(model)
    return model


def install(model, backend=None):
    """Put a backend in place on a loaded model, once; returns the model.

    backend "mlx": the plain graph, its decoder's q/k/v and gate/up stacked into one matmul each
    (fuse; quantized or biased projections stay apart). "cpu": the CPU path (an error where it cannot run, see
    cpu_path_fits). None: the CPU path where it fits, unless MLX_QWEN3VL_CPU_KERNELS=mlx.
    The C extension or numpy for the CPU path's decode work follows MLX_QWEN3VL_CPU_KERNELS."""
    if backend not in (None, "mlx", "cpu"):
        raise ConfigError(f"backend {backend!r} is not one of 'mlx', 'cpu' or None (automatic)")
    choice = env_choice()
    if backend == "mlx" or (backend is None and choice == "mlx"):
        return plain_graph(model)
    why_not = cpu_path_fits(model)
    if why_not:
        if backend == "cpu":
            raise ConfigError(f"the CPU path cannot run this model: {why_not}; load it in float32 on the CPU "
                              "or use backend='mlx'")
        return plain_graph(model)
    from . import cpu  # the CPU path (numpy + C) is imported only for a model that runs on it

    return cpu.install(model, ops=None if choice in ("auto", "mlx") else choice)
