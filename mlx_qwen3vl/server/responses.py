"""OpenAI's Responses API: POST /v1/responses and GET /v1/responses/{id}, its body, its response
object and its stream events.

The body is validated by pydantic models of the wire format (strict types, every field known; a
field this server cannot honour is refused with the reason, by its path) and read into the one
internal request (protocol.ChatRequest), then admitted, built and answered as every endpoint's is
(endpoint.py). A request that declares a computer-use tool (`computer_use_preview`, `computer`) is
rendered with the checkpoint's trained prompt instead (computer.py) and its answer comes back as
`computer_call` items. `<think>` text becomes a `reasoning` item.

`previous_response_id` continues a stored response (store.py): its conversation (the model's own
answer text included, so the prefix cache finds the whole history again) plus this `input`; as
OpenAI does, the earlier `instructions` do not carry over. An unknown or evicted id is a 400
(`previous_response_not_found`).
"""

import copy
import json
import time
from typing import Annotated, Any, Dict, List, Literal, Optional, Union

from pydantic import Field
from starlette.routing import Route

from . import protocol as P
from .conversation import Call, Part, Turn
from .endpoint import Writer, computer_sampling, function_tool, new_id, respond, tools
from .protocol import APIError, ChatRequest, Drafting, OpenAIHints, Rendering, Sampling, Wire, invalid, one_of
from .store import ResponseStore

MAX_METADATA = 16
NonEmpty = Annotated[str, Field(min_length=1)]
NoChecks = Optional[Annotated[List[Any], Field(max_length=0)]]  # this server never issues safety checks

# ------------------------------------------------------------------------------------ the body


class InputText(Wire):
    type: Literal["input_text"]
    text: str
    annotations: Optional[List[Any]] = None
    logprobs: Optional[List[Any]] = None


class OutputText(InputText):
    type: Literal["output_text"]


class InputImage(Wire):
    type: Literal["input_image"]
    image_url: NonEmpty
    detail: Optional[Literal["low", "high", "auto"]] = None  # "low": model_inputs.LOW_DETAIL_PIXELS
    file_id: None = None


class Refusal(Wire):
    type: Literal["refusal"]
    refusal: str


Content = Union[str, List[one_of(InputText, OutputText, InputImage, Refusal)]]


class Stored(Wire):
    """What an output item sent back as input carries besides its content."""

    id: Optional[str] = None
    status: Optional[str] = None


class Message(Stored):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Content
    phase: Optional[str] = None


class FunctionCall(Stored):
    type: Literal["function_call"]
    call_id: NonEmpty
    name: NonEmpty
    arguments: str
    namespace: Optional[str] = None


class FunctionCallOutput(Stored):
    type: Literal["function_call_output"]
    call_id: NonEmpty
    output: Content


class ComputerCall(Stored):
    type: Literal["computer_call"]
    call_id: NonEmpty
    action: Optional[Dict[str, Any]] = None
    actions: Optional[List[Any]] = None  # the batched `computer` tool's
    pending_safety_checks: NoChecks = None


class Screenshot(Wire):
    type: Literal["computer_screenshot", "input_image"]
    image_url: NonEmpty
    file_id: None = None


class ComputerCallOutput(Stored):
    type: Literal["computer_call_output"]
    call_id: NonEmpty
    output: Screenshot
    acknowledged_safety_checks: NoChecks = None


class ReasoningText(Wire):
    type: str
    text: str


class Reasoning(Stored):
    type: Literal["reasoning"]
    summary: Optional[List[ReasoningText]] = None
    content: Optional[List[ReasoningText]] = None
    encrypted_content: Optional[str] = None


Item = one_of(Message, FunctionCall, FunctionCallOutput, ComputerCall, ComputerCallOutput, Reasoning,
              default=lambda item: "message" if "role" in item else None)


class FunctionTool(Wire):
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: Optional[str] = None
    parameters: Optional[Dict[str, Any]] = None
    strict: Optional[bool] = None  # its calls' arguments are held to its schema (model_inputs.py)


