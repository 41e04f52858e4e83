"""GPU: the FlashAttention-2 forward against the float64 reference (out and LSE), with the error rule of
conftest.py, on ragged lengths, seqlen_q != seqlen_k both ways, GQA/MQA, every head dim and dtype -- on both
kernel paths: the mma.sync kernels (backend "sm80", any GPU) and the Hopper kernels (backend "sm90", on a
compute capability 9.0 GPU; their head dims)."""
import math

import numpy as np
import pytest

import cuflash
from cuflash import reference
from conftest import assert_close_to_ref, to_np, torch_attention_lowp, torch_inputs
from cuflash._configs import SM90_HEADDIMS

pytestmark = pytest.mark.gpu

LSE_ATOL = 2e-4  # fp32 accumulation + ex2.approx (rel. err 2^-22): LSE is good to ~1e-5 in practice


BACKENDS = ("sm80", "sm90")


def needs_backend(backend, d=None):
    """Skip an sm90 case off compute capability 9.0 (the sm80 cases run on every GPU)."""
    if backend == "sm90":
        from cuflash._fwd_sm90 import device_cc

        if device_cc(0) != 90:
            pytest.skip("backend sm90 needs a compute capability 9.0 GPU")
        assert d is None or d in SM90_HEADDIMS


def backend_params(headdims):
    """(backend, d) pairs: every head dim on sm80, the sm90 kernels' head dims on sm90."""
    return [(be, d) for be in BACKENDS for d in headdims if be == "sm80" or d in SM90_HEADDIMS]


def run_case(b, sq, sk, h, hk, d, dtype, causal, grid_order="qtile", scale=None, tile=None, backend="sm80"):
    import torch

    needs_backend(backend, d)
    q, k, v = torch_inputs((b, sq, h, d), (b, sk, hk, d), dtype)
    softmax_scale = scale if scale is not None else 1 / math.sqrt(d)
    if tile is None:
        out, lse, none = cuflash.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal,
                                                 return_attn_probs=True, grid_order=grid_order, backend=backend)
    else:  # a tile other than the configured one (benchmark sweeps): the internal launch
        from cuflash import flash
        from cuflash._validate import check_qkv

        out, lse = flash.forward(*check_qkv(q, k, v), scale, causal, grid_order=grid_order, tile=tile)
        none = None
    assert none is None and out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (b, h, sq) and lse.dtype == torch.float32
    ref_o, ref_lse = reference.attention_forward(to_np(q), to_np(k), to_np(v), softmax_scale, causal)
    assert_close_to_ref("out", out, torch_attention_lowp(q, k, v, softmax_scale, causal), ref_o)
    got_lse = to_np(lse)
    assert np.array_equal(np.isneginf(got_lse), np.isneginf(ref_lse)), "rows with no key: LSE must be -inf"
    fin = np.isfinite(ref_lse)
    assert np.allclose(got_lse[fin], ref_lse[fin], atol=LSE_ATOL, rtol=0), np.abs(got_lse[fin] - ref_lse[fin]).max()
    return out, lse


SHAPES = [(1, 1), (17, 17), (127, 1000), (1000, 127), (1, 3001), (600, 3001), (3001, 600), (1000, 1000)]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("backend,d", backend_params([32, 64, 96, 128, 256]))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", SHAPES)
def test_forward_matches_reference(dtype, backend, d, causal, sq, sk):
    run_case(1, sq, sk, 2, 2, d, dtype, causal, backend=backend)


def _sweep_tiles():
    from bench.bench_fwd import SWEEP_TILES

    return [(d, t) for d, ts in SWEEP_TILES.items() for t in ts]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d,tile", _sweep_tiles())
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(17, 17), (1000, 127), (600, 3001), (1, 300)])
def test_every_swept_tile_matches_reference(dtype, d, tile, causal, sq, sk):
    """Every tile a sweep may pick."""
    run_case(1, sq, sk, 2, 2, d, dtype, causal, tile=tile)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("h,hk", [(8, 2), (6, 1)])
@pytest.mark.parametrize("sq,sk", [(1, 700), (4, 700), (257, 129)])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_mqa(backend, h, hk, sq, sk, causal):
    if backend == "sm90" and sq == 1:  # single-query GQA: the sm80 kernel's head folding (test_backend_choice)
        pytest.skip("single-query GQA decoding runs on the sm80 kernels")
    run_case(2, sq, sk, h, hk, 128, "float16", causal, backend=backend)
    run_case(2, sq, sk, h, hk, 64, "bfloat16", causal, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("grid_order", ["qtile", "bh", "auto"])
def test_grid_orders_agree(backend, grid_order):
    run_case(3, 513, 769, 4, 2, 64, "float16", True, grid_order=grid_order, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_rows_without_keys_are_zero(backend):
    out, lse = run_case(2, 300, 100, 2, 2, 64, "float16", True, backend=backend)  # rows 0..199 see no key
    o = to_np(out)
    assert (o[:, :200] == 0).all() and np.isneginf(to_np(lse)[:, :, :200]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_explicit_scale_and_large_values(backend):
    run_case(1, 200, 300, 2, 1, 128, "bfloat16", False, scale=0.3, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_inputs_no_copy(backend):
    """q/k/v as views into one packed qkv tensor (flash-attn's qkvpacked layout): strided, not copied."""
    import torch

    needs_backend(backend)
    qkv = torch.randn(2, 333, 3, 4, 64, device="cuda", dtype=torch.float16)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    out = cuflash.flash_attn_func(q, k, v, causal=True, backend=backend)
    ref, _ = reference.attention_forward(to_np(q), to_np(k), to_np(v), None, True)
    assert_close_to_ref("out", out, torch_attention_lowp(q, k, v, 64 ** -0.5, True), ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cupy_inputs_give_cupy_outputs(backend):
    import cupy

    needs_backend(backend)
    q = cupy.random.standard_normal((2, 211, 4, 64)).astype(cupy.float16)
    k = cupy.random.standard_normal((2, 333, 2, 64)).astype(cupy.float16)
    v = cupy.random.standard_normal((2, 333, 2, 64)).astype(cupy.float16)
    out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, backend=backend)
    assert isinstance(out, cupy.ndarray) and out.dtype == cupy.float16 and isinstance(lse, cupy.ndarray)
    ref, ref_lse = reference.attention_forward(to_np(q), to_np(k), to_np(v), None, True)
    import torch

    tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
    assert_close_to_ref("out", out, torch_attention_lowp(tq, tk, tv, 64 ** -0.5, True), ref)
    assert np.allclose(to_np(lse), ref_lse, atol=LSE_ATOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_64bit_offsets(backend):
    """q and out hold more than 2^31 elements: offsets must be 64-bit. Checked on the last batch elements."""
    import torch

    needs_backend(backend)
    b, sq, h, sk, d = 16400, 128, 8, 16, 128  # q: 16400*128*8*128 = 2.15e9 elements (4.3 GB fp16)
    q = torch.randn((b, sq, h, d), device="cuda", dtype=torch.float16)
    k = torch.randn((b, sk, 1, d), device="cuda", dtype=torch.float16)
    v = torch.randn((b, sk, 1, d), device="cuda", dtype=torch.float16)
    out = cuflash.flash_attn_func(q, k, v, backend=backend)
    tail = slice(b - 3, b)
    ref, _ = reference.attention_forward(to_np(q[tail]), to_np(k[tail]), to_np(v[tail]), None, False)
    lowp = torch_attention_lowp(q[tail], k[tail], v[tail], d ** -0.5, False)
    assert_close_to_ref("out[last batches]", out[tail], lowp, ref)
