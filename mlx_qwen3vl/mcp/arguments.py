"""The tools' arguments as wire models (pydantic, as the HTTP server's protocols: strict types, no
unknown argument) and their reading into the one internal request (server.protocol.ChatRequest:
turns of conversation parts, each remembering its argument, the sampling, the pixel settings).
A failing argument is one line naming its path (`history[2]`) and what to send instead. The
tools' MCP declarations are these models' JSON schemas (`declaration`), so what a client is told
and what is checked are one definition.

The screenshot part's value is the argument as given (a path or data: URL, or the MCP image
content): tools.prepare reads it under the call's media budget.
"""

import re
from typing import Annotated, Any, List, Literal, Optional, Union

from pydantic import Field, StringConstraints, ValidationError, model_validator
from pydantic.json_schema import GenerateJsonSchema
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
    annotations: Optional[Any] = Field(None, description="MCP's hints for the client: ignored.")
    meta: Optional[Any] = Field(None, alias="_meta", description="Ignored.")


Screenshot = Annotated[Union[Annotated[str, StringConstraints(min_length=1)], ImageContent], Field(
    description="The screenshot: MCP image content {\"type\": \"image\", \"data\": <base64>, \"mimeType\": ...}, "
                "a data:image/...;base64 URL, or the path of a PNG / JPEG / WebP / GIF / BMP / TIFF file under a "
                "folder the server allows (--allowed-local-media-path; none by default).")]


class Screen(Wire):
    """The screen answers are given in (default: the screenshot's pixels)."""

    screen_width: Side = Field(None, description="Width of the screen to answer in (e.g. points on a Retina "
                                                 "display); default: the screenshot's pixels. Give both or neither.")
    screen_height: Side = Field(None, description="Height of the screen to answer in; default: the screenshot's "
                                                  "pixels.")

    @model_validator(mode="after")
    def _both(self):
        if (self.screen_width is None) != (self.screen_height is None):
            raise PydanticCustomError("both_or_neither", "'screen_width' and 'screen_height' go together: give both "
                                      "or neither")
        return self


class Ground(Screen):
    """Locate a UI element on a screenshot. Returns its point [x, y] and, where the model gives one,
    its box [x1, y1, x2, y2] in screen pixels, and status: ok, refused (the element is absent) or
    malformed."""

    screenshot: Screenshot
    instruction: Text = Field(description="The element, e.g. 'the Save button'.")
    format: Optional[Literal[GROUNDING_FORMATS]] = Field(
        None, description="The trained prompt to ask with (default: the server's).")
    zoom: Optional[Union[bool, Annotated[float, Field(gt=0, le=1)]]] = Field(
        None, description="Two-stage grounding for small targets on large screens: ask again on a crop around the "
                          "first answer, this fraction of each side (true: 0.5). Default: one pass.")


class NextAction(Screen):
    """The next GUI action towards a task on the current screenshot: status (action, message, done,
    unmapped), actions in screen pixels (click, double_click, triple_click, mouse_move, drag,
    mouse_down, mouse_up, scroll, type, key, wait, screenshot), text, reasoning and the raw answer.
    Pass earlier answers back as history."""

    screenshot: Screenshot
    task: Text = Field(description="What the agent should achieve.")
    history: Optional[Annotated[List[Annotated[str, StringConstraints(max_length=MAX_TEXT_CHARS)]],
                                Field(max_length=MAX_HISTORY)]] = Field(
        None, description="The `answer` of each earlier next_action call, oldest first.")
    kind: Optional[Literal["web", "mobile"]] = Field(
        None, description="UI-Venus format only: its web or mobile prompt (default web).")


class Ask(Wire):
    """Answer a question about a screenshot."""

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


class _Declared(GenerateJsonSchema):
    """A tool's input schema as a client reads it: an optional argument as its own type (leaving it
    out is its default), no titles."""

    def nullable_schema(self, schema):
        return self.generate_inner(schema["schema"])

    def default_schema(self, schema):
        return self.generate_inner(schema["schema"])

    def field_title_should_be_set(self, schema) -> bool:
        return False


def _inline(node, defs):
    if isinstance(node, dict):
        if "$ref" in node:
            node = {**defs[node["$ref"].rsplit("/", 1)[-1]], **{k: v for k, v in node.items() if k != "$ref"}}
        return {k: _inline(v, defs) for k, v in node.items() if k != "title"}
    return [_inline(v, defs) for v in node] if isinstance(node, list) else node


def declaration(name: str) -> dict:
    """The MCP declaration of tool `name` from its wire model: its description and input schema
    (every constraint the model checks, the arguments in the declaration's order, no $ref)."""
    model = MODELS[name]
    schema = model.model_json_schema(by_alias=True, schema_generator=_Declared)
    schema = _inline({k: v for k, v in schema.items() if k not in ("$defs", "description")}, schema.get("$defs", {}))
    schema["properties"] = {k: schema["properties"][k] for k in _names(model)}
    return {"name": name, "description": " ".join(model.__doc__.split()), "inputSchema": schema}


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
