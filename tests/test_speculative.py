"""Speculative decoding in the engine (engine/speculative.py): every drafter (prompt lookup, the
oracle, one that is always wrong) leaves greedy answers token for token the plain run's — on the
dense fixture with an image and on the MoE one, alone and in a batch with rows of different k,
under float and 8-bit KV (quantized from the start, and from mid-answer), on the CPU path and the
plain graph (steps queued ahead), under prefix reuse and in a ChatSession across turns; stop
strings, EOS and max_tokens cut where the plain run does; sampled answers keep the plain
distribution (chi-square over the exact joint distribution of three tokens); drop_last on every
cache kind; bad drafters and arguments get one clear line."""

import math

import conftest  # noqa: F401  (first: it loads the optimized BLAS before mlx.core)
import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

import mlx_qwen3vl as M
from conftest import FIXTURES, load_fixture_model
from mlx_qwen3vl.engine import Done, Engine, Failed, Request, Token
from mlx_qwen3vl.engine.speculative import GrammarForced, Oracle, PromptLookup, Wrong
from mlx_qwen3vl.errors import ConfigError, InputError
from mlx_qwen3vl.generate import encode_prompt
from mlx_qwen3vl.kv_settings import KVSettings

MEDIA = FIXTURES / "media"


@pytest.fixture(scope="module")
def processor():
    return M.Processor.from_pretrained(FIXTURES / "tiny-a")


def user(text, *images):
    return [{"role": "user", "content": [{"type": "image", "image": i} for i in images] + [{"type": "text", "text": text}]}]


def asks():
    """A picture and a repetitive text (prompt lookup finds matches in both the prompt and the answer)."""
    return [user("Describe the picture.", Image.open(MEDIA / "img_123x77.png")),
            user("one two three one two three one two three, and then?")]


KV = {"float": {}, "8-bit": dict(kv_bits=8, kv_group_size=32, quantized_kv_start=0),
      "8-bit mid-answer": "mid"}


def kv_args(kind, messages, processor):
    if KV[kind] == "mid":  # the cache turns quantized a few tokens into the answer
        n = encode_prompt(processor, messages=messages)["input_ids"].shape[1]
        return dict(kv_bits=8, kv_group_size=32, quantized_kv_start=n + 5)
    return dict(KV[kind])


@pytest.mark.parametrize("kind", list(KV))
@pytest.mark.parametrize("fixture, backend", [("tiny-a", "mlx"), ("tiny-a", None), ("tiny-a", "cpu-all"),
                                              ("tiny-moe", "mlx"), ("tiny-moe", None)])
def test_greedy_answers_with_every_drafter_equal_the_plain_run(processor, on_cpu, monkeypatch, fixture, backend,
                                                               kind):
    """Per prompt, four rows in one batch: the oracle (k=4), prompt lookup (k=2), an always-wrong
    drafter (k=3) and no drafter; each row's tokens are the plain run's, the oracle's drafts are
    all kept, the wrong one's none. "cpu-all": the CPU path for every size, as on the 2B model
    (the verify forward's linears through the C extension's matmul_rows)."""
    if backend == "cpu-all":
        from conftest import cpu_path_for_every_size

        cpu_path_for_every_size(monkeypatch)
    model = load_fixture_model(fixture, backend=backend)
    prompts = asks() if backend != "mlx" or kind == "float" else asks()[1:]  # the plain graph's vision: seconds
    for messages in prompts:
        kv = kv_args(kind, messages, processor)
        want = M.generate(model, processor, messages=messages, max_tokens=24, ignore_eos=True, **kv)
        prompt = encode_prompt(processor, messages=messages)["input_ids"][0].tolist()
        rows = [dict(drafter=Oracle(prompt + want.token_ids), num_draft_tokens=4),
                dict(prompt_lookup=3, num_draft_tokens=2),
                dict(drafter=Wrong(model.config.text_config.vocab_size), num_draft_tokens=3),
                {}]
        got = M.batch_generate(model, processor, [dict(messages=messages, **r) for r in rows], max_tokens=24,
                               ignore_eos=True, **kv)
        for r, g in zip(rows, got):
            assert g.token_ids == want.token_ids, (r, kind)
            assert g.text == want.text
        oracle, lookup, wrong, plain = got
        assert oracle.draft_proposed > 0 and oracle.draft_accepted == oracle.draft_proposed
        assert wrong.draft_proposed > 0 and wrong.draft_accepted == 0
        assert lookup.draft_accepted <= lookup.draft_proposed and plain.draft_proposed == 0
        # The verify forward attends to a quantized cache as a prefill chunk does (the CPU path
        # unpacks a layer's keys for it), a decode step reads it packed: the same values, summed
        # in another order.
        assert oracle.logprobs == pytest.approx(want.logprobs, abs=1e-3 if kind == "float" else 2e-2)


