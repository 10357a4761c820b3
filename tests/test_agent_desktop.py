"""The desktop environment (mss + pyautogui) on a real X server: Xvfb, started here with DISPLAY set
for this module only, and a real X11 window (tests/x_window.py, python-xlib) whose coloured buttons
report every press, release and key. Each target is found by its colour in the environment's own
screenshot, acted on at that image pixel, and the window says where the X server delivered it.
Also: a Retina-sized capture (2x) mapped back to points, the screen mapping for Retina,
non-integer and secondary monitors, the confirmation prompt read from stdin, the fail-safe, and
the refusal without a display. Skipped, with the reason, where Xvfb is not installed."""

import importlib.util
import io
import json
import logging
import math
import os
import queue
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mlx_qwen3vl.agent.computer_tools import ComputerAction as A
from mlx_qwen3vl.agent.envs import Observation, to_env_pixel
from mlx_qwen3vl.agent.envs.desktop import NoDisplayError, input_rect, require_display, screen_mapping
from mlx_qwen3vl.errors import InputError

SCREEN = (800, 600)
BUTTONS = {  # name: left, top, width, height, colour (each colour unique on the screen)
    "ok": [101, 77, 61, 31, [200, 30, 30]], "other": [403, 151, 90, 40, [30, 160, 40]],
    "drag": [150, 300, 50, 50, [30, 40, 200]], "marker": [600, 450, 70, 30, [220, 160, 20]],
    "text": [300, 380, 180, 30, [120, 30, 150]],
}
MARKER = (635, 465)  # inside BUTTONS["marker"]
WINDOW = Path(__file__).parent / "x_window.py"


# ---------------------------------------------------------------------------------------------
# The mapping from a capture's pixels to screen points (no display needed)
# ---------------------------------------------------------------------------------------------
def test_screen_mapping_retina_is_half_a_point_per_pixel():
    scale, origin = screen_mapping((2880, 1800), {"left": 0, "top": 0, "width": 1440, "height": 900})
    assert (scale, origin) == ((0.5, 0.5), (0.0, 0.0))
    obs = Observation(Image.new("RGB", (2880, 1800)), scale, origin)
    # both pixels of a point land on it; the last pixel on the last point
    assert to_env_pixel((100, 50), obs) == to_env_pixel((101, 51), obs) == (50, 25)
    assert to_env_pixel((102, 52), obs) == (51, 26)
    assert to_env_pixel((2879, 1799), obs) == (1439, 899)


def test_screen_mapping_non_integer_scale_per_axis():
    # a 2560x1440 panel driven at 150% (1707x960 logical): ratios differ slightly per axis
    scale, origin = screen_mapping((2560, 1440), (0, 0, 1707, 960))
    assert scale == (1707 / 2560, 960 / 1440)
    obs = Observation(Image.new("RGB", (2560, 1440)), scale, origin)
    assert to_env_pixel((0, 0), obs) == (0, 0)
    assert to_env_pixel((1280, 720), obs) == (853, 480)  # centre pixel → centre point (853.8, 480.3)
    assert to_env_pixel((2559, 1439), obs) == (1706, 959)  # never past the screen's last point
    # a downscaled capture (scale > 1): the pixel's centre picks the point
    obs = Observation(Image.new("RGB", (640, 400)), *screen_mapping((640, 400), (0, 0, 1440, 900)))
    assert to_env_pixel((0, 0), obs) == (1, 1) and to_env_pixel((639, 399), obs) == (1438, 898)


