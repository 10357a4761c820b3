"""The converter (python -m mlx_qwen3vl.convert), quantization, and loading the three kinds of
folder: hub, converted, and mlx-vlm's (mlx-community's) layout.

A quantized model is checked in three links, each of which can fail: the converter stores exactly
mx.quantize of the float conversion's weights (at each layer's recorded bits), the quantized
kernels compute what those weights decoded by numpy compute in float32, and more bits land closer
to the float model. Random weights with sharpened attention amplify rounding far beyond trained
ones, so how close a recipe lands (MEAN_COSINE) is recorded, and only its order asserted.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx_qwen3vl  # noqa: F401  (first: it picks the BLAS before mlx.core loads)
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from conftest import CASES, FIXTURES, case_inputs, load_fixture_model, rel_err
from mlx_qwen3vl import convert as convert_mod
from mlx_qwen3vl.convert import convert
from mlx_qwen3vl.errors import ConfigError, InputError, ModelNotFoundError, WeightsError
from mlx_qwen3vl.weights import build_model, load_model

ROOT = Path(__file__).resolve().parents[1]
GROUP = {"tiny-a": 64, "tiny-b": 32}  # tiny-b's width (96) is not a multiple of 64
QUIET = lambda msg: None  # noqa: E731

# Mean cosine between the quantized and the float model's last-position logits over the 6 rows of
# every case (CPU, float32 compute), most bits first: the order the ordering test asserts.
MEAN_COSINE = {
    "tiny-a": {"q8": 0.9979, "mixed_4_8": 0.8007, "q4": 0.7711, "mixed_3_6": 0.6874},
    "tiny-b": {"q8": 0.9948, "mixed_4_8": 0.6920, "q4": 0.6733, "mixed_3_6": 0.5340},
}
RECIPES = {
    "q8": dict(quantize=True, q_bits=8),
    "q4": dict(quantize=True, q_bits=4),
    "mixed_4_8": dict(quantize=True, quant_predicate="mixed_4_8"),
    "mixed_3_6": dict(quantize=True, quant_predicate="mixed_3_6"),
}


def one_line(excinfo):
    msg = str(excinfo.value)
    assert msg and "\n" not in msg
    return msg


def run_cli(*args, env=None):
    cmd = [sys.executable, "-m", "mlx_qwen3vl.convert"]
    full_env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    return subprocess.run(cmd + [str(a) for a in args], capture_output=True, text=True, env=full_env, cwd=ROOT,
                          timeout=300)


def assert_one_line_error(result, *needles):
    """Exit status 2 and one error line on stderr (after any `convert:` progress lines), no traceback."""
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if not line.startswith("convert: ")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def last_logits(model, cases=CASES):
    return {c: np.array(model(**case_inputs(c))[:, -1].astype(mx.float32)) for c in cases}


def cosines(logits, ref):
    """Cosine between each row's last-position logits and the reference's, over every case."""
    return [float((a * b).sum() / np.linalg.norm(a) / np.linalg.norm(b)) for c in ref for a, b in zip(logits[c], ref[c])]


def greedy(model, inputs, n=6):
    """Greedy decoding by re-running the whole sequence (no cache needed)."""
    inputs, tokens = dict(inputs), []
    for _ in range(n):
        t = np.array(model(**inputs)[:, -1].argmax(-1)).astype(np.int64)[:, None]
        tokens.append(t)
        for key, extra in (("input_ids", t), ("attention_mask", np.ones_like(t)), ("mm_token_type_ids", np.zeros_like(t))):
            inputs[key] = np.concatenate([inputs[key], extra], 1)
    return np.concatenate(tokens, 1)


def quantized_layers(model):
    return {p: m for p, m in model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))}


def dequantized_copy(model):
    """The same model with every quantized layer replaced by a float32 layer holding its weight as
    numpy decodes it from the stored packed values (numpy_quant, independent of mx.dequantize):
    what the quantized kernels must compute."""
    import copy

    from mlx.utils import tree_unflatten
    from numpy_quant import dequantize

    copied, swaps = copy.deepcopy(model), []
    for path, q in quantized_layers(copied).items():
        biases = q.get("biases")
        w = dequantize(np.array(q.weight), np.array(q.scales.astype(mx.float32) if q.mode == "affine" else q.scales),
                       None if biases is None else np.array(biases.astype(mx.float32)), q.group_size, q.bits, q.mode)
        layer = nn.Embedding(*w.shape) if isinstance(q, nn.QuantizedEmbedding) else nn.Linear(w.shape[1], w.shape[0],
                                                                                                bias="bias" in q)
        layer.weight = mx.array(w.astype(np.float32))
        if "bias" in q:
            layer.bias = q.bias
        swaps.append((path, layer))
    copied.update_modules(tree_unflatten(swaps))
    return copied


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Conversions made once per module: (checkpoint, recipe) → folder."""
    root = tmp_path_factory.mktemp("converted")
    made = {}

    def get(checkpoint, recipe="float", **extra):
        key = (checkpoint, recipe, tuple(sorted(extra.items())))
        if key not in made:
            kwargs = dict(RECIPES.get(recipe, {}), **extra)
            if kwargs.get("quantize") and kwargs.get("q_mode", "affine") == "affine":
                kwargs.setdefault("q_group_size", GROUP[checkpoint])
            out = root / f"{checkpoint}-{recipe}-{len(made)}"
            made[key] = convert(FIXTURES / checkpoint, out, log=QUIET, **kwargs)
        return made[key]

    return get


# ---------------------------------------------------------------------------------------------
# Float conversion: identical logits, in a fresh process
# ---------------------------------------------------------------------------------------------
LOAD_AND_DUMP = """
import sys, numpy as np
sys.path.insert(0, {tests!r})
from conftest import CASES, case_inputs
from mlx_qwen3vl.weights import build_model
out = {{}}
for hub, path, dtype in {jobs!r}:
    model, kind = build_model(path, dtype)
    assert kind == "mlx_qwen3vl", kind
    reference, kind = build_model(hub, dtype)
    assert kind == "hub", kind
    for c in (CASES if dtype == "float32" else ["text", "image"]):
        out[f"{{path}}|{{dtype}}|{{c}}"] = np.array(model(**case_inputs(c)).astype(__import__("mlx.core").core.float32))
        out[f"{{hub}}|{{dtype}}|{{c}}"] = np.array(reference(**case_inputs(c)).astype(__import__("mlx.core").core.float32))
np.savez({dump!r}, **out)
"""


