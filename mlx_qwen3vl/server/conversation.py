"""A conversation as the Responses and Messages endpoints carry it, in one neutral form, and its
rendering as chat-completions messages (the chat template path every endpoint shares).

responses.py and messages.py each read their protocol's JSON into `Turn`s (checking every field);
without a computer-use tool the turns become OpenAI chat messages for `PromptBuilder.build`, with
a computer-use tool computer.py renders them with the checkpoint's trained prompt instead.
"""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from .protocol import APIError


@dataclass
class Part:
    """Text, or an image by URL (a data URL, http(s), file://: resolved later under the media policy)."""

    kind: str  # "text" | "image"
    value: str  # the text, or the image's URL
    param: str = ""  # where the client put it, for error messages


@dataclass
class Call:
    """An assistant's call of a tool: a function (`arguments`, JSON text) or the computer-use tool
    (`action`: the protocol's form, as computer_tools.ComputerTool.parse_call reads it: Anthropic
    {"name", "input"}, OpenAI an action dict, or a list of them for OpenAI's batched tool)."""

    id: str
    name: str
    arguments: str = "{}"
    action: Any = None
    param: str = ""


@dataclass
class Turn:
    """One message. role: system, user, assistant or tool. A tool turn answers `call_id`. An
    assistant turn's `answer` is the model's own text for it, where this server kept it (a stored
    response): rendered as it was generated, so the prefix cache finds it again."""

    role: str
    parts: List[Part] = field(default_factory=list)
    calls: List[Call] = field(default_factory=list)
    reasoning: Optional[str] = None
    call_id: Optional[str] = None
    answer: Optional[str] = None
    param: str = ""

    def text(self, sep: str = "") -> str:
        return sep.join(p.value for p in self.parts if p.kind == "text")

    def images(self) -> List[Part]:
        return [p for p in self.parts if p.kind == "image"]

    def size(self) -> int:
        """Bytes this turn holds, roughly (what a store of turns counts)."""
        n = sum(len(p.value) + len(p.param) for p in self.parts) + len(self.answer or "") + len(self.reasoning or "")
        return n + sum(len(c.arguments) + len(repr(c.action)) + 64 for c in self.calls) + 64


def leading_system(turns: List[Turn]) -> Tuple[Optional[str], List[Turn]]:
    """(the system text, the other turns): every system turn must come before the conversation
    (the chat template renders only a first system message)."""
    system, rest = [], []
    for t in turns:
        if t.role != "system":
            rest.append(t)
        elif rest:
            raise APIError(400, f"'{t.param}' is a system or developer message after the conversation started; "
                           "put instructions first", param=t.param, code="invalid_value")
        else:
            system.append(t.text())
    return ("\n\n".join(system) if system else None), rest


def chat_messages(turns: List[Turn]) -> Tuple[List[dict], Dict[tuple, str]]:
    """Turns → (OpenAI chat messages, {(message, part): param}) for PromptBuilder.build."""
    system, rest = leading_system(turns)
    messages, names = ([{"role": "system", "content": system}] if system is not None else []), {}
    for t in rest:
        if t.role == "assistant":
            if t.answer is not None:
                messages.append({"role": "assistant", "content": t.answer})
                continue
            m = {"role": "assistant", "content": t.text()}
            if t.calls:
                m["tool_calls"] = [{"id": c.id, "type": "function",
                                    "function": {"name": c.name, "arguments": c.arguments}} for c in t.calls]
            messages.append(m)
            continue
        content = []
        for j, p in enumerate(t.parts):
            if p.kind == "text":
                content.append({"type": "text", "text": p.value})
            else:
                names[(len(messages), j)] = p.param
                content.append({"type": "image_url", "image_url": {"url": p.value}})
        m = {"role": t.role, "content": content}
        if t.role == "tool" and t.call_id:
            m["tool_call_id"] = t.call_id
        messages.append(m)
    return messages, names


def function_tool(name, description, parameters, param) -> dict:
    """A function tool in chat-completions form, its fields checked."""
    if not isinstance(name, str) or not name or len(name) > 256:
        raise APIError(400, f"'{param}.name' must be a non-empty string", param=f"{param}.name", code="invalid_value")
    if description is not None and not isinstance(description, str):
        raise APIError(400, f"'{param}.description' must be a string", param=f"{param}.description",
                       code="invalid_type")
    if parameters is not None and not isinstance(parameters, dict):
        raise APIError(400, f"'{param}' parameters must be a JSON schema object", param=param, code="invalid_type")
    fn = {"name": name}
    if description:
        fn["description"] = description
    fn["parameters"] = parameters if parameters is not None else {"type": "object", "properties": {}}
    return {"type": "function", "function": fn}