def test_screen_mapping_secondary_monitor_origin():
    # a Retina monitor left of and above the primary: mss's rectangle in points, negative origin
    scale, origin = screen_mapping((3840, 2160), {"left": -1920, "top": -300, "width": 1920, "height": 1080})
    obs = Observation(Image.new("RGB", (3840, 2160)), scale, origin)
    assert to_env_pixel((0, 0), obs) == (-1920, -300)
    assert to_env_pixel((3839, 2159), obs) == (-1, 779)
    # a 1x monitor right of a 1440-point primary
    obs = Observation(Image.new("RGB", (1920, 1080)), *screen_mapping((1920, 1080), (1440, 0, 1920, 1080)))
    assert to_env_pixel((0, 10), obs) == (1440, 10) and to_env_pixel((1919, 1079), obs) == (3359, 1079)


def test_input_rect_follows_pyautogui_units():
    primary = {"left": 0, "top": 0, "width": 1440, "height": 900}
    second = {"left": 1440, "top": -200, "width": 1920, "height": 1080}
    # macOS: mss and pyautogui both count points
    assert input_rect(second, primary, (1440, 900), "darwin") == (1440, -200, 1920, 1080)
    # Windows, mss DPI-aware (pixels) and pyautogui not (logical units at 150%): rescaled
    primary_px = {"left": 0, "top": 0, "width": 2560, "height": 1440}
    second_px = {"left": 2560, "top": 0, "width": 1920, "height": 1080}
    assert input_rect(second_px, primary_px, (1707, 960), "win32") == (2560 * 1707 / 2560, 0, 1920 * 1707 / 2560, 720)
    # X11: pyautogui.size() is the whole screen (both monitors), mss's monitor rectangles are right
    assert input_rect(primary, primary, (3360, 1080), "linux") == (0, 0, 1440, 900)


# ---------------------------------------------------------------------------------------------
# No display: one clear line, before pyautogui is imported (it raises KeyError 'DISPLAY' there)
# ---------------------------------------------------------------------------------------------
def test_refuses_without_a_display(monkeypatch, tmp_path):
    with pytest.raises(NoDisplayError, match="DISPLAY is not set") as e:
        require_display({}, platform="linux")
    assert "\n" not in str(e.value)
    with pytest.raises(NoDisplayError, match="Wayland"):
        require_display({"WAYLAND_DISPLAY": "wayland-0"}, platform="linux")
    free = next(n for n in range(917, 999) if not os.path.exists(f"/tmp/.X11-unix/X{n}"))
    pytest.importorskip("Xlib")
    with pytest.raises(NoDisplayError, match=f"cannot connect to display ':{free}'") as e:
        require_display({"DISPLAY": f":{free}"}, platform="linux")
    assert "\n" not in str(e.value)
    require_display({}, platform="darwin")  # macOS and Windows always have a screen
    from mlx_qwen3vl.agent.envs.desktop import DesktopEnv

    monkeypatch.delenv("DISPLAY", raising=False)
    with pytest.raises(NoDisplayError):
        DesktopEnv(yes=True)


# ---------------------------------------------------------------------------------------------
# Under Xvfb
# ---------------------------------------------------------------------------------------------
class Window:
    """The test window's process and its reports."""

    def __init__(self):
        spec = json.dumps({"size": list(SCREEN), "buttons": BUTTONS})
        self.proc = subprocess.Popen([sys.executable, str(WINDOW), spec], stdout=subprocess.PIPE, text=True)
        self.lines = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        try:
            assert self.next() == {"ready": True}
        except BaseException:
            self.stop()
            raise

    def _read(self):
        for line in self.proc.stdout:
            if line.startswith("{"):  # python-xlib may print a warning about the empty Xauthority
                self.lines.put(json.loads(line))

    def next(self, timeout=10.0):
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError("the test window reported nothing") from None

    def take(self, n):
        return [self.next() for _ in range(n)]

    def stop(self):
        self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def xserver(tmp_path_factory):
    if not shutil.which("Xvfb"):
        pytest.skip("Xvfb is not installed (Debian: apt-get install xvfb; .ci/run installs it)")
    pytest.importorskip("Xlib", reason="python-xlib is not installed (the agent extra brings it with pyautogui)")
    pytest.importorskip("mss", reason="mss is not installed (the agent extra)")
    if importlib.util.find_spec("pyautogui") is None:  # not imported here: it needs DISPLAY at import
        pytest.skip("pyautogui is not installed (the agent extra)")
    read, write = os.pipe()
    # -displayfd: Xvfb picks a free display itself and writes its number once it accepts clients
    xvfb = subprocess.Popen(["Xvfb", "-displayfd", str(write), "-screen", "0", f"{SCREEN[0]}x{SCREEN[1]}x24",
                             "-nolisten", "tcp"], pass_fds=(write,), stderr=subprocess.DEVNULL)
    os.close(write)
    try:
        with os.fdopen(read) as f:
            number = f.readline().strip()
        assert number.isdigit(), "Xvfb did not start"
        auth = tmp_path_factory.mktemp("x") / "Xauthority"
        auth.write_bytes(b"")  # python-xlib insists on the file; Xvfb without -auth asks for nothing
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("DISPLAY", f":{number}")
            mp.setenv("XAUTHORITY", str(auth))
            window = Window()
            try:
                yield window
            finally:
                window.stop()
    finally:
        xvfb.terminate()
        xvfb.wait()


