"""Computer-use tools (agent/computer_tools.py, agent/computer_use.py): the protocols' declarations,
every action of each model family's action space mapped to Anthropic and OpenAI calls on displays
that differ from the screenshot (1366x768 declared, an odd 999x577 screenshot where none is),
answers that map to nothing, earlier steps written back in the model's own syntax, and the prompt
for a declared tool equal to the trained one."""

import json

import pytest

from mlx_qwen3vl.agent import computer_use_messages, navigation_messages
from mlx_qwen3vl.agent.computer_tools import (ANTHROPIC_TOOLSET_MEMBERS, ComputerAction, computer_tool,
                                              find_computer_tool)
from mlx_qwen3vl.agent.computer_use import (QWEN_ACTIONS, VENUS_TABLE, ComputerStep, computer_messages,
                                            map_answer)
from mlx_qwen3vl.agent.prompts import COMPUTER_USE_ACTIONS
from mlx_qwen3vl.errors import InputError
from test_agent import FORMATS, MALFORMED, REFUSALS

SCREENSHOT = (1280, 720)  # what the model sees; the declared display is another size
ANTHROPIC = computer_tool({"type": "computer_20251124", "name": "computer", "display_width_px": 1366,
                           "display_height_px": 768, "enable_zoom": True})
PREVIEW = computer_tool({"type": "computer_use_preview", "display_width": 1366, "display_height": 768,
                         "environment": "linux"})
DISPLAY = ANTHROPIC.display_size(SCREENSHOT)
# 0-1000 → 1366 x 768: 500 → 683, 300 → 230 (230.4), 250 → 341 (341.5), 750 → 576, 1000 → 1365 / 767
P, Q, END = (683, 230), (341, 576), (1365, 767)
CENTRE = (683, 384)


def A(kind, **kw):
    return ComputerAction(kind, **kw)


def qwen(action, **args):
    return ('<tool_call>\n' + json.dumps({"name": "computer_use", "arguments": {"action": action, **args}})
            + '\n</tool_call>')


def anth(action, **fields):
    return {"name": "computer", "input": {"action": action, **fields}}


UNMAPPED = "unmapped"
# (answer, neutral actions or (status, text), Anthropic calls, OpenAI calls or UNMAPPED)
QWEN_CASES = [
    (qwen("key", keys=["ctrl", "shift", "esc"]), [A("key", keys=("ctrl", "shift", "esc"))],
     [anth("key", text="ctrl+shift+Escape")], [{"type": "keypress", "keys": ["ctrl", "shift", "esc"]}]),
    (qwen("type", text="hello"), [A("type", text="hello")], [anth("type", text="hello")],
     [{"type": "type", "text": "hello"}]),
    (qwen("mouse_move", coordinate=[250, 750]), [A("mouse_move", point=Q)], [anth("mouse_move", coordinate=list(Q))],
     [{"type": "move", "x": 341, "y": 576}]),
    (qwen("left_click", coordinate=[500, 300]), [A("click", point=P)], [anth("left_click", coordinate=list(P))],
     [{"type": "click", "button": "left", "x": 683, "y": 230}]),
    # A drag from the pointer, whose position is not known here: pressed, moved, released.
    (qwen("left_click_drag", coordinate=[250, 750]), [A("mouse_down"), A("mouse_move", point=Q), A("mouse_up")],
     [anth("left_mouse_down"), anth("mouse_move", coordinate=list(Q)), anth("left_mouse_up")], UNMAPPED),
    (qwen("right_click", coordinate=[500, 300]), [A("click", point=P, button="right")],
     [anth("right_click", coordinate=list(P))], [{"type": "click", "button": "right", "x": 683, "y": 230}]),
    (qwen("middle_click", coordinate=[500, 300]), [A("click", point=P, button="middle")],
     [anth("middle_click", coordinate=list(P))], [{"type": "click", "button": "wheel", "x": 683, "y": 230}]),
    (qwen("double_click", coordinate=[1000, 1000]), [A("double_click", point=END)],
     [anth("double_click", coordinate=list(END))], [{"type": "double_click", "x": 1365, "y": 767}]),
    # Qwen's prompt: "triple_click ... (simulated as double-click since it's the closest action)"
    (qwen("triple_click", coordinate=[500, 300]), [A("triple_click", point=P)],
     [anth("triple_click", coordinate=list(P))], [{"type": "double_click", "x": 683, "y": 230}]),
    (qwen("scroll", pixels=-5), [A("scroll", direction="down", amount=5)],
     [anth("scroll", scroll_direction="down", scroll_amount=5)],
     [{"type": "scroll", "x": 683, "y": 384, "scroll_x": 0, "scroll_y": 500}]),  # no position: the centre
    (qwen("hscroll", pixels=3, coordinate=[1000, 1000]), [A("scroll", point=END, direction="right", amount=3)],
     [anth("scroll", coordinate=list(END), scroll_direction="right", scroll_amount=3)],
     [{"type": "scroll", "x": 1365, "y": 767, "scroll_x": 300, "scroll_y": 0}]),
    (qwen("wait", time=2), [A("wait", seconds=2.0)], [anth("wait", duration=2)], [{"type": "wait"}]),
    (qwen("terminate", status="success"), ("done", ""), [], []),
    (qwen("answer", text="It is 42."), ("message", "It is 42."), [], []),
]

