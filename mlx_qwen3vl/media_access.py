"""Media named from outside (a request, a tool call) → bytes, under an allow-list and one budget.

Three pieces, shared by the HTTP server, the MCP server and the library's loaders:

- `read_allowed(path, folders, label, ...)`: a local file under one of the allowed folders, opened
  race-free. The folder is opened once, then every component below it is opened relative to the
  previous descriptor with O_NOFOLLOW | O_NONBLOCK (O_DIRECTORY for the folders on the way), and
  the last descriptor is checked with fstat (a regular file, within the size cap) and read from.
  Nothing is ever opened by name after a check, so swapping a link, a FIFO or a directory in at any
  moment makes the open fail; it never reaches a file outside the folder nor blocks.
- `decode_data_url(url, label, ...)` and `decode_base64(text, label, ...)`: the one decoder of
  data: URLs (`data:image/png;base64,...`, `data:image;base64,...` with no subtype, as agents send
  them, and percent-encoded ones) and of bare base64 (MCP image content).
- `MediaBudget`: what all of one request's media may cost together: bytes read or fetched,
  pixels, video frames, and one deadline for the whole request. Every reader here (and the
  server's http fetch) takes from it as bytes arrive and stops at the first byte over.

Errors are `MediaError` (an InputError: one line, naming the caller's label, never a server path),
carrying the HTTP status and code the server answers with.
"""

import base64
import binascii
import ctypes
import ctypes.util
import errno
import os
import stat
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Optional, Sequence

from .errors import InputError

# Defaults of a request's totals (the server's flags; docs/server.md lists them).
DEFAULT_MAX_REQUEST_MEDIA_BYTES = 128 << 20  # all of one request's fetched, read and decoded media
DEFAULT_REQUEST_MEDIA_TIMEOUT_S = 30.0  # every fetch and read of one request together

_CHUNK = 1 << 20
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
_STEP_FLAGS = (os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
               | getattr(os, "O_CLOEXEC", 0))


class MediaError(InputError):
    """A medium refused: one line for the user, and how an HTTP server answers it."""

    def __init__(self, message, *, status=400, code="invalid_media", param=None, headers=None):
        super().__init__(message)
        self.status, self.code, self.param, self.headers = status, code, param, headers or {}


def _bad(label, message, **kw):
    return MediaError(message, param=label, **kw)


