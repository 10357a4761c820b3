"""The OpenAI-compatible server, end to end: a real server process on a free 127.0.0.1 port with
the tiny fixture checkpoint, called with the real `openai` client (and raw HTTP for bad input).
Answers are compared with generate() run in this process (greedy, and seeded sampling token for
token)."""

import base64
import http.client
import http.server
import io
import json
import os
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image

import mlx_qwen3vl as M
from mlx_qwen3vl.engine.core import kv_bytes_per_token
from mlx_qwen3vl.generate import token_bytes
from mlx_qwen3vl.server.__main__ import BLAS_ENV
from conftest import FIXTURES, load_fixture_model, write_fixture_video

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

ROOT = FIXTURES.parents[1]


BLAS_THREADS = {"mkl_rt": ("MKL_Get_Max_Threads", "MKL_Set_Num_Threads"),
                "openblas": ("scipy_openblas_get_num_threads64_", "scipy_openblas_set_num_threads64_"),
                "gomp": ("omp_get_max_threads", "omp_set_num_threads")}


def _blas_threads(n=None):
    """Set the BLAS libraries loaded in this process to n threads; returns their former counts."""
    import ctypes
    import re

    before = {}
    if sys.platform != "linux":
        return before
    for path in set(re.findall(r"(/\S+\.so[.\d]*)", open("/proc/self/maps").read())):
        for key, (get, set_) in BLAS_THREADS.items():
            if key in os.path.basename(path):
                try:
                    lib = ctypes.CDLL(path)
                    before[path] = getattr(lib, get)()
                    getattr(lib, set_)(n if isinstance(n, int) else n[path])
                except (OSError, AttributeError, KeyError):
                    pass
    return before
MEDIA = FIXTURES / "media"
KEY = "test-key"
CHECKPOINT = "tiny-a"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *args, model=None, env=None):
        self.port = _free_port()
        # The BLAS thread count the server would restart itself with (--blas-threads 1), set here.
        env = {**os.environ, "PYTHONPATH": str(ROOT), **dict.fromkeys(BLAS_ENV, "1"), **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlx_qwen3vl.server", "--model", str(model or FIXTURES / CHECKPOINT), "--port",
             str(self.port), *args], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.log, self.ready = [], threading.Event()
        threading.Thread(target=self._drain, daemon=True).start()
        if not self.ready.wait(120):
            self.stop()
            raise RuntimeError("server did not start:\n" + "".join(self.log))
        assert self.request("GET", "/health")[0] == 200

    def _drain(self):
        for line in self.proc.stderr:
            self.log.append(line)
            if "Uvicorn running on" in line:
                self.ready.set()
        self.ready.set()  # exited: wake the waiter, which then sees the log

    def request(self, method, path, body=None, headers=None, key=KEY, with_headers=False):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        h = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
        data = body if isinstance(body, (bytes, str)) or body is None else json.dumps(body)
        conn.request(method, path, body=data, headers=h)
        r = conn.getresponse()
        raw = r.read()
        conn.close()
        if with_headers:  # (status, lower-cased response headers)
            return r.status, {k.lower(): v for k, v in r.getheaders()}
        return r.status, json.loads(raw) if raw else None

    def metrics(self):
        return self.request("GET", "/metrics")[1]

    def client(self):
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=KEY, max_retries=0, timeout=120)

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def server():
    s = Server("--api-key", KEY, "--max-body-bytes", "1000000", "--allowed-local-media-path", str(MEDIA),
               "--allow-media-host", "127.0.0.1", "--log-level", "info")  # the media test's helper serves on it
    yield s
    s.stop()


@pytest.fixture(scope="module")
def local():
    """The reference side (generate() in this process), with one BLAS thread as the server runs:
    spinning BLAS threads beside the server's make both far slower on a busy 2-core machine."""
    before = _blas_threads(1)
    yield load_fixture_model(CHECKPOINT), M.Processor.from_pretrained(FIXTURES / CHECKPOINT)
    _blas_threads(before)


