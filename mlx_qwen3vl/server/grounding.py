"""POST /v1/ground: where an instruction's target is on a screenshot, as the agent package's
ground() answers it (one pass, or two with zoom), each pass a request through the server's engine.

    {"image": "data:image/png;base64,...", "instruction": "the Apply button",
     "format": "venus" | "qwen" | "computer_use", "zoom": false | true | 0.4,
     "allow_refusal": true, "min_pixels": ..., "max_pixels": ..., "max_tokens": 128}
    → {"point": [x, y] | null, "box": [x1, y1, x2, y2] | null, "status": "ok" | "refused" | "malformed",
       "answer": ..., "finish_reason": "stop" | "length" | "time_limit", "note": ..., "image_size": [w, h],
       "format": ..., "timing": {...}, "zoom": {"fraction", "window", "pass", "passes": [...]}, "usage": {...}}

`finish_reason` is the answer's pass's, each of `zoom.passes` has its own: the engine's, as the
chat route reports it (a point cut short by max_tokens is "length", its status "malformed").

The grounding itself is agent.ground_with's (prompts, crop, mapping); this module gives it an
`ask` that renders each pass with the chat route's PromptBuilder (budgets, template, processor,
limits) and submits it to the engine, and checks the request's fields against an allow-list
before any work. The image is a URL under the server's media policy, as in a chat message.
"""

import asyncio
import time
import uuid
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional, Union

from starlette.concurrency import run_in_threadpool

from ..agent import GROUNDING_FORMATS, ground_with, missing_point_note, zoom_fraction
from ..errors import Qwen3VLError
from ..processor import image_budget
from ..sampling import SamplingParams
from .fetch import resolve_image
from .limits import check_media, check_pixel_options
from .protocol import APIError, ChatRequest, Wire, number, pixel_options, validate

MAX_INSTRUCTION_CHARS = 8192
DEFAULT_MAX_TOKENS = 128  # as ground()'s: a point or a box is a few tokens


def _invalid(param, message, code="invalid_value"):
    return APIError(400, message, param=param, code=code)


@dataclass
class GroundRequest:
    image: str
    instruction: str
    format: str = "venus"
    zoom: Optional[Fraction] = None
    allow_refusal: bool = True
    min_pixels: Optional[int] = None
    max_pixels: Optional[int] = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    model: Optional[str] = None

    def chat(self) -> ChatRequest:
        """One pass as the chat route's request: greedy (as UI-Venus and Qwen evaluate), its budgets."""
        return ChatRequest(turns=[], sampling=SamplingParams(temperature=0.0), max_tokens=self.max_tokens,
                           model=self.model, min_pixels=self.min_pixels, max_pixels=self.max_pixels,
                           conversation="image")


class GroundBody(Wire):
    """The body's wire format: strict types, no other field (ranges are checked below, by name)."""

    image: str
    instruction: str
    format: Optional[str] = None
    zoom: Union[bool, float, None] = None
    allow_refusal: Optional[bool] = None
    min_pixels: Optional[int] = None
    max_pixels: Optional[int] = None
    max_tokens: Optional[int] = None
    model: Optional[str] = None


def parse_ground_request(body) -> GroundRequest:
    wire = validate(GroundBody, body)
    for name in ("image", "instruction"):
        if not getattr(wire, name).strip():
            raise _invalid(name, f"'{name}' must be a non-empty string", "invalid_type")
    if len(wire.instruction) > MAX_INSTRUCTION_CHARS:
        raise _invalid("instruction", f"'instruction' is {len(wire.instruction)} characters; at most "
                       f"{MAX_INSTRUCTION_CHARS}")
    fmt = wire.format if wire.format is not None else "venus"
    if fmt not in GROUNDING_FORMATS:
        raise _invalid("format", f"'format' is {fmt[:40]!r}; use one of {', '.join(GROUNDING_FORMATS)}")
    zoom = wire.zoom
    if zoom is not None and zoom is not False:
        try:
            zoom = zoom_fraction(zoom, "'zoom'")
        except Qwen3VLError as e:
            raise _invalid("zoom", str(e)) from None
    pixels = pixel_options(body)
    return GroundRequest(image=wire.image, instruction=wire.instruction, format=fmt,
                         zoom=None if zoom is None or zoom is False else zoom,
                         allow_refusal=wire.allow_refusal if wire.allow_refusal is not None else True,
                         max_tokens=number(body, "max_tokens", 1, integer=True, default=DEFAULT_MAX_TOKENS),
                         model=wire.model, **pixels)


