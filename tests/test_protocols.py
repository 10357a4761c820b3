"""The Responses and Messages endpoints end to end, driven by the real `openai` and `anthropic`
clients: one server on the tiny fixture checkpoint (answers compared with generate() in this
process, greedy), one on a scripted checkpoint whose answers are computer-use actions (the whole
loop of each protocol: tool declared, action returned, its result with a new screenshot, the next
action), bad input in each protocol's error shape, and the attacks that apply (media URLs under
the policy, pixel budgets, the response store's bounds). The example computer-use loop runs against
the scripted server."""

import base64
import http.client
import io
import json
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

import mlx_qwen3vl as M
from mlx_qwen3vl.agent.computer_tools import find_computer_tool
from mlx_qwen3vl.agent.computer_use import ComputerStep, computer_messages, map_answer
from scripted import write_scripted_checkpoint
from conftest import FIXTURES, exif_image, load_fixture_model
from test_server import CHECKPOINT, KEY, MEDIA, ROOT, Server, _blas_threads, data_url, png_bytes

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

CAP = 1_000_000  # --max-request-pixels of the tiny server
STORE = ["--responses-store", "4", "--responses-store-mb", "1"]


def png(array) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def b64_block(data: bytes) -> dict:
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                        "data": base64.b64encode(data).decode()}}


def local_user(text, *images):
    return {"role": "user", "content": [*({"type": "image", "image": i} for i in images), {"type": "text", "text": text}]}


@pytest.fixture(scope="module")
def server():
    s = Server("--api-key", KEY, "--allowed-local-media-path", str(MEDIA), "--max-request-pixels", str(CAP),
               "--max-body-bytes", "2000000", *STORE)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def local():
    """generate() in this process, with one BLAS thread as the server runs (test_server's reason)."""
    before = _blas_threads(1)
    yield load_fixture_model(CHECKPOINT), M.Processor.from_pretrained(FIXTURES / CHECKPOINT)
    _blas_threads(before)


def oai(s):
    return s.client()


def claude(s, key=KEY):
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{s.port}", api_key=key, max_retries=0, timeout=120)


def generate(local, messages, max_tokens, **kw):
    model, processor = local
    return M.generate(model, processor, messages=messages, max_tokens=max_tokens, temperature=0.0, **kw)


# ------------------------------------------------------------------------------------ Responses


def test_responses_equal_generate_streamed_and_continued(server, local):
    shot = png_bytes("img_123x77.png")
    client = oai(server)
    items = [{"role": "user", "content": [{"type": "input_image", "image_url": data_url(shot, subtype=False)},
                                          {"type": "input_text", "text": "Describe the picture."}]}]
    history = [{"role": "system", "content": "Be brief."}, local_user("Describe the picture.", shot)]
    want = generate(local, history, 8)
    r = client.responses.create(model="m", instructions="Be brief.", input=items, max_output_tokens=8, temperature=0)
    assert r.output_text == want.text and r.object == "response" and r.output[0].type == "message"
    assert r.usage.input_tokens == want.prompt_tokens and r.usage.output_tokens == len(want.token_ids)
    assert r.status == ("incomplete" if want.finish_reason == "length" else "completed")

    types, deltas, final = [], [], None
    for ev in client.responses.create(model="m", instructions="Be brief.", input=items, max_output_tokens=8,
                                      temperature=0, stream=True):
        types.append(ev.type)
        if ev.type == "response.output_text.delta":
            deltas.append(ev.delta)
        if ev.type in ("response.completed", "response.incomplete"):
            final = ev.response
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete" if want.finish_reason == "length" else "response.completed"]
    assert "".join(deltas) == want.text == final.output_text
    assert final.usage.input_tokens_details.cached_tokens == want.prompt_tokens - 1  # the same prompt again

    # A follow-up: the stored conversation plus the new input; as OpenAI does, the earlier
    # instructions do not carry over (here they are sent again).
    follow = client.responses.create(model="m", previous_response_id=r.id, input="And its colors?",
                                     instructions="Be brief.", max_output_tokens=6, temperature=0)
    again = generate(local, history + [{"role": "assistant", "content": r.output_text},
                                       local_user("And its colors?")], 6)
    assert follow.output_text == again.text and follow.previous_response_id == r.id
    assert follow.usage.input_tokens_details.cached_tokens >= r.usage.input_tokens  # the history, reused
    bare = client.responses.create(model="m", previous_response_id=r.id, input="And its colors?", max_output_tokens=6,
                                   temperature=0)
    assert bare.output_text == generate(local, history[1:] + [{"role": "assistant", "content": r.output_text},
                                                              local_user("And its colors?")], 6).text
    assert client.responses.retrieve(r.id).output_text == r.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_nothing")


TOOLS = [{"type": "function", "name": "click", "description": "Click a button.",
          "parameters": {"type": "object", "properties": {"target": {"enum": ["ok", "cancel"]}},
                         "required": ["target"], "additionalProperties": False}}]


def test_responses_function_tools_and_json_schema(server):
    client = oai(server)
    r = client.responses.create(model="m", input="Press OK.", tools=TOOLS, tool_choice="required",
                                max_output_tokens=40, temperature=0.8, extra_body={"seed": 3})
    call = next(o for o in r.output if o.type == "function_call")
    assert call.name == "click" and json.loads(call.arguments)["target"] in ("ok", "cancel")
    events = [ev for ev in client.responses.create(model="m", input="Press OK.", tools=TOOLS, max_output_tokens=40,
                                                   tool_choice={"type": "function", "name": "click"}, stream=True)]
    args = "".join(ev.delta for ev in events if ev.type == "response.function_call_arguments.delta")
    assert set(json.loads(args)) == {"target"}
    assert [ev.type for ev in events if ev.type.startswith("response.function_call")] == [
        "response.function_call_arguments.delta", "response.function_call_arguments.done"]

    # The call's output, sent back as a function_call_output after the stored response, renders as the
    # chat template's tool result: the same prompt as the whole conversation sent by the client.
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "Pressed."}
    follow = client.responses.create(model="m", previous_response_id=r.id, input=[output], tools=TOOLS,
                                     max_output_tokens=4, temperature=0)
    sent = client.responses.create(model="m", tools=TOOLS, max_output_tokens=4, temperature=0, input=[
        {"role": "user", "content": "Press OK."},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments}, output])
    assert follow.usage.input_tokens == sent.usage.input_tokens and follow.output_text == sent.output_text

    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
              "additionalProperties": False}
    r = client.responses.create(model="m", input="Which color?", max_output_tokens=30, temperature=1.0, extra_body={"seed": 1},
                                text={"format": {"type": "json_schema", "name": "answer", "schema": schema}})
    assert json.loads(r.output_text)["color"] in ("red", "green", "blue")


def test_the_response_store_is_bounded_in_entries_and_bytes(server):
    """A chain of follow-ups, each adding a ~270 KB screenshot: the store counts each shared turn
    once, keeps at most 1 MiB (--responses-store-mb), and forgets what does not fit; a 5th
    response pushes the 1st out (--responses-store 4). Forgotten ids are a 400, never a crash."""
    client = oai(server)
    rng = np.random.default_rng(7)
    ids = []
    for i in range(5):
        shot = png(rng.integers(0, 256, (260, 260, 3), dtype=np.uint8))  # noise: ~270 KB as a data URL
        r = client.responses.create(model="m", previous_response_id=ids[-1] if ids else None, max_output_tokens=1,
                                    input=[{"role": "user", "content": [
                                        {"type": "input_image", "image_url": data_url(shot)},
                                        {"type": "input_text", "text": f"Screen {i}."}]}])
        ids.append(r.id)
        stats = server.metrics()
        assert stats["responses_store_bytes"] <= 1 << 20 and stats["responses_stored"] <= 4
        if i == 3:  # 4 screenshots of history are past the bytes: not kept, so it cannot be continued
            with pytest.raises(openai.BadRequestError) as e:
                client.responses.create(model="m", previous_response_id=r.id, input="Next.", max_output_tokens=1)
            assert e.value.body["code"] == "previous_response_not_found"
            break
    small = [client.responses.create(model="m", input=f"Hi {i}", max_output_tokens=1).id for i in range(5)]
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="m", previous_response_id=small[0], input="Next.", max_output_tokens=1)
    assert client.responses.create(model="m", previous_response_id=small[-1], input="Next.", max_output_tokens=1)


