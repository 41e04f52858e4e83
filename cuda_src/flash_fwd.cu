// cuda_src/flash_fwd.cu -- FlashAttention-2 forward, and its split-KV form (Flash-Decoding) + combine.
//
// One thread block per (Q tile of BLOCK_M rows, head, batch[, KV split]); the KV loop runs inside it.
// Warps split the Q rows (the V2 partition): warp w owns rows [w*WARP_M, (w+1)*WARP_M) of the tile, so the
// softmax statistics of a row live in one quad of one warp and no cross-warp reduction is ever needed.
//
//   Q tile      -> smem (cp.async) -> registers (ldmatrix), once
//   for each KV tile j (double-buffered with cp.async; tile j-1 is in flight while j is computed):
//     S   = Q K_j^T                       [WARP_M, BLOCK_N] fp32 accumulators (mma.sync m16n8k16)
//     m'  = rowmax(S) * scale_log2 if it exceeds m by more than 8, else m   (lazy re-scaling, log2 domain)
//     P   = exp2(S * scale_log2 - m')     one FFMA + one MUFU.EX2 per score
//     acc_o, l *= alpha = exp2(m - m')    only when some row of the warp moved its m (rare after a few tiles)
//     acc_o += P V_j, l += rowsum(P)      P converted in registers into the A operand (no smem trip); l is
//                                         a thread-partial fp32 sum, reduced across the quad at the end
//   O = acc_o / l  (written once, through smem, 16-byte stores);  LSE = (m + log2 l) * ln 2
//
// Template parameters (chosen in cuflash/_configs.py, the single source of truth):
//   T          __half or __nv_bfloat16
//   D          head dim (multiple of 16)
//   BLOCK_M    Q rows per block = NWARPS * WARP_M, WARP_M = 16 * MF
//   BLOCK_N    keys per KV tile (multiple of 16)
//   NWARPS     warps per block
//   CAUSAL     bottom-right aligned causal mask (query i sees key j iff j <= i + seqlen_k - seqlen_q)
//   MOD        MOD_SCORE: the score modifiers -- window band, soft-cap, ALiBi -- from the parameter block
//              (attn/mask.cuh; CAUSAL false, a causal window being the band with right = 0); MOD_SCORE_DROPOUT:
//              with dropout (attn/dropout.cuh: P zeroed where dropped before O += P V, O scaled by 1 / (1 - p))
//   SPLIT      write a partial (o, lse) per KV split in fp32 for flash_combine_kernel (Flash-Decoding)
//   SMEM_BYTES dynamic shared memory the host reserves; checked here against the layout
//   EXP_VARIANT how P = exp(scale * s - m) is computed (attn/softmax.cuh: ExpVariant). The default is the fast
//              path; the others exist only so the V1 -> V2 ladder can measure what the instruction-level choices buy.
//   KUNROLL    k16 steps of S = Q K^T unrolled per loop trip (0: all; cuflash/_configs.py: FwdTile.kunroll).
//              Fully unrolled, ptxas hoists later steps' ldmatrix; with 64-key tiles at head dim 128 that runs
//              out of 255 registers. On sm_80 at most 2 steps per trip: 4 spill 8 B there (NVRTC 13.0), while on
//              sm_90 4 fit and were measured 1-2% faster than 2 (bench/NOTES.md, forward tiles).
//   DO         O columns per block (0: D). Below D (head dim 512: two blocks of 256 columns) each block computes
//              S = Q K^T over all of D and O = P V for its columns [split * DO, +DO) only, the split index of the
//              grid naming the column slice: the O accumulators of a 512-wide head do not fit one thread's
//              registers, and the Q K^T of one slice is repeated by the other (1.5x the FLOPs of one block).
//   VARLEN     packed sequences (attn/seqlen.cuh: FwdParams::cu_seqlens_q; the grid over every element's tiles)
//   UA         rows that are not 16-byte units (a head dim that is not a multiple of 8, strides or base addresses
//              that are not 16-byte aligned): every global access of Q, K, V and O element by element, predicated on
//              the head dim (common/tile.cuh: PAD_ELEM; columns past it zero in shared memory, never stored). The
//              host compiles it with the score-modifier masks only (plain and causal calls run as bands there).
//   LOAD_AT    where a step issues the cp.async of the next K / V tile: 0 right after the barrier, 1 after
//              S = Q K^T. Later issue keeps the S registers live across the copies, so ptxas cannot hand the
//              copies' address registers to S (the zeroing of S then waited for the copies to read them:
//              bench/NOTES.md, forward tiles). Issuing after the softmax, or K after S and V after the softmax,
//              was measured too and removed.
//   CAP_MAX    MOD_SCORE without dropout, fixed lengths: on tiles where the soft-cap is the only change for a warp's
//              rows (Mask::cap_only), the row max taken of the raw scores and capped once (the Hopper forward's
//              form, cuda_src/flash_fwd_sm90.cu); false by default (cuflash/_configs.py: FwdTile.cap_max)
#include "common/ptx.cuh"
#include "common/tile.cuh"
#include "common/warp_gemm.cuh"
#include "attn/params.cuh"
#include "attn/seqlen.cuh"
#include "attn/mask.cuh"
#include "attn/block.cuh"
#include "attn/softmax.cuh"
#include "attn/dropout.cuh"
#include "attn/rotary.cuh"

