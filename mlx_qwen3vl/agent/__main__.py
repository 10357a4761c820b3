"""Command line of the agent runner: `python -m mlx_qwen3vl.agent run|eval|replay`.

    python -m mlx_qwen3vl.agent run --env miniwob --task click-button --seed 0 --model M --json
    python -m mlx_qwen3vl.agent run --env browser --url https://example.com --task "Open More information" --model M
    python -m mlx_qwen3vl.agent run --env desktop --task "Open the Downloads folder" --model M
    python -m mlx_qwen3vl.agent eval --env miniwob --tasks click-button,enter-text --seeds 0-9 --model M --out DIR
    python -m mlx_qwen3vl.agent replay DIR --model M

`run --json` prints one JSON object on its last stdout line (task, seed, reward, success, steps with
answer, action and point in screenshot pixels). Bad input: one `error:` line, exit status 2.
"""

import argparse
import json
import re
import sys

from .. import cli
from ..errors import InputError

ENVS = ("miniwob", "browser", "desktop")
MAX_SEEDS = 10000


# ---------------------------------------------------------------------------------------------
# Flags
# ---------------------------------------------------------------------------------------------
def _model_flags(p):
    p.add_argument("--model", default=None, help="local checkpoint folder or Hugging Face repo id")
    p.add_argument("--base-url", default=None,
                   help="ask a server instead (OpenAI chat completions, e.g. http://127.0.0.1:8080/v1)")
    p.add_argument("--api-key", default=None, help="the server's API key (--base-url)")
    p.add_argument("--server-model", default="default", help="the model name sent to the server (--base-url)")
    p.add_argument("--agent-format", choices=["venus", "qwen"], default="venus",
                   help="the trained prompt: UI-Venus-1.5's navigation (venus) or Qwen3-VL's computer use (qwen)")
    p.add_argument(cli.FLAGS["max_tokens"], type=int, default=None, help="longest answer per step; none = 2048")
    p.add_argument(cli.FLAGS["max_pixels"], type=int, default=None,
                   help="screenshot pixel budget; none = UI-Venus' 12845056, lowered to fit the model's context")
    p.add_argument("--kv-bits", type=int, default=None, help="quantize the KV cache to 4 or 8 bits")


def _episode_flags(p):
    p.add_argument("--max-steps", type=int, default=15, help="steps before the episode ends")
    p.add_argument("--time-budget", type=float, default=None, help="seconds of wall time per episode; none = no limit")
    p.add_argument("--history-images", type=int, default=2, help="qwen format: screenshots kept in the conversation")
    p.add_argument("--history-steps", type=int, default=5, help="venus format: earlier steps in the prompt")
    p.add_argument("--loop-k", type=int, default=3, help="end after the same action on the same screen this many times")
    p.add_argument("--episode-seconds", type=float, default=None,
                   help="miniwob: the task's time limit (MiniWoB++'s own is 10 s, its reward shrinking with time)")
    p.add_argument("--device-scale", type=float, default=1.0,
                   help="miniwob / browser: device pixels per CSS pixel of the screenshot")
    p.add_argument("--headful", action="store_true", help="miniwob / browser: show the browser window")


