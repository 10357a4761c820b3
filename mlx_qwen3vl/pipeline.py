"""Pipeline parallel: the decoder's layers split across ranks, each rank one stage.

    mlx.launch -n 2 --backend ring -- python -m mlx_qwen3vl --parallel pipeline --model ...
    model, processor = mlx_qwen3vl.load(path, parallel="pipeline")      # under mlx.launch

`pipeline(model, group)` is module surgery on a loaded, still lazy model (applied where tensor
parallel's `shard` is): each rank keeps only what its stage runs, so the weights of everything it
drops are never read.

- Stage r runs a contiguous range of decoder layers, rank order = layer order. The hidden state
  goes from stage to stage with `send` / `recv` (ring neighbours), once per prefill chunk or
  decode token: D numbers per token, against tensor parallel's two `all_sum`s per layer.
- The embedding lookup runs on the first stage, the final norm and the LM head on the last; a tied
  table is kept by both (with 2 ranks that is every rank: the lookup needs it on one, the head on
  the other, and sending the table or the logits' rows would cost more than it saves). The last
  stage's logits reach every rank by one `all_sum` (the others add exact zeros), so every rank
  samples the same token without a per-token exchange, as with tensor parallel.
- The vision tower lives on the first stage (its merged features go into the embeddings) and on any
  stage holding one of the first len(deepstack_visual_indexes) layers (DeepStack features are added
  after LLM layers 0, 1, 2 wherever they live). Other stages keep a `FeatureCounter`, which only
  knows how many features the media give, so the prompt bookkeeping runs the same everywhere.
- Balance: the split minimizes the largest stage's parameter bytes, counting the vision tower,
  embedding and head each stage keeps, and each layer's real size (an MoE model's dense layers
  are a fraction of its sparse ones).
- Nothing inside a layer is divided, so any head count, expert count or quantization works; the
  stages run one after another (no micro-batching), so a pipeline saves memory, not time.
- KV caches: one per local layer, made by `model.make_cache()` as for one process, so prefix reuse
  and `ChatSession` keep each rank's own layers' caches.
"""

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from .backend import MLXBackend
from .errors import ConfigError, InputError
from .language import TextModel, kept
from .vision import VisionLayout


@dataclass(frozen=True)
class Stage:
    """This rank's place in the pipeline: decoder layers [start, end) of `layers`."""

    group: object
    rank: int
    size: int
    start: int
    end: int
    layers: int

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1


def check_pipelinable(config, n: int):
    """One ConfigError when the decoder cannot give every one of n ranks a layer."""
    layers = config.text_config.num_hidden_layers
    if layers < n:
        raise ConfigError(f"cannot split {layers} decoder layers over {n} ranks as a pipeline (each rank needs "
                          f"at least one layer): launch at most {layers} ranks, or use --parallel tensor")


