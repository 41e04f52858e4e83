"""CPU: the Hopper forward's per-warpgroup skip of hidden KV tiles (cuda_src/flash_fwd_sm90.cu), its arithmetic written
out in Python -- attn/block.cuh's hidden_tiles over kv_block_begin / kv_block_end with C's integer division, the
mask's band from cuflash._mods.resolve as the launch builds it -- against the visibility of every (row, key) pair by
brute force (cuflash.reference.visible_mask): a consumer warpgroup's products must cover every KV tile that one of
its rows sees, and every tile it skips must be hidden from all of its rows."""
from __future__ import annotations

import pytest

from conftest import c_div
from cuflash import _configs, _mods, reference


class _Mask:
    """attn/mask.cuh's Mask as far as attn/block.cuh reads it: CAUSAL, LOCAL (MOD_SCORE: the band [i + diag - left,
    i + diag + right]), seqlen_k, diag."""

    def __init__(self, causal, window, softcap, sq, sk):
        m = _mods.resolve(causal, window, softcap, None, sq, sk, 0.125)
        self.causal, self.local = m.causal, m.mod != _configs.MOD_NONE
        self.left, self.right = m.fields.get("window_left", 0), m.fields.get("window_right", 0)
        self.sk, self.diag = sk, sk - sq

    def key_end(self, rows_end):
        if self.local:
            return max(0, min(self.sk, rows_end + self.diag + self.right))
        return min(self.sk, rows_end + self.diag) if self.causal else self.sk

    def block_begin(self, rows_begin, bn):
        if self.local:
            return c_div(min(max(0, rows_begin + self.diag - self.left), self.sk), bn)
        return 0

    def block_end(self, rows_end, bn):
        return c_div(self.key_end(rows_end) + bn - 1, bn)


def _hidden_tiles(mask, bn, rows_begin, rows_end, n_end, n_iters):
    """attn/block.cuh's hidden_tiles: (lead, tail)."""
    if rows_end <= rows_begin:
        return n_iters, 0
    lead = min(n_iters, max(0, n_end - mask.block_end(rows_end, bn)))
    return lead, min(n_iters - lead, max(0, mask.block_begin(rows_begin, bn) - (n_end - n_iters)))


def _warpgroup_ranges(mask, sq, m0, bm, bn, nwg, skips):
    """Per consumer warpgroup: (its rows [r0, r1), the KV tiles it runs products for, the ones it skips), from the
    kernel's formulas (one-tile form: leading and trailing skips; the persistent form: leading only)."""
    n_end = mask.block_end(min(m0 + bm, sq), bn)
    n_iters = max(0, n_end - mask.block_begin(m0, bn))
    out = []
    for cw in range(nwg):
        row_wg = m0 + 64 * cw
        rows_end = min(row_wg + 64, sq)
        skip = tail = 0
        if skips != "none" and (mask.causal or mask.local):
            skip, tail = _hidden_tiles(mask, bn, row_wg, rows_end, n_end, n_iters)
            if skips == "leading":
                tail = 0
        visits = [n_end - 1 - it for it in range(n_iters)]  # last first
        out.append(((row_wg, rows_end), visits[skip:n_iters - tail], visits[:skip] + visits[n_iters - tail:]))
    return out


def _tiles():
    """(label, tile, skips) of the Hopper forward forms that run a skip: the configured one-tile tiles of every head
    dim (leading and trailing) and the persistent variants (leading: causal, no modifier)."""
    out = [(f"d{d} one-tile", t, "both") for d, t in _configs.SM90_FWD_TILES.items()]
    for d in _configs.SM90_FWD_PERSIST_VARIANTS:
        out += [(f"d{d} {n}", t, "leading") for n, t in _configs.sm90_fwd_persist_tiles(d).items()]
    return out


SHAPES = [(1, 1), (64, 64), (200, 200), (500, 500), (300, 700), (700, 300), (1000, 1333), (1333, 1000), (4500, 4500),
          (130, 77)]
BANDS = [(True, (-1, -1), 0.0), (False, (100, 17), 0.0), (False, (0, 0), 0.0), (False, (300, -1), 0.0),
         (False, (-1, 50), 0.0), (False, (-1, 0), 20.0), (False, (1000, 0), 0.0), (False, (-1, -1), 30.0),
         (False, (5, 5000), 0.0)]


