"""The MCP server's three tools, `ground`, `next_action` and `ask`, each in two steps: `prepare`
(arguments dict → ToolCall: every argument checked against its allow-list and the screenshot read
under the call's media budget, before any model work; on a preparation thread) and `answer` (the
model's answer, on the model's thread); `ground_tool` and the others do both. No MCP SDK here:
server.py puts these behind the protocol.

A screenshot arrives as MCP image content ({"type": "image", "data": <base64>, "mimeType": ...};
the type is told from the bytes, never from mimeType), a data: URL, or a path (or file:// URL) of a
file under an allowed folder (none unless the operator names one), read by media_access (the HTTP
server's reader: every component opened from the folder's descriptor without following a link, a
regular file checked on the descriptor, read only up to the byte budget). Its header then gives the
size (PNG, JPEG, WebP, GIF, BMP, TIFF only), which must be within the pixel budget before anything
is decoded.
"""

from dataclasses import dataclass, field
from fractions import Fraction
from typing import List, Optional

from .. import media, media_access
from ..errors import InputError
from ..generate import generate
from ..processor import image_budget
from ..video import smart_resize
from ..agent import GROUNDING_FORMATS, Window, ground, parse_action, parse_grounding, zoom_fraction
from ..agent.computer_tools import MAX_DISPLAY
from ..agent.computer_use import AGENT_FORMATS, AGENT_SAMPLING, ComputerStep, computer_messages, map_answer

DEFAULT_MAX_REQUEST_PIXELS = 32 << 20  # as the HTTP server's --max-request-pixels
DEFAULT_MAX_IMAGE_BYTES = 32 << 20
MAX_TEXT_CHARS = 8192
# HTTP sessions (the SDK's own defaults keep 10,000 for 30 minutes; a desktop client holds one).
DEFAULT_MAX_SESSIONS = 32
DEFAULT_MAX_SESSIONS_PER_CLIENT = 4
DEFAULT_SESSION_IDLE_TIMEOUT_S = 300.0
MAX_HISTORY = 32


@dataclass
class Settings:
    """What the operator set (the command line's flags)."""

    agent_format: str = "qwen"
    ground_format: str = "venus"  # as `python -m mlx_qwen3vl.ground`, POST /v1/ground and the playground
    allowed_dirs: List[str] = field(default_factory=list)
    max_request_pixels: int = DEFAULT_MAX_REQUEST_PIXELS
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    min_pixels: Optional[int] = None
    max_pixels: Optional[int] = None
    max_tokens: int = 512
    media_timeout_s: float = media_access.DEFAULT_REQUEST_MEDIA_TIMEOUT_S  # reading one call's screenshot

    def __post_init__(self):
        if self.agent_format not in AGENT_FORMATS:
            raise InputError(f"unknown agent format {self.agent_format!r}; use {' or '.join(AGENT_FORMATS)}")
        if self.ground_format not in GROUNDING_FORMATS:
            raise InputError(f"unknown grounding format {self.ground_format!r}; use {', '.join(GROUNDING_FORMATS)}")
        self.allowed_dirs = media_access.allowed_folders(self.allowed_dirs)

    def budget(self) -> media_access.MediaBudget:
        """One call's media budget: its screenshot's bytes and one deadline for reading it."""
        return media_access.MediaBudget(max_bytes=self.max_image_bytes, timeout_s=self.media_timeout_s,
                                        bytes_flag="--max-image-bytes", timeout_flag="--request-media-timeout")

    def pixel_options(self) -> dict:
        return {k: v for k, v in (("min_pixels", self.min_pixels), ("max_pixels", self.max_pixels)) if v is not None}


# ---------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------
def _check_names(args, allowed):
    if not isinstance(args, dict):
        raise InputError("the arguments must be an object")  # the server names the tool
    unknown = sorted(set(args) - set(allowed))
    if unknown:
        raise InputError(f"unknown argument {unknown[0]!r}; it takes {', '.join(allowed)}")


def _text(args, name, required=True) -> Optional[str]:
    value = args.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value.strip():
        raise InputError(f"'{name}' must be a non-empty string")
    if len(value) > MAX_TEXT_CHARS:
        raise InputError(f"'{name}' is {len(value)} characters; at most {MAX_TEXT_CHARS}")
    return value


