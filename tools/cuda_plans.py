"""The CUDA planner's choices on described devices, from a library that exports w4p_cuda_plan_describe_for
(libw4p_cuda.so, or the host-only planner of native/cuda/build_planner.sh).

    python tools/cuda_plans.py golden [LIB]   # the golden table of tests/data/cuda_plans_h200.tsv
    python tools/cuda_plans.py table [LIB]    # the H200 choice table of docs/CUDA.md (markdown)
    python tools/cuda_plans.py rules          # native/cuda/planner_rules.h's AUTO_RULES as docs/CUDA.md shows them

Without LIB the host-only planner is built from native/cuda into a temporary folder (a C++ compiler, no nvcc).
tests/test_cuda_planner.py checks both outputs against the planner.
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# (multiprocessors, compute capability, shared memory per SM / per block / reserved)
H200 = (132, 90, 233472, 232448, 1024)
# the Llama 7B / 70B layers (N x K) and two small ones
SHAPES = ((4096, 4096), (11008, 4096), (4096, 11008), (12288, 4096), (28672, 8192), (8192, 28672), (8192, 8192),
          (2048, 4096), (196, 576))
# the M values where a rule changes, and a few between
MS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17, 24, 32, 33, 48, 64, 65, 96, 128, 129, 160, 192, 256, 257, 300, 320,
      384, 448, 512, 513, 640, 768, 769, 896, 1024, 1025, 2048)
VARIANTS = ((4, 128), (4, 32), (4, -1), (8, 128))  # (storage bits, group size)
# the docs' table: 4-bit, group size 128, these M columns
TABLE_MS = (1, 2, 4, 8, 9, 16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1025)


def build_planner(out_dir: str | None = None) -> Path:
    out = Path(out_dir or tempfile.mkdtemp(prefix="w4p_planner_")) / "libw4p_cuda_plan.so"
    subprocess.run(["bash", str(ROOT / "native" / "cuda" / "build_planner.sh"), str(out)], check=True)
    return out


def load(path: str | Path):
    import cffi

    from w4pack.native import cuda

    ffi = cffi.FFI()
    ffi.cdef(cuda.cuda_cdef(cuda.header_path().read_text()))
    return ffi, ffi.dlopen(str(path))


def describe(ffi, lib, dev, m: int, n: int, k: int, bits: int = 4, gs: int = 128) -> str:
    buf = ffi.new("char[256]")
    rc = lib.w4p_cuda_plan_describe_for(*dev, m, n, k, bits, gs, 0, 1, 0, 0, buf, 256)
    if rc != 0:
        return "error " + ffi.string(lib.w4p_cuda_last_error()).decode()
    return ffi.string(buf).decode()


def golden_rows(ffi, lib) -> list[str]:
    rows = ["n\tk\tbits\tgroup\tm\tplan"]
    for n, k in SHAPES:
        for bits, gs in VARIANTS:
            for m in MS:
                rows.append(f"{n}\t{k}\t{bits}\t{gs}\t{m}\t{describe(ffi, lib, H200, m, n, k, bits, gs)}")
    return rows


def short(desc: str) -> str:
    """A plan as a table cell: the kernel, its block shape where not the default, its split."""
    name, *fields = desc.split()
    f = dict(x.split("=", 1) for x in fields if "=" in x)
    cell = "dense" if name == "tiled" else name  # (Python's auto takes dequantize + cuBLAS where the plan says tiled)
    if "rows" in f:
        cell += f" r{f['rows']}"
    if "tokens" in f:
        cell += f" t{f['tokens']}"
    if "stream-k" in f:
        cell += " sk"
    elif f.get("splits", "1") != "1":
        cell += f" x{f['splits']}"
    return cell


def choice_table(ffi, lib) -> str:
    head = "| N x K | " + " | ".join(f"M={m}" for m in TABLE_MS) + " |"
    rule = "|" + "---|" * (len(TABLE_MS) + 1)
    lines = [head, rule]
    for n, k in SHAPES:
        cells = []
        for m in TABLE_MS:
            # (Python's auto takes the dense path from M = 33 unless the plan names a wgmma kernel)
            d = describe(ffi, lib, H200, m, n, k)
            cells.append(short(d) if not (m >= 33 and not d.startswith("wgmma")) else "dense")
        lines.append(f"| {n}x{k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def auto_rules() -> list[tuple]:
    """AUTO_RULES of native/cuda/planner_rules.h: (cc_lo, cc_hi, m_lo, m_hi, sizes, kernels, why, bench)."""
    import re

    text = (ROOT / "native" / "cuda" / "planner_rules.h").read_text()
    body = re.sub(r'"\s*\n\s*"', "", text[text.index("AUTO_RULES[] = {"):])  # joined string literals
    rows = re.findall(r'\{(\d+), (\d+), (\d+), (\d+|1 << 30), "([^"]*)", "([^"]*)", "([^"]*)",\s*"([^"]*)"\}', body)
    return [(int(a), int(b), int(c), 1 << 30 if d == "1 << 30" else int(d), sizes.split(), kernels.split(), why, bench)
            for a, b, c, d, sizes, kernels, why, bench in rows]


def rules_table() -> str:
    lines = ["| compute capability | M | sizes | kernels | when | measured |", "|---|---|---|---|---|---|"]
    for cc_lo, cc_hi, m_lo, m_hi, sizes, kernels, why, bench in auto_rules():
        cc = f"{cc_lo / 10:.1f}" if cc_lo == cc_hi else f"{cc_lo / 10:.1f}-{cc_hi / 10:.1f}"
        m = f"{m_lo}+" if m_hi >= 1 << 30 else str(m_lo) if m_lo == m_hi else f"{m_lo}-{m_hi}"
        lines.append(f"| {cc} | {m} | {' '.join(sizes)} | {', '.join(kernels)} | {why} | {bench} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("golden", "table", "rules"):
        print(__doc__, file=sys.stderr)
        return 2
    if argv[0] == "rules":
        print(rules_table())
        return 0
    path = argv[1] if len(argv) > 1 else build_planner()
    ffi, lib = load(path)
    print("\n".join(golden_rows(ffi, lib)) if argv[0] == "golden" else choice_table(ffi, lib))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
