"""How a request's KV cache is stored: `KVSettings`, mlx-lm's `kv_bits` / `kv_group_size` /
`quantized_kv_start` as one validated value (the way SamplingParams holds the sampling options).

A cache is float until it holds `start` positions; then it is quantized to `bits` (affine, groups
of `group_size` along the head dimension, mx.quantize) and every later position is stored and
read quantized. Prefill chunks end at `start`, so which positions were computed against the float
cache and which against the quantized one depends on the positions alone, never on chunk sizes or
on whether a prefix came from a cache: a reused prefix then holds exactly what a fresh run would.
"""

from dataclasses import dataclass
from typing import Optional

from .errors import InputError

BITS = (4, 8)
GROUP_SIZES = (128, 64, 32)  # those MLX's quantized matmuls take
DEFAULT_GROUP_SIZE = 64
DEFAULT_START = 5000  # mlx-lm's DEFAULT_QUANTIZED_KV_START
FIELDS = {"kv_bits": "bits", "kv_group_size": "group_size", "quantized_kv_start": "start"}


@dataclass(frozen=True)
class KVSettings:
    """bits None: a float cache (the other two fields are then unused)."""

    bits: Optional[int] = None
    group_size: int = DEFAULT_GROUP_SIZE
    start: int = DEFAULT_START

    @classmethod
    def build(cls, kv_bits=None, kv_group_size=None, quantized_kv_start=None, *, name=None) -> "KVSettings":
        """Checked settings from mlx-lm's names (None: the default). `name(field)` gives the name a
        message uses for a field (a CLI flag, a JSON key); by default the keyword's own."""
        name = name or (lambda f: f)
        if kv_bits is not None and (not _int(kv_bits) or kv_bits not in BITS):
            raise InputError(f"{name('kv_bits')} = {kv_bits!r} is not allowed; use 4 or 8 (or none for a float cache)")
        gs = DEFAULT_GROUP_SIZE if kv_group_size is None else kv_group_size
        if not _int(gs) or gs not in GROUP_SIZES:
            raise InputError(f"{name('kv_group_size')} = {kv_group_size!r} is not allowed; use 32, 64 or 128")
        start = DEFAULT_START if quantized_kv_start is None else quantized_kv_start
        if not _int(start) or start < 0:
            raise InputError(f"{name('quantized_kv_start')} = {quantized_kv_start!r} is not allowed; use an "
                             "integer >= 0 (the cache length at which quantization begins)")
        return cls(kv_bits, gs, start)

    @classmethod
    def pop_from(cls, kwargs: dict, base: Optional["KVSettings"] = None) -> Optional["KVSettings"]:
        """Settings from the kv_* keywords in `kwargs` (removed from it) over `base`; None when
        none is given and there is no base."""
        given = {k: kwargs.pop(k) for k in list(kwargs) if k in FIELDS}
        if not given:
            return base
        base = base or FLOAT
        merged = {k: given.get(k, getattr(base, f)) for k, f in FIELDS.items()}
        return cls.build(**merged)

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    @property
    def kind(self):
        """What a cache of these settings is once quantized: (bits, group_size), None for float."""
        return (self.bits, self.group_size) if self.bits is not None else None

    def fit(self, head_dim: int) -> "KVSettings":
        """These settings for a model of `head_dim`: a group size that does not divide it is chosen
        down to the largest one that does (64 → 32 on a head dimension of 32); none: InputError."""
        if self.bits is None or head_dim % self.group_size == 0:
            return self
        for gs in GROUP_SIZES:
            if gs < self.group_size and head_dim % gs == 0:
                return KVSettings(self.bits, gs, self.start)
        raise InputError(f"kv_group_size {self.group_size} does not divide the model's head dimension {head_dim}, "
                         f"and neither does any of {', '.join(map(str, GROUP_SIZES))}: this model's KV cache cannot "
                         "be quantized; leave kv_bits unset")

    def as_dict(self) -> dict:
        return {"kv_bits": self.bits, "kv_group_size": self.group_size, "quantized_kv_start": self.start}

    def describe(self) -> str:
        if self.bits is None:
            return "float"
        return f"{self.bits}-bit (group size {self.group_size}) from {self.start} positions"


FLOAT = KVSettings()


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def quantize_if_due(caches: list, settings: KVSettings) -> bool:
    """In place: each layer's float cache → its quantized one (`to_quantized`), when `settings`
    ask for it and the cache holds `settings.start` positions or more. Returns whether it did."""
    if not settings.quantized or not caches or caches[0].kind is not None or caches[0].size() < settings.start:
        return False
    for i, c in enumerate(caches):
        caches[i] = c.to_quantized(group_size=settings.group_size, bits=settings.bits)
    return True


def bytes_per_position(layers: int, kv_heads: int, head_dim: int, itemsize: int, kind=None) -> int:
    """Bytes one position of `layers` caches takes: keys and values, float or quantized (the
    packed data plus one scale and one bias per group, in the model's dtype)."""
    if kind is None:
        return 2 * layers * kv_heads * head_dim * itemsize
    bits, group_size = kind
    return 2 * layers * kv_heads * (head_dim * bits // 8 + 2 * (head_dim // group_size) * itemsize)


def resolve(model, settings: Optional[KVSettings]) -> KVSettings:
    """`settings` (None: a float cache) fitted to `model`'s head dimension."""
    if settings is None or settings.bits is None:
        return FLOAT
    return settings.fit(int(model.config.text_config.head_dim))
