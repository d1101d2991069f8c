/* Run-time choice of the CPU instruction-set path and the thread-local error message. */
#include "w4pack.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#if defined(__linux__) && defined(__x86_64__)
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

static _Thread_local char w4p_err[512];

void w4p_set_error(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(w4p_err, sizeof w4p_err, fmt, ap);
    va_end(ap);
}

const char *w4p_last_error(void) { return w4p_err; }

int w4p_abi_version(void) { return W4P_ABI_VERSION; }

#if defined(__linux__) && defined(__x86_64__)
/* Linux keeps the AMX tile data out of a process's state until it asks (arch_prctl ARCH_REQ_XCOMP_PERM for
   XFEATURE_XTILEDATA); a tile instruction before that faults. Asked once; the answer holds for the process. */
static int amx_granted;
static void ask_amx(void) { amx_granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) == 0; }
#endif

int w4p_cpu_isa_available(void) {
    int isa = W4P_ISA_SCALAR;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        isa |= W4P_ISA_AVX2;
    /* libgcc's feature bits include the OS check (XCR0) for YMM/ZMM state */
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512dq") && (isa & W4P_ISA_AVX2))
        isa |= W4P_ISA_AVX512;
    if ((isa & W4P_ISA_AVX512) && __builtin_cpu_supports("avx512vnni"))
        isa |= W4P_ISA_AVX512VNNI;
#if defined(__linux__) && defined(__x86_64__)
    if ((isa & W4P_ISA_AVX512VNNI) && __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") &&
        __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vbmi")) {
        static pthread_once_t once = PTHREAD_ONCE_INIT;
        pthread_once(&once, ask_amx);
        if (amx_granted) isa |= W4P_ISA_AMX;
    }
#endif
#elif defined(__aarch64__)
    isa |= W4P_ISA_NEON;
#endif
    return isa;
}

int w4p_cpu_isa_selected(void) {
    int avail = w4p_cpu_isa_available();
    const char *force = getenv("W4PACK_ISA");
    if (force && *force) {
        if (!strcmp(force, "scalar")) return W4P_ISA_SCALAR;
        if (!strcmp(force, "avx2") && (avail & W4P_ISA_AVX2)) return W4P_ISA_AVX2;
        /* "avx512" is the AVX-512 path with VNNI where present; "avx512novnni" forces the maddubs variant */
        if (!strcmp(force, "avx512") && (avail & W4P_ISA_AVX512VNNI)) return W4P_ISA_AVX512VNNI;
        if (!strcmp(force, "avx512") && (avail & W4P_ISA_AVX512)) return W4P_ISA_AVX512;
        if (!strcmp(force, "avx512vnni") && (avail & W4P_ISA_AVX512VNNI)) return W4P_ISA_AVX512VNNI;
        if (!strcmp(force, "avx512novnni") && (avail & W4P_ISA_AVX512)) return W4P_ISA_AVX512;
        if (!strcmp(force, "amx") && (avail & W4P_ISA_AMX)) return W4P_ISA_AMX;
        if (!strcmp(force, "neon") && (avail & W4P_ISA_NEON)) return W4P_ISA_NEON;
    }
    if (avail & W4P_ISA_AMX) return W4P_ISA_AMX;
    if (avail & W4P_ISA_AVX512VNNI) return W4P_ISA_AVX512VNNI;
    if (avail & W4P_ISA_AVX512) return W4P_ISA_AVX512;
    if (avail & W4P_ISA_AVX2) return W4P_ISA_AVX2;
    if (avail & W4P_ISA_NEON) return W4P_ISA_NEON;
    return W4P_ISA_SCALAR;
}

const char *w4p_cpu_isa_name(int isa) {
    switch (isa) {
    case W4P_ISA_SCALAR: return "scalar";
    case W4P_ISA_AVX2: return "avx2";
    case W4P_ISA_AVX512: return "avx512novnni";
    case W4P_ISA_AVX512VNNI: return "avx512vnni";
    case W4P_ISA_NEON: return "neon";
    case W4P_ISA_AMX: return "amx";
    default: return "unknown";
    }
}
