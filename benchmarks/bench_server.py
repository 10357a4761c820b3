"""Agent traffic against an OpenAI-compatible server: N concurrent conversations of T turns, each
turn resending the whole history plus a new screenshot, greedy, streamed. Reports total
throughput, per-turn latency, time to first token and the gaps between tokens of running streams
(p50 / p99 / max: how long a stream stalls while another request's screenshot is prefilled), and
cached prompt tokens where the server reports them, for our server and mlx-vlm's on the same
checkpoint. "ours-2ranks" is our server under `mlx.launch -n 2 --backend ring` over 127.0.0.1
(rank 0 serving HTTP, the model split over both ranks). `--server-root DIR` serves from another
checkout of this repo (e.g. main, for a before / after).

    python benchmarks/bench_server.py --model tests/fixtures/mlxvlm-float --servers ours,mlx-vlm
    python benchmarks/bench_server.py --servers ours,ours-2ranks
    python benchmarks/bench_server.py --model tests/fixtures/tiny-a --servers ours --size 1280x720 --turns 3 \
        --server-root /work/main --out before.json
    python benchmarks/bench_server.py --prefix-lookup   # prefix-cache lookup time at 100/1000/5000 entries
    python benchmarks/bench_server.py --model <2B-shaped checkpoint> --servers ours --text \
        --conversations 16 --max-batch 16 --turns 3 --max-tokens 8   # 16 agents' text-only turns

`--refused` instead sends our server (default flags) the over-budget and forbidden requests of
issue #26 one by one and records its RSS and peak RSS (Linux /proc) after each; `--server-root`
runs another checkout's server the same way (before / after a change).
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


def start(server, model, port, max_batch, root=ROOT, extra=()):
    if server.startswith("ours"):
        cmd = [sys.executable, "-m", "mlx_qwen3vl.server", "--model", model, "--port", str(port),
               "--max-batch", str(max_batch), *extra]
        if server == "ours-2ranks":
            sys.path.insert(0, str(ROOT))
            from mlx_qwen3vl.distributed import local_launch_command

            cmd = local_launch_command(2, cmd)
    else:
        cmd = [sys.executable, "-m", "mlx_vlm.server", "--model", model, "--port", str(port)]
    env = {**os.environ, "PYTHONPATH": str(root)}
    # Its own session: stopping it stops mlx.launch's ranks too.
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
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


def stop(proc):
    """End a server `start` began (its whole session: mlx.launch's ranks too)."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


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


def text_turn(rng, c, t):
    """A text-only agent turn: the task first, then a tool's result or a short follow-up, of
    different lengths per agent and turn."""
    if t == 0:
        return f"Task {c}: find the cheapest flight from Zurich to Lisbon next week and book it." + \
            " Keep the receipt." * int(rng.integers(0, 6))
    if t % 2:
        rows = "".join(f'{{"id": {int(rng.integers(1000))}, "price": {int(rng.integers(80, 900))}}}, '
                       for _ in range(int(rng.integers(1, 8))))
        return f"Tool result (search_flights, call {t}): [{rows}]"
    return "Thanks. " + "Is that really the cheapest one? " * int(rng.integers(1, 4))


def conversation(client, model_id, c, turns, size, max_tokens, seed, text=False):
    rng = np.random.default_rng(seed + c)
    messages = [{"role": "system", "content": "You are a GUI agent. Answer with the next action."}]
    out = []
    for t in range(turns):
        if text:
            messages.append({"role": "user", "content": text_turn(rng, c, t)})
        else:
            messages.append({"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": screenshot(rng, size)}},
                {"type": "text", "text": f"Task {c}, step {t}: open the settings and lower the brightness."}]})
        tic = time.perf_counter()
        # Streamed, with logprobs, so every token arrives as a chunk of its own (its time is known).
        stamps, text, usage = [], "", None
        for chunk in client.chat.completions.create(model=model_id, messages=messages, max_tokens=max_tokens,
                                                    temperature=0, stream=True, logprobs=True,
                                                    stream_options={"include_usage": True}):
            if chunk.usage:
                usage = chunk.usage
            for choice in chunk.choices:
                n = len(choice.logprobs.content) if choice.logprobs and choice.logprobs.content else 0
                stamps += [time.perf_counter()] * n
                text += choice.delta.content or ""
        latency = time.perf_counter() - tic
        details = getattr(usage, "prompt_tokens_details", None)
        out.append({"conversation": c, "turn": t, "latency_s": latency, "prompt_tokens": usage.prompt_tokens,
                    "completion_tokens": usage.completion_tokens,
                    "cached_tokens": getattr(details, "cached_tokens", None) if details else None,
                    "ttft_s": stamps[0] - tic if stamps else None,
                    "gaps_s": [b - a for a, b in zip(stamps, stamps[1:])], "answer": text})
        messages.append({"role": "assistant", "content": text})
    return out


