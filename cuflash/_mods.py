"""Score modifiers on the host: flash-attn's window_size, softcap and alibi_slopes -> what the kernels take.

Every kernel configuration with a mask (the V2 forward, split-KV, decode, backward and the Hopper forward) is
compiled twice: MOD = 0, the plain kernel, and MOD = 1 (MOD_SCORE, cuda_src/attn/mask.cuh), which reads all three
modifiers from its parameter block at run time:

* a band of keys i + off - left <= j <= i + off + right (off = seqlen_k - seqlen_q; flash-attn's window_size).
  Causal is right = 0. A band that is exactly causal (no left edge, right edge 0) and has no other modifier runs
  the causal kernels instead; an unbounded side becomes a bound no key reaches (left = seqlen_k, right =
  seqlen_q), so the kernel always sees two ints.
* the soft-cap: scores softcap * tanh(softmax_scale * s / softcap). The kernel multiplies by softcap_pre =
  softmax_scale / softcap before tanh, and the softmax's scale_log2 becomes softcap * log2(e).
* ALiBi: -slope |i + off - j| added to the scaled scores. The kernel reads the fp32 slope of its (batch, head)
  and converts it to its score units with alibi_mul (1 / softmax_scale, or 1 / softcap).

`resolve` turns the options into (causal flag of the kernel, MOD, parameter-block fields); `check_alibi` validates
the slopes before anything is launched.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

from ._configs import MOD_DROPOUT, MOD_NONE, MOD_SCORE, MOD_SCORE_DROPOUT  # noqa: F401 (the kernels' MOD values)
from ._interop import KIND_NAME, Arr, wrap

NO_WINDOW = (-1, -1)
LOG2E = math.log2(math.e)


class Mods(NamedTuple):
    """What the kernels take for one call: the causal template flag, the MOD bits and the FwdParams / BwdParams
    fields of the modifiers (with scale_log2)."""

    causal: bool
    mod: int
    fields: dict


def window_of(causal: bool, window_size) -> tuple:
    """(left, right) with causal folded in (right = 0), -1 for an unbounded side."""
    left, right = (int(w) for w in window_size)
    return (left, 0) if causal else (left, right)


def resolve(causal: bool, window_size, softcap: float, alibi: Arr | None, seqlen_q: int, seqlen_k: int,
            softmax_scale: float, dropout: dict | None = None, force: bool = False) -> Mods:
    """The kernels' view of validated options (module docstring). seqlen_k: the keys (a KV cache's capacity).
    dropout: the dropout fields of the call (cuflash._dropout.fields), or None: with them the kernels are the
    MOD_SCORE_DROPOUT ones, whatever the other options. force: the MOD_SCORE kernels even without a modifier (a
    causal call as the band with right = 0)."""
    left, right = window_of(causal, window_size)
    if not force and softcap <= 0 and alibi is None and (left < 0 and right in (-1, 0)) and dropout is None:
        return Mods(right == 0, MOD_NONE, plain_fields(softmax_scale))
    wl = min(left, seqlen_k) if left >= 0 else seqlen_k
    wr = min(right, seqlen_q) if right >= 0 else seqlen_q
    if softcap > 0:
        scale_log2, pre, unit = softcap * LOG2E, softmax_scale / softcap, softcap
    else:
        scale_log2, pre, unit = softmax_scale * LOG2E, 0.0, softmax_scale
    slopes = alibi.ptr if alibi is not None else 0
    bstride = alibi.strides[0] if alibi is not None and len(alibi.shape) == 2 and alibi.shape[0] > 1 else 0
    fields = dict(alibi_slopes=slopes, alibi_batch_stride=bstride, window_left=wl, window_right=wr, softcap_pre=pre,
                  alibi_mul=1.0 / unit if slopes else 0.0, scale_log2=scale_log2)
    if dropout is not None:
        return Mods(False, MOD_SCORE_DROPOUT, dict(fields, **dropout))
    return Mods(False, MOD_SCORE, fields)


def has_right_edge(mods: Mods, seqlen_q: int) -> bool:
    """Whether the band of a MOD_SCORE call hides keys right of some row's diagonal (causal, or a window's right side
    below seqlen_q): resolve encodes an unbounded right side as seqlen_q, a bound no row reaches."""
    return mods.fields["window_right"] < seqlen_q


def score_mods(mods: Mods | None, causal: bool, softmax_scale: float, seqlen_q: int, seqlen_k: int) -> Mods:
    """A call's Mods on the MOD_SCORE kernels: those of a call with modifiers or dropout as they are; a plain or
    causal call (mods None or MOD_NONE) as the band without edges or with right = 0 (the UA kernels, compiled with
    the score-modifier masks only: cuflash._configs.UA_MODS). seqlen_q, seqlen_k: bounds no row or key reaches."""
    if mods is not None and mods.mod:
        return mods
    return resolve(causal if mods is None else mods.causal, NO_WINDOW, 0.0, None, seqlen_q, seqlen_k,
                   float(softmax_scale), force=True)


def kernel_mode(mods: Mods | None, causal: bool) -> tuple:
    """(causal flag, MOD) of the kernels a call launches: its own causal and MOD_NONE without modifiers."""
    return (causal, MOD_NONE) if mods is None else (mods.causal, mods.mod)


def mod_fields(mods: Mods | None, softmax_scale: float, head_dim: int) -> dict:
    """The fields of a call's parameter block that follow from its options: the modifiers (with scale_log2), the
    dropout fields (cuflash._dropout.fields; zeros without dropout) and the inputs' head dim (the kernel's D may be
    larger: cuflash._configs.kernel_headdim)."""
    return {**NO_DROPOUT, **(plain_fields(softmax_scale) if mods is None else mods.fields), "head_dim": head_dim}


def has_dropout(mods: Mods | None) -> bool:
    return mods is not None and bool(mods.mod & MOD_DROPOUT)


def has_softcap(mods: Mods | None) -> bool:
    """Whether a call's soft-cap is on (resolve sets softcap_pre only then)."""
    return mods is not None and bool(mods.fields["softcap_pre"])