namespace cuflash {

template <typename T, int D, int BLOCK_M, int BLOCK_N, int NWARPS, bool CAUSAL, bool SPLIT, int SMEM_BYTES,
          int EXP_VARIANT = EXP_FFMA_EX2, int KUNROLL = 0, int LOAD_AT = 0, int MOD = MOD_NONE, int DO = 0,
          bool VARLEN = false, bool UA = false, bool CAP_MAX = false>
// Launch bounds: the packed head-dim-32 kernel is capped at 168 registers by ptxas for sm_90 (to fit more blocks)
// and spills 28 B there; one block per SM as the minimum (0: none) lets it keep its registers.
__global__ void __launch_bounds__(NWARPS * 32, VARLEN && D <= 32 ? 1 : 0)
    flash_fwd_kernel(const __grid_constant__ FwdParams p) {
  constexpr int NT = NWARPS * 32;
  constexpr int WARP_M = BLOCK_M / NWARPS;  // Q rows per warp
  constexpr int MF = WARP_M / 16;           // m16 fragments per warp
  constexpr int NF = BLOCK_N / 8;           // n8 fragments of S per row band
  constexpr int DV = DO ? DO : D;           // O (and V) columns of this block
  constexpr int DF = DV / 8;                // n8 fragments of O per row band
  constexpr int KD = D / 16;                // k16 steps of Q K^T
  constexpr int KN = BLOCK_N / 16;          // k16 steps of P V
  constexpr int LDS = PaddedRow<D>::LDS;
  constexpr int LDSV = PaddedRow<DV>::LDS;  // V tile rows
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  constexpr int KU = KUNROLL > 2 ? 2 : KUNROLL;  // sm_80: see KUNROLL above
  constexpr bool SM80_CODE = true;
#else
  // EXP_PRECISE (a V1-ladder rung: libdevice expf) needs registers that 4 steps per trip with LOAD_AT = 1
  // do not leave (16 B of spills under NVRTC 13.0): it gets 2, like sm_80.
  constexpr int KU = EXP_VARIANT == EXP_PRECISE && KUNROLL > 2 ? 2 : KUNROLL;
  constexpr bool SM80_CODE = false;
#endif
  static_assert(LOAD_AT == 0 || LOAD_AT == 1, "LOAD_AT: 0 or 1");
  constexpr bool DROP = (MOD & MOD_DROPOUT) != 0;
  static_assert(!(DROP && SPLIT), "dropout: the plain forward only");
  static_assert(!(VARLEN && SPLIT), "packed sequences: the plain forward only");
  static_assert(!(UA && SPLIT), "rows that are not 16-byte units: the plain forward only");
  static_assert(!CAP_MAX || (MOD == MOD_SCORE && !SPLIT), "the capped-max form: the modifier kernels without dropout");
  constexpr int PAD_Q = UA ? PAD_ELEM : PAD_ZERO, PAD_KV = UA ? PAD_ELEM : PAD_COPY;
  static_assert(WARP_M % 16 == 0 && BLOCK_M == NWARPS * WARP_M, "each warp owns whole m16 fragments");
  static_assert(D % 16 == 0 && BLOCK_N % 16 == 0 && NF % 2 == 0 && DF % 2 == 0, "tile shapes");
  static_assert(D % DV == 0 && DV % 16 == 0 && (DV == D || !SPLIT), "O column slices: whole n8 pairs, no split-KV");
  static_assert(SMEM_BYTES == ((BLOCK_M + 2 * BLOCK_N) * LDS + 2 * BLOCK_N * LDSV) * (int)sizeof(T),
                "host smem size must match: Q tile + 2 stages of K and V tiles");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* q_smem = reinterpret_cast<T*>(smem_raw);  // [BLOCK_M][LDS]
  T* k_smem = q_smem + BLOCK_M * LDS;          // [2][BLOCK_N][LDS]
  T* v_smem = k_smem + 2 * BLOCK_N * LDS;      // [2][BLOCK_N][LDSV]

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const FwdBlock blk = fwd_block_coords<BLOCK_M>(p, blockIdx, VARLEN);
  const int m0 = blk.m_block * BLOCK_M;
  const SeqInfo si = seqinfo(p, blk.batch, VARLEN);
  const int seqlen_q = si.seqlen_q, seqlen_k = si.seqlen_k;
  if (VARLEN && m0 >= seqlen_q) return;  // a tile past this element's rows (attn/seqlen.cuh)
  const Mask<CAUSAL, MOD> mask = si.mask<CAUSAL, MOD>(p, blk.batch, blk.head);
  const int hd = (int)p.head_dim;  // the inputs' head dim (<= D; attn/params.cuh)
  const int o_col0 = DV == D ? 0 : blk.split * DV;  // this block's O (and V) columns
  const int hd_v = DV == D ? hd : min(DV, hd - o_col0);

  const T* q_ptr = reinterpret_cast<const T*>(p.q) +
                   si.q_offset(p.q_batch_stride, p.q_row_stride, p.q_head_stride, blk.batch, blk.head);
  const int64_t kv_head = blk.head / p.heads_per_kv;  // GQA/MQA: shared K/V head, no copy
  const T* k_ptr = reinterpret_cast<const T*>(p.k) +
                   si.k_offset(p.k_batch_stride, p.k_row_stride, p.k_head_stride, blk.batch, kv_head);
  const T* v_ptr = reinterpret_cast<const T*>(p.v) +
                   si.k_offset(p.v_batch_stride, p.v_row_stride, p.v_head_stride, blk.batch, kv_head) + o_col0;

  // KV tiles this block visits: [n_begin, n_end) (attn/block.cuh). Causal: tiles entirely above the diagonal of
  // the last row of this Q tile are never loaded. Split-KV: this row's own KV tiles, cut into num_splits
  // contiguous ranges (empty past the end).
  int n_end = kv_block_end<BLOCK_N>(mask, m0 + BLOCK_M);
  int n_begin = kv_block_begin<BLOCK_N>(mask, m0);
  if (SPLIT) {
    const BlockRange r =
        split_range(n_begin, (seqlen_k + BLOCK_N - 1) / BLOCK_N, n_end, blk.split, (int)p.num_splits);
    n_begin = r.begin;
    n_end = r.end;
  }

  // Per-thread state: O, and the online softmax of rows (g, g + 8) of each of the warp's MF m16 fragments
  // (attn/softmax.cuh: m in log2 units, lazy re-scaling, thread-partial l).
  float acc_o[MF][DF][4];
#pragma unroll
  for (int mf = 0; mf < MF; ++mf) zero_frags(acc_o[mf]);
  OnlineSoftmax<MF> softmax;
  // (common/ptx.cuh, held: HOLD_THREAD for the packed-sequence dropout kernel at head dim 128, 4 B of spills on sm_80
  // without it; HOLD_UNIFORM for the V1 ladder's libdevice-expf rung at head dim 128 on sm_80, 24 B under NVRTC 13.5)
  constexpr int HOLD = VARLEN && DROP && D == 128                                ? HOLD_THREAD
                       : EXP_VARIANT == EXP_PRECISE && D == 128 && SM80_CODE ? HOLD_UNIFORM
                                                                             : HOLD_NONE;
  const float scale_log2 = held<HOLD>(p.scale_log2);
  // Q fragments live in registers when they fit next to the S tile (<= 32 registers with an S tile at most
  // 64 keys wide, or Q + S <= 80: head dim 128 with 16-key tiles); otherwise they are re-read from shared
  // memory at every k16 step.
  constexpr int Q_REGS = MF * KD * 4, S_REGS = MF * NF * 4;
  constexpr bool Q_IN_REGS = (Q_REGS <= 32 && NF <= 8) || (Q_REGS + S_REGS <= 80 && D <= 128);
  // Shared addresses (bytes) with this lane's ldmatrix offsets folded in once: every fragment below is a
  // compile-time constant away ([register + immediate]). Q: the warp's rows; K, V: stage 0 (stage 1 is
  // BLOCK_N rows further).
  const uint32_t q_lane = smem_addr(q_smem) + 2u * warp * WARP_M * LDS + lane_off_a<false, LDS>(lane);
  const uint32_t k_lane = smem_addr(k_smem) + lane_off_b<false, LDS>(lane);
  const uint32_t v_lane = smem_addr(v_smem) + lane_off_b<true, LDSV>(lane);
  constexpr uint32_t STAGE_BYTES = 2u * BLOCK_N * LDS, STAGE_BYTES_V = 2u * BLOCK_N * LDSV;
  // ldmatrix row address of this lane for the A fragment (m16 block mf, k16 block kd) of the warp's Q rows
  auto q_frag_addr = [&](int mf, int kd) { return q_lane + 2u * (mf * 16 * LDS + kd * 16); };
  uint32_t q_frag[Q_IN_REGS ? MF : 1][Q_IN_REGS ? KD : 1][4];

  // ---- the pieces of one KV tile's work, in the order the loop below runs them ----
  // S = Q K^T  [WARP_M, BLOCK_N] per warp. B operand (K^T, col-major) = rows of K: plain ldmatrix;
  // one x4 gives b0, b1 of two adjacent n8 fragments.
  auto compute_s = [&](float (&s)[MF][NF][4], uint32_t k_addr) {
    gemm_abt_x4<T, MF, NF, KD, (KU && KU < KD ? KU : KD)>(
        s,
        [&](uint32_t (&a)[4], int mf, int kd) {
          if constexpr (Q_IN_REGS) {
#pragma unroll
            for (int e = 0; e < 4; ++e) a[e] = q_frag[mf][kd][e];
          } else {
            ldmatrix_x4(a, q_frag_addr(mf, kd));
          }
        },
        [&](int nf, int kd) { return k_addr + 2u * (nf * 8 * LDS + kd * 16); });
  };
  // Mask only tiles that cross the end of the keys or the band's edges, or all with a value modifier (uniform
  // branch per tile). MOD_SCORE: shift gets the rows' ALiBi term the scores are left short of (attn/mask.cuh).
  auto mask_s = [&](float (&s)[MF][NF][4], float (&shift)[MF][2], int n) {
    const int col0 = n * BLOCK_N;
    if (mask.needs_mask(m0, m0 + BLOCK_M - 1, col0, col0 + BLOCK_N - 1))
      mask.apply(s, m0 + warp * WARP_M, col0, lane, shift);
    else
      mask.clear_shift(shift);
  };
  // The masked scores of tile n, then the new row max (whether a row of this lane moved). CAP_MAX: on a tile where
  // the soft-cap is the only change for this warp's rows (Mask::cap_only: warp-uniform), the row max is taken of the
  // raw scores and capped once (OnlineSoftmax::update_max_capped; the Hopper forward's form), so that its reduction
  // does not wait for the per-score tanh.
  auto mask_and_max = [&](float (&s)[MF][NF][4], float (&shift)[MF][2], int n) {
    if constexpr (CAP_MAX) {
      const int r0 = m0 + warp * WARP_M;
      if (mask.cap_only(r0, r0 + WARP_M - 1, n * BLOCK_N, n * BLOCK_N + BLOCK_N - 1)) {
        mask.clear_shift(shift);
        return softmax.update_max_capped(s, scale_log2, mask.cap_pre);
      }
    }
    mask_s(s, shift, n);
    return softmax.update_max(s, scale_log2, mask.shift_arg(shift));
  };
  // acc_o += P V. A operand: P packed to 16 bits one k16 step at a time, straight from the accumulator
  // registers (k16 step kn = S fragments 2kn, 2kn + 1: the C layout is the A layout; no smem trip). B operand
  // (V, [keys, d] row-major, needed col-major) from ldmatrix.trans.
  auto accumulate_pv = [&](const float (&p)[MF][NF][4], uint32_t v_addr) {
    gemm_pv_x4<T, MF, KN, DF>(
        acc_o, [&](uint32_t (&a)[4], int mf, int kn) { frag_to_a<T>(p[mf], kn, a); },
        [&](int kn, int df) { return v_addr + 2u * (kn * 16 * LDSV + df * 8); });
  };

  const int num_tiles = n_end - n_begin;
  if (num_tiles > 0) {
    // Tiles are processed from the last in memory (i = 0: n = n_end - 1) to the first, so the only
    // tiles that need a mask (the ragged end and the diagonal) come first. Tile i lives in stage i % 2.
    auto tile_n = [&](int i) { return n_end - 1 - i; };
    auto k_stage = [&](int i) { return k_smem + (i & 1) * BLOCK_N * LDS; };
    auto v_stage = [&](int i) { return v_smem + (i & 1) * BLOCK_N * LDSV; };
    // Every tile but the first may be loaded without bounds checks (it lies below a full tile's end).
    const FullTileLoader<BLOCK_N, D, NT, T, UA> k_loader(k_ptr, p.k_row_stride, tid, hd);
    const FullTileLoader<BLOCK_N, DV, NT, T, UA> v_loader(v_ptr, p.v_row_stride, tid, hd_v);

    // A warp whose rows all lie past seqlen_q (ragged last tile; decoding) only helps with the loads, and
    // so does a warp on a causal tile that lies entirely above the diagonal of its own rows, or outside their
    // window band (its rows see none of the tile's keys; the block visits the tile for the other warps).
    const bool warp_has_rows = m0 + warp * WARP_M < seqlen_q;
    auto warp_active = [&](int i) {
      if constexpr (MOD == MOD_NONE)
        return warp_has_rows && !mask.above_diagonal(m0 + warp * WARP_M + WARP_M - 1, tile_n(i) * BLOCK_N);
      else
        return warp_has_rows && !mask.above_diagonal(m0 + warp * WARP_M + WARP_M - 1, tile_n(i) * BLOCK_N) &&
               !mask.left_of_window(m0 + warp * WARP_M, tile_n(i) * BLOCK_N + BLOCK_N - 1);
    };
    float s_a[MF][NF][4];
    auto load_q_frags = [&]() {
      if constexpr (Q_IN_REGS) {
#pragma unroll
        for (int mf = 0; mf < MF; ++mf)
#pragma unroll
          for (int kd = 0; kd < KD; ++kd) ldmatrix_x4(q_frag[mf][kd], q_frag_addr(mf, kd));
      }
    };

    // One barrier per tile. At the top of step i, tile i (issued one step ago) has landed; the barrier
    // makes it visible AND proves every warp is done with the other stage, which is then refilled with
    // tile i+1 while this step computes on tile i.
    // a head dim below D (common/tile.cuh): Q zero-padded, K and V PAD_COPY (S = Q K^T is exact, O's padding
    // columns are not stored)
    load_tile_async<BLOCK_M, D, NT, PAD_Q>(q_smem, q_ptr, p.q_row_stride, m0, seqlen_q, tid, hd);
    load_tile_async<BLOCK_N, D, NT, PAD_KV>(k_stage(0), k_ptr, p.k_row_stride, tile_n(0) * BLOCK_N, seqlen_k, tid,
                                              hd);
    load_tile_async<BLOCK_N, DV, NT, PAD_KV>(v_stage(0), v_ptr, p.v_row_stride, tile_n(0) * BLOCK_N, seqlen_k, tid,
                                               hd_v);
    cp_async_commit();
    for (int i = 0; i < num_tiles; ++i) {
      cp_async_wait<0>();
      __syncthreads();
      if (i == 0 && warp_has_rows) load_q_frags();
      // every thread issues K and V of the next tile once per step, where LOAD_AT says
      auto issue_next = [&]() {
        if (i + 1 < num_tiles) {
          k_loader.copy(k_stage(i + 1), tile_n(i + 1) * BLOCK_N);
          v_loader.copy(v_stage(i + 1), tile_n(i + 1) * BLOCK_N);
          cp_async_commit();
        }
      };
      if (LOAD_AT == 0) issue_next();
      if (!warp_active(i)) {
        if (LOAD_AT != 0) issue_next();
        continue;
      }
      compute_s(s_a, k_lane + (i & 1) * STAGE_BYTES);
      if (LOAD_AT == 1) issue_next();
      float shift[MF][2];
      if (__any_sync(0xffffffffu, mask_and_max(s_a, shift, tile_n(i)))) softmax.rescale(acc_o);
      softmax.exp_and_sum<EXP_VARIANT>(s_a, scale_log2, mask.shift_arg(shift));
      if constexpr (DROP)  // the row sums keep every probability; O += P V only the kept ones
        Dropout(p, (int64_t)blk.batch * p.nheads + blk.head)
            .apply<false>(s_a, m0 + warp * WARP_M, tile_n(i) * BLOCK_N, lane);
      accumulate_pv(s_a, v_lane + (i & 1) * STAGE_BYTES_V);
    }
  }

  // Epilogue. l is reduced across the quad once; O = acc_o / l (0 for rows that saw no key). The head, batch
  // and split are derived again from a fresh read of blockIdx (cheap) rather than kept live across the KV
  // loop: at head dim 128 the loop uses all 255 registers, and NVRTC 13.0 otherwise spills them.
  const FwdBlock eblk = fwd_block_coords<BLOCK_M>(p, block_idx_reread(), VARLEN);
  const SeqInfo esi = seqinfo(p, eblk.batch, VARLEN);
  const int64_t bh = (int64_t)eblk.batch * p.nheads + eblk.head;
  float lse[MF][2];
  softmax.finalize(acc_o, lse);
  if constexpr (DROP) scale_frags(acc_o, (float)p.dropout_scale);  // O / (1 - p)
#pragma unroll
  for (int mf = 0; mf < MF; ++mf)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = m0 + warp * WARP_M + mf * 16 + g + h * 8;
      if (t == 0 && row < esi.seqlen_q && (DV == D || eblk.split == 0)) {  // (O column slices: the first writes it)
        if (SPLIT)
          p.lse_accum[((int64_t)eblk.split * p.batch * p.nheads + bh) * esi.seqlen_q + row] = lse[mf][h];
        else if (p.lse)
          p.lse[lse_row0(p, esi, eblk.batch, eblk.head, VARLEN) + row] = lse[mf][h];
      }
    }

