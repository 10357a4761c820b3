"""Speculative decoding, lossless: drafters propose tokens, one forward checks them, and each row
keeps exactly the tokens its own plain run would have chosen (greedy) or drawn from the same
distribution (sampled).

A drafter is any object with `propose(token_ids, k) -> list of ids`: given a request's prompt
and answer so far, up to k tokens it guesses come next (fewer, or none, when it has no guess).
It is asked once per decode step of a row that has one, so it should be cheap.

`accept` is the rule for one row: greedy rows keep the drafts while they equal the argmax of the
target's (processed) logits; sampled rows use the speculative sampling rule for a deterministic
drafter (its q is one-hot): draft d at a position is kept with probability p(d), and on rejection
the token is drawn from p with d removed (the normalized residual max(0, p - q)), so every token
has the target's distribution. Either way the first rejected position (or the one after the last
draft) yields one more token from the target, so a step always makes progress.
"""

from typing import List, Optional, Protocol, Sequence

import mlx.core as mx


class Drafter(Protocol):
    def propose(self, token_ids: Sequence[int], k: int) -> List[int]:
        """Up to `k` token ids guessed to follow `token_ids` (the prompt, then the answer so far)."""


class PromptLookup:
    """Prompt lookup decoding: the longest recent n-gram (n from `max_n` down to `min_n`) that ends
    the sequence and occurred earlier in it; proposes the tokens that followed its latest earlier
    occurrence. Costs one scan of the recent `window` tokens per n on the host, no model."""

    def __init__(self, max_n: int = 3, min_n: int = 1, window: int = 4096):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prompt lookup needs 1 <= min n-gram ({min_n}) <= max n-gram ({max_n})")
        self.max_n, self.min_n, self.window = max_n, min_n, window

    def propose(self, token_ids, k):
        ids = list(token_ids[-self.window:])
        L = len(ids)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            tail = ids[L - n:]
            for start in range(L - n - 1, -1, -1):  # latest earlier occurrence first
                if ids[start:start + n] == tail:
                    return ids[start + n:start + n + k]
        return []


class Scripted:
    """Proposes from a fixed continuation: after `prompt_tokens` prompt tokens and an answer of m
    tokens so far, `continuation[m:m + k]`. With the plain run's own answer it is the oracle (every
    draft right: the mechanism's ceiling); with anything else, a drafter that is wrong."""

    def __init__(self, prompt_tokens: int, continuation: Sequence[int]):
        self.prompt_tokens, self.continuation = prompt_tokens, [int(t) for t in continuation]

    def propose(self, token_ids, k):
        m = len(token_ids) - self.prompt_tokens
        return self.continuation[m:m + k]


class Wrong:
    """Always proposes k tokens that are not the next ones (a test's worst drafter): the last token
    plus one, repeated."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def propose(self, token_ids, k):
        return [(int(token_ids[-1]) + 1 + i) % self.vocab_size for i in range(k)]


def make_drafter(prompt_lookup: int = 0, drafter: Optional[Drafter] = None) -> Optional[Drafter]:
    """The drafter of the surfaces' arguments: `drafter` as given, else PromptLookup(prompt_lookup)
    when it is > 0, else None."""
    if drafter is not None:
        if not callable(getattr(drafter, "propose", None)):
            raise TypeError("drafter must have a propose(token_ids, k) method")
        return drafter
    if prompt_lookup:
        return PromptLookup(max_n=int(prompt_lookup))
    return None


def accept(sampler, history, fed: List[int], logits, log_softmax, greedy_argmax=None):
    """One row's verification. `fed`: the tokens fed at the row's positions, its last token then
    its drafts; `logits` (T, V) of those positions (T >= len(fed)); `history`: the row's tokens
    before `fed` (for processors; None without them). `greedy_argmax`: the argmax of every
    position, already computed for a greedy row without processors.

    → (tokens, logprob rows (V,) each, number of drafts accepted): the drafts kept, then the
    target's own token at the first rejected position (or after the last draft)."""
    drafts = fed[1:]
    if greedy_argmax is not None:
        n = 0
        while n < len(drafts) and drafts[n] == greedy_argmax[n]:
            n += 1
        lp = log_softmax(logits[:n + 1])
        return drafts[:n] + [greedy_argmax[n]], [lp[i] for i in range(n + 1)], n
    tokens, lps = [], []
    for i in range(len(fed)):
        row = logits[i:i + 1]
        if sampler.processors:
            seen = mx.array(fed[:i + 1]) if history is None else mx.concatenate([history, mx.array(fed[:i + 1])])
            row = sampler.process(seen, row)
        lp = log_softmax(row)
        lps.append(lp[0])
        draft = drafts[i] if i < len(drafts) else None
        if sampler.greedy:
            token = int(mx.argmax(lp, axis=-1).item())
            tokens.append(token)
            if token != draft:
                return tokens, lps, i
            continue
        scaled = sampler.scaled(lp)
        if draft is None:
            tokens.append(int(mx.random.categorical(scaled, key=sampler.next_key()).item()))
            return tokens, lps, i
        logq = scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)
        if mx.random.uniform(key=sampler.next_key()).item() < mx.exp(logq[0, draft]).item():
            tokens.append(draft)
            continue
        residual = mx.where(mx.arange(scaled.shape[-1]) == draft, -mx.inf, scaled)
        tokens.append(int(mx.random.categorical(residual, key=sampler.next_key()).item()))
        return tokens, lps, i
    raise AssertionError("unreachable: the last fed position has no draft")
