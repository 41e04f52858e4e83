// cuda_src/attn/dropout.cuh -- attention dropout: which probabilities are dropped, the one definition the forward,
// the backward and the mask kernel share.
//
// Element (bh, i, j) -- batch * nheads + head, query row i, key j -- is kept iff its 16-bit random number is below
// `keep` = 65536 (1 - p) (the host's dropout_keep). The numbers come from Philox4x32-10 (Salmon et al., SC'11: the
// counter-based generator of cuRAND and torch) keyed by the call's seed, 128 bits per counter, and the counter of
// an element is chosen so that one thread evaluates it whatever the layout of its registers:
//
//   counter = (row group, column group, bh, offset)   row group  = (i / 16) * 8 + i % 8
//   key     = (seed_lo, seed_hi ^ offset_hi)          column group = (j / 16) * 4 + (j % 8) / 2
//   number  = 16-bit half (j % 2) of word ((i / 8) % 2) * 2 + (j / 8) % 2
//
// A group is the 8 elements rows {r, r + 8} x columns {2c, 2c + 1, 2c + 8, 2c + 9} of a 16 x 16 block: in the
// m16n8 accumulator layout (rows g, g + 8, columns 2t, 2t + 1 of each n8 block) exactly the elements thread (g, t)
// holds of two adjacent n8 blocks -- one Philox call per 8 probabilities -- and in the transposed layout of the
// backward's S^T = K Q^T (keys g, g + 8, queries 2t, 2t + 1) half of a group's elements: two calls per 8. The
// mask kernel (flash_fwd.cu: dropout_mask_kernel) and the host's reference (cuflash/_dropout.py) compute the same
// numbers, so a test can compare the kernels' dropout with an explicit mask.
//
// The forward zeroes a dropped P before O += P V (the row sum l keeps every probability: flash-attn's semantics)
// and scales O by 1 / (1 - p). The backward marks a dropped P by its sign (ENCODE): dV takes max(P, 0), and
// dS = P (dP / (1 - p) - D) where kept, -P D where dropped (D = rowsum(dO O) holds with the dropped O).
#pragma once
#include "../common/ptx.cuh"

namespace cuflash {

// Philox4x32 with 10 rounds.
__device__ __forceinline__ uint4 philox4x32_10(uint4 c, uint2 k) {
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    const uint32_t lo0 = c.x * 0xD2511F53u, hi0 = __umulhi(c.x, 0xD2511F53u);
    const uint32_t lo1 = c.z * 0xCD9E8D57u, hi1 = __umulhi(c.z, 0xCD9E8D57u);
    c = make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
    k.x += 0x9E3779B9u;
    k.y += 0xBB67AE85u;
  }
  return c;
}

// Word w of a uint4.
__device__ __forceinline__ uint32_t word_of(const uint4& r, int w) {
  return w == 0 ? r.x : w == 1 ? r.y : w == 2 ? r.z : r.w;
}

struct Dropout {
  uint2 key;
  uint32_t bh, offset_lo, keep;

  template <typename Params>
  __device__ __forceinline__ Dropout(const Params& p, int64_t bh_)
      : bh((uint32_t)bh_), offset_lo((uint32_t)(uint64_t)p.rng_offset), keep((uint32_t)p.dropout_keep) {
    const uint64_t seed = (uint64_t)p.rng_seed, off = (uint64_t)p.rng_offset;
    key = make_uint2((uint32_t)seed, (uint32_t)(seed >> 32) ^ (uint32_t)(off >> 32));
  }

  __device__ __forceinline__ uint4 group(uint32_t row_group, uint32_t col_group) const {
    return philox4x32_10(make_uint4(row_group, col_group, bh, offset_lo), key);
  }
  __device__ __forceinline__ bool kept(const uint4& r, int word, int half) const {
    return ((word_of(r, word) >> (16 * half)) & 0xFFFFu) < keep;
  }
  // A dropped value: 0 (forward) or marked by its sign (ENCODE: the backward).
  template <bool ENCODE>
  __device__ __forceinline__ static float dropped(float x) { return ENCODE ? -x : 0.f; }

