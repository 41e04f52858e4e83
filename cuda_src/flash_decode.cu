// cuda_src/flash_decode.cu -- Flash-Decoding: a split-KV attention kernel built for 1..32 query rows.
//
// Decoding has one query row per (batch, head) (or the G query heads of one KV head folded into G rows,
// or the few tokens of speculative decoding), so the work is a stream over the KV cache: the kernel is
// bound by the bytes it keeps in flight, not by the tensor cores. flash_fwd_kernel<SPLIT=true> (the
// prefill kernel cut into KV splits) gives each block 64 rows x 64 keys and 4 warps: with 1-16 rows, 3 of
// 4 warps only load, a block-wide barrier per KV tile serialises the warps, and one KV tile per block is in
// flight. This kernel turns the partition around (V1's split-K, inside the block):
//
//   grid       one block per (m-block of BLOCK_M = 16 * MF rows, head, batch, KV split), 1-D
//   block      NWARPS warps; EVERY warp holds all BLOCK_M rows (Q fragments in registers, or re-read from
//              shared memory when they would take more than 32 registers) and streams its OWN keys:
//              the split's warp tiles of BLOCK_N keys are dealt round-robin, warp w takes tiles
//              w, w + NWARPS, w + 2 NWARPS, ... (so the 4 warps of a block read one contiguous
//              NWARPS * BLOCK_N-key range at a time)
//   per warp   a private STAGES-deep cp.async ring of (K tile, V tile) in shared memory, synchronised
//              with cp.async.wait_group + __syncwarp only: no __syncthreads in the KV loop, so a warp
//              never waits for another warp's loads
//     for each of its tiles:  S = Q K^T (mma.sync m16n8k16, fp32), online softmax in base 2
//                             (one FFMA + one MUFU.EX2 per score), O += P V (P stays in registers)
//   epilogue   one cross-warp combine of (m, l, O) through shared memory (the ring is reused):
//                M = max_w m_w,  c_w = exp2(m_w - M),  L = sum_w c_w l_w   (m in log2 units, attn/softmax.cuh)
//                O = sum_w c_w O_w / L,   LSE = (M + log2 L) * ln 2
//              then either the fp32 partial of the split (o_accum [split, b, h, sq, d], lse_accum
//              [split, b, h, sq]: exactly flash_fwd_kernel<SPLIT=true>'s format, combined by
//              flash_decode_combine_kernel at the end of this file, or by flash_combine_kernel for comparison)
//              or, when p.o_accum is null (one split), O in the input dtype and the LSE straight into
//              p.o / p.lse (no combine launch).
//
// Split ranges. A block's keys are [0, kv_len), kv_len = seqlen_k (ragged: min(seqlens_k[b] +
// seqlen_k_new, seqlen_k)), causal: min(last valid row of the block + 1 + seqlen_k - seqlen_q,
// seqlen_k). Its NT = ceil(kv_len / BLOCK_N) warp tiles are cut into num_splits ranges of
// NWARPS * ceil(NT / (num_splits * NWARPS)) tiles (whole rounds of the warps, so all but the last
// split keep every warp equally busy). A split with no tile (past the end, empty cache) writes
// lse = -inf (and o = 0 when it writes the output directly); a row that sees no key (all masked) ends with m = -inf, l = 0 and gets o = 0,
// lse = -inf (the base-2 exponent uses 0 in place of an -inf max, so no inf - inf = NaN anywhere).
//
// KV-cache indirections (flash-attn's flash_attn_with_kvcache; FwdParams' KV-cache fields, null when absent):
//   cache_batch_idx  element b reads cache row cache_batch_idx[b];
//   leftpad_k        element b's keys are the cache rows from leftpad_k[b] on (attn/seqlen.cuh: seqinfo_cache; its
//                    key positions, causal diagonal and ALiBi distances count from there);
//   block_table      PAGED = true: key row r of element b is row r % page_size of page block_table[b, r / page_size]
//                    (warp_load_kv_paged: one table look-up per 16 rows; a template parameter, so the contiguous
//                    kernels keep their registers: the run-time branch spilled the head-dim-128 two-fragment and
//                    head-dim-256 kernels under NVRTC 13.0);
//   rotary_cos/sin   Q is rotated while it is loaded (attn/rotary.cuh: load_tile_rotated, plain loads into shared
//                    memory), query row i at position cache_seqlens[b] + i when causal or local, else all at
//                    cache_seqlens[b]; the appended keys are rotated by the append kernel (cuda_src/flash_fwd.cu).
//
// Bytes in flight (the design target: HBM bandwidth x latency ~ 4.2 TB/s x ~1-1.5 us / 132 SMs
// ~ 32-48 KB per SM; we aim at >= 64 KB so that the loaded latency may grow). At the top of iteration k
// a warp has issued tiles 0 .. k + STAGES - 2 and waits for tile k; right after, it refills the slot of
// tile k - 1 with tile k + STAGES - 1. So STAGES - 1 tiles of 2 * BLOCK_N * D * 2 bytes are in flight
// per warp at all times (while it waits and while it computes), and per SM
//   blocks/SM x NWARPS x (STAGES - 1) x 2 * BLOCK_N * D * 2 bytes.
// The configurations of cuflash/_configs.py (DECODE_KERNEL_TILES; fp16/bf16, padded smem rows of D + 8
// elements; blocks/SM from shared memory, the registers allow at least as many):
//   D = 128: BLOCK_N 32, 4 warps, 2 stages: tile 16 KB, smem 140 KB/block (MF 1) -> 1 block/SM on
//            sm_90 and sm_80: 1 x 4 x 1 x 16 KB = 64 KB in flight. (16 x 4 warps x 3 stages, 2 blocks/SM and
//            128 KB in flight, measured 1-6% slower: bench/NOTES.md, decode tiles.)
//   D = 128, the wide tile (DECODE_WIDE_TILES: paged caches, and grids of more blocks than one wave of the tile
//            above; cuflash/decode.py decode_auto_tile): BLOCK_N 16, 4 warps, 2 stages: tile 8 KB, 70-80 KB/block
//            -> 2 blocks/SM: 2 x 4 x 1 x 8 KB = 64 KB in flight, one block's set-up and epilogue under the other's
//            loads.
//   D =  64: BLOCK_N 32, 4 warps, 3 stages: tile 8 KB, 110 KB/block -> 2 blocks/SM on sm_90 (228 KB/SM):
//            2 x 4 x 2 x 8 KB = 128 KB in flight; sm_80 (164 KB/SM): 1 block, 64 KB.
//   D =  96: BLOCK_N 16, 4 warps, 4 stages: tile 6 KB, 107 KB/block -> 2 x 4 x 3 x 6 KB = 144 KB.
//   D =  32: BLOCK_N 32, 4 warps, 4 stages: tile 4 KB, 81 KB/block  -> 2 x 4 x 3 x 4 KB = 96 KB.
//   D = 256: BLOCK_N 16, 2 warps, 3 stages: tile 16 KB, 107 KB/block -> 2 x 2 x 2 x 16 KB = 128 KB.
// The work per tile is tiny next to its bytes (D = 128, BLOCK_N 16, MF 1: 32 HMMA + 16 LDSM.x4 + 8
// exponentials per lane for 8 KB), so a warp spends its time waiting on its ring.
//
// Template parameters (chosen in cuflash/_configs.py: decode_spec):
//   T          __half or __nv_bfloat16
//   D          head dim (multiple of 16)
//   MF         m16 fragments of query rows per block (BLOCK_M = 16 * MF rows, every warp holds all)
//   BLOCK_N    keys per warp tile (multiple of 16)
//   NWARPS     warps per block, each streaming its own warp tiles
//   CAUSAL     bottom-right aligned causal mask (query i sees key j iff j <= i + seqlen_k - seqlen_q)
//   STAGES     depth of each warp's cp.async ring (>= 2)
//   SMEM_BYTES dynamic shared memory the host reserves; checked here against the layout
//   MOD        MOD_SCORE: window band, soft-cap and ALiBi from the parameter block (attn/mask.cuh; rows are
//              then query positions of one head: the host does not fold GQA heads into rows)
//   PAGED      the cache is paged (FwdParams::block_table; k, v [pages, page_size, hk, d], their batch stride the
//              page stride)
//   SWZ        the rings' rows unpadded and XOR-swizzled (RingSwizzle, below)
//   UA         rows that are not 16-byte units (a head dim that is not a multiple of 8, strides or base addresses that
//              are not 16-byte aligned): every global access of Q, K, V and O element by element (common/tile.cuh:
//              PAD_ELEM; K and V synchronously into the padded ring, warp_load_tile), the columns past the head dim
//              zero in shared memory and never stored; the host compiles it with the score-modifier mask only (plain
//              and causal calls run as bands there) and the padded ring (not SWZ); the combines below take the same
//              flag for O's stores
//
// Programmatic Dependent Launch (sm_90; common/ptx.cuh: grid_dependency_wait / grid_launch_dependents). The host
// launches this kernel as the dependent of flash_attn_with_kvcache's append kernel, and the combine as this kernel's
// (cuflash/decode.py): each block waits for the append's grid before its first K/V load (and before an empty split's
// writes), and lets the combine's blocks in once its KV loop is done; below sm_90 both compile to nothing.
//
// Parameters: cuflash::FwdParams (attn/params.cuh) exactly as flash_fwd_kernel reads them; grid_order
// is ignored (the grid is 1-D: m-block fastest, then split, head, batch).
#include "common/ptx.cuh"
#include "common/tile.cuh"
#include "common/warp_gemm.cuh"
#include "attn/params.cuh"
#include "attn/seqlen.cuh"
#include "attn/mask.cuh"
#include "attn/block.cuh"
#include "attn/softmax.cuh"
#include "attn/rotary.cuh"

