"""One decode token through the whole decoder stack, outside MLX: the CPU path's decoder layer.

A decode step of the 2B model streams ~7 GB of weights through ~200 GEMVs and leaves room for
little else: through MLX each layer paid per-op dispatch and several host syncs. Here the token
runs the whole stack on one numpy hidden state: per layer the GEMVs (numpy's BLAS) write into
reused buffers, and the rest is four calls (norm with the residual add, q/k norm with rotary,
attention, SwiGLU) into the C extension (_decode.c), or into their numpy versions (NumpyOps)
where it is not built. Modules are read as dict items (nn.Module attribute lookup costs ~2 us a
level). Nothing syncs on the KV cache inside the step: the attention reads each cache's earlier
positions in place and scores the new key on its own, and the step's new keys and values are
queued (KVCache.queue) and evaluated with the next step's inputs, in one sync. Measurements:
benchmarks/README.md, "What bounds each figure".
"""

import importlib

import mlx.core as mx
import numpy as np

from .. import kv_cache
from .experts import experts_into
from .kernels import matmul_t, np_rms_scale, np_rotate, np_silu_mul

NATIVE_INTERFACE = 1  # _decode.c's INTERFACE: the calls decode_tokens makes into it

try:  # by name: the extension is a file of this package, not a module that imports it back
    native = importlib.import_module(f"{__package__}._decode")
except ImportError:  # built without a C compiler: NumpyOps runs instead
    native = None
if getattr(native, "INTERFACE", None) != NATIVE_INTERFACE:  # built from an older _decode.c
    native = None


class KVCache(kv_cache.KVCache):
    """The cache type, plus what the decode stack needs: its positions in use as numpy views, and
    the write it queues for a step (the new key and value go in lazily, without the fetch: the
    type's own indexing costs ~40 us a layer in Python)."""

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


def applies(x, mask, caches) -> bool:
    """Whether `decode_tokens` serves this forward: one token per sequence, no padding mask, and
    every cache one of ours, already holding float32 keys."""
    return (x.shape[1] == 1 and mask is None and bool(caches)
            and all(isinstance(c, KVCache) and c.holds_float32() for c in caches))


def decode_tokens(text_model, x, position_ids, caches, deepstack_embeds, ops):
    """language.TextModel.__call__ for one token per sequence, x (B, 1, D), every cache a filled
    float32 KVCache, no padding: the decoder layers, DeepStack additions and the final norm →
    (B, 1, D). `ops`: the C extension or NumpyOps."""
    layers = text_model.layers
    cos, sin = text_model.rotary.cos_sin(position_ids, 1)
    # One sync: this step's inputs and the previous step's queued cache writes.
    mx.eval(x, cos, sin, deepstack_embeds, kv_cache.state(caches))
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
        keys, values, S = cache.numpy_view()
        ops.attend(qkv, nq, nkv, hd, keys, values, S, attn.scale, att)
        new_kv[i] = qkv[:, nq:].reshape(B, 2, nkv, hd).swapaxes(0, 1)
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
    """Each layer's new key and value, new_kv (layers, 2, B, Hkv, hd), into its cache: one
    conversion to MLX for all layers, then one lazy write per cache."""
    kv = mx.array(new_kv)[..., None, :]  # (layers, 2, B, Hkv, 1, hd)
    starts = {}
    for i, cache in enumerate(caches):
        S = cache.size()
        if S not in starts:
            starts[S] = mx.array([S])
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
    def attend(qkv, nq, nkv, hd, keys, values, S, scale, out):
        out[...] = attend_cached(qkv[:, :nq], qkv[:, nq:nq + nkv], qkv[:, nq + nkv:], keys, values, S, scale)

    @staticmethod
    def silu_mul(gate, up, out):
        out[...] = np_silu_mul(gate, up)


def attend_cached(q, k, v, keys, values, S, scale):
    """Attention of one query token per sequence, q (B, H, hd), over the S earlier positions of
    the cache's buffers keys / values (B, Hkv, capacity, hd) and the new k, v (B, Hkv, hd) not yet
    in them → (B, H * hd); kernels.np_attention's math. Per (kv head, query head of its group) the
    scores are a GEMV over the cached keys, read in place (faster here than GEMMs over the group)."""
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
