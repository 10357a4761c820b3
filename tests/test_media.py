"""Image inputs (mlx_qwen3vl/media.py) and the checks at the processor's edges.

Pixels are compared with transformers' pillow-backend image processor (Qwen2VLImageProcessorPil,
which runs without torch) given the equivalent PIL image: every source we accept must give what
transformers gives for the image the user meant.
"""

import base64
import http.server
import importlib.util
import io
import os
import struct
import threading
import urllib.parse
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mlx_qwen3vl import media
from mlx_qwen3vl.errors import ConfigError, InputError
from mlx_qwen3vl.processor import ImageConfig, Processor

FIXTURES = Path(__file__).parent / "fixtures"
_spec = importlib.util.spec_from_file_location("make_processor_fixtures", FIXTURES / "make_processor_fixtures.py")
recorder = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(recorder)  # for its synthetic screenshot generator


@pytest.fixture(scope="module")
def processor():
    return Processor.from_pretrained(FIXTURES / "tokenizer")


@pytest.fixture(scope="module")
def reference():
    """transformers' pillow-backend image processor: PIL image → (pixel_values, image_grid_thw)."""
    module = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    ref = module.Qwen2VLImageProcessorPil.from_pretrained(str(FIXTURES / "tokenizer"))

    def run(image):
        out = ref(images=[image], return_tensors="np")
        return np.asarray(out["pixel_values"]), np.asarray(out["image_grid_thw"])

    return run


def screenshot(width=150, height=110, seed=3):
    return recorder.synthetic(width, height, seed)


def png_bytes(image, **save):
    buf = io.BytesIO()
    image.save(buf, format="PNG", **save)
    return buf.getvalue()


