"""The backend seam: load installs the CPU path exactly where it fits, the environment switch is
checked, and the model files stay plain MLX."""

import ast
from pathlib import Path

import mlx.core as mx
import numpy as np
import mlx.nn as nn
import pytest

from conftest import FIXTURES, case_inputs, load_fixture_model
from mlx_qwen3vl import blas, cpu, language, vision
from mlx_qwen3vl.backend import MLX, backend_of
from mlx_qwen3vl.errors import ConfigError
from mlx_qwen3vl.weights import load_model

PACKAGE = Path(language.__file__).parent


@pytest.mark.parametrize("name", ["language", "vision", "model", "rope"])
def test_model_files_are_plain_mlx(name):
    """No import of the CPU path, numpy kernels or the environment in the model files."""
    tree = ast.parse((PACKAGE / f"{name}.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
            imported.update(f"{node.module or ''}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
    assert not [m for m in imported if "cpu" in m.split(".") or m in ("os", "os.environ")], imported
    assert "mx.eval(" not in (PACKAGE / f"{name}.py").read_text()  # no host syncs inside a forward


def test_float32_on_cpu_gets_the_cpu_path(monkeypatch, on_cpu):
    monkeypatch.delenv("MLX_QWEN3VL_CPU_KERNELS", raising=False)
    model = load_model(FIXTURES / "tiny-a")
    assert isinstance(model.backend, cpu.CPUBackend) and backend_of(model) is model.backend
    assert model.backend.eager and "cpu path" in model.backend.describe()
    assert f"numpy's BLAS: {blas.numpy_blas()}" in model.backend.describe()  # the CPU path's GEMMs
    assert f"BLAS for MLX: {blas.describe()}" in model.backend.describe()  # what MLX's matmuls call
    assert type(model.language_model) is cpu.layers.TextModel
    assert all(type(layer.self_attn) is cpu.layers.Attention for layer in model.language_model.layers)
    assert all(type(block.mlp) is cpu.layers.VisionMLP for block in model.visual.blocks)
    caches = model.make_cache()
    assert all(type(c) is cpu.decode.KVCache for c in caches)
    from mlx_lm.models.cache import KVCache

    assert all(isinstance(c, KVCache) for c in caches)


@pytest.mark.parametrize("how", ["backend", "env"])
def test_mlx_graph_on_request(how, monkeypatch, on_cpu):
    if how == "env":
        monkeypatch.setenv("MLX_QWEN3VL_CPU_KERNELS", "mlx")
    model = load_model(FIXTURES / "tiny-a", backend="mlx" if how == "backend" else None)
    assert model.backend is MLX and not model.backend.eager
    assert model.backend.describe() == f"mlx graph on {mx.default_device()}; BLAS for MLX: {blas.describe()}"
    kinds = {type(m) for _, m in model.named_modules()}
    assert not any(k.__module__.startswith("mlx_qwen3vl.cpu") for k in kinds)
    from mlx_lm.models.cache import KVCache
    from mlx_qwen3vl import kv_cache

    # The package's cache type (mlx-lm's KVCache with its rows' operations), not the CPU path's.
    assert type(model.make_cache()[0]) is kv_cache.KVCache and isinstance(model.make_cache()[0], KVCache)


@pytest.mark.parametrize("variant", ["bfloat16", "quantized"])
def test_other_models_get_the_mlx_graph(variant, monkeypatch, on_cpu):
    monkeypatch.delenv("MLX_QWEN3VL_CPU_KERNELS", raising=False)
    path, dtype = (FIXTURES / "tiny-a", "bfloat16") if variant == "bfloat16" else (FIXTURES / "mlxvlm-q4", "float32")
    model = load_model(path, dtype=dtype)
    assert model.backend is MLX
    if variant == "quantized":
        assert any(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules())
    with pytest.raises(ConfigError, match="CPU path cannot run this model"):
        load_model(path, dtype=dtype, backend="cpu")


def test_unknown_switch_values_are_errors(monkeypatch):
    monkeypatch.setenv("MLX_QWEN3VL_CPU_KERNELS", "nmupy")
    with pytest.raises(ConfigError, match="MLX_QWEN3VL_CPU_KERNELS='nmupy' is not one of auto, c, numpy, mlx"):
        load_model(FIXTURES / "tiny-a")
    monkeypatch.delenv("MLX_QWEN3VL_CPU_KERNELS")
    with pytest.raises(ConfigError, match="backend 'gpu'"):
        load_model(FIXTURES / "tiny-a", backend="gpu")


def test_numpy_switch_picks_the_numpy_decode_ops(monkeypatch, on_cpu):
    monkeypatch.setenv("MLX_QWEN3VL_CPU_KERNELS", "numpy")
    model = load_model(FIXTURES / "tiny-a")
    assert model.backend.ops is cpu.decode.NumpyOps and "numpy (no C extension)" in model.backend.describe()


def test_backends_share_the_module_classes_they_replace(on_cpu):
    """Each CPU module subclasses the MLX one it stands for, with the same parameters."""
    for base, twin in cpu.layers.TWINS.items():
        assert issubclass(twin, base)
    pure, fast = load_fixture_model("tiny-b", backend="mlx"), load_fixture_model("tiny-b", backend="cpu")
    from mlx.utils import tree_flatten

    assert [k for k, _ in tree_flatten(pure.parameters())] == [k for k, _ in tree_flatten(fast.parameters())]
    assert isinstance(fast.visual, vision.VisionModel)
    x = case_inputs("text")
    assert mx.array_equal(fast(**x).argmax(-1), pure(**x).argmax(-1))


def test_importing_the_package_loads_no_backend_nor_mlx_lm():
    """`import mlx_qwen3vl` (in a fresh process) loads nothing of cpu/ (nor the C extension) and
    neither mlx-lm nor transformers (seconds of startup): they come with the first model."""
    import subprocess
    import sys

    code = ("import sys, mlx_qwen3vl; print(sorted(m for m in sys.modules if m.startswith("
            "('mlx_qwen3vl.cpu', 'mlx_lm', 'transformers', 'torch'))))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parents[1])
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"


def test_plain_graph_on_the_cpu_rotates_text_by_tables_bit_for_bit(on_cpu):
    """On MLX's CPU device the plain graph's text rotary uses the cos/sin tables (mx.fast.rope's
    fallback there is more ops); a decode chunk and a text chunk rotate exactly as mx.fast.rope."""
    import numpy as np

    from mlx_qwen3vl import activations, rope

    model = load_model(FIXTURES / "tiny-a", backend="mlx")
    assert type(model.language_model.rotary) is activations.TextRotary
    plain = rope.TextRotary(128, 5e6, [24, 20, 20])
    tables = activations.TextRotary(128, 5e6, [24, 20, 20])
    for length, positions in ((1, [265, 1000, 40000]), (7, [0, 3])):
        x = mx.random.normal((len(positions), 4, length, 128), key=mx.random.key(length))
        pos = mx.array(positions)
        assert np.array_equal(np.array(plain(pos, length)(x)), np.array(tables(pos, length)(x)))


@pytest.mark.parametrize("fixture", ["tiny-a", "tiny-moe", "mlxvlm-q4"])
def test_plain_graph_stacks_projections_without_renaming_or_copying(fixture, on_cpu):
    """The plain graph's q/k/v and gate/up run as one matmul each (backend.fuse): the parameters
    keep the checkpoint's names and values (views of the stacked weight, no second copy), the
    logits equal the unstacked graph's, and quantized projections and MoE experts stay apart."""
    from mlx.utils import tree_flatten

    from mlx_qwen3vl.weights import build_model

    mx.clear_cache()
    before = mx.get_active_memory()
    fused = load_model(FIXTURES / fixture, backend="mlx")
    fused_bytes = mx.get_active_memory() - before
    plain = build_model(FIXTURES / fixture)[0]
    ours, theirs = dict(tree_flatten(fused.parameters())), dict(tree_flatten(plain.parameters()))
    assert ours.keys() == theirs.keys()
    assert all(mx.array_equal(ours[k], theirs[k]) for k in ours)
    assert fused_bytes <= sum(a.nbytes for a in theirs.values()) * 1.01
    layers = fused.language_model.layers
    quantized = fixture == "mlxvlm-q4"
    assert all((layer.self_attn.get("_qkv") is None) == quantized for layer in layers)
    assert all((layer.mlp.get("_gate_up") is None) == (quantized or not isinstance(layer.mlp, language.MLP))
               for layer in layers)
    inputs = case_inputs("image")
    np.testing.assert_allclose(np.array(fused(**inputs)), np.array(plain(**inputs)), rtol=1e-5, atol=1e-5)


def test_plain_mlp_is_silu_gate_times_up_stacked_or_not(on_cpu):
    """language.MLP (what a GPU runs: compiled swiglu, gate/up stacked by backend.fuse) computes
    down(silu(gate(x)) * up(x)) at any number of tokens, before and after stacking."""
    import mlx.nn as nn
    from types import SimpleNamespace

    from mlx_qwen3vl.backend import fuse

    mlp = language.MLP(64, 96)
    mx.eval(mlp.parameters())
    want = lambda x: mlp.down_proj(nn.silu(mlp.gate_proj(x)) * mlp.up_proj(x))  # noqa: E731
    xs = [mx.random.normal((2, 7, 64)), mx.random.normal((1, 1, 64))]
    expected = [want(x) for x in xs]
    for x, e in zip(xs, expected):
        np.testing.assert_allclose(np.array(mlp(x)), np.array(e), rtol=1e-6, atol=1e-6)
    attn = SimpleNamespace(q_proj=None)  # a layer whose attention cannot be stacked
    attn.q_proj = attn.k_proj = attn.v_proj = nn.QuantizedLinear(64, 64)
    fuse(SimpleNamespace(language_model=SimpleNamespace(layers=[SimpleNamespace(self_attn=attn, mlp=mlp)])))
    assert mlp.get("_gate_up") is not None
    for x, e in zip(xs, expected):
        np.testing.assert_allclose(np.array(mlp(x)), np.array(e), rtol=1e-5, atol=1e-5)


def test_plain_graph_on_cpu_splits_decode_matmuls_bit_for_bit(on_cpu, monkeypatch):
    """On the CPU device the plain graph's decode matmuls (stacked q/k/v and gate/up, o, down, the
    tied LM head) run as row blocks of their weights on two CPU streams (activations.
    split_matmuls): the parameters keep their names, and a decode step's logits equal the
    unsplit products' to the bit."""
    from mlx.utils import tree_flatten

    from mlx_qwen3vl import activations, spread
    from mlx_qwen3vl.engine.step import decode_step

    model = load_model(FIXTURES / "tiny-a", dtype="float32", backend="mlx")
    layer, text = model.language_model.layers[0], model.language_model
    assert type(layer.self_attn) is activations.Attention and type(layer.mlp.down_proj) is activations.Linear
    assert type(text.embed_tokens) is activations.Embedding
    for blocks in (layer.self_attn._qkv_blocks, layer.mlp._gate_up_blocks, layer.mlp.down_proj._blocks,
                   text.embed_tokens._blocks):
        assert len(blocks) == spread.PARTS  # each of them split
    assert not [k for k, _ in tree_flatten(model.parameters()) if "_blocks" in k]
    cache = model.make_cache()
    inputs = case_inputs("text")
    mx.eval(model(inputs["input_ids"], cache=cache))
    positions = mx.array([inputs["input_ids"].shape[1]])
    token = mx.array([7])

    def step():
        logits = decode_step(model, token, cache, positions)
        mx.eval(logits)
        for c in cache:
            c.trim(1)
        return np.array(logits)

    split = step()
    monkeypatch.setattr(activations, "FEW_ROWS", 0)  # every product whole
    assert np.array_equal(split, step())


def test_split_products_equal_whole_ones_bit_for_bit_at_odd_widths(on_cpu):
    """activations.matmul over a weight's row blocks, 1 to FEW_ROWS rows, equals the whole product
    to the bit at odd and narrow widths (a narrow weight is not split: its BLAS kernels differ)."""
    from mlx_qwen3vl import activations

    rng = np.random.default_rng(0)
    for n, k in ((17, 64), (23, 300), (65, 64), (1001, 300)):
        w = mx.array(rng.standard_normal((n, k)).astype(np.float32))
        blocks = activations.row_blocks(w)
        assert (blocks is None) == (n < activations.MIN_ROWS)
        for m in range(1, activations.FEW_ROWS + 1):
            for shape in ((m, k), (1, m, k)):
                x = mx.array(rng.standard_normal(shape).astype(np.float32))
                assert np.array_equal(np.array(activations.matmul(x, w, blocks)), np.array(x @ w.T)), (n, k, shape)
