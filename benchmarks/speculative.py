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
4. Each drafter's tokens/s and acceptance in the engine, on two workloads:
   - an agent loop of 3 turns, the history resent each turn (each earlier answer a thought and a
     computer-use <tool_call>), every answer forced by a logits processor (random weights give
     no real answer; the processor runs at every verified position, so the verify forward keeps
     exactly the drafts that equal the forced answer, as it would for a model that answered so):
     plain against prompt lookup at k = 2, 4, 8;
   - a JSON-schema answer (llguidance's mask, free fields chosen by the weights): plain against
     GrammarForced (the schema's forced tokens, k = 8) and prompt lookup (k = 4).
   Variants alternate, --rounds of them; best decode tokens/s of each (first token to last).

    python benchmarks/speculative.py [--layers 6] [--tokens 48] [--rounds 3] [--workloads] [--out FILE]
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
from mlx_qwen3vl.engine.speculative import GrammarForced, Oracle, PromptLookup  # noqa: E402
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


def force_answer(answer, prompt_tokens):
    """A logits processor that allows only `answer`'s next token (its last one past the end)."""
    ids = mx.array(answer)

    def processor(history, logits):
        n = min(history.shape[-1] - prompt_tokens, len(answer) - 1)
        return mx.where(mx.arange(logits.shape[-1]) == ids[n], logits, -float("inf"))

    return processor


def engine_run(model, processor, inputs, max_tokens, processors, drafter=None, k=0, ignore_eos=True):
    """One request through the engine: (tokens, seconds first token to last, proposed, accepted)."""
    from mlx_qwen3vl.engine import Done, Engine, Request, Token

    engine = Engine(model, processor, max_batch=1)
    engine.add(Request(inputs, M.SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos), processors=processors,
                       **({"drafter": drafter, "num_draft_tokens": k} if drafter else {})))
    tokens, times, done = [], [], None
    for e in engine.run():
        if isinstance(e, Token):
            tokens.append(e.token)
            times.append(time.perf_counter())
        elif isinstance(e, Done):
            done = e
    return tokens, times[-1] - times[0], done.draft_proposed, done.draft_accepted


AGENT_ANSWERS = [("I will type the city next.", "type", 412, 88, ', "text": "weather in Paris"'),
                 ("The results list is open. I will left click the first result.", "left_click", 530, 212, ""),
                 ("The hourly tab is visible below the forecast. I will left click it next.", "left_click", 702, 356, "")]


def agent_loop(model, processor, variants, rounds):
    """Per variant: decode tokens/s over the 3 turns' answers (tokens / decode seconds), drafts
    proposed and kept; each turn's prompt holds every earlier turn's answer."""
    base = [{"role": "system", "content": "You are a GUI agent. Use the computer_use tool: one action per turn, as "
             "<tool_call>{\"name\": \"computer_use\", \"arguments\": {...}}</tool_call>."},
            {"role": "user", "content": "Find tomorrow's weather in Paris and open the hourly view."},
            {"role": "assistant", "content": "I will left click the search box.\n"
             + AGENT_TURN.format(action="left_click", x=412, y=88, extra="")},
            {"role": "user", "content": "The screen changed. Continue."}]
    turns, messages = [], list(base)
    tok = processor.tokenizer
    for thought, action, x, y, extra in AGENT_ANSWERS:
        answer = thought + "\n" + AGENT_TURN.format(action=action, x=x, y=y, extra=extra)
        inputs = encode_prompt(processor, messages=messages)
        turns.append((inputs, tok.encode(answer + "<|im_end|>", add_special_tokens=False)))
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "The screen changed. Continue."}]
    return _interleave(model, processor, variants, rounds, turns)


