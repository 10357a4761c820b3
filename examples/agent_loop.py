"""A GUI-agent loop on ChatSession: each turn sends the next screenshot, the model answers with one
action (a Qwen3-VL `computer_use` tool call, or a UI-Venus action), and the action is parsed into
pixels of that screenshot. The conversation keeps every answer but only the last N screenshots.

    python examples/agent_loop.py --model tests/fixtures/tiny-a --task "Lower the brightness" \
        --screenshots examples/screenshot.png examples/screenshot.png examples/screenshot.png

Here the "screen" is a list of files; a real agent would execute `action` (click at
action.point, type action.args["text"], ...) and take a new screenshot. The tiny test checkpoint
has random weights, so its answers parse to nothing: it only shows that the loop runs.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from mlx_qwen3vl import ChatSession, load  # noqa: E402
from mlx_qwen3vl.agent import computer_use_system_prompt, parse_action  # noqa: E402

OMITTED = {"type": "text", "text": "(an earlier screenshot, omitted)"}


def keep_last_images(messages, n):
    """Replace all but the last `n` images in the conversation with a short text. The session's
    cache is reused up to the first changed turn, so trimming costs a re-read of the turns after
    the dropped image; keeping more images trades memory for less of that."""
    seen = 0
    for message in reversed(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for i in reversed(range(len(content))):
            if content[i].get("type") == "image":
                seen += 1
                if seen > n:
                    content[i] = dict(OMITTED)


def run(model, processor, task, screenshots, keep_images=2, max_tokens=256, on_step=None):
    """Drive one task over the screenshots; returns one record per step."""
    from PIL import Image

    session = ChatSession(model, processor, system=computer_use_system_prompt(), max_tokens=max_tokens)
    steps = []
    for n, shot in enumerate(screenshots):
        with Image.open(shot) as im:
            width, height = im.size
        text = task if n == 0 else "This is the screen after your last action. Continue the task."
        answer = session.send(text, images=[shot])
        action = parse_action(answer, width, height)
        keep_last_images(session.messages, keep_images)
        step = {"step": n, "screenshot": str(shot), "answer": answer,
                "action": action.to_dict() if action else None,
                "cached_tokens": session.last.cached_tokens if session.last else 0}
        steps.append(step)
        if on_step:
            on_step(step)
        if action and (action.name in ("terminate", "answer", "Finished", "CallUser")):
            break
    return steps, session


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tests/fixtures/tiny-a")
    p.add_argument("--task", default="Lower the screen brightness, then apply the change.")
    p.add_argument("--screenshots", nargs="+", default=["examples/screenshot.png"] * 3)
    p.add_argument("--keep-images", type=int, default=2, help="screenshots kept in the conversation")
    p.add_argument("--max-tokens", type=int, default=256)
    args = p.parse_args(argv)
    model, processor = load(args.model)

    def show(step):
        action = step["action"]
        what = f"{action['name']} {action['args']}" if action else f"(no action parsed from {step['answer'][:60]!r})"
        print(f"step {step['step']}: {what}  [{step['cached_tokens']} prompt tokens reused]")

    steps, _ = run(model, processor, args.task, args.screenshots, args.keep_images, args.max_tokens, show)
    return steps


if __name__ == "__main__":
    main()
