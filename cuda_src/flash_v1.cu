// cuda_src/flash_v1.cu -- FlashAttention-1 (Dao et al. 2022): forward (Algorithm 1) and backward
// (Algorithm 4, no dropout), built from the same mma.sync / ldmatrix / cp.async primitives as V2.
//
// What makes it V1 rather than V2 is the loop order and where the running state lives:
//
//   forward, one thread block per (head, batch) -- the only parallelism:
//     for each KV tile j:                           K_j, V_j -> smem, once
//       for each Q tile i (causal: skip pairs entirely above the diagonal):
//         Q_i -> smem (cp.async, double-buffered);  O_i, m_i, l_i <- HBM (skipped on the first visit)
//         S = Q_i K_j^T,  m~ = rowmax(S),  P~ = exp(S - m~),  l~ = rowsum(P~)        (Alg. 1 line 10)
//         m_new = max(m_i, m~),  l_new = e^{m_i - m_new} l_i + e^{m~ - m_new} l~      (line 11)
//         O_i = diag(l_new)^-1 (diag(l_i) e^{m_i - m_new} O_i + e^{m~ - m_new} P~ V_j)  (line 12)
//         O_i (fp32), m_i, l_i -> HBM;  the last KV tile that visits row block i writes O_i in the input
//         dtype and LSE = m + log l instead of the fp32 O_i                          (line 13)
//
//   backward, one thread block per (KV head, batch), looping over the query heads of the group:
//     for each KV tile j:  K_j, V_j -> smem;  dK_j = dV_j = 0 in registers
//       for each (query head, Q tile i) with a visible key in tile j:
//         Q_i, dO_i, O_i, dQ_i (fp32), m_i, l_i -> smem (cp.async, double-buffered)
//         D_i  = rowsum(dO_i * O_i)               recomputed for every (j, i): V1 stores no D
//         P    = diag(l_i)^-1 exp(S - m_i)        from m and l (V2: exp(S - LSE), one exp, no divide)
//         dV_j += P^T dO_i,  dP = dO_i V_j^T,  dS = P * (dP - D_i),  dK_j += dS^T Q_i
//         dQ_i += dS K_j -> HBM                   fp32 read-modify-write (sole writer: no atomics)
//       dK_j, dV_j -> HBM, once
//   then dQ = softmax_scale * dQ_accum in the input dtype (flash_v1_bwd_convert_dq_kernel).
//
// Exponentials use the project's base-2 form (ptx.cuh exp2_approx: one FFMA + one MUFU.EX2 with
// scale_log2 = softmax_scale * log2(e) folded on the host), not the paper's natural exp; the m kept in
// HBM is in natural units of the scaled scores (m of scale * Q K^T, as cuflash.reference.flash_v1_forward),
// converted with one multiply (m2 = m * log2(e)) where it is read.
//
// Warp partition of the forward (template argument WARP_SPLIT):
//   SPLIT_K (V1's): the warps split the KV tile's keys. Warp w computes S_w = Q_i K_w^T for its WARP_N keys
//     and every row of the Q tile, with its own partial statistics m~_w, l~_w and partial product
//     P~_w V_w; the partials are combined across warps through shared memory, together with the O_i,
//     m_i, l_i read from HBM (one extra barrier and a [NWARPS, BLOCK_M, D] fp32 exchange per tile).
//   SPLIT_Q (the ladder's middle step): the warps split the Q rows as in V2. A row's statistics live in
//     one quad of one warp, so the warp folds the new tile straight into its registers: no exchange.
// The backward splits the KV rows across warps in either case (warp w owns 16 KV rows of dK_j, dV_j).
#include "common/ptx.cuh"
#include "common/tile.cuh"
#include "common/warp_gemm.cuh"
#include "attn/params.cuh"
#include "attn/seqlen.cuh"
#include "attn/mask.cuh"
#include "attn/block.cuh"
#include "attn/softmax.cuh"

namespace cuflash {

enum WarpSplit { SPLIT_K = 0, SPLIT_Q = 1 };

namespace v1 {

// acc[16 MF, 8 NF] = A B^T: A = rows [0, 16 MF) of a_tile, B = rows [0, 8 NF) of b_tile, both [rows][LDS]
// 16-bit smem tiles contracting over their D columns. Both operands by plain ldmatrix: the A fragment of
// rows (lane % 16), the B fragment (B^T col-major = rows of b_tile) two n8 blocks per x4 -- the Q K^T of
// flash_fwd.cu, also used for K Q^T and V dO^T in the backward.
template <typename T, int MF, int NF, int KD, int LDS, int UNROLL = KD>
__device__ __forceinline__ void gemm_abt(float (&acc)[MF][NF][4], const T* a_tile, const T* b_tile, int lane) {
  gemm_abt_x4<T, MF, NF, KD, UNROLL>(
      acc,
      [&](uint32_t (&a)[4], int mf, int kd) {
        ldmatrix_x4(a, smem_addr(a_tile + (mf * 16 + (lane % 16)) * LDS + kd * 16 + (lane / 16) * 8));
      },
      [&](int nf, int kd) {
        return smem_addr(b_tile + (nf * 8 + (lane % 8) + (lane / 16) * 8) * LDS + kd * 16 + ((lane / 8) % 2) * 8);
      });
}

template <typename T, int MF, int KN, int DF, int LDS>
__device__ __forceinline__ void gemm_pv(float (&acc)[MF][DF][4], const float (&p)[MF][2 * KN][4], const T* v_tile,
                                        int lane) {
  gemm_pv_x4<T, MF, KN, DF>(acc, [&](uint32_t (&a)[4], int mf, int kn) { frag_to_a<T>(p[mf], kn, a); }, [&](int kn, int df) {
    return smem_addr(v_tile + (kn * 16 + (lane % 8) + ((lane / 8) % 2) * 8) * LDS + df * 8 + (lane / 16) * 8);
  });
}

// load_tile_async (tile.cuh) with register-lean address math, for the backward kernel that runs at the
// register limit. Thread tid copies column chunk tid % CPR of rows r0 + i RPI (r0 = tid / CPR, RPI =
// whole rows per pass; the NT % CPR threads left over idle), so its source addresses are one base plus
// multiples of the row stride, instead of one 64-bit offset per chunk kept live across the loop. Same
// result: rows [row0, row0 + ROWS) of a [nrows, D] matrix into tile[ROWS][D + 8], rows >= nrows zeroed.
template <int ROWS, int D, int NT, typename T>
__device__ __forceinline__ void load_tile_async_lean(T* tile, const T* gmem, int64_t row_stride, int row0, int nrows,
                                                     int tid) {
  constexpr int LDS = PaddedRow<D>::LDS;
  constexpr int CPR = D / 8;     // 16-byte chunks per row
  constexpr int RPI = NT / CPR;  // rows per pass
  static_assert(RPI >= 1, "one pass covers at least one row");
  const int r0 = tid / CPR, col = (tid % CPR) * 8;
  if (r0 >= RPI) return;
  const T* src = gmem + (int64_t)(row0 + r0) * row_stride + col;
#pragma unroll
  for (int i = 0; i < (ROWS + RPI - 1) / RPI; ++i) {
    const int r = r0 + i * RPI;
    if (ROWS % RPI == 0 || r < ROWS) {
      const bool valid = row0 + r < nrows;
      cp_async_16(smem_addr(tile + r * LDS + col), valid ? src + i * RPI * row_stride : gmem, valid);
    }
  }
}

// PTX ISA 9.7.9.25.3.1 cp.async, 4-byte form (.ca: the .cg form is 16-byte only). src_size = 0 reads
// nothing and zero-fills the 4 destination bytes. For the [b, h, sq] row statistics m and l, whose
// rows are neither padded nor 16-byte aligned.
__device__ __forceinline__ void cp_async_4(uint32_t dst_smem, const void* src_gmem, bool valid) {
  const int src_size = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst_smem), "l"(src_gmem), "r"(src_size));
}

