"""The browser environment (selenium, headless Chromium) at devicePixelRatio 1 and 2, on a local
page whose handlers record every event's kind, target, button, clientX / clientY, key, and the
scroll positions. Each target's screenshot pixel is computed from its bounding rect × dpr (or found
by its colour in the environment's own screenshot), the action is given in those image pixels, and
the page says what it received: the element meant, at the CSS pixel holding that device pixel
(odd device pixels at dpr 2 included, and the pixels either side of a boundary between two
elements). One Chromium per dpr for the module; skipped, with the reason, without Debian's
chromium and chromium-driver."""

import math
import os
import shutil

import numpy as np
import pytest

from mlx_qwen3vl.agent.computer_tools import SCROLL_CLICK_PIXELS
from mlx_qwen3vl.agent.computer_tools import ComputerAction as A
from mlx_qwen3vl.errors import InputError

VIEWPORT = (640, 480)
PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><style>
  body { margin: 0; font: 16px sans-serif; }
  div, input, p { position: absolute; box-sizing: border-box; margin: 0; }
  #left { left: 101px; top: 41px; width: 50px; height: 30px; background: #ff0000; }
  #right { left: 151px; top: 41px; width: 50px; height: 30px; background: #0000ff; }
  #btn { left: 233px; top: 97px; width: 81px; height: 29px; background: #00c800; }
  #hover { left: 401px; top: 57px; width: 61px; height: 41px; background: #c8c800; }
  #src { left: 31px; top: 181px; width: 41px; height: 41px; background: #c800c8; }
  #dst { left: 231px; top: 181px; width: 81px; height: 61px; background: #00c8c8; }
  #para { left: 351px; top: 121px; width: 250px; }
  #input { left: 331px; top: 171px; width: 161px; height: 25px; }
  #input2 { left: 331px; top: 211px; width: 161px; height: 25px; }
  #scroller { left: 31px; top: 261px; width: 201px; height: 101px; overflow: scroll; }
  #content { position: static; width: 2000px; height: 2000px; }
  #newtab { position: absolute; left: 501px; top: 261px; width: 81px; height: 25px; background: #808080; }
</style></head><body>
<div id="left"></div><div id="right"></div><div id="btn"></div><div id="hover"></div>
<div id="src"></div><div id="dst"></div>
<p id="para">Three clicks select this whole paragraph.</p>
<input id="input"><input id="input2">
<div id="scroller"><div id="content"></div></div>
<a id="newtab" href="second.html" target="_blank"></a>
<script>
  window.log = [];
  const keep = ["mousedown", "mouseup", "click", "dblclick", "contextmenu", "auxclick", "wheel", "keydown"];
  for (const kind of keep.concat(["mousemove"])) {
    document.addEventListener(kind, (e) => {
      if (kind === "mousemove" && !["hover", "dst"].includes(e.target.id)) return;
      window.log.push({type: kind, id: e.target.id, button: e.button, x: e.clientX, y: e.clientY,
                       detail: e.detail, key: e.key, ctrl: e.ctrlKey, shift: e.shiftKey,
                       dx: e.deltaX, dy: e.deltaY});
    }, true);
  }
  document.getElementById("btn").addEventListener("click", () => { window.agentScore = {done: true, reward: 1}; });
