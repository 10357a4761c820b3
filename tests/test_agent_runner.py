"""The agent runner: the Environment interface and its one coordinate mapping, run_task on
scripted checkpoints, trajectories, replay, the command line and evaluation, in real MiniWoB++
episodes in headless Chromium."""

import json
import re
import shutil

import pytest
from PIL import Image

from mlx_qwen3vl.agent.computer_tools import ComputerAction
from mlx_qwen3vl.agent.envs import Environment, Observation, env_class, to_env
from mlx_qwen3vl.agent.computer_use import AGENT_SAMPLING
from mlx_qwen3vl.agent.runner import LocalAnswerer, run_task
from scripted import write_scripted_checkpoint


def test_to_env_maps_image_pixels_by_origin_and_scale():
    img = Image.new("RGB", (200, 100))
    assert to_env((10, 20), Observation(img)) == (10, 20)
    # Retina: a 2x capture in pixels, input in points
    assert to_env((301, 99), Observation(img, scale=(0.5, 0.5))) == (150.5, 49.5)
    # a downscaled capture of a region of a larger screen, scaled differently on each axis
    assert to_env((10, 20), Observation(img, scale=(2.0, 1.5), origin=(100, 40))) == (120.0, 70.0)
    assert to_env((0, 0), Observation(img, scale=(3.0, 3.0), origin=(7, 9))) == (7, 9)


def test_environment_is_abstract_and_defaults_to_no_score():
    with pytest.raises(TypeError):
        Environment()

    class Still(Environment):
        name = "still"

        def __init__(self):
            self.acts, self.closed = [], False

        def reset(self):
            return self.screenshot(), "nothing"

        def screenshot(self):
            return Observation(Image.new("RGB", (4, 4)))

        def act(self, action):
            self.acts.append(action)

        def close(self):
            self.closed = True

    with Still() as env:
        obs, task = env.reset()
        env.act(ComputerAction("click", (1, 2)))
        assert (task, obs.size, env.done, env.reward, env.acts) == ("nothing", (4, 4), False, 0.0,
                                                                   [ComputerAction("click", (1, 2))])
    assert env.closed


def test_env_class_names_unknown_environment():
    with pytest.raises(KeyError):
        env_class("nowhere")


# ------------------------------------------------------------------------------ MiniWoB++ episodes
# Each scripted checkpoint's answers are computed from the seeded episode's DOM (miniwob's own
# reading of it, CSS pixels of the 160x210 task area): the element the instruction names, as a
# 0-1000 point of the screenshot in the agent format's syntax. Triggers are the instructions
# themselves (each occurs only in its own episode's prompt); a venus multi-step episode also keys
# its later answers on the "Step N" lines of its history.

CHROMIUM, DRIVER = shutil.which("chromium") or shutil.which("chromium-browser"), shutil.which("chromedriver")
W, H = 160, 210  # MiniWoB++'s task area


@pytest.fixture(scope="module")
def miniwob():
    pytest.importorskip("miniwob", reason="miniwob is not installed (the test extra)")
    if not CHROMIUM or not DRIVER:
        pytest.skip("no headless browser here: install Debian's chromium and chromium-driver "
                    "(apt-get install chromium chromium-driver; .ci/run does)")
    from mlx_qwen3vl.agent.envs.miniwob import MiniWoBEnv

    env = MiniWoBEnv("click-button", seed=0, episode_seconds=60)  # one browser for every episode here
    yield env
    env.close()


def walk(node):
    yield node
    for c in node.children:
        yield from walk(c)


def quoted(utterance):
    return re.search(r'"(.*?)"', utterance).group(1)


WIDGETS = {"textarea": "textarea", "checkbox": "input_checkbox", "radio": "input_radio", "text": "input_text",
           "button": "button"}
TARGETS = {  # task → (instruction → is this DOM element the one it names?, the kind of element it picks among)
    "click-button": (lambda u, d: d.text == quoted(u), lambda d: d.tag == "button"),
    "click-link": (lambda u, d: d.text == quoted(u), lambda d: d.tag == "span" and "alink" in (d.classes or "")),
    "click-widget": (lambda u, d: d.tag == WIDGETS.get(quoted(u)), lambda d: d.tag in WIDGETS.values()),
    "click-test-2": (lambda u, d: d.text == u.split()[-1].rstrip("."), lambda d: d.tag == "button"),
}
SEEDS = {"click-test-2": 1}  # its instruction is always "Click button ONE.": one seed (the triggers must differ)


def episode(env, task, seed, device_scale=1):
    env.device_scale = device_scale
    obs, utterance = env.reset(task=task, seed=seed)
    return obs, utterance, list(walk(env.dom()))


def rel(d):
    """The element's centre as the model answers: 0-1000 of the screenshot (which spans the task area)."""
    return round((d.left + d.width / 2) / W * 1000), round((d.top + d.height / 2) / H * 1000)


def inside(point, d):
    return d.left <= point[0] <= d.left + d.width and d.top <= point[1] <= d.top + d.height


def click_answer(fmt, x, y):
    if fmt == "venus":
        return f"<think>the target</think><action>Click(box=({x}, {y}))</action>"
    return ('<tool_call>\n{"name": "computer_use", "arguments": {"action": "left_click", "coordinate": '
            f"[{x}, {y}]" + "}}\n</tool_call>")


