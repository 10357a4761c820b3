"""The prefix cache's second tier: entries in a folder, one cache file each (cache_file.py), so a
restarted server's first turn of a known conversation reuses its history instead of computing it.

An entry file holds the token ids, the media keys (spans.media_keys: kind, span, content hash) and
the KV tensors of one prompt-and-answer, with what identifies the model. At start the folder's
file headers are read into a radix index (caches.PrefixIndex, the in-memory tier's); files of
another model, dtype or KV settings, unreadable ones and anything that is not a regular file
(checked on the descriptor, opened without blocking: a FIFO never hangs the start) are skipped
with one warning line each and left as they are. Entries are written when the engine is idle (`flush`) and read back when a
request's longest reusable prefix is on disk only; the least recently used files go when the
folder is over its budget. Only entries of the tier's own KV settings are kept here.
"""

import os
import sys
import time
from typing import List, Optional

from blake3 import blake3

from .caches import PrefixIndex, index_keys

SUFFIX = ".kv.safetensors"


def _warn(message):
    print(f"[mlx_qwen3vl] warning: {message}", file=sys.stderr, flush=True)


class DiskTier:
    """Entry files under `folder` (created 0700), at most `max_bytes` of them, for caches of KV
    settings `kv` (KVSettings fitted to `model`)."""

    def __init__(self, folder, max_bytes: int, model, kv, warn=_warn):
        from .. import cache_file

        self.folder = cache_file.private_folder(folder)
        self.max_bytes, self.model, self.kv, self.warn = max_bytes, model, kv, warn
        self.indexes = {False: PrefixIndex(), True: PrefixIndex()}  # float entries, quantized ones
        self.files = {}  # name → (keys, bytes, last use, quantized)
        self.pending: List[tuple] = []  # (tokens, media, caches) to write at the next flush
        self.hits = self.writes = self.skipped = 0
        for path in sorted(self.folder.glob("*" + SUFFIX)):
            try:
                what = f"prefix cache file {path.name!r}"
                info, st = cache_file.peek(path, what)
                cache_file.check(info, model, kv, what=what)
                meta = info["meta"]
                keys = index_keys([int(t) for t in meta["tokens"]], [tuple(m) for m in meta["media"]])
            except (cache_file.CacheFileError, KeyError, TypeError, ValueError) as e:
                self.skipped += 1
                self.warn(f"skipped {e}" if isinstance(e, cache_file.CacheFileError)
                          else f"skipped prefix cache file {path.name!r}: it does not hold a prefix entry")
                continue
            self._add(path.name, keys, st.st_size, st.st_mtime, info.get("quantized") is True)
        self._evict()

    @property
    def nbytes(self) -> int:
        return sum(f[1] for f in self.files.values())

    def _add(self, name, keys, size, used, quantized):
        for old in self.indexes[quantized].add(keys, name):  # entries this one extends are redundant
            self._remove(old)
        self.files[name] = (keys, size, used, quantized)

    def _forget(self, name):
        keys, _, _, quantized = self.files.pop(name)
        self.indexes[quantized].remove(keys, name)

    def _remove(self, name):
        self._forget(name)
        (self.folder / name).unlink(missing_ok=True)

    def _evict(self):
        while self.files and self.nbytes > self.max_bytes:
            self._remove(min(self.files, key=lambda n: self.files[n][2]))

    def longest(self, keys: tuple, quantized: bool):
        """(n, file name) of the float (or quantized) entry sharing the longest prefix with
        `keys`, as PrefixIndex.longest."""
        return self.indexes[quantized].longest(keys)

    def load(self, name) -> Optional[tuple]:
        """(tokens, media, caches) of entry `name`, or None (it is then dropped, with a warning)."""
        from .. import cache_file

        path = self.folder / name
        try:
            caches, meta, _, _ = cache_file.read(path, self.model, self.kv, what=f"prefix cache file {name!r}")
            tokens, media = [int(t) for t in meta["tokens"]], [tuple(m) for m in meta["media"]]
            if len(tokens) != caches[0].size():
                raise cache_file.CacheFileError(f"prefix cache file {name!r} holds other positions than tokens")
        except (cache_file.CacheFileError, KeyError, TypeError, ValueError) as e:
            self.skipped += 1
            self.warn(f"skipped {e}" if isinstance(e, cache_file.CacheFileError)
                      else f"skipped prefix cache file {name!r}: it does not hold a prefix entry")
            self._forget(name)
            return None
        keys, size, _, quantized = self.files[name]
        self.files[name] = (keys, size, time.time(), quantized)
        os.utime(path)
        self.hits += 1
        return tokens, media, caches

    def queue(self, tokens, media, caches):
        """An entry (batch-1 caches of exactly its positions) to write at the next flush."""
        self.pending.append((list(tokens), list(media), caches))

    def flush(self):
        """Write the queued entries (an entry already on disk whole is not written again)."""
        from .. import cache_file

        pending, self.pending = self.pending, []
        for tokens, media, caches in pending:
            keys = index_keys(tokens, media)
            quantized = caches[0].kind is not None
            held, _ = self.indexes[quantized].longest(keys)
            if held == len(keys):
                continue
            name = blake3(repr(keys).encode()).hexdigest()[:32] + SUFFIX
            try:
                cache_file.write(self.folder / name, caches, {"tokens": tokens, "media": [list(m) for m in media]},
                                 model=self.model, kv=self.kv)
            except OSError as e:  # a full disk: the memory tier goes on without this entry
                self.warn(f"could not write prefix cache file {name!r}: {e.strerror or e}")
                continue
            self.writes += 1
            self._add(name, keys, (self.folder / name).stat().st_size, time.time(), quantized)
            self._evict()

    def stats(self) -> dict:
        return {"folder": str(self.folder), "entries": len(self.files), "bytes": self.nbytes,
                "max_bytes": self.max_bytes, "hits": self.hits, "writes": self.writes, "skipped": self.skipped,
                "pending": len(self.pending)}
