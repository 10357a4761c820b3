"""Caches shared by all requests of an engine: KV prefixes keyed by tokens *and* media content,
found through a radix tree, and vision features keyed by pixels.

Same-size images expand to identical placeholder tokens, so a prefix cache matched on token ids
alone would hand one screenshot's keys and values to another. Each entry keeps its
token ids and its media keys (kind, span, content hash: spans.media_keys), and a request reuses
what `spans.reusable_prefix` allows: the common prefix, cut before the first image or video that
is not the same content at the same place.

The index is a radix tree over each entry's keys: its token ids with the first position of every
image or video replaced by (kind, content hash, length), so two prompts whose tokens agree but
whose screenshots differ part at that screenshot. A lookup walks the request's keys once: its cost
grows with the prompt, never with the number of entries (mlx-lm's PromptTrie keys tokens only).

Quantized caches (kv_bits) have an index of their own per (bits, group size, quantized_kv_start):
their positions from `quantized_kv_start` on were computed against the quantized cache, so such
an entry serves only requests of those settings, and only prefixes of at least that many
positions (shorter ones were float in a fresh run). A float entry serves a quantized request up to
its `quantized_kv_start`, and any float request whole.
"""

from collections import OrderedDict
from dataclasses import dataclass
from typing import List, Optional, Tuple

import mlx.core as mx
import numpy as np

from ..kv_settings import FLOAT
from ..spans import media_keys, media_spans
from .batch import cache_bytes


def index_keys(tokens, media) -> tuple:
    """An entry's (or a prompt's) keys: `tokens`, the first position of each medium of `media`
    (spans.media_keys) replaced by (kind, hash, span length)."""
    keys = list(tokens)
    for kind, start, end, h in media:
        if start < len(keys):
            keys[start] = (kind, h, end - start)
    return tuple(keys)


def prompt_keys(inputs) -> tuple:
    return index_keys(np.asarray(inputs["input_ids"])[0].tolist(), media_keys(inputs))


