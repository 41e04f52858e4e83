"""CPU tests of cuflash.reference: every tiled variant against the naive reference (float64)."""
import itertools
import math
import zlib
from types import SimpleNamespace

import numpy as np
import pytest

from cuflash import reference as ref

TOL = 1e-12
SHAPES = [(1, 1), (1, 33), (1, 130), (17, 1), (17, 33), (17, 130), (33, 33), (100, 1), (100, 33),
          (100, 130)]  # (seqlen_q, seqlen_k), none a multiple of the blocks
HEADS = [(4, 4), (4, 2), (4, 1)]  # (nheads, nheads_k): MHA, GQA, MQA
BLOCKS = [(16, 16), (64, 64), (16, 64)]  # (block_m, block_n)


@pytest.fixture(autouse=True)
def _no_silent_nan():
    """Any invalid op, division by zero or overflow inside the references is an error."""
    with np.errstate(divide="raise", invalid="raise", over="raise"):
        yield


def _rng(request):
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def _inputs(rng, b, sq, sk, h, hk, d=8):
    """Random q, k, v, dout; scaled up so rows have peaked softmaxes and m really moves."""
    q = 2.0 * rng.standard_normal((b, sq, h, d))
    k = 2.0 * rng.standard_normal((b, sk, hk, d))
    v = rng.standard_normal((b, sk, hk, d))
    return q, k, v, rng.standard_normal((b, sq, h, d))


def assert_close(actual, expected, tol=TOL, floor=1e-300):
    """Frobenius-norm error <= tol * (|expected| + floor); NaN anywhere fails. Gradients use
    floor=1 since dq is exactly zero in theory (rounding noise only) when every row sees one key."""
    assert actual.shape == expected.shape and actual.dtype == np.float64
    assert not np.isnan(actual).any()
    err, norm = np.linalg.norm(actual - expected), np.linalg.norm(expected)
    assert err <= tol * (norm + floor), f"error {err:.3g} vs reference norm {norm:.3g}"


def assert_lse_close(actual, expected, tol=TOL):
    """Same -inf pattern, finite entries close."""
    assert actual.shape == expected.shape and actual.dtype == np.float64
    assert not np.isnan(actual).any()
    np.testing.assert_array_equal(np.isneginf(actual), np.isneginf(expected))
    fin = np.isfinite(expected)
    assert np.isfinite(actual[fin]).all()
    assert_close(actual[fin], expected[fin], tol)


CASES = [pytest.param((sq, sk, h, hk, bm, bn, causal),
                      id=f"sq{sq}-sk{sk}-h{h}/{hk}-blk{bm}x{bn}-{'causal' if causal else 'full'}")
         for (sq, sk), (h, hk), (bm, bn), causal in itertools.product(SHAPES, HEADS, BLOCKS,
                                                                       (False, True))]


@pytest.fixture(params=CASES)
def prob(request):
    sq, sk, h, hk, bm, bn, causal = request.param
    q, k, v, dout = _inputs(_rng(request), 2, sq, sk, h, hk)
    out, lse = ref.attention_forward(q, k, v, causal=causal)
    grads = ref.attention_backward(dout, q, k, v, causal=causal)
    return SimpleNamespace(q=q, k=k, v=v, dout=dout, causal=causal, bm=bm, bn=bn, out=out, lse=lse,
                           grads=grads)


def test_flash_v1_forward(prob):
    out, lse, m, l = ref.flash_v1_forward(prob.q, prob.k, prob.v, causal=prob.causal,
                                          block_m=prob.bm, block_n=prob.bn)
    assert_close(out, prob.out)
    assert_lse_close(lse, prob.lse)
    seen = l > 0
    np.testing.assert_array_equal(seen, np.isfinite(m))
    assert_close(m[seen] + np.log(l[seen]), prob.lse[seen])


def test_flash_v2_forward(prob):
    out, lse = ref.flash_v2_forward(prob.q, prob.k, prob.v, causal=prob.causal, block_m=prob.bm,
                                    block_n=prob.bn)
    assert_close(out, prob.out)
    assert_lse_close(lse, prob.lse)


def test_flash_backward(prob):
    grads = ref.flash_backward(prob.dout, prob.q, prob.k, prob.v, prob.out, prob.lse,
                               causal=prob.causal, block_m=prob.bm, block_n=prob.bn)
    for g, g_ref in zip(grads, prob.grads):
        assert_close(g, g_ref, floor=1.0)


def test_flash_v1_backward(prob):
    out, _, m, l = ref.flash_v1_forward(prob.q, prob.k, prob.v, causal=prob.causal,
                                        block_m=prob.bm, block_n=prob.bn)
    grads = ref.flash_v1_backward(prob.dout, prob.q, prob.k, prob.v, out, m, l, causal=prob.causal,
                                  block_m=prob.bm, block_n=prob.bn)
    for g, g_ref in zip(grads, prob.grads):
        assert_close(g, g_ref, floor=1.0)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 50])  # 50 > number of key blocks: empty splits
