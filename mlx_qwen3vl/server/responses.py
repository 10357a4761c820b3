"""OpenAI's Responses API: POST /v1/responses and GET /v1/responses/{id}.

The request's JSON is read into the neutral conversation (conversation.py), every field checked
against an allow-list; then the same path as chat completions: a ChatRequest through
PromptBuilder (media policy, budgets, template, tools, json_schema grammar), the model thread,
token events. A request that declares a computer-use tool (`computer_use_preview`, `computer`) is
rendered with the checkpoint's trained prompt instead (computer.py) and its answer comes back as
`computer_call` items. `<think>` text becomes a `reasoning` item.

`previous_response_id` continues a stored response (store.py): its conversation (the model's own
answer text included, so the prefix cache finds the whole history again) plus this `input`; as
OpenAI does, the earlier `instructions` do not carry over. An unknown or evicted id is a 400
(`previous_response_not_found`).
"""

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import List, Optional

from starlette.responses import JSONResponse
from starlette.routing import Route

from . import computer
from . import protocol as P
from .answer_stream import AnswerStream, prompt_opens_reasoning
from .conversation import Call, Part, Turn, function_tool
from .protocol import APIError, ChatRequest
from .store import ResponseStore

FIELDS = {"model", "input", "instructions", "previous_response_id", "max_output_tokens", "text", "tools",
          "tool_choice", "parallel_tool_calls", "stream", "store", "metadata", "include", "top_logprobs",
          "truncation", "reasoning", "stream_options", "max_tool_calls",
          # accepted, with no effect on a local server's output (docs/protocols.md says why each)
          "user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "service_tier",
          # this server's extensions, as chat completions takes them (extra_body)
          "min_pixels", "max_pixels", "chat_template_kwargs", "stop", *P.SAMPLING_FIELDS}
REFUSED = {"background": "responses are answered while the request waits",
           "conversation": "conversations are not stored here; use previous_response_id",
           "prompt": "stored prompts are not available here",
           "context_management": "the context is not managed here"}
# reasoning items carry their text as content here, nothing is encrypted: asking for it adds nothing
INCLUDABLE = ("reasoning.encrypted_content",)
MAX_METADATA = 16


def _id(prefix):
    return f"{prefix}_{uuid.uuid4().hex}"


# ---------------------------------------------------------------------------------------------
# Request → conversation
# ---------------------------------------------------------------------------------------------
INPUT_CONTENT = ("input_text", "input_image")
OUTPUT_CONTENT = ("output_text", "refusal", "input_text")
ITEM_FIELDS = {
    "message": {"type", "role", "content", "id", "status", "phase"},
    "function_call": {"type", "call_id", "name", "arguments", "id", "status", "namespace"},
    "function_call_output": {"type", "call_id", "output", "id", "status"},
    "computer_call": {"type", "call_id", "action", "actions", "id", "pending_safety_checks", "status"},
    "computer_call_output": {"type", "call_id", "output", "id", "status", "acknowledged_safety_checks"},
    "reasoning": {"type", "id", "summary", "content", "encrypted_content", "status"},
}


def _content(content, role, where) -> List[Part]:
    if isinstance(content, str):
        return [Part("text", content, where)]
    if not isinstance(content, list):
        raise P.invalid(where, f"'{where}' must be a string or a list of content parts", "invalid_type")
    parts = []
    allowed = OUTPUT_CONTENT if role == "assistant" else INPUT_CONTENT
    for j, part in enumerate(content):
        p = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in allowed:
            raise P.invalid(f"{p}.type", f"'{p}.type' is {kind!r}; a {role} message takes {', '.join(allowed)}"
                            + (" (files are not available on this server)" if kind == "input_file" else ""))
        if kind == "input_image":
            P.check_fields(part, {"type", "image_url", "detail", "file_id"}, p)
            if part.get("file_id") is not None:
                raise P.invalid(f"{p}.file_id", f"'{p}.file_id': files are not available on this server; send the "
                                "image as image_url (a data URL or an http(s) URL)", "unsupported_field")
            url = P.string(part, "image_url", p, required=True, empty=False)
            if role != "user":
                raise P.invalid(p, f"'{p}' is an image in a {role} message, where the chat template renders no "
                                "media; send it in a user message")
            detail = part.get("detail")
            if detail not in (None, "low", "high", "auto"):
                raise P.invalid(f"{p}.detail", f"'{p}.detail' must be low, high or auto")
            parts.append(Part("image", url, f"{p}.image_url", detail=detail))
        elif kind == "refusal":
            parts.append(Part("text", P.string(part, "refusal", p, required=True), p))
        else:
            P.check_fields(part, {"type", "text", "annotations", "logprobs"}, p)
            parts.append(Part("text", P.string(part, "text", p, required=True), f"{p}.text"))
    return parts