VENUS_CASES = [
    ("Click(box=(500, 300))", [A("click", point=P)], [anth("left_click", coordinate=list(P))],
     [{"type": "click", "button": "left", "x": 683, "y": 230}]),
    ("DoubleClick(box=(500, 300))", [A("double_click", point=P)], [anth("double_click", coordinate=list(P))],
     [{"type": "double_click", "x": 683, "y": 230}]),
    ("TripleClick(box=(500, 300))", [A("triple_click", point=P)], [anth("triple_click", coordinate=list(P))],
     [{"type": "double_click", "x": 683, "y": 230}]),
    ("RightClick(box=(500, 300))", [A("click", point=P, button="right")], [anth("right_click", coordinate=list(P))],
     [{"type": "click", "button": "right", "x": 683, "y": 230}]),
    ("MiddleClick(box=(500, 300))", [A("click", point=P, button="middle")],
     [anth("middle_click", coordinate=list(P))], [{"type": "click", "button": "wheel", "x": 683, "y": 230}]),
    ("LongPress(box=(500, 300))", (UNMAPPED, "LongPress(box=(500, 300))"), [], UNMAPPED),
    ("Hover(box=(250, 750))", [A("mouse_move", point=Q)], [anth("mouse_move", coordinate=list(Q))],
     [{"type": "move", "x": 341, "y": 576}]),
    ("Drag(start=(500, 300), end=(250, 750))", [A("drag", point=P, end=Q)],
     [anth("left_click_drag", start_coordinate=list(P), coordinate=list(Q))],
     [{"type": "drag", "path": [{"x": 683, "y": 230}, {"x": 341, "y": 576}]}]),
    ("Scroll(direction='down')", [A("scroll", direction="down", amount=5)],
     [anth("scroll", scroll_direction="down", scroll_amount=5)],
     [{"type": "scroll", "x": 683, "y": 384, "scroll_x": 0, "scroll_y": 500}]),
    # The mobile form: a swipe from start to end; the content moves against the finger.
    ("Scroll(start=(500, 300), end=(500, 100))", [A("scroll", point=P, direction="down", amount=5)],
     [anth("scroll", coordinate=list(P), scroll_direction="down", scroll_amount=5)],
     [{"type": "scroll", "x": 683, "y": 230, "scroll_x": 0, "scroll_y": 500}]),
    ("Swipe(start=(500, 300), end=(900, 300))", [A("scroll", point=P, direction="left", amount=5)],
     [anth("scroll", coordinate=list(P), scroll_direction="left", scroll_amount=5)],
     [{"type": "scroll", "x": 683, "y": 230, "scroll_x": -500, "scroll_y": 0}]),
    ("Type(content='it\\'s here')", [A("type", text="it's here")], [anth("type", text="it's here")],
     [{"type": "type", "text": "it's here"}]),
    ("Hotkey(keys=['ctrl', 'c'])", [A("key", keys=("ctrl", "c"))], [anth("key", text="ctrl+c")],
     [{"type": "keypress", "keys": ["ctrl", "c"]}]),
    ("Launch(app='Settings')", (UNMAPPED, "Launch(app='Settings')"), [], UNMAPPED),
    ("LaunchApp(app='Mail')", (UNMAPPED, "LaunchApp(app='Mail')"), [], UNMAPPED),
    ("Wait()", [A("wait", seconds=1.0)], [anth("wait", duration=1)], [{"type": "wait"}]),
    ("Finished(content='All set.')", ("done", "All set."), [], []),
    ("CallUser(content='Which account?')", ("message", "Which account?"), [], []),
    ("Answer(content='42')", ("message", "42"), [], []),
    ("PressBack()", (UNMAPPED, "PressBack()"), [], UNMAPPED),
    ("PressHome()", (UNMAPPED, "PressHome()"), [], UNMAPPED),
    ("PressEnter()", [A("key", keys=("enter",))], [anth("key", text="Return")],
     [{"type": "keypress", "keys": ["enter"]}]),
    ("PressRecent()", (UNMAPPED, "PressRecent()"), [], UNMAPPED),
    ("GetScreenshot()", [A("screenshot")], [anth("screenshot")], [{"type": "screenshot"}]),
    ("KeyDown(key='shift')", (UNMAPPED, "KeyDown(key='shift')"), [], UNMAPPED),
    ("KeyUp(key='shift')", (UNMAPPED, "KeyUp(key='shift')"), [], UNMAPPED),
    ("MouseDown(box=(500, 300))", [A("mouse_move", point=P), A("mouse_down")],
     [anth("mouse_move", coordinate=list(P)), anth("left_mouse_down")], UNMAPPED),
    ("MouseUp()", [A("mouse_up")], [anth("left_mouse_up")], UNMAPPED),
]


