"""Running the workers (one fresh process per engine) and turning their figures into rooflines,
ratios and the printed tables."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from .measure import decode_bytes_per_token
from .preset_folders import ROOT


BENCH = ROOT / "benchmarks" / "bench.py"  # what a worker process runs (with --worker)


def run_worker(engine, spec, python=None, timeout=None):
    """Run one engine's worker in a fresh process; its JSON result, or None with a note."""
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        if (engine == "mlx-vlm" and not spec.get("same_blas")) or engine == "transformers":
            env["MLX_QWEN3VL_BLAS"] = "off"  # their users' BLAS (the harness imports mlx_qwen3vl in every worker)
        cmd = [python or sys.executable, str(BENCH), "--worker", engine, str(spec_path), str(out_path)]
        try:
            p = subprocess.run(cmd, env=env, timeout=timeout)
        except subprocess.TimeoutExpired:
            return None, f"{engine} did not finish within {timeout} s"
        if p.returncode != 0 or not out_path.is_file():
            return None, f"{engine} worker failed (exit {p.returncode}); see the log above"
        return json.loads(out_path.read_text()), None


def available(engine):
    import importlib.util

    module = {"mlx-vlm": "mlx_vlm", "transformers": "transformers"}[engine]
    if importlib.util.find_spec(module) is None:
        return f"{engine} is not installed in this environment (pip install {engine})"
    if engine == "transformers" and importlib.util.find_spec("torch") is None:
        return "transformers needs torch, which is not installed"
    return None


def ratio(ours, theirs, key, higher_is_better):
    if not ours or not theirs or ours.get(key) in (None, 0) or theirs.get(key) in (None, 0):
        return None
    return ours[key] / theirs[key] if higher_is_better else theirs[key] / ours[key]


COMPARED = [("vision_s", False, "vision"), ("ttft_s", False, "TTFT"), ("prefill_tps", True, "prefill"),
            ("decode_tps", True, "decode"), ("peak_memory_gb", False, "memory")]


def print_tables(report):
    bw = report["engines"].get("ours", {}).get("info", {}).get("bandwidth_gbs")
    print(f"\n{report['model']}  ·  {report['machine']['cpu']} ({report['machine']['cores']} cores)  ·  MLX "
          f"{report['machine']['mlx']} {report['machine']['backend']}  ·  BLAS: {report['machine']['blas']}")
    head = (f"{'engine':<26}{'workload':<11}{'tokens':>7}{'vision s':>10}{'TTFT s':>9}{'prefill/s':>11}{'decode/s':>10}"
            f"{'RSS GB':>9}{'roofline':>10}{'(vs best)':>11}")
    print(head)
    print("-" * len(head))
    for label, eng in report["engines"].items():
        for name, r in eng.get("results", {}).items():
            if name == "agent":
                continue
            f = lambda k, s: (s.format(r[k]) if r.get(k) is not None else "-")
            roof = f"{r['roofline']:.0%}" if r.get("roofline") else "-"
            roof_best = f"{r['roofline_best_bw']:.0%}" if r.get("roofline_best_bw") else "-"
            tag = " (est.)" if r.get("extrapolated") else ""
            print(f"{label:<26}{name:<11}{r['prompt_tokens']:>7}{f('vision_s', '{:.2f}'):>10}{f('ttft_s', '{:.2f}'):>9}"
                  f"{f('prefill_tps', '{:.1f}'):>11}{f('decode_tps', '{:.2f}'):>10}{f('peak_rss_gb', '{:.2f}'):>9}{roof:>10}"
                  f"{roof_best:>11}{tag}")
    for label, eng in report["engines"].items():
        a = eng.get("results", {}).get("agent")
        if a:
            parts = [f"{v.replace('_', ' ')} {a[v]['total_s']:.1f} s" for v in ("reuse", "no_reuse") if v in a]
            print(f"\nagent loop, {label} ({a['turns']} turns, 1280x720 screenshot + instruction, "
                  f"{a['tokens_per_turn']} tokens each): " + ", ".join(parts)
                  + (f" → {a['speedup']:.2f}x" if a.get("speedup") else ""))
    if report.get("ratios"):
        print("\nours / theirs (>1 means ours is better: faster, or less memory)")
        print(f"{'against':<26}{'workload':<11}" + "".join(f"{lbl:>10}" for _, _, lbl in COMPARED))
        for label, per in report["ratios"].items():
            for name, rr in per.items():
                if name == "agent":
                    print(f"{label:<26}agent loop: ours with reuse {rr['total']:.2f}x faster in total")
                    continue
                print(f"{label:<26}{name:<11}" + "".join(
                    f"{(format(rr[lbl], '.2f') + 'x') if rr.get(lbl) else '-':>10}" for _, _, lbl in COMPARED))
    if bw:
        print(f"\nmemory bandwidth measured in this run: {bw:.1f} GB/s at the start of our worker, "
              f"{report.get('bandwidth_best_gbs', bw):.1f} GB/s at best; 'roofline' uses the one measured right "
              f"after each workload, '(vs best)' the best")
    for note in report.get("notes", []):
        print(f"note: {note}")


