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
from mlx_qwen3vl.agent.runner import LocalAnswerer, ServerAnswerer, run_task, step_messages
from mlx_qwen3vl.errors import InputError
from mlx_qwen3vl.agent.trajectory import TrajectoryWriter, replay
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


def test_step_messages_keep_the_last_screenshots_and_no_vision_markers_from_answers():
    shots = [Image.new("RGB", (8, 8), (i, 0, 0)) for i in range(3)]
    answers = ["<action>Click(box=(1, 2))</action><|vision_end|>", "<|image_pad|>x"]
    qwen = step_messages("do it", shots, answers, agent_format="qwen", history_images=2)
    images = [b["image"] for m in qwen if isinstance(m["content"], list) for b in m["content"] if b["type"] == "image"]
    assert images == shots[1:]  # the first screenshot became a line of text
    assert [m["role"] for m in qwen] == ["system", "user", "assistant", "tool", "assistant", "tool"]
    assert qwen[1]["content"][0]["text"] == "(an earlier screenshot, omitted)"
    assert [m["content"] for m in qwen if m["role"] == "assistant"] == ["<action>Click(box=(1, 2))</action>", "x"]
    venus = step_messages("do it", shots, answers, agent_format="venus")
    text = venus[1]["content"][0]["text"]
    assert "Step 0: <think></think><action>Click(box=(1, 2))</action>" in text and "<|" not in text
    assert venus[1]["content"][1]["image"] is shots[-1]


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
        # the point is in screenshot pixels; recorded as the input pixel holding its centre (what the
        # environment acted at), it lands on the element meant
        assert step.env_point == (int((step.point[0] + 0.5) / scale), int((step.point[1] + 0.5) / scale))
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
    """...and replay: the right episode's trajectory asked again of the same model changes nothing;
    of the model that types the wrong text, exactly the typing step changes."""
    _, u, dom = episode(miniwob, "enter-text", seed)
    field = next(d for d in dom if d.tag == "input_text")
    submit = next(d for d in dom if d.tag == "button")
    out = tmp_path_factory.mktemp("trajectory")
    models = []
    # the wrong text once (the single-step test shows a wrong answer scoring nothing in both formats)
    for text, earns in ((quoted(u), True), (quoted(u) + "x", False))[:2 if fmt == "venus" else 1]:
        answers = enter_text_answers(fmt, field, submit, text)
        answers = {(u if k == "first" else k): v for k, v in answers.items()}
        model = scripted_model(tmp_path_factory, answers)
        models.append(model)
        miniwob.task, miniwob.seed, miniwob.device_scale = "enter-text", seed, 1
        writer = TrajectoryWriter(out, overwrite=True) if earns else None
        ep = run_task(*model, miniwob, agent_format=fmt, max_steps=4, on_step=writer)
        if writer:
            writer.finish(ep)
        assert ep.reason == "done" and ep.success == earns and (ep.reward > 0) == earns, ep.to_dict()
        assert len(ep.steps) == (3 if fmt == "venus" else 1)
        kinds = [a["type"] for s in ep.steps for a in s.actions]
        assert kinds == (["click", "type", "click"] if fmt == "venus" else ["triple_click", "type", "click"])
        if fmt == "venus":  # the venus prompt replays the earlier steps as text
            assert ep.steps[2].cached_tokens > 0
    if fmt == "venus":
        same = replay(out, LocalAnswerer(*models[0], max_pixels=ep.settings["max_pixels"], **ep.settings["sampling"]))
        assert same.changed == [] and len(same.steps) == 3
        other = replay(out, LocalAnswerer(*models[1], max_pixels=ep.settings["max_pixels"], **ep.settings["sampling"]))
        assert other.changed == [1]
        assert other.steps[1].replayed == [{"type": "type", "text": quoted(u) + "x"}]


ENDINGS = {"@finish": "<action>Finished(content='all done')</action>",
           "@answer": '<tool_call>\n{"name": "computer_use", "arguments": {"action": "answer", "text": "42"}}\n'
                      "</tool_call>"}