def _nbytes(module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


def balanced_bounds(layer_bytes: Sequence[int], n: int, fixed) -> List[int]:
    """Stage boundaries [0, b1, ..., L] minimizing the largest stage's bytes, each stage non-empty;
    `fixed(rank, start, end)` is what a stage holds besides its layers. Exact (dynamic programming
    over contiguous splits: L * L * n steps, nothing for L <= 100)."""
    L = len(layer_bytes)
    prefix = np.concatenate([[0], np.cumsum(layer_bytes)])
    best = {0: (0, [0])}  # end of stages so far -> (largest stage bytes, boundaries)
    for r in range(n):
        nxt = {}
        for end in range(r + 1, L - (n - r - 1) + 1):
            for start, (worst, bounds) in best.items():
                if start >= end:
                    continue
                cost = max(worst, fixed(r, start, end) + int(prefix[end] - prefix[start]))
                if end not in nxt or cost < nxt[end][0]:
                    nxt[end] = (cost, bounds + [end])
        best = nxt
    return best[L][1]


def stage_bounds(model, n: int) -> List[int]:
    """The balanced split of `model`'s decoder over n stages (see the module docstring)."""
    lm, taps = model.language_model, len(model.config.vision_config.deepstack_visual_indexes)
    vision, table = _nbytes(model.visual), _nbytes(lm.embed_tokens)
    head = table if model.config.tie_word_embeddings else _nbytes(model.lm_head)

    def fixed(rank, start, end):
        held = vision if rank == 0 or start < taps else 0
        held += table if rank == 0 else 0
        if rank == n - 1 and not (rank == 0 and model.config.tie_word_embeddings):
            held += head + _nbytes(lm.norm)
        return held

    return balanced_bounds([_nbytes(layer) for layer in lm.layers], n, fixed)


def _check_bounds(bounds, layers: int, n: int):
    if len(bounds) != n + 1 or bounds[0] != 0 or bounds[-1] != layers or any(
            b >= c for b, c in zip(bounds, bounds[1:])):
        raise ConfigError(f"pipeline split {list(bounds)} is not {n + 1} increasing layer boundaries from 0 to "
                          f"{layers}: give one boundary per stage, each stage at least one layer")


class FeatureCounter(nn.Module):
    """In place of the vision tower on a stage that never uses visual features: zeros of the right
    shapes (the features' count checks the prompt's placeholders on every rank alike), never
    evaluated, because this stage's output does not depend on them."""

    def __init__(self, config, out_dim: int, dtype):
        super().__init__()
        self.config, self.out_dim, self.out_dtype = config, out_dim, dtype

    def __call__(self, pixel_values, grid_thw):
        c = self.config
        layout = VisionLayout.from_grids(grid_thw, c.spatial_merge_size, math.isqrt(c.num_position_embeddings))
        patches = layout.interp_indices.shape[0]
        if pixel_values.shape[0] != patches:  # the vision tower's own check: every rank raises it alike
            raise InputError(f"pixel_values has {pixel_values.shape[0]} patches but grid_thw describes {patches}: "
                             "pass the processor's pixel_values and grid together")
        zeros = mx.zeros((sum(layout.merged_sizes), self.out_dim), self.out_dtype)
        return zeros, [zeros for _ in c.deepstack_visual_indexes]

    # The tower's item-by-item interface (vision.VisionModel.start / run / finish): the same items
    # are made here (vision.vision_items), and none does any work.
    def start(self, pixel_values, grid_thw):
        return self(pixel_values, grid_thw)

    def run(self, run, item):
        return []

    def finish(self, run):
        return run


def _from_last_stage(stage: Stage, compute, x, width: int, dtype):
    """compute(x) of the last stage on every rank: one all_sum, the other ranks adding exact zeros
    (made to depend on x, so the send that produced x on their stage is part of the graph)."""
    if stage.last:
        y = compute(x)
    else:
        y = mx.depends(mx.zeros((*x.shape[:-1], width), dtype), x)
    return mx.distributed.all_sum(y, group=stage.group)


class StageEmbedding(nn.Module):
    """The token embedding of a pipelined model: the lookup on the first stage (zeros elsewhere,
    replaced by the hidden state received); for a tied model, `as_linear` is the LM head, run on
    the last stage and received by every rank."""

    def __init__(self, table: Optional[nn.Module], stage: Stage, hidden: int, dtype, vocab: int, logits_dtype):
        super().__init__()
        if table is not None:
            self.table = table
        self.stage, self.hidden, self.hidden_dtype = stage, hidden, dtype
        self.vocab, self.logits_dtype = vocab, logits_dtype

    def __call__(self, ids):
        if self.stage.first:
            return self.table(ids)
        return mx.zeros((*ids.shape, self.hidden), self.hidden_dtype)

    def as_linear(self, x):
        return _from_last_stage(self.stage, lambda h: self.table.as_linear(h), x, self.vocab, self.logits_dtype)


class StageHead(nn.Module):
    """An untied LM head, kept by the last stage; its logits received by every rank."""

    def __init__(self, head: Optional[nn.Module], stage: Stage, vocab: int, logits_dtype):
        super().__init__()
        if head is not None:
            self.head = head
        self.stage, self.vocab, self.logits_dtype = stage, vocab, logits_dtype

    def __call__(self, x):
        return _from_last_stage(self.stage, lambda h: self.head(h), x, self.vocab, self.logits_dtype)


class PipelineTextModel(TextModel):
    """TextModel over this stage's layers: receive the previous stage's hidden state, run the local
    layers (DeepStack added after the global layers it belongs to), send to the next stage. Only the
    last stage's output is the model's hidden state; the others return what they sent, which the LM
    head uses only as a dependency."""

    stage: Stage

    def __call__(self, inputs_embeds, position_ids, mask=None, cache=None, deepstack_embeds=None, last=None):
        stage = self.stage
        h = inputs_embeds
        if not stage.first:
            h = mx.distributed.recv_like(h, stage.rank - 1, group=stage.group)
        cache = cache or [None] * len(self.layers)
        deepstack_embeds = deepstack_embeds or []
        rope = self.rotary(position_ids, h.shape[1], h.dtype)
        for i, (layer, c) in enumerate(zip(self.layers, cache), start=stage.start):
            h = layer(h, rope, mask, c, last if i == stage.layers - 1 else None)
            if i < len(deepstack_embeds):
                h = h + kept(deepstack_embeds[i], h.shape[1], c, last).astype(h.dtype)
        if stage.last:
            return self.norm(h)
        h = mx.distributed.send(h.astype(inputs_embeds.dtype), stage.rank + 1, group=stage.group)
        if cache[-1] is not None:  # evaluating the cache (between prefill chunks) must also send
            cache[-1].depend_on(h)
        return h


class PipelineMLX(MLXBackend):
    """The plain MLX graph of one pipeline stage (what `--verbose` names); caches for its layers."""

    def __init__(self, stage: Stage):
        self.stage = stage

    def describe(self) -> str:
        s = self.stage
        return (f"{super().describe()}, pipeline over {s.size} ranks (this is rank {s.rank}: decoder layers "
                f"{s.start}-{s.end - 1} of {s.layers})")


def pipeline(model, group, bounds: Optional[Sequence[int]] = None):
    """Keep this rank's stage of a loaded (possibly still lazy) Qwen3-VL model, in place; see the
    module docstring. `bounds`: the stages' layer boundaries [0, ..., num_layers] instead of the
    balanced split (e.g. for machines of different memory). Raises ConfigError when the layers do
    not go round."""
    n, rank = group.size(), group.rank()
    config, lm = model.config, model.language_model
    layers = len(lm.layers)
    check_pipelinable(config, n)
    bounds = list(stage_bounds(model, n) if bounds is None else bounds)
    _check_bounds(bounds, layers, n)
    stage = Stage(group, rank, n, bounds[rank], bounds[rank + 1], layers)
    tied, taps = config.tie_word_embeddings, len(config.vision_config.deepstack_visual_indexes)
    hidden, vocab = config.text_config.hidden_size, config.text_config.vocab_size
    # dtypes from the lazy graph (nothing is read): every rank agrees on what it sends and sums
    dtype = lm.embed_tokens(mx.zeros((1, 1), mx.int32)).dtype
    logits_dtype = model.logits(mx.zeros((1, hidden), dtype)).dtype

    if not (stage.first or stage.start < taps):
        model.visual = FeatureCounter(config.vision_config, hidden, dtype)
    keep_table = stage.first or (tied and stage.last)
    lm.embed_tokens = StageEmbedding(lm.embed_tokens if keep_table else None, stage, hidden, dtype, vocab,
                                     logits_dtype)
    if not tied:
        model.lm_head = StageHead(model.lm_head if stage.last else None, stage, vocab, logits_dtype)
    lm.layers = lm.layers[stage.start:stage.end]
    if not stage.last:
        del lm.norm
    lm.__class__ = PipelineTextModel
    lm.stage = stage
    # The plain MLX graph: the CPU path's fused decode runs the whole stack and knows no stages.
    model.backend = PipelineMLX(stage)
    model.group = group
    return model
