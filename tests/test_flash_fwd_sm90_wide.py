"""GPU: the Hopper forward's wider K / V stages (cuflash._configs.SM90_FWD_WIDE_VARIANTS: 176 keys at head dim 128,
configured without a causal mask above 2048 keys), through an explicit tile with the 16-byte and the TMA-store
epilogue, and through the configuration (flash_attn_func and the packed entry with more than 2048 keys), against the
float64 reference: ragged tails that are no multiple of 176, seqlen_q != seqlen_k, causal (rows that see no key when
seqlen_q > seqlen_k), GQA, a head dim below the kernel's, packed sequences. Outputs poisoned (NaN) before each launch.
Skipped off compute capability 9.0."""
from dataclasses import replace

import pytest

import cuflash
from cuflash import _configs, _fwd_sm90
from conftest import torch_inputs
from test_flash_fwd_sm90 import _check, _hopper  # noqa: F401 (_hopper: the autouse sm90 skip)
from test_flash_fwd_sm90_minb import _run, check_packed, packed_case

pytestmark = pytest.mark.gpu

VARIANTS = [(d, n) for d in sorted(_configs.SM90_FWD_WIDE_VARIANTS) for n in _configs.SM90_FWD_WIDE_VARIANTS[d]]


def _tile(d, name, o_tma):
    return replace(_configs.SM90_FWD_TILES[d], **_configs.SM90_FWD_WIDE_VARIANTS[d][name], o_tma=o_tma)


@pytest.mark.parametrize("d,name", VARIANTS)
@pytest.mark.parametrize("o_tma", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
def test_against_reference(d, name, o_tma, dtype, causal):
    q, k, v = torch_inputs((2, 777, 4, d), (2, 901, 2, d), dtype)  # ragged tails, sq != sk, GQA
    _check(_run(q, k, v, causal, _tile(d, name, o_tma)), q, k, v, causal)


@pytest.mark.parametrize("d,name", VARIANTS)
@pytest.mark.parametrize("sq,sk", [(64, 176), (65, 353), (1000, 129), (2048, 2049)])
def test_row_counts(d, name, sq, sk):
    """Keys ending at, just past and far from a 176-key stage; sq > sk causal: rows that see no key."""
    q, k, v = torch_inputs((3, sq, 2, d), (3, sk, 2, d), "bfloat16")
    for causal in (False, True):
        _check(_run(q, k, v, causal, _tile(d, name, True)), q, k, v, causal)


@pytest.mark.parametrize("d,name", VARIANTS)
def test_head_dim_below_the_kernels(d, name):
    q, k, v = torch_inputs((2, 333, 4, d - 24), (2, 444, 2, d - 24), "float16")  # 24 padding columns
    for causal in (False, True):
        _check(_run(q, k, v, causal, _tile(d, name, True)), q, k, v, causal)


@pytest.mark.parametrize("d,name", VARIANTS)
@pytest.mark.parametrize("causal", [False, True])
def test_packed_sequences(d, name, causal):
    q, k, v, packed = packed_case(d)
    check_packed(_run(q, k, v, causal, _tile(d, name, True), packed=packed), q, k, v, causal)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_configured_above_2048_keys(dtype):
    """The configuration takes the 176-key stages at head dim 128 without a causal mask past 2048 keys: the default
    call runs that kernel (its plan names it) and matches the reference; packed sequences with a longest element of
    more than 2048 keys too."""
    import numpy as np
    import torch

    from cuflash import _fwd
    from cuflash._launch import get_launcher

    assert _configs.sm90_fwd_tile(128, False, 2049).block_n == 176
    q, k, v = torch_inputs((1, 300, 4, 128), (1, 2500, 2, 128), dtype)
    _fwd._PLANS.clear()
    out = cuflash.flash_attn_func(q, k, v)
    plans = [p for p in _fwd._PLANS.values() if isinstance(p, _fwd_sm90.Sm90Plan)]
    want = get_launcher(_configs.sm90_fwd_spec(dtype, 128, False, _configs.sm90_fwd_tile(128, False, 2500)), 0).ptr
    assert any(launch[0] == want for p in plans for launch in p.launches)
    _check(out, q, k, v, False)
    lens = [2500, 7, 1000]
    qp, kp, vp = (torch.randn(sum(lens), 4 if i == 0 else 2, 128, device="cuda").to(getattr(torch, dtype))
                  for i in range(3))
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device="cuda")
    o = cuflash.flash_attn_varlen_func(qp, kp, vp, cu, cu, max(lens), max(lens))
    for a, n in zip(cu.tolist(), lens):
        _check(o[a:a + n][None], qp[a:a + n][None], kp[a:a + n][None], vp[a:a + n][None], False)
