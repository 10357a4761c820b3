"""The OpenAI chat-completions wire format: request validation into `ChatRequest`, error bodies,
and the response / stream-chunk dictionaries.

Every check names the field (`param`) and what to send instead, and answers with OpenAI's error
body `{"error": {"message", "type", "param", "code"}}`.
"""

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from ..errors import InputError
from ..kv_settings import FIELDS as KV_FIELDS, KVSettings
from ..sampling import SamplingParams

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP = 16
MAX_STOP_CHARS = 256  # each stop string is searched for after every token
MAX_TOP_LOGPROBS = 20
MAX_JSON_DEPTH = 64  # nesting of the request body (a JSON schema included)
MAX_LOGIT_BIAS = 300  # entries of logit_bias (OpenAI's bound), each a bias in [-100, 100]
MAX_STOP_TOKEN_IDS = 64
# Every field a chat-completions body may hold; any other is a 400 naming it (never ignored).
CHAT_FIELDS = {
    # OpenAI's, implemented
    "messages", "model", "stream", "stream_options", "n", "max_tokens", "max_completion_tokens", "stop",
    "temperature", "top_p", "presence_penalty", "frequency_penalty", "seed", "logprobs", "top_logprobs",
    "logit_bias", "tools", "tool_choice", "parallel_tool_calls", "response_format", "modalities", "store",
    # OpenAI's identifiers and routing hints: no effect on what a local server answers
    "user", "safety_identifier", "prompt_cache_key", "service_tier",
    # vLLM's extensions (extra_body), implemented
    "top_k", "min_p", "repetition_penalty", "stop_token_ids", "min_tokens", "ignore_eos", "chat_template",
    "chat_template_kwargs", "mm_processor_kwargs",
    # this server's: pixels per image, the KV cache's storage
    "min_pixels", "max_pixels", *("kv_bits", "kv_group_size", "quantized_kv_start")}
CHAT_REFUSED = {
    "max_new_tokens": "use 'max_tokens' (or 'max_completion_tokens'), as OpenAI and vLLM name it",
    "functions": "use 'tools'", "function_call": "use 'tool_choice'",
    "audio": "this model answers in text", "prediction": "predicted outputs are not available here",
    "reasoning_effort": "this checkpoint's thinking is switched by 'chat_template_kwargs': {'enable_thinking': ...}",
    "verbosity": "not available here", "web_search_options": "web search is not available here",
    "metadata": "completions are not stored here"}
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
    messages: List[dict]  # OpenAI messages, validated (media URLs still unresolved)
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
    media_params: Optional[Dict[tuple, str]] = None  # {(message, part): param} where another protocol named it


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


def _check_content(i, message):
    role = message["role"]
    content = message.get("content")
    param = f"messages[{i}].content"
    if content is None:
        if role == "assistant" and message.get("tool_calls"):
            return
        raise _invalid(param, f"'{param}' is missing; send a string or a list of content parts", "missing_field")
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise _invalid(param, f"'{param}' must be a string or a list of content parts", "invalid_type")
    for j, part in enumerate(content):
        p = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise _invalid(p, f"'{p}' must be an object with a 'type'", "invalid_type")
        kind = part.get("type")
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise _invalid(f"{p}.text", f"'{p}.text' must be a string", "invalid_type")
        elif kind in ("image_url", "video_url"):
            ref = part.get(kind)
            url = ref.get("url") if isinstance(ref, dict) else ref
            if not isinstance(url, str) or not url:
                raise _invalid(f"{p}.{kind}.url", f"'{p}.{kind}.url' must be a non-empty string", "invalid_type")
            if role not in ("user", "tool"):  # the chat template renders media only there
                raise _invalid(p, f"'{p}' is {'a video' if kind == 'video_url' else 'an image'} in a {role} message, "
                               "where the chat template renders no media; send it in a user or tool message")
        else:
            raise _invalid(f"{p}.type", f"'{p}.type' is {kind!r}; use 'text', 'image_url' or 'video_url'")


def _check_tools(tools, tool_choice):
    if tools is None:
        return
    if not isinstance(tools, list):
        raise _invalid("tools", "'tools' must be a list of {'type': 'function', 'function': {...}}", "invalid_type")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or tool.get("type", "function") != "function":
            raise _invalid(f"tools[{i}]", f"'tools[{i}]' must be {{'type': 'function', 'function': {{'name': ...}}}}")
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            raise _invalid(f"tools[{i}].function.parameters", "function parameters must be a JSON schema object")
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice.get("function"), dict) else None
        if name not in {t["function"]["name"] for t in tools}:
            raise _invalid("tool_choice", f"'tool_choice' names function {name!r}, which is not in 'tools'")
    elif tool_choice not in ("auto", "none", "required"):
        raise _invalid("tool_choice", "'tool_choice' must be 'auto', 'none', 'required' or {'type': 'function', ...}")


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
    """A request's own min_pixels / max_pixels (checked against the server's cap in prompts.py)."""
    pixels = {k: _number(body, k, 1, integer=True) for k in ("min_pixels", "max_pixels")}
    if pixels["min_pixels"] and pixels["max_pixels"] and pixels["min_pixels"] > pixels["max_pixels"]:
        raise _invalid("min_pixels", "'min_pixels' is larger than 'max_pixels'")
    return pixels


