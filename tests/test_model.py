"""The model reproduces transformers' recorded outputs on the tiny checkpoints (float32)."""

import mlx.core as mx
import numpy as np
import pytest

from conftest import CASES, FIXTURES, case_inputs, cpu_path_for_every_size, load_fixture_model, reference, rel_err
from mlx_qwen3vl.rope import apply_rotary

TOL = 1e-4


@pytest.mark.parametrize("case", CASES)
def test_positions_match_exactly(checkpoint, case):
    model = load_fixture_model(checkpoint)
    inputs, ref = case_inputs(case), reference(checkpoint, case)
    pos, deltas = model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], inputs.get("image_grid_thw"),
        inputs.get("video_grid_thw"), inputs["attention_mask"],
    )
    np.testing.assert_array_equal(np.array(pos), ref["position_ids"])
    np.testing.assert_array_equal(np.array(deltas), ref["rope_deltas"])


@pytest.mark.parametrize("case", ["image", "two_images", "video"])
def test_vision_and_deepstack_features(checkpoint, case, backend):
    model = load_fixture_model(checkpoint, backend=backend)
    inputs, ref = case_inputs(case), reference(checkpoint, case)
    kind, px, grid = (("video", "pixel_values_videos", "video_grid_thw") if case == "video"
                      else ("image", "pixel_values", "image_grid_thw"))
    feats = model.get_image_features(inputs[px], inputs[grid])
    assert rel_err(feats.embeds, ref[f"{kind}_embeds"]) < TOL
    n_taps = len(model.config.vision_config.deepstack_visual_indexes)
    assert len(feats.deepstack) == n_taps
    for i, ds in enumerate(feats.deepstack):
        assert rel_err(ds, ref[f"{kind}_deepstack_{i}"]) < TOL


@pytest.mark.parametrize("case", CASES)
def test_logits(checkpoint, case, backend):
    model = load_fixture_model(checkpoint, backend=backend)
    inputs, ref = case_inputs(case), reference(checkpoint, case)
    logits = np.array(model(**inputs))
    real = inputs["attention_mask"].astype(bool)  # padded positions are garbage in both engines
    assert logits.shape == ref["logits"].shape
    assert rel_err(logits[real], ref["logits"][real]) < TOL


@pytest.mark.parametrize("case", ["two_images", "video", "batch"])
def test_chunked_attention_keeps_references(checkpoint, case, monkeypatch, on_cpu):
    """The plain graph with every attention (vision windows, decoder prefill) in chunks of 7
    queries, which divide none of the fixtures' windows or prompts, still gives the recorded
    features and logits."""
    from mlx_qwen3vl import attention

    monkeypatch.setattr(attention, "query_chunk", lambda q, k, budget=None: 7)
    model = load_fixture_model(checkpoint, backend="mlx")
    inputs, ref = case_inputs(case), reference(checkpoint, case)
    kind, px, grid = (("video", "pixel_values_videos", "video_grid_thw") if case == "video"
                      else ("image", "pixel_values", "image_grid_thw"))
    if px in inputs:
        feats = model.get_image_features(inputs[px], inputs[grid])
        assert rel_err(feats.embeds, ref[f"{kind}_embeds"]) < TOL
        for i, ds in enumerate(feats.deepstack):
            assert rel_err(ds, ref[f"{kind}_deepstack_{i}"]) < TOL
    logits = np.array(model(**inputs))
    real = inputs["attention_mask"].astype(bool)
    assert rel_err(logits[real], ref["logits"][real]) < TOL


def test_bfloat16_stays_close(checkpoint):
    """bf16 compute on these deliberately peaked random models: transformers' own bf16 run is
    0.09-0.23 off its fp32 logits (relative to the max), ours 0.07-0.35; top-1 agrees on >=85%."""
    model = load_fixture_model(checkpoint, dtype="bfloat16")
    assert model.language_model.embed_tokens.weight.dtype == mx.bfloat16
    for case in ("text", "image", "video"):
        inputs, ref = case_inputs(case), reference(checkpoint, case)
        logits = np.array(model(**inputs).astype(mx.float32))
        assert rel_err(logits, ref["logits"]) < 0.4
        assert (logits.argmax(-1) == ref["logits"].argmax(-1)).mean() >= 0.85


