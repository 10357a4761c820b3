"""Pipeline parallel (mlx_qwen3vl/pipeline.py): the decoder's layers split over two ranks with
`mlx.launch -n 2 --backend ring` on 127.0.0.1, against one process.

One worker launch (tests/distributed_worker.py with `--parallel pipeline`) runs every check on each
fixture in turn: tiny-a (dense, tied table: first and last stage both hold it), tiny-b (three DeepStack taps,
so tap 2 is added on the second stage) and tiny-moe (sparse and dense layers of different sizes).
"""

import re
from itertools import combinations

import numpy as np
import pytest

import mlx_qwen3vl as M
from conftest import FIXTURES, load_fixture_model, reference
from distributed_worker import case_messages
from mlx_qwen3vl import distributed
from mlx_qwen3vl.errors import ConfigError
from mlx_qwen3vl.pipeline import balanced_bounds, check_pipelinable, pipeline
from test_distributed import IMAGE, FakeGroup, check_early_stops, launch, pytestmark, single  # noqa: F401 (fixture, mark)
from test_distributed import run_worker, worker_ranks
from test_distributed import MIXED, _sharded_logits_equal_one_process, kv_single, launch_logits

# The balanced split of each fixture over 2 ranks (test_split_is_the_most_even asserts it is).
BOUNDS = {"tiny-a": [0, 2, 3], "tiny-b": [0, 2, 4], "tiny-moe": [0, 2, 4]}


@pytest.fixture(scope="module")
def piped_runs(tmp_path_factory):
    return run_worker(list(BOUNDS), tmp_path_factory.mktemp("pipe"), "--parallel", "pipeline", "--logits")


@pytest.fixture(scope="module", params=list(BOUNDS))
def piped(request, piped_runs):
    checkpoint = request.param
    return checkpoint, worker_ranks(piped_runs, checkpoint), piped_runs[checkpoint][0]


def stage_parameters(checkpoint, bounds, rank):
    """{name: size} a rank of the pipeline should hold, from one process's parameters: its layers
    (renumbered from 0), the vision tower on the first stage and on a stage with a DeepStack layer,
    the embedding on the first stage, norm and head on the last (a tied table on both)."""
    model = load_fixture_model(checkpoint, backend="mlx")
    start, end = bounds[rank], bounds[rank + 1]
    first, last = rank == 0, rank == len(bounds) - 2
    taps = len(model.config.vision_config.deepstack_visual_indexes)
    tied = model.config.tie_word_embeddings
    kept = {}
    for name, value in dict(_flat(model)).items():
        layer = re.match(r"language_model\.layers\.(\d+)\.(.*)", name)
        if layer and start <= int(layer[1]) < end:
            kept[f"language_model.layers.{int(layer[1]) - start}.{layer[2]}"] = value
        elif name.startswith("visual.") and (first or start < taps):
            kept[name] = value
        elif name.startswith("language_model.embed_tokens.") and (first or (tied and last)):
            kept[name.replace("embed_tokens.", "embed_tokens.table.")] = value
        elif name.startswith("language_model.norm.") and last:
            kept[name] = value
        elif name.startswith("lm_head.") and last:
            kept[name.replace("lm_head.", "lm_head.head.")] = value
    return kept


def _flat(model):
    from mlx.utils import tree_flatten

    return [(k, v.size) for k, v in tree_flatten(model.parameters())]


def test_each_rank_holds_only_its_stage(piped):
    checkpoint, ranks, _ = piped
    bounds = BOUNDS[checkpoint]
    for r, out in enumerate(ranks):
        assert out["sharded"] and out["backend"] == "mlx"
        assert (f"pipeline over 2 ranks (this is rank {r}: decoder layers {bounds[r]}-{bounds[r + 1] - 1} "
                f"of {bounds[-1]})") in out["describe"]
        assert out["parameters"] == stage_parameters(checkpoint, bounds, r)
    # tiny-a: the second stage has no DeepStack layer, so no vision tower; tiny-b: it has tap 2
    has_vision = any(k.startswith("visual.") for k in ranks[1]["parameters"])
    assert has_vision == (checkpoint == "tiny-b")


