"""KV caches on disk: one safetensors file per cache, written with mlx-lm's `save_prompt_cache`
and read with its `load_prompt_cache` (ChatSession.save / load; the engine's disk tier,
engine/disk.py).

A file records what identifies the model it came from (a hash of its config, a fingerprint of
its weights' values, the compute dtype, its layer and head shapes) and the KV settings its cache
was made with, plus a BLAKE3 checksum over all of it and every tensor. A file may come from
elsewhere, so it is data only: the header is parsed and checked here (its JSON, every tensor's
dtype, shape and byte range, the file's length) before MLX reads a byte of it; the file is
opened once without blocking and read from that descriptor only if it is a regular file; its
tensors must be exactly those `write` makes for this model (the cache classes mlx-lm's KVCache,
QuantizedKVCache and ArraysCache), of this model's shapes and dtypes, with finite values, before
they are put into our cache types (`fill`). Nothing is unpickled or evaluated, and nothing in a
file is looked up by name. Anything wrong raises `CacheFileError`, one line naming the file and
what is wrong.

Writes are atomic (a private temporary file in the same folder, flushed, then os.replace), and
files are created 0600: they hold screenshots' keys and values.
"""

import hashlib
import json
import os
import stat
import struct
import uuid
import weakref
from pathlib import Path

import mlx.core as mx
import numpy as np
from blake3 import blake3

from .errors import InputError
from .kv_settings import FLOAT, KVSettings

FORMAT = "mlx_qwen3vl.kv-cache.1"
CLASSES = ("KVCache", "QuantizedKVCache", "ArraysCache")
MAX_HEADER_BYTES = 256 << 20
SAFETENSORS_DTYPES = {"BOOL": 1, "U8": 1, "I8": 1, "U16": 2, "I16": 2, "F16": 2, "BF16": 2, "U32": 4, "I32": 4,
                      "F32": 4, "U64": 8, "I64": 8, "F64": 8}
_KEY = __import__("re").compile(r"[0-9]+(\.[0-9]+)*")


class CacheFileError(InputError):
    """A cache file that cannot be used with this model (another model, dtype or KV settings;
    truncated, corrupted or not ours)."""


# --------------------------------------------------------------------------- what identifies a model
_identities = {}


def identity(model) -> dict:
    """What a cache file records of the model it came from: a hash of its config, a fingerprint of
    its weights (every parameter's name, shape, dtype and 16 values spread over it: a fine-tune of
    the same architecture differs), the compute dtype and the cache's shapes. Computed once per
    model object."""
    key = id(model)
    if key not in _identities:
        t = model.config.text_config
        dtype = model.language_model.embed_tokens(mx.zeros((1, 1), mx.int32)).dtype
        _identities[key] = {
            "config": hashlib.sha256(repr(model.config).encode()).hexdigest(),
            "weights": _weights_fingerprint(model), "dtype": str(dtype).replace("mlx.core.", ""),
            "layers": len(model.language_model.layers), "kv_heads": _kv_heads(model), "head_dim": int(t.head_dim)}
        weakref.finalize(model, _identities.pop, key, None)
    return _identities[key]


def _kv_heads(model) -> int:
    attn = model.language_model.layers[0].self_attn
    return int(attn.n_kv_heads)


def _weights_fingerprint(model) -> str:
    from mlx.utils import tree_flatten

    h = blake3()
    samples = []
    for name, a in sorted(tree_flatten(model.parameters())):
        h.update(f"{name}|{a.dtype}|{tuple(a.shape)}".encode())
        flat = a.reshape(-1)
        idx = mx.array(np.linspace(0, flat.size - 1, num=min(16, flat.size)).astype(np.int64).tolist())
        samples.append(mx.view(flat[idx], mx.uint8))
    mx.eval(samples)
    for s in samples:
        h.update(np.asarray(s).tobytes())
    return h.hexdigest()


