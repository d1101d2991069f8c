// PTX wrappers shared by the kernels: mma.sync, ldmatrix, cp.async, plain streaming loads, named and
// cluster barriers, mbarriers, the bulk copy engine, L2 prefetches and programmatic dependent launch.
#pragma once
#include "dequant.cuh"
#include "params.h"

namespace w4p {

template <typename T> __device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <> __device__ __forceinline__ void mma<half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <> __device__ __forceinline__ void mma<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x2(uint32_t addr, uint32_t &r0, uint32_t &r1) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(addr));
}

__device__ __forceinline__ uint4 ld_stream(const uint4 *p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ void cp_async16(void *smem, const void *gmem, bool valid) {
  int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem)), "l"(gmem), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
// 4 bytes (cp.async's smallest copy; through L1, as .cg takes 16 only)
__device__ __forceinline__ void cp_async4(void *smem, const void *gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_u32(smem)), "l"(gmem));
}
// the wait as a compiler barrier too, for a thread that reads what it copied with no block barrier after the wait
template <int N> __device__ __forceinline__ void cp_async_wait_mem() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// A block barrier, or (nt > 0) named barrier 1 over threads 0..nt-1 where the others have left (wgmma_ws's
// 256-row blocks and 256-token tile, whose producer warpgroup leaves before the epilogue)
__device__ __forceinline__ void block_or_named_sync(int nt) {
  if (nt == 0)
    __syncthreads();
  else
    asm volatile("bar.sync 1, %0;\n" ::"r"(nt) : "memory");
}
// Named barrier `id` over n threads that also returns whether any of them passed true: a flag handed to the
// others without shared memory (racecheck reported a shared flag's store and loads as a hazard in a few runs
// although a barrier ordered them)
__device__ __forceinline__ bool named_any(int id, int n, bool v) {
  unsigned r;
  asm volatile(
      "{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n bar.red.or.pred q, %2, %3, p;\n selp.u32 %0, 1, 0, q;\n}\n"
      : "=r"(r) : "r"((unsigned)v), "r"(id), "r"(n) : "memory");
  return r != 0;
}
// block_or_named_sync's barrier with named_any's flag
__device__ __forceinline__ bool block_or_named_any(int nt, bool v) {
  return nt == 0 ? __syncthreads_or(v) != 0 : named_any(1, nt, v);
}

__device__ __forceinline__ void cluster_barrier() {
#if __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release;\n" ::: "memory");
  asm volatile("barrier.cluster.wait.acquire;\n" ::: "memory");
#endif
}
__device__ __forceinline__ float4 ld_cluster_f4(uint32_t addr, uint32_t rank) {
  float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#if __CUDA_ARCH__ >= 900
  uint32_t ra;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(ra) : "r"(addr), "r"(rank));
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(ra) : "memory");
#endif
  return v;
}

// Programmatic dependent launch (sm_90; p.pdl != 0, launch_ex): a kernel launched with it may start while the kernel
// before it on the stream still runs, so each thread reads or writes global memory only after pdl_start's
// griddepcontrol.wait, which returns once that kernel has completed and its writes are visible (at once where the
// launch had no such dependency). What comes before it (the barriers' set-up, the block's share of the work, L2
// prefetches) overlaps the previous kernel's tail. p.pdl == 1 also lets the next such launch begin now: its blocks
// start wherever an SM has room (on a full GPU, as this kernel's blocks leave) and wait there in turn. Measured on
// an H200 in graphs of back-to-back calls: 0.5-1.5 us less per call on the 7B Llama shapes, 0-1 us on the 70B
// ones (docs/journal/2026-cuda.md).
__device__ __forceinline__ void pdl_start(const Params &p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  if (p.pdl != 2) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void mbar_init(uint32_t bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, unsigned parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  } while (!done);
}
// The copies-only probes' consumers: each of nsteps stages (NS barriers full0 / empty0, 8 bytes apart) freed as
// soon as it lands
__device__ __forceinline__ void probe_drain(uint32_t full0, uint32_t empty0, int NS, int nsteps) {
  for (int i = 0; i < nsteps; ++i) {
    mbar_wait(full0 + 8 * (i % NS), (i / NS) & 1);
    mbar_arrive(empty0 + 8 * (i % NS));
  }
}
// (pol: an L2 policy from createpolicy, e.g. evict-first for the weights, evict-last for the activations)
// L2 prefetches: hints only (L2 is where the GPU's writes land, so a line prefetched before another kernel writes
// it is never read stale), hence allowed before pdl_start
__device__ __forceinline__ void prefetch_l2(const void *src, unsigned bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_copy_hinted(uint32_t dst, const void *src, unsigned bytes, uint32_t bar,
                                                 uint64_t pol) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;\n"
      ::"r"(dst), "l"(src), "r"(bytes), "r"(bar), "l"(pol) : "memory");
}
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace w4p
