"""Every shell command in README.md and docs/*.md, run offline on the tiny test checkpoints.

The commands are the lines of the pages' ```bash blocks (a line ending in a backslash, or inside an
open quote, goes on to the next). Each one is, in this order of preference:

- run (RUN), as written but with the hub ids and placeholder paths it names replaced by the
  checkpoints and files in tests/fixtures (MODELS, PATHS), in a scratch folder, with small answers
  and screenshots (SMALL), servers on a free 127.0.0.1 port (started, asked what their page asks,
  stopped), `mlx.launch` commands on 2 local ranks as tests/test_distributed.py runs them;
- parsed only (PARSE): the program's own argument parser reads the command, then it stops, for the
  few that run for minutes (the lab benchmarks);
- checked (an install: the extras it names exist in pyproject.toml);
- left out (SKIP), with the reason.

A command the tables do not cover (an unknown model, a placeholder path, a program nothing here
runs) fails the test, as does a table entry that no page holds any more: a stale command (a wrong
flag, a moved module, a renamed extra) cannot pass.
"""

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from mlx_qwen3vl.distributed import free_ports

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN_TIMEOUT = 180  # one command, on a shared and busy 2-core machine
START_TIMEOUT = 180  # a server (or 2 ranks) loading

# Hub ids and placeholder folders → the tiny checkpoints (a 30B-A3B placeholder → the MoE one).
MODELS = {
    "mlx-community/Qwen3-VL-4B-Instruct-4bit": "tests/fixtures/tiny-a",
    "Qwen/Qwen3-VL-2B-Instruct": "tests/fixtures/tiny-a",
    "Qwen/Qwen3-VL-8B-Instruct": "tests/fixtures/tiny-a",
    "./Qwen3-VL-8B-Instruct": "tests/fixtures/tiny-a",
    "inclusionAI/UI-Venus-1.5-2B": "tests/fixtures/tiny-a",
    "inclusionAI/UI-Venus-1.5-8B": "tests/fixtures/tiny-a",
    "path/to/UI-Venus-1.5": "tests/fixtures/tiny-a",
    "path/to/UI-Venus-1.5-8B": "tests/fixtures/tiny-a",
    "path/to/checkpoint": "tests/fixtures/tiny-a",
    "~/models/qwen3vl-30b": "tests/fixtures/tiny-moe",
}
# Placeholder paths → files and folders of the scratch folder (made by `scratch`).
PATHS = {"shot.png": "examples/screenshot.png", "~/Screenshots": "shots",
         "~/.cache/mlx_qwen3vl/prefixes": "prefixes"}
MODEL_FLAGS = ("--model", "--hf-path")
INPUT_FLAGS = ("--image", "--data", "--allowed-local-media-path", "--allowed-image-dir", "--video")  # must exist (after PATHS)
OUTPUT_FLAGS = ("--annotate", "--json", "--report", "--output", "--mlx-path", "--out")  # must exist after a run
# Appended to every run of a program, to keep the answers and screenshots small (the last value
# of a flag wins, so the command's own flags are still read and checked).
SMALL = {
    "mlx_qwen3vl": ["--max-tokens", "8", "--max-pixels", "65536"],
    "mlx_qwen3vl.ground": ["--max-tokens", "8", "--max-pixels", "65536"],
    "mlx_qwen3vl.eval_grounding": ["--max-tokens", "8", "--no-progress"],
    "mlx_qwen3vl.bench": ["--quick", "--prompt-tokens", "32", "--decode-tokens", "2", "--agent-turns", "1",
                          "--max-pixels", "65536"],
    "examples/agent_loop.py": ["--max-tokens", "8", "--max-pixels", "65536"],
    "mlx_qwen3vl.agent": ["--max-tokens", "8", "--max-pixels", "65536", "--max-steps", "1"],
}
SERVERS = ("mlx_qwen3vl.server",)  # run until asked to stop; `mlx_qwen3vl.mcp --transport http` too
STDIN = {"--chat": "Click it.\n"}  # a flag → what the command reads from stdin (then end of input)

