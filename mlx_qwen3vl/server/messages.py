"""Anthropic's Messages API: POST /v1/messages and POST /v1/messages/count_tokens.

The request's JSON is read into the neutral conversation (conversation.py), every field checked
against an allow-list, then the same path as chat completions: a ChatRequest through PromptBuilder
(media policy, budgets, template, tools, json_schema grammar), the model thread, token events.
Images come as base64 or URL sources (URLs under the server's media policy). A request that
declares a computer-use tool (computer_20250124, computer_20251124, computer_toolset_20260801) is
rendered with the checkpoint's trained prompt instead (computer.py) and its answer comes back as
`tool_use` blocks; `<think>` text becomes a thinking block (with an empty signature: nothing is
signed here, and thinking blocks sent back are read as the model's earlier reasoning).

Sampling: today's `anthropic` SDK has no temperature / top_p / top_k arguments on messages.create,
so they (and this server's other sampling fields, min_pixels / max_pixels) are read from the body
(`extra_body`). Usage counts as Anthropic's do: `input_tokens` are the prompt tokens not read from
the prefix cache, `cache_read_input_tokens` those that were. Errors have Anthropic's shape,
`{"type": "error", "error": {"type", "message"}}` (app.py renders every error under /v1/messages so).
"""

import json
import uuid
from typing import List, Optional

from starlette.responses import JSONResponse
from starlette.routing import Route

from . import computer
from . import protocol as P
from .answer_stream import AnswerStream, prompt_opens_reasoning
from .conversation import Call, Part, Turn, function_tool
from .protocol import APIError, ChatRequest

FIELDS = {"model", "max_tokens", "messages", "system", "stop_sequences", "stream", "metadata", "tools",
          "tool_choice", "thinking", "output_config", "temperature", "top_p", "top_k",
          # accepted, with no effect on a local server's output (docs/protocols.md says why each)
          "service_tier", "cache_control", "inference_geo", "speed", "user_profile_id", "workspace_id",
          # this server's extensions (extra_body)
          "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "min_pixels", "max_pixels",
          "chat_template_kwargs"}
COUNT_FIELDS = FIELDS - {"max_tokens", "stream", "stop_sequences", "metadata", "temperature", "top_p", "top_k",
                         "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed"}
REFUSED = {"container": "code execution containers are not available here",
           "mcp_servers": "MCP servers are not reached from here",
           "context_management": "the context is not managed here", "diagnostics": "not available here"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 421: "permission_error",
               429: "rate_limit_error", 503: "overloaded_error"}
PING_SECONDS = 10  # a stream's keep-alive while the answer is not yet coming (a long prefill)


def error_body(e: APIError) -> dict:
    kind = ERROR_TYPES.get(e.status, "invalid_request_error" if 400 <= e.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def _id(prefix):
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


# ---------------------------------------------------------------------------------------------
# Request → conversation
# ---------------------------------------------------------------------------------------------
BLOCK_FIELDS = {
    "text": {"type", "text", "cache_control", "citations"},
    "image": {"type", "source", "cache_control"},
    "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control", "toolset_name"},
    "tool_use": {"type", "id", "name", "input", "cache_control", "toolset_name", "caller"},
    "thinking": {"type", "thinking", "signature"},
    "redacted_thinking": {"type", "data"},
}
USER_BLOCKS, ASSISTANT_BLOCKS = ("text", "image", "tool_result"), ("text", "tool_use", "thinking", "redacted_thinking")


def _image(block, where) -> Part:
    src, s = block.get("source"), f"{where}.source"
    P.check_fields(src, {"type", "media_type", "data", "url", "file_id"}, s)
    kind = src.get("type")
    if kind == "base64":
        data = P.string(src, "data", s, required=True, empty=False)
        return Part("image", "data:image;base64," + data, f"{s}.data")  # the format is told by content
    if kind == "url":
        return Part("image", P.string(src, "url", s, required=True, empty=False), f"{s}.url")
    if kind == "file":
        raise P.invalid(f"{s}.type", "files are not available on this server; send the image as a base64 or url "
                        "source", "unsupported_field")
    raise P.invalid(f"{s}.type", f"'{s}.type' must be 'base64' or 'url'")


