"""Quantized KV caches (kv_bits / kv_group_size / quantized_kv_start) and caches on
disk (ChatSession.save / load, the prefix cache's disk tier).

Every quantized answer is compared token for token with a fresh `generate(kv_bits=...)` of the
same conversation: through ChatSession, prefix reuse, batches of mixed cache kinds, the engine
(rows joining, leaving and moving to the quantized batch mid-decode) and the server. Against the
float cache, 8-bit logits are held to a stated bound on a long prompt with images. Saved files
are refused (one line) or skipped (one warning) in every bad case: another model, dtype or KV
settings, truncated, corrupted, not ours."""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

import mlx_qwen3vl as M
from conftest import FIXTURES, load_fixture_model, rel_err
from mlx_qwen3vl import cache_file
from mlx_qwen3vl.engine import Done, Engine, Request, Token
from mlx_qwen3vl.errors import InputError
from mlx_qwen3vl.generate import encode_prompt
from mlx_qwen3vl.kv_settings import KVSettings, resolve

ROOT = FIXTURES.parents[1]
MEDIA = FIXTURES / "media"


@pytest.fixture(scope="module")
def processor():
    return M.Processor.from_pretrained(FIXTURES / "tiny-a")


def shot(seed, size=(96, 64)):
    """A random same-size 'screenshot' per seed."""
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def user(text, *images):
    return {"role": "user", "content": [{"type": "image", "image": i} for i in images] + [{"type": "text", "text": text}]}


def kinds_of(caches):
    return caches[0].kind


# ------------------------------------------------------------------------------------- settings
def test_settings_are_checked_and_a_group_size_that_does_not_divide_is_chosen_down():
    for bad, needle in [(dict(kv_bits=3), "kv_bits = 3"), (dict(kv_bits=True), "kv_bits = True"),
                        (dict(kv_bits=8, kv_group_size=48), "kv_group_size = 48"),
                        (dict(kv_bits=8, quantized_kv_start=-1), "quantized_kv_start = -1")]:
        with pytest.raises(InputError, match=needle):
            KVSettings.build(**bad)
    assert KVSettings.build(kv_bits=8).fit(32) == KVSettings(8, 32, 5000)  # the tiny checkpoints' head_dim
    assert KVSettings.build(kv_bits=4, kv_group_size=128).fit(128) == KVSettings(4, 128, 5000)
    with pytest.raises(InputError, match="cannot be quantized"):
        KVSettings.build(kv_bits=8, kv_group_size=32).fit(48)
    model = load_fixture_model("tiny-a")
    with pytest.raises(TypeError, match="kv_bit"):  # a misspelt keyword is not silently float
        M.generate(model, M.Processor.from_pretrained(FIXTURES / "tiny-a"), "Hi", kv_bit=8)


def test_numpy_quantization_is_mlx_quantize_bit_for_bit():
    """The CPU decode stack quantizes each new key and value itself (cpu/decode.quantize_rows)."""
    from mlx_qwen3vl.cpu.decode import dequantize_rows, quantize_rows

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((3, 4, 128)) * rng.uniform(0.01, 20, (3, 4, 1))).astype(np.float32)
    x[0, 0, :32] = 0  # a group of zeros, a constant group
    x[0, 1, :32] = 1.5
    for bits in (4, 8):
        for gs in (32, 64, 128):
            data, scales, biases, back = quantize_rows(x, gs, bits)
            want = mx.quantize(mx.array(x), group_size=gs, bits=bits)
            for got, ref in zip((data, scales, biases), want):
                np.testing.assert_array_equal(got, np.array(ref))
            np.testing.assert_array_equal(back, np.array(mx.dequantize(*want, group_size=gs, bits=bits)))
            np.testing.assert_array_equal(dequantize_rows(data.view(np.uint8), scales, biases, gs, bits), back)


