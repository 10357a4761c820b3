"""A web page in Chromium, driven through selenium: the `browser` environment.

The viewport is set exactly with the DevTools protocol (`Emulation.setDeviceMetricsOverride`:
width and height in CSS pixels and a devicePixelRatio), so a screenshot is (width·dpr, height·dpr)
device pixels and `Observation.scale` is 1/dpr (image pixels → CSS pixels). Mouse input goes
through `Input.dispatchMouseEvent` at viewport coordinates: image pixel (x, y) acts at CSS pixel
floor((x + 0.5)/dpr, (y + 0.5)/dpr), the one holding the device pixel the model pointed at. A wheel
click scrolls SCROLL_CLICK_PIXELS CSS pixels at any dpr. Keys and text go through selenium's W3C
key actions (canonical key names → selenium `Keys`). A page an action opens in a new tab or
window becomes the one shown, at the same viewport.

Chromium: Debian's /usr/bin/chromium with /usr/bin/chromedriver where both exist, else Chrome with
selenium's own driver management (a Mac). The browser does not score: `done` is False and `reward`
0.0 unless `score_script` (JavaScript returning {done, reward}) is given.
"""

import logging
import os
import time
from io import BytesIO
from typing import Optional, Tuple

from PIL import Image

from ...errors import InputError
from ..computer_tools import ACTION_TYPES, SCROLL_CLICK_PIXELS, ComputerAction, check_display
from .base import Environment, Observation, input_pixel

log = logging.getLogger(__name__)

DEBIAN_CHROMIUM = "/usr/bin/chromium"
DEBIAN_DRIVER = "/usr/bin/chromedriver"
_BUTTON_MASK = {"left": 1, "right": 2, "middle": 4}
# canonical key names (computer_tools.canonical_key) → selenium.webdriver.common.keys.Keys attributes
_KEYS = {"ctrl": "CONTROL", "alt": "ALT", "shift": "SHIFT", "cmd": "META", "enter": "ENTER", "esc": "ESCAPE",
         "tab": "TAB", "space": "SPACE", "backspace": "BACKSPACE", "delete": "DELETE", "insert": "INSERT",
         "home": "HOME", "end": "END", "pageup": "PAGE_UP", "pagedown": "PAGE_DOWN", "up": "ARROW_UP",
         "down": "ARROW_DOWN", "left": "ARROW_LEFT", "right": "ARROW_RIGHT", "pause": "PAUSE"}
_KEYS.update({f"f{i}": f"F{i}" for i in range(1, 13)})


def start_chrome(window: Tuple[int, int] = (1280, 800), headless: bool = True):
    """A selenium Chrome driver: Debian's chromium + chromedriver where both exist, else Chrome found
    by selenium's driver management."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    if headless:
        options.add_argument("--headless=new")
    options.add_argument(f"--window-size={window[0]},{window[1]}")
    options.add_argument("--disable-dev-shm-usage")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        options.add_argument("--no-sandbox")  # Chromium refuses to run as root with its sandbox
    if os.path.exists(DEBIAN_CHROMIUM) and os.path.exists(DEBIAN_DRIVER):
        options.binary_location = DEBIAN_CHROMIUM
        return webdriver.Chrome(service=Service(DEBIAN_DRIVER), options=options)
    return webdriver.Chrome(options=options)


def selenium_key(name: str) -> str:
    """A canonical key name → what selenium's key actions send (a `Keys` value, or the character)."""
    from selenium.webdriver.common.keys import Keys

    if name in _KEYS:
        return getattr(Keys, _KEYS[name])
    if name == "space":
        return " "
    if len(name) == 1:
        return name
    raise InputError(f"the browser has no key {name!r}; keys are canonical names (ctrl, enter, f5, a, ...)")