@pytest.mark.parametrize("backend, seed", [(None, 0), ("mlx", 1)])
def test_random_schedule_with_drafters_each_equal_alone(processor, on_cpu, backend, seed):
    """A seeded random schedule: requests with random drafters (oracle, prompt lookup, wrong,
    none) and k, random cache kinds and quantized_kv_start, greedy or sampled, joining at random
    steps of a batch with a prefix cache; each greedy row's tokens equal the request run alone,
    each sampled row's are a valid answer of its length (its distribution: the chi-square test)."""
    import random

    rnd = random.Random(seed)
    model = load_fixture_model("tiny-a", backend=backend)
    words = "one two three the cat menu button click open close one two three".split()
    shot = Image.open(MEDIA / "img_123x77.png")
    asks = []
    for i in range(8):
        messages = user(" ".join(rnd.choice(words) for _ in range(rnd.randrange(2, 14))),
                        *([shot] if rnd.random() < 0.3 else []))
        params = dict(max_tokens=rnd.randrange(2, 20), ignore_eos=rnd.random() < 0.7)
        if rnd.random() < 0.25:
            params.update(temperature=1.0, seed=rnd.randrange(100))
        kv = rnd.choice([{}, dict(kv_bits=8, kv_group_size=32, quantized_kv_start=rnd.choice((0, 30, 45)))])
        asks.append((messages, params, kv, rnd.choice(("oracle", "lookup", "wrong", None)), rnd.randrange(1, 7),
                     rnd.choice((0, 0, 1, 2))))
    wants, requests = [], []
    for messages, params, kv, drafter, k, _ in asks:
        want = M.generate(model, processor, messages=messages, **params, **kv)
        wants.append(want)
        inputs = encode_prompt(processor, messages=messages)
        prompt = inputs["input_ids"][0].tolist()
        d = {"oracle": Oracle(prompt + want.token_ids), "lookup": PromptLookup(3),
             "wrong": Wrong(model.config.text_config.vocab_size), None: None}[drafter]
        requests.append(Request(inputs, M.SamplingParams(**params), kv=KVSettings.build(**kv) if kv else None,
                                **({"drafter": d, "num_draft_tokens": k} if d else {})))
    engine = Engine(model, processor, max_batch=rnd.choice((3, 8)), prefix_cache_bytes=1 << 24)
    ids, tokens, pending = {}, {}, list(range(len(asks)))
    while pending or engine.busy:
        for i in list(pending):
            if asks[i][5] == 0 or rnd.random() < 0.5:
                ids[engine.add(requests[i])] = i
                pending.remove(i)
        for ev in engine.step():
            assert not isinstance(ev, Failed), ev
            if isinstance(ev, Token):
                tokens.setdefault(ids[ev.id], []).append(ev.token)
    for i, (messages, params, kv, drafter, k, _) in enumerate(asks):
        if "temperature" in params:
            assert len(tokens[i]) == len(wants[i].token_ids) or not params["ignore_eos"]
        else:
            assert tokens[i] == wants[i].token_ids, (i, drafter, k, kv)


def test_stream_says_which_tokens_came_from_drafts_and_cuts_as_plain(processor, on_cpu):
    """stream_generate with the oracle: each piece's from_draft, the running counts, and the answer
    cut where the plain run cuts it: a stop string across a token boundary, max_tokens inside an
    accepted run of drafts, EOS."""
    model = load_fixture_model("tiny-a", backend="mlx")
    messages = asks()[0]
    prompt = encode_prompt(processor, messages=messages)["input_ids"][0].tolist()
    full = M.generate(model, processor, messages=messages, max_tokens=30, ignore_eos=True)
    tok = processor.tokenizer
    pieces = [tok.decode([t]) for t in full.token_ids]
    # A stop string made of the end of one token's text and the start of the next one's.
    i = next(i for i in range(6, len(pieces) - 1) if len(pieces[i]) > 1 and len(pieces[i + 1]) > 1)
    stop = pieces[i][-2:] + pieces[i + 1][:1]
    cases = [dict(max_tokens=30, ignore_eos=True, stop=[stop]), dict(max_tokens=7, ignore_eos=True),
             dict(max_tokens=30)]
    for params in cases:
        want = M.generate(model, processor, messages=messages, **params)
        streamed = list(M.stream_generate(model, processor, messages=messages, drafter=Oracle(prompt + full.token_ids),
                                          num_draft_tokens=4, **params))
        assert [p.token for p in streamed] == want.token_ids, params
        assert "".join(p.text for p in streamed) == want.text
        assert streamed[-1].finish_reason == want.finish_reason
        flags = [p.from_draft for p in streamed]
        assert not flags[0] and any(flags)  # the first token comes from the prefill
        assert streamed[-1].draft_accepted == sum(flags) <= streamed[-1].draft_proposed
    assert "stop" == M.generate(model, processor, messages=messages, stop=[stop], max_tokens=30,
                                ignore_eos=True, prompt_lookup=2).finish_reason


@pytest.mark.parametrize("backend", ["mlx", None])
def test_penalties_apply_at_every_verified_position(processor, on_cpu, backend):
    """Greedy rows with repetition / presence / frequency penalties, a logit bias against a token
    the plain answer has, min_tokens holding back a stop token (processors over the tokens so
    far): with drafters (the model drafting for itself proposes its unprocessed choice), the
    plain run's tokens."""
    model = load_fixture_model("tiny-a", backend=backend)
    messages = asks()[1]
    prompt = encode_prompt(processor, messages=messages)["input_ids"][0].tolist()
    base = M.generate(model, processor, messages=messages, max_tokens=20, ignore_eos=True).token_ids
    for params in (dict(repetition_penalty=1.3), dict(presence_penalty=0.7, frequency_penalty=0.4),
                   dict(logit_bias={base[3]: -100.0, 17: 4.0}), dict(min_tokens=10, stop_token_ids=[base[4]])):
        want = M.generate(model, processor, messages=messages, max_tokens=20, ignore_eos=True, **params)
        for drafting in (dict(drafter=Oracle(prompt + want.token_ids), num_draft_tokens=5), dict(prompt_lookup=2),
                         dict(draft_model=model, num_draft_tokens=4)):
            got = M.generate(model, processor, messages=messages, max_tokens=20, ignore_eos=True, **params, **drafting)
            assert got.token_ids == want.token_ids, (params, drafting)


