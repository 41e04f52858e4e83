"""CPU: the decode kernel's swizzled ring (DecodeTile.swizzle, the kernel's SWZ; cuda_src/flash_decode.cu
RingSwizzle). The layout's arithmetic, emulated with the kernel's formulas: every (row, chunk) of a warp tile has its
own 16 bytes; a 32-byte global sector lands in one 32-byte shared sector and rows start on 64 or 128 bytes (the
padded rows do not: what the swizzle is for); each lane's cp.async passes cover the tile once; the ldmatrix
addresses of K (plain) and V (trans), written as (base + offset) ^ lane XOR, are the loader's slots of the elements
each lane must read, and the 8 rows of every 8x8 matrix fall in 8 distinct bank groups. Then the kernel names and
shared memory (the configured tiles take the swizzled ring), and the offline build of every kernel with the padded rows
(no spills, no local memory; sm_80 and sm_90 with the pip NVRTC, sm_90 with CUFLASH_NVRTC_ALT's when set)."""
from dataclasses import replace

import pytest

from cuflash import _configs
from conftest import compile_problems

HEADDIMS = _configs.HEADDIMS


def of(d, row):
    """RingSwizzle<D>::of."""
    cpr = d // 8
    return (row & 7) if cpr % 8 == 0 else ((row >> 1) & 3)


def offset(d, row, chunk):
    """RingSwizzle<D>::offset: the byte offset of (row, 16-byte chunk) in a tile."""
    return row * d * 2 + ((chunk ^ of(d, row)) << 4)


def padded_offset(d, row, chunk):
    return row * (d + _configs.SMEM_ROW_PAD) * 2 + chunk * 16


@pytest.mark.parametrize("d", HEADDIMS)
def test_every_slot_once_and_sectors_whole(d):
    rows = _configs.decode_tile(d).block_n
    cpr = d // 8
    offs = {offset(d, r, c) for r in range(rows) for c in range(cpr)}
    assert offs == {16 * i for i in range(rows * cpr)}  # a permutation of the tile's 16-byte slots
    for r in range(rows):
        assert (r * d * 2) % (128 if cpr % 8 == 0 else 64) == 0
        for k in range(cpr // 2):  # the two halves of a global 32-byte sector share one shared sector
            assert offset(d, r, 2 * k) // 32 == offset(d, r, 2 * k + 1) // 32
    # the padded rows: every row that starts 16 bytes off a sector splits all its sectors (the layout this replaces)
    split = sum(padded_offset(d, r, 0) % 32 != 0 for r in range(rows))
    assert split == rows // 2


@pytest.mark.parametrize("d", HEADDIMS)
def test_loader_passes_cover_the_tile(d):
    """warp_load_tile's lanes: lane -> (row lane / CPR, chunk lane % CPR), pass i adds i x RPP rows."""
    t = _configs.decode_tile(d)
    cpr = d // 8
    rpp, used = 32 // cpr, (32 // cpr) * cpr
    got = [offset(d, lane // cpr + i * rpp, lane % cpr) for lane in range(used) for i in range(t.block_n // rpp)]
    assert sorted(got) == [16 * i for i in range(t.block_n * cpr)]


def _xor_form(d, base, imm, x):
    """The kernel's address: (base + imm) ^ x, base clear in the bits the XOR may flip (4-6, or 4-5 for rows of 4
    or 12 chunks: odd rows of D = 32 and 96 start 64 bytes into a 128-byte line)."""
    assert base & (0x70 if (d // 8) % 8 == 0 else 0x30) == 0
    return (base + imm) ^ x


@pytest.mark.parametrize("d", HEADDIMS)
def test_ldmatrix_addresses_read_the_right_elements_without_conflicts(d):
    t = _configs.decode_tile(d)
    rb = d * 2
    for tile_base in (0, 4352, 2 * t.block_n * rb):  # a tile on a 128-byte boundary (the kernel's smem and slots)
        # K (plain ldmatrix_x4): lane -> row nf*8 + lane%8 + (lane/16)*8, chunk 2kd + (lane/8)%2
        for nf in range(0, t.block_n // 8, 2):
            for kd in range(d // 16):
                addrs = []
                for lane in range(32):
                    x = (((lane // 8) % 2) ^ of(d, lane % 8)) << 4
                    row_base = ((lane % 8) + (lane // 16) * 8) * rb
                    a = _xor_form(d, tile_base + row_base, nf * 8 * rb + kd * 32, x)
                    assert a == tile_base + offset(d, nf * 8 + (lane % 8) + (lane // 16) * 8, 2 * kd + (lane // 8) % 2)
                    addrs.append(a)
                for m in range(4):
                    assert len({(a // 16) % 8 for a in addrs[8 * m: 8 * m + 8]}) == 8
        # V (ldmatrix_x4.trans): lane -> row kn*16 + lane%8 + ((lane/8)%2)*8, chunk df + lane/16, df even
        for kn in range(t.block_n // 16):
            for df in range(0, d // 8, 2):
                addrs = []
                for lane in range(32):
                    x = ((lane // 16) ^ of(d, lane % 8)) << 4
                    row_base = ((lane % 8) + ((lane // 8) % 2) * 8) * rb
                    a = _xor_form(d, tile_base + row_base, kn * 16 * rb + df * 16, x)
                    assert a == tile_base + offset(d, kn * 16 + (lane % 8) + ((lane // 8) % 2) * 8, df + lane // 16)
                    addrs.append(a)
                for m in range(4):
                    assert len({(a // 16) % 8 for a in addrs[8 * m: 8 * m + 8]}) == 8


def test_ring_bases_are_128_byte_aligned():
    """The XOR form needs the tiles' bases on 128 bytes: the Q tile ahead of the rings and every slot are multiples."""
    for d in HEADDIMS:
        t = replace(_configs.decode_tile(d), swizzle=True)
        for mf in range(1, _configs.DECODE_MAX_MF[d] + 1):
            q_bytes = 16 * mf * (d + _configs.SMEM_ROW_PAD) * 2
            assert q_bytes % 128 == 0 and (t.block_n * d * 2) % 128 == 0


def test_names_and_shared_memory():
    """The configured kernels are the swizzled ones; the padded rows keep their old names and shared memory."""
    for d in HEADDIMS:
        s = _configs.decode_tile(d)
        t = replace(s, swizzle=False)
        assert s.swizzle
        for mf in range(1, _configs.DECODE_MAX_MF[d] + 1):
            for pg in (False, True):
                v = _configs.decode_spec("bfloat16", d, True, mf, None, 0, pg)
                assert v == _configs.decode_spec("bfloat16", d, True, mf, s, 0, pg)
                assert v.name.endswith(f", 0, {'true' if pg else 'false'}, true>")
                base = _configs.decode_spec("bfloat16", d, True, mf, t, 0, pg)
                assert base.name.endswith(", 0, true>" if pg else f", {base.smem}>")
                ring = t.nwarps * t.stages * 2 * t.block_n
                assert base.smem - v.smem == ring * _configs.SMEM_ROW_PAD * 2 or \
                    base.smem == v.smem == 16 * mf * (d + 8) * 2 + t.nwarps * 16 * mf * (d + 11) * 4


def test_padded_kernels_compile_spill_free():
    """The padded rows, reachable through an explicit tile (the configured, swizzled kernels are test_compile's)."""
    bad = compile_problems(_configs.decode_padded_specs(), archs=(80, 90))
    assert not bad, bad
