"""The worker of mlx-vlm: its own load, stream_generate and vision tower on our preprocessed
inputs; its default dtype, or a like-for-like dtype with our BLAS loaded."""

import time

import numpy as np

from mlx_qwen3vl.bench import engine_mlx_vlm as vlm  # the installed benchmark's mlx-vlm runner

from .measure import engine_info, fmt, log, rss_peak_gb, time_workload
from .workloads import AGENT_SYSTEM, WARMUP, agent_turns


def worker_mlx_vlm(args, spec):
    if spec.get("same_blas"):
        import mlx_qwen3vl.blas as blas  # the same optimized BLAS as ours, before mlx.core

        blas_note = blas.describe()
    else:
        blas_note = "MLX's bundled BLAS (nothing preloaded)"
    import mlx.core as mx

    info = engine_info("mlx-vlm", "mlx_vlm")
    info["blas"] = blas_note
    tic = time.perf_counter()
    model, processor = vlm.load_ignoring_eos(spec["model"])  # EOS ignored: a fixed number of decode tokens
    if spec.get("dtype"):
        model.set_dtype(getattr(mx, spec["dtype"]))
        mx.eval(model.parameters())
    info.update(load_s=time.perf_counter() - tic, dtype=str(model.language_model.model.norm.weight.dtype).replace("mlx.core.", ""))

    vision_time = []
    # The class of this model's own tower: the dense and the MoE model each have their own module.
    vision_class = type(model.vision_tower)
    orig_call = vision_class.__call__

    def timed_call(self, *a, **k):
        t = time.perf_counter()
        out = orig_call(self, *a, **k)
        mx.eval(out)
        vision_time.append(time.perf_counter() - t)
        return out

    data = np.load(spec["inputs"])
    for _ in vlm.tokens(model, processor, {"input_ids": data[WARMUP + "/input_ids"]}, 4):
        pass
    vision_class.__call__ = timed_call
    results = {}
    for name in spec["workloads"]:
        if name == "agent":
            continue
        inputs = {k.split("/", 1)[1]: data[k] for k in data.files if k.startswith(name + "/")}
        if name in spec.get("extrapolate", []):
            results[name] = mlx_vlm_extrapolated(model, inputs, name)
            log(f"[mlx-vlm] {name}: {fmt(results[name])}")
            continue

        def tokens(inputs=inputs):
            yield from vlm.tokens(model, processor, inputs, spec["decode_tokens"])

        results[name] = time_workload("mlx-vlm", name, inputs["input_ids"].shape[1], vision_time, tokens, spec)
    vision_class.__call__ = orig_call
    if "agent" in spec["workloads"]:
        results["agent"] = mlx_vlm_agent(model, processor, spec)
        log(f"[mlx-vlm] agent: {results['agent']['no_reuse']['total_s']:.1f} s")
    return {"info": info, "results": results}


def mlx_vlm_agent(model, vlm_processor, spec):
    """The agent loop as mlx-vlm's users can run it (mlx_qwen3vl.bench.engine_mlx_vlm.agent_loop):
    a fresh generate over the whole conversation each turn, the prompt built by our processor."""
    from mlx_qwen3vl import Processor

    processor = Processor.from_pretrained(spec["model"])
    fresh = vlm.agent_loop(model, vlm_processor, processor, agent_turns(spec), spec.get("agent_tokens", 8), AGENT_SYSTEM)
    for t, seconds in enumerate(fresh["turn_s"]):
        log(f"[mlx-vlm] agent turn {t + 1}: {seconds:.1f} s, prompt {fresh['prompt_tokens'][t]} (0 cached)")
    fresh["peak_memory_gb"] = max(fresh["peak_memory_gb"])  # one figure per loop, as the other engines give
    return dict(no_reuse=fresh, turns=fresh["turns"], tokens_per_turn=fresh["tokens_per_turn"])


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
                peak_rss_gb=rss_peak_gb(), extrapolated=True,
                parts=dict(embed_s=t_embed, vision_block_s=t_block, merger_s=t_merger, vision_depth=depth,
                           decoder_layer_s=t_layer, decoder_layers=len(lm.model.layers), head_s=t_head))