</script></body></html>
"""
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = "/usr/bin/chromedriver" if os.path.exists("/usr/bin/chromedriver") else shutil.which("chromedriver")


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    path = tmp_path_factory.mktemp("browser") / "page.html"
    path.write_text(PAGE)
    (path.parent / "second.html").write_text('<html><body style="margin:0; background: #0000c8"></body></html>')
    return path.as_uri()


@pytest.fixture(scope="module", params=[1, 2], ids=["dpr1", "dpr2"])
def env(request, page):
    pytest.importorskip("selenium", reason="selenium is not installed (the agent and test extras)")
    if not CHROMIUM or not DRIVER:
        pytest.skip("no headless browser here: install Debian's chromium and chromium-driver "
                    "(apt-get install chromium chromium-driver; .ci/run does)")
    from mlx_qwen3vl.agent.envs.browser import BrowserEnv

    env = BrowserEnv(page, task="press the green button", viewport=VIEWPORT, device_scale_factor=request.param)
    yield env
    env.close()


def fresh(env):
    obs, task = env.reset()
    assert task == "press the green button"
    return obs


def events(env):
    """What the page recorded since the last call."""
    return env.driver.execute_script("const l = window.log; window.log = []; return l;")


def rect(env, id_):
    return env.driver.execute_script(f"const r = document.getElementById('{id_}').getBoundingClientRect();"
                                     "return [r.left, r.top, r.width, r.height];")


def pixel(env, id_, fx=0.5, fy=0.5, odd=True):
    """The screenshot pixel at fraction (fx, fy) of the element's box (made odd at dpr 2, the half of
    a CSS pixel a fractional mapping would round onto the next one), and the CSS pixel expected."""
    left, top, w, h = rect(env, id_)
    p = [math.floor((left + fx * w) * env.dpr), math.floor((top + fy * h) * env.dpr)]
    if odd and env.dpr == 2:
        p = [v | 1 for v in p]
    css = [math.floor((v + 0.5) / env.dpr) for v in p]
    return tuple(p), css


def test_screenshot_is_the_viewport_in_device_pixels(env):
    obs = fresh(env)
    assert obs.image.size == (VIEWPORT[0] * env.dpr, VIEWPORT[1] * env.dpr)
    assert obs.scale == (1 / env.dpr, 1 / env.dpr) and obs.origin == (0.0, 0.0)
    assert env.driver.execute_script("return [innerWidth, innerHeight, devicePixelRatio]") == [*VIEWPORT, env.dpr]
    # the red box is drawn exactly at its CSS rect × dpr
    a = np.asarray(obs.image)
    ys, xs = np.nonzero((a == (255, 0, 0)).all(axis=2))
    assert (xs.min(), xs.max() + 1, ys.min(), ys.max() + 1) == tuple(v * env.dpr for v in (101, 151, 41, 71))
    assert env.done is False and env.reward == 0.0


def test_a_click_found_in_the_screenshot_lands_on_it(env):
    obs = fresh(env)
    ys, xs = np.nonzero((np.asarray(obs.image) == (0, 200, 0)).all(axis=2))
    at = (int(xs.min() + xs.max()) // 2, int(ys.min() + ys.max()) // 2)
    env.act(A("click", point=at))
    log = events(env)
    assert [(e["type"], e["id"], e["button"]) for e in log] == [("mousedown", "btn", 0), ("mouseup", "btn", 0),
                                                                 ("click", "btn", 0)]
    assert [log[0]["x"], log[0]["y"]] == [math.floor((v + 0.5) / env.dpr) for v in at]


def test_the_pixels_either_side_of_a_boundary(env):
    """#left ends and #right starts at CSS 151: device pixels 151·dpr − 1 and 151·dpr."""
    fresh(env)
    edge = 151 * env.dpr
    for x, meant in ((edge - 1, "left"), (edge, "right"), (101 * env.dpr, "left"), (101 * env.dpr - 1, "")):
        env.act(A("click", point=(x, 50 * env.dpr)))
        down = events(env)[0]
        assert (down["id"], down["x"]) == (meant, math.floor((x + 0.5) / env.dpr))


@pytest.mark.parametrize("button, code", [("left", 0), ("middle", 1), ("right", 2)])
def test_click_buttons(env, button, code):
    fresh(env)
    at, css = pixel(env, "btn", 0.3, 0.7)
    env.act(A("click", point=at, button=button))
    log = events(env)
    want = {"left": ["mousedown", "mouseup", "click"], "middle": ["mousedown", "mouseup", "auxclick"],
            "right": ["mousedown", "contextmenu", "mouseup", "auxclick"]}[button]
    assert [e["type"] for e in log] == want
    assert all((e["id"], e["button"], [e["x"], e["y"]]) == ("btn", code, css) for e in log)


def test_double_and_triple_click(env):
    fresh(env)
    at, css = pixel(env, "btn", 0.8, 0.2)
    env.act(A("double_click", point=at))
    log = events(env)
    assert [(e["type"], e["detail"]) for e in log] == [("mousedown", 1), ("mouseup", 1), ("click", 1),
                                                       ("mousedown", 2), ("mouseup", 2), ("click", 2),
                                                       ("dblclick", 2)]
    assert all((e["id"], [e["x"], e["y"]]) == ("btn", css) for e in log)
    at, css = pixel(env, "para", 0.2, 0.5)
    env.act(A("triple_click", point=at))
    clicks = [(e["id"], e["detail"], [e["x"], e["y"]]) for e in events(env) if e["type"] == "click"]
    assert clicks == [("para", n, css) for n in (1, 2, 3)]
    selected = env.driver.execute_script("return getSelection().toString().trim()")
    assert selected == "Three clicks select this whole paragraph."