def percentile(values, q):
    return float(np.percentile(values, q)) if values else None


def run(server, args):
    import openai

    port = free_port()
    proc, log = start(server, args.model, port, args.max_batch, root=Path(args.server_root),
                      extra=args.server_args.split() if args.server_args else ())
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=3600)
        model_id = args.model
        conversation(client, model_id, 999, 1, args.size, 2, args.seed, args.text)  # warm-up (compiles, caches)
        tic = time.perf_counter()
        with ThreadPoolExecutor(args.conversations) as pool:
            turns = sum(pool.map(lambda c: conversation(client, model_id, c, args.turns, args.size, args.max_tokens,
                                                        args.seed, args.text), range(args.conversations)), [])
        wall = time.perf_counter() - tic
        metrics = None
        if server.startswith("ours"):
            import urllib.request

            metrics = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read())
    finally:
        stop(proc)
    by_turn = [[r["latency_s"] for r in turns if r["turn"] == t] for t in range(args.turns)]
    gaps = sum((r["gaps_s"] for r in turns), [])
    ttft = [r["ttft_s"] for r in turns if r["ttft_s"] is not None]
    return {
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "gap_p50_s": percentile(gaps, 50), "gap_p99_s": percentile(gaps, 99), "gap_max_s": max(gaps, default=None),
        "server": server, "wall_s": wall, "requests": len(turns),
        "completion_tokens": sum(r["completion_tokens"] for r in turns),
        "prompt_tokens": sum(r["prompt_tokens"] for r in turns),
        "cached_tokens": sum(r["cached_tokens"] or 0 for r in turns),
        "completion_tok_per_s": sum(r["completion_tokens"] for r in turns) / wall,
        "requests_per_s": len(turns) / wall,
        "median_latency_by_turn_s": [statistics.median(x) for x in by_turn],
        "server_metrics": metrics, "turns": turns,
    }


# ------------------------------------------------------------------------------ refused requests


