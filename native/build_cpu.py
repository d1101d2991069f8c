"""cffi builder (out-of-line API mode) for the CPU kernels: ``w4pack._w4p_cpu``.

The cdef is the public header itself (preprocessor lines stripped), so the ABI is declared once.
No -march=native: each instruction-set file enables its own ISA with per-function target attributes.
"""
from __future__ import annotations

import re
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
#: C sources of the CPU module, one file per instruction set plus the dispatcher
SOURCES = sorted(str(p.relative_to(HERE.parent)) for p in HERE.glob("cpu_*.c"))


def cdef_from_header(path: Path, section: str = "cpu") -> str:
    """The header as a cffi cdef. Lines between the W4P_CUDA_BEGIN / W4P_CUDA_END marker comments are
    CUDA entry points: kept for section="cuda" or "all", dropped for the CPU extension."""
    kept = []
    in_cuda = False
    for line in path.read_text().splitlines():
        if "W4P_CUDA_BEGIN" in line:
            in_cuda = True
            continue
        if "W4P_CUDA_END" in line:
            in_cuda = False
            continue
        if in_cuda and section == "cpu":
            continue
        kept.append(line)
    text = re.sub(r"/\*.*?\*/", "", "\n".join(kept), flags=re.S)
    out = []
    for line in text.splitlines():
        s = line.strip()
        if re.match(r"#define\s+W4P_\w+\s+-?\d+\s*$", s):
            out.append(s)
        elif s.startswith("#") or s.startswith('extern "C"') or s == "}":
            continue
        else:
            out.append(line)
    return "\n".join(out)


ffibuilder = FFI()
ffibuilder.cdef(cdef_from_header(HERE / "w4pack.h"))
ffibuilder.set_source(
    "w4pack._w4p_cpu",
    '#include "w4pack.h"\n',
    sources=SOURCES,
    include_dirs=[str(HERE.relative_to(HERE.parent))],
    extra_compile_args=["-O3", "-std=gnu11", "-fvisibility=hidden", "-Wall", "-Wno-unused-function"],
    libraries=["pthread", "m"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
