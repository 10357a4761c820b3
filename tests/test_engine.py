"""The library's engine (mlx_qwen3vl.engine): continuous batching through its API, the prefill
budget (a screenshot's prefill spread over steps while a stream decodes, the vision tower split
below whole blocks), memory admission, the prefix cache's index, entries sized to their tokens,
and time limits, and a lone screenshot's tower evaluated stage by stage. Every answer is compared
with generate() on the same conversation."""

import importlib
import re

import numpy as np
import pytest
from PIL import Image

import mlx.core as mx
import mlx_qwen3vl as M
from conftest import FIXTURES, case_inputs, load_fixture_model, reference, rel_err
from mlx_qwen3vl.engine import Done, Engine, Request, Token
from mlx_qwen3vl.engine.caches import PrefixCache
from mlx_qwen3vl.errors import InputError
from mlx_qwen3vl.kv_settings import KVSettings
from mlx_qwen3vl.generate import encode_prompt
from mlx_qwen3vl.spans import media_keys, reusable_prefix
from mlx_qwen3vl.vision import vision_items

MEDIA = FIXTURES / "media"


@pytest.fixture(scope="module")
def processor():
    return M.Processor.from_pretrained(FIXTURES / "tiny-a")


def image(name):
    return Image.open(MEDIA / name)


def conversation(text, *images):
    return [{"role": "user", "content": [*({"type": "image", "image": i} for i in images),
                                         {"type": "text", "text": text}]}]


def request(processor, messages, **params):
    return Request(encode_prompt(processor, messages=messages), M.SamplingParams(**params))


def drive(engine, until=None, on_step=None, out=None):
    """Step until `until(out)` (or nothing is left); → {id: [events]} (added to `out` when given)."""
    out = {} if out is None else out
    while engine.busy and not (until and until(out)):
        for ev in engine.step():
            out.setdefault(ev.id, []).append(ev)
        if on_step:
            on_step(out)
    return out


def tokens_of(events):
    return [e.token for e in events if isinstance(e, Token)]


def done_of(events):
    return next(e for e in events if isinstance(e, Done))


@pytest.mark.parametrize("backend", ["mlx", None])  # the plain graph (steps queued ahead) and the CPU path
def test_requests_join_and_leave_mid_decode_each_equal_generate(processor, backend, on_cpu):
    model = load_fixture_model("tiny-a", backend=backend)
    asks = [(conversation("Describe the picture.", image("img_123x77.png")), dict(max_tokens=30)),
            (conversation("Tell me more, slowly." + " please" * 5),
             dict(max_tokens=30, temperature=1.0, seed=5, ignore_eos=True)),
            (conversation("Where is it?", image("img_300x200.png")), dict(max_tokens=10, repetition_penalty=1.3)),
            (conversation("Say something."), dict(max_tokens=30, ignore_eos=True, stop=["zz"]))]
    wants = [M.generate(model, processor, messages=m, **p) for m, p in asks]
    engine = Engine(model, processor, max_batch=4, prefill_budget=96, prefix_cache_bytes=1 << 26,
                    feature_cache_bytes=1 << 24)
    ids = [engine.add(request(processor, asks[0][0], **asks[0][1]))]
    # Request 1 joins after request 0 has 3 tokens, request 2 after 6; request 3 is cancelled after 2.
    plan = {3: 1, 6: 2}
    cancelled_after = 2
    cancelled = []

    def on_step(out):
        got = len(tokens_of(out.get(ids[0], [])))
        if got in plan and len(ids) == plan[got]:
            k = plan[got]
            ids.append(engine.add(request(processor, asks[k][0], **asks[k][1])))
            if k == 2:
                ids.append(engine.add(request(processor, asks[3][0], **asks[3][1])))
        if len(ids) == 4 and len(tokens_of(out.get(ids[3], []))) == cancelled_after and not cancelled:
            engine.cancel(ids[3])
            cancelled.append(ids[3])

    out = drive(engine, on_step=on_step)
    for k in range(3):
        assert tokens_of(out[ids[k]]) == wants[k].token_ids, k
        assert done_of(out[ids[k]]).text == wants[k].text and done_of(out[ids[k]]).finish_reason == wants[k].finish_reason
    stopped = done_of(out[ids[3]])
    assert stopped.finish_reason == "cancelled"
    assert stopped.token_ids == wants[3].token_ids[:len(stopped.token_ids)]
    assert cancelled_after <= len(stopped.token_ids) < len(wants[3].token_ids)
    assert max(int(k) for k in engine.stats()["decode_steps_by_batch_size"]) >= 3  # rows did decode together
    # Request 1 joined mid-decode: request 0 got tokens in the steps before and with its first token,
    # and right after (a step queued ahead hands out nothing when the step before read its tokens).
    steps = list(engine.log)
    first = next(i for i, s in enumerate(steps) if ids[1] in s.tokens)
    assert ids[0] in steps[first - 1].tokens and ids[0] in steps[first].tokens
    assert ids[0] in steps[first + 1].tokens + steps[first + 2].tokens


