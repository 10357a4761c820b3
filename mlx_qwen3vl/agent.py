"""GUI-agent toolkit: the prompts UI-Venus-1.5 and Qwen3-VL were trained with, parsers that turn
their answers into points and actions on the user's screenshot, and `ground()`.

Qwen3-VL (and UI-Venus-1.5, built on it) answers in coordinates relative to the image, 0-1000 on
each axis, whatever size the processor resized the image to (`min_pixels` / `max_pixels`). Every
parser here maps them to pixels of the ORIGINAL image (as loaded: EXIF orientation applied) by one
rule, `to_pixel`:

    pixel = floor(v / 1000 * size), clamped to [0, size - 1]

i.e. the pixel whose extent holds the relative position (1000, the far edge, is the last pixel),
computed exactly (no float rounding). A box's centre is taken in relative coordinates first and
mapped by the same rule. Values outside 0-1000 are a malformed answer, except the UI-Venus refusal
`[-1,-1]`.

    from mlx_qwen3vl import load
    from mlx_qwen3vl.agent import ground, parse_action
    model, processor = load("path/to/UI-Venus-1.5")
    hit = ground(model, processor, "screen.png", "the Apply button")
    print(hit.point, hit.box, hit.answer)
"""

import ast
import json
import math
import re
import time
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from typing import Optional, Sequence, Tuple

from .errors import InputError

SCALE = 1000  # Qwen3-VL's relative coordinate range

# ---------------------------------------------------------------------------------------------
# Prompts, as the models were trained (text must match to the character)
# ---------------------------------------------------------------------------------------------
# UI-Venus-1.5 grounding (inclusionAI/UI-Venus, models/grounding/ui_venus1_5_gd.py): the image,
# then this instruction; the refusal clause lets the model answer [-1,-1] for an absent target.
VENUS_GROUNDING_PROMPT = (
    "Output the center point of the position corresponding to the following instruction: \n{}. \n\n"
    "The output should just be the coordinates of a point, in the format [x,y]."
)
VENUS_REFUSAL_CLAUSE = (
    " Additionally, if the task is infeasible (e.g., the task is not related to the image), "
    "the output should be [-1,-1]."
)

# UI-Venus-1.5 navigation (models/navigation/utils.py): one user turn per step, the prompt text
# then the screenshot, after the system line "You are a helpful assistant."; earlier steps enter as
# text only ("Step i: <think>..</think><action>..</action>", the last 5 in scripts/run_navi.sh).
# That runner still rescales answers by the resized image (a UI-Venus-1.0 / Qwen2.5-VL leftover);
# the 1.5 models answer 0-1000 like Qwen3-VL, which its Venus_framework maps by / 1000, as here.
VENUS_MOBILE_PROMPT = """
**You are a GUI Agent.**  
Your task is to analyze a given user task, review current screenshot and previous actions, and determine the next action to complete the task.

### User Task
{user_task}

### Previous Actions
{previous_actions}

### Available Actions
You may execute one of the following functions:
Click(box=(x1, y1))
Drag(start=(x1, y1), end=(x2, y2))
Scroll(start=(x1, y1), end=(x2, y2), direction='down/up/right/left')
Type(content='')
Launch(app='')
Wait()
Finished(content='')
CallUser(content='')
LongPress(box=(x1, y1))
PressBack()
PressHome()
PressEnter()
PressRecent()

### Instruction
- Make sure you understand the task goal to avoid wrong actions.
- Make sure you carefully examine the the current screenshot. Sometimes the summarized history might not be reliable, over-claiming some effects.
- For requests that are questions (or chat messages), remember to use the `CallUser` action to reply to user explicitly before finishing! Then, after you have replied, use the Finished action if the goal is achieved.
- Consider exploring the screen by using the `scroll` action with different directions to reveal additional content.
- To copy some text: first select the exact text you want to copy, which usually also brings up the text selection bar, then click the `copy` button in bar.
- To paste text into a text box, first long press the text box, then usually the text selection bar will appear with a `paste` button in it.
- You first thinks about the reasoning process in the mind, then provide the action. The reasoning and action are enclosed in <think></think> and <action></action> tags respectively. After providing action, summarize your action in <conclusion></conclusion> tags
"""