# ------------------------------------------------------------------------------------ Messages


def test_messages_equal_generate_streamed_and_counted(server, local):
    shot = png_bytes("img_123x77.png")
    client = claude(server)
    messages = [{"role": "user", "content": [b64_block(shot), {"type": "text", "text": "Describe the picture."}]}]
    history = [{"role": "system", "content": "Be brief."}, local_user("Describe the picture.", shot)]
    want = generate(local, history, 8)
    m = client.messages.create(model="m", system="Be brief.", max_tokens=8, messages=messages,
                               extra_body={"temperature": 0})
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == want.text
    assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[want.finish_reason]
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == want.prompt_tokens
    assert m.usage.output_tokens == len(want.token_ids)

    with client.messages.stream(model="m", system=[{"type": "text", "text": "Be brief."}], max_tokens=8,
                                messages=messages, extra_body={"temperature": 0}) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == want.text == final.content[0].text and final.stop_reason == m.stop_reason
    assert final.usage.cache_read_input_tokens == want.prompt_tokens - 1  # the same prompt again
    assert client.messages.count_tokens(model="m", system="Be brief.", messages=messages).input_tokens == \
        want.prompt_tokens

    # The event sequence as sent, ping included (the SDK hides pings).
    body = {"model": "m", "max_tokens": 3, "stream": True, "temperature": 0, "messages": messages}
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/messages", json.dumps(body), {"Content-Type": "application/json", "x-api-key": KEY})
    events = [line[7:] for line in conn.getresponse().read().decode().splitlines() if line.startswith("event: ")]
    conn.close()
    assert events[:3] == ["message_start", "ping", "content_block_start"]
    assert events[3:-3] == ["content_block_delta"] * (len(events) - 6)
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]

    # A URL source under the media policy (file:// under --allowed-local-media-path) is the same image.
    by_url = [{"role": "user", "content": [{"type": "image", "source": {"type": "url",
                                                                        "url": (MEDIA / "img_123x77.png").as_uri()}},
                                           {"type": "text", "text": "Describe the picture."}]}]
    assert client.messages.create(model="m", system="Be brief.", max_tokens=8, messages=by_url,
                                  extra_body={"temperature": 0}).content[0].text == want.text


def test_messages_stop_sequences_and_keys(server, local):
    client = claude(server)
    full = generate(local, [local_user("Say something.")], 16).text
    stop = full[5:9]
    m = client.messages.create(model="m", max_tokens=16, messages=[{"role": "user", "content": "Say something."}],
                               stop_sequences=["never here", stop], extra_body={"temperature": 0})
    assert m.content[0].text == full[:full.find(stop)]
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)
    with pytest.raises(anthropic.AuthenticationError) as e:
        claude(server, key="wrong").messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": "x"}])
    assert e.value.body == {"type": "error", "error": {"type": "authentication_error", "message": e.value.body[
        "error"]["message"]}}


CLAUDE_TOOLS = [{"name": "click", "description": "Click a button.",
                 "input_schema": {"type": "object", "properties": {"target": {"enum": ["ok", "cancel"]}},
                                  "required": ["target"], "additionalProperties": False}}]


def test_messages_tools_and_a_screenshot_in_a_tool_result(server, local):
    client = claude(server)
    ask = [{"role": "user", "content": "Press OK."}]
    m = client.messages.create(model="m", max_tokens=40, messages=ask, tools=CLAUDE_TOOLS,
                               tool_choice={"type": "any"}, extra_body={"temperature": 0.8, "seed": 3})
    use = next(b for b in m.content if b.type == "tool_use")
    assert m.stop_reason == "tool_use" and use.name == "click" and use.input["target"] in ("ok", "cancel")
    with client.messages.stream(model="m", max_tokens=40, messages=ask, tools=CLAUDE_TOOLS,
                                tool_choice={"type": "tool", "name": "click"}) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and set(final.content[-1].input) == {"target"}

    # The tool's result carries the next screenshot: rendered where the chat template puts tool results.
    shot = png_bytes("img_300x200.png")
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": [
        {"type": "text", "text": "Pressed. The screen now:"}, b64_block(shot)]}]}
    turns = ask + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]}, result]
    got = client.messages.create(model="m", max_tokens=6, messages=turns, tools=CLAUDE_TOOLS,
                                 extra_body={"temperature": 0})
    model, processor = local
    call = {"id": use.id, "type": "function", "function": {"name": "click", "arguments": json.dumps(use.input)}}
    conversation = [{"role": "user", "content": "Press OK."}, {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "content": [{"type": "text", "text": "Pressed. The screen now:"},
                                                 {"type": "image", "image": shot}]}]
    tools = [{"type": "function", "function": {"name": "click", "description": "Click a button.",
                                               "parameters": CLAUDE_TOOLS[0]["input_schema"]}}]
    text = processor.apply_chat_template(conversation, tools=tools)
    want = M.generate(model, processor, text, templated=True, images=[shot], max_tokens=6, temperature=0.0)
    assert got.content[0].text == want.text
    assert got.usage.input_tokens + got.usage.cache_read_input_tokens == want.prompt_tokens


# ------------------------------------------------------------------------------------ bad input

GOOD_R = {"model": "m", "input": "hi", "max_output_tokens": 2}
GOOD_M = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
GOOD_C = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
HUGE = np.zeros((1000, 1001, 3), np.uint8)  # 1,001,000 pixels: over the server's cap, a small file
SMALL = np.zeros((48, 64, 3), np.uint8)


def _m(*blocks, **kw):
    return {**GOOD_M, "messages": [{"role": "user", "content": list(blocks)}], **kw}


def _r(*parts, **kw):
    return {**GOOD_R, "input": [{"role": "user", "content": list(parts)}], **kw}


def _url(url):
    return {"type": "image", "source": {"type": "url", "url": url}}


