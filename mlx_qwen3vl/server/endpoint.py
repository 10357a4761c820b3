"""What the protocol endpoints (chat.py, responses.py, messages.py) share around their wire
formats: their tools in the one request's form, the request built into model inputs (the chat
template, or with a computer-use tool the trained prompt), the writer skeleton that turns the
engine's events into a protocol's events, and the route that admits a request and answers it.

The writer skeleton splits the answer (answer_stream.AnswerStream: reasoning, text, tool calls,
the same pieces whether it streams or not), keeps one block open at a time, caps the calls
(`max_tool_calls`) and maps a computer-use answer to the tool's calls; a protocol's writer says what
each step is on its wire (`opened`, `delta`, `closed`, `call`, `computer_call`, `finished`).
"""

import json
import uuid
from typing import List, Optional

from ..agent.computer_tools import find_computer_tool
from ..agent.computer_use import AGENT_SAMPLING
from ..errors import InputError
from . import computer
from .answer_stream import AnswerStream, prompt_opens_reasoning
from .conversation import Call, Part, Turn
from .protocol import ChatRequest, invalid


def new_id(prefix: str, digits: int = 32) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:digits]}"


def sse(event: dict, named: bool = True) -> str:
    """One server-sent event: named by its `type` (Responses, Messages), or data only (chat)."""
    head = f"event: {event['type']}\n" if named else ""
    return f"{head}data: {json.dumps(event, ensure_ascii=False)}\n\n"


# ------------------------------------------------------------------------------------ tools


def function_tool(name: str, description: Optional[str], parameters: Optional[dict], strict: Optional[bool]) -> dict:
    """A function tool as the chat template and the grammars take it; `strict`: its calls are held to
    its schema (model_inputs.py)."""
    fn = {"name": name, **({"description": description} if description else {}),
          "parameters": parameters if parameters is not None else {"type": "object", "properties": {}}}
    return {"type": "function", "function": {**fn, **({"strict": True} if strict else {})}}


def tools(functions: List[dict], declarations, choice: str, name: Optional[str] = None, *,
          output=None, output_param: str = ""):
    """→ (function tools or None, the computer-use tool or None, tool choice): `choice` is auto,
    none, required or function (then `name`), as the protocol spells them; `declarations` the raw
    `tools`, where agent.computer_tools finds the one computer-use tool. Its prompt has only the
    computer, and its answer is neither forced nor constrained (`output`: the output format)."""
    try:
        tool = find_computer_tool(declarations, "tools")
    except InputError as e:
        raise invalid("tools", str(e)) from None
    if tool is not None and functions:
        raise invalid("tools", "a request with a computer-use tool may declare no other tools: this model's "
                      "computer-use prompt has only the computer", "unsupported_tool")
    if tool is not None and choice != "auto":
        raise invalid("tool_choice", "with a computer-use tool 'tool_choice' must be auto (the model's computer-use "
                      "answers are not constrained)")
    if tool is not None and output is not None:
        raise invalid(output_param, f"'{output_param}' cannot constrain a computer-use answer; leave it out")
    if choice == "function":
        if name not in {f["function"]["name"] for f in functions}:
            raise invalid("tool_choice", f"'tool_choice' names {name!r}, which is not in 'tools'")
        choice = {"type": "function", "function": {"name": name}}
    return functions or None, tool, choice if functions else "none"


def computer_sampling(tool, agent_format: str) -> dict:
    """What a computer-use request samples with unless it says otherwise (agent.AGENT_SAMPLING)."""
    return dict(AGENT_SAMPLING[agent_format]) if tool is not None else {}


# ------------------------------------------------------------------------------------ the request


def build(service, req: ChatRequest):
    """On the preparation pool: → (Prepared, ComputerRequest or None). `req.thinking` switches a
    template that has the switch, and must be what the rendered prompt does."""
    processor = service.processor
    template = getattr(processor, "chat_template", None) or getattr(processor.tokenizer, "chat_template", None)
    if req.thinking in ("enabled", "disabled") and isinstance(template, str) and "enable_thinking" in template:
        req.chat_template_kwargs.setdefault("enable_thinking", req.thinking == "enabled")
    if req.computer is not None:
        built = computer.prepare(service.builder, req, req.turns, req.computer, service.agent_format,
                                 service.computer_answers, service.agent_history)
    else:
        built = service.builder.build(req), None
    thinks = prompt_opens_reasoning(processor.tokenizer, built[0].tokens)
    if req.thinking == "enabled" and not thinks:
        raise invalid("thinking.type", "'thinking' cannot be enabled: this checkpoint's chat template does not "
                      "think (use a Qwen3-VL Thinking checkpoint)", "unsupported_field")
    if req.thinking == "disabled" and thinks:
        raise invalid("thinking.type", "'thinking' cannot be disabled: this checkpoint's chat template always "
                      "thinks (use a Qwen3-VL Instruct checkpoint)", "unsupported_field")
    return built