def _blank_png(width, height):
    """A valid greyscale PNG of black pixels (10000 x 9999: ~100 kB), made without the pixels."""
    import zlib

    def chunk(kind, data):
        return len(data).to_bytes(4, "big") + kind + data + (zlib.crc32(kind + data) & 0xFFFFFFFF).to_bytes(4, "big")

    c, rows = zlib.compressobj(9), b"\0" + bytes(width)
    idat = b"".join(c.compress(rows * min(500, height - y)) for y in range(0, height, 500)) + c.flush()
    ihdr = width.to_bytes(4, "big") + height.to_bytes(4, "big") + bytes([8, 0, 0, 0, 0])
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def _video(path, frames, size, fmt=None, codec="mpeg4"):
    import av

    with av.open(str(path), "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=24)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        rng = np.random.default_rng(0)
        base = rng.integers(0, 255, (size, size, 3), np.uint8)
        for i in range(frames):
            frame = np.roll(base, i, axis=1)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return Path(path).read_bytes()


def _memory(pid):
    fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status"))
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")}


def _send(port, body):
    """POST a body (a dict, or raw bytes) → (status, error code, seconds)."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    tic = time.perf_counter()
    try:
        conn.request("POST", "/v1/chat/completions", body=data, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        raw, status = r.read(), r.status
    except OSError as e:
        raw, status = b"", type(e).__name__
    finally:
        conn.close()
    try:
        code = json.loads(raw)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        code = None
    return status, code, time.perf_counter() - tic


def refused_requests(args):
    """Issue #26's over-budget and forbidden requests, each sent to a fresh server with default
    flags (so each peak is that request's own): status, error code, the server's peak RSS before
    and after, and its RSS after."""
    import tempfile

    def data_url(data, kind="image/png"):
        return f"data:{kind};base64," + base64.b64encode(data).decode()

    def chat(*parts, **extra):
        return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "What is it?"}]}],
                "max_tokens": 2, "temperature": 0, **extra}

    def image(url):
        return {"type": "image_url", "image_url": {"url": url}}

    def video(url):
        return {"type": "video_url", "video_url": {"url": url}}

    buf = io.BytesIO()
    Image.new("RGB", (1, 1)).save(buf, format="PNG")
    tiny = data_url(buf.getvalue())
    big = data_url(_blank_png(10000, 9999))
    tmp = Path(tempfile.mkdtemp())
    m4v = data_url(_video(tmp / "long.m4v", 1200, 256, fmt="m4v"), "video/mp4")  # a raw MPEG-4 stream: no count
    mkv = data_url(_video(tmp / "long.mkv", 4000, 16, codec="ffv1"), "video/x-matroska")  # no count either
    cases = [
        ("1x1 PNG, min_pixels = max_pixels = 40M", chat(image(tiny), min_pixels=40_000_000, max_pixels=40_000_000)),
        ("five 10000x9999 PNGs (97 kB each)", chat(*[image(big)] * 5)),
        ("1200-frame raw .m4v, 256x256 (no count)", chat(video(m4v))),
        ("4000-frame .mkv, 16x16 (no count)", chat(video(mkv))),
        ("chat_template_kwargs tokenize + images", chat(image(tiny), chat_template_kwargs={
            "tokenize": True, "images": [tiny]})),
        ("client chat_template 'x' * 500M", chat(chat_template_kwargs={
            "chat_template": "{% set x = 'x' * 500000000 %}{{ x|length }}"})),
        ("ffconcat playlist as a video", chat(video(data_url(b"ffconcat version 1.0\nfile sub/secret.mp4\n",
                                                             "video/mp4")))),
        ("body nested 100000 deep", b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
        ("65 MiB body (over --max-body-bytes)", b'{"messages": "' + b"x" * (65 << 20) + b'"}'),
        ("63 MiB body, refused image", json.dumps(chat(image(data_url(b"x" * (47 << 20))))).encode()),
    ]
    root = args.server_root or str(ROOT)
    rows = []
    for name, body in cases:
        port = free_port()
        cmd = [sys.executable, "-m", "mlx_qwen3vl.server", "--model", args.model, "--port", str(port)]
        proc = subprocess.Popen(cmd, cwd=root, env={**os.environ, "PYTHONPATH": root}, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        ready = threading.Event()

        def drain():
            for line in proc.stderr:
                if "Uvicorn running on" in line:
                    ready.set()
            ready.set()

        threading.Thread(target=drain, daemon=True).start()
        ready.wait(600)
        try:
            _send(port, chat(image(tiny)))  # one accepted request first: the baseline includes serving
            base = _memory(proc.pid)
            status, code, seconds = _send(port, body)
            mem = _memory(proc.pid)
        finally:
            stop(proc)
        rows.append({"case": name, "status": status, "code": code, "seconds": seconds, "baseline": base, **mem,
                     "peak_rise_mb": (mem["VmHWM"] - base["VmHWM"]) / 2**20})
        print(f"{name:42s} {status} {code or '':26s} {seconds:6.2f} s  peak {base['VmHWM'] / 2**20:5.0f} -> "
              f"{mem['VmHWM'] / 2**20:5.0f} MB (+{rows[-1]['peak_rise_mb']:.0f}), RSS after "
              f"{mem['VmRSS'] / 2**20:5.0f} MB", flush=True)
    meta = {"argv": sys.argv[1:], "machine": platform.platform(), "cpus": os.cpu_count(),
            "load_avg": os.getloadavg(), "time": time.strftime("%Y-%m-%d %H:%M:%S"), "server_root": root}
    Path(args.out).write_text(json.dumps({"meta": meta, "refused": rows}, indent=1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=str(ROOT / "tests/fixtures/mlxvlm-float"))
    p.add_argument("--servers", default="ours,mlx-vlm")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--size", default="320x200", help="screenshot WxH")
    p.add_argument("--text", action="store_true",
                   help="text-only turns (a task, then tool results and short follow-ups), no screenshots")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-root", default=str(ROOT), help="the checkout whose server runs (default: this one)")
    p.add_argument("--server-args", default="", help="extra flags for our server, e.g. '--prefill-budget 0'")
    p.add_argument("--prefix-lookup", action="store_true",
                   help="instead: prefix-cache lookup time at 100/1000/5000 entries, index against a linear scan")
    p.add_argument("--refused", action="store_true", help="instead: the refused-request RSS run (issue #26)")
    p.add_argument("--contention", action="store_true",
                   help="instead: a 1-token text request's latency, idle and while six 4096x4096 images are "
                        "preprocessed (count_tokens requests)")
    p.add_argument("--repeats", type=int, default=3, help="--contention: rounds")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.prefix_lookup:
        args.out = args.out or str(ROOT / "benchmarks/results/prefix-lookup.json")
        return prefix_lookup(args)
    if args.refused:
        args.out = args.out or str(ROOT / "benchmarks/results/server-refused.json")
        return refused_requests(args)
    if args.contention:
        args.out = args.out or str(ROOT / "benchmarks/results/server-contention.json")
        return contention(args)
    args.out = args.out or str(ROOT / "benchmarks/results/server-agents.json")
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
                  f"median latency per turn [{lat}] s  TTFT p50 {r['ttft_p50_s']:.3f} p99 {r['ttft_p99_s']:.3f} s  "
                  f"gap p50 {r['gap_p50_s']:.4f} p99 {r['gap_p99_s']:.4f} max {r['gap_max_s']:.3f} s")
    answers = {r["server"]: [t["answer"] for t in r["turns"]] for r in results if "turns" in r}
    if "ours" in answers and "ours-2ranks" in answers:
        same = answers["ours"] == answers["ours-2ranks"]
        print(f"ours-2ranks answers {'equal' if same else 'DIFFER FROM'} ours")
    meta = {"argv": sys.argv[1:], "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS"), "machine": platform.platform(), "cpus": os.cpu_count(),
            "load_avg": os.getloadavg(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))


# ------------------------------------------------------------------------------ preprocessing contention


def _big_png(size=4096):
    """A 4096x4096 PNG of a few dozen KB: cheap to send, seconds of CPU to decode and resize."""
    from PIL import ImageDraw

    image = Image.new("RGB", (size, size), (200, 30, 30))
    draw = ImageDraw.Draw(image)
    for i in range(0, size, 64):
        draw.line([(i, 0), (size - 1 - i, size - 1)], fill=(10, 200, 40), width=3)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def contention(args, images=6):
    """A 1-token text chat request's latency on an idle server, then while `images` count_tokens
    requests of a 4096x4096 PNG each are being built (sent at once; the text request goes once the
    server has admitted them all, /metrics' requests_built). Best and median of --repeats rounds."""
    import http.client
    import urllib.request

    port = free_port()
    proc, log = start("ours", args.model, port, args.max_batch, root=Path(args.server_root),
                      extra=["--max-queue", "64", *(args.server_args.split() if args.server_args else ())])

    def post(path, body):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        tic = time.perf_counter()
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        r.read()
        conn.close()
        return r.status, time.perf_counter() - tic

    def built():
        return json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read())["requests_built"]

    text = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 1, "temperature": 0}
    png = base64.b64encode(_big_png()).decode()
    count = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}},
        {"type": "text", "text": "What is this?"}]}]}
    idle, loaded, statuses = [], [], []
    try:
        post("/v1/chat/completions", text)  # warm-up
        for _ in range(args.repeats):
            idle.append(post("/v1/chat/completions", text)[1])
            before = built()
            with ThreadPoolExecutor(images) as pool:
                counts = [pool.submit(post, "/v1/messages/count_tokens", count) for _ in range(images)]
                while built() < before + images:  # every image request admitted (its build started or queued)
                    time.sleep(0.005)
                status, seconds = post("/v1/chat/completions", text)
                loaded.append(seconds)
                statuses.append([status] + [f.result()[0] for f in counts])
    finally:
        stop(proc)
    result = {"server_root": args.server_root, "idle_s": idle, "with_images_s": loaded, "statuses": statuses,
              "idle_best_s": min(idle), "with_images_best_s": min(loaded),
              "with_images_median_s": statistics.median(loaded), "load_avg": os.getloadavg()}
    print(f"{args.server_root}: 1-token text request idle best {min(idle):.3f} s; with {images} 4096x4096 images "
          f"being built best {min(loaded):.3f} s, median {statistics.median(loaded):.3f} s (statuses {statuses}); "
          f"load {os.getloadavg()}")
    Path(args.out).write_text(json.dumps(result, indent=1))


