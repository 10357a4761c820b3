"""The server under `mlx.launch -n 2 --backend ring` on 127.0.0.1: rank 0 serves HTTP, both ranks
run the model split in two. Answers (real `openai` client) are compared token for token with
generate() in one process (which test_server.py shows the one-process server equals): greedy
text and image, streamed, a concurrent batch, a seeded sampled request, a request after a
client went away mid-stream, videos and file:// media read on rank 0 only, and tool calls (against
the one-process engine, grammar included). Tensor parallel on tiny-a and tiny-moe; pipeline
(`--parallel pipeline`) on tiny-a (uneven stages: 2 layers and 1), tiny-b (DeepStack tap 2 on
the second stage) and tiny-moe: the same requests (the tensor tests' helpers), a conversation that
must reuse its prefix on every rank, and last a stop by SIGINT / SIGTERM to every rank.
Every launch is bounded (START_TIMEOUT / END_TIMEOUT) and killed by its own process group if it
overstays.
"""

import base64
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

import mlx_qwen3vl as M
from conftest import FIXTURES, load_fixture_model, write_fixture_video
from mlx_qwen3vl import distributed
from mlx_qwen3vl.server import replica
from mlx_qwen3vl.server.__main__ import BLAS_ENV
from mlx_qwen3vl.server.prepared import Prepared
from mlx_qwen3vl.server.protocol import SamplingParams
from test_server import (KEY, MEDIA, SEEDED, TOOLS, _check_seeded, _free_port, data_url, local_messages, png_bytes,
                         user)

openai = pytest.importorskip("openai")

ROOT = FIXTURES.parents[1]
START_TIMEOUT = 300  # two ranks loading on a shared, busy machine
END_TIMEOUT = 60
needs_launch = pytest.mark.skipif(shutil.which("mlx.launch") is None, reason="mlx.launch is not on PATH")


class Launch:
    """`python -m mlx_qwen3vl.server` on two ranks; ready once rank 0 answers /health."""

    def __init__(self, checkpoint, *args):
        self.port = _free_port()
        command = distributed.local_launch_command(2, [
            sys.executable, "-m", "mlx_qwen3vl.server", "--model", str(FIXTURES / checkpoint), "--port",
            str(self.port), "--api-key", KEY, *args])
        ring = int(command[command.index("--starting-port") + 1])
        self.ring_ports = {ring, ring + 1}
        assert self.port not in self.ring_ports
        env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", **dict.fromkeys(BLAS_ENV, "1")}
        self.proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)
        self.log, self.logged = [], threading.Condition()
        self.drained = threading.Thread(target=self._drain, daemon=True)
        self.drained.start()
        deadline = time.monotonic() + START_TIMEOUT
        while not self._healthy():
            try:
                self.proc.wait(timeout=0.5)  # paces the polls; returns early only if the launch ended
            except subprocess.TimeoutExpired:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError("the 2-rank server did not start:\n" + self.text())

    def _healthy(self):
        import http.client

        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
            conn.request("GET", "/health")
            ok = conn.getresponse().status == 200
            conn.close()
            return ok
        except OSError:
            return False

    def _drain(self):
        for line in self.proc.stderr:
            with self.logged:
                self.log.append(line)
                self.logged.notify_all()
        with self.logged:
            self.log.append("")  # the launch ended: wake any waiter
            self.logged.notify_all()

    def text(self):
        return "".join(self.log)

    def wait_for(self, *patterns, timeout=30):
        """The first match of each regex in the ranks' output, waiting up to `timeout` seconds for
        them (mlx.launch may relay a rank's lines after rank 0 already answers /health)."""
        with self.logged:
            self.logged.wait_for(lambda: all(re.search(p, self.text()) for p in patterns)
                                 or self.proc.poll() is not None, timeout=timeout)
        found = [re.search(p, self.text()) for p in patterns]
        assert all(found), self.text()
        return found

    def pids(self):
        """{rank: pid} from the ranks' start lines."""
        found = self.wait_for(r"rank 0 of 2, pid (\d+)", r"rank 1 of 2 \(pid (\d+)\)")
        return {r: int(m.group(1)) for r, m in enumerate(found)}

    def client(self):
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=KEY, max_retries=0, timeout=120)

    def metrics(self):
        import http.client

        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {KEY}"})
        body = json.loads(conn.getresponse().read())
        conn.close()
        return body

    def wait_end(self):
        """The launcher's end (True), or False after END_TIMEOUT."""
        try:
            self.proc.wait(timeout=END_TIMEOUT)
        except subprocess.TimeoutExpired:
            return False
        self.drained.join(10)
        return True

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the launcher's own session: it and its ranks
            self.proc.wait(30)


