"""`make demo`: the main job end to end on an embedded default, printing each step and its time.

Writes a small checkpoint (tools/make_demo_checkpoint.py), converts/re-packs it with `w4pack convert`,
inspects and validates the result.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "out" / "demo"


def step(title: str, argv: list[str]) -> None:
    print(f"\n== {title}\n$ {' '.join(argv)}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=ROOT)
    dt = time.perf_counter() - t0
    if proc.returncode != 0:
        print(f"!! step failed with exit status {proc.returncode}")
        sys.exit(proc.returncode)
    print(f"-- ok in {dt:.2f}s")


def main() -> None:
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    w4 = [sys.executable, "-m", "w4pack"]
    src, dst = WORK / "source", WORK / "packed"
    step("write a small random 4-bit checkpoint", [sys.executable, "tools/make_demo_checkpoint.py", str(src)])
    step("convert it (re-pack into 256 KB shards)", [*w4, "convert", str(src), str(dst), "--max-shard-size", "256KB"])
    step("inspect", [*w4, "inspect", str(dst)])
    step("validate (schema, index, shapes, sha256)", [*w4, "validate", str(dst), "--deep"])
    print(f"\ndemo finished: {dst}")


if __name__ == "__main__":
    main()
