// cuda_src/flash_bwd.cu -- FlashAttention-2 backward: preprocess, main kernel, dQ conversion.
//
//   preprocess:  D = rowsum(dO * O)  and  lse_log2 = LSE * log2(e)   (fp32, rows padded to sq_pad)
//   main:        one thread block per (KV tile, KV head, batch); K_j, V_j stay in shared memory while
//                the block loops over the query heads that share this KV head (GQA) and their Q tiles:
//       S    = Q_i K_j^T                              [BLOCK_M, BLOCK_N]
//       P    = exp2(S * scale_log2 - lse_log2_i)      from the saved LSE: no m, no l
//       dV_j += P^T dO_i
//       dP   = dO_i V_j^T
//       dS   = P * (dP - D_i)
//       dK_j += dS^T Q_i
//       dQ_i += dS K_j   (see the dQ strategies below)
//   convert:     dQ = softmax_scale * (sum of the fp32 dQ partials), in the output dtype.
//
// Three warp partitions (template argument PARTITION; cuflash/_configs.py: BWD_TILES / BWD_TILES_Q /
// BWD_TILES_2D; warp_partition="auto" picks per head dim, BWD_AUTO_PARTITION: "2d" at 64 and 128, else "kv"):
//
// PART_KV ("split the KV rows"): warp w owns KV rows [16 (w / DSPLIT), +16) of the tile and
//   DOUT = D / DSPLIT columns of dK_j, dV_j, which it accumulates in registers over the whole loop. It
//   computes the transposed products S^T, P^T, dP^T, dS^T [16 KV rows, BLOCK_M] itself, so dV += P^T dO and
//   dK += dS^T Q (contractions over the Q rows, all of which the warp holds) need no cross-warp reduction.
//   Only dQ (a contraction over the KV rows spread across warps) exchanges dS^T through shared memory,
//   after which warps re-partition by 16 Q rows x DQ_COLS columns. DSPLIT = 2 (head dim 256) makes two
//   warps share KV rows and split D, duplicating S^T and dP^T, so the dK/dV accumulators fit in registers.
//
// PART_Q ("split the Q rows", the forward's partition): warp w owns Q rows [16 w, +16) of the Q tile
//   (BLOCK_M = 16 NWARPS) and all BLOCK_N keys. It computes S, P, dP, dS [16 Q rows, BLOCK_N], and
//   dQ_i += dS K_j is warp-local (the warp holds every KV row of its dQ rows): dQ leaves straight from the
//   registers, no exchange. dV += P^T dO and dK += dS^T Q contract over the Q rows, which are spread across
//   warps; each warp writes its P and dS rows (16-bit) to shared memory, and after a barrier the warps
//   re-partition by KV rows x D columns (RBW bands of 16 KV rows x D / CB columns each) and accumulate
//   dK_j, dV_j in registers over the whole loop, reading P^T and dS^T with ldmatrix.trans. (The other
//   design, per-warp partial dK/dV [BLOCK_N, D] reduced through shared memory, needs 2 BLOCK_N D fp32
//   registers per warp: 512 per thread at BLOCK_N = 64, D = 128. Not an option.)
//   A warp whose 16 rows all lie past seqlen_q or above the causal diagonal of this KV tile skips its
//   products and writes zeros for its P and dS rows.
//
// PART_2D (FlashAttention-2's): every product in 32-row warp tiles, so that each ldmatrix feeds twice the
//   mma of a 16-row tile. S and dP [Bm, Bn]: (Bm / 32) x (NWARPS / (Bm / 32)) warps of 32 Q rows x KW keys;
//   each warp writes its P and dS (16-bit) to shared memory (P read back, not kept in registers, for dS).
//   After a barrier: dQ = dS K in 32- (or 16-) row x DQC-column warp tiles, straight to the atomics (first,
//   so they drain under the next products); dV += P^T dO and dK += dS^T Q in 32 KV rows x DCOLS warp tiles
//   accumulated in registers over the whole loop. Per (Q row, KV row) pair and product this reads 0.45
//   ldmatrix.x4 per mma (KV partition, d128 32x128: 0.65). Operands are addressed as [register + immediate]
//   from per-lane shared addresses (gemm_smem), the k16 loops are unrolled KUNROLL steps per trip (fully
//   unrolled, head dim 128 spills), and where two dO buffers do not fit sm_80 (d64 128x128, d128 64x128)
//   dO is single-buffered: the next dO tile is loaded behind a third barrier, once every warp is done
//   with dV (a second buffer, sm_90 only, measured no faster).
//
// Cross-warp synchronisation and shared-memory exchange, per Q tile (Bm = BLOCK_M, Bn = BLOCK_N):
//   barriers:  KV, Q: 2 (+ 1 per KV tile, at its end); 2D: 2 or 3 (single dO buffer); one that publishes the cp.async Q/dO tile
//              (and proves every warp is done with the other stage and the exchange buffers), one that
//              publishes the exchanged 16-bit values (KV: dS^T before dQ; Q, 2D: P and dS before dK/dV).
//   exchanged: KV: dS^T, Bn x Bm x 2 B written, read by DQ_COL_BANDS = 16 NWARPS / Bm warps per 16-row Q
//                  band: DQ_COL_BANDS x Bn x Bm x 2 B read.
//              Q:  P and dS, 2 x Bm x Bn x 2 B written, read by CB = 16 NWARPS / Bn warps per 16-row KV band:
//                  2 x CB x Bn x Bm x 2 B read. Twice the values, and both products that consume them (dV,
//                  dK) take A and B from shared memory (KV: only dQ does).
//   With the configured tiles (cuflash/_configs.py), written + read per Q tile, and per (Q row, KV row) pair:
//     KV  d32/64/96 64x128, 8 warps: 16 + 32 KB (2 + 4 B);  d128 32x128, 8 warps: 8 + 32 KB (2 + 8 B);
//         d256 32x64, 8 warps (DSPLIT 2): 4 + 16 KB (2 + 8 B)
//     Q   d32 128x128, 8 warps: 64 + 64 KB (4 + 4 B);  d64/96 64x64, 4 warps: 16 + 16 KB (4 + 4 B);
//         d128 64x32, 4 warps: 8 + 16 KB (4 + 8 B);  d256 64x16, 4 warps: 4 + 16 KB (4 + 16 B)
//   Shared memory per block: KV 60416 / 93184 / 125952 / 115200 / 140800 B, Q 133120 / 74752 / 99328 / 98304 /
//   159232 B (d32 / 64 / 96 / 128 / 256).
//   Registers decide the tiles: the Q partition's dK/dV accumulators are 2 Bn D / (32 NWARPS) fp32 per thread
//   for the whole loop and its S/dP tiles 16 x Bn per warp, so Bn is 16-64 (KV partition: 64-128) except at
//   d32; with fewer KV rows per block, dQ atomics (seqpar: buffers) and Q/dO re-reads grow as 1 / Bn.
//
// dQ strategies (BwdParams::dq_strategy), every partition:
//   0 atomic: every block adds its dQ_i contribution into one fp32 buffer with atomics.
//   1 seqpar: block of KV tile j writes its contribution to its own fp32 buffer j (plain stores);
//             the convert kernel sums the buffers (deterministic; memory x number of KV tiles).
//   2 loop:   one block per (KV head, batch) walks all KV tiles itself, so it is the only writer of
//             its dQ rows: plain read-add-write, no atomics, deterministic.
//
// Layout of the fp32 dQ accumulator: fragment-tiled, not row-major. Per (split, batch, head) it holds
// seqlen_q_pad x D floats as [seqlen_q_pad / 16][D / 8][32 lanes][4]: one m16n8 accumulator fragment (16 rows x
// 8 columns) is 128 consecutive floats, lane l = 4 g + t owning its 4 values (row g: columns 2t, 2t+1; row g + 8:
// the same) at [4 l, 4 l + 4). So a warp adds one whole fragment with one 16-byte RED per lane, 512 contiguous
// bytes (4 cache lines); row-major, the same fragment took two 8-byte REDs per lane, each touching 8 rows = 8
// lines, and those requests queued up in the load/store unit (Nsight's "LG throttle" stalls). Element (r, c) sits
// at (r / 16) 16 D + (c / 8) 128 + 4 (4 (r % 8) + (c % 8) / 2) + 2 ((r / 8) % 2) + c % 2;
// a band of 16 rows is still the same 16 D floats, so zeroing rows and the buffer's size are unchanged.
#include "common/ptx.cuh"
#include "common/tile.cuh"
#include "common/warp_gemm.cuh"
#include "attn/params.cuh"
#include "attn/seqlen.cuh"
#include "attn/mask.cuh"
#include "attn/block.cuh"
#include "attn/softmax.cuh"
#include "attn/dropout.cuh"
#include "attn/bwd.cuh"

