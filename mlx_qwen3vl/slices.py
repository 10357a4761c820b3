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

import json
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from .errors import WeightsError

# safetensors dtype → (numpy dtype to read the bytes as, MLX dtype they hold)
DTYPES = {
    "F32": (np.float32, mx.float32), "F16": (np.float16, mx.float16), "BF16": (np.uint16, mx.bfloat16),
    "U8": (np.uint8, mx.uint8), "U16": (np.uint16, mx.uint16), "U32": (np.uint32, mx.uint32),
    "U64": (np.uint64, mx.uint64), "I8": (np.int8, mx.int8), "I16": (np.int16, mx.int16),
    "I32": (np.int32, mx.int32), "I64": (np.int64, mx.int64), "BOOL": (np.bool_, mx.bool_),
}

_stats = {"bytes": 0, "whole": []}


def read_stats() -> dict:
    """{"bytes": tensor bytes read since the last reset, "whole": views read whole for a transform}."""
    return {"bytes": _stats["bytes"], "whole": list(_stats["whole"])}


def reset_read_stats():
    _stats.update(bytes=0, whole=[])


def _runs_to_index(idx: np.ndarray):
    """A slice when idx is one ascending run (a view, no copy), else the index array."""
    if idx.size and idx[-1] - idx[0] == idx.size - 1 and (idx.size == 1 or np.all(np.diff(idx) == 1)):
        return slice(int(idx[0]), int(idx[-1]) + 1)
    return idx