BAD = [  # (name, path, body, status, what the message names)
    ("unknown field", "/v1/responses", {**GOOD_R, "frobnicate": 1}, 400, "frobnicate"),
    ("background", "/v1/responses", {**GOOD_R, "background": True}, 400, "background"),
    ("no input", "/v1/responses", {"model": "m"}, 400, "input"),
    ("empty input", "/v1/responses", {**GOOD_R, "input": []}, 400, "input"),
    ("only reasoning", "/v1/responses", {**GOOD_R, "input": [{"type": "reasoning", "summary": [
        {"type": "summary_text", "text": "x"}]}]}, 400, "input"),
    ("past the context", "/v1/responses", {**GOOD_R, "input": "word " * 5000}, 400, "context"),
    ("unknown item", "/v1/responses", {**GOOD_R, "input": [{"type": "web_search_call", "id": "x"}]}, 400, "input[0]"),
    ("input_file", "/v1/responses", _r({"type": "input_file", "file_id": "f"}), 400, "input[0].content[0]"),
    ("image in system", "/v1/responses", {**GOOD_R, "input": [{"role": "system", "content": [
        {"type": "input_image", "image_url": "data:image;base64,aGVsbG8="}]}]}, 400, "input[0].content[0]"),
    ("file:// outside", "/v1/responses", _r({"type": "input_image", "image_url": "file:///etc/passwd"}), 400,
     "input[0].content[0].image_url"),
    ("private address", "/v1/responses", _r({"type": "input_image", "image_url": "http://10.0.0.1/a.png"}), 403,
     "input[0].content[0].image_url"),
    ("over budget", "/v1/responses", _r({"type": "input_image", "image_url": data_url(png(HUGE))}), 400,
     "--max-request-pixels"),
    ("huge previous id", "/v1/responses", {**GOOD_R, "previous_response_id": "resp_" + "a" * 500_000}, 400,
     "not found"),
    ("unknown previous id", "/v1/responses", {**GOOD_R, "previous_response_id": "resp_x"}, 400, "not found"),
    ("hosted tool", "/v1/responses", {**GOOD_R, "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
    ("computer and function", "/v1/responses", {**GOOD_R, "tools": [TOOLS[0], {"type": "computer"}]}, 400,
     "no other tools"),
    ("bad display", "/v1/responses", {**GOOD_R, "tools": [{"type": "computer_use_preview", "display_width": 0,
                                                           "display_height": 10, "environment": "mac"}]}, 400,
     "display_width"),
    ("temperature", "/v1/responses", {**GOOD_R, "temperature": 3}, 400, "temperature"),
    ("computer call, no tool", "/v1/responses", {**GOOD_R, "input": [
        {"role": "user", "content": "x"},
        {"type": "computer_call", "call_id": "c", "action": {"type": "click", "button": "left", "x": 1, "y": 1}}]},
     400, "input[1].action"),
    ("no screenshot", "/v1/responses", {**GOOD_R, "tools": [{"type": "computer"}]}, 400, "screenshot"),
    ("function call, computer tool", "/v1/responses", {**GOOD_R, "tools": [{"type": "computer"}], "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "x"},
                                     {"type": "input_image", "image_url": data_url(png(SMALL))}]},
        {"type": "function_call", "call_id": "c", "name": "lookup", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": "ok"}]}, 400, "only the computer"),
    ("other tool_use, computer tool", "/v1/messages", {**GOOD_M, "tools": [
        {"type": "computer_20250124", "name": "computer", "display_width_px": 10, "display_height_px": 10}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, b64_block(png(SMALL))]},
                     {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "lookup", "input": {}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "ok"}]}]},
     400, "only the computer"),
    ("template switch", "/v1/responses", {**GOOD_R, "chat_template_kwargs": {"tokenize": True}}, 400, "tokenize"),
    ("deep json", "/v1/responses", {**GOOD_R, "metadata": json.loads("[" * 80 + "]" * 80)}, 400, "nested"),
    ("no max_tokens", "/v1/messages", {"model": "m", "messages": GOOD_M["messages"]}, 400, "max_tokens"),
    ("unknown field", "/v1/messages", {**GOOD_M, "frobnicate": 1}, 400, "frobnicate"),
    ("bad role", "/v1/messages", {**GOOD_M, "messages": [{"role": "system", "content": "x"}]}, 400, "role"),
    ("prefill", "/v1/messages", {**GOOD_M, "messages": GOOD_M["messages"] + [
        {"role": "assistant", "content": "Sure"}]}, 400, "prefill"),
    ("document block", "/v1/messages", _m({"type": "document", "source": {}}), 400, "messages[0].content[0].type"),
    ("file:// outside", "/v1/messages", _m(_url("file:///etc/passwd")), 400, "messages[0].content[0].source.url"),
    ("file:// via dots", "/v1/messages", _m(_url((MEDIA / ".." / ".." / "scripted.py").as_uri())), 400,
     "allowed-local-media-path"),
    ("loopback", "/v1/messages", _m(_url("http://127.0.0.1:9/x.png")), 403, "loopback"),
    ("loopback spelled", "/v1/messages", _m(_url("http://2130706433/x.png")), 403, "loopback"),
    ("mapped v6", "/v1/messages", _m(_url("http://[::ffff:127.0.0.1]/x.png")), 403, "loopback"),
    ("file source", "/v1/messages", _m({"type": "image", "source": {"type": "file", "file_id": "f"}}), 400, "files"),
    ("over budget", "/v1/messages", _m(b64_block(png(HUGE))), 400, "--max-request-pixels"),
    ("not an image", "/v1/messages", _m({"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                     "data": base64.b64encode(b"%!PS-Adobe").decode()}}),
     400, "image 1"),
    ("server tool", "/v1/messages", {**GOOD_M, "tools": [{"type": "web_search_20250305", "name": "w"}]}, 400,
     "tools[0].type"),
    ("two computers", "/v1/messages", {**GOOD_M, "tools": [
        {"type": "computer_20250124", "name": "computer", "display_width_px": 10, "display_height_px": 10},
        {"type": "computer_toolset_20260801"}]}, 400, "both declare"),
    ("stop sequences", "/v1/messages", {**GOOD_M, "stop_sequences": ["x"] * 17}, 400, "stop_sequences"),
    ("temperature", "/v1/messages", {**GOOD_M, "temperature": 1.5}, 400, "temperature"),
    ("count with stream", "/v1/messages/count_tokens", {"model": "m", "messages": GOOD_M["messages"], "stream": True},
     400, "stream"),
    ("logit_bias", "/v1/messages", {**GOOD_M, "logit_bias": {"5": 1}}, 400, "logit_bias"),
    ("logit_bias", "/v1/responses", {**GOOD_R, "logit_bias": {"5": 1}}, 400, "logit_bias"),
    ("vLLM stop ids", "/v1/responses", {**GOOD_R, "stop_token_ids": [5]}, 400, "stop_token_ids"),
    ("one call only", "/v1/responses", {**GOOD_R, "parallel_tool_calls": False}, 400, "parallel_tool_calls"),
    ("truncation", "/v1/responses", {**GOOD_R, "truncation": "auto"}, 400, "truncation"),
    ("effort", "/v1/responses", {**GOOD_R, "reasoning": {"effort": "low"}}, 400, "reasoning.effort"),
    ("verbosity", "/v1/responses", {**GOOD_R, "text": {"verbosity": "low"}}, 400, "text.verbosity"),
    ("one call only", "/v1/messages", {**GOOD_M, "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}},
     400, "disable_parallel_tool_use"),
    ("effort", "/v1/messages", {**GOOD_M, "output_config": {"effort": "low"}}, 400, "effort"),
    ("bad json", "/v1/messages", b'{"model": ', 400, "JSON"),
    ("not an object", "/v1/messages", b"[1, 2]", 400, "object"),
    ("computer tool_choice", "/v1/messages", {**GOOD_M, "tool_choice": {"type": "any"}, "tools": [
        {"type": "computer_toolset_20260801"}]}, 400, "tool_choice"),
    ("body too big", "/v1/messages", _m({"type": "text", "text": "x" * 2_100_000}), 413, "--max-body-bytes"),
    # fields a client may send that this server could not honour: a 400 naming each, never ignored
    ("include", "/v1/responses", {**GOOD_R, "include": ["message.output_text.logprobs"]}, 400, "include[0]"),
    ("summary", "/v1/responses", {**GOOD_R, "reasoning": {"summary": "auto"}}, 400, "reasoning.summary"),
    ("obfuscation", "/v1/responses", {**GOOD_R, "stream_options": {"include_obfuscation": True}}, 400,
     "stream_options.include_obfuscation"),
    ("cache retention", "/v1/responses", {**GOOD_R, "prompt_cache_retention": "24h"}, 400, "prompt_cache_retention"),
    ("image detail", "/v1/responses", _r({"type": "input_image", "image_url": "data:,", "detail": "max"}), 400,
     "input[0].content[0].detail"),
    ("pending checks", "/v1/responses", {**GOOD_R, "tools": [{"type": "computer"}], "input": [
        {"role": "user", "content": "x"}, {"type": "computer_call", "call_id": "c", "pending_safety_checks": [
            {"id": "s", "code": "malicious_instructions", "message": "?"}], "action": {"type": "screenshot"}}]}, 400,
     "input[1].pending_safety_checks"),
    ("acknowledged checks", "/v1/responses", {**GOOD_R, "input": [{"type": "computer_call_output", "call_id": "c",
                                                                   "acknowledged_safety_checks": [{"id": "s"}],
                                                                   "output": {"type": "computer_screenshot",
                                                                              "image_url": "data:,"}}]}, 400,
     "input[0].acknowledged_safety_checks"),
    ("thinking on Instruct", "/v1/messages", {**GOOD_M, "max_tokens": 2000,
                                              "thinking": {"type": "enabled", "budget_tokens": 1024}}, 400,
     "cannot be enabled"),
    ("thinking budget", "/v1/messages", {**GOOD_M, "thinking": {"type": "enabled", "budget_tokens": 1024}}, 400,
     "less than 'max_tokens'"),
    ("thinking omitted", "/v1/messages", {**GOOD_M, "thinking": {"type": "adaptive", "display": "omitted"}}, 400,
     "thinking.display"),
    ("citations", "/v1/messages", _m({"type": "text", "text": "x", "citations": [{"type": "char_location"}]}), 400,
     "messages[0].content[0].citations"),
    ("caller", "/v1/messages", {**GOOD_M, "messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {},
                                           "caller": {"type": "code_execution_20250825", "tool_id": "s"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "ok"}]}]}, 400,
     "messages[1].content[0].caller"),
    ("input examples", "/v1/messages", {**GOOD_M, "tools": [{"name": "f", "input_schema": {"type": "object"},
                                                             "input_examples": [{}]}]}, 400, "tools[0].input_examples"),
    ("defer loading", "/v1/messages", {**GOOD_M, "tools": [{"name": "f", "input_schema": {"type": "object"},
                                                            "defer_loading": True}]}, 400, "tools[0].defer_loading"),
    ("display number", "/v1/messages", {**GOOD_M, "tools": [
        {"type": "computer_20250124", "name": "computer", "display_width_px": 10, "display_height_px": 10,
         "display_number": 1}]}, 400, "tools[0].display_number"),
    ("body too big", "/v1/responses", {**GOOD_R, "input": "x" * 2_100_000}, 413, "--max-body-bytes"),
    # strict types and every field known, named by its path however deep
    ("a number as text", "/v1/responses", {**GOOD_R, "max_output_tokens": "2"}, 400, "max_output_tokens"),
    ("nested unknown field", "/v1/responses", _r({"type": "input_text", "text": "x", "colour": 1}), 400,
     "input[0].content[0].colour"),
    ("nested unknown field", "/v1/messages", _m({"type": "text", "text": "x", "colour": 1}), 400,
     "messages[0].content[0].colour"),
    # what would be ignored, were it not refused: a schema left out, usage asked of no stream, a tool unnamed
    ("json_schema without one", "/v1/chat/completions", {**GOOD_C, "response_format": {"type": "json_schema"}}, 400,
     "response_format.json_schema"),
    ("stream_options, no stream", "/v1/chat/completions", {**GOOD_C, "stream_options": {"include_usage": True}},
     400, "stream_options"),
    ("tool without its name", "/v1/messages", {**GOOD_M, "tools": [{"name": "f", "input_schema": {"type": "object"}}],
                                              "tool_choice": {"type": "tool"}}, 400, "tool_choice.name"),
    ("input not an object", "/v1/messages", {**GOOD_M, "messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t", "name": "f", "input": "{}"}]}, {"role": "user", "content": "y"}]}, 400,
     "messages[1].content[0].input"),
]