# ---------------------------------------------------------------------------------------------
# The per-request budget
# ---------------------------------------------------------------------------------------------
@dataclass
class MediaBudget:
    """One request's media bytes and its single deadline, shared by all its URLs, files and data
    URLs (thread-safe: they may be read in parallel). Create one per request; call `take_bytes`
    as bytes arrive (before keeping them) and `left()` for the time a blocking step may still take.
    The request's pixels and frames are totalled from the headers by server/limits.check_media."""

    max_bytes: int = DEFAULT_MAX_REQUEST_MEDIA_BYTES
    timeout_s: float = DEFAULT_REQUEST_MEDIA_TIMEOUT_S
    bytes_flag: str = "--max-request-media-bytes"  # named in the refusals
    timeout_flag: str = "--request-media-timeout"
    bytes: int = field(default=0, init=False)

    def __post_init__(self):
        self.deadline = time.monotonic() + self.timeout_s
        self._lock = threading.Lock()

    def left(self, label="media") -> float:
        """Seconds left before the request's deadline; MediaError (timeout) once it passed."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise self.timeout(label)
        return left

    def timeout(self, label):
        return _bad(label, f"{label}: the request's media were not read within {self.timeout_s:g} s "
                    f"({self.timeout_flag}, for all of a request's media together); send fewer or smaller media, "
                    "or data URLs", code="media_timeout")

    def bytes_left(self) -> int:
        return max(0, self.max_bytes - self.bytes)

    def take_bytes(self, n: int, label="media"):
        """Count `n` more bytes; MediaError (413) past the total, before they are kept."""
        self.left(label)
        with self._lock:
            if self.bytes + n > self.max_bytes:
                self.bytes = self.max_bytes + 1  # spent: later media of this request are refused at once
                raise _bad(label, f"{label}: the request's media come to more than {self.max_bytes} bytes "
                           f"({self.bytes_flag}); send fewer or smaller media", status=413, code="media_too_large")
            self.bytes += n


def _too_large(label, max_bytes, flag):
    return _bad(label, f"{label} is larger than the limit of {max_bytes} bytes for one medium ({flag}); send a "
                "smaller one", status=413, code="media_too_large")


# ---------------------------------------------------------------------------------------------
# data: URLs and base64
# ---------------------------------------------------------------------------------------------
def decode_base64(text: str, label: str, *, max_bytes: Optional[int] = None, budget: Optional[MediaBudget] = None,
                  flag: str = "--max-media-bytes") -> bytes:
    """Base64 text (line breaks and spaces allowed) → bytes. Its decoded size is checked against
    `max_bytes` and the budget from its length, before anything is decoded."""
    if not isinstance(text, str):
        raise _bad(label, f"{label} must be base64 text")
    estimate = len(text) * 3 // 4
    if max_bytes is not None and estimate > max_bytes + 3072:  # room for line breaks
        raise _too_large(label, max_bytes, flag)
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        try:  # only now pay for a copy without whitespace
            data = base64.b64decode("".join(text.split()), validate=True)
        except (binascii.Error, ValueError) as e:
            raise _bad(label, f"{label} is not valid base64 ({_reason(e)}); encode the file with base64") from None
    return _decoded(data, label, max_bytes, budget, flag)


def _decoded(data: bytes, label: str, max_bytes: Optional[int], budget: Optional[MediaBudget], flag: str) -> bytes:
    """Decoded bytes held to the limits: not empty, at most `max_bytes`, taken from `budget`."""
    if not data:
        raise _bad(label, f"{label} is empty; send the image's bytes")
    if max_bytes is not None and len(data) > max_bytes:
        raise _too_large(label, max_bytes, flag)
    if budget is not None:
        budget.take_bytes(len(data), label)
    return data


def decode_data_url(url: str, label: str, *, max_bytes: Optional[int] = None, budget: Optional[MediaBudget] = None,
                    flag: str = "--max-media-bytes", base64_only: bool = False) -> bytes:
    """data:[<type>][;base64],<data> → bytes. The type is not needed (`data:image;base64,` is what
    UI-Venus's framework sends); without ;base64 the payload is percent-encoded (the servers pass
    base64_only: an image in a request is always base64)."""
    header, comma, payload = url.partition(",")
    if not comma or not header.startswith("data:"):
        raise _bad(label, f"{label} is not a valid data: URL (no comma before its payload); send "
                   "data:image/png;base64,<data>")
    if header.endswith(";base64"):
        return decode_base64(payload, label, max_bytes=max_bytes, budget=budget, flag=flag)
    if base64_only:
        raise _bad(label, f"{label} is a data URL that is not base64; send data:image/...;base64,<data>")
    if max_bytes is not None and len(payload) > 3 * max_bytes + 3:
        raise _too_large(label, max_bytes, flag)
    return _decoded(urllib.parse.unquote_to_bytes(payload), label, max_bytes, budget, flag)


# ---------------------------------------------------------------------------------------------
# Local files under allowed folders
# ---------------------------------------------------------------------------------------------
def allowed_folders(folders: Sequence[str]) -> list:
    """The operator's folders as resolved absolute paths (what `read_allowed` walks from)."""
    return [os.path.realpath(os.path.expanduser(str(d))) for d in folders]


def local_path_of(url: str) -> str:
    """A file:// URL's path (percent-decoded), or the string itself."""
    if url.startswith("file://"):
        return urllib.parse.unquote(urllib.parse.urlsplit(url).path)
    return url


def _kind(mode):
    if stat.S_ISREG(mode):
        return None
    kinds = {stat.S_ISDIR: "directory", stat.S_ISFIFO: "FIFO (named pipe)", stat.S_ISCHR: "character device",
             stat.S_ISBLK: "block device", stat.S_ISSOCK: "socket", stat.S_ISLNK: "symbolic link"}
    return next((name for test, name in kinds.items() if test(mode)), "special file")


def _where(path: str, folders: Sequence[str]):
    """(folder, components below it) for the first allowed folder holding `path` once links are
    resolved, else None. The components are then opened one by one without following links: a
    link swapped in after this resolution makes that open fail instead of leading outside."""
    try:
        real = os.path.realpath(path)
    except OSError:  # a link there changed while it was resolved (readlink of what is no longer a link)
        return None
    for folder in folders:
        if real == folder:
            return folder, []
        if real.startswith(folder.rstrip(os.sep) + os.sep):
            return folder, [c for c in real[len(folder.rstrip(os.sep)) + 1:].split(os.sep) if c]
    return None