namespace cuflash {

// Shared-memory layout of flash_decode_kernel, in bytes (the host mirrors it: _configs.decode_smem_bytes).
template <int D, int MF, int BLOCK_N, int NWARPS, int STAGES, bool SWZ = false>
struct DecodeSmem {
  static constexpr int BLOCK_M = 16 * MF;
  static constexpr int LDS = PaddedRow<D>::LDS;                      // 16-bit elements per smem row (Q)
  static constexpr int RS = SWZ ? D : LDS;                            // ... of the K / V rings (RingSwizzle)
  static constexpr int TILE_BYTES = BLOCK_N * RS * 2;                 // one K (or V) warp tile
  static constexpr int SLOT_BYTES = 2 * TILE_BYTES;                   // K tile then V tile
  static constexpr int RING_BYTES = NWARPS * STAGES * SLOT_BYTES;     // [NWARPS][STAGES][K, V]
  static constexpr int Q_BYTES = BLOCK_M * LDS * 2;                   // [BLOCK_M][LDS]
  // Cross-warp combine (aliases the rings once every warp is done): O_w [NWARPS][BLOCK_M][RLD] fp32, then
  // m_w, l_w, and the final weights c_w / L, each [NWARPS][BLOCK_M] fp32.
  static constexpr int RLD = D + 8;  // fp32 row stride: float2 stores of a quad row hit 8 distinct banks
  static constexpr int RED_BYTES = NWARPS * BLOCK_M * (RLD + 3) * 4;
  static constexpr int BYTES = Q_BYTES + (RING_BYTES > RED_BYTES ? RING_BYTES : RED_BYTES);
};

// Lanes of a warp copying a [ROWS, D] 16-bit tile with 16-byte cp.async: each row is CPR = D / 8 chunks;
// a pass of the warp covers RPP = 32 / CPR whole rows (lane -> row lane / CPR, chunk lane % CPR), so a
// lane walks its column down the tile with one pointer and constant increments. D = 96 (12 chunks per
// row) leaves lanes 24..31 idle.
template <int D>
struct WarpTileLanes {
  static constexpr int CPR = D / 8;
  static constexpr int RPP = 32 / CPR;
  static constexpr int USED = RPP * CPR;
};

// The swizzled ring (the kernel's SWZ): K / V rows of D elements, unpadded, the 16-byte chunk c of tile row r stored
// at chunk c ^ of(r). With the padded rows (D + 8 elements) every odd row starts 16 bytes off a 32-byte sector of
// shared memory, and Nsight Compute counted 1.5x the L2 sectors of the bytes read on the large decode step (the
// sectors fetched again as L2 hits), where a read kernel with the same global addresses and unpadded destinations
// counted 1.0x (bench/NOTES.md, "Decode"). Here a 32-byte global sector lands in one shared sector
// (the XOR keeps chunk pairs 2k, 2k + 1 together) and a row starts on a 128-byte line (D = 64, 128, 256) or a 64-byte
// half (D = 32, 96). ldmatrix stays conflict-free: the 8 rows of an 8x8 matrix (tile rows 8j .. 8j + 7) at one chunk
// fall in 8 distinct 16-byte bank groups: rows of a multiple of 8 chunks XOR the chunk's low 3 bits with r mod 8;
// rows of 4 or 12 chunks (D = 32, 96) put odd rows 64 bytes (4 groups) from even ones and XOR the low 2 bits with
// (r / 2) mod 4. of(r) depends only on r mod 8, and warp tiles start on multiples of 16 rows.
template <int D>
struct RingSwizzle {
  static constexpr int CPR = D / 8;
  static constexpr int GROUP = CPR % 8 == 0 ? 8 : 4;
  static_assert(CPR % GROUP == 0, "whole swizzle groups per row");
  static constexpr int ROW_BYTES = D * 2;
  static __device__ __forceinline__ int of(int row) { return GROUP == 8 ? (row & 7) : ((row >> 1) & 3); }
  // byte offset of (row, chunk) in a tile
  static __device__ __forceinline__ uint32_t offset(int row, int chunk) {
    return (uint32_t)(row * ROW_BYTES + ((chunk ^ of(row)) << 4));
  }
};

// cp.async of one warp tile: `src` = this lane's first chunk (row row0 + lane / CPR of the matrix, column
// (lane % CPR) * 8), `dst` = its smem address in tile[ROWS][D + 8]; rows at or past `nrows` are zero-filled
// (a zero V row times a zero probability stays 0, never NaN: the cache past its valid length may hold
// anything); their chunks get `base` (row 0 of the matrix, always mapped) as the address they do not read.
// Full tiles (the common case, warp-uniform) take no per-row test.
// SWZ: `dst` is the tile's own address, and pass i of the lane lands at RingSwizzle::offset(its row, its chunk).
// UA (rows that are not 16-byte units; padded rows, not SWZ): `src` at the lane's own column (not clamped), each chunk
// read element by element (common/tile.cuh: load_elems; columns at or past `cols` and rows at or past `nrows` read as
// 0) and stored to shared memory synchronously -- in shared memory when the copy returns, so the ring's
// cp.async.wait_group + __syncwarp that publish a cp.async tile publish it too (the empty groups keep the count).
template <int ROWS, int D, bool SWZ = false, bool UA = false, typename T>
__device__ __forceinline__ void warp_load_tile(uint32_t dst, const T* src, const T* base, int64_t row_stride, int row0,
                                               int nrows, int lane, int cols = D) {
  using W = WarpTileLanes<D>;
  constexpr int LDS = PaddedRow<D>::LDS;
  static_assert(ROWS % W::RPP == 0, "whole passes per tile");
  static_assert(!(UA && SWZ), "UA: the padded ring");
  if (W::USED < 32 && lane >= W::USED) return;
  const int64_t step = W::RPP * row_stride;
  const int lr = lane / W::CPR, lc = lane % W::CPR;
  auto at = [&](int i) -> uint32_t {
    if constexpr (SWZ) return dst + RingSwizzle<D>::offset(lr + i * W::RPP, lc);
    else return dst + (uint32_t)(i * W::RPP * LDS * 2);
  };
  if constexpr (UA) {
    const int n = cols - lc * 8, left = nrows - row0 - lr;  // the lane's columns in its chunk; valid rows from its own
#pragma unroll 4
    for (int i = 0; i < ROWS / W::RPP; ++i)
      st_shared_16(at(i), load_elems(src + i * step, i * W::RPP < left ? n : 0));
    return;
  }
  if (row0 + ROWS <= nrows) {
#pragma unroll
    for (int i = 0; i < ROWS / W::RPP; ++i, src += step) cp_async_16(at(i), src, true);
  } else {
    const int left = nrows - row0 - lr;  // valid rows from this lane's first one
#pragma unroll
    for (int i = 0; i < ROWS / W::RPP; ++i, src += step) {
      const bool valid = i * W::RPP < left;
      cp_async_16(at(i), valid ? src : base, valid);
    }
  }
}

// Paged cache (FwdParams::block_table). Page sizes are multiples of 16 and warp tiles start on multiples of 16, so
// the 16-key chunks of a tile never straddle two pages: one table look-up per chunk. The look-ups of a warp's next
// tile are made one tile ahead (PagedChunks::lookup after each copy), so the table's latency is never waited for
// before the copies are issued.
template <int ROWS>
struct PagedChunks {
  static constexpr int N = ROWS / 16;
  int page[N];  // the page of chunk c (unset past the end)
  int row[N];   // the chunk's first row in its page
  // The chunks of rows [row0, row0 + ROWS) of one element's pages; chunks at or past nrows are not looked up
  // (their table entries may be anything, or past the table's end).
  __device__ __forceinline__ void lookup(const int* pages, int page_size, int row0, int nrows) {
#pragma unroll
    for (int c = 0; c < N; ++c) {
      const int r0 = row0 + c * 16;
      if (r0 < nrows) {
        const int pg = r0 / page_size;
        page[c] = __ldg(pages + pg);
        row[c] = r0 - pg * page_size;
      }
    }
  }
};

// warp_load_tile for the K and the V tile of rows [row0, row0 + ROWS) of a paged element, from the chunks' pages
// (`pc`, looked up for this row0). `dst` as warp_load_tile's (the V tile TILE_BYTES after the K tile);
// k_head / v_head: page 0 of the head (always mapped: the address of zero-filled chunks); col: the lane's
// (clamped) source column. UA: as warp_load_tile's (col the lane's own column, `cols` the row's columns).
template <int ROWS, int D, int TILE_BYTES, bool SWZ = false, bool UA = false, typename T>
__device__ __forceinline__ void warp_load_kv_paged(uint32_t dst, const T* k_head, const T* v_head,
                                                   const PagedChunks<ROWS>& pc, int64_t k_page_stride,
                                                   int64_t k_row_stride, int64_t v_page_stride, int64_t v_row_stride,
                                                   int row0, int nrows, int lane, int col, int cols = D) {
  using W = WarpTileLanes<D>;
  constexpr int LDS = PaddedRow<D>::LDS;
  constexpr int CHUNK = 16;
  static_assert(ROWS % CHUNK == 0 && CHUNK % W::RPP == 0, "16-row page chunks in whole passes");
  static_assert(!(UA && SWZ), "UA: the padded ring");
  if (W::USED < 32 && lane >= W::USED) return;
  const int lr = lane / W::CPR, lc = lane % W::CPR;
  auto at = [&](int row) -> uint32_t {  // this lane's copy into tile row `row` (SWZ: dst is the tile's address)
    if constexpr (SWZ) return dst + RingSwizzle<D>::offset(row + lr, lc);
    else return dst + (uint32_t)(row * LDS * 2);
  };
  // pass i of a chunk: byte offsets i x RPP x row bytes (32-bit: row strides are < 2^30 elements, and a chunk's
  // 16 rows stay well inside 2^32 bytes), one IMAD.WIDE.U32 per copy
  const uint32_t k_step = (uint32_t)(W::RPP * k_row_stride * (int64_t)sizeof(T));
  const uint32_t v_step = (uint32_t)(W::RPP * v_row_stride * (int64_t)sizeof(T));
#pragma unroll
  for (int ch = 0; ch < ROWS / CHUNK; ++ch) {
    const int r0 = row0 + ch * CHUNK;  // warp-uniform
    if (r0 >= nrows) {  // past the end: zero-fill
#pragma unroll
      for (int i = 0; i < CHUNK / W::RPP; ++i) {
        const uint32_t d = at(ch * CHUNK + i * W::RPP);
        if constexpr (UA) {
          st_shared_16(d, make_uint4(0u, 0u, 0u, 0u));
          st_shared_16(d + TILE_BYTES, make_uint4(0u, 0u, 0u, 0u));
        } else {
          cp_async_16(d, k_head, false);
          cp_async_16(d + TILE_BYTES, v_head, false);
        }
      }
      continue;
    }
    const int64_t page = pc.page[ch], in_page = pc.row[ch] + lr;
    const char* ks = reinterpret_cast<const char*>(k_head + page * k_page_stride + in_page * k_row_stride + col);
    const char* vs = reinterpret_cast<const char*>(v_head + page * v_page_stride + in_page * v_row_stride + col);
    const int left = nrows - r0 - lr;  // valid rows from this lane's first one in the chunk
    if constexpr (UA) {  // (one pass at a time: more in flight spilled the paged head-dim-256 kernels)
      const int n = cols - col;
#pragma unroll 1
      for (int i = 0; i < CHUNK / W::RPP; ++i) {
        const int m = i * W::RPP < left ? n : 0;
        const uint32_t d = at(ch * CHUNK + i * W::RPP);
        st_shared_16(d, load_elems(reinterpret_cast<const T*>(ks + (uint32_t)i * k_step), m));
        st_shared_16(d + TILE_BYTES, load_elems(reinterpret_cast<const T*>(vs + (uint32_t)i * v_step), m));
      }
      continue;
    }
#pragma unroll
    for (int i = 0; i < CHUNK / W::RPP; ++i) {
      const bool valid = i * W::RPP < left;
      const uint32_t d = at(ch * CHUNK + i * W::RPP);
      cp_async_16(d, valid ? ks + (uint32_t)i * k_step : reinterpret_cast<const char*>(k_head), valid);
      cp_async_16(d + TILE_BYTES, valid ? vs + (uint32_t)i * v_step : reinterpret_cast<const char*>(v_head), valid);
    }
  }
}

template <typename T, int D, int MF, int BLOCK_N, int NWARPS, bool CAUSAL, int STAGES, int SMEM_BYTES,
          int MOD = MOD_NONE, bool PAGED = false, bool SWZ = false, bool UA = false>
// (NWARPS * 32, 1): with the thread count alone ptxas held the swizzled d32 kernels at 95-96 registers with 8 B of
// spills, and d128 with two row fragments causal spilled 36 B at 255; told one block per SM suffices, it spills in
// none (the footprints keep 1-3 blocks per SM resident: at most 170 registers are needed for 3 blocks of 128).
__global__ void __launch_bounds__(NWARPS * 32, 1) flash_decode_kernel(const __grid_constant__ FwdParams p) {
  using L = DecodeSmem<D, MF, BLOCK_N, NWARPS, STAGES, SWZ>;
  constexpr int NT = NWARPS * 32;
  constexpr int BLOCK_M = L::BLOCK_M;
  constexpr int NF = BLOCK_N / 8;  // n8 fragments of S
  constexpr int DF = D / 8;        // n8 fragments of O
  constexpr int KD = D / 16;       // k16 steps of Q K^T
  constexpr int KN = BLOCK_N / 16; // k16 steps of P V
  constexpr int LDS = L::LDS;
  constexpr int RLD = L::RLD;
  static_assert(D % 16 == 0 && BLOCK_N % 16 == 0 && DF % 2 == 0, "tile shapes");
  static_assert(MF >= 1 && STAGES >= 2 && NWARPS >= 1, "configuration");
  static_assert(SMEM_BYTES == L::BYTES, "host smem size must match the layout (cuflash/_configs.py)");
  static_assert(!(UA && SWZ), "UA: the padded ring");
  // Q fragments stay in registers when they take at most 32 of them (D <= 128 at MF = 1).
  constexpr bool Q_IN_REGS = MF * KD * 4 <= 32;

  extern __shared__ __align__(128) unsigned char smem_raw[];  // 128: the SWZ ring addresses XOR bits 4-6 of a sum
  T* q_smem = reinterpret_cast<T*>(smem_raw);  // [BLOCK_M][LDS]
  unsigned char* ring = smem_raw + L::Q_BYTES;  // [NWARPS][STAGES][K | V][BLOCK_N][LDS]

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;

  // Block coordinates: x = ((batch * nheads + head) * num_splits + split) * num_m_blocks + m_block.
  const int seqlen_q = (int)p.seqlen_q;
  const int num_splits = (int)p.num_splits;
  const int num_m_blocks = (seqlen_q + BLOCK_M - 1) / BLOCK_M;
  int64_t bid = blockIdx.x;
  const int m_block = (int)(bid % num_m_blocks);
  bid /= num_m_blocks;
  const int split = (int)(bid % num_splits);
  const int64_t bh = bid / num_splits;  // batch * nheads + head
  const int head = (int)(bh % p.nheads);
  const int batch = (int)(bh / p.nheads);
  const int m0 = m_block * BLOCK_M;
  const int valid_rows = min(BLOCK_M, seqlen_q - m0);

  const SeqInfo si = seqinfo_cache(p, batch);  // left padding: keys from cache row si.k_start
  const int seqlen_k = si.seqlen_k;
  const Mask<CAUSAL, MOD> mask = si.mask<CAUSAL, MOD>(p, batch, head);
  // keys any valid row of this block may see: [0, kv_len)
  const int kv_len = max(0, kv_key_end(mask, m0 + valid_rows));

  // This split's warp tiles [tile_begin, tile_end): whole rounds of NWARPS tiles per split (attn/block.cuh).
  const int n_tiles = (kv_len + BLOCK_N - 1) / BLOCK_N;
  const BlockRange tiles =
      split_range(kv_block_begin<BLOCK_N>(mask, m0), n_tiles, n_tiles, split, num_splits, NWARPS);
  const int tile_begin = tiles.begin, tile_end = tiles.end;

  const bool direct = p.o_accum == nullptr;  // one split: write O (input dtype) and the LSE directly
  float* o_acc_row0 = direct ? nullptr
                             : p.o_accum + (((int64_t)split * p.batch * p.nheads + bh) * seqlen_q + m0) * D;
  float* lse_row0 = direct ? (p.lse ? p.lse + bh * seqlen_q + m0 : nullptr)
                           : p.lse_accum + ((int64_t)split * p.batch * p.nheads + bh) * seqlen_q + m0;
  T* o_row0 = direct ? reinterpret_cast<T*>(p.o) + SeqInfo::offset(p.o_batch_stride, p.o_head_stride, batch, head) +
                           (int64_t)m0 * p.o_row_stride
                     : nullptr;

  if (tile_begin >= tile_end) {  // no key in this split (block-uniform): lse = -inf; o = 0 when direct (a partial's
    // o is not written: both combines skip the o of a split whose lse is -inf, so an empty split costs no o traffic)
    grid_dependency_wait();  // PDL: no block of this grid ends before the append kernel has (see below)
    if (direct)
      for (int i = tid; i < valid_rows * (D / 4); i += NT) {
        const int r = i / (D / 4), c = (i % (D / 4)) * 4;
        if (c < (int)p.head_dim) store_quad<UA>(o_row0 + (int64_t)r * p.o_row_stride + c, 0u, 0u, (int)p.head_dim - c);
      }
    if (lse_row0 && tid < valid_rows) lse_row0[tid] = -INFINITY;
    return;
  }

  const T* q_ptr = reinterpret_cast<const T*>(p.q) + SeqInfo::offset(p.q_batch_stride, p.q_head_stride, batch, head);
  const int64_t kv_head = head / p.heads_per_kv;  // GQA/MQA without the fold: shared K/V head, no copy
  // The cache row of this element (FwdParams::cache_batch_idx), or, paged, page 0 (the pages are found per tile).
  const int* pages = PAGED ? p.block_table + (int64_t)batch * p.block_table_batch_stride : nullptr;
  const int64_t kv_batch = PAGED ? 0 : p.cache_batch_idx ? __ldg(p.cache_batch_idx + batch) : batch;
  const T* k_ptr = reinterpret_cast<const T*>(p.k) +
                   si.k_offset(p.k_batch_stride, p.k_row_stride, p.k_head_stride, kv_batch, kv_head);
  const T* v_ptr = reinterpret_cast<const T*>(p.v) +
                   si.k_offset(p.v_batch_stride, p.v_row_stride, p.v_head_stride, kv_batch, kv_head);

  // This warp's tiles: tile_begin + warp + i * NWARPS, i in [0, my_tiles). The lane's K and V pointers
  // walk them (one 64-bit add per tile); next_row is the first key of the next tile to load.
  const int first = tile_begin + warp;
  const int my_tiles = first < tile_end ? (tile_end - first + NWARPS - 1) / NWARPS : 0;
  const uint32_t ring_w = smem_addr(ring) + (uint32_t)(warp * STAGES * L::SLOT_BYTES);
  const int lane_row = lane / WarpTileLanes<D>::CPR, lane_col = (lane % WarpTileLanes<D>::CPR) * 8;
  const uint32_t lane_dst = SWZ ? ring_w : ring_w + (uint32_t)((lane_row * LDS + lane_col) * 2);
  // A head dim below D (common/tile.cuh): Q zero-padded, K and V PAD_COPY (the lane's source column clamped; UA:
  // its own column, the columns past hd read as zeros).
  const int hd = (int)p.head_dim, src_col = UA || lane_col < hd ? lane_col : 0;
  int next_row = first * BLOCK_N;
  const T* k_src = k_ptr + (int64_t)(next_row + lane_row) * p.k_row_stride + src_col;
  const T* v_src = v_ptr + (int64_t)(next_row + lane_row) * p.v_row_stride + src_col;
  PagedChunks<PAGED ? BLOCK_N : 16> chunks;  // paged: the pages of the tile at next_row
  if constexpr (PAGED) chunks.lookup(pages, (int)p.page_size, next_row, seqlen_k);
  auto load_next = [&](int slot) {  // the warp's next tile -> ring slot
    const uint32_t dst = lane_dst + (uint32_t)(slot * L::SLOT_BYTES);
    if constexpr (PAGED) {
      warp_load_kv_paged<BLOCK_N, D, L::TILE_BYTES, SWZ, UA>(dst, k_ptr, v_ptr, chunks, p.k_batch_stride,
                                                            p.k_row_stride, p.v_batch_stride, p.v_row_stride, next_row,
                                                            seqlen_k, lane, src_col, hd);
      chunks.lookup(pages, (int)p.page_size, next_row + NWARPS * BLOCK_N, seqlen_k);  // one tile ahead
    } else {
      warp_load_tile<BLOCK_N, D, SWZ, UA>(dst, k_src, k_ptr, p.k_row_stride, next_row, seqlen_k, lane, hd);
      warp_load_tile<BLOCK_N, D, SWZ, UA>(dst + L::TILE_BYTES, v_src, v_ptr, p.v_row_stride, next_row, seqlen_k, lane,
                                          hd);
      k_src += (int64_t)NWARPS * BLOCK_N * p.k_row_stride;
      v_src += (int64_t)NWARPS * BLOCK_N * p.v_row_stride;
    }
    next_row += NWARPS * BLOCK_N;
  };

  // Q (all threads, one cp.async group; with a rotary embedding, plain loads rotated into shared memory,
  // attn/rotary.cuh: query row i at position seqlens_k[b] (+ i when causal or local)), then each warp's first
  // STAGES - 1 tiles (one group each, empty groups included so that the group count per iteration is static).
  if (p.rotary_cos) {
    load_tile_rotated<BLOCK_M, D, NT, UA>(q_smem, q_ptr, p.q_row_stride, m0, seqlen_q, tid, hd, p.rotary_cos,
                                      p.rotary_sin, (int)p.rotary_dim, p.rotary_interleaved != 0, (int)p.seqlen_ro,
                                      __ldg(p.seqlens_k + batch), p.rotary_q_per_row != 0);
  } else {
    load_tile_async<BLOCK_M, D, NT, UA ? PAD_ELEM : PAD_ZERO>(q_smem, q_ptr, p.q_row_stride, m0, seqlen_q, tid, hd);
  }
  cp_async_commit();
  // PDL (launched after flash_attn_with_kvcache's append kernel, cuda_src/flash_fwd.cu): everything above reads only
  // what the append does not write (the parameter block, seqlens_k, leftpad_k, cache_batch_idx, block_table, q and
  // the rotary tables); the K/V rows it writes are read from here on, once it has completed.
  grid_dependency_wait();
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < my_tiles) load_next(s);
    cp_async_commit();
  }
  cp_async_wait<STAGES - 1>();  // this thread's Q chunks have landed ...
  __syncthreads();              // ... everyone's (the only block barrier before the epilogue)

  // ldmatrix lane offsets (bytes): Q as the A operand (rows mf*16 + lane%16, cols kd*16 + (lane/16)*8);
  // K rows as the B operand of Q K^T (plain ldmatrix); V rows as the B operand of P V (ldmatrix.trans).
  const uint32_t q_lane = smem_addr(q_smem) + (uint32_t)(((lane % 16) * LDS + (lane / 16) * 8) * 2);
  // SWZ: the lane's row offsets, and its chunk's XOR (RingSwizzle: of(row) is of(lane % 8) for every row the lane
  // addresses; K's chunk 2 kd + (lane / 8) % 2 and V's df + lane / 16, df even, put the lane's bit in bit 0)
  const uint32_t k_lane = SWZ ? (uint32_t)(((lane % 8) + (lane / 16) * 8) * L::RS * 2)
                              : (uint32_t)((((lane % 8) + (lane / 16) * 8) * LDS + ((lane / 8) % 2) * 8) * 2);
  const uint32_t v_lane = (SWZ ? (uint32_t)(((lane % 8) + ((lane / 8) % 2) * 8) * L::RS * 2)
                               : (uint32_t)((((lane % 8) + ((lane / 8) % 2) * 8) * LDS + (lane / 16) * 8) * 2)) +
                          L::TILE_BYTES;
  const uint32_t k_xor = (uint32_t)((((lane / 8) % 2) ^ RingSwizzle<D>::of(lane % 8)) << 4);
  const uint32_t v_xor = (uint32_t)(((lane / 16) ^ RingSwizzle<D>::of(lane % 8)) << 4);
  uint32_t q_frag[Q_IN_REGS ? MF : 1][Q_IN_REGS ? KD : 1][4];
  if constexpr (Q_IN_REGS) {
#pragma unroll
    for (int mf = 0; mf < MF; ++mf)
#pragma unroll
      for (int kd = 0; kd < KD; ++kd) ldmatrix_x4(q_frag[mf][kd], q_lane + (uint32_t)((mf * 16 * LDS + kd * 16) * 2));
  }

  // Per-thread state: O and the online softmax of rows (g, g + 8) of each m16 fragment (attn/softmax.cuh).
  float acc_o[MF][DF][4];
