"""One admission path for every endpoint (service.Service.admit): the key, the body's size, the JSON
parsed off the event loop with its items bounded, a place in the queue before any media is read,
then the media and the prompt. Each test reproduces an attack on the order: a full queue answers
503 before any image is decoded (chat, count_tokens, /v1/ground alike), and /health answers while
a body of a million parts is read and refused."""

import base64
import http.client
import io
import json
import os
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from PIL import Image, ImageDraw

from test_server import Server

pytest.importorskip("starlette")


@pytest.fixture(scope="module")
def busy():
    s = Server("--max-batch", "1", "--max-queue", "1", "--max-body-bytes", str(48 << 20))
    yield s
    s.stop()


def big_png() -> bytes:
    """A 4096x4096 PNG of a few dozen KB: cheap to send, seconds of CPU to decode and resize."""
    image = Image.new("RGB", (4096, 4096), (200, 30, 30))
    draw = ImageDraw.Draw(image)
    for i in range(0, 4096, 64):
        draw.line([(i, 0), (4095 - i, 4095)], fill=(10, 200, 40), width=3)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _stream(server, body):
    """A streamed chat request left running: (connection, response)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", body=json.dumps({**body, "stream": True}),
                 headers={"Content-Type": "application/json"})
    return conn, conn.getresponse()


def test_a_full_queue_answers_503_before_any_media_is_read(busy):
    long = {"messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 4000, "ignore_eos": True,
            "temperature": 0}
    running, queued = _stream(busy, long), None
    try:
        assert running[1].status == 200
        running[1].read1(1)  # its first chunk: it holds the one batch row
        queued = _stream(busy, long)  # the one place in the queue (it waits: the row is taken)
        for _ in range(5000):  # each look is a request: no sleeping
            if busy.metrics()["waiting"] >= 1:
                break
        assert busy.metrics()["waiting"] == 1
        built = busy.metrics()["requests_built"]
        png = base64.b64encode(big_png()).decode()
        count = {"model": "m", "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}},
            {"type": "text", "text": "What is this?"}]}]}
        chat = {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + png}},
            {"type": "text", "text": "What is this?"}]}], "max_tokens": 1}
        ground = {"image": "data:image/png;base64," + png, "instruction": "the red square"}
        asks = [("/v1/messages/count_tokens", count)] * 6 + [("/v1/chat/completions", chat),
                                                            ("/v1/ground", ground), ("/v1/messages", {
                                                                **count, "max_tokens": 1}),
                                                            ("/v1/responses", {"input": "Hi", "max_output_tokens": 1})]
        with ThreadPoolExecutor(len(asks)) as pool:
            got = list(pool.map(lambda a: busy.request("POST", a[0], a[1], key=None), asks))
        assert [status for status, _ in got] == [503] * len(asks), got
        assert all("busy" in json.dumps(body) for _, body in got)
        assert busy.metrics()["requests_built"] == built  # no request's media was read, none was built
    finally:
        for conn in (running, queued):
            if conn is not None:
                conn[0].close()
    for _ in range(5000):  # the two streams' rows are freed once their clients are gone
        if busy.request("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                         "max_tokens": 1}, key=None)[0] == 200:
            break
    else:
        raise AssertionError("the server did not free the queue")


def test_health_answers_while_a_body_of_a_million_parts_is_read_and_refused(busy):
    """36 MB of empty parts: counted before JSON parsing (on a worker thread, never the event
    loop) and refused; /health is answered while it is in flight."""
    part = b'{"type": "input_text", "text": ""}'
    body = b'{"model": "m", "input": [{"role": "user", "content": [' + b", ".join([part] * 1_000_000) + b"]}]}"
    assert len(body) > 35_000_000
    result, done = {}, threading.Event()

    def send():
        conn = http.client.HTTPConnection("127.0.0.1", busy.port, timeout=120)
        conn.request("POST", "/v1/responses", body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        result["status"], result["body"] = r.status, json.loads(r.read())
        conn.close()
        done.set()

    sender = threading.Thread(target=send)
    sender.start()
    answered_during = 0
    while not done.is_set():
        assert busy.request("GET", "/health", key=None)[0] == 200
        answered_during += not done.is_set()
    sender.join()
    assert result["status"] == 400 and "objects and lists" in result["body"]["error"]["message"], result
    assert answered_during >= 1


# ------------------------------------------------------------------------------ an in-process server


class InProcess:
    """The server in this process on a loopback port (so that a test can instrument its processor)."""

    def __init__(self, **kwargs):
        import uvicorn

        import mlx_qwen3vl as M
        from conftest import FIXTURES
        from mlx_qwen3vl.server import build_server

        model, self.processor = M.load(FIXTURES / "tiny-a")
        self.app, self.engine = build_server(model, self.processor, model_id="m", ui=False, **kwargs)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)  # before the thread starts: a request waits in the backlog until it serves
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="on", ws="none"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()

    def request(self, method, path, body=None, key=None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        conn.request(method, path, body=None if body is None else json.dumps(body),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        raw = r.read()
        conn.close()
        return r.status, json.loads(raw) if raw else None

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


@pytest.fixture(scope="module")
def inproc():
    s = InProcess(max_queue=16, max_batch=2, responses_store_bytes=1 << 20)
    assert s.request("GET", "/health")[0] == 200
    yield s
    s.stop()


def small_png(color) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (64, 48), color).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_a_text_request_is_answered_while_image_requests_are_preprocessed(inproc):
    """Six image requests held inside the processor's image preprocessing (more than the media
    places: two of them wait for one) do not hold up a text-only request: it is built and answered,
    the same answer as on an idle server, while they are still in there. (Before, one processor
    lock made it wait for all six: a 1-token request delayed seconds by big images.)"""
    from mlx_qwen3vl.server.model_inputs import MEDIA_WORKERS

    text = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 3, "temperature": 0}
    status, alone = inproc.request("POST", "/v1/chat/completions", text)
    assert status == 200
    processor, inside, release = inproc.processor, threading.Semaphore(0), threading.Event()
    original = processor.process_images

    def held(*args, **kwargs):  # an image request's preprocessing: waits here until released
        inside.release()
        assert release.wait(60)
        return original(*args, **kwargs)

    processor.process_images = held
    images = [{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": small_png(c)}},
                                                         {"type": "text", "text": "Color?"}]}], "max_tokens": 1}
              for c in [(200, 0, 0), (0, 200, 0), (0, 0, 200), (200, 200, 0), (0, 200, 200), (200, 0, 200)]]
    pool = ThreadPoolExecutor(len(images) + 1)
    try:
        pending = [pool.submit(inproc.request, "POST", "/v1/chat/completions", body) for body in images]
        for _ in range(MEDIA_WORKERS):  # every media place is taken by a held image request
            assert inside.acquire(timeout=60)
        answer = pool.submit(inproc.request, "POST", "/v1/chat/completions", text)
        status, during = answer.result(timeout=60)  # answered while the six are held
        assert not release.is_set() and not any(f.done() for f in pending)
        assert status == 200 and during["choices"][0]["message"] == alone["choices"][0]["message"]
        assert during["usage"]["prompt_tokens"] == alone["usage"]["prompt_tokens"]
    finally:
        release.set()
        processor.process_images = original
        results = [f.result(timeout=120) for f in pending]
        pool.shutdown()
    assert [s for s, _ in results] == [200] * len(images)


def test_health_is_answered_while_a_body_is_being_parsed(inproc, monkeypatch):
    """A body's parse is held inside the parser (a worker thread): /health is answered meanwhile.
    (Were the parse on the event loop, the held parser would hold /health too: before, a 36 MB body
    kept /health waiting 7.9 s.)"""
    from mlx_qwen3vl.server import service

    inside, release = threading.Event(), threading.Event()
    original = service.parse_json

    def held(raw):
        inside.set()
        assert release.wait(60)
        return original(raw)

    monkeypatch.setattr(service, "parse_json", held)
    pool = ThreadPoolExecutor(1)
    try:
        pending = pool.submit(inproc.request, "POST", "/v1/chat/completions",
                              {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 1})
        assert inside.wait(60)
        assert inproc.request("GET", "/health")[0] == 200
        assert not pending.done()
    finally:
        release.set()
        status = pending.result(timeout=120)[0]
        pool.shutdown()
    assert status == 200


def rss() -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS:")).split()[1]) << 10


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads RSS from /proc")
def test_the_responses_store_stays_within_its_flag_in_measured_rss(inproc, monkeypatch):
    """--responses-store-mb 1 and eight responses whose call ids are 8 MiB (the finding: 20 MiB
    ids, the store said 10 KB while RSS grew 190 MB and stayed): none is kept, the store's count
    stays under the flag, this process's RSS grows far less than one entry would hold; small
    responses are kept up to the flag. The walk over an entry runs off the event loop."""
    from mlx_qwen3vl.server import store as S

    walked_on, footprint = set(), S.footprint

    def watched(obj, budget):
        walked_on.add(threading.current_thread())
        return footprint(obj, budget)

    monkeypatch.setattr(S, "footprint", watched)

    def respond(call_id):
        body = {"model": "m", "max_output_tokens": 1, "input": [
            {"role": "user", "content": "Look it up."},
            {"type": "function_call", "call_id": call_id, "name": "lookup", "arguments": "{}"},
            {"type": "function_call_output", "call_id": call_id, "output": "found"}]}
        status, out = inproc.request("POST", "/v1/responses", body)
        assert status == 200, out
        return out["id"]

    def stored():
        return inproc.request("GET", "/metrics")[1]

    respond("w" * (8 << 20))  # one-off costs (buffers, the first big parse) before measuring
    before, kept = rss(), stored()["responses_stored"]
    for i in range(8):
        respond(str(i) * (8 << 20))
    grown = rss() - before
    m = stored()
    assert m["responses_stored"] == kept and m["responses_store_bytes"] <= 1 << 20
    assert grown < 64 << 20, grown  # kept, the eight would hold 128 MiB of ids (allocator slack aside)
    ids = [respond(f"call_{i}_" + "x" * (64 << 10)) for i in range(30)]  # ~130 KB each
    m = stored()
    assert m["responses_evicted"] > 0 and 0 < m["responses_store_bytes"] <= 1 << 20
    assert inproc.request("GET", f"/v1/responses/{ids[-1]}")[0] == 200  # the newest is kept
    assert walked_on and inproc.thread not in walked_on


def test_health_is_answered_while_a_stored_response_is_serialised(inproc, monkeypatch):
    """GET /v1/responses/{id} turns a stored response (up to the store's size) into JSON: held
    inside that serialisation (a hook in JSONResponse.render), /health is answered meanwhile, and
    the response comes back whole once released. (On the event loop, the held serialisation held
    /health too: the /health request below then timed out.)"""
    from starlette.responses import JSONResponse

    status, out = inproc.request("POST", "/v1/responses", {"model": "m", "input": "Say hi.", "max_output_tokens": 2,
                                                           "temperature": 0})
    assert status == 200
    rid, inside, release = out["id"], threading.Event(), threading.Event()
    render = JSONResponse.render

    def held(self, content):
        if isinstance(content, dict) and content.get("id") == rid:
            inside.set()
            assert release.wait(60)
        return render(self, content)

    monkeypatch.setattr(JSONResponse, "render", held)
    pool = ThreadPoolExecutor(1)
    try:
        pending = pool.submit(inproc.request, "GET", f"/v1/responses/{rid}")
        assert inside.wait(60)
        conn = http.client.HTTPConnection("127.0.0.1", inproc.port, timeout=30)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
        conn.close()
        assert not pending.done()
    finally:
        release.set()
        got = pending.result(timeout=120)
        pool.shutdown()
    assert got == (200, out)


def test_a_response_object_is_built_and_encoded_off_the_event_loop(inproc, monkeypatch):
    """A response object repeats its request's instructions and tools (up to the body's size):
    every time one is made (the stream's first and last events, the whole answer, the store's
    copy, GET /v1/responses/{id}) and encoded, it is on a worker thread, never the event loop's
    (which the answers of every other request share), streamed or not."""
    from mlx_qwen3vl.server import endpoint, responses

    made_on, response = set(), responses.ResponseWriter.response
    sse = endpoint.sse

    def made(self):
        made_on.add(threading.current_thread())
        return response.fget(self)

    def encoded(event, named=True):
        if "response" in event:
            made_on.add(threading.current_thread())
        return sse(event, named)

    monkeypatch.setattr(responses.ResponseWriter, "response", property(made))
    monkeypatch.setattr(endpoint, "sse", encoded)
    body = {"model": "m", "input": "Say hi.", "instructions": "Be brief. " * 50, "max_output_tokens": 2,
            "temperature": 0, "tools": [{"type": "function", "name": "lookup", "parameters": {"type": "object"}}]}
    status, whole = inproc.request("POST", "/v1/responses", body)
    assert status == 200 and whole["instructions"] == body["instructions"]
    conn = http.client.HTTPConnection("127.0.0.1", inproc.port, timeout=120)
    conn.request("POST", "/v1/responses", body=json.dumps({**body, "stream": True}),
                 headers={"Content-Type": "application/json"})
    stream = conn.getresponse().read().decode()
    conn.close()
    done = [json.loads(line[6:]) for line in stream.splitlines() if line.startswith("data: ")][-1]
    def output(response):  # its items, their ids (new per response) left out
        return [{k: v for k, v in item.items() if k != "id"} for item in response["output"]]

    assert done["type"] == f"response.{whole['status']}" and output(done["response"]) == output(whole)
    assert inproc.request("GET", f"/v1/responses/{whole['id']}") == (200, whole)
    assert made_on and inproc.thread not in made_on


def test_images_past_the_context_are_refused_before_they_are_preprocessed(inproc):
    """60 small images are 4200 image tokens, past tiny-a's 4096-token context: refused from their
    headers (context_length_exceeded) before the processor reads a pixel (before, every image was
    preprocessed, then the prompt's length refused)."""
    processor, calls = inproc.processor, []
    original = processor.process_images

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    processor.process_images = counted
    try:
        shot = {"type": "image_url", "image_url": {"url": small_png((9, 9, 9))}}
        status, err = inproc.request("POST", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": [shot] * 60}], "max_tokens": 1})
        assert status == 400 and err["error"]["code"] == "context_length_exceeded", err
        assert not calls
        status, _ = inproc.request("POST", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": [shot] * 2}], "max_tokens": 1})
        assert status == 200 and calls
    finally:
        processor.process_images = original
