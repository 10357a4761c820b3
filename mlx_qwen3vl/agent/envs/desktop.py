"""The real screen: the `desktop` environment. `mss` captures a monitor, `pyautogui` moves the mouse
and presses keys.

A capture is in pixels, input in the operating system's units: on macOS a Retina screen's capture
is twice its size in points, which is what pyautogui (and mss's monitor rectangle) count in.
`screen_mapping` turns a capture's size and its monitor's rectangle into the Observation's scale and
origin (per axis, so scaled displays with non-integer ratios and monitors left of or above the
primary one map too); an image pixel then acts at the point holding its centre (`to_env_pixel`).

This acts on a person's machine, so: it asks on the terminal before every action that moves the
mouse or presses a key (unless `yes=True`, the command line's --yes; declining ends the episode),
keeps pyautogui's fail-safe on (the mouse in a screen corner stops the episode), refuses to start
without a display, and logs every action (logger `mlx_qwen3vl.agent.envs.desktop`, one line each).
"""

import logging
import os
import sys
import time
import types
from typing import Optional, Tuple

from PIL import Image

from ...errors import InputError, Qwen3VLError
from ..computer_tools import ACTION_TYPES, ComputerAction
from .base import Environment, Observation, input_pixel

log = logging.getLogger(__name__)

DRAG_SECONDS = 0.3  # a drag moves while the button is held: apps that track a drag need motion events
_NOT_INPUT = ("wait", "screenshot")  # touch nothing on the machine, so they are not asked about


class NoDisplayError(Qwen3VLError, RuntimeError):
    """There is no screen to capture or act on."""


def require_display(environ=None, platform: str = sys.platform) -> None:
    """NoDisplayError (one line) unless a display can be reached: on Linux and other X11 systems
    DISPLAY must be set and accept a connection (pyautogui itself fails at import without one)."""
    if platform in ("darwin", "win32"):
        return
    environ = os.environ if environ is None else environ
    name = environ.get("DISPLAY")
    if not name:
        extra = ", a Wayland session without XWayland" if environ.get("WAYLAND_DISPLAY") else ""
        raise NoDisplayError(f"no display (DISPLAY is not set{extra}); run it inside your desktop session, "
                             "or under Xvfb")
    try:
        from Xlib import display as xdisplay

        xdisplay.Display(name).close()
    except ImportError:
        raise NoDisplayError("the desktop environment needs python-xlib on Linux: pip install 'mlx-qwen3vl[agent]'") \
            from None
    except Exception as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise NoDisplayError(f"cannot connect to display {name!r}: {reason}") from None


def _import_pyautogui():
    """pyautogui, imported once a display is known to be there. mouseinfo 0.1.3 (pyautogui's, for
    its mouseInfo() window only) calls sys.exit at import on Linux without tkinter: an empty module
    stands in for it there, as pyautogui's own ImportError fallback intends."""
    if sys.platform.startswith("linux") and "mouseinfo" not in sys.modules:
        try:
            import tkinter  # noqa: F401
        except ImportError:
            sys.modules["mouseinfo"] = types.ModuleType("mouseinfo")
    import pyautogui

    return pyautogui


def screen_mapping(image_size: Tuple[int, int], monitor) -> Tuple[Tuple[float, float], Tuple[float, float]]:
    """(scale, origin) for a capture of `image_size` pixels of `monitor`: its rectangle in input
    units, (left, top, width, height) or mss's dict. scale = input units per pixel on each axis
    (Retina: 0.5), origin = the monitor's top-left (negative left of or above the primary)."""
    if isinstance(monitor, dict):
        monitor = (monitor["left"], monitor["top"], monitor["width"], monitor["height"])
    left, top, width, height = monitor
    iw, ih = image_size
    return (width / iw, height / ih), (float(left), float(top))


def input_rect(monitor: dict, primary: dict, input_primary: Tuple[int, int], platform: str = sys.platform):
    """`monitor` (an mss monitor) as (left, top, width, height) in pyautogui's units. mss counts in
    the units input uses (macOS: points; X11 and DPI-aware Windows: pixels), which pyautogui.size()
    confirms on the primary screen; where they differ (a Windows pyautogui not DPI-aware) mss's
    rectangles are rescaled by the primary's ratio. On X11 pyautogui.size() is the whole X screen,
    every monitor together, so there is nothing to compare."""
    rect = (monitor["left"], monitor["top"], monitor["width"], monitor["height"])
    if platform not in ("darwin", "win32") or tuple(input_primary) == (primary["width"], primary["height"]):
        return rect
    rx, ry = input_primary[0] / primary["width"], input_primary[1] / primary["height"]
    log.warning("desktop: mss sees the primary screen as %dx%d, pyautogui as %dx%d; scaling by pyautogui's",
                primary["width"], primary["height"], *input_primary)
    return (rect[0] * rx, rect[1] * ry, rect[2] * rx, rect[3] * ry)


def _pyautogui_key(name: str, valid, platform: str = sys.platform) -> str:
    """A canonical key name → pyautogui's (`valid`: pyautogui.isValidKey, this platform's keys)."""
    key = {"cmd": "command" if platform == "darwin" else "win"}.get(name, name)
    if not valid(key):
        raise InputError(f"pyautogui has no key {name!r}")
    return key


