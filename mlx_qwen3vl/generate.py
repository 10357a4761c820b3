"""Generation: chunked prefill, KV-cached decode, sampling, streaming, batching, multi-turn reuse,
and the command line (`python -m mlx_qwen3vl.generate`).

The pieces follow gpt-fast's shape: `prefill` (vision once, then the prompt in chunks),
`decode_step` (one token through the cache) and `sample`, composed by `generate_tokens`.
"""

import argparse
import sys
import time
from dataclasses import dataclass, field
from typing import Iterator, List, Optional

import mlx.core as mx
import numpy as np

from .backend import backend_of
from .errors import InputError, Qwen3VLError
from .positions import IMAGE, VIDEO

DEFAULT_MODEL = "Qwen/Qwen3-VL-2B-Instruct"


# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------
@dataclass
class GenerationResponse:
    """One streamed piece: the new text plus running statistics."""

    text: str
    token: Optional[int]
    prompt_tokens: int
    generation_tokens: int
    prompt_tps: float
    generation_tps: float
    peak_memory_gb: float
    finish_reason: Optional[str] = None  # "stop" (EOS or stop string) or "length", on the last piece
    cached_tokens: int = 0  # prompt tokens reused from a previous turn's cache


@dataclass
class GenerationResult:
    text: str
    token_ids: List[int]
    prompt_tokens: int
    generation_tokens: int
    prompt_tps: float
    generation_tps: float
    peak_memory_gb: float
    finish_reason: str
    cached_tokens: int = 0


@dataclass
class PromptCache:
    """KV cache plus the token ids it holds, kept between turns of one conversation (batch 1)."""

    cache: list
    tokens: List[int] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# Prompt → inputs
# ---------------------------------------------------------------------------------------------
def build_messages(prompt=None, images=(), videos=(), system=None):
    """One user turn: images and videos first, then the prompt text (as the CLI and mlx-vlm do)."""
    content = [{"type": "image"} for _ in images or ()] + [{"type": "video"} for _ in videos or ()]
    content.append({"type": "text", "text": prompt or ""})
    messages = [{"role": "system", "content": system}] if system else []
    return messages + [{"role": "user", "content": content}]


def encode_prompt(processor, prompt=None, *, messages=None, images=None, videos=None, video_fps=None,
                  system=None, min_pixels=None, max_pixels=None, sample_frames=True, chat_template_kwargs=None):
    """A raw prompt string (already templated), or a user prompt / messages → processor inputs."""
    images = list(images or [])
    videos = list(videos or [])
    if messages is None and prompt is None:
        raise InputError("give a prompt or messages")
    if messages is None and ("<|im_start|>" in prompt):
        text = prompt  # already a templated prompt
    else:
        if messages is None:
            messages = build_messages(prompt, images, videos, system)
        from .processor import extract_media

        found_images, found_videos = extract_media(messages)
        images = found_images or images
        videos = found_videos or videos
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                             **(chat_template_kwargs or {}))
    return processor(text=text, images=images or None, videos=videos or None, video_fps=video_fps,
                     sample_frames=sample_frames, min_pixels=min_pixels, max_pixels=max_pixels)


def _vision_runs(types: np.ndarray):
    """[(kind, start, end)] of each run of image/video placeholder tokens in one sequence."""
    runs, i = [], 0
    while i < len(types):
        if types[i] != 0:
            j = i
            while j < len(types) and types[j] == types[i]:
                j += 1
            runs.append((int(types[i]), i, j))
            i = j
        else:
            i += 1
    return runs


def _media_split(inputs, start):
    """Move `start` back so no image/video is split by the cached prefix; return the new start and,
    per kind, the index of the first image/video (and its first pixel row) after it."""
    types = np.asarray(inputs["mm_token_type_ids"])[0]
    runs = _vision_runs(types)
    video_groups = np.asarray(inputs["video_grid_thw"])[:, 0] if "video_grid_thw" in inputs else np.zeros(0, int)
    # Each video has t frame-group runs; map run → media index.
    owner, counters = [], {IMAGE: 0, VIDEO: 0}
    video_run = 0
    for kind, s, e in runs:
        if kind == IMAGE:
            owner.append(counters[IMAGE])
            counters[IMAGE] += 1
        else:
            idx = int(np.searchsorted(np.cumsum(video_groups), video_run, side="right"))
            owner.append(idx)
            video_run += 1
    first_new = {IMAGE: counters[IMAGE], VIDEO: len(video_groups)}
    for (kind, s, e), idx in zip(runs, owner):
        if e > start:
            first_new[kind] = min(first_new[kind], idx)
    for (kind, s, e), idx in zip(runs, owner):  # back off to the first run of a partly cached media
        if idx >= first_new[kind]:
            start = min(start, s)
    return start, first_new