def _choice(args, name, choices, default):
    value = args.get(name, default)
    if value is None:
        return default
    if value not in choices:
        raise InputError(f"'{name}' must be one of {', '.join(choices)}; got {str(value)[:40]!r}")
    return value


def _screen(args, image_size):
    """(width, height) answers are given in: screen_width x screen_height, else the screenshot's."""
    w, h = args.get("screen_width"), args.get("screen_height")
    if w is None and h is None:
        return image_size
    for name, v in (("screen_width", w), ("screen_height", h)):
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_DISPLAY:
            raise InputError(f"'{name}' must be an integer from 1 to {MAX_DISPLAY} (give both or neither); got {v!r}")
    return w, h


def _history(args) -> List[str]:
    value = args.get("history")
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_HISTORY:
        raise InputError(f"'history' must be a list of at most {MAX_HISTORY} earlier answers (strings)")
    for i, step in enumerate(value):
        if not isinstance(step, str) or len(step) > MAX_TEXT_CHARS:
            raise InputError(f"'history[{i}]' must be a string of at most {MAX_TEXT_CHARS} characters")
    return value


# ---------------------------------------------------------------------------------------------
# Screenshots
# ---------------------------------------------------------------------------------------------
ALLOW_FLAG = "--allowed-local-media-path"  # the HTTP server's spelling (--allowed-image-dir still works)


def read_screenshot(value, settings: Settings, processor=None, pixels=None, budget=None):
    """A screenshot argument → (encoded bytes, (width, height)), read by media_access under the
    call's `budget` (default: a fresh settings.budget()) and every pixel limit checked from the
    header before decoding; InputError (one line) otherwise. With `processor`, the size it would
    resize to under `pixels` ({"min_pixels", "max_pixels"} as the call passes them) is held to the
    same budget."""
    budget = budget if budget is not None else settings.budget()
    limit = dict(max_bytes=settings.max_image_bytes, budget=budget)
    if isinstance(value, dict):
        if value.get("type", "image") != "image" or not isinstance(value.get("data"), str):
            raise InputError("'screenshot' as an object must be MCP image content: {\"type\": \"image\", "
                             "\"data\": <base64>, \"mimeType\": ...}")
        data = media_access.decode_base64(value["data"], "the screenshot", flag="--max-image-bytes", **limit)
    elif isinstance(value, str) and value.startswith("data:"):
        data = media_access.decode_data_url(value, "the screenshot", flag="--max-image-bytes", base64_only=True,
                                            **limit)
    elif isinstance(value, str) and value:
        data = media_access.read_allowed(value, settings.allowed_dirs, "the screenshot path", flag=ALLOW_FLAG,
                                         bytes_flag="--max-image-bytes", **limit)
    else:
        raise InputError("'screenshot' is required: MCP image content, a data: URL or an allowed file path")
    if len(data) > settings.max_image_bytes:
        raise InputError(f"the screenshot is over the server's limit of {settings.max_image_bytes} bytes "
                         "(--max-image-bytes)")
    w, h = media.image_size(data, "the screenshot")  # the format allow-list, from the header
    cap = settings.max_request_pixels
    if w * h > cap:
        raise InputError(f"the screenshot is {w}x{h} pixels, over the server's limit of {cap} (--max-request-pixels); "
                         "downscale it")
    if processor is not None:  # what the processor would make of it, within the same budget
        pixels = settings.pixel_options() if pixels is None else pixels
        lo, hi = image_budget(processor.image_config, pixels.get("min_pixels"), pixels.get("max_pixels"))
        rh, rw = smart_resize(h, w, processor.image_config.factor, lo, hi)
        if rh * rw > cap:
            raise InputError(f"the screenshot would be {rw}x{rh} pixels for the model, over the server's limit of "
                             f"{cap} (--max-request-pixels)")
    return data, (w, h)


# ---------------------------------------------------------------------------------------------
# The tools
# ---------------------------------------------------------------------------------------------
def _zoom(args):
    value = args.get("zoom")
    if value is None or value is False:
        return None
    if not isinstance(value, (bool, int, float)):
        raise InputError("'zoom' must be true, false or the window's fraction of each side, in (0, 1]")
    return zoom_fraction(value, "'zoom'")


