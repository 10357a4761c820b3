"""Which backend runs a model's forward, as the token loop sees it.

The token loop (generate.py) asks `backend_of(model)` for the two things it does differently per
backend: whether the forward is eager (it evaluates as it goes, so the next token is computed after
this one is handed out) and the log-softmax of the sampler. A backend is installed on the model
once, at load (`model.backend`); a model built by hand runs the plain MLX graph.
"""

import mlx.core as mx


class MLXBackend:
    """The plain MLX graph: lazy, so the next decode step is queued before a token is handed out."""

    name = "mlx"
    eager = False

    @staticmethod
    def log_softmax(logits):
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    def describe(self) -> str:
        return f"mlx ({mx.default_device()})"


MLX = MLXBackend()


def backend_of(model):
    backend = getattr(model, "backend", None)
    if backend is not None:
        return backend
    # Transitional: until load installs the CPU path, it is chosen by device and environment.
    from . import cpu_kernels

    return cpu_kernels.CPU_BACKEND if cpu_kernels.cpu_kernels_enabled() else MLX
