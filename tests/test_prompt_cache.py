"""Prefix reuse is keyed on content, not only on token ids: same-size images expand to the same
placeholder tokens, so every scenario here swaps, slides, moves or resends same-size media and
compares the answer with a fresh run's, greedy, token for token (issue #19). Also ChatSession's
per-turn settings (issue #20)."""

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

import mlx_qwen3vl as M
from conftest import FIXTURES, load_fixture_model
from mlx_qwen3vl.prompt_cache import media_keys, media_spans, reusable_prefix

N = 8  # tokens per answer


@pytest.fixture(scope="module")
def loaded():
    return {name: (load_fixture_model(name), M.Processor.from_pretrained(FIXTURES / name))
            for name in ("tiny-a", "tiny-b")}


def screenshot(seed, size=(96, 64)):
    """A random same-size 'screenshot' per seed."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def user(text, *images):
    return {"role": "user", "content": [{"type": "image", "image": im} for im in images] + [{"type": "text", "text": text}]}


def fresh(model, processor, **kw):
    return M.generate(model, processor, max_tokens=N, **kw)


def test_same_size_image_swapped_is_not_served_from_cache(loaded, checkpoint):
    model, processor = loaded[checkpoint]
    a, b = screenshot(1), screenshot(2)
    pc = M.PromptCache(model.make_cache())
    first = M.generate(model, processor, "What is on the screen?", images=[a], max_tokens=N, prompt_cache=pc)
    assert first.token_ids == fresh(model, processor, prompt="What is on the screen?", images=[a]).token_ids
    second = M.generate(model, processor, "What is on the screen?", images=[b], max_tokens=N, prompt_cache=pc)
    expected = fresh(model, processor, prompt="What is on the screen?", images=[b])
    assert second.token_ids == expected.token_ids
    image_start = media_spans(processor(text=processor.apply_chat_template([user("x", b)]), images=[b]))[0].start
    assert second.cached_tokens <= image_start  # the text before the image, nothing of it


def test_same_image_resent_is_reused(loaded, checkpoint):
    """Equal pixels match whatever object carries them (a PIL image, then PNG bytes)."""
    import io

    model, processor = loaded[checkpoint]
    a = screenshot(3)
    png = io.BytesIO()
    a.save(png, format="PNG")
    pc = M.PromptCache(model.make_cache())
    turn1 = [user("Where is the menu?", a)]
    answer = M.generate(model, processor, messages=turn1, max_tokens=N, prompt_cache=pc).text
    turn2 = turn1[:1] + [{"role": "assistant", "content": answer}, user("Open it.")]
    turn2[0] = user("Where is the menu?", png.getvalue())
    second = M.generate(model, processor, messages=turn2, max_tokens=N, prompt_cache=pc)
    assert second.token_ids == fresh(model, processor, messages=turn2).token_ids
    inputs = processor.apply_chat_template(turn2, tokenize=True)
    assert second.cached_tokens >= media_spans(inputs)[0].end  # the image came from the cache


def test_agent_sliding_window_of_two_screenshots(loaded, checkpoint):
    """An agent resends its task, its past actions and only the last two screenshots each turn
    (UI-Venus keeps the last few): from turn 3 on, the first image slot holds a new screenshot of
    the same size. Prefill in chunks of 16, so chunks split the images."""
    model, processor = loaded[checkpoint]
    shots = [screenshot(10 + i) for i in range(4)]
    pc = M.PromptCache(model.make_cache())
    actions, cached = [], []
    for turn in range(4):
        window = shots[max(0, turn - 1): turn + 1]
        text = "Task: open settings. Previous actions: " + "; ".join(actions or ["none"])
        messages = [{"role": "system", "content": "You are a GUI agent."}, user(text, *window)]
        result = M.generate(model, processor, messages=messages, max_tokens=N, prompt_cache=pc, prefill_step_size=16)
        assert result.token_ids == fresh(model, processor, messages=messages).token_ids, f"turn {turn}"
        actions.append(f"step {turn}")
        cached.append(result.cached_tokens)
    assert cached[1] > media_spans(processor.apply_chat_template(messages, tokenize=True))[0].start  # turn 1's shot


def test_video_swapped_for_one_of_the_same_shape(loaded, checkpoint):
    model, processor = loaded[checkpoint]
    frames = np.load(FIXTURES / "media" / "video_16x72x100.npy")
    other = frames[:, ::-1].copy()  # same shape, other content
    pc = M.PromptCache(model.make_cache())
    kw = dict(source_fps=8.0, max_tokens=N)
    M.generate(model, processor, "What happens?", videos=[frames], prompt_cache=pc, **kw)
    second = M.generate(model, processor, "What happens?", videos=[other], prompt_cache=pc, **kw)
    assert second.token_ids == M.generate(model, processor, "What happens?", videos=[other], **kw).token_ids


def test_image_moved_to_another_position(loaded, checkpoint):
    model, processor = loaded[checkpoint]
    a, b = screenshot(20), screenshot(21)
    pc = M.PromptCache(model.make_cache())
    M.generate(model, processor, messages=[user("Compare them.", a, b)], max_tokens=N, prompt_cache=pc)
    moved = [user("Compare them.", b, a)]
    second = M.generate(model, processor, messages=moved, max_tokens=N, prompt_cache=pc)
    assert second.token_ids == fresh(model, processor, messages=moved).token_ids


def test_reusable_prefix_rule(loaded):
    """The matching rule as the server's multi-entry cache uses it: (tokens, media) pairs in."""
    _, processor = loaded["tiny-b"]
    a, b = screenshot(30), screenshot(31)
    enc = lambda *ims: processor.apply_chat_template([user("Hi", *ims)], tokenize=True)
    held = enc(a, b)
    tokens, media = held["input_ids"][0].tolist(), media_keys(held)
    spans = media_spans(held)
    assert reusable_prefix(tokens, media, enc(a, b)) == len(tokens) - 1  # all but the last token
    assert reusable_prefix(tokens, media, enc(a, a)) == spans[1].start  # ends before the changed image
    assert reusable_prefix(tokens, media, enc(b, b)) == spans[0].start
    assert reusable_prefix(tokens, [], enc(a, b)) == spans[0].start  # a cache that recorded no media
    assert reusable_prefix(tokens[: spans[0].end - 3], media, enc(a, b)) == spans[0].start  # never inside one


