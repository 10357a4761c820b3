"""Speculative decoding's ceiling and costs on the 2B-shaped checkpoint (the 2b preset's random
weights, cut to --layers decoder layers like decode_gap.py; --layers 28 is the whole 2B).

1. Decode speed, greedy, EOS ignored, one ~960-token text prompt: plain decode against the oracle
   drafter (the plain run's own continuation, so every draft is kept: the mechanism's ceiling) at
   k = 2, 4, 8. Runs alternate variant by variant, --rounds times; best of the rounds each. The
   prompt's cache is reused between runs (PromptCache), so each run times its decode only.
2. The cost of one verify forward of k+1 tokens against one decode step, on the same cache
   (median of --reps each, interleaved).
3. Prompt lookup on an agent-like answer: a computer-use history (tool calls resent each turn)
   and the next answer's tokens; the drafts PromptLookup would propose at each step against that
   answer, so the acceptance a model producing that answer gets (no model needed: greedy
   verification keeps exactly the drafts that equal the answer's next tokens).

    python benchmarks/speculative.py [--layers 6] [--tokens 48] [--rounds 3] [--out FILE]
    MLX_QWEN3VL_CPU_KERNELS=mlx python benchmarks/speculative.py ...   # the plain MLX graph

Run it alone (it measures the machine); the JSON holds the load average beside every figure.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import mlx_qwen3vl as M  # noqa: E402  (loads the BLAS before mlx.core)
import mlx.core as mx  # noqa: E402

from harness.measure import machine_info  # noqa: E402
from mlx_qwen3vl.backend import backend_of  # noqa: E402
from mlx_qwen3vl.engine.speculative import Oracle, PromptLookup  # noqa: E402
from mlx_qwen3vl.engine.step import decode_step, verify_step  # noqa: E402
from mlx_qwen3vl.generate import encode_prompt  # noqa: E402
from mlx_qwen3vl.prompt_cache import PromptCache  # noqa: E402

KS = (2, 4, 8)


def log(*a):
    print("[speculative]", *a, file=sys.stderr, flush=True)


def load_avg():
    return os.getloadavg()[0]


def checkpoint(layers):
    from decode_gap import cut_preset
    from harness.preset_folders import build_preset

    return build_preset("2b", log=log) if layers >= 28 else cut_preset(layers)


def prompt_text():
    words = ("the quick brown fox jumps over the lazy dog while a search box waits at the top of the page and "
             "the user reads every menu item twice before choosing ").split()
    return " ".join(words[i % len(words)] for i in range(230))


def decode_rate(model, processor, prompt, cache, n, **drafting):
    """Tokens per second of the decode (first token to last), the run's draft counts."""
    times, last = [], None
    for last in M.stream_generate(model, processor, prompt=prompt, max_tokens=n, ignore_eos=True, prompt_cache=cache,
                                  **drafting):
        times.append(time.perf_counter())
    return (len(times) - 1) / (times[-1] - times[0]), last


def verify_costs(model, processor, prompt, reps):
    """Seconds of one decode step and of one verify forward of k+1 tokens, on the prompt's cache."""
    inputs = encode_prompt(processor, prompt)
    cache = model.make_cache()
    from mlx_qwen3vl.engine import prefill

    logits, position = prefill(model, inputs, cache)
    mx.eval(logits, [c.state for c in cache])
    y = mx.argmax(logits, axis=-1)
    n0 = cache[0].size()
    out = {"decode": []} | {f"verify{k + 1}": [] for k in KS}
    for rep in range(reps + 1):  # the first round warms up, uncounted
        for name in out:
            tic = time.perf_counter()
            if name == "decode":
                z = decode_step(model, y, cache, position)
            else:
                t = int(name[6:])
                z = verify_step(model, mx.broadcast_to(y[:, None], (1, t)), cache, position)
            mx.eval(z, [c.state for c in cache])
            if rep:
                out[name].append(time.perf_counter() - tic)
            for c in cache:
                c.trim_to(n0)
    return {name: statistics.median(v) for name, v in out.items()}


AGENT_TURN = ('<tool_call>\n{{"name": "computer_use", "arguments": {{"action": "{action}", "coordinate": '
              '[{x}, {y}]{extra}}}}}\n</tool_call>')


