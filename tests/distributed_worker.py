"""One rank of tests/test_distributed.py, started by `mlx.launch -n 2 --backend ring`.

Loads each fixture checkpoint it is given (one after another, in one launch: starting two ranks
costs more than a tiny model's checks) with `mlx_qwen3vl.load` (sharded because the group has 2
ranks), runs the text, image, two-image and video cases, a padded batch, a two-turn ChatSession
and seeded sampling, and writes what it got to OUT/<checkpoint folder>/rank<r>.json. Only rank 0
is given the media: the others get paths that do not exist, so the test fails if they read
anything themselves.
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).parent / "fixtures"
sys.path.insert(0, str(FIXTURES.parents[1]))  # this checkout's mlx_qwen3vl, as pytest imports it
CASES = ["text", "image", "two_images", "video"]


def case_messages(case, rank, row=0):
    data = json.loads((FIXTURES / "cases" / f"{case}.json").read_text())
    messages, fps = data["messages"][row], None
    for message in messages:
        for block in message["content"] if isinstance(message["content"], list) else []:
            if block["type"] in ("image", "video"):
                name = block[block["type"]]
                if rank != 0:
                    block[block["type"]] = f"/nonexistent/rank{rank}/{name}"
                elif block["type"] == "image":
                    block["image"] = str(FIXTURES / "media" / name)
                else:
                    block["video"] = list(np.load(FIXTURES / "media" / name))
                if block["type"] == "video":
                    fps = block.pop("fps")
    return messages, fps


def quantized_kv(M, model, processor, images, rank):
    """A quantized KV cache on every rank's share of the model: a two-turn 8-bit chat (quantized
    inside turn 1, reused quantized in turn 2) and a 4-bit answer whose 16-token prefill chunks
    cross quantized_kv_start."""
    import numpy as np

    def margin(piece):  # the chosen token's lead over the runner-up, in log-probability
        top = np.sort(np.array(piece.logprobs, dtype=np.float32).ravel())[-2:]
        return float(top[1] - top[0])

    session = M.ChatSession(model, processor, max_tokens=8, kv_bits=8, quantized_kv_start=40)
    turns = [list(session.stream(text, images=[image]))
             for text, image in zip(("Where is the search box?", "Now click it."), images)]
    four = list(M.stream_generate(model, processor, messages=case_messages("image", rank)[0], max_tokens=8,
                                  kv_bits=4, quantized_kv_start=20, prefill_step_size=16))
    return {"chat": [[p.token for p in t] for t in turns], "chat_cached": session.last.cached_tokens,
            "four": [p.token for p in four],
            "margins": {"chat": [[margin(p) for p in t] for t in turns], "four": [margin(p) for p in four]}}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, action="append",
                   help="a checkpoint folder; several run one after another in this launch (one start for all)")
    p.add_argument("--out", required=True, help="OUT/<folder name>/rank<r>.json per --model")
    p.add_argument("--heads-too", action="store_true", help="also run the cases with the vision tower split by heads")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--speculative", action="store_true", help="also run the speculative-decoding cases (on the first --model)")
    p.add_argument("--parallel", default="tensor", help="load(..., parallel=): tensor or pipeline")
    p.add_argument("--logits", action="store_true",
                   help="also write the image case's logits to rank<r>.npy beside the json")
    args = p.parse_args()

    import mlx_qwen3vl as M  # before mlx.core: it loads the optimized BLAS MLX's matmuls then use
    from mlx_qwen3vl import distributed

    import mlx.core as mx

    group = mx.distributed.init()
    for path in args.model:
        out_dir = Path(args.out, Path(path).name)
        out_dir.mkdir(parents=True, exist_ok=True)
        out = run(M, distributed, path, out_dir, group, args)
        (out_dir / f"rank{group.rank()}.json").write_text(json.dumps(out))
    return 0


def run(M, distributed, path, out_dir, group, args):
    """Every check on one checkpoint → this rank's results."""
    from mlx.utils import tree_flatten

    rank = group.rank()
    model, processor = M.load(path, parallel=args.parallel)
    out = {"rank": rank, "size": group.size(), "sharded": distributed.is_sharded(model),
           "backend": model.backend.name, "describe": model.backend.describe(),
           "parameters": {k: v.size for k, v in tree_flatten(model.parameters())}}
    from threadpoolctl import threadpool_info

    from mlx_qwen3vl.cpu import threads

    out["blas_threads"] = {"cores": threads.cores(), "chosen": threads.blas_pool().current,
                           "libraries": sorted({i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"}),
                           "mkl_elsewhere": threads.mkl_threads_elsewhere()}

    def run_cases(model, processor):
        cases = {}
        for case in CASES:
            messages, fps = case_messages(case, rank)
            cases[case] = M.generate(model, processor, messages=messages, source_fps=fps,
                                     max_tokens=args.max_tokens).token_ids
        return cases

    out["cases"] = run_cases(model, processor)
    # Prefill in 16-token chunks: the caches are evaluated between chunks, which must run every
    # collective of the chunk on every rank (a pipeline stage's send among them).
    out["chunked"] = M.generate(model, processor, messages=case_messages("image", rank)[0], max_tokens=8,
                                prefill_step_size=16).token_ids
    if args.logits:  # every position's logits of the image case, for a bitwise comparison
        from mlx_qwen3vl.generate import encode_prompt

        inputs = encode_prompt(processor, messages=case_messages("image", rank)[0])
        np.save(out_dir / f"rank{rank}.npy", np.array(model(**inputs)))
    if args.heads_too:
        out["cases_heads"] = run_cases(*distributed.load_sharded(path, group, vision="heads"))

    batch = [dict(messages=case_messages("batch", rank, row)[0]) for row in range(2)]
    out["batch"] = [r.token_ids for r in M.batch_generate(model, processor, batch, max_tokens=args.max_tokens)]

    media = FIXTURES / "media"
    img1, img2 = ([str(media / "img_300x200.png"), str(media / "img_90x260.png")] if rank == 0
                  else ["/nonexistent/a.png", "/nonexistent/b.png"])
    session = M.ChatSession(model, processor, system="You are a GUI agent.", max_tokens=8)
    turns = []
    for text, image in (("Where is the search box?", img1), ("Now click it.", img2)):
        tokens = [piece.token for piece in session.stream(text, images=[image])]
        turns.append({"tokens": tokens, "prompt_tokens": session.last.prompt_tokens,
                      "cached_tokens": session.last.cached_tokens})
    out["chat"] = turns
    out["chat_text"] = [m["content"] for m in session.messages if m["role"] == "assistant"]
    out["kv"] = quantized_kv(M, model, processor, [img1, img2], rank)

    # Speculative decoding on every rank's share: the model drafting for itself (every draft kept),
    # the other fixture (loaded sharded too; its drafts mostly rejected) and prompt lookup.
    if args.speculative and path == args.model[0]:  # tensor ranks (test_distributed); one checkpoint: each step
        # drafts under collectives, slow on a shared CPU (and under pipeline stages, past a launch's bound)
        other = M.load(FIXTURES / ("tiny-b" if Path(path).name == "tiny-a" else "tiny-a"), parallel=args.parallel)
        spec = {}
        for case in ("image", "video"):
            messages, fps = case_messages(case, rank)
            for name, kw in (("self", dict(draft_model=model)), ("other", dict(draft_model=other)),
                             ("lookup", dict(prompt_lookup=2)))[:3 if case == "image" else 1]:  # video: the draft
                # model's own prefill of the frames is what a video adds
                r = M.generate(model, processor, messages=messages, source_fps=fps, max_tokens=args.max_tokens,
                               num_draft_tokens=3, **kw)
                spec[f"{case}/{name}"] = [r.token_ids, r.draft_proposed, r.draft_accepted]
        out["speculative"] = spec

    # Sampling: unseeded runs must agree across ranks; a seed reproduces one process's run.
    out["sampled"] = M.generate(model, processor, "Tell me a story.", max_tokens=12, temperature=1.0).token_ids
    out["seeded"] = M.generate(model, processor, "Tell me a story.", max_tokens=12, temperature=1.0,
                               seed=7).token_ids

    # Stopping early leaves a decode step queued ahead, holding collectives: a host broadcast or a
    # direct model call right after must still pair with the other ranks' (once, it did not).
    from mlx_qwen3vl.generate import encode_prompt

    early = []
    for i in range(10):
        for k, _ in enumerate(M.stream_generate(model, processor, "Tell me a story.", max_tokens=20, temperature=1.0)):
            if k == 1:
                break
        early.append(distributed._broadcast_int(100 + i if rank == 0 else -1, group))
    for k, _ in enumerate(M.stream_generate(model, processor, "Tell me a story.", max_tokens=20)):
        if k == 1:
            break
    out["early_stops"] = early
    out["direct_logits"] = np.array(model(**encode_prompt(processor, "Hello"))[0, -1]).tolist()

    try:  # a bad image on rank 0 must raise the same clear error everywhere, not hang the others
        M.generate(model, processor, "hi", images=[str(media / "missing.png") if rank == 0 else "x.png"],
                   max_tokens=2)
        out["bad_image"] = None
    except M.errors.InputError as e:
        out["bad_image"] = str(e)
    return out


if __name__ == "__main__":
    sys.exit(main())
