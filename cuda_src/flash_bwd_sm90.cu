// cuda_src/flash_bwd_sm90.cu -- the Hopper backward (sm_90a): warp-specialized, TMA-fed, wgmma FlashAttention-2
// backward. The preprocess (D = rowsum(dO * O), lse_log2) and the dQ convert are flash_bwd.cu's kernels: this
// kernel reads and writes the same fp32 row buffers (attn/bwd.cuh).
//
// One thread block per (KV tile of BLOCK_N = 128 keys, KV head, batch), 3 warpgroups of 128 threads:
//
//   warpgroup 0, the producer (setmaxnreg.dec to REGS_LOAD; one thread issues everything -- with BLOCK_M = 80 warp 0
//     walks the iterations and its lane 0 issues, Sm90BwdLayout::WARP_LOADS): K_j and V_j -> smem by
//     TMA, once; then for each (query head of the KV head's group, Q tile of BLOCK_M rows that sees this KV tile):
//     wait until stage s is free (empty), then Q_i, dO_i by TMA and the tile's lse_log2 and D rows by bulk copy,
//     all completing on full[s].
//   warpgroups 1, 2, the consumers (setmaxnreg.inc to REGS_MMA), 64 keys of the KV tile each:
//     S^T  = K_w Q_i^T          wgmma, both operands in smem (K-major)                    [64 keys, BLOCK_M] fp32
//     dP^T = V_w dO_i^T         wgmma, the same                                            (issued with S^T)
//     P^T  = exp2(S^T scale_log2 - lse_log2)    from the forward's LSE (no max, no sum; masked only on the tiles
//                                               where attn/mask.cuh hides an element), 16-bit A fragments
//     dV_w += P^T dO_i          wgmma, P^T from registers, dO_i MN-major from smem        [64 keys, D]
//     dS^T = P^T (dP^T - D)     16-bit A fragments, and stored to smem (dS^T, double-buffered)
//     dK_w += dS^T Q_i          wgmma, dS^T from registers, Q_i MN-major from smem
//     dQ_i  = dS K_j            after a barrier of both consumers (dS^T of all 128 keys in smem): wgmma with both
//                               operands MN-major (dS^T read transposed, K_j): each consumer takes 64 of the Q rows
//                               (BLOCK_M = 128) or 64 of the columns (BLOCK_M = 64) of the [BLOCK_M, D] tile
//     then the consumers stage dQ_i in smem in the accumulator's own layout (fragment-tiled: attn/bwd.cuh), once the
//     writer has read the previous tile (dq_empty), and signal dq_full.
//   warp 1 of warpgroup 0, the dQ writer (one lane): hands each staged tile to the TMA unit as one bulk operation --
//     cp.reduce.async.bulk add.f32 into the accumulator ("atomic"); the same after the KV tiles before this one
//     have added theirs, in a fixed KV-tile order through a semaphore per Q tile ("ordered": deterministic,
//     bitwise reproducible, no extra memory; which order: ORDER below); or a bulk store into the KV tile's own
//     buffer ("seqpar") -- so that no consumer waits for a reduction.
//   and at the end dK = softmax_scale dK_w, dV_w -> global (16-bit), rows past seqlen_k not stored: above head dim
//   64, one block per tile stages them in K's and V's tiles and stores them by TMA (sm90_bwd_store_dkdv_tma).
//
// Shared memory (cuda_src/common/sm90.cuh for the swizzled tile layout; DP = D rounded up to 64, the columns past D
// zero-filled by TMA): K, V [128, DP]; STAGES x Q, dO [BLOCK_M, DP]; 2 x dS^T [128 keys, BLOCK_M] (64-query chunks);
// the dQ staging [BLOCK_M, D] fp32; STAGES x (lse_log2, D) [BLOCK_M]; the mbarriers.
//
// Rows past seqlen_q read as zeros (TMA) with lse_log2 = +inf and D = 0 (the preprocess), so their P and dS are 0;
// keys past seqlen_k are masked on the last KV tile. Rows that saw no key have lse_log2 = +inf too (P = 0).
//
// Template parameters (cuflash/_configs.py: SM90_BWD_TILES, the source of truth):
//   T             __half or __nv_bfloat16;   D  the kernel head dim (the accumulator's row length; DP in smem)
//   BLOCK_M       Q rows per tile: 128 for DP = 64, 64 for DP = 128 (the accumulators: 2 x 64 x DP fp32 of dK, dV
//                 per consumer warpgroup, and the transposed score tiles 2 x 64 x BLOCK_M), or 80 for DP = 128
//                 without a mask (dQ computed transposed; one block per tile or PERSIST, on the lean walk)
//   STAGES        Q / dO stages;  CAUSAL  bottom-right causal;  REGS_MMA, REGS_LOAD  setmaxnreg counts
//   SMEM_BYTES    dynamic shared memory the host reserves;  MOD  MOD_SCORE: window, soft-cap, ALiBi (attn/mask.cuh)
//   ORDER         the visiting order (attn/bwd.cuh: DqOrder): DQ_ORDER_PLAIN, or for "ordered" with the causal mask
//                 DQ_ORDER_KV_DESC (the host's choice) or DQ_ORDER_Q_DESC, without a mask DQ_ORDER_ROT (the host's
//                 choice while a head's KV tiles fit the GPU at once); those kernels run "ordered" only; or with
//                 the causal mask DQ_ORDER_HEADS_INNER (Q tiles last first, the group's query heads inner: the blocks
//                 of a KV head read each Q and dO tile together; GQA) for "atomic", "seqpar" and "ordered" (KV
//                 tiles ascending at each Q tile)
//   GROUP         the blocks' dispatch order (sm90_bwd_block): 0, the launch's; > 0, the causal kernels of "atomic"
//                 and "seqpar" with the longest KV tiles first within groups of GROUP (KV head, batch) pairs
//   CAP_ONLY      a form of the modifier kernel (MOD_SCORE; one block per tile or PERSIST): on the tiles where
//                 the soft-cap is the only change (Mask::cap_only) the scores are capped in the P loop and the
//                 derivative is 1 - tanh^2 alone, without the band form's distances, tests and selects
//                 (bench/NOTES.md, "Score modifiers"); the same values, bitwise
//   PERSIST       the persistent form ("atomic" and "seqpar", no visiting order): a grid of at most one block per
//                 SM, block bid walking the tiles k G + bid of that linear order (Sm90BwdTiles: every other wave
//                 reversed). Each role carries its stage ring, dS^T buffers and dQ hand-offs from tile to tile;
//                 the producer issues the next tile's first Q / dO stage as soon as its stage is free and its K / V
//                 once both consumers have passed the last products that read them (kv_empty), so the next tile's
//                 loads run under this tile's last iteration and dK / dV stores, and no block is launched per tile.
//   SK            stream-K (the persistent form without a mask; Sm90BwdStreamK): the last waves' (query head, Q tile)
//                 iterations in one equal range per block, a tile split between two blocks finished by the one that
//                 began it from the other's fp32 partial dK, dV in the workspace (BwdParams::sk_workspace; null: the
//                 fixed walk); its walk reads its counts at each use (Sm90BwdTiles' LEAN), so that its producer fits
//                 24 registers.
//
// "ordered" under the causal mask. The KV tiles that see Q tile m are 0 .. last(m) (a prefix: a block's range
// begins at its diagonal), so any order in which each Q tile's additions follow one fixed sequence of those KV
// tiles is deterministic; it is deadlock-free when every block visits its (query head, Q tile) pairs in one order
// common to all blocks (heads outer, Q tiles inner) and each waits only on a block dispatched before it (blocks
// start in blockIdx order). Plain ascending order: block j starts at its diagonal, yet every Q tile waits on block
// 0's progress, so block j finishes about j steps after block 0 with j fewer tiles done.
// DQ_ORDER_KV_DESC: KV tile last(m) adds first, then last(m) - 1, ... 0, and the grid runs the KV tiles in reverse
// (block x = KV tile N - 1 - x: the one waited on is dispatched first). KV tile j + 1's range begins at a later Q
// tile and holds no more tiles per head, so it reaches (head, Q tile m) in fewer steps than KV tile j in every
// head: no block waits once the blocks run (GQA too). The cost: the grid's longest blocks start last (a tail).
// DQ_ORDER_Q_DESC: block j trails block j - 1 by one step at the shared last Q tile, but a block with more Q tiles
// per head reaches the next head later: with GQA the waits come back (bench/NOTES.md, "Hopper backward").
// DQ_ORDER_HEADS_INNER (GQA): the Q tiles last first outside, the group's query heads inside, and KV tile j adds after
// 0 .. j - 1 (both dispatch orders start a pair's KV tile j - 1 before its KV tile j: the launch's, and the grouped
// one's tile by tile). KV tile j's range is a suffix of KV tile j - 1's, so both reach (head h, Q tile m) at step
// (M - 1 - m) G + h of their walks: at each step a block waits only for the additions of the blocks before it at
// that step, so the lag of block j behind block 0 is j hand-offs once, not a growing one, and the blocks of a pair
// still read each Q and dO tile together.
//
// "ordered" without a mask. Every KV tile sees every Q tile. In plain ascending order all blocks of a head start at
// Q tile 0 and KV tile j adds after j - 1 at every Q tile, so the last block starts its additions N hand-offs (a bulk
// add's completion, the release, the next acquire) late. DQ_ORDER_ROT: block x visits Q tile (x - s) mod M at step
// s, and a Q tile takes its additions in (step, KV tile) order (rot_turn), so at step s block x adds where block
// x - 1 added at step s - 1: no waits while the blocks run side by side. The wrap (KV tile 0 waits on KV tile N - 1
// at step 1) makes it deadlock-free only while a head's N blocks are resident together, which the host checks.
#include "common/ptx.cuh"
#include "common/sm90.cuh"
#include "common/wgmma.cuh"
#include "common/warp_gemm.cuh"
#include "attn/params.cuh"
#include "attn/seqlen.cuh"
#include "attn/mask.cuh"
#include "attn/block.cuh"
#include "attn/softmax.cuh"
#include "attn/bwd.cuh"

