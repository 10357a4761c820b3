"""Fast paths for MLX's CPU backend, where some of its kernels are far slower than numpy's.

MLX's CPU backend has no fused attention, evaluates exp/tanh/sigmoid with scalar code, and sends
every float32 matmul to `cblas_sgemm` — even a matrix-vector product, which MKL then runs at about
20 GB/s on this machine. numpy vectorizes the transcendentals and calls its own bundled OpenBLAS,
whose GEMV reads weights at 30-35 GB/s and whose GEMM reaches ~160 GFLOP/s (MKL through MLX: ~105).
So on the CPU backend, float32 linears with large weights, attentions and activations evaluate
their inputs and compute in numpy, with the same float32 formulas (only the summation order
differs), and a decode step's decoder stack runs wholly outside MLX. Small ones stay lazy in MLX,
and on a GPU nothing here runs.
This is the one place where a forward pass leaves the MLX graph; MLX_QWEN3VL_CPU_KERNELS=mlx
(or the older MLX_QWEN3VL_CPU_ATTENTION=mlx) turns it off. The work between a decode step's GEMVs
runs in a small C extension (_decode.c, built at install when a C compiler is at hand), or in numpy
without it or with MLX_QWEN3VL_CPU_KERNELS=numpy.
"""

import math
import os

import mlx.nn as nn

NATIVE_INTERFACE = 1  # _decode.c's INTERFACE: the calls decode_tokens makes into it

try:
    from . import _decode as _native
except ImportError:  # built without a C compiler: the numpy versions below run instead
    _native = None
if getattr(_native, "INTERFACE", None) != NATIVE_INTERFACE:  # built from an older _decode.c
    _native = None

# MLX's CPU backend has no fused attention: mx.fast.scaled_dot_product_attention materializes
# the (heads, L, S) scores and runs softmax with a scalar exp (about 45 M values/s on this 2-core
# EPYC, against 530 M/s for numpy's vectorized exp). For a 1920x1080 screenshot (8160 patches,
# 16 heads, 24 blocks) that softmax alone is ~570 s. Attentions therefore run in numpy on the CPU,
# in query chunks (bounded memory): the same float32 math (q * scale) @ k^T, max-shifted exp, sum,
# @ v, exact to float32 rounding. A decode query reads the KV cache in place (a strided view, no
# copy): 28 layers at a 2117-token context take 50 ms this way against 104 ms in MLX's SDPA.
# Only tiny ones (a decode step over a short cache) stay lazy in MLX.
NUMPY_ATTENTION_MIN_SCORES = 1 << 12  # heads * L * S below which MLX's own attention is cheaper
CHUNK_SCORES = 1 << 25  # score elements per query chunk (128 MB in float32)


def cpu_kernels_enabled() -> bool:
    import mlx.core as mx

    for var in ("MLX_QWEN3VL_CPU_KERNELS", "MLX_QWEN3VL_CPU_ATTENTION"):
        if os.environ.get(var, "").strip().lower() == "mlx":
            return False
    return mx.default_device().type == mx.DeviceType.cpu


# Float32 linears whose weight has at least this many elements (the 2B decoder's smallest, k_proj,
# has 2M) run in numpy: x is evaluated (one host sync, ~0.1 ms) and numpy's BLAS reads the weight
# in place (np.asarray of an evaluated MLX array is zero-copy). Decode of the 2B preset: every
# GEMV 361 ms through MLX + MKL, 200 ms through numpy. Smaller weights stay lazy in MLX.
NUMPY_LINEAR_MIN_WEIGHT = 1 << 20


def _matmul_t(a, w, out=None):
    """a @ w.T for a (M, K) in numpy, into `out` (M, N) when given. OpenBLAS's GEMM streams the
    weight far slower for a few rows than its GEMV does (2048 -> 65536, float32: 1 row 18 ms, 2 rows
    92 ms as one GEMM), so up to 4 rows (batched decode) are separate GEMVs."""
    import numpy as np

    if a.shape[0] > 4:
        if out is None:
            return np.matmul(a, w.T)
        out[...] = np.matmul(a, w.T)
        return out
    if out is None:
        out = np.empty((a.shape[0], w.shape[0]), np.result_type(a, w))
    for i in range(a.shape[0]):
        np.matmul(a[i], w.T, out=out[i])
    return out