  if (SPLIT) {  // fp32 partial output [split, b, h, sq, d], float2 stores
    float* o_acc = p.o_accum + (((int64_t)eblk.split * p.batch * p.nheads + bh) * esi.seqlen_q) * D;
#pragma unroll
    for (int mf = 0; mf < MF; ++mf)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = m0 + warp * WARP_M + mf * 16 + g + h * 8;
        if (row < esi.seqlen_q)
#pragma unroll
          for (int df = 0; df < DF; ++df)
            *reinterpret_cast<float2*>(o_acc + (int64_t)row * D + df * 8 + 2 * t) =
                make_float2(acc_o[mf][df][2 * h], acc_o[mf][df][2 * h + 1]);
      }
    return;
  }

  // O -> the warp's own rows of the Q tile in smem (only this warp ever read them) -> 16-byte stores.
  T* o_tile = q_smem + warp * WARP_M * LDS;  // [WARP_M][LDS]
#pragma unroll
  for (int mf = 0; mf < MF; ++mf)
#pragma unroll
    for (int df = 0; df < DF; ++df)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        *reinterpret_cast<uint32_t*>(o_tile + (mf * 16 + g + h * 8) * LDS + df * 8 + 2 * t) =
            pack2<T>(acc_o[mf][df][2 * h], acc_o[mf][df][2 * h + 1]);
  __syncwarp();
  const int e_col0 = DV == D ? 0 : eblk.split * DV;
  T* o_ptr = reinterpret_cast<T*>(p.o) +
             esi.q_offset(p.o_batch_stride, p.o_row_stride, p.o_head_stride, eblk.batch, eblk.head) + e_col0;
  constexpr int CHUNKS = WARP_M * DV / 8;
