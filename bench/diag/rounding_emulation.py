"""Diagnostic (CPU): emulation of where the backward's dq error comes from (python -m bench.diag.rounding_emulation
[--d-precision]).

float64 NumPy with explicit roundings to fp16 at the points where each implementation rounds:
* torch's fp16 math path (the tests' yardstick): S = QK^T rounded, scaled and rounded, softmax in fp32 with a
  fp16 P, dP rounded, dS = P (dP - rowsum(P dP)) rounded, scaled and rounded, dq = dS K rounded;
* cuflash (and FlashAttention-2): S, P in fp32, P rounded to fp16 for P V and for dS, O rounded, D = rowsum(dO O)
  from the rounded O, dP in fp32, dS rounded, dq = softmax_scale * (dS K) in fp32, rounded once.
For random problems it prints how often cuflash's max error exceeds 2x torch's, without and with the test
rule's floor (half an ulp of the output at the reference's largest magnitude; tests/conftest.py), and both
medians in ulps of that magnitude.

--d-precision: the large-logit tail (inputs x3, softmax_scale 0.3, one query row against 1999 keys, fp16): the
worst ratio of cuflash's dq / dk max error to torch's over random problems, with D = rowsum(dO * O) taken three
ways: from the fp16 O (what the backward does today), from the fp32 O before rounding, and as rowsum(P16 * dP) in
fp32 (the form torch's math path has).

--bf16-d1: tests/test_headdims.py::test_odd_backward[bfloat16-1]'s problem (head dim 1, bf16, causal, 190 query rows
against 333 keys, 8 heads per call) over random inputs: how often cuflash's dq error exceeds the test's bound (3x
torch's + half an ulp at the reference's largest magnitude), with D = rowsum(dO * O) from the bf16 O (the backward
today) and from the fp32 O that P V accumulated (P rounded to bf16 as the kernels do)."""
from __future__ import annotations

import numpy as np


def _f16(x):
    return x.astype(np.float16).astype(np.float64)


def _f32(x):
    return x.astype(np.float32).astype(np.float64)


def _bf16(x):
    """Round to bfloat16 (nearest, ties to even: bench.bench_micro_sm90's bit patterns); float64 out."""
    from ..bench_micro_sm90 import bf16_bits, bits_to_float

    return bits_to_float(bf16_bits(x), "bf16")


def bf16_d1_ratio(seed, d_from_fp32_o=False, sq=190, sk=333, d=1, heads=8):
    """cuflash's dq max error over the test's bound (3x torch's + the half-ulp floor) for one call's heads."""
    rng = np.random.default_rng(seed)
    errs = [dq_errors(None, sq, sk, d, rnd=_bf16, mant=8, d_from_fp32_o=d_from_fp32_o, rng=rng) for _ in range(heads)]
    eo, et, ulp = (max(e[i] for e in errs) for i in range(3))
    return eo / (3 * et + max(1e-5, ulp / 2))


def bf16_d1(n=400):
    for fp32_o in (False, True):
        r = np.array([bf16_d1_ratio(s, fp32_o) for s in range(n)])
        print(f"D from the {'fp32' if fp32_o else 'bf16'} O: over the bound in {np.mean(r > 1):.2%} of {n} calls, "
              f"worst {r.max():.2f}x the bound, median {np.median(r):.2f}x")


def dq_errors(seed, sq, sk, d, causal=True, rnd=_f16, mant=10, d_from_fp32_o=False, rng=None):
    """(cuflash max error, torch max error, ulp at max |dq_ref|) of dq for one (batch, head) problem in the 16-bit type
    `rnd` rounds to (mant: its mantissa bits); D = rowsum(dO * O) from the 16-bit O (the backward today) or, with
    d_from_fp32_o, from the fp32 O that P V accumulated; rng: draw from it instead of a generator seeded with seed."""
    rng = rng or np.random.default_rng(seed)
    q, k, v, do = (rnd(rng.standard_normal(s)) for s in ((sq, d), (sk, d), (sk, d), (sq, d)))
    scale = d ** -0.5
    mask = np.arange(sk)[None, :] <= np.arange(sq)[:, None] + sk - sq if causal else np.ones((sq, sk), bool)

    def softmax(s):
        s = np.where(mask, s, -np.inf)
        m = s.max(1, keepdims=True)
        p = np.exp(s - np.where(np.isfinite(m), m, 0))
        l = p.sum(1, keepdims=True)
        return p / np.where(l > 0, l, 1)

    p = softmax(q @ k.T * scale)  # float64 reference
    dq_ref = (p * (do @ v.T - (do * (p @ v)).sum(1, keepdims=True))) @ k * scale
    pt = rnd(softmax(rnd(rnd(q @ k.T) * scale)))  # torch, 16-bit math
    dpt = rnd(do @ v.T)
    dq_t = rnd(rnd(rnd(pt * (dpt - (pt * dpt).sum(1, keepdims=True))) * scale) @ k)
    po = rnd(_f32(softmax(_f32(q @ k.T) * scale)))  # cuflash: P rounded for P V and dS
    o = _f32(po @ v) if d_from_fp32_o else rnd(po @ v)
    dq_o = rnd(_f32(rnd(po * (_f32(do @ v.T) - _f32((do * o).sum(1, keepdims=True)))) @ k) * scale)
    m = np.abs(dq_ref).max()
    return np.abs(dq_o - dq_ref).max(), np.abs(dq_t - dq_ref).max(), 2.0 ** (np.floor(np.log2(m)) - mant)