# Left out, with the reason (the command as its words, comments dropped).
SKIP = {
    "git clone <this repository> mlx-qwen3vl && cd mlx-qwen3vl": "needs the network and a repository address",
    "python3 -m venv .venv && . .venv/bin/activate": "makes the environment the install goes into; .ci/run makes "
                                                     "one the same way",
    'pip install -e ".[test]" && python -m pytest -q': "is this suite; test_ci_runs_the_readme_test_command holds "
                                                      ".ci/run to the same two commands",
    "mlx.launch --hostfile hosts.json --backend ring -- python -m mlx_qwen3vl --model ~/models/qwen3vl-30b --image "
    'shot.png --prompt "Where is the search box?"': "needs ssh to other Macs (the same command on 2 local ranks "
                                                   "runs above it)",
    "mlx.launch --hostfile hosts.json --backend ring -- python -m mlx_qwen3vl.server --model ~/models/qwen3vl-30b "
    "--host 0.0.0.0 --api-key KEY --parallel pipeline": "needs ssh to other Macs and binds every interface",
    "mlx.distributed_config --backend ring --over thunderbolt --hosts mac1,mac2 --auto-setup --output hosts.json":
        "needs ssh to other Macs and a Thunderbolt bridge",
    "bash benchmarks/gpu_run.sh": "needs an NVIDIA GPU and the package index",
    'python -m mlx_qwen3vl.agent run --env browser --url https://example.com --task "Open the More information link" '
    "--model path/to/UI-Venus-1.5 --viewport 1280x800 --device-scale 2 --out example-run":
        "opens a page on the internet (tests/test_agent_browser.py drives the browser environment on a local page "
        "at devicePixelRatio 1 and 2)",
    'python -m mlx_qwen3vl.agent run --env desktop --task "Open System Settings and turn on Dark Mode" '
    "--model path/to/UI-Venus-1.5": "acts on the screen of the machine it runs on (tests/test_agent_desktop.py "
                                    "runs the desktop environment under Xvfb)",
}
# Parsed by the program's own argument parser, not run, with the reason.
PARSE = {
    "python benchmarks/bench.py --preset 2b --workloads text256,image448 --verbose":
        "a lab benchmark: builds a 4.3 GB preset and runs for minutes (tests/test_bench.py runs bench.py on the tiny "
        "preset)",
    "python benchmarks/bench_kv.py --preset 2b --part decode":
        "a lab benchmark: minutes on the 2B preset, ~11 s even on the tiny one",
}


# ---------------------------------------------------------------------------------- extraction
@dataclass
class Command:
    page: str
    line: int
    text: str  # as written (continuations joined)
    words: list = field(default_factory=list)  # shlex words, comments dropped

    @property
    def key(self):
        """The command as written, on one line, without its comment (the tables' keys)."""
        return " ".join(" ".join(re.sub(r"(^|\s)#\s.*$", "", line) for line in self.text.split("\n")).split())

    @property
    def where(self):
        return f"{self.page}:{self.line}"


def page_commands(path):
    """The commands of the ```bash blocks of the page at `path`."""
    out, lines = [], path.read_text().split("\n")
    i = 0
    while i < len(lines):
        if lines[i].strip() != "```bash":
            i += 1
            continue
        i += 1
        text, start = "", None
        while i < len(lines) and lines[i].strip() != "```":
            line = lines[i]
            start = i + 1 if not text else start
            text = f"{text}\n{line}" if text else line
            i += 1
            if text.endswith("\\"):
                text = text[:-1]
                continue
            try:
                words = shlex.split(text, comments=True)
            except ValueError:  # an open quote: the command goes on
                continue
            if words:
                out.append(Command(str(path.relative_to(ROOT)), start, text, words))
            text = ""
        assert not text, f"{path.name}:{start}: a command in a ```bash block does not end"
        i += 1
    return out


def all_commands():
    return [c for page in PAGES for c in page_commands(page)]