def raw_png(array, color_type, extra_chunks=()):
    """A 16-bit PNG written by hand (Pillow cannot write 16-bit colour or LA): big-endian samples."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    height, width = array.shape[:2]
    rows = b"".join(b"\x00" + row.astype(">u2").tobytes() for row in array)
    header = struct.pack(">IIBBBBB", width, height, 16, color_type, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + b"".join(chunk(k, d) for k, d in extra_chunks)
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


def sources(data, tmp_path, name):
    """The same encoded image as every string/bytes source we accept."""
    path = tmp_path / name
    path.write_bytes(data)
    b64 = base64.b64encode(data).decode()
    return {"path": str(path), "pathlib": path, "bytes": data, "data_url": "data:image/png;base64," + b64,
            "data_url_no_subtype": "data:image;base64," + b64}


def assert_same(ours, theirs):
    np.testing.assert_array_equal(ours[1], theirs[1])
    np.testing.assert_array_equal(ours[0], theirs[0])


def error(fn):
    with pytest.raises(InputError) as info:
        fn()
    message = str(info.value)
    assert "\n" not in message
    return message


# ---------------------------------------------------------------------------- transparency


def transparent_pngs():
    base = screenshot()
    alpha = Image.fromarray(np.tile(np.linspace(0, 255, base.width).astype(np.uint8), (base.height, 1)))
    rgba = base.copy()
    rgba.putalpha(alpha)
    la = base.convert("L")
    la.putalpha(alpha)
    keyed = base.copy()
    keyed.paste((10, 200, 30), (20, 15, 120, 90))  # a solid block in the key colour
    palette = keyed.convert("P", palette=Image.Palette.ADAPTIVE, colors=32)
    index = int(np.bincount(np.asarray(palette).ravel()).argmax())
    grey = keyed.convert("L")
    grey_key = int(np.bincount(np.asarray(grey).ravel()).argmax())
    v = np.asarray(rgba).astype(np.uint16) * 257 + 100  # 16-bit samples whose high byte is the 8-bit image
    return {
        "palette_trns": png_bytes(palette, transparency=index),
        "rgb_colour_key": png_bytes(keyed, transparency=(10, 200, 30)),
        "grey_colour_key": png_bytes(grey, transparency=grey_key),
        "la": png_bytes(la),
        "rgba": png_bytes(rgba),
        "la16": raw_png(np.stack([v[..., 0], v[..., 3]], -1), 4),
        "rgba64": raw_png(v, 6),
    }


@pytest.mark.parametrize("kind", list(transparent_pngs()))
def test_transparent_png_is_composited_onto_white_from_every_source(processor, reference, tmp_path, kind):
    data = transparent_pngs()[kind]
    theirs = reference(Image.open(io.BytesIO(data)))  # transformers composites a PIL image onto white
    # what ignoring the transparency gives (an array: Pillow's convert("RGB") keeps a colour key in .info)
    dropped = reference(Image.fromarray(np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))))
    assert np.abs(theirs[0] - dropped[0]).max() > 0.5  # the transparency matters in this image
    for source, x in sources(data, tmp_path, f"{kind}.png").items():
        ours = processor.process_images([x])
        assert_same(ours, theirs)
    assert_same(processor.process_images([Image.open(io.BytesIO(data))]), theirs)


def test_http_url_takes_the_same_path(processor, reference):
    data = transparent_pngs()["palette_trns"]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    server.timeout = 10
    thread = threading.Thread(target=server.handle_request)  # exactly one request
    thread.start()
    try:
        ours = processor.process_images([f"http://127.0.0.1:{server.server_port}/screen.png"])
    finally:
        thread.join(15)
        server.server_close()
    assert_same(ours, reference(Image.open(io.BytesIO(data))))


# ---------------------------------------------------------------------------- 16-bit


def sixteen_bit_pngs():
    """16-bit PNGs and the 8-bit image each stands for (its high byte)."""
    rgb = np.asarray(screenshot(seed=5)).astype(np.uint16)
    v = rgb * 257 + 200  # full 16-bit range; high byte = the 8-bit level
    grey16 = v[..., 1]
    grey_buf = io.BytesIO()
    Image.fromarray(grey16).save(grey_buf, format="PNG")  # Pillow writes I;16
    alpha8 = (np.arange(v.shape[1]) * 255 // (v.shape[1] - 1)).astype(np.uint16)[None].repeat(v.shape[0], 0)
    key = int(grey16[0, 0])
    keyed_alpha = np.where(grey16 == key, 0, 255).astype(np.uint8)
    eight = (v >> 8).astype(np.uint8)
    return {
        "grey16": (grey_buf.getvalue(), Image.fromarray(eight[..., 1])),
        "grey16_colour_key": (raw_png(grey16, 0, [(b"tRNS", struct.pack(">H", key))]),
                              Image.merge("LA", (Image.fromarray(eight[..., 1]), Image.fromarray(keyed_alpha)))),
        "rgb48": (raw_png(v, 2), Image.fromarray(eight)),
        "la16": (raw_png(np.stack([grey16, alpha8 * 257], -1), 4),
                 Image.merge("LA", (Image.fromarray(eight[..., 1]), Image.fromarray(alpha8.astype(np.uint8))))),
    }


@pytest.mark.parametrize("kind", list(sixteen_bit_pngs()))
def test_16_bit_pngs_are_scaled_to_8_bit(processor, reference, tmp_path, kind):
    data, eight_bit = sixteen_bit_pngs()[kind]
    theirs = reference(eight_bit)
    for x in (*sources(data, tmp_path, f"{kind}.png").values(), Image.open(io.BytesIO(data))):
        assert_same(processor.process_images([x]), theirs)


def test_16_bit_grey_differs_from_transformers_on_purpose(processor, reference, tmp_path):
    """transformers converts I;16 with Pillow's clipping: almost all white. README says we differ."""
    data, eight_bit = sixteen_bit_pngs()["grey16"]
    washed_out = reference(Image.open(io.BytesIO(data)))[0]
    assert (washed_out == 1.0).mean() > 0.9
    ours = processor.process_images([data])[0]
    assert (ours == 1.0).mean() < 0.1


def test_16_bit_arrays_are_scaled_too(processor):
    rgb = np.asarray(screenshot())
    wide = rgb.astype(np.uint16) * 256 + 255  # high byte: the 8-bit level
    np.testing.assert_array_equal(processor.process_images([wide])[0], processor.process_images([rgb])[0])


# ---------------------------------------------------------------------------- large images


def test_pillow_bomb_warning_is_silenced(processor, monkeypatch):
    data = png_bytes(screenshot(40, 40))
    expected = processor.process_images([data])[0]
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # Pillow now warns at 1000 pixels (40x40 = 1600)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_array_equal(processor.process_images([data])[0], expected)