  // Accumulator layout: n8 blocks lo, hi = keys [col0, col0 + 8), [col0 + 8, col0 + 16) of the m16 band of rows
  // [row0, row0 + 16) (row0, col0 multiples of 16); element e of a block: row g + 8 (e / 2), key 2t + e % 2.
  template <bool ENCODE>
  __device__ __forceinline__ void pair(float (&lo)[4], float (&hi)[4], int row0, int col0, int g, int t) const {
    const uint4 r = group((uint32_t)(row0 / 16 * 8 + g), (uint32_t)(col0 / 16 * 4 + t));
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (!kept(r, (e / 2) * 2 + 0, e % 2)) lo[e] = dropped<ENCODE>(lo[e]);
      if (!kept(r, (e / 2) * 2 + 1, e % 2)) hi[e] = dropped<ENCODE>(hi[e]);
    }
  }
  // Every pair of a warp's [MF m16 bands][NF n8 blocks] tile at (row0, col0).
  template <bool ENCODE, int MF, int NF>
  __device__ __forceinline__ void apply(float (&s)[MF][NF][4], int row0, int col0, int lane) const {
    static_assert(NF % 2 == 0, "whole 16-key pairs");
#pragma unroll
    for (int mf = 0; mf < MF; ++mf)
#pragma unroll
      for (int J = 0; J < NF / 2; ++J)
        pair<ENCODE>(s[mf][2 * J], s[mf][2 * J + 1], row0 + 16 * mf, col0 + 16 * J, lane / 4, lane % 4);
  }
  // Transposed layout (rows = keys): n8 blocks lo, hi = queries [q0, q0 + 8), [q0 + 8, q0 + 16) of the 16 keys
  // [key0, key0 + 16) (multiples of 16); element e: key g + 8 (e / 2), query 2t + e % 2. Two groups: query
  // parities 0 and 1, each read for the keys of this lane's parity g % 2.
  template <bool ENCODE>
  __device__ __forceinline__ void pair_t(float (&lo)[4], float (&hi)[4], int key0, int q0, int g, int t) const {
#pragma unroll
    for (int qe = 0; qe < 2; ++qe) {
      const uint4 r = group((uint32_t)(q0 / 16 * 8 + 2 * t + qe), (uint32_t)(key0 / 16 * 4 + g / 2));
#pragma unroll
      for (int kh = 0; kh < 2; ++kh) {  // key g + 8 kh: word (query block) * 2 + kh, half g % 2
        const int e = kh * 2 + qe;
        if (!kept(r, 0 * 2 + kh, g % 2)) lo[e] = dropped<ENCODE>(lo[e]);
        if (!kept(r, 1 * 2 + kh, g % 2)) hi[e] = dropped<ENCODE>(hi[e]);
      }
    }
  }
  // Every pair of a warp's [NF n8 blocks of queries] x 16 keys transposed tile (keys key0.., queries q0..).
  template <bool ENCODE, int NF>
  __device__ __forceinline__ void apply_t(float (&s)[NF][4], int key0, int q0, int lane) const {
    static_assert(NF % 2 == 0, "whole 16-query pairs");
#pragma unroll
    for (int J = 0; J < NF / 2; ++J) pair_t<ENCODE>(s[2 * J], s[2 * J + 1], key0, q0 + 16 * J, lane / 4, lane % 4);
  }
};

// |x| where a P may carry dropout's sign (ABS: the dropout kernels), else x.
template <bool ABS>
__device__ __forceinline__ float abs_if(float x) { return ABS ? fabsf(x) : x; }

// dS of one element with dropout: p is P marked by its sign (Dropout::dropped<true>), dp = dO V^T of the dropped
// output, dl = D of its row, scale = 1 / (1 - p_drop).
__device__ __forceinline__ float dropout_ds(float p, float dp, float dl, float scale) {
  return p >= 0.f ? p * (dp * scale - dl) : p * dl;
}

// max(x, 0) of both 16-bit halves of a packed pair (dV's operand from the sign-marked P).
template <typename T>
__device__ __forceinline__ uint32_t relu2(uint32_t x);
template <>
__device__ __forceinline__ uint32_t relu2<__half>(uint32_t x) {
  uint32_t r;
  asm("max.f16x2 %0, %1, %2;\n" : "=r"(r) : "r"(x), "r"(0u));
  return r;
}
template <>
__device__ __forceinline__ uint32_t relu2<__nv_bfloat16>(uint32_t x) {
  uint32_t r;
  asm("max.bf16x2 %0, %1, %2;\n" : "=r"(r) : "r"(x), "r"(0u));
  return r;
}

}  // namespace cuflash