#pragma unroll
  for (int c = lane; c < CHUNKS; c += 32) {
    const int r = c / (DV / 8), col = (c % (DV / 8)) * 8;
    const int row = m0 + warp * WARP_M + r;
    if (row < esi.seqlen_q && col < (int)p.head_dim - e_col0) {
      if constexpr (UA)
        store_elems(o_ptr + (int64_t)row * p.o_row_stride + col, *reinterpret_cast<const uint4*>(o_tile + r * LDS + col),
                    (int)p.head_dim - e_col0 - col);
      else
        *reinterpret_cast<uint4*>(o_ptr + (int64_t)row * p.o_row_stride + col) =
            *reinterpret_cast<const uint4*>(o_tile + r * LDS + col);
    }
  }
}

// Flash-Decoding combine: out = sum_s exp(lse_s - lse) * o_s,  lse = log sum_s exp(lse_s).
// One warp per (batch, head, query row), blockDim.x / 32 rows per block; lanes split the head dim. Splits that saw no key have
// lse_s = -inf and weight 0; if every split is empty the row is zeros with lse = -inf (no NaN).
template <typename T, int D>
__global__ void flash_combine_kernel(const __grid_constant__ FwdParams p) {
  static_assert(D % 32 == 0, "lanes split the head dim evenly");
  const int64_t rows = p.batch * p.nheads * p.seqlen_q;
  const int64_t row = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const int64_t split_stride = rows;  // partial-LSE elements per split
  const int num_splits = (int)p.num_splits;

  float lse_max = -INFINITY;
  for (int s = lane; s < num_splits; s += 32) lse_max = fmaxf(lse_max, p.lse_accum[s * split_stride + row]);
#pragma unroll
  for (int o = 16; o > 0; o /= 2) lse_max = fmaxf(lse_max, __shfl_xor_sync(0xffffffffu, lse_max, o));
  const float base = lse_max == -INFINITY ? 0.f : lse_max;
  float sum = 0.f;
  for (int s = lane; s < num_splits; s += 32) sum += __expf(p.lse_accum[s * split_stride + row] - base);
#pragma unroll
  for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  const float lse = sum > 0.f ? base + __logf(sum) : -INFINITY;

  constexpr int PER_LANE = D / 32;
  float acc[PER_LANE];
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) acc[i] = 0.f;
  for (int s = 0; s < num_splits; ++s) {
    const float lse_s = p.lse_accum[s * split_stride + row];
    if (lse_s == -INFINITY) continue;  // empty split (uniform across the warp)
    const float w = __expf(lse_s - lse);
    const float* o_s = p.o_accum + (s * split_stride + row) * D;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) acc[i] += w * o_s[lane + 32 * i];
  }
  const int64_t i = row % p.seqlen_q, bh = row / p.seqlen_q;
  const int64_t h = bh % p.nheads, b = bh / p.nheads;
  T* o = reinterpret_cast<T*>(p.o) + b * p.o_batch_stride + i * p.o_row_stride + h * p.o_head_stride;
