"""POST /v1/ground and the playground page (GET /) on a scripted-answer checkpoint.

The endpoint's answers equal the library's ground() on the same screenshot, one pass and two
(zoom). The page runs in a real headless browser (Debian's chromium and chromium-driver, driven by
selenium; skipped with the reason where either is missing): a screenshot uploaded through the file
input, an instruction submitted, and the drawn point, box and zoom window read back from the DOM
at the place the answer names on the displayed image (computed from the answer, the image's
natural size and its displayed size); a refused and a malformed answer marked; the chat tab
streaming its answer as text; a running request's spinner, elapsed time and Stop (Locate and Chat);
a picked file that is not an image said at once; a server with a key asking for it; a phone's width. One browser
session and two server processes for the module: the page against a server without a key (so
its Host / Origin rule is what the page's calls meet) and one with a key."""

import base64
import math
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
from PIL import Image, ImageDraw

import mlx_qwen3vl as M
from conftest import asgi_status
from mlx_qwen3vl.agent import ground
from scripted import write_scripted_checkpoint
from test_server import Server

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

KEY = "playground-key"
APPLY = "[523,412]"
BOX = '{"bbox_2d": [422, 454, 578, 546]}'  # with zoom 0.5 on a centred target: pass 2 maps onto the button
CHAT = "It is a <i>Settings</i> page. <img src=x onerror=alert(1)>"
# "Save button" is a trigger as "@zoom" would be: the screenshot the docs show (docs/playground.png,
# from test_zoom_draws_the_window_the_box_and_the_point) reads as a user would type it.
SCRIPT = {"@apply": APPLY, "Save button": BOX, "@absent": "[-1,-1]", "@bad": "<b>nowhere</b> to be seen", "@chat": CHAT}
SIZE = (1280, 800)
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = "/usr/bin/chromedriver" if os.path.exists("/usr/bin/chromedriver") else shutil.which("chromedriver")


def settings_screen(path):
    """A made-up settings window, its Apply button at APPLY's point and the zoom script's box."""
    w, h = SIZE
    im = Image.new("RGB", SIZE, (246, 247, 249))
    d = ImageDraw.Draw(im)
    d.rectangle([0, 0, w - 1, 47], fill=(36, 41, 50))
    d.text((16, 17), "Settings", fill=(255, 255, 255))
    d.rectangle([0, 48, 219, h - 1], fill=(229, 232, 237))
    for i, item in enumerate(["General", "Display", "Network", "Privacy", "About"]):
        d.text((24, 78 + 38 * i), item, fill=(30, 30, 30))
    d.text((260, 84), "Display", fill=(20, 20, 20))
    d.rectangle([260, 120, 900, 156], outline=(180, 184, 190))
    d.text((272, 132), "Resolution: 2560 x 1440", fill=(40, 40, 40))
    x, y = 523 * w // 1000, 412 * h // 1000
    d.rounded_rectangle([x - 48, y - 16, x + 48, y + 16], 6, fill=(31, 111, 235))
    d.text((x - 15, y - 6), "Apply", fill=(255, 255, 255))
    d.rounded_rectangle([590, 382, 690, 418], 6, fill=(26, 127, 55))
    d.text((620, 394), "Save", fill=(255, 255, 255))
    im.save(path)
    return path


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    base = tmp_path_factory.mktemp("playground")
    folder = write_scripted_checkpoint(base / "scripted", SCRIPT, default="It is a screen.")
    shot = settings_screen(base / "settings.png")
    return SimpleNamespace(base=base, folder=folder, shot=shot, data=shot.read_bytes())


@pytest.fixture(scope="module")
def servers(world):
    """(without a key, with KEY), started side by side."""
    with ThreadPoolExecutor(2) as pool:
        started = [pool.submit(Server, "--served-model-name", "scripted-checkpoint", model=world.folder),
                   pool.submit(Server, "--api-key", KEY, model=world.folder)]
        open_, keyed = (f.result() for f in started)
    yield open_, keyed
    open_.stop()
    keyed.stop()


@pytest.fixture(scope="module")
def local(world):
    return M.load(world.folder)


def data_url(data):
    return "data:image/png;base64," + base64.b64encode(data).decode()


