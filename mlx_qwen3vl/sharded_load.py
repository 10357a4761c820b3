"""Load only the parts of a checkpoint that a model keeps after surgery (tensor or pipeline split).

`load_kept(path, dtype, surgery)` builds the model with placeholder parameters (zero-cost
broadcasts, never evaluated), lets `surgery(model)` slice, wrap, move or drop its layers, and then
reads each parameter that is left from the safetensors files, and only the bytes it holds.

- The checkpoint's tensors are `TensorView`s: a file region plus the axis permutations, slices and
  dtype cast that weights.py applies on the way to module names (renames, the hub's fused and
  transposed experts), so any part of a module-side tensor maps back to byte ranges of the file.
- A parameter the surgery left untouched (the same array object: replicated, or moved by a
  pipeline) is read whole. For one it sliced, the surgery runs again on models whose placeholders
  are probes: along axis k, the element at index i of tensor t holds (t << bits) | (i + 1). The
  sliced probes tell which checkpoint tensor and which indices along each axis the parameter holds
  (0: padding, as a vocabulary split's last rows); every element is checked against that reading.
  So the rank's slice is never guessed from names: uneven vocabulary splits, KV heads fewer than
  ranks and the vision qkv's three segments come out of the surgery itself.
- Whole-tensor reads remain where a tensor must be transformed before it can be indexed (the patch
  embedding's 5-D kernel reshaped for the matmul: always replicated anyway), and where a tied
  config's files also hold an lm_head, which is compared with the embedding (weights.py).

`read_stats()` counts the bytes read from tensor data (tests and benchmarks check it against the
shapes). Reads go through numpy memmaps, so only the touched pages are read from disk (a column
slice narrower than a page per row still touches every page of the tensor).
"""

from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from .checkpoint import TensorView, open_views, read_stats, reset_read_stats  # noqa: F401
from .checkpoint import _to_mlx
from .errors import WeightsError
from .weights import assemble, check_weights, empty_model

# ---------------------------------------------------------------------------------------------
# Which part of which tensor a parameter holds, found by running the surgery on probes
# ---------------------------------------------------------------------------------------------
def _placeholder(view) -> mx.array:
    return mx.broadcast_to(mx.zeros((), view.dtype), view.shape)


def _probe(view, tensor_id: int, axis: int, bits: int, dtype) -> mx.array:
    axis = min(axis, view.ndim - 1)
    n = view.shape[axis] if view.ndim else 1
    values = mx.arange(1, n + 1, dtype=dtype) + mx.array(tensor_id << bits, dtype=dtype)
    shape = [1] * view.ndim
    if view.ndim:
        shape[axis] = n
    return mx.broadcast_to(values.reshape(shape), view.shape)


def _built(views, make_model, surgery, fill, where=None):
    """A fresh model, its parameters set to fill(name, view), after the surgery (and the names and
    shapes checked against the checkpoint's first, when `where` names it)."""
    model = make_model()
    placed = {name: fill(name, view) for name, view in views.items()}
    if where is not None:
        check_weights(model, placed, where)
    model.update(tree_unflatten(list(placed.items())))
    surgery(model)
    return model, placed


