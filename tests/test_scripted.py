"""The scripted-answer checkpoint (tests/scripted.py) through the real runtime: load, generate,
ChatSession, batch_generate and the server answer the script, on the plain MLX graph and the CPU
path, with images and histories in the prompt, and every step's scripted token ahead of all others
by a wide margin."""

import base64
import importlib
import io
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image

import mlx_qwen3vl as M
from mlx_qwen3vl.generate import encode_prompt
from conftest import FIXTURES
from scripted import ScriptError, write_scripted_checkpoint

CALL = ('<tool_call>\n{"name": "computer_use", "arguments": {"action": "left_click", "coordinate": [500, 300]}}'
        '\n</tool_call>')
THINK = "<think>look at the top bar</think>[523, 87]"
CLICK = "Click(box=(100, 200))"
BOX = '{"bbox_2d": [10, 20, 300, 400]}'
MISS = "[-1,-1]"
SCRIPT = {"@open": CALL, "@next": THINK, "@last": CLICK, "<|box_start|>": MISS}  # the last: an existing token
MARGIN = 30  # least logit gap, at every step, between the scripted token and the runner-up

rng = np.random.default_rng(0)
PICTURE = rng.integers(0, 256, (200, 300, 3), dtype=np.uint8)
NEGATIVE = 255 - PICTURE  # same size, other content
SCREENSHOT = rng.integers(0, 256, (720, 1280, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_scripted_checkpoint(tmp_path_factory.mktemp("scripted"), SCRIPT, default=BOX)


_loaded = {}


@pytest.fixture
def loaded(folder, backend):
    if backend not in _loaded:  # "cpu-all" loads while the backend fixture lowers the size thresholds
        _loaded[backend] = M.load(folder, backend="cpu" if backend == "cpu-all" else backend)
    return _loaded[backend]


def run(model, processor, **kwargs):
    """(text, finish_reason, least margin over the steps) of a greedy stream_generate."""
    text, finish, margin = "", None, np.inf
    for r in M.stream_generate(model, processor, max_tokens=120, **kwargs):
        top = np.partition(np.array(r.logprobs), -2)[-2:]
        margin = min(margin, float(top[1] - top[0]))
        text, finish = text + r.text, r.finish_reason
    return text, finish, margin


def check(got, want):
    text, finish, margin = got
    assert (text, finish) == (want, "stop")
    assert margin > MARGIN


@pytest.mark.parametrize("prompt, want", [
    ("@open the settings", CALL), ("first @open, then @next", THINK), ("@next @open", CALL),
    ("see @last", CLICK), ("x@openy", CALL), ("@open <|box_start|>", MISS), ("no trigger in this one", BOX)])
def test_the_latest_trigger_chooses_the_answer(loaded, prompt, want):
    check(run(*loaded, prompt=prompt), want)


def test_images_never_disturb_the_script(loaded):
    for image in (PICTURE, NEGATIVE, SCREENSHOT):
        check(run(*loaded, prompt="then @next", images=[image]), THINK)
    check(run(*loaded, messages=[{"role": "user", "content": [{"type": "image", "image": PICTURE}]}]), BOX)


def test_chat_session_turns_follow_their_triggers(loaded):
    model, processor = loaded
    session = M.ChatSession(model, processor, system="You are a GUI agent.", max_tokens=120)
    for turn, (text, image, want) in enumerate([("Open it. @open", PICTURE, CALL), ("Done. @next", NEGATIVE, THINK),
                                                ("And now @last", PICTURE, CLICK)]):
        assert session.send(text, images=[image]) == want and session.last.finish_reason == "stop"
        assert (session.last.cached_tokens > 0) == (turn > 0)  # later turns reuse the earlier ones
        fresh = M.generate(model, processor, messages=session.messages[:-1], max_tokens=120)
        assert (fresh.text, fresh.finish_reason, fresh.cached_tokens) == (want, "stop", 0)


def test_batch_rows_of_uneven_length(loaded):
    model, processor = loaded
    requests = [{"prompt": "@last"},
                {"messages": [{"role": "user", "content": [{"type": "image", "image": PICTURE},
                                                           {"type": "text", "text": "long " * 60 + "@open"}]}]},
                {"prompt": "nothing to see", "max_tokens": 60}]
    results = M.batch_generate(model, processor, requests, max_tokens=120)
    assert [(r.text, r.finish_reason) for r in results] == [(CLICK, "stop"), (CALL, "stop"), (BOX, "stop")]


def test_a_long_history_near_the_context(loaded, backend):
    if backend == "cpu-all":
        pytest.skip("the long prefill is the same numpy attention the cpu backend runs")
    model, processor = loaded
    messages = [{"role": "system", "content": "You operate a computer. " * 10}]
    for i in range(16):  # the tiny tokenizer spends about a token per character
        messages += [{"role": "user", "content": f"step {i}: {'@open' if i % 2 else '@next'} " + "data, " * 24},
                     {"role": "assistant", "content": CALL if i % 2 else THINK}]
    ask = messages + [{"role": "user", "content": "and @last " + "filler " * 20}]
    quiet = messages + [{"role": "user", "content": "no trigger " * 14}]  # turn 16's @open still wins
    assert 3800 < len(encode_prompt(processor, messages=ask)["input_ids"][0]) < 4096
    check(run(model, processor, messages=ask), CLICK)
    check(run(model, processor, messages=quiet), CALL)


def test_one_answer_for_every_prompt(tmp_path):
    model, processor = M.load(write_scripted_checkpoint(tmp_path, "[523, 87]"))
    video = np.load(FIXTURES / "media" / "video_16x72x100.npy")[:8]
    tools = [{"type": "function", "function": {"name": "click", "parameters": {"type": "object"}}}]
    for kwargs in ({"prompt": "hi"}, {"prompt": "What happens?", "videos": [video], "source_fps": 8.0},
                   {"prompt": "Press OK.", "images": [PICTURE], "chat_template_kwargs": {"tools": tools}}):
        check(run(model, processor, **kwargs), "[523, 87]")


@pytest.mark.parametrize("answers, default, says", [
    ({"assistant": "x"}, None, "chat template"),
    ({"@a": "x", "@ab": "y"}, None, "overlap"),
    ({"@a": "go to @b", "@b": "y"}, None, "occurs in the answer"),
    ({" @a": "x"}, None, "whitespace"),
    ({"@a": "x<|im_end|>"}, None, "<|im_end|>"),
    ({"@a": "0" * 40}, None, "context"),
    ("x", "y", "default="),
    ({"@a": "e\u0301"}, None, "decode back"),
    ({"2.5 sec": "x"}, None, "timestamp"),
])
def test_scripts_it_cannot_carry_out_are_refused(tmp_path, answers, default, says):
    with pytest.raises(ScriptError) as e:
        write_scripted_checkpoint(tmp_path, answers, default=default)
    assert says in str(e.value)


def test_server_answers_the_script(folder):
    Server = importlib.import_module("test_server").Server  # here: test_server skips without openai
    buf = io.BytesIO()
    Image.fromarray(SCREENSHOT).save(buf, format="PNG")
    url = "data:image;base64," + base64.b64encode(buf.getvalue()).decode()
    server = Server(model=folder)
    try:
        client = server.client()
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                 {"type": "text", "text": "Where is it? @next"}]}]
        r = client.chat.completions.create(model="m", messages=messages, max_tokens=120)
        assert (r.choices[0].message.content, r.choices[0].finish_reason) == (THINK, "stop")
        tools = [{"type": "function", "function": {"name": "computer_use", "parameters": {"type": "object"}}}]
        messages[0]["content"][1]["text"] = "Click it. @open"
        r = client.chat.completions.create(model="m", messages=messages, tools=tools, max_tokens=120)
        call = r.choices[0].message.tool_calls[0].function
        assert r.choices[0].finish_reason == "tool_calls" and call.name == "computer_use"
        assert call.arguments == '{"action": "left_click", "coordinate": [500, 300]}'
        # Requests decoded together (continuous batching, rows of different lengths) keep their scripts.
        asks = 2 * ([("@last " * k + "go", CLICK) for k in (1, 9)] + [("x " * 30 + "@next", THINK), ("none", BOX)])
        before = server.metrics()["decode_steps_by_batch_size"]
        with ThreadPoolExecutor(len(asks)) as pool:
            got = list(pool.map(lambda a: client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": a[0]}], max_tokens=120), asks))
        assert [(r.choices[0].message.content, r.choices[0].finish_reason) for r in got] == [
            (want, "stop") for _, want in asks]
        after = server.metrics()["decode_steps_by_batch_size"]
        assert sum(v - before.get(k, 0) for k, v in after.items() if int(k) >= 2) > 0, after
    finally:
        server.stop()
