"""The entry points: a prompt or conversation → inputs (render_prompt, encode_prompt), and
generate / stream_generate / batch_generate, each an Engine (engine/) run to completion.

`generate_step` gives fixed-length token streams of a batch (every row to max_tokens) on the same
engine, for the model's own tests and benchmarks. Reuse across turns lives in prompt_cache.py, sampling settings in sampling.py, the
CLI in __main__.py (`python -m mlx_qwen3vl`; `python -m mlx_qwen3vl.generate` runs the same
through generate/__main__.py: a package, so runpy finds the loop already imported by the
package's `generate` function without a warning).
"""

import time
from dataclasses import dataclass, field
from typing import Iterator, List, Optional

import mlx.core as mx
import numpy as np

from ..backend import backend_of
from ..engine import (AnswerText, Done, Engine, Failed, Request, Token, decode_step, eos_token_ids,  # noqa: F401
                      fit_to_context, prefill, sample, token_bytes)
from ..engine.drafting import NAMES as DRAFT_NAMES, pop_drafting
from ..errors import InputError
from ..kv_settings import FLOAT, FIELDS as KV_FIELDS, KVSettings, resolve
from ..processor import renamed_source_fps
from ..prompt_cache import PromptCache
from ..sampling import FIELD_NAMES, SamplingParams

TEMPLATE_MARKER = "<|im_start|>"


# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------
@dataclass
class GenerationResponse:
    """One streamed piece: the new text plus running statistics (mlx-lm's field names)."""

    text: str
    token: Optional[int]
    logprobs: Optional[mx.array]  # log-probabilities over the vocabulary for this step (V,)
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float  # GB
    finish_reason: Optional[str] = None  # "stop" (EOS or stop string) or "length", on the last piece
    from_draft: bool = False
    cached_tokens: int = 0  # prompt tokens reused from a previous turn's cache
    kv_cache_bytes: int = 0  # KV bytes in use: the request's cache buffers as allocated (float or quantized)
    draft_proposed: int = 0  # draft tokens proposed so far (speculative decoding)
    draft_accepted: int = 0  # of them, kept so far

    @property
    def peak_memory_gb(self):
        return self.peak_memory


@dataclass
class GenerationResult:
    text: str
    token_ids: List[int]
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float  # GB
    finish_reason: str
    cached_tokens: int = 0
    logprobs: List[float] = field(default_factory=list)  # of each chosen token
    kv_cache_bytes: int = 0  # KV bytes in use at the end: its cache buffers as allocated (a batch row: its share)
    draft_proposed: int = 0  # draft tokens proposed (speculative decoding)
    draft_accepted: int = 0  # of them, kept: tokens that came from a draft

    @property
    def peak_memory_gb(self):
        return self.peak_memory


# ---------------------------------------------------------------------------------------------
# Prompt → inputs
# ---------------------------------------------------------------------------------------------
def build_messages(prompt=None, images=(), videos=(), system=None):
    """One user turn: images and videos first, then the prompt text (as the CLI and mlx-vlm do)."""
    content = [{"type": "image"} for _ in images or ()] + [{"type": "video"} for _ in videos or ()]
    content.append({"type": "text", "text": prompt or ""})
    messages = [{"role": "system", "content": system}] if system else []
    return messages + [{"role": "user", "content": content}]


