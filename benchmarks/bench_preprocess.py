"""Preprocessing time: ours vs transformers' Qwen3VLProcessor, in the same run.

Inputs: a 1920x1080 screenshot-like image, and a 30-second 30 fps clip (synthetic frames,
1280x720 by default) given as a (T, H, W, 3) uint8 array with its fps. Each measurement is the
full processor call (media + chat prompt → input_ids, pixel values, grids); median and min of
--repeat runs after one warm-up, the contenders interleaved round-robin. transformers (with
torch + torchvision) is optional: without it only our numbers are recorded, with a note.

    PYTHONPATH=. python benchmarks/bench_preprocess.py [--repeat 5] [--video-size 1280x720]
"""

import argparse
import json
import os
import platform
import statistics
import time
import warnings
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "tests" / "fixtures" / "tokenizer"  # the Qwen3-VL Instruct processor configs
RESULTS = ROOT / "benchmarks" / "results" / "preprocess.json"


def screenshot(width=1920, height=1080, seed=0):
    """A UI-like image: flat panels, buttons and rows of text."""
    rng = np.random.default_rng(seed)
    im = Image.new("RGB", (width, height), (242, 242, 247))
    draw = ImageDraw.Draw(im)
    draw.rectangle([0, 0, width, 48], fill=(30, 30, 36))
    for _ in range(40):
        x0, y0 = int(rng.integers(0, width - 200)), int(rng.integers(60, height - 80))
        color = tuple(int(c) for c in rng.integers(0, 256, 3))
        x1, y1 = x0 + int(rng.integers(60, 400)), y0 + int(rng.integers(24, 160))
        draw.rounded_rectangle([x0, y0, x1, y1], 8, fill=color)
    for y in range(70, height - 20, 22):
        line = "Settings  >  Network & Internet  >  Wi-Fi   [ On ]   Connected"
        draw.text((24 + (y * 7) % 300, y), line, fill=(20, 20, 20))
    return im


def clip(seconds=30, fps=30, width=1280, height=720):
    """A screen recording: a page scrolling under a moving cursor."""
    page = np.asarray(screenshot(width, height * 2, seed=1))
    frames = np.empty((seconds * fps, height, width, 3), np.uint8)
    for t in range(len(frames)):
        top = (t * 2) % height
        frames[t] = page[top: top + height]
        y, x = (t * 3) % (height - 16), (t * 5) % (width - 16)
        frames[t, y: y + 16, x: x + 16] = (255, 0, 0)
    return frames


def timed(calls, repeat):
    """Time each named call `repeat` times, round-robin, so that load from other work on the
    machine falls on all of them alike. One warm-up call each (imports, caches, allocator)."""
    for fn in calls.values():
        fn()
    times = {name: [] for name in calls}
    for _ in range(repeat):
        for name, fn in calls.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: {"median_s": round(statistics.median(t), 4), "min_s": round(min(t), 4), "runs": repeat}
            for name, t in times.items()}


def ours(image, frames, fps):
    """Our calls, and their outputs (for the agreement check)."""
    from mlx_qwen3vl.processor import Processor

    proc = Processor.from_pretrained(MODEL)

    def ask(kind, question):
        content = [{"type": kind}, {"type": "text", "text": question}]
        return proc.apply_chat_template([{"role": "user", "content": content}])

    image_prompt, video_prompt = ask("image", "Click Wi-Fi."), ask("video", "What changed?")
    calls = {
        "image": lambda: proc(text=image_prompt, images=[image]),
        "video": lambda: proc(text=video_prompt, videos=[frames], source_fps=fps),
    }
    return calls, (image_prompt, video_prompt)


