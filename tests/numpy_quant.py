"""MLX's quantized formats decoded with numpy alone, bit by bit from the stored packed values: the
independent side of the quantization precision tests (and of make_quant_reference.py).

Packing: element j of a row sits in bits [j*b, (j+1)*b) of the row's uint32 words read as one
little-endian bit stream. Affine: w = q * scale + bias per group. mxfp4/nvfp4: 4-bit E2M1 codes
(sign, 2 exponent bits, 1 mantissa bit) times an E8M0 (mxfp4: 2**(s-127)) or E4M3 (nvfp4) group
scale; mxfp8: 8-bit E4M3 codes times an E8M0 group scale.
"""

import hashlib

import numpy as np

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float64)


def e4m3(codes: np.ndarray) -> np.ndarray:
    """OCP FP8 E4M3 (bias 7, no infinities, 0x7f/0xff NaN) → float64."""
    codes = codes.astype(np.int64)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp, man = (codes >> 3) & 0xF, codes & 0x7
    value = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1 + man / 8.0) * 2.0 ** (exp - 7))
    value = np.where((codes & 0x7F) == 0x7F, np.nan, value)
    return sign * value


def e8m0(codes: np.ndarray) -> np.ndarray:
    return 2.0 ** (codes.astype(np.float64) - 127)


def unpack(packed: np.ndarray, bits: int, n: int) -> np.ndarray:
    """(rows, words) uint32 → (rows, n) integer codes."""
    stream = np.unpackbits(packed.astype("<u4").view(np.uint8), axis=-1, bitorder="little")
    stream = stream[:, : n * bits].reshape(packed.shape[0], n, bits).astype(np.int64)
    return (stream << np.arange(bits)).sum(-1)


def dequantize(weight, scales, biases, group_size: int, bits: int, mode: str) -> np.ndarray:
    """Stored (weight uint32, scales, biases or None) → float64 matrix."""
    weight, scales = np.asarray(weight), np.asarray(scales)
    rows = weight.shape[0]
    n = weight.shape[-1] * 32 // bits
    codes = unpack(weight.reshape(rows, -1), bits, n).reshape(rows, n // group_size, group_size)
    if mode == "affine":
        scale = scales.astype(np.float64)[..., None]
        return (codes * scale + np.asarray(biases, np.float64)[..., None]).reshape(rows, n)
    values = E2M1[codes] if bits == 4 else e4m3(codes)
    scale = (e4m3(scales) if mode == "nvfp4" else e8m0(scales))[..., None]
    return (values * scale).reshape(rows, n)


def packed_digest(tensors: dict) -> str:
    """sha256 over the integer (packed) tensors of a folder, by name: the stored quantized values."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        value = np.asarray(tensors[name])
        if value.dtype.kind in "ui":
            h.update(name.encode())
            h.update(np.ascontiguousarray(value).tobytes())
    return h.hexdigest()


def tensors_digest(folder) -> str:
    """sha256 over every tensor of a folder's safetensors files (name, dtype, shape, bytes)."""
    from pathlib import Path

    import mlx.core as mx

    tensors = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        tensors.update(mx.load(str(f)))
    h = hashlib.sha256()
    for name in sorted(tensors):
        v = tensors[name]
        h.update(f"{name}|{v.dtype}|{tuple(v.shape)}".encode())
        h.update(np.array(mx.view(v, mx.uint16) if v.dtype == mx.bfloat16 else v).tobytes())
    return h.hexdigest()