def test_a_first_token_goes_out_in_the_step_of_its_prefill_and_lookahead_changes_no_token(processor):
    """On the plain graph each decode step is queued before the previous one's tokens are read
    (lookahead). A request's first token still goes out in the step that ran its prefill, not a
    decode step later (time to first token), and every token, log-probability and top
    log-probability is the one handed out without lookahead: rows finishing at different steps,
    one joining mid-decode, one wanting top log-probabilities."""
    model = load_fixture_model("tiny-a", backend="mlx")
    asks = [(conversation("Describe the picture.", image("img_123x77.png")), dict(max_tokens=9, ignore_eos=True)),
            (conversation("Say something."), dict(max_tokens=3, ignore_eos=True, top_logprobs=3)),
            (conversation("Where is it?", image("img_300x200.png")), dict(max_tokens=5, ignore_eos=True))]
    runs = {}
    for lookahead in (True, False):
        engine = Engine(model, processor, max_batch=4, lookahead=lookahead)
        ids, out, first_step, running = [], {}, {}, []
        for step in range(40):
            if len(ids) < len(asks) and (not ids or len(tokens_of(out.get(ids[0], []))) >= 2 * len(ids)):
                ids.append(engine.add(request(processor, asks[len(ids)][0], **asks[len(ids)][1])))
                first_step[ids[-1]] = step
            for ev in engine.step():
                out.setdefault(ev.id, []).append(ev)
            if len(ids) > 1 and step == first_step[ids[-1]]:  # a request joined: the running one's tokens
                running.append((len(tokens_of(out[ids[0]])), step - first_step[ids[0]]))
            if not engine.busy:
                break
        for rid in ids:  # its first token came with the step it was added before (nothing else was prefilling)
            got = [e for e in out[rid] if isinstance(e, Token)]
            assert got and first_step[rid] == next(i for i, s in enumerate(engine.log) if rid in s.tokens), rid
        runs.setdefault("running", []).append(running)
        runs[lookahead] = [[(e.token, e.logprob, e.top_logprobs, np.asarray(e.logprobs)) for e in out[rid]
                            if isinstance(e, Token)] for rid in ids]
        # every token but the first ones came from a decode step, each counted once
        runs[lookahead].append(sum(int(k) * v for k, v in engine.stats()["decode_steps_by_batch_size"].items()))
    # A step that prefilled hands out the token its decode made before the prefill, queued ahead or
    # not: the running request has its first token and one from each step since.
    assert all(len(r) == 2 and all(got == 1 + steps for got, steps in r) for r in runs["running"])
    queued, plain = runs[True], runs[False]
    assert [len(r) for r in queued[:3]] == [9, 3, 5] and queued[-1] == plain[-1] == 9 + 3 + 5 - 3
    assert all(len(t[2]) == 3 for t in queued[1]) and not queued[0][0][2]
    for a, b in zip(queued[:3], plain[:3]):  # the rows shared other batches: float rounding apart
        assert [t[0] for t in a] == [t[0] for t in b]
        assert [[u for u, _ in t[2]] for t in a] == [[u for u, _ in t[2]] for t in b]
        assert np.allclose([t[1] for t in a], [t[1] for t in b], atol=1e-5)
        assert np.allclose([[p for _, p in t[2]] for t in a], [[p for _, p in t[2]] for t in b], atol=1e-5)
        assert all(np.allclose(x[3], y[3], atol=1e-5) and x[1] == x[3][x[0]] for x, y in zip(a, b))