def find(image, name):
    """The centre of BUTTONS[name] found by its colour in `image` (in that image's pixels)."""
    ys, xs = np.nonzero((np.asarray(image) == BUTTONS[name][4]).all(axis=2))
    assert xs.size, f"{name} is not on the screenshot"
    return int(xs.min() + xs.max()) // 2, int(ys.min() + ys.max()) // 2


def desktop(**kwargs):
    from mlx_qwen3vl.agent.envs.desktop import DesktopEnv

    return DesktopEnv(task="press the buttons", pause=0, **kwargs)


def presses(window, n, kind="press"):
    return [e for e in window.take(n) if e["event"] == kind]


def test_every_action_lands_where_the_screenshot_shows_it(xserver, caplog):
    caplog.set_level(logging.INFO, logger="mlx_qwen3vl.agent.envs.desktop")
    env = desktop(yes=True)
    obs, task = env.reset()
    assert task == "press the buttons" and obs.image.size == SCREEN and obs.scale == (1.0, 1.0)
    ok, other, drag, text = (find(obs.image, n) for n in ("ok", "other", "drag", "text"))
    root = lambda name, p: {"window": name, "root": list(p)}  # noqa: E731

    for button, x11 in (("left", 1), ("right", 3), ("middle", 2)):
        env.act(A("click", point=ok, button=button))
        down, up = xserver.take(2)
        assert down == {"event": "press", "button": x11, **root("ok", ok), "at": [ok[0] - 101, ok[1] - 77]}
        assert up["event"] == "release" and up["button"] == x11
    env.act(A("double_click", point=other))
    assert [e["event"] for e in xserver.take(4)] == ["press", "release"] * 2
    env.act(A("triple_click", point=ok))
    events = xserver.take(6)
    assert [(e["event"], e["window"], e["root"]) for e in events] == [("press", "ok", list(ok)),
                                                                      ("release", "ok", list(ok))] * 3
    env.act(A("drag", point=drag, end=(640, 200)))
    down, up = xserver.take(2)
    assert (down["event"], down["window"], down["root"]) == ("press", "drag", list(drag))
    assert (up["event"], up["root"]) == ("release", [640, 200])
    env.act(A("mouse_down", point=other))
    env.act(A("mouse_up", point=ok))
    down, up = xserver.take(2)
    assert (down["event"], down["window"], down["root"], up["event"], up["root"]) == (
        "press", "other", list(other), "release", list(ok))
    for direction, x11 in (("up", 4), ("down", 5), ("left", 6), ("right", 7)):
        env.act(A("scroll", point=other, direction=direction, amount=2))
        events = xserver.take(4)
        assert [(e["button"], e["window"], e["root"]) for e in events] == [(x11, "other", list(other))] * 4
    env.act(A("mouse_move", point=(333, 222)))
    from Xlib import display as xdisplay

    d = xdisplay.Display()
    pointer = d.screen().root.query_pointer()
    d.close()
    assert (pointer.root_x, pointer.root_y) == (333, 222)

    env.act(A("click", point=text))
    xserver.take(2)
    env.act(A("type", text="Hi there!"))
    typed = [e["char"] for e in xserver.take(11) if e["name"] != "Shift_L"]  # H and ! each shifted
    assert "".join(typed) == "Hi there!"
    env.act(A("key", keys=("ctrl", "a")))
    assert [(e["name"], e["ctrl"]) for e in xserver.take(2)] == [("Control_L", False), ("a", True)]
    env.act(A("key", keys=("enter",)))
    assert xserver.next()["name"] == "Return"

    acted = [r.getMessage() for r in caplog.records if r.name.endswith("desktop")]
    assert len(acted) == 17 and all("\n" not in m for m in acted)
    assert acted[0] == f"desktop: click left at ({ok[0]}, {ok[1]}) from image ({ok[0]}, {ok[1]})"
    assert env.done is False and env.reward == 0.0
    with pytest.raises(InputError, match="outside the 800x600 screenshot"):
        env.act(A("click", point=(800, 10)))
    with pytest.raises(InputError, match="keyboard characters"):
        env.act(A("type", text="café"))
    env.close()


