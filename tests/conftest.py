import asyncio
from pathlib import Path

import numpy as np
import pytest

import mlx_qwen3vl  # noqa: F401  (first: it loads the optimized BLAS before any test module imports mlx.core)

FIXTURES = Path(__file__).parent / "fixtures"
CHECKPOINTS = ["tiny-a", "tiny-b"]
CASES = ["text", "image", "two_images", "video", "batch"]
MODEL_KEYS = ["input_ids", "attention_mask", "pixel_values", "image_grid_thw", "pixel_values_videos",
              "video_grid_thw", "mm_token_type_ids"]


def asgi_status(app, method, path, headers, server=("127.0.0.1", 1)) -> int:
    """The status an ASGI app answers one bodiless request with, called directly (no socket)."""
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "scheme": "http", "server": server, "query_string": b"",
             "headers": [(k.encode(), v.encode()) for k, v in headers.items()]}
    asyncio.run(app(scope, receive, send))
    return sent[0]["status"]


def case_inputs(case):
    """Recorded processor outputs of a case (as transformers made them), ready for model(**inputs)."""
    data = np.load(FIXTURES / "cases" / f"{case}.npz")
    return {k: data[k] for k in MODEL_KEYS if k in data}


def reference(checkpoint, case):
    return dict(np.load(FIXTURES / checkpoint / "reference" / f"{case}.npz"))


def rel_err(ours, ref):
    """Largest absolute difference relative to the largest reference magnitude."""
    ours, ref = np.asarray(ours, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


_models = {}
ALL_SIZES = ("LINEAR_MIN_WEIGHT", "ATTENTION_MIN_SCORES", "ACTIVATION_MIN_SIZE")


def load_fixture_model(name, dtype=None, backend=None):
    """A tiny checkpoint, loaded once per (dtype, backend): "mlx" (the plain graph), "cpu" (the CPU
    path as shipped: the tiny weights are below its size thresholds, so mostly MLX around the
    decode stack), "cpu-all" (the CPU path for every size, as on the 2B model; only under the
    `backend` fixture or `cpu_path_for_every_size`), None (what load picks)."""
    from mlx_qwen3vl.cpu import kernels
    from mlx_qwen3vl.weights import load_model

    key = (name, dtype, backend)
    if key not in _models:
        if backend == "cpu-all":
            assert kernels.LINEAR_MIN_WEIGHT == 0, "cpu-all needs cpu_path_for_every_size"
        _models[key] = load_model(FIXTURES / name, dtype=dtype, backend="cpu" if backend == "cpu-all" else backend)
    return _models[key]


def cpu_path_for_every_size(monkeypatch):
    from mlx_qwen3vl.cpu import kernels

    for name in ALL_SIZES:
        monkeypatch.setattr(kernels, name, 0)


@pytest.fixture
def on_cpu():
    """Pin the default device to the CPU for the test (so backend comparisons mean the same on a
    Mac, where the CPU path never runs on its own)."""
    import mlx.core as mx

    before = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(before)


@pytest.fixture(params=CHECKPOINTS)
def checkpoint(request):
    return request.param


BACKENDS = ["mlx", "cpu", "cpu-all"]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch, on_cpu):
    """Run a test on the plain MLX graph (with its lazy, queued decode loop, as a GPU gets it), on
    the CPU path as shipped, and on the CPU path for every size (every float32 linear, attention
    and activation through numpy, as on the 2B model); all on the CPU device. Load the model
    with load_fixture_model(name, backend=backend)."""
    if request.param == "cpu-all":
        cpu_path_for_every_size(monkeypatch)
    return request.param


def write_fixture_video(folder, reverse=False):
    """The fixture clip (8 fps, cropped to even sizes for the encoder) as a lossless FFV1 file in
    `folder` → (its frames, its path). Skips the test without PyAV. `reverse`: the frames in
    reverse order (a different clip of the same size), as clip-reversed.mkv."""
    av = pytest.importorskip("av")
    frames = np.load(FIXTURES / "media" / "video_16x72x100.npy")[:, :64, :96]
    if reverse:
        frames = frames[::-1]
    path = Path(folder) / ("clip-reversed.mkv" if reverse else "clip.mkv")
    with av.open(str(path), "w") as container:
        stream = container.add_stream("ffv1", rate=8)
        stream.width, stream.height, stream.pix_fmt = 96, 64, "bgr0"
        for f in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        container.mux(stream.encode())
    return frames, path


def exif_image(width, height, orientation, format="JPEG", seed=0) -> bytes:
    """An image stored `width` x `height` with EXIF orientation `orientation` (6 and 8: turned a
    quarter, 3: half; 5 and 7: transposed; the model sees it upright), encoded in `format`."""
    import io

    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=format, exif=exif.tobytes())
    return buf.getvalue()
