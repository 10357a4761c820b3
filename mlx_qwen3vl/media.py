"""Any image a user hands us → one RGB uint8 array (H, W, 3), the same way for every source.

Sources: a path, bytes, a data: URL (`data:image;base64,...`, with or without a subtype), an
http(s) URL, a PIL image or a numpy array. Encoded sources, whichever of these they come from, are
decoded by Pillow only in IMAGE_FORMATS (told by content) and turned upright
by their EXIF orientation (as transformers' load_image does); from there files and PIL images take
one conversion to RGB, `pil_to_rgb`:

- transparency (an alpha band, a palette `tRNS` entry, an RGB or grey colour key) is composited
  onto white, as transformers' convert_to_rgb does for PIL images and qwen-vl-utils does for
  training. transformers' own string loader drops the alpha instead; we composite for every source
  so that a screenshot reads the same however it is passed.
- 16-bit samples keep their high byte (v >> 8), which Pillow already does for 16-bit RGB and LA
  PNGs. Pillow's conversion of 16-bit greyscale (I;16) clips at 255 instead, a nearly white image
  (transformers gives that washed-out image to the model); we deliberately differ there.

Arrays are already pixels: 1 channel is repeated, 4 channels are composited onto white by
transformers' formula for arrays.
"""

import io
import os
import re
import stat
import struct
import urllib.error
import urllib.request
import warnings
import zlib
from pathlib import Path
from typing import Optional

import numpy as np
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

from . import media_access
from .errors import InputError

URL_TIMEOUT_S = 10
# Larger images are refused before decoding (10000 x 10000; 300 MB as RGB). The model never sees
# more than the processor's max_pixels (16.7M by default), and Pillow's own decompression-bomb
# check would warn from 89M pixels and fail from 179M with a message about attacks.
MAX_IMAGE_PIXELS = 100_000_000
# Encoded images are decoded only in these formats, told by their bytes (never by a name or a
# media type): the formats screenshots and photos come in. Pillow's other plugins stay unreachable
# (EPS / PostScript would run Ghostscript on the data). An MPO (a phone's multi-picture JPEG) opens
# as JPEG.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
FORMATS_TEXT = "PNG, JPEG, WebP, GIF, BMP or TIFF"
SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")
_TRANSPOSED = (5, 6, 7, 8)  # EXIF orientations that swap width and height
_ADDRESS = re.compile(r"\s*<[^<>]* at 0x[0-9a-fA-F]+>")  # "<_io.BytesIO object at 0x...>"


def describe(x):
    """A short name for an input, for error messages (never an object's repr)."""
    if isinstance(x, (str, os.PathLike)):
        s = str(x)
        if s.startswith("data:"):
            return repr(s[:30] + "...")
        return repr(s if len(s) <= 80 else s[:60] + "...")
    if isinstance(x, np.ndarray):
        return f"(array {x.shape} {x.dtype})"
    return f"({type(x).__name__})"


def reason(e):
    """An exception as a short single line, for the one-line messages."""
    text = _ADDRESS.sub("", str(getattr(e, "reason", e) or ""))
    return " ".join(text.split())[:200] or type(e).__name__


def _file_kind(mode):
    """None for a regular file, else what the path is instead."""
    if stat.S_ISREG(mode):
        return None
    kinds = {stat.S_ISDIR: "directory", stat.S_ISFIFO: "FIFO (named pipe)", stat.S_ISCHR: "character device",
             stat.S_ISBLK: "block device", stat.S_ISSOCK: "socket"}
    return next((name for test, name in kinds.items() if test(mode)), "special file")


def check_regular_file(path, label):
    """Refuse a path that is missing or not a regular file, without opening it."""
    try:
        kind = _file_kind(os.stat(path).st_mode)
    except FileNotFoundError:
        raise InputError(f"{label} does not exist; check the path") from None
    except OSError as e:
        raise InputError(f"{label} could not be read ({reason(e)}); check the file") from None
    if kind:
        raise InputError(f"{label} is a {kind}, not a regular file; pass a file")


