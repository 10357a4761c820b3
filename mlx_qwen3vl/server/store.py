"""The Responses endpoint's memory of recent responses, for `previous_response_id` (and GET
/v1/responses/{id}): each entry is the whole conversation that produced the response (its turns,
the answer's own turn last) and the response object.

Bounded in entries and in bytes, least recently used out first. A follow-up's entry shares its
history's turns with the entry it continues, so each turn is counted once however many entries
hold it: a long chain of follow-ups costs its conversation once, not once per link, and an entry
that alone exceeds the bytes is not kept at all (a follow-up naming it is told it is unknown).
Used from the event loop only.
"""

import collections
import json
from dataclasses import dataclass
from typing import Dict, List, Optional

from .conversation import Turn


@dataclass
class Stored:
    turns: List[Turn]  # the conversation, system instructions left out (a follow-up gives its own)
    response: dict
    size: int  # the response object's bytes (its turns are counted by the store)


class ResponseStore:
    def __init__(self, max_entries: int = 256, max_bytes: int = 256 << 20):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: "collections.OrderedDict[str, Stored]" = collections.OrderedDict()
        self._turns: Dict[int, list] = {}  # id(turn) → [entries holding it, its size]
        self.bytes = 0
        self.evicted = 0

    def __len__(self):
        return len(self._entries)

    def get(self, rid: str) -> Optional[Stored]:
        entry = self._entries.get(rid)
        if entry is not None:
            self._entries.move_to_end(rid)
        return entry

    def put(self, rid: str, turns: List[Turn], response: dict) -> bool:
        """Keep a response; False when it alone is over the bytes (then it is not kept)."""
        if self.max_entries <= 0:
            return False
        size = len(json.dumps(response, ensure_ascii=False))
        new = {id(t): t.size() for t in turns if id(t) not in self._turns}
        if size + sum(new.values()) > self.max_bytes:
            return False
        entry = Stored(list(turns), response, size)
        self._entries[rid] = entry
        for t in entry.turns:
            slot = self._turns.setdefault(id(t), [0, new.get(id(t), 0)])
            slot[0] += 1
        self.bytes += size + sum(new.values())
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
        return rid in self._entries

    def _drop(self, rid: str):
        entry = self._entries.pop(rid)
        self.evicted += 1
        self.bytes -= entry.size
        for t in entry.turns:
            slot = self._turns[id(t)]
            slot[0] -= 1
            if slot[0] == 0:
                del self._turns[id(t)]
                self.bytes -= slot[1]

    def stats(self) -> dict:
        return {"responses_stored": len(self._entries), "responses_store_bytes": self.bytes,
                "responses_evicted": self.evicted}
