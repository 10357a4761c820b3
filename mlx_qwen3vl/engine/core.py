"""The engine: continuous batching over one model, one step at a time.

Requests are added (`add`) and cancelled (`cancel`) at any time; each `step` decodes one token for
every running row and spends a bounded budget of FLOPs on waiting requests' prefill (vision
tower work and prompt chunks, engine/prefill.py), so streams keep producing tokens while a new
screenshot is encoded. It returns the step's events: `Token` per generated token, `Done` when a
request ends, `Failed` when one cannot be served. Everything is deterministic given the calls,
so several ranks replaying the same calls run the same steps (server/replica.py).
"""

import collections
import dataclasses
import itertools
import os
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

import mlx.core as mx
import numpy as np

from ..backend import backend_of
from ..errors import ConfigError, ContextLengthError, InputError
from ..kv_settings import KVSettings, bytes_per_position, quantize_if_due, resolve
from ..sampling import Sampler, SamplingParams
from ..spans import media_keys
from .answer import AnswerText, close_thinking, eos_token_ids, prompt_opens_thinking, stop_token_set, suppress_stops
from .batch import Batch, Row, cache_bytes
from .caches import FeatureCache, PrefixCache, pipeline_scale
from .draft_model import DraftModel, DraftRow, WithDraft
from .prefill import Costs, PrefillJob, prefill_together, together_cost
from .speculative import DEFAULT_DRAFT, MAX_DRAFT
from .step import sample

FINISH_REASONS = ("stop", "length", "time_limit", "cancelled")
CACHE_STEP = 256  # mlx-lm's KVCache and QuantizedKVCache grow their buffers by this many positions


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


@dataclass
class Request:
    """One prompt to answer. `inputs`: the processor's outputs for it (batch 1).

    `cache` / `start`: the caller's own KV cache (one per layer, model.make_cache()), already
    holding the first `start` positions of this prompt (PromptCache.reuse decides them); the
    request then continues it, bypasses the engine's prefix cache, and its Done event hands the
    cache back holding the prompt and the answer. `time_limit`: seconds from `add` (None: the
    engine's `max_request_seconds`). `tokens` / `media`: the prompt's ids and spans.media_keys,
    when the caller has them already. `kv`: how its KV cache is stored (KVSettings; None: the
    engine's). `on_vision_done(seconds)`: its vision tower's time, once its media are encoded.
    `drafter` (engine/speculative.py): speculative decoding, up to `num_draft_tokens` proposed
    tokens checked per step in the same forward as its last one (lossless: its answer is the one
    it would have had without); a DraftModel (engine/draft_model.py) gets its own prefill and
    caches here."""

    inputs: dict
    params: SamplingParams = field(default_factory=SamplingParams)
    processors: Sequence = ()
    id: Optional[int] = None
    cache: Optional[list] = None
    start: int = 0
    time_limit: Optional[float] = None
    tokens: Optional[List[int]] = None
    media: Optional[list] = None
    kv: Optional[KVSettings] = None
    on_vision_done: Optional[Callable] = None  # called with the vision tower's seconds (a timing hook)
    drafter: Optional[object] = None
    num_draft_tokens: int = DEFAULT_DRAFT


@dataclass
class Token:
    """A generated token of request `id`: `text` is what it releases of the answer (stop-string
    hold-back applied, so the pieces add up to the final text), `logprob` its log-probability,
    `logprobs` the step's log-probabilities over the vocabulary (V,), `top_logprobs` the
    request's `params.top_logprobs` likeliest [(token, logprob)], best first."""

    id: int
    token: int
    text: str
    logprob: float
    logprobs: mx.array
    top_logprobs: list = field(default_factory=list)
    finish_reason: Optional[str] = None  # "stop" / "length" when this token ended the answer
    kv_bytes: int = 0  # KV bytes in use by its request when it was computed (see Done.kv_bytes)
    from_draft: bool = False  # a drafter proposed it and the verify forward kept it (mlx-lm's name)


@dataclass
class Done:
    """Request `id` ended: finish_reason "stop" (EOS or a stop string), "length" (max_tokens, or
    the model's context), "time_limit" or "cancelled". `cache`: the request's own cache, when it
    brought one. `kv_bytes`: the bytes its KV cache's buffers held when its last token was computed
    (in a batch its share, padding included: what kv_bytes() counts for it), on this rank.
    `stop`: the stop string that ended it, when one did."""

    id: int
    finish_reason: str
    text: str
    token_ids: List[int]
    logprobs: List[float]
    prompt_tokens: int
    cached_tokens: int
    cache: Optional[list] = None
    kv_bytes: int = 0
    stop: Optional[str] = None
    draft_proposed: int = 0  # draft tokens its drafter proposed (speculative decoding)
    draft_accepted: int = 0  # of them, kept (its tokens with from_draft)


@dataclass
class Failed:
    """Request `id` could not be served (its inputs, its grammar, or a failed step)."""

    id: int
    error: BaseException


@dataclass
class StepRecord:
    """The scheduler's own account of one step: the rows that got a token, the prefill FLOPs
    spent and the budget they were held to (None: not held), the requests prefilling."""

    tokens: tuple
    prefill_flops: float
    budget: Optional[float]
    prefilling: tuple


class _Waiting:
    def __init__(self, request, sampler, kv):
        self.request, self.sampler, self.kv = request, sampler, kv


class _Job:
    def __init__(self, waiting, job, cached, prompt_tokens):
        self.waiting, self.job, self.cached, self.prompt_tokens = waiting, job, cached, prompt_tokens

    @property
    def id(self):
        return self.waiting.request.id


