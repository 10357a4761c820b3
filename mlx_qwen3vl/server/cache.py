"""Caches shared by all requests: KV prefixes keyed by tokens *and* image content, and vision
features keyed by pixels.

Same-size images expand to identical placeholder tokens, so a prefix cache matched on token ids
alone would hand one screenshot's keys and values to another (issue #19). Each entry keeps its
token ids and its media keys (kind, span, content hash: prompt_cache.media_keys), and a request
reuses what `prompt_cache.reusable_prefix` allows: the common prefix, cut before the first image
or video that is not the same content at the same place.
"""

from collections import OrderedDict
from dataclasses import dataclass
from typing import List, Optional  # noqa: F401

import mlx.core as mx

from .. import kv_cache
from ..prompt_cache import reusable_prefix




@dataclass
class _Entry:
    tokens: List[int]
    media: list  # prompt_cache.media_keys of the tokens
    caches: list
    nbytes: int


def _extends(longer: _Entry, shorter_tokens, shorter_media) -> bool:
    """Whether `longer` holds everything a (tokens, media) entry would."""
    n = len(shorter_tokens)
    return len(longer.tokens) >= n and longer.tokens[:n] == shorter_tokens and set(shorter_media) <= set(longer.media)


def pipeline_scale(model):
    """(num, den) that turns this rank's KV bytes into the same count on every rank (see PrefixCache).
    A pipeline stage holds only its own layers' caches (all layers' are the same shape), so its
    bytes × all layers / (its layers × ranks) is the whole model's per rank; (1, 1) otherwise:
    one process, or tensor parallel (every rank holds the same share of every layer)."""
    stage = getattr(model.language_model, "stage", None)
    if stage is None:
        return 1, 1
    return stage.layers, (stage.end - stage.start) * stage.size


class PrefixCache:
    """KV caches of finished requests (batch 1, trimmed to their key), least recently used first
    out when over `max_bytes`. `lookup` returns the longest reusable prefix of a request.

    On several ranks every rank must keep and evict the same entries (a rank reusing a shorter
    prefix would prefill more tokens and pair its collectives wrongly), so an entry counts its
    bytes × `scale` (num, den): pipeline_scale(model), equal on every rank."""

    def __init__(self, max_bytes: int, scale=(1, 1)):
        self.max_bytes = max_bytes
        self.scale = scale
        self.entries: "OrderedDict[int, _Entry]" = OrderedDict()
        self.nbytes = 0
        self._next = 0
        self.hits = self.misses = self.reused_tokens = 0

    def lookup(self, inputs):
        """(entry id, reusable length) of the entry that serves the most of the prompt `inputs`
        (never its last token: its logits start the answer), or (None, 0)."""
        best, best_n = None, 0
        for eid, e in self.entries.items():
            n = reusable_prefix(e.tokens, e.media, inputs)
            if n > best_n:
                best, best_n = eid, n
        if best is not None:
            self.entries.move_to_end(best)
        return best, best_n

    def take(self, eid, length: int, fresh):
        """New batch-1 caches (from `fresh()`) holding the entry's first `length` positions."""
        self.hits += 1
        self.reused_tokens += length
        return kv_cache.extract(self.entries[eid].caches, 0, length)

    def insert(self, tokens: List[int], media: list, caches):
        if not tokens or caches[0].empty():
            return
        if any(_extends(e, tokens, media) for e in self.entries.values()):
            return  # an entry already holds all of it
        new = _Entry(tokens, media, caches, 0)
        for eid in [eid for eid, e in self.entries.items() if _extends(new, e.tokens, e.media)]:
            self._drop(eid)  # entries this one extends are redundant
        caches = kv_cache.extract(caches, 0, len(tokens))  # sized to the tokens it holds
        mx.eval(kv_cache.state(caches))
        num, den = self.scale
        entry = _Entry(tokens, media, caches, kv_cache.nbytes(caches) * num // den)
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
        self.items: "OrderedDict[str, list]" = OrderedDict()
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
