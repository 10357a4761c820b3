"""One decode token through the whole decoder stack, outside MLX: the CPU path's decoder layer.

A decode step streams every weight of the decoder through ~200 GEMVs (the 2B model's) and leaves
room for little else: through MLX ops each layer pays per-op dispatch and several host syncs. Here
the token runs the whole stack on one numpy hidden state: per layer the GEMVs (numpy's BLAS) write
into reused buffers, and the rest is four calls (norm with the residual add, q/k norm with rotary,
attention, SwiGLU) into the C extension (_decode.c), or into their numpy versions (NumpyOps)
where it is not built. Modules are read as dict items (nn.Module's attribute lookup, paid at
every level, is slower). Nothing syncs on the KV cache inside the step: the attention reads each
cache's earlier positions in place and scores the new key on its own, and the step's new keys and
values are queued (KVCache.queue) and evaluated with the next step's inputs, in one sync.
Measurements: benchmarks/README.md, "What bounds each figure" and "Measurements behind choices in
the code".

A quantized cache (kv_bits) is read as it is stored: the attention (`attend_quantized` in C, or
`attend_cached_quantized` in numpy) turns a bounded block of packed positions into float32 at a
time, never the whole cache. The new key and value are quantized here first (`quantize_rows`, MLX's
affine formula in float32), so the step attends to them as the cache will hold them, as the MLX
graph does (mlx-lm's QuantizedKVCache quantizes before its attention reads).
"""

import importlib

import mlx.core as mx
import numpy as np

from .. import kv_cache
from ..language import attention_mask_for
from .experts import experts_into
from .kernels import matmul_t, np_rms_scale, np_rotate, np_silu_mul

NATIVE_INTERFACE = 2  # _decode.c's INTERFACE: the calls decode_tokens makes into it

try:  # by name: the extension is a file of this package, not a module that imports it back
    native = importlib.import_module(f"{__package__}._decode")
except ImportError:  # built without a C compiler: NumpyOps runs instead
    native = None
if getattr(native, "INTERFACE", None) != NATIVE_INTERFACE:  # built from an older _decode.c
    native = None


class QuantizedKVCache(kv_cache.QuantizedKVCache):
    """The quantized cache type, with KVCache's two additions for the decode stack."""

    def holds_float32(self) -> bool:
        return self.keys is not None and isinstance(self.keys, tuple) and self.keys[1].dtype == mx.float32

    def numpy_view(self):
        """(keys, values, positions in use), keys and values each (data as uint8 bytes, scales,
        biases), the evaluated buffers read in place."""
        view = lambda t: (np.asarray(t[0]).view(np.uint8), np.asarray(t[1]), np.asarray(t[2]))  # noqa: E731
        return view(self.keys), view(self.values), self.offset

    def queue(self, keys, values, start):
        """KVCache.queue for keys / values already quantized: (data, scales, biases), each
        (B, Hkv, 1, ...)."""
        if self.offset >= self.keys[0].shape[2]:  # grow by one step, as update_and_fetch would
            grow = lambda a: mx.concatenate(  # noqa: E731
                [a[..., :self.offset, :], mx.zeros((*a.shape[:2], self.step, a.shape[3]), a.dtype)], axis=2)
            self.keys, self.values = tuple(map(grow, self.keys)), tuple(map(grow, self.values))
        self.keys = tuple(mx.slice_update(a, n, start, (2,)) for a, n in zip(self.keys, keys))
        self.values = tuple(mx.slice_update(a, n, start, (2,)) for a, n in zip(self.values, values))
        self.offset += 1


class KVCache(kv_cache.KVCache):
    """The cache type, plus what the decode stack needs: its positions in use as numpy views, and
    the write it queues for a step (the new key and value go in lazily, without the fetch: its
    Python indexing is a cost per layer the step does not need)."""

    Quantized = QuantizedKVCache

    def holds_float32(self) -> bool:
        return self.keys is not None and not isinstance(self.keys, tuple) and self.keys.dtype == mx.float32

    def numpy_view(self):
        """(keys, values, positions in use): the evaluated buffers as numpy arrays, read in place."""
        return (np.ascontiguousarray(np.asarray(self.keys)), np.ascontiguousarray(np.asarray(self.values)),
                self.offset)

    def queue(self, keys, values, start):
        """update_and_fetch of one position, keys / values (B, Hkv, 1, hd), left lazy; `start` is
        mx.array([self.offset]), shared by the layers. Growing the buffer is left to KVCache."""
        if self.offset >= self.keys.shape[2]:
            self.update_and_fetch(keys, values)
            return
        self.keys = mx.slice_update(self.keys, keys, start, (2,))
        self.values = mx.slice_update(self.values, values, start, (2,))
        self.offset += 1


