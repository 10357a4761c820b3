"""The plain MLX graph's decode against mlx-vlm's, like for like: a 2B-shaped model cut to 6 decoder
layers and 6 vision blocks (the 2B preset's weights, float32 in both, MKL serving MLX's matmuls in
both), one ~256-token text prompt, greedy, EOS ignored. Runs alternate engine by engine, best of
--pairs (decode tokens/s, and the time from ready inputs to the first token: the prefill); then
each engine's decode step is split into the model's forward and what its loop adds
(log-softmax, sampling, host work), the forward timed alone over the same cache.

    python benchmarks/decode_gap.py [--pairs 3] [--tokens 64] [--out benchmarks/results/decode-gap-2b6.json]
        [--model FOLDER]   (another checkpoint, e.g. vision_memory.py's h-mid: the same shapes, no 2B preset to build)

Needs mlx-vlm (e.g. a virtualenv with `pip install mlx-vlm` and this package); ~6 GB.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import mlx_qwen3vl as M  # noqa: E402  (loads the BLAS before mlx.core)
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from harness.measure import machine_info  # noqa: E402
from harness.preset_folders import MODELS, build_preset  # noqa: E402
from mlx_qwen3vl.bench import engine_mlx_vlm as vlm  # noqa: E402
from mlx_qwen3vl.generate import encode_prompt  # noqa: E402

LAYERS = 6


def log(*a):
    print("[decode_gap]", *a, file=sys.stderr, flush=True)


def cut_preset(layers=LAYERS):
    """The 2B preset's folder with its first `layers` decoder layers and vision blocks."""
    src = build_preset("2b", log=log)
    out = MODELS / f"qwen3vl-2b-{layers}x{layers}-random"
    if (out / "config.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    cfg["text_config"]["num_hidden_layers"] = layers
    cfg["vision_config"]["depth"] = layers
    cfg["vision_config"]["deepstack_visual_indexes"] = [1, 3, 5]
    weights = {}
    for f in sorted(src.glob("*.safetensors")):
        for k, v in mx.load(str(f)).items():
            parts = k.split(".")
            if "layers" in parts or "blocks" in parts:
                i = parts.index("layers" if "layers" in parts else "blocks")
                if int(parts[i + 1]) >= layers:
                    continue
            if "deepstack_merger_list" in parts and int(parts[parts.index("deepstack_merger_list") + 1]) >= 3:
                continue
            weights[k] = v
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            (out / f.name).write_bytes(f.read_bytes())
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def per_token(times):
    return (len(times) - 1) / (times[-1] - times[0])


def ours_run(model, processor, inputs, n):
    """(decode tokens/s, seconds from ready inputs to the first token)."""
    tic, times = time.perf_counter(), []
    for _ in M.stream_generate(model, processor, inputs=inputs, max_tokens=n, ignore_eos=True, temperature=0.0):
        times.append(time.perf_counter())
    return per_token(times), times[0] - tic


def vlm_run(model, processor, inputs, n):
    tic = time.perf_counter()
    times = [time.perf_counter() for _ in vlm.tokens(model, processor, inputs, n)]
    return per_token(times), times[0] - tic


def forward_alone(step, n):
    """Seconds per decode forward, `step()` returning the logits to evaluate."""
    mx.eval(step())
    tic = time.perf_counter()
    for _ in range(n):
        mx.eval(step())
    return (time.perf_counter() - tic) / n


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--model", default=None, help="a checkpoint folder instead of the cut 2B preset")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "decode-gap-2b6.json"))
    args = p.parse_args()
    folder = Path(args.model) if args.model else cut_preset()
    ours, processor = M.load(str(folder), dtype="float32", backend="mlx")
    theirs, vlm_processor = vlm.load_ignoring_eos(folder)
    theirs.set_dtype(mx.float32)
    mx.eval(theirs.parameters())
    words = " ".join(f"Step {i}: the agent opened window {i}, read its title and clicked OK." for i in range(20))
    prompt = processor.tokenizer.decode(processor.tokenizer(words)["input_ids"][:250])
    inputs = {k: np.asarray(v) for k, v in encode_prompt(processor, prompt=prompt).items()}
    log(f"prompt {inputs['input_ids'].shape[1]} tokens; {ours.backend.describe()}")
    ours_run(ours, processor, inputs, 4), vlm_run(theirs, vlm_processor, inputs, 4)  # warm both
    rows = []
    for i in range(args.pairs):
        order = ["ours", "mlx-vlm"] if i % 2 == 0 else ["mlx-vlm", "ours"]
        pair = {}
        for name in order:
            pair[name], pair[f"{name} ttft_s"] = (ours_run(ours, processor, inputs, args.tokens) if name == "ours"
                                                  else vlm_run(theirs, vlm_processor, inputs, args.tokens))
        pair["load"] = os.getloadavg()[0]
        rows.append(pair)
        log(json.dumps(pair))
    # The forward alone, each engine's own decoder over a cache holding the prompt.
    from mlx_qwen3vl.engine.step import decode_step
    from mlx_qwen3vl.generate import prefill
    from mlx_vlm.models.cache import make_prompt_cache

    cache = ours.make_cache()
    _, positions = prefill(ours, {k: mx.array(v) for k, v in inputs.items()}, cache)
    token = mx.array([100])
    forward = {}

    def ours_step():
        logits = decode_step(ours, token, cache, positions)
        for c in cache:
            c.trim(1)
        return logits

    vcache = make_prompt_cache(theirs.language_model)
    mx.eval(theirs.language_model(mx.array(inputs["input_ids"]), cache=vcache).logits)
    vtoken = mx.array([[100]])

    def vlm_step():
        logits = theirs.language_model(vtoken, cache=vcache).logits
        for c in vcache:
            c.trim(1)
        return logits

    for i in range(args.pairs):
        for name, step in (("ours", ours_step), ("mlx-vlm", vlm_step))[:: 1 if i % 2 == 0 else -1]:
            forward.setdefault(name, []).append(forward_alone(step, args.tokens))
    best = {name: max(r[name] for r in rows) for name in ("ours", "mlx-vlm")}
    ttft = {name: min(r[f"{name} ttft_s"] for r in rows) for name in ("ours", "mlx-vlm")}
    fwd = {name: min(v) for name, v in forward.items()}
    result = {"model": folder.name, "prompt_tokens": int(inputs["input_ids"].shape[1]), "tokens": args.tokens,
              "pairs": rows, "best_decode_tps": best, "ratio_ours_over_mlx_vlm": best["ours"] / best["mlx-vlm"],
              "best_ttft_s": ttft, "prefill_ratio_ours_over_mlx_vlm": ttft["mlx-vlm"] / ttft["ours"],
              "forward_alone_s": fwd, "loop_overhead_s": {n: 1 / best[n] - fwd[n] for n in fwd},
              "machine": machine_info()}
    log(json.dumps({k: result[k] for k in ("best_decode_tps", "ratio_ours_over_mlx_vlm", "best_ttft_s",
                                           "prefill_ratio_ours_over_mlx_vlm", "forward_alone_s",
                                           "loop_overhead_s")}))
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
