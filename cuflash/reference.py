"""NumPy float64 references for the cuflash attention kernels (CPU only).

Each function mirrors one algorithm, so the math of a kernel can be tested on a CPU:

* ``attention_forward`` / ``attention_backward``: naive S = scale*QK^T, P = softmax(S), O = PV, with
  flash-attn's score options: sliding window (``window_size``), ``softcap``, ``alibi_slopes``.
* ``flash_v1_forward`` / ``flash_v1_backward``: FlashAttention-1 (Dao et al. 2022, Algorithms 1
  and 4 without dropout): KV blocks outer, Q blocks inner, O / m / l / dQ kept in full-size
  "HBM" arrays that are read, updated and written back for every tile.
* ``flash_v2_forward`` / ``flash_backward``: FlashAttention-2 (Dao 2023): Q blocks outer with a
  base-2 online softmax in the forward; KV blocks outer, P recomputed from LSE in the backward.
* ``split_kv_forward`` / ``combine_splits``: Flash-Decoding; partial outputs over key splits
  merged through their LSEs. ``decode_kernel_forward``: the dedicated decode kernel (warps split the
  keys of a split, their partial softmax states are merged in the block).
* ``attention_flops``: the one FLOP formula of the project.

Symbols: m = running row max of the scores, l = running row sum of exp(S - m),
LSE = log-sum-exp of a row = m + log(l), D = rowsum(dO * O).

Conventions (as flash-attn):
  q [b, sq, h, d]; k, v [b, sk, hk, d] with h % hk == 0; query head i uses kv head i // (h // hk).
  out like q; LSE [b, h, sq] in natural log; softmax_scale=None means 1/sqrt(d).
  causal is bottom-right aligned: query i sees key j iff j <= i + (sk - sq).
  A row that sees no key has out = 0, LSE = -inf and zero gradients, never NaN.
Internally every tensor is [b, h, s, d] with the kv heads repeated up to h; all math is float64.
"""
import math

import numpy as np

__all__ = [
    "causal_mask", "visible_mask", "alibi_bias", "attention_forward", "attention_backward", "flash_v1_forward",
    "flash_v1_backward", "flash_v2_forward", "flash_backward", "split_kv_forward",
    "combine_splits", "decode_warp_tiles", "decode_kernel_forward", "attention_flops",
]

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


# ---------------------------------------------------------------------------------------- helpers

def _bhsd(x):
    """[b, s, h, d] -> float64 [b, h, s, d]."""
    return np.asarray(x, dtype=np.float64).transpose(0, 2, 1, 3)


def _bshd(x):
    """[b, h, s, d] -> contiguous [b, s, h, d]."""
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3))


def _prep(q, k, v, softmax_scale):
    """Check shapes; return q, k, v as float64 [b, h, s, d] (kv heads repeated), scale, hk."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    if q.ndim != 4 or k.shape != v.shape or k.ndim != 4:
        raise ValueError(f"expected q [b, sq, h, d], k = v [b, sk, hk, d]; "
                         f"got {q.shape}, {k.shape}, {v.shape}")
    b, _, h, d = q.shape
    hk = k.shape[2]
    if k.shape[0] != b or k.shape[3] != d or h % hk:
        raise ValueError(f"incompatible q {q.shape} and k/v {k.shape}")
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    g = h // hk  # query heads per kv head
    return _bhsd(q), _bhsd(np.repeat(k, g, axis=2)), _bhsd(np.repeat(v, g, axis=2)), scale, hk


def _sum_kv_heads(dx, hk):
    """GQA: [b, h, sk, d] grads -> [b, sk, hk, d], summed over the query heads of each kv head."""
    b, h, sk, d = dx.shape
    return _bshd(dx.reshape(b, hk, h // hk, sk, d).sum(axis=2))


def _finite(m):
    """m with -inf replaced by 0, so exp(x - m) never sees -inf - (-inf)."""
    return np.where(m == -np.inf, 0.0, m)


def _safe_inv(l):
    """1 / l, and 0 where l == 0 (rows that saw no key)."""
    pos = l > 0
    return np.where(pos, 1.0 / np.where(pos, l, 1.0), 0.0)


def _lse(m, l):
    """LSE = m + log(l) (natural), -inf where l == 0."""
    pos = l > 0
    return np.where(pos, m + np.log(np.where(pos, l, 1.0)), -np.inf)


def _cdiv(a, b):
    return -(-a // b)


def _blocks(n, bs):
    """[(start, stop)] tiles of size bs covering [0, n); the last one may be short."""
    return [(s, min(s + bs, n)) for s in range(0, n, bs)]


def _above_diag(i1, j0, off):
    """Tile rows [., i1) x cols [j0, .) fully masked: first key past the last row's last key."""
    return j0 > i1 - 1 + off


