"""Computer use on Qwen3-VL / UI-Venus: the trained prompt a request that declares a computer-use
tool is rendered with, and the model's answer mapped to the tool's actions (computer_tools.py has
the protocols' side). Nothing here needs the server.

    tool = find_computer_tool(body["tools"])               # ComputerTool, or None: no computer tool
    display = tool.display_size(screenshot_size)           # declared, else the screenshot's pixels
    messages = computer_messages(task, screenshot, history, format="qwen", display=display)
    turn = map_answer(generate(model, processor, messages=messages).text, display, tool=tool)
    turn.calls    # Anthropic {"name", "input"} dicts / OpenAI action dicts; none: answer turn.text

**Formats** (`agent_format`): "qwen" renders Qwen3-VL's computer-use prompt (the cookbook's
`computer_use` function on a 1000x1000 screen; earlier steps as assistant tool calls and tool
turns carrying the screenshots), "venus" UI-Venus-1.5's navigation prompt (web by default; earlier
steps as its text history, only the current screenshot). Both model families share a model type,
so the caller picks. Answers in either syntax are read whatever the format.

**One table per model family** (QWEN_ACTIONS, VENUS_TABLE) holds every action of its action space,
each mapped to neutral ComputerActions, a message to the user, the end of the task, or the reason
it has no equivalent. An answer naming any action that maps to nothing, or that the declared tool
cannot express, comes back as text (status "unmapped"), never as a made-up action.

**Coordinates.** The model answers 0-1000 relative to the screenshot it sees; the screenshot is
taken to show the whole display, so a relative answer lands on the same relative point of the
display: pixel = floor(v / 1000 * display size) per axis (`parse.to_pixel`), whatever the
screenshot's own size or aspect. Earlier steps are written back with `parse.to_relative`.

**Units.** A Qwen `scroll` / `hscroll` gives `pixels`, the count its trained executor
(pyautogui.scroll) takes: wheel clicks, positive up (hscroll: right). UI-Venus scrolls carry no
amount: VENUS_SCROLL_CLICKS. Qwen's triple_click is "simulated as double-click" in its own prompt,
so a tool without triple click (OpenAI) gets a double click.
"""

import json
import math
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple

from ..errors import InputError
from ..media import load_image
from .computer_tools import (CLICK_ACTIONS, DIRECTIONS, WAIT_SECONDS, ComputerAction, ComputerTool, check_display,
                             parse_keys)
from .parse import SCALE, VENUS_ACTIONS, parse_action, read_answer, reasoning_of, to_relative, without_reasoning
from .prompts import (COMPUTER_USE_ACTIONS, VENUS_HISTORY_LENGTH, VENUS_NAVIGATION_SAMPLING, Step,
                      computer_use_system_prompt, navigation_messages)

AGENT_FORMATS = ("qwen", "venus")
DEFAULT_AGENT_FORMAT = "qwen"
# What each format samples with unless the request says otherwise: UI-Venus' runner settings;
# greedy for Qwen (its cookbook sets nothing else).
AGENT_SAMPLING = {"qwen": {"temperature": 0.0}, "venus": dict(VENUS_NAVIGATION_SAMPLING)}
QWEN_HISTORY_LENGTH = 4  # earlier steps (each with its screenshot) a qwen-format prompt replays
VENUS_SCROLL_CLICKS = 5


# ---------------------------------------------------------------------------------------------
# The model families' action tables: answer Action (pixels) → neutral actions, a message, the end
# of the task, or the reason it has no equivalent (a str)
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Say:
    """The model talks to the user (Qwen `answer`, UI-Venus CallUser / Answer)."""

    text: str


@dataclass(frozen=True)
class _Done:
    """The model ends the task (Qwen `terminate`, UI-Venus Finished)."""

    text: str = ""
    outcome: Optional[str] = None


def _at(args, *keys):
    return next((args[k] for k in keys if isinstance(args.get(k), tuple)), None)


