"""CPU: ring attention (cuflash.distributed) without torch or a GPU: the sharding index maps and their round trips,
the per-step mask classification and call plan (zigzag's equal causal work per rank and step), the LSE merge with
rows that saw no key, and the whole ring -- forward and backward, N = 1-4 simulated ranks in lock-step with the
float64 attention of cuflash.reference -- against the unsharded reference. (GPU: tests/test_distributed.py.)"""
import itertools

import numpy as np
import pytest

from cuflash import distributed as cd
from cuflash import reference


def _rng(*key):
    return np.random.default_rng(abs(hash(key)) % 2**32)


# ------------------------------------------------------------------------------------------ sharding
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_shard_maps_round_trip(layout, n):
    per = 2 if layout == "zigzag" else 1
    seqlen = n * per * 3
    idx = [cd.shard_indices(seqlen, r, n, layout) for r in range(n)]
    assert sorted(np.concatenate(idx).tolist()) == list(range(seqlen))  # a partition of the positions
    assert all(len(i) == seqlen // n for i in idx)
    perm = cd.unshard_indices(seqlen, n, layout)
    assert (np.concatenate(idx)[perm] == np.arange(seqlen)).all()
    x = _rng(layout, n).standard_normal((2, seqlen, 3, 4))
    shards = [cd.shard(x, r, n, layout) for r in range(n)]
    for r in range(n):
        assert (shards[r] == x[:, idx[r]]).all()
    assert (cd.unshard(shards, layout) == x).all()
    assert (np.concatenate(shards, axis=1)[:, perm] == x).all()
    lse = x[:, :, :, 0].transpose(0, 2, 1)  # [b, h, s]: the sequence on dim 2
    assert (cd.unshard([cd.shard(lse, r, n, layout, dim=2) for r in range(n)], layout, dim=2) == lse).all()


def test_zigzag_chunks():
    assert [cd.chunks_of(r, 4) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert [cd.chunks_of(r, 3, "contiguous") for r in range(3)] == [(0,), (1,), (2,)]
    assert cd.num_chunks(4) == 8 and cd.num_chunks(4, "contiguous") == 4


@pytest.mark.parametrize("seqlen,n,layout", [(6, 2, "zigzag"), (10, 4, "zigzag"), (7, 2, "contiguous"), (0, 1, "zigzag"),
                                             (3, 4, "contiguous")])
def test_shard_refuses_uneven_seqlen(seqlen, n, layout):
    with pytest.raises(ValueError, match="seqlen"):
        cd.shard(np.zeros((1, seqlen, 1, 8)), 0, n, layout)


def test_bad_layout_and_world_size():
    with pytest.raises(ValueError, match="layout"):
        cd.chunks_of(0, 2, "striped")
    with pytest.raises(ValueError, match="world_size"):
        cd.chunks_of(0, 0)
    with pytest.raises(ValueError, match="shards"):
        cd.unshard([np.zeros((1, 4, 1, 8)), np.zeros((1, 6, 1, 8))])


# ------------------------------------------------------------------------------------------ schedule
def test_classify():
    assert cd.classify(3, 5, False) == cd.FULL
    assert cd.classify(3, 2, True) == cd.FULL
    assert cd.classify(3, 3, True) == cd.DIAG
    assert cd.classify(3, 4, True) == cd.NONE


def _coverage(q_chunks, kv_chunks, causal, c=3):
    """The (row, key) pairs the plan's calls attend to, in global positions, against the causal mask."""
    seen = set()
    for b in cd.plan_step(q_chunks, kv_chunks, causal):
        assert b.q0 < b.q1 and b.k0 < b.k1
        for a, kk in itertools.product(range(b.q0 * c, b.q1 * c), range(b.k0 * c, b.k1 * c)):
            i = q_chunks[a // c] * c + a % c
            j = kv_chunks[kk // c] * c + kk % c
            if not b.causal or kk - b.k0 * c <= a - b.q0 * c:  # a square causal call: top-left aligned
                assert (i, j) not in seen, "a pair attended twice"
                seen.add((i, j))
    want = {(q_chunks[a // c] * c + a % c, kv_chunks[kk // c] * c + kk % c)
            for a in range(len(q_chunks) * c) for kk in range(len(kv_chunks) * c)}
    if causal:
        want = {(i, j) for i, j in want if j <= i}
    return seen == want


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_plan_covers_the_mask_exactly(layout, causal, n):
    for r, s in itertools.product(range(n), range(n)):
        assert _coverage(cd.chunks_of(r, n, layout), cd.chunks_of(cd.ring_source(r, s, n), n, layout), causal)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_zigzag_is_one_call_per_step_and_balanced(n):
    """Zigzag: every (rank, step) is a single call of the same work (one chunk-pair area x 2), so no rank waits for
    another at any step; contiguous sharding's causal work is uneven."""
    for r, s in itertools.product(range(n), range(n)):
        mine, theirs = cd.chunks_of(r, n), cd.chunks_of(cd.ring_source(r, s, n), n)
        blocks = cd.plan_step(mine, theirs, True)
        assert len(blocks) == 1
        assert cd.visible_pairs(mine, theirs, True) == 2.0
        b = blocks[0]
        assert b.causal == (s == 0)
        assert (b.q1 - b.q0) * (b.k1 - b.k0) == (4 if s == 0 else 2)  # own shard: causal 2x2 = 2 visible pairs
    if n > 1:
        work = [sum(cd.visible_pairs((r,), (cd.ring_source(r, s, n),), True) for s in range(n)) for r in range(n)]
        assert work == [r + 0.5 for r in range(n)]


def test_plan_skips_and_merges():
    assert cd.plan_step((0,), (3,), True) == []
    assert cd.plan_step((0, 7), (2, 5), True) == [cd.Block(1, 2, 0, 2, False)]
    assert cd.plan_step((1, 6), (0, 7), True) == [cd.Block(0, 2, 0, 1, False)]
    assert cd.plan_step((2,), (2,), True) == [cd.Block(0, 1, 0, 1, True)]
    assert cd.plan_step((0, 7), (2, 5), False) == [cd.Block(0, 2, 0, 2, False)]
    # not increasing: diagonals are separate causal calls
    assert cd.plan_step((5, 2), (5, 2), True) == [cd.Block(0, 1, 0, 1, True), cd.Block(0, 1, 1, 2, False),
                                                   cd.Block(1, 2, 1, 2, True)]


# ------------------------------------------------------------------------------------------ merge
def test_merge_matches_one_softmax_and_keeps_empty_rows():
    rng = _rng("merge")
    b, s, h, d, sk = 2, 6, 3, 8, 10
    q, k, v = rng.standard_normal((b, s, h, d)), rng.standard_normal((b, sk, h, d)), rng.standard_normal((b, sk, h, d))
    o, lse = reference.attention_forward(q, k, v)
    o1, l1 = reference.attention_forward(q, k[:, :4], v[:, :4])
    o2, l2 = reference.attention_forward(q, k[:, 4:], v[:, 4:])
    om, lm = cd.merge_partials(o1, l1, o2, l2)
    assert np.abs(om - o).max() < 1e-13 and np.abs(lm - lse).max() < 1e-13
    # a side that saw no key (LSE -inf, O 0) leaves the other unchanged; both sides empty: O 0, LSE -inf, no NaN
    empty_o, empty_l = np.zeros_like(o1), np.full_like(l1, -np.inf)
    with np.errstate(all="raise"):
        om, lm = cd.merge_partials(empty_o, empty_l, o1, l1)
        assert (om == o1).all() and (lm == l1).all()
        om, lm = cd.merge_partials(o1, l1, empty_o, empty_l)
        assert (om == o1).all() and (lm == l1).all()
        om, lm = cd.merge_partials(empty_o, empty_l, empty_o, empty_l)
    assert (om == 0).all() and np.isneginf(lm).all()
    # mixed rows: row 0 of head 0 empty on one side only
    l1m = l1.copy()
    l1m[:, 0, 0] = -np.inf
    o1m = o1.copy()
    o1m[:, 0, 0] = 0
    om, lm = cd.merge_partials(o1m, l1m, o2, l2)
    assert np.allclose(om[:, 0, 0], o2[:, 0, 0]) and np.allclose(lm[:, 0, 0], l2[:, 0, 0])
    # large LSEs (no overflow: weights relative to the max)
    om, lm = cd.merge_partials(o1, l1 + 800.0, o2, l2 + 800.0)
    assert np.isfinite(om).all() and np.abs(lm - (lse + 800.0)).max() < 1e-10


# ------------------------------------------------------------------------------------------ the ring
def _run_ring(n, layout, causal, b=2, h=4, hk=2, d=16, chunk=3, scale=None, seed=0):
    per = 2 if layout == "zigzag" else 1
    seqlen = n * per * chunk
    rng = _rng(n, layout, causal, h, hk, chunk, seed)
    q = rng.standard_normal((b, seqlen, h, d))
    k = rng.standard_normal((b, seqlen, hk, d))
    v = rng.standard_normal((b, seqlen, hk, d))
    do = rng.standard_normal((b, seqlen, h, d))

    def sh(x, dim=1):
        return [cd.shard(x, r, n, layout, dim) for r in range(n)]

    attn = cd.NumpyAttention()
    outs, lses = cd.simulate_forward(attn, sh(q), sh(k), sh(v), causal, scale, layout)
    grads = cd.simulate_backward(attn, sh(do), sh(q), sh(k), sh(v), outs, lses, causal, scale, layout)
    got = [cd.unshard(outs, layout), cd.unshard(lses, layout, dim=2)] + [cd.unshard(g, layout) for g in grads]
    want = list(reference.attention_forward(q, k, v, scale, causal))
    want += list(reference.attention_backward(do, q, k, v, scale, causal))
    return got, want


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("h,hk", [(4, 4), (4, 2), (6, 1)])
def test_ring_matches_unsharded_reference(n, layout, causal, h, hk):
    got, want = _run_ring(n, layout, causal, h=h, hk=hk)
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert g.shape == w.shape, name
        assert not np.isnan(g).any(), name
        assert np.abs(g - w).max() < 1e-12 * max(1.0, np.abs(w).max()), (name, np.abs(g - w).max())


@pytest.mark.parametrize("n", [2, 3])
def test_ring_chunk_of_one_row_and_scale(n):
    got, want = _run_ring(n, "zigzag", True, chunk=1, scale=0.3, d=8)
    for g, w in zip(got, want):
        assert np.abs(g - w).max() < 1e-12


def test_ring_state_starts_with_no_key():
    """Contiguous causal sharding: rank 0 sees no key of any later shard (every later step is skipped), so its
    running state after step 0 is only its own diagonal; the last rank's first merge starts from O 0, LSE -inf."""
    got, want = _run_ring(4, "contiguous", True)
    assert np.abs(got[0] - want[0]).max() < 1e-12


def test_ring_refuses_bad_shards():
    attn = cd.NumpyAttention()
    z = np.zeros((1, 4, 2, 8))
    with pytest.raises(ValueError, match="k must have q's local seqlen"):
        cd.simulate_forward(attn, [z, z], [z[:, :2], z[:, :2]], [z[:, :2], z[:, :2]])
    odd = np.zeros((1, 3, 2, 8))
    with pytest.raises(ValueError, match="q's local seqlen"):
        cd.simulate_forward(attn, [odd, odd], [odd, odd], [odd, odd])
    with pytest.raises(ValueError, match="nheads_k"):
        cd.simulate_forward(attn, [z], [np.zeros((1, 4, 3, 8))], [np.zeros((1, 4, 3, 8))])
    with pytest.raises(ValueError, match="one shard per rank"):
        cd.simulate_forward(attn, [z, z], [z], [z])
    with pytest.raises(ValueError, match="softmax_scale"):
        cd.simulate_forward(attn, [z], [z], [z], softmax_scale=-1.0)
    with pytest.raises(ValueError, match="layout"):
        cd.simulate_forward(attn, [z], [z], [z], layout="striped")


def test_sim_ring_detects_lost_lockstep():
    a, b = cd.SimRing.create(2)
    with pytest.raises(RuntimeError, match="lock-step"):
        b.wait(a.send_recv((np.zeros(1),)) + 1)


def test_import_without_torch():
    import subprocess
    import sys

    code = ("import sys, cuflash.distributed as cd; assert 'torch' not in sys.modules; "
            "assert 'cupy' not in sys.modules; print(cd.plan_step((0, 3), (0, 3), True))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