def test_float_conversion_gives_the_hub_logits_in_a_fresh_process(tmp_path):
    a, b = tmp_path / "tiny-a-mlx", tmp_path / "tiny-b-mlx"
    r = run_cli("--hf-path", FIXTURES / "tiny-a", "--mlx-path", a)
    assert r.returncode == 0, r.stderr
    assert "ready" in r.stderr and r.stdout == ""  # progress on stderr
    r = run_cli("--hf-path", FIXTURES / "tiny-b", "--mlx-path", b)
    assert r.returncode == 0, r.stderr

    hub_a, hub_b = str(FIXTURES / "tiny-a"), str(FIXTURES / "tiny-b")
    jobs = [(hub_a, str(a), "float32"), (hub_a, str(a), "bfloat16"), (hub_b, str(b), "float32")]
    dump = tmp_path / "logits.npz"
    code = LOAD_AND_DUMP.format(tests=str(ROOT / "tests"), jobs=jobs, dump=str(dump))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, r.stderr
    fresh = np.load(dump)
    for hub, path, dtype in jobs:
        for c in (CASES if dtype == "float32" else ["text", "image"]):
            ours, expected = fresh[f"{path}|{dtype}|{c}"], fresh[f"{hub}|{dtype}|{c}"]
            assert np.isfinite(ours).all() and np.array_equal(ours, expected), (path, dtype, c)


def test_converted_folder_layout(tmp_path):
    out = convert(FIXTURES / "tiny-a", tmp_path / "out", max_shard_bytes=400_000, log=QUIET)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["mlx_qwen3vl"]["format_version"] == 2 and cfg["mlx_qwen3vl"]["dtype"] == "bfloat16"
    assert cfg["torch_dtype"] == "bfloat16" and "quantization" not in cfg
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) > 1 and sorted(set(index["weight_map"].values())) == [s.name for s in shards]
    weights = {}
    for s in shards:
        shard = mx.load(str(s))
        assert sum(v.nbytes for v in shard.values()) <= 400_000 or len(shard) == 1
        weights.update(shard)
    assert set(weights) == set(index["weight_map"])
    assert weights["vision_tower.patch_embed.proj.weight"].shape == (64, 2, 16, 16, 3)  # MLX Conv3d, as mlx-vlm
    assert all(k.startswith(("vision_tower.", "language_model.model.")) for k in weights)  # mlx-vlm's names
    assert not any("lm_head" in k for k in weights)  # tied: no head
    assert all(v.dtype == mx.bfloat16 for v in weights.values())
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "preprocessor_config.json",
                 "video_preprocessor_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (FIXTURES / "tiny-a" / name).read_bytes()
    assert not (out / "reference").exists()
    assert oct(out.stat().st_mode & 0o777) != oct(0o700)  # not left private like a temp folder


def test_dtype_option(tmp_path):
    out = convert(FIXTURES / "tiny-b", tmp_path / "fp16", dtype="float16", log=QUIET)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dtype"] == "float16" and "torch_dtype" not in cfg  # transformers-5 layout kept
    assert {v.dtype for v in mx.load(str(out / "model.safetensors")).values()} == {mx.float16}
    ours = np.array(load_model(out, "float16")(**case_inputs("image")).astype(mx.float32))
    hub = np.array(load_fixture_model("tiny-b", "float16")(**case_inputs("image")).astype(mx.float32))
    assert np.array_equal(ours, hub)


# ---------------------------------------------------------------------------------------------
# Quantization
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def float_reference(converted):
    """Last-position logits of the float conversion, per checkpoint (computed once)."""
    cache = {}

    def get(checkpoint):
        if checkpoint not in cache:
            cache[checkpoint] = last_logits(load_model(converted(checkpoint), "float32"))
        return cache[checkpoint]

    return get


@pytest.mark.parametrize("checkpoint", ["tiny-a", "tiny-b"])
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_quantized_layers_hold_the_float_weights_quantized(converted, checkpoint, recipe):
    """Each quantized layer stores exactly mx.quantize of the float conversion's weight (in the
    stored dtype) at the layer's own bits and group size: the right weights, the bits the folder
    says, nothing lost on the way to disk and back."""
    dtype = json.loads((converted(checkpoint) / "config.json").read_text())["mlx_qwen3vl"]["dtype"]
    float_params = dict(tree_flatten(build_model(converted(checkpoint), dtype)[0].parameters()))
    layers = quantized_layers(load_model(converted(checkpoint, recipe), "float32"))
    assert len(layers) == {"tiny-a": 22, "tiny-b": 30}[checkpoint]
    for path, layer in layers.items():
        expected = mx.quantize(float_params[f"{path}.weight"], layer.group_size, layer.bits, mode=layer.mode)
        stored = (layer.weight, layer.scales, layer.biases)
        for name, want, got in zip(("weight", "scales", "biases"), expected, stored):
            assert np.array_equal(np.array(want.astype(got.dtype)), np.array(got)), (path, name)


@pytest.mark.parametrize("checkpoint", ["tiny-a", "tiny-b"])
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_quantized_kernels_compute_the_dequantized_model(converted, checkpoint, recipe):
    """The quantized model's logits are the float32 model on its numpy-decoded weights up to
    summation order (measured: at most 1.2e-5), on every case."""
    model = load_model(converted(checkpoint, recipe), "float32")
    reference = dequantized_copy(model)
    assert quantized_layers(model) and not quantized_layers(reference)
    for case in CASES:
        assert rel_err(model(**case_inputs(case)), reference(**case_inputs(case))) < 3e-5, case


