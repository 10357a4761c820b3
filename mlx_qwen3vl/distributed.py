"""One Qwen3-VL across several processes or machines, on MLX's own distributed runtime.

    mlx.launch -n 2 --backend ring -- python -m mlx_qwen3vl --model ... --image shot.png
    mlx.launch --hostfile hosts.json --backend ring -- python -m mlx_qwen3vl --model ...

`load` calls `load_sharded` when the process belongs to a group of more than one rank
(`mx.distributed.init()`, set up by `mlx.launch`), so the CLI, `generate`, `stream_generate`,
`batch_generate` and `ChatSession` run unchanged on every rank:

- Tensor parallel decoder (Megatron style, as mlx-lm's `Model.shard`): q/k/v/gate/up split by output
  rows ("all-to-sharded"), o/down by input columns ("sharded-to-all", one `all_sum` each), so every
  rank holds 1/N of each layer and of the KV cache, and attention heads are divided. When there are
  fewer KV heads than ranks, each rank keeps the KV head its query heads read.
- Embedding and output head split by vocabulary: a lookup is summed over ranks (each id lives on one
  rank), the logits are gathered. The tied 151936-row table is ~15% of a 2B model.
- The vision tower is replicated by default (VISION_DEFAULT: no collectives inside it, and the
  memory target holds without splitting it; benchmarks/README.md says what was measured), or
  split by heads like the decoder (`vision="heads"`, two `all_sum`s per block). Patch embedding, mergers,
  norms, DeepStack and mRoPE are unchanged: every rank computes the same positions and features.
- Sharded models run the plain MLX graph: `model.backend` is the MLX backend, never the CPU fast
  path (its fused decode step reads whole weight matrices and knows no collectives).
- Only rank 0 reads images and videos: the processor's call runs there and its arrays (or its error)
  are broadcast, so other ranks need the checkpoint but not the media. Ranks then compute the
  same logits (collectives give every rank identical sums), and the random seed is made equal at
  load, so sampled tokens agree without a per-token exchange.
- Loading: each rank reads only its slices from the safetensors files (sharded_load.py: the surgery runs
  on placeholders, then each kept parameter's byte ranges are read), and the ranks first compare a
  fingerprint of config.json and the safetensors headers, so different checkpoints on different
  machines fail at once.

- Ranks on one machine (same host name) split its cores at load: a rank waiting in a collective
  spins on its core, so ranks that each use every core slow each other down (benchmarks/README.md,
  "Several ranks").

- MoE layers (moe.py): the router replicated, every expert's intermediate dimension split (as
  mlx-lm's Qwen3-MoE `shard`), one `all_sum` per layer.

- `parallel="pipeline"` (CLI `--parallel pipeline`) splits the decoder's layers across the ranks
  instead (pipeline.py): for models whose ranks cannot each hold 1/N of every layer's shapes
  (heads or experts that do not divide), or links too slow for two all_sums per layer.
"""

import hashlib
import io
import json
import os
import struct
import sys
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.nn.layers.distributed import shard_inplace, shard_linear
from mlx.utils import tree_flatten, tree_unflatten

from .backend import MLXBackend
from . import errors
from .errors import ConfigError, Qwen3VLError, WeightsError

VISION_MODES = ("replicate", "heads")
PARALLEL_MODES = ("tensor", "pipeline")
VISION_DEFAULT = "replicate"  # see benchmarks/README.md ("Several ranks")


def world() -> Optional[mx.distributed.Group]:
    """The launcher's group when this process is one of several ranks, else None."""
    group = mx.distributed.init()
    return group if group.size() > 1 else None


def is_sharded(model) -> bool:
    return getattr(model, "group", None) is not None