// Copy the contiguous fp32 block gmem[ROWS * D] (ROWS whole rows of a [rows][D] matrix, all in bounds: the
// caller pads the matrix to whole tiles) into tile[ROWS][LD] with 16-byte cp.async, NT threads cooperating;
// the same thread -> (column chunk, rows r0 + i RPI) assignment as load_tile_async_lean.
template <int ROWS, int D, int LD, int NT>
__device__ __forceinline__ void load_f32_tile_async(float* tile, const float* gmem, int tid) {
  constexpr int CPR = D / 4;     // 16-byte chunks per row
  constexpr int RPI = NT / CPR;  // rows per pass
  static_assert(RPI >= 1, "one pass covers at least one row");
  const int r0 = tid / CPR, col = (tid % CPR) * 4;
  if (r0 >= RPI) return;
  float* dst = tile + r0 * LD + col;
  const float* src = gmem + r0 * D + col;
#pragma unroll
  for (int i = 0; i < (ROWS + RPI - 1) / RPI; ++i)
    if (ROWS % RPI == 0 || r0 + i * RPI < ROWS) cp_async_16(smem_addr(dst + i * RPI * LD), src + i * RPI * D, true);
}

}  // namespace v1

// ================================================================================================ forward
//
// Template parameters (chosen in cuflash/v1.py):
//   T          __half or __nv_bfloat16
//   D          head dim (multiple of 16)
//   BLOCK_M    Q rows per inner step
//   BLOCK_N    keys per KV tile
//   NWARPS     warps per block
//   WARP_SPLIT SPLIT_K: warp w owns keys [w WARP_N, (w+1) WARP_N) of the KV tile and all BLOCK_M rows;
//              SPLIT_Q: warp w owns rows [w WARP_M, (w+1) WARP_M) of the Q tile and all BLOCK_N keys
//   CAUSAL     bottom-right aligned causal mask (query i sees key j iff j <= i + seqlen_k - seqlen_q)
//   SMEM_BYTES dynamic shared memory the host reserves; checked here against the layout
template <typename T, int D, int BLOCK_M, int BLOCK_N, int NWARPS, int WARP_SPLIT, bool CAUSAL, int SMEM_BYTES>
__global__ void __launch_bounds__(NWARPS * 32, 1) flash_v1_fwd_kernel(const __grid_constant__ V1FwdParams p) {
  constexpr int NT = NWARPS * 32;
  constexpr bool SPLITK = WARP_SPLIT == SPLIT_K;
  constexpr int WARP_M = SPLITK ? BLOCK_M : BLOCK_M / NWARPS;  // Q rows one warp computes
  constexpr int WARP_N = SPLITK ? BLOCK_N / NWARPS : BLOCK_N;  // keys one warp computes
  constexpr int MF = WARP_M / 16;                              // m16 fragments per warp
  constexpr int NF = WARP_N / 8;                               // n8 fragments of S per m16 fragment
  constexpr int DF = D / 8;                                    // n8 fragments of O per m16 fragment
  constexpr int KD = D / 16;                                   // k16 steps of Q K^T
  constexpr int KN = WARP_N / 16;                              // k16 steps of P V
  constexpr int LDS = PaddedRow<D>::LDS;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  // k16 steps of the split-Q S = Q K^T per loop trip: on sm_80 at most 2 (the causal head-dim-64 tile, fully
  // unrolled, spills 8 B at 255 registers under NVRTC 13.0; the V2 forward's KUNROLL has the same sm_80 cap).
  constexpr int U_S = KD > 2 ? 2 : KD;
#else
  constexpr int U_S = KD;
#endif
  // Split-K exchange: fp32 rows padded by 8 floats, so the float2 fragment stores of a half-warp (rows g,
  // columns 2t) hit 16 distinct bank pairs; the combine step reads it back as float4 rows.
  constexpr int LDR = D + 8;
  constexpr int EXCHANGE_FLOATS = SPLITK ? NWARPS * BLOCK_M * (LDR + 2) : 0;
  constexpr int TPR = SPLITK ? NT / BLOCK_M : 1;  // combine step: threads per row ...
  constexpr int CPT = SPLITK ? D / 4 / TPR : 1;   // ... and float4 chunks of the row per thread
  static_assert(WARP_SPLIT == SPLIT_K || WARP_SPLIT == SPLIT_Q, "warp partition");
  static_assert(WARP_M % 16 == 0 && WARP_N % 16 == 0 && (SPLITK ? BLOCK_N == NWARPS * WARP_N : BLOCK_M == NWARPS * WARP_M),
                "each warp owns whole m16 x k16 fragments");
  static_assert(D % 16 == 0 && NF % 2 == 0 && DF % 2 == 0, "tile shapes");
  static_assert(!SPLITK || (NT % BLOCK_M == 0 && (D / 4) % TPR == 0), "split-K combine: whole float4 chunks per thread");
  static_assert(SMEM_BYTES == (2 * BLOCK_N + 2 * BLOCK_M) * LDS * (int)sizeof(T) + EXCHANGE_FLOATS * (int)sizeof(float),
                "host smem size must match: K and V tiles, 2 stages of Q, split-K exchange");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* k_smem = reinterpret_cast<T*>(smem_raw);  // [BLOCK_N][LDS]  K_j
  T* v_smem = k_smem + BLOCK_N * LDS;          // [BLOCK_N][LDS]  V_j
  T* q_smem = v_smem + BLOCK_N * LDS;          // [2][BLOCK_M][LDS]  Q_i, double-buffered
  float* pv_smem = reinterpret_cast<float*>(q_smem + 2 * BLOCK_M * LDS);  // split-K: [NWARPS][BLOCK_M][LDR] P~_w V_w
  float* mpart_smem = pv_smem + NWARPS * BLOCK_M * LDR;                    // split-K: [NWARPS][BLOCK_M] m~_w (base 2)
  float* lpart_smem = mpart_smem + NWARPS * BLOCK_M;                       // split-K: [NWARPS][BLOCK_M] l~_w

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int head = blockIdx.x, batch = blockIdx.y;
  const SeqInfo si = seqinfo_fixed(p);
  const int seqlen_q = si.seqlen_q, seqlen_k = si.seqlen_k;
  const Mask<CAUSAL> mask = si.mask<CAUSAL>();
  const int num_m = (seqlen_q + BLOCK_M - 1) / BLOCK_M;
  const int num_n = (seqlen_k + BLOCK_N - 1) / BLOCK_N;
  // (HOLD_FADD, common/ptx.cuh: the causal head-dim-64 split-Q tile, 4 B of spills under NVRTC 13.0 without it)
  const float scale_log2 = held<D == 64 && BLOCK_N == 128 && CAUSAL ? HOLD_FADD : HOLD_NONE>(p.scale_log2);

  const int64_t bh = (int64_t)batch * p.nheads + head;
  const int64_t kv_head = head / p.heads_per_kv;  // GQA/MQA: shared K/V head, no copy
  const T* q_ptr = reinterpret_cast<const T*>(p.q) + SeqInfo::offset(p.q_batch_stride, p.q_head_stride, batch, head);
  const T* k_ptr = reinterpret_cast<const T*>(p.k) + SeqInfo::offset(p.k_batch_stride, p.k_head_stride, batch, kv_head);
  const T* v_ptr = reinterpret_cast<const T*>(p.v) + SeqInfo::offset(p.v_batch_stride, p.v_head_stride, batch, kv_head);
  T* o_ptr = reinterpret_cast<T*>(p.o) + SeqInfo::offset(p.o_batch_stride, p.o_head_stride, batch, head);
  float* oacc_ptr = p.o_accum + bh * seqlen_q * D;  // [sq][D]
  float* m_ptr = p.m + bh * seqlen_q;               // [sq]
  float* l_ptr = p.l + bh * seqlen_q;
  float* lse_ptr = p.lse + bh * seqlen_q;

  // Q tiles that no KV tile visits (causal rows above the first key; or no keys at all) keep the
  // initial state of Algorithm 1: O = 0, l = 0, m = -inf, hence LSE = -inf. Written here, once.
  const int m_first = num_n == 0 ? num_m : min(num_m, q_block_begin<BLOCK_M>(mask, 0));
  const int empty_rows = min(seqlen_q, m_first * BLOCK_M);
  for (int64_t c = tid; c < (int64_t)empty_rows * (D / 8); c += NT) {
    const int64_t r = c / (D / 8);
    *reinterpret_cast<uint4*>(o_ptr + r * p.o_row_stride + (c % (D / 8)) * 8) = make_uint4(0u, 0u, 0u, 0u);
  }
  for (int r = tid; r < empty_rows; r += NT) {
    m_ptr[r] = -INFINITY;
    l_ptr[r] = 0.f;
    lse_ptr[r] = -INFINITY;
  }

  for (int n = 0; n < num_n; ++n) {  // outer loop: KV tile j = n
    const int n0 = n * BLOCK_N;
    // Causal: Q tiles whose last row lies above this KV tile's first key are skipped (m_begin is also the
    // first Q tile any KV tile visits, so every visited Q tile is visited by n = 0 first).
    const int m_begin = q_block_begin<BLOCK_M>(mask, n0);
    const int m_end = q_block_end<BLOCK_M>(mask, n0 + BLOCK_N, num_m);
    if (m_begin >= m_end) continue;  // (never without a window: the last query row sees every key)
    __syncthreads();  // every warp is done with K_{j-1}, V_{j-1} and both Q stages before they are refilled
    load_tile_async<BLOCK_N, D, NT>(k_smem, k_ptr, p.k_row_stride, n0, seqlen_k, tid);
    load_tile_async<BLOCK_N, D, NT>(v_smem, v_ptr, p.v_row_stride, n0, seqlen_k, tid);
    load_tile_async<BLOCK_M, D, NT>(q_smem, q_ptr, p.q_row_stride, m_begin * BLOCK_M, seqlen_q, tid);
    cp_async_commit();

    for (int mb = m_begin, stage = 0; mb < m_end; ++mb, stage ^= 1) {  // inner loop: Q tile i = mb
      cp_async_wait<0>();  // Q_i (and, on the first step, K_j and V_j) has landed for this thread ...
      __syncthreads();     // ... for all threads; every warp is done with stage^1 and with the exchange buffers
      if (mb + 1 < m_end) {
        load_tile_async<BLOCK_M, D, NT>(q_smem + (stage ^ 1) * BLOCK_M * LDS, q_ptr, p.q_row_stride,
                                        (mb + 1) * BLOCK_M, seqlen_q, tid);
        cp_async_commit();
      }
      const T* q_tile = q_smem + stage * BLOCK_M * LDS;  // [BLOCK_M][LDS]
      const int m0 = mb * BLOCK_M;
      const bool first = n == kv_block_begin<BLOCK_N>(mask, m0);  // O_i, m_i, l_i: the initial 0, -inf, 0 (not read)
      // The last KV tile that visits this Q tile writes the final O_i (input dtype) and LSE.
      const bool last = n == kv_block_end<BLOCK_N>(mask, m0 + BLOCK_M) - 1;
      // Mask only tiles that cross the end of the keys or the diagonal (uniform branch per tile).
      const bool need_mask = mask.needs_mask(m0, m0 + BLOCK_M - 1, n0, n0 + BLOCK_N - 1);

      if constexpr (SPLITK) {
        // Combine-step ownership: thread -> row rc of the tile, float4 chunks ck + TPR c of that row. The
        // HBM reads of its O_i chunks, m_i and l_i are issued first so their latency overlaps the products;
        // each thread re-reads exactly the O_i chunks it wrote itself at the previous KV tile.
        const int rc = tid / TPR, ck = tid % TPR;
        const int row_c = m0 + rc;
        const bool row_ok = row_c < seqlen_q;
        float4 o_old[CPT];
        float m_old2 = -INFINITY, l_old = 0.f;  // m_i in base-2 units of the raw scores' scale
#pragma unroll
        for (int c = 0; c < CPT; ++c) o_old[c] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (!first && row_ok) {
          m_old2 = m_ptr[row_c] * LOG2E_F;
          l_old = l_ptr[row_c];
#pragma unroll
          for (int c = 0; c < CPT; ++c)
            o_old[c] = *reinterpret_cast<const float4*>(oacc_ptr + (int64_t)row_c * D + (ck + TPR * c) * 4);
        }

        // S_w = Q_i K_w^T  [BLOCK_M, WARP_N]: every row of the Q tile, this warp's keys of the KV tile.
        const int key0 = warp * WARP_N;
        float s[MF][NF][4];
        v1::gemm_abt<T, MF, NF, KD, LDS>(s, q_tile, k_smem + key0 * LDS, lane);
        if (need_mask) mask.apply(s, m0, n0 + key0, lane);

        // This warp's partial statistics: m~_w = rowmax(S_w), P~_w = exp(S_w - m~_w), l~_w = rowsum(P~_w)
        // (Algorithm 1 line 10 on the warp's slice): a fresh online-softmax state over one tile
        // (attn/softmax.cuh; a row with no visible key in the slice keeps m~_w = -inf and l~_w = 0).
        {
          OnlineSoftmax<MF> part;
          part.update_max(s, scale_log2);
          part.set_max();
          part.exp_and_sum(s, scale_log2);
#pragma unroll
          for (int mf = 0; mf < MF; ++mf)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const float sum = part.row_sum_total(mf, h);
              if (t == 0) {
                const int r = mf * 16 + g + h * 8;
                mpart_smem[warp * BLOCK_M + r] = part.row_max[mf][h];
                lpart_smem[warp * BLOCK_M + r] = sum;
              }
            }
        }

        // P~_w V_w  [BLOCK_M, D]: this warp's share of the P V contraction over the KV tile's keys.
        float acc[MF][DF][4];
#pragma unroll
        for (int mf = 0; mf < MF; ++mf)
#pragma unroll
          for (int df = 0; df < DF; ++df)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mf][df][e] = 0.f;
        v1::gemm_pv<T, MF, KN, DF, LDS>(acc, s, v_smem + key0 * LDS, lane);
        float* pv_w = pv_smem + warp * BLOCK_M * LDR;  // [BLOCK_M][LDR]
#pragma unroll
        for (int mf = 0; mf < MF; ++mf)
#pragma unroll
          for (int df = 0; df < DF; ++df)
#pragma unroll
            for (int h = 0; h < 2; ++h)
              *reinterpret_cast<float2*>(pv_w + (mf * 16 + g + h * 8) * LDR + df * 8 + 2 * t) =
                  make_float2(acc[mf][df][2 * h], acc[mf][df][2 * h + 1]);
        __syncthreads();  // every warp's (m~_w, l~_w, P~_w V_w) is in smem

        // Cross-warp reduction folded into Algorithm 1 lines 11-12, per row: a merge of NWARPS + 1 partial
        // states (attn/softmax.cuh: merge_partials), partial 0 being (m_i, l_i, l_i O_i) from HBM:
        //   m_new = max(m_i, max_w m~_w),  a = l_i e^{m_i - m_new},  c_w = e^{m~_w - m_new}
        //   l_new = a + sum_w c_w l~_w,    O_i = (a O_i + sum_w c_w P~_w V_w) / l_new
        float c_all[NWARPS + 1], m_new2;
        const float l_new = merge_partials<NWARPS + 1>(
            [&](int w) { return w == 0 ? m_old2 : mpart_smem[(w - 1) * BLOCK_M + rc]; },
            [&](int w) { return w == 0 ? l_old : lpart_smem[(w - 1) * BLOCK_M + rc]; }, c_all, m_new2);
        const float a = c_all[0] * l_old;  // 0 on the first visit (l_i = 0, m_i = -inf)
        const float inv_l = l_new > 0.f ? 1.f / l_new : 0.f;  // rows that saw no key yet: O_i = 0
        if (row_ok) {
#pragma unroll
          for (int c = 0; c < CPT; ++c) {
            const int col = (ck + TPR * c) * 4;
            float4 x = make_float4(a * o_old[c].x, a * o_old[c].y, a * o_old[c].z, a * o_old[c].w);
#pragma unroll
            for (int w = 0; w < NWARPS; ++w) {
              const float4 y = *reinterpret_cast<const float4*>(pv_smem + (w * BLOCK_M + rc) * LDR + col);
              x.x = fmaf(c_all[w + 1], y.x, x.x);
              x.y = fmaf(c_all[w + 1], y.y, x.y);
              x.z = fmaf(c_all[w + 1], y.z, x.z);
              x.w = fmaf(c_all[w + 1], y.w, x.w);
            }
            x = make_float4(x.x * inv_l, x.y * inv_l, x.z * inv_l, x.w * inv_l);
            if (last)  // final O_i in the input dtype: 4 elements, one 8-byte store
              *reinterpret_cast<uint2*>(o_ptr + (int64_t)row_c * p.o_row_stride + col) =
                  make_uint2(pack2<T>(x.x, x.y), pack2<T>(x.z, x.w));
            else
              *reinterpret_cast<float4*>(oacc_ptr + (int64_t)row_c * D + col) = x;
          }
          if (ck == 0) {
            m_ptr[row_c] = m_new2 * LN2_F;
            l_ptr[row_c] = l_new;
            if (last) lse_ptr[row_c] = merged_lse(m_new2, l_new);
          }
        }
      } else {
        // Split-Q: this warp owns rows r0 + [0, WARP_M) of the Q tile, every key of the KV tile. Its O_i
        // rows are read straight into the accumulator fragments (float2 per (row, 2t): a quad reads one
        // 32-byte sector), before the products so the HBM latency overlaps them.
        const int r0 = warp * WARP_M;
        if (m0 + r0 < seqlen_q) {  // a warp whose rows all lie past seqlen_q has nothing to do
          // The online softmax of Algorithm 1 lines 11-12 (attn/softmax.cuh), eager (RESCALE_LOG2 = 0: m is the
          // running max, which is what HBM keeps), its state read from HBM: m_i in log2 units, l_i carried
          // beside the tile's sums, O_i normalised; the rescale makes acc = diag(l_i) e^{m_i - m_new} O_i. The
          // whole row is in this quad, so m_new is known before the exponentials: P = exp(S - m_new) directly
          // (the paper's e^{m~ - m_new} P~ without the separate rescale).
          float acc[MF][DF][4], l_carry[MF][2];
          OnlineSoftmax<MF, 0> softmax;
#pragma unroll
          for (int mf = 0; mf < MF; ++mf)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int row = m0 + r0 + mf * 16 + g + h * 8;
              const bool ok = !first && row < seqlen_q;
              softmax.row_max[mf][h] = ok ? m_ptr[row] * LOG2E_F : -INFINITY;
              l_carry[mf][h] = ok ? l_ptr[row] : 0.f;
#pragma unroll
              for (int df = 0; df < DF; ++df) {
                const float2 x = ok ? *reinterpret_cast<const float2*>(oacc_ptr + (int64_t)row * D + df * 8 + 2 * t)
                                    : make_float2(0.f, 0.f);
                acc[mf][df][2 * h] = x.x;
                acc[mf][df][2 * h + 1] = x.y;
              }
            }

          // S = Q_w K_j^T  [WARP_M, BLOCK_N]
          float s[MF][NF][4];
          v1::gemm_abt<T, MF, NF, KD, LDS, U_S>(s, q_tile + r0 * LDS, k_smem, lane);
          if (need_mask) mask.apply(s, m0 + r0, n0, lane);
          softmax.step(s, acc, scale_log2, l_carry);

          // acc += P V_j, then O_i = acc / l_new (Algorithm 1 line 12).
          v1::gemm_pv<T, MF, KN, DF, LDS>(acc, s, v_smem, lane);
          float l_new[MF][2];
          softmax.normalize(acc, l_new, l_carry);
#pragma unroll
          for (int mf = 0; mf < MF; ++mf)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int row = m0 + r0 + mf * 16 + g + h * 8;
              if (row >= seqlen_q) continue;
#pragma unroll
              for (int df = 0; df < DF; ++df) {
                const float x = acc[mf][df][2 * h], y = acc[mf][df][2 * h + 1];
                if (last)
                  *reinterpret_cast<uint32_t*>(o_ptr + (int64_t)row * p.o_row_stride + df * 8 + 2 * t) = pack2<T>(x, y);
                else
                  *reinterpret_cast<float2*>(oacc_ptr + (int64_t)row * D + df * 8 + 2 * t) = make_float2(x, y);
              }
              if (t == 0) {
                m_ptr[row] = softmax.row_max[mf][h] * LN2_F;
                l_ptr[row] = l_new[mf][h];
                if (last) lse_ptr[row] = softmax.lse(mf, h, l_new[mf][h]);
              }
            }
        }
      }
    }
  }
}

