"""The machine a run is on (chip, OS, memory, MLX and its device) and the memory figures a run
reads: MLX's peak and the process's peak resident set. The limits the planner compares with are
the library's (memory.py)."""

import gc
import os
import platform
import sys
from pathlib import Path

from ..memory import device_info, sysctl_value, total_memory_bytes


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def cpu_name():
    if sys.platform == "darwin":
        return sysctl_value("machdep.cpu.brand_string") or platform.machine()  # "Apple M2 Pro"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def os_name():
    if sys.platform == "darwin":
        return f"macOS {platform.mac_ver()[0]}"
    if sys.platform.startswith("linux"):
        pretty = None
        try:
            for line in Path("/etc/os-release").read_text().splitlines():
                if line.startswith("PRETTY_NAME="):
                    pretty = line.split("=", 1)[1].strip().strip('"')
        except OSError:
            pass
        return f"{pretty or 'Linux'} (kernel {platform.release()})"
    return platform.platform()


def machine_info():
    """What a result is measured on: chip, OS, memory, Python, MLX, its device and the BLAS."""
    import mlx.core as mx

    from .. import blas as _blas

    info = device_info()
    total = total_memory_bytes()
    return dict(chip=cpu_name(), cpu=cpu_name(), cores=os.cpu_count(), memory_gb=total / 1e9 if total else None,
                os=os_name(), platform=platform.platform(), python=platform.python_version(), mlx=mx.__version__,
                backend=str(mx.default_device()), device="gpu" if mx.default_device().type == mx.DeviceType.gpu else "cpu",
                device_name=info.get("device_name"),
                gpu=info.get("device_name") if mx.default_device().type == mx.DeviceType.gpu else None,
                blas=_blas.describe(), mkl_threading_layer=os.environ.get("MKL_THREADING_LAYER"),
                load_average=os.getloadavg() if hasattr(os, "getloadavg") else None)


def rss_reset():
    """Restart the peak resident set counter (Linux; elsewhere the peak is the process's)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def rss_peak_gb():
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    import resource

    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 1e9


def fresh_mlx_measurement():
    """Free what earlier work left and restart the peak-memory counters (MLX's and the RSS)."""
    import mlx.core as mx

    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    rss_reset()
