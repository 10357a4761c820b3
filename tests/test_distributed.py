"""One model over two ranks: `mlx.launch -n 2 --backend ring` on 127.0.0.1, against one process.

Each launch is bounded (LAUNCH_TIMEOUT) and listens on free 127.0.0.1 ports only. The worker
(tests/distributed_worker.py) loads through `mlx_qwen3vl.load`, which shards because the group has
two ranks; rank 1 is never given readable media, so the answers also prove that rank 0's processor
output reached it.
"""

import json
import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest

import mlx_qwen3vl as M
from conftest import FIXTURES, load_fixture_model, reference
from mlx_qwen3vl.server.__main__ import BLAS_ENV
from distributed_worker import CASES, case_messages
from mlx_qwen3vl import distributed
from mlx_qwen3vl.config import ModelConfig
from mlx_qwen3vl.errors import ConfigError

ROOT = FIXTURES.parents[1]
LAUNCH_TIMEOUT = 600  # generous: the machine may be shared and busy
IMAGE = str(FIXTURES / "media" / "img_123x77.png")
pytestmark = pytest.mark.skipif(shutil.which("mlx.launch") is None, reason="mlx.launch is not on PATH")


def launch(*command, input=None, timeout=LAUNCH_TIMEOUT):
    """Run `command` on 2 ranks over loopback; mlx.launch itself always exits 0, so callers check output."""
    args = distributed.local_launch_command(2, [sys.executable, *command])
    # No BLAS thread settings: the ranks split this machine's cores themselves (share_this_machine).
    env = {k: v for k, v in os.environ.items() if k not in (*BLAS_ENV, "MLX_QWEN3VL_BLAS_THREADS")}
    env.update(PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    return subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=env, input=input,
                          timeout=timeout)


def run_worker(checkpoints, out, *extra):
    """One launch of the worker over `checkpoints` (one after another) → {checkpoint: (its folder
    under out, the error if a rank wrote nothing)}; a fixture reads its own from it."""
    models = [a for c in checkpoints for a in ("--model", str(FIXTURES / c))]
    p = launch(str(ROOT / "tests" / "distributed_worker.py"), *models, "--out", str(out), *extra,
               timeout=LAUNCH_TIMEOUT * len(checkpoints))  # each checkpoint's own bound, as in a launch of its own
    done = {c: all((out / c / f"rank{r}.json").is_file() for r in range(2)) for c in checkpoints}
    return {c: (out / c, None if done[c] else p.stdout + p.stderr) for c in checkpoints}


def worker_ranks(runs, checkpoint):
    folder, error = runs[checkpoint]
    assert error is None, error
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(2)]


SHARDED = ["tiny-a", "tiny-b"]


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory):
    return run_worker(SHARDED, tmp_path_factory.mktemp("dist"), "--heads-too", "--speculative")


@pytest.fixture(scope="module", params=SHARDED)
def sharded_run(request, sharded_runs):
    return request.param, worker_ranks(sharded_runs, request.param)


@pytest.fixture(scope="module")
def single():
    """One process's answers, computed the same way the worker does."""
    cache = {}

    def get(checkpoint):
        if checkpoint not in cache:
            model = load_fixture_model(checkpoint)
            processor = M.Processor.from_pretrained(FIXTURES / checkpoint)
            cases = {}
            for case in CASES:
                messages, fps = case_messages(case, 0)
                cases[case] = M.generate(model, processor, messages=messages, source_fps=fps, max_tokens=16).token_ids
            session = M.ChatSession(model, processor, system="You are a GUI agent.", max_tokens=8)
            chat = []
            for text, image in (("Where is the search box?", "img_300x200.png"), ("Now click it.", "img_90x260.png")):
                chat.append([p.token for p in session.stream(text, images=[str(FIXTURES / "media" / image)])])
            seeded = M.generate(model, processor, "Tell me a story.", max_tokens=12, temperature=1.0, seed=7).token_ids
            cache[checkpoint] = dict(cases=cases, chat=chat, seeded=seeded)
        return cache[checkpoint]

    return get


