"""Image and video URLs of a request → bytes or a local file, under the server's media policy.

The processor itself would open any path or URL it is given; the server resolves every URL here
first, so a request can only reach what the operator allowed: data URLs always (with or without a
subtype: UI-Venus's framework sends `data:image;base64,...`), http(s) URLs unless turned off, and
file:// URLs or plain paths only under --allowed-local-media-path.

http(s) fetches are our own small client (http.client), not urllib's opener, because every hop
must be checked where it lands: the host is resolved once, each address is checked against the
policy (no loopback, private, link-local, multicast or reserved address, in any spelling, unless
--allow-media-host opens it), the connection is made to the checked address (a second DNS answer
cannot move it), redirects are followed here and checked the same way, and one deadline covers the
whole fetch (DNS, connect, TLS, every byte), enforced by closing the socket when it passes.

All of one request's media share one budget (media_access.MediaBudget: total bytes and one
deadline for the request): pass the request's `policy.budget()` to each call.
Local files and data URLs are read by media_access (race-free opens, one decoder).
"""

import concurrent.futures
import http.client
import ipaddress
import os
import re
import socket
import ssl
import tempfile
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import List, Optional

from .. import media_access
from ..media_access import MediaBudget, MediaError
from .protocol import APIError

MAX_REDIRECTS = 5
VIDEO_PREFIX = "mlx_qwen3vl_video_"  # the temp files videos are written to
_TEMP_PATH = re.compile(r"'?" + re.escape(tempfile.gettempdir().rstrip(os.sep) + os.sep + VIDEO_PREFIX) + r"[\w.-]*'?")
REDIRECTS = (301, 302, 303, 307, 308)


@dataclass
class MediaPolicy:
    allow_http: bool = True
    http_timeout_s: float = 10.0  # the whole fetch of one URL, redirects included
    max_media_bytes: int = 64 << 20
    allowed_local_paths: List[str] = field(default_factory=list)  # resolved directories
    allowed_hosts: List[str] = field(default_factory=list)  # host names, addresses or CIDRs opened to http media
    max_fetches: int = 8  # http(s) fetches in flight at once; more are answered 503
    max_request_media_bytes: int = media_access.DEFAULT_MAX_REQUEST_MEDIA_BYTES  # all of a request's media
    request_media_timeout_s: float = media_access.DEFAULT_REQUEST_MEDIA_TIMEOUT_S  # all of a request's media

    def __post_init__(self):
        self.allowed_local_paths = media_access.allowed_folders(self.allowed_local_paths)
        self.host_names, self.networks = set(), []
        for entry in self.allowed_hosts:
            try:
                self.networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
            except ValueError:
                self.host_names.add(entry.lower().rstrip("."))
        self._fetches = threading.BoundedSemaphore(max(1, self.max_fetches))

    def budget(self) -> MediaBudget:
        """A new request's media budget (its deadline starts now)."""
        return MediaBudget(max_bytes=self.max_request_media_bytes, timeout_s=self.request_media_timeout_s)

    def address_allowed(self, host: str, address: str) -> bool:
        """Whether http media may be fetched from `address` (what `host` resolved to)."""
        ip = ipaddress.ip_address(address.split("%")[0])
        if host.lower().rstrip(".") in self.host_names or any(_contains(n, ip) for n in self.networks):
            return True
        return all(_public(a) for a in _embedded(ip))


_HOST_NAME = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*\.?$")


def check_allowed_hosts(entries):
    """The first --allow-media-host value that is not a host name, an address or a CIDR, else None."""
    for entry in entries:
        try:
            ipaddress.ip_network(entry.strip("[]"), strict=False)
        except ValueError:
            if not _HOST_NAME.match(entry):
                return entry
    return None


def _contains(network, ip):
    if ip in network:
        return True
    mapped = getattr(ip, "ipv4_mapped", None)
    return mapped is not None and mapped in network


def _embedded(ip):
    """The address and every IPv4 address an IPv6 form carries (mapped, 6to4, Teredo, NAT64)."""
    out = [ip]
    if ip.version == 6:
        if ip.ipv4_mapped:
            out.append(ip.ipv4_mapped)
        if ip.sixtofour:
            out.append(ip.sixtofour)
        if ip.teredo:
            out.extend(ip.teredo)
        if ip in ipaddress.ip_network("64:ff9b::/96"):
            out.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    return out


def _public(ip):
    return ip.is_global and not ip.is_multicast and not ip.is_reserved