def render_prompt(processor, prompt=None, *, messages=None, images=None, videos=None, system=None,
                  templated=False, chat_template_kwargs=None):
    """(prompt text, images, videos) of one request. The rules, shared by every entry point:

    - `templated=True` marks `prompt` as already chat-templated text, used as it is (its image and
      video placeholders take `images` / `videos` in order); nothing else does. A plain prompt that
      contains `<|im_start|>` is refused rather than guessed at.
    - Otherwise `prompt` is the user's text, or `messages` the conversation (not both); media come
      from the messages' blocks, else from `images` / `videos`.
    - `system=` adds a system message first; with messages that already start with one it is an error.
    """
    images, videos = list(images or []), list(videos or [])
    if (prompt is None) == (messages is None):
        raise InputError("give either a prompt or messages (one of them)")
    if templated:
        if not isinstance(prompt, str):
            raise InputError("templated=True takes the templated text as prompt=, not messages=")
        if system is not None:
            raise InputError("system= cannot be added to an already templated prompt; put it in the text")
        return prompt, images, videos
    if messages is None:
        if not isinstance(prompt, str):
            raise InputError(f"prompt must be a string, not {type(prompt).__name__}")
        if TEMPLATE_MARKER in prompt:
            raise InputError(f"the prompt contains {TEMPLATE_MARKER}; if it is already chat-templated text, "
                             "pass templated=True, else remove the marker")
        messages = build_messages(prompt, images, videos, system)
    elif system is not None:
        if messages and isinstance(messages[0], dict) and messages[0].get("role") == "system":
            raise InputError("system= was given but the messages already start with a system message; give one")
        messages = [{"role": "system", "content": system}] + list(messages)
    from ..processor import extract_media

    found_images, found_videos = extract_media(messages)
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                         **(chat_template_kwargs or {}))
    return text, found_images or images, found_videos or videos


def encode_prompt(processor, prompt=None, *, messages=None, images=None, videos=None, fps=None, source_fps=None,
                  system=None, templated=False, min_pixels=None, max_pixels=None, sample_frames=True,
                  chat_template_kwargs=None, video_fps=None):
    """One request → processor inputs (see render_prompt for the rules). Videos: `fps` frames
    sampled per second, `source_fps` the frame rate of frames passed as a list (`video_fps` is
    its deprecated name)."""
    source_fps = renamed_source_fps(source_fps, video_fps)
    text, images, videos = render_prompt(processor, prompt, messages=messages, images=images, videos=videos,
                                         system=system, templated=templated,
                                         chat_template_kwargs=chat_template_kwargs)
    return processor(text=text, images=images or None, videos=videos or None, fps=fps, source_fps=source_fps,
                     sample_frames=sample_frames, min_pixels=min_pixels, max_pixels=max_pixels)


def check_context(model, inputs):
    """Refuse a prompt the model's positions do not reach, before any work is done (the engine's
    rule, fit_to_context; Engine.add applies it too, and stops answers at the context)."""
    fit_to_context(int(np.asarray(inputs["input_ids"]).shape[1]), 1,
                   int(model.config.text_config.max_position_embeddings))


# ---------------------------------------------------------------------------------------------
# Fixed-length token streams of a batch (on the engine's loop)
# ---------------------------------------------------------------------------------------------
def _generation_stream():
    # mlx_lm is imported on first use: importing it pulls in transformers (seconds of startup).
    from mlx_lm.generate import generation_stream

    return generation_stream


def split_rows(model, inputs) -> List[dict]:
    """A left-padded batch of processor outputs → one batch-1 inputs dict per row: its tokens
    without the padding, and its images and videos (taken in order, as the processor laid them
    out: a row's images are the image-token runs in it; a video of T temporal patches has T)."""
    ids = np.asarray(inputs["input_ids"])
    if ids.shape[0] == 1:
        return [inputs]
    real = np.asarray(inputs.get("attention_mask", np.ones_like(ids))).astype(bool)
    config = model.config
    media = [(config.image_token_id, "pixel_values", "image_grid_thw", False),
             (config.video_token_id, "pixel_values_videos", "video_grid_thw", True)]
    taken = {grid: [0, 0] for _, _, grid, _ in media}  # grid → [media taken, patches taken]
    rows = []
    for b in range(ids.shape[0]):
        row_ids = ids[b][real[b]]
        row = {"input_ids": row_ids[None], "attention_mask": np.ones((1, row_ids.size), np.int64)}
        if "mm_token_type_ids" in inputs:
            row["mm_token_type_ids"] = np.asarray(inputs["mm_token_type_ids"])[b][real[b]][None]
        for token, pixels, grid, by_frame in media:
            is_media = row_ids == token
            runs = int(np.sum(is_media[1:] & ~is_media[:-1]) + bool(is_media[:1].any()))
            first, patches = taken[grid]
            n = 0
            grids = np.asarray(inputs[grid]) if runs else None
            while runs > 0:
                runs -= int(grids[first + n][0]) if by_frame else 1
                n += 1
            if n:
                g = grids[first:first + n]
                count = int(np.prod(g, axis=1).sum())
                row[grid], row[pixels] = g, np.asarray(inputs[pixels])[patches:patches + count]
                taken[grid] = [first + n, patches + count]
        rows.append(row)
    return rows