def _reasoning_text(item, where) -> Optional[str]:
    texts = []
    for key in ("content", "summary"):
        value = item.get(key) or []
        if not isinstance(value, list) or not all(isinstance(v, dict) and isinstance(v.get("text"), str)
                                                  for v in value):
            raise P.invalid(f"{where}.{key}", f"'{where}.{key}' must be a list of {{'type', 'text'}} parts",
                            "invalid_type")
        texts.append("\n".join(v["text"] for v in value))
    return texts[0] or texts[1] or None


def read_input(value, where="input") -> List[Turn]:
    """`input` (a string or a list of items) → turns."""
    if isinstance(value, str):
        return [Turn("user", [Part("text", value, where)], param=where)]
    if not isinstance(value, list):
        raise P.invalid(where, f"'{where}' must be a string or a list of items", "invalid_type")
    turns, reasoning = [], None

    def assistant(item_where):
        nonlocal reasoning
        if turns and turns[-1].role == "assistant" and reasoning is None:
            return turns[-1]
        turn = Turn("assistant", reasoning=reasoning, param=item_where)
        reasoning = None
        turns.append(turn)
        return turn

    for i, item in enumerate(value):
        p = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise P.invalid(p, f"'{p}' must be an object", "invalid_type")
        kind = item.get("type", "message" if "role" in item else None)
        if kind not in ITEM_FIELDS:
            raise P.invalid(f"{p}.type", f"'{p}.type' is {kind!r}; this server takes items of type "
                            + ", ".join(ITEM_FIELDS))
        P.check_fields(item, ITEM_FIELDS[kind], p)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise P.invalid(f"{p}.role", f"'{p}.role' is {role!r}; use user, system, developer or assistant")
            if item.get("content") is None:
                raise P.invalid(f"{p}.content", f"'{p}.content' is required", "missing_field")
            parts = _content(item["content"], role, f"{p}.content")
            if role == "assistant":
                turn = Turn("assistant", parts, reasoning=reasoning, param=p)
                reasoning = None
                turns.append(turn)
            else:
                turns.append(Turn("system" if role == "developer" else role, parts, param=p))
        elif kind == "reasoning":
            reasoning = _reasoning_text(item, p)
        elif kind == "function_call":
            call_id = P.string(item, "call_id", p, required=True, empty=False)
            name = P.string(item, "name", p, required=True, empty=False)
            arguments = P.string(item, "arguments", p, required=True)
            assistant(p).calls.append(Call(call_id, name, arguments=arguments, param=p))
        elif kind == "computer_call":
            call_id = P.string(item, "call_id", p, required=True, empty=False)
            _no_safety_checks(item, "pending_safety_checks", p)
            action = item.get("actions") if item.get("actions") is not None else item.get("action")
            if not isinstance(action, (dict, list)):
                raise P.invalid(f"{p}.action", f"'{p}' needs an 'action' (or 'actions')", "missing_field")
            key = "actions" if isinstance(action, list) else "action"
            assistant(p).calls.append(Call(call_id, "computer", action=action, param=f"{p}.{key}"))
        elif kind == "function_call_output":
            call_id = P.string(item, "call_id", p, required=True, empty=False)
            output = item.get("output")
            if output is None:
                raise P.invalid(f"{p}.output", f"'{p}.output' is required", "missing_field")
            turns.append(Turn("tool", _content(output, "user", f"{p}.output"), call_id=call_id, param=p))
        else:  # computer_call_output
            call_id = P.string(item, "call_id", p, required=True, empty=False)
            _no_safety_checks(item, "acknowledged_safety_checks", p)
            out, o = item.get("output"), f"{p}.output"
            P.check_fields(out, {"type", "image_url", "file_id"}, o)
            if out.get("type") not in ("computer_screenshot", "input_image"):
                raise P.invalid(f"{o}.type", f"'{o}.type' must be 'computer_screenshot'")
            if out.get("file_id") is not None:
                raise P.invalid(f"{o}.file_id", "files are not available on this server; send the screenshot as "
                                "image_url (a data URL)", "unsupported_field")
            url = P.string(out, "image_url", o, required=True, empty=False)
            turns.append(Turn("tool", [Part("image", url, f"{o}.image_url")], call_id=call_id, param=p))
    return turns