def agent_case(processor):
    """(history token ids, answer token ids): four earlier turns each answered with a computer-use
    tool call, the next answer a thought and another call (the shape UI agents' answers have)."""
    turns = [("left_click", 412, 88, ""), ("type", 412, 88, ', "text": "weather in Paris"'),
             ("left_click", 530, 212, ""), ("scroll", 640, 400, ', "pixels": -300')]
    messages = [{"role": "system", "content": "You are a GUI agent. Use the computer_use tool: one action per turn, "
                 "as <tool_call>{\"name\": \"computer_use\", \"arguments\": {...}}</tool_call>."},
                {"role": "user", "content": "Find tomorrow's weather in Paris and open the hourly view."}]
    for action, x, y, extra in turns:
        messages.append({"role": "assistant", "content": "I will " + action.replace("_", " ") + " next.\n"
                         + AGENT_TURN.format(action=action, x=x, y=y, extra=extra)})
        messages.append({"role": "user", "content": "The screen changed. Continue."})
    answer = ("The hourly tab is visible below the forecast. I will left click it next.\n"
              + AGENT_TURN.format(action="left_click", x=702, y=356, extra="") + "<|im_end|>")
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    tok = processor.tokenizer
    return tok.encode(text, add_special_tokens=False), tok.encode(answer, add_special_tokens=False)


def lookup_acceptance(history, answer, k, max_n=3):
    """Greedy verification of PromptLookup's drafts against `answer`: verify steps, drafts proposed
    and kept, tokens per verify step."""
    drafter = PromptLookup(max_n=max_n)
    pos, steps, proposed, kept = 1, 0, 0, 0  # the first token comes from the prefill
    while pos < len(answer):
        drafts = drafter.propose(history + answer[:pos], min(k, len(answer) - pos - 1))
        n = 0
        while n < len(drafts) and drafts[n] == answer[pos + n]:
            n += 1
        steps, proposed, kept = steps + 1, proposed + len(drafts), kept + n
        pos += n + 1
    return {"k": k, "answer_tokens": len(answer), "verify_steps": steps, "proposed": proposed, "accepted": kept,
            "acceptance": kept / max(proposed, 1), "tokens_per_step": (len(answer) - 1) / steps}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    path = checkpoint(args.layers)
    model, processor = M.load(path)
    backend = backend_of(model).describe()
    log("model", path, "backend", backend)
    prompt = prompt_text()
    ids = encode_prompt(processor, prompt)["input_ids"][0].tolist()
    cache = PromptCache(model.make_cache())
    plain = M.generate(model, processor, prompt=prompt, max_tokens=args.tokens, ignore_eos=True, prompt_cache=cache)
    oracle = Oracle(ids + plain.token_ids)
    variants = {"plain": {}} | {f"oracle k={k}": dict(drafter=oracle, num_draft_tokens=k) for k in KS}
    rates = {name: [] for name in variants}
    for r in range(args.rounds):
        for name, drafting in variants.items():
            load = load_avg()
            rate, last = decode_rate(model, processor, prompt, cache, args.tokens, **drafting)
            rates[name].append({"tokens_per_s": rate, "load": load, "proposed": last.draft_proposed,
                                "accepted": last.draft_accepted})
            log(f"round {r + 1} {name}: {rate:.2f} tokens/s (load {load:.2f})")
    best = {name: max(runs, key=lambda x: x["tokens_per_s"]) for name, runs in rates.items()}
    speedup = {name: best[name]["tokens_per_s"] / best["plain"]["tokens_per_s"] for name in best}
    load = load_avg()
    costs = verify_costs(model, processor, prompt, args.reps)
    cost_ratio = {name: costs[name] / costs["decode"] for name in costs}
    log("verify cost / decode step:", {k: round(v, 2) for k, v in cost_ratio.items()}, f"(load {load:.2f})")
    history, answer = agent_case(processor)
    lookup = [lookup_acceptance(history, answer, k) for k in KS]
    for row in lookup:
        log(f"prompt lookup k={row['k']}: {row['accepted']}/{row['proposed']} drafts kept, "
            f"{row['tokens_per_step']:.2f} tokens per verify step")
    for name in best:
        log(f"best {name}: {best[name]['tokens_per_s']:.2f} tokens/s, x{speedup[name]:.2f}")
    result = {"checkpoint": f"2b preset, {args.layers} decoder layers", "backend": backend,
              "tokens": args.tokens, "prompt_tokens": len(ids), "rounds": rates, "best": best, "speedup": speedup,
              "step_seconds": costs, "step_cost_vs_decode": cost_ratio, "step_load": load,
              "prompt_lookup_agent": lookup, "machine": machine_info()}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps({"speedup": speedup, "step_cost_vs_decode": cost_ratio}, indent=2))


if __name__ == "__main__":
    main()
