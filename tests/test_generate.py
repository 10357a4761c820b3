"""Generation against transformers' recorded greedy continuations, chunked prefill, multi-turn
prefix reuse, sampling, stopping, streaming and the CLI."""

import json
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

import mlx_qwen3vl as M
from conftest import CASES, FIXTURES, case_inputs, load_fixture_model, reference, rel_err, write_fixture_video
from mlx_qwen3vl.errors import InputError
from mlx_qwen3vl.generate import generate_tokens

ROOT = FIXTURES.parents[1]


def fixture_messages(case):
    """The case's chat messages with media loaded from tests/fixtures/media."""
    data = json.loads((FIXTURES / "cases" / f"{case}.json").read_text())
    fps = []
    for conversation in data["messages"]:
        for message in conversation:
            for block in message["content"] if isinstance(message["content"], list) else []:
                if block["type"] == "image":
                    block["image"] = Image.open(FIXTURES / "media" / block["image"])
                elif block["type"] == "video":
                    block["video"] = np.load(FIXTURES / "media" / block["video"])
                    fps.append(block.pop("fps"))
    return data["messages"], fps


@pytest.fixture(scope="module")
def loaded():
    return {name: (load_fixture_model(name), M.Processor.from_pretrained(FIXTURES / name))
            for name in ("tiny-a", "tiny-b")}


@pytest.mark.parametrize("case", CASES)
def test_greedy_equals_transformers(checkpoint, case, backend):
    """From the recorded inputs, with a tiny prefill chunk so chunks split images and DeepStack spans;
    on the plain MLX graph and on the CPU path (as shipped, and for every size)."""
    model = load_fixture_model(checkpoint, backend=backend)
    inputs = case_inputs(case)
    processor = M.Processor.from_pretrained(FIXTURES / checkpoint)
    tokens = [np.array(y) for y in generate_tokens(model, processor, inputs, max_tokens=16, prefill_step_size=7)]
    np.testing.assert_array_equal(np.stack(tokens, 1), reference(checkpoint, case)["greedy"])


@pytest.mark.parametrize("case", ["text", "image", "two_images"])
def test_generate_end_to_end_from_messages(loaded, checkpoint, case):
    """Messages → our processor → generate() gives transformers' tokens."""
    model, processor = loaded[checkpoint]
    messages, _ = fixture_messages(case)
    result = M.generate(model, processor, messages=messages[0], max_tokens=16)
    assert result.token_ids == reference(checkpoint, case)["greedy"][0].tolist()
    assert result.finish_reason == "length" and result.generation_tokens == 16
    assert result.prompt_tokens == case_inputs(case)["input_ids"].shape[1]
    assert result.text == processor.tokenizer.decode(result.token_ids)  # as mlx-lm: specials but EOS shown
    assert result.prompt_tps > 0 and result.generation_tps > 0 and result.peak_memory_gb > 0


def test_batch_generate_equals_single_runs(loaded, checkpoint):
    model, processor = loaded[checkpoint]
    messages, _ = fixture_messages("batch")
    results = M.batch_generate(model, processor, [dict(messages=m) for m in messages], max_tokens=16)
    greedy = reference(checkpoint, "batch")["greedy"]
    for i, (r, m) in enumerate(zip(results, messages)):
        assert r.token_ids == greedy[i].tolist()
        assert r.token_ids == M.generate(model, processor, messages=m, max_tokens=16).token_ids


def test_chunked_prefill_equals_one_pass(checkpoint):
    """All-position logits with chunks of 5 (image placeholders and DeepStack spans cross chunk
    boundaries) equal one pass."""
    model = load_fixture_model(checkpoint)
    inputs = case_inputs("two_images")
    prepared = model.prepare_inputs(**inputs)
    whole = model.logits(model.decode_hidden(prepared, None, model.make_cache()))
    cache, parts = model.make_cache(), []
    L = inputs["input_ids"].shape[1]
    image_positions = np.flatnonzero(inputs["mm_token_type_ids"][0])
    assert any(s in image_positions and s - 1 in image_positions for s in range(0, L, 5))
    for s in range(0, L, 5):
        parts.append(model.logits(model.decode_hidden(prepared, None, cache, s, min(L, s + 5))))
    chunked = mx.concatenate(parts, axis=1)
    assert rel_err(chunked, whole) < 1e-5
    assert rel_err(chunked, reference(checkpoint, "two_images")["logits"]) < 1e-4