# ---------------------------------------------------------------------------------------------
# Collectives for host data
# ---------------------------------------------------------------------------------------------
def _drain():
    """Finish what other streams still have queued before a host collective: a decode step queued
    ahead by the token loop (async_eval) holds collectives too, and collectives queued on two streams
    can pair up in a different order on each rank."""
    gen = sys.modules.get("mlx_lm.generate")
    if gen is not None:
        mx.synchronize(gen.generation_stream)
    mx.synchronize()


def _broadcast_bytes(data: Optional[bytes], group) -> bytes:
    """Rank 0's bytes on every rank (all_sum with zeros elsewhere: exact for any byte value)."""
    _drain()
    rank0 = group.rank() == 0
    size = mx.distributed.all_sum(mx.array([len(data) if rank0 else 0], dtype=mx.int64), group=group, stream=mx.cpu)
    n = int(size.item())
    buf = np.frombuffer(data, dtype=np.uint8) if rank0 else np.zeros(n, dtype=np.uint8)
    return bytes(np.array(mx.distributed.all_sum(mx.array(buf), group=group, stream=mx.cpu)))


def _broadcast_int(value: int, group) -> int:
    _drain()
    mine = value if group.rank() == 0 else 0
    return int(mx.distributed.all_sum(mx.array([mine], dtype=mx.int64), group=group, stream=mx.cpu).item())


def sync_random_seed(group, seed: Optional[int] = None):
    """Seed every rank's generator with rank 0's seed: identical logits then sample identical tokens."""
    if seed is None:
        seed = int.from_bytes(os.urandom(4), "little")
    mx.random.seed(_broadcast_int(seed, group))