def transformers_side(image, frames, fps, prompts):
    """transformers' calls (default torchvision backend and pillow image backend), or a note why not."""
    try:
        import torch  # noqa: F401
        from transformers import AutoProcessor
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
        from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
        from transformers.utils import logging
    except ImportError as e:
        return None, f"transformers' processor not run: {e} (needs torch + torchvision)"
    logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    default = AutoProcessor.from_pretrained(str(MODEL))
    pil = Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessorPil.from_pretrained(str(MODEL)),
        tokenizer=default.tokenizer, video_processor=default.video_processor, chat_template=default.chat_template,
    )
    image_prompt, video_prompt = prompts
    video_kw = {"video_metadata": [{"fps": fps, "total_num_frames": len(frames)}], "do_sample_frames": True,
                "cap_pixels_per_frame": True, "return_tensors": "np"}
    return {
        "transformers_image_torchvision_backend":
            lambda: default(text=[image_prompt], images=[image], return_tensors="np"),
        "transformers_image_pillow_backend": lambda: pil(text=[image_prompt], images=[image], return_tensors="np"),
        "transformers_video": lambda: default(text=[video_prompt], videos=[frames], **video_kw),
    }, None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--video-size", default="1280x720")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    vw, vh = (int(v) for v in args.video_size.split("x"))
    fps = 30

    load_at_start = os.getloadavg()[0]
    image = screenshot()
    frames = clip(30, fps, vw, vh)
    mine, prompts = ours(image, frames, fps)
    theirs, note = transformers_side(image, frames, fps, prompts)
    times = timed({**mine, **(theirs or {})}, args.repeat)
    image_out, video_out = mine["image"](), mine["video"]()

    import PIL
    import transformers

    report = {
        "inputs": {
            "image": "1920x1080 RGB screenshot-like (PIL.Image), full processor call with a chat prompt",
            "video": f"30 s at {fps} fps, {vw}x{vh}, (T, H, W, 3) uint8 array with source_fps={fps}, sampled at 2 fps",
            "image_grid_thw": image_out["image_grid_thw"].tolist(),
            "video_grid_thw": video_out["video_grid_thw"].tolist(),
            "input_tokens": {"image": image_out["input_ids"].shape[1], "video": video_out["input_ids"].shape[1]},
        },
        "ours": {"image": times["image"], "video": times["video"]},
        "machine": {
            "platform": platform.platform(), "machine": platform.machine(), "processor": platform.processor(),
            "cpu_count": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__,
            "pillow": PIL.__version__, "transformers": transformers.__version__,
            # other work on the machine inflates times; the min over runs is the least affected
            "load_average_1m_at_start_and_end": [load_at_start, os.getloadavg()[0]],
        },
    }
    if theirs is not None:
        import torch

        report["transformers"] = {
            "image_torchvision_backend": times["transformers_image_torchvision_backend"],
            "image_pillow_backend": times["transformers_image_pillow_backend"],
            "video": times["transformers_video"],
            "torch_threads": torch.get_num_threads(),
        }
        report["machine"]["torch"] = torch.__version__
        pairs = {"image_vs_torchvision_backend": ("transformers_image_torchvision_backend", "image"),
                 "image_vs_pillow_backend": ("transformers_image_pillow_backend", "image"),
                 "video": ("transformers_video", "video")}
        report["speedup"] = {  # transformers' time / ours; > 1 means ours is faster
            stat: {name: round(times[t][stat] / times[o][stat], 2) for name, (t, o) in pairs.items()}
            for stat in ("median_s", "min_s")
        }
        ref_image, ref_video = theirs["transformers_image_pillow_backend"](), theirs["transformers_video"]()
        report["agreement"] = {
            "image_input_ids_equal": bool(np.array_equal(ref_image["input_ids"], image_out["input_ids"])),
            "image_pixels_max_abs_diff_vs_pillow_backend":
                float(np.abs(ref_image["pixel_values"] - image_out["pixel_values"]).max()),
            "video_input_ids_equal": bool(np.array_equal(ref_video["input_ids"], video_out["input_ids"])),
            "video_pixels_max_abs_diff":
                float(np.abs(ref_video["pixel_values_videos"] - video_out["pixel_values_videos"]).max()),
        }
    else:
        report["note"] = note
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
