"""The memory a model may use on this machine: total, available, and on an Apple GPU MLX's
recommended working set (what the planner compares a model's needs with)."""

import os
import subprocess
from pathlib import Path


def sysctl_value(name):
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
