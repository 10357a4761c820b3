"""The benchmark's report: its JSON schema (versioned; docs/bench.md describes every field), a
validator for it, and the table printed at the end of a run."""

SCHEMA = 1
KIND = "mlx_qwen3vl.bench"
OURS = "mlx_qwen3vl"

NUM, INT, STR, LIST, BOOL, DICT = (int, float), int, str, list, bool, dict
OPT = type(None)
TOP = {"schema": INT, "kind": STR, "created": STR, "package": DICT, "command": LIST, "machine": DICT, "model": DICT,
       "settings": DICT, "engines": DICT, "notes": LIST, "wall_s": NUM}
MACHINE = {"chip": STR, "os": STR, "cores": INT, "memory_gb": (float, int, OPT), "python": STR, "mlx": STR,
           "backend": STR, "device": STR, "device_name": (STR, OPT), "blas": STR}
MODEL = {"source": STR, "path": STR, "model_type": STR, "parameters": INT, "weights_gb": NUM, "dtype": STR,
         "quantization": STR, "load_s": NUM}
SETTINGS = {"quick": BOOL, "prompt_tokens": INT, "decode_tokens": INT, "repeats": INT, "screenshots": LIST,
            "agent_turns": INT, "agent_tokens": INT, "max_pixels": (INT, OPT), "compare": LIST}
SINGLE = {"prompt_tokens": INT, "ttft_s": NUM, "prompt_tps": NUM, "decode_tokens": INT, "decode_s": NUM,
          "decode_tps": (float, int, OPT), "total_s": NUM, "peak_memory_gb": NUM, "peak_rss_gb": NUM, "repeats": INT,
          "runs_total_s": LIST, "image_size": (LIST, OPT)}
AGENT = {"turns": INT, "tokens_per_turn": INT, "image_size": LIST, "total_s": NUM, "turn_s": LIST, "ttft_s": LIST,
         "prompt_tokens": LIST, "cached_tokens": LIST, "generated_tokens": LIST, "peak_memory_gb": LIST,
         "peak_rss_gb": NUM}
SPECULATIVE = {"prompt_tokens": INT, "decode_tokens": INT, "num_draft_tokens": INT, "prompt_lookup": INT,
               "repeats": INT, "drafters": DICT}
DRAFTER = {"decode_tps": (float, int, OPT), "proposed": INT, "accepted": INT, "acceptance": (float, int, OPT),
           "speedup": (float, int, OPT), "same_tokens": BOOL}


def _check(obj, spec, where, problems):
    if not isinstance(obj, dict):
        problems.append(f"{where} is not an object")
        return
    for key, types in spec.items():
        if key not in obj:
            problems.append(f"{where}.{key} is missing")
        elif isinstance(obj[key], bool) and types is not BOOL and bool not in (types if isinstance(types, tuple) else (types,)):
            problems.append(f"{where}.{key} is a boolean")
        elif not isinstance(obj[key], types):
            problems.append(f"{where}.{key} is {type(obj[key]).__name__}")


def validate(report) -> list:
    """The ways `report` departs from schema 1 ([] when it conforms)."""
    problems = []
    _check(report, TOP, "report", problems)
    if problems:
        return problems
    if report["schema"] != SCHEMA or report["kind"] != KIND:
        problems.append(f"report is {report['kind']} schema {report['schema']}, not {KIND} schema {SCHEMA}")
    _check(report["machine"], MACHINE, "machine", problems)
    _check(report["model"], MODEL, "model", problems)
    _check(report["settings"], SETTINGS, "settings", problems)
    if OURS not in report["engines"]:
        problems.append(f"engines.{OURS} is missing")
    for engine, res in report["engines"].items():
        if not isinstance(res, dict) or not isinstance(res.get("results"), dict) or not isinstance(res.get("info"), dict):
            problems.append(f"engines.{engine} needs info and results objects")
            continue
        for name, r in res["results"].items():
            where = f"engines.{engine}.results.{name}"
            if name == "speculative":  # only with --speculative (an addition to schema 1: older reports lack it)
                _check(r, SPECULATIVE, where, problems)
                for drafter, row in (r.get("drafters") or {}).items():
                    _check(row, DRAFTER, f"{where}.drafters.{drafter}", problems)
                if isinstance(r.get("drafters"), dict) and "plain" not in r["drafters"]:
                    problems.append(f"{where}.drafters.plain is missing")
                continue
            _check(r, AGENT if name == "agent" else SINGLE, where, problems)
            if name == "agent" and isinstance(r, dict):
                for key in ("turn_s", "ttft_s", "prompt_tokens", "cached_tokens", "generated_tokens", "peak_memory_gb"):
                    if isinstance(r.get(key), list) and len(r[key]) != r.get("turns"):
                        problems.append(f"engines.{engine}.results.agent.{key} has {len(r[key])} entries, not {r.get('turns')}")
    return problems


