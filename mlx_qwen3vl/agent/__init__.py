"""GUI-agent toolkit: the prompts UI-Venus-1.5 and Qwen3-VL were trained with (`prompts`), parsers
that turn their answers into points and actions on the user's screenshot (`parse`), pictures of
answers (`draw`), two-stage grounding's window (`zoom`), and the runtime on top of generate:
`ground()` (one pass, or two with zoom=) and `navigate()`; also the computer-use tools of the
Anthropic and OpenAI protocols (`computer_tools`: declarations, the neutral action, each protocol's
vocabulary) and their rendering with the trained prompts and mapping of answers (`computer_use`).
The runner that acts in environments (`envs`, `runner`, `trajectory`, `evaluation`; `python -m
mlx_qwen3vl.agent`) is imported by name, not from here. The grounding and evaluation commands are
mlx_qwen3vl/ground.py and eval_grounding.py.

    from mlx_qwen3vl import load
    from mlx_qwen3vl.agent import ground, parse_action
    model, processor = load("path/to/UI-Venus-1.5")
    hit = ground(model, processor, "screen.png", "the Apply button")
    print(hit.point, hit.box, hit.answer)
    hit = ground(model, processor, "screen.png", "the Apply button", zoom=True)  # pass 2 on a crop
    print(hit.point, hit.window, hit.used_pass, [p.answer for p in hit.passes])
"""

import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple

from ..errors import InputError
from ..generate import generate
from ..media import load_image
from ..processor import image_budget
from ..prompt_cache import PromptCache
from .computer_tools import ComputerAction, ComputerTool, computer_tool, find_computer_tool
from .computer_use import AGENT_FORMATS, ComputerStep, ComputerTurn, computer_messages, map_answer
from .draw import annotate, missing_point_note
from .parse import (REFUSAL, SCALE, VENUS_ACTIONS, Action, Grounding, Window, from_window, parse_action,
                    parse_grounding, parse_point, to_pixel, to_relative, without_reasoning)
from .prompts import (COMPUTER_USE_ACTIONS, GROUNDING_FORMATS, QWEN_GROUNDING_PROMPT, VENUS_GROUNDING_PROMPT,
                      VENUS_HISTORY_LENGTH, VENUS_MOBILE_PROMPT, VENUS_NAVIGATION_SAMPLING, VENUS_NAVIGATION_SYSTEM,
                      VENUS_REFUSAL_CLAUSE, VENUS_WEB_PROMPT, Step, computer_use_messages, computer_use_system_prompt,
                      computer_use_tool, grounding_messages, grounding_prompt, navigation_messages, navigation_prompt)
from .zoom import ZOOM_FRACTION, choose, covers, crop, zoom_fraction, zoom_window


@dataclass
class GroundingPass:
    """One pass of two-stage grounding: its raw answer, read in pixels of the ORIGINAL image
    (pass 2's answer about the crop included), the size of the image it was shown, timing, and why
    its generation ended (`finish_reason`: "stop", "length" or "time_limit"; None, and left out of
    to_dict, when `ask` answered with a str)."""

    answer: str
    status: str
    point: Optional[Tuple[int, int]]
    box: Optional[Tuple[int, int, int, int]]
    image_size: Tuple[int, int]
    seconds: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generation_tokens: int = 0
    prompt_tps: float = 0.0
    generation_tps: float = 0.0
    finish_reason: Optional[str] = None

    def to_dict(self) -> dict:
        out = {"answer": self.answer, "status": self.status, "point": list(self.point) if self.point else None,
               "box": list(self.box) if self.box else None, "image_size": list(self.image_size),
               "timing": {"seconds": round(self.seconds, 4), "prompt_tokens": self.prompt_tokens,
                          "cached_tokens": self.cached_tokens, "generation_tokens": self.generation_tokens,
                          "prompt_tps": round(self.prompt_tps, 2), "generation_tps": round(self.generation_tps, 2)}}
        if self.finish_reason is not None:
            out["finish_reason"] = self.finish_reason
        return out


