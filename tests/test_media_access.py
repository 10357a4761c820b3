"""media_access: local files opened race-free under an allowed folder, one data-URL decoder, and one
budget (bytes and a deadline) for all of a request's media. The races are run as an attacker runs
them: a thread swapping a link, a FIFO or a directory in and out thousands of times while reads go
on; a read outside the folder, a hang or an unexpected exception fails the test. Fetches go only to
a 127.0.0.1 helper the test starts."""

import os
import subprocess
import sys
import threading

import pytest

from mlx_qwen3vl import media_access as ma
from mlx_qwen3vl.errors import InputError
from mlx_qwen3vl.server import fetch
from mlx_qwen3vl.server.protocol import APIError

INSIDE, SECRET = b"inside-the-folder", b"SECRET-outside"


@pytest.fixture
def world(tmp_path):
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    (allowed / "d").mkdir(parents=True)
    outside.mkdir()
    (allowed / "d" / "shot.png").write_bytes(INSIDE)
    (outside / "shot.png").write_bytes(SECRET)
    (outside / "secret.png").write_bytes(SECRET)
    return allowed, outside, ma.allowed_folders([allowed])


SWAPS = 2000  # swaps per race, by another process (running at the same time as the reads)
MAX_READS = 12_000
SWAPPER = """
import os, sys
kind, target, other, spare, spare2, n = sys.argv[1:7]
inside = open(sys.argv[7], "rb").read() if len(sys.argv) > 7 else b"inside-the-folder"  # the regular file's bytes

def regular():
    open(spare2, "wb").write(inside)
    os.replace(spare2, target)

for i in range(int(n)):
    try:
        if kind == "link":  # target: a regular file <-> a link to `other` (outside)
            if i % 2:
                os.symlink(other, spare); os.replace(spare, target)
            else:
                regular()
        elif kind == "fifo":  # target: a regular file <-> a FIFO
            if i % 2:
                os.mkfifo(spare); os.replace(spare, target)
            else:
                regular()
        else:  # target: a directory <-> a link to the directory `other` (outside)
            if not i % 2:
                os.rename(target, spare2); os.symlink(other, spare); os.replace(spare, target)
            else:
                os.unlink(target); os.rename(spare2, target)
    except FileNotFoundError:
        pass
    if i == 1:  # both states made once: the race is on
        print("swapping", flush=True)
"""


def race(kind, target, other, read):
    """SWAPS swaps of `target` by another process while this one calls read() (in a worker
    thread, as the server's pool does) → the outcomes; a read still running 120 s later (an open
    blocking on a FIFO) fails the test, and so does any exception other than a MediaError."""
    outcomes = {"inside": 0, "outside": 0, "refused": 0}
    errors = []
    folder = os.path.dirname(target)
    swapper = subprocess.Popen([sys.executable, "-c", SWAPPER, kind, target, str(other),
                                os.path.join(folder, ".spare"), os.path.join(folder, ".spare2"), str(SWAPS)],
                               stdout=subprocess.DEVNULL)

    def reader():
        for _ in range(MAX_READS):
            if swapper.poll() is not None:
                return
            try:
                data = read()
            except ma.MediaError:
                outcomes["refused"] += 1
                continue
            except Exception as e:  # noqa: BLE001 — anything else would be a 500
                errors.append(repr(e))
                continue
            outcomes["inside" if data == INSIDE else "outside"] += 1

    worker = threading.Thread(target=reader, daemon=True)
    worker.start()
    worker.join(120)
    hung = worker.is_alive()
    try:
        swapper.wait(30)
    finally:
        swapper.kill()
    print(f"{kind}: {SWAPS} swaps, {sum(outcomes.values())} reads: {outcomes}")
    assert not hung, f"a read blocked ({outcomes})"
    assert swapper.returncode == 0
    assert not errors, errors[:3]
    assert outcomes["outside"] == 0, outcomes
    assert outcomes["inside"] > 0 and outcomes["refused"] > 0, outcomes  # both states were met: the race ran
    return outcomes


def test_a_link_swapped_in_is_never_followed_out_of_the_folder(world):
    allowed, outside, folders = world
    target = str(allowed / "shot.png")
    race("link", target, outside / "secret.png", lambda: ma.read_allowed(target, folders, "image"))


def test_a_fifo_swapped_in_is_refused_without_blocking(world):
    allowed, _, folders = world
    target = str(allowed / "shot.png")
    race("fifo", target, "-", lambda: ma.read_allowed(target, folders, "image"))


def test_a_directory_on_the_way_swapped_for_a_link_is_never_followed(world):
    allowed, outside, folders = world
    path = str(allowed / "d" / "shot.png")  # outside/shot.png is the secret one
    race("dir", str(allowed / "d"), outside, lambda: ma.read_allowed(path, folders, "image"))


def test_what_is_refused_and_how(world):
    allowed, outside, folders = world
    (allowed / "link.png").symlink_to(outside / "secret.png")
    (allowed / "via").symlink_to(outside)
    os.mkfifo(allowed / "pipe.png")
    read = lambda p, **kw: ma.read_allowed(str(p), folders, "image", **kw)  # noqa: E731
    assert read(allowed / "d" / "shot.png") == INSIDE
    assert read((allowed / "d" / "shot.png").as_uri()) == INSIDE
    for path, says in [(allowed / "link.png", "--allowed-local-media-path"),
                       (allowed / "via" / "secret.png", "--allowed-local-media-path"),
                       (allowed / "d" / ".." / ".." / "outside" / "secret.png", "--allowed-local-media-path"),
                       (outside / "secret.png", "--allowed-local-media-path"),
                       (allowed / "pipe.png", "FIFO (named pipe), not a regular file"),
                       (allowed / "d", "directory, not a regular file"),
                       (allowed / "nope.png", "does not exist")]:
        with pytest.raises(ma.MediaError) as e:
            read(path)
        assert says in str(e.value) and str(outside) not in str(e.value) and str(allowed) not in str(e.value), e.value
        assert e.value.status == 400
    with pytest.raises(ma.MediaError, match="local files are off"):
        ma.read_allowed(str(allowed / "d" / "shot.png"), [], "image")
    with pytest.raises(ma.MediaError) as e:
        read(allowed / "d" / "shot.png", max_bytes=5)
    assert e.value.status == 413 and "--max-media-bytes" in str(e.value)
    assert isinstance(e.value, InputError)  # the library's one-line error


