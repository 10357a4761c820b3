"""Chat messages, images and videos → model inputs, as transformers' Qwen3VLProcessor makes them.

numpy + pillow only (plus transformers' tokenizer, which needs no torch). Images follow the
pillow backend of transformers' image processor (Qwen2VLImageProcessorPil) bit for bit;
videos follow Qwen3VLVideoProcessor (see video.py).
"""

import base64
import binascii
import io
import json
import math
import os
import re
import urllib.error
import urllib.request
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from . import video as vid
from .errors import InputError

URL_TIMEOUT_S = 10
CONTENT_TYPES = ("text", "image", "image_url", "video")
# Keys of a content block that can hold the media, in transformers' order.
MEDIA_KEYS = {"image": ("image", "url", "path", "base64"), "video": ("video", "url", "path")}


# ---------------------------------------------------------------------------- images: loading


def _describe(x):
    if isinstance(x, (str, os.PathLike)):
        s = str(x)
        return repr(s if len(s) <= 80 else s[:60] + "...")
    if isinstance(x, np.ndarray):
        return f"(array {x.shape} {x.dtype})"
    return f"({type(x).__name__})"


def _reason(e):
    """An exception as a short single line, for the one-line messages."""
    return " ".join(str(getattr(e, "reason", e) or type(e).__name__).split())[:200]


def _open_bytes(data, label):
    try:
        im = Image.open(io.BytesIO(data))
        im.load()  # surfaces truncated or corrupt files here, with the input's name
    except (OSError, Image.DecompressionBombError, SyntaxError, ValueError) as e:
        raise InputError(f"{label} is not a readable image ({_reason(e)}); pass a valid image file") from None
    return im


def _fetch_url(url, label):
    try:
        with urllib.request.urlopen(url, timeout=URL_TIMEOUT_S) as r:
            return r.read()
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise InputError(f"{label} could not be fetched ({_reason(e)}); check the URL or pass a local file") from None


def _open_string(s, label):
    """A path, http(s) URL or data: URL → PIL image, upright and RGB, as transformers' load_image."""
    if s.startswith(("http://", "https://")):
        im = _open_bytes(_fetch_url(s, label), label)
    elif s.startswith("data:"):
        try:
            data = base64.b64decode(s.split(",", 1)[1], validate=False)
        except (IndexError, binascii.Error) as e:
            raise InputError(
                f"{label} is not a valid base64 data: URL ({_reason(e)}); pass data:image/...;base64,<data>"
            ) from None
        im = _open_bytes(data, label)
    elif os.path.isfile(s):
        try:
            with open(s, "rb") as f:
                data = f.read()
        except OSError as e:
            raise InputError(f"{label} could not be read ({_reason(e)}); check the file") from None
        im = _open_bytes(data, label)
    else:
        raise InputError(f"{label} is not an existing file, http(s) URL or data: URL; check the path")
    return ImageOps.exif_transpose(im).convert("RGB")


def _pil_to_rgb(im):
    """transformers' convert_to_rgb: transparency is composited onto white."""
    if "A" in im.getbands() or im.info.get("transparency") is not None:
        im = im.convert("RGBA")
        white = Image.new("RGBA", im.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, im).convert("RGB")
    return im.convert("RGB")


def _array_to_rgb(a, label):
    if a.dtype != np.uint8:
        raise InputError(f"{label} has dtype {a.dtype}; pass uint8 pixels (H, W, 3) in 0..255")
    if a.ndim == 2:
        a = a[..., None]
    if a.ndim != 3 or a.shape[-1] not in (1, 3, 4):
        raise InputError(f"{label} must be (H, W), (H, W, 1), (H, W, 3) or (H, W, 4); got shape {a.shape}")
    if a.shape[-1] == 1:
        return np.repeat(a, 3, axis=-1)
    if a.shape[-1] == 4:  # composited onto white, as transformers does for 4-channel arrays
        alpha = a[..., 3:4] / 255
        return np.round(alpha * a[..., :3] + (1 - alpha) * 255).astype(np.uint8)
    return a


def load_image(x, label="image"):
    """Any supported image input → RGB uint8 array (H, W, 3)."""
    if isinstance(x, Path):
        x = str(x)
    if isinstance(x, str):
        im = _open_string(x, f"{label} {_describe(x)}")
    elif isinstance(x, bytes):
        im = ImageOps.exif_transpose(_open_bytes(x, f"{label} (bytes)")).convert("RGB")
    elif isinstance(x, Image.Image):
        if x.width == 0 or x.height == 0:
            raise InputError(f"{label} has zero size ({x.width}x{x.height}); pass a non-empty image")
        try:
            im = _pil_to_rgb(x)
        except (OSError, ValueError) as e:
            raise InputError(
                f"{label} {_describe(x)} could not be converted to RGB ({_reason(e)}); pass a valid image"
            ) from None
    elif isinstance(x, np.ndarray):
        rgb = _array_to_rgb(x, f"{label} {_describe(x)}")
        if rgb.shape[0] == 0 or rgb.shape[1] == 0:
            raise InputError(f"{label} has zero size ({rgb.shape[1]}x{rgb.shape[0]}); pass a non-empty image")
        return rgb
    else:
        raise InputError(
            f"{label} {_describe(x)} is not a supported image; pass a path, URL, data: URL, PIL.Image or uint8 array"
        )
    rgb = np.asarray(im)
    if rgb.shape[0] == 0 or rgb.shape[1] == 0:
        raise InputError(f"{label} has zero size ({rgb.shape[1]}x{rgb.shape[0]}); pass a non-empty image")
    return rgb


