"""How the next token is chosen: one validated parameter object and a per-request sampler.

`SamplingParams` is the one place the sampling and length settings are named, defaulted and
range-checked (API, CLI and batch requests all build one). `Sampler` turns it into mlx-lm's
logits processors and filters plus a random stream of its own, derived from the request's seed:
a request sampled inside a batch draws exactly what it draws alone.
"""

import math
from dataclasses import dataclass, field, fields, replace
from typing import Mapping, Optional, Sequence, Tuple, Union

import mlx.core as mx

from .errors import InputError


def _finite(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _int(v):
    return isinstance(v, int) and not isinstance(v, bool)


# field name → (accepts value?, allowed range as a user reads it). The CLI names the same checks
# after its flags (metadata "flag" below).
_CHECKS = {
    "max_tokens": (lambda v: _int(v) and v >= 1, "an integer >= 1"),
    "temperature": (lambda v: _finite(v) and v >= 0, "a number >= 0 (0 = greedy)"),
    "top_p": (lambda v: _finite(v) and 0 < v <= 1, "a number in (0, 1] (1 = off)"),
    "top_k": (lambda v: _int(v) and v >= 0, "an integer >= 0 (0 = off)"),
    "min_p": (lambda v: _finite(v) and 0 <= v <= 1, "a number in [0, 1] (0 = off)"),
    "repetition_penalty": (lambda v: v is None or (_finite(v) and v > 0), "a number > 0 (1 = off)"),
    "repetition_context_size": (lambda v: _int(v) and v >= 1, "an integer >= 1"),
    "seed": (lambda v: v is None or (_int(v) and 0 <= v < 2**63), "an integer in [0, 2**63)"),
    "stop": (lambda v: v is None or isinstance(v, str) and v != "" or (
        isinstance(v, (list, tuple)) and all(isinstance(s, str) and s for s in v)), "a non-empty string or a list of them"),
    "presence_penalty": (lambda v: v is None or _finite(v), "a number (0 or none = off)"),
    "presence_context_size": (lambda v: _int(v) and v >= 1, "an integer >= 1"),
    "frequency_penalty": (lambda v: v is None or _finite(v), "a number (0 or none = off)"),
    "frequency_context_size": (lambda v: _int(v) and v >= 1, "an integer >= 1"),
    "ignore_eos": (lambda v: isinstance(v, bool), "True or False"),
    "stop_token_ids": (lambda v: isinstance(v, tuple) and all(_int(t) and t >= 0 for t in v),
                       "a list of token ids (integers >= 0)"),
    "min_tokens": (lambda v: _int(v) and v >= 0, "an integer >= 0"),
    "thinking_budget": (lambda v: v is None or (_int(v) and v >= 0), "an integer >= 0 (none = off)"),
    "logit_bias": (lambda v: v is None or isinstance(v, tuple) and all(
        isinstance(p, tuple) and len(p) == 2 and _int(p[0]) and p[0] >= 0 and _finite(p[1]) for p in v),
        "{token id: bias} with integer ids >= 0 and finite biases"),
    "logprobs": (lambda v: isinstance(v, bool), "True or False"),
    "top_logprobs": (lambda v: _int(v) and v >= 0, "an integer >= 0"),
}


@dataclass(frozen=True)
class SamplingParams:
    """Sampling, length and output settings of one request (mlx-lm's names and meanings), for
    every entry point: generate / stream_generate / batch_generate, ChatSession, the engine, the
    CLI (each field with a flag) and the server, whose protocol validates JSON into one. The
    defaults are the library's (greedy, 256 tokens); the server sets its own (OpenAI's
    temperature 1.0, its --max-tokens)."""

    max_tokens: int = field(default=256, metadata={"flag": "--max-tokens", "help": "most tokens to generate"})
    temperature: float = field(default=0.0, metadata={"flag": "--temp", "help": "sampling temperature; 0 = greedy"})
    top_p: float = field(default=1.0, metadata={"flag": "--top-p", "help": "nucleus sampling mass; 1 = off"})
    top_k: int = field(default=0, metadata={"flag": "--top-k", "help": "sample among the k likeliest; 0 = off"})
    min_p: float = field(default=0.0, metadata={"flag": "--min-p", "help": "drop tokens below min_p x the top "
                                                                          "probability; 0 = off"})
    repetition_penalty: Optional[float] = field(default=None, metadata={
        "flag": "--repetition-penalty", "help": "penalty for tokens already in the context; 1 or none = off"})
    repetition_context_size: int = field(default=20, metadata={
        "flag": "--repetition-context-size", "help": "how many recent tokens the repetition penalty sees"})
    seed: Optional[int] = field(default=None, metadata={
        "flag": "--seed", "help": "seed of this request's random stream; none = drawn from MLX's global one"})
    stop: Union[None, str, Sequence[str]] = field(default=None, metadata={
        "flag": "--stop", "help": "stop strings (besides the checkpoint's EOS tokens), not part of the answer"})
    presence_penalty: Optional[float] = field(default=None, metadata={
        "flag": "--presence-penalty", "help": "subtracted from the logits of tokens already in the context; "
                                              "0 or none = off"})
    presence_context_size: int = field(default=20, metadata={
        "flag": "--presence-context-size", "help": "how many recent tokens the presence penalty sees"})
    frequency_penalty: Optional[float] = field(default=None, metadata={
        "flag": "--frequency-penalty", "help": "subtracted once per occurrence in the context; 0 or none = off"})
    frequency_context_size: int = field(default=20, metadata={
        "flag": "--frequency-context-size", "help": "how many recent tokens the frequency penalty sees"})
    # Benchmarks need answers of an exact length; EOS tokens then count as ordinary tokens (their
    # text included), and stop strings and max_tokens still end the answer.
    ignore_eos: bool = field(default=False, metadata={
        "flag": "--ignore-eos", "help": "generate past the checkpoint's EOS tokens (exact-length answers)"})
    # vLLM's: more token ids that end the answer like EOS (kept out of the text, even with
    # ignore_eos), and a floor under the answer's length before EOS, these ids or a stop string may end it.
    stop_token_ids: Tuple[int, ...] = ()
    min_tokens: int = 0
    # Anthropic's thinking.budget_tokens: when the prompt opens a <think> block (a Thinking
    # checkpoint's template), the answer's token after this many inside it is forced to be </think>.
    thinking_budget: Optional[int] = None
    # OpenAI's / mlx-lm's: {token id: bias} added to the logits before every other processor;
    # held as sorted (id, bias) pairs, so a saved or broadcast copy reads back the same.
    logit_bias: Optional[Mapping[int, float]] = None
    # What each token's event carries besides the token: its log-probability is always there (the
    # library's results keep it); the `top_logprobs` likeliest alternatives only when asked.
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self):
        # the canonical forms (a JSON round trip gives lists and string keys back), then the checks
        object.__setattr__(self, "stop_token_ids", _canonical_ids(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _canonical_bias(self.logit_bias))
        check_sampling({f.name: getattr(self, f.name) for f in fields(self)})

    @classmethod
    def build(cls, base: Optional["SamplingParams"] = None, **overrides) -> "SamplingParams":
        """`base` (or the defaults) with the given fields replaced; unknown names are an error."""
        unknown = sorted(set(overrides) - FIELD_NAMES)
        if unknown:
            raise TypeError(f"unknown sampling argument(s) {', '.join(unknown)}; use {', '.join(sorted(FIELD_NAMES))}")
        if base is not None and not isinstance(base, SamplingParams):
            raise InputError(f"sampling must be a SamplingParams, not {type(base).__name__}")
        return replace(base or cls(), **overrides)

    @property
    def stop_strings(self) -> list:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


FIELD_NAMES = frozenset(f.name for f in fields(SamplingParams))


def _canonical_ids(v):
    return tuple(v) if isinstance(v, (list, tuple)) else v


def _canonical_bias(v):
    """{id: bias} (or (id, bias) pairs, ids as digit strings too) → sorted pairs; else `v` as it
    came, for the check to refuse."""
    pairs = v.items() if isinstance(v, Mapping) else v
    if not isinstance(pairs, (list, tuple)) and not isinstance(v, Mapping):
        return v
    try:
        out = tuple(sorted((int(t) if isinstance(t, str) and t.isdigit() else t, b) for t, b in pairs))
    except (TypeError, ValueError):
        return v
    return out or None


def check_sampling(values: dict, name=lambda field_name: field_name):
    """Raise InputError for the first value out of range, naming it with `name(field)`."""
    for key, value in values.items():
        ok, allowed = _CHECKS[key]
        if not ok(value):
            raise InputError(f"{name(key)} = {value!r} is not allowed; use {allowed}")


class Sampler:
    """One request's token choice: mlx-lm's logits processors (repetition, presence and frequency
    penalties, then `processors`, e.g. a grammar's mask), its top-p / min-p / top-k filters, then
    a categorical draw with this request's own random key (split once per token)."""

    def __init__(self, params: SamplingParams, processors: Sequence = ()):
        # mlx_lm is imported on first use: importing it pulls in transformers (seconds of startup).
        from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

        penalty = params.repetition_penalty
        # mlx-lm's order: logit bias, repetition, presence, frequency; then any of the request's own (grammar).
        self.processors = make_logits_processors(
            logit_bias=dict(params.logit_bias) if params.logit_bias else None,
            repetition_penalty=penalty if penalty not in (None, 1.0) else None,
            repetition_context_size=params.repetition_context_size,
            presence_penalty=params.presence_penalty or None, presence_context_size=params.presence_context_size,
            frequency_penalty=params.frequency_penalty or None,
            frequency_context_size=params.frequency_context_size) + list(processors)
        self.temperature = float(params.temperature)
        self.greedy = self.temperature == 0
        self.filters = []
        if 0 < params.top_p < 1:
            self.filters.append(lambda x: apply_top_p(x, params.top_p))
        if params.min_p > 0:
            self.filters.append(lambda x: apply_min_p(x, params.min_p))
        if params.top_k > 0:
            # top_k >= vocabulary size keeps every token (mlx-lm would refuse it).
            self.filters.append(lambda x: x if params.top_k >= x.shape[-1] else apply_top_k(x, params.top_k))
        seed = params.seed
        if seed is None and not self.greedy:
            seed = int(mx.random.randint(0, 2**31 - 1, ()).item())  # follows mx.random.seed()
        self.key = None if self.greedy else mx.random.key(seed)

    def process(self, history, logits):
        """logits (1, V) after the processors, over `history` (this request's tokens so far)."""
        for proc in self.processors:
            logits = proc(history, logits)
        return logits

    def __call__(self, logprobs):
        """logprobs (1, V) → token (1,)."""
        if self.greedy:
            return mx.argmax(logprobs, axis=-1)
        return mx.random.categorical(self.scaled(logprobs), key=self.next_key())

    def scaled(self, logprobs):
        """logprobs (1, V) → the unnormalized log-distribution a draw uses: filtered, over temperature."""
        for f in self.filters:
            logprobs = f(logprobs)
        return logprobs * (1.0 / self.temperature)

    def next_key(self):
        """A fresh key from this request's random stream (one split per draw)."""
        keys = mx.random.split(self.key)
        self.key = keys[0]
        return keys[1]