def _interleave(model, processor, variants, rounds, turns, make_processors=None):
    """turns: [(inputs, forced answer ids or None, max tokens)]; variants: {name: (drafter factory or
    None, k)}. Best round of each variant."""
    runs = {name: [] for name in variants}
    for r in range(rounds):
        for name, (make, k) in variants.items():
            load, n, secs, proposed, accepted, outputs = load_avg(), 0, 0.0, 0, 0, []
            for turn in turns:
                inputs, answer = turn[0], turn[1]
                prompt_tokens = inputs["input_ids"].shape[-1]
                procs = make_processors() if make_processors else [force_answer(answer, prompt_tokens)]
                max_tokens = turn[2] if len(turn) > 2 else len(answer)
                tokens, sec, p, a = engine_run(model, processor, inputs, max_tokens, procs,
                                               make(procs) if make else None, k, ignore_eos=make_processors is None)
                n, secs, proposed, accepted = n + len(tokens) - 1, secs + sec, proposed + p, accepted + a
                outputs.append(tokens)
            runs[name].append(dict(tokens_per_s=n / secs, tokens=n, proposed=proposed, accepted=accepted,
                                   acceptance=accepted / proposed if proposed else None, load=load, outputs=outputs))
            log(f"round {r + 1} {name}: {n / secs:.2f} tokens/s, {accepted}/{proposed} drafts kept (load {load:.2f})")
    best = {name: dict(max(v, key=lambda x: x["tokens_per_s"])) for name, v in runs.items()}
    plain = best["plain"]
    for b in best.values():
        b["speedup"] = b["tokens_per_s"] / plain["tokens_per_s"]
        b["same_tokens_as_plain"] = b["outputs"] == plain["outputs"]
    for b in best.values():
        del b["outputs"]
    return best


def json_schema_answer(model, processor, variants, rounds):
    from mlx_qwen3vl.server.grammar import GrammarFactory

    tok = processor.tokenizer
    grammars = GrammarFactory(tok, model.config.text_config.vocab_size, tok.eos_token_id)
    schema = {"type": "object", "properties": {
        "action": {"enum": ["left_click", "double_click", "type", "scroll"]},
        "target": {"type": "string", "maxLength": 24},
        "coordinate": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 1920},
                       "minItems": 2, "maxItems": 2},
        "reason": {"type": "string", "maxLength": 40}},
        "required": ["action", "target", "coordinate", "reason"], "additionalProperties": False}
    messages = [{"role": "user", "content": "Answer with the next action as JSON with the keys action, target, "
                 "coordinate and reason: open the hourly forecast."}]
    inputs = encode_prompt(processor, messages=messages)
    return _interleave(model, processor, variants, rounds, [(inputs, None, 96)],
                       make_processors=lambda: [grammars.json_schema(schema)])


def oracle_and_costs(model, processor, args):
    """1.-3.: the oracle's decode speed at each k, the verify costs, prompt lookup's acceptance."""
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
    return {"tokens": args.tokens, "prompt_tokens": len(ids), "rounds": rates, "best": best, "speedup": speedup,
            "step_seconds": costs, "step_cost_vs_decode": cost_ratio, "step_load": load, "prompt_lookup_agent": lookup}


def workloads(model, processor, rounds):
    """4.: each drafter on the agent loop and on the JSON-schema answer."""
    lookup3 = lambda procs: PromptLookup(max_n=3)  # noqa: E731
    agent = agent_loop(model, processor, {"plain": (None, 0)} | {f"prompt lookup k={k}": (lookup3, k) for k in KS},
                       rounds)
    answer = json_schema_answer(model, processor, {"plain": (None, 0),
                                                   "grammar forced k=8": (lambda procs: GrammarForced(procs[0]), 8),
                                                   "prompt lookup k=4": (lookup3, 4)}, rounds)
    for title, res in (("agent loop", agent), ("json schema", answer)):
        for name, b in res.items():
            log(f"{title} best {name}: {b['tokens_per_s']:.2f} tokens/s (x{b['speedup']:.2f}), "
                f"{b['accepted']}/{b['proposed']} drafts kept, same tokens as plain: {b['same_tokens_as_plain']}")
    return {"agent_loop": agent, "json_schema": answer}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=None)
    p.add_argument("--workloads", action="store_true", help="also the agent loop and the JSON-schema answer (4.)")
    p.add_argument("--only-workloads", action="store_true", help="only those (not 1.-3.)")
    args = p.parse_args()
    path = checkpoint(args.layers)
    model, processor = M.load(path)
    backend = backend_of(model).describe()
    log("model", path, "backend", backend)
    result = {"checkpoint": f"2b preset, {args.layers} decoder layers", "backend": backend}
    if not args.only_workloads:
        result |= oracle_and_costs(model, processor, args)
    if args.workloads or args.only_workloads:
        result |= workloads(model, processor, args.rounds)
    result["machine"] = machine_info()
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: result[k] for k in ("speedup", "step_cost_vs_decode") if k in result}, indent=2))


if __name__ == "__main__":
    main()
