"""The MCP server (python -m mlx_qwen3vl.mcp) driven by the official SDK's own client: over stdio, one
server process on a scripted checkpoint for the module, each tool's answer equal to the library's
(ground() / generate() on the same conversation); screenshots as image content, data URLs and
allowed paths, with the path rule tried as an attack; budgets and bad arguments as one-line tool
errors; and over streamable HTTP on 127.0.0.1, the key rule and the body limit."""

import ast
import base64
import http.client
import io
import json
import math
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

mcp = pytest.importorskip("mcp")

import mlx_qwen3vl as M  # noqa: E402
from mlx_qwen3vl.agent import ground, parse_grounding  # noqa: E402
from mlx_qwen3vl.agent.computer_use import AGENT_SAMPLING, ComputerStep, computer_messages, map_answer  # noqa: E402
from anyio.from_thread import start_blocking_portal  # noqa: E402
from conftest import asgi_status, exif_image  # noqa: E402
from scripted import write_scripted_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ENV = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
CALL = ('<tool_call>\n{"name": "computer_use", "arguments": {"action": "left_click", "coordinate": [500, 300]}}'
        '\n</tool_call>')
BOX = '{"bbox_2d": [100, 200, 300, 400]}'
VENUS_BOX = "<action>Click(box=(100, 200, 300, 400))</action>"  # UI-Venus answers a box too
SCRIPT = {"@find": BOX, "@act": CALL, "@ask": "It says Apply.", "@tapbox": VENUS_BOX}
MAX_PIXELS = 1_000_000  # the server's --max-request-pixels here
MAX_BYTES = 300_000  # --max-image-bytes
SESSIONS, PER_CLIENT = 16, 4  # the HTTP server's --max-sessions, --max-sessions-per-client

rng = np.random.default_rng(0)
SHOT = rng.integers(0, 256, (120, 200, 3), dtype=np.uint8)
OTHER = 255 - SHOT  # same size, other content