def fit_to_context(prompt_tokens: int, max_tokens: int, context: int) -> int:
    """The context rule of every entry point: a prompt must leave room for one token of answer
    (else ContextLengthError, before any work), and the answer stops at the context: the most
    tokens it may have, max_tokens or fewer (it then ends with finish_reason "length")."""
    if prompt_tokens >= context:
        raise ContextLengthError(f"the prompt is {prompt_tokens} tokens but the model's context is {context} "
                                 "(max_position_embeddings); shorten it or use fewer or smaller images",
                                 prompt_tokens, context)
    return min(max_tokens, context - prompt_tokens)


def kv_bytes_per_token(model, kind=None) -> int:
    """KV bytes one position of the whole model's cache takes on each rank (from the config, so
    every rank counts the same); `kind`: None (float) or a quantized cache's (bits, group_size)."""
    t = model.config.text_config
    # The keys' dtype is the hidden state's: the embedding's output (a lazy graph, never evaluated).
    itemsize = model.language_model.embed_tokens(mx.zeros((1, 1), mx.int32)).dtype.size
    ranks = model.group.size() if getattr(model, "group", None) is not None else 1
    return bytes_per_position(t.num_hidden_layers, t.num_key_value_heads, t.head_dim, itemsize, kind) // ranks


def auto_kv_budget(model) -> int:
    """Bytes of KV cache the engine admits by default: 3/4 of the device's memory (a Mac's
    recommended GPU working set, else the machine's RAM) less the weights."""
    info = mx.device_info()
    total = info.get("max_recommended_working_set_size") or info.get("memory_size")
    if not total:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(0, int(0.75 * total) - weight_bytes(model))


_WEIGHT_BYTES = {}  # id(model) → its parameters' bytes, while the model lives


def weight_bytes(model) -> int:
    """The bytes of a model's parameters, counted once per model: stream_generate makes an Engine
    per call, and walking every parameter each time cost a 30B MoE's thousands of arrays per turn."""
    key = id(model)
    if key not in _WEIGHT_BYTES:
        _WEIGHT_BYTES[key] = sum(v.nbytes for _, v in _leaves(model.parameters()))
        weakref.finalize(model, _WEIGHT_BYTES.pop, key, None)  # an id is reused once its model is gone
    return _WEIGHT_BYTES[key]


def _leaves(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, f"{prefix}{k}.")
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _leaves(v, f"{prefix}{i}.")
    elif isinstance(tree, mx.array):
        yield prefix, tree


