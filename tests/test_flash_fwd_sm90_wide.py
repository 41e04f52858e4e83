"""GPU: the Hopper forward's wider K / V stages (cuflash._configs.SM90_FWD_WIDE_VARIANTS: 176 keys at head dim 128, a
variant reached through an explicit tile), with the 16-byte and the TMA-store epilogue, against the float64 reference:
ragged tails that are no multiple of 176, seqlen_q != seqlen_k, causal (rows that see no key when seqlen_q >
seqlen_k), GQA, a head dim below the kernel's, packed sequences. Outputs poisoned (NaN) before each launch.
Skipped off compute capability 9.0."""
from dataclasses import replace

import pytest

from cuflash import _configs
from conftest import torch_inputs
from test_flash_fwd_sm90 import _check, _hopper  # noqa: F401 (_hopper: the autouse sm90 skip)
from test_flash_fwd_sm90_minb import _run, check_packed, check_ragged, check_row_counts, packed_case

pytestmark = pytest.mark.gpu

VARIANTS = [(d, n) for d in sorted(_configs.SM90_FWD_WIDE_VARIANTS) for n in _configs.SM90_FWD_WIDE_VARIANTS[d]]


def _tile(d, name, o_tma):
    return replace(_configs.SM90_FWD_TILES[d], **_configs.SM90_FWD_WIDE_VARIANTS[d][name], o_tma=o_tma)


@pytest.mark.parametrize("d,name", VARIANTS)
@pytest.mark.parametrize("o_tma", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
def test_against_reference(d, name, o_tma, dtype, causal):
    check_ragged(d, dtype, causal, _tile(d, name, o_tma))


@pytest.mark.parametrize("d,name", VARIANTS)
@pytest.mark.parametrize("sq,sk", [(64, 176), (65, 353), (1000, 129), (2048, 2049)])
def test_row_counts(d, name, sq, sk):
    """Keys ending at, just past and far from a 176-key stage; sq > sk causal: rows that see no key."""
    check_row_counts(d, sq, sk, _tile(d, name, True))


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
