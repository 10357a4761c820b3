"""The token loop: chunked prefill, KV-cached decode, sampling, streaming and batching.

The pieces follow gpt-fast's shape: `prefill` (vision once, then the prompt in chunks),
`decode_step` (one token through the cache) and `sample`, composed by `generate_step`. Reuse
across turns lives in prompt_cache.py, sampling settings in sampling.py, the CLI in __main__.py
(`python -m mlx_qwen3vl`; `python -m mlx_qwen3vl.generate` runs the same through
generate/__main__.py: a package, so runpy finds the loop already imported by the package's
`generate` function without a warning).
"""

import re
import time
from dataclasses import dataclass, field
from typing import Iterator, List, Optional

import mlx.core as mx
import numpy as np

from ..backend import backend_of
from ..errors import ContextLengthError, InputError
from ..processor import renamed_source_fps
from ..prompt_cache import PromptCache, media_after
from ..sampling import FIELD_NAMES, Sampler, SamplingParams

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
    """Refuse a prompt the model's positions do not reach, before any work is done."""
    limit = model.config.text_config.max_position_embeddings
    n = int(np.asarray(inputs["input_ids"]).shape[1])
    if n >= limit:
        raise ContextLengthError(f"the prompt is {n} tokens but the model's context is {limit} "
                                 "(max_position_embeddings); shorten it or use fewer or smaller images", n, limit)


# ---------------------------------------------------------------------------------------------
# Prefill, decode, sample
# ---------------------------------------------------------------------------------------------
def _generation_stream():
    # mlx_lm is imported on first use: importing it pulls in transformers (seconds of startup).
    from mlx_lm.generate import generation_stream

    return generation_stream


def prefill(model, inputs, cache, *, start=0, prefill_step_size=2048, on_vision_done=None):
    """Encode the new images/videos once, then run prompt positions [start, L) through the decoder
    in chunks of `prefill_step_size`, so activations stay bounded for long prompts.

    `on_vision_done(seconds)`, when given and the prompt has new media, is called with the vision
    tower's time; it evaluates the features before the prompt (one extra sync), so it is for
    measuring, not for normal runs.

    Returns (logits of the last position (B, V), next 1D position per sequence (B,)). DeepStack
    tensors are sliced with the chunk, so features land on the right positions across chunks."""
    media = media_after(inputs, start)
    tic = time.perf_counter()
    image_features = video_features = None
    if "pixel_values" in media:
        image_features = model.get_image_features(media["pixel_values"], media["image_grid_thw"])
    if "pixel_values_videos" in media:
        video_features = model.get_video_features(media["pixel_values_videos"], media["video_grid_thw"])
    features = [f for f in (image_features, video_features) if f is not None]
    if on_vision_done is not None and features:
        mx.eval([[f.embeds, *f.deepstack] for f in features])
        on_vision_done(time.perf_counter() - tic)
    prepared = model.prepare_inputs(
        inputs["input_ids"], inputs.get("attention_mask"), image_grid_thw=inputs.get("image_grid_thw"),
        video_grid_thw=inputs.get("video_grid_thw"), mm_token_type_ids=inputs.get("mm_token_type_ids"),
        image_features=image_features, video_features=video_features,
        start=start,
    )
    mask = _mask_or_none(inputs)
    n = prepared.inputs_embeds.shape[1]
    step = max(1, int(prefill_step_size))
    for s in range(0, n, step):
        e = min(n, s + step)
        hidden = model.decode_hidden(prepared, mask, cache, s, e)
        if e < n:
            mx.eval([c.state for c in cache])
            mx.clear_cache()
    logits = model.logits(hidden[:, -1, :])
    real = np.asarray(inputs["attention_mask"]).sum(-1) if "attention_mask" in inputs else np.full(
        logits.shape[0], np.asarray(inputs["input_ids"]).shape[-1])
    next_positions = prepared.rope_deltas[:, 0] + mx.array(real)
    return logits, next_positions


def _mask_or_none(inputs):
    """Padding masks matter only for batches that have padding; otherwise use the causal fast path."""
    mask = inputs.get("attention_mask")
    if mask is None or np.asarray(mask).all():
        return None
    return mx.array(np.asarray(mask))


def decode_step(model, tokens, cache, positions, key_mask=None):
    """tokens (B,) → logits (B, V). Decode tokens are text, so their T = H = W position is the
    1D `positions` (cache offset + rope delta) and mRoPE reduces to mx.fast.rope with an offset."""
    embeds = model.language_model.embed_tokens(tokens[:, None])
    mask = None if key_mask is None else model.make_mask(key_mask, 1, key_mask.shape[1])
    hidden = model.language_model(embeds, positions, mask, cache)
    return model.logits(hidden[:, -1, :])


