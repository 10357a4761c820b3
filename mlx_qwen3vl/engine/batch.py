"""The rows being decoded together: one KV cache per layer holding every row, left-padded to a
common length (kv_cache.KVCache, or its QuantizedKVCache: a batch holds rows of one cache kind),
and per row its next 1D position (cache length + its mRoPE rope delta), its sampler (its own
processors and random stream) and, for processors that read it, its tokens so far."""

from typing import List, Optional

import mlx.core as mx

from .speculative import accept
from .step import decode_step, sample, verify_step


def cache_bytes(cache) -> int:
    """Bytes of a cache's buffers over its layers (0: none yet)."""
    return sum(c.nbytes for c in cache) if cache else 0


class Row:
    """One request being decoded (or about to be: its first token comes from its prefill)."""

    def __init__(self, request, sampler, answer, prompt_tokens: int, cached: int, history, kv=None):
        self.request, self.id = request, request.id
        self.kv = kv  # its KVSettings: when its cache turns quantized
        self.sampler, self.answer = sampler, answer
        self.prompt_tokens, self.cached = prompt_tokens, cached
        self.history = history  # mx.array of the tokens so far, for processors; None without them
        self.logprobs: List[float] = []  # of each chosen token
        self.kv_bytes = 0  # its share of the cache's buffers when its newest token was computed
        self.drafter = request.drafter  # speculative decoding: proposes its next tokens
        self.num_draft = request.num_draft_tokens if self.drafter is not None else 0
        self.proposed = self.accepted = 0  # draft tokens proposed for it, and kept
        self.draft_q = None  # the log-probabilities its last drafts were drawn with (None: one-hot)
        self.made = 0  # tokens computed for it (handed out or not: see `unread`)

    @property
    def unread(self) -> bool:
        """Its newest token (y) was computed, possibly queued ahead, and not yet handed out."""
        return self.made > len(self.answer.tokens)

    @property
    def held(self) -> int:
        """Positions of its cache worth keeping: the prompt and the answer but its last token
        (which may or may not have been fed; a next turn renders it again anyway)."""
        return self.prompt_tokens + max(len(self.answer.tokens) - 1, 0)