def generate_step(model, processor, inputs, *, cache=None, sampling: Optional[SamplingParams] = None,
                  prefill_step_size=2048, on_vision_done=None, kv=FLOAT, **sampling_kwargs) -> Iterator[tuple]:
    """Yield (tokens (B,), log-probs (B, V)) one step at a time for the rows of `inputs` (processor
    outputs; a left-padded batch is split into its rows), every row running to `max_tokens` (EOS
    ignored): the fixed-length streams that tests compare with recorded references and benchmarks
    time. It runs the engine's own loop (one Engine, one request per row), so there is one token loop.

    `cache` (batch 1): the caller's KV cache (model.make_cache()), holding the prompt and the answer
    afterwards (its items replaced where the cache turned quantized). `kv` (KVSettings): how the
    cache is stored. `on_vision_done(seconds)`: the vision tower's time, once per prompt with media."""
    params = SamplingParams.build(sampling, **{"ignore_eos": True, **sampling_kwargs})
    kv = resolve(model, kv)
    rows = split_rows(model, inputs)
    if cache is not None and len(rows) != 1:
        raise InputError("generate_step keeps a caller's cache for one prompt only")
    for row in rows:
        check_context(model, row)
    engine = Engine(model, processor, max_batch=len(rows), prefill_step_size=prefill_step_size)
    ids = [engine.add(Request(row, params, cache=cache, kv=kv, on_vision_done=on_vision_done)) for row in rows]
    pending = {i: [] for i in ids}  # tokens of each row not yet handed out
    done = None
    try:
        while engine.busy:
            for event in engine.step():
                if isinstance(event, Failed):
                    raise event.error
                if isinstance(event, Done):
                    done = event
                elif isinstance(event, Token):
                    pending[event.id].append(event)
            while all(pending[i] for i in ids):  # a step every row has reached
                step = [pending[i].pop(0) for i in ids]
                yield mx.array([t.token for t in step]), mx.stack([t.logprobs for t in step])
    finally:
        for i in ids:
            if engine.busy:
                engine.cancel(i)
        while engine.busy:
            for event in engine.step():
                if isinstance(event, Done):
                    done = event
        if cache is not None and done is not None and done.cache is not None:
            cache[:] = done.cache
        if getattr(model, "group", None) is not None:
            # A step queued ahead holds collectives on a sharded model: finish it here, so whatever the
            # caller runs next (on any stream) pairs its collectives with the other ranks' in order.
            mx.synchronize(_generation_stream())


def generate_tokens(model, processor, inputs, **kwargs) -> Iterator[mx.array]:
    """generate_step's tokens alone (B,), for callers that need no log-probs."""
    for y, _ in generate_step(model, processor, inputs, **kwargs):
        yield y


def _sampling(sampling, kwargs) -> SamplingParams:
    return SamplingParams.build(sampling, **{k: kwargs.pop(k) for k in list(kwargs) if k in FIELD_NAMES})


