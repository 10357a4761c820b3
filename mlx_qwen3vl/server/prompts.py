"""An OpenAI chat request → model inputs: media resolved under the server's policy, the chat
template rendered with the tools, tokens and pixels from the processor, the cache key, the
sampling limits and any grammar. Runs on the HTTP side's thread pool, never on the model thread."""

import os
import threading
import traceback

import numpy as np

from ..engine import fit_to_context
from ..errors import ContextLengthError, Qwen3VLError
from ..media_access import release_memory
from ..spans import media_keys
from .prepared import Prepared
from .fetch import hide_temp_paths, resolve_image, resolve_video
from .limits import Limits, check_media, check_pixel_options
from .protocol import APIError, ChatRequest


def _text_of(content):
    if isinstance(content, str) or content is None:
        return content or ""
    return "".join(p["text"] for p in content if p.get("type") == "text")


def convert_messages(messages, policy, temp_files, names=None, budget=None):
    """OpenAI messages → (template messages with media placeholders, images, videos), in order.
    `names`: {(i, j): param} naming a part as the client wrote it (another protocol's field);
    `budget`: the request's media budget (all its media together)."""
    budget = budget or policy.budget()
    out, images, videos = [], [], []
    names = names or {}
    for i, m in enumerate(messages):
        role = "system" if m["role"] == "developer" else m["role"]
        msg = {"role": role}
        content = m.get("content")
        if isinstance(content, list) and role in ("user", "tool"):  # a tool result may be a screenshot
            parts = []
            for j, part in enumerate(content):
                kind = part["type"]
                param = names.get((i, j)) or f"messages[{i}].content[{j}].{kind}.url"
                if kind == "text":
                    parts.append({"type": "text", "text": part["text"]})
                    continue
                ref = part[kind]
                url = ref["url"] if isinstance(ref, dict) else ref
                if kind == "image_url":
                    images.append(resolve_image(url, policy, param, budget))
                    parts.append({"type": "image"})
                else:
                    videos.append(resolve_video(url, policy, param, temp_files, budget))
                    parts.append({"type": "video"})
            msg["content"] = parts
        else:
            msg["content"] = _text_of(content)
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = m["tool_calls"]
        if role == "tool" and m.get("tool_call_id"):
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    return out, images, videos


class PromptBuilder:
    def __init__(self, engine, policy, grammars, limits=None):
        self.engine, self.policy, self.grammars = engine, policy, grammars
        self.limits = limits or Limits()
        self.processor = engine.processor
        self._lock = threading.Lock()  # one tokenizer / processor call at a time

    def build(self, req: ChatRequest) -> Prepared:
        temp_files = []
        check_pixel_options(req, self.limits)
        budget = self.policy.budget(self.limits.max_request_pixels, self.limits.max_video_frames)
        try:
            messages, images, videos = convert_messages(req.messages, self.policy, temp_files, req.media_params,
                                                        budget)
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
        check_media(images, videos, req, self.processor, self.limits)  # before any decoding
        tools = req.tools if req.tool_choice != "none" else None
        with self._lock:
            try:
                text = self.processor.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                          **req.chat_template_kwargs)
                inputs = self.processor(text=text, images=list(images) or None, videos=list(videos) or None,
                                        min_pixels=req.min_pixels, max_pixels=req.max_pixels)
            except Qwen3VLError as e:
                raise APIError(400, hide_temp_paths(str(e)), param="messages", code="invalid_input") from None
            except (TypeError, ValueError) as e:  # the template rejected the conversation
                raise APIError(400, f"the chat template could not render these messages: {e}",
                               param="messages", code="invalid_input") from None
        if "mm_token_type_ids" not in inputs:
            inputs["mm_token_type_ids"] = np.zeros_like(inputs["input_ids"])
        tokens = np.asarray(inputs["input_ids"])[0].tolist()
        media = media_keys(inputs)  # content hashes, computed here, off the model thread
        try:  # the library's rule, here too so that a prompt past the context is refused before it queues
            max_tokens = fit_to_context(len(tokens), req.max_tokens or self.engine.default_max_tokens,
                                        self.engine.context)
        except ContextLengthError as e:
            raise APIError(400, str(e), param="messages", code="context_length_exceeded") from None
        grammar = None
        if req.response_format is not None:
            rf = req.response_format
            schema = {"type": "object"} if rf["type"] == "json_object" else rf["json_schema"].get("schema", {})
            grammar = ["json_schema", schema]
        elif req.tools and (req.tool_choice == "required" or isinstance(req.tool_choice, dict)):
            name = req.tool_choice["function"]["name"] if isinstance(req.tool_choice, dict) else None
            grammar = ["tool_call", req.tools, name]
        return Prepared(inputs=inputs, tokens=tokens, media=media, sampling=req.sampling, max_tokens=max_tokens,
                        grammar=grammar, processors=self.grammars.build(grammar), kv=req.kv)