@pytest.mark.parametrize("bits", [4, 8])
def test_attention_over_the_packed_cache_is_attention_over_its_values(bits):
    """The MLX graph's (mlx-lm's quantized attention) and the CPU decode stack's (numpy and C)
    read the packed cache as it is, and give what float attention over its values gives."""
    from mlx_qwen3vl.cpu import decode
    from mlx_qwen3vl.language import Attention

    rng = np.random.default_rng(bits)
    B, H, Hkv, hd, S = 2, 4, 2, 32, 1500  # S past one numpy block
    k, v = (mx.array(rng.standard_normal((B, Hkv, S + 1, hd)).astype(np.float32) * 3) for _ in range(2))
    q = rng.standard_normal((B, H, 1, hd)).astype(np.float32)
    kq, vq = (tuple(mx.quantize(a, group_size=32, bits=bits)) for a in (k, v))
    kd, vd = (np.array(mx.dequantize(*t, group_size=32, bits=bits)) for t in (kq, vq))
    want = np.array(mx.fast.scaled_dot_product_attention(mx.array(q), mx.array(kd), mx.array(vd), scale=0.2, mask=None))
    attn = Attention.__new__(Attention)
    attn.scale = 0.2
    got = attn.attend_quantized(mx.array(q), kq, vq, None, bits, 32)
    assert rel_err(got, want) < 1e-5
    # the whole buffers, as the decode stack passes them: capacity S + 1, the first S positions read
    packed = lambda t: (np.array(t[0]).view(np.uint8), np.array(t[1]), np.array(t[2]))  # noqa: E731
    qkv = np.concatenate([q[:, :, 0], kd[:, :, S], vd[:, :, S]], axis=1)
    for ops in (decode.NumpyOps, decode.native) if decode.native is not None else (decode.NumpyOps,):
        out = np.empty((B, H * hd), np.float32)
        decode.attend_quantized(ops, qkv, H, Hkv, hd, packed(kq), packed(vq), S, 0.2, bits, 32, out)
        assert rel_err(out, want.reshape(B, -1)) < 1e-5, ops


# ------------------------------------------------------------------------------------- precision
# Measured on tiny-a (random weights, so sharp attention): the worst rel_err of 8-bit against float
# over the prefill's last logits and 16 teacher-forced decode steps was 0.060 (the CPU path as on
# the 2B model; the plain MLX graph: 0.059). The bound is under twice that.
KV8_BOUND = 0.11


def test_kv8_logits_stay_within_a_bound_of_the_float_cache_on_a_long_prompt_with_images(monkeypatch, on_cpu):
    """~2k tokens: four screenshots and a long history; 333-token prefill chunks cross the image
    spans, quantized_kv_start falls inside the third screenshot."""
    from conftest import cpu_path_for_every_size
    from mlx_qwen3vl.engine import decode_step, prefill
    from mlx_qwen3vl.kv_settings import quantize_if_due
    from mlx_qwen3vl.spans import media_spans

    cpu_path_for_every_size(monkeypatch)
    model = load_fixture_model("tiny-a", backend="cpu-all")
    processor = M.Processor.from_pretrained(FIXTURES / "tiny-a")
    base = np.asarray(Image.open(MEDIA / "img_300x200.png").convert("RGB").resize((480, 320)))
    history = " ".join(f"Step {i}: the user clicked button {i} and waited." for i in range(35))
    messages = [user("What changed between the screens? " + history, base, 255 - base, np.roll(base, 100, axis=1),
                     base[::-1].copy())]
    inputs = encode_prompt(processor, messages=messages, max_pixels=480 * 320)
    spans = media_spans(inputs)
    start = 400
    assert inputs["input_ids"].shape[1] > 2000 and len(spans) == 4 and spans[2].start < start < spans[2].end
    assert any(m.start < c < m.end for m in spans for c in (333, 666))
    runs = {}
    for bits in (None, 8):
        kv = resolve(model, KVSettings(bits, 64, start))
        cache = model.make_cache()
        logits, position = prefill(model, inputs, cache, kv=kv, prefill_step_size=333)
        out = [np.array(logits)]
        for i in range(16):
            token = int(np.argmax(out[-1])) if bits is None else runs[None][1][i]
            logits = decode_step(model, mx.array([token]), cache, position)
            quantize_if_due(cache, kv)
            position = position + 1
            out.append(np.array(logits))
        runs[bits] = (np.concatenate(out), [int(np.argmax(o)) for o in out])
        assert kinds_of(cache) == (None if bits is None else (8, 32))
    errors = [rel_err(q, f) for q, f in zip(runs[8][0], runs[None][0])]
    assert 0 < max(errors) < KV8_BOUND, errors