# ---------------------------------------------------------------------------------------------
# User-facing API
# ---------------------------------------------------------------------------------------------
def stream_generate(model, processor, prompt=None, *, messages=None, images=None, videos=None, fps=None,
                    source_fps=None, video_fps=None, system=None, templated=False,
                    sampling: Optional[SamplingParams] = None,
                    prefill_step_size=2048, min_pixels=None, max_pixels=None, sample_frames=True,
                    prompt_cache: Optional[PromptCache] = None, chat_template_kwargs=None, inputs=None,
                    **sampling_kwargs) -> Iterator[GenerationResponse]:
    """Yield the answer piece by piece, each piece with running statistics; the last one carries
    finish_reason. Sampling settings come as `sampling=SamplingParams(...)` and/or as its field
    names (max_tokens, temperature, top_p, top_k, min_p, repetition_penalty, seed, stop, ...).

    With `prompt_cache`, the KV cache of earlier turns is reused for the longest prefix that holds
    the same tokens and the same images and videos, and only the rest is computed. `kv_bits` (4 or
    8), `kv_group_size` and `quantized_kv_start` quantize the KV cache (mlx-lm's meanings; see
    kv_settings.KVSettings: a group size that does not divide the head dimension is chosen down).
    `inputs` takes
    processor outputs instead of a prompt. Videos: `fps` is the sampling rate (frames kept per
    second), `source_fps` the rate of frames passed as a list; `video_fps` is `source_fps`'s
    deprecated name. Speculative decoding (lossless: the same answer, or the same distribution when
    sampling): `prompt_lookup=n` drafts from the longest n-gram (n down to 1) the prompt and answer
    already hold, `draft_model=` a smaller checkpoint of the same tokenizer (a loaded model, a path,
    or an engine.draft_model.DraftModel, which keeps its draft caches for later calls) runs its own
    prefill of the prompt and media and drafts greedily (or, sampling, by its own distribution),
    `drafter=` takes any object with `propose(token_ids, k)` (engine/speculative.py),
    `num_draft_tokens` drafts at most per step (default 4); each piece says `from_draft`.
    It runs on an Engine of its own (one request)."""
    source_fps = renamed_source_fps(source_fps, video_fps)
    for piece, _ in _stream(model, processor, prompt, messages=messages, images=images, videos=videos,
                            fps=fps, source_fps=source_fps, system=system, templated=templated, sampling=sampling,
                            prefill_step_size=prefill_step_size, min_pixels=min_pixels, max_pixels=max_pixels,
                            sample_frames=sample_frames, prompt_cache=prompt_cache,
                            chat_template_kwargs=chat_template_kwargs, inputs=inputs, **sampling_kwargs):
        yield piece


