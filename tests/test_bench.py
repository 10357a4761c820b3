"""benchmarks/bench.py runs end to end on the tiny preset, so it cannot rot. No timing asserts."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ["ttft_s", "prefill_tps", "decode_tps", "peak_memory_gb", "peak_rss_gb", "bytes_per_token",
           "roofline_tps", "roofline", "bandwidth_gbs", "roofline_start_bw",
           "roofline_best_bw"]


def test_bench_tiny_preset_writes_positive_figures(tmp_path):
    out = tmp_path / "tiny.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench.py"), "--preset", "tiny", "--workloads", "image448,agent",
           "--agent-turns", "2", "--agent-tokens", "2", "--agent-variants", "reuse",
           "--decode-tokens", "3", "--bandwidth-gb", "0.05", "--models-dir", str(tmp_path / "models"),
           "--out", str(out), "--verbose"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "BLAS:" in p.stderr  # --verbose names the BLAS in use
    report = json.loads(out.read_text())
    for key in ("cpu", "cores", "mlx", "backend", "blas"):
        assert report["machine"][key], key
    ours = report["engines"]["ours"]
    assert ours["info"]["bandwidth_gbs"] > 0 and ours["info"]["dtype"]
    r = ours["results"]["image448"]
    assert r["prompt_tokens"] > 0 and r["decode_tokens"] == 3
    assert r["vision_s"] > 0 and r["preprocess_s"] > 0
    for key in FIGURES:
        assert r[key] > 0, key
    agent = ours["results"]["agent"]
    assert set(agent) >= {"reuse"} and "no_reuse" not in agent  # --agent-variants picks the variants
    assert agent["reuse"]["total_s"] > 0 and len(agent["reuse"]["turn_s"]) == 2
    assert agent["reuse"]["cached_tokens"][0] == 0 and agent["reuse"]["cached_tokens"][1] > 0  # turn 2 reused turn 1
    assert "image448" in p.stdout  # the table
