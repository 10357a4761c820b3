"""Model folders from a local path or the Hugging Face hub."""

import os
from pathlib import Path

from .errors import ModelNotFoundError

# Weights, configs, tokenizer and templates; never the repo's other files.
ALLOW_PATTERNS = ["*.safetensors", "*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken"]


def resolve_model_path(path_or_hub_id) -> Path:
    """A local folder as it is; otherwise a hub repo id fetched with snapshot_download."""
    path = Path(path_or_hub_id).expanduser()
    if path.is_dir():
        return path
    name = str(path_or_hub_id)
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise ModelNotFoundError(f"model {name!r} is neither a local folder nor a Hugging Face repo id (owner/name)")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, allow_patterns=ALLOW_PATTERNS))
    except Exception as e:  # offline, unknown repo, gated repo, network error: all the same to a user
        offline = os.environ.get("HF_HUB_OFFLINE") not in (None, "", "0")
        reason = "HF_HUB_OFFLINE is set" if offline else f"hub unreachable or no such repo: {type(e).__name__}"
        raise ModelNotFoundError(
            f"could not fetch {name!r} from the Hugging Face hub ({reason}) and no such local folder exists: "
            "check the id and your connection, or pass --model /path/to/a/downloaded/checkpoint"
        ) from None
