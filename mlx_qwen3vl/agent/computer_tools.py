"""The computer-use tools of the Anthropic and OpenAI protocols, and the one neutral action between
them and the models (`ComputerAction`, in display pixels).

Declarations (`computer_tool`, `find_computer_tool`), in the versions today's SDKs send: Anthropic
`computer_20250124` / `computer_20251124` (beta; `display_width_px`, `display_height_px`, a tool
`name`; 20251124 adds `zoom` with `enable_zoom`) and `computer_toolset_20260801` (no display size
and no name: its calls are named by member, `left_click`, `triple_click`, `hold_key`, `zoom`, ...,
with toolset_name "computer"; `configs.<member>.enabled: false` withholds a member); OpenAI
`computer_use_preview` (`display_width`, `display_height`, `environment`; one `action` per
computer_call) and `computer` (no display size; batched `actions`). Where a tool declares no
display size, coordinates are in the last screenshot's pixels (`ComputerTool.display_size`).

`ComputerTool.render` writes a neutral action in the tool's vocabulary (None where the tool has no
such action: OpenAI has no mouse down / up, a toolset may withhold a member); `parse_call` reads an
earlier call back (for replaying a conversation's steps).

**Units.** Scroll amounts are wheel clicks (Anthropic's `scroll_amount`); OpenAI's scroll distances
are SCROLL_CLICK_PIXELS per click. Waits are seconds (Anthropic's whole `duration`, rounded up;
WAIT_SECONDS where none is given). Keys are canonical lower-case names (`ctrl`, `alt`, `shift`,
`cmd`, `enter`, `esc`, `tab`, `space`, `backspace`, `delete`, `up`, `pagedown`, `f5`, or one
character), written in each protocol's spelling (Anthropic: xdotool names joined by "+"; OpenAI:
the names its sample executors map, `arrowup`, `enter`, `ctrl`, ...).
"""

import math
import re
from dataclasses import dataclass
from typing import List, Optional, Tuple

from ..errors import InputError

ACTION_TYPES = ("click", "double_click", "triple_click", "mouse_move", "drag", "mouse_down", "mouse_up", "scroll",
                "type", "key", "wait", "screenshot")
BUTTONS = ("left", "right", "middle")
DIRECTIONS = ("up", "down", "left", "right")
SCROLL_CLICK_PIXELS = 100  # one wheel click as a browser scrolls it
WAIT_SECONDS = 1.0
MAX_DISPLAY = 32768  # pixels per axis a display may have


# ---------------------------------------------------------------------------------------------
# The neutral action
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ComputerAction:
    """One desktop action, coordinates in display pixels.

    type: one of ACTION_TYPES. point: where it acts (click, double_click, triple_click: optional,
    the cursor's position when None; mouse_move: required; scroll: optional; drag: the start).
    end: a drag's end. button: a click's, left / right / middle. text: what `type` types.
    keys: what `key` presses together (canonical names). direction / amount: a scroll's, up /
    down / left / right and wheel clicks. seconds: a wait's."""

    type: str
    point: Optional[Tuple[int, int]] = None
    end: Optional[Tuple[int, int]] = None
    button: str = "left"
    text: Optional[str] = None
    keys: Tuple[str, ...] = ()
    direction: Optional[str] = None
    amount: Optional[int] = None
    seconds: Optional[float] = None

    def to_dict(self) -> dict:
        """JSON-ready, with only the fields this type uses."""
        out = {"type": self.type}
        if self.point is not None:
            out["point"] = list(self.point)
        if self.type == "click":
            out["button"] = self.button
        if self.type == "drag":
            out["end"] = list(self.end)
        if self.type == "type":
            out["text"] = self.text
        if self.type == "key":
            out["keys"] = list(self.keys)
        if self.type == "scroll":
            out["direction"], out["amount"] = self.direction, self.amount
        if self.type == "wait":
            out["seconds"] = self.seconds
        return out


def check_display(display) -> Tuple[int, int]:
    """(width, height) as positive integers up to MAX_DISPLAY each, else InputError."""
    ok = isinstance(display, (tuple, list)) and len(display) == 2 and all(
        isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_DISPLAY for v in display)
    if not ok:
        raise InputError(f"a display size is (width, height), integers from 1 to {MAX_DISPLAY}; got {display!r}")
    return int(display[0]), int(display[1])