@dataclass
class GroundingResult:
    """ground()'s answer: point / box in pixels of the original image (None if refused or
    malformed), the raw answer, the image size, and timing.

    With zoom (two-stage grounding): `zoom` is the window fraction, `window` the crop pass 2 saw
    (x1, y1, x2, y2: its first and last pixel on each axis; None when pass 1 gave no point),
    `used_pass` the pass whose answer this is, `passes` both passes (GroundingPass), and the timing
    fields are the two passes' totals. `finish_reason` is the used pass's (a point cut short by
    max_tokens reads "length"; None, and left out of to_dict, for an answer obtained elsewhere)."""

    point: Optional[Tuple[int, int]]
    box: Optional[Tuple[int, int, int, int]]
    status: str
    answer: str
    width: int
    height: int
    format: str
    seconds: float = 0.0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prompt_tps: float = 0.0
    generation_tps: float = 0.0
    zoom: Optional[float] = None
    window: Optional[Tuple[int, int, int, int]] = None
    used_pass: int = 1
    passes: List[GroundingPass] = field(default_factory=list)
    finish_reason: Optional[str] = None

    def to_dict(self) -> dict:
        out = {"point": list(self.point) if self.point else None, "box": list(self.box) if self.box else None,
               "status": self.status, "answer": self.answer, "image_size": [self.width, self.height],
               "format": self.format,
               "timing": {"seconds": round(self.seconds, 4), "prompt_tokens": self.prompt_tokens,
                          "generation_tokens": self.generation_tokens, "prompt_tps": round(self.prompt_tps, 2),
                          "generation_tps": round(self.generation_tps, 2)}}
        if self.finish_reason is not None:
            out["finish_reason"] = self.finish_reason
        if self.zoom is not None:
            out["zoom"] = {"fraction": self.zoom, "window": list(self.window) if self.window else None,
                           "pass": self.used_pass, "passes": [p.to_dict() for p in self.passes]}
        return out


def _rate(tokens, seconds):
    return tokens / seconds if seconds > 0 else 0.0


def _totals(passes: List[GroundingPass]) -> dict:
    """The passes' timing as one call's: seconds and tokens summed, rates over the summed times."""
    if len(passes) == 1:
        p = passes[0]
        return dict(seconds=p.seconds, prompt_tokens=p.prompt_tokens, generation_tokens=p.generation_tokens,
                    prompt_tps=p.prompt_tps, generation_tps=p.generation_tps)
    prompt_s = sum((p.prompt_tokens - p.cached_tokens) / p.prompt_tps for p in passes if p.prompt_tps > 0)
    gen_s = sum((p.generation_tokens - 1) / p.generation_tps for p in passes if p.generation_tps > 0)
    return dict(seconds=sum(p.seconds for p in passes), prompt_tokens=sum(p.prompt_tokens for p in passes),
                generation_tokens=sum(p.generation_tokens for p in passes),
                prompt_tps=_rate(sum(p.prompt_tokens - p.cached_tokens for p in passes if p.prompt_tps > 0), prompt_s),
                generation_tps=_rate(sum(p.generation_tokens - 1 for p in passes if p.generation_tps > 0), gen_s))


def ground_with(ask: Callable, image, instruction: str, *, format: str = "venus", allow_refusal: bool = True,
                zoom=None, window_min_pixels: int = 0) -> GroundingResult:
    """ground() with any answerer: `ask(messages)` answers one grounding turn (the chat messages
    of grounding_messages) with a str or a GenerationResult. ground() passes generate(); a
    client of another runtime, or a test's script, can pass its own.

    zoom: None / False (one pass), True (a window of ZOOM_FRACTION of each side) or the fraction;
    window_min_pixels: the least pixels a window may hold (the model's minimum). See ground()."""
    if format not in GROUNDING_FORMATS:
        raise InputError(f"unknown grounding format {format!r}; use {', '.join(GROUNDING_FORMATS)}")
    fraction = None if zoom is None or zoom is False else zoom_fraction(zoom)
    rgb = load_image(image)
    height, width = rgb.shape[:2]

    def run(pixels, window=None):
        tic = time.perf_counter()
        out = ask(grounding_messages(pixels, instruction, format, allow_refusal))
        seconds = time.perf_counter() - tic
        text = out if isinstance(out, str) else out.text
        g = parse_grounding(text, width, height, window=window)
        stats = {} if isinstance(out, str) else {k: getattr(out, k, 0) or 0 for k in (
            "prompt_tokens", "cached_tokens", "generation_tokens", "prompt_tps", "generation_tps")}
        if not isinstance(out, str):
            stats["finish_reason"] = getattr(out, "finish_reason", None)
        return g, GroundingPass(text, g.status, g.point, g.box, (pixels.shape[1], pixels.shape[0]), seconds, **stats)

    first, p1 = run(rgb)
    passes, window, final, used = [p1], None, first, 1
    if fraction is not None and first.status == "ok":
        window = zoom_window(first.relative, width, height, fraction, window_min_pixels)
        if not covers(window, width, height):  # a window of the whole image would ask the same again
            second, p2 = run(crop(rgb, window), window)
            passes.append(p2)
            final, used = choose(first, second)
    timing = _totals(passes)
    return GroundingResult(final.point, final.box, final.status, final.answer, width, height, format, **timing,
                           zoom=None if fraction is None else float(fraction),
                           window=None if window is None else window.box, used_pass=used, passes=passes,
                           finish_reason=passes[used - 1].finish_reason)