def test_multi_turn_reuses_prefix_and_matches_from_scratch(loaded, checkpoint, monkeypatch):
    model, processor = loaded[checkpoint]
    img1 = Image.open(FIXTURES / "media" / "img_300x200.png")
    img2 = Image.open(FIXTURES / "media" / "img_90x260.png")
    encoded = []
    original = model.visual.start  # where every run of the tower begins, whole or spread over steps
    monkeypatch.setattr(model.visual, "start",
                        lambda px, grid: encoded.append(np.asarray(grid).tolist()) or original(px, grid))
    session = M.ChatSession(model, processor, system="You are a GUI agent.", max_tokens=8)
    session.send("Where is the search box?", images=[img1])
    first = session.last
    assert first.cached_tokens == 0
    turn2_tokens = [piece.token for piece in session.stream("Now click it.", images=[img2])]
    second = session.last

    # Turn 2 computed only what turn 1 had not: the new image and text.
    history = session.messages[:-1]
    full = processor.apply_chat_template(history, tokenize=True)
    n_full = full["input_ids"].shape[1]
    assert second.prompt_tokens == n_full
    assert second.cached_tokens >= first.prompt_tokens  # turn 1's prompt (and answer) came from cache
    assert n_full - second.cached_tokens < 0.5 * n_full
    assert encoded[-1] == [full["image_grid_thw"][1].tolist()]  # only the new screenshot was encoded

    scratch = M.generate(model, processor, messages=history, max_tokens=8)
    assert scratch.token_ids == turn2_tokens
    assert scratch.text == session.messages[-1]["content"]


def test_prefix_cache_logits_equal_from_scratch(loaded, checkpoint):
    """Reusing a cached prefix gives the same next-token logits as computing the whole prompt."""
    model, processor = loaded[checkpoint]
    img = Image.open(FIXTURES / "media" / "img_123x77.png")
    turn1 = [{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": "Hi"}]}]
    cache = M.PromptCache(model.make_cache())
    answer = M.generate(model, processor, messages=turn1, max_tokens=4, prompt_cache=cache).text
    turn2 = turn1 + [{"role": "assistant", "content": answer},
                     {"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": "Again"}]}]
    inputs = processor.apply_chat_template(turn2, tokenize=True)
    from mlx_qwen3vl.generate import prefill

    start = cache.reuse(inputs)
    assert start > 80
    reused, _ = prefill(model, inputs, cache.cache, start=start)
    fresh, _ = prefill(model, inputs, model.make_cache())
    assert rel_err(reused, fresh) < 1e-4


def test_stop_on_eos_and_stop_strings(loaded, monkeypatch):
    model, processor = loaded["tiny-b"]
    messages, _ = fixture_messages("text")
    greedy = reference("tiny-b", "text")["greedy"][0].tolist()
    monkeypatch.setattr(model.config, "eos_token_ids", [greedy[3]])
    result = M.generate(model, processor, messages=messages[0], max_tokens=16)
    assert result.finish_reason == "stop" and result.token_ids == greedy[:4]
    assert result.text == processor.tokenizer.decode(greedy[:3])
    monkeypatch.undo()
    full = M.generate(model, processor, messages=messages[0], max_tokens=16)
    stop = full.text[5:8]
    cut = M.generate(model, processor, messages=messages[0], max_tokens=16, stop=[stop])
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.find(stop)]