@pytest.mark.parametrize("case", BAD, ids=[f"{c[1].split('/')[2]}: {c[0]}" for c in BAD])
def test_bad_input_gets_the_protocols_error(server, case):
    name, path, body, status, named = case
    got, err = server.request("POST", path, body)
    assert got == status, err
    if path.startswith("/v1/messages"):
        assert set(err) == {"type", "error"} and err["type"] == "error" and set(err["error"]) == {"type", "message"}
        assert err["error"]["type"] == {400: "invalid_request_error", 403: "permission_error",
                                        413: "request_too_large"}[status]
        message = err["error"]["message"]
    else:
        assert set(err["error"]) == {"message", "type", "param", "code"}
        message = f'{err["error"]["param"]} {err["error"]["message"]}'
        if path == "/v1/responses":  # a field of the Responses API (its conversation is `input`)
            assert not (err["error"]["param"] or "").startswith("messages"), err
    assert named in message and "Traceback" not in message and len(message) < 2000
    ok = GOOD_M if path.startswith("/v1/messages") else GOOD_C if path == "/v1/chat/completions" else GOOD_R
    assert server.request("POST", path.replace("/count_tokens", ""), ok)[0] == 200


def test_errors_outside_the_handlers_take_each_shape(server):
    status, err = server.request("POST", "/v1/messages", GOOD_M, key=None)
    assert status == 401 and err["error"]["type"] == "authentication_error" and err["type"] == "error"
    status, err = server.request("POST", "/v1/messages", GOOD_M, key=None, headers={"x-api-key": KEY})
    assert status == 200
    status, err = server.request("POST", "/v1/responses", GOOD_R, key=None, headers={"x-api-key": "nope"})
    assert status == 401 and err["error"]["code"] == "invalid_api_key"
    status, err = server.request("GET", "/v1/messages", key=KEY)
    assert status == 405 and err["type"] == "error"
    with pytest.raises(anthropic.PermissionDeniedError):
        claude(server).messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": [
            _url("http://[::ffff:127.0.0.1]/x.png")]}])
    with pytest.raises(anthropic.BadRequestError):
        claude(server).messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": [
            b64_block(png(HUGE))]}])


# ------------------------------------------------------------------------------------ computer use

CALL = lambda **args: ('<tool_call>\n' + json.dumps({"name": "computer_use", "arguments": args})  # noqa: E731
                       + '\n</tool_call>')
SCRIPT = {
    "@start": "<think>The settings icon is at the top.</think>\n" + CALL(action="left_click", coordinate=[500, 300]),
    "Step 1 done": CALL(action="type", text="display"),
    "Step 2 done": CALL(action="terminate", status="success"),
    "@drag": CALL(action="left_click_drag", coordinate=[900, 100]),
    "@phone": "LongPress(box=(500, 500))",
    "@check": 'Let me check.\n<tool_call>\n{"name": "lookup", "arguments": {"q": "weather"}}\n</tool_call>',
    "@exif": CALL(action="left_click", coordinate=[437, 812]),
    "@two": ('<tool_call>\n{"name": "lookup", "arguments": {"q": "rain"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "find", "arguments": {"q": "snow"}}\n</tool_call>'),
}
# A 10-step loop: each step's answer points where the pixels written back to 0-1000 differ from it
# on the 1366x768 display (y = 13 is pixel 9, written back as 12; 216 is 165, written back as 215).
LOOP = [("left_click" if i % 3 else "double_click", [100 + 70 * i, y])
        for i, y in enumerate([13, 113, 216, 315, 414, 513, 613, 716, 815, 914])]
