"""What every protocol's request reading shares: the internal request (`ChatRequest`), errors
(`APIError`, OpenAI's error body `{"error": {"message", "type", "param", "code"}}`), pydantic
validation with errors named by the field's path (`validate`), and the field checks for sampling,
stop strings, pixels, template switches and KV settings.

Every check names the field (`param`) and what to send instead.
"""

import math
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from pydantic import ValidationError

from ..errors import InputError
from ..kv_settings import FIELDS as KV_FIELDS, KVSettings
from ..sampling import SamplingParams

MAX_STOP = 16
MAX_STOP_CHARS = 256  # each stop string is searched for after every token
MAX_TOP_LOGPROBS = 20
MAX_JSON_DEPTH = 64  # nesting of the request body (a JSON schema included)
MAX_LOGIT_BIAS = 300  # entries of logit_bias (OpenAI's bound), each a bias in [-100, 100]
MAX_STOP_TOKEN_IDS = 64
# The chat template switches a request may set: they change how the conversation is rendered and
# nothing else (the Qwen3-VL templates read these). Anything else the template or the processor
# would take (tokenize, images, videos, chat_template, ...) could reach files, URLs or memory.
TEMPLATE_SWITCHES = {"add_vision_id": bool, "enable_thinking": bool}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: Optional[str] = None, param: Optional[str] = None,
                 code: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                             413: "request_too_large", 429: "rate_limit_error",
                             503: "server_overloaded"}.get(status, "server_error")
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _invalid(param, message, code="invalid_value"):
    return APIError(400, message, param=param, code=code)


@dataclass
class ChatRequest:
    """The one internal request every protocol's body is read into: the conversation as turns of
    parts (each remembering its place in the body), sampling, tools, output format, KV and pixel
    settings. PromptBuilder renders it to the chat template's messages."""

    turns: List[Any]  # conversation.Turn (which imports this module's APIError)
    sampling: SamplingParams  # the library's; its max_tokens is set from `max_tokens` once the prompt is known
    max_tokens: Optional[int] = None  # as the request gave it (none: the server's --max-tokens)
    model: Optional[str] = None
    stream: bool = False
    include_usage: bool = False
    tools: Optional[List[dict]] = None
    tool_choice: Any = "auto"
    response_format: Optional[dict] = None
    min_pixels: Optional[int] = None
    max_pixels: Optional[int] = None
    chat_template_kwargs: Dict[str, Any] = field(default_factory=dict)
    kv: Optional[dict] = None  # kv_bits / kv_group_size / quantized_kv_start the request set (extra_body)
    merge_system: bool = True  # system turns must lead and become one (Responses, Messages); chat keeps them
    drafting: Optional[dict] = None  # prompt_lookup / num_draft_tokens the request set (speculative decoding)


def _number(body, name, lo=None, hi=None, *, integer=False, lo_open=False, default=None):
    value = body.get(name)
    if value is None:
        return default
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise _invalid(name, f"'{name}' must be {kind}, got {type(value).__name__}", "invalid_type")
    if not math.isfinite(value):
        raise _invalid(name, f"'{name}' must be finite")
    if lo is not None and (value <= lo if lo_open else value < lo) or hi is not None and value > hi:
        lo_s = "" if lo is None else f"{'>' if lo_open else '>='} {lo}"
        hi_s = "" if hi is None else f"<= {hi}"
        raise _invalid(name, f"'{name}' is {value}; it must be {' and '.join(s for s in (lo_s, hi_s) if s)}")
    return value


def check_json(body, limit=MAX_JSON_DEPTH):
    """A parsed body nested at most `limit` deep, with no string that is not valid Unicode (a lone
    surrogate, which JSON's \\ud800 escape can carry, fails later when the text is encoded).
    Iterative: a deep body must not exhaust the stack here either."""
    stack = [(body, 1, None)]
    while stack:
        value, depth, where = stack.pop()
        if isinstance(value, str):
            if not value.isascii():
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    raise _invalid(where, f"'{where or 'the body'}' holds a lone surrogate (\\ud800-\\udfff without "
                                   "its pair); send valid Unicode text", "invalid_text") from None
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > limit:
            raise _invalid(where, f"the request body is nested deeper than {limit} levels", "too_deep")
        if isinstance(value, dict):
            for k, v in value.items():
                stack.append((k, depth, where))
                stack.append((v, depth + 1, f"{where}.{k}" if where else k))
        else:
            stack.extend((v, depth + 1, f"{where or ''}[{i}]") for i, v in enumerate(value))


