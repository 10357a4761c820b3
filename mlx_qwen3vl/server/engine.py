"""The model worker: one thread owns the model and runs continuous batching.

Each loop iteration admits waiting requests (each is prefilled alone — reusing the longest cached
prefix and cached vision features — and its first token sampled), joins them to the running
batch, and decodes one token for every running row. The batch's KV cache is one cache per layer
(the model's own type, from make_cache) holding all rows left-padded to a common length; each
row keeps its own 1D decode position (its cache length + its mRoPE rope delta), logits
processors, stop strings and the library's per-request `Sampler` (its own random stream, from its
seed: a seeded answer equals generate(seed=...)'s, alone or batched).
A row leaves when it stops, hits its limit or its client goes away; its cache then goes to the
prefix cache. With a single row and no padding the step is exactly `generate()`'s decode step
(the CPU fast path included).

Under `mlx.launch` every rank runs this loop on its shard of the model (replica.py): rank 0 takes
requests from HTTP and broadcasts each iteration's inputs; the others replay them. With one
process nothing is exchanged.
"""

import asyncio
import collections
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import List, Optional

import mlx.core as mx
import numpy as np

from .. import kv_cache
from ..backend import backend_of
from ..errors import Qwen3VLError
from ..generate import decode_step, eos_token_ids
from ..prompt_cache import media_hashes, media_spans
from ..sampling import Sampler
from ..model import VisualFeatures
from ..pipeline import FeatureCounter
from ..positions import IMAGE, VIDEO
from .cache import FeatureCache, PrefixCache, pipeline_scale
from ..sampling import SamplingParams
from .protocol import APIError
from .replica import Plan, digest

PIXELS = {IMAGE: ("pixel_values", "image_grid_thw"), VIDEO: ("pixel_values_videos", "video_grid_thw")}


@dataclass
class Prepared:
    """A request turned into model inputs (built off the worker thread)."""

    inputs: dict
    tokens: List[int]  # the prompt's token ids
    media: list  # prompt_cache.media_keys: (kind, start, end, content hash) per image / video
    sampling: SamplingParams
    max_tokens: int
    grammar: Optional[list] = None  # the grammar's description (grammar.GrammarFactory.build)
    processors: list = field(default_factory=list)  # extra mlx-lm-style logits processors (grammar)

    @property
    def prompt_tokens(self) -> int:
        return len(self.tokens)


class Handle:
    """A submitted request as the HTTP side sees it: events arrive on an asyncio queue."""

    listening = True

    def __init__(self, prepared: Prepared, loop: asyncio.AbstractEventLoop):
        self.prepared = prepared
        self.id = None  # set when admitted: the row's name in messages to other ranks
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancelled = False

    def emit(self, event: dict):
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the event loop has closed (server shutting down)
            pass

    def cancel(self):
        self.cancelled = True