# --------------------------------------------------------------------------- writing
def private_folder(path) -> Path:
    """`path` as a folder only this user may enter (created 0700; an existing one of ours is
    tightened to 0700; one that is not a folder, or belongs to another user, is refused)."""
    path = Path(path)
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = path.stat()
    except OSError as e:
        raise CacheFileError(f"cache folder {str(path)!r}: {e.strerror or e}") from None
    if not path.is_dir():
        raise CacheFileError(f"cache folder {str(path)!r} is not a folder")
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise CacheFileError(f"cache folder {str(path)!r} belongs to another user; use a folder of your own")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def write(path, caches, meta: dict, arrays=(), *, model, kv: KVSettings = FLOAT):
    """Write `caches` (one per layer, batch 1, no padding, buffers of exactly their positions),
    `meta` (JSON-ready) and extra uint8 `arrays` to `path`, atomically, readable by this user only."""
    from mlx_lm.models.cache import ArraysCache, save_prompt_cache

    path = Path(path)
    holder = ArraysCache(len(arrays))
    for i, a in enumerate(arrays):
        holder[i] = mx.array(np.ascontiguousarray(a))
    kind = caches[0].kind if caches else None
    if kind is not None and kind != kv.kind:
        raise ValueError(f"a {kind} cache written as made under {kv}")
    info = {"format": FORMAT, "identity": identity(model), "kv": kv.as_dict() if kv.quantized else None,
            "quantized": kind is not None, "positions": caches[0].size() if caches else 0, "meta": meta,
            "arrays": len(arrays)}
    text = json.dumps(info, sort_keys=True, separators=(",", ":"))
    checksum = _checksum(text, caches, holder.cache)
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex[:12]}.tmp.safetensors"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # 0600 before a byte is written
    os.close(fd)
    try:
        save_prompt_cache(str(tmp), [*caches, holder], {"info": text, "checksum": checksum})
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# --------------------------------------------------------------------------- reading
def _open(path: Path, what: str):
    """(file object, os.stat_result) of `path`, opened without blocking (a FIFO or a device named
    as the file never blocks the open) and refused unless its descriptor is a regular file; every
    later read goes through that descriptor, never the name again."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise CacheFileError(f"{what}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CacheFileError(f"{what} is not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb"), st
    except BaseException:
        os.close(fd)
        raise


def peek(path, what=None):
    """(the file's recorded info: format, identity, kv, positions, meta; its os.stat_result), from
    its header alone, after checking the header's structure and the file's length;
    CacheFileError otherwise."""
    path = Path(path)
    what = what or f"cache file {str(path)!r}"
    f, st = _open(path, what)
    with f:
        info, _, _, _ = _header(f, st.st_size, what)
    return info, st


def check(info: dict, model, kv=None, *, what="cache file") -> KVSettings:
    """Refuse a file's info recorded for another model, dtype or (when `kv` is given) other KV
    settings; returns the file's KVSettings."""
    mine, theirs = identity(model), info.get("identity") or {}
    for field, label in (("config", "model (config)"), ("dtype", "dtype"), ("layers", "layer count"),
                         ("kv_heads", "KV head count"), ("head_dim", "head dimension"), ("weights", "model (weights)")):
        if theirs.get(field) != mine[field]:
            shown = "" if field in ("config", "weights") else f" ({theirs.get(field)!r}, this one {mine[field]!r})"
            raise CacheFileError(f"{what} was written by another {label}{shown}; it cannot be used with this model")
    try:
        stored = KVSettings.build(**info["kv"]) if info.get("kv") else FLOAT
    except (InputError, TypeError):
        raise CacheFileError(f"{what} records unknown KV settings {info.get('kv')!r}") from None
    if kv is not None and (stored.kind != kv.kind or (kv.quantized and stored.start != kv.start)):
        raise CacheFileError(f"{what} holds a {stored.describe()} KV cache, not the {kv.describe()} one asked for")
    context = int(model.config.text_config.max_position_embeddings)
    if not 0 <= info["positions"] <= context:
        raise CacheFileError(f"{what} records {info['positions']} positions, outside this model's context {context}")
    return stored


def read(path, model, kv=None, *, what=None):
    """(caches in this model's cache types, meta, extra arrays as numpy, KVSettings the cache was
    made with) of a file written by `write` for `model` (and, when `kv` is given, those KV
    settings). The cache is quantized when the file says so (its settings' kind), else float.
    The file is opened once (see _open) and read whole from that descriptor: its tensors must be
    exactly the ones `write` makes for this model, of its shapes and dtypes, and finite."""
    path = Path(path)
    what = what or f"cache file {str(path)!r}"
    f, st = _open(path, what)
    with f:
        info, checksum, meta, _ = _header(f, st.st_size, what)
        stored = check(info, model, kv, what=what)
        try:
            f.seek(0)
            tensors = mx.load(f, format="safetensors")
            mx.eval(list(tensors.values()))  # read now, while the descriptor is open
        except Exception as e:  # noqa: BLE001 — MLX's reader on a file that passed the header checks
            raise CacheFileError(f"{what} could not be read ({type(e).__name__}: {e})") from None
    quantized = info.get("quantized") is True
    if quantized and not stored.quantized:
        raise CacheFileError(f"{what} records a quantized cache without its KV settings")
    layers, positions = info["identity"]["layers"], info["positions"]
    names = [f"1.{i}" for i in range(layers + 1)]
    if [meta.get(n) for n in names] != ["QuantizedKVCache" if quantized else "KVCache"] * layers + ["ArraysCache"]:
        raise CacheFileError(f"{what} does not hold this model's layers")
    if set(tensors) != _tensor_names(layers, quantized, info["arrays"]):
        raise CacheFileError(f"{what} does not hold this model's layers")
    caches = [_layer(tensors, i, model, stored if quantized else None, positions, what) for i in range(layers)]
    extra = [tensors[f"{layers}.0.{k}"] for k in range(info["arrays"])]
    if any(a.dtype != mx.uint8 or a.ndim < 1 for a in extra) or tensors[f"{layers}.1"].size \
            or tensors[f"{layers}.2"].size:
        raise CacheFileError(f"{what} holds media of another dtype than uint8 bytes")
    text = json.dumps(info, sort_keys=True, separators=(",", ":"))
    if _checksum(text, caches, extra) != checksum:
        raise CacheFileError(f"{what} is corrupted (its checksum does not match); delete it")
    return caches, info["meta"], [np.asarray(a) for a in extra], stored


def _tensor_names(layers: int, quantized: bool, arrays: int) -> set:
    """The tensors mlx-lm's save_prompt_cache writes for `write`'s caches: per layer its state
    (keys, values, offset; quantized: each of keys and values as data, scales, biases, then
    offset, group size, bits), then the extra arrays' holder (an ArraysCache: its list, no padding,
    no lengths)."""
    per = ([f"{a}.{b}" for a in "01" for b in "012"] + ["2", "3", "4"]) if quantized else ["0", "1", "2"]
    holder = {f"{layers}.0.{k}" for k in range(arrays)} | {f"{layers}.1", f"{layers}.2"}  # cache, padding, lengths
    return {f"{i}.{n}" for i in range(layers) for n in per} | holder


def _layer(tensors, i: int, model, kv, positions: int, what):
    """Layer `i`'s cache in this model's cache type from the file's tensors (quantized with `kv`'s
    bits and group size, float when `kv` is None), checked against the model: shapes, dtypes,
    the recorded positions and settings, finite values."""
    ident = identity(model)
    H, hd = ident["kv_heads"], ident["head_dim"]
    dtype = getattr(mx, ident["dtype"])
    t = lambda n: tensors[f"{i}.{n}"]  # noqa: E731
    scalar = lambda n: t(n).item() if t(n).size == 1 and t(n).dtype in (mx.int32, mx.int64) else None  # noqa: E731
    out = model.make_cache()[0]
    if scalar(2) != positions:
        raise CacheFileError(f"{what} holds other positions than the {positions} it records")
    if kv is not None:
        if (scalar(4), scalar(3)) != kv.kind:
            raise CacheFileError(f"{what} does not hold the {kv.describe()} cache it records")
        G = hd // kv.group_size
        want = [((1, H, positions, hd * kv.bits // 32), mx.uint32), ((1, H, positions, G), dtype),
                ((1, H, positions, G), dtype)]
        keys, values = (tuple(t(f"{a}.{b}") for b in range(3)) for a in range(2))
        if any(a.shape != s or a.dtype != d for part in (keys, values) for a, (s, d) in zip(part, want)):
            raise CacheFileError(f"{what} holds tensors of other shapes or dtypes than this model's cache")
        floats = (*keys[1:], *values[1:])
        out = out.to_quantized(group_size=kv.group_size, bits=kv.bits)
    else:
        if positions == 0:  # nothing held yet: an empty cache, as a new session's
            return out
        keys, values = t(0), t(1)
        if any(a.shape != (1, H, positions, hd) or a.dtype != dtype for a in (keys, values)):
            raise CacheFileError(f"{what} holds tensors of other shapes or dtypes than this model's cache")
        floats = (keys, values)
    if positions and not all(mx.isfinite(a).all().item() for a in floats):
        raise CacheFileError(f"{what} holds KV values that are not finite (NaN or infinity)")
    return out.fill(keys, values) if positions else out


def _checksum(text: str, caches, arrays) -> str:
    h = blake3()
    h.update(text.encode())
    for c in caches:
        h.update(f"|{type(c).__name__}|{c.size()}|".encode())
        for part in c.buffers():
            for a in (part if isinstance(part, (tuple, list)) else (part,)):
                _digest_array(h, a)
    for a in arrays:
        _digest_array(h, a)
    return h.hexdigest()


def _digest_array(h, a):
    if a is None:
        h.update(b"none")
        return
    h.update(f"{a.dtype}|{tuple(a.shape)}|".encode())
    if a.size:
        h.update(memoryview(np.ascontiguousarray(np.asarray(mx.view(mx.contiguous(a), mx.uint8)))).cast("B"))


def _header(f, size: int, what: str):
    """(info, checksum, metadata, tensors) from the safetensors header read from `f` (at its
    start), checked: JSON of the expected layout, known dtypes, byte ranges that tile the data
    exactly, the file's length."""
    try:
        head = f.read(8)
        if len(head) < 8:
            raise CacheFileError(f"{what} is truncated (no header)")
        (n,) = struct.unpack("<Q", head)
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise CacheFileError(f"{what} is truncated or not a cache file (its header does not fit)")
        raw = f.read(n)
    except OSError as e:
        raise CacheFileError(f"{what}: {e.strerror or e}") from None
    try:
        header = json.loads(raw)
        meta = header.pop("__metadata__")
        info = json.loads(meta["0.info"])
        checksum = meta["0.checksum"]
    except (ValueError, KeyError, TypeError, AttributeError):
        raise CacheFileError(f"{what} is not a cache file of this library (or its header is corrupted)") from None
    if not isinstance(info, dict) or info.get("format") != FORMAT or not isinstance(info.get("identity"), dict):
        raise CacheFileError(f"{what} is not a cache file of this library's format {FORMAT}")
    layers = info["identity"].get("layers")
    classes = [meta.get(f"1.{i}") for i in range(layers + 1)] if isinstance(layers, int) and 0 < layers < 4096 else []
    if not classes or any(c not in CLASSES for c in classes) or f"1.{layers + 1}" in meta:
        raise CacheFileError(f"{what} names cache types other than {', '.join(CLASSES)}")
    if not _count(info.get("positions")) or not _count(info.get("arrays")) or not isinstance(checksum, str):
        raise CacheFileError(f"{what} is not a cache file of this library (or its header is corrupted)")
    ends = []
    for name, t in header.items():
        try:
            dtype, shape, (b, e) = t["dtype"], t["shape"], t["data_offsets"]
            ok = (_KEY.fullmatch(name) and dtype in SAFETENSORS_DTYPES and isinstance(shape, list)
                  and all(_count(d) for d in shape) and _count(b) and _count(e) and b <= e
                  and e - b == int(np.prod(shape, dtype=np.int64)) * SAFETENSORS_DTYPES[dtype])
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise CacheFileError(f"{what} has a malformed tensor entry {name!r}")
        ends.append((b, e))
    ends.sort()
    at = 0
    for b, e in ends:
        if b != at:
            raise CacheFileError(f"{what} has overlapping or gapped tensors (corrupted)")
        at = e
    if size != 8 + n + at:
        raise CacheFileError(f"{what} is truncated ({size} bytes, its header describes {8 + n + at})")
    return info, checksum, meta, header


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0
