"""The tools' arguments as wire models (pydantic, as the HTTP server's protocols: strict types, no
unknown argument) and their reading into the one internal request (server.protocol.ChatRequest:
turns of conversation parts, each remembering its argument, the sampling, the pixel settings).
A failing argument is one line naming its path (`history[2]`) and what to send instead.

The screenshot part's value is the argument as given (a path or data: URL, or the MCP image
content): tools.prepare reads it under the call's media budget.
"""

import re
from typing import Annotated, Any, List, Literal, Optional, Union

from pydantic import Field, StringConstraints, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from ..agent import GROUNDING_FORMATS
from ..agent.computer_tools import MAX_DISPLAY
from ..errors import InputError
from ..sampling import SamplingParams
from ..server.conversation import Part, Turn
from ..server.protocol import ChatRequest, Wire

MAX_TEXT_CHARS = 8192
MAX_HISTORY = 32
GROUND_MAX_TOKENS = 128  # as agent.ground()

Text = Annotated[str, StringConstraints(min_length=1, max_length=MAX_TEXT_CHARS, pattern=r"\S")]
Side = Optional[Annotated[int, Field(ge=1, le=MAX_DISPLAY)]]


class ImageContent(Wire):
    """MCP image content; its type is told from the bytes, never from mimeType."""

    type: Literal["image"] = "image"
    data: str
    mimeType: Optional[str] = None
    annotations: Optional[Any] = None  # MCP's hints for the client: ignored
    meta: Optional[Any] = Field(None, alias="_meta")


Screenshot = Union[Annotated[str, StringConstraints(min_length=1)], ImageContent]


class Screen(Wire):
    """The screen answers are given in (default: the screenshot's pixels)."""

    screen_width: Side = None
    screen_height: Side = None

    @model_validator(mode="after")
    def _both(self):
        if (self.screen_width is None) != (self.screen_height is None):
            raise PydanticCustomError("both_or_neither", "'screen_width' and 'screen_height' go together: give both "
                                      "or neither")
        return self


class Ground(Screen):
    screenshot: Screenshot
    instruction: Text
    format: Optional[Literal[GROUNDING_FORMATS]] = None
    zoom: Optional[Union[bool, Annotated[float, Field(gt=0, le=1)]]] = None


class NextAction(Screen):
    screenshot: Screenshot
    task: Text
    history: Optional[Annotated[List[Annotated[str, StringConstraints(max_length=MAX_TEXT_CHARS)]],
                                Field(max_length=MAX_HISTORY)]] = None
    kind: Optional[Literal["web", "mobile"]] = None


class Ask(Wire):
    screenshot: Screenshot
    question: Text


MODELS = {"ground": Ground, "next_action": NextAction, "ask": Ask}

_TEXT = f"must be a non-empty string of at most {MAX_TEXT_CHARS} characters"
_SIDE = f"must be an integer from 1 to {MAX_DISPLAY} (give both or neither)"
# What each argument must be, by name (the message of any type or value error in it)
_MUST = {
    "screenshot": "must be MCP image content {\"type\": \"image\", \"data\": <base64>, \"mimeType\": ...}, "
                  "a data: URL or an allowed file path",
    "instruction": _TEXT, "task": _TEXT, "question": _TEXT,
    "format": f"must be one of {', '.join(GROUNDING_FORMATS)}",
    "zoom": "must be true, false or the window's fraction of each side, in (0, 1]",
    "history": f"must be a list of at most {MAX_HISTORY} earlier answers (strings)",
    "kind": "must be one of web, mobile",
    "screen_width": _SIDE, "screen_height": _SIDE,
}


_SHOWN = {"format", "zoom", "kind", "screen_width", "screen_height"}  # a short value, repeated in its error


def _names(model) -> list:
    """The model's arguments in the declaration's order (the screen's last)."""
    return sorted(model.model_fields, key=lambda f: f.startswith("screen_"))


_FIELD = re.compile(r"[a-z_][A-Za-z0-9_]*")  # not a union member's label (str, constrained-str, ImageContent)


def _path(loc) -> str:
    """An error's location → the argument's path as the client wrote it (`history[2]`,
    `screenshot.data`), union members' labels left out."""
    out = ""
    for key in loc:
        if isinstance(key, int):
            out += f"[{key}]"
        elif _FIELD.fullmatch(key) and key != "str":
            out += f".{key}" if out else key
    return out


def _message(err, model) -> str:
    loc, kind = err["loc"], err["type"]
    path = _path(loc)
    if kind == "extra_forbidden" and len(loc) == 1:
        return f"unknown argument {str(loc[0])[:80]!r}; it takes {', '.join(_names(model))}"
    if not path:  # the model's own rule (both or neither)
        return err["msg"]
    if kind == "missing" and len(loc) == 1:
        return f"'{path}' is required" + (": MCP image content, a data: URL or an allowed file path"
                                          if path == "screenshot" else "")
    if path.startswith("history["):
        return f"'{path}' must be a string of at most {MAX_TEXT_CHARS} characters"
    name, got = loc[0], err.get("input")
    shown = f"; got {repr(got)[:40]}" if name in _SHOWN and isinstance(got, (str, int, float)) else ""
    if path != name:  # a field inside the argument (image content's)
        shown = f"; '{path}' " + ("is not one of its fields" if kind == "extra_forbidden" else
                                  "is required" if kind == "missing" else f"is not valid: {err['msg']}")
    return f"'{name}' {_MUST.get(name, 'is not valid')}{shown}"


def validate(name: str, args):
    """The call's arguments → its wire model; InputError (one line, the first failing argument:
    an unknown one first, then in the declaration's order) otherwise."""
    if not isinstance(args, dict):
        raise InputError("the arguments must be an object")  # the server names the tool
    model = MODELS[name]
    try:
        return model.model_validate(args)
    except ValidationError as e:
        errors = e.errors(include_url=False)
    order = _names(model)
    first = min(errors, key=lambda err: (err["type"] != "extra_forbidden" or len(err["loc"]) > 1,
                                         order.index(err["loc"][0]) if err["loc"] and err["loc"][0] in order else -1,
                                         -len(err["loc"])))  # the deepest: a union's other member fails at its top
    raise InputError(_message(first, model))


def request(name: str, wire, *, max_tokens: int, sampling: Optional[dict] = None, pixels: Optional[dict] = None
            ) -> ChatRequest:
    """A validated call → the one internal request: the conversation as the tool asks it (ground,
    ask: the screenshot then the text; next_action: the task, each earlier answer as an assistant
    turn kept as written, then the current screenshot), greedy unless `sampling` says otherwise."""
    shot = Part("image", wire.screenshot, param="screenshot")
    if name == "next_action":
        turns = [Turn("user", [Part("text", wire.task, param="task")], param="task")]
        turns += [Turn("assistant", answer=a, param=f"history[{i}]") for i, a in enumerate(wire.history or [])]
        turns.append(Turn("user", [shot], param="screenshot"))
    else:
        text = wire.instruction if name == "ground" else wire.question
        turns = [Turn("user", [shot, Part("text", text, param="instruction" if name == "ground" else "question")],
                      param="arguments")]
    options = {"temperature": 0.0, **(sampling or {})}
    options.setdefault("max_tokens", GROUND_MAX_TOKENS if name == "ground" else max_tokens)
    pixels = pixels or {}
    return ChatRequest(turns=turns, sampling=SamplingParams.build(**options), max_tokens=options["max_tokens"],
                       min_pixels=pixels.get("min_pixels"), max_pixels=pixels.get("max_pixels"))
