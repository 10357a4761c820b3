"""Work split by rows over MLX's CPU streams (spread.py) gives the unsplit result bit for bit:
elementwise work, the plain graph's attention, and a whole prefill with an image."""

import mlx.core as mx
import numpy as np
import pytest

from conftest import FIXTURES, case_inputs
from mlx_qwen3vl import activations, attention, spread
from mlx_qwen3vl.weights import load_model


def recording(fn, seen):
    """fn, noting the default CPU stream each call runs under."""
    def run(*arrays):
        seen.append(mx.default_stream(mx.cpu))
        return fn(*arrays)

    return run


@pytest.mark.parametrize("shape", [(65, 33), (2, 40, 64), (1, 99, 1000)])
@pytest.mark.parametrize("name", ["swiglu", "gelu_tanh", "softmax"])
def test_rows_on_two_streams_equal_the_whole_op(name, shape, monkeypatch, on_cpu):
    fn = {"swiglu": activations.swiglu, "gelu_tanh": activations.gelu_tanh,
          "softmax": lambda x: mx.softmax(x, axis=-1, precise=True)}[name]
    arrays = [mx.random.normal(shape, key=mx.random.key(i)) * 4 for i in range(2 if name == "swiglu" else 1)]
    whole = np.array(fn(*arrays))
    seen = []
    monkeypatch.setattr(spread, "MIN_ELEMENTS", 1)
    split = spread.by_rows(recording(fn, seen), *arrays)
    assert split.shape == whole.shape and np.array_equal(np.array(split), whole)
    assert seen == spread.streams()  # an odd count of rows too: two parts, one per stream
    monkeypatch.setattr(spread, "MIN_ELEMENTS", mx.array(arrays[0]).size + 1)
    seen.clear()
    assert np.array_equal(np.array(spread.by_rows(recording(fn, seen), *arrays)), whole)
    assert seen == [mx.default_stream(mx.cpu)]  # below the threshold: one op, on the caller's stream


@pytest.mark.parametrize("rows", [9, 64, 301])
def test_then_runs_on_each_block_as_on_the_whole(rows, monkeypatch, on_cpu):
    """by_rows(fn, x, then=linear): each block's activation goes through the linear on the caller's
    stream; the rows equal linear(fn(x)) to the bit (MKL rounds a row alike whatever rows it is with)."""
    x = mx.random.normal((1, rows, 96), key=mx.random.key(rows)) * 3
    w = mx.random.normal((40, 96), key=mx.random.key(7))
    linear = lambda h: h @ w.T  # noqa: E731
    whole = np.array(linear(activations.gelu_tanh(x)))
    monkeypatch.setattr(spread, "MIN_ELEMENTS", 1)
    seen = []
    split = spread.by_rows(recording(activations.gelu_tanh, seen), x, then=linear)
    assert split.shape == (1, rows, 40) and np.array_equal(np.array(split), whole)
    # fewer than MIN_ROWS a block (MKL's few-row kernels round otherwise): not split
    assert seen == (spread.streams() if rows >= spread.PARTS * spread.MIN_ROWS else [mx.default_stream(mx.cpu)])


CASES = {  # B, H, Hkv, L, S, D, mask
    "causal prefill, grouped heads": (1, 8, 2, 29, 29, 128, "causal"),
    "causal after a cache": (2, 4, 2, 9, 40, 128, "causal"),
    "left-padded rows (boolean, one head)": (2, 4, 2, 12, 30, 64, "bool1"),
    "boolean per head": (2, 4, 4, 12, 30, 64, "boolH"),
    "boolean per head, one sequence (blocks of kv heads)": (1, 8, 4, 12, 30, 64, "boolH"),
    "additive": (1, 4, 2, 10, 25, 64, "float"),
    "vision windows, head dim 72": (3, 4, 4, 20, 20, 72, None),
}


