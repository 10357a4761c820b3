"""Chat messages, images and videos → model inputs, as transformers' Qwen3VLProcessor makes them.

numpy + pillow only (plus transformers' tokenizer, which needs no torch). Images follow the
pillow backend of transformers' image processor (Qwen2VLImageProcessorPil) bit for bit;
videos follow Qwen3VLVideoProcessor (see video.py).
"""

import dataclasses
import inspect
import json
import os
import re
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import ClassVar

import numpy as np
from PIL import Image

from . import video as vid
from .errors import InputError
from .media import describe, load_image
from .positions import mm_token_type_ids_from
from .video import smart_resize

CONTENT_TYPES = ("text", "image", "image_url", "video")
# The roles whose images and videos Qwen3-VL's chat template renders (a tool result may be a
# screenshot); in system and assistant messages it drops them, so they are refused there.
MEDIA_ROLES = ("user", "tool")
# Keys of a content block that can hold the media, in transformers' order.
MEDIA_KEYS = {"image": ("image", "url", "path", "base64"), "video": ("video", "url", "path")}
IMAGE_TOKEN, VIDEO_TOKEN = "<|image_pad|>", "<|video_pad|>"
VISION_START_TOKEN, VISION_END_TOKEN = "<|vision_start|>", "<|vision_end|>"
VISION_TOKENS = (IMAGE_TOKEN, VIDEO_TOKEN, VISION_START_TOKEN, VISION_END_TOKEN)


# ---------------------------------------------------------------------------- images: pixels


@dataclass
class ImageConfig(vid.PixelConfig):
    legacy_pixel_keys: ClassVar[bool] = True  # transformers' image processor reads min/max_pixels


@lru_cache(maxsize=8)
def _rescale_by_division(rescale_factor):
    """Whether float32 division by 1/rescale_factor gives, for all 256 levels, the pillow
    backend's float32(level · rescale_factor in float64) (true for 1/255): then the float32
    division, much faster than the float64 product, gives the same pixels."""
    levels = np.arange(256)
    by_division = levels.astype(np.float32) / np.float32(1 / rescale_factor)
    return np.array_equal(by_division, (levels * rescale_factor).astype(np.float32))


def _normalize(levels, cfg):
    """uint8 patches → float32 as the pillow backend: rescale (float64, cast to float32),
    then (x - mean) / std in float32."""
    if _rescale_by_division(cfg.rescale_factor):
        out = levels.astype(np.float32)
        out /= np.float32(1 / cfg.rescale_factor)
    else:
        out = (np.arange(256) * cfg.rescale_factor).astype(np.float32)[levels]
    by_channel = out.reshape(len(out), len(cfg.image_mean), -1)  # rows are channel-major
    by_channel -= np.asarray(cfg.image_mean, np.float32)[:, None]
    by_channel /= np.asarray(cfg.image_std, np.float32)[:, None]
    return out


def image_budget(cfg, min_pixels=None, max_pixels=None, names=None):
    """The image pixel budget of a call: its own values over the config's (whose own precedence
    PixelConfig.from_dict states), validated. A call that sets one bound moves the config's other
    bound to meet it (max_pixels=4096 under a config's min_pixels of 65536 means "small images",
    not an error); both set by the call must agree. `names`: see video.pixel_budget."""
    if min_pixels is not None and max_pixels is None:
        lo = vid.as_pixels(min_pixels, (names or {}).get("min_pixels", "min_pixels"))
        return vid.pixel_budget(lo, max(lo, cfg.max_pixels), cfg.factor, names)
    if max_pixels is not None and min_pixels is None:
        hi = vid.as_pixels(max_pixels, (names or {}).get("max_pixels", "max_pixels"))
        return vid.pixel_budget(min(hi, cfg.min_pixels), hi, cfg.factor, names)
    return vid.pixel_budget(
        cfg.min_pixels if min_pixels is None else min_pixels,
        cfg.max_pixels if max_pixels is None else max_pixels,
        cfg.factor,
        names,
    )


def preprocess_image(rgb, cfg, min_pixels=None, max_pixels=None):
    """RGB uint8 (H, W, 3) → (patches (N, C·T·16·16) float32, (1, grid_h, grid_w))."""
    h, w = rgb.shape[:2]
    min_pixels, max_pixels = image_budget(cfg, min_pixels, max_pixels)
    rh, rw = smart_resize(h, w, cfg.factor, min_pixels, max_pixels)
    resized = np.asarray(Image.fromarray(rgb).resize((rw, rh), Image.BICUBIC))
    # The image fills a whole temporal patch by repetition (a broadcast: copied once, by patchify).
    frames = np.broadcast_to(resized, (cfg.temporal_patch_size, *resized.shape))
    levels, grid = vid.patchify(frames, cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size)
    return _normalize(levels, cfg), grid


