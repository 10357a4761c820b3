"""Anthropic's Messages API: POST /v1/messages and POST /v1/messages/count_tokens, its body, its
message object and its stream events.

The body is validated by pydantic models of the wire format (strict types, every field known; a
field this server cannot honour is refused with the reason, by its path) and read into the one
internal request (protocol.ChatRequest), then admitted, built and answered as every endpoint's is
(endpoint.py). Images come as base64 or URL sources (URLs under the server's media policy). A
request that declares a computer-use tool (computer_20250124, computer_20251124,
computer_toolset_20260801) is rendered with the checkpoint's trained prompt instead (computer.py)
and its answer comes back as `tool_use` blocks; `<think>` text becomes a thinking block (with an
empty signature: nothing is signed here, and thinking blocks sent back are read as the model's
earlier reasoning).

Sampling: today's `anthropic` SDK has no temperature / top_p / top_k arguments on messages.create,
so they (and this server's other sampling fields, min_pixels / max_pixels) are read from the body
(`extra_body`). Usage counts as Anthropic's do: `input_tokens` are the prompt tokens not read from
the prefix cache, `cache_read_input_tokens` those that were. Errors have Anthropic's shape,
`{"type": "error", "error": {"type", "message"}}` (app.py renders every error under /v1/messages so).
"""

import json
from typing import Annotated, Any, Dict, List, Literal, Optional, Union

from pydantic import Field
from starlette.responses import JSONResponse
from starlette.routing import Route

from . import protocol as P
from .conversation import Call, Part, Turn
from .endpoint import Writer, computer_sampling, build, function_tool, new_id, respond, tools
from .protocol import APIError, ChatRequest, Drafting, Rendering, Sampling, Wire, invalid, one_of

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 421: "permission_error",
               429: "rate_limit_error", 503: "overloaded_error"}
PING_SECONDS = 10  # a stream's keep-alive while the answer is not yet coming (a long prefill)
NonEmpty = Annotated[str, Field(min_length=1)]


