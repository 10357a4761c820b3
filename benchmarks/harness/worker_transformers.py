"""The worker of transformers (torch CPU): generate with a streamer as the clock and forward
hooks on the vision tower."""

import gc
import time

import numpy as np

from .measure import engine_info, fmt, log, rss_peak_gb, rss_reset, start_clock, summarize, workload_bandwidth
from .workloads import WARMUP


def worker_transformers(args, spec):
    import torch
    from transformers import AutoModelForImageTextToText

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
        rss_reset()
        vision_time.clear()
        clock = Clock()
        start_clock()
        tic = time.perf_counter()
        with torch.inference_mode():
            model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False, streamer=clock,
                           temperature=None, top_p=None, top_k=None)
        ttft = clock.times[0] - tic
        results[name] = summarize(name, inputs["input_ids"].shape[1], sum(vision_time), ttft, clock.times,
                                   rss_peak_gb())
        results[name]["bandwidth_gbs"] = workload_bandwidth(spec)
        log(f"[transformers] {name}: {fmt(results[name])}")
    return {"info": info, "results": results}