namespace cuflash {

enum BwdPartition { PART_KV = 0, PART_Q = 1, PART_2D = 2 };

// The largest dynamic shared memory a block may opt into on sm_80 (163 KB): every configuration must fit it.
constexpr int SM80_MAX_SMEM = 163 * 1024;

// LPR threads per row (the host's _configs.bwd_pre_lanes_per_row: a power of two >= D / 8, each thread reading 8
// columns, 16 bytes, of O and dO) of [b, h, sq_pad]: D = rowsum(dO * O), lse_log2, and (atomic/loop) zero the fp32 dQ
// accumulator (the row's D floats in memory order; over all rows of a 16-row band that is the whole band, whatever
// the layout inside it). Rows that saw no key (LSE = -inf) and padding rows get lse_log2 = +inf, so that the main
// kernel's exp2(S - lse_log2) is 0 there instead of exp2(-inf + inf) = NaN. UA: O and dO rows that are not 16-byte
// units, read element by element (common/tile.cuh: load_elems).
template <typename T, int D, int LPR, bool UA = false>
__global__ void flash_bwd_preprocess_kernel(const __grid_constant__ BwdParams p) {
  static_assert(LPR * 8 >= D && LPR <= 32 && (LPR & (LPR - 1)) == 0, "preprocess: lanes per row");
  const int64_t rows = bwd_ws_rows(p, p.cu_seqlens_q != nullptr);
  const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const int64_t row = tid / LPR;
  const int c = (int)(tid % LPR) * 8;  // this thread's columns [c, c + 8), if c < D
  const bool live = row < rows && c < D;  // no early return: every lane takes part in the shuffles below
  int64_t i = row % p.seqlen_q_pad, bh = row / p.seqlen_q_pad;
  // (b, h) and the row i of the element (packed: the element whose padded rows hold this one), and the row's
  // offset in a q-like tensor (packed: its packed row)
  int64_t h = bh % p.nheads, b = bh / p.nheads, seqlen_q = p.seqlen_q, qrow = i;
  if (p.cu_seqlens_q) {
    const int2 br = varlen_padded_row<BWD_ROW_PAD>(p.cu_seqlens_q, (int)p.batch, i);
    h = bh;
    b = br.x;
    i = br.y;
    const int q0 = b < p.batch ? __ldg(p.cu_seqlens_q + b) : 0;
    seqlen_q = b < p.batch ? __ldg(p.cu_seqlens_q + b + 1) - q0 : 0;
    qrow = q0 + i;
  }
  const bool real = i < seqlen_q;  // not a padding row
  float dsum = 0.f;
  if (live && real && c < p.head_dim) {  // columns past the inputs' head dim add nothing
    const T* o_src = reinterpret_cast<const T*>(p.o) + b * p.o_batch_stride + qrow * p.o_row_stride +
                     h * p.o_head_stride + c;
    const T* g_src = reinterpret_cast<const T*>(p.dout) + b * p.do_batch_stride + qrow * p.do_row_stride +
                     h * p.do_head_stride + c;
    const uint4 o = UA ? load_elems(o_src, (int)p.head_dim - c) : *reinterpret_cast<const uint4*>(o_src);
    const uint4 g = UA ? load_elems(g_src, (int)p.head_dim - c) : *reinterpret_cast<const uint4*>(g_src);
    const uint32_t ow[4] = {o.x, o.y, o.z, o.w}, gw[4] = {g.x, g.y, g.z, g.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 a = unpack2<T>(ow[e]), d = unpack2<T>(gw[e]);
      dsum += a.x * d.x + a.y * d.y;
    }
  }
#pragma unroll
  for (int off = LPR / 2; off > 0; off /= 2) dsum += __shfl_xor_sync(0xffffffffu, dsum, off);
  if (!live) return;
  if (c == 0) {
    const float log2e = 1.4426950408889634f;
    // LSE: [b, h, sq], or [h, total_q] packed
    const float lse = !real ? -INFINITY : p.cu_seqlens_q ? p.lse[h * p.seqlen_q + qrow] : p.lse[bh * p.seqlen_q + i];
    p.delta[row] = dsum;
    p.lse_log2[row] = lse == -INFINITY ? INFINITY : lse * log2e;
  }
  if (p.dq_strategy != DQ_SEQPAR) {
    float4* acc = reinterpret_cast<float4*>(p.dq_accum + row * D + c);
    acc[0] = make_float4(0.f, 0.f, 0.f, 0.f);
    acc[1] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  if (p.dq_strategy == DQ_ORDERED && c == 0 && row % DQ_ORDERED_ROWS_PER_SEM == 0)  // its semaphores (attn/bwd.cuh)
    reinterpret_cast<int*>(p.dq_accum + rows * D)[row / DQ_ORDERED_ROWS_PER_SEM] = 0;
}

// dQ = softmax_scale * sum of the fp32 partials. Each thread takes BWD_CONVERT_SLOTS 16-byte slots of the
// fragment-tiled accumulator: one lane position l of a 16-row band (rows g and g + 8, columns 2t and 2t + 1 of each
// n8 block) in the NS consecutive n8 blocks jg NS .. jg NS + NS - 1, so a warp's loads of one block are 512
// contiguous bytes and the thread's index arithmetic (64-bit divisions by run-time sizes, the sequence's offsets) is
// paid once for all its slots, whose loads are all issued before the first is used. The sums, scaled and packed to
// T pairs, then go through the warp's shared-memory slice once, transposed within each quad of lanes: lane t of the
// quad takes block jg NS + t whole -- 8 columns of rows g and g + 8, two 16-byte stores -- so a warp's store writes
// 64 contiguous bytes of each of 8 rows (whole 32-byte sectors) instead of 4-byte pieces. For "seqpar" only the KV
// tiles a row can see were written for it (causal: tiles j with j * BLOCK_N <= i + sk - sq). UA: dQ rows that are
// not 16-byte units (2-byte stores of each lane's own pairs, no transpose; the column past an odd head dim skipped).
constexpr int BWD_CONVERT_SLOTS = 4;
constexpr int BWD_CONVERT_THREADS = 256;  // the block (cuflash/_configs.py: the same number)

template <typename T, int D, int BLOCK_N, bool CAUSAL, int MOD = MOD_NONE, bool UA = false>
__global__ void __launch_bounds__(BWD_CONVERT_THREADS)
    flash_bwd_convert_dq_kernel(const __grid_constant__ BwdParams p) {
  constexpr int NS = BWD_CONVERT_SLOTS, JG = D / 8 / NS;
  static_assert(D % (8 * NS) == 0, "convert: the head dim's n8 blocks in groups of BWD_CONVERT_SLOTS");
  static_assert(NS == 4, "the quad transpose: one slot per lane of a quad");
  // a warp's slice: [slot n][row half][g ^ 2n][t] T pairs, so that (n, half, g) is one 16-byte row piece; the XOR
  // keeps both the pair stores (a slot's 32 lanes on 32 consecutive words) and the 16-byte loads (a quarter warp's 8
  // lanes: g in {2q, 2q + 1}, t = n in 0 .. 3, on 8 distinct 16-byte bank groups) free of bank conflicts
  __shared__ __align__(16) uint32_t stage[BWD_CONVERT_THREADS / 32][NS * 2 * 32];
  const int64_t ws_rows = bwd_ws_rows(p, p.cu_seqlens_q != nullptr);
  const int64_t threads = ws_rows / 16 * (32 * JG);
  const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= threads) return;  // (whole warps: threads is a multiple of 32)
  const int l = (int)(idx % 32), jg = (int)(idx / 32 % JG);
  const int64_t band = idx / (32 * JG);
  const int64_t bh = band / (p.seqlen_q_pad / 16);
  int64_t i0 = (band % (p.seqlen_q_pad / 16)) * 16 + l / 4;  // rows i0 and i0 + 8
  int64_t h = bh % p.nheads, b = bh / p.nheads;
  if (p.cu_seqlens_q) {  // packed: the element whose padded rows hold the band (one element per 16-row band)
    const int2 br = varlen_padded_row<BWD_ROW_PAD>(p.cu_seqlens_q, (int)p.batch, i0);
    if (br.x >= p.batch) return;  // (the band's: the whole warp)
    h = bh;
    b = br.x;
    i0 = br.y;
  }
  const SeqInfo si = seqinfo(p, (int)b, p.cu_seqlens_q != nullptr);
  if (i0 - l / 4 >= si.seqlen_q) return;  // the band's first row past the sequence: the whole warp
  int64_t splits0 = p.num_dq_splits, splits8 = p.num_dq_splits, begin0 = 0, begin8 = 0;
  if ((CAUSAL || MOD != MOD_NONE) && p.dq_strategy == DQ_SEQPAR) {  // the KV tiles rows i0, i0 + 8 see (attn/block.cuh)
    const Mask<CAUSAL, MOD> mask = si.mask<CAUSAL, MOD>(p, (int)b, (int)h);
    splits0 = min(splits0, (int64_t)max(0, kv_block_end<BLOCK_N>(mask, (int)i0 + 1)));
    splits8 = min(splits8, (int64_t)max(0, kv_block_end<BLOCK_N>(mask, (int)i0 + 9)));
    begin0 = kv_block_begin<BLOCK_N>(mask, (int)i0);
    begin8 = kv_block_begin<BLOCK_N>(mask, (int)i0 + 8);
  }
  const int64_t split_stride = ws_rows * D;
  // slot n: block jg NS + n of the band, 128 floats (32 float4) per block
  const float4* acc = reinterpret_cast<const float4*>(p.dq_accum + band * 16 * D) + jg * NS * 32 + l;
  float4 sum[NS];
#pragma unroll
  for (int n = 0; n < NS; ++n) sum[n] = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int64_t s = begin0; s < splits8; ++s) {  // splits8 >= splits0, begin8 >= begin0
    if (MOD != MOD_NONE && s < begin8 && s >= splits0) continue;
    const float4* src = acc + s * (split_stride / 4);
    float4 x[NS];
#pragma unroll
    for (int n = 0; n < NS; ++n) x[n] = src[n * 32];
#pragma unroll
    for (int n = 0; n < NS; ++n) {
      if (s < splits0) {
        sum[n].x += x[n].x;
        sum[n].y += x[n].y;
      }
      if (MOD == MOD_NONE || s >= begin8) {
        sum[n].z += x[n].z;
        sum[n].w += x[n].w;
      }
    }
  }
  const float scale = (float)p.softmax_scale;
  T* dq_row = reinterpret_cast<T*>(p.dq) + si.q_offset(p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride, b, h) +
              i0 * p.dq_row_stride;
  const bool row0 = i0 < si.seqlen_q, row8 = i0 + 8 < si.seqlen_q;
  if constexpr (UA) {
#pragma unroll
    for (int n = 0; n < NS; ++n) {
      const int c = (jg * NS + n) * 8 + 2 * (l % 4);
      if (c >= p.head_dim || !row0) continue;  // the padding columns of a head dim below D
      store_pair_elems(dq_row + c, pack2<T>(sum[n].x * scale, sum[n].y * scale), c, (int)p.head_dim);
      if (row8)
        store_pair_elems(dq_row + 8 * p.dq_row_stride + c, pack2<T>(sum[n].z * scale, sum[n].w * scale), c,
                         (int)p.head_dim);
    }
  } else {
    uint32_t* st = stage[threadIdx.x / 32];
    const int g = l / 4, t = l % 4;
#pragma unroll
    for (int n = 0; n < NS; ++n) {
      st[((n * 2 + 0) * 8 + (g ^ (2 * n))) * 4 + t] = pack2<T>(sum[n].x * scale, sum[n].y * scale);
      st[((n * 2 + 1) * 8 + (g ^ (2 * n))) * 4 + t] = pack2<T>(sum[n].z * scale, sum[n].w * scale);
    }
    __syncwarp();
    const int c = (jg * NS + t) * 8;  // this lane's block: columns c .. c + 7 (the head dim a multiple of 8 here)
    if (c < p.head_dim && row0) {
      const uint4 lo = *reinterpret_cast<const uint4*>(st + ((t * 2 + 0) * 8 + (g ^ (2 * t))) * 4);
      *reinterpret_cast<uint4*>(dq_row + c) = lo;
      if (row8) {
        const uint4 hi = *reinterpret_cast<const uint4*>(st + ((t * 2 + 1) * 8 + (g ^ (2 * t))) * 4);
        *reinterpret_cast<uint4*>(dq_row + 8 * p.dq_row_stride + c) = hi;
      }
    }
  }
}

// The convert of the T (transposed) accumulator layout, which the Hopper backward's 80-row Q tiles write (attn/bwd.cuh:
// the tile of BM rows [BM m, BM m + BM) of a head as [D / 16][BM / 8][32 lanes][4], the m16n8 fragments of dQ^T).
// A warp takes the rows [BM m + 16 qg, + 16) and the columns [32 bp, + 32): four fragments (two 16-column bands x two
// 8-row blocks), summed over the splits and scaled, then passed through the warp's slice of shared memory as 16-bit
// values [16 rows][32 columns] (rows padded to 40 values: the lanes' 2-byte stores of one instruction fall on distinct
// banks) and stored as 16-byte pieces of rows, 64 contiguous bytes of each row per 4 lanes. Fixed lengths, no mask
// (the tiles' kernel has neither): every split holds every row.
template <typename T, int D, int BM>
__global__ void __launch_bounds__(BWD_CONVERT_THREADS) flash_bwd_convert_dq_t_kernel(const __grid_constant__ BwdParams p) {
  static_assert(D % 32 == 0 && BM % 16 == 0, "convert (T): 32-column band pairs, 16-row groups");
  constexpr int QG = BM / 16, BP = D / 32, PAD = 40;
  __shared__ __align__(16) unsigned short stage[BWD_CONVERT_THREADS / 32][16 * PAD];
  const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const int64_t wid = idx / 32;
  const int lane = (int)(idx % 32), g = lane / 4, t = lane % 4;
  const int num_m = (int)((p.seqlen_q + BM - 1) / BM);
  const int qg = (int)(wid % QG), bp = (int)(wid / QG % BP), tm = (int)(wid / (QG * BP) % num_m);
  const int64_t bh = wid / ((int64_t)QG * BP * num_m);
  const int64_t q0 = (int64_t)tm * BM + 16 * qg;
  if (bh >= p.batch * p.nheads || q0 >= p.seqlen_q) return;  // (whole warps)
  const int64_t split_stride = bwd_ws_rows(p, false) * D;
  const float4* base = reinterpret_cast<const float4*>(p.dq_accum + (bh * p.seqlen_q_pad + (int64_t)tm * BM) * D) + lane;
  float4 sum[4];
#pragma unroll
  for (int f = 0; f < 4; ++f) sum[f] = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int64_t s = 0; s < p.num_dq_splits; ++s) {
    float4 x[4];
#pragma unroll
    for (int f = 0; f < 4; ++f)  // fragment f: band 2 bp + f / 2, row block 2 qg + f % 2
      x[f] = base[s * (split_stride / 4) + ((2 * bp + f / 2) * (BM / 8) + 2 * qg + f % 2) * 32];
#pragma unroll
    for (int f = 0; f < 4; ++f) {
      sum[f].x += x[f].x;
      sum[f].y += x[f].y;
      sum[f].z += x[f].z;
      sum[f].w += x[f].w;
    }
  }
  const float scale = (float)p.softmax_scale;
  unsigned short* st = stage[threadIdx.x / 32];