def test_chat_session_keeps_each_turns_source_fps(loaded, checkpoint):
    """A video sent with source_fps=8 stays at 8 fps (its frames, timestamps, tokens) on later turns."""
    model, processor = loaded[checkpoint]
    frames = np.load(FIXTURES / "media" / "video_16x72x100.npy")
    session = M.ChatSession(model, processor, max_tokens=N)
    session.send("Describe the clip.", videos=[frames], source_fps=8.0)  # (an answer without placeholder tokens)
    tokens = [p.token for p in session.stream("And then?")]
    history = session.messages[:-1]
    ids = processor.apply_chat_template(history, tokenize=True, source_fps=8.0)["input_ids"]
    assert session.last.prompt_tokens == ids.shape[1]
    assert tokens == M.generate(model, processor, messages=history, source_fps=8.0, max_tokens=N).token_ids


def test_chat_session_keeps_each_turns_pixel_budget(loaded, checkpoint):
    """max_pixels given to one send() shapes that turn's image for every later turn."""
    model, processor = loaded[checkpoint]
    img = Image.open(FIXTURES / "media" / "img_300x200.png")
    session = M.ChatSession(model, processor, max_tokens=N)
    session.send("Where is the button?", images=[img], max_pixels=64 * 64)
    session.send("Click it.")
    tokens = [p.token for p in session.stream("Again.")]
    history = session.messages[:-1]
    expected = M.generate(model, processor, messages=history, max_pixels=64 * 64, max_tokens=N)
    assert tokens == expected.token_ids
    assert session.last.cached_tokens > 0


def test_chat_session_inputs_equal_the_whole_conversation(loaded):
    """The session processes each turn's media once and assembles the prompt from pieces; the
    pieces add up to what the processor makes of the whole conversation."""
    model, processor = loaded["tiny-a"]
    session = M.ChatSession(model, processor, system="You are a GUI agent.", max_tokens=4)
    session.send("One.", images=[screenshot(40)])
    session.send("Two.", images=[screenshot(41), screenshot(42, (64, 96))])
    session.messages.append(user("Three."))
    session.settings.append({})
    whole = processor.apply_chat_template(session.messages, tokenize=True)
    pieces = session.encode()
    for key in ("input_ids", "mm_token_type_ids", "pixel_values", "image_grid_thw"):
        np.testing.assert_array_equal(pieces[key], whole[key])
    assert pieces["media_hashes"] == [k[3] for k in media_keys(whole)]


def test_abandoned_turn_leaves_the_session_consistent(loaded):
    model, processor = loaded["tiny-b"]
    session = M.ChatSession(model, processor, max_tokens=N)
    session.send("Hello.", images=[screenshot(50)])
    for _ in session.stream("Tell me more."):
        break  # the caller stops reading
    assert len(session.messages) == 2
    tokens = [p.token for p in session.stream("Something else.")]
    assert tokens == M.generate(model, processor, messages=session.messages[:-1], max_tokens=N).token_ids


