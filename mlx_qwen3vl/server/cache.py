"""Caches shared by all requests: KV prefixes keyed by tokens *and* image content, and vision
features keyed by pixels.

Same-size images expand to identical placeholder tokens, so a prefix cache matched on token ids
alone would hand one screenshot's keys and values to another (issue #19). Here every placeholder
position's key is the content hash of the image or video it belongs to (hash of the preprocessed
pixels and grid, negative so it never equals a token id): a cached prefix ends before the first
image that differs, and the same screenshot resent in another encoding still matches.
"""

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import List, Optional

import mlx.core as mx
import numpy as np

from ..positions import IMAGE, VIDEO

MEDIA = ((IMAGE, "pixel_values", "image_grid_thw"), (VIDEO, "pixel_values_videos", "video_grid_thw"))


def media_hashes(inputs) -> dict:
    """{kind: [hash per image / video]} of the preprocessed pixels and grid, as positive int63."""
    out = {}
    for kind, px, grid in MEDIA:
        if grid not in inputs:
            continue
        pixels, grids = np.asarray(inputs[px]), np.asarray(inputs[grid])
        rows = np.concatenate([[0], np.cumsum(grids.prod(-1))])
        hashes = []
        for k in range(len(grids)):
            h = hashlib.blake2b(digest_size=8)
            h.update(np.ascontiguousarray(grids[k]).tobytes())
            h.update(np.ascontiguousarray(pixels[rows[k]:rows[k + 1]]).tobytes())
            hashes.append(int.from_bytes(h.digest(), "little") >> 1)
        out[kind] = hashes
    return out


def cache_key(inputs, hashes, merge_size: int) -> np.ndarray:
    """Token ids with each image / video placeholder replaced by -(its content hash) - 1."""
    key = np.asarray(inputs["input_ids"])[0].astype(np.int64).copy()
    types = np.asarray(inputs["mm_token_type_ids"])[0]
    for kind, _, grid in MEDIA:
        if grid in inputs:
            counts = np.asarray(inputs[grid]).prod(-1) // merge_size**2
            key[types == kind] = np.repeat(-np.asarray(hashes[kind], np.int64) - 1, counts)
    return key


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def copy_cache(caches, length: int, fresh):
    """Batch-1 KV caches (new ones from `fresh()`, the model's make_cache) holding the first
    `length` positions of `caches`; the source stays intact: the copy writes to its own buffers."""
    out = fresh()
    for c, n in zip(caches, out):
        if length:
            n.keys, n.values = c.keys[..., :length, :], c.values[..., :length, :]
            n.offset = length
    return out


def _nbytes(caches) -> int:
    return sum(c.keys.nbytes + c.values.nbytes for c in caches if c.keys is not None)


@dataclass
class _Entry:
    key: np.ndarray
    caches: list
    nbytes: int


class PrefixCache:
    """KV caches of finished requests (batch 1, trimmed to their key), least recently used first
    out when over `max_bytes`. `lookup` returns the longest reusable prefix of a request."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.entries: "OrderedDict[int, _Entry]" = OrderedDict()
        self.nbytes = 0
        self._next = 0
        self.hits = self.misses = self.reused_tokens = 0

    def lookup(self, key: np.ndarray):
        """(entry id, matched length) for the entry sharing the longest prefix with key[:-1]
        (the last prompt token is always computed: its logits start the answer), or (None, 0)."""
        best, best_n = None, 0
        for eid, e in self.entries.items():
            n = common_prefix(e.key, key[:-1])
            if n > best_n:
                best, best_n = eid, n
        if best is not None:
            self.entries.move_to_end(best)
        return best, best_n

    def take(self, eid, length: int, fresh):
        """New batch-1 caches (from `fresh()`) holding the entry's first `length` positions."""
        self.hits += 1
        self.reused_tokens += length
        return copy_cache(self.entries[eid].caches, length, fresh)

    def insert(self, key: np.ndarray, caches):
        if not len(key) or caches[0].keys is None:
            return
        if any(len(e.key) >= len(key) and common_prefix(e.key, key) == len(key) for e in self.entries.values()):
            return  # an entry already holds this whole prefix
        for eid in [eid for eid, e in self.entries.items()  # entries this one extends are redundant
                    if len(e.key) <= len(key) and common_prefix(e.key, key) == len(e.key)]:
            self._drop(eid)
        mx.eval([(c.keys, c.values) for c in caches])
        entry = _Entry(key, caches, _nbytes(caches))
        if entry.nbytes > self.max_bytes:
            return
        self.entries[self._next] = entry
        self._next += 1
        self.nbytes += entry.nbytes
        while self.nbytes > self.max_bytes:
            self._drop(next(iter(self.entries)))

    def _drop(self, eid):
        self.nbytes -= self.entries.pop(eid).nbytes

    def stats(self) -> dict:
        return {"entries": len(self.entries), "bytes": self.nbytes, "max_bytes": self.max_bytes,
                "hits": self.hits, "misses": self.misses, "reused_tokens": self.reused_tokens}


class FeatureCache:
    """Vision features (merged embeddings and DeepStack taps) per image / video content hash, so a
    screenshot seen again outside a reusable prefix (a sliding history window) skips the vision
    tower. LRU within `max_bytes`."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.items: "OrderedDict[int, list]" = OrderedDict()
        self.nbytes = 0
        self.hits = self.misses = 0

    def get(self, h) -> Optional[List[mx.array]]:
        item = self.items.get(h)
        if item is None:
            self.misses += 1
            return None
        self.hits += 1
        self.items.move_to_end(h)
        return item

    def put(self, h, arrays: List[mx.array]):
        size = sum(a.nbytes for a in arrays)
        if size > self.max_bytes or h in self.items:
            return
        self.items[h] = arrays
        self.nbytes += size
        while self.nbytes > self.max_bytes:
            _, old = self.items.popitem(last=False)
            self.nbytes -= sum(a.nbytes for a in old)

    def stats(self) -> dict:
        return {"entries": len(self.items), "bytes": self.nbytes, "max_bytes": self.max_bytes,
                "hits": self.hits, "misses": self.misses}