def _pointed(kind, button="left", required=False, keys=("coordinate",)):
    def entry(args, cursor):
        point = _at(args, *keys)
        if point is None and required:
            return "gives no coordinate"
        return [ComputerAction(kind, point=point, button=button if kind == "click" else "left")]
    return entry


def _qwen_key(args, cursor):
    keys = parse_keys(args.get("keys"))
    return [ComputerAction("key", keys=keys)] if keys else "gives no keys"


def _qwen_type(args, cursor):
    text = args.get("text")
    return [ComputerAction("type", text=text)] if isinstance(text, str) else "gives no text"


def _qwen_drag(args, cursor):
    end = _at(args, "coordinate")
    if end is None:
        return "gives no coordinate"
    if cursor is not None:  # dragged from where the pointer is
        return [ComputerAction("drag", point=tuple(cursor), end=end)]
    return [ComputerAction("mouse_down"), ComputerAction("mouse_move", point=end), ComputerAction("mouse_up")]


def _qwen_scroll(horizontal):
    def entry(args, cursor):
        pixels = args.get("pixels")
        if isinstance(pixels, bool) or not isinstance(pixels, (int, float)) or not math.isfinite(pixels) or pixels == 0:
            return "gives no scroll amount"
        # Qwen: positive scrolls up (and hscroll right), as pyautogui.scroll / hscroll take it
        direction = ("right" if pixels > 0 else "left") if horizontal else ("up" if pixels > 0 else "down")
        amount = max(1, round(abs(pixels)))
        return [ComputerAction("scroll", point=_at(args, "coordinate"), direction=direction, amount=amount)]
    return entry


def _qwen_wait(args, cursor):
    t = args.get("time", WAIT_SECONDS)
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
        return "gives no valid time"
    return [ComputerAction("wait", seconds=float(t))]


def _qwen_terminate(args, cursor):
    status = args.get("status")
    return _Done(outcome=status if status in ("success", "failure") else None)


def _qwen_answer(args, cursor):
    text = args.get("text")
    return _Say(text) if isinstance(text, str) else "gives no text"


# Qwen3-VL computer_use (prompts.COMPUTER_USE_ACTIONS), every action.
QWEN_ACTIONS = {
    "key": _qwen_key,
    "type": _qwen_type,
    "mouse_move": _pointed("mouse_move", required=True),
    "left_click": _pointed("click"),
    "left_click_drag": _qwen_drag,
    "right_click": _pointed("click", "right"),
    "middle_click": _pointed("click", "middle"),
    "double_click": _pointed("double_click"),
    "triple_click": _pointed("triple_click"),
    "scroll": _qwen_scroll(False),
    "hscroll": _qwen_scroll(True),
    "wait": _qwen_wait,
    "terminate": _qwen_terminate,
    "answer": _qwen_answer,
}
assert set(QWEN_ACTIONS) == set(COMPUTER_USE_ACTIONS)


def _no_equivalent(why):
    return lambda args, cursor: why


def _venus_scroll(args, cursor):
    direction = str(args.get("direction", "")).strip().lower() or None
    start, end = _at(args, "start", "box", "point"), _at(args, "end")
    if direction is None and start is not None and end is not None:
        # a swipe: as a touch screen scrolls, the content moves against the finger
        dx, dy = end[0] - start[0], end[1] - start[1]
        if dx or dy:
            direction = ("down" if dy < 0 else "up") if abs(dy) >= abs(dx) else ("right" if dx < 0 else "left")
    if direction not in DIRECTIONS:
        return "gives no scroll direction"
    return [ComputerAction("scroll", point=start, direction=direction, amount=VENUS_SCROLL_CLICKS)]


def _venus_drag(args, cursor):
    start, end = _at(args, "start"), _at(args, "end")
    if start is None or end is None:
        return "needs a start and an end"
    return [ComputerAction("drag", point=start, end=end)]