def png_bytes(name=None, array=None):
    if name is not None:
        return (MEDIA / name).read_bytes()
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes, subtype=True):
    return ("data:image/png;base64," if subtype else "data:image;base64,") + base64.b64encode(data).decode()


def user(text, *images, subtype=True):
    return {"role": "user", "content": [*({"type": "image_url", "image_url": {"url": data_url(i, subtype)}}
                                          for i in images), {"type": "text", "text": text}]}


def local_messages(messages):
    """The same conversation for generate(): images as bytes."""
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            content = [{"type": "image", "image": base64.b64decode(p["image_url"]["url"].split(",", 1)[1])}
                       if p["type"] == "image_url" else p for p in content]
        out.append({"role": m["role"], "content": content})
    return out


def expected(local, messages, max_tokens, **kw):
    model, processor = local
    return M.generate(model, processor, messages=local_messages(messages), max_tokens=max_tokens, **kw)


def test_answer_and_stream_with_image_equal_generate(server, local):
    client = server.client()
    for subtype in (True, False):
        messages = [user("Describe the picture.", png_bytes("img_123x77.png"), subtype=subtype)]
        want = expected(local, messages, 12)
        r = client.chat.completions.create(model="m", messages=messages, max_tokens=12, temperature=0)
        assert r.choices[0].message.content == want.text
        assert r.choices[0].finish_reason == want.finish_reason
        assert r.usage.prompt_tokens == want.prompt_tokens and r.usage.completion_tokens == len(want.token_ids)

        pieces, usage, finish = [], None, None
        for chunk in client.chat.completions.create(model="m", messages=messages, max_tokens=12, temperature=0,
                                                    stream=True, stream_options={"include_usage": True}):
            if chunk.usage:
                usage = chunk.usage
            for c in chunk.choices:
                pieces.append(c.delta.content or "")
                finish = c.finish_reason or finish
        assert "".join(pieces) == want.text and finish == want.finish_reason
        assert usage.prompt_tokens == want.prompt_tokens
        assert usage.prompt_tokens_details.cached_tokens == want.prompt_tokens - 1  # the same prompt again


def test_models_health_and_logprobs(server, local):
    status, body = server.request("GET", "/v1/models")
    assert status == 200 and body["data"][0]["id"].endswith(CHECKPOINT)
    messages = [user("Hi", png_bytes("img_90x260.png"))]
    r = server.client().chat.completions.create(model="m", messages=messages, max_tokens=4, temperature=0,
                                                logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.top_logprobs[0].logprob == t.logprob for t in content)  # greedy: the best token
    # `bytes` are each token's own bytes, also for a token that is part of a UTF-8 character (whose
    # lone decode is U+FFFD); this answer has such tokens.
    want = expected(local, messages, 4).token_ids
    tokenizer = local[1].tokenizer
    assert [t.bytes for t in content] == [list(token_bytes(tokenizer, i)) for i in want]
    assert any(t.token == "\ufffd" and t.bytes != [239, 191, 189] for t in content)
    assert [t.top_logprobs[0].bytes for t in content] == [t.bytes for t in content]


def test_stop_string_across_tokens(server, local):
    messages = [user("Say something.")]
    full = expected(local, messages, 16).text
    stop = full[5:9]  # a piece of the answer, likely across token boundaries
    r = server.client().chat.completions.create(model="m", messages=messages, max_tokens=16, temperature=0, stop=[stop])
    assert r.choices[0].message.content == full[:full.find(stop)] and r.choices[0].finish_reason == "stop"
    text = "".join(c.choices[0].delta.content or "" for c in server.client().chat.completions.create(
        model="m", messages=messages, max_tokens=16, temperature=0, stop=[stop], stream=True) if c.choices)
    assert text == full[:full.find(stop)]