def _crosses_diag(i0, j1, off):
    """Tile rows [i0, .) x cols [., j1) partly masked: last key past the first row's last key."""
    return j1 - 1 > i0 + off


def _mask_tile(s, i0, j0, off):
    """Set the invisible scores of tile s [..., rows i0.., cols j0..] to -inf."""
    rows = np.arange(i0, i0 + s.shape[-2])[:, None]
    cols = np.arange(j0, j0 + s.shape[-1])[None, :]
    return np.where(cols <= rows + off, s, -np.inf)


# -------------------------------------------------------------------------------------- naive

def causal_mask(seqlen_q, seqlen_k):
    """Bottom-right causal mask [sq, sk], True = visible: j <= i + (sk - sq)."""
    return np.arange(seqlen_k)[None, :] <= np.arange(seqlen_q)[:, None] + (seqlen_k - seqlen_q)


def visible_mask(seqlen_q, seqlen_k, causal=False, window_size=(-1, -1)):
    """Which keys each query row sees, [sq, sk] bool, flash-attn's semantics with off = sk - sq: key j is visible
    to row i iff i + off - left <= j <= i + off + right (a negative bound: unbounded on that side); causal is
    right = 0."""
    left, right = window_size
    if causal:
        right = 0
    i = np.arange(seqlen_q)[:, None] + (seqlen_k - seqlen_q)
    j = np.arange(seqlen_k)[None, :]
    vis = np.ones((seqlen_q, seqlen_k), dtype=bool)
    if left >= 0:
        vis &= j >= i - left
    if right >= 0:
        vis &= j <= i + right
    return vis


def alibi_bias(alibi_slopes, batch, nheads, seqlen_q, seqlen_k):
    """ALiBi's additive bias [b, h, sq, sk]: -slope * |i + off - j|; slopes of shape (nheads,) or (batch, nheads)."""
    sl = np.asarray(alibi_slopes, dtype=np.float64)
    sl = np.broadcast_to(sl.reshape((1, nheads) if sl.ndim == 1 else (batch, nheads)), (batch, nheads))
    dist = np.abs(np.arange(seqlen_q)[:, None] + (seqlen_k - seqlen_q) - np.arange(seqlen_k)[None, :])
    return -sl[:, :, None, None] * dist[None, None]


def _scores(q, k, scale, causal, window_size=(-1, -1), softcap=0.0, alibi_slopes=None):
    """The scores the softmax sees [b, h, sq, sk] (hidden ones -inf) and d(scores)/d(scale * Q K^T) (the softcap
    derivative 1 - tanh^2; 1 without softcap): s = scale * Q K^T; with softcap c > 0, s = c tanh(s / c); hidden
    keys (window, causal) -inf; then + ALiBi's bias (flash-attn's order)."""
    s = scale * (q @ k.swapaxes(-1, -2))
    dcap = 1.0
    if softcap > 0:
        t = np.tanh(s / softcap)
        s, dcap = softcap * t, 1.0 - t * t
    b, h, sq, sk = s.shape
    if causal or window_size[0] >= 0 or window_size[1] >= 0:
        s = np.where(visible_mask(sq, sk, causal, window_size), s, -np.inf)
    if alibi_slopes is not None:
        s = s + alibi_bias(alibi_slopes, b, h, sq, sk)
    return s, dcap


