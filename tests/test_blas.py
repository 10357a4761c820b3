"""The optimized-BLAS loader: on by default, off on request, and it reports what it did. On Linux,
"loaded" means MLX's own cblas_sgemm calls resolve to the library it names: the probe reads the
GOT slot through which libmlx.so calls cblas_sgemm (after a matmul has bound it) and asks the
dynamic linker which library the address belongs to."""

import os
import subprocess
import sys

import pytest

from mlx_qwen3vl import blas

LINUX = sys.platform.startswith("linux")

# In a fresh process (mlx.core imported after the loader): the loader's note, the library that
# serves libmlx.so's cblas_sgemm, and the matmul's value.
PROBE = r'''
import ctypes, os, struct
import mlx_qwen3vl, mlx_qwen3vl.blas as b, mlx.core as mx


def got_slot(path, symbol):
    """Offset of the GOT slot through which the ELF64 shared object `path` calls `symbol`."""
    data = open(path, "rb").read()
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    for _, sh_type, _, _, offset, size, link, _, _, _ in sections:
        if sh_type != 4:  # SHT_RELA: .rela.plt and .rela.dyn
            continue
        symtab, strtab = sections[link][4], sections[sections[link][6]][4]
        for r in range(offset, offset + size, 24):
            r_offset, r_info = struct.unpack_from("<QQ", data, r)
            name_at = strtab + struct.unpack_from("<I", data, symtab + (r_info >> 32) * 24)[0]
            if data[name_at: data.index(b"\0", name_at)] == symbol.encode():
                return r_offset
    raise LookupError(symbol)


class DlInfo(ctypes.Structure):
    _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p), ("sname", ctypes.c_char_p),
                ("saddr", ctypes.c_void_p)]


a = mx.ones((64, 64))
value = float((a @ a)[0, 0])  # MLX's CPU matmul calls cblas_sgemm, which binds its GOT slot
libmlx = os.path.join(os.path.dirname(mx.__file__), "lib", "libmlx.so")
libc = ctypes.CDLL(None)
link_map = ctypes.c_void_p()
assert libc.dlinfo(ctypes.c_void_p(ctypes.CDLL(libmlx)._handle), 2, ctypes.byref(link_map)) == 0  # RTLD_DI_LINKMAP
base = ctypes.c_size_t.from_address(link_map.value).value  # link_map.l_addr
target = ctypes.c_void_p.from_address(base + got_slot(libmlx, "cblas_sgemm")).value
info = DlInfo()
assert libc.dladdr(ctypes.c_void_p(target), ctypes.byref(info))
print(b.describe())
print(os.path.realpath(info.fname.decode()))
print(value)
'''


def probe(**env):
    p = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120,
                       env={**os.environ, **env})
    assert p.returncode == 0, p.stderr
    note, served_by, value = p.stdout.strip().splitlines()
    assert float(value) == 64.0  # matmul still right, whichever BLAS serves it
    return note, served_by


def mlx_reference_blas(path):
    """The netlib BLAS the MLX wheel bundles (mlx_cpu.libs/libblas-<hash>.so.3...)."""
    return os.path.basename(path).startswith("libblas") and os.path.basename(os.path.dirname(path)) == "mlx_cpu.libs"


@pytest.mark.skipif(not LINUX, reason="the loader only acts on Linux")
def test_disabled_by_environment():
    note, served_by = probe(MLX_QWEN3VL_BLAS="off")
    assert "disabled" in note and mlx_reference_blas(served_by), (note, served_by)


@pytest.mark.skipif(not LINUX, reason="the loader only acts on Linux")
def test_unloadable_library_falls_back_to_reference():
    note, served_by = probe(MLX_QWEN3VL_BLAS="/nonexistent/libcblas.so")
    assert note.startswith("reference BLAS") and mlx_reference_blas(served_by), (note, served_by)


@pytest.mark.skipif(not LINUX, reason="the loader only acts on Linux")
def test_default_loads_an_optimized_blas_that_serves_mlx():
    """With a candidate library installed (the `cpu` extra's MKL, a system OpenBLAS) it is loaded
    and MLX's cblas_sgemm calls land in it; without one, the note says how to get one."""
    note, served_by = probe(MLX_QWEN3VL_BLAS="")
    candidates = [c for c in blas._candidates() if not c.startswith("/") or os.path.exists(c)]
    if not candidates:
        assert "pip install" in note and mlx_reference_blas(served_by), (note, served_by)
        return
    assert note in candidates, (note, candidates)
    assert served_by == os.path.realpath(note), (note, served_by)


@pytest.mark.skipif(LINUX, reason="macOS: MLX uses Accelerate")
def test_nothing_is_loaded_elsewhere():
    assert "nothing to load" in blas.describe()


@pytest.mark.skipif(not LINUX, reason="the loader only acts on Linux")
def test_mlx_imported_first_is_one_warning_with_the_fix():
    """Too late to load a BLAS once mlx.core is loaded (its cblas calls resolve to the reference
    one): the user is told once, with the fix; the right order, or the loader off, stays silent."""
    def stderr(code, **env):
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "MLX_QWEN3VL_BLAS": "", **env})
        assert p.returncode == 0, p.stderr
        return p.stderr

    late = stderr("import mlx.core, mlx_qwen3vl, mlx_qwen3vl.blas as b; print(b.describe())")
    assert late.count("RuntimeWarning") == 1 and "import mlx_qwen3vl first" in late, late
    assert "import mlx_qwen3vl first" not in stderr("import mlx_qwen3vl, mlx.core")
    assert "RuntimeWarning" not in stderr("import mlx.core, mlx_qwen3vl", MLX_QWEN3VL_BLAS="off")