def _chunks(n_rows: int, row_size: int, limit: int = 1 << 24):
    step = max(1, limit // max(row_size, 1))
    return [(a, min(n_rows, a + step)) for a in range(0, n_rows, step)]


def _decode(name, probes, bits):
    """(tensor id or None, per-axis index arrays with 0 for padding) of a sliced parameter, from
    its probes; raises WeightsError when an element is not where that reading puts it."""
    mask = (1 << bits) - 1
    ndim = probes[0].ndim
    profiles, lows = [], []
    for k, p in enumerate(probes):
        others = tuple(a for a in range(ndim) if a != k)
        high, low = (p.max(axis=others), p.min(axis=others)) if others else (p, p)
        mx.eval(high, low)
        profiles.append(np.array(high).astype(np.uint64))
        lows.append(np.array(low).astype(np.uint64))
    ids = {int(v) >> bits for prof in profiles for v in np.unique(prof) if v}
    if not ids:
        return None, None  # made by the surgery itself, not read from the checkpoint
    if len(ids) != 1:
        raise WeightsError(f"{name}: the model surgery combined several checkpoint tensors into one parameter, "
                           "which sharded loading cannot read by parts")
    tensor_id = ids.pop()
    index = [(prof & mask).astype(np.int64) for prof in profiles]
    unsupported = (f"{name}: the model surgery rearranged a checkpoint tensor in a way sharded loading cannot read "
                   "by parts (not a block of indices along each axis)")
    if all(i.all() for i in index):  # no padding: each slice across axis k must be constant (min == max)
        if not all(np.array_equal(high, low) for high, low in zip(profiles, lows)):
            raise WeightsError(unsupported)
        return tensor_id, index
    # Padding: check every element, along axis k (id << bits) | index_k[i_k] where no axis is padding, else 0.
    dtype, rows = probes[0].dtype, probes[0].shape[0]
    shaped = lambda x, k: x.reshape([-1 if a == k else 1 for a in range(ndim)])  # noqa: E731
    valid = [shaped(mx.array(i > 0), k) for k, i in enumerate(index)]
    for k, p in enumerate(probes):
        value = shaped(mx.array((np.uint64(tensor_id) << np.uint64(bits)) | index[k].astype(np.uint64)).astype(dtype), k)
        for a, b in _chunks(rows, p.size // max(rows, 1)):
            cut = lambda x: x[a:b] if x.shape[0] != 1 else x  # noqa: E731
            ok = cut(valid[0])
            for v in valid[1:]:
                ok = ok & v
            if not bool(mx.array_equal(cut(p), mx.where(ok, cut(value), mx.zeros((), dtype)))):
                raise WeightsError(unsupported)
    return tensor_id, index


def load_kept(path, dtype, surgery, where=None):
    """The model of a checkpoint folder after `surgery(model)`, each parameter read from the files
    by parts (see the module docstring). `surgery` may slice, wrap, move or drop layers; it runs on
    placeholders and must not evaluate them."""
    path = Path(path)
    where = where or str(path)
    config, views, dtype, layout, _ = assemble(path, dtype, views=True)
    make = lambda: empty_model(config, views, layout, path, dtype)  # noqa: E731

    model, placed = _built(views, make, surgery, lambda name, view: _placeholder(view), where)
    source = {id(v): name for name, v in placed.items()}
    params = dict(tree_flatten(model.parameters()))
    sliced = [name for name, v in params.items() if id(v) not in source]

    probes = {}
    if sliced:  # run the surgery again on probes, one build per axis
        names = sorted(views)
        ids = {name: i + 1 for i, name in enumerate(names)}
        bits = max(max(v.shape, default=1) for v in views.values()).bit_length()
        probe_dtype = mx.uint32 if len(names).bit_length() + bits <= 32 else mx.uint64
        ndim = max(params[name].ndim for name in sliced)
        for axis in range(max(ndim, 1)):
            built, _ = _built(views, make, surgery,
                              lambda name, view: _probe(view, ids[name], axis, bits, probe_dtype))
            flat = dict(tree_flatten(built.parameters()))
            for name in sliced:
                p = flat.get(name)
                if p is None or tuple(p.shape) != tuple(params[name].shape):
                    raise WeightsError(f"{where}: the model surgery gave {name} another shape on a second run; "
                                       "sharded loading needs a surgery that depends only on shapes")
                probes.setdefault(name, []).append(p)
            del built, flat
        by_id = {i: name for name, i in ids.items()}

    def assign(name, value):
        node, parts = model, name.split(".")
        for part in parts[:-1]:
            node = node[int(part)] if isinstance(node, list) else node[part]
        node[parts[-1]] = value

    for name, value in params.items():
        if id(value) in source:
            value = views[source[id(value)]].read()
        else:
            axes = probes.pop(name)[: max(value.ndim, 1)]
            mx.eval(axes)
            tensor_id, index = _decode(f"{where}: {name}", axes, bits)
            del axes
            if tensor_id is None:
                mx.eval(value)  # the surgery's own array (no checkpoint bytes)
                continue
            view = views[by_id[tensor_id]]
            keep = [np.nonzero(i)[0] for i in index]
            raw = view.read_raw([i[i > 0] - 1 for i in index])
            if any(k.size != i.size for k, i in zip(keep, index)):  # padding: zeros around the part read
                full = np.zeros([i.size for i in index], raw.dtype)
                full[np.ix_(*keep)] = raw
                raw = full
            value = _to_mlx(raw.reshape(value.shape), view.code, view.dtype)
        mx.eval(value)
        assign(name, value)
    mx.clear_cache()
    return model
