"""GUI-agent toolkit: prompts, answer parsers (every format, refusals, malformed answers), the
0-1000 → original-pixel mapping on odd and portrait sizes with pixel budgets set, the ground CLI
(JSON and annotated PNG), the grounding evaluation on a shipped JSONL with scripted answers
(accuracy, splits, negatives, --limit, resume), the agent-loop example, and end-to-end runs on
the tiny checkpoint."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mlx_qwen3vl import agent
from mlx_qwen3vl import eval_grounding
from mlx_qwen3vl import ground as ground_cli
from mlx_qwen3vl.agent import (Action, Step, computer_use_messages, computer_use_system_prompt, grounding_messages,
                               grounding_prompt, navigation_messages, navigation_prompt, parse_action,
                               parse_grounding, parse_point, to_pixel)

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
TINY = FIXTURES / "tiny-a"
DATA = FIXTURES / "grounding" / "screenspot_tiny.jsonl"
MEDIA = FIXTURES / "media"


# ---------------------------------------------------------------------------------------------
# Mapping: floor(v / 1000 * size), clamped to [0, size - 1]
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("v,size,expected", [
    (0, 123, 0), (1000, 123, 122), (500, 123, 61),  # 61.5 → 61
    (500, 77, 38), (999, 77, 76), (8, 123, 0),  # 0.984 → 0
    (9, 123, 1),  # 1.107 → 1
    (250, 260, 65), (1000, 1, 0), ("333.5", 90, 30),  # 30.015 → 30
])
def test_to_pixel_rule(v, size, expected):
    assert to_pixel(v, size) == expected


def test_to_pixel_is_exact_where_floats_are_not():
    # 0.29 * 1000 / 1000 * 100 = 28.999999999999996 in floats; the exact value is 29.
    assert to_pixel("290", 100) == 29 and to_pixel(290, 100) == 29
    assert to_pixel("0.29e3", 100) == 29


# Every answer format, on an odd landscape (123x77) and a portrait (90x260) screenshot.
FORMATS = [
    ("[500,500]", {(123, 77): (61, 38), (90, 260): (45, 130)}, None),
    ("(500, 500)", {(123, 77): (61, 38), (90, 260): (45, 130)}, None),
    ("[ 250 , 750 ]", {(123, 77): (30, 57), (90, 260): (22, 195)}, None),
    ("[120.5, 999.9]", {(123, 77): (14, 76), (90, 260): (10, 259)}, None),
    ("[100,200,300,400]", {(123, 77): (24, 23), (90, 260): (18, 78)}, {(123, 77): (12, 15, 36, 30), (90, 260): (9, 52, 27, 104)}),
    ("[300,400,100,200]", {(123, 77): (24, 23), (90, 260): (18, 78)}, {(123, 77): (12, 15, 36, 30), (90, 260): (9, 52, 27, 104)}),
    ("[100,200],[300,400]", {(123, 77): (24, 23), (90, 260): (18, 78)}, {(123, 77): (12, 15, 36, 30), (90, 260): (9, 52, 27, 104)}),
    ("(100, 200), (300, 400)", {(123, 77): (24, 23), (90, 260): (18, 78)}, {(123, 77): (12, 15, 36, 30), (90, 260): (9, 52, 27, 104)}),
    ('```json\n[\n\t{"bbox_2d": [100, 200, 300, 400], "label": "Apply"}\n]\n```', {(123, 77): (24, 23), (90, 260): (18, 78)},
     {(123, 77): (12, 15, 36, 30), (90, 260): (9, 52, 27, 104)}),
    ('[{"point_2d": [500, 500], "label": "point_1"}]', {(123, 77): (61, 38), (90, 260): (45, 130)}, None),
    ("<think>The button sits at [1, 1] in my notes</think><action>Click(box=(500, 500))</action><conclusion>ok</conclusion>",
     {(123, 77): (61, 38), (90, 260): (45, 130)}, None),
    ("Click(box=(500,500))", {(123, 77): (61, 38), (90, 260): (45, 130)}, None),
    ('<tool_call>\n{"name": "computer_use", "arguments": {"action": "left_click", "coordinate": [500, 500]}}\n</tool_call>',
     {(123, 77): (61, 38), (90, 260): (45, 130)}, None),
    ("[1000,1000]", {(123, 77): (122, 76), (90, 260): (89, 259)}, None),
    ("[0,0]", {(123, 77): (0, 0), (90, 260): (0, 0)}, None),
    # The reasoning is never read (a closed block, an open one, or one opened by the template).
    ("<think>not [10, 10]</think>[600, 400]", {(123, 77): (73, 30), (90, 260): (54, 104)}, None),
    ("<think>\nmaybe [10, 10]\n</think>\n\n[600, 400]", {(123, 77): (73, 30), (90, 260): (54, 104)}, None),
    ("first [10, 10]?</think>[600, 400]", {(123, 77): (73, 30), (90, 260): (54, 104)}, None),
    # A JSON string (a label) holds no coordinates.
    ('[{"label": "tab [2, 3]", "bbox_2d": [100, 200, 300, 400]}]', {(123, 77): (24, 23), (90, 260): (18, 78)},
     {(123, 77): (12, 15, 36, 30), (90, 260): (9, 52, 27, 104)}),
    ('{"label": "the [2, 3] tab", "point_2d": [500, 500]}', {(123, 77): (61, 38), (90, 260): (45, 130)}, None),
    ("<point>250, 750</point>", {(123, 77): (30, 57), (90, 260): (22, 195)}, None),
    ("<point>250 750</point>", {(123, 77): (30, 57), (90, 260): (22, 195)}, None),
]


@pytest.mark.parametrize("answer,points,boxes", FORMATS)
@pytest.mark.parametrize("size", [(123, 77), (90, 260)])
def test_answer_formats_map_to_original_pixels(answer, points, boxes, size):
    g = parse_grounding(answer, *size)
    assert g.status == "ok"
    assert g.point == points[size]
    assert g.box == (boxes[size] if boxes else None)
    assert parse_point(answer, *size) == points[size]


REFUSALS = [
    "[-1,-1]", "[-1, -1]", "(-1,-1)", "[]", "```json\n[]\n```",
    '<tool_call>\n{"name": "computer_use", "arguments": {"action": "terminate", "status": "failure"}}\n</tool_call>']


@pytest.mark.parametrize("answer", REFUSALS)
def test_refusals(answer):
    g = parse_grounding(answer, 123, 77)
    assert (g.point, g.box, g.status) == (None, None, "refused")
    assert parse_point(answer, 123, 77) is None


MALFORMED = [
    "", "   ", "I cannot find it.", "[1500, 20]", "[20, -5]", "[1,2,3]", "[12, abc]", "[0,0,1200,10]",
    '<tool_call>\n{"name": "computer_use", "arguments": {"action": "left_click", "coordinate": [5000, 1]}}',
    '<tool_call>\n{"name": "computer_use", "arguments": {"action": "left_click"',  # truncated
    '<tool_call>\n{"name": "computer_use", "arguments": {"action": "type", "text": "hi"}}\n</tool_call>',
    "<think>It is at [500, 500]</think>", "<think>It is at [500, 500]",  # reasoning alone: no answer
    '[{"label": "tab [2, 3]"}]',  # a string alone
    "[500,500]\n[-1,-1]", "[-1,-1]\n[500,500]", "[-1, -1] or (500, 500)",  # a point and a refusal: ambiguous
    None]


@pytest.mark.parametrize("answer", MALFORMED)
def test_malformed_answers(answer):
    g = parse_grounding(answer, 123, 77)
    assert (g.point, g.box, g.status) == (None, None, "malformed")
    assert parse_point(answer, 123, 77) is None


# ---------------------------------------------------------------------------------------------
# Actions
# ---------------------------------------------------------------------------------------------
W, H = 1280, 720  # [500, 250] → (640, 180); [1000, 1000] → (1279, 719)
ACTIONS = [
    ("Click(box=(500, 250))", "Click", {"box": (640, 180)}),
    ("click(box=(500,250))", "Click", {"box": (640, 180)}),
    ("DoubleClick(box=(500, 250))", "DoubleClick", {"box": (640, 180)}),
    ("LongPress(box=(500, 250))", "LongPress", {"box": (640, 180)}),
    ("Hover(box=(1000, 1000))", "Hover", {"box": (1279, 719)}),
    ("Click(point=(500, 250))", "Click", {"point": (640, 180)}),
    ("Drag(start=(0, 0), end=(500, 250))", "Drag", {"start": (0, 0), "end": (640, 180)}),
    ("Scroll(start=(500, 250), end=(500, 0), direction='up')", "Scroll",
     {"start": (640, 180), "end": (640, 0), "direction": "up"}),
    ("Scroll(direction='down')", "Scroll", {"direction": "down"}),
    ("Scroll(start=(), end=(), direction='left')", "Scroll", {"direction": "left"}),
    ("Swipe(start=(500, 250), end=(500, 0))", "Swipe", {"start": (640, 180), "end": (640, 0)}),
    ("Type(content='hello, world')", "Type", {"content": "hello, world"}),
    ("Type(content='it's (really) done')", "Type", {"content": "it's (really) done"}),
    ("Type(content='line1\\nline2')", "Type", {"content": "line1\nline2"}),
    ("Hotkey(keys=['ctrl', 'c'])", "Hotkey", {"keys": ["ctrl", "c"]}),
    ("Launch(app='Settings')", "Launch", {"app": "Settings"}),
    ("Launch(app='', url='https://example.com')", "Launch", {"app": "", "url": "https://example.com"}),
    ("Wait()", "Wait", {}),
    ("Finished(content='done')", "Finished", {"content": "done"}),
    ("Finished()", "Finished", {}),
    ("CallUser(content='Which account?')", "CallUser", {"content": "Which account?"}),
    ("Answer(content='42')", "Answer", {"content": "42"}),
    ("PressBack()", "PressBack", {}),
    ("PressHome()", "PressHome", {}),
    ("PressEnter()", "PressEnter", {}),
    ("PressRecent()", "PressRecent", {}),
]


@pytest.mark.parametrize("text,name,args", ACTIONS)
def test_venus_actions(text, name, args):
    a = parse_action(text, W, H)
    assert (a.name, a.args, a.tool) == (name, args, None)


def test_venus_answer_with_think_and_conclusion():
    text = ("<think>\nThe Apply button is bottom right.\n</think>\n<action>\nClick(box=(891, 924))\n</action>\n"
            "<conclusion>\nClick Apply.\n</conclusion>")
    a = parse_action(text, W, H)
    assert (a.name, a.args, a.point) == ("Click", {"box": (1140, 665)}, (1140, 665))
    assert (a.think, a.conclusion, a.action_text) == ("The Apply button is bottom right.", "Click Apply.",
                                                      "Click(box=(891, 924))")
    assert a.to_dict()["args"] == {"box": [1140, 665]}


TOOL = '<tool_call>\n{{"name": "{tool}", "arguments": {args}}}\n</tool_call>'
TOOL_ACTIONS = [
    ("computer_use", {"action": "left_click", "coordinate": [500, 250]}, "left_click", {"coordinate": (640, 180)}),
    ("computer_use", {"action": "double_click", "coordinate": [1000, 0]}, "double_click", {"coordinate": (1279, 0)}),
    ("computer_use", {"action": "left_click_drag", "coordinate": [500, 250]}, "left_click_drag", {"coordinate": (640, 180)}),
    ("computer_use", {"action": "type", "text": "hello"}, "type", {"text": "hello"}),
    ("computer_use", {"action": "key", "keys": ["ctrl", "s"]}, "key", {"keys": ["ctrl", "s"]}),
    ("computer_use", {"action": "scroll", "pixels": -300}, "scroll", {"pixels": -300}),
    ("computer_use", {"action": "wait", "time": 2}, "wait", {"time": 2}),
    ("computer_use", {"action": "terminate", "status": "success"}, "terminate", {"status": "success"}),
    ("computer_use", {"action": "answer", "text": "42"}, "answer", {"text": "42"}),
    ("mobile_use", {"action": "swipe", "coordinate": [500, 250], "coordinate2": [500, 0]}, "swipe",
     {"coordinate": (640, 180), "coordinate2": (640, 0)}),
]


@pytest.mark.parametrize("tool,args,name,expected", TOOL_ACTIONS)
def test_tool_call_actions(tool, args, name, expected):
    a = parse_action("I will act.\n" + TOOL.format(tool=tool, args=json.dumps(args)), W, H)
    assert (a.name, a.args, a.tool) == (name, expected, tool)


@pytest.mark.parametrize("text", [
    "", "Click the button", "Explode(box=(1, 2))", "Click(box=(2000, 5))", "Click(box=(5,))",
    "Drag(start=(0, 0), end=(500, -1))", "Click(box=__import__('os').system('true'))", "<action></action>",
    '<tool_call>\n{"name": "computer_use", "arguments": {"action": "left_click", "coordinate": [1, 2, 3]}}\n</tool_call>',
    '<tool_call>\n{"name": "computer_use", "arguments": {"coordinate": [1, 2]}}\n</tool_call>',
    "<tool_call>\nnot json\n</tool_call>", None])
def test_malformed_actions(text):
    assert parse_action(text, W, H) is None


# ---------------------------------------------------------------------------------------------
# Prompts, as trained
# ---------------------------------------------------------------------------------------------
def test_venus_grounding_prompt_text():
    expected = ("Output the center point of the position corresponding to the following instruction: \n"
                "Click the Apply button. \n\nThe output should just be the coordinates of a point, in the format [x,y].")
    refusal = (" Additionally, if the task is infeasible (e.g., the task is not related to the image), "
               "the output should be [-1,-1].")
    # UI-Venus strips one trailing period (the template supplies its own).
    assert grounding_prompt("Click the Apply button.", allow_refusal=False) == expected
    assert grounding_prompt("Click the Apply button", allow_refusal=False) == expected
    assert grounding_prompt("Click the Apply button.") == expected + refusal
    assert grounding_prompt("the Apply button", "qwen") == (
        'Locate every object that matches the description "the Apply button" in the image. '
        "Report bbox coordinates in JSON format.")
    with pytest.raises(ValueError):
        grounding_prompt("x", "ui-tars")


def test_grounding_messages_render_image_first():
    from mlx_qwen3vl.processor import Processor

    processor = Processor.from_pretrained(TINY)
    text = processor.apply_chat_template(grounding_messages("shot.png", "Click the Apply button."),
                                         add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
                    + grounding_prompt("Click the Apply button.") + "<|im_end|>\n<|im_start|>assistant\n")
    nav = processor.apply_chat_template(navigation_messages("shot.png", "Open Wi-Fi"), add_generation_prompt=True,
                                        tokenize=False)
    # Navigation: system line, then the prompt text, then the screenshot.
    assert nav.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n\n"
                          "**You are a GUI Agent.**  \nYour task is to analyze")
    assert nav.endswith("in <conclusion></conclusion> tags\n<|vision_start|><|image_pad|><|vision_end|>"
                        "<|im_end|>\n<|im_start|>assistant\n")
    cu = processor.apply_chat_template(computer_use_messages("shot.png", "Open Wi-Fi"), add_generation_prompt=True,
                                       tokenize=False)
    assert cu.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\n")
    assert cu.endswith("</tool_call><|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
                       "Open Wi-Fi<|im_end|>\n<|im_start|>assistant\n")


def test_navigation_prompt_keeps_last_five_steps():
    history = [Step(f"think {i}", f"Click(box=({i}, {i}))") for i in range(7)]
    text = navigation_prompt("Open Wi-Fi", history)
    assert "### User Task\nOpen Wi-Fi\n\n### Previous Actions\n" in text
    expected = "\n".join(f"Step {j}: <think>think {i}</think><action>Click(box=({i}, {i}))</action>"
                         for j, i in enumerate(range(2, 7)))
    assert f"### Previous Actions\n{expected}\n\n### Available Actions" in text
    assert "think 1" not in text
    # Parsed actions and (think, action) pairs work as history too; history_length=0 means none.
    a = parse_action("<think>t</think><action>PressBack()</action>", W, H)
    assert "Step 0: <think>t</think><action>PressBack()</action>\nStep 1: <think>u</think><action>Wait()</action>" \
        in navigation_prompt("x", [a, ("u", "Wait()")])
    assert "### Previous Actions\n\n\n" in navigation_prompt("x", history, history_length=0)
    web = navigation_prompt("x", kind="web")
    assert "- Hotkey(keys=['ctrl', 'c']) # Split keys with comma" in web and "Hover(box=(x1,y1))" in web
    with pytest.raises(ValueError):
        navigation_prompt("x", kind="tv")


def test_computer_use_system_prompt():
    text = computer_use_system_prompt()
    head = "You are a helpful assistant.\n\n# Tools\n\nYou may call one or more functions to assist with the user query."
    assert text.startswith(head)
    tool = json.loads(text.split("<tools>\n")[1].split("\n</tools>")[0])
    fn = tool["function"]
    assert tool["type"] == "function" and list(fn) == ["name_for_human", "name", "description", "parameters",
                                                       "args_format"]
    assert "* The screen's resolution is 1000x1000." in fn["description"]
    assert fn["parameters"]["properties"]["action"]["enum"] == agent.COMPUTER_USE_ACTIONS
    assert text.endswith('<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


# ---------------------------------------------------------------------------------------------
# ground(): end to end on the tiny checkpoint, pixel budgets set
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    from mlx_qwen3vl import load

    return load(TINY)


@pytest.mark.parametrize("image,budget", [("img_90x260.png", dict(min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 16)),
                                          ("img_123x77.png", dict(min_pixels=32 * 32 * 64, max_pixels=32 * 32 * 80))])
def test_ground_end_to_end_maps_to_original_size(tiny, image, budget):
    model, processor = tiny
    path = MEDIA / image
    width, height = Image.open(path).size
    # The budget really resizes the image the model sees ...
    grid = processor(text="<|vision_start|><|image_pad|><|vision_end|>", images=[str(path)], **budget)["image_grid_thw"]
    seen_h, seen_w = int(grid[0][1]) * 16, int(grid[0][2]) * 16
    assert (seen_w, seen_h) != (width, height)
    result = agent.ground(model, processor, str(path), "the top-left panel", max_tokens=6, **budget)
    # ... and the answer is still read in the original's pixels.
    assert (result.width, result.height) == (width, height)
    g = parse_grounding(result.answer, width, height)
    assert (result.point, result.box, result.status) == (g.point, g.box, g.status)
    assert result.generation_tokens >= 1 and result.prompt_tokens > 0
    d = result.to_dict()
    assert d["image_size"] == [width, height] and d["answer"] == result.answer


def test_navigate_step_on_the_tiny_checkpoint(tiny):
    model, processor = tiny
    history = [Step("look", "Click(box=(10, 10))")]
    answer, action = agent.navigate(model, processor, str(MEDIA / "img_90x260.png"), "Open Wi-Fi", history,
                                    max_tokens=4)
    assert isinstance(answer, str)
    assert action == parse_action(answer, 90, 260)


# ---------------------------------------------------------------------------------------------
# The ground CLI
# ---------------------------------------------------------------------------------------------
def _cli(main, argv, capsys, **kw):
    code = main(argv, **kw)
    out, err = capsys.readouterr()
    return code, out, err


def test_ground_cli_json_and_annotation(tmp_path, capsys):
    shot = tmp_path / "shot.png"
    Image.new("RGB", (123, 77), (40, 40, 40)).save(shot)
    out_png = tmp_path / "marked.png"
    code, out, err = _cli(ground_cli.main, ["--image", str(shot), "--instruction", "the OK label", "--format", "qwen",
                                            "--answer", '{"bbox_2d": [100, 200, 300, 400]}', "--annotate",
                                            str(out_png)], capsys)
    assert code == 0 and err == ""
    result = json.loads(out)
    assert result == {"instruction": "the OK label", "point": [24, 23], "box": [12, 15, 36, 30], "status": "ok",
                      "answer": '{"bbox_2d": [100, 200, 300, 400]}', "image_size": [123, 77], "format": "qwen",
                      "timing": {"seconds": 0.0, "prompt_tokens": 0, "generation_tokens": 0, "prompt_tps": 0.0,
                                 "generation_tps": 0.0}, "annotated": str(out_png)}
    before, after = np.asarray(Image.open(shot)), np.asarray(Image.open(out_png))
    assert after.shape == before.shape
    assert (after[23, 24] != before[23, 24]).any()  # the point
    assert (after[15, 12] != before[15, 12]).any()  # the box's corner
    assert (after[70, 110] == before[70, 110]).all()  # far from both: untouched


def test_ground_cli_takes_data_urls_without_subtype(tmp_path, capsys):
    import base64
    import io

    buf = io.BytesIO()
    Image.new("RGB", (90, 260), (9, 9, 9)).save(buf, format="PNG")
    for prefix in ("data:image;base64,", "data:image/png;base64,"):
        url = prefix + base64.b64encode(buf.getvalue()).decode()
        code, out, _ = _cli(ground_cli.main, ["--image", url, "--instruction", "x", "--answer", "[500,500]"], capsys)
        assert code == 0 and json.loads(out)["point"] == [45, 130] and json.loads(out)["image_size"] == [90, 260]


@pytest.mark.parametrize("answer, status", [("[-1,-1]", "refused"), ("I cannot find it.", "malformed"),
                                            ("<think>at [500, 500]</think>", "malformed")])
def test_ground_cli_answer_without_a_point_is_marked(tmp_path, capsys, answer, status):
    """A picture of an answer without a point never passes for the plain screenshot, and hides none
    of it: a red frame round the whole screenshot, and a red band below it that says no point was
    found (and why)."""
    shot = tmp_path / "shot.png"
    Image.new("RGB", (90, 260), (200, 200, 200)).save(shot)
    code, out, _ = _cli(ground_cli.main, ["--image", str(shot), "--instruction", "x", "--answer", answer,
                                          "--annotate", str(tmp_path / "a.png")], capsys)
    assert code == 0
    r = json.loads(out)
    assert (r["point"], r["box"], r["status"]) == (None, None, status)
    before, after = np.asarray(Image.open(shot)).astype(int), np.asarray(Image.open(tmp_path / "a.png")).astype(int)
    h, w = before.shape[:2]
    line = (after.shape[1] - w) // 2
    assert line >= 2 and after.shape[0] > h + 2 * line + 8
    assert (after[line:line + h, line:line + w] == before).all()  # every pixel of the screenshot, as it was
    red = lambda px: (px[..., 0] > 150) & (px[..., 1] < 60)  # noqa: E731
    assert red(after[:line]).all() and red(after[:, :line]).all() and red(after[:, -line:]).all()  # the frame
    band = after[h + 2 * line:]
    assert red(band).mean() > 0.5 and (band.min(-1) > 180).any()  # mostly red, with white text on it


@pytest.mark.parametrize("argv,needle", [
    (["--image", "missing.png", "--instruction", "x", "--answer", "[1,1]"], "missing.png"),
    (["--image", str(MEDIA / "img_123x77.png"), "--instruction", "x"], "--model"),
    (["--image", str(MEDIA / "img_123x77.png"), "--instruction", "x", "--answer", "[1,1]", "--annotate",
      "/nonexistent-dir/x.png"], "does not exist"),
    (["--image", str(MEDIA / "img_123x77.png"), "--instruction", "x", "--model", "/nonexistent/model"], "nonexistent"),
])
def test_ground_cli_errors(argv, needle, capsys):
    code, out, err = _cli(ground_cli.main, argv, capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: ") and needle in err


@pytest.mark.parametrize("flags,needle", [
    (["--max-pixels", "10"], "--max-pixels=10 is below 1024"),
    (["--min-pixels", "-1"], "--min-pixels=-1"),
    (["--max-tokens", "0"], "--max-tokens = 0"),
])
def test_grounding_clis_name_their_flags(flags, needle, capsys):
    """Both grounding CLIs refuse bad values before the model loads, named as the user typed them."""
    shot = ["--image", str(MEDIA / "img_123x77.png"), "--instruction", "x"]
    for main, argv in ((ground_cli.main, shot), (eval_grounding.main, ["--data", str(DATA)])):
        code, out, err = _cli(main, ["--model", str(TINY), *argv, *flags], capsys)
        assert code == 2 and out == "" and err.count("\n") == 1 and err.startswith("error: ") and needle in err, err
        assert "_pixels" not in err and "max_tokens" not in err


def test_ground_cli_never_overwrites_the_screenshot(tmp_path, capsys):
    shot = tmp_path / "shot.png"
    Image.new("RGB", (50, 40), (1, 2, 3)).save(shot)
    data = shot.read_bytes()
    code, _, err = _cli(ground_cli.main, ["--image", str(shot), "--instruction", "x", "--answer", "[500,500]",
                                          "--annotate", str(shot)], capsys)
    assert code == 2 and err.startswith("error: ") and shot.read_bytes() == data


def test_ground_cli_with_the_tiny_model(tmp_path, capsys):
    code, out, err = _cli(ground_cli.main, ["--model", str(TINY), "--image", str(MEDIA / "img_300x200.png"),
                                            "--instruction", "the search field", "--max-tokens", "4",
                                            "--annotate", str(tmp_path / "a.png")], capsys)
    assert code == 0
    r = json.loads(out)
    assert r["image_size"] == [300, 200] and r["format"] == "venus"
    assert r["status"] in ("ok", "refused", "malformed")
    assert r["point"] == (list(parse_point(r["answer"], 300, 200) or []) or None)
    drawn = Image.open(tmp_path / "a.png").size
    assert r["timing"]["generation_tokens"] >= 1 and (drawn == (300, 200)) == (r["point"] is not None), drawn


# ---------------------------------------------------------------------------------------------
# Evaluation on the shipped JSONL with a scripted model
# ---------------------------------------------------------------------------------------------
ANSWERS = {  # instruction → the scripted model's answer (see the JSONL for boxes and sizes)
    "the search field": "[200,200]",  # 300x200 → (60, 40), inside [30,20,90,60]: hit
    "the settings cog": "[100,100]",  # → (30, 20), outside [100,100,150,150]: miss
    "the top-left panel": "[0,0,500,500]",  # 90x260 → centre (22, 65), inside [0,0,45,130]: hit
    "the camera icon": "[-1,-1]",  # refused on a positive: miss
    "the close button": "the close button is at the top right",  # malformed: miss
    "the rocket launcher": "[-1,-1]",  # negative, refused: right
    "the unicorn badge": "[500,500]",  # negative, pointed: wrong
    "the OK label": "[500,500]",  # 123x77 → (61, 38): on the box's corner (borders count): hit
}
FULL_REPORT = {
    "samples": 8, "correct": 4, "accuracy": 0.5,
    "positive": {"samples": 6, "correct": 3, "accuracy": 0.5},
    "negative": {"samples": 2, "correct": 1, "accuracy": 0.5},
    "refused": 2, "malformed": 1,
    "by_type": {"icon": {"samples": 3, "correct": 0, "accuracy": 0.0},
                "text": {"samples": 3, "correct": 3, "accuracy": 1.0}},
    "by_platform": {"desktop": {"samples": 3, "correct": 2, "accuracy": 0.6667},
                    "mobile": {"samples": 2, "correct": 1, "accuracy": 0.5},
                    "web": {"samples": 3, "correct": 1, "accuracy": 0.3333}},
}


@pytest.mark.parametrize("answer,negative_right,positive_right", [
    ("[-1,-1]", True, False), ("[]", True, False), ("I see no such thing", False, False),
    ("[500,500]", False, True), ("[0,0]", False, False)])
def test_scoring_rules(answer, negative_right, positive_right):
    negative = {"index": 0, "id": 0, "instruction": "x", "type": None, "platform": None, "negative": True, "bbox": None}
    positive = dict(negative, negative=False, bbox=[50, 50, 60, 60])
    assert eval_grounding.score(negative, answer, 100, 100)["correct"] is negative_right
    assert eval_grounding.score(positive, answer, 100, 100)["correct"] is positive_right


class Scripted:
    """A model whose answers are known: records every batch it was asked."""

    def __init__(self, fail_after=None):
        self.batches, self.fail_after = [], fail_after

    def __call__(self, samples):
        if self.fail_after is not None and sum(map(len, self.batches)) >= self.fail_after:
            raise KeyboardInterrupt
        self.batches.append([s["instruction"] for s in samples])
        assert all(s["pixels"].ndim == 3 for s in samples)  # the loaded screenshot comes along
        return [ANSWERS[s["instruction"]] for s in samples]


def _eval(argv, capsys, predictor):
    code, out, err = _cli(eval_grounding.main, argv + ["--no-progress"], capsys, predictor=predictor)
    return code, (json.loads(out) if code == 0 else None), err


def _core(report):
    return {k: report[k] for k in FULL_REPORT}


def test_eval_scripted_report_and_results(tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    model = Scripted()
    code, report, _ = _eval(["--data", str(DATA), "--output", str(out), "--report", str(tmp_path / "rep.json")],
                            capsys, model)
    assert code == 0
    assert _core(report) == FULL_REPORT
    assert (report["evaluated_now"], report["resumed"], report["results"]) == (8, 0, str(out))
    assert report["samples_per_s"] > 0
    assert json.loads((tmp_path / "rep.json").read_text()) == report
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(8))
    assert [r["correct"] for r in rows] == [True, False, True, False, False, True, False, True]
    assert [r["point"] for r in rows] == [[60, 40], [30, 20], [22, 65], None, None, None, [150, 100], [61, 38]]
    assert [r["status"] for r in rows] == ["ok", "ok", "ok", "refused", "malformed", "refused", "ok", "ok"]
    assert rows[2]["image_size"] == [90, 260] and rows[0]["id"] == "web-text-hit"
    assert model.batches == [[i] for i in ANSWERS]  # batch size 1 by default with a given predictor


def test_eval_batches_give_the_same_report(tmp_path, capsys):
    model = Scripted()
    code, out, err = _cli(eval_grounding.main, ["--data", str(DATA), "--output", str(tmp_path / "r.jsonl"),
                                                "--batch-size", "3"], capsys, predictor=model)
    assert code == 0 and _core(json.loads(out)) == FULL_REPORT
    assert [len(b) for b in model.batches] == [3, 3, 2]
    assert "8/8" in err  # the progress bar, on stderr


def test_eval_limit_then_resume(tmp_path, capsys):
    out = str(tmp_path / "r.jsonl")
    first = Scripted()
    code, report, _ = _eval(["--data", str(DATA), "--output", out, "--limit", "3"], capsys, first)
    assert code == 0 and sum(map(len, first.batches)) == 3
    assert (report["samples"], report["correct"], report["accuracy"]) == (3, 2, 0.6667)
    assert report["by_type"] == {"icon": {"samples": 1, "correct": 0, "accuracy": 0.0},
                                 "text": {"samples": 2, "correct": 2, "accuracy": 1.0}}
    assert report["negative"] == {"samples": 0, "correct": 0, "accuracy": None}
    second = Scripted()
    code, report, err = _eval(["--data", str(DATA), "--output", out], capsys, second)
    assert code == 0 and "resuming" in err
    assert [b[0] for b in second.batches] == list(ANSWERS)[3:]  # only the rest were asked
    assert _core(report) == FULL_REPORT and (report["evaluated_now"], report["resumed"]) == (5, 3)
    # A smaller --limit over a finished file just reports on those records.
    third = Scripted()
    code, report, _ = _eval(["--data", str(DATA), "--output", out, "--limit", "2"], capsys, third)
    assert code == 0 and third.batches == [] and (report["samples"], report["correct"]) == (2, 1)


def test_eval_resumes_after_an_interruption(tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    code, _, err = _eval(["--data", str(DATA), "--output", str(out)], capsys, Scripted(fail_after=5))
    assert code == 130 and "resume" in err
    assert len(out.read_text().splitlines()) == 5
    with open(out, "a") as f:  # a write cut off mid-line
        f.write('{"index": 5, "instruc')
    rest = Scripted()
    code, report, _ = _eval(["--data", str(DATA), "--output", str(out)], capsys, rest)
    assert code == 0 and [b[0] for b in rest.batches] == list(ANSWERS)[5:]
    assert _core(report) == FULL_REPORT
    assert [json.loads(line)["index"] for line in out.read_text().splitlines()] == list(range(8))


def test_eval_refuses_results_of_other_data(tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    out.write_text(json.dumps({"index": 0, "instruction": "something else"}) + "\n")
    code, _, err = _eval(["--data", str(DATA), "--output", str(out)], capsys, Scripted())
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1
    assert out.read_text() == json.dumps({"index": 0, "instruction": "something else"}) + "\n"


def test_eval_refuses_another_datasets_results_at_the_same_index(tmp_path, capsys):
    """Data B lists the same instructions at the same indices as A but other boxes, or the same
    boxes on other images: A's results file is refused for B, never merged into B's report."""
    out = str(tmp_path / "a.results.jsonl")
    assert _eval(["--data", str(DATA), "--output", out], capsys, Scripted())[0] == 0
    before = open(out).read()
    records = [json.loads(line) for line in DATA.read_text().splitlines()]
    other_box = [dict(records[0], bbox=[0, 0, 10, 10])] + records[1:]
    other_image = [dict(r, image="../media/img_123x77.png") for r in records]
    (tmp_path / "grounding").mkdir()
    (tmp_path / "media").symlink_to(MEDIA)
    for name, rows in (("other_box", other_box), ("other_image", other_image)):
        data = tmp_path / "grounding" / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        code, _, err = _eval(["--data", str(data), "--output", out], capsys, Scripted())
        assert code == 2 and err.count("\n") == 1 and "line 1 is not a result for this --data" in err, (name, err)
    assert open(out).read() == before


def test_eval_resume_follows_the_model_not_its_spelling(tmp_path, capsys, monkeypatch):
    """The same checkpoint named by another relative path resumes the file; another setting is
    refused with that setting named."""
    data = _data_copy(tmp_path)
    monkeypatch.chdir(ROOT)
    first = Scripted()
    argv = ["--data", str(data), "--limit", "2"]
    code, _, err = _eval(argv + ["--model", "tests/fixtures/tiny-a"], capsys, first)
    assert code == 0 and sum(map(len, first.batches)) == 2
    monkeypatch.chdir(FIXTURES / "grounding")
    rest = Scripted()
    code, report, err = _eval(["--data", str(data), "--model", "../tiny-a"], capsys, rest)
    assert code == 0 and "resuming" in err and (report["evaluated_now"], report["resumed"]) == (6, 2)
    code, _, err = _eval(["--data", str(data), "--model", "../tiny-a", "--max-tokens", "64"], capsys, Scripted())
    assert code == 2 and "--max-tokens 128 (this run: 64)" in err, err


@pytest.mark.parametrize("lines,needle", [
    (['{"image": "a.png", "instruction": "x", "bbox": [0, 0, 1, 1]'], "line 1 is not valid JSON"),
    (['{"image": "../media/img_123x77.png", "instruction": "x"}'], "line 1 needs 'bbox'"),
    (['{"image": "../media/img_123x77.png", "instruction": "x", "bbox": [0, 0, 1, 1]}',
      '{"image": "nope.png", "instruction": "y", "bbox": [0, 0, 1, 1]}'], "line 2: image 'nope.png' not found"),
    (['{"instruction": "x", "bbox": [0, 0, 1, 1]}'], "line 1 needs string fields"),
    (['{"img_filename": "../media/img_123x77.png", "instruction": "x", "bbox": [0, 0, 1, 1]}', "[1, 2]"],
     "line 2 needs string fields"),  # ScreenSpot-Pro's img_filename is accepted; a non-object line is not
    ([], "has no records"),
])
def test_eval_bad_data(tmp_path, lines, needle, capsys):
    folder = tmp_path / "grounding"
    folder.mkdir()
    (tmp_path / "media").symlink_to(MEDIA)
    data = folder / "bad.jsonl"
    data.write_text("\n".join(lines) + "\n")
    code, _, err = _eval(["--data", str(data), "--output", str(tmp_path / "r.jsonl")], capsys, Scripted())
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and needle in err


def test_eval_bad_arguments(capsys):
    for argv in (["--limit", "0"], ["--batch-size", "0"], []):
        code, _, err = _eval(["--data", str(DATA)] + argv, capsys, None if not argv else Scripted())
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1


def _data_copy(tmp_path):
    """The shipped JSONL in a folder of its own (results are written beside it), media linked."""
    (tmp_path / "grounding").mkdir()
    (tmp_path / "media").symlink_to(MEDIA)
    data = tmp_path / "grounding" / DATA.name
    data.write_text(DATA.read_text())
    return data


def test_eval_end_to_end_on_the_tiny_checkpoint(tmp_path, capsys, monkeypatch):
    data = _data_copy(tmp_path)
    monkeypatch.chdir(tmp_path / "media")  # not where the results go
    base = ["--model", str(TINY), "--data", str(data), "--limit", "3", "--max-tokens", "4", "--no-progress"]
    code, out, err = _cli(eval_grounding.main, base + ["--batch-size", "2"], capsys)
    assert code == 0
    report = json.loads(out)
    assert report["samples"] == 3 and report["evaluated_now"] == 3
    default = tmp_path / "grounding" / "screenspot_tiny.tiny-a.venus.results.jsonl"  # beside the data, announced
    assert report["results"] == str(default) and err == f"results: {default} (--output to choose)\n"
    rows = [json.loads(line) for line in default.read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2]
    assert rows[0]["settings"]["model"] == str(TINY) and rows[0]["settings"]["max_tokens"] == 4
    for r in rows:  # whatever the random model said, it was scored by the same rule
        assert r["point"] == (list(parse_point(r["answer"], *r["image_size"]) or []) or None)
    assert report["correct"] == sum(r["correct"] for r in rows)
    # Batched answers (a 300x200 and a 300x200 image, then a 90x260 one) equal one-by-one answers.
    code, out, _ = _cli(eval_grounding.main, base + ["--batch-size", "1", "--output", str(tmp_path / "single.jsonl")],
                        capsys)
    assert code == 0
    single = [json.loads(line) for line in (tmp_path / "single.jsonl").read_text().splitlines()]
    assert [r["answer"] for r in single] == [r["answer"] for r in rows]
    # Resuming a file written with other settings is refused, not mixed, naming what differs.
    code, out, err = _cli(eval_grounding.main, base + ["--format", "qwen", "--output", str(default)], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert "other settings: --format 'venus' (this run: 'qwen')" in err


# ---------------------------------------------------------------------------------------------
# The agent-loop example
# ---------------------------------------------------------------------------------------------
def _example():
    spec = importlib.util.spec_from_file_location("agent_loop", ROOT / "examples" / "agent_loop.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def test_agent_loop_example_runs_on_the_tiny_checkpoint(tiny):
    example = _example()
    shots = [str(MEDIA / "img_300x200.png"), str(MEDIA / "img_90x260.png")]
    steps, session = example.run(*tiny, "Open the settings", shots, keep_images=1, max_tokens=3)
    assert [s["step"] for s in steps] == [0, 1]
    images = [b for m in session.messages if isinstance(m["content"], list) for b in m["content"] if b["type"] == "image"]
    assert len(images) == 1  # only the last screenshot is kept, as it was read
    assert np.array_equal(images[0]["image"], np.asarray(Image.open(shots[1]).convert("RGB")))
    assert steps[1]["cached_tokens"] > 0  # the second turn reused the first one's cache
    for s in steps:
        a = parse_action(s["answer"], *Image.open(s["screenshot"]).size)
        assert s["action"] == (a.to_dict() if a else None)


def test_agent_loop_example_runs_as_the_readme_says(tmp_path):
    """`python examples/agent_loop.py`, from another folder, with its defaults: the tiny checkpoint
    and three screenshots of examples/screenshot.png's size fit its 4096-token context."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, str(ROOT / "examples" / "agent_loop.py")], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["step 1", "step 2", "step 3"], p.stdout
    assert all("[0 prompt tokens reused]" not in line for line in lines[1:])  # later steps reuse the cache
    assert Image.open(ROOT / "examples" / "screenshot.png").size == (1280, 720)


