"""The processor against transformers' Qwen3VLProcessor recordings (tests/fixtures/processor).

Recorded by tests/fixtures/make_processor_fixtures.py; no torch or network needed here.

Measured against the recordings (transformers 5.24, torch 2.14.1, Pillow 13, AVX2 CPU):
- chat text, input_ids, attention_mask, mm_token_type_ids and grids: identical in every case;
- image pixel_values vs the pillow backend: identical (max abs diff 0.0);
- image pixel_values vs the default torchvision backend: max abs diff 0.188 (24 uint8 levels at
  sharp edges, on up to 14% of values). That gap is between transformers' own two backends:
  pillow picks the order of its two resize passes itself (vertical first for some sizes) while
  torch always resizes width first, and both round to uint8 between the passes;
- video pixel_values vs transformers (torchvision is its only video backend): max abs diff
  0.0078 = one uint8 level (2/255 after normalization), on under 0.3% of values: pillow passes in
  torch's order, with pillow's int32 instead of torch's int16 fixed-point weights (two levels,
  0.0157, on the larger 1280x720 → 832x480 clip of benchmarks/bench_preprocess.py).
"""

import dataclasses
import importlib.util
import json
import socket
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mlx_qwen3vl import video as vid
from mlx_qwen3vl.errors import InputError
from mlx_qwen3vl.processor import Processor, extract_media, smart_resize

FIXTURES = Path(__file__).parent / "fixtures"
RECORDED = FIXTURES / "processor"
INPUTS = RECORDED / "inputs"
_spec = importlib.util.spec_from_file_location("make_processor_fixtures", FIXTURES / "make_processor_fixtures.py")
recorder = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(recorder)  # only numpy + pillow at import time: for its input resolvers

CASES = json.loads((RECORDED / "cases.json").read_text())["cases"]
SIZES = json.loads((RECORDED / "sizes.json").read_text())
TORCHVISION_IMAGE_MAX_DIFF = 24 / 127.5 + 1e-6  # see the module docstring
VIDEO_MAX_DIFF = 1 / 127.5 + 1e-6


@pytest.fixture(scope="module")
def processor():
    return Processor.from_pretrained(FIXTURES / "tokenizer")


def run(processor, case):
    """Our outputs for a recorded case: (chat text, processed dict)."""
    call = case.get("call", {})
    if case.get("video_processor"):  # the case's video config overrides, as the recorder applies them
        video_config = dataclasses.replace(processor.video_config, **case["video_processor"])
        processor = Processor(processor.tokenizer, processor.image_config, video_config, processor.chat_template)
    if case.get("chat"):
        messages = recorder.resolve(case["messages"], INPUTS)
        chat_text = processor.apply_chat_template(messages, tools=case.get("tools"))
        return chat_text, processor.apply_chat_template(messages, tools=case.get("tools"), tokenize=True, **call)
    images, videos = recorder.resolve_case_inputs(case, INPUTS)
    chat_text = processor.apply_chat_template(case.get("batch") or case["messages"], tools=case.get("tools"))
    return chat_text, processor(text=chat_text, images=images or None, videos=videos or None, **call)


@pytest.fixture(scope="module")
def outputs(processor):
    return {case["name"]: run(processor, case) for case in CASES}


def recorded(name):
    return dict(np.load(RECORDED / f"{name}.npz"))


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_tokens_and_grids_match_transformers(case, outputs):
    chat_text, out = outputs[case["name"]]
    ref = recorded(case["name"])
    assert chat_text == case["expected_text"]
    for key in ("input_ids", "attention_mask", "mm_token_type_ids", "image_grid_thw", "video_grid_thw"):
        assert (key in out) == (key in ref), key
        if key in ref:
            assert out[key].shape == ref[key].shape, key
            np.testing.assert_array_equal(out[key], ref[key], err_msg=key)


IMAGE_CASES = [c["name"] for c in CASES if "pixel_values_levels" in np.load(RECORDED / f"{c['name']}.npz")]
VIDEO_CASES = [c["name"] for c in CASES if "pixel_values_videos_levels" in np.load(RECORDED / f"{c['name']}.npz")]


