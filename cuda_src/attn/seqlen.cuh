// cuda_src/attn/seqlen.cuh -- one batch element's sequence lengths and where its rows live.
//
// Fixed lengths: every batch element has seqlen_q query rows and seqlen_k keys, except that a KV cache
// (FwdParams::seqlens_k) gives each its own key count, clamped to the cache's capacity. Rows of batch b, head h
// start at b * batch_stride + h * head_stride (elements) and are row_stride apart.
//
// Variable lengths (packed sequences, flash-attn's varlen functions): cu_seqlens_q / cu_seqlens_k, int32 [batch + 1]
// prefix sums, give batch element b the packed rows [cu[b], cu[b + 1]) of a [total, heads, d] tensor. The host then
// sets the batch strides to 0, so the same offset formula holds with the element's first row (q_start, k_start)
// added. The grid has no max_seqlen in it (so the host never reads the lengths): its tiles are laid out over all
// elements at once, element b's first tile of R rows being tile cu[b] / R + b (varlen_tile), which leaves room for
// its ceil(len / R) tiles and wastes at most one block per element.
#pragma once
#include "params.cuh"
#include "mask.cuh"

namespace cuflash {

struct SeqInfo {
  int seqlen_q;     // query rows of this batch element
  int seqlen_k;     // keys it attends to
  int q_start = 0;  // varlen: the packed row of its first query (else 0)
  int k_start = 0;  // varlen: the packed row of its first key (else 0)

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
  // The band alone (MOD: the window's edges from the parameter block; no soft-cap, no ALiBi slope, so no load of the
  // slopes): which KV tiles a Q tile visits, or which Q tiles a KV tile sees (attn/block.cuh).
  template <bool CAUSAL, int MOD, typename P>
  __device__ __forceinline__ Mask<CAUSAL, MOD> band(const P& p) const {
    if constexpr (MOD == MOD_NONE) {
      return Mask<CAUSAL, MOD>(seqlen_k, diag());
    } else {
      return Mask<CAUSAL, MOD>(seqlen_k, diag(), (int)p.window_left, (int)p.window_right);
    }
  }
  // ALiBi slope of (batch, head) in the kernel's score units (P::alibi_mul: 1 / softmax_scale, or 1 / softcap);
  // 0 without slopes.
  template <typename P>
  __device__ __forceinline__ static float alibi_slope(const P& p, int batch, int head) {
    return p.alibi_slopes ? p.alibi_slopes[batch * p.alibi_batch_stride + head] * (float)p.alibi_mul : 0.f;
  }

  // Element offset of (batch, head)'s first row in a [b, s, h, d] tensor with these strides (fixed lengths).
  __device__ __forceinline__ static int64_t offset(int64_t batch_stride, int64_t head_stride, int64_t batch,
                                                   int64_t head) {
    return batch * batch_stride + head * head_stride;
  }
  // ... of its first query row / key in a q-like / k-like tensor, packed or not (batch_stride 0 when packed).
  __device__ __forceinline__ int64_t q_offset(int64_t batch_stride, int64_t row_stride, int64_t head_stride,
                                              int64_t batch, int64_t head) const {
    return batch * batch_stride + (int64_t)q_start * row_stride + head * head_stride;
  }
  __device__ __forceinline__ int64_t k_offset(int64_t batch_stride, int64_t row_stride, int64_t head_stride,
                                              int64_t batch, int64_t head) const {
    return batch * batch_stride + (int64_t)k_start * row_stride + head * head_stride;
  }
};

// Varlen: (batch element, its tile) of tile t of a grid laid out over every element's tiles of ROWS rows (see the
// top of this file): the last element b with cu[b] / ROWS + b <= t. The caller skips a tile past the element's rows.
template <int ROWS>
__device__ __forceinline__ int2 varlen_tile(const int* cu, int batch, int t) {
  int lo = 0, hi = batch - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (__ldg(cu + mid) / ROWS + mid <= t) lo = mid; else hi = mid - 1;
  }
  return make_int2(lo, t - (__ldg(cu + lo) / ROWS + lo));
}
// Varlen: the element whose padded rows [pad_start(b), pad_start(b + 1)) hold padded row r, pad_start(b) =
// ROWS * (cu[b] / ROWS + b) (the backward's fp32 row buffers: every element's rows start on a ROWS boundary);
// returns (b, r - pad_start(b)); b = batch for rows past the last element's.
template <int ROWS>
__device__ __forceinline__ int2 varlen_padded_row(const int* cu, int batch, int64_t r) {
  const int2 bt = varlen_tile<ROWS>(cu, batch + 1, (int)(r / ROWS));
  return make_int2(bt.x, (int)(r - (int64_t)ROWS * (__ldg(cu + bt.x) / ROWS + bt.x)));
}
template <int ROWS>
__device__ __forceinline__ int64_t varlen_pad_start(const int* cu, int batch) {
  return (int64_t)ROWS * (__ldg(cu + batch) / ROWS + batch);
}

