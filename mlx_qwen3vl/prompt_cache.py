"""Reuse across turns: a KV cache that remembers which tokens *and which images and videos* it
holds. The rule for how much of a new prompt it can serve (`reusable_prefix`, by tokens and media
content hashes) lives in spans.py, re-exported here; multi-turn chats on top of it in
chat_session.py.
"""

from dataclasses import dataclass, field
from typing import List

import numpy as np

from .spans import (_PIXELS, MediaSpan, content_hash, media_after, media_hashes, media_keys,  # noqa: F401
                    media_spans, reusable_prefix)


@dataclass
class PromptCache:
    """A KV cache plus what it holds: token ids and the media among them (batch 1), kept between
    turns of one conversation. Pass it to generate / stream_generate as `prompt_cache=`."""

    cache: list
    tokens: List[int] = field(default_factory=list)
    media: list = field(default_factory=list)  # media_keys of the held prompt

    def trim(self, keep: int):
        """Drop everything after the first `keep` tokens."""
        drop = self.cache[0].size() - keep if self.cache else 0
        if drop > 0:
            for c in self.cache:
                c.trim(drop)
        self.tokens = self.tokens[:keep]
        self.media = [key for key in self.media if key[2] <= keep]

    def reuse(self, inputs) -> int:
        """Trim to the prefix `inputs` can reuse (see reusable_prefix) and return its length."""
        keep = reusable_prefix(self.tokens, self.media, inputs)
        self.trim(keep)
        return keep

    def record(self, inputs, generated: List[int]):
        """After a turn: the cache holds the prompt and the answer's tokens but the last, which
        may or may not have been fed (the next turn's template renders it again anyway)."""
        self.tokens = np.asarray(inputs["input_ids"])[0].tolist() + list(generated[:-1])
        self.media = media_keys(inputs)
        self.trim(len(self.tokens))