# ---------------------------------------------------------------------------------------------
# Keys: canonical names, and each protocol's spelling
# ---------------------------------------------------------------------------------------------
_KEY_ALIASES = {
    "control": "ctrl", "ctl": "ctrl", "lctrl": "ctrl", "rctrl": "ctrl", "control_l": "ctrl", "control_r": "ctrl",
    "option": "alt", "opt": "alt", "alt_l": "alt", "alt_r": "alt", "shift_l": "shift", "shift_r": "shift",
    "command": "cmd", "meta": "cmd", "super": "cmd", "super_l": "cmd", "win": "cmd", "windows": "cmd",
    "return": "enter", "kp_enter": "enter", "escape": "esc", "spacebar": "space", " ": "space",
    "back_space": "backspace", "bksp": "backspace", "del": "delete", "ins": "insert",
    "pgup": "pageup", "page_up": "pageup", "prior": "pageup", "pgdn": "pagedown", "page_down": "pagedown",
    "next": "pagedown", "arrowup": "up", "arrowdown": "down", "arrowleft": "left", "arrowright": "right",
    "caps_lock": "capslock", "plus": "+", "minus": "-",
}
_XDOTOOL = {"cmd": "super", "enter": "Return", "esc": "Escape", "tab": "Tab", "backspace": "BackSpace",
            "delete": "Delete", "insert": "Insert", "home": "Home", "end": "End", "pageup": "Page_Up",
            "pagedown": "Page_Down", "up": "Up", "down": "Down", "left": "Left", "right": "Right",
            "capslock": "Caps_Lock", "+": "plus"}
_OPENAI_KEYS = {"up": "arrowup", "down": "arrowdown", "left": "arrowleft", "right": "arrowright"}


def canonical_key(name: str) -> str:
    """A key name in any spelling (pyautogui, xdotool, OpenAI's) → its canonical name."""
    if len(name) == 1:
        return name if name != " " else "space"
    low = name.strip().lower()
    if re.fullmatch(r"f\d{1,2}", low):
        return low
    return _KEY_ALIASES.get(low, low)


def parse_keys(value) -> Optional[Tuple[str, ...]]:
    """A model's keys (a list of names, or one "ctrl+c" string) → canonical names; None if none."""
    if isinstance(value, str):
        value = _split_combo(value)
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(k, str) and k for k in value):
        return None
    return tuple(canonical_key(k) for k in value)


def _split_combo(text: str) -> List[str]:
    """"ctrl+shift+t" → its keys ("ctrl++" ends with the + key itself)."""
    parts = text.split("+")
    keys = [p for p in parts if p]
    if text.endswith("+") and len(parts) > 1:
        keys.append("+")
    return keys if keys else [text]


def _xdotool(keys) -> str:
    return "+".join(_XDOTOOL.get(k, k.upper() if re.fullmatch(r"f\d{1,2}", k) else k) for k in keys)


# ---------------------------------------------------------------------------------------------
# Tool declarations
# ---------------------------------------------------------------------------------------------
ANTHROPIC_ACTIONS = ("key", "hold_key", "type", "cursor_position", "mouse_move", "left_mouse_down", "left_mouse_up",
                     "left_click", "left_click_drag", "right_click", "middle_click", "double_click", "triple_click",
                     "scroll", "wait", "screenshot")  # computer_20250124; 20251124 adds zoom (enable_zoom)
ANTHROPIC_TOOLSET_MEMBERS = ANTHROPIC_ACTIONS + ("zoom",)  # computer_toolset_20260801, every one enabled by default
ANTHROPIC_TYPES = ("computer_20250124", "computer_20251124", "computer_toolset_20260801")
OPENAI_TYPES = ("computer_use_preview", "computer")
OPENAI_ENVIRONMENTS = ("windows", "mac", "linux", "ubuntu", "browser")
OPENAI_ACTIONS = ("click", "double_click", "drag", "keypress", "move", "screenshot", "scroll", "type", "wait")
_ANTHROPIC_NAME = {"mouse_move": "mouse_move", "drag": "left_click_drag", "mouse_down": "left_mouse_down",
                   "mouse_up": "left_mouse_up", "double_click": "double_click", "triple_click": "triple_click",
                   "scroll": "scroll", "type": "type", "key": "key", "wait": "wait", "screenshot": "screenshot"}
CLICK_ACTIONS = {"left": "left_click", "right": "right_click", "middle": "middle_click"}
_OPENAI_BUTTON = {"left": "left", "right": "right", "middle": "wheel"}


def _display_field(tool: dict, key: str, where: str) -> int:
    value = tool.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_DISPLAY:
        raise InputError(f"{where}.{key} must be an integer from 1 to {MAX_DISPLAY}; got {value!r}")
    return value


