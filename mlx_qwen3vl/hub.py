"""Model folders from a local path or the Hugging Face hub."""

import os
import re
from pathlib import Path

import json

from .errors import ConfigError, ModelNotFoundError

# Everything a checkpoint needs besides its weights: tokenizer, chat template, processor and
# generation configs (the converter copies exactly these next to the weights it writes).
SIDECAR_FILES = [
    "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
    "added_tokens.json", "tokenizer.model", "*.tiktoken", "chat_template.jinja", "chat_template.json",
    "preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json",
    "generation_config.json", "LICENSE*", "NOTICE*",
]
# What a download fetches: never the repo's other files (READMEs, images, original checkpoints).
HUB_FILES = SIDECAR_FILES + ["config.json", "*.safetensors", "model.safetensors.index.json"]
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_model_path(path_or_hub_id, flag: str = "--model") -> Path:
    """A local folder as it is; otherwise a hub repo id fetched with snapshot_download."""
    path = Path(path_or_hub_id).expanduser()
    if path.is_dir():
        return path
    name = str(path_or_hub_id)
    if path.exists():
        raise ModelNotFoundError(f"{flag} {name} is a file; pass the checkpoint's folder")
    if not HUB_ID.match(name):
        raise ModelNotFoundError(f"{flag} {name!r} is neither a local folder nor a Hugging Face repo id (owner/name)")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, allow_patterns=HUB_FILES))
    except Exception as e:  # offline, unknown repo, gated repo, network error: all the same to a user
        offline = os.environ.get("HF_HUB_OFFLINE") not in (None, "", "0")
        reason = "HF_HUB_OFFLINE is set" if offline else f"hub unreachable or no such repo: {type(e).__name__}"
        raise ModelNotFoundError(
            f"could not fetch {name!r} from the Hugging Face hub ({reason}) and no such local folder exists: "
            f"check the id and your connection, or pass {flag} /path/to/a/downloaded/checkpoint"
        ) from None


def check_tokenizer_files(path: Path):
    """A checkpoint folder must carry a readable tokenizer: `tokenizer.json` (what every Qwen3-VL
    release ships), or the `vocab.json` + `merges.txt` pair transformers can build one from.
    Without this check transformers quietly builds a tokenizer that maps a prompt to one token."""
    path = Path(path)
    if not (path / "config.json").is_file():
        return  # not a checkpoint at all: loading the model says so, naming config.json
    tokenizer = path / "tokenizer.json"
    if not tokenizer.is_file():
        if (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
            return
        raise ConfigError(f"{path} has no tokenizer.json (nor vocab.json + merges.txt): copy the tokenizer files "
                          "from the original checkpoint into it")
    try:
        with tokenizer.open(encoding="utf-8") as f:
            ok = isinstance(json.load(f).get("model"), dict)
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        ok = False
    if not ok:
        raise ConfigError(f"{tokenizer} is truncated or not a tokenizer file: copy it again from the original "
                          "checkpoint")
