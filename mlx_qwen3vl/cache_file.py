"""KV caches on disk: one safetensors file per cache, written with mlx-lm's `save_prompt_cache`
and read with its `load_prompt_cache` (ChatSession.save / load; the engine's disk tier,
engine/disk.py).

A file records what identifies the model it came from (a hash of its config, a fingerprint of
its weights' values, the compute dtype, its layer and head shapes) and the KV settings its cache
was made with, plus a BLAKE3 checksum over all of it and every tensor. A file may come from
elsewhere, so it is data only: the header is parsed and checked here (its JSON, every tensor's
dtype, shape and byte range, the file's length) before MLX reads a byte of it, the cache classes
it names must be mlx-lm's KVCache, QuantizedKVCache or ArraysCache (load_prompt_cache looks them
up by name), and each layer's tensors must have the shapes and dtypes this model makes before
they are put into our cache types. Nothing is unpickled or evaluated. Anything wrong raises
`CacheFileError`, one line naming the file and what is wrong.

Writes are atomic (a private temporary file in the same folder, flushed, then os.replace), and
files are created 0600: they hold screenshots' keys and values.
"""

import hashlib
import json
import os
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
def peek(path) -> dict:
    """The file's recorded info (format, identity, kv, positions, meta), from its header alone,
    after checking the header's structure and the file's length; CacheFileError otherwise."""
    info, _, _ = _header(Path(path))
    return info


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
    return stored


def read(path, model, kv=None, *, what=None):
    """(caches in this model's cache types, meta, extra arrays as numpy, KVSettings the cache was
    made with) of a file written by `write` for `model` (and, when `kv` is given, those KV
    settings). The cache is quantized when the file says so (its settings' kind), else float."""
    from mlx_lm.models.cache import load_prompt_cache

    path = Path(path)
    what = what or f"cache file {str(path)!r}"
    info, checksum, _ = _header(path, what)
    stored = check(info, model, kv, what=what)
    try:
        loaded = load_prompt_cache(str(path))
    except Exception as e:  # noqa: BLE001 — MLX's reader on a file that passed the header checks
        raise CacheFileError(f"{what} could not be read ({type(e).__name__}: {e})") from None
    *layers, holder = loaded
    extra = list(holder.cache) if hasattr(holder, "cache") else None
    if extra is None or len(extra) != info.get("arrays") or len(layers) != info["identity"]["layers"]:
        raise CacheFileError(f"{what} does not hold this model's layers")
    text = json.dumps(info, sort_keys=True, separators=(",", ":"))
    if _checksum(text, layers, extra) != checksum:
        raise CacheFileError(f"{what} is corrupted (its checksum does not match); delete it")
    quantized = info.get("quantized") is True
    if quantized and not stored.quantized:
        raise CacheFileError(f"{what} records a quantized cache without its KV settings")
    caches = [_ours(c, model, stored if quantized else None, info["positions"], what) for c in layers]
    return caches, info["meta"], [np.asarray(a) for a in extra], stored


def _ours(c, model, kv, positions: int, what):
    """mlx-lm's loaded cache → this model's cache type (quantized with `kv`'s bits and group size,
    float when `kv` is None), its tensors checked against the model."""
    ident = identity(model)
    H, hd = ident["kv_heads"], ident["head_dim"]
    dtype = getattr(mx, ident["dtype"])
    out = model.make_cache()[0]
    if positions == 0 and kv is None:  # nothing held yet: an empty cache, as a new session's
        return out
    if kv is not None:
        if type(c).__name__ != "QuantizedKVCache" or (c.bits, c.group_size) != kv.kind:
            raise CacheFileError(f"{what} does not hold the {kv.describe()} cache it records")
        G = hd // kv.group_size
        want = [((1, H, positions, hd * kv.bits // 32), mx.uint32), ((1, H, positions, G), dtype),
                ((1, H, positions, G), dtype)]
        keys, values = tuple(c.keys), tuple(c.values)
        if any(len(t) != 3 or any(a.shape != s or a.dtype != d for a, (s, d) in zip(t, want)) for t in (keys, values)):
            raise CacheFileError(f"{what} holds tensors of other shapes or dtypes than this model's cache")
        out = out.to_quantized(group_size=kv.group_size, bits=kv.bits)
    else:
        if type(c).__name__ != "KVCache":
            raise CacheFileError(f"{what} does not hold the float cache it records")
        keys, values = c.keys, c.values
        if any(a is None or a.shape != (1, H, positions, hd) or a.dtype != dtype for a in (keys, values)):
            raise CacheFileError(f"{what} holds tensors of other shapes or dtypes than this model's cache")
    if c.offset != positions:
        raise CacheFileError(f"{what} holds {c.offset} positions, not the {positions} it records")
    out.keys, out.values, out.offset = keys, values, positions
    return out


def _checksum(text: str, caches, arrays) -> str:
    h = blake3()
    h.update(text.encode())
    for c in caches:
        h.update(f"|{type(c).__name__}|{c.offset}|".encode())
        for part in (c.keys, c.values):
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


def _header(path: Path, what=None):
    """(info, checksum, tensors) from the safetensors header, checked: JSON of the expected
    layout, known dtypes, byte ranges that tile the data exactly, the file's length."""
    what = what or f"cache file {str(path)!r}"
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
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
    except (ValueError, KeyError, TypeError):
        raise CacheFileError(f"{what} is not a cache file of this library (or its header is corrupted)") from None
    if not isinstance(info, dict) or info.get("format") != FORMAT or not isinstance(info.get("identity"), dict):
        raise CacheFileError(f"{what} is not a cache file of this library's format {FORMAT}")
    layers = info["identity"].get("layers")
    classes = [meta.get(f"1.{i}") for i in range(layers + 1)] if isinstance(layers, int) and 0 < layers < 4096 else []
    if not classes or any(c not in CLASSES for c in classes) or f"1.{layers + 1}" in meta:
        raise CacheFileError(f"{what} names cache types other than {', '.join(CLASSES)}")
    if not isinstance(info.get("positions"), int) or not isinstance(info.get("arrays"), int):
        raise CacheFileError(f"{what} is not a cache file of this library (or its header is corrupted)")
    ends = []
    for name, t in header.items():
        try:
            dtype, shape, (b, e) = t["dtype"], t["shape"], t["data_offsets"]
            ok = (_KEY.fullmatch(name) and dtype in SAFETENSORS_DTYPES and all(isinstance(d, int) and d >= 0 for d in shape)
                  and isinstance(b, int) and isinstance(e, int) and 0 <= b <= e
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
    return info, checksum, header