def test_the_tables_cover_each_family_s_whole_action_space():
    assert set(QWEN_ACTIONS) == set(COMPUTER_USE_ACTIONS)
    assert {json.loads(a.split("\n")[1])["arguments"]["action"] for a, *_ in QWEN_CASES} == set(COMPUTER_USE_ACTIONS)
    assert {a.split("(")[0] for a, *_ in VENUS_CASES} == set(VENUS_TABLE)


@pytest.mark.parametrize("answer, neutral, anthropic, openai", QWEN_CASES + VENUS_CASES,
                         ids=[c[0][:40] for c in QWEN_CASES + VENUS_CASES])
def test_every_action_on_both_protocols(answer, neutral, anthropic, openai):
    for tool, calls in ((ANTHROPIC, anthropic), (PREVIEW, openai), (None, None)):
        turn = map_answer(answer, DISPLAY, tool=tool)
        if isinstance(neutral, tuple):  # no action: a message, the end of the task, or text
            status, text = neutral
            assert (turn.status, turn.text, turn.actions, turn.calls) == (status, text, [], [])
            if status == UNMAPPED:
                assert turn.reason
            continue
        if calls == UNMAPPED:  # the model's action has no form in this protocol: the answer as text
            assert (turn.status, turn.text, turn.actions, turn.calls) == (UNMAPPED, answer, [], [])
            assert "does not offer" in turn.reason
            continue
        assert (turn.status, turn.actions) == ("action", neutral)
        assert turn.calls == (calls or [])


def test_toolset_and_computer_coordinates_are_the_screenshot_s():
    shot = (999, 577)  # no declared display: pixels of the last screenshot
    toolset = computer_tool({"type": "computer_toolset_20260801", "configs": {"triple_click": {"enabled": False},
                                                                             "zoom": None}})
    computer = computer_tool({"type": "computer"})
    assert toolset.display_size(shot) == computer.display_size(shot) == shot
    click = qwen("left_click", coordinate=[500, 300])  # 499.5 → 499, 173.1 → 173
    assert map_answer(click, shot, tool=toolset).calls == [
        {"name": "left_click", "toolset_name": "computer", "input": {"coordinate": [499, 173]}}]
    assert map_answer(qwen("scroll", pixels=2), shot, tool=toolset).calls == [
        {"name": "scroll", "toolset_name": "computer", "input": {"scroll_direction": "up", "scroll_amount": 2}}]
    assert map_answer(qwen("wait", time=0.5), shot, tool=toolset).calls == [
        {"name": "wait", "toolset_name": "computer", "input": {"duration": 1}}]  # whole seconds, rounded up
    assert map_answer(click, shot, tool=computer).calls == [{"type": "click", "button": "left", "x": 499, "y": 173}]
    assert computer.batched and not PREVIEW.batched
    # A member the toolset withholds is not offered: the answer comes back as text.
    turn = map_answer(qwen("triple_click", coordinate=[500, 300]), shot, tool=toolset)
    assert (turn.status, turn.calls) == ("unmapped", []) and "triple_click" in turn.reason
    assert "zoom" in toolset.actions and "triple_click" not in toolset.actions


