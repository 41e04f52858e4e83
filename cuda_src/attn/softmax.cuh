// cuda_src/attn/softmax.cuh -- the online softmax, in base 2, for rows held in mma.sync C fragments.
//
// Units. A score s = q . k enters the softmax as s * softmax_scale; every exponential here is base 2, so the
// host passes scale_log2 = softmax_scale * log2(e) and P = exp(s * scale - m) becomes
//     P = exp2(s * scale_log2 - m)        m in log2 units of the scaled scores (m = max_j s_j * scale_log2)
// which is one FFMA (the scale folded into the subtraction) and one MUFU.EX2 (ex2.approx) per score.
// LSE (natural log, the forward's output) = (m + log2 l) * ln 2.
//
// Rows. A thread holds rows g and g + 8 of each of MF m16 fragments (lane = 4 g + t; ptx.cuh), NF n8 blocks of
// keys each, and the quad of four lanes t = 0..3 shares a row. State per row: m (row_max) and l (row_sum,
// thread-partial: the quad reduction happens once, in finalize()).
//
// Contract, per KV tile (flash_fwd.cu and flash_decode.cu call exactly this sequence):
//     moved = update_max(S, scale_log2)     the new max a row's exponents are taken against
//     if (any lane of the warp moved) rescale(O)     O, l *= exp2(m_old - m_new)  (warp-uniform branch)
//     exp_and_sum(S, scale_log2)            S <- P = exp2(S scale_log2 - m), l += rowsum(P)
//     O += P V
// and once at the end finalize(O, lse): O /= l and the LSE. Lazy re-scaling (RESCALE_LOG2 > 0): a row keeps
// its max until a score exceeds it by more than RESCALE_LOG2 (2^8 = 256 bounds P, far from overflow in fp16,
// bf16 and fp32), so after the first tiles O and l are almost never re-scaled; exact either way, since the
// same max divides out of O / l and is added back into the LSE. RESCALE_LOG2 = 0 is the eager textbook form.
//
// Rows that see no key. Their max stays -inf; every exponent base taken from it is replaced by 0, so that
// exp2(-inf - 0) = 0 rather than exp2(-inf + inf) = NaN, l stays 0, and finalize() gives O = 0, LSE = -inf.
//
// Partial states of one row (split-KV pieces, the warps of a decode block, V1's HBM state and a new tile)
// merge by merge_partials(), in the same base-2 units.
#pragma once
#include "../common/ptx.cuh"

namespace cuflash {

constexpr float LOG2E_F = 1.4426950408889634f;
constexpr float LN2_F = 0.6931471805599453f;

// How P = exp(scale * s - m) is computed. EXP_FFMA_EX2 is the kernels' path; the others exist so that the
// V1 -> V2 ladder can measure what the instruction-level choices buy.
enum ExpVariant {
  EXP_FFMA_EX2 = 0,     // ex2.approx(fma(s, scale_log2, -m)): one FFMA + one MUFU.EX2
  EXP_PRECISE = 1,      // expf(fma(s, scale, -m)): the accurate libdevice exp (FMUL, range reduction, ...)
  EXP_SEPARATE_MUL = 2  // ex2.approx(s * scale_log2 - m) kept as FMUL + FADD (no FFMA folding)
};

// The exponent base of a row max: 0 for a row that has seen no key (see above).
__device__ __forceinline__ float exp_base(float m) { return m == -INFINITY ? 0.f : m; }

// P = exp(scale * s - m) with m in log2 units, by variant.
template <int EXP_VARIANT = EXP_FFMA_EX2>
__device__ __forceinline__ float softmax_exp(float s, float scale_log2, float m) {
  if constexpr (EXP_VARIANT == EXP_PRECISE)
    return expf(fmaf(s, scale_log2 * LN2_F, -m * LN2_F));
  else if constexpr (EXP_VARIANT == EXP_SEPARATE_MUL)
    return exp2_approx(__fadd_rn(__fmul_rn(s, scale_log2), -m));
  else
    return exp2_approx(fmaf(s, scale_log2, -m));  // FFMA + MUFU.EX2
}

// The backward's P, recomputed from the forward's LSE (lse_log2 = LSE log2(e); +inf for rows that saw no
// key, so P = exp2(-inf) = 0 there): no max, no sum.
__device__ __forceinline__ float softmax_p_from_lse(float s, float scale_log2, float lse_log2) {
  return exp2_approx(fmaf(s, scale_log2, -lse_log2));  // FFMA + MUFU.EX2
}

template <int MF, int RESCALE_LOG2 = 8>
struct OnlineSoftmax {
  float row_max[MF][2];      // m, log2 units of the scaled scores; -inf until the row sees a key
  float row_sum[MF][2];      // l, thread-partial
  float row_max_new[MF][2];  // update_max() -> rescale()