# ---------------------------------------------------------------------------------------------
# The request
# ---------------------------------------------------------------------------------------------
@dataclass
class ResponsesRequest:
    body_model: Optional[str]
    history: List[Turn]  # what a follow-up continues: the stored conversation and this input
    instructions: Optional[str]
    chat: ChatRequest
    tool: object  # ComputerTool or None
    stream: bool
    store: bool
    echo: dict = field(default_factory=dict)  # the request's settings the response repeats

    @property
    def turns(self) -> List[Turn]:
        head = [Turn("system", [Part("text", self.instructions, "instructions")], param="instructions")]
        return (head if self.instructions is not None else []) + self.history


def _no_safety_checks(item, key, where):
    """This server never issues safety checks: an empty list (what it sent) passes, any other is a 400."""
    if item.get(key) not in (None, []):
        raise P.invalid(f"{where}.{key}", f"'{where}.{key}' must be empty: this server issues no safety checks, "
                        "so none can be pending or acknowledged", "unsupported_field")


def _tools(tools):
    """→ (chat function tools, the computer tool or None)."""
    if tools is None:
        return None, None
    if not isinstance(tools, list):
        raise P.invalid("tools", "'tools' must be a list", "invalid_type")
    functions = []
    for i, t in enumerate(tools):
        p = f"tools[{i}]"
        kind = t.get("type") if isinstance(t, dict) else None
        if kind == "function":
            P.check_fields(t, {"type", "name", "description", "parameters", "strict"}, p)
            functions.append(function_tool(t.get("name"), t.get("description"), t.get("parameters"), p))
            if P.flag(t, "strict", p):  # its calls' arguments are held to its schema (model_inputs.py)
                functions[-1]["function"]["strict"] = True
        elif kind in ("computer_use_preview", "computer"):
            P.check_fields(t, {"type", "display_width", "display_height", "environment"}, p)
        else:
            raise P.invalid(f"{p}.type", f"'{p}.type' is {kind!r}; this server takes 'function', "
                            "'computer_use_preview' and 'computer' tools", "unsupported_tool")
    return functions or None, computer.find_tool(tools, "tools", others=functions)


def _tool_choice(choice, functions, tool):
    if choice is None:
        return "auto"
    if tool is not None:
        if choice != "auto":
            raise P.invalid("tool_choice", "with a computer-use tool 'tool_choice' must be 'auto' (the model's "
                            "computer-use answers are not constrained)")
        return "auto"
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        P.check_fields(choice, {"type", "name"}, "tool_choice")
        name = choice.get("name")
        if name not in {f["function"]["name"] for f in functions or ()}:
            raise P.invalid("tool_choice", f"'tool_choice' names function {name!r}, which is not in 'tools'")
        return {"type": "function", "function": {"name": name}}
    raise P.invalid("tool_choice", "'tool_choice' must be 'auto', 'none', 'required' or {'type': 'function', "
                    "'name': ...}")


