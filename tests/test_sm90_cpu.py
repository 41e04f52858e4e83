"""CPU: the Hopper forward's host side and build -- the generated wgmma wrappers, the tensor-map arguments
(cuflash._tma), the backend choice (cuflash._fwd_sm90) on hand-made views, the tile table's limits, and the
SASS of an offline sm_90a build (HGMMA, UTMALDG, mbarrier SYNCS, setmaxnreg; no local memory)."""
import importlib.util
import re
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

import cuflash
from cuflash import _configs, _fwd_sm90, _tma
from cuflash._interop import CUPY, Arr

ROOT = Path(__file__).resolve().parent.parent
SMEM_LIMIT_SM90 = 232448  # bytes of dynamic shared memory a block may opt in to on sm_90 (227 KB)


def view(shape, strides=None, ptr=0x10000, dtype="float16"):
    if strides is None:
        strides, acc = [], 1
        for s in reversed(shape):
            strides.insert(0, acc)
            acc *= s
    return Arr(CUPY, None, ptr, tuple(shape), tuple(strides), dtype, 0)


def test_wgmma_header_is_what_the_generator_writes():
    spec = importlib.util.spec_from_file_location("gen_wgmma", ROOT / "cuda_src/common/gen_wgmma.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert (ROOT / "cuda_src/common/wgmma.cuh").read_text() == gen.render()
    text = gen.render()
    for n in gen.NS:  # every shape, both input types, both operand forms
        assert text.count(f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16") == 2
        assert text.count(f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16") == 2
        assert f'"+f"(d[{n // 8 - 1}][3])' in text


def test_attention_map_arguments():
    q = view((2, 100, 4, 96))
    m = _tma.attention_map_spec("float16", q.shape, q.strides, 128)
    assert m.dims == (96, 100, 4, 2) and m.box == (64, 128, 1, 1) and m.swizzle == 128
    assert m.strides_bytes == (4 * 96 * 2, 96 * 2, 100 * 4 * 96 * 2)
    # a packed qkv view: [b, s, 3, h, d] -> q = [:, :, 0]
    b, s, h, d = 2, 33, 4, 64
    qs = (s * 3 * h * d, 3 * h * d, d, 1)
    m = _tma.attention_map_spec("bfloat16", (b, s, h, d), qs, 64)
    assert m.strides_bytes == (3 * h * d * 2, d * 2, s * 3 * h * d * 2) and m.dims == (64, 33, 4, 2)
    # dims of size 1 carry whatever stride: replaced by a valid one
    m = _tma.attention_map_spec("float16", (1, 1, 1, 64), (7, 3, 5, 1), 64)
    assert all(x % 16 == 0 and x > 0 for x in m.strides_bytes)


@pytest.mark.parametrize("args,word", [
    (("float32", (64, 10), (128,), (64, 8), 128), "dtype"),
    (("float16", (64, 10), (120,), (64, 8), 128), "stride"),
    (("float16", (64, 10), (0,), (64, 8), 128), "stride"),
    (("float16", (64, 0), (128,), (64, 8), 128), "dim 1"),
    (("float16", (128, 10), (256,), (128, 8), 128), "swizzle span"),
    (("float16", (64, 10), (128,), (64, 300), 128), "box 1"),
    (("float16", (64, 10), (128,), (64, 8), 48), "swizzle"),
])
def test_map_arguments_checked_before_the_driver(args, word):
    with pytest.raises(ValueError, match=word):
        _tma.check_map_args(*args)


def test_tma_compatibility():
    ok = (2, 100, 4, 64)
    assert _tma.tma_compatible(ok, view(ok).strides, 0x10000)
    assert not _tma.tma_compatible(ok, view(ok).strides, 0x10008)  # base not 16-byte aligned
    assert not _tma.tma_compatible(ok, (100 * 4 * 64, 0, 64, 1), 0x10000)  # seqlen stride 0
    assert not _tma.tma_compatible(ok, (100 * 4 * 64, 4 * 64, 0, 1), 0x10000)  # an expanded head: stride 0
    assert not _tma.tma_compatible(ok, (100 * 4 * 64, 4 * 64, 68, 1), 0x10000)  # 136-byte head stride
    assert _tma.tma_compatible((2, 100, 1, 64), (6400, 64, 0, 1), 0x10000)  # size-1 head dim: any stride
    assert not _tma.tma_compatible((2, 0, 4, 64), (0, 256, 64, 1), 0x10000)


def test_backend_choice(monkeypatch):
    q, k, v = view((2, 300, 8, 128)), view((2, 500, 2, 128)), view((2, 500, 2, 128))
    monkeypatch.setattr(_fwd_sm90, "device_cc", lambda dev: 90)
    assert _fwd_sm90.resolve_backend("auto", q, k, v) == "sm90"
    assert _fwd_sm90.resolve_backend("sm80", q, k, v) == "sm80"
    assert _fwd_sm90.resolve_backend("sm90", q, k, v) == "sm90"
    q32, k32 = view((2, 300, 8, 32)), view((2, 500, 2, 32))
    assert _fwd_sm90.resolve_backend("auto", q32, k32, k32) == "sm80"
    with pytest.raises(ValueError, match="head dim 32"):
        _fwd_sm90.resolve_backend("sm90", q32, k32, k32)
    q1 = view((2, 1, 8, 128))  # single-query GQA decoding: the sm80 kernel's head folding
    assert _fwd_sm90.resolve_backend("auto", q1, k, v) == "sm80"
    with pytest.raises(ValueError, match="single-query"):
        _fwd_sm90.resolve_backend("sm90", q1, k, v)
    kx = view((2, 500, 2, 128), strides=(500 * 128, 128, 0, 1))  # an expanded KV head
    assert _fwd_sm90.resolve_backend("auto", q, kx, v) == "sm80"
    with pytest.raises(ValueError, match="k's base address or strides"):
        _fwd_sm90.resolve_backend("sm90", q, kx, v)
    monkeypatch.setattr(_fwd_sm90, "device_cc", lambda dev: 80)
    assert _fwd_sm90.resolve_backend("auto", q, k, v) == "sm80"
    with pytest.raises(ValueError, match="compute capability 9.0"):
        _fwd_sm90.resolve_backend("sm90", q, k, v)


@pytest.mark.parametrize("backend", ["sm100", "", None, "SM90"])
def test_unknown_backend_refused_before_anything(backend):
    import numpy as np

    x = np.zeros((1, 4, 1, 64), np.float16)
    with pytest.raises(ValueError, match="backend"):
        cuflash.flash_attn_func(x, x, x, backend=backend)


@pytest.mark.parametrize("d", _configs.SM90_HEADDIMS)
def test_tile_fits_the_sm(d):
    """Every sm90 tile fits the SM: shared memory, the setmaxnreg register counts, wgmma's N limits, 16-key steps."""
    t = _configs.sm90_fwd_tile(d, False)
    assert _configs.sm90_fwd_smem_bytes(d, t) <= SMEM_LIMIT_SM90
    assert 128 * (t.regs_load + t.nwg * t.regs_mma) <= 65536 and t.regs_mma % 8 == 0 and 24 <= t.regs_load
    assert t.block_n % 16 == 0 and t.block_n <= 256 and -(-d // 64) * 64 <= 256
    spec = _configs.sm90_fwd_spec("float16", d, True)
    assert spec.arch_suffix == "a" and spec.min_arch == 90 and spec.threads == 128 * (t.nwg + 1)
    assert spec in _configs.all_specs()


def test_tiles_by_key_count():
    """The variants taken by key count (no score modifier): head dim 128 takes the persistent form up to 1024 keys and
    its 160-key stages above without a causal mask; causal, the 128-key persistent form up to 4096 keys, the configured
    tile up to 8191 and the 160-key persistent form from 8192; with a modifier or no key count, the configured tile
    (with the modifiers its capped-max form).
    Every variant taken at some count is among the compiled specs, and fits the SM."""
    t128 = _configs.SM90_FWD_TILES[128]
    assert _configs.sm90_fwd_tile(128, False, 1024).persistent
    wide = _configs.sm90_fwd_tile(128, False, 1025)
    assert wide == _configs.sm90_fwd_tile(128, False, 65536) and (wide.block_n, wide.persistent) == (160, True)
    assert wide.o_tma == t128.o_tma and wide.nwg == t128.nwg
    assert _configs.sm90_fwd_tile(128, True, 8192) == wide == _configs.sm90_fwd_tile(128, True, 1 << 20)
    assert _configs.sm90_fwd_tile(128, True, 8191) == t128 == _configs.sm90_fwd_tile(128, False)
    assert _configs.sm90_fwd_tile(128, False, 4096, _configs.MOD_SCORE) == replace(t128, cap_max=True)
    specs = set(_configs.sm90_fwd_specs())
    for d in _configs.SM90_HEADDIMS:
        for causal in (False, True):
            for n in _configs.SM90_FWD_KEY_BOUNDS:
                t = _configs.sm90_fwd_tile(d, causal, n)
                assert _configs.sm90_fwd_smem_bytes(d, t) <= SMEM_LIMIT_SM90
                for dt in _configs.DTYPES:
                    assert _configs.sm90_fwd_spec(dt, d, causal, t) in specs
    assert {1024, 1025, 4096, 4097, 8191, 8192} <= set(_configs.SM90_FWD_KEY_BOUNDS)


def _cuobjdump():
    exe = shutil.which("cuobjdump")
    if exe is None:
        pytest.skip("cuobjdump not installed (pip nvidia-cuda-cuobjdump)")
    return exe


@pytest.mark.parametrize("d", [64, 256])
def test_sass_has_the_hopper_instructions(tmp_path, d):
    """One offline sm_90a build per consumer-warpgroup count: the products are HGMMA (wgmma, not HMMA), the loads
    UTMALDG (TMA), the stage handoffs SYNCS (mbarrier), the register split USETMAXREG, and nothing in local
    memory; ptxas said nothing about setmaxnreg or serialized wgmma."""
    exe = _cuobjdump()
    from cuflash._loader import compile_offline

    spec = _configs.sm90_fwd_spec("bfloat16", d, True)
    res = compile_offline(spec.filename, [spec.name], "90a")
    info = res["kernels"][spec.name]
    assert info["stack"] == 0 and info["spill_st"] == 0 and not [w for w in info["ptxas_warnings"] if "C75" in w]
    cubin = tmp_path / "k.cubin"
    cubin.write_bytes(res["cubin"] + b"\0")  # CuPy's getCUBIN drops the last byte
    sass = subprocess.run([exe, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    ops = set(re.findall(r"\b([A-Z][A-Z0-9]+)[.\s]", sass))
    assert {"HGMMA", "UTMALDG", "SYNCS", "USETMAXREG", "MUFU"} <= ops, sorted(ops)
    assert not {"HMMA", "LDL", "STL"} & ops
    n = d // 64 if d % 64 == 0 else d // 64 + 1
    assert len(re.findall(r"HGMMA\.64x\d+x16", sass)) > 0 and sass.count("UTMALDG") >= 3 * n


def test_compile_check_flags_ptxas_performance_notes():
    """ptxas reports an ignored setmaxnreg as a warning (C7508) but serialized wgmma as an info line (C7512):
    both fail the compile check; an ordinary report does not."""
    from cuflash import _compile_check

    base = dict(regs=168, stack=0, spill_st=0, spill_ld=0)
    ok = dict(base, ptxas_warnings=[])
    c7508 = dict(base, ptxas_warnings=["ptxas warning : (C7508) Potential Performance Loss: 'setmaxnreg' ignored; "
                                       "unable to determine register count at entry"])
    c7512 = dict(base, ptxas_warnings=["ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async "
                                       "instructions are serialized due to insufficient register resources for the "
                                       "wgmma pipeline in the function 'k'"])
    bad = _compile_check.bad_kernels({"ok": ok, "c7508": c7508, "c7512": c7512})
    assert set(bad) == {"c7508", "c7512"}


def test_capped_max_form_configured():
    """The capped-max form (Sm90FwdTile.cap_max) is the configured modifier tile at head dims 64 and 128 (mod
    MOD_SCORE alone: not with dropout, not at 256), named with PERSIST, SK spelled out and CAP_MAX true; the variant
    specs are the same tiles without it (the diagnostics' and tests' comparison), named as before it, each among the
    configurations CI compiles; the form is refused on a kernel without the modifiers."""
    from dataclasses import replace

    every = _configs.all_specs()
    for d in _configs.SM90_HEADDIMS:
        for n in _configs.SM90_FWD_KEY_BOUNDS:
            t = _configs.sm90_fwd_tile(d, False, n, _configs.MOD_SCORE)
            assert t.cap_max == (d in _configs.SM90_FWD_CAP_MAX_HEADDIMS)
            assert not _configs.sm90_fwd_tile(d, False, n, _configs.MOD_SCORE_DROPOUT).cap_max
            assert not _configs.sm90_fwd_tile(d, False, n).cap_max and not _configs.sm90_fwd_tile(d, True, n).cap_max
            if t.cap_max:
                for u in (t, replace(t, o_tma=False)):
                    spec = _configs.sm90_fwd_spec("float16", d, False, u, _configs.MOD_SCORE)
                    assert spec in every and spec.name.endswith(", 1, false, false, true>")
    specs = _configs.sm90_fwd_variant_specs()
    assert len(specs) == 2 * 2 * len(_configs.SM90_FWD_CAP_MAX_HEADDIMS)  # dtypes x (with, without o_tma)
    want = set()
    for dt in _configs.DTYPES:
        for d in _configs.SM90_FWD_CAP_MAX_HEADDIMS:
            t = replace(_configs.sm90_fwd_tile(d, False, None, _configs.MOD_SCORE), cap_max=False)
            for u in (t, replace(t, o_tma=False)):
                want.add(_configs.sm90_fwd_spec(dt, d, False, u, _configs.MOD_SCORE))
    assert set(specs) == want and all(s in every and "CAP" not in s.name and not s.name.endswith(
        ", false, false, true>") for s in specs)
    tile = replace(_configs.sm90_fwd_tile(64, False), cap_max=True)
    for mod in (0, _configs.MOD_SCORE_DROPOUT):
        with pytest.raises(ValueError, match="capped-max form"):
            _configs.sm90_fwd_spec("float16", 64, False, tile, mod)
    src = (Path(cuflash.__file__).parent.parent / "cuda_src" / "flash_fwd_sm90.cu").read_text()
    assert "bool SK = false, bool CAP_MAX = false>" in src


def test_persistent_modifier_form_specs_and_walk(monkeypatch):
    """The modifier kernels' persistent form (cuflash._configs.sm90_fwd_mod_persist_tiles): the plain kernels'
    persistent variants with the modifier tile's capped-max rule, compiled by CI (in all_specs) at both dtypes with and
    without o_tma, never sm90_fwd_tile's (the dispatch's choice: test_fwd90_persist_cpu.py); dropout and stream-K
    refused with it; and its walk on the host: heaviest first in the list model where the band has a right edge
    (mod_band "causal"), never stream-K."""
    from dataclasses import replace

    from cuflash import _fwd_sm90
    from cuflash._mods import mods_for

    every = set(_configs.all_specs())
    specs = _configs.sm90_fwd_mod_persist_specs()
    want = set()
    for d in _configs.SM90_HEADDIMS:
        tiles = _configs.sm90_fwd_mod_persist_tiles(d)
        assert set(tiles) == set(_configs.SM90_FWD_PERSIST_VARIANTS.get(d, {}))
        for t in tiles.values():
            assert t.persistent and t.cap_max == (d in _configs.SM90_FWD_CAP_MAX_HEADDIMS)
            for dt in _configs.DTYPES:
                for u in (t, replace(t, o_tma=False)):
                    want.add(_configs.sm90_fwd_spec(dt, d, False, u, _configs.MOD_SCORE))
            with pytest.raises(ValueError, match="no dropout"):
                _configs.sm90_fwd_spec("float16", d, False, t, _configs.MOD_SCORE_DROPOUT)
            with pytest.raises(ValueError, match="stream-K"):
                _configs.sm90_fwd_spec("float16", d, False, replace(t, stream_k=True), _configs.MOD_SCORE)
        for n in _configs.SM90_FWD_KEY_BOUNDS:
            assert not _configs.sm90_fwd_tile(d, False, n, _configs.MOD_SCORE).persistent
    assert set(specs) == want and len(specs) == 14 and want <= every
    assert all(", 1, true" in s.name and s.name.split(", ")[10] == "1" for s in specs)  # MOD_SCORE, PERSIST

    class A:  # a validated view's shape alone (mods_for reads shapes)
        def __init__(self, shape):
            self.shape = shape

    qa, ka = A((2, 4096, 16, 128)), A((2, 4096, 16, 128))
    causal = mods_for(qa, ka, True, (-1, -1), 50.0, None, None)
    window = mods_for(qa, ka, False, (300, 40), 0.0, None, None)
    flat = mods_for(qa, ka, False, (-1, -1), 50.0, None, None)
    wide = mods_for(qa, ka, False, (300, 4096), 0.0, None, None)  # a right side no row's keys reach past: no edge
    assert [_fwd_sm90.mod_band(m, 4096) for m in (None, causal, window, flat, wide)] == [None, "causal", "causal",
                                                                                         "flat", "flat"]
    t = _configs.sm90_fwd_mod_persist_tiles(128)["persist"]
    monkeypatch.setattr(_fwd_sm90, "sm_count", lambda device: 132)  # (an H100 / H200's SMs; no GPU here)
    # (the plain kernel could walk this launch by stream-K: 1024 tiles on 132 blocks leave the last wave part empty)
    walk, _ = _fwd_sm90.persist_walk("stream_k", False, None, 2, 16, 16, 4096, 4096, 128, t, 32, 0)
    assert walk["walk_slot"] == _fwd_sm90._walk.STREAM_K
    for band in ("causal", "flat"):
        walk, _ = _fwd_sm90.persist_walk("auto", False, None, 2, 16, 16, 4096, 4096, 128, t, 32, 0, band)
        assert walk["walk_slot"] != _fwd_sm90._walk.STREAM_K
        with pytest.raises(ValueError, match="stream_k"):
            _fwd_sm90.persist_walk("stream_k", False, None, 2, 16, 16, 4096, 4096, 128, t, 32, 0, band)


def test_map_memo_encodes_only_new_pointers():
    """The memoized plan's tensor maps (cuflash._fwd_sm90.MapMemo), with stand-ins for torch and the driver: the
    layers of a model (more pointer sets than MAX_MAP_SETS, the same shapes) each called twice over, and each call's
    output new: on the second pass only O's map is encoded (its output's new address), and every launch carries the
    maps of its own q, k, v, o; a set mixing pointers seen in other sets encodes nothing but O's."""
    from conftest import run_with_stand_ins

    res = run_with_stand_ins(r'''
import struct
from cuflash import _fwd_sm90, _tma
from cuflash._fwd_sm90 import MAPS_OFFSET, MAX_MAP_SETS
from cuflash._tma import MAP_BYTES
count = [0]
enc = _tma._encode_fn
def counting(*a):
    count[0] += 1
    return enc(*a)
_tma._encode_fn = counting
layers = [tuple(T((2, 1024, 8, 128), torch.float16) for _ in range(3)) for _ in range(MAX_MAP_SETS + 9)]
def bases(raw):  # the base address of each map in a launch's parameter bytes (the stand-in map's first 8 bytes)
    return [struct.unpack_from("<Q", raw, MAPS_OFFSET + i * MAP_BYTES)[0] for i in range(4)]
passes = []
for _ in range(2):
    count[0] = 0
    ok = True
    for q, k, v in layers:
        ho.LAUNCHES.clear()
        out = cuflash.flash_attn_func(q, k, v, backend="sm90")
        ok &= bases(ho.LAUNCHES[-1][4]) == [q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()]
    passes.append([count[0], ok])
count[0] = 0
q, k, v = layers[0][0], layers[1][1], layers[2][2]
ho.LAUNCHES.clear()
out = cuflash.flash_attn_func(q, k, v, backend="sm90")
res["mixed"] = [count[0], bases(ho.LAUNCHES[-1][4]) == [q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()]]
res["passes"], res["layers"] = passes, len(layers)
''')
    n = res["layers"]
    first, second = res["passes"]
    assert first == [n + 3 * n, True] and second == [n, True]  # first: q, k, v and o each; then O's alone
    assert res["mixed"] == [1, True]