def test_ignore_eos_generates_past_eos_per_request(loaded, monkeypatch):
    """ignore_eos is part of one request's stopping rule: that request runs to max_tokens past the
    EOS token (the same greedy tokens), a request beside it in the batch still stops there."""
    model, processor = loaded["tiny-b"]
    messages, _ = fixture_messages("text")
    greedy = reference("tiny-b", "text")["greedy"][0].tolist()
    monkeypatch.setattr(model.config, "eos_token_ids", [greedy[3]])
    past = M.generate(model, processor, messages=messages[0], max_tokens=16, ignore_eos=True)
    assert past.finish_reason == "length" and past.token_ids == greedy
    stopped, ignored = M.batch_generate(model, processor, [dict(messages=messages[0]),
                                                           dict(messages=messages[0], ignore_eos=True)], max_tokens=16)
    assert stopped.token_ids == greedy[:4] and stopped.finish_reason == "stop"
    assert ignored.token_ids == greedy and ignored.finish_reason == "length"
    cut = M.generate(model, processor, messages=messages[0], max_tokens=16, ignore_eos=True, stop=past.text[5:8])
    assert cut.finish_reason == "stop"  # stop strings still end it
    with pytest.raises(InputError, match="ignore_eos"):
        M.SamplingParams(ignore_eos="yes")
    from mlx_qwen3vl.__main__ import build_parser

    parse = build_parser().parse_args
    assert parse(["--model", "m", "--ignore-eos"]).ignore_eos and not parse(["--model", "m"]).ignore_eos


@pytest.mark.parametrize("case", ["text", "image", "video"])
def test_vision_timing_hook(case):
    """on_vision_done reports the vision tower's seconds once per prompt with media, never without,
    and changes no token."""
    model = load_fixture_model("tiny-a")
    times = []
    processor = M.Processor.from_pretrained(FIXTURES / "tiny-a")
    tokens = [np.array(y) for y in generate_tokens(model, processor, case_inputs(case), max_tokens=4,
                                                    on_vision_done=times.append)]
    np.testing.assert_array_equal(np.stack(tokens, 1), reference("tiny-a", case)["greedy"][:, :4])
    if case == "text":
        assert times == []
    else:
        assert len(times) == 1 and times[0] > 0


def test_streaming_pieces_add_up(loaded):
    model, processor = loaded["tiny-a"]
    messages, _ = fixture_messages("image")
    pieces = list(M.stream_generate(model, processor, messages=messages[0], max_tokens=12))
    assert len(pieces) == 12 and pieces[-1].finish_reason == "length"
    assert all(p.finish_reason is None for p in pieces[:-1])
    assert "".join(p.text for p in pieces) == M.generate(model, processor, messages=messages[0], max_tokens=12).text
    assert [p.generation_tokens for p in pieces] == list(range(1, 13))


def test_sampling_is_seeded(loaded):
    model, processor = loaded["tiny-b"]
    kw = dict(max_tokens=12, temperature=1.0, top_p=0.95, top_k=50, seed=7)
    a = M.generate(model, processor, "Where is the search box?", **kw).token_ids
    b = M.generate(model, processor, "Where is the search box?", **kw).token_ids
    c = M.generate(model, processor, "Where is the search box?", **dict(kw, seed=8)).token_ids
    greedy = M.generate(model, processor, "Where is the search box?", max_tokens=12).token_ids
    assert a == b and a != c and a != greedy
    model, processor = loaded["tiny-a"]  # whose greedy answer repeats itself
    greedy = M.generate(model, processor, "Where is the search box?", max_tokens=12).token_ids
    penalized = M.generate(model, processor, "Where is the search box?", max_tokens=12,
                           repetition_penalty=5.0).token_ids
    assert len(set(penalized)) > len(set(greedy))


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "mlx_qwen3vl.generate", *args], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, **(env or {})}, timeout=300)


def test_cli_streams_answer_and_stats():
    image = str(FIXTURES / "media" / "img_123x77.png")
    p = run_cli("--model", str(FIXTURES / "tiny-a"), "--image", image, "--prompt", "Describe the image.",
                "--max-tokens", "16")
    assert p.returncode == 0, p.stderr
    greedy = reference("tiny-a", "image")["greedy"][0].tolist()
    processor = M.Processor.from_pretrained(FIXTURES / "tiny-a")
    assert p.stdout.strip("\n") == processor.tokenizer.decode(greedy).strip("\n")
    assert "Generation: 16 tokens" in p.stderr and "Peak memory" in p.stderr
    # Nothing but the statistics on stderr (no library warnings).
    assert [line.split(":")[0] for line in p.stderr.splitlines() if line] == ["Prompt", "Generation", "Peak memory"]