#pragma unroll
  for (int mf = 0; mf < MF; ++mf) zero_frags(acc_o[mf]);
  OnlineSoftmax<MF> softmax;
  // (HOLD_FADD, common/ptx.cuh: head dim 128, two row fragments, the score modifiers, contiguous cache -- 24-44 B of
  // spills at 255 registers with the constant-bank operand)
  constexpr int HOLD = D == 128 && MF == 2 && MOD != MOD_NONE && !PAGED ? HOLD_FADD : HOLD_NONE;
  const float scale_log2 = held<HOLD>(p.scale_log2);

  int read_slot = 0, write_slot = STAGES - 1;
  for (int i = 0; i < my_tiles; ++i) {
    cp_async_wait<STAGES - 2>();  // tile i has landed for this lane ...
    __syncwarp();                 // ... for every lane; and every lane is done with tile i-1's slot
    if (i + STAGES - 1 < my_tiles) load_next(write_slot);  // tile i + STAGES - 1 refills the freed slot
    cp_async_commit();
    const uint32_t k_tile = ring_w + (uint32_t)(read_slot * L::SLOT_BYTES);
    read_slot = read_slot == STAGES - 1 ? 0 : read_slot + 1;
    write_slot = write_slot == STAGES - 1 ? 0 : write_slot + 1;

    // S = Q K^T  [BLOCK_M, BLOCK_N] (common/warp_gemm.cuh): Q fragments from registers or shared memory.
    float s[MF][NF][4];
    gemm_abt_x4<T, MF, NF, KD>(
        s,
        [&](uint32_t (&a)[4], int mf, int kd) {
          if constexpr (Q_IN_REGS) {
#pragma unroll
            for (int e = 0; e < 4; ++e) a[e] = q_frag[mf][kd][e];
          } else {
            ldmatrix_x4(a, q_lane + (uint32_t)((mf * 16 * LDS + kd * 16) * 2));
          }
        },
        [&](int nf, int kd) {
          if constexpr (SWZ) return (k_tile + k_lane + (uint32_t)(nf * 8 * L::RS * 2 + kd * 32)) ^ k_xor;
          else return k_tile + k_lane + (uint32_t)((nf * 8 * LDS + kd * 16) * 2);
        });

    // Mask only tiles that cross the end of the keys or the band's edges, or all with a value modifier
    // (warp-uniform branch); MOD_SCORE: shift, as flash_fwd_kernel.
    const int col0 = (first + i * NWARPS) * BLOCK_N;
    float shift[MF][2];
    if (mask.needs_mask(m0, m0 + BLOCK_M - 1, col0, col0 + BLOCK_N - 1))
      mask.apply(s, m0, col0, lane, shift);
    else
      mask.clear_shift(shift);

    // Online softmax (attn/softmax.cuh), as flash_fwd_kernel.
    if (__any_sync(0xffffffffu, softmax.update_max(s, scale_log2, mask.shift_arg(shift)))) softmax.rescale(acc_o);
    softmax.exp_and_sum(s, scale_log2, mask.shift_arg(shift));

    // O += P V: the S accumulators packed to 16-bit pairs are the A operand; V via ldmatrix.trans.
    gemm_pv_x4<T, MF, KN, DF>(
        acc_o, [&](uint32_t (&a)[4], int mf, int kn) { frag_to_a<T>(s[mf], kn, a); },
        [&](int kn, int df) {
          if constexpr (SWZ) return (k_tile + v_lane + (uint32_t)(kn * 16 * L::RS * 2 + df * 16)) ^ v_xor;
          else return k_tile + v_lane + (uint32_t)((kn * 16 * LDS + df * 8) * 2);
        });
  }

  // PDL: the KV loop's shared memory and registers are all this block still needs; let the combine's blocks be
  // scheduled (they wait in flash_decode_combine_kernel until this grid has completed).
  grid_launch_dependents();

  // ---- Cross-warp combine. Every warp's ring is drained and read: reuse the rings for (m_w, l_w, O_w).
  cp_async_wait<0>();  // only empty groups can be pending here; keeps the smem reuse obviously safe
  __syncthreads();
  float* red_o = reinterpret_cast<float*>(ring);        // [NWARPS][BLOCK_M][RLD]  unnormalised O_w
  float* red_m = red_o + NWARPS * BLOCK_M * RLD;        // [NWARPS][BLOCK_M]       m_w, log2 units (or -inf)
  float* red_l = red_m + NWARPS * BLOCK_M;              // [NWARPS][BLOCK_M]       l_w
  float* red_c = red_l + NWARPS * BLOCK_M;              // [NWARPS][BLOCK_M]       c_w / L
