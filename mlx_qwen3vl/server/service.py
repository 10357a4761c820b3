"""What every endpoint shares, whatever protocol it speaks: the API key (Bearer or x-api-key), the
body limit and JSON checks, submitting a prepared request to the model thread, the set of running
requests the server ends when it stops, and waiting for a whole answer while watching the client.
app.py builds one; responses.py and messages.py take it."""

import asyncio
import functools
import hmac
import json
from typing import Optional

from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request

from ..engine import eos_token_ids
from . import protocol as P
from .computer_answers import ComputerAnswers
from .protocol import APIError


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


def parse_json(raw: bytearray):
    """The body as JSON (UTF-8, RFC 8259). The raw bytes are released before parsing: a large body
    is held at most twice (its text, then what is parsed from it)."""
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

    @property
    def processor(self):
        return self.engine.processor

    @functools.cached_property
    def eos(self) -> set:
        return eos_token_ids(self.engine.model, self.engine.processor)

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

    async def read_json(self, request: Request):
        self.check_auth(request)
        if self.stopping:
            raise shutting_down()
        return parse_json(await read_body(request, self.max_body_bytes))

    async def prepare(self, build, *args):
        """Run `build(*args)` (media, template, tokens: blocking work) off the event loop."""
        return await run_in_threadpool(build, *args)

    def submit(self, prepared):
        if self.stopping:
            raise shutting_down()
        handle = self.engine.submit(prepared, asyncio.get_running_loop())
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

    async def collect(self, request: Request, handle, on_token=None):
        """Wait for the whole answer while watching the client: → the "done" event (with "text"
        added: the whole answer), or None if the client went away (its slot is then freed). An
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
                if ev["type"] == "error":
                    finished = True
                    raise ev["error"]
                if ev["type"] == "token":
                    text.append(ev["text"])
                    if on_token is not None:
                        on_token(ev)
                    continue
                finished = True
                return {**ev, "text": "".join(text)}
        finally:
            watcher.cancel()
            self.release(handle, finished)