class Batch:
    """Rows, their caches and the tokens not yet fed (`y`, with their log-probabilities `lp`).
    `kind`: the caches' (kv_cache: None for float, else (bits, group_size))."""

    def __init__(self, model, log_softmax, kind=None):
        self.model, self.log_softmax, self.kind = model, log_softmax, kind
        self.rows: List[Row] = []
        self.cache: Optional[list] = None
        self.y = self.lp = self.positions = None

    def __len__(self):
        return len(self.rows)

    def join(self, row, cache: list, y, lp, position):
        """Add a prefilled row: its cache (batch 1), first token y (1,), lp (1, V), next position (1,);
        or several (`row` a list of Rows, their cache's rows in that order), merged in at once."""
        rows = row if isinstance(row, list) else [row]
        if not self.rows:
            self.rows, self.cache, self.y, self.lp, self.positions = rows, cache, y, lp, position
            return
        self.cache = [type(group[0]).merge(group) for group in zip(self.cache, cache)]
        self.rows.extend(rows)
        self.y = mx.concatenate([self.y, y])
        self.lp = mx.concatenate([self.lp, lp])
        self.positions = mx.concatenate([self.positions, position])

    def length(self, i: int) -> int:
        """Positions row `i` has in the cache (its padding not counted)."""
        return self.cache[0].size() - self.cache[0].padding()[i]

    def take(self, indices) -> list:
        """Take rows out whole → [(row, its cache holding every position it has, y, lp, position)],
        ready to join another batch."""
        indices = sorted(set(indices))
        if len(self.rows) == len(indices) == 1:
            out = [(self.rows[0], self.cache, self.y, self.lp, self.positions)]
            self.rows, self.cache, self.y, self.lp, self.positions = [], None, None, None, None
            return out
        out = [(self.rows[i], [c.extract(i) for c in self.cache], self.y[i:i + 1], self.lp[i:i + 1],
                self.positions[i:i + 1]) for i in indices]
        self.remove(indices)
        return out

    def measure(self):
        """Each row's Row.kv_bytes: its share of the cache's buffers as they are now (padding included)."""
        share = cache_bytes(self.cache) // len(self.rows)
        for row in self.rows:
            row.kv_bytes = share

    def decode(self):
        """Feed `y` and sample the next token of every row → (y, lp), left lazy."""
        rows = self.rows
        for b, row in enumerate(rows):
            row.made += 1
            if row.history is not None:
                row.history = mx.concatenate([row.history, self.y[b:b + 1]])
        logits = decode_step(self.model, self.y, self.cache, self.positions, self.cache[0].key_mask(1))
        self.positions = self.positions + 1
        return sample(logits, [r.sampler for r in rows], [r.history for r in rows], self.log_softmax)

    def verify(self, drafts, qs=None):
        """Speculative step: feed each row's `y` and its drafts (drafts[b], possibly empty) in one
        forward, rows with fewer drafts padded at the end (causal attention keeps the padding out
        of their real positions) → per row (tokens, logprob rows, drafts accepted), each row's
        cache holding exactly its fed tokens up to its last accepted draft, `y` / `lp` its last
        token, left unfed, as after that many decode steps. `qs[b]`: the log-probabilities row b's
        drafts were drawn with (None: a deterministic drafter; see speculative.accept)."""
        rows = self.rows
        T = 1 + max(len(d) for d in drafts)
        ys = self.y.tolist()
        fed = [[y] + list(d) for y, d in zip(ys, drafts)]
        tokens = mx.array([f + [f[0]] * (T - len(f)) for f in fed])
        logits = verify_step(self.model, tokens, self.cache, self.positions, self.cache[0].key_mask(T))
        plain = [i for i, r in enumerate(rows) if r.sampler.greedy and not r.sampler.processors]
        greedy = {}
        if plain:  # the argmax of the log-probs, as a decode step's (not of the logits: they can tie)
            lps = self.log_softmax(logits[mx.array(plain)] if len(plain) < len(rows) else logits)
            greedy = {b: (best, lps[i]) for i, (b, best) in enumerate(zip(plain, mx.argmax(lps, axis=-1).tolist()))}
        runs = []
        for b, row in enumerate(rows):
            runs.append(accept(row.sampler, row.history, fed[b], logits[b], self.log_softmax,
                               greedy.get(b), qs[b] if qs else None))
            n = runs[-1][2]
            row.made += n + 1
            if row.history is not None:
                row.history = mx.concatenate([row.history, mx.array(fed[b][:n + 1])])
        kept = [n + 1 for _, _, n in runs]
        for c in self.cache:
            c.drop_last([T - k for k in kept])
        self.positions = self.positions + mx.array(kept)
        self.y = mx.array([t[-1] for t, _, _ in runs])
        self.lp = mx.stack([lp[-1] for _, lp, _ in runs])
        return runs

    def remove(self, indices, keep_caches=()) -> dict:
        """Take rows out → {index: its cache (a list over layers, holding Row.held positions)}
        for the indices in `keep_caches`. A row alone hands over the batch's own caches (trimmed,
        not copied); several rows are each copied out."""
        indices = set(indices)
        out = {}
        if len(self.rows) == 1 and indices == {0}:
            if 0 in keep_caches:
                row = self.rows[0]
                for c in self.cache:
                    c.trim_to(row.held)
                out[0] = self.cache
            self.rows, self.cache, self.y, self.lp, self.positions = [], None, None, None, None
            return out
        for i in keep_caches:
            out[i] = [c.extract(i, self.rows[i].held) for c in self.cache]
        keep = [i for i in range(len(self.rows)) if i not in indices]
        if not keep:
            self.rows, self.cache, self.y, self.lp, self.positions = [], None, None, None, None
            return out
        for c in self.cache:
            c.filter(keep)
        index = mx.array(keep)
        self.rows = [self.rows[i] for i in keep]
        self.y, self.lp, self.positions = self.y[index], self.lp[index], self.positions[index]
        return out