def test_logit_bias_and_vllm_stopping_fields_equal_generate(server, local):
    """logit_bias (OpenAI's, token id strings), stop_token_ids, min_tokens and ignore_eos each change
    the answer exactly as generate() with the same settings (the same mlx-lm processor), streamed
    and not."""
    messages = [user("Say something.")]
    plain = expected(local, messages, 10)
    first, second = plain.token_ids[0], plain.token_ids[1]
    cases = [  # (request fields, generate() arguments): each changes this answer
        ({"logit_bias": {str(first): -100, "7": 3.5}}, dict(logit_bias={first: -100, 7: 3.5})),
        ({"logit_bias": {str(second): 100}}, dict(logit_bias={second: 100})),
        ({"stop_token_ids": [second]}, dict(stop_token_ids=[second])),
        ({"stop_token_ids": [first], "min_tokens": 3}, dict(stop_token_ids=[first], min_tokens=3)),
        ({"ignore_eos": True, "min_tokens": 10}, dict(ignore_eos=True, min_tokens=10)),
    ]
    for fields, kw in cases:
        want = expected(local, messages, 10, **kw)
        assert want.token_ids != plain.token_ids or kw.get("ignore_eos"), fields
        r = server.client().chat.completions.create(model="m", messages=messages, max_tokens=10, temperature=0,
                                                    extra_body=fields)
        assert (r.choices[0].message.content, r.choices[0].finish_reason) == (want.text, want.finish_reason), fields
        assert r.usage.completion_tokens == len(want.token_ids)
        text = "".join(c.choices[0].delta.content or "" for c in server.client().chat.completions.create(
            model="m", messages=messages, max_tokens=10, temperature=0, extra_body=fields, stream=True) if c.choices)
        assert text == want.text, fields
    assert len(expected(local, messages, 10, stop_token_ids=[first], min_tokens=3).token_ids) >= 3


