"""One rank of tests/test_distributed.py's sharded-loading tests (`mlx.launch -n 2 --backend ring`).

For each fixture (and vision mode) it loads the model with `distributed.sharded_load` (each rank
reads only its slices) and the old way (the whole checkpoint loaded lazily, then `shard`, then
evaluated), and writes to OUT/rank<r>.json, per fixture and mode: the parameters whose dtype, shape
or bits differ between the two, and the tensor bytes the slice reader read.
"""

import argparse
import json
import sys
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures"
sys.path.insert(0, str(FIXTURES.parents[1]))  # this checkout's mlx_qwen3vl, as pytest imports it


def bits(a):
    import mlx.core as mx
    import numpy as np

    return np.array(a.view(mx.uint8) if a.dtype.size != 2 else a.view(mx.uint16))  # bf16: no numpy dtype


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("runs", nargs="+", help="FIXTURE:VISION")
    args = p.parse_args()

    from mlx_qwen3vl import distributed, sharded_load  # before mlx.core: it loads the optimized BLAS

    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten

    from mlx_qwen3vl.weights import build_model

    group = mx.distributed.init()
    out = {}
    for run in args.runs:
        name, vision = run.split(":")
        sharded_load.reset_read_stats()
        new = distributed.sharded_load(FIXTURES / name, group, vision=vision)
        stats = sharded_load.read_stats()
        old, _ = build_model(FIXTURES / name, lazy=True)
        distributed.shard(old, group, vision)
        mx.eval(old.parameters())
        a, b = dict(tree_flatten(new.parameters())), dict(tree_flatten(old.parameters()))
        differ = sorted(set(a) ^ set(b)) + [
            k for k in sorted(set(a) & set(b))
            if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape or not np.array_equal(bits(a[k]), bits(b[k]))]
        out[run] = dict(params=len(a), differ=differ, bytes=stats["bytes"], whole=stats["whole"])
    Path(args.out, f"rank{group.rank()}.json").write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
