#!/usr/bin/env bash
# Build the planner alone as a host library (no CUDA, no nvcc): the ABI's host-only entry points
# (w4p_cuda_abi_version, w4p_cuda_last_error, w4p_cuda_plan_for, w4p_cuda_plan_describe_for) for the planner's
# tests on machines without a GPU. Usage: build_planner.sh OUT.so (CXX: the compiler, default c++).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${1:?usage: build_planner.sh OUT.so}"
"${CXX:-c++}" -O2 -std=c++17 -shared -fPIC -fvisibility=hidden -I"$HERE/.." \
  "$HERE"/planner*.cpp "$HERE"/switches.cpp "$HERE"/error.cpp "$HERE"/abi_host.cpp -o "$OUT"
