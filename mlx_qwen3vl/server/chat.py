"""OpenAI chat completions: POST /v1/chat/completions, its request body, its answer and its
stream chunks.

The body is validated by pydantic models of the wire format (strict types, every field known:
OpenAI's, vLLM's extensions and this server's; an unknown one is a 400 naming its path), then read
into the one internal request (protocol.ChatRequest: turns of parts, sampling, tools, output
format, KV and pixel settings), built into model inputs (PromptBuilder) and answered from the
engine's events. The answer goes through answer.AnswerStream whether it streams or not (tool calls
split out, the blank space beside a call dropped), so a streamed answer's content adds up to the
plain answer's, whitespace included.
"""

import time
import uuid
from typing import Annotated, Any, Dict, List, Literal, Optional, Union

from pydantic import Field
from starlette.routing import Route

from . import protocol as P
from .conversation import Call, Part, Turn
from .endpoint import Writer, respond, tools
from .protocol import APIError, ChatRequest, Drafting, OpenAIHints, Rendering, Sampling, Wire, invalid, one_of

# ------------------------------------------------------------------------------------ the body


class TextPart(Wire):
    type: Literal["text"]
    text: str


class URL(Wire):
    url: Annotated[str, Field(min_length=1)]
    detail: Optional[Literal["low", "high", "auto"]] = None  # "low": model_inputs.LOW_DETAIL_PIXELS


class ImagePart(Wire):
    type: Literal["image_url"]
    image_url: Union[URL, Annotated[str, Field(min_length=1)]]


class VideoPart(Wire):
    type: Literal["video_url"]
    video_url: Union[URL, Annotated[str, Field(min_length=1)]]


ContentPart = one_of(TextPart, ImagePart, VideoPart)


class CalledFunction(Wire):
    name: str
    arguments: Union[str, Dict[str, Any]]


class ToolCall(Wire):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(Wire):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, List[ContentPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[List[ToolCall]] = None
    tool_call_id: Optional[str] = None
    # what an answer carries and clients send back with it: a refusal is the assistant's text;
    # this server never answers with reasoning_content or annotations, so only empty ones pass
    refusal: Optional[str] = None
    reasoning_content: Optional[Annotated[str, Field(max_length=0)]] = None
    annotations: Optional[Annotated[List[Any], Field(max_length=0)]] = None
    audio: None = None
    function_call: None = None


class Function(Wire):
    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: Optional[str] = None
    parameters: Optional[Dict[str, Any]] = None
    strict: Optional[bool] = None


class Tool(Wire):
    type: Literal["function"] = "function"
    function: Function


class NamedFunction(Wire):
    name: str


class ToolChoice(Wire):
    type: Literal["function"]
    function: NamedFunction


class JSONSchema(Wire):
    name: Optional[str] = None
    schema_: Dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: Optional[bool] = None
    description: Optional[str] = None


class ResponseFormat(Wire):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JSONSchema] = None


class StreamOptions(Wire):
    include_usage: Optional[bool] = None


class ProcessorKwargs(Wire):
    min_pixels: Optional[int] = None
    max_pixels: Optional[int] = None


class ChatBody(Sampling, Rendering, Drafting, OpenAIHints):
    """Every field a chat-completions body may hold (ranges are checked with the field's name when
    the request is read: protocol.sampling_params)."""

    messages: Annotated[List[Message], Field(min_length=1)]
    model: Optional[str] = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    n: Optional[int] = None
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    stop: Union[str, List[str], None] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    logit_bias: Optional[Dict[str, Any]] = None
    tools: Optional[List[Tool]] = None
    tool_choice: Union[Literal["auto", "none", "required"], ToolChoice, None] = None
    parallel_tool_calls: Optional[Literal[True]] = None  # false: the server does not cut an answer's calls
    response_format: Optional[ResponseFormat] = None
    modalities: Optional[List[Literal["text"]]] = None
    store: Optional[Literal[False]] = None  # completions are not stored here
    # vLLM's extensions (extra_body; top_k, min_p, repetition_penalty are Sampling's)
    stop_token_ids: Optional[List[int]] = None
    min_tokens: Optional[int] = None
    ignore_eos: Optional[bool] = None
    chat_template: None = None  # refused by name below: the checkpoint's template renders
    mm_processor_kwargs: Optional[ProcessorKwargs] = None
    # this server's: the KV cache's storage (pixels and template switches are Rendering's)
    kv_bits: Optional[int] = None
    kv_group_size: Optional[int] = None
    quantized_kv_start: Optional[int] = None


