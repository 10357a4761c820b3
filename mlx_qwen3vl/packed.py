"""Several rows' new tokens as one packed sequence: batch 1, the rows' tokens one after another,
no padding. Everything a decoder layer does token by token (norms, projections, MLP, rotary from
each token's own position) runs once over the sequence; only attention splits it back into rows,
each row's queries attending causally to its own KV cache (engine/prefill.prefill_together)."""

from typing import Sequence

import mlx.core as mx


class PackedRows:
    """One decoder layer's caches of packed rows (batch-1 caches, unpadded, in packing order) and
    each row's number of new tokens: what the layer gets in place of its cache."""

    def __init__(self, caches: Sequence, lengths: Sequence[int]):
        self.caches = list(caches)
        self.bounds = [0]
        for n in lengths:
            self.bounds.append(self.bounds[-1] + int(n))

    def attend(self, attend, q, k, v):
        """q (1, H, N, D), k / v (1, Hkv, N, D) of the packed sequence → (1, H, N, D): each row's
        slice through `attend(q, k, v, mask, cache)` against its own cache, causal within it."""
        outs = []
        for c, a, b in zip(self.caches, self.bounds, self.bounds[1:]):
            outs.append(attend(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], "causal" if b - a > 1 else None, c))
        return mx.concatenate(outs, axis=2)

    def depend_on(self, x):
        """A pipeline stage's send, evaluated with the rows' caches (kv_cache's depend_on)."""
        for c in self.caches:
            c.depend_on(x)
