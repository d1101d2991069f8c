"""Instructions per tile of a kernel's main loop, counted statically in its SASS (no GPU needed).

    python tools/cuda_sass_loop.py CUBIN_OR_LIB [--kernel REGEX] [--arch sm_90a] [--per 4] [--path]

Why: the gemv kernel was measured bound by the instructions it issues per 512-byte tile
(docs/journal/2026-cuda.md), so a change to it is first judged by that count, which needs no GPU. The tool
disassembles each kernel matching REGEX (cuobjdump: $CUOBJDUMP, else on PATH, else the copy Triton ships), takes
the loop whose body holds the most MMA instructions (the widest such loop's back edge), and walks the path one
iteration takes when it computes every tile and ends no stripe: at each branch the side without a block barrier,
then with the most MMAs, then with the most global loads, then with the fewest instructions. Instructions per tile =
that path's instructions / (its MMAs / --per, 4 m16n8k16 MMAs per 16 x 64 tile). Registers and stack come from
cuobjdump's resource usage; LDL / STL on the path are spills inside the loop.
"""
from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import sys

INS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
FUNC = re.compile(r"Function : (\S+)")
RES = re.compile(r"Function (\S+):\s*REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")


def cuobjdump() -> str:
    """cuobjdump from $CUOBJDUMP, PATH or a Triton installation (CUDA toolkits without it exist)."""
    cand = [os.environ.get("CUOBJDUMP"), shutil.which("cuobjdump")]
    cand += glob.glob(os.path.join(sys.prefix, "lib", "python3*", "site-packages", "triton", "backends", "nvidia",
                                   "bin", "cuobjdump"))
    cand += glob.glob("/work/main/.venv*/lib/python3*/site-packages/triton/backends/nvidia/bin/cuobjdump")
    for c in cand:
        if c and os.access(c, os.X_OK):
            return c
    sys.exit("cuobjdump not found: set CUOBJDUMP (it ships with the CUDA toolkit and with Triton)")


def demangle(name: str) -> str:
    out = subprocess.run(["c++filt", name], capture_output=True, text=True).stdout.strip() or name
    return out.replace("w4p::", "").replace("(anonymous namespace)::", "").replace("__nv_bfloat16", "bf16") \
              .replace("__half", "half")


def functions(path: str, arch: str | None) -> dict[str, list[tuple[int, str, str, str]]]:
    """{mangled name: [(address, predicate, opcode, operands)]} of every kernel in a cubin or a library."""
    cmd = [cuobjdump(), "-sass"] + (["-arch", arch] if arch else []) + [path]
    text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    funcs: dict[str, list] = {}
    cur = None
    for line in text.splitlines():
        m = FUNC.search(line)
        if m:
            cur = funcs.setdefault(m.group(1), [])
            continue
        m = INS.search(line)
        if m and cur is not None:
            cur.append((int(m.group(1), 16), (m.group(2) or "").strip(), m.group(3), m.group(4).strip()))
    return funcs


def resources(path: str, arch: str | None) -> dict[str, tuple[int, int, int]]:
    """{mangled name: (registers, stack bytes, local bytes)}."""
    cmd = [cuobjdump(), "-res-usage"] + (["-arch", arch] if arch else []) + [path]
    text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return {m.group(1): (int(m.group(2)), int(m.group(3)), int(m.group(5))) for m in RES.finditer(text)}


def target(ops: str) -> int | None:
    m = re.search(r"0x([0-9a-f]+)", ops)
    return int(m.group(1), 16) if m else None


def is_mma(op: str) -> bool:
    return op.startswith("HMMA")


def main_loop(ins: list[tuple[int, str, str, str]]) -> tuple[int, int] | None:
    """(first, last) index of the loop whose body holds the most MMAs (the back edge at last)."""
    addr = {a: i for i, (a, *_rest) in enumerate(ins)}
    best = None
    for i, (a, pred, op, ops) in enumerate(ins):
        if not op.startswith("BRA"):
            continue
        t = target(ops)
        if t is None or t >= a or t not in addr:
            continue
        j = addr[t]
        n = sum(1 for k in range(j, i + 1) if is_mma(ins[k][2]))
        key = (n, -(i - j))
        if n and (best is None or key > best[0]):
            best = (key, j, i)
    return (best[1], best[2]) if best else None


