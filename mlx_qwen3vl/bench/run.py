"""Our engine's side of the benchmark, through the public API only (`load`, `stream_generate`,
`ChatSession`, the streamed responses' fields, `mx.get_peak_memory()`).

Every single-turn workload is timed from ready inputs (preprocessed once, the same inputs every
engine gets; the preprocessing is timed apart) to its tokens, greedy, EOS ignored so each run
decodes exactly the tokens asked for:

  ttft_s       ready inputs -> first token (vision tower, prompt prefill, first sample)
  prompt_tps   prompt_tokens / ttft_s
  decode_s     first token -> last token;  decode_tps = (decode_tokens - 1) / decode_s
  total_s      ttft_s + decode_s
  peak_memory_gb  MLX's peak allocation during the run (weights included; stream_generate resets it)

With repeats, the run of median total_s is reported and every run's total_s is kept. The agent
loop is ChatSession turns as a user runs them (each turn's new screenshot preprocessed inside).

With --speculative, one more workload: the same greedy answer to an agent conversation whose
earlier tool calls are resent (inputs.tool_history_messages), decoded plain and with each drafter
(prompt lookup; a draft model when given), interleaved run by run, best decode tokens/s of each,
with the drafts proposed and kept and whether the tokens equal the plain run's.
"""

import time

from .inputs import AGENT_SYSTEM, agent_turns, screenshot_messages, text_messages, tool_history_messages
from .machine import fresh_mlx_measurement, rss_peak_gb


def encode(processor, messages, max_pixels=None):
    """(processor outputs, seconds) of one conversation."""
    tic = time.perf_counter()
    inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, max_pixels=max_pixels)
    return inputs, time.perf_counter() - tic


def timed_run(model, processor, inputs, decode_tokens):
    """One greedy run of exactly `decode_tokens` tokens from ready inputs; its figures."""
    import mlx.core as mx

    from .. import stream_generate

    fresh_mlx_measurement()
    times, last = [], None
    tic = time.perf_counter()
    for last in stream_generate(model, processor, inputs=inputs, max_tokens=decode_tokens, temperature=0.0,
                                ignore_eos=True):
        times.append(time.perf_counter())
    peak = mx.get_peak_memory() / 1e9
    ttft, decode_s = times[0] - tic, times[-1] - times[0]
    n = len(times)
    return dict(prompt_tokens=int(last.prompt_tokens), ttft_s=ttft, prompt_tps=last.prompt_tokens / ttft,
                decode_tokens=n, decode_s=decode_s, decode_tps=(n - 1) / decode_s if n > 1 and decode_s > 0 else None,
                total_s=ttft + decode_s, peak_memory_gb=peak, peak_rss_gb=rss_peak_gb(),
                engine_reported=dict(prompt_tps=last.prompt_tps, generation_tps=last.generation_tps,
                                     generation_tokens=last.generation_tokens, peak_memory_gb=last.peak_memory))


def speculative_run(model, processor, inputs, decode_tokens, **drafting):
    """One greedy run with `drafting` (stream_generate's draft arguments; none: plain): decode
    tokens/s, the drafts proposed and kept, the tokens."""
    from .. import stream_generate

    times, tokens, last = [], [], None
    for last in stream_generate(model, processor, inputs=inputs, max_tokens=decode_tokens, temperature=0.0,
                                ignore_eos=True, **drafting):
        times.append(time.perf_counter())
        tokens.append(int(last.token))
    decode_s = times[-1] - times[0]
    return dict(decode_tps=(len(times) - 1) / decode_s if len(times) > 1 and decode_s > 0 else None,
                proposed=int(last.draft_proposed), accepted=int(last.draft_accepted), tokens=tokens)


def speculative(model, processor, settings, draft_model=None, log=None):
    """Plain decode against each drafter on tool_history_messages (see the module's docstring)."""
    spec, log = settings["speculative"], log or (lambda msg: None)
    inputs, _ = encode(processor, tool_history_messages(), settings["max_pixels"])
    k = spec["num_draft_tokens"]
    variants = {"plain": {}, "prompt_lookup": dict(prompt_lookup=spec["prompt_lookup"], num_draft_tokens=k)}
    if draft_model is not None:
        variants["draft_model"] = dict(draft_model=draft_model, num_draft_tokens=k)
    speculative_run(model, processor, inputs, 4, **variants["prompt_lookup"])  # warm-up of the verify shapes
    runs = {name: [] for name in variants}
    for _ in range(settings["repeats"]):  # interleaved, so a slow moment of the machine hits every variant
        for name, drafting in variants.items():
            runs[name].append(speculative_run(model, processor, inputs, settings["decode_tokens"], **drafting))
    best = {name: max(r, key=lambda x: x["decode_tps"] or 0) for name, r in runs.items()}
    plain = best["plain"]
    out = dict(prompt_tokens=int(inputs["input_ids"].shape[-1]), decode_tokens=len(plain["tokens"]),
               num_draft_tokens=k, prompt_lookup=spec["prompt_lookup"], repeats=settings["repeats"], drafters={})
    for name, r in best.items():
        row = dict(decode_tps=r["decode_tps"], proposed=r["proposed"], accepted=r["accepted"],
                   acceptance=r["accepted"] / r["proposed"] if r["proposed"] else None,
                   speedup=r["decode_tps"] / plain["decode_tps"] if r["decode_tps"] and plain["decode_tps"] else None,
                   same_tokens=r["tokens"] == plain["tokens"])
        out["drafters"][name] = row
        log(f"[bench] speculative, {name}: decode {row['decode_tps'] or 0:.1f} tok/s, "
            f"{row['accepted']}/{row['proposed']} drafts kept")
    return out