def read_file(path, label):
    """The bytes of a regular file. Anything else (a directory, FIFO, device) is refused before a
    byte is read: a FIFO would block and /dev/zero would never end. Opened non-blocking and checked
    on the open descriptor, so the file cannot be swapped between the check and the read."""
    return media_access.read_regular(path, label)


def _fetch_url(url, label):
    try:
        with urllib.request.urlopen(url, timeout=URL_TIMEOUT_S) as r:
            return r.read()
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise InputError(f"{label} could not be fetched ({reason(e)}); check the URL or pass a local file") from None


def _too_large(label, size=""):
    return InputError(f"{label} is {size}over the {MAX_IMAGE_PIXELS:,} pixels this engine decodes; downscale it first")


def _open(data, label):
    """Encoded bytes → a lazily opened PIL image (header read, pixels not yet decoded), in one of
    IMAGE_FORMATS only."""
    try:
        with warnings.catch_warnings():  # our size limit replaces Pillow's bomb warning
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            return Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except Image.DecompressionBombError:  # above Pillow's own limit (2 x Image.MAX_IMAGE_PIXELS): size unread
        raise _too_large(label) from None
    except UnidentifiedImageError:
        raise InputError(f"{label} is not a {FORMATS_TEXT} image; convert it to PNG or JPEG") from None
    except (OSError, SyntaxError, ValueError, EOFError, struct.error, zlib.error) as e:
        raise InputError(f"{label} is not a readable image ({reason(e)}); pass a valid image file") from None


def _png_exif(data) -> Optional[bytes]:
    """A PNG's eXIf chunk, wherever it lies, found by walking the chunks (nothing decompressed):
    Pillow reads one after the image data only when it decodes."""
    at = 8
    while at + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[at:at + 8])
        if kind == b"eXIf":
            return data[at + 8:at + 8 + length]
        if kind == b"IEND":
            return None
        at += 12 + length
    return None


def _orientation(im, data):
    """The EXIF orientation `decode` will apply (exif_transpose's tag), read from the header."""
    if im.format == "PNG" and "exif" not in im.info:
        chunk = _png_exif(data)
        if chunk is not None:
            im.info["exif"] = b"Exif\x00\x00" + chunk  # as Pillow's PNG reader keeps it
    try:
        exif = Image.Image.getexif(im)  # the base method: PNG's own would decode the image first
        return exif.get(ExifTags.Base.Orientation, 1)  # as exif_transpose takes it: only 2..8 turn the image
    except (OSError, SyntaxError, ValueError, TypeError, EOFError, struct.error):
        return 1  # unreadable metadata: decode's exif_transpose reads it the same way and leaves the image


def image_size(x, label="image"):
    """(width, height) of an image as the model sees it: EXIF orientation applied, as `load_image`
    applies it. Encoded sources (bytes; a path, http(s) URL or data: URL, read as load_image reads
    them) are told from the header alone (nothing is decoded), after the same format check as
    `decode`: what a server budgets, and the pixels coordinates refer to. A PIL image or an array
    is its own size (load_image does not rotate those). Every size coordinates are read against
    comes from here."""
    if isinstance(x, Image.Image):
        return x.width, x.height
    if isinstance(x, np.ndarray):
        return int(x.shape[1]), int(x.shape[0])
    if isinstance(x, (str, Path)):
        x = _bytes_of(str(x), f"{label} {describe(x)}")
    data = bytes(x)
    im = _open(data, label)
    w, h = im.width, im.height
    if im.format == "TIFF":  # Pillow's TIFF reader gives the upright size already (and turns it when loading)
        return w, h
    return (h, w) if _orientation(im, data) in _TRANSPOSED else (w, h)