def _naive_probs(q, k, scale, causal, window_size=(-1, -1), softcap=0.0, alibi_slopes=None):
    """P = softmax(scores) [b, h, sq, sk] plus its m and l and the softcap derivative (see _scores); empty rows
    give P = 0."""
    s, dcap = _scores(q, k, scale, causal, window_size, softcap, alibi_slopes)
    m = s.max(axis=-1, initial=-np.inf)  # [b, h, sq]
    e = np.exp(s - _finite(m)[..., None])
    l = e.sum(axis=-1)  # [b, h, sq]
    return e * _safe_inv(l)[..., None], m, l, dcap


def _dropped(p, dropout_mask, dropout_p):
    """P with dropout: P * Z / (1 - p), Z the keep mask [b, h, sq, sk] (None: no dropout)."""
    if dropout_mask is None:
        return p
    return p * np.asarray(dropout_mask, dtype=np.float64) / (1.0 - dropout_p)


def attention_forward(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                      alibi_slopes=None, dropout_mask=None, dropout_p=0.0):
    """Naive attention: O = softmax(scores) V with flash-attn's score options (sliding window, softcap, ALiBi;
    see _scores) and dropout: with a keep mask Z [b, h, sq, sk] (1 keep, 0 drop), O = (P * Z / (1 - dropout_p)) V,
    the LSE that of the undropped softmax. Returns out [b, sq, h, d], LSE [b, h, sq]."""
    q, k, v, scale, _ = _prep(q, k, v, softmax_scale)
    p, m, l, _ = _naive_probs(q, k, scale, causal, window_size, softcap, alibi_slopes)
    return _bshd(_dropped(p, dropout_mask, dropout_p) @ v), _lse(m, l)


def attention_backward(dout, q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                       alibi_slopes=None, dropout_mask=None, dropout_p=0.0):
    """Naive backward from the full P: dV = P^T dO, dP = dO V^T, dS = P * (dP - D), times the softcap
    derivative, dQ = scale dS K, dK = scale dS^T Q with D = rowsum(P * dP) = rowsum(dO * O) (ALiBi's bias has
    no gradient). With dropout (keep mask Z): dV = (P Z / (1 - p))^T dO and dP = (dO V^T) Z / (1 - p). Returns
    dq like q, dk and dv like k (summed over the query heads of each kv head)."""
    q, k, v, scale, hk = _prep(q, k, v, softmax_scale)
    do = _bhsd(dout)  # [b, h, sq, d]
    p, _, _, dcap = _naive_probs(q, k, scale, causal, window_size, softcap, alibi_slopes)  # [b, h, sq, sk]
    dv = _dropped(p, dropout_mask, dropout_p).swapaxes(-1, -2) @ do  # [b, h, sk, d]
    dp = _dropped(do @ v.swapaxes(-1, -2), dropout_mask, dropout_p)  # [b, h, sq, sk]
    ds = p * (dp - (p * dp).sum(axis=-1, keepdims=True)) * dcap
    dq = scale * (ds @ k)  # [b, h, sq, d]
    dk = scale * (ds.swapaxes(-1, -2) @ q)  # [b, h, sk, d]
    return _bshd(dq), _sum_kv_heads(dk, hk), _sum_kv_heads(dv, hk)


# --------------------------------------------------------------------------- FlashAttention-1

