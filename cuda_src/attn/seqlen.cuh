// cuda_src/attn/seqlen.cuh -- one batch element's sequence lengths and where its rows live.
//
// Fixed lengths: every batch element has seqlen_q query rows and seqlen_k keys, except that a KV cache
// (FwdParams::seqlens_k) gives each its own key count, clamped to the cache's capacity. Rows of batch b, head h
// start at b * batch_stride + h * head_stride (elements) and are row_stride apart. Variable lengths (packed
// sequences) and paged caches change these two functions -- the lengths and the row offsets -- and nothing in
// the kernels that call them.
#pragma once
#include "params.cuh"
#include "mask.cuh"

namespace cuflash {

struct SeqInfo {
  int seqlen_q;  // query rows of this batch element
  int seqlen_k;  // keys it attends to

  // The bottom-right aligned causal diagonal: row i sees keys j <= i + diag (attn/mask.cuh).
  __device__ __forceinline__ int diag() const { return seqlen_k - seqlen_q; }
  template <bool CAUSAL>
  __device__ __forceinline__ Mask<CAUSAL> mask() const { return Mask<CAUSAL>(seqlen_k, diag()); }
  // The mask with the score modifiers of MOD (attn/mask.cuh) from a parameter block (FwdParams, BwdParams):
  // band edges, soft-cap, and the ALiBi slope of query head `head` of batch element `batch`.
  template <bool CAUSAL, int MOD, typename P>
  __device__ __forceinline__ Mask<CAUSAL, MOD> mask(const P& p, int batch, int head) const {
    if constexpr (MOD == MOD_NONE) {
      return Mask<CAUSAL, MOD>(seqlen_k, diag());
    } else {
      return Mask<CAUSAL, MOD>(seqlen_k, diag(), (int)p.window_left, (int)p.window_right, (float)p.softcap_pre,
                               alibi_slope(p, batch, head));
    }
  }
  // ALiBi slope of (batch, head) in the kernel's score units (P::alibi_mul: 1 / softmax_scale, or 1 / softcap);
  // 0 without slopes.
  template <typename P>
  __device__ __forceinline__ static float alibi_slope(const P& p, int batch, int head) {
    return p.alibi_slopes ? p.alibi_slopes[batch * p.alibi_batch_stride + head] * (float)p.alibi_mul : 0.f;
  }

  // Element offset of (batch, head)'s first row in a [b, s, h, d] tensor with these strides.
  __device__ __forceinline__ static int64_t offset(int64_t batch_stride, int64_t head_stride, int64_t batch,
                                                   int64_t head) {
    return batch * batch_stride + head * head_stride;
  }
};

// Forward, split-KV and decode kernels. KV cache: keys seen = min(seqlens_k[b] + seqlen_k_new, seqlen_k).
__device__ __forceinline__ SeqInfo seqinfo(const FwdParams& p, int batch) {
  const int seqlen_k = p.seqlens_k ? max(0, min(p.seqlens_k[batch] + (int)p.seqlen_k_new, (int)p.seqlen_k))
                                   : (int)p.seqlen_k;
  return {(int)p.seqlen_q, seqlen_k};
}
// Backward (V2 and V1) and the V1 forward: fixed lengths.
template <typename P>
__device__ __forceinline__ SeqInfo seqinfo_fixed(const P& p) {
  return {(int)p.seqlen_q, (int)p.seqlen_k};
}

// Forward kernels (mma.sync and sm_90): a block's coordinates from the grid, in either grid order (see
// FwdParams::grid_order).
struct FwdBlock {
  int m_block, head, batch, split;
};
__device__ __forceinline__ FwdBlock fwd_block_coords(const FwdParams& p, int num_m_blocks, uint3 bid) {
  FwdBlock c;
  if (p.grid_order == 0) {  // x: Q tile (heaviest causal tiles first), y: head, z: batch * splits
    c.m_block = num_m_blocks - 1 - (int)bid.x;
    c.head = bid.y;
    c.batch = bid.z / p.num_splits;
    c.split = bid.z % p.num_splits;
  } else {  // x: (batch, head), y: Q tile, z: split
    c.m_block = num_m_blocks - 1 - (int)bid.y;
    c.head = bid.x % p.nheads;
    c.batch = bid.x / p.nheads;
    c.split = bid.z;
  }
  return c;
}

}  // namespace cuflash
