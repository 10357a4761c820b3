"""The published Qwen3-VL Instruct architectures ("presets") as config.json dicts (transformers-4.57
layout), so the memory planner can size them and the benchmarks can build them with random
weights, with nothing downloaded.

The shapes are those of config.json of Qwen/Qwen3-VL-{2B,4B,8B,30B-A3B}-Instruct; `tiny` and
`moe-small` are small ones for tests and for machines without the memory for 30B-A3B.
"""

from .errors import InputError

# What every published Qwen3-VL text config shares.
_TEXT = dict(head_dim=128, num_key_value_heads=8, vocab_size=151936, rope_theta=5_000_000,
             mrope_section=[24, 20, 20], max_position_embeddings=262144)
_VISION_2B = dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16,
                  deepstack_visual_indexes=[5, 11, 17])
_VISION_8B = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, deepstack_visual_indexes=[8, 16, 24])
_MOE_30B = dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=32, num_key_value_heads=4,
                moe=dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768))

PRESETS = {
    "tiny": dict(text=dict(_TEXT, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=32, vocab_size=448, mrope_section=[6, 5, 5]),
                 vision=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=4,
                             deepstack_visual_indexes=[0, 1]), tie=True),
    "2b": dict(text=dict(_TEXT, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                         num_attention_heads=16), vision=dict(_VISION_2B), tie=True),
    "4b": dict(text=dict(_TEXT, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                         num_attention_heads=32), vision=dict(_VISION_2B), tie=True),
    "8b": dict(text=dict(_TEXT, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                         num_attention_heads=32), vision=dict(_VISION_8B), tie=False),
    # Qwen/Qwen3-VL-30B-A3B-Instruct (UI-Venus-1.5-30B-A3B's base): 48 sparse layers of 128 experts.
    "30b-a3b": dict(text=dict(_TEXT, **_MOE_30B, num_hidden_layers=48), vision=dict(_VISION_8B), tie=False),
    # 30B-A3B's layer shapes (experts, router, attention, vocabulary, vision tower) with two layers.
    "moe-small": dict(text=dict(_TEXT, **_MOE_30B, num_hidden_layers=2), vision=dict(_VISION_8B), tie=False),
}

# The hub checkpoints each preset stands for (the planner's table names them).
HUB_IDS = {"2b": "Qwen/Qwen3-VL-2B-Instruct", "4b": "Qwen/Qwen3-VL-4B-Instruct", "8b": "Qwen/Qwen3-VL-8B-Instruct",
           "30b-a3b": "Qwen/Qwen3-VL-30B-A3B-Instruct"}

# Qwen3-VL's special token ids (every published checkpoint's tokenizer).
QWEN3VL_TOKENS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                      vision_end_token_id=151653, bos_token_id=151643, eos_token_id=151645)

# preprocessor_config.json of the published checkpoints (the pixel budget and patch layout).
QWEN3VL_PREPROCESSOR = {"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16,
                        "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                        "image_std": [0.5, 0.5, 0.5]}


def check_preset(name, flag="--preset"):
    if name not in PRESETS:
        raise InputError(f"{flag} {name!r} is not one of {', '.join(PRESETS)}")
    return name


def preset_config(name, tokens=None):
    """config.json of a preset in the transformers-4.57 layout (what the hub serves; mlx-vlm
    rejects the 5.x layout). `tokens`: the special token ids (default Qwen3-VL's)."""
    spec = PRESETS[check_preset(name)]
    tok = dict(QWEN3VL_TOKENS, **(tokens or {}))
    t = dict(spec["text"])
    text = dict(
        attention_bias=False, attention_dropout=0.0, bos_token_id=tok["bos_token_id"],
        eos_token_id=tok["eos_token_id"], head_dim=t["head_dim"], hidden_act="silu",
        hidden_size=t["hidden_size"], initializer_range=0.02, intermediate_size=t["intermediate_size"],
        max_position_embeddings=t["max_position_embeddings"], model_type="qwen3_vl_text",
        num_attention_heads=t["num_attention_heads"], num_hidden_layers=t["num_hidden_layers"],
        num_key_value_heads=t["num_key_value_heads"], rms_norm_eps=1e-6,
        rope_scaling=dict(mrope_interleaved=True, mrope_section=t["mrope_section"], rope_type="default"),
        rope_theta=t["rope_theta"], tie_word_embeddings=spec["tie"], use_cache=True, vocab_size=t["vocab_size"],
        torch_dtype="bfloat16",
    )
    vision = dict(spec["vision"], hidden_act="gelu_pytorch_tanh", in_channels=3, initializer_range=0.02,
                  model_type="qwen3_vl", num_position_embeddings=2304, out_hidden_size=t["hidden_size"],
                  patch_size=16, spatial_merge_size=2, temporal_patch_size=2)
    arch, model_type = "Qwen3VLForConditionalGeneration", "qwen3_vl"
    if "moe" in t:  # the published 30B-A3B's text_config keys (4.57 layout)
        arch, model_type = "Qwen3VLMoeForConditionalGeneration", "qwen3_vl_moe"
        text.update(t["moe"], model_type="qwen3_vl_moe_text", decoder_sparse_step=1, mlp_only_layers=[],
                    norm_topk_prob=True)
        vision["model_type"] = "qwen3_vl_moe"
    return dict(architectures=[arch], model_type=model_type,
                image_token_id=tok["image_token_id"], video_token_id=tok["video_token_id"],
                vision_start_token_id=tok["vision_start_token_id"], vision_end_token_id=tok["vision_end_token_id"],
                text_config=text, vision_config=vision, tie_word_embeddings=spec["tie"], torch_dtype="bfloat16",
                transformers_version="4.57.0")
