"""The command line and the API at their edges (issue #14): every bad value ends in one clear
line (CLI: `error: ...` on stderr, exit status 2, no traceback; API: InputError naming the
argument and its allowed range), checked before any model is loaded or any prefill runs."""

import json
import math
import os
import subprocess
import sys

import pytest

import mlx_qwen3vl as M
from conftest import FIXTURES, load_fixture_model
from mlx_qwen3vl.errors import InputError

ROOT = FIXTURES.parents[1]
TINY = str(FIXTURES / "tiny-b")


def cli(*args, module="mlx_qwen3vl", **env):
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **env}, timeout=300)


def assert_one_error_line(p, needle):
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], p.stderr
    assert "Traceback" not in p.stderr and p.stdout == ""


def in_process(capsys, *args):
    """main() as the CLI runs it, without a new interpreter (the values are refused before any
    model work, so this is what a subprocess would print)."""
    from mlx_qwen3vl.__main__ import main

    try:
        code = main(list(args))
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)


@pytest.mark.parametrize("args, needle", [
    (["--max-tokens", "0"], "--max-tokens = 0"),
    (["--max-tokens", "-1"], "--max-tokens = -1"),
    (["--seed", "-1"], "--seed = -1"),
    (["--temp", "nan"], "--temp = nan"),
    (["--temp", "-1"], "--temp = -1"),
    (["--top-p", "2"], "--top-p = 2"),
    (["--top-p", "0"], "(0, 1]"),
    (["--min-p", "2"], "--min-p = 2"),
    (["--top-k", "-3"], "--top-k = -3"),
    (["--repetition-penalty", "-1"], "--repetition-penalty = -1"),
    (["--repetition-penalty", "inf"], "--repetition-penalty = inf"),
    (["--prefill-step-size", "0"], "--prefill-step-size = 0"),
    (["--temp", "warm"], "--temp"),
    (["--no-such-flag"], "--no-such-flag"),
])
def test_bad_values_exit_2_with_one_line(args, needle, capsys):
    assert_one_error_line(in_process(capsys, "--model", TINY, *args), needle)


@pytest.mark.parametrize("args, needle", [
    (["--max-pixels", "0"], "--max-pixels=0 is below 1024"),
    (["--min-pixels", "0"], "--min-pixels=0"),
    (["--min-pixels", "5000", "--max-pixels", "4000"], "1 <= --min-pixels <= --max-pixels"),
    (["--fps", "0"], "--fps=0.0"),
    (["--fps", "-2"], "--fps=-2.0"),
    (["--fps", "nan"], "--fps=nan"),
])
def test_media_flags_are_named_as_typed(args, needle, capsys):
    """Checked against the checkpoint's preprocessor config before the model loads, and named by
    the flag, never by the API argument (max_pixels=, source_fps=)."""
    p = in_process(capsys, "--model", TINY, *args)
    assert_one_error_line(p, needle)
    assert "_pixels" not in p.stderr and "video_fps" not in p.stderr


def test_bad_value_in_a_real_process():
    assert_one_error_line(cli("--model", TINY, "--seed", "-1"), "--seed = -1")


def test_unknown_backend_switch_is_one_error_line():
    p = cli("--model", TINY, "--prompt", "hi", MLX_QWEN3VL_CPU_KERNELS="gpu")
    assert_one_error_line(p, "MLX_QWEN3VL_CPU_KERNELS='gpu' is not one of auto, c, numpy, mlx")


def test_prompt_past_the_context_is_refused_before_prefill(tmp_path):
    """A checkpoint whose max_position_embeddings is 24: the limit and the prompt length are named."""
    for f in (FIXTURES / "tiny-b").iterdir():
        if f.is_file() and f.name != "config.json":
            (tmp_path / f.name).symlink_to(f)
    config = json.loads((FIXTURES / "tiny-b" / "config.json").read_text())
    config["text_config"]["max_position_embeddings"] = 24
    (tmp_path / "config.json").write_text(json.dumps(config))
    p = cli("--model", str(tmp_path), "--prompt", "Tell me about the weather in a long sentence, please.")
    assert_one_error_line(p, "context is 24")


