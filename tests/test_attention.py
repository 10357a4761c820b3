"""Attention in query chunks (attention.py) equals the unchunked result, for the vision tower's
windows (head dims 64 and 72) and the decoder's prefill (causal, padded, grouped heads)."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_qwen3vl import attention
from mlx_qwen3vl.vision import VisionAttention


def reference(q, k, v, scale, allowed=None):
    """softmax(q k^T) v in float64 numpy, q (B, H, L, D), k / v (B, Hkv, S, D)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    s = q @ k.swapaxes(-1, -2) * scale
    if allowed is not None:
        s = np.where(allowed, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def randn(*shape, seed):
    return mx.array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 2)


def test_query_chunk_follows_the_budget():
    q, k = mx.zeros((2, 4, 100, 8)), mx.zeros((2, 4, 30, 8))
    per_query = 2 * 4 * 30 * 4 * 2  # scores and softmax, float32
    assert attention.query_chunk(q, k, budget=7 * per_query + 5) == 7
    assert attention.query_chunk(q, k, budget=1) == 1
    assert attention.query_chunk(q, k) == attention.SCORE_BUDGET // per_query


@pytest.mark.parametrize("head_dim", [64, 72])
@pytest.mark.parametrize("rows", [7, 13])
def test_vision_windows_chunked_equal_unchunked(head_dim, rows, monkeypatch, on_cpu):
    """Windows of 50 (two of them), 37 and 10 (three) patches; chunks of 7 or 13 queries divide none."""
    heads = 2
    attn = VisionAttention(heads * head_dim, heads)
    segments = [(0, 2, 50), (100, 1, 37), (137, 3, 10)]
    n = 167
    q, k, v = (randn(n, heads, head_dim, seed=s) for s in range(3))
    whole = [attn.windows(q, k, v, *seg) for seg in segments]
    calls = []
    sdpa = mx.fast.scaled_dot_product_attention
    counted = lambda *a, **kw: calls.append(a[0].shape) or sdpa(*a, **kw)  # noqa: E731
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", counted)
    per_query = lambda count, length: count * heads * length * 8
    for (start, count, length), full in zip(segments, whole):
        monkeypatch.setattr(attention, "SCORE_BUDGET", rows * per_query(count, length))
        calls.clear()
        chunked = attn.windows(q, k, v, start, count, length)
        assert len(calls) == -(-length // rows)  # ceil: the last chunk is shorter
        np.testing.assert_allclose(np.array(chunked), np.array(full), rtol=1e-5, atol=1e-5)
        # and both equal the float64 softmax of each window
        def window(a):
            a = np.asarray(a)[start:start + count * length]
            return a.reshape(count, length, heads, head_dim).transpose(0, 2, 1, 3)

        ref = reference(window(q), window(k), window(v), head_dim**-0.5)
        ref = ref.transpose(0, 2, 1, 3).reshape(-1, heads * head_dim)
        np.testing.assert_allclose(np.array(chunked), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mask_kind", ["causal", "padded", None])
def test_decoder_prefill_chunked_equals_unchunked(mask_kind, on_cpu):
    """Grouped heads (4 over 2), 29 new queries after 16 cached positions, chunks of 6 queries."""
    B, H, Hkv, L, S, D = 2, 4, 2, 29, 45, 64
    q, k, v = randn(B, H, L, D, seed=4), randn(B, Hkv, S, D, seed=5), randn(B, Hkv, S, D, seed=6)
    allowed = np.tril(np.ones((L, S), bool), k=S - L)[None, None].repeat(B, 0)
    if mask_kind == "padded":
        allowed[1, :, :, :9] = False  # row 1 left-padded by 9 positions
        mask = mx.array(allowed)
    elif mask_kind == "causal":
        mask = "causal"
    else:
        mask, allowed = None, None
    scale = D**-0.5
    full = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    per_query = B * H * S * 8
    chunked = attention.scaled_dot_product_attention(q, k, v, scale, mask, budget=6 * per_query)
    np.testing.assert_allclose(np.array(chunked), np.array(full), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(chunked), reference(q, k, v, scale, allowed), rtol=1e-4, atol=1e-4)