@pytest.fixture(scope="module")
def local():
    from test_server import _blas_threads

    before = _blas_threads(1)
    cache = {}

    def get(checkpoint):
        if checkpoint not in cache:
            cache[checkpoint] = load_fixture_model(checkpoint), M.Processor.from_pretrained(FIXTURES / checkpoint)
        return cache[checkpoint]

    yield get
    _blas_threads(before)


def generate(local, checkpoint, messages, max_tokens, **kw):
    from test_server import expected

    return expected(local(checkpoint), messages, max_tokens, **kw)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    if shutil.which("mlx.launch") is None:
        pytest.skip("mlx.launch is not on PATH")
    videos = tmp_path_factory.mktemp("videos")
    launch = Launch("tiny-a", "--max-batch", "4", "--allowed-local-media-path", str(MEDIA),
                    "--allowed-local-media-path", str(videos))
    launch.videos = videos
    yield launch
    launch.kill()


def listening_ports(pid):
    """TCP ports the process `pid` listens on (Linux /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if os.path.exists(table):
            for line in open(table).read().splitlines()[1:]:
                f = line.split()
                if f[3] == "0A" and f[9] in inodes:  # 0A: LISTEN
                    ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return ports


IMAGE_MESSAGES = [user("Describe the picture.", png_bytes("img_123x77.png"))]
TEXT_MESSAGES = [user("Say something.")]


@needs_launch
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_only_rank0_listens_for_http(dense):
    pids = dense.pids()
    assert dense.port in listening_ports(pids[0])
    assert listening_ports(pids[1]) <= dense.ring_ports  # the ring's own socket at most, never HTTP


def _text_image_and_stream(launch, local, checkpoint):
    client = launch.client()
    for messages in (TEXT_MESSAGES, IMAGE_MESSAGES, [user("Same, no subtype.", png_bytes("img_90x260.png"),
                                                          subtype=False)]):
        want = generate(local, checkpoint, messages, 12)
        r = client.chat.completions.create(model="m", messages=messages, max_tokens=12, temperature=0,
                                           logprobs=True)
        assert r.choices[0].message.content == want.text
        assert [t.token for t in r.choices[0].logprobs.content] == [local(checkpoint)[1].tokenizer.decode([t])
                                                                    for t in want.token_ids]
        assert r.usage.completion_tokens == len(want.token_ids) and r.usage.prompt_tokens == want.prompt_tokens
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="m", messages=IMAGE_MESSAGES, max_tokens=12, temperature=0, stream=True) if c.choices]
    assert "".join(pieces) == generate(local, checkpoint, IMAGE_MESSAGES, 12).text


@needs_launch
def test_text_image_and_stream_equal_one_process(dense, local):
    _text_image_and_stream(dense, local, "tiny-a")


def _concurrent(launch, local, checkpoint, n=6):
    """n different requests at once (text and images, different lengths): each answer is its own
    one-process answer, and some decode steps ran several rows."""
    images = [png_bytes(x) for x in ("img_123x77.png", "img_300x200.png", "img_90x260.png")]
    jobs = [[user(f"Request {k}: what is shown?" + " more" * k, images[k % 3])] if k % 2 else
            [user(f"Request {k}, text only" + " please" * k)] for k in range(n)]
    wants = [generate(local, checkpoint, m, 10).text for m in jobs]
    before = launch.metrics()["decode_steps_by_batch_size"]
    # A long answer is decoding when the others arrive, so they join its batch whatever the timing
    # (six short requests alone may each finish before the next is admitted).
    long = launch.client().chat.completions.create(model="m", messages=[user("Count slowly.")], max_tokens=60,
                                                  temperature=0, stream=True, extra_body={"ignore_eos": True})
    next(iter(long))
    with ThreadPoolExecutor(n) as pool:
        answers = list(pool.map(lambda m: launch.client().chat.completions.create(
            model="m", messages=m, max_tokens=10, temperature=0).choices[0].message.content, jobs))
    for _ in long:
        pass
    assert answers == wants
    after = launch.metrics()["decode_steps_by_batch_size"]
    assert sum(v - before.get(k, 0) for k, v in after.items() if int(k) >= 2) > 0, after


@needs_launch
def test_concurrent_requests_batch_and_equal_one_process(dense, local):
    _concurrent(dense, local, "tiny-a")


def _seeded(launch, local, checkpoint):
    """A seeded sampled request (the seed sent with the orders): generate(seed=...)'s tokens."""
    messages = [user("Pick a word at random.", png_bytes("img_123x77.png"))]
    want = generate(local, checkpoint, messages, **SEEDED)
    assert want.token_ids != generate(local, checkpoint, messages, SEEDED["max_tokens"]).token_ids
    pieces = [local(checkpoint)[1].tokenizer.decode([t]) for t in want.token_ids]
    r = launch.client().chat.completions.create(model="m", messages=messages, logprobs=True, **SEEDED)
    _check_seeded(r, want, pieces)