@pytest.mark.parametrize("checkpoint", ["tiny-a", "tiny-b"])
def test_more_bits_land_closer_to_the_float_model(converted, float_reference, checkpoint):
    """Mean cosine to the float model falls with the bits, in MEAN_COSINE's order (a mixed recipe
    that lost its high-bit layers would tie with its low bits), and 8 bits is close on every row."""
    ref = float_reference(checkpoint)
    cos = {r: cosines(last_logits(load_model(converted(checkpoint, r), "float32")), ref) for r in RECIPES}
    means = [float(np.mean(cos[r])) for r in MEAN_COSINE[checkpoint]]
    assert all(a > b + 0.01 for a, b in zip(means, means[1:])), dict(zip(MEAN_COSINE[checkpoint], means))
    assert min(cos["q8"]) > 0.98, cos["q8"]


@pytest.mark.parametrize("recipe", ["q8", "q4"])
def test_quantized_models_generate(converted, recipe):
    """Greedy decoding runs on the quantized kernels and gives what the dequantized weights give."""
    model = load_model(converted("tiny-a", recipe), "float32")
    reference = dequantized_copy(model)
    assert not quantized_layers(reference)
    tokens = greedy(model, case_inputs("image"))
    assert tokens.shape == (1, 6) and np.all((tokens >= 0) & (tokens < 448))
    assert np.array_equal(tokens, greedy(reference, case_inputs("image")))
    if recipe == "q8":  # 8 bits follows the float model's greedy text continuation here (4 bits does not)
        float_model = load_model(converted("tiny-a"), "float32")
        assert np.array_equal(greedy(model, case_inputs("text")), greedy(float_model, case_inputs("text")))


def test_what_gets_quantized(converted):
    out = converted("tiny-a", "q4")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    model = load_model(out)
    layers = quantized_layers(model)
    assert isinstance(layers["language_model.embed_tokens"], nn.QuantizedEmbedding)  # tied head too
    assert "language_model.layers.2.mlp.down_proj" in layers
    assert not any(p.startswith("visual.") for p in layers)  # vision only with --quantize-vision
    params = dict(tree_flatten(model.parameters()))
    assert params["language_model.norm.weight"].dtype == mx.float32  # norms never
    assert params["visual.blocks.0.attn.qkv.bias"].dtype == mx.float32
    assert len(layers) == 1 + 3 * 7  # embedding + 7 linears per decoder layer

    untied = load_model(converted("tiny-b", "q4"))
    assert isinstance(quantized_layers(untied)["lm_head"], nn.QuantizedLinear)
    # group 64 on tiny-b: layers reading the 96-wide hidden state stay float, the others quantize
    partial = quantized_layers(load_model(converted("tiny-b", "q4", q_group_size=64, allow_float_layers=True)))
    assert "language_model.layers.0.self_attn.q_proj" not in partial and "lm_head" not in partial
    assert "language_model.layers.0.self_attn.o_proj" in partial and "language_model.layers.0.mlp.down_proj" in partial


def test_quantize_vision(converted):
    out = converted("tiny-a", "q4", quantize_vision=True)
    assert json.loads((out / "config.json").read_text())["mlx_qwen3vl"]["quantized_vision"] is True
    layers = quantized_layers(load_model(out))
    assert "visual.blocks.0.attn.qkv" in layers and "visual.merger.linear_fc2" in layers
    assert "visual.deepstack_merger_list.1.linear_fc1" in layers
    assert "visual.patch_embed.proj" not in layers and "visual.pos_embed" not in layers
    assert sum(f.stat().st_size for f in out.glob("*.safetensors")) < \
        sum(f.stat().st_size for f in converted("tiny-a", "q4").glob("*.safetensors"))


def test_mixed_recipe_records_per_layer_bits(converted):
    out = converted("tiny-b", "mixed_3_6")
    q = json.loads((out / "config.json").read_text())["quantization"]
    assert (q["bits"], q["group_size"], q["mode"]) == (3, 32, "affine")
    # 4 layers: the first/last eighth is layer 3 only (4 // 8 == 0), and every third from 0 is 2
    high = {k for k, v in q.items() if isinstance(v, dict)}
    assert high == {"language_model.lm_head", "language_model.model.embed_tokens",  # mlx-vlm's names
                    "language_model.model.layers.2.self_attn.v_proj", "language_model.model.layers.2.mlp.down_proj",
                    "language_model.model.layers.3.self_attn.v_proj", "language_model.model.layers.3.mlp.down_proj"}
    assert all(q[k]["bits"] == 6 for k in high)
    layers = quantized_layers(load_model(out))
    assert layers["language_model.layers.3.mlp.down_proj"].bits == 6
    assert layers["language_model.layers.1.mlp.down_proj"].bits == 3


def float64_reference(checkpoint, recipe, case):
    """transformers in float64 on the weights numpy decodes from the stored packed values (made by
    tests/fixtures/make_quant_reference.py), and the digest of the packed values it decoded."""
    ref = np.load(FIXTURES / "quant-reference" / f"{checkpoint}-{recipe}.npz")
    return ref[case], str(ref["digest"])


def assert_matches_float64(model, folder, checkpoint, recipe, bound=1e-4):
    """Every real (unpadded) position of the image and batch cases within `bound` of the exact answer."""
    from numpy_quant import packed_digest

    stored = {}
    for f in folder.glob("*.safetensors"):
        stored.update({k: np.array(v) for k, v in mx.load(str(f)).items() if not mx.issubdtype(v.dtype, mx.floating)})
    for case in ("image", "batch"):
        expected, digest = float64_reference(checkpoint, recipe, case)
        assert packed_digest(stored) == digest, "the quantizer now stores other values: rerun make_quant_reference.py"
        real = case_inputs(case)["attention_mask"] == 1
        ours = np.array(model(**case_inputs(case)).astype(mx.float32))
        assert rel_err(ours[real], expected[real]) < bound, (case, rel_err(ours[real], expected[real]))