NO_DROPOUT = dict(rng_seed=0, rng_offset=0, dropout_keep=0, dropout_scale=0.0)


def plain_fields(softmax_scale: float) -> dict:
    """The modifier fields of a call without modifiers (MOD_NONE), with scale_log2."""
    return dict(alibi_slopes=0, alibi_batch_stride=0, window_left=0, window_right=0, softcap_pre=0.0, alibi_mul=0.0,
                scale_log2=softmax_scale * LOG2E)


def check_alibi(alibi_slopes: Any, qa: Arr, batch: int, nheads: int, name: str = "alibi_slopes") -> Arr | None:
    """The slopes as a view: float32 of shape (nheads,) or (batch, nheads), contiguous along the heads, on q's
    device and of q's kind. TypeError / ValueError naming the argument."""
    if alibi_slopes is None:
        return None
    a = wrap(alibi_slopes, name)
    if a.kind != qa.kind:
        raise TypeError(f"{name} is a {KIND_NAME[a.kind]} array but q is a {KIND_NAME[qa.kind]} array; pass all "
                        "inputs of one kind")
    if a.device != qa.device:
        raise ValueError(f"{name} is on cuda:{a.device} but q is on cuda:{qa.device}")
    if a.dtype != "float32":
        raise TypeError(f"{name} must be float32; got {a.dtype}")
    if tuple(a.shape) not in ((nheads,), (batch, nheads)):
        raise ValueError(f"{name} must have shape (nheads,) = ({nheads},) or (batch, nheads) = ({batch}, {nheads}); "
                         f"got {tuple(a.shape)}")
    if nheads > 1 and a.strides[-1] != 1:
        raise ValueError(f"{name} must be contiguous along the heads (stride 1); got strides {a.strides}")
    if len(a.shape) == 2 and batch > 1 and a.strides[0] < 0:
        raise ValueError(f"{name} has a negative stride {a.strides}; pass a copy")
    if a.ptr % 4:
        raise ValueError(f"{name} must be 4-byte aligned; got address {a.ptr:#x}")
    return a


def is_plain(window_size, softcap, alibi_slopes) -> bool:
    """No modifier asked for (flash-attn's defaults)."""
    return alibi_slopes is None and not softcap and tuple(window_size) == NO_WINDOW


def mods_for(qa: Arr, ka: Arr, causal: bool, window_size, softcap: float, alibi_slopes: Any,
             softmax_scale: float | None, seqlen_k: int | None = None, dropout_p: float = 0.0,
             rng_state=None, batch: int | None = None) -> Mods | None:
    """Mods of validated views (None without modifiers or dropout); validates alibi_slopes. seqlen_k: the key
    count the kernels bound the band with (default: k's; a KV cache passes its capacity). dropout_p > 0: dropout
    with rng_state = (seed, offset), or a new state of the inputs' generator when None (cuflash._dropout). batch:
    the sequences of a packed call (qa its [1, total, h, d] view; alibi_slopes may be (batch, nheads))."""
    if is_plain(window_size, softcap, alibi_slopes) and not dropout_p:
        return None
    b, sq, h, d = qa.shape
    alibi = check_alibi(alibi_slopes, qa, b if batch is None else batch, h)
    scale = d ** -0.5 if softmax_scale is None else float(softmax_scale)
    drop = None
    if dropout_p:
        from . import _dropout

        seed, offset = (_dropout.next_state(qa.kind, qa.device) if rng_state is None
                        else _dropout.check_rng_state(rng_state))
        drop = _dropout.fields(float(dropout_p), seed, offset)
    return resolve(causal, window_size, float(softcap), alibi, sq, ka.shape[1] if seqlen_k is None else seqlen_k,
                   scale, drop)


def rng_state_of(mods: Mods | None) -> tuple | None:
    """The (seed, offset) a dropout call's kernels use (None without dropout)."""
    if not has_dropout(mods):
        return None
    f = mods.fields
    return f["rng_seed"] & ((1 << 64) - 1), f["rng_offset"] & ((1 << 64) - 1)


def memo_key(causal: bool, window_size, softcap, alibi_slopes):
    """The memo-key part of the options: () without modifiers, None where no key can be formed (the call then
    validates every time); the slopes enter by pointer and descriptor (a plan binds their address)."""
    if is_plain(window_size, softcap, alibi_slopes):
        return ()
    ak = None
    if alibi_slopes is not None:
        from ._interop import desc

        ptr, d = desc(alibi_slopes)
        if d is None:
            return None
        ak = (ptr, d)
    return window_of(causal, window_size), float(softcap), ak
