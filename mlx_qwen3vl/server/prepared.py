"""A chat request turned into model inputs (built off the model thread, by model_inputs.py) and what
the HTTP side holds while it runs: the unit the model thread, the engine and the other ranks
(replica.py) pass around."""

import asyncio
import dataclasses
from dataclasses import dataclass, field
from typing import List, Optional

from ..engine import Request
from ..engine.drafting import drafting as drafts_of
from ..kv_settings import KVSettings
from ..sampling import SamplingParams


@dataclass
class Prepared:
    """A request turned into model inputs (built off the worker thread)."""

    inputs: dict
    tokens: List[int]  # the prompt's token ids
    media: list  # spans.media_keys: (kind, start, end, content hash) per image / video
    sampling: SamplingParams
    max_tokens: int
    grammar: Optional[list] = None  # the grammar's description (grammar.GrammarFactory.build)
    processors: list = field(default_factory=list)  # extra mlx-lm-style logits processors (grammar)
    kv: Optional[dict] = None  # the request's KV cache settings over the server's (None: the server's)
    drafting: Optional[dict] = None  # the request's prompt_lookup / num_draft_tokens (None: the server's)

    @property
    def prompt_tokens(self) -> int:
        return len(self.tokens)

    def request(self, rid: int, kv_base: Optional[KVSettings] = None, drafting: Optional[dict] = None) -> Request:
        """The engine's request, named `rid`; its KV settings are what it set over `kv_base`
        (the engine's), or the engine's when it set none; its drafter the server's (`drafting`:
        Request's drafter / num_draft_tokens), or prompt lookup of the n it set (0: none), with
        the num_draft_tokens it set."""
        kv = KVSettings.pop_from(dict(self.kv), kv_base) if self.kv else None
        drafts = dict(drafting or {})
        if self.drafting:
            if "prompt_lookup" in self.drafting:
                drafts = drafts_of(prompt_lookup=self.drafting["prompt_lookup"],
                                   num_draft_tokens=drafts.get("num_draft_tokens"))
            if drafts and "num_draft_tokens" in self.drafting:
                drafts["num_draft_tokens"] = self.drafting["num_draft_tokens"]
        return Request(self.inputs, dataclasses.replace(self.sampling, max_tokens=self.max_tokens),
                       processors=self.processors, id=rid, tokens=self.tokens, media=self.media, kv=kv, **drafts)


@dataclass
class TokenEvent:
    """A generated token: the text it releases (stop-string hold-back applied) and, when the request
    asked for logprobs, its OpenAI-shaped entry."""

    text: str
    token: int
    logprobs: Optional[dict] = None


@dataclass
class DoneEvent:
    """The answer ended: why, the stop string that fired (if one did), its usage. `text`: the whole
    answer, where a caller collected it (Service.collect)."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    stop: Optional[str] = None
    text: str = ""
    draft_proposed: int = 0  # speculative decoding: draft tokens proposed, and of them kept
    draft_accepted: int = 0


@dataclass
class ErrorEvent:
    """The request failed (its inputs, its grammar, the server stopping): the API error to answer."""

    error: Exception


class Handle:
    """A submitted request as the HTTP side sees it: events arrive on an asyncio queue."""

    listening = True

    def __init__(self, prepared: Prepared, loop: asyncio.AbstractEventLoop):
        self.prepared = prepared
        self.id = None  # set when admitted: the request's name in the engine and in messages to other ranks
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancelled = False

    def emit(self, event):
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the event loop has closed (server shutting down)
            pass

    def cancel(self):
        self.cancelled = True
