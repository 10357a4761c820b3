"""What a ChatSession file may hold, checked as data before any of it is used (ChatSession.load).

A session file may come from someone else (its checksum is unkeyed: anyone can recompute it), so
its state is read as untrusted input, as the server reads a request: messages are text and the
media the file itself holds (pixels, or a video's bytes), never a path or URL to read later;
every per-turn media setting and generation argument goes through the validators the API uses
(the processor's pixel checks, check_fps, SamplingParams, KVSettings), and the turns' images at
their settings must fit the model's context, so a crafted setting cannot make the next send()
allocate more than the model could ever read; media arrays are RGB uint8 of sane shapes; token
lists agree with the cache and with the media spans they record. Anything else raises InputError
naming what is wrong (ChatSession.load turns it into one CacheFileError line).
"""

import re

import numpy as np

from .engine.drafting import drafting
from .errors import InputError
from .kv_settings import FIELDS as KV_FIELDS
from .kv_settings import KVSettings, resolve
from .positions import IMAGE, VIDEO
from .processor import VISION_TOKENS, image_budget
from .sampling import FIELD_NAMES, SamplingParams
from .video import check_fps, smart_resize

TURN_SETTINGS = ("fps", "source_fps", "min_pixels", "max_pixels", "sample_frames")
ROLES = ("system", "user", "assistant")
GENERATION = FIELD_NAMES | set(KV_FIELDS) | {"sampling", "prefill_step_size", "prompt_lookup", "num_draft_tokens"}
SUFFIX = re.compile(r"(\.[A-Za-z0-9]{1,15})?")  # a video copy's extension: no separator, no ".."
FORMS = {"image": ("array",), "video": ("array", "frames", "file")}


def _fail(message):
    raise InputError(message)


def _index(v, n) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < n


def check_turn_settings(settings, processor, where: str, context: int) -> dict:
    """One turn's media settings (None: none), checked as the API checks them; a min_pixels that
    makes any image longer than the model's `context` (in tokens) is refused too."""
    if settings is None:
        return None
    if not isinstance(settings, dict) or set(settings) - set(TURN_SETTINGS):
        _fail(f"{where} holds media settings other than {', '.join(TURN_SETTINGS)}")
    for k in ("fps", "source_fps"):
        check_fps(settings.get(k), k)
    if settings.get("sample_frames") is not None and not isinstance(settings["sample_frames"], bool):
        _fail(f"{where}: sample_frames = {settings['sample_frames']!r} is not true or false")
    cfg = processor.image_config
    lo, _ = image_budget(cfg, settings.get("min_pixels"), settings.get("max_pixels"))
    if lo > context * cfg.factor * cfg.factor:
        _fail(f"{where}: min_pixels = {lo} makes every image longer than the model's context of {context} tokens")
    return dict(settings)


def check_generation(saved, model) -> dict:
    """The session's generation arguments: the names stream_generate takes, each value through
    SamplingParams or KVSettings as the API builds them."""
    if not isinstance(saved, dict) or set(saved) - GENERATION:
        unknown = sorted(set(saved) - GENERATION) if isinstance(saved, dict) else [type(saved).__name__]
        _fail(f"holds generation arguments this library does not take: {', '.join(map(str, unknown))}")
    out = dict(saved)
    if "sampling" in out:
        fields = out["sampling"].get("sampling_params") if isinstance(out["sampling"], dict) else None
        if not isinstance(fields, dict) or set(fields) - FIELD_NAMES:
            _fail("holds a sampling setting that is not SamplingParams' fields")
        if isinstance(fields.get("stop"), list):
            fields = {**fields, "stop": list(fields["stop"])}
        out["sampling"] = SamplingParams(**fields)
    SamplingParams.build(**{k: v for k, v in out.items() if k in FIELD_NAMES})
    resolve(model, KVSettings.pop_from({k: v for k, v in out.items() if k in KV_FIELDS}))
    drafting(**{k: out[k] for k in ("prompt_lookup", "num_draft_tokens") if k in out})
    step = out.get("prefill_step_size", 1)
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        _fail(f"prefill_step_size = {step!r} is not an integer >= 1")
    return out


def _check_messages(messages):
    """Messages of text and media placeholders ({"type": "image"} / {"type": "video"}, filled from
    the file's media entries) → the placeholders' (message, block) → kind."""
    if not isinstance(messages, list):
        _fail("holds no message list")
    slots = {}
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) - {"role", "content"} or m.get("role") not in ROLES:
            _fail(f"message {i + 1} is not a system, user or assistant message of text and media")
        content = m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            _fail(f"message {i + 1} has content that is neither text nor a list of blocks")
        for j, b in enumerate(blocks):
            if isinstance(b, dict) and b.get("type") == "text" and set(b) == {"type", "text"} \
                    and isinstance(b["text"], str):
                if any(t in b["text"] for t in VISION_TOKENS):
                    _fail(f"message {i + 1} has text holding the model's vision markers")
            elif isinstance(b, dict) and set(b) == {"type"} and b["type"] in FORMS:
                slots[(i, j)] = b["type"]
            else:  # a path, a URL, a data URL, anything to read: a session holds its media itself
                _fail(f"message {i + 1} block {j + 1} is neither text nor media the file holds "
                      "(a session file never names files or URLs to read)")
    return slots