def test_with_lookahead_every_read_is_queued_before_the_work_queued_after_it(processor, monkeypatch):
    """A read queued behind other work waits for it: in every step, the tokens to hand out are
    queued before any batch's next decode (a float and an 8-bit batch), and this step's tokens
    before any prefill chunk (a budgeted prefill runs asynchronously while rows decode); each
    Token's row of log-probabilities is evaluated or queued with it."""
    batch_mod, core, prefill_mod = (importlib.import_module(f"mlx_qwen3vl.engine.{m}") for m in ("batch", "core", "prefill"))
    order = []
    for owner, name, mark in ((core.Engine, "_queue_reads", "R"), (batch_mod.Batch, "decode", "D"),
                              (prefill_mod.PrefillJob, "_run_one", "P"), (core.Engine, "_step", "|")):
        def logged(*a, _f=getattr(owner, name), _m=mark, **k):
            order.append(_m)
            return _f(*a, **k)
        monkeypatch.setattr(owner, name, logged)
    evaluated = {}  # every array the engine evaluates or queues, by identity (held, so no id is reused)

    def recorded(f):
        def run(*arrays):
            evaluated.update((id(a), a) for a in arrays if isinstance(a, mx.array))
            return f(*arrays)
        return run
    monkeypatch.setattr(core.mx, "eval", recorded(mx.eval))
    monkeypatch.setattr(core.mx, "async_eval", recorded(mx.async_eval))
    model = load_fixture_model("tiny-a", backend="mlx")
    engine = Engine(model, processor, max_batch=4, lookahead=True, prefill_budget=64)
    ask = lambda text, n, kv=None: Request(encode_prompt(processor, messages=conversation(text)),  # noqa: E731
                                           M.SamplingParams(max_tokens=n, ignore_eos=True), kv=kv)
    ids = [engine.add(ask("Say something.", 12)), engine.add(ask("Say more things.", 12, KVSettings.build(8, 32, 0)))]
    out = drive(engine, until=lambda out: len(tokens_of(out.get(ids[0], []))) >= 3)
    ids.append(engine.add(ask("word " * 300, 2)))
    drive(engine, out=out)
    steps = "".join(order).split("|")[1:]
    assert sum(s.count("P") > 1 for s in steps) >= 2 and any("DD" in s for s in steps)  # spread; two batches
    bad = [s for s in steps if not re.fullmatch("R*D*R*P*", s)]
    assert not bad, bad
    for rid, n in zip(ids, (12, 12, 2)):
        assert len(tokens_of(out[rid])) == n and tokens_of(out[rid]) == done_of(out[rid]).token_ids
    # and each Token's row of log-probabilities was queued with its token (reading it waits for no later step)
    assert all(evaluated.get(id(e.logprobs)) is e.logprobs for events in out.values() for e in events
               if isinstance(e, Token))


