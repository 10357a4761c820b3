"""Requests that declare a computer-use tool (Anthropic computer_20250124 / computer_20251124 /
computer_toolset_20260801, OpenAI computer_use_preview / computer): the conversation is rendered
with the checkpoint's trained computer-use prompt (agent.computer_use.computer_messages, in the
server's --agent-format), and the model's answer is mapped to the tool's actions (map_answer).

The conversation's turns (conversation.py) are read as an agent loop: the task is the text of the
user turns before the first assistant turn; each assistant turn is a step, taken on the last
screenshot before it (its calls read back with the tool's parse_call, or the model's own answer
where the server kept it); text that comes back with a tool result is that step's result; the
current screenshot is the conversation's last image. Only the steps the prompt replays are read
(their screenshots resolved under the media policy), and every image is held to the budgets
before anything is decoded.

A replayed step whose calls are the ones this server issued for an answer (same ids, same actions
on the same display) is rendered from that answer as the model wrote it (computer_answers.py).

Coordinates: where the tool declares a display, actions are in its pixels (the screenshot is taken
to show the whole display, whatever its own size); where it declares none, in the pixels of the
screenshot the step acted on.
"""

from dataclasses import dataclass
from typing import Hashable, List, Optional, Sequence, Tuple

from .. import media
from ..agent.computer_tools import ComputerTool
from ..agent.computer_use import (QWEN_HISTORY_LENGTH, ComputerStep, ComputerTurn, computer_messages,
                                  cursor_after, map_answer)
from ..agent.prompts import VENUS_HISTORY_LENGTH
from ..errors import InputError
from ..processor import extract_media
from .computer_answers import ComputerAnswers
from .conversation import Call, Part, Turn, leading_system
from .fetch import resolve_image
from .limits import check_pixel_options
from .protocol import APIError, ChatRequest


@dataclass
class ComputerRequest:
    """What mapping the answer needs: the tool, the display its actions are in, where the pointer
    was left by the earlier steps."""

    tool: ComputerTool
    display: Tuple[int, int]
    cursor: Optional[Tuple[int, int]] = None
    answers: Optional[ComputerAnswers] = None

    def turn(self, answer: str) -> ComputerTurn:
        return map_answer(answer, self.display, tool=self.tool, cursor=self.cursor)

    def issued(self, answer: str, calls: Sequence[Call]):
        """The calls the response carries for `answer` (their ids and protocol actions): kept, so
        that a replay of exactly these calls is rendered from the answer."""
        if self.answers is not None and calls:
            self.answers.put([c.id for c in calls], _issued_key(self.tool, self.display, calls), answer)


def _issued_key(tool: ComputerTool, display, calls: Sequence[Call]) -> Hashable:
    """What a replay must repeat to be the same action: each call read back by the tool (so a
    client's re-serialised action dict still matches), the tool and the display."""
    def read(action):
        batch = action if isinstance(action, list) else [action]
        try:
            return tuple(tool.parse_call(a) for a in batch)
        except InputError:
            return None
    return (tool.type, tuple(display), tuple(read(c.action) for c in calls))


@dataclass
class _Step:
    turn: Turn
    shot: object  # the Part of the screenshot it acted on, or None
    result: List[str]


def agent_loop(turns: List[Turn]) -> Tuple[Optional[str], List[str], List[_Step], Optional[Part]]:
    """Turns read as an agent loop → (the system text, the task's lines, the steps, the current
    screenshot's part or None): the task is the text of the user turns before the first assistant
    turn; each assistant turn is a step, taken on the last screenshot before it; text coming back
    after a step is its result. The MCP server's next_action reads its turns this way too."""
    system, rest = leading_system(turns)
    task, steps, shot = [], [], None
    for t in rest:
        if t.role == "assistant":
            steps.append(_Step(t, shot, []))
            continue
        images = t.images()
        if images:
            shot = images[-1]
        text = t.text("\n").strip()
        if text:
            (steps[-1].result if steps else task).append(text)
    return system, task, steps, shot