# ---------------------------------------------------------------------------- images: pixels


@dataclass
class ImageConfig:
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple = (0.26862954, 0.26130258, 0.27577711)
    rescale_factor: float = 1 / 255

    @classmethod
    def from_dict(cls, d):
        size = d.get("size") or {}
        base = cls()
        return cls(
            patch_size=d.get("patch_size", base.patch_size),
            temporal_patch_size=d.get("temporal_patch_size", base.temporal_patch_size),
            merge_size=d.get("merge_size", base.merge_size),
            min_pixels=d.get("min_pixels") or size.get("shortest_edge", base.min_pixels),
            max_pixels=d.get("max_pixels") or size.get("longest_edge", base.max_pixels),
            image_mean=tuple(d.get("image_mean", base.image_mean)),
            image_std=tuple(d.get("image_std", base.image_std)),
            rescale_factor=d.get("rescale_factor", base.rescale_factor),
        )

    @property
    def factor(self):
        return self.patch_size * self.merge_size


def smart_resize(height, width, factor, min_pixels, max_pixels):
    """Image size (h, w): multiples of `factor`, area within [min_pixels, max_pixels], aspect kept."""
    if max(height, width) / min(height, width) > 200:
        raise InputError(f"{width}x{height} pixels is an aspect ratio above 200; crop or pad it")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@lru_cache(maxsize=8)
def _rescale_by_division(rescale_factor):
    """Whether float32 division by 1/rescale_factor gives, for all 256 levels, the pillow
    backend's float32(level · rescale_factor in float64) (true for 1/255); it is ~10x faster."""
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


def preprocess_image(rgb, cfg, min_pixels=None, max_pixels=None):
    """RGB uint8 (H, W, 3) → (patches (N, C·T·16·16) float32, (1, grid_h, grid_w))."""
    h, w = rgb.shape[:2]
    rh, rw = smart_resize(h, w, cfg.factor, min_pixels or cfg.min_pixels, max_pixels or cfg.max_pixels)
    resized = np.asarray(Image.fromarray(rgb).resize((rw, rh), Image.BICUBIC))
    # The image fills a whole temporal patch by repetition (a broadcast: copied once, by patchify).
    frames = np.broadcast_to(resized, (cfg.temporal_patch_size, *resized.shape))
    levels, grid = vid.patchify(frames, cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size)
    return _normalize(levels, cfg), grid


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