REFUSED = {  # fields a client may send that this server cannot honour, and what to send instead
    "max_new_tokens": "use 'max_tokens' (or 'max_completion_tokens'), as OpenAI and vLLM name it",
    "functions": "use 'tools'", "function_call": "use 'tool_choice'",
    "audio": "this model answers in text", "prediction": "predicted outputs are not available here",
    "reasoning_effort": "this checkpoint's thinking is switched by 'chat_template_kwargs': {'enable_thinking': ...}",
    "verbosity": "not available here", "web_search_options": "web search is not available here",
    "metadata": "completions are not stored here",
    "chat_template": "this server renders with its checkpoint's template (switches go in 'chat_template_kwargs')",
    "store": "completions are not stored here", "modalities": "this model answers in text only",
    "parallel_tool_calls": "this model may answer with several calls and the server does not cut them",
    "messages.reasoning_content": "its answers carry <think> text in 'content'; send it back there",
    "messages.annotations": "its answers carry no annotations",
}


def parse_chat_request(body) -> ChatRequest:
    """A chat-completions body → the internal request (every check before any work)."""
    wire = P.validate(ChatBody, body, REFUSED)
    max_tokens = wire.max_completion_tokens if wire.max_completion_tokens is not None else wire.max_tokens
    P.number(body, "max_completion_tokens" if wire.max_completion_tokens is not None else "max_tokens", 1,
             integer=True)
    P.number(body, "n", 1, 1, integer=True)  # one choice per request
    top_logprobs = P.number(body, "top_logprobs", 0, P.MAX_TOP_LOGPROBS, integer=True, default=0)
    if top_logprobs and not wire.logprobs:
        raise invalid("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    sampling = P.sampling_params(body, P.stop_strings(wire.stop, "stop"), logprobs=bool(wire.logprobs),
                                 top_logprobs=top_logprobs, **P.stopping(body, max_tokens))
    choice = wire.tool_choice or "auto"
    functions, _, tool_choice = tools(
        [{"type": "function", "function": {**t.function.model_dump(exclude_none=True), "parameters":
                                           t.function.parameters or {"type": "object", "properties": {}}}}
         for t in wire.tools or ()], [], "function" if isinstance(choice, ToolChoice) else choice,
        choice.function.name if isinstance(choice, ToolChoice) else None)
    if wire.stream_options is not None and not wire.stream:  # as OpenAI: its usage chunk needs a stream
        raise invalid("stream_options", "'stream_options' is only allowed with 'stream': true")
    rf = wire.response_format
    if rf is not None and rf.type == "json_schema" and rf.json_schema is None:
        raise invalid("response_format.json_schema", "'response_format.json_schema' is required with type "
                      "json_schema: {\"name\": ..., \"schema\": {...}}", "missing_field")
    mm = wire.mm_processor_kwargs or ProcessorKwargs()
    pixels = P.pixel_options({"min_pixels": wire.min_pixels if wire.min_pixels is not None else mm.min_pixels,
                              "max_pixels": wire.max_pixels if wire.max_pixels is not None else mm.max_pixels})
    return ChatRequest(
        turns=read_messages(wire.messages), sampling=sampling, max_tokens=max_tokens, model=wire.model,
        stream=bool(wire.stream), include_usage=bool(wire.stream_options and wire.stream_options.include_usage),
        tools=functions, tool_choice=tool_choice,
        response_format=rf and P.output_format(rf.type, (rf.json_schema or JSONSchema()).schema_,
                                               (rf.json_schema or JSONSchema()).name),
        chat_template_kwargs=P.template_switches(wire.chat_template_kwargs), kv=P.kv_settings(body),
        merge_system=False, drafting=P.drafting_settings(wire), **pixels)


def read_messages(messages: List[Message]) -> List[Turn]:
    """Chat messages → turns; each part remembers where the client put it."""
    turns = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = "system" if m.role == "developer" else m.role
        if m.content is None and not (m.role == "assistant" and (m.tool_calls or m.refusal)):
            raise invalid(f"{where}.content", f"'{where}.content' is missing; send a string or a list of content "
                          "parts", "missing_field")
        if m.name and role != "tool":  # a tool result's name is its function's, which the call already names
            raise invalid(f"{where}.name", f"'{where}.name' is not supported by this server: the chat template has no "
                          "participant names; put the name in the message's text", "unsupported_field")
        if m.refusal and (m.role != "assistant" or (m.content and m.content != m.refusal)):
            raise invalid(f"{where}.refusal", f"'{where}.refusal' is an assistant's answer instead of content; "
                          "send one or the other", "invalid_value")
        parts = []
        if m.refusal and not m.content:  # the model said it: render it as the assistant's text
            parts.append(Part("text", m.refusal, f"{where}.refusal"))
        if isinstance(m.content, str):
            parts.append(Part("text", m.content, f"{where}.content"))
        for j, part in enumerate(m.content if isinstance(m.content, list) else ()):
            p = f"{where}.content[{j}]"
            if isinstance(part, TextPart):
                parts.append(Part("text", part.text, f"{p}.text"))
                continue
            kind = "image" if isinstance(part, ImagePart) else "video"
            ref = part.image_url if kind == "image" else part.video_url
            if role not in ("user", "tool"):  # the chat template renders media only there
                raise invalid(p, f"'{p}' is {'a video' if kind == 'video' else 'an image'} in a {m.role} message, "
                              "where the chat template renders no media; send it in a user or tool message")
            parts.append(Part(kind, ref.url if isinstance(ref, URL) else ref, f"{p}.{part.type}.url",
                              detail=ref.detail if isinstance(ref, URL) and kind == "image" else None))
        calls = [Call(c.id, c.function.name, arguments=c.function.arguments, param=f"{where}.tool_calls[{k}]")
                 for k, c in enumerate(m.tool_calls or ())]
        turns.append(Turn(role, parts, calls=calls, call_id=m.tool_call_id, param=where,
                          listed=isinstance(m.content, list)))
    return turns