def test_vision_is_per_image(checkpoint):
    """Attention never crosses images: encoding two images together equals encoding each alone."""
    model = load_fixture_model(checkpoint)
    inputs = case_inputs("two_images")
    grids = inputs["image_grid_thw"]
    sizes = grids.prod(-1)
    both = model.get_image_features(inputs["pixel_values"], grids)
    start, merged = 0, 0
    for grid, n in zip(grids, sizes):
        alone = model.get_image_features(inputs["pixel_values"][start:start + n], grid[None])
        m = int(n) // 4
        np.testing.assert_allclose(np.array(alone.embeds), np.array(both.embeds[merged:merged + m]), atol=1e-5)
        for a, b in zip(alone.deepstack, both.deepstack):
            np.testing.assert_allclose(np.array(a), np.array(b[merged:merged + m]), atol=1e-5)
        start, merged = start + int(n), merged + m


def test_video_frames_attend_within_frame(checkpoint):
    """A video's temporal patches are separate attention windows: the first frame group's features
    do not change when the second group changes."""
    model = load_fixture_model(checkpoint)
    inputs = case_inputs("video")
    grid = inputs["video_grid_thw"]
    t, h, w = (int(v) for v in grid[0])
    assert t >= 2
    px = inputs["pixel_values_videos"].copy()
    base = model.get_video_features(px, grid).embeds
    px[h * w:] = -px[h * w:]
    changed = model.get_video_features(px, grid).embeds
    m = h * w // 4
    np.testing.assert_allclose(np.array(base[:m]), np.array(changed[:m]), atol=1e-6)
    assert np.abs(np.array(base[m:]) - np.array(changed[m:])).max() > 1e-3


def test_text_only_positions_reduce_to_1d_rope(checkpoint, on_cpu):
    """T = H = W positions through mRoPE equal the 1D tables built from first positions only (the
    CPU decode stack's), and the rotation of 1D positions (mx.fast.rope with transformers'
    frequencies, the decode path of the MLX graph) equals the tables' on the CPU to the bit; plain
    mx.fast.rope with a base (its own frequencies) to float32 rounding."""
    rotary = load_fixture_model(checkpoint).language_model.rotary
    starts = mx.array([7, 130])
    pos3 = mx.broadcast_to((starts[:, None] + mx.arange(5))[None], (3, 2, 5))
    cos3, sin3 = rotary.cos_sin(pos3, 5)
    cos1, sin1 = rotary.cos_sin(starts, 5)
    np.testing.assert_array_equal(np.array(cos3), np.array(cos1))
    np.testing.assert_array_equal(np.array(sin3), np.array(sin1))
    q = mx.random.normal((2, 3, 5, rotary.head_dim), key=mx.random.key(0))
    ours = apply_rotary(q, cos3, sin3)
    np.testing.assert_array_equal(np.array(rotary(starts, 5)(q)), np.array(ours))
    assert not mx.array_equal(rotary(starts + 1, 5)(q), ours)
    plain = mx.fast.rope(q, rotary.head_dim, traditional=False, base=rotary.theta, scale=1.0, offset=starts)
    np.testing.assert_allclose(np.array(ours), np.array(plain), atol=2e-5)


def test_cpu_path_matches_mlx_graph(checkpoint, monkeypatch, on_cpu):
    """The CPU path for every size (numpy linears, attention, activations) and the plain MLX graph
    give the same logits, on the same device."""
    cpu_path_for_every_size(monkeypatch)
    inputs, ref = case_inputs("two_images"), reference(checkpoint, "two_images")
    fast = np.array(load_fixture_model(checkpoint, backend="cpu-all")(**inputs))
    pure = np.array(load_fixture_model(checkpoint, backend="mlx")(**inputs))
    assert rel_err(pure, ref["logits"]) < TOL and rel_err(fast, ref["logits"]) < TOL
    assert rel_err(fast, pure) < 5e-5  # float32 summation order only


def test_cpu_log_softmax_matches_mlx(on_cpu):
    """The sampler's normalization through numpy (a decode step's vocabulary on the CPU) equals
    MLX's: top-p sampling reads exp(logprobs) as probabilities."""
    from mlx_qwen3vl.backend import MLX
    from mlx_qwen3vl.cpu import kernels

    logits = mx.random.normal((2, 151936), key=mx.random.key(3)) * 8
    fast, pure = kernels.log_softmax(logits), MLX.log_softmax(logits)
    np.testing.assert_allclose(np.array(fast), np.array(pure), atol=2e-5)
    np.testing.assert_allclose(np.exp(np.array(fast, np.float64)).sum(-1), 1.0, atol=1e-5)


