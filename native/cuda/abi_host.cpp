// The ABI's host-only entry points (native/w4pack.h): version, last error, the plan on a described device and
// the decode attention's workspace size.
// Built into libw4p_cuda.so and, with the planner, into the planner's own library (no CUDA needed).
#include "params.h"
#include "planner.h"

#define W4P_CUDA_ABI 6

using namespace w4p;

extern "C" {

int w4p_cuda_abi_version(void) { return W4P_CUDA_ABI; }

const char *w4p_cuda_last_error(void) { return g_err; }

int w4p_cuda_plan_for(int sms, int cc, int smem_sm, int smem_block, int smem_reserved, int64_t m, int n, int k,
                      int storage_bits, int group_size, int act_order, int x_aligned, int kernel, int splits,
                      int *kernel_out, int *splits_out, size_t *workspace_bytes) {
  if (bad_description(sms, cc, smem_sm, smem_block, smem_reserved)) return W4P_EINVAL;
  return plan_on(described(sms, cc, smem_sm, smem_block, smem_reserved), m, n, k, storage_bits, group_size,
                 act_order, x_aligned, kernel, splits, kernel_out, splits_out, workspace_bytes);
}

int w4p_cuda_plan_describe_for(int sms, int cc, int smem_sm, int smem_block, int smem_reserved, int64_t m, int n,
                               int k, int storage_bits, int group_size, int act_order, int x_aligned, int kernel,
                               int splits, char *buf, size_t len) {
  if (bad_description(sms, cc, smem_sm, smem_block, smem_reserved)) return W4P_EINVAL;
  return describe_on(described(sms, cc, smem_sm, smem_block, smem_reserved), m, n, k, storage_bits, group_size,
                     act_order, x_aligned, kernel, splits, buf, len);
}

size_t w4p_cuda_decode_attention_workspace(int heads, int kv_heads, int head_dim, int splits) {
  if (heads < 1 || kv_heads < 1 || head_dim < 1 || splits < 1 || heads % kv_heads) return 0;
  if (splits == 1) return 0;
  return attn_counter_bytes(kv_heads) +
         (size_t)kv_heads * (size_t)splits * (size_t)(heads / kv_heads) * (size_t)(head_dim + 2) * sizeof(float);
}

}  // extern "C"
