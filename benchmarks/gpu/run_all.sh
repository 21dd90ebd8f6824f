#!/usr/bin/env bash
# The GPU suite in one command: tests/gpu (pytest -m gpu) and the GPU benchmarks, with every figure
# written to one results folder (device name, torch version and date inside each file).
#
#   bash benchmarks/gpu/run_all.sh [RESULTS_DIR]      # default: benchmarks/results/gpu-<date>
#
# Needs a CUDA device; the project installed (`pip install -e .`, or `--no-deps -e .` where torch,
# Lightning, transformers and torchmetrics are already there). SKIP_BENCHMARKS=1 runs the tests only.
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${1:-benchmarks/results/gpu-$(date +%F)}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 LIGHTNING_PIPE_GPU_RESULTS="$out/gpu_tests.jsonl"
rm -f "$LIGHTNING_PIPE_GPU_RESULTS"
python - <<'PY' | tee "$out/environment.txt"
import datetime, torch, lightning
print("date", datetime.date.today(), "| device", torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
      "| torch", torch.__version__, "| cuda", torch.version.cuda, "| lightning", lightning.__version__)
PY
status=0
python -m pytest -q -m gpu tests/gpu -rs -s -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log" || status=1
if [ "${SKIP_BENCHMARKS:-0}" != "1" ]; then
  python benchmarks/gpu/profile_blocks.py --out "$out/gpu_profile.json" 2>&1 | tee "$out/profile_blocks.log" || status=1
  python benchmarks/gpu/bench_overhead.py --json "$out/overhead.json" 2>&1 | grep -v -i "warn\|tip\|available:" | tee "$out/overhead.log" || status=1
  if [ -f benchmarks/gpu/bench_offload.py ]; then
    python benchmarks/gpu/bench_offload.py --out "$out" 2>&1 | grep -v -i "warn\|tip\|available:" | tee "$out/offload.log" || status=1
  fi
fi
echo "GPU suite finished with status $status; results in $out"
exit $status