def flash_v1_forward(q, k, v, softmax_scale=None, causal=False, block_m=64, block_n=64):
    """FlashAttention-1 forward (Algorithm 1): KV blocks outer, Q blocks inner, natural exp.
    Per tile: m~ = rowmax(S_ij), P~ = exp(S_ij - m~), l~ = rowsum(P~), m_new = max(m_i, m~),
    l_new = e^{m_i - m_new} l_i + e^{m~ - m_new} l~,
    O_i = diag(l_new)^-1 (diag(l_i) e^{m_i - m_new} O_i + e^{m~ - m_new} P~ V_j).
    Returns out [b, sq, h, d], LSE, m, l (all [b, h, sq]; m, l of the scaled scores S)."""
    q, k, v, scale, _ = _prep(q, k, v, softmax_scale)
    b, h, sq, d = q.shape
    sk = k.shape[2]
    off = sk - sq
    o = np.zeros((b, h, sq, d))  # HBM: O
    l = np.zeros((b, h, sq))  # HBM: l
    m = np.full((b, h, sq), -np.inf)  # HBM: m
    for j0, j1 in _blocks(sk, block_n):  # outer: K_j, V_j -> SRAM
        kj, vj = k[:, :, j0:j1], v[:, :, j0:j1]  # [b, h, bn, d]
        for i0, i1 in _blocks(sq, block_m):  # inner: Q_i, O_i, l_i, m_i -> SRAM
            if causal and _above_diag(i1, j0, off):
                continue
            qi, oi, li, mi = q[:, :, i0:i1], o[:, :, i0:i1], l[:, :, i0:i1], m[:, :, i0:i1]
            s = scale * (qi @ kj.swapaxes(-1, -2))  # S_ij [b, h, bm, bn]
            if causal and _crosses_diag(i0, j1, off):
                s = _mask_tile(s, i0, j0, off)
            m_t = s.max(axis=-1)  # m~_ij [b, h, bm]
            p_t = np.exp(s - _finite(m_t)[..., None])  # P~_ij
            l_t = p_t.sum(axis=-1)  # l~_ij
            m_new = np.maximum(mi, m_t)
            a = np.exp(mi - _finite(m_new))  # e^{m_i - m_new}
            c = np.exp(m_t - _finite(m_new))  # e^{m~_ij - m_new}
            l_new = a * li + c * l_t
            o[:, :, i0:i1] = _safe_inv(l_new)[..., None] * (
                (li * a)[..., None] * oi + c[..., None] * (p_t @ vj))  # O_i -> HBM
            l[:, :, i0:i1] = l_new  # l_i -> HBM
            m[:, :, i0:i1] = m_new  # m_i -> HBM
    return _bshd(o), _lse(m, l), m, l


def flash_v1_backward(dout, q, k, v, out, m, l, softmax_scale=None, causal=False, block_m=64,
                      block_n=64):
    """FlashAttention-1 backward (Algorithm 4, no dropout): KV blocks outer, Q blocks inner.
    P_ij = diag(l_i)^-1 exp(S_ij - m_i) from the forward's m, l [b, h, sq]; D_i = rowsum(dO_i O_i);
    dS_ij = P_ij * (dP_ij - D_i); dQ_i (HBM) += scale dS_ij K_j; dK_j, dV_j accumulate in SRAM."""
    q, k, v, scale, hk = _prep(q, k, v, softmax_scale)
    do, o = _bhsd(dout), _bhsd(out)  # [b, h, sq, d]
    m, inv_l = _finite(np.asarray(m, dtype=np.float64)), _safe_inv(np.asarray(l, dtype=np.float64))
    sq, sk = q.shape[2], k.shape[2]
    off = sk - sq
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)  # HBM
    for j0, j1 in _blocks(sk, block_n):  # outer: K_j, V_j -> SRAM, dK~_j = dV~_j = 0
        kj, vj = k[:, :, j0:j1], v[:, :, j0:j1]  # [b, h, bn, d]
        dkj, dvj = np.zeros(kj.shape), np.zeros(vj.shape)
        for i0, i1 in _blocks(sq, block_m):  # inner: Q_i, O_i, dO_i, dQ_i, l_i, m_i -> SRAM
            if causal and _above_diag(i1, j0, off):
                continue
            qi, oi, doi = q[:, :, i0:i1], o[:, :, i0:i1], do[:, :, i0:i1]
            s = scale * (qi @ kj.swapaxes(-1, -2))  # S_ij [b, h, bm, bn]
            if causal and _crosses_diag(i0, j1, off):
                s = _mask_tile(s, i0, j0, off)
            p = inv_l[:, :, i0:i1, None] * np.exp(s - m[:, :, i0:i1, None])  # P_ij
            dvj += p.swapaxes(-1, -2) @ doi
            dp = doi @ vj.swapaxes(-1, -2)  # dP_ij [b, h, bm, bn]
            d_i = (doi * oi).sum(axis=-1)  # D_i [b, h, bm]
            ds = p * (dp - d_i[..., None])  # dS_ij
            dq[:, :, i0:i1] += scale * (ds @ kj)  # dQ_i -> HBM
            dkj += scale * (ds.swapaxes(-1, -2) @ qi)
        dk[:, :, j0:j1], dv[:, :, j0:j1] = dkj, dvj  # dK_j, dV_j -> HBM
    return _bshd(dq), _sum_kv_heads(dk, hk), _sum_kv_heads(dv, hk)


