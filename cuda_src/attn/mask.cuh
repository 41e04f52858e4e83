// cuda_src/attn/mask.cuh -- which keys a query row sees, and the value of each score it keeps: the one
// definition every kernel family uses.
//
// Coordinates: query row i in [0, seqlen_q), key j in [0, seqlen_k) of one (batch, head); diag = seqlen_k -
// seqlen_q aligns the causal diagonal and the window bottom-right (flash-attn's convention: the last query row
// sees every key, and with seqlen_q > seqlen_k the first seqlen_q - seqlen_k rows see none).
//
//   visible(i, j)  =  j < seqlen_k  &&  (!CAUSAL || j <= i + diag)
//                                   &&  (!LOCAL || i + diag - left <= j <= i + diag + right)
//
// MOD = MOD_SCORE compiles the modifiers in, all taken from the parameter block at run time, so one more kernel
// per configuration covers every combination of them (MOD = 0: the plain kernels, unchanged):
//   LOCAL    the band [i + diag - left, i + diag + right] (flash-attn's window_size); a causal window is right = 0,
//            and the host turns an unbounded side into a bound no key reaches (left = seqlen_k, right =
//            seqlen_q), so a kernel with MOD_SCORE always tests a band (CAUSAL is false there)
//   softcap  s -> tanh(s * cap_pre), cap_pre = softmax_scale / softcap (0: off); the host sets scale_log2 =
//            softcap * log2(e), so the softmax sees softcap * tanh(softmax_scale * s / softcap), one FFMA per
//            score as before
//   ALiBi    s -> s - alibi * |i + diag - j|, alibi = the head's slope over the score's unit (softmax_scale, or
//            softcap with the soft-cap; 0: off), so the softmax sees -slope |i + diag - j| added to the scaled score
// in that order (flash-attn's). With either value modifier on (a non-zero cap_pre or slope), apply() runs on every
// tile; with the band alone only on the tiles that cross its edges. A tile inside the band whose keys all lie on
// one side of every row's diagonal (side_of; with a causal band every tile but the diagonal ones) runs no compare:
// there |i + diag - j| = +-(i + diag - j), so ALiBi's bias is a column term, one FFMA per score with the column
// offset as an immediate, plus a row term -- added once per row by the forward's softmax (apply() with a shift;
// attn/softmax.cuh), into each score by the backward, which recomputes P from the LSE (two operations per score).
//
// A kernel asks these questions of a tile of rows [i0, i1] x keys [j0, j1]:
//   needs_mask(i0, i1, j0, j1)  does apply() change any element: one is hidden, or a modifier is on (evaluated
//                               once per tile, warp-uniformly, so that the tiles inside the band and the keys
//                               -- all but the ragged end and the band's edges -- run none of the per-element
//                               code when no modifier is on)
//   above_diagonal(i1, j0)      every key lies right of every row's band (causal diagonal / right edge)
//   left_of_window(i0, j1)      every key lies left of every row's band (the window's left edge)
// and, on the tiles that need it, replaces each score by score(): -inf where hidden, the modified value else.
// Which tiles a block visits at all follows from the same edges (attn/block.cuh). The backward's dS gets the
// soft-cap's derivative from softcap_grad() or softcap_grad_of(). Every kernel calls only these functions, so a modifier written here
// reaches the forward, split-KV, decode and backward kernels alike (the V1 kernels take MOD = 0).
#pragma once
#include "../common/ptx.cuh"

namespace cuflash {

// MOD bits: MOD_SCORE (this file), MOD_DROPOUT (attn/dropout.cuh). A dropout kernel is compiled with both
// (MOD_SCORE_DROPOUT): one more kernel per configuration covers dropout with or without the modifiers.
enum : int { MOD_NONE = 0, MOD_SCORE = 1, MOD_DROPOUT = 2, MOD_SCORE_DROPOUT = 3 };
// Mask::apply_band's forms (see there).
enum : int { BAND = 0, BAND_SIDE = 1, BAND_SIDE_SHIFT = 2 };

template <bool CAUSAL, int MOD = MOD_NONE>
struct Mask {
  static constexpr bool IS_CAUSAL = CAUSAL;
  static constexpr bool LOCAL = (MOD & MOD_SCORE) != 0;  // band edges, soft-cap and ALiBi from the parameter block
  static_assert(MOD == MOD_NONE || MOD == MOD_SCORE || MOD == MOD_SCORE_DROPOUT,
                "MOD: MOD_NONE, MOD_SCORE or MOD_SCORE_DROPOUT");
  static_assert(!(CAUSAL && LOCAL), "MOD_SCORE: a causal window is the band with right = 0");