FIELD_ERRORS = [  # chat-completions fields a client may send that this server cannot honour: a 400 naming each
    ({"max_new_tokens": 5}, "max_new_tokens"), ({"frobnicate": 1}, "frobnicate"), ({"functions": []}, "functions"),
    ({"reasoning_effort": "low"}, "reasoning_effort"),
    ({"include_stop_str_in_output": True}, "include_stop_str_in_output"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls"), ({"store": True}, "store"),
    ({"modalities": ["text", "audio"]}, "modalities"), ({"logit_bias": {"x": 1}}, "logit_bias.x"),
    ({"logit_bias": {"5": 101}}, "logit_bias.5"), ({"logit_bias": {"5": "1"}}, "logit_bias.5"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"), ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"stop_token_ids": [99999999]}, "stop_token_ids"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"), ({"ignore_eos": "yes"}, "ignore_eos"),
]


@pytest.mark.parametrize("fields,param", FIELD_ERRORS, ids=[p for _, p in FIELD_ERRORS])
def test_fields_this_server_cannot_honour_are_refused_by_name(server, fields, param):
    status, err = server.request("POST", "/v1/chat/completions", {**GOOD, **fields})
    assert status == 400 and err["error"]["param"] == param and param.split(".")[0] in err["error"]["message"], err


def test_concurrent_clients_get_their_single_answers_decoded_together(server, local):
    images = [png_bytes(n) for n in ("img_123x77.png", "img_300x200.png", "img_90x260.png")]
    # 10 distinct requests of different lengths (so rows are padded), each sent 4 times in all.
    distinct = [[user(f"Request {k}: what is shown?" + " more" * (k % 4), images[k % 3])] if k % 4 else
                [user(f"Request {k}, text only" + " please" * k)] for k in range(10)]
    jobs = [distinct[(3 * c + r) % 10] for c in range(8) for r in range(5)]
    wants = {json.dumps(m): expected(local, m, 8).text for m in distinct}
    before = server.metrics()["decode_steps_by_batch_size"]

    def client_run(c):
        client = server.client()
        return [client.chat.completions.create(model="m", messages=jobs[c * 5 + r], max_tokens=8,
                                               temperature=0).choices[0].message.content for r in range(5)]

    with ThreadPoolExecutor(8) as pool:
        answers = sum(pool.map(client_run, range(8)), [])
    assert answers == [wants[json.dumps(m)] for m in jobs]
    after = server.metrics()["decode_steps_by_batch_size"]
    batched = sum(v - before.get(k, 0) for k, v in after.items() if int(k) >= 2)
    assert batched > 0, after  # some decode steps ran several requests' rows together


SEEDED = dict(max_tokens=12, temperature=1.0, seed=1234)


def _seeded_expectation(local):
    """(messages, generate()'s answer) of the seeded request, and its tokens as the server's
    logprobs name them (one string per token)."""
    messages = [user("Pick a word at random.", png_bytes("img_123x77.png"))]
    want = expected(local, messages, **SEEDED)
    greedy = expected(local, messages, SEEDED["max_tokens"])
    assert want.token_ids != greedy.token_ids  # the draw matters, so the test can tell streams apart
    decode = local[1].tokenizer.decode
    return messages, want, [decode([t]) for t in want.token_ids]


def _check_seeded(r, want, pieces):
    assert r.choices[0].message.content == want.text
    assert [t.token for t in r.choices[0].logprobs.content] == pieces
    assert r.choices[0].finish_reason == want.finish_reason


def test_seeded_sampling_equals_generate(server, local):
    """temperature 1 with a seed: the server draws from the request's own random stream, the one
    generate(seed=...) uses, so the answer is generate()'s token for token (and again on resend)."""
    messages, want, pieces = _seeded_expectation(local)
    client = server.client()
    for _ in range(2):
        r = client.chat.completions.create(model="m", messages=messages, logprobs=True, **SEEDED)
        _check_seeded(r, want, pieces)


def test_seeded_sampling_inside_a_running_batch_equals_generate(server, local):
    """The same seeded request sent while four other requests (two greedy, two sampled; prompts of
    other lengths, so the batch is padded) are decoding still gets generate()'s tokens, and every
    one of its decode steps ran with all four others."""
    messages, want, pieces = _seeded_expectation(local)
    others = [[user(f"Tell story {k}." + " slowly" * k, *[png_bytes("img_90x260.png")] * (k % 2))] for k in range(4)]
    # Greedy, or seeds whose answers run the full 1000 tokens (generate() with these settings).
    settings = [dict(temperature=0), dict(temperature=1.0, seed=104),
                dict(temperature=0), dict(temperature=1.0, seed=105)]
    started = [threading.Event() for _ in others]
    release = threading.Event()

    def background(k):
        stream = server.client().chat.completions.create(model="m", messages=others[k], max_tokens=1000,
                                                         logprobs=True, stream=True, **settings[k])
        try:
            for chunk in stream:
                if chunk.choices and chunk.choices[0].logprobs:  # a decoded token: the row is in the batch
                    started[k].set()
                if release.is_set():
                    return
        finally:
            started[k].set()
            stream.close()  # frees the row

    with ThreadPoolExecutor(len(others)) as pool:
        futures = [pool.submit(background, k) for k in range(len(others))]
        try:
            assert all(e.wait(120) for e in started)
            five = str(len(others) + 1)
            before = server.metrics()["decode_steps_by_batch_size"].get(five, 0)
            r = server.client().chat.completions.create(model="m", messages=messages, logprobs=True, **SEEDED)
            after = server.metrics()["decode_steps_by_batch_size"].get(five, 0)
        finally:
            release.set()
        for f in futures:
            f.result()
    _check_seeded(r, want, pieces)
    # Its first token comes from its prefill; each later one from a step of all five rows.
    assert after - before == len(want.token_ids) - 1


def test_agent_conversation_reuses_each_turn(server, local):
    """History resent each turn, a new same-size screenshot each turn: each turn's cached tokens
    cover the previous prompt, and each answer equals a fresh run of the whole conversation."""
    base = np.asarray(Image.open(MEDIA / "img_300x200.png").convert("RGB").resize((96, 64)))
    client, messages, previous = server.client(), [{"role": "system", "content": "You are a GUI agent."}], 0
    for turn in range(5):
        screenshot = np.roll(base, 13 * turn, axis=1)
        messages.append(user(f"Step {turn}: click the button.", png_bytes(array=screenshot), subtype=turn % 2 == 0))
        want = expected(local, messages, 6)
        r = client.chat.completions.create(model="m", messages=messages, max_tokens=6, temperature=0)
        assert r.choices[0].message.content == want.text, turn
        assert r.usage.prompt_tokens_details.cached_tokens >= previous, turn
        previous = r.usage.prompt_tokens
        messages.append({"role": "assistant", "content": r.choices[0].message.content})


def test_screenshot_as_a_tool_result_equals_generate(server, local):
    """Computer-use loops return the screenshot as the tool's result: the server renders it where
    the chat template puts tool results, as generate() does with the same conversation."""
    shot = png_bytes("img_300x200.png")
    call = {"id": "call_1", "type": "function",
            "function": {"name": "computer_use", "arguments": json.dumps({"action": "left_click",
                                                                            "coordinate": [500, 500]})}}
    messages = [user("Open the settings."), {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": [
                    {"type": "text", "text": "Clicked. The screen now:"},
                    {"type": "image_url", "image_url": {"url": data_url(shot)}}]}]
    local_history = [messages[0], {"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "content": [{"type": "text", "text": "Clicked. The screen now:"},
                                                  {"type": "image", "image": shot}]}]
    model, processor = local
    want = M.generate(model, processor, messages=local_history, max_tokens=6)
    with_image = processor.apply_chat_template(local_history, tokenize=True)
    assert with_image["image_grid_thw"].shape == (1, 3)  # the template renders the tool's screenshot
    r = server.client().chat.completions.create(model="m", messages=messages, max_tokens=6, temperature=0)
    assert r.choices[0].message.content == want.text and r.usage.prompt_tokens == want.prompt_tokens