@pytest.mark.parametrize("ops", ["c", "numpy"])
@pytest.mark.parametrize("batch", [1, 2])
def test_cpu_decode_token_path_matches_mlx(checkpoint, batch, ops, monkeypatch, on_cpu):
    """The decoder stack for one decode token (cache writes queued, settled with the next step's
    inputs), with its per-layer work in the C extension or in numpy, gives the MLX graph's hidden
    states and leaves the same KV cache, over steps that cross the cache's 256-slot growth; one
    step carries DeepStack additions (a one-token prefill chunk at an image position)."""
    from mlx_qwen3vl.cpu import decode
    from mlx_qwen3vl.weights import load_model

    assert decode.native is not None, "the C extension is not built: pip install -e . (needs a C compiler)"
    monkeypatch.setenv("MLX_QWEN3VL_CPU_KERNELS", ops)
    fast_model = load_model(FIXTURES / checkpoint, backend="cpu")
    pure_model = load_fixture_model(checkpoint, backend="mlx")
    D = pure_model.config.text_config.hidden_size
    prompt = mx.random.normal((batch, 253, D), key=mx.random.key(5))
    tokens = [mx.random.normal((batch, 1, D), key=mx.random.key(6 + i)) for i in range(5)]
    n_layers = len(pure_model.language_model.layers)
    deepstack = [mx.random.normal((batch, 1, D), key=mx.random.key(20 + j)) for j in range(min(3, n_layers))]
    calls = []
    original = decode.decode_tokens
    monkeypatch.setattr(decode, "decode_tokens", lambda *a: calls.append(a[-1]) or original(*a))

    def run(model):
        text, cache = model.language_model, model.make_cache()
        outs = [text(prompt, mx.zeros((batch,), mx.int32), None, cache)]
        for i, t in enumerate(tokens):
            outs.append(text(t, mx.full((batch,), 253 + i, mx.int32), None, cache, deepstack if i == 2 else None))
        return [np.array(o) for o in outs], [np.array(a[:, :, :c.offset]) for c in cache for a in (c.keys, c.values)]

    fast_out, fast_cache = run(fast_model)
    assert calls == [decode.native if ops == "c" else decode.NumpyOps] * len(tokens)
    pure_out, pure_cache = run(pure_model)
    assert len(calls) == len(tokens)
    assert fast_cache[0].shape[2] == 258
    for fast, pure in zip(fast_out + fast_cache, pure_out + pure_cache):
        assert rel_err(fast, pure) < 5e-5  # float32 summation order only


@pytest.mark.parametrize("case", ["image", "batch"])
def test_a_prefills_end_runs_the_final_layer_on_its_last_position_only(checkpoint, case, backend, monkeypatch):
    """The end of a prefill wants one position's logits: the final decoder layer runs its MLP (and
    attention queries, output projection) on that row alone, its q/k/v projection on all, and the logits still
    equal the recorded ones (the batch case: left padding, a boolean mask); the caches hold every
    position, as the whole forward's do. With two layers the final one is also a DeepStack layer."""
    from mlx_qwen3vl.engine.prefill import prefill

    model = load_fixture_model(checkpoint, backend=backend)
    inputs, ref = case_inputs(case), reference(checkpoint, case)
    final, rows = model.language_model.layers[-1], []
    kind = type(final.mlp)
    call = kind.__call__
    monkeypatch.setattr(kind, "__call__", lambda mlp, x: (mlp is final.mlp and rows.append(x.shape[1])) or call(mlp, x))
    cache = model.make_cache()
    logits, _ = prefill(model, inputs, cache)
    assert rows == [1]
    assert rel_err(logits, ref["logits"][:, -1]) < TOL
    whole = model.make_cache()
    model(**inputs, cache=whole)
    for ours, theirs in zip(cache, whole):
        for a, b in zip(ours.state, theirs.state):
            if isinstance(a, mx.array):
                assert a.shape == b.shape and rel_err(a, np.array(b)) < TOL

    lm = model.language_model
    layers = lm.layers
    lm.layers = layers[:2]  # layer 1 adds the second DeepStack tap
    try:
        assert len(model.config.vision_config.deepstack_visual_indexes) >= 2
        logits, _ = prefill(model, inputs, model.make_cache())
        expected = np.array(model(**inputs))[:, -1]
    finally:
        lm.layers = layers
    assert rel_err(logits, expected) < TOL