def _blocks(content, allowed, where) -> list:
    """Content (a string or blocks) → [(block type, block, param)], each block's fields checked."""
    if isinstance(content, str):
        return [("text", {"type": "text", "text": content}, where)]
    if not isinstance(content, list):
        raise P.invalid(where, f"'{where}' must be a string or a list of content blocks", "invalid_type")
    out = []
    for j, block in enumerate(content):
        p = f"{where}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in allowed:
            raise P.invalid(f"{p}.type", f"'{p}.type' is {kind!r}; here this server takes {', '.join(allowed)}")
        P.check_fields(block, BLOCK_FIELDS[kind], p)
        out.append((kind, block, p))
    return out


def _parts(content, where) -> List[Part]:
    """A user's (or a tool result's) text and image blocks → parts."""
    parts = []
    for kind, block, p in _blocks(content, ("text", "image"), where):
        if kind == "text":
            _no_citations(block, p)
            parts.append(Part("text", P.string(block, "text", p, required=True), f"{p}.text"))
        else:
            parts.append(_image(block, p))
    return parts


def _no_citations(block, where):
    """A text block's citations: this server cites nothing, so only an empty (or disabled) one passes."""
    cites = block.get("citations")
    if cites in (None, []) or (isinstance(cites, dict) and cites.get("enabled") is False):
        return
    raise P.invalid(f"{where}.citations", f"'{where}.citations' is not supported by this server: its answers cite "
                    "no documents", "unsupported_field")


def read_messages(body) -> List[Turn]:
    turns = []
    system = body.get("system")
    if system is not None:
        text = "".join(b["text"] for kind, b, p in _blocks(system, ("text",), "system")
                       if P.string(b, "text", p, required=True) is not None)
        turns.append(Turn("system", [Part("text", text, "system")], param="system"))
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise P.invalid("messages", "'messages' must be a non-empty list", "missing_field" if messages is None
                        else "invalid_type")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        P.check_fields(m, {"role", "content"}, where)
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise P.invalid(f"{where}.role", f"'{where}.role' is {role!r}; use 'user' or 'assistant'")
        if m.get("content") is None:
            raise P.invalid(f"{where}.content", f"'{where}.content' is required", "missing_field")
        c = f"{where}.content"
        if role == "assistant":
            turn = Turn("assistant", param=where)
            thoughts = []
            for kind, block, p in _blocks(m["content"], ASSISTANT_BLOCKS, c):
                if kind == "text":
                    _no_citations(block, p)
                    turn.parts.append(Part("text", P.string(block, "text", p, required=True), p))
                elif kind == "thinking":
                    thoughts.append(P.string(block, "thinking", p, required=True))
                elif kind == "tool_use":
                    name = P.string(block, "name", p, required=True, empty=False)
                    caller = block.get("caller")
                    if caller is not None and (not isinstance(caller, dict) or caller.get("type") != "direct"):
                        raise P.invalid(f"{p}.caller", f"'{p}.caller' must be {{'type': 'direct'}}: the model calls "
                                        "tools itself here (no code execution calls them)", "unsupported_field")
                    if not isinstance(block.get("input"), dict):
                        raise P.invalid(f"{p}.input", f"'{p}.input' must be an object", "invalid_type")
                    call = {"name": name, "input": block["input"]}
                    if block.get("toolset_name") is not None:
                        call["toolset_name"] = block["toolset_name"]
                    turn.calls.append(Call(P.string(block, "id", p, required=True, empty=False), name,
                                           arguments=json.dumps(block["input"], ensure_ascii=False),
                                           action=call, param=p))
            turn.reasoning = "\n\n".join(thoughts) or None
            turns.append(turn)
            continue
        plain = []  # a user message: its tool results first (the calls they answer), then its own blocks
        for kind, block, p in _blocks(m["content"], USER_BLOCKS, c):
            if kind == "tool_result":
                call_id = P.string(block, "tool_use_id", p, required=True, empty=False)
                content = block.get("content")
                parts = _parts(content, f"{p}.content") if content is not None else []
                if P.flag(block, "is_error", p):  # the template has no error flag: the result's text says it
                    parts.insert(0, Part("text", "Error: ", f"{p}.is_error"))
                turns.append(Turn("tool", parts, call_id=call_id, param=p))
            elif kind == "text":
                _no_citations(block, p)
                plain.append(Part("text", P.string(block, "text", p, required=True), f"{p}.text"))
            else:
                plain.append(_image(block, p))
        if plain:
            turns.append(Turn("user", plain, param=where))
    if turns[-1].role == "assistant":
        raise P.invalid(f"messages[{len(messages) - 1}]", "the last message is the assistant's: continuing a "
                        "prefilled answer is not supported here; end with a user message")
    return turns


