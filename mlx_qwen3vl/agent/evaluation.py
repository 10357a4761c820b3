"""A MiniWoB++ evaluation: every (task, seed) episode run once, in one browser, each episode's
trajectory kept; success rate, mean steps, seconds per step, a per-task table, eval.json and
report.html (with a picture of each episode's last step).

Resumable: eval.json is rewritten after every episode, and a rerun into the same folder skips the
episodes it holds. It holds one run's settings (model, agent format, step limit, ...): a rerun with
other settings is refused rather than merged into numbers that would mean nothing.
"""

import html
import json
import os
import time
import urllib.parse
from pathlib import Path
from typing import Callable, List

from ..errors import InputError

EVAL_FILE, REPORT_FILE, EPISODES = "eval.json", "report.html", "episodes"
# The flags whose values make two runs' episodes incomparable.
SETTINGS = ("env", "agent_format", "max_steps", "time_budget", "history_images", "history_steps", "loop_k",
            "episode_seconds", "device_scale", "max_tokens", "max_pixels", "kv_bits", "base_url", "server_model")


def settings_of(args, model_name: str) -> dict:
    out = {k: getattr(args, k, None) for k in SETTINGS}
    out["model"] = model_name
    return out


def _write_json(path: Path, data):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, ensure_ascii=False))
    os.replace(tmp, path)


def load_state(folder: Path, settings: dict) -> dict:
    """The folder's evaluation so far ({"settings", "episodes"}), or a new one; other settings refused."""
    path = folder / EVAL_FILE
    if not path.exists():
        return {"settings": settings, "episodes": {}}
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
        held = state["settings"]
        state["episodes"]
    except (ValueError, KeyError, TypeError) as e:
        raise InputError(f"{path} is not an evaluation this command wrote ({e}); use another --out") from None
    differ = [k for k in sorted(set(held) | set(settings)) if held.get(k) != settings.get(k)]
    if differ:
        what = ", ".join(f"{k} {held.get(k)!r} there, {settings.get(k)!r} here" for k in differ)
        raise InputError(f"{folder} holds an evaluation with other settings ({what}); use another --out or the "
                         "same settings to resume it")
    return state


def episode_key(task: str, seed: int) -> str:
    return f"{task}/{seed}"


def summarize(state: dict, tasks: List[str], seeds: List[int]) -> dict:
    """Success rate, mean steps, seconds per step, reward, over the episodes of these tasks and seeds."""
    rows, episodes = [], []
    for task in tasks:
        eps = [state["episodes"][k] for k in (episode_key(task, s) for s in seeds) if k in state["episodes"]]
        episodes += eps
        rows.append(_stats(eps, task=task))
    total = _stats(episodes)
    return {**total, "settings": state["settings"], "tasks": rows,
            "missing": len(tasks) * len(seeds) - len(episodes)}


def _stats(eps, **extra) -> dict:
    n = len(eps)
    steps = sum(e["steps"] for e in eps)
    return {**extra, "episodes": n, "successes": sum(bool(e["success"]) for e in eps),
            "success_rate": round(sum(bool(e["success"]) for e in eps) / n, 4) if n else None,
            "mean_reward": round(sum(e["reward"] for e in eps) / n, 4) if n else None,
            "mean_steps": round(steps / n, 3) if n else None,
            "seconds_per_step": round(sum(e["seconds"] for e in eps) / steps, 3) if steps else None}