def post_ground(server, body, key=None):
    return server.request("POST", "/v1/ground", body, key=key)


# ------------------------------------------------------------------------------ the endpoint


@pytest.mark.parametrize("instruction,fmt,zoom,pixels", [
    ("the Apply button @apply", "venus", None, {}),
    ("the Apply button @apply", "venus", True, {}),  # pass 2 answers the same text about the crop: another point
    ("the Save button", "qwen", 0.5, {}),
    ("the camera @absent", "venus", 0.3, {}),  # a refusal in pass 1 is the answer: no pass 2
    # computer_use's system prompt is ~2,800 tokens: a smaller screenshot keeps it in the 4,096 context
    ("the camera @bad", "computer_use", None, {"max_pixels": 200_000}),
    ("the Apply button @apply", "computer_use", 0.5, {"max_pixels": 200_000, "min_pixels": 100_000}),
    ("the Apply button @apply", "venus", True, {"max_tokens": 3}),  # cut short: "length", malformed, no pass 2
])
def test_ground_endpoint_equals_the_library(servers, local, world, instruction, fmt, zoom, pixels):
    body = {"image": data_url(world.data), "instruction": instruction, "format": fmt, **pixels}
    if zoom is not None:
        body["zoom"] = zoom
    status, got = post_ground(servers[0], body)
    assert status == 200, got
    want = ground(*local, world.data, instruction, format=fmt, zoom=zoom, **pixels)
    assert (got["point"], got["box"], got["status"], got["answer"], got["image_size"]) == (
        list(want.point) if want.point else None, list(want.box) if want.box else None, want.status, want.answer,
        list(SIZE))
    assert got["note"] == M.agent.missing_point_note(want.status)
    assert got["finish_reason"] == want.finish_reason == ("length" if "max_tokens" in pixels else "stop")
    assert got["usage"]["prompt_tokens"] == want.prompt_tokens
    assert got["usage"]["completion_tokens"] == want.generation_tokens
    if zoom is None:
        assert "zoom" not in got
        return
    z = got["zoom"]
    assert (z["window"], z["pass"], len(z["passes"])) == (
        list(want.window) if want.window else None, want.used_pass, len(want.passes))
    for mine, theirs in zip(z["passes"], want.passes):
        assert (mine["answer"], mine["finish_reason"], mine["point"], mine["image_size"],
                mine["timing"]["prompt_tokens"]) == (theirs.answer, theirs.finish_reason,
                                                     list(theirs.point) if theirs.point else None,
                                                     list(theirs.image_size), theirs.prompt_tokens)
    if fmt == "venus" and want.used_pass == 2:  # pass 2 really ran and moved the point
        assert got["point"] != z["passes"][0]["point"]


def test_ground_needs_the_key_and_the_page_is_open(servers, world):
    _, keyed = servers
    body = {"image": data_url(world.data), "instruction": "it @apply"}
    assert post_ground(keyed, body)[0] == 401
    assert post_ground(keyed, body, key="wrong")[0] == 401
    assert post_ground(keyed, body, key=KEY)[0] == 200
    status, headers = keyed.request("GET", "/", key=None, with_headers=True)  # the page holds no data
    assert status == 200 and headers["content-type"].startswith("text/html")


def test_page_headers_and_no_ui(servers):
    from mlx_qwen3vl.server.app import create_app

    server = servers[0]
    for path, kind in (("/", "text/html"), ("/ui/app.js", "text/javascript"), ("/ui/style.css", "text/css")):
        status, h = server.request("GET", path, key=None, with_headers=True)
        assert status == 200 and h["content-type"].startswith(kind), path
        assert h["x-content-type-options"] == "nosniff" and h["x-frame-options"] == "DENY"
        csp = dict(d.strip().split(" ", 1) for d in h["content-security-policy"].split(";"))
        assert csp["default-src"] == csp["script-src"] == csp["style-src"] == csp["connect-src"] == "'self'"
        assert csp["frame-ancestors"] == "'none'"
    assert server.request("GET", "/ui/../pyproject.toml", key=None)[0] == 404
    assert server.request("GET", "/ui/grounding.py", key=None)[0] == 404

    def get(app, path):
        return asgi_status(app, "GET", path, {"host": "127.0.0.1:1"})

    engine = SimpleNamespace(close=lambda: None, processor=SimpleNamespace(tokenizer=None))  # no model: routes only
    assert get(create_app(engine, None, model_id="m", ui=False), "/") == 404  # --no-ui
    assert get(create_app(engine, None, model_id="m", ui=False), "/health") == 200
    assert get(create_app(engine, None, model_id="m"), "/") == 200
    from mlx_qwen3vl.server.__main__ import build_parser

    assert build_parser().parse_args(["--model", "m", "--no-ui"]).no_ui


