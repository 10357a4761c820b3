"""Qwen3-VL-MoE: transformers' recorded outputs on tiny-moe (its transformers-5 files) and on the same
weights in the hub's expert layout (tiny-moe-hub), the router, the layouts, mlx-vlm's converted
folders, conversion and generation end to end."""

import json
import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

import mlx_qwen3vl as M
from conftest import CASES, FIXTURES, case_inputs, load_fixture_model, reference, rel_err
from mlx_qwen3vl.config import ModelConfig, TextConfig
from mlx_qwen3vl.errors import ConfigError, InputError, WeightsError
from mlx_qwen3vl.generate import generate_tokens
from mlx_qwen3vl.language import MLP
from mlx_qwen3vl.moe import SparseMoeBlock, route
from mlx_qwen3vl.weights import EXPERTS_HUB, EXPERTS_T5, build_model, expert_layout, load_model

TOL = 1e-4
LAYOUTS = ["tiny-moe", "tiny-moe-hub"]  # transformers 5's files and the hub's, same weights
REF = "tiny-moe"


@pytest.fixture(params=LAYOUTS)
def moe(request):
    return request.param


def ref(case):
    return reference(REF, case)


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------
def test_both_config_layouts_read_the_same_experts():
    t5, hub = (ModelConfig.from_pretrained(FIXTURES / name) for name in LAYOUTS)
    raw_t5 = json.loads((FIXTURES / "tiny-moe" / "config.json").read_text())["text_config"]
    raw_hub = json.loads((FIXTURES / "tiny-moe-hub" / "config.json").read_text())["text_config"]
    assert "num_local_experts" in raw_t5 and "num_experts" in raw_hub and "rope_scaling" in raw_hub
    for c in (t5, hub):
        assert c.model_type == "qwen3_vl_moe"
        t = c.text_config
        assert (t.num_experts, t.num_experts_per_tok, t.moe_intermediate_size) == (16, 4, 96)
        assert t.mlp_only_layers == [1] and t.decoder_sparse_step == 1 and t.norm_topk_prob
        assert t.mrope_section == [6, 5, 5] and c.vision_config.hidden_act == "gelu_pytorch_tanh"
    assert (t5.transformers_version, hub.transformers_version) == ("5.24.0", "4.57.0")
    raw = json.loads((FIXTURES / "tiny-moe-hub" / "config.json").read_text())
    raw["text_config"]["norm_topk_prob"] = False  # Qwen3-MoE's meaning: no renormalisation
    from mlx_qwen3vl.model import Qwen3VLForConditionalGeneration

    block = Qwen3VLForConditionalGeneration(ModelConfig.from_dict(raw)).language_model.layers[0].mlp
    assert isinstance(block, SparseMoeBlock) and block.norm_topk_prob is False


def text_config(**kw):
    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4, vocab_size=32,
                head_dim=32, mrope_section=[6, 5, 5], num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    return TextConfig(**{**base, **kw})


@pytest.mark.parametrize("step, only, sparse", [
    (1, [], [0, 1, 2, 3, 4, 5]),
    (1, [1], [0, 2, 3, 4, 5]),
    (2, [], [1, 3, 5]),  # transformers: (index + 1) % decoder_sparse_step == 0
    (2, [3], [1, 5]),
    (3, [0], [2, 5]),
])
def test_sparse_layers_follow_the_reference_rule(step, only, sparse):
    config = text_config(decoder_sparse_step=step, mlp_only_layers=only)
    assert [i for i in range(6) if config.is_sparse_layer(i)] == sparse
    from mlx_qwen3vl.language import TextModel

    kinds = [type(layer.mlp) for layer in TextModel(config).layers]
    assert kinds == [SparseMoeBlock if i in sparse else MLP for i in range(6)]


