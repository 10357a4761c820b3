"""What every endpoint shares, whatever protocol it speaks: one admission path (`Service.admit`),
the set of running requests the server ends when it stops, and waiting for a whole answer while
watching the client. app.py builds one; chat.py, responses.py, messages.py and grounding take it.

Admission, in this order, for every endpoint: the API key; the body, read up to --max-body-bytes;
then, on a small parse pool (never the event loop), the JSON with its nesting and item count
bounded and the protocol's own checks; a place in the queue (503 when --max-queue requests wait,
before any media is read); the media and the prompt built on the preparation pool (a thread per
queued request; media work limited to model_inputs.MEDIA_WORKERS at once, text-only requests
never behind it); the engine.
"""

import asyncio
import contextlib
import dataclasses
import functools
import hmac
import inspect
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, StreamingResponse

from . import protocol as P
from .computer_answers import ComputerAnswers
from .prepared import DoneEvent, ErrorEvent, TokenEvent
from .protocol import APIError


def as_api_error(e: BaseException) -> APIError:
    """An exception as the API's error: an unexpected one is a 500 naming only its type (its text
    may hold server paths)."""
    if isinstance(e, APIError):
        return e
    return APIError(500, f"internal error ({type(e).__name__})", code="internal_error")


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down; this request was not finished", code="server_shutdown",
                    headers={"Retry-After": "5"})


async def read_body(request: Request, limit: int) -> bytearray:
    too_big = APIError(413, f"the request body is larger than this server's limit of {limit} bytes; send "
                       "smaller images (or start the server with a larger --max-body-bytes)", code="body_too_large")
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > limit:
        raise too_big
    body = bytearray()  # one buffer: a list of chunks joined at the end would hold the body twice
    try:
        async for chunk in request.stream():
            if len(body) + len(chunk) > limit:
                raise too_big
            body += chunk
    except ClientDisconnect:  # gone (or closed by a read deadline): nobody reads the answer
        raise APIError(400, "the client went away before its body arrived", code="client_disconnected") from None
    return body


MAX_JSON_ITEMS = 200_000  # objects and lists in one body (counted before parsing, as brackets)
PARSE_WORKERS = 2  # bodies parsed at once
# Requests being built at once: each holds a place in the queue, so there are at most --max-queue;
# one thread each, so that a text-only request never waits for a thread behind requests waiting
# for one of model_inputs.MEDIA_WORKERS media places (threads start only as requests come).
MAX_PREPARE_THREADS = 256


def parse_json(raw: bytearray):
    """The body as JSON (UTF-8, RFC 8259), its objects and lists counted before parsing (an upper
    bound: brackets inside strings count too). The raw bytes are released before parsing: a large
    body is held at most twice (its text, then what is parsed from it)."""
    items = raw.count(b"{") + raw.count(b"[")
    if items > MAX_JSON_ITEMS:
        raise APIError(400, f"the request body holds more than {MAX_JSON_ITEMS} objects and lists; send fewer "
                       "messages or parts", code="too_many_items")
    try:
        text = raw.decode("utf-8-sig")  # a leading BOM is tolerated, as json.loads(bytes) does
        raw.clear()
        body = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e})", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, f"the request body is nested deeper than {P.MAX_JSON_DEPTH} levels",
                       code="too_deep") from None
    P.check_json(body)
    return body


async def _completed(result):
    if inspect.isawaitable(result):
        await result


