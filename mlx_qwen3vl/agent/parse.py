"""Answers → points, boxes and actions in pixels of the original screenshot.

Qwen3-VL (and UI-Venus-1.5, built on it) answers in coordinates relative to the image, 0-1000 on
each axis, whatever size the processor resized the image to (`min_pixels` / `max_pixels`). Every
parser here maps them to pixels of the ORIGINAL image (as loaded: EXIF orientation applied) by one
rule, `to_pixel`:

    pixel = floor(v / 1000 * size), clamped to [0, size - 1]

i.e. the pixel whose extent holds the relative position (1000, the far edge, is the last pixel),
computed exactly (no float rounding). A box's centre is taken in relative coordinates first and
mapped by the same rule. Values outside 0-1000 are a malformed answer, except the UI-Venus refusal
`[-1,-1]`.

A whole agent answer (tool calls, a UI-Venus action, or a grounding answer, which is where to
click) is read by `read_answer`: computer use maps what it reads, so every shape grounding reads
means the same there.

An answer about a crop of the screenshot (two-stage grounding's second pass) is read with the
crop's `Window`: its coordinates, relative to the crop, are carried into coordinates relative to
the whole screenshot, exactly (`from_window`), and only then mapped by the same rule, once.
"""

import ast
import json
import math
import re
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from typing import NamedTuple, Optional, Tuple

from ..errors import InputError

SCALE = 1000  # Qwen3-VL's relative coordinate range

# ---------------------------------------------------------------------------------------------
# Coordinates
# ---------------------------------------------------------------------------------------------
def _number(v) -> Optional[Fraction]:
    """A finite number (or numeric string) as an exact fraction; None otherwise."""
    if isinstance(v, bool):
        return None
    if isinstance(v, float) and not math.isfinite(v):
        return None
    try:
        return Fraction(str(v).strip()) if isinstance(v, str) else Fraction(v)
    except (ValueError, TypeError, ZeroDivisionError):
        return None


def to_pixel(v, size: int) -> int:
    """A 0-1000 relative coordinate → pixel index on an axis of `size` pixels:
    floor(v / 1000 * size), clamped to [0, size - 1], computed exactly."""
    f = _number(v)
    if f is None:
        raise InputError(f"coordinate {v!r} is not a number")
    return max(0, min(size - 1, math.floor(f * size / SCALE)))


class Window(NamedTuple):
    """A crop of a screenshot, in its pixels: the crop's first column and row, and its size."""

    left: int
    top: int
    width: int
    height: int

    @property
    def box(self) -> Tuple[int, int, int, int]:
        """(x1, y1, x2, y2): the crop's first and last pixel on each axis, as boxes are given."""
        return (self.left, self.top, self.left + self.width - 1, self.top + self.height - 1)


def from_window(v, offset: int, extent: int, size: int) -> Fraction:
    """A 0-1000 coordinate relative to a window of `extent` pixels starting at pixel `offset` →
    0-1000 relative to the whole axis of `size` pixels, exactly: (1000 * offset + v * extent) / size."""
    return (SCALE * offset + Fraction(v) * extent) / size


class _Frame:
    """Where an answer's 0-1000 coordinates live: the whole width x height image, or a Window of it."""

    def __init__(self, width: int, height: int, window: Optional[Window] = None):
        self.width, self.height = width, height
        self.window = Window(0, 0, width, height) if window is None else Window(*window)
        w = self.window
        if not (w.width >= 1 and w.height >= 1 and 0 <= w.left and w.left + w.width <= width
                and 0 <= w.top and w.top + w.height <= height):
            raise InputError(f"window {tuple(w)} (left, top, width, height) does not lie within the "
                             f"{width}x{height} image")

    def relative(self, x, y) -> Tuple[Fraction, Fraction]:
        """Window-relative (x, y) → relative to the whole image (the identity without a window)."""
        w = self.window
        return from_window(x, w.left, w.width, self.width), from_window(y, w.top, w.height, self.height)

    def pixel(self, x, y) -> Tuple[int, int]:
        rx, ry = self.relative(x, y)
        return to_pixel(rx, self.width), to_pixel(ry, self.height)


