"""Two-stage grounding's geometry: the window the second pass looks at, and the crop.

Pass 1 answers on the whole screenshot. The window is centred on its point (in exact relative
units, not on the floored pixel), `fraction` of the screenshot's width and height (default one
half), made larger, keeping the screenshot's aspect, until it holds at least the model's minimum
pixels (a smaller crop would only be upscaled), and shifted to stay inside the image. Pass 2
answers on that crop at the processor's normal budget, and its answer is read with the window
(parse_grounding(..., window=)): crop-relative → screenshot-relative exactly, then the one
floor-and-clamp rule. A pass 1 refusal or malformed answer is the answer; a pass 2 one falls back
to pass 1's point (`choose`).

UI-Venus-1.5 reports "+ ZoomIn" figures (inclusionAI/UI-Venus README) but neither its repository
nor its technical report describes the procedure; the one trace is a results viewer in that
repository (compare_results.py on its VenusBench-Mobile branch) labelled "Zoom-In (0.5)" that
draws a `crop_box` in the screenshot's pixels. The default fraction 0.5 agrees with it; the rest
(centring, shifting, the minimum, the fallback) is this project's rule.
"""

import math
from fractions import Fraction
from typing import Tuple

import numpy as np

from ..errors import InputError
from .parse import SCALE, Grounding, Window, _number

ZOOM_FRACTION = Fraction(1, 2)


def zoom_fraction(value, name: str = "zoom") -> Fraction:
    """`zoom=` as a window fraction: True → ZOOM_FRACTION; a number in (0, 1] → itself, exactly
    (a float as written: 0.3 is 3/10). `name`: what the error message calls the setting."""
    if value is True:
        return ZOOM_FRACTION
    f = None if isinstance(value, bool) else _number(repr(value) if isinstance(value, float) else value)
    if f is None or not 0 < f <= 1:
        raise InputError(f"{name} {value!r}: give the window's fraction of the screenshot's width and height, "
                         "a number in (0, 1] (0.5: half of each)")
    return f


def _round(v: Fraction) -> int:
    return math.floor(v + Fraction(1, 2))  # to the nearest integer, halves up


def zoom_window(point: Tuple, width: int, height: int, fraction=ZOOM_FRACTION, min_pixels: int = 0) -> Window:
    """The crop pass 2 looks at, for pass 1's `point` (x, y in 0-1000 relative to the whole image).

    Size: ceil(fraction * width) x ceil(fraction * height); when that holds fewer than
    `min_pixels`, both sides grow by one factor (then one by one) until it holds them, at most the
    whole image. Place: centred on the point (left = round(x / 1000 * width - w / 2), halves up),
    shifted to stay inside the image."""
    f = zoom_fraction(fraction)
    w, h = min(width, math.ceil(f * width)), min(height, math.ceil(f * height))
    if w * h < min_pixels:
        g = math.sqrt(min_pixels / (width * height))
        w, h = min(width, max(w, math.ceil(g * width))), min(height, max(h, math.ceil(g * height)))
        while w * h < min_pixels and (w < width or h < height):
            if w < width and (h == height or w * height <= h * width):  # the side further behind the aspect
                w += 1
            else:
                h += 1
    x, y = (Fraction(v) for v in point)
    left = min(max(0, _round(x * width / SCALE - Fraction(w, 2))), width - w)
    top = min(max(0, _round(y * height / SCALE - Fraction(h, 2))), height - h)
    return Window(left, top, w, h)


def covers(window: Window, width: int, height: int) -> bool:
    """The window is the whole image: a second pass would ask the same question again."""
    return tuple(window) == (0, 0, width, height)


def crop(rgb: np.ndarray, window: Window) -> np.ndarray:
    """The window's pixels of an (H, W, 3) image, as an array of their own."""
    return np.ascontiguousarray(rgb[window.top:window.top + window.height, window.left:window.left + window.width])


def choose(first: Grounding, second: Grounding) -> Tuple[Grounding, int]:
    """The answer two-stage grounding gives, and the pass that produced it: pass 2's point when it
    has one, otherwise (a refusal or a malformed answer on the crop) pass 1's."""
    return (second, 2) if second.status == "ok" else (first, 1)