SCRIPT.update({("@loop" if i == 0 else f"@r{i}"): "<think>Go.</think>\n" + CALL(action=a, coordinate=xy)
               for i, (a, xy) in enumerate(LOOP)})
DISPLAY = (1366, 768)
rng = np.random.default_rng(0)
SHOTS = [png(rng.integers(0, 256, (120, 200, 3), dtype=np.uint8)) for _ in range(3)]  # same size, other content
LOOP_SHOTS = [png(rng.integers(0, 256, (32, 64, 3), dtype=np.uint8)) for _ in range(len(LOOP))]


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    folder = write_scripted_checkpoint(tmp_path_factory.mktemp("protocols") / "scripted", SCRIPT)
    # --agent-history 10: the 10-step loop's prompts each extend the one before (the default window slides)
    s = Server("--api-key", KEY, "--agent-history", "10", model=folder)
    yield s, M.load(folder)
    s.stop()


def _expected(lib, task, shots, steps, tool, display):
    """The library's answer for the same conversation: computer_messages → generate → map_answer."""
    out = M.generate(*lib, messages=computer_messages(task, shots[-1], steps, display=display), max_tokens=256,
                     temperature=0.0)
    return map_answer(out.text, display, tool=tool)


def test_anthropic_computer_use_loop_end_to_end(scripted):
    s, lib = scripted
    client = claude(s)
    declared = {"type": "computer_20251124", "name": "computer", "display_width_px": DISPLAY[0],
                "display_height_px": DISPLAY[1]}
    tool = find_computer_tool([declared])
    task = "Open the settings @start"
    messages = [{"role": "user", "content": [{"type": "text", "text": task}, b64_block(SHOTS[0])]}]
    steps, replies = [], []
    for i in range(3):
        reply = client.messages.create(model="m", max_tokens=256, tools=[declared], messages=messages)
        want = _expected(lib, task, SHOTS[:i + 1], steps, tool, DISPLAY)
        blocks = [b for b in reply.content if b.type == "tool_use"]
        assert [{"name": b.name, "input": b.input} for b in blocks] == want.calls, i
        if want.reasoning:
            assert reply.content[0].type == "thinking" and reply.content[0].thinking == want.reasoning
        replies.append(reply)
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
        if reply.stop_reason != "tool_use":
            break
        steps.append(ComputerStep(SHOTS[i], actions=[tool.parse_call(c) for c in want.calls],
                                  reasoning=want.reasoning, display=DISPLAY, result=f"Step {i + 1} done."))
        messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": blocks[0].id, "content": [
            b64_block(SHOTS[i + 1]), {"type": "text", "text": f"Step {i + 1} done."}]}]})
    assert [r.stop_reason for r in replies] == ["tool_use", "tool_use", "end_turn"]
    assert replies[0].content[-1].input == {"action": "left_click", "coordinate": [683, 230]}  # 500/1000 of 1366
    assert replies[1].content[-1].input == {"action": "type", "text": "display"}
    assert replies[1].usage.cache_read_input_tokens >= replies[0].usage.input_tokens  # system + first screenshot
    # Streamed, the same blocks arrive whole.
    with client.messages.stream(model="m", max_tokens=256, tools=[declared], messages=messages[:1]) as stream:
        final = stream.get_final_message()
    assert [b.model_dump(exclude={"id"}) for b in final.content] == \
        [b.model_dump(exclude={"id"}) for b in replies[0].content]
    # An answer with no computer-use equivalent (a phone gesture) comes back as text, never as an action.
    m = client.messages.create(model="m", max_tokens=64, tools=[declared], messages=[
        {"role": "user", "content": [{"type": "text", "text": "Hold it @phone"}, b64_block(SHOTS[0])]}])
    assert m.stop_reason == "end_turn" and [(b.type, b.text) for b in m.content] == [
        ("text", "LongPress(box=(500, 500))")]


def _anthropic_loop(client, declared, fresh_ids):
    """Ten steps of LOOP through the real client; `fresh_ids`: each tool_use is replayed under an id
    this server never issued (as a client that rewrites ids would), so history is rendered from the
    replayed pixels. → (the usage of each turn, the actions)."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "Walk the grid @loop"}, b64_block(LOOP_SHOTS[0])]}]
    usage, actions = [], []
    for i in range(len(LOOP)):
        reply = client.messages.create(model="m", max_tokens=256, tools=[declared], messages=messages,
                                       extra_body={"min_pixels": 1024, "max_pixels": 2048})  # 2 tokens an image
        assert reply.stop_reason == "tool_use", i
        usage.append(reply.usage)
        blocks = [b.model_dump(exclude_none=True) for b in reply.content]
        actions.append(blocks[-1]["input"])
        if fresh_ids:
            blocks[-1]["id"] = f"toolu_client{i:02d}"
        messages.append({"role": "assistant", "content": blocks})
        if i + 1 < len(LOOP):
            messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": blocks[-1]["id"],
                                                          "content": [b64_block(LOOP_SHOTS[i + 1]),
                                                                      {"type": "text", "text": f"@r{i + 1}"}]}]})
    return usage, actions


def test_a_ten_step_anthropic_loop_reads_its_history_from_the_prefix_cache(scripted):
    """Every replayed tool_use the server issued is rendered from the model's own answer, so each
    turn's prompt extends the previous prompt and answer: cache_read_input_tokens covers all of
    them, turn after turn. The same loop replayed under ids the server never issued is written back
    from the pixels (y 13 → pixel 9 → 12 on 768 rows): each prompt leaves the cache inside the
    previous step's action, which the model is shown as an action it did not write."""
    s, _ = scripted
    client = claude(s)
    declared = {"type": "computer_20251124", "name": "computer", "display_width_px": DISPLAY[0],
                "display_height_px": DISPLAY[1]}
    before, actions = _anthropic_loop(client, declared, fresh_ids=True)
    after, same = _anthropic_loop(client, declared, fresh_ids=False)
    assert same == actions and [a["action"] for a in actions] == [a for a, _ in LOOP]
    total = lambda u: u.input_tokens + u.cache_read_input_tokens  # noqa: E731
    cached = [u.cache_read_input_tokens for u in after]
    print("cache_read_input_tokens per turn: replayed from pixels", [u.cache_read_input_tokens for u in before],
          "of", [total(u) for u in before], "; from the kept answers", cached, "of", [total(u) for u in after])
    for t in range(1, len(LOOP)):  # the whole previous prompt and its answer came from the cache
        assert cached[t] >= total(after[t - 1]) + after[t - 1].output_tokens - 1 > cached[t - 1], t
    for t in range(1, len(LOOP)):  # from pixels: the previous answer is not the one generated
        assert before[t].cache_read_input_tokens < total(before[t - 1]) + before[t - 1].output_tokens - 1, t
    assert s.metrics()["computer_answers_replayed"] >= sum(range(len(LOOP)))


class _Builder:
    """What computer.prepare needs of the prompt builder; render keeps the messages it is given."""

    def __init__(self):
        from mlx_qwen3vl.server.fetch import MediaPolicy
        from mlx_qwen3vl.server.limits import Limits
        self.policy, self.limits, self.rendered = MediaPolicy(), Limits(), []

    def render(self, req, messages, images, videos):
        self.rendered.append(messages)
        return "prepared"