def test_both_entry_points_and_help_show_defaults():
    for module in ("mlx_qwen3vl", "mlx_qwen3vl.generate"):
        p = cli("--help", module=module)
        assert p.returncode == 0 and p.stderr == ""
        for default in ("Describe this image.", "default: 256", "default: 0.0",
                        "default: 2048"):
            assert default in p.stdout, default
    p = cli("--model", TINY, "--prompt", "hi", "--max-tokens", "2", "--verbose")
    assert p.returncode == 0
    assert "backend: cpu path" in p.stderr and "BLAS for MLX: " in p.stderr and "prompt: 'hi'" in p.stderr
    # --verbose's KV figure is the bytes in use: the cache's buffers (grown 256 positions at a time),
    # as a session's cache holds them after the same turn, not the positions' bytes alone
    session = M.ChatSession(load_fixture_model("tiny-b"), M.Processor.from_pretrained(TINY), max_tokens=2)
    session.send("hi")
    last, held = session.last, sum(c.nbytes for c in session.prompt_cache.cache)
    positions = last.prompt_tokens + last.generation_tokens - 1
    assert last.kv_cache_bytes == held
    assert f"KV cache: {held / 1e6:.2f} MB in use for {positions} positions (float)" in p.stderr, p.stderr


@pytest.mark.parametrize("kwargs, needle", [
    (dict(max_tokens=0), "max_tokens = 0"),
    (dict(temperature=math.nan), "temperature = nan"),
    (dict(top_p=2.0), "top_p = 2.0"),
    (dict(min_p=-0.1), "min_p"),
    (dict(seed=-1), "seed = -1"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(stop=[""]), "stop"),
])
def test_api_validates_sampling_values(kwargs, needle):
    model = load_fixture_model("tiny-b")
    processor = M.Processor.from_pretrained(FIXTURES / "tiny-b")
    with pytest.raises(InputError, match=needle) as e:
        M.generate(model, processor, "hi", **kwargs)
    assert "--" not in str(e.value)  # API messages never name CLI flags
    with pytest.raises(InputError, match=needle):
        M.SamplingParams(**kwargs)
    with pytest.raises(InputError, match=needle):
        M.batch_generate(model, processor, [dict(prompt="hi", **kwargs)])
    with pytest.raises(TypeError, match="tempreature"):
        M.generate(model, processor, "hi", tempreature=1.0)


def test_api_refuses_prompt_past_the_context(monkeypatch):
    model = load_fixture_model("tiny-b")
    processor = M.Processor.from_pretrained(FIXTURES / "tiny-b")
    monkeypatch.setattr(model.config.text_config, "max_position_embeddings", 10)
    with pytest.raises(InputError, match=r"prompt is \d+ tokens but the model's context is 10"):
        M.generate(model, processor, "hi there")


def test_api_load_errors_do_not_mention_cli_flags(tmp_path):
    with pytest.raises(M.errors.ModelNotFoundError) as e:
        M.load("/no/such/model")
    assert "--model" not in str(e.value)
    with pytest.raises(M.errors.ConfigError) as e:
        M.load(tmp_path)  # a folder that is no checkpoint
    assert "--model" not in str(e.value) and "config.json" in str(e.value)