def sample(logits, sampler, histories, log_softmax):
    """logits (B, V) → tokens (B,), log-probs (B, V).

    `sampler` is one function over the batch's log-probs (e.g. mlx-lm's make_sampler), or one
    `Sampler` per row: each applies its repetition penalty to its own row's history (real tokens
    only, never the left-padding) and draws from its own random stream."""
    if callable(sampler):
        logprobs = log_softmax(logits)
        return sampler(logprobs), logprobs
    if any(s.processors for s in sampler):
        logits = mx.concatenate([s.process(h, logits[b: b + 1]) for b, (s, h) in enumerate(zip(sampler, histories))])
    logprobs = log_softmax(logits)
    if all(s.greedy for s in sampler):
        return mx.argmax(logprobs, axis=-1), logprobs
    return mx.concatenate([s(logprobs[b: b + 1]) for b, s in enumerate(sampler)]), logprobs


def generate_step(model, inputs, cache, *, sampler, max_tokens=256, start=0, prefill_step_size=2048,
                  on_vision_done=None, on_prefill_done=None) -> Iterator[tuple]:
    """Yield (tokens (B,), log-probs (B, V)) one step at a time. A yielded token may or may not
    have been fed into `cache` yet (see `eager` below); callers keeping the cache trim it to what
    they keep. `on_vision_done(seconds)` (see prefill) and `on_prefill_done()` are timing hooks."""
    stream = _generation_stream()
    backend = backend_of(model)
    with mx.stream(stream):
        logits, positions = prefill(model, inputs, cache, start=start, prefill_step_size=prefill_step_size,
                                    on_vision_done=on_vision_done)
        key_mask = _mask_or_none(inputs)
        histories = None
        if not callable(sampler) and any(s.processors for s in sampler):
            ids = np.asarray(inputs["input_ids"])
            real = np.asarray(inputs.get("attention_mask", np.ones_like(ids))).astype(bool)
            histories = [mx.array(ids[b][real[b]]) for b in range(ids.shape[0])]
        y, logprobs = sample(logits, sampler, histories, backend.log_softmax)
        mx.async_eval(y, logprobs)
    if on_prefill_done:
        mx.eval(y)
        on_prefill_done()
    # With the CPU path the forward runs eagerly (it evaluates as it goes), so the next token
    # is computed after this one is handed out; on a GPU its graph is queued first, so the device
    # works while the caller handles the token.
    eager = backend.eager

    def advance(y):
        nonlocal key_mask, histories, positions
        with mx.stream(stream):
            if key_mask is not None:
                key_mask = mx.concatenate([key_mask, mx.ones((key_mask.shape[0], 1), key_mask.dtype)], axis=1)
            if histories is not None:
                histories = [mx.concatenate([h, y[b: b + 1]]) for b, h in enumerate(histories)]
            logits = decode_step(model, y, cache, positions, key_mask)
            positions = positions + 1
            step = sample(logits, sampler, histories, backend.log_softmax)
            mx.async_eval(*step)
        return step

    try:
        for n in range(max_tokens):
            last = n + 1 == max_tokens
            ahead = None if eager or last else advance(y)
            yield y, logprobs
            if not last:
                y, logprobs = advance(y) if ahead is None else ahead
            if n % 256 == 255:
                mx.clear_cache()
    finally:
        if getattr(model, "group", None) is not None:
            # A caller that stops early (EOS, stop string, break) leaves a step queued ahead, and on a
            # sharded model that step holds collectives: finish it here, so whatever the caller runs
            # next (on any stream) pairs its collectives with the other ranks' in the same order.
            mx.synchronize(stream)


def generate_tokens(model, inputs, cache, **kwargs) -> Iterator[mx.array]:
    """generate_step's tokens alone (B,), for callers that need no log-probs."""
    for y, _ in generate_step(model, inputs, cache, **kwargs):
        yield y


