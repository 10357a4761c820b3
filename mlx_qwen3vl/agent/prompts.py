"""The prompts UI-Venus-1.5 and Qwen3-VL were trained with (text must match to the character):
grounding, navigation and computer use, as chat messages."""

import json
from dataclasses import dataclass
from typing import Sequence

from ..errors import InputError
from .parse import SCALE, Action

# UI-Venus-1.5 grounding (inclusionAI/UI-Venus, models/grounding/ui_venus1_5_gd.py): the image,
# then this instruction; the refusal clause lets the model answer [-1,-1] for an absent target.
VENUS_GROUNDING_PROMPT = (
    "Output the center point of the position corresponding to the following instruction: \n{}. \n\n"
    "The output should just be the coordinates of a point, in the format [x,y]."
)
VENUS_REFUSAL_CLAUSE = (
    " Additionally, if the task is infeasible (e.g., the task is not related to the image), "
    "the output should be [-1,-1]."
)

# UI-Venus-1.5 navigation (models/navigation/utils.py): one user turn per step, the prompt text
# then the screenshot, after the system line "You are a helpful assistant."; earlier steps enter as
# text only ("Step i: <think>..</think><action>..</action>", the last 5 in scripts/run_navi.sh).
# That runner still rescales answers by the resized image (a UI-Venus-1.0 / Qwen2.5-VL leftover);
# the 1.5 models answer 0-1000 like Qwen3-VL, which its Venus_framework maps by / 1000, as here.
VENUS_MOBILE_PROMPT = """
**You are a GUI Agent.**  
Your task is to analyze a given user task, review current screenshot and previous actions, and determine the next action to complete the task.

### User Task
{user_task}

### Previous Actions
{previous_actions}

### Available Actions
You may execute one of the following functions:
Click(box=(x1, y1))
Drag(start=(x1, y1), end=(x2, y2))
Scroll(start=(x1, y1), end=(x2, y2), direction='down/up/right/left')
Type(content='')
Launch(app='')
Wait()
Finished(content='')
CallUser(content='')
LongPress(box=(x1, y1))
PressBack()
PressHome()
PressEnter()
PressRecent()

### Instruction
- Make sure you understand the task goal to avoid wrong actions.
- Make sure you carefully examine the the current screenshot. Sometimes the summarized history might not be reliable, over-claiming some effects.
- For requests that are questions (or chat messages), remember to use the `CallUser` action to reply to user explicitly before finishing! Then, after you have replied, use the Finished action if the goal is achieved.
- Consider exploring the screen by using the `scroll` action with different directions to reveal additional content.
- To copy some text: first select the exact text you want to copy, which usually also brings up the text selection bar, then click the `copy` button in bar.
- To paste text into a text box, first long press the text box, then usually the text selection bar will appear with a `paste` button in it.
- You first thinks about the reasoning process in the mind, then provide the action. The reasoning and action are enclosed in <think></think> and <action></action> tags respectively. After providing action, summarize your action in <conclusion></conclusion> tags
"""

VENUS_WEB_PROMPT = """
**You are a GUI Agent.**
Your task is to analyze a given user task, review current screenshot and previous actions, and determine the next action to complete the task.

### Available Actions
You may execute one of the following functions:
- Click(box=(x1,y1))
- Drag(start=(x1,y1), end=(x2,y2))
- Scroll(direction='down or up')
- Type(content='')
- Launch(app='' or url='')
- Wait()
- Finished(content='')
- CallUser(content='')
- LongPress(box=(x1,y1))
- PressBack()
- PressHome()
- PressEnter()
- PressRecent()
- Hover(box=(x1,y1))
- DoubleClick(box=(x1,y1))
- Hotkey(keys=['ctrl', 'c']) # Split keys with comma and wrap each key in single quotes. Do not use more than 3 keys in one Hotkey action.

### User Task
{user_task}

### Previous Actions
{previous_actions}

### Output Format
<think> your thinking process </think>
<action> the next action </action>
<conclusion> the conclusion about the next action </conclusion>

### Instruction
- Make sure you understand the task goal to avoid wrong actions.
- Make sure you carefully examine the the current screenshot. Sometimes the summarized history might not be reliable, over-claiming some effects.
- For complex information-retrieval tasks, use `CallUser(content='...')` to reply only at the very end, after gathering all required info. Combine web evidence with your reasoning.
- To input text: first `Click(box=...)` on the textbox, then `Type(content='...')`. The system automatically presses `ENTER` afterward. If search filters are needed, click the search button after typing.
- Try to use simple language when searching.
- Distinguish textbox from button: never `Type` into a button. If no textbox is visible, try clicking the search icon first \u2014 the input field may appear afterward.
- Execute only one action per step.
- Strictly avoid repeating the same action when the webpage remains unchanged \u2014 you may have executed the wrong action. Continuous use of `Wait()` is also NOT allowed.
"""
VENUS_NAVIGATION_SYSTEM = "You are a helpful assistant."
VENUS_HISTORY_LENGTH = 5
# What UI-Venus' navigation runner samples with (greedy, repetition penalty 1.05) and its pixel budget.
VENUS_NAVIGATION_SAMPLING = dict(temperature=0.0, repetition_penalty=1.05, max_tokens=2048,
                                 min_pixels=3136, max_pixels=12845056)

