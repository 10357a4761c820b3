"""mlx-vlm on the same inputs, in its own process (its own peak memory, nothing of ours loaded):

    python -m mlx_qwen3vl.bench.engine_mlx_vlm SPEC.json OUT.json

The inputs are the ones our engine gets, preprocessed once by our processor (token ids, pixels,
grids in an .npz): mlx-vlm's `stream_generate` takes them as they are, greedy, its EOS ignored,
timed the same way (bench/run.py). Its agent loop is the one its users can run: every turn adds a
screenshot, which its prompt cache cannot reuse, so each turn is a fresh generate over the whole
conversation (the prompt built by our processor, the answer decoded from its tokens).
"""

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from .machine import fresh_mlx_measurement, rss_peak_gb

MODEL_KEYS = ("input_ids", "pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")


def missing():
    """None when mlx-vlm can be imported here, else the line to print."""
    if importlib.util.find_spec("mlx_vlm") is None:
        return "mlx-vlm is not installed in this environment (pip install mlx-vlm); --compare mlx-vlm skipped"
    return None


def version():
    import importlib.metadata as md

    try:
        return md.version("mlx-vlm")
    except md.PackageNotFoundError:
        return None


def load_ignoring_eos(path):
    """mlx-vlm's model and processor, its tokenizer told that no token stops (fixed-length runs)."""
    from mlx_vlm import load

    model, processor = load(str(path))
    tok = processor.tokenizer if hasattr(processor, "tokenizer") else processor
    tok.stopping_criteria = lambda token: False
    return model, processor


def tokens(model, processor, inputs, max_tokens):
    """mlx-vlm's tokens for ready inputs, one per decoded token (its last piece repeats one)."""
    import mlx.core as mx
    from mlx_vlm import stream_generate

    kwargs = {k: mx.array(np.asarray(inputs[k])) for k in MODEL_KEYS if k in inputs}
    seen = 0
    for r in stream_generate(model, processor, "", max_tokens=max_tokens, temperature=0.0, **kwargs):
        if r.token is not None and r.generation_tokens > seen:
            seen = r.generation_tokens
            yield int(r.token)


def timed_run(model, processor, inputs, decode_tokens):
    import mlx.core as mx

    fresh_mlx_measurement()
    times = []
    tic = time.perf_counter()
    for _ in tokens(model, processor, inputs, decode_tokens):
        times.append(time.perf_counter())
    n_prompt = int(np.asarray(inputs["input_ids"]).shape[1])
    ttft, decode_s = times[0] - tic, times[-1] - times[0]
    return dict(prompt_tokens=n_prompt, ttft_s=ttft, prompt_tps=n_prompt / ttft, decode_tokens=len(times),
                decode_s=decode_s, decode_tps=(len(times) - 1) / decode_s if len(times) > 1 and decode_s > 0 else None,
                total_s=ttft + decode_s, peak_memory_gb=mx.get_peak_memory() / 1e9, peak_rss_gb=rss_peak_gb())


def agent_loop(model, vlm_processor, processor, script, tokens_per_turn, system, max_pixels=None):
    """The agent loop as mlx-vlm's users run it: a fresh generate over the whole conversation each turn."""
    import mlx.core as mx

    fresh_mlx_measurement()
    messages = [{"role": "system", "content": system}]
    out = dict(turns=len(script), tokens_per_turn=tokens_per_turn, turn_s=[], ttft_s=[], prompt_tokens=[],
               cached_tokens=[], generated_tokens=[], peak_memory_gb=[], answers=[])
    tic = time.perf_counter()
    for shot, ask in script:
        t0, first, ids = time.perf_counter(), None, []
        messages.append({"role": "user", "content": [{"type": "image", "image": shot}, {"type": "text", "text": ask}]})
        inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, max_pixels=max_pixels)
        mx.reset_peak_memory()
        for t in tokens(model, vlm_processor, inputs, tokens_per_turn):
            first = first or time.perf_counter()
            ids.append(t)
        answer = processor.tokenizer.decode(ids)
        messages.append({"role": "assistant", "content": answer})
        out["turn_s"].append(time.perf_counter() - t0)
        out["ttft_s"].append(first - t0)
        out["prompt_tokens"].append(int(np.asarray(inputs["input_ids"]).shape[1]))
        out["cached_tokens"].append(0)
        out["generated_tokens"].append(len(ids))
        out["peak_memory_gb"].append(mx.get_peak_memory() / 1e9)
        out["answers"].append(answer)
    out["total_s"] = time.perf_counter() - tic
    out["peak_rss_gb"] = rss_peak_gb()
    return out