def test_vision_activation_comes_from_the_config(tmp_path):
    """The blocks' GELU is the config's (a peer engine swapped the two variants); an unknown one is
    refused."""
    dst = tmp_path / "exact-gelu"
    shutil.copytree(FIXTURES / REF, dst, ignore=shutil.ignore_patterns("reference"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["vision_config"]["hidden_act"] = "gelu"
    (dst / "config.json").write_text(json.dumps(cfg))
    inputs = case_inputs("image")
    tanh, exact = (load_model(p).get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).embeds
                   for p in (FIXTURES / REF, dst))
    # the two GELUs differ by < 1e-3 of their output: visible against float32 rounding, not above 1e-4
    assert 10 * rel_err(tanh, ref("image")["image_embeds"]) < rel_err(exact, ref("image")["image_embeds"])
    cfg["vision_config"]["hidden_act"] = "relu"
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict(cfg)
    assert "relu" in str(e.value) and "gelu_pytorch_tanh" in str(e.value)


@pytest.mark.parametrize("change, needle", [
    (lambda t: t.pop("moe_intermediate_size"), "moe_intermediate_size"),
    (lambda t: t.update(num_experts_per_tok=17), "num_experts_per_tok"),
    (lambda t: t.update(mlp_only_layers=[4]), "mlp_only_layers"),
    (lambda t: t.update(decoder_sparse_step=0), "decoder_sparse_step"),
])
def test_bad_moe_config_is_one_clear_line(change, needle):
    raw = json.loads((FIXTURES / "tiny-moe" / "config.json").read_text())
    change(raw["text_config"])
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict(raw)
    assert needle in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------
# The router and the sparse block
# ---------------------------------------------------------------------------------------------
def test_route_is_float32_softmax_top_k_renormalised():
    logits = mx.random.normal((3, 5, 16), key=mx.random.key(1)).astype(mx.bfloat16) * 3
    inds, weights = route(logits, 4)
    assert weights.dtype == mx.bfloat16 and inds.shape == (3, 5, 4)
    p = np.array(logits.astype(mx.float32), np.float64)
    p = np.exp(p - p.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    top = np.argsort(-p, -1)[..., :4]
    np.testing.assert_array_equal(np.sort(np.array(inds), -1), np.sort(top, -1))
    expected = np.take_along_axis(p, np.array(inds), -1)
    np.testing.assert_allclose(np.array(weights.astype(mx.float32)), expected / expected.sum(-1, keepdims=True),
                               rtol=1e-2)
    _, raw = route(logits.astype(mx.float32), 4, normalize=False)
    np.testing.assert_allclose(np.array(raw), expected, rtol=1e-5)


def test_sparse_block_equals_a_loop_over_selected_experts():
    """gather_mm over the stacked experts = each token through its own k experts, weighted."""
    config = text_config()
    block = SparseMoeBlock(config)
    x = mx.random.normal((2, 3, 64), key=mx.random.key(2))
    out = np.array(block(x))
    inds, weights = route(block.gate(x), 2)
    inds, weights, xs = np.array(inds), np.array(weights), np.array(x)
    sw = block.switch_mlp
    g, u, d = (np.array(p.weight) for p in (sw.gate_proj, sw.up_proj, sw.down_proj))
    expected = np.zeros_like(xs)
    for b, t in np.ndindex(2, 3):
        for e, w in zip(inds[b, t], weights[b, t]):
            gate = g[e] @ xs[b, t]
            expected[b, t] += w * (d[e] @ (gate / (1 + np.exp(-gate)) * (u[e] @ xs[b, t])))
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Against transformers, from both expert layouts
# ---------------------------------------------------------------------------------------------
def test_layouts_are_told_apart_and_load_the_same_weights():
    t5, hub = (load_fixture_model(name) for name in LAYOUTS)
    a, b = (dict(tree_flatten(m.parameters())) for m in (t5, hub))
    assert a.keys() == b.keys()
    assert all(np.array_equal(np.array(a[k]), np.array(b[k])) for k in a)
    assert a["language_model.layers.0.mlp.switch_mlp.gate_proj.weight"].shape == (16, 96, 64)
    assert a["language_model.layers.0.mlp.switch_mlp.down_proj.weight"].shape == (16, 64, 96)


@pytest.mark.parametrize("case", CASES)
def test_positions_match_exactly(moe, case):
    model, inputs = load_fixture_model(moe), case_inputs(case)
    pos, deltas = model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"], inputs.get("image_grid_thw"),
                                       inputs.get("video_grid_thw"), inputs["attention_mask"])
    np.testing.assert_array_equal(np.array(pos), ref(case)["position_ids"])
    np.testing.assert_array_equal(np.array(deltas), ref(case)["rope_deltas"])


@pytest.mark.parametrize("case", CASES)
def test_logits(moe, case):
    model, inputs = load_fixture_model(moe), case_inputs(case)
    assert float(ref(case)["router_margin"]) > 1e-4  # the recorded expert choices are not near-ties
    logits = np.array(model(**inputs))
    real = inputs["attention_mask"].astype(bool)
    assert logits.shape == ref(case)["logits"].shape
    assert rel_err(logits[real], ref(case)["logits"][real]) < TOL


@pytest.mark.parametrize("case", ["image", "video"])
def test_vision_and_deepstack_features(case):
    """The MoE model's vision tower is the dense one (gelu_pytorch_tanh blocks, exact-GELU merger)."""
    model, inputs = load_fixture_model(REF), case_inputs(case)
    px, grid = ("pixel_values_videos", "video_grid_thw") if case == "video" else ("pixel_values", "image_grid_thw")
    feats = model.get_image_features(inputs[px], inputs[grid])
    assert rel_err(feats.embeds, ref(case)[f"{case}_embeds"]) < TOL
    assert len(feats.deepstack) == 2
    for i, ds in enumerate(feats.deepstack):
        assert rel_err(ds, ref(case)[f"{case}_deepstack_{i}"]) < TOL


@pytest.mark.parametrize("case", CASES)
def test_greedy_equals_transformers(moe, case, backend):
    """Token by token from the recorded inputs, with a prefill chunk of 7 (chunks split images), on
    the MLX graph and on the CPU path (as shipped, and for every size)."""
    model = load_fixture_model(moe, backend=backend)
    processor = M.Processor.from_pretrained(FIXTURES / moe)
    tokens = [np.array(y) for y in generate_tokens(model, processor, case_inputs(case), max_tokens=16,
                                                    prefill_step_size=7)]
    greedy = ref(case)["greedy"]
    got = np.stack(tokens, 1)[:, :greedy.shape[1]]
    np.testing.assert_array_equal(got, greedy)


def test_chunked_prefill_equals_one_pass():
    model, inputs = load_fixture_model(REF), case_inputs("two_images")
    prepared = model.prepare_inputs(**inputs)
    whole = model.logits(model.decode_hidden(prepared, None, model.make_cache()))
    cache, parts, L = model.make_cache(), [], inputs["input_ids"].shape[1]
    for s in range(0, L, 5):
        parts.append(model.logits(model.decode_hidden(prepared, None, cache, s, min(L, s + 5))))
    chunked = mx.concatenate(parts, axis=1)
    assert rel_err(chunked, whole) < 1e-5
    assert rel_err(chunked, ref("two_images")["logits"]) < TOL


def test_chat_session_reuses_the_prefix_and_matches_from_scratch():
    from PIL import Image

    model, processor = load_fixture_model(REF), M.Processor.from_pretrained(FIXTURES / REF)
    img1 = Image.open(FIXTURES / "media" / "img_300x200.png")
    img2 = Image.open(FIXTURES / "media" / "img_90x260.png")
    session = M.ChatSession(model, processor, system="You are a GUI agent.", max_tokens=8)
    session.send("Where is the search box?", images=[img1])
    first = session.last
    second_tokens = [piece.token for piece in session.stream("Now click it.", images=[img2])]
    second = session.last
    assert first.cached_tokens == 0 and second.cached_tokens >= first.prompt_tokens
    scratch = M.generate(model, processor, messages=session.messages[:-1], max_tokens=8)
    assert scratch.token_ids == second_tokens


def test_half_precision_experts():
    """On MLX's CPU backend gather_mm is float32-only: float bf16 experts are refused at load in one
    line; quantized experts (gather_qmm) run in bf16 and stay close to their float32 run."""
    if mx.default_device().type != mx.DeviceType.cpu:
        model = load_model(FIXTURES / REF, dtype="bfloat16")
        logits = np.array(model(**case_inputs("image")).astype(mx.float32))
        assert (logits.argmax(-1) == ref("image")["logits"].argmax(-1)).mean() >= 0.75
        return
    with pytest.raises(InputError) as e:
        load_model(FIXTURES / REF, dtype="bfloat16")
    assert "float32" in str(e.value) and "bfloat16" in str(e.value) and "\n" not in str(e.value)
    half, full = (load_model(FIXTURES / "mlxvlm-moe-q4", dtype=d) for d in ("bfloat16", "float32"))
    for case in ("text", "image"):  # measured: 0.79, 0.89 of positions keep their top-1
        a, b = (np.array(m(**case_inputs(case)).astype(mx.float32)) for m in (half, full))
        assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.75


# ---------------------------------------------------------------------------------------------
# Expert layouts: by shape, by transformers_version, or a clear error
# ---------------------------------------------------------------------------------------------
def square_config(version):
    """hidden == 2*I: a gate_up_proj alone reads the same in both layouts."""
    raw = json.loads((FIXTURES / "tiny-moe" / "config.json").read_text())
    raw["text_config"]["moe_intermediate_size"] = 32
    raw["transformers_version"] = version
    return ModelConfig.from_dict(raw)


def test_expert_layout_by_shape_then_version():
    z = lambda *s: mx.zeros(s)  # noqa: E731
    key = "language_model.layers.0.mlp.experts."
    cfg = square_config(None)
    # down_proj decides whenever I != hidden, even where gate_up cannot
    assert expert_layout({key + "gate_up_proj": z(16, 64, 64), key + "down_proj": z(16, 32, 64)}, cfg, "x") == EXPERTS_HUB
    assert expert_layout({key + "gate_up_proj": z(16, 64, 64), key + "down_proj": z(16, 64, 32)}, cfg, "x") == EXPERTS_T5
    only_square = {key + "gate_up_proj": z(16, 64, 64)}
    assert expert_layout(only_square, square_config("4.57.1"), "x") == EXPERTS_HUB
    assert expert_layout(only_square, square_config("5.2.0"), "x") == EXPERTS_T5
    with pytest.raises(WeightsError) as e:
        expert_layout(only_square, cfg, "ckpt")
    assert "transformers_version" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(WeightsError) as e:
        expert_layout({key + "down_proj": z(16, 48, 64)}, cfg, "ckpt")
    assert "(16, 48, 64)" in str(e.value) and "moe_intermediate_size 32" in str(e.value)
    with pytest.raises(WeightsError) as e:
        expert_layout({key + "down_proj": z(16, 32, 64), "language_model.layers.2.mlp.experts.down_proj": z(16, 64, 32)},
                      cfg, "ckpt")
    assert "mix" in str(e.value)


def test_wrong_expert_count_is_reported(tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "tiny-moe", dst, ignore=shutil.ignore_patterns("reference"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["text_config"]["num_local_experts"] = 8
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightsError) as e:
        load_model(dst)
    assert "num_experts 8" in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------
# mlx-vlm's converted MoE folders
# ---------------------------------------------------------------------------------------------
def test_mlxvlm_quantized_moe_folder_gives_mlxvlms_logits():
    model, kind = build_model(FIXTURES / "mlxvlm-moe-q4", "float32")
    assert kind == "mlx-vlm"
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    block = model.language_model.layers[0].mlp
    assert isinstance(block.switch_mlp.down_proj, QuantizedSwitchLinear) and block.switch_mlp.down_proj.bits == 4
    assert isinstance(block.gate, nn.QuantizedLinear)  # mlx-vlm 0.7.10 quantizes the router too
    recorded = np.load(FIXTURES / "mlxvlm-moe-q4" / "reference" / "text.npz")["logits"]  # made by mlx-vlm itself
    logits = np.array(model(**case_inputs("text")))
    assert rel_err(logits, recorded) < TOL
    assert np.array_equal(logits.argmax(-1), recorded.argmax(-1))


# ---------------------------------------------------------------------------------------------
# Conversion (float, 4-bit, mixed) and generation end to end, CLI included
# ---------------------------------------------------------------------------------------------
QUIET = lambda msg: None  # noqa: E731
RECIPES = {  # groups of 32: the experts' input widths (64 and 96) are multiples, so all are quantized
    "float": dict(),
    "q4": dict(quantize=True, q_bits=4, q_group_size=32),
    "mixed_3_6": dict(quantize=True, quant_predicate="mixed_3_6", q_group_size=32),
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from mlx_qwen3vl.convert import convert

    root, made = tmp_path_factory.mktemp("moe-converted"), {}

    def get(recipe, source="tiny-moe-hub"):
        if (recipe, source) not in made:
            logs = []
            made[recipe, source] = convert(FIXTURES / source, root / f"{source}-{recipe}", log=logs.append,
                                           **RECIPES[recipe]), logs
        return made[recipe, source]

    return get


@pytest.mark.parametrize("source", LAYOUTS)
def test_float_conversion_is_lossless(converted, source):
    out, _ = converted("float", source)
    model, kind = build_model(out)  # the plain MLX graph, as the hub model below
    assert kind == "mlx_qwen3vl"
    hub = load_fixture_model(REF, backend="mlx")
    for case in ("text", "video"):
        assert np.array_equal(np.array(model(**case_inputs(case))), np.array(hub(**case_inputs(case))))


def quantized(model):
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    return {p: m for p, m in model.named_modules()
            if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear))}


@pytest.mark.parametrize("recipe, bits", [("q4", {0: 4, 2: 4, 3: 4}), ("mixed_3_6", {0: 3, 2: 6, 3: 6})])
def test_quantized_conversion(converted, recipe, bits):
    """Experts quantized (mixed: down_proj at high bits where mlx-lm's recipe puts them), the router
    at 8 bits, the dense layer as usual; the quantized kernels (gather_qmm) compute what the
    dequantized weights do; the log gives bits per weight and the active share."""
    from mlx_lm.utils import dequantize_model

    out, logs = converted(recipe)
    model, _ = build_model(out, "float32")
    layers = quantized(model)
    for i, b in bits.items():
        assert layers[f"language_model.layers.{i}.mlp.switch_mlp.down_proj"].bits == b
        assert layers[f"language_model.layers.{i}.mlp.switch_mlp.gate_proj"].bits == (4 if recipe == "q4" else 3)
        assert layers[f"language_model.layers.{i}.mlp.gate"].bits == 8
    assert "language_model.layers.1.mlp.down_proj" in layers  # the dense (mlp_only) layer
    cfg = json.loads((out / "config.json").read_text())["quantization"]
    # Written under mlx-vlm's names (the converter's output layout), which mlx-vlm reads too.
    assert cfg["language_model.model.layers.0.mlp.gate"] == {"group_size": 32, "bits": 8, "mode": "affine"}
    import copy

    reference_model = dequantize_model(copy.deepcopy(model))
    for case in ("text", "image"):
        ours, deq = (np.array(m(**case_inputs(case))) for m in (model, reference_model))
        assert rel_err(ours, deq) < TOL
    line = next(msg for msg in logs if "mixture of experts" in msg)
    assert "top-4 of 16" in line and "1.07 M weights" in line and "405 k active per token" in line
    assert any("bits per weight" in msg for msg in logs)
    # reloading the converted folder and converting it again changes nothing
    again, _ = build_model(out, "float32")
    assert np.array_equal(np.array(again(**case_inputs("text"))), np.array(model(**case_inputs("text"))))


def test_weight_counts_active_vs_total():
    from mlx_qwen3vl.moe import weight_counts

    counts = weight_counts(load_fixture_model(REF))
    experts = 3 * 16 * 3 * 64 * 96  # three sparse layers of 16 experts (gate, up, down)
    assert counts["total"] - counts["active"] == experts * 12 // 16  # a token reads 4 of 16
    dense = weight_counts(load_fixture_model("tiny-b"))
    assert dense["total"] == dense["active"]


def run_module(module, *args):
    """`python -m module args`; stdout and stderr decoded without newline translation (a generated
    "\r" stays one)."""
    import os
    import subprocess
    import sys

    root = FIXTURES.parents[1]
    p = subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True, cwd=root,
                       env={**os.environ, "PYTHONPATH": str(root), "PYTHONIOENCODING": "utf-8"}, timeout=300)
    p.stdout, p.stderr = p.stdout.decode("utf-8"), p.stderr.decode("utf-8")
    return p


