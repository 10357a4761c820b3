"""One decode token and the choice of the next: `decode_step` (tokens through the cache → logits)
and `sample` (logits → tokens, with each row's processors and random stream), gpt-fast's small
functions, the engine's (engine/batch.py's decode); `verify_step`, decode_step for several tokens
a row (speculative decoding's verify forward)."""

import mlx.core as mx


def decode_step(model, tokens, cache, positions, key_mask=None):
    """tokens (B,) → logits (B, V). Decode tokens are text, so their T = H = W position is the
    1D `positions` (cache offset + rope delta) and mRoPE reduces to mx.fast.rope with an offset.
    `key_mask` (B, S + 1): False at padded positions of rows (the cache's key_mask(1))."""
    embeds = model.language_model.embed_tokens(tokens[:, None])
    mask = None if key_mask is None else model.make_mask(key_mask, 1, key_mask.shape[1])
    hidden = model.language_model(embeds, positions, mask, cache)
    return model.logits(hidden[:, -1, :])


def verify_step(model, tokens, cache, positions, key_mask=None):
    """tokens (B, T) → logits (B, T, V): each row's last token and its drafts (speculative
    decoding) through the cache at text positions `positions` (B,) onward, as T decode steps
    would see them (causal, `key_mask` (B, S + T) hiding left padding)."""
    T = tokens.shape[1]
    embeds = model.language_model.embed_tokens(tokens)
    mask = model.make_mask(key_mask, T, key_mask.shape[1]) if key_mask is not None else "causal"
    hidden = model.language_model(embeds, positions, mask, cache)
    return model.logits(hidden)


def sample(logits, sampler, histories, log_softmax):
    """logits (B, V) → tokens (B,), log-probs (B, V).

    `sampler` is one function over the batch's log-probs (e.g. mlx-lm's make_sampler), or one
    `Sampler` per row: each applies its logits processors to its own row's history (real tokens
    only, never the left-padding; None for rows without processors) and draws from its own
    random stream."""
    if callable(sampler):
        logprobs = log_softmax(logits)
        return sampler(logprobs), logprobs
    if any(s.processors for s in sampler):
        logits = mx.concatenate([s.process(h, logits[b: b + 1]) if s.processors else logits[b: b + 1]
                                 for b, (s, h) in enumerate(zip(sampler, histories))])
    logprobs = log_softmax(logits)
    if all(s.greedy for s in sampler):
        return mx.argmax(logprobs, axis=-1), logprobs
    return mx.concatenate([s(logprobs[b: b + 1]) for b, s in enumerate(sampler)]), logprobs
