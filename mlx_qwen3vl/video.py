"""Videos → patches: frame sampling, sizing, resizing, normalization and the patch layout.

Mirrors transformers' Qwen3VLVideoProcessor (torchvision backend) with numpy + pillow only.
Frames reach this module as RGB uint8 arrays (H, W, 3); turning user objects into such
arrays is the processor's job. `patchify` is shared with images: an image is a one-frame
clip repeated to the temporal patch. Pixels stay uint8 through the resize and the patch
reordering (4x less memory traffic than floats) and become float32 last.
"""

import math
import numbers
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import ClassVar

import numpy as np
from PIL import Image

from .errors import ConfigError, InputError
from .media import check_regular_file, describe, reason

DEFAULT_SOURCE_FPS = 24  # what transformers assumes when a clip comes without its fps


@dataclass
class PixelConfig:
    """What image and video preprocessor configs share: patch layout, pixel budget, normalization.
    The defaults are transformers' image processor's; VideoConfig has its video processor's."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple = (0.26862954, 0.26130258, 0.27577711)
    rescale_factor: float = 1 / 255

    legacy_pixel_keys: ClassVar[bool] = False  # see from_dict

    @classmethod
    def from_dict(cls, d):
        """A preprocessor config dict → config; what it lacks (or sets to null) keeps the default.

        The pixel budget, first found wins: the call's min_pixels / max_pixels (images only), the
        top-level `min_pixels` / `max_pixels` keys (image configs only: transformers' image
        processor honours these legacy keys, its Qwen3-VL video processor ignores them),
        `size.shortest_edge` / `size.longest_edge`, the class default.
        """
        size = d.get("size") or {}
        values = {f.name: d[f.name] for f in fields(cls) if d.get(f.name) is not None}
        for key, size_key in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
            legacy = d.get(key) if cls.legacy_pixel_keys else None
            values.pop(key, None)
            if legacy is not None or size.get(size_key) is not None:
                values[key] = legacy if legacy is not None else size[size_key]
        for key in ("image_mean", "image_std"):
            if key in values:
                values[key] = tuple(values[key])
        cfg = cls(**values)
        try:
            pixel_budget(cfg.min_pixels, cfg.max_pixels, cfg.factor)
        except InputError as e:
            raise ConfigError(f"the preprocessor config's pixel budget: {e}") from None
        return cfg

    @property
    def factor(self):
        return self.patch_size * self.merge_size


@dataclass
class VideoConfig(PixelConfig):
    min_pixels: int = 128 * 32 * 32
    max_pixels: int = 768 * 32 * 32
    image_mean: tuple = (0.5, 0.5, 0.5)
    image_std: tuple = (0.5, 0.5, 0.5)
    fps: float = 2
    min_frames: int = 4
    max_frames: int = 768
    max_video_tokens: int = 768
    # qwen-vl-utils' per-frame cap (see frame_pixel_budget). On by default: transformers 5.24 still
    # defaults to off (with a warning that the capped behaviour becomes its default).
    cap_pixels_per_frame: bool = True


def as_pixels(value, name):
    """An integer pixel count (ints, numpy ints and integral floats; not bools, not 1.5)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Integral, float)):
        raise InputError(f"{name}={value!r} is not an integer; pass a whole number of pixels")
    if isinstance(value, float) and not value.is_integer():
        raise InputError(f"{name}={value!r} is not an integer; pass a whole number of pixels")
    return int(value)


def pixel_budget(min_pixels, max_pixels, factor, names=None):
    """Validated (min_pixels, max_pixels): integers, 1 <= min_pixels <= max_pixels, and
    max_pixels >= factor² (one merged token: the smallest image the model takes). `names` maps
    "min_pixels" / "max_pixels" to what the caller calls them (a CLI: its flags)."""
    lo_name, hi_name = ((names or {}).get(k, k) for k in ("min_pixels", "max_pixels"))
    lo, hi = as_pixels(min_pixels, lo_name), as_pixels(max_pixels, hi_name)
    if hi < factor * factor:
        raise InputError(f"{hi_name}={hi} is below {factor * factor}; pass {hi_name} >= {factor * factor}")
    if not 1 <= lo <= hi:
        raise InputError(f"{lo_name}={lo} is outside 1..{hi_name} ({hi}); pass 1 <= {lo_name} <= {hi_name}")
    return lo, hi


