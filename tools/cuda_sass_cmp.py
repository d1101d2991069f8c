"""Compare the kernels of two CUDA library builds, SASS section by section (no cuobjdump needed).

Keep each build's cubins, e.g.
    W4P_CUDA_FORCE=1 W4P_CUDA_OUT=/tmp/a/lib.so W4P_CUDA_DEFINES="-keep -keep-dir /tmp/a/keep" bash native/cuda/build.sh
then `python tools/cuda_sass_cmp.py /tmp/a/keep /tmp/b/keep [--families]`. Each kernel is an ELF section
.text.<symbol> of a cubin; kernels are matched by demangled name (namespaces dropped, so a move between files or
namespaces compares equal) and compared byte for byte; instruction counts are bytes / 16 (sm_70 and newer).
A kernel renamed between the builds is paired with `--rename 'REGEX=REPLACEMENT'` (Python re.sub on the first
build's names, repeatable); kernels the second build removes on purpose are named with `--removed REGEX`
(matched against the first build's names before any rename, repeatable): they are counted, not failed.
Exit status 0 when every kernel of every architecture is byte-identical (or removed as named).
"""
from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import struct
import subprocess
import sys

def sections(path):
    b = open(path, 'rb').read()
    assert b[:4] == b'\x7fELF' and b[4] == 2
    shoff, = struct.unpack_from('<Q', b, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from('<HHH', b, 0x3A)
    hdrs = []
    for i in range(shnum):
        name, typ, flags, addr, off, size = struct.unpack_from('<IIQQQQ', b, shoff + i * shentsize)
        hdrs.append((name, off, size))
    stroff = hdrs[shstrndx][1]
    out = {}
    for name, off, size in hdrs:
        end = b.index(b'\0', stroff + name)
        nm = b[stroff + name:end].decode()
        if nm.startswith('.text.'):
            out[nm[6:]] = b[off:off + size]
    return out

def norm(names):
    dem = subprocess.run(['c++filt'], input='\n'.join(names), capture_output=True, text=True).stdout.split('\n')
    res = {}
    for n, d in zip(names, dem):
        d = d.replace('w4p::', '').replace('(anonymous namespace)::', '')
        res[n] = d
    return res

def load(d):
    per_arch = {}
    for cub in sorted(c for c in glob.glob(os.path.join(d, '*.cubin')) if 'dlink' not in c):
        m = re.search(r'sm_(\w+)\.cubin$', cub) or re.search(r'compute_(\w+)\.cubin$', cub)
        if m is None:
            raise SystemExit(f'cuda_sass_cmp: {cub}: not named *.sm_XX.cubin (nvcc -keep names them so)')
        arch = m.group(1)
        secs = sections(cub)
        nm = norm(list(secs))
        for k, v in secs.items():
            key = nm[k]
            assert key not in per_arch.setdefault(arch, {}), (arch, key)
            per_arch[arch][key] = v
    return per_arch


def family(name):
    return re.match(r'void (\w+)', name).group(1) if name.startswith('void ') else name.split('(')[0]


def compare(a, b, renames=(), removed=(), families=False):
    """(report lines, ok) for builds a and b ({arch: {kernel name: SASS bytes}}): a's names pass through
    `removed` (regexes: kernels b drops on purpose) and then `renames` ((regex, replacement) pairs) first."""
    out = ['archs %s %s' % (sorted(a), sorted(b))]
    ok = True
    for arch in sorted(set(a) | set(b)):
        A, gone = {}, []
        for k, v in a.get(arch, {}).items():
            if any(re.search(r, k) for r in removed):
                gone.append(k)
                continue
            for pat, rep in renames:
                k = re.sub(pat, rep, k)
            assert k not in A, ('two kernels of the first build map to one name', arch, k)
            A[k] = v
        B = b.get(arch, {})
        same = sum(1 for k in A if k in B and A[k] == B[k])
        diff = [k for k in A if k in B and A[k] != B[k]]
        only_a = [k for k in A if k not in B]
        only_b = [k for k in B if k not in A]
        ia, ib = sum(len(v) for v in A.values()) // 16, sum(len(v) for v in B.values()) // 16
        out.append(f'sm_{arch}: {len(A)} kernels before, {len(B)} after; byte-identical {same}; differing {len(diff)}; '
                   f'only before {len(only_a)}; only after {len(only_b)}; instructions {ia} before, {ib} after'
                   + (f'; removed as named {len(gone)}' if removed else ''))
        out += ['  DIFF %s %d %d' % (k[:150], len(A[k]) // 16, len(B[k]) // 16) for k in diff[:10]]
        out += ['  ONLY BEFORE ' + k[:150] for k in only_a[:5]]
        out += ['  ONLY AFTER ' + k[:150] for k in only_b[:5]]
        ok &= not diff and not only_a and not only_b
        if families:
            fam, famb = collections.Counter(), collections.Counter()
            for k, v in A.items():
                fam[family(k)] += len(v) // 16
            for k, v in B.items():
                famb[family(k)] += len(v) // 16
            out += [f'    {f:20s} {fam[f]:8d} {famb[f]:8d}' for f in sorted(set(fam) | set(famb))]
    out.append('IDENTICAL' if ok else 'DIFFERENT')
    return out, ok


def rename_arg(text):
    pat, sep, rep = text.partition('=')
    if not sep:
        raise argparse.ArgumentTypeError(f'--rename {text!r}: expected REGEX=REPLACEMENT')
    try:
        re.compile(pat)
    except re.error as e:
        raise argparse.ArgumentTypeError(f'--rename {text!r}: {e}')
    return pat, rep


def main(argv=None):
    ap = argparse.ArgumentParser(description='compare two builds\' kept cubins kernel by kernel')
    ap.add_argument('before')
    ap.add_argument('after')
    ap.add_argument('--families', action='store_true', help='instructions per kernel family')
    ap.add_argument('--rename', action='append', default=[], type=rename_arg, metavar='REGEX=REPLACEMENT',
                    help='rename the first build\'s kernels (re.sub, in order) so that renamed kernels pair up')
    ap.add_argument('--removed', action='append', default=[], metavar='REGEX',
                    help='the first build\'s kernels that the second removes on purpose')
    args = ap.parse_args(argv)
    builds = []
    for d in (args.before, args.after):
        build = load(d)
        if not build:  # (a mistyped path, or a build without -keep: nothing compared is no "IDENTICAL")
            print(f'cuda_sass_cmp: {d}: no cubins found (a build folder made with nvcc -keep)', file=sys.stderr)
            return 2
        builds.append(build)
    lines, ok = compare(*builds, args.rename, args.removed, args.families)
    print('\n'.join(lines))
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(main())