def single_step_cases(env):
    """Two seeds of each single-step task whose instructions differ (the triggers must): per case
    (task, seed, device scale, instruction, the right element, a wrong point's element or None)."""
    cases = []
    for task, (names, kind) in TARGETS.items():
        seen = set()
        for seed in range(12):
            if len([c for c in cases if c[0] == task]) == SEEDS.get(task, 2):
                break
            _, u, dom = episode(env, task, seed)
            if u in seen or not any(kind(d) and names(u, d) for d in dom):
                continue
            seen.add(u)
            right = next(d for d in dom if kind(d) and names(u, d))
            wrong = next((d for d in dom if kind(d) and not names(u, d)), None)
            cases.append((task, seed, 1 + len(seen) % 2, u, right, wrong))  # device scale 2, then 1
    return cases


@pytest.fixture(scope="module")
def cases(miniwob):
    return single_step_cases(miniwob)


def scripted_model(tmp_path_factory, answers, default=None):
    import mlx_qwen3vl as M

    folder = write_scripted_checkpoint(tmp_path_factory.mktemp("ck"), answers, default=default)
    return M.load(folder)


def answerer(model, fmt):
    """One LocalAnswerer for a model's episodes (as eval does: the system prompt's cache reused)."""
    return LocalAnswerer(*model, **{"max_tokens": 256, **AGENT_SAMPLING[fmt]})


@pytest.mark.parametrize("fmt", ["venus", "qwen"])
def test_single_step_tasks_right_answer_earns_the_reward_and_a_wrong_one_does_not(miniwob, cases, fmt,
                                                                                 tmp_path_factory):
    assert len(cases) == 7 and {c[2] for c in cases} == {1, 2}
    right = scripted_model(tmp_path_factory, {u: click_answer(fmt, *rel(r)) for _, _, _, u, r, _ in cases})
    wrong_cases = [c for c in cases if c[5] is not None]
    # a wrong element where there is one (it ends the episode with -1), else the empty bottom row
    wrong = scripted_model(tmp_path_factory, {u: click_answer(fmt, *(rel(w) if w is not None else (500, 990)))
                                              for _, _, _, u, _, w in cases})
    right, wrong = answerer(right, fmt), answerer(wrong, fmt)
    for task, seed, scale, u, target, other in cases:
        miniwob.task, miniwob.seed, miniwob.device_scale = task, seed, scale
        ep = run_task(None, None, miniwob, agent_format=fmt, max_steps=1, answerer=right)
        (step,) = ep.steps
        assert ep.reason == "done" and ep.success and 0 < ep.reward <= 1, (task, seed, ep.to_dict())
        assert step.image_size == (W * scale, H * scale)
        # the point is in screenshot pixels; mapped by the scale, it lands on the element meant
        assert step.env_point == (step.point[0] / scale, step.point[1] / scale)
        assert inside(step.env_point, target), (task, seed, step.env_point)
        ep = run_task(None, None, miniwob, agent_format=fmt, max_steps=1, answerer=wrong)
        assert not ep.success and ep.reward <= 0, (task, seed, ep.to_dict())
        assert ep.reason == ("done" if other is not None else "max_steps")
    assert len(wrong_cases) >= 4


def enter_text_answers(fmt, field, submit, text):
    if fmt == "venus":  # one action per step: the later ones keyed on the history's "Step N" lines
        return {"first": "<action>Click(box=({}, {}))</action>".format(*rel(field)),
                "Step 0": f"<action>Type(content='{text}')</action>",
                "Step 1": "<action>Click(box=({}, {}))</action>".format(*rel(submit))}
    # Qwen: the three calls in one answer, each written its own way (key order, spacing) so that the
    # scripted model tells them apart within a state's 16 tokens of context (tests/scripted.py);
    # a triple click focuses the field as a click would.
    calls = [({"arguments": {"action": "triple_click", "coordinate": list(rel(field))}, "name": "computer_use"}, ","),
             ({"name": "computer_use", "arguments": {"action": "type", "text": text}}, ","),
             ({"arguments": {"action": "left_click", "coordinate": list(rel(submit))}, "name": "computer_use"}, ", ")]
    return {"first": "\n".join("<tool_call>\n" + json.dumps(c, separators=(sep, sep.replace(",", ":")))
                               + "\n</tool_call>" for c, sep in calls)}


@pytest.mark.parametrize("fmt,seed", [("venus", 1), ("qwen", 2)])
def test_enter_text_multi_step_earns_the_reward_with_the_right_text_only(miniwob, fmt, seed, tmp_path_factory):
    _, u, dom = episode(miniwob, "enter-text", seed)
    field = next(d for d in dom if d.tag == "input_text")
    submit = next(d for d in dom if d.tag == "button")
    for text, earns in ((quoted(u), True), (quoted(u) + "x", False)):
        answers = enter_text_answers(fmt, field, submit, text)
        answers = {(u if k == "first" else k): v for k, v in answers.items()}
        model = scripted_model(tmp_path_factory, answers)
        miniwob.task, miniwob.seed, miniwob.device_scale = "enter-text", seed, 1
        ep = run_task(*model, miniwob, agent_format=fmt, max_steps=4)
        assert ep.reason == "done" and ep.success == earns and (ep.reward > 0) == earns, ep.to_dict()
        assert len(ep.steps) == (3 if fmt == "venus" else 1)
        kinds = [a["type"] for s in ep.steps for a in s.actions]
        assert kinds == (["click", "type", "click"] if fmt == "venus" else ["triple_click", "type", "click"])
        if fmt == "venus":  # the venus prompt replays the earlier steps as text
            assert ep.steps[2].cached_tokens > 0