CASES = [(label, tile, skips, *band) for label, tile, skips in _tiles() for band in BANDS
         if skips == "both" or band[0]]  # (the persistent form takes no score modifier: causal only)


@pytest.mark.parametrize("label,tile,skips,causal,window,softcap", CASES,
                         ids=[f"{c[0]}-c{int(c[3])}-w{c[4][0]}_{c[4][1]}-cap{c[5]:g}" for c in CASES])
def test_warpgroup_skips_only_hidden_tiles(label, tile, skips, causal, window, softcap):
    bm, bn = tile.block_m, tile.block_n
    skipped = 0
    for sq, sk in SHAPES:
        mask = _Mask(causal, window, softcap, sq, sk)
        vis = reference.visible_mask(sq, sk, causal, window)
        for m0 in range(0, sq, bm):
            for (r0, r1), runs, skips_ in _warpgroup_ranges(mask, sq, m0, bm, bn, tile.nwg, skips):
                seen = {n for n in range(-(-sk // bn)) if r1 > r0 and vis[r0:r1, n * bn:(n + 1) * bn].any()}
                assert seen <= set(runs), (sq, sk, m0, r0, sorted(seen - set(runs)))
                assert not seen & set(skips_), (sq, sk, m0, r0)
                assert runs == sorted(runs, reverse=True) and all(a - b == 1 for a, b in zip(runs, runs[1:]))
                skipped += len(skips_)
    if tile.nwg > 1 and (causal or window[1] >= 0):
        assert skipped > 0  # the cases reach the skip (a right band edge with several warpgroups per tile)


def test_no_skip_without_a_band_edge():
    """Without causal and without a window (plain, or a soft-cap alone) every warpgroup with rows runs every tile of
    its Q tile: the skip changes nothing there."""
    tile = _configs.SM90_FWD_TILES[64]
    for causal, window, softcap in [(False, (-1, -1), 0.0), (False, (-1, -1), 30.0)]:
        for sq, sk in SHAPES:
            mask = _Mask(causal, window, softcap, sq, sk)
            for m0 in range(0, sq, tile.block_m):
                for (r0, r1), runs, skips_ in _warpgroup_ranges(mask, sq, m0, tile.block_m, tile.block_n, tile.nwg,
                                                                 "both"):
                    if r1 > r0:  # (a warpgroup past seqlen_q's rows runs nothing it needs, skipped or not)
                        assert not skips_ and len(runs) == -(-sk // tile.block_n)


def test_skip_counts_at_head_dim_64():
    """The 192-row tiles with 128-key stages: causal at sq = sk, the first warpgroup's rows end 128 keys before the
    tile's (one KV tile hidden from them in every Q tile), the second's 64 keys before (one in every other), the third
    skips none but in the last Q tile, which holds no row of it (all of them); at a window's left edge the same by
    the first rows (the third warpgroup's rows begin 128 keys after the tile's: one tile)."""
    tile = _configs.SM90_FWD_TILES[64]
    assert (tile.block_m, tile.block_n, tile.nwg) == (192, 128, 3)
    mask = _Mask(True, (-1, -1), 0.0, 4500, 4500)
    counts = {cw: [] for cw in range(3)}
    for m0 in range(0, 4500, 192):
        for cw, (_, _, skips_) in enumerate(_warpgroup_ranges(mask, 4500, m0, 192, 128, 3, "both")):
            counts[cw].append(len(skips_))
    assert set(counts[0]) == {1} and set(counts[1]) == {0, 1} and counts[2] == [0] * 23 + [36]
    last = _warpgroup_ranges(_Mask(True, (-1, -1), 0.0, 500, 500), 500, 384, 192, 128, 3, "both")
    assert [(rows, len(r), len(s)) for rows, r, s in last] == [((384, 448), 4, 0), ((448, 500), 4, 0), ((512, 500), 0, 4)]
    band = _Mask(False, (1000, 0), 0.0, 4500, 4500)
    tails = {cw: set() for cw in range(3)}
    for m0 in range(1152, 4224, 192):  # Q tiles whose bands lie inside the keys at both edges
        for cw, ((r0, _), runs, skips_) in enumerate(_warpgroup_ranges(band, 4500, m0, 192, 128, 3, "both")):
            tails[cw].add(sum(n < runs[-1] for n in skips_))
    assert tails[0] == {0} and tails[1] == {0, 1} and tails[2] == {1}