def _stream(model, processor, prompt=None, *, messages=None, images=None, videos=None, fps=None, source_fps=None,
            video_fps=None, system=None,
            templated=False, sampling=None, prefill_step_size=2048, min_pixels=None, max_pixels=None,
            sample_frames=True, prompt_cache=None, chat_template_kwargs=None, inputs=None, **sampling_kwargs):
    """stream_generate's pieces, each with the engine's Token event it came from."""
    source_fps = renamed_source_fps(source_fps, video_fps, stacklevel=4)
    params = _sampling(sampling, sampling_kwargs)
    kv = resolve(model, KVSettings.pop_from(sampling_kwargs))
    drafting = pop_drafting(sampling_kwargs)
    if sampling_kwargs:
        raise TypeError(f"stream_generate got unexpected argument(s) {', '.join(sorted(sampling_kwargs))}")
    if inputs is None:
        inputs = encode_prompt(processor, prompt, messages=messages, images=images, videos=videos,
                               fps=fps, source_fps=source_fps, system=system, templated=templated,
                               min_pixels=min_pixels, max_pixels=max_pixels, sample_frames=sample_frames,
                               chat_template_kwargs=chat_template_kwargs)
    ids = np.asarray(inputs["input_ids"])
    if ids.shape[0] != 1:
        raise InputError("stream_generate takes one prompt; use batch_generate for several")
    check_context(model, inputs)  # before the prompt cache is touched
    start = prompt_cache.reuse(inputs, kv, model.make_cache) if prompt_cache is not None else 0
    engine = Engine(model, processor, max_batch=1, prefill_step_size=prefill_step_size)
    rid = engine.add(Request(inputs, params, cache=prompt_cache.cache if prompt_cache is not None else None,
                             start=start, kv=kv, **drafting))
    mx.reset_peak_memory()
    tic = time.perf_counter()
    prompt_s, n, done = None, 0, None
    drafted = [0, 0]  # proposed, accepted

    def stats(kv_bytes):
        elapsed = time.perf_counter() - tic
        return dict(prompt_tokens=ids.shape[1], cached_tokens=start,
                    prompt_tps=(ids.shape[1] - start) / max(prompt_s, 1e-9), generation_tokens=n,
                    generation_tps=(n - 1) / max(elapsed - prompt_s, 1e-9) if n > 1 else 0.0,
                    peak_memory=mx.get_peak_memory() / 1e9, kv_cache_bytes=kv_bytes,
                    draft_proposed=drafted[0], draft_accepted=drafted[1])

    from mlx_lm.generate import wired_limit

    try:
        with wired_limit(model, [_generation_stream()]):
            while done is None:
                for event in engine.step():
                    if isinstance(event, Failed):
                        raise event.error
                    if isinstance(event, Done):
                        done = event
                        continue
                    if prompt_s is None:
                        prompt_s = time.perf_counter() - tic
                    n += 1
                    drafted[0] = engine.metrics["draft_proposed"]
                    drafted[1] += event.from_draft
                    yield GenerationResponse(text=event.text, token=event.token, logprobs=event.logprobs,
                                             finish_reason=event.finish_reason, from_draft=event.from_draft,
                                             **stats(event.kv_bytes)), event
    finally:
        if done is None and engine.busy:  # the caller stopped early: end the request, keep its cache
            engine.cancel(rid)
            for event in engine.step():
                if isinstance(event, Done):
                    done = event
        if getattr(model, "group", None) is not None:
            # A step queued ahead holds collectives on a sharded model: finish it here, so whatever the
            # caller runs next (on any stream) pairs its collectives with the other ranks' in order.
            mx.synchronize(_generation_stream())
        if prompt_cache is not None:
            if done is not None and done.cache is not None and done.cache[0].size() >= ids.shape[1]:
                prompt_cache.cache = done.cache
                prompt_cache.record(inputs, done.token_ids, kv)
            else:  # failed, or ended before its prefill: the cache holds what it held before
                prompt_cache.trim(start)


def generate(model, processor, prompt=None, **kwargs) -> GenerationResult:
    """Run to completion; see stream_generate for the arguments."""
    text, tokens, logprobs, last = "", [], [], None
    for last, event in _stream(model, processor, prompt, **kwargs):
        text += last.text
        tokens.append(last.token)
        logprobs.append(event.logprob)
    return GenerationResult(text=text, token_ids=tokens, logprobs=logprobs, prompt_tokens=last.prompt_tokens,
                            generation_tokens=last.generation_tokens, prompt_tps=last.prompt_tps,
                            generation_tps=last.generation_tps, peak_memory=last.peak_memory,
                            finish_reason=last.finish_reason, cached_tokens=last.cached_tokens,
                            kv_cache_bytes=last.kv_cache_bytes, draft_proposed=last.draft_proposed,
                            draft_accepted=last.draft_accepted)


REQUEST_KEYS = {"prompt", "messages", "images", "videos", "fps", "source_fps", "video_fps", "system",
                "templated"} | FIELD_NAMES | set(KV_FIELDS) | set(DRAFT_NAMES)