def test_prefix_reuse_and_chat_session_across_turns(processor, on_cpu):
    """The engine's prefix cache holds what a drafting row left (the next request reusing it
    answers as plain), and a ChatSession with prompt lookup answers every turn as one without."""
    model = load_fixture_model("tiny-a", backend=None)
    messages = asks()[0]
    want = M.generate(model, processor, messages=messages, max_tokens=16, ignore_eos=True)
    engine = Engine(model, processor, max_batch=2, prefix_cache_bytes=1 << 26)
    inputs = encode_prompt(processor, messages=messages)
    prompt = inputs["input_ids"][0].tolist()
    for turn in range(2):
        rid = engine.add(Request(inputs, M.SamplingParams(max_tokens=16, ignore_eos=True),
                                 drafter=Oracle(prompt + want.token_ids), num_draft_tokens=3))
        events = list(engine.run())
        assert [e.token for e in events if isinstance(e, Token) and e.id == rid] == want.token_ids
    assert engine.prefix.reused_tokens > 0
    # The second request reused the first one's cache, answer included: a longer conversation.
    follow = messages + [{"role": "assistant", "content": want.text}, {"role": "user", "content": "And then?"}]
    want2 = M.generate(model, processor, messages=follow, max_tokens=12, ignore_eos=True)
    rid = engine.add(Request(encode_prompt(processor, messages=follow), M.SamplingParams(max_tokens=12, ignore_eos=True),
                             drafter=PromptLookup(2), num_draft_tokens=4))
    assert [e.token for e in engine.run() if isinstance(e, Token) and e.id == rid] == want2.token_ids

    plain = M.ChatSession(model, processor, max_tokens=12, ignore_eos=True)
    spec = M.ChatSession(model, processor, max_tokens=12, ignore_eos=True, prompt_lookup=3, num_draft_tokens=3)
    for text, images in (("Describe the picture.", [Image.open(MEDIA / "img_123x77.png")]),
                         ("Say it again, word for word.", []), ("Once more.", [Image.open(MEDIA / "img_90x260.png")])):
        assert spec.send(text, images=images) == plain.send(text, images=images)
        assert spec.last.generation_tokens == plain.last.generation_tokens
        assert spec.last.cached_tokens == plain.last.cached_tokens
    assert spec.last.draft_proposed > 0


def test_grammar_forced_tokens_are_proposed_and_always_kept(processor, on_cpu):
    """A JSON-schema answer (llguidance's mask as the request's processor): with GrammarForced
    drafting the schema's fixed keys, the plain grammar run's tokens; every forced draft is kept."""
    from mlx_qwen3vl.server.grammar import GrammarFactory

    model = load_fixture_model("tiny-a", backend=None)
    tok = processor.tokenizer
    grammars = GrammarFactory(tok, model.config.text_config.vocab_size, tok.eos_token_id)
    schema = {"type": "object", "properties": {"action": {"const": "left_click"}, "target": {"const": "search box"},
                                               "x": {"type": "integer"}},
              "required": ["action", "target", "x"], "additionalProperties": False}
    inputs = encode_prompt(processor, messages=asks()[1])
    params = M.SamplingParams(max_tokens=40)

    def run(drafting):
        engine = Engine(model, processor, max_batch=2)
        grammar = grammars.json_schema(schema)
        rid = engine.add(Request(inputs, params, processors=[grammar],
                                 **({"drafter": GrammarForced(grammar), "num_draft_tokens": 8} if drafting else {})))
        events = [e for e in engine.run() if e.id == rid]
        return [e.token for e in events if isinstance(e, Token)], events[-1]

    want, plain = run(False)
    got, done = run(True)
    assert got == want and done.text == plain.text
    assert done.draft_proposed > 5 and done.draft_accepted == done.draft_proposed


