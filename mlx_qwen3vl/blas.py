"""Load an optimized CBLAS before MLX does, on Linux.

MLX's Linux CPU wheel links netlib's reference BLAS, many times slower at float32 matmuls than an
optimized one (benchmarks/README.md, "Measurements behind choices in the code"). Its `cblas_sgemm`
calls resolve through the global symbol scope, so a faster CBLAS loaded there first with
RTLD_GLOBAL — pip's `mkl` (the `cpu` extra) or a system OpenBLAS — serves them instead. This must
run before `mlx.core` is first imported, which is why the package imports this module first.

With the CPU path installed (cpu/layers.py), the large float32 matmuls go through numpy's own
BLAS instead; this one serves MLX's remaining matmuls, and all of them on the plain MLX graph.

MLX_QWEN3VL_BLAS=off disables it; MLX_QWEN3VL_BLAS=/path/to/libcblas.so picks a library.
"""

import ctypes
import ctypes.util
import glob
import os
import sys

_state = {"library": None, "note": "not attempted"}


def _candidates():
    chosen = os.environ.get("MLX_QWEN3VL_BLAS", "").strip()
    if chosen and chosen.lower() not in ("on", "auto", "1"):
        return [chosen]
    prefixes = dict.fromkeys([sys.prefix, sys.base_prefix, os.path.dirname(os.path.dirname(sys.executable))])
    found = []
    for prefix in prefixes:
        found += sorted(glob.glob(os.path.join(prefix, "lib", "libmkl_rt.so*")))
    # Absolute paths first, so describe() names the file that was loaded; find_library (a bare
    # soname) covers other layouts.
    found += sorted(glob.glob("/usr/lib/*-linux-gnu/libopenblas*.so*"))
    system = ctypes.util.find_library("openblas")
    found += [system] if system else []
    return found


def load():
    if not sys.platform.startswith("linux"):
        _state["note"] = "Accelerate (macOS); nothing to load"
        return None
    if os.environ.get("MLX_QWEN3VL_BLAS", "").strip().lower() in ("off", "0", "none", "false"):
        _state["note"] = "reference BLAS (disabled by MLX_QWEN3VL_BLAS)"
        return None
    if "mlx.core" in sys.modules:
        _state["note"] = "reference BLAS (mlx.core was imported before mlx_qwen3vl)"
        _warn_late()
        return None
    for path in _candidates():
        if "mkl" in os.path.basename(path):
            # GNU OpenMP threading: the OpenMP runtime most wheels already load, so no second one
            # (libiomp5 spin-waits after each call, stealing a core from MLX's threads), and no
            # slower than MKL's other layers (benchmarks/README.md).
            os.environ.setdefault("MKL_THREADING_LAYER", "GNU")
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        _state.update(library=path, note=path)
        return path
    _state["note"] = 'reference BLAS (install the `cpu` extra: pip install "mlx-qwen3vl[cpu]")'
    return None


def _warn_late():
    """Too late to load a BLAS: libmlx's cblas calls already resolve to the wheel's reference BLAS,
    which loaded first. Say so once, where it costs: MLX computing on the CPU."""
    import warnings

    mx = sys.modules["mlx.core"]
    if mx.default_device() != mx.cpu:
        return
    warnings.warn("mlx.core was imported before mlx_qwen3vl, so MLX's own matmuls run on its wheel's reference "
                  "BLAS (about 20x slower on the CPU): import mlx_qwen3vl first (MLX_QWEN3VL_BLAS=off silences "
                  "this)", RuntimeWarning, stacklevel=2)


def describe() -> str:
    return _state["note"]


def numpy_blas() -> str:
    """The BLAS numpy was built with (the CPU path's GEMMs and GEMVs run on it, not on MLX's)."""
    import numpy as np

    try:
        info = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        return f"{info['name']} {info.get('version', '')}".strip()
    except Exception:  # numpy < 1.26 has no dict form; its config is then only printed
        return "unknown"


load()