# ------------------------------------------------------------------------------------- answers
@pytest.mark.parametrize("bits, fixture", [(8, "tiny-a"), (4, "tiny-a"), (8, "tiny-moe")])
def test_chat_session_and_batches_equal_fresh_generate(processor, bits, fixture):
    """Three turns of same-size but different screenshots; the cache turns quantized inside turn
    1's prompt, so turn 2 and 3 reuse a quantized prefix as it is. Then batch_generate with rows of
    every kind (float, 8-bit, 4-bit, one crossing quantized_kv_start mid-decode). MoE too."""
    model = load_fixture_model(fixture, backend="mlx")
    kw = dict(kv_bits=bits, quantized_kv_start=90, max_tokens=10)
    session = M.ChatSession(model, processor, system="You are a GUI agent.", **kw)
    for text, image in (("Where is the search box?", shot(1)), ("Now click it.", shot(2)), ("And again.", shot(1))):
        got = [p.token for p in session.stream(text, images=[image])]
        want = M.generate(model, processor, messages=session.messages[:-1], **kw)
        assert got == want.token_ids
        assert session.prompt_cache.cache[0].kind == (bits, 32)
    assert session.last.cached_tokens > 90  # a quantized prefix reused
    requests = [dict(messages=[user("Describe.", shot(3))], kv_bits=bits, quantized_kv_start=40),
                dict(prompt="Tell me a story about it please. " * 3, kv_bits=12 - bits, quantized_kv_start=20),
                dict(prompt="Hello there.", max_tokens=24),
                dict(prompt="Hi " * 10, kv_bits=bits, quantized_kv_start=30, max_tokens=30, ignore_eos=True)]
    got = M.batch_generate(model, processor, requests, max_tokens=16)
    for r, g in zip(requests, got):
        assert g.token_ids == M.generate(model, processor, **{"max_tokens": 16, **r}).token_ids