def runs(mlp) -> bool:
    """Whether the decode stack runs this feed-forward block: the dense MLP, or float32 experts
    (experts_into)."""
    if "switch_mlp" in mlp:
        return "scales" not in mlp["switch_mlp"]["gate_proj"] and mlp["gate"]["weight"].dtype == mx.float32
    return "gate_proj" in mlp


def applies(x, position_ids, mask, caches) -> bool:
    """Whether `decode_tokens` serves this forward: one token per sequence, and every cache one of
    ours, already holding float32 keys (or float32 scales), all of one kind; either no mask, or a
    decode step's padding mask (engine/step.py's: text positions (B,), exactly the caches' own key
    mask, which the attention applies from their `padding()`). A one-token prefill chunk ((3, B, L)
    positions, "causal" or a mask) runs the layers, as every other chunk does."""
    if not (x.shape[1] == 1 and bool(caches)
            and all(isinstance(c, (KVCache, QuantizedKVCache)) and c.holds_float32() for c in caches)
            and len({c.kind for c in caches}) == 1):
        return False
    if mask is None:
        return True
    # Any other mask (a caller's own attention_mask) runs the layers, which apply it.
    if not (isinstance(mask, mx.array) and position_ids.ndim == 1):
        return False
    key_mask = caches[0].key_mask(1)
    return key_mask is not None and mx.array_equal(mask, attention_mask_for(key_mask, 1)).item()