def test_sharded_ranks_run_the_plain_mlx_graph(sharded_run):
    _, ranks = sharded_run
    for r, out in enumerate(ranks):
        assert out["rank"] == r and out["size"] == 2
        assert out["sharded"] and out["backend"] == "mlx"
        assert f"tensor parallel over 2 ranks (this is rank {r}; vision tower replicated)" in out["describe"]


def test_sharded_greedy_equals_one_process_and_transformers(sharded_run, single):
    """Text, image, two images and video: every rank's answer is one process's; where transformers'
    run used the same inputs (text and images), it is also transformers' recorded answer."""
    checkpoint, ranks = sharded_run
    expected = single(checkpoint)["cases"]
    for out in ranks:
        assert out["cases"] == expected
    for case in ("text", "image", "two_images"):
        assert ranks[0]["cases"][case] == reference(checkpoint, case)["greedy"][0].tolist()


def test_sharded_padded_batch_equals_transformers(sharded_run):
    """batch_generate: an image request and a text request, left-padded, per-sequence rope deltas."""
    checkpoint, ranks = sharded_run
    for out in ranks:
        assert out["batch"] == reference(checkpoint, "batch")["greedy"].tolist()


def test_sharded_chat_session_reuses_cache_on_every_rank(sharded_run, single):
    checkpoint, ranks = sharded_run
    for out in ranks:
        first, second = out["chat"]
        assert [first["tokens"], second["tokens"]] == single(checkpoint)["chat"]
        assert first["cached_tokens"] == 0
        assert second["cached_tokens"] >= first["prompt_tokens"]  # turn 1 came from each rank's own cache
    assert ranks[0]["chat_text"] == ranks[1]["chat_text"]


def kv_single(checkpoint):
    """tests/distributed_worker.quantized_kv in one process, on the plain MLX graph the ranks run."""
    from distributed_worker import quantized_kv

    model = load_fixture_model(checkpoint, backend="mlx")
    images = [str(FIXTURES / "media" / "img_300x200.png"), str(FIXTURES / "media" / "img_90x260.png")]
    return quantized_kv(M, model, M.Processor.from_pretrained(FIXTURES / checkpoint), images, 0)


NEAR_TIE = 0.01  # log-probability lead below which the ranks' other summation order may pick the runner-up


def same_until_a_near_tie(got, want, margins) -> bool:
    """got == want, or they part at a token one process chose by less than NEAR_TIE over the
    runner-up (tensor parallel sums each layer's halves in another order, and a quantized cache
    turns that rounding into a whole quantization step now and then). False when they part there."""
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            assert margins[i] < NEAR_TIE, f"token {i}: {g} vs one process's {w}, chosen by {margins[i]:.4f}"
            return False
    assert len(got) == len(want)
    return True


def test_speculative_decoding_under_ranks_answers_as_one_process(sharded_runs, single):
    """A draft model (the model itself, and the other fixture, both sharded) and prompt lookup,
    with an image and a video: every rank's greedy answer is one process's plain one, the
    self-draft keeps every draft (tiny-a: the worker drafts on its first checkpoint only)."""
    checkpoint = SHARDED[0]
    ranks = worker_ranks(sharded_runs, checkpoint)
    expected = single(checkpoint)["cases"]
    for out in ranks:
        for key, (tokens, proposed, accepted) in out["speculative"].items():
            assert tokens == expected[key.split("/")[0]], key
            assert accepted == proposed > 0 if key.endswith("/self") else accepted <= proposed, key
            assert proposed > 0 or key.endswith("/lookup"), key  # a lookup may find no n-gram
    assert ranks[0]["speculative"] == ranks[1]["speculative"]