def test_same_size_image_never_reuses_another_images_state(server, local):
    a = np.asarray(Image.open(MEDIA / "img_300x200.png").convert("RGB"))
    client = server.client()
    for img in (a, 255 - a):
        messages = [user("What changed?", png_bytes(array=img))]
        r = client.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0)
        assert r.choices[0].message.content == expected(local, messages, 8).text
    # The second image's placeholders follow a few text tokens: only those may be reused.
    assert r.usage.prompt_tokens_details.cached_tokens < 10


def test_media_sources_and_pixel_budget(server, local):
    data = png_bytes("img_300x200.png")
    messages = [user("Where is it?", data)]
    want = expected(local, messages, 6)
    client = server.client()
    url = (MEDIA / "img_300x200.png").as_uri()
    r = client.chat.completions.create(model="m", max_tokens=6, temperature=0, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                     {"type": "text", "text": "Where is it?"}]}])
    assert r.choices[0].message.content == want.text

    handler = type("H", (http.server.SimpleHTTPRequestHandler,), {"log_message": lambda *a: None})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), lambda *a: handler(*a, directory=str(MEDIA)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        r = client.chat.completions.create(model="m", max_tokens=6, temperature=0, messages=[
            {"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": f"http://127.0.0.1:{httpd.server_address[1]}/img_300x200.png"}},
                {"type": "text", "text": "Where is it?"}]}])
        assert r.choices[0].message.content == want.text
    finally:
        httpd.shutdown()
        httpd.server_close()

    small = expected(local, messages, 6, min_pixels=32 * 32, max_pixels=64 * 64)
    r = client.chat.completions.create(model="m", messages=messages, max_tokens=6, temperature=0,
                                       extra_body={"min_pixels": 32 * 32, "max_pixels": 64 * 64})
    assert r.usage.prompt_tokens == small.prompt_tokens < want.prompt_tokens
    assert r.choices[0].message.content == small.text


