"""CPU: the Hopper forward's tile walks in groups and its dynamic walk (cuda_src/flash_fwd_sm90.cu: Sm90FwdTiles,
Sm90FwdWalk; cuflash._configs.persist_walk_model / sm90_persist_dynamic; cuflash._walk): the list model against the
kernel's index arithmetic written out, the rule that picks the dynamic walk, and how counter slots are handed out;
stream-K (Sm90FwdStreamK): its segments against the kernel's arithmetic, its model and its workspace."""
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


def test_kernel_slot_counts_match():
    src = (ROOT / "cuda_src" / "flash_fwd_sm90.cu").read_text()
    assert int(re.search(r"constexpr int SM90_WALK_SLOTS = (\d+);", src).group(1)) == _walk.SLOTS == _walk.FWD_SLOTS.size


def test_slots_per_stream_and_per_captured_launch(monkeypatch):
    """One slot per (device, stream), the same on every call; a launch on a stream being captured takes a new one each
    time; none left: -1 (the forward's fixed waves). Two pools count apart."""
    pool = _walk.SlotPool(_walk.FWD_SLOTS.size)
    other = _walk.SlotPool(8)
    capturing = set()
    monkeypatch.setattr(_walk, "capturing", lambda stream: stream in capturing)
    a, b = pool.slot(0, 111), pool.slot(0, 222)
    assert a != b and pool.slot(0, 111) == a and pool.slot(1, 111) not in (a, b)
    assert other.slot(0, 999) == 0  # (a pool of its own: its first slot whatever the other has handed out)
    capturing.add(333)
    c1, c2 = pool.slot(0, 333), pool.slot(0, 333)
    assert len({a, b, c1, c2, pool.slot(1, 111)}) == 5
    capturing.clear()
    assert pool.slot(0, 333) not in (c1, c2)  # (its eager slot, apart from the captured launches')
    pool.taken = pool.size - 1
    assert pool.slot(0, 444) == pool.size - 1 and pool.slot(0, 555) == -1 and pool.slot(0, 444) == pool.size - 1


def test_forward_slot_is_its_pools():
    assert _walk.slot == _walk.FWD_SLOTS.slot


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


def _sk_segment(block, grid, tiles, n, j):
    """Sm90FwdStreamK::segment written out from the kernel's text: the same integer steps (unsigned 32-bit S)."""
    waves = tiles // grid - 1
    if j < waves:
        return (j * grid + (grid - 1 - block if j & 1 else block), 0, n)
    dp = waves * grid
    s = ((tiles - dp) * n) & 0xFFFFFFFF
    lo, hi = (s * block) % 2 ** 32 // grid, (s * (block + 1)) % 2 ** 32 // grid
    tt = lo // n + (j - waves)
    start = max(lo, tt * n)
    if start >= hi:
        return (tiles, 0, 0)
    return (dp + tt, start - tt * n, min(hi - tt * n, n))


@pytest.mark.parametrize("tiles,n_kv,grid", [(2048, 13, 132), (2048, 26, 132), (2048, 103, 132), (300, 7, 17),
                                             (133, 5, 132), (263, 1, 132), (10, 4, 3), (2816, 16, 132)])