def _common(a: tuple, b: tuple) -> int:
    """Length of the common prefix of two tuples (slice comparisons run in C)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class _Node:
    __slots__ = ("label", "children", "entries", "ending")

    def __init__(self, label: tuple):
        self.label = label  # the keys on the edge into this node
        self.children = {}  # first key of a child's label → child
        self.entries = set()  # ids of the entries whose keys pass through or end at this node
        self.ending = set()  # ids of the entries whose keys end exactly here


class PrefixIndex:
    """A radix tree of key sequences (index_keys), each held by one or more entry ids."""

    def __init__(self):
        self.root = _Node(())

    def longest(self, keys: tuple) -> Tuple[int, Optional[int]]:
        """(n, entry id): the longest common prefix of `keys` with any held sequence, and an entry
        holding such a prefix; (0, None) when nothing shares a first key."""
        node, depth, best = self.root, 0, None
        while depth < len(keys):
            child = node.children.get(keys[depth])
            if child is None:
                break
            j = _common(child.label, keys[depth:depth + len(child.label)])
            depth += j
            best = child
            if j < len(child.label):
                break
            node = child
        return (depth, next(iter(best.entries))) if best is not None else (0, None)

    def add(self, keys: tuple, eid: int) -> list:
        """Hold `keys` under `eid`; returns the ids of entries whose keys are a prefix of them."""
        node, depth, prefixes = self.root, 0, []
        node.entries.add(eid)
        while depth < len(keys):
            child = node.children.get(keys[depth])
            if child is None:
                child = _Node(keys[depth:])
                node.children[keys[depth]] = child
                child.entries.add(eid)
                node, depth = child, len(keys)
                break
            j = _common(child.label, keys[depth:depth + len(child.label)])
            if j < len(child.label):  # split the edge where the keys part
                middle = _Node(child.label[:j])
                middle.entries = set(child.entries)
                child.label = child.label[j:]
                middle.children[child.label[0]] = child
                node.children[keys[depth]] = middle
                child = middle
            child.entries.add(eid)
            depth += j
            node = child
            prefixes += node.ending
        node.ending.add(eid)
        return [e for e in prefixes if e != eid]

    def remove(self, keys: tuple, eid: int):
        node, depth, path = self.root, 0, []
        node.entries.discard(eid)
        while depth < len(keys):
            child = node.children[keys[depth]]
            path.append((node, child))
            child.entries.discard(eid)
            depth += len(child.label)
            node = child
        node.ending.discard(eid)
        for parent, child in reversed(path):  # prune branches no entry holds any more
            if not child.entries:
                del parent.children[child.label[0]]


@dataclass
class _Entry:
    tokens: List[int]
    media: list  # spans.media_keys of the tokens
    keys: tuple
    caches: list
    nbytes: int
    index: Optional[tuple] = None  # the index it is in: None (float) or (bits, group size, start)


def _index_of(caches, kv) -> Optional[tuple]:
    kind = caches[0].kind
    return None if kind is None else (*kind, kv.start)


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
    """KV caches of finished requests (batch 1, sized to the tokens they hold), least recently
    used first out when over `max_bytes`. `lookup` returns the longest reusable prefix of a request.

    On several ranks every rank must keep and evict the same entries (a rank reusing a shorter
    prefix would prefill more tokens and pair its collectives wrongly), so an entry counts its
    bytes × `scale` (num, den): pipeline_scale(model), equal on every rank."""

    def __init__(self, max_bytes: int, scale=(1, 1), disk=None):
        self.max_bytes = max_bytes
        self.scale = scale
        self.disk = disk  # disk.DiskTier: the second tier, or None
        self.entries: "OrderedDict[int, _Entry]" = OrderedDict()
        self.indexes = {None: PrefixIndex()}  # per kind of cache (see the module docstring)
        self.nbytes = 0
        self._next = 0
        self.hits = self.misses = self.reused_tokens = 0

    @property
    def index(self) -> PrefixIndex:
        """The float entries' index."""
        return self.indexes[None]

    def lookup(self, inputs, kv=FLOAT):
        """(entry id, reusable length) of an entry that serves the most of the prompt `inputs`
        for a request whose cache follows `kv` (KVSettings; see the module docstring), never its
        last token (its logits start the answer) and never into an image or video; or (None, 0)."""
        if not self.entries and self.disk is None:
            return None, 0
        keys = prompt_keys(inputs)[:-1]
        spans = media_spans(inputs)

        def usable(n, cap, floor):
            n = min(n, cap)
            for m in spans:
                if m.start < n < m.end:
                    return m.start if m.start >= floor else 0
            return n if n >= floor else 0

        float_cap = kv.start if kv.quantized else len(keys)
        best, best_n = self._memory(keys, kv, usable, float_cap)
        if self.disk is not None:
            found, n = self._disk(keys, kv, usable, float_cap)
            if n > best_n:
                loaded = self.disk.load(found)
                eid = self._insert(*loaded, self.disk.kv) if loaded is not None else None
                if eid is not None:
                    best, best_n = eid, n
        if best is None:
            return None, 0
        self.entries.move_to_end(best)
        return best, best_n

    def _memory(self, keys, kv, usable, float_cap):
        """(entry id, n) of the memory tier's best entry for `keys` (None, 0)."""
        best, best_n = None, 0
        choices = [(None, float_cap, 1)]
        if kv.quantized:
            choices.append(((*kv.kind, kv.start), len(keys), max(1, kv.start)))
        for key, cap, floor in choices:
            index = self.indexes.get(key)
            if index is not None:
                n, eid = index.longest(keys)
                n = usable(n, cap, floor)
                if n > best_n:
                    best, best_n = eid, n
        return best, best_n

    def _disk(self, keys, kv, usable, float_cap):
        """(file name, n) of the disk tier's best entry for `keys` (None, 0): float entries serve
        any request (up to its kv.start), quantized ones only requests of the tier's settings."""
        best, best_n = None, 0
        choices = [(False, float_cap, 1)]
        if kv.quantized and kv.kind == self.disk.kv.kind and kv.start == self.disk.kv.start:
            choices.append((True, len(keys), max(1, kv.start)))
        for quantized, cap, floor in choices:
            n, name = self.disk.longest(keys, quantized)
            n = usable(n, cap, floor)
            if n > best_n:
                best, best_n = name, n
        return best, best_n

    def take(self, eid, length: int):
        """New batch-1 caches holding the entry's first `length` positions."""
        self.hits += 1
        self.reused_tokens += length
        return [c.extract(0, length) for c in self.entries[eid].caches]

    def insert(self, tokens: List[int], media: list, caches, kv=FLOAT):
        """Keep `caches` (batch 1, holding `tokens` first, made under KVSettings `kv`) as an entry,
        copied to exactly that many positions. Nothing is kept when an entry already holds all of
        it (or, quantized, when it holds fewer than kv.start positions); entries it extends go.
        The disk tier gets it too (at its next flush) when it is float or of the tier's settings."""
        eid = self._insert(tokens, media, caches, kv)
        if eid is not None and self.disk is not None:
            e = self.entries[eid]
            kind = e.caches[0].kind
            if kind is None or (kind == self.disk.kv.kind and kv.start == self.disk.kv.start):
                self.disk.queue(e.tokens, e.media, e.caches)

    def flush(self):
        """Write the entries queued for the disk tier (the engine calls it when idle)."""
        if self.disk is not None and self.disk.pending:
            self.disk.flush()

    def _insert(self, tokens, media, caches, kv) -> Optional[int]:
        if not tokens or caches[0].empty():
            return None
        n = len(tokens)
        where = _index_of(caches, kv)
        if where is not None and n < kv.start:
            return None  # no request could reuse it (see lookup)
        index = self.indexes.setdefault(where, PrefixIndex())
        keys = index_keys(tokens, media)
        held, _ = index.longest(keys)
        if held == len(keys):
            return None  # an entry already holds all of it
        caches = [c if c.size() == c.capacity() == n and c.batch_size == 1 and not any(c.padding())
                  else c.extract(0, n) for c in caches]
        mx.async_eval([c.state[:2] for c in caches])  # the copy runs beside the next step, not in its way
        num, den = self.scale
        nbytes = cache_bytes(caches) * num // den
        if nbytes > self.max_bytes:
            return None
        eid = self._next
        self._next += 1
        self.entries[eid] = _Entry(list(tokens), list(media), keys, caches, nbytes, where)
        self.nbytes += nbytes
        for old in index.add(keys, eid):
            self._drop(old)  # entries this one extends are redundant
        while self.nbytes > self.max_bytes:
            self._drop(next(iter(self.entries)))
        return eid if eid in self.entries else None

    def _drop(self, eid):
        entry = self.entries.pop(eid)
        self.indexes[entry.index].remove(entry.keys, eid)
        self.nbytes -= entry.nbytes

    def stats(self) -> dict:
        out = {"entries": len(self.entries), "bytes": self.nbytes, "max_bytes": self.max_bytes,
               "hits": self.hits, "misses": self.misses, "reused_tokens": self.reused_tokens}
        if self.disk is not None:
            out["disk"] = self.disk.stats()
        return out