@dataclass(frozen=True)
class ComputerTool:
    """A declared computer-use tool.

    protocol: "anthropic" or "openai". type: the declaration's type. name: the name its calls
    carry (Anthropic: the tool's `name`, "computer"; the toolset's calls are named by member and
    carry toolset_name "computer"). display: the declared (width, height), None where the
    declaration has none (coordinates are then the screenshot's pixels). actions: what the tool
    offers in the protocol's vocabulary (a toolset without its disabled members). environment:
    OpenAI's. batched: OpenAI `computer` (one computer_call with `actions`; `computer_use_preview`
    has one `action` per call)."""

    protocol: str
    type: str
    name: str
    display: Optional[Tuple[int, int]]
    actions: frozenset
    environment: Optional[str] = None
    batched: bool = False

    @property
    def toolset(self) -> bool:
        return self.type == "computer_toolset_20260801"

    def display_size(self, screenshot_size: Tuple[int, int]) -> Tuple[int, int]:
        """The (width, height) coordinates refer to: the declared display, else the screenshot's."""
        return self.display or (int(screenshot_size[0]), int(screenshot_size[1]))

    # -- neutral → protocol
    def render(self, action: ComputerAction, display: Tuple[int, int], cursor=None) -> Optional[dict]:
        """The protocol's form of `action`: Anthropic {"name", "input"} (plus "toolset_name" for
        the toolset), OpenAI an action dict ({"type": "click", "button", "x", "y"}, ...); None
        when this tool cannot express it. `cursor`: the pointer's position if known (OpenAI's
        actions need a position where the model gave none: a scroll then acts at the cursor, or
        at the display's centre)."""
        if self.protocol == "anthropic":
            return self._anthropic(action)
        return self._openai(action, display, cursor)

    def _anthropic(self, a: ComputerAction) -> Optional[dict]:
        name = CLICK_ACTIONS[a.button] if a.type == "click" else _ANTHROPIC_NAME.get(a.type)
        if name is None or name not in self.actions:
            return None
        fields = {}
        if a.type == "drag":
            fields = {"start_coordinate": list(a.point), "coordinate": list(a.end)}
        elif a.type == "mouse_move" and a.point is None:
            return None
        elif a.point is not None:
            fields["coordinate"] = list(a.point)
        if a.type == "scroll":
            fields.update(scroll_direction=a.direction, scroll_amount=a.amount)
        elif a.type == "type":
            fields["text"] = a.text
        elif a.type == "key":
            fields["text"] = _xdotool(a.keys)
        elif a.type == "wait":
            fields["duration"] = max(1, math.ceil(a.seconds))
        if self.toolset:
            return {"name": name, "toolset_name": "computer", "input": fields}
        return {"name": self.name, "input": {"action": name, **fields}}

    def _openai(self, a: ComputerAction, display, cursor) -> Optional[dict]:
        at = a.point or cursor
        xy = {"x": at[0], "y": at[1]} if at else None
        if a.type in ("click", "double_click", "triple_click", "mouse_move") and xy is None:
            return None
        if a.type == "click":
            return {"type": "click", "button": _OPENAI_BUTTON[a.button], **xy}
        if a.type in ("double_click", "triple_click"):  # Qwen's own definition: triple is simulated as double
            return {"type": "double_click", **xy}
        if a.type == "mouse_move":
            return {"type": "move", **xy}
        if a.type == "drag":
            return {"type": "drag", "path": [{"x": a.point[0], "y": a.point[1]}, {"x": a.end[0], "y": a.end[1]}]}
        if a.type == "scroll":
            xy = xy or {"x": display[0] // 2, "y": display[1] // 2}
            step = a.amount * SCROLL_CLICK_PIXELS
            dx = {"left": -step, "right": step}.get(a.direction, 0)
            dy = {"up": -step, "down": step}.get(a.direction, 0)
            return {"type": "scroll", **xy, "scroll_x": dx, "scroll_y": dy}
        if a.type == "type":
            return {"type": "type", "text": a.text}
        if a.type == "key":
            return {"type": "keypress", "keys": [_OPENAI_KEYS.get(k, k) for k in a.keys]}
        if a.type in ("wait", "screenshot"):
            return {"type": a.type}
        return None  # mouse_down / mouse_up: OpenAI's computer tools have neither

    # -- protocol → neutral (for replaying a conversation's earlier steps)
    def parse_call(self, call: dict, where: str = "call") -> Optional[ComputerAction]:
        """An earlier call of this tool → ComputerAction: Anthropic a tool_use block's
        {"name", "input"}, OpenAI an action dict. None for an action outside the neutral
        vocabulary (zoom, cursor_position, hold_key, a back / forward click); InputError (naming
        `where`) for a malformed one."""
        if not isinstance(call, dict):
            raise InputError(f"{where} must be an object")
        if self.protocol == "anthropic":
            payload = call.get("input")
            if not isinstance(payload, dict):
                raise InputError(f"{where}.input must be an object")
            name = call.get("name") if self.toolset else payload.get("action")
            return _from_anthropic(name, payload, where)
        return _from_openai(call, where)


def computer_tool(declaration, where: str = "tool") -> Optional[ComputerTool]:
    """A tool declaration (a request's `tools` entry, as a dict) → ComputerTool; None for any
    other tool. InputError (naming `where`) for a computer tool declared wrong: a display size
    that is not an integer in 1..MAX_DISPLAY, an unknown environment or toolset member."""
    if not isinstance(declaration, dict):
        return None
    kind = declaration.get("type")
    if kind in ("computer_20250124", "computer_20251124"):
        display = (_display_field(declaration, "display_width_px", where),
                   _display_field(declaration, "display_height_px", where))
        actions = ANTHROPIC_ACTIONS + (("zoom",) if kind == "computer_20251124" and
                                       declaration.get("enable_zoom") is True else ())
        name = declaration.get("name", "computer")
        if not isinstance(name, str) or not name:
            raise InputError(f"{where}.name must be a non-empty string")
        return ComputerTool("anthropic", kind, name, display, frozenset(actions))
    if kind == "computer_toolset_20260801":
        configs = declaration.get("configs") or {}
        if not isinstance(configs, dict):
            raise InputError(f"{where}.configs must be an object keyed by member name")
        enabled = set(ANTHROPIC_TOOLSET_MEMBERS)
        for member, config in configs.items():
            if member not in ANTHROPIC_TOOLSET_MEMBERS:
                raise InputError(f"{where}.configs has an unknown member {member!r}; members: "
                                 f"{', '.join(ANTHROPIC_TOOLSET_MEMBERS)}")
            if config is None:
                continue
            on = config.get("enabled") if isinstance(config, dict) else "?"
            if on not in (None, True, False):
                raise InputError(f"{where}.configs.{member}.enabled must be true, false or null")
            if on is False:
                enabled.discard(member)
        return ComputerTool("anthropic", kind, "computer", None, frozenset(enabled))
    if kind == "computer_use_preview":
        display = (_display_field(declaration, "display_width", where),
                   _display_field(declaration, "display_height", where))
        env = declaration.get("environment")
        if env not in OPENAI_ENVIRONMENTS:
            raise InputError(f"{where}.environment must be one of {', '.join(OPENAI_ENVIRONMENTS)}; got {env!r}")
        return ComputerTool("openai", kind, kind, display, frozenset(OPENAI_ACTIONS), environment=env)
    if kind == "computer":
        return ComputerTool("openai", kind, kind, None, frozenset(OPENAI_ACTIONS), batched=True)
    return None


def find_computer_tool(tools, where: str = "tools") -> Optional[ComputerTool]:
    """The one computer-use tool among a request's tool declarations (None without one);
    InputError if more than one is declared."""
    found = []
    for i, declaration in enumerate(tools or ()):
        tool = computer_tool(declaration, f"{where}[{i}]")
        if tool is not None:
            found.append((i, tool))
    if len(found) > 1:
        raise InputError(f"{where}[{found[0][0]}] and {where}[{found[1][0]}] both declare a computer-use tool; "
                         "declare one")
    return found[0][1] if found else None


# ---------------------------------------------------------------------------------------------
# Protocol calls → neutral actions
# ---------------------------------------------------------------------------------------------
def _coordinate(value, where, required=True) -> Optional[Tuple[int, int]]:
    if value is None and not required:
        return None
    ok = isinstance(value, (list, tuple)) and len(value) == 2 and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and 0 <= v <= 10 * MAX_DISPLAY
        for v in value)
    if not ok:
        raise InputError(f"{where} must be [x, y], two non-negative numbers; got {value!r}"[:300])
    return int(value[0]), int(value[1])