@pytest.mark.parametrize("display, rounded", [((1366, 768), 233), ((800, 600), 401), ((360, 640), 961)])
def test_replayed_calls_the_server_issued_are_the_model_s_own_words(display, rounded):
    """Each [v, v] (v = 0..1000) clicked on the display: the call the server issued, replayed under
    its id, is rendered as the answer it came from (0 differ); replayed under another id (or with
    another action) it is written back from the pixels, and `rounded` of the 1001 differ."""
    from mlx_qwen3vl.server import computer
    from mlx_qwen3vl.server.computer_answers import ComputerAnswers
    from mlx_qwen3vl.server.conversation import Call, Part, Turn
    from mlx_qwen3vl.server.protocol import ChatRequest, sampling_params

    tool = find_computer_tool([{"type": "computer_20251124", "name": "computer", "display_width_px": display[0],
                                "display_height_px": display[1]}])
    answers, builder = ComputerAnswers(), _Builder()
    req = ChatRequest(turns=[], sampling=sampling_params({}))
    tiny = data_url(png(np.zeros((4, 4, 3), np.uint8)))  # its size does not matter: the display is declared
    first = [Turn("user", [Part("text", "Click it"), Part("image", tiny, "a")])]
    _, request = computer.prepare(builder, req, first, tool, "qwen", answers)
    differ = {"issued": 0, "other id": 0, "other action": 0}
    for v in range(1001):
        answer = CALL(action="left_click", coordinate=[v, v])
        call = request.turn(answer).calls[0]
        request.issued(answer, [Call(f"toolu_{v}", call["name"], action=call)])
        moved = {**call, "input": {**call["input"], "coordinate": [call["input"]["coordinate"][0] + 1, 0]}}
        cases = {"issued": (f"toolu_{v}", call), "other id": (f"toolu_x{v}", call)}
        if v % 50 == 0:  # 21 values: the same id with another action is never the kept answer
            cases["other action"] = (f"toolu_{v}", moved)
        for case, (cid, action) in cases.items():
            turns = first + [Turn("assistant", [], [Call(cid, "computer", action=action, param="b")]),
                             Turn("tool", [Part("image", tiny, "c")], call_id=cid)]
            computer.prepare(builder, req, turns, tool, "qwen", answers)
            differ[case] += builder.rendered[-1][2]["content"] != answer
    assert differ == {"issued": 0, "other id": rounded, "other action": 21}
    assert answers.hits == 1001 and len(answers) == 1001


def test_the_kept_answers_are_bounded():
    from mlx_qwen3vl.server.computer_answers import ComputerAnswers

    kept = ComputerAnswers(max_entries=3, max_bytes=2000)
    for i in range(5):
        assert kept.put([f"t{i}"], "k", "x" * 100)
    assert len(kept) == 3 and kept.get(["t0"], "k") is None and kept.get(["t4"], "k") == "x" * 100
    assert kept.get(["t4"], "other") is None and kept.get(["t4", "t5"], "k") is None  # same ids, same actions only
    assert kept.put(["t2"], "k", "y" * 100) and kept.put(["t9"], "k", "z" * 1200)  # t2 used last: t3, t4 go
    assert [kept.get([t], "k") is not None for t in ("t2", "t3", "t4", "t9")] == [True, False, False, True]
    assert not kept.put(["big"], "k", "w" * 2000) and kept.bytes <= 2000  # alone over the bytes: not kept
    assert not ComputerAnswers(max_entries=0).put(["t"], "k", "x")  # --computer-answers 0: off


def test_a_replayed_key_without_keys_is_a_400_in_anthropic_s_shape(scripted):
    s, _ = scripted
    body = {"model": "m", "max_tokens": 8, "tools": [{"type": "computer_20250124", "name": "computer",
                                                      "display_width_px": 800, "display_height_px": 600}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Press it"}, b64_block(SHOTS[0])]},
                         {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "computer",
                                                            "input": {"action": "key", "text": ""}}]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                       "content": [b64_block(SHOTS[1])]}]}]}
    status, err = s.request("POST", "/v1/messages", body)
    assert status == 400 and err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert err["error"]["message"] == ("messages[1].content[0].input.text must name the keys to press, such as "
                                       "'ctrl+c'"), err
    assert s.request("GET", "/health")[0] == 200 and "Traceback" not in "".join(s.log)


def test_responses_computer_use_loop_end_to_end(scripted):
    """The batched `computer` tool declares no display: actions are in the screenshot's pixels.
    Each step continues the stored response with the computer_call_output's new screenshot."""
    s, lib = scripted
    client = oai(s)
    tool = find_computer_tool([{"type": "computer"}])
    task = "Open the settings @start"
    size = Image.open(io.BytesIO(SHOTS[0])).size
    r = client.responses.create(model="m", tools=[{"type": "computer"}], input=[{"role": "user", "content": [
        {"type": "input_text", "text": task}, {"type": "input_image", "image_url": data_url(SHOTS[0])}]}])
    want = _expected(lib, task, SHOTS[:1], [], tool, size)
    assert [o.type for o in r.output] == ["reasoning", "computer_call"]
    assert r.output[0].content[0].text == want.reasoning
    assert [a.model_dump(exclude_none=True) for a in r.output[1].actions] == want.calls == [
        {"type": "click", "button": "left", "x": 100, "y": 36}]
    steps = [ComputerStep(SHOTS[0], actions=[tool.parse_call(c) for c in want.calls], display=size,
                          answer=SCRIPT["@start"], result="Step 1 done.")]
    r2 = client.responses.create(model="m", tools=[{"type": "computer"}], previous_response_id=r.id, input=[
        {"type": "computer_call_output", "call_id": r.output[1].call_id,
         "output": {"type": "computer_screenshot", "image_url": data_url(SHOTS[1], subtype=False)}},
        {"role": "user", "content": "Step 1 done."}])
    want = _expected(lib, task, SHOTS[:2], steps, tool, size)
    assert [a.model_dump(exclude_none=True) for a in r2.output[-1].actions] == want.calls == [
        {"type": "type", "text": "display"}]
    # the stored answer is replayed as generated: the prompt's whole history comes from the cache
    assert r2.usage.input_tokens_details.cached_tokens >= r.usage.input_tokens + r.usage.output_tokens - 1
    # continued without the tool, its computer calls would render as calls of an undeclared function
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="m", previous_response_id=r.id, input="And now?", max_output_tokens=2)
    assert refused.value.body["param"] == "previous_response_id" and "computer" in refused.value.body["message"]
    # the same conversation sent whole (no previous_response_id): the computer_call this server issued is
    # rendered from its answer too, and the prompt is the same one
    first = [{"role": "user", "content": [{"type": "input_text", "text": task},
                                          {"type": "input_image", "image_url": data_url(SHOTS[0])}]}]
    r3 = client.responses.create(model="m", tools=[{"type": "computer"}], store=False, input=[
        *first, *(o.model_dump(exclude_none=True) for o in r.output),
        {"type": "computer_call_output", "call_id": r.output[1].call_id,
         "output": {"type": "computer_screenshot", "image_url": data_url(SHOTS[1], subtype=False)}},
        {"role": "user", "content": "Step 1 done."}])
    assert [a.model_dump(exclude_none=True) for a in r3.output[-1].actions] == want.calls
    assert r3.usage.input_tokens == r2.usage.input_tokens
    assert r3.usage.input_tokens_details.cached_tokens == r2.usage.input_tokens - 1

    # computer_use_preview declares a display: one computer_call per action, in its pixels; streamed.
    preview = {"type": "computer_use_preview", "display_width": DISPLAY[0], "display_height": DISPLAY[1],
               "environment": "browser"}
    with client.responses.stream(model="m", tools=[preview], input=[{"role": "user", "content": [
            {"type": "input_text", "text": "Drag it @drag"}, {"type": "input_image", "image_url": data_url(SHOTS[0])}]}],
            ) as stream:
        types = [ev.type for ev in stream]
        final = stream.get_final_response()
    assert types[0] == "response.created" and types[-1] == "response.completed"
    # a Qwen drag from an unknown start is mouse-down, move, up: OpenAI's tools have no mouse-down, so it is text
    assert [o.type for o in final.output] == ["message"] and final.output[0].content[0].text == SCRIPT["@drag"]