def linear(x, weight, bias=None):
    """x @ weight.T (+ bias), nn.Linear's math, for x (..., K) and weight (N, K)."""
    import mlx.core as mx

    if (weight.size < NUMPY_LINEAR_MIN_WEIGHT or weight.dtype != mx.float32 or x.dtype != mx.float32
            or not cpu_kernels_enabled()):
        return x @ weight.T if bias is None else mx.addmm(bias, x, weight.T)
    import numpy as np

    mx.eval(x)
    y = _matmul_t(np.asarray(x).reshape(-1, x.shape[-1]), np.asarray(weight))
    if bias is not None:
        y += np.asarray(bias)
    return mx.array(y.reshape(*x.shape[:-1], weight.shape[0]))


class Linear(nn.Linear):
    """nn.Linear computed through `linear`; nn.quantize still turns it into a QuantizedLinear."""

    def __call__(self, x):
        return linear(x, self.weight, self.get("bias"))


def attention(q, k, v, scale: float, causal: bool = False):
    """softmax(q k^T * scale [+ causal mask]) v for q (B, H, L, D), k / v (B, Hkv, S, D) with H a
    multiple of Hkv (grouped queries). Causal is lower-right aligned (query i sees keys up to
    S - L + i), as with a KV cache. Returns (B, H, L, D) in q's dtype."""
    import mlx.core as mx

    H, L, S = q.shape[1], q.shape[2], k.shape[2]
    if H * L * S < NUMPY_ATTENTION_MIN_SCORES or not cpu_kernels_enabled():
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal" if causal else None)
    import numpy as np

    dtype = q.dtype
    if dtype != mx.float32:
        q, k, v = (a.astype(mx.float32) for a in (q, k, v))
    mx.eval(q, k, v)
    result = mx.array(_np_attention(np.asarray(q), np.asarray(k), np.asarray(v), scale, causal))
    return result if dtype == mx.float32 else result.astype(dtype)


def _np_attention(q, k, v, scale, causal):
    """`attention` in numpy: q (B, H, L, D), k / v (B, Hkv, S, D) float32 arrays (k and v may be
    views of the KV cache) → (B, H, L, D)."""
    import numpy as np

    B, H, L, D = q.shape
    S, Hkv = k.shape[2], k.shape[1]
    rep = H // Hkv
    qn = q.reshape(B, Hkv, rep, L, D)
    kt = k.swapaxes(-1, -2)[:, :, None]  # (B, Hkv, 1, D, S); a view of the KV cache
    vn = v[:, :, None]  # (B, Hkv, 1, S, D)
    if L >= 16:  # many queries: contiguous copies pay for themselves in the GEMMs
        kt, vn = np.ascontiguousarray(kt), np.ascontiguousarray(vn)
    out = np.empty((B, Hkv, rep, L, v.shape[-1]), np.float32)
    rows = max(16, CHUNK_SCORES // max(1, B * H * S))
    offset = S - L
    for s in range(0, L, rows):
        e = min(L, s + rows)
        keys = min(S, offset + e) if causal else S  # keys past the chunk's last query are masked anyway
        scores = np.matmul(qn[:, :, :, s:e] * np.float32(scale), kt[..., :keys])
        if causal and offset + s + 1 < keys:
            i = np.arange(s, e)[:, None] + offset
            j = np.arange(keys)[None, :]
            scores[..., j > i] = -np.inf
        np.subtract(scores, scores.max(-1, keepdims=True), out=scores)
        np.exp(scores, out=scores)
        total = scores.sum(-1, keepdims=True)
        np.divide(np.matmul(scores, vn[:, :, :, :keys]), total, out=out[:, :, :, s:e])
    return out.reshape(B, H, L, -1)


# Activations on the CPU backend, for the same reason: MLX's CPU tanh / sigmoid run ~37 M values/s
# (gelu_approx of one 1280x720 screenshot's MLP, 15 M values, takes 0.7 s per block), numpy's
# vectorized ones ~300-500 M/s. Same formulas as mlx.nn. Down to a decode token's SwiGLU (6144
# values: 0.19 ms in MLX), whose inputs come evaluated from the numpy linears anyway.
NUMPY_ACTIVATION_MIN_SIZE = 1 << 12


def _numpy_ok(x) -> bool:
    import mlx.core as mx

    return x.size >= NUMPY_ACTIVATION_MIN_SIZE and x.dtype == mx.float32 and cpu_kernels_enabled()


def gelu_approx(x):
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), as mlx.nn.gelu_approx (gelu_pytorch_tanh)."""
    import mlx.core as mx
    import mlx.nn as nn

    if not _numpy_ok(x):
        return nn.gelu_approx(x)
    import numpy as np

    mx.eval(x)
    xn = np.asarray(x)
    t = xn * xn
    t *= np.float32(0.044715)
    t *= xn
    t += xn
    t *= np.float32(math.sqrt(2 / math.pi))
    np.tanh(t, out=t)
    t += np.float32(1)
    t *= xn
    t *= np.float32(0.5)
    return mx.array(t)


def silu_mul(gate, up):
    """silu(gate) * up = gate * sigmoid(gate) * up, the SwiGLU of the decoder's MLP."""
    import mlx.core as mx
    import mlx.nn as nn

    if not _numpy_ok(gate):
        return nn.silu(gate) * up
    import numpy as np

    mx.eval(gate, up)
    return mx.array(_np_silu_mul(np.asarray(gate), np.asarray(up)))


