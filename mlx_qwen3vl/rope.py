"""Rotary position embeddings: the decoder's interleaved mRoPE and the vision tower's 2D RoPE.

Both rotate with the "rotate half" convention (pairs are (i, i + D/2), not adjacent lanes), which
is mx.fast.rope's `traditional=False`.
"""

import mlx.core as mx


def inverse_frequencies(dim: int, theta: float) -> mx.array:
    # Computed in float32 as transformers does; cos/sin of these are cast afterwards.
    return 1.0 / (theta ** (mx.arange(0, dim, 2, dtype=mx.float32) / dim))


def rotate_half(x: mx.array) -> mx.array:
    half = x.shape[-1] // 2
    return mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rotary(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    return x * cos + rotate_half(x) * sin


class TextRotary:
    """Interleaved mRoPE for the decoder.

    Each token has a (T, H, W) position. With mrope_section = [24, 20, 20] the 64 frequencies are
    shared out *interleaved*: H owns indices 1, 4, 7, ..., 58, W owns 2, 5, 8, ..., 59 and T owns
    the rest (0, 3, ..., 57 and 60..63). Qwen2.5-VL used contiguous chunks instead; Qwen3-VL
    interleaves so every axis sees both high and low frequencies.

    Text tokens have T = H = W, so for them every frequency sees the same position and mRoPE is
    exactly plain 1D RoPE: a text-only chunk (decode, or text after the prompt) needs only each
    sequence's first position, and is rotated by mx.fast.rope (one fused kernel on a GPU) with
    transformers' float32 frequencies, so it equals the tables to the bit. General mRoPE builds
    cos/sin tables once per forward, shared by every layer.
    """

    def __init__(self, head_dim: int, theta: float, mrope_section):
        self.head_dim = head_dim
        self.theta = float(theta)
        self.section = list(mrope_section)
        self.inv_freq = inverse_frequencies(head_dim, theta)
        self.periods = 1.0 / self.inv_freq  # mx.fast.rope's `freqs`

    def cos_sin(self, position_ids: mx.array, length: int, dtype=mx.float32):
        """cos, sin of shape (B, 1, L, head_dim), ready to broadcast over heads, for position_ids
        (3, B, L) — general mRoPE — or (B,) — the 1D position of each sequence's first token in a
        text-only chunk of `length` consecutive positions (T = H = W)."""
        if position_ids.ndim == 1:
            positions = position_ids[:, None] + mx.arange(length)
            merged = positions.astype(mx.float32)[..., None] * self.inv_freq  # (B, L, D/2)
        else:
            freqs = position_ids.astype(mx.float32)[..., None] * self.inv_freq  # (3, B, L, D/2)
            merged = freqs[0]
            for axis in (1, 2):  # H at 1::3, W at 2::3, each for `section[axis]` frequencies
                end = 3 * self.section[axis]
                merged[..., axis:end:3] = freqs[axis][..., axis:end:3]
        emb = mx.concatenate([merged, merged], axis=-1)[:, None]
        return mx.cos(emb).astype(dtype), mx.sin(emb).astype(dtype)

    def __call__(self, position_ids: mx.array, length: int, dtype=mx.float32):
        """The rotation of (B, heads, L, head_dim) queries or keys at these positions (as cos_sin)."""
        if position_ids.ndim == 1:
            return lambda x: mx.fast.rope(x, self.head_dim, traditional=False, base=None, scale=1.0,
                                          offset=position_ids, freqs=self.periods)
        cos, sin = self.cos_sin(position_ids, length, dtype)
        return lambda x: apply_rotary(x, cos, sin)


class VisionRotary:
    """2D RoPE of the vision tower: a quarter of the head dim's frequencies for rows, a quarter for
    columns, [h | w] concatenated and then duplicated for the rotate-half pairs."""

    def __init__(self, head_dim: int, theta: float = 10000.0):
        self.inv_freq = inverse_frequencies(head_dim // 2, theta)

    def cos_sin(self, hw_positions: mx.array):
        """hw_positions (N, 2) int -> cos, sin of shape (N, 1, head_dim)."""
        freqs = hw_positions.astype(mx.float32)[..., None] * self.inv_freq  # (N, 2, D/4)
        freqs = freqs.reshape(freqs.shape[0], -1)  # [h freqs | w freqs]
        emb = mx.concatenate([freqs, freqs], axis=-1)[:, None]
        return mx.cos(emb), mx.sin(emb)