def test_stream_k_segments_cover_every_pair_once(tiles, n_kv, grid):
    """cuflash._configs.stream_k_segment (the kernel's arithmetic, checked against it written out): the whole waves
    but the last are the fixed walk's tiles (Sm90FwdTiles::tile, whole), and past them every (tile, K / V tile) pair is covered exactly once, each
    block's pairs one contiguous run of at least a tile's; a block's parts of tiles are at most a tail (its first
    segment past the whole waves, visits [i0, n) with i0 > 0) and a head (its last, [0, i1) with i1 < n), and block
    b's head is the tile whose tail block b + 1 runs, the two ranges meeting at i1: what the kernel's merge assumes."""
    assert _configs.stream_k_eligible(False, False, tiles, n_kv, grid)
    waves = tiles // grid - 1
    seen = []
    for b in range(grid):
        segs = _configs.stream_k_segments(b, grid, tiles, n_kv)
        assert segs == [_sk_segment(b, grid, tiles, n_kv, j) for j in range(len(segs))]
        assert _sk_segment(b, grid, tiles, n_kv, len(segs))[0] >= tiles
        assert all(e == n_kv and f == 0 for _, f, e in segs[:waves])
        # the whole waves' tiles are the fixed walk's (Sm90FwdTiles::tile): the consumers' first pass derives them so
        assert [s[0] for s in segs[:waves]] == [j * grid + (grid - 1 - b if j & 1 else b) for j in range(waves)]
        sk = segs[waves:]
        flat = [t * n_kv + i for t, f, e in sk for i in range(f, e)]
        assert flat == list(range(flat[0], flat[0] + len(flat))) and len(flat) >= n_kv
        seen += [t * n_kv + i for t, f, e in segs for i in range(f, e)]
        parts = [j for j, (_, f, e) in enumerate(sk) if e - f < n_kv]
        assert all(j in (0, len(sk) - 1) for j in parts)
        if sk[0][1] > 0:  # a tail: the block before ends with the head of the same tile
            prev = _configs.stream_k_segments(b - 1, grid, tiles, n_kv)[-1]
            assert prev == (sk[0][0], 0, sk[0][1]) and sk[0][2] == n_kv
        if sk[-1][2] < n_kv:
            assert b < grid - 1 and sk[-1][1] == 0
    assert sorted(seen) == list(range(tiles * n_kv))


@pytest.mark.parametrize("tiles,n_kv,grid", [(132, 5, 132), (264, 5, 132), (131, 5, 132), (400, 0, 132),
                                             (600, 5, 257), (400, 2 ** 20, 132)])
def test_stream_k_not_eligible(tiles, n_kv, grid):
    """Whole waves, fewer tiles than blocks, no keys, a grid past the kernel's flags, 32-bit overflow: no stream-K;
    with a mask or packed sequences neither."""
    assert not _configs.stream_k_eligible(False, False, tiles, n_kv, grid)
    assert not _configs.stream_k_eligible(True, False, 2048, 13, 132)
    assert not _configs.stream_k_eligible(False, True, 2048, 13, 132)