  int seqlen_k;  // keys of this (batch, head), or, for a tile-local mask (local()), keys past the tile origin
  int diag;      // seqlen_k - seqlen_q (tile-local: shifted by the tile origin)
  int left, right;       // LOCAL: the band [i + diag - left, i + diag + right]
  float cap_pre;         // soft-cap: raw score multiplier before tanh (0: off)
  float alibi;           // ALiBi: slope in the kernel's score units (0: off)

  __device__ __forceinline__ Mask(int seqlen_k_, int diag_, int left_ = 0, int right_ = 0, float cap_pre_ = 0.f,
                                  float alibi_ = 0.f)
      : seqlen_k(seqlen_k_), diag(diag_), left(left_), right(right_), cap_pre(cap_pre_), alibi(alibi_) {}

  // Key j is hidden from row i.
  __device__ __forceinline__ bool masked(int i, int j) const {
    return j >= seqlen_k || (CAUSAL && j > i + diag) || (LOCAL && (j > i + diag + right || j < i + diag - left));
  }
  // apply() changes some element of rows [i0, i1] x keys [j0, j1]: a modifier is on, or an element is hidden
  // (the corners decide: top-right for the end of the keys, the diagonal and the right edge, bottom-left for the
  // left edge).
  __device__ __forceinline__ bool needs_mask(int i0, int i1, int j0, int j1) const {
    return (LOCAL && (cap_pre != 0.f || alibi != 0.f)) || j1 >= seqlen_k || (CAUSAL && j1 > i0 + diag) ||
           (LOCAL && (j1 > i0 + diag + right || j0 < i1 + diag - left));
  }
  // Every key of [j0, ...] lies right of the band of every row of [..., i1] (the bottom-left corner decides);
  // false without CAUSAL or LOCAL.
  __device__ __forceinline__ bool above_diagonal(int i1, int j0) const {
    return (CAUSAL && j0 > i1 + diag) || (LOCAL && j0 > i1 + diag + right);
  }
  // Every key of [..., j1] lies left of the band of every row of [i0, ...] (the top-right corner decides).
  __device__ __forceinline__ bool left_of_window(int i0, int j1) const { return LOCAL && j1 < i0 + diag - left; }
  // Every element of rows [i0, i1] x keys [j0, j1] is hidden.
  __device__ __forceinline__ bool sees_none(int i0, int i1, int j0, int j1) const {
    return j0 >= seqlen_k || above_diagonal(i1, j0) || left_of_window(i0, j1);
  }
  // The same mask in coordinates relative to the tile origin (i0, j0): local(i0, j0).masked(r, c) ==
  // masked(i0 + r, j0 + c), and score() alike (every term depends on i + diag - j and j - seqlen_k only). With
  // the origin folded in once, the per-element test compares compile-time fragment offsets against registers.
  __device__ __forceinline__ Mask local(int i0, int j0) const {
    Mask m = *this;
    m.seqlen_k = seqlen_k - j0;
    m.diag = diag + i0 - j0;
    return m;
  }
  // The same mask with another head's ALiBi slope (kernels whose blocks loop over the query heads of a KV head).
  __device__ __forceinline__ Mask with_alibi(float alibi_) const {
    Mask m = *this;
    m.alibi = alibi_;
    return m;
  }
  __device__ __forceinline__ bool softcap() const { return LOCAL && cap_pre != 0.f; }
  // Rows [i0, i1] x keys [j0, j1] hide no element and the soft-cap is the only value modifier on: every score
  // becomes tanh(cap_pre s), an increasing function, so the row max of the capped scores is tanh(cap_pre max s) --
  // the forward's capped-max form (OnlineSoftmax::update_max_capped) takes the max of the raw scores, whose
  // reduction then does not wait for the per-score tanh.
  __device__ __forceinline__ bool cap_only(int i0, int i1, int j0, int j1) const {
    return softcap() && alibi == 0.f && j1 < seqlen_k && j1 <= i0 + diag + right && j0 >= i1 + diag - left;
  }