def test_one_answer_several_calls_text_reasoning_and_the_cursor():
    answer = ("<think>The field is on top.</think>I will fill it in.\n" + qwen("left_click", coordinate=[500, 300])
              + "\n" + qwen("type", text="mlx"))
    turn = map_answer(answer, DISPLAY, tool=ANTHROPIC)
    assert (turn.status, turn.text, turn.reasoning) == ("action", "I will fill it in.", "The field is on top.")
    assert turn.calls == [anth("left_click", coordinate=list(P)), anth("type", text="mlx")]
    # A drag starts where the pointer is: the earlier move in the same answer, or the given cursor.
    turn = map_answer(qwen("mouse_move", coordinate=[500, 300]) + qwen("left_click_drag", coordinate=[250, 750]),
                      DISPLAY, tool=PREVIEW)
    assert turn.calls[1] == {"type": "drag", "path": [{"x": 683, "y": 230}, {"x": 341, "y": 576}]}
    turn = map_answer(qwen("left_click_drag", coordinate=[250, 750]), DISPLAY, tool=PREVIEW, cursor=(10, 20))
    assert turn.actions == [A("drag", point=(10, 20), end=Q)]
    # An OpenAI scroll without a position acts at the pointer when it is known.
    assert map_answer(qwen("scroll", pixels=1), DISPLAY, tool=PREVIEW, cursor=(5, 6)).calls == [
        {"type": "scroll", "x": 5, "y": 6, "scroll_x": 0, "scroll_y": -100}]
    # UI-Venus: <think> is the reasoning, <conclusion> the text; a template-opened think too.
    turn = map_answer("<think>\nIt is the gear.\n</think>\n<action>Click(box=(500, 300))</action>\n"
                      "<conclusion>Open the settings.</conclusion>", DISPLAY, tool=ANTHROPIC)
    assert (turn.reasoning, turn.text, turn.calls) == ("It is the gear.", "Open the settings.",
                                                      [anth("left_click", coordinate=list(P))])
    assert map_answer("the gear</think>Click(box=(500, 300))", DISPLAY).reasoning == "the gear"
    turn = map_answer("Done.\n" + qwen("terminate", status="failure"), DISPLAY, tool=ANTHROPIC)
    assert (turn.status, turn.outcome, turn.text) == ("done", "failure", "Done.")


@pytest.mark.parametrize("answer, status", [
    ("I cannot see a settings button.", "message"),
    ("", "message"),
    ("Explode(box=(1, 2))", "message"),  # not an action of either family: plain text
    ("<action>Click(box=(2000, 5))</action>", UNMAPPED),  # outside 0-1000: never clamped into a click
    ("Click(box=(5,))", UNMAPPED),
    (qwen("zoom", region=[0, 0, 10, 10]), UNMAPPED),  # not in Qwen's action space
    (qwen("left_click", coordinate=[1, 2, 3]), UNMAPPED),
    (qwen("mouse_move"), UNMAPPED),
    (qwen("scroll"), UNMAPPED),
    (qwen("key", keys=[]), UNMAPPED),
    ('<tool_call>\n{"name": "mobile_use", "arguments": {"action": "click", "coordinate": [1, 2]}}\n</tool_call>',
     UNMAPPED),
    ("<tool_call>\nnot json\n</tool_call>", UNMAPPED),
    # one unmappable call spoils the turn: never half of it
    (qwen("left_click", coordinate=[500, 300]) + qwen("hscroll", pixels=0), UNMAPPED),
    ("<action>Scroll(direction='sideways')</action>", UNMAPPED),
])
def test_answers_that_map_to_nothing_come_back_as_text(answer, status):
    for tool in (ANTHROPIC, PREVIEW, None):
        turn = map_answer(answer, DISPLAY, tool=tool)
        assert (turn.status, turn.actions, turn.calls, turn.text) == (status, [], [], answer.strip())
        assert (turn.reason is not None) == (status == UNMAPPED)


# One parser: every answer shape grounding reads (test_agent's FORMATS, refusals, malformed
# answers) means the same through computer use: a click at the grounding point, on both protocols.
@pytest.mark.parametrize("answer, points, boxes", FORMATS)
@pytest.mark.parametrize("size", [(123, 77), (90, 260)])
def test_every_grounding_shape_is_a_click_at_its_point(answer, points, boxes, size):
    x, y = points[size]
    for tool, call in ((None, None), (computer_tool({"type": "computer_toolset_20260801"}),
                                      {"name": "left_click", "toolset_name": "computer", "input": {"coordinate": [x, y]}}),
                       (computer_tool({"type": "computer"}), {"type": "click", "button": "left", "x": x, "y": y})):
        turn = map_answer(answer, size, tool=tool)
        assert (turn.status, turn.actions) == ("action", [A("click", point=(x, y))]), answer
        assert turn.calls == ([call] if tool else [])


