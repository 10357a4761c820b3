"""The draft-model drafter: a smaller Qwen3-VL checkpoint with the same tokenizer proposing a
request's next tokens for speculative decoding (engine/speculative.py holds the rule that keeps
them).

`DraftModel` is what a request names (`Request.drafter`); the engine makes one `DraftRow` of it
per request: the draft model's own prefill of the same prompt, images and videos (a PrefillJob
spent inside the engine's prefill budget, after the target's: `WithDraft`), its own KV caches of
the request's kind (its KVSettings fitted to the draft's head dimension), and its own prefix cache,
so a turn that resends the history prefills only what is new for the draft too. Each `propose`
first trims the draft's cache (the cache type's `trim_to`) to what it shares with the tokens so
far, which drops the drafts the target rejected, feeds the rest, and runs k steps: greedy drafts,
or for a sampled request drafts drawn from the draft's own distribution (the request's filters and
temperature), whose log-probabilities `q` the speculative sampling rule reads.
"""

from typing import List, Optional

import mlx.core as mx

from ..errors import ConfigError
from ..kv_settings import FLOAT, quantize_if_due, resolve
from ..loading import load
from .caches import PrefixCache, _common, pipeline_scale
from .prefill import Costs, PrefillJob
from .step import verify_step

# What must agree for the draft to read the target's prompt ids as its own (same tokens for text,
# same placeholder counts for every image and video).
_SAME = (("vocab_size", lambda c: c.text_config.vocab_size), ("image_token_id", lambda c: c.image_token_id),
         ("video_token_id", lambda c: c.video_token_id),
         ("vision patch size", lambda c: c.vision_config.patch_size),
         ("spatial_merge_size", lambda c: c.vision_config.spatial_merge_size),
         ("temporal_patch_size", lambda c: c.vision_config.temporal_patch_size))


class DraftModel:
    """A smaller checkpoint of the same family proposing drafts (`draft_model=` of every entry
    point): `model` loaded (e.g. by `load`), `tokenizer` its tokenizer when known (checked against
    the target's), `prefix_cache_bytes` the draft caches kept for later requests."""

    def __init__(self, model, tokenizer=None, prefix_cache_bytes: int = 1 << 30):
        self.model, self.tokenizer = model, tokenizer
        self.prefix = PrefixCache(prefix_cache_bytes, pipeline_scale(model))
        self.costs = Costs(model.config)
        self._checked = set()

    @classmethod
    def of(cls, draft_model) -> "DraftModel":
        """`draft_model=` as the surfaces take it: a DraftModel, a loaded model, (model,
        processor), or a checkpoint folder / hub id (loaded here)."""
        if isinstance(draft_model, DraftModel):
            return draft_model
        if isinstance(draft_model, tuple) and len(draft_model) == 2:
            model, processor = draft_model
            return cls(model, getattr(processor, "tokenizer", processor))
        if isinstance(draft_model, (str, bytes)) or hasattr(draft_model, "__fspath__"):
            model, processor = load(draft_model)
            return cls(model, processor.tokenizer)
        if not hasattr(draft_model, "language_model") or not hasattr(draft_model, "make_cache"):
            raise ConfigError(f"draft_model must be a loaded Qwen3-VL model or a checkpoint path, "
                              f"not {type(draft_model).__name__}")
        return cls(draft_model)  # a new prefix cache: pass a DraftModel to keep one across calls

    def check(self, target, tokenizer=None):
        """ConfigError, one line, unless the draft reads the target's prompts as its own: the same
        vocabulary, media token ids and patch sizes, and (when both are known) the same tokenizer."""
        if id(target) in self._checked:
            return
        a, b = self.model.config, target.config
        for name, get in _SAME:
            if get(a) != get(b):
                raise ConfigError(f"the draft model's {name} ({get(a)}) is not the model's ({get(b)}): a draft model "
                                  "must share the model's tokenizer and vision patches")
        if self.tokenizer is not None and tokenizer is not None and self.tokenizer.get_vocab() != tokenizer.get_vocab():
            raise ConfigError("the draft model's tokenizer is not the model's: a draft model must share the model's "
                              "tokenizer")
        self._checked.add(id(target))

    def start(self, request, kv, *, item_budget=None, prefill_step_size=2048) -> "DraftRow":
        """One request's draft state: its cache (from the draft's prefix cache when it holds a
        prefix of the prompt) and the prefill of the rest."""
        kv = resolve(self.model, kv) if kv is not None and kv.quantized else FLOAT
        eid, start = self.prefix.lookup(request.inputs, kv) if self.prefix.max_bytes else (None, 0)
        if start:
            cache = self.prefix.take(eid, start)
        else:
            self.prefix.misses += bool(self.prefix.max_bytes)
            cache = self.model.make_cache()
        job = PrefillJob(self.model, request.inputs, cache, start=start, item_budget=item_budget,
                         prefill_step_size=prefill_step_size, costs=self.costs, kv=kv, head=False)
        return DraftRow(self, job, list(request.tokens), request.media, kv)