class TensorView:
    """One tensor of a safetensors file as the model will hold it: stored axes permuted (`perm`:
    view axis → stored axis) and sliced (`begin`), cast to `dtype`, read only where asked. A view
    reshaped (`ops`) can only be read whole."""

    def __init__(self, file, key, code, offset, stored_shape, perm=None, begin=None, shape=None, dtype=None,
                 ops=(), base_shape=None):
        self.file, self.key, self.code, self.offset = file, key, code, offset
        self.stored_shape = tuple(stored_shape)
        self.perm = tuple(range(len(self.stored_shape))) if perm is None else tuple(perm)
        self.begin = (0,) * len(self.stored_shape) if begin is None else tuple(begin)
        self.shape = self.stored_shape if shape is None else tuple(shape)
        self.dtype = DTYPES[code][1] if dtype is None else dtype
        self.ops = tuple(ops)
        self.base_shape = self.shape if base_shape is None else tuple(base_shape)  # the shape before `ops`

    def __repr__(self):
        return f"TensorView({self.file.name}:{self.key} {self.shape} {self.dtype})"

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def stored_itemsize(self):
        return np.dtype(DTYPES[self.code][0]).itemsize

    @property
    def size(self):
        return int(np.prod(self.shape, dtype=np.int64))

    def _with(self, **kw):
        fields = dict(perm=self.perm, begin=self.begin, shape=self.shape, dtype=self.dtype, ops=self.ops,
                      base_shape=self.base_shape)
        fields.update(kw)
        if not fields["ops"]:
            fields["base_shape"] = None
        elif not self.ops:
            fields["base_shape"] = self.shape
        return TensorView(self.file, self.key, self.code, self.offset, self.stored_shape, **fields)

    # --- the array operations weights.py applies ---------------------------------------------
    def astype(self, dtype):
        return self._with(dtype=dtype)

    def transpose(self, *axes):
        axes = axes[0] if len(axes) == 1 and isinstance(axes[0], (tuple, list)) else axes
        shape = tuple(self.shape[a] for a in axes)
        if self.ops:
            return self._with(shape=shape, ops=self.ops + (("transpose", tuple(axes)),))
        return self._with(perm=tuple(self.perm[a] for a in axes), begin=tuple(self.begin[a] for a in axes),
                          shape=shape)

    def swapaxes(self, a, b):
        axes = list(range(self.ndim))
        axes[a], axes[b] = axes[b], axes[a]
        return self.transpose(*axes)

    def reshape(self, *shape):
        shape = list(shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape)
        if -1 in shape:
            known = int(np.prod([s for s in shape if s != -1], dtype=np.int64))
            shape[shape.index(-1)] = self.size // known
        return self._with(shape=tuple(shape), ops=self.ops + (("reshape", tuple(shape)),))

    def __getitem__(self, key):
        key = key if isinstance(key, tuple) else (key,)
        if any(k is Ellipsis for k in key):
            i = key.index(Ellipsis)
            key = key[:i] + (slice(None),) * (self.ndim - len(key) + 1) + key[i + 1:]
        if len(key) > self.ndim or not all(isinstance(k, slice) and k.step in (None, 1) for k in key):
            raise TypeError(f"{self!r}: only unit-step slices are supported, not {key!r}")
        key = key + (slice(None),) * (self.ndim - len(key))
        ranges = [k.indices(n)[:2] for k, n in zip(key, self.shape)]
        shape = tuple(max(0, stop - start) for start, stop in ranges)
        if self.ops:
            return self._with(shape=shape, ops=self.ops + (("slice", tuple(ranges)),))
        return self._with(begin=tuple(b + start for b, (start, _) in zip(self.begin, ranges)), shape=shape)

    # --- reading ------------------------------------------------------------------------------
    def _read_stored(self, stored_index) -> np.ndarray:
        """Raw stored-dtype elements at per-stored-axis index arrays, in stored axis order."""
        np_dtype = DTYPES[self.code][0]
        if any(idx.size == 0 for idx in stored_index):
            return np.zeros([idx.size for idx in stored_index], np_dtype)
        mm = np.memmap(self.file, dtype=np_dtype, mode="r", offset=self.offset, shape=self.stored_shape)
        index = [_runs_to_index(idx) for idx in stored_index]
        part = mm[tuple(i if isinstance(i, slice) else slice(None) for i in index)]  # a view: nothing read yet
        touched = None
        for axis, i in enumerate(index):
            if not isinstance(i, slice):
                part = np.take(part, i, axis=axis)  # the first take reads; later ones copy in memory
                touched = part.size if touched is None else touched
        part = np.array(part, copy=True)
        _stats["bytes"] += (part.size if touched is None else touched) * part.itemsize
        del mm
        return part

    def read_raw(self, index=None) -> np.ndarray:
        """The view's elements (before the cast) at per-view-axis index arrays (None: all)."""
        if index is None:
            index = [np.arange(n) for n in self.shape]
        if self.ops:  # a transform: read whole, apply it, then index
            _stats["whole"].append(self.key)
            base = self._with(shape=self.base_shape, ops=())
            x = _to_mlx(base.read_raw(), self.code, None)
            for op, arg in self.ops:
                x = x.transpose(arg) if op == "transpose" else x.reshape(arg) if op == "reshape" else \
                    x[tuple(slice(a, b) for a, b in arg)]
            x = np.array(x.view(mx.uint16) if self.code == "BF16" else x)
            return x[np.ix_(*index)] if x.ndim else x
        stored = [None] * len(self.stored_shape)
        for axis, idx in enumerate(index):
            stored[self.perm[axis]] = np.asarray(idx, dtype=np.int64) + self.begin[axis]
        part = self._read_stored(stored)
        return np.ascontiguousarray(part.transpose(self.perm))  # view axis k is stored axis perm[k]

    def read(self, index=None) -> mx.array:
        return _to_mlx(self.read_raw(index), self.code, self.dtype)


def _to_mlx(raw: np.ndarray, code: str, dtype) -> mx.array:
    x = mx.array(raw)
    if code == "BF16":
        x = x.view(mx.bfloat16)
    return x if dtype is None or x.dtype == dtype else x.astype(dtype)


def open_views(f: Path) -> dict:
    """name → TensorView for every tensor of one safetensors file (only its header is read)."""
    try:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
    except (OSError, struct.error, ValueError) as e:
        raise WeightsError(f"{f} could not be read ({e}); re-download or re-convert it") from None
    size = f.stat().st_size
    views = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        code, shape, (start, stop) = info["dtype"], info["shape"], info["data_offsets"]
        if code not in DTYPES:
            raise WeightsError(f"{f}: {key} has dtype {code}, which sharded loading cannot read by parts")
        if 8 + n + stop > size:
            raise WeightsError(f"{f} is truncated ({key} ends past the end of the file); re-download or re-convert it")
        views[key] = TensorView(f, key, code, 8 + n + start, shape)
    return views


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
    from .weights import check_weights

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
    from .weights import assemble, empty_model

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
