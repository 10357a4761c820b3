"""The optimized-BLAS loader: on by default, off on request, and it reports what it did. On Linux,
"loaded" means MLX's own cblas_sgemm calls resolve to the library it names."""

import os
import subprocess
import sys

import pytest

from mlx_qwen3vl.cpu import blas

# In a fresh process: the note, whether the global cblas_sgemm (the one MLX's calls resolve to,
# mlx.core being imported after the loader) is the named library's, and a matmul through MLX.
PROBE = """
import ctypes, mlx_qwen3vl, mlx_qwen3vl.cpu.blas as b, mlx.core as mx
note = b.describe()
same = None
if note.startswith("/"):
    addr = lambda lib: ctypes.cast(lib.cblas_sgemm, ctypes.c_void_p).value
    same = addr(ctypes.CDLL(None)) == addr(ctypes.CDLL(note))
a = mx.ones((64, 64))
print(note); print(same); print(float((a @ a)[0, 0]))
"""


def probe(**env):
    p = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120,
                       env={**os.environ, **env})
    assert p.returncode == 0, p.stderr
    note, same, value = p.stdout.strip().splitlines()
    assert float(value) == 64.0  # matmul still right, whichever BLAS serves it
    return note, same


def test_disabled_by_environment():
    note, same = probe(MLX_QWEN3VL_BLAS="off")
    assert "disabled" in note and same == "None"


def test_unloadable_library_falls_back_to_reference():
    note, _ = probe(MLX_QWEN3VL_BLAS="/nonexistent/libcblas.so")
    assert note.startswith("reference BLAS")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="macOS uses Accelerate; nothing is loaded")
def test_default_loads_an_optimized_blas_that_serves_mlx():
    """With a candidate library installed (the `cpu` extra's MKL, a system OpenBLAS) it is loaded
    and MLX's cblas_sgemm resolves to it; without one, the note says how to get one."""
    note, same = probe(MLX_QWEN3VL_BLAS="")
    candidates = [c for c in blas._candidates() if not c.startswith("/") or os.path.exists(c)]
    if not candidates:
        assert "pip install" in note and same == "None"
        return
    assert note in candidates, (note, candidates)
    assert same == "True"