def test_a_retina_capture_acts_at_points(xserver):
    """A capture twice the screen's size (as macOS gives for a Retina screen): scale 0.5, and both
    image pixels of a point act on that point."""
    env = desktop(yes=True)
    grab = env._capture
    env._capture = lambda: grab().resize((SCREEN[0] * 2, SCREEN[1] * 2), Image.NEAREST)
    obs = env.screenshot()
    assert obs.image.size == (1600, 1200) and obs.scale == (0.5, 0.5)
    x, y = find(obs.image, "other")
    for pixel in ((x, y), (x | 1, y | 1)):
        env.act(A("click", point=pixel))
        down, _ = xserver.take(2)
        assert (down["window"], down["root"]) == ("other", [pixel[0] // 2, pixel[1] // 2])
    # the button's last pixel column and row, and the first outside it
    left, top, w, h = BUTTONS["other"][:4]
    env.act(A("click", point=(2 * (left + w) - 1, 2 * (top + h) - 1)))
    assert xserver.take(2)[0]["root"] == [left + w - 1, top + h - 1]
    env.act(A("click", point=(2 * (left + w), 2 * top)))
    assert xserver.take(2)[0] == {"event": "press", "button": 1, "window": "background",
                                  "root": [left + w, top], "at": [left + w, top]}
    env.close()


@pytest.mark.parametrize("size", [(1200, 900), (600, 450), (1000, 660)], ids=["1.5x", "0.75x", "uneven"])
def test_captures_of_other_sizes_act_at_the_point_under_the_pixel(xserver, size):
    """Non-integer ratios (a 150% display; a downscaled capture; a different ratio per axis): each
    button found in the capture is clicked at its centre pixel, which lands on the point holding
    that pixel's centre, inside the button."""
    env = desktop(yes=True)
    grab = env._capture
    env._capture = lambda: grab().resize(size, Image.NEAREST)
    obs = env.screenshot()
    assert obs.scale == (SCREEN[0] / size[0], SCREEN[1] / size[1])
    for name in ("ok", "other", "drag"):
        px = find(obs.image, name)
        env.act(A("click", point=px))
        down, _ = xserver.take(2)
        assert (down["window"], down["root"]) == (name, [math.floor((p + 0.5) * s) for p, s in zip(px, obs.scale)])
    env.close()


def test_asks_before_each_action_and_a_no_ends_the_episode(xserver, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\nn\n"))
    env = desktop()
    obs = env.screenshot()
    ok, other, marker = (find(obs.image, n) for n in ("ok", "other", "marker"))
    env.act(A("wait", seconds=0))  # waits touch nothing: not asked
    env.act(A("click", point=ok))
    asked = f"desktop: click left at ({ok[0]}, {ok[1]}) from image ({ok[0]}, {ok[1]}). Do it? [y/N] "
    assert capsys.readouterr().err == asked
    assert xserver.take(2)[0]["window"] == "ok"
    env.act(A("click", point=other))
    assert "Do it? [y/N]" in capsys.readouterr().err
    assert env.done and env.stop_reason == "the person declined an action"
    with pytest.raises(InputError, match="the episode has ended"):
        env.act(A("click", point=other))
    # the declined click never happened: the next event the window sees is the marker's
    desktop(yes=True, ask_in=io.StringIO("")).act(A("click", point=marker))
    assert xserver.take(2)[0]["window"] == "marker"
    # end of input (no terminal answer) declines too
    env = desktop(ask_in=io.StringIO(""), ask_out=io.StringIO())
    env.act(A("click", point=ok))
    assert env.done


def test_the_fail_safe_stops_the_episode(xserver):
    env = desktop(yes=True)
    obs = env.screenshot()
    ok, marker = find(obs.image, "ok"), find(obs.image, "marker")
    env.act(A("mouse_move", point=(0, 0)))  # a screen corner: pyautogui's fail-safe trips on the next call
    env.act(A("click", point=ok))
    assert env.done and "fail-safe" in env.stop_reason
    from Xlib import display as xdisplay

    d = xdisplay.Display()  # the person moves the mouse out of the corner
    d.screen().root.warp_pointer(400, 300)
    d.sync()
    d.close()
    desktop(yes=True).act(A("click", point=marker))
    assert xserver.take(2)[0]["window"] == "marker"


def test_run_task_on_the_desktop_stops_when_the_person_declines(xserver, monkeypatch, capsys):
    """The runner on this environment (scripted UI-Venus answers in 0-1000 coordinates): the first
    click, accepted, lands on the button the answer names; the second, declined, ends the episode."""
    from mlx_qwen3vl.agent.runner import Answer, run_task

    monkeypatch.setattr(sys, "stdin", io.StringIO("y\nn\n"))
    env = desktop()
    rel = lambda name: [round((BUTTONS[name][i] + BUTTONS[name][i + 2] / 2) / SCREEN[i] * 1000)  # noqa: E731
                        for i in (0, 1)]
    answers = iter(["<action>Click(box=({}, {}))</action>".format(*rel(n)) for n in ("other", "ok", "marker")])
    episode = run_task(None, None, env, answerer=lambda messages: Answer(next(answers)))
    assert episode.reason == "done" and len(episode.steps) == 2 and env.stop_reason == "the person declined an action"
    down = xserver.take(2)[0]
    assert (down["window"], down["root"]) == ("other", list(episode.steps[0].point))
    assert capsys.readouterr().err.count("Do it? [y/N]") == 2
    desktop(yes=True).act(A("click", point=find(env.screenshot().image, "marker")))
    assert xserver.take(2)[0]["window"] == "marker"  # the declined click on "ok" never happened
    env.close()


def test_works_on_a_python_without_tkinter(xserver):
    """pyautogui's mouseinfo exits the process at import on Linux without tkinter; the desktop
    environment still starts and acts there (a fresh process whose tkinter cannot be imported)."""
    code = ("import sys; sys.modules['tkinter'] = None\n"
            "from mlx_qwen3vl.agent.computer_tools import ComputerAction\n"
            "from mlx_qwen3vl.agent.envs.desktop import DesktopEnv\n"
            f"DesktopEnv(yes=True, pause=0).act(ComputerAction('click', point={MARKER}))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).parents[1])
    assert done.returncode == 0, done.stderr[-2000:]
    assert xserver.take(2)[0]["window"] == "marker"