@pytest.mark.parametrize("backend", ["mlx", "cpu-all"])  # steps queued ahead; the CPU decode stack
def test_engine_rows_of_each_kind_join_leave_and_move_each_equal_generate(processor, backend, request):
    """Float, 8-bit and 4-bit rows decode side by side (one batch per kind); the 8-bit rows begin
    float and move to the 8-bit batch when they reach quantized_kv_start, mid-decode; rows join
    while others decode (prefill in budgeted chunks) and leave; later requests reuse quantized
    and float prefixes from the prefix cache."""
    if backend == "cpu-all":
        request.getfixturevalue("on_cpu")
        from conftest import cpu_path_for_every_size

        cpu_path_for_every_size(request.getfixturevalue("monkeypatch"))
    model = load_fixture_model("tiny-a", backend=backend)
    turn = [user("Where is the menu?", shot(4))]
    length = lambda m: encode_prompt(processor, messages=m)["input_ids"].shape[1]  # noqa: E731
    kv8 = KVSettings(8, 32, length(turn) + 8)  # reached mid-decode by requests 0 and 3
    kv4 = KVSettings(4, 32, length([user("Where?", shot(5))]) - 5)  # reached in the prefill
    chatter = next([user("Hi there " * k)] for k in range(1, 200) if length([user("Hi there " * k)]) > kv8.start - 25)
    asks = [(turn, kv8, dict(max_tokens=24, ignore_eos=True)),
            ([user("Say something long.")], None, dict(max_tokens=20, ignore_eos=True)),
            ([user("Where?", shot(5))], kv4, dict(max_tokens=12, temperature=1.0, seed=3)),
            (chatter, kv8, dict(max_tokens=40, ignore_eos=True))]
    assert length(chatter) < kv8.start < length(chatter) + 40
    wants = [M.generate(model, processor, messages=m, **p, **(kv.as_dict() if kv else {})) for m, kv, p in asks]
    engine = Engine(model, processor, max_batch=4, prefill_budget=48, prefix_cache_bytes=1 << 26)
    out, kinds_seen = {}, set()
    ids = [engine.add(Request(encode_prompt(processor, messages=m), M.SamplingParams(**p), kv=kv))
           for m, kv, p in asks[:2]]
    while engine.busy:
        for ev in engine.step():
            out.setdefault(ev.id, []).append(ev)
        kinds_seen |= {b.kind for b in engine.batches.values() if b.rows}
        if len(ids) < len(asks) and len([e for e in out.get(ids[0], []) if isinstance(e, Token)]) >= 2 * len(ids):
            m, kv, p = asks[len(ids)]
            ids.append(engine.add(Request(encode_prompt(processor, messages=m), M.SamplingParams(**p), kv=kv)))
    assert kinds_seen == {None, (8, 32), (4, 32)}
    for rid, want in zip(ids, wants):
        assert [e.token for e in out[rid] if isinstance(e, Token)] == want.token_ids, rid
    # The next turn of request 0 (quantized, > 60 positions) and of request 1 (float) reuse their entries.
    answer0 = next(e for e in out[ids[0]] if isinstance(e, Done)).text
    follow = [(turn + [{"role": "assistant", "content": answer0}, user("Then?")], kv8),
              ([user("Say something long.")], kv8)]  # a float entry serves an 8-bit request up to its start
    for messages, kv in follow:
        want = M.generate(model, processor, messages=messages, max_tokens=8, **kv.as_dict())
        rid = engine.add(Request(encode_prompt(processor, messages=messages), M.SamplingParams(max_tokens=8), kv=kv))
        events = [ev for ev in engine.run() if ev.id == rid]
        done = next(e for e in events if isinstance(e, Done))
        assert done.token_ids == want.token_ids and done.cached_tokens > 0
    assert engine.stats()["kv_cache"]["bytes"] == 0 and engine.prefix.stats()["hits"] >= 2


def test_quantized_kv_start_is_honoured(processor):
    """Prefill chunks end at quantized_kv_start and the cache turns quantized there; a decoding
    row moves to the quantized batch at the step its cache reaches it, not before; a start past
    the answer leaves the cache float (the same log-probabilities as without kv_bits)."""
    from mlx_qwen3vl.engine import PrefillJob

    model = load_fixture_model("tiny-a", backend="mlx")
    messages = [user("Look at this. " * 6, shot(6))]
    inputs = encode_prompt(processor, messages=messages)
    n = inputs["input_ids"].shape[1]
    kv = resolve(model, KVSettings(8, 64, 30))
    job = PrefillJob(model, inputs, model.make_cache(), prefill_step_size=16, kv=kv)
    sizes = []
    while not job.done:
        job._run_one(None, evaluate=True)  # one item: the vision tower, then 16-token chunks
        sizes.append((job.cache[0].size(), job.cache[0].kind))
    assert n > 40 and (16, None) in sizes and (30, (8, 32)) in sizes and sizes[-1] == (n, (8, 32))
    assert all(kind == (None if size < 30 else (8, 32)) for size, kind in sizes)

    start = n + 5
    engine = Engine(model, processor, kv_bits=8, quantized_kv_start=start)
    rid = engine.add(Request(inputs, M.SamplingParams(max_tokens=12, ignore_eos=True)))
    moved_at = None
    while engine.busy:
        engine.step()
        for kind, batch in engine.batches.items():
            if batch.rows and kind is not None and moved_at is None:
                moved_at = batch.length(0)
    assert moved_at == start  # the row's cache holds exactly quantized_kv_start positions when it moves
    never = M.generate(model, processor, messages=messages, max_tokens=10, kv_bits=8, quantized_kv_start=n + 10)
    float_ = M.generate(model, processor, messages=messages, max_tokens=10)
    assert never.logprobs == float_.logprobs and never.kv_cache_bytes == float_.kv_cache_bytes
    always = M.generate(model, processor, messages=messages, max_tokens=10, kv_bits=8, quantized_kv_start=0)
    # float32 keys: 128 bytes per head and position; 8-bit in groups of 32: 32 + two float32 per group
    assert always.logprobs != float_.logprobs and always.kv_cache_bytes * 128 == float_.kv_cache_bytes * 40
    del rid