def huge_png_header(width, height):
    """A PNG that claims a huge size (its pixel data is absent: it must never be decoded)."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


@pytest.mark.parametrize("width, height", [(12000, 10000), (20000, 20000)])  # below / above Pillow's error
def test_too_large_image_is_refused_with_our_limit(processor, tmp_path, width, height):
    path = tmp_path / "huge.png"
    path.write_bytes(huge_png_header(width, height))
    for x in (str(path), path.read_bytes()):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            message = error(lambda: processor.process_images([x]))
        assert message.startswith("image 1") and f"over the {media.MAX_IMAGE_PIXELS:,} pixels" in message, message
        assert "bomb" not in message.lower() and "DOS" not in message, message
        if width * height < 2 * Image.MAX_IMAGE_PIXELS:
            assert f"{width}x{height}" in message, message


# ---------------------------------------------------------------------------- error messages


def test_errors_count_images_from_1_and_show_no_object_addresses(processor):
    good = np.zeros((40, 40, 3), np.uint8)
    message = error(lambda: processor.process_images([good, b"not an image at all"]))
    assert message.startswith("image 2 (bytes)"), message
    assert " at 0x" not in message and "_io." not in message, message
    message = error(lambda: processor.process_images([good, good, io.BytesIO(b"x")]))
    assert message.startswith("image 3 (BytesIO)") and " at 0x" not in message, message


def test_errors_count_videos_and_frames_from_1(processor):
    frames = [np.zeros((40, 40, 3), np.uint8), "no-such-frame.png"]
    message = error(lambda: processor.process_videos([np.zeros((4, 40, 40, 3), np.uint8), frames]))
    assert message.startswith("video 2 frame 2 'no-such-frame.png'"), message


@pytest.mark.parametrize("fps", [0, -1, float("nan"), float("inf"), "24", True])
def test_source_fps_must_be_a_frame_rate(processor, fps):
    """0 divided by zero, -1 sampled min_frames silently: each is one line naming source_fps."""
    clip = np.zeros((4, 40, 40, 3), np.uint8)
    for call in (lambda: processor.process_videos([clip], source_fps=fps),
                 lambda: processor.process_videos([clip, clip], source_fps=[24, fps]),
                 lambda: processor(text="<|vision_start|><|video_pad|><|vision_end|>?", videos=[clip], source_fps=fps)):
        message = error(call)
        assert message.startswith(f"source_fps={fps!r} is not a frame rate"), message
    assert processor.process_videos([clip], source_fps=np.float32(2.5))[1].shape == (1, 3)


def test_errors_count_messages_and_items_from_1(processor):
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "audio", "audio": "x"}]}]
    assert "message 1 content item 2" in error(lambda: processor.apply_chat_template(messages))


# ---------------------------------------------------------------------------- file kinds


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_paths_that_are_not_regular_files_are_refused_unread(processor, tmp_path):
    fifo = tmp_path / "screen.png"
    os.mkfifo(fifo)  # reading it would block forever: no writer
    link = tmp_path / "link.png"
    link.symlink_to(fifo)
    cases = {str(fifo): "FIFO", str(link): "FIFO", str(tmp_path): "directory"}
    if os.path.exists("/dev/zero"):
        cases["/dev/zero"] = "character device"  # reading it would never end
    for path, kind in cases.items():
        message = error(lambda: processor.process_images([path]))
        assert kind in message and "not a regular file" in message, message
    message = error(lambda: processor.process_videos([str(fifo)]))
    assert message.startswith("video 1") and "FIFO" in message, message


def test_missing_path_names_what_is_accepted(processor, tmp_path):
    message = error(lambda: processor.process_images([str(tmp_path / "nope.png")]))
    assert "nope.png" in message and "http(s) URL or data: URL" in message


def test_data_url_without_base64_is_percent_decoded(processor):
    data = png_bytes(screenshot(40, 30))
    url = "data:image/png," + urllib.parse.quote_from_bytes(data)
    assert_same(processor.process_images([url]), processor.process_images([data]))


def test_bad_data_urls(processor):
    assert "not valid base64" in error(lambda: processor.process_images(["data:image/png;base64,!!!"]))
    assert "no comma" in error(lambda: processor.process_images(["data:image/png;base64"]))


# ---------------------------------------------------------------------------- pixel budgets


@pytest.mark.parametrize("kw, words", [
    (dict(min_pixels=0), ["min_pixels=0", "1 <= min_pixels <= max_pixels"]),
    (dict(min_pixels=-5), ["min_pixels=-5", "1 <= min_pixels"]),
    (dict(max_pixels=0), ["max_pixels=0", "max_pixels >= 1024"]),
    (dict(max_pixels=-1), ["max_pixels=-1", ">= 1024"]),
    (dict(min_pixels=200_000, max_pixels=100_000), ["min_pixels=200000", "max_pixels (100000)"]),
    (dict(max_pixels=1.5e5 + 0.5), ["max_pixels=150000.5", "not an integer"]),
    (dict(min_pixels="4096"), ["min_pixels='4096'", "not an integer"]),
    (dict(max_pixels=True), ["max_pixels=True", "not an integer"]),
    (dict(max_pixels=float("nan")), ["max_pixels=nan", "not an integer"]),
])
def test_pixel_budgets_are_validated_where_they_enter(processor, kw, words):
    image = np.zeros((40, 40, 3), np.uint8)
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}])
    calls = [
        lambda: processor(text=text, images=[image], **kw),
        lambda: processor(text="no images here", **kw),  # refused even when no image would use it
        lambda: processor.process_images([image], **kw),
    ]
    for call in calls:
        message = error(call)
        for word in words:
            assert word in message, message


def test_integral_pixel_budgets_are_accepted(processor):
    image = np.asarray(screenshot())
    a = processor.process_images([image], min_pixels=4096, max_pixels=65536)
    b = processor.process_images([image], min_pixels=np.int64(4096), max_pixels=65536.0)
    assert_same(a, b)


def test_config_pixel_budgets_are_validated_and_precedence_is_transformers():
    with pytest.raises(ConfigError, match="min_pixels=0"):
        ImageConfig.from_dict({"size": {"shortest_edge": 0, "longest_edge": 65536}})
    both = {"size": {"shortest_edge": 4096, "longest_edge": 65536}, "min_pixels": 1024, "max_pixels": 32768}
    cfg = ImageConfig.from_dict(both)  # images: the legacy top-level keys win, as transformers' image processor
    assert (cfg.min_pixels, cfg.max_pixels) == (1024, 32768)
    from mlx_qwen3vl.video import VideoConfig

    cfg = VideoConfig.from_dict(both)  # videos: size only, as transformers' Qwen3-VL video processor
    assert (cfg.min_pixels, cfg.max_pixels) == (4096, 65536)


# ---------------------------------------------------------------------------- placeholder tokens in text


@pytest.mark.parametrize("token", ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"])
def test_vision_tokens_in_message_text_are_refused(processor, token):
    image = np.zeros((40, 40, 3), np.uint8)
    block = [{"role": "user", "content": [{"type": "image", "image": image},
                                          {"type": "text", "text": f"what is {token} here?"}]}]
    plain = [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"say {token}"}]
    for messages, where in ((block, "message 1 content item 2"), (plain, "message 2's text")):
        for call in (lambda: processor.apply_chat_template(messages),
                     lambda: processor.apply_chat_template(messages, tokenize=True)):
            message = error(call)
            assert where in message and token in message, message


def test_other_special_looking_text_is_plain_text(processor):
    messages = [{"role": "user", "content": "the <|image|> tag and <|vision_pad"}]
    out = processor.apply_chat_template(messages, tokenize=True)
    assert (out["mm_token_type_ids"] == 0).all()


def test_one_sided_pixel_budget_moves_the_configs_other_bound():
    """max_pixels below the config's min_pixels (or min_pixels above its max) is a request for
    smaller (larger) images, not a contradiction: the config's other bound follows it."""
    from mlx_qwen3vl.processor import ImageConfig, image_budget

    cfg = ImageConfig(min_pixels=65536, max_pixels=1 << 20)
    assert image_budget(cfg, max_pixels=4096) == (4096, 4096)
    assert image_budget(cfg, min_pixels=1 << 21) == (1 << 21, 1 << 21)
    assert image_budget(cfg, max_pixels=1 << 19) == (65536, 1 << 19)
    with pytest.raises(InputError, match="min_pixels=8192 is outside"):
        image_budget(cfg, min_pixels=8192, max_pixels=4096)