def log_softmax(logits):
    """logits - logsumexp(logits) over the last axis. The sampler's normalization of a decode
    step's 151936 logits costs ~3 ms through MLX's scalar exp on the CPU; numpy's is ~10x faster."""
    import mlx.core as mx

    if not _numpy_ok(logits):
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    import numpy as np

    mx.eval(logits)
    a = np.asarray(logits)
    t = a - a.max(-1, keepdims=True)
    t -= np.log(np.exp(t).sum(-1, keepdims=True))
    return mx.array(t)


def _np_silu_mul(g, up):
    import numpy as np

    t = np.negative(g)
    np.exp(t, out=t)
    t += np.float32(1)
    np.divide(g, t, out=t)
    t *= up
    return t


# A decode step through MLX on the CPU pays its per-op dispatch and one host sync (~0.1 ms) at
# every numpy linear: ~4 syncs and ~20 small ops per layer, ~50 ms of a 2B step whose weight reads
# take ~220 ms. For a few unpadded query tokens the whole decoder layer therefore runs here in
# numpy (the same float32 math as language.DecoderLayer), MLX touching only the KV cache update.
DECODE_LAYER_MAX_TOKENS = 16


def decode_layer_applies(layer, x, mask, cache) -> bool:
    import mlx.core as mx

    weight = layer.mlp.down_proj.weight
    return ((mask is None or isinstance(mask, str)) and cache is not None and x.shape[1] <= DECODE_LAYER_MAX_TOKENS
            and x.dtype == mx.float32 and weight.dtype == mx.float32 and weight.size >= NUMPY_LINEAR_MIN_WEIGHT
            and cpu_kernels_enabled())


def _np_linear(a, module):
    import numpy as np

    y = _matmul_t(a.reshape(-1, a.shape[-1]), np.asarray(module["weight"])).reshape(*a.shape[:-1], -1)
    if "bias" in module:
        y += np.asarray(module["bias"])
    return y


def _np_rms_scale(a, eps):
    """1 / sqrt(mean(a^2) + eps) over the last axis, keepdims."""
    import numpy as np

    ss = np.square(a).sum(-1, keepdims=True)
    ss /= np.float32(a.shape[-1])
    ss += np.float32(eps)
    np.sqrt(ss, out=ss)
    return np.divide(np.float32(1), ss, out=ss)


