"""CPU: the Hopper forward's TMA-store epilogue (Sm90FwdTile.o_tma, the kernel's O_TMA; the configured tiles' epilogue)
on the host: its kernel name, and the launches of the memoized, the explicit and the packed paths with the GPU replaced
by bench/diag/host_overhead.py's stand-ins -- the fourth tensor map (O's: the output's base, dims and strides, boxes
of 64 columns by one consumer warpgroup's 64 rows) after q, k and v's, and none with the 16-byte stores' tiles
(o_tma off)."""
import struct
from dataclasses import replace

import pytest

from cuflash import _configs
from cuflash._fwd_sm90 import MAPS_OFFSET
from conftest import run_with_stand_ins

_BODY = r"""
from dataclasses import replace
from cuflash import _configs, _fwd, _fwd_sm90
from cuflash._validate import check_qkv

def run(d, causal=False, window=(-1, -1), shapes=((2, 300, 8), (2, 777, 2))):
    (b, sq, h), (_, sk, hk) = shapes
    q, k, v = T((b, sq, h, d), torch.float16), T((b, sk, hk, d), torch.float16), T((b, sk, hk, d), torch.float16)
    rec, out = launches(lambda: cuflash.flash_attn_func(q, k, v, causal=causal, window_size=window))
    return rec, [out.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr()]

tiles = dict(_configs.SM90_FWD_TILES)
for kd, t in tiles.items():
    _configs.SM90_FWD_TILES[kd] = replace(t, o_tma=False)
_fwd._PLANS.clear(); _fwd._KV_PLANS.clear()
for d in (64, 80, 128):
    res[f"stores16 {d}"] = run(d)
_configs.SM90_FWD_TILES.update(tiles)  # the configured tiles: o_tma
_fwd._PLANS.clear(); _fwd._KV_PLANS.clear()
for d in (64, 80, 128, 256):
    res[f"o_tma {d}"] = run(d)
res["o_tma causal"] = run(128, True)
res["o_tma window"] = run(128, False, (50, 0))
res["o_tma repeat"] = [run(64)[0] for _ in range(2)]
# the explicit path with a strided output: out = the first 128 columns of a [2, 300, 8, 192] tensor
q, k, v = T((2, 300, 8, 128), torch.float16), T((2, 777, 2, 128), torch.float16), T((2, 777, 2, 128), torch.float16)
qa, ka, va = check_qkv(q, k, v)
wide = T((2, 300, 8, 192), torch.float16)
o = T((2, 300, 8, 128), torch.float16, strides=(300 * 8 * 192, 8 * 192, 192, 1))
rec, _ = launches(lambda: _fwd_sm90.forward(qa, ka, va, None, False, out=o))
res["o_tma strided"] = [rec, [o.data_ptr()]]
# an output no map describes (a head stride of 0: TMA steps only positive strides): the tile without o_tma
o_bad = T((2, 300, 8, 128), torch.float16, strides=(300 * 128, 128, 0, 1))
rec, _ = launches(lambda: _fwd_sm90.forward(qa, ka, va, None, False, out=o_bad))
res["o_tma unmappable out"] = [rec]
# packed sequences: O's map is [1, total, h, d]
qv, kv_ = T((700, 8, 128), torch.float16), T((900, 2, 128), torch.float16)
vv = T((900, 2, 128), torch.float16)
cq, ck = T((4,), torch.int32), T((4,), torch.int32)
rec, out = launches(lambda: cuflash.flash_attn_varlen_func(qv, kv_, vv, cq, ck, 350, 300))
res["o_tma varlen"] = [rec, [out.data_ptr()]]
"""


@pytest.fixture(scope="module")
def res():
    return run_with_stand_ins(_BODY)


def _maps(raw_hex, n):
    raw = bytes.fromhex(raw_hex)
    return [raw[MAPS_OFFSET + 128 * i: MAPS_OFFSET + 128 * (i + 1)] for i in range(n)]


def _map_fields(m):
    ptr, _ = struct.unpack_from("<QI", m, 0)
    dims_box = [struct.unpack_from("<QI", m, 12 + 12 * i) for i in range(4)]
    strides = list(struct.unpack_from("<3Q", m, 60))
    return ptr, [d for d, _ in dims_box], [b for _, b in dims_box], strides


def test_spec_name_shows_the_epilogue():
    for d in _configs.SM90_HEADDIMS:
        assert _configs.sm90_fwd_tile(d, False).o_tma  # every configured tile
        for causal, mod in _configs.MASK_MODES:
            t = replace(_configs.sm90_fwd_tile(d, causal, None, mod), cap_max=False)  # (the capped-max form: below)
            v = _configs.sm90_fwd_spec("float16", d, causal, t, mod)
            assert _configs.sm90_fwd_spec("float16", d, causal, mod=mod) == _configs.sm90_fwd_spec(
                "float16", d, causal, _configs.sm90_fwd_tile(d, causal, None, mod), mod)
            base = _configs.sm90_fwd_spec("float16", d, causal, replace(t, o_tma=False), mod)
            assert "true>" not in base.name[-6:]
            # the MOD argument is spelled out (even MOD_NONE) so that O_TMA, after it, can be given
            assert v.name == base.name[:-1].removesuffix(f", {mod}") + f", {mod}, true>"
            assert (v.threads, v.smem, v.min_arch, v.arch_suffix) == (base.threads, base.smem, 90, "a")
    specs = set(_configs.sm90_fwd_specs())
    for d in _configs.SM90_HEADDIMS:  # every launched tile with o_tma, and without (an output no map describes)
        for causal, mod in _configs.MASK_MODES:
            for sk in (None, _configs.SM90_FWD_SHORT_MAX_SEQLEN_K):
                t = _configs.sm90_fwd_tile(d, causal, sk, mod)
                assert t.o_tma and _configs.sm90_fwd_spec("float16", d, causal, t, mod) in specs
                assert _configs.sm90_fwd_spec("float16", d, causal, replace(t, o_tma=False), mod) in specs