def png(pixels) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def content(data: bytes) -> dict:
    return {"type": "image", "data": base64.b64encode(data).decode(), "mimeType": "image/png"}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    base = tmp_path_factory.mktemp("mcp")
    allowed, outside = base / "allowed", base / "outside"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "shot.png").write_bytes(png(SHOT))
    (outside / "secret.png").write_bytes(png(OTHER))
    (allowed / "link.png").symlink_to(outside / "secret.png")  # a link out of the folder
    (allowed / "notes.png").write_bytes(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n")  # not an allowed format
    (allowed / "big.png").write_bytes(png(np.zeros((1000, 1001, 3), np.uint8)))  # 1,001,000 pixels
    os.mkfifo(allowed / "pipe.png")  # would block a reader that opened it naively
    return {"folder": write_scripted_checkpoint(base / "scripted", SCRIPT), "allowed": allowed, "outside": outside}


@pytest.fixture(scope="module")
def local(world):
    return M.load(world["folder"])


@pytest.fixture(scope="module")
def client(world):
    """call(name, args) → CallToolResult, through the SDK's Client over stdio to one server process."""
    params = mcp.StdioServerParameters(
        command=sys.executable, cwd=str(ROOT), env=ENV,
        args=["-m", "mlx_qwen3vl.mcp", "--model", str(world["folder"]), "--allowed-image-dir", str(world["allowed"]),
              "--max-request-pixels", str(MAX_PIXELS), "--max-image-bytes", str(MAX_BYTES)])
    with start_blocking_portal() as portal:
        with portal.wrap_async_context_manager(mcp.Client(params, read_timeout_seconds=120)) as c:
            yield type("Caller", (), {"call": staticmethod(lambda name, args: portal.call(c.call_tool, name, args)),
                                      "tools": staticmethod(lambda: portal.call(c.list_tools))})


def ok(result) -> dict:
    assert not result.is_error, result.content[0].text
    return result.structured_content


def error(result) -> str:
    assert result.is_error and len(result.content) == 1
    text = result.content[0].text
    assert "\n" not in text and "Traceback" not in text
    return text


def test_the_tools_are_declared(client):
    tools = {t.name: t for t in client.tools().tools}
    assert set(tools) == {"ground", "next_action", "ask"}
    assert tools["ground"].input_schema["required"] == ["screenshot", "instruction"]
    assert tools["next_action"].input_schema["required"] == ["screenshot", "task"]
    assert tools["ask"].input_schema["required"] == ["screenshot", "question"]


def test_ground_equals_the_library(client, local):
    data = png(SHOT)
    for fmt in (None, "venus", "computer_use"):
        args = {"screenshot": content(data), "instruction": "the Apply button @find"}
        got = ok(client.call("ground", {**args, "format": fmt} if fmt else args))
        want = ground(*local, data, "the Apply button @find", format=fmt or "venus")  # the CLI's default
        assert (got["point"], got["box"], got["status"], got["answer"]) == (
            list(want.point), list(want.box), want.status, want.answer)
        assert got["screen_size"] == got["image_size"] == [200, 120]
    # Answered on a screen of another size (a Retina screen's points): the same relative place.
    got = ok(client.call("ground", {"screenshot": content(data), "instruction": "it @find", "screen_width": 1366,
                                    "screen_height": 768}))
    g = parse_grounding(BOX, 1366, 768)
    assert (got["point"], got["box"], got["screen_size"]) == (list(g.point), list(g.box), [1366, 768])


def test_ground_zoom_equals_the_library(client, local):
    """Two-stage grounding through the tool: the library's answer, and on a screen of another size
    pass 2's box carried through its window to the same relative place (by hand, below)."""
    shot = np.zeros((600, 1000, 3), np.uint8)
    shot[::7] = 200  # 1000x600: half of each side (150,000 pixels) is over the model's minimum (65,536)
    data = png(shot)
    want = ground(*local, data, "it @find", format="qwen", zoom=True)
    assert want.used_pass == 2
    got = ok(client.call("ground", {"screenshot": content(data), "instruction": "it @find", "zoom": True,
                                    "format": "qwen"}))
    assert (got["point"], got["box"], got["status"]) == (list(want.point), list(want.box), want.status)
    z = got["zoom"]
    assert (z["fraction"], z["window"], z["pass"]) == (0.5, list(want.window), 2)
    assert [p["answer"] for p in z["passes"]] == [p.answer for p in want.passes] == [BOX, BOX]
    got = ok(client.call("ground", {"screenshot": content(data), "instruction": "it @find", "zoom": 0.5,
                                    "format": "qwen", "screen_width": 1366, "screen_height": 768}))
    x1, y1, x2, y2 = want.window

    def on_screen(v, offset, extent, size, screen):  # crop-relative → whole-relative → screen pixel
        return min(screen - 1, math.floor((1000 * offset + v * extent) * screen / (size * 1000)))

    px = lambda v: on_screen(v, x1, x2 - x1 + 1, 1000, 1366)  # noqa: E731
    py = lambda v: on_screen(v, y1, y2 - y1 + 1, 600, 768)  # noqa: E731
    assert got["point"] == [px(200), py(300)] and got["box"] == [px(100), py(200), px(300), py(400)]
    for bad in (2, 0, "yes"):
        assert "'zoom'" in error(client.call("ground", {"screenshot": content(data), "instruction": "x",
                                                        "zoom": bad}))


def test_next_action_equals_the_library(client, local):
    data = png(OTHER)
    history = [CALL, "I opened the menu.\n" + CALL]
    got = ok(client.call("next_action", {"screenshot": content(data), "task": "Open the settings @act",
                                         "history": history}))
    messages = computer_messages("Open the settings @act", data, [ComputerStep(answer=a) for a in history])
    want = M.generate(*local, messages=messages, max_tokens=512, **AGENT_SAMPLING["qwen"]).text
    assert got["answer"] == want == CALL
    turn = map_answer(want, (200, 120))
    assert (got["status"], got["actions"]) == ("action", [a.to_dict() for a in turn.actions])
    assert got["actions"] == [{"type": "click", "point": [100, 36], "button": "left"}]
    assert got["parsed"]["name"] == "left_click"


@pytest.mark.parametrize("orientation", [6, 8, 5, 7, 3])
def test_rotated_screenshots_answer_in_the_upright_pixels(client, local, orientation):
    """A JPEG stored 640x360 with an EXIF orientation is seen upright by the model: ground and
    next_action (no screen size) report and map in the upright size, and zoom's window lies in it.
    By hand, on 360x640: the box [100, 200, 300, 400] is [36, 128, 108, 256], its centre [72, 192];
    the click [500, 300] is [180, 192] (on 640x360, turned half: [64, 72, 192, 144], [128, 108] and [320, 108])."""
    data = exif_image(640, 360, orientation)
    turned = orientation != 3
    size = [360, 640] if turned else [640, 360]
    shot = {"type": "image", "data": base64.b64encode(data).decode(), "mimeType": "image/jpeg"}
    got = ok(client.call("ground", {"screenshot": shot, "instruction": "it @find"}))
    assert got["image_size"] == got["screen_size"] == size
    assert (got["point"], got["box"]) == (([72, 192], [36, 128, 108, 256]) if turned else ([128, 108], [64, 72, 192, 144]))
    zoomed = ok(client.call("ground", {"screenshot": shot, "instruction": "it @find", "zoom": True}))
    want = ground(*local, data, "it @find", format="qwen", zoom=True)
    assert (zoomed["point"], zoomed["box"], zoomed["zoom"]["window"]) == (list(want.point), list(want.box),
                                                                          list(want.window))
    act = ok(client.call("next_action", {"screenshot": shot, "task": "Open it @act"}))
    assert act["image_size"] == act["screen_size"] == size
    assert act["actions"] == [{"type": "click", "point": [180, 192] if turned else [320, 108], "button": "left"}]
    if orientation == 6:  # a Retina screen in points, half the upright pixels: (200, 300) of 180x320 is (36, 96)
        retina = ok(client.call("ground", {"screenshot": shot, "instruction": "it @find", "screen_width": 180,
                                           "screen_height": 320}))
        assert (retina["point"], retina["screen_size"], retina["image_size"]) == ([36, 96], [180, 320], size)


def test_next_action_reads_a_venus_box_as_its_centre(client):
    """Click(box=(x1, y1, x2, y2)) is a click at the box's centre, as ground reads it: (200, 300) of
    1000 on 200x120 is pixel (40, 36)."""
    got = ok(client.call("next_action", {"screenshot": content(png(SHOT)), "task": "Tap it @tapbox"}))
    assert got["answer"] == VENUS_BOX and got["status"] == "action"
    assert got["actions"] == [{"type": "click", "point": [40, 36], "button": "left"}]
    assert got["parsed"]["args"] == {"box": [40, 36]} and parse_grounding(VENUS_BOX, 200, 120).point == (40, 36)


def test_ask_equals_the_library(client, local):
    data = png(SHOT)
    result = client.call("ask", {"screenshot": "data:image;base64," + base64.b64encode(data).decode(),
                                 "question": "What does the button say? @ask"})
    messages = [{"role": "user", "content": [{"type": "image", "image": data},
                                             {"type": "text", "text": "What does the button say? @ask"}]}]
    want = M.generate(*local, messages=messages, max_tokens=512, temperature=0.0).text
    assert ok(result)["answer"] == result.content[0].text == want == "It says Apply."


def test_paths_only_under_the_allowed_folder(client, world):
    allowed, outside = world["allowed"], world["outside"]
    ask = lambda shot: client.call("ask", {"screenshot": shot, "question": "@ask"})  # noqa: E731
    assert ok(ask(str(allowed / "shot.png")))["answer"] == "It says Apply."
    assert ok(ask((allowed / "shot.png").as_uri()))["answer"] == "It says Apply."
    for attack in (str(outside / "secret.png"), str(allowed / "link.png"), (outside / "secret.png").as_uri(),
                   str(allowed / ".." / "outside" / "secret.png"), "/etc/passwd", "tests/fixtures/tiny-a/config.json"):
        assert "--allowed-local-media-path" in error(ask(attack)), attack
    assert "not a PNG, JPEG, WebP, GIF, BMP or TIFF image" in error(ask(str(allowed / "notes.png")))
    assert "not a regular file" in error(ask(str(allowed / "pipe.png")))  # answered at once, nothing read
    assert "not a regular file" in error(ask(str(allowed)))
    assert "does not exist" in error(ask(str(allowed / "missing.png")))


def test_budgets_and_bad_arguments_are_one_line_errors(client, world):
    shot = content(png(SHOT))
    assert "1001x1000 pixels, over the server's limit of 1000000" in error(
        client.call("ask", {"screenshot": str(world["allowed"] / "big.png"), "question": "@ask"}))
    huge = {"type": "image", "data": "A" * (MAX_BYTES * 2), "mimeType": "image/png"}  # refused before decoding
    assert "--max-image-bytes" in error(client.call("ask", {"screenshot": huge, "question": "x"}))
    cases = [
        ("ground", {"instruction": "x"}, "'screenshot' is required"),
        ("ground", {"screenshot": shot, "instruction": "x", "format": "ui-tars"}, "'format' must be one of"),
        ("ground", {"screenshot": shot, "instruction": ""}, "'instruction' must be a non-empty string"),
        ("ground", {"screenshot": shot, "instruction": "x", "screen_width": 100}, "give both or neither"),
        ("ground", {"screenshot": shot, "instruction": "x", "tokenize": True}, "ground: unknown argument 'tokenize'"),
        ("ground", {"screenshot": {"type": "audio", "data": ""}, "instruction": "x"}, "MCP image content"),
        ("ground", {"screenshot": {"type": "image", "data": "@@@"}, "instruction": "x"}, "not valid base64"),
        ("ground", {"screenshot": "data:image/png,rawbytes", "instruction": "x"}, "base64"),
        ("next_action", {"screenshot": shot, "task": "x", "history": "Click"}, "'history' must be a list"),
        ("next_action", {"screenshot": shot, "task": "x", "history": [1]}, "'history[0]' must be a string"),
        ("ask", {"screenshot": shot, "question": "x" * 9000}, "at most 8192"),
        # strict types, each error naming the argument's path
        ("ask", {"screenshot": shot, "question": 5}, "'question' must be a non-empty string"),
        ("ground", {"screenshot": shot, "instruction": "x", "screen_width": "100", "screen_height": 100},
         "'screen_width' must be an integer"),
        ("ground", {"screenshot": shot, "instruction": "x", "zoom": "0.5"}, "'zoom' must be true, false or"),
        ("next_action", {"screenshot": shot, "task": "x", "history": ["Click", 2]}, "'history[1]' must be a string"),
        ("next_action", {"screenshot": shot, "task": "x", "kind": "desktop"}, "'kind' must be one of web, mobile"),
        ("ask", {"screenshot": {"type": "image", "data": "AAAA", "alt": "x"}, "question": "x"}, "MCP image content"),
        ("teleport", {}, "unknown tool 'teleport'"),
    ]
    for name, args, says in cases:
        text = error(client.call(name, args))
        assert says in text and not text.startswith(f"{name}: {name}:"), (name, args, text)  # named once
    # The server is still serving; MCP's own fields of image content (annotations, _meta) are accepted.
    shot = {**shot, "annotations": {"audience": ["user"]}, "_meta": {}}
    assert ok(client.call("ask", {"screenshot": shot, "question": "@ask"}))["answer"] == "It says Apply."


# ---------------------------------------------------------------------------------------------
# Streamable HTTP
# ---------------------------------------------------------------------------------------------
KEY = "test-key-123"
INIT = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                   "clientInfo": {"name": "t", "version": "1"}}}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port, body, headers):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/mcp", body=body if isinstance(body, bytes) else json.dumps(body),
                 headers={"Content-Type": "application/json", "Accept": "application/json, text/event-stream",
                          **headers})
    r = conn.getresponse()
    raw = r.read()
    conn.close()
    return r.status, raw