@pytest.mark.parametrize("checkpoint", ["tiny-a", "tiny-b"])
@pytest.mark.parametrize("mode,bits,group", [("mxfp4", 4, 32), ("nvfp4", 4, 16), ("mxfp8", 8, 32)])
def test_other_quantization_modes(converted, checkpoint, mode, bits, group):
    """The fp modes compute in float32 when loaded in float32 (their quantized embedding returned
    bfloat16 before, 1.5e-2 off the exact answer), within float32 noise of the float64 answer."""
    out = converted(checkpoint, mode, quantize=True, q_mode=mode)
    assert json.loads((out / "config.json").read_text())["quantization"] == {"group_size": group, "bits": bits, "mode": mode}
    model = load_model(out, "float32")
    assert {(m.mode, m.bits, m.group_size) for m in quantized_layers(model).values()} == {(mode, bits, group)}
    assert model.language_model.embed_tokens(mx.array([[1, 2]])).dtype == mx.float32
    assert_matches_float64(model, out, checkpoint, mode)


@pytest.mark.parametrize("checkpoint,recipe", [("tiny-a", "float"), ("tiny-a", "q8"), ("tiny-b", "q4"),
                                               ("tiny-b", "mixed_4_8")])
def test_affine_recipes_against_float64(converted, checkpoint, recipe):
    out = converted(checkpoint, recipe)
    assert_matches_float64(load_model(out, "float32"), out, checkpoint, recipe)


def test_numpy_decoder_is_mlx_dequantize(converted):
    """The reference's decoder reads the stored values as MLX does (for every mode on a real layer)."""
    from numpy_quant import dequantize

    for recipe, extra in (("q4", {}), ("mxfp4", dict(quantize=True, q_mode="mxfp4")),
                          ("nvfp4", dict(quantize=True, q_mode="nvfp4")), ("mxfp8", dict(quantize=True, q_mode="mxfp8"))):
        layer = load_model(converted("tiny-a", recipe, **extra), "float32").language_model.layers[1].mlp.down_proj
        biases = layer.get("biases")
        ours = dequantize(np.array(layer.weight), np.array(layer.scales), None if biases is None else np.array(biases),
                          layer.group_size, layer.bits, layer.mode)
        theirs = mx.dequantize(layer.weight, layer.scales, biases, layer.group_size, layer.bits, layer.mode,
                               dtype=mx.float32)
        assert np.allclose(ours, np.array(theirs), rtol=0, atol=1e-6 * np.abs(ours).max()), recipe


def test_sizes_on_disk(converted):
    size = lambda p: sum(f.stat().st_size for f in p.glob("*.safetensors"))  # noqa: E731
    float_b, q8_b, q4_b = size(converted("tiny-b")), size(converted("tiny-b", "q8")), size(converted("tiny-b", "q4"))
    assert q4_b < q8_b < 0.6 * float_b  # from fp32: 1838 kB and 1537 kB of 3487 kB (the vision tower stays float)


def test_reconvert_quantized_mlxvlm_folder(tmp_path):
    out = convert(FIXTURES / "mlxvlm-q4", tmp_path / "ours", log=QUIET)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    ours, kind = build_model(out, "float32")
    theirs, their_kind = build_model(FIXTURES / "mlxvlm-q4", "float32")
    assert (kind, their_kind) == ("mlx_qwen3vl", "mlx-vlm")
    assert np.array_equal(np.array(ours(**case_inputs("image"))), np.array(theirs(**case_inputs("image"))))
    with pytest.raises(InputError) as e:
        convert(FIXTURES / "mlxvlm-q4", tmp_path / "again", quantize=True, log=QUIET)
    assert "already quantized" in one_line(e)


# ---------------------------------------------------------------------------------------------
# mlx-vlm (mlx-community) folders
# ---------------------------------------------------------------------------------------------
def test_mlxvlm_float_folder_gives_the_hub_logits():
    model, kind = build_model(FIXTURES / "mlxvlm-float", "float32")
    assert kind == "mlx-vlm"
    hub = load_fixture_model("tiny-a", "float32", backend="mlx")  # build_model installs no backend
    for case in CASES:
        assert np.array_equal(np.array(model(**case_inputs(case))), np.array(hub(**case_inputs(case)))), case


@pytest.mark.parametrize("name", ["mlxvlm-q4", "mlxvlm-mixed_3_6", "mlxvlm-untied-mixed_3_6"])
def test_mlxvlm_quantized_folder_gives_mlxvlms_logits(name):
    model, kind = build_model(FIXTURES / name, "float32")
    assert kind == "mlx-vlm" and quantized_layers(model)
    recorded = np.load(FIXTURES / name / "reference" / "image.npz")["logits"]  # made by mlx-vlm itself
    logits = np.array(model(**case_inputs("image")))
    assert rel_err(logits, recorded) < 1e-4
    assert np.array_equal(logits.argmax(-1), recorded.argmax(-1))


def test_mlxvlm_mixed_per_layer_bits_are_honoured():
    layers = quantized_layers(load_model(FIXTURES / "mlxvlm-mixed_3_6"))
    assert layers["language_model.layers.2.self_attn.v_proj"].bits == 6  # mlx-vlm's per-layer entry
    assert layers["language_model.layers.1.self_attn.v_proj"].bits == 3
    assert layers["language_model.embed_tokens"].bits == 6
    untied = quantized_layers(load_model(FIXTURES / "mlxvlm-untied-mixed_3_6"))
    assert untied["lm_head"].bits == 6  # its override is `language_model.lm_head`, no trailing dot


# ---------------------------------------------------------------------------------------------
# mlx-vlm (and LM Studio, which runs on it) reading our folders
# ---------------------------------------------------------------------------------------------
sys.path.insert(0, str(FIXTURES))
from make_mlxvlm_fixture import CASE, OURS, OURS_CASE, mlx_vlm_logits  # noqa: E402


