"""Benchmark mlx_qwen3vl, side by side with mlx-vlm and transformers.

    python benchmarks/bench.py --preset 2b                          # our engine, every workload
    python benchmarks/bench.py --preset 2b --compare mlx-vlm,transformers --out benchmarks/results/x.json
    python benchmarks/bench.py --model Qwen/Qwen3-VL-2B-Instruct --workloads image448,text256
    python benchmarks/bench.py --preset tiny --workloads text256 --decode-tokens 4   # smoke test

`--preset 2b|4b|8b` builds the published Qwen3-VL Instruct architecture with random weights once,
as a hub folder (bfloat16 safetensors, hub key names, transformers-4.57 config layout, the test
fixture's tokenizer and chat template) under benchmarks/models/, so every engine loads the same
files and nothing is downloaded. `tiny` is a small one for the test suite.

Every engine runs in its own worker process started by this one (same machine, same run, same
inputs): peak memory is per engine, and a "default" engine loads only what its users get. Inputs
are preprocessed once, here, with our processor; each worker times from ready inputs to tokens:

  vision_s      images/videos through the vision tower (evaluated, timed on its own)
  ttft_s        ready inputs → first token (vision + prompt prefill + first sample)
  prefill_tps   prompt tokens / (ttft_s - vision_s)
  decode_tps    (decode_tokens - 1) / (time of last token - time of first token), EOS ignored, greedy
  peak_memory_gb  MLX's peak allocation (mx.get_peak_memory) for MLX engines; for torch the
                process's peak resident set
  peak_rss_gb   the process's peak resident set (VmHWM, reset per workload), for every engine:
                the figure memory ratios use (our CPU kernels' numpy arrays are outside MLX's count)
  roofline      decode_tps × bytes read per token (weights + KV cache) ÷ memory bandwidth, the
                bandwidth measured in the same worker right after the workload (best of a large
                MLX reduction, a large GEMV in MLX and the same GEMV through numpy's BLAS)

The agent loop is 5 turns, each a new 1280×720 screenshot plus a short instruction with the
history kept: ours once with ChatSession (KV cache reused between turns) and once with a fresh
generate over the whole conversation each turn (`--agent-variants`); mlx-vlm (`--compare-workloads
agent`) as its users can run it: a fresh generate over the whole conversation each turn, since it
reuses a multi-turn prefix only when the new turn has no image. Total seconds each, including
preprocessing (our processor for every engine).
"""

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "tiny-a"
SCREENSHOT = ROOT / "examples" / "screenshot.png"
MODELS = ROOT / "benchmarks" / "models"

# ------------------------------------------------------------------------------------- presets
# Published Qwen3-VL Instruct architectures (config.json of Qwen/Qwen3-VL-{2B,4B,8B}-Instruct).
_TEXT = dict(head_dim=128, num_key_value_heads=8, vocab_size=151936, rope_theta=5_000_000,
             mrope_section=[24, 20, 20], max_position_embeddings=262144)
_VISION_2B = dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16,
                  deepstack_visual_indexes=[5, 11, 17])
PRESETS = {
    "tiny": dict(text=dict(_TEXT, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=32, vocab_size=448, mrope_section=[6, 5, 5]),
                 vision=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=4,
                             deepstack_visual_indexes=[0, 1]), tie=True),
    "2b": dict(text=dict(_TEXT, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                         num_attention_heads=16), vision=dict(_VISION_2B), tie=True),
    "4b": dict(text=dict(_TEXT, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                         num_attention_heads=32), vision=dict(_VISION_2B), tie=True),
    "8b": dict(text=dict(_TEXT, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                         num_attention_heads=32),
               vision=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16,
                           deepstack_visual_indexes=[8, 16, 24]), tie=False),
}
PRESET_FORMAT = 1  # bump when the files a preset writes change
SHARD_BYTES = 2 << 30
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "preprocessor_config.json",
                   "video_preprocessor_config.json"]


def preset_config(name):
    """config.json of a preset in the transformers-4.57 layout (what the hub serves; mlx-vlm
    rejects the 5.x layout), with the fixture tokenizer's special token ids."""
    spec = PRESETS[name]
    fx = json.loads((FIXTURE / "config.json").read_text())
    t = dict(spec["text"])
    text = dict(
        attention_bias=False, attention_dropout=0.0, bos_token_id=fx["text_config"]["bos_token_id"],
        eos_token_id=fx["text_config"]["eos_token_id"], head_dim=t["head_dim"], hidden_act="silu",
        hidden_size=t["hidden_size"], initializer_range=0.02, intermediate_size=t["intermediate_size"],
        max_position_embeddings=t["max_position_embeddings"], model_type="qwen3_vl_text",
        num_attention_heads=t["num_attention_heads"], num_hidden_layers=t["num_hidden_layers"],
        num_key_value_heads=t["num_key_value_heads"], rms_norm_eps=1e-6,
        rope_scaling=dict(mrope_interleaved=True, mrope_section=t["mrope_section"], rope_type="default"),
        rope_theta=t["rope_theta"], tie_word_embeddings=spec["tie"], use_cache=True, vocab_size=t["vocab_size"],
        torch_dtype="bfloat16",
    )
    vision = dict(spec["vision"], hidden_act="gelu_pytorch_tanh", in_channels=3, initializer_range=0.02,
                  model_type="qwen3_vl", num_position_embeddings=2304, out_hidden_size=t["hidden_size"],
                  patch_size=16, spatial_merge_size=2, temporal_patch_size=2)
    return dict(architectures=["Qwen3VLForConditionalGeneration"], model_type="qwen3_vl",
                image_token_id=fx["image_token_id"], video_token_id=fx["video_token_id"],
                vision_start_token_id=fx["vision_start_token_id"], vision_end_token_id=fx["vision_end_token_id"],
                text_config=text, vision_config=vision, tie_word_embeddings=spec["tie"], torch_dtype="bfloat16",
                transformers_version="4.57.0")


def _hub_name(name):
    for ours, hub in (("visual.", "model.visual."), ("language_model.", "model.language_model."), ("lm_head.", "lm_head.")):
        if name.startswith(ours):
            return hub + name[len(ours):]
    raise ValueError(name)