#pragma unroll
  for (int k = 0; k < PER_LANE; ++k)
    if (lane + 32 * k < p.head_dim) o[lane + 32 * k] = static_cast<T>(acc[k]);
  if (p.lse && lane == 0) p.lse[row] = lse;
}

}  // namespace cuflash

namespace cuflash {

// The keep mask of a dropout call (attn/dropout.cuh): mask[bh][i][j] = 1 where the attention kernels keep the
// probability of (batch * nheads + head, query i, key j), else 0; uint8 [batch * nheads, seqlen_q, seqlen_k] at p.o.
// One thread per Philox group. Reads batch, nheads, seqlen_q, seqlen_k and the dropout fields of the block.
__global__ void dropout_mask_kernel(const __grid_constant__ FwdParams p) {
  const int64_t sq = p.seqlen_q, sk = p.seqlen_k;
  const int64_t row_groups = (sq + 15) / 16 * 8, col_groups = (sk + 15) / 16 * 4;
  const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= p.batch * p.nheads * row_groups * col_groups) return;
  const int64_t cg = idx % col_groups, rg = idx / col_groups % row_groups, bh = idx / (col_groups * row_groups);
  const Dropout drop(p, bh);
  const uint4 r = drop.group((uint32_t)rg, (uint32_t)cg);
  const int64_t i0 = rg / 8 * 16 + rg % 8, j0 = cg / 4 * 16 + 2 * (cg % 4);
  unsigned char* mask = reinterpret_cast<unsigned char*>(p.o) + bh * sq * sk;
#pragma unroll
  for (int a = 0; a < 2; ++a)
#pragma unroll
    for (int b = 0; b < 2; ++b)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int64_t i = i0 + 8 * a, j = j0 + 8 * b + e;
        if (i < sq && j < sk) mask[i * sk + j] = drop.kept(r, a * 2 + b, e) ? 1 : 0;
      }
}

