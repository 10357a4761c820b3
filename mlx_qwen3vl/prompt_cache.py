"""Reuse across turns: a KV cache that remembers which tokens *and which images and videos* it
holds. The rule for how much of a new prompt it can serve (`reusable_prefix`, by tokens and media
content hashes) lives in spans.py, re-exported here; multi-turn chats on top of it in
chat_session.py.
"""

from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np

from .kv_settings import FLOAT, KVSettings

from .spans import (_PIXELS, MediaSpan, content_hash, media_after, media_hashes, media_keys,  # noqa: F401
                    media_spans, reusable_prefix)


@dataclass
class PromptCache:
    """A KV cache plus what it holds: token ids and the media among them (batch 1), kept between
    turns of one conversation. Pass it to generate / stream_generate as `prompt_cache=`."""

    cache: list
    tokens: List[int] = field(default_factory=list)
    media: list = field(default_factory=list)  # media_keys of the held prompt
    kv: Optional[KVSettings] = None  # the KV settings the cache was made with

    def trim(self, keep: int):
        """Drop everything after the first `keep` tokens."""
        if self.cache and self.cache[0].size() > keep:
            for c in self.cache:
                c.trim_to(keep)
        self.tokens = self.tokens[:keep]
        self.media = [key for key in self.media if key[2] <= keep]

    def reuse(self, inputs, kv: KVSettings = FLOAT, make_cache=None) -> int:
        """Trim to the prefix `inputs` can reuse (see reusable_prefix) for a turn whose cache
        follows `kv`, and return its length. A quantized cache serves only the same settings and
        from kv.start positions on (before them a fresh run's cache is float); for a quantized
        turn a float one serves up to kv.start. A quantized cache that cannot serve is replaced by
        `make_cache()` (the model's make_cache)."""
        keep = reusable_prefix(self.tokens, self.media, inputs)
        kind = self.cache[0].kind if self.cache else None
        if kind is not None and (kind != kv.kind or self.kv is None or self.kv.start != kv.start
                                 or keep < kv.start):
            keep = 0
        elif kind is None and kv.quantized and keep > kv.start:
            keep = kv.start
            for m in media_spans(inputs):  # never into an image or video
                if m.start < keep < m.end:
                    keep = m.start
                    break
        self.trim(keep)
        if keep == 0 and kind is not None and make_cache is not None:
            self.cache = make_cache()
        return keep

    def record(self, inputs, generated: List[int], kv: KVSettings = FLOAT):
        """After a turn: the cache holds the prompt and the answer's tokens but the last, which
        may or may not have been fed (the next turn's template renders it again anyway)."""
        self.tokens = np.asarray(inputs["input_ids"])[0].tolist() + list(generated[:-1])
        self.media = media_keys(inputs)
        self.kv = kv
        self.trim(len(self.tokens))
