"""Multi-turn chats on one KV cache: `ChatSession`, and how each turn's media are read when it is
sent and kept as they were then."""

import dataclasses
import json
import os
import re
import shutil
import tempfile
import weakref
from typing import Iterator

import numpy as np
from blake3 import blake3

from .engine.draft_model import DraftModel
from .errors import InputError
from .generate import stream_generate
from .kv_settings import KVSettings, resolve
from .media import describe, load_image, read_file
from .positions import IMAGE, VIDEO
from .processor import VISION_TOKENS, _block_type, _media_of, renamed_source_fps
from .prompt_cache import PromptCache
from .sampling import SamplingParams
from .session_file import TURN_SETTINGS, check_state
from .spans import _PIXELS, content_hash, media_hashes

UNSAVED = ("draft_model", "drafter")  # objects that change speed, not answers: given again to load


def _concat_inputs(parts: list) -> dict:
    out = {}
    for key in ("input_ids", "attention_mask", "mm_token_type_ids"):
        out[key] = np.concatenate([p[key] for p in parts], axis=1)
    for px, grid in _PIXELS.values():
        held = [p for p in parts if grid in p]
        if held:
            out[px] = np.concatenate([p[px] for p in held])
            out[grid] = np.concatenate([p[grid] for p in held])
    out["media_hashes"] = [h for p in parts for h in media_hashes(p)]
    return out


def _frozen(rgb: np.ndarray, source) -> np.ndarray:
    """`rgb` as a private read-only array (load_image hands a caller's RGB array back as it is)."""
    if isinstance(source, np.ndarray) and np.may_share_memory(rgb, source):
        rgb = rgb.copy()
    rgb.flags.writeable = False
    return rgb


def snapshot_image(image, label="image"):
    """(pixels, content key) of an image as it reads now: RGB uint8, read-only, no longer tied to
    the file, PIL image or buffer it came from (the caller may overwrite or refill those)."""
    rgb = _frozen(load_image(image, label), image)
    return rgb, content_hash(rgb, rgb.shape)


class _VideoFiles:
    """Private copies of video files, named by content: a video is read once, when its turn is sent."""

    def __init__(self):
        self.folder = None

    def copy(self, path, label):
        return self.store(read_file(path, f"{label} {describe(path)}"), os.path.splitext(str(path))[1][:16])

    def store(self, data: bytes, suffix: str):
        """(path of a private copy of `data`, named by its content, content key)."""
        key = content_hash(np.frombuffer(data, np.uint8), (len(data),))
        if self.folder is None:
            self.folder = tempfile.mkdtemp(prefix="mlx_qwen3vl-chat-")
            weakref.finalize(self, shutil.rmtree, self.folder, True)
        target = os.path.join(self.folder, key + suffix)
        if not os.path.exists(target):
            with open(target, "wb") as f:
                f.write(data)
        return target, key


def _snapshot_video(video, label, files: _VideoFiles):
    """(video as read now, content key): a file becomes a private copy; frames become read-only
    RGB arrays. Anything else is left for the processor to refuse (key None)."""
    if isinstance(video, (str, os.PathLike)):
        return files.copy(video, label)
    if isinstance(video, np.ndarray) and video.ndim == 4 and video.shape[-1] == 3 and video.dtype == np.uint8:
        frames = _frozen(video, video)
        return frames, content_hash(frames, frames.shape)
    if isinstance(video, (list, tuple)) or (isinstance(video, np.ndarray) and video.ndim == 4):
        frames = [snapshot_image(f, f"{label} frame {t}") for t, f in enumerate(video, 1)]
        h = blake3(max_threads=blake3.AUTO)
        for _, key in frames:
            h.update(key.encode())
        return [f for f, _ in frames], h.hexdigest()
    return video, None


def _read_snapshot(kind, value, label, files):
    """A snapshot as a dict of arrays (what Processor.read_media hands between ranks)."""
    if kind == IMAGE:
        media, key = snapshot_image(value, label)
    else:
        media, key = _snapshot_video(value, label, files)
    if key is None:
        return {}
    if isinstance(media, list):  # frames
        return {"key": np.array(key), **{f"frame{t}": f for t, f in enumerate(media)}}
    return {"key": np.array(key), "media": media if isinstance(media, np.ndarray) else np.array(media)}


