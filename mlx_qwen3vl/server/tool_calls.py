"""Qwen3-VL tool calls in the answer text → OpenAI `tool_calls`.

The chat template asks for each call as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.
`ToolCallParser` splits a streamed answer into content and complete calls: text that could be the
start of `<tool_call>` is held back until it is resolved, and a call is handed out when its closing
tag arrives.
"""

import json
import uuid

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def _call(body: str):
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}}


class ToolCallParser:
    def __init__(self):
        self.buffer = ""
        self.in_call = False
        self.calls = []

    def feed(self, text: str, final: bool = False):
        """→ (content to send now, [new complete calls])."""
        self.buffer += text
        content, new = "", []
        while True:
            if not self.in_call:
                i = self.buffer.find(OPEN)
                if i < 0:
                    keep = 0 if final else next((k for k in range(min(len(OPEN) - 1, len(self.buffer)), 0, -1)
                                                 if self.buffer.endswith(OPEN[:k])), 0)
                    content += self.buffer[:len(self.buffer) - keep]
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    break
                content += self.buffer[:i]
                self.buffer = self.buffer[i + len(OPEN):]
                self.in_call = True
            else:
                j = self.buffer.find(CLOSE)
                if j < 0:
                    if final:  # an unfinished call: hand it back as text, nothing is lost
                        call = _call(self.buffer.strip())
                        if call:
                            new.append(call)
                        else:
                            content += OPEN + self.buffer
                        self.buffer = ""
                    break
                body, self.buffer = self.buffer[:j], self.buffer[j + len(CLOSE):]
                self.in_call = False
                call = _call(body.strip())
                if call:
                    new.append(call)
                else:
                    content += OPEN + body + CLOSE
        self.calls += new
        return content, new


def split_tool_calls(text: str):
    """A whole answer → (content or None, tool calls)."""
    parser = ToolCallParser()
    content, calls = parser.feed(text, final=True)
    return (content.strip() or None) if calls else content, calls