def _slice_media(inputs, first_new):
    """Pixel rows and grids of the images / videos from `first_new` on."""
    out = {}
    for kind, px, grid in ((IMAGE, "pixel_values", "image_grid_thw"), (VIDEO, "pixel_values_videos", "video_grid_thw")):
        if grid not in inputs:
            continue
        grids = np.asarray(inputs[grid])
        k = first_new[kind]
        if k >= len(grids):
            continue
        row = int(grids[:k].prod(-1).sum())
        out[px], out[grid] = np.asarray(inputs[px])[row:], grids[k:]
    return out


# ---------------------------------------------------------------------------------------------
# Prefill, decode, sample
# ---------------------------------------------------------------------------------------------
def prefill(model, inputs, cache, *, start=0, prefill_step_size=2048):
    """Encode the new images/videos once, then run prompt positions [start, L) through the decoder
    in chunks of `prefill_step_size`, so activations stay bounded for long prompts.

    Returns (logits of the last position (B, V), next 1D position per sequence (B,)). DeepStack
    tensors are sliced with the chunk, so features land on the right positions across chunks."""
    media = _slice_media(inputs, _media_split(inputs, start)[1]) if start else inputs
    image_features = video_features = None
    if "pixel_values" in media:
        image_features = model.get_image_features(media["pixel_values"], media["image_grid_thw"])
    if "pixel_values_videos" in media:
        video_features = model.get_video_features(media["pixel_values_videos"], media["video_grid_thw"])
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


def sample(logits, sampler, logits_processors, history, log_softmax):
    """logits (B, V) → tokens (B,), log-probs (B, V). Processors (e.g. repetition penalty) see each
    sequence's own history."""
    if logits_processors:
        rows = []
        for b in range(logits.shape[0]):
            row = logits[b: b + 1]
            for proc in logits_processors:
                row = proc(history[b], row)
            rows.append(row)
        logits = mx.concatenate(rows, axis=0)
    logprobs = log_softmax(logits)
    return sampler(logprobs), logprobs


def generate_tokens(model, inputs, cache, *, sampler, logits_processors=None, max_tokens=256, start=0,
                    prefill_step_size=2048, on_prefill_done=None) -> Iterator[mx.array]:
    """Yield sampled tokens (B,) one step at a time. A yielded token may or may not have been fed
    into `cache` yet (see `eager` below); callers keeping the cache trim it to what they keep."""
    logits, positions = prefill(model, inputs, cache, start=start, prefill_step_size=prefill_step_size)
    key_mask = _mask_or_none(inputs)
    ids = np.asarray(inputs["input_ids"])
    history = [mx.array(ids[b]) for b in range(ids.shape[0])] if logits_processors else None
    backend = backend_of(model)
    y, _ = sample(logits, sampler, logits_processors, history, backend.log_softmax)
    mx.async_eval(y)
    if on_prefill_done:
        mx.eval(y)
        on_prefill_done()
    # With the CPU path the forward runs eagerly (it evaluates as it goes), so the next token
    # is computed after this one is handed out; on a GPU its graph is queued first, so the device
    # works while the caller handles the token.
    eager = backend.eager

    def advance(y):
        nonlocal key_mask, history, positions
        if key_mask is not None:
            key_mask = mx.concatenate([key_mask, mx.ones((key_mask.shape[0], 1), key_mask.dtype)], axis=1)
        if history is not None:
            history = [mx.concatenate([h, y[b: b + 1]]) for b, h in enumerate(history)]
        logits = decode_step(model, y, cache, positions, key_mask)
        positions = positions + 1
        next_y, _ = sample(logits, sampler, logits_processors, history, backend.log_softmax)
        mx.async_eval(next_y)
        return next_y

    for n in range(max_tokens):
        last = n + 1 == max_tokens
        next_y = None if eager or last else advance(y)
        yield y
        if not last:
            y = advance(y) if next_y is None else next_y