@pytest.mark.parametrize("name", sorted(OURS))
def test_mlxvlm_reads_our_folders_with_our_logits(tmp_path, name):
    """What mlx-vlm 0.7.10 computed from our folders (recorded by make_mlxvlm_fixture.py, with the
    sha256 of every tensor it read): today's converter writes those bytes, and our logits agree.
    mlx-vlm computes the fp modes' embedding in bfloat16 (see docs/convert.md), hence their bound."""
    from numpy_quant import tensors_digest

    source, kwargs = OURS[name]
    out = convert(FIXTURES / source, tmp_path / name, log=QUIET, **kwargs)
    recorded = np.load(FIXTURES / "mlxvlm-reads-ours" / f"{name}.npz")
    assert tensors_digest(out) == str(recorded["digest"]), "the converter writes other bytes: rerun the fixture"
    ours = np.array(load_model(out, "float32")(**case_inputs(OURS_CASE.get(name, CASE))))
    bound = 3e-2 if kwargs.get("q_mode") else 1e-4
    assert rel_err(ours, recorded["logits"]) < bound
    assert (ours.argmax(-1) == recorded["logits"].argmax(-1)).mean() > (0.95 if kwargs.get("q_mode") else 0.999)


# What mlx-vlm 0.7.10 requires of a qwen3_vl_moe config (mlx_vlm/models/qwen3_vl_moe/config.py and
# vision.py): every TextConfig field without a default (from_dict leaves a text_config lacking one
# undeserialized, and the model fails to build), rope_scaling with mrope_section and a default /
# mrope type, and the vision model_type its VisionModel accepts.
MLX_VLM_MOE_TEXT_FIELDS = ("model_type", "num_hidden_layers", "hidden_size", "intermediate_size",
                           "num_attention_heads", "num_experts", "num_experts_per_tok", "decoder_sparse_step",
                           "mlp_only_layers", "moe_intermediate_size", "rms_norm_eps", "vocab_size",
                           "num_key_value_heads", "head_dim", "rope_theta", "max_position_embeddings")


@pytest.mark.parametrize("kwargs", [{}, dict(quantize=True, q_bits=4, q_group_size=32)], ids=["float", "q4"])
@pytest.mark.parametrize("source", ["tiny-moe", "tiny-moe-hub"])
def test_converted_moe_config_is_what_mlxvlm_reads(tmp_path, source, kwargs):
    """tiny-moe is transformers 5's layout (num_local_experts, qwen3_vl_moe_vision, rope_parameters),
    tiny-moe-hub 4.57's: both convert to a config.json mlx-vlm 0.7.10 builds its model from."""
    out = convert(FIXTURES / source, tmp_path / "out", log=QUIET, **kwargs)
    cfg = json.loads((out / "config.json").read_text())
    text = cfg["text_config"]
    assert [k for k in MLX_VLM_MOE_TEXT_FIELDS if k not in text] == []
    assert text["num_experts"] == 16 and cfg["vision_config"]["model_type"] == "qwen3_vl_moe"
    rope = text["rope_scaling"]
    assert "mrope_section" in rope and rope.get("type", rope.get("rope_type")) in ("mrope", "default")
    assert load_model(out).config.text_config.num_experts == 16  # and we still read it


@pytest.mark.parametrize("name", ["tiny-a-q4-vision", "tiny-b-float", "tiny-moe-float", "tiny-moe-q4"])
def test_mlxvlm_live_reads_our_folders(tmp_path, name):
    """The same with mlx-vlm itself, where it is installed (it is not a test dependency: it pulls
    datasets, pyarrow, pandas, opencv and mlx-audio; the recorded test above runs everywhere)."""
    pytest.importorskip("mlx_vlm")
    source, kwargs = OURS[name]
    case = OURS_CASE.get(name, CASE)
    out = convert(FIXTURES / source, tmp_path / name, log=QUIET, **kwargs)
    ours = np.array(load_model(out, "float32")(**case_inputs(case)))
    theirs = mlx_vlm_logits(out, case)
    assert rel_err(ours, theirs) < 1e-4 and np.array_equal(ours.argmax(-1), theirs.argmax(-1))


# ---------------------------------------------------------------------------------------------
# Strict loading for every kind, bad inputs, atomicity
# ---------------------------------------------------------------------------------------------
def _drop_tensor(folder: Path, key: str):
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = folder / index["weight_map"].pop(key)
    weights = mx.load(str(shard))
    del weights[key]
    mx.save_safetensors(str(shard), weights)
    index_path.write_text(json.dumps(index))


def test_strict_checks_for_converted_and_mlxvlm_folders(converted, tmp_path):
    import shutil

    ours = tmp_path / "ours"
    shutil.copytree(converted("tiny-a", "q4"), ours)
    _drop_tensor(ours, "language_model.model.layers.1.mlp.up_proj.scales")
    with pytest.raises(WeightsError) as e:
        load_model(ours)
    assert "missing 1: language_model.layers.1.mlp.up_proj.scales" in one_line(e)

    theirs = tmp_path / "theirs"
    shutil.copytree(FIXTURES / "mlxvlm-float", theirs)
    weights = mx.load(str(theirs / "model.safetensors"))
    weights["vision_tower.merger.linear_fc2.weight"] = mx.zeros((3, 3), mx.bfloat16)
    weights["language_model.model.layers.7.mlp.up_proj.weight"] = mx.zeros((4, 4), mx.bfloat16)
    mx.save_safetensors(str(theirs / "model.safetensors"), weights)
    index = json.loads((theirs / "model.safetensors.index.json").read_text())
    index["weight_map"]["language_model.model.layers.7.mlp.up_proj.weight"] = "model.safetensors"
    (theirs / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightsError) as e:
        load_model(theirs)
    msg = one_line(e)
    assert "language_model.layers.7.mlp.up_proj.weight" in msg and "visual.merger.linear_fc2.weight (3, 3)" in msg


def test_quantized_weights_without_quantization_config(converted, tmp_path):
    import shutil

    folder = tmp_path / "q"
    shutil.copytree(converted("tiny-a", "q4"), folder)
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["quantization"], cfg["quantization_config"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightsError) as e:
        load_model(folder)
    assert "no quantization section" in one_line(e)


