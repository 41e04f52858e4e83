// cuda_src/flash_bwd.cu -- FlashAttention-2 backward: preprocess, main kernel, dQ conversion.
//
//   preprocess:  D = rowsum(dO * O)  and  lse_log2 = LSE * log2(e)   (fp32, rows padded to sq_pad)
//   main:        one thread block per (KV tile, KV head, batch); K_j, V_j stay in shared memory while
//                the block loops over the query heads that share this KV head (GQA) and their Q tiles:
//       S^T  = K_j Q_i^T                              [BLOCK_N, BLOCK_M]
//       P^T  = exp2(S^T * scale_log2 - lse_log2_i)    from the saved LSE: no m, no l
//       dV_j += P^T dO_i
//       dP^T = V_j dO_i^T
//       dS^T = P^T * (dP^T - D_i)
//       dK_j += dS^T Q_i
//       dQ_i += dS K_j   (dS^T goes through shared memory; see the dQ strategies below)
//   convert:     dQ = softmax_scale * (sum of the fp32 dQ partials), in the output dtype.
//
// Warp partition ("split the KV rows"): warp w owns KV rows [16 (w / DSPLIT), +16) of the tile and
// DOUT = D / DSPLIT columns of dK_j, dV_j, which it accumulates in registers over the whole loop: the
// four products above that produce or consume [KV, *] blocks need no cross-warp reduction. Only dQ
// (a contraction over the KV rows spread across warps) exchanges dS^T through shared memory, after
// which warps re-partition by Q rows x D columns. DSPLIT = 2 (head dim 256) makes two warps share KV
// rows and split D, duplicating S^T and dP^T, so the dK/dV accumulators fit in registers.
//
// dQ strategies (BwdParams::dq_strategy):
//   0 atomic: every block adds its dQ_i contribution into one fp32 buffer with atomics.
//   1 seqpar: block of KV tile j writes its contribution to its own fp32 buffer j (plain stores);
//             the convert kernel sums the buffers (deterministic; memory x number of KV tiles).
//   2 loop:   one block per (KV head, batch) walks all KV tiles itself, so it is the only writer of
//             its dQ rows: plain read-add-write, no atomics, deterministic.
#include "common/ptx.cuh"
#include "common/tile.cuh"
#include "common/params.cuh"
#include "common/warp_gemm.cuh"

namespace cuflash {

enum DqStrategy { DQ_ATOMIC = 0, DQ_SEQPAR = 1, DQ_LOOP = 2 };

// One warp per row of [b, h, sq_pad]: D = rowsum(dO * O), lse_log2, and (atomic/loop) zero the fp32
// dQ accumulator row. Rows that saw no key (LSE = -inf) and padding rows get lse_log2 = +inf, so that
// the main kernel's exp2(S - lse_log2) is 0 there instead of exp2(-inf + inf) = NaN.
template <typename T, int D>
__global__ void flash_bwd_preprocess_kernel(const __grid_constant__ BwdParams p) {
  const int64_t rows = p.batch * p.nheads * p.seqlen_q_pad;
  const int64_t row = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const int64_t i = row % p.seqlen_q_pad, bh = row / p.seqlen_q_pad;
  const int64_t h = bh % p.nheads, b = bh / p.nheads;
  float dsum = 0.f;
  if (i < p.seqlen_q) {
    const T* o = reinterpret_cast<const T*>(p.o) + b * p.o_batch_stride + i * p.o_row_stride + h * p.o_head_stride;
    const T* dout =
        reinterpret_cast<const T*>(p.dout) + b * p.do_batch_stride + i * p.do_row_stride + h * p.do_head_stride;
    for (int c = 2 * lane; c < D; c += 64) {
      const float2 a = unpack2<T>(*reinterpret_cast<const uint32_t*>(o + c));
      const float2 g = unpack2<T>(*reinterpret_cast<const uint32_t*>(dout + c));
      dsum += a.x * g.x + a.y * g.y;
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) dsum += __shfl_xor_sync(0xffffffffu, dsum, off);
  }
  if (lane == 0) {
    const float log2e = 1.4426950408889634f;
    const float lse = i < p.seqlen_q ? p.lse[bh * p.seqlen_q + i] : -INFINITY;
    p.delta[row] = dsum;
    p.lse_log2[row] = lse == -INFINITY ? INFINITY : lse * log2e;
  }
  if (p.dq_strategy != DQ_SEQPAR)
    for (int c = lane; c < D; c += 32) p.dq_accum[row * D + c] = 0.f;
}

// dQ = softmax_scale * sum of the fp32 partials; one thread per pair of elements. For "seqpar" only the
// KV tiles a row can see were written for it (causal: tiles j with j * BLOCK_N <= i + sk - sq).
template <typename T, int D, int BLOCK_N, bool CAUSAL>
__global__ void flash_bwd_convert_dq_kernel(const __grid_constant__ BwdParams p) {
  const int64_t pairs = p.batch * p.nheads * p.seqlen_q * (D / 2);
  const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= pairs) return;
  const int c = (int)(idx % (D / 2)) * 2;
  const int64_t r = idx / (D / 2);
  const int64_t i = r % p.seqlen_q, bh = r / p.seqlen_q;
  const int64_t h = bh % p.nheads, b = bh / p.nheads;
  int64_t splits = p.num_dq_splits;
  if (CAUSAL && p.dq_strategy == DQ_SEQPAR) {
    const int64_t last_key = i + p.seqlen_k - p.seqlen_q;
    splits = last_key < 0 ? 0 : min(splits, last_key / BLOCK_N + 1);
  }
  const int64_t split_stride = p.batch * p.nheads * p.seqlen_q_pad * D;
  const float* acc = p.dq_accum + (bh * p.seqlen_q_pad + i) * D + c;
  float2 sum = make_float2(0.f, 0.f);
  for (int64_t s = 0; s < splits; ++s) {
    const float2 x = *reinterpret_cast<const float2*>(acc + s * split_stride);
    sum.x += x.x;
    sum.y += x.y;
  }
  const float scale = (float)p.softmax_scale;
  T* dq = reinterpret_cast<T*>(p.dq) + b * p.dq_batch_stride + i * p.dq_row_stride + h * p.dq_head_stride + c;
  *reinterpret_cast<uint32_t*>(dq) = pack2<T>(sum.x * scale, sum.y * scale);
}

