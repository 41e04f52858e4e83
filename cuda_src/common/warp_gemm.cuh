// cuda_src/common/warp_gemm.cuh -- warp-level matrix-product helpers shared by the kernels.
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
// acc *= s for every fragment of [M][NF] accumulator blocks.
template <int M, int NF>
__device__ __forceinline__ void scale_frags(float (&acc)[M][NF][4], float s) {
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int f = 0; f < NF; ++f)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[m][f][e] *= s;
}

// Byte offset of this lane's ldmatrix.x4 row address from the origin of a 16-bit smem block with row stride
// LD elements. Added once to a 32-bit shared base address, it leaves every fragment's address a compile-time
// constant away ([register + immediate] in SASS, no per-fragment address registers).
// A operand [16 m, 16 k]: KMAJOR = stored transposed (rows = k; ldmatrix.trans), else rows = m (plain).
// B operand [16 k, 16 n] (two n8 fragments): KMAJOR = stored row-major [k, n] (ldmatrix.trans, e.g. V in P V),
// else stored as B^T [n, k] (plain ldmatrix, e.g. K in Q K^T).
template <bool KMAJOR, int LD>
__device__ __forceinline__ uint32_t lane_off_a(int lane) {  // bytes
  return 2u * (KMAJOR ? ((lane % 8) + (lane / 16) * 8) * LD + ((lane / 8) % 2) * 8 : (lane % 16) * LD + (lane / 16) * 8);
}
template <bool KMAJOR, int LD>
__device__ __forceinline__ uint32_t lane_off_b(int lane) {  // bytes
  return 2u * (KMAJOR ? ((lane % 8) + ((lane / 8) % 2) * 8) * LD + (lane / 16) * 8
                      : ((lane % 8) + (lane / 16) * 8) * LD + ((lane / 8) % 2) * 8);
}

// fp32 C fragments of a [16, 16*KS] block -> 16-bit A fragments of the same block (C layout == A layout:
// n8 fragments 2k and 2k+1 form k16 step k).
template <typename T, int NF>
__device__ __forceinline__ void frag_to_a(const float (&c)[NF][4], int k, uint32_t (&a)[4]) {  // k16 step k only
  a[0] = pack2<T>(c[2 * k][0], c[2 * k][1]);
  a[1] = pack2<T>(c[2 * k][2], c[2 * k][3]);
  a[2] = pack2<T>(c[2 * k + 1][0], c[2 * k + 1][1]);
  a[3] = pack2<T>(c[2 * k + 1][2], c[2 * k + 1][3]);
}
template <typename T, int KS>
__device__ __forceinline__ void frags_to_a(const float (&c)[2 * KS][4], uint32_t (&a)[KS][4]) {
#pragma unroll
  for (int k = 0; k < KS; ++k) frag_to_a<T>(c, k, a[k]);
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

// acc[16 MF, 8 NF] = sum over KD k16 steps of A B^T -- the S = Q K^T of the forward kernels. a_frag(a, mf, kd)
// fills the A fragment of m16 block mf at k16 step kd (from registers, or ldmatrix); b_addr(nf, kd) is this
// lane's ldmatrix.x4 address of n8 blocks nf, nf + 1 at step kd (B^T col-major = the rows of a row-major
// tile, plain ldmatrix: one x4 gives b0, b1 of two adjacent n8 fragments). UNROLL k16 steps per loop trip
// (default all): fully unrolled, ptxas may hoist the ldmatrix of later steps far enough to run out of registers.
template <typename T, int MF, int NF, int KD, int UNROLL = KD, typename AFrag, typename BAddr>
__device__ __forceinline__ void gemm_abt_x4(float (&acc)[MF][NF][4], const AFrag& a_frag, const BAddr& b_addr) {
#pragma unroll
  for (int mf = 0; mf < MF; ++mf) zero_frags(acc[mf]);
#pragma unroll UNROLL
  for (int kd = 0; kd < KD; ++kd) {
    uint32_t a[MF][4];
#pragma unroll
    for (int mf = 0; mf < MF; ++mf) a_frag(a[mf], mf, kd);
#pragma unroll
    for (int nf = 0; nf < NF; nf += 2) {
      uint32_t b[4];
      ldmatrix_x4(b, b_addr(nf, kd));
#pragma unroll
      for (int mf = 0; mf < MF; ++mf) {
        mma_m16n8k16<T>(acc[mf][nf], a[mf], b[0], b[1]);
        mma_m16n8k16<T>(acc[mf][nf + 1], a[mf], b[2], b[3]);
      }
    }
  }
}

// acc[16 MF, 8 DF] += P V -- the O += P V of the forward kernels. p_frag(a, mf, kn) fills the 16-bit A
// fragment of P for m16 block mf at k16 step kn (typically packed from the fp32 S/P accumulators right there,
// frag_to_a, so only one step's fragments are live); v_addr(kn, df) is this lane's ldmatrix.x4.trans address
// of V rows [16 kn, +16) x columns of n8 blocks df, df + 1 (V is row-major [keys, D]; the B operand wants it
// column-major).
template <typename T, int MF, int KN, int DF, typename PFrag, typename VAddr>
__device__ __forceinline__ void gemm_pv_x4(float (&acc)[MF][DF][4], const PFrag& p_frag, const VAddr& v_addr) {
#pragma unroll
  for (int kn = 0; kn < KN; ++kn) {
    uint32_t a[MF][4];
#pragma unroll
    for (int mf = 0; mf < MF; ++mf) p_frag(a[mf], mf, kn);
#pragma unroll
    for (int df = 0; df < DF; df += 2) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, v_addr(kn, df));
#pragma unroll
      for (int mf = 0; mf < MF; ++mf) {
        mma_m16n8k16<T>(acc[mf][df], a[mf], b[0], b[1]);
        mma_m16n8k16<T>(acc[mf][df + 1], a[mf], b[2], b[3]);
      }
    }
  }
}

}  // namespace cuflash
