"""CPU tests of the backward's two warp partitions (cuda_src/flash_bwd.cu, template argument PARTITION;
`warp_partition="kv"` / `"q"` / `"2d"`, and `"auto"`), no GPU needed:

* the argument is validated (ValueError naming it) before any input is looked at, at every entry point;
* every configuration of both partitions is listed by `all_specs()` (so CI compiles it for sm_80 / sm_90 and
  rejects spills: tests/test_compile.py), fits sm_80's shared memory, and has the shape the kernel asserts;
* a lane-level float64 emulation of `flash_bwd_kernel` -- `ldmatrix` / `ldmatrix.trans` addressing per lane,
  `mma.sync` fragment layouts, shared memory poisoned with NaN, every index expression transliterated from
  the CUDA source -- run with the configured tiles of both partitions and every dQ strategy reproduces the
  float64 reference: the index math of both partitions is checked without a GPU. The emulation mirrors the
  kernel line by line; a change to the kernel's indexing must be made here too (the GPU tests in
  tests/test_flash_bwd.py check the kernel itself).
"""
import numpy as np
import pytest

import cuflash
from cuflash import _configs, reference
from cuflash import backward as bwd_mod
from cuflash._configs import BWD_TILES, BWD_TILES_Q, BwdTile, bwd_convert_spec, bwd_spec, bwd_tiles
from cuflash._interop import CUPY, Arr

SM80_MAX_SMEM = 163 * 1024


# ---------------------------------------------------------------------------------------------- validation
def _view(shape, dtype="float16"):
    strides, acc = [], 1
    for s in reversed(shape):
        strides.insert(0, acc)
        acc *= s
    return Arr(CUPY, None, 0x10000, tuple(shape), tuple(strides), dtype, 0)


@pytest.mark.parametrize("bad", ["k", "Q", "rows", None, 1])
def test_bad_warp_partition_refused_at_every_entry_point(bad):
    with pytest.raises(ValueError, match="warp_partition must be one of"):
        cuflash.flash_attn_backward(None, None, None, None, None, None, warp_partition=bad)
    with pytest.raises(ValueError, match="warp_partition must be one of"):
        cuflash.flash_attn_func(None, None, None, warp_partition=bad)
    q, kv = _view((1, 16, 2, 64)), _view((1, 16, 2, 64))
    with pytest.raises(ValueError, match="warp_partition must be one of"):
        bwd_mod.backward(q, q, kv, kv, q, None, None, False, warp_partition=bad)


def test_q_partition_is_a_v2_option():
    with pytest.raises(ValueError, match="warp_partition.*v1"):
        cuflash.flash_attn_backward(None, None, None, None, None, None, algorithm="v1", warp_partition="q")
    with pytest.raises(ValueError, match="warp_partition.*v1"):
        cuflash.flash_attn_func(None, None, None, algorithm="v1", warp_partition="q")


def test_unsupported_head_dim_of_a_partition_names_it(monkeypatch):
    monkeypatch.delitem(BWD_TILES_Q, 256)
    q = _view((1, 16, 2, 256))
    with pytest.raises(ValueError, match="warp_partition='q' does not support head dim 256"):
        bwd_mod.backward(q, q, q, q, q, None, None, False, warp_partition="q")


