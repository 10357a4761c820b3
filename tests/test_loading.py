"""Config layouts, strict weight loading and the one-line errors for bad checkpoints or inputs."""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

from conftest import FIXTURES, case_inputs, load_fixture_model
from mlx_qwen3vl.config import ModelConfig
from mlx_qwen3vl.errors import ConfigError, InputError, WeightsError
from mlx_qwen3vl.weights import load_model


def one_line(excinfo):
    msg = str(excinfo.value)
    assert "\n" not in msg and msg
    return msg


def copy_checkpoint(tmp_path, name="tiny-b"):
    dst = tmp_path / name
    shutil.copytree(FIXTURES / name, dst, ignore=shutil.ignore_patterns("reference"))
    return dst


def test_both_config_layouts_agree():
    legacy = ModelConfig.from_pretrained(FIXTURES / "tiny-a")  # transformers 4.57: rope_scaling + rope_theta
    modern = ModelConfig.from_pretrained(FIXTURES / "tiny-b")  # transformers 5: rope_parameters
    assert legacy.text_config.mrope_section == [6, 5, 5] and legacy.text_config.rope_theta == 1000.0
    assert modern.text_config.mrope_section == [24, 20, 20] and modern.text_config.rope_theta == 5_000_000.0
    assert legacy.tie_word_embeddings and not modern.tie_word_embeddings
    assert legacy.torch_dtype == "bfloat16" and modern.torch_dtype == "float32"
    assert legacy.vision_config.deepstack_visual_indexes == [0, 2]


def test_tie_word_embeddings_only_in_text_config():
    raw = json.loads((FIXTURES / "tiny-a" / "config.json").read_text())
    raw.pop("tie_word_embeddings")
    raw["unknown_future_key"] = {"ignored": True}
    assert ModelConfig.from_dict(raw).tie_word_embeddings is True
    raw["text_config"]["tie_word_embeddings"] = False
    assert ModelConfig.from_dict(raw).tie_word_embeddings is False


def test_wrong_model_type(tmp_path):
    ckpt = copy_checkpoint(tmp_path)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"] = "qwen2_5_vl"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as e:
        load_model(ckpt)
    assert "qwen2_5_vl" in one_line(e) and "model_type" in str(e.value)


def test_missing_required_key():
    raw = json.loads((FIXTURES / "tiny-b" / "config.json").read_text())
    del raw["text_config"]["num_hidden_layers"]
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict(raw)
    assert "num_hidden_layers" in one_line(e)


def test_missing_weight_file(tmp_path):
    ckpt = copy_checkpoint(tmp_path)
    for f in ckpt.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(WeightsError) as e:
        load_model(ckpt)
    assert "safetensors" in one_line(e)


def test_missing_shard(tmp_path):
    ckpt = copy_checkpoint(tmp_path, "tiny-a")
    (ckpt / "model-00002-of-00005.safetensors").unlink()
    with pytest.raises(WeightsError) as e:
        load_model(ckpt)
    assert "model-00002-of-00005.safetensors" in one_line(e)


def test_missing_and_extra_keys_reported_together(tmp_path):
    ckpt = copy_checkpoint(tmp_path)
    weights = mx.load(str(ckpt / "model.safetensors"))
    del weights["model.language_model.layers.1.mlp.up_proj.weight"]
    weights["model.language_model.layers.9.mlp.up_proj.weight"] = mx.zeros((4, 4))
    weights["model.visual.merger.linear_fc1.weight"] = mx.zeros((3, 3))
    mx.save_safetensors(str(ckpt / "model.safetensors"), weights)
    with pytest.raises(WeightsError) as e:
        load_model(ckpt)
    msg = one_line(e)
    assert "language_model.layers.1.mlp.up_proj.weight" in msg
    assert "language_model.layers.9.mlp.up_proj.weight" in msg
    assert "visual.merger.linear_fc1.weight" in msg


def test_placeholder_count_mismatch(checkpoint):
    model = load_fixture_model(checkpoint)
    inputs = case_inputs("image")
    ids = inputs["input_ids"].copy()
    ids[0, np.flatnonzero(ids[0] == model.config.image_token_id)[0]] = 50  # one placeholder fewer
    with pytest.raises(InputError) as e:
        model(**dict(inputs, input_ids=ids))
    msg = one_line(e)
    assert "image" in msg and str(int((ids == model.config.image_token_id).sum())) in msg


def test_pixel_values_not_matching_grid(checkpoint):
    model = load_fixture_model(checkpoint)
    inputs = case_inputs("image")
    with pytest.raises(InputError) as e:
        model.get_image_features(inputs["pixel_values"][:-4], inputs["image_grid_thw"])
    assert "grid_thw" in one_line(e)


# ---------------------------------------------------------------------------------------------
# Tokenizer files: checked when a folder loads, before any weight is read
# ---------------------------------------------------------------------------------------------
def _load_fails(folder):
    import mlx_qwen3vl

    with pytest.raises(ConfigError) as e:
        mlx_qwen3vl.load(str(folder))
    return one_line(e)


def test_folder_without_tokenizer_files(tmp_path):
    ckpt = copy_checkpoint(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (ckpt / name).unlink()
    msg = _load_fails(ckpt)
    assert str(ckpt) in msg and "no tokenizer.json" in msg and "copy the tokenizer files" in msg


def test_folder_missing_only_tokenizer_json(tmp_path):
    """transformers would build a tokenizer from tokenizer_config.json alone that maps a prompt to
    one token (an empty answer)."""
    ckpt = copy_checkpoint(tmp_path)
    (ckpt / "tokenizer.json").unlink()
    assert "no tokenizer.json" in _load_fails(ckpt)


def test_truncated_tokenizer_json(tmp_path):
    ckpt = copy_checkpoint(tmp_path)
    data = (ckpt / "tokenizer.json").read_bytes()
    (ckpt / "tokenizer.json").write_bytes(data[: len(data) // 2])
    msg = _load_fails(ckpt)
    assert "tokenizer.json is truncated" in msg


def test_good_folder_loads(tmp_path):
    import mlx_qwen3vl

    model, processor = mlx_qwen3vl.load(str(FIXTURES / "tiny-b"))
    assert processor.tokenizer.encode("hello world") and len(processor.tokenizer.encode("hello world")) > 1
