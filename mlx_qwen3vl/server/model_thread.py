"""The model thread: the library's engine (mlx_qwen3vl.engine) behind HTTP.

One thread owns the model. Each iteration takes what the HTTP side did since the last (requests
submitted, clients gone away), hands it to the engine, runs one engine step (one decode token for
every running row, a bounded share of the waiting requests' prefill) and routes the step's events
to each request's asyncio queue as prepared.TokenEvent / DoneEvent / ErrorEvent (the API's error).

Under `mlx.launch` every rank runs this loop on its shard of the model (replica.py): rank 0 takes
requests from HTTP and broadcasts each iteration's inputs (the requests, the cancellations, the
requests past their time limit); the others replay them, so every rank's engine runs the same
steps. With one process nothing is exchanged.
"""

import collections
import itertools
import threading
import time

import mlx.core as mx

from ..engine import Done, Failed, Token, token_bytes
from ..engine import Engine
from ..engine.draft_model import DraftModel
from ..errors import Qwen3VLError
from .prepared import DoneEvent, ErrorEvent, Handle, Prepared, TokenEvent  # noqa: F401  (Prepared: the unit)
from .protocol import APIError
from .replica import Orders, digest


class ModelThread:
    """The server's side of the engine: a thread, a queue of submitted requests, event routing.
    `core` is the library Engine; `prefix` and `features` its shared caches."""

    def __init__(self, model, processor, *, max_batch=8, max_queue=64, prefill_step_size=2048, prefill_budget=256,
                 prefix_cache_bytes=2 << 30, feature_cache_bytes=512 << 20, default_max_tokens=512,
                 kv_cache_bytes="auto", max_request_seconds=None, replicas=None, kv_bits=None, kv_group_size=None,
                 quantized_kv_start=None, prefix_cache_dir=None, prefix_cache_dir_bytes=8 << 30, drafting=None):
        self.model, self.processor = model, processor
        self.drafting = drafting or {}  # the server's speculative decoding (Request's drafter, num_draft_tokens)
        self.max_batch, self.max_queue = max_batch, max_queue
        self.prefill_step_size = prefill_step_size
        self.default_max_tokens = default_max_tokens
        self.replicas = replicas  # replica.Leader / Follower on several ranks, else None
        # Several ranks: the step is evaluated before the next exchange (no step queued ahead, whose
        # collectives would meet the exchange's), and rank 0 alone reads the clock for time limits.
        self.core = Engine(model, processor, max_batch=max_batch, prefill_step_size=prefill_step_size,
                            prefill_budget=prefill_budget or None, prefix_cache_bytes=prefix_cache_bytes,
                            feature_cache_bytes=feature_cache_bytes, kv_budget_bytes=kv_cache_bytes,
                            max_request_seconds=max_request_seconds,
                            lookahead=False if replicas is not None else None,
                            check_time_limits=replicas is None, kv_bits=kv_bits, kv_group_size=kv_group_size,
                            quantized_kv_start=quantized_kv_start, prefix_cache_dir=prefix_cache_dir,
                            prefix_cache_dir_bytes=prefix_cache_dir_bytes, flush_when_idle=False)
        if replicas is not None and self.core.kv_budget is not None:
            self.core.kv_budget = replicas.agree_min(self.core.kv_budget)  # the smallest machine's
        self.prefix, self.features = self.core.prefix, self.core.features
        self.context = self.core.context  # the library engine's: its rule (fit_to_context) caps answers
        self._pending: collections.deque = collections.deque()
        self._reserved = 0  # slots held by requests being built (Slot)
        self._handles = {}  # engine request id → Handle (or a replica's ghost)
        self._cv = threading.Condition()
        self._stopping = False
        self._ids = itertools.count()
        self._iteration = 0
        self.metrics = collections.Counter()
        _settle(model)
        if isinstance(self.drafting.get("drafter"), DraftModel):
            _settle(self.drafting["drafter"].model)
        self._thread = threading.Thread(target=self._run, name="mlx_qwen3vl-model", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ called from the HTTP side
    def _check_room(self):
        """A 503 when --max-queue requests wait already: submitted, or holding a slot while their
        media are read and their prompt built (under self._cv)."""
        waiting = len(self._pending) + len(self.core.waiting) + self._reserved
        if waiting >= self.max_queue:
            self.metrics["rejected"] += 1
            raise APIError(503, f"the server is busy ({waiting} requests waiting); retry shortly",
                           code="queue_full", headers={"Retry-After": "1"})

    def reserve(self) -> "Slot":
        """A place in the queue for a request about to be built (before any of its media is read):
        a full queue refuses it here, before the work."""
        with self._cv:
            self._check_room()
            self._reserved += 1
        return Slot(self)

    def submit(self, prepared: Prepared, loop, slot: "Slot" = None) -> Handle:
        """Queue `prepared` in the place `slot` holds (or a new one, if there is room)."""
        handle = Handle(prepared, loop)
        with self._cv:
            if slot is not None and slot.held:
                slot.held = False
                self._reserved -= 1
            else:
                self._check_room()
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
        out = self.core.stats()
        with self._cv:
            out["waiting"] += len(self._pending)
        out["max_queue"] = self.max_queue
        for k, v in self.metrics.items():
            out[k] = out.get(k, 0) + v
        return out

    # ------------------------------------------------------------------ the worker loop
    def _run(self):
        # MLX streams belong to the thread that made them: the model thread makes its own.
        mx.set_default_stream(mx.new_stream(mx.default_device()))
        self.core.stream = mx.default_stream(mx.default_device())
        try:
            while True:
                orders = self._orders()
                if self.replicas is not None:
                    tic = time.perf_counter()
                    orders = self.replicas.exchange(orders, self._state())
                    self.metrics["exchange_s"] += time.perf_counter() - tic  # includes waiting for the others
                if orders.stop:
                    self.core.prefix.flush()
                    return
                self._apply(orders)
                if self.core.busy:
                    self._route(self.core.step())
                    if not self.core.busy:  # idle: the disk tier's writes, after the answers went out
                        self.core.prefix.flush()
                self._iteration += 1
        except BaseException as e:
            if self.replicas is None:
                raise
            self.replicas.fail(e)  # ends this rank; mlx.launch stops the others

    def _orders(self):
        """This iteration's inputs from the HTTP side (rank 0 / one process): the requests to add,
        those whose clients went away or that passed their time limit, or stop. Waits while there
        is nothing to do."""
        if self.replicas is not None and self.replicas.rank != 0:
            return None  # the others receive rank 0's orders
        with self._cv:
            while not self._pending and not self.core.busy and not self._stopping:
                self._cv.wait()
            if self._stopping:
                return Orders(stop=True)
            admit = list(self._pending)
            self._pending.clear()
        orders = Orders(cancel=[rid for rid, h in self._handles.items() if h.cancelled])
        self.metrics["cancelled"] += sum(h.cancelled for h in admit)
        orders.admit = [h for h in admit if not h.cancelled]
        for handle in orders.admit:
            handle.id = next(self._ids)
        if self.replicas is not None:  # one clock for every rank: rank 0's
            orders.expire = [rid for rid in self.core.expired() if rid not in orders.cancel]
        return orders

    def _apply(self, orders):
        for handle in orders.admit:
            try:
                self.core.add(handle.prepared.request(handle.id, self.core.kv, self.drafting))
            except Exception as e:  # noqa: BLE001 — the request fails, the server keeps serving
                self._failed(e)
                handle.emit(ErrorEvent(_as_api_error(e)))
                continue
            self._handles[handle.id] = handle
        for rid in orders.cancel:
            self.core.cancel(rid)
        for rid in orders.expire:
            self.core.cancel(rid, "time_limit")

    def _route(self, events):
        for ev in events:
            handle = self._handles.get(ev.id)
            if handle is None:
                continue
            if isinstance(ev, Token):
                lp = self._logprob_entry(ev) if handle.prepared.sampling.logprobs and handle.listening else None
                handle.emit(TokenEvent(ev.text, ev.token, lp))
            elif isinstance(ev, Done):
                del self._handles[ev.id]
                if ev.finish_reason != "cancelled":
                    handle.emit(DoneEvent(ev.finish_reason, ev.prompt_tokens, len(ev.token_ids), ev.cached_tokens,
                                          ev.stop, draft_proposed=ev.draft_proposed, draft_accepted=ev.draft_accepted))
            elif isinstance(ev, Failed):
                del self._handles[ev.id]
                self._failed(ev.error)
                handle.emit(ErrorEvent(_as_api_error(ev.error)))

    def _failed(self, e):
        """On several ranks only the errors every rank raises alike (the inputs' and the grammar's,
        before or after the model's collectives) leave the ranks in step; any other ends the rank."""
        if self.replicas is not None and not isinstance(e, (APIError, Qwen3VLError)):
            raise e
        self.metrics["server_errors"] += 1

    def _logprob_entry(self, ev: Token):
        decode = self.processor.tokenizer.decode

        def item(t, lp):
            s = decode([int(t)])
            return {"token": s, "logprob": lp, "bytes": list(token_bytes(self.processor.tokenizer, t))}

        entry = item(ev.token, ev.logprob)
        entry["top_logprobs"] = [item(t, lp) for t, lp in ev.top_logprobs]
        return entry

    def _state(self) -> int:
        """A digest of what every rank must agree on before the next iteration."""
        return digest(self._iteration, self.max_batch, self.prefill_step_size, self.default_max_tokens,
                      self.core.fingerprint())


class Slot:
    """A request's place in the queue from before its media are read until it is submitted (or
    given back: a count, an error)."""

    def __init__(self, engine: ModelThread):
        self.engine, self.held = engine, True

    def release(self):
        with self.engine._cv:
            if self.held:
                self.held = False
                self.engine._reserved -= 1


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