# ------------------------------------------------------------------------------------- on disk
RESUME = """
import json, sys
import mlx_qwen3vl as M
from mlx_qwen3vl.weights import load_model
model = load_model(sys.argv[1], backend="mlx")
processor = M.Processor.from_pretrained(sys.argv[1])
out = []
for path in sys.argv[2:]:
    session = M.ChatSession.load(path, model, processor)
    tokens = [p.token for p in session.stream("And now the next one.")]
    out.append({"tokens": tokens, "cached": session.last.cached_tokens, "prompt": session.last.prompt_tokens})
print(json.dumps(out))
"""


def test_a_saved_session_answers_its_next_turn_in_a_new_process_as_the_live_one(processor, tmp_path):
    model = load_fixture_model("tiny-a", backend="mlx")
    sessions, paths, prompts = [], [], []
    for bits in (None, 8):
        s = M.ChatSession(model, processor, system="You are a GUI agent.", max_tokens=8, kv_bits=bits,
                          quantized_kv_start=70, max_pixels=96 * 64)
        s.send("Where is the search box?", images=[shot(7)])
        s.send("Now this one.", images=[np.asarray(shot(8))], max_pixels=64 * 64)  # a turn of its own setting
        prompts.append(s.last.prompt_tokens)
        path = tmp_path / f"session-{bits}.safetensors"
        s.save(path)
        assert oct(path.stat().st_mode & 0o777) == "0o600"
        sessions.append(s)
        paths.append(path)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MLX_QWEN3VL_CPU_KERNELS": "mlx"}
    p = subprocess.run([sys.executable, "-c", RESUME, str(FIXTURES / "tiny-a"), *map(str, paths)], capture_output=True,
                       text=True, cwd=ROOT, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    resumed = json.loads(p.stdout)
    for s, r, before in zip(sessions, resumed, prompts):
        live = [piece.token for piece in s.stream("And now the next one.")]
        # The history is cached, as in the live session: every position up to the last answer
        # (whose random text need not tokenize again as it was generated).
        assert r["tokens"] == live and r["cached"] == s.last.cached_tokens >= before and r["prompt"] == s.last.prompt_tokens


def test_bad_session_files_are_refused_with_one_line(processor, tmp_path):
    model = load_fixture_model("tiny-a", backend="mlx")
    s = M.ChatSession(model, processor, max_tokens=4, kv_bits=8, quantized_kv_start=20)
    s.send("Where is it?", images=[shot(9)])
    good = tmp_path / "good.safetensors"
    s.save(good)
    data = good.read_bytes()
    (n,) = np.frombuffer(data[:8], "<u8")
    header = data[8:8 + int(n)]
    cases = {}
    cases["truncated"] = data[:-100]
    flipped = bytearray(data)
    flipped[len(data) - 50] ^= 0xFF  # a byte of a tensor
    cases["corrupted"] = bytes(flipped)
    cases["tokens edited"] = data.replace(b"Where", b"There") if b"Where" in header else data[:-1]
    cases["another class"] = data[:8] + header.replace(b'"1.0":"QuantizedKVCache"', b'"1.0":"RotatingKVCache"') + data[8 + n:]
    cases["not a cache file"] = (FIXTURES / "tiny-a" / "model-00001-of-00005.safetensors").read_bytes()
    cases["garbage"] = b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}"
    for name, content in cases.items():
        bad = tmp_path / f"{name}.safetensors"
        bad.write_bytes(content)
        with pytest.raises(cache_file.CacheFileError) as e:
            M.ChatSession.load(bad, model, processor)
        assert "\n" not in str(e.value) and str(bad) in str(e.value), name
    others = [(load_fixture_model("tiny-b", backend="mlx"), {}, "another model"),
              (load_fixture_model("tiny-a", dtype="float16", backend="mlx"), {}, "dtype"),
              (model, {"kv_bits": 4}, "4-bit"), (model, {"kv_bits": 8, "quantized_kv_start": 30}, "from 30")]
    for other, expect, needle in others:
        with pytest.raises(cache_file.CacheFileError, match=needle) as e:
            M.ChatSession.load(good, other, processor, **expect)
        assert "\n" not in str(e.value)
    loaded = M.ChatSession.load(good, model, processor, kv_bits=8, quantized_kv_start=20)
    assert loaded.messages[1]["content"] == s.messages[1]["content"]
    # An interrupted save leaves the file it would have replaced as it was, and no temporary file.
    import mlx_lm.models.cache as mlx_lm_cache

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    before = good.read_bytes()
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(mlx_lm_cache, "save_prompt_cache", broken)
    try:
        with pytest.raises(OSError):
            s.save(good)
    finally:
        monkeypatch.undo()
    assert good.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("."))== []