#pragma unroll
  for (int f = 0; f < 4; ++f) {  // (x, y): rows r, r + 1 of column c; (z, w): of column c + 8
    const int r = 8 * (f % 2) + 2 * t, c = 16 * (f / 2) + g;
    const uint32_t lo = pack2<T>(sum[f].x * scale, sum[f].y * scale), hi = pack2<T>(sum[f].z * scale, sum[f].w * scale);
    st[r * PAD + c] = (unsigned short)(lo & 0xffffu);
    st[(r + 1) * PAD + c] = (unsigned short)(lo >> 16);
    st[r * PAD + c + 8] = (unsigned short)(hi & 0xffffu);
    st[(r + 1) * PAD + c + 8] = (unsigned short)(hi >> 16);
  }
  __syncwarp();
  const int64_t b = bh / p.nheads, h = bh % p.nheads;
  const SeqInfo si = seqinfo(p, (int)b, false);
  T* dq = reinterpret_cast<T*>(p.dq) + si.q_offset(p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride, b, h);
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int piece = lane + 32 * k, r = piece / 4, c = 32 * bp + 8 * (piece % 4);
    if (q0 + r < p.seqlen_q && c < p.head_dim)
      *reinterpret_cast<uint4*>(dq + (q0 + r) * p.dq_row_stride + c) =
          *reinterpret_cast<const uint4*>(st + r * PAD + 8 * (piece % 4));
  }
}

// acc[0..3] += v[0..3] at a 16-byte aligned fp32 address, atomically per element.
__device__ __forceinline__ void atomic_add_f4(float* addr, const float (&v)[4]) {
#if __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float4*>(addr), make_float4(v[0], v[1], v[2], v[3]));  // one RED.E.ADD.F32x4
#else
#pragma unroll
  for (int e = 0; e < 4; ++e) atomicAdd(addr + e, v[e]);
#endif
}

// ------------------------------------------------------------------------------------------------------
// Warp-level pieces of the main kernel (both partitions). Fragment layouts: common/ptx.cuh.

// acc[16, 8 NF] += X Y^T, X = rows [0, 16) of x_rows, Y = rows [0, 8 NF) of y_tile: both row-major 16-bit
// smem tiles [*, 16 KD] with row stride lds, read with plain ldmatrix (S = Q K^T, dP = dO V^T and their
// transposes S^T = K Q^T, dP^T = V dO^T). UNROLL: k16 steps per loop trip (see KUNROLL).
template <typename T, int KD, int NF, int UNROLL = KD>
__device__ __forceinline__ void gemm_rows_rows_t(float (&acc)[NF][4], const T* x_rows, const T* y_tile, int lds,
                                                 int lane) {
#pragma unroll UNROLL
  for (int kd = 0; kd < KD; ++kd) {
    uint32_t a[4];
    ldmatrix_x4(a, smem_addr(x_rows + (lane % 16) * lds + kd * 16 + (lane / 16) * 8));
#pragma unroll
    for (int nf = 0; nf < NF; nf += 2) {
      uint32_t b[4];
      ldmatrix_x4(b, smem_addr(y_tile + (nf * 8 + (lane % 8) + (lane / 16) * 8) * lds + kd * 16 +
                               ((lane / 8) % 2) * 8));
      mma_m16n8k16<T>(acc[nf], a, b[0], b[1]);
      mma_m16n8k16<T>(acc[nf + 1], a, b[2], b[3]);
    }
  }
}

// acc[16, 8 NF] += A B with both operands stored k-major in smem: A^T = rows [0, 16 KS) x columns
// [a_col0, +16) of a_t (row stride lda), B = rows [0, 16 KS) x columns [b_col0, +8 NF) of b_tile (row stride
// ldb); ldmatrix.trans for both (KV partition: dQ = dS K from dS^T; Q partition: dV = P^T dO, dK = dS^T Q
// from P, dS). UNROLL: k16 steps per loop trip (see KUNROLL).
template <typename T, int KS, int NF, int UNROLL = KS>
__device__ __forceinline__ void gemm_smem_at_b(float (&acc)[NF][4], const T* a_t, int lda, int a_col0, const T* b_tile,
                                               int ldb, int b_col0, int lane) {
#pragma unroll UNROLL
  for (int ks = 0; ks < KS; ++ks) {
    uint32_t a[4];
    ldmatrix_x4_trans(a, smem_addr(a_t + (ks * 16 + (lane % 8) + (lane / 16) * 8) * lda + a_col0 +
                                   ((lane / 8) % 2) * 8));
#pragma unroll
    for (int nf = 0; nf < NF; nf += 2) {
      uint32_t b[4];
      const int br = ks * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
      const int bc = b_col0 + nf * 8 + (lane / 16) * 8;
      ldmatrix_x4_trans(b, smem_addr(b_tile + br * ldb + bc));
      mma_m16n8k16<T>(acc[nf], a, b[0], b[1]);
      mma_m16n8k16<T>(acc[nf + 1], a, b[2], b[3]);
    }
  }
}

// acc[16 MF, 8 NF] += A B over KS k16 steps with both operands in shared memory (PART_2D: every product).
// A_KMAJOR: A is stored transposed, rows = k, columns = m (ldmatrix.trans), else row-major, rows = m (plain
// ldmatrix). B_KMAJOR: B is stored row-major [k, n] (ldmatrix.trans), else as B^T [n, k] (plain ldmatrix).
// LDA, LDB: row strides in elements. `a`, `b`: this lane's shared addresses of the warp's block origin, lane
// offsets included (lane_off_a / lane_off_b), so every ldmatrix is [register + immediate] and a loop trip of
// the k16 steps adds one constant per operand. Per k16 step: MF A loads, NF / 2 B loads, MF NF mma.
template <typename T, int MF, int NF, int KS, bool A_KMAJOR, bool B_KMAJOR, int LDA, int LDB, int UNROLL = KS>
__device__ __forceinline__ void gemm_smem(float (&acc)[MF][NF][4], uint32_t a, uint32_t b) {
  static_assert(NF % 2 == 0, "B is loaded two n8 fragments at a time");
#pragma unroll UNROLL
  for (int ks = 0; ks < KS; ++ks) {
    uint32_t af[MF][4];
#pragma unroll
    for (int mf = 0; mf < MF; ++mf) {
      if constexpr (A_KMAJOR)
        ldmatrix_x4_trans(af[mf], a + 2 * (ks * 16 * LDA + mf * 16));
      else
        ldmatrix_x4(af[mf], a + 2 * (mf * 16 * LDA + ks * 16));
    }
#pragma unroll
    for (int nf = 0; nf < NF; nf += 2) {
      uint32_t bf[4];
      if constexpr (B_KMAJOR)
        ldmatrix_x4_trans(bf, b + 2 * (ks * 16 * LDB + nf * 8));
      else
        ldmatrix_x4(bf, b + 2 * (nf * 8 * LDB + ks * 16));
#pragma unroll
      for (int mf = 0; mf < MF; ++mf) {
        mma_m16n8k16<T>(acc[mf][nf], af[mf], bf[0], bf[1]);
        mma_m16n8k16<T>(acc[mf][nf + 1], af[mf], bf[2], bf[3]);
      }
    }
  }
}

// A fragments of a warp's 16-bit [16, 16 KS] block -> rows [row0, +16) x columns [0, 16 KS) of a row-major
// smem tile (row stride lds): the layout gemm_smem_at_b reads back transposed.
template <int KS, typename T>
__device__ __forceinline__ void store_a_frags(T* tile, int lds, int row0, const uint32_t (&a)[KS][4], int lane) {
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int k = 0; k < KS; ++k) {
    uint32_t* r0 = reinterpret_cast<uint32_t*>(tile + (row0 + g) * lds + k * 16 + 2 * t);
    uint32_t* r8 = reinterpret_cast<uint32_t*>(tile + (row0 + g + 8) * lds + k * 16 + 2 * t);
    r0[0] = a[k][0];
    r8[0] = a[k][1];
    r0[4] = a[k][2];  // +8 columns = +4 words
    r8[4] = a[k][3];
  }
}

// The dO tile of (query head hq, Q tile at row m0).
// Rows [m0, m0 + BLOCK_M) of one head's [seqlen_q, D] matrix into a tile, zero-filled past seqlen_q. FAST: a
// full tile goes without bounds checks (one IMAD.WIDE.U32 per 16-byte chunk, common/tile.cuh); only the 2D
// partition uses it (at head dim 128 the KV partition's kernels are at 255 registers and it makes them spill).
// UA: rows that are not 16-byte units, element by element (common/tile.cuh: PAD_ELEM).
template <typename T, int D, int BLOCK_M, int NT, bool FAST, bool UA = false>
__device__ __forceinline__ void load_rows(T* dst, const T* head, int64_t row_stride, int m0, int seqlen_q, int tid,
                                          int cols) {
  if (FAST && !UA && m0 + BLOCK_M <= seqlen_q)
    FullTileLoader<BLOCK_M, D, NT, T>(head, row_stride, tid, cols).copy(dst, m0);
  else
    load_tile_async<BLOCK_M, D, NT, UA ? PAD_ELEM : PAD_COPY>(dst, head, row_stride, m0, seqlen_q, tid, cols);
}

template <typename T, int D, int BLOCK_M, int NT, bool FAST, bool UA = false>
__device__ __forceinline__ void load_do_tile(const BwdParams& p, T* do_dst, const SeqInfo& si, int batch, int hq,
                                             int m0, int tid) {
  const T* do_head = reinterpret_cast<const T*>(p.dout) +
                     si.q_offset(p.do_batch_stride, p.do_row_stride, p.do_head_stride, batch, hq);
  load_rows<T, D, BLOCK_M, NT, FAST, UA>(do_dst, do_head, p.do_row_stride, m0, si.seqlen_q, tid, (int)p.head_dim);
}

// Loads of one (query head hq, Q tile at row m0) into one pipeline stage: Q, dO tiles (dO only if LOAD_DO),
// lse_log2 and D rows (fp32 rows are padded to sq_pad: no guard). VARLEN: packed sequences.
template <typename T, int D, int BLOCK_M, int NT, bool FAST, bool VARLEN, bool LOAD_DO = true, bool UA = false>
__device__ __forceinline__ void load_q_tile(const BwdParams& p, T* q_dst, T* do_dst, float* lse_dst, float* delta_dst,
                                            const SeqInfo& si, int batch, int hq, int m0, int tid) {
  const T* q_head = reinterpret_cast<const T*>(p.q) +
                    si.q_offset(p.q_batch_stride, p.q_row_stride, p.q_head_stride, batch, hq);
  load_rows<T, D, BLOCK_M, NT, FAST, UA>(q_dst, q_head, p.q_row_stride, m0, si.seqlen_q, tid, (int)p.head_dim);
  if constexpr (LOAD_DO) load_do_tile<T, D, BLOCK_M, NT, FAST, UA>(p, do_dst, si, batch, hq, m0, tid);
  const int64_t row0 = VARLEN ? bwd_ws_base(p, si, batch, true) + hq * p.seqlen_q_pad + m0
                              : ((int64_t)batch * p.nheads + hq) * p.seqlen_q_pad + m0;
  if (tid < BLOCK_M / 4)
    cp_async_16(smem_addr(lse_dst + tid * 4), p.lse_log2 + row0 + tid * 4, true);
  else if (tid < BLOCK_M / 2)
    cp_async_16(smem_addr(delta_dst + (tid - BLOCK_M / 4) * 4), p.delta + row0 + (tid - BLOCK_M / 4) * 4, true);
}