VENUS_WEB_PROMPT = """
**You are a GUI Agent.**
Your task is to analyze a given user task, review current screenshot and previous actions, and determine the next action to complete the task.

### Available Actions
You may execute one of the following functions:
- Click(box=(x1,y1))
- Drag(start=(x1,y1), end=(x2,y2))
- Scroll(direction='down or up')
- Type(content='')
- Launch(app='' or url='')
- Wait()
- Finished(content='')
- CallUser(content='')
- LongPress(box=(x1,y1))
- PressBack()
- PressHome()
- PressEnter()
- PressRecent()
- Hover(box=(x1,y1))
- DoubleClick(box=(x1,y1))
- Hotkey(keys=['ctrl', 'c']) # Split keys with comma and wrap each key in single quotes. Do not use more than 3 keys in one Hotkey action.

### User Task
{user_task}

### Previous Actions
{previous_actions}

### Output Format
<think> your thinking process </think>
<action> the next action </action>
<conclusion> the conclusion about the next action </conclusion>

### Instruction
- Make sure you understand the task goal to avoid wrong actions.
- Make sure you carefully examine the the current screenshot. Sometimes the summarized history might not be reliable, over-claiming some effects.
- For complex information-retrieval tasks, use `CallUser(content='...')` to reply only at the very end, after gathering all required info. Combine web evidence with your reasoning.
- To input text: first `Click(box=...)` on the textbox, then `Type(content='...')`. The system automatically presses `ENTER` afterward. If search filters are needed, click the search button after typing.
- Try to use simple language when searching.
- Distinguish textbox from button: never `Type` into a button. If no textbox is visible, try clicking the search icon first \u2014 the input field may appear afterward.
- Execute only one action per step.
- Strictly avoid repeating the same action when the webpage remains unchanged \u2014 you may have executed the wrong action. Continuous use of `Wait()` is also NOT allowed.
"""
VENUS_NAVIGATION_SYSTEM = "You are a helpful assistant."
VENUS_HISTORY_LENGTH = 5
# What UI-Venus' navigation runner samples with (greedy, repetition penalty 1.05) and its pixel budget.
VENUS_NAVIGATION_SAMPLING = dict(temperature=0.0, repetition_penalty=1.05, max_tokens=2048,
                                 min_pixels=3136, max_pixels=12845056)

# Qwen3-VL's own referring grounding (the technical report's prompt): a bbox_2d JSON answer.
QWEN_GROUNDING_PROMPT = ('Locate every object that matches the description "{}" in the image. '
                         "Report bbox coordinates in JSON format.")

# Qwen3-VL computer use (cookbooks/computer_use.ipynb): qwen-agent's Nous function-calling system
# prompt around the cookbook's `computer_use` tool, declared on a 1000x1000 screen so that the
# model's coordinates are the relative ones; the user turn is the screenshot, then the query.
_COMPUTER_USE_DESCRIPTION = """Use a mouse and keyboard to interact with a computer, and take screenshots.
* This is an interface to a desktop GUI. You do not have access to a terminal or applications menu. You must click on desktop icons to start applications.
* Some applications may take time to start or process actions, so you may need to wait and take successive screenshots to see the results of your actions. E.g. if you click on Firefox and a window doesn't open, try wait and taking another screenshot.
* The screen's resolution is {width}x{height}.
* Whenever you intend to move the cursor to click on an element like an icon, you should consult a screenshot to determine the coordinates of the element before moving the cursor.
* If you tried clicking on a program or link but it failed to load, even after waiting, try adjusting your cursor position so that the tip of the cursor visually falls on the element that you want to click.
* Make sure to click any buttons, links, icons, etc with the cursor tip in the center of the element. Don't click boxes on their edges."""
_COMPUTER_USE_ACTIONS = """The action to perform. The available actions are:
* `key`: Performs key down presses on the arguments passed in order, then performs key releases in reverse order.
* `type`: Type a string of text on the keyboard.
* `mouse_move`: Move the cursor to a specified (x, y) pixel coordinate on the screen.
* `left_click`: Click the left mouse button at a specified (x, y) pixel coordinate on the screen.
* `left_click_drag`: Click and drag the cursor to a specified (x, y) pixel coordinate on the screen.
* `right_click`: Click the right mouse button at a specified (x, y) pixel coordinate on the screen.
* `middle_click`: Click the middle mouse button at a specified (x, y) pixel coordinate on the screen.
* `double_click`: Double-click the left mouse button at a specified (x, y) pixel coordinate on the screen.
* `triple_click`: Triple-click the left mouse button at a specified (x, y) pixel coordinate on the screen (simulated as double-click since it's the closest action).
* `scroll`: Performs a scroll of the mouse scroll wheel.
* `hscroll`: Performs a horizontal scroll (mapped to regular scroll).
* `wait`: Wait specified seconds for the change to happen.
* `terminate`: Terminate the current task and report its completion status.
* `answer`: Answer a question."""
COMPUTER_USE_ACTIONS = ["key", "type", "mouse_move", "left_click", "left_click_drag", "right_click",
                        "middle_click", "double_click", "triple_click", "scroll", "hscroll", "wait",
                        "terminate", "answer"]