def to_relative(pixel: int, size: int) -> int:
    """The inverse of `to_pixel`: a pixel index on an axis of `size` pixels → the least 0-1000
    coordinate that lies in that pixel, ceil(pixel * 1000 / size), clamped to 0-1000. Exact both
    ways where a unit fits a pixel: to_pixel(to_relative(p, s), s) == p for s <= 1000, and
    to_relative(to_pixel(v, s), s) == v (v < 1000) for s >= 1000."""
    p = max(0, min(size - 1, int(pixel)))
    return min(SCALE, -(-p * SCALE // size))


def _in_range(*vals) -> bool:
    return all(v is not None and 0 <= v <= SCALE for v in vals)




# ---------------------------------------------------------------------------------------------
# Grounding answers
# ---------------------------------------------------------------------------------------------
@dataclass
class Grounding:
    """A grounding answer in the original image's pixels.

    status: "ok" (a point, and a box when the answer gave one), "refused" (the model said the
    target is absent: UI-Venus' [-1,-1], Qwen's empty JSON list [], or a computer_use
    `terminate`), "malformed" (no usable coordinates: neither a point nor a refusal).
    relative: the point in exact 0-1000 coordinates of the whole image (None without a point);
    where two-stage grounding centres its window."""

    point: Optional[Tuple[int, int]]
    box: Optional[Tuple[int, int, int, int]]
    status: str
    answer: str
    relative: Optional[Tuple[Fraction, Fraction]] = None


_NUM = r"(-?\d+(?:\.\d+)?)"
_SEP = r"\s*,\s*"
# [x,y] / (x,y), [x1,y1,x2,y2] / (x1,y1,x2,y2), and two points [x1,y1],[x2,y2].
_GROUP = re.compile(r"[\[(]\s*" + _NUM + _SEP + _NUM + r"(?:" + _SEP + _NUM + _SEP + _NUM + r")?\s*[\])]")
_SECOND_POINT = re.compile(r"\s*,?\s*[\[(]\s*" + _NUM + _SEP + _NUM + r"\s*[\])]")
# <point>x, y</point> / <point>x y</point>, <bbox>x1 y1 x2 y2</bbox> (commas or spaces)
_LOOSE_SEP = r"(?:\s*,\s*|\s+)"
_POINT_TAG = re.compile(r"<point>\s*" + _NUM + _LOOSE_SEP + _NUM + r"\s*</point>")
_BOX_TAG = re.compile(r"<bbox>\s*" + _LOOSE_SEP.join([_NUM] * 4) + r"\s*</bbox>")
_TAG = {tag: re.compile(rf"<{tag}>(.*?)(?:</{tag}>|$)", re.S) for tag in ("think", "action", "conclusion", "answer")}
_THINK_BLOCK = re.compile(r"<think>.*?(?:</think>|$)", re.S)
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
_EMPTY_JSON_LIST = re.compile(r"\s*(?:```(?:json)?\s*)?\[\s*\]\s*(?:```)?\s*")
_JSON_STRING = re.compile(r'"(?:[^"\\\n]|\\.)*"')
_JSON_KEYS = ("bbox_2d", "point_2d", "bbox", "point", "box", "coordinate")
REFUSAL = [-1, -1]


def _tag(text, tag):
    m = _TAG[tag].search(text)
    return m.group(1).strip() if m else None


def reasoning_of(answer: str) -> Optional[str]:
    """The answer's reasoning: its <think> blocks, or what precedes a lone </think> (a template that
    opens the tag in the prompt); None without any."""
    blocks = [m.strip() for m in _TAG["think"].findall(answer)]
    if not blocks and "</think>" in answer:
        blocks = [answer.split("</think>", 1)[0].strip()]
    text = "\n\n".join(b for b in blocks if b)
    return text or None


def without_reasoning(text: str) -> str:
    """The answer with its reasoning left out: `<think>...</think>` blocks (an unclosed one runs to
    the end), and everything before a lone `</think>` (thinking templates open the tag in the prompt)."""
    text = _THINK_BLOCK.sub(" ", text)
    return text.rsplit("</think>", 1)[-1]


def _json_coordinates(body):
    """The numbers under the first bbox_2d / point_2d (or bbox, point, ...) key of the first JSON
    value in `body` that has one (Qwen's `[{"bbox_2d": [...], "label": "..."}]`); None without one."""
    def first(value):
        if isinstance(value, dict):
            for key in _JSON_KEYS:
                if key in value:
                    return value[key]
            return None
        if isinstance(value, list):
            for item in value:
                found = first(item)
                if found is not None:
                    return found
        return None

    decoder = json.JSONDecoder()
    for m in re.finditer(r"[\[{]", body):
        try:
            value, _ = decoder.raw_decode(body, m.start())
        except ValueError:
            continue
        found = first(value)
        if found is not None:
            return found
    return None


def _ground_box(nums, frame: _Frame, answer) -> Grounding:
    x1, y1, x2, y2 = nums
    if not _in_range(*nums):
        return Grounding(None, None, "malformed", answer)
    x1, x2 = sorted((x1, x2))
    y1, y2 = sorted((y1, y2))
    centre = ((x1 + x2) / 2, (y1 + y2) / 2)
    return Grounding(frame.pixel(*centre), frame.pixel(x1, y1) + frame.pixel(x2, y2), "ok", answer,
                     frame.relative(*centre))


def _ground_numbers(nums, frame: _Frame, answer) -> Grounding:
    """Two numbers (a point, or [-1,-1]) or four (a box) → Grounding; anything else is malformed."""
    if len(nums) == 4:
        return _ground_box(nums, frame, answer)
    if len(nums) == 2 and nums == REFUSAL:
        return Grounding(None, None, "refused", answer)
    if len(nums) == 2 and _in_range(*nums):
        return Grounding(frame.pixel(*nums), None, "ok", answer, frame.relative(*nums))
    return Grounding(None, None, "malformed", answer)


def parse_grounding(text: str, width: int, height: int, window: Optional[Window] = None) -> Grounding:
    """Any grounding answer → Grounding in pixels of a `width` x `height` image.

    Understood: `[x,y]` / `(x,y)`; a box `[x1,y1,x2,y2]` or two corners `[x1,y1],[x2,y2]` (point
    = the box centre); `<point>x, y</point>` and `<bbox>x1 y1 x2 y2</bbox>`; Qwen's
    `{"bbox_2d": [...]}` / `{"point_2d": [...]}` JSON (first object; its strings, such as a label,
    are never read as coordinates); UI-Venus actions such as `Click(box=(x,y))` (inside <action>
    when present); a `computer_use` tool call's `coordinate`. `[-1,-1]`, an empty JSON list and a
    `terminate` call are refusals. The reasoning (`<think>...</think>`) is never read, and an
    answer holding both a refusal and coordinates is ambiguous: malformed.

    `window` (a Window, or (left, top, width, height) in the image's pixels): the answer is about
    that crop of the image; its coordinates are carried into the whole image's, then mapped."""
    frame = _Frame(width, height, window)
    answer = text if isinstance(text, str) else ""
    body = without_reasoning(answer)
    if _EMPTY_JSON_LIST.fullmatch(body):
        return Grounding(None, None, "refused", answer)
    call = _TOOL_CALL.search(body)
    if call:
        args = _tool_arguments(call.group(1))
        if args is None:
            return Grounding(None, None, "malformed", answer)
        if args.get("action") == "terminate":
            return Grounding(None, None, "refused", answer)
        value = args.get("coordinate")
        nums = [_number(v) for v in value] if isinstance(value, (list, tuple)) and len(value) == 2 else []
        return _ground_numbers(nums, frame, answer) if nums != REFUSAL else Grounding(None, None, "malformed", answer)
    body = _tag(body, "action") or _tag(body, "answer") or body
    for tag in (_POINT_TAG, _BOX_TAG):
        m = tag.search(body)
        if m:
            return _ground_numbers([_number(g) for g in m.groups()], frame, answer)
    found = _json_coordinates(body)
    if found is not None:
        nums = [_number(v) for v in found] if isinstance(found, list) else []
        return _ground_numbers(nums, frame, answer)
    body = _JSON_STRING.sub(lambda s: " " * len(s.group()), body)  # a quoted label is no coordinate
    groups = [[_number(g) for g in m.groups() if g is not None] for m in _GROUP.finditer(body)]
    if not groups:
        return Grounding(None, None, "malformed", answer)
    if REFUSAL in groups and any(g != REFUSAL for g in groups):
        return Grounding(None, None, "malformed", answer)  # a point and a refusal: which one?
    nums = groups[0]
    if len(nums) == 2 and nums != REFUSAL:
        second = _SECOND_POINT.match(body, _GROUP.search(body).end())
        if second:
            nums = nums + [_number(g) for g in second.groups()]
    return _ground_numbers(nums, frame, answer)


def _point_arg(value, width: int, height: int, boxes: bool = True) -> Optional[Tuple[int, int]]:
    """An action's coordinate argument → pixels, read as a grounding answer's numbers are: (x, y),
    or (with `boxes`) a box (x1, y1, x2, y2) as its centre; None for anything else (a refusal, a
    value outside 0-1000)."""
    if not isinstance(value, (list, tuple)) or len(value) not in ((2, 4) if boxes else (2,)):
        return None
    g = _ground_numbers([_number(v) for v in value], _Frame(width, height), "")
    return g.point if g.status == "ok" else None


def parse_point(text: str, width: int, height: int) -> Optional[Tuple[int, int]]:
    """The point an answer names, in pixels of the original `width` x `height` image; None for a
    refusal (`[-1,-1]`) or an answer without usable 0-1000 coordinates. See parse_grounding."""
    return parse_grounding(text, width, height).point

# ---------------------------------------------------------------------------------------------
# Actions
# ---------------------------------------------------------------------------------------------
# UI-Venus action names (1.5 mobile / web grammar and the 2.x additions), by lower-case spelling.
VENUS_ACTIONS = {n.lower(): n for n in (
    "Click", "DoubleClick", "TripleClick", "RightClick", "MiddleClick", "LongPress", "Hover", "Drag", "Scroll",
    "Swipe", "Type", "Hotkey", "Launch", "LaunchApp", "Wait", "Finished", "CallUser", "Answer", "PressBack",
    "PressHome", "PressEnter", "PressRecent", "GetScreenshot", "KeyDown", "KeyUp", "MouseDown", "MouseUp")}
_VENUS_POINT_ARGS = ("box", "point", "start", "end")
_TOOL_POINT_ARGS = ("coordinate", "coordinate2", "start_coordinate")
_CALL = re.compile(r"^\s*([A-Za-z_]\w*)\s*\((.*)\)\s*$", re.S)


@dataclass
class Action:
    """One agent action with its coordinates in pixels of the original screenshot.

    name: the UI-Venus action (`Click`, `Scroll`, ...) or the computer-use / mobile-use action
    (`left_click`, `type`, ...); args: its arguments (coordinate arguments as (x, y) pixel tuples);
    tool: "computer_use" / "mobile_use" for tool calls, None for UI-Venus actions; think /
    conclusion: the <think> / <conclusion> text; action_text: the action as written."""

    name: str
    args: dict = field(default_factory=dict)
    tool: Optional[str] = None
    think: Optional[str] = None
    conclusion: Optional[str] = None
    action_text: str = ""

    @property
    def point(self) -> Optional[Tuple[int, int]]:
        """Where the action acts: its box / point / coordinate / start, in pixels (None if none)."""
        for key in ("box", "point", "coordinate", "start"):
            if key in self.args:
                return self.args[key]
        return None

    def to_dict(self) -> dict:
        """JSON-ready: coordinate tuples become lists."""
        out = asdict(self)
        out["args"] = {k: list(v) if isinstance(v, tuple) else v for k, v in self.args.items()}
        return out


def _tool_arguments(payload) -> Optional[dict]:
    try:
        call = json.loads(payload)
        args = call.get("arguments", {})
        args = json.loads(args) if isinstance(args, str) else args
    except (ValueError, AttributeError):
        return None
    return args if isinstance(args, dict) else None


def _literal_args(params: str) -> Optional[dict]:
    """`key=literal, ...` parsed without evaluating anything; None if not such a list."""
    try:
        node = ast.parse(f"f({params})", mode="eval").body
        if node.args:
            return None
        return {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        return None


_LOOSE_ARG = re.compile(r"(\w+)\s*=\s*(\([^)]*\)|\[[^\]]*\]|'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|[^,]+)")


def _loose_args(params: str) -> dict:
    """Fallback for answers that are not valid Python (e.g. `Type(content='it's')`): a lone
    string argument keeps everything between its outer quotes; other values are read one by one."""
    m = re.fullmatch(r"\s*(\w+)\s*=\s*(['\"])(.*)\2\s*", params, re.S)
    if m:
        return {m.group(1): m.group(3)}
    out = {}
    for key, value in _LOOSE_ARG.findall(params):
        value = value.strip()
        parsed = _literal_args(f"v={value}")
        out[key] = parsed["v"] if parsed else value.strip("'\"")
    return out


def parse_action(text: str, width: int, height: int) -> Optional[Action]:
    """An agent answer → Action with coordinates in pixels of the original `width` x `height`
    screenshot (0-1000 relative, mapped by `to_pixel`); None when no known action can be read or a
    coordinate argument is not two numbers in 0-1000 (a malformed answer, never a guessed one).

    Understood: UI-Venus `<think>..</think><action>Name(key=value, ...)</action><conclusion>..`
    answers (the bare call too; a point argument may be a box (x1, y1, x2, y2): its centre, as
    parse_grounding reads it), for Click, DoubleClick, LongPress, Hover, Drag, Scroll (start/end
    or direction), Swipe, Type, Hotkey, Launch, Wait, Finished, CallUser, Answer, PressBack /
    Home / Enter / Recent and the rest of VENUS_ACTIONS; and Qwen3-VL `<tool_call>` JSON for
    `computer_use` / `mobile_use` (coordinate, coordinate2 mapped). Nothing is ever evaluated."""
    if not isinstance(text, str):
        return None
    think, conclusion = _tag(text, "think"), _tag(text, "conclusion")
    call = _TOOL_CALL.search(text)
    if call:
        args = _tool_arguments(call.group(1))
        try:
            tool = json.loads(call.group(1)).get("name")
        except (ValueError, AttributeError):
            tool = None
        if args is None or not isinstance(args.get("action"), str):
            return None
        mapped = {}
        for key, value in args.items():
            if key in _TOOL_POINT_ARGS:  # Qwen's coordinate is a point, as the grounding parser reads it
                value = _point_arg(value, width, height, boxes=False)
                if value is None:
                    return None
            mapped[key] = value
        name = mapped.pop("action")
        return Action(name, mapped, tool=tool, think=think, conclusion=conclusion, action_text=call.group(1))
    action_text = _tag(text, "action")
    if action_text is None:  # a bare call, possibly after free text
        found = [line for line in text.strip().splitlines() if _CALL.match(line)]
        action_text = found[-1].strip() if found else text.strip()
    m = _CALL.match(action_text)
    if not m or m.group(1).lower() not in VENUS_ACTIONS:
        return None
    name, params = VENUS_ACTIONS[m.group(1).lower()], m.group(2).strip()
    args = {} if not params else _literal_args(params)
    if args is None:
        args = _loose_args(params)
    mapped = {}
    for key, value in args.items():
        if key in _VENUS_POINT_ARGS:
            if value in ((), [], "", None):  # UI-Venus writes Scroll(start=(), end=()) for "none"
                continue
            value = _point_arg(value, width, height)  # a point, or a box (UI-Venus answers both): its centre
            if value is None:
                return None
        mapped[key] = value
    return Action(name, mapped, think=think, conclusion=conclusion, action_text=action_text)



# ---------------------------------------------------------------------------------------------
# A whole agent answer
# ---------------------------------------------------------------------------------------------
_VENUS_CALL = re.compile(r"<action>|^\s*(?:" + "|".join(VENUS_ACTIONS.values()) + r")\s*\(", re.M | re.I)
_ACTION_BLOCK = re.compile(r"<action>.*?(?:</action>|$)", re.S)
_CONCLUSION_TAG = re.compile(r"</?conclusion>")


@dataclass
class AgentAnswer:
    """An agent's whole answer, read by the parsers above (what computer use maps).

    status: "actions" (`actions`: every `<tool_call>` in order, or the one UI-Venus action, or,
    for an answer in any grounding shape, a `Click` at its point), "unreadable" (it writes a tool
    call or a UI-Venus action that cannot be read: `problem` says which) or "text" (no action:
    prose, a refusal). text: what is left for the user (the answer less its reasoning and
    actions). reasoning: its <think> text (None without)."""

    status: str
    actions: list = field(default_factory=list)
    text: str = ""
    reasoning: Optional[str] = None
    problem: Optional[str] = None


def read_answer(text: str, width: int, height: int) -> AgentAnswer:
    """An agent answer → AgentAnswer with coordinates in pixels of a `width` x `height` image.

    Qwen `<tool_call>` blocks (each must be a readable `computer_use` call), else a UI-Venus action
    (parse_action), else any answer parse_grounding reads as a point ([x, y], a box, bbox_2d /
    point_2d JSON, <point> / <bbox> tags), which is where to click: one parser for every shape. A
    call of an action neither family has (`Explode(box=(1, 2))`) is text, never a click."""
    if not isinstance(text, str):
        raise InputError("the answer must be a string")
    reasoning = reasoning_of(text)
    body = without_reasoning(text).strip()
    blocks = list(_TOOL_CALL.finditer(body))
    if blocks:
        actions = [parse_action(m.group(0), width, height) for m in blocks]
        if any(a is None or a.tool != "computer_use" for a in actions):
            return AgentAnswer("unreadable", text=body, reasoning=reasoning,
                               problem="a tool call that is not a readable computer_use call")
        return AgentAnswer("actions", actions, _TOOL_CALL.sub(" ", body).strip(), reasoning)
    a = parse_action(body, width, height)
    if a is not None and a.tool is None:
        rest = _ACTION_BLOCK.sub(" ", body) if "<action>" in body else body.replace(a.action_text, " ", 1)
        return AgentAnswer("actions", [a], _CONCLUSION_TAG.sub(" ", rest).strip(), reasoning)
    if _VENUS_CALL.search(body):
        return AgentAnswer("unreadable", text=body, reasoning=reasoning,
                           problem="an unreadable UI-Venus action (a coordinate outside 0-1000, or bad arguments)")
    if any(_CALL.match(line) for line in body.splitlines()):  # a call of an action neither family has
        return AgentAnswer("text", text=body, reasoning=reasoning)
    g = parse_grounding(body, width, height)
    if g.status == "ok":
        return AgentAnswer("actions", [Action("Click", {"box": g.point}, action_text=body)], "", reasoning)
    return AgentAnswer("text", text=body, reasoning=reasoning)