@pytest.mark.parametrize("d", [64, 80, 128])
def test_16_byte_store_tiles_launch_three_maps(res, d):
    rec, _ = res[f"stores16 {d}"]
    kd = _configs.kernel_headdim(d, _configs.SM90_HEADDIMS)
    t = replace(_configs.sm90_fwd_tile(kd, False, 777), o_tma=False)  # (the configured tiles without o_tma)
    assert len(rec) == 1 and rec[0][0] == _configs.sm90_fwd_spec("float16", kd, False, t).name


@pytest.mark.parametrize("d", [64, 80, 128, 256])
def test_o_tma_launches_the_output_map(res, d):
    (launch,), (op, qp, kp, vp) = res[f"o_tma {d}"]
    kd = _configs.kernel_headdim(d, _configs.SM90_HEADDIMS)
    t = _configs.sm90_fwd_tile(kd, False, 777)  # 777 keys: head dim 64 takes its short-keys tile
    assert t.o_tma and launch[0] == _configs.sm90_fwd_spec("float16", kd, False, t).name
    q, k, v, o = (_map_fields(m) for m in _maps(launch[2], 4))
    assert [q[0], k[0], v[0], o[0]] == [qp, kp, vp, op]
    # O: the inputs' head dim (columns past it, D's padding, are clipped), q's rows, 64-row boxes, out's strides
    assert o[1] == [d, 300, 8, 2] and o[2] == [64, 64, 1, 1]
    assert o[3] == [8 * d * 2, d * 2, 300 * 8 * d * 2]
    assert q[2] == [64, t.block_m, 1, 1]


def test_o_tma_mask_modes_and_memo(res):
    name = res["o_tma causal"][0][0][0]
    assert name.startswith("cuflash::flash_fwd_sm90_kernel<__half, 128, 128, 2, 2, true, ")  # CAUSAL
    t = _configs.sm90_fwd_tile(128, True, 777)  # 777 keys: causal head dim 128 takes the persistent form
    assert t.o_tma and t.persistent and name == _configs.sm90_fwd_spec("float16", 128, True, t).name
    assert name.endswith(", 0, true, 1, true>")  # MOD_NONE spelled out, then O_TMA, MINB and PERSIST
    # a window: MOD_SCORE, then O_TMA, MINB, PERSIST, SK, and at head dim 128 the capped-max form's CAP_MAX
    assert res["o_tma window"][0][0][0].endswith(", 1, true, 1, false, false, true>")
    r1, r2 = res["o_tma repeat"]
    assert len(_maps(r1[0][2], 4)[3]) == 128 and _map_fields(_maps(r1[0][2], 4)[3])[1] == [64, 300, 8, 2]
    assert _map_fields(_maps(r2[0][2], 4)[3])[1] == [64, 300, 8, 2]


def test_o_tma_strided_output(res):
    (launch,), (op,) = res["o_tma strided"]
    assert launch[0].endswith(", true>")
    ptr, dims, box, strides = _map_fields(_maps(launch[2], 4)[3])
    assert ptr == op and dims == [128, 300, 8, 2] and box == [64, 64, 1, 1]
    assert strides == [8 * 192 * 2, 192 * 2, 300 * 8 * 192 * 2]  # (rows, heads, batch): out's, not q's


def test_o_tma_falls_back_for_an_output_no_map_describes(res):
    (launch,), = res["o_tma unmappable out"]
    t = replace(_configs.sm90_fwd_tile(128, False, 777), o_tma=False)
    assert launch[0] == _configs.sm90_fwd_spec("float16", 128, False, t).name


def test_o_tma_packed_output_map(res):
    (launch,), (op,) = res["o_tma varlen"]
    assert launch[0].endswith(", true>")
    ptr, dims, box, strides = _map_fields(_maps(launch[2], 4)[3])
    assert ptr == op and dims == [128, 700, 8, 1] and box == [64, 64, 1, 1]
    assert strides[:2] == [8 * 128 * 2, 128 * 2]


@pytest.mark.parametrize("d,causal", [(64, True), (256, False)])
def test_variant_compiles_spill_free_with_tma_stores(tmp_path, d, causal):
    """An offline sm_90a build of the variant: no spills, no local memory, no ptxas performance note, and (where
    cuobjdump is installed) one UTMASTG per 64-column chunk of O next to the loads' UTMALDG."""
    import re
    import shutil
    import subprocess

    from cuflash._loader import compile_offline

    spec = _configs.sm90_fwd_spec("bfloat16", d, causal, replace(_configs.sm90_fwd_tile(d, causal), o_tma=True))
    res = compile_offline(spec.filename, [spec.name], "90a")
    info = res["kernels"][spec.name]
    assert info["stack"] == 0 and info["spill_st"] == 0 and info["spill_ld"] == 0
    assert not [w for w in info["ptxas_warnings"] if "C75" in w]
    exe = shutil.which("cuobjdump")
    if exe is None:
        return
    cubin = tmp_path / "k.cubin"
    cubin.write_bytes(res["cubin"] + b"\0")  # CuPy's getCUBIN drops the last byte
    sass = subprocess.run([exe, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    ops = re.findall(r"\b([A-Z][A-Z0-9]+)[.\s]", sass)
    assert ops.count("UTMASTG") == d // 64 and "UTMALDG" in ops and not {"LDL", "STL"} & set(ops)
