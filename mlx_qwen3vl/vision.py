"""The Qwen3-VL vision tower: patch embedding, resampled learned positions, 2D RoPE, ViT blocks
with per-image/per-frame attention, the 2x2 patch merger and the DeepStack mergers.

Patches arrive from the processor already flattened as [C, T=2, 16, 16] rows, in 2x2-merge-block
order (the four patches that merge into one LLM token are consecutive). Everything positional
here (learned grid, rotary) is laid out in that same order.
"""

import math
from dataclasses import dataclass
from typing import List, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .attention import scaled_dot_product_attention
from .config import VisionConfig
from .errors import InputError
from .rope import VisionRotary, apply_rotary


def _as_grids(grid_thw):
    return [tuple(int(v) for v in g) for g in np.asarray(grid_thw).reshape(-1, 3)]


def merge_order_rows_cols(h: int, w: int, merge: int):
    """Row and column of every patch of an (h, w) grid, listed in merge-block order."""
    rows = np.arange(h).reshape(h // merge, merge, 1, 1)
    cols = np.arange(w).reshape(1, 1, w // merge, merge)
    rows = np.broadcast_to(rows, (h // merge, merge, w // merge, merge)).transpose(0, 2, 1, 3)
    cols = np.broadcast_to(cols, (h // merge, merge, w // merge, merge)).transpose(0, 2, 1, 3)
    return rows.reshape(-1), cols.reshape(-1)


def _bilinear_taps(index: np.ndarray, size: int, side: int):
    """Two taps and weights per output index resampling a `side`-long axis to `size` samples with
    align_corners=True: the first and last samples land exactly on the table's corner entries.
    float32 throughout, as transformers computes it, so the weights agree to the bit."""
    index = index.astype(np.float32)
    src = index * np.float32(side - 1) / np.float32(max(size - 1, 1))
    floor = np.floor(src)
    taps = np.clip(floor.astype(np.int64)[:, None] + np.arange(2), 0, side - 1)
    weights = np.clip(1 - np.abs(src[:, None] - floor[:, None] - np.arange(2, dtype=np.float32)), 0, None)
    return taps, weights.astype(np.float32)


@dataclass
class VisionLayout:
    """Host-side bookkeeping derived from grid_thw (input metadata, never model outputs)."""

    hw_positions: mx.array  # (N, 2) rotary row/col per patch
    interp_indices: mx.array  # (N, 4) rows of the learned 48x48 grid to blend
    interp_weights: mx.array  # (N, 4)
    segments: list  # [(start, count, length)]: `count` consecutive attention windows of `length`
    merged_sizes: list  # LLM tokens per image/video

    @classmethod
    def from_grids(cls, grid_thw, merge: int, side: int):
        grids = _as_grids(grid_thw)
        hw, idx, wts, segments, sizes = [], [], [], [], []
        start = 0
        for t, h, w in grids:
            rows, cols = merge_order_rows_cols(h, w, merge)
            hw.append(np.tile(np.stack([rows, cols], -1), (t, 1)))
            h_taps, h_w = _bilinear_taps(rows, h, side)
            w_taps, w_w = _bilinear_taps(cols, w, side)
            i = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
            wt = (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4)
            idx.append(np.tile(i, (t, 1)))
            wts.append(np.tile(wt, (t, 1)))
            # Attention never crosses an image or a video frame. Consecutive windows of one
            # length are batched into one call, so cost and memory stay linear in images.
            if segments and segments[-1][2] == h * w and segments[-1][0] + segments[-1][1] * h * w == start:
                s0, c0, l0 = segments[-1]
                segments[-1] = (s0, c0 + t, l0)
            else:
                segments.append((start, t, h * w))
            start += t * h * w
            sizes.append(t * h * w // (merge * merge))
        return cls(
            mx.array(np.concatenate(hw).astype(np.int32)),
            mx.array(np.concatenate(idx).astype(np.int32)),
            mx.array(np.concatenate(wts)),
            segments,
            sizes,
        )


class PatchEmbed(nn.Module):
    """Conv3d with kernel == stride == [2, 16, 16] is one matmul over flattened patches; the
    checkpoint's (E, C, 2, 16, 16) kernel is stored here reshaped to (E, C*2*16*16)."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        in_dim = config.in_channels * config.temporal_patch_size * config.patch_size**2
        self.proj = nn.Linear(in_dim, config.hidden_size, bias=True)

    def __call__(self, x):
        return self.proj(x)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)

    def __call__(self, x, cos, sin, segments):
        q, k, v = self.rotated_qkv(x, cos, sin)
        outs = [self.windows(q, k, v, start, count, length) for start, count, length in segments]
        return self.proj(outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0))

    def rotated_qkv(self, x, cos, sin):
        """x (n, dim) → q, k, v (n, heads, head_dim), q and k rotated (in float32, as transformers)."""
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, self.head_dim).transpose(1, 0, 2, 3)
        q = apply_rotary(q.astype(mx.float32), cos, sin).astype(x.dtype)
        k = apply_rotary(k.astype(mx.float32), cos, sin).astype(x.dtype)
        return q, k, v

    def windows(self, q, k, v, start, count, length, first=0, last=None):
        """Attention within `count` consecutive windows of `length` rows from row `start` of q, k, v
        (rows, heads, head_dim), for the queries [first, last) of each window → (rows, heads *
        head_dim) in row order. A query sees only its own window's keys, so any split of the
        queries gives the same rows."""
        end = start + count * length
        window = lambda a: a[start:end].reshape(count, length, self.num_heads, self.head_dim).transpose(0, 2, 1, 3)
        queries = window(q)
        if first or last is not None:
            queries = queries[:, :, first:last]
        o = self.attend(queries, window(k), window(v))
        return o.transpose(0, 2, 1, 3).reshape(-1, o.shape[1] * o.shape[3])  # heads may be sharded

    def attend(self, q, k, v):
        """Unmasked attention within each window, q (windows, heads, queries, head_dim), k / v
        (windows, heads, length, head_dim), in query chunks of bounded memory (attention.py)."""
        return scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)


def gelu_tanh(x):
    """gelu_pytorch_tanh, in float32 inside as torch computes it."""
    return nn.gelu_approx(x.astype(mx.float32)).astype(x.dtype)


# The blocks' activation, by config name (transformers' ACT2FN names); every published Qwen3-VL,
# dense or MoE, says gelu_pytorch_tanh. The mergers always use the exact GELU (torch nn.GELU()).
ACTIVATIONS = {"gelu_pytorch_tanh": gelu_tanh, "gelu_new": gelu_tanh, "gelu": nn.gelu}


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, hidden_act: str = "gelu_pytorch_tanh"):
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden, bias=True)
        self.linear_fc2 = nn.Linear(hidden, dim, bias=True)
        self.hidden_act = hidden_act

    def __call__(self, x):
        return self.linear_fc2(ACTIVATIONS[self.hidden_act](self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = VisionAttention(config.hidden_size, config.num_heads)
        self.mlp = VisionMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def __call__(self, x, cos, sin, segments):
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Concatenates each 2x2 block of patches into one token and projects it to the LLM width.
    The main merger normalizes each patch before the concat; DeepStack mergers normalize after
    (use_postshuffle_norm), over the concatenated 4*hidden features."""

    def __init__(self, config: VisionConfig, use_postshuffle_norm: bool):
        super().__init__()
        self.merged_dim = config.hidden_size * config.spatial_merge_size**2
        self.use_postshuffle_norm = use_postshuffle_norm
        self.norm = nn.LayerNorm(self.merged_dim if use_postshuffle_norm else config.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged_dim, self.merged_dim, bias=True)
        self.linear_fc2 = nn.Linear(self.merged_dim, config.out_hidden_size, bias=True)

    def __call__(self, x):
        if self.use_postshuffle_norm:
            x = self.norm(x.reshape(-1, self.merged_dim))
        else:
            x = self.norm(x).reshape(-1, self.merged_dim)
        return self.linear_fc2(nn.gelu(self.linear_fc1(x)))


class VisionModel(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.num_grid_per_side = int(math.isqrt(config.num_position_embeddings))
        self.blocks = [VisionBlock(config) for _ in range(config.depth)]
        self.merger = PatchMerger(config, use_postshuffle_norm=False)
        self.deepstack_visual_indexes = list(config.deepstack_visual_indexes)
        self.deepstack_merger_list = [
            PatchMerger(config, use_postshuffle_norm=True) for _ in self.deepstack_visual_indexes
        ]
        self._rotary = VisionRotary(config.hidden_size // config.num_heads, config.rope_theta)

    def layout(self, grid_thw) -> VisionLayout:
        return VisionLayout.from_grids(grid_thw, self.config.spatial_merge_size, self.num_grid_per_side)

    def __call__(self, pixel_values: mx.array, grid_thw):
        """pixel_values (N, C*2*16*16), grid_thw (num_images, 3) ->
        (merged (N/4, out_hidden), [DeepStack features (N/4, out_hidden)] in deepstack index order)."""
        run = self.start(pixel_values, grid_thw)
        for item in vision_items(self.config, grid_thw):
            self.run(run, item)
        return self.finish(run)

    # --- the same forward as work items (vision_plan), for a caller that spreads it over steps ---
    def start(self, pixel_values, grid_thw) -> "VisionRun":
        layout = self.layout(grid_thw)
        if pixel_values.shape[0] != layout.interp_indices.shape[0]:
            raise InputError(
                f"pixel_values has {pixel_values.shape[0]} patches but grid_thw describes "
                f"{layout.interp_indices.shape[0]}: pass the processor's pixel_values and grid together"
            )
        cos, sin = self._rotary.cos_sin(layout.hw_positions)
        return VisionRun(layout, mx.array(pixel_values), cos, sin)

    def run(self, run: "VisionRun", item: "VisionItem") -> list:
        """Do one work item (in plan order); returns the arrays it produced, for the caller to
        evaluate when it wants the work done."""
        phase = (item.stage, item.block)
        if run.phase != phase:
            run.close()
            run.phase = phase
        a, b = item.start, item.end
        if item.stage == "embed":
            dtype = self.patch_embed.proj.weight.dtype
            x = self.patch_embed(run.pixels[a:b].astype(dtype))
            # The 48x48 learned grid resampled (bilinear, align_corners=True) to this image's grid.
            layout = run.layout
            pos = (self.pos_embed.weight[layout.interp_indices[a:b]] * layout.interp_weights[a:b, :, None]).sum(axis=1)
            out = [x + pos.astype(x.dtype)]  # fp32 weights, as transformers
        elif item.stage == "qkv":
            block = self.blocks[item.block]
            out = list(block.attn.rotated_qkv(block.norm1(run.x[a:b]), run.cos[a:b], run.sin[a:b]))
        elif item.stage == "attend":
            q, k, v = run.qkv
            out = [self.blocks[item.block].attn.windows(q, k, v, *item.window, a, b)]
        elif item.stage == "out":
            block = self.blocks[item.block]
            x = run.x[a:b] + block.attn.proj(run.o[a:b])
            out = [x + block.mlp(block.norm2(x))]
        elif item.stage == "tap":
            merger = self.deepstack_merger_list[self.deepstack_visual_indexes.index(item.block)]
            out = [merger(run.x[a:b])]
        else:  # "merge"
            out = [self.merger(run.x[a:b])]
        run.parts.append(out)
        return out

    def finish(self, run: "VisionRun"):
        run.close()
        return run.merged, run.deepstack


@dataclass(frozen=True)
class VisionItem:
    """One piece of the vision tower's forward over some images. stage "embed" (patch embedding and
    positions), then per block "qkv" (norm, projection, rotary), "attend" (windows, or a range of
    one window's queries), "out" (output projection, residual, MLP) and, after a DeepStack tap,
    "tap" (its merger); last "merge". `start`/`end`: the rows (patches) it covers, or for "attend"
    its queries within each window of `window` = (first row, windows, window length)."""

    stage: str
    block: int
    start: int
    end: int
    cost: float  # FLOPs (2 x multiply-adds) of its matmuls and attention
    window: tuple = ()


def vision_items(config: VisionConfig, grid_thw, budget: Optional[float] = None) -> List[VisionItem]:
    """The vision tower's forward over images of `grid_thw` as work items, each costing at most
    `budget` FLOPs where a piece that small exists (one merged token's rows, one query of one
    window), every stage whole when `budget` is None. A pure function of the config and grids,
    so every rank (and a pipeline stage without the tower) makes the same items."""
    grids = _as_grids(grid_thw)
    m2 = config.spatial_merge_size**2
    d, inter, out_dim = config.hidden_size, config.intermediate_size, config.out_hidden_size
    in_dim = config.in_channels * config.temporal_patch_size * config.patch_size**2
    n = sum(t * h * w for t, h, w in grids)
    segments = []  # as VisionLayout.from_grids: runs of equal windows
    start = 0
    for t, h, w in grids:
        if segments and segments[-1][2] == h * w and segments[-1][0] + segments[-1][1] * h * w == start:
            segments[-1] = (segments[-1][0], segments[-1][1] + t, h * w)
        else:
            segments.append((start, t, h * w))
        start += t * h * w

    def rows(stage, block, per_row, step=1):
        if budget is None:
            return [VisionItem(stage, block, 0, n, per_row * n)]
        size = max(step, int(budget // per_row) // step * step)
        return [VisionItem(stage, block, a, min(n, a + size), per_row * (min(n, a + size) - a))
                for a in range(0, n, size)]

    def attend(block):
        items = []
        for first, count, length in segments:
            per_window = 4.0 * length * length * d  # scores and weighted values
            if budget is None or per_window * count <= budget:
                items.append(VisionItem("attend", block, 0, length, per_window * count, (first, count, length)))
            elif per_window <= budget:
                k = int(budget // per_window)
                for j in range(0, count, k):
                    c = min(k, count - j)
                    items.append(VisionItem("attend", block, 0, length, per_window * c, (first + j * length, c, length)))
            else:
                q = max(1, int(budget // (4.0 * length * d)))
                for j in range(count):
                    for a in range(0, length, q):
                        b = min(length, a + q)
                        items.append(VisionItem("attend", block, a, b, 4.0 * (b - a) * length * d,
                                                (first + j * length, 1, length)))
        return items

    merger = 2.0 * (m2 * d * m2 * d + m2 * d * out_dim) / m2  # per patch row
    items = rows("embed", -1, 2.0 * in_dim * d)
    for i in range(config.depth):
        items += rows("qkv", i, 2.0 * 3 * d * d)
        items += attend(i)
        items += rows("out", i, 2.0 * (d * d + 2 * d * inter))
        if i in config.deepstack_visual_indexes:
            items += rows("tap", i, merger, m2)
    return items + rows("merge", -1, merger, m2)


class VisionRun:
    """The state of one forward done item by item: each stage's pieces, joined when the next
    stage begins."""

    def __init__(self, layout: VisionLayout, pixels, cos, sin):
        self.layout, self.pixels, self.cos, self.sin = layout, pixels, cos, sin
        self.phase, self.parts = None, []
        self.x = self.qkv = self.o = self.merged = None
        self.deepstack = []

    def close(self):
        """Join the pieces of the stage just finished into its result."""
        if self.phase is None:
            return
        joined = [p[0] if len(p) == 1 else mx.concatenate(list(p)) for p in zip(*self.parts)]
        stage = self.phase[0]
        if stage in ("embed", "out"):
            self.x, self.o = joined[0], None
        elif stage == "qkv":
            self.qkv = joined
        elif stage == "attend":
            self.o, self.qkv = joined[0], None  # q, k, v done with: freed before the MLP's activations
        elif stage == "tap":
            self.deepstack.append(joined[0])
        else:
            self.merged = joined[0]
        self.phase, self.parts = None, []