_FN_CALL_TEMPLATE = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tool_descs}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def computer_use_tool(width=SCALE, height=SCALE) -> dict:
    """The cookbook's `computer_use` function declaration (qwen-agent's field order)."""
    parameters = {
        "properties": {
            "action": {"description": _COMPUTER_USE_ACTIONS, "enum": COMPUTER_USE_ACTIONS, "type": "string"},
            "keys": {"description": "Required only by `action=key`.", "type": "array"},
            "text": {"description": "Required only by `action=type` and `action=answer`.", "type": "string"},
            "coordinate": {"description": "(x, y): The x (pixels from the left edge) and y (pixels from the top "
                                          "edge) coordinates to move the mouse to.", "type": "array"},
            "pixels": {"description": "The amount of scrolling to perform. Positive values scroll up, negative "
                                      "values scroll down. Required only by `action=scroll` and `action=hscroll`.",
                       "type": "number"},
            "time": {"description": "The seconds to wait. Required only by `action=wait`.", "type": "number"},
            "status": {"description": "The status of the task. Required only by `action=terminate`.",
                       "type": "string", "enum": ["success", "failure"]},
        },
        "required": ["action"],
        "type": "object",
    }
    return {"name_for_human": "computer_use", "name": "computer_use",
            "description": _COMPUTER_USE_DESCRIPTION.format(width=width, height=height),
            "parameters": parameters, "args_format": "Format the arguments as a JSON object."}


def computer_use_system_prompt(system="You are a helpful assistant.") -> str:
    """The system turn of Qwen3-VL's computer-use cookbook: `system`, then the tool block."""
    tool = json.dumps({"type": "function", "function": computer_use_tool()}, ensure_ascii=False)
    return system + "\n\n" + _FN_CALL_TEMPLATE.format(tool_descs=tool)


def _image_block(image):
    return {"type": "image", "image": image}


GROUNDING_FORMATS = ("venus", "qwen", "computer_use")


def grounding_prompt(instruction: str, format: str = "venus", allow_refusal: bool = True) -> str:
    """The user text that asks for `instruction`'s location, in the model's trained wording."""
    if format == "venus":
        # UI-Venus drops one trailing period: the template adds its own.
        text = VENUS_GROUNDING_PROMPT.format(instruction[:-1] if instruction.endswith(".") else instruction)
        return text + VENUS_REFUSAL_CLAUSE if allow_refusal else text
    if format == "qwen":
        return QWEN_GROUNDING_PROMPT.format(instruction)
    if format == "computer_use":
        return instruction
    raise InputError(f"unknown grounding format {format!r}; use {', '.join(GROUNDING_FORMATS)}")


def grounding_messages(image, instruction: str, format: str = "venus", allow_refusal: bool = True) -> list:
    """Chat messages for one grounding query: the screenshot first, then the prompt (all three
    formats put the image first); computer_use adds its tool-declaring system turn."""
    messages = [{"role": "system", "content": computer_use_system_prompt()}] if format == "computer_use" else []
    content = [_image_block(image), {"type": "text", "text": grounding_prompt(instruction, format, allow_refusal)}]
    return messages + [{"role": "user", "content": content}]


