"""Qwen3-VL configuration, read from a checkpoint's config.json in any layout people have.

Hub checkpoints written by transformers 4.57 carry `rope_theta` + `rope_scaling` in `text_config`
and `torch_dtype`; transformers 5 writes `rope_parameters` and `dtype`. `tie_word_embeddings` may
sit at the top level, in `text_config`, or both (the top level wins, as in transformers 5).
Unknown keys are ignored so newer configs keep loading.

Mixture-of-experts checkpoints (`qwen3_vl_moe`: Qwen3-VL-30B-A3B, 235B-A22B, UI-Venus-1.5-30B-A3B)
add the expert settings to `text_config`; the expert count is `num_experts` in 4.57 files and
`num_local_experts` in transformers 5 files.
"""

import dataclasses
import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from .errors import ConfigError

SUPPORTED_MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe")
VISION_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_new", "gelu")  # vision.ACTIVATIONS
MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")


def _from_dict(cls, params: dict, where: str):
    names = inspect.signature(cls).parameters
    missing = [
        f.name for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        and f.name not in params
    ]
    if missing:
        raise ConfigError(f"{where} is missing required key(s): {', '.join(missing)}")
    return cls(**{k: v for k, v in params.items() if k in names})


@dataclass
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    hidden_act: str = "gelu_pytorch_tanh"
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: list = field(default_factory=list)
    rope_theta: float = 10000.0

    def __post_init__(self):
        if self.hidden_act not in VISION_ACTIVATIONS:
            raise ConfigError(f"vision_config: hidden_act {self.hidden_act!r} is not one of "
                              f"{', '.join(VISION_ACTIVATIONS)} (Qwen3-VL's is gelu_pytorch_tanh)")


@dataclass
class TextConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 5_000_000.0
    mrope_section: list = field(default_factory=lambda: [24, 20, 20])
    attention_bias: bool = False
    hidden_act: str = "silu"
    max_position_embeddings: int = 262144
    tie_word_embeddings: bool = False
    # Mixture of experts (qwen3_vl_moe); num_experts == 0 is the dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: list = field(default_factory=list)
    # transformers' Qwen3-VL-MoE always renormalises the top-k weights; every published config says
    # true. A config that says false gets what the flag means in Qwen3-MoE (no renormalisation).
    norm_topk_prob: bool = True

    def is_sparse_layer(self, index: int) -> bool:
        """Whether decoder layer `index` is a mixture-of-experts block (transformers' rule)."""
        return (self.num_experts > 0 and index not in self.mlp_only_layers
                and (index + 1) % self.decoder_sparse_step == 0)

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if sum(self.mrope_section) != self.head_dim // 2:
            raise ConfigError(
                f"text_config: mrope_section {self.mrope_section} must sum to head_dim/2 = {self.head_dim // 2}"
            )
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ConfigError(f"text_config: num_experts_per_tok {self.num_experts_per_tok} must be between 1 "
                                  f"and num_experts ({self.num_experts})")
            if self.moe_intermediate_size <= 0 or self.decoder_sparse_step < 1:
                raise ConfigError("text_config: moe_intermediate_size must be positive and decoder_sparse_step >= 1 "
                                  f"(got {self.moe_intermediate_size}, {self.decoder_sparse_step})")
            bad = [i for i in self.mlp_only_layers if not (isinstance(i, int) and 0 <= i < self.num_hidden_layers)]
            if bad:
                raise ConfigError(f"text_config: mlp_only_layers {bad} are not layer indexes below "
                                  f"num_hidden_layers ({self.num_hidden_layers})")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


def _moe_fields(text: dict, where: str):
    """Expert settings of a qwen3_vl_moe text_config, in either layout, checked for presence."""
    if "num_local_experts" in text:  # transformers 5's name for num_experts
        text["num_experts"] = text.pop("num_local_experts")
    missing = [k for k in MOE_KEYS if not isinstance(text.get(k), int) or isinstance(text.get(k), bool)]
    if missing:
        raise ConfigError(f"{where} text_config: a qwen3_vl_moe config needs integer {', '.join(missing)}")
    if text.get("mlp_only_layers") is None:
        text["mlp_only_layers"] = []
    text["mlp_only_layers"] = list(text["mlp_only_layers"])


@dataclass
class ModelConfig:
    text_config: TextConfig
    vision_config: VisionConfig
    model_type: str = "qwen3_vl"
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    tie_word_embeddings: bool = False
    torch_dtype: Optional[str] = None
    transformers_version: Optional[str] = None  # tells the expert layouts apart when shapes cannot
    quantization: Optional[dict] = None
    eos_token_ids: list = field(default_factory=list)  # from generation_config.json

    @classmethod
    def from_dict(cls, raw: dict, where: str = "config.json") -> "ModelConfig":
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"{where}: model_type {model_type!r} is not Qwen3-VL (expected one of {SUPPORTED_MODEL_TYPES}); "
                "this engine loads Qwen3-VL dense and mixture-of-experts checkpoints"
            )
        for key in ("text_config", "vision_config"):
            if not isinstance(raw.get(key), dict):
                raise ConfigError(f"{where} is missing required key: {key}")
        text = dict(raw["text_config"])
        # transformers 5 nests rope settings in rope_parameters; 4.57 has rope_theta + rope_scaling.
        rope = dict(text.get("rope_scaling") or {})
        rope.update(text.get("rope_parameters") or {})
        if "rope_theta" in rope:
            text["rope_theta"] = rope["rope_theta"]
        if "mrope_section" in rope:
            text["mrope_section"] = list(rope["mrope_section"])
        if rope.get("mrope_interleaved") is False:
            raise ConfigError(f"{where}: non-interleaved mRoPE is Qwen2.5-VL's layout, not Qwen3-VL's")
        if model_type == "qwen3_vl_moe":
            _moe_fields(text, where)
        else:  # a dense checkpoint: expert keys left over from elsewhere mean nothing here
            for key in (*MOE_KEYS, "num_local_experts", "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob"):
                text.pop(key, None)
        tie = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        text["tie_word_embeddings"] = bool(tie)

        vision = dict(raw["vision_config"])
        vrope = vision.get("rope_parameters") or {}
        if "rope_theta" in vrope:
            vision["rope_theta"] = vrope["rope_theta"]

        params = {k: v for k, v in raw.items() if k not in ("text_config", "vision_config")}
        params["tie_word_embeddings"] = bool(tie)
        params["torch_dtype"] = raw.get("dtype") or raw.get("torch_dtype") or text.get("dtype")
        params["quantization"] = raw.get("quantization") or raw.get("quantization_config")
        eos = raw.get("eos_token_ids", text.get("eos_token_id"))
        params["eos_token_ids"] = [eos] if isinstance(eos, int) else list(eos or [])
        params["text_config"] = _from_dict(TextConfig, text, f"{where} text_config")
        params["vision_config"] = _from_dict(VisionConfig, vision, f"{where} vision_config")
        return _from_dict(cls, params, where)

    @classmethod
    def from_pretrained(cls, path) -> "ModelConfig":
        path = Path(path) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path} not found: the model path must be a Qwen3-VL checkpoint folder")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON ({e})") from None
        config = cls.from_dict(raw, str(path))
        generation = path.parent / "generation_config.json"
        if generation.is_file():
            eos = json.loads(generation.read_text()).get("eos_token_id")
            if eos is not None:
                config.eos_token_ids = [eos] if isinstance(eos, int) else list(eos)
        return config
