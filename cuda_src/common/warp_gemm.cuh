// cuda_src/common/warp_gemm.cuh -- warp-level matrix-product helpers shared by the backward kernels.
//
// Fragments follow the mma.sync m16n8k16 layouts documented in ptx.cuh: an fp32 accumulator of a
// [16, 8 NF] block is float[NF][4]; a 16-bit A operand of a [16, 16 KS] block is uint32_t[KS][4].
#pragma once
#include "ptx.cuh"

namespace cuflash {

template <int NF>
__device__ __forceinline__ void zero_frags(float (&acc)[NF][4]) {
#pragma unroll
  for (int f = 0; f < NF; ++f)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[f][e] = 0.f;
}

// fp32 C fragments of a [16, 16*KS] block -> 16-bit A fragments of the same block (C layout == A layout:
// n8 fragments 2k and 2k+1 form k16 step k).
template <typename T, int KS>
__device__ __forceinline__ void frags_to_a(const float (&c)[2 * KS][4], uint32_t (&a)[KS][4]) {
#pragma unroll
  for (int k = 0; k < KS; ++k) {
    a[k][0] = pack2<T>(c[2 * k][0], c[2 * k][1]);
    a[k][1] = pack2<T>(c[2 * k][2], c[2 * k][3]);
    a[k][2] = pack2<T>(c[2 * k + 1][0], c[2 * k + 1][1]);
    a[k][3] = pack2<T>(c[2 * k + 1][2], c[2 * k + 1][3]);
  }
}

// acc[16, 8*NF] += A[16, 16*KS] (registers) x B[16*KS, 8*NF], B = rows [0, 16*KS) x columns [col0, +8*NF)
// of a row-major smem tile (row stride lds), read with ldmatrix.trans (B must be "column-major").
template <typename T, int KS, int NF>
__device__ __forceinline__ void gemm_a_regs_b_trans(float (&acc)[NF][4], const uint32_t (&a)[KS][4], const T* b_tile,
                                                    int lds, int col0, int lane) {
#pragma unroll
  for (int k = 0; k < KS; ++k)
#pragma unroll
    for (int f = 0; f < NF; f += 2) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, smem_addr(b_tile + (k * 16 + (lane % 8) + ((lane / 8) % 2) * 8) * lds + col0 + f * 8 +
                                     (lane / 16) * 8));
      mma_m16n8k16<T>(acc[f], a[k], b[0], b[1]);
      mma_m16n8k16<T>(acc[f + 1], a[k], b[2], b[3]);
    }
}

}  // namespace cuflash
