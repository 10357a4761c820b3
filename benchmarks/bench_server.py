"""Agent traffic against an OpenAI-compatible server: N concurrent conversations of T turns, each
turn resending the whole history plus a new screenshot, greedy. Reports total throughput and
per-turn latency (and cached prompt tokens where the server reports them), for our server and
mlx-vlm's on the same checkpoint. "ours-2ranks" is our server under `mlx.launch -n 2 --backend
ring` over 127.0.0.1 (rank 0 serving HTTP, the model split over both ranks).

    python benchmarks/bench_server.py --model tests/fixtures/mlxvlm-float --servers ours,mlx-vlm
    python benchmarks/bench_server.py --servers ours,ours-2ranks
"""

import argparse
import base64
import io
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(server, model, port, max_batch):
    if server.startswith("ours"):
        cmd = [sys.executable, "-m", "mlx_qwen3vl.server", "--model", model, "--port", str(port),
               "--max-batch", str(max_batch)]
        if server == "ours-2ranks":
            sys.path.insert(0, str(ROOT))
            from mlx_qwen3vl.distributed import local_launch_command

            cmd = local_launch_command(2, cmd)
    else:
        cmd = [sys.executable, "-m", "mlx_vlm.server", "--model", model, "--port", str(port)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # Its own session: stopping it stops mlx.launch's ranks too.
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    ready, log = threading.Event(), []

    def drain():
        for line in proc.stderr:
            log.append(line)
            if "Uvicorn running on" in line or "Application startup complete" in line:
                ready.set()
        ready.set()

    threading.Thread(target=drain, daemon=True).start()
    ready.wait(600)
    if proc.poll() is not None:
        raise RuntimeError(f"{server} server exited:\n" + "".join(log[-30:]))
    return proc, log


def screenshot(rng, size):
    """A GUI-like screenshot: flat panels and a few buttons, different every turn, same size."""
    w, h = size
    img = np.full((h, w, 3), 240, np.uint8)
    for _ in range(8):
        x0, y0 = rng.integers(0, w - 8), rng.integers(0, h - 8)
        img[y0:y0 + rng.integers(4, h // 3), x0:x0 + rng.integers(8, w // 2)] = rng.integers(0, 255, 3)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    # With a subtype: mlx-vlm 0.7.10 answers 500 to `data:image;base64,...` (ours takes both).
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def conversation(client, model_id, c, turns, size, max_tokens, seed):
    rng = np.random.default_rng(seed + c)
    messages = [{"role": "system", "content": "You are a GUI agent. Answer with the next action."}]
    out = []
    for t in range(turns):
        messages.append({"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": screenshot(rng, size)}},
            {"type": "text", "text": f"Task {c}, step {t}: open the settings and lower the brightness."}]})
        tic = time.perf_counter()
        r = client.chat.completions.create(model=model_id, messages=messages, max_tokens=max_tokens, temperature=0)
        latency = time.perf_counter() - tic
        details = getattr(r.usage, "prompt_tokens_details", None)
        out.append({"conversation": c, "turn": t, "latency_s": latency, "prompt_tokens": r.usage.prompt_tokens,
                    "completion_tokens": r.usage.completion_tokens,
                    "cached_tokens": getattr(details, "cached_tokens", None) if details else None,
                    "answer": r.choices[0].message.content})
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
    return out


def run(server, args):
    import openai

    port = free_port()
    proc, log = start(server, args.model, port, args.max_batch)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=3600)
        model_id = args.model
        conversation(client, model_id, 999, 1, args.size, 2, args.seed)  # warm-up (compiles, caches)
        tic = time.perf_counter()
        with ThreadPoolExecutor(args.conversations) as pool:
            turns = sum(pool.map(lambda c: conversation(client, model_id, c, args.turns, args.size, args.max_tokens,
                                                        args.seed), range(args.conversations)), [])
        wall = time.perf_counter() - tic
        metrics = None
        if server.startswith("ours"):
            import urllib.request

            metrics = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read())
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    by_turn = [[r["latency_s"] for r in turns if r["turn"] == t] for t in range(args.turns)]
    return {
        "server": server, "wall_s": wall, "requests": len(turns),
        "completion_tokens": sum(r["completion_tokens"] for r in turns),
        "prompt_tokens": sum(r["prompt_tokens"] for r in turns),
        "cached_tokens": sum(r["cached_tokens"] or 0 for r in turns),
        "completion_tok_per_s": sum(r["completion_tokens"] for r in turns) / wall,
        "requests_per_s": len(turns) / wall,
        "median_latency_by_turn_s": [statistics.median(x) for x in by_turn],
        "server_metrics": metrics, "turns": turns,
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=str(ROOT / "tests/fixtures/mlxvlm-float"))
    p.add_argument("--servers", default="ours,mlx-vlm")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--size", default="320x200", help="screenshot WxH")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/server-agents.json"))
    args = p.parse_args()
    args.size = tuple(int(v) for v in args.size.split("x"))
    results = []
    for server in args.servers.split(","):
        try:
            results.append(run(server, args))
        except Exception as e:  # noqa: BLE001 — record why a server could not be measured
            results.append({"server": server, "error": f"{type(e).__name__}: {e}"[:2000]})
        r = results[-1]
        if "error" in r:
            print(f"{server}: {r['error'][:300]}")
        else:
            lat = " ".join(f"{x:.2f}" for x in r["median_latency_by_turn_s"])
            print(f"{server:8s} wall {r['wall_s']:.1f}s  {r['requests_per_s']:.2f} req/s  "
                  f"{r['completion_tok_per_s']:.1f} tok/s  prompt {r['prompt_tokens']} (cached {r['cached_tokens']})  "
                  f"median latency per turn [{lat}] s")
    answers = {r["server"]: [t["answer"] for t in r["turns"]] for r in results if "turns" in r}
    if "ours" in answers and "ours-2ranks" in answers:
        same = answers["ours"] == answers["ours-2ranks"]
        print(f"ours-2ranks answers {'equal' if same else 'DIFFER FROM'} ours")
    meta = {"argv": sys.argv[1:], "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS"), "machine": platform.platform(), "cpus": os.cpu_count(),
            "load_avg": os.getloadavg(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))


if __name__ == "__main__":
    main()