def hot_path(ins: list[tuple[int, str, str, str]], lo: int, hi: int) -> list[int]:
    """Indices of one iteration's instructions (see the module docstring for the choice at each branch)."""
    addr = {a: i for i, (a, *_rest) in enumerate(ins)}
    leaders = {lo}
    for i in range(lo, hi + 1):
        a, pred, op, ops = ins[i]
        if op.startswith(("BRA", "EXIT", "RET", "JMP")) or op == "BPT":
            leaders.add(i + 1)
            t = target(ops) if op.startswith("BRA") else None
            if t is not None and t in addr and lo <= addr[t] <= hi:
                leaders.add(addr[t])
    starts = sorted(x for x in leaders if lo <= x <= hi)
    blocks = {s: (s, (starts[n + 1] - 1) if n + 1 < len(starts) else hi) for n, s in enumerate(starts)}

    def weight(s: int, e: int) -> tuple[int, int, int, int]:
        ops = [ins[k][2] for k in range(s, e + 1)]
        return (-sum(o.startswith("BAR") for o in ops), sum(map(is_mma, ops)),
                sum(o.startswith("LDG") for o in ops), -len(ops))

    NEG = None
    best: dict[int, tuple | None] = {s: NEG for s in starts}
    prev: dict[int, int | None] = {}
    best[lo] = weight(*blocks[lo])
    prev[lo] = None
    end_best, end_block = NEG, None
    for s in starts:
        if best[s] is NEG:
            continue
        _, e = blocks[s]
        a, pred, op, ops = ins[e]
        succ = []
        uncond = pred in ("", "@PT")
        if e == hi:  # the back edge: one iteration ends here
            if end_best is NEG or best[s] > end_best:
                end_best, end_block = best[s], s
            continue
        if op.startswith("BRA"):
            t = target(ops)
            if t is not None and t in addr and lo < addr[t] <= hi and addr[t] > e:
                succ.append(addr[t])
            if not uncond and e + 1 <= hi:
                succ.append(e + 1)
        elif op.startswith(("EXIT", "RET")):
            if not uncond and e + 1 <= hi:
                succ.append(e + 1)
        elif e + 1 <= hi:
            succ.append(e + 1)
        for t in succ:
            w = weight(*blocks[t])
            cand = tuple(x + y for x, y in zip(best[s], w))
            if best[t] is NEG or cand > best[t]:
                best[t], prev[t] = cand, s
    path = []
    s = end_block
    while s is not None:
        b, e = blocks[s]
        path = list(range(b, e + 1)) + path
        s = prev.get(s)
    return path


CLASSES = (("HMMA", "mma"), ("LDG", "global load"), ("LDS", "shared load"), ("LDL", "spill load"),
           ("STL", "spill store"), ("LDC", "constant load"), ("LOP3", "lop3"), ("SHF", "shift"),
           ("HADD2.F32", "cvt"), ("HADD2", "fp16x2"), ("HFMA2", "fp16x2"), ("HMUL2", "fp16x2"), ("PRMT", "prmt"),
           ("F", "fp32"), ("I", "integer"), ("LEA", "integer"), ("VIADD", "integer"), ("SEL", "integer"),
           ("U", "uniform"), ("BRA", "branch"), ("MOV", "move"), ("CS2R", "move"), ("S2R", "move"))


def classify(op: str) -> str:
    for prefix, name in CLASSES:
        if op.startswith(prefix):
            return name
    return "other"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("binary", help="a cubin or a library holding cubins")
    ap.add_argument("--kernel", default="gemv", help="regex on the mangled kernel name")
    ap.add_argument("--arch", default=None, help="e.g. sm_90a (a library holds several)")
    ap.add_argument("--per", type=int, default=4, help="MMAs per tile (4 for a 16 x 64 tile of m16n8k16)")
    ap.add_argument("--path", action="store_true", help="print the counted instructions")
    args = ap.parse_args()
    res = resources(args.binary, args.arch)
    rows = []
    for name, ins in functions(args.binary, args.arch).items():
        if not re.search(args.kernel, name):
            continue
        loop = main_loop(ins)
        reg, stack, local = res.get(name, (0, 0, 0))
        if loop is None:
            rows.append((demangle(name), reg, stack, 0, 0, 0.0, {}))
            continue
        path = hot_path(ins, *loop)
        ops = [ins[k][2] for k in path]
        mmas = sum(map(is_mma, ops))
        tiles = mmas / args.per
        cls = collections.Counter(classify(o) for o in ops)
        rows.append((demangle(name), reg, stack, len(ops), tiles, len(ops) / tiles if tiles else 0.0, cls))
        if args.path:
            print(f"# {demangle(name)}")
            for k in path:
                a, pred, op, o = ins[k]
                print(f"  {a:05x} {pred:5s} {op} {o}")
    for name, reg, stack, n, tiles, per, cls in sorted(rows):
        spill = f" SPILL stack={stack}" if stack else ""
        detail = ", ".join(f"{k} {v / tiles:.1f}" for k, v in cls.most_common()) if tiles else "no MMA loop"
        print(f"{per:6.1f} /tile  {n:4d} instr / {tiles:g} tiles  regs {reg:3d}{spill}  {name}\n        {detail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
