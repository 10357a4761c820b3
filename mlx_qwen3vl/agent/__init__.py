"""GUI-agent toolkit: the prompts UI-Venus-1.5 and Qwen3-VL were trained with (`prompts`), parsers
that turn their answers into points and actions on the user's screenshot (`parse`), pictures of
answers (`draw`), and the runtime on top of generate: `ground()` and `navigate()`. The grounding
command line (`ground`, also `python -m mlx_qwen3vl.ground`) and the evaluation (`eval_grounding`)
live here too, and so do the computer-use tools of the Anthropic and OpenAI protocols
(`computer_tools`: declarations, the neutral action, each protocol's vocabulary) and their
rendering with the trained prompts and mapping of answers (`computer_use`).

    from mlx_qwen3vl import load
    from mlx_qwen3vl.agent import ground, parse_action
    model, processor = load("path/to/UI-Venus-1.5")
    hit = ground(model, processor, "screen.png", "the Apply button")
    print(hit.point, hit.box, hit.answer)
"""

import time
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

from ..errors import InputError
from ..generate import generate
from ..media import load_image
from .computer_tools import ComputerAction, ComputerTool, computer_tool, find_computer_tool
from .computer_use import (AGENT_FORMATS, ComputerStep, ComputerTurn, computer_messages, map_answer)
from .draw import annotate, missing_point_note
from .parse import (REFUSAL, SCALE, VENUS_ACTIONS, Action, Grounding, parse_action, parse_grounding, parse_point,
                    to_pixel, to_relative, without_reasoning)
from .prompts import (COMPUTER_USE_ACTIONS, GROUNDING_FORMATS, QWEN_GROUNDING_PROMPT, VENUS_GROUNDING_PROMPT,
                      VENUS_HISTORY_LENGTH, VENUS_MOBILE_PROMPT, VENUS_NAVIGATION_SAMPLING, VENUS_NAVIGATION_SYSTEM,
                      VENUS_REFUSAL_CLAUSE, VENUS_WEB_PROMPT, Step, computer_use_messages, computer_use_system_prompt,
                      computer_use_tool, grounding_messages, grounding_prompt, navigation_messages, navigation_prompt)


@dataclass
class GroundingResult:
    """ground()'s answer: point / box in pixels of the original image (None if refused or
    malformed), the raw answer, the image size, and timing."""

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

    def to_dict(self) -> dict:
        return {"point": list(self.point) if self.point else None, "box": list(self.box) if self.box else None,
                "status": self.status, "answer": self.answer, "image_size": [self.width, self.height],
                "format": self.format,
                "timing": {"seconds": round(self.seconds, 4), "prompt_tokens": self.prompt_tokens,
                           "generation_tokens": self.generation_tokens, "prompt_tps": round(self.prompt_tps, 2),
                           "generation_tps": round(self.generation_tps, 2)}}


def ground(model, processor, image, instruction: str, *, format: str = "venus", allow_refusal: bool = True,
           min_pixels: Optional[int] = None, max_pixels: Optional[int] = None, max_tokens: int = 128,
           **generate_kwargs) -> GroundingResult:
    """Locate `instruction` on `image` (path, URL, data: URL, PIL image or uint8 array) and return
    the point in the image's own pixels, whatever min_pixels / max_pixels did to it for the model.

    format: "venus" (UI-Venus-1.5's [x,y] prompt; allow_refusal adds its [-1,-1] clause), "qwen"
    (Qwen3-VL's bbox_2d JSON) or "computer_use" (Qwen3-VL's tool call). Greedy by default, as both
    projects evaluate; other generate() options pass through."""
    if format not in GROUNDING_FORMATS:
        raise InputError(f"unknown grounding format {format!r}; use {', '.join(GROUNDING_FORMATS)}")
    rgb = load_image(image)
    height, width = rgb.shape[:2]
    tic = time.perf_counter()
    out = generate(model, processor, messages=grounding_messages(rgb, instruction, format, allow_refusal),
                   max_tokens=max_tokens, min_pixels=min_pixels, max_pixels=max_pixels, **generate_kwargs)
    seconds = time.perf_counter() - tic
    g = parse_grounding(out.text, width, height)
    return GroundingResult(g.point, g.box, g.status, out.text, width, height, format, seconds,
                           out.prompt_tokens, out.generation_tokens, out.prompt_tps, out.generation_tps)


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


__all__ = ["ground", "navigate", "annotate", "missing_point_note", "parse_point", "parse_grounding", "parse_action",
           "to_pixel", "to_relative", "without_reasoning",
           "ComputerAction", "ComputerTool", "ComputerStep", "ComputerTurn", "computer_tool", "find_computer_tool",
           "computer_messages", "map_answer", "AGENT_FORMATS",
           "grounding_prompt", "grounding_messages", "navigation_prompt", "navigation_messages",
           "computer_use_messages", "computer_use_system_prompt", "computer_use_tool", "Action", "Step",
           "Grounding", "GroundingResult", "VENUS_NAVIGATION_SAMPLING", "GROUNDING_FORMATS", "SCALE", "REFUSAL",
           "COMPUTER_USE_ACTIONS", "VENUS_ACTIONS", "VENUS_GROUNDING_PROMPT", "VENUS_REFUSAL_CLAUSE",
           "VENUS_MOBILE_PROMPT", "VENUS_WEB_PROMPT", "VENUS_NAVIGATION_SYSTEM", "VENUS_HISTORY_LENGTH",
           "QWEN_GROUNDING_PROMPT"]