def segments(words):
    """A command's words split at `&&`."""
    out, cur = [], []
    for w in words:
        if w == "&&":
            out.append(cur)
            cur = []
        else:
            cur.append(w)
    return out + [cur]


def program(words):
    """(program, its arguments) of one segment: a module (python -m X), a script (python X.py), or
    a command name; environment assignments before it are skipped."""
    words = [w for w in words if not re.match(r"^[A-Z_][A-Z0-9_]*=", w)] if words else words
    if words and words[0] in ("python", "python3"):
        if len(words) > 2 and words[1] == "-m":
            return words[2], words[3:]
        return words[1], words[2:]
    return words[0], words[1:]


def classify(c):
    """'skip', 'parse', 'install' or 'run', with the reason for the first two."""
    if c.key in SKIP:
        return "skip", SKIP[c.key]
    if c.key in PARSE:
        return "parse", PARSE[c.key]
    if c.words[0] == "pip":
        return "install", "installs packages: the extras it names are checked against pyproject.toml"
    return "run", None


# ---------------------------------------------------------------------------------- substitution
def substitute(words, port=None):
    """`words` with models and paths replaced (MODELS, PATHS); an unknown hub id or placeholder is
    an AssertionError naming it."""
    out = []
    for i, w in enumerate(words):
        prev = words[i - 1] if i else None
        if prev in MODEL_FLAGS:
            if w in MODELS:
                w = MODELS[w]
            assert (ROOT / w).exists(), f"{w!r}: add this model to MODELS (a tiny checkpoint standing for it)"
        elif w in PATHS:
            w = PATHS[w]
        elif w.startswith(("~", "path/to/", "<")):
            raise AssertionError(f"{w!r}: add this placeholder to PATHS")
        elif port is not None and prev == "--port":
            w = str(port)
        out.append(w)
    return out


@dataclass
class Run:
    """How one command runs: its shell line, whether it serves (and on which port), its stdin."""
    command: Command
    argv_segments: list
    serve: str = None  # "http" (GET /health) or "mcp" (any HTTP answer at /mcp)
    port: int = None
    key: str = None
    stdin: str = None
    outputs: list = field(default_factory=list)

    @property
    def shell(self):
        return " && ".join(shlex.join(s) for s in self.argv_segments)


def how_to_run(c):
    """How a command runs (substitutions, small sizes, ports): its Run."""
    p = Run(c, [])
    for seg in segments(c.words):
        env = [w for w in seg if re.match(r"^[A-Z_][A-Z0-9_]*=", w)]
        words = seg[len(env):]
        launch = []
        if words[0] == "mlx.launch":
            assert words[1:4] == ["-n", "2", "--backend"] and "--" in words, f"{c.where}: not a local 2-rank launch"
            cut = words.index("--")
            first = free_ports(2)
            launch = [*words[:cut], "--hosts", "127.0.0.1", "--starting-port", str(first), "--"]
            words = words[cut + 1:]
        name, args = program(words)
        if name == "curl":
            p.argv_segments.append(env + ["curl", *args])
            continue
        serves = name in SERVERS or (name == "mlx_qwen3vl.mcp" and "--transport" in args)
        if serves:
            p.port = free_ports()
            p.serve = "mcp" if name == "mlx_qwen3vl.mcp" else "http"
            if "--port" not in args:
                args = [*args, "--port", str(p.port)]
            host = args[args.index("--host") + 1] if "--host" in args else "127.0.0.1"
            assert host in ("127.0.0.1", "::1"), f"{c.where}: a test serves on loopback only, not {host}"
            if "--api-key" in args:
                p.key = args[args.index("--api-key") + 1]
        args = substitute(args, p.port) + SMALL.get(name, [])
        for flag in INPUT_FLAGS:
            for i, w in enumerate(args[:-1]):
                if w == flag and not args[i + 1].startswith("-"):
                    assert args[i + 1] in PATHS.values() or (ROOT / args[i + 1]).exists(), \
                        f"{c.where}: {flag} {args[i + 1]!r} names no file of the repository"
        p.outputs += [args[i + 1] for i, w in enumerate(args[:-1])
                      if w in OUTPUT_FLAGS and not args[i + 1].startswith("-")]  # a bare --json is a switch
        p.stdin = next((text for flag, text in STDIN.items() if flag in args), p.stdin)
        head = [sys.executable, "-m", name] if words[0].startswith("python") and words[1] == "-m" else \
            [sys.executable, name] if words[0].startswith("python") else [name]
        p.argv_segments.append(env + launch + head + args)
    return p