@needs_launch
def test_per_request_prompt_lookup_equals_one_process(dense, local):
    """A request's own prompt_lookup and num_draft_tokens travel to every rank with it: the greedy
    answer is one process's plain one, and usage counts its drafts."""
    messages = [user("one two three one two three one two three, and then?")]
    want = generate(local, "tiny-a", messages, 16, ignore_eos=True)
    r = dense.client().chat.completions.create(model="m", messages=messages, max_tokens=16, temperature=0,
                                               extra_body={"ignore_eos": True, "prompt_lookup": 3,
                                                           "num_draft_tokens": 3})
    assert r.choices[0].message.content == want.text
    details = r.usage.completion_tokens_details
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens > 0


@needs_launch
def test_seeded_sampling_equals_generate(dense, local):
    _seeded(dense, local, "tiny-a")


def _client_gone(launch, local, checkpoint):
    """An unseeded sampled stream (its seed drawn on rank 0 and sent) is dropped after a few
    tokens while a greedy request decodes beside it; both ranks drop its row at the same step,
    so the greedy answer and the next request are still one process's. Its grammar (a JSON string
    of 500 characters at least) keeps it from ending before it is dropped (an early end-of-text
    draw would leave nothing to cancel)."""
    cancelled = launch.metrics().get("cancelled", 0)
    greedy = [user("Tell me a long story." + " please" * 3, png_bytes("img_300x200.png"))]
    want = generate(local, checkpoint, greedy, 40)
    endless = {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "string", "minLength": 500}}}
    stream = launch.client().chat.completions.create(model="m", messages=[user("Ramble on.")], max_tokens=1000,
                                                     temperature=1.0, response_format=endless, stream=True)
    with ThreadPoolExecutor(1) as pool:
        got = 0
        for chunk in stream:
            got += bool(chunk.choices and chunk.choices[0].delta.content)
            if got == 1:
                future = pool.submit(lambda: launch.client().chat.completions.create(
                    model="m", messages=greedy, max_tokens=40, temperature=0).choices[0].message.content)
            if got == 4:
                break
        stream.close()
        assert future.result() == want.text
    after = [user("And now?", png_bytes("img_123x77.png"))]
    r = launch.client().chat.completions.create(model="m", messages=after, max_tokens=12, temperature=0)
    assert r.choices[0].message.content == generate(local, checkpoint, after, 12).text
    assert launch.metrics()["cancelled"] > cancelled


@needs_launch
def test_client_gone_mid_stream_keeps_ranks_in_step(dense, local):
    _client_gone(dense, local, "tiny-a")