def _venus_type(args, cursor):
    text = args.get("content", args.get("text"))
    return [ComputerAction("type", text=text)] if isinstance(text, str) else "gives no content"


def _venus_hotkey(args, cursor):
    keys = parse_keys(args.get("keys", args.get("key")))
    return [ComputerAction("key", keys=keys)] if keys else "gives no keys"


def _venus_content(cls):
    def entry(args, cursor):
        text = args.get("content", args.get("text", ""))
        return cls(text if isinstance(text, str) else str(text))
    return entry


def _venus_mouse(kind):
    def entry(args, cursor):
        point = _at(args, "box", "point")
        return ([ComputerAction("mouse_move", point=point)] if point else []) + [ComputerAction(kind)]
    return entry


_BOX = ("box", "point")
# UI-Venus (parse.VENUS_ACTIONS: the 1.5 mobile / web grammar and the 2.x additions), every action.
VENUS_TABLE = {
    "Click": _pointed("click", required=True, keys=_BOX),
    "DoubleClick": _pointed("double_click", required=True, keys=_BOX),
    "TripleClick": _pointed("triple_click", required=True, keys=_BOX),
    "RightClick": _pointed("click", "right", required=True, keys=_BOX),
    "MiddleClick": _pointed("click", "middle", required=True, keys=_BOX),
    "LongPress": _no_equivalent("is a touch gesture with no computer-use equivalent"),
    "Hover": _pointed("mouse_move", required=True, keys=_BOX),
    "Drag": _venus_drag,
    "Scroll": _venus_scroll,
    "Swipe": _venus_scroll,
    "Type": _venus_type,
    "Hotkey": _venus_hotkey,
    "Launch": _no_equivalent("opens an app or URL, which the computer-use tools cannot"),
    "LaunchApp": _no_equivalent("opens an app, which the computer-use tools cannot"),
    "Wait": lambda args, cursor: [ComputerAction("wait", seconds=WAIT_SECONDS)],
    "Finished": _venus_content(_Done),
    "CallUser": _venus_content(_Say),
    "Answer": _venus_content(_Say),
    "PressBack": _no_equivalent("is a phone button with no computer-use equivalent"),
    "PressHome": _no_equivalent("is a phone button with no computer-use equivalent"),
    "PressEnter": lambda args, cursor: [ComputerAction("key", keys=("enter",))],
    "PressRecent": _no_equivalent("is a phone button with no computer-use equivalent"),
    "GetScreenshot": lambda args, cursor: [ComputerAction("screenshot")],
    "KeyDown": _no_equivalent("holds a key with no duration, which the computer-use tools cannot"),
    "KeyUp": _no_equivalent("releases a held key, which the computer-use tools cannot"),
    "MouseDown": _venus_mouse("mouse_down"),
    "MouseUp": _venus_mouse("mouse_up"),
}
assert set(VENUS_TABLE) == set(VENUS_ACTIONS.values())


# ---------------------------------------------------------------------------------------------
# An answer → the turn the protocol returns
# ---------------------------------------------------------------------------------------------
@dataclass
class ComputerTurn:
    """What one model answer becomes in a computer-use conversation.

    status: "action" (`actions` to carry out; `calls` is their protocol form when a tool was
    given), "message" (the model talks: its answer, CallUser, or plain text), "done" (it ended the
    task: Qwen terminate, UI-Venus Finished; `outcome` "success" / "failure" where it said) or
    "unmapped" (it named an action with no equivalent, or one the tool cannot express: `reason`
    says which; `text` is then the whole visible answer). text: what the user reads ("" when
    nothing: a bare action). reasoning: the <think> text (Anthropic thinking blocks, Responses
    reasoning items), None without one. answer: the model's raw text."""

    answer: str
    status: str
    text: str = ""
    reasoning: Optional[str] = None
    actions: List[ComputerAction] = field(default_factory=list)
    calls: List[dict] = field(default_factory=list)
    outcome: Optional[str] = None
    reason: Optional[str] = None

    def to_dict(self) -> dict:
        return {"status": self.status, "text": self.text, "reasoning": self.reasoning,
                "actions": [a.to_dict() for a in self.actions], "calls": self.calls, "outcome": self.outcome,
                "reason": self.reason, "answer": self.answer}


