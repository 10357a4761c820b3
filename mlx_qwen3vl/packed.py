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

    def attend(self, attend, q, k, v, last=None):
        """q (1, H, N, D), k / v (1, Hkv, N, D) of the packed sequence → (1, H, N, D): each row's
        slice through `attend(q, k, v, mask, cache)` against its own cache, causal within it;
        with `last`, only each row's last `last` queries (every key and value still cached)."""
        outs = []
        for c, a, b in zip(self.caches, self.bounds, self.bounds[1:]):
            queries = q[:, :, a:b] if last is None else q[:, :, max(a, b - last):b]
            # "causal" even for one query (lower-right aligned: all its keys), so a row's last query
            # takes the attention a lone prefill's does, bit for bit on the CPU path
            outs.append(attend(queries, k[:, :, a:b], v[:, :, a:b], "causal", c))
        return mx.concatenate(outs, axis=2)

    def last_positions(self, x, last: int):
        """x (1, N, ...) at each row's last `last` positions, in packing order."""
        index = [i for a, b in zip(self.bounds, self.bounds[1:]) for i in range(max(a, b - last), b)]
        return x[:, mx.array(index)]

    def depend_on(self, x):
        """A pipeline stage's send, evaluated with the rows' caches (kv_cache's depend_on)."""
        for c in self.caches:
            c.depend_on(x)