def normalize_messages(messages):
    """Copy of one conversation as transformers hands it to the template: keys set to None are
    dropped, and OpenAI `image_url` blocks become `{"type": "image", "url": ...}`."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InputError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InputError(f"message {i} is a {type(message).__name__}; pass dicts with 'role' and 'content'")
        message = {k: v for k, v in message.items() if v is not None}
        content = message.get("content")
        if isinstance(content, (list, tuple)):
            blocks = []
            for j, block in enumerate(content):
                kind = _block_type(block, f"message {i} content item {j}")
                if kind == "image_url" and "image_url" in block:
                    info = block["image_url"]
                    block = {"type": "image", "url": info.get("url", "") if isinstance(info, dict) else info}
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

    image_token = "<|image_pad|>"
    video_token = "<|video_pad|>"
    vision_start_token = "<|vision_start|>"
    vision_end_token = "<|vision_end|>"

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
    def from_pretrained(cls, path, tokenizer=None):
        """Load from a model folder: tokenizer files, preprocessor configs and chat template."""
        path = Path(path)
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(path))
        nested = _read_json(path / "processor_config.json") or {}
        image = nested.get("image_processor") or _read_json(path / "preprocessor_config.json") or {}
        video = nested.get("video_processor") or _read_json(path / "video_preprocessor_config.json") or image
        return cls(
            tokenizer,
            ImageConfig.from_dict(image),
            vid.VideoConfig.from_dict(video),
            _read_chat_template(path, tokenizer),
        )

    # -- text

    def decode(self, ids, skip_special_tokens=True, **kw):
        return self.tokenizer.decode(np.asarray(ids).tolist(), skip_special_tokens=skip_special_tokens, **kw)

    def batch_decode(self, sequences, skip_special_tokens=True, **kw):
        return [self.decode(s, skip_special_tokens=skip_special_tokens, **kw) for s in sequences]

    def apply_chat_template(
        self,
        messages,
        add_generation_prompt=True,
        tokenize=False,
        tools=None,
        chat_template=None,
        images=None,
        videos=None,
        video_fps=None,
        sample_frames=True,
        min_pixels=None,
        max_pixels=None,
        return_tensors="np",
        **template_kwargs,
    ):
        """Render the conversation (or a batch of them) as transformers' processor does.

        With `tokenize=True`, returns the processed inputs (see `__call__`), taking the media from
        the messages, or from `images` / `videos` when the messages only hold placeholders.
        """
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
            **template_kwargs,
        )
        prompt = rendered if batch else rendered[0]
        if not tokenize:
            return prompt
        found_images, found_videos = extract_media(messages)
        return self(
            text=prompt,
            images=found_images or images,
            videos=found_videos or videos,
            video_fps=video_fps,
            sample_frames=sample_frames,
            min_pixels=min_pixels,
            max_pixels=max_pixels,
            return_tensors=return_tensors,
        )

    # -- media

    def process_images(self, images, min_pixels=None, max_pixels=None):
        """Images → (pixel_values (N, C·T·16·16) float32, image_grid_thw (n, 3) int64)."""
        patches, grids = [], []
        for i, image in enumerate(images):
            rgb = load_image(image, f"image {i}")
            try:
                p, grid = preprocess_image(rgb, self.image_config, min_pixels, max_pixels)
            except InputError as e:
                raise InputError(f"image {i} {_describe(image)}: {e}") from None
            patches.append(p)
            grids.append(grid)
        return np.concatenate(patches), np.array(grids, dtype=np.int64)

    def _clip(self, video, fps, sample, label):
        cfg = self.video_config
        if isinstance(video, (str, os.PathLike)):
            if not os.path.isfile(video):
                raise InputError(f"{label} {_describe(video)} is not an existing file; check the path")
            return vid.read_video_file(video, fps, sample, cfg)
        is_rgb_array = isinstance(video, np.ndarray) and video.ndim == 4 and video.shape[-1] == 3
        if is_rgb_array and video.dtype == np.uint8:
            frames = video
        elif isinstance(video, (list, tuple)) or (isinstance(video, np.ndarray) and video.ndim == 4):
            if len(video) == 0:
                raise InputError(f"{label} has no frames; pass at least {cfg.temporal_patch_size} frames")
            rgb = [load_image(f, f"{label} frame {t}") for t, f in enumerate(video)]
            if len({f.shape for f in rgb}) > 1:
                raise InputError(f"{label} frames differ in size; resize them to one size first")
            frames = np.stack(rgb)
        else:
            raise InputError(
                f"{label} {_describe(video)} is not a supported video; pass a file path, a list of frames "
                "or a (T, H, W, 3) uint8 array"
            )
        if frames.shape[1] == 0 or frames.shape[2] == 0:
            raise InputError(f"{label} has zero-size frames; pass non-empty frames")
        return vid.clip_from_frames(frames, fps, sample, cfg)

    def process_videos(self, videos, video_fps=None, sample_frames=True):
        """Videos → (pixel_values_videos, video_grid_thw (n, 3) int64, timestamps per video)."""
        fps_list = video_fps if isinstance(video_fps, (list, tuple)) else [video_fps] * len(videos)
        if len(fps_list) != len(videos):
            raise InputError(f"video_fps has {len(fps_list)} entries for {len(videos)} videos; pass one per video")
        patches, grids, times = [], [], []
        for i, (video, fps) in enumerate(zip(videos, fps_list)):
            clip = self._clip(video, fps, sample_frames, f"video {i}")
            try:
                p, grid, ts = vid.preprocess_clip(clip, self.video_config)
            except InputError as e:
                raise InputError(f"video {i} {_describe(video)}: {e}") from None
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

    def __call__(
        self,
        text=None,
        images=None,
        videos=None,
        video_fps=None,
        sample_frames=True,
        min_pixels=None,
        max_pixels=None,
        padding=True,
        return_tensors="np",
    ):
        """Tokenize text with each image / video placeholder expanded, and preprocess the media.

        Returns a dict with transformers' names: input_ids, attention_mask, mm_token_type_ids
        (0 text, 1 image, 2 video), and pixel_values + image_grid_thw, pixel_values_videos +
        video_grid_thw when there are images / videos. Batches are padded on the left.
        """
        if return_tensors not in ("np", "mlx"):
            raise InputError(f"return_tensors={return_tensors!r} is not supported; use 'np' or 'mlx'")
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
                videos, video_fps, sample_frames
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
        types = np.zeros_like(input_ids)
        types[input_ids == self.image_token_id] = 1
        types[input_ids == self.video_token_id] = 2
        return {"input_ids": input_ids, "attention_mask": mask, "mm_token_type_ids": types}


# ---------------------------------------------------------------------------- input shapes


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
