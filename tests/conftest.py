from pathlib import Path

import numpy as np
import pytest

FIXTURES = Path(__file__).parent / "fixtures"
CHECKPOINTS = ["tiny-a", "tiny-b"]
CASES = ["text", "image", "two_images", "video", "batch"]
MODEL_KEYS = ["input_ids", "attention_mask", "pixel_values", "image_grid_thw", "pixel_values_videos",
              "video_grid_thw", "mm_token_type_ids"]


def case_inputs(case):
    """Recorded processor outputs of a case (as transformers made them), ready for model(**inputs)."""
    data = np.load(FIXTURES / "cases" / f"{case}.npz")
    return {k: data[k] for k in MODEL_KEYS if k in data}


def reference(checkpoint, case):
    return dict(np.load(FIXTURES / checkpoint / "reference" / f"{case}.npz"))


def rel_err(ours, ref):
    """Largest absolute difference relative to the largest reference magnitude."""
    ours, ref = np.asarray(ours, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


_models = {}


def load_fixture_model(name, dtype=None):
    from mlx_qwen3vl.weights import load_model

    key = (name, dtype)
    if key not in _models:
        _models[key] = load_model(FIXTURES / name, dtype=dtype)
    return _models[key]


@pytest.fixture(params=CHECKPOINTS)
def checkpoint(request):
    return request.param


@pytest.fixture(params=["default", "numpy", "mlx"])
def cpu_kernels(request, monkeypatch):
    """Run a test with the CPU fast paths as shipped ("default": the tiny fixtures are below their
    size thresholds, so mostly MLX), forced on for every size ("numpy": every float32 linear,
    attention and activation through cpu_kernels' numpy code, as on the 2B model), and off ("mlx":
    the pure-MLX graph and the queued decode loop a GPU gets)."""
    if request.param == "mlx":
        monkeypatch.setenv("MLX_QWEN3VL_CPU_KERNELS", "mlx")
    if request.param == "numpy":
        from mlx_qwen3vl import cpu_kernels

        for name in ("NUMPY_LINEAR_MIN_WEIGHT", "NUMPY_ATTENTION_MIN_SCORES", "NUMPY_ACTIVATION_MIN_SIZE"):
            monkeypatch.setattr(cpu_kernels, name, 0)
    return request.param