# ------------------------------------------------------------------------------ the page in a browser


@pytest.fixture(scope="module")
def browser():
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (the test extra)")
    if not CHROMIUM or not DRIVER:
        pytest.skip("no headless browser here: install Debian's chromium and chromium-driver "
                    "(apt-get install chromium chromium-driver; .ci/run does)")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,900", "--hide-scrollbars"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    yield driver
    driver.quit()


def wait(driver, condition, seconds=30):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, seconds, poll_frequency=0.05).until(condition)


def by_id(driver, name):
    return driver.find_element("id", name)


def rect(driver, name):
    r = driver.execute_script("const r = document.getElementById(arguments[0]).getBoundingClientRect();"
                              "return [r.left, r.top, r.width, r.height];", name)
    return SimpleNamespace(left=r[0], top=r[1], width=r[2], height=r[3])


def open_page(driver, server, shot):
    driver.get_log("browser")  # what earlier pages logged
    driver.get(f"http://127.0.0.1:{server.port}/")
    wait(driver, lambda d: by_id(d, "model").text)  # /v1/models answered: the page may call the API
    by_id(driver, "file").send_keys(str(shot))
    wait(driver, lambda d: d.execute_script("const i = document.getElementById('shot');"
                                            "return i.complete && i.naturalWidth > 0;"))


def locate(driver, instruction, fmt="venus", zoom=False):
    from selenium.webdriver.support.ui import Select

    by_id(driver, "tab-ground").click()
    field = by_id(driver, "instruction")
    field.clear()
    field.send_keys(instruction)
    Select(by_id(driver, "format")).select_by_value(fmt)
    if by_id(driver, "zoom").is_selected() != bool(zoom):
        by_id(driver, "zoom").click()
    driver.execute_script("document.getElementById('status').textContent = '';")
    by_id(driver, "locate").click()
    wait(driver, lambda d: by_id(d, "status").text or by_id(d, "error").text)
    assert not by_id(driver, "error").is_displayed(), by_id(driver, "error").text


def expected_centre(driver, point, size=SIZE):
    """Where pixel `point` of the screenshot lies on screen: its centre, scaled to the displayed image."""
    img = rect(driver, "shot")
    natural = driver.execute_script("const i = document.getElementById('shot');"
                                    "return [i.naturalWidth, i.naturalHeight];")
    assert tuple(natural) == size
    return (img.left + (point[0] + 0.5) * img.width / size[0], img.top + (point[1] + 0.5) * img.height / size[1])


def timings(driver):
    """The tokens-and-timings table: {row label: [one cell per column]}, the header row under ""."""
    rows = driver.execute_script("return Array.from(document.querySelectorAll('#timings tr'), "
                                 "r => Array.from(r.children, c => c.textContent));")
    return {r[0]: r[1:] for r in rows}


def marker_centre(driver):
    r = rect(driver, "point")
    return r.left + r.width / 2, r.top + r.height / 2


def box_on_screen(driver, box):
    img = rect(driver, "shot")
    sx, sy = img.width / SIZE[0], img.height / SIZE[1]
    x1, y1, x2, y2 = box
    return img.left + x1 * sx, img.top + y1 * sy, (x2 - x1 + 1) * sx, (y2 - y1 + 1) * sy


def close(a, b, tol=0.1):  # layout positions are exact to 1/64 px
    return all(abs(x - y) <= tol for x, y in zip(a, b))


