"""Qwen3-VL glue: embed tokens, encode images/videos, scatter the features into their placeholder
positions, compute mRoPE positions, run the decoder, project to the vocabulary.

Call signatures use transformers' argument names so the two can be compared side by side.
No state lives on the model: caches and rope deltas are passed in and returned.
"""

from dataclasses import dataclass
from typing import List, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .backend import MLX
from .config import ModelConfig
from .errors import InputError
from .language import TextModel, attention_mask_for
from .positions import get_rope_index, mm_token_type_ids_from
from .vision import VisionModel


@dataclass
class VisualFeatures:
    """Merged features for the LLM plus one DeepStack feature per tap, all (N_tokens, D)."""

    embeds: mx.array
    deepstack: List[mx.array]


@dataclass
class PreparedInputs:
    """Everything the decoder needs for a prompt, built once and sliceable into prefill chunks."""

    inputs_embeds: mx.array  # (B, L, D)
    position_ids: mx.array  # (3, B, L)
    rope_deltas: mx.array  # (B, 1)
    deepstack: List[mx.array]  # per tap (B, L, D), zero outside visual positions


def _scatter(embeds, ids, token_id, features):
    """Place features[k] at the k-th position where ids == token_id (row-major over the batch),
    with device ops only (no host sync)."""
    mask = (ids == token_id).reshape(-1)
    index = mx.maximum(mx.cumsum(mask.astype(mx.int32)) - 1, 0)
    flat = embeds.reshape(-1, embeds.shape[-1])
    placed = mx.where(mask[:, None], features[index].astype(flat.dtype), flat)
    return placed.reshape(embeds.shape)