def _join(*parts) -> str:
    out = []
    for p in parts:
        p = (p or "").strip()
        if p and not any(p in q for q in out):
            out.append(p)
    return "\n".join(out)


def map_answer(answer: str, display, *, tool: Optional[ComputerTool] = None, cursor=None) -> ComputerTurn:
    """A model answer → ComputerTurn with its actions in pixels of `display` (width, height).

    The answer is read by parse.read_answer, the parser grounding shares: Qwen tool calls (each
    `<tool_call>` of the answer, in order) go through QWEN_ACTIONS, a UI-Venus action (a box
    argument as its centre) through VENUS_TABLE, and an answer in a grounding shape ([x, y], a box,
    bbox_2d / point_2d JSON, <point> / <bbox>) is a click at its point; other text (a refusal
    included) is a message. With `tool`, every action must
    be one the tool offers (else the turn is "unmapped") and `calls` holds their protocol form.
    `cursor`: the pointer's last known position (the previous action's), which a Qwen drag starts
    from and an OpenAI scroll without a position acts at."""
    if not isinstance(answer, str):
        raise InputError("the answer must be a string")
    width, height = check_display(display)
    read = read_answer(answer, width, height)
    if read.status == "unreadable":
        return ComputerTurn(answer, "unmapped", read.text, read.reasoning, reason=read.problem)
    if read.status == "text":
        return ComputerTurn(answer, "message", read.text, read.reasoning)
    parsed, text, reasoning = read.actions, read.text, read.reasoning
    table, label = (QWEN_ACTIONS, "computer_use action") if parsed[0].tool else (VENUS_TABLE, "UI-Venus action")
    body = without_reasoning(answer).strip()

    def unmapped(reason):
        return ComputerTurn(answer, "unmapped", body, reasoning, reason=reason)

    turn = ComputerTurn(answer, "message", text, reasoning)
    position = tuple(cursor) if cursor is not None else None
    for a in parsed:
        entry = table.get(a.name)
        if entry is None:
            return unmapped(f"{a.name!r} is not a {label}")
        mapped = entry(a.args, position)
        if isinstance(mapped, str):
            return unmapped(f"{a.name} {mapped}")
        if isinstance(mapped, _Say):
            turn.text = _join(turn.text, mapped.text)
        elif isinstance(mapped, _Done):
            turn.text, turn.outcome = _join(turn.text, mapped.text), mapped.outcome
            turn.status = "done"
        else:
            for action in mapped:
                if tool is not None:
                    call = tool.render(action, (width, height), position)
                    if call is None:
                        return unmapped(f"{a.name} needs {action.type!r}, which the {tool.type} tool does not offer")
                    turn.calls.append(call)
                turn.actions.append(action)
                position = cursor_after([action], position)
    if turn.actions:
        turn.status = "action"
    return turn


def cursor_after(actions: Sequence[ComputerAction], cursor=None):
    """Where the pointer is after `actions` (starting at `cursor`): the last position one acted at."""
    for a in actions:
        if a.point is not None:
            cursor = a.end or a.point
    return cursor


