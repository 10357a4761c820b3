"""The agent loop: screenshot → the trained prompt → the model's answer → ComputerActions executed in
an Environment, until the environment, the model, a loop, the step limit or the time budget ends it.

    from mlx_qwen3vl import load
    from mlx_qwen3vl.agent.envs.miniwob import MiniWoBEnv
    from mlx_qwen3vl.agent.runner import run_task
    model, processor = load("path/to/UI-Venus-1.5-2B")
    with MiniWoBEnv("click-button", seed=0) as env:
        episode = run_task(model, processor, env, agent_format="venus", max_steps=5)
    print(episode.success, episode.reason, [s.action_dicts for s in episode.steps])

**Prompts** are the server's (`computer_use.computer_messages`): "qwen" is Qwen3-VL's computer-use
conversation (system prompt with the tool, the task and first screenshot, then each answer and the
next screenshot as a tool turn), its whole history kept with only the last `history_images`
screenshots (older ones become a line of text, as examples/agent_loop.py does); "venus" is
UI-Venus-1.5's navigation prompt, one turn per step with the last `history_steps` steps as text.
Both are asked through one ChatSession (its KV cache and processed turns reused across steps), or
through a server with the OpenAI client (`ServerAnswerer`, the model in another process).

**Coordinates.** The model sees the Observation's image; `map_answer` gives actions in that image's
pixels; the environment maps them with `envs.to_env_pixel` (recorded beside each step as
`env_point`: the input coordinate it acted at).

**Endings** (`Episode.reason`): "done" (the environment ended the episode: MiniWoB++ scored it),
"terminate" (Qwen terminate / UI-Venus Finished), "answer" (the model answered the user: Qwen
answer, UI-Venus CallUser), "loop" (the same action on the same screen `loop_k` times),
"max_steps", "time_budget" (`time_budget_s` of wall time spent before a step), "context" (the
conversation no longer fits the model).
"""

import base64
import hashlib
import io
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple

from ..errors import ContextLengthError, InputError
from ..processor import VISION_TOKENS
from .computer_use import AGENT_FORMATS, AGENT_SAMPLING, ComputerStep, computer_messages, map_answer
from .envs.base import Environment, Observation, to_env_pixel
from .parse import parse_action, parse_grounding
from .prompts import VENUS_HISTORY_LENGTH, VENUS_NAVIGATION_SAMPLING, computer_use_system_prompt

# UI-Venus' navigation runner: its pixel budget and answer length; each format samples as the server
# does (venus: greedy with repetition penalty 1.05, qwen: greedy).
MAX_TOKENS = VENUS_NAVIGATION_SAMPLING["max_tokens"]
MAX_PIXELS = VENUS_NAVIGATION_SAMPLING["max_pixels"]
MIN_PIXELS = VENUS_NAVIGATION_SAMPLING["min_pixels"]
HISTORY_IMAGES = 2  # qwen format: screenshots kept in the conversation (older ones become OMITTED)
LOOP_K = 3
OMITTED = {"type": "text", "text": "(an earlier screenshot, omitted)"}
ENDINGS = ("done", "terminate", "answer", "loop", "max_steps", "time_budget", "context")
# What a history step's text costs in the context budget (its answer, the template's tokens): the
# answers of a navigation model are an action and a sentence or two.
HISTORY_STEP_TOKENS = 160