def _read(part, builder, cap, budget) -> Tuple[bytes, Tuple[int, int]]:
    data = resolve_image(part.value, builder.policy, part.param, budget)
    try:
        w, h = media.image_size(data, part.param)
    except InputError as e:
        raise APIError(400, str(e), param=part.param, code="invalid_media") from None
    if w * h > cap:
        raise APIError(400, f"'{part.param}' is {w}x{h} pixels, over this server's limit of {cap} pixels "
                       "(--max-request-pixels); downscale it", param=part.param, code="over_budget")
    return data, (w, h)


def _actions(tool, step: _Step):
    out = []
    for call in step.turn.calls:
        if call.action is None or tool.protocol == "anthropic" and not tool.toolset and call.name != tool.name:
            raise APIError(400, f"'{call.param}' calls {call.name!r}, but a request with a computer-use tool may "
                           f"declare no other tools: its prompt has only the computer ({tool.name!r})",
                           param=call.param, code="unsupported_tool")
        batch = call.action if isinstance(call.action, list) else [call.action]
        for k, action in enumerate(batch):
            where = f"{call.param}[{k}]" if isinstance(call.action, list) else call.param
            try:
                parsed = tool.parse_call(action, where)
            except InputError as e:
                raise APIError(400, str(e), param=call.param, code="invalid_value") from None
            if parsed is not None:  # an action outside the shared vocabulary (zoom, hold_key): not replayed
                out.append(parsed)
    return out


def prepare(builder, req: ChatRequest, turns: List[Turn], tool: ComputerTool, agent_format: str,
            answers: Optional[ComputerAnswers] = None, history_length: Optional[int] = None):
    """→ (Prepared, ComputerRequest). `req` carries the sampling, limits and pixel options; its
    messages are not read. `answers`: the answers behind the calls this server issued.
    `history_length`: earlier steps replayed (default: the format's, QWEN_HISTORY_LENGTH or
    VENUS_HISTORY_LENGTH)."""
    check_pixel_options(req, builder.limits)
    system, task, steps, shot = agent_loop(turns)
    if shot is None:
        raise APIError(400, "a computer-use request needs a screenshot: send the current screen as an image in the "
                       "first user message or in a tool result (this model decides each action from one)",
                       param=req.conversation, code="missing_screenshot")
    if not task:
        raise APIError(400, "a computer-use request needs its task as text in the first user message",
                       param=req.conversation, code="missing_task")
    cap = builder.limits.max_request_pixels
    budget = builder.policy.budget()  # all of this request's screenshots
    current, size = _read(shot, builder, cap, budget)
    display = tool.display_size(size)
    keep = history_length if history_length is not None else (
        QWEN_HISTORY_LENGTH if agent_format == "qwen" else VENUS_HISTORY_LENGTH)
    replayed, cursor, seen = [], None, {}
    for step in steps[-keep:] if keep > 0 else []:
        data, step_display = None, display
        if step.shot is not None and (agent_format == "qwen" or tool.display is None):
            if id(step.shot) not in seen:
                seen[id(step.shot)] = (_read(step.shot, builder, cap, budget) if step.shot is not shot
                                       else (current, size))
            data, step_size = seen[id(step.shot)]
            step_display = tool.display_size(step_size)
        actions = _actions(tool, step)
        cursor = cursor_after(actions, cursor) if step_display == display else None
        answer = step.turn.answer
        if answer is None and answers is not None and step.turn.calls:
            answer = answers.get([c.id for c in step.turn.calls], _issued_key(tool, step_display, step.turn.calls))
        replayed.append(ComputerStep(
            screenshot=data if agent_format == "qwen" else None, answer=answer, actions=actions,
            text=step.turn.text("\n").strip() or None, reasoning=step.turn.reasoning, display=step_display,
            result="\n".join(step.result) or None))
    try:
        messages = computer_messages("\n".join(task), current, replayed, format=agent_format, display=display,
                                     system=system, history_length=keep)
    except InputError as e:
        raise APIError(400, str(e), param=req.conversation, code="invalid_input") from None
    images, _ = extract_media(messages)
    prepared = builder.render(req, messages, images, [])
    return prepared, ComputerRequest(tool, display, cursor, answers)