GOOD = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}


def _with(**kw):
    return {**GOOD, **kw}


BAD = [
    ("malformed json", b'{"messages": [', 400, None),
    ("not an object", b"[1, 2]", 400, None),
    ("missing messages", {"max_tokens": 2}, 400, "messages"),
    ("messages not a list", _with(messages="hi"), 400, "messages"),
    ("bad role", _with(messages=[{"role": "robot", "content": "hi"}]), 400, "messages[0].role"),
    ("content wrong type", _with(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content"),
    ("unknown part", _with(messages=[{"role": "user", "content": [{"type": "audio"}]}]), 400,
     "messages[0].content[0].type"),
    ("max_tokens wrong type", _with(max_tokens="ten"), 400, "max_tokens"),
    ("temperature out of range", _with(temperature=3.5), 400, "temperature"),
    ("top_p zero", _with(top_p=0), 400, "top_p"),
    ("min_p out of range", _with(min_p=1.5), 400, "min_p"),
    ("top_logprobs without logprobs", _with(top_logprobs=3), 400, "top_logprobs"),
    ("n > 1", _with(n=2), 400, "n"),
    ("undecodable image", _with(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8gd29ybGQ="}}]}]), 400, "messages"),
    ("bad base64", _with(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image;base64"}}]}]), 400,
     "messages[0].content[0].image_url.url"),
    ("file outside allowed dirs", _with(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}]), 400,
     "messages[0].content[0].image_url.url"),
    ("unreachable url", _with(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}]}]), 400,
     "messages[0].content[0].image_url.url"),
    ("image in a system message", _with(messages=[{"role": "system", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}]}, GOOD["messages"][0]]), 400,
     "messages[0].content[0]"),
    ("image in a developer message", _with(messages=[GOOD["messages"][0], {"role": "developer", "content": [
        {"type": "text", "text": "Rules."}, {"type": "image_url", "image_url": "data:image;base64,aGVsbG8="}]}]), 400,
     "messages[1].content[1]"),
    ("video in an assistant message", _with(messages=[GOOD["messages"][0], {"role": "assistant", "content": [
        {"type": "video_url", "video_url": {"url": "file:///x.mp4"}}]}, GOOD["messages"][0]]), 400,
     "messages[1].content[0]"),
    ("prompt past the context", _with(messages=[{"role": "user", "content": "lorem ipsum " * 3000}]), 400, "messages"),
    ("oversize body", _with(messages=[{"role": "user", "content": "x" * 1_200_000}]), 413, None),
    ("bad schema", _with(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "nope"}}}}}), 400, "response_format"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_request_gets_its_error_and_the_server_keeps_serving(server, case):
    _, body, status, param = case
    got, err = server.request("POST", "/v1/chat/completions", body)
    assert got == status, err
    assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["message"]
    assert err["error"]["param"] == param
    assert server.request("POST", "/v1/chat/completions", GOOD)[0] == 200


def test_api_key_required(server):
    status, err = server.request("POST", "/v1/chat/completions", GOOD, key=None)
    assert status == 401 and err["error"]["type"] == "authentication_error"
    assert server.request("GET", "/v1/models", key="wrong")[0] == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="wrong", max_retries=0).models.list()
    assert server.request("POST", "/v1/chat/completions", GOOD)[0] == 200