def _jpeg_block(data: bytes) -> dict:
    return {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg",
                                        "data": base64.b64encode(data).decode()}}


@pytest.mark.parametrize("orientation, upright", [(6, (360, 640)), (8, (360, 640)), (3, (640, 360)),
                                                  (5, (360, 640)), (7, (360, 640))])
def test_rotated_screenshots_map_in_the_pixels_the_model_saw(scripted, orientation, upright):
    """A JPEG stored 640x360 with an EXIF orientation: the model sees it upright, so a tool without
    a display size (Anthropic's toolset, OpenAI's computer) maps its [437, 812] in the upright size:
    floor(437 * 360 / 1000), floor(812 * 640 / 1000) = [157, 519] when turned a quarter (the stored
    size gives [279, 292]), [279, 292] when turned half."""
    s, _ = scripted
    want = {(360, 640): [157, 519], (640, 360): [279, 292]}[upright]
    shot = exif_image(640, 360, orientation)
    m = claude(s).messages.create(model="m", max_tokens=256, tools=[{"type": "computer_toolset_20260801"}],
                                  messages=[{"role": "user", "content": [{"type": "text", "text": "Tap it @exif"},
                                                                         _jpeg_block(shot)]}])
    assert [(b.name, b.input) for b in m.content if b.type == "tool_use"] == [("left_click", {"coordinate": want})]
    r = oai(s).responses.create(model="m", tools=[{"type": "computer"}], input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Tap it @exif"}, {"type": "input_image", "image_url": data_url(shot)}]}])
    assert [a.model_dump(exclude_none=True) for a in r.output[-1].actions] == [
        {"type": "click", "button": "left", "x": want[0], "y": want[1]}]


@pytest.mark.parametrize("display, want", [((800, 600), [349, 487]), ((360, 640), [157, 519]),
                                           ((683, 384), [298, 311])])
def test_declared_displays_small_and_retina(scripted, display, want):
    """A declared display is what [437, 812] maps to, whatever the screenshot's own pixels: displays
    under 1000 px, and a Retina one declared at half the screenshot's pixels (683x384 points for a
    1366x768 screenshot, here stored 768x1366 and turned upright by its EXIF tag)."""
    s, _ = scripted
    tool = {"type": "computer_20251124", "name": "computer", "display_width_px": display[0],
            "display_height_px": display[1]}
    m = claude(s).messages.create(model="m", max_tokens=256, tools=[tool], extra_body={"max_pixels": 65536}, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Tap it @exif"}, _jpeg_block(exif_image(768, 1366, 6))]}])
    assert m.content[-1].input == {"action": "left_click", "coordinate": want}


def test_the_example_loop_runs_against_the_server(scripted):
    s, _ = scripted
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "computer_use_anthropic.py"), "--base-url",
                          f"http://127.0.0.1:{s.port}", "--api-key", KEY, "--task", "Open the settings @start",
                          "--max-pixels", "65536"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines == ["step 1 thinks: The settings icon is at the top.",
                     "step 1 does: left_click(coordinate=[683, 230])",
                     "step 2 does: type(text=display)",
                     "done after 3 step(s): end_turn"], out.stdout


LOOKUP = {"name": "lookup", "description": "Look a word up.",
          "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}


def test_a_tool_call_answer_is_the_same_streamed_and_not(scripted):
    """The answer 'Let me check.\n<tool_call>...': every protocol hands out the text beside the call
    without its blank space, streamed or not, and the same call."""
    s, _ = scripted
    ask = "What is the weather? @check"
    chat = dict(model="m", max_tokens=64, messages=[{"role": "user", "content": ask}],
                tools=[{"type": "function", "function": LOOKUP}])
    plain = oai(s).chat.completions.create(**chat).choices[0]
    pieces, args = [], ""
    for c in oai(s).chat.completions.create(**chat, stream=True):
        for choice in c.choices:
            pieces.append(choice.delta.content or "")
            args += "".join(t.function.arguments or "" for t in choice.delta.tool_calls or [])
    assert plain.message.content == "".join(pieces) == "Let me check." and plain.finish_reason == "tool_calls"
    assert json.loads(plain.message.tool_calls[0].function.arguments) == json.loads(args) == {"q": "weather"}

    resp = dict(model="m", input=ask, tools=[{"type": "function", **LOOKUP}], max_output_tokens=64)
    plain = oai(s).responses.create(**resp)
    with oai(s).responses.stream(**resp) as stream:
        streamed = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert plain.output_text == streamed == final.output_text == "Let me check."
    assert [(o.type, getattr(o, "arguments", None)) for o in plain.output][-1] == ("function_call", '{"q": "weather"}')

    msg = dict(model="m", max_tokens=64, messages=[{"role": "user", "content": ask}],
               tools=[{"name": "lookup", "description": "Look a word up.", "input_schema": LOOKUP["parameters"]}])
    plain = claude(s).messages.create(**msg)
    with claude(s).messages.stream(**msg) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert plain.content[0].text == streamed == final.content[0].text == "Let me check."
    assert [(b.type, getattr(b, "input", None)) for b in plain.content] == [("text", None),
                                                                          ("tool_use", {"q": "weather"})]
    assert plain.stop_reason == final.stop_reason == "tool_use"


def test_venus_format_renders_navigation_prompts():
    """--agent-format venus: the same conversation as UI-Venus' navigation prompt (the steps as its
    text history, only the current screenshot), what computer.prepare hands the prompt builder."""
    from mlx_qwen3vl.server import computer
    from mlx_qwen3vl.server.conversation import Call, Part, Turn
    from mlx_qwen3vl.server.fetch import MediaPolicy
    from mlx_qwen3vl.server.limits import Limits
    from mlx_qwen3vl.server.protocol import ChatRequest, sampling_params

    rendered = []

    class Builder:
        policy, limits = MediaPolicy(), Limits()

        def render(self, req, messages, images, videos):
            rendered.append((messages, images))
            return "prepared"

    tool = find_computer_tool([{"type": "computer_20250124", "name": "computer", "display_width_px": DISPLAY[0],
                                "display_height_px": DISPLAY[1]}])
    click = {"name": "computer", "input": {"action": "left_click", "coordinate": [683, 230]}}
    turns = [Turn("user", [Part("text", "Open the settings"), Part("image", data_url(SHOTS[0]), "a")]),
             Turn("assistant", [Part("text", "On it.")], [Call("t1", "computer", action=click, param="b")]),
             Turn("tool", [Part("image", data_url(SHOTS[1]), "c"), Part("text", "Done.")], call_id="t1")]
    req = ChatRequest(turns=[], sampling=sampling_params({}))
    prepared, request = computer.prepare(Builder(), req, turns, tool, "venus")
    step = ComputerStep(actions=[tool.parse_call(click)], text="On it.", display=DISPLAY)
    want = computer_messages("Open the settings", SHOTS[1], [step], format="venus", display=DISPLAY)
    assert rendered == [(want, [SHOTS[1]])] and request.display == DISPLAY and request.cursor == (683, 230)
    assert "Click(box=(500, 300))" in want[1]["content"][0]["text"]


# ------------------------------------------------------------------------------------ every field has its effect
def test_image_detail_low_reads_fewer_pixels_than_high(server):
    """OpenAI's detail: "low" is a 512x512-pixel budget, "high" and "auto" the request's own."""
    image = data_url(png(np.random.default_rng(3).integers(0, 256, (600, 800, 3), dtype=np.uint8)))
    tokens = {}
    for detail in ("low", "high", None):
        url = {"url": image, **({"detail": detail} if detail else {})}
        tokens["chat", detail] = oai(server).chat.completions.create(model="m", max_tokens=1, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": url},
                                         {"type": "text", "text": "What?"}]}]).usage.prompt_tokens
        part = {"type": "input_image", "image_url": image, **({"detail": detail} if detail else {})}
        tokens["responses", detail] = oai(server).responses.create(model="m", max_output_tokens=1, input=[
            {"role": "user", "content": [part, {"type": "input_text", "text": "What?"}]}]).usage.input_tokens
    for api in ("chat", "responses"):
        assert tokens[api, "low"] < tokens[api, "high"] == tokens[api, None], tokens


