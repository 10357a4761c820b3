"""python -m mlx_qwen3vl.bench and python -m mlx_qwen3vl.plan on the tiny checkpoints: the bench's
figures against what its own run measured (token counts, timings that add up, memory at least the
weights) and its JSON schema; the planner's counts against the loaded models, its quantized sizes
against real conversions, its KV and vision figures against the engine's caches and processor, and
the published architectures against their published parameter counts. No timing is asserted."""

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mlx_qwen3vl import Processor, attention, plan
from mlx_qwen3vl import memory
from mlx_qwen3vl.bench import machine
from mlx_qwen3vl.bench.__main__ import main as bench_main
from mlx_qwen3vl.bench.inputs import screenshot_messages, text_messages, tool_history_messages
from mlx_qwen3vl.architectures import HUB_IDS, PRESETS, preset_config
from mlx_qwen3vl.bench.report import validate
from mlx_qwen3vl.config import ModelConfig
from mlx_qwen3vl.weights import load_model

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
MAX_PIXELS = 131072  # keeps the tiny model's vision tower quick on a 2-core CPU
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}

# Total parameter counts published for the models the presets stand for (the tests allow 2%):
PUBLISHED = {
    # huggingface.co/OpenExplorer/Qwen3-VL-2B-Instruct: "Total model parameters 2.128B" (vision 407.0M,
    # language 1.721B), "calculated from the tensors stored in the upstream checkpoint"; the upstream
    # huggingface.co/Qwen/Qwen3-VL-2B-Instruct/tree/main lists model.safetensors (bfloat16) at 4.26 GB.
    "2b": 2.128e9,
    # codersera.com/blog/qwen3-vl-4b-instruct-vs-qwen3-vl-4b-thinking-complete-2025-guide: "a dense
    # transformer architecture with 4.44 billion parameters, featuring 36 layers".
    "4b": 4.44e9,
    # codersera.com/blog/qwen3-vl-8b-instruct-vs-qwen3-vl-8b-thinking-2025-guide: "8.77 billion
    # parameters"; haimaker.ai/models/qwen/qwen3-vl-8b-instruct: "8.8B-parameter".
    "8b": 8.77e9,
    # whatmodel.sh (github.com/jakemanger/whatmodel, pages/model/qwen3-vl-30b-a3b-instruct.md):
    # "31.1B params (3B active)"; the hub lists Qwen/Qwen3-VL-30B-A3B-Instruct-GGUF at 31B.
    "30b-a3b": 31.1e9,
}
# UI-Venus-1.5 publishes no parameter count beyond the hub's rounded sizes
# (huggingface.co/collections/inclusionAI/ui-venus: UI-Venus-1.5-8B "9B"; UI-Venus-1.5-30B-A3B "31B";
# UI-Venus-1.5-2B no size) and its config.json is not reachable here: the sizes are only checked to
# round as the hub shows them on the architectures they are built on.
UI_VENUS_ROUNDED = {"8b": 9e9, "30b-a3b": 31e9}


def loaded_counts(model):
    """(total, vision) parameters of a loaded model, a quantized weight counted as its original
    shape (packed uint32 words unpacked; scales and biases are storage, not parameters)."""
    total = vision = 0
    for path, module in model.named_modules():
        if module.children():
            continue
        bits = getattr(module, "bits", None)
        for name, value in tree_flatten(module.parameters()):
            if bits and name in ("scales", "biases"):
                continue
            n = value.size * 32 // bits if bits and name == "weight" else value.size
            total += n
            vision += n if path.startswith("visual.") else 0
    return total, vision


