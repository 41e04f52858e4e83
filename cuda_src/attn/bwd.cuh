// cuda_src/attn/bwd.cuh -- what the backward kernels share (cuda_src/flash_bwd.cu, the mma.sync backward, and
// cuda_src/flash_bwd_sm90.cu, the Hopper backward): the dQ strategies, the fp32 row buffers (lse_log2, D, the dQ
// accumulator) and their addressing, and the dK / dV store.
//
// Layout of the fp32 dQ accumulator: fragment-tiled, not row-major (flash_bwd.cu's header says why). Per (split,
// batch, head) it holds seqlen_q_pad x D floats as [seqlen_q_pad / 16][D / 8][32 lanes][4]: one m16n8 accumulator
// fragment (16 rows x 8 columns) is 128 consecutive floats, lane l = 4 g + t owning its 4 values at [4 l, 4 l + 4).
// wgmma's accumulator has the same per-warp layout, so both kernel families add into it alike and share the
// preprocess and convert kernels.
// The T layout (the Hopper backward's 80-row Q tiles, whose dQ is computed transposed: flash_bwd_sm90.cu): the rows
// [BM m, BM m + BM) of a (split, batch, head) -- the same BM D floats -- hold dQ^T's fragments, [D / 16][BM / 8][32
// lanes][4]: element (r, c) of the tile sits at ((c / 16) (BM / 8) + r / 8) 128 + 4 (4 (c % 8) + (r % 8) / 2) +
// 2 ((c / 8) % 2) + r % 2. Its convert kernel is flash_bwd_convert_dq_t_kernel; zeroing is unchanged.
#pragma once
#include "../common/ptx.cuh"
#include "../common/tile.cuh"
#include "params.cuh"
#include "seqlen.cuh"

