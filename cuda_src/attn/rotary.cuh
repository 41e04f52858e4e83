// cuda_src/attn/rotary.cuh -- rotary position embedding (RoPE) of 16-byte chunks, fused into the KV-cache append
// (the new keys, cuda_src/flash_fwd.cu: kvcache_append_kernel) and into the decode kernel's Q load
// (cuda_src/flash_decode.cu), flash-attn's flash_attn_with_kvcache semantics.
//
// cos, sin: [seqlen_ro, rotary_dim / 2] (the dtype of q, contiguous); a row x at position pos has its first
// rotary_dim columns rotated, pair k by the angle of cos[pos, k], sin[pos, k]:
//   interleaved (GPT-J):      pairs (x[2k], x[2k + 1])
//   half-split (GPT-NeoX):    pairs (x[k], x[k + rotary_dim / 2])
//   (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), in fp32, rounded once to the input dtype;
// columns at or past rotary_dim are copied. rotary_dim is a multiple of 16, so a chunk of 8 columns is rotated
// whole or not at all, holds whole interleaved pairs, and its half-split partner is one whole chunk
// rotary_dim / 2 columns away.
#pragma once
#include "../common/ptx.cuh"
#include "../common/tile.cuh"

namespace cuflash {

template <typename T>
__device__ __forceinline__ float to_f32(T x);
template <>
__device__ __forceinline__ float to_f32<__half>(__half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

// The rotation of one position: cos / sin rows, the rotary dim and the pairing.
template <typename T>
struct RotaryRow {
  const T* cos;  // cos[pos, 0 .. rotary_dim / 2)
  const T* sin;
  int dim;       // rotary_dim (0: no rotation)
  bool interleaved;

  // The 8 columns [c, c + 8) of a row (`own`, its 16-byte chunk) rotated; `partner` is the chunk of columns
  // [c +- dim / 2, ...) (half-split only; ignored when interleaved). Chunks at or past dim come back as they are.
  __device__ __forceinline__ uint4 chunk(uint4 own, uint4 partner, int c) const {
    if (c >= dim) return own;
    const uint32_t* a = reinterpret_cast<const uint32_t*>(&own);
    const uint32_t* b = reinterpret_cast<const uint32_t*>(&partner);
    uint4 out;
    uint32_t* o = reinterpret_cast<uint32_t*>(&out);
    if (interleaved) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {  // pair j of the chunk: columns c + 2j, c + 2j + 1; angle (c / 2 + j)
        const float2 x = unpack2<T>(a[j]);
        const float cs = to_f32(cos[c / 2 + j]), sn = to_f32(sin[c / 2 + j]);
        o[j] = pack2<T>(x.x * cs - x.y * sn, x.y * cs + x.x * sn);
      }
    } else {
      const int half = dim / 2;
      const bool first = c < half;  // x1 of its pairs (partner = x2), or x2 (partner = x1)
      const int k0 = first ? c : c - half;
      const float sgn = first ? -1.f : 1.f;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 x = unpack2<T>(a[j]), y = unpack2<T>(b[j]);
        const float c0 = to_f32(cos[k0 + 2 * j]), s0 = to_f32(sin[k0 + 2 * j]);
        const float c1 = to_f32(cos[k0 + 2 * j + 1]), s1 = to_f32(sin[k0 + 2 * j + 1]);
        o[j] = pack2<T>(x.x * c0 + sgn * y.x * s0, x.y * c1 + sgn * y.y * s1);
      }
    }
    return out;
  }
  // The column of the half-split partner chunk of chunk c (c itself when interleaved or past dim).
  __device__ __forceinline__ int partner_col(int c) const {
    if (interleaved || c >= dim) return c;
    return c < dim / 2 ? c + dim / 2 : c - dim / 2;
  }
  // Chunk c of the row at `row` ([0, cols) of it; c < cols) read element by element and rotated (the UA kernels:
  // rows that are not 16-byte units; common/tile.cuh: load_elems, the columns at or past cols read as 0). A rotated
  // chunk and its partner lie inside [0, dim) and dim <= cols, so they are whole.
  __device__ __forceinline__ uint4 chunk_elems(const T* row, int c, int cols) const {
    const uint4 own = load_elems(row + c, cols - c);
    const int pc = partner_col(c);
    return chunk(own, load_elems(row + pc, cols - pc), c);
  }
};

// The rotation at position `pos` (clamped to the table's last row: positions past it belong to rows that are
// dropped or never seen) from a parameter block with rotary_cos / rotary_sin / rotary_dim / rotary_interleaved /
// seqlen_ro (FwdParams, or the append kernel's arguments gathered by the caller).
template <typename T>
__device__ __forceinline__ RotaryRow<T> rotary_row(const void* cos, const void* sin, int dim, bool interleaved,
                                                   int seqlen_ro, int pos) {
  const int64_t row = (int64_t)max(0, min(pos, seqlen_ro - 1)) * (dim / 2);
  return {reinterpret_cast<const T*>(cos) + row, reinterpret_cast<const T*>(sin) + row, dim, interleaved};
}

// Rows [row0, row0 + ROWS) of a [nrows, cols] matrix rotated into tile[ROWS][D + 8] (plain loads and shared
// stores, NT threads; the rows of load_tile_async<PAD_ZERO>: rows >= nrows and columns >= cols are zero). Row
// r's position is pos0 + (per_row ? row0 + r : 0). The caller's barrier publishes the tile. UA: rows that are not
// 16-byte units, each chunk (and its partner) read element by element (common/tile.cuh: load_elems).
template <int ROWS, int D, int NT, bool UA = false, typename T>
__device__ __forceinline__ void load_tile_rotated(T* tile, const T* gmem, int64_t row_stride, int row0, int nrows,
                                                  int tid, int cols, const void* cos, const void* sin, int dim,
                                                  bool interleaved, int seqlen_ro, int pos0, bool per_row) {
  constexpr int LDS = PaddedRow<D>::LDS;
  constexpr int CPR = D / 8;
  for (int i = tid; i < ROWS * CPR; i += NT) {
    const int r = i / CPR, col = (i % CPR) * 8;
    uint4 x = make_uint4(0u, 0u, 0u, 0u);
    if (row0 + r < nrows && col < cols) {
      const T* src = gmem + (int64_t)(row0 + r) * row_stride;
      const RotaryRow<T> rot = rotary_row<T>(cos, sin, dim, interleaved, seqlen_ro, pos0 + (per_row ? row0 + r : 0));
      if constexpr (UA) {
        x = rot.chunk_elems(src, col, cols);
      } else {
        const uint4 own = *reinterpret_cast<const uint4*>(src + col);
        const uint4 partner = *reinterpret_cast<const uint4*>(src + rot.partner_col(col));
        x = rot.chunk(own, partner, col);
      }
    }
    *reinterpret_cast<uint4*>(tile + r * LDS + col) = x;
  }
}

}  // namespace cuflash
