"""A GUI-agent loop on ChatSession: each turn sends the next screenshot, the model answers with one
action (a Qwen3-VL `computer_use` tool call, or a UI-Venus action), and the action is parsed into
pixels of that screenshot. The conversation keeps every answer but only the last N screenshots.

    python examples/agent_loop.py                     # the tiny test checkpoint, examples/screenshot.png x3
    python examples/agent_loop.py --model Qwen/Qwen3-VL-2B-Instruct --task "Lower the brightness" \
        --screenshots shot1.png shot2.png shot3.png

Here the "screen" is a list of files; a real agent would execute `action` (click at
action.point, type action.args["text"], ...) and take a new screenshot, and may save each one to
the same file: ChatSession reads every turn's screenshot when the turn is sent. The tiny test
checkpoint has random weights, so its answers parse to nothing: it only shows that the loop runs.

Without --max-pixels, each screenshot gets the largest pixel budget with which the system prompt,
every step's text and answer (--max-tokens) and the last --keep-images screenshots fit the model's
context (at most 1280*28*28 pixels, the budget Qwen's agent examples use): the tiny checkpoint's
context is 4096 tokens, of which its tokenizer spends about 3000 on the tool-declaring system prompt.
"""

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout without installing

from mlx_qwen3vl import ChatSession, ContextLengthError, InputError, load, resolve_model_path  # noqa: E402
from mlx_qwen3vl.agent import computer_use_system_prompt, parse_action  # noqa: E402
from mlx_qwen3vl.agent.runner import OMITTED, keep_last_images  # noqa: E402
from mlx_qwen3vl.media import image_size  # noqa: E402
from mlx_qwen3vl.cli import run as run_cli  # noqa: E402

DEFAULT_MODEL = HERE.parent / "tests" / "fixtures" / "tiny-a"
DEFAULT_SCREENSHOTS = [HERE / "screenshot.png"] * 3
NEXT_STEP = "This is the screen after your last action. Continue the task."
AGENT_MAX_PIXELS = 1280 * 28 * 28


def fitting_max_pixels(model, processor, task, steps, keep_images, max_tokens):
    """The largest screenshot budget (pixels) with which `steps` turns fit the model's context:
    the system prompt, each turn's text, its answer of up to `max_tokens` tokens, and the last
    `keep_images` screenshots."""
    count = lambda text: len(processor.tokenizer(text)["input_ids"])  # noqa: E731
    system = count(processor.apply_chat_template([{"role": "system", "content": computer_use_system_prompt()}],
                                                 add_generation_prompt=False))
    per_turn = max(count(task), count(NEXT_STEP)) + count(OMITTED["text"]) + max_tokens + 16  # + template tokens
    room = model.config.text_config.max_position_embeddings - 1 - system - steps * per_turn
    # Each kept screenshot costs its image tokens and the two that mark it.
    per_image = room // max(1, min(keep_images, steps)) - 2
    if per_image < 1:
        raise InputError(f"{steps} steps do not fit the model's context of "
                         f"{model.config.text_config.max_position_embeddings} tokens (the system prompt takes "
                         f"{system}, each step's text and answer up to {per_turn}); lower --max-tokens (now "
                         f"{max_tokens}) or pass fewer --screenshots")
    return min(AGENT_MAX_PIXELS, per_image * processor.image_config.factor ** 2)


def run(model, processor, task, screenshots, keep_images=2, max_tokens=256, on_step=None, max_pixels=None):
    """Drive one task over the screenshots; returns (one record per step, the session)."""
    session = ChatSession(model, processor, system=computer_use_system_prompt(), max_tokens=max_tokens,
                          max_pixels=max_pixels)
    steps = []
    for n, shot in enumerate(screenshots):
        width, height = image_size(shot)  # as the model sees it (EXIF orientation applied)
        text = task if n == 0 else NEXT_STEP
        keep_last_images(session.messages, keep_images - 1)  # with this turn's, keep_images screenshots are sent
        try:
            answer = session.send(text, images=[shot])
        except ContextLengthError as e:
            raise InputError(f"step {n + 1}: the conversation is {e.prompt_tokens} tokens, past the model's context "
                             f"of {e.context}; lower --max-pixels (now {max_pixels or 'the checkpoint default'}) or "
                             f"--keep-images (now {keep_images}), or pass fewer --screenshots") from None
        action = parse_action(answer, width, height)
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
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="local checkpoint folder or Hugging Face repo id")
    p.add_argument("--task", default="Lower the screen brightness, then apply the change.")
    p.add_argument("--screenshots", nargs="+", default=[str(s) for s in DEFAULT_SCREENSHOTS],
                   help="one screenshot per step")
    p.add_argument("--keep-images", type=int, default=2, help="screenshots kept in the conversation")
    p.add_argument("--max-tokens", type=int, default=128, help="longest answer per step")
    p.add_argument("--max-pixels", type=int, default=None,
                   help="pixel budget per screenshot; none = the largest that fits the model's context")
    args = p.parse_args(argv)

    def body():
        if args.keep_images < 1 or args.max_tokens < 1:
            raise InputError("--keep-images and --max-tokens take a positive number")
        model, processor = load(resolve_model_path(args.model, flag="--model"))
        max_pixels = args.max_pixels or fitting_max_pixels(model, processor, args.task, len(args.screenshots),
                                                           args.keep_images, args.max_tokens)

        def show(step):
            action = step["action"]
            what = (f"{action['name']} {action['args']}" if action
                    else f"(no action parsed from {step['answer'][:60]!r})")
            print(f"step {step['step'] + 1}: {what}  [{step['cached_tokens']} prompt tokens reused]", flush=True)

        print(f"pixel budget per screenshot: {max_pixels}", file=sys.stderr)
        run(model, processor, args.task, args.screenshots, args.keep_images, args.max_tokens, show, max_pixels)
        return 0

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())