# ---------------------------------------------------------------------------------------------
# Tokens → text
# ---------------------------------------------------------------------------------------------
def eos_token_ids(model, processor) -> set:
    """The checkpoint's EOS ids (generation_config.json) and the tokenizer's."""
    ids = set(model.config.eos_token_ids)
    if processor.tokenizer.eos_token_id is not None:
        ids.add(processor.tokenizer.eos_token_id)
    return ids


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_bytes(tokenizer, token: int) -> bytes:
    """The bytes one token stands for (OpenAI's logprobs `bytes`). A token that is part of a UTF-8
    character decodes alone to U+FFFD; its own bytes come from the vocabulary instead: byte-level
    BPE pieces (Qwen's) through mlx-lm's byte table, SentencePiece byte tokens (`<0xB7>`) by value."""
    from mlx_lm.tokenizer_utils import _byte_decoder

    text = tokenizer.decode([int(token)])
    if "\ufffd" not in text:
        return text.encode("utf-8")
    piece = tokenizer.convert_ids_to_tokens(int(token)) or ""
    m = _BYTE_TOKEN.fullmatch(piece)
    if m:
        return bytes([int(m.group(1), 16)])
    table = _byte_decoder()
    if piece and all(c in table for c in piece):
        return bytes(table[c] for c in piece)
    return text.encode("utf-8")


