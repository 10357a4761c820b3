"""Rows of a batch under every cache kind: rows finishing, joining and leaving at every step
(float, 8-bit, 4-bit, quantized_kv_start reached mid-answer; dense and MoE; the CPU path and
the plain MLX graph), each row equal token for token to the same request run alone; the cache
types' own row operations (merge / filter / extract / trim_to) leave buffers in the layout each
attention reads; and a seeded random-schedule fuzz over all of it.

`PYTHONPATH=.:tests python tests/test_cache_rows.py N` runs the fuzz with N requests per configuration by hand and
prints "N requests, N equal"."""

import random
import sys

import conftest  # noqa: F401  (first: run by hand, it loads the optimized BLAS before mlx.core)
import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

import mlx_qwen3vl as M
from conftest import FIXTURES, load_fixture_model
from mlx_qwen3vl.engine import Done, Engine, Request, Token
from mlx_qwen3vl.generate import encode_prompt
from mlx_qwen3vl.kv_settings import KVSettings

KINDS = {"float": None, "8-bit": KVSettings(8, 32, 0), "4-bit": KVSettings(4, 32, 0),
         "8-bit mid-answer": "mid"}


@pytest.fixture(scope="module")
def processor():
    return M.Processor.from_pretrained(FIXTURES / "tiny-a")


def shot(seed, size=(64, 64)):
    """A same-size picture whose content depends on `seed`."""
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def user(text, *images):
    content = [{"type": "image", "image": i} for i in images] + [{"type": "text", "text": text}]
    return [{"role": "user", "content": content}]


def alone(model, processor, messages, params, kv):
    """The request run by itself: generate()'s tokens."""
    kw = {} if kv is None else kv.as_dict()
    return M.generate(model, processor, messages=messages, **params, **kw).token_ids


def model_for(fixture, backend, monkeypatch):
    if backend == "cpu-all":
        from conftest import cpu_path_for_every_size

        cpu_path_for_every_size(monkeypatch)
    return load_fixture_model(fixture, backend=backend)


# ------------------------------------------------------------------------------------- the case
@pytest.mark.parametrize("bits, start", [(8, 0), (4, 20)])
def test_quantized_batch_whose_row_finishes_first_equals_each_row_alone(processor, on_cpu, bits, start):
    """The reported case: two rows, the first finishing at step 3 while the other goes on to 12,
    on the CPU decode stack (load's choice here). Before the fix: "ndarray is not C-contiguous"."""
    model = load_fixture_model("tiny-a", backend="cpu")
    requests = [dict(prompt="Hi.", max_tokens=3, ignore_eos=True),
                dict(prompt="Tell me a long story.", max_tokens=12, ignore_eos=True)]
    got = M.batch_generate(model, processor, requests, kv_bits=bits, quantized_kv_start=start)
    for r, g in zip(requests, got):
        assert g.token_ids == M.generate(model, processor, **r, kv_bits=bits, quantized_kv_start=start).token_ids


# ------------------------------------------------------------------------------------- every step
def _every_step_schedule(processor, kind):
    """Six requests: one joins at each of the first six steps and they finish at six different
    steps (one of them, the fourth, is cancelled instead after its fourth token: it leaves)."""
    prompts = [user("Hi."), user("Tell me a long story about a cat.", shot(1)), user("Two plus two?"),
               user("Where is the menu?", shot(2)), user("Say something."), user("Describe it.", shot(1))]
    max_tokens = [7, 3, 11, 9, 1, 5]
    out = []
    for i, (m, n) in enumerate(zip(prompts, max_tokens)):
        kv = KINDS[kind]
        if kv == "mid":  # reached at the request's (i % 3 + 1)-th answer token
            length = encode_prompt(processor, messages=m)["input_ids"].shape[1]
            kv = KVSettings(8, 32, length + i % 3 + 1)
        out.append((m, dict(max_tokens=n, ignore_eos=True), kv))
    return out