def _text_format(text):
    if text is None:
        return None, {"format": {"type": "text"}}
    P.check_fields(text, {"format", "verbosity"}, "text", {"verbosity": "the answer's length is the model's"})
    fmt = text.get("format") or {"type": "text"}
    P.check_fields(fmt, {"type", "name", "schema", "strict", "description"}, "text.format")
    kind = fmt.get("type")
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise P.invalid("text.format.schema", "'text.format.schema' must be a JSON schema object")
        rf = {"type": "json_schema", "json_schema": {"name": fmt.get("name") or "response", "schema": fmt["schema"]}}
    elif kind in ("text", "json_object"):
        rf = {"type": kind}
    else:
        raise P.invalid("text.format.type", "'text.format.type' must be 'text', 'json_object' or 'json_schema'")
    return P.response_format(rf), {"format": fmt}


def continue_stored(req: ResponsesRequest, store: ResponseStore):
    """A follow-up's history: the stored conversation of `previous_response_id`, then its input
    (on the event loop, where the store lives)."""
    previous = req.echo["previous_response_id"]
    if previous is None:
        return
    entry = store.get(previous) if len(previous) <= 128 else None
    if entry is None:
        raise APIError(400, f"Previous response with id '{previous[:128]}' not found (this server keeps "
                       f"{store.max_entries} recent responses within {store.max_bytes >> 20} MiB; send the "
                       "whole conversation as input instead)", param="previous_response_id",
                       code="previous_response_not_found")
    req.history = list(entry.turns) + req.history