class AnswerText:
    """One request's answer as it streams: mlx-lm's streaming detokenizer (multi-byte characters
    never break), EOS tokens (unless `ignore_eos`) and stop strings end it, max_tokens bounds it. Text that could still
    turn out to be the start of a stop string is held back until it is decided, so the streamed
    pieces always add up to the final text."""

    def __init__(self, processor, stop_ids, params: SamplingParams):
        from mlx_lm.tokenizer_utils import TokenizerWrapper

        self.detok = TokenizerWrapper(processor.tokenizer).detokenizer
        self.detok.reset()
        self.stop_ids = frozenset() if params.ignore_eos else stop_ids
        self.stops, self.max_tokens = params.stop_strings, params.max_tokens
        self.tokens, self.text, self.pending, self.finish = [], "", "", None

    def _held(self, text):
        """Length of the longest end of `text` that begins some stop string."""
        return max((k for s in self.stops for k in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:k])), default=0)

    def add(self, token: int) -> str:
        """Take one token; return the text it releases (self.finish says whether it ended)."""
        self.tokens.append(token)
        if token in self.stop_ids:
            self.finish = "stop"
        else:
            self.detok.add_token(token)
        if self.finish is None and len(self.tokens) >= self.max_tokens:
            self.finish = "length"
        if self.finish:
            self.detok.finalize()
        pending = self.pending + self.detok.last_segment
        hits = [i for i in (pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            pending, self.finish = pending[:min(hits)], "stop"
        keep = 0 if self.finish else self._held(pending)
        piece, self.pending = pending[:len(pending) - keep], pending[len(pending) - keep:]
        self.text += piece
        return piece


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
    the same tokens and the same images and videos, and only the rest is computed. `inputs` takes
    processor outputs instead of a prompt. Videos: `fps` is the sampling rate (frames kept per
    second), `source_fps` the rate of frames passed as a list; `video_fps` is `source_fps`'s
    deprecated name."""
    source_fps = renamed_source_fps(source_fps, video_fps)
    params = _sampling(sampling, sampling_kwargs)
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
    check_context(model, inputs)
    start = prompt_cache.reuse(inputs) if prompt_cache is not None else 0
    cache = prompt_cache.cache if prompt_cache is not None else model.make_cache()
    answer = AnswerText(processor, eos_token_ids(model, processor), params)
    mx.reset_peak_memory()
    tic = time.perf_counter()
    timing = {}

    def stats():
        prompt_s = timing.get("prompt", 1e-9)
        n = len(answer.tokens)
        return dict(prompt_tokens=ids.shape[1], cached_tokens=start,
                    prompt_tps=(ids.shape[1] - start) / max(prompt_s, 1e-9), generation_tokens=n,
                    generation_tps=(n - 1) / max(time.perf_counter() - tic - prompt_s, 1e-9) if n > 1 else 0.0,
                    peak_memory=mx.get_peak_memory() / 1e9)

    from mlx_lm.generate import wired_limit

    prefilled = False
    try:
        with wired_limit(model, [_generation_stream()]):
            for y, logprobs in generate_step(
                    model, inputs, cache, sampler=[Sampler(params)], max_tokens=params.max_tokens, start=start,
                    prefill_step_size=prefill_step_size,
                    on_prefill_done=lambda: timing.setdefault("prompt", time.perf_counter() - tic)):
                prefilled = True
                token = int(y.item())
                piece = answer.add(token)
                yield GenerationResponse(text=piece, token=token, logprobs=logprobs[0],
                                         finish_reason=answer.finish, **stats())
                if answer.finish:
                    break
    finally:
        if prompt_cache is not None:
            if prefilled:
                prompt_cache.record(inputs, answer.tokens)
            else:  # prefill failed part way: keep what the cache held before it
                prompt_cache.trim(start)


def generate(model, processor, prompt=None, **kwargs) -> GenerationResult:
    """Run to completion; see stream_generate for the arguments."""
    text, tokens, logprobs, last = "", [], [], None
    for last in stream_generate(model, processor, prompt, **kwargs):
        text += last.text
        tokens.append(last.token)
        logprobs.append(float(last.logprobs[last.token]))
    return GenerationResult(text=text, token_ids=tokens, logprobs=logprobs, prompt_tokens=last.prompt_tokens,
                            generation_tokens=last.generation_tokens, prompt_tps=last.prompt_tps,
                            generation_tps=last.generation_tps, peak_memory=last.peak_memory,
                            finish_reason=last.finish_reason, cached_tokens=last.cached_tokens)


REQUEST_KEYS = {"prompt", "messages", "images", "videos", "fps", "source_fps", "video_fps", "system",
                "templated"} | FIELD_NAMES


def batch_generate(model, processor, requests, *, sampling: Optional[SamplingParams] = None, prefill_step_size=2048,
                   min_pixels=None, max_pixels=None, **sampling_kwargs) -> List[GenerationResult]:
    """Several requests as one left-padded batch with per-sequence rope deltas; each result equals
    that request run alone with generate(), sampling included (each request draws from its own
    random stream, seeded by its `seed`).

    A request is a dict with `prompt=` or `messages=` and optionally images, videos, fps,
    source_fps (video_fps, deprecated), system, templated (the rules of render_prompt), and any
    sampling field to override the batch's (seed, temperature, max_tokens, stop, ...)."""
    base = _sampling(sampling, sampling_kwargs)
    if sampling_kwargs:
        raise TypeError(f"batch_generate got unexpected argument(s) {', '.join(sorted(sampling_kwargs))}")
    texts, images, videos, fps, source_fps, params = [], [], [], [], [], []
    for i, r in enumerate(requests):
        if not isinstance(r, dict) or set(r) - REQUEST_KEYS:
            extra = sorted(set(r) - REQUEST_KEYS) if isinstance(r, dict) else type(r).__name__
            raise InputError(f"request {i + 1}: unexpected {extra}; use keys among {', '.join(sorted(REQUEST_KEYS))}")
        params.append(SamplingParams.build(base, **{k: r[k] for k in r if k in FIELD_NAMES}))
        text, found_i, found_v = render_prompt(processor, r.get("prompt"), messages=r.get("messages"),
                                               images=r.get("images"), videos=r.get("videos"),
                                               system=r.get("system"), templated=r.get("templated", False))
        texts.append(text)
        images += found_i
        videos += found_v
        fps += [r.get("fps")] * len(found_v)
        source_fps += [renamed_source_fps(r.get("source_fps"), r.get("video_fps"))] * len(found_v)
    if not texts:
        return []
    inputs = processor(text=texts, images=images or None, videos=videos or None, fps=fps or None,
                       source_fps=source_fps or None,
                       min_pixels=min_pixels, max_pixels=max_pixels, padding=True)
    check_context(model, inputs)
    stop_ids = eos_token_ids(model, processor)
    answers = [AnswerText(processor, stop_ids, p) for p in params]
    chosen = [[] for _ in answers]
    mx.reset_peak_memory()
    tic = time.perf_counter()
    timing = {}
    from mlx_lm.generate import wired_limit

    with wired_limit(model, [_generation_stream()]):
        for y, logprobs in generate_step(
                model, inputs, model.make_cache(), sampler=[Sampler(p) for p in params],
                max_tokens=max(p.max_tokens for p in params), prefill_step_size=prefill_step_size,
                on_prefill_done=lambda: timing.setdefault("prompt", time.perf_counter() - tic)):
            tokens = y.tolist()
            for b, answer in enumerate(answers):
                if answer.finish is None:
                    answer.add(tokens[b])
                    chosen[b].append(float(logprobs[b, tokens[b]]))
            if all(a.finish for a in answers):
                break
    total = time.perf_counter() - tic
    real = np.asarray(inputs["attention_mask"]).sum(-1)
    generated = sum(len(a.tokens) for a in answers)
    return [GenerationResult(
        text=a.text, token_ids=a.tokens, logprobs=chosen[b], prompt_tokens=int(real[b]),
        generation_tokens=len(a.tokens), prompt_tps=float(real.sum()) / timing["prompt"],
        generation_tps=generated / max(total - timing["prompt"], 1e-9),
        peak_memory=mx.get_peak_memory() / 1e9, finish_reason=a.finish or "length") for b, a in enumerate(answers)]

