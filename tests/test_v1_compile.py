"""CPU tests of the FlashAttention-1 kernels (cuda_src/flash_v1.cu, cuflash/v1.py), no GPU needed:

* every configuration `v1.specs()` lists compiles with NVRTC for sm_80 and sm_90 with no register spills
  and no local memory (ptxas -v report), within sm_80's 163 KB of shared memory per block;
* a NumPy model of the kernels' tile schedule (KV tiles outer, Q tiles inner, causal pair skipping, first
  and last visits, the split-K cross-warp combine, the backward's m/l-based P and on-the-fly D) run with
  the configured tile sizes on NaN-poisoned "HBM" buffers reproduces the float64 reference: every value
  the kernels read was written first, every output row is written.
"""
import math

import numpy as np
import pytest

from cuflash import _compile_check, _loader, reference, v1
from cuflash._launch import KernelSpec

SM80_MAX_SMEM = 163 * 1024  # opt-in dynamic shared memory per block on sm_80 (sm_90: 227 KB)


def _v1_bench_specs():
    """The ladder's kernels beyond the package's own: V1 tiles, and the V2 forward's exp variants."""
    from bench import bench_v1

    return [s for s in bench_v1.sweep_specs() if s.filename in (v1.FILENAME, "flash_fwd.cu") and s not in v1.specs()]


def _specs():
    return v1.specs() + _v1_bench_specs()  # the package's configurations and the ladder's extra kernels


# the compiles each test reads (tests/conftest.py: kernel_report; v1.specs() are also in test_compile's set,
# and the pass compiles each kernel once)
KERNEL_TASKS = {"test_v1_kernels_compile_without_spills": lambda arch: _compile_check.tasks(_specs(), (arch,))}


@pytest.mark.parametrize("arch", _compile_check.ARCHS)
def test_v1_kernels_compile_without_spills(kernel_report, arch):
    specs = _specs()
    bad = {}
    for s in specs:  # each compiled alone, as the run-time loader compiles it
        info = kernel_report[s.name]
        assert "error" not in info, f"{s.name}: {info['error']}"
        assert "regs" in info, f"no ptxas report for {s.name}"
        assert info["regs"] <= 255
        assert s.smem <= SM80_MAX_SMEM, (s.name, s.smem)
        if info["stack"] or info["spill_st"] or info["spill_ld"]:
            bad[s.name] = {k: info[k] for k in ("regs", "stack", "spill_st", "spill_ld", "nvrtc")}
    assert not bad, "spills or local memory:\n" + "\n".join(f"  {n}: {b}" for n, b in sorted(bad.items()))


def test_specs_cover_every_configuration():
    specs = v1.specs()
    assert all(isinstance(s, KernelSpec) and s.filename == "flash_v1.cu" for s in specs)
    assert len({s.name for s in specs}) == len(specs)
    for dt in ("float16", "bfloat16"):
        for d in v1.HEADDIMS:
            for causal in (False, True):
                assert v1.bwd_spec(dt, d, causal) in specs
                for split in ("k", "q"):
                    assert v1.fwd_spec(dt, d, causal, split) in specs
            assert v1.convert_spec(dt, d) in specs
    # the name expressions carry the smem size the kernel static_asserts against
    s = v1.fwd_spec("float16", 128, True, "k")
    assert s.name.endswith(f", 0, true, {s.smem}>") and s.threads == 32 * v1.FWD_TILES["k"][128].nwarps


def test_argument_errors():
    with pytest.raises(ValueError, match="warp_split"):
        v1.fwd_spec("float16", 64, False, "x")
    with pytest.raises(ValueError, match="warp_split"):
        v1.forward(None, None, None, None, False, warp_split="rows")
    with pytest.raises(ValueError, match="head dims"):
        v1._check_headdim(256)


def test_param_formats_are_8_byte_slots():
    import struct

    assert struct.calcsize(v1.FWD_FORMAT) == 8 * len(v1.FWD_PARAMS)
    assert struct.calcsize(v1.BWD_FORMAT) == 8 * len(v1.BWD_PARAMS)


# ------------------------------------------------------------------------------- schedule model (NumPy)
LOG2E, LN2 = math.log2(math.e), math.log(2.0)