def test_the_drawn_point_lands_where_the_answer_says(browser, servers, world):
    open_page(browser, servers[0], world.shot)
    locate(browser, "the Apply button @apply")
    point = (math.floor(523 * SIZE[0] / 1000), math.floor(412 * SIZE[1] / 1000))  # (669, 329)
    assert by_id(browser, "point").is_displayed() and not by_id(browser, "failure").is_displayed()
    assert by_id(browser, "answer").text == APPLY
    assert "point (669, 329)" in by_id(browser, "status").text
    img = rect(browser, "shot")
    assert img.width < SIZE[0]  # shown scaled down: the mapping, not the natural pixel, is tested
    assert close(marker_centre(browser), expected_centre(browser, point))
    assert timings(browser)["generated tokens"] == ["10"]  # "[523,412]" and <|im_end|>
    assert browser.get_log("browser") == []  # no CSP violation, no script error


def test_zoom_draws_the_window_the_box_and_the_point(browser, servers, world):
    status, want = post_ground(servers[0], {"image": data_url(world.data), "instruction": "the Save button",
                                            "format": "qwen", "zoom": 0.5})
    assert status == 200 and want["zoom"]["pass"] == 2
    open_page(browser, servers[0], world.shot)
    locate(browser, "the Save button", fmt="qwen", zoom=True)
    w = rect(browser, "zoom-window")
    assert close((w.left, w.top, w.width, w.height), box_on_screen(browser, want["zoom"]["window"]))
    b = rect(browser, "box")
    assert close((b.left, b.top, b.width, b.height), box_on_screen(browser, want["box"]))
    assert close(marker_centre(browser), expected_centre(browser, want["point"]))
    assert "from pass 2" in by_id(browser, "status").text
    table = timings(browser)
    assert table[""] == ["pass 1", "pass 2", "both"] and table["image"] == ["1280×800", "640×400", ""]
    assert table["generated tokens"] == [str(p["timing"]["generation_tokens"]) for p in want["zoom"]["passes"]] + [
        str(want["usage"]["completion_tokens"])]
    browser.save_screenshot(str(world.base / "playground.png"))


@pytest.mark.parametrize("trigger,note", [("@absent", "no point: the model says the target is absent"),
                                          ("@bad", "no point found: the answer could not be read")])
def test_a_failed_answer_is_marked(browser, servers, world, trigger, note):
    open_page(browser, servers[0], world.shot)
    locate(browser, f"the camera {trigger}", zoom=True)
    failure = by_id(browser, "failure")
    assert failure.is_displayed() and failure.text == note
    assert not by_id(browser, "point").is_displayed() and not by_id(browser, "zoom-window").is_displayed()
    assert "failed" in by_id(browser, "stage").get_attribute("class")
    assert "failed" in by_id(browser, "status").get_attribute("class")
    answer = by_id(browser, "answer")
    assert answer.text == SCRIPT[trigger] and answer.find_elements("css selector", "*") == []  # text, not HTML
    browser.save_screenshot(str(world.base / f"failed{trigger[1:]}.png"))


def test_the_chat_tab_streams_its_answer_as_text(browser, servers, world):
    open_page(browser, servers[0], world.shot)
    by_id(browser, "tab-chat").click()
    assert not by_id(browser, "ground-panel").is_displayed()
    by_id(browser, "question").send_keys("What is on this screen? @chat")
    by_id(browser, "send").click()
    wait(browser, lambda d: by_id(d, "chat-stats").text or by_id(d, "error").text)
    assert not by_id(browser, "error").is_displayed(), by_id(browser, "error").text
    replies = browser.find_elements("css selector", "#chat-log .msg.assistant")
    assert [r.get_attribute("textContent") for r in replies] == [CHAT]
    assert replies[0].find_elements("css selector", "*") == []  # the markup stayed text
    stats = by_id(browser, "chat-stats").text
    tokens, chunks = int(stats.split()[0]), int(stats.split(" in ")[1].split()[0])
    assert tokens > 3 and chunks > 1, stats  # streamed: the answer came in pieces
    prompt = int(stats.split("prompt ")[1].split()[0])
    assert prompt > 100, stats  # the screenshot went with the question (a text-only prompt is a few dozen tokens)
    assert browser.get_log("browser") == []