def _string(value, where) -> str:
    if not isinstance(value, str):
        raise InputError(f"{where} must be a string")
    return value


def _number(value, where, default=None) -> float:
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise InputError(f"{where} must be a non-negative number; got {value!r}"[:300])
    return float(value)


def _from_anthropic(name, p, where) -> Optional[ComputerAction]:
    def at(key="coordinate", required=False):
        return _coordinate(p.get(key), f"{where}.input.{key}", required)

    clicks = {"left_click": "left", "right_click": "right", "middle_click": "middle"}
    if name in clicks:
        return ComputerAction("click", point=at(), button=clicks[name])
    if name in ("double_click", "triple_click"):
        return ComputerAction(name, point=at())
    if name == "mouse_move":
        return ComputerAction("mouse_move", point=at(required=True))
    if name == "left_click_drag":
        return ComputerAction("drag", point=at("start_coordinate", True), end=at(required=True))
    if name in ("left_mouse_down", "left_mouse_up"):
        return ComputerAction("mouse_down" if name == "left_mouse_down" else "mouse_up")
    if name == "scroll":
        direction = p.get("scroll_direction")
        if direction not in DIRECTIONS:
            raise InputError(f"{where}.input.scroll_direction must be one of {', '.join(DIRECTIONS)}")
        amount = _number(p.get("scroll_amount"), f"{where}.input.scroll_amount")
        return ComputerAction("scroll", point=at(), direction=direction, amount=max(1, round(amount)))
    if name == "type":
        return ComputerAction("type", text=_string(p.get("text"), f"{where}.input.text"))
    if name == "key":
        keys = parse_keys(_string(p.get("text"), f"{where}.input.text"))
        if keys is None:
            raise InputError(f"{where}.input.text must name the keys to press, such as 'ctrl+c'")
        return ComputerAction("key", keys=keys)
    if name == "wait":
        return ComputerAction("wait", seconds=_number(p.get("duration"), f"{where}.input.duration", WAIT_SECONDS))
    if name == "screenshot":
        return ComputerAction("screenshot")
    if isinstance(name, str):
        return None  # hold_key, cursor_position, zoom, or a name this module does not know
    raise InputError(f"{where} names no action")