__device__ __forceinline__ void atomic_add_f2(float* addr, float x, float y) {
#if __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(addr), make_float2(x, y));  // one vector RED.E.ADD.F32x2 on sm_90
#else
  atomicAdd(addr, x);
  atomicAdd(addr + 1, y);
#endif
}

template <typename T, int D, int BLOCK_M, int BLOCK_N, int NWARPS, int DSPLIT, bool CAUSAL, int SMEM_BYTES>
__global__ void __launch_bounds__(NWARPS * 32) flash_bwd_kernel(const __grid_constant__ BwdParams p) {
  constexpr int NT = NWARPS * 32;
  constexpr int LDS = PaddedRow<D>::LDS;
  constexpr int LDS_DS = PaddedRow<BLOCK_M>::LDS;
  constexpr int DOUT = D / DSPLIT;  // dK/dV columns a warp owns
  constexpr int NFQ = BLOCK_M / 8;  // n8 fragments of S^T along the Q rows
  constexpr int KD = D / 16;        // k16 steps of the products that contract over D
  constexpr int KQ = BLOCK_M / 16;  // k16 steps of the products that contract over Q rows
  constexpr int DFO = DOUT / 8;     // n8 fragments of a warp's dK/dV
  constexpr int DQ_ROW_BANDS = BLOCK_M / 16;             // dQ phase: warps tile [BLOCK_M, D] as
  constexpr int DQ_COL_BANDS = NWARPS / DQ_ROW_BANDS;    //   row bands of 16 x column bands
  constexpr int DQ_COLS = D / DQ_COL_BANDS;
  constexpr int DQF = DQ_COLS / 8;
  constexpr int KN = BLOCK_N / 16;  // k16 steps of dQ = dS K (contract over KV rows)
  static_assert(BLOCK_N * DSPLIT == 16 * NWARPS, "each warp (pair, with DSPLIT = 2) owns 16 KV rows");
  static_assert(NWARPS % DQ_ROW_BANDS == 0 && DQ_COLS % 16 == 0 && DOUT % 16 == 0 && NFQ % 2 == 0, "tiles");
  static_assert(SMEM_BYTES == (2 * BLOCK_N + 4 * BLOCK_M) * LDS * (int)sizeof(T) +
                                  BLOCK_N * LDS_DS * (int)sizeof(T) + 4 * BLOCK_M * (int)sizeof(float),
                "host smem size must match the layout below");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* k_smem = reinterpret_cast<T*>(smem_raw);  // [BLOCK_N][LDS]
  T* v_smem = k_smem + BLOCK_N * LDS;          // [BLOCK_N][LDS]
  T* q_smem = v_smem + BLOCK_N * LDS;          // [2][BLOCK_M][LDS]
  T* do_smem = q_smem + 2 * BLOCK_M * LDS;     // [2][BLOCK_M][LDS]
  T* ds_smem = do_smem + 2 * BLOCK_M * LDS;    // [BLOCK_N][LDS_DS]  dS^T of the current Q tile
  float* lse_smem = reinterpret_cast<float*>(ds_smem + BLOCK_N * LDS_DS);  // [2][BLOCK_M]
  float* delta_smem = lse_smem + 2 * BLOCK_M;                             // [2][BLOCK_M]

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int wk = warp / DSPLIT, wd = warp % DSPLIT;  // KV band, D part of this warp
  const int dq_rb = warp % DQ_ROW_BANDS, dq_cb = warp / DQ_ROW_BANDS;
  const int batch = blockIdx.z, kv_head = blockIdx.y;
  const int seqlen_q = (int)p.seqlen_q, seqlen_k = (int)p.seqlen_k;
  const int diag = seqlen_k - seqlen_q;
  const int group = (int)p.heads_per_kv;
  const int num_n_blocks = (seqlen_k + BLOCK_N - 1) / BLOCK_N;
  const int num_m_blocks = (seqlen_q + BLOCK_M - 1) / BLOCK_M;
  const float scale_log2 = (float)p.scale_log2;
  const T* k_ptr = reinterpret_cast<const T*>(p.k) + batch * p.k_batch_stride + kv_head * p.k_head_stride;
  const T* v_ptr = reinterpret_cast<const T*>(p.v) + batch * p.v_batch_stride + kv_head * p.v_head_stride;

  // "loop": gridDim.x == 1 and this block walks every KV tile; otherwise one KV tile per block.
  for (int n_block = blockIdx.x; n_block < num_n_blocks; n_block += gridDim.x) {
    const int n0 = n_block * BLOCK_N;
    int m_begin = 0;  // causal: Q tiles whose rows all lie above this KV tile's diagonal are skipped
    if (CAUSAL && n0 - diag > 0) m_begin = (n0 - diag) / BLOCK_M;
    const int num_m = max(0, num_m_blocks - m_begin);
    const int total = group * num_m;  // iterations: (query head of the group, Q tile)

    float acc_dk[DFO][4], acc_dv[DFO][4];
#pragma unroll
    for (int f = 0; f < DFO; ++f)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_dk[f][e] = acc_dv[f][e] = 0.f;

    // Loads of iteration `it` into `stage`: Q_i, dO_i tiles, lse_log2_i and D_i (padded rows: no guard).
    auto issue_loads = [&](int it, int stage) {
      const int hq = kv_head * group + it / num_m;
      const int m0 = (m_begin + it % num_m) * BLOCK_M;
      const T* q_head = reinterpret_cast<const T*>(p.q) + batch * p.q_batch_stride + hq * p.q_head_stride;
      const T* do_head = reinterpret_cast<const T*>(p.dout) + batch * p.do_batch_stride + hq * p.do_head_stride;
      load_tile_async<BLOCK_M, D, NT>(q_smem + stage * BLOCK_M * LDS, q_head, p.q_row_stride, m0, seqlen_q, tid);
      load_tile_async<BLOCK_M, D, NT>(do_smem + stage * BLOCK_M * LDS, do_head, p.do_row_stride, m0, seqlen_q, tid);
      const int64_t row0 = ((int64_t)batch * p.nheads + hq) * p.seqlen_q_pad + m0;
      if (tid < BLOCK_M / 4)
        cp_async_16(smem_addr(lse_smem + stage * BLOCK_M + tid * 4), p.lse_log2 + row0 + tid * 4, true);
      else if (tid < BLOCK_M / 2)
        cp_async_16(smem_addr(delta_smem + stage * BLOCK_M + (tid - BLOCK_M / 4) * 4),
                    p.delta + row0 + (tid - BLOCK_M / 4) * 4, true);
    };

    if (total > 0) {
      load_tile_async<BLOCK_N, D, NT>(k_smem, k_ptr, p.k_row_stride, n0, seqlen_k, tid);
      load_tile_async<BLOCK_N, D, NT>(v_smem, v_ptr, p.v_row_stride, n0, seqlen_k, tid);
      issue_loads(0, 0);
      cp_async_commit();
    }
    for (int it = 0, stage = 0; it < total; ++it, stage ^= 1) {
      cp_async_wait<0>();  // iteration it's tiles (and K, V) have landed for this thread ...
      __syncthreads();     // ... for all threads; and every warp is done with stage^1 and ds_smem
      if (it + 1 < total) {
        issue_loads(it + 1, stage ^ 1);
        cp_async_commit();
      }
      const int hq = kv_head * group + it / num_m;
      const int m0 = (m_begin + it % num_m) * BLOCK_M;
      const T* q_tile = q_smem + stage * BLOCK_M * LDS;    // [BLOCK_M][LDS]
      const T* do_tile = do_smem + stage * BLOCK_M * LDS;  // [BLOCK_M][LDS]
      const float* lse_tile = lse_smem + stage * BLOCK_M;
      const float* delta_tile = delta_smem + stage * BLOCK_M;

      // (1) S^T = K_w Q^T [16, BLOCK_M]: A = this warp's 16 K rows, B = Q^T = rows of Q (plain ldmatrix).
      float acc[NFQ][4];
      zero_frags(acc);
#pragma unroll
      for (int kd = 0; kd < KD; ++kd) {
        uint32_t a[4];
        ldmatrix_x4(a, smem_addr(k_smem + (wk * 16 + (lane % 16)) * LDS + kd * 16 + (lane / 16) * 8));
#pragma unroll
        for (int nf = 0; nf < NFQ; nf += 2) {
          uint32_t b[4];
          ldmatrix_x4(b, smem_addr(q_tile + (nf * 8 + (lane % 8) + (lane / 16) * 8) * LDS + kd * 16 + ((lane / 8) % 2) * 8));
          mma_m16n8k16<T>(acc[nf], a, b[0], b[1]);
          mma_m16n8k16<T>(acc[nf + 1], a, b[2], b[3]);
        }
      }
      // (2) P^T = exp2(S^T * scale_log2 - lse_log2[q]), masked only on tiles that cross the end of the
      // keys or the diagonal; kept as 16-bit A fragments (the operand of dV += P^T dO).
      const bool need_mask = n0 + BLOCK_N > seqlen_k || (CAUSAL && n0 + BLOCK_N - 1 > m0 + diag);
      uint32_t pa[KQ][4];
#pragma unroll
      for (int nf = 0; nf < NFQ; ++nf) {
        const float2 lse = *reinterpret_cast<const float2*>(lse_tile + nf * 8 + 2 * t);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = acc[nf][e];
          if (need_mask) {
            const int j = n0 + wk * 16 + g + (e / 2) * 8;
            const int i = m0 + nf * 8 + 2 * t + (e % 2);
            if (j >= seqlen_k || (CAUSAL && j > i + diag)) x = -INFINITY;
          }
          acc[nf][e] = exp2_approx(fmaf(x, scale_log2, -(e % 2 ? lse.y : lse.x)));  // FFMA + MUFU.EX2
        }
      }
      frags_to_a<T>(acc, pa);
      // (3) dV += P^T dO: B = dO [Q rows, D] via ldmatrix.trans; this warp's DOUT columns.
      gemm_a_regs_b_trans<T, KQ, DFO>(acc_dv, pa, do_tile, LDS, wd * DOUT, lane);
      // (4) dP^T = V_w dO^T [16, BLOCK_M], like (1).
      zero_frags(acc);
#pragma unroll
      for (int kd = 0; kd < KD; ++kd) {
        uint32_t a[4];
        ldmatrix_x4(a, smem_addr(v_smem + (wk * 16 + (lane % 16)) * LDS + kd * 16 + (lane / 16) * 8));
#pragma unroll
        for (int nf = 0; nf < NFQ; nf += 2) {
          uint32_t b[4];
          ldmatrix_x4(b, smem_addr(do_tile + (nf * 8 + (lane % 8) + (lane / 16) * 8) * LDS + kd * 16 + ((lane / 8) % 2) * 8));
          mma_m16n8k16<T>(acc[nf], a, b[0], b[1]);
          mma_m16n8k16<T>(acc[nf + 1], a, b[2], b[3]);
        }
      }
      // (5) dS^T = P^T * (dP^T - D[q]) (P from its 16-bit copy: the same values dV used).
#pragma unroll
      for (int nf = 0; nf < NFQ; ++nf) {
        const float2 dl = *reinterpret_cast<const float2*>(delta_tile + nf * 8 + 2 * t);
        const float2 p01 = unpack2<T>(pa[nf / 2][(nf % 2) * 2]), p23 = unpack2<T>(pa[nf / 2][(nf % 2) * 2 + 1]);
        acc[nf][0] = p01.x * (acc[nf][0] - dl.x);
        acc[nf][1] = p01.y * (acc[nf][1] - dl.y);
        acc[nf][2] = p23.x * (acc[nf][2] - dl.x);
        acc[nf][3] = p23.y * (acc[nf][3] - dl.y);
      }
      uint32_t dsa[KQ][4];
      frags_to_a<T>(acc, dsa);
      if (wd == 0) {  // dS^T -> smem for dQ (both warps of a DSPLIT pair hold the same values)
#pragma unroll
        for (int kq = 0; kq < KQ; ++kq) {
          uint32_t* ds0 = reinterpret_cast<uint32_t*>(ds_smem + (wk * 16 + g) * LDS_DS + kq * 16 + 2 * t);
          uint32_t* ds8 = reinterpret_cast<uint32_t*>(ds_smem + (wk * 16 + g + 8) * LDS_DS + kq * 16 + 2 * t);
          ds0[0] = dsa[kq][0];
          ds8[0] = dsa[kq][1];
          ds0[4] = dsa[kq][2];  // +8 columns = +4 words
          ds8[4] = dsa[kq][3];
        }
      }
      // (6) dK += dS^T Q: B = Q [Q rows, D] via ldmatrix.trans.
      gemm_a_regs_b_trans<T, KQ, DFO>(acc_dk, dsa, q_tile, LDS, wd * DOUT, lane);
      __syncthreads();  // dS^T of every warp is in smem

      // dQ_i [BLOCK_M, D] += dS K: warps re-partition as 16-row bands x DQ_COLS columns.
      // A = dS (rows = Q) from dS^T in smem via ldmatrix.trans; B = K [KV, D] via ldmatrix.trans.
      float acc_dq[DQF][4];
#pragma unroll
      for (int f = 0; f < DQF; ++f)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_dq[f][e] = 0.f;
#pragma unroll
      for (int kn = 0; kn < KN; ++kn) {
        uint32_t a[4];
        ldmatrix_x4_trans(a, smem_addr(ds_smem + (kn * 16 + (lane % 8) + (lane / 16) * 8) * LDS_DS + dq_rb * 16 +
                                       ((lane / 8) % 2) * 8));
#pragma unroll
        for (int df = 0; df < DQF; df += 2) {
          uint32_t b[4];
          const int br = kn * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
          const int bc = dq_cb * DQ_COLS + df * 8 + (lane / 16) * 8;
          ldmatrix_x4_trans(b, smem_addr(k_smem + br * LDS + bc));
          mma_m16n8k16<T>(acc_dq[df], a, b[0], b[1]);
          mma_m16n8k16<T>(acc_dq[df + 1], a, b[2], b[3]);
        }
      }
      const int64_t split = p.dq_strategy == DQ_SEQPAR ? n_block : 0;
      float* dq_rows = p.dq_accum +
                       (((split * p.batch + batch) * p.nheads + hq) * p.seqlen_q_pad + m0 + dq_rb * 16 + g) * D +
                       dq_cb * DQ_COLS + 2 * t;  // padded rows: always in bounds
#pragma unroll
      for (int df = 0; df < DQF; ++df)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float* a = dq_rows + h * 8 * D + df * 8;
          const float x = acc_dq[df][2 * h], y = acc_dq[df][2 * h + 1];
          if (p.dq_strategy == DQ_ATOMIC) {
            atomic_add_f2(a, x, y);
          } else if (p.dq_strategy == DQ_SEQPAR) {
            *reinterpret_cast<float2*>(a) = make_float2(x, y);
          } else {  // DQ_LOOP: this thread is the only writer of these two floats
            float2 old = *reinterpret_cast<float2*>(a);
            *reinterpret_cast<float2*>(a) = make_float2(old.x + x, old.y + y);
          }
        }
    }

    // dK = softmax_scale * acc_dk, dV = acc_dv: this warp's 16 KV rows x DOUT columns, written once.
    const float scale = (float)p.softmax_scale;
    T* dk_ptr = reinterpret_cast<T*>(p.dk) + batch * p.dk_batch_stride + kv_head * p.dk_head_stride;
    T* dv_ptr = reinterpret_cast<T*>(p.dv) + batch * p.dv_batch_stride + kv_head * p.dv_head_stride;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int j = n0 + wk * 16 + g + h * 8;
      if (j < seqlen_k)
#pragma unroll
        for (int df = 0; df < DFO; ++df) {
          const int c = wd * DOUT + df * 8 + 2 * t;
          *reinterpret_cast<uint32_t*>(dk_ptr + (int64_t)j * p.dk_row_stride + c) =
              pack2<T>(acc_dk[df][2 * h] * scale, acc_dk[df][2 * h + 1] * scale);
          *reinterpret_cast<uint32_t*>(dv_ptr + (int64_t)j * p.dv_row_stride + c) =
              pack2<T>(acc_dv[df][2 * h], acc_dv[df][2 * h + 1]);
        }
    }
    __syncthreads();  // "loop": every warp is done with K, V and dS^T before the next KV tile reloads them
  }
}

}  // namespace cuflash