def parse_request(body, agent_format: str) -> ResponsesRequest:
    """The body → a request whose history is its input (continue_stored adds what it continues)."""
    P.check_fields(body, FIELDS, None, REFUSED)
    if body.get("input") is None:
        raise P.invalid("input", "'input' is required", "missing_field")
    model = P.string(body, "model", None)
    instructions = P.string(body, "instructions", None)
    previous = P.string(body, "previous_response_id", None)
    new = read_input(body["input"], "input")
    history = list(new)
    functions, tool = _tools(body.get("tools"))
    if tool is None:  # a computer call's action has no place in the chat template's rendering
        for call in (c for t in new for c in t.calls if c.action is not None):
            raise P.invalid(call.param, f"'{call.param}' is a computer call, but the request declares no "
                            "computer-use tool; declare the one the conversation uses")
    tool_choice = _tool_choice(body.get("tool_choice"), functions, tool)
    rf, text_echo = _text_format(body.get("text"))
    if tool is not None and rf is not None:
        raise P.invalid("text.format", "'text.format' cannot constrain a computer-use answer; leave it out")
    include = body.get("include") or []
    if not isinstance(include, list):
        raise P.invalid("include", "'include' must be a list", "invalid_type")
    for k, value in enumerate(include):
        if value not in INCLUDABLE:
            raise P.invalid(f"include[{k}]", f"'include' value {str(value)[:80]!r} is not supported by this server "
                            f"(it may list only {', '.join(INCLUDABLE)})", "unsupported_field")
    if body.get("top_logprobs") not in (None, 0):
        raise P.invalid("top_logprobs", "'top_logprobs' is not supported by this server", "unsupported_field")
    if body.get("truncation") not in (None, "disabled"):
        raise P.invalid("truncation", "'truncation' must be 'disabled': a prompt past the context is refused here, "
                        "never truncated", "unsupported_field")
    for name, kinds in (("reasoning", dict), ("stream_options", dict), ("metadata", dict)):
        if body.get(name) is not None and not isinstance(body[name], kinds):
            raise P.invalid(name, f"'{name}' must be an object", "invalid_type")
    metadata = body.get("metadata") or {}
    if len(metadata) > MAX_METADATA or not all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str)
                                               and len(v) <= 512 for k, v in metadata.items()):
        raise P.invalid("metadata", f"'metadata' holds at most {MAX_METADATA} string values (keys up to 64 "
                        "characters, values up to 512)")
    if P.flag(body, "parallel_tool_calls", None, True) is not True:
        raise P.invalid("parallel_tool_calls", "'parallel_tool_calls' must be true: this model may answer with several "
                        "calls and the server does not cut them", "unsupported_field")
    P.check_fields(body.get("reasoning") or {}, {"effort", "summary", "generate_summary"}, "reasoning")
    for key in ("summary", "generate_summary"):
        if (body.get("reasoning") or {}).get(key) is not None:
            raise P.invalid(f"reasoning.{key}", f"'reasoning.{key}' is not supported by this server: it makes no "
                            "summaries; reasoning items carry the whole reasoning text as content",
                            "unsupported_field")
    P.check_fields(body.get("stream_options") or {}, {"include_obfuscation"}, "stream_options")
    if P.flag(body.get("stream_options") or {}, "include_obfuscation", "stream_options") is True:
        raise P.invalid("stream_options.include_obfuscation", "'stream_options.include_obfuscation' is not "
                        "supported by this server: stream events are not padded", "unsupported_field")
    if body.get("prompt_cache_retention") not in (None, "in-memory", "in_memory"):
        raise P.invalid("prompt_cache_retention", "'prompt_cache_retention' must be 'in-memory': this server keeps "
                        "its prefix cache in memory only", "unsupported_field")
    if (body.get("reasoning") or {}).get("effort") is not None:
        raise P.invalid("reasoning.effort", "'reasoning.effort' is not available here: this checkpoint's thinking is "
                        "switched by 'chat_template_kwargs': {'enable_thinking': ...}", "unsupported_field")
    max_tool_calls = P.number(body, "max_tool_calls", 1, integer=True)
    defaults = computer.sampling_defaults(agent_format) if tool is not None else {}
    stop = P.stop_strings(body.get("stop"), "stop")
    sampling = P.sampling_params(body, stop, defaults=defaults)
    pixels = P.pixel_options(body)
    for k in ("min_pixels", "max_pixels"):
        pixels[k] = pixels[k] or defaults.get(k)
    max_tokens = P.number(body, "max_output_tokens", 1, integer=True, default=defaults.get("max_tokens"))
    chat = ChatRequest(turns=[], sampling=sampling, max_tokens=max_tokens, model=model,
                       tools=functions, tool_choice=tool_choice if functions else "none", response_format=rf,
                       chat_template_kwargs=P.template_switches(body.get("chat_template_kwargs")), **pixels)
    echo = {"instructions": instructions, "max_output_tokens": body.get("max_output_tokens"),
            "metadata": metadata, "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": previous, "reasoning": body.get("reasoning") or {"effort": None, "summary": None},
            "temperature": sampling.temperature, "top_p": sampling.top_p, "text": text_echo,
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
            "truncation": body.get("truncation") or "disabled", "user": body.get("user"),
            "max_tool_calls": max_tool_calls}
    return ResponsesRequest(model, history, instructions, chat, tool, P.flag(body, "stream", None),
                            P.flag(body, "store", None, True), echo)