# The generation CLI: `python -m mlx_qwen3vl` where the package has a __main__, else the module.
CLI = "mlx_qwen3vl" if (FIXTURES.parents[1] / "mlx_qwen3vl" / "__main__.py").is_file() else "mlx_qwen3vl.generate"


def test_cli_on_the_hub_checkpoint_gives_transformers_tokens():
    image = FIXTURES / "media" / "img_123x77.png"
    p = run_module(CLI, "--model", FIXTURES / "tiny-moe-hub", "--image", image,
                   "--prompt", "Describe the image.", "--max-tokens", "16")
    assert p.returncode == 0, p.stderr
    model, processor = load_fixture_model("tiny-moe-hub"), M.Processor.from_pretrained(FIXTURES / "tiny-moe-hub")
    from PIL import Image

    api = M.generate(model, processor, "Describe the image.", images=[Image.open(image)], max_tokens=16)
    assert api.token_ids == ref("image")["greedy"][0].tolist()  # transformers' tokens
    assert p.stdout.strip("\n") == api.text.strip("\n")


def test_cli_convert_then_generate_4bit(tmp_path):
    out = tmp_path / "q4"
    p = run_module("mlx_qwen3vl.convert", "--hf-path", FIXTURES / "tiny-moe", "--mlx-path", out, "-q",
                   "--q-group-size", "32")
    assert p.returncode == 0, p.stderr
    assert "mixture of experts (top-4 of 16)" in p.stderr
    model, processor = load_model(out), M.Processor.from_pretrained(out)
    expected = M.generate(model, processor, "Where is the search box?", max_tokens=8)
    p = run_module(CLI, "--model", out, "--prompt", "Where is the search box?", "--max-tokens", "8")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip("\n") == expected.text.strip("\n") and expected.generation_tokens == 8