def _bad(message, param):
    return APIError(400, message, param=param, code="invalid_media")


def hide_temp_paths(message: str) -> str:
    """A message without the server's temp file names (an uploaded video is named by its label)."""
    return _TEMP_PATH.sub("(uploaded)", message)


def api_error(e: MediaError) -> APIError:
    """A media_access refusal as the API's error."""
    return APIError(e.status, str(e), param=e.param, code=e.code, headers=e.headers or None,
                    type="request_too_large" if e.status == 413 else None)


def decode_data_url(url: str, param: str, policy: Optional[MediaPolicy] = None,
                    budget: Optional[MediaBudget] = None) -> bytes:
    try:
        return media_access.decode_data_url(url, param, max_bytes=policy.max_media_bytes if policy else None,
                                            budget=budget, base64_only=True)
    except MediaError as e:
        raise api_error(e) from None


# ------------------------------------------------------------------------------ http(s)

_resolver = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="mlx_qwen3vl-dns")


class _Fetch:
    """One URL's fetch: its deadline, and the socket the deadline closes."""

    def __init__(self, policy: MediaPolicy, param: str, budget: MediaBudget):
        self.policy, self.param, self.budget = policy, param, budget
        self.deadline = min(time.monotonic() + policy.http_timeout_s, budget.deadline)
        self.sock = None  # a duplicate of the connection's socket: still valid once TLS wraps the original
        self.expired = False
        self.lock = threading.Lock()

    def left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise self.timeout()
        return left

    def timeout(self):
        if self.budget.deadline <= self.deadline:
            return api_error(self.budget.timeout(self.param))
        return _bad(f"{self.param} was not fetched within {self.policy.http_timeout_s:g} s (the server's "
                    "--media-timeout for a whole fetch); send the image as a data URL", self.param)

    def expire(self):
        """At the deadline (a timer thread): end whatever the socket is doing."""
        with self.lock:
            self.expired = True
            if self.sock is not None:
                try:
                    self.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def address(self, host: str, port: int) -> str:
        """`host` resolved once, within the deadline; the first answer the policy allows, else 400."""
        future = _resolver.submit(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM)
        try:
            infos = future.result(timeout=self.left())
        except concurrent.futures.TimeoutError:
            raise self.timeout() from None
        except (OSError, UnicodeError) as e:
            raise _bad(f"{self.param}: the host {host!r} could not be resolved ({_reason(e)})", self.param) from None
        addresses = [info[4][0] for info in infos]
        allowed = [a for a in addresses if self.policy.address_allowed(host, a)]
        if not allowed:
            raise APIError(403, f"{self.param}: {host!r} is a loopback, private, link-local, multicast or reserved "
                           f"address ({addresses[0]}); this server fetches media only from public hosts unless "
                           "started with --allow-media-host", param=self.param, code="media_host_forbidden",
                           type="permission_error")
        return allowed[0]

    def connect(self, address, port, timeout):
        sock = socket.create_connection((address, port), timeout=timeout)
        with self.lock:
            if self.expired:
                sock.close()
                raise self.timeout()
            self.sock = sock.dup()
        return sock

    def release(self):
        with self.lock:
            if self.sock is not None:
                self.sock.close()
                self.sock = None

    def get(self, url: str) -> bytes:
        for _ in range(MAX_REDIRECTS + 1):
            parts = urllib.parse.urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise _bad(f"{self.param}: {url[:100]!r} is not an http(s) URL", self.param)
            if parts.username is not None or parts.password is not None:
                raise _bad(f"{self.param}: URLs with a user name or password are not fetched", self.param)
            try:
                port = parts.port or (443 if parts.scheme == "https" else 80)
            except ValueError:
                raise _bad(f"{self.param}: {url[:100]!r} has an invalid port", self.param) from None
            host = parts.hostname
            address = self.address(host, port)
            kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
            extra = {"context": ssl.create_default_context()} if parts.scheme == "https" else {}
            conn = kind(host, port, timeout=self.left(), **extra)
            conn._create_connection = lambda addr, timeout, source=None: self.connect(address, port, timeout)
            try:
                path = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
                conn.request("GET", path, headers={"User-Agent": "mlx-qwen3vl", "Accept": "*/*",
                                                   "Accept-Encoding": "identity"})
                r = conn.getresponse()
                if r.status in REDIRECTS and r.getheader("Location"):
                    url = urllib.parse.urljoin(url, r.getheader("Location"))
                    continue
                if r.status != 200:
                    raise _bad(f"{self.param} could not be fetched (HTTP {r.status} {r.reason}); check the URL or "
                               "send a data URL", self.param)
                return self.body(r)
            finally:
                conn.close()
                self.release()
        raise _bad(f"{self.param} redirects more than {MAX_REDIRECTS} times", self.param)

    def body(self, r) -> bytes:
        cap = self.policy.max_media_bytes
        length = r.getheader("Content-Length")
        if length and length.isdigit():
            if int(length) > cap:
                raise self.too_large()
            self.take(int(length))  # the request's total, before a byte of the body is read
            counted = int(length)
        else:
            counted = 0
        chunks, n = [], 0
        while True:
            chunk = r.read(1 << 20)
            if self.expired:  # the deadline's shutdown ends a read as if the body had ended
                raise self.timeout()
            if not chunk:
                return b"".join(chunks)
            n += len(chunk)
            if n > cap:
                raise self.too_large()
            if n > counted:
                self.take(n - counted)
                counted = n
            chunks.append(chunk)

    def take(self, n):
        try:
            self.budget.take_bytes(n, self.param)
        except MediaError as e:
            raise api_error(e) from None

    def too_large(self):
        return APIError(413, f"{self.param} is larger than the server's media limit of {self.policy.max_media_bytes} "
                        "bytes", param=self.param, code="media_too_large", type="request_too_large")