def ground(model, processor, image, instruction: str, *, format: str = "venus", allow_refusal: bool = True,
           zoom=None, min_pixels: Optional[int] = None, max_pixels: Optional[int] = None, max_tokens: int = 128,
           **generate_kwargs) -> GroundingResult:
    """Locate `instruction` on `image` (path, URL, data: URL, PIL image or uint8 array) and return
    the point in the image's own pixels, whatever min_pixels / max_pixels did to it for the model.

    format: "venus" (UI-Venus-1.5's [x,y] prompt; allow_refusal adds its [-1,-1] clause), "qwen"
    (Qwen3-VL's bbox_2d JSON) or "computer_use" (Qwen3-VL's tool call). Greedy by default, as both
    projects evaluate; other generate() options pass through.

    zoom (two-stage grounding, for small targets on large screens): True or a fraction in (0, 1]
    (True: 0.5). Pass 1 on the whole screenshot; pass 2 on a window centred on its point, that
    fraction of each side (never below the model's minimum pixels, shifted to stay inside), at the
    same pixel budget, so the crop is seen in more detail; pass 2's answer is carried into the whole
    screenshot's relative coordinates and mapped by the one rule (see agent.zoom for the procedure
    and why it is this one). A refusal or malformed answer in pass 1 is the answer; one in pass 2
    falls back to pass 1's point. It costs a second generation; only the prompt before the image
    is reused from pass 1's cache (the grounding prompts put the screenshot first: a few tokens for
    venus and qwen, computer_use's whole system prompt)."""
    fraction = None if zoom is None or zoom is False else zoom_fraction(zoom)
    if fraction is not None and generate_kwargs.get("prompt_cache") is None:
        generate_kwargs["prompt_cache"] = PromptCache(model.make_cache())
    floor = image_budget(processor.image_config, min_pixels, max_pixels)[0] if fraction is not None else 0

    def ask(messages):
        return generate(model, processor, messages=messages, max_tokens=max_tokens, min_pixels=min_pixels,
                        max_pixels=max_pixels, **generate_kwargs)

    return ground_with(ask, image, instruction, format=format, allow_refusal=allow_refusal, zoom=fraction,
                       window_min_pixels=floor)


def navigate(model, processor, image, task: str, history: Sequence = (), *, kind: str = "mobile",
             history_length: int = VENUS_HISTORY_LENGTH, **generate_kwargs) -> Tuple[str, Optional[Action]]:
    """One UI-Venus-1.5 navigation step on `image`: its prompt (the last `history_length` steps of
    `history` as text), sampled as UI-Venus' runner does (VENUS_NAVIGATION_SAMPLING, overridable).
    Returns the raw answer and its Action in the image's pixels (None if the answer has none);
    append the Action to `history` for the next step."""
    rgb = load_image(image)
    height, width = rgb.shape[:2]
    options = {**VENUS_NAVIGATION_SAMPLING, **generate_kwargs}
    out = generate(model, processor, messages=navigation_messages(rgb, task, history, kind, history_length), **options)
    return out.text, parse_action(out.text, width, height)


__all__ = ["ground", "ground_with", "navigate", "annotate", "missing_point_note", "parse_point", "parse_grounding",
           "parse_action", "to_pixel", "to_relative", "from_window", "without_reasoning", "zoom_window",
           "zoom_fraction", "crop", "choose", "covers", "Window", "GroundingPass", "ZOOM_FRACTION",
           "ComputerAction", "ComputerTool", "ComputerStep", "ComputerTurn", "computer_tool", "find_computer_tool",
           "computer_messages", "map_answer", "AGENT_FORMATS",
           "grounding_prompt", "grounding_messages", "navigation_prompt", "navigation_messages",
           "computer_use_messages", "computer_use_system_prompt", "computer_use_tool", "Action", "Step",
           "Grounding", "GroundingResult", "VENUS_NAVIGATION_SAMPLING", "GROUNDING_FORMATS", "SCALE", "REFUSAL",
           "COMPUTER_USE_ACTIONS", "VENUS_ACTIONS", "VENUS_GROUNDING_PROMPT", "VENUS_REFUSAL_CLAUSE",
           "VENUS_MOBILE_PROMPT", "VENUS_WEB_PROMPT", "VENUS_NAVIGATION_SYSTEM", "VENUS_HISTORY_LENGTH",
           "QWEN_GROUNDING_PROMPT"]