class DraftRow:
    """One request's drafts from a DraftModel (the engine's Row.drafter): `propose` as every
    drafter, and `q`, the log-probabilities (V,) each of the last proposal's drafts were drawn
    with (None: greedy drafts, which the rule treats as one-hot)."""

    def __init__(self, owner: DraftModel, job: PrefillJob, prompt: List[int], media, kv):
        self.owner, self.job, self.kv = owner, job, kv
        self.media = media
        self.held = prompt  # the tokens its cache holds, in order
        self.delta = None  # its rope delta: a text position is cache length + delta
        self.sampler = None
        self.q: Optional[list] = None
        self.log_softmax = None

    @property
    def cache(self):
        return self.job.cache

    def begin(self, sampler, log_softmax):
        """After the prefill: the request's sampler (a sampled request's drafts are drawn with its
        filters, temperature and random stream)."""
        _, position = self.job.result()
        self.delta = position - len(self.held)
        self.sampler = None if sampler.greedy else sampler
        self.log_softmax = log_softmax

    def propose(self, token_ids, k):
        ids = [int(t) for t in token_ids]
        n = min(_common(tuple(self.held), tuple(ids)), len(ids) - 1)  # at least the last token is fed
        if n < len(self.held):
            for c in self.cache:
                c.trim_to(n)  # the rejected drafts (and anything past what the tokens share) go
        x = mx.array([ids[n:]])
        position = self.delta + n
        model, drafts, qs = self.owner.model, [], []
        for _ in range(k):
            logits = verify_step(model, x, self.cache, position)[:, -1]
            quantize_if_due(self.cache, self.kv)
            position = position + x.shape[1]
            lp = self.log_softmax(logits)
            if self.sampler is None:
                t = mx.argmax(lp, axis=-1)
            else:
                scaled = self.sampler.scaled(lp)
                t = mx.random.categorical(scaled, key=self.sampler.next_key())
                qs.append((scaled - mx.logsumexp(scaled, axis=-1, keepdims=True))[0])
            drafts.append(t)
            x = t[None]
        mx.eval(drafts, qs)
        drafts = [int(t.item()) for t in drafts]
        self.held = ids + drafts[:-1]
        self.q = qs or None
        return drafts

    def close(self, tokens):
        """The request ended holding `tokens` (prompt and answer but its last): the draft cache's
        part that holds them goes to the draft's prefix cache."""
        n = _common(tuple(self.held), tuple(int(t) for t in tokens))
        cache = self.cache
        if self.owner.prefix.max_bytes and n and cache and cache[0].size() >= n:
            for c in cache:
                c.trim_to(n)
            self.owner.prefix.insert(self.held[:n], self.media, cache, self.kv)


class WithDraft:
    """A request's prefill and then its draft model's, as one job for the engine's scheduler:
    `advance` spends one budget of FLOPs on both (the target's items first), `cache` / `result`
    are the target's."""

    def __init__(self, target: PrefillJob, draft: DraftRow):
        self.target, self.draft = target, draft

    @property
    def cache(self):
        return self.target.cache

    @property
    def done(self) -> bool:
        return self.target.done and self.draft.job.done

    @property
    def spent(self) -> float:
        return self.target.spent + self.draft.job.spent

    def result(self):
        return self.target.result()

    def advance(self, budget=None, *, force_first=True, evaluate=True) -> float:
        spent = 0.0
        if not self.target.done:
            spent = self.target.advance(budget, force_first=force_first, evaluate=evaluate)
            if not self.target.done:
                return spent
        left = None if budget is None else budget - spent
        if left is None or left > 0 or (force_first and spent == 0):
            spent += self.draft.job.advance(left, force_first=force_first and spent == 0, evaluate=evaluate)
        return spent