  __device__ __forceinline__ OnlineSoftmax() {
#pragma unroll
    for (int mf = 0; mf < MF; ++mf) row_max[mf][0] = row_max[mf][1] = -INFINITY, row_sum[mf][0] = row_sum[mf][1] = 0.f;
  }

  // ---- per row (mf, h): the pieces the tile-wide steps below are made of
  // Row shift (shift != nullptr: the MOD_SCORE forward, attn/mask.cuh, apply_band's BAND_SIDE_SHIFT form): this
  // lane's scores of the row are short of shift[mf][h] (score units, per lane), which enters once per row -- into
  // the lane's max before the quad's reduction, and into the exponent base -- instead of once per score:
  //     max = quad_max(max_lane(s) + shift),    P = exp2(s * scale_log2 - (m - shift * scale_log2)).
  // The row's m, l, O and LSE are those of the complete scores.
  // The row's new max from this tile's scores; returns whether it moved (scale_log2 > 0: the host checks it,
  // so max(s) * scale_log2 = max(s * scale_log2)).
  // CAPPED (update_max_capped): the row's scores become tanh(cap_pre s) in place after its lane max is taken of
  // the raw ones, and the reduced max is capped the same way (s is then a non-const array).
  template <bool CAPPED = false, typename S>
  __device__ __forceinline__ bool row_update_max(S& s, float scale_log2, int mf, int h,
                                                 const float (*shift)[2] = nullptr, float cap_pre = 0.f) {
    constexpr int NF = sizeof(s[0]) / sizeof(s[0][0]);
    float mx = -INFINITY;
#pragma unroll
    for (int nf = 0; nf < NF; ++nf) mx = fmaxf(mx, fmaxf(s[mf][nf][2 * h], s[mf][nf][2 * h + 1]));
    if (shift) mx += shift[mf][h];
    if constexpr (CAPPED) {
#pragma unroll
      for (int nf = 0; nf < NF; ++nf)
#pragma unroll
        for (int e = 2 * h; e < 2 * h + 2; ++e) s[mf][nf][e] = tanh_approx(s[mf][nf][e] * cap_pre);
      mx = tanh_approx(quad_max(mx) * cap_pre) * scale_log2;
    } else {
      mx = quad_max(mx) * scale_log2;
    }
    const bool moved = mx > row_max[mf][h] + (float)RESCALE_LOG2;
    row_max_new[mf][h] = moved ? mx : row_max[mf][h];
    return moved;
  }
  // O and l of the row *= alpha = exp2(m_old - m_new); m = m_new. l_carry: see rescale().
  template <int DF>
  __device__ __forceinline__ void row_rescale(float (&acc_o)[MF][DF][4], float (*l_carry)[2], int mf, int h) {
    const float alpha = exp2_approx(row_max[mf][h] - exp_base(row_max_new[mf][h]));
    float a = alpha;
    if (l_carry)
      a = l_carry[mf][h] *= alpha;  // row_sum holds this tile's sums only (step())
    else
      row_sum[mf][h] *= alpha;
#pragma unroll
    for (int df = 0; df < DF; ++df) {
      acc_o[mf][df][2 * h] *= a;
      acc_o[mf][df][2 * h + 1] *= a;
    }
    row_max[mf][h] = row_max_new[mf][h];
  }
  // The row's P = exp2(S * scale_log2 - m) in place; l += its sum (FRESH: l = its sum).
  template <int EXP_VARIANT, bool FRESH = false, int NF>
  __device__ __forceinline__ void row_exp_sum(float (&s)[MF][NF][4], float scale_log2, int mf, int h,
                                              const float (*shift)[2] = nullptr) {
    float m = exp_base(row_max[mf][h]);
    if (shift) m = fmaf(-shift[mf][h], scale_log2, m);
    float sum = 0.f;
#pragma unroll
    for (int nf = 0; nf < NF; ++nf)
#pragma unroll
      for (int e = 2 * h; e < 2 * h + 2; ++e) {
        s[mf][nf][e] = softmax_exp<EXP_VARIANT>(s[mf][nf][e], scale_log2, m);
        sum += s[mf][nf][e];
      }
    row_sum[mf][h] = FRESH ? sum : row_sum[mf][h] + sum;
  }