def test_stream_k_spread_and_rule_on_the_fa2_grid():
    """The list model (2048 Q tiles of 128 rows on 132 blocks at head dim 128; 128-key stages at 1k, 160 at 2k-16k)
    against the fixed walk's 1.031, and where the model alone would take stream-K on the FA2 grid without a mask
    (cuflash._configs.sm90_stream_k; grid_order "auto" does not, measured): at head dim 128; not at head dim 64 (2k /
    4k: ragged Q tiles, where equal pair counts are unequal work; 8k / 16k: within 0.01)."""
    got = [round(_configs.stream_k_spread(16384 // s * 16, s, s, 128, 128 if s == 1024 else 160, 132), 3)
           for s in (1024, 2048, 4096, 8192)]
    assert got == [1.017, 1.013, 1.007, 1.003]
    assert _configs.persist_walk_model(1, False, 128, 2048, 2048, 128, 160, 132, causal=False) == pytest.approx(
        1.031, abs=1e-3)
    taken = {}
    for d in (64, 128):
        for s in (1024, 2048, 4096, 8192, 16384):
            t = _configs.sm90_fwd_tile(d, False, s)
            if not t.persistent:
                continue
            bhs, tiles = 16384 // s * 2048 // d, -(-s // t.block_m) * (16384 // s) * (2048 // d)
            fixed = _configs.sm90_persist_walk(False, bhs, s, s, t, 132)
            group = _configs.sm90_persist_dynamic(bhs, 1, s, s, d, t.block_m, t.block_n, 132, fixed, False)
            taken[(d, s)] = (_configs.stream_k_eligible(False, False, tiles, -(-s // t.block_n), 132) and
                             _configs.sm90_stream_k(bhs, s, s, t.block_m, t.block_n, 132, fixed, group))
    assert taken == {(64, 2048): False, (64, 4096): False, (64, 8192): False, (64, 16384): False, (128, 1024): True,
                     (128, 2048): True, (128, 4096): True, (128, 8192): True, (128, 16384): True}


def test_stream_k_workspace_layout_matches_the_kernel():
    """The flags' bytes and the grid they cover, as cuda_src/flash_fwd_sm90.cu sizes them; the workspace per (block,
    consumer warpgroup): 128 threads x (DP / 8 + 1) float4."""
    src = (ROOT / "cuda_src" / "flash_fwd_sm90.cu").read_text()
    flags = int(re.search(r"constexpr int SM90_SK_FLAGS = (\d+);", src).group(1))
    assert flags * 4 == _walk.SK_FLAG_BYTES and flags == 4 * _configs.SM90_SK_MAX_GRID
    assert "return reinterpret_cast<int*>(p.o_accum) + 4 * block + cw;" in src
    assert "(size_t)(block * NWG + cw) * (DF + 1) * 128 + tid" in src
    assert _walk.sk_bytes(132, 2, 128) == 4096 + 132 * 2 * 17 * 128 * 16
    assert _walk.sk_bytes(132, 3, 64) == 4096 + 132 * 3 * 9 * 128 * 16
    assert _walk.sk_bytes(132, 2, 96) == _walk.sk_bytes(132, 2, 128)  # (96 columns take two 64-column chunks)


def test_stream_k_workspace_per_stream_and_none_when_captured(monkeypatch):
    """One workspace per (device, stream) -- per thread on the per-thread default stream -- made once (its flags
    zeroed on that stream) and kept, a larger one when outgrown (the old one kept); none (0) for a launch being
    captured."""
    import threading

    class Mem:
        def __init__(self, ptr):
            self.ptr = ptr

    made = []

    def alloc(device, stream, nbytes):
        made.append((device, stream, nbytes))
        return Mem(4096 * len(made))

    monkeypatch.setattr(_walk, "_alloc_zeroed_flags", alloc)
    monkeypatch.setattr(_walk, "_workspaces", {})
    monkeypatch.setattr(_walk, "_outgrown", [])
    capturing = set()
    monkeypatch.setattr(_walk, "capturing", lambda stream: stream in capturing)
    a = _walk.sk_workspace(0, 111, 1000)
    assert a and _walk.sk_workspace(0, 111, 900) == a and _walk.sk_workspace(0, 222, 900) not in (0, a)
    assert made[0] == (0, 111, 1000) and _walk.sk_workspace(1, 111, 900) not in (0, a)
    big = _walk.sk_workspace(0, 111, 5000)
    assert big != a and _walk.sk_workspace(0, 111, 1000) == big and _walk._outgrown[0][0] == a
    capturing.add(333)
    assert _walk.sk_workspace(0, 333, 1000) == 0
    mine = _walk.sk_workspace(0, _walk.PER_THREAD_STREAM, 100)
    other = []
    th = threading.Thread(target=lambda: other.append(_walk.sk_workspace(0, _walk.PER_THREAD_STREAM, 100)))
    th.start()
    th.join()
    assert other[0] not in (0, mine) and _walk.sk_workspace(0, _walk.PER_THREAD_STREAM, 100) == mine


def test_stream_k_kernels_are_their_own():
    """Stream-K's code is in kernels of its own (the kernel's SK): the configured kernels' names are those without
    it, the SK form needs the persistent form and no causal mask, and every persistent tile without a mask has its SK
    kernel among those CI compiles."""
    from dataclasses import replace

    t = _configs.sm90_fwd_tile(128, False, 2048)
    plain, sk = (_configs.sm90_fwd_spec("float16", 128, False, u).name for u in (t, replace(t, stream_k=True)))
    assert sk == plain[:-1] + ", true>" and not plain.endswith("true, true>")
    with pytest.raises(ValueError, match="persistent"):
        replace(_configs.sm90_fwd_tile(256, False, 2048), stream_k=True)
    with pytest.raises(ValueError, match="causal"):
        _configs.sm90_fwd_spec("float16", 128, True, replace(_configs.sm90_fwd_tile(128, True, 2048), stream_k=True))
    names = {s.name for s in _configs.sm90_fwd_specs()}
    for d in (64, 128):
        for keys in _configs.SM90_FWD_KEY_BOUNDS:
            u = _configs.sm90_fwd_tile(d, False, keys)
            if u.persistent:
                assert _configs.sm90_fwd_spec("bfloat16", d, False, replace(u, stream_k=True)).name in names