# ------------------------------------------------------------------------------------ the answer


class Answer(Writer):
    """A chat completion and its stream chunks: the answer's content and tool calls (its `<think>`
    text stays content), a token's logprobs in the chunk of its text."""

    named = False  # chunks are data-only events, and the stream ends with [DONE]

    def __init__(self, req: ChatRequest, model: str, prepared=None, computer_request=None, opened: bool = False):
        super().__init__(req, model, prepared, reasoning=False)
        self.id, self.content, self.tool_calls, self.logprobs = "chatcmpl-" + uuid.uuid4().hex[:24], [], [], []

    def chunk(self, delta=None, finish_reason=None, logprobs=None, use=None) -> dict:
        out = {"id": self.id, "object": "chat.completion.chunk", "created": int(time.time()), "model": self.model,
               "choices": [] if use else [{"index": 0, "delta": delta or {}, "logprobs": logprobs,
                                           "finish_reason": finish_reason}]}
        return {**out, "usage": use} if use else out

    def start(self) -> list:
        return [self.chunk({"role": "assistant", "content": ""})]

    def token(self, ev) -> list:
        if ev.logprobs is None:
            return super().token(ev)
        self.logprobs.append(ev.logprobs)  # one chunk: the token's text (maybe none yet) and its logprobs
        segments = self.parts.feed(ev.text)
        text = "".join(v for kind, v in segments if kind == "text")
        self.content.append(text)
        return [self.chunk({"content": text}, logprobs={"content": [ev.logprobs]})] + self._segments(
            (kind, v) for kind, v in segments if kind == "call")

    def opened(self, kind) -> list:
        return []

    def delta(self, kind, value) -> list:
        self.content.append(value)
        return [self.chunk({"content": value})]

    def closed(self, kind, status) -> list:
        return []

    def call(self, call) -> list:
        self.tool_calls.append(call)
        return [self.chunk({"tool_calls": [{"index": len(self.tool_calls) - 1, **call}]})]

    def finished(self, ev, cut) -> list:
        self.finish = "tool_calls" if self.tool_calls else ev.finish_reason
        self.usage = {"prompt_tokens": ev.prompt_tokens, "completion_tokens": ev.completion_tokens,
                      "total_tokens": ev.prompt_tokens + ev.completion_tokens,
                      "prompt_tokens_details": {"cached_tokens": ev.cached_tokens}}
        if ev.draft_proposed:  # speculative decoding's drafts as OpenAI's predicted outputs: kept, and rejected
            self.usage["completion_tokens_details"] = {
                "accepted_prediction_tokens": ev.draft_accepted,
                "rejected_prediction_tokens": ev.draft_proposed - ev.draft_accepted}
        return [self.chunk(finish_reason=self.finish)] + ([self.chunk(use=self.usage)] if self.req.include_usage
                                                          else [])

    def failed(self, error: APIError) -> list:
        return [error.body()]

    def result(self) -> dict:
        content = "".join(self.content)
        message = {"role": "assistant", "content": content or None, "tool_calls": self.tool_calls} \
            if self.tool_calls else {"role": "assistant", "content": content}
        return {"id": self.id, "object": "chat.completion", "created": int(time.time()), "model": self.model,
                "choices": [{"index": 0, "message": message, "logprobs": {"content": self.logprobs} if self.logprobs
                             else None, "finish_reason": self.finish}], "usage": self.usage}


def routes(service) -> list:
    async def create(request):
        return await respond(service, request, parse_chat_request, Answer, end="data: [DONE]\n\n")

    return [Route("/v1/chat/completions", create, methods=["POST"])]