def client_shell(p, server_port):
    """A curl command of a page, pointed at the server the page started."""
    png = (ROOT / "tests" / "fixtures" / "media" / "img_123x77.png").read_bytes()
    import base64

    url = "data:image/png;base64," + base64.b64encode(png).decode()
    line = p.shell.replace("127.0.0.1:8080", f"127.0.0.1:{server_port}").replace("data:image/png;base64,...", url)
    assert "..." not in line, f"{p.command.where}: a placeholder is left in {line!r}"
    return line


# ---------------------------------------------------------------------------------- running
@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A folder to run the commands in: the repository's examples (copied: commands write there),
    tests and benchmarks (linked), the folders PATHS names, and its own HOME."""
    d = tmp_path_factory.mktemp("readme")
    shutil.copytree(ROOT / "examples", d / "examples")
    for name in ("tests", "benchmarks"):
        (d / name).symlink_to(ROOT / name)
    for name in ("shots", "prefixes", "home"):
        (d / name).mkdir()
    return d


def environment(scratch):
    env = {k: v for k, v in os.environ.items() if k not in ("MLX_QWEN3VL_API_KEY",)}
    env.update(PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", HOME=str(scratch / "home"))
    return env


def run(shell, scratch, stdin=None, timeout=RUN_TIMEOUT):
    r = subprocess.run(["bash", "-c", shell], cwd=scratch, env=environment(scratch), input=stdin or "",
                       capture_output=True, text=True, timeout=timeout)
    return r


def ready(p, deadline, proc):
    """Wait until the server of `p` answers (True), or it ended or the deadline passed (False)."""
    url = f"http://127.0.0.1:{p.port}" + ("/health" if p.serve == "http" else "/mcp")
    headers = {"Authorization": f"Bearer {p.key}"} if p.key else {}
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as r:
                return r.status == 200
        except urllib.error.HTTPError:  # an HTTP answer: it is serving (MCP wants a POST)
            return p.serve == "mcp"
        except OSError:
            try:
                proc.wait(0.5)
            except subprocess.TimeoutExpired:
                pass
    return False


def serve(p, scratch, clients):
    """Start the server command, run `clients` (shell lines) against it, stop it (SIGTERM to its
    process group: itself, or mlx.launch and its ranks). Returns (exit status, log, client results)."""
    log = scratch / f"server-{p.port}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(["bash", "-c", "exec " + p.shell], cwd=scratch, env=environment(scratch),
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    results = []
    try:
        up = ready(p, time.monotonic() + START_TIMEOUT, proc)
        assert up, f"{p.command.where}: the server did not start:\n{log.read_text()[-3000:]}"
        results = [(line, run(line.replace("PORT", str(p.port)), scratch)) for line in clients]
    finally:
        if proc.poll() is None:
            # Under mlx.launch, signal the ranks (as a terminal's Ctrl-C reaches them): a signal to
            # the launcher alone does not stop them (docs/server.md). One process: the server itself.
            ranks, deadline = [], time.monotonic() + 30  # mlx.launch may relay rank 1's line late
            while "mlx.launch" in p.shell and len(ranks) < 2 and time.monotonic() < deadline:
                ranks = [int(pid) for pid in re.findall(r"rank \d of \d,? \(?pid (\d+)", log.read_text())]
                try:
                    proc.wait(0.2)
                except subprocess.TimeoutExpired:
                    pass
            if len(ranks) == 2:
                for pid in ranks:
                    os.kill(pid, signal.SIGTERM)
            else:
                os.killpg(proc.pid, signal.SIGTERM)
        try:
            status = proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
            status = "killed after 60 s"
    return status, log.read_text(), results


PARSE_ONLY = """
import argparse, runpy, sys
parse = argparse.ArgumentParser.parse_args
def stop(self, args=None, namespace=None):
    parse(self, args, namespace)
    print("[parsed]", file=sys.stderr)
    raise SystemExit(0)