def _on_screen(hit, size, screen):
    """The answer in screen pixels: read again at the screen's size, pass 2's through its window
    scaled to the screen exactly (Fractions), so both land on the same relative place."""
    window = None
    if hit.used_pass == 2:
        x1, y1, x2, y2 = hit.window
        sx, sy = Fraction(screen[0], size[0]), Fraction(screen[1], size[1])
        window = Window(x1 * sx, y1 * sy, (x2 - x1 + 1) * sx, (y2 - y1 + 1) * sy)
    return parse_grounding(hit.answer, *screen, window=window)


@dataclass
class ToolCall:
    """A tool call checked and its screenshot read (`prepare`, on a preparation thread): what the
    model thread needs to answer it (`answer`)."""

    name: str
    data: bytes  # the screenshot, encoded
    size: tuple  # its (width, height)
    screen: tuple  # the (width, height) answers are given in
    options: dict  # the tool's own: instruction, format, zoom / task, history, kind / question


def prepare(name: str, processor, settings: Settings, args) -> ToolCall:
    """Every argument of a call checked against its allow-list, then the screenshot read under the
    call's media budget (bytes and one deadline, media_access.MediaBudget) and its pixels checked
    from the header: all before the model is asked. InputError (one line) otherwise."""
    budget = settings.budget()
    if name == "ground":
        _check_names(args, ("screenshot", "instruction", "format", "zoom", "screen_width", "screen_height"))
        options = {"instruction": _text(args, "instruction"),
                   "format": _choice(args, "format", GROUNDING_FORMATS, settings.ground_format), "zoom": _zoom(args)}
        pixels = None
    elif name == "next_action":
        _check_names(args, ("screenshot", "task", "history", "kind", "screen_width", "screen_height"))
        options = {"task": _text(args, "task"), "history": _history(args),
                   "kind": _choice(args, "kind", ("web", "mobile"), "web")}
        pixels = next_action_options(settings)
    else:
        _check_names(args, ("screenshot", "question"))
        options, pixels = {"question": _text(args, "question")}, None
    data, size = read_screenshot(args.get("screenshot"), settings, processor, pixels, budget)
    screen = _screen(args, size) if name != "ask" else size
    return ToolCall(name, data, size, screen, options)


def answer(model, processor, settings: Settings, call: ToolCall) -> dict:
    """A prepared call's answer (on the model's thread)."""
    return ANSWERS[call.name](model, processor, settings, call)


def _ground(model, processor, settings: Settings, call: ToolCall) -> dict:
    o, size, screen = call.options, call.size, call.screen
    hit = ground(model, processor, call.data, o["instruction"], format=o["format"], zoom=o["zoom"],
                 **settings.pixel_options())
    g = _on_screen(hit, size, screen) if screen != size else hit
    out = {"point": list(g.point) if g.point else None, "box": list(g.box) if g.box else None, "status": g.status,
           "answer": hit.answer, "format": o["format"], "screen_size": list(screen), "image_size": list(size)}
    if o["zoom"] is not None:  # the window in the screenshot's pixels, and each pass's answer there
        out["zoom"] = hit.to_dict()["zoom"]
    return out


def next_action_messages(settings: Settings, task, data, history, kind):
    return computer_messages(task, data, [ComputerStep(answer=a) for a in history], format=settings.agent_format,
                             kind=kind)


def next_action_options(settings: Settings) -> dict:
    options = dict(AGENT_SAMPLING[settings.agent_format])
    options.setdefault("max_tokens", settings.max_tokens)
    options.update(settings.pixel_options())
    return options


def _next_action(model, processor, settings: Settings, call: ToolCall) -> dict:
    o, screen = call.options, call.screen
    messages = next_action_messages(settings, o["task"], call.data, o["history"], o["kind"])
    out = generate(model, processor, messages=messages, **next_action_options(settings))
    turn = map_answer(out.text, screen)
    parsed = parse_action(out.text, *screen)
    result = turn.to_dict()
    del result["calls"]  # no protocol here: the neutral actions are the answer
    result.update(parsed=parsed.to_dict() if parsed else None, screen_size=list(screen), image_size=list(call.size),
                  finish_reason=out.finish_reason)
    return result


def ask_messages(data, question):
    return [{"role": "user", "content": [{"type": "image", "image": data}, {"type": "text", "text": question}]}]


def _ask(model, processor, settings: Settings, call: ToolCall) -> dict:
    out = generate(model, processor, messages=ask_messages(call.data, call.options["question"]),
                   max_tokens=settings.max_tokens, temperature=0.0, **settings.pixel_options())
    return {"answer": out.text, "finish_reason": out.finish_reason}


