"""Attention dropout on the host: the Philox state of a call, the kernels' fields, the keep mask, and a NumPy
reference of the random numbers.

The kernels drop element (bh, i, j) -- batch * nheads + head, query row i, key j -- iff its 16-bit Philox number
is at or above `keep` = round(65536 (1 - p)) (cuda_src/attn/dropout.cuh gives the counter layout). A call's
(seed, offset):

* torch tensors: taken from torch's CUDA generator of the inputs' device -- its seed and its Philox offset, which
  is then advanced, as torch's own random ops do -- so `torch.manual_seed` makes dropout reproducible and
  `torch.cuda.get_rng_state` / `set_rng_state` replay it. Autograd keeps the forward's pair for the backward.
* CuPy arrays: from cuflash's own counter (`manual_seed` sets its seed; every dropout call takes the next offset).
  `get_rng_state()` returns the pair the next call will take, for `flash_attn_backward(..., rng_state=)`.

`keep_mask` launches dropout_mask_kernel: the same numbers, written out as a uint8 mask (tests, and the
probabilities flash_attn_func returns with return_attn_probs=True).
"""
from __future__ import annotations

import sys
import threading
from contextlib import contextmanager

import numpy as np

from ._interop import TORCH

KEEP_ONE = 1 << 16  # the 16-bit numbers are compared with keep: 65536 keeps everything
OFFSET_STEP = 4  # a call's advance of torch's Philox offset (torch keeps offsets in multiples of 4)
DEFAULT_SEED = 67280421310721  # torch's default seed, for the CuPy counter until manual_seed
_lock = threading.Lock()
_state = {"seed": DEFAULT_SEED, "offset": 0}


def keep_threshold(p: float) -> int:
    """The kernels' dropout_keep: an element is kept iff its 16-bit number is below it."""
    return min(KEEP_ONE, max(0, round((1.0 - p) * KEEP_ONE)))


def _int64(x: int) -> int:
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >> 63 else x


def fields(p: float, seed: int, offset: int) -> dict:
    """The dropout fields of FwdParams / BwdParams (cuda_src/attn/params.cuh) for dropout_p = p."""
    return dict(rng_seed=_int64(seed), rng_offset=_int64(offset), dropout_keep=keep_threshold(p),
                dropout_scale=1.0 / (1.0 - p))


# ------------------------------------------------------------------------------------------- state
def manual_seed(seed: int) -> None:
    """Seed cuflash's dropout counter (the state CuPy inputs draw from; torch inputs use torch's generator)."""
    with _lock:
        _state["seed"], _state["offset"] = int(seed) & ((1 << 64) - 1), 0


def get_rng_state() -> tuple:
    """(seed, offset) the next dropout call on CuPy inputs will take."""
    with _lock:
        return _state["seed"], _state["offset"]


def _torch_state(device: int) -> tuple:
    torch = sys.modules["torch"]
    gen = torch.cuda.default_generators[device]
    state = gen.get_state()
    words = state.view(torch.int64)
    if words.numel() == 2:  # (seed, Philox offset): advance the offset as torch's random ops do
        seed, offset = int(words[0]), int(words[1])
        words[1] += OFFSET_STEP
        gen.set_state(state)
        return seed & ((1 << 64) - 1), offset
    with _lock:  # another state layout: torch's seed and cuflash's own offsets
        offset = _state["offset"]
        _state["offset"] += OFFSET_STEP
    return gen.initial_seed(), offset


def next_state(kind: int, device: int) -> tuple:
    """(seed, offset) of a new dropout call on inputs of this kind and device (module docstring)."""
    if kind == TORCH:
        return _torch_state(device)
    with _lock:
        seed, offset = _state["seed"], _state["offset"]
        _state["offset"] += OFFSET_STEP
    return seed, offset


def check_rng_state(rng_state, name: str = "rng_state") -> tuple:
    """A (seed, offset) pair of ints; TypeError naming the argument otherwise."""
    import numbers

    try:
        seed, offset = rng_state
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a (seed, offset) pair of ints; got {rng_state!r}") from None
    for what, x in (("seed", seed), ("offset", offset)):
        if not isinstance(x, numbers.Integral) or isinstance(x, bool):
            raise TypeError(f"{name} {what} must be an int; got {type(x).__name__}")
    return int(seed), int(offset)