def build_preset(name, root=MODELS, log=print):
    """Write the preset's hub folder once (random bf16 weights); return its path."""
    out = Path(root) / f"qwen3vl-{name}-random"
    marker = out / "bench_preset.json"
    stamp = {"preset": name, "format": PRESET_FORMAT, "spec": PRESETS[name]}
    if marker.is_file() and json.loads(marker.read_text()) == json.loads(json.dumps(stamp)):
        return out
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlx_qwen3vl.config import ModelConfig
    from mlx_qwen3vl.model import Qwen3VLForConditionalGeneration

    tic = time.perf_counter()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cfg = preset_config(name)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    fx_gen = json.loads((FIXTURE / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps(fx_gen, indent=2))
    for f in TOKENIZER_FILES:
        shutil.copy(FIXTURE / f, out / f)
    n_tok = len(json.loads((FIXTURE / "tokenizer.json").read_text())["model"]["vocab"])
    n_tok += len(json.loads((FIXTURE / "tokenizer.json").read_text())["added_tokens"])

    # Names and shapes from our module tree (lazy: nothing is allocated), renamed to hub keys.
    config = ModelConfig.from_pretrained(out)
    params = tree_flatten(Qwen3VLForConditionalGeneration(config).parameters())
    vc = config.vision_config
    rng = np.random.default_rng(0)
    shards, current, size, total = [], {}, 0, 0

    def flush():
        nonlocal current, size
        if current:
            shards.append(current)
            path = out / f"shard-{len(shards)}.tmp.safetensors"
            mx.save_safetensors(str(path), current, metadata={"format": "pt"})
            current, size = {}, 0

    for key, p in params:
        shape = tuple(p.shape)
        leaf = key.rsplit(".", 1)[-1]
        if leaf == "bias":
            value = np.zeros(shape, np.float32)
        elif "norm" in key.rsplit(".", 2)[-2]:  # LayerNorm / RMSNorm scales
            value = np.ones(shape, np.float32)
        else:
            value = rng.standard_normal(shape, dtype=np.float32)
            value *= np.float32(0.02)
            if key in ("language_model.embed_tokens.weight", "lm_head.weight") and shape[0] > n_tok:
                # Rows past the tokenizer's vocabulary (real checkpoints pad the vocab too) are kept
                # small, so greedy decoding of random weights emits tokens the tokenizer can decode.
                value[n_tok:] *= np.float32(1e-3)
        if key == "visual.patch_embed.proj.weight":
            value = value.reshape(shape[0], vc.in_channels, vc.temporal_patch_size, vc.patch_size, vc.patch_size)
        arr = mx.array(value).astype(mx.bfloat16)
        mx.eval(arr)
        del value
        current[_hub_name(key)] = arr
        size += arr.nbytes
        total += arr.nbytes
        if size >= SHARD_BYTES:
            flush()
    flush()
    n = len(shards)
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{n:05d}.safetensors"
        os.replace(out / f"shard-{i}.tmp.safetensors", out / fname)
        weight_map.update({k: fname for k in shard})
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    marker.write_text(json.dumps(stamp))
    log(f"[bench] wrote preset {name}: {total / 1e9:.2f} GB of bf16 weights in {time.perf_counter() - tic:.0f} s → {out}")
    return out


# ----------------------------------------------------------------------------------- workloads
ALL_WORKLOADS = ["image448", "image720", "image1080", "text256", "video8", "agent"]
PROMPT = "Describe this screenshot: where are the buttons and what do they do?"


def _screenshot(w, h, variant=0):
    from PIL import Image, ImageDraw

    im = Image.open(SCREENSHOT).convert("RGB").resize((w, h), Image.BICUBIC)
    if variant:  # a different screen each agent turn: a moved "window" and a new title
        d = ImageDraw.Draw(im)
        x, y = (97 * variant) % (w - 300), (61 * variant) % (h - 200)
        d.rectangle([x, y, x + 300, y + 200], fill=(40 * variant % 255, 120, 200), outline=(0, 0, 0))
        d.text((x + 10, y + 10), f"Step {variant}: dialog", fill=(255, 255, 255))
    return np.asarray(im)


def _text_prompt(processor, n_tokens):
    """A user message whose templated prompt is exactly `n_tokens` tokens (when reachable)."""
    words = ("The quick brown fox jumps over the lazy dog while the agent opens the settings menu, "
             "finds the display panel and lowers the brightness before saving. ").split()
    count = lambda t: len(processor.tokenizer(processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": t}]}], add_generation_prompt=True, tokenize=False))["input_ids"])
    text, i = "", 0
    while count(text) < n_tokens:
        text += ("" if not text else " ") + words[i % len(words)]
        i += 1
    while count(text) > n_tokens and len(text) > 1:
        text = text[:-1]
    return text


def workload_messages(name, processor):
    """(messages, kwargs for the processor) of a single-turn workload."""
    if name == "image448":
        media, kw = [{"type": "image", "image": _screenshot(448, 448)}], {}
    elif name == "image720":
        media, kw = [{"type": "image", "image": _screenshot(1280, 720)}], {}
    elif name == "image1080":
        media, kw = [{"type": "image", "image": _screenshot(1920, 1080)}], {}
    elif name == "video8":
        frames = np.stack([_screenshot(640, 360, variant=t + 1) for t in range(8)])
        media, kw = [{"type": "video", "video": frames}], dict(video_fps=2.0, sample_frames=False)
    elif name == "text256":
        return [{"role": "user", "content": [{"type": "text", "text": _text_prompt(processor, 256)}]}], {}
    elif name == WARMUP:
        return [{"role": "user", "content": [{"type": "text", "text": _text_prompt(processor, 32)}]}], {}
    else:
        raise ValueError(f"unknown workload {name!r}; one of {', '.join(ALL_WORKLOADS)}")
    return [{"role": "user", "content": media + [{"type": "text", "text": PROMPT}]}], kw


# Every worker first runs this short text prompt, untimed (4 tokens): whichever workload came first
# otherwise paid one-time costs (measured: ~4 s more prefill for the first workload of our worker,
# whichever it was), and every engine gets the same treatment.
WARMUP = "warmup"
MODEL_KEYS = ["input_ids", "attention_mask", "mm_token_type_ids", "pixel_values", "image_grid_thw",
              "pixel_values_videos", "video_grid_thw"]


def prepare_inputs(names, processor, reps=3):
    """{workload: processor outputs}, plus our preprocessing seconds (median of `reps`)."""
    from mlx_qwen3vl.generate import encode_prompt

    inputs, pre = {}, {}
    for name in names:
        if name == "agent":
            continue
        messages, kw = workload_messages(name, processor)
        times = []
        for _ in range(reps):
            tic = time.perf_counter()
            out = encode_prompt(processor, messages=messages, **kw)
            times.append(time.perf_counter() - tic)
        inputs[name] = {k: np.asarray(out[k]) for k in MODEL_KEYS if k in out}
        pre[name] = statistics.median(times)
    return inputs, pre


# ------------------------------------------------------------------------------- measurements
def _fresh_mlx_measurement():
    """Free what earlier work left and restart the peak-memory counters (MLX's and the RSS)."""
    import mlx.core as mx

    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    _rss_reset()


def _rss_reset():
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _rss_peak_gb():
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    import resource

    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 1e9


def measure_bandwidth(gb=1.0, reps=7):
    """Read bandwidth (GB/s): a GEMV over a large float32 matrix (what decode does) in MLX, the same
    GEMV through numpy's BLAS, and an MLX reduction, median of `reps` each. The best of them is the
    roofline: MLX's CPU matmul reaches only what MKL's sgemm gives a matrix-vector product (about
    20 GB/s on the 2-core EPYC), numpy's OpenBLAS GEMV over 30, and the machine is what it is.
    Without MLX (the transformers worker), the numpy GEMV alone."""
    try:
        import mlx.core as mx
    except ImportError:
        mx = None
    n = int(gb * 1e9 / 4)
    cols = 4096
    rng = np.random.default_rng(0)
    an = rng.random((n // cols, cols), dtype=np.float32)
    xn = rng.random((1, cols), dtype=np.float32)

    def timed(fn, sync=lambda r: r):
        sync(fn())
        ts = []
        for _ in range(reps):
            tic = time.perf_counter()
            sync(fn())
            ts.append(time.perf_counter() - tic)
        return an.nbytes / statistics.median(ts) / 1e9

    out = {"numpy_gemv_gbs": timed(lambda: xn @ an.T)}
    if mx is not None:
        a, x = mx.array(an), mx.array(xn)
        mx.eval(a, x)
        out.update(sum_gbs=timed(lambda: a.sum(), mx.eval), gemv_gbs=timed(lambda: x @ a.T, mx.eval))
        a = x = None
    an = xn = None  # free the matrix before the model loads / the next workload runs
    gc.collect()
    if mx is not None:
        mx.clear_cache()
    out["bandwidth_gbs"] = max(v for k, v in out.items() if k.endswith("_gbs"))
    return out


def workload_bandwidth(spec):
    """The bandwidth again, right after a workload's decode: on a shared machine it drifts within
    minutes (21-41 GB/s here within one 17-minute run), so the roofline compares each decode with
    the bandwidth of the same moment. Taken after the workload's peak memory was read."""
    return measure_bandwidth(spec.get("bandwidth_gb", 1.0), reps=5)["bandwidth_gbs"]


def decode_bytes_per_token(cfg_text, tie, dtype_bytes, context):
    """Bytes read per decoded token: every decoder weight, the LM head (the embedding table when
    tied; one embedding row otherwise, ignored) and the KV cache at `context` tokens."""
    d, L, f = cfg_text["hidden_size"], cfg_text["num_hidden_layers"], cfg_text["intermediate_size"]
    hq, hkv, hd, V = cfg_text["num_attention_heads"], cfg_text["num_key_value_heads"], cfg_text["head_dim"], cfg_text["vocab_size"]
    per_layer = d * hq * hd * 2 + d * hkv * hd * 2 + 3 * d * f + 2 * d + 2 * hd
    weights = L * per_layer + d + V * d
    kv = 2 * L * hkv * hd * context
    return (weights + kv) * dtype_bytes


_cpu_mark = [0.0]


def _start_clock():
    """Mark the start of a workload: CPU seconds of this process (all threads) from here on show
    how much of the machine it actually got (the machine may be shared)."""
    _cpu_mark[0] = time.process_time()


def _summarize(name, n_prompt, vision_s, ttft, token_times, peak_gb, extra=None):
    n = len(token_times)
    decode = (n - 1) / (token_times[-1] - token_times[0]) if n > 1 else 0.0
    llm = max(ttft - vision_s, 1e-9)
    out = dict(workload=name, prompt_tokens=int(n_prompt), vision_s=vision_s, ttft_s=ttft,
               prefill_tps=n_prompt / llm, decode_tokens=n, decode_tps=decode, peak_memory_gb=peak_gb,
               peak_rss_gb=_rss_peak_gb(), cpu_s=time.process_time() - _cpu_mark[0],
               load_average=os.getloadavg()[0] if hasattr(os, "getloadavg") else None)
    out["wall_s"] = token_times[-1] - token_times[0] + ttft if n else ttft
    out.update(extra or {})
    return out


# ----------------------------------------------------------------------------- engine: ours
def worker_ours(args, spec):
    import mlx.core as mx

    import mlx_qwen3vl
    from mlx_qwen3vl.cpu import blas as _blas

    gen = sys.modules["mlx_qwen3vl.generate"]  # the module (the package exports the function)
    from mlx_qwen3vl.weights import load_model

    info = engine_info("mlx_qwen3vl")
    info["blas"] = _blas.describe()
    bw = measure_bandwidth(spec.get("bandwidth_gb", 1.0))
    tic = time.perf_counter()
    model = load_model(spec["model"], dtype=spec.get("dtype"), backend=spec.get("backend"))
    load_s = time.perf_counter() - tic
    dtype = model.language_model.norm.weight.dtype
    info.update(dtype=str(dtype).replace("mlx.core.", ""), load_s=load_s, backend=model.backend.describe(), **bw)
    log(f"[ours] backend: {info['backend']}")
    results = {}
    # Vision is timed on its own by evaluating the features where prefill asks for them.
    vision_time = []
    orig = model.get_image_features

    def timed_features(pixel_values, grid_thw):
        t = time.perf_counter()
        feats = orig(pixel_values, grid_thw)
        mx.eval(feats.embeds, *feats.deepstack)
        vision_time.append(time.perf_counter() - t)
        return feats

    model.get_image_features = model.get_video_features = timed_features
    sampler = lambda logprobs: mx.argmax(logprobs, axis=-1)
    data = np.load(spec["inputs"])
    warm = {k.split("/", 1)[1]: data[k] for k in data.files if k.startswith(WARMUP + "/")}
    for y in gen.generate_tokens(model, warm, model.make_cache(), sampler=sampler, max_tokens=4):
        y.item()
    for name in spec["workloads"]:
        if name == "agent":
            continue
        inputs = {k.split("/", 1)[1]: data[k] for k in data.files if k.startswith(name + "/")}
        for _ in range(spec.get("warmup", 0)):
            for y in gen.generate_tokens(model, inputs, model.make_cache(), sampler=sampler, max_tokens=2):
                y.item()
        _fresh_mlx_measurement()
        vision_time.clear()
        times = []
        _start_clock()
        tic = time.perf_counter()
        for y in gen.generate_tokens(model, inputs, model.make_cache(), sampler=sampler,
                                     max_tokens=spec["decode_tokens"],
                                     prefill_step_size=spec.get("prefill_step_size", 2048)):
            y.item()
            times.append(time.perf_counter())
        ttft = times[0] - tic
        peak = mx.get_peak_memory() / 1e9
        results[name] = _summarize(name, inputs["input_ids"].shape[1], sum(vision_time), ttft, times, peak)
        results[name]["bandwidth_gbs"] = workload_bandwidth(spec)
        log(f"[ours] {name}: {_fmt(results[name])}")
    if "agent" in spec["workloads"]:
        model.get_image_features = model.get_video_features = orig
        results["agent"] = agent_loop(model, spec)
    return {"info": info, "results": results}


AGENT_SYSTEM = "You are a GUI agent. Answer with the next action."
AGENT_ASKS = ["Open the display settings.", "Lower the brightness.", "Click Apply.", "Close the dialog.",
              "Open the search box and type 'network'."]


def agent_turns(spec):
    """[(screenshot, instruction)] of the agent loop, the same for every engine."""
    turns = spec.get("agent_turns", 5)
    return [(_screenshot(1280, 720, variant=t + 1), AGENT_ASKS[t % len(AGENT_ASKS)]) for t in range(turns)]


def agent_loop(model, spec):
    """5 turns of (new 1280×720 screenshot + short instruction), history kept: ChatSession (the
    KV cache of earlier turns reused) vs a fresh generate over the whole conversation each turn.
    EOS is ignored so every turn answers with exactly `agent_tokens` tokens in both variants."""
    import mlx.core as mx

    from mlx_qwen3vl import ChatSession, Processor

    gen = sys.modules["mlx_qwen3vl.generate"]

    processor = Processor.from_pretrained(spec["model"])
    gen.eos_token_ids = lambda model, processor: set()
    script = agent_turns(spec)
    turns = len(script)
    kw = dict(max_tokens=spec.get("agent_tokens", 8), temperature=0.0)
    out = {}
    for variant in spec.get("agent_variants", ["reuse", "no_reuse"]):
        _fresh_mlx_measurement()
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
                r = gen.generate(model, processor, messages=messages, **kw)
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
                            peak_rss_gb=_rss_peak_gb(), answers=answers)
    out.update(turns=turns, tokens_per_turn=kw["max_tokens"])
    if "reuse" in out and "no_reuse" in out:
        out["speedup"] = out["no_reuse"]["total_s"] / out["reuse"]["total_s"]
        out["same_answers"] = out["reuse"]["answers"] == out["no_reuse"]["answers"]
        log(f"[ours] agent: reuse {out['reuse']['total_s']:.1f} s, no reuse {out['no_reuse']['total_s']:.1f} s "
            f"({out['speedup']:.2f}x)")
    return out


def mlx_vlm_agent(model, vlm_processor, spec, stream_generate):
    """The agent loop as mlx-vlm's users can run it: every turn has a new image, so its prompt cache
    cannot be reused and each turn is a fresh generate over the whole conversation. The prompt is
    built by our processor (as for every other workload) and the answer, decoded from its tokens,
    goes back into the history."""
    import mlx.core as mx

    from mlx_qwen3vl import Processor
    from mlx_qwen3vl.generate import encode_prompt

    processor = Processor.from_pretrained(spec["model"])
    script = agent_turns(spec)
    n_tokens = spec.get("agent_tokens", 8)
    _fresh_mlx_measurement()
    messages = [{"role": "system", "content": AGENT_SYSTEM}]
    per_turn, answers, prompt_tokens = [], [], []
    tic = time.perf_counter()
    for t, (shot, ask) in enumerate(script):
        t0 = time.perf_counter()
        messages.append({"role": "user", "content": [{"type": "image", "image": shot}, {"type": "text", "text": ask}]})
        inputs = encode_prompt(processor, messages=messages)
        kwargs = {k: mx.array(np.asarray(inputs[k])) for k in ("input_ids", "pixel_values", "image_grid_thw")}
        tokens = []
        for r in stream_generate(model, vlm_processor, "", max_tokens=n_tokens, temperature=0.0, **kwargs):
            if r.token is not None and r.generation_tokens > len(tokens):  # (its last piece repeats a token)
                tokens.append(int(r.token))
        answer = processor.tokenizer.decode(tokens)
        messages.append({"role": "assistant", "content": answer})
        answers.append(answer)
        prompt_tokens.append(int(kwargs["input_ids"].shape[1]))
        per_turn.append(time.perf_counter() - t0)
        log(f"[mlx-vlm] agent turn {t + 1}: {per_turn[-1]:.1f} s, prompt {prompt_tokens[-1]} (0 cached)")
    fresh = dict(total_s=time.perf_counter() - tic, turn_s=per_turn, prompt_tokens=prompt_tokens,
                 cached_tokens=[0] * len(script), peak_memory_gb=mx.get_peak_memory() / 1e9,
                 peak_rss_gb=_rss_peak_gb(), answers=answers)
    return dict(no_reuse=fresh, turns=len(script), tokens_per_turn=n_tokens)


# -------------------------------------------------------------------------- engine: mlx-vlm
def worker_mlx_vlm(args, spec):
    if spec.get("same_blas"):
        import mlx_qwen3vl.cpu.blas as blas  # the same optimized BLAS as ours, before mlx.core

        blas_note = blas.describe()
    else:
        blas_note = "MLX's bundled BLAS (nothing preloaded)"
    import mlx.core as mx
    from mlx_vlm import load as vlm_load, stream_generate
    from mlx_vlm.models.qwen3_vl import vision as vlm_vision

    info = engine_info("mlx-vlm", "mlx_vlm")
    info["blas"] = blas_note
    tic = time.perf_counter()
    model, processor = vlm_load(spec["model"])
    if spec.get("dtype"):
        model.set_dtype(getattr(mx, spec["dtype"]))
        mx.eval(model.parameters())
    info.update(load_s=time.perf_counter() - tic, dtype=str(model.language_model.model.norm.weight.dtype).replace("mlx.core.", ""))
    tok = processor.tokenizer if hasattr(processor, "tokenizer") else processor
    tok.stopping_criteria = lambda token: False  # EOS ignored: a fixed number of decode tokens

    vision_time = []
    orig_call = vlm_vision.VisionModel.__call__

    def timed_call(self, *a, **k):
        t = time.perf_counter()
        out = orig_call(self, *a, **k)
        mx.eval(out)
        vision_time.append(time.perf_counter() - t)
        return out

    data = np.load(spec["inputs"])
    for _ in stream_generate(model, processor, "", input_ids=mx.array(data[WARMUP + "/input_ids"]), max_tokens=4,
                             temperature=0.0):
        pass
    vlm_vision.VisionModel.__call__ = timed_call
    results = {}
    for name in spec["workloads"]:
        if name == "agent":
            continue
        inputs = {k.split("/", 1)[1]: data[k] for k in data.files if k.startswith(name + "/")}
        if name in spec.get("extrapolate", []):
            results[name] = mlx_vlm_extrapolated(model, inputs, name)
            log(f"[mlx-vlm] {name}: {_fmt(results[name])}")
            continue
        kwargs = dict(input_ids=mx.array(inputs["input_ids"]), max_tokens=spec["decode_tokens"], temperature=0.0)
        for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
            if key in inputs:
                kwargs[key] = mx.array(inputs[key])
        _fresh_mlx_measurement()
        vision_time.clear()
        times = []
        _start_clock()
        tic = time.perf_counter()
        for r in stream_generate(model, processor, "", **kwargs):
            if r.token is not None and r.generation_tokens > len(times):  # (its last piece repeats a token)
                times.append(time.perf_counter())
        ttft = times[0] - tic
        peak = mx.get_peak_memory() / 1e9
        results[name] = _summarize(name, inputs["input_ids"].shape[1], sum(vision_time), ttft, times, peak)
        results[name]["bandwidth_gbs"] = workload_bandwidth(spec)
        log(f"[mlx-vlm] {name}: {_fmt(results[name])}")
    vlm_vision.VisionModel.__call__ = orig_call
    if "agent" in spec["workloads"]:
        results["agent"] = mlx_vlm_agent(model, processor, spec, stream_generate)
        log(f"[mlx-vlm] agent: {results['agent']['no_reuse']['total_s']:.1f} s")
    return {"info": info, "results": results}


def mlx_vlm_extrapolated(model, inputs, name, reps=1):
    """Too slow to run whole (bfloat16 on a CPU): time mlx-vlm's own modules on this workload's
    real shapes — patch embedding + positions, one vision block, one merger, one decoder layer over
    the whole prompt — and add them up by depth. Decode speed is not extrapolated (it is the
    measured one of the other workloads)."""
    import mlx.core as mx

    vt, lm = model.vision_tower, model.language_model
    px = mx.array(inputs["pixel_values"]).astype(vt.patch_embed.proj.weight.dtype)
    grid = mx.array(inputs["image_grid_thw"])

    def timed(fn):
        best = []
        for _ in range(reps):
            t = time.perf_counter()
            out = fn()
            mx.eval(out)
            best.append(time.perf_counter() - t)
        return out, min(best)

    h, t_embed = timed(lambda: vt.patch_embed(px) + vt.fast_pos_embed_interpolate(grid))
    rot = vt.rot_pos_emb(grid)
    n = h.shape[0]
    cu = mx.array([0, n], dtype=mx.int32)
    h2, t_block = timed(lambda: vt.blocks[0](h, cu_seqlens=cu, rotary_pos_emb=rot))
    _, t_merger = timed(lambda: vt.merger(h2))
    depth, taps = len(vt.blocks), len(vt.deepstack_merger_list)
    vision = t_embed + depth * t_block + (1 + taps) * t_merger
    ids = mx.array(inputs["input_ids"])
    L = ids.shape[1]
    emb = lm.model.embed_tokens(ids).astype(h.dtype)
    pos, _ = lm.get_rope_index(ids, grid, None, None)
    layer = lm.model.layers[0]
    from mlx_vlm.models.cache import KVCache

    _, t_layer = timed(lambda: layer(emb, mask="causal", cache=KVCache(), position_ids=pos))
    _, t_head = timed(lambda: lm.lm_head(emb[:, -1:]) if hasattr(lm, "lm_head") and not model.config.text_config.tie_word_embeddings
                      else lm.model.embed_tokens.as_linear(emb[:, -1:]))
    prefill = len(lm.model.layers) * t_layer + t_head
    return dict(workload=name, prompt_tokens=int(L), vision_s=vision, ttft_s=vision + prefill,
                prefill_tps=L / prefill, decode_tokens=0, decode_tps=None, peak_memory_gb=None,
                peak_rss_gb=_rss_peak_gb(), extrapolated=True,
                parts=dict(embed_s=t_embed, vision_block_s=t_block, merger_s=t_merger, vision_depth=depth,
                           decoder_layer_s=t_layer, decoder_layers=len(lm.model.layers), head_s=t_head))


# ---------------------------------------------------------------------- engine: transformers
def worker_transformers(args, spec):
    import torch
    from transformers import AutoModelForImageTextToText, TextStreamer  # noqa: F401

    info = engine_info("transformers", "transformers")
    info.update(torch=torch.__version__, torch_threads=torch.get_num_threads(),
                blas="torch's bundled MKL/oneDNN", backend="torch CPU")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, None: "auto"}[spec.get("dtype")]
    tic = time.perf_counter()
    model = AutoModelForImageTextToText.from_pretrained(spec["model"], dtype=dtype).eval()
    info.update(load_s=time.perf_counter() - tic, dtype=str(next(model.parameters()).dtype).replace("torch.", ""))
    vision_time, start = [], []
    visual = model.model.visual
    visual.register_forward_pre_hook(lambda m, a: start.append(time.perf_counter()))
    visual.register_forward_hook(lambda m, a, o: vision_time.append(time.perf_counter() - start[-1]))

    class Clock:
        def __init__(self):
            self.times, self.first = [], True

        def put(self, value):
            if self.first:  # the prompt
                self.first = False
                return
            self.times.append(time.perf_counter())

        def end(self):
            pass

    data = np.load(spec["inputs"])
    with torch.inference_mode():
        model.generate(input_ids=torch.from_numpy(data[WARMUP + "/input_ids"]), max_new_tokens=4, do_sample=False,
                       temperature=None, top_p=None, top_k=None)
    results = {}
    n = spec["decode_tokens"]
    for name in spec["workloads"]:
        if name == "agent":
            log("[transformers] agent loop not implemented for this engine; skipped")
            continue
        inputs = {k.split("/", 1)[1]: torch.from_numpy(data[k]) for k in data.files if k.startswith(name + "/")}
        for key in ("pixel_values", "pixel_values_videos"):
            if key in inputs:
                inputs[key] = inputs[key].to(next(model.parameters()).dtype)
        gc.collect()
        _rss_reset()
        vision_time.clear()
        clock = Clock()
        _start_clock()
        tic = time.perf_counter()
        with torch.inference_mode():
            model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False, streamer=clock,
                           temperature=None, top_p=None, top_k=None)
        ttft = clock.times[0] - tic
        results[name] = _summarize(name, inputs["input_ids"].shape[1], sum(vision_time), ttft, clock.times,
                                   _rss_peak_gb())
        results[name]["bandwidth_gbs"] = workload_bandwidth(spec)
        log(f"[transformers] {name}: {_fmt(results[name])}")
    return {"info": info, "results": results}


WORKERS = {"ours": worker_ours, "mlx-vlm": worker_mlx_vlm, "transformers": worker_transformers}


# ------------------------------------------------------------------------------------ plumbing
def log(msg):
    print(msg, file=sys.stderr, flush=True)


def _fmt(r):
    parts = []
    for key, f in (("vision_s", "vision {:.2f}s"), ("ttft_s", "TTFT {:.2f}s"), ("prefill_tps", "prefill {:.1f} tok/s"),
                   ("decode_tps", "decode {:.2f} tok/s"), ("peak_memory_gb", "MLX peak {:.2f} GB"),
                   ("peak_rss_gb", "peak RSS {:.2f} GB")):
        if r.get(key) is not None:
            parts.append(f.format(r[key]))
    return f"{r['prompt_tokens']} prompt tokens, " + ", ".join(parts)


def engine_info(name, module=None):
    info = {"engine": name}
    try:
        import mlx.core as mx

        info["mlx"] = mx.__version__
        info["backend"] = str(mx.default_device())
    except ImportError:
        pass
    if module:
        import importlib.metadata as md

        try:
            info["version"] = md.version(module.replace("_", "-"))
        except md.PackageNotFoundError:
            pass
    return info


def machine_info():
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        try:
            cpu = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True).stdout.strip() or cpu
        except OSError:
            pass
    mem = None
    try:
        mem = int(Path("/proc/meminfo").read_text().split()[1]) * 1024 / 1e9
    except OSError:
        pass
    import mlx.core as mx

    from mlx_qwen3vl.cpu import blas as _blas

    gpu = None
    try:
        if mx.metal.is_available():
            gpu = mx.metal.device_info().get("device_name") if hasattr(mx.metal, "device_info") else "Metal"
    except Exception:
        pass
    return dict(cpu=cpu, cores=os.cpu_count(), memory_gb=mem, platform=platform.platform(),
                python=platform.python_version(), mlx=mx.__version__, backend=str(mx.default_device()),
                gpu=gpu, blas=_blas.describe(), mkl_threading_layer=os.environ.get("MKL_THREADING_LAYER"),
                load_average=os.getloadavg() if hasattr(os, "getloadavg") else None)


def run_worker(engine, spec, python=None, timeout=None):
    """Run one engine's worker in a fresh process; its JSON result, or None with a note."""
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        if engine == "mlx-vlm" and not spec.get("same_blas"):
            env["MLX_QWEN3VL_BLAS"] = "off"
        cmd = [python or sys.executable, str(Path(__file__).resolve()), "--worker", engine, str(spec_path), str(out_path)]
        try:
            p = subprocess.run(cmd, env=env, timeout=timeout)
        except subprocess.TimeoutExpired:
            return None, f"{engine} did not finish within {timeout} s"
        if p.returncode != 0 or not out_path.is_file():
            return None, f"{engine} worker failed (exit {p.returncode}); see the log above"
        return json.loads(out_path.read_text()), None


def available(engine):
    import importlib.util

    module = {"mlx-vlm": "mlx_vlm", "transformers": "transformers"}[engine]
    if importlib.util.find_spec(module) is None:
        return f"{engine} is not installed in this environment (pip install {engine})"
    if engine == "transformers" and importlib.util.find_spec("torch") is None:
        return "transformers needs torch, which is not installed"
    return None


def ratio(ours, theirs, key, higher_is_better):
    if not ours or not theirs or ours.get(key) in (None, 0) or theirs.get(key) in (None, 0):
        return None
    return ours[key] / theirs[key] if higher_is_better else theirs[key] / ours[key]


COMPARED = [("vision_s", False, "vision"), ("ttft_s", False, "TTFT"), ("prefill_tps", True, "prefill"),
            ("decode_tps", True, "decode"), ("peak_memory_gb", False, "memory")]


def print_tables(report):
    bw = report["engines"].get("ours", {}).get("info", {}).get("bandwidth_gbs")
    print(f"\n{report['model']}  ·  {report['machine']['cpu']} ({report['machine']['cores']} cores)  ·  MLX "
          f"{report['machine']['mlx']} {report['machine']['backend']}  ·  BLAS: {report['machine']['blas']}")
    head = (f"{'engine':<26}{'workload':<11}{'tokens':>7}{'vision s':>10}{'TTFT s':>9}{'prefill/s':>11}{'decode/s':>10}"
            f"{'RSS GB':>9}{'roofline':>10}{'(vs best)':>11}")
    print(head)
    print("-" * len(head))
    for label, eng in report["engines"].items():
        for name, r in eng.get("results", {}).items():
            if name == "agent":
                continue
            f = lambda k, s: (s.format(r[k]) if r.get(k) is not None else "-")
            roof = f"{r['roofline']:.0%}" if r.get("roofline") else "-"
            roof_best = f"{r['roofline_best_bw']:.0%}" if r.get("roofline_best_bw") else "-"
            tag = " (est.)" if r.get("extrapolated") else ""
            print(f"{label:<26}{name:<11}{r['prompt_tokens']:>7}{f('vision_s', '{:.2f}'):>10}{f('ttft_s', '{:.2f}'):>9}"
                  f"{f('prefill_tps', '{:.1f}'):>11}{f('decode_tps', '{:.2f}'):>10}{f('peak_rss_gb', '{:.2f}'):>9}{roof:>10}"
                  f"{roof_best:>11}{tag}")
    for label, eng in report["engines"].items():
        a = eng.get("results", {}).get("agent")
        if a:
            parts = [f"{v.replace('_', ' ')} {a[v]['total_s']:.1f} s" for v in ("reuse", "no_reuse") if v in a]
            print(f"\nagent loop, {label} ({a['turns']} turns, 1280x720 screenshot + instruction, "
                  f"{a['tokens_per_turn']} tokens each): " + ", ".join(parts)
                  + (f" → {a['speedup']:.2f}x" if a.get("speedup") else ""))
    if report.get("ratios"):
        print("\nours / theirs (>1 means ours is better: faster, or less memory)")
        print(f"{'against':<26}{'workload':<11}" + "".join(f"{lbl:>10}" for _, _, lbl in COMPARED))
        for label, per in report["ratios"].items():
            for name, rr in per.items():
                if name == "agent":
                    print(f"{label:<26}agent loop: ours with reuse {rr['total']:.2f}x faster in total")
                    continue
                print(f"{label:<26}{name:<11}" + "".join(
                    f"{(format(rr[lbl], '.2f') + 'x') if rr.get(lbl) else '-':>10}" for _, _, lbl in COMPARED))
    if bw:
        print(f"\nmemory bandwidth measured in this run: {bw:.1f} GB/s at the start of our worker, "
              f"{report.get('bandwidth_best_gbs', bw):.1f} GB/s at best; 'roofline' uses the one measured right "
              f"after each workload, '(vs best)' the best")
    for note in report.get("notes", []):
        print(f"note: {note}")


def analyze(report, text_cfg, tie):
    """Rooflines and our/their ratios from the workers' raw figures (also rerun by --reanalyze)."""
    # Roofline of each engine's decode against the bandwidth measured right after it in its own
    # worker; `roofline_start_bw` uses our worker's start-of-run measurement instead and
    # `roofline_best_bw` the best bandwidth measured anywhere in the run (the machine's capability:
    # the conservative figure, since a shared machine's bandwidth dips but never exceeds it).
    bw_start = report["engines"].get("ours", {}).get("info", {}).get("bandwidth_gbs")
    bw_best = max([bw_start or 0] + [r.get("bandwidth_gbs") or 0 for eng in report["engines"].values()
                                     for r in eng.get("results", {}).values()])
    report["bandwidth_best_gbs"] = bw_best
    for label, eng in report["engines"].items():
        dt = eng.get("info", {}).get("dtype", "float32")
        nbytes = {"float32": 4, "float16": 2, "bfloat16": 2}.get(dt, 4)
        for name, r in eng.get("results", {}).items():
            bw = r.get("bandwidth_gbs") or bw_start
            if name == "agent" or not r.get("decode_tps") or not bw:
                continue
            per_token = decode_bytes_per_token(text_cfg, tie, nbytes,
                                               r["prompt_tokens"] + r["decode_tokens"] // 2)
            r["bytes_per_token"] = per_token
            r["roofline_tps"] = bw * 1e9 / per_token
            r["roofline"] = r["decode_tps"] / r["roofline_tps"]
            if bw_start:
                r["roofline_start_bw"] = r["decode_tps"] * per_token / (bw_start * 1e9)
            r["roofline_best_bw"] = r["decode_tps"] * per_token / (bw_best * 1e9)
    ours = report["engines"].get("ours", {}).get("results", {})
    for label, eng in report["engines"].items():
        if label == "ours":
            continue
        per = {}
        for name, theirs in eng.get("results", {}).items():
            mine = ours.get(name)
            if not mine:
                continue
            if name == "agent":  # our ChatSession (reuse) against their best way to run the loop
                best = min((theirs[v] for v in ("reuse", "no_reuse") if v in theirs), key=lambda r: r["total_s"])
                if "reuse" in mine:
                    per[name] = {"total": best["total_s"] / mine["reuse"]["total_s"],
                                 "same_answers": best["answers"] == mine["reuse"]["answers"]}
                continue
            # Memory against the process's peak RSS: our CPU kernels allocate numpy arrays, which
            # MLX's own peak counter does not see, and torch has none.
            per[name] = {lbl: ratio(mine, theirs, "peak_rss_gb" if key == "peak_memory_gb" else key, hib)
                         for key, hib, lbl in COMPARED}
        report["ratios"][label] = per


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="local checkpoint folder or Hugging Face repo id")
    src.add_argument("--preset", choices=list(PRESETS), help="random-weight published architecture")
    p.add_argument("--workloads", default=",".join(ALL_WORKLOADS), help=f"comma list of {', '.join(ALL_WORKLOADS)}")
    p.add_argument("--decode-tokens", type=int, default=32, help="tokens decoded per workload (EOS ignored)")
    p.add_argument("--agent-turns", type=int, default=5)
    p.add_argument("--agent-tokens", type=int, default=8, help="answer tokens per agent turn")
    p.add_argument("--agent-variants", default="reuse,no_reuse",
                   help="our agent loop: with KV-cache reuse (ChatSession) and/or a fresh generate each turn")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="our compute dtype (default: the engine's, float32 on a CPU)")
    p.add_argument("--backend", choices=["auto", "mlx", "cpu"], default="auto",
                   help="our backend: the CPU path where it fits (auto), the plain MLX graph a GPU runs, or cpu")
    p.add_argument("--prefill-step-size", type=int, default=2048)
    p.add_argument("--bandwidth-gb", type=float, default=1.0, help="array size of the bandwidth measurement")
    p.add_argument("--warmup", type=int, default=0, help="untimed 2-token runs per workload first")
    p.add_argument("--compare", default="", help="comma list of mlx-vlm, transformers")
    p.add_argument("--compare-dtypes", default="default,float32",
                   help="for each compared engine: 'default' (what its users get: the checkpoint's dtype, "
                        "nothing preloaded) and/or a dtype run like for like (our BLAS loaded into mlx-vlm)")
    p.add_argument("--compare-workloads", default=None, help="workloads for compared engines (default: all but agent; mlx-vlm also runs agent)")
    p.add_argument("--extrapolate", default="", help="mlx-vlm workloads too slow to run whole in bfloat16: "
                                                     "timed per block and summed by depth (e.g. image1080)")
    p.add_argument("--skip-ours", action="store_true", help="only run the compared engines")
    p.add_argument("--ours-from", default=None, help="take our results from this earlier results JSON "
                                                     "(same model) instead of running our engine again")
    p.add_argument("--python", default=None, help="interpreter for the workers (default: this one)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per worker")
    p.add_argument("--out", default=None, help="results JSON (default: benchmarks/results/<model>.json)")
    p.add_argument("--models-dir", default=str(MODELS))
    p.add_argument("--verbose", action="store_true", help="print the BLAS in use and each step")
    p.add_argument("--reanalyze", metavar="FILE", help="recompute rooflines and ratios of a results JSON in place")
    p.add_argument("--worker", nargs=3, metavar=("ENGINE", "SPEC", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:
        engine, spec_path, out_path = args.worker
        if engine == "ours":
            import mlx_qwen3vl  # noqa: F401  (loads the optimized BLAS before mlx.core)
        result = WORKERS[engine](args, json.loads(Path(spec_path).read_text()))
        Path(out_path).write_text(json.dumps(result, indent=1, default=float))
        return 0

    if args.reanalyze:
        report = json.loads(Path(args.reanalyze).read_text())
        cfg = json.loads((Path(report["path"]) / "config.json").read_text())
        text_cfg = cfg.get("text_config", cfg)
        analyze(report, text_cfg, cfg.get("tie_word_embeddings", text_cfg.get("tie_word_embeddings", False)))
        Path(args.reanalyze).write_text(json.dumps(report, indent=1, default=float))
        print_tables(report)
        return 0

    sys.path.insert(0, str(ROOT))
    import mlx_qwen3vl
    from mlx_qwen3vl.cpu import blas as _blas
    from mlx_qwen3vl.config import ModelConfig
    from mlx_qwen3vl.hub import resolve_model_path

    if args.verbose:
        log(f"[mlx_qwen3vl] BLAS: {_blas.describe()}")
    if args.preset:
        path = build_preset(args.preset, args.models_dir, log)
        label = f"preset {args.preset} (random weights)"
    else:
        path = resolve_model_path(args.model or "Qwen/Qwen3-VL-2B-Instruct")
        label = str(args.model)
    path = Path(path)
    config = ModelConfig.from_pretrained(path)
    processor = mlx_qwen3vl.Processor.from_pretrained(path)
    names = [w for w in args.workloads.split(",") if w]
    for w in names:
        if w not in ALL_WORKLOADS:
            p.error(f"unknown workload {w!r}; one of {', '.join(ALL_WORKLOADS)}")
    for v in args.agent_variants.split(","):
        if v and v not in ("reuse", "no_reuse"):
            p.error(f"unknown agent variant {v!r}; one of reuse, no_reuse")
    compare = [e for e in args.compare.split(",") if e]
    compare_names = [w for w in (args.compare_workloads.split(",") if args.compare_workloads else
                                 [n for n in names if n != "agent"]) if w]
    inputs, pre = prepare_inputs(sorted(set(names) | set(compare_names)) + [WARMUP], processor)
    report = dict(model=label, path=str(path), machine=machine_info(), started=time.strftime("%Y-%m-%d %H:%M:%S"),
                  settings=dict(backend=args.backend, decode_tokens=args.decode_tokens, agent_turns=args.agent_turns,
                                agent_tokens=args.agent_tokens, prefill_step_size=args.prefill_step_size,
                                workloads=names, compare=compare, compare_workloads=compare_names),
                  engines={}, ratios={}, notes=[])
    text_cfg = dict(config.text_config.__dict__)
    with tempfile.TemporaryDirectory() as tmp:
        npz = Path(tmp) / "inputs.npz"
        np.savez(npz, **{f"{w}/{k}": v for w, d in inputs.items() for k, v in d.items()})
        base = dict(model=str(path), inputs=str(npz), decode_tokens=args.decode_tokens, warmup=args.warmup,
                    bandwidth_gb=args.bandwidth_gb,
                    prefill_step_size=args.prefill_step_size, agent_turns=args.agent_turns, agent_tokens=args.agent_tokens,
                    agent_variants=[v for v in args.agent_variants.split(",") if v])
        if args.ours_from:
            report["engines"]["ours"] = json.loads(Path(args.ours_from).read_text())["engines"]["ours"]
            report["notes"].append(f"our results are those of {Path(args.ours_from).name} (same machine, earlier run)")
        elif not args.skip_ours:
            backend = None if args.backend == "auto" else args.backend
            res, note = run_worker("ours", dict(base, workloads=names, dtype=args.dtype, backend=backend), args.python,
                                   args.timeout)
            if res:
                for name, r in res["results"].items():
                    if name in pre:
                        r["preprocess_s"] = pre[name]
                report["engines"]["ours"] = res
            else:
                report["notes"].append(note)
        for engine in compare:
            missing = available(engine) if not args.python else None
            if missing:
                report["notes"].append(f"{engine} skipped: {missing}")
                log(f"[bench] {engine} skipped: {missing}")
                continue
            for mode in [m for m in args.compare_dtypes.split(",") if m]:
                dtype = None if mode == "default" else mode
                label = f"{engine}[{mode if dtype else 'default'}]"
                spec = dict(base, workloads=compare_names, dtype=dtype, same_blas=dtype is not None,
                            extrapolate=[w for w in args.extrapolate.split(",") if w] if engine == "mlx-vlm" and not dtype else [])
                log(f"[bench] running {label}")
                res, note = run_worker(engine, spec, args.python, args.timeout)
                if res:
                    report["engines"][label] = res
                else:
                    report["notes"].append(note)
    analyze(report, text_cfg, config.tie_word_embeddings)
    report["machine"]["load_average_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"{(args.preset or path.name)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=float))
    print_tables(report)
    log(f"[bench] wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