#pragma unroll
  for (int mf = 0; mf < MF; ++mf)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = mf * 16 + g + h * 8;
      const float l = softmax.row_sum_total(mf, h);
      if (r < valid_rows) {
        if (t == 0) {
          red_m[warp * BLOCK_M + r] = softmax.row_max[mf][h];
          red_l[warp * BLOCK_M + r] = l;
        }
        float* dst = red_o + (warp * BLOCK_M + r) * RLD + 2 * t;
#pragma unroll
        for (int df = 0; df < DF; ++df)
          *reinterpret_cast<float2*>(dst + df * 8) = make_float2(acc_o[mf][df][2 * h], acc_o[mf][df][2 * h + 1]);
      }
    }
  __syncthreads();
  if (tid < valid_rows) {  // per row: M, L, the weights c_w / L and the LSE (attn/softmax.cuh: merge_partials)
    float c[NWARPS], m_max;
    const float l_tot = merge_partials<NWARPS>([&](int w) { return red_m[w * BLOCK_M + tid]; },
                                               [&](int w) { return red_l[w * BLOCK_M + tid]; }, c, m_max);
    const float inv_l = l_tot > 0.f ? 1.f / l_tot : 0.f;
#pragma unroll
    for (int w = 0; w < NWARPS; ++w) red_c[w * BLOCK_M + tid] = c[w] * inv_l;
    if (lse_row0) lse_row0[tid] = merged_lse(m_max, l_tot);
  }
  __syncthreads();
  for (int i = tid; i < valid_rows * (D / 4); i += NT) {  // O = sum_w (c_w / L) O_w, 4 columns per thread
    const int r = i / (D / 4), c = (i % (D / 4)) * 4;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < NWARPS; ++w) {
      const float cw = red_c[w * BLOCK_M + r];
      const float4 x = *reinterpret_cast<const float4*>(red_o + (w * BLOCK_M + r) * RLD + c);
      o.x += cw * x.x;
      o.y += cw * x.y;
      o.z += cw * x.z;
      o.w += cw * x.w;
    }
    if (direct) {
      if (c < (int)p.head_dim)
        store_quad<UA>(o_row0 + (int64_t)r * p.o_row_stride + c, pack2<T>(o.x, o.y), pack2<T>(o.z, o.w),
                       (int)p.head_dim - c);
    } else {
      *reinterpret_cast<float4*>(o_acc_row0 + (int64_t)r * D + c) = o;
    }
  }
}