namespace cuflash {

// The tensor maps of Q, K, V and dO, and of the outputs dK and dV: 4-d [batch, seqlen, heads, D] views, boxes of 64
// columns by BLOCK_M (Q, dO) or BLOCK_N (K, V, dK, dV) rows, 128-byte swizzle (cuflash/_tma.py encodes them).
struct Sm90BwdMaps {
  TmaDesc q, k, v, dout, dk, dv;
};

// dK = softmax_scale dK_acc and dV_acc of a block's KV tile through shared memory and TMA (one block per tile; the
// persistent form stores from registers, store_dkdv_wide, as its next tile's K and V load into these buffers under
// the stores). Once both consumers' products are complete (named barrier 1: the other consumer's products read this
// one's keys of K), each thread writes its fragments (rows r0, r0 + 8 of the tile, n8 blocks of columns from chunk
// c0) into K's and V's tiles, in their own layout (chunk c of 64 columns at + c * BLOCK_N * 128); then one thread
// stores both tiles, one TMA box per chunk, and waits until the boxes are read before the block's shared memory goes
// away. TMA clips rows past seqlen_k and columns past the inputs' head dim (a chunk wholly past it is not issued).
template <typename T, int D, int BLOCK_N, int CH, int NF>
__device__ __forceinline__ void sm90_bwd_store_dkdv_tma(const BwdParams& p, const Sm90BwdMaps& maps,
                                                        unsigned char* k_tile, unsigned char* v_tile, int c0,
                                                        float (&dk)[NF][4], const float (&dv)[NF][4], int n0,
                                                        int kv_head, int batch, int r0, int tq, bool issue) {
  scale_frags(reinterpret_cast<float(&)[1][NF][4]>(dk), (float)p.softmax_scale);
  named_bar_sync(1, 256);
  stage_frags<T, D, BLOCK_N>(k_tile + c0 * BLOCK_N * 128, dk, r0, tq);
  stage_frags<T, D, BLOCK_N>(v_tile + c0 * BLOCK_N * 128, dv, r0, tq);
  fence_proxy_async_shared();  // each thread's writes, before the async proxy (the TMA stores) reads them
  named_bar_sync(1, 256);
  if (issue) {
#pragma unroll
    for (int c = 0; c < CH; ++c)
      if (c * 64 < (int)p.head_dim) {
        tma_store_4d(&maps.dk, k_tile + c * BLOCK_N * 128, c * 64, n0, kv_head, batch);
        tma_store_4d(&maps.dv, v_tile + c * BLOCK_N * 128, c * 64, n0, kv_head, batch);
      }
    bulk_commit_group();
    bulk_wait_group_read<0>();
  }
}

// The Q tile of a query head's iteration m (0 .. num_m): m_begin + m, last first (DQ_ORDER_Q_DESC,
// DQ_ORDER_HEADS_INNER), or DQ_ORDER_ROT's rot - m (mod num_m), rot = the KV tile's index mod num_m (rot_of_tile).
template <int ORDER>
__device__ __forceinline__ int q_tile_at(int m_begin, int num_m, int m, int rot) {
  if constexpr (ORDER == DQ_ORDER_ROT) {
    const int r = rot - m;
    return m_begin + (r < 0 ? r + num_m : r);
  }
  return ORDER == DQ_ORDER_Q_DESC || ORDER == DQ_ORDER_HEADS_INNER ? m_begin + num_m - 1 - m : m_begin + m;
}
// The step after iteration (query head h, Q tile index m) of a block: each head's Q tiles in turn (heads outer), or
// with DQ_ORDER_HEADS_INNER the group's heads at each Q tile (Q tiles outer).
template <int ORDER>
__device__ __forceinline__ void walk_step(int& h, int& m, int num_m, int group) {
  if constexpr (ORDER == DQ_ORDER_HEADS_INNER) {
    if (++h == group) {
      h = 0;
      ++m;
    }
  } else if (++m == num_m) {
    m = 0;
    ++h;
  }
}
template <int ORDER>
__device__ __forceinline__ int rot_of_tile(int n_block, int num_m) {
  return ORDER == DQ_ORDER_ROT && num_m > 0 ? n_block % num_m : 0;
}

// DQ_ORDER_ROT: the turn of KV tile n (of N) at Q tile m (of M) -- the additions made before its own, in the order
// of (step, KV tile). KV tile x visits Q tile m at step (x - m) mod M, so those before n are the KV tiles whose
// residue mod M is (m + k) mod M for a k below d = (n - m) mod M (N / M of each residue, one more for the residues
// below N mod M), and the n / M of n's own residue below it.
__device__ __forceinline__ int rot_turn(unsigned n, int m, unsigned N, unsigned M) {
  const unsigned nq = n / M, q = N / M;
  const int nm = (int)(n - nq * M), rem = (int)(N - q * M);
  const int d = nm - m < 0 ? nm - m + (int)M : nm - m;
  const int below = m + d <= (int)M ? max(0, min(m + d, rem) - m) : max(0, rem - m) + min(m + d - (int)M, rem);
  return d * (int)q + below + (int)nq;
}

// "ordered": the turn of KV tile n_block at the Q tile of rows m0 .. m0 + BLOCK_M -- the additions made there before
// its own: ascending (n_block), from the last KV tile that sees the tile down (DQ_ORDER_KV_DESC: its rows see the keys
// before kv_block_end's tile, the same band q_block_begin reads), or rot_turn's among the launch's n_tiles KV tiles
// (DQ_ORDER_ROT: every KV tile sees every Q tile). The KV tiles that see a Q tile are 0 .. last (MOD_NONE: the host's
// rule). LEAN: ROT's operands through opaque, so that its divisions are done at each use rather than held as the
// loop's invariants (they spilled at the dQ writer's 24 registers).
template <int ORDER, int BLOCK_M, int BLOCK_N, bool LEAN = false, class M>
__device__ __forceinline__ int dq_ordered_turn(const M& band, int n_block, int m0, int n_tiles, int num_m) {
  if constexpr (ORDER == DQ_ORDER_ROT)
    return rot_turn(LEAN ? opaque(n_block) : n_block, m0 / BLOCK_M, n_tiles, LEAN ? opaque(num_m) : num_m);
  else if constexpr (ORDER == DQ_ORDER_KV_DESC)
    return kv_block_end<BLOCK_N>(band, m0 + BLOCK_M) - 1 - n_block;
  else
    return n_block;
}

// The block's (KV tile, KV head, batch) of the launch (KV tiles, KV heads, batch). GROUP = 0: blockIdx as launched
// (DQ_ORDER_KV_DESC: KV tiles last first). GROUP > 0 (the causal kernels of "atomic" and "seqpar"): the linear block
// index -- the order blocks are dispatched in -- taken as groups of GROUP (KV head, batch) pairs, one group after the
// other, and inside a group KV tile by KV tile (tile 0 of each pair, then tile 1, ...): under the causal mask the
// longest blocks start first, so the grid's last blocks are short ones, while the blocks running at once share the Q
// and dO of about GROUP heads in L2 as the launch's order does (bench/diag/bwd_grid_model.py: tile-major/G).
// (bi: blockIdx, or block_idx_reread's.)
template <int ORDER, int GROUP>
__device__ __forceinline__ int3 sm90_bwd_block(const uint3& bi) {
  if constexpr (GROUP == 0) {
    return make_int3(ORDER == DQ_ORDER_KV_DESC ? (int)(gridDim.x - 1 - bi.x) : (int)bi.x, (int)bi.y, (int)bi.z);
  } else {
    const int n = (int)gridDim.x, pairs = (int)(gridDim.y * gridDim.z);
    const int lin = (int)(bi.x + gridDim.x * (bi.y + gridDim.y * bi.z));
    const int g = lin / (GROUP * n), size = min(GROUP, pairs - g * GROUP), r = lin - g * GROUP * n;
    const int pair = g * GROUP + r % size;
    return make_int3(r / size, pair % (int)gridDim.y, pair / (int)gridDim.y);
  }
}

// The persistent form (the kernel's PERSIST): a grid of G <= the SM count blocks over the launch's tiles (KV tiles,
// KV heads, batch) in the launch's linear order (the KV tile fastest); block bid takes tile k G + bid of wave k for
// even k and k G + G - 1 - bid for odd k, so that under the causal mask a block's long and short tiles alternate.
// x < 0: the block's walk is over.
// LEAN (the stream-K kernels and the 80-row tile's, whose producer warpgroup runs on 24 registers): every count read
// through a volatile move at each use, so that the compiler cannot hoist the counts out of the walk's loops and hold
// them in registers there (held, they spilled), and in 32-bit arithmetic.
template <int BLOCK_N, bool LEAN = false>
struct Sm90BwdTiles {
  const BwdParams& p;  // the counts are read from the parameters at each step (constant bank: no registers held)
  __device__ __forceinline__ static int v(int x) { return LEAN ? opaque(x) : x; }
  __device__ __forceinline__ int kv_heads() const {
    return LEAN ? v((int)p.nheads) / (int)p.heads_per_kv : (int)(p.nheads / p.heads_per_kv);
  }
  __device__ __forceinline__ int3 at(int k) const {
    const int n = (v((int)p.seqlen_k) + BLOCK_N - 1) / BLOCK_N, ny = kv_heads();
    const int G = v((int)gridDim.x), bid = (int)blockIdx.x;
    const int lin = k * G + (k & 1 ? G - 1 - bid : bid), pair = lin / n;
    return lin < n * ny * v((int)p.batch) ? make_int3(lin - pair * n, pair % ny, pair / ny) : make_int3(-1, 0, 0);
  }
  // the launch's tile count, its whole waves before stream-K's segments (Sm90BwdStreamK), its tile `lin` in the
  // linear order
  __device__ __forceinline__ int count() const {
    return (v((int)p.seqlen_k) + BLOCK_N - 1) / BLOCK_N * kv_heads() * v((int)p.batch);
  }
  __device__ __forceinline__ int sk_waves() const { return count() / v((int)gridDim.x) - 1; }
  __device__ __forceinline__ int3 of(int lin) const {
    const int n = (v((int)p.seqlen_k) + BLOCK_N - 1) / BLOCK_N, ny = kv_heads(), pair = lin / n;
    return make_int3(lin - pair * n, pair % ny, pair / ny);
  }
};

// Stream-K (the kernels' SK: the persistent form without a mask, so every tile has the same n_it iterations). The
// first C / G - 1 waves of the C tiles go out whole, as the fixed walk's; the iterations of the remaining tiles
// (between G and 2G - 1 of them) are cut into G equal ranges in tile order, block b taking range b, so that the
// blocks' work differs by a partial tile's epilogue rather than by a whole tile (the fixed walk's part-empty last
// wave). Each range holds at least n_it iterations, so a tile has at most two parts: its head [0, i), the last
// segment of block b, and its tail [i, n_it), the first segment past the whole waves of block b + 1. The tail's
// block stores its partial dK, dV (fp32, unscaled) in its slot of the workspace and raises its flag; the head's
// block, which reaches the end of its range last, waits for the flag, adds the partial to its own and stores the
// tile's dK, dV (a fixed order of the two sums: deterministic). The workspace (p.sk_workspace, cuflash/_walk.py):
// an int flag per block (every launch leaves them zero), then from byte SM90_BWD_SK_DATA_OFFSET one slot per block of
// 256 consumer threads x 2 NF float4 (NF: a consumer thread's accumulator fragments of dK, and of dV), thread-major.
// p.sk_workspace null (a launch captured into a CUDA graph): every tile whole, the fixed walk's waves.
constexpr int SM90_BWD_SK_DATA_OFFSET = 4096;  // cuflash/_walk.py: SK_FLAG_BYTES
enum Sm90BwdPart { PART_WHOLE = 0, PART_TAIL = 1, PART_HEAD = 2 };
struct Sm90BwdSeg {
  int lin, i0, i1;  // the tile (-1: none), its iterations [i0, i1)
};
struct Sm90BwdStreamK {
  // Segment s past the whole waves of this block; n_it: every tile's iterations (no mask: group x Q tiles). The
  // counts come from the parameters at each call (Sm90BwdTiles' LEAN), the ranges in 32 bits: u G < 2^32 is the host's
  // rule (cuflash/_configs.py, sm90_bwd_stream_k_max_iters).
  template <int BLOCK_M, int BLOCK_N>
  __device__ __forceinline__ static Sm90BwdSeg segment(const BwdParams& p, int s, int& n_it) {
    const Sm90BwdTiles<BLOCK_N, true> tiles{p};
    const unsigned G = (unsigned)opaque((int)gridDim.x), b = blockIdx.x;
    const int count = tiles.count(), dp = (count / (int)G - 1) * (int)G;
    n_it = (opaque((int)p.seqlen_q) + BLOCK_M - 1) / BLOCK_M * opaque((int)p.heads_per_kv);
    const unsigned u = (unsigned)(count - dp) * (unsigned)n_it;
    const int lo = (int)(u * b / G), hi = (int)(u * (b + 1) / G);
    const int tt = lo / n_it + s, t0 = tt * n_it, start = max(lo, t0);
    if (start >= hi) return Sm90BwdSeg{-1, 0, 0};
    return Sm90BwdSeg{dp + tt, start - t0, min(hi - t0, n_it)};
  }
  __device__ __forceinline__ static int* flag(const BwdParams& p, int block) {
    return reinterpret_cast<int*>(p.sk_workspace) + block;
  }
  // consumer thread c's first float4 of block `block`'s slot of 2 NF float4 per thread (its fragment f at + f * 256)
  template <int NF>
  __device__ __forceinline__ static float4* part(const BwdParams& p, int block, int c) {
    return reinterpret_cast<float4*>(reinterpret_cast<unsigned char*>(p.sk_workspace) + SM90_BWD_SK_DATA_OFFSET) +
           (size_t)block * 2 * NF * 256 + c;
  }
};

// The Q tiles [x, x + y) of BLOCK_M rows that the KV tile of keys [n0, n0 + BLOCK_N) sees under `band`.
template <int BLOCK_M, int BLOCK_N, class M>
__device__ __forceinline__ int2 sm90_bwd_q_tiles(const M& band, const SeqInfo& si, int n0) {
  const int m_begin = q_block_begin<BLOCK_M>(band, n0);
  return make_int2(m_begin,
                   max(0, q_block_end<BLOCK_M>(band, n0 + BLOCK_N, (si.seqlen_q + BLOCK_M - 1) / BLOCK_M) - m_begin));
}

template <int D, int BLOCK_M, int STAGES, bool PERSIST = false>
struct Sm90BwdLayout {
  static constexpr int BLOCK_N = 128;
  // The loads' role: the whole warp 0 walks the tiles and lane 0 issues the copies, so that the walk's state is
  // warp-uniform (ptxas keeps it in uniform registers) -- with BLOCK_M = 80, whose persistent form's producer fits
  // its 24 registers only so (one thread: 44 B of spills; with the lean walk, 32 B); else thread 0 alone.
  static constexpr bool WARP_LOADS = BLOCK_M == 80;
  static constexpr int DP = (D + 63) / 64 * 64;  // columns in smem: whole 64-column (128-byte) chunks
  static constexpr int CH = DP / 64;
  static constexpr int KV_BYTES = BLOCK_N * DP * 2;   // K (or V)
  static constexpr int Q_BYTES = BLOCK_M * DP * 2;    // one stage of Q (or of dO)
  static constexpr int DS_BYTES = BLOCK_N * BLOCK_M * 2;  // one dS^T buffer
  static constexpr int DQ_BYTES = BLOCK_M * D * 4;      // the staged dQ tile (the accumulator's rows of D floats)
  static constexpr int K_OFF = 0;
  static constexpr int V_OFF = K_OFF + KV_BYTES;
  static constexpr int Q_OFF = V_OFF + KV_BYTES;
  static constexpr int DO_OFF = Q_OFF + STAGES * Q_BYTES;
  static constexpr int DS_OFF = DO_OFF + STAGES * Q_BYTES;
  static constexpr int DQ_OFF = DS_OFF + 2 * DS_BYTES;
  static constexpr int LSE_OFF = DQ_OFF + DQ_BYTES;
  static constexpr int DELTA_OFF = LSE_OFF + STAGES * BLOCK_M * 4;
  static constexpr int BAR_OFF = DELTA_OFF + STAGES * BLOCK_M * 4;
  static constexpr int BARS = 3 + 2 * STAGES + PERSIST;  // K/V; full, empty per stage; dq_full, dq_empty; kv_empty
  static constexpr int BYTES = BAR_OFF + BARS * 8 + 1024;  // + the slack that aligns the base to 1024 bytes
};

// acc [64 rows of A, N] = A B^T over the DP columns of two K-major tiles in shared memory, A and B in 64-column
// chunks of A_ROWS and B_ROWS rows (the 128-byte-swizzled layout of sm90.cuh): S^T = K Q^T and dP^T = V dO^T.
template <typename T, int N, int A_ROWS, int B_ROWS, int DP>
__device__ __forceinline__ void wgmma_ss_over_d(float (&acc)[N / 8][4], uint32_t a, uint32_t b) {
#pragma unroll
  for (int k = 0; k < DP / 16; ++k) {
    const uint32_t off = (k % 4) * 32;  // k16 step within the 64-column chunk k / 4
    Wgmma<N>::template ss<T>(acc, smem_desc(a + (k / 4) * A_ROWS * 128 + off, 16, 1024),
                             smem_desc(b + (k / 4) * B_ROWS * 128 + off, 16, 1024), k > 0);
  }
}

// The (query head, Q tile) pairs of a block in its order: heads of the KV head's group outer, each head's Q tiles
// [m_begin, m_begin + num_m) inner (q_tile_at's order), with ROT started `rot` tiles in (wrapping).
template <bool ROT>
struct QTileWalk {
  int h = 0, m = 0;
  // the current pair's (query head within the group, Q tile index within the range), then a step on
  __device__ __forceinline__ int2 next(int num_m, int rot) {
    int mi = m;
    if constexpr (ROT) {
      mi += rot;
      if (mi >= num_m) mi -= num_m;
    }
    const int2 r = make_int2(h, mi);
    if (++m == num_m) {
      m = 0;
      ++h;
    }
    return r;
  }
  // the same in the order ORDER (DQ_ORDER_HEADS_INNER: walk_step's, the group's heads inner; else next's)
  template <int ORDER>
  __device__ __forceinline__ int2 step(int num_m, int rot, int group) {
    if constexpr (ORDER == DQ_ORDER_HEADS_INNER) {
      const int2 r = make_int2(h, m);
      walk_step<ORDER>(h, m, num_m, group);
      return r;
    } else {
      return next(num_m, rot);
    }
  }
};

// The producer thread (layout L: Sm90BwdLayout or Sm90BwdSplitLayout): K_j and V_j once, then for every (query head,
// Q tile) of the block, once stage s is free, Q_i and dO_i by TMA and the rows' lse_log2 and D by bulk copy, all
// completing on full[s].
// PERSIST (the persistent form): the block's tile j (of those with work), whose iterations follow it0 earlier ones in
// the stage ring; K and V are loaded once the consumers have released tile j - 1's (kv_empty), after the first Q
// tile's loads, which only wait for their stage. [i0, i1): a stream-K segment's iterations (i1 < 0: all).
template <class L, int BLOCK_M, int STAGES, int ORDER, bool ROT = false, bool PERSIST = false>
__device__ __forceinline__ void sm90_bwd_load(const BwdParams& p, const Sm90BwdMaps& maps, unsigned char* sm,
                                              uint64_t* bar_kv, uint64_t* full, uint64_t* empty, int n0, int kv_head,
                                              int batch, int group, int m_begin, int num_m, int rot, int it0 = 0,
                                              uint64_t* kv_empty = nullptr, int j = 0, int i0 = 0, int i1 = -1) {
  constexpr int BLOCK_N = L::BLOCK_N, CH = L::CH;
  const bool issue = !L::WARP_LOADS || threadIdx.x % 32 == 0;  // (WARP_LOADS: the warp waits, lane 0 issues)
  auto load_kv = [&]() {
    if constexpr (PERSIST) mbar_wait(kv_empty, (j & 1) ^ 1);
    if (issue) {
      mbar_arrive_expect_tx(bar_kv, 2 * L::KV_BYTES);
#pragma unroll
      for (int c = 0; c < CH; ++c) {
        tma_load_4d(sm + L::K_OFF + c * BLOCK_N * 128, &maps.k, bar_kv, c * 64, n0, kv_head, batch);
        tma_load_4d(sm + L::V_OFF + c * BLOCK_N * 128, &maps.v, bar_kv, c * 64, n0, kv_head, batch);
      }
    }
  };
  if constexpr (!PERSIST) load_kv();
  const int total = i1 < 0 ? group * num_m : i1 - i0;  // (i0, i1: a stream-K segment's iterations)
  const int rot_o = rot_of_tile<ORDER>(n0 / BLOCK_N, num_m);
  QTileWalk<ROT> walk;
  walk.h = i0 / num_m;
  walk.m = i0 - walk.h * num_m;
  static_assert(ORDER != DQ_ORDER_HEADS_INNER || (!ROT && !PERSIST), "DQ_ORDER_HEADS_INNER: one block per tile");
#pragma unroll 1
  for (int it = 0; it < total; ++it) {
    const int s = (it0 + it) % STAGES, ph = ((it0 + it) / STAGES) & 1;
    const int2 hm = walk.template step<ORDER>(num_m, rot, group);
    const int hq = kv_head * group + hm.x, m0 = q_tile_at<ORDER>(m_begin, num_m, hm.y, rot_o) * BLOCK_M;
    mbar_wait(&empty[s], ph ^ 1);
    if (issue) {
      mbar_arrive_expect_tx(&full[s], 2 * L::Q_BYTES + 2 * BLOCK_M * 4);
#pragma unroll
      for (int c = 0; c < CH; ++c) {
        tma_load_4d(sm + L::Q_OFF + s * L::Q_BYTES + c * BLOCK_M * 128, &maps.q, &full[s], c * 64, m0, hq, batch);
        tma_load_4d(sm + L::DO_OFF + s * L::Q_BYTES + c * BLOCK_M * 128, &maps.dout, &full[s], c * 64, m0, hq,
                    batch);
      }
      const int64_t row = ((int64_t)batch * p.nheads + hq) * p.seqlen_q_pad + m0;  // (sq_pad: whole tiles)
      bulk_load(sm + L::LSE_OFF + s * BLOCK_M * 4, p.lse_log2 + row, BLOCK_M * 4, &full[s]);
      bulk_load(sm + L::DELTA_OFF + s * BLOCK_M * 4, p.delta + row, BLOCK_M * 4, &full[s]);
    }
    if constexpr (PERSIST) {
      if (it == 0) load_kv();
    }
  }
}

// The dQ writer (one lane of the producer warpgroup) over `total` iterations of one tile from its iteration i0, which
// follow it0 earlier ones of the block: each staged dQ tile handed to the TMA unit as one bulk operation -- a reduction
// into the accumulator ("atomic"), the same in KV-tile order ("ordered": not in the persistent form, nor in the kernels
// the host never runs it on, ORDERED false: the modifier kernels and the grouped dispatch order's) or a store into the
// KV tile's own buffer ("seqpar").
template <class L, int D, int BLOCK_M, int BLOCK_N, int ORDER, bool PERSIST, bool ORDERED, class M>
__device__ __forceinline__ void sm90_bwd_write_dq(const BwdParams& p, const M& band, uint64_t* dq_full,
                                                  uint64_t* dq_empty, float* dq_stage, int n_block, int kv_head,
                                                  int batch, int group, int m_begin, int num_m, int total, int it0,
                                                  int i0 = 0) {
  const int strategy = ORDER == DQ_ORDER_PLAIN || ORDER == DQ_ORDER_HEADS_INNER ? (int)p.dq_strategy : DQ_ORDERED;
  const bool ordered = ORDERED && !PERSIST && strategy == DQ_ORDERED;
  const int64_t ws_rows = bwd_ws_rows(p, false);
  int* sem = reinterpret_cast<int*>(p.dq_accum + ws_rows * D);  // "ordered": one counter per 64 rows
  const uint32_t src = smem_addr(dq_stage);
  int h = i0 / num_m, m = i0 - h * num_m;  // (i0: a stream-K segment's first iteration)
#pragma unroll 1
  for (int it = 0; it < total; ++it) {
    // (DQ_ORDER_ROT: the rotation derived at each step, not held: see the turn below)
    const int rot = ORDER == DQ_ORDER_ROT ? rot_of_tile<ORDER>(opaque(n_block), num_m) : 0;
    const int hq = kv_head * group + h, m0 = q_tile_at<ORDER>(m_begin, num_m, m, rot) * BLOCK_M;
    walk_step<ORDER>(h, m, num_m, group);
    const int64_t row = ((int64_t)batch * p.nheads + hq) * p.seqlen_q_pad + m0;
    float* dst = p.dq_accum + ((strategy == DQ_SEQPAR ? n_block * ws_rows : 0) + row) * D;
    int* sem_at = nullptr;
    mbar_wait(dq_full, (it0 + it) & 1);
    if (ordered) {
      const int turn = dq_ordered_turn<ORDER, BLOCK_M, BLOCK_N, true>(band, n_block, m0, (int)gridDim.x, num_m);
      sem_at = sem + row / 64;  // (from here held in place of the row: one 64-bit value less across the wait)
      while (ld_acquire_gpu(sem_at) != turn) {
      }
      fence_proxy_async_global();
    }
    if (strategy == DQ_SEQPAR)
      bulk_store_f32(dst, src, L::DQ_BYTES);
    else
      bulk_reduce_add_f32(dst, src, L::DQ_BYTES);
    bulk_commit_group();
    bulk_wait_group_read<0>();
    mbar_arrive(dq_empty);  // the staging is free once read (the consumers stage the next tile meanwhile)
    if (ordered) {  // added (not only read) before the next KV tile may add
      bulk_wait_group<0>();
      fence_proxy_async_global();
      red_release_gpu_add(sem_at, 1);
    }
  }
}

// Stream-K's end of a segment that is part of a tile (Sm90BwdStreamK), in the consumers (NF accumulator fragments of dK
// and of dV per thread): a tail stores its partial (fp32, unscaled) in the block's slot and raises the block's flag --
// true: the tile's dK, dV are the head's block's to store; a head waits for the next block's flag, sets it back and
// adds that block's partial to its own -- false, as for a whole tile: the caller stores dK, dV.
template <int NF>
__device__ __forceinline__ bool sm90_bwd_sk_part(const BwdParams& p, int part, float (&acc_dk)[NF][4],
                                                 float (&acc_dv)[NF][4]) {
  const int c = threadIdx.x - 128;  // the consumer thread
  if (part == PART_TAIL) {
    float4* dst = Sm90BwdStreamK::part<NF>(p, (int)blockIdx.x, c);
#pragma unroll
    for (int f = 0; f < NF; ++f) {
      __stcg(dst + f * 256, make_float4(acc_dk[f][0], acc_dk[f][1], acc_dk[f][2], acc_dk[f][3]));
      __stcg(dst + (NF + f) * 256, make_float4(acc_dv[f][0], acc_dv[f][1], acc_dv[f][2], acc_dv[f][3]));
    }
    named_bar_sync(1, 256);  // every consumer thread's stores before the release (cumulative through the barrier)
    if (c == 0) red_release_gpu_add(Sm90BwdStreamK::flag(p, (int)blockIdx.x), 1);
    return true;
  }
  if (part == PART_HEAD) {
    if (c == 0) {
      int* fl = Sm90BwdStreamK::flag(p, (int)blockIdx.x + 1);
      while (ld_acquire_gpu(fl) == 0) {
      }
      *fl = 0;  // (read by no one else: the next launch on this workspace starts after this one ends)
    }
    named_bar_sync(1, 256);
    const float4* src = Sm90BwdStreamK::part<NF>(p, (int)blockIdx.x + 1, c);
#pragma unroll
    for (int f = 0; f < NF; ++f) {
      const float4 a = __ldcg(src + f * 256), b = __ldcg(src + (NF + f) * 256);
      acc_dk[f][0] += a.x;
      acc_dk[f][1] += a.y;
      acc_dk[f][2] += a.z;
      acc_dk[f][3] += a.w;
      acc_dv[f][0] += b.x;
      acc_dv[f][1] += b.y;
      acc_dv[f][2] += b.z;
      acc_dv[f][3] += b.w;
    }
  }
  return false;
}

// A block's tiles (KV tile, KV head, batch), each as fn(tile, its Q tiles [x, x + y) -- those that see the KV tile;
// a tile's iterations are (query head, Q tile) --, the iterations of the block's tiles before it, the number of its
// tiles with work before it, the iterations [i0, i1) of the tile the block runs, which part of the tile that is
// (Sm90BwdPart)): the launch's one (blk1, qr1), or the persistent form's walk (Sm90BwdTiles), with SK its stream-K
// segments past the whole waves (Sm90BwdStreamK).
template <bool PERSIST, bool SK, int BLOCK_M, int BLOCK_N, class M, class F>
__device__ __forceinline__ void sm90_bwd_for_tiles(const BwdParams& p, const SeqInfo& si, const M& band, int group,
                                                   const int3& blk1, const int2& qr1, F&& fn) {
  if constexpr (PERSIST) {
    const Sm90BwdTiles<BLOCK_N, SK || BLOCK_M == 80> tiles{p};  // (lean: Sm90BwdTiles)
    int it0 = 0, j = 0;
    // SK with a workspace: C / G - 1 whole waves, then the segments (every tile's Q tiles alike: no mask)
    const bool sk = SK && p.sk_workspace != nullptr;
#pragma unroll 1
    for (int k = 0; !sk || k < tiles.sk_waves(); ++k) {
      const int3 blk = tiles.at(k);
      if (blk.x < 0) break;
      const int2 qr = sm90_bwd_q_tiles<BLOCK_M, BLOCK_N>(band, si, blk.x * BLOCK_N);
      fn(blk, qr, it0, j, 0, group * qr.y, PART_WHOLE);
      if (qr.y > 0) {
        it0 += group * qr.y;
        ++j;
      }
    }
    if constexpr (SK) {
      if (sk) {
#pragma unroll 1
        for (;;) {  // segment j - whole waves (each wave gave the block a tile with work): no counter of its own
          int n_it;
          const Sm90BwdSeg sg = Sm90BwdStreamK::segment<BLOCK_M, BLOCK_N>(p, j - tiles.sk_waves(), n_it);
          if (sg.lin < 0) break;
          fn(tiles.of(sg.lin), make_int2(0, n_it / group), it0, j, sg.i0, sg.i1,
             sg.i0 > 0 ? PART_TAIL : sg.i1 < n_it ? PART_HEAD : PART_WHOLE);
          it0 += sg.i1 - sg.i0;
          ++j;
        }
      }
    }
  } else {
    fn(blk1, qr1, 0, 0, 0, group * qr1.y, PART_WHOLE);
  }
}

// The loads' thread of either kernel: sm90_bwd_load over the launch's tile (blk1, its Q tiles qr1, its first Q tile
// rot1), or over the persistent form's walk (rot_of(KV tile, Q tiles): a tile's first Q tile, with ROT).
template <class L, int BLOCK_M, int STAGES, int ORDER, bool ROT, bool PERSIST, bool SK, class M, class R>
__device__ __forceinline__ void sm90_bwd_produce(const BwdParams& p, const Sm90BwdMaps& maps, unsigned char* sm,
                                                 uint64_t* bar_kv, uint64_t* full, uint64_t* empty, uint64_t* kv_empty,
                                                 const SeqInfo& si, const M& band, int group, const int3& blk1,
                                                 const int2& qr1, int rot1, R&& rot_of) {
  constexpr int BLOCK_N = L::BLOCK_N;
  if constexpr (PERSIST) {
    sm90_bwd_for_tiles<PERSIST, SK, BLOCK_M, BLOCK_N>(
        p, si, band, group, blk1, qr1, [&](const int3& blk, const int2& qr, int it0, int tile_j, int i0, int i1, int) {
          if (qr.y > 0)
            sm90_bwd_load<L, BLOCK_M, STAGES, ORDER, ROT, true>(p, maps, sm, bar_kv, full, empty, blk.x * BLOCK_N,
                                                                blk.y, blk.z, group, qr.x, qr.y, rot_of(blk.x, qr.y),
                                                                it0, kv_empty, tile_j, i0, i1);
        });
  } else {
    sm90_bwd_load<L, BLOCK_M, STAGES, ORDER, ROT>(p, maps, sm, bar_kv, full, empty, blk1.x * BLOCK_N, blk1.y, blk1.z,
                                                  group, qr1.x, qr1.y, rot1);
  }
}

template <typename T, int D, int BLOCK_M, int STAGES, bool CAUSAL, int REGS_MMA, int REGS_LOAD, int SMEM_BYTES,
          int MOD = MOD_NONE, int ORDER = DQ_ORDER_PLAIN, int GROUP = 0, bool PERSIST = false, bool SK = false,
          bool CAP_ONLY = false>
__global__ void __launch_bounds__(384, 1)
    flash_bwd_sm90_kernel(const __grid_constant__ BwdParams p, const __grid_constant__ Sm90BwdMaps maps) {
  using L = Sm90BwdLayout<D, BLOCK_M, STAGES, PERSIST>;
  constexpr int BLOCK_N = L::BLOCK_N, DP = L::DP, CH = L::CH;
  constexpr bool SPLIT_M = BLOCK_M == 128;  // dQ: each consumer takes 64 Q rows (else 64 columns) of the tile
  // BLOCK_M = 80 (head dim 128, no mask): wgmma's M is 64, so dQ is computed transposed, dQ^T = K^T dS^T (each
  // consumer 64 of the head dim's rows x the 80 queries), from dS stored K-major (rows = queries, stmatrix.trans), and
  // staged in the transposed accumulator layout (attn/bwd.cuh: the T80 tiles; flash_bwd.cu: their convert kernel).
  constexpr bool TRANS_DQ = BLOCK_M == 80;
  // the dQ writer's "ordered" turns: not in the kernels the host never runs it on (cuflash/_bwd_sm90.py: the
  // modifier kernels, the grouped dispatch order's but for the heads-inner walk, the 80-row tiles')
  constexpr bool WRITER_ORDERED = MOD == MOD_NONE && (GROUP == 0 || ORDER == DQ_ORDER_HEADS_INNER) && !TRANS_DQ;
  constexpr int KM = BLOCK_M / 16;   // k16 steps over the Q rows (dV, dK)
  constexpr int KN = BLOCK_N / 16;   // k16 steps over the keys (dQ)
  constexpr int MF = BLOCK_M / 8;    // n8 blocks of S^T along the Q rows
  constexpr int DF = DP / 8;         // n8 blocks of dK, dV
  static_assert(D % 16 == 0 && (SPLIT_M ? DP == 64 : ((BLOCK_M == 64 || BLOCK_M == 80) && DP == 128)),
                "tiles: 128 x 128 at head dims up to 64, 64 x 128 (or 80 x 128) up to 128");
  static_assert(!TRANS_DQ || (!CAUSAL && MOD == MOD_NONE && ORDER == DQ_ORDER_PLAIN && GROUP == 0 && !SK),
                "80-row Q tiles: without a mask, atomic or seqpar, one block per tile or persistent (no stream-K)");
  static_assert(MOD == MOD_NONE || MOD == MOD_SCORE, "MOD: none or MOD_SCORE (dropout runs on the sm80 kernels)");
  // setmaxnreg moves registers within the block's launch allocation (65536 / 384 threads, rounded down to a multiple
  // of 8: 168 each), not the whole register file: asking for more than the producer gives back never returns.
  static_assert(128 * (REGS_LOAD + 2 * REGS_MMA) <= 65536 / (384 * 8) * 8 * 384 && REGS_MMA % 8 == 0 &&
                    REGS_LOAD % 8 == 0,
                "setmaxnreg register counts");
  static_assert(SMEM_BYTES == L::BYTES, "host smem size must match the layout");
  static_assert(ORDER == DQ_ORDER_PLAIN || (MOD == MOD_NONE && CAUSAL == (ORDER != DQ_ORDER_ROT)),
                "the other orders: ordered (or DQ_ORDER_HEADS_INNER: atomic, seqpar), causal only (DQ_ORDER_ROT: "
                "without a mask only)");
  static_assert(GROUP >= 0 && (GROUP == 0 || (CAUSAL && MOD == MOD_NONE &&
                                              (ORDER == DQ_ORDER_PLAIN || ORDER == DQ_ORDER_HEADS_INNER))),
                "GROUP: the causal kernels of atomic and seqpar (and ordered on the heads-inner walk) only");
  static_assert(!PERSIST || (ORDER == DQ_ORDER_PLAIN && GROUP == 0), "PERSIST: atomic and seqpar, the launch's order");
  static_assert(!SK || (PERSIST && !CAUSAL && MOD == MOD_NONE), "SK: the persistent form without a mask");
  static_assert(!CAP_ONLY || (MOD == MOD_SCORE && !SK && ORDER == DQ_ORDER_PLAIN && GROUP == 0),
                "CAP_ONLY: a form of the modifier kernel (one block per tile, or persistent)");

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* sm = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);  // 1024-aligned: the swizzle
  uint64_t* bar_kv = reinterpret_cast<uint64_t*>(sm + L::BAR_OFF);
  uint64_t* full = bar_kv + 1;
  uint64_t* empty = full + STAGES;
  uint64_t* dq_full = empty + STAGES;
  uint64_t* dq_empty = dq_full + 1;
  uint64_t* kv_empty = dq_empty + 1;  // PERSIST: the consumers are done with the tile's K and V
  float* dq_stage = reinterpret_cast<float*>(sm + L::DQ_OFF);