@pytest.mark.parametrize("max_tokens", [4, 16, 64])
def test_agent_loop_example_s_own_budget_fits_any_max_tokens(tiny, max_tokens):
    """Without --max-pixels the example picks the screenshots' budget: it fits the context for any
    --max-tokens (a smaller one leaves more room for pixels; every answer here runs to max_tokens),
    with the kept screenshots counted as they are sent."""
    example = _example()
    model, processor = tiny  # the example's default checkpoint
    shots = [str(ROOT / "examples" / "screenshot.png")] * 3
    budget = example.fitting_max_pixels(model, processor, "Open the settings", 3, 2, max_tokens)
    steps, session = example.run(model, processor, "Open the settings", shots, 2, max_tokens, max_pixels=budget)
    assert len(steps) == 3 and session.last.generation_tokens <= max_tokens
    assert session.last.prompt_tokens + max_tokens <= model.config.text_config.max_position_embeddings


def test_agent_loop_example_context_overflow_is_one_line(capsys):
    """A budget too large for the context fails at the step that overflows, in one line naming the
    knobs to turn."""
    code = _example().main(["--max-pixels", str(1280 * 28 * 28)])
    out, err = capsys.readouterr()
    assert code == 2 and out.startswith("step 1:") and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: step 2: the conversation is ") and "context of 4096" in last
    assert "--max-pixels (now 1003520)" in last and "--keep-images (now 2)" in last
    assert "--max-tokens" not in last  # a smaller answer limit would not have made room


def test_action_to_dict_is_json_ready():
    a = Action("Drag", {"start": (1, 2), "end": (3, 4)}, think="t")
    assert json.loads(json.dumps(a.to_dict()))["args"] == {"start": [1, 2], "end": [3, 4]}


def test_the_grounding_commands_run_as_modules():
    """`python -m mlx_qwen3vl.ground` and `python -m mlx_qwen3vl.eval_grounding` (what the README
    and people's scripts say): the commands' one home each."""
    for module, prog in (("mlx_qwen3vl.ground", "ground"), ("mlx_qwen3vl.eval_grounding", "eval_grounding")):
        p = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
        assert p.returncode == 0, p.stderr
        assert "--instruction" in p.stdout if prog == "ground" else "--data" in p.stdout