@dataclass
class Step:
    """One earlier navigation step, as UI-Venus feeds it back: its thinking and its action text."""

    think: str
    action: str


def navigation_prompt(task: str, history: Sequence = (), kind: str = "mobile",
                      history_length: int = VENUS_HISTORY_LENGTH) -> str:
    """UI-Venus-1.5's navigation prompt for `task`, with the last `history_length` steps (Step
    objects, Actions from parse_action, or (think, action) pairs), numbered from 0 in the window."""
    template = {"mobile": VENUS_MOBILE_PROMPT, "web": VENUS_WEB_PROMPT}.get(kind)
    if template is None:
        raise InputError(f"unknown navigation prompt kind {kind!r}; use mobile or web")
    recent = list(history)[-history_length:] if history_length > 0 else []
    lines = []
    for i, step in enumerate(recent):
        think, action = (step.think, step.action_text) if isinstance(step, Action) else (
            (step.think, step.action) if isinstance(step, Step) else step)
        lines.append(f"Step {i}: <think>{think or ''}</think><action>{action}</action>")
    return template.format(user_task=task, previous_actions="\n".join(lines))


def navigation_messages(image, task: str, history: Sequence = (), kind: str = "mobile",
                        history_length: int = VENUS_HISTORY_LENGTH) -> list:
    """One UI-Venus-1.5 navigation step: system line, then the prompt text and the screenshot."""
    return [{"role": "system", "content": VENUS_NAVIGATION_SYSTEM},
            {"role": "user", "content": [{"type": "text", "text": navigation_prompt(task, history, kind, history_length)},
                                         _image_block(image)]}]


def computer_use_messages(image, query: str) -> list:
    """One Qwen3-VL computer-use turn: the tool system prompt, then the screenshot and the query."""
    return grounding_messages(image, query, "computer_use")


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


def _in_range(*vals) -> bool:
    return all(v is not None and 0 <= v <= SCALE for v in vals)


def _pair(value, width, height) -> Optional[Tuple[int, int]]:
    """(x, y) relative → pixels; None unless two numbers within 0-1000."""
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        return None
    x, y = (_number(v) for v in value)
    return (to_pixel(x, width), to_pixel(y, height)) if _in_range(x, y) else None


# ---------------------------------------------------------------------------------------------
# Grounding answers
# ---------------------------------------------------------------------------------------------
@dataclass
class Grounding:
    """A grounding answer in the original image's pixels.

    status: "ok" (a point, and a box when the answer gave one), "refused" (the model said the
    target is absent: UI-Venus' [-1,-1], Qwen's empty JSON list [], or a computer_use
    `terminate`), "malformed" (no usable coordinates: neither a point nor a refusal)."""

    point: Optional[Tuple[int, int]]
    box: Optional[Tuple[int, int, int, int]]
    status: str
    answer: str


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


def _ground_box(nums, width, height, answer) -> Grounding:
    x1, y1, x2, y2 = nums
    if not _in_range(*nums):
        return Grounding(None, None, "malformed", answer)
    x1, x2 = sorted((x1, x2))
    y1, y2 = sorted((y1, y2))
    box = (to_pixel(x1, width), to_pixel(y1, height), to_pixel(x2, width), to_pixel(y2, height))
    centre = (to_pixel((x1 + x2) / 2, width), to_pixel((y1 + y2) / 2, height))
    return Grounding(centre, box, "ok", answer)


def _ground_numbers(nums, width, height, answer) -> Grounding:
    """Two numbers (a point, or [-1,-1]) or four (a box) → Grounding; anything else is malformed."""
    if len(nums) == 4:
        return _ground_box(nums, width, height, answer)
    if len(nums) == 2 and nums == REFUSAL:
        return Grounding(None, None, "refused", answer)
    if len(nums) == 2 and _in_range(*nums):
        return Grounding((to_pixel(nums[0], width), to_pixel(nums[1], height)), None, "ok", answer)
    return Grounding(None, None, "malformed", answer)