@pytest.mark.parametrize("block_n", [16, 64])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", SHAPES)
def test_split_kv_forward(request, sq, sk, causal, block_n, num_splits):
    h, hk = HEADS[SHAPES.index((sq, sk)) % len(HEADS)]
    q, k, v, _ = _inputs(_rng(request), 2, sq, sk, h, hk)
    out, lse = ref.split_kv_forward(q, k, v, causal=causal, num_splits=num_splits, block_n=block_n)
    out_ref, lse_ref = ref.attention_forward(q, k, v, causal=causal)
    assert_close(out, out_ref)
    assert_lse_close(lse, lse_ref)


@pytest.mark.parametrize("sq,sk", [(100, 33), (17, 1), (5, 3)])
def test_causal_rows_without_keys(request, sq, sk):
    """Causal with sq > sk: query rows i < sq - sk see no key -> out 0, LSE -inf, zero grads."""
    empty = sq - sk
    q, k, v, dout = _inputs(_rng(request), 2, sq, sk, 4, 2)
    outs = {"naive": ref.attention_forward(q, k, v, causal=True),
            "v1": ref.flash_v1_forward(q, k, v, causal=True, block_m=16, block_n=16)[:2],
            "v2": ref.flash_v2_forward(q, k, v, causal=True, block_m=16, block_n=16),
            "split": ref.split_kv_forward(q, k, v, causal=True, num_splits=3, block_n=16)}
    for out, lse in outs.values():
        assert np.all(out[:, :empty] == 0.0) and np.isfinite(out).all()
        assert np.all(lse[..., :empty] == -np.inf) and np.isfinite(lse[..., empty:]).all()
    out, lse = outs["naive"]
    _, _, m, l = ref.flash_v1_forward(q, k, v, causal=True, block_m=16, block_n=16)
    assert np.all(l[..., :empty] == 0.0) and np.all(m[..., :empty] == -np.inf)
    grads = [ref.attention_backward(dout, q, k, v, causal=True),
             ref.flash_backward(dout, q, k, v, out, lse, causal=True, block_m=16, block_n=16),
             ref.flash_v1_backward(dout, q, k, v, out, m, l, causal=True, block_m=16, block_n=16)]
    for dq, dk, dv in grads:
        assert all(np.isfinite(g).all() for g in (dq, dk, dv))
        assert np.all(dq[:, :empty] == 0.0)


@pytest.mark.parametrize("sq,sk", [(3, 4), (4, 3)])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_backward_finite_differences(request, sq, sk, causal):
    """Central differences of L = sum(out * dout) with respect to every element of q, k, v."""
    q, k, v, dout = _inputs(_rng(request), 1, sq, sk, 4, 2, d=4)  # GQA: heads 0,1 -> kv 0
    grads = ref.attention_backward(dout, q, k, v, causal=causal)
    eps = 1e-6
    xs = [q, k, v]
    for x, g in zip(xs, grads):
        fd = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            orig = x[idx]
            vals = []
            for step in (eps, -eps):
                x[idx] = orig + step
                vals.append(np.sum(ref.attention_forward(*xs, causal=causal)[0] * dout))
            x[idx] = orig
            fd[idx] = (vals[0] - vals[1]) / (2 * eps)
        np.testing.assert_allclose(g, fd, rtol=1e-6, atol=1e-7 * max(1.0, np.abs(fd).max()))


@pytest.mark.parametrize("h,hk", [(4, 2), (4, 1), (6, 3)])
def test_gqa_head_mapping(request, h, hk):
    """Query head i uses kv head i // (h // hk); dk, dv sum over those query heads."""
    q, k, v, dout = _inputs(_rng(request), 2, 5, 7, h, hk)
    kv_of = np.arange(h) // (h // hk)
    k_rep, v_rep = k[:, :, kv_of], v[:, :, kv_of]  # explicit MHA copies [b, sk, h, d]
    assert_close(ref.attention_forward(q, k, v, causal=True)[0],
                 ref.attention_forward(q, k_rep, v_rep, causal=True)[0])
    dq, dk, dv = ref.attention_backward(dout, q, k, v, causal=True)
    dq_rep, dk_rep, dv_rep = ref.attention_backward(dout, q, k_rep, v_rep, causal=True)
    assert_close(dq, dq_rep)
    for g, g_rep in ((dk, dk_rep), (dv, dv_rep)):
        summed = np.stack([g_rep[:, :, kv_of == j].sum(axis=2) for j in range(hk)], axis=2)
        assert_close(g, summed)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq", [1, 5])
