// cuda_src/softmax.cu -- the softmax of standard (unfused) attention: P = softmax(scale * S) in place.
//
// The baseline computes attention the way frameworks did before fusion: S = Q K^T is materialized in
// device memory by cuBLAS, this kernel turns each row of S into probabilities (masked, scaled, in fp32
// internally, stored back in the input dtype), and cuBLAS computes O = P V. The [b, h, sq, sk] matrix
// is written and read several times: that traffic is what FlashAttention removes.
#include "common/ptx.cuh"

namespace cuflash {

// Online (max, sum) pair in base 2: merge (m2, l2) into (m, l).
__device__ __forceinline__ void merge_max_sum(float& m, float& l, float m2, float l2) {
  const float mn = fmaxf(m, m2);
  if (mn == -INFINITY) return;  // both empty
  l = l * exp2_approx(m - mn) + l2 * exp2_approx(m2 - mn);
  m = mn;
}

// One block per row of S [rows = b*h*sq, seqlen_k]; row r is query i = r % seqlen_q. Causal is
// bottom-right aligned: key j is visible iff j <= i + seqlen_k - seqlen_q. Fully masked rows -> zeros.
template <typename T>
__global__ void softmax_rows_kernel(T* s, int64_t seqlen_q, int64_t seqlen_k, float scale_log2, int causal) {
  __shared__ float red_m[32], red_l[32];
  const int64_t row = blockIdx.x;
  const int64_t i = row % seqlen_q;
  const int64_t last = causal ? i + seqlen_k - seqlen_q : seqlen_k - 1;  // last visible key
  T* x = s + row * seqlen_k;

  float m = -INFINITY, l = 0.f;  // pass 1: running max and sum of 2^(scale_log2 * s)
  for (int64_t j = threadIdx.x; j <= last && j < seqlen_k; j += blockDim.x)
    merge_max_sum(m, l, static_cast<float>(x[j]) * scale_log2, 1.f);
  for (int o = 16; o > 0; o /= 2)
    merge_max_sum(m, l, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, l, o));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nwarps = blockDim.x / 32;
  if (lane == 0) red_m[warp] = m, red_l[warp] = l;
  __syncthreads();  // every warp's partial (m, l) is in smem
  m = lane < nwarps ? red_m[lane] : -INFINITY;
  l = lane < nwarps ? red_l[lane] : 0.f;
  for (int o = 16; o > 0; o /= 2)
    merge_max_sum(m, l, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, l, o));

  const float inv_l = l > 0.f ? 1.f / l : 0.f;  // pass 2: P = 2^(scale_log2 * s - m) / l
  for (int64_t j = threadIdx.x; j < seqlen_k; j += blockDim.x)
    x[j] = static_cast<T>(j <= last ? exp2_approx(static_cast<float>(x[j]) * scale_log2 - m) * inv_l : 0.f);
}

}  // namespace cuflash