@pytest.mark.parametrize("name", IMAGE_CASES)
def test_image_pixels_match_pillow_backend(name, outputs):
    ref = recorded(name)
    expected = ref["pixel_values_table"][ref["pixel_values_levels"]]
    got = outputs[name][1]["pixel_values"]
    assert got.dtype == np.float32 and got.shape == expected.shape
    assert np.abs(got - expected).max() <= 1e-5


@pytest.mark.parametrize("name", IMAGE_CASES)
def test_image_pixels_within_torchvision_backend_rounding(name, outputs):
    ref = recorded(name)
    tv_levels = ref["pixel_values_levels"].astype(np.int16) + ref["tv_pixel_values_delta"]
    expected = ref["tv_pixel_values_table"][tv_levels]
    assert np.abs(outputs[name][1]["pixel_values"] - expected).max() <= TORCHVISION_IMAGE_MAX_DIFF


@pytest.mark.parametrize("name", VIDEO_CASES)
def test_video_pixels_match_transformers_within_one_level(name, outputs):
    ref = recorded(name)
    expected = ref["pixel_values_videos_table"][ref["pixel_values_videos_levels"]]
    got = outputs[name][1]["pixel_values_videos"]
    assert got.dtype == np.float32 and got.shape == expected.shape
    diff = np.abs(got - expected)
    assert diff.max() <= VIDEO_MAX_DIFF
    assert (diff > 1e-6).mean() < 0.01


def test_image_sizes_match_reference_smart_resize():
    for h, w, mn, mx, rh, rw in SIZES["image_smart_resize"]:
        assert smart_resize(h, w, 32, mn, mx) == (rh, rw), (h, w, mn, mx)


@pytest.mark.parametrize("cap", [True, False])
def test_video_patch_counts_match_reference_with_and_without_frame_cap(processor, cap):
    cfg = processor.video_config
    assert cfg.cap_pixels_per_frame  # our default: qwen-vl-utils' cap
    for t, h, w, n_capped, n_uncapped in SIZES["video_num_patches"]:
        budget = vid.frame_pixel_budget(t, cfg, cap)
        rh, rw = vid.smart_resize(h, w, cfg.factor, cfg.min_pixels, budget, t, cfg.temporal_patch_size)
        grid_t = -(-t // cfg.temporal_patch_size)
        assert grid_t * (rh // 16) * (rw // 16) == (n_capped if cap else n_uncapped), (t, h, w)


def test_frame_cap_option_reaches_the_pixels(processor):
    """Off per call, per processor (from_pretrained) or per config: all equal transformers' uncapped run."""
    clip = recorder.resolve("@npy:clip40.npz", INPUTS)
    uncapped = recorded("video_uncapped")
    assert not np.array_equal(uncapped["video_grid_thw"], recorded("video_capped")["video_grid_thw"])
    small = dataclasses.replace(processor.video_config, max_video_tokens=8)
    per_config = Processor(processor.tokenizer, processor.image_config,
                           dataclasses.replace(small, cap_pixels_per_frame=False))
    np.testing.assert_array_equal(per_config(videos=[clip], source_fps=10)["video_grid_thw"],
                                  uncapped["video_grid_thw"])
    loaded = Processor.from_pretrained(FIXTURES / "tokenizer", cap_pixels_per_frame=False)
    assert not loaded.video_config.cap_pixels_per_frame
    cfg = vid.VideoConfig.from_dict({"cap_pixels_per_frame": False, "max_video_tokens": 8})
    assert not cfg.cap_pixels_per_frame and cfg.max_video_tokens == 8


def test_video_timestamps_follow_the_sampled_frames(outputs, processor):
    text = processor.decode(outputs["video_sampled"][1]["input_ids"][0], skip_special_tokens=False)
    # 40 frames at 10 fps sampled at 2 fps: frames 0, 6, 11, 17, 22, 28, 33, 39
    assert "<0.3 seconds>" in text and "<3.6 seconds>" in text and text.count("seconds>") == 4


# ---------------------------------------------------------------------------- API


def test_special_token_ids_and_decode(processor):
    tok = processor.tokenizer
    assert processor.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    assert processor.video_token_id == tok.convert_tokens_to_ids("<|video_pad|>")
    assert processor.vision_start_token_id == tok.convert_tokens_to_ids("<|vision_start|>")
    assert processor.vision_end_token_id == tok.convert_tokens_to_ids("<|vision_end|>")
    ids = processor(text="Hello<|im_end|>")["input_ids"]
    assert processor.decode(ids[0]) == "Hello"
    assert processor.decode(ids[0], skip_special_tokens=False) == "Hello<|im_end|>"
    assert processor.batch_decode(ids) == ["Hello"]


def test_extract_media_in_conversation_order():
    img = np.zeros((40, 40, 3), np.uint8)
    frames = np.zeros((4, 40, 40, 3), np.uint8)
    messages = [
        {"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "text", "text": "x"}]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/b.png"}},
            {"type": "video", "video": frames},
            {"image": img},
            {"type": "image"},
        ]},
    ]
    images, videos = extract_media(messages)
    assert images[:2] == ["a.png", "https://example.com/b.png"] and images[2] is img and len(images) == 3
    assert len(videos) == 1 and videos[0] is frames