// KV-cache append, before attending: k_cache[b, seqlens[b] + i] = k_new[b, i] and the same for v, one
// 16-byte chunk per thread (headdim, a multiple of 8, is a run-time value: any head dim the attention kernels
// take; UA: any head dim and 2-byte aligned rows, each chunk element by element). Rows that would land past the
// cache's capacity (seqlen_cache) are dropped (the attention kernel clamps the key count to the capacity too). Strides in elements; last dims contiguous. The cache indirections of
// flash_attn_with_kvcache (null: none):
//   cache_batch_idx [b]  element b writes cache row cache_batch_idx[b] (kc_bs / vc_bs apart);
//   block_table [b, bt_stride]  paged: cache row r of element b is row r % page_size of page
//                        block_table[b, r / page_size] (kc_bs / vc_bs: the page strides);
//   rotary_cos / rotary_sin [seqlen_ro, rotary_dim / 2]  the new keys are rotated first (attn/rotary.cuh), key i
//                        of element b at position seqlens[b] + i; the values are copied as they are.
template <typename T, bool UA = false>
__global__ void kvcache_append_kernel(T* k_cache, T* v_cache, const T* k_new, const T* v_new, const int* seqlens,
                                      const int* block_table, const int* cache_batch_idx, const void* rotary_cos,
                                      const void* rotary_sin, int64_t kc_bs, int64_t kc_rs, int64_t kc_hs,
                                      int64_t vc_bs, int64_t vc_rs, int64_t vc_hs, int64_t kn_bs, int64_t kn_rs,
                                      int64_t kn_hs, int64_t vn_bs, int64_t vn_rs, int64_t vn_hs, int64_t batch,
                                      int64_t seqlen_new, int64_t nheads_k, int64_t seqlen_cache, int64_t headdim,
                                      int64_t bt_stride, int64_t page_size, int64_t rotary_dim,
                                      int64_t rotary_interleaved, int64_t seqlen_ro) {
  // PDL: the decode kernel launched after it (cuflash/decode.py) may start its set-up now; it waits for this grid to
  // complete before it reads the cache (cuda_src/flash_decode.cu).
  grid_launch_dependents();
  const int64_t CHUNKS = (headdim + 7) / 8;
  const int64_t per_tensor = batch * seqlen_new * nheads_k * CHUNKS;
  int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= 2 * per_tensor) return;
  const bool is_v = idx >= per_tensor;
  idx -= is_v ? per_tensor : 0;
  const int c = (int)(idx % CHUNKS) * 8;
  int64_t r = idx / CHUNKS;
  const int64_t h = r % nheads_k;
  r /= nheads_k;
  const int64_t i = r % seqlen_new, b = r / seqlen_new;
  const int pos = seqlens[b] + (int)i;
  if (pos >= seqlen_cache) return;
  // the destination: (cache row, row in it) -- the page and its row when paged
  int64_t dst_b = cache_batch_idx ? cache_batch_idx[b] : b, dst_row = pos;
  if (block_table) {
    dst_b = block_table[b * bt_stride + pos / page_size];
    dst_row = pos % page_size;
  }
  const T* src = is_v ? v_new + b * vn_bs + i * vn_rs + h * vn_hs : k_new + b * kn_bs + i * kn_rs + h * kn_hs;
  T* dst = is_v ? v_cache + dst_b * vc_bs + dst_row * vc_rs + h * vc_hs : k_cache + dst_b * kc_bs + dst_row * kc_rs + h * kc_hs;
  if constexpr (UA) {
    uint4 x;
    if (!is_v && rotary_cos)
      x = rotary_row<T>(rotary_cos, rotary_sin, (int)rotary_dim, rotary_interleaved != 0, (int)seqlen_ro, pos)
              .chunk_elems(src, c, (int)headdim);
    else
      x = load_elems(src + c, (int)headdim - c);
    store_elems(dst + c, x, (int)headdim - c);
    return;
  }
  uint4 x = *reinterpret_cast<const uint4*>(src + c);
  if (!is_v && rotary_cos) {
    const RotaryRow<T> rot = rotary_row<T>(rotary_cos, rotary_sin, (int)rotary_dim, rotary_interleaved != 0,
                                           (int)seqlen_ro, pos);
    x = rot.chunk(x, *reinterpret_cast<const uint4*>(src + rot.partner_col(c)), c);
  }
  *reinterpret_cast<uint4*>(dst + c) = x;
}

