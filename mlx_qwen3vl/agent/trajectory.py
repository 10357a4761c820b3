"""An episode on disk, for people and for regression checks.

`TrajectoryWriter(dir)` is run_task's on_step: each step's screenshot (step-NNN.png, exactly what
the model saw) and a picture of its answer (step-NNN-answer.png: point, box and drag path drawn),
one JSON line per step in trajectory.jsonl (the answer, the parsed actions, the point in screenshot
and environment pixels, tokens, seconds for prefill, decode and acting, the reward), then
episode.json (the result and the settings) and index.html (the pictures in order, plain HTML: no
script, no CDN, every text escaped).

`replay(dir, answerer)` asks a model again on the recorded screenshots, with the recorded answers as
the history (so every step is asked what it was asked then), and reports the steps whose actions
changed: a check for a new prompt, quantization or KV setting, without the environment.
"""

import html
import json
import os
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Optional

from ..errors import InputError
from .computer_use import map_answer
from .draw import annotate
from .runner import Episode, StepRecord, step_messages

STEPS_FILE, EPISODE_FILE, INDEX_FILE = "trajectory.jsonl", "episode.json", "index.html"


def _write_json(path: Path, data):
    """Write JSON atomically (a reader never sees half a file; an interrupted run leaves the old one)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, ensure_ascii=False))
    os.replace(tmp, path)


def describe(actions: List[dict]) -> str:
    """Actions in a few words (a picture's banner when they point nowhere)."""
    words = []
    for a in actions:
        if a["type"] == "type":
            words.append(f"type {a['text']!r}")
        elif a["type"] == "key":
            words.append("key " + "+".join(a["keys"]))
        elif a["type"] == "scroll":
            words.append(f"scroll {a['direction']} {a['amount']}")
        else:
            words.append(a["type"].replace("_", " "))
    return ", ".join(words)


def answer_picture(image, rec: StepRecord, path=None):
    """The screenshot with the step's answer drawn: its point, box and drag path, or a banner saying
    what it did instead (typing, a key, a message) or why nothing was done."""
    note = None
    if rec.point is None and rec.end is None:
        note = {"action": f"no point: {describe(rec.actions)}", "message": "no action: a message",
                "done": "the model ended the task",
                "unmapped": f"not executed: {rec.reason or 'unmapped'}"}.get(rec.status, "no point")
    if rec.error:
        note = f"not executed: {rec.error}"
    return annotate(image, point=rec.point or rec.end, box=rec.box, drag=rec.end if rec.point else None, note=note,
                    path=path)


class TrajectoryWriter:
    """Writes an episode into `folder` as it runs (pass it as run_task's on_step, then call
    finish(episode)). A folder that holds another trajectory is refused unless `overwrite`."""

    def __init__(self, folder, *, overwrite: bool = False):
        self.folder = Path(folder)
        if (self.folder / STEPS_FILE).exists() and not overwrite:
            raise InputError(f"{self.folder} already holds a trajectory; choose another --out folder")
        self.folder.mkdir(parents=True, exist_ok=True)
        for old in self.folder.glob("step-*.png"):
            old.unlink()
        (self.folder / STEPS_FILE).write_text("")
        self.records: List[dict] = []

    def __call__(self, rec: StepRecord, obs) -> None:
        shot, picture = f"step-{rec.index:03d}.png", f"step-{rec.index:03d}-answer.png"
        obs.image.save(self.folder / shot, format="PNG")
        answer_picture(obs.image, rec, self.folder / picture)
        rec.screenshot = shot
        line = {**rec.to_dict(), "picture": picture, "scale": list(obs.scale), "origin": list(obs.origin)}
        self.records.append(line)
        with open(self.folder / STEPS_FILE, "a", encoding="utf-8") as f:
            f.write(json.dumps(line, ensure_ascii=False) + "\n")

    def finish(self, episode: Episode, extra: Optional[dict] = None) -> Path:
        summary = {k: v for k, v in episode.to_dict().items() if k != "steps"}
        summary.update(extra or {})
        summary["steps"] = len(episode.steps)
        _write_json(self.folder / EPISODE_FILE, summary)
        (self.folder / INDEX_FILE).write_text(index_html(summary, self.records), encoding="utf-8")
        return self.folder / INDEX_FILE


def read_trajectory(folder) -> (dict, List[dict]):
    """(episode.json, the steps of trajectory.jsonl) of a trajectory folder."""
    folder = Path(folder)
    if not (folder / STEPS_FILE).is_file() or not (folder / EPISODE_FILE).is_file():
        raise InputError(f"{folder} holds no finished trajectory ({STEPS_FILE} and {EPISODE_FILE})")
    try:
        summary = json.loads((folder / EPISODE_FILE).read_text(encoding="utf-8"))
        steps = [json.loads(line) for line in (folder / STEPS_FILE).read_text(encoding="utf-8").splitlines() if line]
    except (ValueError, UnicodeDecodeError) as e:
        raise InputError(f"{folder}: unreadable trajectory ({e})") from None
    return summary, steps


# ---------------------------------------------------------------------------------------------
# The page
# ---------------------------------------------------------------------------------------------
_STYLE = """body{font:14px/1.4 system-ui,sans-serif;margin:2em;max-width:80em;color:#222}
h1{font-size:1.3em}table{border-collapse:collapse}td,th{padding:.2em .6em;text-align:left;vertical-align:top}
.step{display:flex;gap:1.5em;border-top:1px solid #ccc;padding:1em 0}.step img{max-width:40em;border:1px solid #999}
pre{white-space:pre-wrap;word-break:break-word;background:#f4f4f4;padding:.5em;margin:.2em 0;max-width:50em}
.ok{color:#070}.bad{color:#b00}"""


def _e(value) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _src(name: str) -> str:
    return _e(urllib.parse.quote(name))


def _pt(p):
    return "none" if p is None else "(" + ", ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in p) + ")"