def _template_switches(kwargs):
    if not isinstance(kwargs, dict):
        raise _invalid("chat_template_kwargs", "'chat_template_kwargs' must be an object", "invalid_type")
    for key, value in kwargs.items():
        param = f"chat_template_kwargs.{key}"
        kind = TEMPLATE_SWITCHES.get(key)
        if kind is None:
            raise _invalid(param, f"'chat_template_kwargs' may not set {key!r}; this server takes only "
                           + ", ".join(sorted(TEMPLATE_SWITCHES)), "unsupported_template_kwarg")
        if not isinstance(value, kind):
            raise _invalid(param, f"'{param}' must be true or false", "invalid_type")
    return dict(kwargs)


def _check_response_format(rf):
    if rf is None:
        return None
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise _invalid("response_format", "'response_format.type' must be 'text', 'json_object' or 'json_schema'")
    if rf["type"] == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise _invalid("response_format.json_schema", "'response_format.json_schema' must be "
                           "{'name': ..., 'schema': {...}}")
    return None if rf["type"] == "text" else rf


SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "seed")


def stop_strings(stop, name="stop") -> List[str]:
    """A request's stop strings (a string or a list), checked against the limits."""
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP:
        raise _invalid(name, f"'{name}' must be a non-empty string or a list of at most {MAX_STOP} of them")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise _invalid(name, f"each '{name}' string must be at most {MAX_STOP_CHARS} characters")
    return stop


def sampling_params(body, stop=(), *, defaults=None, logprobs=False, top_logprobs=0, **more) -> SamplingParams:
    """The sampling fields of a request body (SAMPLING_FIELDS) → SamplingParams; a field the body
    leaves out takes `defaults`' value, else OpenAI's default temperature (1.0), not the library's
    greedy one."""
    d = defaults or {}
    top_k = _number(body, "top_k", -1, integer=True, default=d.get("top_k", 0))
    return SamplingParams(
        temperature=_number(body, "temperature", 0, 2, default=d.get("temperature", 1.0)),
        top_p=_number(body, "top_p", 0, 1, lo_open=True, default=d.get("top_p", 1.0)),
        top_k=max(top_k, 0),
        min_p=_number(body, "min_p", 0, 1, default=d.get("min_p", 0.0)),
        repetition_penalty=_number(body, "repetition_penalty", 0, 10, lo_open=True,
                                   default=d.get("repetition_penalty")),
        presence_penalty=_number(body, "presence_penalty", -2, 2, default=d.get("presence_penalty")),
        frequency_penalty=_number(body, "frequency_penalty", -2, 2, default=d.get("frequency_penalty")),
        seed=_number(body, "seed", 0, 2**63 - 1, integer=True),
        stop=list(stop), logprobs=logprobs, top_logprobs=top_logprobs, **more,
    )


def pixel_options(body) -> Dict[str, Optional[int]]:
    """A request's own min_pixels / max_pixels (checked against the server's cap in model_inputs.py)."""
    pixels = {k: _number(body, k, 1, integer=True) for k in ("min_pixels", "max_pixels")}
    if pixels["min_pixels"] and pixels["max_pixels"] and pixels["min_pixels"] > pixels["max_pixels"]:
        raise _invalid("min_pixels", "'min_pixels' is larger than 'max_pixels'")
    return pixels


def template_switches(kwargs):
    return _template_switches(kwargs or {})


def stopping(body, max_tokens) -> dict:
    """logit_bias (OpenAI: {"token id": bias in [-100, 100]}) and vLLM's stop_token_ids,
    min_tokens, ignore_eos → SamplingParams fields (token ids are checked against the vocabulary
    when the engine takes the request)."""
    out = {}
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise _invalid("logit_bias", "'logit_bias' must be an object {\"token id\": bias}", "invalid_type")
        if len(bias) > MAX_LOGIT_BIAS:
            raise _invalid("logit_bias", f"'logit_bias' may hold at most {MAX_LOGIT_BIAS} tokens")
        pairs = {}
        for key in bias:
            name = f"logit_bias.{key}"
            if not (key.isascii() and key.isdigit()) or len(key) > 12:
                raise _invalid(name, f"'logit_bias' keys are token ids (decimal strings), not {key[:40]!r}")
            pairs[int(key)] = number(bias, key, -100, 100, param=name)
        out["logit_bias"] = pairs or None
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or len(ids) > MAX_STOP_TOKEN_IDS or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in ids):
            raise _invalid("stop_token_ids", f"'stop_token_ids' must be a list of at most {MAX_STOP_TOKEN_IDS} token "
                           "ids (integers >= 0)")
        out["stop_token_ids"] = tuple(ids)
    min_tokens = _number(body, "min_tokens", 0, integer=True)
    if min_tokens is not None:
        if max_tokens is not None and min_tokens > max_tokens:
            raise _invalid("min_tokens", f"'min_tokens' ({min_tokens}) is larger than the request's max_tokens "
                           f"({max_tokens})")
        out["min_tokens"] = min_tokens
    if body.get("ignore_eos") is not None:
        out["ignore_eos"] = flag(body, "ignore_eos", None)
    return out