@pytest.mark.parametrize("args, needle", [
    (["--model", str(FIXTURES / "tiny-a"), "--image", "missing.png"], "missing.png"),
    (["--model", "/no/such/model"], "/no/such/model"),
    (["--model", "Qwen/Qwen3-VL-2B-Instruct"], "HF_HUB_OFFLINE"),
])
def test_cli_bad_inputs_exit_2_with_one_line(args, needle):
    p = run_cli(*args, "--prompt", "hi", env={"HF_HUB_OFFLINE": "1"})
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0]


def test_cli_chat_reuses_cache_between_turns():
    image = str(FIXTURES / "media" / "img_123x77.png")
    p = subprocess.run([sys.executable, "-m", "mlx_qwen3vl.generate", "--model", str(FIXTURES / "tiny-b"), "--chat",
                        "--max-tokens", "4"], input=f"/image {image}\nWhat is this?\nAnd now?\n", capture_output=True,
                       text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr
    prompts = [line for line in p.stderr.splitlines() if line.startswith("Prompt:")]
    assert len(prompts) == 2
    assert "(0 cached)" in prompts[0]
    first_total = int(prompts[0].split()[1])
    cached = int(prompts[1].split("(")[1].split()[0])
    assert cached >= first_total  # turn 1's prompt with its image came from the cache


def test_cli_video_file_equals_frames(loaded, tmp_path):
    """--video FILE (PyAV) answers as the same frames given to the Python API do."""
    frames, path = write_fixture_video(tmp_path)
    model, processor = loaded["tiny-b"]
    expected = M.generate(model, processor, "What happens?", videos=[frames], source_fps=8.0, max_tokens=8)
    p = run_cli("--model", str(FIXTURES / "tiny-b"), "--video", str(path), "--prompt", "What happens?",
                "--max-tokens", "8")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip("\n") == expected.text.strip("\n")
    assert f"Prompt: {expected.prompt_tokens} tokens" in p.stderr


# ---------------------------------------------------------------------------------------------
# Each feature equals the plain fresh run it stands for (issue #20)
# ---------------------------------------------------------------------------------------------
def test_batch_with_repetition_penalty_equals_single_runs(loaded, checkpoint):
    """The shorter row's left-padding (the pad id is an EOS id) is not part of its penalty history
    (a penalty below 1, which favours seen tokens, made the counted padding end that row early)."""
    model, processor = loaded[checkpoint]
    long = "Where is the search box on this long page of results? Please answer with coordinates."
    requests = [dict(prompt="Click."), dict(prompt=long)]
    kw = dict(max_tokens=12, repetition_penalty=0.5, repetition_context_size=64)
    results = M.batch_generate(model, processor, requests, **kw)
    for r, req in zip(results, requests):
        alone = M.generate(model, processor, req["prompt"], **kw)
        assert r.token_ids == alone.token_ids and r.text == alone.text


def test_templated_prompt_is_used_as_is_everywhere(loaded):
    """One rule for generate and batch_generate: only templated=True marks text as templated."""
    model, processor = loaded["tiny-b"]
    messages = [{"role": "user", "content": "Where is the search box?"}]
    text = processor.apply_chat_template(messages)
    expected = M.generate(model, processor, messages=messages, max_tokens=8).token_ids
    assert M.generate(model, processor, text, templated=True, max_tokens=8).token_ids == expected
    batch = M.batch_generate(model, processor, [dict(prompt=text, templated=True), dict(messages=messages)],
                             max_tokens=8)
    assert [r.token_ids for r in batch] == [expected, expected]
    with pytest.raises(M.errors.InputError, match="templated=True"):
        M.generate(model, processor, text, max_tokens=8)  # not guessed at
    with pytest.raises(M.errors.InputError, match="templated=True"):
        M.batch_generate(model, processor, [dict(prompt=text)], max_tokens=8)


def test_system_with_messages_is_applied_or_refused(loaded):
    model, processor = loaded["tiny-b"]
    user = [{"role": "user", "content": "Click OK."}]
    with_system = [{"role": "system", "content": "You are a GUI agent."}] + user
    expected = M.generate(model, processor, messages=with_system, max_tokens=8)
    got = M.generate(model, processor, messages=user, system="You are a GUI agent.", max_tokens=8)
    assert got.token_ids == expected.token_ids and got.prompt_tokens == expected.prompt_tokens
    [batched] = M.batch_generate(model, processor, [dict(messages=user, system="You are a GUI agent.")], max_tokens=8)
    assert batched.token_ids == expected.token_ids
    with pytest.raises(M.errors.InputError, match="system"):
        M.generate(model, processor, messages=with_system, system="Another.", max_tokens=8)


def test_sampling_in_a_batch_equals_alone_with_the_same_seed(loaded, checkpoint):
    model, processor = loaded[checkpoint]
    messages, _ = fixture_messages("batch")
    kw = dict(max_tokens=12, temperature=1.0, top_p=0.9, top_k=40)
    requests = [dict(messages=m, seed=11 + i) for i, m in enumerate(messages)]
    results = M.batch_generate(model, processor, requests, **kw)
    for r, req in zip(results, requests):
        alone = M.generate(model, processor, messages=req["messages"], seed=req["seed"], **kw)
        assert r.token_ids == alone.token_ids
    greedy = M.batch_generate(model, processor, requests, max_tokens=12)
    assert [r.token_ids for r in results] != [g.token_ids for g in greedy]  # it did sample


def test_stop_string_across_two_tokens_never_shows_its_first_part(loaded, checkpoint):
    """Streamed pieces and the final text both end right before the stop string, and add up."""
    model, processor = loaded[checkpoint]
    messages, _ = fixture_messages("text")
    full = M.generate(model, processor, messages=messages[0], max_tokens=16)
    pieces = [processor.tokenizer.decode([t]) for t in full.token_ids]
    k = next(i for i in range(1, len(pieces)) if pieces[i - 1] and pieces[i]
             and (pieces[i - 1] + pieces[i]) in full.text)
    stop = pieces[k - 1][-1] + pieces[k][0]  # the last character of one token and the first of the next
    cut = full.text[: full.text.find(stop)]
    streamed = list(M.stream_generate(model, processor, messages=messages[0], max_tokens=16, stop=stop))
    assert "".join(p.text for p in streamed) == cut
    assert M.generate(model, processor, messages=messages[0], max_tokens=16, stop=[stop]).text == cut
    assert streamed[-1].finish_reason == "stop"
    [batched] = M.batch_generate(model, processor, [dict(messages=messages[0])], max_tokens=16, stop=[stop])
    assert batched.text == cut and batched.finish_reason == "stop"


def test_logprobs_per_token(loaded):
    model, processor = loaded["tiny-a"]
    result = M.generate(model, processor, "Where is the search box?", max_tokens=6)
    pieces = list(M.stream_generate(model, processor, "Where is the search box?", max_tokens=6))
    assert len(result.logprobs) == 6 and all(lp <= 0 for lp in result.logprobs)
    for p, lp in zip(pieces, result.logprobs):
        assert p.logprobs.shape == (model.config.text_config.vocab_size,)
        assert int(mx.argmax(p.logprobs)) == p.token  # greedy
        assert abs(float(p.logprobs[p.token]) - lp) < 1e-5
    [batched] = M.batch_generate(model, processor, [dict(prompt="Where is the search box?")], max_tokens=6)
    np.testing.assert_allclose(batched.logprobs, result.logprobs, atol=1e-5)


def test_response_fields_are_mlx_lms():
    """Code written against mlx-lm's stream_generate reads our pieces unchanged (plus cached_tokens,
    kv_cache_bytes, the KV cache's bytes in use, and speculative decoding's draft counts)."""
    import dataclasses
    import importlib

    from mlx_qwen3vl.generate import GenerationResponse

    theirs = {f.name for f in dataclasses.fields(importlib.import_module("mlx_lm.generate").GenerationResponse)}
    ours = {f.name for f in dataclasses.fields(GenerationResponse)}
    assert theirs <= ours and ours - theirs == {"cached_tokens", "kv_cache_bytes", "draft_proposed", "draft_accepted"}, (
        theirs - ours, ours - theirs)


# ---------------------------------------------------------------------------------------------
# Issue #27: media by role, token bytes, video frame rates, the chat loop
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("role", ["system", "developer", "assistant"])
def test_media_where_the_template_renders_none_are_refused_naming_the_message(loaded, role):
    model, processor = loaded["tiny-a"]
    image = FIXTURES / "media" / "img_123x77.png"
    messages = [{"role": "user", "content": "Hi."},
                {"role": role, "content": [{"type": "text", "text": "Look."}, {"type": "image", "image": str(image)}]},
                {"role": "user", "content": "Go on."}]
    with pytest.raises(InputError, match=f"message 2 content item 2 is an image in a {role} message"):
        M.generate(model, processor, messages=messages, max_tokens=2)


def test_screenshot_in_a_tool_result_is_rendered(loaded):
    """A tool result may be a screenshot (computer-use loops): it gets its image placeholders and
    pixels, and the answer equals the one with the same pixels given as a PIL image."""
    model, processor = loaded["tiny-a"]
    path = FIXTURES / "media" / "img_123x77.png"
    tool = lambda image: [{"role": "user", "content": "Click it."},  # noqa: E731
                          {"role": "assistant", "content": "", "tool_calls": [
                              {"type": "function", "function": {"name": "computer_use", "arguments": {}}}]},
                          {"role": "tool", "content": [{"type": "image", "image": image},
                                                       {"type": "text", "text": "Done."}]}]
    inputs = processor.apply_chat_template(tool(str(path)), tokenize=True)
    assert inputs["image_grid_thw"].shape == (1, 3)
    assert "<tool_response>\n<|vision_start|>" in processor.apply_chat_template(tool(str(path)))
    assert (M.generate(model, processor, messages=tool(str(path)), max_tokens=4).token_ids
            == M.generate(model, processor, messages=tool(Image.open(path)), max_tokens=4).token_ids)


def _gpt2_byte_table():
    """GPT-2's byte → printable character map (its bytes_to_unicode), written out independently."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    table, n = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + n)] = b
            n += 1
    return table


def test_token_bytes_are_each_tokens_own_bytes(loaded):
    """Tokens that are part of a UTF-8 character decode alone to U+FFFD; their bytes are their own
    (the vocabulary's byte-level pieces), so a text's tokens' bytes add up to the text's bytes."""
    from mlx_qwen3vl.generate import token_bytes

    tokenizer = loaded["tiny-a"][1].tokenizer
    text = "é·中 ok <|im_end|>"
    ids = tokenizer(text)["input_ids"]
    assert any(tokenizer.decode([i]) == "\ufffd" for i in ids)  # the case that matters is present
    assert b"".join(token_bytes(tokenizer, i) for i in ids) == text.encode("utf-8")
    table = _gpt2_byte_table()
    middle = tokenizer.convert_tokens_to_ids("·")  # the lone byte 0xB7
    assert token_bytes(tokenizer, middle) == b"\xb7" == bytes(table[c] for c in tokenizer.convert_ids_to_tokens(middle))


def test_fps_is_the_sampling_rate_and_source_fps_the_frames_rate(loaded, tmp_path):
    """fps= samples that many frames per second of video (qwen-vl-utils' meaning), for frames and
    files alike; source_fps= is the rate of the frames given (video_fps=, its old name, warns)."""
    _, processor = loaded["tiny-b"]
    frames, path = write_fixture_video(tmp_path)  # 16 frames at 8 fps: 2 seconds
    grid = lambda **kw: processor.process_videos([frames], **kw)[1][0, 0]  # noqa: E731
    assert grid(source_fps=8) == 2  # 2 fps by default: 4 frames, 2 temporal patches
    assert grid(source_fps=8, fps=4) == 4  # 8 frames
    assert grid(source_fps=16, fps=4) == 2  # the same frames as 1 second: 4 frames
    assert processor.process_videos([str(path)], fps=4)[1][0, 0] == 4  # the file's own 8 fps
    ts = lambda **kw: processor.process_videos([frames], **kw)[2][0]  # noqa: E731
    with pytest.warns(DeprecationWarning, match="source_fps"):
        old = ts(video_fps=16)
    assert old == ts(source_fps=16) != ts(source_fps=8)
    with pytest.raises(InputError, match="fps=0 is not a frame rate"):
        processor.process_videos([frames], fps=0)


def test_chat_session_keeps_each_turns_sampling_rate(loaded):
    model, processor = loaded["tiny-b"]
    frames = np.load(FIXTURES / "media" / "video_16x72x100.npy")
    session = M.ChatSession(model, processor, max_tokens=4, source_fps=8.0)
    session.send("Describe the clip.", videos=[frames], fps=4)
    tokens = [p.token for p in session.stream("And then?")]
    history = session.messages[:-1]
    assert tokens == M.generate(model, processor, messages=history, fps=4, source_fps=8.0, max_tokens=4).token_ids
    at = lambda **kw: processor.apply_chat_template(history, tokenize=True, source_fps=8.0, **kw)  # noqa: E731
    assert session.last.prompt_tokens == at(fps=4)["input_ids"].shape[1] != at()["input_ids"].shape[1]


def test_cli_fps_flags_mean_the_librarys_keywords(loaded, tmp_path, capsys):
    """--fps is fps= (the sampling rate), --source-fps is source_fps= (the file's rate overridden)."""
    from mlx_qwen3vl.__main__ import main

    model, processor = loaded["tiny-b"]
    _, path = write_fixture_video(tmp_path)
    for flags, kw in ((["--fps", "4"], dict(fps=4)), (["--source-fps", "16"], dict(source_fps=16)), ([], {})):
        want = M.generate(model, processor, "What happens?", videos=[str(path)], max_tokens=4, **kw)
        assert main(["--model", str(FIXTURES / "tiny-b"), "--video", str(path), "--prompt", "What happens?",
                     "--max-tokens", "4", *flags]) == 0
        out, err = capsys.readouterr()
        assert out.strip("\n") == want.text.strip("\n") and f"Prompt: {want.prompt_tokens} tokens" in err, flags
    assert M.generate(model, processor, "What happens?", videos=[str(path)], max_tokens=1, fps=4).prompt_tokens \
        != want.prompt_tokens


def test_cli_chat_commands_first_turn_and_prompts(loaded):
    """--prompt (with --image) is the chat's first turn; `/image missing.png` is refused at once and
    the next message still goes; /help is answered locally; stdout holds only the answers."""
    model, processor = loaded["tiny-b"]
    image = str(FIXTURES / "media" / "img_123x77.png")
    p = subprocess.run([sys.executable, "-m", "mlx_qwen3vl", "--model", str(FIXTURES / "tiny-b"), "--chat",
                        "--max-tokens", "4", "--prompt", "First.", "--image", image],
                       input="/image missing.png\nWhat is this?\n/help\n", capture_output=True, text=True, cwd=ROOT,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    session = M.ChatSession(model, processor, max_tokens=4)
    answers = [session.send("First.", images=[image]), session.send("What is this?")]
    assert p.stdout == "".join(a + "\n" for a in answers)  # no ">> " between them
    assert len([line for line in p.stderr.splitlines() if line.startswith("Prompt:")]) == 2  # /help never sent
    errors = [line for line in p.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "/image 'missing.png'" in errors[0]
    assert "/image PATH" in p.stderr.split("Commands", 1)[1]


def test_stream_generate_counts_the_weights_once_per_model(loaded, monkeypatch):
    """Each call runs an Engine of its own; the weights' bytes its KV budget subtracts are counted
    once per model, not by walking every parameter per call (issue #40)."""
    from mlx_qwen3vl.engine import core

    model, processor = loaded["tiny-b"]
    walks, real = [], core._leaves
    monkeypatch.setattr(core, "_leaves", lambda tree, prefix="": (walks.append(1) if prefix == "" else None)
                        or real(tree, prefix))
    monkeypatch.setattr(core, "_WEIGHT_BYTES", {})
    for _ in range(3):
        M.generate(model, processor, "hi", max_tokens=1)
    assert len(walks) == 1
    assert core.weight_bytes(model) == sum(v.nbytes for _, v in real(model.parameters()))