def analyze(report, text_cfg, tie):
    """Rooflines and our/their ratios from the workers' raw figures (also rerun by --reanalyze)."""
    # Roofline of each engine's decode against the bandwidth measured right after it in its own
    # worker; `roofline_start_bw` uses our worker's start-of-run measurement instead and
    # `roofline_best_bw` the best bandwidth measured anywhere in the run (the machine's capability:
    # the conservative figure, since a shared machine's bandwidth dips but never exceeds it).
    bw_start = report["engines"].get("ours", {}).get("info", {}).get("bandwidth_gbs")
    bw_best = max([bw_start or 0] + [r.get("bandwidth_gbs") or 0 for eng in report["engines"].values()
                                     for r in eng.get("results", {}).values()])
    report["bandwidth_best_gbs"] = bw_best
    for label, eng in report["engines"].items():
        dt = eng.get("info", {}).get("dtype", "float32")
        nbytes = {"float32": 4, "float16": 2, "bfloat16": 2}.get(dt, 4)
        for name, r in eng.get("results", {}).items():
            bw = r.get("bandwidth_gbs") or bw_start
            if name == "agent" or not r.get("decode_tps") or not bw:
                continue
            per_token = decode_bytes_per_token(text_cfg, tie, nbytes,
                                               r["prompt_tokens"] + r["decode_tokens"] // 2)
            r["bytes_per_token"] = per_token
            r["roofline_tps"] = bw * 1e9 / per_token
            r["roofline"] = r["decode_tps"] / r["roofline_tps"]
            if bw_start:
                r["roofline_start_bw"] = r["decode_tps"] * per_token / (bw_start * 1e9)
            r["roofline_best_bw"] = r["decode_tps"] * per_token / (bw_best * 1e9)
    ours = report["engines"].get("ours", {}).get("results", {})
    for label, eng in report["engines"].items():
        if label == "ours":
            continue
        per = {}
        for name, theirs in eng.get("results", {}).items():
            mine = ours.get(name)
            if not mine:
                continue
            if name == "agent":  # our ChatSession (reuse) against their best way to run the loop
                best = min((theirs[v] for v in ("reuse", "no_reuse") if v in theirs), key=lambda r: r["total_s"])
                if "reuse" in mine:
                    per[name] = {"total": best["total_s"] / mine["reuse"]["total_s"],
                                 "same_answers": best["answers"] == mine["reuse"]["answers"]}
                continue
            # Memory against the process's peak RSS: our CPU kernels allocate numpy arrays, which
            # MLX's own peak counter does not see, and torch has none.
            per[name] = {lbl: ratio(mine, theirs, "peak_rss_gb" if key == "peak_memory_gb" else key, hib)
                         for key, hib, lbl in COMPARED}
        report["ratios"][label] = per
