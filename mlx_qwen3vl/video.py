"""Videos → patches: frame sampling, sizing, resizing, normalization and the patch layout.

Mirrors transformers' Qwen3VLVideoProcessor (torchvision backend) with numpy + pillow only.
Frames reach this module as RGB uint8 arrays (H, W, 3); turning user objects into such
arrays is the processor's job. `patchify` is shared with images: an image is a one-frame
clip repeated to the temporal patch. Pixels stay uint8 through the resize and the patch
reordering (4x less memory traffic than floats) and become float32 last.
"""

import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from PIL import Image

from .errors import InputError

DEFAULT_SOURCE_FPS = 24  # what transformers assumes when a clip comes without its fps


@dataclass
class VideoConfig:
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 128 * 32 * 32
    max_pixels: int = 768 * 32 * 32
    image_mean: tuple = (0.5, 0.5, 0.5)
    image_std: tuple = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    fps: float = 2
    min_frames: int = 4
    max_frames: int = 768
    max_video_tokens: int = 768

    @classmethod
    def from_dict(cls, d):
        size = d.get("size") or {}
        base = cls()
        return cls(
            patch_size=d.get("patch_size", base.patch_size),
            temporal_patch_size=d.get("temporal_patch_size", base.temporal_patch_size),
            merge_size=d.get("merge_size", base.merge_size),
            min_pixels=size.get("shortest_edge", d.get("min_pixels", base.min_pixels)),
            max_pixels=size.get("longest_edge", d.get("max_pixels", base.max_pixels)),
            image_mean=tuple(d.get("image_mean", base.image_mean)),
            image_std=tuple(d.get("image_std", base.image_std)),
            rescale_factor=d.get("rescale_factor", base.rescale_factor),
            fps=d.get("fps", base.fps) or base.fps,
            min_frames=d.get("min_frames", base.min_frames),
            max_frames=d.get("max_frames", base.max_frames),
            max_video_tokens=d.get("max_video_tokens", base.max_video_tokens),
        )

    @property
    def factor(self):
        return self.patch_size * self.merge_size


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


def read_video_file(path, source_fps, sample, cfg: VideoConfig):
    """Decode a video file with PyAV, converting only the frames that are kept."""
    try:
        import av
    except ImportError:
        raise InputError(
            f'video {str(path)!r}: reading video files needs PyAV: pip install "mlx-qwen3vl[video]"'
        ) from None
    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            fps = source_fps or (float(stream.average_rate) if stream.average_rate else None)
            fps = DEFAULT_SOURCE_FPS if fps is None else float(fps)
            total = stream.frames
            if total:  # the container knows its length: decode up to the last wanted frame only
                indices = sample_indices(total, fps, cfg) if sample else list(range(total))
                wanted = set(indices)
                kept = {}
                for i, frame in enumerate(container.decode(video=0)):
                    if i > indices[-1]:
                        break
                    if i in wanted:
                        kept[i] = frame.to_ndarray(format="rgb24")
                indices = [i for i in indices if i in kept]
                frames = [kept[i] for i in indices]
            else:
                frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
                if frames:
                    return clip_from_frames(frames, fps, sample, cfg)
    except (OSError, IndexError, av.error.FFmpegError) as e:
        reason = " ".join(str(e).split())[:200]
        raise InputError(f"video {str(path)!r} could not be decoded ({reason}); pass a readable video file") from None
    if not frames:
        raise InputError(f"video {str(path)!r} has no frames; pass a non-empty video")
    return Clip(frames, indices, fps)


# ---------------------------------------------------------------------------- sizing


def frame_pixel_budget(num_frames, cfg: VideoConfig):
    """Total pixel budget for a clip, with the per-frame cap qwen-vl-utils applies."""
    frame_cap = cfg.max_video_tokens * cfg.factor * cfg.factor
    per_frame = max(min(frame_cap, cfg.max_pixels // num_frames), int(cfg.min_pixels * 1.05))
    return per_frame * num_frames


def smart_resize_video(num_frames, height, width, cfg: VideoConfig, max_pixels):
    """Frame size (h, w): multiples of the factor, clip pixels within [min_pixels, max_pixels]."""
    factor, tf = cfg.factor, cfg.temporal_patch_size
    if num_frames < tf:
        raise InputError(f"{num_frames} frame(s) is fewer than the temporal patch ({tf}); pass at least {tf} frames")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise InputError(f"frames of {width}x{height} pixels have an aspect ratio above 200; crop or pad them")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / tf) * tf
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt(num_frames * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < cfg.min_pixels:
        beta = math.sqrt(cfg.min_pixels / (num_frames * height * width))
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


def preprocess_clip(clip: Clip, cfg: VideoConfig):
    """A clip → (patches, (grid_t, grid_h, grid_w), timestamp of each temporal patch)."""
    n = len(clip.frames)
    h, w = clip.frames[0].shape[:2] if n else (0, 0)
    rh, rw = smart_resize_video(n, h, w, cfg, frame_pixel_budget(n, cfg) if n else cfg.max_pixels)
    frames = resize_frames(clip.frames, rh, rw, cfg.temporal_patch_size)
    patches, grid = patchify(frames, cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size)
    return normalize_patches(patches, cfg), grid, timestamps(clip.indices, clip.fps, cfg.temporal_patch_size)
