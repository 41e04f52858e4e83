"""CPU: the float64 references of flash-attn's score options (cuflash.reference: sliding window, softcap, ALiBi),
against a per-element definition written out loop by loop, and their backward against finite differences."""
import math

import numpy as np
import pytest

from cuflash import reference

WINDOWS = [(-1, -1), (0, 0), (3, 0), (2, 5), (-1, 2), (4, -1), (100, 100)]


def _brute_visible(sq, sk, causal, window):
    left, right = window
    if causal:
        right = 0
    out = np.zeros((sq, sk), bool)
    for i in range(sq):
        for j in range(sk):
            c = i + sk - sq
            out[i, j] = (left < 0 or j >= c - left) and (right < 0 or j <= c + right)
    return out


@pytest.mark.parametrize("sq,sk", [(5, 9), (9, 5), (7, 7), (1, 12)])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("causal", [False, True])
def test_visible_mask(sq, sk, window, causal):
    assert np.array_equal(reference.visible_mask(sq, sk, causal, window), _brute_visible(sq, sk, causal, window))
    if window == (-1, -1):
        assert np.array_equal(reference.visible_mask(sq, sk, causal), reference.causal_mask(sq, sk) if causal
                              else np.ones((sq, sk), bool))


def _brute_forward(q, k, v, scale, causal, window, softcap, slopes):
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    vis = _brute_visible(sq, sk, causal, window)
    out = np.zeros((b, sq, h, d))
    lse = np.full((b, h, sq), -np.inf)
    for bi in range(b):
        for hi in range(h):
            kh = hi // (h // hk)
            slope = None if slopes is None else (slopes[hi] if np.ndim(slopes) == 1 else slopes[bi][hi])
            for i in range(sq):
                sc = []
                for j in range(sk):
                    if not vis[i, j]:
                        continue
                    x = scale * float(np.dot(q[bi, i, hi], k[bi, j, kh]))
                    if softcap > 0:
                        x = softcap * math.tanh(x / softcap)
                    if slope is not None:
                        x -= slope * abs(i + sk - sq - j)
                    sc.append((j, x))
                if not sc:
                    continue
                mx = max(x for _, x in sc)
                w = [(j, math.exp(x - mx)) for j, x in sc]
                tot = sum(e for _, e in w)
                out[bi, i, hi] = sum(e * v[bi, j, kh] for j, e in w) / tot
                lse[bi, hi, i] = mx + math.log(tot)
    return out, lse


def _inputs(rng, b=2, sq=6, sk=9, h=4, hk=2, d=8, mag=1.0):
    q = rng.standard_normal((b, sq, h, d)) * mag
    k = rng.standard_normal((b, sk, hk, d)) * mag
    v = rng.standard_normal((b, sk, hk, d))
    return q, k, v


OPTIONS = [
    dict(causal=False, window=(-1, -1), softcap=0.0, alibi=None),
    dict(causal=True, window=(-1, -1), softcap=0.0, alibi=None),
    dict(causal=False, window=(2, 3), softcap=0.0, alibi=None),
    dict(causal=True, window=(3, -1), softcap=0.0, alibi=None),
    dict(causal=False, window=(-1, -1), softcap=5.0, alibi=None),
    dict(causal=True, window=(-1, -1), softcap=0.0, alibi="h"),
    dict(causal=False, window=(4, 1), softcap=2.0, alibi="bh"),
]


def _slopes(kind, rng, b=2, h=4):
    if kind is None:
        return None
    return rng.uniform(0.05, 0.5, (h,) if kind == "h" else (b, h))


@pytest.mark.parametrize("sq,sk", [(6, 9), (9, 6), (1, 7)])
@pytest.mark.parametrize("opt", OPTIONS, ids=lambda o: f"c{int(o['causal'])}-w{o['window']}-cap{o['softcap']}-"
                                                     f"alibi{o['alibi']}")
def test_forward_matches_the_per_element_definition(sq, sk, opt):
    rng = np.random.default_rng(sq * 100 + sk)
    q, k, v = _inputs(rng, sq=sq, sk=sk, mag=2.0)
    sl = _slopes(opt["alibi"], rng)
    out, lse = reference.attention_forward(q, k, v, 0.3, opt["causal"], opt["window"], opt["softcap"], sl)
    ref_o, ref_lse = _brute_forward(q, k, v, 0.3, opt["causal"], opt["window"], opt["softcap"], sl)
    assert np.allclose(out, ref_o, atol=1e-12, rtol=1e-10)
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    assert np.allclose(lse[fin], ref_lse[fin], atol=1e-12)


def test_rows_that_see_no_key_are_zero():
    """A window that leaves some rows without keys (sq > sk, causal, narrow left edge): out 0, LSE -inf, grads 0,
    never NaN."""
    rng = np.random.default_rng(3)
    q, k, v = _inputs(rng, sq=9, sk=4)
    out, lse = reference.attention_forward(q, k, v, None, True, (1, -1), 3.0, _slopes("h", rng))
    dq, dk, dv = reference.attention_backward(np.ones_like(out), q, k, v, None, True, (1, -1), 3.0,
                                              _slopes("h", rng))
    empty = ~reference.visible_mask(9, 4, True, (1, -1)).any(axis=1)
    assert empty.sum() == 5 and (out[:, empty] == 0).all() and np.isneginf(lse[:, :, empty]).all()
    assert not any(np.isnan(x).any() for x in (out, dq, dk, dv)) and (dq[:, empty] == 0).all()


@pytest.mark.parametrize("opt", OPTIONS, ids=lambda o: f"c{int(o['causal'])}-w{o['window']}-cap{o['softcap']}-"
                                                     f"alibi{o['alibi']}")
def test_backward_matches_finite_differences(opt):
    rng = np.random.default_rng(11)
    q, k, v = _inputs(rng, b=1, sq=5, sk=7, h=2, hk=1, d=4, mag=1.5)
    sl = _slopes(opt["alibi"], rng, b=1, h=2)
    dout = rng.standard_normal(q.shape)
    args = (0.7, opt["causal"], opt["window"], opt["softcap"], sl)
    grads = reference.attention_backward(dout, q, k, v, *args)

    def loss(qq, kk, vv):
        return float((reference.attention_forward(qq, kk, vv, *args)[0] * dout).sum())

    eps = 1e-6
    for sel, g in enumerate(grads):
        x = (q, k, v)[sel]
        num = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            plus, minus = [q, k, v], [q, k, v]
            plus[sel], minus[sel] = x.copy(), x.copy()
            plus[sel][idx] += eps
            minus[sel][idx] -= eps
            num[idx] = (loss(*plus) - loss(*minus)) / (2 * eps)
        assert np.allclose(g, num, atol=1e-6, rtol=1e-5), ("qkv"[sel], np.abs(g - num).max())