// A shared int read afresh at every use: a volatile load is neither hoisted nor merged, so the value lives in a
// register only from the load to its use (the packed backward's per-block values, flash_bwd.cu).
__device__ __forceinline__ int lds_fresh(const int* p) {
  int v;
  asm volatile("ld.volatile.shared.b32 %0, [%1];" : "=r"(v) : "r"(smem_addr(p)));
  return v;
}

// The lengths and first rows of one packed batch element.
__device__ __forceinline__ SeqInfo seqinfo_varlen(const int* cu_q, const int* cu_k, int batch) {
  const int q0 = __ldg(cu_q + batch), k0 = __ldg(cu_k + batch);
  return {__ldg(cu_q + batch + 1) - q0, __ldg(cu_k + batch + 1) - k0, q0, k0};
}

// Forward, split-KV and decode kernels. KV cache: keys seen = min(seqlens_k[b] + seqlen_k_new, seqlen_k).
// varlen (a compile-time constant in the mma.sync kernels, their VARLEN template parameter, so that a fixed-length
// kernel keeps its lengths in the parameter block rather than in registers): the packed element's
// (FwdParams::cu_seqlens_q).
__device__ __forceinline__ SeqInfo seqinfo(const FwdParams& p, int batch, bool varlen = false) {
  if (varlen) return seqinfo_varlen(p.cu_seqlens_q, p.cu_seqlens_k, batch);
  const int seqlen_k = p.seqlens_k ? max(0, min(p.seqlens_k[batch] + (int)p.seqlen_k_new, (int)p.seqlen_k))
                                   : (int)p.seqlen_k;
  return {(int)p.seqlen_q, seqlen_k};
}
// The decode kernel's KV cache: as seqinfo, and with left padding (FwdParams::leftpad_k) element b's keys are the
// cache rows [leftpad_k[b], that end): k_start = leftpad_k[b], seqlen_k the rows past it.
__device__ __forceinline__ SeqInfo seqinfo_cache(const FwdParams& p, int batch) {
  SeqInfo si = seqinfo(p, batch);
  if (p.leftpad_k) {
    si.k_start = __ldg(p.leftpad_k + batch);
    si.seqlen_k = max(0, si.seqlen_k - si.k_start);
  }
  return si;
}
// The V1 forward and backward: fixed lengths.
template <typename P>
__device__ __forceinline__ SeqInfo seqinfo_fixed(const P& p) {
  return {(int)p.seqlen_q, (int)p.seqlen_k};
}
// The V2 backward: fixed or packed (BwdParams::cu_seqlens_q; varlen as above).
__device__ __forceinline__ SeqInfo seqinfo(const BwdParams& p, int batch, bool varlen) {
  if (varlen) return seqinfo_varlen(p.cu_seqlens_q, p.cu_seqlens_k, batch);
  return {(int)p.seqlen_q, (int)p.seqlen_k};
}
// The first element of (batch, head)'s LSE row: [b, h, seqlen_q] fixed, flash-attn's [h, total_q] packed (the host
// passes total_q as seqlen_q then).
template <typename P>
__device__ __forceinline__ int64_t lse_row0(const P& p, const SeqInfo& si, int batch, int head, bool varlen) {
  return varlen ? (int64_t)head * p.seqlen_q + si.q_start : ((int64_t)batch * p.nheads + head) * p.seqlen_q;
}

// Forward kernels (mma.sync and sm_90): a block's coordinates from the grid, in either grid order (see
// FwdParams::grid_order), or, packed, x: the tiles of every element (the last first), y: head, z: split. A packed
// element's tile may lie past its rows (m_block * BLOCK_M >= its seqlen_q): the kernel returns at once.
struct FwdBlock {
  int m_block, head, batch, split;
};
template <int BLOCK_M>
__device__ __forceinline__ FwdBlock fwd_block_coords(const FwdParams& p, uint3 bid, bool varlen) {
  FwdBlock c;
  const int num_m_blocks = ((int)p.seqlen_q + BLOCK_M - 1) / BLOCK_M;
  if (varlen) {
    const int2 bt = varlen_tile<BLOCK_M>(p.cu_seqlens_q, (int)p.batch, (int)(gridDim.x - 1 - bid.x));
    c.batch = bt.x;
    c.m_block = bt.y;
    c.head = bid.y;
    c.split = bid.z;
  } else if (p.grid_order == 0) {  // x: Q tile (heaviest causal tiles first), y: head, z: batch * splits
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