@pytest.fixture(scope="module")
def http_port(world):
    """An MCP server over HTTP with a key, a small body limit and small session caps."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlx_qwen3vl.mcp", "--model", str(world["folder"]), "--transport", "http", "--port",
         str(port), "--api-key", KEY, "--max-body-bytes", "200000", "--log-level", "info",
         "--max-sessions", str(SESSIONS), "--max-sessions-per-client", str(PER_CLIENT)],
        cwd=ROOT, env={**os.environ, **ENV}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ready, log = threading.Event(), []

    def drain():
        for line in proc.stderr:
            log.append(line)
            if "Uvicorn running on" in line:
                ready.set()
        ready.set()

    threading.Thread(target=drain, daemon=True).start()
    try:
        assert ready.wait(120) and proc.poll() is None, "".join(log)
        yield port, proc
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_http_transport_key_rule_and_body_limit(http_port, local):
    port, _ = http_port
    assert _post(port, INIT, {})[0] == 401
    assert _post(port, INIT, {"Authorization": "Bearer wrong"})[0] == 401
    assert _post(port, INIT, {"Authorization": KEY})[0] == 401  # not a Bearer token
    # With the key, any Host is served (a LAN name): the key does the protecting.
    status, raw = _post(port, INIT, {"Authorization": f"Bearer {KEY}", "Host": "gpu-box.lan:8765"})
    assert status == 200 and b'"serverInfo"' in raw
    assert _post(port, b"x" * 300_000, {"Authorization": f"Bearer {KEY}"})[0] == 413

    # The SDK's client over HTTP, with the key: the same answer as the library.
    import httpx2
    from mcp.client.streamable_http import streamable_http_client

    data = png(SHOT)
    with start_blocking_portal() as portal:
        http_client = httpx2.AsyncClient(headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
        transport = streamable_http_client(f"http://127.0.0.1:{port}/mcp", http_client=http_client)
        with portal.wrap_async_context_manager(mcp.Client(transport)) as c:
            result = portal.call(c.call_tool, "ask", {"screenshot": content(data), "question": "@ask"})
    messages = [{"role": "user", "content": [{"type": "image", "image": data}, {"type": "text", "text": "@ask"}]}]
    assert ok(result)["answer"] == M.generate(*local, messages=messages, max_tokens=512, temperature=0.0).text


def _from(port, source, method="POST", body=INIT, session=None):
    """A request to the MCP server from the loopback address `source` (127.0.0.x)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60, source_address=(source, 0))
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream",
               "Authorization": f"Bearer {KEY}", **({"Mcp-Session-Id": session} if session else {})}
    conn.request(method, "/mcp", body=json.dumps(body) if body is not None else None, headers=headers)
    r = conn.getresponse()
    raw = r.read()
    conn.close()
    return r.status, r.getheader("Mcp-Session-Id"), raw


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs 127.0.0.2 and 127.0.0.3 (127/8 on Linux)")
def test_a_session_flood_gets_503_for_the_flooder_only(http_port):
    """300 initialize POSTs from one address: the first PER_CLIENT open sessions, the rest get
    503 at once; another address still opens one and uses it; ending one of the flooder's
    sessions (DELETE) lets it open one again. The server's memory stays flat."""
    port, proc = http_port
    def rss():
        with open(f"/proc/{proc.pid}/status") as f:
            return int(next(line for line in f if line.startswith("VmRSS:")).split()[1])

    before = rss()
    answers = [_from(port, "127.0.0.2") for _ in range(300)]
    opened = [sid for status, sid, _ in answers if status == 200]
    assert len(opened) == PER_CLIENT and [a[0] for a in answers].count(503) == 300 - PER_CLIENT, \
        sorted({a[0] for a in answers})
    assert b"--max-sessions-per-client" in answers[-1][2]
    status, sid, raw = _from(port, "127.0.0.3")
    assert status == 200 and sid and b'"serverInfo"' in raw
    initialized = {"jsonrpc": "2.0", "method": "notifications/initialized"}
    assert _from(port, "127.0.0.3", body=initialized, session=sid)[0] == 202
    status, _, raw = _from(port, "127.0.0.3", body={"jsonrpc": "2.0", "id": 2, "method": "tools/list"}, session=sid)
    assert status == 200 and b'"next_action"' in raw
    assert _from(port, "127.0.0.2", method="DELETE", body=None, session=opened[0])[0] == 200
    assert _from(port, "127.0.0.2")[0] == 200
    assert _from(port, "127.0.0.2")[0] == 503
    print(f"RSS {before >> 10} MB before the flood, {rss() >> 10} MB after")
    assert rss() - before < 50 << 10  # KiB


