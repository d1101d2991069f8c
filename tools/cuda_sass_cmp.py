"""Compare the kernels of two CUDA library builds, SASS section by section (no cuobjdump needed).

Keep each build's cubins, e.g.
    W4P_CUDA_FORCE=1 W4P_CUDA_OUT=/tmp/a/lib.so W4P_CUDA_DEFINES="-keep -keep-dir /tmp/a/keep" bash native/cuda/build.sh
then `python tools/cuda_sass_cmp.py /tmp/a/keep /tmp/b/keep [--families]`. Each kernel is an ELF section
.text.<symbol> of a cubin; kernels are matched by demangled name (namespaces dropped, so a move between files or
namespaces compares equal) and compared byte for byte; instruction counts are bytes / 16 (sm_70 and newer).
Exit status 0 when every kernel of every architecture is byte-identical.
"""
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
        arch = m.group(1)
        secs = sections(cub)
        nm = norm(list(secs))
        for k, v in secs.items():
            key = nm[k]
            assert key not in per_arch.setdefault(arch, {}), (arch, key)
            per_arch[arch][key] = v
    return per_arch

a, b = load(sys.argv[1]), load(sys.argv[2])
print('archs', sorted(a), sorted(b))
ok = True
for arch in sorted(set(a) | set(b)):
    A, B = a.get(arch, {}), b.get(arch, {})
    same = sum(1 for k in A if k in B and A[k] == B[k])
    diff = [k for k in A if k in B and A[k] != B[k]]
    only_a = [k for k in A if k not in B]
    only_b = [k for k in B if k not in A]
    ia, ib = sum(len(v) for v in A.values()) // 16, sum(len(v) for v in B.values()) // 16
    print(f'sm_{arch}: {len(A)} kernels before, {len(B)} after; byte-identical {same}; differing {len(diff)}; '
          f'only before {len(only_a)}; only after {len(only_b)}; instructions {ia} before, {ib} after')
    for k in diff[:10]: print('  DIFF', k[:150], len(A[k]) // 16, len(B[k]) // 16)
    for k in only_a[:5]: print('  ONLY BEFORE', k[:150])
    for k in only_b[:5]: print('  ONLY AFTER', k[:150])
    ok &= not diff and not only_a and not only_b
    if '--families' in sys.argv[3:]:
        fam = collections.Counter()
        for k, v in A.items():
            fam[re.match(r'void (\w+)', k).group(1) if k.startswith('void ') else k.split('(')[0]] += len(v) // 16
        famb = collections.Counter()
        for k, v in B.items():
            famb[re.match(r'void (\w+)', k).group(1) if k.startswith('void ') else k.split('(')[0]] += len(v) // 16
        for f in sorted(set(fam) | set(famb)):
            print(f'    {f:20s} {fam[f]:8d} {famb[f]:8d}')
print('IDENTICAL' if ok else 'DIFFERENT')
sys.exit(0 if ok else 1)
