"""The worker of our engine: load with the chosen backend, time vision, TTFT and decode per
workload, and the agent loop with and without KV-cache reuse."""

import time

import numpy as np

from .measure import engine_info, fresh_mlx_measurement, log, measure_bandwidth, rss_peak_gb, time_workload
from .workloads import AGENT_SYSTEM, WARMUP, agent_turns


def worker_ours(args, spec):
    from mlx_qwen3vl import blas as _blas  # before mlx.core: it loads the optimized BLAS

    from mlx_qwen3vl import Processor
    from mlx_qwen3vl.generate import generate_tokens
    from mlx_qwen3vl.weights import load_model

    info = engine_info("mlx_qwen3vl")
    info["blas"] = _blas.describe()
    bw = measure_bandwidth(spec.get("bandwidth_gb", 1.0))
    tic = time.perf_counter()
    model = load_model(spec["model"], dtype=spec.get("dtype"), backend=spec.get("backend"))
    processor = Processor.from_pretrained(spec["model"])  # the preset folder's tokenizer (the engine detokenizes)
    load_s = time.perf_counter() - tic
    dtype = model.language_model.norm.weight.dtype
    info.update(dtype=str(dtype).replace("mlx.core.", ""), load_s=load_s, backend=model.backend.describe(), **bw)
    log(f"[ours] backend: {info['backend']}")
    results = {}
    # Vision is timed on its own: the token loop evaluates the features and reports their time.
    vision_time = []
    data = np.load(spec["inputs"])
    warm = {k.split("/", 1)[1]: data[k] for k in data.files if k.startswith(WARMUP + "/")}
    for y in generate_tokens(model, processor, warm, max_tokens=4):
        y.item()
    for name in spec["workloads"]:
        if name == "agent":
            continue
        inputs = {k.split("/", 1)[1]: data[k] for k in data.files if k.startswith(name + "/")}
        for _ in range(spec.get("warmup", 0)):
            for y in generate_tokens(model, processor, inputs, max_tokens=2):
                y.item()

        def tokens(inputs=inputs):
            for y in generate_tokens(model, processor, inputs, max_tokens=spec["decode_tokens"],
                                     on_vision_done=vision_time.append,
                                     prefill_step_size=spec.get("prefill_step_size", 2048)):
                yield y.item()

        results[name] = time_workload("ours", name, inputs["input_ids"].shape[1], vision_time, tokens, spec)
    if "agent" in spec["workloads"]:
        results["agent"] = agent_loop(model, spec)
    return {"info": info, "results": results}


def agent_loop(model, spec):
    """5 turns of (new 1280×720 screenshot + short instruction), history kept: ChatSession (the
    KV cache of earlier turns reused) vs a fresh generate over the whole conversation each turn.
    EOS is ignored so every turn answers with exactly `agent_tokens` tokens in both variants."""
    import mlx.core as mx

    from mlx_qwen3vl import ChatSession, Processor, generate

    processor = Processor.from_pretrained(spec["model"])
    script = agent_turns(spec)
    turns = len(script)
    kw = dict(max_tokens=spec.get("agent_tokens", 8), temperature=0.0, ignore_eos=True)
    out = {}
    for variant in spec.get("agent_variants", ["reuse", "no_reuse"]):
        fresh_mlx_measurement()
        per_turn, answers, prompt_tokens, cached = [], [], [], []
        session = ChatSession(model, processor, system=AGENT_SYSTEM, **kw)
        messages = [{"role": "system", "content": AGENT_SYSTEM}]
        tic = time.perf_counter()
        for t in range(turns):
            t0 = time.perf_counter()
            shot, ask = script[t]
            if variant == "reuse":
                answer = session.send(ask, images=[shot])
                last = session.last
                prompt_tokens.append(last.prompt_tokens)
                cached.append(last.cached_tokens)
            else:
                messages.append({"role": "user", "content": [{"type": "image", "image": shot},
                                                             {"type": "text", "text": ask}]})
                r = generate(model, processor, messages=messages, **kw)
                answer = r.text
                messages.append({"role": "assistant", "content": answer})
                prompt_tokens.append(r.prompt_tokens)
                cached.append(0)
            answers.append(answer)
            per_turn.append(time.perf_counter() - t0)
            log(f"[ours] agent {variant} turn {t + 1}: {per_turn[-1]:.1f} s, prompt {prompt_tokens[-1]} "
                f"({cached[-1]} cached)")
        out[variant] = dict(total_s=time.perf_counter() - tic, turn_s=per_turn, prompt_tokens=prompt_tokens,
                            cached_tokens=cached, peak_memory_gb=mx.get_peak_memory() / 1e9,
                            peak_rss_gb=rss_peak_gb(), answers=answers)
    out.update(turns=turns, tokens_per_turn=kw["max_tokens"])
    if "reuse" in out and "no_reuse" in out:
        out["speedup"] = out["no_reuse"]["total_s"] / out["reuse"]["total_s"]
        out["same_answers"] = out["reuse"]["answers"] == out["no_reuse"]["answers"]
        log(f"[ours] agent: reuse {out['reuse']['total_s']:.1f} s, no reuse {out['no_reuse']['total_s']:.1f} s "
            f"({out['speedup']:.2f}x)")
    return out
