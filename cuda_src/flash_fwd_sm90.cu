// cuda_src/flash_fwd_sm90.cu -- the Hopper forward (sm_90a): warp-specialized, TMA-fed, wgmma FlashAttention.
//
// One thread block per (Q tile of BLOCK_M = 64 NWG rows, head, batch), 1 + NWG warpgroups of 128 threads:
//
//   warpgroup 0, the producer (setmaxnreg.dec to REGS_LOAD; one thread issues everything):
//     Q tile -> smem by TMA, once;  for each KV tile, last first:  wait until stage s is free (empty_k / empty_v),
//     then K_j -> stage s and V_j -> stage s by TMA, each completing on its full_k / full_v mbarrier.
//   warpgroups 1..NWG, the consumers (setmaxnreg.inc to REGS_MMA), 64 query rows each:
//     S   = Q K_j^T          wgmma, Q and K_j both in shared memory (K-major)      [64, BLOCK_N] fp32
//     the online softmax of cuda_src/attn/softmax.cuh on S, which wgmma leaves in the m16n8 C layout of mma.sync
//       (row max, lazy re-scaling, P = exp2(S scale_log2 - m): one FFMA + one MUFU.EX2 per score), masked by
//       attn/mask.cuh on the tiles where some element is hidden (the last tile and the causal diagonal)
//     O  += P V_j            wgmma, P from registers (the A fragment: no smem trip), V_j in smem (MN-major)
//     and at the end O / l -> the warpgroup's own Q rows in smem -> 16-byte stores; LSE = (m + log2 l) ln 2.
//   Causal or windowed, a consumer warpgroup takes no product for the KV tiles hidden from all of its 64 rows (with
//   192-row Q tiles up to two at each band edge): it takes their turns empty and releases their stages.
//
// Overlap. The tensor cores run while the softmax does: each step issues the next tile's S = Q K^T together with
// the current O += P V and runs the softmax of the new S under that product (the O re-scaling it implies waits for
// the product: OnlineSoftmax::rescale_sum / rescale_o; issuing S, softmax and P V one after another measured 10-15%
// slower, bench/NOTES.md); PINGPONG hands the tensor cores from one consumer warpgroup to the next through named
// barriers, each warpgroup issuing its products in its turn, so one warpgroup's softmax runs under another's.
//
// Shared memory (cuda_src/common/sm90.cuh for the swizzled tile layout): Q [BLOCK_M, DP], STAGES x K [BLOCK_N, DP],
// STAGES x V [BLOCK_N, DP], then the mbarriers. DP = D rounded up to 64 (one 128-byte box per 64 columns): the
// columns past D read as zeros (TMA fills them), add nothing to S and give O columns that are never stored.
//
// Scheduling: one block per Q tile, the heaviest causal tiles first (grid order as the sm80 forward's); or, with
// PERSIST, a grid of at most MINB blocks per SM, each walking Q tiles (the persistent form, below).
//
// The persistent form (PERSIST; taken at head dims 64 and 128 by key count: cuflash/_configs.py, bench/NOTES.md
// "Hopper forward"). It hides what one block per Q tile leaves exposed, most where a block runs few KV tiles: the
// prologue (barrier set-up, the Q load and first K load before the first product) and the epilogue (O / l, the O
// store, the wait for the store's reads). The tiles are walked in a fixed order (Sm90FwdTiles): a (batch, head)'s
// tiles, the heaviest causal tile first, or the (batch, head)s in groups, every member's heaviest tile first, then
// the next. They are handed out in fixed waves -- block `bid` of G takes tiles bid, 2G - 1 - bid, 2G + bid, ...,
// every other wave in reverse, so that a block's causal tiles alternate heavy and light -- or, the dynamic walk,
// by a counter in device memory that each block's producer draws from as its block frees up (Sm90FwdWalk), which
// balances the causal work to about one tile whatever G is. The barriers are set
// up once; the producer runs ahead across tiles: the K/V ring is one stream over all of a block's tiles (stage and
// phase from a running count), and Q has two buffers, each with a full (bar_q) and an empty (empty_q) mbarrier, so
// tile t + 1's Q and first K/V stages load while the consumers finish tile t. Hazards: the epilogue stages O in
// the warpgroup's rows of its tile's Q buffer (as the one-tile form does), so that buffer is released (empty_q:
// every consumer thread arrives) only after the O store has read it -- the 16-byte stores' own loads, or the TMA
// store's reads (its issuing thread waits for them, `cp.async.bulk.wait_group.read`, at the next tile's first
// product, out of the way of the epilogue); with PINGPONG the last consumer's last turn of a tile opens the first
// turn of the next (a tile with no KV tile has no turns and passes the opening on), so the tensor cores go on to
// the next tile during its epilogue, and consumer 0 takes the one opening left over after the last tile. A tile
// whose rows see no key (n_iters = 0) takes a Q buffer without a load (bar_q completes by a plain arrive) and
// stores O = 0, LSE = -inf; a packed tile past its element's rows is passed over by the producer. The producer
// tells the consumers which tile a Q buffer holds through shared memory (tile_of), and an index past the tiles ends
// their walk.
//
// Template parameters (cuflash/_configs.py: SM90_FWD_TILES, the source of truth):
//   T                 __half or __nv_bfloat16;   D  head dim (multiple of 16)
//   BLOCK_N           keys per KV tile (multiple of 16, <= 256);   NWG  consumer warpgroups (BLOCK_M = 64 NWG)
//   STAGES            K/V shared-memory stages;   CAUSAL  bottom-right aligned causal mask
//   REGS_MMA, REGS_LOAD  setmaxnreg register counts of the consumer / producer warpgroups
//                     (128 (REGS_LOAD + NWG REGS_MMA) <= the launch allocation: 65536 with MINB = 1)
//   PINGPONG          the turn-taking above;   SMEM_BYTES  dynamic shared memory the host reserves
//   MOD               MOD_SCORE: window band, soft-cap and ALiBi from the parameter block (attn/mask.cuh);
//                     MOD_SCORE_DROPOUT: with dropout (attn/dropout.cuh): the accumulator of S = Q K^T is the
//                     m16n8 layout stacked along N (rows g, g + 8 of the warp's 16, columns 2t, 2t + 1 of each n8
//                     block), so the mma.sync forward's Philox groups apply as they are and the kernels drop the
//                     same elements; P zeroed where dropped before O += P V, O scaled by 1 / (1 - p)
//   O_TMA             the epilogue's store through a TMA tensor store of O's map (Sm90FwdMapsO) instead of the
//                     threads' 16-byte stores, on the warpgroup tiles TMA can clip (see the epilogue); off by default
//   MINB              blocks per SM the launch bounds ask for (__launch_bounds__'s second argument): the launch
//                     allocation is 65536 / (MINB threads) registers per thread, rounded down to a multiple of 8, which
//                     REGS_LOAD + NWG REGS_MMA must fit; 2: short blocks whose prologue and epilogue run under another
//                     block's main loop (the smem of MINB blocks must fit the SM too: cuflash/_configs.py checks it);
//                     1 by default
//   PERSIST           the persistent form above (no dropout; with MOD_SCORE its tiles walked heaviest first, as
//                     causal ones); false by default
//   SK                the persistent form without a mask, able to walk by stream-K (Sm90FwdStreamK) when the host
//                     passes a workspace (p.o_accum); false by default (a kernel of its own: carrying stream-K's code
//                     measured 1-3% slower on the fixed walk, bench/NOTES.md)
//   CAP_MAX           MOD_SCORE: on tiles where the soft-cap is the only change (Mask::cap_only), the row max taken
//                     of the raw scores and capped once (OnlineSoftmax::update_max_capped) rather than of the capped
//                     scores after Mask::apply; false by default (the configured modifier kernels at head dims
//                     in SM90_FWD_CAP_MAX_HEADDIMS set it: Sm90FwdTile.cap_max, cuflash._configs)
#include "common/ptx.cuh"
#include "common/sm90.cuh"
#include "common/wgmma.cuh"
#include "common/warp_gemm.cuh"
#include "attn/params.cuh"
#include "attn/seqlen.cuh"
#include "attn/mask.cuh"
#include "attn/block.cuh"
#include "attn/softmax.cuh"
#include "attn/dropout.cuh"

