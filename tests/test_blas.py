"""The optimized-BLAS loader: on by default, off on request, and it reports what it did."""

import os
import subprocess
import sys

PROBE = "import mlx_qwen3vl, mlx_qwen3vl._blas as b, mlx.core as mx; print(b.describe()); " \
        "a = mx.ones((64, 64)); print(float((a @ a)[0, 0]))"


def probe(**env):
    p = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120,
                       env={**os.environ, **env})
    assert p.returncode == 0, p.stderr
    note, value = p.stdout.strip().splitlines()
    assert float(value) == 64.0  # matmul still right, whichever BLAS serves it
    return note


def test_disabled_by_environment():
    assert "disabled" in probe(MLX_QWEN3VL_BLAS="off")


def test_unloadable_library_falls_back_to_reference():
    assert probe(MLX_QWEN3VL_BLAS="/nonexistent/libcblas.so").startswith("reference BLAS")


def test_default_names_what_it_loaded():
    note = probe(MLX_QWEN3VL_BLAS="")
    if sys.platform.startswith("linux"):
        assert note.startswith("/") or "pip install" in note
