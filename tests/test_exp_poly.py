"""exp2 on the FMA pipe (cuda_src/common/ptx.cuh: exp2_poly) and the kernel names of its variants.

CPU: a float32 emulation of exactly the device's steps, with the coefficients read from the source, holds the
documented bounds (relative error <= 1.02e-4 on [-126, 8], exact at integers, +0 for -inf and below -127).
GPU: the device function itself, bitwise equal to that emulation on a sweep of inputs."""
from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest

from cuflash import _loader
from cuflash._configs import (EXP_POLY_HALF, EXP_POLY_QUARTER, MOD_SCORE, SM90_BWD_TILES, SM90_FWD_TILES,
                              sm90_bwd_spec, sm90_fwd_spec)

REL_BOUND = 1.02e-4


def _source() -> str:
    return (_loader.source_dir() / "common" / "ptx.cuh").read_text()


def _coefficients():
    """(c3, c2, c1) of exp2_poly's Horner form, from the source's hex float literals."""
    body = _source().split("float exp2_poly(float x)", 1)[1].split("\n}", 1)[0]
    lits = re.findall(r"(0x[0-9a-fA-F.]+p[-+]?\d+)f", body)
    assert len(lits) == 3, lits
    return tuple(np.float32(float.fromhex(x)) for x in lits)


def emulate(x: np.ndarray) -> np.ndarray:
    """exp2_poly in float32, step by step (round to nearest everywhere, as the device's FADD / FFMA)."""
    c3, c2, c1 = _coefficients()
    x = np.maximum(x.astype(np.float32), np.float32(-127.0))
    rnd = np.float32(12582912.0)
    t = (x + rnd).astype(np.float32)
    f = (x - (t - rnd).astype(np.float32)).astype(np.float32)
    # FFMA rounds once: emulate in float64 (exact product of float32s) and round
    p = (c3.astype(np.float64) * f + c2).astype(np.float32)
    p = (p.astype(np.float64) * f + c1).astype(np.float32)
    p = (p.astype(np.float64) * f + 1.0).astype(np.float32)
    bits = (p.view(np.uint32).astype(np.uint64) + (t.view(np.uint32).astype(np.uint64) << np.uint64(23)))
    return (bits & np.uint64(0xFFFFFFFF)).astype(np.uint32).view(np.float32)


def test_exp2_poly_emulation_bounds():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.uniform(-126, 8, 400_000), rng.uniform(-1, 1, 100_000)]).astype(np.float32)
    y = emulate(x).astype(np.float64)
    rel = np.abs(y / np.exp2(x.astype(np.float64)) - 1)
    assert rel.max() <= REL_BOUND, rel.max()
    ints = np.arange(-126, 9, dtype=np.float32)
    assert np.array_equal(emulate(ints), np.exp2(ints.astype(np.float64)).astype(np.float32))
    zeros = emulate(np.array([-np.inf, -1e30, -200.0, -127.0], np.float32))
    assert np.array_equal(zeros.view(np.uint32), np.zeros(4, np.uint32))  # +0, as ex2.approx(-inf)
    tiny = emulate(np.array([-126.9, -126.5, -126.1], np.float32))
    assert np.all(tiny >= 0) and np.all(tiny < 2.0 ** -125)


def test_exp_variant_names():
    """exp / cap_exp reach the name only where they act: cap_exp in MOD_SCORE kernels; the defaults print nothing."""
    base = SM90_FWD_TILES[64]
    plain = sm90_fwd_spec("float16", 64, True, replace(base, exp=0, cap_exp=0)).name
    assert plain.endswith(f", {sm90_fwd_spec('float16', 64, True, base).smem}>")  # no trailing MOD, EXP, CAP_EXP
    assert sm90_fwd_spec("float16", 64, True, replace(base, exp=0, cap_exp=EXP_POLY_HALF)).name == plain
    assert sm90_fwd_spec("float16", 64, True, replace(base, exp=EXP_POLY_QUARTER)).name.endswith(", 0, 4, 0>")
    mod = sm90_fwd_spec("float16", 64, False, replace(base, exp=0, cap_exp=EXP_POLY_HALF), MOD_SCORE).name
    assert mod.endswith(", 1, 0, 3>")
    assert sm90_fwd_spec("float16", 64, False, replace(base, exp=0, cap_exp=0), MOD_SCORE).name.endswith(", 1>")
    b = SM90_BWD_TILES[128]
    assert sm90_bwd_spec("float16", 128, True, replace(b, cap_exp=EXP_POLY_HALF)).name == \
        sm90_bwd_spec("float16", 128, True, replace(b, cap_exp=0)).name
    assert sm90_bwd_spec("float16", 128, False, replace(b, cap_exp=EXP_POLY_HALF), MOD_SCORE).name.endswith(
        ", 1, 0, 3>")


KERNEL = r"""
extern "C" __global__ void probe(const float* x, float* y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = cuflash::exp2_poly(x[i]);
}
"""


@pytest.mark.gpu
def test_exp2_poly_device_matches_emulation():
    import cupy as cp

    src = _source().replace("#pragma once", "") + KERNEL
    mod = cp.RawModule(code=src, options=("-std=c++17", "-ftz=true"))
    fn = mod.get_function("probe")
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.uniform(-130, 9, 1 << 18), np.arange(-130, 9), [-np.inf, -127.0, -126.5, 0.0, 0.5,
                                                                             -0.5]]).astype(np.float32)
    xd = cp.asarray(x)
    yd = cp.full(x.shape, cp.nan, dtype=cp.float32)  # poisoned
    fn(((x.size + 255) // 256,), (256,), (xd, yd, np.int32(x.size)))
    y = cp.asnumpy(yd)
    emu = emulate(x)
    # -ftz: the device flushes the denormal results of x in (-127, -126) to what the integer add gives (no float op
    # follows inside the function), so those compare bitwise as well
    assert np.array_equal(y.view(np.uint32), emu.view(np.uint32)), np.flatnonzero(y.view(np.uint32) != emu.view(np.uint32))[:10]
    ok = x >= -126
    rel = np.abs(y[ok].astype(np.float64) / np.exp2(x[ok].astype(np.float64)) - 1)
    assert rel.max() <= REL_BOUND
