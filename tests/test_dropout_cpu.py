"""CPU: dropout's host side and the head-dim rule. Philox4x32-10 against Random123's known-answer vectors, the
reference numbers' layout (cuda_src/attn/dropout.cuh) and statistics, the keep threshold and parameter fields, the
CuPy-side generator state, input checks; every dropout kernel listed for CI's compile pass."""
import struct

import numpy as np
import pytest

from cuflash import _configs, _dropout, _mods, _validate
from cuflash._params import BWD_PARAMS, FWD_PARAMS

# Random123 tests/kat_vectors: philox4x32 10 counter key -> output
KATS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter,key,expected", KATS)
def test_philox_known_answers(counter, key, expected):
    assert tuple(int(w) for w in _dropout.philox4x32_10(counter, key)) == expected


def test_reference_layout():
    """Element (i, j)'s number is half j % 2 of word ((i / 8) % 2) * 2 + (j / 8) % 2 of the group ((i / 16) * 8 +
    i % 8, (j / 16) * 4 + (j % 8) / 2): checked element by element against a direct Philox call."""
    seed, offset, bh = 0x1234_5678_9ABC_DEF0, (3 << 32) + 8, 5
    r = _dropout.random16_reference(bh, 40, 37, seed, offset)
    key = (seed & 0xFFFFFFFF, (seed >> 32) ^ (offset >> 32))
    for i, j in [(0, 0), (7, 1), (8, 9), (15, 14), (16, 2), (33, 36), (39, 20)]:
        words = _dropout.philox4x32_10(((i // 16) * 8 + i % 8, (j // 16) * 4 + (j % 8) // 2, bh, offset & 0xFFFFFFFF),
                                       key)
        w = int(words[((i // 8) % 2) * 2 + (j // 8) % 2])
        assert r[i, j] == (w >> (16 * (j % 2))) & 0xFFFF


def test_reference_statistics_and_keys():
    """The numbers are uniform (mean, and every 16-bit value's top bits), different for another head, offset or
    seed; the keep mask drops p of them."""
    r = _dropout.random16_reference(0, 512, 512, 1, 0).astype(np.float64)
    assert abs(r.mean() / 65535 - 0.5) < 0.005
    hist = np.bincount((r.astype(np.int64) >> 12).ravel(), minlength=16) / r.size
    assert np.abs(hist - 1 / 16).max() < 0.005
    for other in (_dropout.random16_reference(1, 512, 512, 1, 0), _dropout.random16_reference(0, 512, 512, 1, 4),
                  _dropout.random16_reference(0, 512, 512, 2, 0), _dropout.random16_reference(0, 512, 512, 1, 1 << 32)):
        assert (other != r).mean() > 0.99
    m = _dropout.keep_mask_reference(2, 3, 100, 130, 0.3, 9, 0)
    assert m.shape == (2, 3, 100, 130) and abs((1 - m.mean()) - 0.3) < 0.01


def test_keep_threshold_and_fields():
    assert _dropout.keep_threshold(0.0) == 65536
    assert _dropout.keep_threshold(0.5) == 32768
    assert _dropout.keep_threshold(1 - 2 ** -20) == 0
    f = _dropout.fields(0.25, 2**64 - 1, 2**63 + 4)
    assert f["dropout_keep"] == 49152 and f["dropout_scale"] == pytest.approx(4 / 3)
    assert f["rng_seed"] == -1 and f["rng_offset"] == -(2**63) + 4  # int64 fields: the bits of the unsigned values
    for block in (FWD_PARAMS, BWD_PARAMS):
        raw = block.pack(0, **f)
        off = block.offsets()
        assert struct.unpack_from("<Q", raw, off["rng_seed"][0])[0] == 2**64 - 1
        assert struct.unpack_from("<Q", raw, off["rng_offset"][0])[0] == 2**63 + 4


def test_cupy_generator_state():
    from cuflash._interop import CUPY

    _dropout.manual_seed(5)
    s0 = _dropout.get_rng_state()
    assert s0 == (5, 0)
    assert _dropout.next_state(CUPY, 0) == s0
    assert _dropout.get_rng_state() == (5, _dropout.OFFSET_STEP)
    _dropout.manual_seed(5)
    assert _dropout.next_state(CUPY, 0) == s0


def test_rng_state_and_option_checks():
    with pytest.raises(TypeError, match="rng_state"):
        _dropout.check_rng_state(3)
    with pytest.raises(TypeError, match="offset"):
        _dropout.check_rng_state((1, 2.5))
    assert _dropout.check_rng_state((1, 2)) == (1, 2)
    with pytest.raises(ValueError, match="dropout_p"):
        _validate.check_unsupported(1.0)
    with pytest.raises(NotImplementedError, match="dropout"):
        _validate.check_unsupported(0.1, scores=False)
    _validate.check_unsupported(0.1)  # the V2 kernels take it


def test_resolve_with_dropout():
    """Dropout always takes the MOD_SCORE_DROPOUT kernels, causal folded into the band (right = 0), with the call's
    fields; without it nothing changes."""
    drop = _dropout.fields(0.1, 3, 8)
    m = _mods.resolve(True, (-1, -1), 0.0, None, 100, 120, 0.125, drop)
    assert (m.causal, m.mod) == (False, _configs.MOD_SCORE_DROPOUT)
    assert (m.fields["window_left"], m.fields["window_right"]) == (120, 0)
    assert m.fields["dropout_keep"] == _dropout.keep_threshold(0.1) and _mods.rng_state_of(m) == (3, 8)
    assert _mods.resolve(True, (-1, -1), 0.0, None, 100, 120, 0.125).mod == _configs.MOD_NONE
    f = _mods.mod_fields(None, 0.125, 80)
    assert f["head_dim"] == 80 and f["dropout_keep"] == 0 and f["dropout_scale"] == 0.0


def test_every_dropout_kernel_is_listed():
    """A MOD_SCORE_DROPOUT kernel for every V2 forward and backward configuration (and the mask kernel) in
    all_specs, so CI compiles each; none for split-KV."""
    names = {s.name for s in _configs.all_specs()}
    assert _configs.dropout_mask_spec().name in names
    for dt in _configs.DTYPES:
        for d in _configs.HEADDIMS:
            assert _configs.fwd_spec(dt, d, False, False, mod=_configs.MOD_SCORE_DROPOUT).name in names
            for part in _configs.BWD_PARTITIONS:
                if d in _configs.bwd_tiles(part) and (part, d) not in _configs.BWD_SCORE_UNSUPPORTED:
                    for arch in (80, 90):
                        tile = _configs.bwd_tile(d, part, arch, dt, _configs.MOD_SCORE_DROPOUT)
                        spec = _configs.bwd_spec(dt, d, False, tile, part, mod=_configs.MOD_SCORE_DROPOUT)
                        assert spec.name in names, spec.name
                        conv = _configs.bwd_convert_spec(dt, d, False, tile.block_n, _configs.MOD_SCORE)
                        assert conv.name in names, conv.name
    with pytest.raises(ValueError, match="split"):
        _configs.fwd_spec("float16", 64, False, True, mod=_configs.MOD_SCORE_DROPOUT)


@pytest.mark.parametrize("opts", [dict(causal=False, window_size=(-1, -1), softcap=0.0, alibi=False),
                                  dict(causal=True, window_size=(-1, -1), softcap=0.0, alibi=False),
                                  dict(causal=False, window_size=(9, 2), softcap=2.0, alibi=True)])
def test_varlen_probs_assembly(opts):
    """The packed S_dmask's assembly (_dropout._varlen_probs, run on NumPy here; CuPy on the GPU): sequence b's
    probabilities at [b, :, :len_q(b), :len_k(b)] against the float64 softmax of that sequence alone (its mask
    bottom-right aligned, ALiBi of its row of slopes), negated exactly where the NumPy Philox mask of (b nheads +
    head, local i, local j) drops, zeros past each sequence and for empty ones."""
    from cuflash import reference

    rng = np.random.default_rng(5)
    lens_q, lens_k, h, hk, d, p = (5, 0, 1, 19, 3), (7, 4, 1, 19, 0), 4, 2, 8, 0.3
    cq, ck = np.concatenate([[0], np.cumsum(lens_q)]), np.concatenate([[0], np.cumsum(lens_k)])
    mq, mk = 21, 19
    q = rng.standard_normal((h, cq[-1], d)).astype(np.float32)
    k = rng.standard_normal((hk, ck[-1], d)).astype(np.float32)
    k_rep = np.repeat(k, h // hk, axis=0)
    slopes = (rng.random((len(lens_q), h)) * 0.5).astype(np.float32) if opts["alibi"] else None
    scale = d ** -0.5
    keep = _dropout.keep_mask_reference(len(lens_q), h, mq, mk, p, 77, 12)
    lse = np.full((h, cq[-1]), -np.inf, dtype=np.float32)
    scores = {}
    for b, (sq, sk) in enumerate(zip(lens_q, lens_k)):
        if sq == 0 or sk == 0:
            continue
        s, _ = reference._scores(q[None, :, cq[b]:cq[b + 1]].astype(np.float64),
                                 k_rep[None, :, ck[b]:ck[b + 1]].astype(np.float64), scale, opts["causal"],
                                 opts["window_size"], opts["softcap"], None if slopes is None else slopes[b])
        m = s.max(-1, keepdims=True)
        safe = np.where(np.isfinite(m), m, 0.0)
        l_b = np.where(np.isfinite(m), safe + np.log(np.exp(s - safe).sum(-1, keepdims=True)), -np.inf)[0, :, :, 0]
        lse[:, cq[b]:cq[b + 1]] = l_b
        scores[b] = np.nan_to_num(np.exp(s[0] - l_b[..., None]))
    got = _dropout._varlen_probs(np, q, k_rep, lse, keep, (cq, ck, mq, mk), scale, opts["causal"],
                                 opts["window_size"], opts["softcap"], slopes)
    assert got.shape == (len(lens_q), h, mq, mk) and got.dtype == np.float32
    for b, (sq, sk) in enumerate(zip(lens_q, lens_k)):
        assert not got[b, :, sq:].any() and not got[b, :, :, sk:].any()
        if b not in scores:
            assert not got[b].any()
            continue
        mine = got[b, :, :sq, :sk]
        assert np.abs(np.abs(mine) - scores[b]).max() < 1e-5
        nz = mine != 0
        assert nz.any() and np.array_equal(~np.signbit(mine) & nz, keep[b, :, :sq, :sk] & nz)
        for hh in range(h):  # the mask of (b nheads + head) at local positions: the kernels' counter
            ref = _dropout.random16_reference(b * h + hh, sq, sk, 77, 12) < _dropout.keep_threshold(p)
            assert np.array_equal(keep[b, hh, :sq, :sk], ref)