def _chi_square_bound(df: int, z: float = 3.09) -> float:
    """The chi-square distribution's upper 0.1% point (Wilson-Hilferty), df degrees of freedom."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("drafting", ["fixed", "draft model"])
def test_sampled_answers_keep_the_plain_distribution(processor, on_cpu, drafting):
    """Three sampled tokens (temperature 1.5, top_k 3: 27 possible answers) from N seeds, the
    second and third through the verify forward with a drafter proposing fixed tokens (q one-hot)
    or a draft model (the 4-bit tiny-a) drawing its drafts from its own distribution (q its probabilities),
    kept sometimes, rejected sometimes: their frequencies against the exact plain distribution,
    computed from the model's own forwards, by chi-square at the 0.1% level (cells with expected
    counts under 5 merged). Each request checks one draft, kept with probability
    sum_b min(p(b), q(b)) (for a one-hot q: p(draft)): the count kept against that expectation,
    computed from both models' forwards, at the same level. A rule that always kept drafts or
    resampled from p instead of the residual fails the first; one that ignored q (keeping a draft
    with p(d): exact, but keeping far fewer) fails the second, which the first cannot see."""
    from mlx_lm.sample_utils import apply_top_k

    model = load_fixture_model("tiny-a", backend="mlx")
    messages = user("one two three one two three")
    prompt = encode_prompt(processor, messages=messages)["input_ids"][0].tolist()
    temp, top_k, N = 1.5, 3, 1200 if drafting == "fixed" else 600  # the draft model's: 13 s at 1200

    def dist(prefix, model=model):
        logits = model(mx.array([prompt + prefix]))[0, -1:].astype(mx.float32)
        lp = apply_top_k(logits - mx.logsumexp(logits, axis=-1, keepdims=True), top_k) / temp
        p = np.asarray(mx.softmax(lp, axis=-1)[0])
        return {int(t): float(p[t]) for t in np.nonzero(p > 0)[0]}

    exact = {}
    for a, pa in dist([]).items():
        for b, pb in dist([a]).items():
            for c, pc in dist([a, b]).items():
                exact[(a, b, c)] = pa * pb * pc
    d1 = max(dist([max(dist([]), key=dist([]).get)]).items(), key=lambda x: x[1])[0]
    drafter = type("Fixed", (), {"propose": lambda self, ids, k: [d1, d1][:k]})()
    q = lambda a: {d1: 1.0}  # noqa: E731 — the distribution of the draft after the first token a
    if drafting == "draft model":
        from mlx_qwen3vl.engine.draft_model import DraftModel

        draft = load_fixture_model("mlxvlm-q4", backend="mlx")  # tiny-a in 4 bits: q near p
        drafter, q = DraftModel(draft), lambda a: dist([a], draft)
    kept = sum(pa * sum(min(pb, q(a).get(b, 0.0)) for b, pb in dist([a]).items()) for a, pa in dist([]).items())
    engine = Engine(model, processor, max_batch=64, prefix_cache_bytes=1 << 26)
    inputs = encode_prompt(processor, messages=messages)
    for seed in range(N):
        engine.add(Request(inputs, M.SamplingParams(max_tokens=3, temperature=temp, top_k=top_k, seed=seed,
                                                    ignore_eos=True), drafter=drafter, num_draft_tokens=2))
    counts, proposed, accepted = {}, 0, 0
    for ev in engine.run():
        if isinstance(ev, Done):
            counts[tuple(ev.token_ids)] = counts.get(tuple(ev.token_ids), 0) + 1
            proposed, accepted = proposed + ev.draft_proposed, accepted + ev.draft_accepted
        assert not isinstance(ev, Failed)
    assert set(counts) <= set(exact) and sum(counts.values()) == N
    assert 0 < accepted < proposed == N  # drafts were both kept and rejected
    assert abs(accepted - N * kept) < 3.29 * math.sqrt(N * kept * (1 - kept)), (accepted, N * kept)
    cells = sorted(exact, key=exact.get, reverse=True)
    big = [c for c in cells if exact[c] * N >= 5]
    small = [c for c in cells if exact[c] * N < 5]
    observed = [counts.get(c, 0) for c in big] + ([sum(counts.get(c, 0) for c in small)] if small else [])
    expected = [exact[c] * N for c in big] + ([sum(exact[c] for c in small) * N] if small else [])
    chi2 = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    assert chi2 < _chi_square_bound(len(observed) - 1), (chi2, len(observed))


def test_drop_last_on_every_cache_kind():
    """Rows losing different numbers of positions: each keeps exactly its first positions, rows stay
    right-aligned (padding grows by the difference), the key mask hides the padding."""
    from mlx_qwen3vl.cpu.decode import KVCache

    rng = np.random.default_rng(0)
    for quantized in (False, True):
        rows = []
        for n in (9, 6, 8):
            c = KVCache()
            c.update_and_fetch(*(mx.array(rng.standard_normal((1, 2, n, 32)).astype(np.float32)) for _ in "kv"))
            rows.append(c.to_quantized(32, 8) if quantized else c)
        batch = type(rows[0]).merge(rows)
        batch.drop_last([3, 1, 2])
        assert batch.size() == 8 and batch.padding() == [2, 3, 2]
        first = lambda c: c.keys[0] if quantized else c.keys  # noqa: E731
        for r, keep in zip(range(3), (6, 5, 6)):
            assert np.array_equal(np.asarray(first(batch.extract(r))), np.asarray(first(rows[r]))[:, :, :keep])
        assert np.asarray(batch.key_mask(0)).sum(axis=1).tolist() == [6, 5, 6]
        batch.drop_last([1, 1, 1])  # the same count for every row: a trim
        assert batch.size() == 7 and batch.padding() == [2, 3, 2]


def test_linear_of_a_few_rows_reads_the_weight_once_with_the_same_result(monkeypatch):
    """The CPU path's linear for 2..SMALL_ROWS rows (the C extension's matmul_rows over column
    ranges on several threads; more rows than one tile group holds go over the weight a panel at a
    time) equals numpy's matmul; one row and many rows keep numpy's."""
    from mlx_qwen3vl.cpu import kernels

    if kernels._native is None:
        pytest.skip("the C extension is not built")
    rng = np.random.default_rng(1)
    w = rng.standard_normal((1003, 300)).astype(np.float32)  # K not a multiple of 8, N odd
    for m in (1, 2, 5, 10, 13, 16, 17):
        a = rng.standard_normal((m, 300)).astype(np.float32)
        for n_threads in (1, 2, 3):
            monkeypatch.setattr(kernels.threads, "apply", lambda: n_threads)
            got = np.asarray(kernels.linear(mx.array(a), mx.array(w)))
            np.testing.assert_allclose(got, a @ w.T, rtol=1e-4, atol=1e-4)


def test_matmul_rows_tiles_at_every_row_count_with_either_vector_width():
    """The C extension's matmul_rows, its 8-lane loop (AVX2, tiles of up to 4 rows) and, where the CPU
    has it, its 16-lane one (AVX-512, up to 8), whichever this machine picks by itself: every row
    count from 1 to SMALL_ROWS, K leaving a tail of either width, an odd N, column ranges that
    cut a panel of weight rows; only the range asked for is written."""
    from mlx_qwen3vl.cpu import kernels

    if kernels._native is None:
        pytest.skip("the C extension is not built")
    rng = np.random.default_rng(2)
    lanes = [8]
    try:
        kernels._native.matmul_rows(np.zeros((1, 1), np.float32), np.zeros((1, 1), np.float32),
                                    np.zeros((1, 1), np.float32), 0, 1, 16)
        lanes.append(16)
    except ValueError:  # no AVX-512 here
        pass
    for K in (7, 300):
        w = rng.standard_normal((37, K)).astype(np.float32)
        for m in range(1, kernels.SMALL_ROWS + 1):
            a = rng.standard_normal((m, K)).astype(np.float32)
            want = a.astype(np.float64) @ w.T.astype(np.float64)
            for n0, n1 in ((0, 37), (5, 30)):
                for lane in lanes:
                    out = np.full((m, 37), np.nan, np.float32)
                    kernels._native.matmul_rows(a, w, out, n0, n1, lane)
                    np.testing.assert_allclose(out[:, n0:n1], want[:, n0:n1], rtol=1e-4, atol=1e-4)
                    assert np.isnan(out[:, :n0]).all() and np.isnan(out[:, n1:]).all()
    with pytest.raises(ValueError, match="lanes"):
        kernels._native.matmul_rows(a, w, out, 0, 37, 4)


def test_bad_drafters_and_arguments_get_one_line(processor, on_cpu):
    model = load_fixture_model("tiny-a", backend=None)
    messages = asks()[1]
    for bad in (dict(prompt_lookup=-1), dict(num_draft_tokens=1000, prompt_lookup=2), dict(drafter=object()),
                dict(prompt_lookup=2, draft_model=model)):
        with pytest.raises(InputError):
            M.generate(model, processor, messages=messages, **bad)
    out = type("PastVocabulary", (), {"propose": lambda self, ids, k: [10**6] * k})()
    with pytest.raises(InputError, match="outside the vocabulary"):
        M.generate(model, processor, messages=messages, max_tokens=5, drafter=out)
    # A drafter that fails fails its own request only; the batch's other row answers as plain.
    boom = type("Boom", (), {"propose": lambda self, ids, k: 1 / 0})()
    want = M.generate(model, processor, messages=messages, max_tokens=8, ignore_eos=True)
    engine = Engine(model, processor, max_batch=2)
    inputs = encode_prompt(processor, messages=messages)
    bad = engine.add(Request(inputs, M.SamplingParams(max_tokens=8, ignore_eos=True), drafter=boom))
    good = engine.add(Request(inputs, M.SamplingParams(max_tokens=8, ignore_eos=True), drafter=PromptLookup(2)))
    events = list(engine.run())
    assert [type(e.error) for e in events if isinstance(e, Failed)] == [ZeroDivisionError]
    assert all(e.id == bad for e in events if isinstance(e, Failed))
    assert [e.token for e in events if isinstance(e, Token) and e.id == good] == want.token_ids
    from mlx_qwen3vl.__main__ import main

    assert main(["--model", str(FIXTURES / "tiny-a"), "--draft-model", "x"]) == 2
    assert main(["--model", str(FIXTURES / "tiny-a"), "--draft-model", str(FIXTURES / "tiny-b"),
                 "--prompt-lookup", "2"]) == 2


def video(n=8):
    return np.load(MEDIA / "video_16x72x100.npy")[:n, :64, :96]


def test_draft_model_greedy_answers_equal_the_plain_run(processor, on_cpu):
    """A draft model (its own prefill of the prompt, image or video, its own caches): tiny-b (a
    different random checkpoint of the same tokenizer: its drafts are rejected) and the target
    itself (every draft kept: its prefill, positions and trimmed cache are right), in one batch
    with prompt lookup and plain rows of other k, finishing at different steps; float, 8-bit KV
    quantized from mid-answer and 4-bit from the start; the dense and the MoE target; each row's
    tokens are the plain run's."""
    target = load_fixture_model("tiny-a", backend=None)
    other = load_fixture_model("tiny-b", backend=None)
    shot = Image.open(MEDIA / "img_123x77.png")
    clip = [{"role": "user", "content": [{"type": "video", "video": video()},
                                         {"type": "text", "text": "What happens?"}]}]
    four = dict(kv_bits=4, kv_group_size=32, quantized_kv_start=0)
    for messages, kvs in ((user("Describe the picture, then describe it again.", shot), ({}, "mid", four)),
                          (clip, ({}, "mid"))):
        for kv in kvs:
            kv = kv_args("8-bit mid-answer", messages, processor) if kv == "mid" else kv
            want = M.generate(target, processor, messages=messages, max_tokens=20, ignore_eos=True, source_fps=8, **kv)
            # rows leaving the batch at different steps while the others go on drafting
            rows = [dict(draft_model=other, num_draft_tokens=3, max_tokens=13),
                    dict(draft_model=target, num_draft_tokens=4, max_tokens=20),
                    dict(draft_model=target, num_draft_tokens=3, max_tokens=7),
                    dict(prompt_lookup=2, num_draft_tokens=2, max_tokens=5), dict(max_tokens=16)]
            got = M.batch_generate(target, processor, [dict(messages=messages, source_fps=8, **r) for r in rows],
                                   ignore_eos=True, **kv)
            for r, g in zip(rows, got):
                assert g.token_ids == want.token_ids[:r["max_tokens"]], (r, kv)
            wrong, right = got[0], got[1]
            assert wrong.draft_proposed > 0 and wrong.draft_accepted < wrong.draft_proposed
            assert right.draft_proposed > 0 and right.draft_accepted == right.draft_proposed, kv
    moe = load_fixture_model("tiny-moe", backend=None)
    messages = user("one two three one two three")
    want = M.generate(moe, processor, messages=messages, max_tokens=16, ignore_eos=True)
    for draft in (target, moe):
        got = M.generate(moe, processor, messages=messages, max_tokens=16, ignore_eos=True, draft_model=draft)
        assert got.token_ids == want.token_ids
    assert got.draft_accepted == got.draft_proposed > 0