// ---- Split-KV combine of the decode kernel's partials (flash_decode_combine_kernel).
//
//   out = sum_s w_s o_s,  w_s = exp(lse_s - lse),  lse = log sum_s exp(lse_s)   (lse_s natural log, o_s normalised)
//
// flash_combine_kernel (cuda_src/flash_fwd.cu: one warp per row, the splits walked one at a time, each step a load
// of lse_s, a branch on it and the loads of o_s) costs about one L2 round trip per split: with 64-122 splits that
// was most of a small decoding step's time (bench/NOTES.md, "Decode"). Here every load that can be in flight is:
//   grid    one block per output row (batch, head, query row as the decode kernel sees them: a folded GQA group's
//           rows are rows), rows = batch x nheads x seqlen_q of the parameter block
//   block   SG = 8 split groups x D / 4 column groups (4 fp32 columns, one float4, per thread): 2 x D threads
//   1. the LSE of every split, one (or two, D = 32) per thread, all loads independent; block max and block sum
//      (warp shuffles, then one float per warp through shared memory); the weights w_s = e_s / sum -> smem
//   2. thread (sg, cg) sums w_s o_s[cg] over the splits s = sg, sg + SG, ... (at most DECODE_MAX_SPLITS / SG = 16):
//      all its float4 loads issued before the first is used (one round trip, not n); a split of weight 0 (no key,
//      or negligible) is not loaded (its o may be unwritten: the decode kernel writes no o for an empty split)
//   3. the SG partial sums of a column group through shared memory; split group 0 writes O in the input dtype
//      (columns below head_dim) and thread 0 the LSE (-inf and O = 0 when no split saw a key: every w_s = 0)
// UA: O's rows are not 16-byte units (the decode kernel's UA form): its columns stored element by element.
// Reads the parameter block of the decode launch: batch, nheads, seqlen_q, num_splits (<= DECODE_MAX_SPLITS, the
// host's MAX_SPLITS), o_accum, lse_accum, o, lse, the o strides and head_dim.
// Programmatic Dependent Launch (sm_90, cuflash/_launch.py): the host launches it as the decode kernel's dependent,
// so its blocks may be resident before the decode grid drains (the decode kernel lets them in after its KV loop);
// grid_dependency_wait precedes every read of the partials and every write.
constexpr int DECODE_MAX_SPLITS = 128;
constexpr int COMBINE_SPLIT_GROUPS = 8;