# ---------------------------------------------------------------------------------------------
# The planner
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["tiny-a", "tiny-moe", "mlxvlm-q4", "mlxvlm-moe-q4"])
def test_plan_counts_equal_the_loaded_models(name):
    raw, _, _ = plan.read_config(str(FIXTURES / name))
    counts = plan.parameter_counts(ModelConfig.from_dict(raw))
    total, vision = loaded_counts(load_model(FIXTURES / name, backend="mlx"))
    assert (counts["total"], counts["vision"]) == (total, vision)
    assert counts["language"] == total - vision


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_plan_counts_of_the_published_architectures(preset):
    counts = plan.parameter_counts(ModelConfig.from_dict(preset_config(preset)))
    assert abs(counts["total"] / PUBLISHED[preset] - 1) < 0.02, (preset, counts["total"])
    if preset in UI_VENUS_ROUNDED:
        assert round(counts["total"] / 1e9) * 1e9 == UI_VENUS_ROUNDED[preset]
    if preset == "30b-a3b":  # "A3B": about 3 billion of the language model's weights per token
        assert 3.0e9 < counts["active"] < 3.5e9


@pytest.mark.parametrize("name,bits", [("tiny-a", 4), ("tiny-moe", 3)])
def test_plan_quantized_bytes_equal_a_real_conversion(name, bits, tmp_path):
    from mlx_qwen3vl import convert

    out = tmp_path / "q"
    assert convert.main(["--hf-path", str(FIXTURES / name), "--mlx-path", str(out), "-q", "--q-bits", str(bits)]) == 0
    stored = sum(v.nbytes for f in out.glob("*.safetensors") for v in mx.load(str(f)).values())
    raw, _, _ = plan.read_config(str(FIXTURES / name))
    rows = {r["name"]: r["bytes"] for r in plan.weight_rows(ModelConfig.from_dict(raw))}
    assert rows[f"{bits}-bit"] == stored
    source = sum(v.nbytes for f in (FIXTURES / name).glob("*.safetensors") for v in mx.load(str(f)).values())
    assert rows["bfloat16"] == source  # the fixtures are stored in bfloat16


