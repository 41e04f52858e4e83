"""CPU: the Hopper forward's persistent form (Sm90FwdTile.persistent, the kernel's PERSIST;
cuflash._configs.SM90_FWD_PERSIST_VARIANTS): the kernel names (the configured ones unchanged), its shared memory (two Q
buffers) said in Python and static_asserted, no score modifier, the offline build of every variant (no spills, no
local memory, no ptxas performance note, with the pip NVRTC and the one CUFLASH_NVRTC_ALT names), and the launch grid
of an explicit persistent tile (at most min_blocks blocks per SM of the stand-ins' 132, one per Q tile at most) on
the memoized, explicit and packed paths with the GPU replaced by bench/diag/host_overhead.py's stand-ins."""
from dataclasses import replace

import pytest

from cuflash import _configs
from cuflash._configs import sm90_fwd_persist_tiles, sm90_fwd_spec, sm90_fwd_tile
from conftest import compile_problems, run_with_stand_ins

VARIANTS = [(d, n) for d in sorted(_configs.SM90_FWD_PERSIST_VARIANTS) for n in _configs.SM90_FWD_PERSIST_VARIANTS[d]]


def test_configured_tiles_are_not_persistent_and_keep_their_names():
    for d in _configs.SM90_HEADDIMS:
        assert not sm90_fwd_tile(d, False).persistent
        for causal, mod in _configs.MASK_MODES:
            t = sm90_fwd_tile(d, causal, None, mod)
            assert sm90_fwd_spec("float16", d, causal, mod=mod) == sm90_fwd_spec("float16", d, causal,
                                                                                 replace(t, persistent=False), mod)
    # the persistent kernels compiled ahead of time are those the key-count selection takes: head dims 64 and 128
    # (d128: 128-key stages causal or not up to 1024 keys, 160-key stages past them), causal and not, fp16 and bf16,
    # with and without o_tma (d64: the 16-byte stores only)
    pers = [s.name for s in _configs.sm90_fwd_specs() if s.name.count(",") == 13 and s.name.endswith(", true>")]
    want = set()
    for d in (64, 128):
        for causal in (False, True):
            for n in (_configs.SM90_FWD_SHORT_MAX_SEQLEN_K, _configs.SM90_FWD_SHORT_MAX_SEQLEN_K + 1, 1 << 20):
                t = sm90_fwd_tile(d, causal, n)
                if t.persistent:
                    want |= {sm90_fwd_spec(dt, d, causal, replace(t, o_tma=o)).name for dt in _configs.DTYPES
                             for o in ((True, False) if t.o_tma else (False,))}
    assert len(pers) == len(set(pers)) and set(pers) == want and len(want) == 20