  const SeqInfo si = seqinfo_fixed(p);
  const int group = (int)p.heads_per_kv;
  const Mask<CAUSAL, MOD> band = si.band<CAUSAL, MOD>(p);
  // the launch's tile and its Q tiles (one block per tile)
  const int3 blk1 = PERSIST ? make_int3(0, 0, 0) : sm90_bwd_block<ORDER, GROUP>(blockIdx);
  const int n0_1 = blk1.x * BLOCK_N;
  const int2 qr1 = PERSIST ? make_int2(0, 0) : sm90_bwd_q_tiles<BLOCK_M, BLOCK_N>(band, si, n0_1);
  const int total1 = group * qr1.y;  // its iterations
  const int wg = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    mbar_init(bar_kv, 1);
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 256);  // every consumer thread releases a stage it has read
    }
    mbar_init(dq_full, 256);  // every consumer thread has staged its part of the dQ tile
    mbar_init(dq_empty, 1);   // the writer has read the staged tile
    if constexpr (PERSIST) mbar_init(kv_empty, 256);  // every consumer thread, after its tile's last products
    fence_barrier_init();
  }
  __syncthreads();

  if (wg == 0) {  // ------------------------------------------------------------------------------ producer
    setmaxnreg_dec<REGS_LOAD>();
    if ((L::WARP_LOADS ? threadIdx.x < 32 : threadIdx.x == 0) && (PERSIST || total1 > 0)) {
      sm90_bwd_produce<L, BLOCK_M, STAGES, ORDER, false, PERSIST, SK>(p, maps, sm, bar_kv, full, empty, kv_empty, si,
                                                                     band, group, blk1, qr1, 0,
                                                                     [](int, int) { return 0; });
    } else if (threadIdx.x == 32 && (PERSIST || total1 > 0)) {  // the dQ writer
      if constexpr (PERSIST) {
        sm90_bwd_for_tiles<PERSIST, SK, BLOCK_M, BLOCK_N>(
            p, si, band, group, blk1, qr1, [&](const int3& blk, const int2& qr, int it0, int, int i0, int i1, int) {
              sm90_bwd_write_dq<L, D, BLOCK_M, BLOCK_N, ORDER, true, WRITER_ORDERED>(
                  p, band, dq_full, dq_empty, dq_stage, blk.x, blk.y, blk.z, group, qr.x, qr.y, i1 - i0, it0, i0);
            });
      } else {
        sm90_bwd_write_dq<L, D, BLOCK_M, BLOCK_N, ORDER, false, WRITER_ORDERED>(
            p, band, dq_full, dq_empty, dq_stage, blk1.x, blk1.y, blk1.z, group, qr1.x, qr1.y, total1, 0);
      }
    }
    return;
  }

  // ------------------------------------------------------------------------------------------------ consumers
  setmaxnreg_inc<REGS_MMA>();
  const Mask<CAUSAL, MOD> mask_kv1 = si.mask<CAUSAL, MOD>(p, blk1.z, blk1.y * group);  // (the launch's tile)
  // consumer index: keys [n0 + 64 cw, +64). Above head dim 64 it is taken from lane 0 so the compiler knows it
  // is warp-uniform and keeps the wgmma descriptors in uniform registers; at 64 the score-modifier kernels of one
  // block per tile would then spill, so it stays a plain register there -- but not in the persistent modifier
  // kernel, which fits only with it (4 B of spills under NVRTC 13.0 without).
  const int cw = D > 64 || (PERSIST && MOD != MOD_NONE) ? __shfl_sync(0xffffffffu, wg - 1, 0) : wg - 1;
  const int tid = threadIdx.x % 128, lane = tid % 32;
  const int warp = __shfl_sync(0xffffffffu, tid / 32, 0);  // warp-uniform (the bulk copies' addresses)
  const int g = lane / 4, t = lane % 4;
  const int key_w1 = n0_1 + 64 * cw + 16 * warp;
  const float scale_log2 = (float)p.scale_log2;
  const uint32_t k_base = smem_addr(sm + L::K_OFF), v_base = smem_addr(sm + L::V_OFF);
  const uint32_t q_base = smem_addr(sm + L::Q_OFF), do_base = smem_addr(sm + L::DO_OFF);
  const uint32_t ds_base = smem_addr(sm + L::DS_OFF);
  // This warp's part of the dQ tile: 16 rows from row_q (within the Q tile), n8 blocks [dq_f0, dq_f0 + 8) of the
  // row (those below D / 8: the head dim's), at the band of row_q in the staging (16 D floats per 16-row band).
  const int row_q = (SPLIT_M ? 64 * cw : 0) + 16 * warp;
  const int dq_f0 = SPLIT_M ? 0 : 8 * cw;
  float* dq_band = dq_stage + (row_q / 16) * 16 * D + 4 * lane;

  sm90_bwd_for_tiles<PERSIST, SK, BLOCK_M, BLOCK_N>(
      p, si, band, group, blk1, qr1,
      [&](const int3& blk, const int2& qr, int it0, int tile_j, int i0, int i1, int part) {
    const int n_block = blk.x, kv_head = blk.y, batch = blk.z;
    const int n0 = n_block * BLOCK_N, m_begin = qr.x, num_m = qr.y, total = i1 - i0;
    const Mask<CAUSAL, MOD> mask_kv = PERSIST ? si.mask<CAUSAL, MOD>(p, batch, kv_head * group) : mask_kv1;
    // the warp's first key: its fragments hold keys key_w + g (+ 8)
    const int key_w = PERSIST ? n0 + 64 * cw + 16 * warp : key_w1;
    float acc_dk[DF][4], acc_dv[DF][4];
    zero_frags(acc_dk);
    zero_frags(acc_dv);

    if (total > 0) mbar_wait(bar_kv, tile_j & 1);
    int h = i0 / num_m, m = i0 - h * num_m;
    const int rot = rot_of_tile<ORDER>(n_block, num_m);
    for (int it = 0; it < total; ++it) {
      const int gi = it0 + it;  // the iteration's place in the block's stage ring, dS^T buffers and dQ hand-offs
      const int s = gi % STAGES, ph = (gi / STAGES) & 1;
      const int hq = kv_head * group + h, m0 = q_tile_at<ORDER>(m_begin, num_m, m, rot) * BLOCK_M;
      walk_step<ORDER>(h, m, num_m, group);
      const uint32_t qs = q_base + s * L::Q_BYTES, dos = do_base + s * L::Q_BYTES;
      const uint32_t ka = k_base + cw * 64 * 128, va = v_base + cw * 64 * 128;  // this consumer's 64 keys
      const float* lse_s = reinterpret_cast<const float*>(sm + L::LSE_OFF) + s * BLOCK_M;
      const float* dl_s = reinterpret_cast<const float*>(sm + L::DELTA_OFF) + s * BLOCK_M;
      mbar_wait(&full[s], ph);

      // S^T = K_w Q^T and dP^T = V_w dO^T, two groups.
      float acc_s[MF][4], acc_dp[MF][4];
      wgmma_fence();
      wgmma_ss_over_d<T, BLOCK_M, BLOCK_N, BLOCK_M, DP>(acc_s, ka, qs);
      wgmma_commit();
      wgmma_ss_over_d<T, BLOCK_M, BLOCK_N, BLOCK_M, DP>(acc_dp, va, dos);
      wgmma_commit();
      wgmma_wait<1>();  // S^T done (dP^T may still run)
      reg_fence(acc_s);

      // P^T, masked where some element of this consumer's [64 keys, BLOCK_M] tile is hidden (warpgroup-uniform).
      const Mask<CAUSAL, MOD> mask =
          MOD == MOD_NONE || group == 1 ? mask_kv : mask_kv.with_alibi(SeqInfo::alibi_slope(p, batch, hq));
      const bool need_mask = mask.needs_mask(m0, m0 + BLOCK_M - 1, n0 + 64 * cw, n0 + 64 * cw + 63);
      // CAP_ONLY: on a tile where the soft-cap is the only change (no element hidden, no ALiBi: Mask::cap_only,
      // warpgroup-uniform) the scores are capped in the P loop below, without apply_t's band form.
      bool lean = false;
      if constexpr (CAP_ONLY) lean = mask.cap_only(m0, m0 + BLOCK_M - 1, n0 + 64 * cw, n0 + 64 * cw + 63);
      if constexpr (MOD != MOD_NONE) {
        if (need_mask && !lean) mask.apply_t(acc_s, key_w, m0, lane);
      }
      uint32_t pa[KM][4];
      // With the soft-cap (MOD_SCORE, uniform): P goes straight into the A fragments, and the soft-cap's derivative
      // 1 - tanh^2 of each element (softcap_grad_of: from its value, no MUFU) is kept until dS: in acc_s at DP = 128;
      // at DP = 64 (BLOCK_M = 128: 64 elements per thread, whose registers do not fit beside pa, dP^T, dK and dV) as
      // 32 fp16 pairs in the rows of the dS^T buffer that this warp's dS^T overwrites later (its 16 rows of each
      // 64-query chunk: 4 KB, a word per lane per row; values in [0, 1]: 2^-12 absolute, below the 16-bit dS they
      // multiply). Element e of block nf: row m0 + 8 nf + 2t + e % 2, key key_w + g +
      // 8 (e / 2); its pair is word 2 nf + e / 2.
      constexpr bool CAP_PACKED = SPLIT_M;
      static_assert(!CAP_PACKED || 2 * MF == 16 * (BLOCK_M / 64), "the derivative's words: 16 rows per 64-query chunk");
      bool cap = false;
      unsigned char* ds_buf = nullptr;  // MOD_SCORE: the dS^T buffer (its layout: see the dS^T stores below)
      if constexpr (MOD != MOD_NONE) {
        cap = mask.softcap();
        ds_buf = sm + L::DS_OFF + (gi % 2) * L::DS_BYTES;
      }
      auto cap_word = [&](int w) {
        return reinterpret_cast<uint32_t*>(ds_buf + (64 * cw + 16 * warp) * 128) + lane + (w / 16) * (BLOCK_N * 32) +
               (w % 16) * 32;
      };
      // A soft-capped element block's end: P into the A fragments, the derivative into its words (CAP_PACKED).
      auto put_p = [&](int nf, const float (&pv)[4], const float (&dv)[4]) {
        pa[nf / 2][(nf % 2) * 2] = pack2<T>(pv[0], pv[1]);
        pa[nf / 2][(nf % 2) * 2 + 1] = pack2<T>(pv[2], pv[3]);
        if constexpr (CAP_PACKED) {
          *cap_word(2 * nf) = pack2<__half>(dv[0], dv[1]);
          *cap_word(2 * nf + 1) = pack2<__half>(dv[2], dv[3]);
        }
      };
      if (CAP_ONLY && cap && lean) {
        // CAP_ONLY's tiles: x is the raw score, capped here, and the derivative 1 - tanh^2 clamped at 0 -- on such a
        // tile exactly what apply_t's band form and softcap_grad_of compute in the loop below (their ALiBi term adds
        // -0 x dist, their -inf test holds), so the gradients are bitwise the same. (A loop of its own: written as
        // one loop with a switch, the configured kernels' registers were allocated differently.)
#pragma unroll
        for (int nf = 0; nf < MF; ++nf) {
          const float2 lse = *reinterpret_cast<const float2*>(lse_s + nf * 8 + 2 * t);
          float pv[4], dv[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float x = tanh_approx(acc_s[nf][e] * mask.cap_pre);
            pv[e] = softmax_p_from_lse(x, scale_log2, e % 2 ? lse.y : lse.x);
            dv[e] = fmaxf(0.f, fmaf(-x, x, 1.f));
            if constexpr (!CAP_PACKED) acc_s[nf][e] = dv[e];
          }
          put_p(nf, pv, dv);
        }
      } else if (cap) {
        const float dist0 = mask.dist_of(m0 + 2 * t, key_w + g);
#pragma unroll
        for (int nf = 0; nf < MF; ++nf) {
          const float2 lse = *reinterpret_cast<const float2*>(lse_s + nf * 8 + 2 * t);
          float pv[4], dv[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float x = acc_s[nf][e];
            pv[e] = softmax_p_from_lse(x, scale_log2, e % 2 ? lse.y : lse.x);
            dv[e] = mask.softcap_grad_of(x, dist0 + (float)(nf * 8 + (e % 2) - 8 * (e / 2)));
            if constexpr (!CAP_PACKED) acc_s[nf][e] = dv[e];
          }
          put_p(nf, pv, dv);
        }
      } else {
#pragma unroll
        for (int nf = 0; nf < MF; ++nf) {
          const float2 lse = *reinterpret_cast<const float2*>(lse_s + nf * 8 + 2 * t);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float x = acc_s[nf][e];
            if (MOD == MOD_NONE && need_mask) x = mask.score_t(x, key_w, m0, nf, e, lane);
            acc_s[nf][e] = softmax_p_from_lse(x, scale_log2, e % 2 ? lse.y : lse.x);
          }
        }
        frags_to_a<T>(acc_s, pa);
      }

      // dV += P^T dO.
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < KM; ++k)
        Wgmma<DP>::template rs<T, 1>(acc_dv, pa[k], smem_desc(dos + k * 16 * 128, BLOCK_M * 128, 1024), 1);
      wgmma_commit();
      wgmma_wait<1>();  // dP^T done (dV may still run)
      reg_fence(acc_dp);

      // dS^T = P^T (dP^T - D), P from its 16-bit copy (the values dV uses).
#pragma unroll
      for (int nf = 0; nf < MF; ++nf) {
        const float2 dl = *reinterpret_cast<const float2*>(dl_s + nf * 8 + 2 * t);
        const float2 p01 = unpack2<T>(pa[nf / 2][(nf % 2) * 2]), p23 = unpack2<T>(pa[nf / 2][(nf % 2) * 2 + 1]);
        acc_dp[nf][0] = p01.x * (acc_dp[nf][0] - dl.x);
        acc_dp[nf][1] = p01.y * (acc_dp[nf][1] - dl.y);
        acc_dp[nf][2] = p23.x * (acc_dp[nf][2] - dl.x);
        acc_dp[nf][3] = p23.y * (acc_dp[nf][3] - dl.y);
      }
      if (cap) {  // the soft-cap's derivative, kept in acc_s or in smem (above)
#pragma unroll
        for (int nf = 0; nf < MF; ++nf) {
          if constexpr (CAP_PACKED) {
            const float2 d01 = unpack2<__half>(*cap_word(2 * nf)), d23 = unpack2<__half>(*cap_word(2 * nf + 1));
            acc_dp[nf][0] *= d01.x;
            acc_dp[nf][1] *= d01.y;
            acc_dp[nf][2] *= d23.x;
            acc_dp[nf][3] *= d23.y;
          } else {
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_dp[nf][e] *= acc_s[nf][e];
          }
        }
      }
      uint32_t dsa[KM][4];
      frags_to_a<T>(acc_dp, dsa);
      // dS^T -> smem buffer gi % 2, rows = keys (this consumer's 64 from row 64 cw), 64-query chunks, swizzled: the
      // lane's words of k16 step k are queries 16 k + 2t (+ 8), rows 16 warp + g (+ 8); r % 8 == g. Over the soft-cap
      // derivative's words (CAP_PACKED), once every lane of the warp has read its own. Both consumers' dQ of
      // iteration gi - 2, the buffer's last readers, completed before the named barrier of iteration gi - 1.
      if constexpr (MOD != MOD_NONE && CAP_PACKED) __syncwarp();
      if constexpr (TRANS_DQ) {
        // dS, K-major: [BLOCK_M queries, 128 keys] in 64-key chunks of BLOCK_M rows (this consumer's: chunk cw),
        // swizzled. dsa[k][j] is the 8 x 8 matrix of keys 16 warp + 8 (j % 2) + 0..7 x queries 16 k + 8 (j / 2) + 0..7;
        // stored transposed, its row c is query 16 k + 8 (j / 2) + c, the keys' 16-byte piece 2 warp + j % 2.
        const uint32_t dsb = ds_base + (gi % 2) * L::DS_BYTES + cw * BLOCK_M * 128;
        const int j = lane / 8, c = lane % 8;
#pragma unroll
        for (int k = 0; k < KM; ++k) {
          const int q = 16 * k + 8 * (j / 2) + c;  // q % 8 == c
          stmatrix_x4_trans(dsb + q * 128 + (((2 * warp + j % 2) ^ c) << 4), dsa[k]);
        }
      } else {
        unsigned char* dsb = MOD != MOD_NONE ? ds_buf : sm + L::DS_OFF + (gi % 2) * L::DS_BYTES;
#pragma unroll
        for (int k = 0; k < KM; ++k) {
          unsigned char* chunk = dsb + (k / 4) * BLOCK_N * 128;
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = 64 * cw + 16 * warp + g + 8 * (e % 2), piece = (2 * (k % 4) + e / 2) ^ g;
            *reinterpret_cast<uint32_t*>(chunk + r * 128 + piece * 16 + 4 * t) = dsa[k][e];
          }
        }
      }
      // dK += dS^T Q.
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < KM; ++k)
        Wgmma<DP>::template rs<T, 1>(acc_dk, dsa[k], smem_desc(qs + k * 16 * 128, BLOCK_M * 128, 1024), 1);
      wgmma_commit();
      fence_proxy_async_shared();  // the dS^T stores, before wgmma (the async proxy) reads them
      named_bar_sync(1, 256);      // both consumers' dS^T are in smem

      // dQ = dS K: A = dS [queries, keys] read MN-major from dS^T, B = K [keys, D] MN-major; 64 x 64 per consumer.
      float acc_dq[TRANS_DQ ? MF : 8][4];
      if constexpr (TRANS_DQ) {
        // dQ^T = K^T dS^T: A = K^T [this consumer's 64 head-dim columns, keys] read MN-major from K, B = dS^T read
        // K-major from dS [queries, keys] (the S^T product's B form); 64 x BLOCK_M per consumer.
        const uint32_t da = k_base + cw * BLOCK_N * 128, db = ds_base + (gi % 2) * L::DS_BYTES;
#pragma unroll
        for (int k = 0; k < KN; ++k)
          Wgmma<BLOCK_M>::template ss<T, 1, 0>(acc_dq, smem_desc(da + k * 16 * 128, BLOCK_N * 128, 1024),
                                               smem_desc(db + (k / 4) * BLOCK_M * 128 + (k % 4) * 32, 16, 1024),
                                               k > 0);
      } else {
        const uint32_t da = ds_base + (gi % 2) * L::DS_BYTES + (SPLIT_M ? cw * BLOCK_N * 128 : 0);
        const uint32_t db = k_base + (SPLIT_M ? 0 : cw * BLOCK_N * 128);
#pragma unroll
        for (int k = 0; k < KN; ++k)
          Wgmma<64>::template ss<T, 1, 1>(acc_dq, smem_desc(da + k * 16 * 128, BLOCK_N * 128, 1024),
                                          smem_desc(db + k * 16 * 128, BLOCK_N * 128, 1024), k > 0);
      }
      wgmma_commit();
      wgmma_wait<0>();  // dV, dK, dQ done: Q_i, dO_i, the P and dS fragments are free
      reg_fence(acc_dq);
      reg_fence(acc_dk);
      reg_fence(acc_dv);
      reg_fence(pa);
      reg_fence(dsa);
      mbar_arrive(&empty[s]);
      if constexpr (PERSIST) {
        if (it == total - 1) mbar_arrive(kv_empty);  // K and V are free for the block's next tile
      }

      // dQ -> the staging, once the writer has read the previous tile; then hand it over.
      mbar_wait(dq_empty, (gi & 1) ^ 1);
      if constexpr (TRANS_DQ) {  // the T80 layout (attn/bwd.cuh): band 4 cw + warp of the head dim, q block nf
#pragma unroll
        for (int nf = 0; nf < MF; ++nf)
          *reinterpret_cast<float4*>(dq_stage + ((4 * cw + warp) * MF + nf) * 128 + 4 * lane) =
              make_float4(acc_dq[nf][0], acc_dq[nf][1], acc_dq[nf][2], acc_dq[nf][3]);
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j)
          if (dq_f0 + j < D / 8)
            *reinterpret_cast<float4*>(dq_band + (dq_f0 + j) * 128) =
                make_float4(acc_dq[j][0], acc_dq[j][1], acc_dq[j][2], acc_dq[j][3]);
      }
      fence_proxy_async_shared();  // the stores, before the writer's bulk operation (the async proxy) reads them
      mbar_arrive(dq_full);
    }

    if constexpr (SK) {
      if (sm90_bwd_sk_part<DF>(p, part, acc_dk, acc_dv)) return;  // (a tail: the tile's dK, dV are the head's to store)
    }
    // dK = softmax_scale dK_w, dV_w: this warp's 16 keys, the inputs' head dim (one block per tile above head dim
    // 64: through shared memory and TMA; the persistent form, and head dim 64, whose 32 KB tile the 16-byte stores
    // wrote as fast: 16-byte stores -- bench/NOTES.md, "Hopper backward").
    if constexpr (PERSIST || D <= 64)
      store_dkdv_wide<T, D / 8>(p, si, batch, kv_head, key_w, 0, reinterpret_cast<const float(&)[D / 8][4]>(acc_dk),
                                reinterpret_cast<const float(&)[D / 8][4]>(acc_dv), lane);
    else {  // (the tile's coordinates derived again from blockIdx: none held across the loop)
      const int3 b = sm90_bwd_block<ORDER, GROUP>(block_idx_reread());
      sm90_bwd_store_dkdv_tma<T, D, BLOCK_N, CH>(p, maps, sm + L::K_OFF, sm + L::V_OFF, 0, acc_dk, acc_dv,
                                                 b.x * BLOCK_N, b.y, b.z, 64 * cw + 16 * warp + g, t,
                                                 threadIdx.x == 128);
    }
  });
}