namespace cuflash {

// The tensor maps of Q, K and V: 4-d [batch, seqlen, heads, D] views (innermost D), boxes of 64 columns by
// BLOCK_M (Q) or BLOCK_N (K, V) rows, 128-byte swizzle (cuflash/_tma.py encodes them).
struct Sm90FwdMaps {
  TmaDesc q, k, v;
};
// O_TMA: O's map too ([batch, seqlen_q, heads, head_dim] as the kernel stores it, boxes of 64 columns by 64 rows: one
// consumer warpgroup's rows; columns past head_dim and rows past the map's seqlen are clipped). The default kernels
// keep Sm90FwdMaps: their parameter block is unchanged.
struct Sm90FwdMapsO : Sm90FwdMaps {
  TmaDesc o;
};
template <bool O_TMA>
struct Sm90FwdMapsOf {
  using type = Sm90FwdMaps;
};
template <>
struct Sm90FwdMapsOf<true> {
  using type = Sm90FwdMapsO;
};

// QBUF Q buffers: 1, or 2 in the persistent form (the next tile's Q loads while the current one's runs).
template <int D, int BLOCK_N, int NWG, int STAGES, int QBUF = 1>
struct Sm90FwdLayout {
  static constexpr int DP = (D + 63) / 64 * 64;  // columns in smem: whole 64-column (128-byte) chunks
  static constexpr int CH = DP / 64;
  static constexpr int BLOCK_M = 64 * NWG;
  static constexpr int Q_BYTES = BLOCK_M * DP * 2;
  static constexpr int KV_BYTES = BLOCK_N * DP * 2;  // one stage of K (or of V)
  static constexpr int Q_OFF = 0;
  static constexpr int K_OFF = Q_OFF + QBUF * Q_BYTES;
  static constexpr int V_OFF = K_OFF + STAGES * KV_BYTES;
  static constexpr int BAR_OFF = V_OFF + STAGES * KV_BYTES;
  // full Q per buffer; full_k, full_v, empty_k, empty_v per stage; with two buffers, empty Q per buffer
  static constexpr int BARS = QBUF + 4 * STAGES + (QBUF > 1 ? QBUF : 0);
  // with two buffers, each buffer's tile index (int32: the persistent form's producer tells the consumers which tile
  // a buffer holds)
  static constexpr int TILE_OFF = BAR_OFF + BARS * 8;
  static constexpr int BYTES = TILE_OFF + (QBUF > 1 ? 8 : 0) + 1024;  // + the slack that aligns the base to 1024
};

// The persistent form's tiles: a linear index t over x (a (batch, head)'s Q tiles, or, packed, every element's tiles
// as the one-tile grid's x: attn/seqlen.cuh) and (batch, head), each (batch, head)'s heaviest tile first -- causal,
// x from the last down (as fwd_block_coords); without a mask, x from the first up (a ragged last tile's warpgroups
// past seqlen_q take their turns empty, so it is the lightest) -- and the (batch, head)s taken in groups of
// p.walk_group: group after group, and inside a group every member's heaviest tile, then the next, ... So group 1
// ("qtile") runs a (batch, head)'s tiles together (their K/V shared through L2); a group of every (batch, head)
// ("bh", fixed lengths) deals the causal tiles out in order of decreasing work, at the cost of every head's K/V in
// L2 at once; groups between keep the K/V of a group's heads in L2 and deal each group's tiles out heaviest first
// (the host picks: cuflash/_configs.py, sm90_persist_walk).
// Handing out, fixed (p.walk_slot < 0): block bid of G takes tile k G + bid of wave k for even k and k G + G - 1 -
// bid for odd k -- with "qtile" and G a multiple of the x tiles a block's causal tiles pair heavy with light
// exactly, and nearly so otherwise; with "bh" the alternating waves bound the spread of the blocks' work by about
// one tile. Dynamic (p.walk_slot >= 0, Sm90FwdWalk): block bid takes tile bid first and then whichever tile the
// counter gives it as it frees up, so a block that drew light tiles draws more (greedy list scheduling of tiles in
// decreasing work within each group).
template <int BLOCK_M, bool CAUSAL>
struct Sm90FwdTiles {
  int x_tiles, count;
  __device__ __forceinline__ Sm90FwdTiles(const FwdParams& p, bool varlen)
      : x_tiles(varlen ? (int)(p.seqlen_q / BLOCK_M + p.batch) : (int)((p.seqlen_q + BLOCK_M - 1) / BLOCK_M)),
        count(x_tiles * (int)(p.nheads * (varlen ? 1 : p.batch))) {}
  __device__ __forceinline__ int tile(int k) const {  // the fixed walk: this block's tile of wave k (none: >= count)
    const int g = (int)gridDim.x;
    return k * g + ((k & 1) ? g - 1 - (int)blockIdx.x : (int)blockIdx.x);
  }
  __device__ __forceinline__ FwdBlock coords(const FwdParams& p, int t, bool varlen) const {
    FwdBlock c;
    // (the (batch, head)s and the group size taken from the parameter block here rather than held: the producer
    // runs on few registers)
    const int bhs = (int)(p.nheads * (varlen ? 1 : p.batch)), group = max(1, min((int)p.walk_group, bhs));
    const int first = t / (x_tiles * group) * group;  // the group's first (batch, head)
    const int size = min(group, bhs - first), within = t - first * x_tiles;
    // (the heaviest tile first: causal the last, which sees the most keys; without a mask the first, as a last
    // tile past seqlen_q's multiple of BLOCK_M has warpgroups without rows, which take their turns empty)
    const int x = CAUSAL ? x_tiles - 1 - within / size : within / size, bh = first + within % size;
    if (varlen) {
      const int2 bt = varlen_tile<BLOCK_M>(p.cu_seqlens_q, (int)p.batch, x);
      c.batch = bt.x;
      c.m_block = bt.y;
      c.head = bh;
    } else {
      c.m_block = x;
      c.head = bh % (int)p.nheads;
      c.batch = bh / (int)p.nheads;
    }
    c.split = 0;
    return c;
  }
};

// The dynamic walk's tile counters: a pair per slot (the host hands slots out, cuflash/_walk.py: one per stream, and
// one of its own to each launch captured into a CUDA graph, so that no two launches that may overlap share one),
// zero at module load and left zero by every launch: [0] tiles handed out past the first wave, [1] blocks done.
constexpr int SM90_WALK_SLOTS = 8192;
__device__ unsigned int sm90_walk_counters[SM90_WALK_SLOTS][2];

// One launch's counter pair (used by the producer thread alone; its address taken from the parameter block at each
// use: the producer runs on few registers).
struct Sm90FwdWalk {
  const FwdParams& p;
  __device__ __forceinline__ bool dynamic() const { return p.walk_slot >= 0; }
  // (the slot through a volatile move: its address is then made at each use, not held through the producer's loop)
  __device__ __forceinline__ unsigned int* pair() const {
    return sm90_walk_counters[opaque((int)p.walk_slot) % SM90_WALK_SLOTS];
  }
  // The block's tile of its k-th draw: its own index first, then the counter's next (past the first wave).
  __device__ __forceinline__ int draw(int k) const {
    // (the counter's value through a shuffle of the one lane: the compiler then keeps the tile's coordinates, as it
    // does those of a fixed walk's tile, in uniform registers, and the producer's few registers hold the rest)
    return k == 0 ? (int)blockIdx.x : (int)gridDim.x + __shfl_sync(1u, (int)atomicAdd(pair(), 1u), 0);
  }
  // After the block's last draw (an index past the tiles): the block that finishes last sets both counters back to
  // zero. Every block's draws come before its count (the fence orders them), so the last to count comes after every
  // draw of the launch; the next launch on the slot starts after this one ends (stream order, or a graph's order).
  __device__ __forceinline__ void finish() const {
    __threadfence();
    if (atomicAdd(pair() + 1, 1u) == gridDim.x - 1) {
      atomicExch(pair(), 0u);
      atomicExch(pair() + 1, 0u);
    }
  }
};

// Stream-K (the SK kernels: without a mask, fixed lengths; p.o_accum: the launch's workspace, cuflash/_walk.py; null:
// the fixed walk). With C tiles of n
// KV tiles each on G blocks and C no multiple of G, whole tiles leave the last wave part empty. Here the first
// W = C / G - 1 waves go out whole, as the fixed walk's (Sm90FwdTiles::tile), and the (tile, KV tile) pairs of the
// remaining C - W G tiles -- between G and 2G - 1 of them, so S = (C - W G) n pairs, at least n per block -- are
// cut into G ranges of consecutive pairs in tile order: block b takes [b S / G, (b + 1) S / G). A range runs over
// tile boundaries; a block's segments are then: the remainder of a tile the block before began (a "tail": KV
// visits [i0, n) with i0 > 0; the block's first segment past the whole waves), whole tiles, and the beginning of a
// tile the next block ends (a "head": visits [0, i1) with i1 < n; its last segment). A range of at least n pairs
// never lies inside one tile, so a tile has at most two parts. The tail's warpgroups write their unnormalised state
// (O, the row max m and the thread-partial row sum l of attn/softmax.cuh) to the workspace and raise a flag; the
// head's warpgroups, after their own products, wait for that flag, merge (M = max(m_a, m_b), O = O_a 2^(m_a - M) +
// O_b 2^(m_b - M), l likewise) and store O and the LSE as for a whole tile. A block computes its tail first and its
// head last, so the wait is short; it waits only on the next block's first segment, which waits on nothing, so no
// wait can deadlock. The reader sets the flag back to zero: every launch leaves the flags as it found them (zero
// when the host allocated the workspace). Workspace: SM90_SK_FLAGS ints (block b's warpgroup w: flag 4 b + w), then
// per (block, warpgroup) (DF + 1) x 128 float4: each thread's DF O fragments and (m0, m1, l0, l1), thread-major so
// that the writer's and the reader's accesses are coalesced and alike.
constexpr int SM90_SK_FLAGS = 1024;  // (4 per block: grids of at most 256 blocks; cuflash/_walk.py)
struct Sm90FwdSeg {
  int t, i0, i1;  // tile t (>= the tile count: the walk is over), its KV visits [i0, i1) (i1: at most its n_iters)
};
template <int BLOCK_N>
struct Sm90FwdStreamK {
  // The block's segment j (from the parameter block each time: the producer runs on few registers).
  template <typename Tiles>
  __device__ __forceinline__ static Sm90FwdSeg segment(const FwdParams& p, const Tiles& tiles, int j) {
    const unsigned g = gridDim.x, b = blockIdx.x;
    const int n = (int)((p.seqlen_k + BLOCK_N - 1) / BLOCK_N);
    const int waves = tiles.count / (int)g - 1;
    if (j < waves) return Sm90FwdSeg{tiles.tile(j), 0, n};
    const int dp = waves * (int)g;
    const unsigned s = (unsigned)(tiles.count - dp) * (unsigned)n;  // (< 2^31 / G: the host's rule)
    const int lo = (int)(s * b / g), hi = (int)(s * (b + 1) / g);
    const int tt = lo / n + (j - waves), start = max(lo, tt * n);
    if (start >= hi) return Sm90FwdSeg{tiles.count, 0, 0};
    return Sm90FwdSeg{dp + tt, start - tt * n, min(hi - tt * n, n)};
  }
  // The partial state of block `block`'s warpgroup `cw`: its flag, and thread tid's first float4.
  __device__ __forceinline__ static int* flag(const FwdParams& p, int block, int cw) {
    return reinterpret_cast<int*>(p.o_accum) + 4 * block + cw;
  }
  template <int NWG, int DF>
  __device__ __forceinline__ static float4* part(const FwdParams& p, int block, int cw, int tid) {
    return reinterpret_cast<float4*>(p.o_accum + SM90_SK_FLAGS) + (size_t)(block * NWG + cw) * (DF + 1) * 128 + tid;
  }
};

// S = Q K^T of one K stage, issued (commit and wait follow): the warpgroup's 64 Q rows at q_base (KD k16 steps in
// 64-column chunks of BLOCK_M 128-byte swizzled rows) against the stage's BLOCK_N keys at kb (chunks of BLOCK_N rows).
template <typename T, int BLOCK_M, int BLOCK_N, int KD, int NF>
__device__ __forceinline__ void issue_qk_stage(float (&acc_s)[NF][4], uint32_t q_base, uint32_t kb) {
#pragma unroll
  for (int k = 0; k < KD; ++k) {
    const uint32_t off = (k % 4) * 32;  // k16 step within the 64-column chunk k / 4
    const uint64_t da = smem_desc(q_base + (k / 4) * BLOCK_M * 128 + off, 16, 1024);
    const uint64_t db = smem_desc(kb + (k / 4) * BLOCK_N * 128 + off, 16, 1024);
    Wgmma<BLOCK_N>::template ss<T>(acc_s, da, db, k > 0);
  }
}

// O += P V of one V stage, issued: P from registers (one A fragment per k16 step of the stage's BLOCK_N keys), V's
// BLOCK_N rows of DP columns at vb.
template <typename T, int BLOCK_N, int DP, int KN, int DF>
__device__ __forceinline__ void issue_pv_stage(float (&acc_o)[DF][4], const uint32_t (&p_frag)[KN][4], uint32_t vb) {
#pragma unroll
  for (int k = 0; k < KN; ++k)
    Wgmma<DP>::template rs<T, 1>(acc_o, p_frag[k], smem_desc(vb + k * 16 * 128, BLOCK_N * 128, 1024), 1);
}

// The end of a KV tile's turn, after the softmax of the next S: O += P V completed (O and the P fragments free
// again), then O re-scaled where a row's max moved (`moved`: warp-uniform). The wait opens a basic block of its own:
// ptxas places a wgmma wait as early as its basic block allows, so written in the exponentials' block it came ahead
// of them in the SASS, and the softmax waited for the product instead of running under it
// (tests/test_fwd90_sass_cpu.py checks the order). The block boundary is a branch on `scale_log2 > 0`, true at run
// time (the host takes softmax_scale > 0 only) but not known to the compiler -- warpgroup-uniform, as the wait needs:
// wgmma.wait_group is .aligned, every thread of the warpgroup executes the same one. (A branch on `moved` itself,
// warp-uniform only, put the warps of one warpgroup on different waits: compute-sanitizer's synccheck reports that as
// a warpgroup MMA sequence error; a vote over the warpgroup's named barrier in every turn cost 4-15%.) The other arm
// re-scales every row -- alpha = 1 where a row did not move, the same O bit for bit -- so that the arms differ and
// ptxas keeps the branch, and so that either arm is right.
template <int DF, int KN>
__device__ __forceinline__ void wait_pv_rescale(bool moved, float scale_log2, float (&acc_o)[1][DF][4],
                                                uint32_t (&p_frag)[KN][4], const float (&alpha)[1][2]) {
  if (scale_log2 > 0.f) {
    wgmma_wait<0>();
    reg_fence(acc_o[0]);
    reg_fence(p_frag);
    if (moved) OnlineSoftmax<1>::rescale_o(acc_o, alpha);
  } else {
    wgmma_wait<0>();
    reg_fence(acc_o[0]);
    reg_fence(p_frag);
    OnlineSoftmax<1>::rescale_o(acc_o, alpha);
  }
}

// The persistent form (PERSIST: see the top of this file), the kernel's whole body then. Per tile it runs the
// one-tile form's steps (the same products in the same order, the same softmax and epilogue: a tile's output is
// bitwise the one-tile form's), written apart from it so that the one-tile kernels compile exactly as they did.
template <typename T, int D, int BLOCK_N, int NWG, int STAGES, bool CAUSAL, int REGS_MMA, int REGS_LOAD,
          bool PINGPONG, bool O_TMA, bool SK, int MOD, bool CAP_MAX>
__device__ __forceinline__ void flash_fwd_sm90_persistent(const FwdParams& p,
                                                          const typename Sm90FwdMapsOf<O_TMA>::type& maps,
                                                          unsigned char* sm) {
  using L = Sm90FwdLayout<D, BLOCK_N, NWG, STAGES, 2>;
  constexpr int BLOCK_M = L::BLOCK_M, DP = L::DP, CH = L::CH;
  constexpr int NF = BLOCK_N / 8, DF = DP / 8, KD = DP / 16, KN = BLOCK_N / 16;  // as the kernel's
  uint64_t* bar_q = reinterpret_cast<uint64_t*>(sm + L::BAR_OFF);  // Q buffer b loaded: bar_q[b]
  uint64_t* full_k = bar_q + 2;
  uint64_t* full_v = full_k + STAGES;
  uint64_t* empty_k = full_v + STAGES;
  uint64_t* empty_v = empty_k + STAGES;
  uint64_t* empty_q = empty_v + STAGES;  // Q buffer b free again (the O staged in it stored): empty_q[b]
  volatile int* tile_of = reinterpret_cast<volatile int*>(sm + L::TILE_OFF);  // buffer b's tile: tile_of[b]

  const bool varlen = p.cu_seqlens_q != nullptr;
  const int wg = threadIdx.x / 128;
  // The modifier kernels (MOD_SCORE: CAUSAL is false, a causal mask is the band with right = 0) walk their tiles
  // heaviest first too, as for a causal mask: the tiles of the band's last rows see the most keys.
  using Tiles = Sm90FwdTiles<BLOCK_M, CAUSAL || MOD != MOD_NONE>;
  // A tile's coordinates, its element's lengths and its KV tiles [n_end - n_iters, n_end) (as the kernel's)
  struct Work {
    FwdBlock blk;
    SeqInfo si;
    int m0, n_end, n_iters;
  };
  auto work_of = [&](const Tiles& tiles, int t) {
    Work w;
    w.blk = tiles.coords(p, t, varlen);
    w.m0 = w.blk.m_block * BLOCK_M;
    w.si = seqinfo(p, w.blk.batch, varlen);
    const Mask<CAUSAL, MOD> mk = w.si.band<CAUSAL, MOD>(p);  // (the soft-cap and ALiBi's slope: the consumers')
    w.n_end = kv_block_end<BLOCK_N>(mk, min(w.m0 + BLOCK_M, w.si.seqlen_q));
    w.n_iters = max(0, w.n_end - kv_block_begin<BLOCK_N>(mk, w.m0));
    return w;
  };

  if (threadIdx.x == 0) {
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      mbar_init(&bar_q[b], 1);
      mbar_init(&empty_q[b], NWG * 128);  // every consumer thread releases a Q buffer, its O stored
    }
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full_k[s], 1);
      mbar_init(&full_v[s], 1);
      mbar_init(&empty_k[s], NWG * 128);
      mbar_init(&empty_v[s], NWG * 128);
    }
    fence_barrier_init();
  }
  __syncthreads();

  if (wg == 0) {  // ------------------------------------------------------------------------------ producer
    setmaxnreg_dec<REGS_LOAD>();
    if (threadIdx.x == 0) {
      // Every tile in turn: Q buffer qi % 2 (reloaded once the consumers have stored the O staged in it) and one
      // ring position per KV tile, the ring continuing across tiles. The tile's index goes with its buffer
      // (tile_of, written before the buffer's bar_q arrive, whose release the consumers' wait acquires); an index
      // past the tiles ends the walk (a plain arrive, nothing loaded). The dynamic walk draws a tile once its
      // buffer is free, i.e. as the consumers start the tile before: a block takes one tile ahead of its work.
      const Tiles tiles(p, varlen);
      const Sm90FwdWalk walk{p};
      int kv = 0, qi = 0;
      for (int k = 0;;) {
        const int qb = qi % 2, qph = (qi / 2) & 1;
        ++qi;
        mbar_wait(&empty_q[qb], qph ^ 1);
        int t, i0 = 0, i1 = 0x7fffffff;  // the KV visits [i0, i1) of tile t (all of them but in stream-K's parts)
        if (SK && p.o_accum) {  // stream-K: segment k (the consumers derive it from k too)
          const Sm90FwdSeg sg = Sm90FwdStreamK<BLOCK_N>::segment(p, tiles, k);
          tile_of[qb] = k++;
          t = sg.t;
          i0 = sg.i0;
          i1 = sg.i1;
        } else {
          do {  // varlen: a tile past its element's rows is passed over (the consumers never see it)
            t = walk.dynamic() ? walk.draw(k) : tiles.tile(k);
            ++k;
          } while (varlen && t < tiles.count && work_of(tiles, t).m0 >= work_of(tiles, t).si.seqlen_q);
          tile_of[qb] = min(t, tiles.count);
        }
        if (t >= tiles.count) {
          mbar_arrive(&bar_q[qb]);
          break;
        }
        const Work w = work_of(tiles, t);
        const int kv_head = (int)(w.blk.head / p.heads_per_kv);
        const int tb = varlen ? 0 : w.blk.batch;
        if (w.n_iters > 0) {
          mbar_arrive_expect_tx(&bar_q[qb], L::Q_BYTES);
#pragma unroll
          for (int c = 0; c < CH; ++c)
            tma_load_4d(sm + L::Q_OFF + qb * L::Q_BYTES + c * BLOCK_M * 128, &maps.q, &bar_q[qb], c * 64,
                        w.si.q_start + w.m0, w.blk.head, tb);
        } else {
          mbar_arrive(&bar_q[qb]);  // no key: nothing to load, the buffer only stages O = 0
        }
        const int n_first = w.n_end - 1 - i0, n_loads = min(i1, w.n_iters) - i0;
        for (int it = 0; it < n_loads; ++it, ++kv) {
          const int n = n_first - it, s = kv % STAGES, ph = (kv / STAGES) & 1;
          mbar_wait(&empty_k[s], ph ^ 1);
          mbar_arrive_expect_tx(&full_k[s], L::KV_BYTES);
#pragma unroll
          for (int c = 0; c < CH; ++c)
            tma_load_4d(sm + L::K_OFF + s * L::KV_BYTES + c * BLOCK_N * 128, &maps.k, &full_k[s], c * 64,
                        w.si.k_start + n * BLOCK_N, kv_head, tb);
          mbar_wait(&empty_v[s], ph ^ 1);
          mbar_arrive_expect_tx(&full_v[s], L::KV_BYTES);
#pragma unroll
          for (int c = 0; c < CH; ++c)
            tma_load_4d(sm + L::V_OFF + s * L::KV_BYTES + c * BLOCK_N * 128, &maps.v, &full_v[s], c * 64,
                        w.si.k_start + n * BLOCK_N, kv_head, tb);
        }
      }
      if (walk.dynamic()) walk.finish();
    }
    return;
  }

  // ------------------------------------------------------------------------------------------------ consumers
  setmaxnreg_inc<REGS_MMA>();
  // The consumer index, taken from lane 0 so the compiler knows it is warp-uniform: the wgmma descriptors
  // built from it then live in uniform registers (no R2UR in the main loop).
  const int cw = __shfl_sync(0xffffffffu, wg - 1, 0);
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  // (through a volatile move: held in a register across the tiles. It was so for the conversion from the double
  // parameter that came back inside the main loop -- F2F.F32.F64 with its FP64 denormal test, DSETP; the parameter
  // is a float now, f32_slot, and the register is kept: the kernel's schedule was measured with it)
  const float scale_log2 = opaque((float)p.scale_log2);
  const uint32_t k_base = smem_addr(sm + L::K_OFF), v_base = smem_addr(sm + L::V_OFF);

  float acc_o[1][DF][4];
  float acc_s[1][NF][4];
  float shift[1][2];  // MOD_SCORE: the rows' ALiBi term, as the kernel's (MOD_NONE: untouched)
  uint32_t p_frag[KN][4];

  // The kernel's issue_qk / issue_pv with this tile's Q buffer (q_base: the warpgroup's rows of it).
  auto issue_qk = [&](uint32_t q_base, int st) {
    issue_qk_stage<T, BLOCK_M, BLOCK_N, KD>(acc_s[0], q_base, k_base + st * L::KV_BYTES);
  };
  auto issue_pv = [&](int st) { issue_pv_stage<T, BLOCK_N, DP>(acc_o[0], p_frag, v_base + st * L::KV_BYTES); };
  // PINGPONG turns as the kernel's, but continuing across tiles: the last consumer's last turn of a tile opens
  // the next tile's first (a tile without KV tiles has no turns and passes the opening on); consumer 0 takes the
  // opening left over after the last tile.
  auto turn_begin = [&]() {
    if constexpr (PINGPONG) named_bar_sync(1 + cw, 256);
  };
  auto turn_end = [&]() {
    if constexpr (PINGPONG) named_bar_arrive(1 + (cw + 1) % NWG, 256);
  };
  if (PINGPONG && cw == NWG - 1) named_bar_arrive(1, 256);  // the first tile's first turn

  // tid 0 releases the previous tile's Q buffer (qb ^ 1: consecutive tiles alternate) once that tile's O store
  // has read it, at this tile's first product -- out of the epilogue's way -- or, without KV tiles, after the wait
  // for Q; the last tile's store is waited for at the end.
  auto release_previous = [&](int qb, int qi) {
    if (tid == 0 && qi > 1) {
      bulk_wait_group_read<0>();
      mbar_arrive(&empty_q[qb ^ 1]);
    }
  };

  // Stream-K (SK with a workspace): the producer hands out segment indices, whole tiles for the first waves.
  const bool sk = SK && p.o_accum != nullptr;
  const Tiles tiles(p, varlen);
  int kv = 0, qi = 0;
  // The walk, as one loop over the Q buffers' tiles; stream-K takes it twice: the whole tiles of its first C / G - 1
  // waves, then its segments (`parts`: a segment may be part of a tile). So the whole tiles' loop has none of the
  // parts' branches in its code: compiled into every tile's code, those brought divergence guards and per-thread
  // copies of uniform values that cost every tile (bench/NOTES.md, "Hopper forward").
  auto walk = [&](bool parts) {
    // The tile (and KV visits) of the index a Q buffer comes with: the tile itself, or, stream-K, the segment's index,
    // from which the tile and its visits are derived as the producer derived them.
    auto seg_of = [&](const Tiles& tiles, int v) {
      if constexpr (SK) {
        if (parts) return Sm90FwdStreamK<BLOCK_N>::segment(p, tiles, v);
        // (the whole waves: segment v for v < C / G - 1 is the fixed walk's tile(v), whole -- the producer's
        // segment() and this must agree; tests/test_fwd90_walk_cpu.py checks the host mirror stream_k_segment)
        if (sk) return Sm90FwdSeg{tiles.tile(v), 0, 0x7fffffff};
      }
      return Sm90FwdSeg{v, 0, 0x7fffffff};
    };
    const int waves = tiles.count / (int)gridDim.x - 1;  // (stream-K's whole tiles: its first steps)
    for (int step = 0; !sk || parts || step < waves; ++step) {
      const int qb = qi % 2, qph = (qi / 2) & 1;
      ++qi;
      mbar_wait(&bar_q[qb], qph);  // buffer qb's Q and its tile index
      const int v = __shfl_sync(0xffffffffu, tile_of[qb], 0);  // (through lane 0: warp-uniform, as cw)
      const Sm90FwdSeg sg = seg_of(tiles, v);
      const int t = sg.t;
      if (t >= tiles.count) break;
      const Work wl = work_of(tiles, t);
      const Mask<CAUSAL, MOD> mask = wl.si.mask<CAUSAL, MOD>(p, wl.blk.batch, wl.blk.head);
      const int row_wg = wl.m0 + cw * 64, row_w = row_wg + warp * 16;
      unsigned char* q_tile = sm + L::Q_OFF + qb * L::Q_BYTES + cw * 64 * 128;  // the warpgroup's rows of buffer qb
      const uint32_t q_base = smem_addr(q_tile);
      auto mask_and_max = [&](OnlineSoftmax<1>& softmax, int n) {
        if constexpr (CAP_MAX) {  // (as the kernel's)
          if (mask.cap_only(row_wg, row_wg + 63, n * BLOCK_N, n * BLOCK_N + BLOCK_N - 1)) {
            mask.clear_shift(shift);
            return softmax.update_max_capped(acc_s, scale_log2, mask.cap_pre);
          }
        }
        if (mask.needs_mask(row_wg, row_wg + 63, n * BLOCK_N, n * BLOCK_N + BLOCK_N - 1))
          mask.apply(acc_s, row_w, n * BLOCK_N, lane, shift);
        else
          mask.clear_shift(shift);
        return softmax.update_max(acc_s, scale_log2, mask.shift_arg(shift));
      };
      zero_frags(acc_o[0]);
      OnlineSoftmax<1> softmax;
      // (a stream-K part: the visits [i0, i1) of the tile's, as a tile of its own whose last KV tile is n_end - 1)
      const int n_end = wl.n_end - sg.i0, n_iters = min(sg.i1, wl.n_iters) - sg.i0;
      // Causal: the tile's first KV tiles (visited last first) past the keys of this warpgroup's last row are hidden
      // from all of its 64 rows -- with Q tiles of 192 rows (head dim 64: three warpgroups) up to two per tile, and
      // all of them for a warpgroup past its element's last row, as without a mask. The warpgroup takes their turns
      // and releases their stages (once loaded) without a product; its first product is the first tile its rows see.
      // A window (MOD_SCORE) also hides the tile's last KV tiles left of the band of the warpgroup's first row (`tail`,
      // the kernel's): their turns come after its last product, empty. (Stream-K's parts: no mask.)
      int skip = 0, tail = 0;
      if constexpr (MOD != MOD_NONE) {
        const HiddenTiles ht = hidden_tiles<BLOCK_N>(mask, row_wg, min(row_wg + 64, wl.si.seqlen_q), n_end, n_iters);
        skip = ht.lead;
        tail = ht.tail;
      } else if constexpr (CAUSAL) {
        skip = hidden_tiles<BLOCK_N>(mask, row_wg, min(row_wg + 64, wl.si.seqlen_q), n_end, n_iters).lead;
      } else if (row_wg >= wl.si.seqlen_q) {
        skip = n_iters;
      }
      const int real_end = n_iters - tail;  // products over visits [skip, real_end)
      auto empty_turn = [&](int it) {
        const int st = (kv + it) % STAGES, ph = ((kv + it) / STAGES) & 1;
        mbar_wait(&full_k[st], ph);
        turn_begin();
        turn_end();
        if (it == 0) release_previous(qb, qi);
        mbar_arrive(&empty_k[st]);
        mbar_wait(&full_v[st], ph);
        mbar_arrive(&empty_v[st]);
      };
      if (n_iters > 0) {
        for (int it = 0; it < skip; ++it) empty_turn(it);
      }
      if (real_end > skip) {
        // KV tile `skip`: S alone.
        const int st0 = (kv + skip) % STAGES, ph0 = ((kv + skip) / STAGES) & 1;
        mbar_wait(&full_k[st0], ph0);
        turn_begin();
        wgmma_fence();
        issue_qk(q_base, st0);
        wgmma_commit();
        turn_end();
        if (skip == 0) release_previous(qb, qi);
        wgmma_wait<0>();
        reg_fence(acc_s[0]);
        mbar_arrive(&empty_k[st0]);
        {
          mask_and_max(softmax, n_end - 1 - skip);
          float alpha[1][2];
          softmax.rescale_sum(alpha);
          softmax.exp_and_sum(acc_s, scale_log2, mask.shift_arg(shift));
  #pragma unroll
          for (int kk = 0; kk < KN; ++kk) frag_to_a<T>(acc_s[0], kk, p_frag[kk]);
        }
        // KV tiles skip + 1..: S of tile it and O += P V of tile it - 1 in one turn; the softmax of S_it under P V.
        for (int it = skip + 1; it < real_end; ++it) {
          const int n = n_end - 1 - it, ph = ((kv + it) / STAGES) & 1, pph = ((kv + it - 1) / STAGES) & 1;
          // (stage indices through lane 0, warp-uniform: the descriptors they offset stay in uniform registers)
          const int st = __shfl_sync(0xffffffffu, (kv + it) % STAGES, 0);
          const int pst = __shfl_sync(0xffffffffu, (kv + it - 1) % STAGES, 0);
          mbar_wait(&full_k[st], ph);
          mbar_wait(&full_v[pst], pph);
          turn_begin();
          wgmma_fence();
          issue_qk(q_base, st);
          wgmma_commit();
          issue_pv(pst);
          wgmma_commit();
          turn_end();
          wgmma_wait<1>();
          reg_fence(acc_s[0]);
          mbar_arrive(&empty_k[st]);
          const bool moved = __any_sync(0xffffffffu, mask_and_max(softmax, n));
          float alpha[1][2];
          softmax.rescale_sum(alpha);
          softmax.exp_and_sum(acc_s, scale_log2, mask.shift_arg(shift));
          wait_pv_rescale(moved, scale_log2, acc_o, p_frag, alpha);
          mbar_arrive(&empty_v[pst]);
  #pragma unroll
          for (int kk = 0; kk < KN; ++kk) frag_to_a<T>(acc_s[0], kk, p_frag[kk]);
        }
        // The last O += P V, then the hidden tail's turns.
        const int lst = (kv + real_end - 1) % STAGES, lph = ((kv + real_end - 1) / STAGES) & 1;
        mbar_wait(&full_v[lst], lph);
        turn_begin();
        wgmma_fence();
        issue_pv(lst);
        wgmma_commit();
        turn_end();  // (the last consumer's last turn of a tile: the next tile's first)
        wgmma_wait<0>();
        reg_fence(acc_o[0]);
        mbar_arrive(&empty_v[lst]);
        if constexpr (MOD != MOD_NONE) {
          for (int it = real_end; it < n_iters; ++it) empty_turn(it);
        }
      } else if (n_iters > 0) {  // every KV tile hidden: the rest of the turns empty (a window's tail), and the last
        if constexpr (MOD != MOD_NONE) {
          for (int it = skip; it < n_iters; ++it) empty_turn(it);
        }
        turn_begin();
        turn_end();
      } else {
        release_previous(qb, qi);
      }
      kv += n_iters;

      // (the segment and the tile's coordinates taken again from v rather than held in registers through the main loop)
      const Sm90FwdSeg se = seg_of(tiles, opaque(v));
      const Work w = work_of(tiles, se.t);
      if (SK && parts) {
        if (se.i0 > 0) {  // stream-K, the remainder of a tile the block before began: the state to the workspace
          using SKW = Sm90FwdStreamK<BLOCK_N>;  // (not SK: a template parameter's name is not redeclared)
          float4* dst = SKW::template part<NWG, DF>(p, (int)blockIdx.x, cw, tid);
  #pragma unroll
          for (int df = 0; df < DF; ++df)
            __stcg(dst + df * 128, make_float4(acc_o[0][df][0], acc_o[0][df][1], acc_o[0][df][2], acc_o[0][df][3]));
          __stcg(dst + DF * 128, make_float4(softmax.row_max[0][0], softmax.row_max[0][1], softmax.row_sum[0][0],
                                             softmax.row_sum[0][1]));
          named_bar_sync(4 + cw, 128);  // every thread's stores before the release (cumulative through the barrier)
          if (tid == 0) red_release_gpu_add(SKW::flag(p, (int)blockIdx.x, cw), 1);
          if (tid != 0) mbar_arrive(&empty_q[qb]);  // (tid 0: at the next segment's first product, release_previous)
          continue;
        }
        if (se.i1 < w.n_iters) {  // stream-K, the beginning of a tile the next block ends: its state merged in
          using SKW = Sm90FwdStreamK<BLOCK_N>;
          if (tid == 0) {
            int* f = SKW::flag(p, (int)blockIdx.x + 1, cw);
            while (ld_acquire_gpu(f) == 0) {
            }
            *f = 0;  // (read by no one else: the next launch on this workspace starts after this one ends)
          }
          named_bar_sync(4 + cw, 128);
          const float4* src = SKW::template part<NWG, DF>(p, (int)blockIdx.x + 1, cw, tid);
          const float4 ml = __ldcg(src + DF * 128);
          const float mb[2] = {ml.x, ml.y}, lb[2] = {ml.z, ml.w};
          float c[2][2];  // per row h: this block's state's weight c[h][0], the next block's c[h][1]
  #pragma unroll
          for (int h = 0; h < 2; ++h) {  // (the thread-partial l's merge as the row's l would: the same weights)
            float m;
            softmax.row_sum[0][h] = merge_partials<2>([&](int i) { return i ? mb[h] : softmax.row_max[0][h]; },
                                                      [&](int i) { return i ? lb[h] : softmax.row_sum[0][h]; }, c[h],
                                                      m);
            softmax.row_max[0][h] = m;
          }
  #pragma unroll
          for (int df = 0; df < DF; ++df) {
            const float4 o = __ldcg(src + df * 128);
            acc_o[0][df][0] = acc_o[0][df][0] * c[0][0] + o.x * c[0][1];
            acc_o[0][df][1] = acc_o[0][df][1] * c[0][0] + o.y * c[0][1];
            acc_o[0][df][2] = acc_o[0][df][2] * c[1][0] + o.z * c[1][1];
            acc_o[0][df][3] = acc_o[0][df][3] * c[1][0] + o.w * c[1][1];
          }
        }
      }

      // Epilogue, as the kernel's: O / l -> the warpgroup's rows of Q buffer qb -> the TMA store or 16-byte stores.
      const int seqlen_q = w.si.seqlen_q;
      float lse[1][2];
      softmax.finalize(acc_o, lse);
      const int g = lane / 4, tq = lane % 4;
      if (p.lse && tq == 0) {
        const int64_t row0 = lse_row0(p, w.si, w.blk.batch, w.blk.head, varlen);
  #pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = row_w + g + 8 * h;
          if (row < seqlen_q) p.lse[row0 + row] = lse[0][h];
        }
      }
      named_bar_sync(4 + cw, 128);
      stage_frags<T, D, BLOCK_M>(q_tile, acc_o[0], warp * 16 + g, tq);
      bool stored = false;
      if constexpr (O_TMA) {
        if (!varlen || row_wg + 64 <= seqlen_q) {  // warpgroup-uniform
          fence_proxy_async_shared();
          named_bar_sync(4 + cw, 128);
          if (tid == 0 && row_wg < seqlen_q) {
  #pragma unroll
            for (int c = 0; c < CH; ++c)
              if (c * 64 < p.head_dim)
                tma_store_4d(&maps.o, q_tile + c * BLOCK_M * 128, c * 64, w.si.q_start + row_wg, w.blk.head,
                             varlen ? 0 : w.blk.batch);
            bulk_commit_group();  // (its reads waited for by release_previous)
          }
          stored = true;
        }
      }
      if (!stored) {
        named_bar_sync(4 + cw, 128);
        T* o_ptr = reinterpret_cast<T*>(p.o) + w.si.q_offset(p.o_batch_stride, p.o_row_stride, p.o_head_stride,
                                                             w.blk.batch, w.blk.head);
        constexpr int PIECES = D / 8;
  #pragma unroll
        for (int i = tid; i < 64 * PIECES; i += 128) {
          const int r = i / PIECES, pc = i % PIECES;
          const int row = row_wg + r;
          if (row < seqlen_q && pc * 8 < p.head_dim)
            *reinterpret_cast<uint4*>(o_ptr + (int64_t)row * p.o_row_stride + pc * 8) =
                *reinterpret_cast<const uint4*>(q_tile + (pc / 8) * BLOCK_M * 128 + r * 128 +
                                                (((pc % 8) ^ (r % 8)) * 16));
        }
      }
      // Buffer qb is free once its O is stored: each thread arrives after its own reads of it (the 16-byte stores'
      // loads, in program order before the arrive's release); tid 0 after the TMA store's reads (release_previous).
      if (tid != 0) mbar_arrive(&empty_q[qb]);
    }
  };
  walk(false);
  if constexpr (SK) {
    if (sk) walk(true);
  }
  if (tid == 0) bulk_wait_group_read<0>();  // the last store's smem source read before the block exits
  if (PINGPONG && cw == 0) named_bar_sync(1, 256);  // the opening the last consumer left after the last tile
}

