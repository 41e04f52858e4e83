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

// Copy rows [row0, row0 + ROWS) of a [nrows, D] matrix (row stride in elements, columns contiguous) into
// tile[ROWS][D + 8] with 16-byte cp.async, NT threads cooperating. Rows >= nrows are zero-filled.
template <int ROWS, int D, int NT, typename T>
__device__ __forceinline__ void load_tile_async(T* tile, const T* gmem, int64_t row_stride, int row0, int nrows,
                                                int tid) {
  constexpr int LDS = PaddedRow<D>::LDS;
  constexpr int CHUNKS_PER_ROW = D / 8;  // 16-byte chunks
  constexpr int TOTAL = ROWS * CHUNKS_PER_ROW;
  constexpr int ITERS = (TOTAL + NT - 1) / NT;
#pragma unroll
  for (int i = 0; i < ITERS; ++i) {
    const int c = tid + i * NT;
    if (TOTAL % NT == 0 || c < TOTAL) {
      const int r = c / CHUNKS_PER_ROW;
      const int col = (c % CHUNKS_PER_ROW) * 8;
      const bool valid = row0 + r < nrows;
      const T* src = gmem + (valid ? (int64_t)(row0 + r) * row_stride + col : 0);
      cp_async_16(smem_addr(tile + r * LDS + col), src, valid);
    }
  }
}

}  // namespace cuflash