async def disconnected(request: Request):
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Service:
    """One server's shared state for its endpoints. `running`: handles being answered; `stopping`
    becomes true once the server stops (new requests are refused)."""

    def __init__(self, engine, builder, *, model_id: str, api_key: Optional[str], max_body_bytes: int,
                 agent_format: str = "qwen", computer_answers=None, agent_history=None):
        self.engine, self.builder, self.model_id = engine, builder, model_id
        # the answers behind the computer-use calls this server issued (computer_answers.py)
        self.computer_answers = computer_answers if computer_answers is not None else ComputerAnswers()
        self.api_key, self.max_body_bytes = api_key, max_body_bytes
        self.agent_format = agent_format  # the computer-use prompt: --agent-format
        self.agent_history = agent_history  # the earlier steps it replays: --agent-history (None: the format's)
        self.running = set()
        self.stopping = False
        self.built = 0  # requests whose media and prompt were built (each after its place in the queue)
        self.parse_pool = ThreadPoolExecutor(PARSE_WORKERS, thread_name_prefix="mlx_qwen3vl-parse")
        threads = min(max(getattr(engine, "max_queue", 1), 1) + 1, MAX_PREPARE_THREADS)
        self.prepare_pool = ThreadPoolExecutor(threads, thread_name_prefix="mlx_qwen3vl-prepare")

    @property
    def processor(self):
        return self.engine.processor

    def check_auth(self, request: Request):
        """With a key, `Authorization: Bearer KEY` or (Anthropic's clients) `x-api-key: KEY`."""
        if self.api_key is None:
            return
        key = self.api_key.encode()
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key):
            return
        given = request.headers.get("x-api-key")
        if given is not None and hmac.compare_digest(given.strip().encode(), key):
            return
        raise APIError(401, "missing or wrong API key; send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def _on(self, pool, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args))

    async def json(self, make) -> JSONResponse:
        """A JSON answer, `make()`'s object, built and serialised on the parse pool: an object as
        large as a body (a stored response, an echo of a request's instructions and tools) must
        not hold the event loop."""
        return await self._on(self.parse_pool, lambda: JSONResponse(make()))

    async def read(self, request: Request, parse):
        """Admission up to the queue: the key, the body (size), then on the parse pool the JSON
        (nesting, items) and `parse(body)` (the protocol's checks) → what `parse` returns."""
        self.check_auth(request)
        if self.stopping:
            raise shutting_down()
        raw = await read_body(request, self.max_body_bytes)
        return await self._on(self.parse_pool, lambda: parse(parse_json(raw)))

    async def admit(self, request: Request, parse, build, *, submit: bool = True, then=None):
        """The whole admission path: `read`, then a place in the queue (a 503 when it is full,
        before any media is read), then `build(req)` → (Prepared, extra) on the preparation pool
        (media under the request's budget, template, tokens), then the engine. → (req, prepared,
        extra, handle); with submit=False (a token count) nothing is queued and handle is None.
        `then(req)` runs on the event loop after parsing (what only the loop may read: the store)."""
        async with self.queued(request, parse, then) as (req, slot):
            prepared, extra = await self._on(self.prepare_pool, build, req)
            if not submit:
                return req, prepared, extra, None
            return req, prepared, extra, self.submit(prepared, slot)

    @contextlib.asynccontextmanager
    async def queued(self, request: Request, parse, then=None):
        """`read`, `then(req)`, then a place in the queue (a 503 when it is full) → (req, slot),
        the slot released on the way out (a submitted request's slot is already its place)."""
        req = await self.read(request, parse)
        if then is not None:
            then(req)
        slot = self.engine.reserve()
        self.built += 1
        try:
            yield req, slot
        finally:
            slot.release()

    def submit(self, prepared, slot=None):
        if self.stopping:
            raise shutting_down()
        handle = self.engine.submit(prepared, asyncio.get_running_loop(), slot)
        self.running.add(handle)
        return handle

    def release(self, handle, finished: bool):
        """The HTTP side is done with `handle`; unless its answer finished, free its batch slot."""
        self.running.discard(handle)
        if not finished:
            handle.cancel()

    async def next_event(self, handle, timeout=None):
        """The handle's next event; None when `timeout` seconds pass first (a stream's keep-alive)."""
        if timeout is None:
            return await handle.queue.get()
        try:
            return await asyncio.wait_for(handle.queue.get(), timeout)
        except asyncio.TimeoutError:
            return None

    async def answer(self, request: Request, handle, writer, encode, stream: bool, **options):
        """The one answer path: the answer streamed (`stream`, below) or, whole, as the JSON of
        `writer.result()` once the engine is done (None while the client went away: a 499)."""
        if stream:
            return StreamingResponse(self.stream(handle, writer, encode, **options), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        done = await self.collect(request, handle, on_token=writer.token)
        if done is None:  # the client went away
            return JSONResponse({}, status_code=499)
        await self._on(self.parse_pool, writer.done, done)  # its events may repeat the request (stream's)
        if options.get("on_done") is not None:
            await _completed(options["on_done"]())
        return await self.json(writer.result)

    async def stream(self, handle, writer, encode, *, ping=None, on_done=None, end: str = ""):
        """One answer's server-sent events, for every protocol: `writer` (the protocol's) turns the
        engine's events into its own (start(), token(ev), done(ev), failed(APIError)) and `encode`
        each into SSE text; `ping` (seconds, event) is sent while nothing comes (a long prefill);
        `on_done()` runs once the answer is whole (awaited, if it returns an awaitable, before the
        last events go out); `end` is the stream's last line. The first and last events may repeat
        the request (a response object echoes its instructions and tools): they are built and
        encoded on the parse pool, a token's on the event loop."""
        def text(events) -> str:
            return "".join(encode(e) for e in events)

        finished = False
        try:
            yield await self._on(self.parse_pool, lambda: text(writer.start()))
            while not finished:
                ev = await self.next_event(handle, ping[0] if ping else None)
                if ev is None:
                    yield encode(ping[1])
                    continue
                if isinstance(ev, TokenEvent):
                    yield text(writer.token(ev))
                    continue
                finished = True
                last = await self._on(self.parse_pool, lambda: text(
                    writer.failed(ev.error) if isinstance(ev, ErrorEvent) else writer.done(ev)))
                if isinstance(ev, DoneEvent) and on_done is not None:
                    await _completed(on_done())
                yield last
        except Exception as e:  # noqa: BLE001 — the headers are sent: end the stream with an error event
            finished = True
            yield text(writer.failed(as_api_error(e)))
        finally:
            self.release(handle, finished)
        if end:
            yield end

    async def collect(self, request: Request, handle, on_token=None):
        """Wait for the whole answer while watching the client: → its DoneEvent (with `text`: the
        whole answer), or None if the client went away (its slot is then freed). An
        engine error is raised. `on_token(event)` sees each token event."""
        watcher = asyncio.ensure_future(disconnected(request))
        text, finished = [], False
        try:
            while True:
                get = asyncio.ensure_future(handle.queue.get())
                done, _ = await asyncio.wait({get, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                    return None
                ev = get.result()
                if isinstance(ev, ErrorEvent):
                    finished = True
                    raise ev.error
                if isinstance(ev, TokenEvent):
                    text.append(ev.text)
                    if on_token is not None:
                        on_token(ev)
                    continue
                finished = True
                return dataclasses.replace(ev, text="".join(text))
        finally:
            watcher.cancel()
            self.release(handle, finished)