argparse.ArgumentParser.parse_args = stop
target, sys.argv = sys.argv[1], sys.argv[1:]
if target.endswith(".py"):
    runpy.run_path(target, run_name="__main__")
else:
    runpy.run_module(target, run_name="__main__", alter_sys=True)
print("the program ended without parsing its arguments", file=sys.stderr)
raise SystemExit(3)
"""


def units():
    """The commands to run, once each (two pages holding the same command, once the models are
    substituted, run it once), with the curl lines of their page for a server."""
    out, seen = [], {}
    commands = all_commands()
    for c in commands:
        if classify(c)[0] != "run" or c.words[0] == "curl":
            continue
        try:
            p = how_to_run(c)
        except AssertionError as e:  # reported by test_command_runs for this command
            out.append((str(e), [c], []))
            continue
        same = re.sub(r"--(port|starting-port) \d+", "", p.shell)
        clients = [x for x in commands if x.page == c.page and x.words[0] == "curl" and x.line > c.line] \
            if p.serve == "http" else []
        if same in seen:
            seen[same][1].append(c)
            seen[same][2].extend(x for x in clients if x not in seen[same][2])
            continue
        seen[same] = (p, [c], clients)
        out.append(seen[same])
    return out


UNITS = units()


# ---------------------------------------------------------------------------------- the tests
def test_every_command_is_run_checked_or_left_out_with_a_reason():
    commands = all_commands()
    assert len(commands) >= 30, "the pages' commands were not found: are they still in ```bash blocks?"
    keys = {c.key for c in commands}
    for table in (SKIP, PARSE):
        stale = [k for k in table if k not in keys]
        assert not stale, f"no page holds these commands any more; update the table: {stale}"
    curls = [c for c in commands if c.words[0] == "curl"]
    served = {c.key for _, _, clients in UNITS for c in clients}
    unplanned = [u[0] for u in UNITS if isinstance(u[0], str)]
    assert not unplanned, unplanned
    assert all(c.key in served for c in curls), "a curl command with no server started before it on its page"
    for c in commands:
        kind, _ = classify(c)
        if kind == "run" and c.words[0] != "curl":
            name, _ = program(segments(c.words)[-1] if c.words[0] != "mlx.launch" else
                              c.words[c.words.index("--") + 1:])
            assert name.startswith(("mlx_qwen3vl", "examples/")), \
                f"{c.where}: nothing here knows how to run {name!r}: run it, PARSE it or SKIP it with a reason"


def test_ci_runs_the_readme_test_command():
    """.ci/run installs as README.md's test command says and runs it."""
    readme = [c for c in page_commands(ROOT / "README.md") if "pytest" in c.words]
    assert len(readme) == 1, "README.md should name one test command"
    install, test = segments(readme[0].words)
    lines = (ROOT / ".ci" / "run").read_text().replace("\\\n", " ").splitlines()
    ci = [shlex.split(line, comments=True) for line in lines]
    assert [w for w in install if w != "-q"] in [[w for w in line if w != "-q"] for line in ci], install
    assert test in ci, test


@pytest.mark.parametrize("command", [c for c in all_commands() if classify(c)[0] == "install"], ids=lambda c: c.where)
def test_install_commands_name_real_extras(command):
    text = (ROOT / "pyproject.toml").read_text()  # (tomllib is Python 3.11+; this project runs on 3.10)
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    extras = set(re.findall(r"^([A-Za-z][\w-]*)\s*=", section, re.M))
    assert {"test", "cpu", "server"} <= extras, extras
    for seg in segments(command.words):
        for w in seg:
            m = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", w)
            if m and m.group(1):
                for extra in m.group(1).split(","):
                    assert extra in extras, f"{command.where}: pyproject.toml has no extra {extra!r}"