def test_a_draft_cut_back_after_rejections_proposes_as_a_fresh_one(processor, on_cpu, monkeypatch):
    """DraftRow.propose after the model rejected its drafts (its cache cut back with trim_to, float
    and 4-bit) proposes what a draft prefilled afresh with the same tokens proposes: the answers
    above are exact whatever the draft proposes, so only this sees a draft cache left uncut. The
    draft's prefill runs no LM head (nothing reads its last logits)."""
    from mlx_qwen3vl.backend import backend_of
    from mlx_qwen3vl.engine.draft_model import DraftModel
    from mlx_qwen3vl.sampling import Sampler
    from mlx_qwen3vl.spans import media_keys

    model = load_fixture_model("tiny-b", backend=None)
    draft, V = DraftModel(model, prefix_cache_bytes=0), model.config.text_config.vocab_size
    calls = []
    monkeypatch.setattr(model, "logits", lambda hidden, head=model.logits: calls.append(1) or head(hidden))
    prompt = encode_prompt(processor, messages=asks()[1])["input_ids"][0].tolist()

    def started(ids, kv):
        inputs = {"input_ids": np.array([ids]), "attention_mask": np.ones((1, len(ids)), np.int64),
                  "mm_token_type_ids": np.zeros((1, len(ids)), np.int64)}
        row = draft.start(Request(inputs, tokens=list(ids), media=media_keys(inputs)), kv)
        heads = len(calls)
        row.job.advance(None)
        assert len(calls) == heads
        row.begin(Sampler(M.SamplingParams()), backend_of(model).log_softmax)
        return row

    for kv in (KVSettings(), KVSettings.build(kv_bits=4, kv_group_size=32, quantized_kv_start=0)):
        row, ids = started(prompt, kv), prompt + [100]
        drafts = row.propose(ids, 4)
        for keep in (1, 0, 3):  # the model kept `keep` drafts, then chose another token
            ids = ids + drafts[:keep] + [(drafts[keep] + 1) % V]
            drafts = row.propose(ids, 4)
            assert drafts == started(ids[:-1], kv).propose(ids, 4), (kv, keep)


