"""Attention in bounded memory: MLX's scaled_dot_product_attention over query chunks wherever its
fused kernel would not run and the whole score matrix would be materialised.

Metal's fused kernel covers head dims 64, 80 and 128; elsewhere (the CPU device, the 72-wide
heads of the 4B/8B/30B vision towers on a Mac) MLX computes heads × queries × keys scores and
their softmax as whole arrays: one 1080p screenshot is 16 × 8160² floats per vision layer. Each
query's row of the softmax sees the same keys in any split of the queries, so chunking is exact
up to float summation order.

On the CPU device MLX runs that unfused path as plain ops, one thread each; `attend` runs the same
ops over blocks of heads, each block's softmax on a CPU stream of its own (spread.py), so both
cores share the exps that dominate it.
"""

import mlx.core as mx

from . import spread

# The most bytes the scores and probabilities of one query chunk may hold (override per call
# with `budget`, or set this module default).
SCORE_BUDGET = 1 << 29
# A decoder prompt's chunks, less: evaluated with the lazy work of their layer and those before
# it, their scores share the peak with more than a vision window's do (one 1080p screenshot's
# prompt on h-mid: 4.13 GB at SCORE_BUDGET, 3.86 GB at this; no slower). Vision windows keep
# SCORE_BUDGET: halving theirs cost ~12% of their attention's time on the CPU.
PROMPT_BUDGET = 1 << 28
FUSED_HEAD_DIMS = (64, 80, 128)  # mx.fast's Metal kernel for many queries


def fused(q) -> bool:
    """Whether MLX runs its fused kernel for queries q (B, H, L, D), never holding the scores."""
    return q.shape[-1] in FUSED_HEAD_DIMS and mx.default_device().type == mx.DeviceType.gpu and mx.metal.is_available()


def query_chunk(q, k, budget=None) -> int:
    """Queries per chunk so that one chunk's scores and softmax (float32) fit in `budget` bytes."""
    B, H, _, _ = q.shape
    per_query = B * H * k.shape[2] * 4 * 2
    return max(1, int(SCORE_BUDGET if budget is None else budget) // per_query)


def scaled_dot_product_attention(q, k, v, scale, mask=None, budget=None):
    """mx.fast.scaled_dot_product_attention of q (B, H, L, D), k / v (B, Hkv, S, D) with mask None,
    "causal" (lower-right aligned, as with a KV cache) or an array (..., L, S), in query chunks
    holding at most `budget` bytes of scores (default SCORE_BUDGET) where no fused kernel runs."""
    L, S = q.shape[2], k.shape[2]
    rows = query_chunk(q, k, budget)
    if rows >= L or fused(q):
        return attend(q, k, v, scale, mask)
    outs = []
    for a in range(0, L, rows):
        b = min(L, a + rows)
        if isinstance(mask, str):  # causal: this chunk's last query sees keys up to S - L + b
            ks, vs, m = k[:, :, : S - L + b], v[:, :, : S - L + b], mask
        else:
            ks, vs = k, v
            m = mask[..., a:b, :] if mask is not None and mask.shape[-2] == L else mask
        outs.append(attend(q[:, :, a:b], ks, vs, scale, m))
        # Evaluated one by one: in one lazy graph MLX dispatches several chunks ahead of the
        # computation and holds all their scores at once.
        mx.eval(outs[-1])
    return mx.concatenate(outs, axis=2)


def attend(q, k, v, scale, mask=None):
    """mx.fast.scaled_dot_product_attention; on the CPU device, for many scores, the ops of its
    fallback there (mlx/fast.cpp) over blocks of the batch (or, for one sequence, of the kv
    heads): each block's scores and product with the values on this stream, its softmax on a CPU
    stream of its own, in place as the fallback's is. The same numbers and memory, both cores."""
    B, H, L, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    axis = 0 if B >= spread.PARTS else 1
    cpu = mx.default_device().type == mx.DeviceType.cpu
    if not cpu or B * H * L * S < spread.MIN_ELEMENTS or (B, Hkv)[axis] < 2:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    repeats = H // Hkv
    # (B, Hkv, repeats, L, D) against (B, Hkv, 1, S, D), as the fallback groups heads
    q, k, v = (q * scale).reshape(B, Hkv, repeats, L, D), k[:, :, None], v[:, :, None]
    if isinstance(mask, str):  # "causal", lower-right aligned
        mask = mx.arange(S - L, S)[:, None] >= mx.arange(S)[None]
    elif mask is not None and mask.ndim >= 3:
        one = mask.shape[-3] == 1
        mask = mx.expand_dims(mask, -3) if one else mask.reshape(*mask.shape[:-3], Hkv, repeats, L, S)
    outs = []
    for a, b, stream in spread.blocks((B, Hkv)[axis]):
        block = lambda x: x[a:b] if axis == 0 else x[:, a:b]  # noqa: E731
        scores = block(q) @ block(k).swapaxes(-1, -2)
        if mask is not None:
            m = _block_of(mask, axis, a, b)
            if m.dtype == mx.bool_:
                scores = mx.where(m, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
            else:
                scores = scores + m.astype(scores.dtype)
        with mx.stream(stream):
            probs = _softmax(scores)
        outs.append(probs @ block(v))
    return mx.concatenate(outs, axis=axis).reshape(B, H, L, -1)


def _block_of(mask, axis, a, b):
    """The rows [a, b) along the scores' `axis` of a mask aligned to their 5 axes from the right."""
    i = axis - (5 - mask.ndim)
    if i < 0 or mask.shape[i] == 1:
        return mask
    return mask[(slice(None),) * i + (slice(a, b),)]


def _softmax(scores):
    return mx.softmax(scores, axis=-1, precise=True)
