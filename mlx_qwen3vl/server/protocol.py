"""What every protocol's request reading shares: the internal request (`ChatRequest`), errors
(`APIError`, OpenAI's error body `{"error": {"message", "type", "param", "code"}}`), the wire
models' base (`Wire`: strict, no unknown field; `one_of`: a union told apart by its `type`),
validation with errors named by the field's path (`validate`), the fields every protocol shares
(`Sampling`, `Rendering`, `Drafting`), and the value checks for sampling, stop strings, pixels,
template switches, KV settings and the output format.

Every check names the field (`param`) and what to send instead.
"""

import math
import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Dict, List, Optional, Union, get_args

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError

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


def invalid(param, message, code="invalid_value") -> APIError:
    """A 400 naming the field (`param`) in OpenAI's shape."""
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
    computer: Any = None  # a computer-use tool (agent.computer_tools.ComputerTool): the trained prompt renders
    thinking: Optional[str] = None  # "enabled" / "disabled": what the rendered prompt must do (Messages' thinking)
    max_tool_calls: Optional[int] = None  # calls one answer may carry; the model's further calls are dropped
    echo: Dict[str, Any] = field(default_factory=dict)  # the request's settings its answer repeats (Responses)
    drafting: Optional[dict] = None  # prompt_lookup / num_draft_tokens the request set (speculative decoding)
    conversation: str = "messages"  # the body's field holding the conversation: errors about it as a whole name it


def number(body, name, lo=None, hi=None, *, integer=False, lo_open=False, default=None, param=None):
    """body[name] checked as a number in range (None → default); `param` names it in errors."""
    value, label = body.get(name), param or name
    if value is None:
        return default
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise invalid(label, f"'{label}' must be {kind}, got {type(value).__name__}", "invalid_type")
    if not math.isfinite(value):
        raise invalid(label, f"'{label}' must be finite")
    if lo is not None and (value <= lo if lo_open else value < lo) or hi is not None and value > hi:
        lo_s = "" if lo is None else f"{'>' if lo_open else '>='} {lo}"
        hi_s = "" if hi is None else f"<= {hi}"
        raise invalid(label, f"'{label}' is {value}; it must be {' and '.join(s for s in (lo_s, hi_s) if s)}")
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
                    raise invalid(where, f"'{where or 'the body'}' holds a lone surrogate (\\ud800-\\udfff without "
                                  "its pair); send valid Unicode text", "invalid_text") from None
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > limit:
            raise invalid(where, f"the request body is nested deeper than {limit} levels", "too_deep")
        if isinstance(value, dict):
            for k, v in value.items():
                stack.append((k, depth, where))
                stack.append((v, depth + 1, f"{where}.{k}" if where else k))
        else:
            stack.extend((v, depth + 1, f"{where or ''}[{i}]") for i, v in enumerate(value))


def template_switches(kwargs) -> Dict[str, Any]:
    """chat_template_kwargs (an object, typed by the wire model), each key a TEMPLATE_SWITCHES one."""
    for key, value in (kwargs or {}).items():
        param = f"chat_template_kwargs.{key}"
        kind = TEMPLATE_SWITCHES.get(key)
        if kind is None:
            raise invalid(param, f"'chat_template_kwargs' may not set {key!r}; this server takes only "
                          + ", ".join(sorted(TEMPLATE_SWITCHES)), "unsupported_template_kwarg")
        if not isinstance(value, kind):
            raise invalid(param, f"'{param}' must be true or false", "invalid_type")
    return dict(kwargs or {})


def output_format(kind: Optional[str], schema=None, name: Optional[str] = None) -> Optional[dict]:
    """The one output format every protocol's spelling becomes: None (free text), json_object, or
    json_schema with its schema (compiled by llguidance when the prompt is built)."""
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": name or "response", "schema": schema}}
    return {"type": "json_object"} if kind == "json_object" else None


def stop_strings(stop, name="stop") -> List[str]:
    """A request's stop strings (a string or a list), checked against the limits."""
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP:
        raise invalid(name, f"'{name}' must be a non-empty string or a list of at most {MAX_STOP} of them")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise invalid(name, f"each '{name}' string must be at most {MAX_STOP_CHARS} characters")
    return stop


def sampling_params(body, stop=(), *, defaults=None, logprobs=False, top_logprobs=0, **more) -> SamplingParams:
    """The sampling fields of a request body (the Sampling model's) → SamplingParams; a field the body
    leaves out takes `defaults`' value, else OpenAI's default temperature (1.0), not the library's
    greedy one."""
    d = defaults or {}
    top_k = number(body, "top_k", -1, integer=True, default=d.get("top_k", 0))
    return SamplingParams(
        temperature=number(body, "temperature", 0, 2, default=d.get("temperature", 1.0)),
        top_p=number(body, "top_p", 0, 1, lo_open=True, default=d.get("top_p", 1.0)),
        top_k=max(top_k, 0),
        min_p=number(body, "min_p", 0, 1, default=d.get("min_p", 0.0)),
        repetition_penalty=number(body, "repetition_penalty", 0, 10, lo_open=True,
                                   default=d.get("repetition_penalty")),
        presence_penalty=number(body, "presence_penalty", -2, 2, default=d.get("presence_penalty")),
        frequency_penalty=number(body, "frequency_penalty", -2, 2, default=d.get("frequency_penalty")),
        seed=number(body, "seed", 0, 2**63 - 1, integer=True),
        stop=list(stop), logprobs=logprobs, top_logprobs=top_logprobs, **more,
    )


