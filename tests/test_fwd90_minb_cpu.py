"""CPU: the Hopper forward's tiles with more than one block per SM (Sm90FwdTile.min_blocks, the kernel's MINB;
cuflash._configs.SM90_FWD_MINB_VARIANTS): the kernel names (the configured ones unchanged), the register and
shared-memory limits said in Python before a compile and in the kernel's static_assert, the offline build of every
variant (no spills, no local memory, no ptxas performance note, with the pip NVRTC and the one CUFLASH_NVRTC_ALT
names), and the launch of an explicit variant tile (grid of its 64 nwg-row Q tiles) with the GPU replaced by
bench/diag/host_overhead.py's stand-ins."""
from dataclasses import replace

import pytest

from cuflash import _configs
from cuflash._configs import Sm90FwdTile, sm90_fwd_minb_tiles, sm90_fwd_spec, sm90_fwd_tile
from conftest import compile_problems, run_with_stand_ins

VARIANTS = [(d, n) for d in sorted(_configs.SM90_FWD_MINB_VARIANTS) for n in _configs.SM90_FWD_MINB_VARIANTS[d]]


def test_configured_tiles_stay_one_block_and_keep_their_names():
    for d in _configs.SM90_HEADDIMS:
        t = sm90_fwd_tile(d, False)
        assert t.min_blocks == 1
        for causal, mod in _configs.MASK_MODES:
            base = sm90_fwd_spec("float16", d, causal, mod=mod)
            u = sm90_fwd_tile(d, causal, None, mod)
            assert base == sm90_fwd_spec("float16", d, causal, replace(u, min_blocks=1), mod)
    # (MOD, O_TMA and MINB after SMEM_BYTES: at most 12 commas; only the persistent form's PERSIST is a 13th, its
    # stream-K form's SK a 14th, and the modifier kernels' capped-max form PERSIST, SK false and CAP_MAX a 15th)
    assert all(s.name.count(",") <= 12 or (s.name.count(",") == 13 and s.name.endswith(", true>")) or
               (s.name.count(",") == 14 and s.name.endswith(", true, true>")) or
               (s.name.count(",") == 15 and s.name.endswith(", false, false, true>"))
               for s in _configs.sm90_fwd_specs())


@pytest.mark.parametrize("d,name", VARIANTS)
def test_variant_names_spell_out_mod_and_o_tma(d, name):
    t = sm90_fwd_minb_tiles(d)[name]
    assert t.min_blocks > 1 and t.o_tma == sm90_fwd_tile(d, False).o_tma  # the configured epilogue, inherited
    for o_tma in (False, True):
        for causal, mod in _configs.MASK_MODES:
            v = sm90_fwd_spec("bfloat16", d, causal, replace(t, o_tma=o_tma), mod)
            assert v.name.endswith(f", {mod}, {'true' if o_tma else 'false'}, {t.min_blocks}>")
            assert v.threads == 128 * (t.nwg + 1)
            assert t.min_blocks * (v.smem + 1024) <= _configs.SM90_SMEM_PER_SM


def test_register_limit_checked_in_python():
    # two blocks of 384 threads: 80 registers per thread at launch, 128 (24 + 2 R) <= 80 x 384: R <= 108
    assert Sm90FwdTile(48, 2, regs_mma=104, min_blocks=2).launch_regs == 80
    with pytest.raises(ValueError, match="launch allocation"):
        Sm90FwdTile(48, 2, regs_mma=112, min_blocks=2)
    # three of 256: 80 per thread, 128 (24 + R) <= 80 x 256: R <= 136
    Sm90FwdTile(64, 1, regs_mma=136, pingpong=False, min_blocks=3)
    with pytest.raises(ValueError, match="launch allocation"):
        Sm90FwdTile(64, 1, regs_mma=144, pingpong=False, min_blocks=3)
    with pytest.raises(ValueError, match="launch allocation"):  # the configured d128 tile cannot take two blocks
        replace(sm90_fwd_tile(128, False), min_blocks=2)
    with pytest.raises(ValueError, match="multiples of 8"):
        Sm90FwdTile(64, 2, regs_mma=100, min_blocks=2)
    with pytest.raises(ValueError, match="min_blocks"):
        Sm90FwdTile(64, 2, min_blocks=0)


def test_shared_memory_of_the_blocks_checked():
    # head dim 128, one consumer, 96-key stages: 115 KB a block, two do not fit 228 KB with their 1 KB each
    t = Sm90FwdTile(96, 1, regs_mma=232, pingpong=False, min_blocks=2)
    with pytest.raises(ValueError, match="do not fit an SM"):
        sm90_fwd_spec("float16", 128, False, t)
    sm90_fwd_spec("float16", 128, False, replace(t, block_n=80))


def test_kernel_static_assert_rejects_a_register_count_over_the_launch_allocation():
    from cuflash._loader import compile_offline

    name = "cuflash::flash_fwd_sm90_kernel<__half, 64, 48, 2, 2, false, 112, 24, true, 42056, 0, false, 2>"
    with pytest.raises(RuntimeError, match="setmaxnreg register counts"):
        compile_offline("flash_fwd_sm90.cu", [name], "90a", verbose=False)