# ---------------------------------------------------------------------------------------------
# The CPU path's experts (numpy, grouped by expert) against MLX's gather_mm
# ---------------------------------------------------------------------------------------------
def poisoned_block(tokens, seed=3):
    """A random MoE block whose experts that `tokens` do not select hold NaN: any read of them would
    show in the output."""
    from mlx_qwen3vl.cpu import layers

    config = text_config(num_experts=64, num_experts_per_tok=3)
    block = SparseMoeBlock(config)
    mx.random.seed(seed)
    block.update(tree_map(lambda w: mx.random.normal(w.shape) * 0.2, block.parameters()))
    chosen = np.unique(np.array(route(block.gate(tokens), 3)[0]))
    unused = np.setdiff1d(np.arange(64), chosen)
    assert len(unused) > 0
    for proj in (block.switch_mlp.gate_proj, block.switch_mlp.up_proj, block.switch_mlp.down_proj):
        w = np.array(proj.weight)
        w[unused] = np.nan
        proj.weight = mx.array(w)
    cpu = SparseMoeBlock(config)
    cpu.update(block.parameters())
    cpu.__class__ = layers.SparseMoeBlock
    return block, cpu


@pytest.mark.parametrize("shape", [(1, 1), (2, 1), (2, 37)])  # decode, batched decode, prefill chunk
def test_cpu_experts_equal_mlx_and_read_only_the_chosen_experts(shape, on_cpu):
    x = mx.random.normal((*shape, 64), key=mx.random.key(9))
    mlx_block, cpu_block = poisoned_block(x)
    ours, theirs = np.array(cpu_block(x)), np.array(mlx_block(x))
    assert np.isfinite(ours).all() and np.isfinite(theirs).all()
    assert rel_err(ours, theirs) < 1e-5  # float32 summation order only