def test_disk_tier_serves_a_restarted_engine_and_skips_bad_files_with_one_warning(processor, tmp_path):
    model = load_fixture_model("tiny-a", backend="mlx")
    folder = tmp_path / "prefixes"
    kw = dict(kv_bits=8, quantized_kv_start=50, prefix_cache_bytes=1 << 26, prefix_cache_dir=folder)
    turn = [user("Where is the menu?", shot(10))]
    engine = Engine(model, processor, **kw)
    engine.add(Request(encode_prompt(processor, messages=turn), M.SamplingParams(max_tokens=8)))
    first = next(e for e in engine.run() if isinstance(e, Done))
    assert engine.prefix.stats()["disk"]["writes"] == 1 and oct(folder.stat().st_mode & 0o777) == "0o700"
    [entry] = folder.iterdir()
    assert oct(entry.stat().st_mode & 0o777) == "0o600"
    # Beside it: a copy cut short, one of another model, one of other KV settings, one corrupted.
    (folder / ("cut" + entry.name)).write_bytes(entry.read_bytes()[:-10])
    other = Engine(load_fixture_model("tiny-b", backend="mlx"), processor, prefix_cache_bytes=1 << 26,
                   prefix_cache_dir=tmp_path / "b")
    other.add(Request(encode_prompt(processor, messages=turn), M.SamplingParams(max_tokens=2)))
    list(other.run())
    for f in (tmp_path / "b").iterdir():
        f.rename(folder / ("b" + f.name))
    float_tier = Engine(model, processor, prefix_cache_bytes=1 << 26, prefix_cache_dir=tmp_path / "f")
    float_tier.add(Request(encode_prompt(processor, messages=turn), M.SamplingParams(max_tokens=2)))
    list(float_tier.run())
    for f in (tmp_path / "f").iterdir():
        f.rename(folder / ("f" + f.name))
    corrupt = bytearray(entry.read_bytes())
    corrupt[-20] ^= 0xFF
    entry.write_bytes(bytes(corrupt))
    warnings = []
    from mlx_qwen3vl.engine import disk

    restarted = Engine(model, processor, **kw)
    restarted.prefix.disk.warn = warnings.append  # the start's warnings went to stderr: count them again
    assert restarted.prefix.disk.skipped == 3 and len(restarted.prefix.disk.files) == 1
    again = disk.DiskTier(folder, 1 << 30, model, restarted.kv, warn=warnings.append)
    assert len(warnings) == 3 and all("\n" not in w for w in warnings)
    assert any("truncated" in w for w in warnings) and any("another model" in w for w in warnings)
    assert any("8-bit" in w for w in warnings)
    follow = turn + [{"role": "assistant", "content": first.text}, user("Then?")]
    want = M.generate(model, processor, messages=follow, max_tokens=8, kv_bits=8, quantized_kv_start=50)
    # The corrupted entry is found by its header, refused when read (checksum): one warning, computed afresh.
    restarted.add(Request(encode_prompt(processor, messages=follow), M.SamplingParams(max_tokens=8)))
    done = next(e for e in restarted.run() if isinstance(e, Done))
    assert done.token_ids == want.token_ids and done.cached_tokens == 0
    assert len(warnings) == 4 and "corrupted" in warnings[-1]
    # The entry the restarted engine wrote serves the next restart.
    third = Engine(model, processor, **kw)
    third.add(Request(encode_prompt(processor, messages=follow), M.SamplingParams(max_tokens=8)))
    done = next(e for e in third.run() if isinstance(e, Done))
    assert done.token_ids == want.token_ids and done.cached_tokens == done.prompt_tokens - 1
    del again