def check_fps(value, name="source_fps"):
    """A frame rate (a source's, or the sampling rate): None (the default) or a finite number > 0."""
    ok = value is None or (isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
                           and math.isfinite(value) and value > 0)
    if not ok:
        raise InputError(f"{name}={value!r} is not a frame rate; pass a number > 0 (frames per second) or leave it out")
    return value


@dataclass
class Clip:
    """Frames chosen from a video, with where they came from (for the timestamps)."""

    frames: list  # (H, W, 3) uint8 arrays
    indices: list  # source frame index of each frame
    fps: float  # source frame rate


# ---------------------------------------------------------------------------- sampling


def sample_indices(total, source_fps, cfg: VideoConfig):
    """Which source frames to keep: `cfg.fps` per second, clamped to [min_frames, max_frames]."""
    n = int(total / source_fps * cfg.fps)
    n = min(max(n, cfg.min_frames), cfg.max_frames, total)
    return np.linspace(0, total - 1, n).round().astype(int).tolist()


def clip_from_frames(frames, source_fps, sample, cfg: VideoConfig):
    """A clip from decoded frames ((T, H, W, 3) or a list), sampled at the processor's fps or kept whole."""
    fps = DEFAULT_SOURCE_FPS if source_fps is None else float(source_fps)
    total = len(frames)
    indices = sample_indices(total, fps, cfg) if sample and total else list(range(total))
    return Clip([frames[i] for i in indices], indices, fps)  # views, no copy


# Video files are demuxed only from these containers, told by their first bytes; FFmpeg is then
# held to that one demuxer and to the file protocol. Playlists and scripts (HLS, ffconcat, image
# sequences, raw elementary streams) never reach FFmpeg: they can make it open other files or URLs.
VIDEO_CONTAINERS = {"mp4": "mov", "matroska": "matroska", "avi": "avi"}  # ours -> FFmpeg's demuxer
CONTAINERS_TEXT = "MP4/MOV, WebM/MKV or AVI"
_MP4_BOXES = (b"ftyp", b"moov", b"mdat", b"wide", b"free", b"skip")


def sniff_container(head: bytes):
    """The container of a file's first 12 bytes ("mp4", "matroska", "avi"), or None."""
    if head[4:8] in _MP4_BOXES:
        return "mp4"
    if head[:4] == b"\x1a\x45\xdf\xa3":  # EBML: Matroska and WebM
        return "matroska"
    if head[:4] == b"RIFF" and head[8:12] == b"AVI ":
        return "avi"
    return None


@dataclass
class VideoInfo:
    """What a video file's headers say, before any frame is decoded."""

    width: int
    height: int
    frames: int  # the container's frame count, else its video packets (demuxed, never decoded)
    fps: float  # the stream's average rate, else DEFAULT_SOURCE_FPS


def _decode_reason(e):
    """PyAV's error without the file name it appends (the label names the file)."""
    return reason(getattr(e, "strerror", None) or e)


def _av(label):
    try:
        import av
    except ImportError:
        raise InputError(f'{label}: reading video files needs PyAV: pip install "mlx-qwen3vl[video]"') from None
    return av


def open_video(path, label="video"):
    """A PyAV input container for a file in VIDEO_CONTAINERS, opened with its one demuxer and the
    file protocol only (a caller closes it)."""
    check_regular_file(path, label)
    try:
        with open(path, "rb") as f:
            head = f.read(12)
    except OSError as e:
        raise InputError(f"{label} could not be read ({reason(e)}); check the file") from None
    kind = sniff_container(head)
    if kind is None:
        raise InputError(f"{label} is not a {CONTAINERS_TEXT} file; convert it to MP4 (playlists and raw "
                         "streams are not read)")
    av = _av(label)
    demuxer = VIDEO_CONTAINERS[kind]
    try:
        container = av.open(str(path), format=demuxer,
                            container_options={"protocol_whitelist": "file", "enable_drefs": "0"})
    except (OSError, av.error.FFmpegError) as e:
        raise InputError(f"{label} could not be decoded ({_decode_reason(e)}); pass a readable video file") from None
    if container.format.name != demuxer or not container.streams.video:
        container.close()
        raise InputError(f"{label} has no video stream; pass a video file")
    return container