class DesktopEnv(Environment):
    """The screen of monitor `monitor` (mss numbering: 1 is the primary). task: the task text.
    yes: act without asking. pause: seconds pyautogui rests after each call (None: its default,
    0.1). ask_in / ask_out: where the confirmation is read and written (the terminal's stdin and
    stderr)."""

    name = "desktop"

    def __init__(self, task: str = "", monitor: int = 1, yes: bool = False, pause: Optional[float] = None,
                 ask_in=None, ask_out=None):
        require_display()
        import mss

        self.pyautogui = pyautogui = _import_pyautogui()
        pyautogui.FAILSAFE = True  # the mouse in a screen corner raises FailSafeException: the person's stop
        if pause is not None:
            pyautogui.PAUSE = pause
        self.task, self.yes = task, yes
        self.ask_in, self.ask_out = ask_in, ask_out
        self._sct = (getattr(mss, "MSS", None) or mss.mss)()
        monitors = self._sct.monitors
        if not 1 <= monitor < len(monitors):
            raise InputError(f"monitor {monitor} does not exist; this machine has monitors 1 to {len(monitors) - 1}")
        self.monitor = dict(monitors[monitor])  # what mss captures, in mss's units
        self.input_rect = input_rect(self.monitor, monitors[1], tuple(pyautogui.size()))
        self._last: Optional[Observation] = None
        self.stop_reason: Optional[str] = None

    # -- the screen
    def _capture(self) -> Image.Image:
        shot = self._sct.grab(self.monitor)
        return Image.frombytes("RGB", shot.size, shot.bgra, "raw", "BGRX")

    def screenshot(self) -> Observation:
        image = self._capture()
        scale, origin = screen_mapping(image.size, self.input_rect)
        self._last = Observation(image, scale=scale, origin=origin)
        return self._last

    def reset(self) -> Tuple[Observation, str]:
        self.stop_reason = None
        return self.screenshot(), self.task

    @property
    def done(self) -> bool:
        return self.stop_reason is not None

    def close(self) -> None:
        if self._sct is not None:
            self._sct.close()
        self._sct = None

    # -- input
    def to_screen(self, point) -> Tuple[int, int]:
        """An image pixel of the last screenshot → the screen point holding it; InputError outside."""
        return input_pixel(point, self._last or self.screenshot())

    def act(self, action: ComputerAction) -> None:
        if action.type not in ACTION_TYPES:
            raise InputError(f"the desktop cannot {action.type!r}; actions: {', '.join(ACTION_TYPES)}")
        if self.stop_reason is not None:
            raise InputError(f"the episode has ended ({self.stop_reason})")
        at = self.to_screen(action.point) if action.point is not None else None
        end = self.to_screen(action.end) if action.end is not None else None
        keys = [_pyautogui_key(k, self.pyautogui.isValidKey) for k in action.keys] if action.type == "key" else []
        if action.type == "type":
            missing = sorted({c for c in action.text or "" if not self.pyautogui.isValidKey(c)})
            if missing:  # pyautogui would skip them silently
                raise InputError(f"pyautogui can only type keyboard characters; not {''.join(missing)!r}")
        line = _describe(action, at, end)
        if action.type not in _NOT_INPUT and not self.yes and not self._confirm(line):
            self.stop_reason = "the person declined an action"
            log.info("desktop: declined: %s", line)
            return
        log.info("desktop: %s", line)
        try:
            self._do(action, at, end, keys)
        except self.pyautogui.FailSafeException:
            self.stop_reason = "pyautogui's fail-safe: the mouse was in a screen corner"
            log.warning("desktop: stopped by the fail-safe (the mouse in a screen corner) before: %s", line)

    def _confirm(self, line: str) -> bool:
        out = self.ask_out or sys.stderr
        out.write(f"desktop: {line}. Do it? [y/N] ")
        out.flush()
        answer = (self.ask_in or sys.stdin).readline()
        return answer.strip().lower() in ("y", "yes")

    def _do(self, a: ComputerAction, at, end, keys):
        g = self.pyautogui
        x, y = at if at is not None else (None, None)
        if a.type == "click":
            g.click(x, y, button=a.button)
        elif a.type == "double_click":
            g.doubleClick(x, y)
        elif a.type == "triple_click":
            g.tripleClick(x, y)
        elif a.type == "mouse_move":
            g.moveTo(x, y)
        elif a.type == "drag":
            g.moveTo(x, y)
            g.mouseDown(button="left")
            g.moveTo(*end, duration=DRAG_SECONDS)
            g.mouseUp(button="left")
        elif a.type == "mouse_down":
            g.mouseDown(x, y, button=a.button)
        elif a.type == "mouse_up":
            g.mouseUp(x, y, button=a.button)
        elif a.type == "scroll":
            clicks = a.amount or 1
            if a.direction in ("up", "down"):
                g.scroll(clicks if a.direction == "up" else -clicks, x, y)
            else:
                g.hscroll(clicks if a.direction == "right" else -clicks, x, y)
        elif a.type == "type":
            g.write(a.text or "")
        elif a.type == "key":
            g.hotkey(*keys)
        elif a.type == "wait":
            time.sleep(a.seconds or 0)


def _describe(action: ComputerAction, at, end) -> str:
    """One line: the action, in screen points (and the image pixels it came from)."""
    parts = [action.type]
    if action.type in ("click", "mouse_down", "mouse_up"):
        parts.append(action.button)
    if at is not None:
        parts.append(f"at ({at[0]}, {at[1]}) from image ({action.point[0]}, {action.point[1]})")
    if end is not None:
        parts.append(f"to ({end[0]}, {end[1]}) from image ({action.end[0]}, {action.end[1]})")
    if action.type == "scroll":
        parts.append(f"{action.direction} {action.amount} clicks")
    if action.type == "type":
        parts.append(repr(action.text))
    if action.type == "key":
        parts.append("+".join(action.keys))
    if action.type == "wait":
        parts.append(f"{action.seconds:g} s")
    return " ".join(parts)


__all__ = ["DesktopEnv", "NoDisplayError", "require_display", "screen_mapping", "input_rect"]