  // ---- tile-wide steps
  // The max each row takes its exponents against from this tile on; returns whether one of this thread's rows
  // moved it. shift: see row_update_max.
  template <int NF>
  __device__ __forceinline__ bool update_max(const float (&s)[MF][NF][4], float scale_log2,
                                             const float (*shift)[2] = nullptr) {
    bool moved_any = false;
#pragma unroll
    for (int mf = 0; mf < MF; ++mf)
#pragma unroll
      for (int h = 0; h < 2; ++h) moved_any |= row_update_max(s, scale_log2, mf, h, shift);
    return moved_any;
  }

  // update_max on a tile whose scores all become tanh(cap_pre s) (Mask::cap_only: the soft-cap alone, no element
  // hidden), the soft-cap applied here: each row's max is taken of the raw scores and capped once, tanh(cap_pre
  // max s) (tanh is increasing; cap_pre > 0), while every score is capped in place. The max's reduction (FMNMX, the
  // quad's shuffles) then depends on the product alone and runs beside the per-score tanh (MUFU), where update_max
  // after Mask::apply waits for the last of them. tanh.approx may round two close scores out of order: a score then
  // lies above the row's m by scale_log2 times that difference (about |scaled score| log2(e) 2^-10 in log2 units at
  // tanh.approx's error), a little past the lazy re-scaling's margin (P <= 2^(RESCALE_LOG2 + 0.05) at soft-cap 30).
  template <int NF>
  __device__ __forceinline__ bool update_max_capped(float (&s)[MF][NF][4], float scale_log2, float cap_pre) {
    bool moved_any = false;
#pragma unroll
    for (int mf = 0; mf < MF; ++mf)
#pragma unroll
      for (int h = 0; h < 2; ++h) moved_any |= row_update_max<true>(s, scale_log2, mf, h, nullptr, cap_pre);
    return moved_any;
  }

  // O and l *= alpha = exp2(m_old - m_new) (1 exactly for rows that did not move; 0 for rows that had seen no
  // key), m = m_new. Called under a warp-uniform branch, only when some row of the warp moved.
  // l_carry (V1: O and l kept normalised in HBM): O holds O / l and l is not in row_sum but in l_carry, the
  // whole row's l in every lane of the quad; both become l alpha, O in the same multiply.
  template <int DF>
  __device__ __forceinline__ void rescale(float (&acc_o)[MF][DF][4], float (*l_carry)[2] = nullptr) {
#pragma unroll
    for (int mf = 0; mf < MF; ++mf)
#pragma unroll
      for (int h = 0; h < 2; ++h) row_rescale(acc_o, l_carry, mf, h);
  }

  // m = m_new without touching O: for a state that has no O yet (a fresh partial).
  __device__ __forceinline__ void set_max() {
#pragma unroll
    for (int mf = 0; mf < MF; ++mf) row_max[mf][0] = row_max_new[mf][0], row_max[mf][1] = row_max_new[mf][1];
  }

  // The overlapped form (the sm_90 forward: O += P V of the previous tile is still running on the tensor cores
  // while this tile's softmax runs, so O cannot be touched yet). After update_max: rescale_sum() takes l and m
  // to the new max and returns each row's alpha = exp2(m_old - m_new); exp_and_sum() follows at once, and
  // rescale_o() applies the alphas to O once that product has completed. Same arithmetic as rescale().
  __device__ __forceinline__ void rescale_sum(float (&alpha)[MF][2]) {
#pragma unroll
    for (int mf = 0; mf < MF; ++mf)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        alpha[mf][h] = exp2_approx(row_max[mf][h] - exp_base(row_max_new[mf][h]));
        row_sum[mf][h] *= alpha[mf][h];
        row_max[mf][h] = row_max_new[mf][h];
      }
  }
  template <int DF>
  __device__ __forceinline__ static void rescale_o(float (&acc_o)[MF][DF][4], const float (&alpha)[MF][2]) {
#pragma unroll
    for (int mf = 0; mf < MF; ++mf)
#pragma unroll
      for (int df = 0; df < DF; ++df)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_o[mf][df][e] *= alpha[mf][e / 2];
  }

  // S <- P = exp2(S * scale_log2 - m) in place; l += rowsum(P). shift: see row_update_max (the same as there).
  template <int EXP_VARIANT = EXP_FFMA_EX2, int NF>
  __device__ __forceinline__ void exp_and_sum(float (&s)[MF][NF][4], float scale_log2,
                                              const float (*shift)[2] = nullptr) {
#pragma unroll
    for (int mf = 0; mf < MF; ++mf)
#pragma unroll
      for (int h = 0; h < 2; ++h) row_exp_sum<EXP_VARIANT>(s, scale_log2, mf, h, shift);
  }