# ------------------------------------------------------------------------------------- the server
def data_url(image) -> str:
    import base64
    import io

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image;base64," + base64.b64encode(buf.getvalue()).decode()


def test_server_kv_bits_per_request_settings_metrics_and_a_restart_from_the_disk_tier(tmp_path):
    """--kv-bits 8 with a request asking 4 bits beside it, /metrics, a bad per-request value, then
    a restart on the same --prefix-cache-dir (with a file of another kind dropped in it): the
    known conversation's next turn reuses its history from disk. Answers equal generate()."""
    pytest.importorskip("openai")
    from test_server import KEY, Server

    model, processor = load_fixture_model("tiny-a"), M.Processor.from_pretrained(FIXTURES / "tiny-a")
    folder = tmp_path / "prefixes"
    args = ("--api-key", KEY, "--kv-bits", "8", "--quantized-kv-start", "40", "--prefix-cache-dir", str(folder))
    image = shot(12)
    turn = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                         {"type": "text", "text": "Where is the menu?"}]}]
    local = [user("Where is the menu?", image)]
    server = Server(*args)
    try:
        client = server.client()
        r8 = client.chat.completions.create(model="m", messages=turn, max_tokens=8, temperature=0)
        want8 = M.generate(model, processor, messages=local, max_tokens=8, kv_bits=8, quantized_kv_start=40)
        assert r8.choices[0].message.content == want8.text and r8.usage.completion_tokens == len(want8.token_ids)
        r4 = client.chat.completions.create(model="m", messages=turn, max_tokens=8, temperature=0,
                                            extra_body={"kv_bits": 4, "quantized_kv_start": 10})
        want4 = M.generate(model, processor, messages=local, max_tokens=8, kv_bits=4, quantized_kv_start=10)
        assert r4.choices[0].message.content == want4.text
        status, body = server.request("POST", "/v1/chat/completions", {"messages": turn, "kv_bits": 3})
        assert status == 400 and body["error"]["param"] == "kv_bits" and "4 or 8" in body["error"]["message"]
        metrics = server.metrics()
        assert metrics["kv_cache"]["settings"] == {"kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": 40}
        assert metrics["kv_cache"]["bytes"] == 0 and metrics["prefix_cache"]["disk"]["folder"] == str(folder)
        assert metrics["prefix_cache"]["entries"] == 2  # one per cache kind
        # Concurrent 8-bit requests of different lengths: rows leave the quantized batch while
        # others decode (before the fix the CPU decode stack failed the others with a 500).
        asks = [("Hi.", 3), ("Tell me a long story.", 12), ("Where is the menu?", 6), ("Say more.", 9)]
        kv0 = {"kv_bits": 8, "quantized_kv_start": 0}

        def ask(a):
            return server.client().chat.completions.create(
                model="m", messages=[{"role": "user", "content": a[0]}], max_tokens=a[1], temperature=0,
                extra_body=kv0).choices[0].message.content

        before = server.metrics()["decode_steps_by_batch_size"]
        with ThreadPoolExecutor(len(asks)) as pool:
            answers = list(pool.map(ask, asks))
        for (text, n), got in zip(asks, answers):
            assert got == M.generate(model, processor, messages=[{"role": "user", "content": text}], max_tokens=n,
                                     **kv0).text
        after = server.metrics()["decode_steps_by_batch_size"]
        assert sum(v - before.get(k, 0) for k, v in after.items() if int(k) >= 2) > 0  # decoded together
    finally:
        server.stop()  # SIGTERM: what was not written yet is written on the way out
    assert len(list(folder.iterdir())) == 1  # the 8-bit entry; the 4-bit request's stays in memory
    (folder / "junk.kv.safetensors").write_bytes(b"\x20" + bytes(64))
    follow = turn + [{"role": "assistant", "content": r8.choices[0].message.content},
                     {"role": "user", "content": "Then?"}]
    want = M.generate(model, processor, messages=local + [{"role": "assistant", "content": want8.text}, user("Then?")],
                      max_tokens=8, kv_bits=8, quantized_kv_start=40)
    server = Server(*args)
    try:
        r = server.client().chat.completions.create(model="m", messages=follow, max_tokens=8, temperature=0)
        assert r.choices[0].message.content == want.text
        assert r.usage.prompt_tokens_details.cached_tokens > 40  # the history, read back from the folder
        assert server.metrics()["prefix_cache"]["disk"]["hits"] == 1
    finally:
        server.stop()
    warnings = [line for line in server.log if "warning" in line]
    assert len(warnings) == 1 and "junk.kv.safetensors" in warnings[0], server.log


