"""OpenAI chat completions: POST /v1/chat/completions, its answer and its stream chunks.

The request is read into a ChatRequest (protocol.parse_chat_request), built into model inputs
(PromptBuilder) and answered from the engine's events. The answer goes through
answer.AnswerStream whether it streams or not (tool calls split out, the blank space beside a
call dropped), so a streamed answer's content adds up to the plain answer's, whitespace included.
"""

import json
import time
import uuid

from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from . import protocol as P
from .answer import AnswerStream
from .protocol import APIError


def completion_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex[:24]


def usage(prompt_tokens, completion_tokens, cached_tokens) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def chat_response(cid, model, message, finish_reason, logprobs, use) -> dict:
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}],
            "usage": use}


def chunk(cid, model, delta=None, finish_reason=None, logprobs=None, use=None, choices=True) -> dict:
    out = {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
           "choices": [{"index": 0, "delta": delta or {}, "logprobs": logprobs, "finish_reason": finish_reason}]
           if choices else []}
    if use is not None:
        out["usage"] = use
    return out


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class Answer:
    """One chat answer as its token events arrive: content and tool calls, and the chunks a
    stream sends for each event."""

    def __init__(self, req: P.ChatRequest, cid: str, model: str):
        self.req, self.cid, self.model = req, cid, model
        self.parts = AnswerStream(tools=bool(req.tools) and req.tool_choice != "none", reasoning=False)
        self.content, self.calls, self.logprobs = [], [], []

    def _chunks(self, segments, lp=None) -> list:
        text = "".join(v for kind, v in segments if kind == "text")
        self.content.append(text)
        out = [chunk(self.cid, self.model, {"content": text}, logprobs=lp)] if text or lp else []
        for kind, call in segments:
            if kind == "call":
                out.append(chunk(self.cid, self.model, {"tool_calls": [{"index": len(self.calls), **call}]}))
                self.calls.append(call)
        return out

    def token(self, ev) -> list:
        if "logprobs" in ev:
            self.logprobs.append(ev["logprobs"])
        return self._chunks(self.parts.feed(ev["text"]), {"content": [ev["logprobs"]]} if "logprobs" in ev else None)

    def done(self, ev) -> list:
        out = self._chunks(self.parts.finish())
        self.finish = "tool_calls" if self.calls else ev["finish_reason"]
        self.usage = usage(ev["prompt_tokens"], ev["completion_tokens"], ev["cached_tokens"])
        out.append(chunk(self.cid, self.model, finish_reason=self.finish))
        if self.req.include_usage:
            out.append(chunk(self.cid, self.model, use=self.usage, choices=False))
        return out

    def response(self) -> dict:
        content = "".join(self.content)
        message = {"role": "assistant", "content": content}
        if self.calls:
            message = {"role": "assistant", "content": content or None, "tool_calls": self.calls}
        return chat_response(self.cid, self.model, message, self.finish,
                             {"content": self.logprobs} if self.logprobs else None, self.usage)


def routes(service) -> list:
    def build(req):
        return service.builder.build(req), None

    async def create(request):
        req, _, _, handle = await service.admit(request, P.parse_chat_request, build)
        answer = Answer(req, completion_id(), req.model or service.model_id)
        if req.stream:
            return StreamingResponse(_stream(service, handle, answer), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        done = await service.collect(request, handle, on_token=answer.token)
        if done is None:  # the client went away
            return JSONResponse({}, status_code=499)
        answer.done(done)
        return JSONResponse(answer.response())

    return [Route("/v1/chat/completions", create, methods=["POST"])]


async def _stream(service, handle, answer: Answer):
    finished = False
    try:
        yield _sse(chunk(answer.cid, answer.model, {"role": "assistant", "content": ""}))
        while True:
            ev = await service.next_event(handle)
            if ev["type"] == "error":
                finished = True
                yield _sse(ev["error"].body())
                break
            if ev["type"] == "token":
                for c in answer.token(ev):
                    yield _sse(c)
                continue
            finished = True
            for c in answer.done(ev):
                yield _sse(c)
            break
    except Exception as e:  # noqa: BLE001 — the headers are sent: end the stream with an error event
        finished = True
        error = e if isinstance(e, APIError) else APIError(500, f"internal error: {type(e).__name__}: {e}",
                                                           code="internal_error")
        yield _sse(error.body())
    finally:
        service.release(handle, finished)
    yield "data: [DONE]\n\n"