def _f(value, fmt):
    return "-" if value is None else format(value, fmt)


def workload_label(name):
    return name.replace("screenshot_", "screenshot ") if name != "text" else "text"


def format_report(report) -> str:
    from ..plan import count_label, size_label

    m, mod = report["machine"], report["model"]
    device = f"the {m.get('device', 'cpu').upper()}" + (f" ({m['device_name']})" if m.get("gpu") else "")
    lines = [f"mlx_qwen3vl bench  ·  {m['chip']}, {m['cores']} cores, {_f(m['memory_gb'], '.0f')} GB  ·  {m['os']}  ·  "
             f"MLX {m['mlx']} on {device}  ·  Python {m['python']}",
             f"model: {mod['source']}  ·  {count_label(mod['parameters'])} parameters, "
             f"{size_label(mod['weights_gb'] * 1e9)} of weights  ·  {mod['dtype']}  ·  quantization: {mod['quantization']}", ""]
    head = (f"{'engine':<18}{'workload':<22}{'prompt':>7}{'prep s':>8}{'first token s':>15}{'prompt tok/s':>14}"
            f"{'decode tok/s':>14}{'peak GB':>9}")
    lines += [head, "-" * len(head)]
    for engine, res in report["engines"].items():
        label = engine + (f" {res['info']['version']}" if res["info"].get("version") and engine != OURS else "")
        for name, r in res["results"].items():
            if name in ("agent", "speculative"):
                continue
            lines.append(f"{label:<18}{workload_label(name):<22}{r['prompt_tokens']:>7}{_f(r.get('preprocess_s'), '.2f'):>8}"
                         f"{r['ttft_s']:>15.2f}{r['prompt_tps']:>14.1f}{_f(r['decode_tps'], '.2f'):>14}"
                         f"{r['peak_memory_gb']:>9.2f}")
    ours_agent = report["engines"].get(OURS, {}).get("results", {}).get("agent")
    for engine, res in report["engines"].items():
        a = res["results"].get("agent")
        if not a:
            continue
        how = "the KV cache reused (ChatSession)" if engine == OURS else "a fresh generate over the conversation each turn"
        w, h = a["image_size"]
        line = (f"agent loop, {engine}: {a['turns']} turns, each a new {w}x{h} screenshot and {a['tokens_per_turn']} answer "
                f"tokens, {how}: {a['total_s']:.2f} s ({' + '.join(f'{s:.2f}' for s in a['turn_s'])}); prompt tokens "
                f"{'/'.join(map(str, a['prompt_tokens']))}, reused {'/'.join(map(str, a['cached_tokens']))}; "
                f"peak {max(a['peak_memory_gb']):.2f} GB")
        if engine != OURS and ours_agent:
            line += f"  ->  ours {a['total_s'] / ours_agent['total_s']:.2f}x faster"
        lines.append(line)
    spec = report["engines"].get(OURS, {}).get("results", {}).get("speculative")
    if spec:
        rows = [f"{name.replace('_', ' ')} {_f(r['decode_tps'], '.2f')} tok/s"
                + ("" if name == "plain" else f" ({_f(r['speedup'], '.2f')}x, {r['accepted']}/{r['proposed']} drafts kept"
                   + ("" if r["same_tokens"] else ", TOKENS DIFFER FROM PLAIN") + ")")
                for name, r in spec["drafters"].items()]
        lines.append(f"speculative decoding, an agent conversation with its tool calls resent ({spec['prompt_tokens']} "
                     f"prompt tokens, k = {spec['num_draft_tokens']}): " + "; ".join(rows))
    s = report["settings"]
    lines.append(f"\ngreedy, EOS ignored: {s['decode_tokens']} tokens per run, median of {s['repeats']} run(s); first token "
                 "from ready inputs (prep s: our preprocessing, apart); peak GB: MLX's peak allocation, weights included")
    for note in report["notes"]:
        lines.append(f"note: {note}")
    return "\n".join(lines)