def _cdiv(a, b):
    return -(-a // b)


def _exp2(x):
    with np.errstate(over="raise", invalid="raise"):
        return np.exp2(x)


def _tile(x, r0, rows):
    """Rows [r0, r0 + rows) of x, zero-filled past its end (cp.async with src_size 0)."""
    t = np.zeros((rows,) + x.shape[1:])
    part = x[r0:r0 + rows]
    t[:len(part)] = part
    return t


def model_forward(q, k, v, scale, causal, tile, split):
    """flash_v1_fwd_kernel for one (batch, head): q [sq, d], k, v [sk, d]. Returns out, lse, m, l."""
    (sq, d), sk = q.shape, k.shape[0]
    bm, bn, nw = tile.block_m, tile.block_n, tile.nwarps
    diag, num_m, num_n, sl2 = sk - sq, _cdiv(sq, bm), _cdiv(sk, bn), scale * LOG2E
    o_acc, m, l = np.full((sq, d), np.nan), np.full(sq, np.nan), np.full(sq, np.nan)  # poisoned HBM
    out, lse = np.full((sq, d), np.nan), np.full(sq, np.nan)
    m_first = num_m if num_n == 0 else (min(num_m, -diag // bm) if causal and diag < 0 else 0)
    empty = min(sq, m_first * bm)
    out[:empty], m[:empty], l[:empty], lse[:empty] = 0.0, -np.inf, 0.0, -np.inf
    for n in range(num_n):
        n0 = n * bn
        m_begin = (n0 - diag) // bm if causal and n0 - diag > 0 else 0
        kt, vt = _tile(k, n0, bn), _tile(v, n0, bn)
        for mb in range(m_begin, num_m):
            m0 = mb * bm
            n_last = min(num_n - 1, (m0 + bm - 1 + diag) // bn) if causal else num_n - 1
            rows = np.arange(m0, m0 + bm)
            ok = rows < sq
            s = _tile(q, m0, bm) @ kt.T
            cols = np.arange(n0, n0 + bn)
            s[(cols[None] >= sk) | (causal & (cols[None] > rows[:, None] + diag))] = -np.inf
            m_old2, l_old, o_old = np.full(bm, -np.inf), np.zeros(bm), np.zeros((bm, d))
            if n > 0:  # not the first visit: read O_i, m_i, l_i
                m_old2[ok], l_old[ok], o_old[ok] = m[rows[ok]] * LOG2E, l[rows[ok]], o_acc[rows[ok]]
                assert not (np.isnan(m_old2).any() or np.isnan(l_old).any() or np.isnan(o_old).any()), "unwritten"
            if split == "k":  # per-warp partials over their key slices, combined across warps
                wn = bn // nw
                parts = []
                for w in range(nw):
                    sw = s[:, w * wn:(w + 1) * wn]
                    mp = sw.max(axis=1) * sl2
                    p = _exp2(sw * sl2 - np.where(np.isneginf(mp), 0.0, mp)[:, None])
                    parts.append((mp, p.sum(axis=1), p @ vt[w * wn:(w + 1) * wn]))
                m_new2 = np.maximum(m_old2, np.max([mp for mp, _, _ in parts], axis=0))
                base = np.where(np.isneginf(m_new2), 0.0, m_new2)
                a = l_old * _exp2(m_old2 - base)
                l_new, acc = a.copy(), a[:, None] * o_old
                for mp, lp, pv in parts:
                    c = _exp2(mp - base)
                    l_new, acc = l_new + c * lp, acc + c[:, None] * pv
            else:  # split-Q: the row's running max is known before the exponentials
                m_new2 = np.maximum(m_old2, s.max(axis=1) * sl2)
                base = np.where(np.isneginf(m_new2), 0.0, m_new2)
                a = l_old * _exp2(m_old2 - base)
                p = _exp2(s * sl2 - base[:, None])
                l_new, acc = a + p.sum(axis=1), a[:, None] * o_old + p @ vt
            o_new = acc * np.where(l_new > 0, 1 / np.where(l_new > 0, l_new, 1), 0)[:, None]
            r = rows[ok]
            if n == n_last:
                out[r] = o_new[ok]
                pos = l_new[ok] > 0
                lse[r] = np.where(pos, (base[ok] + np.log2(np.where(pos, l_new[ok], 1))) * LN2, -np.inf)
            else:
                o_acc[r] = o_new[ok]
            m[r], l[r] = m_new2[ok] * LN2, l_new[ok]
    return out, lse, m, l


def model_backward(dout, q, k, v, o, m, l, scale, causal, tile):
    """flash_v1_bwd_kernel + convert for one (batch, head). Returns dq, dk, dv."""
    (sq, d), sk = q.shape, k.shape[0]
    bm, bn = tile.block_m, tile.block_n
    diag, num_m, num_n, sl2 = sk - sq, _cdiv(sq, bm), _cdiv(sk, bn), scale * LOG2E
    dq_acc = np.zeros((num_m * bm, d))  # zero-initialised, rows padded to whole tiles
    dk, dv = np.full((sk, d), np.nan), np.full((sk, d), np.nan)
    for n in range(num_n):
        n0 = n * bn
        m_begin = (n0 - diag) // bm if causal and n0 - diag > 0 else 0
        kt, vt = _tile(k, n0, bn), _tile(v, n0, bn)
        acc_dk, acc_dv = np.zeros((bn, d)), np.zeros((bn, d))
        for mb in range(m_begin, num_m):
            m0 = mb * bm
            rows = np.arange(m0, m0 + bm)
            qt, dot, ot = _tile(q, m0, bm), _tile(dout, m0, bm), _tile(o, m0, bm)
            mt, lt = _tile(m, m0, bm), _tile(l, m0, bm)  # padding rows read as m = l = 0
            no_key = ~(lt > 0) | np.isneginf(mt)
            m2 = np.where(no_key, np.inf, mt * LOG2E)
            inv_l = np.where(no_key, 0.0, 1 / np.where(no_key, 1.0, lt))
            delta = (dot * ot).sum(axis=1)
            st = kt @ qt.T  # S^T [bn, bm]
            keys = np.arange(n0, n0 + bn)[:, None]
            st[(keys >= sk) | (causal & (keys > rows[None] + diag))] = -np.inf
            pt = _exp2(st * sl2 - m2[None]) * inv_l[None]
            acc_dv += pt @ dot
            dst = pt * (vt @ dot.T - delta[None])
            acc_dk += dst @ qt
            dq_acc[m0:m0 + bm] += dst.T @ kt
        nr = min(bn, sk - n0)
        dk[n0:n0 + nr], dv[n0:n0 + nr] = scale * acc_dk[:nr], acc_dv[:nr]
    return scale * dq_acc[:sq], dk, dv


MODEL_SHAPES = [(1, 1), (17, 17), (17, 300), (300, 17), (300, 300), (100, 33), (33, 100), (5, 3), (200, 1),
                (1, 200), (130, 257)]


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", MODEL_SHAPES)
def test_schedule_model_matches_reference(d, causal, sq, sk):
    rng = np.random.default_rng(sq * 1000 + sk + d + causal)
    q = 2 * rng.standard_normal((1, sq, 1, d))
    k = 2 * rng.standard_normal((1, sk, 1, d))
    val = rng.standard_normal((1, sk, 1, d))
    dout = rng.standard_normal((1, sq, 1, d))
    scale = d ** -0.5
    ref_o, ref_lse = reference.attention_forward(q, k, val, scale, causal)
    ref_g = reference.attention_backward(dout, q, k, val, scale, causal)
    q2, k2, v2, do2 = q[0, :, 0], k[0, :, 0], val[0, :, 0], dout[0, :, 0]
    for split in ("k", "q"):
        out, lse, m, l = model_forward(q2, k2, v2, scale, causal, v1.FWD_TILES[split][d], split)
        for x in (out, lse, m, l):
            assert not np.isnan(x).any(), f"split-{split}: an output row was never written"
        np.testing.assert_allclose(out, ref_o[0, :, 0], atol=1e-12)
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse[0, 0]))
        np.testing.assert_array_equal(np.isneginf(m), np.isneginf(ref_lse[0, 0]))
        fin = np.isfinite(ref_lse[0, 0])
        np.testing.assert_allclose(lse[fin], ref_lse[0, 0][fin], atol=1e-12)
        np.testing.assert_allclose(m[fin] + np.log(l[fin]), ref_lse[0, 0][fin], atol=1e-12)
        for mm, ll in ((m, l), (lse, np.ones(sq))):  # backward from (m, l) and from (LSE, 1)
            grads = model_backward(do2, q2, k2, v2, out, mm, ll, scale, causal, v1.BWD_TILES[d])
            for g, r in zip(grads, ref_g):
                assert not np.isnan(g).any()
                np.testing.assert_allclose(g, r[0, :, 0], atol=1e-10)