# --------------------------------------------------------------------------- FlashAttention-2

def _fa2_row_block(qi, k, v, scale, i0, off, causal, n_lo, n_hi, block_n):
    """FA2 forward of one Q block (query rows i0..) over key blocks [n_lo, n_hi) of size block_n.
    qi [b, h, bm, d]; k, v [b, h, sk, d]. Returns O [b, h, bm, d] normalised by its own l,
    and LSE [b, h, bm] (-inf and O = 0 for rows that saw no key)."""
    scale_log2 = scale * _LOG2E
    sk = k.shape[2]
    if causal:  # key blocks entirely above the diagonal are never visited
        n_hi = min(n_hi, _cdiv(max(0, min(sk, i0 + qi.shape[2] + off)), block_n))
    acc = np.zeros(qi.shape)  # O accumulator (registers), [b, h, bm, d]
    m = np.full(qi.shape[:3], -np.inf)  # running row max of the raw scores
    m_scaled = np.zeros(qi.shape[:3])
    l = np.zeros(qi.shape[:3])  # running row sum
    for n in range(n_lo, n_hi):
        j0, j1 = n * block_n, min((n + 1) * block_n, sk)  # slicing replaces the OOB-column mask
        s = qi @ k[:, :, j0:j1].swapaxes(-1, -2)  # S_raw [b, h, bm, bn], unscaled GEMM output
        if causal and _crosses_diag(i0, j1, off):  # only diagonal tiles pay for the mask
            s = _mask_tile(s, i0, j0, off)
        m_old, m = m, np.maximum(m, s.max(axis=-1))
        m_scaled = np.where(m == -np.inf, 0.0, m * scale_log2)  # no -inf - (-inf) in the exponent
        p = np.exp2(s * scale_log2 - m_scaled[..., None])  # per element: FFMA + EX2
        alpha = np.exp2(m_old * scale_log2 - m_scaled)  # per row: FFMA + EX2
        l = alpha * l + p.sum(axis=-1)
        acc = alpha[..., None] * acc + p @ v[:, :, j0:j1]
    lse_log2 = m_scaled + np.log2(np.where(l > 0, l, 1.0))
    lse = np.where(l > 0, lse_log2 * _LN2, -np.inf)
    return acc * _safe_inv(l)[..., None], lse


def flash_v2_forward(q, k, v, softmax_scale=None, causal=False, block_m=64, block_n=64):
    """FlashAttention-2 forward: Q blocks outer (one CTA each), KV blocks inner, online softmax in
    base 2 on the raw scores with scale_log2 = scale * log2(e); O = acc / l once at the end.
    Returns out [b, sq, h, d], LSE [b, h, sq]."""
    q, k, v, scale, _ = _prep(q, k, v, softmax_scale)
    b, h, sq, d = q.shape
    sk = k.shape[2]
    out, lse = np.zeros((b, h, sq, d)), np.full((b, h, sq), -np.inf)
    for i0, i1 in _blocks(sq, block_m):
        out[:, :, i0:i1], lse[:, :, i0:i1] = _fa2_row_block(
            q[:, :, i0:i1], k, v, scale, i0, sk - sq, causal, 0, _cdiv(sk, block_n), block_n)
    return _bshd(out), lse


