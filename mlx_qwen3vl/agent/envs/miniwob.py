"""MiniWoB++ tasks (the `miniwob` package, Farama: its task pages in its wheel, driven by selenium in
Chromium) as an agent Environment, seeded and scored by the task's own reward.

The screenshot is the task's area as MiniWoB++ renders it (160x210 CSS pixels, the query on top),
at `device_scale` device pixels per CSS pixel (1: miniwob's own size; 2 shows a model the page as a
Retina screen would, and its points map back by 0.5). Actions go through miniwob's own action space
(`create_action` with CLICK_COORDS, TYPE_TEXT, PRESS_KEY, ...), in the task's CSS pixels.

One Chromium serves every task: `reset` with another task loads its page in the same browser
(MiniWoB++ starts a browser per environment, some seconds each, which an evaluation of many tasks
would otherwise pay per task).
"""

import os
import time
import urllib.parse
from io import BytesIO
from typing import Optional, Tuple

from ...errors import InputError
from ..computer_tools import SCROLL_CLICK_PIXELS, ComputerAction
from .base import Environment, Observation, to_env_pixel

CHROME_BINARY, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"  # Debian's; elsewhere selenium finds one
MAX_WAIT_S = 5.0  # the longest `wait` the environment sleeps
# Canonical key names (computer_tools.parse_keys) → miniwob's key syntax.
KEYS = {"enter": "<Enter>", "tab": "<Tab>", "space": "<Space>", "backspace": "<Backspace>", "delete": "<Delete>",
        "esc": "<Escape>", "up": "<ArrowUp>", "down": "<ArrowDown>", "left": "<ArrowLeft>", "right": "<ArrowRight>",
        "pageup": "<PageUp>", "pagedown": "<PageDown>", "home": "<Home>", "end": "<End>"}
MODIFIERS = {"ctrl": "C-", "shift": "S-", "alt": "A-", "cmd": "M-"}


def task_names():
    """The MiniWoB++ tasks the installed package registers (their names without miniwob/ and -v1)."""
    import gymnasium
    import miniwob

    gymnasium.register_envs(miniwob)
    return sorted(k[len("miniwob/"):-len("-v1")] for k in gymnasium.registry if k.startswith("miniwob/"))


def miniwob_key(keys) -> str:
    """Canonical keys pressed together → miniwob's PRESS_KEY syntax ("C-a", "<Enter>", "S-<Tab>")."""
    *mods, key = keys
    prefix = ""
    for m in mods:
        if m not in MODIFIERS:
            raise InputError(f"MiniWoB++ cannot press {m!r} as a modifier")
        prefix += MODIFIERS[m]
    if key in KEYS:
        return prefix + KEYS[key]
    if len(key) == 1:
        return prefix + key
    raise InputError(f"MiniWoB++ has no key {key!r}")


