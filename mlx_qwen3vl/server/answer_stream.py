"""An answer as the Responses and Messages endpoints hand it out: reasoning (a `<think>` block),
text and `<tool_call>` calls, in order, split while it streams. A whole answer is split by feeding
it the same pieces, so a streamed response and a plain one hold the same parts.

Reasoning is the inside of a `<think>` block that opens the answer (after blank space), or, when the
prompt itself opened one (a thinking template), everything before the first `</think>`; the blank
space around it is dropped. Everything else is text, exactly as generated, except that with tools
the blank space next to a call is dropped (as chat completions strips content beside tool_calls).
"""

from typing import List, Optional, Tuple

from ..engine.answer import prompt_opens_thinking
from .tool_calls import ToolCallParser

OPEN, CLOSE = "<think>", "</think>"


def split_reasoning(text: str, opened: bool = False, final: bool = True) -> Tuple[Optional[str], str]:
    """(reasoning or None, text) of an answer so far. With final=False only what is decided: each
    result is a prefix of the next one (a stream sends the differences)."""
    start = 0
    if not opened:
        head = text.lstrip()
        if not head.startswith(OPEN):
            if not final and OPEN.startswith(head):  # it may still become <think>
                return None, ""
            return None, text
        start = len(text) - len(head) + len(OPEN)
    inner = text[start:]
    end = inner.find(CLOSE)
    if end >= 0:
        return inner[:end].strip(), inner[end + len(CLOSE):].lstrip()
    if final:
        return inner.strip(), ""
    keep = next((k for k in range(min(len(CLOSE) - 1, len(inner)), 0, -1) if inner.endswith(CLOSE[:k])), 0)
    return inner[:len(inner) - keep].strip(), ""  # trailing blanks wait: they may precede </think>


class AnswerStream:
    """A streamed answer → segments in order: ("reasoning", text), ("text", text), ("call", call)
    where a call is tool_calls.ToolCallParser's {"id", "type", "function": {"name", "arguments"}}.
    `tools`: parse `<tool_call>` blocks out of the text; `opened`: the prompt ends inside <think>;
    `reasoning=False`: no reasoning is split out (chat completions hands `<think>` text back as content)."""

    def __init__(self, tools: bool = False, opened: bool = False, reasoning: bool = True):
        self.opened, self.tools, self.split = opened, tools, reasoning
        self.whole, self.reasoning, self.text = "", "", ""
        self.has_reasoning = False
        self.parser = ToolCallParser() if tools else None
        self.held = ""  # blank text that may turn out to sit beside a call
        self.calls, self.sent_text, self.after_call = [], False, False

    def feed(self, piece: str, final: bool = False) -> List[tuple]:
        self.whole += piece
        reasoning, text = split_reasoning(self.whole, self.opened, final) if self.split else (None, self.whole)
        out = []
        if reasoning is not None:
            self.has_reasoning = True
            if reasoning[len(self.reasoning):]:
                out.append(("reasoning", reasoning[len(self.reasoning):]))
            self.reasoning = reasoning
        new, self.text = text[len(self.text):], text
        if self.parser is None:
            if new:
                out.append(("text", new))
                self.sent_text = True
        else:
            # a character at a time: text and calls come out in the order they were written
            for i, c in enumerate(new or [""]):
                content, calls = self.parser.feed(c, final=final and i == max(len(new) - 1, 0))
                out += self._text(content)
                for call in calls:
                    self.held, self.after_call = "", True
                    out.append(("call", call))
                    self.calls.append(call)
        if final:
            if self.held and (not self.calls or (self.sent_text and not self.after_call)):
                out.append(("text", self.held))
                self.sent_text = True
            self.held = ""
            if not out and not (self.sent_text or self.calls or self.has_reasoning):  # an empty answer's text
                out.append(("text", ""))
                self.sent_text = True
        return out

    def _text(self, content):
        whole = self.held + content
        body = whole.rstrip()
        if not body:  # blank so far: it waits for what follows
            self.held = whole
            return []
        self.held = whole[len(body):]
        if self.after_call:  # text after a call starts at its first visible character
            body, self.after_call = body.lstrip(), False
        self.sent_text = True
        return [("text", body)]

    def finish(self) -> List[tuple]:
        return self.feed("", final=True)

    @property
    def in_reasoning(self) -> bool:
        """Whether the answer so far ends inside its reasoning (its tokens count as reasoning)."""
        return (self.has_reasoning or self.opened) and CLOSE not in self.whole


prompt_opens_reasoning = prompt_opens_thinking  # the engine's test, for the server's callers