def flash_backward(dout, q, k, v, out, lse, softmax_scale=None, causal=False, block_m=64,
                   block_n=64):
    """FlashAttention-2 backward: D = rowsum(dO * O) first, then KV blocks outer, Q blocks inner;
    P = exp(S - LSE) recomputed from LSE [b, h, sq]; dV_j += P^T dO; dP = dO V^T;
    dS = P * (dP - D); dK_j += scale dS^T Q; dQ_i += scale dS K_j (atomicAdd across KV blocks)."""
    q, k, v, scale, hk = _prep(q, k, v, softmax_scale)
    do, o = _bhsd(dout), _bhsd(out)  # [b, h, sq, d]
    lse = np.asarray(lse, dtype=np.float64)
    lse = np.where(lse == -np.inf, np.inf, lse)  # empty rows: exp(S - inf) = 0
    delta = (do * o).sum(axis=-1)  # D [b, h, sq], its own pre-processing kernel
    sq, sk = q.shape[2], k.shape[2]
    off = sk - sq
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for j0, j1 in _blocks(sk, block_n):  # outer: one CTA per KV block, dK_j, dV_j in registers
        kj, vj = k[:, :, j0:j1], v[:, :, j0:j1]  # [b, h, bn, d]
        for i0, i1 in _blocks(sq, block_m):
            if causal and _above_diag(i1, j0, off):
                continue
            qi, doi = q[:, :, i0:i1], do[:, :, i0:i1]
            s = scale * (qi @ kj.swapaxes(-1, -2))  # S [b, h, bm, bn]
            if causal and _crosses_diag(i0, j1, off):
                s = _mask_tile(s, i0, j0, off)
            p = np.exp(s - lse[:, :, i0:i1, None])  # P
            dv[:, :, j0:j1] += p.swapaxes(-1, -2) @ doi
            dp = doi @ vj.swapaxes(-1, -2)  # dP [b, h, bm, bn]
            ds = p * (dp - delta[:, :, i0:i1, None])  # dS
            dk[:, :, j0:j1] += scale * (ds.swapaxes(-1, -2) @ qi)
            dq[:, :, i0:i1] += scale * (ds @ kj)
    return _bshd(dq), _sum_kv_heads(dk, hk), _sum_kv_heads(dv, hk)


# ----------------------------------------------------------------------------- Flash-Decoding

def combine_splits(o_partial, lse_partial):
    """Merge split-KV partials: LSE = log sum_s exp(lse_s), out = sum_s exp(lse_s - LSE) o_s.
    o_partial [s, b, h, sq, d] (each normalised by its own l), lse_partial [s, b, h, sq]
    (-inf for a split that saw no key). Returns out [b, sq, h, d], LSE [b, h, sq]."""
    o_partial = np.asarray(o_partial, dtype=np.float64)
    lse_partial = np.asarray(lse_partial, dtype=np.float64)
    lse_max = lse_partial.max(axis=0)  # [b, h, sq]
    lse = _lse(lse_max, np.exp(lse_partial - _finite(lse_max)).sum(axis=0))
    w = np.exp(lse_partial - np.where(lse == -np.inf, np.inf, lse))  # [s, b, h, sq]; 0 if empty
    return _bshd((w[..., None] * o_partial).sum(axis=0)), lse