def test_draft_model_prefix_reuse_chat_session_and_plain_graph(processor, on_cpu, tmp_path):
    """The draft model's own prefix cache: a ChatSession's later turns prefill only what is new for
    the draft too (its entries reused), answers every turn as the plain session (and saves without
    the draft model, which changes no answer; given again to load, the loaded session drafts
    from the draft's kept caches); an engine's prefix cache and the draft's serve a repeated
    request, each without the other and both, answered as plain; on the plain graph (steps queued ahead) a drafting
    request answers as plain."""
    from mlx_qwen3vl.engine.draft_model import DraftModel

    target = load_fixture_model("tiny-a", backend=None)
    draft = DraftModel(target)
    plain = M.ChatSession(target, processor, max_tokens=10, ignore_eos=True)
    spec = M.ChatSession(target, processor, max_tokens=10, ignore_eos=True, draft_model=draft, num_draft_tokens=3)
    for text, images in (("Describe the picture.", [Image.open(MEDIA / "img_123x77.png")]), ("Again.", []),
                         ("And this one?", [Image.open(MEDIA / "img_90x260.png")])):
        assert spec.send(text, images=images) == plain.send(text, images=images)
        assert spec.last.cached_tokens == plain.last.cached_tokens
        assert spec.last.draft_accepted == spec.last.draft_proposed > 0
    assert draft.prefix.hits == 2 and draft.prefix.reused_tokens >= spec.last.cached_tokens
    spec.save(tmp_path / "chat.safetensors")
    assert "draft_model" not in M.ChatSession.load(tmp_path / "chat.safetensors", target, processor).generation_kwargs
    # The draft model is given again to load: the loaded session drafts, its draft caches still kept.
    loaded = M.ChatSession.load(tmp_path / "chat.safetensors", target, processor, draft_model=draft)
    hits = draft.prefix.hits
    assert loaded.send("Once more.") == plain.send("Once more.")
    assert loaded.last.draft_accepted == loaded.last.draft_proposed > 0 and draft.prefix.hits == hits + 1
    engine = Engine(target, processor, max_batch=2, prefix_cache_bytes=1 << 26)
    inputs = encode_prompt(processor, messages=asks()[0])
    want = M.generate(target, processor, messages=asks()[0], max_tokens=10, ignore_eos=True).token_ids
    hits = draft.prefix.hits
    for _ in range(2):
        rid = engine.add(Request(inputs, M.SamplingParams(max_tokens=10, ignore_eos=True), drafter=draft,
                                 num_draft_tokens=2))
        assert [e.token for e in engine.run() if isinstance(e, Token) and e.id == rid] == want
    assert engine.prefix.hits == 1 and draft.prefix.hits == hits + 2  # the session left this prompt too
    fresh = DraftModel(target)  # the engine's prefix cache serves the prompt, this draft's holds nothing
    rid = engine.add(Request(inputs, M.SamplingParams(max_tokens=10, ignore_eos=True), drafter=fresh,
                             num_draft_tokens=2))
    events = list(engine.run())
    assert [e.token for e in events if isinstance(e, Token) and e.id == rid] == want
    done = next(e for e in events if isinstance(e, Done) and e.id == rid)
    assert engine.prefix.hits == 2 and fresh.prefix.misses == 1 and done.draft_accepted == done.draft_proposed > 0
    graph = load_fixture_model("tiny-a", backend="mlx")
    messages = asks()[1]
    want = M.generate(graph, processor, messages=messages, max_tokens=12, ignore_eos=True)
    got = M.generate(graph, processor, messages=messages, max_tokens=12, ignore_eos=True,
                     draft_model=load_fixture_model("tiny-b", backend="mlx"))
    assert got.token_ids == want.token_ids and got.draft_proposed > 0


