"""The MCP server's three tools, `ground`, `next_action` and `ask`, each in two steps: `prepare`
(arguments dict → ToolCall: the arguments validated by their wire models and read into the one
request form, `server.protocol.ChatRequest` (arguments.py), and the screenshot read under the
call's media budget, before any model work; on a preparation thread) and `answer` (on the model's
thread: the turns rendered as the HTTP server renders them: `ask` by conversation.template_messages,
`next_action` by the trained computer-use prompt, `ground` by agent.ground's grounding prompt);
`ground_tool` and the others do both. No MCP SDK here: server.py puts these behind the protocol.

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
from ..agent.computer_use import AGENT_FORMATS, AGENT_SAMPLING, ComputerStep, computer_messages, map_answer
from ..server.computer import agent_loop
from ..server.conversation import template_messages
from ..server.protocol import ChatRequest
from . import arguments
from .arguments import ImageContent

DEFAULT_MAX_REQUEST_PIXELS = 32 << 20  # as the HTTP server's --max-request-pixels
DEFAULT_MAX_IMAGE_BYTES = 32 << 20
# HTTP sessions (the SDK's own defaults keep 10,000 for 30 minutes; a desktop client holds one).
DEFAULT_MAX_SESSIONS = 32
DEFAULT_MAX_SESSIONS_PER_CLIENT = 4
DEFAULT_SESSION_IDLE_TIMEOUT_S = 300.0


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
    if isinstance(value, ImageContent):  # (the argument as arguments.py validated it: content or a non-empty string)
        data = media_access.decode_base64(value.data, "the screenshot", flag="--max-image-bytes", **limit)
    elif value.startswith("data:"):
        data = media_access.decode_data_url(value, "the screenshot", flag="--max-image-bytes", base64_only=True,
                                            **limit)
    else:
        data = media_access.read_allowed(value, settings.allowed_dirs, "the screenshot path", flag=ALLOW_FLAG,
                                         bytes_flag="--max-image-bytes", **limit)
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
    request: ChatRequest  # the one request form: the conversation's turns, sampling, pixels
    media: dict  # each image part's encoded bytes, by its argument (the part's param)
    size: tuple  # the screenshot's (width, height)
    screen: tuple  # the (width, height) answers are given in
    options: dict  # what the request form has no place for: ground's format and zoom, next_action's kind

    def resolve(self, part) -> bytes:
        return self.media[part.param]

    def text(self) -> str:
        """The user's words: ground's instruction, next_action's task, ask's question."""
        return "\n".join(t.text("\n") for t in self.request.turns if t.role == "user" and t.text())


def _sampling_and_pixels(name: str, settings: Settings):
    """A tool's sampling (next_action: the agent format's, AGENT_SAMPLING; else greedy) and pixel
    settings (the format's, then the operator's)."""
    if name != "next_action":
        return None, settings.pixel_options()
    options = dict(AGENT_SAMPLING[settings.agent_format])
    pixels = {k: options.pop(k) for k in ("min_pixels", "max_pixels") if k in options}
    return options, {**pixels, **settings.pixel_options()}


def prepare(name: str, processor, settings: Settings, args) -> ToolCall:
    """Every argument of a call checked (arguments.py's wire models) and read into the one request
    form, then the screenshot read under the call's media budget (bytes and one deadline,
    media_access.MediaBudget) and its pixels checked from the header: all before the model is
    asked. InputError (one line) otherwise."""
    wire = arguments.validate(name, args)
    sampling, pixels = _sampling_and_pixels(name, settings)
    req = arguments.request(name, wire, max_tokens=settings.max_tokens, sampling=sampling, pixels=pixels)
    budget, media, size = settings.budget(), {}, None
    for turn in req.turns:
        for part in turn.images():
            media[part.param], size = read_screenshot(part.value, settings, processor, pixels, budget)
    screen = size
    if name != "ask" and getattr(wire, "screen_width", None) is not None:
        screen = (wire.screen_width, wire.screen_height)
    if name == "ground":
        options = {"format": wire.format or settings.ground_format,
                   "zoom": None if wire.zoom is None or wire.zoom is False else zoom_fraction(wire.zoom, "'zoom'")}
    else:
        options = {"kind": getattr(wire, "kind", None) or "web"}
    return ToolCall(name, req, media, size, screen, options)


def answer(model, processor, settings: Settings, call: ToolCall) -> dict:
    """A prepared call's answer (on the model's thread)."""
    return ANSWERS[call.name](model, processor, settings, call)


def _pixels(req: ChatRequest) -> dict:
    return {"min_pixels": req.min_pixels, "max_pixels": req.max_pixels}


def _ground(model, processor, settings: Settings, call: ToolCall) -> dict:
    """The grounding prompt of the format (agent.ground), as POST /v1/ground asks it."""
    o, size, screen, req = call.options, call.size, call.screen, call.request
    hit = ground(model, processor, call.media["screenshot"], call.text(), format=o["format"], zoom=o["zoom"],
                 max_tokens=req.sampling.max_tokens, **_pixels(req))
    g = _on_screen(hit, size, screen) if screen != size else hit
    out = {"point": list(g.point) if g.point else None, "box": list(g.box) if g.box else None, "status": g.status,
           "answer": hit.answer, "format": o["format"], "screen_size": list(screen), "image_size": list(size)}
    if o["zoom"] is not None:  # the window in the screenshot's pixels, and each pass's answer there
        out["zoom"] = hit.to_dict()["zoom"]
    return out


def agent_messages(settings: Settings, call: ToolCall) -> list:
    """next_action's turns as the trained computer-use prompt: read as the HTTP server reads a
    computer-use conversation (server.computer.agent_loop: the task, each earlier answer as
    written, the current screenshot), rendered by agent.computer_use.computer_messages."""
    system, task, steps, shot = agent_loop(call.request.turns)
    return computer_messages("\n".join(task), call.resolve(shot), [ComputerStep(answer=s.turn.answer) for s in steps],
                             format=settings.agent_format, kind=call.options["kind"], system=system)


def _next_action(model, processor, settings: Settings, call: ToolCall) -> dict:
    screen, req = call.screen, call.request
    out = generate(model, processor, messages=agent_messages(settings, call), sampling=req.sampling, **_pixels(req))
    turn = map_answer(out.text, screen)
    parsed = parse_action(out.text, *screen)
    result = turn.to_dict()
    del result["calls"]  # no protocol here: the neutral actions are the answer
    result.update(parsed=parsed.to_dict() if parsed else None, screen_size=list(screen), image_size=list(call.size),
                  finish_reason=out.finish_reason)
    return result


def _ask(model, processor, settings: Settings, call: ToolCall) -> dict:
    """The chat template's messages, rendered from the turns as the HTTP server renders a chat."""
    req = call.request
    messages, images, _ = template_messages(req.turns, call.resolve)
    out = generate(model, processor, messages=messages, images=images, sampling=req.sampling, **_pixels(req))
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
TOOL_DECLARATIONS = [arguments.declaration(name) for name in ("ground", "next_action", "ask")]