def _np_rms_norm(a, module):
    import numpy as np

    out = a * _np_rms_scale(a, module.eps)
    out *= np.asarray(module["weight"])
    return out


def _np_rotate(a, cos, sin):
    import numpy as np

    half = a.shape[-1] // 2
    return a * cos + np.concatenate([-a[..., half:], a[..., :half]], axis=-1) * sin


def decode_layer(layer, x, rope, cache):
    """language.DecoderLayer.__call__ for x (B, L, D) without padding (causal within the chunk), in
    numpy. One token per sequence with a filled cache goes through `decode_tokens` instead."""
    import mlx.core as mx
    import numpy as np

    attn, mlp = layer.self_attn, layer.mlp
    cos, sin = rope
    mx.eval(x, cos, sin)
    h = np.asarray(x)
    B, L, _ = h.shape
    cos, sin = np.asarray(cos), np.asarray(sin)
    n = _np_rms_norm(h, layer.input_layernorm)
    heads = lambda a, count: a.reshape(B, L, count, -1)
    q = _np_rms_norm(heads(_np_linear(n, attn.q_proj), attn.n_heads), attn.q_norm).transpose(0, 2, 1, 3)
    k = _np_rms_norm(heads(_np_linear(n, attn.k_proj), attn.n_kv_heads), attn.k_norm).transpose(0, 2, 1, 3)
    v = heads(_np_linear(n, attn.v_proj), attn.n_kv_heads).transpose(0, 2, 1, 3)
    q, k = _np_rotate(q, cos, sin), _np_rotate(k, cos, sin)
    keys, values = cache.update_and_fetch(mx.array(k), mx.array(v))
    mx.eval(keys, values)
    out = _np_attention(q, np.asarray(keys), np.asarray(values), attn.scale, causal=L > 1)
    h = h + _np_linear(out.transpose(0, 2, 1, 3).reshape(B, L, -1), attn.o_proj)
    n = _np_rms_norm(h, layer.post_attention_layernorm)
    t = _np_silu_mul(_np_linear(n, mlp.gate_proj), _np_linear(n, mlp.up_proj))
    return mx.array(h + _np_linear(t, mlp.down_proj))


# One decode token per sequence is the step that decides decode speed, and on the 2B model its
# ~200 GEMVs leave room for little else. Between them a layer through the general path above made
# ~100 numpy/MLX calls, each paying dispatch and a cache that the last GEMV had just flushed
# (16-20% of the step). So a token runs the whole decoder stack here, on one numpy hidden state:
# per layer the GEMVs write into reused buffers, and the rest is four calls (norm with the
# residual add, q/k norm with rotary, attention, SwiGLU) into the C extension, or into their
# numpy versions below. Modules are read as dict items (nn.Module.__getattr__ costs ~1.7 us per
# level), and nothing syncs on the KV cache: the attention reads the cache's earlier positions in
# place and scores the new key separately, so the step's new keys and values are only queued at
# its end (one conversion to MLX, then lazy slice updates, done in place since nothing else holds
# the buffers) and `settle_caches` evaluates all layers' updates at once before the next step
# reads them. Measured inside a 2B step at 273 / 2117 tokens: norms, rotary and SwiGLU 11 ms in
# numpy, 1.7 in C; attention 15 / 74 ms in numpy, 4.5 / 31 in C; cache writes 3.1 ms queued layer
# by layer, 0.6 at the end.
def _holds_keys(cache) -> bool:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    return type(cache) is KVCache and cache.keys is not None and cache.keys.dtype == mx.float32


def decode_tokens_apply(x, caches) -> bool:
    """Whether `decode_tokens` serves this input (given decode_layer_applies)."""
    return x.shape[1] == 1 and all(_holds_keys(c) for c in caches)


def settle_caches(cache):
    """Evaluate the KV-cache updates `decode_tokens` queued, all layers in one host sync."""
    import mlx.core as mx

    mx.eval([(c.keys, c.values) for c in cache if _holds_keys(c)])


