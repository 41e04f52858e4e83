// cuda_src/common/tile.cuh -- shared-memory tiles: layout and cooperative asynchronous loads.
#pragma once
#include "ptx.cuh"

namespace cuflash {

// A tile of a [rows, D] 16-bit matrix in shared memory is stored row-major with each row padded by 8
// elements (16 bytes): row stride = (D + 8) * 2 bytes = D/2 + 4 banks. The 8 row addresses of one
// ldmatrix 8x8 matrix then start 4 banks apart and cover all 32 banks once: no bank conflicts, for every
// D that is a multiple of 8, at a cost of 16 bytes per row (6% of a 128-wide tile).
template <int D>
struct PaddedRow {
  static constexpr int LDS = D + 8;  // elements between consecutive rows
};

// Head dims below the kernel's D. A matrix of `cols` < D columns (a multiple of 8: the kernel of the next compiled
// head dim runs it) fills the columns [cols, D) of its tiles by one of two rules:
//   PAD_ZERO  zeros (cp.async with source size 0). A kernel loads one operand of every product that contracts over
//             the head dim this way (the forward's Q, the backward's K and V), so those products are exact.
//   PAD_COPY  the row's own first columns again (the chunk's source column clamped to 0): finite values, no read
//             past a row's cols, and no register or test in the copy loops. Their products either meet a PAD_ZERO
//             operand or land in output columns past cols, which are never stored.
//   PAD_ELEM  rows that are not 16-byte units (a head dim that is not a multiple of 8, or a stride or base address
//             that is not 16-byte aligned: the kernels' UA variants): each chunk read element by element (8
//             predicated 2-byte loads into registers, then one 16-byte shared store), columns >= cols read as 0.
//             Synchronous: the data is in shared memory when the copy returns, so the cp.async waits and barriers
//             that guard a stage guard it too (a stage is only refilled once every warp is done with it).
enum PadMode { PAD_ZERO = 0, PAD_COPY = 1, PAD_ELEM = 2 };

// The first n (<= 8; none when n <= 0) elements of a chunk at any 2-byte aligned address, the rest 0.
template <typename T>
__device__ __forceinline__ uint4 load_elems(const T* src, int n) {
  const unsigned short* s = reinterpret_cast<const unsigned short*>(src);
  uint32_t w[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const uint32_t lo = 2 * e < n ? (uint32_t)__ldg(s + 2 * e) : 0u;
    const uint32_t hi = 2 * e + 1 < n ? (uint32_t)__ldg(s + 2 * e + 1) : 0u;
    w[e] = lo | (hi << 16);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// The first n (<= 8) elements of chunk x to any 2-byte aligned address (the columns past a row's end untouched).
template <typename T>
__device__ __forceinline__ void store_elems(T* dst, const uint4& x, int n) {
  unsigned short* d = reinterpret_cast<unsigned short*>(dst);
  const uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
  for (int e = 0; e < 8; ++e)
    if (e < n) d[e] = (unsigned short)(w[e / 2] >> (16 * (e % 2)));
}

// Columns [c, c + 4) of a row as two packed pairs (lo: c, c + 1), n = the row's columns from c on (>= 1): one 8-byte
// store, or with UA (rows that are not 16-byte units) element by element, the columns past the row's end untouched.
template <bool UA, typename T>
__device__ __forceinline__ void store_quad(T* dst, uint32_t lo, uint32_t hi, int n) {
  if constexpr (UA)
    store_elems(dst, make_uint4(lo, hi, 0u, 0u), n < 4 ? n : 4);
  else
    *reinterpret_cast<uint2*>(dst) = make_uint2(lo, hi);
}

// The two elements (lo, hi) of a packed pair to columns c, c + 1 of a row with `cols` columns (c < cols).
__device__ __forceinline__ void store_pair_elems(void* dst, uint32_t pair, int c, int cols) {
  unsigned short* d = reinterpret_cast<unsigned short*>(dst);
  d[0] = (unsigned short)pair;
  if (c + 1 < cols) d[1] = (unsigned short)(pair >> 16);
}

// Copy rows [row0, row0 + ROWS) of a [nrows, cols] matrix (row stride in elements, columns contiguous) into
// tile[ROWS][D + 8] with 16-byte cp.async, NT threads cooperating. Rows >= nrows are zero-filled; columns >= cols
// follow PAD.
template <int ROWS, int D, int NT, int PAD = PAD_ZERO, typename T>
__device__ __forceinline__ void load_tile_async(T* tile, const T* gmem, int64_t row_stride, int row0, int nrows,
                                                int tid, int cols = D) {
  constexpr int LDS = PaddedRow<D>::LDS;
  constexpr int CHUNKS_PER_ROW = D / 8;  // 16-byte chunks
  constexpr int TOTAL = ROWS * CHUNKS_PER_ROW;
  constexpr int ITERS = (TOTAL + NT - 1) / NT;
  if constexpr (PAD == PAD_ELEM) {
    // two chunks in flight per thread: fully unrolled, ptxas hoists every chunk's 8 loads (8 registers each)
    // above the shared stores and the kernels' accumulators spill
#pragma unroll 2
    for (int i = 0; i < ITERS; ++i) {
      const int c = tid + i * NT;
      if (TOTAL % NT == 0 || c < TOTAL) {
        const int r = c / CHUNKS_PER_ROW, col = (c % CHUNKS_PER_ROW) * 8;
        const int n = row0 + r < nrows ? cols - col : 0;
        *reinterpret_cast<uint4*>(tile + r * LDS + col) =
            load_elems(gmem + (n > 0 ? (int64_t)(row0 + r) * row_stride + col : 0), n);
      }
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < ITERS; ++i) {
    const int c = tid + i * NT;
    if (TOTAL % NT == 0 || c < TOTAL) {
      const int r = c / CHUNKS_PER_ROW;
      const int col = (c % CHUNKS_PER_ROW) * 8;
      const bool valid = row0 + r < nrows && (PAD == PAD_COPY || col < cols);
      const int src_col = PAD == PAD_COPY && col >= cols ? 0 : col;
      const T* src = gmem + (valid ? (int64_t)(row0 + r) * row_stride + src_col : 0);
      cp_async_16(smem_addr(tile + r * LDS + col), src, valid);
    }
  }
}

}  // namespace cuflash

namespace cuflash {

// The cp.async plan of one thread for FULL tiles (every row in range: no bounds checks): the thread
// copies chunk column `col` of rows r, r + ROWS_PER_ITER, ... Its shared offsets are compile-time
// constants past `smem_off`; each global address is one IMAD.WIDE.U32 (row x row_bytes + base). Three
// registers per matrix: the 64-bit base and the 32-bit row stride in bytes (the host rejects sequence
// strides of 2^30 elements or more). Columns at or past `cols` (the matrix's head dim, when it is below D) are
// PAD_COPY: the thread's source column is clamped once, here. Falls back to load_tile_async when the chunks do
// not divide evenly among the threads (head dim 96), and for rows that are not 16-byte units (UA: PAD_ELEM).
template <int ROWS, int D, int NT, typename T, bool UA = false>
struct FullTileLoader {
  static constexpr int LDS = PaddedRow<D>::LDS;
  static constexpr int CHUNKS_PER_ROW = D / 8;
  static constexpr bool EVEN = !UA && NT % CHUNKS_PER_ROW == 0 && (ROWS * CHUNKS_PER_ROW) % NT == 0;
  static constexpr int ROWS_PER_ITER = EVEN ? NT / CHUNKS_PER_ROW : 1;
  static constexpr int ITERS = EVEN ? ROWS / ROWS_PER_ITER : 1;
  const char* gbase;  // this thread's chunk in row r of the matrix
  int row_bytes;      // row stride in bytes (< 2^31)
  uint32_t smem_off;  // byte offset of this thread's first chunk inside a tile
  const T* gmem;      // fallback path
  int tid, cols;

  __device__ __forceinline__ FullTileLoader(const T* gmem_, int64_t row_stride, int tid_, int cols_ = D)
      : gmem(gmem_), tid(tid_), cols(cols_) {
    const int r = tid_ / CHUNKS_PER_ROW, col = (tid_ % CHUNKS_PER_ROW) * 8;
    row_bytes = (int)(row_stride * (int64_t)sizeof(T));
    gbase = reinterpret_cast<const char*>(gmem_ + (col < cols_ ? col : 0)) + (int64_t)r * row_bytes;  // PAD_COPY
    smem_off = (uint32_t)((r * LDS + col) * sizeof(T));
  }
  // Rows [row0, row0 + ROWS) -> tile (all in range).
  __device__ __forceinline__ void copy(T* tile, int row0) const {
    if constexpr (EVEN) {
      const uint32_t dst = smem_addr(tile) + smem_off;
#pragma unroll
      for (int i = 0; i < ITERS; ++i)
        cp_async_16_full(dst + i * ROWS_PER_ITER * LDS * (int)sizeof(T),
                         gbase + (unsigned long long)(unsigned)(row0 + i * ROWS_PER_ITER) * (unsigned)row_bytes);
    } else {
      load_tile_async<ROWS, D, NT, UA ? PAD_ELEM : PAD_COPY>(tile, gmem, (int64_t)row_bytes / (int64_t)sizeof(T), row0, row0 + ROWS,
                                             tid, cols);
    }
  }
};

}  // namespace cuflash
