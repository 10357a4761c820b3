"""The files of a checkpoint folder: its safetensors shards (and their index) and config.json.

`read_weights` reads every tensor of a folder, each from the shard the index places it in: lazily
loaded MLX arrays, or `TensorView`s (views=True) that read only the bytes a caller asks for (the
sharded loads of sharded_load.py). weights.py turns the names and layouts into this package's modules.
"""

import json
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np

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


def _short_list(names, limit=4):
    names = sorted(names)
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def weight_files(path: Path):
    """The safetensors files of a folder and the index's name → file map (None without an index)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise WeightsError(f"{index} is not a valid safetensors index ({e})") from None
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise WeightsError(f"{path}: shard(s) listed in the index are missing: {_short_list(missing)}")
        return [path / f for f in files], weight_map
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"{path} has no *.safetensors weights: download or convert the checkpoint first")
    return files, None


def _load_file(f: Path) -> dict:
    try:
        return mx.load(str(f))
    except Exception as e:  # mlx raises RuntimeError/ValueError for truncated or foreign files
        raise WeightsError(f"{f} could not be read ({str(e).splitlines()[0]}); re-download or re-convert it") from None


def read_weights(path: Path, with_files: bool = False, views: bool = False):
    """All tensors of a folder (lazily loaded; views=True: sharded_load.TensorView's, read by parts
    later); with_files=True also returns name → file name.

    With an index each name is read from the shard the index places it in (a stray copy in another
    shard is ignored); without one, a name in two files is an error rather than "the last file wins"."""
    files, weight_map = weight_files(path)
    weights, origin = {}, {}
    for f in files:
        for key, value in (open_views(f) if views else _load_file(f)).items():
            if weight_map is not None:
                if weight_map.get(key, f.name) != f.name:
                    continue  # the index places this tensor in another shard
            elif key in weights:
                raise WeightsError(f"{path}: {key} is in both {origin[key]} and {f.name} and there is no "
                                   "model.safetensors.index.json to say which is right: remove the stray file")
            weights[key], origin[key] = value, f.name
    if weight_map is not None:
        unlisted = set(weight_map) - set(weights)
        if unlisted:
            raise WeightsError(f"{path}: weights named in the index are missing from the shards: {_short_list(unlisted)}")
        not_in_index = set(weights) - set(weight_map)
        if not_in_index:
            raise WeightsError(f"{path}: shards hold weights missing from the index: {_short_list(not_in_index)}")
    return (weights, origin) if with_files else weights


def read_raw_config(path: Path) -> dict:
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}  # ModelConfig.from_pretrained has already reported a missing or broken file