// Paged K/V of packed sequences, gathered into packed rows (flash_attn_varlen_func with a block_table; the packed
// kernels then read them as any packed K/V): key r of sequence b, row r % page_size of page
// block_table[b, r / page_size] of k_pages, v_pages [pages, page_size, nheads_k, headdim], goes to packed row
// cu_seqlens_k[b] + r of k_out, v_out [rows, nheads_k, headdim] (contiguous; rows >= cu_seqlens_k[batch], the total,
// which the host does not read). The rows after the total are zeroed: a kernel whose last KV tile runs past the last
// sequence reads them (the Hopper forward's TMA tiles; a zero V row times a zero probability stays 0, a stale one
// could be NaN), and the output is the same on every call. One 16-byte chunk per thread; a thread finds its
// sequence by an upper-bound binary search over cu_seqlens_k. Strides in elements, last dims contiguous. UA: rows that
// are not 16-byte units (any head dim, 2-byte aligned pages), each chunk element by element.
template <typename T, bool UA = false>
__global__ void paged_kv_gather_kernel(T* k_out, T* v_out, const T* k_pages, const T* v_pages,
                                       const int* cu_seqlens_k, const int* block_table, int64_t kp_ps, int64_t kp_rs,
                                       int64_t kp_hs, int64_t vp_ps, int64_t vp_rs, int64_t vp_hs, int64_t batch,
                                       int64_t rows, int64_t nheads_k, int64_t headdim, int64_t bt_stride,
                                       int64_t page_size) {
  const int64_t CHUNKS = UA ? (headdim + 7) / 8 : headdim / 8;
  const int64_t per_tensor = rows * nheads_k * CHUNKS;
  int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= 2 * per_tensor) return;
  const bool is_v = idx >= per_tensor;
  idx -= is_v ? per_tensor : 0;
  const int64_t c = idx % CHUNKS * 8, h = idx / CHUNKS % nheads_k, t = idx / (CHUNKS * nheads_k);
  T* dst = (is_v ? v_out : k_out) + (t * nheads_k + h) * headdim;
  const int64_t total = __ldg(cu_seqlens_k + batch);
  const int n = (int)(headdim - c);  // the chunk's columns (UA: fewer than 8 in a row's last chunk)
  if (t >= total) {
    if constexpr (UA)
      store_elems(dst + c, make_uint4(0u, 0u, 0u, 0u), n);
    else
      *reinterpret_cast<uint4*>(dst + c) = make_uint4(0u, 0u, 0u, 0u);
    return;
  }
  int lo = 0, hi = (int)batch - 1;  // the last sequence b with cu[b] <= t
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (__ldg(cu_seqlens_k + mid) <= t) lo = mid; else hi = mid - 1;
  }
  const int64_t r = t - __ldg(cu_seqlens_k + lo);
  const int64_t page = __ldg(block_table + lo * bt_stride + r / page_size), in_page = r % page_size;
  const T* src = is_v ? v_pages + page * vp_ps + in_page * vp_rs + h * vp_hs
                      : k_pages + page * kp_ps + in_page * kp_rs + h * kp_hs;
  if constexpr (UA)
    store_elems(dst + c, load_elems(src + c, n), n);
  else
    *reinterpret_cast<uint4*>(dst + c) = *reinterpret_cast<const uint4*>(src + c);
}

}  // namespace cuflash