def test_disconnect_frees_the_slot(server, local):
    """And while the request decodes, /metrics reports its KV bytes in use: the cache's buffers
    (grown 256 positions at a time), not what admission reserves for it (kv_bytes_needed)."""
    before = server.metrics().get("cancelled", 0)
    stream = server.client().chat.completions.create(model="m", messages=[user("Tell a long story.")],
                                                     max_tokens=3000, temperature=0, stream=True)
    next(iter(stream))
    for _ in range(5000):  # bounded: each poll is one request round trip
        m = server.metrics()
        if m["running"] == 1:
            break
    kv, per = m["kv_cache"], kv_bytes_per_token(local[0])
    assert kv["by_kind"] == {"float": kv["bytes"]} and kv["positions"] > 20, m
    # (one position of slack either side: the model thread may be mid-step while /metrics reads)
    assert (kv["positions"] - 1) * per <= kv["bytes"] <= (kv["positions"] + 257) * per < m["kv_bytes_needed"], m
    stream.close()
    for _ in range(5000):  # bounded: each poll is one request round trip
        m = server.metrics()
        if m["running"] == 0 and m.get("cancelled", 0) > before:
            break
    assert m["running"] == 0 and m.get("cancelled", 0) > before


def test_an_answer_stops_at_the_context_as_generate_s(server, local):
    """A prompt 3 tokens short of the 4,096-token context: the server's answer is generate()'s
    (the library's rule, fit_to_context: finish_reason "length" there); one that fills it is a 400."""
    model, processor = local
    context = model.config.text_config.max_position_embeddings
    template = M.generate(model, processor, "7", max_tokens=1).prompt_tokens - 1  # "7" is one token
    messages = [{"role": "user", "content": "7" * (context - 3 - template)}]
    want = M.generate(model, processor, messages=messages, max_tokens=20)
    assert (want.prompt_tokens, len(want.token_ids), want.finish_reason) == (context - 3, 3, "length")
    r = server.client().chat.completions.create(model="m", messages=messages, max_tokens=20, temperature=0)
    assert (r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens) == (
        want.text, "length", 3)
    status, err = server.request("POST", "/v1/chat/completions",
                                 {"messages": [{"role": "user", "content": "7" * (context - template)}]})
    assert status == 400 and err["error"]["code"] == "context_length_exceeded", err
    assert f"the model's context is {context}" in err["error"]["message"]


TOOLS = [{"type": "function", "function": {
    "name": "click", "description": "Click a point on the screen",
    "parameters": {"type": "object", "properties": {"target": {"type": "string", "enum": ["ok", "cancel"]},
                                                    "double": {"type": "boolean"}},
                   "required": ["target", "double"], "additionalProperties": False}}}]


def test_tool_calls_parse_plain_and_streamed(server):
    client = server.client()
    messages = [user("Press OK.", png_bytes("img_123x77.png"))]
    plain = client.chat.completions.create(model="m", messages=messages, max_tokens=20)
    with_tools = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=1)
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens  # the template rendered the tools
    r = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, tool_choice="required",
                                       max_tokens=60, temperature=0.8, seed=3)
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "click"
    assert json.loads(call.function.arguments)["target"] in ("ok", "cancel")
    calls = {}
    for chunk in client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=60, stream=True,
                                                tool_choice={"type": "function", "function": {"name": "click"}}):
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                calls.setdefault(tc.index, "")
                calls[tc.index] += tc.function.arguments or ""
    assert set(json.loads(calls[0])) == {"target", "double"}


