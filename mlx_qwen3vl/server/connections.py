"""The HTTP connections themselves, below the ASGI app: uvicorn's h11 protocol with a cap on open
connections and deadlines for reading a request, and a uvicorn Server that stops on SIGTERM /
SIGINT with status 0 after telling running requests so.

An ASGI middleware never sees a connection that sends nothing, or half a header: those are
handled here, per connection. A connection past --max-connections gets a 503 and is closed at
once (so idle sockets cannot use up the process's file descriptors); a connection's first request
must bring its headers within --header-timeout of connecting (a later request, of its first byte),
a body must arrive within --body-timeout of its headers (else 408 and closed); between requests
uvicorn's own --keep-alive-timeout applies.
"""

import asyncio
import errno
import json
import signal
import socket

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .limits import (DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S, DEFAULT_KEEP_ALIVE_TIMEOUT_S,
                     DEFAULT_MAX_CONNECTIONS)

MAX_HEADER_BYTES = 16 << 10  # h11's own default, stated: a longer header section is a 400
REFUSED_LINGER_S = 1.0
REFUSED_LINGERING = 64


def _raw_response(status: int, reason: str, message: str, code: str, extra=b"") -> bytes:
    body = json.dumps({"error": {"message": message, "type": "server_overloaded" if status == 503 else
                                 "invalid_request_error", "param": None, "code": code}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n").encode() + extra + b"\r\n" + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, plus the connection cap and the read deadlines (class attributes,
    set by `protocol_class`)."""

    max_connections = DEFAULT_MAX_CONNECTIONS
    header_timeout = DEFAULT_HEADER_TIMEOUT_S
    body_timeout = DEFAULT_BODY_TIMEOUT_S
    _lingering = 0  # refused connections not yet closed (per server: protocol_class makes a class each)

    def connection_made(self, transport):
        self._timers = {"header": None, "body": None}
        self._first, self._refused, self._lingers = True, False, False
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self._refuse(transport)
            return
        self._update_timers()

    def _refuse(self, transport):
        """A 503 at once; the connection then reads (and drops) what the client sends until it
        closes, for at most REFUSED_LINGER_S, so that closing never resets the connection before
        the client has read the answer. Past REFUSED_LINGERING such connections, it is dropped."""
        self._refused = True
        cls = type(self)
        if cls._lingering >= REFUSED_LINGERING:
            transport.abort()
            return
        cls._lingering += 1
        self._lingers = True
        transport.write(_raw_response(
            503, "Service Unavailable", f"the server has {self.max_connections} connections open "
            "(--max-connections); retry shortly", "too_many_connections", b"retry-after: 1\r\n"))
        transport.write_eof()
        self._timers["header"] = self.loop.call_later(min(REFUSED_LINGER_S, self.header_timeout), transport.close)

    def data_received(self, data):
        if self._refused:
            return
        super().data_received(data)
        self._update_timers()

    def eof_received(self):
        if self._refused:
            self.transport.close()

    def on_response_complete(self):
        super().on_response_complete()
        self._update_timers()

    def connection_lost(self, exc):
        for kind in self._timers:
            self._cancel(kind)
        if self._lingers:
            self._lingers = False
            type(self)._lingering -= 1
        super().connection_lost(exc)

    # -- deadlines, from h11's view of the request being read
    def _cancel(self, kind):
        if self._timers[kind] is not None:
            self._timers[kind].cancel()
            self._timers[kind] = None

    def _arm(self, kind, seconds):
        if self._timers[kind] is None:
            self._timers[kind] = self.loop.call_later(seconds, self._expired, kind)

    def _update_timers(self):
        if self.transport.is_closing():
            return
        state = self.conn.their_state
        if state is h11.IDLE:
            # Waiting for headers: the first request's from the start, a later one's from its
            # first byte (an idle keep-alive connection is uvicorn's keep-alive timer's).
            if self._first or self.conn.trailing_data[0]:
                self._arm("header", self.header_timeout)
        else:
            self._first = False
            self._cancel("header")
        if state is h11.SEND_BODY:
            self._arm("body", self.body_timeout)
        else:
            self._cancel("body")

    def _expired(self, kind):
        self._timers[kind] = None
        state = self.conn.their_state
        if self.transport.is_closing() or state is not (h11.IDLE if kind == "header" else h11.SEND_BODY):
            self._update_timers()
            return
        if self.cycle is None or self.cycle.response_complete or not self.cycle.response_started:
            seconds = self.header_timeout if kind == "header" else self.body_timeout
            what = "headers" if kind == "header" else "body"
            self.transport.write(_raw_response(
                408, "Request Timeout", f"the request's {what} did not arrive within {seconds:g} s "
                f"(--{kind}-timeout)", "request_timeout"))
        self.transport.close()


def protocol_class(max_connections, header_timeout, body_timeout):
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {
        "max_connections": max_connections, "header_timeout": header_timeout, "body_timeout": body_timeout})


class Server(uvicorn.Server):
    """uvicorn's Server; on SIGTERM or SIGINT it calls `on_stop` on the event loop first (running
    requests end with an error event), and it does not re-raise the signal once shut down: a
    stop on request exits with status 0. A second SIGINT still forces the exit."""

    def __init__(self, config, on_stop=None):
        super().__init__(config)
        self.on_stop = on_stop
        self._loop = None

    async def serve(self, sockets=None):
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets=None):
        await super().startup(sockets)
        if sockets is not None and not self.should_exit:  # uvicorn names only the addresses it bound itself
            self._log_started_message(sockets)

    def handle_exit(self, sig, frame):
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
            return
        self.should_exit = True
        if self.on_stop is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self.on_stop)


def bind(host, port):
    """(a listening socket on host:port, None), or (None, why not) in one line. The server binds
    before it loads the model, so a busy port is said at once, before "serving ..."."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart reuses TIME_WAIT
        sock.bind((host, port))
        sock.listen(2048)  # uvicorn's default backlog
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            return None, (f"--port {port}: {host}:{port} is already in use (another server?); stop it or "
                          "choose another --port")
        return None, f"--host {host} --port {port}: cannot listen there: {e.strerror or e}"
    sock.set_inheritable(True)
    return sock, None


def serve(app, *, sock, log_level, max_connections=DEFAULT_MAX_CONNECTIONS,
          header_timeout=DEFAULT_HEADER_TIMEOUT_S, body_timeout=DEFAULT_BODY_TIMEOUT_S,
          keep_alive_timeout=DEFAULT_KEEP_ALIVE_TIMEOUT_S, on_stop=None):
    """Serve `app` on `sock` (from bind) until a signal stops it (then return)."""
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on", ws="none",
                            http=protocol_class(max_connections, header_timeout, body_timeout),
                            timeout_keep_alive=keep_alive_timeout, timeout_graceful_shutdown=5,
                            h11_max_incomplete_event_size=MAX_HEADER_BYTES)
    Server(config, on_stop).run(sockets=[sock])


def check_file_limit(max_connections, reserve=256):
    """None if the process may open `max_connections` sockets and `reserve` other files (models,
    media, temp files) at once, raising its soft limit toward the hard one if needed; else why not."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = max_connections + reserve
    if soft != resource.RLIM_INFINITY and soft < need:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard) if hard != resource.RLIM_INFINITY else need,
                                                        hard))
        except (ValueError, OSError):
            pass
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft != resource.RLIM_INFINITY and soft < need:
            return (f"--max-connections {max_connections} needs {need} open files with the {reserve} the server "
                    f"keeps for itself, over this process's limit of {soft}; lower it or raise `ulimit -n`")
    return None