namespace cuflash {

// DQ_ORDERED (the Hopper backward only): the atomic accumulator, added to in KV-tile order through int32 semaphores
// right after the accumulator in the workspace, eight per 64 accumulator rows, zeroed by the preprocess: the 128-key
// kernel's dQ writer takes one per 64 rows (index row / 64, within the first eighth), the column-split kernel's
// consumer warps one each (index row / 8 + warp).
enum DqStrategy { DQ_ATOMIC = 0, DQ_SEQPAR = 1, DQ_LOOP = 2, DQ_ORDERED = 3 };
// DQ_ORDERED's accumulator rows per semaphore (eight semaphores per 64 rows; cuflash/_configs.py: the same name).
constexpr int DQ_ORDERED_ROWS_PER_SEM = 8;
// The Hopper backward's visiting order (its ORDER template parameter; cuflash/_configs.py: the same numbers).
// DQ_ORDER_PLAIN: block x is KV tile x, the Q tiles ascending; under DQ_ORDERED KV tile j adds after 0 .. j - 1.
// The other two are compiled for DQ_ORDERED with the causal mask only, where a block's Q tiles begin at its diagonal:
// DQ_ORDER_KV_DESC: block x is KV tile (KV tiles - 1 - x), so the shorter ranges start first, and each Q tile takes
//   the additions of the KV tiles that see it from the last one down (the last one sees it at its first step);
// DQ_ORDER_Q_DESC: block x is KV tile x, each head's Q tiles last first (every block starts at the last Q tile).
// DQ_ORDER_ROT, compiled for DQ_ORDERED without a mask: block x is KV tile x and visits Q tile (x - s) mod M at step
//   s of each head (M Q tiles), and each Q tile takes its additions in the order of (step, KV tile): every block
//   waits only on one that added a step before it (or, M < KV tiles, on KV tile x - M at the same step), so the blocks
//   run without waiting once they all run -- which they must: KV tile 0 waits on the last one (the host takes this
//   order only while a head's KV tiles fit the GPU at once).
// DQ_ORDER_HEADS_INNER, compiled with the causal mask (no modifiers, one block per tile): every block visits its Q
//   tiles last first and, at each, the query heads of its KV head's group in turn (Q tiles outer, heads inner), so
//   that the blocks of one (KV head, batch) pair that start together read the same Q and dO tiles at the same step,
//   however many query heads share the KV head. For DQ_ATOMIC / DQ_SEQPAR, and for DQ_ORDERED with DQ_ORDER_PLAIN's
//   turns (KV tile j adds after 0 .. j - 1): every block reaches (head, Q tile m) at the same step of its walk, and
//   the one it waits on was dispatched before it (in either dispatch order).
enum DqOrder { DQ_ORDER_PLAIN = 0, DQ_ORDER_Q_DESC = 1, DQ_ORDER_KV_DESC = 2, DQ_ORDER_ROT = 3,
               DQ_ORDER_HEADS_INNER = 4 };

// The fp32 row buffers (lse_log2, D, each dQ accumulator split) have seqlen_q_pad rows per (batch element, head),
// a multiple of BWD_ROW_PAD (cuflash/_configs.py: the same number), or packed, seqlen_q_pad rows per head holding
// every element's rows, element b's from varlen_pad_start<BWD_ROW_PAD>(b) (attn/seqlen.cuh).
constexpr int BWD_ROW_PAD = 128;
// Rows of one buffer (one split of the dQ accumulator).
__device__ __forceinline__ int64_t bwd_ws_rows(const BwdParams& p, bool varlen) {
  return (varlen ? 1 : p.batch) * p.nheads * p.seqlen_q_pad;
}
// The first row of batch element `batch` (head 0): (batch, head hq, row i) is at bwd_ws_base + hq sq_pad + i
// (packed: varlen_pad_start, from the element's first packed row si.q_start = cu_seqlens_q[batch]).
__device__ __forceinline__ int64_t bwd_ws_base(const BwdParams& p, const SeqInfo& si, int batch, bool varlen) {
  return varlen ? (int64_t)BWD_ROW_PAD * (si.q_start / BWD_ROW_PAD + batch) : batch * p.nheads * p.seqlen_q_pad;
}

template <int D, bool VARLEN>
__device__ __forceinline__ float* dq_accum_band(const BwdParams& p, int n_block, const SeqInfo& si, int batch, int hq,
                                                int row0, int lane) {
  const int64_t split = p.dq_strategy == DQ_SEQPAR ? n_block : 0;
  if constexpr (VARLEN)
    return p.dq_accum + (split * bwd_ws_rows(p, true) + bwd_ws_base(p, si, batch, true) + hq * p.seqlen_q_pad + row0) *
                            D +
           4 * lane;
  else
    return p.dq_accum + (((split * p.batch + batch) * p.nheads + hq) * p.seqlen_q_pad + row0) * D + 4 * lane;
}
template <int D>
__device__ __forceinline__ constexpr int dq_frag_offset(int mf, int c) { return mf * 16 * D + 16 * c; }

// dK = softmax_scale * dk, dV = dv for KV rows j0 + g (+ 8) and columns c0 + 8 df + 2t (rows past seqlen_k
// are not written). UA: rows that are not 16-byte units, element by element (columns past the head dim skipped).
template <typename T, int NF, bool UA = false>
__device__ __forceinline__ void store_dkdv(const BwdParams& p, const SeqInfo& si, int batch, int kv_head, int j0,
                                           int c0, const float (&dk)[NF][4], const float (&dv)[NF][4], int lane) {
  const float scale = (float)p.softmax_scale;
  const int g = lane / 4, t = lane % 4, seqlen_k = si.seqlen_k;
  T* dk_ptr = reinterpret_cast<T*>(p.dk) + si.k_offset(p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride, batch,
                                                       kv_head);
  T* dv_ptr = reinterpret_cast<T*>(p.dv) + si.k_offset(p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride, batch,
                                                       kv_head);
  // n8 blocks before the inputs' head dim (warp-uniform): all NF unless the head dim is below the kernel's
  const int hd = (int)p.head_dim, live_frags = (hd - c0 + (UA ? 7 : 0)) / 8;
  const bool all_live = live_frags >= NF;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int j = j0 + g + h * 8;
    if (j < seqlen_k)
#pragma unroll
      for (int df = 0; df < NF; ++df) {
        const int c = c0 + df * 8 + 2 * t;
        if (!all_live && df >= live_frags) continue;  // the padding columns of a head dim below D
        if constexpr (UA) {
          if (c >= hd) continue;
          store_pair_elems(dk_ptr + (int64_t)j * p.dk_row_stride + c,
                           pack2<T>(dk[df][2 * h] * scale, dk[df][2 * h + 1] * scale), c, hd);
          store_pair_elems(dv_ptr + (int64_t)j * p.dv_row_stride + c, pack2<T>(dv[df][2 * h], dv[df][2 * h + 1]), c,
                           hd);
          continue;
        }
        *reinterpret_cast<uint32_t*>(dk_ptr + (int64_t)j * p.dk_row_stride + c) =
            pack2<T>(dk[df][2 * h] * scale, dk[df][2 * h + 1] * scale);
        *reinterpret_cast<uint32_t*>(dv_ptr + (int64_t)j * p.dv_row_stride + c) =
            pack2<T>(dv[df][2 * h], dv[df][2 * h + 1]);
      }
  }
}