@dataclass
class PassAnswer:
    """One pass's answer as ground_with reads an `ask` result (GenerationResult's names). The rates
    are measured from the submission: prompt_tps includes any wait for a batch slot."""

    text: str
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    generation_tokens: int
    prompt_tps: float
    generation_tps: float


def _rate(n, seconds):
    return n / seconds if seconds > 0 and n > 0 else 0.0


def _template(messages):
    """grounding_messages (screenshots inline) → the template's messages with placeholders, and the images."""
    out, images = [], []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            parts = []
            for part in content:
                if part["type"] == "image":
                    images.append(part["image"])
                    part = {"type": "image"}
                parts.append(part)
            m = {**m, "content": parts}
        out.append(m)
    return out, images


class GroundJob:
    """One /v1/ground request. `serve` runs it: `run` (on a worker thread) reads the screenshot and
    runs ground_with, whose `ask` prepares each pass on that thread and has the event loop submit it
    and wait for its answer with Service.collect (the one wait for a whole answer, watching the
    client: a client gone away cancels the running pass and starts no other)."""

    def __init__(self, service, req: GroundRequest, request, loop, slot=None):
        self.service, self.builder, self.req, self.request, self.loop = service, service.builder, req, request, loop
        self.slot = slot  # the job's place in the queue: its first pass's
        self.chat = req.chat()
        self.gone = False

    async def serve(self):
        """Run the job on a worker thread: its GroundingResult, or None when the client went away."""
        try:
            return await run_in_threadpool(self.run)
        except ClientGone:
            return None

    def run(self):
        req, builder = self.req, self.builder
        processor, limits = builder.processor, builder.limits
        check_pixel_options(self.chat, limits)
        with builder.media_place():  # the screenshot is read under the request's budget, as a chat image
            data = resolve_image(req.image, builder.policy, "image", builder.policy.budget())
        check_media([data], (), self.chat, processor, limits)  # from the header, before ground_with decodes it
        floor = 0
        if req.zoom is not None:  # the window holds at least the pixels the model is shown at least
            floor = image_budget(processor.image_config, req.min_pixels, req.max_pixels)[0]
        try:
            return ground_with(self.ask, data, req.instruction, format=req.format, allow_refusal=req.allow_refusal,
                               zoom=req.zoom, window_min_pixels=floor)
        except Qwen3VLError as e:
            raise APIError(400, str(e), param="image", code="invalid_input") from None

    def ask(self, messages) -> PassAnswer:
        if self.gone:
            raise ClientGone
        messages, images = _template(messages)
        prepared = self.builder.render(self.chat, messages, images)
        return asyncio.run_coroutine_threadsafe(self._answer(prepared), self.loop).result()

    async def _answer(self, prepared) -> PassAnswer:
        tic, first = time.perf_counter(), []
        handle = self.service.submit(prepared, self.slot)  # the first pass takes the job's place
        done = await self.service.collect(self.request, handle,
                                          on_token=lambda ev: first or first.append(time.perf_counter()))
        if done is None:
            self.gone = True
            raise ClientGone
        end = time.perf_counter()
        start = first[0] if first else end
        n, computed = done.completion_tokens, done.prompt_tokens - done.cached_tokens
        return PassAnswer(done.text, done.finish_reason, done.prompt_tokens, done.cached_tokens, n,
                          _rate(computed, start - tic), _rate(n - 1, end - start))


class ClientGone(Exception):
    """The client went away: the job ends without an answer."""


def response(hit, model: str) -> dict:
    """The route's JSON: the GroundingResult's, the note an annotated picture would carry, usage."""
    passes = hit.passes
    prompt = sum(p.prompt_tokens for p in passes)
    completion = sum(p.generation_tokens for p in passes)
    return {"id": "ground-" + uuid.uuid4().hex[:24], "object": "grounding", "created": int(time.time()),
            "model": model, **hit.to_dict(), "note": missing_point_note(hit.status),
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                      "prompt_tokens_details": {"cached_tokens": sum(p.cached_tokens for p in passes)}}}
