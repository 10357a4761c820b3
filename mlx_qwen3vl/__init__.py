"""mlx_qwen3vl: exact, fast Qwen3-VL inference on MLX."""

from . import _blas  # noqa: F401  (must run before mlx.core is first imported)
from .weights import load_model

__version__ = "0.1.0"


def load(path_or_hub_id, dtype=None):
    """Load a checkpoint → (model, processor)."""
    from .processor import Processor

    model = load_model(path_or_hub_id, dtype)
    return model, Processor.from_pretrained(path_or_hub_id)
