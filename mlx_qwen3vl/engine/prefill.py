"""A prompt's prefill as work items: the vision tower on its new images and videos (split below
whole blocks, vision.vision_items), then the prompt in chunks through the decoder. The engine
spends a bounded budget of them per step, so streams that are decoding keep getting tokens while
a screenshot is encoded; `prefill` runs them all at once (for tests and benchmarks that prefill
a cache of their own).

Costs are FLOPs (2 x multiply-adds of the matmuls and attention), computed from the config and
the shapes alone: every rank of a sharded or pipelined model plans and spends the same items in
the same steps, so their collectives line up.
"""

import time
from collections import deque
from typing import Optional

import mlx.core as mx
import numpy as np

from ..kv_settings import FLOAT, quantize_if_due
from ..model import VisualFeatures
from ..packed import PackedRows
from ..positions import IMAGE, VIDEO
from ..spans import media_after, media_hashes, media_spans
from ..vision import vision_items

PIXELS = {IMAGE: ("pixel_values", "image_grid_thw"), VIDEO: ("pixel_values_videos", "video_grid_thw")}


class Costs:
    """FLOPs of the decoder's work, from the text config: `token` per prompt token through every
    layer, plus `key` per (query, key) pair of the attention, and the LM head of the last one."""

    def __init__(self, config):
        t = config.text_config
        heads, kv, hd, d = t.num_attention_heads, t.num_key_value_heads, t.head_dim, t.hidden_size
        attention = d * hd * (2 * heads + 2 * kv)
        layers = 0
        for i in range(t.num_hidden_layers):
            if t.is_sparse_layer(i):
                layers += attention + t.num_experts_per_tok * 3 * d * t.moe_intermediate_size + d * t.num_experts
            else:
                layers += attention + 3 * d * t.intermediate_size
        self.token = 2.0 * layers
        self.key = 4.0 * heads * hd * t.num_hidden_layers
        self.head = 2.0 * d * t.vocab_size

    def chunk(self, n: int, end: int) -> float:
        """A chunk of n prompt tokens whose last sees `end` positions."""
        return n * self.token + self.key * n * (end - (n - 1) / 2)

    def tokens_within(self, budget: float, end: int) -> int:
        """How many tokens a chunk ending at most at `end` may take within `budget` (at least 1)."""
        return max(1, int(budget // (self.token + self.key * end)))


class PrefillJob:
    """Prompt positions [start, L) of `inputs` into `cache`, item by item (`advance`), ending in the
    last position's logits and each row's next 1D position (`result`).

    Features of media already in `features` (a FeatureCache, batch-1 prompts only) are reused;
    the others are computed by the vision tower (the model's `visual`: the tower, or a pipeline
    stage's stand-in, which makes the same items) and stored there. `item_budget`: the most
    FLOPs one item may cost (None: each stage whole, chunks of `prefill_step_size`).

    `kv` (KVSettings, fitted to the model): a chunk never crosses `kv.start`, and once the cache
    holds that many positions its layers are quantized in place (the `cache` list's items).
    `head` False: no LM head at the end (`result`'s logits None), for a prefill whose last logits
    nobody reads (a draft model's: its first proposal feeds the answer's first token)."""

    def __init__(self, model, inputs, cache, *, start=0, features=None, item_budget: Optional[float] = None,
                 prefill_step_size=2048, costs: Optional[Costs] = None, on_vision_done=None, kv=FLOAT, head=True):
        self.model, self.inputs, self.cache, self.start = model, inputs, cache, start
        self.kv, self.head = kv, head
        self.features, self.item_budget = features, item_budget
        self.step_size = max(1, int(prefill_step_size))
        self.costs = costs or Costs(model.config)
        self.on_vision_done = on_vision_done
        self.done = False
        self.spent = 0.0  # FLOPs so far
        self._mask = _mask_or_none(inputs)
        self._found = {}  # kind → {media index: [embeds, *deepstack]}
        self._items = deque()  # (cost, fn) of the vision work still to do
        self._vision_tic = None
        for kind in (IMAGE, VIDEO):
            self._queue_media(kind)
        self._prepared = None
        self._next = 0  # the next prompt position (relative to start) to run
        self._hidden = None
        self._result = None

    # ------------------------------------------------------------------ vision
    def _queue_media(self, kind):
        px, grid = PIXELS[kind]
        if grid not in self.inputs:
            return
        grids = np.asarray(self.inputs[grid])
        if self.features is None:  # every image / video from `start` on, in one run (generate's prefill)
            media = media_after(self.inputs, self.start)
            if grid in media:
                self._vision(kind, None, np.asarray(media[px]), np.asarray(media[grid]))
            return
        spans = media_spans(self.inputs)
        hashes = {(m.kind, m.index): h for m, h in zip(spans, media_hashes(self.inputs, spans))}
        later = [m.index for m in spans if m.kind == kind and m.start >= self.start]
        if not later:
            return
        found = self._found.setdefault(kind, {})
        missing = []
        rows = np.concatenate([[0], np.cumsum(grids.prod(-1))])
        pixels = np.asarray(self.inputs[px])
        for k in range(later[0], len(grids)):
            hit = self.features.get(hashes[kind, k])
            if hit is None:
                missing.append(k)
            elif hit is self.features.NOT_KEPT:  # a stage's stand-in for the tower: placeholders, no work
                merged, deepstack = self.model.visual(pixels[rows[k]:rows[k + 1]], grids[k:k + 1])
                found[k] = [merged, *deepstack]
            else:
                found[k] = hit
        if missing:
            sel = np.concatenate([pixels[rows[k]:rows[k + 1]] for k in missing])
            self._vision(kind, [(k, hashes[kind, k]) for k in missing], sel, grids[missing])

    def _vision(self, kind, keys, pixels, grids):
        """Queue the tower's items over `pixels`; at the end, split its features per medium
        (`keys`: [(index, hash)] to store, or None: keep them whole)."""
        visual = self.model.visual
        state = {}
        items = vision_items(self.model.config.vision_config, grids, self.item_budget)
        if self.item_budget is None:  # the whole tower at once
            def whole():
                # Stage by stage, each evaluated before the next is built: as one lazy graph (the
                # model's own call) MLX holds several stages' intermediates at once (one 1080p
                # screenshot on h-mid's plain graph: 1.21 GB above the weights, 0.71 stage by stage).
                run = visual.start(pixels, grids)
                for item in items:
                    mx.eval(visual.run(run, item))
                state["features"] = VisualFeatures(*visual.finish(run))
                return []

            self._items.append((sum(item.cost for item in items), whole))
        else:
            def begin():
                state["run"] = visual.start(pixels, grids)
                return []

            self._items.append((0.0, begin))
            for item in items:
                self._items.append((item.cost, lambda item=item: visual.run(state["run"], item)))

        def end():
            if "features" in state:
                merged, deepstack = state["features"].embeds, state["features"].deepstack
            else:
                merged, deepstack = visual.finish(state["run"])
            arrays = [merged, *deepstack]
            if keys is None:
                self._found[kind] = arrays
                return arrays
            counts = grids.prod(-1) // self.model.spatial_merge_size**2
            bounds = np.concatenate([[0], np.cumsum(counts)])
            found = self._found.setdefault(kind, {})
            for i, (k, h) in enumerate(keys):
                found[k] = [a[int(bounds[i]):int(bounds[i + 1])] for a in arrays]
                self.features.put(h, found[k])
            return arrays

        self._items.append((0.0, end))

    def _features(self, kind) -> Optional[VisualFeatures]:
        got = self._found.get(kind)
        if got is None:
            return None
        if isinstance(got, list):
            return VisualFeatures(got[0], got[1:])
        ordered = [got[k] for k in sorted(got)]
        joined = [mx.concatenate(list(col)) if len(col) > 1 else col[0] for col in zip(*ordered)]
        return VisualFeatures(joined[0], joined[1:])

    # ------------------------------------------------------------------ decoder
    def _prepare(self):
        inputs = self.inputs
        self._prepared = self.model.prepare_inputs(
            inputs["input_ids"], inputs.get("attention_mask"), image_grid_thw=inputs.get("image_grid_thw"),
            video_grid_thw=inputs.get("video_grid_thw"), mm_token_type_ids=inputs.get("mm_token_type_ids"),
            image_features=self._features(IMAGE), video_features=self._features(VIDEO), start=self.start)
        self._found = {}

    @property
    def length(self) -> int:
        """Prompt positions this job computes."""
        return int(np.asarray(self.inputs["input_ids"]).shape[1]) - self.start

    def next_cost(self, budget: Optional[float] = None) -> float:
        """The cost of the next item (a chunk sized to `budget` when given)."""
        if self._items:
            return self._items[0][0]
        n, end = self._chunk(budget)
        return self.costs.chunk(n, self.start + end) + (self.costs.head if end == self.length and self.head else 0)

    def _chunk(self, budget):
        """(tokens, end) of the next decoder chunk."""
        left = self.length - self._next
        limit = self.step_size
        cap = budget if self.item_budget is None else (
            self.item_budget if budget is None else min(budget, self.item_budget))
        if cap is not None:
            limit = min(limit, self.costs.tokens_within(cap, self.start + self.length))
        n = min(left, limit)
        at = self.start + self._next
        if self.kv.quantized and self.cache and self.cache[0].kind is None and at < self.kv.start < at + n:
            n = self.kv.start - at  # the positions before it float, the rest against the quantized cache
        return n, self._next + n

    def one_chunk(self) -> bool:
        """Whether what is left is one decoder chunk and nothing else: no vision work, not begun,
        and its cache's kind unchanged by it (it ends before kv.start) — a job `prefill_together`
        may take. Prepares the prompt's embeddings and positions when it is."""
        if self._items or self._next or self.done:
            return False
        if self._prepared is None:
            self._prepare()
            quantize_if_due(self.cache, self.kv)  # a cache handed in already past kv.start
        if self._chunk(None)[1] != self.length:
            return False
        kv = self.kv
        return not (kv.quantized and self.cache[0].kind is None and self.start + self.length >= kv.start)

    def advance(self, budget: Optional[float] = None, *, force_first=True, evaluate=True) -> float:
        """Run items while they fit in `budget` FLOPs (None: all of them); the first one runs even
        if it does not fit when `force_first`. Each item's arrays are evaluated (asynchronously when
        `evaluate` is "async") unless `budget` is None, where the graph is left to the chunks, as a
        whole prefill has it. Returns the FLOPs spent."""
        spent = 0.0
        while not self.done:
            cost = self.next_cost(None if budget is None else budget - spent)
            if budget is not None and spent + cost > budget and not (force_first and spent == 0):
                break
            self._run_one(None if budget is None else budget - spent, evaluate=evaluate if budget is not None else None)
            spent += cost
        self.spent += spent
        return spent

    def _run_one(self, budget, evaluate):
        if self._items:
            if self._vision_tic is None:
                self._vision_tic = time.perf_counter()
            _, fn = self._items.popleft()
            arrays = fn()
            if arrays and evaluate:
                (mx.async_eval if evaluate == "async" else mx.eval)(arrays)
            if not self._items and self.on_vision_done is not None:
                mx.eval(arrays)
                self.on_vision_done(time.perf_counter() - self._vision_tic)
            return
        if self._prepared is None:
            self._prepare()
            quantize_if_due(self.cache, self.kv)  # a cache handed in already past kv.start
        n, end = self._chunk(budget)
        s = self._next
        last = 1 if end == self.length else None  # the prompt's end: only its last position's logits
        self._hidden = self.model.decode_hidden(self._prepared, self._mask, self.cache, s, end, last)
        self._next = end
        quantize_if_due(self.cache, self.kv)
        if end < self.length:
            state = [c.state for c in self.cache]
            if evaluate == "async":
                mx.async_eval(state)
            else:
                mx.eval(state)
                mx.clear_cache()
            return
        logits = self.model.logits(self._hidden[:, -1, :]) if self.head else None
        inputs = self.inputs
        ids = np.asarray(inputs["input_ids"])
        if "attention_mask" in inputs:
            real = np.asarray(inputs["attention_mask"]).sum(-1)
        else:
            real = np.full(ids.shape[0], ids.shape[1])
        self._result = logits, self._prepared.rope_deltas[:, 0] + mx.array(real)
        self._prepared = self._hidden = None
        self.done = True

    def result(self):
        """(logits of the last position (B, V), next 1D position per row (B,)), once done."""
        return self._result


def together_cost(jobs) -> float:
    """FLOPs of `prefill_together(jobs)`: each row's own chunk (packed: no padding) and LM head."""
    return sum(_own_cost(j) for j in jobs)


def _own_cost(job) -> float:
    return job.costs.chunk(job.length, job.start + job.length) + job.costs.head


def prefill_together(jobs):
    """Several jobs whose rest is one chunk each (`PrefillJob.one_chunk`, caches of one kind)
    through one forward, as mlx-lm's PromptProcessingBatch prefills several prompts, but packed:
    the rows' new tokens one after another in one sequence without padding, each with its own
    positions (text: offset + rope delta), so the token-wise work is paid for real tokens only;
    attention splits the sequence back into rows, each row's queries against its own cache
    (packed.PackedRows). The rows' caches are then merged (right-aligned, left-padded) as a
    decode batch holds them.

    Returns (logits of each row's last position (B, V), next 1D position per row (B,), the rows'
    one merged cache); the jobs are done (their own `result` is not set)."""
    model = jobs[0].model
    lengths = [j.length for j in jobs]
    preps = [j._prepared for j in jobs]
    embeds = mx.concatenate([p.inputs_embeds for p in preps], axis=1)
    positions = mx.concatenate([p.position_ids for p in preps], axis=2)
    taps = max(len(p.deepstack) for p in preps)
    deepstack = [mx.concatenate([p.deepstack[k] if p.deepstack else mx.zeros((1, n, embeds.shape[2]), embeds.dtype)
                                 for p, n in zip(preps, lengths)], axis=1) for k in range(taps)]
    rows = list(zip(*(j.cache for j in jobs)))  # per layer: the rows' own caches
    packed = [PackedRows(layer, lengths) for layer in rows]
    hidden = model.language_model(embeds, positions, None, packed, deepstack, last=1)  # each row's last position
    logits = model.logits(hidden[0])
    cache = [type(layer[0]).merge(layer) for layer in rows]
    rope_deltas = mx.concatenate([p.rope_deltas for p in preps])
    ends = mx.array([j.start + j.length for j in jobs])
    for j in jobs:
        j.spent += _own_cost(j)
        j._next, j._prepared, j.done = j.length, None, True
    return logits, rope_deltas[:, 0] + ends, cache


def media_features(model, inputs, start=0, features=None) -> dict:
    """{kind: VisualFeatures} of the images / videos from token `start` on (what a prefill from
    there encodes), reusing and filling the FeatureCache `features` when given."""
    job = PrefillJob(model, inputs, None, start=start, features=features)
    while job._items:
        job._run_one(None, evaluate=None)
    return {kind: f for kind in (IMAGE, VIDEO) if (f := job._features(kind)) is not None}


def _mask_or_none(inputs):
    """Padding masks matter only for batches that have padding; otherwise use the causal fast path."""
    mask = inputs.get("attention_mask")
    if mask is None or np.asarray(mask).all():
        return None
    return mx.array(np.asarray(mask))


def prefill(model, inputs, cache, *, start=0, prefill_step_size=2048, on_vision_done=None, kv=FLOAT):
    """Encode the new images/videos once, then run prompt positions [start, L) through the decoder
    in chunks of `prefill_step_size`, so activations stay bounded for long prompts.

    `on_vision_done(seconds)`, when given and the prompt has new media, is called with the vision
    tower's time; it evaluates the features before the prompt (one extra sync), so it is for
    measuring, not for normal runs.

    Returns (logits of the last position (B, V), next 1D position per sequence (B,)). DeepStack
    tensors are sliced with the chunk, so features land on the right positions across chunks.
    `kv`: KVSettings (see PrefillJob); `cache`'s items may be replaced by quantized ones."""
    job = PrefillJob(model, inputs, cache, start=start, prefill_step_size=prefill_step_size,
                     on_vision_done=on_vision_done, kv=kv)
    job.advance(None)
    return job.result()