def test_draft_model_with_another_vocabulary_is_refused_in_one_line(processor, on_cpu):
    """A draft model that would read the prompt's ids otherwise, or whose caches do not fit the
    KV budget beside the request's own: one line, before any work; the KV bytes in use count the
    draft's caches while its request runs."""
    import dataclasses
    import types

    from mlx_qwen3vl.engine.draft_model import DraftModel

    target = load_fixture_model("tiny-a", backend=None)
    c = target.config
    small = types.SimpleNamespace(config=dataclasses.replace(c, text_config=dataclasses.replace(c.text_config,
                                                                                              vocab_size=300)),
                                  language_model=None, make_cache=None)
    with pytest.raises(ConfigError, match=r"^the draft model's vocab_size \(300\) is not the model's \(448\)"):
        M.generate(target, processor, messages=asks()[1], max_tokens=3, draft_model=small)
    other = type("Tok", (), {"get_vocab": lambda self: {"a": 0}})()
    with pytest.raises(ConfigError, match="tokenizer is not the model's"):
        M.generate(target, processor, messages=asks()[1], max_tokens=3, draft_model=(target, other))
    # The KV budget counts the draft's caches: a request that fits alone but not with its draft's.
    from mlx_qwen3vl.engine.draft_model import DraftModel
    from mlx_qwen3vl.kv_settings import FLOAT

    inputs = encode_prompt(processor, messages=asks()[1])
    alone = Engine(target, processor)._kv_bytes(FLOAT, inputs["input_ids"].shape[1] + 8)
    engine = Engine(target, processor, kv_budget_bytes=alone)
    engine.add(Request(inputs, M.SamplingParams(max_tokens=8)))
    with pytest.raises(InputError, match="KV cache"):
        engine.add(Request(inputs, M.SamplingParams(max_tokens=8), drafter=DraftModel(target)))
    # The caches in use (/metrics' kv_cache) count the draft's, while its row runs, and none after.
    from mlx_qwen3vl.engine.batch import cache_bytes

    engine = Engine(target, processor)
    engine.add(Request(inputs, M.SamplingParams(max_tokens=8, ignore_eos=True), drafter=DraftModel(target)))
    while not engine.rows:
        list(engine.step())
    list(engine.step())
    draft, batch = engine.rows[0].drafter.cache, engine._running()[0].cache
    kv = engine.kv_bytes()
    assert kv["draft_bytes"] == cache_bytes(draft) > 0 and kv["bytes"] == cache_bytes(batch) + cache_bytes(draft)
    list(engine.run())
    assert engine.kv_bytes()["bytes"] == engine.kv_bytes()["draft_bytes"] == 0