def test_without_a_key_only_this_machine_s_names_and_origin():
    """The no-key guard in front of the transport: the HTTP server's local-only rule."""
    from mlx_qwen3vl.mcp.server import BearerKey, http_app

    reached = []

    async def inner(scope, receive, send):
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    class FakeServer:  # what http_app needs of the SDK's Server: an ASGI app for the transport
        def streamable_http_app(self, **kwargs):
            assert kwargs["max_request_body_size"] == 1234
            return inner

    def request(app, headers):
        return asgi_status(app, "POST", "/mcp", headers, server=("127.0.0.1", 8765))

    app = http_app(FakeServer(), api_key=None, bound_host="127.0.0.1", max_body_bytes=1234)
    assert request(app, {"host": "127.0.0.1:8765"}) == 204
    assert request(app, {"host": "localhost:8765", "origin": "http://localhost:8765"}) == 204
    assert request(app, {"host": "evil.example:8765"}) == 421  # a DNS-rebinding page's own name
    assert request(app, {"host": "127.0.0.1:8765", "origin": "https://evil.example"}) == 403
    keyed = http_app(FakeServer(), api_key=KEY, max_body_bytes=1234)
    assert isinstance(keyed, BearerKey)
    assert request(keyed, {"host": "evil.example", "authorization": f"Bearer {KEY}"}) == 204
    assert request(keyed, {"host": "127.0.0.1:8765"}) == 401
    assert reached == ["/mcp"] * 3