def kv_settings(body) -> Optional[dict]:
    """The KV cache settings a request may set (as mlx-lm names them; null: the server's)."""
    given = {k: body[k] for k in KV_FIELDS if body.get(k) is not None}
    if not given:
        return None
    try:
        KVSettings.build(**given, name=lambda f: f"'{f}'")
    except InputError as e:
        raise _invalid(next(iter(given)), str(e)) from None
    return given


# ----------------------------------------------------------------- shared by the other protocols


_FIELD = re.compile(r"[a-z_][a-z0-9_]*")
_TYPE_LABELS = {"str", "int", "float", "bool", "none", "list", "dict"}


def _path(loc, extra: bool) -> str:
    """A pydantic error location → the field's path as the client wrote it (`messages[2].content[0].
    image_url.url`): union members' labels (`str`, `list[...]`, `URL`, a tag such as `image_url part`)
    are left out."""
    out = ""
    for i, key in enumerate(loc):
        if isinstance(key, int):
            out += f"[{key}]"
        elif (extra and i == len(loc) - 1) or (_FIELD.fullmatch(key) and key not in _TYPE_LABELS):
            out += f".{key}" if out else key
    return out


def validate(model, body, refused=None):
    """`body` validated by the pydantic `model` (strict; unknown fields refused) → the model; else
    a 400 naming the first failing field by its path. `refused` {field: why}: fields the model
    holds only to refuse their values with a reason."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        errors = e.errors(include_url=False, include_context=False, include_input=False)
        # the deepest failure names the field (a union's other members fail at its top)
        first = max(errors, key=lambda err: len(_path(err["loc"], err["type"] == "extra_forbidden")))
        kind = first["type"]
        path = _path(first["loc"], kind == "extra_forbidden")
        if kind in ("union_tag_invalid", "union_tag_not_found"):
            path += ".type"
        top = path.split(".")[0].split("[")[0]
        if refused and top in refused:
            raise _invalid(top, f"'{top}' is not supported by this server: {refused[top]}",
                           "unsupported_field") from None
        if kind == "extra_forbidden":
            raise _invalid(path, f"'{path}' is not a field this server accepts here", "unknown_field") from None
        if kind == "missing":
            raise _invalid(path, f"'{path}' is required", "missing_field") from None
        same = [first["msg"]] + [err["msg"] for err in errors if _path(err["loc"], False) == path]
        kinds = " or ".join(dict.fromkeys(same))
        raise _invalid(path or None, f"'{path or 'the body'}' is not valid: {kinds}",
                       "invalid_type" if "type" in kind or kind.endswith("_type") else "invalid_value") from None


def invalid(param, message, code="invalid_value") -> APIError:
    return _invalid(param, message, code)


def number(body, name, lo=None, hi=None, *, integer=False, lo_open=False, default=None, param=None):
    """body[name] checked as a number in range (None → default); `param` names it in errors."""
    try:
        return _number(body, name, lo, hi, integer=integer, lo_open=lo_open, default=default)
    except APIError as e:
        if param is not None:
            e.param, e.message = param, e.message.replace(f"'{name}'", f"'{param}'")
            e.args = (e.message,)
        raise


def check_fields(obj, allowed, where, refused=None):
    """`obj` is an object whose keys are all in `allowed`: an unknown key is a 400 naming it (a
    field this server does not implement is never silently ignored); `refused` maps a known
    field to why it is refused."""
    if not isinstance(obj, dict):
        raise _invalid(where, f"'{where or 'the body'}' must be an object", "invalid_type")
    for key in obj:
        if refused and key in refused and obj[key] is not None:
            name = f"{where}.{key}" if where else key
            raise _invalid(name, f"'{name}' is not supported by this server: {refused[key]}", "unsupported_field")
        if key not in allowed:
            name = f"{where}.{key}" if where else key
            raise _invalid(name, f"'{name}' is not a field this server accepts here", "unknown_field")


def string(obj, key, where, *, required=False, default=None, empty=True):
    value = obj.get(key)
    name = f"{where}.{key}" if where else key
    if value is None:
        if required:
            raise _invalid(name, f"'{name}' is required", "missing_field")
        return default
    if not isinstance(value, str) or (not empty and not value):
        raise _invalid(name, f"'{name}' must be a {'non-empty ' if not empty else ''}string", "invalid_type")
    return value


def flag(obj, key, where, default=False):
    value = obj.get(key)
    name = f"{where}.{key}" if where else key
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _invalid(name, f"'{name}' must be true or false", "invalid_type")
    return value


def response_format(rf):
    """A chat-completions response_format, checked (None for plain text)."""
    return _check_response_format(rf)