# What a snippet's `import X` installs as (where the two names differ).
DISTRIBUTIONS = {"PIL": "pillow", "mlx_lm": "mlx-lm", "mlx_qwen3vl": "mlx-qwen3vl"}


def test_python_snippets_import_only_what_their_page_installs():
    """A page's ```python snippet imports the package, the standard library, the package's own
    dependencies, or what a `pip install` line above it on the same page installs (a package by
    name, or an extra that holds it): the server page's clients are not in the `server` extra."""
    text = (ROOT / "pyproject.toml").read_text()
    name = lambda req: re.match(r"[A-Za-z0-9_.-]+", req).group(0).lower().replace("_", "-")  # noqa: E731
    core = {name(r) for r in re.findall(r'"([^"]+)"', text.split("dependencies = [", 1)[1].split("]", 1)[0])}
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    extras = {m.group(1): {name(r) for r in re.findall(r'"([^"]+)"', m.group(2))}
              for m in re.finditer(r"^([\w-]+)\s*=\s*\[(.*?)\]", section, re.M | re.S)}
    for extra, reqs in extras.items():  # an extra naming another (test = mlx-qwen3vl[test-tools])
        for inner in re.findall(r"mlx-qwen3vl\[([\w,-]+)\]", section.split(extra + " =", 1)[1].split("\n", 1)[0]):
            reqs |= {r for e in inner.split(",") for r in extras.get(e, ())}
    checked = 0
    for page in PAGES:
        installed, text = set(core) | {"mlx-qwen3vl"}, page.read_text()
        for m in re.finditer(r"^```(bash|python)\n(.*?)^```", text, flags=re.S | re.M):
            if m.group(1) == "bash":
                for line in re.findall(r"pip install ([^#&\n]*)", m.group(2)):
                    for word in line.split():
                        extra = re.fullmatch(r"""["']?\.(?:\[([\w,-]+)\])?["']?""", word)
                        if extra:
                            installed |= {r for e in (extra.group(1) or "").split(",") if e for r in extras[e]}
                        elif not word.startswith("-"):
                            installed.add(name(word))
                continue
            for root in re.findall(r"^(?:from|import) ([A-Za-z_]\w*)", m.group(2), re.M):
                if root in sys.stdlib_module_names:
                    continue
                dist = DISTRIBUTIONS.get(root, root.replace("_", "-")).lower()
                line = text[:m.start()].count("\n") + 1
                assert dist in installed, f"{page.name}:{line}: imports {root}, which no pip install above it installs"
                checked += 1
    assert checked >= 10


def test_the_readme_s_snippet_runs_from_the_folder_above_the_clone(tmp_path):
    """The clone's folder, named as README.md clones it, is not importable: from the folder above
    it, `import mlx_qwen3vl` finds the installed package, not the clone's folder as a namespace
    package ("cannot import name 'load' from 'mlx_qwen3vl' (unknown location)", as a clone named
    mlx_qwen3vl did under an editable install, whose finder Python asks after the folders)."""
    (clone,) = [c for c in all_commands() if c.words[:2] == ["git", "clone"]]
    cut = clone.words.index("&&")
    folder = clone.words[cut - 1]
    assert clone.words[cut:] == ["&&", "cd", folder]
    (tmp_path / folder).mkdir()
    (tmp_path / folder / "mlx_qwen3vl").symlink_to(ROOT / "mlx_qwen3vl")
    code = f"""
import importlib.util, sys
class Editable:  # what an editable install appends to sys.meta_path: the package's own folder
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "mlx_qwen3vl":
            return importlib.util.spec_from_file_location(name, {str(ROOT / "mlx_qwen3vl" / "__init__.py")!r},
                                                          submodule_search_locations=[{str(ROOT / "mlx_qwen3vl")!r}])
sys.meta_path.append(Editable)
from mlx_qwen3vl import load
print(load.__module__)
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("mlx_qwen3vl"), r.stderr[-2000:]


def test_no_block_installs_both_linux_backends():
    """A block is pasted whole: one that installs both .[cpu] and .[cuda] fetches the CUDA wheels
    and replaces the CPU build's libmlx.so."""
    for page in PAGES:
        blocks = re.findall(r"^```bash\n(.*?)^```", page.read_text(), flags=re.S | re.M)
        for block in blocks:
            extras = set(re.findall(r"\.\[([\w,-]+)\]", block))
            named = {e for group in extras for e in group.split(",")} & {"cpu", "cuda"}
            assert len(named) <= 1, f"{page.name}: one block installs both backends:\n{block}"