def build_parser():
    p = cli.Parser(prog="python -m mlx_qwen3vl.agent", description="Run a GUI agent in an environment.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=cli.Parser)
    r = sub.add_parser("run", help="one episode", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    r.add_argument("--env", choices=ENVS, default=None, help="where the agent acts")
    r.add_argument("--task", default=None, help="miniwob: the task's name; browser / desktop: the instruction")
    r.add_argument("--seed", type=int, default=0, help="miniwob: the episode's seed")
    r.add_argument("--url", default=None, help="browser: the page to open")
    r.add_argument("--viewport", default="1280x800", help="browser: viewport WIDTHxHEIGHT in CSS pixels")
    r.add_argument("--yes", action="store_true", help="desktop: act without asking before each action")
    r.add_argument("--out", default=None, help="write the trajectory (screenshots, trajectory.jsonl, index.html) here")
    r.add_argument("--replay", default=None, metavar="DIR",
                   help="instead of running: ask the model again on a recorded trajectory and report changed steps")
    r.add_argument("--json", action="store_true", help="print one JSON object on the last stdout line")
    _model_flags(r)
    _episode_flags(r)
    e = sub.add_parser("eval", help="a MiniWoB++ evaluation", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    e.add_argument("--env", choices=["miniwob"], default="miniwob")
    e.add_argument("--tasks", required=True, help="comma-separated MiniWoB++ task names")
    e.add_argument("--seeds", default="0-9", help="seeds: 0-9, or 1,4,7, or both")
    e.add_argument("--out", required=True, help="the evaluation's folder (rerun to resume)")
    e.add_argument("--json", action="store_true", help="print the summary as JSON on the last stdout line")
    _model_flags(e)
    _episode_flags(e)
    rp = sub.add_parser("replay", help="ask again on a recorded trajectory")
    rp.add_argument("trajectory", help="a trajectory folder (run --out)")
    rp.add_argument("--json", action="store_true", help="print the report as JSON on the last stdout line")
    _model_flags(rp)
    return p


def parse_seeds(text: str):
    seeds = []
    for part in str(text).split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not m:
            raise InputError(f"--seeds: {part.strip()!r} is not a seed or a range such as 0-9")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise InputError(f"--seeds: the range {part.strip()} runs backwards")
        seeds.extend(range(lo, hi + 1))
        if len(seeds) > MAX_SEEDS:
            raise InputError(f"--seeds: more than {MAX_SEEDS} seeds")
    return list(dict.fromkeys(seeds))


def _check(args):
    """Every flag checked, under its name, before a model loads or a browser starts."""
    if (args.model is None) == (args.base_url is None):
        raise InputError("give --model (a checkpoint) or --base-url (a server), one of them")
    if args.base_url is not None and not re.match(r"https?://", args.base_url):
        raise InputError(f"--base-url must be an http(s) URL, not {args.base_url!r}")
    if args.max_tokens is not None:
        cli.check_max_tokens(args.max_tokens)
    if args.max_pixels is not None and args.max_pixels < 1:
        raise InputError("--max-pixels must be positive")
    if args.kv_bits not in (None, 4, 8):
        raise InputError("--kv-bits takes 4 or 8")
    for flag in ("max_steps", "history_images", "loop_k"):
        if getattr(args, flag, 1) < 1:
            raise InputError(f"--{flag.replace('_', '-')} must be at least 1")
    if getattr(args, "history_steps", 0) < 0:
        raise InputError("--history-steps must not be negative")
    if getattr(args, "time_budget", None) is not None and not args.time_budget > 0:
        raise InputError("--time-budget must be positive")
    if getattr(args, "episode_seconds", None) is not None and not args.episode_seconds > 0:
        raise InputError("--episode-seconds must be positive")
    if getattr(args, "device_scale", 1.0) < 1 or getattr(args, "device_scale", 1.0) > 4:
        raise InputError("--device-scale must be between 1 and 4")


def _sampling(args) -> dict:
    out = {}
    if args.max_tokens is not None:
        out["max_tokens"] = args.max_tokens
    if args.kv_bits is not None:
        out["kv_bits"] = args.kv_bits
    return out


class Model:
    """The model once loaded (or the server), and an answerer per episode."""

    def __init__(self, args):
        self.args = args
        self.model = self.processor = None
        self._local = {}
        if args.base_url is None:
            from .. import load, resolve_model_path

            self.model, self.processor = load(resolve_model_path(args.model, flag="--model"))

    @property
    def name(self) -> str:
        a = self.args
        return a.model if a.base_url is None else f"{a.base_url} ({a.server_model})"

    def answerer(self, agent_format, settings=None):
        """What asks the model: one LocalAnswerer per format, reused across episodes (the system
        prompt's cache with it), or a ServerAnswerer. `settings`: a recorded episode's (replay: its
        sampling and pixel budget)."""
        from .computer_use import AGENT_SAMPLING
        from .runner import MAX_TOKENS, LocalAnswerer, ServerAnswerer

        sampling = {k: v for k, v in {"max_tokens": MAX_TOKENS, **AGENT_SAMPLING[agent_format],
                                      **_sampling(self.args)}.items() if k not in ("min_pixels", "max_pixels")}
        if settings is not None and "sampling" in settings:
            sampling = {**settings["sampling"], **_sampling(self.args)}
        if self.args.base_url is not None:
            return ServerAnswerer(self.args.base_url, model=self.args.server_model, api_key=self.args.api_key,
                                  **sampling)
        if settings is not None:
            return LocalAnswerer(self.model, self.processor, max_pixels=settings.get("max_pixels"),
                                 min_pixels=settings.get("min_pixels"), **sampling)
        if agent_format not in self._local:
            self._local[agent_format] = LocalAnswerer(self.model, self.processor, **sampling)
        return self._local[agent_format]


def _viewport(text):
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text or "")
    if not m or not all(0 < int(v) <= 16384 for v in m.groups()):
        raise InputError(f"--viewport must be WIDTHxHEIGHT such as 1280x800, not {text!r}")
    return int(m.group(1)), int(m.group(2))


def make_env(args):
    """The environment the flags name (browser and desktop imported only when asked for)."""
    from .envs import env_class

    try:
        cls = env_class(args.env)
    except ImportError as e:
        raise InputError(f"the {args.env} environment is not available here: {e}") from None
    try:
        if args.env == "miniwob":
            return cls(args.task, seed=args.seed, headless=not args.headful, episode_seconds=args.episode_seconds,
                       device_scale=args.device_scale)
        if args.env == "browser":
            return cls(url=args.url, viewport=_viewport(args.viewport), device_scale_factor=args.device_scale,
                       headless=not args.headful)
        return cls(yes=args.yes)
    except InputError:
        raise
    except Exception as e:  # a browser or display that would not start
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(f"could not start the {args.env} environment: {first}") from None


def _episode_kwargs(args) -> dict:
    return dict(agent_format=args.agent_format, max_steps=args.max_steps, time_budget_s=args.time_budget,
                history_images=args.history_images, history_steps=args.history_steps, loop_k=args.loop_k,
                max_pixels=args.max_pixels, **_sampling(args))


def step_summary(rec) -> dict:
    action = rec.actions[0] if rec.actions else None
    return {"answer": rec.answer, "status": rec.status, "action": action, "actions": rec.actions,
            "point": list(rec.point) if rec.point else None,
            "env_point": [round(v, 3) for v in rec.env_point] if rec.env_point else None,
            "reward": rec.reward, "error": rec.error}


# ---------------------------------------------------------------------------------------------
# run
# ---------------------------------------------------------------------------------------------
def cmd_run(args) -> int:
    if args.replay is not None:
        return cmd_replay(args, args.replay)
    if args.env is None:
        raise InputError("--env is required: miniwob, browser or desktop (or --replay DIR)")
    _check(args)
    if args.env == "miniwob":
        from .envs.miniwob import MiniWoBEnv

        if not args.task:
            raise InputError("--task: the MiniWoB++ task's name, e.g. click-button")
        MiniWoBEnv._check_task(args.task)
    elif not args.task:
        raise InputError(f"--task: the instruction for the {args.env} environment")
    if args.env == "browser":
        if not args.url:
            raise InputError("--url: the page the browser opens")
        _viewport(args.viewport)
    from .runner import run_task
    from .trajectory import TrajectoryWriter

    writer = TrajectoryWriter(args.out) if args.out else None
    model = Model(args)
    steps_seen = []

    def on_step(rec, obs):
        if writer:
            writer(rec, obs)
        steps_seen.append(rec)
        if not args.json:
            what = json.dumps(rec.actions[0]) if rec.actions else f"({rec.status}) {rec.answer.strip()[:80]!r}"
            print(f"step {rec.index + 1}: {what}", flush=True)

    env = make_env(args)
    try:
        episode = run_task(model.model, model.processor, env, None if args.env == "miniwob" else args.task,
                           answerer=model.answerer(args.agent_format), on_step=on_step, **_episode_kwargs(args))
        extra = {"model": model.name, "seed": args.seed if args.env == "miniwob" else None}
        if args.env == "miniwob":
            extra["instruction"], extra["name"] = episode.task, args.task
        if writer:
            writer.finish(episode, extra)
    finally:
        env.close()
    result = {"task": args.task if args.env == "miniwob" else episode.task, "seed": extra["seed"], "env": args.env,
              "instruction": episode.task, "model": model.name, "agent_format": args.agent_format,
              "reward": episode.reward, "success": episode.success, "reason": episode.reason,
              "detail": episode.detail, "seconds": round(episode.seconds, 3),
              "steps": [step_summary(s) for s in episode.steps], "out": args.out}
    if args.json:
        print(json.dumps(result, ensure_ascii=False))
    else:
        print(f"{'success' if episode.success else 'no success'}: reward {episode.reward:g}, {len(episode.steps)} "
              f"steps, ended by {episode.reason} ({episode.detail})" + (f"; trajectory in {args.out}" if args.out else ""))
    return 0


# ---------------------------------------------------------------------------------------------
# replay
# ---------------------------------------------------------------------------------------------
def cmd_replay(args, folder) -> int:
    from .trajectory import read_trajectory, replay

    _check(args)
    summary, _ = read_trajectory(folder)
    if summary.get("agent_format") not in ("qwen", "venus"):
        raise InputError(f"{folder}: the trajectory names no agent format")
    model = Model(args)
    report = replay(folder, model.answerer(summary["agent_format"], summary.get("settings") or {}))
    if args.json:
        print(json.dumps(report.to_dict(), ensure_ascii=False))
    else:
        for s in report.steps:
            print(f"step {s.index + 1}: {'CHANGED' if s.changed else 'same'}"
                  + (f" (recorded {json.dumps(s.recorded)}, now {json.dumps(s.replayed)})" if s.changed else ""))
        print(f"{len(report.changed)} of {len(report.steps)} steps changed")
    return 0


# ---------------------------------------------------------------------------------------------
# eval
# ---------------------------------------------------------------------------------------------
def cmd_eval(args) -> int:
    from .evaluation import run_eval

    _check(args)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise InputError("--tasks: give at least one MiniWoB++ task name")
    seeds = parse_seeds(args.seeds)
    summary = run_eval(args, tasks, seeds, Model, _episode_kwargs(args), quiet=args.json)
    if args.json:
        print(json.dumps(summary, ensure_ascii=False))
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "replay":
        return cli.run(lambda: cmd_replay(args, args.trajectory))
    return cli.run(lambda: {"run": cmd_run, "eval": cmd_eval}[args.command](args))


if __name__ == "__main__":
    sys.exit(main())