@pytest.mark.parametrize("case", CASES)
def test_attention_on_the_cpu_device_equals_mlx_fast_bit_for_bit(case, monkeypatch, on_cpu):
    """attention.attend writes out the ops of mx.fast's CPU fallback with the softmax split by rows;
    its result is that of mx.fast.scaled_dot_product_attention, to the bit."""
    B, H, Hkv, L, S, D, kind = CASES[case]
    keys = mx.random.split(mx.random.key(L * S), 4)
    q, k, v = (mx.random.normal(shape, key=key) * 2 for shape, key in
               zip(((B, H, L, D), (B, Hkv, S, D), (B, Hkv, S, D)), keys))
    mask = {"bool1": lambda: mx.random.uniform(shape=(B, 1, L, S), key=keys[3]) > 0.3,
            "boolH": lambda: mx.random.uniform(shape=(B, H, L, S), key=keys[3]) > 0.3,
            "float": lambda: mx.random.normal((B, 1, L, S), key=keys[3])}.get(kind, lambda: kind)()
    if kind in ("bool1", "boolH"):
        mask[..., -1] = True  # every query sees a key
    fast = np.array(mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask=mask))
    monkeypatch.setattr(spread, "MIN_ELEMENTS", 1)
    seen = []
    monkeypatch.setattr(attention, "_softmax", recording(attention._softmax, seen))
    ours = attention.attend(q, k, v, D**-0.5, mask)
    assert np.array_equal(np.array(ours), fast)
    assert seen == spread.streams()


def test_a_plain_graph_prefill_split_over_streams_equals_it_unsplit(monkeypatch, on_cpu):
    """tiny-a on the plain graph, a prompt with an image: every attention's softmax (vision and
    decoder) and every vision block's GELU split (threshold 1 element) give the unsplit logits bit
    for bit."""
    model = load_model(FIXTURES / "tiny-a", dtype="float32", backend="mlx")
    inputs = case_inputs("image")
    whole = np.array(model(**inputs))
    calls, split_calls = [], []
    by_rows, softmax, blocks = spread.by_rows, attention._softmax, spread.blocks
    monkeypatch.setattr(spread, "by_rows", lambda fn, *a, **kw: calls.append(fn) or by_rows(fn, *a, **kw))
    monkeypatch.setattr(attention, "_softmax", lambda s: calls.append(softmax) or softmax(s))
    monkeypatch.setattr(spread, "blocks", lambda n: split_calls.append(n) or blocks(n))
    monkeypatch.setattr(spread, "MIN_ELEMENTS", 1)
    split = np.array(model(**inputs))
    assert np.array_equal(split, whole)
    text, blocks_ = len(model.language_model.layers), len(model.visual.blocks)
    assert len(split_calls) == text + 2 * blocks_  # each attention, each vision GELU
    assert sum(fn is softmax for fn in calls) == 2 * (text + blocks_)  # two blocks of heads in each
    assert sum(fn is activations.gelu_tanh for fn in calls) == blocks_


def test_rows_finishing_at_different_steps_split_equal_unsplit(monkeypatch, on_cpu):
    """Through the engine on the plain graph: an image prompt beside text prompts of other lengths
    (left-padded rows, a boolean mask), sampled, finishing at different steps: with every attention
    split (threshold 1 element) each row's tokens and log-probabilities equal the unsplit run's."""
    import mlx_qwen3vl as M

    model = load_model(FIXTURES / "tiny-a", dtype="float32", backend="mlx")
    processor = M.Processor.from_pretrained(FIXTURES / "tiny-a")
    picture = str(FIXTURES / "media" / "img_123x77.png")
    asks = [dict(prompt="What is drawn?", images=[picture], max_tokens=5, seed=1),
            dict(prompt="Click the blue button on the left of the screen, then wait.", max_tokens=3, seed=2),
            dict(prompt="Hi", max_tokens=7, seed=3)]
    def run():
        results = M.batch_generate(model, processor, asks, temperature=1.0, ignore_eos=True)
        return [(r.token_ids, r.logprobs) for r in results]

    monkeypatch.setattr(spread, "MIN_ELEMENTS", 1 << 62)
    whole = run()
    assert [len(t) for t, _ in whole] == [5, 3, 7]
    splits = []
    blocks = spread.blocks
    monkeypatch.setattr(spread, "blocks", lambda n: splits.append(n) or blocks(n))
    monkeypatch.setattr(spread, "MIN_ELEMENTS", 1)
    assert run() == whole
    assert len(splits) > 3 * len(model.language_model.layers)  # the decode steps' attention too
