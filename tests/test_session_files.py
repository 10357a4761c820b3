"""Session files are data: ChatSession.save / load round-trips under any file name, and a crafted
file (written here the way anyone can: cache_file.write recomputes the unkeyed checksum) is
refused with one line for each finding of issue 35: media named by path or URL, per-turn pixel
settings and generation arguments the API would refuse, NaN in the KV tensors, token lists that
disagree with the cache, bad media arrays, a `../` video suffix, a FIFO named as the file or lying
in the server's --prefix-cache-dir."""

import os
import threading

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

import mlx_qwen3vl as M
from conftest import FIXTURES, load_fixture_model
from mlx_qwen3vl import cache_file
from mlx_qwen3vl.kv_settings import KVSettings

MEDIA = FIXTURES / "media"


@pytest.fixture(scope="module")
def model():
    return load_fixture_model("tiny-a", backend="mlx")


@pytest.fixture(scope="module")
def processor():
    return M.Processor.from_pretrained(FIXTURES / "tiny-a")


def shot(seed, size=(64, 48)):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def saved(model, processor, tmp_path_factory):
    """A two-turn session (same-size, different screenshots) saved once: (path, session)."""
    s = M.ChatSession(model, processor, system="You are a GUI agent.", max_tokens=6)
    s.send("Where is the search box?", images=[shot(1)])
    s.send("And now?", images=[shot(2)], max_pixels=48 * 48)
    path = tmp_path_factory.mktemp("sessions") / "good.safetensors"
    s.save(path)
    return path, s


def parts(path, model):
    """What a crafter starts from: (caches, state, arrays, kv) of a good file."""
    caches, state, arrays, kv = cache_file.read(path, model)
    return caches, state, arrays, kv


def craft(tmp_path, name, model, caches, state, arrays, kv=KVSettings()):
    path = tmp_path / name
    cache_file.write(path, caches, state, arrays, model=model, kv=kv)
    return path


def refused(path, model, processor, needle):
    with pytest.raises(cache_file.CacheFileError) as e:
        M.ChatSession.load(path, model, processor)
    message = str(e.value)
    assert "\n" not in message and str(path) in message and needle in message, message
    return message


def test_round_trip_under_any_file_name_answers_as_the_uninterrupted_session(saved, model, processor, tmp_path):
    """Before: load failed unless the name ended in .safetensors ("could not infer file format
    from extension")."""
    path, live = saved
    loaded = []
    for name in ("session.bin", "noext", "s.kv.safetensors"):
        live.save(tmp_path / name)
        assert (tmp_path / name).exists() and not (tmp_path / (name + ".safetensors")).exists()
        loaded.append(M.ChatSession.load(tmp_path / name, model, processor))
    fork = M.ChatSession.load(path, model, processor)  # the session as saved, to go on uninterrupted
    want = [p.token for p in fork.stream("Then click it.", images=[shot(3)])]
    for s in loaded:
        assert [p.token for p in s.stream("Then click it.", images=[shot(3)])] == want
        assert s.last.cached_tokens == fork.last.cached_tokens > 0