def test_plan_kv_bytes_equal_the_engines_cache():
    """The float32 row (the CPU backend's dtype) against the plain MLX graph's cache once a
    1,024-token prompt is in it."""
    from mlx_qwen3vl import PromptCache, stream_generate

    model = load_model(FIXTURES / "tiny-a", dtype="float32", backend="mlx")
    processor = Processor.from_pretrained(FIXTURES / "tiny-a")
    inputs = processor.apply_chat_template(text_messages(processor, plan.KV_TOKENS), tokenize=True)
    assert inputs["input_ids"].shape[1] == plan.KV_TOKENS
    cache = PromptCache(model.make_cache())
    for _ in stream_generate(model, processor, inputs=inputs, prompt_cache=cache, max_tokens=1):
        pass
    rows = {r["name"]: r["bytes"] for r in plan.kv_rows(model.config)}
    # the bytes of the positions it holds (its buffer keeps spare capacity for the next tokens)
    assert rows["float32"] == sum(c.nbytes * c.size() // c.capacity() for c in cache.cache)
    assert rows["bfloat16"] * 2 == rows["float32"]
    assert rows["8-bit"] is None and rows["4-bit"] is None  # head_dim 32: not a multiple of 64
    big = {r["name"]: r["bytes"] for r in plan.kv_rows(ModelConfig.from_dict(preset_config("8b")))}
    # mlx-lm's QuantizedKVCache: bits/8 bytes per element plus a bfloat16 scale and bias per 64
    assert big["8-bit"] / big["bfloat16"] == pytest.approx((128 + 8) / 256)
    assert big["4-bit"] / big["bfloat16"] == pytest.approx((64 + 8) / 256)


@pytest.mark.parametrize("size,max_pixels", [((1280, 720), None), ((1920, 1080), MAX_PIXELS), ((640, 480), 500000)])
def test_plan_vision_tokens_equal_the_processors(size, max_pixels):
    processor = Processor.from_pretrained(FIXTURES / "tiny-a")
    raw, _, folder = plan.read_config(str(FIXTURES / "tiny-a"))
    config = ModelConfig.from_dict(raw)
    image_config, _ = plan.image_config_for(folder)
    vision = plan.vision_plan(config, image_config, size, max_pixels)
    inputs = processor.apply_chat_template(screenshot_messages(*size), tokenize=True, max_pixels=max_pixels)
    t, h, w = (int(v) for v in inputs["image_grid_thw"][0])
    assert (vision["patches"], vision["resized"]) == (t * h * w, [w * 16, h * 16])
    assert vision["tokens"] == int((inputs["input_ids"] == config.image_token_id).sum())


def test_plan_vision_memory_estimate_against_a_measurement(on_cpu):
    """The estimate (activations plus the attention scores the plain MLX graph holds on a CPU)
    against MLX's peak while the tiny vision tower runs on that graph: within -20%..+60%."""
    model = load_model(FIXTURES / "tiny-a", dtype="float32", backend="mlx")
    processor = Processor.from_pretrained(FIXTURES / "tiny-a")
    image_config, _ = plan.image_config_for(FIXTURES / "tiny-a")
    for size in [(640, 360), (1280, 720)]:
        inputs = processor(text=processor.image_token, images=[screenshot_messages(*size)[0]["content"][0]["image"]],
                           max_pixels=400000)
        pixels = mx.array(inputs["pixel_values"])
        mx.eval(pixels)
        machine.fresh_mlx_measurement()
        base = mx.get_active_memory()
        features = model.get_image_features(pixels, inputs["image_grid_thw"])
        mx.eval(features.embeds, *features.deepstack)
        measured = mx.get_peak_memory() - base + pixels.nbytes
        v = plan.vision_plan(model.config, image_config, size, 400000, dtype_bytes=4)
        estimate = v["activation_bytes"] + v["attention_scores_bytes"]
        assert 0.8 < measured / estimate < 1.6, (size, measured, estimate)


@pytest.mark.parametrize("budget", [None, 1 << 21])
def test_plan_attention_working_bytes_against_a_measurement(on_cpu, monkeypatch, budget):
    """What the plan counts for attention beyond its inputs and output (the whole score matrix, or
    one query chunk's under attention.SCORE_BUDGET) against MLX's peak while the plain graph's
    attention runs over 4 heads x 1024 patches (16.8 MB of float32 scores): within -20%..+60%,
    so a plan that still counted the whole matrix under chunking (16x here) fails."""
    if budget is not None:
        monkeypatch.setattr(attention, "SCORE_BUDGET", budget)
    heads, n, d = 4, 1024, 64
    q, k, v = (mx.random.normal((1, heads, n, d), key=mx.random.key(i)) for i in range(3))
    mx.eval(q, k, v)
    machine.fresh_mlx_measurement()
    base = mx.get_active_memory()
    out = attention.scaled_dot_product_attention(q, k, v, d**-0.5)
    mx.eval(out)
    measured = mx.get_peak_memory() - base - out.nbytes
    estimate = plan.attention_working_bytes(heads * n * n * 4, "cpu", d)
    assert estimate == (heads * n * n * 4 if budget is None else budget // 2)
    assert 0.8 < measured / estimate < 1.6, (measured, estimate)


def test_plan_fits_against_the_gpu_working_set_on_macos(monkeypatch):
    """On an Apple GPU mx.device_info() reports the recommended working set (not on Linux): stubbed."""
    info = {"device_name": "Apple M2", "memory_size": 8 * 2**30, "max_recommended_working_set_size": 4_000_000_000}
    monkeypatch.setattr(mx, "device_info", lambda *a: dict(info))
    limits = memory.memory_limits()
    assert limits["budget"] == limits["working_set"] == 4_000_000_000 and "working set" in limits["budget_name"]
    p = plan.make_plan(preset_config("2b"), "2b", limits=limits, device="metal")
    verdicts = {f["weights"]: f["verdict"] for f in p["fits"]}
    assert verdicts["bfloat16"] == "does not fit" and verdicts["4-bit"] == "fits"
    for f in p["fits"]:
        assert f["need_bytes"] == f["weight_bytes"] + f["kv_bytes"] + f["working_bytes"]
        expect = ("fits" if f["need_bytes"] <= plan.HEADROOM * 4e9 else "tight" if f["need_bytes"] <= 4e9
                  else "does not fit")
        assert f["verdict"] == expect
    assert "iogpu.wired_limit_mb" in plan.format_plan(p)
    linux = memory.memory_limits({"device_name": "AMD EPYC"})  # what Linux reports: names only
    assert linux["working_set"] is None and linux["budget"] in (linux["available"], linux["total"])


def test_plan_command_line(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert plan.main(["--preset", "8b", "--screenshot", "2560x1440", "--context", "4096", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    p = json.loads(out.read_text())
    assert p["schema"] == 1 and p["kind"] == "mlx_qwen3vl.plan" and p["context_tokens"] == 4096
    assert p["vision"]["screenshot"] == [2560, 1440] and "8.77B" in printed
    assert [r["name"] for r in p["weights"]] == ["bfloat16", "float32", "8-bit", "6-bit", "4-bit", "3-bit"]
    assert bench_main(["--plan", "--model", str(FIXTURES / "tiny-moe")]) == 0  # bench --plan is the planner
    assert "mixture of experts" in capsys.readouterr().out
    for argv, words in [(["--preset", "2b", "--screenshot", "big"], "WIDTHxHEIGHT"),
                        (["--preset", "2b", "--context", "0"], "--context 0"),
                        (["--model", str(FIXTURES / "tiny-a"), "--max-pixels", "100"], "--max-pixels"),
                        (["--model", str(tmp_path / "nowhere")], "neither a local folder"),
                        (["--preset", "2b", "--json", str(tmp_path / "no" / "plan.json")], "--json"),
                        ([], "give --model")]:
        assert plan.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error:") and words in err[0], (argv, err)


def test_json_without_a_path(tmp_path, monkeypatch, capsys):
    """--json as the README words it, without a path: plan.json / bench.json in the current folder,
    as --json plan.json would write; `--json -` puts the JSON alone on stdout."""
    monkeypatch.chdir(tmp_path)
    assert plan.main(["--preset", "2b", "--json"]) == 0
    table = capsys.readouterr()
    assert plan.main(["--preset", "2b", "--json", str(tmp_path / "named.json")]) == 0
    capsys.readouterr()
    def same(text):  # the plan, but for this machine's free memory of the moment (and so what fits)
        d = json.loads(text)
        d.pop("machine")
        return [(k, v) for k, v in d.items() if k != "weights"] + [
            [(k, v) for k, v in row.items() if "fit" not in k] for row in d["weights"]]

    assert same((tmp_path / "plan.json").read_text()) == same((tmp_path / "named.json").read_text())
    assert table.err.strip() == "wrote plan.json" and "2.13B" in table.out
    assert plan.main(["--preset", "2b", "--json", "-"]) == 0
    out = capsys.readouterr()
    assert same(out.out) == same((tmp_path / "plan.json").read_text()) and "2.13B" in out.err
    from mlx_qwen3vl.bench.__main__ import build_parser

    assert build_parser().parse_args(["--model", "m", "--json"]).json == "bench.json"


def test_plan_hub_id_offline_is_one_line():
    p = subprocess.run([sys.executable, "-m", "mlx_qwen3vl.plan", "--model", "mlx-qwen3vl-tests/no-such-model"],
                       capture_output=True, text=True, timeout=60, env={**ENV, "HF_HUB_OFFLINE": "1"})
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "could not fetch config.json" in lines[0] and "HF_HUB_OFFLINE" in lines[0]


def test_plan_hub_id_with_the_hub_unreachable_fails_at_once(tmp_path):
    """No network (the hub's address refuses connections: a closed port on this machine): one line,
    status 2, within 2 s of the command starting its work, instead of huggingface_hub's five
    retries with back-off (~25 s, a dozen warning lines). The interpreter's own start is not timed."""
    from mlx_qwen3vl.distributed import free_ports

    code = ("import sys, time; from mlx_qwen3vl import plan; t = time.monotonic(); "
            "code = plan.main(['--model', 'mlx-qwen3vl-tests/no-such-model']); "
            "print(f'took {time.monotonic() - t:.2f}'); sys.exit(code)")
    env = {k: v for k, v in ENV.items() if k != "HF_HUB_OFFLINE"}
    env.update(HF_ENDPOINT=f"http://127.0.0.1:{free_ports()}", HF_HOME=str(tmp_path / "hf"))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "could not fetch config.json" in lines[0] and "hub unreachable" in lines[0], lines
    assert float(p.stdout.split()[-1]) < 2.0, p.stdout


def test_readme_table_is_the_planners():
    readme = (ROOT / "docs" / "bench.md").read_text()  # the planner's table, linked from README.md
    assert plan.README_HEADER in readme
    for preset, hub_id in HUB_IDS.items():
        p = plan.make_plan(preset_config(preset), preset)
        assert plan.readme_row(p, hub_id) in readme, plan.readme_row(p, hub_id)
    assert set(HUB_IDS) <= set(PRESETS)


# ---------------------------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    argv = ["--model", str(FIXTURES / "tiny-a"), "--quick", "--max-pixels", str(MAX_PIXELS), "--speculative",
            "--json", str(out)]
    p = subprocess.run([sys.executable, "-m", "mlx_qwen3vl.bench"] + argv, capture_output=True, text=True,
                       timeout=300, env=ENV)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(out.read_text()), p


def test_quick_bench_report_conforms_and_describes_the_run(quick_run):
    report, p = quick_run
    assert validate(report) == []
    s = report["settings"]
    assert (s["quick"], s["prompt_tokens"], s["decode_tokens"], s["repeats"], s["agent_turns"], s["agent_tokens"]) == \
        (True, 256, 32, 1, 3, 8)
    assert s["max_pixels"] == MAX_PIXELS and s["screenshots"] == [[1280, 720], [1920, 1080]]
    m = report["machine"]
    assert m["mlx"] == mx.__version__ and m["os"] and m["chip"] and m["cores"] == os.cpu_count()
    model = load_model(FIXTURES / "tiny-a")
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    assert report["model"]["parameters"] == loaded_counts(model)[0]
    assert report["model"]["weights_gb"] * 1e9 == pytest.approx(weights)
    assert report["model"]["dtype"] == "float32" and report["model"]["quantization"].startswith("none")
    header = p.stdout.splitlines()[:2]
    for words in (m["chip"], m["os"], f"MLX {m['mlx']}", "float32", "quantization: none"):
        assert any(words in line for line in header), words
    for label in ("text", "screenshot 1280x720", "screenshot 1920x1080", "agent loop"):
        assert label in p.stdout


def test_quick_bench_figures_match_what_the_run_measured(quick_run):
    report, _ = quick_run
    processor = Processor.from_pretrained(FIXTURES / "tiny-a")
    results = report["engines"]["mlx_qwen3vl"]["results"]
    weights = report["model"]["weights_gb"]
    expected = {"text": text_messages(processor, 256), "screenshot_1280x720": screenshot_messages(1280, 720),
                "screenshot_1920x1080": screenshot_messages(1920, 1080)}
    total = 0.0
    for name, messages in expected.items():
        r = results[name]
        inputs = processor.apply_chat_template(messages, tokenize=True, max_pixels=MAX_PIXELS)
        assert r["prompt_tokens"] == inputs["input_ids"].shape[1], name
        assert r["decode_tokens"] == 32 and r["engine_reported"]["generation_tokens"] == 32
        assert r["total_s"] == pytest.approx(r["ttft_s"] + r["decode_s"])
        assert r["decode_tps"] == pytest.approx(31 / r["decode_s"])
        assert r["prompt_tps"] == pytest.approx(r["prompt_tokens"] / r["ttft_s"])
        assert r["runs_total_s"] == [r["total_s"]]
        assert r["peak_memory_gb"] >= weights and r["peak_rss_gb"] >= weights
        total += r["total_s"]
    assert results["text"]["prompt_tokens"] == 256
    a = results["agent"]
    assert a["turns"] == 3 and a["generated_tokens"] == [8, 8, 8] and a["image_size"] == [1280, 720]
    assert sum(a["turn_s"]) <= a["total_s"] and a["total_s"] - sum(a["turn_s"]) < 0.1 * a["total_s"] + 0.05
    assert all(0 < t <= s for t, s in zip(a["ttft_s"], a["turn_s"]))
    assert a["cached_tokens"][0] == 0
    for t in (1, 2):  # each turn reuses at least the whole previous prompt, and computes its new screenshot
        assert a["prompt_tokens"][t - 1] <= a["cached_tokens"][t] < a["prompt_tokens"][t]
    assert min(a["peak_memory_gb"]) >= weights
    assert total + a["total_s"] < report["wall_s"]


def test_speculative_row_is_the_librarys_prompt_lookup(quick_run):
    """--speculative: on the agent conversation whose tool calls are resent, prompt lookup's run
    kept the drafts a library call with the same settings keeps, its tokens are the plain run's,
    and the table says both rates."""
    report, p = quick_run
    import mlx_qwen3vl as M

    spec = report["engines"]["mlx_qwen3vl"]["results"]["speculative"]
    assert report["settings"]["speculative"] == {"num_draft_tokens": 4, "prompt_lookup": 3, "draft_model": None}
    model = load_model(FIXTURES / "tiny-a")
    processor = Processor.from_pretrained(FIXTURES / "tiny-a")
    inputs = processor.apply_chat_template(tool_history_messages(), add_generation_prompt=True, tokenize=True,
                                           max_pixels=MAX_PIXELS)
    kw = dict(inputs=inputs, max_tokens=32, temperature=0.0, ignore_eos=True)
    plain = M.generate(model, processor, **kw)
    looked = M.generate(model, processor, prompt_lookup=3, num_draft_tokens=4, **kw)
    assert looked.token_ids == plain.token_ids and looked.draft_accepted > 0
    assert spec["prompt_tokens"] == inputs["input_ids"].shape[1] and spec["decode_tokens"] == 32
    rows = spec["drafters"]
    assert set(rows) == {"plain", "prompt_lookup"} and rows["plain"]["proposed"] == 0
    lookup = rows["prompt_lookup"]
    assert (lookup["proposed"], lookup["accepted"]) == (looked.draft_proposed, looked.draft_accepted)
    assert lookup["same_tokens"] and lookup["acceptance"] == pytest.approx(lookup["accepted"] / lookup["proposed"])
    assert lookup["speedup"] == pytest.approx(lookup["decode_tps"] / rows["plain"]["decode_tps"])
    line = next(line for line in p.stdout.splitlines() if line.startswith("speculative decoding"))
    assert f"{lookup['accepted']}/{lookup['proposed']} drafts kept" in line and "TOKENS DIFFER" not in line
    broken = json.loads(json.dumps(report))
    del broken["engines"]["mlx_qwen3vl"]["results"]["speculative"]["drafters"]["prompt_lookup"]["same_tokens"]
    assert validate(broken) == ["engines.mlx_qwen3vl.results.speculative.drafters.prompt_lookup.same_tokens is missing"]


def test_speculative_row_with_a_draft_model(tmp_path):
    """--draft-model: the fixture as its own draft model proposes exactly the model's greedy
    tokens, so every draft is kept and the tokens are the plain run's."""
    out = tmp_path / "b.json"
    model = str(FIXTURES / "tiny-a")
    argv = ["--model", model, "--quick", "--max-pixels", str(MAX_PIXELS), "--prompt-tokens", "32", "--decode-tokens",
            "12", "--agent-turns", "0", "--speculative", "--num-draft-tokens", "3", "--draft-model", model, "--json",
            str(out)]
    assert bench_main(argv) == 0
    report = json.loads(out.read_text())
    assert validate(report) == []
    rows = report["engines"]["mlx_qwen3vl"]["results"]["speculative"]["drafters"]
    assert set(rows) == {"plain", "prompt_lookup", "draft_model"}
    d = rows["draft_model"]
    assert d["same_tokens"] and d["proposed"] > 0 and d["accepted"] == d["proposed"] and d["acceptance"] == 1.0


def test_bench_flags_are_checked_before_any_work(tmp_path, capsys):
    model = str(FIXTURES / "tiny-a")
    cases = [(["--model", model, "--decode-tokens", "1"], "--decode-tokens 1"),
             (["--model", model, "--agent-turns", "-1"], "--agent-turns -1"),
             (["--model", model, "--repeats", "0"], "--repeats 0"),
             (["--model", model, "--compare", "llama.cpp"], "--compare 'llama.cpp'"),
             (["--model", model, "--json", str(tmp_path / "missing" / "b.json")], "--json"),
             (["--model", model, "--json", str(tmp_path)], "--json"),
             (["--model", model, "--max-pixels", "100"], "--max-pixels"),
             (["--model", str(tmp_path / "nowhere")], "--model"),
             (["--preset", "2b"], "--preset is for --plan"),
             (["--model", model, "--speculative", "--num-draft-tokens", "0"], "--num-draft-tokens 0"),
             (["--model", model, "--draft-model", model], "go with --speculative"),
             (["--model", model, "--speculative", "--draft-model", str(tmp_path / "nowhere")], "--draft-model"),
             ([], "give --model")]
    for argv, words in cases:
        assert bench_main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error:") and words in err[0], (argv, err)
    with pytest.raises(SystemExit) as e:
        bench_main(["--model", model, "--bogus"])
    assert e.value.code == 2 and capsys.readouterr().err.startswith("error:")


def test_compare_without_mlx_vlm_says_so_in_one_line(monkeypatch, tmp_path, capsys):
    """--compare mlx-vlm where it is not installed: our run goes on, the note is one line (stderr and JSON)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlx_vlm" else real(name, *a))
    out = tmp_path / "b.json"
    argv = ["--model", str(FIXTURES / "tiny-a"), "--quick", "--max-pixels", str(MAX_PIXELS), "--prompt-tokens", "32",
            "--decode-tokens", "2", "--agent-turns", "0", "--compare", "mlx-vlm", "--json", str(out)]
    assert bench_main(argv) == 0
    report = json.loads(out.read_text())
    assert validate(report) == [] and list(report["engines"]) == ["mlx_qwen3vl"]
    assert report["notes"] == ["mlx-vlm is not installed in this environment (pip install mlx-vlm); "
                               "--compare mlx-vlm skipped"]
    assert sum("mlx-vlm is not installed" in line for line in capsys.readouterr().err.splitlines()) == 1


def test_validate_names_what_departs_from_the_schema(quick_run):
    report = json.loads(json.dumps(quick_run[0]))
    del report["machine"]["chip"]
    report["settings"]["repeats"] = "3"
    report["engines"]["mlx_qwen3vl"]["results"]["agent"]["turn_s"].pop()
    assert validate(report) == ["machine.chip is missing", "settings.repeats is str",
                                "engines.mlx_qwen3vl.results.agent.turn_s has 2 entries, not 3"]
    assert validate({**report, "schema": 2})[0].endswith("not mlx_qwen3vl.bench schema 1")


def test_compare_with_mlx_vlm_runs_it_on_the_same_inputs(tmp_path, monkeypatch):
    """Where mlx-vlm is installed: it runs on the same inputs (the same prompt tokens), in its own
    process. On the lab's tiny preset, whose vocabulary rows past the tokenizer are kept small so
    random weights emit tokens mlx-vlm's detokenizer knows."""
    pytest.importorskip("mlx_vlm")
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from harness.preset_folders import build_preset

    folder = build_preset("tiny", tmp_path / "models", log=lambda msg: None)
    out = tmp_path / "b.json"
    argv = ["--model", str(folder), "--quick", "--max-pixels", str(MAX_PIXELS), "--prompt-tokens", "32",
            "--decode-tokens", "4", "--agent-turns", "2", "--agent-tokens", "2", "--compare", "mlx-vlm", "--json", str(out)]
    assert bench_main(argv) == 0
    report = json.loads(out.read_text())
    assert validate(report) == [] and report["notes"] == []
    ours, theirs = (report["engines"][e]["results"] for e in ("mlx_qwen3vl", "mlx-vlm"))
    assert set(ours) == set(theirs)
    for name in ours:
        if name == "agent":
            # the same first turn (later ones hold each engine's own answers)
            assert theirs[name]["prompt_tokens"][0] == ours[name]["prompt_tokens"][0]
            assert theirs[name]["cached_tokens"] == [0, 0] and theirs[name]["generated_tokens"] == [2, 2]
        else:
            assert theirs[name]["prompt_tokens"] == ours[name]["prompt_tokens"] and theirs[name]["decode_tokens"] == 4
