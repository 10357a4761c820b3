"""numpy versions of the float32 work MLX's CPU backend does slowly: large linears, attention,
the MLP activations and the sampler's log-softmax.

MLX's CPU backend has no fused attention, evaluates exp/tanh/sigmoid with scalar code, and sends
every float32 matmul, even a matrix-vector product, to `cblas_sgemm`. numpy vectorizes the
transcendentals, and the C extension's matmul_rows (or, without it, numpy's OpenBLAS) beats that
path at every row count (benchmarks/README.md, "What bounds each figure"); matmul_rows also gives
a row the same numbers whatever the other rows and the thread count. Each function takes and
returns MLX arrays: it evaluates its inputs (a host sync), computes in numpy with the same float32 formulas as MLX (only the summation order
differs) and hands the result back to MLX. Below the size thresholds MLX's own op is cheaper than
the sync and runs instead.
"""

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
SMALL_ROWS = 16  # queries up to which the attention runs its BLAS on one thread (a verify forward)
CHUNK_SCORES = 1 << 25  # score elements per query chunk of the attention (128 MB in float32)
KEY_ALIGN = 16  # the attention's keys are zero-padded to a multiple of matmul_rows' widest vector


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


def _rows_apply(a, w) -> bool:
    """Whether matmul_rows computes a @ w.T: the C extension is built and both are float32, w
    C-contiguous (a weight as loaded)."""
    return _native is not None and a.dtype == w.dtype == np.float32 and w.flags["C_CONTIGUOUS"]


def matmul_t(a, w, out=None):
    """a @ w.T for a (M, K) in numpy, into `out` (M, N) when given. Every BLAS call of the CPU
    path's linears comes through here, so the thread count is set here (threads.apply).

    With the C extension, every M goes through matmul_rows: each output element is one dot
    product in a fixed order, so a row's numbers do not depend on the other rows (batch size,
    prompt chunking) nor on the thread count (threads split the columns). OpenBLAS's GEMM and GEMV
    round a row differently at each M and its GEMM at each thread count, which made an answer
    depend on the batch, the chunking and the machine's load (benchmarks/README.md, "One answer
    whatever the batch, chunking and load"). Without it: per-row GEMVs up to 4 rows, else GEMM."""
    n = threads.apply()
    if _rows_apply(a, w):
        if out is None or not out.flags["C_CONTIGUOUS"]:
            y = _rows_in_parallel(np.ascontiguousarray(a, np.float32), w, np.empty((a.shape[0], w.shape[0]), np.float32), n)
            if out is None:
                return y
            out[...] = y
            return out
        return _rows_in_parallel(np.ascontiguousarray(a, np.float32), w, out, n)
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
    y = matmul_t(a, w)
    if bias is not None:
        y += np.asarray(bias)
    return mx.array(y.reshape(*x.shape[:-1], weight.shape[0]))


def attention(q, k, v, scale: float, mask=None):
    """softmax(q k^T * scale, masked) v for q (B, H, L, D), k / v (B, Hkv, S, D) with H a multiple
    of Hkv (grouped queries), mask None, "causal" (lower-right aligned, as with a KV cache) or a
    boolean array (B or 1, 1, L, S), True where a query may look. Returns (B, H, L, D).

    With the C extension every prefill chunk, whatever its size or mask, runs np_attention, so a
    query's numbers do not depend on the chunk it comes in (MLX's kernel rounds differently); one
    query under a mask (a decode step of left-padded rows) stays with MLX, which reads the cache in
    place."""
    H, L, S = q.shape[1], q.shape[2], k.shape[2]
    masked = isinstance(mask, mx.array)
    if (masked and L == 1) if _native is not None else (masked or H * L * S < ATTENTION_MIN_SCORES):
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    mx.eval(q, k, v, *([mask] if masked else []))
    args = (np.asarray(q), np.asarray(k), np.asarray(v), scale)
    kw = dict(causal=isinstance(mask, str) and mask == "causal", allowed=np.asarray(mask) if masked else None)
    if q.shape[2] <= SMALL_ROWS:  # a verify forward's few queries: small GEMMs, beside matmul_rows' threads
        with threads.one_blas_thread():
            out = np_attention(*args, **kw)
    else:
        out = np_attention(*args, **kw)
    return mx.array(out)


def np_attention(q, k, v, scale, causal, allowed=None):
    """`attention` in numpy: q (B, H, L, D), k / v (B, Hkv, S, D) float32 arrays (k and v may be
    views of the KV cache) → (B, H, L, D), in query chunks of bounded memory; `allowed`: a boolean
    mask (B or 1, 1, L, S) instead of `causal` (with the C extension only).

    With the C extension each query's result is the same whatever the chunk it comes in and the
    thread count: its scores are matmul_rows' dot products, and the softmax's weighted sum of the
    values and its total are one more dot product each over the keys zero-padded to a multiple of
    KEY_ALIGN (masked and padded keys add exact zeros, and the summation order depends only on a
    key's position). The BLAS's GEMMs round a query differently with the chunk's shape and the
    thread count."""
    if _native is None:
        assert allowed is None, "a boolean mask is MLX's without the C extension"
        return _np_attention_blas(q, k, v, scale, causal)
    B, H, L, D = q.shape
    S, Hkv, Dv = k.shape[2], k.shape[1], v.shape[-1]
    rep = H // Hkv
    n = threads.apply()
    P = -(-S // KEY_ALIGN) * KEY_ALIGN
    out = np.empty((B, Hkv, rep, L, Dv), np.float32)
    rows = max(16, CHUNK_SCORES // max(1, B * H * P))
    offset = S - L
    qs = (q * np.float32(scale)).reshape(B, Hkv, rep, L, D)
    if allowed is not None:
        allowed = np.broadcast_to(allowed, (B, 1, L, S))
        causal = False
    for b in range(B):
        for g in range(Hkv):
            keys = np.zeros((P, D), np.float32)
            keys[:S] = k[b, g]
            vt = np.zeros((Dv + 1, P), np.float32)  # the values and a row of ones (the total) per key
            vt[:Dv, :S] = v[b, g].T
            vt[Dv, :S] = 1
            for s in range(0, L, rows):
                e = min(L, s + rows)
                seen = min(S, offset + e) if causal else S  # keys past the chunk's last query are masked anyway
                kp = -(-seen // KEY_ALIGN) * KEY_ALIGN
                a = np.ascontiguousarray(qs[b, g, :, s:e]).reshape(rep * (e - s), D)
                scores = _rows_in_parallel(a, keys[:kp], np.empty((a.shape[0], kp), np.float32), n)
                view = scores.reshape(rep, e - s, kp)
                if causal:
                    view[:, np.arange(s, e)[:, None] + offset < np.arange(kp)[None, :]] = -np.inf
                else:
                    view[..., S:] = -np.inf
                    if allowed is not None:
                        view[..., :S][:, ~allowed[b, 0, s:e]] = -np.inf
                np.subtract(scores, scores.max(-1, keepdims=True), out=scores)
                np.exp(scores, out=scores)
                wsum = _rows_in_parallel(scores, np.ascontiguousarray(vt[:, :kp]),
                                         np.empty((a.shape[0], Dv + 1), np.float32), n)
                out[b, g, :, s:e] = (wsum[:, :Dv] / wsum[:, Dv:]).reshape(rep, e - s, Dv)
    return out.reshape(B, H, L, -1)


def _np_attention_blas(q, k, v, scale, causal):
    """np_attention through the BLAS's GEMMs (no C extension)."""
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
