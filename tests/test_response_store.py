"""The Responses store counts what its entries take in memory (tracemalloc's measure of the very
turns it keeps, parsed from a Responses body as the server parses one), so --responses-store-mb
bounds memory, not only the length of the text: long call ids, many empty parts, many small calls."""

import gc
import json
import tracemalloc

import pytest

from mlx_qwen3vl.server import responses as R
from mlx_qwen3vl.server import store as S

FACTOR = 1.6  # the store's count is within [1 / FACTOR, FACTOR] of the measured bytes

BODIES = {
    "a 2 MiB call_id": [{"type": "function_call", "call_id": "c" * (2 << 20), "name": "f", "arguments": "{}"},
                        {"type": "function_call_output", "call_id": "c" * (2 << 20), "output": "ok"}],
    "50k empty text parts": [{"role": "user", "content": [{"type": "input_text", "text": ""}] * 50_000}],
    "5k small calls": [{"type": "function_call", "call_id": f"c{i}", "name": f"fn{i}", "arguments": f'{{"a": {i}}}'}
                       for i in range(5000)],
}


def parsed_turns(items, measure=True):
    """The turns of a Responses body as the server parses them → (turns, the bytes they hold as
    tracemalloc measures them, or None)."""
    raw = json.dumps({"model": "m", "input": items}).encode()
    if not measure:
        return R.history(R.parse_request(json.loads(raw), "qwen")), None
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        req = R.parse_request(json.loads(raw), "qwen")
        turns = R.history(req)
        del req
        gc.collect()
        return turns, tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("case", list(BODIES))
def test_the_store_counts_what_an_entry_takes(case):
    store = S.ResponseStore(8, 1 << 30)
    turns, measured = parsed_turns(BODIES[case])
    assert store.put("resp_1", turns, {"id": "resp_1", "object": "response", "output": []})
    counted = store.bytes
    assert measured / FACTOR <= counted <= measured * FACTOR, (case, counted, measured)


def test_the_flag_bounds_what_the_store_holds_in_memory():
    """1 MiB: eight responses whose call_id is 2 MiB are not kept, and many small ones are kept
    only up to the bytes, with the memory the store holds (measured) within the bound."""
    store = S.ResponseStore(256, 1 << 20)
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for i in range(8):
            turns, _ = parsed_turns(BODIES["a 2 MiB call_id"], measure=False)
            assert not store.put(f"big_{i}", turns, {"id": f"big_{i}", "output": []})
            del turns
        assert len(store) == 0 and store.bytes == 0
        small = [{"type": "function_call", "call_id": f"call_{i}", "name": "lookup", "arguments": "{\"q\": 1}"}
                 for i in range(200)]
        for i in range(30):
            turns, _ = parsed_turns(small, measure=False)
            store.put(f"small_{i}", turns, {"id": f"small_{i}", "output": [{"type": "message", "content": "x" * 100}]})
            del turns
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert store.evicted > 0 and 0 < store.bytes <= 1 << 20
    assert held <= FACTOR * (1 << 20), held


def test_an_entry_of_too_many_objects_is_not_kept(monkeypatch):
    monkeypatch.setattr(S, "MAX_ENTRY_OBJECTS", 1000)
    store = S.ResponseStore(8, 1 << 30)
    turns, _ = parsed_turns([{"role": "user", "content": [{"type": "input_text", "text": ""}] * 2000}])
    assert not store.put("resp_1", turns, {"id": "resp_1", "output": []}) and len(store) == 0
    turns, _ = parsed_turns([{"role": "user", "content": [{"type": "input_text", "text": "hi"}] * 10}])
    assert store.put("resp_2", turns, {"id": "resp_2", "output": []}) and len(store) == 1