@pytest.mark.parametrize("d,name", VARIANTS)
def test_variant_names_and_shared_memory(d, name):
    t = sm90_fwd_persist_tiles(d)[name]
    assert t.persistent
    dp = -(-d // 64) * 64
    for causal in (False, True):
        v = sm90_fwd_spec("bfloat16", d, causal, t)
        assert v.name.endswith(f", 0, {'true' if t.o_tma else 'false'}, {t.min_blocks}, true>")
        assert v.threads == t.threads
        # two Q buffers; bar_q, empty_q per buffer and four barriers per stage; each buffer's tile index
        assert v.smem == (2 * t.block_m + 2 * t.stages * t.block_n) * dp * 2 + (4 + 4 * t.stages) * 8 + 8 + 1024
        assert v.smem <= _configs.SM90_SMEM_PER_BLOCK


def test_no_dropout_and_d256_does_not_fit():
    t = sm90_fwd_persist_tiles(128)["persist"]
    with pytest.raises(ValueError, match="persistent form takes no dropout"):
        sm90_fwd_spec("float16", 128, False, t, _configs.MOD_SCORE_DROPOUT)
    assert sm90_fwd_spec("float16", 128, False, t, _configs.MOD_SCORE).name.endswith(", 1, true, 1, true>")  # allowed
    with pytest.raises(ValueError, match="do not fit an SM"):
        sm90_fwd_spec("float16", 256, False, replace(sm90_fwd_tile(256, False), persistent=True))


def test_kernel_static_assert_checks_the_two_buffer_layout():
    from cuflash._loader import compile_offline

    t = sm90_fwd_persist_tiles(128)["persist"]
    one_buffer = sm90_fwd_spec("float16", 128, False, replace(t, persistent=False)).smem
    name = sm90_fwd_spec("float16", 128, False, t).name.replace(f", {sm90_fwd_spec('float16', 128, False, t).smem},",
                                                                  f", {one_buffer},")
    with pytest.raises(RuntimeError, match="host smem size must match the layout"):
        compile_offline("flash_fwd_sm90.cu", [name], "90a", verbose=False)


def _variant_specs():
    out = []
    for d, name in VARIANTS:
        t = sm90_fwd_persist_tiles(d)[name]
        for dt in ("float16", "bfloat16"):
            for causal in (False, True):
                out.append(sm90_fwd_spec(dt, d, causal, t))
                if d != 64:  # (d64's variant takes the 16-byte stores: _configs.SM90_FWD_PERSIST_VARIANTS)
                    out.append(sm90_fwd_spec(dt, d, causal, replace(t, o_tma=not t.o_tma)))
    return out


def test_variants_compile_spill_free_under_both_nvrtcs():
    """Every variant, fp16 and bf16, causal and not, both epilogues at d96 and d128: no spills, no local memory, no
    ptxas note (C75xx) -- with the pip NVRTC, and with CUFLASH_NVRTC_ALT's when set."""
    bad = compile_problems(_variant_specs())
    assert not bad, bad


_BODY = r"""
from cuflash import _configs, _fwd_sm90, _mods
from cuflash._validate import check_qkv
from cuflash._varlen import check_varlen

for d, shapes in (("128", ((2, 300, 8), (2, 777, 2))), ("64", ((2, 300, 8), (2, 777, 2))),
                  ("128", ((16, 1024, 16), (16, 1024, 16)))):
    (b, sq, h), (_, sk, hk) = shapes
    t = _configs.sm90_fwd_persist_tiles(int(d))["persist"]
    q = T((b, sq, h, int(d)), torch.float16)
    k, v = T((b, sk, hk, int(d)), torch.float16), T((b, sk, hk, int(d)), torch.float16)
    qa, ka, va = check_qkv(q, k, v)
    for causal in (False, True):
        rec, _ = launches(lambda: _fwd_sm90.make_plan(qa, ka, va, None, causal, "auto", tile=t).run(qa.ptr, ka.ptr,
                                                                                                     va.ptr))
        res[f"plan {d} {b} {sq} {causal}"] = [[r[0], list(r[1])] for r in rec]
    rec, _ = launches(lambda: _fwd_sm90.forward(qa, ka, va, None, True, tile=t))
    res[f"forward {d} {b} {sq}"] = [[r[0], list(r[1])] for r in rec]
    mods = _mods.resolve(False, (-1, -1), 30.0, None, sq, sk, int(d) ** -0.5)
    tm = _configs.sm90_fwd_mod_persist_tiles(int(d))["persist"]
    rec, _ = launches(lambda: _fwd_sm90.forward(qa, ka, va, None, False, tile=tm, mods=mods))
    res[f"mod {d} {b} {sq}"] = [[r[0], list(r[1])] for r in rec]
for d, sq, causal, cap in ((128, 4096, True, 50.0), (128, 8192, True, 50.0), (128, 8192, False, 50.0),
                           (64, 8192, False, 50.0), (64, 16384, False, 50.0), (64, 2048, True, 50.0),
                           (96, 4096, False, 50.0), (96, 4096, True, 50.0), (96, 8192, False, 50.0),
                           (128, 4096, True, 0.0)):
    q, k, v = (T((1, sq, 8, d), torch.float16) for _ in range(3))
    qa, ka, va = check_qkv(q, k, v)
    mods = _mods.resolve(causal, (-1, -1), cap, None, sq, sq, d ** -0.5) if cap else None
    rec, _ = launches(lambda: _fwd_sm90.forward(qa, ka, va, None, causal, mods=mods))
    res[f"configured mod {d} {sq} {causal} {cap}"] = [[r[0], list(r[1])] for r in rec]
qv, kv_ = T((700, 8, 128), torch.float16), T((900, 2, 128), torch.float16)
vv = T((900, 2, 128), torch.float16)
cq, ck = T((4,), torch.int32), T((4,), torch.int32)
q4, k4, v4, packed = check_varlen(qv, kv_, vv, cq, ck, 350, 300)
t = _configs.sm90_fwd_persist_tiles(128)["persist"]
rec, _ = launches(lambda: _fwd_sm90.forward(q4, k4, v4, None, True, tile=t, packed=packed))
res["packed"] = [[r[0], list(r[1])] for r in rec]
rec, _ = launches(lambda: _fwd_sm90.forward(q4, k4, v4, None, True, "bh", tile=t, packed=packed))
res["packed bh"] = [[r[0], list(r[1])] for r in rec]
for b, sq, h, causal, order, tile in ((2, 8192, 16, True, "auto", None), (1, 8191, 16, True, "auto", "persist"),
                                      (2, 8192, 16, False, "auto", None), (2, 8192, 16, False, "qtile", None),
                                      (2, 8192, 16, False, "stream_k", None), (2, 8000, 16, False, "auto", None),
                                      (2, 8192, 16, False, "bh", None),
                                      (2, 8192, 16, True, "qtile", None),
                                      (1, 300, 2, True, "bh", "persist"), (1, 300, 2, False, "auto", None),
                                      (1, 65536, 16, True, "auto", None), (1, 8192, 2, True, "auto", None)):
    q, k, v = (T((b, sq, h, 128), torch.float16) for _ in range(3))
    qa, ka, va = check_qkv(q, k, v)
    t = tile and _configs.sm90_fwd_persist_tiles(128)[tile]
    lau, grid, fields, _ = _fwd_sm90.launch_setup(qa, ka, va, None, causal, order, (sq * 256, 256, 128), tile=t)
    res[f"walk {b} {sq} {h} {causal} {order} {tile}"] = [lau.spec.name, fields["walk_group"], fields["walk_slot"],
                                                         list(grid)]
for d, sq, sk, h in ((120, 2048, 3000, 10), (120, 2048, 1000, 10), (64, 1920, 3000, 16)):  # kernels 128 and 64
    q = T((1, sq, h, d), torch.float16)
    k, v = (T((1, sk, 2, d), torch.float16) for _ in range(2))
    qa, ka, va = check_qkv(q, k, v)
    lau, grid, fields, _ = _fwd_sm90.launch_setup(qa, ka, va, None, False, "auto", (sq * h * d, h * d, d))
    res[f"walk d{d} {sq} {sk}"] = [lau.spec.name, fields["walk_slot"]]
for b, sq in ((8, 2048), (4, 4096), (2, 8192), (2, 3000)):  # head dim 64 without a mask: ragged last Q tiles
    q, k, v = (T((b, sq, 32, 64), torch.float16) for _ in range(3))
    qa, ka, va = check_qkv(q, k, v)
    lau, grid, fields, _ = _fwd_sm90.launch_setup(qa, ka, va, None, False, "auto", (sq * 2048, 2048, 64))
    res[f"walk64 {b} {sq}"] = [lau.spec.name, fields["walk_group"], fields["walk_slot"], list(grid)]
# the dynamic walk's slot: put in per call by the memoized plan (the stream's), and by the explicit path
from cuflash import _walk
q, k, v = (T((2, 2048, 32, 64), torch.float16) for _ in range(3))
qa, ka, va = check_qkv(q, k, v)
plan = _fwd_sm90.make_plan(qa, ka, va, None, True, "auto")
res["plan walk"] = [plan.walk, [launches(lambda: plan.run(qa.ptr, ka.ptr, va.ptr))[0][0][2] for _ in range(2)],
                    launches(lambda: _fwd_sm90.forward(qa, ka, va, None, True))[0][0][2],
                    _walk.SLOT_OFFSET, dict(_walk.FWD_SLOTS.streams).__len__()]
q, k, v = (T((1, 4224, 4, 128), torch.float16) for _ in range(3))
qa, ka, va = check_qkv(q, k, v)
plan = _fwd_sm90.make_plan(qa, ka, va, None, False, "auto")  # 132 Q tiles of the same work: one whole wave, fixed
res["plan no walk"] = [plan.walk, plan.sk, launches(lambda: plan.run(qa.ptr, ka.ptr, va.ptr))[0][0][2]]
# stream-K's workspace: put in per call by the plan (the stream's, made once) and by the explicit path
_made = []
_stand_in = _walk._alloc_zeroed_flags
_walk._alloc_zeroed_flags = lambda device, stream, nbytes: (_made.append(nbytes), _stand_in(device, stream, nbytes))[1]
_walk._workspaces.clear()
q, k, v = (T((2, 4096, 16, 128), torch.float16) for _ in range(3))
qa, ka, va = check_qkv(q, k, v)
plan = _fwd_sm90.make_plan(qa, ka, va, None, False, "stream_k")  # 1024 Q tiles of the same work: 7.8 waves
from cuflash import _fwd
plan.kv = _fwd.KvFields(plan, None, ka.shape, 1)
_run = lambda n: launches(lambda: plan.run_kv(qa.ptr, ka.ptr, va.ptr, (2, n, 16, 128), (n * 2048, 2048, 128),  # noqa: E731
                                              (n * 2048, 2048, 128)))[0][0][2]
res["plan sk"] = [plan.walk, list(plan.sk), [launches(lambda: plan.run(qa.ptr, ka.ptr, va.ptr))[0][0][2] for _ in range(2)],
                  launches(lambda: _fwd_sm90.forward(qa, ka, va, None, False, "stream_k"))[0][0][2],
                  [_run(4096), _run(8192)], _run(plan.sk[2] + 1), _made]
"""


@pytest.fixture(scope="module")
def res():
    return run_with_stand_ins(_BODY)


@pytest.mark.parametrize("d,b,sq,h", [(128, 2, 300, 8), (64, 2, 300, 8), (128, 16, 1024, 16)])
def test_persistent_grid(res, d, b, sq, h):
    t = sm90_fwd_persist_tiles(d)["persist"]
    tiles = -(-sq // t.block_m) * h * b
    for causal in (False, True):
        (name, grid), = res[f"plan {d} {b} {sq} {causal}"]
        sk = not causal and _configs.sm90_fwd_stream_k_auto(d, sq, sq, t.block_m) and tiles > 132 and tiles % 132
        assert name == sm90_fwd_spec("float16", d, causal, replace(t, stream_k=bool(sk))).name
        assert grid == [min(tiles, 132 * t.min_blocks), 1, 1]
    (name, grid), = res[f"forward {d} {b} {sq}"]
    assert name == sm90_fwd_spec("float16", d, True, t).name and grid == [min(tiles, 132), 1, 1]


def test_persistent_modifier_tile_launch(res):
    """A soft-capped call on the modifier kernels' persistent form (an explicit tile) launches that kernel on the
    persistent grid: at most a block per SM, one per Q tile."""
    for d, (b, sq, h) in (("128", (2, 300, 8)), ("64", (2, 300, 8)), ("128", (16, 1024, 16))):
        tm = _configs.sm90_fwd_mod_persist_tiles(int(d))["persist"]
        (name, grid), = res[f"mod {d} {b} {sq}"]
        want = {sm90_fwd_spec("float16", int(d), False, u, _configs.MOD_SCORE).name
                for u in (tm, replace(tm, o_tma=False))}
        assert name in want and grid == [min(b * h * -(-sq // tm.block_m), 132), 1, 1]


@pytest.mark.parametrize("d,sq,causal,want", [(128, 4096, True, "persist"), (128, 8192, True, None),
                                               (128, 8192, False, "persist n160"), (64, 8192, False, "persist"),
                                               (64, 16384, False, None), (64, 2048, True, None),
                                               (96, 4096, False, "persist"), (96, 4096, True, None),
                                               (96, 8192, False, None)])
def test_configured_modifier_calls_take_the_persistent_form(res, d, sq, causal, want):
    """A soft-capped call of fixed lengths (tile None) takes the modifier kernels' persistent form where
    SM90_FWD_MOD_PERSIST names it for its keys and band (causal: a right edge; no mask: "flat"), the one-tile
    modifier kernel elsewhere; the plain call keeps its own configured tile."""
    (name, grid), = res[f"configured mod {d} {sq} {causal} 50.0"]
    if want is None:
        tile = sm90_fwd_tile(d, False, sq, _configs.MOD_SCORE)
        assert not tile.persistent and grid[0] * grid[1] * grid[2] == 8 * -(-sq // tile.block_m)  # a block per Q tile
    else:
        tile = _configs.sm90_fwd_mod_persist_tiles(d)[want]
        assert grid == [132, 1, 1]
    assert name == sm90_fwd_spec("float16", d, False, tile, _configs.MOD_SCORE).name
    assert _configs.sm90_fwd_mod_tile(d, sq, "causal" if causal else "flat") == (None if want is None else tile)
    (plain, _), = res["configured mod 128 4096 True 0.0"]
    assert plain == sm90_fwd_spec("float16", 128, True, sm90_fwd_tile(128, True, 4096)).name


def test_persistent_packed_grid(res):
    (name, grid), = res["packed"]
    t = sm90_fwd_persist_tiles(128)["persist"]
    assert name == sm90_fwd_spec("float16", 128, True, t).name
    assert grid == [min((700 // t.block_m + 3) * 8, 132), 1, 1]  # Packed.grid: x (3 sequences) by 8 heads


def test_persistent_packed_grid_ignores_the_walk(res):
    assert res["packed bh"] == res["packed"]  # (the kernel walks packed tiles in element order whatever grid_order)


@pytest.mark.parametrize("b,sq,h,causal,order,tile,group,kind", [
    (2, 8192, 16, True, "auto", None, 32, "fixed"),  # 160-key form; "qtile" unbalanced (1.03 vs 1.003): fixed "bh"
    (1, 8191, 16, True, "auto", "persist", 2, "dynamic"),  # fixed "qtile" 1.03 in the list model, dynamic below 1.01
    (2, 8192, 16, False, "auto", None, 1, "sk"),  # 2048 equal tiles, 15.5 waves: stream-K (SM90_FWD_SK_MIN_SEQLEN_K)
    (2, 8192, 16, False, "stream_k", None, 1, "sk"),  # (forced: the same)
    (2, 8000, 16, False, "auto", None, 1, "fixed"),  # a ragged last Q tile: not under "auto"
    (2, 8192, 16, False, "bh", None, 32, "fixed"),  # (an explicit order: fixed)
    (2, 8192, 16, False, "qtile", None, 1, "fixed"),  # (an explicit order: fixed)
    (2, 8192, 16, True, "qtile", None, 1, "fixed"), (1, 300, 2, True, "bh", "persist", 2, "fixed"),  # explicit: fixed
    (1, 300, 2, False, "auto", None, 1, "fixed"),  # 6 tiles: fewer than the grid
    (1, 65536, 16, True, "auto", None, 1, "dynamic"),  # "qtile" 1.015 against "bh" 1.000: a head's tiles, dynamic
    (1, 8192, 2, True, "auto", None, 1, "fixed")])  # 128 tiles, one wave: the walks alike
def test_persistent_tile_walk(res, b, sq, h, causal, order, tile, group, kind):
    """The walk a persistent launch carries (walk_group, walk_slot: the kernel's Sm90FwdTiles / Sm90FwdWalk) under
    "auto": the dynamic walk where _configs.sm90_persist_dynamic names a group (walk_slot _walk.DYNAMIC until the
    launch's slot is put in), else _configs.sm90_persist_walk's fixed one ("bh": every (batch, head) one group;
    "qtile": groups of one), and stream-K where _configs.sm90_fwd_stream_k_auto takes it; an explicit order is fixed;
    "stream_k" (diagnostics): walk_slot _walk.STREAM_K wherever it can run. Stream-K's slot stays _walk.STREAM_K until
    the workspace is put in. The grid is the persistent one whatever the walk."""
    from cuflash import _walk

    name, got_group, slot, grid = res[f"walk {b} {sq} {h} {causal} {order} {tile}"]
    t = sm90_fwd_persist_tiles(128)[tile] if tile else sm90_fwd_tile(128, causal, sq)
    t = replace(t, stream_k=kind == "sk")  # (stream-K: the tile's SK kernel)
    assert t.persistent and name == sm90_fwd_spec("float16", 128, causal, t).name
    assert got_group == group and slot == {"dynamic": _walk.DYNAMIC, "sk": _walk.STREAM_K, "fixed": -1}[kind]
    assert grid == [min(-(-sq // t.block_m) * b * h, 132), 1, 1]


@pytest.mark.parametrize("d,sq,sk,h,sk_walk",
                         [(120, 2048, 3000, 10, True), (120, 2048, 1000, 10, False), (64, 1920, 3000, 16, False)])
def test_stream_k_by_kernel_head_dim(res, d, sq, sk, h, sk_walk):
    """grid_order "auto" walks by stream-K on the head-dim-128 kernel whatever the call's head dim (120: its columns
    past 120 zero-filled), from SM90_FWD_SK_MIN_SEQLEN_K keys (1000: below), and not on the head-dim-64 kernel (not in
    SM90_FWD_SK_MIN_SEQLEN_K), though its persistent launch could (10 whole Q tiles of 192 rows x 16 heads = 160 on 132
    blocks: stream_k_eligible); 160 Q tiles of 10 heads at 120, GQA to 2 KV heads."""
    from cuflash import _walk

    name, slot = res[f"walk d{d} {sq} {sk}"]
    kd = _configs.kernel_headdim(d, _configs.SM90_HEADDIMS)
    t = sm90_fwd_tile(kd, False, sk)
    assert t.persistent and _configs.stream_k_eligible(False, False, -(-sq // t.block_m) * h, -(-sk // t.block_n), 132)
    t = replace(t, stream_k=sk_walk)
    assert name == sm90_fwd_spec("float16", kd, False, t).name
    assert (slot == _walk.STREAM_K) == sk_walk


@pytest.mark.parametrize("b,sq,group", [(8, 2048, 16), (4, 4096, 16), (2, 8192, 0), (2, 3000, 0)])
def test_persistent_tile_walk_without_a_mask(res, b, sq, group):
    """Head dim 64 without a mask (Q tiles of 192 rows, 32 heads): at 2k and 4k every (batch, head)'s last Q tile
    holds 128 or 64 rows, its other warpgroups take their turns empty, and the fixed waves leave the largest block
    1.06x the mean in the list model where the dynamic walk, the light tiles last in each group, gives 1.02x (stream-K
    1.03: equal pair counts of unequal work); at 8k the wave count and at 3000 rows the share of light tiles leave no
    gain of 0.01 (fixed "qtile")."""
    from cuflash import _walk

    name, got_group, slot, grid = res[f"walk64 {b} {sq}"]
    t = sm90_fwd_tile(64, False, sq)
    assert t.persistent and name == sm90_fwd_spec("float16", 64, False, t).name
    assert (got_group, slot) == ((group, _walk.DYNAMIC) if group else (1, -1))
    assert grid == [132, 1, 1]


def test_plans_put_the_walk_slot_in_per_call(res):
    """A memoized plan of the dynamic walk binds walk_slot -1 and puts the stream's slot in at each call (the same
    slot for the same stream), as the explicit path does; a plan of a fixed walk launches walk_slot -1."""
    import struct

    from cuflash import _walk

    walk, (raw1, raw2), raw3, off, n = res["plan walk"]
    slot = lambda raw: struct.unpack_from("<q", bytes.fromhex(raw), off)[0]  # noqa: E731
    assert walk and slot(raw1) == slot(raw2) == slot(raw3) >= 0 and n == 1
    assert _walk.SLOT_OFFSET == 8 * [n for n, _ in _configs_fwd_params()].index("walk_slot")
    walk, sk, raw = res["plan no walk"]
    assert not walk and sk is None and slot(raw) == -1


def test_plans_put_the_stream_k_workspace_in_per_call(res):
    """A memoized plan of stream-K (grid_order "stream_k") launches walk_slot -1 with o_accum the stream's workspace
    (made once, of the size the kernel's layout needs), as the explicit path does, also at other key counts
    (run_kv); at a key count past the 32-bit segment arithmetic's reach it launches without one (o_accum 0: fixed
    waves)."""
    import struct

    from cuflash import _walk
    from cuflash._params import FWD_PARAMS

    walk, (nbytes, block_n, max_keys), raws, raw_fwd, raw_kv, raw_far, made = res["plan sk"]
    soff = _walk.SLOT_OFFSET
    get = lambda raw, off, f="<q": struct.unpack_from(f, bytes.fromhex(raw), off)[0]  # noqa: E731
    assert not walk and block_n == 160 and nbytes == _walk.sk_bytes(132, 2, 128)
    assert _walk.O_ACCUM_OFFSET == FWD_PARAMS.offsets()["o_accum"][0]
    for raw in (*raws, raw_fwd, *raw_kv):
        assert get(raw, soff) == -1 and get(raw, _walk.O_ACCUM_OFFSET, "<Q") == 0x7000
    assert get(raw_far, _walk.O_ACCUM_OFFSET, "<Q") == 0 and get(raw_far, soff) == -1
    assert made == [nbytes]  # (one workspace for the stream)
    assert max_keys == (2 ** 31 - 1) // ((1024 - 6 * 132) * 132) * 160


def _configs_fwd_params():
    from cuflash._params import FWD_PARAMS

    return list(FWD_PARAMS)


def _walk_by_blocks(walk, bhs, sq, sk, bm, bn, grid):
    """Each block's work under a walk, by the kernel's own index arithmetic (Sm90FwdTiles::tile and ::coords in
    cuda_src/flash_fwd_sm90.cu, written out with loops) and a tile's K / V count from its last row's keys."""
    x_tiles = -(-sq // bm)
    count = x_tiles * bhs
    totals = [0] * grid
    for bid in range(grid):
        k = 0
        while True:
            t = k * grid + (grid - 1 - bid if k & 1 else bid)
            if t >= count:
                break
            x = x_tiles - 1 - (t // bhs if walk == "bh" else t % x_tiles)
            last = min(sk, (x + 1) * bm + sk - sq)  # bottom-right causal
            totals[bid] += max(0, -(-last // bn))
            k += 1
    return totals


@pytest.mark.parametrize("bhs,sq,sk,bm,bn,grid", [(16, 16384, 16384, 128, 160, 132), (32, 8192, 8192, 128, 160, 132),
                                                  (6, 1000, 333, 128, 128, 17), (3, 777, 2000, 192, 128, 5),
                                                  (5, 640, 640, 128, 128, 25)])
def test_walk_model_follows_the_kernels_walks(bhs, sq, sk, bm, bn, grid):
    """persist_walk_spread against the kernel's index arithmetic: the largest block's work over the mean, both walks,
    causal with sq != sk both ways (tiles that see no key), grids that are no multiple of a head's Q tiles."""
    for walk in ("qtile", "bh"):
        tot = _walk_by_blocks(walk, bhs, sq, sk, bm, bn, grid)
        want = max(tot) / (sum(tot) / grid) if sum(tot) else 1.0
        got = _configs.persist_walk_spread(walk, bhs, sq, sk, bm, bn, grid)
        assert got == pytest.approx(want, rel=1e-12), walk


def test_walk_rule_at_the_measured_shapes():
    """The list model's figures the rule rests on (head dim 128, 16 heads, 160-key stages, 132 blocks): "qtile"
    unbalanced at 1 x 16k and 2 x 8k, balanced at 1 x 64k; below SM90_PERSIST_BH_MIN_ROWS "qtile" whatever the model."""
    t = sm90_fwd_persist_tiles(128)["persist n160"]
    spread = lambda w, b, s: _configs.persist_walk_spread(w, b * 16, s, s, 128, 160, 132)  # noqa: E731
    assert spread("qtile", 1, 16384) == pytest.approx(1.539, abs=1e-3) and spread("bh", 1, 16384) < 1.005
    assert spread("qtile", 2, 8192) == pytest.approx(1.032, abs=1e-3) and spread("bh", 2, 8192) < 1.005
    assert spread("qtile", 1, 65536) == pytest.approx(1.015, abs=1e-3) and spread("bh", 1, 65536) < 1.001
    walk = lambda b, s, causal=True: _configs.sm90_persist_walk(causal, b * 16, s, s, t, 132)  # noqa: E731
    assert (walk(1, 16384), walk(2, 8192), walk(1, 65536), walk(4, 4096), walk(1, 16384, False)) == \
        ("bh", "bh", "qtile", "qtile", "qtile")


def test_walk_model_orders_and_spreads():
    """bench.diag.fwd90_walk_model: its walks reproduce the configured list model, "group" is "bh" for one group and
    "qtile" for groups of one head, and dynamic scheduling of equal tiles that fill the blocks is even."""
    import numpy as np

    from bench.diag import fwd90_walk_model as wm
    from cuflash._configs import persist_walk_spread

    for walk in ("qtile", "bh"):  # the diagnostic's own tile list, dealt in the kernel's fixed waves
        work = wm.tile_work(walk, 256, 2048, 192, 128, fixed=1.0)
        t = np.arange(work.size)
        block = np.where((t // 132) % 2 == 1, 131 - t % 132, t % 132)
        totals = np.bincount(block, weights=work, minlength=132)
        assert wm.fixed_spread(walk, 256, 2048, 192, 128, 132, fixed=1.0) == pytest.approx(
            totals.max() / totals.mean(), rel=1e-12)
        assert wm.fixed_spread(walk, 256, 2048, 192, 128, 132) == persist_walk_spread(walk, 256, 2048, 2048, 192, 128,
                                                                                      132)
    assert np.array_equal(wm.tile_work("group", 12, 1000, 128, 128, group=12), wm.tile_work("bh", 12, 1000, 128, 128))
    assert np.array_equal(wm.tile_work("group", 12, 1000, 128, 128, group=1), wm.tile_work("qtile", 12, 1000, 128, 128))
    ragged = wm.tile_work("group", 10, 512, 128, 128, group=4)  # groups of 4, 4, 2 heads
    assert list(ragged[:8]) == [4] * 4 + [3] * 4 and list(ragged[-4:]) == [2, 2, 1, 1]
    assert sorted(ragged) == sorted(wm.tile_work("qtile", 10, 512, 128, 128))
    assert wm.dynamic_spread("qtile", 132, 128, 128, 128, 132) == 1.0  # one tile each
    assert wm.dynamic_spread("bh", 256, 2048, 192, 128, 132, fixed=1.0) < wm.fixed_spread("qtile", 256, 2048, 192, 128,
                                                                                          132, fixed=1.0)
    assert [p[:3] for p in wm.points()][:2] == [(64, 2048, 8), (64, 4096, 4)]  # the configured persistent points
