"""The runtime every entry point shares: continuous batching of requests over one model.

    from mlx_qwen3vl import load, Engine, Request, SamplingParams
    from mlx_qwen3vl.generate import encode_prompt

    engine = Engine(model, processor, prefill_budget=256, prefix_cache_bytes=1 << 30)
    rid = engine.add(Request(encode_prompt(processor, "Where is the search box?", images=[shot]),
                             SamplingParams(max_tokens=64)))
    while engine.busy:
        for event in engine.step():   # Token / Done / Failed, by request id
            ...

    core.py     Engine, Request, the events; scheduling, admission, time limits
    batch.py    the rows decoded together and their one left-padded KV cache
    prefill.py  a prompt's prefill as work items with FLOP costs (vision split below blocks)
    step.py     decode_step and sample, the two small functions of one decode token
    answer.py   tokens → answer text (EOS, stop strings, hold-back)
    caches.py   the media-aware prefix cache (a radix index) and the vision-feature cache
    speculative.py  drafters and the rule that keeps a row's drafts (speculative decoding)
    draft_model.py  a smaller checkpoint as a drafter: its own prefill, caches and prefix cache

generate / stream_generate / batch_generate and ChatSession run on an Engine of their own; the
server runs one on its model thread (server/model_thread.py), and under mlx.launch every rank replays
rank 0's calls to it (server/replica.py).
"""

from .answer import AnswerText, eos_token_ids, token_bytes  # noqa: F401
from .caches import FeatureCache, PrefixCache  # noqa: F401
from .core import Done, Engine, Failed, Request, StepRecord, Token, fit_to_context  # noqa: F401
from .prefill import PrefillJob, prefill  # noqa: F401
from .step import decode_step, sample  # noqa: F401

__all__ = ["Engine", "Request", "Token", "Done", "Failed", "StepRecord", "PrefixCache", "FeatureCache",
           "fit_to_context"]
