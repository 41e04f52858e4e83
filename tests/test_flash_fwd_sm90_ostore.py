"""GPU: the Hopper forward's TMA-store epilogue (Sm90FwdTile.o_tma, the configured tiles' epilogue; the fixture
makes sure of it on every head dim's tile, the memoized plans cleared): against the float64 reference with ragged
tails, seqlen_q != seqlen_k, causal, GQA, a head dim below the kernel's (padding columns), packed sequences whose
elements end inside and at the end of a warpgroup's 64 rows, and strided outputs -- and bitwise the output of the
16-byte stores' epilogue (o_tma off: the same products; only the store differs). Skipped off compute capability
9.0."""
from dataclasses import replace

import pytest

import cuflash
from cuflash import _configs, _fwd, _fwd_sm90
from conftest import torch_inputs
from test_flash_fwd_sm90 import _check, _hopper  # noqa: F401 (_hopper: the autouse sm90 skip)
from test_varlen import check as check_varlen, cu_of, packed_inputs

pytestmark = pytest.mark.gpu



@pytest.fixture
def o_tma(monkeypatch):
    """Every sm90 forward tile with o_tma (the plans memoized before are dropped, before and after)."""
    for d, t in list(_configs.SM90_FWD_TILES.items()):
        monkeypatch.setitem(_configs.SM90_FWD_TILES, d, replace(t, o_tma=True))
    _fwd._PLANS.clear()
    _fwd._KV_PLANS.clear()
    yield
    _fwd._PLANS.clear()
    _fwd._KV_PLANS.clear()


def _stores16(fn):
    """fn() with every tile's O written by 16-byte stores (o_tma off)."""
    saved = dict(_configs.SM90_FWD_TILES)
    try:
        for d, t in saved.items():
            _configs.SM90_FWD_TILES[d] = replace(t, o_tma=False)
        _fwd._PLANS.clear()
        _fwd._KV_PLANS.clear()
        return fn()
    finally:
        _configs.SM90_FWD_TILES.update(saved)
        _fwd._PLANS.clear()
        _fwd._KV_PLANS.clear()


def _launched_o_tma():
    return any(isinstance(p, _fwd_sm90.Sm90Plan) and p.o_tma for p in _fwd._PLANS.values())


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [64, 80, 96, 128, 136, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_against_reference_and_bitwise_stores16(o_tma, d, dtype, causal):
    q, k, v = torch_inputs((2, 777, 4, d), (2, 901, 2, d), dtype)  # ragged tails, sq != sk, GQA
    out = cuflash.flash_attn_func(q, k, v, causal=causal, backend="sm90")
    assert _launched_o_tma()
    _check(out, q, k, v, causal)
    ref = _stores16(lambda: cuflash.flash_attn_func(q, k, v, causal=causal, backend="sm90"))
    assert (out == ref).all()


@pytest.mark.parametrize("sq,sk", [(64, 64), (65, 300), (191, 191), (1, 1000), (1000, 129), (4096, 4096)])
def test_row_counts_around_the_warpgroup_boxes(o_tma, sq, sk):
    """Rows ending exactly at, just past and far from a 64-row box; rows that see no key (causal, sq > sk)."""
    q, k, v = torch_inputs((3, sq, 2, 128), (3, sk, 2, 128), "bfloat16")
    for causal in (False, True):
        out = cuflash.flash_attn_func(q, k, v, causal=causal, backend="sm90")
        _check(out, q, k, v, causal)
        assert (out == _stores16(lambda: cuflash.flash_attn_func(q, k, v, causal=causal, backend="sm90"))).all()


def test_window_and_softcap(o_tma):
    q, k, v = torch_inputs((2, 500, 4, 128), (2, 700, 4, 128), "float16")
    kw = dict(window_size=(100, 30), softcap=20.0, backend="sm90")
    out = cuflash.flash_attn_func(q, k, v, **kw)
    assert (out == _stores16(lambda: cuflash.flash_attn_func(q, k, v, **kw))).all()


@pytest.mark.parametrize("lens_q,lens_k", [
    ((37, 0, 1, 130, 64, 5, 200), (53, 17, 1, 130, 0, 200, 77)),
    ((128, 300, 64, 65, 1000, 63), (128, 200, 900, 65, 1000, 70)),
])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_packed_sequences(o_tma, lens_q, lens_k, d, causal):
    """Elements that end inside a warpgroup's 64 rows (those take the 16-byte stores: the rows after belong to the
    next element), that end exactly at one, and whole boxes in the middle of the packed rows."""
    q, k, v = packed_inputs(lens_q, lens_k, 4, 2, d, "bfloat16", requires_grad=False)
    out = check_varlen(q, k, v, lens_q, lens_k, causal=causal, backend="sm90", grads=False)
    cq, ck = cu_of(lens_q), cu_of(lens_k)
    ref = _stores16(lambda: cuflash.flash_attn_varlen_func(q, k, v, cq, ck, max(lens_q), max(lens_k), causal=causal,
                                                         backend="sm90"))
    assert (out == ref).all()


@pytest.mark.parametrize("d", [64, 128])
def test_strided_outputs(o_tma, d):
    """out a view into a wider tensor ([b, s, h, d] of [b, s, h, d + 64] and heads-major [b, h, s, d] transposed):
    O's map carries its strides; nothing outside the view is written."""
    import torch

    from cuflash._validate import check_qkv

    q, k, v = torch_inputs((2, 333, 4, d), (2, 444, 4, d), "float16")
    qa, ka, va = check_qkv(q, k, v)
    wide = torch.full((2, 333, 4, d + 64), float("nan"), device="cuda", dtype=torch.float16)
    heads_major = torch.full((2, 4, 333, d), float("nan"), device="cuda", dtype=torch.float16)
    for causal in (False, True):
        # the tile the call below selects (444 keys: head dim 64's short-keys tile), with the 16-byte stores
        base, _ = _fwd_sm90.forward(qa, ka, va, None, causal,
                                    tile=replace(_configs.sm90_fwd_tile(d, causal, 444), o_tma=False))
        for buf, view in ((wide, wide[..., :d]), (heads_major, heads_major.transpose(1, 2))):
            buf.fill_(float("nan"))
            out, _ = _fwd_sm90.forward(qa, ka, va, None, causal, out=view)
            assert out.data_ptr() == view.data_ptr()
            _check(view, q, k, v, causal)
            assert (view == base).all()
        assert torch.isnan(wide[..., d:]).all()
