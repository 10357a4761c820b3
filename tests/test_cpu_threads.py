"""The CPU path's BLAS thread policy: the choice from the machine's runnable tasks, its smoothing
and re-reading interval, the readings from /proc, the override (environment, CLI, API) and that
the count reaches the loaded libraries. No timings here: they are in benchmarks/cpu_threads.py."""

import os
import sys

import pytest

from conftest import FIXTURES
from mlx_qwen3vl.cpu import threads
from mlx_qwen3vl.errors import ConfigError
from mlx_qwen3vl.weights import load_model


@pytest.fixture(autouse=True)
def fresh_policy(monkeypatch):
    """Each test starts from an unset policy and leaves the process's as it found it."""
    monkeypatch.delenv(threads.ENV, raising=False)
    monkeypatch.setattr(threads, "_policy", None)
    yield
    threads.blas_pool().set(threads.cores())


@pytest.mark.parametrize("value, expected", [(None, None), ("", None), ("auto", None), (" AUTO ", None),
                                             ("1", 1), ("2", 2), (" 16 ", 16), (3, 3)])
def test_parse(value, expected):
    assert threads.parse(value) == expected


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5", "auto2"])
def test_parse_refuses_with_the_source_named(value):
    with pytest.raises(ConfigError, match=rf"^{threads.ENV} = '{value}' is not 'auto' or a positive thread count"):
        threads.parse(value)
    with pytest.raises(ConfigError, match=r"^--blas-threads = "):
        threads.parse(value, "--blas-threads")


@pytest.mark.parametrize("cores, others, expected", [
    (2, 0, 2), (2, 0.5, 2),  # one reading that caught a short-lived task: keep both cores
    (2, 0.75, 1), (2, 1, 1), (2, 4, 1),  # a competitor for two readings, or several: one thread
    (1, 0, 1), (4, 0, 4), (4, 1, 3), (4, 2.6, 2), (4, 2.8, 1), (4, 9, 1), (8, 3, 5),
])
def test_choose(cores, others, expected):
    assert threads.choose(cores, others) == expected


class Machine:
    """A scripted /proc: `seen` is what each reading returns; `now` the clock."""

    def __init__(self, seen):
        self.seen, self.now, self.reads = list(seen), 0.0, 0

    def read(self):
        self.reads += 1
        return self.seen.pop(0)

    def clock(self):
        return self.now


def run(policy, machine, steps, dt):
    counts = []
    for _ in range(steps):
        counts.append(policy.threads())
        machine.now += dt
    return counts


def test_policy_follows_a_competitor_and_ignores_a_blip():
    m = Machine([0, 1, 0, 0, 1, 1, 1, 0, 0, 0])
    p = threads.Policy(interval=0.25, clock=m.clock, read=m.read, ncores=2)
    # smoothed readings: 0, 0.5 (a blip), 0.25, 0.13, 0.56 -> 2 threads; 0.78, 0.89 -> 1; 0.45 ... -> 2
    assert run(p, m, 10, 0.25) == [2, 2, 2, 2, 2, 1, 1, 2, 2, 2]
    assert m.reads == 10


def test_policy_rereads_at_most_every_interval():
    m = Machine([3] * 3)
    p = threads.Policy(interval=0.25, clock=m.clock, read=m.read, ncores=2)
    assert run(p, m, 20, 0.03) == [1] * 20  # the first reading is taken as it is: no smoothing from zero
    assert m.reads == 3  # at 0, 0.27 and 0.54 s of 0.6


def test_policy_without_proc_keeps_every_core():
    m = Machine([None] * 4)
    p = threads.Policy(clock=m.clock, read=m.read, ncores=2)
    assert run(p, m, 4, 1.0) == [2, 2, 2, 2]


def test_fixed_count_is_never_second_guessed():
    m = Machine([5] * 4)
    p = threads.Policy(fixed=2, clock=m.clock, read=m.read, ncores=2)
    assert run(p, m, 4, 1.0) == [2, 2, 2, 2] and m.reads == 0


def test_runnable_others_reads_proc(tmp_path):
    (tmp_path / "loadavg").write_text("3.10 2.00 1.50 5/321 4242\n")
    tasks = tmp_path / "task"
    for tid, comm, state in [(1, "python", "R"), (2, "a) R (b", "S"), (3, "py", "R"), (4, "x", "D")]:
        (tasks / str(tid)).mkdir(parents=True)
        (tasks / str(tid) / "stat").write_text(f"{tid} ({comm}) {state} 1 2 3 4\n")
    # 5 running on the machine, 2 of them ours (the comm with ") R (" in it is sleeping)
    assert threads.runnable_others(tmp_path / "loadavg", tasks) == 3
    (tmp_path / "loadavg").write_text("1.0 1.0 1.0 1/100 7\n")
    assert threads.runnable_others(tmp_path / "loadavg", tasks) == 0  # never below zero
    assert threads.runnable_others(tmp_path / "missing", tasks) is None
    (tmp_path / "loadavg").write_text("garbage\n")
    assert threads.runnable_others(tmp_path / "loadavg", tasks) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")
def test_runnable_others_counts_this_process_out():
    """This process is running while it reads: it is never one of the others."""
    import os

    others = threads.runnable_others()
    running = int(open("/proc/loadavg").read().split()[3].split("/")[0])
    assert others is not None and 0 <= others < running + len(os.listdir("/proc/self/task"))