@pytest.mark.parametrize("answer", REFUSALS + MALFORMED)
def test_refusals_and_malformed_answers_are_never_actions(answer):
    if answer is None:
        with pytest.raises(InputError):
            map_answer(answer, (123, 77))
        return
    turn = map_answer(answer, (123, 77), tool=ANTHROPIC)
    if '"action": "type"' in answer:  # no point for grounding, but an action with no coordinate here
        assert turn.actions == [A("type", text="hi")]
        return
    assert turn.actions == [] and turn.calls == []
    terminate = '"terminate"' in answer
    assert turn.status == ("done" if terminate else UNMAPPED if "<tool_call>" in answer else "message"), answer


@pytest.mark.parametrize("answer, actions", [
    ("Click(box=(100, 200, 300, 400))", [A("click", point=(273, 230))]),  # the box's centre (200, 300)
    ("<think>There.</think><action>DoubleClick(box=(300, 400, 100, 200))</action>", [A("double_click", point=(273, 230))]),
    ("Hover(box=[100, 200, 300, 400])", [A("mouse_move", point=(273, 230))]),
    ("Drag(start=(0, 0, 200, 200), end=(500, 300))", [A("drag", point=(136, 76), end=P)]),
    ("Scroll(start=(100, 200, 300, 400), direction='down')", [A("scroll", point=(273, 230), direction="down",
                                                              amount=5)]),
])
def test_venus_boxes_are_their_centres(answer, actions):
    """UI-Venus answers a box as often as a point: read as parse_grounding reads it, its centre."""
    from mlx_qwen3vl.agent import parse_grounding

    turn = map_answer(answer, DISPLAY, tool=ANTHROPIC)
    assert (turn.status, turn.actions) == ("action", actions)
    assert parse_grounding(answer, *DISPLAY).point == actions[0].point or "start=" in answer


# ---------------------------------------------------------------------------------------------
# Declarations
# ---------------------------------------------------------------------------------------------
def test_declarations():
    old = computer_tool({"type": "computer_20250124", "name": "computer", "display_width_px": 1024,
                         "display_height_px": 768, "display_number": 1})
    assert (old.protocol, old.display, old.name, "zoom" in old.actions) == ("anthropic", (1024, 768), "computer", False)
    assert "zoom" in ANTHROPIC.actions and old.display_size((10, 10)) == (1024, 768)
    assert (PREVIEW.protocol, PREVIEW.environment, PREVIEW.display) == ("openai", "linux", (1366, 768))
    assert computer_tool({"type": "computer_toolset_20260801"}).actions == frozenset(ANTHROPIC_TOOLSET_MEMBERS)
    assert computer_tool({"type": "function", "function": {"name": "f"}}) is None
    assert find_computer_tool(None) is None
    tools = [{"type": "function", "function": {"name": "f"}}, {"type": "computer"}]
    assert find_computer_tool(tools).type == "computer"