def d_precision_ratios(seed, sq=1, sk=1999, d=64, xs=3.0, scale=0.3):
    """{variant: max(dq error / torch's, dk error / torch's)} of one problem (module docstring, --d-precision)."""
    rng = np.random.default_rng(seed)
    q, k = (_f16(rng.standard_normal(s) * xs) for s in ((sq, d), (sk, d)))
    v, do = (_f16(rng.standard_normal(s)) for s in ((sk, d), (sq, d)))

    def softmax(s):
        p = np.exp(s - s.max(1, keepdims=True))
        return p / p.sum(1, keepdims=True)

    p = softmax(q @ k.T * scale)
    ds = p * (do @ v.T - (do * (p @ v)).sum(1, keepdims=True))
    dq_ref, dk_ref = ds @ k * scale, ds.T @ q * scale
    pt = _f16(softmax(_f16(_f16(q @ k.T) * scale)))  # torch, fp16 math
    dpt = _f16(do @ v.T)
    dst = _f16(pt * (dpt - (pt * dpt).sum(1, keepdims=True)))
    et = (np.abs(_f16(_f16(dst * scale) @ k) - dq_ref).max(), np.abs(_f16(_f16(dst.T * scale) @ q) - dk_ref).max())
    pf = _f32(softmax(_f32(q @ k.T) * scale))  # cuflash: P in fp32, its fp16 copy for dV and dS
    p16, dp = _f16(pf), _f32(do @ v.T)
    out = {}
    for name, dd in (("D from fp16 O", (do * _f16(pf @ v)).sum(1, keepdims=True)),
                     ("D from fp32 O", (do * _f32(pf @ v)).sum(1, keepdims=True)),
                     ("D = rowsum(P16 dP)", (p16 * dp).sum(1, keepdims=True))):
        dsc = _f16(p16 * (dp - _f32(dd)))
        eq = np.abs(_f16(_f32(dsc @ k) * scale) - dq_ref).max()
        ek = np.abs(_f16(_f32(dsc.T @ q) * scale) - dk_ref).max()
        out[name] = max(eq / max(et[0], 1e-30), ek / max(et[1], 1e-30))
    return out


def d_precision(n=300):
    by = {}
    for seed in range(n):
        for name, r in d_precision_ratios(seed).items():
            by.setdefault(name, []).append(r)
    for name, rs in by.items():
        rs = np.array(rs)
        print(f"{name:20s} worst {rs.max():6.1f}x torch, 99th percentile {np.percentile(rs, 99):5.1f}x, "
              f"> 3x in {np.mean(rs > 3):.1%} of {n}")


def main(n=200):
    for sq, sk in ((300, 17), (257, 257)):
        for d in (32, 64):
            eo, et, ulp = map(np.array, zip(*(dq_errors(s, sq, sk, d) for s in range(n))))
            print(f"({sq}, {sk}) causal d={d}: cuflash > 2x torch in {np.mean(eo > 2 * et):.1%} of {n} problems, "
                  f"with the half-ulp floor in {np.mean(eo > 2 * et + ulp / 2):.1%}; median error in ulps: "
                  f"cuflash {np.median(eo / ulp):.2f}, torch {np.median(et / ulp):.2f}")


if __name__ == "__main__":
    import sys

    if "--bf16-d1" in sys.argv:
        bf16_d1()
    else:
        d_precision() if "--d-precision" in sys.argv else main()