class BrowserEnv(Environment):
    """A page at `url` in Chromium with a `viewport` of (width, height) CSS pixels at
    `device_scale_factor`. `driver`: a selenium Chrome driver to use (not quit on close); None
    starts one. `score_script`: JavaScript whose return value is {done, reward} (or null)."""

    name = "browser"

    def __init__(self, url: str, task: Optional[str] = None, viewport: Tuple[int, int] = (1280, 800),
                 device_scale_factor: float = 1.0, headless: bool = True, driver=None,
                 score_script: Optional[str] = None):
        if not isinstance(url, str) or not url.strip():
            raise InputError("the browser environment needs a page to open (a URL; --url)")
        self.url, self.task = url, task or ""
        self.viewport = check_display(tuple(viewport))
        if not (isinstance(device_scale_factor, (int, float)) and 0.25 <= device_scale_factor <= 4):
            raise InputError(f"device_scale_factor must be a number from 0.25 to 4; got {device_scale_factor!r}")
        self.dpr = float(device_scale_factor)
        self.score_script = score_script
        self._own_driver = driver is None
        self.driver = driver if driver is not None else start_chrome(self.viewport, headless)
        self._last: Optional[Observation] = None
        self._cursor: Optional[Tuple[float, float]] = None  # where the mouse is, CSS pixels
        self._buttons = 0  # the mouse buttons held (CDP's bit mask)
        self._window, self._windows = self.driver.current_window_handle, set(self.driver.window_handles)
        self._set_metrics()

    # -- the page
    def _set_metrics(self):
        w, h = self.viewport
        self.driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                                    {"width": w, "height": h, "deviceScaleFactor": self.dpr, "mobile": False})

    def reset(self) -> Tuple[Observation, str]:
        self.driver.get(self.url)
        self._set_metrics()
        self._window, self._windows = self.driver.current_window_handle, set(self.driver.window_handles)
        self._cursor, self._buttons = None, 0
        return self.screenshot(), self.task

    def screenshot(self) -> Observation:
        image = Image.open(BytesIO(self.driver.get_screenshot_as_png())).convert("RGB")
        (w, h), (iw, ih) = self.viewport, image.size
        if abs(iw - w * self.dpr) >= 1 or abs(ih - h * self.dpr) >= 1:  # a fractional dpr rounds either way
            raise RuntimeError(f"the browser's screenshot is {iw}x{ih}, not the viewport {w}x{h} at "
                               f"devicePixelRatio {self.dpr:g}")
        self._last = Observation(image, scale=(w / iw, h / ih))
        return self._last

    @property
    def done(self) -> bool:
        return bool(self._score().get("done", False))

    @property
    def reward(self) -> float:
        return float(self._score().get("reward", 0.0))

    def _score(self) -> dict:
        if not self.score_script:
            return {}
        value = self.driver.execute_script(self.score_script)
        return value if isinstance(value, dict) else {}

    def close(self) -> None:
        if self._own_driver and self.driver is not None:
            self.driver.quit()
        self.driver = None

    # -- input
    def to_css(self, point) -> Tuple[int, int]:
        """An image pixel of the last screenshot → the CSS pixel that holds it (to_env_pixel: integer,
        since Chromium's hit test rounds a fractional position, which at dpr 2 lands half the time
        on the next CSS pixel); InputError outside the image."""
        return input_pixel(point, self._last or self.screenshot())

    def act(self, action: ComputerAction) -> None:
        kind = action.type
        if kind not in ACTION_TYPES:
            raise InputError(f"the browser cannot {kind!r}; actions: {', '.join(ACTION_TYPES)}")
        at = self.to_css(action.point) if action.point is not None else None
        log.info("browser: %s", _describe(action, at))
        if kind in ("click", "double_click", "triple_click"):
            at = self._at(at)
            button = action.button if kind == "click" else "left"
            for n in range(1, {"click": 1, "double_click": 2, "triple_click": 3}[kind] + 1):
                self._mouse("mousePressed", at, button, n)
                self._mouse("mouseReleased", at, button, n)
        elif kind == "mouse_move":
            self._move(at)
        elif kind == "drag":
            self._move(at)
            self._mouse("mousePressed", at, "left", 1)
            end = self.to_css(action.end)
            for i in range(1, 6):  # intermediate moves: pages that track a drag see it travel
                self._move((at[0] + (end[0] - at[0]) * i / 5, at[1] + (end[1] - at[1]) * i / 5))
            self._mouse("mouseReleased", end, "left", 1)
        elif kind in ("mouse_down", "mouse_up"):
            at = self._at(at)
            self._mouse("mousePressed" if kind == "mouse_down" else "mouseReleased", at, action.button, 1)
        elif kind == "scroll":
            at = self._at(at, centre=True)
            step = (action.amount or 1) * SCROLL_CLICK_PIXELS
            dx = {"left": -step, "right": step}.get(action.direction, 0)
            dy = {"up": -step, "down": step}.get(action.direction, 0)
            self._cdp_mouse({"type": "mouseWheel", "x": at[0], "y": at[1], "deltaX": dx, "deltaY": dy})
            self._settle()
        elif kind == "type":
            from selenium.webdriver import ActionChains

            ActionChains(self.driver).send_keys(action.text or "").perform()
        elif kind == "key":
            self._keys(action.keys)
        elif kind == "wait":
            time.sleep(action.seconds or 0)
        # screenshot: nothing to do; the runner takes the next one
        if kind not in ("wait", "screenshot"):
            self._follow_windows()

    def _follow_windows(self):
        """A page the action opened in a new tab or window becomes the one shown (as a person's
        browser would bring it forward), at the same viewport; a closed one gives way to the last."""
        handles = self.driver.window_handles
        new = [h for h in handles if h not in self._windows]
        current = None
        if new:
            current = new[-1]
        elif self._window not in handles and handles:
            current = handles[-1]
        self._windows = set(handles)
        if current is not None:
            log.info("browser: now showing window %s", current)
            self.driver.switch_to.window(current)
            self._window = current
            self._set_metrics()
            self._cursor, self._buttons = None, 0

    def _at(self, at, centre=False) -> Tuple[float, float]:
        """Where an action without a point acts: the cursor (the viewport's centre before any move)."""
        if at is not None:
            self._move(at)
            return at
        if self._cursor is None:
            if not centre:
                raise InputError("this action names no point and the mouse has not been anywhere yet")
            self._cursor = (self.viewport[0] / 2, self.viewport[1] / 2)
        return self._cursor

    def _move(self, at):
        self._cdp_mouse({"type": "mouseMoved", "x": at[0], "y": at[1], "button": "none"})
        self._cursor = at

    def _mouse(self, kind, at, button, count):
        if kind == "mousePressed":
            self._buttons |= _BUTTON_MASK[button]
        else:
            self._buttons &= ~_BUTTON_MASK[button]
        self._cdp_mouse({"type": kind, "x": at[0], "y": at[1], "button": button, "clickCount": count})

    def _cdp_mouse(self, params):
        self.driver.execute_cdp_cmd("Input.dispatchMouseEvent", {**params, "buttons": self._buttons})

    def _settle(self):
        """Wait for two animation frames: a wheel scroll is applied by the compositor after the event."""
        self.driver.execute_async_script(
            "const done = arguments[arguments.length - 1];"
            "requestAnimationFrame(() => requestAnimationFrame(() => done(true)));")

    def _keys(self, keys):
        from selenium.webdriver import ActionChains

        names = [selenium_key(k) for k in keys]
        chain = ActionChains(self.driver)
        for k in names:
            chain.key_down(k)
        for k in reversed(names):
            chain.key_up(k)
        chain.perform()


def _describe(action: ComputerAction, at) -> str:
    """One log line: the action and where it acts in CSS pixels."""
    text = ", ".join(f"{k}={v}" for k, v in action.to_dict().items() if k != "type")
    where = f" at CSS ({at[0]:g}, {at[1]:g})" if at is not None else ""
    return f"{action.type} {text}{where}".rstrip()


__all__ = ["BrowserEnv", "start_chrome", "selenium_key"]