# ---------------------------------------------------------------------------------------------
# Earlier steps and the prompt
# ---------------------------------------------------------------------------------------------
@dataclass
class ComputerStep:
    """One earlier step of a computer-use conversation, as the prompt replays it.

    screenshot: the screen the step was decided on (any image source generate takes; None when not
    kept). answer: the model's own answer text for the step, where the caller kept it (a server
    that stored its response); otherwise the step is written from `actions` (display pixels, as
    parsed back from the protocol's calls with ComputerTool.parse_call), `text` and `reasoning`.
    display: the (width, height) those pixels refer to (default: computer_messages' display).
    result: text the step's tool result carried beside the next screenshot (an Anthropic
    tool_result's text, a tool message's text): the qwen format shows it in the tool turn after the
    screenshot; UI-Venus' navigation prompt has no place for it."""

    screenshot: Any = None
    answer: Optional[str] = None
    actions: Sequence[ComputerAction] = ()
    text: Optional[str] = None
    reasoning: Optional[str] = None
    display: Optional[Tuple[int, int]] = None
    result: Optional[str] = None


def _rel(point, display):
    return [to_relative(point[0], display[0]), to_relative(point[1], display[1])]


def _collapse_drags(actions):
    """mouse_down, mouse_move(p), mouse_up (how a Qwen drag without a start is carried out) → one
    drag to p with no start, as the model wrote it."""
    out, i = [], 0
    while i < len(actions):
        a = actions[i:i + 3]
        if [x.type for x in a] == ["mouse_down", "mouse_move", "mouse_up"]:
            out.append(ComputerAction("drag", point=None, end=a[1].point))
            i += 3
            continue
        out.append(actions[i])
        i += 1
    return out


def _qwen_call(a: ComputerAction, display) -> Optional[dict]:
    if a.type == "click":
        args = {"action": CLICK_ACTIONS[a.button]}
    elif a.type in ("double_click", "triple_click", "mouse_move"):
        args = {"action": a.type}
    elif a.type == "drag":
        return {"action": "left_click_drag", "coordinate": _rel(a.end, display)}
    elif a.type == "scroll":
        horizontal = a.direction in ("left", "right")
        sign = 1 if a.direction in ("up", "right") else -1
        args = {"action": "hscroll" if horizontal else "scroll", "pixels": sign * a.amount}
    elif a.type == "type":
        return {"action": "type", "text": a.text}
    elif a.type == "key":
        return {"action": "key", "keys": list(a.keys)}
    elif a.type == "wait":
        return {"action": "wait", "time": int(a.seconds) if float(a.seconds).is_integer() else a.seconds}
    else:
        return None  # screenshot, mouse_down / mouse_up: not in Qwen's action space
    if a.point is not None:
        args["coordinate"] = _rel(a.point, display)
    return args


def _venus_call(a: ComputerAction, display) -> Optional[str]:
    box = lambda p: "({}, {})".format(*_rel(p, display))  # noqa: E731
    names = {("click", "left"): "Click", ("click", "right"): "RightClick", ("click", "middle"): "MiddleClick",
             ("double_click", "left"): "DoubleClick", ("triple_click", "left"): "TripleClick"}
    if a.type in ("click", "double_click", "triple_click") and a.point is not None:
        return f"{names[a.type, a.button]}(box={box(a.point)})"
    if a.type == "mouse_move":
        return f"Hover(box={box(a.point)})"
    if a.type == "drag" and a.point is not None:
        return f"Drag(start={box(a.point)}, end={box(a.end)})"
    if a.type == "scroll":
        start = f"start={box(a.point)}, " if a.point is not None else ""
        return f"Scroll({start}direction={a.direction!r})"
    if a.type == "type":
        return f"Type(content={a.text!r})"
    if a.type == "key":
        return "PressEnter()" if a.keys == ("enter",) else f"Hotkey(keys={list(a.keys)!r})"
    if a.type == "wait":
        return "Wait()"
    if a.type == "screenshot":
        return "GetScreenshot()"
    if a.type in ("mouse_down", "mouse_up"):
        return "MouseDown()" if a.type == "mouse_down" else "MouseUp()"
    return None


def _qwen_answer_text(step: ComputerStep, display) -> str:
    if step.answer is not None:
        return step.answer
    calls = [_qwen_call(a, display) for a in _collapse_drags(list(step.actions))]
    blocks = ["<tool_call>\n" + json.dumps({"name": "computer_use", "arguments": c}, ensure_ascii=False)
              + "\n</tool_call>" for c in calls if c is not None]
    return "\n".join(([step.text.strip()] if step.text and step.text.strip() else []) + blocks)