@pytest.mark.parametrize("how", ["paste", "drop"])
def test_a_pasted_or_dropped_screenshot_is_taken(browser, servers, world, how):
    browser.get_log("browser")
    browser.get(f"http://127.0.0.1:{servers[0].port}/")
    wait(browser, lambda d: by_id(d, "model").text)
    browser.execute_script("""
        const canvas = document.createElement('canvas');
        canvas.width = 200; canvas.height = 100;
        canvas.getContext('2d').fillRect(10, 10, 50, 20);
        canvas.toBlob((blob) => {
          const data = new DataTransfer();
          data.items.add(new File([blob], 'shot.png', {type: 'image/png'}));
          const ev = arguments[0] === 'paste' ? new ClipboardEvent('paste', {clipboardData: data, bubbles: true})
            : new DragEvent('drop', {dataTransfer: data, bubbles: true, cancelable: true});
          (arguments[0] === 'paste' ? document : document.getElementById('drop')).dispatchEvent(ev);
        }, 'image/png');""", how)
    wait(browser, lambda d: by_id(d, "image-info").text)
    assert by_id(browser, "image-info").text == "shot.png: 200 × 100 px"
    locate(browser, "the Apply button @apply")
    assert close(marker_centre(browser), expected_centre(browser, (104, 41), size=(200, 100)))


def test_with_a_key_the_page_asks_for_it(browser, servers, world):
    _, keyed = servers
    browser.get_log("browser")
    browser.get(f"http://127.0.0.1:{keyed.port}/")
    wait(browser, lambda d: by_id(d, "key-form").is_displayed())
    by_id(browser, "key").send_keys("not-the-key")
    by_id(browser, "key-form").find_element("css selector", "button").click()
    wait(browser, lambda d: by_id(d, "key-error").is_displayed())
    assert "refused" in by_id(browser, "key-error").text
    by_id(browser, "key").send_keys(KEY)
    by_id(browser, "key-form").find_element("css selector", "button").click()
    wait(browser, lambda d: not by_id(d, "key-form").is_displayed())
    assert by_id(browser, "model").text == str(world.folder)
    by_id(browser, "file").send_keys(str(world.shot))
    locate(browser, "the Apply button @apply")  # the key goes with each call
    assert by_id(browser, "answer").text == APPLY
    assert browser.execute_script("return window.localStorage.length;") == 0  # memory only: not opted in
    browser.get(f"http://127.0.0.1:{keyed.port}/")  # a reload forgets it
    wait(browser, lambda d: by_id(d, "key-form").is_displayed())
    browser.get_log("browser")  # the 401s the page met on purpose


def test_a_phone_s_width(browser, servers, world):
    browser.set_window_size(375, 812)
    try:
        open_page(browser, servers[0], world.shot)
        assert browser.execute_script("return window.innerWidth;") <= 375
        locate(browser, "the Apply button @apply")
        overflow = browser.execute_script("return document.documentElement.scrollWidth - window.innerWidth;")
        assert overflow <= 0, f"the page is {overflow} px wider than the phone"
        img = rect(browser, "shot")
        assert img.width < 375
        assert close(marker_centre(browser), expected_centre(browser, (669, 329)))
        assert rect(browser, "locate").width > 0 and rect(browser, "instruction").left >= 0
        browser.save_screenshot(str(world.base / "phone.png"))
    finally:
        browser.set_window_size(1280, 900)


# The page's own fetch, holding its API calls until the test lets each go (window.__held[i]()), and
# keeping their bodies: a request that takes as long as the test needs, on the real server.
HOLD = """
  window.__held = []; window.__bodies = [];
  const real = window.fetch;
  window.fetch = (url, init) => {
    if (!/\\/v1\\/(ground|chat\\/completions)$/.test(String(url))) return real(url, init);
    window.__bodies.push(JSON.parse(init.body));
    return new Promise((resolve, reject) => {
      init.signal.addEventListener("abort", () => reject(new DOMException("aborted", "AbortError")));
      window.__held.push(() => real(url, init).then(resolve, reject));
    });
  };"""


def progress_seconds(driver):
    text = by_id(driver, "progress-text").text  # "Locating… 1.3 s"
    return float(text.split("…")[1].split()[0])


def held(driver):
    return driver.execute_script("return window.__held.length;")


