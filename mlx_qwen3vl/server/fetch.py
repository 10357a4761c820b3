"""Image and video URLs of a request → bytes or a local file, under the server's media policy.

The processor itself would open any path or URL it is given; the server resolves every URL here
first, so a request can only reach what the operator allowed: data URLs always (with or without a
subtype: UI-Venus's framework sends `data:image;base64,...`), http(s) URLs within a timeout and a
size cap unless turned off, and file:// URLs or plain paths only under --allowed-local-media-path.
"""

import base64
import binascii
import os
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import List

from .protocol import APIError


@dataclass
class MediaPolicy:
    allow_http: bool = True
    http_timeout_s: float = 10.0
    max_media_bytes: int = 64 << 20
    allowed_local_paths: List[str] = field(default_factory=list)  # resolved directories

    def __post_init__(self):
        self.allowed_local_paths = [os.path.realpath(p) for p in self.allowed_local_paths]


def _bad(message, param):
    return APIError(400, message, param=param, code="invalid_media")


def decode_data_url(url: str, param: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep:
        raise _bad(f"{param} is a data URL without a ',' before its payload; send data:image/png;base64,<data>", param)
    if not header.endswith(";base64"):
        raise _bad(f"{param} is a data URL that is not base64; send data:image/...;base64,<data>", param)
    try:
        data = base64.b64decode(payload.strip(), validate=False)
    except (binascii.Error, ValueError) as e:
        raise _bad(f"{param} has invalid base64 data ({e}); encode the file with base64", param) from None
    if not data:
        raise _bad(f"{param} is an empty data URL; send the image's bytes", param)
    return data


def fetch_http(url: str, policy: MediaPolicy, param: str) -> bytes:
    if not policy.allow_http:
        raise _bad(f"{param}: this server does not fetch http(s) URLs; send the image as a data URL", param)
    try:
        with urllib.request.urlopen(url, timeout=policy.http_timeout_s) as r:
            data = r.read(policy.max_media_bytes + 1)
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = " ".join(str(getattr(e, "reason", e)).split())[:200]
        raise _bad(f"{param} could not be fetched ({reason}); check the URL or send a data URL", param) from None
    if len(data) > policy.max_media_bytes:
        raise APIError(413, f"{param} is larger than the server's media limit of {policy.max_media_bytes} bytes",
                       param=param, code="media_too_large", type="request_too_large")
    return data


def local_path(url: str, policy: MediaPolicy, param: str) -> str:
    path = urllib.parse.unquote(urllib.parse.urlparse(url).path) if url.startswith("file://") else url
    real = os.path.realpath(path)
    if not any(real == d or real.startswith(d + os.sep) for d in policy.allowed_local_paths):
        raise _bad(f"{param}: local files are only served from --allowed-local-media-path directories", param)
    if not os.path.isfile(real):
        raise _bad(f"{param}: {path!r} is not an existing file", param)
    return real


def resolve_image(url, policy: MediaPolicy, param: str):
    """→ the image's bytes (the processor decodes them exactly as it decodes a file)."""
    if not isinstance(url, str) or not url:
        raise _bad(f"{param} must be a non-empty string URL", param)
    if url.startswith("data:"):
        return decode_data_url(url, param)
    if url.startswith(("http://", "https://")):
        return fetch_http(url, policy, param)
    path = local_path(url, policy, param)
    with open(path, "rb") as f:
        return f.read()


def resolve_video(url, policy: MediaPolicy, param: str, temp_files: list):
    """→ a local video file path (PyAV reads files); fetched or inlined videos go to a temp file
    that the caller deletes (listed in temp_files)."""
    if not isinstance(url, str) or not url:
        raise _bad(f"{param} must be a non-empty string URL", param)
    if url.startswith("data:"):
        data = decode_data_url(url, param)
    elif url.startswith(("http://", "https://")):
        data = fetch_http(url, policy, param)
    else:
        return local_path(url, policy, param)
    fd, path = tempfile.mkstemp(prefix="mlx_qwen3vl_video_")
    temp_files.append(path)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path