def worker(spec) -> dict:
    """Every workload of `spec` (written by run_compare) on mlx-vlm."""
    from mlx_qwen3vl import Processor

    from .inputs import AGENT_SYSTEM, agent_turns

    tic = time.perf_counter()
    model, vlm_processor = load_ignoring_eos(spec["model"])
    info = dict(engine="mlx-vlm", version=version(), load_s=time.perf_counter() - tic,
                dtype=str(model.language_model.model.norm.weight.dtype).replace("mlx.core.", ""))
    data = np.load(spec["inputs"])
    results = {}
    for name in spec["workloads"]:
        inputs = {k.split("/", 1)[1]: data[k] for k in data.files if k.startswith(name + "/")}
        for _ in tokens(model, vlm_processor, inputs, 2):  # untimed: the first run of a shape compiles
            pass
        runs = [timed_run(model, vlm_processor, inputs, spec["decode_tokens"]) for _ in range(spec["repeats"])]
        median = sorted(runs, key=lambda r: r["total_s"])[(len(runs) - 1) // 2]
        results[name] = dict(median, repeats=len(runs), runs_total_s=[r["total_s"] for r in runs],
                             image_size=spec["image_sizes"].get(name))
    agent = spec.get("agent")
    if agent and agent["turns"]:
        processor = Processor.from_pretrained(spec["model"])
        script = agent_turns(agent["turns"], *agent["size"])
        results["agent"] = dict(agent_loop(model, vlm_processor, processor, script, agent["tokens"], AGENT_SYSTEM,
                                           agent.get("max_pixels")), image_size=list(agent["size"]))
    return dict(info=info, results=results)


def run_compare(model_path, inputs, settings, timeout=None):
    """Run the worker in a fresh process on `inputs` ({workload: processor outputs}); (its
    results, None) or (None, the reason it has none)."""
    with tempfile.TemporaryDirectory() as tmp:
        npz, spec_path, out_path = Path(tmp) / "inputs.npz", Path(tmp) / "spec.json", Path(tmp) / "out.json"
        np.savez(npz, **{f"{w}/{k}": np.asarray(v) for w, d in inputs.items() for k, v in d.items() if k in MODEL_KEYS})
        spec = dict(model=str(model_path), inputs=str(npz), workloads=list(inputs), decode_tokens=settings["decode_tokens"],
                    repeats=settings["repeats"],
                    image_sizes={w: list(map(int, w.split("_")[1].split("x"))) for w in inputs if w.startswith("screenshot_")},
                    agent=dict(turns=settings["agent_turns"], tokens=settings["agent_tokens"], size=[1280, 720],
                               max_pixels=settings["max_pixels"]))
        spec_path.write_text(json.dumps(spec))
        env = dict(os.environ, MLX_QWEN3VL_BLAS="off")  # what mlx-vlm's users get: nothing of ours preloaded
        try:
            p = subprocess.run([sys.executable, "-m", "mlx_qwen3vl.bench.engine_mlx_vlm", str(spec_path), str(out_path)],
                               env=env, timeout=timeout, stdout=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return None, f"mlx-vlm did not finish within {timeout} s"
        if p.returncode != 0 or not out_path.is_file():
            return None, f"mlx-vlm's run failed (exit {p.returncode}); its error is above"
        return json.loads(out_path.read_text()), None


def main(argv=None):
    spec_path, out_path = (argv or sys.argv[1:])[:2]
    result = worker(json.loads(Path(spec_path).read_text()))
    Path(out_path).write_text(json.dumps(result, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