@pytest.mark.parametrize("tools, says", [
    ([{"type": "computer_20250124", "name": "computer", "display_width_px": 0, "display_height_px": 768}],
     "tools[0].display_width_px"),
    ([{"type": "computer_20251124", "name": "computer", "display_width_px": "1366", "display_height_px": 768}],
     "display_width_px"),
    ([{"type": "computer_20251124", "name": "computer", "display_width_px": True, "display_height_px": 768}],
     "display_width_px"),
    ([{"type": "computer_20251124", "name": "computer", "display_width_px": 1366}], "display_height_px"),
    ([{"type": "computer_use_preview", "display_width": 10 ** 9, "display_height": 768, "environment": "mac"}],
     "display_width"),
    ([{"type": "computer_use_preview", "display_width": 1366, "display_height": 768, "environment": "amiga"}],
     "environment"),
    ([{"type": "computer_toolset_20260801", "configs": {"teleport": {"enabled": True}}}], "teleport"),
    ([{"type": "computer_toolset_20260801", "configs": {"zoom": {"enabled": "yes"}}}], "zoom"),
    ([{"type": "computer"}, {"type": "computer_toolset_20260801"}], "both declare"),
])
def test_bad_declarations_are_refused_with_the_field_named(tools, says):
    with pytest.raises(InputError) as e:
        find_computer_tool(tools)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_protocol_calls_read_back_into_the_same_actions():
    actions = {a for _, neutral, *_ in QWEN_CASES + VENUS_CASES if isinstance(neutral, list) for a in neutral}
    toolset = computer_tool({"type": "computer_toolset_20260801"})
    for tool in (ANTHROPIC, toolset):
        for a in actions:
            assert tool.parse_call(tool.render(a, DISPLAY), "content[0]") == a
    exact = [A("click", point=P, button="middle"), A("double_click", point=P), A("mouse_move", point=Q),
             A("drag", point=P, end=Q), A("scroll", point=P, direction="left", amount=3), A("type", text="x"),
             A("key", keys=("cmd", "up", "f5")), A("screenshot"), A("wait", seconds=1.0)]
    for a in exact:
        assert PREVIEW.parse_call(PREVIEW.render(a, DISPLAY)) == a
    assert PREVIEW.render(A("key", keys=("cmd", "up")), DISPLAY) == {"type": "keypress", "keys": ["cmd", "arrowup"]}
    assert ANTHROPIC.render(A("key", keys=("cmd", "pagedown", "f5", "+")), DISPLAY)["input"]["text"] == \
        "super+Page_Down+F5+plus"
    # What the neutral vocabulary has no word for reads as None; malformed calls are errors.
    assert ANTHROPIC.parse_call(anth("zoom", region=[0, 0, 5, 5])) is None
    assert ANTHROPIC.parse_call(anth("hold_key", text="shift", duration=1)) is None
    assert toolset.parse_call({"name": "cursor_position", "input": {}}) is None
    assert PREVIEW.parse_call({"type": "click", "button": "back", "x": 1, "y": 2}) is None
    for bad in (anth("left_click", coordinate=[1]), anth("scroll", scroll_direction="in", scroll_amount=1),
                anth("type"), {"name": "computer", "input": "left_click"}):
        with pytest.raises(InputError):
            ANTHROPIC.parse_call(bad, "messages[1].content[0]")
    with pytest.raises(InputError):
        PREVIEW.parse_call({"type": "drag", "path": [{"x": 1, "y": 1}]})


# ---------------------------------------------------------------------------------------------
# The trained prompt, and earlier steps
# ---------------------------------------------------------------------------------------------
def test_a_declared_tool_renders_the_trained_prompt():
    from mlx_qwen3vl.processor import Processor

    from conftest import FIXTURES

    processor = Processor.from_pretrained(FIXTURES / "tiny-a")
    render = lambda m: processor.apply_chat_template(m, add_generation_prompt=True, tokenize=False)  # noqa: E731
    task = "Open the display settings."
    assert computer_messages(task, "shot.png") == computer_use_messages("shot.png", task)
    assert render(computer_messages(task, "shot.png", format="qwen")) == render(computer_use_messages("shot.png", task))
    for kind in ("web", "mobile"):
        venus = computer_messages(task, "shot.png", format="venus", kind=kind)
        assert venus == navigation_messages("shot.png", task, kind=kind)
    # Earlier steps: the model's own answers as assistant turns, each next screenshot as the tool's result.
    history = [ComputerStep(screenshot=f"s{i}.png", answer=qwen("left_click", coordinate=[i, i])) for i in range(6)]
    messages = computer_messages(task, "now.png", history)
    assert [m["role"] for m in messages] == ["system", "user"] + ["assistant", "tool"] * 4  # the last four steps
    assert messages[1]["content"] == [{"type": "image", "image": "s2.png"}, {"type": "text", "text": task}]
    assert [m["content"] for m in messages[2::2]] == [qwen("left_click", coordinate=[i, i]) for i in range(2, 6)]
    assert [m["content"] for m in messages[3::2]] == [[{"type": "image", "image": s}] for s in
                                                      ("s3.png", "s4.png", "s5.png", "now.png")]
    text = render(messages)
    assert text.endswith(qwen("left_click", coordinate=[5, 5]) + "<|im_end|>\n<|im_start|>user\n<tool_response>\n"
                         "<|vision_start|><|image_pad|><|vision_end|>\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\n")
    venus = computer_messages(task, "now.png", [ComputerStep(answer="<think>t</think><action>Wait()</action>")],
                              format="venus")
    assert venus == navigation_messages("now.png", task, [("t", "Wait()")], kind="web")