ANSWERS = {"ground": _ground, "next_action": _next_action, "ask": _ask}


def ground_tool(model, processor, settings: Settings, args: dict) -> dict:
    """Where `instruction` is on the screenshot: point, box and status in screen pixels; with
    zoom, two-stage grounding (pass 2 on a crop around pass 1's point)."""
    return answer(model, processor, settings, prepare("ground", processor, settings, args))


def next_action_tool(model, processor, settings: Settings, args: dict) -> dict:
    """The next action for `task` on the screenshot after `history` (earlier answers), in screen pixels."""
    return answer(model, processor, settings, prepare("next_action", processor, settings, args))


def ask_tool(model, processor, settings: Settings, args: dict) -> dict:
    """The model's answer to a question about the screenshot (greedy)."""
    return answer(model, processor, settings, prepare("ask", processor, settings, args))


TOOLS = {"ground": ground_tool, "next_action": next_action_tool, "ask": ask_tool}

# ---------------------------------------------------------------------------------------------
# Their declarations (MCP input schemas)
# ---------------------------------------------------------------------------------------------
_SCREENSHOT = {
    "description": "The screenshot: MCP image content {\"type\": \"image\", \"data\": <base64>, \"mimeType\": ...}, "
                   "a data:image/...;base64 URL, or the path of a PNG / JPEG / WebP / GIF / BMP / TIFF file under a "
                   "folder the server allows (--allowed-local-media-path; none by default).",
    "anyOf": [{"type": "string"},
              {"type": "object", "properties": {"type": {"const": "image"}, "data": {"type": "string"},
                                                "mimeType": {"type": "string"}}, "required": ["data"]}],
}
_SCREEN = {
    "screen_width": {"type": "integer", "minimum": 1, "maximum": MAX_DISPLAY,
                     "description": "Width of the screen to answer in (e.g. points on a Retina display); default: "
                                    "the screenshot's pixels. Give both or neither."},
    "screen_height": {"type": "integer", "minimum": 1, "maximum": MAX_DISPLAY,
                      "description": "Height of the screen to answer in; default: the screenshot's pixels."},
}


def _schema(properties, required):
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


TOOL_DECLARATIONS = [
    {"name": "ground",
     "description": "Locate a UI element on a screenshot. Returns its point [x, y] and, where the model gives one, "
                    "its box [x1, y1, x2, y2] in screen pixels, and status: ok, refused (the element is absent) "
                    "or malformed.",
     "inputSchema": _schema({"screenshot": _SCREENSHOT,
                             "instruction": {"type": "string", "description": "The element, e.g. 'the Save button'."},
                             "format": {"type": "string", "enum": list(GROUNDING_FORMATS),
                                        "description": "The trained prompt to ask with (default: the server's)."},
                             "zoom": {"anyOf": [{"type": "boolean"},
                                                {"type": "number", "exclusiveMinimum": 0, "maximum": 1}],
                                      "description": "Two-stage grounding for small targets on large screens: "
                                                     "ask again on a crop around the first answer, this "
                                                     "fraction of each side (true: 0.5). Default: one pass."},
                             **_SCREEN}, ["screenshot", "instruction"])},
    {"name": "next_action",
     "description": "The next GUI action towards a task on the current screenshot: status (action, message, done, "
                    "unmapped), actions in screen pixels (click, double_click, triple_click, mouse_move, drag, "
                    "mouse_down, mouse_up, scroll, type, key, wait, screenshot), text, reasoning and the raw "
                    "answer. Pass earlier answers back as history.",
     "inputSchema": _schema({"screenshot": _SCREENSHOT,
                             "task": {"type": "string", "description": "What the agent should achieve."},
                             "history": {"type": "array", "items": {"type": "string"}, "maxItems": MAX_HISTORY,
                                         "description": "The `answer` of each earlier next_action call, oldest "
                                                        "first."},
                             "kind": {"type": "string", "enum": ["web", "mobile"],
                                      "description": "UI-Venus format only: its web or mobile prompt (default web)."},
                             **_SCREEN}, ["screenshot", "task"])},
    {"name": "ask",
     "description": "Answer a question about a screenshot.",
     "inputSchema": _schema({"screenshot": _SCREENSHOT, "question": {"type": "string"}}, ["screenshot", "question"])},
]