  __device__ __forceinline__ bool has_alibi() const { return LOCAL && alibi != 0.f; }
  // The modified value of a visible score s of row i, key j (soft-cap, then ALiBi; s itself with MOD_NONE). CAP,
  // ALI: whether the soft-cap / ALiBi is on (the callers' branch: tile-uniform, so each tile runs one loop).
  // ALiBi's distance |i + diag - j| in float: dist_f = (float)(i + diag - j), exact below 2^24.
  template <bool CAP, bool ALI>
  __device__ __forceinline__ float value(float s, float dist_f) const {
    if constexpr (LOCAL) {
      if constexpr (CAP) s = tanh_approx(s * cap_pre);
      if constexpr (ALI) s = fmaf(-alibi, fabsf(dist_f), s);
    }
    return s;
  }
  // The score a kernel keeps for row i, key j: -inf where hidden, else value(). Every kernel's masking goes
  // through here (on the tiles where needs_mask() holds).
  template <bool CAP = false, bool ALI = false>
  __device__ __forceinline__ float score(float s, int i, int j) const {
    return masked(i, j) ? -INFINITY : value<CAP, ALI>(s, ALI ? (float)(i + diag - j) : 0.f);
  }
  // score() with the modifiers' run-time switches inside (per-element callers that fold it into another pass).
  __device__ __forceinline__ float score_any(float s, int i, int j) const {
    if (!LOCAL) return score<false, false>(s, i, j);
    const float v = softcap() ? tanh_approx(s * cap_pre) : s;
    return masked(i, j) ? -INFINITY : (has_alibi() ? fmaf(-alibi, fabsf((float)(i + diag - j)), v) : v);
  }
  // Backward, soft-cap: d value / d (cap_pre s) = 1 - tanh^2 of the element whose ALiBi distance i + diag - j is
  // `dist`, from the probability p = exp2(value * scale_log2 - lse_log2) the backward recomputed: value =
  // (log2(p) + lse_log2) / scale_log2, tanh = value + alibi |dist|; no register holds tanh across the dP
  // product. 0 where p == 0 (dS = p (dP - D) is 0 there anyway). Callers branch on softcap() first. `dist` is
  // built like apply_band's: dist_of() of the lane's first element plus a compile-time offset.
  __device__ __forceinline__ float softcap_grad(float p, float lse_log2, float dist, float scale_log2) const {
    const float t = fmaf(alibi, fabsf(dist), __fdividef(log2_approx(p) + lse_log2, scale_log2));
    return p > 0.f ? fmaxf(0.f, fmaf(-t, t, 1.f)) : 0.f;
  }
  // The same derivative from the element's value x (what apply() / apply_t() left: value() with ALiBi, or -inf
  // where hidden), read before x becomes P: tanh = x + alibi |dist|, exactly the tanh of the score up to the rounding
  // of ALiBi's term; 0 where hidden. No MUFU (softcap_grad takes a MUFU.LG2 per score): for kernels that can keep
  // the derivative in the registers of S until dS (the sm_90a backward: its S^T accumulator is free once P is packed).
  __device__ __forceinline__ float softcap_grad_of(float x, float dist) const {
    const float t = fmaf(alibi, fabsf(dist), x);
    return x != -INFINITY ? fmaxf(0.f, fmaf(-t, t, 1.f)) : 0.f;
  }
  __device__ __forceinline__ float dist_of(int i, int j) const { return (float)(i + diag - j); }