def _reason(e):
    return " ".join(str(getattr(e, "reason", None) or e).split())[:200] or type(e).__name__


def fetch_http(url: str, policy: MediaPolicy, param: str, budget: Optional[MediaBudget] = None) -> bytes:
    """The body of an http(s) URL, under the policy and the request's budget (one of its own when
    none is given)."""
    budget = budget or policy.budget()
    if not policy.allow_http:
        raise _bad(f"{param}: this server does not fetch http(s) URLs; send the image as a data URL", param)
    if not policy._fetches.acquire(blocking=False):
        raise APIError(503, f"{param}: the server is fetching {policy.max_fetches} URLs already; retry shortly or "
                       "send a data URL", param=param, code="fetches_busy", headers={"Retry-After": "1"})
    try:
        fetch = _Fetch(policy, param, budget)
        budget.left(param)
    except MediaError as e:
        policy._fetches.release()
        raise api_error(e) from None
    timer = threading.Timer(max(0.0, fetch.deadline - time.monotonic()), fetch.expire)
    timer.daemon = True
    timer.start()
    try:
        return fetch.get(url)
    except APIError:
        raise
    except (OSError, http.client.HTTPException, ValueError) as e:
        if fetch.expired or isinstance(e, TimeoutError) or time.monotonic() >= fetch.deadline:
            raise fetch.timeout() from None
        raise _bad(f"{param} could not be fetched ({_reason(e)}); check the URL or send a data URL", param) from None
    finally:
        timer.cancel()
        policy._fetches.release()


# ------------------------------------------------------------------------------ local files


def read_local(url: str, policy: MediaPolicy, param: str, budget: Optional[MediaBudget] = None) -> bytes:
    """A file (a path or file:// URL) under --allowed-local-media-path, opened race-free."""
    try:
        return media_access.read_allowed(url, policy.allowed_local_paths, param, max_bytes=policy.max_media_bytes,
                                         budget=budget)
    except MediaError as e:
        raise api_error(e) from None


def resolve_image(url, policy: MediaPolicy, param: str, budget: Optional[MediaBudget] = None) -> bytes:
    """→ the image's bytes (the processor decodes them exactly as it decodes a file), counted in
    the request's `budget` (a fresh one when none is given)."""
    if not isinstance(url, str) or not url:
        raise _bad(f"{param} must be a non-empty string URL", param)
    budget = budget or policy.budget()
    if url.startswith("data:"):
        return decode_data_url(url, param, policy, budget)
    if url.startswith(("http://", "https://")):
        return fetch_http(url, policy, param, budget)
    return read_local(url, policy, param, budget)


def resolve_video(url, policy: MediaPolicy, param: str, temp_files: list, budget: Optional[MediaBudget] = None):
    """→ a local video file path (PyAV reads files): every video, local ones included (read
    race-free from the allowed folder), is written to a temp file that the caller deletes (listed
    in temp_files), so what PyAV opens is what was checked."""
    data = resolve_image(url, policy, param, budget)
    fd, path = tempfile.mkstemp(prefix=VIDEO_PREFIX)
    temp_files.append(path)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path