def test_screenshot_prefill_is_spread_over_steps_while_a_stream_decodes(processor):
    """A 2-megapixel screenshot arrives while one stream decodes: its prefill (vision split below
    whole blocks, then prompt chunks) spreads over many steps, each within the budget, the stream
    gets a token every one of them, so its longest gap (one step's prefill share plus a decode) is
    far under a quarter of that prefill's whole work; both answers are generate()'s."""
    model = load_fixture_model("tiny-a")
    rng = np.random.default_rng(3)
    shot = Image.fromarray(rng.integers(0, 255, (1080, 1920, 3), dtype=np.uint8))
    stream = (conversation("Tell a long story."), dict(max_tokens=200, ignore_eos=True))
    big = (conversation("Click the search box.", shot), dict(max_tokens=4))
    budget_tokens = 8192
    engine = Engine(model, processor, prefill_budget=budget_tokens)
    s = engine.add(request(processor, stream[0], **stream[1]))
    drive(engine, until=lambda out: len(tokens_of(out.get(s, []))) >= 3)
    big_request = request(processor, big[0], **big[1])
    assert big_request.inputs["input_ids"].shape[1] > 2000
    b = engine.add(big_request)
    start = len(engine.log)
    out = drive(engine, until=lambda out: b in out)
    during = list(engine.log)[start:]
    total = sum(r.prefill_flops for r in during)
    budget = budget_tokens * engine.costs.token
    assert all(r.budget == budget and r.prefill_flops <= budget for r in during)
    assert all(s in r.tokens for r in during)  # the stream got a token every step
    decode = engine.costs.chunk(1, 4096)
    assert len(during) >= 8 and max(r.prefill_flops for r in during) + decode < total / 4
    drive(engine, out=out)
    assert tokens_of(out[b]) == M.generate(model, processor, messages=big[0], **big[1]).token_ids
    assert len(tokens_of(out[s])) >= 3


@pytest.mark.parametrize("case", ["two_images", "video"])
def test_vision_split_below_blocks_equals_the_whole_tower(case, backend):
    """Items of at most a quarter of one window's attention (query chunks of a window, row chunks
    of every other stage; a piece of one row or one query where even that is over) give the whole
    tower's features (float32 summation order aside) and transformers' recorded ones."""
    model = load_fixture_model("tiny-a", backend=backend)
    inputs, ref = case_inputs(case), reference("tiny-a", case)
    kind, px, grid = (("video", "pixel_values_videos", "video_grid_thw") if case == "video"
                      else ("image", "pixel_values", "image_grid_thw"))
    whole = model.visual(mx.array(inputs[px]), inputs[grid])
    vc = model.config.vision_config
    budget = max(i.cost / i.window[1] for i in vision_items(vc, inputs[grid]) if i.stage == "attend") / 4
    items = vision_items(vc, inputs[grid], budget)
    smallest = {"tap": vc.spatial_merge_size**2, "merge": vc.spatial_merge_size**2}
    assert all(i.cost <= budget or i.end - i.start <= smallest.get(i.stage, 1) for i in items)
    assert sum(i.stage == "attend" and i.end - i.start < i.window[2] for i in items) > 0  # queries split
    assert sum(i.stage == "out" and i.block == 0 for i in items) > 1  # rows split
    run = model.visual.start(mx.array(inputs[px]), inputs[grid])
    for item in items:
        mx.eval(model.visual.run(run, item))
    merged, deepstack = model.visual.finish(run)
    for got, want, name in zip([merged, *deepstack], [whole[0], *whole[1]], ["embeds", "deepstack_0", "deepstack_1"]):
        assert rel_err(got, want) < 1e-5
        assert rel_err(got, ref[f"{kind}_{name}"]) < 1e-4


def test_admission_waits_for_memory_and_refuses_what_never_fits(processor):
    model = load_fixture_model("tiny-a")
    asks = [conversation("Describe the picture.", image("img_123x77.png")), conversation("And this one?")]
    per_token = Engine(model, processor).kv_per_token
    n0 = encode_prompt(processor, messages=asks[0])["input_ids"].shape[1]
    # Room for the first request alone (its prompt and 8 tokens, in one 256-position buffer step),
    # not for both together.
    from mlx_lm.models.cache import KVCache

    from mlx_qwen3vl.engine.core import CACHE_STEP

    assert CACHE_STEP == KVCache.step == 256 and n0 + 8 <= 256
    engine = Engine(model, processor, kv_budget_bytes=256 * per_token)
    a, b = (engine.add(request(processor, m, max_tokens=8)) for m in asks)
    out = drive(engine, until=lambda out: True if engine.log else False)  # one step
    assert engine.stats()["running"] + engine.stats()["prefilling"] == 1 and engine.stats()["waiting"] == 1
    drive(engine, out=out)
    log = list(engine.log)
    last_a = max(i for i, s in enumerate(log) if a in s.tokens)
    assert min(i for i, s in enumerate(log) if b in s.tokens) >= last_a  # b started once a had left
    assert all(b not in s.prefilling for s in log[:last_a])
    for rid, m in zip((a, b), asks):
        assert tokens_of(out[rid]) == M.generate(model, processor, messages=m, max_tokens=8).token_ids
    with pytest.raises(InputError, match="KV cache"):
        engine.add(request(processor, asks[0], max_tokens=4000))