def measure(model, processor, inputs, decode_tokens, repeats=1, **extra):
    runs = [timed_run(model, processor, inputs, decode_tokens) for _ in range(repeats)]
    median = sorted(runs, key=lambda r: r["total_s"])[(len(runs) - 1) // 2]
    return dict(median, repeats=repeats, runs_total_s=[r["total_s"] for r in runs], **extra)


def agent_loop(model, processor, turns, tokens_per_turn, max_pixels=None, size=(1280, 720)):
    """`turns` turns of (a new screenshot + an instruction) in one ChatSession: the KV cache of the
    earlier turns reused. Per turn: seconds, time to first token, prompt and reused tokens, peak."""
    from .. import ChatSession

    script = agent_turns(turns, *size)
    fresh_mlx_measurement()
    session = ChatSession(model, processor, system=AGENT_SYSTEM, max_pixels=max_pixels, max_tokens=tokens_per_turn,
                          temperature=0.0, ignore_eos=True)
    out = dict(turns=turns, tokens_per_turn=tokens_per_turn, image_size=list(size), turn_s=[], ttft_s=[],
               prompt_tokens=[], cached_tokens=[], generated_tokens=[], peak_memory_gb=[])
    tic = time.perf_counter()
    for shot, ask in script:
        t0, first, n = time.perf_counter(), None, 0
        for _ in session.stream(ask, images=[shot]):
            first = first or time.perf_counter()
            n += 1
        out["turn_s"].append(time.perf_counter() - t0)
        out["ttft_s"].append(first - t0)
        last = session.last
        out["prompt_tokens"].append(int(last.prompt_tokens))
        out["cached_tokens"].append(int(last.cached_tokens))
        out["generated_tokens"].append(n)
        out["peak_memory_gb"].append(last.peak_memory)  # stream_generate restarts MLX's peak each turn
    out["total_s"] = time.perf_counter() - tic
    out["peak_rss_gb"] = rss_peak_gb()
    return out


def warm_up(model, processor, max_pixels=None):
    """Untimed: a short text run and a small screenshot, so one-time costs (kernel compilation,
    first allocations) land on no workload."""
    from .. import stream_generate

    for messages in (text_messages(processor, 32), screenshot_messages(320, 200)):
        inputs, _ = encode(processor, messages, max_pixels)
        for _ in stream_generate(model, processor, inputs=inputs, max_tokens=2, temperature=0.0, ignore_eos=True):
            pass


def prepare(processor, settings) -> dict:
    """{workload: (processor outputs, preprocessing seconds, image size)}: the text prompt and each
    screenshot, encoded once; every engine gets these same inputs."""
    mp = settings["max_pixels"]
    inputs, pre = encode(processor, text_messages(processor, settings["prompt_tokens"]), mp)
    prepared = {"text": (inputs, pre, None)}
    for w, h in settings["screenshots"]:
        inputs, pre = encode(processor, screenshot_messages(w, h), mp)
        prepared[f"screenshot_{w}x{h}"] = (inputs, pre, [w, h])
    return prepared


def run_ours(model, processor, prepared, settings, log=None, draft_model=None):
    """Every workload on our engine, then the agent loop (and the speculative one): {workload: figures}."""
    log = log or (lambda msg: None)
    warm_up(model, processor, settings["max_pixels"])
    results = {}
    for name, (inputs, pre, size) in prepared.items():
        r = results[name] = measure(model, processor, inputs, settings["decode_tokens"], settings["repeats"],
                                    preprocess_s=pre, image_size=size)
        log(f"[bench] {name}: {r['prompt_tokens']} prompt tokens, first token {r['ttft_s']:.2f} s, "
            f"decode {r['decode_tps'] or 0:.1f} tok/s")
    if settings["agent_turns"]:
        a = results["agent"] = agent_loop(model, processor, settings["agent_turns"], settings["agent_tokens"],
                                          settings["max_pixels"])
        log(f"[bench] agent: {a['total_s']:.2f} s for {a['turns']} turns")
    if settings.get("speculative"):
        results["speculative"] = speculative(model, processor, settings, draft_model, log)
    return results
