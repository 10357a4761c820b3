"""Tokens → one request's answer text: EOS, stop strings and max_tokens end it, and text that may
still turn out to start a stop string is held back while streaming; the bytes of one token."""

import re

import mlx.core as mx

from ..sampling import SamplingParams


def eos_token_ids(model, processor) -> set:
    """The checkpoint's EOS ids (generation_config.json) and the tokenizer's."""
    ids = set(model.config.eos_token_ids)
    if processor.tokenizer.eos_token_id is not None:
        ids.add(processor.tokenizer.eos_token_id)
    return ids


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_bytes(tokenizer, token: int) -> bytes:
    """The bytes one token stands for (OpenAI's logprobs `bytes`). A token that is part of a UTF-8
    character decodes alone to U+FFFD; its own bytes come from the vocabulary instead: byte-level
    BPE pieces (Qwen's) through mlx-lm's byte table, SentencePiece byte tokens (`<0xB7>`) by value."""
    from mlx_lm.tokenizer_utils import _byte_decoder

    text = tokenizer.decode([int(token)])
    if "\ufffd" not in text:
        return text.encode("utf-8")
    piece = tokenizer.convert_ids_to_tokens(int(token)) or ""
    m = _BYTE_TOKEN.fullmatch(piece)
    if m:
        return bytes([int(m.group(1), 16)])
    table = _byte_decoder()
    if piece and all(c in table for c in piece):
        return bytes(table[c] for c in piece)
    return text.encode("utf-8")


def stop_token_set(eos, params: SamplingParams) -> frozenset:
    """The token ids that end a request's answer: the checkpoint's EOS (unless ignore_eos) and its
    own stop_token_ids."""
    return frozenset(() if params.ignore_eos else eos) | frozenset(params.stop_token_ids)


def suppress_stops(ids, prompt_tokens: int, min_tokens: int):
    """A logits processor (mlx-lm's form) that keeps `ids` from being sampled while the answer is
    shorter than `min_tokens` (vLLM's min_tokens); `history` holds the prompt, then the answer."""
    banned = mx.array(sorted(ids))

    def processor(history, logits):
        if history.shape[-1] - prompt_tokens >= min_tokens:
            return logits
        return logits.at[:, banned].add(-float("inf"))

    return processor


def prompt_opens_thinking(tokenizer, tokens) -> bool:
    """Whether the prompt ends inside a <think> block (a thinking template's generation prompt)."""
    return tokenizer.decode(list(tokens[-4:])).rstrip().endswith("<think>")


def close_thinking(close_id: int, prompt_tokens: int, budget: int):
    """A logits processor (mlx-lm's form) that forces `close_id` (</think>) as the answer's token
    number budget + 1 unless the answer has closed its thinking by then (Anthropic's budget_tokens).
    It reads only the history, no state of its own: a verify forward of speculative decoding calls
    it at positions that may be rejected."""

    def processor(history, logits):
        answer = history[..., prompt_tokens:]
        if answer.shape[-1] != budget or (answer == close_id).any().item():
            return logits
        return mx.where(mx.arange(logits.shape[-1]) == close_id, logits, -float("inf"))

    return processor


class AnswerText:
    """One request's answer as it streams: mlx-lm's streaming detokenizer (multi-byte characters
    never break), EOS tokens (unless `ignore_eos`), `stop_token_ids` and stop strings end it, none
    of them before `min_tokens` tokens, and max_tokens bounds it. Text that could still turn out to
    be the start of a stop string is held back until it is decided, so the streamed pieces always
    add up to the final text.

    `detokenizer`: a fresh streaming detokenizer (mlx-lm's TokenizerWrapper(...).detokenizer)."""

    def __init__(self, detokenizer, stop_ids, params: SamplingParams):
        self.detok = detokenizer
        self.detok.reset()
        self.stop_ids = stop_token_set(stop_ids, params)
        self.stops, self.max_tokens, self.min_tokens = params.stop_strings, params.max_tokens, params.min_tokens
        self.tokens, self.text, self.pending, self.finish = [], "", "", None
        self.stopped_by = None  # the stop string that ended the answer, if one did

    def _held(self, text):
        """Length of the longest end of `text` that begins some stop string."""
        return max((k for s in self.stops for k in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:k])), default=0)

    def add(self, token: int) -> str:
        """Take one token; return the text it releases (self.finish says whether it ended)."""
        self.tokens.append(token)
        if token in self.stop_ids and len(self.tokens) > self.min_tokens:
            self.finish = "stop"
        else:
            self.detok.add_token(token)
        if self.finish is None and len(self.tokens) >= self.max_tokens:
            self.finish = "length"
        if self.finish:
            self.detok.finalize()
        pending = self.pending + self.detok.last_segment
        hits = [] if len(self.tokens) < self.min_tokens else \
            [(i, k) for k, i in enumerate(pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            at, k = min(hits)
            pending, self.finish, self.stopped_by = pending[:at], "stop", self.stops[k]
        keep = 0 if self.finish else self._held(pending)
        piece, self.pending = pending[:len(pending) - keep], pending[len(pending) - keep:]
        self.text += piece
        return piece
