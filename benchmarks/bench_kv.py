"""The quantized KV cache (kv_bits) and the prefix cache's disk tier, on a preset (random weights).

    python benchmarks/bench_kv.py --preset 2b --part decode      # bytes per token; decode tok/s at 4k and 16k
    python benchmarks/bench_kv.py --preset 2b --part agreement   # greedy agreement of 8 and 4 bits with float
    python benchmarks/bench_kv.py --preset 2b --part agent --kv 8    # the agent loop (one kind per run: none, 8, 4)
    python benchmarks/bench_kv.py --preset 2b --part restart     # a restarted agent's turn: disk tier vs cold

Each part is one process and writes benchmarks/results/kv-<preset>-<part>[-<kv>].json. Parts:

  decode     KV bytes per position (float, 8-bit, 4-bit; measured from the caches, and what a
             bfloat16 model's would be); prefill of a ~4k-token prompt with each cache kind
             (quantized_kv_start 0: quantized from the first chunk) and decode tok/s on it (32
             greedy tokens, the first one excluded); decode tok/s at a 16k context on caches
             filled with random keys and values (decode time does not depend on their values;
             a real 16k prefill does not fit in minutes on a small CPU).
  agreement  one ~1k-token prompt (a 1280x720 screenshot and a question): 256 greedy float tokens,
             then 8-bit and 4-bit caches (quantized from the start) fed the same tokens (teacher
             forcing): how often their next token is the float one, where the first difference
             falls (= the common prefix of free-running greedy answers), and the logits' rel_err.
  agent      ChatSession over --turns screenshots (640x360, a new one each turn, history kept,
             --agent-tokens per answer), quantized from --agent-start positions: seconds per turn,
             the KV bytes of the session's cache at the end.
  restart    the agent loop through an Engine with a prefix cache folder (--kv settings), then a
             new Engine on the same folder (a restarted server: nothing in memory) answering the
             next turn, against a cold Engine without the folder.

Random weights: the agreement figures are a regression floor for the implementation, not a claim
about a trained model's quality.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from harness.measure import machine_info  # noqa: E402
from harness.preset_folders import ROOT, build_preset  # noqa: E402
from harness.workloads import screenshot  # noqa: E402

import mlx.core as mx  # noqa: E402

import mlx_qwen3vl as M  # noqa: E402
from mlx_qwen3vl.generate import encode_prompt, generate_step  # noqa: E402
from mlx_qwen3vl.kv_settings import KVSettings, quantize_if_due, resolve  # noqa: E402

KINDS = {"none": None, "8": 8, "4": 4}


def log(*a):
    print("[bench_kv]", *a, file=sys.stderr, flush=True)


def text_of(processor, n):
    """A user text of about n tokens."""
    words = " ".join(f"Step {i}: the agent opened window {i % 17}, read its title and clicked OK." for i in range(n // 14 + 1))
    ids = processor.tokenizer(words)["input_ids"][:n]
    return processor.tokenizer.decode(ids)


def cache_bytes(cache):
    return sum(c.nbytes for c in cache)


def part_decode(model, processor, args):
    from mlx_qwen3vl.engine.core import kv_bytes_per_token
    from mlx_qwen3vl.engine.step import decode_step

    out = {"bytes_per_position": {}, "context_4k": {}, "context_16k": {}}
    t = model.config.text_config
    from mlx_qwen3vl.kv_settings import bytes_per_position

    for name, bits in KINDS.items():
        kind = None if bits is None else resolve(model, KVSettings(bits)).kind
        out["bytes_per_position"][name] = {
            "model_dtype": kv_bytes_per_token(model, kind),
            "bfloat16": bytes_per_position(t.num_hidden_layers, t.num_key_value_heads, t.head_dim, 2, kind)}
    inputs = encode_prompt(processor, messages=[{"role": "user", "content": [{"type": "text", "text": text_of(processor, 4096)}]}])
    n = int(inputs["input_ids"].shape[1])
    for name, bits in KINDS.items():
        kv = KVSettings(bits, 64, 0)
        cache = model.make_cache()
        times = []
        tic = time.perf_counter()
        for y, _ in generate_step(model, processor, inputs, cache=cache, max_tokens=args.decode_tokens, kv=kv):
            mx.eval(y)
            times.append(time.perf_counter())
        positions = cache[0].size()
        row = {"prompt_tokens": n, "prefill_s": times[0] - tic, "prefill_tps": n / (times[0] - tic),
               "decode_tps": (len(times) - 1) / (times[-1] - times[0]), "cache_bytes": cache_bytes(cache),
               "cache_positions": positions, "cache_kind": cache[0].kind}
        out["context_4k"][name] = row
        log("4k", name, json.dumps(row))
        del cache
        mx.clear_cache()
    # 16k: random keys and values (the decode step's time does not depend on them)
    L = args.long_context
    rng = np.random.default_rng(0)
    H, hd = t.num_key_value_heads, t.head_dim
    dtype = model.language_model.embed_tokens.weight.dtype  # the cache holds the model's dtype
    for name, bits in KINDS.items():
        cache = model.make_cache()
        for c in cache:
            k = mx.array(rng.standard_normal((1, H, L, hd), dtype=np.float32)).astype(dtype)
            c.update_and_fetch(k, k)
            mx.eval(c.keys, c.values)
        if bits is not None:
            quantize_if_due(cache, resolve(model, KVSettings(bits, 64, 0)))
            mx.eval([c.state for c in cache])
        y = mx.array([100])
        positions = mx.array([L])
        times = []
        for i in range(args.long_tokens):
            logits = decode_step(model, y, cache, positions)
            y = mx.argmax(logits, axis=-1)
            mx.eval(y)
            positions = positions + 1
            times.append(time.perf_counter())
        row = {"context": L, "decode_tps": (len(times) - 1) / (times[-1] - times[0]),
               "cache_bytes": cache_bytes(cache), "cache_kind": cache[0].kind}
        out["context_16k"][name] = row
        log("16k", name, json.dumps(row))
        del cache
        mx.clear_cache()
    return out


def part_agreement(model, processor, args):
    from mlx_qwen3vl.engine.prefill import prefill
    from mlx_qwen3vl.engine.step import decode_step

    image = screenshot(1280, 720, variant=1)
    messages = [{"role": "user", "content": [{"type": "image", "image": image},
                                             {"type": "text", "text": "Describe every window on this screen, then "
                                                                      "say which button to click to close the dialog."}]}]
    inputs = encode_prompt(processor, messages=messages)
    runs = {}
    for name, bits in KINDS.items():
        kv = resolve(model, KVSettings(bits, 64, 0))
        cache = model.make_cache()
        tic = time.perf_counter()
        logits, position = prefill(model, inputs, cache, kv=kv)
        rows = [np.array(logits.astype(mx.float32))[0]]
        feed = None if bits is None else runs["none"]["tokens"]
        tokens = []
        for i in range(args.agree_tokens):
            token = int(np.argmax(rows[-1])) if feed is None else feed[i]
            tokens.append(token)
            logits = decode_step(model, mx.array([token]), cache, position)
            quantize_if_due(cache, kv)
            position = position + 1
            rows.append(np.array(logits.astype(mx.float32))[0])
        runs[name] = {"tokens": tokens, "logits": np.stack(rows[:-1]), "seconds": time.perf_counter() - tic}
        log("agreement", name, f"{runs[name]['seconds']:.0f} s")
    base = runs["none"]
    out = {"prompt_tokens": int(inputs["input_ids"].shape[1]), "tokens": args.agree_tokens, "kinds": {}}
    for name in ("8", "4"):
        q = runs[name]["logits"]
        top = q.argmax(-1)
        same = top == np.array(base["tokens"])
        rel = np.abs(q - base["logits"]).max(-1) / np.abs(base["logits"]).max(-1)
        out["kinds"][name] = {"top1_agreement": float(same.mean()),
                              "first_difference": int(np.argmin(same)) if not same.all() else len(same),
                              "rel_err_max": float(rel.max()), "rel_err_median": float(np.median(rel)),
                              "seconds": runs[name]["seconds"]}
        log("agreement", name, json.dumps(out["kinds"][name]))
    out["float_seconds"] = base["seconds"]
    return out


def agent_turns(n):
    return [(screenshot(640, 360, variant=t + 1), f"Step {t + 1}: click the button that closes the dialog.")
            for t in range(n)]


def part_agent(model, processor, args):
    bits = KINDS[args.kv]
    session = M.ChatSession(model, processor, system="You are a GUI agent.", max_tokens=args.agent_tokens,
                            kv_bits=bits, quantized_kv_start=args.agent_start)
    turns = []
    tic = time.perf_counter()
    for image, text in agent_turns(args.turns):
        t0 = time.perf_counter()
        session.send(text, images=[image])
        turns.append({"seconds": time.perf_counter() - t0, "prompt_tokens": session.last.prompt_tokens,
                      "cached_tokens": session.last.cached_tokens, "kv_cache_bytes": session.last.kv_cache_bytes})
        log("agent", args.kv, json.dumps(turns[-1]))
    return {"kv": args.kv, "quantized_kv_start": args.agent_start, "total_s": time.perf_counter() - tic,
            "turns": turns, "cache_bytes_at_end": cache_bytes(session.prompt_cache.cache),
            "cache_positions_at_end": session.prompt_cache.cache[0].size(), "answers": [
                m["content"] for m in session.messages if m["role"] == "assistant"]}


def part_restart(model, processor, args):
    from mlx_qwen3vl.engine import Done, Engine, Request

    bits = KINDS[args.kv]
    kv = dict(kv_bits=bits, quantized_kv_start=args.agent_start)
    folder = Path(tempfile.mkdtemp(prefix="bench-kv-"))
    params = M.SamplingParams(max_tokens=args.agent_tokens)
    messages = [{"role": "system", "content": "You are a GUI agent."}]
    turns = agent_turns(args.turns + 1)

    def ask(engine, messages):
        tic = time.perf_counter()
        engine.add(Request(encode_prompt(processor, messages=messages), params))
        done = next(e for e in engine.run() if isinstance(e, Done))
        return done, time.perf_counter() - tic

    try:
        engine = Engine(model, processor, prefix_cache_bytes=8 << 30, prefix_cache_dir=folder, **kv)
        history = []
        for image, text in turns[:-1]:
            messages.append({"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]})
            done, seconds = ask(engine, messages)
            messages.append({"role": "assistant", "content": done.text})
            history.append({"seconds": seconds, "prompt_tokens": done.prompt_tokens, "cached_tokens": done.cached_tokens})
            log("restart: history", json.dumps(history[-1]))
        disk = engine.prefix.stats()["disk"]
        del engine
        mx.clear_cache()
        image, text = turns[-1]
        messages.append({"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]})
        out = {"kv": args.kv, "history": history, "disk": disk}
        for name, extra in (("from_disk", dict(prefix_cache_dir=folder)), ("cold", {})):
            tic = time.perf_counter()
            engine = Engine(model, processor, prefix_cache_bytes=8 << 30, **extra, **kv)
            start_s = time.perf_counter() - tic
            done, seconds = ask(engine, messages)
            out[name] = {"seconds": seconds, "engine_start_s": start_s, "prompt_tokens": done.prompt_tokens,
                         "cached_tokens": done.cached_tokens, "tokens": done.token_ids}
            log("restart", name, json.dumps({k: v for k, v in out[name].items() if k != "tokens"}))
            del engine
            mx.clear_cache()
        out["same_answer"] = out["from_disk"]["tokens"] == out["cold"]["tokens"]
        return out
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="2b")
    p.add_argument("--part", required=True, choices=["decode", "agreement", "agent", "restart"])
    p.add_argument("--kv", default="8", choices=list(KINDS), help="agent / restart: the cache kind")
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--long-context", type=int, default=16384)
    p.add_argument("--long-tokens", type=int, default=12)
    p.add_argument("--agree-tokens", type=int, default=256)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--agent-tokens", type=int, default=16)
    p.add_argument("--agent-start", type=int, default=0, help="quantized_kv_start of the agent parts")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    path = build_preset(args.preset, log=log)
    info = machine_info()
    tic = time.perf_counter()
    model, processor = M.load(str(path))
    load_s = time.perf_counter() - tic
    log(f"loaded {path.name} in {load_s:.0f} s; backend {model.backend.describe()}")
    part = {"decode": part_decode, "agreement": part_agreement, "agent": part_agent, "restart": part_restart}[args.part]
    result = {"preset": args.preset, "part": args.part, "machine": info, "load_s": load_s,
              "settings": {k: v for k, v in vars(args).items() if k != "out"}, "result": part(model, processor, args)}
    result["machine"]["load_average_end"] = list(os.getloadavg())
    name = f"kv-{args.preset}-{args.part}" + (f"-{args.kv}" if args.part in ("agent", "restart") else "")
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"{name}.json"
    out.write_text(json.dumps(result, indent=1, default=str))
    log("wrote", out)


if __name__ == "__main__":
    main()
