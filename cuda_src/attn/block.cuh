// cuda_src/attn/block.cuh -- which tiles a thread block visits.
//
// Forward (Q tile outer, KV loop inside): a Q tile of rows [m0, rows_end) visits the KV tiles of BLOCK_N keys
// [kv_block_begin, kv_block_end); with causal, tiles entirely above the diagonal of its last row are never
// loaded. Split-KV (Flash-Decoding) cuts that range into num_splits contiguous pieces (split_range). Backward
// (KV tile outer, Q loop inside): a KV tile of keys [n0, n_end) visits the Q tiles [q_block_begin, q_block_end);
// with causal, tiles whose rows all lie above its diagonal are skipped. Every kernel takes its loop bounds from
// these four functions, so a local window changes them here only: kv_block_begin and q_block_end are the
// window's edges (today: 0 and all Q tiles), from the same window that attn/mask.cuh tests per element.
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
// The first KV tile of BLOCK_N keys that rows from rows_begin on visit (no left window edge yet: 0).
template <int BLOCK_N, bool CAUSAL>
__device__ __forceinline__ int kv_block_begin(const Mask<CAUSAL>& /*mask*/, int /*rows_begin*/) {
  return 0;
}
// KV tiles [.., kv_block_end) of BLOCK_N keys that rows before rows_end visit.
template <int BLOCK_N, bool CAUSAL>
__device__ __forceinline__ int kv_block_end(const Mask<CAUSAL>& mask, int rows_end) {
  return (kv_key_end(mask, rows_end) + BLOCK_N - 1) / BLOCK_N;
}
// Split `split` of num_splits over a row's KV tiles [n_begin, n_total), in whole granules of `granule` tiles:
// ranges of ceil((n_total - n_begin) / (num_splits granule)) granules from n_begin on, the last ones clipped to
// n_end (causal) or empty.
__device__ __forceinline__ BlockRange split_range(int n_begin, int n_total, int n_end, int split, int num_splits,
                                                  int granule = 1) {
  const int per = (n_total - n_begin + num_splits * granule - 1) / (num_splits * granule) * granule;
  const int begin = n_begin + split * per;
  return {begin, min(n_end, begin + per)};
}
// Backward: the first Q tile of BLOCK_M rows with a row that sees a key of the KV tile starting at key n0.
template <int BLOCK_M, bool CAUSAL>
__device__ __forceinline__ int q_block_begin(const Mask<CAUSAL>& mask, int n0) {
  return CAUSAL && n0 - mask.diag > 0 ? (n0 - mask.diag) / BLOCK_M : 0;
}
// Backward: the Q tiles [.., q_block_end) of BLOCK_M rows that see a key before n_end (no right window edge yet:
// all num_m_blocks).
template <int BLOCK_M, bool CAUSAL>
__device__ __forceinline__ int q_block_end(const Mask<CAUSAL>& /*mask*/, int /*n_end*/, int num_m_blocks) {
  return num_m_blocks;
}

}  // namespace cuflash