def test_vision_markers_in_an_answer_do_not_break_the_next_turn(checkpoint, monkeypatch):
    """An answer that holds <|image_pad|> (random weights emit it) is kept in the history without
    the marker, so the next turn renders (no stray media slot) and equals a fresh run on it."""
    model = load_fixture_model(checkpoint)
    processor = M.Processor.from_pretrained(FIXTURES / checkpoint)
    original = type(model).logits
    bias = mx.zeros((model.config.text_config.vocab_size,)).at[processor.image_token_id].add(1e4)
    monkeypatch.setattr(model, "logits", lambda hidden: original(model, hidden) + bias)
    session = M.ChatSession(model, processor, max_tokens=3)
    img = Image.open(FIXTURES / "media" / "img_123x77.png")
    first = session.send("Where is it?", images=[img])
    assert "<|image_pad|>" in first and "<|image_pad|>" not in session.messages[-1]["content"]
    monkeypatch.undo()
    answer = session.send("And now?")
    assert answer == M.generate(model, processor, messages=session.messages[:-1], max_tokens=3).text


def _png(image):
    import io

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _overwrite(kind, target, image):
    """Put `image` into the agent's screen holder `target` in place (its id, path or buffer kept)."""
    if kind == "file":
        image.save(target, format="PNG")
    elif kind == "pil":
        target.paste(image)
    elif kind == "numpy":
        target[...] = np.asarray(image)
    else:
        target[:] = _png(image)


@pytest.mark.parametrize("kind", ["file", "pil", "numpy", "bytearray"])
def test_chat_session_keeps_each_turns_screenshot_as_sent(loaded, kind, tmp_path):
    """An agent that saves every screen to the same file (or draws into the same PIL image, or
    refills the same array or byte buffer) sends it each turn: each turn is answered from the pixels
    it held when that turn was sent, and the history keeps them (turn 3, after a third change,
    still equals the conversation with the first two screens). Turn 2 reuses turn 1's cache."""
    model, processor = loaded["tiny-a"]
    shots = [screenshot(60 + i) for i in range(3)]
    holder = {"file": tmp_path / "screen.png", "pil": shots[0].copy(), "numpy": np.array(shots[0]),
              "bytearray": bytearray(_png(shots[0]))}[kind]
    _overwrite(kind, holder, shots[0])
    session = M.ChatSession(model, processor, system="You are a GUI agent.", max_tokens=N)
    history = [{"role": "system", "content": "You are a GUI agent."}]
    for turn, text in enumerate(["Next.", "Next."]):  # the same call each turn
        if turn:
            _overwrite(kind, holder, shots[turn])
        tokens = [p.token for p in session.stream(text, images=[holder])]
        history.append(user(text, shots[turn]))
        want = fresh(model, processor, messages=history)
        assert tokens == want.token_ids, f"turn {turn + 1}"
        history.append({"role": "assistant", "content": session.messages[-1]["content"]})
        if turn:
            assert session.last.cached_tokens >= first_prompt
        first_prompt = session.last.prompt_tokens
    _overwrite(kind, holder, shots[2])
    tokens = [p.token for p in session.stream("And now?")]
    assert tokens == fresh(model, processor, messages=history + [user("And now?")]).token_ids
    assert session.last.cached_tokens >= first_prompt


def test_chat_session_keeps_each_turns_video_file_as_sent(loaded, tmp_path):
    """The same for a video file overwritten in place between turns."""
    import shutil

    from conftest import write_fixture_video

    model, processor = loaded["tiny-b"]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    _, clip_a = write_fixture_video(tmp_path / "a")
    _, clip_b = write_fixture_video(tmp_path / "b", reverse=True)
    screen = tmp_path / "screen.mkv"
    session = M.ChatSession(model, processor, max_tokens=N)
    history = []
    for text, clip in (("What happens?", clip_a), ("What happens?", clip_b)):
        shutil.copyfile(clip, screen)
        tokens = [p.token for p in session.stream(text, videos=[screen])]
        history.append({"role": "user", "content": [{"type": "video", "video": str(clip)},
                                                    {"type": "text", "text": text}]})
        assert tokens == fresh(model, processor, messages=history).token_ids, text
        history.append({"role": "assistant", "content": session.messages[-1]["content"]})
    assert session.last.cached_tokens > 0