def test_truncated_shard(converted, tmp_path):
    import shutil

    folder = tmp_path / "t"
    shutil.copytree(converted("tiny-a", "q8"), folder)
    shard = folder / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(WeightsError) as e:
        load_model(folder)
    assert "model.safetensors" in one_line(e)
    r = run_cli("--hf-path", folder, "--mlx-path", tmp_path / "out")  # converting from it fails the same way
    assert_one_line_error(r, "model.safetensors", "could not be read")
    assert not (tmp_path / "out").exists()


def test_missing_index_entry(converted, tmp_path):
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(converted("tiny-a", "q4"), folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    del index["weight_map"]["language_model.model.layers.0.mlp.gate_proj.scales"]
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightsError) as e:
        load_model(folder)
    assert "missing from the index: language_model.model.layers.0.mlp.gate_proj.scales" in one_line(e)


BAD_OPTIONS = [
    (["-q", "--q-bits", "7"], "--q-bits 7 is not supported"),
    (["-q", "--q-bits", "four"], "'four' is not a whole number"),
    (["-q", "--q-group-size", "48"], "--q-group-size 48 is not supported"),
    (["-q", "--q-mode", "mxfp4", "--q-bits", "8"], "mxfp4 always uses 4 bits"),
    (["-q", "--q-mode", "int4"], "--q-mode 'int4' is not one of"),
    (["-q", "--quant-predicate", "mixed_6_4"], "is not a mixed recipe"),
    (["-q", "--quant-predicate", "mixed_3_6", "--q-mode", "nvfp4"], "cannot be used with --q-mode nvfp4"),
    (["--q-bits", "4"], "without -q"),
    (["--dtype", "float64"], "--dtype 'float64'"),
]


@pytest.mark.parametrize("args,needle", BAD_OPTIONS)
def test_bad_options_are_one_line_errors(tmp_path, capsys, args, needle):
    try:
        code = convert_mod.main(["--hf-path", str(FIXTURES / "tiny-a"), "--mlx-path", str(tmp_path / "out"), *args])
    except SystemExit as e:  # argparse's own checks (not a number) exit from parse_args
        code = e.code
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], captured.err
    assert not list(tmp_path.iterdir())


def test_unsupported_q_bits_from_the_command_line(tmp_path):
    r = run_cli("--hf-path", FIXTURES / "tiny-a", "--mlx-path", tmp_path / "out", "-q", "--q-bits", "7")
    assert_one_line_error(r, "--q-bits 7 is not supported", "2, 3, 4, 5, 6, 8")
    assert not list(tmp_path.iterdir())


def test_unsupported_bits_in_python_api(tmp_path):
    with pytest.raises(InputError) as e:
        convert(FIXTURES / "tiny-a", tmp_path / "out", quantize=True, q_bits=1, log=QUIET)
    assert "--q-bits 1" in one_line(e)


def test_existing_output_refused_unless_force(tmp_path):
    out = convert(FIXTURES / "tiny-a", tmp_path / "out", log=QUIET)  # an earlier conversion
    (out / "keep.txt").write_text("mine")
    r = run_cli("--hf-path", FIXTURES / "tiny-b", "--mlx-path", out)
    assert_one_line_error(r, "already exists", "--force")
    assert (out / "keep.txt").read_text() == "mine" and len(list(tmp_path.iterdir())) == 1

    convert(FIXTURES / "tiny-b", out, force=True, log=QUIET)
    assert not (out / "keep.txt").exists() and (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp or backup folder left
    load_model(out)


def test_force_only_replaces_a_model_folder(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(InputError) as e:
        convert(FIXTURES / "tiny-b", tmp_path, force=True, log=QUIET)
    assert "no checkpoint" in one_line(e)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_output_may_not_replace_the_source(tmp_path):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "tiny-b", src, ignore=shutil.ignore_patterns("reference"))
    with pytest.raises(InputError) as e:
        convert(src, src, force=True, log=QUIET)
    assert "would replace the source" in one_line(e)
    load_model(src)


def test_interrupted_conversion_leaves_nothing_loadable(tmp_path, monkeypatch):
    real_save = mx.save_safetensors
    calls = []

    def save_then_fail(path, arrays, **kw):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt  # e.g. Ctrl-C while the second shard is written
        real_save(path, arrays, **kw)

    monkeypatch.setattr(convert_mod.mx, "save_safetensors", save_then_fail)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        convert(FIXTURES / "tiny-a", out, quantize=True, max_shard_bytes=300_000, log=QUIET)
    assert len(calls) == 2
    assert not out.exists() and list(tmp_path.iterdir()) == []  # the temporary folder is gone too
    with pytest.raises(ConfigError):
        load_model(out)


def test_interrupted_forced_conversion_keeps_the_old_output(tmp_path, monkeypatch):
    out = convert(FIXTURES / "tiny-b", tmp_path / "out", log=QUIET)
    before = (out / "model.safetensors").read_bytes()

    def fail(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(convert_mod, "copy_side_files", fail)
    with pytest.raises(RuntimeError):
        convert(FIXTURES / "tiny-b", out, force=True, quantize=True, q_group_size=32, log=QUIET)
    assert (out / "model.safetensors").read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    load_model(out)


def test_killed_conversion_folder_is_not_a_checkpoint(tmp_path):
    """A run killed outright (no cleanup) leaves only the hidden temporary folder, which has no
    config.json until the very end, so it never loads."""
    partial = tmp_path / ".out.converting-x"
    partial.mkdir()
    model = load_model(FIXTURES / "tiny-b")
    convert_mod.write_weights(partial, dict(tree_flatten(model.parameters())), log=QUIET)
    convert_mod.copy_side_files(FIXTURES / "tiny-b", partial)
    with pytest.raises(ConfigError) as e:
        load_model(partial)
    assert "config.json" in one_line(e)


def test_hub_id_is_downloaded_with_patterns(tmp_path, monkeypatch):
    import shutil

    from mlx_qwen3vl import hub

    seen = {}

    def fake_snapshot_download(repo_id, allow_patterns=None, **kw):
        seen.update(repo_id=repo_id, allow_patterns=allow_patterns)
        snap = tmp_path / "snapshot"
        shutil.copytree(FIXTURES / "tiny-b", snap, ignore=shutil.ignore_patterns("reference"))
        return str(snap)

    monkeypatch.setattr(hub, "snapshot_download", fake_snapshot_download)
    monkeypatch.setattr(hub, "get_hf_file_metadata", lambda url, **kw: seen.update(probed=url))  # the hub answers
    out = convert("Qwen/Qwen3-VL-2B-Instruct", tmp_path / "out", log=QUIET)
    assert seen["repo_id"] == "Qwen/Qwen3-VL-2B-Instruct" and seen["probed"].endswith("/config.json")
    patterns = seen["allow_patterns"]
    for name in ("model-00001-of-00002.safetensors", "model.safetensors.index.json", "config.json", "tokenizer.json",
                 "chat_template.jinja", "preprocessor_config.json", "video_preprocessor_config.json",
                 "generation_config.json"):
        assert any(__import__("fnmatch").fnmatch(name, p) for p in patterns), name
    assert "*" not in patterns and "*.bin" not in patterns
    assert json.loads((out / "config.json").read_text())["mlx_qwen3vl"]["converted_from"] == "Qwen/Qwen3-VL-2B-Instruct"


def test_hub_id_offline_is_one_line(tmp_path):
    r = run_cli("--hf-path", "Qwen/Qwen3-VL-2B-Instruct", "--mlx-path", tmp_path / "out",
                env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})
    line = assert_one_line_error(r, "Qwen/Qwen3-VL-2B-Instruct", "HF_HUB_OFFLINE")
    assert line.startswith("error: ")
    with pytest.raises(ModelNotFoundError) as e:
        convert(str(tmp_path / "no" / "such" / "folder"), tmp_path / "out", log=QUIET)
    assert "neither a local folder nor" in one_line(e)


# ---------------------------------------------------------------------------------------------
# Quantizing what the group size allows, and saying so
# ---------------------------------------------------------------------------------------------
def narrow_checkpoint(tmp_path):
    """A random checkpoint whose decoder widths (80, 160) no supported group size except 32 divides
    fully, and 64 divides none of: under this package's names, as a hand-made folder would be."""
    import shutil

    from mlx_qwen3vl.config import ModelConfig
    from mlx_qwen3vl.model import Qwen3VLForConditionalGeneration

    raw = json.loads((FIXTURES / "tiny-b" / "config.json").read_text())
    raw["text_config"].update(hidden_size=80, intermediate_size=160, head_dim=40)
    raw["text_config"]["rope_parameters"]["mrope_section"] = [8, 6, 6]
    raw["vision_config"]["out_hidden_size"] = 80
    model = Qwen3VLForConditionalGeneration(ModelConfig.from_dict(raw))
    folder = tmp_path / "narrow"
    folder.mkdir()
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(raw))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(FIXTURES / "tiny-b" / f, folder / f)
    return folder