def test_the_docs_client_example_runs(world):
    """docs/protocols.md's MCP client, as written but for the checkpoint (the scripted one) and the
    interpreter: it starts the server over stdio and prints ground's answer."""
    page = (ROOT / "docs" / "protocols.md").read_text()
    (code,) = [b for b in page.split("```python\n")[1:] if "mcp.Client" in b.split("```")[0]]
    code = code.split("```")[0].replace('"path/to/UI-Venus-1.5"', repr(str(world["folder"])))
    code = code.replace('command="python"', f"command={sys.executable!r}").replace("the search box", "it @find")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, **ENV}, capture_output=True,
                       text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    answer = ast.literal_eval(p.stdout.strip())  # the printed dict
    assert answer["status"] == "ok" and answer["answer"] == BOX and answer["image_size"] == [1280, 720], answer


# ---------------------------------------------------------------------------------------------
# Admission (in this process, through the SDK's in-memory client)
# ---------------------------------------------------------------------------------------------
def test_a_full_queue_refuses_a_call_before_its_screenshot_is_read(world, monkeypatch):
    """--max-queue 1 with the model's thread busy: the first call takes the one place (its
    screenshot is read off the model's thread, then it waits), a second is told the server is busy
    without its screenshot being read; the first is answered once the model is free."""
    import asyncio

    from mlx_qwen3vl import media_access
    from mlx_qwen3vl.mcp import server as MS
    from mlx_qwen3vl.mcp.tools import Settings

    reads, read, decode = [], threading.Event(), media_access.decode_base64

    def counted(*args, **kwargs):
        reads.append(args[1])
        read.set()
        return decode(*args, **kwargs)

    monkeypatch.setattr(media_access, "decode_base64", counted)
    worker, free = MS.model_thread(), threading.Event()
    model, processor = worker.submit(M.load, world["folder"]).result()  # loaded where it runs
    worker.submit(free.wait, 60)  # the model's thread is busy
    server = MS.create_server(model, processor, Settings(), worker=worker, max_queue=1)
    shot = content(png(SHOT))

    async def scenario():
        async with mcp.Client(server) as c:
            first = asyncio.create_task(c.call_tool("ask", {"screenshot": shot, "question": "@ask"}))
            # the first call's screenshot is read off the model's thread (then it waits for the model)
            assert await asyncio.to_thread(read.wait, 30)
            second = await c.call_tool("ask", {"screenshot": shot, "question": "@ask"})
            assert "busy" in error(second) and len(reads) == 1
            free.set()
            return await first

    try:
        assert ok(asyncio.run(scenario()))["answer"] == "It says Apply."
    finally:
        free.set()
        worker.shutdown()