def test_good_run_prints_only_statistics_on_stderr_without_torch():
    """As on a machine without torch (transformers would advise 'PyTorch was not found')."""
    code = ("import sys, runpy; sys.modules['torch'] = None; "
            f"sys.argv = ['mlx_qwen3vl', '--model', {TINY!r}, '--prompt', 'hi', '--max-tokens', '2']; "
            "runpy.run_module('mlx_qwen3vl', run_name='__main__')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr
    # Exactly the three lines the README promises: no blank line before them on a terminal
    assert [line.split(":")[0] for line in p.stderr.splitlines()] == ["Prompt", "Generation", "Peak memory"]


def test_readme_synopsis_lists_every_flag_as_it_takes_values():
    """The command line's synopsis (docs/cli.md) names every flag the parser has, and a flag that
    takes several values (--image, --video, --stop) is shown with `...`; the README's short one
    names only flags the parser has."""
    import re

    from mlx_qwen3vl.__main__ import build_parser

    synopsis = (ROOT / "docs" / "cli.md").read_text().split("```text", 1)[1].split("```")[0]
    shown = set(re.findall(r"--[a-z][a-z-]*", synopsis))
    actions = [a for a in build_parser()._actions if a.option_strings and a.option_strings[-1] != "--help"]
    flags = {a.option_strings[-1] for a in actions}
    assert flags - shown == set() and shown - flags == set()
    short = (ROOT / "README.md").read_text().split("## Command line", 1)[1].split("```text", 1)[1].split("```")[0]
    assert set(re.findall(r"--[a-z][a-z-]*", short)) <= flags
    for a in actions:
        if a.nargs == "+":
            assert re.search(re.escape(a.option_strings[-1]) + r" \S+ \.\.\.\]", synopsis), a.option_strings[-1]


def test_errors_are_importable_from_the_package():
    from mlx_qwen3vl import ConfigError, ContextLengthError, InputError, ModelNotFoundError, Qwen3VLError, WeightsError

    assert issubclass(InputError, Qwen3VLError) and issubclass(ContextLengthError, InputError)
    assert {ConfigError, WeightsError, ModelNotFoundError} <= set(Qwen3VLError.__subclasses__())
    with pytest.raises(M.InputError):
        M.generate(load_fixture_model("tiny-b"), M.Processor.from_pretrained(FIXTURES / "tiny-b"), "hi", top_p=2.0)


# ---------------------------------------------------------------------------------------------
# A newcomer's frictions (issue #40)
# ---------------------------------------------------------------------------------------------
def test_no_model_is_one_error_line_not_a_download(capsys):
    """--model is required (as the usage line and mlx-lm / mlx-vlm say): never a silent download."""
    p = in_process(capsys, "--prompt", "hi")
    assert_one_error_line(p, "--model")
    assert "required" in p.stderr
    assert "usage" not in p.stderr


class Terminal:
    """A command on a pseudo-terminal (stdin, stdout and stderr), read as a user would see it."""

    def __init__(self, *args):
        import pty

        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen([sys.executable, "-m", "mlx_qwen3vl", *args], stdin=slave, stdout=slave,
                                     stderr=slave, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                                     close_fds=True)
        os.close(slave)
        self.text = ""

    def until(self, needle, start=0, seconds=120):
        """Read until `needle` appears after position `start`; its position."""
        import select
        import time

        deadline = time.monotonic() + seconds
        while needle not in self.text[start:]:
            left = deadline - time.monotonic()
            assert left > 0, f"no {needle!r} within {seconds} s:\n{self.text[-3000:]}"
            if select.select([self.master], [], [], left)[0]:
                try:
                    data = os.read(self.master, 65536)
                except OSError:  # the process ended: its side of the terminal closed
                    data = b""
                assert data, f"the program ended before {needle!r}:\n{self.text[-3000:]}"
                self.text += data.decode(errors="replace").replace("\r\n", "\n")
        return self.text.index(needle, start)

    def type(self, line):
        os.write(self.master, line.encode())

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        os.close(self.master)


def test_ctrl_c_in_chat_stops_the_answer_and_keeps_the_history(tmp_path):
    """Under a terminal: Ctrl-C while an answer streams stops that answer, the chat goes on, and
    the next turn's prompt is the history without the stopped turn, its first turn from the cache."""
    import signal

    from scripted import write_scripted_checkpoint

    long = " ".join(str(n) for n in range(1000, 1100))  # ~500 tokens: the stop lands inside it
    folder = write_scripted_checkpoint(tmp_path / "scripted", {"@one": "First answer.", "@long": long,
                                                                "@three": "Third answer."})
    term = Terminal("--model", str(folder), "--chat", "--max-tokens", "600")
    try:
        at = term.until(">> ")
        term.type("hi @one\n")
        at = term.until(">> ", term.until("Peak memory", at))
        term.type("count @long\n")
        turn = at = term.until("1000 1001", at)
        term.proc.send_signal(signal.SIGINT)
        stopped = term.until("[stopped", at)
        at = term.until(">> ", stopped)
        assert "1099" not in term.text and "Prompt:" not in term.text[turn:at], term.text[-2000:]  # no statistics
        term.type("and now @three\n")
        at = term.until("Peak memory", term.until("Third answer.", at))
        prompt = term.text[term.text.rindex("Prompt:", 0, at):at].split()
        term.type("\x04")  # Ctrl-D at the start of a line: end of input
        assert term.proc.wait(60) == 0, term.text[-2000:]
    finally:
        term.close()
    processor = M.Processor.from_pretrained(folder)
    history = [{"role": "user", "content": "hi @one"}, {"role": "assistant", "content": "First answer."},
               {"role": "user", "content": "and now @three"}]
    want = processor.apply_chat_template(history, tokenize=True)["input_ids"].shape[1]
    assert int(prompt[1]) == want, prompt  # the stopped turn is not in the history
    assert int(prompt[3].strip("(")) >= 10, prompt  # turn 1 came from the cache