@pytest.mark.parametrize("command", [c for c in all_commands() if classify(c)[0] == "parse"], ids=lambda c: c.where)
def test_long_running_commands_parse(command, scratch):
    (seg,) = segments(command.words)
    name, args = program(seg)
    r = run(shlex.join([sys.executable, "-c", PARSE_ONLY, name, *args]), scratch)
    assert r.returncode == 0 and "[parsed]" in r.stderr, f"{command.where}: {command.text}\n{r.stderr[-3000:]}"


@pytest.mark.parametrize("unit", UNITS, ids=lambda u: u[1][0].where)
def test_command_runs(unit, scratch):
    p, same, clients = unit
    if isinstance(p, str):
        pytest.fail(p)  # the command could not be planned: an unknown model or placeholder, or a remote launch
    where = ", ".join(c.where for c in same)
    if "mlx.launch" in p.shell and shutil.which("mlx.launch") is None:
        pytest.skip("mlx.launch is not on PATH")
    if p.serve:
        status, log, results = serve(p, scratch, [client_shell(how_to_run(c), "PORT") for c in clients])
        # Both servers promise status 0 on SIGTERM (docs/server.md, docs/protocols.md).
        assert status == 0, \
            f"{where}: {p.command.text}\nstopped with {status}:\n{log[-3000:]}"
        for line, r in results:
            assert r.returncode == 0, f"{where}: {line[:200]}\n{r.stderr[-2000:]}"
            answer = json.loads(r.stdout)
            assert "error" not in answer, f"{where}: {line[:200]}\n{r.stdout[:2000]}"
        return
    r = run(p.shell, scratch, stdin=p.stdin)
    assert r.returncode == 0, f"{where}: {p.command.text}\nran as: {p.shell}\n{r.stdout[-1500:]}\n{r.stderr[-3000:]}"
    for out in p.outputs:
        assert (scratch / out).exists(), f"{where}: {out} was not written"


def _anchors(path):
    """GitHub's anchors of a page's headings."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    return {re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            for m in re.finditer(r"^#{1,6} (.*)$", text, re.M)}


def test_links_between_the_pages_resolve():
    """README.md and docs/ point at each other and at benchmarks/: every relative link names a
    file that exists, and a heading of it where it names one."""
    pages = PAGES + [ROOT / "benchmarks" / "README.md", *sorted((ROOT / "benchmarks" / "results").glob("*.md"))]
    bad = []
    for page in pages:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://")):
                continue
            path, _, anchor = target.partition("#")
            file = page.parent / path if path else page
            if not file.exists() or (anchor and file.suffix == ".md" and anchor not in _anchors(file)):
                bad.append(f"{page.relative_to(ROOT)}: {target}")
    assert not bad, bad


def test_the_server_page_names_every_server_flag():
    """docs/server.md, whose table holds every flag that bounds a request, names every flag the
    server has."""
    from mlx_qwen3vl.server.__main__ import build_parser

    page = (ROOT / "docs" / "server.md").read_text()
    flags = [a.option_strings[-1] for a in build_parser()._actions if a.option_strings[-1] != "--help"]
    missing = [f for f in flags if not re.search(re.escape(f) + r"(?![\w-])", page)]
    assert not missing, missing
