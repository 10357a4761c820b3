"""The server as an attacker meets it (issue #26): each numbered case of the issue tried against a
real server process on 127.0.0.1 (tiny-a, no API key, short deadlines and small budgets set by its
flags), with local helper HTTP servers on 127.0.0.1 and ::1 that count what reaches them. Every
wait is bounded by a socket timeout; the only waits are the deadlines under test."""

import base64
import http.client
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import zlib

import numpy as np
import pytest

from conftest import FIXTURES, write_fixture_video
from test_server import MEDIA, ROOT, Server, png_bytes, user

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

CAP = 1_000_000  # --max-request-pixels of the module's server
FRAMES = 100  # its --max-video-frames
ALLOWED_ORIGIN = "http://allowed.test"
REQUEST_BYTES = 16 << 20  # its --max-request-media-bytes
LONG = dict(temperature=1.0, seed=104, max_tokens=1000)  # a sampled answer that runs all 1000 tokens (test_server)


# ------------------------------------------------------------------------------ helpers


class Helper:
    """A local HTTP server (127.0.0.1 or ::1) answering scripted paths; `hits` lists the paths
    requested, so a test can tell that the server never reached it."""

    def __init__(self, host, routes):
        self.hits, stop = [], threading.Event()
        self.stop_event = stop

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, *a):
                pass

            def do_GET(self):
                helper.hits.append(self.path)
                route = routes.get(self.path.split("?")[0])
                if route is None:
                    self.send_error(404)
                    return
                try:
                    route(self, stop)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        helper = self
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        server_class = type("S", (http.server.ThreadingHTTPServer,), {"address_family": family,
                                                                       "daemon_threads": True})
        self.httpd = server_class((host, 0), Handler)
        self.port = self.httpd.server_address[1]
        self.base = f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.stop_event.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def send(handler, data, status=200, headers=()):
    handler.send_response(status)
    for k, v in headers:
        handler.send_header(k, v)
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def trickle_body(handler, stop):
    """A valid status and headers, then one byte every 0.2 s (at most 10 s)."""
    handler.send_response(200)
    handler.send_header("Content-Length", "100000")
    handler.end_headers()
    for _ in range(50):
        if stop.wait(0.2):
            return
        handler.wfile.write(b"\0")
        handler.wfile.flush()


def trickle_headers(handler, stop):
    handler.wfile.write(b"HTTP/1.0 200 OK\r\n")
    for _ in range(50):
        if stop.wait(0.2):
            return
        handler.wfile.write(b"X")
        handler.wfile.flush()


def blank_png(width, height):
    """A valid greyscale PNG of black pixels, compressed row block by row block (the test never
    holds the pixels); 10000 x 9999 comes to ~100 kB."""
    def chunk(kind, data):
        return struct_pack(len(data)) + kind + data + struct_pack(zlib.crc32(kind + data) & 0xFFFFFFFF)

    c, rows, block = zlib.compressobj(9), b"\0" + bytes(width), 500
    idat = b"".join(c.compress(rows * min(block, height - y)) for y in range(0, height, block)) + c.flush()
    ihdr = struct_pack(width) + struct_pack(height) + bytes([8, 0, 0, 0, 0])
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def struct_pack(n):
    return n.to_bytes(4, "big")


def long_mkv(path, frames=400, size=64):
    """A Matroska clip of `frames` flat frames: Matroska states no frame count."""
    av = pytest.importorskip("av")
    with av.open(str(path), "w") as container:
        stream = container.add_stream("ffv1", rate=24)
        stream.width = stream.height = size
        stream.pix_fmt = "gray"
        for i in range(frames):
            frame = np.full((size, size), i % 251, np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="gray")))
        container.mux(stream.encode())
    return path


def image_part(url):
    return {"type": "image_url", "image_url": {"url": url}}


def video_part(url):
    return {"type": "video_url", "video_url": {"url": url}}