def _run_schedule(engine, processor, asks, join_at, cancels=None, max_steps=200):
    """Add asks[i] before step join_at[i]; cancels {index: after that many tokens} → {index: tokens}."""
    cancels = cancels or {}
    tokens, ids, step = {}, {}, 0
    while len(ids) < len(asks) or engine.busy:
        for i, at in enumerate(join_at):
            if at == step and i not in ids:
                m, params, kv = asks[i]
                ids[i] = engine.add(Request(encode_prompt(processor, messages=m), M.SamplingParams(**params), kv=kv))
        index = {rid: i for i, rid in ids.items()}
        for ev in engine.step():
            if isinstance(ev, Token):
                i = index[ev.id]
                tokens.setdefault(i, []).append(ev.token)
                if cancels.get(i) == len(tokens[i]):
                    engine.cancel(ev.id)
            elif not isinstance(ev, Done):
                raise AssertionError(f"request {index[ev.id]}: {ev!r}")
        step += 1
        assert step < max_steps
    return tokens


EVERY_STEP = ([("tiny-a", backend, kind) for backend in ("cpu", "mlx") for kind in KINDS]
              + [("tiny-moe", "cpu", kind) for kind in ("8-bit", "4-bit", "8-bit mid-answer")]
              + [("tiny-moe", "mlx", kind) for kind in ("8-bit", "8-bit mid-answer")])


@pytest.mark.parametrize("fixture, backend, kind", EVERY_STEP)
def test_rows_join_finish_and_leave_at_every_step_each_equal_alone(processor, on_cpu, monkeypatch, fixture,
                                                                   backend, kind):
    """One row joins at each of the first six steps while the others decode, rows finish at six
    different steps and one is cancelled mid-answer; under each cache kind, each row's tokens
    equal the request run alone (the cancelled one: a prefix of it)."""
    model = model_for(fixture, backend, monkeypatch)
    asks = _every_step_schedule(processor, kind)
    engine = Engine(model, processor, max_batch=8)
    got = _run_schedule(engine, processor, asks, join_at=range(len(asks)), cancels={3: 4})
    for i, (m, params, kv) in enumerate(asks):
        want = alone(model, processor, m, params, kv)
        assert got[i] == (want[:4] if i == 3 else want), (i, kind)
    assert engine.kv_bytes()["bytes"] == 0 and not engine.rows


def test_row_operations_leave_row_contiguous_buffers():
    """merge, filter, extract and keep on float and quantized caches: values as the rows held them,
    buffers row-contiguous (the CPU decode stack reads them in place), key masks right."""
    from mlx_qwen3vl.cpu.decode import KVCache

    rng = np.random.default_rng(0)
    for quantized in (False, True):
        rows = []
        for n in (5, 9, 3):
            c = KVCache()
            c.update_and_fetch(*(mx.array(rng.standard_normal((1, 2, n, 32)).astype(np.float32)) for _ in "kv"))
            rows.append(c.to_quantized(32, 8) if quantized else c)
        batch = type(rows[0]).merge(rows)
        assert batch.size() == 9 and batch.padding() == [4, 0, 6]
        batch.filter([2, 0])  # the shared padding (4) goes
        assert batch.size() == 5 and batch.padding() == [2, 0]
        for b in (batch, batch.extract(1), batch.extract(0, 2)):
            for a in (b.keys if quantized else (b.keys,)):
                assert np.asarray(a).flags["C_CONTIGUOUS"]
        first = lambda c: c.keys[0] if quantized else c.keys  # noqa: E731
        assert np.array_equal(np.asarray(first(batch.extract(1))), np.asarray(first(rows[0]))[:, :, :5])
        assert np.array_equal(np.asarray(first(batch.extract(0))), np.asarray(first(rows[2]))[:, :, :3])
        assert np.asarray(batch.key_mask(1)).tolist() == [[False, False, True, True, True, True], [True] * 6]
        one = rows[1].extract()
        one.trim_to(4)
        assert one.size() == 4 and one.nbytes > 0
        with pytest.raises(ValueError):
            one.trim_to(5)


