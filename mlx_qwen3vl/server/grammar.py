"""Constrained decoding with llguidance: `response_format` (json_object, json_schema) and forced
tool calls (`tool_choice` "required" or a named function) as mlx-lm-style logits processors.

llguidance rather than xgrammar (which needs torch, not a runtime dependency here) or
outlines-core; its mask is computed per token on the CPU (see benchmarks/README.md, "Server").
"""

import concurrent.futures
import json
import threading

import mlx.core as mx
import numpy as np

from .protocol import APIError

# Compact JSON (no free whitespace): a model cannot pad its answer with blanks until the limit.
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Compiles run here (llguidance drops the GIL while it builds a matcher), so a request can stop
# waiting at its deadline; llguidance's own fuel limits end the compile itself soon after.
_compiler = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="mlx_qwen3vl-grammar")


class GrammarFactory:
    """Compiles grammars for one tokenizer; the llguidance tokenizer is built once, lazily.
    `timeout_s`: how long a request may wait for its grammar (queueing included), else a 400;
    None (ranks replaying rank 0's requests, which must compile what rank 0 accepted): no limit."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int, timeout_s=None):
        self.tokenizer, self.vocab_size, self.eos = tokenizer, vocab_size, eos_token_id
        self.timeout_s = timeout_s
        self._lltok = None
        self._lock = threading.Lock()

    def _llg_tokenizer(self):
        import llguidance.hf

        with self._lock:
            if self._lltok is None:
                self._lltok = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size,
                                                          eos_token=self.eos)
            return self._lltok

    def _processor(self, grammar: str, param: str):
        import llguidance

        matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar)
        if matcher.is_error():
            raise APIError(400, f"'{param}' could not be compiled: {first_line(matcher.get_error())}", param=param,
                           code="invalid_schema")
        probe = matcher.deep_copy()  # a grammar with no value at all (a $ref to itself) fails at its first mask
        probe.compute_bitmask()
        if probe.is_error():
            raise APIError(400, f"'{param}' admits no value at all (a schema whose $ref only refers to itself, or "
                           "contradicting constraints); send a schema some JSON value satisfies", param=param,
                           code="invalid_schema")
        return GrammarProcessor(matcher, self.vocab_size, param)

    def build(self, spec) -> list:
        """The logits processors of a grammar description (Prepared.grammar): None, ["json_schema",
        schema] or ["tool_call", tools, name]. A description, unlike a compiled matcher, can be sent
        to other ranks, which compile their own."""
        if spec is None:
            return []
        self._llg_tokenizer()  # built once, outside any request's deadline
        if spec[0] == "json_schema":
            compile_, param = (lambda: self.json_schema(spec[1])), "response_format"
        elif spec[0] == "tool_text":
            compile_, param = (lambda: self.tool_call(spec[1], free_text=True)), "tools"
        else:
            compile_, param = (lambda: self.tool_call(spec[1], spec[2])), "tool_choice"
        if self.timeout_s is None:
            return [compile_()]
        future = _compiler.submit(compile_)
        try:
            return [future.result(timeout=self.timeout_s)]
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise APIError(400, f"'{param}' did not compile within {self.timeout_s:g} s (the server's "
                           "--grammar-timeout); send a simpler schema", param=param, code="grammar_timeout") from None

    def json_schema(self, schema: dict, param="response_format"):
        import llguidance

        schema = {**schema, "x-guidance": {**COMPACT, **schema.get("x-guidance", {})}}
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        except (ValueError, TypeError) as e:
            raise APIError(400, f"'{param}' is not a usable JSON schema: {first_line(str(e))}", param=param,
                           code="invalid_schema") from None
        return self._processor(grammar, param)

    def tool_call(self, tools, name=None, free_text=False):
        """One `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` block, for the
        named function or any of `tools`, in the Qwen3-VL template's format. `free_text` (tool_choice
        auto with a strict tool): any text, then any number of such blocks, each strict tool's
        arguments held to its schema (another tool's to any object)."""
        import llguidance

        options = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
        calls = [{"type": "object", "properties": {
                     "name": {"const": f["name"]},
                     "arguments": (f.get("parameters") or {"type": "object"}) if f.get("strict") or not free_text
                     else {"type": "object"}},
                  "required": ["name", "arguments"], "additionalProperties": False} for f in options]
        schema = {"anyOf": calls} if len(calls) > 1 else calls[0]
        schema["x-guidance"] = COMPACT
        ids = [self.tokenizer.convert_tokens_to_ids(t) for t in ("<tool_call>", "</tool_call>")]
        if any(i is None or i == self.tokenizer.unk_token_id for i in ids):
            raise APIError(400, "this checkpoint's tokenizer has no <tool_call> token; tool_choice "
                           "'required' cannot be enforced", param="tool_choice")
        if free_text:  # text (a thinking checkpoint's <think> tokens too), then the calls
            think = [self.tokenizer.convert_tokens_to_ids(t) for t in ("<think>", "</think>")]
            think = [f"<[{i}]>" for i in think if i is not None and i != self.tokenizer.unk_token_id]
            lark = (f'start: text? (<[{ids[0]}]> "\\n" call "\\n" <[{ids[1]}]> "\\n"?)*\n'
                    f'text: (TEXT {" ".join("| " + t for t in think)})+\nTEXT: /(?s:.+)/\n'
                    f'call: %json {json.dumps(schema)}\n')
            return self._processor(llguidance.LLMatcher.grammar_from_lark(lark), "tools")
        lark = f'start: <[{ids[0]}]> "\\n" call "\\n" <[{ids[1]}]>\ncall: %json {json.dumps(schema)}\n'
        return self._processor(llguidance.LLMatcher.grammar_from_lark(lark), "tool_choice")


def first_line(error: str) -> str:
    """llguidance's error without the parser state it appends (lines of internal counters)."""
    return (error or "").split("\n<state>", 1)[0].strip().split("\n", 1)[0][:300] or "no allowed token"


class GrammarProcessor:
    """(tokens, logits) → logits with every token the grammar forbids at -inf. `tokens` is the
    whole sequence so far (prompt + answer), as mlx-lm passes it; the first call marks where the
    answer starts, later calls feed the tokens sampled since into the matcher. A matcher that
    fails mid-answer ran into llguidance's limits on the request's schema (`param`): a 400."""

    def __init__(self, matcher, vocab_size: int, param: str = "response_format"):
        self.matcher, self.vocab_size, self.param = matcher, vocab_size, param
        self.seen = None

    def __call__(self, tokens, logits):
        n = int(tokens.shape[0])
        if self.seen is not None and n > self.seen:
            for t in np.asarray(tokens[self.seen:]).tolist():
                if not self.matcher.consume_token(int(t)):
                    raise APIError(400, f"'{self.param}' could not be followed: {first_line(self.matcher.get_error())}"
                                   "; send a simpler schema (one with a finite value)", param=self.param,
                                   code="grammar_error")
        self.seen = n
        bits = np.frombuffer(self.matcher.compute_bitmask(), np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[: logits.shape[-1]].astype(bool)
        return mx.where(mx.array(allowed), logits, mx.array(-np.inf, logits.dtype))
