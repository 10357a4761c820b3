"""How many threads the CPU path's matmuls use: all cores on a quiet machine, fewer when other
processes want them. The count splits matmul_rows' columns (kernels.py; an element's result does
not depend on it) and is set in the BLAS libraries (MLX's own matmuls, and numpy's where the C
extension is not built).

A decode step makes ~200 matrix-vector products. With two threads each is split in halves and
returns only when both are done, so on an oversubscribed machine every GEMV waits for
its second thread to be scheduled, while one thread keeps its fair share of a core. On a quiet
machine the second thread is worth having, so the count is chosen per forward from what the
scheduler reports: the runnable tasks that are not ours. Measured: benchmarks/README.md, "BLAS
threads under contention" and "Measurements behind choices in the code".

MLX_QWEN3VL_BLAS_THREADS=auto (default) or N fixes the count (the CLI's --blas-threads).
"""

import os
import time
from contextlib import contextmanager
from pathlib import Path

from ..errors import ConfigError

ENV = "MLX_QWEN3VL_BLAS_THREADS"


def cores() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def parse(value, name=ENV) -> "int | None":
    """None for automatic ('auto', unset, empty), else a positive thread count; anything else is an
    error naming where the value came from (`name`)."""
    text = str(value).strip().lower() if value is not None else ""
    if text in ("", "auto"):
        return None
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise ConfigError(f"{name} = {value!r} is not 'auto' or a positive thread count; use auto or e.g. 1")


def choose(cores: int, others: float) -> int:
    """Threads for `cores` CPUs while `others` runnable tasks that are not ours (Policy's smoothed
    count) compete for them: the cores they leave free, at least one. A thread that shares its core
    makes every split GEMV wait for it, so a core counts as taken from 3/4 of a task on: two
    readings in a row with one more task, not a single reading that caught a short-lived one."""
    return max(1, min(cores, cores - int(others + 0.25)))


def runnable_others(loadavg="/proc/loadavg", tasks="/proc/self/task") -> "int | None":
    """Runnable tasks on the machine right now that are not threads of this process (None where
    /proc does not say): /proc/loadavg's running count less our own threads in state R (the
    reading thread, and a BLAS worker spinning between calls)."""
    try:
        running = int(Path(loadavg).read_text().split()[3].split("/")[0])
        ours = 0
        for task in os.scandir(tasks):
            try:
                with open(os.path.join(task.path, "stat"), "rb") as f:
                    ours += f.read().rsplit(b")", 1)[1].split()[0] == b"R"
            except OSError:
                continue  # the thread ended while we looked
    except (OSError, ValueError, IndexError):
        return None
    return max(0, running - ours)


def cpu_pressure(path="/proc/pressure/cpu") -> "float | None":
    """The kernel's share of the last 10 s in which some task waited for a CPU, in percent."""
    try:
        first = Path(path).read_text().splitlines()[0].split()
        return float(dict(kv.split("=") for kv in first[1:])["avg10"])
    except (OSError, ValueError, KeyError, IndexError):
        return None


def signals() -> dict:
    return dict(runnable_others=runnable_others(), cpu_pressure=cpu_pressure(), load_average=os.getloadavg()[0])


class Policy:
    """The thread count for the next forward: `fixed` if set, else `choose` over the runnable
    others, smoothed over recent samples (a single reading catches short-lived tasks) and re-read
    at most every `interval` seconds."""

    def __init__(self, fixed=None, interval=0.25, smoothing=0.5, clock=time.monotonic, read=runnable_others,
                 ncores=None):
        self.fixed, self.interval, self.smoothing = fixed, interval, smoothing
        self.clock, self.read = clock, read
        self.ncores = ncores or cores()
        self.others, self.last, self.count = 0.0, None, fixed or self.ncores

    def threads(self) -> int:
        if self.fixed:
            return self.fixed
        now = self.clock()
        if self.last is None or now - self.last >= self.interval:
            seen = self.read()
            if seen is not None:
                self.others = seen if self.last is None else self.smoothing * self.others + (1 - self.smoothing) * seen
                self.count = choose(self.ncores, self.others)
            self.last = now
        return self.count


def blas_libraries():
    """threadpoolctl's controllers of the BLAS libraries loaded now (None without threadpoolctl)."""
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:
        return None
    return [c for c in ThreadpoolController().lib_controllers if c.user_api == "blas"]


