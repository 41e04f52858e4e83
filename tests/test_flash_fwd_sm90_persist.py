"""GPU: the Hopper forward's persistent form (cuflash._configs.SM90_FWD_PERSIST_VARIANTS, launched through an explicit
tile; configured at head dims 64 and 128 by key count: cuflash._configs.SM90_FWD_LONG_TILES) against the float64 reference and bitwise against the one-tile kernel of the same tile shape
(the same products per tile): ragged tails, seqlen_q != seqlen_k, GQA, causal with rows that see no key (whole Q tiles
of them when seqlen_q > seqlen_k), grids of fewer tiles than SMs and of many tiles per block, packed sequences, and
both tile walks (grid_order "qtile": a (batch, head)'s tiles together; "bh": every head's tile x, then x - 1, ...).
Outputs poisoned (NaN) before each launch. Skipped off compute capability 9.0."""
from dataclasses import replace

import pytest

import cuflash
from cuflash import _configs, _fwd_sm90
from conftest import torch_inputs
from test_flash_fwd_sm90 import _check, _hopper  # noqa: F401 (_hopper: the autouse sm90 skip)
from test_flash_fwd_sm90_minb import _run, check_packed, packed_case

pytestmark = pytest.mark.gpu

VARIANTS = [(d, n) for d in sorted(_configs.SM90_FWD_PERSIST_VARIANTS) for n in _configs.SM90_FWD_PERSIST_VARIANTS[d]]


def _tiles(d, name, o_tma=None):
    t = _configs.sm90_fwd_persist_tiles(d)[name]
    if o_tma is not None:
        t = replace(t, o_tma=o_tma)
    return t, replace(t, persistent=False)