def test_json_schema_output_parses(server):
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
              "required": ["color", "ok"], "additionalProperties": False}
    r = server.client().chat.completions.create(
        model="m", messages=[user("Which color?")], max_tokens=40, temperature=1.0, seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    value = json.loads(r.choices[0].message.content)
    assert value["color"] in ("red", "green", "blue") and isinstance(value["ok"], bool)


def test_tool_call_parser_across_pieces():
    from mlx_qwen3vl.server.tool_calls import ToolCallParser, split_tool_calls

    text = 'Sure.<tool_call>\n{"name": "click", "arguments": {"x": 1}}\n</tool_call> done <tool'
    parser, content, calls = ToolCallParser(), "", []
    for i in range(0, len(text), 3):
        c, new = parser.feed(text[i:i + 3])
        content, calls = content + c, calls + new
    c, new = parser.feed("", final=True)
    assert content + c == "Sure. done <tool" and [x["function"]["name"] for x in calls + new] == ["click"]
    assert split_tool_calls("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])


def test_queue_limit_answers_503_never_hangs():
    s = Server("--max-batch", "1", "--max-queue", "1")
    try:
        body = _with(max_tokens=400, messages=[{"role": "user", "content": "Tell a long story."}])
        with ThreadPoolExecutor(6) as pool:
            statuses = list(pool.map(lambda _: s.request("POST", "/v1/chat/completions", body, key=None)[0], range(6)))
        assert 200 in statuses and 503 in statuses and set(statuses) <= {200, 503}
        assert s.request("POST", "/v1/chat/completions", GOOD, key=None)[0] == 200
        assert s.request("GET", "/v1/models", key=None)[0] == 200  # no key needed when none is set
    finally:
        s.stop()


def test_cors_headers_only_with_the_option(server):
    """CORS is off by default: no Access-Control-* headers, preflights refused. With
    --cors-allow-origin the named origin (only it) gets them, on answers and preflights."""
    origin, preflight = "http://example.test", {"Access-Control-Request-Method": "POST",
                                                "Access-Control-Request-Headers": "authorization,content-type"}

    def cors(s, method, path, sent_origin=origin, extra=None):
        status, headers = s.request(method, path, headers={"Origin": sent_origin, **(extra or {})}, with_headers=True)
        return status, {k: v for k, v in headers.items() if k.startswith("access-control-")}

    status, got = cors(server, "GET", "/v1/models")
    assert status == 200 and got == {}
    status, got = cors(server, "OPTIONS", "/v1/chat/completions", extra=preflight)
    assert status == 405 and got == {}  # no OPTIONS route without CORS

    s = Server("--api-key", KEY, "--cors-allow-origin", origin)
    try:
        status, got = cors(s, "GET", "/v1/models")
        assert status == 200 and got["access-control-allow-origin"] == origin
        status, got = cors(s, "OPTIONS", "/v1/chat/completions", extra=preflight)
        assert status == 200 and got["access-control-allow-origin"] == origin
        assert "POST" in got["access-control-allow-methods"]
        allowed = {h.strip().lower() for h in got["access-control-allow-headers"].split(",")}
        assert {"authorization", "content-type"} <= allowed
        status, got = cors(s, "GET", "/v1/models", sent_origin="http://other.test")
        assert status == 200 and "access-control-allow-origin" not in got
    finally:
        s.stop()


def test_video_url_equals_generate(server, local, tmp_path):
    frames, path = write_fixture_video(tmp_path)
    model, processor = local
    want = M.generate(model, processor, messages=[{"role": "user", "content": [
        {"type": "video", "video": str(path)}, {"type": "text", "text": "What happens?"}]}], max_tokens=6)
    url = "data:video/x-matroska;base64," + base64.b64encode(path.read_bytes()).decode()
    r = server.client().chat.completions.create(model="m", max_tokens=6, temperature=0, messages=[
        {"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                     {"type": "text", "text": "What happens?"}]}])
    assert r.usage.prompt_tokens == want.prompt_tokens and r.choices[0].message.content == want.text


@pytest.mark.parametrize("module,extra", [("mlx_qwen3vl.server", []), ("mlx_qwen3vl.mcp", ["--transport", "http"])])
def test_a_busy_port_is_one_error_line_before_serving(module, extra):
    """The port is bound before the model loads: a taken one is one `error:` line and status 2, with
    no "serving ..." line before it and none of uvicorn's."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        p = subprocess.run([sys.executable, "-m", module, "--model", str(FIXTURES / CHECKPOINT), "--port", str(port),
                            *extra], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                           text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert p.stderr.splitlines() == [f"error: --port {port}: 127.0.0.1:{port} is already in use (another server?); "
                                     "stop it or choose another --port"], p.stderr
