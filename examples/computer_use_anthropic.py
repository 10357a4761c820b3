"""A computer-use agent loop written against Anthropic's own client, pointed at this project's local
server: the same code drives a hosted Claude with a different base URL and model name.

    python -m mlx_qwen3vl.server --model path/to/Qwen3-VL-or-UI-Venus [--agent-format venus]   # one terminal
    python examples/computer_use_anthropic.py --task "Open the display settings"                 # another

The server renders the request with the checkpoint's trained computer-use prompt and answers with
`tool_use` blocks of the `computer` tool in the declared display's pixels. Here the "computer" is
simulated: each action is printed, and its tool_result carries the next file of --screenshots
(cycled) and a line saying which step was done. A real agent would carry out block.input (click at
`coordinate`, type `text`, ...) with pyautogui or xdotool and send a fresh screenshot. The loop ends
when the model answers without a tool call (it says the task is done, or asks something), or after
--max-steps.

The tiny test checkpoint has random weights, so against it the model answers text at once; the
project's tests run this script against a scripted checkpoint that clicks, types and finishes.
"""

import argparse
import base64
import sys
from pathlib import Path

import anthropic

HERE = Path(__file__).resolve().parent


def image_block(path: Path) -> dict:
    data = base64.b64encode(path.read_bytes()).decode()
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}


def describe(action: dict) -> str:
    """One line for an action the simulated computer 'carries out'."""
    name = action.get("action")
    args = ", ".join(f"{k}={v}" for k, v in action.items() if k != "action")
    return f"{name}({args})"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8080", help="the server (no /v1)")
    p.add_argument("--api-key", default="unused", help="the server's --api-key, if it has one")
    p.add_argument("--model", default="local", help="any name: the server answers with its own model")
    p.add_argument("--task", default="Open the display settings.")
    p.add_argument("--screenshots", nargs="+", type=Path, default=[HERE / "screenshot.png"])
    p.add_argument("--display", default="1366x768", help="the screen's size in pixels, as the tool declares it")
    p.add_argument("--max-steps", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--max-pixels", type=int, default=None, help="the server's per-request screenshot budget")
    args = p.parse_args(argv)
    width, height = (int(v) for v in args.display.lower().split("x"))

    client = anthropic.Anthropic(base_url=args.base_url, api_key=args.api_key, max_retries=0)
    tools = [{"type": "computer_20251124", "name": "computer", "display_width_px": width, "display_height_px": height}]
    # The SDK has no temperature argument here: sampling options go in the body (the server reads them).
    extra = {"temperature": 0.0, **({"max_pixels": args.max_pixels} if args.max_pixels else {})}
    messages = [{"role": "user", "content": [{"type": "text", "text": args.task}, image_block(args.screenshots[0])]}]
    for step in range(1, args.max_steps + 1):
        reply = client.beta.messages.create(model=args.model, max_tokens=args.max_tokens, tools=tools,
                                            messages=messages, betas=["computer-use-2025-11-24"], extra_body=extra)
        calls = []
        for block in reply.content:
            if block.type == "thinking":
                print(f"step {step} thinks: {block.thinking}")
            elif block.type == "text" and block.text:
                print(f"step {step} says: {block.text}")
            elif block.type == "tool_use":
                calls.append(block)
                print(f"step {step} does: {describe(block.input)}")
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
        if reply.stop_reason != "tool_use":
            print(f"done after {step} step(s): {reply.stop_reason}")
            return 0
        screenshot = args.screenshots[step % len(args.screenshots)]  # the screen after the actions
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call.id,
             "content": [{"type": "text", "text": f"Step {step} done."}, image_block(screenshot)]}
            for call in calls]})
    print(f"stopped after {args.max_steps} steps")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except anthropic.APIError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