def _ops():
    if _native is not None and os.environ.get("MLX_QWEN3VL_CPU_KERNELS", "").strip().lower() != "numpy":
        return _native
    return NumpyOps


def decode_tokens(layers, x, rope, caches, deepstack_embeds, norm):
    """TextModel.__call__ for one token per sequence, x (B, 1, D), every cache a filled float32
    KVCache, no padding: the decoder layers, DeepStack additions and the final norm → (B, 1, D)."""
    import mlx.core as mx
    import numpy as np

    ops = _ops()
    cos, sin = rope
    mx.eval(x, cos, sin, deepstack_embeds)
    B, _, D = x.shape
    first = layers[0]["self_attn"]
    nq, nkv, hd = first.n_heads, first.n_kv_heads, first.head_dim
    cos, sin = (np.ascontiguousarray(np.asarray(a, np.float32).reshape(B, hd)) for a in (cos, sin))
    h = np.array(x, np.float32).reshape(B, D)
    n = np.empty_like(h)
    qkv = np.empty((B, nq + 2 * nkv, hd), np.float32)
    flat = qkv.reshape(B, -1)
    att = np.empty((B, nq * hd), np.float32)
    delta = np.empty_like(h)
    hidden = layers[0]["mlp"]["gate_proj"]["weight"].shape[0]
    gate, up = np.empty((B, hidden), np.float32), np.empty((B, hidden), np.float32)
    new_kv = np.empty((len(layers), 2, B, nkv, hd), np.float32)  # each layer's new key and value
    pending = None  # the last layer's output, added to h by the next norm
    for i, (layer, cache) in enumerate(zip(layers, caches)):
        attn, mlp = layer["self_attn"], layer["mlp"]
        _rms_norm_into(ops, h, pending, layer["input_layernorm"], n)
        _linear_into(n, attn["q_proj"], flat[:, :nq * hd])
        _linear_into(n, attn["k_proj"], flat[:, nq * hd:(nq + nkv) * hd])
        _linear_into(n, attn["v_proj"], flat[:, (nq + nkv) * hd:])
        ops.qk_norm_rope(qkv, nq, nkv, np.asarray(attn["q_norm"]["weight"]), np.asarray(attn["k_norm"]["weight"]),
                         attn["q_norm"].eps, cos, sin)  # q_norm and k_norm: one eps
        keys, values = (np.ascontiguousarray(np.asarray(a)) for a in (cache.keys, cache.values))
        ops.attend(qkv, nq, nkv, hd, keys, values, cache.offset, attn.scale, att)
        new_kv[i] = qkv[:, nq:].reshape(B, 2, nkv, hd).swapaxes(0, 1)
        _linear_into(att, attn["o_proj"], delta)
        _rms_norm_into(ops, h, delta, layer["post_attention_layernorm"], n)
        _linear_into(n, mlp["gate_proj"], gate)
        _linear_into(n, mlp["up_proj"], up)
        ops.silu_mul(gate, up, gate)
        _linear_into(gate, mlp["down_proj"], delta)
        pending = delta
        if i < len(deepstack_embeds):
            h += delta
            h += np.asarray(deepstack_embeds[i], np.float32).reshape(B, D)
            pending = None
    _rms_norm_into(ops, h, pending, norm, n)
    _queue_cache_writes(caches, new_kv)
    return mx.array(n.reshape(B, 1, D))


def _rms_norm_into(ops, h, delta, module, out):
    import numpy as np

    ops.rms_norm(h, delta, np.asarray(module["weight"]), module.eps, out)


def _linear_into(a, module, out):
    """out = a @ weight.T (+ bias) for a (B, K)."""
    import numpy as np

    _matmul_t(a, np.asarray(module["weight"]), out)
    if "bias" in module:
        out += np.asarray(module["bias"])
    return out