// The 4 x 4 transpose of 32-bit words within each quad of lanes (t = lane % 4): lane t's w[k] becomes lane k's w[t]
// (two butterfly stages, each 2 shuffles and 6 selects).
__device__ __forceinline__ void quad_transpose4(uint32_t (&w)[4], int t) {
  const bool b1 = t & 2, b0 = t & 1;
  uint32_t r0 = __shfl_xor_sync(0xffffffffu, b1 ? w[0] : w[2], 2);  // stage 1: word pairs across lanes t, t ^ 2
  uint32_t r1 = __shfl_xor_sync(0xffffffffu, b1 ? w[1] : w[3], 2);
  uint32_t x0 = b1 ? r0 : w[0], x1 = b1 ? r1 : w[1], x2 = b1 ? w[2] : r0, x3 = b1 ? w[3] : r1;
  r0 = __shfl_xor_sync(0xffffffffu, b0 ? x0 : x1, 1);  // stage 2: single words across lanes t, t ^ 1
  r1 = __shfl_xor_sync(0xffffffffu, b0 ? x2 : x3, 1);
  w[0] = b0 ? r0 : x0;
  w[1] = b0 ? x1 : r0;
  w[2] = b0 ? r1 : x2;
  w[3] = b0 ? x3 : r1;
}

// store_dkdv in 16-byte pieces (the Hopper kernels; rows of 16-byte units, NF a multiple of 4): for each group of 4 n8
// blocks the quad's 32-bit pairs are transposed (quad_transpose4), so that lane t stores 8 consecutive columns of block
// 4 q + t of its row -- a warp's store writes 64 contiguous bytes of each of 8 rows, 16 store instructions per
// thread for dK and dV instead of 64 of 4 bytes.
template <typename T, int NF>
__device__ __forceinline__ void store_dkdv_wide(const BwdParams& p, const SeqInfo& si, int batch, int kv_head, int j0,
                                                int c0, const float (&dk)[NF][4], const float (&dv)[NF][4],
                                                int lane) {
  static_assert(NF % 4 == 0, "store_dkdv_wide: groups of 4 n8 blocks");
  const float scale = (float)p.softmax_scale;
  const int g = lane / 4, t = lane % 4, seqlen_k = si.seqlen_k, hd = (int)p.head_dim;
  T* dk_ptr = reinterpret_cast<T*>(p.dk) + si.k_offset(p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride, batch,
                                                       kv_head);
  T* dv_ptr = reinterpret_cast<T*>(p.dv) + si.k_offset(p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride, batch,
                                                       kv_head);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int j = j0 + g + h * 8;
#pragma unroll
    for (int q = 0; q < NF / 4; ++q) {
      uint32_t wk[4], wv[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        wk[u] = pack2<T>(dk[4 * q + u][2 * h] * scale, dk[4 * q + u][2 * h + 1] * scale);
        wv[u] = pack2<T>(dv[4 * q + u][2 * h], dv[4 * q + u][2 * h + 1]);
      }
      quad_transpose4(wk, t);
      quad_transpose4(wv, t);
      const int c = c0 + 8 * (4 * q + t);  // block 4 q + t: columns c .. c + 7 (padding columns past hd not stored)
      if (j < seqlen_k && c < hd) {
        *reinterpret_cast<uint4*>(dk_ptr + (int64_t)j * p.dk_row_stride + c) = make_uint4(wk[0], wk[1], wk[2], wk[3]);
        *reinterpret_cast<uint4*>(dv_ptr + (int64_t)j * p.dv_row_stride + c) = make_uint4(wv[0], wv[1], wv[2], wv[3]);
      }
    }
  }
}

}  // namespace cuflash
