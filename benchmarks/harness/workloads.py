"""The inputs every engine gets: single-turn workloads (screenshots at three sizes, a video, a
text prompt) preprocessed once with our processor, and the agent loop's turns. The prompts and
the agent's instructions are the installed benchmark's (mlx_qwen3vl/bench/inputs.py); the
screenshots here are examples/screenshot.png resized, as every recorded result used."""

import statistics
import time

import numpy as np

from mlx_qwen3vl.bench.inputs import AGENT_ASKS, AGENT_SYSTEM, PROMPT, text_prompt  # noqa: F401  (the installed bench's)

from .preset_folders import ROOT

SCREENSHOT_FILE = ROOT / "examples" / "screenshot.png"

ALL_WORKLOADS = ["image448", "image720", "image1080", "text256", "video8", "agent"]


def screenshot(w, h, variant=0):
    from PIL import Image, ImageDraw

    im = Image.open(SCREENSHOT_FILE).convert("RGB").resize((w, h), Image.BICUBIC)
    if variant:  # a different screen each agent turn: a moved "window" and a new title
        d = ImageDraw.Draw(im)
        x, y = (97 * variant) % (w - 300), (61 * variant) % (h - 200)
        d.rectangle([x, y, x + 300, y + 200], fill=(40 * variant % 255, 120, 200), outline=(0, 0, 0))
        d.text((x + 10, y + 10), f"Step {variant}: dialog", fill=(255, 255, 255))
    return np.asarray(im)


def workload_messages(name, processor):
    """(messages, kwargs for the processor) of a single-turn workload."""
    if name == "image448":
        media, kw = [{"type": "image", "image": screenshot(448, 448)}], {}
    elif name == "image720":
        media, kw = [{"type": "image", "image": screenshot(1280, 720)}], {}
    elif name == "image1080":
        media, kw = [{"type": "image", "image": screenshot(1920, 1080)}], {}
    elif name == "video8":
        frames = np.stack([screenshot(640, 360, variant=t + 1) for t in range(8)])
        media, kw = [{"type": "video", "video": frames}], dict(source_fps=2.0, sample_frames=False)
    elif name == "text256":
        return [{"role": "user", "content": [{"type": "text", "text": text_prompt(processor, 256)}]}], {}
    elif name == WARMUP:
        return [{"role": "user", "content": [{"type": "text", "text": text_prompt(processor, 32)}]}], {}
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


def agent_turns(spec):
    """[(screenshot, instruction)] of the agent loop, the same for every engine."""
    turns = spec.get("agent_turns", 5)
    return [(screenshot(1280, 720, variant=t + 1), AGENT_ASKS[t % len(AGENT_ASKS)]) for t in range(turns)]