# ---------------------------------------------------------------------------------------------
# Checkpoint agreement
# ---------------------------------------------------------------------------------------------
def checkpoint_fingerprint(path) -> bytes:
    """sha256 of config.json and of every safetensors header (names, dtypes, shapes, offsets):
    cheap to compute on a 400 GB folder, and different for any other checkpoint or conversion."""
    from .weights import weight_files

    path = Path(path)
    digest = hashlib.sha256()
    digest.update(json.dumps(json.loads((path / "config.json").read_text()), sort_keys=True).encode())
    files, _ = weight_files(path)
    for f in files:
        with open(f, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise WeightsError(f"{f} is truncated (no safetensors header); re-download or re-convert it")
            (n,) = struct.unpack("<Q", head)
            digest.update(f.name.encode() + head + fh.read(min(n, 100 << 20)))
    return digest.digest()


def check_same_checkpoint(path, group):
    """Raise on every rank unless every rank's folder has the same fingerprint. A rank that cannot
    read its folder raises its own error; the others say which rank failed (nobody waits forever)."""
    error = None
    try:
        mine = np.frombuffer(checkpoint_fingerprint(path), dtype=np.uint8)
        row = np.concatenate([[1], mine]).astype(np.uint8)
    except (OSError, ValueError, Qwen3VLError) as e:
        error, row = e, np.zeros(33, dtype=np.uint8)
    rows = np.array(mx.distributed.all_gather(mx.array(row)[None], group=group, stream=mx.cpu))
    if error is not None:
        if isinstance(error, Qwen3VLError):
            raise error
        raise WeightsError(f"{path}: cannot read the checkpoint on rank {group.rank()} ({error})") from None
    failed = [r for r in range(group.size()) if rows[r, 0] == 0]
    if failed:
        raise WeightsError(f"rank(s) {failed} could not read the checkpoint {path} (their own errors say why)")
    differ = [r for r in range(group.size()) if not np.array_equal(rows[r], rows[0])]
    if differ:
        raise WeightsError(
            f"rank(s) {differ} have a different checkpoint at {path} than rank 0 (config.json or weight "
            "files differ): copy the same folder to every machine"
        )


def ranks_on_this_machine(group) -> int:
    """How many ranks of `group` (this one included) run on this machine, by host name."""
    import socket

    mine = np.frombuffer(hashlib.sha256(socket.gethostname().encode()).digest()[:8], dtype=np.uint8)
    rows = np.array(mx.distributed.all_gather(mx.array(mine)[None], group=group, stream=mx.cpu))
    return int(sum(np.array_equal(row, mine) for row in rows))


def share_this_machine(group):
    """Ranks on one machine share its cores: each one's automatic BLAS thread count is its share."""
    from .cpu import threads

    threads.share_cores(ranks_on_this_machine(group))


# ---------------------------------------------------------------------------------------------
# Sharding
# ---------------------------------------------------------------------------------------------
def _undivided(config, n: int, vision: str) -> list:
    """The dimensions tensor parallelism would have to split over n ranks but cannot."""
    t, v = config.text_config, config.vision_config
    problems = []
    if t.num_attention_heads % n:
        problems.append(f"num_attention_heads={t.num_attention_heads}")
    if t.num_key_value_heads % n and n % t.num_key_value_heads:
        problems.append(f"num_key_value_heads={t.num_key_value_heads} (nor does {n} divide by it)")
    if t.intermediate_size % n:
        problems.append(f"intermediate_size={t.intermediate_size}")
    moe_size = getattr(t, "moe_intermediate_size", None) if getattr(t, "num_experts", 0) else None
    if moe_size and moe_size % n:
        problems.append(f"moe_intermediate_size={moe_size}")
    if vision == "heads":
        if v.num_heads % n:
            problems.append(f"vision num_heads={v.num_heads}")
        if v.intermediate_size % n:
            problems.append(f"vision intermediate_size={v.intermediate_size}")
    return problems


def check_shardable(config, n: int, vision: str = VISION_DEFAULT):
    """One ConfigError naming every dimension that cannot be split over n ranks, and what works
    instead: the layers split (--parallel pipeline), or rank counts that do divide them."""
    if vision not in VISION_MODES:
        raise ConfigError(f"vision sharding {vision!r} is not one of {', '.join(VISION_MODES)}")
    t, v = config.text_config, config.vision_config
    moe_size = getattr(t, "moe_intermediate_size", None) if getattr(t, "num_experts", 0) else None
    problems = _undivided(config, n, vision)
    if problems:
        others = [k for k in range(2, 9) if k != n and not _undivided(config, k, vision)]
        counts = f", or launch {' or '.join(map(str, others))} ranks (mlx.launch -n {others[0]})" if others else ""
        raise ConfigError(
            f"cannot shard this model over {n} ranks: {', '.join(problems)} do not divide by {n}, as tensor "
            f"parallelism needs; split its layers over the ranks instead with --parallel pipeline (load(..., "
            f"parallel=\"pipeline\")){counts}"
        )
    # A quantized layer split by input columns keeps whole quantization groups on each rank.
    q = config.quantization if isinstance(getattr(config, "quantization", None), dict) else {}
    sizes = {int(v["group_size"]) for v in [q, *q.values()] if isinstance(v, dict) and "group_size" in v}
    columns = {"o_proj input": t.num_attention_heads * t.head_dim, "intermediate_size": t.intermediate_size}
    if moe_size:
        columns["moe_intermediate_size"] = moe_size
    if vision == "heads":
        columns.update({"vision hidden_size": v.hidden_size, "vision intermediate_size": v.intermediate_size})
    split = [f"{name} {size}/{n}" for name, size in columns.items() for g in sizes if (size // n) % g]
    if split:
        raise ConfigError(
            f"cannot shard this quantized model over {n} ranks: {', '.join(sorted(set(split)))} is not a multiple "
            f"of the quantization group size ({', '.join(map(str, sorted(sizes)))}); split its layers instead with "
            "--parallel pipeline, use fewer ranks, or convert with a smaller --q-group-size"
        )


def _take_rows(module: nn.Module, start: int, stop: int, rows: int):
    """Keep rows [start, stop) of every parameter of `module` (weight, scales, biases, bias), padded
    with zero rows to `rows`, sliced lazily so only the slice is ever evaluated."""
    params = []
    for name, value in tree_flatten(module.parameters()):
        part = value[start:stop]
        if stop - start < rows:
            part = mx.concatenate([part, mx.zeros((rows - (stop - start), *value.shape[1:]), value.dtype)])
        params.append((name, mx.contiguous(part)))
    module.update(tree_unflatten(params))


def _gather_vocab(local, vocab_size, group):
    """Per-rank logits (..., V/N) → full logits (..., V): all_gather stacks along axis 0."""
    parts = mx.distributed.all_gather(mx.moveaxis(local, -1, 0), group=group)
    return mx.moveaxis(parts[:vocab_size], 0, -1)


class _VocabShard(nn.Module):
    """Rows [start, start + rows) of a vocabulary-sized layer (the last rank's padded with zeros)."""

    def __init__(self, layer, vocab_size, group):
        super().__init__()
        self.vocab_size, self.group = vocab_size, group
        self.rows = -(-vocab_size // group.size())
        self.start = group.rank() * self.rows
        _take_rows(layer, self.start, min(vocab_size, self.start + self.rows), self.rows)
        self.layer = layer


class VocabShardedEmbedding(_VocabShard):
    """An Embedding (or QuantizedEmbedding) split by vocabulary: each id is found on one rank and
    summed over ranks (the others add exact zeros); `as_linear` (tied head) gathers the logits."""

    def __call__(self, ids):
        local = ids - self.start
        inside = (local >= 0) & (local < self.rows)
        x = self.layer(mx.where(inside, local, 0))
        x = mx.where(inside[..., None], x, mx.zeros((), x.dtype))
        return mx.distributed.all_sum(x, group=self.group)

    def as_linear(self, x):
        return _gather_vocab(self.layer.as_linear(x), self.vocab_size, self.group)


class VocabShardedHead(_VocabShard):
    """An untied LM head (Linear or QuantizedLinear) split by vocabulary rows; logits gathered."""

    def __call__(self, x):
        return _gather_vocab(self.layer(x), self.vocab_size, self.group)


def _shard_mlp(mlp, up_names, down_name, group):
    for name in up_names:
        setattr(mlp, name, shard_linear(getattr(mlp, name), "all-to-sharded", group=group))
    setattr(mlp, down_name, shard_linear(getattr(mlp, down_name), "sharded-to-all", group=group))


class ShardedExperts(nn.Module):
    """A sparse MoE block with every expert's intermediate dimension split over the ranks (mlx-lm's
    way): the router is replicated, each rank runs its part of each chosen expert, and the parts of
    the weighted sum are summed over ranks (the weighting is linear, so summing last is exact)."""

    def __init__(self, block, group):
        super().__init__()
        experts = block.switch_mlp
        shard_inplace(experts.gate_proj, "all-to-sharded", group=group)
        shard_inplace(experts.up_proj, "all-to-sharded", group=group)
        shard_inplace(experts.down_proj, "sharded-to-all", group=group)
        self.block, self.group = block, group

    def __call__(self, x):
        return mx.distributed.all_sum(self.block(x), group=self.group)


def _shard_attention(attn, group):
    n, rank = group.size(), group.rank()
    attn.q_proj = shard_linear(attn.q_proj, "all-to-sharded", group=group)
    if attn.n_kv_heads % n == 0:
        attn.k_proj = shard_linear(attn.k_proj, "all-to-sharded", group=group)
        attn.v_proj = shard_linear(attn.v_proj, "all-to-sharded", group=group)
        attn.n_kv_heads //= n
    else:  # fewer KV heads than ranks: keep the one this rank's query heads read (GQA groups)
        head = rank * attn.n_kv_heads // n
        for proj in (attn.k_proj, attn.v_proj):
            _take_rows(proj, head * attn.head_dim, (head + 1) * attn.head_dim, attn.head_dim)
        attn.n_kv_heads = 1
    attn.o_proj = shard_linear(attn.o_proj, "sharded-to-all", group=group)
    attn.n_heads //= n


def _shard_vision(visual, group):
    for block in visual.blocks:
        # qkv is [q; k; v] stacked by rows: each third is split, so a rank gets whole heads of each.
        block.attn.qkv = shard_linear(block.attn.qkv, "all-to-sharded", segments=3, group=group)
        block.attn.proj = shard_linear(block.attn.proj, "sharded-to-all", group=group)
        block.attn.num_heads //= group.size()
        _shard_mlp(block.mlp, ("linear_fc1",), "linear_fc2", group)


def shard(model, group, vision: str = VISION_DEFAULT):
    """Split a loaded (possibly still lazy) Qwen3-VL model over `group` in place; see the module
    docstring. Raises ConfigError when a dimension does not divide by the group size."""
    check_shardable(model.config, group.size(), vision)
    lm = model.language_model
    for layer in lm.layers:
        _shard_attention(layer.self_attn, group)
        if hasattr(layer.mlp, "switch_mlp"):  # MoE layer (moe.py); dense layers of an MoE model below
            layer.mlp = ShardedExperts(layer.mlp, group)
        else:
            _shard_mlp(layer.mlp, ("gate_proj", "up_proj"), "down_proj", group)
    vocab = model.config.text_config.vocab_size
    lm.embed_tokens = VocabShardedEmbedding(lm.embed_tokens, vocab, group)
    if not model.config.tie_word_embeddings:
        model.lm_head = VocabShardedHead(model.lm_head, vocab, group)
    if vision == "heads":
        _shard_vision(model.visual, group)
    # The plain MLX graph, explicitly: the CPU path's one-token decode stack reads whole weight
    # matrices and knows no collectives, so it is never installed on a sharded model.
    model.backend = ShardedMLX(group, vision)
    model.group = group
    return model


class ShardedMLX(MLXBackend):
    """The plain MLX graph of a model split over a group (what `--verbose` names)."""

    def __init__(self, group, vision):
        self.group, self.vision = group, vision

    def describe(self) -> str:
        vision = "replicated" if self.vision == "replicate" else "split by heads"
        return (f"{super().describe()}, tensor parallel over {self.group.size()} ranks (this is rank "
                f"{self.group.rank()}; vision tower {vision})")


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------
def check_parallel(parallel: str, vision: str = VISION_DEFAULT):
    if parallel not in PARALLEL_MODES:
        raise ConfigError(f"parallel={parallel!r} is not one of {', '.join(PARALLEL_MODES)}")
    if parallel == "pipeline" and vision != VISION_DEFAULT:
        raise ConfigError(f"vision={vision!r} splits the vision tower by heads, which only tensor parallel does; "
                          "a pipeline keeps the tower whole on the stages that use it")


def sharded_load(path, group, dtype=None, vision: str = VISION_DEFAULT, backend=None, parallel: str = "tensor"):
    """The model of a checkpoint folder, split over `group` (parallel "tensor": every layer split,
    "pipeline": the layers split, see pipeline.py): each rank reads only its slices of the
    safetensors files (sharded_load.load_kept). backend: None or "mlx" (the only one that shards)."""
    from .config import ModelConfig
    from .pipeline import check_pipelinable, pipeline
    from .sharded_load import load_kept

    check_parallel(parallel, vision)
    if backend not in (None, "mlx"):
        raise ConfigError(f"backend {backend!r} cannot run a model split over {group.size()} ranks: "
                          "sharded models run the plain MLX graph (backend='mlx' or None)")
    check_same_checkpoint(path, group)
    share_this_machine(group)
    config = ModelConfig.from_pretrained(Path(path))
    if parallel == "pipeline":
        check_pipelinable(config, group.size())
        surgery = lambda model: pipeline(model, group)  # noqa: E731
    else:
        check_shardable(config, group.size(), vision)
        surgery = lambda model: shard(model, group, vision)  # noqa: E731
    model = load_kept(path, dtype, surgery)
    sync_random_seed(group)
    return model


class RankZeroProcessor:
    """A Processor whose call (image and video reading and preprocessing) runs on rank 0 only;
    the other ranks receive its arrays, or its error, through the group."""

    def __init__(self, processor, group):
        self._processor, self._group = processor, group
        self.local = processor  # for a caller that shares the results itself (the server's rank 0)

    def __getattr__(self, name):
        return getattr(self._processor, name)

    def __call__(self, *args, **kwargs):
        return self.read_media(self._processor, *args, **kwargs)

    def read_media(self, read, *args, **kwargs):
        """read(*args, **kwargs) on rank 0 (a dict of arrays), its result or its error on every rank."""
        if self._group.rank() == 0:
            try:
                out = read(*args, **kwargs)
            except Exception as e:
                _broadcast_bytes(_error_payload(e), self._group)
                raise
            _broadcast_bytes(_arrays_payload(out), self._group)
            return out
        return _from_payload(_broadcast_bytes(None, self._group))


def _error_payload(e) -> bytes:
    # the nearest class the other ranks can raise: errors.py's (a module's own subclass, such as
    # media_access.MediaError, is not importable by name there)
    kind = next((c.__name__ for c in type(e).__mro__
                 if issubclass(c, Qwen3VLError) and getattr(errors, c.__name__, None) is c), "RuntimeError")
    return b"E" + json.dumps({"kind": kind, "message": str(e)}).encode()


def _arrays_payload(out) -> bytes:
    buf = io.BytesIO()
    as_mlx = [k for k, v in out.items() if isinstance(v, mx.array)]
    np.savez(buf, **{k: np.array(v) for k, v in out.items()})
    return b"A" + json.dumps(as_mlx).encode() + b"\n" + buf.getvalue()


def _from_payload(data: bytes):
    if data[:1] == b"E":
        info = json.loads(data[1:])
        cls = getattr(errors, info["kind"], None)
        cls = cls if isinstance(cls, type) and issubclass(cls, Qwen3VLError) else RuntimeError
        raise cls(f"{info['message']} (reported by rank 0)")
    header, body = data[1:].split(b"\n", 1)
    as_mlx = set(json.loads(header))
    with np.load(io.BytesIO(body), allow_pickle=False) as arrays:
        return {k: mx.array(arrays[k]) if k in as_mlx else arrays[k] for k in arrays.files}


def load_sharded(path, group, dtype=None, backend=None, vision: str = VISION_DEFAULT, parallel: str = "tensor"):
    """(sharded model, rank-0-reading processor) for `load` under `mlx.launch`."""
    from .processor import Processor

    model = sharded_load(path, group, dtype, vision, backend, parallel)
    return model, RankZeroProcessor(Processor.from_pretrained(Path(path)), group)


def free_ports(n: int = 1) -> int:
    """The first of n consecutive free ports on 127.0.0.1."""
    import socket

    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            for k in range(1, n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + k))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no {n} consecutive free ports on 127.0.0.1")


def local_launch_command(n: int, command) -> list:
    """`mlx.launch` running `command` (an argv list) as n ranks on this machine, ring backend over
    127.0.0.1 on free ports (one per rank): for tests and benchmarks."""
    # "--": everything after it is the program's own (mlx.launch would take --verbose, -p, --env...)
    return ["mlx.launch", "-n", str(n), "--backend", "ring", "--hosts", "127.0.0.1",
            "--starting-port", str(free_ports(n)), "--", *command]


def quiet_other_ranks(group=None):
    """For the CLI: ranks other than 0 print nothing (their answer is rank 0's)."""
    group = group if group is not None else world()
    if group is not None and group.rank() != 0:
        sys.stdout.flush(), sys.stderr.flush()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)  # file descriptors, so output bound to sys.stderr early is silenced too
        os.dup2(devnull, 2)
        os.close(devnull)