def split_kv_forward(q, k, v, softmax_scale=None, causal=False, num_splits=1, block_n=64,
                     cache_seqlens=None):
    """Flash-Decoding: the keys of each batch element are cut into num_splits contiguous runs of
    ceil(ceil(sk_b / block_n) / num_splits) blocks (trailing splits may be empty); each split runs
    the FA2 loop, then combine_splits merges them. cache_seqlens [b] (optional) limits batch b to
    keys [0, sk_b) and aligns its causal mask to sk_b. Returns out [b, sq, h, d], LSE [b, h, sq]."""
    q, k, v, scale, _ = _prep(q, k, v, softmax_scale)
    b, h, sq, d = q.shape
    sk = k.shape[2]
    if cache_seqlens is None:
        seqlens = np.full(b, sk)
    else:
        seqlens = np.asarray(cache_seqlens).astype(np.int64).reshape(-1)
        if seqlens.shape != (b,) or np.any(seqlens < 0) or np.any(seqlens > sk):
            raise ValueError(f"cache_seqlens must be [{b}] ints in [0, {sk}], got {cache_seqlens}")
    o_part = np.zeros((num_splits, b, h, sq, d))
    lse_part = np.full((num_splits, b, h, sq), -np.inf)
    for bi, sk_b in enumerate(int(x) for x in seqlens):
        n_blocks = _cdiv(sk_b, block_n)
        per_split = _cdiv(n_blocks, num_splits)
        kb, vb = k[bi:bi + 1, :, :sk_b], v[bi:bi + 1, :, :sk_b]  # [1, h, sk_b, d]
        for s in range(num_splits):  # one CTA per (split, batch, head)
            lo, hi = s * per_split, min((s + 1) * per_split, n_blocks)
            o_s, lse_s = _fa2_row_block(q[bi:bi + 1], kb, vb, scale, 0, sk_b - sq, causal,
                                        lo, hi, block_n)
            o_part[s, bi], lse_part[s, bi] = o_s[0], lse_s[0]
    return combine_splits(o_part, lse_part)


def decode_warp_tiles(kv_len, num_splits, split, nwarps, block_n):
    """The keys of one block of the decode kernel (cuda_src/flash_decode.cu), as it computes them: the
    ceil(kv_len / block_n) warp tiles are cut into num_splits ranges of whole rounds of nwarps tiles
    (nwarps * ceil(tiles / (num_splits * nwarps))), and warp w of split s takes tiles
    begin + w, begin + w + nwarps, ... of its range. Returns [tiles of warp w for w in range(nwarps)]."""
    n_tiles = _cdiv(kv_len, block_n)
    rounds = _cdiv(n_tiles, num_splits * nwarps)
    begin = split * rounds * nwarps
    end = min(n_tiles, begin + rounds * nwarps)
    return [list(range(begin + w, end, nwarps)) for w in range(nwarps)]