# ---------------------------------------------------------------------------------------------
# Events → the response and its stream events
# ---------------------------------------------------------------------------------------------
class Writer:
    """One response as it is produced: each engine event → the stream events it makes (a plain
    request ignores them and takes `response` at the end), and the answer's own turn."""

    def __init__(self, req: ResponsesRequest, model: str, opened: bool, computer_request=None):
        self.req, self.model, self.computer = req, model, computer_request
        self.id, self.created = _id("resp"), int(time.time())
        self.seq = 0
        self.output: List[dict] = []
        self.open = None  # the output item being streamed (reasoning or message), or None
        self.parts = AnswerStream(tools=bool(req.chat.tools) and req.chat.tool_choice != "none", opened=opened)
        self.raw, self.reasoning_tokens = [], 0
        self.status, self.usage, self.error = "in_progress", None, None
        self.turn: Optional[Turn] = None
        self.calls_made = 0

    def event(self, kind, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def result(self) -> dict:
        return self.response

    @property
    def response(self) -> dict:
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": self.status,
               "error": self.error, "incomplete_details": None, "model": self.model, "output": self.output,
               "usage": self.usage, "store": self.req.store, **self.req.echo}
        if self.status == "incomplete":
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        return json.loads(json.dumps(out))  # a snapshot: later events must not change what was sent

    def start(self) -> List[dict]:
        return [self.event("response.created", response=self.response),
                self.event("response.in_progress", response=self.response)]

    # -- items
    def _close(self, status="completed") -> List[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        i = self.output.index(item)
        item["status"] = status
        part = item["content"][0]
        if item["type"] == "reasoning":
            events = [self.event("response.reasoning_text.done", item_id=item["id"], output_index=i,
                                 content_index=0, text=part["text"])]
        else:
            events = [self.event("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                                 text=part["text"], logprobs=[])]
        return events + [self.event("response.content_part.done", item_id=item["id"], output_index=i,
                                    content_index=0, part=dict(part)),
                         self.event("response.output_item.done", output_index=i, item=json.loads(json.dumps(item)))]

    def _open(self, kind) -> List[dict]:
        if self.open is not None and self.open["type"] == kind:
            return []
        events = self._close()
        if kind == "reasoning":
            item = {"type": "reasoning", "id": _id("rs"), "summary": [], "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"type": "message", "id": _id("msg"), "status": "in_progress", "role": "assistant", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.output.append(item)
        self.open = item
        i = len(self.output) - 1
        events.append(self.event("response.output_item.added", output_index=i, item=json.loads(json.dumps(item))))
        item["content"].append(part)
        events.append(self.event("response.content_part.added", item_id=item["id"], output_index=i,
                                 content_index=0, part=dict(part)))
        return events

    def _segment(self, kind, value) -> List[dict]:
        if kind == "call":
            if not self._may_call():  # past max_tool_calls: the call is dropped, as OpenAI ignores it
                return []
            events = self._close()
            fn = value["function"]
            item = {"type": "function_call", "id": _id("fc"), "call_id": value["id"], "name": fn["name"],
                    "arguments": "", "status": "in_progress"}
            self.output.append(item)
            i = len(self.output) - 1
            events.append(self.event("response.output_item.added", output_index=i, item=dict(item)))
            events.append(self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=i,
                                     delta=fn["arguments"]))
            item.update(arguments=fn["arguments"], status="completed")
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                                     name=fn["name"], arguments=fn["arguments"]))
            return events + [self.event("response.output_item.done", output_index=i, item=dict(item))]
        events = self._open("reasoning" if kind == "reasoning" else "message")
        item, i = self.open, len(self.output) - 1
        item["content"][0]["text"] += value
        if not value:
            return events
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return events + [self.event(name, item_id=item["id"], output_index=i, content_index=0, delta=value, **extra)]

    def _may_call(self) -> bool:
        cap = self.req.echo.get("max_tool_calls")
        self.calls_made += 1
        return cap is None or self.calls_made <= cap

    def _whole_item(self, item) -> List[dict]:
        self.output.append(item)
        i = len(self.output) - 1
        return [self.event("response.output_item.added", output_index=i, item={**item, "status": "in_progress"}),
                self.event("response.output_item.done", output_index=i, item=dict(item))]

    # -- engine events
    def token(self, ev) -> List[dict]:
        self.raw.append(ev.text)
        if self.computer is not None:  # the whole answer is mapped at the end
            return []
        inside = self.parts.in_reasoning
        events = [e for kind, value in self.parts.feed(ev.text) for e in self._segment(kind, value)]
        self.reasoning_tokens += inside
        return events

    def done(self, ev) -> List[dict]:
        answer = "".join(self.raw)
        cut = ev.finish_reason in ("length", "time_limit")
        if self.computer is not None:
            events = self._computer(answer)
        else:
            events = [e for kind, value in self.parts.finish() for e in self._segment(kind, value)]
            events += self._close("incomplete" if cut else "completed")
            calls = [Call(o["call_id"], o["name"], arguments=o["arguments"]) for o in self.output
                     if o["type"] == "function_call"]
            self.turn = Turn("assistant", [Part("text", self.parts.text)], calls, self.parts.reasoning or None,
                             answer=answer)
        self.status = "incomplete" if cut else "completed"
        n, cached = ev.prompt_tokens, ev.cached_tokens
        self.usage = {"input_tokens": n, "input_tokens_details": {"cached_tokens": cached},
                      "output_tokens": ev.completion_tokens,
                      "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                      "total_tokens": n + ev.completion_tokens}
        name = "response.incomplete" if cut else "response.completed"
        return events + [self.event(name, response=self.response)]

    def _computer(self, answer) -> List[dict]:
        turn = self.computer.turn(answer)
        events, calls = [], []
        if turn.reasoning:
            events += self._whole_item({"type": "reasoning", "id": _id("rs"), "summary": [], "status": "completed",
                                        "content": [{"type": "reasoning_text", "text": turn.reasoning}]})
        if turn.text or not turn.calls:
            events += self._whole_item({"type": "message", "id": _id("msg"), "status": "completed",
                                        "role": "assistant", "content": [{"type": "output_text", "text": turn.text,
                                                                          "annotations": [], "logprobs": []}]})
        tool = self.computer.tool
        for batch in ([turn.calls] if tool.batched else [[c] for c in turn.calls]) if turn.calls else []:
            if not self._may_call():
                break
            call_id = _id("call")
            item = {"type": "computer_call", "id": _id("cu"), "call_id": call_id, "pending_safety_checks": [],
                    "status": "completed"}
            item.update({"actions": batch} if tool.batched else {"action": batch[0]})
            events += self._whole_item(item)
            calls.append(Call(call_id, "computer", action=batch if tool.batched else batch[0]))
        self.computer.issued(answer, calls)
        self.turn = Turn("assistant", [Part("text", turn.text)], calls, turn.reasoning, answer=answer)
        return events

    def failed(self, error: APIError) -> List[dict]:
        self.status = "failed"
        self.error = {"code": error.code or error.type, "message": error.message}
        return [self.event("error", code=error.code, message=error.message, param=error.param),
                self.event("response.failed", response=self.response)]


def _sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


# ---------------------------------------------------------------------------------------------
# Routes
# ---------------------------------------------------------------------------------------------
def routes(service, store: ResponseStore) -> list:
    tokenizer = service.processor.tokenizer

    def build(req: ResponsesRequest):
        if req.tool is not None:
            return computer.prepare(service.builder, req.chat, req.turns, req.tool, service.agent_format,
                                    service.computer_answers, service.agent_history)
        req.chat.turns = req.turns
        return service.builder.build(req.chat), None

    def keep(req: ResponsesRequest, writer: Writer):  # (awaited before the answer's end is sent)
        if req.store and writer.turn is not None:
            return store.keep(writer.id, req.history + [writer.turn], writer.response, service.prepare_pool)

    async def create(request):
        req, prepared, computer_request, handle = await service.admit(
            request, lambda body: parse_request(body, service.agent_format), build,
            then=lambda req: continue_stored(req, store))
        writer = Writer(req, req.body_model or service.model_id, prompt_opens_reasoning(tokenizer, prepared.tokens),
                        computer_request)
        return await service.answer(request, handle, writer, _sse, req.stream, on_done=lambda: keep(req, writer))

    async def retrieve(request):
        service.check_auth(request)
        rid = request.path_params["response_id"]
        entry = store.get(rid)
        if entry is None:
            raise APIError(404, f"Response with id '{rid[:128]}' not found (this server keeps recent responses "
                           "only)", param="response_id", code="response_not_found")
        return JSONResponse(entry.response)

    return [Route("/v1/responses", create, methods=["POST"]),
            Route("/v1/responses/{response_id}", retrieve, methods=["GET"])]
