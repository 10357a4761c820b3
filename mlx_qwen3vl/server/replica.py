"""The engine on several ranks (`mlx.launch -n N -- python -m mlx_qwen3vl.server`): a replicated
state machine. Rank 0 serves HTTP; before each engine iteration it broadcasts the iteration's
inputs (the requests it admits, with their token ids, pixel arrays, sampling settings and a seed
drawn here; the requests whose clients went away or that passed their time limit, by this rank's
clock; or the order to stop), and every rank then hands them to its engine and runs the same
deterministic step (admission, the prefill items its FLOP budget allows, decode, sampling, stop
decisions), so the collectives inside the sharded model line up. Other ranks never read media or
bind a port.

Each broadcast also carries every rank's digest of its engine state (settings, rows, tokens so far,
cache length): ranks that drift apart stop with one clear error instead of hanging in mismatched
collectives. An unexpected error on any rank ends that rank with status 1, and `mlx.launch` then
stops the others.
"""

import dataclasses
import hashlib
import io
import json
import os
import sys
from dataclasses import dataclass, field
from typing import List, Optional

import mlx.core as mx
import numpy as np

from ..sampling import SamplingParams
from .prepared import Prepared


class OutOfStep(RuntimeError):
    """The ranks' engine states differ: continuing would pair mismatched collectives."""


class RankLost(RuntimeError):
    """A rank sent nothing to the step's exchange: it has ended (the ring then fails the sum)."""


@dataclass
class Orders:
    """One engine iteration's inputs, as rank 0 decided them."""

    admit: list = field(default_factory=list)  # Handles (ghosts on other ranks), ids set
    cancel: List[int] = field(default_factory=list)  # ids of requests whose clients went away
    expire: List[int] = field(default_factory=list)  # ids of requests past their time limit (rank 0's clock)
    stop: bool = False


class _Ghost:
    """A request on a rank that does not serve HTTP: the same inputs, nobody listening."""

    listening = False
    cancelled = False

    def __init__(self, prepared, rid):
        self.prepared, self.id = prepared, rid

    def emit(self, event):
        pass


def digest(*parts) -> int:
    """A 56-bit digest of `parts` (their repr): small enough to sum over ranks in an int64."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=7).digest(), "little")


def _all_sum(values: np.ndarray, group) -> np.ndarray:
    # No model collective is in flight here: every engine step ends with mx.eval of its sampled tokens,
    # which every collective of the step feeds (the token loop's queued-ahead step is not used here).
    return np.array(mx.distributed.all_sum(mx.array(values), group=group, stream=mx.cpu))


class _Replicas:
    def __init__(self, group):
        self.group, self.rank, self.size = group, group.rank(), group.size()

    def _header(self, length: int, stop: bool, state: int):
        """All ranks' [payload length, stop, digest of rank 0, ..., digest of rank N-1]: one all_sum."""
        mine = np.zeros(2 + self.size, np.int64)
        if self.rank == 0:
            mine[:2] = length, stop
        mine[2 + self.rank] = state
        got = _all_sum(mine, self.group)
        # A digest is never 0 (but 1 in 2**56): a 0 is a rank whose part never arrived.
        lost = [r for r in range(self.size) if r != self.rank and got[2 + r] == 0]
        if lost:
            raise RankLost(f"rank(s) {lost} sent nothing (ended or unreachable); stopping this rank")
        differ = [r for r in range(self.size) if got[2 + r] != got[2]]
        if differ:
            raise OutOfStep(f"rank(s) {differ} are out of step with rank 0 (their engine states differ); "
                            "stopping every rank rather than pairing mismatched collectives")
        return int(got[0]), bool(got[1])

    def _payload(self, data: Optional[bytes], n: int) -> bytes:
        buf = np.frombuffer(data, np.uint8) if self.rank == 0 else np.zeros(n, np.uint8)
        return _all_sum(buf, self.group).tobytes()

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's `value` (e.g. a KV budget from each machine's memory)."""
        mine = np.zeros(self.size, np.int64)
        mine[self.rank] = value
        return int(_all_sum(mine, self.group).min())

    def fail(self, error: BaseException):
        """End this rank at once with one clear line: mlx.launch then stops the other ranks."""
        print(f"[mlx_qwen3vl] rank {self.rank} of {self.size}: the model worker failed "
              f"({type(error).__name__}: {error}); stopping all ranks", file=sys.stderr, flush=True)
        os._exit(1)


class Leader(_Replicas):
    """Rank 0: sends each orders."""

    def exchange(self, orders: Orders, state: int) -> Orders:
        for handle in orders.admit:
            p = handle.prepared
            if p.sampling.seed is None:  # drawn here, as the one-process Sampler would draw it
                p.sampling = dataclasses.replace(p.sampling, seed=int(mx.random.randint(0, 2**31 - 1, ()).item()))
        data = encode(orders) if orders.admit or orders.cancel or orders.expire else b""
        self._header(len(data), orders.stop, state)
        if data:
            self._payload(data, len(data))
        return orders


class Follower(_Replicas):
    """Ranks 1..N-1: receive each orders; grammars are compiled again here from their description."""

    def __init__(self, group, grammars):
        super().__init__(group)
        self.grammars = grammars

    def exchange(self, orders, state: int) -> Orders:
        length, stop = self._header(0, False, state)
        if stop:
            return Orders(stop=True)
        return decode(self._payload(None, length), self.grammars) if length else Orders()


# ------------------------------------------------------------------------------------------------
# Wire format: a JSON line (ids, tokens, media keys, sampling, grammar, cancellations), then one
# .npz with every admitted request's arrays (pixels, grids, ids) under "<index>/<name>".
def encode(orders: Orders) -> bytes:
    requests, arrays = [], {}
    for i, handle in enumerate(orders.admit):
        p = handle.prepared
        inputs = {}
        for k, v in p.inputs.items():
            if isinstance(v, (np.ndarray, mx.array)):
                arrays[f"{i}/{k}"] = np.array(v)
                inputs[k] = "mlx" if isinstance(v, mx.array) else "numpy"
            else:
                inputs[k] = {"value": v}
        requests.append({"id": handle.id, "inputs": inputs, "tokens": p.tokens, "media": p.media,
                         "sampling": dataclasses.asdict(p.sampling), "max_tokens": p.max_tokens,
                         "grammar": p.grammar, "kv": p.kv, "drafting": p.drafting})
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    head = {"admit": requests, "cancel": orders.cancel, "expire": orders.expire}
    return json.dumps(head).encode() + b"\n" + buf.getvalue()


def decode(data: bytes, grammars) -> Orders:
    head, body = data.split(b"\n", 1)
    info = json.loads(head)
    admit = []
    with np.load(io.BytesIO(body), allow_pickle=False) as arrays:
        for i, r in enumerate(info["admit"]):
            inputs = {}
            for k, kind in r["inputs"].items():
                if isinstance(kind, dict):
                    inputs[k] = kind["value"]
                else:
                    a = arrays[f"{i}/{k}"]
                    inputs[k] = mx.array(a) if kind == "mlx" else a
            p = Prepared(inputs=inputs, tokens=r["tokens"], media=[tuple(m) for m in r["media"]],
                         sampling=SamplingParams(**r["sampling"]), max_tokens=r["max_tokens"],
                         grammar=r["grammar"], processors=grammars.build(r["grammar"]), kv=r.get("kv"),
                         drafting=r.get("drafting"))
            admit.append(_Ghost(p, r["id"]))
    return Orders(admit=admit, cancel=info["cancel"], expire=info.get("expire", []))