# ---------------------------------------------------------------------------- formats by content

EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nnewpath 0 0 moveto 10 10 lineto stroke\n%%EOF\n"


def test_only_listed_image_formats_are_decoded_whatever_the_source(processor, tmp_path, monkeypatch):
    """EPS (Pillow would hand it to Ghostscript), PSD, PPM, ICO...: refused by content from bytes,
    data URLs and paths alike, and Pillow's plugins for them are never entered."""
    from PIL import EpsImagePlugin

    entered = []
    monkeypatch.setattr(EpsImagePlugin.EpsImageFile, "_open", lambda self: entered.append(1))
    others = {"eps": EPS}
    for fmt in ("PPM", "ICO", "TGA", "PCX"):
        buf = io.BytesIO()
        Image.new("RGB", (8, 8), (1, 2, 3)).save(buf, format=fmt)
        others[fmt.lower()] = buf.getvalue()
    for name, data in others.items():
        path = tmp_path / "picture.png"  # the name says PNG; the bytes decide
        path.write_bytes(data)
        for x in (data, "data:image/png;base64," + base64.b64encode(data).decode(), str(path)):
            message = error(lambda: processor.process_images([x]))
            assert "is not a PNG, JPEG, WebP, GIF, BMP or TIFF image" in message, (name, message)
    assert entered == []
    for fmt in ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"):
        buf = io.BytesIO()
        Image.new("RGB", (40, 30), (10, 200, 30)).save(buf, format=fmt)
        assert media.load_image(buf.getvalue()).shape == (30, 40, 3), fmt
        assert media.image_size(buf.getvalue()) == (40, 30)