def test_server_refuses_the_disk_tier_under_several_ranks_and_a_bad_kv_flag(monkeypatch, capsys):
    from test_distributed import FakeGroup

    from mlx_qwen3vl import distributed
    from mlx_qwen3vl.server.__main__ import main

    monkeypatch.setattr(distributed, "world", lambda: FakeGroup(2, 0))
    assert main(["--model", str(FIXTURES / "tiny-a"), "--prefix-cache-dir", "/tmp/nowhere-kvq"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--prefix-cache-dir is not available under mlx.launch" in err[0]
    with pytest.raises(SystemExit) as e:
        main(["--model", str(FIXTURES / "tiny-a"), "--kv-bits", "3"])
    assert e.value.code == 2 and "--kv-bits: invalid choice: 3" in capsys.readouterr().err


def test_per_request_kv_settings_reach_every_rank(processor):
    """The request's settings travel in the orders rank 0 broadcasts (server/replica.py)."""
    from mlx_qwen3vl.server import replica
    from mlx_qwen3vl.server.fetch import MediaPolicy
    from mlx_qwen3vl.server.grammar import GrammarFactory
    from mlx_qwen3vl.server.model_inputs import PromptBuilder
    from mlx_qwen3vl.server.chat import parse_chat_request

    class Engine:  # what PromptBuilder reads
        context, default_max_tokens = 4096, 16

    Engine.processor = processor
    tok = processor.tokenizer
    grammars = GrammarFactory(tok, 448, tok.eos_token_id)
    req = parse_chat_request({"messages": [{"role": "user", "content": "Hi"}], "kv_bits": 4, "kv_group_size": 32})
    handle = replica._Ghost(PromptBuilder(Engine(), MediaPolicy(), grammars).build(req), 3)
    got = replica.decode(replica.encode(replica.Orders(admit=[handle])), grammars).admit[0].prepared
    assert got.kv == {"kv_bits": 4, "kv_group_size": 32}
    assert got.request(3, KVSettings(8, 64, 100)).kv == KVSettings(4, 32, 100)
    assert got.request(3).kv == KVSettings(4, 32, 5000)