  // s: mma.sync C fragments of rows row0 + [0, 16 MF) x keys col0 + [0, 8 NF) (ptx.cuh: lane l = 4 g + t holds
  // rows g, g + 8 and columns 2t, 2t + 1 of every m16n8 block). Each score -> score(). MOD_SCORE: a tile inside
  // the band whose keys lie on one side of every row's diagonal (side_of) takes apply_band's BAND_SIDE form,
  // every other tile its BAND form (warp-uniform branch: row0 and col0 are).
  template <int MF, int NF>
  __device__ __forceinline__ void apply(float (&s)[MF][NF][4], int row0, int col0, int lane) const {
    if constexpr (!LOCAL) {
      const int g = lane / 4, t = lane % 4;
#pragma unroll
      for (int mf = 0; mf < MF; ++mf)
#pragma unroll
        for (int nf = 0; nf < NF; ++nf)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            s[mf][nf][e] = score(s[mf][nf][e], row0 + mf * 16 + g + (e / 2) * 8, col0 + nf * 8 + 2 * t + (e % 2));
    } else {
      apply_mod<false>(s, row0, col0, lane, nullptr);
    }
  }
  // The forward's apply(): where the BAND_SIDE_SHIFT form runs, the scores are left short of ALiBi's row term,
  // which shift receives (the softmax adds it back per row: OnlineSoftmax::update_max / exp_and_sum); 0 on the
  // other tiles, whose scores are complete. A kernel calls it where needs_mask() holds and clear_shift()
  // elsewhere, and hands the softmax shift_arg(shift) (nullptr with MOD_NONE: the plain kernels' softmax is
  // unchanged).
  template <int MF, int NF>
  __device__ __forceinline__ void apply(float (&s)[MF][NF][4], int row0, int col0, int lane,
                                        float (&shift)[MF][2]) const {
    if constexpr (!LOCAL)
      apply(s, row0, col0, lane);
    else
      apply_mod<true>(s, row0, col0, lane, shift);
  }
  template <bool SHIFT, int MF, int NF>
  __device__ __forceinline__ void apply_mod(float (&s)[MF][NF][4], int row0, int col0, int lane,
                                            float (*shift)[2]) const {
    const int side = side_of(row0, row0 + 16 * MF - 1, col0, col0 + 8 * NF - 1);
    const float a = side > 0 ? alibi : -alibi;
    if (side != 0) {
      if (softcap())
        apply_band<true, SHIFT ? BAND_SIDE_SHIFT : BAND_SIDE>(s, row0, col0, lane, a, shift);
      else
        apply_band<false, SHIFT ? BAND_SIDE_SHIFT : BAND_SIDE>(s, row0, col0, lane, a, shift);
    } else {
      if constexpr (SHIFT) {
#pragma unroll
        for (int mf = 0; mf < MF; ++mf) shift[mf][0] = shift[mf][1] = 0.f;
      }
      if (softcap())
        apply_band<true>(s, row0, col0, lane);
      else
        apply_band<false>(s, row0, col0, lane);
    }
  }
  template <int MF>
  __device__ __forceinline__ static void clear_shift(float (&shift)[MF][2]) {
    if constexpr (LOCAL) {
#pragma unroll
      for (int mf = 0; mf < MF; ++mf) shift[mf][0] = shift[mf][1] = 0.f;
    }
  }
  template <int MF>
  __device__ __forceinline__ static const float (*shift_arg(const float (&shift)[MF][2]))[2] {
    return LOCAL ? shift : nullptr;
  }
  // Rows [i0, i1] x keys [j0, j1] hide no element (inside the band, below the end of the keys), and every key
  // lies at or left of every row's diagonal (+1: i + diag - j >= 0; the top-right corner decides) or at or
  // right of it (-1; the bottom-left corner decides); 0 otherwise. Then ALiBi's |i + diag - j| is
  // side (i + diag - j) on the whole tile: no compare, no select, no |.| per score. With a causal band
  // (right = 0) every tile inside the band is +1: only the tiles that cross the diagonal take apply_band.
  __device__ __forceinline__ int side_of(int i0, int i1, int j0, int j1) const {
    const bool inside = j1 < seqlen_k && j1 <= i0 + diag + right && j0 >= i1 + diag - left;
    return !inside ? 0 : j1 <= i0 + diag ? 1 : j0 >= i1 + diag ? -1 : 0;
  }
  // MOD_SCORE: each row's visible keys as an interval relative to the lane's first column (col0 + 2t), so that an
  // element compares its compile-time column offset against two registers of its row; ALiBi's distance in float
  // from one conversion per row (I2F issues at MUFU rates), and computed with a slope of 0 too (no branch).
  // FORM (BAND: that) BAND_SIDE, BAND_SIDE_SHIFT: a tile side_of() classed (a = side alibi), no compare; per
  // score the soft-cap (CAP), then ALiBi's bias -a (i + diag - j) = -a (dist0 - k), dist0 = i + diag - (col0 + 2t)
  // of the row, k the compile-time column offset. BAND_SIDE: the full value, fma(-a, dist0 - k, v) (FADD + FFMA;
  // the same value as BAND's). BAND_SIDE_SHIFT: v + a k (one FFMA, k an immediate), and the row term -a dist0 into
  // shift[mf][h] (per lane: dist0 counts from the lane's first column). The bias is separable on such a tile,
  // -a (i + diag) + a j; the per-lane row term is handed to the softmax instead of being added to every score.
  template <bool CAP, int FORM = BAND, int MF, int NF>
  __device__ __forceinline__ void apply_band(float (&s)[MF][NF][4], int row0, int col0, int lane, float a = 0.f,
                                             float (*shift)[2] = nullptr) const {
    const int base = col0 + 2 * (lane % 4);
#pragma unroll
    for (int mf = 0; mf < MF; ++mf)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int ri = row0 + mf * 16 + lane / 4 + h * 8 + diag - base;  // i + diag - (col0 + 2t)
        const int lo = ri - left, hi = min(seqlen_k - base, ri + right + 1);
        const float dist0 = (float)ri;
        if constexpr (FORM == BAND_SIDE_SHIFT) shift[mf][h] = -a * dist0;
#pragma unroll
        for (int nf = 0; nf < NF; ++nf)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int k = nf * 8 + c;
            float& x = s[mf][nf][2 * h + c];
            float v = x;
            if constexpr (CAP) v = tanh_approx(v * cap_pre);
            if constexpr (FORM == BAND_SIDE_SHIFT) {
              x = fmaf(a, (float)k, v);
            } else if constexpr (FORM == BAND_SIDE) {
              x = fmaf(-a, dist0 - (float)k, v);
            } else {
              v = fmaf(-alibi, fabsf(dist0 - (float)k), v);
              x = (k < lo || k >= hi) ? -INFINITY : v;
            }
          }
      }
  }
  // apply() of a transposed fragment (rows = keys key0 + [0, 16), columns = query rows row0 + [0, 8 NF): the
  // backward's S^T = K Q^T), MOD_SCORE only: the tiles side_of() classes (rows and keys swapped) take
  // apply_band_t's BAND_SIDE form (i + diag - j = dist0 + k, dist0 the lane's first row's); the others its BAND
  // form, each key's visible rows as an interval relative to row0 + 2t.
  template <int NF>
  __device__ __forceinline__ void apply_t(float (&s)[NF][4], int key0, int row0, int lane) const {
    static_assert(LOCAL, "apply_t: MOD_SCORE (the plain kernels use score_t)");
    const int side = side_of(row0, row0 + 8 * NF - 1, key0, key0 + 15);
    if (side != 0) {
      const float a = side > 0 ? alibi : -alibi;
      if (softcap())
        apply_band_t<true, BAND_SIDE>(s, key0, row0, lane, a);
      else
        apply_band_t<false, BAND_SIDE>(s, key0, row0, lane, a);
    } else if (softcap()) {
      apply_band_t<true>(s, key0, row0, lane);
    } else {
      apply_band_t<false>(s, key0, row0, lane);
    }
  }
  template <bool CAP, int FORM = BAND, int NF>
  __device__ __forceinline__ void apply_band_t(float (&s)[NF][4], int key0, int row0, int lane, float a = 0.f) const {
    static_assert(FORM != BAND_SIDE_SHIFT, "apply_band_t: the backward takes the full value");
    const int base = row0 + 2 * (lane % 4);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int j = key0 + lane / 4 + h * 8;
      const int dj = base + diag - j;  // i + diag - j at the lane's first row: row k sees j iff -right <= dj + k <= left
      const int lo = -right - dj, hi = left - dj + 1;
      const bool key_ok = j < seqlen_k;
      const float dist0 = (float)dj;
#pragma unroll
      for (int nf = 0; nf < NF; ++nf)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int k = nf * 8 + c;
          float& x = s[nf][2 * h + c];
          float v = x;
          if constexpr (CAP) v = tanh_approx(v * cap_pre);
          if constexpr (FORM == BAND_SIDE) {
            x = fmaf(-a, dist0 + (float)k, v);
          } else {
            v = fmaf(-alibi, fabsf(dist0 + (float)k), v);
            x = (!key_ok || k < lo || k >= hi) ? -INFINITY : v;
          }
        }
    }
  }
  // Row and key of element e of n8 block nf of a fragment whose rows are keys and columns are query rows (the
  // transposed products S^T = K Q^T of the backward): keys key0 + [0, 16), rows row0 + [0, 8 NF).
  __device__ __forceinline__ static int row_t(int row0, int nf, int e, int lane) {
    return row0 + nf * 8 + 2 * (lane % 4) + (e % 2);
  }
  __device__ __forceinline__ static int key_t(int key0, int e, int lane) { return key0 + lane / 4 + (e / 2) * 8; }
  // Row and key of element e of n8 block nf of a fragment in the usual orientation (rows = queries): rows
  // row0 + [0, 16), keys col0 + [0, 8 NF).
  __device__ __forceinline__ static int row_c(int row0, int e, int lane) { return row0 + lane / 4 + (e / 2) * 8; }
  __device__ __forceinline__ static int key_c(int col0, int nf, int e, int lane) {
    return col0 + nf * 8 + 2 * (lane % 4) + (e % 2);
  }
  // score() of one C element of a transposed fragment (see row_t / key_t).
  __device__ __forceinline__ float score_t(float s, int key0, int row0, int nf, int e, int lane) const {
    return score_any(s, row_t(row0, nf, e, lane), key_t(key0, e, lane));
  }
  // score() of one C element of a fragment in the usual orientation, for loops that fold the mask into another
  // per-element pass (see row_c / key_c).
  __device__ __forceinline__ float score_c(float s, int row0, int col0, int nf, int e, int lane) const {
    return score_any(s, row_c(row0, e, lane), key_c(col0, nf, e, lane));
  }
};

}  // namespace cuflash