def prefix_lookup(args):
    """The prefix cache's lookup against 100 / 1000 / 5000 entries: agent-like prompts (a shared
    system prompt, a screenshot, a distinct task), timed for a request matching one entry's
    prompt and for one matching none, through the index and through a scan of every entry
    (reusable_prefix per entry: the lookup before the index). Entries hold tiny caches: only the
    lookup is measured. In process, no server."""
    sys.path.insert(0, str(ROOT))
    import mlx_qwen3vl  # noqa: F401  (before mlx.core: it loads the optimized BLAS)
    import mlx.core as mx

    from mlx_qwen3vl.engine.caches import PrefixCache
    from mlx_qwen3vl.kv_cache import KVCache
    from mlx_qwen3vl.positions import IMAGE
    from mlx_qwen3vl.spans import reusable_prefix

    rng = np.random.default_rng(args.seed)
    system = rng.integers(10, 400, 300).tolist()
    image_tokens = 256

    def prompt(k):
        """(tokens, media, inputs) of prompt k: the system prompt, a 256-token screenshot, 40 task tokens."""
        ids = system + [409] + [412] * image_tokens + [410] + rng.integers(10, 400, 40).tolist()
        types = np.zeros((1, len(ids)), np.int64)
        types[0, len(system) + 1:len(system) + 1 + image_tokens] = IMAGE
        h = f"{k:064x}"
        media = [(IMAGE, len(system) + 1, len(system) + 1 + image_tokens, h)]
        # spans.media_hashes reads the hashes from the inputs when they are there (no pixels needed)
        inputs = {"input_ids": np.array([ids]), "mm_token_type_ids": types, "image_grid_thw": np.array([[1, 32, 32]]),
                  "media_hashes": [h]}
        return ids, media, inputs

    results = []
    for n in (100, 1000, 5000):
        cache = PrefixCache(1 << 40)
        held = []
        for k in range(n):
            ids, media, inputs = prompt(k)
            kv = KVCache()
            kv.update_and_fetch(*[mx.zeros((1, 1, len(ids), 1))] * 2)
            cache.insert(ids + [7], media, [kv])
            held.append((ids + [7], media))
        hit = prompt(n // 2)
        hit = (held[n // 2][0][:-1], held[n // 2][1], {**hit[2], "input_ids": np.array([held[n // 2][0][:-1] + [5]])})
        miss = prompt(n + 1)
        row = {"entries": n}
        for name, (_, _, inputs) in (("hit", hit), ("miss", miss)):
            reps = 50
            tic = time.perf_counter()
            for _ in range(reps):
                got = cache.lookup(inputs)[1]
            row[f"index_{name}_ms"] = (time.perf_counter() - tic) / reps * 1e3
            reps = max(1, 2000 // n)
            tic = time.perf_counter()
            for _ in range(reps):
                want = max(reusable_prefix(t, m, inputs) for t, m in held)
            row[f"scan_{name}_ms"] = (time.perf_counter() - tic) / reps * 1e3
            assert got == want, (n, name, got, want)
            row[f"{name}_reused_tokens"] = got
        results.append(row)
        print(f"{n:5d} entries: index hit {row['index_hit_ms']:.3f} ms, miss {row['index_miss_ms']:.3f} ms; "
              f"linear scan hit {row['scan_hit_ms']:.1f} ms, miss {row['scan_miss_ms']:.1f} ms "
              f"(reused {row['hit_reused_tokens']} / {row['miss_reused_tokens']} tokens)")
    meta = {"argv": sys.argv[1:], "machine": platform.platform(), "cpus": os.cpu_count(),
            "load_avg": os.getloadavg(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    out = Path(args.out)
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))


if __name__ == "__main__":
    main()