def test_cpu_pressure(tmp_path):
    f = tmp_path / "cpu"
    f.write_text("some avg10=12.50 avg60=3.00 avg300=1.00 total=99\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    assert threads.cpu_pressure(f) == 12.5
    assert threads.cpu_pressure(tmp_path / "none") is None


class FakeLibrary:
    def __init__(self):
        self.calls = []

    def set_num_threads(self, n):
        self.calls.append(n)


def test_pool_calls_the_libraries_only_on_change():
    a, b = FakeLibrary(), FakeLibrary()
    pool = threads.BlasPool(find=lambda: [a, b])
    for n in (2, 2, 1, 1, 1, 2):
        pool.set(n)
    assert a.calls == b.calls == [2, 1, 2]


def test_pool_sets_a_library_loaded_after_it():
    """As scipy's own OpenBLAS, imported after the first forward: it gets the next count, and
    `configure` sets every library at once even when the count is the one last set."""
    a, b, loaded = FakeLibrary(), FakeLibrary(), []
    pool = threads.BlasPool(find=lambda: list(loaded))
    loaded.append(a)
    pool.set(1)
    loaded.append(b)
    pool.set(1)
    assert a.calls == [1] and b.calls == []
    pool.set(2)
    pool.set(2, force=True)
    assert a.calls == [1, 2, 2] and b.calls == [2, 2]


def test_one_blas_thread_inside_and_the_count_back_after(monkeypatch):
    """A verify forward's few-query attention runs its BLAS calls on the calling thread only (woken
    workers would spin beside matmul_rows' threads), and the pool's count is back afterwards, also
    when the work inside fails; with one thread already nothing is called."""
    a = FakeLibrary()
    pool = threads.BlasPool(find=lambda: [a])
    monkeypatch.setattr(threads, "_pool", pool)
    pool.set(2)
    with threads.one_blas_thread():
        assert a.calls == [2, 1]
    with pytest.raises(ZeroDivisionError), threads.one_blas_thread():
        1 / 0
    assert a.calls == [2, 1, 2, 1, 2] and pool.current == 2
    pool.set(1)
    with threads.one_blas_thread():
        pass
    assert a.calls == [2, 1, 2, 1, 2, 1]


def test_a_verify_forwards_attention_calls_the_blas_on_one_thread(monkeypatch):
    """kernels.attention over a few queries (a verify forward's) runs inside one_blas_thread, over a
    prefill chunk's many queries on the pool's threads; the result is the attention either way."""
    import contextlib

    import mlx.core as mx
    import numpy as np

    from mlx_qwen3vl.cpu import kernels

    entered = []

    @contextlib.contextmanager
    def one():
        entered.append(True)
        yield

    monkeypatch.setattr(threads, "one_blas_thread", one)
    rng = np.random.default_rng(0)
    k, v = (mx.array(rng.standard_normal((1, 2, 512, 32)).astype(np.float32)) for _ in "kv")
    for queries, inside in ((5, [True]), (kernels.SMALL_ROWS + 1, [])):
        entered.clear()
        q = mx.array(rng.standard_normal((1, 4, queries, 32)).astype(np.float32))
        out = kernels.attention(q, k, v, 0.2)
        assert entered == inside
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2)
        np.testing.assert_allclose(np.array(out), np.array(want), rtol=1e-4, atol=1e-5)


def test_environment_fixes_the_count_and_a_bad_value_fails_the_load(monkeypatch):
    monkeypatch.setenv(threads.ENV, "1")
    assert threads.policy().fixed == 1 and threads.apply() == 1
    assert "BLAS threads 1 (fixed)" in threads.describe()
    monkeypatch.setattr(threads, "_policy", None)
    monkeypatch.setenv(threads.ENV, "lots")
    with pytest.raises(ConfigError, match=f"{threads.ENV} = 'lots'"):
        load_model(FIXTURES / "tiny-a", backend="cpu")


def test_configure_overrides_the_environment(monkeypatch):
    monkeypatch.setenv(threads.ENV, "bad")  # the CLI's value wins, and the environment's is not read
    threads.configure("1", "--blas-threads")
    assert threads.policy().fixed == 1
    threads.configure("auto")
    assert threads.policy().fixed is None and "auto:" in threads.describe()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the CPU path's BLAS is numpy's OpenBLAS on Linux")
def test_count_reaches_numpy_blas(on_cpu):
    """The count the policy applies is the one the BLAS libraries report (threadpoolctl's view),
    and the CPU path's matmuls apply it."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    import numpy as np

    from mlx_qwen3vl.cpu import kernels

    def counts():
        return {i["internal_api"]: i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"}

    threads.configure(1)
    assert set(counts().values()) == {1} and "openblas" in counts()
    threads.policy().fixed = 2  # changed behind the pool's back: the next matmul applies it
    kernels.matmul_t(np.ones((1, 8), np.float32), np.ones((4, 8), np.float32))
    assert set(counts().values()) == {2}


@pytest.mark.skipif(threads.cores() < 2, reason="needs 2 cores to tell 1 thread from all")
def test_count_reaches_mkl_in_other_threads():
    """threadpoolctl sets MKL's count for the calling thread only; MLX calls MKL from its own
    threads, so the count must be MKL's global one too (it was not: the plain graph kept every core)."""
    if threads.mkl_threads_elsewhere() is None:
        pytest.skip("MKL is not loaded (no `cpu` extra)")
    try:
        threads.configure(1)
        assert threads.mkl_threads_elsewhere() == 1
        threads.configure(2)
        assert threads.mkl_threads_elsewhere() == 2
    finally:
        threads.configure("auto")


def test_verbose_backend_names_the_thread_count(monkeypatch, on_cpu):
    monkeypatch.setenv(threads.ENV, "1")
    model = load_model(FIXTURES / "tiny-a", backend="cpu")
    assert "BLAS threads 1 (fixed)" in model.backend.describe()


def test_cli_flag(capsys):
    from mlx_qwen3vl.__main__ import main

    assert main(["--model", str(FIXTURES / "tiny-a"), "--blas-threads", "many"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --blas-threads = 'many' is not 'auto'"), err