def test_bare_placeholders_take_media_from_arguments(processor, outputs):
    case = next(c for c in CASES if c["name"] == "odd_size")
    images, _ = recorder.resolve_case_inputs(case, INPUTS)
    out = processor.apply_chat_template(case["messages"], tokenize=True, images=images)
    np.testing.assert_array_equal(out["input_ids"], outputs["odd_size"][1]["input_ids"])


def test_mlx_tensors(processor, outputs):
    mx = pytest.importorskip("mlx.core")
    case = next(c for c in CASES if c["name"] == "image_and_video")
    images, videos = recorder.resolve_case_inputs(case, INPUTS)
    text = outputs["image_and_video"][0]
    out = processor(text=text, images=images, videos=videos, return_tensors="mlx", **case["call"])
    ref = outputs["image_and_video"][1]
    assert set(out) == set(ref)
    for key, value in out.items():
        assert isinstance(value, mx.array)
        np.testing.assert_array_equal(np.array(value), ref[key])
    assert out["input_ids"].dtype == mx.int32 and out["pixel_values"].dtype == mx.float32


def test_image_input_kinds_agree(processor):
    path = INPUTS / "a.png"
    rgb = np.asarray(Image.open(path).convert("RGB"))
    data_url = recorder.resolve("@dataurl:a.png", INPUTS)
    kinds = (str(path), path, Image.open(path), rgb, data_url, path.read_bytes())
    results = [processor.process_images([x])[0] for x in kinds]
    for r in results[1:]:
        np.testing.assert_array_equal(r, results[0])


def test_video_file_matches_its_decoded_frames(processor, tmp_path):
    av = pytest.importorskip("av")
    clip = recorder.resolve("@npy:clip40.npz", INPUTS)[:, :64, :96]  # even sizes for the encoder
    path = tmp_path / "clip.mkv"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("ffv1", rate=10)  # lossless: decoded frames equal the input
        stream.width, stream.height, stream.pix_fmt = 96, 64, "bgr0"
        for f in clip:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        container.mux(stream.encode())
    from_file = processor(videos=[str(path)])
    from_frames = processor(videos=[clip], source_fps=10)
    np.testing.assert_array_equal(from_file["video_grid_thw"], from_frames["video_grid_thw"])
    np.testing.assert_array_equal(from_file["pixel_values_videos"], from_frames["pixel_values_videos"])


def test_chat_template_from_json_when_no_jinja(tmp_path, processor):
    for f in (FIXTURES / "tokenizer").iterdir():
        if f.name != "chat_template.jinja":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": processor.chat_template}))
    other = Processor.from_pretrained(tmp_path)
    messages = CASES[0]["messages"]
    assert other.apply_chat_template(messages) == processor.apply_chat_template(messages)