def test_episode_endings_loop_steps_time_terminate_answer(miniwob, tmp_path_factory):
    # without a trigger: a click on the empty bottom row, which changes nothing on the screen
    model = scripted_model(tmp_path_factory, ENDINGS, default=click_answer("venus", 500, 990))
    ask = answerer(model, "venus")
    miniwob.task, miniwob.seed, miniwob.device_scale = "click-button", 0, 1

    def run(task, **kw):
        return run_task(None, None, miniwob, task, answerer=ask, **{"agent_format": "venus", **kw})

    ep = run("Click nothing.", max_steps=6, loop_k=2)
    assert (ep.reason, len(ep.steps), ep.success) == ("loop", 2, False)
    assert ep.steps[0].screen_hash == ep.steps[1].screen_hash and ep.steps[0].actions == ep.steps[1].actions
    ep = run("Click nothing.", max_steps=3, loop_k=4)
    assert (ep.reason, len(ep.steps)) == ("max_steps", 3)
    ep = run("Click nothing.", max_steps=3, time_budget_s=1e-9)
    assert (ep.reason, len(ep.steps)) == ("time_budget", 0)
    ep = run("Stop now @finish", max_steps=3)
    assert (ep.reason, ep.message, len(ep.steps), ep.steps[0].status) == ("terminate", "all done", 1, "done")
    ep = run("What is six times seven? @answer", max_steps=3, agent_format="qwen")
    assert (ep.reason, ep.message, len(ep.steps)) == ("answer", "42", 1)
    with pytest.raises(InputError, match="loop_k"):
        run("Click nothing.", loop_k=0)


# ------------------------------------------------------------------------------ the command line


def agent_cli(capsys, *argv):
    from mlx_qwen3vl.agent.__main__ import main

    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def click_button_model(miniwob, cases, tmp_path_factory):
    """A checkpoint answering every single-step case rightly in the venus syntax, its folder."""
    folder = tmp_path_factory.mktemp("ck-cli")
    write_scripted_checkpoint(folder, {u: "<think><b>x & y</b></think><action>Click(box=({}, {}))</action>".format(
        *rel(r)) for _, _, _, u, r, _ in cases})
    return folder


def test_cli_run_json_and_the_trajectory_page(miniwob, cases, click_button_model, tmp_path, capsys):
    task, seed, _, u, target, _ = next(c for c in cases if c[0] == "click-link")
    out = tmp_path / "run"
    code, stdout, err = agent_cli(capsys, "run", "--env", "miniwob", "--task", task, "--seed", seed, "--model",
                                  click_button_model, "--max-steps", 2, "--out", out, "--json")
    assert code == 0, err
    result = json.loads(stdout.strip().splitlines()[-1])
    assert (result["task"], result["seed"], result["instruction"], result["success"]) == (task, seed, u, True)
    assert result["reward"] > 0 and len(result["steps"]) == 1
    step = result["steps"][0]
    assert step["action"]["type"] == "click" and inside(step["point"], target)  # screenshot px = CSS px here
    assert step["answer"].startswith("<think><b>x & y</b></think>")
    lines = [json.loads(x) for x in (out / "trajectory.jsonl").read_text().splitlines()]
    assert [x["point"] for x in lines] == [step["point"]] and lines[0]["env_point"] == step["point"]
    assert {"prompt_tokens", "cached_tokens", "generation_tokens", "prefill_s", "decode_s", "act_s", "reward",
            "screenshot", "actions", "answer"} <= set(lines[0])
    page = (out / "index.html").read_text()
    assert "&lt;b&gt;x &amp; y&lt;/b&gt;" in page and "<b>x" not in page and "http" not in page  # escaped, no CDN
    # the page in the browser: every picture loads, the answer reads as the model wrote it
    driver = miniwob.driver
    main_tab = driver.current_window_handle
    driver.switch_to.new_window("tab")
    try:
        driver.get((out / "index.html").as_uri())
        loaded = driver.execute_script("return [...document.images].map(i => i.complete && i.naturalWidth > 0)")
        assert loaded == [True]
        assert driver.execute_script("return document.querySelector('pre').textContent") == step["answer"]
    finally:
        driver.close()
        driver.switch_to.window(main_tab)
    # the same run without --json: readable lines, the trajectory folder refused once it holds one
    code, stdout, err = agent_cli(capsys, "run", "--env", "miniwob", "--task", task, "--seed", seed, "--model",
                                  click_button_model, "--out", out)
    assert code == 2 and err.startswith("error: ") and "already holds a trajectory" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("argv,message", [
    (["run", "--env", "miniwob", "--task", "click-buton"], "unknown MiniWoB++ task 'click-buton'"),
    (["run", "--env", "browser", "--task", "x"], "--url"),
    (["run", "--env", "browser", "--task", "x", "--url", "http://127.0.0.1:9/", "--viewport", "big"], "--viewport"),
    (["run", "--env", "miniwob", "--task", "click-button", "--max-steps", "0"], "--max-steps"),
    (["eval", "--tasks", "click-button", "--seeds", "9-1", "--out", "x"], "runs backwards"),
    (["eval", "--tasks", "click-button", "--seeds", "a", "--out", "x"], "--seeds"),
    (["run", "--env", "miniwob", "--task", "click-button", "--base-url", "ftp://x"], "--base-url"),
    (["replay", "nowhere"], "no finished trajectory"),
])
def test_cli_bad_input_is_one_error_line(capsys, argv, message, tmp_path):
    if "--base-url" not in argv:
        argv = argv + ["--model", str(tmp_path)]
    code, out, err = agent_cli(capsys, *argv)
    assert code == 2 and message in err and err.startswith("error: ") and len(err.splitlines()) == 1, err


