"""Pictures of answers: the point, box and drag path drawn on the screenshot (and two-stage
grounding's zoom window), and a visible mark when there is no point."""

import math
from typing import Optional

WINDOW_COLOUR = (0, 120, 255)
DRAG_COLOUR = (255, 140, 0)


def annotate(image, point=None, box=None, path=None, note=None, window=None, drag=None):
    """Draw `window` (two-stage grounding's crop, a blue outline: x1, y1, x2, y2 inclusive), `box`
    (green outline), `drag` (a drag's end point: an orange line from `point` to it, ending in an
    arrowhead) and `point` (ringed dot with a crosshair) on a copy of the image (RGB array or PIL
    image). With `note` (e.g. "no point found") the picture grows: a red frame round the screenshot
    and the note on a red band below it, so a picture of an answer without a point never passes for
    the plain screenshot and hides none of it. Returns the PIL image, also written to `path` as PNG
    when given."""
    import numpy as np
    from PIL import Image, ImageDraw, ImageFont

    im = Image.fromarray(np.asarray(image)) if not isinstance(image, Image.Image) else image.convert("RGB").copy()
    draw = ImageDraw.Draw(im)
    line = max(2, round(min(im.size) / 200))
    if window:
        draw.rectangle(window, outline=WINDOW_COLOUR, width=line)
    if box:
        draw.rectangle(box, outline=(0, 200, 0), width=line)
    if drag and point:
        draw_arrow(draw, point, drag, line)
    if point:
        x, y = point
        r = max(6, round(min(im.size) / 40))
        draw.line([(x - 2 * r, y), (x + 2 * r, y)], fill=(255, 255, 255), width=line)
        draw.line([(x, y - 2 * r), (x, y + 2 * r)], fill=(255, 255, 255), width=line)
        draw.ellipse([x - r, y - r, x + r, y + r], outline=(255, 0, 0), width=line)
        d = max(2, r // 3)
        draw.ellipse([x - d, y - d, x + d, y + d], fill=(255, 0, 0), outline=(255, 255, 255))
    if note:
        im = _with_note(im, note, line, ImageDraw, ImageFont, Image)
    if path is not None:
        im.save(path, format="PNG")
    return im


def _with_note(im, note, line, ImageDraw, ImageFont, Image):
    """`im` framed in red, `line` pixels wide, above a red band holding `note` in white."""
    try:
        font = ImageFont.load_default(size=max(9, min(28, im.height // 24)))
    except (TypeError, OSError, ImportError):  # Pillow < 10.1 or no FreeType: the fixed bitmap font
        font = ImageFont.load_default()
    room = im.width - 2 * line
    rows = [""]  # the note's words wrapped to the width
    for word in note.split():
        wider = f"{rows[-1]} {word}".strip()
        if rows[-1] and font.getlength(wider) > room:
            rows.append(word)
        else:
            rows[-1] = wider
    text = "\n".join(rows)
    probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    left, top, right, bottom = probe.multiline_textbbox((0, 0), text, font=font)
    out = Image.new("RGB", (im.width + 2 * line, im.height + 2 * line + bottom + 2 * line), (200, 0, 0))
    out.paste(im, (line, line))
    ImageDraw.Draw(out).multiline_text((2 * line, im.height + 2 * line), text, fill=(255, 255, 255), font=font)
    return out


def draw_arrow(draw, start, end, width, colour=DRAG_COLOUR):
    """A line from `start` to `end` with an arrowhead at `end` (a drag's path)."""
    (x1, y1), (x2, y2) = start, end
    draw.line([(x1, y1), (x2, y2)], fill=colour, width=width)
    length = math.hypot(x2 - x1, y2 - y1)
    if length == 0:
        return
    ux, uy = (x2 - x1) / length, (y2 - y1) / length
    size = max(6, 4 * width)
    left = (x2 - size * ux + size / 2 * uy, y2 - size * uy - size / 2 * ux)
    right = (x2 - size * ux - size / 2 * uy, y2 - size * uy + size / 2 * ux)
    draw.polygon([(x2, y2), left, right], fill=colour)


def missing_point_note(status: str) -> Optional[str]:
    """What an annotated picture says when the answer gave no point (None when it gave one)."""
    return {"refused": "no point: the model says the target is absent",
            "malformed": "no point found: the answer could not be read"}.get(status)