def test_playlists_and_raw_streams_are_not_videos(processor, tmp_path):
    """An ffconcat or HLS playlist (which make FFmpeg open the files or URLs they name) and a raw
    elementary stream are refused by their first bytes, whatever their name."""
    from conftest import write_fixture_video

    write_fixture_video(tmp_path)  # clip.mkv, which the playlists name
    texts = {"list.mp4": b"ffconcat version 1.0\nfile clip.mkv\n",
             "list.m3u8": b"#EXTM3U\n#EXT-X-TARGETDURATION:1\n#EXTINF:1,\nclip.mkv\n#EXT-X-ENDLIST\n",
             "raw.m4v": b"\x00\x00\x01\xb0\x01\x00\x00\x01\xb5\x89\x13\x00\x00\x01\x00\x00"}
    for name, data in texts.items():
        (tmp_path / name).write_bytes(data)
        message = error(lambda: processor.process_videos([str(tmp_path / name)]))
        assert "is not a MP4/MOV, WebM/MKV or AVI file" in message, message


def test_video_without_a_frame_count_holds_only_its_sampled_frames(processor, tmp_path):
    """Matroska states no frame count: the frames are counted from the packets, and only the
    sampled ones are converted and kept (as with a count), never the whole clip. The clip equals
    the one sampled from every decoded frame."""
    import tracemalloc

    av = pytest.importorskip("av")
    from mlx_qwen3vl import video as vid

    path, n, size = tmp_path / "long.mkv", 480, 64
    with av.open(str(path), "w") as container:
        stream = container.add_stream("ffv1", rate=24)
        stream.width = stream.height = size
        stream.pix_fmt = "gray"
        for i in range(n):
            frame = np.full((size, size), i % 251, np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="gray")))
        container.mux(stream.encode())
    with av.open(str(path)) as c:
        assert c.streams.video[0].frames == 0
        every = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    want = vid.clip_from_frames(every, 24, True, processor.video_config)
    del every
    assert vid.probe_video(path).frames == n and vid.probe_video(path, max_frames=10).frames == 11
    tracemalloc.start()
    clip = vid.read_video_file(path, None, True, processor.video_config)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert clip.indices == want.indices and len(clip.indices) == n // 24 * 2
    assert all(np.array_equal(a, b) for a, b in zip(clip.frames, want.frames))
    assert peak < 3 * len(clip.frames) * size * size * 3  # the kept frames (and change), not all n


def _exif_after_image_data(png: bytes, orientation: int) -> bytes:
    """A PNG whose eXIf chunk comes after IDAT (Pillow reads it only when it decodes)."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    body = exif.tobytes()[6:]  # without the "Exif\\0\\0" header, as the chunk holds it
    chunk = struct.pack(">I", len(body)) + b"eXIf" + body + struct.pack(">I", zlib.crc32(b"eXIf" + body))
    return png[:-12] + chunk + png[-12:]  # before IEND


@pytest.mark.parametrize("orientation", range(1, 9))
def test_image_size_is_the_upright_size_from_every_source(orientation, tmp_path):
    """media.image_size, read from the header alone, is the size load_image decodes to (EXIF
    orientation applied) for every format that carries the tag and every source."""
    from conftest import exif_image

    upright = (360, 640) if orientation in (5, 6, 7, 8) else (640, 360)
    plain = io.BytesIO()
    Image.fromarray(np.zeros((360, 640, 3), np.uint8)).save(plain, format="PNG")
    encoded = {f: exif_image(640, 360, orientation, format=f) for f in ("JPEG", "PNG", "WEBP", "TIFF", "MPO")}
    encoded["PNG, eXIf after IDAT"] = _exif_after_image_data(plain.getvalue(), orientation)
    for name, data in encoded.items():
        path = tmp_path / "shot.img"
        path.write_bytes(data)
        url = "data:image;base64," + base64.b64encode(data).decode()
        for source in (data, bytearray(data), str(path), path, url):
            assert media.image_size(source) == upright, (name, type(source))
        assert media.load_image(data).shape[:2] == upright[::-1], name
    pil = Image.open(io.BytesIO(encoded["JPEG"]))  # a PIL image is taken as it is, as load_image takes it
    assert media.image_size(pil) == (640, 360) == media.load_image(pil).shape[1::-1]
    assert media.image_size(np.zeros((5, 7, 3), np.uint8)) == (7, 5)