def batch_generate(model, processor, requests, *, sampling: Optional[SamplingParams] = None, prefill_step_size=2048,
                   min_pixels=None, max_pixels=None, **sampling_kwargs) -> List[GenerationResult]:
    """Several requests decoded together (one Engine run to completion, each prompt prefilled
    whole as it joins the running rows); each result equals that request run alone with generate(),
    sampling included (each request draws from its own random stream, seeded by its `seed`).

    A request is a dict with `prompt=` or `messages=` and optionally images, videos, fps,
    source_fps (video_fps, deprecated), system, templated (the rules of render_prompt), and any
    sampling field or kv_bits / kv_group_size / quantized_kv_start to override the batch's (seed,
    temperature, max_tokens, stop, ...); rows of different KV cache kinds decode in batches of
    their own. Speculative decoding's arguments (prompt_lookup, draft_model, drafter, num_draft_tokens; see
    stream_generate) apply to every request, or to one when given in its dict (rows with different
    drafters and k verify in one forward)."""
    base = _sampling(sampling, sampling_kwargs)
    base_kv = KVSettings.pop_from(sampling_kwargs)
    base_draft = {k: sampling_kwargs.pop(k) for k in DRAFT_NAMES if k in sampling_kwargs}
    checked = pop_drafting(dict(base_draft))  # checked once, before any work
    if base_draft.get("draft_model") is not None:  # a path loaded once for every request
        base_draft["draft_model"] = checked["drafter"]
    if sampling_kwargs:
        raise TypeError(f"batch_generate got unexpected argument(s) {', '.join(sorted(sampling_kwargs))}")
    prepared = []
    for i, r in enumerate(requests):
        if not isinstance(r, dict) or set(r) - REQUEST_KEYS:
            extra = sorted(set(r) - REQUEST_KEYS) if isinstance(r, dict) else type(r).__name__
            raise InputError(f"request {i + 1}: unexpected {extra}; use keys among {', '.join(sorted(REQUEST_KEYS))}")
        params = SamplingParams.build(base, **{k: r[k] for k in r if k in FIELD_NAMES})
        text, found_i, found_v = render_prompt(processor, r.get("prompt"), messages=r.get("messages"),
                                               images=r.get("images"), videos=r.get("videos"),
                                               system=r.get("system"), templated=r.get("templated", False))
        source_fps = renamed_source_fps(r.get("source_fps"), r.get("video_fps"))
        kv = resolve(model, KVSettings.pop_from({k: r[k] for k in r if k in KV_FIELDS}, base_kv))
        drafting = pop_drafting({**base_draft, **{k: r[k] for k in r if k in DRAFT_NAMES}})
        prepared.append((text, found_i, found_v, r.get("fps"), source_fps, params, kv, drafting))
    if not prepared:
        return []
    engine = Engine(model, processor, max_batch=len(prepared), prefill_step_size=prefill_step_size)
    ids = []
    for text, found_i, found_v, fps, source_fps, params, kv, drafting in prepared:
        inputs = processor(text=text, images=found_i or None, videos=found_v or None, fps=fps, source_fps=source_fps,
                           min_pixels=min_pixels, max_pixels=max_pixels)
        ids.append(engine.add(Request(inputs, params, kv=kv, **drafting)))
    mx.reset_peak_memory()
    tic = time.perf_counter()
    first, done = set(), {}
    prompt_s = None
    from mlx_lm.generate import wired_limit

    with wired_limit(model, [_generation_stream()]):
        while engine.busy:
            for event in engine.step():
                if isinstance(event, Failed):
                    raise event.error
                if isinstance(event, Done):
                    done[event.id] = event
                elif event.id not in first:
                    first.add(event.id)
                    if len(first) == len(ids):
                        prompt_s = time.perf_counter() - tic
    total = time.perf_counter() - tic
    prompt_s = prompt_s or total
    results = [done[i] for i in ids]
    prompt_tokens = sum(d.prompt_tokens for d in results)
    generated = sum(len(d.token_ids) for d in results)
    return [GenerationResult(
        text=d.text, token_ids=d.token_ids, logprobs=d.logprobs, prompt_tokens=d.prompt_tokens,
        generation_tokens=len(d.token_ids), prompt_tps=prompt_tokens / max(prompt_s, 1e-9),
        generation_tps=generated / max(total - prompt_s, 1e-9), peak_memory=mx.get_peak_memory() / 1e9,
        finish_reason=d.finish_reason, kv_cache_bytes=d.kv_bytes, draft_proposed=d.draft_proposed,
        draft_accepted=d.draft_accepted) for d in results]
