"""The machine a run is on (chip, OS, memory, MLX and its device) and the memory figures a run
reads: MLX's peak, the process's peak resident set, and the limits the planner compares with."""

import gc
import os
import platform
import subprocess
import sys
from pathlib import Path


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def _sysctl(name):
    try:
        out = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out or None


def _meminfo(key):
    """A /proc/meminfo entry in bytes (Linux), else None."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cpu_name():
    if sys.platform == "darwin":
        return _sysctl("machdep.cpu.brand_string") or platform.machine()  # "Apple M2 Pro"
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


def total_memory_bytes():
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # Linux and macOS
    except (ValueError, OSError, AttributeError):
        return _meminfo("MemTotal")


def device_info():
    """mx.device_info() of the default device ({} where MLX has none). On Apple GPUs it reports
    `memory_size` and `max_recommended_working_set_size`; on Linux only names."""
    import mlx.core as mx

    try:
        return dict(mx.device_info())
    except Exception:  # older MLX: only mx.metal.device_info
        try:
            return dict(mx.metal.device_info()) if mx.metal.is_available() else {}
        except Exception:
            return {}


def memory_limits(info=None):
    """The memory a model may use here: {total, available, working_set, budget, budget_name} in
    bytes (None where the OS does not say). On an Apple GPU the budget is MLX's recommended working
    set (the wired limit mlx-lm's `wired_limit` sets for generation); elsewhere the memory the OS
    reports available, else its total."""
    info = device_info() if info is None else info
    total = total_memory_bytes()
    available = _meminfo("MemAvailable")
    working_set = info.get("max_recommended_working_set_size") or None
    if working_set:
        budget, name = int(working_set), "MLX's recommended working set (the GPU's wired limit)"
    elif available:
        budget, name = available, "memory available"
    else:
        budget, name = total, "total memory"
    return dict(total=total, available=available, working_set=int(working_set) if working_set else None,
                device_memory=info.get("memory_size"), budget=budget, budget_name=name)


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
