"""A conversation in one neutral form, whatever protocol carried it, and its rendering as the chat
template's messages (the path every endpoint shares).

chat.py, responses.py and messages.py each read their protocol's JSON into `Turn`s of `Part`s
(text, image, video; each remembering where the client put it, for errors); without a
computer-use tool `template_messages` renders them for the chat template (media read under the
policy as it goes), with a computer-use tool computer.py renders them with the checkpoint's
trained prompt instead.
"""

from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

from .protocol import APIError


@dataclass
class Part:
    """Text, or an image or video by URL (a data URL, http(s), file://: resolved later under the
    media policy)."""

    kind: str  # "text" | "image" | "video"
    value: str  # the text, or the image's URL
    param: str = ""  # where the client put it, for error messages
    detail: Optional[str] = None  # an image's resolution hint: "low" reads it at LOW_DETAIL_PIXELS


@dataclass
class Call:
    """An assistant's call of a tool: a function (`arguments`, JSON text) or the computer-use tool
    (`action`: the protocol's form, as computer_tools.ComputerTool.parse_call reads it: Anthropic
    {"name", "input"}, OpenAI an action dict, or a list of them for OpenAI's batched tool)."""

    id: str
    name: str
    arguments: Any = "{}"  # JSON text (a chat client may send the object itself)
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
    listed: bool = True  # its content came as a list of parts (a chat message's string renders as one)

    def text(self, sep: str = "") -> str:
        return sep.join(p.value for p in self.parts if p.kind == "text")

    def images(self) -> List[Part]:
        return [p for p in self.parts if p.kind == "image"]


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


def template_messages(turns: List[Turn], resolve, merge_system: bool = True) -> Tuple[List[dict], list, list]:
    """Turns → (the chat template's messages, images, videos), in order: `resolve(part)` reads an
    image or video part under the media policy (an image's bytes, a video's file). With
    `merge_system`, system turns must lead and become one message (Responses, Messages)."""
    if merge_system:
        system, turns = leading_system(turns)
        out = [{"role": "system", "content": system}] if system is not None else []
    else:
        out = []
    images, videos = [], []
    for t in turns:
        if t.role == "assistant" and t.answer is not None:  # the model's own words, as generated
            out.append({"role": "assistant", "content": t.answer})
            continue
        if t.role in ("user", "tool") and t.listed:  # a tool result may be a screenshot
            content = []
            for p in t.parts:
                if p.kind == "text":
                    content.append({"type": "text", "text": p.value})
                else:
                    (images if p.kind == "image" else videos).append(resolve(p))
                    content.append({"type": p.kind})
            m = {"role": t.role, "content": content}
        else:
            m = {"role": t.role, "content": t.text()}
        if t.role == "assistant" and t.calls:
            m["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                               for c in t.calls]
        if t.role == "tool" and t.call_id:
            m["tool_call_id"] = t.call_id
        out.append(m)
    return out, images, videos
