"""What one request may cost, checked before anything is decoded: image sizes read from their
headers (Pillow's lazy open), video frame counts and sizes from the container (demuxed, not
decoded), and the pixels the processor would make of them. A refused request never decodes a pixel."""

from dataclasses import dataclass

import numpy as np

from .. import media
from .. import video as vid
from ..errors import InputError
from ..processor import image_budget
from .fetch import hide_temp_paths
from .protocol import APIError

# Every limit's default, here (no server dependency needed to read them: --help shows them).
DEFAULT_MAX_REQUEST_PIXELS = 32 << 20  # 33.5M: one 8K (7680x4320) image, or four 4K screenshots
DEFAULT_MAX_VIDEO_FRAMES = 3600  # two minutes at 30 fps
DEFAULT_GRAMMAR_TIMEOUT_S = 5.0
DEFAULT_MAX_CONNECTIONS = 256  # well below the 2048 file descriptors mlx-lm sets at import
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 60.0
DEFAULT_KEEP_ALIVE_TIMEOUT_S = 5.0


@dataclass
class Limits:
    max_request_pixels: int = DEFAULT_MAX_REQUEST_PIXELS
    max_video_frames: int = DEFAULT_MAX_VIDEO_FRAMES


def _over(param, message):
    return APIError(400, message, param=param, code="over_budget")


def check_pixel_options(req, limits: Limits):
    """A request's min_pixels / max_pixels may not ask for more than the server's cap."""
    for name in ("min_pixels", "max_pixels"):
        value = getattr(req, name)
        if value is not None and value > limits.max_request_pixels:
            raise _over(name, f"'{name}' is {value}; this server's limit is {limits.max_request_pixels} pixels per "
                        "request (--max-request-pixels)")


def check_token_ids(sampling, vocab: int):
    """The token ids a request names (logit_bias, stop_token_ids) lie in the model's vocabulary."""
    for name, ids in (("logit_bias", [t for t, _ in sampling.logit_bias or ()]),
                      ("stop_token_ids", sampling.stop_token_ids)):
        bad = [t for t in ids if t >= vocab]
        if bad:
            raise APIError(400, f"'{name}' names token id {bad[0]}, which is not in this model's vocabulary (ids 0 to "
                           f"{vocab - 1})", param=name, code="invalid_value")


def check_media(images, videos, req, processor, limits: Limits, context=None):
    """Refuse the request before decoding if its media would exceed the budget: each image's own
    pixels (as stored) and the pixels of all images (as resized for the model) and video frames
    (as decoded: the kept frames are held at once) together at most --max-request-pixels, each
    video, and all of them together, at most --max-video-frames frames; the images' tokens alone
    within the model's `context` (where given). `images`: encoded bytes (or decoded RGB arrays);
    `videos`: file paths."""
    cap, total, tokens, where = limits.max_request_pixels, 0, 0, req.conversation
    cfg = processor.image_config
    try:
        lo, hi = image_budget(cfg, req.min_pixels, req.max_pixels)
    except InputError as e:
        raise APIError(400, str(e), param="max_pixels", code="invalid_value") from None
    for i, data in enumerate(images, 1):
        label = f"image {i}"
        try:
            w, h = (data.shape[1], data.shape[0]) if isinstance(data, np.ndarray) else media.image_size(data, label)
            rh, rw = vid.smart_resize(h, w, cfg.factor, lo, hi)
        except InputError as e:
            raise APIError(400, str(e), param=where, code="invalid_input") from None
        if w * h > cap:
            raise _over(where, f"{label} is {w}x{h} pixels, over this server's limit of {cap} pixels "
                        "(--max-request-pixels); downscale it")
        total += rh * rw
        tokens += rh * rw // cfg.factor ** 2  # one token per merged patch
        if context and tokens > context:
            raise APIError(400, f"the request's images alone come to more than {context} tokens, the model's context; "
                           "send fewer or smaller images, or a smaller max_pixels", param=where,
                           code="context_length_exceeded")
        if total > cap:
            raise _over(where, f"the request's images come to more than {cap} pixels as the model sees them "
                        "(--max-request-pixels); send fewer or smaller images, or a smaller max_pixels")
    vcfg = processor.video_config
    frames = 0
    for i, path in enumerate(videos, 1):
        label = f"video {i}"
        try:
            info = vid.probe_video(path, label, max_frames=limits.max_video_frames)
        except InputError as e:
            raise APIError(400, hide_temp_paths(str(e)), param=where, code="invalid_input") from None
        if info.frames > limits.max_video_frames:
            raise _over(where, f"{label} has more than {limits.max_video_frames} frames (--max-video-frames); "
                        "send a shorter clip")
        frames += info.frames
        if frames > limits.max_video_frames:
            raise _over(where, f"the request's videos have more than {limits.max_video_frames} frames together "
                        "(--max-video-frames); send shorter clips")
        if not info.width or not info.height:
            raise APIError(400, f"{label} does not state its frame size; re-encode it as MP4",
                           param=where, code="invalid_input")
        kept = len(vid.sample_indices(info.frames, info.fps, vcfg)) if info.frames else 0
        total += kept * info.width * info.height
        if total > cap:
            raise _over(where, f"{label}'s {kept} sampled frames of {info.width}x{info.height} bring the "
                        f"request over this server's limit of {cap} pixels (--max-request-pixels); send a "
                        "shorter or smaller clip")