# ---------------------------------------------------------------------------- bad inputs


def one_line_error(fn, *words):
    with pytest.raises(InputError) as info:
        fn()
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message
    return message


def prompt(processor, n_images=0, n_videos=0):
    content = [{"type": "image"}] * n_images + [{"type": "video"}] * n_videos + [{"type": "text", "text": "?"}]
    return processor.apply_chat_template([{"role": "user", "content": content}])


def test_unreadable_image_file(processor, tmp_path):
    bad = tmp_path / "not_an_image.png"
    bad.write_bytes(b"this is not a png")
    one_line_error(lambda: processor(text=prompt(processor, 1), images=[str(bad)]), "not_an_image.png")


def test_truncated_image_file(processor, tmp_path):
    data = (INPUTS / "odd.png").read_bytes()
    cut = tmp_path / "truncated.png"
    cut.write_bytes(data[: len(data) // 2])
    one_line_error(lambda: processor(text=prompt(processor, 1), images=[str(cut)]), "truncated.png")


def test_missing_image_file(processor, tmp_path):
    one_line_error(lambda: processor(text=prompt(processor, 1), images=[str(tmp_path / "nope.png")]), "nope.png")


@pytest.mark.parametrize("image", [np.zeros((0, 10, 3), np.uint8), Image.new("RGB", (0, 5))], ids=["array", "pil"])
def test_zero_size_image(processor, image):
    one_line_error(lambda: processor(text=prompt(processor, 1), images=[image]), "zero size")


def test_aspect_ratio_above_200(processor):
    thin = np.zeros((2, 403, 3), np.uint8)
    one_line_error(lambda: processor(text=prompt(processor, 1), images=[thin]), "image 1", "aspect ratio")


def test_more_placeholders_than_images(processor):
    img = np.zeros((40, 40, 3), np.uint8)
    one_line_error(lambda: processor(text=prompt(processor, 2), images=[img]), "2 <|image_pad|>", "1 image")


def test_fewer_placeholders_than_images(processor):
    img = np.zeros((40, 40, 3), np.uint8)
    one_line_error(lambda: processor(text=prompt(processor, 1), images=[img, img]), "1 <|image_pad|>", "2 image")


def test_video_placeholder_count(processor):
    one_line_error(lambda: processor(text=prompt(processor, 0, 1)), "<|video_pad|>", "0 video")


@pytest.mark.parametrize("sample", [True, False])
def test_video_shorter_than_temporal_patch(processor, sample):
    one_frame = np.zeros((1, 64, 64, 3), np.uint8)
    one_line_error(
        lambda: processor(text=prompt(processor, 0, 1), videos=[one_frame], sample_frames=sample), "temporal patch"
    )


def test_unknown_content_type(processor):
    messages = [{"role": "user", "content": [{"type": "audio", "audio": "x.wav"}, {"type": "text", "text": "?"}]}]
    one_line_error(lambda: processor.apply_chat_template(messages), "'audio'")


def test_unsupported_image_object(processor):
    one_line_error(lambda: processor(text=prompt(processor, 1), images=[12345]), "image 1")


def test_unreachable_url(processor):
    with socket.socket() as s:  # a port nothing listens on: connection refused, no network needed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/screen.png"
    one_line_error(lambda: processor(text=prompt(processor, 1), images=[url]), url, "could not be fetched")


def test_video_file_without_pyav(processor, tmp_path, monkeypatch):
    path = tmp_path / "clip.mp4"
    path.write_bytes(b"\x00" * 16)
    monkeypatch.setitem(sys.modules, "av", None)  # makes `import av` fail
    call = lambda: processor(text=prompt(processor, 0, 1), videos=[str(path)])  # noqa: E731
    one_line_error(call, "clip.mp4", 'pip install "mlx-qwen3vl[video]"')
