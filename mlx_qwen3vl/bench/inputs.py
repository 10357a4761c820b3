"""The benchmark's inputs: a synthetic screenshot of any size (a settings window drawn with
Pillow, so nothing is shipped or downloaded and every machine gets the same pixels), a text
prompt of a chosen token count, and the agent loop's turns."""

from functools import lru_cache

import numpy as np

PROMPT = "Describe this screenshot: where are the buttons and what do they do?"
AGENT_SYSTEM = "You are a GUI agent. Answer with the next action."
AGENT_ASKS = ["Open the display settings.", "Lower the brightness.", "Click Apply.", "Close the dialog.",
              "Open the search box and type 'network'."]

_WORDS = ("The quick brown fox jumps over the lazy dog while the agent opens the settings menu, "
          "finds the display panel and lowers the brightness before saving. ").split()
_MENU = ["General", "Display", "Network", "Sound", "Privacy", "Updates", "Accounts", "About"]
_ROWS = ["Brightness", "Night shift", "Resolution", "Refresh rate", "Scale", "True tone", "HDR"]


@lru_cache(maxsize=8)
def _font(size):
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)  # Pillow >= 10.1 with FreeType
    except (TypeError, OSError, ImportError):
        return ImageFont.load_default()


def draw_dialog(image, variant):
    """A dialog window moved and retitled by `variant`: a different screen each agent turn."""
    from PIL import ImageDraw

    w, h = image.size
    d = ImageDraw.Draw(image)
    bw, bh = max(w // 5, 40), max(h // 4, 30)
    x, y = (97 * variant) % max(w - bw, 1), (61 * variant) % max(h - bh, 1)
    d.rectangle([x, y, x + bw, y + bh], fill=(40 * variant % 255, 120, 200), outline=(0, 0, 0))
    d.text((x + bw // 20 + 2, y + bh // 10 + 2), f"Step {variant}: dialog", fill=(255, 255, 255),
           font=_font(max(h // 60, 8)))
    return image


def screenshot(width, height, variant=0):
    """An RGB uint8 (height, width, 3) desktop screenshot: title bar, sidebar menu, a search box, a
    settings pane of labelled controls, Cancel / Apply buttons; `variant` > 0 adds a dialog and
    moves the selection, so each agent turn sends new pixels of the same size."""
    from PIL import Image, ImageDraw

    w, h = int(width), int(height)
    im = Image.new("RGB", (w, h), (236, 238, 242))
    d = ImageDraw.Draw(im)
    unit = max(h // 40, 4)  # one line of UI
    font, big = _font(max(unit * 2 // 3, 8)), _font(max(unit, 9))
    bar = unit * 2
    d.rectangle([0, 0, w, bar], fill=(48, 52, 60))
    for i, colour in enumerate([(237, 106, 94), (245, 191, 79), (98, 197, 84)]):
        cx = unit + i * unit * 3 // 2
        d.ellipse([cx - unit // 3, bar // 2 - unit // 3, cx + unit // 3, bar // 2 + unit // 3], fill=colour)
    d.text((w // 2 - 4 * unit, bar // 4), "Settings - Display", fill=(230, 230, 230), font=big)
    side = max(w // 5, 4 * unit)
    d.rectangle([0, bar, side, h], fill=(222, 225, 231))
    selected = 1 + variant % (len(_MENU) - 1)
    for i, item in enumerate(_MENU):
        y = bar + unit + i * unit * 2
        if i == selected:
            d.rounded_rectangle([unit // 2, y - unit // 3, side - unit // 2, y + unit + unit // 3], radius=unit // 3,
                                fill=(0, 110, 230))
        d.text((unit * 3 // 2, y), item, fill=(255, 255, 255) if i == selected else (30, 30, 30), font=font)
    d.rounded_rectangle([w - side - unit, bar + unit // 2, w - unit, bar + unit * 2], radius=unit // 2,
                        fill=(255, 255, 255), outline=(170, 170, 180))
    d.text((w - side, bar + unit * 3 // 4), "Search settings...", fill=(140, 140, 150), font=font)
    x0 = side + 2 * unit
    d.text((x0, bar + unit * 3), _MENU[selected], fill=(20, 20, 20), font=big)
    for i, label in enumerate(_ROWS):
        y = bar + unit * (6 + 3 * i)
        if y + 2 * unit > h - 4 * unit:
            break
        d.rounded_rectangle([x0, y - unit // 2, w - 2 * unit, y + unit * 2], radius=unit // 2, fill=(250, 250, 252))
        d.text((x0 + unit, y + unit // 3), label, fill=(40, 40, 40), font=font)
        cx = w - 2 * unit - side
        if i % 3 == 0:  # a slider
            d.line([cx, y + unit * 3 // 4, cx + side - 2 * unit, y + unit * 3 // 4], fill=(0, 110, 230), width=max(unit // 6, 1))
            k = cx + (side - 2 * unit) * ((i + variant) % 5 + 1) // 6
            d.ellipse([k - unit // 2, y + unit // 4, k + unit // 2, y + unit * 5 // 4], fill=(255, 255, 255),
                      outline=(120, 120, 130))
        elif i % 3 == 1:  # a toggle
            on = (i + variant) % 2 == 0
            d.rounded_rectangle([cx + side - 4 * unit, y, cx + side - 2 * unit, y + unit * 3 // 2], radius=unit // 2,
                                fill=(52, 199, 89) if on else (200, 200, 205))
        else:  # a drop-down
            d.rounded_rectangle([cx, y, cx + side - 2 * unit, y + unit * 3 // 2], radius=unit // 4,
                                fill=(255, 255, 255), outline=(170, 170, 180))
            d.text((cx + unit // 2, y + unit // 4), f"{1280 + 640 * i} x {720 + 360 * i}", fill=(40, 40, 40), font=font)
    for j, (label, fill, ink) in enumerate([("Apply changes", (0, 110, 230), (255, 255, 255)),
                                            ("Cancel", (255, 255, 255), (30, 30, 30))]):
        bx = w - (j + 1) * (side // 2 + 2 * unit) - unit
        d.rounded_rectangle([bx, h - 3 * unit, bx + side // 2 + unit, h - unit], radius=unit // 2, fill=fill,
                            outline=(120, 120, 130))
        d.text((bx + unit // 2, h - 5 * unit // 2), label, fill=ink, font=font)
    if variant:
        draw_dialog(im, variant)
    return np.asarray(im)


def _count(processor, text):
    messages = [{"role": "user", "content": [{"type": "text", "text": text}]}]
    return len(processor.tokenizer(processor.apply_chat_template(messages, add_generation_prompt=True))["input_ids"])


def text_prompt(processor, n_tokens):
    """A user message whose templated prompt is exactly `n_tokens` tokens (when reachable): the
    fewest words that reach it (found by bisection), then characters trimmed while over."""
    def text_of(k):
        return " ".join(_WORDS[i % len(_WORDS)] for i in range(k))

    lo, hi = 0, 1
    while _count(processor, text_of(hi)) < n_tokens:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # the count grows with the words: the first k that reaches n_tokens
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _count(processor, text_of(mid)) < n_tokens else (lo, mid)
    text = text_of(hi)
    while _count(processor, text) > n_tokens and len(text) > 1:
        text = text[:-1]
    return text


def text_messages(processor, n_tokens):
    return [{"role": "user", "content": [{"type": "text", "text": text_prompt(processor, n_tokens)}]}]


def screenshot_messages(width, height, prompt=PROMPT):
    return [{"role": "user", "content": [{"type": "image", "image": screenshot(width, height)},
                                         {"type": "text", "text": prompt}]}]


def agent_turns(turns, width=1280, height=720):
    """[(screenshot, instruction)] of the agent loop: a new screen each turn, the same for every engine."""
    return [(screenshot(width, height, variant=t + 1), AGENT_ASKS[t % len(AGENT_ASKS)]) for t in range(turns)]


TOOL_CALL = ('<tool_call>\n{{"name": "computer_use", "arguments": {{"action": "{action}", "coordinate": [{x}, {y}]}}}}'
             '\n</tool_call>')
TOOL_TURNS = [("left_click", 412, 88), ("type", 412, 88), ("left_click", 530, 212), ("scroll", 640, 400),
              ("left_click", 702, 356)]


def tool_history_messages(turns=4):
    """A text-only agent conversation as a UI agent resends it each turn: an instruction, then
    `turns` answers that are computer-use tool calls, each followed by "Continue" (the next answer
    repeats their JSON, which is what prompt lookup drafts from)."""
    messages = [{"role": "system", "content": "You are a GUI agent. Use the computer_use tool: one action per turn, as "
                 '<tool_call>{"name": "computer_use", "arguments": {...}}</tool_call>.'},
                {"role": "user", "content": "Find tomorrow's weather in Paris and open the hourly view."}]
    for t in range(turns):
        action, x, y = TOOL_TURNS[t % len(TOOL_TURNS)]
        messages.append({"role": "assistant", "content": f"I will {action.replace('_', ' ')} next.\n"
                         + TOOL_CALL.format(action=action, x=x, y=y)})
        messages.append({"role": "user", "content": "The screen changed. Continue."})
    return messages
