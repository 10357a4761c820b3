"""Speculative decoding, lossless: drafters propose tokens, one forward checks them, and each row
keeps exactly the tokens its own plain run would have chosen (greedy) or drawn from the same
distribution (sampled).

A drafter is any object with `propose(token_ids, k) -> list of ids`: given a request's prompt
and answer so far, up to k tokens it guesses come next (fewer, or none, when it has no guess).
It is asked once per decode step of a row that has one, so it should be cheap. Here:
PromptLookup (n-grams the sequence already holds), GrammarForced (what a grammar forces), Oracle
(a known continuation: benchmarks' ceiling) and Wrong (tests' worst case); a draft model, which
needs a prefill and caches of its own in the engine, is engine/draft_model.py's DraftModel.

`accept` is the rule for one row: greedy rows keep the drafts while they equal the argmax of the
target's (processed) logits; sampled rows use the speculative sampling rule: draft d at a
position is kept with probability min(1, p(d) / q(d)), and on rejection the token is drawn from
the normalized residual max(0, p - q), so every token has the target's distribution. q is the
distribution the drafter drew d from (a DraftModel of a sampled request gives it, `q`), one-hot
for a deterministic drafter: d kept with probability p(d), else drawn from p with d removed (also
exact for drafts drawn at random, only keeping fewer). Either way the first rejected position (or
the one after the last draft) yields one more token from the target, so a step always makes
progress.
"""

from typing import List, Protocol, Sequence

import mlx.core as mx


MAX_DRAFT = 64  # draft tokens per verify forward at most
MAX_PROMPT_LOOKUP = 64  # the longest n-gram prompt lookup matches


class Drafter(Protocol):
    """Optionally, a drafter that draws its drafts at random sets `q` after each `propose`: per
    draft, the log-probabilities (V,) it was drawn from (DraftRow does, for sampled requests); the
    rule then keeps a draft with min(1, p/q) instead of p."""

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


class Oracle:
    """Proposes from a known sequence (a prompt and its answer, e.g. the plain run's own): while
    the tokens so far are its beginning, what follows them there; else nothing. With the plain
    run's answer every draft is right: the mechanism's ceiling, for benchmarks and tests."""

    def __init__(self, sequence: Sequence[int]):
        self.sequence = [int(t) for t in sequence]

    def propose(self, token_ids, k):
        n = len(token_ids)
        tail = min(n, 16)  # the tokens so far are checked by their end: the prompt is the caller's
        if self.sequence[n - tail:n] != [int(t) for t in token_ids[n - tail:]]:
            return []
        return self.sequence[n:n + k]


class Wrong:
    """Always proposes k tokens that are not the next ones (a test's worst drafter): the last token
    plus one, repeated."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def propose(self, token_ids, k):
        return [(int(token_ids[-1]) + 1 + i) % self.vocab_size for i in range(k)]


class GrammarForced:
    """The tokens a request's grammar forces next (llguidance's fast-forward tokens: where the
    grammar admits one continuation, e.g. a JSON schema's fixed keys), proposed as drafts; the
    grammar's mask then gives them all the probability, so they are always kept. `processor`: the
    request's grammar processor (server/grammar.py's GrammarProcessor: its llguidance `matcher`
    and the tokens `seen`), read on a copy of the matcher, never advanced."""

    def __init__(self, processor):
        self.processor = processor

    def propose(self, token_ids, k):
        seen = self.processor.seen
        if seen is None:
            return []
        matcher = self.processor.matcher.deep_copy()
        for t in token_ids[seen:]:
            if not matcher.consume_token(int(t)):
                return []
        return list(matcher.compute_ff_tokens())[:k]


DEFAULT_DRAFT = 4  # num_draft_tokens when a drafter is given without it


def accept(sampler, history, fed: List[int], logits, log_softmax, greedy=None, q=None):
    """One row's verification. `fed`: the tokens fed at the row's positions, its last token then
    its drafts; `logits` (T, V) of those positions (T >= len(fed)); `history`: the row's tokens
    before `fed` (for processors; None without them). `greedy`: (argmax, log-probs (T, V)) of
    every position, already computed for a greedy row without processors. `q`: per draft, the
    log-probabilities (V,) it was drawn with (a sampling drafter: engine/draft_model.py); None: a
    deterministic drafter (q one-hot).

    → (tokens, logprob rows (V,) each, number of drafts accepted): the drafts kept, then the
    target's own token at the first rejected position (or after the last draft)."""
    drafts = fed[1:]
    if greedy is not None:
        best, lp = greedy
        n = 0
        while n < len(drafts) and drafts[n] == best[n]:
            n += 1
        return drafts[:n] + [best[n]], [lp[i] for i in range(n + 1)], n
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
        logp = scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)
        ratio = logp[0, draft] if q is None else logp[0, draft] - q[i][draft]  # accepted with min(1, p/q)
        if mx.random.uniform(key=sampler.next_key()).item() < mx.exp(ratio).item():
            tokens.append(draft)
            continue
        if q is None:  # the residual max(0, p - q) of a one-hot q: p without the draft
            residual = mx.where(mx.arange(scaled.shape[-1]) == draft, -mx.inf, scaled)
        else:
            residual = mx.log(mx.maximum(mx.exp(logp[0]) - mx.exp(q[i]), 0.0))[None]
            # p == q to the last bit leaves no residual (a rejection then has probability ~0): draw from p
            residual = mx.where(mx.all(mx.isinf(residual)), logp, residual)
        tokens.append(int(mx.random.categorical(residual, key=sampler.next_key()).item()))
        return tokens, lps, i
    raise AssertionError("unreachable: the last fed position has no draft")
