"""CPU: the Hopper forward's tile walks in groups and its dynamic walk (cuda_src/flash_fwd_sm90.cu: Sm90FwdTiles,
Sm90FwdWalk; cuflash._configs.persist_walk_model / sm90_persist_dynamic; cuflash._walk): the list model against the
kernel's index arithmetic written out, the rule that picks the dynamic walk, and how counter slots are handed out."""
import re
from pathlib import Path

import pytest

from cuflash import _configs, _walk

ROOT = Path(__file__).resolve().parent.parent


def _coords(t, x_tiles, bhs, group, causal=True):
    """Sm90FwdTiles::coords for fixed lengths: (x, (batch, head) index) of linear tile t."""
    group = max(1, min(group, bhs))
    first = t // (x_tiles * group) * group
    size = min(group, bhs - first)
    within = t - first * x_tiles
    return (x_tiles - 1 - within // size if causal else within // size), first + within % size


def _work(x, sq, sk, bm, bn, causal=True):
    if not causal:  # every K / V tile, by the warpgroups (64 rows each) that hold a row
        rows = min(bm, sq - x * bm)
        return -(-sk // bn) * (-(-rows // 64)) / (bm // 64)
    last = min(sk, (x + 1) * bm + sk - sq)  # bottom-right causal: the keys the tile's last row sees
    return max(0, -(-last // bn))


def _blocks(group, bhs, sq, sk, bm, bn, grid, dynamic, fixed=1.0, causal=True):
    """Each block's work: fixed waves (Sm90FwdTiles::tile) or each tile to the block free first (the counter), the
    tiles in the kernel's order, a tile's work its K / V tiles (without a mask: times its warpgroups' share) plus
    `fixed`."""
    x_tiles = -(-sq // bm)
    works = [_work(_coords(t, x_tiles, bhs, group, causal)[0], sq, sk, bm, bn, causal) + fixed
             for t in range(x_tiles * bhs)]
    totals = [0.0] * grid
    for t, w in enumerate(works):
        if dynamic:
            b = t if t < grid else min(range(grid), key=lambda i: (totals[i], i))
        else:
            k, pos = divmod(t, grid)
            b = grid - 1 - pos if k & 1 else pos
        totals[b] += w
    return totals


def test_coords_visit_every_tile_once_heaviest_first_in_each_group():
    for bhs, group in ((10, 4), (12, 12), (12, 1), (7, 3), (5, 100)):
        x_tiles = 6
        seen = [_coords(t, x_tiles, bhs, group) for t in range(x_tiles * bhs)]
        assert sorted(seen) == sorted((x, bh) for x in range(x_tiles) for bh in range(bhs))
        g = max(1, min(group, bhs))
        for first in range(0, bhs, g):  # a group's tiles are consecutive, its members' x decreasing together
            members = range(first, min(first + g, bhs))
            idx = [t for t, (x, bh) in enumerate(seen) if bh in members]
            assert idx == list(range(idx[0], idx[0] + len(idx)))
            xs = [seen[t][0] for t in idx]
            assert xs == sorted(xs, reverse=True)
    # group 1 is "qtile" (a (batch, head)'s tiles together), a group of all is "bh" (every head's tile x, then x - 1)
    assert [_coords(t, 3, 2, 1) for t in range(6)] == [(2, 0), (1, 0), (0, 0), (2, 1), (1, 1), (0, 1)]
    assert [_coords(t, 3, 2, 2) for t in range(6)] == [(2, 0), (2, 1), (1, 0), (1, 1), (0, 0), (0, 1)]
    # without a mask the first tile first (a ragged last tile is the lightest)
    assert [_coords(t, 3, 2, 2, False) for t in range(6)] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]


@pytest.mark.parametrize("group,bhs,sq,sk,bm,bn,grid", [(16, 256, 2048, 2048, 192, 128, 132),
                                                         (4, 10, 1000, 333, 128, 128, 17),
                                                         (3, 7, 777, 2000, 192, 128, 5), (1, 16, 8192, 8192, 128, 160, 132),
                                                         (32, 32, 4096, 4096, 128, 128, 132)])
def test_walk_model_follows_the_kernel(group, bhs, sq, sk, bm, bn, grid):
    """persist_walk_model against the index arithmetic above, fixed and dynamic, with and without a fixed cost per
    tile."""
    for causal in (True, False):
        for dynamic in (False, True):
            for fixed in (0.0, 1.0):
                tot = _blocks(group, bhs, sq, sk, bm, bn, grid, dynamic, fixed, causal)
                want = max(tot) / (sum(tot) / grid)
                got = _configs.persist_walk_model(group, dynamic, bhs, sq, sk, bm, bn, grid, fixed, causal)
                assert got == pytest.approx(want, rel=1e-9), (causal, dynamic, fixed)


@pytest.mark.parametrize("causal", [True, False])
def test_dynamic_walk_rule_on_the_fa2_grid(causal):
    """The groups sm90_persist_dynamic picks at the FA2-grid points of the persistent form (16k tokens, hidden 2048,
    132 blocks): dynamic wherever the fixed walk is 0.01 or more above it, in groups whose K / V fit
    SM90_WALK_GROUP_BYTES. Causal: the fixed "bh" walk stays from 8k at head dim 128; GQA shares K / V within a group,
    so the group may grow. Without a mask: only head dim 64 at 2k and 4k, whose last Q tiles of 192 rows hold 128 and
    64 rows (head dim 128's 128-row tiles divide every length: the tiles are alike and no walk gains)."""
    got = {}
    for d in (64, 128):
        for s in (1024, 2048, 4096, 8192, 16384):
            b, h = 16384 // s, 2048 // d
            t = _configs.sm90_fwd_tile(d, causal, s)
            if not t.persistent:
                continue
            grid = min(-(-s // t.block_m) * b * h, 132)
            fixed = _configs.sm90_persist_walk(causal, b * h, s, s, t, grid)
            got[d, s] = _configs.sm90_persist_dynamic(b * h, 1, s, s, d, t.block_m, t.block_n, grid, fixed, causal)
            if got[d, s]:
                assert got[d, s] * s * d * 4 <= _configs.SM90_WALK_GROUP_BYTES  # (one head per KV head)
                model = (b * h, s, s, t.block_m, t.block_n, grid)
                dyn = _configs.persist_walk_model(got[d, s], True, *model, causal=causal)
                fx = _configs.persist_walk_model(b * h if fixed == "bh" else 1, False, *model, causal=causal)
                assert dyn <= fx - _configs.SM90_WALK_DYNAMIC_MIN_GAIN and dyn < 1.025
    if causal:
        assert got == {(64, 2048): 16, (64, 4096): 16, (128, 1024): 16, (128, 2048): 8, (128, 4096): 4,
                       (128, 8192): 0, (128, 16384): 0}
        t = _configs.sm90_fwd_tile(128, True, 4096)
        assert _configs.sm90_persist_dynamic(64, 8, 4096, 4096, 128, t.block_m, t.block_n, 132, "qtile") >= 4
    else:
        assert got == {(64, 2048): 16, (64, 4096): 16, (64, 8192): 0, (64, 16384): 0, (128, 1024): 0,
                       (128, 2048): 0, (128, 4096): 0, (128, 8192): 0, (128, 16384): 0}


def test_kernel_slot_count_matches():
    src = (ROOT / "cuda_src" / "flash_fwd_sm90.cu").read_text()
    assert int(re.search(r"constexpr int SM90_WALK_SLOTS = (\d+);", src).group(1)) == _walk.SLOTS


def test_slots_per_stream_and_per_captured_launch(monkeypatch):
    """One slot per (device, stream), the same on every call; a launch on a stream being captured takes a new one each
    time; none left: -1 (the fixed waves)."""
    monkeypatch.setattr(_walk, "_stream_slots", {})
    monkeypatch.setattr(_walk, "_taken", [0])
    capturing = set()
    monkeypatch.setattr(_walk, "capturing", lambda stream: stream in capturing)
    a, b = _walk.slot(0, 111), _walk.slot(0, 222)
    assert a != b and _walk.slot(0, 111) == a and _walk.slot(1, 111) not in (a, b)
    capturing.add(333)
    c1, c2 = _walk.slot(0, 333), _walk.slot(0, 333)
    assert len({a, b, c1, c2, _walk.slot(1, 111)}) == 5
    capturing.clear()
    assert _walk.slot(0, 333) not in (c1, c2)  # (its eager slot, apart from the captured launches')
    monkeypatch.setattr(_walk, "_taken", [_walk.SLOTS - 1])
    assert _walk.slot(0, 444) == _walk.SLOTS - 1 and _walk.slot(0, 555) == -1 and _walk.slot(0, 444) == _walk.SLOTS - 1


def test_capturing_without_a_gpu_is_false():
    assert _walk.capturing(0) is False


def test_tail_probe_shapes_make_whole_waves():
    """bench.diag.fwd90_tail_probe: the grid count's shape holds the grid's Q tiles (head dim 128: 8 x 16 heads of 2048
    rows as 128 heads), the other two whole waves of 132 blocks just below and above it, every row count whole Q
    tiles."""
    from bench.diag.fwd90_tail_probe import SMS, counts, shapes

    assert counts(2048) == (2048, 1980, 2112) and counts(1980) == (1980, 1980, 2112)
    for d, s in ((128, 2048), (128, 16384), (64, 4096), (256, 8192)):
        bm = _configs.sm90_fwd_tile(d, False, s).block_m
        cases = shapes(d, s, bm)
        assert all(rows % bm == 0 for _, rows in cases)
        got = [h * rows // bm for h, rows in cases]
        assert got[1] % SMS == 0 and got[2] % SMS == 0 and got[1] <= got[0] < got[2]
    assert shapes(128, 2048, 128)[0] == (128, 2048)


@pytest.mark.parametrize("tiles,n_kv,grid", [(2048, 13, 132), (2048, 26, 132), (300, 7, 17), (133, 5, 132),
                                             (10, 4, 3)])
def test_stream_k_segments_cover_every_pair_once(tiles, n_kv, grid):
    """bench.diag.fwd90_walk_model.stream_k_segments: the blocks' segments cover every (tile, K / V tile) pair exactly
    once, each block's pairs one contiguous run in tile order, and where a block's share is at least two tiles' pairs
    a tile is split between at most two blocks (the first ends the block before's range, the rest starts the next)."""
    from bench.diag.fwd90_walk_model import stream_k_segments

    seen, owners = [], {}
    for b in range(grid):
        run = [(t, i) for t, f, e in stream_k_segments(b, grid, tiles, n_kv) for i in range(f, e)]
        flat = [t * n_kv + i for t, i in run]
        if flat:  # (blocks past the pairs' end hold none)
            assert flat == list(range(flat[0], flat[0] + len(flat)))
        seen += flat
        for t, _ in run:
            owners.setdefault(t, set()).add(b)
    assert sorted(seen) == list(range(tiles * n_kv))
    if -(-tiles * n_kv // grid) >= 2 * n_kv:
        assert max(len(o) for o in owners.values()) <= 2


def test_stream_k_spread_at_head_dim_128():
    """The stream-K figures NOTES cites (2048 Q tiles of 128 rows on 132 blocks; 160-key stages at 2k-8k: 13, 26, 52
    K / V tiles; one of fixed cost per segment, half of one per merged piece) against the fixed walk's 1.031."""
    from bench.diag.fwd90_walk_model import stream_k_spread

    got = [round(stream_k_spread(2048, n, 132), 3) for n in (13, 26, 52)]
    assert got == [1.013, 1.007, 1.003]
    assert _configs.persist_walk_model(1, False, 128, 2048, 2048, 128, 160, 132, causal=False) == pytest.approx(
        1.031, abs=1e-3)
    assert stream_k_spread(132, 10, 132) == pytest.approx(1.0)  # one whole tile each