def test_quantized_kv_cache_answers_as_one_process(sharded_run):
    """Token for token as one process, up to a near-tie there (which a different BLAS can bring:
    one process chose 240 over 372 by 0.0003 where the ranks chose 372, with MLX's own BLAS)."""
    checkpoint, ranks = sharded_run
    want = kv_single(checkpoint)
    assert ranks[0]["kv"] == ranks[1]["kv"] and want["chat_cached"] > 40
    got = ranks[0]["kv"]
    if same_until_a_near_tie(got["chat"][0], want["chat"][0], want["margins"]["chat"][0]):
        assert got["chat_cached"] == want["chat_cached"]  # turn 2 reused the same quantized prefix
        same_until_a_near_tie(got["chat"][1], want["chat"][1], want["margins"]["chat"][1])
    same_until_a_near_tie(got["four"], want["four"], want["margins"]["four"])


def test_sampling_agrees_across_ranks(sharded_run, single):
    """Unseeded: the seed made equal at load gives every rank the same tokens; seeded: one process's."""
    checkpoint, ranks = sharded_run
    assert ranks[0]["sampled"] == ranks[1]["sampled"]
    assert ranks[0]["seeded"] == ranks[1]["seeded"] == single(checkpoint)["seeded"]


def check_early_stops(checkpoint, ranks):
    """After a stream stopped early (a decode step still queued, holding collectives), rank 0's
    broadcasts arrive intact and a direct model call gives one process's logits on every rank."""
    for out in ranks:
        assert out["early_stops"] == list(range(100, 110))
    from mlx_qwen3vl.generate import encode_prompt

    model = load_fixture_model(checkpoint, backend="mlx")
    processor = M.Processor.from_pretrained(FIXTURES / checkpoint)
    expected = np.array(model(**encode_prompt(processor, "Hello"))[0, -1])
    for out in ranks:
        got = np.array(out["direct_logits"])
        assert np.abs(got - expected).max() <= 1e-4 * np.abs(expected).max()


def test_stopping_early_leaves_the_ranks_in_step(sharded_run):
    check_early_stops(*sharded_run)