def pixel_options(body) -> Dict[str, Optional[int]]:
    """A request's own min_pixels / max_pixels (checked against the server's cap in model_inputs.py)."""
    pixels = {k: number(body, k, 1, integer=True) for k in ("min_pixels", "max_pixels")}
    if pixels["min_pixels"] and pixels["max_pixels"] and pixels["min_pixels"] > pixels["max_pixels"]:
        raise invalid("min_pixels", "'min_pixels' is larger than 'max_pixels'")
    return pixels


def stopping(body, max_tokens) -> dict:
    """logit_bias (OpenAI: {"token id": bias in [-100, 100]}) and vLLM's stop_token_ids,
    min_tokens, ignore_eos → SamplingParams fields (token ids are checked against the vocabulary
    when the engine takes the request)."""
    out = {}
    bias = body.get("logit_bias")
    if bias is not None:
        if len(bias) > MAX_LOGIT_BIAS:
            raise invalid("logit_bias", f"'logit_bias' may hold at most {MAX_LOGIT_BIAS} tokens")
        pairs = {}
        for key in bias:
            name = f"logit_bias.{key}"
            if not (key.isascii() and key.isdigit()) or len(key) > 12:
                raise invalid(name, f"'logit_bias' keys are token ids (decimal strings), not {key[:40]!r}")
            pairs[int(key)] = number(bias, key, -100, 100, param=name)
        out["logit_bias"] = pairs or None
    ids = body.get("stop_token_ids")
    if ids is not None:
        if len(ids) > MAX_STOP_TOKEN_IDS or not all(0 <= t < 2**31 for t in ids):  # ints: the wire model's
            raise invalid("stop_token_ids", f"'stop_token_ids' must be a list of at most {MAX_STOP_TOKEN_IDS} token "
                          "ids (integers >= 0)")
        out["stop_token_ids"] = tuple(ids)
    min_tokens = number(body, "min_tokens", 0, integer=True)
    if min_tokens is not None:
        if max_tokens is not None and min_tokens > max_tokens:
            raise invalid("min_tokens", f"'min_tokens' ({min_tokens}) is larger than the request's max_tokens "
                          f"({max_tokens})")
        out["min_tokens"] = min_tokens
    if body.get("ignore_eos") is not None:
        out["ignore_eos"] = body["ignore_eos"]  # a bool: the wire model typed it
    return out


def kv_settings(body) -> Optional[dict]:
    """The KV cache settings a request may set (as mlx-lm names them; null: the server's)."""
    given = {k: body[k] for k in KV_FIELDS if body.get(k) is not None}
    if not given:
        return None
    try:
        KVSettings.build(**given, name=lambda f: f"'{f}'")
    except InputError as e:
        raise invalid(next(iter(given)), str(e)) from None
    return given


# ------------------------------------------------------------------------------ the wire models


class Wire(BaseModel):
    """A protocol's wire object: strict types (no string for a number, no number for a string), and
    every field known (an unknown one is a 400 naming its path)."""

    model_config = ConfigDict(extra="forbid", strict=True)


Number = Optional[float]  # strict: an int or a float, never a bool or a string


class Sampling(Wire):
    """The sampling fields every protocol takes (their ranges are sampling_params', by name)."""

    temperature: Number = None
    top_p: Number = None
    top_k: Optional[int] = None
    min_p: Number = None
    repetition_penalty: Number = None
    presence_penalty: Number = None
    frequency_penalty: Number = None
    seed: Optional[int] = None


class Rendering(Wire):
    """This server's own fields, in every protocol: pixels per image, the template's switches."""

    min_pixels: Optional[int] = None
    max_pixels: Optional[int] = None
    chat_template_kwargs: Optional[Dict[str, Any]] = None


MAX_REQUEST_DRAFT = 16  # a request's prompt_lookup and num_draft_tokens at most: a batch's verify forward is as
# long as its longest row's drafts, and a lookup scans the history once per n each step
DraftCount = Optional[Annotated[int, Field(ge=0, le=MAX_REQUEST_DRAFT)]]


class Drafting(Wire):
    """Speculative decoding's settings, this server's in every protocol that answers (lossless: only
    the speed changes): prompt lookup's longest n-gram (0: none; it replaces the server's drafter)
    and the draft tokens checked per step (0: none)."""

    prompt_lookup: DraftCount = None
    num_draft_tokens: DraftCount = None