template <typename T, int D, int BLOCK_N, int NWG, int STAGES, bool CAUSAL, int REGS_MMA, int REGS_LOAD,
          bool PINGPONG, int SMEM_BYTES, int MOD = MOD_NONE, bool O_TMA = false, int MINB = 1, bool PERSIST = false,
          bool SK = false, bool CAP_MAX = false>
__global__ void __launch_bounds__((NWG + 1) * 128, MINB)
    flash_fwd_sm90_kernel(const __grid_constant__ FwdParams p,
                          const __grid_constant__ typename Sm90FwdMapsOf<O_TMA>::type maps) {
  using L = Sm90FwdLayout<D, BLOCK_N, NWG, STAGES>;
  constexpr int BLOCK_M = L::BLOCK_M, DP = L::DP, CH = L::CH;
  constexpr int NF = BLOCK_N / 8;   // n8 blocks of S per row band
  constexpr int DF = DP / 8;        // n8 blocks of O per row band
  constexpr int KD = DP / 16;       // k16 steps of Q K^T
  constexpr int KN = BLOCK_N / 16;  // k16 steps of P V
  static_assert(D % 16 == 0 && BLOCK_N % 16 == 0 && BLOCK_N <= 256 && DP <= 256, "wgmma shapes");
  static_assert(NWG >= 1 && NWG <= 3 && (!PINGPONG || NWG >= 2), "consumer warpgroups");
  // (setmaxnreg moves registers within the block's launch allocation: 65536 / (MINB threads), rounded down to a
  // multiple of 8, per thread -- asking for more than the producer gives back never returns)
  static_assert(MINB >= 1 && 128 * (REGS_LOAD + NWG * REGS_MMA) <=
                                 65536 / (MINB * (NWG + 1) * 128 * 8) * 8 * ((NWG + 1) * 128) &&
                    REGS_MMA % 8 == 0 && REGS_LOAD % 8 == 0,
                "setmaxnreg register counts");
  static_assert(SMEM_BYTES == Sm90FwdLayout<D, BLOCK_N, NWG, STAGES, PERSIST ? 2 : 1>::BYTES,
                "host smem size must match the layout");
  static_assert(!PERSIST || (MOD & MOD_DROPOUT) == 0, "the persistent form takes no dropout");
  static_assert(!SK || (PERSIST && !CAUSAL && MOD == MOD_NONE), "stream-K: the persistent form without a mask");
  static_assert(!CAP_MAX || (MOD & MOD_SCORE), "the capped-max form: the modifier kernels");

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* sm = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);  // 1024-aligned: the swizzle
  if constexpr (PERSIST) {
    flash_fwd_sm90_persistent<T, D, BLOCK_N, NWG, STAGES, CAUSAL, REGS_MMA, REGS_LOAD, PINGPONG, O_TMA, SK, MOD,
                              CAP_MAX>(p, maps, sm);
    return;
  }
  uint64_t* bar_q = reinterpret_cast<uint64_t*>(sm + L::BAR_OFF);
  uint64_t* full_k = bar_q + 1;
  uint64_t* full_v = full_k + STAGES;
  uint64_t* empty_k = full_v + STAGES;
  uint64_t* empty_v = empty_k + STAGES;

  const bool varlen = p.cu_seqlens_q != nullptr;  // (a run-time test here: no register pressure to spare it)
  const FwdBlock blk = fwd_block_coords<BLOCK_M>(p, blockIdx, varlen);  // heaviest causal Q tiles first
  const int m0 = blk.m_block * BLOCK_M;
  const SeqInfo si = seqinfo(p, blk.batch, varlen);
  const int seqlen_q = si.seqlen_q;
  if (m0 >= seqlen_q) return;  // varlen: a tile past this element's rows (attn/seqlen.cuh)
  const Mask<CAUSAL, MOD> mask = si.mask<CAUSAL, MOD>(p, blk.batch, blk.head);
  constexpr bool DROP = (MOD & MOD_DROPOUT) != 0;
  // KV tiles [n_begin, n_end), visited last first: the tile that needs the mask comes first, the rest need none
  // but, with a window, the ones at its left edge (attn/block.cuh: tiles right of the diagonal / band of the
  // tile's last row, or left of the band of its first, are never loaded).
  const int n_begin = kv_block_begin<BLOCK_N>(mask, m0);
  const int n_end = kv_block_end<BLOCK_N>(mask, min(m0 + BLOCK_M, seqlen_q));
  const int n_iters = max(0, n_end - n_begin);
  const int wg = threadIdx.x / 128;

  if (threadIdx.x == 0) {
    mbar_init(bar_q, 1);
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full_k[s], 1);
      mbar_init(&full_v[s], 1);
      mbar_init(&empty_k[s], NWG * 128);  // every consumer thread releases a stage it has read
      mbar_init(&empty_v[s], NWG * 128);
    }
    fence_barrier_init();
  }
  __syncthreads();

  if (wg == 0) {  // ------------------------------------------------------------------------------ producer
    setmaxnreg_dec<REGS_LOAD>();
    if (threadIdx.x == 0 && n_iters > 0) {
      const int kv_head = (int)(blk.head / p.heads_per_kv);  // GQA/MQA: the shared K/V head
      // varlen: the maps see [1, total, h, d]; a tile's rows past the element's end are the next element's (never
      // stored; keys past its end are masked) or past the total (zero-filled by TMA)
      const int tb = varlen ? 0 : blk.batch;
      mbar_arrive_expect_tx(bar_q, L::Q_BYTES);
#pragma unroll
      for (int c = 0; c < CH; ++c)
        tma_load_4d(sm + L::Q_OFF + c * BLOCK_M * 128, &maps.q, bar_q, c * 64, si.q_start + m0, blk.head, tb);
      for (int it = 0; it < n_iters; ++it) {
        const int n = n_end - 1 - it, s = it % STAGES, ph = (it / STAGES) & 1;
        mbar_wait(&empty_k[s], ph ^ 1);
        mbar_arrive_expect_tx(&full_k[s], L::KV_BYTES);
#pragma unroll
        for (int c = 0; c < CH; ++c)
          tma_load_4d(sm + L::K_OFF + s * L::KV_BYTES + c * BLOCK_N * 128, &maps.k, &full_k[s], c * 64,
                      si.k_start + n * BLOCK_N, kv_head, tb);
        mbar_wait(&empty_v[s], ph ^ 1);
        mbar_arrive_expect_tx(&full_v[s], L::KV_BYTES);
#pragma unroll
        for (int c = 0; c < CH; ++c)
          tma_load_4d(sm + L::V_OFF + s * L::KV_BYTES + c * BLOCK_N * 128, &maps.v, &full_v[s], c * 64,
                      si.k_start + n * BLOCK_N, kv_head, tb);
      }
    }
    return;
  }

  // ------------------------------------------------------------------------------------------------ consumers
  setmaxnreg_inc<REGS_MMA>();
  const int cw = __shfl_sync(0xffffffffu, wg - 1, 0);  // consumer index: rows [m0 + 64 cw, +64); warp-uniform
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  const int row_wg = m0 + cw * 64;       // the warpgroup's first row
  const int row_w = row_wg + warp * 16;  // the warp's: its fragments hold rows row_w + g, row_w + g + 8
  const float scale_log2 = (float)p.scale_log2;
  const uint32_t q_base = smem_addr(sm + L::Q_OFF) + cw * 64 * 128;
  const uint32_t k_base = smem_addr(sm + L::K_OFF), v_base = smem_addr(sm + L::V_OFF);

  float acc_o[1][DF][4];
  zero_frags(acc_o[0]);
  float acc_s[1][NF][4];
  float shift[1][2];  // MOD_SCORE: the rows' ALiBi term the scores are left short of (attn/mask.cuh)
  uint32_t p_frag[KN][4];
  OnlineSoftmax<1> softmax;

  // S = Q K^T of the tile in stage st; O += P V of the tile in stage st (issue only: commit and wait follow).
  auto issue_qk = [&](int st) {
    issue_qk_stage<T, BLOCK_M, BLOCK_N, KD>(acc_s[0], q_base, k_base + st * L::KV_BYTES);
  };
  auto issue_pv = [&](int st) { issue_pv_stage<T, BLOCK_N, DP>(acc_o[0], p_frag, v_base + st * L::KV_BYTES); };
  // Whose turn it is at the tensor cores (PINGPONG): consumer cw waits on barrier 1 + cw, which the previous
  // consumer arrives at once it has issued its products; the last consumer opens the first turn and, on its
  // last turn, arrives nowhere (every barrier is left complete).
  auto turn_begin = [&]() {
    if constexpr (PINGPONG) named_bar_sync(1 + cw, 256);
  };
  auto turn_end = [&](bool last) {
    if constexpr (PINGPONG)
      if (!(last && cw == NWG - 1)) named_bar_arrive(1 + (cw + 1) % NWG, 256);
  };
  // The masked scores of tile n (only where some element is hidden or a value modifier is on: warpgroup-uniform),
  // then the new row max.
  auto mask_and_max = [&](int n) {
    if constexpr (CAP_MAX) {  // the soft-cap's max from the raw scores on the tiles where it is the only change
      if (mask.cap_only(row_wg, row_wg + 63, n * BLOCK_N, n * BLOCK_N + BLOCK_N - 1)) {
        mask.clear_shift(shift);
        return softmax.update_max_capped(acc_s, scale_log2, mask.cap_pre);
      }
    }
    if (mask.needs_mask(row_wg, row_wg + 63, n * BLOCK_N, n * BLOCK_N + BLOCK_N - 1))
      mask.apply(acc_s, row_w, n * BLOCK_N, lane, shift);
    else
      mask.clear_shift(shift);
    return softmax.update_max(acc_s, scale_log2, mask.shift_arg(shift));
  };
  // Dropout (DROP): P of tile n zeroed where dropped, after the row sums took every probability (flash-attn's
  // semantics: the normaliser keeps all).
  auto drop_p = [&](int n) {
    if constexpr (DROP)
      Dropout(p, (int64_t)blk.batch * p.nheads + blk.head).apply<false>(acc_s, row_w, n * BLOCK_N, lane);
  };

  // The KV tiles hidden from all of this warpgroup's 64 rows (causal, window; without a mask, every KV tile for a
  // warpgroup past seqlen_q, and none otherwise): of [n_begin, n_end), visited last
  // first, the first `skip` lie right of the band of its last row (the causal diagonal, the window's right edge) and
  // the last `tail` left of the band of its first row (the window's left edge) -- with Q tiles of 192 rows (head dim
  // 64: three warpgroups) up to two per edge, and all of them for a warpgroup past seqlen_q or whose rows see no
  // key. The warpgroup takes their turns empty and releases their stages once loaded (every consumer arrives at
  // every stage's empty barrier); its products run over [skip, n_iters - tail), the same products in the same order
  // as without the skip where its rows see a key (the output is bitwise the same).
  // (Not with dropout: its kernels at head dim 64 hold no register to spare for it.)
  int skip = 0, tail = 0;
  if constexpr ((CAUSAL || decltype(mask)::LOCAL) && !DROP) {
    const HiddenTiles h = hidden_tiles<BLOCK_N>(mask, row_wg, min(row_wg + 64, seqlen_q), n_end, n_iters);
    skip = h.lead;
    tail = h.tail;
  } else if constexpr (!DROP) {
    if (row_wg >= seqlen_q) skip = n_iters;  // no mask: only a warpgroup past seqlen_q (a ragged last Q tile)
  }
  const int real_end = n_iters - tail;  // products over visits [skip, real_end)
  auto empty_turn = [&](int it, bool last_turn) {
    const int st = it % STAGES, ph = (it / STAGES) & 1;
    mbar_wait(&full_k[st], ph);
    turn_begin();
    turn_end(last_turn);
    mbar_arrive(&empty_k[st]);
    mbar_wait(&full_v[st], ph);
    mbar_arrive(&empty_v[st]);
  };

  if (n_iters > 0) {
    if (PINGPONG && cw == NWG - 1) named_bar_arrive(1, 256);
    mbar_wait(bar_q, 0);
    for (int it = 0; it < skip; ++it) empty_turn(it, false);
  }
  if (real_end > skip) {
    // Tile `skip`: S alone.
    const int st0 = skip % STAGES, ph0 = (skip / STAGES) & 1;
    mbar_wait(&full_k[st0], ph0);
    turn_begin();
    wgmma_fence();
    issue_qk(st0);
    wgmma_commit();
    turn_end(false);
    wgmma_wait<0>();
    reg_fence(acc_s[0]);
    mbar_arrive(&empty_k[st0]);
    {
      mask_and_max(n_end - 1 - skip);
      float alpha[1][2];
      softmax.rescale_sum(alpha);  // O is still zero: only m (and l = 0) move
      softmax.exp_and_sum(acc_s, scale_log2, mask.shift_arg(shift));
      drop_p(n_end - 1 - skip);
#pragma unroll
      for (int k = 0; k < KN; ++k) frag_to_a<T>(acc_s[0], k, p_frag[k]);
    }
    // Tiles skip + 1..: S of tile it and O += P V of tile it - 1 in one turn; the softmax of S_it under P V.
    for (int it = skip + 1; it < real_end; ++it) {
      const int n = n_end - 1 - it, st = it % STAGES, ph = (it / STAGES) & 1;
      const int pst = (it - 1) % STAGES, pph = ((it - 1) / STAGES) & 1;
      mbar_wait(&full_k[st], ph);
      mbar_wait(&full_v[pst], pph);
      turn_begin();
      wgmma_fence();
      issue_qk(st);
      wgmma_commit();
      issue_pv(pst);
      wgmma_commit();
      turn_end(false);
      wgmma_wait<1>();  // S done (P V may still run)
      reg_fence(acc_s[0]);
      mbar_arrive(&empty_k[st]);
      const bool moved = __any_sync(0xffffffffu, mask_and_max(n));
      float alpha[1][2];
      softmax.rescale_sum(alpha);
      softmax.exp_and_sum(acc_s, scale_log2, mask.shift_arg(shift));
      drop_p(n);
      if constexpr (!(DROP && D > 128)) {
        wait_pv_rescale(moved, scale_log2, acc_o, p_frag, alpha);
        mbar_arrive(&empty_v[pst]);
      } else {  // dropout at head dim 256: its kernels spill with the wait behind the exponentials
        wgmma_wait<0>();
        reg_fence(acc_o[0]);
        reg_fence(p_frag);
        mbar_arrive(&empty_v[pst]);
        if (moved) OnlineSoftmax<1>::rescale_o(acc_o, alpha);
      }
#pragma unroll
      for (int k = 0; k < KN; ++k) frag_to_a<T>(acc_s[0], k, p_frag[k]);
    }
    // The last O += P V (the warpgroup's last turn unless hidden tiles follow), then their turns.
    const int lst = (real_end - 1) % STAGES, lph = ((real_end - 1) / STAGES) & 1;
    mbar_wait(&full_v[lst], lph);
    turn_begin();
    wgmma_fence();
    issue_pv(lst);
    wgmma_commit();
    turn_end(tail == 0);
    wgmma_wait<0>();
    reg_fence(acc_o[0]);
    mbar_arrive(&empty_v[lst]);
    for (int it = real_end; it < n_iters; ++it) empty_turn(it, it == n_iters - 1);
  } else if (n_iters > 0) {  // every KV tile hidden from these rows: the rest of the turns empty, and the last
    for (int it = skip; it < n_iters; ++it) empty_turn(it, false);
    turn_begin();
    turn_end(true);
  }

  // ------------------------------------------------------------------------------------------------ epilogue
  float lse[1][2];
  softmax.finalize(acc_o, lse);
  if constexpr (DROP) scale_frags(acc_o, (float)p.dropout_scale);  // O / (1 - p)
  const int g = lane / 4, t = lane % 4;
  if (p.lse && t == 0) {
    const int64_t row0 = lse_row0(p, si, blk.batch, blk.head, varlen);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row_w + g + 8 * h;
      if (row < seqlen_q) p.lse[row0 + row] = lse[0][h];
    }
  }
  // O -> this warpgroup's 64 rows of the Q tile (only its own products read them, all completed), in the same
  // swizzled layout, then 16-byte stores of the rows that exist.
  unsigned char* o_tile = sm + L::Q_OFF + cw * 64 * 128;  // chunk c at + c * BLOCK_M * 128
  named_bar_sync(4 + cw, 128);
  stage_frags<T, D, BLOCK_M>(o_tile, acc_o[0], warp * 16 + g, t);
  if constexpr (O_TMA) {
    // One thread stores the warpgroup's 64 rows by TMA, one box per 64-column chunk (the smem tile is already in the
    // map's 128-byte swizzle). TMA clips what lies outside the map: columns past head_dim (D's padding) and rows past
    // seqlen_q -- but a varlen map is [1, total, h, d], where rows past this element's end are the next element's:
    // a varlen warpgroup tile that crosses its element's end takes the 16-byte stores below.
    if (!varlen || row_wg + 64 <= seqlen_q) {  // warpgroup-uniform
      fence_proxy_async_shared();  // each thread's O writes, before the async proxy (the TMA store) reads them
      named_bar_sync(4 + cw, 128);  // every thread's writes fenced before the store is issued
      if (tid == 0 && row_wg < seqlen_q) {  // (a warpgroup wholly past seqlen_q has nothing to store)
#pragma unroll
        for (int c = 0; c < CH; ++c)
          if (c * 64 < p.head_dim)  // (a chunk wholly past head_dim would be clipped whole: not issued)
            tma_store_4d(&maps.o, o_tile + c * BLOCK_M * 128, c * 64, si.q_start + row_wg, blk.head,
                         varlen ? 0 : blk.batch);
        bulk_commit_group();
        bulk_wait_group_read<0>();  // the smem source read before the block exits (its shared memory is freed)
      }
      return;
    }
  }
  named_bar_sync(4 + cw, 128);
  T* o_ptr = reinterpret_cast<T*>(p.o) + si.q_offset(p.o_batch_stride, p.o_row_stride, p.o_head_stride, blk.batch,
                                                     blk.head);
  constexpr int PIECES = D / 8;  // 16-byte pieces of a row of O
#pragma unroll
  for (int i = tid; i < 64 * PIECES; i += 128) {
    const int r = i / PIECES, pc = i % PIECES;
    const int row = row_wg + r;
    if (row < seqlen_q && pc * 8 < p.head_dim)  // a head dim below D: its padding columns are not stored
      *reinterpret_cast<uint4*>(o_ptr + (int64_t)row * p.o_row_stride + pc * 8) = *reinterpret_cast<const uint4*>(
          o_tile + (pc / 8) * BLOCK_M * 128 + r * 128 + (((pc % 8) ^ (r % 8)) * 16));
  }
}

}  // namespace cuflash