def test_split_kv_cache_seqlens(request, sq, causal, num_splits):
    seqlens = np.array([0, 3, 37, 130], dtype=np.int32)  # empty, ragged (< sq), ragged, full
    q, k, v, _ = _inputs(_rng(request), len(seqlens), sq, 130, 4, 2)
    out, lse = ref.split_kv_forward(q, k, v, causal=causal, num_splits=num_splits, block_n=16,
                                    cache_seqlens=seqlens)
    assert np.all(out[0] == 0.0) and np.all(lse[0] == -np.inf)
    for bi, n in enumerate(seqlens):
        out_ref, lse_ref = ref.attention_forward(q[bi:bi + 1], k[bi:bi + 1, :n], v[bi:bi + 1, :n],
                                                 causal=causal)
        assert_close(out[bi:bi + 1], out_ref)
        assert_lse_close(lse[bi:bi + 1], lse_ref)


def test_combine_splits_direct():
    rng = np.random.default_rng(0)
    q, k, v, _ = _inputs(rng, 1, 3, 20, 2, 2)
    parts = [ref.attention_forward(q, k[:, a:b], v[:, a:b]) for a, b in [(0, 7), (7, 7), (7, 20)]]
    o_part = np.stack([o.transpose(0, 2, 1, 3) for o, _ in parts])  # [s, b, h, sq, d]
    lse_part = np.stack([lse for _, lse in parts])  # [s, b, h, sq]; the middle split is empty
    assert np.all(lse_part[1] == -np.inf)
    out, lse = ref.combine_splits(o_part, lse_part)
    out_ref, lse_ref = ref.attention_forward(q, k, v)
    assert_close(out, out_ref)
    assert_lse_close(lse, lse_ref)
    out, lse = ref.combine_splits(np.zeros((2, 1, 2, 3, 8)), np.full((2, 1, 2, 3), -np.inf))
    assert np.all(out == 0.0) and np.all(lse == -np.inf)


def test_causal_mask():
    t, f = True, False
    np.testing.assert_array_equal(ref.causal_mask(2, 4), [[t, t, t, f], [t, t, t, t]])
    np.testing.assert_array_equal(ref.causal_mask(3, 2), [[f, f], [t, f], [t, t]])
    np.testing.assert_array_equal(ref.causal_mask(3, 3), np.tril(np.ones((3, 3), bool)))


def test_softmax_scale_and_dtypes(request):
    """Explicit scale is honoured by every variant; float32 inputs compute and return float64."""
    q32, k32, v32, do32 = (x.astype(np.float32) for x in _inputs(_rng(request), 2, 17, 33, 4, 2))
    qd, kd, vd, dout = (x.astype(np.float64) for x in (q32, k32, v32, do32))
    out_ref, lse_ref = ref.attention_forward(qd, kd, vd, softmax_scale=0.7, causal=True)
    default = ref.attention_forward(qd, kd, vd, softmax_scale=1 / math.sqrt(8), causal=True)
    assert_close(ref.attention_forward(q32, k32, v32, causal=True)[0], default[0])
    kw = dict(softmax_scale=0.7, causal=True, block_m=16, block_n=16)
    out1, lse1, m, l = ref.flash_v1_forward(q32, k32, v32, **kw)
    for out, lse in [(out1, lse1), ref.flash_v2_forward(q32, k32, v32, **kw),
                     ref.split_kv_forward(q32, k32, v32, softmax_scale=0.7, causal=True,
                                          num_splits=2, block_n=16)]:
        assert_close(out, out_ref)
        assert_lse_close(lse, lse_ref)
    grads_ref = ref.attention_backward(dout, qd, kd, vd, softmax_scale=0.7, causal=True)
    for grads in [ref.flash_backward(do32, q32, k32, v32, out_ref, lse_ref, **kw),
                  ref.flash_v1_backward(do32, q32, k32, v32, out1, m, l, **kw)]:
        for g, g_ref in zip(grads, grads_ref):
            assert_close(g, g_ref, floor=1.0)


def test_attention_flops():
    assert ref.attention_flops(1, 1, 1, 1, 1) == 4.0
    assert ref.attention_flops(1, 2, 3, 5, 7) == 840.0
    assert ref.attention_flops(2, 16, 1024, 1024, 64) == 8589934592.0
    assert ref.attention_flops(2, 16, 1024, 1024, 64, causal=True, mode="bwd") == 10737418240.0
    assert ref.attention_flops(2, 16, 1024, 1024, 64, mode="fwd_bwd") == 30064771072.0
    with pytest.raises(ValueError):
        ref.attention_flops(1, 1, 1, 1, 1, mode="backward")
