"""Reuse across turns: a KV cache that remembers which tokens *and which images and videos* it
holds, and multi-turn chats on top of it. The rule for how much of a new prompt it can serve
(`reusable_prefix`, by tokens and media content hashes) lives in spans.py, re-exported here.
"""

import re
from dataclasses import dataclass, field
from typing import Iterator, List

import numpy as np

from .positions import IMAGE, VIDEO
from .processor import VISION_TOKENS
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


# ---------------------------------------------------------------------------------------------
# Multi-turn chats
# ---------------------------------------------------------------------------------------------
TURN_SETTINGS = ("video_fps", "min_pixels", "max_pixels", "sample_frames")


def _concat_inputs(parts: list) -> dict:
    out = {}
    for key in ("input_ids", "attention_mask", "mm_token_type_ids"):
        out[key] = np.concatenate([p[key] for p in parts], axis=1)
    for px, grid in _PIXELS.values():
        held = [p for p in parts if grid in p]
        if held:
            out[px] = np.concatenate([p[px] for p in held])
            out[grid] = np.concatenate([p[grid] for p in held])
    out["media_hashes"] = [h for p in parts for h in media_hashes(p)]
    return out


class ChatSession:
    """A multi-turn conversation that keeps its KV cache between turns: an agent that sends a new
    screenshot each turn pays for that screenshot and the new text only.

    Whatever shaped a turn's media (`video_fps`, `min_pixels`, `max_pixels`, `sample_frames`)
    stays with that turn: each turn's images and videos are processed once, with its settings, and
    reused as they are by every later turn. Every turn answers as `generate(messages=history)`
    would, with each turn's media processed with its own settings."""

    def __init__(self, model, processor, system=None, **defaults):
        self.model, self.processor = model, processor
        self.messages = [{"role": "system", "content": system}] if system else []
        self.settings = [None] * len(self.messages)  # per message: the settings its media were processed with
        self.prompt_cache = PromptCache(model.make_cache())
        self.defaults = {k: defaults.pop(k) for k in TURN_SETTINGS if k in defaults}
        self.generation_kwargs = defaults
        self.last = None  # the last GenerationResponse
        self._parts = []  # [(key, processed inputs)] per rendered chunk, reused while unchanged

    def _chunk_inputs(self, chunk, media, settings):
        key = (chunk, tuple(id(m) for _, m in media), tuple(sorted(settings.items())))
        for k, part in self._parts:
            if k == key:
                return key, part
        images = [m for kind, m in media if kind == IMAGE]
        videos = [m for kind, m in media if kind == VIDEO]
        part = self.processor(text=chunk, images=images or None, videos=videos or None, **settings)
        media_hashes(part)
        return key, part

    def encode(self) -> dict:
        """The whole conversation as model inputs. The rendered prompt is cut before every
        `<|im_start|>` (a special token, so the pieces tokenize exactly as the whole does), and each
        piece is processed with the settings of the turn its media belong to."""
        from .processor import extract_media

        items = []  # (kind, media, settings) in conversation order
        for message, settings in zip(self.messages, self.settings):
            found_images, found_videos = extract_media([message])
            order = [b.get("type") for b in message["content"]] if isinstance(message["content"], list) else []
            it_i, it_v = iter(found_images), iter(found_videos)
            for kind in order:
                if kind in ("image", "image_url"):
                    items.append((IMAGE, next(it_i), settings))
                elif kind == "video":
                    items.append((VIDEO, next(it_v), settings))
        text = self.processor.apply_chat_template(self.messages, add_generation_prompt=True, tokenize=False)
        chunks = [c for c in re.split(r"(?=<\|im_start\|>)", text) if c]
        parts, pos = [], 0
        image_token, video_token = self.processor.image_token, self.processor.video_token
        for chunk in chunks:
            n = chunk.count(image_token) + chunk.count(video_token)
            media = [(kind, m) for kind, m, _ in items[pos:pos + n]]
            settings = {k: v for k, v in (items[pos][2] if n else {}).items() if v is not None}
            parts.append(self._chunk_inputs(chunk, media, settings))
            pos += n
        self._parts = parts
        return _concat_inputs([p for _, p in parts])

    def stream(self, text, images=None, videos=None, *, video_fps=None, min_pixels=None, max_pixels=None,
               sample_frames=None, **kwargs) -> Iterator:
        from .generate import stream_generate

        content = [{"type": "image", "image": im} for im in images or []]
        content += [{"type": "video", "video": v} for v in videos or []]
        content.append({"type": "text", "text": text})
        given = dict(video_fps=video_fps, min_pixels=min_pixels, max_pixels=max_pixels, sample_frames=sample_frames)
        settings = {k: given[k] if given[k] is not None else self.defaults.get(k) for k in TURN_SETTINGS}
        self.messages.append({"role": "user", "content": content})
        self.settings.append(settings)
        answer, done = "", False
        try:
            inputs = self.encode()
            for piece in stream_generate(self.model, self.processor, inputs=inputs, prompt_cache=self.prompt_cache,
                                         **{**self.generation_kwargs, **kwargs}):
                answer += piece.text
                self.last = piece
                yield piece
            done = True
        finally:
            if done:
                # A vision marker in the answer (random or confused weights emit them) would read as
                # a media slot when the history is rendered again; the history keeps the text around it.
                for token in VISION_TOKENS:
                    answer = answer.replace(token, "")
                self.messages.append({"role": "assistant", "content": answer})
                self.settings.append(None)
            else:  # a failed or abandoned turn leaves the conversation as it was
                self.messages.pop()
                self.settings.pop()

    def send(self, text, images=None, videos=None, **kwargs) -> str:
        return "".join(p.text for p in self.stream(text, images, videos, **kwargs))
