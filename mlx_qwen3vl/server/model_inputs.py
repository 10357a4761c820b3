"""An OpenAI chat request → model inputs: media resolved under the server's policy, the chat
template rendered with the tools, tokens and pixels from the processor, the cache key, the
sampling limits and any grammar. Runs on the HTTP side's thread pool, never on the model thread.

Requests are built in parallel: the processor keeps no state between calls (its tokenizer is
called with one fixed padding and truncation setting, so the Rust tokenizer is only ever read),
and only a request with media takes one of MEDIA_WORKERS media places while its media are read
and preprocessed. A text-only request never waits behind another request's images."""

import contextlib
import os
import threading
import traceback

import numpy as np
from PIL import Image

from .. import media
from ..engine import fit_to_context
from ..errors import ContextLengthError, Qwen3VLError
from ..media_access import release_memory
from ..spans import media_keys
from .conversation import template_messages
from .fetch import hide_temp_paths, resolve_image, resolve_video
from .limits import Limits, check_media, check_pixel_options, check_token_ids
from .prepared import Prepared
from .protocol import APIError, ChatRequest


# OpenAI's detail "low" is a 512x512 thumbnail: here the image is resized to at most that many
# pixels before the processor reads it ("high" and "auto" keep the request's min/max_pixels).
LOW_DETAIL_PIXELS = 512 * 512
MEDIA_WORKERS = 4  # requests whose media are read and preprocessed at once (the rest wait for a place)


def low_detail(data, cap: int, label: str):
    """Encoded image bytes → an RGB array of at most LOW_DETAIL_PIXELS (orientation applied); an
    image over the server's pixel cap is left encoded, for check_media to refuse by name."""
    w, h = media.image_size(data, label)
    if w * h <= LOW_DETAIL_PIXELS or w * h > cap:
        return data
    im = Image.fromarray(media.pil_to_rgb(media.decode(data, label)))
    scale = (LOW_DETAIL_PIXELS / (w * h)) ** 0.5
    size = (max(1, int(w * scale)), max(1, int(h * scale)))
    return np.asarray(im.resize(size, Image.Resampling.BICUBIC))


class PromptBuilder:
    def __init__(self, engine, policy, grammars, limits=None):
        self.engine, self.policy, self.grammars = engine, policy, grammars
        self.limits = limits or Limits()
        self.processor = engine.processor
        self._media_places = threading.BoundedSemaphore(MEDIA_WORKERS)
        self._holding = threading.local()  # this thread's request holds a media place (build → render)

    @contextlib.contextmanager
    def media_place(self):
        """One of MEDIA_WORKERS places for a request's media work, held until the request is built
        (taken once per thread: build's media reads and render's preprocessing share it)."""
        if getattr(self._holding, "place", False):
            yield
            return
        with self._media_places:
            self._holding.place = True
            try:
                yield
            finally:
                self._holding.place = False

    def build(self, req: ChatRequest) -> Prepared:
        check_pixel_options(req, self.limits)
        has_media = any(p.kind != "text" for t in req.turns for p in t.parts)
        with self.media_place() if has_media else contextlib.nullcontext():
            return self._build(req)

    def _build(self, req: ChatRequest) -> Prepared:
        temp_files = []
        budget = self.policy.budget()  # (its one deadline starts once the request holds its media place)

        def resolve(part):  # every medium of the request under one budget of bytes, pixels, frames and time
            if part.kind == "image":
                data = resolve_image(part.value, self.policy, part.param, budget)
                if part.detail == "low":
                    try:
                        return low_detail(data, self.limits.max_request_pixels, part.param)
                    except Qwen3VLError as e:
                        raise APIError(400, str(e), param=part.param, code="invalid_input") from None
                return data
            return resolve_video(part.value, self.policy, part.param, temp_files, budget)

        try:
            messages, images, videos = template_messages(req.turns, resolve, req.merge_system)
            return self.render(req, messages, images, videos)
        except APIError as e:
            # The media read so far live in the traceback's frames until the error is answered:
            # drop them now, and give their pages back to the system when they were large.
            traceback.clear_frames(e.__traceback__)
            if budget.bytes > (8 << 20):
                release_memory()
            raise
        finally:
            for path in temp_files:
                os.unlink(path)

    def render(self, req: ChatRequest, messages, images, videos=()) -> Prepared:
        """Template messages whose media are resolved (`images`: encoded bytes or RGB arrays,
        `videos`: files, in order) → Prepared, under the request's budgets, tools and grammar. The
        computer-use prompt (computer.py) and the grounding route's passes (grounding.py: the
        screenshot and its crop) come in here too."""
        check_pixel_options(req, self.limits)
        check_token_ids(req.sampling, self.grammars.vocab_size)
        check_media(images, videos, req, self.processor, self.limits, self.engine.context)  # before any decoding
        tools = req.tools if req.tool_choice != "none" else None
        with self.media_place() if len(images) or len(videos) else contextlib.nullcontext():
            try:
                text = self.processor.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                          **req.chat_template_kwargs)
                inputs = self.processor(text=text, images=list(images) or None, videos=list(videos) or None,
                                        min_pixels=req.min_pixels, max_pixels=req.max_pixels)
            except Qwen3VLError as e:
                raise APIError(400, hide_temp_paths(str(e)), param=req.conversation, code="invalid_input") from None
            except (TypeError, ValueError) as e:  # the template rejected the conversation
                raise APIError(400, f"the chat template could not render these messages: {e}",
                               param=req.conversation, code="invalid_input") from None
        if "mm_token_type_ids" not in inputs:
            inputs["mm_token_type_ids"] = np.zeros_like(inputs["input_ids"])
        tokens = np.asarray(inputs["input_ids"])[0].tolist()
        media = media_keys(inputs)  # content hashes, computed here, off the model thread
        try:  # the library's rule, here too so that a prompt past the context is refused before it queues
            max_tokens = fit_to_context(len(tokens), req.max_tokens or self.engine.default_max_tokens,
                                        self.engine.context)
        except ContextLengthError as e:
            raise APIError(400, str(e), param=req.conversation, code="context_length_exceeded") from None
        grammar = None
        if req.response_format is not None:
            rf = req.response_format
            schema = {"type": "object"} if rf["type"] == "json_object" else rf["json_schema"].get("schema", {})
            grammar = ["json_schema", schema]
        elif req.tools and (req.tool_choice == "required" or isinstance(req.tool_choice, dict)):
            name = req.tool_choice["function"]["name"] if isinstance(req.tool_choice, dict) else None
            grammar = ["tool_call", req.tools, name]
        elif tools and any(t["function"].get("strict") for t in tools):  # a call it makes keeps to its schema
            grammar = ["tool_text", req.tools]
        return Prepared(inputs=inputs, tokens=tokens, media=media, sampling=req.sampling, max_tokens=max_tokens,
                        grammar=grammar, processors=self.grammars.build(grammar), kv=req.kv, drafting=req.drafting)
