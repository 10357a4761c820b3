"""load(): a checkpoint folder or hub id → (model, processor), sharded under `mlx.launch`. Its own
module so that the engine (a draft model given as a path) loads without importing the package."""

from .hub import check_tokenizer_files, resolve_model_path
from .processor import Processor
from .weights import load_model


def load(path_or_hub_id, dtype=None, backend=None, parallel="tensor"):
    """A local checkpoint folder or a hub repo id → (model, processor). dtype defaults to float32
    on the CPU backend and to the checkpoint's dtype on a GPU; backend "mlx", "cpu" or None
    (automatic, see backend.py). Under `mlx.launch -n N`, parallel "tensor" splits every layer
    over the N ranks, "pipeline" splits the layers (see distributed.py, pipeline.py)."""
    path = resolve_model_path(path_or_hub_id, flag="load()'s path")
    check_tokenizer_files(path)  # before the weights: a broken folder fails fast, in one line
    from . import distributed

    distributed.check_parallel(parallel)
    group = distributed.world()  # under `mlx.launch -n N`: split the model over the N ranks
    if group is not None:
        return distributed.load_sharded(path, group, dtype, backend, parallel=parallel)
    return load_model(path, dtype, backend), Processor.from_pretrained(path)
