"""The Linux CPU path: where MLX's CPU backend is slow, float32 work runs in numpy and C.

    kernels  numpy linears, attention, activations, log-softmax (MLX arrays in and out)
    decode   one decode token through the whole decoder stack (numpy GEMVs + _decode.c or its
             numpy twin), and the KV cache it writes
    layers   the model's modules in their CPU versions, and `install`, which swaps them in
    threads  how many BLAS threads the matmuls use: every core while the machine is quiet, fewer
             while other processes run (MLX_QWEN3VL_BLAS_THREADS / --blas-threads fix it)

backend.install imports and puts this path on a float32 model at load on the CPU; `import
mlx_qwen3vl` loads none of it, and nothing in the model files refers to it. (The optimized BLAS
that MLX's own matmuls use is the package's blas.py, loaded before mlx.core.)
"""

from .layers import CPUBackend, install  # noqa: F401
