"""mlx_qwen3vl: exact, fast Qwen3-VL inference on MLX.

    from mlx_qwen3vl import load, generate
    model, processor = load("Qwen/Qwen3-VL-2B-Instruct")
    print(generate(model, processor, "Describe this image.", images=["examples/screenshot.png"]).text)
"""

from . import blas  # noqa: F401  (loads an optimized BLAS, so it must run before mlx.core is imported)

try:
    import mlx.core  # noqa: F401, E402
except ImportError as e:  # Linux: the `mlx` wheel alone has no backend library (mlx-cpu or mlx-cuda-13 adds it)
    if "libmlx" not in str(e):
        raise
    raise ImportError("MLX is installed without a backend: pip install 'mlx-qwen3vl[cpu]' (the CPU) or "
                      "'mlx-qwen3vl[cuda]' (an NVIDIA GPU); from a checkout: pip install -e '.[cpu]'") from None
import os

# Only transformers' tokenizer and chat template are used, never torch: its "PyTorch was not
# found" advisory (printed on import) is noise on every run. mlx-lm sets the same.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from .errors import (ConfigError, ContextLengthError, InputError, ModelNotFoundError, Qwen3VLError,  # noqa: E402
                     WeightsError)
from .engine import Done, Engine, Failed, Request, Token  # noqa: E402
from .generate import GenerationResponse, GenerationResult, batch_generate, generate, stream_generate  # noqa: E402
from .chat_session import ChatSession  # noqa: E402
from .prompt_cache import PromptCache  # noqa: E402
from .sampling import SamplingParams  # noqa: E402
from .hub import check_tokenizer_files, resolve_model_path  # noqa: E402, F401  (public names)
from .processor import Processor  # noqa: E402
from .weights import load_model  # noqa: E402
from .loading import load  # noqa: E402

__version__ = "0.1.0"
__all__ = ["load", "generate", "stream_generate", "batch_generate", "ChatSession", "PromptCache",
           "SamplingParams", "GenerationResult", "GenerationResponse", "Processor", "load_model",
           "Qwen3VLError", "InputError", "ConfigError", "WeightsError", "ModelNotFoundError", "ContextLengthError",
           "Engine", "Request", "Token", "Done", "Failed"]