def test_a_call_s_screenshot_is_read_under_its_media_budget(world):
    """One budget per call (media_access.MediaBudget): its bytes (--max-image-bytes) and one
    deadline (--request-media-timeout) for reading the screenshot, whichever way it comes."""
    from mlx_qwen3vl.errors import InputError
    from mlx_qwen3vl.mcp.tools import Settings, prepare

    spent = Settings(allowed_dirs=[str(world["allowed"])], media_timeout_s=1e-9)
    for shot in (content(png(SHOT)), "data:image/png;base64," + content(png(SHOT))["data"],
                 str(world["allowed"] / "shot.png")):
        with pytest.raises(InputError, match="--request-media-timeout"):
            prepare("ask", None, spent, {"screenshot": shot, "question": "x"})
    small = Settings(allowed_dirs=[str(world["allowed"])], max_image_bytes=1000)
    for shot in (content(png(SHOT)), str(world["allowed"] / "shot.png")):
        with pytest.raises(InputError, match="--max-image-bytes"):
            prepare("ask", None, small, {"screenshot": shot, "question": "x"})
    call = prepare("ground", None, Settings(), {"screenshot": content(png(SHOT)), "instruction": "the box",
                                                "screen_width": 400, "screen_height": 240})
    assert (call.size, call.screen, call.options["format"]) == ((200, 120), (400, 240), "venus")