def _stream_k(q, k, causal, tile, packed, grid_order) -> bool:
    """Whether the persistent launch of `tile` walks by stream-K (grid_order "auto" takes it at kernel head dim 128
    from 1k keys: cuflash._configs.sm90_fwd_stream_k_auto)."""
    from cuflash import _walk

    if packed is not None:
        return False
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    fields, _ = _fwd_sm90.persist_walk(grid_order, causal, None, b, h, hk, sq, sk, d, tile, -(-sq // tile.block_m),
                                       q.device.index or 0)
    return fields["walk_slot"] == _walk.STREAM_K


def _both(q, k, v, causal, d, name, o_tma=None, packed=None, grid_order="auto"):
    """The persistent tile's output (walk `grid_order`), bitwise equal to the one-tile kernel's. A stream-K walk
    splits a tile's keys between two blocks and merges their partial rows, so its output is not the one-tile
    kernel's bit for bit: then the fixed walk ("qtile") is compared bitwise and the stream-K output returned for the
    reference check."""
    import torch

    pt, one = _tiles(d, name, o_tma)
    a = _run(q, k, v, causal, pt, packed, grid_order)
    fixed = _run(q, k, v, causal, pt, packed, "qtile") if _stream_k(q, k, causal, pt, packed, grid_order) else a
    b = _run(q, k, v, causal, one, packed)
    assert torch.equal(fixed, b), f"persistent != one-tile: max diff {float((fixed.float() - b.float()).abs().max())}"
    return a


@pytest.mark.parametrize("d,name", VARIANTS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("o_tma", [None, False, True])
def test_against_reference_and_one_tile(d, name, dtype, causal, o_tma):
    if d == 64 and o_tma:
        pytest.skip("d64's persistent variant takes the 16-byte stores")
    q, k, v = torch_inputs((2, 777, 4, d), (2, 901, 2, d), dtype)  # ragged tails, sq != sk, GQA
    _check(_both(q, k, v, causal, d, name, o_tma), q, k, v, causal)


@pytest.mark.parametrize("d,name", VARIANTS)
@pytest.mark.parametrize("b,sq,sk,h", [(1, 64, 64, 1), (3, 65, 300, 2), (3, 1000, 129, 2), (2, 2048, 2048, 4),
                                       (4, 1024, 1024, 40)])
def test_row_counts_and_grids(d, name, b, sq, sk, h):
    """One tile, tiles just past a Q tile, sq > sk causal (Q tiles whose rows see no key: O = 0, LSE -inf), long
    blocks, and many more tiles than SMs (every block walks several)."""
    q, k, v = torch_inputs((b, sq, h, d), (b, sk, h, d), "bfloat16")
    for causal in (False, True):
        _check(_both(q, k, v, causal, d, name), q, k, v, causal)


@pytest.mark.parametrize("d,name", VARIANTS)
def test_lse_of_rows_that_see_no_key(d, name):
    import torch

    from cuflash._validate import check_qkv

    q, k, v = torch_inputs((2, 700, 4, d), (2, 100, 4, d), "float16")
    qa, ka, va = check_qkv(q, k, v)
    pt, one = _tiles(d, name)
    outs = []
    for t in (pt, one):
        out = torch.full_like(q, float("nan"))
        lse = torch.full((2, 4, 700), float("nan"), device="cuda")
        _fwd_sm90.forward(qa, ka, va, None, True, out=out, lse=lse, tile=t)
        outs.append((out, lse))
    (o1, l1), (o2, l2) = outs
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    assert torch.all(o1[:, :600] == 0) and torch.all(torch.isneginf(l1[:, :, :600]))  # rows 0..599 see no key
    assert torch.isfinite(l1[:, :, 600:]).all()


@pytest.mark.parametrize("d,name", VARIANTS)
@pytest.mark.parametrize("causal", [False, True])
def test_packed_sequences(d, name, causal):
    q, k, v, packed = packed_case(d)
    check_packed(_both(q, k, v, causal, d, name, packed=packed), q, k, v, causal)


@pytest.mark.parametrize("d,name", VARIANTS)
@pytest.mark.parametrize("order", ["qtile", "bh", "dynamic"])
@pytest.mark.parametrize("b,sq,sk,h", [(3, 1000, 129, 2), (2, 1024, 1500, 13), (1, 3072, 3072, 12)])
def test_tile_walks(d, name, order, b, sq, sk, h):
    """Every walk of the tiles (the fixed waves in groups of one and of all (batch, head)s, and the dynamic walk
    handing tiles out from a counter) gives the one-tile kernel's output bitwise (each tile's products are the same,
    only which block runs it and when differs): fewer tiles than the grid, and 1.2-2.2 times as many (counts that are
    no multiple of it), causal (sq != sk: rows that see no key) and not."""
    q, k, v = torch_inputs((b, sq, h, d), (b, sk, h, d), "float16")
    for causal in (False, True):
        _check(_both(q, k, v, causal, d, name, grid_order=order), q, k, v, causal)


@pytest.mark.parametrize("d,name", VARIANTS)
def test_packed_sequences_ignore_the_walk(d, name):
    """Packed sequences keep the element-ordered walk under grid_order "bh" (the kernel reads it for fixed lengths)."""
    q, k, v, packed = packed_case(d)
    check_packed(_both(q, k, v, True, d, name, packed=packed, grid_order="bh"), q, k, v, True)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_configured_long_keys(dtype):
    """The configuration at head dim 128: past 1024 keys without a causal mask, and from 8192 causal keys, the 160-key
    persistent form (the default call's plan launches it, its tiles walked as _configs.sm90_persist_walk picks),
    against the reference; packed sequences with a longest element past 1024 keys too."""
    import numpy as np
    import torch

    from cuflash import _fwd
    from cuflash._launch import get_launcher

    for (b, sq, sk, h, hk), causal in (((1, 300, 2500, 4, 2), False), ((1, 8192, 8192, 2, 1), True)):
        t = _configs.sm90_fwd_tile(128, causal, sk)
        assert t.persistent and t.block_n == 160
        q, k, v = torch_inputs((b, sq, h, 128), (b, sk, hk, 128), dtype)
        _fwd._PLANS.clear()
        out = cuflash.flash_attn_func(q, k, v, causal=causal)
        plans = [p for p in _fwd._PLANS.values() if isinstance(p, _fwd_sm90.Sm90Plan)]
        want = get_launcher(_configs.sm90_fwd_spec(dtype, 128, causal, t), 0).ptr
        assert any(launch[0] == want for p in plans for launch in p.launches)
        _check(out, q, k, v, causal)
    lens = [2500, 7, 1000]
    qp, kp, vp = (torch.randn(sum(lens), 4 if i == 0 else 2, 128, device="cuda").to(getattr(torch, dtype))
                  for i in range(3))
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device="cuda")
    o = cuflash.flash_attn_varlen_func(qp, kp, vp, cu, cu, max(lens), max(lens))
    for a, n in zip(cu.tolist(), lens):
        _check(o[a:a + n][None], qp[a:a + n][None], kp[a:a + n][None], vp[a:a + n][None], False)


# ------------------------------------------------------------------------------------- the dynamic walk's counters
_COUNTERS = "_ZN7cuflash18sm90_walk_countersE"  # cuflash::sm90_walk_counters (cuda_src/flash_fwd_sm90.cu)


def _counters(tile, causal, dtype="float16", d=128):
    """The counter pairs of the module that holds the kernel of `tile` on device 0, read back ([slots, 2] uint32)."""
    import numpy as np
    from cupy.cuda import driver, runtime

    from cuflash import _walk
    from cuflash._launch import get_launcher

    lau = get_launcher(_configs.sm90_fwd_spec(dtype, d, causal, tile), 0)
    got = driver.moduleGetGlobal(lau.raw.module.ptr, _COUNTERS)
    ptr, size = got if isinstance(got, tuple) else (got, 8 * _walk.SLOTS)
    assert size == 8 * _walk.SLOTS
    host = np.empty((_walk.SLOTS, 2), np.uint32)
    runtime.deviceSynchronize()
    runtime.memcpy(host.ctypes.data, ptr, host.nbytes, runtime.memcpyDeviceToHost)
    return host


@pytest.mark.parametrize("d,name", VARIANTS)
def test_dynamic_walk_repeats_and_leaves_its_counters_zero(d, name):
    """Launches of the dynamic walk one after another on one stream (each block's producer drawing from the stream's
    counter pair, the last block done setting it back), causal and not: every output bitwise the one-tile kernel's,
    and every pair zero after them -- also after launches whose grid is the whole tile count (no draw past the first
    wave)."""
    import torch

    pt, one = _tiles(d, name)
    for causal in (True, False):
        for b, sq, h in ((2, 2048, 8), (1, 300, 2)):
            q, k, v = torch_inputs((b, sq, h, d), (b, sq, h, d), "bfloat16")
            want = _run(q, k, v, causal, one)
            for _ in range(4):
                assert torch.equal(_run(q, k, v, causal, pt, grid_order="dynamic"), want)
        assert not _counters(pt, causal, "bfloat16", d).any()


def on_streams(cases, want, fn, repeats=3):
    """fn(q, k, v) of every case on a stream of its own, `repeats` times each, queued without waiting: each output
    bitwise the case's `want`. Returns the streams."""
    import torch

    streams = [torch.cuda.Stream() for _ in cases]
    outs = [[] for _ in cases]
    torch.cuda.synchronize()
    for _ in range(repeats):
        for i, ((q, k, v), s) in enumerate(zip(cases, streams)):
            with torch.cuda.stream(s):
                outs[i].append(fn(q, k, v))
    torch.cuda.synchronize()
    for w, os_ in zip(want, outs):
        for o in os_:
            assert torch.equal(o, w)
    return streams


def test_dynamic_walk_on_concurrent_streams():
    """Launches of one kernel on three streams at once (problems of different tile counts, queued without waiting):
    each stream's launches draw from their own counter pair, so each output is bitwise the one-tile kernel's."""
    pt, one = _tiles(128, "persist")
    cases = [torch_inputs((b, sq, h, 128), (b, sq, h, 128), "float16") for b, sq, h in
             ((2, 2048, 8), (1, 4000, 6), (3, 1500, 5))]
    want = [_run(q, k, v, True, one) for q, k, v in cases]
    on_streams(cases, want, lambda q, k, v: _run(q, k, v, True, pt, grid_order="dynamic"))
    assert not _counters(pt, True).any()


def test_dynamic_walk_in_a_cuda_graph():
    """flash_attn_func at a shape whose configured walk is dynamic (head dim 64, causal, 2 x 2048 x 32 heads),
    captured into a CUDA graph (its launch takes a counter pair of its own) and replayed on new inputs, between eager
    calls on the stream it was captured on and on the current stream: every replay bitwise the eager output."""
    import torch

    from cuflash import _fwd, _walk
    from cuflash._validate import check_qkv

    q, k, v = torch_inputs((2, 2048, 32, 64), (2, 2048, 32, 64), "float16")
    qa, ka, va = check_qkv(q, k, v)
    _, _, fields, _ = _fwd_sm90.launch_setup(qa, ka, va, None, True, "auto", (2048 * 32 * 64, 32 * 64, 64))
    assert fields["walk_slot"] == _walk.DYNAMIC
    _fwd._PLANS.clear()
    cuflash.flash_attn_func(q, k, v, causal=True)  # warm: the plan exists before capture
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    with torch.cuda.graph(g, stream=side):
        out = cuflash.flash_attn_func(q, k, v, causal=True)
    for _ in range(3):
        fresh = torch_inputs((2, 2048, 32, 64), (2, 2048, 32, 64), "float16")
        for x, y in zip((q, k, v), fresh):
            x.copy_(y)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            side_eager = cuflash.flash_attn_func(*fresh, causal=True)
        g.replay()
        eager = cuflash.flash_attn_func(*fresh, causal=True)
        torch.cuda.synchronize()
        assert torch.equal(out, eager) and torch.equal(side_eager, eager)
    _check(out, q, k, v, True)


@pytest.mark.parametrize("b,sq,dynamic", [(2, 2048, True), (1, 4096, False), (1, 2000, False)])
def test_configured_dynamic_walk_without_a_mask(b, sq, dynamic):
    """Head dim 64 without a mask (32 heads): each (batch, head)'s last Q tile of 192 rows holds 128 rows at 2k, 64 at
    4k and 80 at 2000 (a warpgroup of 16 rows), its warpgroups past seqlen_q taking their turns empty. The configured
    plan walks dynamically where the list model gains (2 x 2k: 704 tiles on 132 blocks), in fixed waves elsewhere (1
    x 4k, 1 x 2000: cuflash._configs.sm90_persist_dynamic); the output is bitwise the one-tile kernel's and within the
    reference's bound, and the counters are left zero."""
    import torch

    from cuflash import _fwd, _walk
    from cuflash._validate import check_qkv

    q, k, v = torch_inputs((b, sq, 32, 64), (b, sq, 32, 64), "bfloat16")
    qa, ka, va = check_qkv(q, k, v)
    _, _, fields, _ = _fwd_sm90.launch_setup(qa, ka, va, None, False, "auto", (sq * 32 * 64, 32 * 64, 64))
    assert (fields["walk_slot"] == _walk.DYNAMIC) == dynamic
    t = _configs.sm90_fwd_tile(64, False, sq)
    assert t.persistent
    _fwd._PLANS.clear()
    out = cuflash.flash_attn_func(q, k, v)
    assert torch.equal(out, _run(q, k, v, False, replace(t, persistent=False)))
    _check(out, q, k, v, False)
    assert not _counters(t, False, "bfloat16", 64).any()