# ---------------------------------------------------------------------------------------------
# User-facing API
# ---------------------------------------------------------------------------------------------
def eos_token_ids(model, processor) -> set:
    """The checkpoint's EOS ids (generation_config.json) and the tokenizer's."""
    ids = set(model.config.eos_token_ids)
    if processor.tokenizer.eos_token_id is not None:
        ids.add(processor.tokenizer.eos_token_id)
    return ids


def _sampling(temperature, top_p, top_k, min_p, repetition_penalty, repetition_context_size, seed):
    # mlx_lm is imported on first use: importing it pulls in transformers (seconds of startup).
    from mlx_lm.sample_utils import make_logits_processors, make_sampler

    if seed is not None:
        mx.random.seed(seed)
    sampler = make_sampler(temp=temperature, top_p=top_p, min_p=min_p, top_k=top_k)
    processors = make_logits_processors(
        repetition_penalty=repetition_penalty if repetition_penalty not in (None, 1.0) else None,
        repetition_context_size=repetition_context_size,
    )
    return sampler, processors


def _common_prefix(a: List[int], b: List[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _trim(prompt_cache: PromptCache, keep: int):
    drop = prompt_cache.cache[0].offset - keep if prompt_cache.cache else 0
    if drop > 0:
        for c in prompt_cache.cache:
            c.trim(drop)
    prompt_cache.tokens = prompt_cache.tokens[:keep]


def stream_generate(model, processor, prompt=None, *, messages=None, images=None, videos=None, video_fps=None,
                    system=None, max_tokens=256, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0,
                    repetition_penalty=None, repetition_context_size=20, seed=None, stop=None,
                    prefill_step_size=2048, min_pixels=None, max_pixels=None, sample_frames=True,
                    prompt_cache: Optional[PromptCache] = None,
                    chat_template_kwargs=None) -> Iterator[GenerationResponse]:
    """Yield the answer piece by piece (mlx-lm's streaming detokenizer, so multi-byte characters
    never break), each piece with running statistics; the last one carries finish_reason.

    With `prompt_cache`, the KV cache of earlier turns is reused for the longest common token
    prefix and only the rest of the prompt (and only new images) is computed."""
    inputs = encode_prompt(processor, prompt, messages=messages, images=images, videos=videos,
                           video_fps=video_fps, system=system, min_pixels=min_pixels, max_pixels=max_pixels,
                           sample_frames=sample_frames, chat_template_kwargs=chat_template_kwargs)
    ids = np.asarray(inputs["input_ids"])
    if ids.shape[0] != 1:
        raise InputError("stream_generate takes one prompt; use batch_generate for several")
    sampler, processors = _sampling(temperature, top_p, top_k, min_p, repetition_penalty,
                                    repetition_context_size, seed)
    start = 0
    if prompt_cache is not None:
        # Reuse the longest cached prefix, leaving at least one token to compute (its logits start
        # the answer) and never splitting an image or video.
        start = _common_prefix(prompt_cache.tokens, ids[0, :-1].tolist())
        start, _ = _media_split(inputs, start)
        _trim(prompt_cache, start)
        cache = prompt_cache.cache
    else:
        cache = model.make_cache()

    stop_ids = eos_token_ids(model, processor)
    stop_strings = [stop] if isinstance(stop, str) else list(stop or [])
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    detok = TokenizerWrapper(processor.tokenizer).detokenizer
    detok.reset()
    mx.reset_peak_memory()
    tic = time.perf_counter()
    timing = {}

    def prefill_done():
        timing["prompt"] = time.perf_counter() - tic

    n_prompt = ids.shape[1] - start
    tokens, text, finish = [], "", None
    stats = lambda: dict(
        prompt_tokens=ids.shape[1], cached_tokens=start,
        generation_tokens=len(tokens),
        prompt_tps=n_prompt / max(timing.get("prompt", 1e-9), 1e-9),
        generation_tps=(len(tokens) - 1) / max(time.perf_counter() - tic - timing.get("prompt", 0), 1e-9)
        if len(tokens) > 1 else 0.0,
        peak_memory_gb=mx.get_peak_memory() / 1e9,
    )
    for y in generate_tokens(model, inputs, cache, sampler=sampler, logits_processors=processors,
                             max_tokens=max_tokens, start=start, prefill_step_size=prefill_step_size,
                             on_prefill_done=prefill_done):
        token = int(y.item())
        tokens.append(token)
        if token in stop_ids:
            finish = "stop"
        else:
            detok.add_token(token)
        if finish is None and len(tokens) == max_tokens:
            finish = "length"
        if finish:
            detok.finalize()
        piece = detok.last_segment
        if stop_strings:
            combined = text + piece
            hit = min((combined.find(s) for s in stop_strings if s in combined), default=-1)
            if hit >= 0:
                piece, finish = combined[:hit][len(text):], "stop"
        text += piece
        yield GenerationResponse(text=piece, token=token, finish_reason=finish, **stats())
        if finish:
            break
    if prompt_cache is not None:
        # The decode loop may have fed the last token (or not): keep the prompt and all generated
        # tokens but the last, which the next turn's template renders again anyway.
        prompt_cache.tokens = ids[0].tolist() + tokens[:-1]
        _trim(prompt_cache, len(prompt_cache.tokens))


def generate(model, processor, prompt=None, **kwargs) -> GenerationResult:
    """Run to completion; see stream_generate for the arguments."""
    text, tokens, last = "", [], None
    for last in stream_generate(model, processor, prompt, **kwargs):
        text += last.text
        tokens.append(last.token)
    return GenerationResult(text=text, token_ids=tokens, prompt_tokens=last.prompt_tokens,
                            generation_tokens=last.generation_tokens, prompt_tps=last.prompt_tps,
                            generation_tps=last.generation_tps, peak_memory_gb=last.peak_memory_gb,
                            finish_reason=last.finish_reason, cached_tokens=last.cached_tokens)


def batch_generate(model, processor, requests, *, max_tokens=256, temperature=0.0, top_p=1.0, top_k=0,
                   min_p=0.0, repetition_penalty=None, repetition_context_size=20, seed=None,
                   prefill_step_size=2048, min_pixels=None, max_pixels=None) -> List[GenerationResult]:
    """Several requests (dicts with messages= or prompt=, images=, videos=, video_fps=) as one
    left-padded batch with per-sequence rope deltas; each result equals that request run alone."""
    texts, images, videos, fps = [], [], [], []
    from .processor import extract_media

    for r in requests:
        messages = r.get("messages") or build_messages(r.get("prompt"), r.get("images"), r.get("videos"),
                                                       r.get("system"))
        found_i, found_v = extract_media(messages)
        images += found_i or list(r.get("images") or [])
        v = found_v or list(r.get("videos") or [])
        videos += v
        fps += [r.get("video_fps")] * len(v)
        texts.append(processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    inputs = processor(text=texts, images=images or None, videos=videos or None, video_fps=fps or None,
                       min_pixels=min_pixels, max_pixels=max_pixels, padding=True)
    sampler, processors = _sampling(temperature, top_p, top_k, min_p, repetition_penalty,
                                    repetition_context_size, seed)
    stop_ids = eos_token_ids(model, processor)
    B = len(texts)
    out = [[] for _ in range(B)]
    done = [None] * B
    mx.reset_peak_memory()
    tic = time.perf_counter()
    timing = {}
    for y in generate_tokens(model, inputs, model.make_cache(), sampler=sampler, logits_processors=processors,
                             max_tokens=max_tokens, prefill_step_size=prefill_step_size,
                             on_prefill_done=lambda: timing.setdefault("prompt", time.perf_counter() - tic)):
        for b, t in enumerate(y.tolist()):
            if done[b] is None:
                out[b].append(t)
                if t in stop_ids:
                    done[b] = "stop"
                elif len(out[b]) == max_tokens:
                    done[b] = "length"
        if all(done):
            break
    total = time.perf_counter() - tic
    real = np.asarray(inputs["attention_mask"]).sum(-1)
    results = []
    for b in range(B):
        toks = [t for t in out[b] if t not in stop_ids]
        results.append(GenerationResult(
            text=processor.tokenizer.decode(toks), token_ids=out[b], prompt_tokens=int(real[b]),
            generation_tokens=len(out[b]), prompt_tps=float(real.sum()) / timing["prompt"],
            generation_tps=sum(len(o) for o in out) / max(total - timing["prompt"], 1e-9),
            peak_memory_gb=mx.get_peak_memory() / 1e9, finish_reason=done[b] or "length"))
    return results


class ChatSession:
    """A multi-turn conversation that keeps its KV cache between turns: an agent that sends a new
    screenshot each turn pays for that screenshot and the new text only."""

    def __init__(self, model, processor, system=None, **generation_kwargs):
        self.model, self.processor = model, processor
        self.messages = [{"role": "system", "content": system}] if system else []
        self.prompt_cache = PromptCache(model.make_cache())
        self.generation_kwargs = generation_kwargs
        self.last: Optional[GenerationResponse] = None

    def stream(self, text, images=None, videos=None, video_fps=None, **kwargs) -> Iterator[GenerationResponse]:
        content = [{"type": "image", "image": im} for im in images or []]
        content += [{"type": "video", "video": v} for v in videos or []]
        content.append({"type": "text", "text": text})
        self.messages.append({"role": "user", "content": content})
        answer = ""
        for piece in stream_generate(self.model, self.processor, messages=self.messages, video_fps=video_fps,
                                     prompt_cache=self.prompt_cache, **{**self.generation_kwargs, **kwargs}):
            answer += piece.text
            self.last = piece
            yield piece
        self.messages.append({"role": "assistant", "content": answer})

    def send(self, text, images=None, videos=None, **kwargs) -> str:
        return "".join(p.text for p in self.stream(text, images, videos, **kwargs))


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------
def build_parser():
    p = argparse.ArgumentParser(prog="python -m mlx_qwen3vl.generate",
                                description="Generate text from images/videos and a prompt with Qwen3-VL.")
    p.add_argument("--model", default=DEFAULT_MODEL, help="local folder or Hugging Face repo id")
    p.add_argument("--prompt", default="Describe this image.")
    p.add_argument("--image", nargs="+", default=[], help="image paths or URLs")
    p.add_argument("--video", nargs="+", default=[], help="video files (needs the `video` extra)")
    p.add_argument("--system", default=None)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temp", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--repetition-context-size", type=int, default=20)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--min-pixels", type=int, default=None)
    p.add_argument("--max-pixels", type=int, default=None)
    p.add_argument("--fps", type=float, default=None, help="source fps for videos given as frames")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None)
    p.add_argument("--prefill-step-size", type=int, default=2048)
    p.add_argument("--chat", action="store_true", help="interactive multi-turn chat with prefix reuse")
    p.add_argument("--verbose", action="store_true", help="print the backend and BLAS in use, and the prompt")
    return p


def _print_stats(last, out=sys.stderr):
    if last is None:
        return
    print(f"\nPrompt: {last.prompt_tokens} tokens ({last.cached_tokens} cached), {last.prompt_tps:.1f} tokens/s"
          f"\nGeneration: {last.generation_tokens} tokens, {last.generation_tps:.2f} tokens/s"
          f"\nPeak memory: {last.peak_memory_gb:.2f} GB", file=out)


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        from . import load

        model, processor = load(args.model, dtype=args.dtype)
        if args.verbose:
            print(f"[mlx_qwen3vl] backend: {backend_of(model).describe()}", file=sys.stderr)
        kwargs = dict(max_tokens=args.max_tokens, temperature=args.temp, top_p=args.top_p, top_k=args.top_k,
                      min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                      repetition_context_size=args.repetition_context_size, seed=args.seed,
                      min_pixels=args.min_pixels, max_pixels=args.max_pixels,
                      prefill_step_size=args.prefill_step_size)
        if args.chat:
            return _chat(model, processor, args, kwargs)
        last = None
        for last in stream_generate(model, processor, args.prompt, images=args.image, videos=args.video,
                                    video_fps=args.fps, system=args.system, **kwargs):
            print(last.text, end="", flush=True)
        print()
        _print_stats(last)
        return 0
    except Qwen3VLError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _chat(model, processor, args, kwargs):
    session = ChatSession(model, processor, system=args.system, **kwargs)
    images, videos = list(args.image), list(args.video)
    print("Chat with the model; /image PATH attaches an image to the next turn, Ctrl-D quits.", file=sys.stderr)
    while True:
        try:
            line = input(">> ").strip()
        except EOFError:
            print(file=sys.stderr)
            return 0
        if line.startswith("/image "):
            images.append(line.split(maxsplit=1)[1])
            continue
        if not line:
            continue
        try:
            for piece in session.stream(line, images=images, videos=videos, video_fps=args.fps):
                print(piece.text, end="", flush=True)
        except Qwen3VLError as e:
            session.messages.pop()
            print(f"error: {e}", file=sys.stderr)
            continue
        finally:
            images, videos = [], []
        print()
        _print_stats(session.last)


if __name__ == "__main__":
    sys.exit(main())