def test_chat_history_fields_render_or_are_refused(server):
    """A refusal sent back is the assistant's text; a tool result's name is accepted; a user's name,
    reasoning_content and annotations (which this server never answers with) are a 400 naming each."""
    def ask(assistant, **user):
        return server.request("POST", "/v1/chat/completions", {"model": "m", "max_tokens": 1, "messages": [
            {"role": "user", "content": "Do it.", **user}, {"role": "assistant", **assistant},
            {"role": "user", "content": "Please?"}]})
    said, refused = ask({"content": "I can't."}), ask({"content": None, "refusal": "I can't."})
    tokens = lambda r: r[1]["usage"]["prompt_tokens"]  # noqa: E731
    assert said[0] == refused[0] == 200 and tokens(said) == tokens(refused)
    assert refused[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == tokens(said) - 1  # the same prompt
    assert tokens(ask({"content": "", "refusal": "I can't."})) == tokens(said)
    for assistant, user, param in (({"content": "x"}, {"name": "bob"}, "messages[0].name"),
                                   ({"content": "x", "reasoning_content": "hm"}, {}, "messages[1].reasoning_content"),
                                   ({"content": "x", "annotations": [{"type": "url_citation"}]}, {},
                                    "messages[1].annotations"),
                                   ({"content": "x", "refusal": "no"}, {}, "messages[1].refusal")):
        status, err = ask(assistant, **user)
        assert status == 400 and err["error"]["param"] == param, err
    assert ask({"content": "x", "reasoning_content": None, "annotations": []})[0] == 200
    status, _ = server.request("POST", "/v1/chat/completions", {"model": "m", "max_tokens": 1, "messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                              "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "name": "f", "content": "ok"}]})
    assert status == 200


def test_anthropic_history_fields_take_effect(server):
    """is_error is in the tool result's text; cache_control, metadata.user_id, thinking disabled (an
    Instruct checkpoint) and a direct caller are accepted."""
    def count(is_error, **extra):
        use = {"type": "tool_use", "id": "t", "name": "f", "input": {}, "caller": {"type": "direct"}}
        return claude(server).messages.count_tokens(model="m", messages=[
            {"role": "user", "content": "x"}, {"role": "assistant", "content": [use]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "gone",
                                          "is_error": is_error, "cache_control": {"type": "ephemeral"}}]}],
            tools=[{"name": "f", "input_schema": {"type": "object"}}], **extra).input_tokens
    assert count(True) > count(False) == count(False, thinking={"type": "disabled"})
    r = claude(server).messages.create(model="m", max_tokens=1, metadata={"user_id": "u1"},
                                       thinking={"type": "disabled"}, messages=[{"role": "user", "content": "hi"}])
    assert r.usage.output_tokens == 1


STRICT = {"type": "object", "properties": {"q": {"enum": ["sunny", "cloudy"]}}, "required": ["q"],
          "additionalProperties": False}


def test_strict_tools_hold_an_unforced_call_to_the_schema(scripted):
    """The scripted answer calls lookup with q "weather": a strict tool's schema (q one of two words)
    constrains that call although tool_choice is auto; the same tool not strict lets it through."""
    s, _ = scripted
    ask = "What is the weather? @check"
    for strict in (True, False):
        fn = {"name": "lookup", "parameters": STRICT, "strict": strict}
        chat = oai(s).chat.completions.create(model="m", max_tokens=64, messages=[{"role": "user", "content": ask}],
                                              tools=[{"type": "function", "function": fn}])
        resp = oai(s).responses.create(model="m", input=ask, tools=[{"type": "function", **fn}], max_output_tokens=64)
        msg = claude(s).messages.create(model="m", max_tokens=64, messages=[{"role": "user", "content": ask}], tools=[
            {"name": "lookup", "input_schema": STRICT, "strict": strict}])
        got = [json.loads(chat.choices[0].message.tool_calls[0].function.arguments)["q"],
               json.loads([o for o in resp.output if o.type == "function_call"][0].arguments)["q"],
               [b for b in msg.content if b.type == "tool_use"][0].input["q"]]
        assert all(q in ("sunny", "cloudy") for q in got) if strict else got == ["weather"] * 3, (strict, got)


def test_max_tool_calls_cuts_the_calls(scripted):
    s, _ = scripted
    ask = dict(model="m", input="Two lookups @two", max_output_tokens=80,
               tools=[{"type": "function", **LOOKUP}, {"type": "function", **LOOKUP, "name": "find"}])
    calls = lambda r: [json.loads(o.arguments)["q"] for o in r.output if o.type == "function_call"]  # noqa: E731
    assert calls(oai(s).responses.create(**ask)) == ["rain", "snow"]
    r = oai(s).responses.create(**ask, max_tool_calls=1)
    assert calls(r) == ["rain"] and r.max_tool_calls == 1
    with oai(s).responses.stream(**ask, max_tool_calls=1) as stream:
        assert calls(stream.get_final_response()) == ["rain"]


def test_thinking_budget_closes_the_thinking_block(tmp_path):
    """A Thinking template (its generation prompt opens <think>) and a script that thinks 12 tokens:
    thinking_budget=B closes the block after exactly B of them and the answer goes on; without a
    budget (or one it stays under) the answer is the script's. The Messages field is the same rule."""
    thoughts = " ".join(f"w{i}" for i in range(12))
    folder = write_scripted_checkpoint(tmp_path / "think", f"<think>\n{thoughts}</think>\n\nDone.")
    template = folder / "chat_template.jinja"
    template.write_text(template.read_text().replace("'<|im_start|>assistant\\n'",
                                                     "'<|im_start|>assistant\\n<think>\\n'"))
    model, processor = M.load(folder)
    tok = processor.tokenizer
    messages = [{"role": "user", "content": "think"}]
    plain = M.generate(model, processor, messages=messages, max_tokens=64, temperature=0.0)
    ids = tok.encode(thoughts, add_special_tokens=False)
    assert plain.text == f"{thoughts}</think>\n\nDone." and len(ids) > 8
    assert M.generate(model, processor, messages=messages, max_tokens=64, thinking_budget=64).text == plain.text
    for budget in (0, 3, 8):
        out = M.generate(model, processor, messages=messages, max_tokens=64, thinking_budget=budget)
        assert out.text == tok.decode(ids[:budget]) + "</think>\n\nDone.", budget
    # Messages: budget_tokens reaches the request's SamplingParams (the script cannot think 1024 tokens)
    from mlx_qwen3vl.server.messages import parse_request
    body = {"model": "m", "max_tokens": 2000, "messages": messages,
            "thinking": {"type": "enabled", "budget_tokens": 1500}}
    assert parse_request(body, "qwen").sampling.thinking_budget == 1500
    assert parse_request({**body, "thinking": None}, "qwen").sampling.thinking_budget is None