def read_media_configs(path):
    """A model folder's (ImageConfig, VideoConfig): processor_config.json's sections, else
    preprocessor_config.json and video_preprocessor_config.json (the video's falls back to the image's)."""
    path = Path(path)
    nested = _read_json(path / "processor_config.json") or {}
    image = nested.get("image_processor") or _read_json(path / "preprocessor_config.json") or {}
    video = nested.get("video_processor") or _read_json(path / "video_preprocessor_config.json") or image
    return ImageConfig.from_dict(image), vid.VideoConfig.from_dict(video)


# ---------------------------------------------------------------------------- chat messages


def _block_type(block, where):
    if not isinstance(block, dict):
        raise InputError(
            f"{where} is a {type(block).__name__}, not a content dict; use {{'type': 'text', 'text': ...}}"
        )
    kind = block.get("type")
    if kind is None:  # infer it the way the chat template does: from the keys present
        kind = next((k for k in ("image", "image_url", "video", "text") if k in block), None)
    if kind not in CONTENT_TYPES:
        raise InputError(f"{where} has unknown content type {kind!r}; use one of {', '.join(CONTENT_TYPES)}")
    return kind


def _is_batch(messages):
    return isinstance(messages, (list, tuple)) and bool(messages) and isinstance(messages[0], (list, tuple))


def _check_text(text, where):
    """Message text may not contain the vision markers: the template puts exactly one
    vision_start, pad, vision_end per image or video, and a stray one would be read as an image
    with no pixels (or shift every later image's pixels onto the wrong placeholder)."""
    if isinstance(text, str):
        found = [t for t in VISION_TOKENS if t in text]
        if found:
            raise InputError(
                f"{where} contains {found[0]}, a token that marks where images and videos go; remove it "
                "from the text and pass media as {'type': 'image'} / {'type': 'video'} content items"
            )