// =============================================================================================== backward
//
// Template parameters (cuflash/v1.py): T, D, BLOCK_M (Q rows per inner step), BLOCK_N = 16 NWARPS (KV rows
// per tile: warp w owns rows [16 w, 16 w + 16) of K_j, V_j, dK_j, dV_j), NWARPS, CAUSAL, SMEM_BYTES, KUNROLL
// (k16 steps of S^T = K Q^T, dP^T = V dO^T and dQ = dS K unrolled per loop trip, 0: all; head dims 96 and
// 128 need it: fully unrolled, NVRTC 13.0 spills 4-16 B at 255 registers).
template <typename T, int D, int BLOCK_M, int BLOCK_N, int NWARPS, bool CAUSAL, int SMEM_BYTES, int KUNROLL = 0>
__global__ void __launch_bounds__(NWARPS * 32, 1) flash_v1_bwd_kernel(const __grid_constant__ V1BwdParams p) {
  constexpr int NT = NWARPS * 32;
  constexpr int LDS = PaddedRow<D>::LDS;
  constexpr int LDS_DS = PaddedRow<BLOCK_M>::LDS;
  constexpr int LDQ = D + 4;        // fp32 row stride of the dQ_i tile (16-byte rows; D + 4, not D + 8: fits sm_80)
  constexpr int NFQ = BLOCK_M / 8;  // n8 fragments of S^T along the Q rows
  constexpr int KD = D / 16;        // k16 steps of the products that contract over D
  constexpr int U_D = KUNROLL && KUNROLL < KD ? KUNROLL : KD;  // ... unrolled per loop trip
  constexpr int KQ = BLOCK_M / 16;  // k16 steps of the products that contract over Q rows
  constexpr int DFO = D / 8;        // n8 fragments of a warp's dK/dV rows
  constexpr int DQ_ROW_BANDS = BLOCK_M / 16;           // dQ step: warps tile [BLOCK_M, D] as
  constexpr int DQ_COL_BANDS = NWARPS / DQ_ROW_BANDS;  //   row bands of 16 x column bands
  constexpr int DQ_COLS = D / DQ_COL_BANDS;
  constexpr int DQF = DQ_COLS / 8;
  constexpr int KN = BLOCK_N / 16;        // k16 steps of dQ = dS K (contract over KV rows)
  constexpr int U_N = KUNROLL && KUNROLL < KN ? KUNROLL : KN;  // ... unrolled per loop trip
  constexpr int D_TPR = NT / BLOCK_M;                      // D_i pass: threads per row (consecutive lanes) ...
  constexpr int D_CPT = (D / 8 + D_TPR - 1) / D_TPR;       // ... and 16-byte chunks of the row per thread (at most)
  static_assert(BLOCK_N == 16 * NWARPS, "each warp owns 16 KV rows");
  static_assert(NWARPS % DQ_ROW_BANDS == 0 && DQ_COLS % 8 == 0 && NFQ % 2 == 0 && DFO % 2 == 0, "tiles");
  static_assert(NT % BLOCK_M == 0 && D_TPR <= 32 && (D_TPR & (D_TPR - 1)) == 0,
                "D_i pass: a power-of-two group of lanes of one warp per row");
  static_assert(SMEM_BYTES == (2 * BLOCK_N + 6 * BLOCK_M) * LDS * (int)sizeof(T) + BLOCK_N * LDS_DS * (int)sizeof(T) +
                                  (2 * BLOCK_M * LDQ + 5 * BLOCK_M) * (int)sizeof(float),
                "host smem size must match the layout below");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* k_smem = reinterpret_cast<T*>(smem_raw);  // [BLOCK_N][LDS]  K_j
  T* v_smem = k_smem + BLOCK_N * LDS;          // [BLOCK_N][LDS]  V_j
  T* q_smem = v_smem + BLOCK_N * LDS;          // [2][BLOCK_M][LDS]  Q_i
  T* do_smem = q_smem + 2 * BLOCK_M * LDS;     // [2][BLOCK_M][LDS]  dO_i
  T* o_smem = do_smem + 2 * BLOCK_M * LDS;     // [2][BLOCK_M][LDS]  O_i (read only by the D_i pass)
  T* ds_smem = o_smem + 2 * BLOCK_M * LDS;     // [BLOCK_N][LDS_DS]  dS^T of the current Q tile
  float* dqa_smem = reinterpret_cast<float*>(ds_smem + BLOCK_N * LDS_DS);  // [2][BLOCK_M][LDQ] dQ_i (fp32)
  float* m2_smem = dqa_smem + 2 * BLOCK_M * LDQ;                           // [2][BLOCK_M] m * log2(e)
  float* il_smem = m2_smem + 2 * BLOCK_M;                                 // [2][BLOCK_M] 1 / l
  float* delta_smem = il_smem + 2 * BLOCK_M;                              // [BLOCK_M]    D_i

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int dq_rb = warp % DQ_ROW_BANDS, dq_cb = warp / DQ_ROW_BANDS;
  const int kv_head = blockIdx.x, batch = blockIdx.y;
  const SeqInfo si = seqinfo_fixed(p);
  const int seqlen_q = si.seqlen_q, seqlen_k = si.seqlen_k;
  const Mask<CAUSAL> mask = si.mask<CAUSAL>();
  const int group = (int)p.heads_per_kv;
  const int num_n = (seqlen_k + BLOCK_N - 1) / BLOCK_N;
  const int num_m = (seqlen_q + BLOCK_M - 1) / BLOCK_M;
  const float scale_log2 = (float)p.scale_log2;
  const T* k_ptr = reinterpret_cast<const T*>(p.k) + SeqInfo::offset(p.k_batch_stride, p.k_head_stride, batch, kv_head);
  const T* v_ptr = reinterpret_cast<const T*>(p.v) + SeqInfo::offset(p.v_batch_stride, p.v_head_stride, batch, kv_head);

  for (int n_block = 0; n_block < num_n; ++n_block) {  // outer loop: KV tile j
    const int n0 = n_block * BLOCK_N;
    // causal: Q tiles whose rows all lie above this KV tile's diagonal are skipped (attn/block.cuh)
    const int m_begin = q_block_begin<BLOCK_M>(mask, n0);
    const int num_mv = max(0, q_block_end<BLOCK_M>(mask, n0 + BLOCK_N, num_m) - m_begin);
    const int total = group * num_mv;  // inner iterations: (query head of the group, Q tile)

    float acc_dk[DFO][4], acc_dv[DFO][4];
#pragma unroll
    for (int f = 0; f < DFO; ++f)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_dk[f][e] = acc_dv[f][e] = 0.f;

    auto head_of = [&](int it) { return kv_head * group + it / num_mv; };
    auto row0_of = [&](int it) { return (m_begin + it % num_mv) * BLOCK_M; };
    // Iteration `it`'s inputs into `stage` (Algorithm 4 line 8: Q_i, O_i, dO_i, dQ_i, l_i, m_i -> SRAM): the
    // Q_i, dO_i, O_i tiles (rows past seqlen_q zero-filled), the fp32 dQ_i tile it adds to (last written at
    // the previous KV tile, before the barrier that ends it, so this read sees the update), and m_i, l_i
    // (4-byte copies; rows past seqlen_q read as m = l = 0, i.e. "no key").
    auto issue_loads = [&](int it, int stage) {
      const int hq = head_of(it), m0 = row0_of(it);
      const T* q_head = reinterpret_cast<const T*>(p.q) + SeqInfo::offset(p.q_batch_stride, p.q_head_stride, batch, hq);
      const T* do_head = reinterpret_cast<const T*>(p.dout) + SeqInfo::offset(p.do_batch_stride, p.do_head_stride, batch, hq);
      const T* o_head = reinterpret_cast<const T*>(p.o) + SeqInfo::offset(p.o_batch_stride, p.o_head_stride, batch, hq);
      v1::load_tile_async_lean<BLOCK_M, D, NT>(q_smem + stage * BLOCK_M * LDS, q_head, p.q_row_stride, m0, seqlen_q, tid);
      v1::load_tile_async_lean<BLOCK_M, D, NT>(do_smem + stage * BLOCK_M * LDS, do_head, p.do_row_stride, m0, seqlen_q, tid);
      v1::load_tile_async_lean<BLOCK_M, D, NT>(o_smem + stage * BLOCK_M * LDS, o_head, p.o_row_stride, m0, seqlen_q, tid);
      const float* dq_head = p.dq_accum + (((int64_t)batch * p.nheads + hq) * p.seqlen_q_pad + m0) * D;
      v1::load_f32_tile_async<BLOCK_M, D, LDQ, NT>(dqa_smem + stage * BLOCK_M * LDQ, dq_head, tid);
      if (tid < BLOCK_M) {
        const bool ok = m0 + tid < seqlen_q;
        const int64_t i = ((int64_t)batch * p.nheads + hq) * seqlen_q + (ok ? m0 + tid : 0);
        v1::cp_async_4(smem_addr(m2_smem + stage * BLOCK_M + tid), p.m + i, ok);
        v1::cp_async_4(smem_addr(il_smem + stage * BLOCK_M + tid), p.l + i, ok);
      }
    };

    // Software pipeline: step `it` issues the loads of step it + 1 and computes step it; step -1 only
    // issues (with K_j, V_j) the loads of step 0. One issue site keeps the address math in one place.
    for (int it = -1, stage = 1; it < total; ++it, stage ^= 1) {
      if (it >= 0) {
        cp_async_wait<0>();  // this iteration's tiles (and K_j, V_j) have landed for this thread ...
        __syncthreads();     // ... for all threads; every warp is done with stage^1 and dS^T
      }
      if (it + 1 < total) {
        if (it < 0) {
          v1::load_tile_async_lean<BLOCK_N, D, NT>(k_smem, k_ptr, p.k_row_stride, n0, seqlen_k, tid);
          v1::load_tile_async_lean<BLOCK_N, D, NT>(v_smem, v_ptr, p.v_row_stride, n0, seqlen_k, tid);
        }
        issue_loads(it + 1, stage ^ 1);
        cp_async_commit();
      }
      if (it < 0) continue;
      const int hq = head_of(it), m0 = row0_of(it);
      const T* q_tile = q_smem + stage * BLOCK_M * LDS;    // [BLOCK_M][LDS]
      const T* do_tile = do_smem + stage * BLOCK_M * LDS;  // [BLOCK_M][LDS]
      const T* o_tile = o_smem + stage * BLOCK_M * LDS;    // [BLOCK_M][LDS]
      float* m2_tile = m2_smem + stage * BLOCK_M;  // m_i, then m_i log2(e)
      float* il_tile = il_smem + stage * BLOCK_M;  // l_i, then 1 / l_i

      // m2 = m log2(e) and 1/l, in place (the one divide per row of diag(l)^-1; published by the barrier
      // after (1)). Rows that saw no key (l = 0, m = -inf) and padding rows get m2 = +inf, 1/l = 0, so
      // P = exp2(S - inf) * 0 = 0, never NaN.
      if (tid < BLOCK_M) {
        const float m = m2_tile[tid], l = il_tile[tid];
        const bool empty = !(l > 0.f) || m == -INFINITY;
        m2_tile[tid] = empty ? INFINITY : m * LOG2E_F;
        il_tile[tid] = empty ? 0.f : 1.f / l;
      }

      // D_i = rowsum(dO_i * O_i) (Algorithm 4 line 19), recomputed for every (j, i): D_TPR consecutive
      // lanes per row, 16-byte chunks, fp32 sums, then a shuffle reduction over the lane group.
      {
        const int r = tid / D_TPR, k = tid % D_TPR;
        float sum = 0.f;
#pragma unroll
        for (int c = 0; c < D_CPT; ++c) {
          const int col = (k + D_TPR * c) * 8;
          if ((D / 8) % D_TPR != 0 && col >= D) break;
          const uint4 a = *reinterpret_cast<const uint4*>(do_tile + r * LDS + col);
          const uint4 b = *reinterpret_cast<const uint4*>(o_tile + r * LDS + col);
          const uint32_t aw[4] = {a.x, a.y, a.z, a.w}, bw[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
          for (int w = 0; w < 4; ++w) {
            const float2 x = unpack2<T>(aw[w]), y = unpack2<T>(bw[w]);
            sum = fmaf(x.x, y.x, sum);
            sum = fmaf(x.y, y.y, sum);
          }
        }
#pragma unroll
        for (int off = D_TPR / 2; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
        if (k == 0) delta_smem[r] = sum;
      }

      // (1) S^T = K_w Q_i^T  [16, BLOCK_M]: A = this warp's 16 K rows, B = Q^T = rows of Q.
      float acc[1][NFQ][4];
      v1::gemm_abt<T, 1, NFQ, KD, LDS, U_D>(acc, k_smem + warp * 16 * LDS, q_tile, lane);
      __syncthreads();  // D_i, m2 and 1/l of every row of the tile are in smem

      // (2) P^T = diag(l_i)^-1 exp(S^T - m_i) (Algorithm 4 line 13): exp2(S^T scale_log2 - m2[q]) * (1/l)[q],
      // masked only on tiles that cross the end of the keys or the diagonal; kept as 16-bit A fragments.
      if (mask.needs_mask(m0, m0 + BLOCK_M - 1, n0, n0 + BLOCK_N - 1)) {
#pragma unroll
        for (int nf = 0; nf < NFQ; ++nf)
#pragma unroll
          for (int e = 0; e < 4; ++e)  // rows of S^T are keys, columns are queries
            acc[0][nf][e] = mask.score_t(acc[0][nf][e], n0 + warp * 16, m0, nf, e, lane);
      }
#pragma unroll
      for (int nf = 0; nf < NFQ; ++nf) {
        const float2 m2 = *reinterpret_cast<const float2*>(m2_tile + nf * 8 + 2 * t);
        const float2 il = *reinterpret_cast<const float2*>(il_tile + nf * 8 + 2 * t);
#pragma unroll
        for (int e = 0; e < 4; ++e)  // FFMA + MUFU.EX2 + FMUL
          acc[0][nf][e] = softmax_p_from_lse(acc[0][nf][e], scale_log2, e % 2 ? m2.y : m2.x) * (e % 2 ? il.y : il.x);
      }
      uint32_t pa[KQ][4];
      frags_to_a<T, KQ>(acc[0], pa);
      // (3) dV_j += P^T dO_i  (line 16): B = dO [Q rows, D] via ldmatrix.trans.
      gemm_a_regs_b_trans<T, KQ, DFO>(acc_dv, pa, do_tile, LDS, 0, lane);
      // (4) dP^T = V_w dO_i^T  [16, BLOCK_M]  (line 17), like (1).
      v1::gemm_abt<T, 1, NFQ, KD, LDS, U_D>(acc, v_smem + warp * 16 * LDS, do_tile, lane);
      // (5) dS^T = P^T * (dP^T - D_i)  (line 20; P from its 16-bit copy: the same values dV used).
#pragma unroll
      for (int nf = 0; nf < NFQ; ++nf) {
        const float2 dl = *reinterpret_cast<const float2*>(delta_smem + nf * 8 + 2 * t);
        const float2 p01 = unpack2<T>(pa[nf / 2][(nf % 2) * 2]), p23 = unpack2<T>(pa[nf / 2][(nf % 2) * 2 + 1]);
        acc[0][nf][0] = p01.x * (acc[0][nf][0] - dl.x);
        acc[0][nf][1] = p01.y * (acc[0][nf][1] - dl.y);
        acc[0][nf][2] = p23.x * (acc[0][nf][2] - dl.x);
        acc[0][nf][3] = p23.y * (acc[0][nf][3] - dl.y);
      }
      uint32_t dsa[KQ][4];
      frags_to_a<T, KQ>(acc[0], dsa);
      // dS^T -> smem for dQ: rows (g, g + 8) of this warp's band, columns kq * 16 + 2t (+8).
#pragma unroll
      for (int kq = 0; kq < KQ; ++kq) {
        uint32_t* ds0 = reinterpret_cast<uint32_t*>(ds_smem + (warp * 16 + g) * LDS_DS + kq * 16 + 2 * t);
        uint32_t* ds8 = reinterpret_cast<uint32_t*>(ds_smem + (warp * 16 + g + 8) * LDS_DS + kq * 16 + 2 * t);
        ds0[0] = dsa[kq][0];
        ds8[0] = dsa[kq][1];
        ds0[4] = dsa[kq][2];  // +8 columns = +4 words
        ds8[4] = dsa[kq][3];
      }
      // (6) dK_j += dS^T Q_i  (line 22; softmax_scale applied once at the end): B = Q via ldmatrix.trans.
      gemm_a_regs_b_trans<T, KQ, DFO>(acc_dk, dsa, q_tile, LDS, 0, lane);
      __syncthreads();  // dS^T of every warp is in smem

      // (7) dQ_i += dS K_j  (line 21): the dQ_i tile loaded with Q_i plus this product, written back to HBM
      // in fp32. This block is the only one that touches the rows of (batch, hq): no atomics.
      // Warps re-partition as 16-row bands x DQ_COLS columns; A = dS (rows = Q) from dS^T in smem via
      // ldmatrix.trans, B = K_j [KV, D] via ldmatrix.trans.
      float acc_dq[DQF][4];
#pragma unroll
      for (int f = 0; f < DQF; ++f)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_dq[f][e] = 0.f;
#pragma unroll U_N
      for (int kn = 0; kn < KN; ++kn) {
        uint32_t a[4];
        ldmatrix_x4_trans(a, smem_addr(ds_smem + (kn * 16 + (lane % 8) + (lane / 16) * 8) * LDS_DS + dq_rb * 16 +
                                       ((lane / 8) % 2) * 8));
#pragma unroll
        for (int df = 0; df < DQF; df += 2) {
          uint32_t b[4];
          const int br = kn * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
          const int bc = dq_cb * DQ_COLS + df * 8 + (lane / 16) * 8;
          ldmatrix_x4_trans(b, smem_addr(k_smem + br * LDS + bc));  // odd DQF: the last x4 also reads the
          mma_m16n8k16<T>(acc_dq[df], a, b[0], b[1]);                // next 8 columns (in the row / its padding)
          if (df + 1 < DQF) mma_m16n8k16<T>(acc_dq[df + 1], a, b[2], b[3]);
        }
      }
      const float* dq_old = dqa_smem + stage * BLOCK_M * LDQ + (dq_rb * 16 + g) * LDQ + dq_cb * DQ_COLS + 2 * t;
      float* dq_rows = p.dq_accum + (((int64_t)batch * p.nheads + hq) * p.seqlen_q_pad + m0 + dq_rb * 16 + g) * D +
                       dq_cb * DQ_COLS + 2 * t;  // rows padded to seqlen_q_pad: always in bounds
#pragma unroll
      for (int df = 0; df < DQF; ++df)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float2 old = *reinterpret_cast<const float2*>(dq_old + h * 8 * LDQ + df * 8);
          *reinterpret_cast<float2*>(dq_rows + h * 8 * D + df * 8) =
              make_float2(old.x + acc_dq[df][2 * h], old.y + acc_dq[df][2 * h + 1]);
        }
    }

    // dK_j = softmax_scale * acc_dk, dV_j = acc_dv: this warp's 16 KV rows, written once (line 24).
    const float scale = (float)p.softmax_scale;
    T* dk_ptr = reinterpret_cast<T*>(p.dk) + SeqInfo::offset(p.dk_batch_stride, p.dk_head_stride, batch, kv_head);
    T* dv_ptr = reinterpret_cast<T*>(p.dv) + SeqInfo::offset(p.dv_batch_stride, p.dv_head_stride, batch, kv_head);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int j = n0 + warp * 16 + g + h * 8;
      if (j < seqlen_k)
#pragma unroll
        for (int df = 0; df < DFO; ++df) {
          const int c = df * 8 + 2 * t;
          *reinterpret_cast<uint32_t*>(dk_ptr + (int64_t)j * p.dk_row_stride + c) =
              pack2<T>(acc_dk[df][2 * h] * scale, acc_dk[df][2 * h + 1] * scale);
          *reinterpret_cast<uint32_t*>(dv_ptr + (int64_t)j * p.dv_row_stride + c) =
              pack2<T>(acc_dv[df][2 * h], acc_dv[df][2 * h + 1]);
        }
    }
    __syncthreads();  // every warp is done with K_j, V_j, dS^T and the stages before the next KV tile reloads them
  }
}

// dQ = softmax_scale * dq_accum in the input dtype; one thread per pair of elements.
template <typename T, int D>
__global__ void flash_v1_bwd_convert_dq_kernel(const __grid_constant__ V1BwdParams p) {
  const int64_t pairs = p.batch * p.nheads * p.seqlen_q * (D / 2);
  const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= pairs) return;
  const int c = (int)(idx % (D / 2)) * 2;
  const int64_t r = idx / (D / 2);
  const int64_t i = r % p.seqlen_q, bh = r / p.seqlen_q;
  const int64_t h = bh % p.nheads, b = bh / p.nheads;
  const float2 x = *reinterpret_cast<const float2*>(p.dq_accum + (bh * p.seqlen_q_pad + i) * D + c);
  const float scale = (float)p.softmax_scale;
  T* dq = reinterpret_cast<T*>(p.dq) + b * p.dq_batch_stride + i * p.dq_row_stride + h * p.dq_head_stride + c;
  *reinterpret_cast<uint32_t*>(dq) = pack2<T>(x.x * scale, x.y * scale);
}

}  // namespace cuflash