# ------------------------------------------------------------------------------------ reference
PHILOX_M = (0xD2511F53, 0xCD9E8D57)
PHILOX_W = (0x9E3779B9, 0xBB67AE85)
_U32 = np.uint64(0xFFFFFFFF)


def philox4x32_10(counter, key) -> tuple:
    """Philox4x32-10 of uint32 arrays (NumPy broadcasting): counter (c0, c1, c2, c3), key (k0, k1) -> 4 words."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) & _U32 for c in counter)
    k0, k1 = (np.asarray(k, dtype=np.uint64) & _U32 for k in key)
    m0, m1 = np.uint64(PHILOX_M[0]), np.uint64(PHILOX_M[1])
    for _ in range(10):
        p0, p1 = c0 * m0, c2 * m1
        c0, c1, c2, c3 = (p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & _U32, (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & _U32
        k0, k1 = (k0 + np.uint64(PHILOX_W[0])) & _U32, (k1 + np.uint64(PHILOX_W[1])) & _U32
    return tuple(w.astype(np.uint32) for w in (c0, c1, c2, c3))


def random16_reference(bh: int, seqlen_q: int, seqlen_k: int, seed: int, offset: int) -> np.ndarray:
    """The 16-bit numbers of (bh, i, j) for all i < seqlen_q, j < seqlen_k: uint16 [seqlen_q, seqlen_k]
    (cuda_src/attn/dropout.cuh's layout)."""
    seed &= (1 << 64) - 1
    offset &= (1 << 64) - 1
    i = np.arange(seqlen_q)[:, None]
    j = np.arange(seqlen_k)[None, :]
    rg = (i // 16) * 8 + i % 8
    cg = (j // 16) * 4 + (j % 8) // 2
    key = (seed & 0xFFFFFFFF, (seed >> 32) ^ (offset >> 32))
    words = philox4x32_10((rg, cg, np.full_like(rg, bh), np.full_like(rg, offset & 0xFFFFFFFF)), key)
    w = ((i // 8) % 2) * 2 + (j // 8) % 2
    word = np.choose(w, words)
    return ((word >> (16 * (j % 2)).astype(np.uint32)) & 0xFFFF).astype(np.uint16)


def keep_mask_reference(batch: int, nheads: int, seqlen_q: int, seqlen_k: int, p: float, seed: int,
                        offset: int) -> np.ndarray:
    """bool [batch, nheads, seqlen_q, seqlen_k]: True where the kernels keep the probability."""
    keep = keep_threshold(p)
    out = np.empty((batch * nheads, seqlen_q, seqlen_k), dtype=bool)
    for bh in range(batch * nheads):
        out[bh] = random16_reference(bh, seqlen_q, seqlen_k, seed, offset) < keep
    return out.reshape(batch, nheads, seqlen_q, seqlen_k)


# ------------------------------------------------------------------------------------------ device
def keep_mask(like, batch: int, nheads: int, seqlen_q: int, seqlen_k: int, p: float, rng_state) -> object:
    """uint8 [batch, nheads, seqlen_q, seqlen_k] on the device of `like` (a validated view), of its kind: 1 where
    the kernels keep the probability of a dropout call with this rng_state."""
    from . import _interop
    from ._configs import dropout_mask_spec
    from ._launch import get_launcher
    from ._params import FWD_PARAMS

    seed, offset = check_rng_state(rng_state)
    mask = _interop.empty(like, (batch, nheads, seqlen_q, seqlen_k), "uint8")
    groups = batch * nheads * (-(-seqlen_q // 16) * 8) * (-(-seqlen_k // 16) * 4)
    if groups == 0:
        return mask
    lau = get_launcher(dropout_mask_spec(), like.device)
    with _interop.device_guard(like.device):
        lau.launch_block((-(-groups // lau.threads), 1, 1), _interop.current_stream(like), FWD_PARAMS,
                         FWD_PARAMS.values(0, o=_interop.data_ptr(mask), batch=batch, nheads=nheads,
                                           seqlen_q=seqlen_q, seqlen_k=seqlen_k, **fields(p, seed, offset)))
    return mask


@contextmanager
def _in_caller_order(a):
    """CuPy work on a's device in the caller's current stream (after what the caller queued before)."""
    import cupy

    from . import _interop

    with _interop.device_guard(a.device), cupy.cuda.ExternalStream(_interop.current_stream(a)):
        yield


def _signed_probs(xp, q, k, lse, keep, scale, causal, window_size, softcap, slopes):
    """float32 [n, h, sq, sk] of the array module xp (CuPy; NumPy in the CPU tests): exp(scores - lse) of q [n, h,
    sq, d], k [n, h, sk, d] (float32, K/V heads repeated), lse [n, h, sq, 1] (-inf: a row that sees no key, all 0),
    negated where keep [n, h, sq, sk] is 0; slopes float32 (1 or n, h) or None; the mask bottom-right aligned
    (offset sk - sq)."""
    sq, sk = q.shape[2], k.shape[2]
    s = xp.matmul(q, k.transpose(0, 1, 3, 2)) * scale
    if softcap:
        s = softcap * xp.tanh(s / softcap)
    dist = xp.arange(sq)[:, None] + (sk - sq) - xp.arange(sk)[None, :]  # >= 0 left of the diagonal
    if slopes is not None:
        s = s - slopes[:, :, None, None] * xp.abs(dist).astype(xp.float32)
    left, right = window_size
    if causal:
        right = 0
    hidden = xp.zeros((sq, sk), dtype=bool)
    if right >= 0:
        hidden |= dist < -right
    if left >= 0:
        hidden |= dist > left
    s = xp.where(hidden, -xp.inf, s)
    dead = xp.isinf(lse)
    probs = xp.where(dead, 0.0, xp.exp(s - xp.where(dead, 0.0, lse)))
    return xp.where(keep.astype(bool), probs, -probs).astype(xp.float32)


def _float32_cupy(a):
    """A validated view's array as float32 CuPy (torch converts first: CuPy has no bfloat16)."""
    import cupy

    if a.kind == TORCH:
        return cupy.from_dlpack(a.obj.detach().float())
    return a.obj.astype("float32")


def _lse_cupy(lse, kind):
    import cupy

    return cupy.from_dlpack(lse.detach() if kind == TORCH else lse)


def _slopes_cupy(alibi_slopes, h):
    import cupy

    if alibi_slopes is None:
        return None
    return cupy.from_dlpack(alibi_slopes).astype(cupy.float32).reshape(-1, h)  # (1 or batch, h)


def _as_kind(probs, kind):
    return sys.modules["torch"].from_dlpack(probs) if kind == TORCH else probs


def attention_probs(qa, ka, lse, softmax_scale, causal, window_size, softcap, alibi_slopes, p, rng_state):
    """flash-attn's S_dmask of a dropout call (return_attn_probs=True): the softmax probabilities P = exp(scores -
    LSE) of every (batch, head, query, key), float32 [batch, nheads, seqlen_q, seqlen_k] of q's kind, negated where
    dropout dropped them (the keep mask of the kernels' numbers, keep_mask). Recomputed from q, k and the
    forward's LSE with the array library in float32 -- for tests and inspection: it materialises seqlen_q x
    seqlen_k per head."""
    import cupy

    b, sq, h, d = qa.shape
    sk, hk = ka.shape[1], ka.shape[2]
    scale = d ** -0.5 if softmax_scale is None else float(softmax_scale)
    keep = keep_mask(qa, b, h, sq, sk, p, rng_state)
    with _in_caller_order(qa):
        q = _float32_cupy(qa).transpose(0, 2, 1, 3)
        k = cupy.repeat(_float32_cupy(ka).transpose(0, 2, 1, 3), h // hk, axis=1)
        probs = _signed_probs(cupy, q, k, _lse_cupy(lse, qa.kind)[:, :, :, None], cupy.from_dlpack(keep), scale,
                              causal, window_size, softcap, _slopes_cupy(alibi_slopes, h))
    return _as_kind(probs, qa.kind)


def varlen_probs_layout(packed, max_seqlen_q, max_seqlen_k):
    """(cu_seqlens_q, cu_seqlens_k as int64 NumPy arrays, max_seqlen_q, max_seqlen_k as ints) of a packed call that
    returns S_dmask, read on the host (a synchronisation; 0-dim max_seqlen arrays too) before anything is launched;
    a max_seqlen shorter than a sequence is a ValueError (S_dmask is laid out by it)."""
    import cupy

    a = packed.cu_q
    with _in_caller_order(a):
        cq = cupy.asnumpy(cupy.from_dlpack(a.obj)).astype(np.int64)
        ck = cupy.asnumpy(cupy.from_dlpack(packed.cu_k.obj)).astype(np.int64)
    mq = int(max_seqlen_q) if packed.max_q is None else packed.max_q
    mk = int(max_seqlen_k) if packed.max_k is None else packed.max_k
    for name, m, lens in (("max_seqlen_q", mq, np.diff(cq)), ("max_seqlen_k", mk, np.diff(ck))):
        if lens.size and int(lens.max()) > m:
            raise ValueError(f"{name} ({m}) is shorter than the longest sequence ({int(lens.max())}); the "
                             "probabilities of return_attn_probs are laid out by it")
    return cq, ck, mq, mk


def _varlen_probs(xp, q, k, lse, keep, layout, scale, causal, window_size, softcap, slopes):
    """attention_probs_varlen's array (module xp: CuPy; NumPy in the CPU tests): q [h, total_q, d], k [h, total_k,
    d] float32 (K/V heads repeated), lse [h, total_q], keep [batch, h, max_seqlen_q, max_seqlen_k], layout:
    varlen_probs_layout's; slopes float32 (1 or batch, h) or None."""
    cq, ck, mq, mk = layout
    batch, h = len(cq) - 1, q.shape[0]
    out = xp.zeros((batch, h, mq, mk), dtype=xp.float32)
    for b in range(batch):
        sq, sk = int(cq[b + 1] - cq[b]), int(ck[b + 1] - ck[b])
        if sq == 0 or sk == 0:
            continue
        sl = None if slopes is None else slopes[b if slopes.shape[0] > 1 else 0][None]
        out[b, :, :sq, :sk] = _signed_probs(xp, q[None, :, cq[b]:cq[b + 1]], k[None, :, ck[b]:ck[b + 1]],
                                            lse[None, :, cq[b]:cq[b + 1], None], keep[b:b + 1, :, :sq, :sk], scale,
                                            causal, window_size, softcap, sl)[0]
    return out


def attention_probs_varlen(qa, ka, lse, packed, layout, softmax_scale, causal, window_size, softcap, alibi_slopes, p,
                           rng_state):
    """S_dmask of a packed dropout call (flash_attn_varlen_func with return_attn_probs=True): float32 [batch,
    nheads, max_seqlen_q, max_seqlen_k] of q's kind, sequence b's probabilities in [b, :, :len_q(b), :len_k(b)]
    (attention_probs' rule per sequence: the mask bottom-right aligned to each sequence, dropped ones negated),
    zeros past them. qa [total_q, nheads, headdim], ka [total_k, nheads_k, headdim] views; lse [nheads, total_q];
    packed: the call's cuflash._varlen.Packed; layout: varlen_probs_layout's. The kernels drop element (sequence b,
    head, local row i, local key j) by the counter of (b nheads + head, i, j), so the keep mask of a [batch, nheads,
    max_seqlen_q, max_seqlen_k] call holds every sequence's. Materialises max_seqlen_q x max_seqlen_k per
    (sequence, head): for tests and inspection."""
    import cupy

    _, h, d = qa.shape
    hk = ka.shape[1]
    mq, mk = layout[2:]
    scale = d ** -0.5 if softmax_scale is None else float(softmax_scale)
    with _in_caller_order(qa):
        keep = cupy.from_dlpack(keep_mask(qa, packed.batch, h, mq, mk, p, rng_state))
        q = _float32_cupy(qa).transpose(1, 0, 2)  # [h, total_q, d]
        k = cupy.repeat(_float32_cupy(ka).transpose(1, 0, 2), h // hk, axis=0)
        out = _varlen_probs(cupy, q, k, _lse_cupy(lse, qa.kind), keep, layout, scale, causal, window_size, softcap,
                            _slopes_cupy(alibi_slopes, h))
    return _as_kind(out, qa.kind)


def dropout_mask(q, k, dropout_p: float, rng_state) -> object:
    """The keep mask of a dropout call: uint8 [batch, nheads, seqlen_q, seqlen_k] of q's kind, 1 where
    flash_attn_func(q, k, ..., dropout_p) with this rng_state (seed, offset) keeps the probability. q, k as
    flash_attn_func's."""
    from ._validate import check_rank, check_score_options
    from ._interop import wrap

    check_score_options(dropout_p)
    qa, ka = wrap(q, "q"), wrap(k, "k")
    check_rank(qa, "q", 4, "(batch, seqlen, nheads, headdim)")
    check_rank(ka, "k", 4, "(batch, seqlen, nheads, headdim)")
    b, sq, h, _ = qa.shape
    return keep_mask(qa, b, h, sq, ka.shape[1], float(dropout_p), rng_state)