def decode_tokens(text_model, x, position_ids, caches, deepstack_embeds, ops):
    """language.TextModel.__call__ for one token per sequence, x (B, 1, D), every cache a filled
    float32 KVCache: the decoder layers, DeepStack additions and the final norm → (B, 1, D).
    `ops`: the C extension or NumpyOps. A left-padded row attends from its first own position on,
    so it gets the same numbers as alone (every other step is per row already)."""
    layers = text_model.layers
    cos, sin = text_model.rotary.cos_sin(position_ids, 1)
    # One sync: this step's inputs and the previous step's queued cache writes.
    mx.eval(x, cos, sin, deepstack_embeds, [c.state for c in caches])
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
    hidden = max((layer["mlp"]["gate_proj"]["weight"].shape[0] for layer in layers if "gate_proj" in layer["mlp"]),
                 default=0)  # the dense layers' width (an MoE layer's experts are experts_into's business)
    gate, up = np.empty((B, hidden), np.float32), np.empty((B, hidden), np.float32)
    kind = caches[0].kind
    pads = caches[0].padding()  # every layer's cache holds the same rows
    first = np.array(pads, np.int64) if any(pads) else None
    if kind is None:
        new_kv = np.empty((len(layers), 2, B, nkv, hd), np.float32)  # each layer's new key and value
    else:
        bits, group_size = kind
        new_kv = [np.empty((len(layers), 2, B, nkv, hd * bits // 32), np.uint32),  # ... as stored
                  np.empty((len(layers), 2, B, nkv, hd // group_size), np.float32),
                  np.empty((len(layers), 2, B, nkv, hd // group_size), np.float32)]
    pending = None  # the last layer's output, added to h by the next norm
    for i, (layer, cache) in enumerate(zip(layers, caches)):
        attn, mlp = layer["self_attn"], layer["mlp"]
        _rms_norm_into(ops, h, pending, layer["input_layernorm"], n)
        _linear_into(n, attn["q_proj"], flat[:, :nq * hd])
        _linear_into(n, attn["k_proj"], flat[:, nq * hd:(nq + nkv) * hd])
        _linear_into(n, attn["v_proj"], flat[:, (nq + nkv) * hd:])
        ops.qk_norm_rope(qkv, nq, nkv, np.asarray(attn["q_norm"]["weight"]), np.asarray(attn["k_norm"]["weight"]),
                         attn["q_norm"].eps, cos, sin)  # q_norm and k_norm: one eps
        keys, values, S = cache.numpy_view()
        if kind is None:
            ops.attend(qkv, nq, nkv, hd, keys, values, S, attn.scale, att, first)
            new_kv[i] = qkv[:, nq:].reshape(B, 2, nkv, hd).swapaxes(0, 1)
        else:  # the new key and value as the cache will hold them, then attention over the packed cache
            new = qkv[:, nq:].reshape(B, 2, nkv, hd).swapaxes(0, 1)
            data, scales, biases, new[...] = quantize_rows(new, group_size, bits)
            new_kv[0][i], new_kv[1][i], new_kv[2][i] = data, scales, biases
            attend_quantized(ops, qkv, nq, nkv, hd, keys, values, S, attn.scale, bits, group_size, att, first)
        _linear_into(att, attn["o_proj"], delta)
        _rms_norm_into(ops, h, delta, layer["post_attention_layernorm"], n)
        if "switch_mlp" in mlp:  # only the k experts the token chose are read
            experts_into(n, mlp, delta)
        else:
            _linear_into(n, mlp["gate_proj"], gate)
            _linear_into(n, mlp["up_proj"], up)
            ops.silu_mul(gate, up, gate)
            _linear_into(gate, mlp["down_proj"], delta)
        pending = delta
        if i < len(deepstack_embeds):
            h += delta
            h += np.asarray(deepstack_embeds[i], np.float32).reshape(B, D)
            pending = None
    _rms_norm_into(ops, h, pending, text_model.norm, n)
    _queue_cache_writes(caches, new_kv)
    return mx.array(n.reshape(B, 1, D))


def _rms_norm_into(ops, h, delta, module, out):
    ops.rms_norm(h, delta, np.asarray(module["weight"]), module.eps, out)


def _linear_into(a, module, out):
    """out = a @ weight.T (+ bias) for a (B, K)."""
    matmul_t(a, np.asarray(module["weight"]), out)
    if "bias" in module:
        out += np.asarray(module["bias"])
    return out


def _queue_cache_writes(caches, new_kv):
    """Each layer's new key and value, new_kv (layers, 2, B, Hkv, hd) (or, quantized, a list of
    its data, scales and biases), into its cache: one conversion to MLX per array for all layers,
    then one lazy write per cache."""
    quantized = isinstance(new_kv, list)
    kv = [mx.array(a)[..., None, :] for a in new_kv] if quantized else mx.array(new_kv)[..., None, :]
    starts = {}
    for i, cache in enumerate(caches):
        S = cache.size()
        if S not in starts:
            starts[S] = mx.array([S])
        if quantized:
            cache.queue(tuple(a[i, 0] for a in kv), tuple(a[i, 1] for a in kv), starts[S])
        else:
            cache.queue(kv[i, 0], kv[i, 1], starts[S])


class NumpyOps:
    """The C extension's four calls in numpy, same arguments and results (see _decode.c)."""

    @staticmethod
    def rms_norm(x, delta, weight, eps, out):
        if delta is not None:
            x += delta
        np.multiply(x, np_rms_scale(x, eps), out=out)
        out *= weight

    @staticmethod
    def qk_norm_rope(qkv, nq, nkv, q_weight, k_weight, eps, cos, sin):
        B, _, hd = qkv.shape
        qk = qkv[:, :nq + nkv]
        qk *= np_rms_scale(qk, eps)
        qk[:, :nq] *= q_weight
        qk[:, nq:] *= k_weight
        qk[...] = np_rotate(qk, cos.reshape(B, 1, hd), sin.reshape(B, 1, hd))

    @staticmethod
    def attend(qkv, nq, nkv, hd, keys, values, S, scale, out, first=None):
        for rows, f in _by_first(first):
            out[rows] = attend_cached(qkv[rows, :nq], qkv[rows, nq:nq + nkv], qkv[rows, nq + nkv:],
                                      keys[rows, :, f:], values[rows, :, f:], S - f, scale)

    @staticmethod
    def silu_mul(gate, up, out):
        out[...] = np_silu_mul(gate, up)

    @staticmethod
    def attend_quantized(qkv, nq, nkv, hd, kdata, kscales, kbiases, vdata, vscales, vbiases, S, scale, bits,
                         group_size, out, first=None):
        for rows, f in _by_first(first):
            part = lambda t: tuple(a[rows, :, f:] for a in t)  # noqa: E731
            out[rows] = attend_cached_quantized(qkv[rows, :nq], qkv[rows, nq:nq + nkv], qkv[rows, nq + nkv:],
                                                part((kdata, kscales, kbiases)), part((vdata, vscales, vbiases)),
                                                S - f, scale, bits, group_size)


def _by_first(first):
    """The rows (a slice, or an index array) of each first own position: all rows at 0 unpadded."""
    if first is None:
        return [(slice(None), 0)]
    return [(np.flatnonzero(first == f), int(f)) for f in np.unique(first)]


def attend_quantized(ops, qkv, nq, nkv, hd, keys, values, S, scale, bits, group_size, out, first=None):
    """ops.attend for a quantized cache: keys / values are (data as uint8, scales, biases); `first`
    None or each row's first own position (int64 (B,))."""
    ops.attend_quantized(qkv, nq, nkv, hd, *keys, *values, S, scale, bits, group_size, out, first)


def quantize_rows(x, group_size: int, bits: int):
    """mx.quantize's affine quantization of float32 rows x (..., d), in numpy with MLX's float32
    formula (mlx/backend/cpu/quantized.cpp) → (data uint32 (..., d * bits / 32), scales and biases
    (..., d / group_size), x as the quantized values give it back)."""
    g = x.reshape(*x.shape[:-1], -1, group_size)
    n_bins = np.float32((1 << bits) - 1)
    w_max, w_min = g.max(-1), g.min(-1)
    mask = np.abs(w_min) > np.abs(w_max)
    scale = np.maximum((w_max - w_min) / n_bins, np.float32(1e-7))
    scale = np.where(mask, scale, -scale)
    edge = np.where(mask, w_min, w_max)
    q0 = np.rint(edge / scale)
    nonzero = q0 != 0
    scale = np.where(nonzero, edge / np.where(nonzero, q0, np.float32(1)), scale).astype(np.float32)
    bias = np.where(nonzero, edge, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint((g - bias[..., None]) / scale[..., None]), 0, n_bins)
    back = (q * scale[..., None] + bias[..., None]).reshape(x.shape)
    codes = q.astype(np.uint8).reshape(*x.shape[:-1], -1)
    if bits == 4:  # two to a byte, the first in the low nibble (MLX packs from bit 0 up)
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    data = np.ascontiguousarray(codes).view(np.uint32)
    return data, scale, bias, back


def dequantize_rows(data, scales, biases, group_size: int, bits: int):
    """(data as uint8 bytes (..., d * bits / 8), scales, biases) → float32 (..., d)."""
    if bits == 4:
        data = np.stack([data & 15, data >> 4], -1).reshape(*data.shape[:-1], -1)
    g = data.astype(np.float32).reshape(*data.shape[:-1], -1, group_size)
    g *= scales[..., None]
    g += biases[..., None]
    return g.reshape(*data.shape[:-1], -1)


QUANTIZED_BLOCK = 1024  # cached positions turned into float32 at a time by the numpy attention


def attend_cached_quantized(q, k, v, keys, values, S, scale, bits, group_size):
    """attend_cached over a quantized cache: keys / values are (data as uint8 bytes (B, Hkv,
    capacity, hd * bits / 8), scales, biases (B, Hkv, capacity, hd / group_size)), dequantized a
    block of QUANTIZED_BLOCK positions at a time; k, v (B, Hkv, hd) the new key and value (as the
    cache will hold them) → (B, H * hd)."""
    B, H, hd = q.shape
    nkv = k.shape[1]
    qs = (q * np.float32(scale)).reshape(B, nkv, H // nkv, hd)
    scores = np.empty((B, nkv, H // nkv, S + 1), np.float32)
    blocks = [(s, min(S, s + QUANTIZED_BLOCK)) for s in range(0, S, QUANTIZED_BLOCK)]
    part = lambda t, s, e: dequantize_rows(t[0][:, :, s:e], t[1][:, :, s:e], t[2][:, :, s:e], group_size, bits)  # noqa: E731
    for s, e in blocks:
        np.matmul(qs, part(keys, s, e).swapaxes(-1, -2), out=scores[..., s:e])
    np.matmul(qs, k[:, :, :, None], out=scores[..., S:])
    scores -= scores.max(-1, keepdims=True)
    np.exp(scores, out=scores)
    total = scores.sum(-1, keepdims=True)
    out = scores[..., S:] * v[:, :, None, :]
    for s, e in blocks:
        out += np.matmul(scores[..., s:e], part(values, s, e))
    out /= total
    return out.reshape(B, H * hd)


def attend_cached(q, k, v, keys, values, S, scale):
    """Attention of one query token per sequence, q (B, H, hd), over the S earlier positions of
    the cache's buffers keys / values (B, Hkv, capacity, hd) and the new k, v (B, Hkv, hd) not yet
    in them → (B, H * hd); kernels.np_attention's math. Per (kv head, query head of its group) the
    scores are a GEMV over the cached keys, read in place (GEMMs over the group measured slower)."""
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