  // update_max, rescale and exp_and_sum fused row by row, with no warp-uniform branch: every row is re-scaled
  // (the eager form, where rows move at most tiles), for a state whose l is carried in l_carry (see rescale:
  // V1, one tile per state) and row_sum receives this tile's sums. One pass over each row keeps fewer values
  // live at once than three passes over the tile (V1's split-Q forward, at 255 registers, needs it).
  template <int EXP_VARIANT = EXP_FFMA_EX2, int NF, int DF>
  __device__ __forceinline__ void step(float (&s)[MF][NF][4], float (&acc_o)[MF][DF][4], float scale_log2,
                                       float (&l_carry)[MF][2]) {
#pragma unroll
    for (int mf = 0; mf < MF; ++mf)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        row_update_max(s, scale_log2, mf, h);
        row_rescale(acc_o, l_carry, mf, h);
        row_exp_sum<EXP_VARIANT, true>(s, scale_log2, mf, h);
      }
  }

  // The row's l, summed over its quad (every lane of the quad gets it).
  __device__ __forceinline__ float row_sum_total(int mf, int h) const { return quad_sum(row_sum[mf][h]); }

  // O /= l (0 for rows that saw no key); l gets the rows' l. l_carry (see rescale): added to the row's l.
  template <int DF>
  __device__ __forceinline__ void normalize(float (&acc_o)[MF][DF][4], float (&l)[MF][2],
                                            const float (*l_carry)[2] = nullptr) const {
#pragma unroll
    for (int mf = 0; mf < MF; ++mf)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        l[mf][h] = row_sum_total(mf, h) + (l_carry ? l_carry[mf][h] : 0.f);
        const float inv_l = l[mf][h] > 0.f ? 1.f / l[mf][h] : 0.f;
#pragma unroll
        for (int df = 0; df < DF; ++df) {
          acc_o[mf][df][2 * h] *= inv_l;
          acc_o[mf][df][2 * h + 1] *= inv_l;
        }
      }
  }
  // The row's LSE, natural log, from its l: (m + log2 l) ln 2; -inf for a row that saw no key (l = 0).
  __device__ __forceinline__ float lse(int mf, int h, float l) const {
    return l > 0.f ? (exp_base(row_max[mf][h]) + __log2f(l)) * LN2_F : -INFINITY;
  }
  // normalize() and every row's LSE.
  template <int DF>
  __device__ __forceinline__ void finalize(float (&acc_o)[MF][DF][4], float (&lse_out)[MF][2]) const {
    float l[MF][2];
    normalize(acc_o, l);
#pragma unroll
    for (int mf = 0; mf < MF; ++mf)
#pragma unroll
      for (int h = 0; h < 2; ++h) lse_out[mf][h] = lse(mf, h, l[mf][h]);
  }
};

// Merge N partial states (m_w, l_w) of one row, m in log2 units (-inf: the partial saw no key):
//   M = max_w m_w,  c_w = exp2(m_w - M),  L = sum_w c_w l_w,  O = sum_w c_w O_w / L,  lse_log2 = M + log2 L.
// Fills c[w] and returns L (0 when no partial saw a key: every c_w = exp2(-inf - 0) = 0); m_max gets M (-inf
// when no partial saw a key). m_of(w), l_of(w) read partial w.
template <int N, typename MOf, typename LOf>
__device__ __forceinline__ float merge_partials(const MOf& m_of, const LOf& l_of, float (&c)[N], float& m_max) {
  float mx = -INFINITY;
#pragma unroll
  for (int w = 0; w < N; ++w) mx = fmaxf(mx, m_of(w));
  m_max = mx;
  const float base = exp_base(mx);
  float l_tot = 0.f;
#pragma unroll
  for (int w = 0; w < N; ++w) {
    c[w] = exp2_approx(m_of(w) - base);
    l_tot += c[w] * l_of(w);
  }
  return l_tot;
}

// lse (natural log) of a merged row: (M + log2 L) ln 2, -inf when L = 0.
__device__ __forceinline__ float merged_lse(float m_max, float l_tot) {
  return l_tot > 0.f ? (exp_base(m_max) + __log2f(l_tot)) * LN2_F : -INFINITY;
}

}  // namespace cuflash
