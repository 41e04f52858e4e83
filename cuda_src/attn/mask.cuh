// cuda_src/attn/mask.cuh -- which keys a query row sees: the one definition every kernel family uses.
//
// Coordinates: query row i in [0, seqlen_q), key j in [0, seqlen_k) of one (batch, head); diag = seqlen_k -
// seqlen_q aligns the causal diagonal bottom-right (flash-attn's convention: the last query row sees every
// key, and with seqlen_q > seqlen_k the first seqlen_q - seqlen_k rows see none).
//
//   visible(i, j)  =  j < seqlen_k  &&  (!CAUSAL || j <= i + diag)
//
// A kernel asks two questions of a tile of rows [i0, i1] x keys [j0, j1]:
//   needs_mask(i0, j1)  does any element of it fail visible()?  (evaluated once per tile, warp-uniformly,
//                       so that the tiles that need no mask -- all but the ragged end and the diagonal -- run
//                       none of the per-element code)
//   sees_none(i1, j0)   does no element pass?  (such tiles are never loaded: attn/block.cuh)
// and, on the tiles that need it, sets the scores that fail visible() to -inf (apply*).
//
// Extending (score modifiers). A local window adds `j >= i + diag - window_left` and `j <= i + diag +
// window_right` to visible(), the matching terms to needs_mask / sees_none, and its KV range to
// attn/block.cuh; ALiBi (-slope |i + diag - j|) and softcap (softcap * tanh(s / softcap)) change the value of
// a visible score rather than its visibility, and attach where apply*() visits each (i, j) with its score.
// Every kernel calls only these functions, so a modifier written here reaches the forward, split-KV, decode,
// backward and V1 kernels alike.
#pragma once
#include "../common/ptx.cuh"

namespace cuflash {

template <bool CAUSAL>
struct Mask {
  int seqlen_k;  // keys of this (batch, head), or, for a tile-local mask (local()), keys past the tile origin
  int diag;      // seqlen_k - seqlen_q (tile-local: shifted by the tile origin)

  __device__ __forceinline__ Mask(int seqlen_k_, int diag_) : seqlen_k(seqlen_k_), diag(diag_) {}

  // Key j is hidden from row i.
  __device__ __forceinline__ bool masked(int i, int j) const { return j >= seqlen_k || (CAUSAL && j > i + diag); }
  // Some element of rows [i0, ...] x keys [..., j1] is hidden (the top-right corner decides).
  __device__ __forceinline__ bool needs_mask(int i0, int j1) const {
    return j1 >= seqlen_k || (CAUSAL && j1 > i0 + diag);
  }
  // Every key of [j0, ...] lies above the causal diagonal of every row of [..., i1] (the bottom-left corner
  // decides); false without CAUSAL.
  __device__ __forceinline__ bool above_diagonal(int i1, int j0) const { return CAUSAL && j0 > i1 + diag; }
  // Every element of rows [..., i1] x keys [j0, ...] is hidden.
  __device__ __forceinline__ bool sees_none(int i1, int j0) const { return j0 >= seqlen_k || above_diagonal(i1, j0); }
  // The same mask in coordinates relative to the tile origin (i0, j0): local(i0, j0).masked(r, c) ==
  // masked(i0 + r, j0 + c). With the origin folded in once, the per-element test compares compile-time
  // fragment offsets against two registers.
  __device__ __forceinline__ Mask local(int i0, int j0) const { return Mask(seqlen_k - j0, diag + i0 - j0); }

  // The score a kernel keeps for row i, key j: -inf where hidden, else s. Every kernel's masking goes through
  // here (on the tiles where needs_mask() holds), so a modifier of the score's value (ALiBi, softcap) is written
  // here once -- together with making needs_mask() true on the tiles it changes.
  __device__ __forceinline__ float score(float s, int i, int j) const { return masked(i, j) ? -INFINITY : s; }

  // s: mma.sync C fragments of rows row0 + [0, 16 MF) x keys col0 + [0, 8 NF) (ptx.cuh: lane l = 4 g + t holds
  // rows g, g + 8 and columns 2t, 2t + 1 of every m16n8 block). Hidden scores -> -inf.
  template <int MF, int NF>
  __device__ __forceinline__ void apply(float (&s)[MF][NF][4], int row0, int col0, int lane) const {
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int mf = 0; mf < MF; ++mf)
#pragma unroll
      for (int nf = 0; nf < NF; ++nf)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          s[mf][nf][e] = score(s[mf][nf][e], row0 + mf * 16 + g + (e / 2) * 8, col0 + nf * 8 + 2 * t + (e % 2));
  }
  // score() of one C element of a fragment whose rows are keys and columns are query rows (the transposed
  // products S^T = K Q^T of the backward): element e of n8 block nf, keys key0 + [0, 16), rows row0 + [0, 8 NF).
  __device__ __forceinline__ float score_t(float s, int key0, int row0, int nf, int e, int lane) const {
    return score(s, row0 + nf * 8 + 2 * (lane % 4) + (e % 2), key0 + lane / 4 + (e / 2) * 8);
  }
  // score() of one C element of a fragment in the usual orientation (rows = queries), for loops that fold the
  // mask into another per-element pass: element e of n8 block nf, rows row0 + [0, 16), keys col0 + [0, 8 NF).
  __device__ __forceinline__ float score_c(float s, int row0, int col0, int nf, int e, int lane) const {
    return score(s, row0 + lane / 4 + (e / 2) * 8, col0 + nf * 8 + 2 * (lane % 4) + (e % 2));
  }
};

}  // namespace cuflash