def test_mouse_move_drag_and_buttons_held(env):
    fresh(env)
    at, css = pixel(env, "hover", 0.25, 0.75)
    env.act(A("mouse_move", point=at))
    assert [(e["type"], e["id"], [e["x"], e["y"]]) for e in events(env)] == [("mousemove", "hover", css)]
    start, start_css = pixel(env, "src")
    end, end_css = pixel(env, "dst", 0.7, 0.6)
    env.act(A("drag", point=start, end=end))
    log = events(env)
    assert (log[0]["type"], log[0]["id"], [log[0]["x"], log[0]["y"]]) == ("mousedown", "src", start_css)
    up = [e for e in log if e["type"] == "mouseup"]
    assert [(e["id"], [e["x"], e["y"]]) for e in up] == [("dst", end_css)]
    assert any(e["type"] == "mousemove" and e["id"] == "dst" for e in log)  # the page saw it travel
    env.act(A("mouse_down", point=pixel(env, "btn")[0]))
    env.act(A("mouse_up", point=at))
    log = events(env)
    # (the browser then clicks their common ancestor, the page)
    assert [(e["type"], e["id"]) for e in log if e["type"] != "mousemove"] == [("mousedown", "btn"),
                                                                               ("mouseup", "hover"), ("click", "")]
    # without a point, a click acts where the mouse is
    env.act(A("click"))
    assert {(e["id"], e["x"], e["y"]) for e in events(env) if e["type"] != "mousemove"} == {("hover", *css)}


def test_scroll_by_wheel_clicks_where_meant(env):
    fresh(env)
    at, css = pixel(env, "scroller", 0.4, 0.4)
    position = "const s = document.getElementById('scroller'); return [s.scrollLeft, s.scrollTop];"
    for direction, amount, want in (("down", 3, [0, 300]), ("up", 1, [0, 200]), ("right", 2, [200, 200]),
                                    ("left", 1, [100, 200])):
        env.act(A("scroll", point=at, direction=direction, amount=amount))
        wheel = [e for e in events(env) if e["type"] == "wheel"]
        step = amount * SCROLL_CLICK_PIXELS
        assert len(wheel) == 1 and [wheel[0]["x"], wheel[0]["y"]] == css and wheel[0]["id"] == "content"
        # the page scrolls amount × SCROLL_CLICK_PIXELS CSS pixels at any dpr, applied before act
        # returned (the wheel event's own delta is divided by the emulated dpr in Chromium)
        assert env.driver.execute_script(position) == want
        sign = {"down": (0, 1), "up": (0, -1), "right": (1, 0), "left": (-1, 0)}[direction]
        assert (wheel[0]["dx"], wheel[0]["dy"]) == (sign[0] * step / env.dpr, sign[1] * step / env.dpr)
    assert env.driver.execute_script("return scrollY") == 0  # the page itself did not move


def test_type_and_keys(env):
    fresh(env)
    env.act(A("click", point=pixel(env, "input")[0]))
    env.act(A("type", text="Hello, wörld!"))
    value = "return document.getElementById('input').value"
    assert env.driver.execute_script(value) == "Hello, wörld!"
    events(env)
    env.act(A("key", keys=("ctrl", "a")))
    env.act(A("key", keys=("backspace",)))
    assert env.driver.execute_script(value) == ""
    env.act(A("type", text="ab"))
    env.act(A("key", keys=("left",)))
    env.act(A("key", keys=("shift", "home")))
    env.act(A("key", keys=("enter",)))
    env.act(A("key", keys=("esc",)))
    keys = [(e["key"], e["ctrl"], e["shift"]) for e in events(env) if e["type"] == "keydown"]
    assert keys == [("Control", True, False), ("a", True, False), ("Backspace", False, False), ("a", False, False),
                    ("b", False, False), ("ArrowLeft", False, False), ("Shift", False, True), ("Home", False, True),
                    ("Enter", False, False), ("Escape", False, False)]
    assert env.driver.execute_script("const i = document.getElementById('input');"
                                     "return [i.selectionStart, i.selectionEnd]") == [0, 1]
    env.act(A("key", keys=("tab",)))
    assert env.driver.execute_script("return document.activeElement.id") == "input2"


