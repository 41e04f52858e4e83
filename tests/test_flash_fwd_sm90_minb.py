"""GPU: the Hopper forward's tiles of two and three blocks per SM (cuflash._configs.SM90_FWD_MINB_VARIANTS, launched
through an explicit tile: they are not configured), each with the 16-byte and the TMA-store epilogue, against the
float64 reference: ragged tails, seqlen_q != seqlen_k, causal (rows that see no key when seqlen_q > seqlen_k), GQA,
a head dim below the kernel's (padding columns), and packed sequences whose elements end inside and at the end of a
Q tile. Outputs poisoned (NaN) before each launch. Skipped off compute capability 9.0."""
from dataclasses import replace

import numpy as np
import pytest

from cuflash import _configs, _fwd_sm90, reference
from conftest import assert_close_to_ref, to_np, torch_attention_lowp, torch_inputs
from test_flash_fwd_sm90 import _check, _hopper  # noqa: F401 (_hopper: the autouse sm90 skip)

pytestmark = pytest.mark.gpu

VARIANTS = [(d, n) for d in sorted(_configs.SM90_FWD_MINB_VARIANTS) for n in _configs.SM90_FWD_MINB_VARIANTS[d]]



def _tile(d, name, o_tma):
    return replace(_configs.sm90_fwd_minb_tiles(d)[name], o_tma=o_tma)


def _run(q, k, v, causal, tile, packed=None, grid_order="auto"):
    """The sm90 forward with `tile` (and `grid_order`) into a NaN-filled output."""
    import torch

    from cuflash._validate import check_qkv

    if packed is None:
        qa, ka, va = check_qkv(q, k, v)
        out = torch.full_like(q, float("nan"))
    else:
        qa, ka, va, packed = packed
        out = torch.full((packed.total_q, *q.shape[1:]), float("nan"), device="cuda", dtype=q.dtype)
    o, _ = _fwd_sm90.forward(qa, ka, va, None, causal, grid_order, out=out, tile=tile, packed=packed)
    assert o.data_ptr() == out.data_ptr()
    return out


def check_ragged(d, dtype, causal, tile):
    """`tile` against the reference on ragged tails, sq != sk and GQA (shared by the explicit-tile test files)."""
    q, k, v = torch_inputs((2, 777, 4, d), (2, 901, 2, d), dtype)
    _check(_run(q, k, v, causal, tile), q, k, v, causal)


def check_row_counts(d, sq, sk, tile):
    """`tile` against the reference at sq x sk, causal and not (sq > sk causal: rows that see no key)."""
    q, k, v = torch_inputs((3, sq, 2, d), (3, sk, 2, d), "bfloat16")
    for causal in (False, True):
        _check(_run(q, k, v, causal, tile), q, k, v, causal)


@pytest.mark.parametrize("d,name", VARIANTS)
@pytest.mark.parametrize("o_tma", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
def test_against_reference(d, name, o_tma, dtype, causal):
    check_ragged(d, dtype, causal, _tile(d, name, o_tma))


@pytest.mark.parametrize("d,name", VARIANTS)
@pytest.mark.parametrize("sq,sk", [(64, 64), (65, 300), (1000, 129), (2048, 2048)])
def test_row_counts(d, name, sq, sk):
    """Rows ending at, just past and far from a Q tile; sq > sk causal: rows that see no key."""
    check_row_counts(d, sq, sk, _tile(d, name, True))


@pytest.mark.parametrize("name", list(_configs.SM90_FWD_MINB_VARIANTS[64]))
def test_head_dim_below_the_kernels(name):
    q, k, v = torch_inputs((2, 333, 4, 56), (2, 444, 2, 56), "float16")  # the d64 kernel, 8 padding columns
    tile = _tile(64, name, True)
    for causal in (False, True):
        _check(_run(q, k, v, causal, tile), q, k, v, causal)


PACKED_LENS = ((37, 1, 130, 64, 128, 300, 1000, 63), (53, 1, 130, 200, 128, 77, 1000, 70))  # (q, k) per element


def packed_case(d):
    """Eight packed bf16 sequences of PACKED_LENS (GQA 4 / 2): (q, k, v, their PackedSeqs)."""
    import torch

    from cuflash._varlen import check_varlen

    lens_q, lens_k = PACKED_LENS
    q, k, v = torch_inputs((1, sum(lens_q), 4, d), (1, sum(lens_k), 2, d), "bfloat16")
    q, k, v = q[0], k[0], v[0]
    cq, ck = (torch.tensor(np.concatenate([[0], np.cumsum(x)]), dtype=torch.int32, device="cuda")
              for x in (lens_q, lens_k))
    return q, k, v, check_varlen(q, k, v, cq, ck, max(lens_q), max(lens_k))


def check_packed(out, q, k, v, causal):
    """Each element of a packed_case output against the float64 reference and torch's low-precision error."""
    d = q.shape[-1]
    oq = ok = 0
    for lq, lk in zip(*PACKED_LENS):
        qe, ke, ve = q[oq:oq + lq][None], k[ok:ok + lk][None], v[ok:ok + lk][None]
        ref, _ = reference.attention_forward(to_np(qe), to_np(ke), to_np(ve), None, causal)
        assert_close_to_ref(f"element at {oq}", out[oq:oq + lq][None], torch_attention_lowp(qe, ke, ve, d ** -0.5,
                                                                                            causal), ref)
        oq, ok = oq + lq, ok + lk


@pytest.mark.parametrize("d,name", VARIANTS)
@pytest.mark.parametrize("o_tma", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_packed_sequences(d, name, o_tma, causal):
    q, k, v, packed = packed_case(d)
    check_packed(_run(q, k, v, causal, _tile(d, name, o_tma), packed=packed), q, k, v, causal)
