"""The KV cache: one per decoder layer, holding B rows left-padded to a common length, and every
operation on those rows. Nothing outside this type (and its subclasses) reads or writes its fields.

It is mlx-lm's `KVCache` (the buffer grown in steps of 256 positions, `update_and_fetch`, `trim`,
`state`, `nbytes`) with the row operations of its `BatchKVCache` (rows right-aligned, each with
its own left padding: `merge`, `filter`, `extract`) in the same type, so one request's cache and a
batch's are one kind of object, plus what the engine and the prefix cache need and mlx-lm lacks:
a right-sized copy of a row's first n positions (`extract(row, length)`), `trim_to(n)`, `fill`
(a cache read from a file), a key mask for the padding, and a dependency hook for pipeline stages.
Every row operation leaves fresh row-contiguous buffers: the CPU decode stack reads them in place.

mlx-lm (and with it transformers) is imported with this module, so modules that `import
mlx_qwen3vl` loads call these methods on caches the model made rather than importing it.

Row operations go through `_map`, which applies one array operation to a buffer or to each
array of a tuple of buffers: `QuantizedKVCache` (mlx-lm's, for kv_bits) stores (data, scales,
biases) per buffer, all with the position axis at 2, so the same merge / filter / extract serve
it unchanged.
"""

from typing import List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models import cache as mlx_lm_cache


def _map(f, x):
    return tuple(f(a) for a in x) if isinstance(x, tuple) else f(x)


def _first(x):
    return x[0] if isinstance(x, tuple) else x


def _nbytes(x) -> int:
    return sum(a.nbytes for a in x) if isinstance(x, tuple) else x.nbytes


class _Rows:
    """The row operations, for a cache whose `keys` / `values` are one buffer (float) or a tuple
    of buffers (quantized: data, scales, biases), (B, kv heads, capacity, ...) each."""

    left_padding: Optional[List[int]] = None  # per row; None: no row is padded

    kind = None  # what it stores: None (float) or (bits, group_size)

    @property
    def batch_size(self) -> int:
        return 0 if self.keys is None else _first(self.keys).shape[0]

    def size(self) -> int:
        return self.offset

    def capacity(self) -> int:
        """Positions the buffers have room for."""
        return 0 if self.keys is None else _first(self.keys).shape[2]

    def padding(self) -> List[int]:
        return list(self.left_padding) if self.left_padding else [0] * self.batch_size

    def key_mask(self, new: int = 0):
        """(B, offset + new) booleans, False at each row's padding; None when no row is padded."""
        if not self.left_padding or not any(self.left_padding):
            return None
        pads = mx.array(self.left_padding)[:, None]
        return mx.arange(self.offset + new)[None, :] >= pads

    def depend_on(self, x):
        """Make evaluating this cache evaluate `x` too (a pipeline stage's send of its hidden state)."""
        if isinstance(self.keys, tuple):
            self.keys = (mx.depends(self.keys[0], x), *self.keys[1:])
        else:
            self.keys = mx.depends(self.keys, x)

    def empty_like(self):
        """An empty cache of the same type and settings."""
        return type(self)()

    def buffers(self):
        """(keys, values) as held: None, a buffer, or a tuple of buffers each."""
        return self.keys, self.values

    def fill(self, keys, values):
        """Hold exactly `keys` / `values` (buffers as `buffers()` gives them, batch 1, of exactly
        the positions they hold), replacing whatever this cache held."""
        self.keys, self.values = keys, values
        self.offset = _first(keys).shape[2]
        self.left_padding = None
        return self

    def trim_to(self, n: int):
        """Keep only the first `n` positions, padding included (in place; buffers are not copied):
        mlx-lm's trim counted from the other end."""
        if n > self.offset:
            raise ValueError(f"trim_to({n}) on a cache of {self.offset} positions")
        self.trim(self.offset - n)

    def drop_last(self, counts: Sequence[int]):
        """Row b loses its last `counts[b]` positions (a speculative step's rejected drafts), in
        place. The positions all rows lose are trimmed (no copy); a row that loses fewer than the
        most is shifted right by the difference, its padding growing by it, so rows stay
        right-aligned (one gather over the buffers, only when the counts differ)."""
        m = min(counts)
        shifts = [c - m for c in counts]
        if any(shifts):
            cap = _first(self.keys).shape[2]
            s = mx.array(shifts)[:, None]
            index = mx.maximum(mx.arange(cap)[None, :] - s, 0)[:, None, :, None]  # (B, 1, cap, 1)
            shift = lambda a: mx.contiguous(mx.take_along_axis(a, index, axis=2))  # noqa: E731
            self.keys, self.values = _map(shift, self.keys), _map(shift, self.values)
            pads = [p + d for p, d in zip(self.padding(), shifts)]
            self.left_padding = pads if any(pads) else None
        if m:
            self.trim(m)

    @property
    def nbytes(self) -> int:
        """Bytes of its buffers (their whole capacity)."""
        return 0 if self.keys is None else _nbytes(self.keys) + _nbytes(self.values)

    # ------------------------------------------------------------------ row operations
    @classmethod
    def merge(cls, caches: Sequence["_Rows"]):
        """One cache with the rows of `caches`, in order, right-aligned to the longest; each row
        keeps its positions and gains left padding. The sources stay as they were. An empty cache
        (a one-row cache that holds nothing yet) joins as a row of padding only; if all are empty,
        the result is empty too (its rows come with the first update)."""
        if len({c.kind for c in caches}) > 1:
            raise ValueError("merge needs caches of one kind (all float, or all of the same bits and group size)")
        out = caches[0].empty_like()
        full = [c for c in caches if not c.empty()]
        if not full:
            return out
        T = max(c.offset for c in caches)
        blank = lambda a: mx.zeros((1, a.shape[1], T, a.shape[3]), a.dtype)  # noqa: E731
        keys, values, pads = [], [], []
        for c in caches:
            if c.empty():
                keys.append(_map(blank, full[0].keys))
                values.append(_map(blank, full[0].values))
                pads.append(T)
                continue
            extra = T - c.offset
            pad = [(0, 0), (0, 0), (extra, 0), (0, 0)]
            used = lambda a: a[..., :c.offset, :]  # noqa: E731
            k, v = _map(used, c.keys), _map(used, c.values)
            if extra:
                k, v = _map(lambda a: mx.pad(a, pad), k), _map(lambda a: mx.pad(a, pad), v)
            keys.append(k)
            values.append(v)
            pads += [p + extra for p in c.padding()]
        join = lambda parts: (tuple(mx.concatenate(p) for p in zip(*parts)) if isinstance(parts[0], tuple)  # noqa: E731
                              else mx.concatenate(parts))
        out.keys, out.values, out.offset = join(keys), join(values), T
        out.left_padding = pads if any(pads) else None
        return out

    def filter(self, rows: Sequence[int]):
        """Keep only `rows` (indices, in the order given), in place; padding all kept rows share
        is dropped."""
        pads = [self.padding()[i] for i in rows]
        trim = min(pads) if pads else 0
        index = mx.array(list(rows))
        # A fresh row-contiguous buffer: the CPU decode stack reads it in place as (B, H, S, ...).
        pick = lambda a: mx.contiguous(a[index, :, trim:self.offset])  # noqa: E731
        self.keys, self.values = _map(pick, self.keys), _map(pick, self.values)
        self.offset -= trim
        pads = [p - trim for p in pads]
        self.left_padding = pads if any(pads) else None

    def extract(self, row: int = 0, length: Optional[int] = None):
        """A new one-row cache holding row `row`'s first `length` positions (all of them by
        default), in buffers of exactly that size; this cache is left as it was."""
        pad = self.padding()[row]
        length = self.offset - pad if length is None else min(length, self.offset - pad)
        out = self.empty_like()
        if length > 0:
            take = lambda a: mx.contiguous(a[row:row + 1, :, pad:pad + length])  # noqa: E731
            out.keys, out.values, out.offset = _map(take, self.keys), _map(take, self.values), length
        return out