def test_score_hook_refusals_and_no_ops(env, page):
    from mlx_qwen3vl.agent.envs.browser import BrowserEnv

    fresh(env)
    scored = BrowserEnv(page, driver=env.driver, viewport=VIEWPORT, device_scale_factor=env.dpr,
                        score_script="return window.agentScore || null;")
    scored.screenshot()
    assert (scored.done, scored.reward) == (False, 0.0)
    scored.act(A("click", point=pixel(env, "btn")[0]))
    assert (scored.done, scored.reward) == (True, 1.0)
    scored.close()  # a driver it was given stays open
    assert env.driver.execute_script("return 1") == 1
    env.act(A("wait", seconds=0))
    env.act(A("screenshot"))
    w, h = VIEWPORT[0] * int(env.dpr), VIEWPORT[1] * int(env.dpr)
    with pytest.raises(InputError, match=f"outside the {w}x{h} screenshot"):
        env.act(A("click", point=(w, 0)))
    with pytest.raises(InputError, match="no key 'capslock'"):
        env.act(A("key", keys=("capslock",)))
    assert [e["type"] for e in events(env) if e["type"] != "mousemove"] == ["mousedown", "mouseup", "click"]


@pytest.mark.parametrize("fmt", ["venus", "qwen"])
def test_run_task_acts_where_the_answer_points(env, fmt):
    """The runner on this environment (answers scripted, in the models' 0-1000 coordinates of the
    screenshot): a click on the text field, typing into it, then the end of the task."""
    from mlx_qwen3vl.agent.runner import Answer, run_task

    fresh(env)
    left, top, w, h = rect(env, "input")
    x, y = round((left + w / 2) / VIEWPORT[0] * 1000), round((top + h / 2) / VIEWPORT[1] * 1000)
    if fmt == "venus":
        script = [f"<action>Click(box=({x}, {y}))</action>", "<action>Type(content='hello')</action>",
                  "<action>Finished()</action>"]
    else:
        call = '<tool_call>\n{{"name": "computer_use", "arguments": {}}}\n</tool_call>'.format
        script = [call(f'{{"action": "left_click", "coordinate": [{x}, {y}]}}'),
                  call('{"action": "type", "text": "hello"}'), call('{"action": "terminate", "status": "success"}')]
    answers = iter(script)
    episode = run_task(None, None, env, agent_format=fmt, answerer=lambda messages: Answer(next(answers)))
    assert episode.reason == "terminate" and len(episode.steps) == 3 and episode.reward == 0.0
    first = episode.steps[0]
    assert first.image_size == (VIEWPORT[0] * env.dpr, VIEWPORT[1] * env.dpr)
    click = [e for e in events(env) if e["type"] == "click"]
    assert [(e["id"], [e["x"], e["y"]]) for e in click] == [("input", [math.floor((v + 0.5) / env.dpr)
                                                                        for v in first.point])]
    assert env.driver.execute_script("return document.getElementById('input').value") == "hello"


def test_a_new_tab_becomes_the_page_shown(env):
    fresh(env)
    first = env.driver.current_window_handle
    env.act(A("click", point=pixel(env, "newtab")[0]))
    try:
        assert env.driver.current_url.endswith("/second.html")
        obs = env.screenshot()  # the new tab, at the same viewport and dpr
        assert obs.image.size == (VIEWPORT[0] * env.dpr, VIEWPORT[1] * env.dpr)
        corners = {obs.image.getpixel((x, y)) for x in (0, obs.image.width - 1) for y in (0, obs.image.height - 1)}
        assert corners == {(0, 0, 200)}
    finally:
        env.driver.close()
        env.driver.switch_to.window(first)


def test_a_fractional_dpr(env, page):
    """devicePixelRatio 1.5 (on this module's browser, whose own ratio the next reset restores):
    the corners of each box as drawn in the screenshot are clicked, and land on that box."""
    from mlx_qwen3vl.agent.envs.browser import BrowserEnv

    odd = BrowserEnv(page, driver=env.driver, viewport=VIEWPORT, device_scale_factor=1.5)
    obs, _ = odd.reset()
    assert obs.image.size == (960, 720) and obs.scale == (2 / 3, 2 / 3)
    a = np.asarray(obs.image)
    for id_, colour in (("left", (255, 0, 0)), ("right", (0, 0, 255)), ("btn", (0, 200, 0))):
        ys, xs = np.nonzero((a == colour).all(axis=2))
        for x in (xs.min(), xs.max()):
            for y in (ys.min(), ys.max()):
                odd.act(A("click", point=(int(x), int(y))))
                assert events(env)[0]["id"] == id_, (id_, x, y)