async def respond(service, request, parse, writer_type, *, then=None, on_done=None, **options):
    """The route of a protocol: admission (`parse` the body into a ChatRequest), the build, then
    the answer, streamed or whole, written by `writer_type(req, model, prepared, computer_request,
    opened)`. `on_done(req, writer)`: once the answer is whole."""
    req, prepared, computer_request, handle = await service.admit(request, parse, lambda r: build(service, r),
                                                                  then=then)
    opened = prompt_opens_reasoning(service.processor.tokenizer, prepared.tokens)
    writer = writer_type(req, req.model or service.model_id, prepared, computer_request, opened)
    done = (lambda: on_done(req, writer)) if on_done is not None else None
    return await service.answer(request, handle, writer, lambda e: sse(e, writer.named), req.stream,
                                on_done=done, **options)


# ------------------------------------------------------------------------------------ the answer


class Writer:
    """One answer as the engine's events arrive → a protocol's events (a plain request takes
    `result()` at the end); `turn` is the answer's own turn once it is done.

    A protocol's writer says what each step is on its wire, each method → a list of its events:
    start(); opened(kind), delta(kind, text), closed(kind, status) for a block of reasoning or text;
    call(call) for a function call ({"id", "function": {"name", "arguments"}}); computer_call(action)
    → (events, Call) for one computer-use call (an action, or a batch of them); finished(DoneEvent,
    cut); failed(APIError); and result(), the whole answer's object."""

    named = True  # its SSE events carry their type as the event name

    def __init__(self, req: ChatRequest, model: str, prepared, computer_request=None, opened: bool = False,
                 reasoning: bool = True):
        self.req, self.model, self.computer = req, model, computer_request
        self.parts = AnswerStream(tools=bool(req.tools) and req.tool_choice != "none", opened=opened,
                                  reasoning=reasoning)
        self.raw: List[str] = []
        self.open: Optional[str] = None  # the block being written: "reasoning", "text" or None
        self.calls: List[Call] = []  # the calls the answer carries
        self.reasoning_tokens = 0
        self.turn: Optional[Turn] = None

    def token(self, ev) -> list:
        self.raw.append(ev.text)
        if self.computer is not None:  # the whole answer is mapped at the end
            return []
        self.reasoning_tokens += self.parts.in_reasoning
        return self._segments(self.parts.feed(ev.text))

    def done(self, ev) -> list:
        answer = "".join(self.raw)
        cut = ev.finish_reason in ("length", "time_limit")
        if self.computer is not None:
            events = self._computer(answer)
        else:
            events = self._segments(self.parts.finish()) + self.close("incomplete" if cut else "completed")
            self.turn = Turn("assistant", [Part("text", self.parts.text)], self.calls, self.parts.reasoning or None,
                             answer=answer)
        return events + self.finished(ev, cut)

    def _segments(self, segments) -> list:
        return [e for kind, value in segments for e in self.segment(kind, value)]

    def segment(self, kind: str, value) -> list:
        if kind == "call":
            if not self._may_call():  # past max_tool_calls: dropped, as OpenAI ignores them
                return []
            fn = value["function"]
            self.calls.append(Call(value["id"], fn["name"], arguments=fn["arguments"]))
            return self.call(value)
        events = []
        if self.open != kind:
            events = self.close() + self.opened(kind)
            self.open = kind
        return events + (self.delta(kind, value) if value else [])

    def close(self, status: str = "completed") -> list:
        kind, self.open = self.open, None
        return self.closed(kind, status) if kind is not None else []

    def whole(self, kind: str, value: str) -> list:
        """A whole block of a computer-use answer."""
        events = self.close() + self.opened(kind)
        self.open = kind
        return events + self.delta(kind, value) + self.close()

    def _may_call(self) -> bool:
        cap = self.req.max_tool_calls
        return cap is None or len(self.calls) < cap

    def _computer(self, answer: str) -> list:
        turn = self.computer.turn(answer)
        events = self.whole("reasoning", turn.reasoning) if turn.reasoning else []
        if turn.text or not turn.calls:
            events += self.whole("text", turn.text)
        batched = self.computer.tool.batched
        for batch in ([turn.calls] if batched else [[c] for c in turn.calls]) if turn.calls else []:
            if not self._may_call():
                break
            more, call = self.computer_call(batch if batched else batch[0])
            events += more
            self.calls.append(call)
        self.computer.issued(answer, self.calls)
        self.turn = Turn("assistant", [Part("text", turn.text)], self.calls, turn.reasoning, answer=answer)
        return events
