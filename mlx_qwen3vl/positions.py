"""3D (T, H, W) positions for the decoder's mRoPE, computed on the host from input metadata.

- Text advances every axis by 1.
- An image of (t, h, w) merged tokens starting at `start` gets T = start + frame, H = start + row,
  W = start + col; the text after it resumes at start + max(h, w).
- Videos are split per temporal patch (each frame group has its own `<x.y seconds>` text and
  vision start/end tokens), so each group is an image with t = 1.
- Padding (attention_mask == 0) gets position 0 on all axes.
- rope_delta = max position + 1 - number of real tokens: decode continues at cache offset + delta.
"""

import itertools

import numpy as np

TEXT, IMAGE, VIDEO = 0, 1, 2


def _np(x, dtype=np.int64):
    if x is None:
        return None
    return np.asarray(x).astype(dtype)


def vision_position_ids(start: int, grid_thw, spatial_merge_size: int) -> np.ndarray:
    t, h, w = int(grid_thw[0]), int(grid_thw[1]) // spatial_merge_size, int(grid_thw[2]) // spatial_merge_size
    tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
    return np.stack([tt, hh, ww]).reshape(3, -1) + start


def get_rope_index(
    input_ids,
    mm_token_type_ids,
    image_grid_thw=None,
    video_grid_thw=None,
    attention_mask=None,
    spatial_merge_size: int = 2,
):
    """Returns (position_ids (3, B, L) int64, rope_deltas (B, 1) int64), as transformers does."""
    input_ids = _np(input_ids)
    types = _np(mm_token_type_ids)
    if types is None:
        types = np.zeros_like(input_ids)
    attention_mask = _np(attention_mask)
    grids = {IMAGE: iter(_np(image_grid_thw) if image_grid_thw is not None else [])}
    videos = _np(video_grid_thw)
    if videos is not None:  # one entry per temporal patch, each with t = 1
        videos = np.repeat(videos, videos[:, 0], axis=0)
        videos[:, 0] = 1
    grids[VIDEO] = iter(videos if videos is not None else [])

    B, L = input_ids.shape
    position_ids = np.zeros((3, B, L), dtype=np.int64)
    deltas = np.zeros((B, 1), dtype=np.int64)
    for b in range(B):
        keep = attention_mask[b].astype(bool) if attention_mask is not None else np.ones(L, bool)
        row_types = types[b][keep]
        pieces, pos = [], 0
        for kind, group in itertools.groupby(row_types.tolist()):
            n = len(list(group))
            if kind == TEXT:
                pieces.append(np.broadcast_to(np.arange(n) + pos, (3, n)))
                pos += n
                continue
            try:
                grid = next(grids[kind])
            except StopIteration:
                from .errors import InputError

                name = "image_grid_thw" if kind == IMAGE else "video_grid_thw"
                raise InputError(f"{name} has fewer entries than the prompt's vision placeholders") from None
            block = vision_position_ids(pos, grid, spatial_merge_size)
            if block.shape[1] != n:
                from .errors import InputError

                raise InputError(
                    f"a run of {n} vision placeholder tokens does not match its grid {tuple(int(g) for g in grid)} "
                    f"({block.shape[1]} tokens): build input_ids and grids with the same processor call"
                )
            pieces.append(block)
            pos += max(int(grid[1]), int(grid[2])) // spatial_merge_size
        llm = np.concatenate(pieces, axis=1) if pieces else np.zeros((3, 0), np.int64)
        position_ids[:, b, keep] = llm
        deltas[b, 0] = (llm.max() + 1 if llm.size else 0) - int(keep.sum())
    return position_ids, deltas


def mm_token_type_ids_from(input_ids, image_token_id: int, video_token_id: int) -> np.ndarray:
    """The processor's mm_token_type_ids, rebuilt from placeholder ids when a caller lacks them."""
    ids = _np(input_ids)
    return (ids == image_token_id) * IMAGE + (ids == video_token_id) * VIDEO