class NumpyOps:
    """The C extension's four calls in numpy, same arguments and results (see _decode.c)."""

    @staticmethod
    def rms_norm(x, delta, weight, eps, out):
        import numpy as np

        if delta is not None:
            x += delta
        np.multiply(x, _np_rms_scale(x, eps), out=out)
        out *= weight

    @staticmethod
    def qk_norm_rope(qkv, nq, nkv, q_weight, k_weight, eps, cos, sin):
        B, _, hd = qkv.shape
        qk = qkv[:, :nq + nkv]
        qk *= _np_rms_scale(qk, eps)
        qk[:, :nq] *= q_weight
        qk[:, nq:] *= k_weight
        qk[...] = _np_rotate(qk, cos.reshape(B, 1, hd), sin.reshape(B, 1, hd))

    @staticmethod
    def attend(qkv, nq, nkv, hd, keys, values, S, scale, out):
        out[...] = _attend_cached(qkv[:, :nq], qkv[:, nq:nq + nkv], qkv[:, nq + nkv:], keys, values, S, scale)

    @staticmethod
    def silu_mul(gate, up, out):
        out[...] = _np_silu_mul(gate, up)


def _queue_cache_writes(caches, new_kv):
    """cache.update_and_fetch of each layer's new key and value, new_kv (layers, 2, B, Hkv, hd),
    without the fetch, left lazy: one conversion to MLX for all layers, then while a buffer has
    room one slice update per array (KVCache's own indexing costs ~40 us per layer in Python).
    Growing a buffer is left to KVCache."""
    import mlx.core as mx

    kv = mx.array(new_kv)[..., None, :]  # (layers, 2, B, Hkv, 1, hd)
    starts = {}
    for i, cache in enumerate(caches):
        k, v = kv[i, 0], kv[i, 1]
        if cache.offset >= cache.keys.shape[2]:
            cache.update_and_fetch(k, v)
            continue
        start = starts.get(cache.offset)
        if start is None:
            start = starts[cache.offset] = mx.array([cache.offset])
        cache.keys = mx.slice_update(cache.keys, k, start, (2,))
        cache.values = mx.slice_update(cache.values, v, start, (2,))
        cache.offset += 1


def _attend_cached(q, k, v, keys, values, S, scale):
    """Attention of one query token per sequence, q (B, H, hd), over the S earlier positions of
    the cache's buffers keys / values (B, Hkv, capacity, hd) and the new k, v (B, Hkv, hd) not yet
    in them → (B, H * hd). The same float32 math as _np_attention. Per (kv head, query head in its
    group) the scores are a GEMV over the cached keys, read in place: inside a 2B decode step 11 /
    68 ms at 273 / 2117 tokens, against 17 / 80 for GEMMs with the group's query heads as rows and
    20 / 105 for keys @ queries^T. The C extension's `attend` reads each key and value once for
    the whole group instead."""
    import numpy as np

    B, H, hd = q.shape
    nkv = k.shape[1]
    keys = keys[:, :, None, :S]  # (B, Hkv, 1, S, hd), views of the cache's buffer
    values = values[:, :, None, :S]
    qs = (q * np.float32(scale)).reshape(B, nkv, H // nkv, 1, hd)
    scores = np.empty((B, nkv, H // nkv, 1, S + 1), np.float32)  # the cached keys', then the new key's
    np.matmul(qs, keys.swapaxes(-1, -2), out=scores[..., :S])
    np.matmul(qs, k.reshape(B, nkv, 1, hd, 1), out=scores[..., S:])
    scores -= scores.max(-1, keepdims=True)
    np.exp(scores, out=scores)
    total = scores.sum(-1, keepdims=True)
    out = np.matmul(scores[..., :S], values)
    out += scores[..., S:] * v.reshape(B, nkv, 1, 1, hd)
    out /= total
    return out.reshape(B, H * hd)


class CPUBackend:
    """The Linux CPU path as the token loop sees it (see backend.py): eager, numpy log-softmax."""

    name = "cpu"
    eager = True
    log_softmax = staticmethod(log_softmax)

    def describe(self) -> str:
        from . import _blas

        return f"cpu (numpy/C fast path, {'C extension' if _native else 'numpy ops'}; BLAS: {_blas.describe()})"


CPU_BACKEND = CPUBackend()