def test_ranks_on_one_machine_split_its_cores(sharded_run):
    """Two ranks here: each one's BLAS libraries (MKL serving MLX's matmuls, numpy's OpenBLAS) use
    half the cores, not all of them (a waiting rank spins on its core)."""
    _, ranks = sharded_run
    for out in ranks:
        share = max(1, out["blas_threads"]["cores"] // 2)
        assert out["blas_threads"]["chosen"] == share and out["blas_threads"]["libraries"] == [share], out["blas_threads"]
        assert out["blas_threads"]["mkl_elsewhere"] in (share, None)  # what MLX's own threads use


def test_bad_image_on_rank0_is_one_clear_error_on_every_rank(sharded_run):
    _, ranks = sharded_run
    assert "missing.png" in ranks[0]["bad_image"] and "check the path" in ranks[0]["bad_image"]
    assert ranks[1]["bad_image"] == ranks[0]["bad_image"] + " (reported by rank 0)"


def test_vision_sharded_by_heads_gives_the_same_answers(sharded_run, single):
    checkpoint, ranks = sharded_run
    for out in ranks:
        assert out["cases_heads"] == single(checkpoint)["cases"]


def test_cli_under_mlx_launch_prints_once():
    image = str(FIXTURES / "media" / "img_123x77.png")
    p = launch("-m", "mlx_qwen3vl.generate", "--model", str(FIXTURES / "tiny-a"), "--image", image,
               "--prompt", "Describe the image.", "--max-tokens", "16", "--verbose")
    processor = M.Processor.from_pretrained(FIXTURES / "tiny-a")
    answer = processor.tokenizer.decode(reference("tiny-a", "image")["greedy"][0].tolist())
    assert p.stdout.strip("\n") == answer.strip("\n"), p.stderr
    assert p.stderr.count("Generation: 16 tokens") == 1 and "WARN" not in p.stderr
    # --verbose reaches the program (the launch puts "--" before it) and only rank 0 prints
    assert p.stderr.count("tensor parallel over 2 ranks (this is rank 0;") == 1, p.stderr
    assert "this is rank 1" not in p.stderr


def test_cli_error_under_mlx_launch_is_one_line_from_rank0():
    p = launch("-m", "mlx_qwen3vl.generate", "--model", str(FIXTURES / "tiny-a"), "--image", "missing.png",
               "--prompt", "hi")
    errors = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "missing.png" in errors[0]
    assert "Traceback" not in p.stderr and p.stdout == ""


# Ranks given different checkpoints: each prints the error its load raised. Run first in the
# tensor_logits launch (whose loads then agree), to spare this check a launch of its own.
MISMATCH = ("g = mx.distributed.init()\n"
            f"paths = [{str(FIXTURES / 'tiny-a')!r}, {str(FIXTURES / 'tiny-b')!r}]\n"
            "try:\n    M.load(paths[g.rank()])\nexcept M.errors.WeightsError as e:\n"
            "    print(f'rank{g.rank()}: {e}', flush=True)\n")


def test_ranks_with_different_checkpoints_fail_clearly(tensor_logits):
    p = tensor_logits["launch"]
    lines = sorted(line for line in p.stdout.splitlines() if line.startswith("rank"))
    assert len(lines) == 2, p.stdout + p.stderr
    for line in lines:
        assert "rank(s) [1] have a different checkpoint" in line and "copy the same folder" in line


def _logits_script(paths, out_dir, parallel="tensor", before=""):
    """Each rank, after `before`, for each checkpoint in turn (one launch for all), into
    out_dir/<folder name>/: all-position logits of an image prompt to rank<r>.npy, a greedy answer
    to rank<r>.json, how the model is split to rank<r>.txt."""
    return ("import mlx.core as mx, numpy as np, os, mlx_qwen3vl as M\n"
            "from mlx_qwen3vl.generate import encode_prompt\n"
            + before +
            "r = mx.distributed.init().rank()\n"
            f"for path in {[str(p) for p in paths]!r}:\n"
            f"    out = os.path.join({str(out_dir)!r}, os.path.basename(path))\n"
            "    os.makedirs(out, exist_ok=True)\n"
            f"    model, processor = M.load(path, parallel={parallel!r})\n"
            f"    inputs = encode_prompt(processor, 'Describe the image.', images=[{IMAGE!r}])\n"
            "    np.save(out + f'/rank{r}.npy', np.array(model(**inputs)))\n"
            "    open(out + f'/rank{r}.txt', 'w').write(model.backend.describe())\n"
            f"    ids = M.generate(model, processor, 'Describe the image.', images=[{IMAGE!r}],\n"
            "                     max_tokens=12).token_ids\n"
            "    open(out + f'/rank{r}.json', 'w').write(str(ids))\n")


def launch_logits(paths, out_dir, parallel="tensor", before=""):
    """_logits_script on 2 ranks (split as `parallel` says) → {path: (its folder, the launch's
    output)}, and the launch's CompletedProcess under "launch"."""
    p = launch("-c", _logits_script(paths, out_dir, parallel, before),
               timeout=LAUNCH_TIMEOUT * (len(paths) + bool(before)))  # a bound per load, as in launches of their own
    return {"launch": p, **{path: (out_dir / path.name, p.stdout + p.stderr) for path in paths}}


def _sharded_logits_equal_one_process(path, run):
    """`run`, launch_logits' entry for `path`: its logits agree bitwise across ranks and match one
    process's within 1e-4 (sums split over ranks round differently, as the CPU path does against
    MLX here: ~1e-5). Returns one process's (model, processor) and the ranks' greedy answers."""
    folder, log = run
    assert all((folder / f"rank{r}.npy").is_file() for r in range(2)), log
    got = [np.load(folder / f"rank{r}.npy") for r in range(2)]
    np.testing.assert_array_equal(got[0], got[1])
    model, processor = M.load(path)
    from mlx_qwen3vl.generate import encode_prompt

    expected = np.array(model(**encode_prompt(processor, "Describe the image.", images=[IMAGE])))
    assert got[0].shape == expected.shape
    assert np.abs(got[0] - expected).max() <= 1e-4 * np.abs(expected).max()
    return model, processor, [(folder / f"rank{r}.json").read_text() for r in range(2)]


MIXED, MOE = FIXTURES / "mlxvlm-mixed_3_6", FIXTURES / "tiny-moe"


@pytest.fixture(scope="module")
def tensor_logits(tmp_path_factory):
    return launch_logits([MIXED, MOE], tmp_path_factory.mktemp("logits"), before=MISMATCH)


def test_quantized_checkpoint_logits_equal_one_process(tensor_logits):
    """mlx-vlm's mixed 3/6-bit folder: quantized tied embedding split by vocabulary, 3-bit
    projections split by rows and columns."""
    _sharded_logits_equal_one_process(MIXED, tensor_logits[MIXED])


def test_moe_logits_and_greedy_equal_one_process(tensor_logits):
    """Experts' intermediate split over 2 ranks, router replicated, the dense mlp_only layer split too."""
    model, processor, answers = _sharded_logits_equal_one_process(MOE, tensor_logits[MOE])
    ids = M.generate(model, processor, "Describe the image.", images=[IMAGE], max_tokens=12).token_ids
    assert answers == [str(ids)] * 2


def test_quantized_experts_that_do_not_split_by_group_are_one_clear_error():
    config = ModelConfig.from_pretrained(FIXTURES / "mlxvlm-moe-q4")  # moe_intermediate_size 96, groups of 32
    with pytest.raises(ConfigError, match="moe_intermediate_size 96/2 is not a multiple of the quantization group"):
        distributed.check_shardable(config, 2)


# --- in one process: what needs no second rank --------------------------------------------------
class FakeGroup:
    def __init__(self, size, rank=0):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def test_fixture_head_counts_divide_by_two():
    for name in ("tiny-a", "tiny-b"):
        config = ModelConfig.from_pretrained(FIXTURES / name)
        distributed.check_shardable(config, 2, "heads")
    # tiny-b has one KV head for two query heads: each rank keeps a copy of it.
    assert ModelConfig.from_pretrained(FIXTURES / "tiny-b").text_config.num_key_value_heads == 1


@pytest.mark.parametrize("n, vision, needle", [
    (3, "replicate", "num_attention_heads=4"),
    (8, "replicate", "num_attention_heads=4"),
    (4, "heads", None),
])
def test_dimensions_that_do_not_divide_are_one_clear_error(n, vision, needle):
    config = ModelConfig.from_pretrained(FIXTURES / "tiny-a")
    if needle is None:
        distributed.check_shardable(config, n, vision)  # 4 heads, 2 KV heads, 4 vision heads: fine
        return
    with pytest.raises(ConfigError, match=f"cannot shard this model over {n} ranks: .*{needle}"):
        distributed.check_shardable(config, n, vision)
    model = M.load_model(FIXTURES / "tiny-a")
    before = model.language_model.layers[0].self_attn.q_proj.weight.shape
    with pytest.raises(ConfigError):
        distributed.shard(model, FakeGroup(n), vision)
    assert model.language_model.layers[0].self_attn.q_proj.weight.shape == before  # untouched


def test_kv_heads_that_do_not_divide_suggest_the_pipeline_not_the_same_launch():
    """3 KV heads over 2 ranks: the message points at --parallel pipeline (which splits layers, not
    heads), never at the `-n 2` launch that just failed; where other rank counts divide, it names them."""
    import dataclasses

    config = ModelConfig.from_pretrained(FIXTURES / "tiny-a")
    three = dataclasses.replace(config, text_config=dataclasses.replace(config.text_config, num_key_value_heads=3))
    with pytest.raises(ConfigError) as e:
        distributed.check_shardable(three, 2)
    message = str(e.value)
    assert "num_key_value_heads=3" in message and "--parallel pipeline" in message and "-n 2" not in message
    with pytest.raises(ConfigError, match=r"--parallel pipeline .*, or launch 2 or 4 ranks \(mlx.launch -n 2\)"):
        distributed.check_shardable(config, 3)  # tiny-a's 4 heads and 2 KV heads divide by 2 and 4


def test_cpu_path_is_refused_for_a_sharded_model():
    with pytest.raises(ConfigError, match="sharded models run the plain MLX graph"):
        distributed.sharded_load(FIXTURES / "tiny-a", FakeGroup(2), backend="cpu")


def test_vision_heads_that_do_not_divide(tmp_path):
    config = ModelConfig.from_pretrained(FIXTURES / "tiny-b")  # vision num_heads=2
    with pytest.raises(ConfigError, match="vision num_heads=2"):
        distributed.check_shardable(config, 4, "heads")
    with pytest.raises(ConfigError, match="not one of"):
        distributed.check_shardable(config, 2, "rows")


def test_fingerprint_tells_checkpoints_apart(tmp_path):
    a = distributed.checkpoint_fingerprint(FIXTURES / "tiny-a")
    assert a == distributed.checkpoint_fingerprint(FIXTURES / "tiny-a")
    assert a != distributed.checkpoint_fingerprint(FIXTURES / "tiny-b")
    copy = tmp_path / "copy"
    shutil.copytree(FIXTURES / "tiny-a", copy)
    assert distributed.checkpoint_fingerprint(copy) == a
    config = json.loads((copy / "config.json").read_text())
    config["text_config"]["rms_norm_eps"] = 1e-5
    (copy / "config.json").write_text(json.dumps(config))
    assert distributed.checkpoint_fingerprint(copy) != a


def test_one_process_is_not_sharded():
    assert distributed.world() is None
    model, _ = M.load(FIXTURES / "tiny-a")
    assert not distributed.is_sharded(model)
    np.testing.assert_array_equal(np.array(model.language_model.embed_tokens.weight.shape), [448, 64])


# --- sharded loading: each rank reads only its slices ----------------------------------------------
LOAD_RUNS = ["tiny-a:replicate", "tiny-a:heads", "tiny-b:replicate", "tiny-b:heads", "tiny-moe:replicate",
             "tiny-moe-hub:heads", "mlxvlm-mixed_3_6:replicate", "mlxvlm-untied-mixed_3_6:replicate"]


@pytest.fixture(scope="module")
def sharded_loads(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded-load")
    p = launch(str(ROOT / "tests" / "sharded_load_worker.py"), "--out", str(out), *LOAD_RUNS)
    ranks = [out / f"rank{r}.json" for r in range(2)]
    assert all(f.is_file() for f in ranks), p.stdout + p.stderr
    return [json.loads(f.read_text()) for f in ranks]


def _header(f):
    with open(f, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        return {k: v for k, v in json.loads(fh.read(n)).items() if k != "__metadata__"}


def expected_bytes(name, vision, rank, n=2):
    """The tensor bytes rank `rank` of n should read, from the checkpoint's headers and config alone:
    1/n of every tensor the decoder splits (vocabulary rows for the embedding and head, one KV head
    when there are fewer KV heads than ranks, the vision blocks' too with vision="heads"), the whole
    of every other tensor."""
    folder = FIXTURES / name
    t = ModelConfig.from_pretrained(folder).text_config
    files, weight_map = M.weights.weight_files(folder)
    total = 0
    for f in files:
        for key, info in _header(f).items():
            if weight_map is not None and weight_map[key] != f.name:
                continue
            size = info["data_offsets"][1] - info["data_offsets"][0]
            rows = -(-t.vocab_size // n)
            if "embed_tokens." in key or "lm_head." in key:
                part = size * len(range(rank * rows, min(t.vocab_size, (rank + 1) * rows))) // t.vocab_size
            elif ("self_attn.k_proj." in key or "self_attn.v_proj." in key) and t.num_key_value_heads < n:
                part = size // t.num_key_value_heads
            elif any(s in key for s in ("_proj.", "experts.", "switch_mlp.")) and ".layers." in key:
                part = size // n  # q/k/v/o, gate/up/down and the experts (not the router, `mlp.gate.`)
            elif vision == "heads" and ".blocks." in key and any(s in key for s in ("attn.", "mlp.")):
                split_bias = key.endswith("bias") and ("attn.proj." in key or "linear_fc2." in key)
                part = size if split_bias else size // n  # a sharded-to-all bias is not split
            else:
                part = size
            total += part
    return total


@pytest.mark.parametrize("run", LOAD_RUNS)
def test_sharded_load_equals_loading_whole_then_sharding(sharded_loads, run):
    """Every parameter each rank reads by parts is, bit for bit, what the whole-tensor load sliced
    gives: dense bf16 (tied, 5 shards) and float32 (untied, 1 KV head for 2 ranks), MoE experts in
    transformers 5's and the hub's transposed layout, mixed 3/6-bit quantized (tied and untied)."""
    for out in sharded_loads:
        assert out[run]["params"] > 50 and out[run]["differ"] == []


@pytest.mark.parametrize("run", LOAD_RUNS)
def test_sharded_load_reads_only_its_part(sharded_loads, run):
    """The bytes each rank read are exactly its share of the split tensors plus the replicated ones
    (only the 5-D patch kernel, replicated anyway, is read whole to be reshaped)."""
    name, vision = run.split(":")
    for rank, out in enumerate(sharded_loads):
        assert out[run]["bytes"] == expected_bytes(name, vision, rank)
        assert all("patch_embed.proj.weight" in key for key in out[run]["whole"])
    whole = expected_bytes(name, vision, 0, n=1)
    assert sharded_loads[0][run]["bytes"] < whole  # and it is a real saving


def _load_with(surgery, name="tiny-a"):
    from mlx.utils import tree_flatten

    from mlx_qwen3vl import sharded_load

    new = sharded_load.load_kept(FIXTURES / name, None, surgery)
    old, _ = M.weights.build_model(FIXTURES / name, lazy=True)
    surgery(old)
    return dict(tree_flatten(new.parameters())), dict(tree_flatten(old.parameters()))


def test_load_kept_follows_any_slicing_surgery():
    """A pipeline-like surgery (layers dropped, the rest renumbered), rows reversed, every other
    column, an embedding's last 8 rows padded with zeros to 16: each parameter is read by parts and
    equals the whole load's."""
    import mlx.core as mx

    def surgery(model):
        lm = model.language_model
        lm.layers = lm.layers[1:]  # moved: read whole, under new names
        mlp = lm.layers[0].mlp
        mlp.gate_proj.weight = mlp.gate_proj.weight[::-1]
        mlp.up_proj.weight = mlp.up_proj.weight[:, ::2]
        distributed._take_rows(lm.embed_tokens, 440, 448, 16)  # the last rank of an uneven split: zero rows
        model.visual.blocks = []

    new, old = _load_with(surgery)
    assert set(new) == set(old) and not any(k.startswith("visual.blocks") for k in new)
    for k in new:
        assert new[k].shape == old[k].shape and bool(mx.array_equal(new[k], old[k])), k


def test_load_kept_refuses_a_surgery_it_cannot_read_by_parts():
    """A transposed square weight is not a block of indices along each axis: one clear error."""
    from mlx_qwen3vl import sharded_load
    from mlx_qwen3vl.errors import WeightsError

    def surgery(model):
        attn = model.language_model.layers[0].self_attn
        attn.k_proj.weight = attn.k_proj.weight.T  # (64, 64)

    with pytest.raises(WeightsError, match="k_proj.weight: the model surgery rearranged"):
        sharded_load.load_kept(FIXTURES / "tiny-a", None, surgery)