def _check_media(entries, arrays, slots):
    """[((message, block, kind, form, suffix), [arrays])] of the file's media entries."""
    if not isinstance(entries, list):
        _fail("holds no media list")
    used, out = set(), []
    for n, e in enumerate(entries, 1):
        if not isinstance(e, dict) or set(e) - {"message", "block", "kind", "form", "arrays", "suffix"}:
            _fail(f"media entry {n} is malformed")
        where = (e.get("message"), e.get("block"))
        kind, form, idx = e.get("kind"), e.get("form"), e.get("arrays")
        if kind not in FORMS or slots.get(where) != kind or form not in FORMS[kind]:
            _fail(f"media entry {n} does not fill a {kind!r} placeholder of its message as a {form!r}")
        del slots[where]
        if not isinstance(idx, list) or not idx or len(set(map(repr, idx))) != len(idx) or not all(
                _index(k, len(arrays)) and k not in used for k in idx):
            _fail(f"media entry {n} names arrays the file does not hold (or another entry's)")
        used |= set(idx)
        parts = [arrays[k] for k in idx]
        suffix = e.get("suffix", "")
        if form == "file":
            if len(parts) != 1 or parts[0].ndim != 1 or not isinstance(suffix, str) or not SUFFIX.fullmatch(suffix):
                _fail(f"media entry {n}: a video file's bytes with an extension like .mp4 (not {suffix!r})")
        else:
            ndim = 4 if form == "array" and kind == "video" else 3
            if (form == "array" and len(parts) != 1) or any(
                    a.dtype != np.uint8 or a.ndim != ndim or a.shape[-1] != 3 or 0 in a.shape for a in parts):
                _fail(f"media entry {n} is not RGB uint8 pixels (height x width x 3)")
        out.append(((where[0], where[1], kind, form, suffix), parts))
    if slots:
        _fail(f"message {next(iter(slots))[0] + 1} has media the file does not hold")
    if len(used) != len(arrays):
        _fail("holds arrays no message uses")
    return out


def _check_fits(messages, media, settings, processor, context):
    """The turns' images at their own settings: at most the model's context in tokens."""
    cfg = processor.image_config
    tokens = 0
    for (i, _, kind, form, _), parts in media:
        if kind != "image":
            continue
        turn = settings[i] or {}
        lo, hi = image_budget(cfg, turn.get("min_pixels"), turn.get("max_pixels"))
        h, w = parts[0].shape[:2]
        rh, rw = smart_resize(h, w, cfg.factor, lo, hi)
        tokens += rh * rw // (cfg.factor * cfg.factor)
        if tokens > context:
            _fail(f"message {i + 1}'s images at its min_pixels / max_pixels come to over the model's context of "
                  f"{context} tokens")


def _check_tokens(tokens, media_keys, n, processor, vocab):
    """Token ids the cache's `n` positions hold, and the media spans among them."""
    if not isinstance(tokens, list) or len(tokens) != n or not all(_index(t, vocab) for t in tokens):
        _fail(f"holds a token list that disagrees with its KV cache ({n} positions)")
    if not isinstance(media_keys, list):
        _fail("holds no media key list")
    ids = np.asarray(tokens, np.int64)
    covered = np.zeros(n, bool)
    end = 0
    for key in media_keys:
        if not (isinstance(key, list) and len(key) == 4 and key[0] in (IMAGE, VIDEO) and _index(key[1], n)
                and isinstance(key[2], int) and key[1] < key[2] <= n and key[1] >= end and isinstance(key[3], str)):
            _fail("holds media keys that do not lie in its token list")
        kind, start, stop = key[0], key[1], key[2]
        token = processor.image_token_id if kind == IMAGE else processor.video_token_id
        span = ids[start:stop]
        if ids[start] != token or ids[stop - 1] != token or (kind == IMAGE and (span != token).any()):
            _fail("holds media keys that do not lie on its image and video tokens")
        covered[start:stop] = True
        end = stop
    vision = (ids == processor.image_token_id) | (ids == processor.video_token_id)
    if (vision & ~covered).any():
        _fail("holds image or video tokens that no media key accounts for")


def check_state(state, arrays, caches, kv, model, processor):
    """(messages with placeholders, media, per-message settings, defaults, generation arguments)
    of a session file's `state`, its extra `arrays` and its `caches` (read under KVSettings `kv`),
    each checked; InputError otherwise."""
    if not isinstance(state, dict):
        _fail("holds no session state")
    messages = state.get("messages")
    slots = _check_messages(messages)
    media = _check_media(state.get("media"), arrays, slots)
    settings = state.get("settings")
    if not isinstance(settings, list) or len(settings) != len(messages):
        _fail("holds per-turn settings that do not match its messages")
    context = int(model.config.text_config.max_position_embeddings)
    settings = [check_turn_settings(t, processor, f"message {i + 1}", context) for i, t in enumerate(settings)]
    defaults = check_turn_settings(state.get("defaults"), processor, "the session's defaults", context) or {}
    generation = check_generation(state.get("generation"), model)
    _check_fits(messages, media, settings, processor, context)
    if state.get("kv") != kv.as_dict() and not (kv.bits is None and isinstance(state.get("kv"), dict)
                                                 and state["kv"].get("kv_bits") is None):
        _fail("records other KV settings than its cache")
    n = caches[0].size() if caches else 0
    _check_tokens(state.get("tokens"), state.get("media_keys"), n, processor,
                  int(model.config.text_config.vocab_size))
    return messages, media, settings, defaults, generation