def test_answers_stop_at_the_context_on_every_entry_point(processor, monkeypatch):
    """A prompt 5 tokens short of the model's context (lowered to keep it small): generate,
    batch_generate, ChatSession and the engine (beside a row far from it) stop there with
    finish_reason "length", token for token the plain run's answer; a max_tokens past any KV budget
    is then no refusal; a prompt that fills the context is one ContextLengthError, at add."""
    model = load_fixture_model("tiny-a")
    messages, short = conversation("Tell me a long story about the sea."), conversation("Hi.")
    n = encode_prompt(processor, messages=messages)["input_ids"].shape[1]
    plain = M.generate(model, processor, messages=messages, max_tokens=5, ignore_eos=True)
    beside = M.generate(model, processor, messages=short, max_tokens=3, ignore_eos=True)
    monkeypatch.setattr(model.config.text_config, "max_position_embeddings", n + 5)
    got = M.generate(model, processor, messages=messages, max_tokens=10**9, ignore_eos=True)
    assert (got.token_ids, got.finish_reason) == (plain.token_ids, "length")
    asks = [dict(messages=messages, max_tokens=40), dict(messages=short, max_tokens=3)]
    batch = M.batch_generate(model, processor, asks, ignore_eos=True)
    want = [(plain.token_ids, "length"), (beside.token_ids, "length")]
    assert [(r.token_ids, r.finish_reason) for r in batch] == want
    session = M.ChatSession(model, processor, max_tokens=40, ignore_eos=True)
    assert session.send("Tell me a long story about the sea.") == plain.text
    assert session.last.finish_reason == "length"
    with pytest.raises(M.ContextLengthError, match=f"context is {n + 5}"):
        session.send("And then?")
    engine = Engine(model, processor)
    ids = [engine.add(request(processor, messages, max_tokens=40, ignore_eos=True)),
           engine.add(request(processor, short, max_tokens=3, ignore_eos=True))]
    out = drive(engine)
    assert [(tokens_of(out[i]), done_of(out[i]).finish_reason) for i in ids] == want
    assert [e.finish_reason for e in out[ids[0]] if isinstance(e, Token)][-1] == "length"
    monkeypatch.setattr(model.config.text_config, "max_position_embeddings", n)
    with pytest.raises(M.ContextLengthError, match=f"prompt is {n} tokens but the model's context is {n}"):
        Engine(model, processor).add(request(processor, messages))


def _linear_scan(entries, inputs):
    """The prefix cache's lookup before its index: every entry's reusable prefix, the longest."""
    return max((reusable_prefix(tokens, media, inputs) for tokens, media in entries), default=0)


def test_prefix_index_finds_what_a_scan_of_every_entry_finds(processor):
    """Entries made to break a token-only index: the same tokens with another image of the same
    size, prefixes of each other, the image moved, a longer text after the same image; every
    lookup's length equals the linear scan's (the old rule), and its entry serves that length."""
    a, b = image("img_300x200.png"), Image.fromarray(255 - np.asarray(image("img_300x200.png").convert("RGB")))
    c = image("img_123x77.png")
    convos = [conversation("Where is the button?", a), conversation("Where is the button?", b),
              conversation("Where is the button?"), conversation("Where is the button? Tell me.", a),
              conversation("Where", a), conversation("Where is the button?", c, a),
              conversation("Where is the button?", a) + [{"role": "assistant", "content": "Here."}]
              + conversation("Now this one.", b)]
    inputs = [encode_prompt(processor, messages=m) for m in convos]
    cache = PrefixCache(1 << 30)
    model = load_fixture_model("tiny-a")
    held = []
    for k in (0, 2, 4, 5, 6):  # the entries: whole prompts (+ a fake answer) of some conversations
        tokens = inputs[k]["input_ids"][0].tolist() + [7, 8]
        caches = model.make_cache()
        for layer in caches:
            layer.update_and_fetch(*[mx.zeros((1, 2, len(tokens), 32))] * 2)
        cache.insert(tokens, media_keys(inputs[k]), caches)
        held.append((tokens, media_keys(inputs[k])))
    assert len(cache.entries) == 5
    for x in inputs:
        eid, n = cache.lookup(x)
        assert n == _linear_scan(held, x)
        if n:
            e = cache.entries[eid]
            assert reusable_prefix(e.tokens, e.media, x) == n
    # Same tokens, other pixels: only the text before the image; the image itself is reused.
    assert cache.lookup(inputs[1])[1] < cache.lookup(inputs[0])[1] == inputs[0]["input_ids"].shape[1] - 1