def test_cli_eval_resumes_and_refuses_other_settings(miniwob, cases, click_button_model, tmp_path, capsys):
    ran = [(t, s) for t, s, *_ in cases if t in ("click-button", "click-link")]
    assert len(ran) == 4
    out = tmp_path / "eval"
    args = ["eval", "--env", "miniwob", "--tasks", "click-button,click-link", "--seeds",
            ",".join(sorted({str(s) for _, s in ran})), "--model", click_button_model, "--max-steps", 1, "--out", out]
    code, stdout, err = agent_cli(capsys, *args, "--json")
    assert code == 0, err
    summary = json.loads(stdout.strip().splitlines()[-1])
    state = json.loads((out / "eval.json").read_text())
    # every case the checkpoint knows succeeds; a seed it was not given (the other task's) does not
    for key, e in state["episodes"].items():
        assert e["success"] == (tuple([e["task"], e["seed"]]) in ran), key
        assert (out / e["last_picture"]).is_file() and (out / e["trajectory"] / "index.html").is_file()
    n = len(state["episodes"])
    assert summary["episodes"] == n and summary["successes"] == 4 and summary["success_rate"] == round(4 / n, 4)
    assert summary["mean_steps"] == 1 and {r["task"] for r in summary["tasks"]} == {"click-button", "click-link"}
    report = (out / "report.html").read_text()
    assert report.count("<img ") == n and "http" not in report
    # resumed: nothing left to run, the same numbers
    code, stdout, err = agent_cli(capsys, *args, "--json")
    assert code == 0 and json.loads(stdout.strip().splitlines()[-1]) == summary
    assert json.loads((out / "eval.json").read_text()) == state
    # other settings: refused, nothing changed
    code, stdout, err = agent_cli(capsys, *[a if a != 1 else 2 for a in args])
    assert code == 2 and "other settings (max_steps 1 there, 2 here)" in err and len(err.splitlines()) == 1
    assert json.loads((out / "eval.json").read_text()) == state


# ------------------------------------------------------------------------------ a server


def test_server_backend_runs_the_same_loop(miniwob, cases, click_button_model):
    pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from test_server import KEY, Server

    server = Server("--api-key", KEY, model=click_button_model)
    try:
        # UI-Venus' sampling (its repetition penalty goes as an extra field the server reads)
        sampling = {k: v for k, v in AGENT_SAMPLING["venus"].items() if "pixels" not in k}
        ask = ServerAnswerer(f"http://127.0.0.1:{server.port}/v1", api_key=KEY, **{**sampling, "max_tokens": 64})
        assert ask.extra_body == {"repetition_penalty": 1.05}
        for task, seed, scale, u, target, _ in cases[1:2]:  # at device scale 1
            miniwob.task, miniwob.seed, miniwob.device_scale = task, seed, scale
            ep = run_task(None, None, miniwob, agent_format="venus", max_steps=1, answerer=ask)
            assert ep.success and ep.reason == "done" and inside(ep.steps[0].env_point, target), ep.to_dict()
            assert ep.steps[0].prompt_tokens > 1000 and ep.steps[0].generation_tokens > 5
    finally:
        server.stop()