def _info(container, max_frames=None):
    stream = container.streams.video[0]
    fps = float(stream.average_rate) if stream.average_rate else DEFAULT_SOURCE_FPS
    total = stream.frames
    if not total:  # Matroska / WebM (and some AVIs) carry no count: count the packets instead
        total = 0
        for packet in container.demux(stream):
            total += packet.size > 0
            if max_frames is not None and total > max_frames:
                break
    ctx = stream.codec_context
    return VideoInfo(int(ctx.width), int(ctx.height), int(total), fps)


def probe_video(path, label="video", max_frames=None):
    """A video file's VideoInfo, without decoding a frame (counting stops past `max_frames`)."""
    label = f"{label} {describe(path)}"
    av = _av(label)
    try:
        with open_video(path, label) as container:
            return _info(container, max_frames)
    except (OSError, IndexError, av.error.FFmpegError) as e:
        raise InputError(f"{label} could not be decoded ({_decode_reason(e)}); pass a readable video file") from None


def read_video_file(path, source_fps, sample, cfg: VideoConfig, label="video"):
    """Decode a video file with PyAV up to its last wanted frame, converting (and keeping) only the
    frames that are kept. The frame count comes from the headers (see VideoInfo), so no more than
    the wanted frames are ever held, whether or not the container states its length."""
    info = probe_video(path, label)  # its own pass: counting packets reads the file to its end
    label = f"{label} {describe(path)}"
    av = _av(label)
    try:
        with open_video(path, label) as container:
            fps = float(source_fps or info.fps)
            indices = sample_indices(info.frames, fps, cfg) if sample and info.frames else None
            last = indices[-1] if indices else info.frames - 1
            wanted, kept = set(indices or ()), {}
            for i, frame in enumerate(container.decode(video=0)):
                if i > last:
                    break
                if info.width and (frame.width, frame.height) != (info.width, info.height):
                    raise InputError(f"{label} changes frame size at frame {i + 1}; re-encode it at one size")
                if indices is None or i in wanted:
                    kept[i] = frame.to_ndarray(format="rgb24")
    except (OSError, IndexError, av.error.FFmpegError) as e:
        raise InputError(f"{label} could not be decoded ({_decode_reason(e)}); pass a readable video file") from None
    indices = sorted(kept) if indices is None else [i for i in indices if i in kept]
    if not indices:
        raise InputError(f"{label} has no frames; pass a non-empty video")
    return Clip([kept[i] for i in indices], indices, fps)


# ---------------------------------------------------------------------------- sizing