def _from_snapshot(read: dict):
    """(media, key) back from _read_snapshot's dict; (None, None) for media left unread."""
    if "key" not in read:
        return None, None
    if "media" in read:
        media = read["media"]
        if media.dtype.kind == "U":  # a private copy's path
            media = str(media)
        else:
            media.flags.writeable = False
    else:
        media = [read[f"frame{t}"] for t in range(len(read) - 1)]
        for f in media:
            f.flags.writeable = False
    return media, str(read["key"])


def _media_blocks(message):
    """(content index, kind, value) of each image and video block of a message, in order."""
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, list):
        return []
    out = []
    for j, block in enumerate(content):
        kind = _block_type(block, "content item")
        if kind == "image_url" and "image_url" in block:
            info = block["image_url"]
            out.append((j, IMAGE, info.get("url", "") if isinstance(info, dict) else info))
        elif kind in ("image", "image_url"):
            out.append((j, IMAGE, _media_of(block, "image")))
        elif kind == "video":
            out.append((j, VIDEO, _media_of(block, "video")))
    return out


class ChatSession:
    """A multi-turn conversation that keeps its KV cache between turns: an agent that sends a new
    screenshot each turn pays for that screenshot and the new text only.

    Each turn's images and videos are read when that turn is sent, and the history keeps them as
    they were then (`messages` holds the pixels the model saw, as read-only arrays; a video file,
    a private copy kept while the session lives): an agent may save every screen to the same
    file, draw into the same PIL image or refill the same buffer. Whatever shaped a turn's media
    (`fps`, `source_fps`, `min_pixels`, `max_pixels`, `sample_frames`) stays with that turn too.
    Each turn is processed once and reused, keyed by its text, its media's content and its
    settings, so every turn answers as `generate(messages=history)` would, with each turn's media
    processed with its own settings."""

    def __init__(self, model, processor, system=None, **defaults):
        self.model, self.processor = model, processor
        self.messages = [{"role": "system", "content": system}] if system else []
        self.settings = [None] * len(self.messages)  # per message: the settings its media were processed with
        self.prompt_cache = PromptCache(model.make_cache())
        if "video_fps" in defaults:
            defaults["source_fps"] = renamed_source_fps(defaults.get("source_fps"), defaults.pop("video_fps"))
        self.defaults = {k: defaults.pop(k) for k in TURN_SETTINGS if k in defaults}
        self.generation_kwargs = defaults
        self._draft(defaults)
        self.last = None  # the last GenerationResponse
        self._parts = []  # [(key, processed inputs)] per rendered chunk, reused while unchanged
        self._snapshots = []  # [(media as read, content key)] of the media the messages hold
        self._video_files = _VideoFiles()

    def _draft(self, kwargs):
        """A draft model given to the session: loaded and checked once, its draft caches kept
        across turns (and across save and load when the same DraftModel is given to load)."""
        if kwargs.get("draft_model") is not None:
            kwargs["draft_model"] = DraftModel.of(kwargs["draft_model"])
            kwargs["draft_model"].check(self.model, getattr(self.processor, "tokenizer", None))

    def _media_items(self):
        """(kind, media, content key, settings) of every image and video of the conversation, in
        order. Media the session has not read yet (the turn being sent, a message appended by
        hand) are read now, and the message holds what was read from then on."""
        while len(self.settings) < len(self.messages):  # messages appended by hand: the session's defaults
            self.settings.append(dict(self.defaults))
        items, kept, count = [], [], {IMAGE: 0, VIDEO: 0}
        for message, settings in zip(self.messages, self.settings):
            for j, kind, value in _media_blocks(message):
                count[kind] += 1
                # Identity with an object the session made and holds (never reused while held).
                key = next((k for snap, k in self._snapshots if snap is value), None)
                if key is None:
                    label = f"{'image' if kind == IMAGE else 'video'} {count[kind]}"
                    media, key = _from_snapshot(self.processor.read_media(_read_snapshot, kind, value, label,
                                                                          self._video_files))
                    if key is not None:
                        value = media
                        message["content"][j] = {"type": "image" if kind == IMAGE else "video",
                                                 "image" if kind == IMAGE else "video": value}
                kept.append((value, key))
                items.append((kind, value, key, settings or {}))
        self._snapshots = kept
        return items

    def _chunk_inputs(self, chunk, media, settings):
        key = (chunk, tuple(k for _, _, k in media), tuple(sorted(settings.items())))
        for k, part in self._parts:
            if k == key:
                return key, part
        images = [m for kind, m, _ in media if kind == IMAGE]
        videos = [m for kind, m, _ in media if kind == VIDEO]
        part = self.processor(text=chunk, images=images or None, videos=videos or None, **settings)
        media_hashes(part)
        return key, part

    def encode(self) -> dict:
        """The whole conversation as model inputs. The rendered prompt is cut before every
        `<|im_start|>` (a special token, so the pieces tokenize exactly as the whole does), and each
        piece is processed with the settings of the turn its media belong to."""
        items = self._media_items()
        text = self.processor.apply_chat_template(self.messages, add_generation_prompt=True, tokenize=False)
        chunks = [c for c in re.split(r"(?=<\|im_start\|>)", text) if c]
        parts, pos = [], 0
        image_token, video_token = self.processor.image_token, self.processor.video_token
        for chunk in chunks:
            n = chunk.count(image_token) + chunk.count(video_token)
            media = [(kind, m, key) for kind, m, key, _ in items[pos:pos + n]]
            settings = {k: v for k, v in (items[pos][3] if n else {}).items() if v is not None}
            parts.append(self._chunk_inputs(chunk, media, settings))
            pos += n
        self._parts = parts
        return _concat_inputs([p for _, p in parts])

    def stream(self, text, images=None, videos=None, *, fps=None, source_fps=None, min_pixels=None,
               max_pixels=None, sample_frames=None, video_fps=None, **kwargs) -> Iterator:
        """Send one user turn (its images, then its videos, then the text) and stream the answer.
        `video_fps` is `source_fps`'s deprecated name."""
        content = [{"type": "image", "image": im} for im in images or []]
        content += [{"type": "video", "video": v} for v in videos or []]
        content.append({"type": "text", "text": text})
        given = dict(fps=fps, source_fps=renamed_source_fps(source_fps, video_fps), min_pixels=min_pixels,
                     max_pixels=max_pixels, sample_frames=sample_frames)
        settings = {k: given[k] if given[k] is not None else self.defaults.get(k) for k in TURN_SETTINGS}
        while len(self.settings) < len(self.messages):
            self.settings.append(dict(self.defaults))
        self.messages.append({"role": "user", "content": content})
        self.settings.append(settings)
        answer, done = "", False
        try:
            inputs = self.encode()
            for piece in stream_generate(self.model, self.processor, inputs=inputs, prompt_cache=self.prompt_cache,
                                         **{**self.generation_kwargs, **kwargs}):
                answer += piece.text
                self.last = piece
                yield piece
            done = True
        finally:
            if done:
                # A vision marker in the answer (random or confused weights emit them) would read as
                # a media slot when the history is rendered again; the history keeps the text around it.
                for token in VISION_TOKENS:
                    answer = answer.replace(token, "")
                self.messages.append({"role": "assistant", "content": answer})
                self.settings.append(None)
            else:  # a failed or abandoned turn leaves the conversation as it was
                self.messages.pop()
                self.settings.pop()

    def send(self, text, images=None, videos=None, **kwargs) -> str:
        return "".join(p.text for p in self.stream(text, images, videos, **kwargs))

    # ------------------------------------------------------------------ on disk
    def save(self, path):
        """Write the session to `path` (one safetensors file, written atomically, readable by this
        user only): the messages with each turn's media as they were read, the settings that
        shaped them, the session's generation settings, the KV cache and the tokens and media it
        holds, and what identifies the model. `ChatSession.load(path, model, processor)` goes on
        from there, its next turn reusing the whole history."""
        from . import cache_file

        _one_process(self.model, "ChatSession.save")
        self._media_items()  # every medium read, including any in messages appended by hand
        messages, media, arrays = [], [], []
        for i, message in enumerate(self.messages):
            message = dict(message)
            blocks = _media_blocks(message)
            if blocks:
                message["content"] = list(message["content"])
            for j, kind, value in blocks:
                name = "image" if kind == IMAGE else "video"
                entry = {"message": i, "block": j, "kind": name, "arrays": []}
                if isinstance(value, str):  # a video's private copy
                    entry["form"], entry["suffix"] = "file", os.path.splitext(value)[1]
                    with open(value, "rb") as f:
                        arrays.append(np.frombuffer(f.read(), np.uint8))
                    entry["arrays"].append(len(arrays) - 1)
                elif isinstance(value, np.ndarray) and value.dtype == np.uint8:
                    entry["form"] = "array"
                    arrays.append(value)
                    entry["arrays"].append(len(arrays) - 1)
                elif isinstance(value, list) and all(isinstance(f, np.ndarray) and f.dtype == np.uint8 for f in value):
                    entry["form"] = "frames"
                    for frame in value:
                        arrays.append(frame)
                        entry["arrays"].append(len(arrays) - 1)
                else:
                    raise InputError(f"ChatSession.save: {name} {j + 1} of message {i + 1} could not be read, so it "
                                     "cannot be saved")
                media.append(entry)
                message["content"][j] = {"type": name}
            messages.append(message)
        pc = self.prompt_cache
        kv = pc.kv or self._kv()
        state = {"messages": messages, "settings": self.settings, "defaults": self.defaults,
                 "generation": _settings_to_json(self.generation_kwargs), "media": media,
                 "tokens": pc.tokens, "media_keys": [list(m) for m in pc.media], "kv": kv.as_dict()}
        try:
            json.dumps(state)
        except (TypeError, ValueError) as e:
            raise InputError(f"ChatSession.save: the conversation holds something that is not text, numbers or "
                             f"media ({e}); it cannot be saved") from None
        n = len(pc.tokens)
        caches = [c.extract(0, n) for c in pc.cache]
        cache_file.write(path, caches, state, arrays, model=self.model, kv=kv)

    @classmethod
    def load(cls, path, model, processor, **expect) -> "ChatSession":
        """The session `save` wrote to `path`, for `model` (the same checkpoint, dtype and KV
        settings; `expect` may name kv_bits / kv_group_size / quantized_kv_start it must have).
        A file of another model, dtype or KV settings, or a truncated or corrupted one, is refused
        with one line (cache_file.CacheFileError, an InputError); nothing of it is used.
        `draft_model=` / `drafter=`, which `save` does not write (they change speed, not answers),
        are given again here."""
        from . import cache_file

        _one_process(model, "ChatSession.load")
        speed = {k: expect.pop(k) for k in UNSAVED if k in expect}
        want = KVSettings.pop_from(expect)
        if expect:
            raise TypeError(f"ChatSession.load got unexpected argument(s) {', '.join(sorted(expect))}")
        what = f"session file {str(path)!r}"
        caches, state, arrays, kv = cache_file.read(path, model, None if want is None else resolve(model, want),
                                                    what=what)
        session = cls(model, processor)
        try:
            session._restore(state, arrays, caches, kv)
        except InputError as e:
            raise cache_file.CacheFileError(f"{what}: {e}") from None
        except (KeyError, TypeError, ValueError, IndexError, AttributeError):
            raise cache_file.CacheFileError(f"{what} does not hold a chat session") from None
        session.generation_kwargs.update(speed)
        session._draft(session.generation_kwargs)
        return session

    def _restore(self, state, arrays, caches, kv):
        """The session a file's `state` describes, every part of it checked as data (see
        session_file.check_state), with media as the pixels or private copies the file holds."""
        messages, media, settings, defaults, generation = check_state(state, arrays, caches, kv, self.model,
                                                                      self.processor)
        for (i, j, name, form, suffix), parts in media:
            for a in parts:
                a.flags.writeable = False
            if form == "file":
                value, _ = self._video_files.store(parts[0].tobytes(), suffix)
            else:
                value = parts[0] if form == "array" else parts
            messages[i]["content"][j] = {"type": name, name: value}
        self.messages, self.settings, self.defaults = messages, settings, defaults
        self.generation_kwargs = generation
        self.prompt_cache = PromptCache(caches, list(state["tokens"]), [tuple(m) for m in state["media_keys"]], kv)

    def _kv(self) -> KVSettings:
        return resolve(self.model, KVSettings.pop_from(dict(self.generation_kwargs)))


def _one_process(model, what):
    if getattr(model, "group", None) is not None:
        raise InputError(f"{what} is not available under several ranks (each rank holds a part of the cache); "
                         "save and load sessions in one process")


def _settings_to_json(kwargs: dict) -> dict:
    out = {}
    for k, v in kwargs.items():
        if k in UNSAVED:
            continue
        if isinstance(v, SamplingParams):
            v = {"sampling_params": dataclasses.asdict(v)}
        try:
            json.dumps(v)
        except (TypeError, ValueError):
            raise InputError(f"ChatSession.save: the session's setting {k}={v!r} cannot be saved") from None
        out[k] = v
    return out