class FeatureCache:
    """Vision features (merged embeddings and DeepStack taps) per image / video content hash, so a
    screenshot seen again outside a reusable prefix (a sliding history window) skips the vision
    tower. LRU within `max_bytes`.

    `keep=False` (a pipeline stage without the vision tower, whose features are placeholder
    zeros): no arrays are kept, but the same hashes and byte counts are, so its hits and misses,
    and with them the prefill items it plans, stay those of the stage that has the tower."""

    def __init__(self, max_bytes: int, keep: bool = True):
        self.max_bytes = max_bytes
        self.keep = keep
        self.items: "OrderedDict[str, list]" = OrderedDict()
        self.sizes: "OrderedDict[str, int]" = OrderedDict()
        self.nbytes = 0
        self.hits = self.misses = 0

    NOT_KEPT = ()  # what `get` returns for a hit when no arrays are kept

    def get(self, h) -> Optional[List[mx.array]]:
        """The features stored for `h`, NOT_KEPT for a hit of a cache that keeps none, or None."""
        if h not in self.sizes:
            self.misses += 1
            return None
        self.hits += 1
        self.sizes.move_to_end(h)
        if not self.keep:
            return self.NOT_KEPT
        self.items.move_to_end(h)
        return self.items[h]

    def put(self, h, arrays: List[mx.array]):
        size = sum(a.nbytes for a in arrays)
        if size > self.max_bytes or h in self.sizes:
            return
        self.sizes[h] = size
        if self.keep:
            self.items[h] = arrays
        self.nbytes += size
        while self.nbytes > self.max_bytes:
            old, n = self.sizes.popitem(last=False)
            self.items.pop(old, None)
            self.nbytes -= n

    def stats(self) -> dict:
        return {"entries": len(self.items), "bytes": self.nbytes if self.keep else 0, "max_bytes": self.max_bytes,
                "hits": self.hits, "misses": self.misses}