class BlasPool:
    """Sets the thread count of every BLAS library loaded in the process (numpy's OpenBLAS, the MKL
    of blas.py, and any loaded later: scipy brings its own OpenBLAS) through threadpoolctl, only
    when it changes. The libraries are looked up again at each change (at most once per Policy
    interval), so one loaded after the first forward is not left at its default count."""

    def __init__(self, find=blas_libraries):
        self.find, self.current = find, None
        self.libraries = find()

    @property
    def note(self) -> str:
        if self.libraries is None:
            return "threadpoolctl not installed: BLAS threads as loaded"
        return "set in " + (", ".join(f"{c.internal_api} ({os.path.basename(c.filepath)})" for c in self.libraries)
                            or "no BLAS found")

    def set(self, n: int, force=False):
        """`force`: set it even if it is the count last set (a library may have been changed or
        loaded since)."""
        if (n != self.current or force) and self.libraries is not None:
            self.libraries = self.find()
            for lib in self.libraries:
                lib.set_num_threads(n)
                if getattr(lib, "internal_api", None) == "mkl":
                    # threadpoolctl sets MKL's count for the calling thread only, and MLX calls MKL
                    # from its own stream threads: the global count is the one they read.
                    lib.dynlib.MKL_Set_Num_Threads(n)
        self.current = n


def mkl_threads_elsewhere() -> "int | None":
    """MKL's thread count as a thread that never set its own reads it: what MLX's stream threads use
    for the plain graph's matmuls (None without MKL)."""
    import ctypes
    import threading

    from .. import blas

    if "mkl" not in os.path.basename(blas.describe()):
        return None
    mkl, seen = ctypes.CDLL(blas.describe()), []
    reader = threading.Thread(target=lambda: seen.append(mkl.MKL_Get_Max_Threads()))
    reader.start()
    reader.join()
    return seen[0]


_pool = None
_policy = None


def blas_pool() -> BlasPool:
    global _pool
    if _pool is None:
        _pool = BlasPool()
    return _pool


def policy() -> Policy:
    """The process's policy, fixed by MLX_QWEN3VL_BLAS_THREADS on first use (checked: a bad value is
    an error) unless `configure` set it first."""
    global _policy
    if _policy is None:
        _policy = Policy(fixed=parse(os.environ.get(ENV)))
    return _policy


def configure(value, name="blas_threads"):
    """Fix the thread count (a positive integer) or make it automatic ('auto' or None), overriding
    the environment: the CLI's --blas-threads. Takes effect at once."""
    global _policy
    fixed = parse(value, name)
    if _policy is None:
        _policy = Policy(fixed=fixed)
    _policy.fixed = fixed
    blas_pool().set(_policy.threads(), force=True)  # at once, even where the count is the one last set


def share_cores(k: int) -> int:
    """`k` processes of one job run on this machine (ranks of mlx.launch): the automatic count uses
    this process's share of the cores, set at once (a rank waiting in a collective spins on its core,
    so ranks that oversubscribe the cores slow each other down). A fixed count is kept as it is."""
    p = policy()
    p.ncores = max(1, cores() // max(1, k))
    if not p.fixed:
        p.count = min(p.count, p.ncores)
    blas_pool().set(p.threads(), force=True)
    return p.threads()


@contextmanager
def one_blas_thread():
    """The BLAS on the calling thread only, inside: for small calls beside work on threads of our
    own (a verify forward's attention beside matmul_rows' column ranges), since woken BLAS workers
    keep spinning after each call and take a core from ours (benchmarks/README.md, "The tiled
    matmul_rows")."""
    pool = blas_pool()
    n = pool.current
    if pool.libraries is None or n is None or n <= 1:
        yield
        return
    for lib in pool.libraries:
        lib.set_num_threads(1)
    try:
        yield
    finally:
        for lib in pool.libraries:
            lib.set_num_threads(n)


def apply() -> int:
    """Set the BLAS threads for the work about to run (cheap: the policy re-reads the machine at
    most every `interval`, and the libraries are called only when the count changes)."""
    n = policy().threads()
    blas_pool().set(n)
    return n


def describe() -> str:
    p = policy()
    mode = f"{p.fixed} (fixed)" if p.fixed else f"auto: {p.count} now, of up to {p.ncores} (fewer while other processes run)"
    return f"BLAS threads {mode}; {blas_pool().note}"