def parse_grounding(text: str, width: int, height: int) -> Grounding:
    """Any grounding answer → Grounding in pixels of a `width` x `height` image.

    Understood: `[x,y]` / `(x,y)`; a box `[x1,y1,x2,y2]` or two corners `[x1,y1],[x2,y2]` (point
    = the box centre); `<point>x, y</point>` and `<bbox>x1 y1 x2 y2</bbox>`; Qwen's
    `{"bbox_2d": [...]}` / `{"point_2d": [...]}` JSON (first object; its strings, such as a label,
    are never read as coordinates); UI-Venus actions such as `Click(box=(x,y))` (inside <action>
    when present); a `computer_use` tool call's `coordinate`. `[-1,-1]`, an empty JSON list and a
    `terminate` call are refusals. The reasoning (`<think>...</think>`) is never read, and an
    answer holding both a refusal and coordinates is ambiguous: malformed."""
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
        point = _pair(args.get("coordinate"), width, height)
        return Grounding(point, None, "ok" if point else "malformed", answer)
    body = _tag(body, "action") or _tag(body, "answer") or body
    for tag in (_POINT_TAG, _BOX_TAG):
        m = tag.search(body)
        if m:
            return _ground_numbers([_number(g) for g in m.groups()], width, height, answer)
    found = _json_coordinates(body)
    if found is not None:
        nums = [_number(v) for v in found] if isinstance(found, list) else []
        return _ground_numbers(nums, width, height, answer)
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
    return _ground_numbers(nums, width, height, answer)


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
    answers (the bare call too), for Click, DoubleClick, LongPress, Hover, Drag, Scroll (start/end
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
            if key in _TOOL_POINT_ARGS:
                value = _pair(value, width, height)
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
            value = _pair(value, width, height)
            if value is None:
                return None
        mapped[key] = value
    return Action(name, mapped, think=think, conclusion=conclusion, action_text=action_text)


# ---------------------------------------------------------------------------------------------
# ground()
# ---------------------------------------------------------------------------------------------
def _load_image(image):
    from .media import load_image

    return load_image(image)


@dataclass
class GroundingResult:
    """ground()'s answer: point / box in pixels of the original image (None if refused or
    malformed), the raw answer, the image size, and timing."""

    point: Optional[Tuple[int, int]]
    box: Optional[Tuple[int, int, int, int]]
    status: str
    answer: str
    width: int
    height: int
    format: str
    seconds: float = 0.0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prompt_tps: float = 0.0
    generation_tps: float = 0.0

    def to_dict(self) -> dict:
        return {"point": list(self.point) if self.point else None, "box": list(self.box) if self.box else None,
                "status": self.status, "answer": self.answer, "image_size": [self.width, self.height],
                "format": self.format,
                "timing": {"seconds": round(self.seconds, 4), "prompt_tokens": self.prompt_tokens,
                           "generation_tokens": self.generation_tokens, "prompt_tps": round(self.prompt_tps, 2),
                           "generation_tps": round(self.generation_tps, 2)}}


def ground(model, processor, image, instruction: str, *, format: str = "venus", allow_refusal: bool = True,
           min_pixels: Optional[int] = None, max_pixels: Optional[int] = None, max_tokens: int = 128,
           **generate_kwargs) -> GroundingResult:
    """Locate `instruction` on `image` (path, URL, data: URL, PIL image or uint8 array) and return
    the point in the image's own pixels, whatever min_pixels / max_pixels did to it for the model.

    format: "venus" (UI-Venus-1.5's [x,y] prompt; allow_refusal adds its [-1,-1] clause), "qwen"
    (Qwen3-VL's bbox_2d JSON) or "computer_use" (Qwen3-VL's tool call). Greedy by default, as both
    projects evaluate; other generate() options pass through."""
    from . import generate

    if format not in GROUNDING_FORMATS:
        raise InputError(f"unknown grounding format {format!r}; use {', '.join(GROUNDING_FORMATS)}")
    rgb = _load_image(image)
    height, width = rgb.shape[:2]
    tic = time.perf_counter()
    out = generate(model, processor, messages=grounding_messages(rgb, instruction, format, allow_refusal),
                   max_tokens=max_tokens, min_pixels=min_pixels, max_pixels=max_pixels, **generate_kwargs)
    seconds = time.perf_counter() - tic
    g = parse_grounding(out.text, width, height)
    return GroundingResult(g.point, g.box, g.status, out.text, width, height, format, seconds,
                           out.prompt_tokens, out.generation_tokens, out.prompt_tps, out.generation_tps)


def navigate(model, processor, image, task: str, history: Sequence = (), *, kind: str = "mobile",
             history_length: int = VENUS_HISTORY_LENGTH, **generate_kwargs) -> Tuple[str, Optional[Action]]:
    """One UI-Venus-1.5 navigation step on `image`: its prompt (the last `history_length` steps of
    `history` as text), sampled as UI-Venus' runner does (VENUS_NAVIGATION_SAMPLING, overridable).
    Returns the raw answer and its Action in the image's pixels (None if the answer has none);
    append the Action to `history` for the next step."""
    from . import generate

    rgb = _load_image(image)
    height, width = rgb.shape[:2]
    options = {**VENUS_NAVIGATION_SAMPLING, **generate_kwargs}
    out = generate(model, processor, messages=navigation_messages(rgb, task, history, kind, history_length), **options)
    return out.text, parse_action(out.text, width, height)


def annotate(image, point=None, box=None, path=None, note=None):
    """Draw `box` (outline) and `point` (ringed dot with a crosshair) on a copy of the image (RGB
    array or PIL image), and `note` (e.g. "no point found") as a red banner across the top, so a
    picture of an answer without a point never passes for the plain screenshot. Returns the PIL
    image, also written to `path` as PNG when given."""
    import numpy as np
    from PIL import Image, ImageDraw, ImageFont

    im = Image.fromarray(np.asarray(image)) if not isinstance(image, Image.Image) else image.convert("RGB").copy()
    draw = ImageDraw.Draw(im)
    line = max(2, round(min(im.size) / 200))
    if box:
        draw.rectangle(box, outline=(0, 200, 0), width=line)
    if point:
        x, y = point
        r = max(6, round(min(im.size) / 40))
        draw.line([(x - 2 * r, y), (x + 2 * r, y)], fill=(255, 255, 255), width=line)
        draw.line([(x, y - 2 * r), (x, y + 2 * r)], fill=(255, 255, 255), width=line)
        draw.ellipse([x - r, y - r, x + r, y + r], outline=(255, 0, 0), width=line)
        d = max(2, r // 3)
        draw.ellipse([x - d, y - d, x + d, y + d], fill=(255, 0, 0), outline=(255, 255, 255))
    if note:
        try:
            font = ImageFont.load_default(size=max(9, min(28, im.height // 24)))
        except (TypeError, OSError, ImportError):  # Pillow < 10.1 or no FreeType: the fixed bitmap font
            font = ImageFont.load_default()
        room = im.width - 4 * line
        rows = [""]  # the note's words wrapped to the width
        for word in note.split():
            wider = f"{rows[-1]} {word}".strip()
            if rows[-1] and font.getlength(wider) > room:
                rows.append(word)
            else:
                rows[-1] = wider
        text = "\n".join(rows)
        left, top, right, bottom = draw.multiline_textbbox((2 * line, line), text, font=font)
        draw.rectangle([0, 0, im.width - 1, bottom + line], fill=(200, 0, 0))
        draw.multiline_text((2 * line, line), text, fill=(255, 255, 255), font=font)
        draw.rectangle([0, 0, im.width - 1, im.height - 1], outline=(200, 0, 0), width=line)
    if path is not None:
        im.save(path, format="PNG")
    return im


def missing_point_note(status: str) -> Optional[str]:
    """What an annotated picture says when the answer gave no point (None when it gave one)."""
    return {"refused": "no point: the model says the target is absent",
            "malformed": "no point found: the answer could not be read"}.get(status)


__all__ = ["ground", "navigate", "annotate", "missing_point_note", "parse_point", "parse_grounding", "parse_action",
           "to_pixel", "without_reasoning",
           "grounding_prompt", "grounding_messages", "navigation_prompt", "navigation_messages",
           "computer_use_messages", "computer_use_system_prompt", "computer_use_tool", "Action", "Step",
           "Grounding", "GroundingResult", "VENUS_NAVIGATION_SAMPLING", "GROUNDING_FORMATS"]