def test_server_drafts_with_its_draft_model_and_per_request_settings(processor):
    """A server with --draft-model (tiny-b drafting for tiny-a) through the real openai client
    (chat completions, Responses) and anthropic client (Messages): greedy answers (an image,
    streamed or not) are the plain run's; a request's own prompt_lookup replaces the server's
    drafter and num_draft_tokens 0 turns drafting off, in every protocol; usage says kept and
    rejected drafts in each one's shape, /metrics their totals; a bad value is a 400 naming it in
    each one's error shape."""
    import base64
    import io

    pytest.importorskip("openai")
    anthropic = pytest.importorskip("anthropic")
    from test_server import KEY, Server

    server = Server("--api-key", KEY, "--draft-model", str(FIXTURES / "tiny-b"), "--num-draft-tokens", "3")
    try:
        model = load_fixture_model("tiny-a", backend=None)
        buf = io.BytesIO()
        Image.open(MEDIA / "img_123x77.png").save(buf, "PNG")
        url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                 {"type": "text", "text": "one two three one two three"}]}]
        want = M.generate(model, processor, messages=user("one two three one two three",
                                                          Image.open(MEDIA / "img_123x77.png")),
                          max_tokens=14, ignore_eos=True)
        client = server.client()
        ask = dict(model="m", messages=messages, max_tokens=14, temperature=0)
        totals = [0, 0]
        for extra in ({}, {"prompt_lookup": 2, "num_draft_tokens": 2}, {"num_draft_tokens": 0}):
            r = client.chat.completions.create(**ask, extra_body={"ignore_eos": True, **extra})
            assert r.choices[0].message.content == want.text, extra
            details = r.usage.completion_tokens_details
            if extra.get("num_draft_tokens") == 0:
                assert details is None
                continue
            kept, rejected = details.accepted_prediction_tokens, details.rejected_prediction_tokens
            assert kept + rejected > 0 and kept <= r.usage.completion_tokens
            totals = [totals[0] + kept + rejected, totals[1] + kept]
        pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
            **ask, stream=True, extra_body={"ignore_eos": True}) if c.choices]
        assert "".join(pieces) == want.text
        # Responses and Messages (no EOS in these 14 tokens: the same answer without ignore_eos)
        said = "one two three one two three"
        parts = [{"type": "input_image", "image_url": url}, {"type": "input_text", "text": said}]
        for extra in ({"prompt_lookup": 2, "num_draft_tokens": 2}, {"num_draft_tokens": 0}):
            r = client.responses.create(model="m", input=[{"role": "user", "content": parts}], max_output_tokens=14,
                                        temperature=0, extra_body=extra)
            assert r.output_text == want.text, extra
            details = r.usage.output_tokens_details.model_extra
            if extra["num_draft_tokens"]:
                kept, rejected = details["accepted_prediction_tokens"], details["rejected_prediction_tokens"]
                assert kept + rejected > 0 and kept <= r.usage.output_tokens
                totals = [totals[0] + kept + rejected, totals[1] + kept]
            else:
                assert not details
        claude = anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key=KEY, max_retries=0,
                                     timeout=120)
        image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": url.split(",", 1)[1]}}
        blocks = [image, {"type": "text", "text": said}]
        for extra in ({}, {"num_draft_tokens": 0}):
            m = claude.messages.create(model="m", max_tokens=14, messages=[{"role": "user", "content": blocks}],
                                       extra_body={"temperature": 0, **extra})
            assert m.content[0].text == want.text, extra
            if extra:
                assert not m.usage.model_extra
            else:
                kept, rejected = m.usage.accepted_draft_tokens, m.usage.rejected_draft_tokens
                assert kept + rejected > 0 and kept <= m.usage.output_tokens
                totals = [totals[0] + kept + rejected, totals[1] + kept]
        stats = server.metrics()
        assert stats["draft_proposed"] > totals[0] and stats["draft_accepted"] >= totals[1]
        status, body = server.request("POST", "/v1/chat/completions", {**ask, "num_draft_tokens": 17})
        assert status == 400 and body["error"]["param"] == "num_draft_tokens"
        status, body = server.request("POST", "/v1/responses", {"model": "m", "input": "hi", "prompt_lookup": 17})
        assert status == 400 and body["error"]["param"] == "prompt_lookup", body
        status, body = server.request("POST", "/v1/messages", {"model": "m", "max_tokens": 4, "num_draft_tokens": -1,
                                                               "messages": [{"role": "user", "content": "hi"}]})
        assert status == 400 and body["type"] == "error" and "'num_draft_tokens'" in body["error"]["message"], body
    finally:
        server.stop()


def test_cli_draft_model_answers_as_plain(capsys):
    """`--draft-model` on the command line: the same answer as without, and a Drafts line."""
    from mlx_qwen3vl.__main__ import main

    args = ["--model", str(FIXTURES / "tiny-a"), "--prompt", "one two three one two three", "--max-tokens", "8",
            "--ignore-eos"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main(args + ["--draft-model", str(FIXTURES / "tiny-b"), "--num-draft-tokens", "2"]) == 0
    out = capsys.readouterr()
    assert out.out == plain and "Drafts: " in out.err


@pytest.mark.parametrize("backend", ["mlx", None])
def test_greedy_verify_breaks_ties_of_the_log_probs_as_plain(processor, on_cpu, backend):
    """Two tokens whose logits differ by one ulp but whose log-probabilities round to the same
    value: the plain run takes the first (the argmax of its log-probs); a draft of the other one,
    the argmax of the raw logits, must be rejected."""
    from mlx_qwen3vl.weights import load_model

    model = load_model(FIXTURES / "tiny-a", backend=backend)  # its own: `logits` is replaced
    V = model.config.text_config.vocab_size
    base = np.zeros(V, np.float32)
    base[5], base[9] = 1.0, np.nextafter(np.float32(1.0), np.float32(2.0))
    lp = np.asarray(mx.array(base) - mx.logsumexp(mx.array(base)))
    assert lp[5] == lp[9] and base[9] > base[5]  # the tie exists only after normalising
    model.logits = lambda hidden: mx.broadcast_to(mx.array(base), hidden.shape[:-1] + (V,))
    messages = asks()[1]
    want = M.generate(model, processor, messages=messages, max_tokens=6, ignore_eos=True)
    assert want.token_ids == [5] * 6
    nine = type("Nine", (), {"propose": lambda self, ids, k: [9] * k})()
    got = M.generate(model, processor, messages=messages, max_tokens=6, ignore_eos=True, drafter=nine)
    assert got.token_ids == want.token_ids and got.draft_accepted == 0 < got.draft_proposed
