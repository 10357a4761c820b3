"""The surfaces' drafting arguments (`draft_model=`, `num_draft_tokens=`, `prompt_lookup=`,
`drafter=` on generate, ChatSession, the CLI and the server) checked and turned into the one
drafter a request carries. Apart from engine/speculative.py, whose verification rule the engine's
batch imports, so that it need not import the draft model (which builds on the engine's caches)."""

from ..errors import InputError
from .draft_model import DraftModel
from .speculative import DEFAULT_DRAFT, MAX_DRAFT, MAX_PROMPT_LOOKUP, PromptLookup

NAMES = ("draft_model", "num_draft_tokens", "prompt_lookup", "drafter")  # the surfaces' arguments


def drafting(draft_model=None, num_draft_tokens=None, prompt_lookup=0, drafter=None) -> dict:
    """The surfaces' arguments (mlx-lm's draft_model / num_draft_tokens: a smaller checkpoint
    of the same tokenizer, loaded or a path, engine/draft_model.py; prompt_lookup: the longest
    n-gram PromptLookup matches, 0 off; drafter: any object with `propose`) → the Request's fields
    {drafter, num_draft_tokens} (drafter None: no speculation). One drafter per request."""
    if not (isinstance(prompt_lookup, int) and not isinstance(prompt_lookup, bool)
            and 0 <= prompt_lookup <= MAX_PROMPT_LOOKUP):
        raise InputError(f"prompt_lookup = {prompt_lookup!r} is not allowed; use an integer in "
                         f"[0, {MAX_PROMPT_LOOKUP}] (the longest n-gram matched; 0 = off)")
    if num_draft_tokens is not None and not (isinstance(num_draft_tokens, int) and not isinstance(num_draft_tokens, bool)
                                             and 0 <= num_draft_tokens <= MAX_DRAFT):
        raise InputError(f"num_draft_tokens = {num_draft_tokens!r} is not allowed; use an integer in [0, {MAX_DRAFT}]")
    if drafter is not None and not callable(getattr(drafter, "propose", None)):
        raise InputError("drafter must have a propose(token_ids, k) method")
    named = [n for n, v in (("draft_model", draft_model), ("prompt_lookup", prompt_lookup), ("drafter", drafter)) if v]
    if len(named) > 1:
        raise InputError(f"{' and '.join(named)} were both given; a request drafts from one of them")
    if draft_model is not None:
        drafter = DraftModel.of(draft_model)
    if drafter is None and prompt_lookup:
        drafter = PromptLookup(max_n=prompt_lookup)
    if drafter is None:
        return {}
    return {"drafter": drafter, "num_draft_tokens": DEFAULT_DRAFT if num_draft_tokens is None else num_draft_tokens}


def pop_drafting(kwargs: dict) -> dict:
    """drafting() of the surfaces' arguments found in `kwargs`, removed from it."""
    return drafting(**{k: kwargs.pop(k) for k in NAMES if k in kwargs})