// ---------------------------------------------------------------------------------------------------------------
// Head dim 256: the column-split form. dK and dV of 128 keys x 256 columns would take 2 x 128 fp32 per consumer
// thread, so the KV tile has BLOCK_N = 64 keys and the two consumer warpgroups split the columns instead: consumer c
// holds dK, dV of all 64 keys and columns [128 c, 128 c + 128) (2 x 64 registers per thread), and for each Q tile of
// BLOCK_M = 64 rows:
//   consumer 0:  S^T  = K Q^T   [64 keys, 64 queries]  wgmma, both operands in smem (N = 64: operand reads match the
//   consumer 1:  dP^T = V dO^T  [64 keys, 64 queries]  tensor pipe's rate; two N = 32 halves per consumer would not)
//   consumer 0:  P^T = exp2(S^T scale_log2 - lse_log2) -> smem, 16-bit (the P^T buffer); named barrier 1 (both)
//   both:        dV_c += P^T dO_c        wgmma, P^T from smem (K-major), dO's columns of c (MN-major)
//   consumer 1:  dS^T = P^T (dP^T - D)   P from the P^T buffer (the 16-bit values dV uses) -> the dS^T buffer;
//                named barrier 2 (both)
//   both:        dQ_c  = dS K_c          wgmma, dS read MN-major from dS^T, K's columns of c
//                dK_c += dS^T Q_c        wgmma, dS^T from smem
//                dQ_c -> the fp32 accumulator from registers, while dK's products run: one 16-byte reduction
//                (RED.E.ADD.F32x4) per thread and accumulator fragment, or with "seqpar" a 16-byte store into this KV
//                tile's buffer.
// There is no shared memory left for a dQ staging tile (K, V, 2 stages of Q and dO: 192 KB, P^T and dS^T double
// buffered: 32 KB), so there is no dQ writer warp: with "ordered" each consumer warp takes its own turn at the Q tile
// before its reductions -- lane 0 waits until the warp's semaphore (one per consumer warp: 8 per 64 accumulator rows)
// counts the KV tiles that add before this one, the warp adds, and lane 0 raises the semaphore after the warp's
// barrier (a release, cumulative: no fence per lane) -- so every accumulator element takes its additions in one fixed
// KV-tile order (bitwise reproducible). The turns are the 128-key kernel's: without a mask ascending (KV tile j after
// 0 .. j - 1, every block starting at Q tile 0) or DQ_ORDER_ROT's (block x at Q tile (x - s) mod M at step s,
// additions in (step, KV tile) order: rot_turn; only while a head's KV tiles are resident together, which the host
// checks), with the causal mask DQ_ORDER_KV_DESC's (the grid's KV tiles last first, each Q tile's additions from its
// last KV tile down) or on the heads-inner walk ascending. Under DQ_ORDER_ROT and DQ_ORDER_KV_DESC a Q tile's
// previous addition was made one step earlier, so the warp raises the semaphore a step late (LATE_RELEASE: under the
// next step's first product, or after the tile's last step), and the reductions complete under that work rather
// than in a fence. A warp waits only on the same warp of a block dispatched before its own (DQ_ORDER_ROT: or, at the
// wrap, on the head's last block, resident with it), and a late release only on its own block's next step (its
// stage, filled by its own producer; the first product, which its warpgroup's other warps issue once past their own
// turns); the first read of the semaphore runs under dQ's products, the waiting under dK's. Plain non-causal blocks
// of "atomic" and "seqpar" start their Q tiles at n_block % num_m (wrapping), so that the blocks of one head add into
// different accumulator tiles at a time; causal blocks start at their diagonal (ORDER = DQ_ORDER_HEADS_INNER: at the
// last Q tile, the group's query heads inner, as the 128-key kernel's).
// MOD_SCORE (window, soft-cap, ALiBi: attn/mask.cuh): consumer 0 applies them to S^T on the tiles that need it and
// hands the soft-cap's derivative to consumer 1 through the dS^T buffer.
// P^T and dS^T buffers: [64 keys, 64 queries] 16-bit, one 128-byte-swizzled chunk (the layout TMA writes), so that
// they are wgmma operands in both orientations. The buffer of iteration it is it % 2: its last readers, iteration
// it - 2's products, completed before both consumers passed iteration it - 1's barriers.
// PERSIST: the persistent form, as the 128-key kernel's (the iterations counted over the block's tiles, kv_empty
// before the next tile's K and V); SK: its stream-K form, as the 128-key kernel's.
template <int D, int STAGES, bool PERSIST = false>
struct Sm90BwdSplitLayout {
  static constexpr int BLOCK_N = 64, BLOCK_M = 64;
  static constexpr bool WARP_LOADS = false;  // (Sm90BwdLayout: the loads' thread 0 alone)
  static constexpr int DP = (D + 63) / 64 * 64;
  static constexpr int CH = DP / 64;
  static constexpr int KV_BYTES = BLOCK_N * DP * 2;
  static constexpr int Q_BYTES = BLOCK_M * DP * 2;
  static constexpr int PS_BYTES = BLOCK_N * BLOCK_M * 2;  // one P^T or dS^T buffer
  static constexpr int K_OFF = 0;
  static constexpr int V_OFF = K_OFF + KV_BYTES;
  static constexpr int Q_OFF = V_OFF + KV_BYTES;
  static constexpr int DO_OFF = Q_OFF + STAGES * Q_BYTES;
  static constexpr int PT_OFF = DO_OFF + STAGES * Q_BYTES;
  static constexpr int DS_OFF = PT_OFF + 2 * PS_BYTES;
  static constexpr int LSE_OFF = DS_OFF + 2 * PS_BYTES;
  static constexpr int DELTA_OFF = LSE_OFF + STAGES * BLOCK_M * 4;
  static constexpr int BAR_OFF = DELTA_OFF + STAGES * BLOCK_M * 4;
  static constexpr int BARS = 1 + 2 * STAGES + PERSIST;  // K/V; full, empty per stage; kv_empty
  static constexpr int BYTES = BAR_OFF + BARS * 8 + 1024;
};