def _tools(tools):
    if tools is None:
        return None, None
    if not isinstance(tools, list):
        raise P.invalid("tools", "'tools' must be a list", "invalid_type")
    functions = []
    for i, t in enumerate(tools):
        p = f"tools[{i}]"
        kind = t.get("type", "custom") if isinstance(t, dict) else None
        if kind == "custom":
            P.check_fields(t, {"type", "name", "description", "input_schema", "cache_control", "strict",
                               "input_examples", "defer_loading", "eager_input_streaming"}, p)
            functions.append(function_tool(t.get("name"), t.get("description"), t.get("input_schema"), p))
            if P.flag(t, "strict", p):  # its calls' input is held to its schema (model_inputs.py)
                functions[-1]["function"]["strict"] = True
            if t.get("input_examples") not in (None, []):
                raise P.invalid(f"{p}.input_examples", f"'{p}.input_examples' is not supported by this server: the "
                                "chat template renders a tool's schema and description only", "unsupported_field")
            if P.flag(t, "defer_loading", p):
                raise P.invalid(f"{p}.defer_loading", f"'{p}.defer_loading' is not supported by this server: there "
                                "is no tool search here; every tool is in the prompt", "unsupported_field")
            P.flag(t, "eager_input_streaming", p)  # a call's input is streamed whole, once it is complete
        elif kind in ("computer_20250124", "computer_20251124"):
            P.check_fields(t, {"type", "name", "display_width_px", "display_height_px", "display_number",
                               "enable_zoom", "cache_control"}, p)
            if t.get("display_number") is not None:
                raise P.invalid(f"{p}.display_number", f"'{p}.display_number' is not supported by this server: the "
                                "model's computer-use prompt has one display", "unsupported_field")
        elif kind == "computer_toolset_20260801":
            P.check_fields(t, {"type", "configs", "cache_control"}, p)
        else:
            raise P.invalid(f"{p}.type", f"'{p}.type' is {kind!r}; this server takes custom tools and the computer "
                            "tools (computer_20250124, computer_20251124, computer_toolset_20260801)",
                            "unsupported_tool")
    return functions or None, computer.find_tool(tools, "tools", others=functions)


def _tool_choice(choice, functions, tool):
    if choice is None:
        return "auto"
    P.check_fields(choice, {"type", "name", "disable_parallel_tool_use"}, "tool_choice")
    if choice.get("disable_parallel_tool_use"):
        raise P.invalid("tool_choice.disable_parallel_tool_use", "'tool_choice.disable_parallel_tool_use' is not "
                        "available here: this model may answer with several calls and the server does not cut them",
                        "unsupported_field")
    kind = choice.get("type")
    if tool is not None:
        if kind != "auto":
            raise P.invalid("tool_choice.type", "with a computer-use tool 'tool_choice' must be auto (the model's "
                            "computer-use answers are not constrained)")
        return "auto"
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool":
        name = choice.get("name")
        if name not in {f["function"]["name"] for f in functions or ()}:
            raise P.invalid("tool_choice.name", f"'tool_choice' names tool {name!r}, which is not in 'tools'")
        return {"type": "function", "function": {"name": name}}
    raise P.invalid("tool_choice.type", "'tool_choice.type' must be auto, any, tool or none")