# ------------------------------------------------------------------------------------------------ configs
@pytest.mark.parametrize("part", ["kv", "q", "2d"])
def test_every_partition_config_is_listed_and_fits(part):
    specs = _configs.all_specs()
    for dt in _configs.DTYPES:
        for d, tile in bwd_tiles(part).items():
            for causal in (False, True):
                s = bwd_spec(dt, d, causal, warp_partition=part)
                assert s in specs
                assert bwd_convert_spec(dt, d, causal, tile.block_n) in specs
                assert s.smem <= SM80_MAX_SMEM, (s.name, s.smem)
                assert s.threads == 32 * tile.nwarps
                assert s.name.endswith(f", {s.smem}, {_configs.BWD_PARTITIONS[part]}, {tile.kunroll}>")
                if part == "2d":
                    wm = tile.block_m // 32
                    assert tile.block_m % 32 == 0 and tile.block_n % 32 == 0 and tile.dsplit == 1
                    assert tile.nwarps % wm == 0 and (tile.block_n // (tile.nwarps // wm)) % 16 == 0
                    assert tile.nwarps % (tile.block_n // 32) == 0 and (d // (tile.nwarps // (tile.block_n // 32))) % 16 == 0
                    assert 128 % tile.block_m == 0
                elif part == "q":
                    assert tile.block_m == 16 * tile.nwarps and tile.dsplit == 1
                    assert 128 % tile.block_m == 0  # fp32 row buffers are padded to 128 rows
                else:
                    assert tile.block_n * tile.dsplit == 16 * tile.nwarps
    assert set(bwd_tiles("q")) == set(_configs.HEADDIMS)


def test_sm90_tiles_are_listed_and_fit_sm90_only():
    """BWD_TILES_2D_SM90: what bwd_tiles("2d", 90) returns (sm_80 keeps BWD_TILES_2D); listed in all_specs() with
    min_arch 90, so CI compiles them for sm_90 only, and within sm_90's 227 KB of shared memory."""
    specs = _configs.all_specs()
    assert bwd_tiles("2d", 80) == _configs.BWD_TILES_2D and bwd_tiles("2d", 86) == _configs.BWD_TILES_2D
    assert bwd_tiles("kv", 90) == _configs.BWD_TILES and bwd_tiles("q", 90) == _configs.BWD_TILES_Q
    t90 = bwd_tiles("2d", 90)
    assert set(t90) == set(_configs.BWD_TILES_2D) and t90 == bwd_tiles("2d", 90, "float16")
    for dt in _configs.DTYPES:
        for d in _configs.BWD_TILES_2D_SM90:
            tile = bwd_tiles("2d", 90, dt)[d]
            assert tile == _configs.BWD_TILES_2D_SM90_DTYPE.get(dt, {}).get(d, _configs.BWD_TILES_2D_SM90[d])
            assert tile.dq_bulk and _configs.bwd_do_stages(d, tile, "2d") == 2
            base = _configs.BWD_TILES_2D[d]
            assert (tile.block_m, tile.block_n, tile.nwarps) == (base.block_m, base.block_n, base.nwarps)
            for causal in (False, True):
                s = bwd_spec(dt, d, causal, tile, "2d")
                assert s in specs and s.min_arch == 90 and s.smem <= 227 * 1024
                # staging (block_m x d fp32) + a second dO buffer on top of the sm_80 layout
                s80 = bwd_spec(dt, d, causal, base, "2d")
                assert s80.min_arch == 80
                extra_do = (tile.block_m * (d + _configs.SMEM_ROW_PAD) * 2
                            if _configs.bwd_do_stages(d, base, "2d") == 1 else 0)
                assert s.smem == s80.smem + tile.block_m * d * 4 + extra_do
                assert s.name.endswith(f", {s.smem}, 2, {tile.kunroll}{_configs._bwd_name_extras(tile)}>")
                assert _configs._bwd_name_extras(tile).startswith(", true, ")
    assert all(s.smem <= SM80_MAX_SMEM for s in specs if s.min_arch == 80)  # what sm_80 compiles fits it


def test_bwd_name_extras_trim_trailing_defaults():
    """The backward kernel's trailing template arguments (DQ_BULK, P_REGS, LOAD_AT, EXP_IL) are written up to the
    last one that differs from its default, so each configuration has exactly one name."""
    from dataclasses import replace

    base = _configs.BwdTile(128, 128, 8, 1, 4)
    assert _configs._bwd_name_extras(base) == ""
    assert _configs._bwd_name_extras(replace(base, dq_bulk=True)) == ", true"
    assert _configs._bwd_name_extras(replace(base, p_regs=True)) == ", false, true"
    assert _configs._bwd_name_extras(replace(base, dq_bulk=True, load_at=1)) == ", true, false, 1"
    assert _configs._bwd_name_extras(replace(base, dq_bulk=True, p_regs=True, load_at=2)) == ", true, true, 2"
    assert _configs._bwd_name_extras(replace(base, p_regs=True, exp_il=True)) == ", false, true, 0, true"


def test_auto_partition_resolves_per_head_dim():
    for d in _configs.HEADDIMS:
        part = bwd_mod.resolve_warp_partition("auto", d)
        assert part == _configs.BWD_AUTO_PARTITION.get(d, "kv") and d in bwd_tiles(part)
    assert bwd_mod.resolve_warp_partition("auto", 128) == "2d"
    assert bwd_mod.resolve_warp_partition("q", 128) == "q"
    bwd_mod.check_warp_partition("auto", 256)  # every head dim has an "auto" partition
    bwd_mod.check_warp_partition("auto", algorithm="v1")  # the default is fine with the V1 kernels
    with pytest.raises(ValueError, match="warp_partition='2d' does not support head dim 256"):
        bwd_mod.check_warp_partition("2d", 256)


def test_default_partition_is_unchanged():
    assert bwd_spec("float16", 64, True) == bwd_spec("float16", 64, True, BWD_TILES[64], "kv")


# ------------------------------------------------------------------------------ lane-level kernel emulation
LANE = np.arange(32)
G, T = LANE // 4, LANE % 4


def ldmatrix_x4(smem, addr, trans=False):
    """ldmatrix.sync.aligned.m8n8.x4[.trans].b16: lanes 8j..8j+7 give the row addresses (element offsets) of
    matrix j; r[lane, j] = (row g, cols 2t, 2t+1) of matrix j, or (rows 2t, 2t+1; col g) with .trans."""
    r = np.empty((32, 4, 2))
    for j in range(4):
        if trans:
            r[:, j, 0], r[:, j, 1] = smem[addr[8 * j + 2 * T] + G], smem[addr[8 * j + 2 * T + 1] + G]
        else:
            rows = addr[8 * j + G]
            r[:, j, 0], r[:, j, 1] = smem[rows + 2 * T], smem[rows + 2 * T + 1]
    return r


def mma(d, a, b0, b1):
    """mma.sync.m16n8k16: d (32, 4) + A B from the lanes' fragments (common/ptx.cuh layouts); every element of
    A and B must be provided (and no NaN: unwritten shared memory is NaN)."""
    A, B = np.full((16, 16), np.nan), np.full((16, 8), np.nan)
    for reg, (dr, dc) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
        A[G + dr, 2 * T + dc], A[G + dr, 2 * T + dc + 1] = a[:, reg, 0], a[:, reg, 1]
    B[2 * T, G], B[2 * T + 1, G], B[2 * T + 8, G], B[2 * T + 9, G] = b0[:, 0], b0[:, 1], b1[:, 0], b1[:, 1]
    assert not np.isnan(A).any() and not np.isnan(B).any(), "mma operand read unwritten shared memory"
    C = A @ B
    return d + np.stack([C[G, 2 * T], C[G, 2 * T + 1], C[G + 8, 2 * T], C[G + 8, 2 * T + 1]], axis=1)


def zeros(nf):
    return np.zeros((nf, 32, 4))


def gemm_rows_rows_t(acc, smem, x_rows, y_tile, lds, KD, NF):
    for kd in range(KD):
        a = ldmatrix_x4(smem, x_rows + (LANE % 16) * lds + kd * 16 + (LANE // 16) * 8)
        for nf in range(0, NF, 2):
            b = ldmatrix_x4(smem, y_tile + (nf * 8 + (LANE % 8) + (LANE // 16) * 8) * lds + kd * 16 +
                            ((LANE // 8) % 2) * 8)
            acc[nf], acc[nf + 1] = mma(acc[nf], a, b[:, 0], b[:, 1]), mma(acc[nf + 1], a, b[:, 2], b[:, 3])


def gemm_smem_at_b(acc, smem, a_t, lda, a_col0, b_tile, ldb, b_col0, KS, NF):
    for ks in range(KS):
        a = ldmatrix_x4(smem, a_t + (ks * 16 + (LANE % 8) + (LANE // 16) * 8) * lda + a_col0 + ((LANE // 8) % 2) * 8,
                        True)
        for nf in range(0, NF, 2):
            br = ks * 16 + (LANE % 8) + ((LANE // 8) % 2) * 8
            b = ldmatrix_x4(smem, b_tile + br * ldb + b_col0 + nf * 8 + (LANE // 16) * 8, True)
            acc[nf], acc[nf + 1] = mma(acc[nf], a, b[:, 0], b[:, 1]), mma(acc[nf + 1], a, b[:, 2], b[:, 3])


def gemm_smem(acc, smem, a, lda, b, ldb, MF, NF, KS, a_kmajor, b_kmajor):  # flash_bwd.cu (PART_2D)
    for ks in range(KS):
        af = []
        for mf in range(MF):
            if a_kmajor:
                af.append(ldmatrix_x4(smem, a + (ks * 16 + (LANE % 8) + (LANE // 16) * 8) * lda + mf * 16 +
                                      ((LANE // 8) % 2) * 8, True))
            else:
                af.append(ldmatrix_x4(smem, a + (mf * 16 + LANE % 16) * lda + ks * 16 + (LANE // 16) * 8))
        for nf in range(0, NF, 2):
            if b_kmajor:
                b_ = ldmatrix_x4(smem, b + (ks * 16 + (LANE % 8) + ((LANE // 8) % 2) * 8) * ldb + nf * 8 +
                                 (LANE // 16) * 8, True)
            else:
                b_ = ldmatrix_x4(smem, b + (nf * 8 + (LANE % 8) + (LANE // 16) * 8) * ldb + ks * 16 +
                                 ((LANE // 8) % 2) * 8)
            for mf in range(MF):
                acc[mf][nf] = mma(acc[mf][nf], af[mf], b_[:, 0], b_[:, 1])
                acc[mf][nf + 1] = mma(acc[mf][nf + 1], af[mf], b_[:, 2], b_[:, 3])


def gemm_a_regs_b_trans(acc, a_regs, smem, b_tile, lds, col0, KS, NF):  # common/warp_gemm.cuh
    for k in range(KS):
        for f in range(0, NF, 2):
            b = ldmatrix_x4(smem, b_tile + (k * 16 + (LANE % 8) + ((LANE // 8) % 2) * 8) * lds + col0 + f * 8 +
                            (LANE // 16) * 8, True)
            acc[f], acc[f + 1] = mma(acc[f], a_regs[k], b[:, 0], b[:, 1]), mma(acc[f + 1], a_regs[k], b[:, 2], b[:, 3])


def frags_to_a(c, KS):  # common/warp_gemm.cuh (no rounding: the emulation checks indices, not precision)
    a = np.empty((KS, 32, 4, 2))
    for k in range(KS):
        a[k, :, 0], a[k, :, 1] = c[2 * k][:, 0:2], c[2 * k][:, 2:4]
        a[k, :, 2], a[k, :, 3] = c[2 * k + 1][:, 0:2], c[2 * k + 1][:, 2:4]
    return a


def store_a_frags(smem, tile, lds, row0, a, KS):
    for k in range(KS):
        r0 = tile + (row0 + G) * lds + k * 16 + 2 * T
        r8 = tile + (row0 + G + 8) * lds + k * 16 + 2 * T
        for base, reg, off in ((r0, 0, 0), (r8, 1, 0), (r0, 2, 8), (r8, 3, 8)):
            smem[base + off], smem[base + off + 1] = a[k, :, reg, 0], a[k, :, reg, 1]


def load_tile(smem, tile, rows, row0, nrows, ROWS, D, LDS):  # load_tile_async: zero-fill past nrows
    for r in range(ROWS):
        smem[tile + r * LDS: tile + r * LDS + D] = rows[row0 + r] if row0 + r < nrows else 0.0


def dq_accumulate(p, a0, acc, D, NF):
    """a0: each lane's 16-byte slot of the first fragment (fragment-tiled accumulator, flash_bwd.cu "Layout")."""
    for df in range(NF):
        a = a0 + df * 128
        assert len(set(a.tolist())) == 32 and (a % 4 == 0).all() and (a + 3 < p.dq_accum.size).all()
        for e in range(4):
            if p.dq_strategy == 1:  # seqpar: plain stores, each element of a buffer written once
                assert np.isnan(p.dq_accum[a + e]).all(), "seqpar buffer element written twice"
                p.dq_accum[a + e] = acc[df][:, e]
            else:  # atomic / loop: add
                p.dq_accum[a + e] += acc[df][:, e]


def dq_band(p, split, batch, hq, row0, D):
    """dq_accum_band: each lane's slot in the first fragment of the 16-row band at row0."""
    assert row0 % 16 == 0
    return (((split * p.batch + batch) * p.nheads + hq) * p.seqlen_q_pad + row0) * D + 4 * LANE


def dq_untile(acc, D):
    """[..., sq_pad * D] fragment-tiled -> [..., sq_pad, D] row-major: (band, col block, g, t, row half, x)."""
    lead = acc.shape[:-1]
    x = acc.reshape(*lead, -1, D // 8, 8, 4, 2, 2)  # band, cb, g, t, hh, x
    n = x.ndim
    x = np.moveaxis(x, (n - 6, n - 2, n - 4, n - 5, n - 3, n - 1), range(n - 6, n))  # band, hh, g, cb, t, x
    return x.reshape(*lead, -1, D)


def store_dkdv(p, batch, kv_head, j0, c0, dk, dv, NF):
    for h in range(2):
        j = j0 + G + h * 8
        for df in range(NF):
            c = c0 + df * 8 + 2 * T
            for lane in np.nonzero(j < p.seqlen_k)[0]:
                for x in range(2):
                    assert np.isnan(p.dk[batch, j[lane], kv_head, c[lane] + x]), "dK element written twice"
                    p.dk[batch, j[lane], kv_head, c[lane] + x] = dk[df][lane, 2 * h + x] * p.softmax_scale
                    p.dv[batch, j[lane], kv_head, c[lane] + x] = dv[df][lane, 2 * h + x]


def emulate_kernel(p, grid_x, D, BLOCK_M, BLOCK_N, NWARPS, DSPLIT, CAUSAL, PARTITION):
    """flash_bwd_kernel, every block; warps run one after the other between barriers."""
    QPART, P2D = PARTITION == 1, PARTITION == 2
    LDS, KD, KQ, KN = D + 8, D // 16, BLOCK_M // 16, BLOCK_N // 16
    if P2D:
        CB, RBW = NWARPS // (BLOCK_N // 32), 2
    else:
        CB = (16 * NWARPS // BLOCK_N if 16 * NWARPS >= BLOCK_N else 1) if QPART else DSPLIT
        RBW = (BLOCK_N // (16 * NWARPS) if BLOCK_N > 16 * NWARPS else 1) if QPART else 1
    DCOLS = D // CB
    DFO = DCOLS // 8
    assert RBW * 16 * (NWARPS // CB) == BLOCK_N and NWARPS % CB == 0 and DCOLS % 16 == 0
    DQ_ROW_BANDS = BLOCK_M // 16
    DQ_COLS = D // (1 if QPART or P2D else NWARPS // DQ_ROW_BANDS)
    DQF = DQ_COLS // 8
    DQ_CHUNK = D if D < 32 else 32
    LDS_DS, LDS_PS = BLOCK_M + 8, BLOCK_N + 8
    part_name = {0: "kv", 1: "q", 2: "2d"}[PARTITION]
    DO_STAGES = _configs.bwd_do_stages(D, BwdTile(BLOCK_M, BLOCK_N, NWARPS, DSPLIT), part_name)
    k_smem = 0
    v_smem = k_smem + BLOCK_N * LDS
    q_smem = v_smem + BLOCK_N * LDS
    do_smem = q_smem + 2 * BLOCK_M * LDS
    xc_smem = do_smem + DO_STAGES * BLOCK_M * LDS
    smem_elems = xc_smem + (2 * BLOCK_M * LDS_PS if QPART or P2D else BLOCK_N * LDS_DS)
    seqlen_q, seqlen_k, group = p.seqlen_q, p.seqlen_k, p.heads_per_kv
    diag = seqlen_k - seqlen_q
    num_n_blocks, num_m_blocks = -(-seqlen_k // BLOCK_N), -(-seqlen_q // BLOCK_M)
    sl2 = p.scale_log2
    for batch, kv_head, bx in np.ndindex(p.batch, p.nheads // group, grid_x):
        smem = np.full(smem_elems, np.nan)
        lse_smem, delta_smem = np.full(2 * BLOCK_M, np.nan), np.full(2 * BLOCK_M, np.nan)

        def load_do_tile(stage, hq, m0):
            load_tile(smem, do_smem + stage * BLOCK_M * LDS, p.do[batch, :, hq], m0, seqlen_q, BLOCK_M, D, LDS)

        def load_q_tile(stage, hq, m0, load_do=True):
            load_tile(smem, q_smem + stage * BLOCK_M * LDS, p.q[batch, :, hq], m0, seqlen_q, BLOCK_M, D, LDS)
            if load_do:
                load_do_tile(stage, hq, m0)
            lse_smem[stage * BLOCK_M:(stage + 1) * BLOCK_M] = p.lse_log2[batch, hq, m0:m0 + BLOCK_M]
            delta_smem[stage * BLOCK_M:(stage + 1) * BLOCK_M] = p.delta[batch, hq, m0:m0 + BLOCK_M]

        for n_block in range(bx, num_n_blocks, grid_x):
            n0 = n_block * BLOCK_N
            m_begin = (n0 - diag) // BLOCK_M if CAUSAL and n0 - diag > 0 else 0
            num_m = max(0, num_m_blocks - m_begin)
            total = group * num_m

            def tile_of(i):  # iteration i's (query head, Q tile row)
                return kv_head * group + i // num_m, (m_begin + i % num_m) * BLOCK_M
            acc_dk = [[zeros(DFO) for _ in range(RBW)] for _ in range(NWARPS)]
            acc_dv = [[zeros(DFO) for _ in range(RBW)] for _ in range(NWARPS)]
            if total > 0:
                load_tile(smem, k_smem, p.k[batch, :, kv_head], n0, seqlen_k, BLOCK_N, D, LDS)
                load_tile(smem, v_smem, p.v[batch, :, kv_head], n0, seqlen_k, BLOCK_N, D, LDS)
                load_q_tile(0, *tile_of(0))
            stage = 0
            for it in range(total):
                if it + 1 < total:  # after barrier 1: the next Q tile into the other stage
                    load_q_tile(stage ^ 1, *tile_of(it + 1), DO_STAGES == 2)
                hq, m0 = tile_of(it)
                q_tile = q_smem + stage * BLOCK_M * LDS
                do_tile = do_smem + (stage if DO_STAGES == 2 else 0) * BLOCK_M * LDS
                lse_tile, delta_tile = lse_smem[stage * BLOCK_M:], delta_smem[stage * BLOCK_M:]
                split = n_block if p.dq_strategy == 1 else 0
                if P2D:
                    WM_S = BLOCK_M // 32
                    WN_S = NWARPS // WM_S
                    KW = BLOCK_N // WN_S
                    NFS = KW // 8
                    WM_Q = WM_S if (D // (NWARPS // WM_S)) % 16 == 0 else BLOCK_M // 16
                    WD_Q = NWARPS // WM_Q
                    MFQ, DQC = BLOCK_M // (16 * WM_Q), D // WD_Q
                    DQ_CH = min(DQC, 64)
                    assert WM_S * WN_S == NWARPS and KW % 16 == 0 and WM_Q * WD_Q == NWARPS and DQC % 16 == 0
                    p_smem, ds_smem = xc_smem, xc_smem + BLOCK_M * LDS_PS
                    for warp in range(NWARPS):
                        qr0, kc0 = (warp // WN_S) * 32, (warp % WN_S) * KW
                        acc = [zeros(NFS) for _ in range(2)]
                        gemm_smem(acc, smem, q_tile + qr0 * LDS, LDS, k_smem + kc0 * LDS, LDS, 2, NFS, KD, False, False)
                        klim, dlim = seqlen_k - (n0 + kc0), m0 + qr0 + diag - (n0 + kc0)
                        need_mask = KW > klim or (CAUSAL and KW - 1 > dlim)
                        for mf in range(2):
                            lse_g, lse_g8 = lse_tile[qr0 + mf * 16 + G], lse_tile[qr0 + mf * 16 + G + 8]
                            for nf, e in np.ndindex(NFS, 4):
                                x = acc[mf][nf][:, e].copy()
                                if need_mask:
                                    c = nf * 8 + 2 * T + (e % 2)
                                    r = mf * 16 + G + (e // 2) * 8
                                    x[(c >= klim) | (CAUSAL & (c > r + dlim))] = -np.inf
                                acc[mf][nf][:, e] = np.exp2(x * sl2 - (lse_g8 if e // 2 else lse_g))
                            store_a_frags(smem, p_smem + kc0, LDS_PS, qr0 + mf * 16, frags_to_a(acc[mf], NFS // 2),
                                          NFS // 2)
                        acc = [zeros(NFS) for _ in range(2)]
                        gemm_smem(acc, smem, do_tile + qr0 * LDS, LDS, v_smem + kc0 * LDS, LDS, 2, NFS, KD, False, False)
                        for mf in range(2):
                            dl_g, dl_g8 = delta_tile[qr0 + mf * 16 + G], delta_tile[qr0 + mf * 16 + G + 8]
                            p_g = p_smem + (qr0 + mf * 16 + G) * LDS_PS + kc0 + 2 * T
                            p_g8 = p_g + 8 * LDS_PS
                            for nf in range(NFS):
                                acc[mf][nf][:, 0] = smem[p_g + nf * 8] * (acc[mf][nf][:, 0] - dl_g)
                                acc[mf][nf][:, 1] = smem[p_g + nf * 8 + 1] * (acc[mf][nf][:, 1] - dl_g)
                                acc[mf][nf][:, 2] = smem[p_g8 + nf * 8] * (acc[mf][nf][:, 2] - dl_g8)
                                acc[mf][nf][:, 3] = smem[p_g8 + nf * 8 + 1] * (acc[mf][nf][:, 3] - dl_g8)
                            store_a_frags(smem, ds_smem + kc0, LDS_PS, qr0 + mf * 16, frags_to_a(acc[mf], NFS // 2),
                                          NFS // 2)
                    for warp in range(NWARPS):  # after barrier 2: dV
                        band0, cband = (warp // CB) * RBW, warp % CB
                        gemm_smem(acc_dv[warp], smem, p_smem + band0 * 16, LDS_PS, do_tile + cband * DCOLS, LDS, 2, DFO,
                                  KQ, True, True)
                    if DO_STAGES == 1:  # after barrier 3: the next dO tile; poison what it replaces if none
                        if it + 1 < total:
                            load_do_tile(0, *tile_of(it + 1))
                        else:
                            smem[do_smem:do_smem + BLOCK_M * LDS] = np.nan
                    for warp in range(NWARPS):  # dK, dQ
                        band0, cband = (warp // CB) * RBW, warp % CB
                        gemm_smem(acc_dk[warp], smem, ds_smem + band0 * 16, LDS_PS, q_tile + cband * DCOLS, LDS, 2, DFO,
                                  KQ, True, True)
                        dq_r0, dq_c0 = (warp // WD_Q) * 16 * MFQ, (warp % WD_Q) * DQC
                        band = dq_band(p, split, batch, hq, m0 + dq_r0, D)
                        for c0 in range(0, DQC, DQ_CH):
                            acc_dq = [zeros(DQ_CH // 8) for _ in range(MFQ)]
                            gemm_smem(acc_dq, smem, ds_smem + dq_r0 * LDS_PS, LDS_PS, k_smem + dq_c0 + c0, LDS, MFQ,
                                      DQ_CH // 8, KN, False, True)
                            for mf in range(MFQ):
                                dq_accumulate(p, band + mf * 16 * D + 16 * (dq_c0 + c0), acc_dq[mf], D, DQ_CH // 8)
                elif not QPART:
                    NFQ = BLOCK_M // 8
                    ds_smem = xc_smem
                    for warp in range(NWARPS):
                        wk, wd = (warp // CB) * RBW, warp % CB
                        acc = zeros(NFQ)
                        gemm_rows_rows_t(acc, smem, k_smem + wk * 16 * LDS, q_tile, LDS, KD, NFQ)
                        need_mask = n0 + BLOCK_N > seqlen_k or (CAUSAL and n0 + BLOCK_N - 1 > m0 + diag)
                        for nf, e in np.ndindex(NFQ, 4):
                            x = acc[nf][:, e].copy()
                            if need_mask:
                                j = n0 + wk * 16 + G + (e // 2) * 8
                                i = m0 + nf * 8 + 2 * T + (e % 2)
                                x[(j >= seqlen_k) | (CAUSAL & (j > i + diag))] = -np.inf
                            acc[nf][:, e] = np.exp2(x * sl2 - lse_tile[nf * 8 + 2 * T + (e % 2)])
                        pa = frags_to_a(acc, KQ)
                        gemm_a_regs_b_trans(acc_dv[warp][0], pa, smem, do_tile, LDS, wd * DCOLS, KQ, DFO)
                        acc = zeros(NFQ)
                        gemm_rows_rows_t(acc, smem, v_smem + wk * 16 * LDS, do_tile, LDS, KD, NFQ)
                        for nf in range(NFQ):
                            dl = delta_tile[nf * 8 + 2 * T], delta_tile[nf * 8 + 2 * T + 1]
                            p01, p23 = pa[nf // 2][:, (nf % 2) * 2], pa[nf // 2][:, (nf % 2) * 2 + 1]
                            for e, (pp, dd) in enumerate(((p01[:, 0], dl[0]), (p01[:, 1], dl[1]), (p23[:, 0], dl[0]),
                                                          (p23[:, 1], dl[1]))):
                                acc[nf][:, e] = pp * (acc[nf][:, e] - dd)
                        dsa = frags_to_a(acc, KQ)
                        if wd == 0:
                            store_a_frags(smem, ds_smem, LDS_DS, wk * 16, dsa, KQ)
                        gemm_a_regs_b_trans(acc_dk[warp][0], dsa, smem, q_tile, LDS, wd * DCOLS, KQ, DFO)
                    for warp in range(NWARPS):  # after barrier 2
                        dq_rb, dq_cb = warp % DQ_ROW_BANDS, warp // DQ_ROW_BANDS
                        acc_dq = zeros(DQF)
                        gemm_smem_at_b(acc_dq, smem, ds_smem, LDS_DS, dq_rb * 16, k_smem, LDS, dq_cb * DQ_COLS, KN, DQF)
                        a0 = dq_band(p, split, batch, hq, m0 + dq_rb * 16, D) + 16 * dq_cb * DQ_COLS
                        dq_accumulate(p, a0, acc_dq, D, DQF)
                else:
                    NFK = BLOCK_N // 8
                    p_smem, ds_smem = xc_smem, xc_smem + BLOCK_M * LDS_PS
                    for warp in range(NWARPS):
                        r0 = warp * 16
                        if m0 + r0 < seqlen_q and not (CAUSAL and m0 + r0 + 15 + diag < n0):
                            acc = zeros(NFK)
                            gemm_rows_rows_t(acc, smem, q_tile + r0 * LDS, k_smem, LDS, KD, NFK)
                            need_mask = n0 + BLOCK_N > seqlen_k or (CAUSAL and n0 + BLOCK_N - 1 > m0 + r0 + diag)
                            lse_g, lse_g8 = lse_tile[r0 + G], lse_tile[r0 + G + 8]
                            for nf, e in np.ndindex(NFK, 4):
                                x = acc[nf][:, e].copy()
                                if need_mask:
                                    j = n0 + nf * 8 + 2 * T + (e % 2)
                                    i = m0 + r0 + G + (e // 2) * 8
                                    x[(j >= seqlen_k) | (CAUSAL & (j > i + diag))] = -np.inf
                                acc[nf][:, e] = np.exp2(x * sl2 - (lse_g8 if e // 2 else lse_g))
                            store_a_frags(smem, p_smem, LDS_PS, r0, frags_to_a(acc, KN), KN)
                            acc = zeros(NFK)
                            gemm_rows_rows_t(acc, smem, do_tile + r0 * LDS, v_smem, LDS, KD, NFK)
                            dl_g, dl_g8 = delta_tile[r0 + G], delta_tile[r0 + G + 8]
                            p_g = p_smem + (r0 + G) * LDS_PS + 2 * T  # uint32_t word nf * 4 = element nf * 8
                            p_g8 = p_smem + (r0 + G + 8) * LDS_PS + 2 * T
                            for nf in range(NFK):
                                acc[nf][:, 0] = smem[p_g + nf * 8] * (acc[nf][:, 0] - dl_g)
                                acc[nf][:, 1] = smem[p_g + nf * 8 + 1] * (acc[nf][:, 1] - dl_g)
                                acc[nf][:, 2] = smem[p_g8 + nf * 8] * (acc[nf][:, 2] - dl_g8)
                                acc[nf][:, 3] = smem[p_g8 + nf * 8 + 1] * (acc[nf][:, 3] - dl_g8)
                            dsa = frags_to_a(acc, KN)
                            store_a_frags(smem, ds_smem, LDS_PS, r0, dsa, KN)
                            band = dq_band(p, split, batch, hq, m0 + r0, D)
                            for c0 in range(0, D, DQ_CHUNK):
                                acc_dq = zeros(DQ_CHUNK // 8)
                                gemm_a_regs_b_trans(acc_dq, dsa, smem, k_smem, LDS, c0, KN, DQ_CHUNK // 8)
                                dq_accumulate(p, band + 16 * c0, acc_dq, D, DQ_CHUNK // 8)
                        else:
                            for c in range(16 * BLOCK_N // 8):
                                off = (r0 + c // (BLOCK_N // 8)) * LDS_PS + (c % (BLOCK_N // 8)) * 8
                                smem[p_smem + off:p_smem + off + 8] = 0.0
                                smem[ds_smem + off:ds_smem + off + 8] = 0.0
                    for warp in range(NWARPS):  # after barrier 2
                        band0, cband = (warp // CB) * RBW, warp % CB
                        for r in range(RBW):
                            kv_row0 = (band0 + r) * 16
                            gemm_smem_at_b(acc_dv[warp][r], smem, p_smem, LDS_PS, kv_row0, do_tile, LDS, cband * DCOLS,
                                           KQ, DFO)
                            gemm_smem_at_b(acc_dk[warp][r], smem, ds_smem, LDS_PS, kv_row0, q_tile, LDS, cband * DCOLS,
                                           KQ, DFO)
                stage ^= 1
            for warp in range(NWARPS):
                band0, cband = (warp // CB) * RBW, warp % CB
                for r in range(RBW):
                    store_dkdv(p, batch, kv_head, n0 + (band0 + r) * 16, cband * DCOLS, acc_dk[warp][r],
                               acc_dv[warp][r], DFO)


class _Params:
    pass


def emulate_backward(q, k, v, dout, causal, tile, partition, dq_strategy):
    """cuflash/backward.py's host side + preprocess + main kernel (emulated) + convert, in float64."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = d ** -0.5
    out, lse = reference.attention_forward(q, k, v, scale, causal)
    sq_pad = -(-sq // _configs.BWD_ROW_PAD) * _configs.BWD_ROW_PAD
    n_blocks = -(-sk // tile.block_n)
    splits = n_blocks if dq_strategy == 1 else 1
    p = _Params()
    p.batch, p.nheads, p.heads_per_kv, p.seqlen_q, p.seqlen_k, p.seqlen_q_pad = b, h, h // hk, sq, sk, sq_pad
    p.dq_strategy, p.scale_log2, p.softmax_scale = dq_strategy, scale * np.log2(np.e), scale
    p.q, p.k, p.v, p.do = q, k, v, dout
    p.lse_log2, p.delta = np.full((b, h, sq_pad), np.inf), np.zeros((b, h, sq_pad))  # padding rows: +inf, 0
    p.lse_log2[:, :, :sq] = np.where(np.isfinite(lse), lse * np.log2(np.e), np.inf)
    p.delta[:, :, :sq] = np.einsum("bshd,bshd->bhs", out, dout)
    p.dq_accum = np.full(splits * b * h * sq_pad * d, np.nan if dq_strategy == 1 else 0.0)
    p.dk, p.dv = np.full((b, sk, hk, d), np.nan), np.full((b, sk, hk, d), np.nan)
    emulate_kernel(p, 1 if dq_strategy == 2 else n_blocks, d, tile.block_m, tile.block_n, tile.nwarps, tile.dsplit,
                   causal, partition)
    acc = dq_untile(p.dq_accum.reshape(splits, b, h, sq_pad * d), d)
    dq = np.zeros((b, sq, h, d))
    for i in range(sq):  # flash_bwd_convert_dq_kernel: seqpar + causal reads only the tiles row i sees
        n = splits
        if causal and dq_strategy == 1:
            last_key = i + sk - sq
            n = 0 if last_key < 0 else min(n, last_key // tile.block_n + 1)
        dq[:, i] = scale * acc[:n, :, :, i, :].sum(axis=0)
    return dq, p.dk, p.dv


EMU_CASES = [  # (partition, head dim, tile (None: configured), b, sq, sk, h, hk, causal, dq strategy)
    ("q", 32, None, 1, 150, 151, 2, 1, True, 1),   # the band-skip boundary: the last row of a band sees key n0
    ("q", 32, None, 2, 300, 17, 4, 2, False, 0),
    ("q", 64, None, 1, 17, 300, 2, 1, True, 2),
    ("q", 64, None, 1, 257, 129, 3, 1, True, 1),
    ("q", 128, None, 1, 130, 100, 2, 2, False, 1),  # CB = 2: two warps per KV row band
    ("q", 256, None, 1, 40, 70, 2, 1, True, 0),     # CB = 4, BLOCK_N = 16
    ("q", 96, None, 1, 1, 1, 1, 1, False, 2),
    ("q", 32, BwdTile(64, 128, 4, 1), 1, 100, 200, 2, 1, True, 0),  # RBW = 2: a warp owns two KV row bands
    ("kv", 64, None, 1, 130, 200, 4, 2, True, 1),
    ("kv", 128, None, 1, 90, 150, 2, 1, False, 2),
    ("kv", 256, None, 1, 40, 70, 2, 1, True, 0),    # DSPLIT = 2
    ("2d", 64, None, 1, 130, 200, 4, 2, True, 1),   # dO double-buffered
    ("2d", 128, None, 1, 200, 150, 2, 1, True, 0),  # dO single-buffered (barrier 3), several Q tiles
    ("2d", 128, None, 2, 90, 300, 2, 2, False, 2),  # "loop": one block walks every KV tile
    ("2d", 32, None, 1, 17, 129, 2, 1, True, 1),    # dQ in 16-row warp tiles (32 / 4 columns is not a k16)
    ("2d", 96, None, 1, 100, 100, 3, 1, False, 0),  # 16-row dQ tiles, 48-column dK/dV blocks
    ("2d", 64, BwdTile(64, 128, 8, 1, 2), 1, 300, 400, 4, 2, True, 1),  # dO double-buffered, GQA
]


@pytest.mark.parametrize("case", EMU_CASES, ids=lambda c: "-".join(str(x) for x in c if not isinstance(x, BwdTile)))
def test_emulated_kernel_matches_reference(case):
    part, d, tile, b, sq, sk, h, hk, causal, strat = case
    tile = tile or bwd_tiles(part)[d]
    rng = np.random.default_rng(sq * 1000 + sk)
    q, do = rng.standard_normal((b, sq, h, d)), rng.standard_normal((b, sq, h, d))
    k, v = rng.standard_normal((b, sk, hk, d)), rng.standard_normal((b, sk, hk, d))
    ref = reference.attention_backward(do, q, k, v, d ** -0.5, causal)
    got = emulate_backward(q, k, v, do, causal, tile, _configs.BWD_PARTITIONS[part], strat)
    for name, x, r in zip(("dq", "dk", "dv"), got, ref):
        assert not np.isnan(x).any(), f"{name}: element never written"
        np.testing.assert_allclose(x, r, rtol=0, atol=1e-10, err_msg=name)


_BWD_TILE_SCRIPT = r"""
import json, sys
sys.path.insert(0, ROOT)
from bench.diag import host_overhead as ho
torch = ho.install_fakes(record=True)  # device compute capability 9.0, launches recorded, nothing compiled
import cuflash
res = []
for dt in ("float16", "bfloat16"):
    for d in (64, 128):
        for causal in (False, True):
            q, o, do = (torch.Tensor((2, 300, 4, d), getattr(torch, dt)) for _ in range(3))
            k, v = torch.Tensor((2, 300, 2, d), getattr(torch, dt)), torch.Tensor((2, 300, 2, d), getattr(torch, dt))
            lse = torch.Tensor((2, 4, 300), torch.float32)
            ho.LAUNCHES.clear()
            cuflash.flash_attn_backward(do, q, k, v, o, lse, causal=causal, backend="sm80")
            res.append([dt, d, causal, [r[0] for r in ho.LAUNCHES]])
print(json.dumps(res))
"""


def test_backward_launches_the_dtype_tile_on_sm90():
    """On an sm_90 device the mma.sync backward's main kernel (backend="sm80") is the sm_90 tile of the inputs'
    dtype (bf16 has its own at head dims 64 and 128: BWD_TILES_2D_SM90_DTYPE), through the public API's host path
    (stand-ins for torch and the GPU, bench/diag/host_overhead.py, in a subprocess)."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", _BWD_TILE_SCRIPT.replace("ROOT", repr(root))], capture_output=True,
                         text=True, cwd=root, check=True).stdout
    res = json.loads(out.strip().splitlines()[-1])
    assert len(res) == 8
    for dt, d, causal, names in res:
        want = bwd_spec(dt, d, causal, bwd_tiles("2d", 90, dt)[d], "2d").name
        assert want in names, (dt, d, causal, names)
    for d in (64, 128):
        assert bwd_tiles("2d", 90, "bfloat16")[d] != bwd_tiles("2d", 90, "float16")[d]