@pytest.mark.parametrize("backend_name", ["cpu", "cpu-all"])
def test_cpu_decode_stack_runs_the_expert_layers(backend_name, monkeypatch, on_cpu):
    """The one-token decode stack takes MoE models (their expert layers through experts_into) and
    leaves the same hidden states and KV cache as the MLX graph, over steps crossing the cache's
    256-slot growth."""
    from conftest import cpu_path_for_every_size
    from mlx_qwen3vl.cpu import decode, layers

    if backend_name == "cpu-all":
        cpu_path_for_every_size(monkeypatch)
    cpu, plain = load_fixture_model(REF, backend=backend_name), load_fixture_model(REF, backend="mlx")
    assert type(cpu.language_model) is layers.TextModel
    calls = []
    original = decode.decode_tokens
    monkeypatch.setattr(decode, "decode_tokens", lambda *a: calls.append(1) or original(*a))
    prompt = mx.random.normal((2, 254, 64), key=mx.random.key(5))
    steps = [mx.random.normal((2, 1, 64), key=mx.random.key(6 + i)) for i in range(4)]

    def run(model):
        text, cache = model.language_model, model.make_cache()
        outs = [text(prompt, mx.zeros((2,), mx.int32), None, cache)]
        outs += [text(t, mx.full((2,), 254 + i, mx.int32), None, cache) for i, t in enumerate(steps)]
        return [np.array(o) for o in outs] + [np.array(c.keys[:, :, :c.offset]) for c in cache]

    fast, pure = run(cpu), run(plain)
    assert len(calls) == len(steps)
    for a, b in zip(fast, pure):
        assert rel_err(a, b) < 5e-5


def test_mlxvlm_float_moe_layout_gives_the_hub_logits(converted, tmp_path):
    """mlx-vlm's unquantized layout (language_model.model.*.switch_mlp.*, vision_tower.*, no marker)
    loads to the same model as the hub folder. The converter writes that layout, so its float output
    without our marker is such a folder."""
    out, _ = converted("float")
    weights = mx.load(str(out / "model.safetensors"))
    assert "language_model.model.layers.0.mlp.switch_mlp.down_proj.weight" in weights
    assert any(k.startswith("vision_tower.") for k in weights)
    dst = tmp_path / "mlxvlm-float"
    shutil.copytree(out, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.pop("mlx_qwen3vl")
    (dst / "config.json").write_text(json.dumps(cfg))
    model, kind = build_model(dst)
    assert kind == "mlx-vlm"
    hub = load_fixture_model(REF, backend="mlx")
    assert np.array_equal(np.array(model(**case_inputs("image"))), np.array(hub(**case_inputs("image"))))