def drafting_settings(wire: Drafting) -> Optional[dict]:
    """The speculative decoding settings the request set (None: the server's)."""
    return wire.model_dump(include={"prompt_lookup", "num_draft_tokens"}, exclude_none=True) or None


class OpenAIHints(Wire):
    """OpenAI's identifiers and routing hints: accepted, with no effect on what a local server answers."""

    user: Optional[str] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    service_tier: Optional[str] = None


def one_of(*models, key: str = "type", default=None):
    """The wire models as one field, told apart by the value of their `key` (each model's Literal):
    pydantic's tagged union, so an error names the member's own field, and an unknown value is a 400
    naming what this server takes there. `default(value)`: the member of a value without `key`."""
    tags = {}
    for m in models:
        values = get_args(m.model_fields[key].annotation)
        tags.update((v, "<" + "|".join(values) + ">") for v in values)  # not a field name: error paths skip it

    def tag(value):
        kind = value.get(key) if isinstance(value, dict) else getattr(value, key, None)
        if kind is None and default is not None and isinstance(value, dict):
            kind = default(value)
        return None if kind is None else tags.get(kind, f"<{str(kind)[:60]}>") if isinstance(kind, str) else "<?>"

    members = tuple(Annotated[m, Tag(tags[get_args(m.model_fields[key].annotation)[0]])] for m in models)
    return Annotated[Union[members], Discriminator(tag)]


_FIELD = re.compile(r"[a-z_][a-z0-9_]*")
_TYPE_LABELS = {"str", "int", "float", "bool", "none", "list", "dict"}


def _path(loc, extra: bool) -> str:
    """A pydantic error location → the field's path as the client wrote it (`messages[2].content[0].
    image_url.url`): union members' labels (`str`, `list[...]`, `URL`, a tag such as `<image_url>`)
    are left out."""
    out = ""
    for i, key in enumerate(loc):
        if isinstance(key, int):
            out += f"[{key}]"
        elif (extra and i == len(loc) - 1) or (_FIELD.fullmatch(key) and key not in _TYPE_LABELS):
            out += f".{key}" if out else key
    return out


def _refusal(refused, path: str, tag: Optional[str]):
    """→ (the refused field's path, why) where `refused` names `path` (or what holds it), else None."""
    plain = re.sub(r"\[\d+\]", "", path)  # indices left out
    for key, why in refused.items():
        if key[0] == "." and plain.endswith(key) or tag is not None and key == f"{plain}={tag}":
            return path, why
        if plain == key or plain.startswith(key + "."):  # the field itself, not what it holds
            return re.sub(r"(\[\d+\])+$", "", ".".join(path.split(".")[:key.count(".") + 1])), why
    return None


def validate(model, body, refused=None):
    """`body` validated by the pydantic `model` → the model; else a 400 naming the failing field by
    its path (a refused one first, else the deepest: a union's other members fail at its top).
    `refused` {path: why}: what this server knows and refuses, with the reason: a field and what is
    inside it (`store`, `reasoning.effort`; indices left out), a field anywhere (`.file_id`), or a
    member of a tagged union (`tools.type=web_search`)."""
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be a JSON object", "invalid_type")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        errors = e.errors(include_url=False, include_input=False)
    found = []
    for err in errors:
        kind, ctx = err["type"], err.get("ctx") or {}
        path, tag = _path(err["loc"], kind == "extra_forbidden"), None
        if kind in ("union_tag_invalid", "union_tag_not_found"):
            path = f"{path}.type" if path else "type"
            tag = ctx.get("tag", "<?>")[1:-1] if kind == "union_tag_invalid" else None
        found.append((_refusal(refused or {}, path, tag) is None, -len(path), err, path, tag))
    _, _, first, path, tag = min(found, key=lambda f: f[:2])
    kind, refusal = first["type"], _refusal(refused or {}, path, tag)
    if refusal is not None:
        where, why = refusal
        raise invalid(where, f"'{where}'{f' {tag!r}' if tag else ''} is not supported by this server: {why}",
                      "unsupported_field")
    if kind == "extra_forbidden":
        raise invalid(path, f"'{path}' is not a field this server accepts here", "unknown_field")
    if kind in ("missing", "union_tag_not_found"):
        raise invalid(path, f"'{path}' is required", "missing_field")
    if kind == "union_tag_invalid":
        takes = ", ".join(t.strip("'<>") for t in first["ctx"]["expected_tags"].replace("|", "', '").split(", "))
        raise invalid(path, f"'{path}' is {tag!r}; here this server takes {takes}")
    same = [first["msg"]] + [err["msg"] for err in errors if _path(err["loc"], False) == path]
    kinds = " or ".join(dict.fromkeys(same))
    raise invalid(path or None, f"'{path or 'the body'}' is not valid: {kinds}",
                  "invalid_type" if "type" in kind or kind.endswith("_type") else "invalid_value")