def test_prefix_entries_hold_only_their_tokens(processor):
    """A max_tokens=1 request (its cache straight from the prefill, a 256-position buffer) and one
    that leaves a batch of two are each kept in exactly their prompt and answer's positions."""
    model = load_fixture_model("tiny-a")
    t = model.config.text_config
    per_position = t.num_hidden_layers * 2 * t.num_key_value_heads * t.head_dim * 4
    engine = Engine(model, processor, prefix_cache_bytes=1 << 30)
    short = engine.add(request(processor, conversation("Hi"), max_tokens=1))
    out = drive(engine)
    n = done_of(out[short]).prompt_tokens
    [entry] = engine.prefix.entries.values()
    assert len(entry.tokens) == n and entry.nbytes == n * per_position
    long_ = engine.add(request(processor, conversation("Tell a long story, please."), max_tokens=20, ignore_eos=True))
    other = engine.add(request(processor, conversation("Bye now"), max_tokens=5, ignore_eos=True))
    out = drive(engine)
    for rid in (long_, other):
        d = done_of(out[rid])
        held = d.prompt_tokens + len(d.token_ids) - 1
        entry = next(e for e in engine.prefix.entries.values() if e.tokens[:d.prompt_tokens] ==
                     encode_prompt(processor, messages=conversation(
                         "Tell a long story, please." if rid == long_ else "Bye now"))["input_ids"][0].tolist())
        assert len(entry.tokens) == held and entry.nbytes == held * per_position


def test_time_limit_ends_running_and_waiting_requests(processor):
    """With a clock of its own: a decoding request past its limit ends with finish_reason
    "time_limit" and its text so far (a prefix of generate()'s), one still waiting ends without
    work, one within its limit runs on."""
    model = load_fixture_model("tiny-a")
    now = [0.0]
    engine = Engine(model, processor, max_batch=1, max_request_seconds=10, clock=lambda: now[0])
    ask = conversation("Tell a long story.")
    want = M.generate(model, processor, messages=ask, max_tokens=50, ignore_eos=True)
    slow = engine.add(request(processor, ask, max_tokens=50, ignore_eos=True))
    queued = engine.add(request(processor, conversation("Hi"), max_tokens=5))
    patient = engine.add(Request(encode_prompt(processor, messages=conversation("Hello")),
                                 M.SamplingParams(max_tokens=3), time_limit=100))
    out = drive(engine, until=lambda out: len(tokens_of(out.get(slow, []))) >= 5)
    now[0] = 11.0
    drive(engine, out=out)
    ended = done_of(out[slow])
    assert ended.finish_reason == "time_limit" and 5 <= len(ended.token_ids) < 50
    assert ended.token_ids == want.token_ids[:len(ended.token_ids)] and want.text.startswith(ended.text)
    assert done_of(out[queued]).finish_reason == "time_limit" and tokens_of(out[queued]) == []
    assert done_of(out[patient]).finish_reason == "length" and len(tokens_of(out[patient])) == 3