class ComputerTool(Wire):  # its values are checked by agent.computer_tools
    type: Literal["computer_use_preview", "computer"]
    display_width: Optional[int] = None
    display_height: Optional[int] = None
    environment: Optional[str] = None


class FunctionChoice(Wire):
    type: Literal["function"]
    name: str


class Format(Wire):
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = None
    schema_: Optional[Dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None
    description: Optional[str] = None


class Text(Wire):
    format: Optional[Format] = None
    verbosity: None = None


class ReasoningConfig(Wire):
    effort: None = None
    summary: None = None
    generate_summary: None = None


class StreamOptions(Wire):
    include_obfuscation: Optional[Literal[False]] = None


class Body(Sampling, Rendering, Drafting, OpenAIHints):
    input: Union[str, List[Item]]
    model: Optional[str] = None
    instructions: Optional[str] = None
    previous_response_id: Optional[str] = None
    max_output_tokens: Optional[Annotated[int, Field(ge=1)]] = None
    text: Optional[Text] = None
    tools: Optional[List[one_of(FunctionTool, ComputerTool)]] = None
    tool_choice: Union[Literal["auto", "none", "required"], FunctionChoice, None] = None
    parallel_tool_calls: Optional[Literal[True]] = None
    stream: Optional[bool] = None
    store: Optional[bool] = None
    metadata: Optional[Annotated[Dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                                 Field(max_length=MAX_METADATA)]] = None
    include: Optional[List[Literal["reasoning.encrypted_content"]]] = None  # reasoning items carry their text
    top_logprobs: Optional[Literal[0]] = None
    truncation: Optional[Literal["disabled"]] = None
    reasoning: Optional[ReasoningConfig] = None
    stream_options: Optional[StreamOptions] = None
    max_tool_calls: Optional[Annotated[int, Field(ge=1)]] = None
    prompt_cache_retention: Optional[Literal["in-memory", "in_memory"]] = None
    stop: Union[str, List[str], None] = None  # this server's, as chat completions takes it (extra_body)


NO_FILES = "files are not available on this server; send the image as image_url (a data URL or an http(s) URL)"
NO_SUMMARY = "it makes no summaries; reasoning items carry the whole reasoning text as content"
NO_CHECKS = "this server issues no safety checks, so none can be pending or acknowledged"
REFUSED = {  # what a client may send that this server cannot honour, and why
    "background": "responses are answered while the request waits",
    "conversation": "conversations are not stored here; use previous_response_id",
    "prompt": "stored prompts are not available here", "context_management": "the context is not managed here",
    "top_logprobs": "log probabilities are not given here",
    "truncation": "only 'disabled': a prompt past the context is refused here, never truncated",
    "parallel_tool_calls": "only true: this model may answer with several calls and the server does not cut them",
    "reasoning.effort": "this checkpoint's thinking is switched by 'chat_template_kwargs': {'enable_thinking': ...}",
    "reasoning.summary": NO_SUMMARY, "reasoning.generate_summary": NO_SUMMARY,
    "text.verbosity": "the answer's length is the model's",
    "stream_options.include_obfuscation": "stream events are not padded",
    "prompt_cache_retention": "only 'in-memory': this server keeps its prefix cache in memory",
    ".file_id": NO_FILES, "input.content.type=input_file": NO_FILES, "input.output.type=input_file": NO_FILES,
    "input.pending_safety_checks": NO_CHECKS, "input.acknowledged_safety_checks": NO_CHECKS,
}
ROLE_CONTENT = {"user": ("input_text", "input_image"), "assistant": ("output_text", "refusal", "input_text")}


# ------------------------------------------------------------------------------------ body → request


def _content(content, role: str, where: str) -> List[Part]:
    if isinstance(content, str):
        return [Part("text", content, where)]
    allowed = ROLE_CONTENT["assistant" if role == "assistant" else "user"]
    parts = []
    for j, part in enumerate(content):
        p = f"{where}[{j}]"
        if part.type not in allowed:
            raise invalid(f"{p}.type", f"'{p}.type' is {part.type!r}; a {role} message takes {', '.join(allowed)}")
        if part.type == "input_image":
            if role != "user":
                raise invalid(p, f"'{p}' is an image in a {role} message, where the chat template renders no media; "
                              "send it in a user message")
            parts.append(Part("image", part.image_url, f"{p}.image_url", detail=part.detail))
        else:
            refusal = part.type == "refusal"
            parts.append(Part("text", part.refusal if refusal else part.text, p if refusal else f"{p}.text"))
    return parts


def read_input(value, where: str = "input") -> List[Turn]:
    """`input` (a string or a list of items) → turns; a call joins the assistant turn before it
    (a reasoning item starts a new one: it is the reasoning of the turn that follows)."""
    if isinstance(value, str):
        return [Turn("user", [Part("text", value, where)], param=where)]
    turns, reasoning = [], None

    def assistant(param, parts=None):
        nonlocal reasoning
        if parts is not None or not turns or turns[-1].role != "assistant" or reasoning is not None:
            turns.append(Turn("assistant", parts or [], reasoning=reasoning, param=param))
            reasoning = None
        return turns[-1]

    for i, item in enumerate(value):
        p = f"{where}[{i}]"
        if isinstance(item, Message) and item.role == "assistant":
            assistant(p, _content(item.content, "assistant", f"{p}.content"))
        elif isinstance(item, Message):
            turns.append(Turn("system" if item.role == "developer" else item.role,
                              _content(item.content, item.role, f"{p}.content"), param=p))
        elif isinstance(item, Reasoning):
            reasoning = "\n".join(v.text for v in item.content or ()) or "\n".join(
                v.text for v in item.summary or ()) or None
        elif isinstance(item, FunctionCall):
            assistant(p).calls.append(Call(item.call_id, item.name, arguments=item.arguments, param=p))
        elif isinstance(item, ComputerCall):
            key = "actions" if item.actions is not None else "action"
            if getattr(item, key) is None:
                raise invalid(f"{p}.action", f"'{p}' needs an 'action' (or 'actions')", "missing_field")
            assistant(p).calls.append(Call(item.call_id, "computer", action=getattr(item, key), param=f"{p}.{key}"))
        elif isinstance(item, FunctionCallOutput):
            turns.append(Turn("tool", _content(item.output, "user", f"{p}.output"), call_id=item.call_id, param=p))
        else:  # computer_call_output
            turns.append(Turn("tool", [Part("image", item.output.image_url, f"{p}.output.image_url")],
                              call_id=item.call_id, param=p))
    return turns


def parse_request(body, agent_format: str) -> ChatRequest:
    """The body → the request; its turns are the instructions and the input (continue_stored puts
    the stored conversation between them)."""
    wire = P.validate(Body, body, REFUSED)
    turns = read_input(wire.input)
    if not turns and wire.previous_response_id is None:
        raise invalid("input", "'input' holds no message (a reasoning item goes with the turn after it); send at "
                      "least one, or continue a stored response with 'previous_response_id'", "missing_field")
    fmt = wire.text.format if wire.text is not None and wire.text.format is not None else Format(type="text")
    if fmt.type == "json_schema" and fmt.schema_ is None:
        raise invalid("text.format.schema", "'text.format.schema' must be a JSON schema object")
    rf = P.output_format(fmt.type, fmt.schema_, fmt.name)
    choice = wire.tool_choice or "auto"
    functions, tool, tool_choice = tools(
        [function_tool(t.name, t.description, t.parameters, t.strict) for t in wire.tools or ()
         if isinstance(t, FunctionTool)], body.get("tools"), "function" if isinstance(choice, FunctionChoice)
        else choice, getattr(choice, "name", None), output=rf, output_param="text.format")
    if tool is None:  # a computer call's action has no place in the chat template's rendering
        for call in (c for t in turns for c in t.calls if c.action is not None):
            raise invalid(call.param, f"'{call.param}' is a computer call, but the request declares no "
                          "computer-use tool; declare the one the conversation uses")
    defaults = computer_sampling(tool, agent_format)
    sampling = P.sampling_params(body, P.stop_strings(wire.stop), defaults=defaults)
    pixels = {k: v or defaults.get(k) for k, v in P.pixel_options(body).items()}
    head = [] if wire.instructions is None else [
        Turn("system", [Part("text", wire.instructions, "instructions")], param="instructions")]
    echo = {"instructions": wire.instructions, "max_output_tokens": wire.max_output_tokens,
            "metadata": wire.metadata or {}, "parallel_tool_calls": True,
            "previous_response_id": wire.previous_response_id,
            "reasoning": body.get("reasoning") or {"effort": None, "summary": None},
            "temperature": sampling.temperature, "top_p": sampling.top_p,
            "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
            "truncation": "disabled", "user": wire.user, "max_tool_calls": wire.max_tool_calls,
            "store": wire.store is not False}
    return ChatRequest(
        turns=head + turns, sampling=sampling, model=wire.model, stream=bool(wire.stream),
        max_tokens=wire.max_output_tokens or defaults.get("max_tokens"),
        tools=functions, tool_choice=tool_choice, response_format=rf, computer=tool, max_tool_calls=wire.max_tool_calls,
        chat_template_kwargs=P.template_switches(wire.chat_template_kwargs), echo=echo,
        drafting=P.drafting_settings(wire), conversation="input", **pixels)


def history(req: ChatRequest) -> List[Turn]:
    """What a follow-up continues: the conversation without the instructions."""
    return [t for t in req.turns if t.param != "instructions"]


def continue_stored(req: ChatRequest, store: ResponseStore):
    """A follow-up's turns: the instructions, the stored conversation of `previous_response_id`, then
    its input (on the event loop, where the store lives)."""
    previous = req.echo["previous_response_id"]
    if previous is None:
        return
    entry = store.get(previous) if len(previous) <= 128 else None
    if entry is None:
        raise APIError(400, f"Previous response with id '{previous[:128]}' not found (this server keeps "
                       f"{store.max_entries} recent responses within {store.max_bytes >> 20} MiB; send the "
                       "whole conversation as input instead)", param="previous_response_id",
                       code="previous_response_not_found")
    if req.computer is None and any(c.action is not None for t in entry.turns for c in t.calls):
        raise invalid("previous_response_id", f"the conversation of '{previous[:128]}' has computer calls, but this "
                      "request declares no computer-use tool; declare the one that conversation used")
    head = len(req.turns) - len(history(req))
    req.turns = req.turns[:head] + list(entry.turns) + req.turns[head:]


# ------------------------------------------------------------------------------------ the response


_TEXT = {"reasoning": "reasoning_text", "text": "output_text"}  # a block's text events


def _item(kind: str, text: str, status: str) -> dict:
    """A reasoning item or an assistant message holding `text`."""
    if kind == "reasoning":
        return {"type": "reasoning", "id": new_id("rs"), "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": text}]}
    return {"type": "message", "id": new_id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


class ResponseWriter(Writer):
    """The response object and OpenAI's stream events: an output item per reasoning block, message,
    function call or computer call."""

    def __init__(self, *args):
        super().__init__(*args)
        self.id, self.created, self.seq = new_id("resp"), int(time.time()), 0
        self.output: List[dict] = []
        self.status, self.usage, self.error = "in_progress", None, None

    def event(self, kind, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def result(self) -> dict:
        return self.response

    @property
    def response(self) -> dict:
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": self.status,
               "error": self.error, "incomplete_details": None, "model": self.model, "output": self.output,
               "usage": self.usage, **self.req.echo}
        if self.status == "incomplete":
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        return copy.deepcopy(out)  # a snapshot: later events must not change what was sent (its strings are shared)

    def start(self) -> list:
        return [self.event("response.created", response=self.response),
                self.event("response.in_progress", response=self.response)]

    def _add(self, item, shown=None) -> dict:
        self.output.append(item)
        return self.event("response.output_item.added", output_index=len(self.output) - 1,
                          item=shown or json.loads(json.dumps(item)))

    def _on(self, kind, **fields) -> dict:
        """An event about the last output item."""
        return self.event(kind, item_id=self.output[-1]["id"], output_index=len(self.output) - 1, **fields)

    def _whole(self, item) -> list:
        return [self._add(item, {**item, "status": "in_progress"}),
                self.event("response.output_item.done", output_index=len(self.output) - 1, item=dict(item))]

    def opened(self, kind) -> list:
        item = _item(kind, "", "in_progress")
        part = item["content"].pop()  # added empty, then its part
        events = [self._add(item)]
        item["content"].append(part)
        return events + [self._on("response.content_part.added", content_index=0, part=dict(part))]

    def delta(self, kind, value) -> list:
        self.output[-1]["content"][0]["text"] += value
        return [self._on(f"response.{_TEXT[kind]}.delta", content_index=0, delta=value,
                         **({"logprobs": []} if kind == "text" else {}))]

    def closed(self, kind, status) -> list:
        item = self.output[-1]
        item["status"] = status
        part = item["content"][0]
        return [self._on(f"response.{_TEXT[kind]}.done", content_index=0, text=part["text"],
                         **({"logprobs": []} if kind == "text" else {})),
                self._on("response.content_part.done", content_index=0, part=dict(part)),
                self.event("response.output_item.done", output_index=len(self.output) - 1,
                           item=json.loads(json.dumps(item)))]

    def whole(self, kind, value) -> list:
        return self._whole(_item(kind, value, "completed"))

    def call(self, call) -> list:
        events, fn = self.close(), call["function"]
        item = {"type": "function_call", "id": new_id("fc"), "call_id": call["id"], "name": fn["name"],
                "arguments": "", "status": "in_progress"}
        events += [self._add(item, dict(item)), self._on("response.function_call_arguments.delta",
                                                         delta=fn["arguments"])]
        item.update(arguments=fn["arguments"], status="completed")
        return events + [self._on("response.function_call_arguments.done", name=fn["name"], arguments=fn["arguments"]),
                         self.event("response.output_item.done", output_index=len(self.output) - 1, item=dict(item))]

    def computer_call(self, action) -> tuple:
        call_id = new_id("call")
        item = {"type": "computer_call", "id": new_id("cu"), "call_id": call_id, "pending_safety_checks": [],
                "status": "completed", ("actions" if self.computer.tool.batched else "action"): action}
        return self._whole(item), Call(call_id, "computer", action=action)

    def finished(self, ev, cut) -> list:
        self.status = "incomplete" if cut else "completed"
        n = ev.prompt_tokens
        self.usage = {"input_tokens": n, "input_tokens_details": {"cached_tokens": ev.cached_tokens},
                      "output_tokens": ev.completion_tokens,
                      "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                      "total_tokens": n + ev.completion_tokens}
        if ev.draft_proposed:  # speculative decoding's drafts, named as chat completions' predicted outputs
            self.usage["output_tokens_details"].update(accepted_prediction_tokens=ev.draft_accepted,
                                                       rejected_prediction_tokens=ev.draft_proposed - ev.draft_accepted)
        return [self.event(f"response.{self.status}", response=self.response)]

    def failed(self, error: APIError) -> list:
        self.status = "failed"
        self.error = {"code": error.code or error.type, "message": error.message}
        return [self.event("error", code=error.code, message=error.message, param=error.param),
                self.event("response.failed", response=self.response)]


# ------------------------------------------------------------------------------------ routes


def routes(service, store: ResponseStore) -> list:
    def keep(req: ChatRequest, writer: ResponseWriter):  # (awaited before the answer's end is sent)
        if req.echo["store"] and writer.turn is not None:
            return store.keep(writer.id, history(req) + [writer.turn], lambda: writer.response, service.prepare_pool)

    async def create(request):
        return await respond(service, request, lambda body: parse_request(body, service.agent_format),
                             ResponseWriter, then=lambda req: continue_stored(req, store), on_done=keep)

    async def retrieve(request):
        service.check_auth(request)
        rid = request.path_params["response_id"]
        entry = store.get(rid)
        if entry is None:
            raise APIError(404, f"Response with id '{rid[:128]}' not found (this server keeps recent responses "
                           "only)", param="response_id", code="response_not_found")
        return await service.json(lambda: entry.response)

    return [Route("/v1/responses", create, methods=["POST"]),
            Route("/v1/responses/{response_id}", retrieve, methods=["GET"])]
