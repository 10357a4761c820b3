#!/usr/bin/env bash
# The first GPU figures, the day a Linux machine with an NVIDIA GPU is at hand. From the
# repository root:
#
#   bash benchmarks/gpu_run.sh
#
# It makes a fresh virtualenv with MLX's CUDA build (`pip install -e ".[cuda,test-tools]"`: mlx-cuda-13
# instead of mlx-cpu, which cannot be installed beside it), checks that MLX's default device is the
# GPU, then writes into benchmarks/results/, next to the CPU results, files named cuda-<UTC time>-*:
#
#   machine.txt          nvidia-smi, uname, Python, the installed packages
#   suite.txt            the whole test suite (python -m pytest -q) and its exit status
#   lab-2b.json          benchmarks/bench.py --preset 2b --backend mlx (random weights, bfloat16): vision,
#                        first token, prefill, decode, peak memory, the agent loop with and without reuse
#   plan-2b.json         python -m mlx_qwen3vl.plan on the same checkpoint
#   bench-2b.json        python -m mlx_qwen3vl.bench on it (bfloat16), the installed benchmark's table
#   bench-2b-4bit.json   the same, --quick, on its 4-bit conversion (what Mac users run)
#   vision-memory.json   benchmarks/vision_memory.py, bfloat16: peak memory and first token for a 1080p and a 4K
#                        screenshot, vision head dims 64 and 72, the plain graph against mlx-vlm (when installed)
#   graph-ops.json       benchmarks/graph_ops.py: ops of a decode step and a vision block, ours vs mlx-vlm
#   decode-gap.json      benchmarks/decode_gap.py: decode and first token against mlx-vlm, interleaved (needs mlx-vlm)
#   host-overlap.json    benchmarks/host_overlap.py: a decode step with 0, 5 and 20 ms of the caller's work per
#                        token, queued ahead (the GPU computes meanwhile) and not
#   server-text-agents.json  benchmarks/bench_server.py --text: 16 agents sending text-only turns to our server
#                        (h-mid checkpoint), short prompts prefilled together
#
# A step that fails is recorded and the next one still runs; the script's exit status is the
# first failure's. Settings (environment variables): VENV=path (reuse a virtualenv, and INSTALL=0
# to skip the install), PRESET=2b (another preset), SKIP_SUITE=1, ALLOW_CPU=1 (run the same steps
# without a GPU, to check this script on a CPU machine).
set -uo pipefail
cd "$(dirname "$0")/.."

preset=${PRESET:-2b}
stamp=$(date -u +%Y%m%d-%H%M%S)
out=benchmarks/results/cuda-$stamp
models=benchmarks/models
status=0

step() {  # step NAME COMMAND...: run it, keep going on failure, remember the first one
  echo "== $1" >&2
  shift
  "$@"
  local rc=$?
  if [ $rc -ne 0 ]; then
    echo "== failed (exit $rc): $*" >&2
    [ $status -eq 0 ] && status=$rc
  fi
  return 0
}

venv=${VENV:-$(mktemp -d)/venv}
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv" || exit 1
fi
# shellcheck disable=SC1091
. "$venv/bin/activate"
if [ "${INSTALL:-1}" != 0 ]; then
  python -m pip install -q --upgrade pip || exit 1
  pip install -q -e ".[cuda,test-tools]" || exit 1
fi

python - <<'EOF' || { [ "${ALLOW_CPU:-0}" = 1 ] || exit 1; }
import sys
import mlx.core as mx
device = mx.default_device()
print(f"MLX {mx.__version__}, default device {device}: {mx.device_info()}", file=sys.stderr)
if device.type != mx.DeviceType.gpu:
    sys.exit("MLX's default device is not a GPU: is mlx-cuda-13 installed (not mlx-cpu) and the NVIDIA driver up?")
EOF

{
  nvidia-smi 2>&1 || echo "(no nvidia-smi)"
  uname -a
  python --version
  pip freeze
} > "$out-machine.txt" 2>&1

if [ "${SKIP_SUITE:-0}" != 1 ]; then
  python -m pytest -q -p no:cacheprovider > "$out-suite.txt" 2>&1
  rc=$?
  echo "exit status: $rc" >> "$out-suite.txt"
  [ $rc -ne 0 ] && [ $status -eq 0 ] && status=$rc
  tail -3 "$out-suite.txt" >&2
fi

checkpoint=$models/qwen3vl-$preset-random
step "lab benchmark, preset $preset" \
  python benchmarks/bench.py --preset "$preset" --backend mlx --models-dir "$models" \
    --workloads image448,image720,image1080,text256,video8,agent --out "$out-lab-$preset.json"
step "memory plan" python -m mlx_qwen3vl.plan --model "$checkpoint" --json "$out-plan-$preset.json"
step "bench, bfloat16" python -m mlx_qwen3vl.bench --model "$checkpoint" --json "$out-bench-$preset.json"
if [ ! -f "$checkpoint-4bit/config.json" ]; then
  step "4-bit conversion" python -m mlx_qwen3vl.convert --hf-path "$checkpoint" --mlx-path "$checkpoint-4bit" -q
fi
step "bench, 4-bit, --quick" \
  python -m mlx_qwen3vl.bench --model "$checkpoint-4bit" --quick --json "$out-bench-$preset-4bit.json"

step "vision memory, 1080p and 4K" \
  python benchmarks/vision_memory.py --engines mlx,mlx-vlm --dtype bfloat16 --out "$out-vision-memory.json"
step "graph ops" python benchmarks/graph_ops.py --out "$out-graph-ops.json"
if python -c "import mlx_vlm" 2>/dev/null; then
  step "decode gap against mlx-vlm" \
    python benchmarks/decode_gap.py --model "$models/vision-memory/6x6/qwen3vl-h-mid-random" --out "$out-decode-gap.json"
fi

step "host work overlapped with decode" \
  python benchmarks/host_overlap.py --model "$models/vision-memory/6x6/qwen3vl-h-mid-random" --host-ms 0,5,20 \
    --out "$out-host-overlap.json"

step "server, 16 agents' text-only turns" \
  python benchmarks/bench_server.py --model "$models/vision-memory/6x6/qwen3vl-h-mid-random" --servers ours --text \
    --conversations 16 --max-batch 16 --turns 3 --max-tokens 8 --out "$out-server-text-agents.json"

ls -l "$out"-* >&2
exit $status