@pytest.mark.parametrize("flags", [["-q"], ["-q", "--q-bits", "8"], ["-q", "--quant-predicate", "mixed_3_6"]])
def test_quantizing_nothing_is_an_error(tmp_path, flags):
    src = narrow_checkpoint(tmp_path)
    r = run_cli("--hf-path", src, "--mlx-path", tmp_path / "out", *flags)
    assert_one_line_error(r, "none of the 30 layers", "80, 160", "group size 64", "--q-group-size")
    assert not (tmp_path / "out").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["narrow"]


def test_mostly_float_quantization_needs_consent(tmp_path):
    """tiny-b with groups of 64: only o_proj/down_proj (29% of the weights) fit; asked to, it goes on
    and names how many layers it quantized."""
    r = run_cli("--hf-path", FIXTURES / "tiny-b", "--mlx-path", tmp_path / "out", "-q")
    assert_one_line_error(r, "only 8 of 30 layers", "29%", "--allow-float-layers")
    assert not (tmp_path / "out").exists()
    logged = []
    out = convert(FIXTURES / "tiny-b", tmp_path / "out", quantize=True, allow_float_layers=True, log=logged.append)
    summary = next(m for m in logged if "quantized" in m)
    assert "quantized 8 of 30 layers" in summary and "22 stay float" in summary and "96" in summary
    assert len(quantized_layers(load_model(out))) == 8
    logged.clear()
    convert(FIXTURES / "tiny-b", tmp_path / "all", quantize=True, q_group_size=32, log=logged.append)
    assert any("quantized 30 of 30 layers" in m for m in logged)


# ---------------------------------------------------------------------------------------------
# Folders that disagree with themselves
# ---------------------------------------------------------------------------------------------
def copy_fixture(tmp_path, name):
    import shutil

    dst = tmp_path / name
    shutil.copytree(FIXTURES / name, dst, ignore=shutil.ignore_patterns("reference"))
    return dst


def edit_shard(folder: Path, shard: str, **changes):
    weights = mx.load(str(folder / shard))
    weights.update(changes)
    mx.save_safetensors(str(folder / shard), weights)


def test_index_map_decides_between_copies(tmp_path):
    """A stray copy of a tensor in a shard the index does not name for it is ignored."""
    folder = copy_fixture(tmp_path, "tiny-a")
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.language_model.embed_tokens.weight"
    home, last = index[name], "model-00005-of-00005.safetensors"
    assert home != last
    stray = mx.zeros_like(mx.load(str(folder / home))[name])
    edit_shard(folder, last, **{name: stray})
    ours = np.array(load_model(folder, "float32")(**case_inputs("image")))
    assert np.array_equal(ours, np.array(load_fixture_model("tiny-a", "float32")(**case_inputs("image"))))


def test_duplicate_name_without_index_is_an_error(tmp_path):
    folder = copy_fixture(tmp_path, "tiny-b")
    name = "model.language_model.norm.weight"
    mx.save_safetensors(str(folder / "model-extra.safetensors"),
                        {name: mx.load(str(folder / "model.safetensors"))[name] * 2})
    with pytest.raises(WeightsError) as e:
        load_model(folder)
    msg = one_line(e)
    assert name in msg and "model.safetensors" in msg and "model-extra.safetensors" in msg