def test_server_ends_a_request_past_its_time_limit_and_refuses_one_that_never_fits(processor, capsys):
    """The server's model thread: a request still generating after --max-request-seconds ends with
    finish_reason "time_limit" and what it had generated; one whose KV cache exceeds the budget
    gets a 400 naming it; bad values of the new flags exit 2 with one line."""
    pytest.importorskip("starlette")
    import asyncio

    from mlx_qwen3vl.server.__main__ import build_parser, main
    from mlx_qwen3vl.server.model_thread import ModelThread as ServerEngine
    from mlx_qwen3vl.server.prepared import DoneEvent, ErrorEvent, Prepared, TokenEvent

    model = load_fixture_model("tiny-a")
    inputs = encode_prompt(processor, messages=conversation("Tell a long story."))
    n = inputs["input_ids"].shape[1]

    def answer(engine, max_tokens):
        loop = asyncio.new_event_loop()
        try:
            handle = engine.submit(Prepared(inputs=inputs, tokens=inputs["input_ids"][0].tolist(), media=[],
                                            sampling=M.SamplingParams(ignore_eos=True), max_tokens=max_tokens), loop)

            async def events():
                got = []
                while not got or isinstance(got[-1], TokenEvent):
                    got.append(await asyncio.wait_for(handle.queue.get(), 120))
                return got

            return loop.run_until_complete(events())
        finally:
            engine.close()
            loop.close()

    got = answer(ServerEngine(model, processor, max_request_seconds=0.3), 3500)
    assert isinstance(got[-1], DoneEvent) and got[-1].finish_reason == "time_limit"
    assert 0 < got[-1].completion_tokens == len(got) - 1 < 3500
    per_token = Engine(model, processor).kv_per_token
    got = answer(ServerEngine(model, processor, kv_cache_bytes=(n + 10) * per_token), 100)
    assert isinstance(got[-1], ErrorEvent) and got[-1].error.status == 400 and "KV cache" in got[-1].error.message
    assert build_parser().parse_args(["--model", "m"]).max_request_seconds == 600
    for flag, value in (("--max-request-seconds", "-1"), ("--prefill-budget", "-5"), ("--kv-cache-gb", "0")):
        assert main(["--model", str(FIXTURES / "tiny-a"), flag, value]) == 2
        assert capsys.readouterr().err.startswith(f"error: {flag}")


def test_one_request_object_added_twice_gets_two_answers_and_is_left_as_it_was(processor):
    """An agent loop that keeps one Request and adds it again (a retry, a second sample) gets a new
    id and its own answer each time, and its Request is not changed by add; an id the caller
    chooses that a live request holds is refused."""
    model = load_fixture_model("tiny-a", backend="mlx")
    messages = conversation("Where is the menu?", image("img_123x77.png"))
    want = M.generate(model, processor, messages=messages, max_tokens=6, ignore_eos=True)
    req = request(processor, messages, max_tokens=6, ignore_eos=True)
    engine = Engine(model, processor, max_batch=4)
    a, b = engine.add(req), engine.add(req)
    assert a != b and req.id is None and req.tokens is None and req.params.max_tokens == 6
    with pytest.raises(InputError, match=f"request id {a} is already in use"):
        engine.add(Request(req.inputs, req.params, id=a))
    out = drive(engine)
    assert tokens_of(out[a]) == tokens_of(out[b]) == want.token_ids