class MiniWoBEnv(Environment):
    """A MiniWoB++ task in headless (or visible) Chromium.

    task: a task name (`task_names()`: click-button, enter-text, ...). seed: the episode's seed
    (reset(seed=) changes it; each reset with the same seed gives the same episode).
    episode_seconds: the task's time limit (MiniWoB++'s own is 10 s, and its reward shrinks with
    the time taken; a model thinking for seconds per step needs more: None keeps the task's own).
    device_scale: device pixels per CSS pixel of the screenshot (1 or more; may be changed between
    episodes)."""

    name = "miniwob"

    def __init__(self, task: str, seed: int = 0, *, headless: bool = True, episode_seconds: Optional[float] = None,
                 device_scale: float = 1.0):
        import gymnasium
        import miniwob

        gymnasium.register_envs(miniwob)
        self._check_task(task)
        if not device_scale >= 1:
            raise InputError(f"device_scale must be at least 1, not {device_scale!r}")
        if episode_seconds is not None and not episode_seconds > 0:
            raise InputError(f"episode_seconds must be positive, not {episode_seconds!r}")
        if os.path.exists(CHROME_BINARY) and os.path.exists(CHROMEDRIVER):
            os.environ.setdefault("MINIWOB_CHROME_BINARY", CHROME_BINARY)
            os.environ.setdefault("MINIWOB_CHROMEDRIVER", CHROMEDRIVER)
        self.task, self.seed, self.episode_seconds, self.device_scale = task, seed, episode_seconds, device_scale
        self._gym = gymnasium.make(f"miniwob/{task}-v1", render_mode=None if headless else "human")
        self._env = self._gym.unwrapped
        self._loaded = task
        self._reward, self._raw, self._done, self._cursor = 0.0, 0.0, False, (0.0, 0.0)
        self.info = {}

    @staticmethod
    def _check_task(task):
        names = task_names()
        if task not in names:
            close = [n for n in names if task and (task in n or n in task)][:5]
            raise InputError(f"unknown MiniWoB++ task {task!r}" + (f" (did you mean {', '.join(close)}?)" if close
                                                                    else f"; {len(names)} tasks, e.g. click-button"))
        if task.startswith("flight."):
            raise InputError("the flight.* tasks need their own window size; use a miniwob task")

    @property
    def driver(self):
        return self._env.instance.driver

    def _apply_scale(self):
        """Render at device_scale (settable between episodes), through the DevTools protocol."""
        if self.device_scale == getattr(self, "_scale_applied", 1.0):
            return
        if self.device_scale == 1:
            self.driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
        else:
            inst = self._env.instance
            self.driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
                "width": inst.inner_width, "height": inst.inner_height, "deviceScaleFactor": self.device_scale,
                "mobile": False})
        self._scale_applied = self.device_scale

    def _load(self, task):
        """Show `task`'s page in the running browser (what a new miniwob environment would open)."""
        from miniwob.fields import get_field_extractor
        from selenium.webdriver.common.by import By
        from selenium.webdriver.support import expected_conditions as EC
        from selenium.webdriver.support.wait import WebDriverWait

        instance = self._env.instance
        instance.url = urllib.parse.urljoin(instance.url, f"{task}.html")
        instance.field_extractor = get_field_extractor(task)
        self._env.subdomain = task
        self.driver.get(instance.url)
        WebDriverWait(self.driver, 5).until(EC.element_to_be_clickable((By.ID, instance.SYNC_SCREEN_ID)))
        self._loaded = task

    def reset(self, task: Optional[str] = None, seed: Optional[int] = None) -> Tuple[Observation, str]:
        """A new episode (of `task` / with `seed` when given): its first screenshot and its instruction."""
        if task is not None and task != self.task:
            self._check_task(task)
            self.task = task
        if seed is not None:
            self.seed = seed
        if self._loaded != self.task:
            self._load(self.task)
        self._apply_scale()
        if self.episode_seconds is not None:
            self.driver.execute_script(f"core.EPISODE_MAX_TIME = {int(self.episode_seconds * 1000)};")
        obs, self.info = self._gym.reset(seed=self.seed)
        self._reward, self._raw, self._done = 0.0, 0.0, False
        self.utterance = obs["utterance"]
        return self.screenshot(), self.utterance

    def screenshot(self) -> Observation:
        from PIL import Image

        inst = self._env.instance
        png = Image.open(BytesIO(self.driver.get_screenshot_as_png())).convert("RGB")
        s = self.device_scale
        w, h = round(inst.task_width * s), round(inst.task_height * s)
        image = png.crop((0, 0, w, h))
        self._last = Observation(image, scale=(inst.task_width / w, inst.task_height / h))
        return self._last

    def dom(self):
        """The task's DOM as miniwob reads it (miniwob.dom.DOMElement; CSS pixels of the task area)."""
        from miniwob.dom import DOMElement

        return DOMElement(self.driver.execute_script("return core.getDOMInfo();"))

    # -------------------------------------------------------------- acting
    def _step(self, kind, **fields):
        if self._done:
            return
        _, reward, done, _, info = self._gym.step(self._env.create_action(kind, **fields))
        if done:
            self._done, self._reward, self._raw = True, float(reward), float(info.get("raw_reward") or 0.0)
            self.info = info

    def _coords(self, point):
        import numpy as np

        x, y = point  # CSS pixels of the task area (already mapped by to_env)
        return np.array([x, y], dtype=np.float32)

    def act(self, action: ComputerAction) -> None:
        # points are in the last screenshot's pixels; they act at the CSS pixel holding that pixel
        at = lambda p: to_env_pixel(p, self._last)  # noqa: E731
        point = at(action.point) if action.point is not None else self._cursor
        t = action.type
        if t in ("click", "double_click", "triple_click", "mouse_move", "mouse_down", "mouse_up", "scroll", "drag"):
            if t == "click" and action.button != "left":
                raise InputError(f"MiniWoB++ has no {action.button} click")
            self._cursor = point
            coords = self._coords(point)
            if t == "click":
                self._step("CLICK_COORDS", coords=coords)
            elif t in ("double_click", "triple_click"):  # no triple click: a double one, as Qwen's prompt says
                self._step("DBLCLICK_COORDS", coords=coords)
            elif t == "mouse_move":
                self._step("MOVE_COORDS", coords=coords)
            elif t == "mouse_down":
                self._step("MOUSEDOWN_COORDS", coords=coords)
            elif t == "mouse_up":
                self._step("MOUSEUP_COORDS", coords=coords)
            elif t == "drag":
                end = at(action.end)
                self._step("MOUSEDOWN_COORDS", coords=coords)
                self._step("MOVE_COORDS", coords=self._coords(end))
                self._step("MOUSEUP_COORDS", coords=self._coords(end))
                self._cursor = end
            else:
                if action.direction not in ("up", "down"):
                    raise InputError(f"MiniWoB++ scrolls up or down, not {action.direction}")
                config = self._env.action_space_config
                config.scroll_amount = (action.amount or 1) * SCROLL_CLICK_PIXELS
                self._step("SCROLL_UP_COORDS" if action.direction == "up" else "SCROLL_DOWN_COORDS", coords=coords)
        elif t == "type":
            self._step("TYPE_TEXT", text=action.text)
        elif t == "key":
            key = miniwob_key(action.keys)
            allowed = list(self._env.action_space_config.allowed_keys)
            if key not in allowed:
                raise InputError(f"MiniWoB++ does not allow the key {key!r}")
            self._step("PRESS_KEY", key=allowed.index(key))
        elif t == "wait":
            time.sleep(min(MAX_WAIT_S, action.seconds or 0.0))
            self._step("NONE")
        elif t == "screenshot":
            pass
        else:
            raise InputError(f"MiniWoB++ cannot {t}")
        self._poll()

    def _poll(self):
        """The task may end on its own (its timer): read its state."""
        if not self._done:
            meta = self._env.instance.get_metadata()
            if meta["done"]:
                self._done, self._reward, self._raw = True, float(meta["env_reward"]), float(meta["raw_reward"] or 0)

    @property
    def done(self) -> bool:
        if not self._done:
            self._poll()
        return self._done

    @property
    def reward(self) -> float:
        return self._reward

    @property
    def raw_reward(self) -> float:
        """The task's reward before MiniWoB++ scales it by the time taken."""
        return self._raw

    @property
    def success(self) -> bool:
        """MiniWoB++'s success: the task's own (unscaled) reward is positive."""
        return self._raw > 0

    def close(self) -> None:
        if getattr(self, "_gym", None) is not None:
            self._gym.close()
            self._gym = None


__all__ = ["MiniWoBEnv", "task_names", "miniwob_key", "KEYS"]