def test_tied_config_with_its_own_head(tmp_path):
    """transformers unties and uses a head the files hold; so do we (with a warning), and the
    converter writes the folder untied. A head equal to the embedding is just dropped."""
    folder = copy_fixture(tmp_path, "tiny-a")
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    embed_name = "model.language_model.embed_tokens.weight"
    shard = index["weight_map"][embed_name]
    embed = mx.load(str(folder / shard))[embed_name]
    index["weight_map"]["lm_head.weight"] = shard
    index_path.write_text(json.dumps(index))

    edit_shard(folder, shard, **{"lm_head.weight": embed})  # the same tensor: nothing to say
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = load_model(folder, "float32")
    assert model.config.tie_word_embeddings and "lm_head" not in model

    edit_shard(folder, shard, **{"lm_head.weight": embed * 2})  # exact in any float dtype
    with pytest.warns(UserWarning, match="different lm_head"):
        model = load_model(folder, "float32")
    tied = np.array(load_fixture_model("tiny-a", "float32")(**case_inputs("image")))
    assert not model.config.tie_word_embeddings
    assert np.array_equal(np.array(model(**case_inputs("image"))), 2 * tied)

    with pytest.warns(UserWarning):
        out = convert(folder, tmp_path / "out", log=QUIET)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False and cfg["text_config"]["tie_word_embeddings"] is False
    assert np.array_equal(np.array(load_model(out, "float32")(**case_inputs("image"))), 2 * tied)


def test_float16_overflow_is_refused(tmp_path):
    folder = copy_fixture(tmp_path, "tiny-a")
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.language_model.layers.1.mlp.up_proj.weight"
    w = mx.load(str(folder / index[name]))[name]
    edit_shard(folder, index[name], **{name: mx.concatenate([mx.full((1, w.shape[1]), 1e5, w.dtype), w[1:]])})
    r = run_cli("--hf-path", folder, "--mlx-path", tmp_path / "out", "--dtype", "float16")
    assert_one_line_error(r, "float16", "language_model.model.layers.1.mlp.up_proj.weight", "--dtype bfloat16")
    assert not (tmp_path / "out").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["tiny-a"]
    convert(folder, tmp_path / "out", log=QUIET)  # bfloat16 holds it


def test_shard_in_another_dtype_than_the_config(tmp_path):
    folder = copy_fixture(tmp_path, "tiny-a")  # config: bfloat16
    shard = "model-00002-of-00005.safetensors"
    weights = mx.load(str(folder / shard))
    mx.save_safetensors(str(folder / shard), {k: v.astype(mx.float16) for k, v in weights.items()})
    with pytest.raises(WeightsError) as e:
        load_model(folder)
    msg = one_line(e)
    assert shard in msg and "float16" in msg and "says bfloat16" in msg


def test_fixed_mode_with_wrong_group_size_in_config(converted, tmp_path):
    import shutil

    folder = tmp_path / "nv"
    shutil.copytree(converted("tiny-a", "nvfp4", quantize=True, q_mode="nvfp4"), folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization"]["group_size"] = cfg["quantization_config"]["group_size"] = 32
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as e:
        load_model(folder)
    assert "nvfp4 stores 4 bits in groups of 16, not 4 bits in groups of 32" in one_line(e)


# ---------------------------------------------------------------------------------------------
# What --force may replace
# ---------------------------------------------------------------------------------------------
def test_force_never_replaces_a_file_or_a_link(tmp_path):
    target = tmp_path / "notes.txt"
    target.write_text("mine")
    r = run_cli("--hf-path", FIXTURES / "tiny-b", "--mlx-path", target, "--force")
    assert_one_line_error(r, "is a file", "--force only replaces a model folder")
    assert target.read_text() == "mine"

    model_dir = convert(FIXTURES / "tiny-b", tmp_path / "model", log=QUIET)
    link = tmp_path / "link"
    link.symlink_to(model_dir)
    with pytest.raises(InputError) as e:
        convert(FIXTURES / "tiny-b", link, force=True, log=QUIET)
    assert "symbolic link" in one_line(e) and link.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "model", "notes.txt"]


def test_force_never_replaces_a_folder_with_sub_folders_or_no_weights(tmp_path):
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "config.json").write_text("{}")
    (project / "model.safetensors").write_bytes(b"")
    with pytest.raises(InputError) as e:
        convert(FIXTURES / "tiny-b", project, force=True, log=QUIET)
    assert "no checkpoint" in one_line(e) and (project / "src").is_dir()
    (project / "src").rmdir()
    (project / "model.safetensors").unlink()
    with pytest.raises(InputError):  # config.json alone is not a checkpoint
        convert(FIXTURES / "tiny-b", project, force=True, log=QUIET)
    empty = tmp_path / "empty"
    empty.mkdir()
    convert(FIXTURES / "tiny-b", empty, force=True, log=QUIET)  # an empty folder holds nothing to lose
    load_model(empty)


def test_format_1_folders_still_load(tmp_path):
    """Folders from the previous converter (this package's module names, matmul patch kernel)."""
    import shutil

    folder = tmp_path / "v1"
    folder.mkdir()
    model, _ = build_model(FIXTURES / "tiny-b", "float32")  # both sides without a backend installed
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    cfg = json.loads((FIXTURES / "tiny-b" / "config.json").read_text())
    cfg["mlx_qwen3vl"] = {"format_version": 1, "converted_from": "tiny-b", "dtype": "float32", "quantized_vision": False}
    (folder / "config.json").write_text(json.dumps(cfg))
    shutil.copyfile(FIXTURES / "tiny-b" / "tokenizer.json", folder / "tokenizer.json")
    loaded, kind = build_model(folder, "float32")
    assert kind == "mlx_qwen3vl"
    assert np.array_equal(np.array(loaded(**case_inputs("image"))), np.array(model(**case_inputs("image"))))
