"""Two-stage grounding (zoom): the window pass 2 sees and the mapping of its answer back to the
screenshot, hand-computed, on odd and portrait sizes with first points at every edge and corner;
refusals and malformed answers in either pass; the ground CLI (JSON with both passes, the window
drawn); the evaluation's one-pass and two-pass figures with a scripted predictor that answers from
the crop's geometry; and end-to-end runs on a scripted-answer checkpoint through the real engine.

Hand computations use the rules of mlx_qwen3vl.agent.zoom: window side ceil(fraction * side),
left = round(x / 1000 * W - w / 2) (halves up) clamped to [0, W - w], and pass 2's answer u maps to
floor(left + u / 1000 * w) clamped to [0, W - 1], applied once, at the end."""

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mlx_qwen3vl import agent
from mlx_qwen3vl import eval_grounding
from mlx_qwen3vl import ground as ground_cli
from mlx_qwen3vl.agent import Window, ground_with, parse_grounding, zoom_window
from mlx_qwen3vl.agent.draw import WINDOW_COLOUR
from scripted import write_scripted_checkpoint

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "fixtures" / "grounding" / "screenspot_tiny.jsonl"
MEDIA = ROOT / "tests" / "fixtures" / "media"


def _screen(width, height, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def two_passes(size, first, second=None, *, format="venus", **kw):
    """ground_with on a random width x height screenshot, pass 1 answering `first` and pass 2
    `second` → (result, the images each pass was shown, the screenshot)."""
    screen = _screen(*size)
    shown = []

    def ask(messages):
        image = messages[-1]["content"][0]["image"]
        shown.append(image)
        return first if len(shown) == 1 else second

    return ground_with(ask, screen, "the Apply button", format=format, **kw), shown, screen


def _check_crop(shown, screen, window):
    left, top, w, h = window
    assert len(shown) == 2 and np.array_equal(shown[1], screen[top:top + h, left:left + w])


# ---------------------------------------------------------------------------------------------
# The mapping, by hand
# ---------------------------------------------------------------------------------------------
CASES = [
    # size, pass 1, pass 2, window (left, top, w, h), final point; the arithmetic beside each.
    ((1366, 768), "[500,500]", "[500,500]", (342, 192, 683, 384), (683, 384)),
    # w = ceil(683) = 683, h = 384; left = round(683 - 341.5) = round(341.5) = 342, top = 384 - 192 = 192;
    # x = floor(342 + 500/1000*683) = floor(683.5) = 683, y = floor(192 + 192) = 384.
    ((1366, 768), "[0,0]", "[10,20]", (0, 0, 683, 384), (6, 7)),
    # top-left corner: left = round(-341.5) → 0, top → 0; x = floor(10/1000*683) = floor(6.83) = 6,
    # y = floor(20/1000*384) = floor(7.68) = 7.
    ((1366, 768), "[1000,1000]", "[1000,1000]", (683, 384, 683, 384), (1365, 767)),
    # bottom-right corner: left = round(1366 - 341.5) = 1025 → clamped to 1366 - 683 = 683, top → 768 - 384 = 384;
    # x = floor(683 + 683) = 1366 → clamped to 1365, y = floor(384 + 384) = 768 → 767 (the clamp, once, at the end).
    ((1366, 768), "[1000,0]", "[900,50]", (683, 0, 683, 384), (1297, 19)),
    # top-right corner: x = floor(683 + 900/1000*683) = floor(683 + 614.7) = 1297, y = floor(50/1000*384) = floor(19.2) = 19.
    ((1366, 768), "[0,1000]", "[50,900]", (0, 384, 683, 384), (34, 729)),
    # bottom-left corner: x = floor(50/1000*683) = floor(34.15) = 34, y = floor(384 + 345.6) = 729.
    ((1366, 768), "[999,500]", "[250,750]", (683, 192, 683, 384), (853, 480)),
    # right edge: cx = 999/1000*1366 = 1364.634, left = round(1023.134) = 1023 → 683;
    # x = floor(683 + 170.75) = 853, y = floor(192 + 288) = 480.
    ((1366, 768), "[1,500]", "[999,999]", (0, 192, 683, 384), (682, 575)),
    # left edge: x = floor(999/1000*683) = floor(682.317) = 682, y = floor(192 + 383.616) = 575.
    ((1366, 768), "[500,3]", "[0,0]", (342, 0, 683, 384), (342, 0)),
    # top edge: cy = 2.304, top = round(2.304 - 192) → 0.
    ((1366, 768), "[500,1000]", "[500,1000]", (342, 384, 683, 384), (683, 767)),
    # bottom edge: top = round(768 - 192) = 576 → 384; y = floor(384 + 384) = 768 → 767.
    ((1366, 768), "[500,500]", "[1000,1000]", (342, 192, 683, 384), (1025, 576)),
    # 1000 on a window inside the image is the window's far edge: floor(342 + 683) = 1025, the pixel
    # just past the window's last column (1024): the clamp applies to the screenshot, not to the window.
    ((3840, 2160), "[600,400]", "[500,500]", (1344, 324, 1920, 1080), (2304, 864)),
    # 4K centre: left = 2304 - 960 = 1344, top = 864 - 540 = 324; x = 1344 + 960 = 2304, y = 324 + 540 = 864.
    ((3840, 2160), "[123,877]", "[333,667]", (0, 1080, 1920, 1080), (639, 1800)),
    # 4K near the bottom-left: cx = 472.32 → left = round(-487.68) → 0; cy = 1894.32 → top = round(1354.32) = 1354
    # → 2160 - 1080 = 1080; x = floor(333/1000*1920) = floor(639.36) = 639, y = floor(1080 + 720.36) = 1800.
    ((1079, 1921), "[500,500]", "[500,500]", (270, 480, 540, 961), (540, 960)),
    # odd portrait: w = ceil(539.5) = 540, h = ceil(960.5) = 961; left = round(539.5 - 270) = round(269.5) = 270,
    # top = round(960.5 - 480.5) = 480; x = floor(270 + 270) = 540, y = floor(480 + 480.5) = 960
    # (one pass would give floor(539.5) = 539: the two passes round differently, each by the rule).
    ((1080, 2340), "[250,100]", "[800,150]", (0, 0, 540, 1170), (432, 175)),
    # phone portrait near the top: left = round(270 - 270) = 0, top = round(234 - 585) → 0;
    # x = floor(800/1000*540) = 432, y = floor(150/1000*1170) = floor(175.5) = 175.
    ((1080, 2340), "[1000,999]", "[999,1]", (540, 1170, 540, 1170), (1079, 1171)),
    # phone bottom-right: x = floor(540 + 539.46) = 1079, y = floor(1170 + 1.17) = 1171.
]


@pytest.mark.parametrize("size,first,second,window,point", CASES)
def test_two_pass_mapping_by_hand(size, first, second, window, point):
    result, shown, screen = two_passes(size, first, second, zoom=True)
    assert zoom_window(parse_grounding(first, *size).relative, *size) == Window(*window)
    assert (result.point, result.status, result.answer, result.used_pass) == (point, "ok", second, 2)
    left, top, w, h = window
    assert result.window == (left, top, left + w - 1, top + h - 1)
    _check_crop(shown, screen, window)  # pass 2 saw exactly the window's pixels
    assert [p.image_size for p in result.passes] == [size, (w, h)]
    assert result.passes[0].point == parse_grounding(first, *size).point  # pass 1 read as a one-pass answer
    assert (result.width, result.height) == size


def test_a_box_in_pass_2_maps_corners_and_centre():
    """qwen's bbox_2d: each corner and the box centre (taken in relative units) carried out of
    the window (342, 192, 683, 384) of a 1366x768 screenshot."""
    result, shown, _ = two_passes((1366, 768), '[{"bbox_2d": [400, 400, 600, 600]}]',
                                  '[{"bbox_2d": [100, 200, 300, 400], "label": "Apply"}]', format="qwen", zoom=0.5)
    # pass 1 centre (500, 500) → the window of the first case. Corners: x1 = floor(342 + 68.3) = 410,
    # y1 = floor(192 + 76.8) = 268, x2 = floor(342 + 204.9) = 546, y2 = floor(192 + 153.6) = 345;
    # centre (200, 300) of the window: x = floor(342 + 136.6) = 478, y = floor(192 + 115.2) = 307.
    assert result.window == (342, 192, 1024, 575)
    assert (result.point, result.box, result.used_pass) == ((478, 307), (410, 268, 546, 345), 2)
    assert result.passes[0].box == (546, 307, 819, 460)  # pass 1's own box, one-pass rule


def test_window_grows_to_the_models_minimum_pixels():
    # 123x77 at one half: 62 x 39 = 2418 pixels, under 4096: both sides grow by sqrt(4096 / 9471) = 0.6576
    # → ceil(80.89) = 81, ceil(50.64) = 51 (4131 pixels); left = round(61.5 - 40.5) = 21, top = round(38.5 - 25.5) = 13.
    result, shown, screen = two_passes((123, 77), "[500,500]", "[500,500]", zoom=True, window_min_pixels=4096)
    _check_crop(shown, screen, (21, 13, 81, 51))
    assert result.point == (61, 38)  # floor(21 + 40.5) = 61, floor(13 + 25.5) = 38
    assert zoom_window((500, 500), 123, 77) == Window(31, 19, 62, 39)  # without it: round(30.5) = 31, 19
    # A screenshot under the minimum: the window would be all of it, so pass 2 is not run.
    result, shown, _ = two_passes((300, 200), "[200,200]", "never asked", zoom=True, window_min_pixels=65536)
    assert len(shown) == 1 and len(result.passes) == 1 and result.used_pass == 1
    assert (result.point, result.window) == ((60, 40), (0, 0, 299, 199))
    # Other fractions: 0.3 of 1000 x 10 is 300 x 3 at round(500 - 150) = 350, round(5 - 1.5) = round(3.5) = 4;
    # 0.1 is 100 x 1 (100 pixels); at least 5000: sqrt(5000 / 10000) = 0.7071 → ceil(707.1) = 708 x ceil(7.07) = 8
    # at round(500 - 354) = 146, round(5 - 4) = 1.
    assert zoom_window((500, 500), 1000, 10, fraction=0.3) == Window(350, 4, 300, 3)
    assert zoom_window((500, 500), 1000, 10, fraction=0.1) == Window(450, 5, 100, 1)
    assert zoom_window((500, 500), 1000, 10, fraction=0.1, min_pixels=5000) == Window(146, 1, 708, 8)


@pytest.mark.parametrize("size", [(123, 77), (1366, 768), (90, 260), (1000, 10), (7, 3), (1, 1)])
@pytest.mark.parametrize("min_pixels", [0, 100, 4096, 65536])
def test_windows_lie_inside_and_hold_the_minimum(size, min_pixels):
    width, height = size
    for point in ((0, 0), (1000, 1000), (0, 1000), (1000, 0), (500, 500), (1, 999), (333, 667)):
        left, top, w, h = window = zoom_window(point, width, height, min_pixels=min_pixels)
        assert 0 <= left and left + w <= width and 0 <= top and top + h <= height, window
        assert w >= width / 2 and h >= height / 2 and (w * h >= min_pixels or (w, h) == size), window


@pytest.mark.parametrize("first,status", [("[-1,-1]", "refused"), ("I cannot see it", "malformed"),
                                          ("[1200, 30]", "malformed"), ("[500,500]\n[-1,-1]", "malformed")])
def test_pass_1_without_a_point_is_the_answer(first, status):
    result, shown, _ = two_passes((1366, 768), first, "[500,500]", zoom=True)
    assert len(shown) == 1  # no pass 2
    assert (result.point, result.box, result.status, result.answer) == (None, None, status, first)
    assert (result.window, result.used_pass, len(result.passes)) == (None, 1, 1)
    assert result.to_dict()["zoom"] == {"fraction": 0.5, "window": None, "pass": 1,
                                        "passes": [result.passes[0].to_dict()]}


@pytest.mark.parametrize("second,status", [("[-1,-1]", "refused"), ("no idea", "malformed"),
                                           ("[1200, 30]", "malformed"), ("[]", "refused"),
                                           ("<think>at [500, 500]</think>", "malformed")])
@pytest.mark.parametrize("size,first,point", [((1366, 768), "[1000,0]", (1365, 0)), ((1079, 1921), "[250,750]", (269, 1440))])
def test_pass_2_without_a_point_falls_back_to_pass_1(second, status, size, first, point):
    result, shown, screen = two_passes(size, first, second, zoom=True)
    assert len(shown) == 2
    # pass 1's point: (floor(1366), floor(0)) → (1365, 0); (floor(269.75), floor(1440.75)) = (269, 1440)
    assert (result.point, result.status, result.answer, result.used_pass) == (point, "ok", first, 1)
    assert [p.status for p in result.passes] == ["ok", status] and result.passes[1].point is None
    assert result.window is not None  # the window was looked at, and is reported


def test_zoom_result_keeps_both_passes_and_the_old_keys():
    result, _, _ = two_passes((1366, 768), "[500,500]", "[250,250]", zoom=True)
    d = result.to_dict()
    one_pass, _, _ = two_passes((1366, 768), "[500,500]")
    assert list(one_pass.to_dict()) == ["point", "box", "status", "answer", "image_size", "format", "timing"]
    assert list(d) == ["point", "box", "status", "answer", "image_size", "format", "timing", "zoom"]
    assert d["point"] == [512, 288]  # floor(342 + 170.75), floor(192 + 96)
    assert d["zoom"]["passes"][0]["answer"] == "[500,500]" and d["zoom"]["passes"][1]["answer"] == "[250,250]"
    assert d["zoom"]["passes"][1]["image_size"] == [683, 384] and d["zoom"]["window"] == [342, 192, 1024, 575]
    assert d["timing"]["seconds"] == pytest.approx(sum(p.seconds for p in result.passes), abs=1e-3)


@pytest.mark.parametrize("zoom", [0, -0.5, 1.5, float("nan"), "half", [0.5]])
def test_bad_zoom_fractions(zoom):
    with pytest.raises(ValueError, match="in \\(0, 1\\]"):
        two_passes((100, 100), "[1,1]", zoom=zoom)


# ---------------------------------------------------------------------------------------------
# Through the real engine: a scripted-answer checkpoint
# ---------------------------------------------------------------------------------------------
SCRIPT = {"@absent": "[-1,-1]", "search field": "[200,200]", "camera icon": "[-1,-1]", "close button": "at the top"}


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    from mlx_qwen3vl import load

    folder = write_scripted_checkpoint(tmp_path_factory.mktemp("zoom-scripted"), SCRIPT, default="[500,500]")
    return folder, load(folder)


def test_ground_zoom_end_to_end(scripted):
    """Both passes answer [500,500] (the script reads the prompt's text, which both passes share):
    pass 2 on the window, its prompt's text before the screenshot served from pass 1's cache."""
    from mlx_qwen3vl import generate

    _, (model, processor) = scripted
    screen = _screen(1366, 768)
    result = agent.ground(model, processor, screen, "the Apply button", zoom=True)
    assert (result.point, result.window, result.used_pass) == ((683, 384), (342, 192, 1024, 575), 2)  # the first case
    first, second = result.passes
    assert (first.answer, second.answer, first.image_size, second.image_size) == (
        "[500,500]", "[500,500]", (1366, 768), (683, 384))
    # The grounding prompt puts the screenshot first: only "<|im_start|>user\n<|vision_start|>" is reusable.
    assert (first.cached_tokens, second.cached_tokens) == (0, 6)
    fresh = generate(model, processor, messages=agent.grounding_messages(screen[192:576, 342:1025], "the Apply button"),
                     max_tokens=128)
    assert (fresh.text, fresh.prompt_tokens) == (second.answer, second.prompt_tokens)
    assert result.prompt_tokens == first.prompt_tokens + second.prompt_tokens
    absent = agent.ground(model, processor, screen, "the Apply button @absent", zoom=True)
    assert (absent.status, absent.window, len(absent.passes)) == ("refused", None, 1)


def test_ground_cli_zoom_draws_the_window(scripted, tmp_path, capsys):
    folder, _ = scripted
    shot = tmp_path / "shot.png"
    Image.new("RGB", (1366, 768), (40, 40, 40)).save(shot)
    out_png = tmp_path / "marked.png"
    code = ground_cli.main(["--model", str(folder), "--image", str(shot), "--instruction", "the Apply button",
                            "--zoom", "--annotate", str(out_png)])
    out, err = capsys.readouterr()
    assert code == 0, err
    r = json.loads(out)
    assert (r["point"], r["status"], r["answer"]) == ([683, 384], "ok", "[500,500]")
    assert r["zoom"]["window"] == [342, 192, 1024, 575] and r["zoom"]["pass"] == 2
    assert [p["image_size"] for p in r["zoom"]["passes"]] == [[1366, 768], [683, 384]]
    assert r["timing"]["prompt_tokens"] == sum(p["timing"]["prompt_tokens"] for p in r["zoom"]["passes"])
    drawn = np.asarray(Image.open(out_png))
    for x, y in ((342, 300), (1024, 300), (700, 192), (700, 575)):  # the window's four sides
        assert tuple(drawn[y, x]) == WINDOW_COLOUR, (x, y)
    assert tuple(drawn[300, 341]) == (40, 40, 40) and tuple(drawn[100, 100]) == (40, 40, 40)
    assert (drawn[384, 683] != (40, 40, 40)).any()  # the point
    # Another fraction: a third of each side.
    code = ground_cli.main(["--model", str(folder), "--image", str(shot), "--instruction", "x", "--zoom", "0.25"])
    r = json.loads(capsys.readouterr().out)
    # w = ceil(341.5) = 342, h = 192: left = round(683 - 171) = 512, top = 384 - 96 = 288; x = floor(512 + 171) = 683
    assert code == 0 and r["zoom"]["window"] == [512, 288, 853, 479] and r["point"] == [683, 384]


@pytest.mark.parametrize("argv,needle", [
    (["--zoom", "0"], "--zoom 0.0: give the window's fraction"),
    (["--zoom", "2"], "--zoom 2.0"),
    (["--zoom", "--answer", "[1,1]"], "cannot go with --answer"),
])
def test_ground_cli_zoom_errors(argv, needle, capsys):
    code = ground_cli.main(["--image", str(MEDIA / "img_123x77.png"), "--instruction", "x", "--model",
                            "/nonexistent/model", *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1 and err.startswith("error: ") and needle in err, err


# ---------------------------------------------------------------------------------------------
# The evaluation: one pass and two passes side by side
# ---------------------------------------------------------------------------------------------
FIRST = {  # instruction → pass 1's answer (boxes and sizes: the JSONL)
    "the search field": "[200,200]",  # 300x200 → (60, 40), in [30,20,90,60]; pass 2 malformed: falls back, hit
    "the settings cog": "[300,450]",  # → (90, 90), just outside [100,100,150,150]: pass 2 fixes it
    "the top-left panel": "[0,0,500,500]",  # 90x260 → (22, 65), hit; pass 2 from the geometry: hit
    "the camera icon": "[-1,-1]",  # refused: no pass 2
    "the close button": "the close button is at the top right",  # malformed: no pass 2
    "the rocket launcher": "[-1,-1]",  # negative, refused: right, no pass 2
    "the unicorn badge": "[500,500]",  # negative, pointed: wrong; pass 2 refuses, falls back: still wrong
    "the OK label": "[500,500]",  # 123x77 → (61, 38), on the box's corner: hit; pass 2 is led astray: broken
}
SECOND = {"the search field": "hmm", "the OK label": "[0,0]"}  # answers pass 2 gives whatever the crop shows


class GeometryPredictor:
    """Pass 1 answers FIRST; pass 2 (a sample with a `window`) answers where the target's box
    centre lies in the crop, in 0-1000 of the crop, or [-1,-1] when the crop does not hold it, as a
    model that sees the crop perfectly would (SECOND overrides)."""

    def __init__(self, fail_after=None):
        self.calls, self.fail_after = [], fail_after

    def __call__(self, samples):
        if self.fail_after is not None and len(self.calls) >= self.fail_after:
            raise KeyboardInterrupt
        self.calls.append([(s["instruction"], s.get("window")) for s in samples])
        answers = []
        for s in samples:
            if "window" not in s:
                answers.append(FIRST[s["instruction"]])
                continue
            left, top, w, h = s["window"]
            full = np.asarray(Image.open(s["image"]).convert("RGB"))
            assert np.array_equal(s["pixels"], full[top:top + h, left:left + w])  # the crop, really
            if s["instruction"] in SECOND:
                answers.append(SECOND[s["instruction"]])
                continue
            if s["bbox"] is None:
                answers.append("[-1,-1]")
                continue
            cx, cy = (s["bbox"][0] + s["bbox"][2]) / 2, (s["bbox"][1] + s["bbox"][3]) / 2
            if not (left <= cx < left + w and top <= cy < top + h):
                answers.append("[-1,-1]")
                continue
            answers.append(f"[{round((cx - left) / w * 1000)},{round((cy - top) / h * 1000)}]")
        return answers


def _eval(argv, capsys, predictor):
    code = eval_grounding.main(argv + ["--no-progress"], predictor=predictor)
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 else None), err


def _acc(n, c):
    return {"samples": n, "correct": c, "accuracy": round(c / n, 4) if n else None}


def test_eval_zoom_side_by_side(tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    model = GeometryPredictor()
    code, report, err = _eval(["--data", str(DATA), "--output", str(out), "--zoom", "--batch-size", "4"], capsys, model)
    assert code == 0, err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    # Pass 2 ran for the samples whose pass 1 gave a point (search, cog, panel | unicorn, OK), one call per batch.
    assert [[i for i, w in call] for call in model.calls] == [
        ["the search field", "the settings cog", "the top-left panel", "the camera icon"],
        ["the search field", "the settings cog", "the top-left panel"],
        ["the close button", "the rocket launcher", "the unicorn badge", "the OK label"],
        ["the unicorn badge", "the OK label"]]
    z = {r["id"]: r["zoom"] for r in rows}
    # the settings cog: pass 1 (90, 90) on 300x200; window 150x100 at left = round(90 - 75) = 15, top = round(90 - 50) = 40;
    # the box centre (125, 125) is at ((125-15)/150, (125-40)/100) = [733, 850] of it → (floor(15 + 109.95), floor(40 + 85))
    assert z["web-icon-miss"]["window"] == [15, 40, 164, 139]
    assert [p["answer"] for p in z["web-icon-miss"]["passes"]] == ["[300,450]", "[733,850]"]
    assert [p["point"] for p in z["web-icon-miss"]["passes"]] == [[90, 90], [124, 125]]
    # the OK label: window 62x39 at left = round(61.5 - 31) = 31 (halves up), top = round(38.5 - 19.5) = 19;
    # pass 2's [0,0] is the window's corner (31, 19), outside [61,38,70,50].
    assert z["desktop-text-border-hit"]["window"] == [31, 19, 92, 57]
    assert z["desktop-text-border-hit"]["passes"][1]["point"] == [31, 19]
    assert [r["point"] for r in rows] == [[60, 40], [124, 125], [22, 65], None, None, None, [150, 100], [31, 19]]
    assert [r["zoom"]["pass"] for r in rows] == [1, 2, 2, 1, 1, 1, 1, 2]
    assert [len(r["zoom"]["passes"]) for r in rows] == [2, 2, 2, 1, 1, 1, 2, 2]
    assert [r["correct"] for r in rows] == [True, True, True, False, False, True, False, False]
    assert [r["zoom"]["passes"][0]["correct"] for r in rows] == [True, False, True, False, False, True, False, True]
    assert all(r["settings"] == {"zoom": 0.5} for r in rows)

    zoom = report["zoom"]
    assert zoom["fraction"] == 0.5
    assert (zoom["one_pass"]["correct"], zoom["two_pass"]["correct"]) == (4, 4)  # the same overall ...
    assert zoom["side_by_side"]["by_type"] == {  # ... but not per type
        "icon": {"samples": 3, "one_pass": 0.0, "two_pass": 0.3333},
        "text": {"samples": 3, "one_pass": 1.0, "two_pass": 0.6667}}
    assert zoom["side_by_side"]["by_platform"] == {
        "desktop": {"samples": 3, "one_pass": 0.6667, "two_pass": 0.3333},
        "mobile": {"samples": 2, "one_pass": 0.5, "two_pass": 0.5},
        "web": {"samples": 3, "one_pass": 0.3333, "two_pass": 0.6667}}
    assert zoom["side_by_side"]["all"] == {"samples": 8, "one_pass": 0.5, "two_pass": 0.5}
    assert zoom["one_pass"]["by_type"]["icon"] == _acc(3, 0) and zoom["two_pass"]["by_type"]["icon"] == _acc(3, 1)
    assert zoom["second_pass"] == {"ran": 5, "used": 3, "fell_back": 2, "not_run": 3}
    assert zoom["changed"] == {"fixed": 1, "broken": 1}
    s = zoom["seconds_per_sample"]
    assert s["two_pass"] == pytest.approx(s["one_pass"] + s["extra"], abs=2e-6) and s["extra"] >= 0
    # The report's main figures are the two-pass answers'.
    assert {k: report[k] for k in ("samples", "correct", "by_type")} == {
        k: zoom["two_pass"][k] for k in ("samples", "correct", "by_type")}


def test_eval_zoom_resumes_and_is_part_of_the_identity(tmp_path, capsys):
    out = str(tmp_path / "r.jsonl")
    code, _, err = _eval(["--data", str(DATA), "--output", out, "--zoom"], capsys, GeometryPredictor(fail_after=4))
    assert code == 130 and "resume" in err
    assert len(open(out).read().splitlines()) == 2  # two samples: each one's both passes are in its line
    rest = GeometryPredictor()
    code, report, err = _eval(["--data", str(DATA), "--output", out, "--zoom", "0.5"], capsys, rest)
    assert code == 0 and "resuming" in err and (report["evaluated_now"], report["resumed"]) == (6, 2)
    assert report["zoom"]["changed"] == {"fixed": 1, "broken": 1} and report["zoom"]["second_pass"]["ran"] == 5
    before = open(out).read()
    for argv, needle in ((["--zoom", "0.25"], "--zoom 0.5 (this run: 0.25)"), ([], "--zoom 0.5 (this run: None)")):
        code, _, err = _eval(["--data", str(DATA), "--output", out] + argv, capsys, GeometryPredictor())
        assert code == 2 and err.count("\n") == 1 and needle in err, err
    assert open(out).read() == before
    # A one-pass file is not resumed by a zoom run either.
    one = str(tmp_path / "one.jsonl")
    assert _eval(["--data", str(DATA), "--output", one, "--limit", "2"], capsys, GeometryPredictor())[0] == 0
    code, _, err = _eval(["--data", str(DATA), "--output", one, "--zoom"], capsys, GeometryPredictor())
    assert code == 2 and "--zoom None (this run: 0.5)" in err, err


def test_eval_zoom_bad_fraction(capsys):
    code, _, err = _eval(["--data", str(DATA), "--zoom", "1.5"], capsys, GeometryPredictor())
    assert code == 2 and err.startswith("error: --zoom 1.5") and err.count("\n") == 1


def test_eval_zoom_end_to_end_on_the_example_data(scripted, tmp_path, capsys):
    """`eval_grounding --zoom` with a model: the scripted checkpoint on the shipped JSONL (its
    screenshots are under the model's 65536-pixel minimum, so --min-pixels lowers it; the 123x77
    one's window then grows to hold 4096 pixels)."""
    folder, _ = scripted
    (tmp_path / "grounding").mkdir()
    (tmp_path / "media").symlink_to(MEDIA)
    data = tmp_path / "grounding" / DATA.name
    data.write_text(DATA.read_text())
    code = eval_grounding.main(["--model", str(folder), "--data", str(data), "--zoom", "--min-pixels", "4096",
                                "--batch-size", "3", "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads(out)
    default = tmp_path / "grounding" / f"screenspot_tiny.{folder.name}.venus.zoom0.5.results.jsonl"
    assert report["results"] == str(default)
    rows = {r["id"]: r for r in map(json.loads, default.read_text().splitlines())}
    assert rows["web-text-hit"]["settings"]["zoom"] == 0.5 and rows["web-text-hit"]["settings"]["min_pixels"] == 4096
    # the search field: [200,200] twice. Pass 1 (60, 40); window 150x100 at round(60 - 75) → 0, round(40 - 50) → 0;
    # pass 2 → (floor(200/1000*150), floor(200/1000*100)) = (30, 20): the box's corner, a hit.
    assert rows["web-text-hit"]["zoom"]["window"] == [0, 0, 149, 99]
    assert [p["point"] for p in rows["web-text-hit"]["zoom"]["passes"]] == [[60, 40], [30, 20]]
    # the OK label: [500,500] (no trigger: the default); window 81x51 at (21, 13) (see the 123x77 minimum case).
    assert rows["desktop-text-border-hit"]["zoom"]["window"] == [21, 13, 101, 63]
    assert rows["desktop-text-border-hit"]["point"] == [61, 38]
    assert [r["zoom"]["pass"] for r in rows.values()] == [2, 2, 2, 1, 1, 2, 2, 2]
    assert rows["mobile-icon-refused"]["status"] == "refused" and rows["desktop-icon-malformed"]["status"] == "malformed"
    zoom = report["zoom"]
    assert zoom["second_pass"] == {"ran": 6, "used": 6, "fell_back": 0, "not_run": 2}
    assert set(zoom["side_by_side"]) == {"all", "positive", "negative", "by_type", "by_platform"}
    assert zoom["one_pass"]["samples"] == zoom["two_pass"]["samples"] == 8
    assert zoom["seconds_per_sample"]["extra"] > 0


@pytest.mark.parametrize("orientation", [6, 8, 3, 5, 7])
def test_ground_with_reads_rotated_screenshots_upright(orientation):
    """The library's grounding on a JPEG stored 640x360 with an EXIF orientation: sizes, points and
    the zoom window are the upright image's. By hand on 360x640, [100, 200] is pixel (36, 128) and
    the half window around it is 180x320 at (0, 0); on 640x360 (turned half), (64, 72) and 320x180
    at (0, 0)."""
    from conftest import exif_image

    data = exif_image(640, 360, orientation)
    turned = orientation != 3
    hit = ground_with(lambda messages: "[100, 200]", data, "it", format="venus", zoom=True)
    assert (hit.width, hit.height) == ((360, 640) if turned else (640, 360))
    assert hit.passes[0].point == ((36, 128) if turned else (64, 72))
    assert hit.window == ((0, 0, 179, 319) if turned else (0, 0, 319, 179)) and hit.used_pass == 2
    # pass 2's [100, 200] of the crop, carried into the whole image: 100/1000 of 180 = 18, 200/1000 of 320 = 64
    assert hit.point == ((18, 64) if turned else (32, 36))