template <typename T, int D, int STAGES, bool CAUSAL, int REGS_MMA, int REGS_LOAD, int SMEM_BYTES, int MOD = MOD_NONE,
          int GROUP = 0, bool PERSIST = false, bool SK = false, int ORDER = DQ_ORDER_PLAIN>
__global__ void __launch_bounds__(384, 1)
    flash_bwd_sm90_split_kernel(const __grid_constant__ BwdParams p, const __grid_constant__ Sm90BwdMaps maps) {
  using L = Sm90BwdSplitLayout<D, STAGES, PERSIST>;
  constexpr int BLOCK_N = L::BLOCK_N, BLOCK_M = L::BLOCK_M, DP = L::DP;
  constexpr int KM = BLOCK_M / 16;   // k16 steps over the Q rows (dV, dK)
  constexpr int KN = BLOCK_N / 16;   // k16 steps over the keys (dQ)
  constexpr int MF = BLOCK_M / 8;    // n8 blocks of S^T, dP^T along the Q rows
  constexpr int HD = DP / 2;         // a consumer's columns
  constexpr int HF = HD / 8;         // n8 blocks of them (dK, dV, dQ)
  static_assert(DP == 256 && D % 16 == 0, "the column-split form: head dim 256");
  static_assert(128 * (REGS_LOAD + 2 * REGS_MMA) <= 65536 / (384 * 8) * 8 * 384 && REGS_MMA % 8 == 0 &&
                    REGS_LOAD % 8 == 0,
                "setmaxnreg register counts");
  static_assert(SMEM_BYTES == L::BYTES, "host smem size must match the layout");
  static_assert(GROUP >= 0 && (GROUP == 0 || (CAUSAL && MOD == MOD_NONE && !PERSIST && ORDER != DQ_ORDER_KV_DESC)),
                "GROUP: the causal kernels only (the persistent form walks the launch's order)");
  static_assert(MOD == MOD_NONE || MOD == MOD_SCORE, "MOD: none or MOD_SCORE (dropout runs on the sm80 kernels)");
  static_assert(!SK || (PERSIST && !CAUSAL && MOD == MOD_NONE), "SK: the persistent form without a mask");
  static_assert(ORDER == DQ_ORDER_PLAIN ||
                    ((ORDER == DQ_ORDER_HEADS_INNER || ORDER == DQ_ORDER_KV_DESC) == CAUSAL &&
                     (ORDER == DQ_ORDER_HEADS_INNER || ORDER == DQ_ORDER_KV_DESC || ORDER == DQ_ORDER_ROT) &&
                     MOD == MOD_NONE && !PERSIST),
                "ORDER: DQ_ORDER_PLAIN, DQ_ORDER_HEADS_INNER / DQ_ORDER_KV_DESC (causal) or DQ_ORDER_ROT (no mask); "
                "no modifiers, one block per tile");
  // "ordered"'s turns: not in the kernels the host never runs it on (the modifier kernels, the persistent form, the
  // grouped dispatch order's but for the heads-inner walk)
  constexpr bool ORDERED = MOD == MOD_NONE && !PERSIST && (GROUP == 0 || ORDER == DQ_ORDER_HEADS_INNER);

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* sm = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  uint64_t* bar_kv = reinterpret_cast<uint64_t*>(sm + L::BAR_OFF);
  uint64_t* full = bar_kv + 1;
  uint64_t* empty = full + STAGES;
  uint64_t* kv_empty = empty + STAGES;  // PERSIST: the consumers are done with the tile's K and V

  // the launch's tile (one block per tile; PERSIST: Sm90BwdTiles' walk, each role in sm90_bwd_for_tiles)
  const int3 blk1 = PERSIST ? make_int3(0, 0, 0) : sm90_bwd_block<ORDER, GROUP>(blockIdx);
  const int n0_1 = blk1.x * BLOCK_N;
  const SeqInfo si = seqinfo_fixed(p);
  const int group = (int)p.heads_per_kv;
  const Mask<CAUSAL, MOD> band = si.band<CAUSAL, MOD>(p);
  const int2 qr1 = PERSIST ? make_int2(0, 0) : sm90_bwd_q_tiles<BLOCK_M, BLOCK_N>(band, si, n0_1);  // its Q tiles
  const int total1 = group * qr1.y;
  // a tile's first Q tile, plain non-causal: its KV tile's index modulo its Q tiles, so that the blocks of one head
  // add into different accumulator tiles at a time ("ordered": Q tile 0, its turns' order)
  auto rot_of = [&](int n_block, int num_m) {
    return CAUSAL || MOD != MOD_NONE || num_m == 0 || (ORDERED && p.dq_strategy == DQ_ORDERED) ? 0 : n_block % num_m;
  };
  const int rot1 = rot_of(blk1.x, qr1.y);
  const int wg = threadIdx.x / 128;

  if (threadIdx.x == 0) {
    mbar_init(bar_kv, 1);
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 256);
    }
    if constexpr (PERSIST) mbar_init(kv_empty, 256);  // every consumer thread, after its tile's last products
    fence_barrier_init();
  }
  __syncthreads();

  if (wg == 0) {  // ------------------------------------------------------------------------------ producer
    setmaxnreg_dec<REGS_LOAD>();
    if (threadIdx.x == 0 && (PERSIST || total1 > 0))
      sm90_bwd_produce<L, BLOCK_M, STAGES, ORDER, !CAUSAL && MOD == MOD_NONE, PERSIST, SK>(
          p, maps, sm, bar_kv, full, empty, kv_empty, si, band, group, blk1, qr1, rot1, rot_of);
    return;
  }

  // ------------------------------------------------------------------------------------------------ consumers
  setmaxnreg_inc<REGS_MMA>();
  const Mask<CAUSAL, MOD> mask_kv1 = si.mask<CAUSAL, MOD>(p, blk1.z, blk1.y * group);
  const int cw = __shfl_sync(0xffffffffu, wg - 1, 0);  // warp-uniform: the role and the columns [HD cw, +HD)
  const int tid = threadIdx.x % 128, lane = tid % 32;
  const int warp = __shfl_sync(0xffffffffu, tid / 32, 0);
  const int g = lane / 4, t = lane % 4;
  const int key_w1 = n0_1 + 16 * warp;
  const float scale_log2 = (float)p.scale_log2;
  const uint32_t k_base = smem_addr(sm + L::K_OFF), v_base = smem_addr(sm + L::V_OFF);
  const uint32_t q_base = smem_addr(sm + L::Q_OFF), do_base = smem_addr(sm + L::DO_OFF);
  const uint32_t pt_base = smem_addr(sm + L::PT_OFF), ds_base = smem_addr(sm + L::DS_OFF);
  const bool seqpar = p.dq_strategy == DQ_SEQPAR;
  const bool ordered = ORDERED && p.dq_strategy == DQ_ORDERED;
  int* const sem = reinterpret_cast<int*>(p.dq_accum + bwd_ws_rows(p, false) * D);  // "ordered" (attn/bwd.cuh)
  // "ordered": where a Q tile's previous KV tile added one step before this one (DQ_ORDER_ROT, DQ_ORDER_KV_DESC), the
  // warp raises its semaphore one step late -- under the next step's first product, or after the tile's last step --
  // so that its reductions complete under that work instead of in a fence; where it added at the same step (the
  // ascending turns) the next one waits on it, and the warp raises it once its reductions are done.
  constexpr bool LATE_RELEASE = ORDER == DQ_ORDER_ROT || ORDER == DQ_ORDER_KV_DESC;
  // The release: the warp's reductions before lane 0's release (the warp barrier, then the release's cumulativity).
  auto raise = [&](int* at) {
    __syncwarp();
    if (lane == 0) red_release_gpu_add(at, 1);
  };

  sm90_bwd_for_tiles<PERSIST, SK, BLOCK_M, BLOCK_N>(
      p, si, band, group, blk1, qr1,
      [&](const int3& blk, const int2& qr, int it0, int tile_j, int i0, int i1, int part) {
    const int n_block = blk.x, kv_head = blk.y, batch = blk.z, m_begin = qr.x, num_m = qr.y;
    const int n0 = n_block * BLOCK_N, total = i1 - i0;
    const int rot = PERSIST ? rot_of(n_block, num_m) : rot1;
    const Mask<CAUSAL, MOD> mask_kv = PERSIST ? si.mask<CAUSAL, MOD>(p, batch, kv_head * group) : mask_kv1;
    const int key_w = PERSIST ? n0 + 16 * warp : key_w1;  // the warp's rows of S^T / dP^T: keys key_w + g (+ 8)
    float acc_dk[HF][4], acc_dv[HF][4];
    zero_frags(acc_dk);
    zero_frags(acc_dv);

    if (total > 0) mbar_wait(bar_kv, tile_j & 1);
    int* held = nullptr;  // LATE_RELEASE: the semaphore of the warp's last reductions, not yet raised
    QTileWalk<!CAUSAL && MOD == MOD_NONE> walk;
    walk.h = i0 / num_m;  // (i0: a stream-K segment's first iteration)
    walk.m = i0 - walk.h * num_m;
    for (int it = 0; it < total; ++it) {
      const int gi = it0 + it;  // the iteration's place in the block's stage ring and P^T / dS^T buffers
      const int s = gi % STAGES, ph = (gi / STAGES) & 1;
      const int2 hm = walk.template step<ORDER>(num_m, rot, group);
      const int hq = kv_head * group + hm.x;
      const int m0 = q_tile_at<ORDER>(m_begin, num_m, hm.y, rot_of_tile<ORDER>(n_block, num_m)) * BLOCK_M;
      const uint32_t qs = q_base + s * L::Q_BYTES, dos = do_base + s * L::Q_BYTES;
      const uint32_t pt = pt_base + (gi % 2) * L::PS_BYTES, ds = ds_base + (gi % 2) * L::PS_BYTES;
      unsigned char* const pt_buf = sm + L::PT_OFF + (gi % 2) * L::PS_BYTES;
      unsigned char* const ds_buf = sm + L::DS_OFF + (gi % 2) * L::PS_BYTES;
      mbar_wait(&full[s], ph);

      // S^T = K Q^T (consumer 0) or dP^T = V dO^T (consumer 1): [64 keys, 64 queries].
      float acc[MF][4];
      wgmma_fence();
      wgmma_ss_over_d<T, BLOCK_M, BLOCK_N, BLOCK_M, DP>(acc, cw ? v_base : k_base, cw ? dos : qs);
      wgmma_commit();
      if (LATE_RELEASE && held) {  // (warp-uniform) the previous step's reductions, long issued
        raise(held);
        held = nullptr;
      }
      wgmma_wait<0>();
      reg_fence(acc);
      // The word of fragment element pair (nf, h) (h = e / 2: rows g, g + 8) in a P^T / dS^T buffer: row r = 16 warp
      // + g + 8 h (a key), queries 8 nf + 2t, + 1 (16-byte piece nf, swizzled by r % 8 = g).
      auto word = [&](unsigned char* buf, int nf, int h) {
        return reinterpret_cast<uint32_t*>(buf + (16 * warp + g + 8 * h) * 128 + ((nf ^ g) * 16) + 4 * t);
      };
      const float* lse_s = reinterpret_cast<const float*>(sm + L::LSE_OFF) + s * BLOCK_M;
      const float* dl_s = reinterpret_cast<const float*>(sm + L::DELTA_OFF) + s * BLOCK_M;
      // With the soft-cap (MOD_SCORE, uniform), consumer 0 also keeps each element's derivative 1 - tanh^2
      // (softcap_grad_of: from its value, no MUFU) as 16-bit pairs in the dS^T buffer, at the words consumer 1's thread
      // of the same warp and lane reads and then overwrites with dS^T (values in [0, 1]: 2^-12 absolute, below the
      // 16-bit dS they multiply).
      const Mask<CAUSAL, MOD> mask =
          MOD == MOD_NONE || group == 1 ? mask_kv : mask_kv.with_alibi(SeqInfo::alibi_slope(p, batch, hq));
      bool cap = false;
      if constexpr (MOD != MOD_NONE) cap = mask.softcap();
      if (cw == 0) {  // P^T, masked where some element of the [64 keys, 64 rows] tile is hidden (uniform)
        const bool need_mask = mask.needs_mask(m0, m0 + BLOCK_M - 1, n0, n0 + BLOCK_N - 1);
        if constexpr (MOD != MOD_NONE) {
          if (need_mask) mask.apply_t(acc, key_w, m0, lane);
        }
        const float dist0 = MOD != MOD_NONE ? mask.dist_of(m0 + 2 * t, key_w + g) : 0.f;
#pragma unroll
        for (int nf = 0; nf < MF; ++nf) {
          const float2 lse = *reinterpret_cast<const float2*>(lse_s + nf * 8 + 2 * t);
          float pv[4], dv[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float x = acc[nf][e];
            if (MOD == MOD_NONE && need_mask) x = mask.score_t(x, key_w, m0, nf, e, lane);
            pv[e] = softmax_p_from_lse(x, scale_log2, e % 2 ? lse.y : lse.x);
            if constexpr (MOD != MOD_NONE)
              dv[e] = mask.softcap_grad_of(x, dist0 + (float)(nf * 8 + (e % 2) - 8 * (e / 2)));
          }
          *word(pt_buf, nf, 0) = pack2<T>(pv[0], pv[1]);
          *word(pt_buf, nf, 1) = pack2<T>(pv[2], pv[3]);
          if (cap) {
            *word(ds_buf, nf, 0) = pack2<__half>(dv[0], dv[1]);
            *word(ds_buf, nf, 1) = pack2<__half>(dv[2], dv[3]);
          }
        }
        fence_proxy_async_shared();  // the P^T stores, before wgmma (the async proxy) reads them
      }
      named_bar_sync(1, 256);  // P^T in smem (and dP^T in consumer 1's registers)

      // dV_c += P^T dO_c.
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < KM; ++k)
        Wgmma<HD>::template ss<T, 0, 1>(acc_dv, smem_desc(pt + k * 32, 16, 1024),
                                        smem_desc(dos + 2 * cw * BLOCK_M * 128 + k * 16 * 128, BLOCK_M * 128, 1024), 1);
      wgmma_commit();

      if (cw == 1) {  // dS^T = P^T (dP^T - D) (times the soft-cap's derivative), under dV's products
#pragma unroll
        for (int nf = 0; nf < MF; ++nf) {
          const float2 dl = *reinterpret_cast<const float2*>(dl_s + nf * 8 + 2 * t);
          const float2 p01 = unpack2<T>(*word(pt_buf, nf, 0)), p23 = unpack2<T>(*word(pt_buf, nf, 1));
          float2 c01 = make_float2(1.f, 1.f), c23 = c01;
          if (cap) {
            c01 = unpack2<__half>(*word(ds_buf, nf, 0));
            c23 = unpack2<__half>(*word(ds_buf, nf, 1));
          }
          *word(ds_buf, nf, 0) = pack2<T>(p01.x * (acc[nf][0] - dl.x) * c01.x, p01.y * (acc[nf][1] - dl.y) * c01.y);
          *word(ds_buf, nf, 1) = pack2<T>(p23.x * (acc[nf][2] - dl.x) * c23.x, p23.y * (acc[nf][3] - dl.y) * c23.y);
        }
        fence_proxy_async_shared();
      }
      named_bar_sync(2, 256);  // dS^T in smem

      // dQ_c = dS K_c (A = dS^T read MN-major, B = K's columns of c, MN-major), then dK_c += dS^T Q_c: dQ's
      // reductions are issued while dK's products run.
      float acc_dq[HF][4];
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < KN; ++k)
        Wgmma<HD>::template ss<T, 1, 1>(acc_dq, smem_desc(ds + k * 16 * 128, BLOCK_N * 128, 1024),
                                        smem_desc(k_base + 2 * cw * BLOCK_N * 128 + k * 16 * 128, BLOCK_N * 128, 1024),
                                        k > 0);
      wgmma_commit();
#pragma unroll
      for (int k = 0; k < KM; ++k)
        Wgmma<HD>::template ss<T, 0, 1>(acc_dk, smem_desc(ds + k * 32, 16, 1024),
                                        smem_desc(qs + 2 * cw * BLOCK_M * 128 + k * 16 * 128, BLOCK_M * 128, 1024), 1);
      wgmma_commit();
      // "ordered": the warp's turn at the Q tile (its own semaphore of the tile's eight), first read under dQ's
      // products.
      int* sem_at = nullptr;
      int turn = 0, seen = 0;
      if (ordered) {
        turn = dq_ordered_turn<ORDER, BLOCK_M, BLOCK_N>(band, n_block, m0, (int)gridDim.x, num_m);
        sem_at = sem + (((int64_t)batch * p.nheads + hq) * p.seqlen_q_pad + m0) / DQ_ORDERED_ROWS_PER_SEM + 4 * cw +
                 warp;
        if (lane == 0) seen = ld_acquire_gpu(sem_at);
      }
      wgmma_wait<1>();  // dV, dQ done (dK may still run)
      reg_fence(acc_dq);

      // dQ_c: this warp's 16 rows, n8 blocks [HF cw, HF cw + HF) of the accumulator (attn/bwd.cuh's layout); one
      // 16-byte reduction (RED.E.ADD.F32x4) per thread and fragment, or with "seqpar" a 16-byte store into this KV
      // tile's buffer. "ordered": after the warp's turn; the semaphore raised once the reductions are done (now, or
      // LATE_RELEASE's step later), so that the next KV tile's same warp adds after them.
      float* band_dq = dq_accum_band<D, false>(p, n_block, si, batch, hq, m0 + 16 * warp, lane) + 128 * HF * cw;
      if (ordered) {
        if (lane == 0) {
          while (seen != turn) seen = ld_acquire_gpu(sem_at);
        }
        __syncwarp();
      }
#pragma unroll
      for (int j = 0; j < HF; ++j) {
        float4* dst = reinterpret_cast<float4*>(band_dq + 128 * j);
        const float4 v = make_float4(acc_dq[j][0], acc_dq[j][1], acc_dq[j][2], acc_dq[j][3]);
        if (seqpar)
          *dst = v;
        else
          atomicAdd(dst, v);
      }
      if (ordered) {
        if (LATE_RELEASE)
          held = sem_at;
        else
          raise(sem_at);
      }
      wgmma_wait<0>();  // dK done: stage s, the P^T and dS^T buffers are free
      reg_fence(acc_dk);
      reg_fence(acc_dv);
      mbar_arrive(&empty[s]);
      if constexpr (PERSIST) {
        if (it == total - 1) mbar_arrive(kv_empty);  // K and V are free for the block's next tile
      }
    }

    if (LATE_RELEASE && held) raise(held);  // the tile's last reductions
    if constexpr (SK) {
      if (sm90_bwd_sk_part<HF>(p, part, acc_dk, acc_dv)) return;  // (a tail: the tile's dK, dV are the head's to store)
    }
    // dK = softmax_scale dK_c, dV_c: this warp's 16 keys, columns [HD cw, +HD) of the inputs' head dim (one block
    // per tile: through shared memory and TMA, the consumer's chunks from 2 cw; the persistent form: 16-byte stores).
    if constexpr (PERSIST)
      store_dkdv_wide<T, HF>(p, si, batch, kv_head, key_w, HD * cw, acc_dk, acc_dv, lane);
    else
      sm90_bwd_store_dkdv_tma<T, HD, BLOCK_N, L::CH>(p, maps, sm + L::K_OFF, sm + L::V_OFF, (HD / 64) * cw, acc_dk,
                                                     acc_dv, n0, kv_head, batch, 16 * warp + g, t,
                                                     threadIdx.x == 128);
  });
}

}  // namespace cuflash
