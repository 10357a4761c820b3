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
call ids, arguments and each part's overhead all count. The walk over an entry's objects runs
off the event loop (`keep`: measured on a worker thread, then kept on the loop); the rest is the
loop's alone, and eviction is O(1) per entry (an OrderedDict and a running byte count).
"""

import asyncio
import collections
import sys
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

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


TURN_SLOT = 200  # each turn's slot in the turn map


@dataclass
class Stored:
    turns: List[Turn]  # the conversation, system instructions left out (a follow-up gives its own)
    response: dict
    size: int  # the bytes of the response object and of the entry itself (its turns are counted by the store)


@dataclass
class Measured:
    entry: Stored
    new: Dict[int, int]  # id(turn) → its bytes, for the turns the store did not hold when measured


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
        return self._insert(rid, self.measure(rid, turns, response, set(self._turns)))

    async def keep(self, rid: str, turns: List[Turn], response: Callable[[], dict], pool=None) -> bool:
        """`put`, with the response object made (`response()`) and the walk over the entry's objects
        (up to MAX_ENTRY_OBJECTS) on `pool`'s thread, only the bookkeeping on the event loop.
        Awaited before the response is sent, so a follow-up naming it finds it."""
        known = set(self._turns)
        measured = await asyncio.get_running_loop().run_in_executor(
            pool, lambda: self.measure(rid, turns, response(), known))
        return self._insert(rid, measured)

    def measure(self, rid: str, turns: List[Turn], response: dict, known) -> Optional["Measured"]:
        """What keeping the entry would cost (the turns not in `known` measured) → Measured, or None
        when it alone is over the bytes or the objects. Reads no state of the store: any thread."""
        if self.max_entries <= 0:
            return None
        objects = [MAX_ENTRY_OBJECTS]  # read at each call (tests lower it)
        try:
            new, total = {}, 0
            for t in turns:
                if id(t) not in known and id(t) not in new:
                    new[id(t)] = footprint(t, objects)
                    total += new[id(t)]
                    if total > self.max_bytes:
                        return None
            entry = Stored(list(turns), response, 0)
            entry.size = footprint(response, objects) + sys.getsizeof(entry) + sys.getsizeof(entry.__dict__) + \
                sys.getsizeof(entry.turns) + sys.getsizeof(rid) + 100  # + the dict slot and the turn map's lists
        except TooMany:
            return None
        if entry.size + total + TURN_SLOT * len(new) > self.max_bytes:
            return None
        return Measured(entry, new)

    def _insert(self, rid: str, measured: Optional["Measured"]) -> bool:
        """Keep a measured entry (on the event loop: O(its turns), then O(1) per entry evicted)."""
        if measured is None:
            return False
        entry, new = measured.entry, measured.new
        for t in entry.turns:  # a turn that left the store while this entry was measured: measured now
            if id(t) not in self._turns and id(t) not in new:
                try:
                    new[id(t)] = footprint(t, [MAX_ENTRY_OBJECTS])
                except TooMany:
                    return False
        self._entries[rid] = entry
        self.bytes += entry.size
        for t in entry.turns:
            slot = self._turns.get(id(t))
            if slot is None:  # the first entry holding this turn pays for it
                slot = self._turns[id(t)] = [0, new[id(t)] + TURN_SLOT]
                self.bytes += slot[1]
            slot[0] += 1
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