def frame_pixel_budget(num_frames, cfg: VideoConfig, cap=None):
    """Total pixel budget for a clip. With the cap (qwen-vl-utils', on unless `cap` or the config
    turns it off) each frame gets at most max_video_tokens merged tokens and its even share of
    max_pixels, floored at 1.05 · min_pixels; without it the frames share max_pixels, so a short
    clip keeps near-native resolution (4 frames of 1280x720: 1440 vs 1760 video tokens)."""
    if not (cfg.cap_pixels_per_frame if cap is None else cap):
        return cfg.max_pixels
    frame_cap = cfg.max_video_tokens * cfg.factor * cfg.factor
    per_frame = max(min(frame_cap, cfg.max_pixels // num_frames), int(cfg.min_pixels * 1.05))
    return per_frame * num_frames


def smart_resize(height, width, factor, min_pixels, max_pixels, num_frames=1, temporal_factor=1):
    """Size (h, w) of an image or of a clip's frames: multiples of `factor`, aspect kept, the
    pixels of all frames (rounded to the temporal patch) within [min_pixels, max_pixels].

    Images are one frame (transformers' image smart_resize); clips (temporal_factor > 1) follow its
    video smart_resize, which first scales frames smaller than `factor` up to it.
    """
    if num_frames < temporal_factor:
        raise InputError(
            f"{num_frames} frame(s) is fewer than the temporal patch ({temporal_factor}); "
            f"pass at least {temporal_factor} frames"
        )
    if temporal_factor > 1 and (height < factor or width < factor):
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise InputError(f"{width}x{height} pixels is an aspect ratio above 200; crop or pad it")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt(num_frames * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


# ---------------------------------------------------------------------------- pixels


def resize_frame(frame, height, width):
    """Bicubic (antialiased) resize of one RGB uint8 frame.

    torch's uint8 kernel, which the reference uses, resizes width first and height second; pillow
    picks its own pass order, so the two passes are run explicitly in torch's order. What is left
    is the fixed-point rounding (torch's int16 weights, pillow's int32): a level or two on a few
    pixels.
    """
    if frame.shape[:2] == (height, width):
        return frame
    im = Image.fromarray(frame)
    if im.width != width:
        im = im.resize((width, im.height), Image.BICUBIC)
    if im.height != height:
        im = im.resize((width, height), Image.BICUBIC)
    return np.asarray(im)


def resize_frames(frames, height, width, pad_to):
    """Resize every frame (in parallel: pillow releases the GIL) into one (T', H, W, 3) array,
    repeating the last frame so that T' is a multiple of `pad_to`."""
    n = len(frames)
    out = np.empty((n + (-n % pad_to), height, width, 3), np.uint8)

    def one(i):
        out[i] = resize_frame(frames[i], height, width)

    workers = min(8, os.cpu_count() or 1, n)
    if workers > 1:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(one, range(n)))
    else:
        for i in range(n):
            one(i)
    out[n:] = out[n - 1]
    return out


def patchify(frames, patch_size, merge_size, temporal_patch_size):
    """(T, H, W, C) → (grid_t·grid_h·grid_w, C·temporal·patch·patch), same dtype, in 2×2 merge-block order.

    Rows run over temporal patches, then merge blocks (row-major), then the patches inside a
    block; each row is channel, then time, then the patch's pixels.
    """
    t, h, w, c = frames.shape
    gt, gh, gw = t // temporal_patch_size, h // patch_size, w // patch_size
    m, p = merge_size, patch_size
    x = frames.reshape(gt, temporal_patch_size, gh // m, m, p, gw // m, m, p, c)
    x = x.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)
    return np.ascontiguousarray(x).reshape(gt * gh * gw, c * temporal_patch_size * p * p), (gt, gh, gw)


def normalize_patches(patches, cfg: VideoConfig):
    """uint8 patches → float32 as torchvision's fused rescale + normalize: (x - mean/r) / (std/r)."""
    scale = np.float32(1.0 / cfg.rescale_factor)
    mean = (np.asarray(cfg.image_mean, np.float32) * scale)[:, None]
    std = (np.asarray(cfg.image_std, np.float32) * scale)[:, None]
    out = patches.astype(np.float32)
    by_channel = out.reshape(len(out), len(mean), -1)  # rows are channel-major
    by_channel -= mean
    by_channel /= std
    return out


def timestamps(indices, fps, temporal_patch_size):
    """Mean time (s) of each temporal patch, the last frame repeated to fill the final patch."""
    indices = list(indices)
    if len(indices) % temporal_patch_size:
        indices += [indices[-1]] * (temporal_patch_size - len(indices) % temporal_patch_size)
    times = [i / fps for i in indices]
    return [
        (times[i] + times[i + temporal_patch_size - 1]) / 2 for i in range(0, len(times), temporal_patch_size)
    ]


def preprocess_clip(clip: Clip, cfg: VideoConfig, cap_pixels_per_frame=None):
    """A clip → (patches, (grid_t, grid_h, grid_w), timestamp of each temporal patch)."""
    n = len(clip.frames)
    h, w = clip.frames[0].shape[:2] if n else (1, 1)
    budget = frame_pixel_budget(n, cfg, cap_pixels_per_frame) if n else cfg.max_pixels
    rh, rw = smart_resize(h, w, cfg.factor, cfg.min_pixels, budget, n, cfg.temporal_patch_size)
    frames = resize_frames(clip.frames, rh, rw, cfg.temporal_patch_size)
    patches, grid = patchify(frames, cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size)
    return normalize_patches(patches, cfg), grid, timestamps(clip.indices, clip.fps, cfg.temporal_patch_size)
