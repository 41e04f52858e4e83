// cuda_src/attn/block.cuh -- which tiles a thread block visits.
//
// Forward (Q tile outer, KV loop inside): a Q tile of rows [m0, rows_end) visits the KV tiles of BLOCK_N keys
// [0, kv_block_end); with causal, tiles entirely above the diagonal of its last row are never loaded. Split-KV
// (Flash-Decoding) cuts a row's tiles into num_splits contiguous ranges (split_range). Backward (KV tile outer,
// Q loop inside): a KV tile starting at key n0 visits the Q tiles [q_block_begin, num_m_blocks); with causal,
// tiles whose rows all lie above its diagonal are skipped. A local window adds the lower bound of the KV range
// and the upper bound of the Q range here, from the same window that attn/mask.cuh tests per element.
#pragma once
#include "mask.cuh"

namespace cuflash {

struct BlockRange {
  int begin, end;  // [begin, end); empty when end <= begin
};

// Keys [0, kv_key_end) that some row before rows_end can see.
template <bool CAUSAL>
__device__ __forceinline__ int kv_key_end(const Mask<CAUSAL>& mask, int rows_end) {
  return CAUSAL ? min(mask.seqlen_k, rows_end + mask.diag) : mask.seqlen_k;
}
// KV tiles [0, kv_block_end) of BLOCK_N keys that rows before rows_end visit.
template <int BLOCK_N, bool CAUSAL>
__device__ __forceinline__ int kv_block_end(const Mask<CAUSAL>& mask, int rows_end) {
  return (kv_key_end(mask, rows_end) + BLOCK_N - 1) / BLOCK_N;
}
// Split `split` of num_splits over a row's n_total KV tiles, in whole granules of `granule` tiles: ranges of
// ceil(n_total / (num_splits granule)) granules, the last ones clipped to n_end (causal) or empty.
__device__ __forceinline__ BlockRange split_range(int n_total, int n_end, int split, int num_splits, int granule = 1) {
  const int per = (n_total + num_splits * granule - 1) / (num_splits * granule) * granule;
  const int begin = split * per;
  return {begin, min(n_end, begin + per)};
}
// Backward: the first Q tile of BLOCK_M rows with a row that sees a key of the KV tile starting at key n0.
template <int BLOCK_M, bool CAUSAL>
__device__ __forceinline__ int q_block_begin(const Mask<CAUSAL>& mask, int n0) {
  return CAUSAL && n0 - mask.diag > 0 ? (n0 - mask.diag) / BLOCK_M : 0;
}

}  // namespace cuflash
