/*
 * w4pack native ABI: the one public header shared by the C (CPU) and CUDA kernels and by the cffi cdef.
 *
 * Conventions
 *   - Every entry point returns an int status: W4P_OK (0) or a negative W4P_E* code; the message of the
 *     last error on the calling thread is available from w4p_last_error(). Nothing aborts the process.
 *   - Weights are in layout w4pack-tiles v1 (docs/LAYOUT.md): qweight int32 [Np/16][Kp/64 * 32 * wpl],
 *     scales/zeros/mins [Gp][Np], perm int32 [K] (optional).
 *   - This header is parsed by cffi: plain C declarations only, no macros beyond #define constants.
 */
#ifndef W4PACK_H
#define W4PACK_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define W4P_ABI_VERSION 1

#define W4P_OK 0
#define W4P_EINVAL -1
#define W4P_ENOMEM -2
#define W4P_EUNSUPPORTED -3
#define W4P_ENODEVICE -4
#define W4P_ECUDA -5

/* ---- common ------------------------------------------------------------------------------------ */
int w4p_abi_version(void);
const char *w4p_last_error(void);

/* ---- CPU ---------------------------------------------------------------------------------------- */
/* Bit set of the instruction-set paths this CPU can run (W4P_ISA_*). */
#define W4P_ISA_SCALAR 1
#define W4P_ISA_AVX2 2
#define W4P_ISA_AVX512 4
#define W4P_ISA_AVX512VNNI 8
#define W4P_ISA_NEON 16
int w4p_cpu_isa_available(void);
/* The path the dispatcher picks (honours W4PACK_ISA=scalar|avx2|avx512|neon). */
int w4p_cpu_isa_selected(void);
const char *w4p_cpu_isa_name(int isa);

/* W4P_CUDA_BEGIN ---- CUDA entry points (libw4p_cuda.so, loaded with ffi.dlopen) ------------------ */
/* W4P_CUDA_END */

#ifdef __cplusplus
}
#endif
#endif /* W4PACK_H */
