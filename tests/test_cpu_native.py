"""The C extension of the CPU decode path (mlx_qwen3vl/cpu/_decode.c) against its numpy versions
(cpu.decode.NumpyOps), on shapes that reach every branch: head sizes that are and are not
multiples of the vector width, odd query groups, caches whose length is not a multiple of the
key block, and exp's edges."""

import numpy as np
import pytest

from mlx_qwen3vl.cpu import decode
from mlx_qwen3vl.cpu.decode import NumpyOps

native = decode.native
if native is None:
    pytest.fail("the C extension is not built, or built from an older _decode.c: pip install -e . (needs a C "
                "compiler)", pytrace=False)

rng = np.random.default_rng(0)


def test_interface_matches():
    from mlx_qwen3vl.cpu import _decode

    assert _decode.INTERFACE == decode.NATIVE_INTERFACE


def randn(*shape):
    return rng.standard_normal(shape, dtype=np.float32)


def rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("nq,nkv,hd,S", [(16, 8, 128, 273), (6, 2, 64, 5), (3, 1, 40, 130), (4, 4, 8, 0)])
@pytest.mark.parametrize("batch", [1, 3])
def test_attend_matches_numpy(nq, nkv, hd, S, batch):
    cap = S + 7
    qkv = randn(batch, nq + 2 * nkv, hd)
    keys, values = randn(batch, nkv, cap, hd), randn(batch, nkv, cap, hd)
    keys[:, :, S:] = values[:, :, S:] = np.nan  # positions past S are never read
    ours, ref = np.empty((batch, nq * hd), np.float32), np.empty((batch, nq * hd), np.float32)
    native.attend(qkv, nq, nkv, hd, keys, values, S, hd**-0.5, ours)
    NumpyOps.attend(qkv, nq, nkv, hd, keys, values, S, hd**-0.5, ref)
    assert rel(ours, ref) < 2e-6


@pytest.mark.parametrize("bits", [None, 8, 4])
def test_left_padded_rows_attend_as_alone(bits):
    """Rows left-padded by 0, 9 and 70 positions (`first`): each row's output is bit for bit its
    output alone in an unpadded cache, whatever the padding holds (NaN here); numpy's too (and close
    to C's)."""
    nq, nkv, hd, S, gs = 6, 2, 64, 203, 32
    firsts = np.array([0, 9, 70], np.int64)
    qkv, keys, values = randn(3, nq + 2 * nkv, hd), randn(3, nkv, S + 5, hd), randn(3, nkv, S + 5, hd)
    if bits is None:
        for b, f in enumerate(firsts.tolist()):
            keys[b, :, :f] = values[b, :, :f] = np.nan
        call = lambda ops, q, k, v, n, out, first=None: ops.attend(  # noqa: E731
            q, nq, nkv, hd, k, v, n, 0.125, out, first)
        row = lambda t, b, f: t[b:b + 1, :, f:].copy()  # noqa: E731
    else:
        keys, values = ([decode.quantize_rows(t, gs, bits)[i] for i in range(3)] for t in (keys, values))
        keys[0], values[0] = (np.ascontiguousarray(t[0]).view(np.uint8) for t in (keys, values))
        for b, f in enumerate(firsts.tolist()):
            for t in keys[1:] + values[1:]:
                t[b, :, :f] = np.nan
        call = lambda ops, q, k, v, n, out, first=None: ops.attend_quantized(  # noqa: E731
            q, nq, nkv, hd, *k, *v, n, 0.125, bits, gs, out, first)
        row = lambda t, b, f: [a[b:b + 1, :, f:].copy() for a in t]  # noqa: E731
    for ops in (native, NumpyOps):
        padded = np.empty((3, nq * hd), np.float32)
        call(ops, qkv, keys, values, S, padded, firsts)
        for b, f in enumerate(firsts.tolist()):
            alone = np.empty((1, nq * hd), np.float32)
            call(ops, qkv[b:b + 1], row(keys, b, f), row(values, b, f), S - f, alone)
            assert np.array_equal(padded[b], alone[0]), (ops, b)
        if ops is native:
            ours = padded
    assert rel(ours, padded) < 2e-6
    with pytest.raises(ValueError, match="first"):
        call(native, qkv, keys, values, S, padded, np.array([0, 9, S + 1], np.int64))


@pytest.mark.parametrize("hd", [128, 10, 1100])
def test_qk_norm_rope_matches_numpy(hd):
    qkv, cos, sin = randn(2, 7, hd), randn(2, hd), randn(2, hd)
    qw, kw = randn(hd), randn(hd)
    ours, ref = qkv.copy(), qkv.copy()
    native.qk_norm_rope(ours, 3, 2, qw, kw, 1e-6, cos, sin)
    NumpyOps.qk_norm_rope(ref, 3, 2, qw, kw, 1e-6, cos, sin)
    assert rel(ours, ref) < 2e-6
    np.testing.assert_array_equal(ours[:, 5:], qkv[:, 5:])  # the v heads untouched


@pytest.mark.parametrize("with_delta", [True, False])
def test_rms_norm_matches_numpy(with_delta):
    h, w = randn(3, 2051), randn(2051)
    delta = randn(3, 2051) if with_delta else None
    h_ours, h_ref = h.copy(), h.copy()
    ours, ref = np.empty_like(h), np.empty_like(h)
    native.rms_norm(h_ours, delta, w, 1e-6, ours)
    NumpyOps.rms_norm(h_ref, delta, w, 1e-6, ref)
    np.testing.assert_allclose(h_ours, h_ref, rtol=0, atol=0)  # the residual add is exact
    assert rel(ours, ref) < 2e-6


def test_silu_mul_matches_float64_including_edges():
    g = np.concatenate([np.linspace(-100, 100, 10_003, dtype=np.float32), np.float32([0, np.inf, -np.inf, np.nan])])
    up = randn(g.size)
    ours = np.empty_like(g)
    native.silu_mul(g, up, ours)
    with np.errstate(all="ignore"):
        ref = (g / (1 + np.exp(-g.astype(np.float64))) * up).astype(np.float32)
    finite = np.isfinite(ref) & (np.abs(ref) > 1e-30)
    assert np.max(np.abs(ours[finite] - ref[finite]) / np.abs(ref[finite])) < 1e-6
    assert ours[-4] == 0 and ours[-3] == up[-3] * np.inf and np.isnan(ours[-2]) and np.isnan(ours[-1])
    assert np.all(np.abs(ours[:200]) < 1e-30)  # silu(-100..-98) underflows to 0, not to NaN


def test_bad_buffers_raise_clear_errors():
    out = np.empty((1, 16 * 128), np.float32)
    qkv, kv = randn(1, 32, 128), randn(1, 8, 64, 128)
    with pytest.raises(ValueError, match="capacity"):
        native.attend(qkv, 16, 8, 128, kv, kv, 65, 0.1, out)
    with pytest.raises(TypeError, match="float32"):
        native.rms_norm(np.ones((1, 8)), None, np.ones(8, np.float32), 1e-6, np.ones((1, 8), np.float32))
    with pytest.raises(ValueError, match="shapes"):
        native.silu_mul(np.ones(8, np.float32), np.ones(9, np.float32), np.ones(8, np.float32))
    with pytest.raises(ValueError, match="contiguous"):
        native.silu_mul(np.ones(8, np.float32)[::2], np.ones(4, np.float32), np.ones(4, np.float32))
