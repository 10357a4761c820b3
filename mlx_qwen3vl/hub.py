"""Model folders from a local path or the Hugging Face hub."""

import json
import os
import re
from pathlib import Path

from huggingface_hub import get_hf_file_metadata, hf_hub_url, snapshot_download
from huggingface_hub.errors import HfHubHTTPError

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
    try:
        return Path(hub_fetch(name, lambda **kw: snapshot_download(name, allow_patterns=HUB_FILES, **kw)))
    except HubUnavailable as e:
        raise ModelNotFoundError(
            f"could not fetch {name!r} from the Hugging Face hub ({e}) and no such local folder exists: "
            f"check the id and your connection, or pass {flag} /path/to/a/downloaded/checkpoint"
        ) from None


class HubUnavailable(Exception):
    """Why the hub could not give a repo's files (offline, unreachable, no such repo, gated)."""


def hub_fetch(repo_id, download):
    """download() (a huggingface_hub call taking local_files_only=), failing fast when offline.

    huggingface_hub retries a connection that fails five times, with back-off (~25 s and a dozen
    warning lines); one HEAD of the repo's config.json, without retries, says first whether the hub
    answers. When it does not, the local cache serves, as with HF_HUB_OFFLINE=1."""
    if os.environ.get("HF_HUB_OFFLINE") not in (None, "", "0"):
        try:
            return download()
        except Exception:  # noqa: BLE001 - not in the cache
            raise HubUnavailable("HF_HUB_OFFLINE is set") from None
    try:
        get_hf_file_metadata(hf_hub_url(repo_id, "config.json"), timeout=10)
    except HfHubHTTPError as e:  # the hub answered: no such repo, gated, or no config.json
        status = e.response.status_code if e.response is not None else "?"
        raise HubUnavailable(f"no such repo, or it needs a login (HTTP {status})") from None
    except Exception as e:  # noqa: BLE001 - no answer: offline, DNS, refused, timed out
        try:
            return download(local_files_only=True)
        except Exception:  # noqa: BLE001
            raise HubUnavailable(f"hub unreachable: {type(e).__name__}, and not in the local cache") from None
    try:
        return download()
    except Exception as e:  # noqa: BLE001 - it went away meanwhile, or a file of the repo is missing
        raise HubUnavailable(f"the download failed: {type(e).__name__}") from None


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