template <typename T, int D, bool UA = false>
__global__ void __launch_bounds__(COMBINE_SPLIT_GROUPS * D / 4) flash_decode_combine_kernel(const __grid_constant__ FwdParams p) {
  constexpr int CG = D / 4;                   // column groups (one float4 each)
  constexpr int SG = COMBINE_SPLIT_GROUPS;   // split groups
  constexpr int NT = SG * CG;
  constexpr int NW = NT / 32;
  constexpr int PER_THREAD = (DECODE_MAX_SPLITS + NT - 1) / NT;  // LSE loads per thread
  constexpr int PER_GROUP = DECODE_MAX_SPLITS / SG;              // o loads per thread
  static_assert(D % 4 == 0 && NT % 32 == 0 && DECODE_MAX_SPLITS % SG == 0, "combine shapes");
  __shared__ float w_smem[DECODE_MAX_SPLITS];                     // w_s
  __shared__ float max_smem[NW], sum_smem[NW];                    // per-warp max / sum
  __shared__ __align__(16) float acc_smem[SG - 1][D];            // split groups 1.. : their partial sums

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int64_t rows = p.batch * p.nheads * p.seqlen_q;
  const int64_t row = blockIdx.x;
  const int n = (int)p.num_splits;

  // PDL (launched right after the decode kernel): its partials are read only after it has completed.
  grid_dependency_wait();

  // 1. LSEs -> weights.
  float lse_s[PER_THREAD], mx = -INFINITY;
#pragma unroll
  for (int j = 0; j < PER_THREAD; ++j) {
    const int s = tid + j * NT;
    lse_s[j] = s < n ? p.lse_accum[s * rows + row] : -INFINITY;
    mx = fmaxf(mx, lse_s[j]);
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  if (lane == 0) max_smem[warp] = mx;
  __syncthreads();  // max_smem complete
#pragma unroll
  for (int w = 0; w < NW; ++w) mx = fmaxf(mx, max_smem[w]);
  const float base = mx == -INFINITY ? 0.f : mx;  // every split empty: e_s = exp(-inf) = 0, no inf - inf
  float e[PER_THREAD], sum = 0.f;
#pragma unroll
  for (int j = 0; j < PER_THREAD; ++j) {
    e[j] = __expf(lse_s[j] - base);
    sum += e[j];
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  if (lane == 0) sum_smem[warp] = sum;
  __syncthreads();  // sum_smem complete
  sum = 0.f;
#pragma unroll
  for (int w = 0; w < NW; ++w) sum += sum_smem[w];
  const float inv_sum = sum > 0.f ? 1.f / sum : 0.f;
#pragma unroll
  for (int j = 0; j < PER_THREAD; ++j) {
    const int s = tid + j * NT;
    if (s < n) w_smem[s] = e[j] * inv_sum;  // exp(lse_s - lse)
  }
  __syncthreads();  // w_smem complete

  // 2. This thread's splits, every load issued before the first use.
  const int cg = tid % CG, sg = tid / CG;
  const float* o_col = p.o_accum + row * D + cg * 4;
  const int64_t split_stride = rows * D;
  float wt[PER_GROUP];
  float4 x[PER_GROUP];
#pragma unroll
  for (int j = 0; j < PER_GROUP; ++j) {
    const int s = sg + j * SG;
    wt[j] = s < n ? w_smem[s] : 0.f;
    x[j] = wt[j] != 0.f ? *reinterpret_cast<const float4*>(o_col + s * split_stride) : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int j = 0; j < PER_GROUP; ++j) {
    acc.x += wt[j] * x[j].x;
    acc.y += wt[j] * x[j].y;
    acc.z += wt[j] * x[j].z;
    acc.w += wt[j] * x[j].w;
  }

  // 3. Sum the split groups; write O and the LSE.
  if (sg > 0) *reinterpret_cast<float4*>(&acc_smem[sg - 1][cg * 4]) = acc;
  __syncthreads();  // acc_smem complete
  if (sg == 0) {
#pragma unroll
    for (int g = 0; g < SG - 1; ++g) {
      const float4 y = *reinterpret_cast<const float4*>(&acc_smem[g][cg * 4]);
      acc.x += y.x;
      acc.y += y.y;
      acc.z += y.z;
      acc.w += y.w;
    }
    const int64_t i = row % p.seqlen_q, bh = row / p.seqlen_q;
    const int64_t h = bh % p.nheads, b = bh / p.nheads;
    T* o = reinterpret_cast<T*>(p.o) + b * p.o_batch_stride + i * p.o_row_stride + h * p.o_head_stride;
    if (cg * 4 < (int)p.head_dim)
      store_quad<UA>(o + cg * 4, pack2<T>(acc.x, acc.y), pack2<T>(acc.z, acc.w), (int)p.head_dim - cg * 4);
  }
  if (p.lse && tid == 0) p.lse[row] = sum > 0.f ? base + __logf(sum) : -INFINITY;
}

// ---- The same combine for a few splits (num_splits <= COMBINE_ROWS_MAX_SPLITS): flash_decode_combine_rows_kernel.
//
// One block per row holds 2 x D threads and about 90 registers each (the 16 float4 loads per thread that 128 splits
// need), so an SM runs 2 of them: with many rows and few splits (MQA at batch 64: 2048 rows of 2 splits) the grid is
// 8 waves of blocks that each wait on three round trips, 17 us for 2 MB (bench/NOTES.md, "Decode"). Here one warp
// takes a row and a block COMBINE_ROWS_WARPS rows; no shared memory, no block barrier, no shuffle before the sums:
//   1. every lane loads the row's COMBINE_ROWS_MAX_SPLITS LSEs (one address per warp load; -inf past num_splits) and
//      computes the max, the sum and the weights w_s = exp(lse_s - lse) itself
//   2. the warp's lanes are SGW split groups x LCG lanes of D / 4 / CPL column groups (CPL float4 columns per lane:
//      D 32: 4 x 8 lanes, 64: 2 x 16, 96: 1 x 24 (lanes 24-31 idle), 128: 1 x 32, 256: 1 x 32 x 2 columns); lane
//      (sg, c) takes the splits sg, sg + SGW, ... (COMBINE_ROWS_MAX_SPLITS / SGW of them): all its float4 loads are
//      issued before the first is used (one round trip; the minimum of 2 blocks per SM in the launch bounds is what
//      lets ptxas keep them in flight: without it, it held two at a time in 32 registers). A split past num_splits
//      loads split 0's row again; a split of weight 0 (no key, or past num_splits) is never added, not even times 0
//      (an empty split's o is unwritten)
//   3. the split groups' sums by shuffles; split group 0 writes O (columns below head_dim), lane 0 the LSE
// Results: the same weights as flash_decode_combine_kernel, summed in another order (rounding-level differences).
// PDL as that kernel: grid_dependency_wait before every read of the partials and every write.
// MAXS: the most splits it takes: COMBINE_ROWS_MAX_SPLITS, or 16 at head dims up to 128 (cuflash/_configs.py:
// COMBINE_ROWS_WIDE_SPLITS; a lane's 16 float4 loads in flight in 96 registers at head dim 128). UA: as the block
// combine's.
constexpr int COMBINE_ROWS_MAX_SPLITS = 8;
constexpr int COMBINE_ROWS_WARPS = 8;

template <typename T, int D, int MAXS = COMBINE_ROWS_MAX_SPLITS, bool UA = false>
__global__ void __launch_bounds__(COMBINE_ROWS_WARPS * 32, 2)
    flash_decode_combine_rows_kernel(const __grid_constant__ FwdParams p) {
  constexpr int CG = D / 4;                       // float4 column groups of a row
  constexpr int CPL = CG > 32 ? CG / 32 : 1;      // column groups per lane
  constexpr int LCG = CG / CPL;                   // lanes of one split group
  constexpr int SGW = 32 / LCG;                   // split groups of the warp
  constexpr int PG = MAXS / SGW;                  // splits per lane
  static_assert(D % 4 == 0 && CG % CPL == 0 && LCG <= 32 && MAXS % SGW == 0 && (SGW == 1 || (LCG & (LCG - 1)) == 0),
                "combine rows shapes");
  const int lane = threadIdx.x % 32;
  const int64_t rows = p.batch * p.nheads * p.seqlen_q;
  const int64_t row = (int64_t)blockIdx.x * COMBINE_ROWS_WARPS + threadIdx.x / 32;
  const int n = (int)p.num_splits;

  // PDL (launched right after the decode kernel): its partials are read only after it has completed.
  grid_dependency_wait();
  if (row >= rows) return;  // (warp-uniform)

  // 1. Every lane: every split's LSE (the warp's loads of one address: one request each), max, sum, weights.
  float lse_s[MAXS], mx = -INFINITY;
#pragma unroll
  for (int s = 0; s < MAXS; ++s) {
    lse_s[s] = s < n ? p.lse_accum[s * rows + row] : -INFINITY;
    mx = fmaxf(mx, lse_s[s]);
  }
  const float base = mx == -INFINITY ? 0.f : mx;  // every split empty: e_s = exp(-inf) = 0, no inf - inf
  float sum = 0.f;
#pragma unroll
  for (int s = 0; s < MAXS; ++s) {
    lse_s[s] = __expf(lse_s[s] - base);  // e_s
    sum += lse_s[s];
  }
  const float inv_sum = sum > 0.f ? 1.f / sum : 0.f;

  // 2. This lane's splits and columns, every load issued before the first use.
  const int sg = lane / LCG, lc = lane % LCG;
  const float* o_row = p.o_accum + row * D + lc * 4;
  const int64_t split_stride = rows * D;
  float wt[PG];
  const float* src[PG];  // the addresses first, then the loads back to back
#pragma unroll
  for (int j = 0; j < PG; ++j) {
    // split sg + j SGW: a register index only after unrolling over the lane's split group (idle lanes: sg == SGW)
    float e = 0.f;
#pragma unroll
    for (int g = 0; g < SGW; ++g)
      if (sg == g) e = lse_s[g + j * SGW];
    wt[j] = e * inv_sum;
    src[j] = o_row + (sg + j * SGW < n ? sg + j * SGW : 0) * split_stride;  // past n: split 0's row, weight 0
  }
  float4 x[PG][CPL];
#pragma unroll
  for (int j = 0; j < PG; ++j)
#pragma unroll
    for (int c = 0; c < CPL; ++c) x[j][c] = *reinterpret_cast<const float4*>(src[j] + c * LCG * 4);
  float4 acc[CPL];
#pragma unroll
  for (int c = 0; c < CPL; ++c) {
    acc[c] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int j = 0; j < PG; ++j) {
      if (wt[j] != 0.f) {  // (an empty split's o may be unwritten: never multiplied, even by 0)
        acc[c].x += wt[j] * x[j][c].x;
        acc[c].y += wt[j] * x[j][c].y;
        acc[c].z += wt[j] * x[j][c].z;
        acc[c].w += wt[j] * x[j][c].w;
      }
    }
  }

  // 3. The split groups' sums (lanes LCG apart); split group 0 writes O, lane 0 the LSE.
#pragma unroll
  for (int o = LCG; o < LCG * SGW; o *= 2)
#pragma unroll
    for (int c = 0; c < CPL; ++c) {
      acc[c].x += __shfl_xor_sync(0xffffffffu, acc[c].x, o);
      acc[c].y += __shfl_xor_sync(0xffffffffu, acc[c].y, o);
      acc[c].z += __shfl_xor_sync(0xffffffffu, acc[c].z, o);
      acc[c].w += __shfl_xor_sync(0xffffffffu, acc[c].w, o);
    }
  if (sg == 0) {
    const int64_t i = row % p.seqlen_q, bh = row / p.seqlen_q;
    const int64_t h = bh % p.nheads, b = bh / p.nheads;
    T* o = reinterpret_cast<T*>(p.o) + b * p.o_batch_stride + i * p.o_row_stride + h * p.o_head_stride;
#pragma unroll
    for (int c = 0; c < CPL; ++c) {
      const int col = (lc + c * LCG) * 4;
      if (col < (int)p.head_dim)
        store_quad<UA>(o + col, pack2<T>(acc[c].x, acc[c].y), pack2<T>(acc[c].z, acc[c].w), (int)p.head_dim - col);
    }
  }
  if (p.lse && lane == 0) p.lse[row] = sum > 0.f ? base + __logf(sum) : -INFINITY;
}

}  // namespace cuflash
