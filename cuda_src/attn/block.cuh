// cuda_src/attn/block.cuh -- which tiles a thread block visits.
//
// Forward (Q tile outer, KV loop inside): a Q tile of rows [m0, rows_end) visits the KV tiles of BLOCK_N keys
// [kv_block_begin, kv_block_end); with causal, tiles entirely above the diagonal of its last row are never
// loaded. Split-KV (Flash-Decoding) cuts that range into num_splits contiguous pieces (split_range). Backward
// (KV tile outer, Q loop inside): a KV tile of keys [n0, n_end) visits the Q tiles [q_block_begin, q_block_end);
// with causal, tiles whose rows all lie above its diagonal are skipped. Every kernel takes its loop bounds from
// these four functions: a local window (attn/mask.cuh, LOCAL) moves kv_block_begin / q_block_end to its left
// edge and kv_block_end / q_block_begin to its right edge (the causal diagonal is a right edge at 0), from the
// same band that attn/mask.cuh tests per element. The cost of a windowed row is then its band, not seqlen_k.
#pragma once
#include "mask.cuh"

namespace cuflash {

struct BlockRange {
  int begin, end;  // [begin, end); empty when end <= begin
};

// Keys [0, kv_key_end) that some row before rows_end can see (the right edge of the last row's band).
template <class M>
__device__ __forceinline__ int kv_key_end(const M& mask, int rows_end) {
  if constexpr (M::LOCAL) return max(0, min(mask.seqlen_k, rows_end + mask.diag + mask.right));
  return M::IS_CAUSAL ? min(mask.seqlen_k, rows_end + mask.diag) : mask.seqlen_k;
}
// The first KV tile of BLOCK_N keys that rows from rows_begin on visit (the left edge of the first row's band).
template <int BLOCK_N, class M>
__device__ __forceinline__ int kv_block_begin(const M& mask, int rows_begin) {
  if constexpr (M::LOCAL) return min(max(0, rows_begin + mask.diag - mask.left), mask.seqlen_k) / BLOCK_N;
  return 0;
}
// KV tiles [.., kv_block_end) of BLOCK_N keys that rows before rows_end visit.
template <int BLOCK_N, class M>
__device__ __forceinline__ int kv_block_end(const M& mask, int rows_end) {
  return (kv_key_end(mask, rows_end) + BLOCK_N - 1) / BLOCK_N;
}
// Of a block's KV tiles [n_end - n_iters, n_end), visited last first, those hidden from every row of
// [rows_begin, rows_end): `lead` first ones right of the band of its last row (the causal diagonal, a window's right
// edge) and `tail` last ones left of the band of its first row (a window's left edge); all of them lead when the
// range holds no row. A Hopper forward warpgroup of these rows takes their turns empty (flash_fwd_sm90.cu).
struct HiddenTiles {
  int lead, tail;
};
template <int BLOCK_N, class M>
__device__ __forceinline__ HiddenTiles hidden_tiles(const M& mask, int rows_begin, int rows_end, int n_end,
                                                    int n_iters) {
  if (rows_end <= rows_begin) return {n_iters, 0};
  const int lead = min(n_iters, max(0, n_end - kv_block_end<BLOCK_N>(mask, rows_end)));
  return {lead, min(n_iters - lead, max(0, kv_block_begin<BLOCK_N>(mask, rows_begin) - (n_end - n_iters)))};
}
// Split `split` of num_splits over a row's KV tiles [n_begin, n_total) (n_begin <= n_total: kv_block_begin is
// clamped to the keys), in whole granules of `granule` tiles:
// ranges of ceil((n_total - n_begin) / (num_splits granule)) granules from n_begin on, the last ones clipped to
// n_end (causal, window) or empty.
__device__ __forceinline__ BlockRange split_range(int n_begin, int n_total, int n_end, int split, int num_splits,
                                                  int granule = 1) {
  const int per = (n_total - n_begin + num_splits * granule - 1) / (num_splits * granule) * granule;
  const int begin = n_begin + split * per;
  return {begin, min(n_end, begin + per)};
}
// Backward: the first Q tile of BLOCK_M rows with a row that sees a key of the KV tile starting at key n0 (rows
// i with i + diag (+ right) >= n0).
template <int BLOCK_M, class M>
__device__ __forceinline__ int q_block_begin(const M& mask, int n0) {
  if constexpr (M::LOCAL) return max(0, n0 - mask.diag - mask.right) / BLOCK_M;
  return M::IS_CAUSAL && n0 - mask.diag > 0 ? (n0 - mask.diag) / BLOCK_M : 0;
}
// Backward: the Q tiles [.., q_block_end) of BLOCK_M rows that see a key before n_end (all num_m_blocks but with
// a left window edge: rows i with i + diag - left <= n_end - 1).
template <int BLOCK_M, class M>
__device__ __forceinline__ int q_block_end(const M& mask, int n_end, int num_m_blocks) {
  if constexpr (M::LOCAL) return min(num_m_blocks, (max(0, n_end - mask.diag + mask.left) + BLOCK_M - 1) / BLOCK_M);
  return num_m_blocks;
}

}  // namespace cuflash