HD = computer_tool({"type": "computer_20251124", "name": "computer", "display_width_px": 1920,
                    "display_height_px": 1080})  # over 1000 pixels a side: 0-1000 → pixels → 0-1000 is exact


def test_steps_from_the_protocol_s_calls_are_written_as_the_model_wrote_them():
    answers = [qwen("left_click", coordinate=[500, 300]), qwen("right_click", coordinate=[1, 999]),
               qwen("middle_click", coordinate=[0, 0]), qwen("double_click", coordinate=[123, 456]),
               qwen("triple_click", coordinate=[999, 1]), qwen("mouse_move", coordinate=[250, 750]),
               qwen("left_click_drag", coordinate=[250, 750]), qwen("scroll", pixels=-5),
               qwen("hscroll", pixels=3, coordinate=[10, 20]), qwen("type", text="hello"),
               qwen("key", keys=["ctrl", "s"]), qwen("wait", time=2),
               "I will search.\n" + qwen("left_click", coordinate=[500, 300])]
    display = HD.display
    for answer in answers:
        turn = map_answer(answer, display, tool=HD)
        actions = [HD.parse_call(c) for c in turn.calls]  # what a client sends back
        step = ComputerStep(screenshot="s.png", actions=actions, text=turn.text)
        assert computer_messages("t", "now.png", [step], display=display)[2]["content"] == answer
    venus = ["Click(box=(500, 300))", "RightClick(box=(1, 999))", "DoubleClick(box=(123, 456))",
             "TripleClick(box=(999, 1))", "MiddleClick(box=(5, 5))", "Hover(box=(250, 750))",
             "Drag(start=(500, 300), end=(250, 750))", "Scroll(direction='down')",
             "Scroll(start=(500, 300), direction='up')", "Type(content=\"it's\")", "Hotkey(keys=['ctrl', 'c'])",
             "PressEnter()", "Wait()", "GetScreenshot()"]
    for action in venus:
        turn = map_answer(f"<think>why</think><action>{action}</action>", display, tool=HD)
        step = ComputerStep(actions=[HD.parse_call(c) for c in turn.calls], reasoning=turn.reasoning)
        text = computer_messages("t", "now.png", [step], format="venus", display=display)[1]["content"][0]["text"]
        assert f"### Previous Actions\nStep 0: <think>why</think><action>{action}</action>\n" in text
    # A step that only talked is replayed as a message to the user.
    text = computer_messages("t", "now.png", [ComputerStep(text="Which one?")], format="venus")[1]["content"][0]["text"]
    assert "Step 0: <think></think><action>CallUser(content='Which one?')</action>" in text
    with pytest.raises(InputError):
        computer_messages("t", "now.png", format="ui-tars")


def test_a_replayed_loop_runs_through_the_real_processor(tmp_path):
    """Two steps parsed back from Anthropic calls, each with its screenshot as the tool's result,
    then the next step: the prompt the engine runs (a scripted checkpoint answers the task's
    trigger) holds every screenshot, and the answer maps to the tool's call."""
    import numpy as np

    import mlx_qwen3vl as M
    from mlx_qwen3vl.generate import encode_prompt
    from scripted import write_scripted_checkpoint

    answer = qwen("double_click", coordinate=[250, 750])
    model, processor = M.load(write_scripted_checkpoint(tmp_path, {"@settings": answer}))
    rng = np.random.default_rng(1)
    shots = [rng.integers(0, 256, (72, 128, 3), dtype=np.uint8) for _ in range(3)]
    steps = []
    for i, call in enumerate([anth("left_click", coordinate=list(P)), anth("type", text="display")]):
        steps.append(ComputerStep(screenshot=shots[i], actions=[ANTHROPIC.parse_call(call)]))
    messages = computer_messages("Open the @settings", shots[2], steps, display=DISPLAY)
    inputs = encode_prompt(processor, messages=messages)
    assert int(np.asarray(inputs["image_grid_thw"]).shape[0]) == 3
    out = M.generate(model, processor, messages=messages, max_tokens=256, temperature=0.0)
    turn = map_answer(out.text, DISPLAY, tool=ANTHROPIC)
    assert (out.text, turn.calls) == (answer, [anth("double_click", coordinate=list(Q))])