# ---------------------------------------------------------------------------------------------
# Prompts: the same messages for a live step and a replayed one
# ---------------------------------------------------------------------------------------------
def keep_last_images(messages, n: int):
    """Replace all but the last `n` images of `messages` with OMITTED (in place). The session's cache
    is reused up to the first changed turn, so dropping an image costs a re-read of what follows."""
    seen = 0
    for message in reversed(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for i in reversed(range(len(content))):
            if content[i].get("type") == "image":
                seen += 1
                if seen > n:
                    content[i] = dict(OMITTED)
    return messages


def without_vision_tokens(text: str) -> str:
    """An answer as the history shows it: the vision markers a confused model may emit removed (they
    would read as media slots), as ChatSession keeps its answers."""
    for token in VISION_TOKENS:
        text = text.replace(token, "")
    return text


def step_messages(task: str, screenshots: Sequence, answers: Sequence[str], *, agent_format: str,
                  history_images: int = HISTORY_IMAGES, history_steps: int = VENUS_HISTORY_LENGTH,
                  kind: str = "web") -> list:
    """The prompt of the step that sees screenshots[-1], after the earlier steps' screenshots and
    answers (len(answers) == len(screenshots) - 1): qwen, the whole conversation with the last
    `history_images` screenshots; venus, the navigation prompt with the last `history_steps` steps."""
    if len(answers) != len(screenshots) - 1:
        raise ValueError("one answer per earlier screenshot")
    answers = [without_vision_tokens(a) for a in answers]
    if agent_format == "qwen":
        history = [ComputerStep(screenshot=s, answer=a) for s, a in zip(screenshots, answers)]
        messages = computer_messages(task, screenshots[-1], history, format="qwen", history_length=len(history))
        return keep_last_images(messages, history_images)
    history = [ComputerStep(answer=a) for a in answers]
    return computer_messages(task, screenshots[-1], history, format="venus", history_length=history_steps, kind=kind)


def fitting_max_pixels(model, processor, task: str, *, agent_format: str, max_steps: int, history_images: int,
                       history_steps: int, cap: int = MAX_PIXELS) -> int:
    """The largest screenshot budget (pixels, at most `cap`) with which the last step's prompt fits
    the model's context with room for HISTORY_STEP_TOKENS per earlier step (qwen: every step, and
    `history_images` screenshots; venus: `history_steps` steps, one screenshot)."""
    context = model.config.text_config.max_position_embeddings
    count = lambda text: len(processor.tokenizer(text)["input_ids"])  # noqa: E731
    if agent_format == "qwen":
        fixed = count(computer_use_system_prompt()) + count(task) + max_steps * HISTORY_STEP_TOKENS
        images = max(1, min(history_images, max_steps))
    else:
        text = step_messages(task, [None], [], agent_format="venus")[1]["content"][0]["text"]
        fixed = count(text) + min(history_steps, max_steps) * HISTORY_STEP_TOKENS
        images = 1
    factor = processor.image_config.factor
    per_image = (context - 1 - fixed - 32) // images
    floor = processor.image_config.min_pixels
    if per_image * factor ** 2 < min(floor, MIN_PIXELS):
        raise InputError(f"{max_steps} steps do not fit the model's context of {context} tokens (the prompt's text "
                         f"takes about {fixed}); lower --max-steps or --history-images")
    return max(min(floor, MIN_PIXELS), min(cap, per_image * factor ** 2))


# ---------------------------------------------------------------------------------------------
# Answerers: the model in this process (one ChatSession) or behind a server (the OpenAI client)
# ---------------------------------------------------------------------------------------------
@dataclass
class Answer:
    text: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generation_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    finish_reason: Optional[str] = None


class LocalAnswerer:
    """The model in this process. One ChatSession: each step's messages replace its conversation,
    and its KV cache and processed turns are reused for what they share with the previous step's (a
    qwen step appends to the last one; a venus step shares the system line and the prompt's start;
    reused across episodes, the next episode shares the system prompt). min_pixels / max_pixels:
    the screenshots' budget (run_task sets them per episode)."""

    def __init__(self, model, processor, *, max_pixels=None, min_pixels=None, **sampling):
        from ..chat_session import ChatSession

        self.model, self.processor = model, processor
        self.min_pixels, self.max_pixels = min_pixels, max_pixels
        self.sampling = sampling
        self.session = ChatSession(model, processor, **sampling)

    def __call__(self, messages) -> Answer:
        from ..generate import stream_generate

        s = self.session
        s.messages = [dict(m, content=list(m["content"])) if isinstance(m.get("content"), list) else dict(m)
                      for m in messages]
        s.settings = [{"min_pixels": self.min_pixels, "max_pixels": self.max_pixels} for _ in s.messages]
        tic = time.perf_counter()
        first, text, last = None, "", None
        for piece in stream_generate(self.model, self.processor, inputs=s.encode(), prompt_cache=s.prompt_cache,
                                     **s.generation_kwargs):
            if first is None:
                first = time.perf_counter()
            text += piece.text
            last = piece
        end = time.perf_counter()
        first = first or end
        return Answer(text, last.prompt_tokens if last else 0, last.cached_tokens if last else 0,
                      last.generation_tokens if last else 0, first - tic, end - first,
                      last.finish_reason if last else None)


def _data_url(image) -> str:
    import numpy as np
    from PIL import Image

    im = image if isinstance(image, Image.Image) else Image.fromarray(np.asarray(image))
    buf = io.BytesIO()
    im.convert("RGB").save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def openai_messages(messages) -> list:
    """Chat messages with their images as PNG data URLs (the OpenAI chat-completions form)."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = [{"type": "image_url", "image_url": {"url": _data_url(b["image"])}} if b.get("type") == "image"
                       else b for b in content]
        out.append({**m, "content": content})
    return out


class ServerAnswerer:
    """The model behind an OpenAI-compatible server (this package's, or another engine's): the same
    messages, sent to `base_url`'s chat completions with the `openai` client, streamed so that the
    time to the first token (prefill) and the rest (decode) are measured apart."""

    def __init__(self, base_url: str, *, model: str = "default", api_key: Optional[str] = None, timeout: float = 600,
                 **sampling):
        import openai

        self.client = openai.OpenAI(base_url=base_url, api_key=api_key or "none", max_retries=0, timeout=timeout)
        self.model = model
        self.sampling = {k: v for k, v in sampling.items() if k in ("temperature", "max_tokens", "top_p", "seed")}
        extra = {k: v for k, v in sampling.items() if k in ("repetition_penalty", "top_k", "min_p")}
        self.extra_body = extra or None

    def __call__(self, messages) -> Answer:
        tic = time.perf_counter()
        first, text, usage, finish = None, "", None, None
        stream = self.client.chat.completions.create(model=self.model, messages=openai_messages(messages), stream=True,
                                                     stream_options={"include_usage": True},
                                                     extra_body=self.extra_body, **self.sampling)
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                if choice.delta and choice.delta.content:
                    if first is None:
                        first = time.perf_counter()
                    text += choice.delta.content
                if choice.finish_reason:
                    finish = choice.finish_reason
        end = time.perf_counter()
        first = first or end
        details = getattr(usage, "prompt_tokens_details", None) if usage else None
        return Answer(text, getattr(usage, "prompt_tokens", 0) or 0, getattr(details, "cached_tokens", 0) or 0,
                      getattr(usage, "completion_tokens", 0) or 0, first - tic, end - first, finish)


# ---------------------------------------------------------------------------------------------
# The episode
# ---------------------------------------------------------------------------------------------
@dataclass
class StepRecord:
    """One step: what the model saw and said, what was done, and what it cost.

    image_size: the screenshot's (width, height). status: map_answer's ("action", "message", "done",
    "unmapped"). actions: the ComputerActions as dicts, points in screenshot pixels; point / end: the
    first pointing action's (None without one), env_point / env_end: the environment's input
    coordinates it acted at (envs.to_env_pixel). box: the answer's box where it gave one (screenshot
    pixels).
    error: why an action was not executed (the environment refused it), else None."""

    index: int
    image_size: Tuple[int, int]
    answer: str
    status: str
    actions: List[dict] = field(default_factory=list)
    point: Optional[Tuple[int, int]] = None
    end: Optional[Tuple[int, int]] = None
    env_point: Optional[Tuple[float, float]] = None
    env_end: Optional[Tuple[float, float]] = None
    box: Optional[Tuple[int, int, int, int]] = None
    text: str = ""
    reason: Optional[str] = None
    error: Optional[str] = None
    screen_hash: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generation_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    act_s: float = 0.0
    reward: float = 0.0
    screenshot: Optional[str] = None  # the file the trajectory saved it to

    def to_dict(self) -> dict:
        out = asdict(self)
        for k in ("prefill_s", "decode_s", "act_s"):
            out[k] = round(out[k], 4)
        return out


@dataclass
class Episode:
    task: str
    env: str
    agent_format: str
    steps: List[StepRecord]
    reason: str
    detail: str = ""
    reward: float = 0.0
    success: bool = False
    seconds: float = 0.0
    outcome: Optional[str] = None
    message: Optional[str] = None
    settings: dict = field(default_factory=dict)  # what shaped the prompts and sampling (replay reuses them)

    def to_dict(self) -> dict:
        return {"task": self.task, "env": self.env, "agent_format": self.agent_format, "reward": self.reward,
                "success": self.success, "reason": self.reason, "detail": self.detail, "outcome": self.outcome,
                "message": self.message, "seconds": round(self.seconds, 3), "settings": self.settings,
                "steps": [s.to_dict() for s in self.steps]}


def screen_hash(image) -> str:
    import numpy as np

    a = np.ascontiguousarray(np.asarray(image))
    return hashlib.blake2b(a.tobytes() + repr(a.shape).encode(), digest_size=16).hexdigest()


def _pointing(actions):
    return next((a for a in actions if a.point is not None or a.end is not None), None)


def record_step(index: int, obs: Observation, answer: Answer) -> Tuple[StepRecord, object]:
    """(StepRecord of `answer` about `obs`, map_answer's turn)."""
    width, height = obs.image.size
    turn = map_answer(answer.text, (width, height))
    rec = StepRecord(index, (width, height), answer.text, turn.status, [a.to_dict() for a in turn.actions],
                     text=turn.text, reason=turn.reason, prompt_tokens=answer.prompt_tokens,
                     cached_tokens=answer.cached_tokens, generation_tokens=answer.generation_tokens,
                     prefill_s=answer.prefill_s, decode_s=answer.decode_s)
    first = _pointing(turn.actions)
    if first is not None:
        rec.point = tuple(first.point) if first.point is not None else None
        rec.end = tuple(first.end) if first.end is not None else None
        rec.env_point = to_env_pixel(rec.point, obs) if rec.point else None
        rec.env_end = to_env_pixel(rec.end, obs) if rec.end else None
    g = parse_grounding(answer.text, width, height)
    if g.status == "ok" and g.box is not None:
        rec.box = tuple(g.box)
    return rec, turn


def _ends_with_answer(text: str, width: int, height: int) -> bool:
    a = parse_action(text, width, height)
    return a is not None and a.name in ("answer", "CallUser", "Answer")


def run_task(model, processor, env: Environment, task: Optional[str] = None, *, agent_format: str = "venus",
             max_steps: int = 15, time_budget_s: Optional[float] = None, history_images: int = HISTORY_IMAGES,
             history_steps: int = VENUS_HISTORY_LENGTH, loop_k: int = LOOP_K, max_pixels: Optional[int] = None,
             min_pixels: Optional[int] = None, answerer: Optional[Callable] = None,
             on_step: Optional[Callable] = None, kind: str = "web", **sampling) -> Episode:
    """Run one episode of `env` (reset here; closed by the caller) and return the Episode.

    task: the instruction (default: the one env.reset() gives). agent_format: "venus" or "qwen"
    (the prompts; answers of either syntax are read). Sampling defaults to the server's for the
    format (AGENT_SAMPLING: greedy; venus adds UI-Venus' repetition penalty 1.05) and UI-Venus'
    max_tokens of 2048; `sampling` overrides them.
    max_pixels: the screenshot budget (default: UI-Venus' 12,845,056, lowered until the prompt fits
    the model's context). answerer: ask(messages) → Answer (default: a new LocalAnswerer on model and
    processor; pass one to reuse it across episodes, its sampling then its own; ServerAnswerer for a
    server, model and processor then None).
    on_step(record, obs): called after each step is executed (the trajectory writer)."""
    if agent_format not in AGENT_FORMATS:
        raise InputError(f"unknown agent format {agent_format!r}; use {' or '.join(AGENT_FORMATS)}")
    for name, value, least in (("max_steps", max_steps, 1), ("history_images", history_images, 1),
                               ("history_steps", history_steps, 0), ("loop_k", loop_k, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise InputError(f"{name} must be an integer of at least {least}, not {value!r}")
    if time_budget_s is not None and not time_budget_s > 0:
        raise InputError(f"time_budget_s must be positive, not {time_budget_s!r}")
    options = {k: v for k, v in {"max_tokens": MAX_TOKENS, **AGENT_SAMPLING[agent_format], **sampling}.items()
               if k not in ("min_pixels", "max_pixels")}
    start = time.perf_counter()
    obs, env_task = env.reset()
    task = env_task if task is None else task
    if not isinstance(task, str) or not task.strip():
        raise InputError("the task is empty: give one (--task)")
    settings = {"agent_format": agent_format, "max_steps": max_steps, "history_images": history_images,
                "history_steps": history_steps, "loop_k": loop_k, "kind": kind, "sampling": options}
    if answerer is None:
        answerer = LocalAnswerer(model, processor, **options)
    if isinstance(answerer, LocalAnswerer):
        if max_pixels is None:
            max_pixels = fitting_max_pixels(answerer.model, answerer.processor, task, agent_format=agent_format,
                                            max_steps=max_steps, history_images=history_images,
                                            history_steps=history_steps)
        answerer.max_pixels = max_pixels
        answerer.min_pixels = min_pixels if min_pixels is not None else min(MIN_PIXELS, max_pixels)
        settings.update(max_pixels=answerer.max_pixels, min_pixels=answerer.min_pixels, sampling=answerer.sampling)
    screenshots, answers, steps, seen = [], [], [], {}
    reason, detail, outcome, message = "max_steps", f"{max_steps} steps taken", None, None
    for i in range(max_steps):
        if time_budget_s is not None and time.perf_counter() - start > time_budget_s:
            reason, detail = "time_budget", f"{time_budget_s:g} s spent before step {i + 1}"
            break
        screenshots.append(obs.image)
        messages = step_messages(task, screenshots, answers, agent_format=agent_format,
                                 history_images=history_images, history_steps=history_steps, kind=kind)
        try:
            answer = answerer(messages)
        except ContextLengthError as e:
            reason, detail = "context", str(e)
            break
        answers.append(answer.text)
        rec, turn = record_step(i, obs, answer)
        rec.screen_hash = screen_hash(obs.image)
        steps.append(rec)
        key = (rec.screen_hash, json.dumps(rec.actions, sort_keys=True) if rec.actions else rec.answer.strip())
        seen[key] = seen.get(key, 0) + 1
        tic = time.perf_counter()
        if turn.status == "action":
            for action in turn.actions:
                try:
                    env.act(action)
                except InputError as e:  # an action the environment cannot carry out
                    rec.error = str(e)
                    break
                if env.done:  # the task scored, or the person stopped the episode
                    break
        rec.act_s = time.perf_counter() - tic
        rec.reward = float(env.reward)
        ended = None
        if env.done:
            ended = ("done", getattr(env, "stop_reason", None) or "the environment ended the episode")
        elif turn.status == "done":
            outcome, message = turn.outcome, turn.text or None
            ended = ("terminate", f"the model ended the task ({turn.outcome or 'no status'})")
        elif turn.status == "message" and _ends_with_answer(answer.text, *rec.image_size):
            message = turn.text
            ended = ("answer", "the model answered")
        elif seen[key] >= loop_k:
            ended = ("loop", f"the same action on the same screen {loop_k} times (step {i + 1})")
        if on_step is not None:
            on_step(rec, obs)
        if ended:
            reason, detail = ended
            break
        obs = env.screenshot()
    reward = float(env.reward)
    return Episode(task, getattr(env, "name", type(env).__name__), agent_format, steps, reason, detail, reward,
                   success=bool(getattr(env, "success", reward > 0)), seconds=time.perf_counter() - start,
                   outcome=outcome, message=message, settings=settings)


__all__ = ["run_task", "step_messages", "keep_last_images", "fitting_max_pixels", "LocalAnswerer", "ServerAnswerer",
           "Answer", "StepRecord", "Episode", "record_step", "screen_hash", "openai_messages", "ENDINGS",
           "MAX_TOKENS", "HISTORY_IMAGES", "LOOP_K"]