# Qwen3-VL's own referring grounding (the technical report's prompt): a bbox_2d JSON answer.
QWEN_GROUNDING_PROMPT = ('Locate every object that matches the description "{}" in the image. '
                         "Report bbox coordinates in JSON format.")

# Qwen3-VL computer use (cookbooks/computer_use.ipynb): qwen-agent's Nous function-calling system
# prompt around the cookbook's `computer_use` tool, declared on a 1000x1000 screen so that the
# model's coordinates are the relative ones; the user turn is the screenshot, then the query.
_COMPUTER_USE_DESCRIPTION = """Use a mouse and keyboard to interact with a computer, and take screenshots.
* This is an interface to a desktop GUI. You do not have access to a terminal or applications menu. You must click on desktop icons to start applications.
* Some applications may take time to start or process actions, so you may need to wait and take successive screenshots to see the results of your actions. E.g. if you click on Firefox and a window doesn't open, try wait and taking another screenshot.
* The screen's resolution is {width}x{height}.
* Whenever you intend to move the cursor to click on an element like an icon, you should consult a screenshot to determine the coordinates of the element before moving the cursor.
* If you tried clicking on a program or link but it failed to load, even after waiting, try adjusting your cursor position so that the tip of the cursor visually falls on the element that you want to click.
* Make sure to click any buttons, links, icons, etc with the cursor tip in the center of the element. Don't click boxes on their edges."""
_COMPUTER_USE_ACTIONS = """The action to perform. The available actions are:
* `key`: Performs key down presses on the arguments passed in order, then performs key releases in reverse order.
* `type`: Type a string of text on the keyboard.
* `mouse_move`: Move the cursor to a specified (x, y) pixel coordinate on the screen.
* `left_click`: Click the left mouse button at a specified (x, y) pixel coordinate on the screen.
* `left_click_drag`: Click and drag the cursor to a specified (x, y) pixel coordinate on the screen.
* `right_click`: Click the right mouse button at a specified (x, y) pixel coordinate on the screen.
* `middle_click`: Click the middle mouse button at a specified (x, y) pixel coordinate on the screen.
* `double_click`: Double-click the left mouse button at a specified (x, y) pixel coordinate on the screen.
* `triple_click`: Triple-click the left mouse button at a specified (x, y) pixel coordinate on the screen (simulated as double-click since it's the closest action).
* `scroll`: Performs a scroll of the mouse scroll wheel.
* `hscroll`: Performs a horizontal scroll (mapped to regular scroll).
* `wait`: Wait specified seconds for the change to happen.
* `terminate`: Terminate the current task and report its completion status.
* `answer`: Answer a question."""
COMPUTER_USE_ACTIONS = ["key", "type", "mouse_move", "left_click", "left_click_drag", "right_click",
                        "middle_click", "double_click", "triple_click", "scroll", "hscroll", "wait",
                        "terminate", "answer"]