def _from_openai(a, where) -> Optional[ComputerAction]:
    kind = a.get("type")
    xy = lambda: _coordinate([a.get("x"), a.get("y")], f"{where} x, y")  # noqa: E731
    if kind == "click":
        button = {"left": "left", "right": "right", "wheel": "middle"}.get(a.get("button", "left"))
        return ComputerAction("click", point=xy(), button=button) if button else None
    if kind == "double_click":
        return ComputerAction("double_click", point=xy())
    if kind == "move":
        return ComputerAction("mouse_move", point=xy())
    if kind == "drag":
        path = a.get("path")
        if not isinstance(path, list) or len(path) < 2 or not all(isinstance(q, dict) for q in path):
            raise InputError(f"{where}.path must be a list of at least two {{x, y}} points")
        ends = [_coordinate([q.get("x"), q.get("y")], f"{where}.path") for q in (path[0], path[-1])]
        return ComputerAction("drag", point=ends[0], end=ends[1])
    if kind == "scroll":
        dx, dy = (_signed(a.get(k, 0), f"{where}.{k}") for k in ("scroll_x", "scroll_y"))
        if dx == dy == 0:
            return None
        direction = ("down" if dy > 0 else "up") if abs(dy) >= abs(dx) else ("right" if dx > 0 else "left")
        amount = max(1, round(max(abs(dx), abs(dy)) / SCROLL_CLICK_PIXELS))
        return ComputerAction("scroll", point=xy(), direction=direction, amount=amount)
    if kind == "type":
        return ComputerAction("type", text=_string(a.get("text"), f"{where}.text"))
    if kind == "keypress":
        keys = parse_keys(a.get("keys"))
        if keys is None:
            raise InputError(f"{where}.keys must be a non-empty list of key names")
        return ComputerAction("key", keys=keys)
    if kind == "wait":
        return ComputerAction("wait", seconds=WAIT_SECONDS)
    if kind == "screenshot":
        return ComputerAction("screenshot")
    if isinstance(kind, str):
        return None
    raise InputError(f"{where}.type names no action")


def _signed(value, where) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InputError(f"{where} must be a number")
    return float(value)


__all__ = ["ACTION_TYPES", "BUTTONS", "DIRECTIONS", "SCROLL_CLICK_PIXELS", "WAIT_SECONDS", "MAX_DISPLAY",
           "ANTHROPIC_TYPES", "ANTHROPIC_ACTIONS", "ANTHROPIC_TOOLSET_MEMBERS", "OPENAI_TYPES", "OPENAI_ACTIONS",
           "ComputerAction", "ComputerTool", "computer_tool", "find_computer_tool", "canonical_key", "parse_keys",
           "check_display"]