def test_one_decoder_for_data_urls_and_base64():
    assert ma.decode_data_url("data:image;base64,aGVsbG8=", "u") == b"hello"  # no subtype, as agents send
    assert ma.decode_data_url("data:image/png;base64,aGVs\nbG8=", "u") == b"hello"  # line breaks
    assert ma.decode_data_url("data:,hi%20x", "u") == b"hi x"
    for url, says in [("data:image/png;base64", "no comma"), ("data:image/png;base64,!!!", "not valid base64"),
                      ("data:image/png;base64,", "empty")]:
        with pytest.raises(ma.MediaError, match=says):
            ma.decode_data_url(url, "u")
    with pytest.raises(ma.MediaError, match="not base64"):
        ma.decode_data_url("data:,hi", "u", base64_only=True)
    with pytest.raises(ma.MediaError) as e:  # refused from its length, before decoding
        ma.decode_data_url("data:image/png;base64," + "A" * 400_000, "u", max_bytes=1000)
    assert e.value.status == 413
    budget = ma.MediaBudget(max_bytes=8)
    assert ma.decode_base64("aGVsbG8=", "a", budget=budget) == b"hello" and budget.bytes == 5
    with pytest.raises(ma.MediaError, match="--max-request-media-bytes"):
        ma.decode_base64("aGVsbG8=", "b", budget=budget)


def test_local_files_and_data_urls_share_one_request_budget(world):
    allowed, _, folders = world
    budget = ma.MediaBudget(max_bytes=3 * len(INSIDE))
    for _ in range(3):
        assert ma.read_allowed(str(allowed / "d" / "shot.png"), folders, "image", budget=budget) == INSIDE
    with pytest.raises(ma.MediaError) as e:
        ma.decode_data_url("data:image/png;base64,aGVsbG8=", "the 4th", budget=budget)
    assert e.value.status == 413 and e.value.param == "the 4th"
    with pytest.raises(ma.MediaError):  # spent: refused at once
        ma.read_allowed(str(allowed / "d" / "shot.png"), folders, "image", budget=budget)


# ------------------------------------------------------------------------------ http(s) under one budget


class Bodies:
    """A 127.0.0.1 helper: /big/N answers `size` bytes (in 1 MiB writes, counted as sent); /hang
    answers headers and then nothing until closed."""

    def __init__(self, size):
        from test_server_security import Helper

        self.sent, self.size, self.release = 0, size, threading.Event()

        def big(handler, stop):
            handler.send_response(200)
            handler.send_header("Content-Length", str(self.size))
            handler.end_headers()
            block = bytes(1 << 20)
            for _ in range(self.size >> 20):
                handler.wfile.write(block)
                self.sent += len(block)

        def hang(handler, stop):
            handler.send_response(200)
            handler.send_header("Content-Length", "1000")
            handler.end_headers()
            handler.wfile.flush()
            self.release.wait(30)

        self.helper = Helper("127.0.0.1", {**{f"/big/{i}": big for i in range(64)}, "/hang": hang,
                                           "/hang2": hang, "/hang3": hang})

    def close(self):
        self.release.set()
        self.helper.close()


def test_a_requests_urls_stop_at_its_total_bytes():
    bodies = Bodies(8 << 20)
    policy = fetch.MediaPolicy(allowed_hosts=["127.0.0.1"], max_request_media_bytes=20 << 20)
    budget = policy.budget()
    got = []
    try:
        with pytest.raises(APIError) as e:
            for i in range(24):  # one request naming 24 URLs of 8 MiB each
                got.append(fetch.resolve_image(f"{bodies.helper.base}/big/{i}", policy, f"url {i}", budget))
    finally:
        bodies.close()
    assert e.value.status == 413 and e.value.code == "media_too_large" and e.value.param == "url 2", e.value.body()
    assert "--max-request-media-bytes" in e.value.message
    assert len(got) == 2 and budget.bytes > policy.max_request_media_bytes
    assert len(bodies.helper.hits) == 3  # the third was refused from its Content-Length; none after it was asked


def test_a_requests_urls_share_one_deadline():
    bodies = Bodies(1 << 20)
    policy = fetch.MediaPolicy(allowed_hosts=["127.0.0.1"], http_timeout_s=30, request_media_timeout_s=0.5)
    budget = policy.budget()
    try:
        with pytest.raises(APIError) as e:
            for path in ("/hang", "/hang2", "/hang3"):
                fetch.resolve_image(bodies.helper.base + path, policy, path, budget)
        with pytest.raises(APIError) as late:  # the request's deadline passed: no further fetch starts
            fetch.resolve_image(bodies.helper.base + "/big/0", policy, "later", budget)
    finally:
        bodies.close()
    assert e.value.param == "/hang" and "--request-media-timeout" in e.value.message, e.value.body()
    assert late.value.code == "media_timeout"
    assert bodies.helper.hits == ["/hang"]
