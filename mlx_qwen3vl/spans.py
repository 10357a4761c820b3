"""Where each image and video lies in a prompt, what it is, and how much of a prompt a cache can
serve: media spans (token ranges and pixel rows, from the grid metadata, beside positions.py),
content hashes of their pixels, and `reusable_prefix`, the rule every KV cache that keeps
(tokens, media) pairs follows (prompt_cache.PromptCache, the engine's prefix cache).

Same-size images expand to identical placeholder tokens, so token ids alone cannot tell a new
screenshot from the old one. A cache therefore records a content hash of each image and video
(of the preprocessed pixels and grid: the same screenshot resent as PNG or JPEG of equal pixels
still matches), and the reusable prefix ends before the first one whose hash differs.
"""

from dataclasses import dataclass
from typing import List, Optional

import numpy as np
from blake3 import blake3

from .errors import InputError
from .positions import IMAGE, TEXT, VIDEO

_PIXELS = {IMAGE: ("pixel_values", "image_grid_thw"), VIDEO: ("pixel_values_videos", "video_grid_thw")}


@dataclass(frozen=True)
class MediaSpan:
    """One image or video of a prompt: its token span (a video's spans the timestamps between its
    frame groups too) and its rows of pixel_values / pixel_values_videos."""

    kind: int  # positions.IMAGE or positions.VIDEO
    index: int  # among the prompt's images, or among its videos
    start: int
    end: int
    rows: tuple  # (first, last + 1)


def _runs(types: np.ndarray):
    """[(kind, start, end)] of each run of image / video placeholder tokens."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], types, [0]])) != 0)
    return [(int(types[s]), int(s), int(e)) for s, e in zip(edges[:-1], edges[1:]) if types[s] != TEXT]


def media_spans(inputs) -> List[MediaSpan]:
    """The images and videos of a one-sequence prompt, in token order."""
    types = np.asarray(inputs["mm_token_type_ids"])[0]
    grids = {k: np.asarray(inputs[g]) if g in inputs else np.zeros((0, 3), int) for k, (_, g) in _PIXELS.items()}
    runs_left = {IMAGE: [1] * len(grids[IMAGE]), VIDEO: [int(t) for t in grids[VIDEO][:, 0]]}  # runs per item
    rows = {k: np.concatenate([[0], np.cumsum(g.prod(-1))]).astype(int) for k, g in grids.items()}
    spans, current = [], {IMAGE: 0, VIDEO: 0}
    opened = {}
    for kind, s, e in _runs(types):
        i = current[kind]
        if i >= len(runs_left[kind]):
            raise InputError(f"the prompt has more {'image' if kind == IMAGE else 'video'} placeholders than media")
        first = opened.setdefault(kind, s)
        runs_left[kind][i] -= 1
        if runs_left[kind][i] == 0:  # the item's last run (a video has one per frame group)
            spans.append(MediaSpan(kind, i, first, e, (int(rows[kind][i]), int(rows[kind][i + 1]))))
            current[kind] += 1
            del opened[kind]
    return sorted(spans, key=lambda m: m.start)


def content_hash(pixels: np.ndarray, grid) -> str:
    """A cryptographic digest of one image's or video's preprocessed pixels and grid (a collision
    would serve another image's keys and values, so a fast non-cryptographic hash will not do).
    BLAKE3 (SIMD, multi-threaded) keeps it a small share of preprocessing (benchmarks/README.md,
    "Content hashes for prefix reuse")."""
    h = blake3(max_threads=blake3.AUTO)
    h.update(np.asarray(grid, dtype=np.int64).tobytes())
    h.update(str(pixels.dtype).encode())
    h.update(memoryview(np.ascontiguousarray(pixels)).cast("B"))
    return h.hexdigest()


def media_hashes(inputs, spans: Optional[List[MediaSpan]] = None) -> List[str]:
    """content_hash of each span's media (computed once per inputs dict, under "media_hashes")."""
    if "media_hashes" not in inputs:
        spans = media_spans(inputs) if spans is None else spans
        out = []
        for m in spans:
            px, grid = _PIXELS[m.kind]
            out.append(content_hash(np.asarray(inputs[px])[m.rows[0]:m.rows[1]], np.asarray(inputs[grid])[m.index]))
        inputs["media_hashes"] = out
    return inputs["media_hashes"]


def media_keys(inputs, upto: Optional[int] = None) -> list:
    """[(kind, start, end, hash)] of the media that lie wholly before token `upto`."""
    spans = media_spans(inputs)
    hashes = media_hashes(inputs, spans)
    return [(m.kind, m.start, m.end, h) for m, h in zip(spans, hashes) if upto is None or m.end <= upto]


def reusable_prefix(tokens: List[int], media: list, inputs) -> int:
    """How many leading tokens of the prompt `inputs` a cache holding `tokens` (with the media
    `media`, as media_keys gives them) can serve: the common token prefix, leaving at least one
    token to compute (its logits start the answer), cut before the first image or video that is
    not the same content at the same place, and never inside one."""
    from mlx_lm.utils import common_prefix_len

    n = common_prefix_len(list(tokens), np.asarray(inputs["input_ids"])[0, :-1].tolist())
    held = {key[:3]: key[3] for key in media}
    spans = media_spans(inputs)
    if not any(m.start < n for m in spans):
        return n
    for m, h in zip(spans, media_hashes(inputs, spans)):
        if m.start >= n:
            break
        if m.end > n or held.get((m.kind, m.start, m.end)) != h:
            return m.start
    return n


def media_after(inputs, start: int) -> dict:
    """Pixel rows and grids of the images / videos that begin at or after token `start` (the ones
    a prefill from `start` must encode; a reusable prefix never ends inside one)."""
    if not start:
        return {k: inputs[k] for names in _PIXELS.values() for k in names if k in inputs}
    out = {}
    for kind, (px, grid) in _PIXELS.items():
        later = [m for m in media_spans(inputs) if m.kind == kind and m.start >= start]
        if later:
            out[px] = np.asarray(inputs[px])[later[0].rows[0]:]
            out[grid] = np.asarray(inputs[grid])[later[0].index:]
    return out