// This lane's slot of the first fragment of the 16-row band starting at `row0` (a multiple of 16) of (query head
// hq)'s fp32 dQ accumulator, in the buffer this KV tile writes (seqpar: its own). Fragment (band + mf, column
// block c / 8) is at + mf 16 D + 16 c (dq_frag_offset).
// A warp's fp32 dQ fragments [16, 8 NF] (columns c0 + 8 df) into the accumulator; `a0` = this lane's slot of the
// first one (dq_accum_band + dq_frag_offset; padded rows: always in bounds). Fragment df is 128 floats further.
// The strategy test sits outside the loops: one branch per call, then straight-line 16-byte accesses.
template <int D, int NF>
__device__ __forceinline__ void dq_accumulate(const BwdParams& p, float* a0, const float (&acc)[NF][4]) {
  if (p.dq_strategy == DQ_ATOMIC) {
#pragma unroll
    for (int df = 0; df < NF; ++df) atomic_add_f4(a0 + df * 128, acc[df]);
  } else if (p.dq_strategy == DQ_SEQPAR) {
#pragma unroll
    for (int df = 0; df < NF; ++df)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        *reinterpret_cast<float2*>(a0 + df * 128 + 2 * h) = make_float2(acc[df][2 * h], acc[df][2 * h + 1]);
  } else {  // DQ_LOOP: this lane is the only writer of its slot
#pragma unroll
    for (int df = 0; df < NF; ++df)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float2* a = reinterpret_cast<float2*>(a0 + df * 128 + 2 * h);
        const float2 old = *a;
        *a = make_float2(old.x + acc[df][2 * h], old.y + acc[df][2 * h + 1]);
      }
  }
}

// The 2D partition's warp tiling (used by its branch of flash_bwd_kernel, and by the DQ_BULK reduction at the
// loop top).
// S, dP [BLOCK_M, BLOCK_N]: WM_S x WN_S warps of 32 Q rows x KW keys. dQ [BLOCK_M, D]: WM_Q x WD_Q warps of
// 16 MFQ Q rows x DQC columns (32-row tiles unless the columns would not split into k16 multiples, then 16-row
// tiles), DQ_CH columns per pass (bounds its accumulator registers).
template <int D, int BLOCK_M, int BLOCK_N, int NWARPS>
struct Tiling2D {
  static constexpr int WM_S = BLOCK_M / 32 > 0 ? BLOCK_M / 32 : 1, WN_S = NWARPS / WM_S, KW = BLOCK_N / WN_S;
  static constexpr int NFS = KW / 8;
  static constexpr int WM_Q = (D / (NWARPS / WM_S)) % 16 == 0 ? WM_S : BLOCK_M / 16;
  static constexpr int WD_Q = NWARPS / WM_Q, MFQ = BLOCK_M / (16 * WM_Q), DQC = D / WD_Q;
  static constexpr int DQ_CH = DQC > 64 ? 64 : DQC;
};

// Shared-memory bytes of the main kernel's layout (the host computes the same: _configs.bwd_smem_bytes).
// dO is double-buffered like Q, except in PART_2D when that would not fit sm_80 (DO_STAGES = 1: the next dO
// tile is loaded once every warp is done with dV += P^T dO, behind one more barrier).
// DQ_BULK (2D, sm_90): + BLOCK_M x D fp32 staging for the dQ tile (cp.reduce.async.bulk reads it), and dO
// double-buffered even where that does not fit sm_80.
template <int D, int BLOCK_M, int BLOCK_N, int PARTITION, int ELEM, bool DQ_BULK = false>
struct BwdSmem {
  static constexpr int LDS = PaddedRow<D>::LDS;
  static constexpr int EXCHANGE = PARTITION != PART_KV ? 2 * BLOCK_M * PaddedRow<BLOCK_N>::LDS * ELEM  // P, dS
                                                       : BLOCK_N * PaddedRow<BLOCK_M>::LDS * ELEM;    // dS^T
  __host__ __device__ static constexpr int bytes(int do_stages) {  // K, V, 2 x Q, do_stages x dO, exchange, 2 x (lse, D) rows
    return (2 * BLOCK_N + (2 + do_stages) * BLOCK_M) * LDS * ELEM + EXCHANGE + 4 * BLOCK_M * (int)sizeof(float);
  }
  static constexpr int DO_STAGES = DQ_BULK ? 2 : PARTITION == PART_2D && bytes(2) > SM80_MAX_SMEM ? 1 : 2;
  static constexpr int STAGING = DQ_BULK ? BLOCK_M * D * (int)sizeof(float) : 0;
  static constexpr int BYTES = bytes(DO_STAGES) + STAGING;
};

// ------------------------------------------------------------------------------------------------------
// Main kernel. Grid: (KV tiles, or 1 for "loop"; KV heads; batch). PARTITION: PART_KV, PART_Q or PART_2D
// (see top).  KV: BLOCK_N * DSPLIT == 16 * NWARPS.  Q: BLOCK_M == 16 * NWARPS, DSPLIT == 1.
//   2D: 32-row warp tiles, BLOCK_M % 32 == 0, BLOCK_N % 32 == 0, DSPLIT == 1.
//   KUNROLL: k16 steps unrolled per loop trip in the products whose operands both come from shared memory (0:
//   all; cuflash/_configs.py: BwdTile). Fully unrolled, ptxas hoists the ldmatrix of later steps; where the
//   dK/dV accumulators already take most of the 255 registers that spills (the KV partition at head dims
//   96-256 with NVRTC 13.0, the H200 image's compiler). Register-operand loops always unroll fully.
//   DQ_BULK (2D partition, sm_90, "atomic" dQ): each warp stores its dQ tile to shared memory and one lane adds it
//   to the accumulator with cp.reduce.async.bulk (the TMA unit's reduction), so no RED holds the accumulator
//   registers (their write-after-read waits: bench/NOTES.md, dQ strategies). Other strategies use dq_accumulate.
//   The reductions are issued from warp-uniform values (the warp index broadcast by __shfl_sync, as CUTLASS's
//   canonical_warp_idx_sync does; built from per-lane values, ptxas wraps each in an ELECT loop), and the dQ
//   tile staged in step i is reduced at the top of step i + 1, after its cp_async_wait<0> and barrier and before
//   it requests the next tiles: the proxy fence in front of the reduction then has no cp.async of this thread to
//   wait for. dO is double-buffered (sm_90's shared memory allows it at every 2D tile).
//   P_REGS (2D partition): dS = P * (dP - D) takes P from its packed 16-bit fragments kept in registers across
//   the dP product, instead of reading back the words this thread stored to shared memory (2 LDS per n8 block:
//   they queue with MUFU.EX2 in the MIO pipe). Costs NFS * 4 registers (bf16 fits only since unpack2 takes
//   bf16 apart with a shift and a mask: through __bfloat1622float2 the d64 tile spilled 24-64 B, NVRTC 13.0).
//   LOAD_AT (2D partition with DQ_BULK): where the next Q tile's copies are requested. 0: right after
//   barrier 1; 1: after S = Q K^T, while S is live, so that ptxas cannot give the copies' address registers to
//   the constants and accumulators of that product (the forward's LOAD_AT = 1, flash_fwd.cu); 2: after P is
//   computed and stored, before dP = dO V^T (with EXP_IL: after the interleaved dP and exps).
//   EXP_IL (2D): dP = dO V^T is computed one k16 step at a time, and P's exps are interleaved with it, 1 / KD of
//   the S tile after each step, so that MUFU.EX2 issues between the HMMAs instead of as one block queued behind
//   the ldmatrix of dP in the MIO pipe (S and dP accumulators both live during dP).
//   UA: rows of Q, K, V, dO, dK, dV that are not 16-byte units (head dims that are not multiples of 8, strides or
//   base addresses that are not 16-byte aligned): element-wise predicated loads and stores (common/tile.cuh:
//   PAD_ELEM), the host picking it with the score-modifier masks (MOD_SCORE[_DROPOUT]) and the sm_80 tables only.
//   VARLEN: packed sequences (attn/seqlen.cuh; BwdParams::cu_seqlens_q): grid x over every element's KV tiles
//   ("loop": z over the elements, as fixed), each element's lengths and first rows from cu_seqlens. A template
//   parameter so that the fixed-length kernels keep their lengths in the parameter block, not in registers.
template <typename T, int D, int BLOCK_M, int BLOCK_N, int NWARPS, int DSPLIT, bool CAUSAL, int SMEM_BYTES,
          int PARTITION, int KUNROLL = 0, bool DQ_BULK = false, bool P_REGS = false, int LOAD_AT = 0,
          bool EXP_IL = false, int MOD = MOD_NONE, bool VARLEN = false, bool UA = false>