def index_html(summary: dict, steps: List[dict]) -> str:
    """The trajectory page: the episode's result, then each step's picture beside what it did."""
    ok = summary.get("success")
    head = [("task", summary.get("task")), ("environment", summary.get("env")),
            ("agent format", summary.get("agent_format")), ("model", summary.get("model")),
            ("result", f"{'success' if ok else 'no success'}, reward {summary.get('reward')}"),
            ("ended", f"{summary.get('reason')}: {summary.get('detail')}"),
            ("steps", summary.get("steps")), ("seconds", summary.get("seconds"))]
    rows = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in head if v is not None)
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           f"<title>{_e(summary.get('task'))}</title><style>{_STYLE}</style></head><body>",
           f"<h1>Trajectory: <span class=\"{'ok' if ok else 'bad'}\">{_e(summary.get('task'))}</span></h1>",
           f"<table>{rows}</table>"]
    for s in steps:
        actions = "; ".join(json.dumps(a, ensure_ascii=False) for a in s.get("actions", [])) or "none"
        facts = [("status", s.get("status")), ("actions", actions),
                 ("point (screenshot px)", _pt(s.get("point"))), ("point (environment)", _pt(s.get("env_point")))]
        if s.get("end"):
            facts += [("drag end (screenshot px)", _pt(s.get("end"))), ("drag end (environment)", _pt(s.get("env_end")))]
        if s.get("error") or s.get("reason"):
            facts.append(("not executed", s.get("error") or s.get("reason")))
        facts += [("screenshot", f"{s['image_size'][0]}x{s['image_size'][1]} px, scale {_pt(s.get('scale'))}"),
                  ("tokens", f"{s.get('prompt_tokens')} prompt ({s.get('cached_tokens')} cached), "
                             f"{s.get('generation_tokens')} generated"),
                  ("seconds", f"prefill {s.get('prefill_s')}, decode {s.get('decode_s')}, act {s.get('act_s')}"),
                  ("reward", s.get("reward"))]
        table = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in facts)
        out.append(f'<div class="step" id="step-{int(s["index"])}"><div><a href="{_src(s["screenshot"])}">'
                   f'<img src="{_src(s["picture"])}" alt="step {int(s["index"]) + 1}"></a></div>'
                   f'<div><h2>Step {int(s["index"]) + 1}</h2><table>{table}</table>'
                   f"<p>Answer:</p><pre>{_e(s.get('answer'))}</pre></div></div>")
    out.append("</body></html>\n")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# Replay
# ---------------------------------------------------------------------------------------------
@dataclass
class ReplayStep:
    index: int
    recorded: List[dict]
    replayed: List[dict]
    recorded_answer: str
    replayed_answer: str
    changed: bool


@dataclass
class ReplayReport:
    folder: str
    steps: List[ReplayStep] = field(default_factory=list)

    @property
    def changed(self) -> List[int]:
        return [s.index for s in self.steps if s.changed]

    def to_dict(self) -> dict:
        return {"trajectory": self.folder, "steps": len(self.steps), "changed": self.changed,
                "details": [s.__dict__ for s in self.steps]}


def replay(folder, answerer: Callable) -> ReplayReport:
    """Ask `answerer` (runner.LocalAnswerer / ServerAnswerer) each recorded step again: the recorded
    screenshots, the recorded answers as history, the episode's prompt settings. A step changed when
    its actions (or, without actions, its status and text) differ from the recorded ones."""
    from PIL import Image

    summary, steps = read_trajectory(folder)
    settings = summary.get("settings") or {}
    fmt = summary.get("agent_format")
    shots = []
    for s in steps:
        with Image.open(Path(folder) / s["screenshot"]) as im:
            shots.append(im.convert("RGB"))
    report = ReplayReport(str(folder))
    answers = [s["answer"] for s in steps]
    for i, s in enumerate(steps):
        messages = step_messages(summary["task"], shots[:i + 1], answers[:i], agent_format=fmt,
                                 history_images=settings.get("history_images", 2),
                                 history_steps=settings.get("history_steps", 5), kind=settings.get("kind", "web"))
        text = answerer(messages).text
        turn = map_answer(text, tuple(s["image_size"]))
        new = [a.to_dict() for a in turn.actions]
        same = new == s["actions"] and (new or (turn.status, turn.text) == (s["status"], s.get("text", "")))
        report.steps.append(ReplayStep(i, s["actions"], new, s["answer"], text, not same))
    return report


__all__ = ["TrajectoryWriter", "read_trajectory", "index_html", "answer_picture", "replay", "ReplayReport",
           "STEPS_FILE", "EPISODE_FILE", "INDEX_FILE"]
