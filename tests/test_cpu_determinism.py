"""The CPU path's numbers do not depend on the thread count (the machine's load chooses it) nor on
how rows are grouped: a linear's row and an attention query come out bit for bit the same in any
batch, prompt chunking and thread count, so a quantized cache holds the same codes and a request
the same answer alone or beside others."""

import mlx.core as mx
import numpy as np
import pytest

import mlx_qwen3vl as M
from conftest import FIXTURES, cpu_path_for_every_size, load_fixture_model
from mlx_qwen3vl.cpu import kernels, threads
from mlx_qwen3vl.engine.prefill import prefill
from mlx_qwen3vl.generate import encode_prompt
from mlx_qwen3vl.kv_settings import KVSettings

pytestmark = pytest.mark.skipif(kernels._native is None, reason="the C extension is not built")


@pytest.fixture(autouse=True)
def thread_count_back():
    yield
    threads.configure(None)


def test_linear_rows_are_the_same_in_any_grouping_and_thread_count():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((37, 256)).astype(np.float32)
    w = rng.standard_normal((300, 256)).astype(np.float32)
    threads.configure(2)
    whole = kernels.matmul_t(a, w)
    for n in (2, 1):
        threads.configure(n)
        for m in (1, 3, 5, 8, 16, 37):
            got = np.concatenate([kernels.matmul_t(a[s:s + m], w) for s in range(0, len(a), m)])
            assert np.array_equal(got, whole), (n, m)


def test_attention_queries_are_the_same_in_any_chunk_and_thread_count():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, h, 45, 32)).astype(np.float32) for h in (4, 2, 2))
    threads.configure(2)
    whole = kernels.np_attention(q, k, v, 0.2, causal=True)
    for n in (2, 1):
        threads.configure(n)
        for c in (2, 7, 16, 45):  # the queries [s, e) over the keys [0, e), as a chunked prefill has them
            got = np.concatenate([kernels.np_attention(q[:, :, s:s + c], k[:, :, :s + c], v[:, :, :s + c], 0.2,
                                                       causal=True) for s in range(0, 45, c)], axis=2)
            assert np.array_equal(got, whole), (n, c)
    # A boolean mask (rows prefilled together, right-padded) gives its queries the same numbers.
    allowed = np.tril(np.ones((45, 45), bool))[None, None]
    assert np.array_equal(kernels.np_attention(q, k, v, 0.2, causal=False, allowed=allowed), whole)
    near = mx.fast.scaled_dot_product_attention(*map(mx.array, (q, k, v)), scale=0.2, mask=mx.array(allowed))
    assert np.allclose(np.array(near), whole, atol=1e-5)


@pytest.fixture(scope="module")
def processor():
    return M.Processor.from_pretrained(FIXTURES / "tiny-a")


@pytest.mark.parametrize("kind", [None, (8, 32, 0), (4, 32, 0), (4, 32, 30)], ids=["float", "8-bit", "4-bit",
                                                                                       "4-bit from 30"])
def test_prefill_holds_the_same_cache_bytes_at_any_thread_count_and_chunking(processor, on_cpu, monkeypatch, kind):
    """The CPU path as on the 2B model (every linear and attention in numpy and C): a prompt
    prefilled whole on two threads, whole on one, and in chunks of 1, 2, 5 and 16 tokens leaves the
    same cache bytes (a quantized cache: the same codes, scales and biases) and the same logits.
    Before: OpenBLAS's GEMMs changed ~all of them with the thread count and the chunk, and a
    one-token chunk ran the decode stack (its own arithmetic)."""
    cpu_path_for_every_size(monkeypatch)
    model = load_fixture_model("tiny-a", backend="cpu-all")
    words = "tell me a long story about the red cat and the dog where is the menu"
    inputs = encode_prompt(processor, messages=[{"role": "user", "content": [{"type": "text", "text": words}]}])
    L = inputs["input_ids"].shape[1]
    kv = KVSettings(*kind).fit(32) if kind else KVSettings()

    def run(step, n):
        threads.configure(n)
        cache = model.backend.make_cache(model)
        logits, _ = prefill(model, inputs, cache, prefill_step_size=step, kv=kv)
        mx.eval(logits)
        arrays = [a for c in cache for t in (c.keys, c.values) for a in (t if isinstance(t, tuple) else (t,))]
        return np.array(logits), [np.array(a[..., :L, :]) for a in arrays]

    want_logits, want = run(4096, 2)
    for step, n in ((4096, 1), (1, 2), (2, 1), (5, 2), (16, 1)):  # 69 tokens: chunks ending in one token
        logits, got = run(step, n)
        assert np.array_equal(logits, want_logits), (step, n)
        assert all(np.array_equal(g, w) for g, w in zip(got, want)), (step, n)


def test_answers_are_the_same_at_any_thread_count_and_in_a_batch(processor, on_cpu, monkeypatch):
    """Sampled answers under a 4-bit cache, the CPU path as on the 2B model: one request alone on
    two threads, alone on one, and six rows of one length decoded together (no padding: the decode
    stack for all of them, where more than 4 rows were one OpenBLAS GEMM) give the same tokens
    and the same log-probabilities, bit for bit."""
    cpu_path_for_every_size(monkeypatch)
    model = load_fixture_model("tiny-a", backend="cpu-all")
    kw = dict(max_tokens=6, ignore_eos=True, temperature=1.0, kv_bits=4, kv_group_size=32, quantized_kv_start=0)
    asks = [dict(prompt=f"Where is menu {i}?", seed=i) for i in range(6)]
    lengths = {encode_prompt(processor, prompt=a["prompt"])["input_ids"].shape[1] for a in asks}
    assert len(lengths) == 1
    threads.configure(2)
    want = [M.generate(model, processor, **a, **kw) for a in asks]
    threads.configure(1)
    assert [(r.token_ids, r.logprobs) for r in (M.generate(model, processor, **asks[0], **kw),)] == \
        [(want[0].token_ids, want[0].logprobs)]
    threads.configure(2)
    got = M.batch_generate(model, processor, [dict(a, **kw) for a in asks])
    assert [(r.token_ids, r.logprobs) for r in got] == [(r.token_ids, r.logprobs) for r in want]