def template_switches(kwargs):
    return _template_switches(kwargs or {})


def parse_chat_request(body) -> ChatRequest:
    if not isinstance(body, dict):
        raise _invalid(None, "the request body must be a JSON object", "invalid_type")
    check_fields(body, CHAT_FIELDS, None, CHAT_REFUSED)
    if body.get("modalities") not in (None, ["text"]):
        raise _invalid("modalities", "'modalities' may only be [\"text\"]: this model answers in text",
                       "unsupported_field")
    if body.get("store") not in (None, False):
        raise _invalid("store", "'store' must be false: completions are not stored here", "unsupported_field")
    if body.get("parallel_tool_calls") not in (None, True):
        raise _invalid("parallel_tool_calls", "'parallel_tool_calls' must be true: this model may answer with "
                       "several calls and the server does not cut them", "unsupported_field")
    messages = body.get("messages")
    if messages is None:
        raise _invalid("messages", "'messages' is required", "missing_field")
    if not isinstance(messages, list) or not messages:
        raise _invalid("messages", "'messages' must be a non-empty list", "invalid_type")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _invalid(f"messages[{i}]", f"'messages[{i}]' must be an object with 'role' and 'content'",
                           "invalid_type")
        if m.get("role") not in ROLES:
            raise _invalid(f"messages[{i}].role", f"'messages[{i}].role' is {m.get('role')!r}; use one of "
                           + ", ".join(ROLES))
        _check_content(i, m)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _invalid("model", "'model' must be a string", "invalid_type")
    for name in ("stream", "logprobs"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise _invalid(name, f"'{name}' must be true or false", "invalid_type")
    n = _number(body, "n", 1, 1, integer=True)
    del n  # one choice per request (n > 1 is refused above)

    max_tokens = _number(body, "max_completion_tokens", 1, integer=True)
    if max_tokens is None:
        max_tokens = _number(body, "max_tokens", 1, integer=True)
    stop = stop_strings(body.get("stop"), "stop")
    top_logprobs = _number(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, integer=True, default=0)
    if top_logprobs and not body.get("logprobs"):
        raise _invalid("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    sampling = sampling_params(body, stop, logprobs=bool(body.get("logprobs")), top_logprobs=top_logprobs,
                               **_stopping(body, max_tokens))
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise _invalid("stream_options", "'stream_options' must be an object", "invalid_type")
    tools, tool_choice = body.get("tools"), body.get("tool_choice", "auto")
    _check_tools(tools, tool_choice)
    mm = body.get("mm_processor_kwargs") or {}
    if not isinstance(mm, dict):
        raise _invalid("mm_processor_kwargs", "'mm_processor_kwargs' must be an object", "invalid_type")
    for key in mm:
        if key not in ("min_pixels", "max_pixels"):
            raise _invalid(f"mm_processor_kwargs.{key}", f"'mm_processor_kwargs' may not set {key!r}; this server "
                           "takes only min_pixels, max_pixels", "unsupported_processor_kwarg")
    pixels = {k: _number(body, k, 1, integer=True, default=_number(mm, k, 1, integer=True))
              for k in ("min_pixels", "max_pixels")}
    if pixels["min_pixels"] and pixels["max_pixels"] and pixels["min_pixels"] > pixels["max_pixels"]:
        raise _invalid("min_pixels", "'min_pixels' is larger than 'max_pixels'")
    if body.get("chat_template") is not None:
        raise _invalid("chat_template", "'chat_template' cannot be sent; this server renders with its checkpoint's "
                       "template (switches go in 'chat_template_kwargs')", "unsupported_field")
    kwargs = _template_switches(body.get("chat_template_kwargs") or {})
    kv = _kv_settings(body)
    return ChatRequest(
        messages=messages, sampling=sampling, max_tokens=max_tokens, model=model, stream=bool(body.get("stream")),
        include_usage=bool(stream_options.get("include_usage")), tools=tools or None,
        tool_choice=tool_choice if tools else "none", response_format=_check_response_format(body.get("response_format")),
        chat_template_kwargs=kwargs, kv=kv, **pixels,
    )


def _stopping(body, max_tokens) -> dict:
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


def _kv_settings(body) -> Optional[dict]:
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