def decode(data, label):
    """Encoded image bytes → an upright PIL image, fully decoded (bad data fails here, named)."""
    im = _open(data, label)
    if im.width * im.height > MAX_IMAGE_PIXELS:
        raise _too_large(label, f"{im.width}x{im.height} pixels, ")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im.load()
            return ImageOps.exif_transpose(im)
    except Image.DecompressionBombError:
        raise _too_large(label) from None
    except (OSError, SyntaxError, ValueError, EOFError, struct.error, zlib.error) as e:
        raise InputError(f"{label} is not a readable image ({reason(e)}); pass a valid image file") from None


def _sixteen_to_eight(im):
    """16-bit greyscale → 8-bit by the high byte; a grey colour key becomes an alpha band."""
    raw = np.asarray(im)
    grey = Image.fromarray((np.clip(raw, 0, 65535).astype(np.uint32) >> 8).astype(np.uint8))
    key = im.info.get("transparency")
    if isinstance(key, int):
        alpha = Image.fromarray(np.where(raw == key, 0, 255).astype(np.uint8))
        return Image.merge("LA", (grey, alpha))
    return grey


def pil_to_rgb(im):
    """A PIL image → RGB uint8 array: 16-bit reduced, transparency composited onto white."""
    if im.mode in SIXTEEN_BIT_MODES:
        im = _sixteen_to_eight(im)
    if "A" in im.getbands() or im.info.get("transparency") is not None:
        im = im.convert("RGBA")
        white = Image.new("RGBA", im.size, (255, 255, 255, 255))
        im = Image.alpha_composite(white, im)
    return np.asarray(im.convert("RGB"))


def array_to_rgb(a, label):
    """uint8 (or 16-bit: high byte) (H, W), (H, W, 1), (H, W, 3) or (H, W, 4) → RGB uint8."""
    if a.dtype == np.uint16:
        a = (a >> 8).astype(np.uint8)
    if a.dtype != np.uint8:
        raise InputError(f"{label} has dtype {a.dtype}; pass uint8 pixels (H, W, 3) in 0..255")
    if a.ndim == 2:
        a = a[..., None]
    if a.ndim != 3 or a.shape[-1] not in (1, 3, 4):
        raise InputError(f"{label} must be (H, W), (H, W, 1), (H, W, 3) or (H, W, 4); got shape {a.shape}")
    if a.shape[-1] == 1:
        return np.repeat(a, 3, axis=-1)
    if a.shape[-1] == 4:  # transformers' convert_to_rgb for arrays
        alpha = a[..., 3:4] / 255
        return np.round(alpha * a[..., :3] + (1 - alpha) * 255).astype(np.uint8)
    return a


def _bytes_of(s, label):
    """The encoded bytes behind a path, http(s) URL or data: URL."""
    if s.startswith(("http://", "https://")):
        return _fetch_url(s, label)
    if s.startswith("data:"):
        return media_access.decode_data_url(s, label)
    return read_file(s, label)


def load_image(x, label="image"):
    """Any supported image input → RGB uint8 array (H, W, 3)."""
    named = f"{label} {describe(x)}"
    if isinstance(x, (str, Path)):
        rgb = pil_to_rgb(decode(_bytes_of(str(x), named), named))
    elif isinstance(x, (bytes, bytearray, memoryview)):
        rgb = pil_to_rgb(decode(bytes(x), named))
    elif isinstance(x, Image.Image):
        if x.width == 0 or x.height == 0:
            raise InputError(f"{label} has zero size ({x.width}x{x.height}); pass a non-empty image")
        try:
            rgb = pil_to_rgb(x)
        except (OSError, ValueError) as e:
            raise InputError(f"{named} could not be converted to RGB ({reason(e)}); pass a valid image") from None
    elif isinstance(x, np.ndarray):
        rgb = array_to_rgb(x, named)
    else:
        raise InputError(
            f"{named} is not a supported image; pass a path, URL, data: URL, bytes, PIL.Image or uint8 array"
        )
    if rgb.shape[0] == 0 or rgb.shape[1] == 0:
        raise InputError(f"{label} has zero size ({rgb.shape[1]}x{rgb.shape[0]}); pass a non-empty image")
    return rgb