def test_split_is_the_most_even(piped):
    """No other split of the layers over 2 ranks has a smaller largest rank (by parameters)."""
    checkpoint = piped[0]
    layers = BOUNDS[checkpoint][-1]

    def largest(k):
        return max(sum(stage_parameters(checkpoint, [0, k, layers], r).values()) for r in range(2))

    assert largest(BOUNDS[checkpoint][1]) == min(largest(k) for k in range(1, layers))


def test_greedy_equals_one_process(piped, single):
    """Text, image, two images and video on every rank; the padded batch is transformers' answer."""
    checkpoint, ranks, _ = piped
    for out in ranks:
        assert out["cases"] == single(checkpoint)["cases"]
        assert out["batch"] == reference(checkpoint, "batch")["greedy"].tolist()


def test_chunked_prefill_equals_one_process(piped):
    checkpoint, ranks, _ = piped
    model = load_fixture_model(checkpoint)
    processor = M.Processor.from_pretrained(FIXTURES / checkpoint)
    expected = M.generate(model, processor, messages=case_messages("image", 0)[0], max_tokens=8,
                          prefill_step_size=16).token_ids
    assert ranks[0]["chunked"] == ranks[1]["chunked"] == expected


def test_logits_equal_one_process(piped):
    """Both ranks get the same logits, one process's up to the BLAS's rounding: nothing is summed
    differently in a pipeline, so against a fresh process they are bitwise equal, but this test
    process has run the CPU path, whose BLAS thread setting changes MKL's blocking (~1e-5)."""
    checkpoint, _, out = piped
    model = load_fixture_model(checkpoint, backend="mlx")
    processor = M.Processor.from_pretrained(FIXTURES / checkpoint)
    from mlx_qwen3vl.generate import encode_prompt

    expected = np.array(model(**encode_prompt(processor, messages=case_messages("image", 0)[0])))
    got = [np.load(out / f"rank{r}.npy") for r in range(2)]
    np.testing.assert_array_equal(got[0], got[1])
    assert got[0].shape == expected.shape
    assert np.abs(got[0] - expected).max() <= 1e-4 * np.abs(expected).max()


def test_chat_session_reuses_each_ranks_cache(piped, single):
    checkpoint, ranks, _ = piped
    for out in ranks:
        first, second = out["chat"]
        assert [first["tokens"], second["tokens"]] == single(checkpoint)["chat"]
        assert first["cached_tokens"] == 0 and second["cached_tokens"] >= first["prompt_tokens"]


def test_quantized_kv_cache_answers_as_one_process(piped):
    """Each stage quantizes its own layers' caches at the same position."""
    checkpoint, ranks, _ = piped
    want = kv_single(checkpoint)
    for out in ranks:  # each stage runs whole layers: the same sums as one process, so the same tokens
        assert {k: v for k, v in out["kv"].items() if k != "margins"} == {k: v for k, v in want.items() if k != "margins"}


def test_sampling_and_errors_agree_across_ranks(piped, single):
    checkpoint, ranks, _ = piped
    assert ranks[0]["sampled"] == ranks[1]["sampled"]
    assert ranks[0]["seeded"] == ranks[1]["seeded"] == single(checkpoint)["seeded"]
    assert "missing.png" in ranks[0]["bad_image"]
    assert ranks[1]["bad_image"] == ranks[0]["bad_image"] + " (reported by rank 0)"


def test_stopping_early_leaves_the_ranks_in_step(piped):
    checkpoint, ranks, _ = piped
    check_early_stops(checkpoint, ranks)


