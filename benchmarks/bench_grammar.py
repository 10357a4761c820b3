"""Per-token cost of constrained decoding (the server's response_format / forced tool calls) with
the two maintained grammar libraries that need no torch: llguidance and outlines-core.

A synthetic vocabulary the size of Qwen3-VL's (151,936 tokens: every printable ASCII character plus
random 2-10 character strings) and a JSON schema of an agent action; per token: the mask for the
next token, applying it to (1, V) float32 logits in MLX, and advancing the matcher with a token
drawn from the allowed ones. xgrammar is not measured: it depends on torch, which this project
never needs at runtime.

    python benchmarks/bench_grammar.py
"""

import json
import string
import time

import mlx.core as mx
import numpy as np

V = 151_936
SCHEMA = {"type": "object", "properties": {
    "action": {"enum": ["click", "type", "scroll", "done"]},
    "x": {"type": "integer", "minimum": 0, "maximum": 1000}, "y": {"type": "integer", "minimum": 0, "maximum": 1000},
    "text": {"type": "string", "maxLength": 40}}, "required": ["action", "x", "y", "text"], "additionalProperties": False}


def vocabulary(seed=0):
    rng = np.random.default_rng(seed)
    alphabet = list(string.ascii_letters + string.digits + ' ":{},.-_')
    tokens, seen = list(string.printable[:95]), set(string.printable[:95])
    while len(tokens) < V - 1:
        t = "".join(rng.choice(alphabet, rng.integers(2, 11)))
        if t not in seen:
            seen.add(t)
            tokens.append(t)
    return tokens  # the EOS token is id V - 1


def run(name, mask_fn, advance_fn, steps=64, seed=0):
    rng = np.random.default_rng(seed)
    logits = mx.random.normal((1, V))
    mx.eval(logits)
    times, n = [], 0
    for _ in range(steps):
        tic = time.perf_counter()
        allowed = mask_fn()
        out = mx.where(mx.array(allowed), logits, mx.array(-np.inf, mx.float32))
        mx.eval(out)
        times.append(time.perf_counter() - tic)
        ids = np.flatnonzero(allowed)
        if len(ids) == 0 or (len(ids) == 1 and ids[0] == V - 1):
            break
        token = int(rng.choice(ids[ids != V - 1]))
        advance_fn(token)
        n += 1
    return {"library": name, "tokens": n, "median_ms": 1e3 * float(np.median(times)),
            "p90_ms": 1e3 * float(np.percentile(times, 90))}


def bench_llguidance(tokens):
    import llguidance

    class Tok:
        eos_token_id, bos_token_id = V - 1, None
        special_token_ids = [V - 1]

        def __init__(self):
            self.tokens = [t.encode() for t in tokens] + [b"<eos>"]

        def __call__(self, s):
            return [self.tokens.index(bytes([b])) for b in (s if isinstance(s, bytes) else s.encode())]

    tic = time.perf_counter()
    lltok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Tok()))
    tokenizer_s = time.perf_counter() - tic  # once per server
    tic = time.perf_counter()
    schema = {**SCHEMA, "x-guidance": {"whitespace_flexible": False}}
    matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(schema))
    setup = time.perf_counter() - tic
    assert not matcher.is_error(), matcher.get_error()

    def mask():
        bits = np.frombuffer(matcher.compute_bitmask(), np.uint8)
        return np.unpackbits(bits, bitorder="little")[:V].astype(bool)

    return {**run("llguidance", mask, matcher.consume_token), "setup_s": setup, "tokenizer_s": tokenizer_s}


def bench_outlines(tokens):
    import outlines_core as oc

    tic = time.perf_counter()
    vocab = oc.Vocabulary(V - 1, {t: [i] for i, t in enumerate(tokens)})
    tokenizer_s = time.perf_counter() - tic  # once per server
    tic = time.perf_counter()
    index = oc.Index(oc.json_schema.build_regex_from_schema(json.dumps(SCHEMA)), vocab)
    guide = oc.Guide(index)
    setup = time.perf_counter() - tic

    def mask():
        allowed = np.zeros(V, bool)
        allowed[guide.get_tokens()] = True
        return allowed

    return {**run("outlines-core", mask, guide.advance), "setup_s": setup, "tokenizer_s": tokenizer_s}


if __name__ == "__main__":
    tokens = vocabulary()
    for bench in (bench_llguidance, bench_outlines):
        try:
            r = bench(tokens)
            print(f"{r['library']:14s} vocabulary {r['tokenizer_s']:.2f}s (once)  schema {r['setup_s']:.2f}s (per request)  per token median {r['median_ms']:.2f} ms  "
                  f"p90 {r['p90_ms']:.2f} ms  over {r['tokens']} tokens")
        except ImportError as e:
            print(f"{bench.__name__}: not installed ({e.name})")