def _venus_steps(step: ComputerStep, display) -> List[Step]:
    if step.answer is not None:
        a = parse_action(step.answer, SCALE, SCALE)  # only its text is kept
        if a is not None and a.tool is None:
            return [Step(a.think, a.action_text)]
        return [Step(reasoning_of(step.answer), without_reasoning(step.answer).strip())]
    calls = [c for c in (_venus_call(a, display) for a in step.actions) if c is not None]
    if not calls and step.text:
        calls = [f"CallUser(content={step.text.strip()!r})"]
    return [Step(step.reasoning if i == 0 else None, c) for i, c in enumerate(calls)]


def _image(source):
    return {"type": "image", "image": source}


def computer_messages(task: str, screenshot, history: Sequence[ComputerStep] = (), *,
                      format: str = DEFAULT_AGENT_FORMAT, display=None, kind: str = "web",
                      history_length: Optional[int] = None, system: Optional[str] = None) -> list:
    """The trained prompt for the next step of `task` on `screenshot`, after `history`.

    qwen: the computer-use system prompt (`system` before its tool block, default Qwen's "You are a
    helpful assistant."), then the user turn (the first replayed step's screenshot, or the current
    one, then the task), each replayed step as an assistant tool call followed by a tool turn with
    the next screenshot (and the step's `result` text); the last `history_length`
    (QWEN_HISTORY_LENGTH) steps are replayed, and a step with neither has no tool turn. With no history this is computer_use_messages.
    venus: navigation_messages(screenshot, task, steps, kind) with the last `history_length`
    (VENUS_HISTORY_LENGTH) steps as its text history (`system` replaces its system line).
    display: the (width, height) the steps' actions are in (default: the current screenshot's)."""
    if format not in AGENT_FORMATS:
        raise InputError(f"unknown agent format {format!r}; use {' or '.join(AGENT_FORMATS)}")
    if not isinstance(task, str):
        raise InputError("the task must be a string")
    steps = list(history)
    if display is None and any(s.answer is None and s.actions and s.display is None for s in steps):
        h, w = load_image(screenshot, "screenshot").shape[:2]
        display = (w, h)
    if format == "venus":
        n = VENUS_HISTORY_LENGTH if history_length is None else history_length
        venus = [s for step in steps for s in _venus_steps(step, step.display or display)]
        messages = navigation_messages(screenshot, task, venus, kind, n)
        if system is not None:
            messages[0] = {"role": "system", "content": system}
        return messages
    n = QWEN_HISTORY_LENGTH if history_length is None else history_length
    steps = steps[-n:] if n > 0 else []
    prompt = computer_use_system_prompt() if system is None else computer_use_system_prompt(system)
    messages = [{"role": "system", "content": prompt}]
    first = steps[0].screenshot if steps else screenshot
    messages.append({"role": "user", "content": ([_image(first)] if first is not None else [])
                     + [{"type": "text", "text": task}]})
    for i, step in enumerate(steps):
        messages.append({"role": "assistant", "content": _qwen_answer_text(step, step.display or display)})
        following = steps[i + 1].screenshot if i + 1 < len(steps) else screenshot
        result = [{"type": "text", "text": step.result}] if step.result else []
        if following is not None or result:
            messages.append({"role": "tool", "content": ([_image(following)] if following is not None else [])
                             + result})
    return messages


__all__ = ["AGENT_FORMATS", "DEFAULT_AGENT_FORMAT", "AGENT_SAMPLING", "QWEN_HISTORY_LENGTH", "VENUS_SCROLL_CLICKS",
           "QWEN_ACTIONS", "VENUS_TABLE", "ComputerTurn", "ComputerStep", "map_answer", "computer_messages",
           "cursor_after", "reasoning_of"]