def decode_kernel_forward(q, k, v, softmax_scale=None, causal=False, num_splits=1, block_n=16, nwarps=4, mf=1,
                          cache_seqlens=None):
    """The dedicated decode kernel step by step (cuda_src/flash_decode.cu), float64.

    seqlen_q == 1 with GQA folds the G query heads of a KV head into G rows. One block per (m-block of
    16 * mf rows, head, batch, split); its keys are [0, kv_len) (causal: up to the last valid row's
    diagonal), split by `decode_warp_tiles`; every warp runs the base-2 online softmax over its own warp
    tiles for all rows of the block (keys past the valid length read as zeros and are masked), then the
    warps' (m, l, O) are merged: M = max m_w, c_w = exp2((m_w - M) scale_log2), L = sum c_w l_w,
    O = sum c_w O_w / L, LSE = (M scale_log2 + log2 L) ln 2. One split is the output; more are merged by
    combine_splits (flash_combine_kernel). Returns out [b, sq, h, d], LSE [b, h, sq]."""
    qf, kf, vf = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    b, sq, h, d = qf.shape
    sk, hk = kf.shape[1], kf.shape[2]
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    sl2 = scale * _LOG2E
    seqlens = np.full(b, sk) if cache_seqlens is None else np.minimum(np.asarray(cache_seqlens).reshape(-1), sk)
    fold = sq == 1 and h > hk
    causal = bool(causal) and sq > 1
    if fold:  # view [b, hk, G, d]: row i of KV head j is query head j * G + i
        rows, kheads = h // hk, hk
        qv = qf[:, 0].reshape(b, hk, rows, d)
        kv_of = lambda hd: hd  # noqa: E731
    else:
        rows, kheads = sq, h
        qv = qf.transpose(0, 2, 1, 3)
        kv_of = lambda hd: hd // (h // hk)  # noqa: E731
    bm = 16 * mf
    o_part = np.zeros((num_splits, b, kheads, rows, d))
    lse_part = np.full((num_splits, b, kheads, rows), -np.inf)
    for bi in range(b):
        seqlen_k = max(0, int(seqlens[bi]))
        diag = seqlen_k - rows
        for hd in range(kheads):
            kmat, vmat = kf[bi, :, kv_of(hd)], vf[bi, :, kv_of(hd)]  # [sk, d]
            for m0 in range(0, rows, bm):
                valid = min(bm, rows - m0)
                qb = np.zeros((bm, d))
                qb[:valid] = qv[bi, hd, m0:m0 + valid]
                row_idx = m0 + np.arange(bm)
                kv_len = max(0, min(seqlen_k, m0 + valid + diag)) if causal else seqlen_k
                for s in range(num_splits):
                    warps = []
                    for tiles in decode_warp_tiles(kv_len, num_splits, s, nwarps, block_n):
                        m, l, acc = np.full(bm, -np.inf), np.zeros(bm), np.zeros((bm, d))
                        for t in tiles:
                            cols = t * block_n + np.arange(block_n)
                            ok = cols < seqlen_k
                            kt, vt = np.zeros((block_n, d)), np.zeros((block_n, d))  # zero-filled past the end
                            kt[ok], vt[ok] = kmat[cols[ok]], vmat[cols[ok]]
                            sc = qb @ kt.T
                            vis = ok[None, :] & ((cols[None, :] <= row_idx[:, None] + diag) if causal else True)
                            sc = np.where(vis, sc, -np.inf)
                            m_new = np.maximum(m, sc.max(axis=1))
                            m_scaled = np.where(m_new == -np.inf, 0.0, m_new * sl2)
                            alpha = np.exp2(m * sl2 - m_scaled)
                            p = np.exp2(sc * sl2 - m_scaled[:, None])
                            l = alpha * l + p.sum(axis=1)
                            acc = alpha[:, None] * acc + p @ vt
                            m = m_new
                        warps.append((np.where(m == -np.inf, -np.inf, m * sl2), l, acc))
                    red_m = np.stack([w[0] for w in warps])  # [nwarps, bm]
                    mx = red_m.max(axis=0)
                    base = np.where(mx == -np.inf, 0.0, mx)
                    c = np.exp2(red_m - base)
                    l_tot = (c * np.stack([w[1] for w in warps])).sum(axis=0)
                    inv = _safe_inv(l_tot)
                    o = ((c * inv)[..., None] * np.stack([w[2] for w in warps])).sum(axis=0)
                    lse = np.where(l_tot > 0, (base + np.log2(np.where(l_tot > 0, l_tot, 1.0))) * _LN2, -np.inf)
                    o_part[s, bi, hd, m0:m0 + valid] = o[:valid]
                    lse_part[s, bi, hd, m0:m0 + valid] = lse[:valid]
    if fold:  # back to [s, b, h, 1, ...]: head = kv head * G + row
        o_part = o_part.reshape(num_splits, b, h, 1, d)
        lse_part = lse_part.reshape(num_splits, b, h, 1)
    if num_splits == 1:  # the kernel writes the output directly
        return _bshd(o_part[0]), lse_part[0]
    return combine_splits(o_part, lse_part)


# ---------------------------------------------------------------------------------------- FLOPs

def attention_flops(batch, nheads, seqlen_q, seqlen_k, headdim, causal=False, mode="fwd"):
    """FlashAttention-2's count: 4 * B * H * Sq * Sk * D (QK^T and PV, 2 FLOPs per MAC),
    halved for causal; x2.5 for mode "bwd", x3.5 for "fwd_bwd"."""
    mult = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}
    if mode not in mult:
        raise ValueError(f"mode must be one of {sorted(mult)}, got {mode!r}")
    flops = 4.0 * batch * nheads * seqlen_q * seqlen_k * headdim * mult[mode]
    return flops / 2 if causal else flops