_FN_CALL_TEMPLATE = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tool_descs}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def computer_use_tool(width=SCALE, height=SCALE) -> dict:
    """The cookbook's `computer_use` function declaration (qwen-agent's field order)."""
    parameters = {
        "properties": {
            "action": {"description": _COMPUTER_USE_ACTIONS, "enum": COMPUTER_USE_ACTIONS, "type": "string"},
            "keys": {"description": "Required only by `action=key`.", "type": "array"},
            "text": {"description": "Required only by `action=type` and `action=answer`.", "type": "string"},
            "coordinate": {"description": "(x, y): The x (pixels from the left edge) and y (pixels from the top "
                                          "edge) coordinates to move the mouse to.", "type": "array"},
            "pixels": {"description": "The amount of scrolling to perform. Positive values scroll up, negative "
                                      "values scroll down. Required only by `action=scroll` and `action=hscroll`.",
                       "type": "number"},
            "time": {"description": "The seconds to wait. Required only by `action=wait`.", "type": "number"},
            "status": {"description": "The status of the task. Required only by `action=terminate`.",
                       "type": "string", "enum": ["success", "failure"]},
        },
        "required": ["action"],
        "type": "object",
    }
    return {"name_for_human": "computer_use", "name": "computer_use",
            "description": _COMPUTER_USE_DESCRIPTION.format(width=width, height=height),
            "parameters": parameters, "args_format": "Format the arguments as a JSON object."}


def computer_use_system_prompt(system="You are a helpful assistant.") -> str:
    """The system turn of Qwen3-VL's computer-use cookbook: `system`, then the tool block."""
    tool = json.dumps({"type": "function", "function": computer_use_tool()}, ensure_ascii=False)
    return system + "\n\n" + _FN_CALL_TEMPLATE.format(tool_descs=tool)


def _image_block(image):
    return {"type": "image", "image": image}


GROUNDING_FORMATS = ("venus", "qwen", "computer_use")


def grounding_prompt(instruction: str, format: str = "venus", allow_refusal: bool = True) -> str:
    """The user text that asks for `instruction`'s location, in the model's trained wording."""
    if format == "venus":
        # UI-Venus drops one trailing period: the template adds its own.
        text = VENUS_GROUNDING_PROMPT.format(instruction[:-1] if instruction.endswith(".") else instruction)
        return text + VENUS_REFUSAL_CLAUSE if allow_refusal else text
    if format == "qwen":
        return QWEN_GROUNDING_PROMPT.format(instruction)
    if format == "computer_use":
        return instruction
    raise InputError(f"unknown grounding format {format!r}; use {', '.join(GROUNDING_FORMATS)}")


def grounding_messages(image, instruction: str, format: str = "venus", allow_refusal: bool = True) -> list:
    """Chat messages for one grounding query: the screenshot first, then the prompt (all three
    formats put the image first); computer_use adds its tool-declaring system turn."""
    messages = [{"role": "system", "content": computer_use_system_prompt()}] if format == "computer_use" else []
    content = [_image_block(image), {"type": "text", "text": grounding_prompt(instruction, format, allow_refusal)}]
    return messages + [{"role": "user", "content": content}]


@dataclass
class Step:
    """One earlier navigation step, as UI-Venus feeds it back: its thinking and its action text."""

    think: str
    action: str


def navigation_prompt(task: str, history: Sequence = (), kind: str = "mobile",
                      history_length: int = VENUS_HISTORY_LENGTH) -> str:
    """UI-Venus-1.5's navigation prompt for `task`, with the last `history_length` steps (Step
    objects, Actions from parse_action, or (think, action) pairs), numbered from 0 in the window."""
    template = {"mobile": VENUS_MOBILE_PROMPT, "web": VENUS_WEB_PROMPT}.get(kind)
    if template is None:
        raise InputError(f"unknown navigation prompt kind {kind!r}; use mobile or web")
    recent = list(history)[-history_length:] if history_length > 0 else []
    lines = []
    for i, step in enumerate(recent):
        think, action = (step.think, step.action_text) if isinstance(step, Action) else (
            (step.think, step.action) if isinstance(step, Step) else step)
        lines.append(f"Step {i}: <think>{think or ''}</think><action>{action}</action>")
    return template.format(user_task=task, previous_actions="\n".join(lines))


def navigation_messages(image, task: str, history: Sequence = (), kind: str = "mobile",
                        history_length: int = VENUS_HISTORY_LENGTH) -> list:
    """One UI-Venus-1.5 navigation step: system line, then the prompt text and the screenshot."""
    return [{"role": "system", "content": VENUS_NAVIGATION_SYSTEM},
            {"role": "user", "content": [{"type": "text", "text": navigation_prompt(task, history, kind, history_length)},
                                         _image_block(image)]}]


def computer_use_messages(image, query: str) -> list:
    """One Qwen3-VL computer-use turn: the tool system prompt, then the screenshot and the query."""
    return grounding_messages(image, query, "computer_use")