// Launch bounds: at head dim 32 the kernels need ~130-200 registers and ptxas (NVRTC 13.5) caps some at 128 to fit
// two blocks per SM, spilling 4-8 B; one block per SM (the second argument; 0 = no minimum) lets them keep their
// registers. Other head dims are far above 128 and unaffected (their SASS is identical either way).
__global__ void __launch_bounds__(NWARPS * 32, D <= 32 ? 1 : 0) flash_bwd_kernel(const __grid_constant__ BwdParams p) {
  constexpr bool QPART = PARTITION == PART_Q;
  constexpr bool P2D = PARTITION == PART_2D;
  constexpr int NT = NWARPS * 32;
  constexpr int LDS = PaddedRow<D>::LDS;
  constexpr int KD = D / 16;        // k16 steps of the products that contract over D
  constexpr int KQ = BLOCK_M / 16;  // k16 steps of the products that contract over Q rows
  constexpr int KN = BLOCK_N / 16;  // k16 steps of the products that contract over KV rows
  // dK/dV ownership (both partitions): warp w accumulates RBW bands of 16 KV rows, bands
  // (w / CB) * RBW + r, x DCOLS = D / CB columns starting at (w % CB) * DCOLS.
  // 2D: warps tile dK/dV [BLOCK_N, D] as (BLOCK_N / 32) x CB blocks of 32 KV rows (RBW = 2 bands) x DCOLS.
  constexpr int CB = P2D ? NWARPS / (BLOCK_N / 32)
                         : QPART ? (16 * NWARPS >= BLOCK_N ? 16 * NWARPS / BLOCK_N : 1) : DSPLIT;
  constexpr int RBW = P2D ? 2 : QPART ? (BLOCK_N > 16 * NWARPS ? BLOCK_N / (16 * NWARPS) : 1) : 1;
  constexpr int DCOLS = D / CB;
  constexpr int DFO = DCOLS / 8;  // n8 fragments of a warp's dK/dV row band
  static_assert(PARTITION == PART_KV || PARTITION == PART_Q || PARTITION == PART_2D, "partition");
  static_assert(P2D ? (BLOCK_M % 32 == 0 && BLOCK_N % 32 == 0 && DSPLIT == 1)
                    : QPART ? (BLOCK_M == 16 * NWARPS && DSPLIT == 1) : (BLOCK_N * DSPLIT == 16 * NWARPS),
                "KV: each warp (pair, with DSPLIT = 2) owns 16 KV rows; Q: each warp owns 16 Q rows");
  static_assert(RBW * 16 * (NWARPS / CB) == BLOCK_N && NWARPS % CB == 0 && DCOLS % 16 == 0 && KQ >= 1 && KN >= 1,
                "every (KV row band, column band) of dK/dV is owned by exactly one warp");
  static_assert(SMEM_BYTES == BwdSmem<D, BLOCK_M, BLOCK_N, PARTITION, (int)sizeof(T), DQ_BULK>::BYTES,
                "host smem size must match the layout below");
  static_assert(!DQ_BULK || PARTITION == PART_2D, "DQ_BULK: the 2D partition's option");
  static_assert(!P_REGS || PARTITION == PART_2D, "P_REGS: the 2D partition's option");
  static_assert(LOAD_AT == 0 || (LOAD_AT <= 2 && DQ_BULK), "LOAD_AT: an option of the DQ_BULK (sm_90) tiles");
  static_assert(!EXP_IL || P2D, "EXP_IL: the 2D partition's option");
  // MOD_SCORE_DROPOUT: P recomputed, marked by its sign where the forward dropped it (attn/dropout.cuh); dV takes
  // max(P, 0) and is scaled by 1 / (1 - p), dS = P (dP / (1 - p) - D) where kept, -P D where dropped.
  constexpr bool DROP = (MOD & MOD_DROPOUT) != 0;
  auto ds_of = [&](float pv, float dp, float dl) {
    if constexpr (DROP)
      return dropout_ds(pv, dp, dl, (float)p.dropout_scale);
    else
      return pv * (dp - dl);
  };
  // KV partition only: the dQ phase tiles [BLOCK_M, D] as 16-row bands x DQ_COLS columns.
  constexpr int U_D = KUNROLL && KUNROLL < KD ? KUNROLL : KD;  // loop unrolling of the k16 steps over D, Q rows,
  constexpr int U_M = KUNROLL && KUNROLL < KQ ? KUNROLL : KQ;  // KV rows (see KUNROLL)
  constexpr int U_N = KUNROLL && KUNROLL < KN ? KUNROLL : KN;
  constexpr int DQ_ROW_BANDS = BLOCK_M / 16;
  constexpr int DQ_COL_BANDS = QPART || P2D ? 1 : NWARPS / DQ_ROW_BANDS;
  constexpr int DQ_COLS = D / DQ_COL_BANDS;
  constexpr int DQF = DQ_COLS / 8;
  static_assert(QPART || P2D || (NWARPS % DQ_ROW_BANDS == 0 && DQ_COLS % 16 == 0), "KV partition: dQ phase tiles");
  // Q partition only: dQ = dS K is computed (and written out) DQ_CHUNK columns at a time.
  constexpr int DQ_CHUNK = D < 32 ? D : 32;
  static_assert(D % DQ_CHUNK == 0 && DQ_CHUNK % 16 == 0, "dQ chunks");

  using Smem = BwdSmem<D, BLOCK_M, BLOCK_N, PARTITION, (int)sizeof(T), DQ_BULK>;
  constexpr int DO_STAGES = Smem::DO_STAGES;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* k_smem = reinterpret_cast<T*>(smem_raw);        // [BLOCK_N][LDS]
  T* v_smem = k_smem + BLOCK_N * LDS;                // [BLOCK_N][LDS]
  T* q_smem = v_smem + BLOCK_N * LDS;                // [2][BLOCK_M][LDS]
  T* do_smem = q_smem + 2 * BLOCK_M * LDS;           // [DO_STAGES][BLOCK_M][LDS]
  T* xc_smem = do_smem + DO_STAGES * BLOCK_M * LDS;  // exchange: KV: dS^T [BLOCK_N][LDS_DS]; Q, 2D: P, dS [BLOCK_M][LDS_PS]
  constexpr int LDS_DS = PaddedRow<BLOCK_M>::LDS;
  constexpr int LDS_PS = PaddedRow<BLOCK_N>::LDS;
  float* lse_smem = reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(xc_smem) + Smem::EXCHANGE);  // [2][Bm]
  float* delta_smem = lse_smem + 2 * BLOCK_M;                                                             // [2][Bm]
  float* dq_stage = delta_smem + 2 * BLOCK_M;  // DQ_BULK: [NWARPS][the warp's dQ tile, fragment-tiled]
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  static_assert(!DQ_BULK, "DQ_BULK needs sm_90 (cp.reduce.async.bulk)");
  static_assert(SMEM_BYTES <= SM80_MAX_SMEM, "this tile needs sm_90's shared memory");