class Qwen3VLForConditionalGeneration(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.visual = VisionModel(config.vision_config)
        self.language_model = TextModel(config.text_config)
        self.backend = MLX  # what runs the forward; load may install another (see backend.py)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.text_config.hidden_size, config.text_config.vocab_size, bias=False)

    @property
    def spatial_merge_size(self):
        return self.config.vision_config.spatial_merge_size

    # --- vision -------------------------------------------------------------------------------
    def get_image_features(self, pixel_values, image_grid_thw) -> VisualFeatures:
        merged, deepstack = self.visual(mx.array(pixel_values), image_grid_thw)
        return VisualFeatures(merged, deepstack)

    get_video_features = get_image_features

    # --- decoder ------------------------------------------------------------------------------
    def logits(self, hidden):
        if self.config.tie_word_embeddings:
            return self.language_model.embed_tokens.as_linear(hidden)
        return self.lm_head(hidden)

    def get_rope_index(self, input_ids, mm_token_type_ids=None, image_grid_thw=None, video_grid_thw=None,
                       attention_mask=None):
        if mm_token_type_ids is None:
            mm_token_type_ids = mm_token_type_ids_from(
                input_ids, self.config.image_token_id, self.config.video_token_id
            )
        pos, deltas = get_rope_index(
            input_ids, mm_token_type_ids, image_grid_thw, video_grid_thw, attention_mask, self.spatial_merge_size
        )
        return mx.array(pos), mx.array(deltas)

    def _check_placeholders(self, ids: np.ndarray, token_id: int, features: Optional[VisualFeatures], what: str):
        n_tokens = int((ids == token_id).sum())
        n_features = 0 if features is None else features.embeds.shape[0]
        if n_tokens != n_features:
            raise InputError(
                f"the prompt has {n_tokens} {what} placeholder tokens but the {what}s give {n_features} "
                f"features: expand each <|{what}_pad|> with the processor, and pass every {what} it saw"
            )

    def prepare_inputs(
        self,
        input_ids,
        attention_mask=None,
        pixel_values=None,
        image_grid_thw=None,
        pixel_values_videos=None,
        video_grid_thw=None,
        mm_token_type_ids=None,
        image_features: Optional[VisualFeatures] = None,
        video_features: Optional[VisualFeatures] = None,
        start: int = 0,
    ) -> PreparedInputs:
        """Embeddings, positions and DeepStack tensors of prompt positions [start, L).

        Positions always come from the whole prompt (they depend on every earlier image). With
        start > 0 (a cached prefix), the features passed must be those of the images/videos whose
        placeholders lie at or after `start`; they may be passed precomputed."""
        ids_np = np.asarray(input_ids)
        if ids_np.ndim == 1:
            ids_np = ids_np[None]
        if image_features is None and pixel_values is not None:
            image_features = self.get_image_features(pixel_values, image_grid_thw)
        if video_features is None and pixel_values_videos is not None:
            video_features = self.get_video_features(pixel_values_videos, video_grid_thw)
        suffix = ids_np[:, start:]
        self._check_placeholders(suffix, self.config.image_token_id, image_features, "image")
        self._check_placeholders(suffix, self.config.video_token_id, video_features, "video")

        ids = mx.array(suffix)
        embeds = self.language_model.embed_tokens(ids)
        n_taps = len(self.config.vision_config.deepstack_visual_indexes)
        deepstack = [mx.zeros_like(embeds) for _ in range(n_taps)] if (image_features or video_features) else []
        for token_id, feats in ((self.config.image_token_id, image_features), (self.config.video_token_id, video_features)):
            if feats is None:
                continue
            embeds = _scatter(embeds, ids, token_id, feats.embeds)
            deepstack = [_scatter(d, ids, token_id, f) for d, f in zip(deepstack, feats.deepstack)]

        position_ids, rope_deltas = self.get_rope_index(
            ids_np, mm_token_type_ids, image_grid_thw, video_grid_thw, attention_mask
        )
        return PreparedInputs(embeds, position_ids[:, :, start:], rope_deltas, deepstack)

    def decode_hidden(self, prepared: PreparedInputs, attention_mask=None, cache=None, start=0, end=None, last=None):
        """Run positions [start, end) of `prepared` through the decoder (one prefill chunk); the
        hidden states of its last `last` positions only, when given (TextModel's `last`)."""
        end = prepared.inputs_embeds.shape[1] if end is None else end
        embeds = prepared.inputs_embeds[:, start:end]
        positions = prepared.position_ids[:, :, start:end]
        deepstack = [d[:, start:end] for d in prepared.deepstack]
        offset = cache[0].size() if cache else 0
        # "causal" even for a one-token chunk (the same attention as no mask): a prefill chunk goes
        # through the layers, never the CPU path's decode stack, whose arithmetic differs, so a
        # position's numbers do not depend on where the chunks end.
        mask = self.make_mask(attention_mask, end - start, offset + end - start)
        return self.language_model(embeds, positions, "causal" if mask is None else mask, cache, deepstack, last)

    def make_cache(self):
        """One KV cache per decoder layer, of the type the installed backend reads."""
        return self.backend.make_cache(self)

    @staticmethod
    def make_mask(attention_mask, query_len: int, key_len: int):
        """None for a single query without padding, "causal" for an unpadded chunk, else boolean."""
        if attention_mask is None:
            return "causal" if query_len > 1 else None
        key_mask = mx.array(attention_mask)[:, :key_len]
        return attention_mask_for(key_mask, query_len)

    def __call__(self, input_ids, attention_mask=None, cache=None, position_ids=None, **media):
        """Full-prompt forward → logits (B, L, vocab); `media`: prepare_inputs' pixel, grid and
        token-type arguments, by name. With a non-empty `cache`, pass `position_ids` ((3, B, L), or
        (B,) first positions of a text-only chunk); see generate.py."""
        if cache is not None and cache[0].size() > 0:
            if position_ids is None:
                raise InputError("position_ids are required when continuing from a non-empty cache")
            ids = mx.array(np.asarray(input_ids))
            embeds = self.language_model.embed_tokens(ids)
            mask = self.make_mask(attention_mask, ids.shape[1], cache[0].size() + ids.shape[1])
            return self.logits(self.language_model(embeds, position_ids, mask, cache))
        prepared = self.prepare_inputs(input_ids, attention_mask, **media)
        return self.logits(self.decode_hidden(prepared, attention_mask, cache))