def test_arguments_are_read_into_the_one_request_form():
    """Each tool's arguments become server.protocol.ChatRequest turns of conversation parts, each
    part naming its argument; `ask` renders them with the HTTP server's template_messages, and the
    tools' declarations (the models' schemas) refuse what the models refuse."""
    from mlx_qwen3vl.errors import InputError
    from mlx_qwen3vl.mcp import arguments
    from mlx_qwen3vl.mcp.tools import TOOL_DECLARATIONS, Settings, prepare
    from mlx_qwen3vl.server.conversation import template_messages
    from mlx_qwen3vl.server.protocol import ChatRequest

    data = png(SHOT)
    call = prepare("ask", None, Settings(), {"screenshot": content(data), "question": "what?"})
    assert isinstance(call.request, ChatRequest) and call.request.sampling.temperature == 0.0
    assert [(p.kind, p.param) for p in call.request.turns[0].parts] == [("image", "screenshot"), ("text", "question")]
    messages, images, videos = template_messages(call.request.turns, call.resolve)
    assert messages == [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what?"}]}]
    assert images == [data] and videos == []
    venus = Settings(agent_format="venus", max_pixels=500_000)
    call = prepare("next_action", None, venus, {"screenshot": content(data), "task": "go", "history": ["a", "b"],
                                                "kind": "mobile"})
    turns = call.request.turns
    assert [(t.role, t.param, t.answer) for t in turns] == [
        ("user", "task", None), ("assistant", "history[0]", "a"), ("assistant", "history[1]", "b"),
        ("user", "screenshot", None)]
    assert (call.request.sampling.repetition_penalty, call.request.sampling.max_tokens) == (1.05, 2048)
    assert (call.request.min_pixels, call.request.max_pixels, call.options["kind"]) == (3136, 500_000, "mobile")
    assert (call.text(), call.size, call.screen) == ("go", (200, 120), (200, 120))
    # The declarations are the models' own schemas: what one refuses, the other refuses.
    jsonschema = pytest.importorskip("jsonschema")
    schemas = {d["name"]: d["inputSchema"] for d in TOOL_DECLARATIONS}
    assert list(schemas["ground"]["properties"]) == ["screenshot", "instruction", "format", "zoom", "screen_width",
                                                     "screen_height"]
    shot = content(data)
    for name, args, good in [
            ("ground", {"screenshot": shot, "instruction": "x", "zoom": 0.5, "format": "qwen"}, True),
            ("ground", {"screenshot": {**shot, "_meta": {}}, "instruction": "x", "screen_width": 9,
                        "screen_height": 9}, True),
            ("ground", {"screenshot": shot, "instruction": "x", "zoom": 2}, False),
            ("ground", {"screenshot": shot, "instruction": "x", "format": "ui-tars"}, False),
            ("ground", {"screenshot": shot, "instruction": "x", "screen_width": 0, "screen_height": 9}, False),
            ("ground", {"screenshot": {**shot, "alt": ""}, "instruction": "x"}, False),
            ("next_action", {"screenshot": "a.png", "task": "x", "history": ["a"], "kind": "mobile"}, True),
            ("next_action", {"screenshot": "a.png", "task": "x", "history": ["a", 1]}, False),
            ("next_action", {"screenshot": "a.png", "task": " "}, False),
            ("ask", {"screenshot": "a.png", "question": "x", "format": "qwen"}, False),
            ("ask", {"screenshot": "", "question": "x"}, False)]:
        schema_ok = jsonschema.Draft202012Validator(schemas[name]).is_valid(args)
        try:
            arguments.validate(name, args)
            model_ok = True
        except InputError:
            model_ok = False
        assert schema_ok == model_ok == good, (name, args)


def test_a_cancelled_call_gives_its_place_in_the_queue_back(world):
    """--max-queue 1 with the model's thread busy: a call that waits for the model and is then
    cancelled by its client (notifications/cancelled) gives its place back, so the next call is
    answered, not told the server is busy. (Before, the place was given back only when the call
    started on the model's thread, which a cancelled call never does: after max_queue
    cancellations every call was refused.)"""
    import asyncio

    from mlx_qwen3vl.mcp import server as MS
    from mlx_qwen3vl.mcp.tools import Settings

    worker, free, queued, dropped = MS.model_thread(), threading.Event(), threading.Event(), threading.Event()
    model, processor = worker.submit(M.load, world["folder"]).result()  # loaded where it runs
    worker.submit(free.wait, 60)  # the model's thread is busy
    submit = worker.submit

    def watched(fn, *args):  # a call's future on the model's thread: seen queued, seen cancelled
        future = submit(fn, *args)
        future.add_done_callback(lambda f: f.cancelled() and dropped.set())
        queued.set()
        return future

    worker.submit = watched
    server = MS.create_server(model, processor, Settings(), worker=worker, max_queue=1)
    shot = content(png(SHOT))

    async def scenario():
        async with mcp.Client(server) as c:
            waiting = asyncio.create_task(c.call_tool("ask", {"screenshot": shot, "question": "@ask"}))
            assert await asyncio.to_thread(queued.wait, 30)  # it waits for the model's thread
            waiting.cancel()
            assert await asyncio.to_thread(dropped.wait, 30)  # the server dropped it
            free.set()
            return await c.call_tool("ask", {"screenshot": shot, "question": "@ask"})

    try:
        assert ok(asyncio.run(scenario()))["answer"] == "It says Apply."
    finally:
        free.set()
        worker.shutdown()