class Engine:
    """Continuous batching over `model`: see the module docstring and README ("Python").

    max_batch: rows decoded together. prefill_step_size: most prompt tokens per decoder chunk.
    prefill_budget: prefill work per step while rows decode, in prompt-token equivalents
      (a prompt token through the decoder; vision work counted by its FLOPs); None: one waiting
      request is prefilled whole per step (as is any while nothing decodes).
    prefix_cache_bytes / feature_cache_bytes: the shared caches (0: off).
    kv_budget_bytes: KV cache the running and prefilling rows may take, "auto" (auto_kv_budget)
      or None (no limit); a request waits until it fits, and one that never can is refused.
    max_request_seconds: time limit of every request (from `add`), None: none.
    lookahead: queue each decode step before handing out the previous one's tokens (default:
      when the backend's forward is lazy, i.e. the plain MLX graph).
    check_time_limits: whether `step` ends requests past their time limit itself (a replicated
      engine is told by rank 0 instead, `expired`).
    kv_bits / kv_group_size / quantized_kv_start: the KV cache of requests that name none
      (mlx-lm's meanings, kv_settings.KVSettings). Rows are decoded in one batch per cache kind
      (float, and each bits / group size), all of them every step; a row moves from the float
      batch to its quantized one when its cache reaches `quantized_kv_start` positions.
    prefix_cache_dir / prefix_cache_dir_bytes: the prefix cache's second tier, a folder of cache
      files (engine/disk.py) kept within that many bytes; written when the engine is idle (at
      the end of a step that leaves nothing to do, unless `flush_when_idle` is False: then the
      caller runs `prefix.flush()`). One process only."""

    def __init__(self, model, processor, *, max_batch=8, prefill_step_size=2048, prefill_budget=None,
                 prefix_cache_bytes=0, feature_cache_bytes=0, kv_budget_bytes="auto", max_request_seconds=None,
                 lookahead=None, check_time_limits=True, clock=time.monotonic, stream=None, kv_bits=None,
                 kv_group_size=None, quantized_kv_start=None, prefix_cache_dir=None, prefix_cache_dir_bytes=8 << 30,
                 flush_when_idle=True):
        from mlx_lm.tokenizer_utils import TokenizerWrapper

        if max_batch < 1:
            raise InputError(f"max_batch = {max_batch} is not allowed; use an integer >= 1")
        self.model, self.processor = model, processor
        self.max_batch, self.prefill_step_size = max_batch, max(1, int(prefill_step_size))
        self.costs = Costs(model.config)
        self.prefill_budget = prefill_budget
        self.budget_flops = None if not prefill_budget else prefill_budget * self.costs.token
        self.context = int(model.config.text_config.max_position_embeddings)
        backend = backend_of(model)
        self.lookahead = (not backend.eager) if lookahead is None else lookahead
        self.eos = eos_token_ids(model, processor)
        self.tokenizer = TokenizerWrapper(processor.tokenizer)
        self.kv = resolve(model, KVSettings.build(kv_bits, kv_group_size, quantized_kv_start))
        disk = None
        if prefix_cache_dir is not None:
            if getattr(model, "group", None) is not None:
                raise ConfigError("a prefix cache folder is not available under several ranks (each rank would have "
                                  "to hold the same entries); leave it out there")
            if not prefix_cache_bytes:
                raise ConfigError("a prefix cache folder needs the in-memory prefix cache too (prefix_cache_bytes > 0)")
            from .disk import DiskTier

            disk = DiskTier(prefix_cache_dir, prefix_cache_dir_bytes, model, self.kv)
        self.flush_when_idle = flush_when_idle
        self.prefix = PrefixCache(prefix_cache_bytes, pipeline_scale(model), disk)
        from ..pipeline import FeatureCounter

        self.features = FeatureCache(feature_cache_bytes, keep=not isinstance(model.visual, FeatureCounter))
        self.kv_per_token = kv_bytes_per_token(model)
        self._kv_per_kind = {None: self.kv_per_token}
        self._draft_kv = {}  # id(draft model) → its KV bytes per position (requests with a DraftModel)
        self.kv_budget = auto_kv_budget(model) if kv_budget_bytes == "auto" else kv_budget_bytes
        self.max_request_seconds = max_request_seconds
        self.check_time_limits, self.clock = check_time_limits, clock
        self.stream = stream
        self.log_softmax = backend.log_softmax
        self.batches = {}  # cache kind (None: float, (bits, group_size)) → Batch
        self.waiting: collections.deque = collections.deque()
        self.jobs: List[_Job] = []  # prefilling, in order (the first is the one being worked on)
        self._cancels = {}  # id → reason, applied at the next step
        self._ids = itertools.count()
        self._deadlines = {}
        self.metrics = collections.Counter()
        self.batch_sizes = collections.Counter()  # decode steps by the number of rows they gave a token
        self.log: collections.deque = collections.deque(maxlen=4096)  # StepRecord per step

    # ------------------------------------------------------------------ requests in
    def add(self, request: Request) -> int:
        """Queue a request; returns its id. Its answer stops at the model's context (its params'
        max_tokens lowered to fit, fit_to_context). Raises InputError for one that can never be
        served (ContextLengthError: a prompt that fills the context; a KV cache larger than the
        whole budget). The caller's Request is left as it was (the same one may be added again)."""
        request = dataclasses.replace(request)
        inputs = request.inputs
        ids = np.asarray(inputs["input_ids"])
        if ids.ndim != 2 or ids.shape[0] != 1:
            raise InputError("an engine request holds one prompt (input_ids of shape (1, L))")
        n = int(ids.shape[1])
        max_tokens = fit_to_context(n, request.params.max_tokens, self.context)
        if max_tokens < request.params.max_tokens:  # the answer stops at the context
            request.params = dataclasses.replace(request.params, max_tokens=max_tokens)
        kv = self.kv if request.kv is None else resolve(self.model, request.kv)
        if isinstance(request.drafter, DraftModel):
            request.drafter.check(self.model, self.processor.tokenizer)
        need = int(self._kv_bytes(kv, n + request.params.max_tokens) * self._with_draft(request))
        if self.kv_budget is not None and need > self.kv_budget:
            raise InputError(f"this request needs {_size(need)} of KV cache ({n} prompt tokens + "
                             f"max_tokens {request.params.max_tokens}) but the engine's KV budget is "
                             f"{_size(self.kv_budget)}; lower max_tokens or the prompt, or raise the budget")
        if request.tokens is None:
            request.tokens = ids[0].tolist()
        if request.media is None:
            request.media = media_keys(inputs)
        if request.drafter is not None and not isinstance(request.drafter, DraftModel) \
                and not callable(getattr(request.drafter, "propose", None)):
            raise InputError("a request's drafter needs a propose(token_ids, k) method")
        if request.drafter is not None and not (isinstance(request.num_draft_tokens, int)
                                                and 0 <= request.num_draft_tokens <= MAX_DRAFT):
            raise InputError(f"num_draft_tokens = {request.num_draft_tokens!r} is not allowed; "
                             f"use an integer in [0, {MAX_DRAFT}]")
        if request.id is None:
            request.id = next(self._ids)
        elif request.id in self._live_ids():
            raise InputError(f"request id {request.id} is already in use by a request of this engine")
        params = request.params
        vocab = self.model.config.text_config.vocab_size
        named = [t for t, _ in params.logit_bias or ()] + list(params.stop_token_ids)
        if named and max(named) >= vocab:
            raise InputError(f"token id {max(named)} is not in this model's vocabulary (ids 0..{vocab - 1})")
        processors = list(request.processors)
        if params.min_tokens and stop_token_set(self.eos, params):
            processors.append(suppress_stops(stop_token_set(self.eos, params), len(request.tokens), params.min_tokens))
        if params.thinking_budget is not None and prompt_opens_thinking(self.tokenizer, request.tokens):
            close = self.tokenizer.convert_tokens_to_ids("</think>")
            processors.append(close_thinking(close, len(request.tokens), params.thinking_budget))
        # The sampler now: an unseeded one draws its seed from MLX's global stream in add order.
        sampler = Sampler(params, processors=processors)
        limit = request.time_limit if request.time_limit is not None else self.max_request_seconds
        deadline = None if limit is None else self.clock() + limit
        self.waiting.append(_Waiting(request, sampler, kv))
        if deadline is not None:
            self._deadlines[request.id] = deadline
        self.metrics["requests"] += 1
        return request.id

    def _live_ids(self) -> set:
        """Ids of the requests waiting, prefilling or decoding."""
        return {w.request.id for w in self.waiting} | {j.id for j in self.jobs} | {r.request.id for r in self.rows}

    def cancel(self, rid: int, reason: str = "cancelled"):
        """End request `rid` at the next step (queued, prefilling or decoding), with Done(reason)."""
        self._cancels.setdefault(rid, reason)

    def expired(self, now: Optional[float] = None) -> List[int]:
        """Ids of requests past their time limit (rank 0 of a replicated engine sends these)."""
        now = self.clock() if now is None else now
        return [rid for rid, d in self._deadlines.items() if d <= now]

    def fingerprint(self) -> tuple:
        """What every rank replaying the same calls must agree on (server/replica.py compares it)."""
        return (self.max_batch, self.prefill_budget, self.kv_budget, self.kv, self.prefix.max_bytes,
                self.features.max_bytes, self.metrics["errors"],
                [(b.kind, [(r.id, len(r.answer.tokens), r.answer.tokens[-1:]) for r in b.rows],
                  b.cache[0].padding() if b.cache else [], b.cache[0].size() if b.cache else 0)
                 for b in self._running()],
                [(j.id, j.job.spent) for j in self.jobs], [w.request.id for w in self.waiting],
                (list(self.prefix.entries), self.prefix.nbytes, self.prefix.reused_tokens),
                (list(self.features.sizes), self.features.hits))

    @property
    def busy(self) -> bool:
        return bool(self.jobs or self.waiting or self._cancels or any(b.rows for b in self.batches.values()))

    @property
    def rows(self) -> List[Row]:
        """The rows being decoded, batch by batch."""
        return [r for b in self._running() for r in b.rows]

    def kv_bytes(self) -> dict:
        """KV cache bytes in use now by the running and prefilling requests: their caches' buffers
        as allocated (mlx-lm's grow in steps of 256 positions; a batch's padding included), in all
        ("bytes") and by cache kind ("by_kind": "float", "8-bit/g64", ...), and the positions they
        hold ("positions"). A draft model's caches count in "bytes" and "by_kind" too, and on
        their own in "draft_bytes". The prefix cache's entries are its own (PrefixCache.stats)."""
        by_kind, positions = collections.Counter(), 0
        jobs = tuple(self.jobs)
        caches = [b.cache for b in self._running()] + [j.job.cache for j in jobs]
        drafts = [r.drafter.cache for r in self.rows if isinstance(r.drafter, DraftRow)] + \
                 [j.job.draft.cache for j in jobs if isinstance(j.job, WithDraft)]
        for cache in caches + drafts:
            if cache and not cache[0].empty():
                kind = cache[0].kind
                by_kind["float" if kind is None else f"{kind[0]}-bit/g{kind[1]}"] += cache_bytes(cache)
        for cache in caches:
            if cache and not cache[0].empty():
                positions += cache[0].size() * max(1, cache[0].batch_size)
        return {"bytes": sum(by_kind.values()), "positions": positions, "by_kind": dict(by_kind),
                "draft_bytes": sum(cache_bytes(c) for c in drafts if c and not c[0].empty())}

    def stats(self) -> dict:
        return {"running": len(self.rows), "prefilling": len(self.jobs), "waiting": len(self.waiting),
                "max_batch": self.max_batch, "kv_budget_bytes": self.kv_budget, "kv_bytes_needed": self._kv_need(),
                "kv_cache": {**self.kv_bytes(), "settings": self.kv.as_dict()},
                **dict(self.metrics),
                # speculative decoding: draft tokens proposed and kept, present (0) when none ran
                "draft_proposed": self.metrics["draft_proposed"], "draft_accepted": self.metrics["draft_accepted"],
                "decode_steps_by_batch_size": {str(k): v for k, v in sorted(self.batch_sizes.items())},
                "prefix_cache": self.prefix.stats(), "vision_feature_cache": self.features.stats()}

    # ------------------------------------------------------------------ the step
    def step(self) -> list:
        """One iteration: time limits and cancellations, one decode step of every running row,
        prefill work within the budget, the tokens handed out. Returns its events."""
        if self.stream is None:
            from mlx_lm.generate import generation_stream

            self.stream = generation_stream
        with mx.stream(self.stream):
            return self._step()

    def run(self):
        """Step until nothing is left to do, yielding each event."""
        while self.busy:
            yield from self.step()

    def _running(self) -> List[Batch]:
        """The batches with rows, float first, then by bits and group size (one order on every rank)."""
        # a snapshot (one C-level copy): /metrics reads this from the server's thread mid-step
        batches = dict(self.batches)
        return [batches[k] for k in sorted(batches, key=lambda k: (k is not None, k or ())) if batches[k].rows]

    def _batch(self, kind) -> Batch:
        if kind not in self.batches:
            self.batches[kind] = Batch(self.model, self.log_softmax, kind)
        return self.batches[kind]

    def _step(self) -> list:
        events = []
        if self.check_time_limits and self._deadlines:
            for rid in self.expired():
                self.cancel(rid, "time_limit")
        if self._cancels:
            self._apply_cancels(events)
        pending = []
        tic = time.perf_counter()
        running = self._running()
        ahead = {}
        if self.lookahead:  # every batch's reads before any batch's next decode: none waits for another's
            for batch in running:
                unread = [i for i, r in enumerate(batch.rows) if r.unread]
                if unread and not any(r.num_draft for r in batch.rows):
                    ahead[id(batch)] = self._queue_reads(list(batch.rows), unread, batch.y, batch.lp)
        for batch in running:
            if any(r.num_draft for r in batch.rows):
                self._speculate(batch, events)
                continue
            rows = list(batch.rows)
            queued = len(pending)
            try:
                if self.lookahead:  # the next step is queued before this one's tokens are read
                    if id(batch) in ahead:
                        pending.append(ahead[id(batch)])
                    batch.measure()  # the cache the pending tokens came from
                    y, lp = batch.decode()
                    mx.async_eval(y, lp)
                    batch.y, batch.lp = y, lp
                else:
                    y, lp = batch.decode()
                    mx.eval(y, lp)
                    batch.y, batch.lp = y, lp
                    batch.measure()
                    self._emit(*self._queue_reads(rows, range(len(rows)), y, lp), events)
            except Exception as e:  # noqa: BLE001 — the batch fails, the engine keeps serving
                del pending[queued:]
                self._fail_rows(batch.rows, e, events)
        self._requantize()
        early = []
        # This step's tokens, queued before any prefill work so that reading them after it waits
        # for nothing queued since (a budgeted chunk runs asynchronously); handed out if it ran.
        if self.lookahead and (self.jobs or self.waiting):
            for batch in self._running():
                unread = [i for i, r in enumerate(batch.rows) if r.unread]
                if unread:
                    early.append((batch, self._queue_reads(list(batch.rows), unread, batch.y, batch.lp)))
        self.metrics["decode_s"] += time.perf_counter() - tic
        tic = time.perf_counter()
        spent, budget, prefilled = self._prefill(events)
        self.metrics["prefill_s"] += time.perf_counter() - tic
        got = tuple(e.id for e in events if isinstance(e, Token))
        for reads in pending:
            try:
                got += self._emit(*reads, events)
            except Exception as e:  # noqa: BLE001
                self._fail_rows([r for r in reads[0] if self._where(r) is not None], e, events)
        if prefilled and self.lookahead:
            # This step's decode ran before the prefill: its tokens go out now rather than after
            # the next step's prefill too (the next decode is then queued after this read).
            for batch, (rows, index, *rest) in early:
                keep = [(r, i) for r, i in zip(rows, index) if r.unread and self._where(r) is not None]
                try:
                    if keep:
                        batch.measure()
                        got += self._emit([r for r, _ in keep], [i for _, i in keep], *rest, events)
                except Exception as e:  # noqa: BLE001
                    self._fail_rows([r for r, _ in keep], e, events)
        self.log.append(StepRecord(got, spent, budget, tuple(j.id for j in self.jobs)))
        self.metrics["steps"] += 1
        if self.flush_when_idle and self.prefix.disk is not None and not self.busy:
            self.prefix.flush()
        if self.metrics["steps"] % 256 == 0:
            mx.clear_cache()
        return events

    def _requantize(self):
        """Rows of the float batch whose cache has reached their kv.start positions: quantized and
        moved to the batch of their kind, before the next decode reads them."""
        batch = self.batches.get(None)
        if batch is None or not batch.rows:
            return
        due = [i for i, r in enumerate(batch.rows) if r.kv.quantized and batch.length(i) >= r.kv.start]
        for row, cache, y, lp, position in batch.take(due) if due else ():
            quantize_if_due(cache, row.kv)
            self._batch(cache[0].kind).join(row, cache, y, lp, position)

    def _where(self, row) -> Optional[Batch]:
        """The batch holding `row` (None: it has left)."""
        for batch in self.batches.values():
            if any(r is row for r in batch.rows):
                return batch
        return None

    # ------------------------------------------------------------------ decode
    def _speculate(self, batch, events):
        """A decode step of a batch holding drafting rows, evaluated now (drafters read the tokens
        so far): tokens queued ahead are handed out first, then each drafting row's last token
        and drafts, and every other row's last token, go through one forward (Batch.verify)."""
        rows = list(batch.rows)
        try:
            unread = [i for i, r in enumerate(rows) if r.unread]
            if unread:
                self._emit(*self._queue_reads(rows, unread, batch.y, batch.lp), events)
            rows = list(batch.rows)
            if not rows:
                return
            drafts, bad = {}, {}
            for i, r in enumerate(rows):
                try:
                    drafts[i] = self._drafts(batch, i, r)
                except Exception as e:  # noqa: BLE001 — a drafter's failure is its own request's
                    bad[i] = e
            if bad:  # those requests fail; the rest of the batch goes on
                batch.remove(list(bad))
                for i, e in bad.items():
                    self._deadlines.pop(rows[i].id, None)
                    self.metrics["errors"] += 1
                    events.append(Failed(rows[i].id, e))
                rows = [r for i, r in enumerate(rows) if i not in bad]
                if not rows:
                    return
            drafts = [d for _, d in sorted(drafts.items())]
            if not any(drafts):
                y, lp = batch.decode()
                mx.eval(y, lp)
                batch.y, batch.lp = y, lp
                batch.measure()
                self._emit(*self._queue_reads(rows, range(len(rows)), y, lp), events)
                return
            runs = batch.verify(drafts, [r.draft_q for r in rows])
            batch.measure()
        except Exception as e:  # noqa: BLE001 — the batch fails, the engine keeps serving
            self._fail_rows(batch.rows, e, events)
            return
        self.batch_sizes[len(rows)] += 1
        self.metrics["decode_steps"] += 1
        self.metrics["verify_steps"] += 1
        done = []
        for row, drafted, (tokens, lps, n) in zip(rows, drafts, runs):
            row.proposed += len(drafted)
            self.metrics["draft_proposed"] += len(drafted)
            for i, (token, lp) in enumerate(zip(tokens, lps)):
                from_draft = i < n
                row.accepted += from_draft
                self.metrics["draft_accepted"] += from_draft
                self._token(row, token, lp, events, from_draft=from_draft)
                if row.answer.finish:
                    done.append(row)
                    break
        if done:
            self._leave(done, events)

    def _drafts(self, batch, i, row) -> list:
        """Row `i`'s drafts for this step: at most its num_draft_tokens, none past its max_tokens,
        and none that would go past its quantized_kv_start while its cache is float (the plain
        run attends to those positions quantized)."""
        row.draft_q = None
        if row.drafter is None or not row.num_draft:
            return []
        k = min(row.num_draft, row.request.params.max_tokens - len(row.answer.tokens) - 1)
        if batch.kind is None and row.kv is not None and row.kv.quantized:
            k = min(k, row.kv.start - batch.length(i) - 1)
        if k <= 0:
            return []
        vocab = self.model.config.text_config.vocab_size
        drafts = []
        for t in list(row.drafter.propose(row.request.tokens + row.answer.tokens, k))[:k]:
            t = int(t)
            if not 0 <= t < vocab:
                raise InputError(f"the drafter proposed token {t}, outside the vocabulary [0, {vocab})")
            drafts.append(t)
        q = getattr(row.drafter, "q", None)  # a sampling drafter's q (DraftRow), for the rule
        row.draft_q = q[:len(drafts)] if q is not None and not row.sampler.greedy else None
        return drafts

    def _queue_reads(self, rows, index, y, lp):
        """What `_emit` reads of rows `index` of a batch's `rows` (y (B,), lp (B, V) made with them),
        queued now: with lookahead the next decode step is queued after these, and an array first
        evaluated when the tokens are handed out would wait for that step to finish."""
        index = list(index)
        chosen = mx.take_along_axis(lp, y[:, None], axis=-1)[:, 0].astype(mx.float32)
        top = lp.astype(mx.float32) if any(rows[i].request.params.top_logprobs for i in index) else None
        own = {i: lp[i] for i in index}  # each Token's logprobs, which its reader may evaluate
        mx.async_eval(y, chosen, *own.values(), *([top] if top is not None else []))
        return [rows[i] for i in index], index, y, own, chosen, top

    def _emit(self, rows, index, y, own, chosen, top, events) -> tuple:
        """Hand out a decode step's tokens of `rows`, rows `index` of its y (B,), with their rows of
        its log-probabilities (`own`, by index), the chosen tokens' log-probabilities `chosen` (B,)
        and, when a row wants top log-probabilities, all of them in float32 (`top`), as
        `_queue_reads` queued them. Rows that finish leave their batch."""
        tokens, chosen = y.tolist(), chosen.tolist()
        top = np.asarray(top) if top is not None else None
        got, done = [], []
        for row, b in zip(rows, index):
            self._token(row, tokens[b], own[b], events, chosen[b], top=top[b] if top is not None else None)
            got.append(row.id)
            if row.answer.finish:
                done.append(row)
        if rows:
            self.batch_sizes[len(rows)] += 1
            self.metrics["decode_steps"] += 1
        if done:
            self._leave(done, events)
        return tuple(got)

    def _token(self, row: Row, token: int, logprobs, events, logprob=None, from_draft=False, top=None):
        """Row `row`'s next token out as a Token event; `logprob` / `top` (the row's log-probs in
        float32, numpy): read already, else read from `logprobs` (V,) here."""
        piece = row.answer.add(token)
        logprob = float(logprobs[token]) if logprob is None else logprob
        row.logprobs.append(logprob)
        best = []
        k = row.request.params.top_logprobs
        if k:
            lp = np.asarray(logprobs.astype(mx.float32)) if top is None else top
            best = [(int(t), float(lp[t])) for t in np.argsort(-lp, kind="stable")[:k]]
        events.append(Token(row.id, token, piece, logprob, logprobs, best, row.answer.finish, row.kv_bytes,
                            from_draft))

    def _leave(self, rows, events, reason=None):
        """Rows out of their batches: their caches to the prefix cache (or back to their request)."""
        for batch in self._running():
            index = {id(r): i for i, r in enumerate(batch.rows)}
            mine = [r for r in rows if id(r) in index]
            if not mine:
                continue
            keep = [index[id(r)] for r in mine if r.request.cache is not None or self.prefix.max_bytes]
            caches = batch.remove([index[id(r)] for r in mine], keep_caches=keep)
            for row in mine:
                cache = caches.get(index[id(row)])
                if cache is not None and row.request.cache is None:
                    self.prefix.insert(row.request.tokens + row.answer.tokens[:-1], row.request.media, cache, row.kv)
                    cache = None
                self._finish(row, reason or row.answer.finish, cache, events)

    def _finish(self, row: Row, reason: str, cache, events):
        self._deadlines.pop(row.id, None)
        if isinstance(row.drafter, DraftRow):  # its draft cache to the draft model's prefix cache
            row.drafter.close(row.request.tokens + row.answer.tokens[:-1])
        self.metrics["completion_tokens"] += len(row.answer.tokens)
        if reason in ("cancelled", "time_limit"):
            self.metrics[reason] += 1
        a = row.answer
        events.append(Done(row.id, reason, a.text, list(a.tokens), list(row.logprobs), row.prompt_tokens,
                           row.cached, cache, row.kv_bytes, a.stopped_by, row.proposed, row.accepted))

    def _fail_rows(self, rows, error, events):
        """A failed decode: the batches holding `rows` fail whole (their caches are in doubt)."""
        self.metrics["errors"] += 1
        for batch in {id(b): b for b in (self._where(r) for r in rows) if b is not None}.values():
            for row in batch.rows:
                self._deadlines.pop(row.id, None)
                events.append(Failed(row.id, error))
            self.batches[batch.kind] = Batch(self.model, self.log_softmax, batch.kind)

    # ------------------------------------------------------------------ cancellations
    def _apply_cancels(self, events):
        cancels, self._cancels = self._cancels, {}
        kept = collections.deque()
        for w in self.waiting:
            reason = cancels.pop(w.request.id, None)
            if reason is None:
                kept.append(w)
            else:
                self._end_unstarted(w.request, reason, 0, events, 0)
        self.waiting = kept
        for j in list(self.jobs):
            reason = cancels.pop(j.id, None)
            if reason is not None:
                self.jobs.remove(j)
                held = cache_bytes(j.job.cache)
                self._drop_job(j)
                self._end_unstarted(j.waiting.request, reason, j.cached, events, held)
        by_reason = collections.defaultdict(list)
        for r in self.rows:
            if r.id in cancels:
                by_reason[cancels[r.id]].append(r)
        for reason, rows in by_reason.items():
            self._leave(rows, events, reason)

    def _end_unstarted(self, request, reason, cached, events, kv_bytes):
        self._deadlines.pop(request.id, None)
        self.metrics[reason] += 1
        events.append(Done(request.id, reason, "", [], [], len(request.tokens), cached,
                           self._restored(request), kv_bytes))

    @staticmethod
    def _restored(request):
        """A request's own cache as it was before its prefill began (a quantized one stays
        quantized: the caller's reuse rule, PromptCache.reuse, then starts it afresh)."""
        if request.cache is None:
            return None
        for c in request.cache:
            c.trim_to(request.start)
        return request.cache

    def _drop_job(self, j):
        if j.waiting.request.cache is not None:
            self._restored(j.waiting.request)

    # ------------------------------------------------------------------ prefill
    def _kv_bytes(self, kv: KVSettings, length: int) -> int:
        """Bytes a cache of `kv` reaches at `length` positions: float until kv.start, then the
        quantized copy (the float one it replaces counted until then). Caches grow in steps of
        CACHE_STEP positions, so a length counts as the buffer holding it."""
        f = self.kv_per_token
        length = -(-length // CACHE_STEP) * CACHE_STEP
        if not kv.quantized or length < kv.start:
            return length * f
        if kv.kind not in self._kv_per_kind:
            self._kv_per_kind[kv.kind] = kv_bytes_per_token(self.model, kv.kind)
        return max(kv.start * f, length * self._kv_per_kind[kv.kind])

    def _with_draft(self, request) -> float:
        """A request's KV bytes over its own cache's: 1, or with a draft model's caches beside it
        (the draft's bytes per position over the model's: counted as growing alike)."""
        draft = request.drafter
        if not isinstance(draft, DraftModel):
            return 1.0
        if id(draft.model) not in self._draft_kv:
            self._draft_kv[id(draft.model)] = kv_bytes_per_token(draft.model)
        return 1.0 + self._draft_kv[id(draft.model)] / self.kv_per_token

    def _kv_need(self, extra=None) -> int:
        """Bytes the batches' caches can reach: every row (running, prefilling, `extra`) padded to
        the longest row of the kind its cache ends as, until the row with the most tokens left
        there ends."""
        members = collections.defaultdict(list)  # final kind → [(kv, width, tokens left, _with_draft)]
        for batch in self._running():
            width = batch.cache[0].size()
            for row in batch.rows:
                n, left = row.prompt_tokens + len(row.answer.tokens), row.request.params.max_tokens - len(row.answer.tokens)
                members[_final_kind(row.kv, n + left)].append((row.kv, max(width, n), left,
                                                               self._with_draft(row.request)))
        for w in [j.waiting for j in self.jobs] + ([extra] if extra is not None else []):
            n, left = len(w.request.tokens), w.request.params.max_tokens
            members[_final_kind(w.kv, n + left)].append((w.kv, n, left, self._with_draft(w.request)))
        total = 0
        for group in members.values():
            length = max(m[1] for m in group) + max(m[2] for m in group)
            total += sum(int(self._kv_bytes(kv, length) * share) for kv, _, _, share in group)
        return total

    def _admit(self, events) -> Optional[_Job]:
        """The next waiting request's prefill, if one fits (rows and KV budget), else None."""
        while self.waiting:
            running = len(self.rows)
            if running + len(self.jobs) >= self.max_batch:
                return None
            w = self.waiting[0]
            if self.kv_budget is not None and (running or self.jobs) and self._kv_need(w) > self.kv_budget:
                return None  # waits until rows leave
            self.waiting.popleft()
            try:
                return self._start(w)
            except Exception as e:  # noqa: BLE001 — this request fails, the others go on
                self._deadlines.pop(w.request.id, None)
                self.metrics["errors"] += 1
                if w.request.cache is not None:
                    self._restored(w.request)
                events.append(Failed(w.request.id, e))
        return None

    def _start(self, w: _Waiting) -> _Job:
        r = w.request
        if r.cache is not None:
            cache, start = r.cache, r.start
        else:
            eid, start = self.prefix.lookup(r.inputs, w.kv) if self.prefix.max_bytes else (None, 0)
            if start:
                cache = self.prefix.take(eid, start)
            else:
                self.prefix.misses += bool(self.prefix.max_bytes)
                cache = self.model.make_cache()
        decoding = bool(self.rows)
        item_budget = self.budget_flops if decoding else None
        job = PrefillJob(self.model, r.inputs, cache, start=start,
                         features=self.features if self.features.max_bytes else None,
                         item_budget=item_budget, prefill_step_size=self.prefill_step_size, costs=self.costs,
                         kv=w.kv, on_vision_done=r.on_vision_done)
        if isinstance(r.drafter, DraftModel):  # the draft model's own prefill, after this one's
            job = WithDraft(job, r.drafter.start(r, w.kv, item_budget=item_budget,
                                                 prefill_step_size=self.prefill_step_size))
        n = len(r.tokens)
        self.metrics["prompt_tokens"] += n
        self.metrics["prompt_tokens_computed"] += n - start
        j = _Job(w, job, start, n)
        self.jobs.append(j)
        return j

    def _prefill(self, events):
        """Prefill work of this step → (FLOPs spent, budget held to or None, whether any prefill
        work was done). A request prefilled
        whole (nothing decoding, or no budget) ends the step's prefill: its first token goes out
        with this step's events, not after the next request's prefill too. Short text prompts
        waiting together go through one forward (`_together`)."""
        spent, held, worked = 0.0, None, False
        evaluate = "async" if self.lookahead else True
        while True:
            budget = self.budget_flops if (self.budget_flops and self.rows) else None
            group = self._together(events, budget, spent)
            if not group:
                break
            j = group[0]
            if budget is not None:
                held = budget
                if spent >= budget:
                    break
            worked = True
            if len(group) > 1:
                spent += self._prefill_together(group, events)
                if budget is None:
                    break
                continue
            try:
                if budget is None:
                    j.job.advance(None)
                else:
                    spent += j.job.advance(budget - spent, force_first=spent == 0, evaluate=evaluate)
                if not j.job.done:
                    break
                self.jobs.remove(j)
                self._complete(j, events)
                if budget is None:
                    break
            except Exception as e:  # noqa: BLE001 — this request fails, the others go on
                if j in self.jobs:
                    self.jobs.remove(j)
                self._fail_job(j, e, events)
        return spent, held, worked

    def _fail_job(self, j: _Job, error, events):
        self._drop_job(j)
        self._deadlines.pop(j.id, None)
        self.metrics["errors"] += 1
        events.append(Failed(j.id, error))

    def _together(self, events, budget, spent) -> List[_Job]:
        """The jobs of the next prefill work: the first job (a waiting request admitted when none
        is prefilling), and, when it is one decoder chunk of text (PrefillJob.one_chunk: its media
        are before its cached prefix or have their features cached), the jobs after it that are
        too and of its cache kind, admitted in turn (others passed over, keeping their order),
        while they fit one forward: their tokens (packed) within prefill_step_size, its FLOPs
        within what is left of `budget`. Requests with a cache of their own (their caller's
        cache is continued in place) or a draft model (its own prefill follows) go alone."""
        first = self.jobs[0] if self.jobs else self._admit(events)
        if first is None or not self._joinable(first):
            return [first] if first is not None else []
        group, kind = [first], first.job.cache[0].kind
        seen = 1  # jobs looked at; the others (another cache kind, media work) keep their order
        while True:
            j = self.jobs[seen] if seen < len(self.jobs) else (self._admit(events) if self.waiting else None)
            if j is None:
                break
            seen += 1
            if not self._joinable(j) or j.job.cache[0].kind != kind:
                continue
            trial = group + [j]
            if sum(g.job.length for g in trial) > self.prefill_step_size:
                break
            if budget is not None and spent + together_cost([g.job for g in trial]) > budget:
                break
            group = trial
        return group

    @staticmethod
    def _joinable(j: _Job) -> bool:
        if j.waiting.request.cache is not None or not isinstance(j.job, PrefillJob):  # own cache, a draft's prefill
            return False
        try:
            return j.job.one_chunk()
        except Exception:  # noqa: BLE001 — its prefill alone reports the error
            return False

    def _prefill_together(self, group: List[_Job], events) -> float:
        """`group`'s prompts through one forward (prefill.prefill_together), their first tokens
        sampled, the rows joined to their batch → FLOPs spent."""
        jobs = [j.job for j in group]
        cost = together_cost(jobs)
        for j in group:
            self.jobs.remove(j)
        try:
            logits, positions, cache = prefill_together(jobs)
            waiting = [j.waiting for j in group]
            histories = [mx.array(w.request.tokens) if w.sampler.processors else None for w in waiting]
            y, lp = sample(logits, [w.sampler for w in waiting], histories, self.log_softmax)
        except Exception as e:  # noqa: BLE001 — these requests fail, the others go on
            for j in group:
                self._fail_job(j, e, events)
            return cost
        self.metrics["prefills_together"] += 1
        self.metrics["prefilled_together"] += len(group)
        self._complete_together(group, y, lp, positions, cache, histories, events)
        return cost

    def _complete_together(self, group, y, lp, positions, cache, histories, events):
        """_complete for rows prefilled together (one cache holding them all, in order)."""
        rows = []
        share = cache_bytes(cache) // len(group)
        for j, history in zip(group, histories):
            r, w = j.waiting.request, j.waiting
            row = Row(r, w.sampler, AnswerText(self.tokenizer.detokenizer, self.eos, r.params), j.prompt_tokens,
                      j.cached, history, w.kv)
            row.made, row.kv_bytes = 1, share
            rows.append(row)
        batch = self._batch(cache[0].kind)
        own = [lp[b] for b in range(len(rows))]  # each Token's logprobs, read later
        mx.eval(y, lp, *own)  # read at once, as _complete's
        for b, (row, token) in enumerate(zip(rows, y.tolist())):
            self._token(row, token, own[b], events)
        keep = [b for b, row in enumerate(rows) if not row.answer.finish]
        for b, row in enumerate(rows):
            if row.answer.finish:
                if self.prefix.max_bytes:
                    self.prefix.insert(row.request.tokens[:row.held], row.request.media,
                                       [c.extract(b, row.held) for c in cache], row.kv)
                self._finish(row, row.answer.finish, None, events)
        if not keep:
            return
        if len(keep) < len(rows):
            for c in cache:
                c.filter(keep)
            index = mx.array(keep)
            y, lp, positions = y[index], lp[index], positions[index]
        batch.join([rows[b] for b in keep], cache, y, lp, positions)

    def _complete(self, j: _Job, events):
        """A finished prefill: sample its first token, then join the batch of its cache's kind (or
        end at once)."""
        r, w = j.waiting.request, j.waiting
        logits, position = j.job.result()
        history = mx.array(r.tokens) if w.sampler.processors else None
        y, lp = sample(logits, [w.sampler], [history], self.log_softmax)
        answer = AnswerText(self.tokenizer.detokenizer, self.eos, r.params)
        row = Row(r, w.sampler, answer, j.prompt_tokens, j.cached, history, w.kv)
        if isinstance(j.job, WithDraft):
            row.drafter = j.job.draft
            row.drafter.begin(w.sampler, self.log_softmax)
        row.made = 1
        cache = j.job.cache
        row.kv_bytes = cache_bytes(cache)  # the cache its first token came from
        batch = self._batch(cache[0].kind)
        # Read at once, lookahead or not: its first token goes out with this step's events rather
        # than behind the next decode step (one step sooner to the first token).
        own = lp[0]  # its Token's logprobs, read later
        mx.eval(y, lp, own)
        self._token(row, int(y.item()), own, events)
        if answer.finish:
            if r.cache is None:
                if self.prefix.max_bytes:
                    self.prefix.insert(r.tokens[:row.held], r.media, cache, w.kv)
                cache = None
            else:
                for c in cache:
                    c.trim_to(row.held)
            self._finish(row, answer.finish, cache, events)
            return
        batch.join(row, cache, y, lp, position)


def _final_kind(kv: KVSettings, length: int):
    """The kind of cache a request of `kv` ends with at `length` positions."""
    return kv.kind if kv.quantized and length >= kv.start else None