class QuantizedKVCache(_Rows, mlx_lm_cache.QuantizedKVCache):
    """mlx-lm's QuantizedKVCache (keys and values as mx.quantize's (data, scales, biases), grown in
    steps of 256; attention reads them with quantized matmuls) with the same row operations."""

    def __init__(self, group_size: int = 64, bits: int = 8):
        super().__init__(group_size=group_size, bits=bits)
        self.left_padding = None

    @property
    def kind(self):
        return (self.bits, self.group_size)

    def empty_like(self):
        return type(self)(self.group_size, self.bits)

    def update_and_fetch(self, keys, values):
        k, v = super().update_and_fetch(keys, values)
        return tuple(k), tuple(v)


class KVCache(_Rows, mlx_lm_cache.KVCache):
    """mlx-lm's KVCache (one decoder layer's (B, kv heads, capacity, head dim) buffers, of which
    the first `offset` positions are in use, grown in steps of 256) whose rows may be left-padded:
    row b's own positions start after its `padding()[b]` leading pad positions (zeros, hidden by
    `key_mask`). Everything else that is done to its rows is a method here."""

    Quantized = QuantizedKVCache  # what to_quantized makes (the CPU backend's caches name their own)

    def __init__(self):
        super().__init__()
        self.left_padding = None

    def to_quantized(self, group_size: int = 64, bits: int = 8):
        """This cache's positions in use, quantized (each position on its own, so the same values
        as if each had been quantized when it was written), in a new cache of the same rows."""
        out = self.Quantized(group_size=group_size, bits=bits)
        out.left_padding = self.left_padding
        if self.keys is not None:
            used = lambda a: a[..., :self.offset, :]  # noqa: E731
            out.keys = tuple(mx.quantize(used(self.keys), group_size=group_size, bits=bits))
            out.values = tuple(mx.quantize(used(self.values), group_size=group_size, bits=bits))
            out.offset = self.offset
        return out