# ------------------------------------------------------------------------------------- fuzz
def fuzz(model, processor, seed, count, backend_kinds=("float", "8", "4")):
    """`count` random requests on a random schedule → (requests, equal). Prompts of text and
    same-size pictures of different content, random max_tokens, sampling seeded or greedy, random
    cache kinds and quantized_kv_start, joining via Engine.add at random steps, some cancelled."""
    rnd = random.Random(seed)
    words = "the a cat dog menu button click where is open close tell me story why how many red".split()
    asks, join_at, cancels = [], [], {}
    step = 0
    for i in range(count):
        images = [shot(rnd.randrange(4)) for _ in range(rnd.choice((0, 0, 1, 2)))]
        m = user(" ".join(rnd.choice(words) for _ in range(rnd.randrange(1, 12))), *images)
        params = dict(max_tokens=rnd.randrange(1, 14), ignore_eos=rnd.random() < 0.7)
        if rnd.random() < 0.3:
            params.update(temperature=1.0, seed=rnd.randrange(1000))
        k = rnd.choice(backend_kinds)
        kv = None if k == "float" else KVSettings(int(k), rnd.choice((32, 64)),
                                                  rnd.choice((0, rnd.randrange(5, 60))))
        asks.append((m, params, kv))
        step += rnd.choice((0, 0, 1, 2, 3))
        join_at.append(step)
        if rnd.random() < 0.1:
            cancels[i] = rnd.randrange(1, 4)
    engine = Engine(model, processor, max_batch=rnd.choice((2, 4, 8)), prefill_budget=rnd.choice((None, 16, 64)),
                    prefix_cache_bytes=rnd.choice((0, 1 << 24)))
    tokens = _run_schedule(engine, processor, asks, join_at, cancels, max_steps=10_000)
    differ = []
    for i, (m, params, kv) in enumerate(asks):
        want = alone(model, processor, m, params, kv)
        got = tokens.get(i, [])
        if not (got == (want[:len(got)] if i in cancels else want) and (i in cancels or got)):
            differ.append((i, params, kv, got, want))
    return len(asks), len(asks) - len(differ), differ


@pytest.mark.parametrize("fixture, backend, seed", [("tiny-a", "cpu", 1), ("tiny-a", "cpu-all", 3),
                                                    ("tiny-moe", "mlx", 2)])
def test_random_schedules_each_row_equals_alone(processor, on_cpu, monkeypatch, fixture, backend, seed):
    model = model_for(fixture, backend, monkeypatch)
    n, equal, differ = fuzz(model, processor, seed, 10)
    assert equal == n, differ


if __name__ == "__main__":  # the fuzz by hand: python tests/test_cache_rows.py N
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    mx.set_default_device(mx.cpu)
    proc = M.Processor.from_pretrained(FIXTURES / "tiny-a")
    total = same = 0
    for fixture, backend in (("tiny-a", "cpu"), ("tiny-a", "cpu-all"), ("tiny-a", "mlx"), ("tiny-moe", "cpu"),
                             ("tiny-moe", "mlx")):
        if backend == "cpu-all":  # the CPU path for every size, as on the 2B model
            from conftest import ALL_SIZES
            from mlx_qwen3vl.cpu import kernels

            saved = {name: getattr(kernels, name) for name in ALL_SIZES}
            for name in ALL_SIZES:
                setattr(kernels, name, 0)
        model = load_fixture_model(fixture, backend=backend)
        for seed in range(max(1, count // 20)):
            n, e, differ = fuzz(model, proc, 1000 + seed, 20)
            total, same = total + n, same + e
            print(f"{fixture} {backend} seed {1000 + seed}: {n} requests, {e} equal", *differ, flush=True)
        if backend == "cpu-all":
            for name, value in saved.items():
                setattr(kernels, name, value)
    print(f"{total} requests, {same} equal")
