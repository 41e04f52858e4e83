"""Diagnostic (CPU): emulation of where the backward's dq error comes from (python -m bench.diag.rounding_emulation).

float64 NumPy with explicit roundings to fp16 at the points where each implementation rounds:
* torch's fp16 math path (the tests' yardstick): S = QK^T rounded, scaled and rounded, softmax in fp32 with a
  fp16 P, dP rounded, dS = P (dP - rowsum(P dP)) rounded, scaled and rounded, dq = dS K rounded;
* cuflash (and FlashAttention-2): S, P in fp32, P rounded to fp16 for P V and for dS, O rounded, D = rowsum(dO O)
  from the rounded O, dP in fp32, dS rounded, dq = softmax_scale * (dS K) in fp32, rounded once.
For random problems it prints how often cuflash's max error exceeds 2x torch's, without and with the test
rule's floor (half an ulp of the output at the reference's largest magnitude; tests/conftest.py), and both
medians in ulps of that magnitude."""
from __future__ import annotations

import numpy as np


def _f16(x):
    return x.astype(np.float16).astype(np.float64)


def _f32(x):
    return x.astype(np.float32).astype(np.float64)


def dq_errors(seed, sq, sk, d, causal=True):
    """(cuflash max error, torch max error, ulp at max |dq_ref|) of dq for one (batch, head) problem."""
    rng = np.random.default_rng(seed)
    q, k, v, do = (_f16(rng.standard_normal(s)) for s in ((sq, d), (sk, d), (sk, d), (sq, d)))
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
    pt = _f16(softmax(_f16(_f16(q @ k.T) * scale)))  # torch, fp16 math
    dpt = _f16(do @ v.T)
    dq_t = _f16(_f16(_f16(pt * (dpt - (pt * dpt).sum(1, keepdims=True))) * scale) @ k)
    po = _f16(_f32(softmax(_f32(q @ k.T) * scale)))  # cuflash
    o = _f16(po @ v)
    dq_o = _f16(_f32(_f16(po * (_f32(do @ v.T) - _f32((do * o).sum(1, keepdims=True)))) @ k) * scale)
    m = np.abs(dq_ref).max()
    return np.abs(dq_o - dq_ref).max(), np.abs(dq_t - dq_ref).max(), 2.0 ** (np.floor(np.log2(m)) - 10)


def main(n=200):
    for sq, sk in ((300, 17), (257, 257)):
        for d in (32, 64):
            eo, et, ulp = map(np.array, zip(*(dq_errors(s, sq, sk, d) for s in range(n))))
            print(f"({sq}, {sk}) causal d={d}: cuflash > 2x torch in {np.mean(eo > 2 * et):.1%} of {n} problems, "
                  f"with the half-ulp floor in {np.mean(eo > 2 * et + ulp / 2):.1%}; median error in ulps: "
                  f"cuflash {np.median(eo / ulp):.2f}, torch {np.median(et / ulp):.2f}")


if __name__ == "__main__":
    main()