def _variant_specs():
    out = []
    for d, name in VARIANTS:
        t = sm90_fwd_minb_tiles(d)[name]
        for o_tma in (False, True):
            out += [sm90_fwd_spec("bfloat16", d, True, replace(t, o_tma=o_tma)),
                    sm90_fwd_spec("float16", d, False, replace(t, o_tma=o_tma))]
    return out


def test_variants_compile_spill_free_under_both_nvrtcs():
    """Every variant, both epilogues, fp16 and bf16 (causal and not): no spills, no local memory, no ptxas note
    (C7512: wgmma serialized for want of registers) -- with the pip NVRTC, and with CUFLASH_NVRTC_ALT's when set."""
    bad = compile_problems(_variant_specs())
    assert not bad, bad


_BODY = r"""
from cuflash import _configs, _fwd_sm90
from cuflash._validate import check_qkv

for d, name in (("64", "2x2wg n48"), ("64", "3x1wg n64"), ("128", "2x1wg n80")):
    t = _configs.sm90_fwd_minb_tiles(int(d))[name]
    q = T((2, 300, 8, int(d)), torch.float16)
    k, v = T((2, 777, 2, int(d)), torch.float16), T((2, 777, 2, int(d)), torch.float16)
    qa, ka, va = check_qkv(q, k, v)
    rec, _ = launches(lambda: _fwd_sm90.make_plan(qa, ka, va, None, True, "auto", tile=t).run(qa.ptr, ka.ptr, va.ptr))
    res[d + " " + name] = [[r[0], list(r[1])] for r in rec]
"""


@pytest.fixture(scope="module")
def res():
    return run_with_stand_ins(_BODY)


@pytest.mark.parametrize("d,name", [(64, "2x2wg n48"), (64, "3x1wg n64"), (128, "2x1wg n80")])
def test_explicit_variant_tile_launches(res, d, name):
    t = sm90_fwd_minb_tiles(d)[name]
    (launch_name, grid), = res[f"{d} {name}"]
    assert launch_name == sm90_fwd_spec("float16", d, True, t).name
    assert sorted(grid) == sorted([-(-300 // t.block_m), 8, 2])


def test_key_count_tile_selection():
    """Without modifiers, head dim 64 takes its short-keys tiles (several blocks per SM) up to
    SM90_FWD_SHORT_MAX_SEQLEN_K keys and the persistent form above (causal: up to 4096 keys, then the configured tile);
    head dim 128 the persistent form up to 1024 keys, and above them its 160-key persistent form without a causal mask;
    causal, the persistent form up to 4096 keys, the configured tile up to 8191 and the 160-key persistent form from
    8192. An unknown key count (packed sequences given max_seqlen_k as a device array), the modifiers and the other
    head dims take the configured tile."""
    from cuflash import _configs
    from cuflash._configs import sm90_fwd_persist_tiles

    limit = _configs.SM90_FWD_SHORT_MAX_SEQLEN_K
    p64, p128, w128 = (sm90_fwd_persist_tiles(64)["persist"], sm90_fwd_persist_tiles(128)["persist"],
                       sm90_fwd_persist_tiles(128)["persist n160"])
    assert w128.persistent and w128.block_n == 160 and w128.o_tma
    b64, b128 = _configs.SM90_FWD_TILES[64], _configs.SM90_FWD_TILES[128]
    # (head dim, causal, short-keys tile, [(key count, tile)] past the short keys)
    cases = ((64, False, sm90_fwd_minb_tiles(64)["2x2wg n48"], [(limit + 1, p64), (1 << 20, p64)]),
             (64, True, sm90_fwd_minb_tiles(64)["3x1wg n64"], [(limit + 1, p64), (4096, p64), (4097, b64),
                                                              (1 << 20, b64)]),
             (128, False, p128, [(limit + 1, w128), (2049, w128), (1 << 20, w128)]),
             (128, True, p128, [(limit + 1, p128), (4096, p128), (4097, b128), (8191, b128), (8192, w128),
                                (1 << 20, w128)]))
    for d, causal, short, longer in cases:
        base = _configs.SM90_FWD_TILES[d]
        assert sm90_fwd_tile(d, causal, 1) == sm90_fwd_tile(d, causal, limit) == short
        for n, want in longer:
            assert sm90_fwd_tile(d, causal, n) == want, (d, causal, n)
        assert short.min_blocks > 1 or short.persistent
        assert sm90_fwd_tile(d, causal, None) == base and not base.persistent
        for mod in (_configs.MOD_SCORE, _configs.MOD_SCORE_DROPOUT):  # (the soft-cap's capped-max form at 64, 128)
            for n in (512, limit + 1, 8192):
                assert sm90_fwd_tile(d, causal, n, mod) == replace(base, cap_max=mod == _configs.MOD_SCORE)
    for d, t in ((64, p64), (128, p128), (128, w128)):  # (d64's persistent form: the 16-byte stores)
        assert t.persistent and (t.o_tma or d == 64)
    for d in (96, 256):
        for causal in (False, True):
            for n in (512, limit + 1, None):
                assert sm90_fwd_tile(d, causal, n) == _configs.SM90_FWD_TILES[d]