def normalize_messages(messages):
    """Copy of one conversation as transformers hands it to the template: keys set to None are
    dropped, and OpenAI `image_url` blocks become `{"type": "image", "url": ...}`. Messages and
    content items are counted from 1 in errors."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InputError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    out = []
    for i, message in enumerate(messages, 1):
        if not isinstance(message, dict):
            raise InputError(f"message {i} is a {type(message).__name__}; pass dicts with 'role' and 'content'")
        message = {k: v for k, v in message.items() if v is not None}
        content = message.get("content")
        _check_text(content, f"message {i}'s text")
        if isinstance(content, (list, tuple)):
            blocks = []
            for j, block in enumerate(content, 1):
                where = f"message {i} content item {j}"
                kind = _block_type(block, where)
                if kind != "text" and message.get("role") not in MEDIA_ROLES:
                    raise InputError(
                        f"{where} is {'a video' if kind == 'video' else 'an image'} in a {message.get('role')} "
                        "message, where the chat template renders no media; put it in a user message "
                        "(or a tool result)"
                    )
                if kind == "image_url" and "image_url" in block:
                    info = block["image_url"]
                    block = {"type": "image", "url": info.get("url", "") if isinstance(info, dict) else info}
                if kind == "text":
                    _check_text(block.get("text"), where)
                blocks.append(block)
            message["content"] = blocks
        out.append(message)
    return out


def _media_of(block, kind):
    for key in MEDIA_KEYS[kind]:
        if key in block:
            value = block[key]
            if key == "base64" and isinstance(value, str) and not value.startswith("data:"):
                value = "data:image/png;base64," + value
            return value
    return None


def extract_media(messages):
    """The images and videos carried by the messages, in conversation order (one conversation or a batch)."""
    conversations = messages if _is_batch(messages) else [messages]
    images, videos = [], []
    for conversation in conversations:
        for message in normalize_messages(conversation):
            content = message.get("content")
            if not isinstance(content, list):
                continue
            for block in content:
                kind = _block_type(block, "content item")
                if kind in MEDIA_KEYS and (media := _media_of(block, kind)) is not None:
                    (images if kind == "image" else videos).append(media)
    return images, videos


def _template_view(conversation):
    """Media objects swapped for inert placeholders: the template only checks which keys exist."""
    view = []
    for message in conversation:
        content = message.get("content")
        if isinstance(content, list):
            message = dict(message)
            message["content"] = [
                {k: v if isinstance(v, str) or k in ("type", "text") else f"<{type(v).__name__}>" for k, v in b.items()}
                for b in content
            ]
        view.append(message)
    return view


def _read_chat_template(path, tokenizer):
    path = Path(path)
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    for name in ("chat_template.json", "processor_config.json", "tokenizer_config.json"):
        file = path / name
        if file.is_file():
            template = json.loads(file.read_text(encoding="utf-8")).get("chat_template")
            if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
                template = {t["name"]: t["template"] for t in template}
            if isinstance(template, dict):
                template = template.get("default")
            if template:
                return template
    return getattr(tokenizer, "chat_template", None)


def _read_json(path):
    return json.loads(Path(path).read_text(encoding="utf-8")) if Path(path).is_file() else None


# ---------------------------------------------------------------------------- processor


class Processor:
    """Tokenizer + image and video preprocessing for Qwen3-VL."""

    image_token = IMAGE_TOKEN
    video_token = VIDEO_TOKEN
    vision_start_token = VISION_START_TOKEN
    vision_end_token = VISION_END_TOKEN

    def __init__(self, tokenizer, image_config=None, video_config=None, chat_template=None):
        self.tokenizer = tokenizer
        self.image_config = image_config or ImageConfig()
        self.video_config = video_config or vid.VideoConfig()
        self.chat_template = chat_template
        ids = tokenizer.convert_tokens_to_ids
        self.image_token_id = ids(self.image_token)
        self.video_token_id = ids(self.video_token)
        self.vision_start_token_id = ids(self.vision_start_token)
        self.vision_end_token_id = ids(self.vision_end_token)
        pad = tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None else tokenizer.eos_token_id

    @classmethod
    def from_pretrained(cls, path, tokenizer=None, *, cap_pixels_per_frame=None):
        """Load from a model folder: tokenizer files, preprocessor configs and chat template.

        `cap_pixels_per_frame` (default: the video config's, else True) sets the video frame cap
        for every call; see `__call__`."""
        path = Path(path)
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(path))
        image_config, video_config = read_media_configs(path)
        if cap_pixels_per_frame is not None:
            video_config.cap_pixels_per_frame = bool(cap_pixels_per_frame)
        return cls(tokenizer, image_config, video_config, _read_chat_template(path, tokenizer))

    # -- text

    def decode(self, ids, skip_special_tokens=True, **kw):
        return self.tokenizer.decode(np.asarray(ids).tolist(), skip_special_tokens=skip_special_tokens, **kw)

    def batch_decode(self, sequences, skip_special_tokens=True, **kw):
        return [self.decode(s, skip_special_tokens=skip_special_tokens, **kw) for s in sequences]

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False, tools=None,
                            chat_template=None, images=None, videos=None, **kwargs):
        """Render the conversation (or a batch of them) as transformers' processor does.

        With `tokenize=True`, returns the processed inputs (see `__call__`, which takes the media
        options among `kwargs`: fps, source_fps, min_pixels, ...), taking the media from the messages, or
        from `images` / `videos` when the messages only hold placeholders. The other `kwargs` go to
        the chat template.
        """
        call_options = {k: kwargs.pop(k) for k in list(kwargs) if k in CALL_OPTIONS}
        template = chat_template or self.chat_template
        if template is None:
            raise InputError(
                "this model folder has no chat template; pass chat_template= or format the prompt yourself"
            )
        batch = _is_batch(messages)
        conversations = [normalize_messages(c) for c in (messages if batch else [messages])]
        rendered = self.tokenizer.apply_chat_template(
            [_template_view(c) for c in conversations],
            chat_template=template,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **kwargs,
        )
        prompt = rendered if batch else rendered[0]
        if not tokenize:
            return prompt
        found_images, found_videos = extract_media(messages)
        return self(text=prompt, images=found_images or images, videos=found_videos or videos, **call_options)

    # -- media

    def read_media(self, read, *args):
        """`read(*args)`: a function that reads media (files, URLs, buffers) into a dict of numpy
        arrays. Every media read outside `__call__` goes through here, so that a distributed
        processor (distributed.RankZeroProcessor) can run it on rank 0 alone and hand the other
        ranks its result."""
        return read(*args)

    def process_images(self, images, min_pixels=None, max_pixels=None):
        """Images → (pixel_values (N, C·T·16·16) float32, image_grid_thw (n, 3) int64)."""
        patches, grids = [], []
        for i, image in enumerate(images, 1):
            rgb = load_image(image, f"image {i}")
            try:
                p, grid = preprocess_image(rgb, self.image_config, min_pixels, max_pixels)
            except InputError as e:
                raise InputError(f"image {i} {describe(image)}: {e}") from None
            patches.append(p)
            grids.append(grid)
        return np.concatenate(patches), np.array(grids, dtype=np.int64)

    def _clip(self, video, source_fps, fps, sample, label):
        cfg = self.video_config if fps is None else dataclasses.replace(self.video_config, fps=float(fps))
        if isinstance(video, (str, os.PathLike)):
            return vid.read_video_file(video, source_fps, sample, cfg, label)
        is_rgb_array = isinstance(video, np.ndarray) and video.ndim == 4 and video.shape[-1] == 3
        if is_rgb_array and video.dtype == np.uint8:
            frames = video
        elif isinstance(video, (list, tuple)) or (isinstance(video, np.ndarray) and video.ndim == 4):
            if len(video) == 0:
                raise InputError(f"{label} has no frames; pass at least {cfg.temporal_patch_size} frames")
            rgb = [load_image(f, f"{label} frame {t}") for t, f in enumerate(video, 1)]
            if len({f.shape for f in rgb}) > 1:
                raise InputError(f"{label} frames differ in size; resize them to one size first")
            frames = np.stack(rgb)
        else:
            raise InputError(
                f"{label} {describe(video)} is not a supported video; pass a file path, a list of frames "
                "or a (T, H, W, 3) uint8 array"
            )
        if frames.shape[1] == 0 or frames.shape[2] == 0:
            raise InputError(f"{label} has zero-size frames; pass non-empty frames")
        return vid.clip_from_frames(frames, source_fps, sample, cfg)

    def process_videos(self, videos, source_fps=None, sample_frames=True, cap_pixels_per_frame=None, fps=None,
                       video_fps=None):
        """Videos → (pixel_values_videos, video_grid_thw (n, 3) int64, timestamps per video).

        `fps`: frames sampled per second of video (qwen-vl-utils' and transformers' meaning; default
        the video config's, 2). `source_fps`: the frame rate of the source, for frames passed as a
        list or array (default 24) or to override a file's own. Either may be one value per video."""
        source_fps = renamed_source_fps(source_fps, video_fps)
        per_video = {}
        for name, value in (("source_fps", source_fps), ("fps", fps)):
            values = value if isinstance(value, (list, tuple)) else [value] * len(videos)
            if len(values) != len(videos):
                raise InputError(f"{name} has {len(values)} entries for {len(videos)} videos; pass one per video")
            for v in values:
                vid.check_fps(v, name)
            per_video[name] = values
        patches, grids, times = [], [], []
        for i, (video, src, rate) in enumerate(zip(videos, per_video["source_fps"], per_video["fps"]), 1):
            clip = self._clip(video, src, rate, sample_frames, f"video {i}")
            try:
                p, grid, ts = vid.preprocess_clip(clip, self.video_config, cap_pixels_per_frame)
            except InputError as e:
                raise InputError(f"video {i} {describe(video)}: {e}") from None
            patches.append(p)
            grids.append(grid)
            times.append(ts)
        return np.concatenate(patches), np.array(grids, dtype=np.int64), times

    def _video_placeholder(self, grid, times):
        per_frame = self.video_token * int(grid[1] * grid[2] // self.video_config.merge_size**2)
        return "".join(
            f"<{t:.1f} seconds>{self.vision_start_token}{per_frame}{self.vision_end_token}" for t in times[: grid[0]]
        )

    # -- everything

    def __call__(self, text=None, images=None, videos=None, fps=None, source_fps=None, sample_frames=True,
                 min_pixels=None, max_pixels=None, cap_pixels_per_frame=None, padding=True, return_tensors="np",
                 video_fps=None):
        """Tokenize text with each image / video placeholder expanded, and preprocess the media.

        Returns a dict with transformers' names: input_ids, attention_mask, mm_token_type_ids
        (0 text, 1 image, 2 video), and pixel_values + image_grid_thw, pixel_values_videos +
        video_grid_thw when there are images / videos. Batches are padded on the left.

        `min_pixels` / `max_pixels` override the image config's budget (integers,
        1 <= min_pixels <= max_pixels, max_pixels >= 1024). `cap_pixels_per_frame` (default: the
        video config's, True unless it says otherwise) caps each video frame as qwen-vl-utils
        does; False gives transformers 5.24's default, uncapped frames. `fps` (frames sampled per
        second) and `source_fps` (the frames' own rate): see `process_videos`; `video_fps` is
        `source_fps`'s old name (deprecated).
        """
        if return_tensors not in ("np", "mlx"):
            raise InputError(f"return_tensors={return_tensors!r} is not supported; use 'np' or 'mlx'")
        min_pixels, max_pixels = image_budget(self.image_config, min_pixels, max_pixels)
        texts = [text] if isinstance(text, str) else (list(text) if text is not None else None)
        images = _flatten_images(images)
        videos = _as_video_list(videos)
        if texts is not None:
            _check_counts(texts, self.image_token, len(images), "image")
            _check_counts(texts, self.video_token, len(videos), "video")

        out = {}
        replacements = {}
        if images:
            out["pixel_values"], out["image_grid_thw"] = self.process_images(images, min_pixels, max_pixels)
            merge = self.image_config.merge_size**2
            replacements[self.image_token] = iter(
                self.image_token * int(g.prod() // merge) for g in out["image_grid_thw"]
            )
        if videos:
            out["pixel_values_videos"], out["video_grid_thw"], times = self.process_videos(
                videos, renamed_source_fps(source_fps, video_fps), sample_frames, cap_pixels_per_frame, fps
            )
            replacements[self.video_token] = iter(
                self._video_placeholder(g, t) for g, t in zip(out["video_grid_thw"], times)
            )
        if texts is not None:
            if replacements:
                pattern = re.compile("|".join(re.escape(t) for t in replacements))
                texts = [pattern.sub(lambda m: next(replacements[m.group()]), t) for t in texts]
            out = {**self._tokenize(texts, padding), **out}
        return _to_tensors(out, return_tensors)

    def _tokenize(self, texts, padding):
        ids = self.tokenizer(texts)["input_ids"]
        longest = max(len(x) for x in ids)
        if not padding and any(len(x) != longest for x in ids):
            raise InputError("texts tokenize to different lengths; pass padding=True (left padding)")
        input_ids = np.full((len(ids), longest), self.pad_token_id, dtype=np.int64)
        mask = np.zeros((len(ids), longest), dtype=np.int64)
        for row, x in enumerate(ids):
            if x:
                input_ids[row, longest - len(x):] = x
                mask[row, longest - len(x):] = 1
        types = mm_token_type_ids_from(input_ids, self.image_token_id, self.video_token_id)
        return {"input_ids": input_ids, "attention_mask": mask, "mm_token_type_ids": types}


# ---------------------------------------------------------------------------- input shapes


def renamed_source_fps(source_fps, video_fps, stacklevel=3):
    """`video_fps=` is `source_fps=`'s deprecated name, accepted with a DeprecationWarning: it names the
    source's frame rate, while qwen-vl-utils' users read `fps` as the sampling rate, which `fps=` is."""
    if video_fps is None:
        return source_fps
    warnings.warn("video_fps= is deprecated: it is the source's frame rate, now source_fps= "
                  "(fps= is the sampling rate, frames kept per second)", DeprecationWarning, stacklevel=stacklevel)
    if source_fps is not None and source_fps != video_fps:
        raise InputError("source_fps= and video_fps= (its deprecated name) disagree; give source_fps= alone")
    return video_fps


# What apply_chat_template(tokenize=True) hands on to __call__ besides the text and media: the
# media options are named once, in __call__'s signature.
CALL_OPTIONS = frozenset(inspect.signature(Processor.__call__).parameters) - {"self", "text", "images", "videos"}


def _is_frame(x):
    return isinstance(x, Image.Image) or (isinstance(x, np.ndarray) and x.ndim in (2, 3))


def _flatten_images(images):
    if images is None:
        return []
    if isinstance(images, np.ndarray) and images.ndim == 4:
        return list(images)
    if not isinstance(images, (list, tuple)):
        return [images]
    flat = []
    for item in images:
        flat.extend(_flatten_images(item) if isinstance(item, (list, tuple)) else [item])
    return flat


def _as_video_list(videos):
    if videos is None:
        return []
    if isinstance(videos, (list, tuple)):
        return [videos] if videos and _is_frame(videos[0]) else list(videos)
    return [videos]


def _check_counts(texts, token, n_media, kind):
    n_placeholders = sum(t.count(token) for t in texts)
    if n_placeholders != n_media:
        raise InputError(
            f"text has {n_placeholders} {token} placeholder(s) but {n_media} {kind}(s) were given; "
            f"pass one {kind} per placeholder"
        )


def _to_tensors(out, return_tensors):
    if return_tensors == "mlx":
        import mlx.core as mx

        return {k: mx.array(v.astype(np.int32) if v.dtype == np.int64 else v) for k, v in out.items()}
    return out