@pytest.mark.parametrize("block", [
    {"type": "image", "image": str(MEDIA / "img_123x77.png")},
    {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/secret.png"}},
    {"type": "image", "image": "file:///etc/passwd"},
    {"type": "video", "video": "/some/local/video.mp4"}])
def test_a_file_naming_a_local_path_or_url_is_refused(saved, model, processor, tmp_path, block):
    """Before: the next send() read the local file or fetched the URL with no media policy."""
    caches, state, arrays, kv = parts(saved[0], model)
    state["messages"][1]["content"].insert(0, block)
    path = craft(tmp_path, "paths.bin", model, caches, state, arrays, kv)
    refused(path, model, processor, "never names files or URLs")


@pytest.mark.parametrize("settings, needle", [
    ({"min_pixels": 60_000_000, "max_pixels": 60_000_000}, "context"),  # before: 60M allocated, +2.8 GB
    ({"max_pixels": "big"}, "max_pixels"), ({"min_pixels": 0}, "min_pixels"), ({"fps": -1}, "fps"),
    ({"sample_frames": "yes"}, "sample_frames"), ({"exec": "x"}, "media settings")])
def test_per_turn_settings_are_checked_as_the_api_checks_them(saved, model, processor, tmp_path, settings, needle):
    caches, state, arrays, kv = parts(saved[0], model)
    state["settings"][1] = {**(state["settings"][1] or {}), **settings}
    refused(craft(tmp_path, "settings", model, caches, state, arrays, kv), model, processor, needle)
    state["settings"][1] = None  # the defaults are checked alike
    state["defaults"] = settings
    refused(craft(tmp_path, "defaults", model, caches, state, arrays, kv), model, processor, needle)


@pytest.mark.parametrize("generation, needle", [
    ({"temperature": -1}, "temperature"), ({"max_tokens": "many"}, "max_tokens"), ({"kv_bits": 3}, "kv_bits"),
    ({"sampling": {"sampling_params": {"top_p": 7}}}, "top_p"), ({"prompt_cache": 1}, "prompt_cache"),
    ({"prefill_step_size": 0}, "prefill_step_size")])
def test_generation_arguments_are_checked_as_the_api_checks_them(saved, model, processor, tmp_path, generation,
                                                                 needle):
    """Before: generation keyword arguments passed unchecked into the next send()."""
    caches, state, arrays, kv = parts(saved[0], model)
    state["generation"] = generation
    refused(craft(tmp_path, "gen", model, caches, state, arrays, kv), model, processor, needle)


def test_nan_in_the_kv_tensors_is_refused(saved, model, processor, tmp_path):
    caches, state, arrays, kv = parts(saved[0], model)
    keys, values = caches[1].buffers()
    caches[1] = caches[1].empty_like().fill(keys.at[0, 0, 3, 0].add(mx.array(float("nan"))), values)
    refused(craft(tmp_path, "nan", model, caches, state, arrays, kv), model, processor, "not finite")


@pytest.mark.parametrize("edit, needle", [
    (lambda s: s["tokens"].pop(), "disagrees with its KV cache"),
    (lambda s: s["tokens"].__setitem__(0, 10 ** 6), "disagrees with its KV cache"),
    (lambda s: s["media_keys"][0].__setitem__(1, 0), "image and video tokens"),
    (lambda s: s["media_keys"].pop(), "no media key accounts for"),
    (lambda s: s.__setitem__("kv", {"kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": 0}), "KV settings")])
def test_token_lists_that_disagree_with_the_cache_are_refused(saved, model, processor, tmp_path, edit, needle):
    caches, state, arrays, kv = parts(saved[0], model)
    edit(state)
    refused(craft(tmp_path, "tokens", model, caches, state, arrays, kv), model, processor, needle)


@pytest.mark.parametrize("bad", [np.zeros((4, 4), np.uint8), np.zeros((4, 4, 4), np.uint8),
                                 np.zeros((0, 4, 3), np.uint8), np.zeros(48, np.uint8)])
def test_bad_media_arrays_are_refused(saved, model, processor, tmp_path, bad):
    caches, state, arrays, kv = parts(saved[0], model)
    arrays[0] = bad
    refused(craft(tmp_path, "media", model, caches, state, arrays, kv), model, processor, "RGB uint8")


def test_a_video_suffix_that_leaves_the_folder_is_a_cache_file_error(saved, model, processor, tmp_path):
    """Before: FileNotFoundError from writing the private copy under "<folder>/<key>/../../x"."""
    caches, state, arrays, kv = parts(saved[0], model)
    state["messages"][1]["content"][0] = {"type": "video"}
    entry = state["media"][0]
    entry.update(kind="video", form="file", suffix="/../../../x.mp4")
    arrays[entry["arrays"][0]] = np.frombuffer(b"not really a video", np.uint8)
    refused(craft(tmp_path, "suffix", model, caches, state, arrays, kv), model, processor, "extension")


def _in_thread(fn):
    """fn() in a thread that must finish within 20 s (a blocking open would never return)."""
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", _catch(fn)), daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive(), "blocked"
    return out["r"]


def _catch(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        return e


def test_a_fifo_named_as_the_session_file_is_refused_without_blocking(model, processor, tmp_path):
    """Before: open() of a FIFO waited for a writer forever."""
    fifo = tmp_path / "session.bin"
    os.mkfifo(fifo)
    e = _in_thread(lambda: M.ChatSession.load(fifo, model, processor))
    assert isinstance(e, cache_file.CacheFileError) and "not a regular file" in str(e) and "\n" not in str(e)


def test_a_fifo_in_the_prefix_cache_dir_is_skipped_with_one_warning(model, tmp_path):
    """Before: the server's start hung reading the folder's headers."""
    from mlx_qwen3vl.engine.disk import SUFFIX, DiskTier

    folder = tmp_path / "prefixes"
    folder.mkdir(mode=0o700)
    os.mkfifo(folder / ("entry" + SUFFIX))
    warnings = []
    tier = _in_thread(lambda: DiskTier(folder, 1 << 20, model, KVSettings(), warn=warnings.append))
    assert isinstance(tier, DiskTier) and tier.skipped == 1 and not tier.files
    assert len(warnings) == 1 and "not a regular file" in warnings[0] and "\n" not in warnings[0]