def data_url(data, kind="image/png"):
    return f"data:{kind};base64," + base64.b64encode(data).decode()


def chat(*parts, **extra):
    return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "What is it?"}]}],
            "max_tokens": 2, "temperature": 0, **extra}


def post(server, body, headers=None):
    return server.request("POST", "/v1/chat/completions", body, headers=headers, key=None)


def refused(server, body, status=400, param=None, says=None):
    got, err = post(server, body)
    assert got == status, err
    assert set(err["error"]) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["error"]["param"] == param, err
    if says is not None:
        assert says in err["error"]["message"], err
    return err["error"]


def peak_rss(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("security")


def race_folders(tmp):
    """(allowed, outside) for the swap races: allowed/shot.png is 32x32, outside/secret.png 96x96
    (a read outside would show in the prompt's token count)."""
    allowed, outside = tmp / "race-allowed", tmp / "race-outside"
    if not allowed.exists():
        (allowed / "d").mkdir(parents=True)
        outside.mkdir()
        for folder in (allowed, allowed / "d"):
            (folder / "shot.png").write_bytes(png_bytes(array=np.zeros((32, 32, 3), np.uint8)))
        for name in ("secret.png", "shot.png"):
            (outside / name).write_bytes(png_bytes(array=np.zeros((96, 96, 3), np.uint8)))
    return allowed, outside


@pytest.fixture(scope="module")
def server(tmp):
    """No API key (Host / Origin checks on), http media only from ::1 (so 127.0.0.1 is a
    forbidden destination), one-second deadlines, small budgets; its temp files go to `tmp`."""
    s = Server("--allow-media-host", "::1", "--media-timeout", "1", "--max-request-pixels", str(CAP),
               "--max-video-frames", str(FRAMES), "--grammar-timeout", "0.1", "--max-connections", "8",
               "--header-timeout", "1", "--body-timeout", "1", "--keep-alive-timeout", "1",
               "--cors-allow-origin", ALLOWED_ORIGIN, "--allowed-local-media-path", str(MEDIA),
               "--allowed-local-media-path", str(race_folders(tmp)[0]), "--max-request-media-bytes", str(REQUEST_BYTES),
               env={"TMPDIR": str(tmp)})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def loopback():
    """What the server must never reach: a 127.0.0.1 helper with an image on it."""
    h = Helper("127.0.0.1", {"/x.png": lambda r, stop: send(r, png_bytes("img_123x77.png"))})
    yield h
    h.close()


# ------------------------------------------------------------------------------ 1. chat_template_kwargs


def test_template_kwargs_are_an_allow_list_of_switches(server, loopback):
    attacks = [({"tokenize": True, "images": [loopback.base + "/x.png"]}, "chat_template_kwargs.tokenize"),
               ({"images": ["/etc/shadow"]}, "chat_template_kwargs.images"),
               ({"videos": [loopback.base + "/x.png"]}, "chat_template_kwargs.videos"),
               ({"chat_template": "{% for i in range(10**9) %}x{% endfor %}"}, "chat_template_kwargs.chat_template"),
               ({"add_vision_id": "yes"}, "chat_template_kwargs.add_vision_id")]
    picture = image_part(data_url(png_bytes("img_123x77.png")))  # today's template then takes `images` for it
    for kwargs, param in attacks:
        for stream in (False, True):
            refused(server, chat(picture, chat_template_kwargs=kwargs, stream=stream), param=param)
    refused(server, chat(chat_template="{{ 'x' * 500000000 }}"), param="chat_template")
    refused(server, chat(mm_processor_kwargs={"fps": 2}), param="mm_processor_kwargs.fps")
    assert loopback.hits == []
    # The switches themselves work: add_vision_id writes "Picture 1: " before each image.
    two = chat(picture, image_part(data_url(png_bytes("img_90x260.png"))))
    plain = post(server, two)[1]["usage"]["prompt_tokens"]
    named = post(server, {**two, "chat_template_kwargs": {"add_vision_id": True, "enable_thinking": False}})
    assert named[0] == 200 and named[1]["usage"]["prompt_tokens"] > plain


# ------------------------------------------------------------------------------ 2. formats by content


def test_playlists_and_unlisted_formats_are_refused(server, tmp):
    (tmp / "sub").mkdir(exist_ok=True)
    _, clip = write_fixture_video(tmp / "sub")  # what an ffconcat file in $TMPDIR could name
    playlists = [b"ffconcat version 1.0\nfile sub/clip.mkv\n",
                 b"#EXTM3U\n#EXT-X-TARGETDURATION:1\n#EXTINF:1,\nsub/clip.mkv\n#EXT-X-ENDLIST\n"]
    for text in playlists:
        refused(server, chat(video_part(data_url(text, "video/mp4"))), param="messages", says="MP4/MOV")
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nnewpath 0 0 moveto 10 10 lineto stroke\n%%EOF\n"
    svg = b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"><rect width="10" height="10"/></svg>'
    for data in (eps, svg, b"%PDF-1.4\n%%EOF\n"):
        refused(server, chat(image_part(data_url(data))), param="messages", says="PNG, JPEG")
    assert post(server, chat(video_part(data_url(clip.read_bytes(), "video/x-matroska"))))[0] == 200


# ------------------------------------------------------------------------------ 3. connections


def _connect(server):
    s = socket.create_connection(("127.0.0.1", server.port), timeout=15)  # the test's bound, not the server's
    return s


def _read_all(s):
    """Everything the server sends until it closes the connection (within the socket timeout)."""
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    s.close()
    return out


def test_idle_and_slow_connections_are_capped_and_closed(server):
    idle = [_connect(server) for _ in range(8)]
    probe = _connect(server)
    probe.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert _read_all(probe).startswith(b"HTTP/1.1 503 ")
    for s in idle:  # nothing sent: closed at the first-request deadline (or refused at once)
        assert _read_all(s).split(b" ")[1] in (b"408", b"503")
    slow_header = _connect(server)
    slow_header.sendall(b"GET /health HTTP/1.1\r\nHo")
    slow_body = _connect(server)
    slow_body.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{")
    kept = _connect(server)
    kept.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert _read_all(slow_header).startswith(b"HTTP/1.1 408 ")
    assert _read_all(slow_body).startswith(b"HTTP/1.1 408 ")
    assert _read_all(kept).startswith(b"HTTP/1.1 200 ")  # then closed by the keep-alive timeout
    assert server.request("GET", "/health", key=None)[0] == 200


# ------------------------------------------------------------------------------ 4. one deadline per fetch


def test_a_trickling_url_fails_at_the_whole_fetch_deadline(server):
    helper = Helper("::1", {"/body": trickle_body, "/headers": trickle_headers})
    try:
        for path in ("/body", "/headers"):
            refused(server, chat(image_part(helper.base + path)), param="messages[0].content[0].image_url.url",
                    says="within 1 s")
    finally:
        helper.close()


# ------------------------------------------------------------------------------ 5. budgets before decoding


def test_budgets_refuse_before_decoding_and_peak_rss_stays_flat(server, tmp):
    tiny = png_bytes(array=np.zeros((1, 1, 3), np.uint8))
    big = data_url(blank_png(10000, 9999))
    video = data_url(long_mkv(tmp / "long.mkv").read_bytes(), "video/x-matroska")
    before = peak_rss(server.proc.pid) if sys.platform.startswith("linux") else None
    refused(server, chat(image_part(data_url(tiny)), min_pixels=40_000_000, max_pixels=40_000_000),
            param="min_pixels", says="--max-request-pixels")
    refused(server, chat(*[image_part(big)] * 5), param="messages", says="10000x9999")
    refused(server, chat(video_part(video)), param="messages", says=f"more than {FRAMES} frames")
    shot = data_url(png_bytes(array=np.zeros((400, 600, 3), np.uint8)))  # 608x384 as resized: 4 fit in 1M, 5 do not
    refused(server, chat(*[image_part(shot)] * 5), param="messages", says="as the model sees them")
    assert post(server, chat(*[image_part(shot)] * 3))[0] == 200
    refused(server, chat(stop=["x" * 257]), param="stop")
    refused(server, chat(stop=[str(i) for i in range(17)]), param="stop")
    slow = {"type": "string", "pattern": "(" + "|".join(f"w{i}q" for i in range(100_000)) + ")"}  # ~0.5 s to compile
    error = refused(server, chat(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": slow}}),
                    param="response_format", says="--grammar-timeout")
    assert error["code"] == "grammar_timeout"
    if before is not None:
        assert peak_rss(server.proc.pid) - before < 200 << 20


# ------------------------------------------------------------------------------ 6. http media destinations


def test_http_media_never_reach_private_addresses(server, loopback):
    port = loopback.port
    forms = ["127.0.0.1", "127.1", "2130706433", "0177.0.0.1", "0x7f.0.0.1", "[::ffff:127.0.0.1]",
             "[::ffff:7f00:1]"]
    for host in forms:
        refused(server, chat(image_part(f"http://{host}:{port}/x.png")), status=403,
                param="messages[0].content[0].image_url.url", says="--allow-media-host")
    allowed = Helper("::1", {
        "/img.png": lambda r, stop: send(r, png_bytes("img_123x77.png")),
        "/to-loopback": lambda r, stop: send(r, b"", 302, [("Location", f"http://127.0.0.1:{port}/x.png")]),
        "/to-self": lambda r, stop: send(r, b"", 307, [("Location", "/img.png")])})
    try:
        refused(server, chat(image_part(allowed.base + "/to-loopback")), status=403, says="--allow-media-host")
        want = post(server, chat(image_part(data_url(png_bytes("img_123x77.png")))))[1]
        got = post(server, chat(image_part(allowed.base + "/to-self")))  # redirects are followed, and checked
        assert got[0] == 200 and got[1]["choices"][0]["message"] == want["choices"][0]["message"]
        assert allowed.hits == ["/to-loopback", "/to-self", "/img.png"]
    finally:
        allowed.close()
    assert loopback.hits == []


def test_the_connection_goes_to_the_checked_address(monkeypatch):
    """A host whose second DNS answer would be 127.0.0.1: resolved once, checked, connected to."""
    from mlx_qwen3vl.server import fetch

    helper = Helper("::1", {"/img.png": lambda r, stop: send(r, b"picture")})
    answers = [("::1", helper.port, 0, 0), ("127.0.0.1", helper.port)]
    real = socket.getaddrinfo

    def resolve(host, port, *a, **kw):
        if host != "rebind.test":
            return real(host, port, *a, **kw)
        address = answers.pop(0)
        return [(socket.AF_INET6 if ":" in address[0] else socket.AF_INET, socket.SOCK_STREAM, 6, "", address)]

    monkeypatch.setattr(fetch.socket, "getaddrinfo", resolve)
    try:
        policy = fetch.MediaPolicy(allowed_hosts=["::1"], http_timeout_s=5)
        assert fetch.fetch_http(f"http://rebind.test:{helper.port}/img.png", policy, "url") == b"picture"
        assert len(answers) == 1 and helper.hits == ["/img.png"]
    finally:
        helper.close()


# ------------------------------------------------------------------------------ 8. the small items


def test_bad_bodies_get_400s_streaming_or_not(server):
    for stream in ("false", "true"):
        deep = b"[" * 100_000 + b"]" * 100_000
        got, err = post(server, b'{"stream": %s, "messages": %s}' % (stream.encode(), deep))
        assert got == 400 and err["error"]["code"] == "too_deep"
        body = '{"model": "\\ud800", "stream": %s, "messages": [{"role": "user", "content": "hi"}]}' % stream
        got, err = post(server, body)
        assert got == 400 and err["error"]["param"] == "model"
    assert post(server, chat())[0] == 200


def test_without_a_key_only_this_machine_and_same_origin_are_served(server):
    port = server.port
    for host in ("evil.test", f"evil.test:{port}", "127.0.0.1.evil.test", f"192.0.2.1:{port}"):
        status, err = server.request("GET", "/health", headers={"Host": host}, key=None)
        assert status == 421 and err["error"]["code"] == "forbidden_host", host
        assert post(server, chat(), headers={"Host": host})[0] == 421
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "localhost"):
        assert server.request("GET", "/health", headers={"Host": host}, key=None)[0] == 200, host
    for origin in ("http://evil.test", "null", f"http://localhost:{port + 1}"):
        got, err = post(server, chat(), headers={"Origin": origin, "Content-Type": "text/plain"})
        assert got == 403 and err["error"]["code"] == "forbidden_origin", origin
    assert post(server, chat(), headers={"Origin": f"http://127.0.0.1:{port}"})[0] == 200  # its own pages
    status, headers = server.request("POST", "/v1/chat/completions", chat(), headers={"Origin": ALLOWED_ORIGIN},
                                     key=None, with_headers=True)
    assert status == 200 and headers["access-control-allow-origin"] == ALLOWED_ORIGIN


def test_start_refuses_an_empty_key_and_names_model_offline():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "mlx_qwen3vl.server"]
    r = subprocess.run(command + ["--model", str(FIXTURES / "tiny-a"), "--api-key", ""], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--api-key is empty" in r.stderr
    r = subprocess.run(command + ["--model", str(FIXTURES / "tiny-a"), "--allow-media-host", "http://x/"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--allow-media-host 'http://x/'" in r.stderr
    r = subprocess.run(command + ["--model", "nobody-here/no-such-model"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "--model" in r.stderr and "load()" not in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1  # one line, no traceback


def test_help_shows_every_default():
    from mlx_qwen3vl.server.__main__ import build_parser

    parser = build_parser()
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            shown = " ".join(parser._get_formatter()._format_action(action).split())  # as --help prints it
            assert "(default" in shown or "(required)" in shown, shown
    text = " ".join(parser.format_help().split())
    assert "--port PORT port to bind (default: 8080)" in text and "(default: 33554432)" in text


def _stream_lines(server, body, key=None):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), headers)
    r = conn.getresponse()
    assert r.status == 200
    return conn, r


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_ends_running_streams_with_an_error_and_exits_0(sig):
    """A server with a key serves other Host names (a LAN name: the key is the protection); a
    signal mid-stream ends the stream with an error event and [DONE], and the process with 0."""
    s = Server("--api-key", "k")
    try:
        assert s.request("GET", "/v1/models", headers={"Host": "gpu-box.lan:8080"}, key="k")[0] == 200
        assert s.request("GET", "/v1/models", headers={"Host": "gpu-box.lan:8080"}, key=None)[0] == 401
        body = {"messages": [user("Tell story 1. slowly", png_bytes("img_90x260.png"))], "stream": True, **LONG}
        conn, r = _stream_lines(s, body, key="k")
        lines = []
        while not any('"content": "' in x and '"content": ""' not in x for x in lines):  # a decoded token
            lines.append(r.readline().decode())
        s.proc.send_signal(sig)
        lines += [x.decode() for x in r.readlines()]
        conn.close()
        assert s.proc.wait(60) == 0, "".join(s.log[-20:])
    finally:
        s.stop()
    events = [x[len("data: "):].strip() for x in lines if x.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "server_shutdown" and error["type"] == "server_overloaded"


# ------------------------------------------------------------------------------ POST /v1/ground and the page


def ground_post(server, body, headers=None):
    return server.request("POST", "/v1/ground", body, headers=headers, key=None)


def test_ground_checks_every_field_before_any_work(server, loopback):
    """/v1/ground takes an allow-list of fields, its image under the media policy and the pixel
    budget (checked from the header), and answers each bad one with a 400 naming it."""
    good = {"image": data_url(png_bytes("img_123x77.png")), "instruction": "the OK button", "max_tokens": 2}
    outside = FIXTURES / "tiny-a" / "config.json"
    cases = [
        ({**good, "chat_template": "{{ raise('x') }}"}, "chat_template", "unknown_field"),
        ({**good, "messages": []}, "messages", "unknown_field"),
        ({**good, "temperature": 1.0}, "temperature", "unknown_field"),
        ({"instruction": "x"}, "image", "missing_field"),
        ({**good, "image": {"url": good["image"]}}, "image", "invalid_type"),
        ({**good, "instruction": " "}, "instruction", "invalid_type"),
        ({**good, "instruction": "x" * 8193}, "instruction", "invalid_value"),
        ({**good, "format": "../venus"}, "format", "invalid_value"),
        ({**good, "zoom": "0.5"}, "zoom", "invalid_type"),
        ({**good, "zoom": [0.5]}, "zoom", "invalid_type"),
        ({**good, "allow_refusal": "no"}, "allow_refusal", "invalid_type"),
        ({**good, "max_pixels": CAP + 1}, "max_pixels", "over_budget"),
        ({**good, "min_pixels": 5000, "max_pixels": 4000}, "min_pixels", "invalid_value"),
        ({**good, "max_tokens": 0}, "max_tokens", "invalid_value"),
        ({**good, "image": data_url(blank_png(1001, 1000))}, "image", "over_budget"),  # 1,001,000 > CAP
        ({**good, "image": data_url(b"%!PS-Adobe-3.0 EPSF-3.0\n")}, "image", None),
        ({**good, "image": "data:image/png;base64,@@@"}, "image", None),
        ({**good, "image": f"file://{outside}"}, "image", None),
        ({**good, "image": f"file://{MEDIA}/../tiny-a/config.json"}, "image", None),
        ({**good, "image": "/etc/passwd"}, "image", None),
    ]
    for zoom in (0, -1, 1.5, 1e308):
        cases.append(({**good, "zoom": zoom}, "zoom", "invalid_value"))
    for body, param, code in cases:
        status, err = ground_post(server, body)
        assert status == 400 and err["error"]["param"] == param, (body.get(param, body) if param != "image" else param,
                                                                  err)
        assert code is None or err["error"]["code"] == code, err
    status, err = ground_post(server, b'{"image": "x", "instruction": "NaN", "zoom": NaN}')
    assert status == 400 and err["error"]["param"] == "zoom", err
    status, err = ground_post(server, {**good, "image": f"http://127.0.0.1:{loopback.port}/x.png"})
    assert status == 403 and err["error"]["param"] == "image" and loopback.hits == []
    status, ok = ground_post(server, {**good, "zoom": 0.5, "image": f"file://{MEDIA}/img_123x77.png"})
    assert status == 200 and ok["image_size"] == [123, 77] and ok["zoom"]["fraction"] == 0.5


def test_ground_and_the_page_keep_the_host_and_origin_rule(server):
    port = server.port
    body = {"image": data_url(png_bytes("img_123x77.png")), "instruction": "the OK button", "max_tokens": 2}
    for host in ("evil.test", f"evil.test:{port}", "127.0.0.1.evil.test"):
        assert ground_post(server, body, headers={"Host": host})[0] == 421, host
        assert server.request("GET", "/", headers={"Host": host}, key=None)[0] == 421, host
    for origin in ("http://evil.test", "null", f"http://localhost:{port + 1}"):
        status, err = ground_post(server, body, headers={"Origin": origin, "Content-Type": "text/plain"})
        assert status == 403 and err["error"]["code"] == "forbidden_origin", origin
    # The page's own calls: same origin, by each of this machine's names.
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}"):
        assert ground_post(server, body, headers={"Host": host, "Origin": f"http://{host}"})[0] == 200, host
    status, headers = server.request("GET", "/", key=None, with_headers=True)
    assert status == 200 and "frame-ancestors 'none'" in headers["content-security-policy"]


def test_ground_disconnect_frees_the_slot(server):
    before = server.metrics().get("cancelled", 0)
    body = json.dumps({"image": data_url(png_bytes("img_123x77.png")), "instruction": "the OK button",
                       "max_tokens": 3000, "zoom": True})  # tiny-a runs all 3000 tokens (~5 s)
    s = _connect(server)
    s.sendall(f"POST /v1/ground HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
    for _ in range(5000):  # bounded: each poll is one request round trip
        if server.metrics()["running"] == 1:
            break
    s.close()
    for _ in range(5000):
        m = server.metrics()
        if m["running"] == 0 and m.get("cancelled", 0) > before:
            break
    assert m["running"] == 0 and m.get("cancelled", 0) > before


# ------------------------------------------------------------------------------ #36: one media budget, race-free files


def test_a_requests_urls_stop_at_its_total_and_memory_stays_flat(server):
    """24 URLs of 4 MiB in one request (96 MiB): fetched only up to --max-request-media-bytes, the
    rest never asked for, a 413 naming the flag, and the peak RSS bounded by the total."""
    size = 4 << 20

    def big(handler, stop):
        send(handler, bytes(size))

    helper = Helper("::1", {f"/big/{i}": big for i in range(24)})
    before = peak_rss(server.proc.pid) if sys.platform.startswith("linux") else None
    try:
        error = refused(server, chat(*[image_part(f"{helper.base}/big/{i}") for i in range(24)]), status=413,
                        says="--max-request-media-bytes")
    finally:
        helper.close()
    assert error["code"] == "media_too_large" and error["param"] == "messages[0].content[4].image_url.url", error
    assert len(helper.hits) == REQUEST_BYTES // size + 1  # the 5th is refused from its Content-Length
    if before is not None:
        assert peak_rss(server.proc.pid) - before < 2 * REQUEST_BYTES + (32 << 20)


def _count(server, url):
    body = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": url}}, {"type": "text", "text": "x"}]}]}
    status, out = server.request("POST", "/v1/messages/count_tokens", body, key=None)
    return status, out


@pytest.mark.parametrize("kind", ["link", "fifo", "dir"])
def test_files_swapped_during_requests_are_never_read_outside_nor_block(server, tmp, kind):
    """Another process swaps a link, a FIFO or a directory in and out (the regular file a real
    PNG) from before the first of 300 requests naming the file until after the last: every answer
    is the inside file's token count or a 400, never a 500, never a 408/503 (a worker blocked in
    open) nor a hang (the client's timeout), never the outside file's count; and the server
    answers the inside file once the swapping stops. How the answers split between the two
    depends on scheduling (the swaps' speed under load), so only their kinds are asserted."""
    from test_media_access import SWAPPER

    allowed, outside = race_folders(tmp)
    target, other = (allowed / "d", outside) if kind == "dir" else (allowed / "shot.png", outside / "secret.png")
    name = allowed / "d" / "shot.png" if kind == "dir" else target
    status, inside = _count(server, name.as_uri())
    status2, secret = _count(server, (outside / "secret.png").as_uri())
    assert status == 200 and status2 == 400, (inside, secret)
    shot = tmp / "race-shot.png"  # what the swapper writes as the regular file: the allowed one's bytes
    shot.write_bytes((allowed / "shot.png").read_bytes())
    swapper = subprocess.Popen([sys.executable, "-c", SWAPPER, kind, str(target), str(other),
                                str(allowed / ".spare"), str(allowed / ".spare2"), str(10**9), str(shot)],
                               stdout=subprocess.PIPE, text=True)
    seen = {}
    try:
        assert swapper.stdout.readline() == "swapping\n"  # the swaps started before the first request
        for _ in range(300):
            status, out = _count(server, name.as_uri())
            key = (status, out["input_tokens"] if status == 200 else out["error"]["type"])
            seen[key] = seen.get(key, 0) + 1
        assert swapper.poll() is None  # ... and went on past the last
    finally:
        swapper.kill()
        swapper.wait()
        swapper.stdout.close()
        (allowed / ".spare").unlink(missing_ok=True)  # what the kill left unplaced
        if kind == "dir" and (target.is_symlink() or not target.exists()):  # the folder back as it was
            target.unlink(missing_ok=True)
            (allowed / ".spare2").rename(target)
        if kind != "dir":
            (allowed / ".spare2").unlink(missing_ok=True)
            target.unlink(missing_ok=True)
            target.write_bytes(png_bytes(array=np.zeros((32, 32, 3), np.uint8)))
    print(kind, seen)
    assert set(seen) <= {(200, inside["input_tokens"]), (400, "invalid_request_error")}, seen
    assert _count(server, name.as_uri()) == (200, inside)


# ------------------------------------------------------------------------------ #36: 500s that were bad input


def test_schemas_with_no_value_and_bad_videos_are_400s_of_one_line(server, tmp):
    """A json_schema whose $ref only refers to itself was a 500 carrying llguidance's parser
    state; an undecodable video named the server's temp file. Both are 400s of one line now, and
    the log has no traceback."""
    logged = len(server.log)
    for schema in ({"$ref": "#"}, {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                                   "$ref": "#/$defs/a"}):
        error = refused(server, chat(response_format={"type": "json_schema", "json_schema": {"name": "s",
                                                                                             "schema": schema}}),
                        param="response_format", says="admits no value")
        assert error["code"] == "invalid_schema" and "\n" not in error["message"] and "state" not in error["message"]
    for data in (b"\x00\x00\x00\x18ftypmp42" + b"junk" * 100, b"\x1a\x45\xdf\xa3" + b"x" * 50, b"not a video"):
        error = refused(server, chat(video_part(data_url(data, "video/mp4"))), param="messages")
        assert str(tmp) not in error["message"] and "mlx_qwen3vl_video_" not in error["message"], error
        assert "video 1" in error["message"]
    assert not [line for line in server.log[logged:] if "Traceback" in line], server.log[logged:]


def test_a_schema_past_llguidance_s_limits_is_a_400_streamed_or_not(server):
    """A schema whose only values are infinite (a required property that is the schema itself)
    compiles and has a first token, then llguidance stops at its item limit mid-answer: that was
    a 500 (server_error). It is the request's schema: a 400 naming the field, streamed (the
    stream's error event, as the openai client raises it) or not, and no traceback in the log."""
    import openai

    endless = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    cases = [(chat(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": endless}}),
              "response_format"),
             (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}],
                   tool_choice="required"), "tool_choice")]
    logged = len(server.log)
    for body, param in cases:
        error = refused(server, body, param=param, says="simpler schema")
        assert error["code"] == "grammar_error" and error["type"] == "invalid_request_error", error
        with pytest.raises(openai.APIError) as raised:
            for _ in server.client().chat.completions.create(model="m", stream=True, **body):
                pass
        assert (raised.value.body["param"], raised.value.body["type"]) == (param, "invalid_request_error")
    assert not [line for line in server.log[logged:] if "Traceback" in line], server.log[logged:]


def test_an_unexpected_exception_is_a_500_without_its_text_and_one_log_line(capsys):
    from conftest import asgi_status
    from mlx_qwen3vl.server.app import OneLineErrors

    async def broken(scope, receive, send):
        raise TypeError(f"'NoneType' object is not subscriptable in {MEDIA}")

    assert asgi_status(OneLineErrors(broken), "POST", "/v1/chat/completions", {}) == 500
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "TypeError at test_server_security.py:" in lines[0], lines