def _json_schema(launch, local, checkpoint):
    """The grammar is compiled again on rank 1 from its description: its masks must be rank 0's
    (a different token on either rank would stop both with "out of step"), so the seeded answer
    is the one-process server's, parses, and repeats exactly; a refused request changes nothing
    on either rank."""
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
              "required": ["color", "ok"], "additionalProperties": False}
    ask = dict(messages=[user("Which color?")], max_tokens=40, temperature=1.0, seed=1,
               response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    want, finish = one_process_server(local, checkpoint, ask)
    client = launch.client()
    first = client.chat.completions.create(model="m", **ask).choices[0]
    assert (first.message.content, first.finish_reason) == (want, finish)
    value = json.loads(want)
    assert value["color"] in ("red", "green", "blue") and isinstance(value["ok"], bool)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", **{**ask, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}})
    assert client.chat.completions.create(model="m", **ask).choices[0].message.content == want
    r = client.chat.completions.create(model="m", messages=IMAGE_MESSAGES, max_tokens=12, temperature=0)
    assert r.choices[0].message.content == generate(local, checkpoint, IMAGE_MESSAGES, 12).text


@needs_launch
def test_json_schema_and_a_bad_request_keep_ranks_in_step(dense, local):
    _json_schema(dense, local, "tiny-a")


def _media_message(kind, source, text):
    """A user message, text first: a request differing only in its text then reuses no cached KV
    past the text, so its media come from the vision-feature cache."""
    return [{"role": "user", "content": [{"type": "text", "text": text}, {"type": kind, kind: source}]}]


@needs_launch
def test_videos_and_file_urls_equal_one_process(dense, local):
    """Videos (decoded into frames on rank 0, their pixels sent) and file:// images and videos
    (read on rank 0 only): two same-size clips, then two same-size images, in turn, then the first
    of each again under another question (a vision-feature cache hit on every rank), each equal to
    one process's answer. A rank reusing the other clip's or image's features would change it."""
    model, processor = local("tiny-a")
    _, clip = write_fixture_video(dense.videos)
    _, reversed_clip = write_fixture_video(dense.videos, reverse=True)
    image = (MEDIA / "img_300x200.png").read_bytes()
    inverted = png_bytes(array=255 - np.asarray(Image.open(MEDIA / "img_300x200.png").convert("RGB")))
    inline_clip = "data:video/x-matroska;base64," + base64.b64encode(clip.read_bytes()).decode()
    asks = [("video", inline_clip, str(clip), "What happens?"),
            ("video", reversed_clip.as_uri(), str(reversed_clip), "What happens?"),
            ("video", clip.as_uri(), str(clip), "What happens next?"),
            ("image", (MEDIA / "img_300x200.png").as_uri(), image, "Where is it?"),
            ("image", data_url(inverted), inverted, "Where is it?"),
            ("image", (MEDIA / "img_300x200.png").as_uri(), image, "Where is it now?")]
    wants = [M.generate(model, processor, messages=_media_message(kind, source, text), max_tokens=8)
             for kind, _, source, text in asks]
    for same_size in (slice(0, 2), slice(3, 5)):  # the two clips', the two images' answers tell them apart
        first, second = wants[same_size]
        assert first.token_ids != second.token_ids
    client = dense.client()
    hits = dense.metrics()["vision_feature_cache"]["hits"]
    for (kind, url, _, text), want in zip(asks, wants):
        r = client.chat.completions.create(model="m", max_tokens=8, temperature=0, messages=[{"role": "user", "content": [
            {"type": "text", "text": text}, {"type": f"{kind}_url", f"{kind}_url": {"url": url}}]}])
        assert r.usage.prompt_tokens == want.prompt_tokens, (kind, url[:40])
        assert r.choices[0].message.content == want.text, (kind, url[:40])
    assert dense.metrics()["vision_feature_cache"]["hits"] >= hits + 2  # the repeats (and earlier requests' image)


def one_process_server(local, checkpoint, body):
    """The one-process server's answer to `body`: its request handling and engine (grammar, seed,
    batching) in this process, without HTTP → (text, finish_reason)."""
    import asyncio

    from mlx_qwen3vl.server.model_thread import ModelThread as Engine
    from mlx_qwen3vl.server.prepared import DoneEvent, ErrorEvent
    from mlx_qwen3vl.server.fetch import MediaPolicy
    from mlx_qwen3vl.server.grammar import GrammarFactory
    from mlx_qwen3vl.server.model_inputs import PromptBuilder
    from mlx_qwen3vl.server.chat import parse_chat_request

    model, processor = local(checkpoint)
    tok = processor.tokenizer
    engine = Engine(model, processor)
    loop = asyncio.new_event_loop()
    try:
        builder = PromptBuilder(engine, MediaPolicy(), GrammarFactory(tok, model.config.text_config.vocab_size,
                                                                      tok.eos_token_id))
        handle = engine.submit(builder.build(parse_chat_request(body)), loop)

        async def answer():
            text = ""
            while True:
                ev = await asyncio.wait_for(handle.queue.get(), 120)
                assert not isinstance(ev, ErrorEvent), ev
                if isinstance(ev, DoneEvent):
                    return text, ev.finish_reason
                text += ev.text

        return loop.run_until_complete(answer())
    finally:
        engine.close()
        loop.close()


def _tool_calls(launch, local, checkpoint):
    """Tools rendered by the template, and the forced call's grammar compiled again on rank 1:
    a required call (greedy), a named call (seeded sampling, streamed) and tools left to the model,
    each the one-process server's answer: same calls, arguments and content."""
    from mlx_qwen3vl.server.tool_calls import split_tool_calls

    messages = [user("Press OK.", png_bytes("img_123x77.png"))]
    client = launch.client()
    asks = [dict(tool_choice="required", max_tokens=60, temperature=0),
            dict(tool_choice={"type": "function", "function": {"name": "click"}}, max_tokens=60, temperature=0.8,
                 seed=3, stream=True),
            dict(max_tokens=30, temperature=0)]
    for ask in asks:
        text, finish = one_process_server(local, checkpoint, dict(messages=messages, tools=TOOLS, **ask))
        content, calls = split_tool_calls(text)
        want = [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
        if "tool_choice" in ask:
            assert want, text  # the grammar forced a call
        r = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, **ask)
        if ask.get("stream"):
            got, pieces = {}, []
            for chunk in r:
                for c in chunk.choices:
                    pieces.append(c.delta.content or "")
                    for tc in c.delta.tool_calls or []:
                        name, args = got.get(tc.index, ("", ""))
                        got[tc.index] = (name + (tc.function.name or ""), args + (tc.function.arguments or ""))
            assert [got[i] for i in sorted(got)] == want
            assert "".join(pieces).strip() == (content or "").strip()
        else:
            m = r.choices[0].message
            assert [(c.function.name, c.function.arguments) for c in m.tool_calls or []] == want
            assert m.content == content
            assert r.choices[0].finish_reason == ("tool_calls" if calls else finish)


@needs_launch
def test_tool_calls_equal_one_process_server(dense, local):
    _tool_calls(dense, local, "tiny-a")


@needs_launch
def test_a_rank_that_dies_ends_the_launch(dense):
    """Last on this launch: rank 1 killed outright; mlx.launch then stops rank 0 (no hang)."""
    os.kill(dense.pids()[1], signal.SIGKILL)
    assert dense.wait_end(), dense.text()
    assert "Node with rank 1" in dense.text()


@needs_launch
def test_moe_server_on_two_ranks_and_clean_shutdown(local):
    """tiny-moe (experts split over the ranks): text, image and a batch equal one process; then
    rank 0 stopped like Ctrl-C / SIGTERM stops a server: the other rank ends too, cleanly."""
    launch = Launch("tiny-moe")
    try:
        client = launch.client()
        for messages in (TEXT_MESSAGES, IMAGE_MESSAGES):
            r = client.chat.completions.create(model="m", messages=messages, max_tokens=12, temperature=0)
            assert r.choices[0].message.content == generate(local, "tiny-moe", messages, 12).text
        _concurrent(launch, local, "tiny-moe", n=4)
        os.kill(launch.pids()[0], signal.SIGTERM)
        assert launch.wait_end(), launch.text()
        assert "rank 1 of 2: rank 0 stopped serving; exiting" in launch.text(), launch.text()
        assert "Node with rank" not in launch.text(), launch.text()  # no rank exited with an error
        assert "Traceback" not in launch.text(), launch.text()
    finally:
        launch.kill()


# ------------------------------------------------------------------ pipeline: layers split over the ranks
# A conversation (history resent, a new same-size screenshot each turn) whose turns reuse the
# previous turn's prefix: on a pipeline every rank must make the same prefix-cache decision
# (a rank reusing less would prefill more tokens than it receives hidden states for).
SCREEN = np.asarray(Image.open(MEDIA / "img_300x200.png").convert("RGB").resize((96, 64)))
TURN_TOKENS = 6


def _conversation(local, checkpoint, turns=3):
    """[(messages, one process's answer)] per turn: a new same-size screenshot each turn, the
    history (with the earlier answers) resent."""
    out, messages = [], []
    for turn in range(turns):
        messages = messages + [user(f"Step {turn}: click the button.",
                                    png_bytes(array=np.roll(SCREEN, 29 * turn, axis=1)))]
        want = generate(local, checkpoint, messages, TURN_TOKENS)
        out.append((messages, want))
        messages = messages + [{"role": "assistant", "content": want.text}]
    return out


def _tight_prefix_budget(local, checkpoint):
    """--prefix-cache-gb that holds the second turn's cache counted as the whole model's per rank
    (its KV bytes × layers / 2), but not counted as tiny-a's first stage's own bytes (2 of its 3
    layers): a rank counting its own bytes would drop the entry there, keep it on the other rank,
    and the third turn would reuse different prefixes on the two ranks."""
    config = local(checkpoint)[0].config.text_config
    want = _conversation(local, checkpoint, 2)[1][1]
    cached = want.prompt_tokens + len(want.token_ids) - 1  # the last answer token is never fed
    per_layer = cached * 2 * config.num_key_value_heads * config.head_dim * 4  # keys and values, float32
    return repr(1.75 * per_layer / (1 << 30))


@pytest.fixture(scope="module", params=["tiny-a", "tiny-b", "tiny-moe"])
def piped(request, local):
    """tiny-a: uneven stages (2 layers and 1, the tied table on both), with a prefix budget that
    only a rank-independent count keeps the same on both; tiny-b: DeepStack tap 2 on the second
    stage (the vision tower on both); tiny-moe: sparse and dense layers."""
    if shutil.which("mlx.launch") is None:
        pytest.skip("mlx.launch is not on PATH")
    checkpoint = request.param
    budget = ["--prefix-cache-gb", _tight_prefix_budget(local, checkpoint)] if checkpoint == "tiny-a" else []
    # Prompts prefilled in chunks of 32: the cache between chunks is evaluated, with each stage's send.
    launch = Launch(checkpoint, "--parallel", "pipeline", "--max-batch", "4", "--prefill-step-size", "32", *budget)
    launch.checkpoint = checkpoint
    yield launch
    if launch.proc.poll() is not None:  # ended under a test: its ranks' last words explain the failure
        print(launch.text()[-4000:])
    launch.kill()


@needs_launch
def test_pipeline_server_equals_one_process(piped, local):
    piped.wait_for(r"rank 0 of 2, pid \d+, pipeline parallel")
    _text_image_and_stream(piped, local, piped.checkpoint)
    _concurrent(piped, local, piped.checkpoint, n=4)


@needs_launch
def test_pipeline_conversation_reuses_its_prefix_on_every_rank(piped, local):
    """Each turn equals a fresh one-process run of the whole conversation and reuses the previous
    turn's prompt (counted on rank 0; the other rank's reuse is in the state digest that every
    step compares: a rank reusing a different prefix stops the launch as "out of step")."""
    client, previous = piped.client(), 0
    for turn, (messages, want) in enumerate(_conversation(local, piped.checkpoint)):
        r = client.chat.completions.create(model="m", messages=messages, max_tokens=TURN_TOKENS, temperature=0)
        assert r.choices[0].message.content == want.text, turn
        assert r.usage.prompt_tokens_details.cached_tokens >= previous, turn
        previous = r.usage.prompt_tokens
    # One more step after the last turn: the ranks compare their cache states once more.
    r = client.chat.completions.create(model="m", messages=TEXT_MESSAGES, max_tokens=4, temperature=0)
    assert r.choices[0].message.content == generate(local, piped.checkpoint, TEXT_MESSAGES, 4).text
    assert "out of step" not in piped.text() and piped.proc.poll() is None, piped.text()



@needs_launch
@pytest.mark.parametrize("ask", [_seeded, _client_gone, _json_schema, _tool_calls],
                         ids=["seeded", "client_gone", "json_schema", "tool_calls"])
def test_pipeline_requests_equal_one_process(piped, local, ask):
    """The tensor tests' requests (see each helper): seeded sampling, a client gone mid-stream,
    a json_schema with a refused one beside it, tool calls."""
    ask(piped, local, piped.checkpoint)


@needs_launch
def test_pipeline_launch_ends_cleanly_or_on_a_lost_rank(piped):
    """Last on each launch. tiny-a and tiny-b: SIGTERM (a service manager's stop) or SIGINT (Ctrl-C,
    which a terminal sends to every process of the job) to every rank. Rank 0 shuts HTTP down and
    tells the other rank, which waits for that: every rank ends with status 0 (mlx.launch would name
    any other), no traceback. (The launcher itself is left out: on Ctrl-C mlx.launch prints its own
    KeyboardInterrupt and stops relaying the ranks' output.)
    tiny-moe: rank 0 killed outright. The other rank ignores SIGTERM (it waits for rank 0's word),
    so it must end on its own: its collective with the lost rank fails, and it exits with one line."""
    if piped.checkpoint == "tiny-moe":
        os.kill(piped.pids()[0], signal.SIGKILL)
        assert piped.wait_end(), piped.text()
        assert "Node with rank 0 exited with code -9" in piped.text(), piped.text()
        assert "rank 1 of 2: the model worker failed (RankLost: rank(s) [0] sent nothing" in piped.text(), piped.text()
        return
    sig = signal.SIGINT if piped.checkpoint == "tiny-b" else signal.SIGTERM
    for pid in piped.pids().values():
        os.kill(pid, sig)
    assert piped.wait_end(), piped.text()
    assert piped.proc.returncode == 0, piped.text()
    assert "rank 1 of 2: rank 0 stopped serving; exiting" in piped.text(), piped.text()
    assert "Node with rank" not in piped.text(), piped.text()  # no rank exited with another status
    assert "Traceback" not in piped.text() and "[ring]" not in piped.text(), piped.text()


def test_pipeline_stages_count_prefixes_alike_and_keep_no_placeholder_features(local):
    """In process, each of tiny-a's two stages (2 layers and 1): the same prefix counts the same
    bytes on both (so both keep and evict alike), and the stage without the vision tower, whose
    features are placeholder zeros, keeps none of them (the first stage keeps the real ones)."""
    from mlx_qwen3vl.engine.prefill import media_features
    from mlx_qwen3vl.pipeline import FeatureCounter, pipeline
    from mlx_qwen3vl.positions import IMAGE
    from mlx_qwen3vl.server.model_thread import ModelThread as Engine
    from mlx_qwen3vl.weights import load_model
    from test_distributed import FakeGroup

    processor = local("tiny-a")[1]
    inputs = processor(text=processor.apply_chat_template(local_messages(IMAGE_MESSAGES)),
                       images=[png_bytes("img_123x77.png")])
    counted, kept = [], []
    for rank in (0, 1):
        model = pipeline(load_model(FIXTURES / "tiny-a", backend="mlx"), FakeGroup(2, rank))
        engine = Engine(model, processor)
        try:
            caches = model.make_cache()
            for c in caches:
                c.update_and_fetch(*[mx.zeros((1, 2, 10, 32))] * 2)
            engine.prefix.insert(list(range(10)), [], caches)
            counted.append((len(caches), engine.prefix.nbytes))
            features = media_features(model, inputs, 0, engine.features)[IMAGE]
            assert features.embeds.shape[0] == int((np.asarray(inputs["input_ids"]) == model.config.image_token_id).sum())
            kept.append((isinstance(model.visual, FeatureCounter), engine.features.stats()["entries"]))
        finally:
            engine.close()
    assert counted[0][0] == 2 and counted[1][0] == 1 and counted[0][1] == counted[1][1] > 0
    assert kept == [(False, 1), (True, 0)]


def test_parallel_flag_reaches_load_and_bad_choices_exit_2(monkeypatch, capsys):
    from mlx_qwen3vl.cpu import threads
    from mlx_qwen3vl.errors import ConfigError
    from mlx_qwen3vl.server.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["--model", str(FIXTURES / "tiny-a"), "--parallel", "rows"])
    assert e.value.code == 2 and "--parallel: invalid choice: 'rows'" in capsys.readouterr().err
    seen = []

    def load(path, dtype=None, parallel="tensor"):
        seen.append(parallel)
        raise ConfigError("stopped after load's arguments")

    monkeypatch.setattr(M, "load", load)
    monkeypatch.setattr(threads, "configure", lambda *a: None)  # leave this process's BLAS threads alone
    for argv, parallel in (([], "tensor"), (["--parallel", "pipeline"], "pipeline")):
        assert main(["--model", str(FIXTURES / "tiny-a"), *argv]) == 2
        assert seen[-1] == parallel
    assert "error: stopped after load's arguments" in capsys.readouterr().err


