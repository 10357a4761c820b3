"""The model's own answer behind each computer-use action this server issued, so that a client
replaying the action is shown what the model wrote, not the action written back from pixels.

An answer's 0-1000 coordinates become display pixels on the way out; written back from the pixels
they round to other values (on a 1366-pixel axis 233 of the 1001 values do), so the model would
be shown an action it did not take and the prompt would leave the prefix cache at the first
replayed step. The server keeps each answer keyed by the ids it issued (Anthropic tool_use ids,
OpenAI call_ids: random, so only a client that received them can name them) with the actions as
it issued them; a replayed assistant turn whose calls carry exactly those ids and the same actions
(read back the same way, on the same display) is rendered from the kept answer, and anything
else from the replay itself.

Bounded in entries and bytes, least recently used out first; an answer alone over the bytes is not
kept. Used from the event loop and the prepare threads: one lock.
"""

import collections
import threading
from dataclasses import dataclass
from typing import Hashable, Optional, Sequence

DEFAULT_ENTRIES = 1024
DEFAULT_BYTES = 16 << 20
_OVERHEAD = 256  # bytes counted per entry beyond its text (ids, the actions, the slot)


@dataclass(frozen=True)
class _Issued:
    ids: tuple
    key: Hashable  # the actions as issued (and the display and tool they were in)
    answer: str
    size: int


class ComputerAnswers:
    def __init__(self, max_entries: int = DEFAULT_ENTRIES, max_bytes: int = DEFAULT_BYTES):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: "collections.OrderedDict[str, _Issued]" = collections.OrderedDict()  # first id → entry
        self._lock = threading.Lock()
        self.bytes = self.evicted = self.hits = 0

    def __len__(self):
        return len(self._entries)

    def put(self, ids: Sequence[str], key: Hashable, answer: str) -> bool:
        """Keep `answer` for the calls `ids` (in order) issued as `key`; False when not kept (the
        store is off, or the answer alone is over the bytes)."""
        ids = tuple(ids)
        size = len(answer.encode("utf-8", "surrogatepass")) + sum(map(len, ids)) + _OVERHEAD
        if not ids or self.max_entries <= 0 or size > self.max_bytes:
            return False
        with self._lock:
            old = self._entries.pop(ids[0], None)
            if old is not None:
                self.bytes -= old.size
            self._entries[ids[0]] = _Issued(ids, key, answer, size)
            self.bytes += size
            while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
                _, dropped = self._entries.popitem(last=False)
                self.bytes -= dropped.size
                self.evicted += 1
        return True

    def get(self, ids: Sequence[str], key: Hashable) -> Optional[str]:
        """The answer kept for exactly these ids issued as exactly `key`; None otherwise."""
        ids = tuple(ids)
        if not ids:
            return None
        with self._lock:
            entry = self._entries.get(ids[0])
            if entry is None or entry.ids != ids or entry.key != key:
                return None
            self._entries.move_to_end(ids[0])
            self.hits += 1
            return entry.answer

    def stats(self) -> dict:
        return {"computer_answers_stored": len(self._entries), "computer_answers_bytes": self.bytes,
                "computer_answers_evicted": self.evicted, "computer_answers_replayed": self.hits}
