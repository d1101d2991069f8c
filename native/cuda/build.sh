#!/usr/bin/env bash
# Build w4pack/_lib/libw4p_cuda.so with nvcc from every .cu (kernels, launch table, ABI) and .cpp (the host-only
# planner, built by the host compiler) here: SASS for sm_80, sm_86, sm_89, sm_90a (the wgmma kernels) plus
# compute_90 PTX,
# the CUDA runtime linked statically (the library loads without libcudart and reports "no CUDA device"
# cleanly where there is no driver). Skips the build when the library is newer than every input.
# Environment: NVCC (default: nvcc on PATH), W4P_CUDA_ARCHS (e.g. "90" for a quick local build), W4P_CUDA_OUT
# (another output path) and W4P_CUDA_DEFINES (extra -D flags: tools/ws_trace.py builds its diagnostics library
# with -DW4P_WS_TRACE this way).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
NVCC="${NVCC:-nvcc}"
OUT="${W4P_CUDA_OUT:-$ROOT/w4pack/_lib/libw4p_cuda.so}"
ARCHS="${W4P_CUDA_ARCHS:-80 86 89 90a}"
DEFINES="${W4P_CUDA_DEFINES:-}"
STAMP="$ARCHS${DEFINES:+ $DEFINES}"  # what the library was built for
SRCS=("$HERE"/*.cu "$HERE"/*.cpp)
INPUTS=("${SRCS[@]}" "$HERE"/*.h "$HERE"/*.cuh "$ROOT/native/w4pack.h" "$HERE/build.sh")

if [ -f "$OUT" ] && [ -z "${W4P_CUDA_FORCE:-}" ]; then
  stale=0
  for f in "${INPUTS[@]}"; do [ "$f" -nt "$OUT" ] && stale=1; done
  stamp="$OUT.archs"
  [ "$(cat "$stamp" 2>/dev/null)" = "$STAMP" ] || stale=1
  if [ "$stale" = 0 ]; then echo "$(basename "$OUT") is up to date"; exit 0; fi
fi

GENCODE=()
last=""
for a in $ARCHS; do GENCODE+=("-gencode=arch=compute_$a,code=sm_$a"); last="$a"; done
ptx="${last%a}"  # portable PTX (sm_90a code runs only on compute capability 9.0 exactly)
GENCODE+=("-gencode=arch=compute_$ptx,code=compute_$ptx")

mkdir -p "$(dirname "$OUT")"
tmp="$OUT.tmp.$$"
echo "nvcc: building $(basename "$OUT") for sm_${ARCHS// /, sm_} + compute_$ptx PTX"
# -compress-all: fatbinary compresses only large SASS images by default; one translation unit per kernel keeps
# each under that size, and uncompressed they would double the library
build() {
  "$NVCC" -O3 -std=c++17 -shared -Xcompiler -fPIC -Xcompiler -fvisibility=hidden -cudart static -Xfatbin -compress-all \
    --threads "$1" -diag-suppress 177 $DEFINES "${GENCODE[@]}" -I"$ROOT/native" "${SRCS[@]}" -o "$tmp"
}
# (one parallel build here failed in its device link, "nvlink fatal: Could not read file /tmp/tmpxft_..._dlink.reg.c",
# and passed when run again: a failed parallel build is retried once one job at a time before the error stands)
if ! build 0; then
  rm -f "$tmp"
  echo "nvcc: the parallel build failed; building again one job at a time" >&2
  build 1
fi
mv -f "$tmp" "$OUT"
cp -f "$ROOT/native/w4pack.h" "$(dirname "$OUT")/w4pack.h"
echo "$STAMP" > "$OUT.archs"
echo "built $OUT"