# ------------------------------------------------------------------ the wire format, in process
def test_orders_round_trip_rebuilds_inputs_sampling_and_grammar(local):
    from mlx_qwen3vl.server.grammar import GrammarFactory
    from mlx_qwen3vl.server.model_inputs import PromptBuilder
    from mlx_qwen3vl.server.chat import parse_chat_request
    from mlx_qwen3vl.server.fetch import MediaPolicy

    model, processor = local("tiny-a")

    class Engine:  # what PromptBuilder reads
        context, default_max_tokens = 4096, 16

    Engine.processor = processor
    tok = processor.tokenizer
    grammars = GrammarFactory(tok, model.config.text_config.vocab_size, tok.eos_token_id)
    builder = PromptBuilder(Engine(), MediaPolicy(), grammars)
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    req = parse_chat_request({"messages": [user("Where?", png_bytes("img_123x77.png"))], "max_tokens": 5,
                              "temperature": 0.7, "top_k": 3, "stop": ["ab"], "logit_bias": {"9": -2.5, "4": 1},
                              "stop_token_ids": [3], "min_tokens": 2,
                              "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}})
    handle = replica._Ghost(builder.build(req), 7)
    orders = replica.decode(replica.encode(replica.Orders(admit=[handle], cancel=[3, 5])), grammars)
    assert orders.cancel == [3, 5] and not orders.stop
    got, sent = orders.admit[0].prepared, handle.prepared
    assert orders.admit[0].id == 7 and got.tokens == sent.tokens and got.media == sent.media
    assert got.sampling.logit_bias == ((4, 1), (9, -2.5))
    assert got.sampling == sent.sampling and got.max_tokens == sent.max_tokens and got.grammar == sent.grammar
    assert set(got.inputs) == set(sent.inputs)
    for k, v in sent.inputs.items():
        if isinstance(v, (np.ndarray, mx.array)):
            assert type(got.inputs[k]) is type(v) and np.array_equal(np.array(got.inputs[k]), np.array(v)), k
            assert np.array(got.inputs[k]).dtype == np.array(v).dtype, k
        else:
            assert got.inputs[k] == v, k
    # The grammar is compiled again on the receiving side: it forbids what the sender's forbids.
    logits = mx.zeros((1, model.config.text_config.vocab_size))
    history = mx.array(sent.tokens)
    assert np.array_equal(np.array(got.processors[0](history, logits)), np.array(sent.processors[0](history, logits)))
    assert got.processors[0] is not sent.processors[0]


class Rank0Of2:
    def rank(self):
        return 0

    def size(self):
        return 2


def test_ranks_out_of_step_stop_with_a_clear_error(monkeypatch):
    sums = {"digest": 11}
    monkeypatch.setattr(replica, "_all_sum", lambda v, g: v + np.array([0, 0, 0, sums["digest"]]))
    leader = replica.Leader(Rank0Of2())
    orders = replica.Orders()
    sums["digest"] = 11  # rank 1 agrees
    assert leader.exchange(orders, 11) is orders
    sums["digest"] = 12
    with pytest.raises(replica.OutOfStep, match=r"rank\(s\) \[1\] are out of step"):
        leader.exchange(orders, 11)
    sums["digest"] = 0  # rank 1's part never arrived
    with pytest.raises(replica.RankLost, match=r"rank\(s\) \[1\] sent nothing"):
        leader.exchange(orders, 11)


def test_leader_draws_the_seed_of_an_unseeded_request(monkeypatch):
    # Rank 1's digest equals rank 0's; the payload comes back as sent.
    monkeypatch.setattr(replica, "_all_sum", lambda v, g: np.where(np.arange(len(v)) == 3, v[2], v)
                        if v.dtype == np.int64 else v)
    p = Prepared(inputs={"input_ids": np.zeros((1, 3), np.int32)}, tokens=[0, 0, 0], media=[],
                 sampling=SamplingParams(temperature=1.0), max_tokens=4)
    h = replica._Ghost(p, 0)
    replica.Leader(Rank0Of2()).exchange(replica.Orders(admit=[h]), 5)
    assert isinstance(h.prepared.sampling.seed, int)
    assert dataclasses.replace(h.prepared.sampling, seed=None) == SamplingParams(temperature=1.0)
