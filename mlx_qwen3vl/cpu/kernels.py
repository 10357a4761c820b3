"""numpy versions of the float32 work MLX's CPU backend does slowly: large linears, attention,
the MLP activations and the sampler's log-softmax.

MLX's CPU backend has no fused attention, evaluates exp/tanh/sigmoid with scalar code, and sends
every float32 matmul, even a matrix-vector product, to `cblas_sgemm`. numpy vectorizes the
transcendentals and calls its own OpenBLAS, whose GEMV and GEMM beat that path (benchmarks/README.md,
"What bounds each figure"). Each function takes and returns MLX arrays: it evaluates its inputs (a
host sync), computes in numpy with the same float32 formulas as MLX (only the summation order
differs) and hands the result back to MLX. Below the size thresholds MLX's own op is cheaper than
the sync and runs instead.
"""

import contextlib
import importlib
import math
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np

from . import threads

try:  # the C extension's matmul_rows (an older build without it: numpy's GEMVs, as before)
    _native = importlib.import_module(f"{__package__}._decode")
    _native = _native if hasattr(_native, "matmul_rows") else None
except ImportError:
    _native = None
_pool = None  # threads for matmul_rows' column ranges, made on first use

# Thresholds (elements) below which MLX's op is cheaper than leaving the graph. A linear's is
# applied once, when `install` picks which modules to swap; the 2B decoder's smallest weight
# (k_proj) has 2M elements.
LINEAR_MIN_WEIGHT = 1 << 20
ATTENTION_MIN_SCORES = 1 << 12  # heads * queries * keys
ACTIVATION_MIN_SIZE = 1 << 12
SMALL_ROWS = 16  # rows up to which `linear` reads the weight once for all rows (C extension)
CHUNK_SCORES = 1 << 25  # score elements per query chunk of the attention (128 MB in float32)


def _rows_in_parallel(a, w, out, n_threads):
    """The C extension's matmul_rows over `n_threads` disjoint column ranges (it releases the GIL)."""
    N = w.shape[0]
    step = -(-N // n_threads)
    parts = [(s, min(N, s + step)) for s in range(0, N, step)]
    if len(parts) == 1:
        _native.matmul_rows(a, w, out, 0, N)
        return out
    global _pool
    if _pool is None or _pool._max_workers < len(parts) - 1:
        _pool = ThreadPoolExecutor(max_workers=len(parts) - 1, thread_name_prefix="mlx_qwen3vl-rows")
    futures = [_pool.submit(_native.matmul_rows, a, w, out, s, e) for s, e in parts[1:]]
    _native.matmul_rows(a, w, out, *parts[0])
    for f in futures:
        f.result()
    return out


def matmul_t(a, w, out=None):
    """a @ w.T for a (M, K) in numpy, into `out` (M, N) when given. OpenBLAS's GEMM streams the
    weight far slower for a few rows than its GEMV does, so up to 4 rows (batched decode) are
    separate GEMVs (each row's numbers then equal its own decode's). Every BLAS call of the CPU
    path comes through here, so the thread count is set here (threads.apply)."""
    threads.apply()
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
    """x @ weight.T (+ bias), nn.Linear's math, for x (..., K) and weight (N, K). numpy reads the
    evaluated weight in place (np.asarray of an MLX array is zero-copy)."""
    mx.eval(x)
    a, w = np.asarray(x).reshape(-1, x.shape[-1]), np.asarray(weight)
    if 1 < a.shape[0] <= SMALL_ROWS and _native is not None and a.dtype == w.dtype == np.float32 \
            and w.flags["C_CONTIGUOUS"]:
        # A few positions (speculative decoding's verify forward, a short prompt chunk): the
        # weight read once for all of them, as one GEMV reads it, not once per row.
        y = _rows_in_parallel(np.ascontiguousarray(a), w, np.empty((a.shape[0], w.shape[0]), np.float32),
                              threads.apply())
    else:
        y = matmul_t(a, w)
    if bias is not None:
        y += np.asarray(bias)
    return mx.array(y.reshape(*x.shape[:-1], weight.shape[0]))


def attention(q, k, v, scale: float, mask=None):
    """softmax(q k^T * scale, masked) v for q (B, H, L, D), k / v (B, Hkv, S, D) with H a multiple
    of Hkv (grouped queries), mask None, "causal" (lower-right aligned, as with a KV cache) or a
    boolean array (left to MLX). Returns (B, H, L, D)."""
    H, L, S = q.shape[1], q.shape[2], k.shape[2]
    if isinstance(mask, mx.array) or H * L * S < ATTENTION_MIN_SCORES:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    mx.eval(q, k, v)
    # a verify forward's few queries: small GEMMs, beside matmul_rows' threads
    with threads.one_blas_thread() if L <= SMALL_ROWS else contextlib.nullcontext():
        return mx.array(np_attention(np.asarray(q), np.asarray(k), np.asarray(v), scale, causal=mask == "causal"))


def np_attention(q, k, v, scale, causal):
    """`attention` in numpy: q (B, H, L, D), k / v (B, Hkv, S, D) float32 arrays (k and v may be
    views of the KV cache) → (B, H, L, D), in query chunks of bounded memory."""
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


def gelu_approx(x):
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), as mlx.nn.gelu_approx (gelu_pytorch_tanh)."""
    import mlx.nn as nn

    if x.size < ACTIVATION_MIN_SIZE:
        return nn.gelu_approx(x)
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
    import mlx.nn as nn

    if gate.size < ACTIVATION_MIN_SIZE:
        return nn.silu(gate) * up
    mx.eval(gate, up)
    return mx.array(np_silu_mul(np.asarray(gate), np.asarray(up)))


def np_silu_mul(g, up):
    t = np.negative(g)
    np.exp(t, out=t)
    t += np.float32(1)
    np.divide(g, t, out=t)
    t *= up
    return t


def log_softmax(logits):
    """logits - logsumexp(logits) over the last axis: the sampler's normalization of a decode
    step's vocabulary, in numpy for its vectorized exp (benchmarks/README.md, "Measurements behind
    choices in the code")."""
    if logits.size < ACTIVATION_MIN_SIZE or logits.dtype != mx.float32:
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    mx.eval(logits)
    a = np.asarray(logits)
    t = a - a.max(-1, keepdims=True)
    t -= np.log(np.exp(t).sum(-1, keepdims=True))
    return mx.array(t)


def np_rms_scale(a, eps):
    """1 / sqrt(mean(a^2) + eps) over the last axis, keepdims."""
    ss = np.square(a).sum(-1, keepdims=True)
    ss /= np.float32(a.shape[-1])
    ss += np.float32(eps)
    np.sqrt(ss, out=ss)
    return np.divide(np.float32(1), ss, out=ss)


def np_rotate(a, cos, sin):
    """rope.apply_rotary in numpy (rotate-half pairs)."""
    half = a.shape[-1] // 2
    return a * cos + np.concatenate([-a[..., half:], a[..., :half]], axis=-1) * sin