def error_body(e: APIError) -> dict:
    kind = ERROR_TYPES.get(e.status, "invalid_request_error" if 400 <= e.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


# ------------------------------------------------------------------------------------ the body


class Cached(Wire):
    cache_control: Optional[Dict[str, Any]] = None  # every prefix is cached here: each breakpoint is honoured


class CitationsOff(Wire):
    enabled: Literal[False]


class TextBlock(Cached):
    type: Literal["text"]
    text: str
    citations: Union[Annotated[List[Any], Field(max_length=0)], CitationsOff, None] = None  # this server cites nothing


class Base64Source(Wire):
    type: Literal["base64"]
    media_type: Optional[str] = None  # the format is told by content
    data: NonEmpty


class URLSource(Wire):
    type: Literal["url"]
    url: NonEmpty


class ImageBlock(Cached):
    type: Literal["image"]
    source: one_of(Base64Source, URLSource)


class ToolResult(Cached):
    type: Literal["tool_result"]
    tool_use_id: NonEmpty
    content: Union[str, List[one_of(TextBlock, ImageBlock)], None] = None
    is_error: Optional[bool] = None
    toolset_name: Optional[str] = None


class Caller(Wire):
    type: Literal["direct"]


class ToolUse(Cached):
    type: Literal["tool_use"]
    id: NonEmpty
    name: NonEmpty
    input: Dict[str, Any]
    toolset_name: Optional[str] = None
    caller: Optional[Caller] = None


class Thinking(Wire):
    type: Literal["thinking"]
    thinking: str
    signature: Optional[str] = None


class RedactedThinking(Wire):
    type: Literal["redacted_thinking"]
    data: Optional[str] = None


class Message(Wire):
    role: Literal["user", "assistant"]
    content: Union[str, Annotated[List[one_of(TextBlock, ImageBlock, ToolResult, ToolUse, Thinking, RedactedThinking)],
                                  Field(min_length=1)]]


class CustomTool(Cached):
    type: Literal["custom"] = "custom"
    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: Optional[str] = None
    input_schema: Optional[Dict[str, Any]] = None
    strict: Optional[bool] = None  # its calls' input is held to its schema (model_inputs.py)
    input_examples: Optional[Annotated[List[Any], Field(max_length=0)]] = None
    defer_loading: Optional[Literal[False]] = None
    eager_input_streaming: Optional[bool] = None  # a call's input is streamed whole, once it is complete


class ComputerTool(Cached):  # its values are checked by agent.computer_tools
    type: Literal["computer_20250124", "computer_20251124"]
    name: Optional[str] = None
    display_width_px: Optional[int] = None
    display_height_px: Optional[int] = None
    display_number: None = None
    enable_zoom: Optional[bool] = None


class Toolset(Cached):
    type: Literal["computer_toolset_20260801"]
    configs: Optional[Dict[str, Any]] = None


class ToolChoice(Wire):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[Literal[False]] = None


class ThinkingConfig(Wire):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Optional[Annotated[int, Field(ge=1024)]] = None
    display: Optional[Literal["summarized"]] = None


class OutputFormat(Wire):
    type: Literal["json_schema"]
    schema_: Dict[str, Any] = Field(alias="schema")


class OutputConfig(Wire):
    format: Optional[OutputFormat] = None
    effort: None = None


class Metadata(Wire):
    user_id: Optional[str] = None


class CountBody(Rendering):
    """What /v1/messages/count_tokens takes: the prompt's fields."""

    model: str
    messages: Annotated[List[Message], Field(min_length=1)]
    system: Union[str, List[TextBlock], None] = None
    tools: Optional[List[one_of(CustomTool, ComputerTool, Toolset, default=lambda tool: "custom")]] = None
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[ThinkingConfig] = None
    output_config: Optional[OutputConfig] = None
    # accepted, with no effect on a local server's output (docs/protocols.md says why each)
    service_tier: Optional[str] = None
    cache_control: Optional[Dict[str, Any]] = None
    inference_geo: Optional[str] = None
    speed: Optional[str] = None
    user_profile_id: Optional[str] = None
    workspace_id: Optional[str] = None


class Body(CountBody, Sampling, Drafting):
    max_tokens: Annotated[int, Field(ge=1)]
    temperature: Optional[Annotated[float, Field(ge=0, le=1)]] = None  # Anthropic's range
    stream: Optional[bool] = None
    stop_sequences: Optional[List[str]] = None
    metadata: Optional[Metadata] = None


NO_FILES = "files are not available on this server; send the image as a base64 or url source"
REFUSED = {  # what a client may send that this server cannot honour, and why
    "container": "code execution containers are not available here",
    "mcp_servers": "MCP servers are not reached from here",
    "context_management": "the context is not managed here", "diagnostics": "not available here",
    "messages.content.source.type=file": NO_FILES, "messages.content.content.source.type=file": NO_FILES,
    ".citations": "its answers cite no documents",
    "messages.content.caller": "only {'type': 'direct'}: the model calls tools itself here (no code execution "
                               "calls them)",
    "tools.input_examples": "the chat template renders a tool's schema and description only",
    "tools.defer_loading": "there is no tool search here; every tool is in the prompt",
    "tools.display_number": "the model's computer-use prompt has one display",
    "tool_choice.disable_parallel_tool_use": "this model may answer with several calls and the server does not "
                                             "cut them",
    "output_config.effort": "the model's effort is not adjustable here",
    "thinking.display": "only 'summarized': thinking blocks carry the model's whole reasoning (nothing is "
                        "omitted or signed)",
}
ROLE_BLOCKS = {"user": ("text", "image", "tool_result"), "assistant": ("text", "tool_use", "thinking",
                                                                         "redacted_thinking")}


# ------------------------------------------------------------------------------------ body → request


def _part(block, where: str) -> Part:
    """A text or image block → a part."""
    if block.type == "text":
        return Part("text", block.text, f"{where}.text")
    s = block.source
    if s.type == "base64":
        return Part("image", "data:image;base64," + s.data, f"{where}.source.data")  # the format is told by content
    return Part("image", s.url, f"{where}.source.url")


def read_messages(wire) -> List[Turn]:
    """`system` and `messages` → turns: a user message's tool results first (the calls they answer),
    then its own blocks."""
    turns = []
    if wire.system is not None:
        text = wire.system if isinstance(wire.system, str) else "".join(b.text for b in wire.system)
        turns.append(Turn("system", [Part("text", text, "system")], param="system"))
    for i, m in enumerate(wire.messages):
        where = f"messages[{i}]"
        if isinstance(m.content, str):
            turns.append(Turn(m.role, [Part("text", m.content, f"{where}.content")], param=where))
            continue
        turn, plain, thoughts = Turn("assistant", param=where), [], []
        for j, b in enumerate(m.content):
            p = f"{where}.content[{j}]"
            if b.type not in ROLE_BLOCKS[m.role]:
                raise invalid(f"{p}.type", f"'{p}.type' is {b.type!r}; a {m.role} message takes "
                              + ", ".join(ROLE_BLOCKS[m.role]))
            if b.type in ("text", "image"):
                (turn.parts if m.role == "assistant" else plain).append(_part(b, p))
            elif b.type == "thinking":
                thoughts.append(b.thinking)
            elif b.type == "tool_use":
                call = {"name": b.name, "input": b.input}
                if b.toolset_name is not None:
                    call["toolset_name"] = b.toolset_name
                turn.calls.append(Call(b.id, b.name, arguments=json.dumps(b.input, ensure_ascii=False), action=call,
                                       param=p))
            elif b.type == "tool_result":
                content = [Part("text", b.content, f"{p}.content")] if isinstance(b.content, str) else [
                    _part(c, f"{p}.content[{k}]") for k, c in enumerate(b.content or ())]
                if b.is_error:  # the template has no error flag: the result's text says it
                    content.insert(0, Part("text", "Error: ", f"{p}.is_error"))
                turns.append(Turn("tool", content, call_id=b.tool_use_id, param=p))
        if m.role == "assistant":
            turn.reasoning = "\n\n".join(thoughts) or None
            turns.append(turn)
        elif plain:
            turns.append(Turn("user", plain, param=where))
    if turns[-1].role == "assistant":
        raise invalid(f"messages[{len(wire.messages) - 1}]", "the last message is the assistant's: continuing a "
                      "prefilled answer is not supported here; end with a user message")
    return turns


def parse_request(body, agent_format: str, count: bool = False) -> ChatRequest:
    """The body → the request (`count`: a token count's body, the prompt's fields only)."""
    wire = P.validate(CountBody if count else Body, body, REFUSED)
    turns = read_messages(wire)
    choice = wire.tool_choice or ToolChoice(type="auto")
    if choice.type == "tool" and choice.name is None:
        raise invalid("tool_choice.name", "'tool_choice.name' is required with type tool: the tool to call",
                      "missing_field")
    fmt = wire.output_config.format if wire.output_config is not None else None
    rf = P.output_format("json_schema", fmt.schema_, "output") if fmt is not None else None
    functions, tool, tool_choice = tools(
        [function_tool(t.name, t.description, t.input_schema, t.strict) for t in wire.tools or ()
         if isinstance(t, CustomTool)], body.get("tools"), {"any": "required", "tool": "function"}.get(
            choice.type, choice.type), choice.name, output=rf, output_param="output_config.format")
    if count and tool_choice not in ("auto", "none"):
        tool_choice = "auto"  # the same prompt, without compiling the grammar it would enforce
    max_tokens = None if count else wire.max_tokens
    budget = None
    if wire.thinking is not None and wire.thinking.type == "enabled":
        budget = wire.thinking.budget_tokens
        if budget is None:
            raise invalid("thinking.budget_tokens", "'thinking.budget_tokens' is required when thinking is "
                          "enabled", "missing_field")
        if max_tokens is not None and budget >= max_tokens:
            raise invalid("thinking.budget_tokens", "'thinking.budget_tokens' must be less than 'max_tokens'")
    defaults = computer_sampling(tool, agent_format)
    sampling = P.sampling_params(body, P.stop_strings(body.get("stop_sequences"), "stop_sequences"),
                                 defaults=defaults, thinking_budget=budget)
    return ChatRequest(
        turns=turns, sampling=sampling, max_tokens=max_tokens, model=wire.model, stream=bool(body.get("stream")),
        tools=functions, tool_choice=tool_choice, response_format=rf, computer=tool,
        thinking=wire.thinking.type if wire.thinking is not None else None,
        chat_template_kwargs=P.template_switches(wire.chat_template_kwargs),
        drafting=None if count else P.drafting_settings(wire),
        **{k: v or defaults.get(k) for k, v in P.pixel_options(body).items()})


# ------------------------------------------------------------------------------------ the message


class MessageWriter(Writer):
    """The message object and Anthropic's stream events: a content block per thinking block, text
    or tool use."""

    def __init__(self, req: ChatRequest, model: str, prepared, computer_request=None, opened: bool = False):
        super().__init__(req, model, prepared, computer_request, opened)
        self.id = new_id("msg", 24)
        self.content: List[dict] = []
        self.stop_reason, self.stop_sequence = None, None
        self.usage = {"input_tokens": prepared.prompt_tokens, "output_tokens": 0, "cache_read_input_tokens": 0,
                      "cache_creation_input_tokens": 0}

    def result(self) -> dict:
        return self.message

    @property
    def message(self) -> dict:
        return json.loads(json.dumps({"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                                      "content": self.content, "stop_reason": self.stop_reason,
                                      "stop_sequence": self.stop_sequence, "usage": self.usage}))

    def failed(self, error: APIError) -> list:
        return [error_body(error)]

    def start(self) -> list:
        return [{"type": "message_start", "message": {**self.message, "content": []}}, {"type": "ping"}]

    def _event(self, kind, **fields) -> dict:
        return {"type": kind, "index": len(self.content) - 1, **fields}

    def opened(self, kind) -> list:
        block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "reasoning" else \
            {"type": "text", "text": ""}
        self.content.append(block)
        return [self._event("content_block_start", content_block=dict(block))]

    def delta(self, kind, value) -> list:
        field = "thinking" if kind == "reasoning" else "text"
        self.content[-1][field] += value
        return [self._event("content_block_delta", delta={"type": f"{field}_delta", field: value})]

    def closed(self, kind, status) -> list:
        signed = [self._event("content_block_delta", delta={"type": "signature_delta", "signature": ""})]
        return (signed if kind == "reasoning" else []) + [self._event("content_block_stop")]

    def _tool_use(self, block) -> list:
        events = self.close()
        self.content.append(block)
        return events + [self._event("content_block_start", content_block={**block, "input": {}}),
                         self._event("content_block_delta", delta={"type": "input_json_delta", "partial_json":
                                                                   json.dumps(block["input"], ensure_ascii=False)}),
                         self._event("content_block_stop")]

    def call(self, call) -> list:
        fn = call["function"]
        try:
            args = json.loads(fn["arguments"])
        except json.JSONDecodeError:
            args = None
        if not isinstance(args, dict):  # not a call Anthropic's clients can run: its text stays text
            return self.segment("text", f'<tool_call>\n{{"name": {json.dumps(fn["name"])}, "arguments": '
                                        f'{fn["arguments"]}}}\n</tool_call>')
        return self._tool_use({"type": "tool_use", "id": "toolu_" + call["id"].split("_", 1)[-1],
                               "name": fn["name"], "input": args})

    def computer_call(self, call) -> tuple:
        block = {"type": "tool_use", "id": new_id("toolu", 24), "name": call["name"], "input": call["input"]}
        if "toolset_name" in call:
            block["toolset_name"] = call["toolset_name"]
        return self._tool_use(block), Call(block["id"], call["name"], action=call)

    def finished(self, ev, cut) -> list:
        if any(b["type"] == "tool_use" for b in self.content):
            self.stop_reason = "tool_use"
        elif cut:
            self.stop_reason = "max_tokens"
        else:
            self.stop_reason, self.stop_sequence = ("stop_sequence", ev.stop) if ev.stop else ("end_turn", None)
        cached = ev.cached_tokens
        self.usage = {"input_tokens": ev.prompt_tokens - cached, "output_tokens": ev.completion_tokens,
                      "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}
        if ev.draft_proposed:  # speculative decoding's drafts (this server's fields): kept, among output_tokens
            self.usage.update(accepted_draft_tokens=ev.draft_accepted,
                              rejected_draft_tokens=ev.draft_proposed - ev.draft_accepted)
        return [{"type": "message_delta", "delta": {"stop_reason": self.stop_reason,
                                                    "stop_sequence": self.stop_sequence}, "usage": dict(self.usage)},
                {"type": "message_stop"}]


# ------------------------------------------------------------------------------------ routes


def routes(service) -> list:
    async def create(request):
        return await respond(service, request, lambda body: parse_request(body, service.agent_format),
                             MessageWriter, ping=(PING_SECONDS, {"type": "ping"}))

    async def count_tokens(request):
        _, prepared, _, _ = await service.admit(
            request, lambda body: parse_request(body, service.agent_format, count=True),
            lambda req: build(service, req), submit=False)
        return JSONResponse({"input_tokens": prepared.prompt_tokens})

    return [Route("/v1/messages", create, methods=["POST"]),
            Route("/v1/messages/count_tokens", count_tokens, methods=["POST"])]
