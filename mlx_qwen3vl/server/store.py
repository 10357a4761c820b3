"""The Responses endpoint's memory of recent responses, for `previous_response_id` (and GET
/v1/responses/{id}): each entry is the whole conversation that produced the response (its turns,
the answer's own turn last) and the response object.

Bounded in entries and in bytes, least recently used out first. A follow-up's entry shares its
history's turns with the entry it continues, so each turn is counted once however many entries
hold it: a long chain of follow-ups costs its conversation once, not once per link, and an entry
that alone exceeds the bytes, or holds more than MAX_ENTRY_OBJECTS objects, is not kept at all (a
follow-up naming it is told it is unknown).

Bytes are what the objects take in this process (`footprint`: every object's own size as CPython
lays it out, its attributes, containers and items), not the length of their text: ids, names,
call ids, arguments and each part's overhead all count. Used from the event loop only.
"""

import collections
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional

from .conversation import Turn


MAX_ENTRY_OBJECTS = 200_000  # objects one entry may hold (parts, calls, strings...); more: not kept
_ATOMS = (str, bytes, bytearray, int, float, bool, type(None), complex)


class TooMany(Exception):
    pass


def footprint(obj, budget: List[int]) -> int:
    """Bytes `obj` keeps alive: each object reached from it (attributes, containers and their
    items) by sys.getsizeof, each counted once. `budget`: [objects still allowed], spent here;
    TooMany once it runs out."""
    seen, total, stack = set(), 0, [obj]
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        budget[0] -= 1
        if budget[0] < 0:
            raise TooMany
        total += sys.getsizeof(o)
        if isinstance(o, _ATOMS):
            continue
        if isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack.extend(o)
        else:
            d = getattr(o, "__dict__", None)
            if d is not None:
                stack.append(d)
            for name in getattr(type(o), "__slots__", ()):
                if hasattr(o, name):
                    stack.append(getattr(o, name))
    return total


@dataclass
class Stored:
    turns: List[Turn]  # the conversation, system instructions left out (a follow-up gives its own)
    response: dict
    size: int  # the bytes of the response object and of the entry itself (its turns are counted by the store)


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
        """Keep a response; False when it alone is over the bytes or the objects (then it is not kept)."""
        if self.max_entries <= 0:
            return False
        objects = [MAX_ENTRY_OBJECTS]  # read at each call (tests lower it)
        try:
            new, total = {}, 0
            for t in turns:
                if id(t) not in self._turns and id(t) not in new:
                    new[id(t)] = footprint(t, objects)
                    total += new[id(t)]
                    if total > self.max_bytes:
                        return False
            entry = Stored(list(turns), response, 0)
            entry.size = footprint(response, objects) + sys.getsizeof(entry) + sys.getsizeof(entry.__dict__) + \
                sys.getsizeof(entry.turns) + sys.getsizeof(rid) + 100  # + the dict slot and the turn map's lists
        except TooMany:
            return False
        size = entry.size + total + 200 * len(new)  # each new turn's slot in the turn map
        if size > self.max_bytes:
            return False
        self._entries[rid] = entry
        for t in entry.turns:
            slot = self._turns.setdefault(id(t), [0, new.get(id(t), 0) + 200])
            slot[0] += 1
        self.bytes += size
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