def _output_format(config):
    if config is None:
        return None
    P.check_fields(config, {"format", "effort"}, "output_config",
                   {"effort": "the model's effort is not adjustable here"})
    fmt = config.get("format")
    if fmt is None:
        return None
    P.check_fields(fmt, {"type", "schema"}, "output_config.format")
    if fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise P.invalid("output_config.format", "'output_config.format' must be {'type': 'json_schema', "
                        "'schema': {...}}")
    return P.response_format({"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}})


def parse_request(body, agent_format: str, count=False):
    """→ (turns, ChatRequest, computer tool or None, stream)."""
    P.check_fields(body, COUNT_FIELDS if count else FIELDS, None, REFUSED)
    P.string(body, "model", None, required=True)
    turns = read_messages(body)
    functions, tool = _tools(body.get("tools"))
    tool_choice = _tool_choice(body.get("tool_choice"), functions, tool)
    rf = _output_format(body.get("output_config"))
    if tool is not None and rf is not None:
        raise P.invalid("output_config.format", "a computer-use answer cannot be constrained; leave it out")
    thinking, budget = _thinking(body)
    if body.get("metadata") is not None:
        P.check_fields(body["metadata"], {"user_id"}, "metadata")
    defaults = computer.sampling_defaults(agent_format) if tool is not None else {}
    max_tokens = None
    if not count:
        max_tokens = P.number(body, "max_tokens", 1, integer=True)
        if max_tokens is None:
            raise P.invalid("max_tokens", "'max_tokens' is required", "missing_field")
    if body.get("temperature") is not None:
        P.number(body, "temperature", 0, 1)  # Anthropic's range
    sampling = P.sampling_params(body, P.stop_strings(body.get("stop_sequences"), "stop_sequences"),
                                 defaults=defaults, thinking_budget=budget)
    pixels = P.pixel_options(body)
    for k in ("min_pixels", "max_pixels"):
        pixels[k] = pixels[k] or defaults.get(k)
    if count and tool_choice not in ("auto", "none"):
        tool_choice = "auto"  # the same prompt, without compiling the grammar it would enforce
    chat = ChatRequest(turns=[], sampling=sampling, max_tokens=max_tokens, model=body.get("model"),
                       tools=functions, tool_choice=tool_choice if functions else "none", response_format=rf,
                       chat_template_kwargs=P.template_switches(body.get("chat_template_kwargs")), **pixels)
    return turns, chat, tool, P.flag(body, "stream", None), thinking


def _thinking(body):
    """(thinking.type, budget_tokens), checked (None when not sent); whether the checkpoint can is
    checked once its prompt is rendered (check_thinking)."""
    thinking = body.get("thinking")
    budget = None
    if thinking is None:
        return None, None
    P.check_fields(thinking, {"type", "budget_tokens", "display"}, "thinking")
    kind = thinking.get("type")
    if kind not in ("enabled", "disabled", "adaptive"):
        raise P.invalid("thinking.type", "'thinking.type' must be enabled, disabled or adaptive")
    if kind == "enabled":
        budget = P.number(thinking, "budget_tokens", 1024, integer=True, param="thinking.budget_tokens")
        if budget is None:
            raise P.invalid("thinking.budget_tokens", "'thinking.budget_tokens' is required when thinking is "
                            "enabled", "missing_field")
        if isinstance(body.get("max_tokens"), int) and budget >= body["max_tokens"]:
            raise P.invalid("thinking.budget_tokens", "'thinking.budget_tokens' must be less than 'max_tokens'")
    if thinking.get("display") not in (None, "summarized"):  # the whole reasoning is sent: no summary is shorter
        raise P.invalid("thinking.display", "'thinking.display' must be 'summarized' here: thinking blocks carry "
                        "the model's whole reasoning (nothing is omitted or signed)", "unsupported_field")
    return kind, budget


def check_thinking(kind, thinks: bool):
    """The rendered prompt decides: a thinking checkpoint's opens a <think> block."""
    if kind == "enabled" and not thinks:
        raise P.invalid("thinking.type", "'thinking' cannot be enabled: this checkpoint's chat template does not "
                        "think (use a Qwen3-VL Thinking checkpoint)", "unsupported_field")
    if kind == "disabled" and thinks:
        raise P.invalid("thinking.type", "'thinking' cannot be disabled: this checkpoint's chat template always "
                        "thinks (use a Qwen3-VL Instruct checkpoint)", "unsupported_field")


# ---------------------------------------------------------------------------------------------
# Events → the message and its stream events
# ---------------------------------------------------------------------------------------------
class Writer:
    """One message as it is produced: each engine event → the stream events it makes (a plain
    request ignores them and takes `message` at the end)."""

    def __init__(self, chat: ChatRequest, model: str, prompt_tokens: int, opened: bool, computer_request):
        self.chat, self.model, self.computer = chat, model, computer_request
        self.id = _id("msg")
        self.content: List[dict] = []
        self.open = None
        self.parts = AnswerStream(tools=bool(chat.tools) and chat.tool_choice != "none", opened=opened)
        self.raw = []
        self.stop_reason, self.stop_sequence = None, None
        self.usage = {"input_tokens": prompt_tokens, "output_tokens": 0, "cache_read_input_tokens": 0,
                      "cache_creation_input_tokens": 0}

    def result(self) -> dict:
        return self.message

    @property
    def message(self) -> dict:
        return json.loads(json.dumps({"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                                      "content": self.content, "stop_reason": self.stop_reason,
                                      "stop_sequence": self.stop_sequence, "usage": self.usage}))

    def failed(self, error: APIError) -> List[tuple]:
        return [("error", error_body(error))]

    def start(self) -> List[tuple]:
        return [("message_start", {"type": "message_start", "message": {**self.message, "content": []}}),
                ("ping", {"type": "ping"})]

    def _close(self) -> List[tuple]:
        if self.open is None:
            return []
        i, self.open = self.content.index(self.open), None
        events = []
        if self.content[i]["type"] == "thinking":
            events.append(("content_block_delta", {"type": "content_block_delta", "index": i,
                                                   "delta": {"type": "signature_delta", "signature": ""}}))
        return events + [("content_block_stop", {"type": "content_block_stop", "index": i})]

    def _block(self, block, delta=None) -> List[tuple]:
        """A whole block: start, one delta, stop."""
        events = self._close()
        self.content.append(block)
        i = len(self.content) - 1
        start = dict(block)
        if block["type"] == "tool_use":
            start["input"] = {}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}
        elif block["type"] == "text":
            start["text"] = ""
            delta = {"type": "text_delta", "text": block["text"]}
        elif block["type"] == "thinking":
            start["thinking"] = ""
            delta = {"type": "thinking_delta", "thinking": block["thinking"]}
        events.append(("content_block_start", {"type": "content_block_start", "index": i, "content_block": start}))
        events.append(("content_block_delta", {"type": "content_block_delta", "index": i, "delta": delta}))
        if block["type"] == "thinking":
            events.append(("content_block_delta", {"type": "content_block_delta", "index": i,
                                                   "delta": {"type": "signature_delta", "signature": ""}}))
        return events + [("content_block_stop", {"type": "content_block_stop", "index": i})]

    def _segment(self, kind, value) -> List[tuple]:
        if kind == "call":
            fn = value["function"]
            try:
                args = json.loads(fn["arguments"])
            except json.JSONDecodeError:
                args = None
            if not isinstance(args, dict):  # not a call Anthropic's clients can run: its text stays text
                return self._segment("text", f'<tool_call>\n{{"name": {json.dumps(fn["name"])}, "arguments": '
                                             f'{fn["arguments"]}}}\n</tool_call>')
            return self._block({"type": "tool_use", "id": "toolu_" + value["id"].split("_", 1)[-1],
                                "name": fn["name"], "input": args})
        btype, field, dtype = (("thinking", "thinking", "thinking_delta") if kind == "reasoning"
                               else ("text", "text", "text_delta"))
        events = []
        if self.open is None or self.open["type"] != btype:
            events = self._close()
            block = {"type": "thinking", "thinking": "", "signature": ""} if btype == "thinking" \
                else {"type": "text", "text": ""}
            self.content.append(block)
            self.open = block
            events.append(("content_block_start", {"type": "content_block_start", "index": len(self.content) - 1,
                                                   "content_block": dict(block)}))
        self.open[field] += value
        if value:
            events.append(("content_block_delta", {"type": "content_block_delta", "index": len(self.content) - 1,
                                                   "delta": {"type": dtype, field: value}}))
        return events

    def token(self, ev) -> List[tuple]:
        self.raw.append(ev.text)
        if self.computer is not None:
            return []
        return [e for kind, value in self.parts.feed(ev.text) for e in self._segment(kind, value)]

    def done(self, ev) -> List[tuple]:
        answer = "".join(self.raw)
        if self.computer is not None:
            turn = self.computer.turn(answer)
            events = []
            if turn.reasoning:
                events += self._block({"type": "thinking", "thinking": turn.reasoning, "signature": ""})
            if turn.text or not turn.calls:
                events += self._block({"type": "text", "text": turn.text})
            issued = []
            for call in turn.calls:
                block = {"type": "tool_use", "id": _id("toolu"), "name": call["name"], "input": call["input"]}
                if "toolset_name" in call:
                    block["toolset_name"] = call["toolset_name"]
                events += self._block(block)
                issued.append(Call(block["id"], call["name"], action=call))
            self.computer.issued(answer, issued)
            calls = bool(turn.calls)
        else:
            events = [e for kind, value in self.parts.finish() for e in self._segment(kind, value)]
            events += self._close()
            calls = any(b["type"] == "tool_use" for b in self.content)
        finish = ev.finish_reason
        if calls:
            self.stop_reason = "tool_use"
        elif finish in ("length", "time_limit"):
            self.stop_reason = "max_tokens"
        else:
            stop = ev.stop
            self.stop_reason, self.stop_sequence = ("stop_sequence", stop) if stop else ("end_turn", None)
        cached = ev.cached_tokens
        self.usage = {"input_tokens": ev.prompt_tokens - cached, "output_tokens": ev.completion_tokens,
                      "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}
        return events + [("message_delta", {"type": "message_delta",
                                            "delta": {"stop_reason": self.stop_reason,
                                                      "stop_sequence": self.stop_sequence},
                                            "usage": dict(self.usage)}),
                         ("message_stop", {"type": "message_stop"})]


def _sse(event) -> str:
    name, data = event
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


# ---------------------------------------------------------------------------------------------
# Routes
# ---------------------------------------------------------------------------------------------
def routes(service) -> list:
    tokenizer = service.processor.tokenizer

    template = getattr(service.processor, "chat_template", None) or getattr(tokenizer, "chat_template", None) or ""
    switch = isinstance(template, str) and "enable_thinking" in template  # a hybrid template's switch

    def build(parsed):
        turns, chat, tool, _, thinking = parsed
        if thinking in ("enabled", "disabled") and switch:
            chat.chat_template_kwargs.setdefault("enable_thinking", thinking == "enabled")
        if tool is not None:
            built = computer.prepare(service.builder, chat, turns, tool, service.agent_format,
                                     service.computer_answers, service.agent_history)
        else:
            chat.turns = turns
            built = service.builder.build(chat), None
        check_thinking(thinking, prompt_opens_reasoning(tokenizer, built[0].tokens))
        return built

    async def create(request):
        (turns, chat, tool, stream, _), prepared, computer_request, handle = await service.admit(
            request, lambda body: parse_request(body, service.agent_format), build)
        writer = Writer(chat, chat.model, prepared.prompt_tokens, prompt_opens_reasoning(tokenizer, prepared.tokens),
                        computer_request)
        return await service.answer(request, handle, writer, _sse, stream,
                                    ping=(PING_SECONDS, ("ping", {"type": "ping"})))

    async def count_tokens(request):
        _, prepared, _, _ = await service.admit(
            request, lambda body: parse_request(body, service.agent_format, count=True), build, submit=False)
        return JSONResponse({"input_tokens": prepared.prompt_tokens})

    return [Route("/v1/messages", create, methods=["POST"]),
            Route("/v1/messages/count_tokens", count_tokens, methods=["POST"])]
