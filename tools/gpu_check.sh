#!/usr/bin/env bash
# One pass over everything GPU-side, for a machine with an NVIDIA GPU and nvcc: build the CPU extension and
# the CUDA library, run every GPU-marked test, time the kernels against the peers, and run compute-sanitizer
# (memcheck, racecheck) over a small checked sweep of every kernel path. Logs go to $LOGDIR (default ./gpu-logs);
# the summary lines are printed.
# Usage: tools/gpu_check.sh [bench_gpu.py arguments...]   e.g. tools/gpu_check.sh --ms 1,4,8,16 --sweep
# Environment: PYTHON (default python3), W4P_CUDA_ARCHS (e.g. "90a" for a quick build on an H100/H200),
# SKIP_TESTS=1, SKIP_BENCH=1, SKIP_SANITIZERS=1.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
LOGDIR="${LOGDIR:-gpu-logs}"
mkdir -p "$LOGDIR"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.mem --format=csv,noheader || exit 1
"$PY" setup.py -q build_ext --inplace > "$LOGDIR/build.log" 2>&1 || { tail -20 "$LOGDIR/build.log"; exit 1; }
W4P_CUDA_FORCE=1 bash native/cuda/build.sh >> "$LOGDIR/build.log" 2>&1 || { tail -30 "$LOGDIR/build.log"; exit 1; }
rc=0
if [ -z "${SKIP_TESTS:-}" ]; then
  echo "== GPU tests"
  "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/ > "$LOGDIR/gputests.log" 2>&1 || rc=1
  tail -2 "$LOGDIR/gputests.log"; grep -E "^(FAILED|ERROR)" "$LOGDIR/gputests.log" | head -20
fi
if [ -z "${SKIP_BENCH:-}" ]; then
  echo "== bench"
  "$PY" tools/bench_gpu.py --json "$LOGDIR/bench.jsonl" --plot "$LOGDIR/speedup.png" "$@" > "$LOGDIR/bench.log" 2>&1 || rc=1
  "$PY" tools/plot_bench.py "$LOGDIR/bench.jsonl" --markdown > "$LOGDIR/kernels-table.md" 2>&1 || rc=1
  grep -E "^\||^K=|M=[0-9]+: [0-9.]+x|^bandwidth|^GPU" "$LOGDIR/bench.log" | grep -v "^|---"
fi
if [ -z "${SKIP_SANITIZERS:-}" ]; then
  echo "== sanitizers"
  for tool in memcheck racecheck; do
    compute-sanitizer --tool "$tool" "$PY" tools/bench_gpu.py --smoke > "$LOGDIR/$tool.log" 2>&1 || rc=1
    tail -2 "$LOGDIR/$tool.log"
  done
fi
exit $rc