#endif
  const bool dq_bulk = DQ_BULK && p.dq_strategy == DQ_ATOMIC;
  using TD = Tiling2D<D, BLOCK_M, BLOCK_N, NWARPS>;
  // DQ_BULK: add this warp's staged dQ tile of (KV tile, batch, query head, Q tile at row m0) to the accumulator,
  // from warp-uniform values only. Each 16-row band is DQC / 8 consecutive fragments, in shared memory as in the
  // accumulator: one bulk reduction per band. The lanes' stores must reach the async proxy first.
  const int warp_u = __shfl_sync(0xffffffffu, (int)threadIdx.x / 32, 0);
  auto dq_bulk_reduce = [&](int n_block_, const SeqInfo& si_, int batch_, int hq_, int m0_) {
    float* dst = dq_accum_band<D, VARLEN>(p, n_block_, si_, batch_, hq_, m0_ + (warp_u / TD::WD_Q) * 16 * TD::MFQ, 0) +
                 dq_frag_offset<D>(0, (warp_u % TD::WD_Q) * TD::DQC);
    fence_proxy_async_shared();
    __syncwarp();
    if (threadIdx.x % 32 == 0) {
#pragma unroll
      for (int mf = 0; mf < TD::MFQ; ++mf)
        bulk_reduce_add_f32(dst + mf * 16 * D, smem_addr(dq_stage + (warp_u * TD::MFQ + mf) * 16 * TD::DQC),
                            (TD::DQC / 8) * 128 * (int)sizeof(float));
      bulk_commit_group();
    }
  };
  int dq_pending_hq = -1, dq_pending_m0 = 0;  // DQ_BULK: the Q tile whose staged dQ still has to be added

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const uint32_t smem_base = smem_addr(smem_raw);
  const int band0 = (warp / CB) * RBW, cband = warp % CB;  // dK/dV: first KV row band, column band
  // The block's sequence. Fixed lengths: the parameter block and the grid (x: KV tiles, y: KV heads, z: batch).
  // VARLEN (attn/seqlen.cuh): x over the KV tiles of every sequence ("loop": z over the sequences, as fixed); the
  // sequence's index, first KV tile, lengths and first rows are found once, kept in shared memory and read back
  // afresh where used (volatile loads), so that no register carries them across the loops (the fixed-length
  // kernels leave none to spare, and the packed ones run the same code).
  const int kv_head = blockIdx.y;
  const int group = (int)p.heads_per_kv;
  __shared__ int seq_smem[6];  // VARLEN: batch, first KV tile, seqlen_q, seqlen_k, q_start, k_start
  if constexpr (VARLEN) {
    if (threadIdx.x == 0) {
      int2 bt = make_int2((int)blockIdx.z, 0);
      if (p.dq_strategy != DQ_LOOP) bt = varlen_tile<BLOCK_N>(p.cu_seqlens_k, (int)p.batch, blockIdx.x);
      const SeqInfo s0 = seqinfo_varlen(p.cu_seqlens_q, p.cu_seqlens_k, bt.x);
      seq_smem[0] = bt.x;
      seq_smem[1] = bt.y;
      seq_smem[2] = s0.seqlen_q;
      seq_smem[3] = s0.seqlen_k;
      seq_smem[4] = s0.q_start;
      seq_smem[5] = s0.k_start;
    }
    __syncthreads();
  }
  const int batch_fixed = blockIdx.z;
  const SeqInfo si_fixed = seqinfo_fixed(p);
  auto cur_batch = [&]() -> int {
    if constexpr (VARLEN) return lds_fresh(seq_smem); else return batch_fixed;
  };
  auto cur_si = [&]() -> SeqInfo {
    if constexpr (VARLEN)
      return {lds_fresh(seq_smem + 2), lds_fresh(seq_smem + 3), lds_fresh(seq_smem + 4), lds_fresh(seq_smem + 5)};
    else
      return si_fixed;
  };
  // The KV head's mask (its band and soft-cap); the ALiBi slope is each query head's (mask() below).
  const Mask<CAUSAL, MOD> mask_kv_fixed = seqinfo_fixed(p).mask<CAUSAL, MOD>(p, blockIdx.z, kv_head * group);
  auto mask_kv = [&]() -> Mask<CAUSAL, MOD> {
    if constexpr (VARLEN) return cur_si().mask<CAUSAL, MOD>(p, cur_batch(), kv_head * group); else return mask_kv_fixed;
  };
  const int num_m_blocks_fixed = ((int)p.seqlen_q + BLOCK_M - 1) / BLOCK_M;
  auto num_m_blocks = [&]() {
    if constexpr (VARLEN) return (cur_si().seqlen_q + BLOCK_M - 1) / BLOCK_M; else return num_m_blocks_fixed;
  };
  // (common/ptx.cuh, held: configurations at 255 registers that spill 8-16 B with the constant-bank operand -- the
  // KV partition's score-modifier tile at head dim 128, fp16 (HOLD_FADD), and the 2D tile with the interleaved
  // exponentials and the early next-tile request, bf16 at head dim 128 (HOLD_UNIFORM))
  constexpr int HOLD = PARTITION == PART_KV && D == 128 && MOD == MOD_SCORE && !is_bf16_v<T> ? HOLD_FADD
                       : EXP_IL && LOAD_AT == 1                            ? HOLD_UNIFORM
                                                                           : HOLD_NONE;
  const float scale_log2 = held<HOLD>(p.scale_log2);
  const T* k_ptr_fixed = reinterpret_cast<const T*>(p.k) +
                         SeqInfo::offset(p.k_batch_stride, p.k_head_stride, blockIdx.z, kv_head);
  const T* v_ptr_fixed = reinterpret_cast<const T*>(p.v) +
                         SeqInfo::offset(p.v_batch_stride, p.v_head_stride, blockIdx.z, kv_head);
  auto k_ptr = [&]() {
    if constexpr (VARLEN)
      return reinterpret_cast<const T*>(p.k) +
             cur_si().k_offset(p.k_batch_stride, p.k_row_stride, p.k_head_stride, cur_batch(), kv_head);
    else
      return k_ptr_fixed;
  };
  auto v_ptr = [&]() {
    if constexpr (VARLEN)
      return reinterpret_cast<const T*>(p.v) +
             cur_si().k_offset(p.v_batch_stride, p.v_row_stride, p.v_head_stride, cur_batch(), kv_head);
    else
      return v_ptr_fixed;
  };
  // KV tiles [first, stop), step: fixed, one per block (gridDim.x) or all ("loop"); packed, the block's own one, or
  // all ("loop"). seqpar's buffers hold num_dq_splits KV tiles (packed: max_seqlen_k's): never write past them.
  const int num_n_blocks_fixed = ((int)p.seqlen_k + BLOCK_N - 1) / BLOCK_N;
  auto n_stop = [&]() {
    if constexpr (VARLEN) {
      const int n = (cur_si().seqlen_k + BLOCK_N - 1) / BLOCK_N;
      return p.dq_strategy == DQ_SEQPAR ? min(n, (int)p.num_dq_splits) : n;
    } else {
      return num_n_blocks_fixed;
    }
  };
  const int n_first = VARLEN ? lds_fresh(seq_smem + 1) : (int)blockIdx.x;
  const bool one_tile = VARLEN && p.dq_strategy != DQ_LOOP;

  // "loop": gridDim.x == 1 and this block walks every KV tile; otherwise one KV tile per block.
  for (int n_block = n_first; n_block < n_stop(); n_block += one_tile ? (1 << 30) : (int)gridDim.x) {
    const int n0 = n_block * BLOCK_N;
    // causal: Q tiles whose rows all lie above this KV tile's diagonal are skipped (attn/block.cuh)
    const int m_begin = q_block_begin<BLOCK_M>(mask_kv(), n0);
    const int num_m = max(0, q_block_end<BLOCK_M>(mask_kv(), n0 + BLOCK_N, num_m_blocks()) - m_begin);
    const int total = group * num_m;  // iterations: (query head of the group, Q tile)
    // Iteration it works on (query head within the group, Q tile) = (cur_h, cur_m), stepped without divisions.
    int cur_h = 0, cur_m = 0;
    auto step = [&](int& h, int& m) {  // the tile after (h, m) (past the last: the first again)
      if (++m == num_m) {
        m = 0;
        if (++h == group) h = 0;
      }
    };

    float acc_dk[RBW][DFO][4], acc_dv[RBW][DFO][4];
#pragma unroll
    for (int r = 0; r < RBW; ++r) {
      zero_frags(acc_dk[r]);
      zero_frags(acc_dv[r]);
    }

    if (total > 0) {
      // a head dim below D (common/tile.cuh): K and V zero-padded, Q and dO PAD_COPY (S = Q K^T and dP = dO V^T
      // are exact; the padding columns of dK, dV are not stored, dQ's are K's zeros)
      load_tile_async<BLOCK_N, D, NT, UA ? PAD_ELEM : PAD_ZERO>(k_smem, k_ptr(), p.k_row_stride, n0, cur_si().seqlen_k, tid,
                                                (int)p.head_dim);
      load_tile_async<BLOCK_N, D, NT, UA ? PAD_ELEM : PAD_ZERO>(v_smem, v_ptr(), p.v_row_stride, n0, cur_si().seqlen_k, tid,
                                                (int)p.head_dim);
      load_q_tile<T, D, BLOCK_M, NT, P2D, VARLEN, true, UA>(p, q_smem, do_smem, lse_smem, delta_smem, cur_si(), cur_batch(),
                                          kv_head * group + cur_h, (m_begin + cur_m) * BLOCK_M,
                                          tid);  // dO into stage 0 (DO_STAGES = 1: the only one)
      cp_async_commit();
    }
    for (int it = 0, stage = 0; it < total; ++it, stage ^= 1) {
      cp_async_wait<0>();  // iteration it's tiles (and K, V) have landed for this thread ...
      __syncthreads();     // ... for all threads (barrier 1 of 2); every warp is done with stage^1 and xc_smem
      const int hq = kv_head * group + cur_h, m0 = (m_begin + cur_m) * BLOCK_M;
      // this query head's mask (VARLEN: rebuilt where used, from the shared copies)
      const Mask<CAUSAL, MOD> mask_it = MOD == MOD_NONE || group == 1
                                            ? mask_kv()
                                            : mask_kv().with_alibi(SeqInfo::alibi_slope(p, cur_batch(), hq));
      auto mask = [&]() -> Mask<CAUSAL, MOD> {
        if constexpr (VARLEN)
          return MOD == MOD_NONE || group == 1 ? mask_kv()
                                               : mask_kv().with_alibi(SeqInfo::alibi_slope(p, cur_batch(), hq));
        else
          return mask_it;
      };
      step(cur_h, cur_m);  // (cur_h, cur_m) now name the next iteration's tile
      if constexpr (DQ_BULK) {  // the previous step's dQ tile, now that no cp.async of this thread is in flight
        if (dq_pending_hq >= 0) dq_bulk_reduce(n_block, cur_si(), cur_batch(), dq_pending_hq, dq_pending_m0);
        dq_pending_hq = -1;
      }
      // the next iteration's Q, dO, lse and D rows into the other stage (every warp is done with it)
      auto request_next = [&]() {
        if (it + 1 < total) {
          const int nst = stage ^ 1;
          const int hq_next = kv_head * group + cur_h, m0_next = (m_begin + cur_m) * BLOCK_M;
          load_q_tile<T, D, BLOCK_M, NT, P2D, VARLEN, DO_STAGES == 2, UA>(p, q_smem + nst * BLOCK_M * LDS,
                                                              do_smem + nst * BLOCK_M * LDS, lse_smem + nst * BLOCK_M,
                                                              delta_smem + nst * BLOCK_M, cur_si(),
                                                              cur_batch(), hq_next, m0_next, tid);
          cp_async_commit();
        }
      };
      if constexpr (LOAD_AT == 0) request_next();
      const T* q_tile = q_smem + stage * BLOCK_M * LDS;    // [BLOCK_M][LDS]
      const T* do_tile = do_smem + (DO_STAGES == 2 ? stage : 0) * BLOCK_M * LDS;  // [BLOCK_M][LDS]
      const float* lse_tile = lse_smem + stage * BLOCK_M;
      const float* delta_tile = delta_smem + stage * BLOCK_M;

      if constexpr (PARTITION == PART_KV) {
        // ---------------------------------------------------------------- KV partition: 16 KV rows / warp
        constexpr int NFQ = BLOCK_M / 8;  // n8 fragments of S^T along the Q rows
        const int wk = band0, wd = cband;
        T* ds_smem = xc_smem;  // [BLOCK_N][LDS_DS]  dS^T of the current Q tile
        // (1) S^T = K_w Q^T [16, BLOCK_M]: A = this warp's 16 K rows, B = Q^T = rows of Q (plain ldmatrix).
        float acc[NFQ][4];
        zero_frags(acc);
        gemm_rows_rows_t<T, KD, NFQ, U_D>(acc, k_smem + wk * 16 * LDS, q_tile, LDS, lane);
        // (2) P^T = exp2(S^T * scale_log2 - lse_log2[q]), masked only on tiles that cross the end of the
        // keys or the diagonal; kept as 16-bit A fragments (the operand of dV += P^T dO).
        const bool need_mask = mask().needs_mask(m0, m0 + BLOCK_M - 1, n0, n0 + BLOCK_N - 1);
        if constexpr (MOD != MOD_NONE) {
          if (need_mask) mask().apply_t(acc, n0 + wk * 16, m0, lane);
        }
        uint32_t pa[KQ][4];
#pragma unroll
        for (int nf = 0; nf < NFQ; ++nf) {
          const float2 lse = *reinterpret_cast<const float2*>(lse_tile + nf * 8 + 2 * t);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float x = acc[nf][e];
            if (MOD == MOD_NONE && need_mask) x = mask().score_t(x, n0 + wk * 16, m0, nf, e, lane);
            acc[nf][e] = softmax_p_from_lse(x, scale_log2, e % 2 ? lse.y : lse.x);
          }
        }
        if constexpr (DROP) Dropout(p, (int64_t)cur_batch() * p.nheads + hq).apply_t<true>(acc, n0 + wk * 16, m0, lane);
        frags_to_a<T>(acc, pa);
        // (3) dV += P^T dO: B = dO [Q rows, D] via ldmatrix.trans; this warp's DOUT columns.
        if constexpr (DROP) {  // the kept probabilities: max(P, 0) of the sign-marked P
          uint32_t pr[KQ][4];
#pragma unroll
          for (int k = 0; k < KQ; ++k)
#pragma unroll
            for (int e = 0; e < 4; ++e) pr[k][e] = relu2<T>(pa[k][e]);
          gemm_a_regs_b_trans<T, KQ, DFO>(acc_dv[0], pr, do_tile, LDS, wd * DCOLS, lane);
        } else {
          gemm_a_regs_b_trans<T, KQ, DFO>(acc_dv[0], pa, do_tile, LDS, wd * DCOLS, lane);
        }
        // (4) dP^T = V_w dO^T [16, BLOCK_M], like (1).
        zero_frags(acc);
        gemm_rows_rows_t<T, KD, NFQ, U_D>(acc, v_smem + wk * 16 * LDS, do_tile, LDS, lane);
        // (5) dS^T = P^T * (dP^T - D[q]) (P from its 16-bit copy: the same values dV used).
#pragma unroll
        for (int nf = 0; nf < NFQ; ++nf) {
          const float2 dl = *reinterpret_cast<const float2*>(delta_tile + nf * 8 + 2 * t);
          const float2 p01 = unpack2<T>(pa[nf / 2][(nf % 2) * 2]), p23 = unpack2<T>(pa[nf / 2][(nf % 2) * 2 + 1]);
          acc[nf][0] = ds_of(p01.x, acc[nf][0], dl.x);
          acc[nf][1] = ds_of(p01.y, acc[nf][1], dl.y);
          acc[nf][2] = ds_of(p23.x, acc[nf][2], dl.x);
          acc[nf][3] = ds_of(p23.y, acc[nf][3], dl.y);
        }
        if constexpr (MOD != MOD_NONE) {  // the soft-cap's derivative (attn/mask().cuh: softcap_grad)
          if (mask().softcap()) {  // element e of block nf: row m0 + 8 nf + 2t + e % 2, key n0 + 16 wk + g + 8 (e / 2)
            const float dist0 = mask().dist_of(m0 + 2 * t, n0 + wk * 16 + g);
#pragma unroll
            for (int nf = 0; nf < NFQ; ++nf) {
              const float2 lse = *reinterpret_cast<const float2*>(lse_tile + nf * 8 + 2 * t);
              const float2 p01 = unpack2<T>(pa[nf / 2][(nf % 2) * 2]), p23 = unpack2<T>(pa[nf / 2][(nf % 2) * 2 + 1]);
              const float pv[4] = {abs_if<DROP>(p01.x), abs_if<DROP>(p01.y), abs_if<DROP>(p23.x), abs_if<DROP>(p23.y)};
#pragma unroll
              for (int e = 0; e < 4; ++e)
                acc[nf][e] *= mask().softcap_grad(pv[e], e % 2 ? lse.y : lse.x,
                                                dist0 + (float)(nf * 8 + (e % 2) - 8 * (e / 2)), scale_log2);
            }
          }
        }
        uint32_t dsa[KQ][4];
        frags_to_a<T>(acc, dsa);
        if (wd == 0) store_a_frags(ds_smem, LDS_DS, wk * 16, dsa, lane);  // both warps of a DSPLIT pair hold it
        // (6) dK += dS^T Q: B = Q [Q rows, D] via ldmatrix.trans.
        gemm_a_regs_b_trans<T, KQ, DFO>(acc_dk[0], dsa, q_tile, LDS, wd * DCOLS, lane);
        __syncthreads();  // barrier 2 of 2: dS^T of every warp is in smem

        // dQ_i [BLOCK_M, D] += dS K: warps re-partition as 16-row bands x DQ_COLS columns.
        // A = dS (rows = Q) from dS^T in smem via ldmatrix.trans; B = K [KV, D] via ldmatrix.trans.
        const int dq_rb = warp % DQ_ROW_BANDS, dq_cb = warp / DQ_ROW_BANDS;
        float acc_dq[DQF][4];
        zero_frags(acc_dq);
        gemm_smem_at_b<T, KN, DQF, U_N>(acc_dq, ds_smem, LDS_DS, dq_rb * 16, k_smem, LDS, dq_cb * DQ_COLS, lane);
        dq_accumulate<D>(p, dq_accum_band<D, VARLEN>(p, n_block, cur_si(), cur_batch(), hq, m0 + dq_rb * 16, lane) +
                                dq_frag_offset<D>(0, dq_cb * DQ_COLS),
                         acc_dq);
      } else if constexpr (QPART) {
        // ----------------------------------------------------------------- Q partition: 16 Q rows / warp
        constexpr int NFK = BLOCK_N / 8;  // n8 fragments of S along the KV rows
        T* p_smem = xc_smem;                         // [BLOCK_M][LDS_PS]  P of the current Q tile
        T* ds_smem = xc_smem + BLOCK_M * LDS_PS;     // [BLOCK_M][LDS_PS]  dS
        const int r0 = warp * 16;                    // this warp's rows in the Q tile
        // Warp-uniform: do any of the warp's rows lie before seqlen_q and see a key of this KV tile?
        const bool active = m0 + r0 < cur_si().seqlen_q && !mask().above_diagonal(m0 + r0 + 15, n0);
        if (active) {
          // (1) S = Q_w K^T [16, BLOCK_N]: A = this warp's 16 Q rows, B = K^T = rows of K (plain ldmatrix).
          float acc[NFK][4];
          zero_frags(acc);
          gemm_rows_rows_t<T, KD, NFK, U_D>(acc, q_tile + r0 * LDS, k_smem, LDS, lane);
          // (2) P = exp2(S * scale_log2 - lse_log2[row]); rows g and g + 8 of the warp's band.
          const bool need_mask = mask().needs_mask(m0 + r0, m0 + r0 + 15, n0, n0 + BLOCK_N - 1);
          if constexpr (MOD != MOD_NONE) {
            if (need_mask) mask().apply(reinterpret_cast<float(&)[1][NFK][4]>(acc), m0 + r0, n0, lane);
          }
          const float lse_g = lse_tile[r0 + g], lse_g8 = lse_tile[r0 + g + 8];
#pragma unroll
          for (int nf = 0; nf < NFK; ++nf)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              float x = acc[nf][e];
              if (MOD == MOD_NONE && need_mask) x = mask().score_c(x, m0 + r0, n0, nf, e, lane);
              acc[nf][e] = softmax_p_from_lse(x, scale_log2, e / 2 ? lse_g8 : lse_g);
            }
          if constexpr (DROP)
            Dropout(p, (int64_t)cur_batch() * p.nheads + hq)
                .apply<true>(reinterpret_cast<float(&)[1][NFK][4]>(acc), m0 + r0, n0, lane);
          {
            uint32_t pa[KN][4];
            frags_to_a<T>(acc, pa);
            store_a_frags(p_smem, LDS_PS, r0, pa, lane);
          }
          // (3) dP = dO_w V^T [16, BLOCK_N], like (1).
          zero_frags(acc);
          gemm_rows_rows_t<T, KD, NFK, U_D>(acc, do_tile + r0 * LDS, v_smem, LDS, lane);
          // (4) dS = P * (dP - D[row]), P from its 16-bit copy (the same values dV uses), read back from the
          // words this thread stored (cheaper in registers than keeping P across (3)).
          const float dl_g = delta_tile[r0 + g], dl_g8 = delta_tile[r0 + g + 8];
          uint32_t* p_g = reinterpret_cast<uint32_t*>(p_smem + (r0 + g) * LDS_PS + 2 * t);
          uint32_t* p_g8 = reinterpret_cast<uint32_t*>(p_smem + (r0 + g + 8) * LDS_PS + 2 * t);
#pragma unroll
          for (int nf = 0; nf < NFK; ++nf) {
            const float2 p01 = unpack2<T>(p_g[nf * 4]), p23 = unpack2<T>(p_g8[nf * 4]);  // +8 columns = +4 words
            acc[nf][0] = ds_of(p01.x, acc[nf][0], dl_g);
            acc[nf][1] = ds_of(p01.y, acc[nf][1], dl_g);
            acc[nf][2] = ds_of(p23.x, acc[nf][2], dl_g8);
            acc[nf][3] = ds_of(p23.y, acc[nf][3], dl_g8);
          }
          if constexpr (MOD != MOD_NONE) {  // the soft-cap's derivative (attn/mask().cuh: softcap_grad)
            if (mask().softcap()) {  // element e of block nf: row m0 + r0 + g + 8 (e / 2), key n0 + 8 nf + 2t + e % 2
              const float dist0 = mask().dist_of(m0 + r0 + g, n0 + 2 * t);
#pragma unroll
              for (int nf = 0; nf < NFK; ++nf) {
                const float2 p01 = unpack2<T>(p_g[nf * 4]), p23 = unpack2<T>(p_g8[nf * 4]);
                const float pv[4] = {abs_if<DROP>(p01.x), abs_if<DROP>(p01.y), abs_if<DROP>(p23.x), abs_if<DROP>(p23.y)};
#pragma unroll
                for (int e = 0; e < 4; ++e)
                  acc[nf][e] *= mask().softcap_grad(pv[e], e / 2 ? lse_g8 : lse_g,
                                                  dist0 + (float)(8 * (e / 2) - nf * 8 - (e % 2)), scale_log2);
              }
            }
          }
          if constexpr (DROP) {  // dV's P: the kept probabilities (max(P, 0)), over this thread's own words
#pragma unroll
            for (int nf = 0; nf < NFK; ++nf) {
              p_g[nf * 4] = relu2<T>(p_g[nf * 4]);
              p_g8[nf * 4] = relu2<T>(p_g8[nf * 4]);
            }
          }
          uint32_t dsa[KN][4];
          frags_to_a<T>(acc, dsa);
          store_a_frags(ds_smem, LDS_PS, r0, dsa, lane);
          // (5) dQ_w += dS K_j: warp-local (A = dS in registers, B = K [KV, D] via ldmatrix.trans), written
          // out DQ_CHUNK columns at a time straight from the accumulator fragments.
          float* dq_band = dq_accum_band<D, VARLEN>(p, n_block, cur_si(), cur_batch(), hq, m0 + r0, lane);
#pragma unroll
          for (int c0 = 0; c0 < D; c0 += DQ_CHUNK) {
            float acc_dq[DQ_CHUNK / 8][4];
            zero_frags(acc_dq);
            gemm_a_regs_b_trans<T, KN, DQ_CHUNK / 8>(acc_dq, dsa, k_smem, LDS, c0, lane);
            dq_accumulate<D>(p, dq_band + dq_frag_offset<D>(0, c0), acc_dq);
          }
        } else {  // P = dS = 0 for all 16 rows: write the zeros the dK/dV phase reads
          constexpr int CHUNKS = 16 * BLOCK_N / 8;  // 16-byte chunks per 16-row band
#pragma unroll
          for (int c = lane; c < CHUNKS; c += 32) {
            const int off = (r0 + c / (BLOCK_N / 8)) * LDS_PS + (c % (BLOCK_N / 8)) * 8;
            *reinterpret_cast<uint4*>(p_smem + off) = make_uint4(0u, 0u, 0u, 0u);
            *reinterpret_cast<uint4*>(ds_smem + off) = make_uint4(0u, 0u, 0u, 0u);
          }
        }
        __syncthreads();  // barrier 2 of 2: P and dS of every warp are in smem

        // (6) dV_j += P^T dO_i and (7) dK_j += dS^T Q_i: warps re-partition by KV rows x D columns.
        // A = P^T / dS^T [16 KV rows, BLOCK_M] from P / dS via ldmatrix.trans; B = dO / Q via ldmatrix.trans.
#pragma unroll
        for (int r = 0; r < RBW; ++r) {
          const int kv_row0 = (band0 + r) * 16;
          gemm_smem_at_b<T, KQ, DFO, U_M>(acc_dv[r], p_smem, LDS_PS, kv_row0, do_tile, LDS, cband * DCOLS, lane);
          gemm_smem_at_b<T, KQ, DFO, U_M>(acc_dk[r], ds_smem, LDS_PS, kv_row0, q_tile, LDS, cband * DCOLS, lane);
        }
      } else {
        // ------------------------------------------------- 2D partition: 32-row warp tiles in every product
        // S, dP [BLOCK_M, BLOCK_N]: WM_S x WN_S warps of 32 Q rows x KW keys.
        constexpr int WM_S = TD::WM_S, WN_S = TD::WN_S, KW = TD::KW, NFS = TD::NFS;  // Tiling2D
        constexpr int WD_Q = TD::WD_Q, MFQ = TD::MFQ, DQC = TD::DQC, DQ_CH = TD::DQ_CH;
        static_assert(WM_S == BLOCK_M / 32, "2D: 32-row S tiles");
        static_assert(WM_S * WN_S == NWARPS && KW % 16 == 0, "2D: S / dP warp tiles");
        static_assert(TD::WM_Q * WD_Q == NWARPS && DQC % 16 == 0 && DQC % DQ_CH == 0, "2D: dQ warp tiles");
        T* p_smem = xc_smem;                      // [BLOCK_M][LDS_PS]  P of the current Q tile
        T* ds_smem = xc_smem + BLOCK_M * LDS_PS;  // [BLOCK_M][LDS_PS]  dS
        // Shared addresses of the tiles (bytes): the kernel's smem base + compile-time offsets (+ the stage).
        const uint32_t k_addr = smem_base, v_addr = smem_base + 2 * BLOCK_N * LDS;
        const uint32_t q_addr = smem_base + 2 * (2 * BLOCK_N + stage * BLOCK_M) * LDS;
        const uint32_t do_addr = smem_base + 2 * (2 * BLOCK_N + 2 * BLOCK_M + (DO_STAGES == 2 ? stage : 0) * BLOCK_M) * LDS;
        const uint32_t p_addr = smem_base + 2 * (2 * BLOCK_N + (2 + DO_STAGES) * BLOCK_M) * LDS;
        const uint32_t ds_addr = p_addr + 2 * BLOCK_M * LDS_PS;
        const int qr0 = (warp / WN_S) * 32, kc0 = (warp % WN_S) * KW;  // this warp's S block
        // (1) S = Q K^T for Q rows [qr0, +32) x keys [kc0, +KW).
        float acc[2][NFS][4];
#pragma unroll
        for (int mf = 0; mf < 2; ++mf) zero_frags(acc[mf]);
        gemm_smem<T, 2, NFS, KD, false, false, LDS, LDS, U_D>(acc, q_addr + 2 * qr0 * LDS + lane_off_a<false, LDS>(lane),
                                                             k_addr + 2 * kc0 * LDS + lane_off_b<false, LDS>(lane));
        if constexpr (LOAD_AT == 1) request_next();
        // (2) P = exp2(S * scale_log2 - lse_log2[row]) -> 16-bit, into smem (for dV, and for dS below).
        // In warp-tile-local indices (row r, key c; attn/mask().cuh: Mask::local), as a separate pass, so that
        // unmasked tiles run none of it.
        const Mask<CAUSAL, MOD> wmask = mask().local(m0 + qr0, n0 + kc0);
        if (wmask.needs_mask(0, 31, 0, KW - 1)) wmask.apply(acc, 0, 0, lane);
        uint32_t pa[2][NFS / 2][4];  // P, packed (P_REGS: kept for dS; else only live per mf)
        if constexpr (EXP_IL) {
          // (2) + (3) interleaved: dP = dO V^T one k16 step at a time into acc_p; after step ks, the exps of
          // the S fragments [ks FPS, +FPS) (fragment f = (mf, nf) = (f / NFS, f % NFS)); each 16-row band's
          // P is packed and stored once its last fragment is done.
          constexpr int FPS = 2 * NFS / KD;  // S fragments per k16 step of dP
          static_assert(FPS >= 1 && FPS * KD == 2 * NFS && NFS % FPS == 0, "EXP_IL: fragments per k16 step");
          float acc_p[2][NFS][4];
#pragma unroll
          for (int mf = 0; mf < 2; ++mf) zero_frags(acc_p[mf]);
          const uint32_t a_do = do_addr + 2 * qr0 * LDS + lane_off_a<false, LDS>(lane);
          const uint32_t b_v = v_addr + 2 * kc0 * LDS + lane_off_b<false, LDS>(lane);
#pragma unroll
          for (int ks = 0; ks < KD; ++ks) {
            gemm_smem<T, 2, NFS, 1, false, false, LDS, LDS, 1>(acc_p, a_do + 2 * 16 * ks, b_v + 2 * 16 * ks);
#pragma unroll
            for (int f = ks * FPS; f < (ks + 1) * FPS; ++f) {
              const int mf = f / NFS, nf = f % NFS;
#pragma unroll
              for (int e = 0; e < 4; ++e)  // lse read where used (held in 4 registers, bf16 spilled under NVRTC 13.5)
                acc[mf][nf][e] = softmax_p_from_lse(acc[mf][nf][e], scale_log2, lse_tile[qr0 + mf * 16 + g + (e / 2) * 8]);
              if (nf % 2 == 1) {  // k16 step nf / 2 of this band's A fragments
                if constexpr (DROP)
                  Dropout(p, (int64_t)cur_batch() * p.nheads + hq)
                      .pair<true>(acc[mf][nf - 1], acc[mf][nf], m0 + qr0 + mf * 16, n0 + kc0 + 16 * (nf / 2), g, t);
                frag_to_a<T>(acc[mf], nf / 2, pa[mf][nf / 2]);
              }
            }
#pragma unroll
            for (int mf = 0; mf < 2; ++mf)
              if ((ks + 1) * FPS == (mf + 1) * NFS) store_a_frags(p_smem + kc0, LDS_PS, qr0 + mf * 16, pa[mf], lane);
          }
#pragma unroll
          for (int mf = 0; mf < 2; ++mf)
#pragma unroll
            for (int nf = 0; nf < NFS; ++nf)
#pragma unroll
              for (int e = 0; e < 4; ++e) acc[mf][nf][e] = acc_p[mf][nf][e];
          if constexpr (LOAD_AT == 2) request_next();  // P is stored and dP done
        } else {
#pragma unroll
          for (int mf = 0; mf < 2; ++mf) {
            const float lse_g = lse_tile[qr0 + mf * 16 + g], lse_g8 = lse_tile[qr0 + mf * 16 + g + 8];
#pragma unroll
            for (int nf = 0; nf < NFS; ++nf)
#pragma unroll
              for (int e = 0; e < 4; ++e)
                acc[mf][nf][e] = softmax_p_from_lse(acc[mf][nf][e], scale_log2, e / 2 ? lse_g8 : lse_g);
            if constexpr (DROP)
              Dropout(p, (int64_t)cur_batch() * p.nheads + hq)
                  .apply<true>(reinterpret_cast<float(&)[1][NFS][4]>(acc[mf]), m0 + qr0 + mf * 16, n0 + kc0, lane);
            frags_to_a<T>(acc[mf], pa[mf]);
            store_a_frags(p_smem + kc0, LDS_PS, qr0 + mf * 16, pa[mf], lane);
          }
          if constexpr (LOAD_AT == 2) request_next();
          // (3) dP = dO V^T, same block.
#pragma unroll
          for (int mf = 0; mf < 2; ++mf) zero_frags(acc[mf]);
          gemm_smem<T, 2, NFS, KD, false, false, LDS, LDS, U_D>(acc, do_addr + 2 * qr0 * LDS + lane_off_a<false, LDS>(lane),
                                                               v_addr + 2 * kc0 * LDS + lane_off_b<false, LDS>(lane));
        }
        // (4) dS = P * (dP - D[row]) -> smem. P from its 16-bit copy (the values dV uses): kept in registers
        // across (3) (P_REGS), or read back from the words this thread stored.
#pragma unroll
        for (int mf = 0; mf < 2; ++mf) {
          const float dl_g = delta_tile[qr0 + mf * 16 + g], dl_g8 = delta_tile[qr0 + mf * 16 + g + 8];
          uint32_t* p_g = reinterpret_cast<uint32_t*>(p_smem + (qr0 + mf * 16 + g) * LDS_PS + kc0 + 2 * t);
          uint32_t* p_g8 = p_g + 8 * LDS_PS / 2;  // row g + 8
#pragma unroll
          for (int nf = 0; nf < NFS; ++nf) {
            // the A fragment of k16 step nf / 2 holds (row g, row g + 8) of n8 block nf in words 2 (nf % 2) + (0, 1)
            const float2 p01 = unpack2<T>(P_REGS ? pa[mf][nf / 2][2 * (nf % 2)] : p_g[nf * 4]);  // +8 columns = +4 words
            const float2 p23 = unpack2<T>(P_REGS ? pa[mf][nf / 2][2 * (nf % 2) + 1] : p_g8[nf * 4]);
            acc[mf][nf][0] = ds_of(p01.x, acc[mf][nf][0], dl_g);
            acc[mf][nf][1] = ds_of(p01.y, acc[mf][nf][1], dl_g);
            acc[mf][nf][2] = ds_of(p23.x, acc[mf][nf][2], dl_g8);
            acc[mf][nf][3] = ds_of(p23.y, acc[mf][nf][3], dl_g8);
          }
          if constexpr (MOD != MOD_NONE) {  // the soft-cap's derivative (attn/mask().cuh: softcap_grad), tile-local
            if (wmask.softcap()) {
              const float lse_g = lse_tile[qr0 + mf * 16 + g], lse_g8 = lse_tile[qr0 + mf * 16 + g + 8];
              const float dist0 = wmask.dist_of(g, 2 * t);
#pragma unroll
              for (int nf = 0; nf < NFS; ++nf) {
                const float2 p01 = unpack2<T>(P_REGS ? pa[mf][nf / 2][2 * (nf % 2)] : p_g[nf * 4]);
                const float2 p23 = unpack2<T>(P_REGS ? pa[mf][nf / 2][2 * (nf % 2) + 1] : p_g8[nf * 4]);
                const float pv[4] = {abs_if<DROP>(p01.x), abs_if<DROP>(p01.y), abs_if<DROP>(p23.x), abs_if<DROP>(p23.y)};
#pragma unroll
                for (int e = 0; e < 4; ++e)  // tile-local row mf 16 + g + 8 (e / 2), key 8 nf + 2t + e % 2
                  acc[mf][nf][e] *= wmask.softcap_grad(pv[e], e / 2 ? lse_g8 : lse_g,
                                                       dist0 + (float)(mf * 16 + 8 * (e / 2) - nf * 8 - (e % 2)),
                                                       scale_log2);
              }
            }
          }
          if constexpr (DROP) {  // dV's P: the kept probabilities (max(P, 0)), over this thread's own words
#pragma unroll
            for (int nf = 0; nf < NFS; ++nf) {
              p_g[nf * 4] = relu2<T>(P_REGS ? pa[mf][nf / 2][2 * (nf % 2)] : p_g[nf * 4]);
              p_g8[nf * 4] = relu2<T>(P_REGS ? pa[mf][nf / 2][2 * (nf % 2) + 1] : p_g8[nf * 4]);
            }
          }
          uint32_t dsa[NFS / 2][4];
          frags_to_a<T>(acc[mf], dsa);
          store_a_frags(ds_smem + kc0, LDS_PS, qr0 + mf * 16, dsa, lane);
        }
        __syncthreads();  // barrier 2: P and dS of every warp are in smem

        // (5) dQ_i += dS K_j first, so that its atomics drain under the dV and dK products instead of queueing
        // in front of the next tile's loads: rows [dq_r0, +16 MFQ) x columns [dq_c0, +DQC); A = dS (plain
        // ldmatrix), B = K via ldmatrix.trans.
        const int dq_r0 = (warp / WD_Q) * 16 * MFQ, dq_c0 = (warp % WD_Q) * DQC;
        float* dq_band = dq_accum_band<D, VARLEN>(p, n_block, cur_si(), cur_batch(), hq, m0 + dq_r0, opaque(lane));
        if (dq_bulk) {  // the previous tile's reductions have read the staging
          if (lane == 0) bulk_wait_group_read<0>();
          __syncwarp();
        }
#pragma unroll
        for (int c0 = 0; c0 < DQC; c0 += DQ_CH) {
          float acc_dq[MFQ][DQ_CH / 8][4];
#pragma unroll
          for (int mf = 0; mf < MFQ; ++mf) zero_frags(acc_dq[mf]);
          gemm_smem<T, MFQ, DQ_CH / 8, KN, false, true, LDS_PS, LDS, U_N>(
              acc_dq, ds_addr + 2 * dq_r0 * LDS_PS + lane_off_a<false, LDS_PS>(lane),
              k_addr + 2 * (dq_c0 + c0) + lane_off_b<true, LDS>(lane));
          if (dq_bulk) {  // this lane's slots of the staged tile [mf][column block] (dq_bulk_reduce reads it)
            float* st = dq_stage + warp * (16 * MFQ * DQC) + 4 * lane;
#pragma unroll
            for (int mf = 0; mf < MFQ; ++mf)
#pragma unroll
              for (int df = 0; df < DQ_CH / 8; ++df)
                *reinterpret_cast<float4*>(st + (mf * (DQC / 8) + c0 / 8 + df) * 128) =
                    make_float4(acc_dq[mf][df][0], acc_dq[mf][df][1], acc_dq[mf][df][2], acc_dq[mf][df][3]);
          } else {
#pragma unroll
            for (int mf = 0; mf < MFQ; ++mf)
              dq_accumulate<D>(p, dq_band + dq_frag_offset<D>(mf, dq_c0 + c0), acc_dq[mf]);
          }
        }
        if (dq_bulk) {  // reduced at the top of the next step (DQ_BULK above)
          dq_pending_hq = hq;
          dq_pending_m0 = m0;
        }
        // (6) dV_j += P^T dO_i: this warp's 32 KV rows [band0 * 16, +32) x DCOLS columns; A = P^T via
        // ldmatrix.trans of P, B = dO via ldmatrix.trans.
        gemm_smem<T, 2, DFO, KQ, true, true, LDS_PS, LDS, U_M>(
            acc_dv, p_addr + 2 * band0 * 16 + lane_off_a<true, LDS_PS>(lane),
            do_addr + 2 * cband * DCOLS + lane_off_b<true, LDS>(lane));
        if constexpr (DO_STAGES == 1) {
          __syncthreads();  // barrier 3: every warp is done with dO (dP, dV): bring in the next dO tile
          if (it + 1 < total) {
            load_do_tile<T, D, BLOCK_M, NT, true, UA>(p, do_smem, cur_si(), cur_batch(), kv_head * group + cur_h,
                                                  (m_begin + cur_m) * BLOCK_M, tid);
            cp_async_commit();
          }
        }
        // (7) dK_j += dS^T Q_i, like (6).
        gemm_smem<T, 2, DFO, KQ, true, true, LDS_PS, LDS, U_M>(
            acc_dk, ds_addr + 2 * band0 * 16 + lane_off_a<true, LDS_PS>(lane),
            q_addr + 2 * cband * DCOLS + lane_off_b<true, LDS>(lane));
      }
    }

    if constexpr (DQ_BULK) {  // the last Q tile's dQ
      if (dq_pending_hq >= 0) dq_bulk_reduce(n_block, cur_si(), cur_batch(), dq_pending_hq, dq_pending_m0);
      dq_pending_hq = -1;
    }
    // dK = softmax_scale * acc_dk, dV = acc_dv (/ (1 - p) with dropout): this warp's KV row bands x DCOLS
    // columns, written once.
    if constexpr (DROP) scale_frags(acc_dv, (float)p.dropout_scale);
#pragma unroll
    for (int r = 0; r < RBW; ++r)
      store_dkdv<T, DFO, UA>(p, cur_si(), cur_batch(), kv_head, opaque(n_block) * BLOCK_N + (band0 + r) * 16, cband * DCOLS,
                         acc_dk[r], acc_dv[r], lane);
    __syncthreads();  // "loop": every warp is done with K, V and the exchange buffers before the next KV tile
  }
  if constexpr (DQ_BULK) {  // the last reductions must have read the staging before the block's smem goes away
    if (lane == 0) bulk_wait_group_read<0>();
  }
}

}  // namespace cuflash