@pytest.mark.parametrize("name,backend", [("tiny-a", "mlx"), ("tiny-a", "cpu-all"), ("tiny-moe", "cpu-all")])
def test_short_prompts_waiting_together_are_prefilled_in_one_forward_each_equal_alone(name, backend, monkeypatch,
                                                                                     on_cpu):
    """Text prompts arriving together go through one packed forward per cache kind (float, 8-bit,
    4-bit, each row's positions its own: one continues a cached prefix that holds an image, so its
    text positions carry a rope delta), rows of very different lengths (6 to ~150 new tokens)
    finishing at different steps (one at its prefill); each answer equals generate() on its
    conversation alone. The final layer's MLP runs on each row's last position only."""
    from conftest import cpu_path_for_every_size

    if backend == "cpu-all":
        cpu_path_for_every_size(monkeypatch)
    model = load_fixture_model(name, backend=backend)
    processor = M.Processor.from_pretrained(FIXTURES / name)
    kvs = [{}, dict(kv_bits=8, kv_group_size=32, quantized_kv_start=0), dict(kv_bits=4, kv_group_size=32,
                                                                              quantized_kv_start=0)]
    first = conversation("Describe the picture.", image("img_123x77.png"))
    engine = Engine(model, processor, max_batch=8, prefix_cache_bytes=1 << 26)
    rid = engine.add(request(processor, first, max_tokens=6, ignore_eos=True))
    turn1 = done_of(drive(engine)[rid])
    turn2 = first + [{"role": "assistant", "content": [{"type": "text", "text": turn1.text}]},
                     conversation("Tool result: clicked. What next?")[0]]
    asks = [(turn2, 7, 0), (conversation("Hello there, " * 4), 3, 0), (conversation("Short."), 1, 0),
            (conversation("Count to ten."), 5, 1), (conversation("Name a colour, please " * 3), 2, 1),
            (conversation("Why?"), 4, 2), (conversation("Tell me a story about a cat."), 6, 2),
            (conversation("Read this log: " + "step 7 failed, retrying; " * 24), 3, 0)]
    wants = [M.generate(model, processor, messages=m, max_tokens=n, ignore_eos=True, **kvs[k]).token_ids
             for m, n, k in asks]
    final, seen = model.language_model.layers[-1], []
    call = type(final.mlp).__call__
    monkeypatch.setattr(type(final.mlp), "__call__",
                        lambda mlp, x: (mlp is final.mlp and seen.append(x.shape[1])) or call(mlp, x))
    ids = [engine.add(Request(encode_prompt(processor, messages=m), M.SamplingParams(max_tokens=n, ignore_eos=True),
                              kv=KVSettings.build(**kvs[k]))) for m, n, k in asks]
    out = drive(engine)
    assert [tokens_of(out[i]) for i in ids] == wants
    assert max(seen) <= len(asks)  # a packed forward's final layer ran each row's last position only
    assert done_of(out[ids[0]]).cached_tokens > turn1.prompt_tokens - 2  # its prefix came from the cache
    assert engine.metrics["prefills_together"] == 3 and engine.metrics["prefilled_together"] == len(asks)


def test_a_lone_requests_vision_tower_is_evaluated_stage_by_stage(processor, monkeypatch, on_cpu):
    """The engine runs a screenshot's tower (nothing else decoding: the whole tower in one step) as
    its stages, each evaluated before the next is built, so their intermediates are never held
    together as one lazy graph (the full-depth 1080p peak, benchmarks/README.md "Vision memory");
    the features equal the model's own whole-tower call."""
    from mlx_qwen3vl.weights import load_model

    model = load_model(FIXTURES / "tiny-a", dtype="float32", backend="mlx")
    inputs = case_inputs("image")
    want = model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
    order, made, features = [], [], []
    run, evaluate, finish = model.visual.run, mx.eval, model.visual.finish

    def staged(state, item):
        assert all(evaluated for _, evaluated in made), "a stage was built before the one before it ran"
        out = run(state, item)
        made.extend([a, False] for a in out)
        order.append(item.stage)
        return out

    def counted(*arrays):
        flat = [a for x in arrays for a in (x if isinstance(x, (list, tuple)) else [x])]
        for entry in made:
            entry[1] = entry[1] or any(entry[0] is a for a in flat)
        return evaluate(*arrays)

    monkeypatch.setattr(model.visual, "run", staged)
    monkeypatch.setattr(model.visual, "finish", lambda state: features.append(finish(state)) or features[-1])
    monkeypatch.setattr(mx, "eval", counted)
    M.generate(model, processor, inputs=inputs, max_tokens=1)
    monkeypatch.undo()
    blocks = len(model.visual.blocks)
    assert order[0] == "embed" and order[-1] == "merge" and order.count("attend") == blocks
    assert all(evaluated for _, evaluated in made)
    # the same features, to the bit, as the model's own whole-tower call
    (merged, deepstack), = features
    assert np.array_equal(np.array(merged), np.array(want.embeds))
    assert all(np.array_equal(np.array(a), np.array(b)) for a, b in zip(deepstack, want.deepstack, strict=True))