def run_eval(args, tasks: List[str], seeds: List[int], make_model: Callable, episode_kwargs: dict,
             quiet: bool = False) -> dict:
    """Run the missing episodes of tasks x seeds into args.out; returns the summary."""
    from .envs.miniwob import MiniWoBEnv
    from .runner import run_task
    from .trajectory import TrajectoryWriter

    for task in tasks:
        MiniWoBEnv._check_task(task)
    folder = Path(args.out)
    model_name = args.model if args.base_url is None else f"{args.base_url} ({args.server_model})"
    state = load_state(folder, settings_of(args, model_name))  # refused before any model loads
    todo = [(t, s) for t in tasks for s in seeds if episode_key(t, s) not in state["episodes"]]
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    say(f"{len(tasks) * len(seeds) - len(todo)} episodes done already, {len(todo)} to run")
    if todo:
        folder.mkdir(parents=True, exist_ok=True)
        model = make_model(args)
        env = MiniWoBEnv(todo[0][0], seed=todo[0][1], headless=not args.headful,
                         episode_seconds=args.episode_seconds, device_scale=args.device_scale)
        try:
            for task, seed in todo:
                env.task, env.seed = task, seed  # its next reset() loads this task's page if needed
                name = f"{task}-{seed}"
                writer = TrajectoryWriter(folder / EPISODES / name, overwrite=True)  # an interrupted one is redone
                tic = time.perf_counter()
                episode = run_task(model.model, model.processor, env, None, answerer=model.answerer(args.agent_format),
                                   on_step=writer, **episode_kwargs)
                writer.finish(episode, {"model": model_name, "seed": seed, "name": task})
                last = writer.records[-1]["picture"] if writer.records else None
                state["episodes"][episode_key(task, seed)] = {
                    "task": task, "seed": seed, "success": episode.success, "reward": episode.reward,
                    "steps": len(episode.steps), "seconds": round(time.perf_counter() - tic, 3),
                    "reason": episode.reason, "instruction": episode.task,
                    "trajectory": f"{EPISODES}/{name}", "last_picture": f"{EPISODES}/{name}/{last}" if last else None}
                _write_json(folder / EVAL_FILE, state)
                say(f"{task} seed {seed}: {'success' if episode.success else 'failure'}, reward {episode.reward:g}, "
                    f"{len(episode.steps)} steps ({episode.reason})")
        finally:
            env.close()
    folder.mkdir(parents=True, exist_ok=True)
    _write_json(folder / EVAL_FILE, state)
    summary = summarize(state, tasks, seeds)
    (folder / REPORT_FILE).write_text(report_html(summary, state, tasks, seeds), encoding="utf-8")
    say(table(summary))
    return summary


def table(summary: dict) -> str:
    lines = [f"{'task':<28} {'episodes':>8} {'success':>8} {'steps':>6} {'s/step':>7}"]
    for r in summary["tasks"] + [dict(summary, task="all")]:
        rate = "-" if r["success_rate"] is None else f"{100 * r['success_rate']:.0f}%"
        lines.append(f"{r['task']:<28} {r['episodes']:>8} {rate:>8} {r['mean_steps'] if r['mean_steps'] is not None else '-':>6} "
                     f"{r['seconds_per_step'] if r['seconds_per_step'] is not None else '-':>7}")
    return "\n".join(lines)


def _e(v) -> str:
    return html.escape("" if v is None else str(v), quote=True)


def report_html(summary: dict, state: dict, tasks, seeds) -> str:
    settings = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in summary["settings"].items())
    rows = "".join(
        f"<tr><td>{_e(r['task'])}</td><td>{r['episodes']}</td><td>{r['successes']}</td>"
        f"<td>{_e(r['success_rate'])}</td><td>{_e(r['mean_reward'])}</td><td>{_e(r['mean_steps'])}</td>"
        f"<td>{_e(r['seconds_per_step'])}</td></tr>" for r in summary["tasks"] + [dict(summary, task="all")])
    cards = []
    for task in tasks:
        for seed in seeds:
            e = state["episodes"].get(episode_key(task, seed))
            if e is None:
                continue
            link = _e(urllib.parse.quote(e["trajectory"] + "/index.html"))
            img = (f'<img src="{_e(urllib.parse.quote(e["last_picture"]))}" alt="last step">'
                   if e.get("last_picture") else "<p>(no step)</p>")
            cards.append(f'<figure class="{"ok" if e["success"] else "bad"}"><a href="{link}">{img}</a><figcaption>'
                         f'{_e(task)} seed {seed}: {"success" if e["success"] else "failure"}, reward {_e(e["reward"])}, '
                         f'{e["steps"]} steps, {_e(e["reason"])}<br><small>{_e(e.get("instruction"))}</small>'
                         "</figcaption></figure>")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>MiniWoB++ evaluation</title>"
            "<style>body{font:14px/1.4 system-ui,sans-serif;margin:2em;color:#222}table{border-collapse:collapse}"
            "td,th{padding:.2em .6em;text-align:left}figure{display:inline-block;margin:.5em;width:220px;"
            "vertical-align:top}figure img{max-width:210px;border:3px solid #999}.ok img{border-color:#070}"
            ".bad img{border-color:#b00}</style></head><body><h1>MiniWoB++ evaluation</h1>"
            "<table><tr><th>task</th><th>episodes</th><th>successes</th><th>success rate</th><th>mean reward</th>"
            f"<th>mean steps</th><th>seconds per step</th></tr>{rows}</table><h2>Settings</h2><table>{settings}</table>"
            f"<h2>Last step of each episode</h2>{''.join(cards)}</body></html>\n")


__all__ = ["run_eval", "summarize", "load_state", "settings_of", "report_html", "table", "SETTINGS"]