def assert_progress_then_stop(driver, label, button):
    wait(driver, lambda d: by_id(d, "progress").is_displayed())
    assert by_id(driver, "progress-text").text.startswith(label + "…")
    spinner = driver.find_element("css selector", "#progress .spinner")
    assert spinner.is_displayed() and spinner.value_of_css_property("animation-name") == "spin"
    assert not by_id(driver, button).is_enabled()
    wait(driver, lambda d: progress_seconds(d) >= 0.3)  # the elapsed time goes on while it waits
    by_id(driver, "stop").click()
    wait(driver, lambda d: not by_id(d, "progress").is_displayed())
    assert by_id(driver, "notice").text.startswith("Stopped after"), by_id(driver, "notice").text
    assert not by_id(driver, "error").is_displayed() and by_id(driver, button).is_enabled()


def test_a_running_locate_shows_a_spinner_the_time_and_stops(browser, servers, world):
    open_page(browser, servers[0], world.shot)
    browser.execute_script(HOLD)
    by_id(browser, "instruction").send_keys("the Apply button @apply")
    by_id(browser, "locate").click()
    assert_progress_then_stop(browser, "Locating", "locate")
    assert not by_id(browser, "ground-result").is_displayed() and not by_id(browser, "point").is_displayed()
    by_id(browser, "locate").click()  # again, and this time it goes through to the server
    wait(browser, lambda d: held(d) == 2)
    assert by_id(browser, "progress").is_displayed() and not by_id(browser, "notice").is_displayed()
    browser.execute_script("window.__held[1]();")
    wait(browser, lambda d: by_id(d, "status").text)
    assert not by_id(browser, "progress").is_displayed() and by_id(browser, "answer").text == APPLY
    assert by_id(browser, "point").is_displayed()
    assert browser.get_log("browser") == []


def test_a_running_chat_answer_shows_progress_and_stops(browser, servers, world):
    open_page(browser, servers[0], world.shot)
    browser.execute_script(HOLD)
    by_id(browser, "tab-chat").click()
    by_id(browser, "question").send_keys("What is this? @chat")
    by_id(browser, "send").click()
    assert_progress_then_stop(browser, "Answering", "send")
    replies = browser.find_elements("css selector", "#chat-log .msg.assistant")
    assert [r.get_attribute("textContent") for r in replies] == ["[stopped]"]
    assert "stopped" in replies[0].get_attribute("class")
    by_id(browser, "question").send_keys("And now? @chat")
    by_id(browser, "send").click()
    wait(browser, lambda d: held(d) == 2)
    browser.execute_script("window.__held[1]();")
    wait(browser, lambda d: by_id(d, "chat-stats").text or by_id(d, "error").text)
    assert not by_id(browser, "error").is_displayed(), by_id(browser, "error").text
    sent = browser.execute_script("return window.__bodies[1].messages;")
    # the stopped turn is not in the chat: the new question goes alone, with the screenshot
    assert len(sent) == 1 and sent[0]["content"][-1] == {"type": "text", "text": "And now? @chat"}
    assert sent[0]["content"][0]["type"] == "image_url"
    replies = browser.find_elements("css selector", "#chat-log .msg.assistant")
    assert [r.get_attribute("textContent") for r in replies] == ["[stopped]", CHAT]
    assert browser.get_log("browser") == []


@pytest.mark.parametrize("name,says", [("notes.png", "notes.png could not be read as an image"),
                                       ("notes.txt", "notes.txt is not an image (text/plain)")])
def test_a_file_that_is_not_an_image_is_said_at_once(browser, servers, world, name, says):
    """Said when it is picked, not at Locate: a text file, named as one or as a PNG."""
    open_page(browser, servers[0], world.shot)
    bad = world.base / name
    bad.write_text("not an image\n")
    by_id(browser, "file").send_keys(str(bad))
    wait(browser, lambda d: by_id(d, "error").is_displayed())
    assert by_id(browser, "error").text.startswith(says), by_id(browser, "error").text
    if name.endswith(".png"):  # the screenshot it replaced is gone: Locate asks for one
        assert not by_id(browser, "stage").is_displayed()
        by_id(browser, "instruction").send_keys("the Apply button @apply")
        by_id(browser, "locate").click()
        wait(browser, lambda d: "screenshot" in by_id(d, "error").text)
    browser.get_log("browser")  # the broken image's load error, on purpose