def _holdback(text: str, stops: List[str]) -> int:
    """How many trailing characters could start a stop string (kept back until resolved)."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class _Row:
    def __init__(self, handle: Handle, engine: "Engine", cached: int):
        p = handle.prepared
        self.handle, self.prepared, self.cached, self.id = handle, p, cached, handle.id
        self.tokens: List[int] = []
        self.position = 0
        self.detok = engine.tokenizer_wrapper.detokenizer
        self.text, self.sent = "", 0
        self.finish: Optional[str] = None
        self.sampler = engine.sampling(p)
        # The tokens so far (prompt + answer), kept only for the processors that read them.
        self.history = list(p.tokens) if self.sampler.processors else None


class Engine:
    def __init__(self, model, processor, *, max_batch=8, max_queue=64, prefill_step_size=2048,
                 prefix_cache_bytes=2 << 30, feature_cache_bytes=512 << 20, default_max_tokens=512, replicas=None):
        from mlx_lm.tokenizer_utils import TokenizerWrapper

        self.model, self.processor = model, processor
        self.max_batch, self.max_queue = max_batch, max_queue
        self.prefill_step_size = prefill_step_size
        self.default_max_tokens = default_max_tokens
        self.context = int(model.config.text_config.max_position_embeddings)
        self.merge_size = model.spatial_merge_size
        self.tokenizer_wrapper = TokenizerWrapper(processor.tokenizer)
        self.eos = eos_token_ids(model, processor)
        self.log_softmax = backend_of(model).log_softmax
        self.prefix = PrefixCache(prefix_cache_bytes, pipeline_scale(model))
        # A pipeline stage without the vision tower gets placeholder zeros for features: none are kept.
        self.feature_cache_bytes = feature_cache_bytes
        self.features = FeatureCache(0 if isinstance(model.visual, FeatureCounter) else feature_cache_bytes)
        self._pending: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._rows: List[_Row] = []
        self._cache = None  # per layer, all rows left-padded to one length
        self._stopping = False
        self.replicas = replicas  # replica.Leader / Follower on several ranks, else None
        self._ids = itertools.count()
        self._iteration = 0
        self.metrics = collections.Counter()
        self.batch_sizes = collections.Counter()  # decode steps by number of rows decoded together
        _settle(model)
        self._thread = threading.Thread(target=self._run, name="mlx_qwen3vl-model", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ called from the HTTP side
    def submit(self, prepared: Prepared, loop) -> Handle:
        handle = Handle(prepared, loop)
        with self._cv:
            if len(self._pending) >= self.max_queue:
                self.metrics["rejected"] += 1
                raise APIError(503, f"the server is busy ({len(self._pending)} requests waiting); retry shortly",
                               code="queue_full", headers={"Retry-After": "1"})
            self._pending.append(handle)
            self._cv.notify()
        return handle

    def close(self):
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout=30)

    def join(self):
        """Wait until the model thread ends (on ranks other than 0: when rank 0 stops)."""
        self._thread.join()

    def stats(self) -> dict:
        with self._cv:
            waiting = len(self._pending)
        return {"running": len(self._rows), "waiting": waiting, "max_batch": self.max_batch,
                "max_queue": self.max_queue, **dict(self.metrics),
                "decode_steps_by_batch_size": {str(k): v for k, v in sorted(self.batch_sizes.items())},
                "prefix_cache": self.prefix.stats(), "vision_feature_cache": self.features.stats()}

    # ------------------------------------------------------------------ sampling
    def sampling(self, p: Prepared):
        """The library's Sampler of one request, the one generate() builds for the same settings
        (penalties, filters, and a random stream of the request's own, from its seed), so a seeded
        answer equals generate(seed=...)'s whatever requests share the batch; any grammar follows."""
        return Sampler(p.sampling, processors=p.processors)

    def _sample(self, row: _Row, logits):
        """logits (1, V) → (token (1,), log-probs (1, V)), with the row's processors and random stream."""
        if row.history is not None:
            logits = row.sampler.process(mx.array(row.history), logits)
        logprobs = self.log_softmax(logits)
        return row.sampler(logprobs), logprobs

    # ------------------------------------------------------------------ the worker loop
    def _run(self):
        # MLX streams belong to the thread that made them: the model thread makes its own.
        mx.set_default_stream(mx.new_stream(mx.default_device()))
        try:
            while True:
                plan = self._plan()
                if self.replicas is not None:
                    tic = time.perf_counter()
                    plan = self.replicas.exchange(plan, self._state())
                    self.metrics["exchange_s"] += time.perf_counter() - tic  # includes waiting for the others
                if plan.stop:
                    return
                self._apply(plan)
                if self._rows:
                    tic = time.perf_counter()
                    try:
                        self._step()
                    except Exception as e:  # noqa: BLE001
                        self._failed(e)
                        for row in self._rows:
                            row.handle.emit({"type": "error", "error": _as_api_error(e)})
                        self._rows, self._cache = [], None
                    self.metrics["decode_s"] += time.perf_counter() - tic
                self._iteration += 1
        except BaseException as e:
            if self.replicas is None:
                raise
            self.replicas.fail(e)  # ends this rank; mlx.launch stops the others

    def _plan(self):
        """This iteration's inputs from the HTTP side (rank 0 / one process): the requests to admit,
        running rows whose clients went away, or stop. Waits while there is nothing to do."""
        if self.replicas is not None and self.replicas.rank != 0:
            return None  # the others receive rank 0's plan
        with self._cv:
            while not self._pending and not self._rows and not self._stopping:
                self._cv.wait()
            if self._stopping:
                return Plan(stop=True)
            admit = []
            while self._pending and len(self._rows) + len(admit) < self.max_batch:
                admit.append(self._pending.popleft())
        plan = Plan()
        if self.replicas is not None:
            # Several ranks: what the clients did is read once, here, and sent with the plan.
            plan.cancel = [row.id for row in self._rows if row.handle.cancelled]
            self.metrics["cancelled"] += sum(h.cancelled for h in admit)
            admit = [h for h in admit if not h.cancelled]
        for handle in admit:
            handle.id = next(self._ids)
        plan.admit = admit
        return plan

    def _apply(self, plan):
        if plan.cancel:
            gone = set(plan.cancel)
            done = [i for i, row in enumerate(self._rows) if row.id in gone]
            for i in done:
                self._rows[i].finish = "cancelled"
            self.metrics["cancelled"] += len(done)
            self._remove(done)
        for handle in plan.admit:
            if self.replicas is None and handle.cancelled:
                self.metrics["cancelled"] += 1
                continue
            tic = time.perf_counter()
            try:
                self._start(handle)
            except Exception as e:  # noqa: BLE001 — the request fails, the server keeps serving
                self._failed(e)
                handle.emit({"type": "error", "error": _as_api_error(e)})
            self.metrics["prefill_s"] += time.perf_counter() - tic

    def _failed(self, e):
        """On several ranks only the errors every rank raises alike (the inputs' and the grammar's,
        before or after the model's collectives) leave the ranks in step; any other ends the rank."""
        if self.replicas is not None and not isinstance(e, (APIError, Qwen3VLError)):
            raise e
        self.metrics["errors"] += 1

    def _state(self) -> int:
        """A digest of what every rank must agree on before the next iteration."""
        return digest(self._iteration, self.max_batch, self.prefill_step_size, self.prefix.max_bytes,
                      self.feature_cache_bytes, self.default_max_tokens, self.metrics["errors"],
                      [(r.id, len(r.tokens), r.tokens[-1]) for r in self._rows],
                      self._cache[0].padding() if self._cache else [], kv_cache.size(self._cache or []),
                      (list(self.prefix.entries), self.prefix.nbytes, self.prefix.reused_tokens))

    # ------------------------------------------------------------------ prefill
    def _features(self, kind, inputs, start):
        """VisualFeatures of the images (or videos) that begin at or after token `start`, reusing
        cached ones (by content hash)."""
        px, grid = PIXELS[kind]
        spans = media_spans(inputs)
        hashes = {(m.kind, m.index): h for m, h in zip(spans, media_hashes(inputs, spans))}
        later = [m.index for m in spans if m.kind == kind and m.start >= start]
        if not later:
            return None
        first = later[0]
        grids = np.asarray(inputs[grid])
        rows = np.concatenate([[0], np.cumsum(grids.prod(-1))])
        parts = {k: self.features.get(hashes[kind, k]) for k in range(first, len(grids))}
        missing = [k for k, v in parts.items() if v is None]
        if missing:
            pixels = np.asarray(inputs[px])
            sel = np.concatenate([pixels[rows[k]:rows[k + 1]] for k in missing])
            feats = self.model.get_image_features(sel, grids[missing])
            arrays = [feats.embeds] + list(feats.deepstack)
            mx.eval(arrays)
            counts = grids[missing].prod(-1) // self.merge_size**2
            bounds = np.concatenate([[0], np.cumsum(counts)])
            for i, k in enumerate(missing):
                parts[k] = [a[int(bounds[i]):int(bounds[i + 1])] for a in arrays]
                self.features.put(hashes[kind, k], parts[k])
        ordered = [parts[k] for k in range(first, len(grids))]
        joined = [mx.concatenate(list(col)) if len(col) > 1 else col[0] for col in zip(*ordered)]
        return VisualFeatures(joined[0], joined[1:])

    def _start(self, handle: Handle):
        p = handle.prepared
        inputs = p.inputs
        eid, start = self.prefix.lookup(inputs)
        if start:
            cache = self.prefix.take(eid, start, self.model.make_cache)
        else:
            self.prefix.misses += 1
            cache = self.model.make_cache()
        prepared = self.model.prepare_inputs(
            inputs["input_ids"], None, image_grid_thw=inputs.get("image_grid_thw"),
            video_grid_thw=inputs.get("video_grid_thw"), mm_token_type_ids=inputs.get("mm_token_type_ids"),
            image_features=self._features(IMAGE, inputs, start),
            video_features=self._features(VIDEO, inputs, start), start=start)
        n = prepared.inputs_embeds.shape[1]
        step = max(1, self.prefill_step_size)
        for s in range(0, n, step):
            e = min(n, s + step)
            hidden = self.model.decode_hidden(prepared, None, cache, s, e)
            if e < n:
                mx.eval([c.state for c in cache])
        logits = self.model.logits(hidden[:, -1, :])
        row = _Row(handle, self, start)
        row.position = int(prepared.rope_deltas[0, 0].item()) + p.prompt_tokens
        self.metrics["requests"] += 1
        self.metrics["prompt_tokens"] += p.prompt_tokens
        self.metrics["prompt_tokens_computed"] += p.prompt_tokens - start
        token, logprobs = self._sample(row, logits)
        mx.eval(token, logprobs, [c.state for c in cache])
        self._emit(row, int(token.item()), logprobs)
        if row.finish:
            self._finish(row, cache)
        else:
            self._join(row, cache)

    def _join(self, row: _Row, caches):
        if self._cache is None:
            self._cache, self._rows = caches, [row]
            return
        self._cache = kv_cache.merge([self._cache, caches])
        mx.eval(kv_cache.state(self._cache))
        self._rows.append(row)

    # ------------------------------------------------------------------ decode
    def _step(self):
        rows = self._rows
        y = mx.array([r.tokens[-1] for r in rows])
        positions = mx.array([r.position for r in rows])
        key_mask = self._cache[0].key_mask(1)
        logits = decode_step(self.model, y, self._cache, positions, key_mask)
        self.batch_sizes[len(rows)] += 1
        self.metrics["decode_steps"] += 1
        sampled = []
        for b, row in enumerate(rows):
            row.position += 1
            if row.history is not None:
                row.history.append(row.tokens[-1])
            sampled.append(self._sample(row, logits[b: b + 1]))
        mx.eval(sampled)
        for row, (token, logprobs) in zip(rows, sampled):
            if self.replicas is None and row.handle.cancelled:  # several ranks: cancelled by the plan
                row.finish = "cancelled"
                self.metrics["cancelled"] += 1
            else:
                self._emit(row, int(token.item()), logprobs)
        done = [i for i, r in enumerate(rows) if r.finish]
        if done:
            self._remove(done)

    def _remove(self, done: List[int]):
        for i in done:
            self._finish(self._rows[i], kv_cache.extract(self._cache, i))
        keep = [i for i in range(len(self._rows)) if i not in set(done)]
        if not keep:
            self._rows, self._cache = [], None
            return
        kv_cache.filter_rows(self._cache, keep)
        mx.eval(kv_cache.state(self._cache))
        self._rows = [self._rows[i] for i in keep]

    # ------------------------------------------------------------------ output
    def _emit(self, row: _Row, token: int, logprobs):
        p = row.prepared
        row.tokens.append(token)
        finish = None
        if token in self.eos:
            finish = "stop"
        else:
            row.detok.add_token(token)
        if finish is None and (len(row.tokens) >= p.max_tokens):
            finish = "length"
        if finish:
            row.detok.finalize()
        row.text += row.detok.last_segment
        stops = p.sampling.stop
        if stops:
            hits = [i for i in (row.text.find(s, max(0, row.sent - len(s))) for s in stops) if i >= 0]
            if hits:
                row.text, finish = row.text[:min(hits)], "stop"
        end = len(row.text) if finish or not stops else len(row.text) - _holdback(row.text, stops)
        event = {"type": "token", "text": row.text[row.sent:end], "token": token}
        row.sent = max(row.sent, end)
        if p.sampling.logprobs and row.handle.listening:
            event["logprobs"] = self._logprob_entry(token, logprobs, p.sampling.top_logprobs)
        row.handle.emit(event)
        if finish:
            row.finish = finish
            self.metrics["completion_tokens"] += len(row.tokens)

    def _logprob_entry(self, token, logprobs, top):
        lp = np.asarray(logprobs[0].astype(mx.float32))
        decode = self.processor.tokenizer.decode

        def item(t):
            s = decode([int(t)])
            return {"token": s, "logprob": float(lp[t]), "bytes": list(s.encode("utf-8"))}

        entry = item(token)
        best = np.argsort(-lp, kind="stable")[:top] if top else []
        entry["top_logprobs"] = [item(t) for t in best]
        return entry

    def _finish(self, row: _Row, caches):
        p = row.prepared
        # The last sampled token was never fed, so the cache holds the prompt and the others.
        tokens = p.tokens + row.tokens[:-1]
        if row.finish != "cancelled":
            row.handle.emit({"type": "done", "finish_reason": row.finish, "prompt_tokens": p.prompt_tokens,
                             "completion_tokens": len(row.tokens), "cached_tokens": row.cached})
        self.prefix.insert(tokens[:kv_cache.size(caches)], p.media, caches)


def _settle(model):
    """Evaluate the model's weights and precomputed tables (rotary frequencies) here: a lazy array
    made on this thread's stream cannot be evaluated from the model thread."""
    arrays = []
    for _, module in model.named_modules():
        for value in vars(module).values():
            if isinstance(value, mx.array):
                arrays.append(value)
            elif hasattr(value, "__dict__") and not isinstance(value, type):
                arrays += [a for a in vars(value).values() if isinstance(a, mx.array)]
    mx.eval(arrays, model.parameters())


def _as_api_error(e) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, Qwen3VLError):
        return APIError(400, str(e), code="invalid_input")
    return APIError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error")