def open_allowed(path: str, folders: Sequence[str], label: str, *, flag: str = "--allowed-local-media-path") -> int:
    """A descriptor of the regular file `path` (a path or file:// URL) under one of `folders`
    (from `allowed_folders`), opened race-free as the module says. The caller closes it."""
    if not folders:
        raise _bad(label, f"{label}: local files are off on this server (start it with {flag} DIR); send the "
                   "image as a data URL instead", code="local_media_forbidden")
    path = local_path_of(path)
    if not path or "\0" in path:
        raise _bad(label, f"{label} is not a valid path")
    found = _where(path, folders)
    if found is None:
        raise _bad(label, f"{label}: local files are only read from the server's {flag} folders",
                   code="local_media_forbidden")
    folder, parts = found
    try:
        fd = os.open(folder, _DIR_FLAGS)
    except OSError:
        raise _bad(label, f"{label}: the server's {flag} folder cannot be opened") from None
    try:
        for i, name in enumerate(parts):
            last = i == len(parts) - 1
            nfd = os.open(name, _STEP_FLAGS | (0 if last else getattr(os, "O_DIRECTORY", 0)), dir_fd=fd)
            os.close(fd)
            fd = nfd
        kind = _kind(os.fstat(fd).st_mode)
    except OSError as e:
        os.close(fd)
        raise _open_error(label, e, flag) from None
    if kind:
        os.close(fd)
        raise _bad(label, f"{label} is a {kind}, not a regular file; pass an image file")
    return fd


def _open_error(label, e, flag):
    if e.errno == errno.ENOENT:
        return _bad(label, f"{label} does not exist; check the path")
    if e.errno in (errno.ELOOP, errno.ENOTDIR, getattr(errno, "EMLINK", -1)):  # a link (or a file) met on the way
        return _bad(label, f"{label} leads through a link or a non-folder; local files are only read from the "
                    f"server's {flag} folders, without links", code="local_media_forbidden")
    return _bad(label, f"{label} could not be opened ({os.strerror(e.errno) if e.errno else _reason(e)})")


def read_fd(fd: int, label: str, *, max_bytes: Optional[int] = None, budget: Optional[MediaBudget] = None,
            flag: str = "--max-media-bytes") -> bytes:
    """The bytes of an open regular file (closed afterwards), held to its own cap and the
    request's budget by its size before a byte is read, then as it is read (it may grow)."""
    try:
        size = os.fstat(fd).st_size
        if max_bytes is not None and size > max_bytes:
            raise _too_large(label, max_bytes, flag)
        if budget is not None:
            budget.take_bytes(size, label)
        chunks, n = [], 0
        while True:
            if budget is not None:
                budget.left(label)
            chunk = os.read(fd, _CHUNK)
            if not chunk:
                return b"".join(chunks)
            n += len(chunk)
            if max_bytes is not None and n > max_bytes:
                raise _too_large(label, max_bytes, flag)
            if budget is not None and n > size:  # grown since fstat: count what is past it
                budget.take_bytes(min(len(chunk), n - size), label)
            chunks.append(chunk)
    except OSError as e:
        raise _bad(label, f"{label} could not be read ({_reason(e)})") from None
    finally:
        os.close(fd)


def read_allowed(path: str, folders: Sequence[str], label: str, *, max_bytes: Optional[int] = None,
                 budget: Optional[MediaBudget] = None, flag: str = "--allowed-local-media-path",
                 bytes_flag: str = "--max-media-bytes") -> bytes:
    """The bytes of the regular file `path` (a path or file:// URL) under one of `folders`, opened
    race-free and read within `max_bytes` and the request's `budget`. MediaError otherwise."""
    fd = open_allowed(path, folders, label, flag=flag)
    return read_fd(fd, label, max_bytes=max_bytes, budget=budget, flag=bytes_flag)


def read_regular(path: str, label: str, *, max_bytes: Optional[int] = None,
                 budget: Optional[MediaBudget] = None) -> bytes:
    """A path the caller may read anywhere (the library's own user): opened once, non-blocking,
    checked to be a regular file on the descriptor, read from it."""
    try:
        fd = os.open(path, _STEP_FLAGS & ~getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise _bad(label, f"{label} is not an existing file, http(s) URL or data: URL; check the path") from None
    except OSError as e:
        raise _bad(label, f"{label} could not be read ({_reason(e)}); check the file") from None
    kind = _kind(os.fstat(fd).st_mode)
    if kind:
        os.close(fd)
        raise _bad(label, f"{label} is a {kind}, not a regular file; pass an image file")
    return read_fd(fd, label, max_bytes=max_bytes, budget=budget)


def _reason(e):
    return " ".join(str(getattr(e, "strerror", None) or e).split())[:200] or type(e).__name__


# ---------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------
_libc = None
if os.name == "posix":
    try:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        _libc.malloc_trim  # glibc only
    except (OSError, AttributeError):
        _libc = None


def release_memory():
    """Give freed heap pages back to the system (glibc): a refused request's media chunks would
    otherwise stay in the process's resident size."""
    if _libc is not None:
        _libc.malloc_trim(0)
