"""The mixture-of-experts block in numpy: the CPU path's version of moe.SparseMoeBlock.

MLX's CPU `gather_mm` runs each (token, expert) pair as its own small product: a decode token's
experts stream well below a GEMV's bandwidth, and a prefill chunk re-reads an expert's weights
once per token that chose it (benchmarks/README.md, "Mixture of experts" and "Measurements behind
choices in the code"). Here tokens are grouped by expert: each selected expert's weights are read
once, by one GEMM over the tokens that chose it (one GEMV per expert for a decode token), and the
experts nobody chose are never touched. The router is the same float32 softmax, top-k and
renormalisation.
"""

import numpy as np

from .kernels import matmul_t, np_silu_mul


def route(x, gate_weight, top_k: int, normalize: bool):
    """(indices (N, k), weights (N, k)) of each row's top-k experts: moe.route in numpy."""
    probs = matmul_t(x, gate_weight)
    probs -= probs.max(-1, keepdims=True)
    np.exp(probs, out=probs)
    probs /= probs.sum(-1, keepdims=True)
    inds = np.argpartition(-probs, top_k - 1, axis=-1)[:, :top_k]
    weights = np.take_along_axis(probs, inds, -1)
    if normalize:
        weights /= weights.sum(-1, keepdims=True)
    return inds, weights


def experts_into(x, block, out):
    """out (N, D) = the block's output for x (N, D) float32 (moe.SparseMoeBlock.__call__); `block`
    read as dict items, float32 unquantized experts."""
    switch = block["switch_mlp"]
    gate, up, down = (np.asarray(switch[name]["weight"]) for name in ("gate_proj", "up_proj", "down_proj"))
    inds, weights = route(x, np.asarray(block["gate"]["weight"]), block.top_k, block.norm_topk_prob)
    k = inds.shape[1]
    flat, weights = inds.reshape(-1), weights.reshape(-1)
    order = np.argsort(flat, kind="stable")  # (token, slot) pairs grouped by expert
    out[...] = 0
    for pairs in np.split(order, np.flatnonzero(np.diff(flat[order])) + 1):
        e, rows = flat[pairs[0]], pairs // k  # a token picks an expert once: rows are distinct
        xs = x[rows]
        h = np_silu_mul(matmul_t(xs, gate[e]), matmul_t(xs, up[e]))
        y = matmul_t(h, down[e])
        y *= weights[pairs, None]
        out[rows] += y
    return out