def test_quantized_checkpoint_logits_and_greedy_equal_one_process(tmp_path):
    """mlx-vlm's mixed 3/6-bit folder as a pipeline: its 6-bit tied table is kept by both stages
    (the lookup on the first, `as_linear` on the last), 3- and 6-bit layers stay whole on theirs."""
    run = launch_logits([MIXED], tmp_path, "pipeline")[MIXED]
    model, processor, answers = _sharded_logits_equal_one_process(MIXED, run)
    for r in range(2):
        assert f"pipeline over 2 ranks (this is rank {r}: decoder layers" in (run[0] / f"rank{r}.txt").read_text()
    ids = M.generate(model, processor, "Describe the image.", images=[IMAGE], max_tokens=12).token_ids
    assert answers == [str(ids)] * 2


@pytest.mark.parametrize("checkpoint", ["tiny-a", "tiny-moe"])
def test_cli_pipeline_prints_one_process_answer(checkpoint):
    p = launch("-m", "mlx_qwen3vl", "--parallel", "pipeline", "--model", str(FIXTURES / checkpoint), "--image", IMAGE,
               "--prompt", "Describe the image.", "--max-tokens", "12")
    model = load_fixture_model(checkpoint)
    processor = M.Processor.from_pretrained(FIXTURES / checkpoint)
    answer = M.generate(model, processor, "Describe the image.", images=[IMAGE], max_tokens=12).text
    answer = answer.replace("\r\n", "\n").replace("\r", "\n")  # as the text-mode pipe reads it
    assert p.stdout.strip("\n") == answer.strip("\n"), p.stderr
    assert p.stderr.count("Generation: 12 tokens") == 1 and "Traceback" not in p.stderr


# --- in one process -------------------------------------------------------------------------------
def test_more_ranks_than_layers_is_one_clear_error():
    config = M.load_model(FIXTURES / "tiny-a").config  # 3 decoder layers
    check_pipelinable(config, 3)
    with pytest.raises(ConfigError, match="cannot split 3 decoder layers over 4 ranks as a pipeline.*at most 3"):
        check_pipelinable(config, 4)
    from mlx_qwen3vl.weights import build_model

    model, _ = build_model(FIXTURES / "tiny-a", lazy=True)
    with pytest.raises(ConfigError, match="cannot split 3 decoder layers"):
        pipeline(model, FakeGroup(4))
    assert len(model.language_model.layers) == 3  # untouched
    with pytest.raises(ConfigError, match=r"pipeline split \[0, 3, 3\] is not 3 increasing"):
        pipeline(model, FakeGroup(2), bounds=[0, 3, 3])


def test_bad_choices_are_one_clear_error():
    with pytest.raises(ConfigError, match="parallel='layers' is not one of tensor, pipeline"):
        M.load(FIXTURES / "tiny-a", parallel="layers")
    with pytest.raises(ConfigError, match="only tensor parallel does"):
        distributed.sharded_load(FIXTURES / "tiny-a", FakeGroup(2), vision="heads", parallel="pipeline")
    with pytest.raises(ConfigError, match="sharded models run the plain MLX graph"):
        distributed.sharded_load(FIXTURES / "tiny-a", FakeGroup(2), backend="cpu", parallel="pipeline")


def test_balanced_bounds_minimize_the_largest_stage():
    """Against every split, on uneven layers (an MoE model's dense layers are small) and a first
    stage that also holds a large vision tower and table."""
    rng = np.random.default_rng(0)
    for _ in range(20):
        sizes = [int(s) for s in rng.choice([10, 100], size=int(rng.integers(3, 9)))]
        n = int(rng.integers(2, 4))
        fixed = lambda rank, start, end: (150 if rank == 0 else 0) + (40 if rank == n - 1 else 0)  # noqa: E731

        def largest(bounds):
            return max(fixed(r, a, b) + sum(sizes[a:b]) for r, (a, b) in enumerate(zip(bounds, bounds[1:])))

        every = [[0, *cut, len(sizes)] for cut in combinations(range(1, len(sizes)), n - 1)]
        got = balanced_bounds(sizes, n, fixed)
        assert got in every and largest(got) == min(largest(b) for b in every)


def test_one_process_ignores_parallel():
    model, _ = M.load(FIXTURES / "tiny-a", parallel="pipeline")
    assert not distributed.is_sharded(model) and len(model.language_model.layers) == 3
