"""Work spread over MLX's CPU streams. MLX's CPU device runs each op on one thread (BLAS threads
its own matmuls); ops on separate CPU streams run on separate threads, so work split over
`PARTS` streams uses every core of a two-core machine. Used by the plain graph on the CPU device
only (activations.py, attention.py); on a GPU an op already fills the device.

Each part computes its rows exactly as the whole op would, so a split result is bit for bit the
unsplit one (BLAS too: MKL gives a row of a product the same bits whatever rows it is computed
with, which tests/test_spread.py holds; benchmarks/README.md, "The plain MLX graph")."""

import mlx.core as mx

PARTS = 2
# Below this many elements a split costs more than it saves (a decode step's activations).
MIN_ELEMENTS = 1 << 18
# Nor fewer rows per block: MKL computes a product of 4 to 23 rows with other kernels, rounding a
# row otherwise than among more rows (a block's linear in `by_rows` would then differ from the
# whole's).
MIN_ROWS = 32
_streams = []


def streams():
    """PARTS CPU streams, made once."""
    if not _streams:
        _streams.extend(mx.new_stream(mx.cpu) for _ in range(PARTS))
    return _streams


def blocks(n):
    """(start, stop, stream): n items in at most PARTS blocks, each with its CPU stream."""
    step = -(-n // PARTS)
    return [(a, min(n, a + step), s) for a, s in zip(range(0, n, step), streams())]


def by_rows(fn, *arrays, then=None):
    """fn(*arrays) for an fn that treats each row (last axis) on its own (elementwise work), or
    then(fn(*arrays)) for a `then` that does too (a linear). On the CPU device, from MIN_ELEMENTS
    elements and PARTS * MIN_ROWS rows, the arrays (of one shape) go in blocks of rows: fn of each
    on its own CPU stream, `then` of each on the caller's, the results concatenated. With `then`,
    fn's output is never copied whole."""
    shape = arrays[0].shape
    rows = arrays[0].size // shape[-1] if len(shape) >= 2 else 0
    if (rows < PARTS * MIN_ROWS or arrays[0].size < MIN_ELEMENTS
            or mx.default_device().type != mx.DeviceType.cpu):
        out = fn(*arrays)
        return out if then is None else then(out)
    flat = [a.reshape(rows, shape[-1]) for a in arrays]
    parts = []
    for a, b, stream in blocks(rows):
        with mx.stream(stream):
            part = fn(*(x[a:b] for x in flat))
        parts.append(part if then is None else then(part))
    return mx.concatenate(parts, axis=0).reshape(*shape[:-1], parts[0].shape[-1])
