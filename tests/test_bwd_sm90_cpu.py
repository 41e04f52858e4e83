"""CPU: the Hopper backward's host path (cuflash/_bwd_sm90.py) through the public API with the GPU replaced by
bench/diag/host_overhead.py's stand-ins (a compute capability 9.0 device, launches recorded, nothing compiled):
which calls take it, the three launches it makes (preprocess, the sm90 main kernel, the dQ convert: one parameter
block, the four tensor maps after it), the grid and the seqpar buffers of its 128-key tiles, the memoized maps,
and the refusals of backend="sm90" that name why. Its kernels' compilation is CI's (all_specs)."""
import struct
import re
from dataclasses import replace

import pytest

from cuflash import _configs
from cuflash._bwd_sm90 import ARGS_BYTES, MAPS_OFFSET
from cuflash._params import BWD_PARAMS
from conftest import c_div, run_with_stand_ins

_BODY = r"""
from cupy.cuda import runtime
runtime.memGetInfo = lambda: (100 << 30, 141 << 30)  # free, total (seqpar sizes its buffers by it)
def tensors(b, sq, sk, h, hk, d, dt="float16", q_rows=None):
    dt = getattr(torch, dt)
    q, o, do = (T((b, sq, h, d), dt) for _ in range(3))
    k, v = T((b, sk, hk, d), dt), T((b, sk, hk, d), dt)
    lse = T((b, h, sq), torch.float32)
    return do, q, k, v, o, lse

def main_of(rec):
    return [r for r in rec if "bwd_sm90" in r[0] or "flash_bwd_kernel" in r[0]]

# default (auto) path per head dim, mask and dtype
for d in (32, 40, 64, 80, 96, 128, 256):
    for causal in (False, True):
        for dt in ("float16", "bfloat16"):
            rec, _ = launches(lambda: cuflash.flash_attn_backward(*tensors(2, 300, 777, 8, 2, d, dt), causal=causal))
            res[f"auto {d} {causal} {dt}"] = rec
# the options that keep the mma.sync kernels under auto, and refuse backend="sm90"
opts = {"dropout": dict(dropout_p=0.1, rng_state=(1, 2)), "loop": dict(dq_strategy="loop"),
        "kv": dict(warp_partition="kv")}
for name, kw in opts.items():
    rec, _ = launches(lambda: cuflash.flash_attn_backward(*tensors(1, 200, 200, 4, 4, 64), **kw))
    res["opt " + name] = rec
    res["forced " + name] = err(lambda: cuflash.flash_attn_backward(*tensors(1, 200, 200, 4, 4, 64), backend="sm90",
                                                                  **kw))
rec, _ = launches(lambda: cuflash.flash_attn_backward(*tensors(1, 200, 200, 4, 4, 256), backend="sm90",
                                                      window_size=(50, 0)))
res["forced d256 window"] = rec
from cuflash import _bwd_sm90 as _b90s, backward as _bms
# head dim 256 as configured (SM90_BWD_SPLIT_ORDERED), then with the column-split kernel's "ordered" turned off and on
# (cuflash._bwd_sm90.SPLIT_ORDERED): which kernels calls take
rec, _ = launches(lambda: cuflash.flash_attn_backward(*tensors(2, 300, 777, 8, 2, 256), deterministic=True))
res["deterministic d256 configured"] = rec
_b90s.SPLIT_ORDERED = False
_bms._PLANS.clear()
res["forced d256 ordered"] = err(lambda: cuflash.flash_attn_backward(*tensors(1, 200, 200, 4, 4, 256), backend="sm90",
                                                                    dq_strategy="ordered", deterministic=True))
rec, _ = launches(lambda: cuflash.flash_attn_backward(*tensors(2, 300, 777, 8, 2, 256), deterministic=True))
res["deterministic d256"] = rec
_b90s.SPLIT_ORDERED = True
_bms._PLANS.clear()
for causal in (False, True):
    rec, _ = launches(lambda: cuflash.flash_attn_backward(*tensors(1, 200, 700, 4, 4, 256), backend="sm90",
                                                          causal=causal, dq_strategy="ordered", deterministic=True))
    res[f"forced d256 ordered {causal}"] = rec
rec, _ = launches(lambda: cuflash.flash_attn_backward(*tensors(2, 300, 777, 8, 2, 256), deterministic=True))
res["deterministic d256 split ordered"] = rec
res["forced d256 ordered softcap"] = err(lambda: cuflash.flash_attn_backward(
    *tensors(1, 200, 200, 4, 4, 256), backend="sm90", softcap=5.0, dq_strategy="ordered"))
_b90s.SPLIT_ORDERED = None
_bms._PLANS.clear()
rec, _ = launches(lambda: cuflash.flash_attn_backward(*tensors(1, 200, 200, 4, 4, 256), softcap=5.0))
res["auto d256 softcap"] = rec
res["forced d32"] = err(lambda: cuflash.flash_attn_backward(*tensors(1, 200, 200, 4, 4, 32), backend="sm90"))
res["bad backend"] = err(lambda: cuflash.flash_attn_backward(*tensors(1, 200, 200, 4, 4, 64), backend="hopper"))
# a head stride that TMA cannot step (an expanded KV head): auto falls back, forced refuses
do, q, k, v, o, lse = tensors(1, 200, 200, 4, 1, 64)
k4 = T((1, 200, 4, 64), k.dtype, strides=(200 * 64, 64, 0, 1))
v4 = T((1, 200, 4, 64), k.dtype, strides=(200 * 64, 64, 0, 1))
rec, _ = launches(lambda: cuflash.flash_attn_backward(do, q, k4, v4, o, lse))
res["expanded"] = rec
res["forced expanded"] = err(lambda: cuflash.flash_attn_backward(do, q, k4, v4, o, lse, backend="sm90"))
# deterministic: "ordered" (no window), seqpar with one buffer per 128-key tile (explicit, or with a window)
rec, _ = launches(lambda: cuflash.flash_attn_backward(*tensors(2, 300, 777, 8, 2, 128), deterministic=True))
res["deterministic"] = rec
rec, _ = launches(lambda: cuflash.flash_attn_backward(*tensors(2, 300, 777, 8, 2, 128), causal=True,
                                                      deterministic=True))
res["deterministic causal"] = rec
rec, _ = launches(lambda: cuflash.flash_attn_backward(*tensors(2, 300, 777, 4, 4, 64), causal=True,
                                                      deterministic=True))
res["deterministic causal mha"] = rec
# "ordered" without a mask: ROT at one query head per KV head up to SM90_BWD_ROT_MAX_TILES KV tiles (64 at head dim
# 64, 32 at 128), else plain; forced (cuflash._bwd_sm90.PLAIN_ORDER), ROT with GQA too but only while a sequence's KV
# tiles fit half the SMs (66 of the stand-in's 132), and plain anywhere; head dim 256 (the column-split kernel's
# "ordered" turned on, 64-key tiles) likewise
from cuflash import _bwd_sm90 as _b90, _configs, backward as _bm
_b90.SPLIT_ORDERED = True
for knob in (None, 3, 0):
    _b90.PLAIN_ORDER = knob
    _bm._PLANS.clear()
    for name, shape in (("d64 64 tiles", (1, 64, 64 * 128, 2, 2, 64)),
                        ("d64 65 tiles", (1, 64, 64 * 128 + 1, 2, 2, 64)),
                        ("d64 66 tiles", (1, 64, 66 * 128, 2, 2, 64)),
                        ("d64 67 tiles", (1, 64, 66 * 128 + 1, 2, 2, 64)),
                        ("d128 32 tiles", (1, 64, 32 * 128, 2, 2, 128)),
                        ("d128 33 tiles", (1, 64, 32 * 128 + 1, 2, 2, 128)),
                        ("d128 gqa", (2, 300, 777, 8, 2, 128)),
                        ("d256 66 tiles", (1, 64, 66 * 64, 2, 2, 256)),
                        ("d256 67 tiles", (1, 64, 66 * 64 + 1, 2, 2, 256))):
        rec, _ = launches(lambda: cuflash.flash_attn_backward(*tensors(*shape), deterministic=True))
        res[f"rot {knob} {name}"] = rec
_b90.PLAIN_ORDER = _b90.SPLIT_ORDERED = None
_bm._PLANS.clear()
rec, _ = launches(lambda: cuflash.flash_attn_backward(*tensors(2, 300, 777, 8, 2, 128), causal=True))
res["atomic causal"] = rec
rec, _ = launches(lambda: cuflash.flash_attn_backward(*tensors(2, 300, 777, 8, 2, 128), deterministic=True,
                                                      window_size=(100, 0)))
res["deterministic window"] = rec
rec, _ = launches(lambda: cuflash.flash_attn_backward(*tensors(2, 300, 777, 8, 2, 128), dq_strategy="seqpar"))
res["seqpar"] = rec
res["ordered window"] = err(lambda: cuflash.flash_attn_backward(*tensors(1, 200, 200, 4, 4, 64), window_size=(9, 0),
                                                                dq_strategy="ordered"))
res["ordered sm80"] = err(lambda: cuflash.flash_attn_backward(*tensors(1, 200, 200, 4, 4, 64), dq_strategy="ordered",
                                                              backend="sm80"))
# the memo: a repeated call launches the same maps; new pointers, new maps
args = tensors(1, 256, 256, 2, 2, 64)
r1, _ = launches(lambda: cuflash.flash_attn_backward(*args))
r2, _ = launches(lambda: cuflash.flash_attn_backward(*args))
args2 = tensors(1, 256, 256, 2, 2, 64)
r3, _ = launches(lambda: cuflash.flash_attn_backward(*args2))
res["memo"] = [r1, r2, r3, [a.data_ptr() for a in args], [a.data_ptr() for a in args2]]
# a dispatch order of groups of (KV head, batch) pairs (cuflash._bwd_sm90.CAUSAL_GROUP): which kernels take it
from cuflash import _bwd_sm90, _configs, backward as bwd_mod
_bwd_sm90.CAUSAL_GROUP, _bwd_sm90.HEADS_INNER = 8, False  # (the heads-outer walk: the heads-inner one's are below)
bwd_mod._PLANS.clear()
for name, kw in (("atomic", {}), ("seqpar", dict(dq_strategy="seqpar")), ("ordered", dict(deterministic=True)),
                 ("window", dict(window_size=(100, 0)))):
    rec, _ = launches(lambda: cuflash.flash_attn_backward(*tensors(2, 300, 777, 8, 2, 128), causal=True, **kw))
    res["group " + name] = rec[1][0]
rec, _ = launches(lambda: cuflash.flash_attn_backward(*tensors(2, 300, 777, 8, 2, 128)))
res["group non-causal"] = rec[1][0]
_bwd_sm90.CAUSAL_GROUP = _bwd_sm90.HEADS_INNER = None  # the default choice: by head dim, keys per sequence, GQA
bwd_mod._PLANS.clear()
for name, shape in (("d64", (1, 300, 777, 4, 4, 64)), ("long", (1, 64, 8193, 2, 2, 128)),
                    ("longest grouped", (1, 64, 8192, 2, 2, 128)), ("gqa 2", (1, 64, 4100, 4, 2, 128)),
                    ("gqa 8", (1, 64, 8192, 16, 2, 128)), ("gqa 8 long", (1, 64, 8193, 16, 2, 128)),
                    ("gqa 8 many", (4, 64, 8192, 64, 8, 128)),
                    ("gqa 8 d64", (1, 64, 8192, 16, 2, 64))):
    rec, _ = launches(lambda: cuflash.flash_attn_backward(*tensors(*shape), causal=True))
    res["default " + name] = rec[1][0]
# the heads-inner walk forced on (cuflash._bwd_sm90.HEADS_INNER), alone and with a grouped order: which kernels take it
_bwd_sm90.HEADS_INNER = True
for grp in (None, 3):
    _bwd_sm90.CAUSAL_GROUP = grp
    for name, shape, kw in (("atomic", (2, 300, 777, 8, 2, 128), {}),
                            ("seqpar", (2, 300, 777, 8, 2, 128), dict(dq_strategy="seqpar")),
                            ("ordered", (2, 300, 777, 8, 2, 128), dict(deterministic=True)),
                            ("window", (2, 300, 777, 8, 2, 128), dict(window_size=(100, 0))),
                            ("d256", (2, 300, 777, 8, 2, 256), {}), ("long", (1, 64, 8193, 2, 2, 128), {})):
        bwd_mod._PLANS.clear()
        rec, _ = launches(lambda: cuflash.flash_attn_backward(*tensors(*shape), causal=True, **kw))
        res[f"inner {grp} {name}"] = rec[1][0]
    bwd_mod._PLANS.clear()
    rec, _ = launches(lambda: cuflash.flash_attn_backward(*tensors(2, 300, 777, 8, 2, 128)))
    res[f"inner {grp} non-causal"] = rec[1][0]
_bwd_sm90.HEADS_INNER = _bwd_sm90.CAUSAL_GROUP = None
bwd_mod._PLANS.clear()
# the persistent form and stream-K forced on (cuflash._bwd_sm90.PERSIST, STREAM_K; PERSIST_MAX_GRID): the kernel, grid
# and parameter bytes (stream-K's workspace pointer is put in per call) of each call's main kernel
from cuflash import _walk
_walk.sk_workspace = lambda device, stream, nbytes: 0x7000_0000 + nbytes  # (a fake address that names the size)
FORCED = {"d128": ((2, 300, 777, 8, 2, 128), {}), "d128 causal": ((2, 300, 777, 8, 2, 128), dict(causal=True)),
          "d48 seqpar": ((2, 300, 777, 8, 2, 48), dict(dq_strategy="seqpar")), "many tiles": ((4, 64, 8000, 8, 8, 64), {}),
          "whole waves": ((4, 64, 8000, 8, 8, 64), dict(dq_strategy="seqpar")),
          "ordered": ((2, 300, 777, 8, 2, 128), dict(deterministic=True)),
          "window": ((2, 300, 777, 8, 2, 128), dict(window_size=(100, 0))), "d96": ((2, 300, 777, 8, 2, 96), {}),
          "d256": ((2, 300, 777, 8, 2, 256), {}), "d256 window": ((2, 300, 777, 8, 2, 256), dict(window_size=(100, 0)))}
def forced(knob, prefix, names, grids=None):
    setattr(_bwd_sm90, knob, True)
    for cap in (None, 5):
        for name in names:
            shape, kw = FORCED[name]
            _bwd_sm90.PERSIST_MAX_GRID = (grids or {}).get((name, cap), cap)
            bwd_mod._PLANS.clear()
            rec, _ = launches(lambda: cuflash.flash_attn_backward(*tensors(*shape), **kw))
            res[f"{prefix} {cap} {name}"] = rec[1]
    setattr(_bwd_sm90, knob, None)
    _bwd_sm90.PERSIST_MAX_GRID = None
    bwd_mod._PLANS.clear()
forced("PERSIST", "persist", ("d128", "d128 causal", "d48 seqpar", "many tiles", "ordered", "window", "d96", "d256",
                              "d256 window"))
# (2016 tiles in whole waves of 126 or 4 blocks: "whole waves")
forced("STREAM_K", "sk", ("d128", "d128 causal", "d48 seqpar", "many tiles", "whole waves", "window", "d96", "d256"),
       {("whole waves", None): 126, ("whole waves", 5): 4})
# the modifier kernels' CAP_ONLY form (cuflash._bwd_sm90.CAP_ONLY): the main kernel of calls with and without modifiers
CAP_CALLS = {"softcap d128": ((2, 300, 777, 8, 2, 128), dict(softcap=10.0)),
             "softcap d64 causal": ((2, 300, 777, 8, 2, 64), dict(softcap=10.0, causal=True)),
             "window d96": ((2, 300, 777, 8, 2, 96), dict(window_size=(100, 0))),
             "softcap d256": ((2, 300, 777, 8, 2, 256), dict(softcap=10.0)),
             "plain d128": ((2, 300, 777, 8, 2, 128), {}),
             "window d64": ((2, 300, 777, 8, 2, 64), dict(window_size=(100, 0)))}
for knob in (None, True, False):
    _bwd_sm90.CAP_ONLY = knob
    for name, (shape, kw) in CAP_CALLS.items():
        bwd_mod._PLANS.clear()
        rec, _ = launches(lambda: cuflash.flash_attn_backward(*tensors(*shape), **kw))
        res[f"cap_only {knob} {name}"] = rec[1][0]
# ... and in the persistent form (forced), at head dim 64
_bwd_sm90.PERSIST = True
for knob in (None, True, False):
    _bwd_sm90.CAP_ONLY = knob
    for name in ("softcap d64 causal", "window d64"):
        shape, kw = CAP_CALLS[name]
        bwd_mod._PLANS.clear()
        rec, _ = launches(lambda: cuflash.flash_attn_backward(*tensors(*shape), **kw))
        res[f"cap_only persist {knob} {name}"] = rec[1][0]
_bwd_sm90.PERSIST = None
_bwd_sm90.CAP_ONLY = None
bwd_mod._PLANS.clear()
# the 80-row Q tiles forced on (cuflash._bwd_sm90.M80): the three launches of calls that can take them, and the main
# kernel of those that cannot; with PERSIST forced too, the 80-row tiles' persistent form
M80_CALLS = {"d128": ((2, 300, 777, 8, 2, 128), {}), "d120 seqpar": ((3, 161, 700, 4, 4, 120), dict(dq_strategy="seqpar")),
             "d128 one row": ((1, 1, 5, 2, 1, 128), {}),
             "causal": ((2, 300, 777, 8, 2, 128), dict(causal=True)),
             "window": ((2, 300, 777, 8, 2, 128), dict(window_size=(100, 0))),
             "ordered": ((2, 300, 777, 8, 2, 128), dict(deterministic=True)), "d64": ((2, 300, 777, 8, 2, 64), {}),
             "d96": ((2, 300, 777, 8, 2, 96), {})}
for persist in (None, True):
    _bwd_sm90.M80, _bwd_sm90.PERSIST = True, persist
    for name, (shape, kw) in M80_CALLS.items():
        bwd_mod._PLANS.clear()
        rec, _ = launches(lambda: cuflash.flash_attn_backward(*tensors(*shape), **kw))
        res[f"m80 {persist} {name}"] = rec
_bwd_sm90.M80 = _bwd_sm90.PERSIST = None
bwd_mod._PLANS.clear()
"""


@pytest.fixture(scope="module")
def res():
    return run_with_stand_ins(_BODY)


def _maps(raw_hex):
    raw = bytes.fromhex(raw_hex)
    return [raw[MAPS_OFFSET + 128 * i: MAPS_OFFSET + 128 * (i + 1)] for i in range(ARGS_BYTES // 128)]


def _map_fields(m):
    ptr, dtype = struct.unpack_from("<QI", m, 0)
    dims_box = [struct.unpack_from("<QI", m, 12 + 12 * i) for i in range(4)]
    return ptr, dtype, [d for d, _ in dims_box], [b for _, b in dims_box]


@pytest.mark.parametrize("d", [32, 40, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
def test_auto_takes_the_sm90_backward_where_it_can(res, d, causal, dt):
    rec = res[f"auto {d} {causal} {dt}"]
    assert len(rec) == 3  # preprocess, main, convert
    kd = _configs.kernel_headdim(d)
    # the convert: BWD_CONVERT_SLOTS 16-byte slots of the [b h sq_pad, kd] fp32 accumulator per thread
    rows = 2 * 8 * -(-300 // _configs.BWD_ROW_PAD) * _configs.BWD_ROW_PAD
    threads = rows * kd // 4 // _configs.BWD_CONVERT_SLOTS
    assert rec[2][1] == [-(-threads // _configs.BWD_CONVERT_THREADS), 1, 1]
    if d > _configs.SM80_ONLY_MAX_HEADDIM and kd in _configs.SM90_BWD_HEADDIMS:
        bn = 64 if kd == 256 else 128  # the column-split kernel's KV tile at head dim 256
        if _configs.sm90_bwd_persistent(kd, causal, 0, 0, 777):  # the persistent form (777 keys: configured for it)
            spec = _configs.sm90_bwd_spec(dt, kd, causal, _configs.sm90_bwd_persist_tile(kd))
            assert rec[1][1] == [-(-777 // bn) * 2 * 2, 1, 1]  # every tile on its own SM (fewer than 132)
        else:
            spec = _configs.sm90_bwd_spec(dt, kd, causal,
                                          group=_configs.sm90_bwd_causal_group(kd, 777) if causal else 0)
            assert rec[1][1] == [-(-777 // bn), 2, 2]  # (KV tiles, KV heads, batch)
        assert rec[1][0] == spec.name
        assert _configs.sm90_bwd_tile(kd).block_n == bn and ("split" in spec.name) == (kd == 256)
        assert rec[2][0] == _configs.bwd_convert_spec(dt, kd, causal, bn).name
        # one parameter block for the three kernels; the main kernel's maps after it: q, k, v, dout and the outputs
        # dk, dv, whose boxes are 64 columns by the tile's rows, their dims the inputs' (head dim, seqlen, heads,
        # batch), dk's and dv's at the parameter block's output pointers
        assert rec[0][2][:2 * BWD_PARAMS.size] == rec[1][2][:2 * BWD_PARAMS.size] == rec[2][2][:2 * BWD_PARAMS.size]
        bm = _configs.sm90_bwd_tile(kd).block_m
        shapes = [(d, 300, 8, 2), (d, 777, 2, 2), (d, 777, 2, 2), (d, 300, 8, 2), (d, 777, 2, 2), (d, 777, 2, 2)]
        maps = _maps(rec[1][2])
        assert len(maps) == 6
        for m, rows, dims in zip(maps, (bm, bn, bn, bm, bn, bn), shapes):
            ptr, _, got_dims, box = _map_fields(m)
            assert ptr and tuple(got_dims) == dims and box == [64, rows, 1, 1]
        f = _fields(rec)
        assert [_map_fields(m)[0] for m in maps[4:]] == [f["dk"], f["dv"]] and f["dk"] != f["dv"]
    else:
        assert "bwd_sm90" not in rec[1][0] and "flash_bwd_kernel" in rec[1][0]


@pytest.mark.parametrize("name,why", [("dropout", "dropout"), ("loop", "dq_strategy='loop'"),
                                      ("kv", "warp_partition='kv'")])
def test_options_of_the_sm80_kernels(res, name, why):
    assert "flash_bwd_kernel" in res["opt " + name][1][0]
    kind, msg = res["forced " + name]
    assert kind == "ValueError" and "backend='sm90'" in msg and why in msg


def test_refusals_name_the_reason(res):
    kind, msg = res["forced d256 ordered"]  # (the column-split kernel's "ordered" turned off)
    assert kind == "ValueError" and "backend='sm90'" in msg and "dq_strategy='ordered' at head dim 256" in msg, msg
    assert "SPLIT_ORDERED" in msg
    kind, msg = res["forced d256 ordered softcap"]  # turned on: "ordered" runs without score modifiers, as elsewhere
    assert kind == "ValueError" and "dq_strategy='ordered'" in msg and "softcap" in msg, msg
    # the score modifiers at 256: the column-split kernel's MOD_SCORE form (mod 1)
    for name in ("forced d256 window", "auto d256 softcap"):
        main = res[name][1][0]
        assert main == _configs.sm90_bwd_spec("float16", 256, False, mod=_configs.MOD_SCORE).name, (name, main)
    assert res["forced d32"][0] == "ValueError" and "head dim 32" in res["forced d32"][1]
    assert res["bad backend"][0] == "ValueError" and "backend" in res["bad backend"][1]
    assert "flash_bwd_kernel" in res["expanded"][1][0]
    assert res["forced expanded"][0] == "ValueError" and "k's base address or strides" in res["forced expanded"][1]


def _fields(rec):
    return dict(zip(BWD_PARAMS.names, BWD_PARAMS.struct.unpack_from(bytes.fromhex(rec[1][2]), 0)))


def test_deterministic_strategies(res):
    """deterministic=True: "ordered" (3, one accumulator) without modifiers, seqpar (1) with 128-key buffers with a
    window or when asked for; at head dim 256 seqpar with 64-key buffers while the column-split kernel's "ordered"
    is turned off, "ordered" once turned on (its consumer warps take the turns), and as configured
    (SM90_BWD_SPLIT_ORDERED) by default; "ordered" refused with a window or on the sm80 kernels."""
    d256 = (3, 1) if _configs.SM90_BWD_SPLIT_ORDERED else (1, -(-777 // 64))
    for name, strategy, splits in (("deterministic", 3, 1), ("deterministic window", 1, -(-777 // 128)),
                                   ("seqpar", 1, -(-777 // 128)), ("deterministic d256", 1, -(-777 // 64)),
                                   ("deterministic d256 split ordered", 3, 1), ("deterministic d256 configured", *d256)):
        rec = res[name]
        assert "bwd_sm90" in rec[1][0], name
        f = _fields(rec)
        assert (f["dq_strategy"], f["num_dq_splits"]) == (strategy, splits), name
    for name in ("ordered window", "ordered sm80"):
        kind, msg = res[name]
        assert kind == "ValueError" and "ordered" in msg, name
    # head dim 256, "ordered" turned on and asked for: the column-split kernel's, without a mask in the launch's order
    # (ascending turns, every block from Q tile 0), causal with KV tiles last first (SM90_BWD_CAUSAL_ORDER: 11 KV tiles
    # of 64 keys)
    for causal, order in ((False, _configs.DQ_ORDER_PLAIN), (True, _configs.SM90_BWD_CAUSAL_ORDER)):
        rec = res[f"forced d256 ordered {causal}"]
        assert rec[1][0] == _configs.sm90_bwd_spec("float16", 256, causal, order=order).name, causal
        assert rec[1][1] == [-(-700 // 64), 4, 1] and _fields(rec)["dq_strategy"] == 3



def test_dq_numbers_match_the_kernels():
    """The numbers the host and the kernels must agree on, read from cuda_src/attn/bwd.cuh: the dQ strategies, the
    visiting orders and the "ordered" semaphores' rows (the host sizes and the preprocess zeroes rows / that many)."""
    from pathlib import Path

    src = (Path(_configs.__file__).resolve().parent.parent / "cuda_src" / "attn" / "bwd.cuh").read_text()
    enums = {m[0]: int(m[1]) for m in re.findall(r"\b(DQ_[A-Z_]+) = (\d+)", src)}
    from cuflash.backward import DQ_STRATEGIES

    assert {k: enums[f"DQ_{k.upper()}"] for k in DQ_STRATEGIES} == DQ_STRATEGIES
    for name in ("PLAIN", "Q_DESC", "KV_DESC", "ROT", "HEADS_INNER"):
        assert enums[f"DQ_ORDER_{name}"] == getattr(_configs, f"DQ_ORDER_{name}"), name
    rows = re.search(r"constexpr int DQ_ORDERED_ROWS_PER_SEM = (\d+);", src)
    assert rows and int(rows[1]) == _configs.DQ_ORDERED_ROWS_PER_SEM
    # the column-split kernel's consumer warps (2 consumers x 4 warps) each own one semaphore of a 64-row Q tile
    assert 64 // _configs.DQ_ORDERED_ROWS_PER_SEM == 8

def test_memoized_maps(res):
    r1, r2, r3, p1, p2 = res["memo"]
    m1, m2, m3 = _maps(r1[1][2]), _maps(r2[1][2]), _maps(r3[1][2])
    # the same inputs: the same maps of q, k, v, dout (dk's and dv's follow the outputs' addresses, new arrays here)
    assert m1[:4] == m2[:4] and [r[0] for r in r1] == [r[0] for r in r2]
    # map order q, k, v, dout, dk, dv; the tensors' order in the call: dout, q, k, v, out, lse; dk and dv the plan's
    # outputs (the parameter block's pointers)
    for r, m, p in ((r1, m1, p1), (r2, m2, p1), (r3, m3, p2)):
        f = _fields(r)
        assert [_map_fields(x)[0] for x in m] == [p[1], p[2], p[3], p[0], f["dk"], f["dv"]]


# ---- "ordered" under the causal mask: the turn protocol of cuda_src/flash_bwd_sm90.cu, emulated -------------------

def _ordered_blocks(sq, sk, bm, group, order, causal=True, bn=128):
    """Per dispatched block (blockIdx.x order): [(head, Q tile, turn)] in the kernel's visiting order, from the
    kernel's formulas (attn/block.cuh: q_block_begin, q_block_end, kv_block_end; the writer's turn)."""
    diag, n_tiles = sk - sq, -(-sk // bn)
    out = []
    for x in range(n_tiles):
        j = n_tiles - 1 - x if order == _configs.DQ_ORDER_KV_DESC else x
        n0 = j * bn
        m_begin = c_div(n0 - diag, bm) if causal and n0 - diag > 0 else 0
        num_m = max(0, -(-sq // bm) - m_begin)
        items = []
        if order == _configs.DQ_ORDER_HEADS_INNER:  # walk_step's: the Q tiles (last first) outer, the heads inner
            walk = [(h, it) for it in range(num_m) for h in range(group)]
        else:
            walk = [(h, it) for h in range(group) for it in range(num_m)]
        last_first = order in (_configs.DQ_ORDER_Q_DESC, _configs.DQ_ORDER_HEADS_INNER)
        for h, it in walk:
            m = m_begin + num_m - 1 - it if last_first else m_begin + it
            last = c_div(min(sk, (m + 1) * bm + diag) + bn - 1, bn) - 1
            items.append((h, m, last - j if order == _configs.DQ_ORDER_KV_DESC else j))
        out.append((j, items))
    return out


def _run(blocks, slots):
    """Blocks start in order as slots free up; a resident block adds (h, m) once that counter reads its turn.
    Returns ({(h, m): [KV tiles in the order they added]}, deadlocked)."""
    counters, adders, resident, queue = {}, {}, [], list(blocks)
    while queue or resident:
        while queue and len(resident) < slots:
            j, items = queue.pop(0)
            resident.append([j, list(items)])
        moved = False
        for b in resident:
            while b[1] and counters.get(b[1][0][:2], 0) == b[1][0][2]:
                h, m, _ = b[1].pop(0)
                counters[(h, m)] = counters.get((h, m), 0) + 1
                adders.setdefault((h, m), []).append(b[0])
                moved = True
        resident = [b for b in resident if b[1]]
        if not moved and resident:
            return adders, True
    return adders, False


def _rot_turn(n, m, N, M):
    """cuda_src/flash_bwd_sm90.cu rot_turn, line for line."""
    nq, q = n // M, N // M
    nm, rem = n - nq * M, N - q * M
    d = nm - m + M if nm - m < 0 else nm - m
    below = max(0, min(m + d, rem) - m) if m + d <= M else max(0, rem - m) + min(m + d - M, rem)
    return d * q + below + nq


def _rot_blocks(sq, sk, bm, group, bn=128):
    """DQ_ORDER_ROT's blocks (no mask): block x = KV tile x visits Q tile (x - s) mod M at step s of each head
    (q_tile_at, rot_of_tile), with the writer's turn."""
    N, M = -(-sk // bn), -(-sq // bm)
    return [(x, [(h, (x % M - s) % M, _rot_turn(x, (x % M - s) % M, N, M)) for h in range(group) for s in range(M)])
            for x in range(N)]


@pytest.mark.parametrize("bm,bn", [(64, 128), (128, 128), (64, 64)])
@pytest.mark.parametrize("sq,sk", [(1, 1), (17, 300), (300, 17), (700, 130), (1000, 700), (640, 1300),
                                   (2048, 2048), (4095, 4097), (130, 2100), (64, 8448)])
@pytest.mark.parametrize("group", [1, 3])
def test_ordered_rot_turns(bm, bn, sq, sk, group):
    """DQ_ORDER_ROT: every Q tile's turns are a permutation of 0 .. N - 1 in (step, KV tile) order -- the kernel's
    closed form equals that definition, so a block's predecessor at a Q tile added there at an earlier step or, at
    the same step, from a lower KV tile (no waits while all run side by side) --, and the blocks finish in one fixed
    order with any residency of at least N blocks; with fewer than N <= M it deadlocks (KV tile 0 waits on the last
    one), which is why the host takes this order only where N <= half the SMs. bn = 64: the column-split kernel's
    64 x 64 tiles, whose consumer warps take the same turns each."""
    blocks = _rot_blocks(sq, sk, bm, group, bn)
    N, M = len(blocks), -(-sq // bm)
    turns = {}
    for x, items in blocks:
        for s, (h, m, t) in enumerate(items):
            turns.setdefault((h, m), []).append((s % M, x, t))
    for (h, m), stx in turns.items():
        assert len(stx) == N
        assert [t for _, _, t in sorted(stx)] == list(range(N)), (h, m)  # (step, KV tile) order
    expect = None
    for slots in sorted({N, N + 1, 132, 2 * N}):
        adders, dead = _run(blocks, slots)
        assert not dead, slots
        assert expect is None or adders == expect
        expect = adders
    if 1 < N <= M:  # (N > M: whether it deadlocks depends on the shape; N <= the slots is what the host ensures)
        assert _run(blocks, N - 1)[1]


def test_ordered_rot_dispatch(res):
    """"ordered" without a mask launches the ROT kernel where it measured faster (one query head per KV head, at most
    SM90_BWD_ROT_MAX_TILES KV tiles: 64 at head dim 64, 32 at 128), the plain one elsewhere; forced, ROT with GQA too
    but never past half the SMs (a head's blocks must be resident together), or plain anywhere. The kernels are
    compiled (sm90_bwd_specs), and the orders refuse the other mask and the modifiers."""
    def spec(d, order):
        return _configs.sm90_bwd_spec("float16", d, False, order=order)
    rot, plain = _configs.DQ_ORDER_ROT, _configs.DQ_ORDER_PLAIN
    assert _configs.SM90_BWD_ROT_MAX_TILES == {64: 64, 96: 32, 128: 32}
    expect = {None: {"d64 64 tiles": rot, "d64 65 tiles": plain, "d64 66 tiles": plain, "d64 67 tiles": plain,
                     "d128 32 tiles": rot, "d128 33 tiles": plain, "d128 gqa": plain, "d256 66 tiles": plain,
                     "d256 67 tiles": plain},
              3: {"d64 64 tiles": rot, "d64 65 tiles": rot, "d64 66 tiles": rot, "d64 67 tiles": plain,
                  "d128 32 tiles": rot, "d128 33 tiles": rot, "d128 gqa": rot, "d256 66 tiles": rot,
                  "d256 67 tiles": plain},
              0: dict.fromkeys(("d64 64 tiles", "d64 65 tiles", "d64 66 tiles", "d64 67 tiles", "d128 32 tiles",
                                "d128 33 tiles", "d128 gqa", "d256 66 tiles", "d256 67 tiles"), plain)}
    for knob, cases in expect.items():
        for name, order in cases.items():
            rec = res[f"rot {knob} {name}"]
            d = int(name.split()[0][1:])
            assert rec[1][0] == spec(d, order).name, (knob, name)
            assert _fields(rec)["dq_strategy"] == 3
    assert res["rot None d64 64 tiles"][1][1] == [64, 2, 1] and res["rot 3 d256 66 tiles"][1][1] == [66, 2, 1]
    for d in (64, 256):
        assert spec(d, rot).name.endswith(", 3>") and spec(d, rot) in _configs.sm90_bwd_specs()
    assert "split" in spec(256, rot).name
    # causal: the heads-inner walk with GQA and fixed lengths (n_blocks > 0), else KV tiles last first; or as forced
    inner, kv_desc = _configs.DQ_ORDER_HEADS_INNER, _configs.SM90_BWD_CAUSAL_ORDER
    assert _configs.SM90_BWD_ORDERED_HEADS_INNER_MIN_HEADS == 2 and kv_desc == _configs.DQ_ORDER_KV_DESC
    assert _configs.sm90_bwd_ordered_order(True, 0, 5, 132, 128, 4) == inner
    assert _configs.sm90_bwd_ordered_order(True, 0, 5, 132, 64, 2) == inner
    assert _configs.sm90_bwd_ordered_order(True, 0, 5, 132, 128, 1) == kv_desc
    assert _configs.sm90_bwd_ordered_order(True, 0, 0, 132, 128, 4) == kv_desc  # (packed sequences)
    assert _configs.sm90_bwd_ordered_order(True, 0, 5, 132, 128, 4, causal_order=kv_desc) == kv_desc
    assert _configs.sm90_bwd_ordered_order(True, 0, 5, 132, 128, 1, causal_order=inner) == inner
    # its dispatch group: "atomic"'s on the heads-inner walk (sm90_bwd_causal_walk), else the launch's
    g = _configs.SM90_BWD_CAUSAL_GROUP
    for order, args, want in ((inner, (128, 4096, 8, 256, 132), g), (inner, (128, 8192, 8, 1024, 132), 0),
                              (inner, (128, 8193, 8, 256, 132), 0), (inner, (64, 4096, 8, 256, 132), 0),
                              (inner, (128, 4096, 1, 256, 132), 0), (kv_desc, (128, 4096, 8, 256, 132), 0)):
        assert _configs.sm90_bwd_ordered_group(order, *args) == want, (order, args)
    assert _configs.sm90_bwd_ordered_order(False, _configs.MOD_SCORE, 5, 132, 128, 1) == plain
    assert _configs.sm90_bwd_ordered_order(False, 0, 32, 60, 128, 1) == plain  # (30 of 60 SMs)
    with pytest.raises(ValueError, match="order"):
        _configs.sm90_bwd_spec("float16", 64, True, order=rot)
    with pytest.raises(ValueError, match="order"):
        _configs.sm90_bwd_spec("float16", 64, False, mod=_configs.MOD_SCORE, order=rot)


# (order, KV tile, Q tile): the 128-key kernels' orders at both Q tiles, and the column-split kernel's (64 x 64 tiles;
# no Q_DESC there)
_CAUSAL_TURN_CASES = [(o, 128, bm) for o in (_configs.DQ_ORDER_PLAIN, _configs.DQ_ORDER_Q_DESC,
                                              _configs.DQ_ORDER_KV_DESC, _configs.DQ_ORDER_HEADS_INNER)
                      for bm in (64, 128)] + [(o, 64, 64) for o in (_configs.DQ_ORDER_PLAIN, _configs.DQ_ORDER_KV_DESC,
                                                                     _configs.DQ_ORDER_HEADS_INNER)]


@pytest.mark.parametrize("order,bn,bm", _CAUSAL_TURN_CASES)
@pytest.mark.parametrize("sq,sk", [(1, 1), (17, 300), (300, 17), (700, 130), (1000, 700), (640, 1300),
                                   (4096, 4096), (4095, 4097), (130, 2100)])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_ordered_causal_turns(order, bn, bm, sq, sk, group):
    """Every Q tile's turns are a permutation of 0 .. (KV tiles that see it) - 1 -- exactly the KV tiles the mask
    lets see it (a prefix), each once -- and the blocks finish with any number of resident blocks (in-order
    dispatch), so the additions run in one fixed order: deterministic, no deadlock. The column-split kernel takes the
    turns per consumer warp (8 semaphores per Q tile), each warp the same sequence as its Q tile's."""
    blocks = _ordered_blocks(sq, sk, bm, group, order, bn=bn)
    diag = sk - sq
    turns = {}
    for j, items in blocks:
        for h, m, t in items:
            turns.setdefault((h, m), []).append((t, j))
    for (h, m), tj in turns.items():
        seen = sorted(j for _, j in tj)
        # the KV tiles whose keys some row of Q tile m sees (bottom-right causal), rows past seqlen_q included
        assert seen == [j for j in range(-(-sk // bn)) if j * bn <= (m + 1) * bm - 1 + diag], (h, m)
        assert sorted(t for t, _ in tj) == list(range(len(tj))), (h, m, tj)
    # Q tiles whose rows all see no key are never waited for (their dQ stays the preprocess's zeros)
    assert all((m + 1) * bm - 1 + diag >= 0 for _, m in turns)
    expect = None
    for slots in (1, 2, 5, 132):
        adders, dead = _run(blocks, slots)
        assert not dead, slots
        assert expect is None or adders == expect  # the same order whatever the residency
        expect = adders


def test_the_emulation_sees_a_deadlock():
    """The emulation's check is live: KV tiles last first without the reversed dispatch (block x = KV tile x) waits
    on a block that cannot start while one slot holds the waiter."""
    blocks = _ordered_blocks(1000, 1000, 64, 1, _configs.DQ_ORDER_KV_DESC)[::-1]
    assert _run(blocks, 1)[1] and not _run(blocks, 132)[1]


def test_ordered_causal_kernels(res):
    """Causal "ordered": with GQA the heads-inner walk's kernel in "atomic"'s dispatch order for it (here, 28 blocks,
    the grouped one), without it KV tiles last first; both with the "ordered" strategy's value and one block per KV
    tile."""
    rec = res["deterministic causal"]
    assert rec[1][0] == _configs.sm90_bwd_spec("float16", 128, True, order=_configs.DQ_ORDER_HEADS_INNER,
                                               group=_configs.SM90_BWD_CAUSAL_GROUP).name
    assert rec[1][0].endswith(f", 0, 4, {_configs.SM90_BWD_CAUSAL_GROUP}>") and _fields(rec)["dq_strategy"] == 3
    assert rec[1][0] in {s.name for s in _configs.sm90_bwd_heads_inner_specs()}
    assert rec[1][1] == [-(-777 // 128), 2, 2]
    rec = res["deterministic causal mha"]
    assert rec[1][0] == _configs.sm90_bwd_spec("float16", 64, True, order=_configs.SM90_BWD_CAUSAL_ORDER).name
    assert rec[1][0].endswith(", 0, 2>") and _fields(rec)["dq_strategy"] == 3
    assert rec[1][1] == [-(-777 // 128), 4, 2]
    # the other strategies keep the plain order (causal "atomic" at 777 keys: the persistent form), and so does
    # "ordered" without a mask with GQA (test_ordered_rot_dispatch)
    assert res["deterministic"][1][0] == _configs.sm90_bwd_spec("float16", 128, False).name
    assert _configs.sm90_bwd_persistent(128, True, 0, 0, 777)  # (777 keys: the persistent form, in launch order)
    assert res["atomic causal"][1][0] == _configs.sm90_bwd_spec("float16", 128, True,
                                                                    _configs.sm90_bwd_persist_tile(128)).name
    with pytest.raises(ValueError, match="order"):
        _configs.sm90_bwd_spec("float16", 128, False, order=_configs.DQ_ORDER_KV_DESC)


def test_convert_slots_match_the_kernel():
    """The host's BWD_CONVERT_SLOTS and BWD_CONVERT_THREADS (the convert grid and block) are the kernel's, and the
    slots divide every head dim's n8 blocks."""
    import re

    from cuflash._loader import source_dir

    src = (source_dir() / "flash_bwd.cu").read_text()
    assert int(re.search(r"constexpr int BWD_CONVERT_SLOTS = (\d+);", src).group(1)) == _configs.BWD_CONVERT_SLOTS
    assert int(re.search(r"constexpr int BWD_CONVERT_THREADS = (\d+);", src).group(1)) == _configs.BWD_CONVERT_THREADS
    assert all(d // 8 % _configs.BWD_CONVERT_SLOTS == 0 for d in _configs.HEADDIMS)


def test_convert_quad_transpose():
    """The convert's staging (cuda_src/flash_bwd.cu, flash_bwd_convert_dq_kernel, with its formulas): lane (g, t)
    writes slot n's pair of columns 2t, 2t + 1 of rows g (half 0) and g + 8 (half 1) to word ((2 n + half) 8 +
    (g ^ 2 n)) 4 + t, and reads the 16 bytes at word ((2 t + half) 8 + (g ^ 2 t)) 4: the read is block t's 8 columns
    of its own row in order; no two lanes write one word; the pair stores and the 16-byte loads are free of bank
    conflicts (32 banks of 4 bytes; a 16-byte load is served a quarter warp at a time)."""
    from cuflash._loader import source_dir

    src = (source_dir() / "flash_bwd.cu").read_text()
    kernel = src[src.index("flash_bwd_convert_dq_kernel(const __grid_constant__"):]
    kernel = kernel[:kernel.index("\n}\n")]
    assert "st[((n * 2 + 0) * 8 + (g ^ (2 * n))) * 4 + t]" in kernel  # (the formulas emulated below are the kernel's)
    assert "st[((n * 2 + 1) * 8 + (g ^ (2 * n))) * 4 + t]" in kernel
    assert "st + ((t * 2 + 0) * 8 + (g ^ (2 * t))) * 4" in kernel
    assert "st + ((t * 2 + 1) * 8 + (g ^ (2 * t))) * 4" in kernel
    ns = _configs.BWD_CONVERT_SLOTS

    def wr(n, half, g, t):
        return ((n * 2 + half) * 8 + (g ^ (2 * n))) * 4 + t

    def rd(half, g, t):
        return ((t * 2 + half) * 8 + (g ^ (2 * t))) * 4

    smem = {}
    for n in range(ns):
        for half in (0, 1):
            words = [wr(n, half, l // 4, l % 4) for l in range(32)]
            assert len({w % 32 for w in words}) == 32  # one store instruction: 32 banks
            for l, w in enumerate(words):
                assert w not in smem
                smem[w] = (n, half, l // 4, 2 * (l % 4))  # (block of the slot, row half, row g, first column)
    assert sorted(smem) == list(range(ns * 2 * 32))
    for half in (0, 1):
        for q in range(4):  # quarter warps
            lanes = range(8 * q, 8 * q + 8)
            assert len({rd(half, l // 4, l % 4) // 4 % 8 for l in lanes}) == 8  # 8 distinct 16-byte bank groups
        for l in range(32):
            g, t = l // 4, l % 4
            assert [smem[rd(half, g, t) + i] for i in range(4)] == [(t, half, g, 2 * i) for i in range(4)]


def test_grid_model_tail():
    """bench/diag/bwd_grid_model.py: blocks of equal length end at ceil(blocks / 132) waves (the non-causal grid's
    tail), and under the causal mask dispatching every head's longest KV tile first never ends later than the
    launch's head-major order."""
    import math

    from bench.diag import bwd_grid_model as gm

    for d in (64, 128):
        bm = _configs.SM90_BWD_TILES[d].block_m
        for s in (2048, 16384):
            b, h = 16384 // s, 2048 // d
            blocks = b * h * s // gm.BLOCK_N
            want = math.ceil(blocks / gm.SMS) / (blocks / gm.SMS)
            assert abs(gm.overhead(s, h, b, bm, False, "head-major") - want) < 1e-12
            tile, head = (gm.overhead(s, h, b, bm, True, o) for o in ("tile-major", "head-major"))
            assert 1.0 <= tile <= head
            # groups of one pair are the launch's order; a group of every pair is tile-major
            assert gm.overhead(s, h, b, bm, True, "tile-major/1") == head
            assert gm.overhead(s, h, b, bm, True, f"tile-major/{b * h}") == tile
    assert gm.block_lengths(512, 64, True) == [8, 6, 4, 2] and gm.block_lengths(512, 64, False) == [8] * 4


@pytest.mark.parametrize("grid", [(1, 1, 1), (5, 3, 2), (16, 16, 8), (7, 5, 3), (128, 2, 1)])
@pytest.mark.parametrize("group", [1, 2, 3, 8, 1000])
def test_grouped_dispatch_order(grid, group):
    """The kernel's GROUP mapping (bench/diag/bwd_grid_model.grouped_block, the Python form of sm90_bwd_block): every
    block of the launch exactly once, the groups' (KV head, batch) pairs one group after the other, and inside a group
    the KV tiles ascending (tile 0 of each pair first: under the causal mask the longest)."""
    from bench.diag.bwd_grid_model import grouped_block

    n, hk, b = grid
    coords = [grouped_block(lin, n, hk, b, group) for lin in range(n * hk * b)]
    assert sorted(coords) == sorted((j, h, z) for j in range(n) for h in range(hk) for z in range(b))
    pair_of = [z * hk + h for _, h, z in coords]
    groups = [p // group for p in pair_of]
    assert groups == sorted(groups)
    for g in set(groups):
        tiles = [j for (j, _, _), gg in zip(coords, groups) if gg == g]
        assert tiles == sorted(tiles)
    if group == 1:  # groups of one pair: the launch's order (KV tile fastest)
        assert coords == [(j, h, z) for z in range(b) for h in range(hk) for j in range(n)]


def test_group_kernels(res):
    """The grouped dispatch order is taken by the causal kernels of "atomic" and "seqpar" only; the host takes it there
    when CAUSAL_GROUP is set, and keeps "ordered" (its own order), the modifiers and the non-causal kernels; by
    default (CAUSAL_GROUP None) at the head dims SM90_BWD_CAUSAL_GROUP_HEADDIMS up to
    SM90_BWD_CAUSAL_GROUP_MAX_SEQLEN_K keys, the launch's order elsewhere."""
    spec = _configs.sm90_bwd_spec("float16", 128, True, group=8)
    assert spec.name.endswith(", 0, 0, 8>") and spec.name != _configs.sm90_bwd_spec("float16", 128, True).name
    for causal, kw in ((False, {}), (True, dict(order=_configs.DQ_ORDER_KV_DESC)), (True, dict(group=-1))):
        with pytest.raises(ValueError, match="group"):
            _configs.sm90_bwd_spec("float16", 128, causal, **dict(dict(group=8), **kw))
    assert res["group atomic"] == res["group seqpar"] == spec.name
    # "ordered" (GQA: the heads-inner walk's kernel) takes the configuration's dispatch order, not CAUSAL_GROUP's
    ordered = _configs.sm90_bwd_spec("float16", 128, True, order=_configs.DQ_ORDER_HEADS_INNER,
                                     group=_configs.SM90_BWD_CAUSAL_GROUP)
    assert res["group ordered"] == ordered.name
    # non-causal calls have no dispatch order to take: at 777 keys the persistent form, as configured
    assert res["group non-causal"] == _configs.sm90_bwd_spec("float16", 128, False,
                                                             _configs.sm90_bwd_persist_tile(128)).name
    # the window's band kernel (mod MOD_SCORE: no dispatch order; its CAP_ONLY form where configured)
    band = replace(_configs.sm90_bwd_tile(128), cap_only=128 in _configs.SM90_BWD_CAP_ONLY_HEADDIMS)
    assert res["group window"] == _configs.sm90_bwd_spec("float16", 128, False, band, mod=_configs.MOD_SCORE).name
    g = _configs.SM90_BWD_CAUSAL_GROUP
    assert g > 1 and 128 in _configs.SM90_BWD_CAUSAL_GROUP_HEADDIMS and 64 not in _configs.SM90_BWD_CAUSAL_GROUP_HEADDIMS
    grouped = _configs.sm90_bwd_spec("float16", 128, True, group=g).name
    assert res["default longest grouped"] == grouped  # (at 777 keys the persistent form: test_persistent_form_launches)
    assert res["default long"] == _configs.sm90_bwd_spec("float16", 128, True).name
    assert res["default d64"] == _configs.sm90_bwd_spec("float16", 64, True, _configs.sm90_bwd_persist_tile(64)).name


def test_heads_inner_kernels(res):
    """The heads-inner walk (DQ_ORDER_HEADS_INNER) is taken, when forced, by the causal kernels of "atomic" and "seqpar"
    of one block per tile, in the launch's or the grouped dispatch order, at 128 keys and with the column-split kernel;
    "ordered" keeps its own order, the modifier and non-causal kernels theirs, and a call in the persistent form keeps
    that (its walk is the launch's). Its spec names the order after the group; orders and forms it cannot run with
    are refused."""
    hi = _configs.DQ_ORDER_HEADS_INNER
    # no dispatch order forced: at 777 keys the persistent form, as configured; past the grouped order's key limit
    # the launch's order
    for d in (128, 256):
        assert res[f"inner None {'atomic' if d == 128 else 'd256'}"] == _configs.sm90_bwd_spec(
            "float16", d, True, _configs.sm90_bwd_persist_tile(d)).name
    assert res["inner None long"] == _configs.sm90_bwd_spec("float16", 128, True, order=hi).name
    assert res["inner 3 atomic"] == res["inner 3 seqpar"] == _configs.sm90_bwd_spec("float16", 128, True, order=hi,
                                                                                    group=3).name
    assert res["inner 3 d256"] == _configs.sm90_bwd_spec("float16", 256, True, order=hi, group=3).name
    assert res["inner 3 long"] == _configs.sm90_bwd_spec("float16", 128, True, order=hi, group=3).name
    for grp in (None, 3):
        # ("ordered" with GQA: the heads-inner walk whatever HEADS_INNER says, in the configuration's dispatch order)
        assert res[f"inner {grp} ordered"] == _configs.sm90_bwd_spec("float16", 128, True, order=hi,
                                                                      group=_configs.SM90_BWD_CAUSAL_GROUP).name
        # the window's band kernel (mod MOD_SCORE: no dispatch order; its CAP_ONLY form where configured) and the
        # non-causal call (at 777 keys the persistent form) keep theirs
        assert res[f"inner {grp} window"] == res["group window"]
        assert res[f"inner {grp} non-causal"] == _configs.sm90_bwd_spec("float16", 128, False,
                                                                         _configs.sm90_bwd_persist_tile(128)).name
    assert _configs.sm90_bwd_spec("float16", 128, True, order=hi).name.endswith(", 0, 4>")
    assert _configs.sm90_bwd_spec("float16", 128, True, order=hi, group=3).name.endswith(", 0, 4, 3>")
    assert _configs.sm90_bwd_spec("float16", 256, True, order=hi, group=3).name.endswith(", 0, 3, false, false, 4>")
    for causal, kw in ((False, {}), (True, dict(mod=_configs.MOD_SCORE))):
        with pytest.raises(ValueError, match="order"):
            _configs.sm90_bwd_spec("float16", 128, causal, order=hi, **kw)
    with pytest.raises(ValueError, match="persistent"):
        _configs.sm90_bwd_spec("float16", 128, True, _configs.sm90_bwd_persist_tile(128), order=hi)
    names = {s.name for s in _configs.sm90_bwd_specs()}
    assert {s.name for s in _configs.sm90_bwd_heads_inner_specs()} <= names
    for d in _configs.SM90_BWD_HEADDIMS:
        assert _configs.sm90_bwd_spec("bfloat16", d, True, order=hi).name in names


def test_heads_inner_rule(res):
    """The host's choice of walk for a causal call of one block per tile: the heads-inner walk with GQA where the grouped
    dispatch order is configured -- in the launch's dispatch order from SM90_BWD_HEADS_INNER_LAUNCH_MIN_HEADS query
    heads per KV head on grids of more than SM90_BWD_HEADS_INNER_GROUPED_MAX_WAVES blocks per SM, else in the grouped
    one --; the plain walk without GQA, past the grouped order's key limit and at the other head dims; and the default
    calls launch those kernels (the stand-ins' GPU: 132 SMs)."""
    hi, plain = _configs.DQ_ORDER_HEADS_INNER, _configs.DQ_ORDER_PLAIN
    lim, g = _configs.SM90_BWD_CAUSAL_GROUP_MAX_SEQLEN_K, _configs.SM90_BWD_CAUSAL_GROUP
    lo, hi_heads = _configs.SM90_BWD_HEADS_INNER_MIN_HEADS, _configs.SM90_BWD_HEADS_INNER_LAUNCH_MIN_HEADS
    waves = _configs.SM90_BWD_HEADS_INNER_GROUPED_MAX_WAVES
    assert 2 <= lo < hi_heads and waves >= 1
    for d in _configs.SM90_BWD_HEADDIMS:
        grouped = _configs.sm90_bwd_grouped_headdim(d)
        for heads in (1, lo, hi_heads - 1, hi_heads, 8, 16):
            for sk in (4096, lim, lim + 1, None):
                for blocks, sms in ((256, 132), (264, 132), (265, 132), (1024, 132), (1024, 512)):
                    got = _configs.sm90_bwd_causal_walk(d, sk, heads, blocks, sms)
                    gr = _configs.sm90_bwd_causal_group(d, sk)
                    if grouped and gr and heads >= lo:
                        launch = heads >= hi_heads and blocks > waves * sms
                        assert got == (hi, 0 if launch else g), (d, heads, sk, blocks, sms)
                    else:
                        assert got == (plain, gr), (d, heads, sk)
    assert res["default gqa 2"] == _configs.sm90_bwd_spec("float16", 128, True, order=hi, group=g).name
    # 8 query heads per KV head: 128 blocks (one wave) in the grouped order, 2048 in the launch's
    assert res["default gqa 8"] == _configs.sm90_bwd_spec("float16", 128, True, order=hi, group=g).name
    assert res["default gqa 8 many"] == _configs.sm90_bwd_spec("float16", 128, True, order=hi).name
    assert res["default gqa 8 long"] == _configs.sm90_bwd_spec("float16", 128, True).name
    assert res["default gqa 8 d64"] == _configs.sm90_bwd_spec("float16", 64, True).name


def test_default_group_rule():
    """sm90_bwd_causal_group: the group at the listed head dims up to the key limit, 0 past it, at other head dims
    and for packed sequences (seqlen_k None); the grouped kernels are among the precompiled ones."""
    lim = _configs.SM90_BWD_CAUSAL_GROUP_MAX_SEQLEN_K
    for d in _configs.SM90_BWD_HEADDIMS:
        on = d in _configs.SM90_BWD_CAUSAL_GROUP_HEADDIMS
        assert _configs.sm90_bwd_causal_group(d, 1) == _configs.sm90_bwd_causal_group(d, lim) == (
            _configs.SM90_BWD_CAUSAL_GROUP if on else 0)
        assert _configs.sm90_bwd_causal_group(d, lim + 1) == _configs.sm90_bwd_causal_group(d, None) == 0
        if _configs.sm90_bwd_tile(d).split:  # the column-split kernel: KV tiles last first and ROT, not Q_DESC
            for causal, order in ((True, _configs.DQ_ORDER_KV_DESC), (False, _configs.DQ_ORDER_ROT)):
                assert _configs.sm90_bwd_spec("float16", d, causal, order=order) in _configs.sm90_bwd_specs()
            with pytest.raises(ValueError, match="column-split"):
                _configs.sm90_bwd_spec("float16", d, True, order=_configs.DQ_ORDER_Q_DESC)
        for dt in _configs.DTYPES:
            names = {s.name for s in _configs.sm90_bwd_specs()}
            models = {s.name for s in _configs.model_specs((dt,), (d,), (True,), decode=False, arch=90)}
            grouped = _configs.sm90_bwd_spec(dt, d, True, group=_configs.SM90_BWD_CAUSAL_GROUP).name
            assert (grouped in names) == (grouped in models) == on
            for grp in (0, _configs.SM90_BWD_CAUSAL_GROUP) if on else (0,):  # the heads-inner walk (GQA, grouped)
                inner = _configs.sm90_bwd_spec(dt, d, True, order=_configs.DQ_ORDER_HEADS_INNER, group=grp).name
                assert inner in names and (inner in models) == on


def test_group_kernels_compile():
    """The grouped kernels (both dtypes, every sm90 backward head dim) compile for sm_90a with no spill, no local
    memory and no ptxas performance note, under both NVRTCs."""
    from conftest import compile_problems

    specs = [_configs.sm90_bwd_spec(dt, d, True, group=8) for dt in _configs.DTYPES
             for d in _configs.SM90_BWD_HEADDIMS]
    assert compile_problems(specs) == []


def test_order_probe_model(capsys):
    """bench/diag/bwd_order_probe.py --model (CPU): the grouped orders' predicted speed-up per causal point; a group
    of every pair is never predicted slower than the launch order, and bad --groups values are refused."""
    from bench.diag import bwd_order_probe as bp

    assert bp.main(["--model", "--groups", "1,8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 + sum(p[0] == "float16" for p in bp.points())
    assert all(abs(float(x.split("|")[1].split()[0]) - 1.0) < 1e-12 for x in lines[2:])  # group 1: the launch order
    for dt, d, s, b, h, hk in bp.points():
        assert bp.predicted(d, s, b, h, hk, b * hk) >= 1.0
    with pytest.raises(ValueError, match="groups"):
        bp.main(["--model", "--groups", "0"])


@pytest.mark.parametrize("cap", [None, 5])
def test_persistent_form_launches(res, cap):
    """Forced on, the persistent form runs the plain and causal calls of kernel head dims 64, 128 and 256 (the
    column-split kernel; causal in the launch's order, not the grouped one) and "seqpar" on its kernel over min(tiles,
    SMs, the cap) blocks of a 1-d grid; "ordered", the modifiers and head dim 96 keep one block per tile."""
    sms = 132  # the stand-in device's
    lim = sms if cap is None else cap
    for name, d, causal, tiles in (("d128", 128, False, 7 * 2 * 2), ("d128 causal", 128, True, 7 * 2 * 2),
                                   ("d48 seqpar", 64, False, 7 * 2 * 2), ("many tiles", 64, False, 63 * 8 * 4),
                                   ("d256", 256, False, 13 * 2 * 2)):
        spec = _configs.sm90_bwd_spec("float16", d, causal, _configs.sm90_bwd_persist_tile(d))
        assert res[f"persist {cap} {name}"][:2] == [spec.name, [min(tiles, lim), 1, 1]], name
        assert spec.name.endswith(", 0, 0, true>") and spec in _configs.sm90_bwd_specs()
    for name, d in (("ordered", 128), ("window", 128), ("d96", 96), ("d256 window", 256)):
        kernel, grid = res[f"persist {cap} {name}"][:2]
        persistent = re.search(r", \d+, \d+, \d+, true(, true)?>$", kernel)  # (not the CAP_ONLY form's tail)
        assert not persistent and grid == [-(-777 // _configs.sm90_bwd_tile(d).block_n), 2, 2], name


def test_persistent_form_layout_and_rule():
    """Its shared memory holds one more mbarrier (kv_empty); its producer takes 40 registers and the consumers 232
    (the launch allocation's 168 x 384 shared out); the configuration's rule takes it only where a key limit is set
    for (head dim, causal), for plain calls of fixed lengths, and with the score modifiers where one is set for the
    head dim, without the soft-cap (with it where a soft-capped limit is set: the persistent CAP_ONLY form); it has
    no visiting order ("ordered")."""
    assert set(_configs.SM90_BWD_PERSIST_CAP_MAX_SEQLEN_K) <= (set(_configs.SM90_BWD_PERSIST_MOD_HEADDIMS)
                                                               & set(_configs.SM90_BWD_CAP_ONLY_HEADDIMS))
    for d in _configs.SM90_BWD_PERSIST_HEADDIMS:
        t, p = _configs.sm90_bwd_tile(d), _configs.sm90_bwd_persist_tile(d)
        assert _configs.sm90_bwd_smem_bytes(d, p) == _configs.sm90_bwd_smem_bytes(d, t) + 8
        assert 128 * (p.regs_load + 2 * p.regs_mma) <= 65536 // (384 * 8) * 8 * 384
        for causal in (False, True):
            lim = _configs.SM90_BWD_PERSIST_MAX_SEQLEN_K.get((d, causal))
            mlim = _configs.SM90_BWD_PERSIST_MOD_MAX_SEQLEN_K.get(d)
            assert _configs.sm90_bwd_persistent(d, causal, _configs.MOD_SCORE, 0, 1024) == (mlim is not None
                                                                                             and 1024 <= mlim)
            clim = _configs.SM90_BWD_PERSIST_CAP_MAX_SEQLEN_K.get(d)
            assert _configs.sm90_bwd_persistent(d, causal, _configs.MOD_SCORE, 0, 1024, softcap=True) == (
                clim is not None and 1024 <= clim)
            if clim is not None:
                assert not _configs.sm90_bwd_persistent(d, causal, _configs.MOD_SCORE, 0, clim + 1, softcap=True)
            if mlim is not None:
                assert not _configs.sm90_bwd_persistent(d, causal, _configs.MOD_SCORE, 0, mlim + 1)
                assert not _configs.sm90_bwd_persistent(d, causal, _configs.MOD_SCORE, 1, mlim)
            assert not _configs.sm90_bwd_persistent(d, causal, 0, _configs.DQ_ORDER_KV_DESC, 1024)
            assert not _configs.sm90_bwd_persistent(d, causal, 0, 0, None)
            if lim is None:
                assert not _configs.sm90_bwd_persistent(d, causal, 0, 0, 1)
            else:
                assert _configs.sm90_bwd_persistent(d, causal, 0, 0, lim)
                assert not _configs.sm90_bwd_persistent(d, causal, 0, 0, lim + 1)
    assert _configs.sm90_bwd_persist_headdims(0) == _configs.SM90_BWD_PERSIST_HEADDIMS
    assert _configs.sm90_bwd_persist_headdims(_configs.MOD_SCORE) == _configs.SM90_BWD_PERSIST_MOD_HEADDIMS
    assert _configs.sm90_bwd_persist_headdims(_configs.MOD_SCORE | _configs.MOD_DROPOUT) == ()
    for kw in (dict(order=_configs.DQ_ORDER_KV_DESC), dict(group=_configs.SM90_BWD_CAUSAL_GROUP)):
        with pytest.raises(ValueError, match="persistent"):
            _configs.sm90_bwd_spec("float16", 128, True, _configs.sm90_bwd_persist_tile(128), **kw)


@pytest.mark.parametrize("n,hk,b", [(1, 1, 1), (7, 5, 3), (16, 16, 8), (17, 1, 3), (128, 2, 1)])
@pytest.mark.parametrize("grid", [1, 3, 132, 1000])
def test_persistent_walk(n, hk, b, grid):
    """The persistent form's walk (bench/diag/bwd_grid_model.persistent_tiles, the Python form of Sm90BwdTiles):
    over the blocks of a grid of min(grid, tiles), every tile exactly once; block bid's first tile is the launch's
    block bid, and its tiles alternate between waves taken forwards and backwards."""
    from bench.diag.bwd_grid_model import persistent_tiles

    count = n * hk * b
    g = min(grid, count)
    walks = [persistent_tiles(bid, g, n, hk, b) for bid in range(g)]
    assert sorted(t for w in walks for t in w) == sorted((j, h, z) for j in range(n) for h in range(hk)
                                                         for z in range(b))
    order = [(lin % n, lin // n % hk, lin // (n * hk)) for lin in range(count)]  # the launch's (KV tile fastest)
    for bid, w in enumerate(walks):
        assert w[0] == order[bid]
        assert all(t == order[k * g + (g - 1 - bid if k & 1 else bid)] for k, t in enumerate(w))
        assert len(w) in (count // g, -(-count // g))


def test_persistent_kernels_compile():
    """The persistent kernels (both dtypes, head dims 64, 128 and 256, plain and causal) compile for sm_90a with no
    spill, no local memory and no ptxas performance note under both NVRTCs (40 registers for the producer warpgroup,
    which walks the tiles: at 24 it spilled 72-140 B)."""
    from conftest import compile_problems

    specs = [_configs.sm90_bwd_spec(dt, d, c, _configs.sm90_bwd_persist_tile(d)) for dt in _configs.DTYPES
             for d in _configs.SM90_BWD_PERSIST_HEADDIMS for c in (False, True)]
    assert compile_problems(specs) == []


def test_persist_probe_model(capsys):
    """bench/diag/bwd_persist_probe.py --model (CPU): both makespans per point; without a mask the two are the same
    list schedule, and under the causal mask at 16k with head dim 128 the persistent form's static walk is predicted
    far from the ideal (which is why the configuration stops at 2048 keys there)."""
    from bench.diag import bwd_persist_probe as pp

    assert pp.main(["--model"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 + sum(p[0] == "float16" for p in pp.points())
    for dt, d, s, b, h, hk, c in pp.points():
        one, per = pp.model(d, s, b, h, hk, c)
        assert one >= 1.0 and per >= 1.0
        if not c:
            assert abs(one - per) < 1e-12
    assert pp.model(128, 16384, 1, 16, 16, True)[1] > 1.4
    for (d, c), lim in _configs.SM90_BWD_PERSIST_MAX_SEQLEN_K.items():
        assert d in _configs.SM90_BWD_PERSIST_HEADDIMS
        assert pp.model(d, lim, 16384 // lim, 2048 // d, 2048 // d, c)[1] < 1.05


@pytest.mark.parametrize("cap", [None, 5])
def test_stream_k_launches(res, cap):
    """Forced on, stream-K runs the plain calls of kernel head dims 64, 128 and 256 ("atomic" and "seqpar") whose tile
    count is above the grid's and no multiple of it, on the persistent grid, with the stream's workspace
    (cuflash._walk.bwd_sk_bytes for that grid) in the parameter block's sk_workspace; the causal mask, the modifiers,
    head dim 96, and tile counts that fill whole waves keep their configured kernels, with no workspace."""
    from cuflash import _walk
    from cuflash._bwd_sm90 import SK_WS_OFFSET

    sms = 132
    lim = sms if cap is None else cap
    for name, d, tiles in (("d128", 128, 7 * 2 * 2), ("d48 seqpar", 64, 7 * 2 * 2), ("many tiles", 64, 63 * 8 * 4),
                           ("d256", 256, 13 * 2 * 2)):
        kernel, grid, raw = res[f"sk {cap} {name}"]
        g = min(tiles, lim)
        on = tiles > g and tiles % g
        tile = _configs.sm90_bwd_stream_k_tile(d) if on else _configs.sm90_bwd_persist_tile(d)
        assert [kernel, grid] == [_configs.sm90_bwd_spec("float16", d, False, tile).name, [g, 1, 1]], name
        ws = struct.unpack_from("<Q", bytes.fromhex(raw), SK_WS_OFFSET)[0]
        assert ws == (0x7000_0000 + _walk.bwd_sk_bytes(g, d, tile.split) if on else 0), name
    assert res[f"sk {cap} d128"][0].endswith("true, true>") == (cap == 5)  # 28 tiles: on 5 blocks, not on 132
    assert res[f"sk {cap} d256"][0].endswith("true, true>") == (cap == 5)  # 52 tiles of 64 keys, likewise
    kernel, grid, raw = res[f"sk {cap} whole waves"]
    assert [kernel, grid] == [_configs.sm90_bwd_spec("float16", 64, False).name, [63, 8, 4]]  # (8000 keys: one
    # block per tile, as configured without stream-K)
    assert struct.unpack_from("<Q", bytes.fromhex(raw), SK_WS_OFFSET)[0] == 0
    for name in ("d128 causal", "window", "d96"):
        kernel, grid, raw = res[f"sk {cap} {name}"]
        assert not kernel.endswith("true, true>"), name
        assert struct.unpack_from("<Q", bytes.fromhex(raw), SK_WS_OFFSET)[0] == 0, name


@pytest.mark.parametrize("count,n_it,grid", [(2048, 32, 132), (4096, 1, 132), (272, 9, 132), (9, 22, 5), (4, 22, 3),
                                              (34, 32, 5), (2016, 1, 132), (2049, 3, 2), (7, 4, 5), (1000, 4096, 132)])
def test_stream_k_walk(count, n_it, grid):
    """The stream-K walk (the forward's stream_k_segment, the Python form of Sm90BwdStreamK::segment with a tile's
    iterations for its K / V tiles): every (tile, iteration) once over the blocks; the first C / G - 1 waves whole;
    every tile in one or two parts, a part [i, n_it) with i > 0 (a tail) only as a block's first segment past the
    whole waves and a part [0, i) with i < n_it (a head) only as its last, the head of a tile on block b and its tail
    on block b + 1 -- the flag block b waits for; the blocks' iterations differ by at most one tile's plus one."""
    if count <= grid or count % grid == 0:
        pytest.skip("not a stream-K launch")
    waves = count // grid - 1
    seen, parts, work = {}, {}, []
    for b in range(grid):
        segs = _configs.stream_k_segments(b, grid, count, n_it)
        assert [s[0] for s in segs[:waves]] == [k * grid + (grid - 1 - b if k % 2 else b) for k in range(waves)]
        assert all(s[1:] == (0, n_it) for s in segs[:waves])
        sk = segs[waves:]
        for i, (t, i0, i1) in enumerate(sk):
            assert 0 <= i0 < i1 <= n_it
            if i0 > 0:
                assert i == 0
            if i1 < n_it:
                assert i == len(sk) - 1
            parts.setdefault(t, []).append((b, i0, i1))
        for t, i0, i1 in segs:
            for it in range(i0, i1):
                assert (t, it) not in seen
                seen[(t, it)] = b
        work.append(sum(i1 - i0 for _, i0, i1 in sk))
    assert len(seen) == count * n_it
    for t, ps in parts.items():
        assert len(ps) <= 2
        if len(ps) == 2:
            (b0, h0, h1), (b1, t0, t1) = sorted(ps)
            assert b1 == b0 + 1 and h0 == 0 and h1 == t0 and t1 == n_it
    assert max(work) - min(work) <= 1


def test_stream_k_layout_and_rule():
    """The workspace: the forward's flag bytes (SM90_BWD_SK_DATA_OFFSET in the kernel), one int flag per block for up
    to SM90_BWD_SK_MAX_GRID blocks, then 2 x DP / 8 float4 per consumer thread and block; the rule takes head dims 64
    and 128 without a mask where the tile count leaves a part-empty last wave, and the configuration only within
    SM90_BWD_SK_SEQLEN_K; the spec refuses the forms it has no kernel for."""
    import re
    from dataclasses import replace
    from pathlib import Path

    from cuflash import _walk

    src = (Path(_configs.__file__).parent.parent / "cuda_src" / "flash_bwd_sm90.cu").read_text()
    assert int(re.search(r"constexpr int SM90_BWD_SK_DATA_OFFSET = (\d+);", src).group(1)) == _walk.SK_FLAG_BYTES
    assert 4 * _configs.SM90_BWD_SK_MAX_GRID <= _walk.SK_FLAG_BYTES
    assert _walk.bwd_sk_bytes(132, 128) == _walk.SK_FLAG_BYTES + 132 * 256 * 2 * 16 * 16
    assert _walk.bwd_sk_bytes(132, 64) == _walk.SK_FLAG_BYTES + 132 * 256 * 2 * 8 * 16
    assert _walk.bwd_sk_bytes(132, 256, True) == _walk.SK_FLAG_BYTES + 132 * 256 * 2 * 16 * 16  # (half the columns)
    el = lambda *a: _configs.sm90_bwd_stream_k_eligible(*a, 32)  # noqa: E731 (32 iterations per tile)
    assert el(128, False, 0, 2048, 2048, 132) and el(64, False, 0, 2048, 4096, 132)
    assert not el(128, True, 0, 2048, 2048, 132) and not el(128, False, _configs.MOD_SCORE, 2048, 2048, 132)
    assert not el(96, False, 0, 2048, 2048, 132) and el(256, False, 0, 2048, 2048, 132)
    assert not el(128, False, 0, None, 2048, 132) and not el(128, False, 0, 2048, 2112, 132)
    assert not el(128, False, 0, 2048, 100, 132) and not el(128, False, 0, 2048, 1 << 20, 1 + 4 * 256)
    # the segment arithmetic's 32 bits: (tiles past the whole waves) x iterations x grid < 2^32
    top = _configs.sm90_bwd_stream_k_max_iters(2048, 132)
    assert top == (2 ** 32 - 1) // (200 * 132) and (200 * top * 132) < 2 ** 32 <= 200 * (top + 1) * 132
    assert _configs.sm90_bwd_stream_k_eligible(128, False, 0, 2048, 2048, 132, top)
    assert not _configs.sm90_bwd_stream_k_eligible(128, False, 0, 2048, 2048, 132, top + 1)
    assert not _configs.sm90_bwd_stream_k_eligible(128, False, 0, 2048, 2048, 132, 0)
    for d in _configs.SM90_BWD_SK_HEADDIMS:
        rng = _configs.SM90_BWD_SK_SEQLEN_K.get(d)
        for n in (512, 1024, 2048, 4096, 8192, 16384):
            assert _configs.sm90_bwd_stream_k(d, False, 0, n, 2048, 132, 32) == (rng is not None and
                                                                               rng[0] <= n <= rng[1])
        assert not _configs.sm90_bwd_stream_k(d, False, 0, 2048, 2112, 132, 32)
        t = _configs.sm90_bwd_stream_k_tile(d)
        assert t.persistent and t.stream_k and _configs.sm90_bwd_smem_bytes(d, t) == _configs.sm90_bwd_smem_bytes(
            d, _configs.sm90_bwd_persist_tile(d))
        # the 128-key kernel on one block per tile's registers (its walk reads its counts at each use), the
        # column-split one on the persistent form's
        assert (t.regs_load, t.regs_mma) == ((40, 232) if t.split else (24, 240))
        plain = _configs.sm90_bwd_spec("bfloat16", d, False, _configs.sm90_bwd_persist_tile(d)).name
        assert _configs.sm90_bwd_spec("bfloat16", d, False, t).name == plain.replace(
            ", 232, 40, ", f", {t.regs_mma}, {t.regs_load}, ")[:-1] + ", true>"
        assert _configs.sm90_bwd_spec("bfloat16", d, False, t) in _configs.sm90_bwd_specs()
        with pytest.raises(ValueError, match="stream-K"):
            _configs.sm90_bwd_spec("float16", d, True, t)
        with pytest.raises(ValueError, match="stream-K"):
            _configs.sm90_bwd_spec("float16", d, False, t, mod=_configs.MOD_SCORE)
    with pytest.raises(ValueError, match="stream-K"):
        _configs.sm90_bwd_spec("float16", 128, False, replace(_configs.sm90_bwd_tile(128), stream_k=True))


def test_stream_k_kernels_compile():
    """The stream-K kernels (both dtypes, head dims 64, 128 and 256) compile for sm_90a with no spill, no local memory
    and no ptxas performance note under both NVRTCs (the 128-key kernel on 24 registers for the producer warpgroup
    and 240 for the consumers)."""
    from conftest import compile_problems

    specs = [_configs.sm90_bwd_spec(dt, d, False, _configs.sm90_bwd_stream_k_tile(d)) for dt in _configs.DTYPES
             for d in _configs.SM90_BWD_SK_HEADDIMS]
    assert compile_problems(specs) == []


def test_stream_k_model():
    """bench/diag/bwd_grid_model.stream_k_overhead (the probe's model column for stream-K): on the FA2 grid without a
    mask the fixed walk's part-empty last wave (1.031) shrinks to within 1.2% of the ideal from 1k, and a tile count
    that fills whole waves keeps the fixed walk's figure."""
    from bench.diag import bwd_persist_probe as pp
    from bench.diag.bwd_grid_model import persistent_overhead, stream_k_overhead

    for d, bm, h in ((128, 64, 16), (64, 128, 32)):
        for s in (1024, 2048, 4096, 8192, 16384):
            fixed, sk = persistent_overhead(s, h, 16384 // s, bm, False), stream_k_overhead(s, h, 16384 // s, bm)
            assert abs(fixed - 1.03125) < 1e-9 and 1.0 <= sk < 1.012 and sk == pp.sk_model(d, s, 16384 // s, h)
    assert stream_k_overhead(2048, 33, 4, 64) == persistent_overhead(2048, 33, 4, 64, False)  # 2112 tiles: 16 waves


def test_cap_only_form_launches(res):
    """The modifier kernels' CAP_ONLY form (Sm90BwdTile.cap_only): as configured (SM90_BWD_CAP_ONLY_HEADDIMS: every
    kernel head dim of 128-key tiles, 64, 96 and 128) the calls with score modifiers take it, causal ones included (the
    modifier kernel runs the causal mask as its band), the soft-capped ones at head dim 64 and up to
    SM90_BWD_PERSIST_CAP_MAX_SEQLEN_K keys in the persistent form; forced on, the same; forced off, none (and one
    block per tile); the calls without modifiers and the column-split kernel (head dim 256) keep theirs in all
    three."""
    assert _configs.SM90_BWD_CAP_ONLY_HEADDIMS == (64, 96, 128)
    for name, d in (("softcap d128", 128), ("softcap d64 causal", 64), ("window d96", 96)):
        mod_kernel = _configs.sm90_bwd_spec("float16", d, False, mod=_configs.MOD_SCORE).name
        # (777 keys: a soft-capped call at head dim 64 is configured persistent, SM90_BWD_PERSIST_CAP_MAX_SEQLEN_K)
        persist = "softcap" in name and 777 <= _configs.SM90_BWD_PERSIST_CAP_MAX_SEQLEN_K.get(d, 0)
        tile = _configs.sm90_bwd_persist_tile(d) if persist else _configs.sm90_bwd_tile(d)
        cap_kernel = _configs.sm90_bwd_spec("float16", d, False, replace(tile, cap_only=True), _configs.MOD_SCORE).name
        assert res[f"cap_only False {name}"] == mod_kernel, name
        assert res[f"cap_only True {name}"] == cap_kernel and cap_kernel.endswith(
            ", 1, 0, 0, true, false, true>" if persist else ", 1, 0, 0, false, false, true>")
        assert res[f"cap_only None {name}"] == cap_kernel, name
    assert _configs.SM90_BWD_PERSIST_CAP_MAX_SEQLEN_K.get(64, 0) >= 777
    for name in ("softcap d256", "plain d128"):
        assert res[f"cap_only True {name}"] == res[f"cap_only None {name}"] == res[f"cap_only False {name}"], name
        assert not res[f"cap_only True {name}"].endswith("false, false, true>"), name
    # the persistent form (forced) takes it with the soft-cap on (configured or forced), not without it
    ptile = _configs.sm90_bwd_persist_tile(64)
    pmod = _configs.sm90_bwd_spec("float16", 64, False, ptile, _configs.MOD_SCORE).name
    pcap = _configs.sm90_bwd_spec("float16", 64, False, replace(ptile, cap_only=True), _configs.MOD_SCORE).name
    assert pcap.endswith(", 1, 0, 0, true, false, true>") and pcap != pmod
    assert res["cap_only persist None softcap d64 causal"] == res["cap_only persist True softcap d64 causal"] == pcap
    assert res["cap_only persist False softcap d64 causal"] == pmod
    assert all(res[f"cap_only persist {k} window d64"] == pmod for k in (None, True, False))


def test_cap_only_specs():
    """The CAP_ONLY kernels: both dtypes at kernel head dims 64, 96 and 128, among the specs CI compiles; the form is
    the modifier kernel's alone (one block per tile or persistent at SM90_BWD_PERSIST_MOD_HEADDIMS, the launch's
    order, not stream-K nor the column-split kernel), refused by name elsewhere; the kernel's template parameter
    defaults to off, so every other kernel keeps its name."""
    import os

    specs = _configs.sm90_bwd_cap_only_variant_specs()
    npersist = len(_configs.SM90_BWD_PERSIST_MOD_HEADDIMS)
    assert len(specs) == 2 * (3 + npersist) and all(s in _configs.all_specs() for s in specs)
    assert {s.name.split(", ")[1] for s in specs} == {"64", "96", "128"}
    assert sum(s.name.endswith(", 1, 0, 0, true, false, true>") for s in specs) == 2 * npersist
    t = replace(_configs.sm90_bwd_tile(128), cap_only=True)
    for kw in (dict(mod=0), dict(mod=_configs.MOD_SCORE, group=4)):
        with pytest.raises(ValueError, match="CAP_ONLY"):
            _configs.sm90_bwd_spec("float16", 128, bool(kw.get("group")), t, **kw)
    with pytest.raises(ValueError, match="CAP_ONLY"):
        _configs.sm90_bwd_spec("float16", 64, False, replace(_configs.sm90_bwd_stream_k_tile(64), cap_only=True),
                               _configs.MOD_SCORE)
    with pytest.raises(ValueError, match="CAP_ONLY"):
        _configs.sm90_bwd_spec("float16", 256, False, replace(_configs.sm90_bwd_tile(256), cap_only=True),
                               _configs.MOD_SCORE)
    src = open(os.path.join(os.path.dirname(_configs.__file__), "..", "cuda_src", "flash_bwd_sm90.cu")).read()
    assert "bool PERSIST = false, bool SK = false,\n          bool CAP_ONLY = false>" in src


def test_cap_only_kernels_compile():
    """The CAP_ONLY kernels compile for sm_90a with no spill, no local memory and no ptxas performance note under both
    NVRTCs, on the modifier kernel's 24 / 240 registers."""
    from conftest import compile_problems

    assert compile_problems(_configs.sm90_bwd_cap_only_variant_specs()) == []


_MOD_PROBE_BODY = r'''
from bench.diag import bwd_mod_probe as bp
import bench.harness as hz
torch.randn = lambda *shape, device=None, dtype=None: torch.empty(shape, dtype=dtype, device=device)
torch.tensor = lambda data, device=None, dtype=None: torch.empty((len(data),), dtype=dtype, device=device)
def once(fns, rounds, rotate=False, **kw):  # (each variant's call once, its launches recorded; 1 ms each)
    out = {}
    for n, fn in fns.items():
        rec, _ = launches(fn)
        res[n] = [r[0] for r in rec]
        out[n] = (1.0 + 0.1 * len(out), [])
    return out
hz.time_rounds = once
bp.run(1, [4096], [64])
'''


def test_bwd_mod_probe_variants(capsys):
    """bench.diag.bwd_mod_probe (under the stand-ins: no GPU) launches what each variant names at head dim 64, 4k
    causal: the configured plain backward (the persistent form), the plain kernel one block per tile, and the modifier
    kernel (its configured CAP_ONLY form) for the window that hides nothing, the 4096-key window, ALiBi and the
    soft-cap, and the same four on the persistent modifier kernel (the soft-cap in its CAP_ONLY form) -- each with
    the preprocess and the dQ convert of
    its mode; and its report's costs, one block per tile -> persistent where both ran."""
    from bench.diag.bwd_mod_probe import NAMES, report

    res = run_with_stand_ins(_MOD_PROBE_BODY)
    pnames = [n + "_p" for n in NAMES[2:]]
    assert sorted(res) == sorted(NAMES + tuple(pnames))
    main = {n: [k for k in res[n] if "flash_bwd_sm90_kernel<" in k] for n in res}
    spec = lambda *a, **kw: _configs.sm90_bwd_spec("float16", 64, *a, **kw).name  # noqa: E731
    assert main["plain"] == [spec(True, _configs.sm90_bwd_persist_tile(64))]
    assert main["plain1"] == [spec(True)]
    mod = spec(False, replace(_configs.sm90_bwd_tile(64), cap_only=True), _configs.MOD_SCORE)
    assert all(main[n] == [mod] for n in ("wcausal", "w4096", "alibi", "softcap"))
    pmod = spec(False, _configs.sm90_bwd_persist_tile(64), mod=_configs.MOD_SCORE)
    pcap = spec(False, replace(_configs.sm90_bwd_persist_tile(64), cap_only=True), mod=_configs.MOD_SCORE)
    assert all(main[n] == [pcap if n == "softcap_p" else pmod] for n in pnames)
    assert all(len(res[n]) == 3 and "preprocess" in res[n][0] and "convert_dq" in res[n][2] for n in res)
    report([(64, 4096, 1.0, {n: 1.0 + 0.1 * i for i, n in enumerate(NAMES)})])
    out = capsys.readouterr().out
    assert "| 64 | 4096 | +10.0% | +20.0% | +30.0% | +40.0% | +50.0% |" in out
    report([(64, 4096, 1.0, {**{n: 1.0 + 0.1 * i for i, n in enumerate(NAMES)}, "alibi_p": 1.25})])
    assert "| 64 | 4096 | +10.0% | +20.0% | +30.0% | +40.0% -> +25.0% | +50.0% |" in capsys.readouterr().out


def test_m80_form_launches(res):
    """Forced on, the 80-row tiles run head-dim-128 calls without a mask ("atomic" and "seqpar", padded head dims) on
    their kernel, one block per tile -- with the persistent form forced as well, its persistent form on min(tiles, 132
    SMs) blocks --, with the workspace's rows per head a multiple of 80 rounded up to 128 and the T convert (a warp per
    16 rows x 32 columns of a Q tile); the Q and dO maps' boxes are 80 rows. The causal mask, a window, "ordered" and
    the other head dims keep their kernels."""
    for persist in (None, True):
        for name, (b, sq, sk, h, hk, d), splits in (("d128", (2, 300, 777, 8, 2, 128), 1),
                                                    ("d120 seqpar", (3, 161, 700, 4, 4, 120), -(-700 // 128)),
                                                    ("d128 one row", (1, 1, 5, 2, 1, 128), 1)):
            pre, main, conv = res[f"m80 {persist} {name}"]
            spec = _configs.sm90_bwd_spec("float16", 128, False, _configs.sm90_bwd_m80_tile(128, bool(persist)))
            tiles = -(-sk // 128) * hk * b
            assert main[:2] == [spec.name, [min(tiles, 132), 1, 1] if persist else [-(-sk // 128), hk, b]], name
            assert ", 128, 80, 2, false, 240, 24, " in spec.name and spec in _configs.sm90_bwd_specs()
            sq_pad = _configs.sm90_bwd_sq_pad(sq, 80)
            assert sq_pad % 128 == 0 and sq_pad >= -(-sq // 80) * 80 and sq_pad - 128 < -(-sq // 80) * 80
            rows = b * h * sq_pad
            f = _fields([None, main])
            assert (f["seqlen_q_pad"], f["num_dq_splits"]) == (sq_pad, splits), name
            assert pre[1] == [c_div(rows * _configs.bwd_pre_lanes_per_row(128), _configs.BWD_PRE_THREADS), 1, 1]
            assert conv[0] == _configs.bwd_convert_t_spec("float16", 128, 80).name
            assert conv[1] == [c_div(b * h * -(-sq // 80) * 5 * 4 * 32, _configs.BWD_CONVERT_THREADS), 1, 1]
            boxes = [_map_fields(m)[3] for m in _maps(main[2])]
            assert boxes == [[64, 80, 1, 1], [64, 128, 1, 1], [64, 128, 1, 1], [64, 80, 1, 1], [64, 128, 1, 1],
                             [64, 128, 1, 1]]  # q, k, v, dout, dk, dv
        for name in ("causal", "window", "ordered", "d64", "d96"):
            main = res[f"m80 {persist} {name}"][1][0]
            assert ", 80, 2, " not in main and "convert_dq_t" not in res[f"m80 {persist} {name}"][2][0], name


def test_m80_layout_and_rule():
    """The 80-row tile's shared memory, and its persistent form's, fit the 227 KB a block may have (setmaxnreg 240 / 24
    in both); the rule takes it only where SM90_BWD_M80_SEQLEN_K says, for head dim 128 without a mask, fixed lengths,
    "atomic" / "seqpar", and its persistent form where SM90_BWD_M80_PERSIST_SEQLEN_K says; sm90_bwd_sq_pad keeps whole
    Q tiles within a head's rows."""
    t = _configs.sm90_bwd_m80_tile(128)
    assert (t.block_m, t.block_n, t.persistent) == (80, 128, False)
    assert _configs.sm90_bwd_smem_bytes(128, t) == 231736 <= 227 * 1024
    tp = _configs.sm90_bwd_m80_tile(128, True)  # the persistent form: one more mbarrier (K, V free for the next tile)
    assert (tp.block_m, tp.persistent, tp.regs_mma, tp.regs_load) == (80, True, 240, 24)
    assert _configs.sm90_bwd_smem_bytes(128, tp) == 231744 <= 227 * 1024
    for sk in (None, 1, 1024, 2048, 4096, 16384):
        rng = _configs.SM90_BWD_M80_PERSIST_SEQLEN_K.get(128)
        assert _configs.sm90_bwd_m80_persistent(128, sk) == (rng is not None and sk is not None and
                                                             rng[0] <= sk <= rng[1])
    for kw in (dict(causal=True), dict(mod=_configs.MOD_SCORE), dict(strategy="ordered"), dict(seqlen_k=None),
               dict(headdim=64)):
        args = dict(headdim=128, causal=False, mod=0, strategy="atomic", seqlen_k=2048)
        args.update(kw)
        assert not _configs.sm90_bwd_m80_eligible(**args), kw
    assert _configs.sm90_bwd_m80_eligible(128, False, 0, "seqpar", 2048)
    for sk in (1, 2048, 16384):
        rng = _configs.SM90_BWD_M80_SEQLEN_K.get(128)
        assert _configs.sm90_bwd_m80(128, False, 0, "atomic", sk) == (rng is not None and rng[0] <= sk <= rng[1])
    for sq in (1, 79, 80, 81, 128, 300, 2048, 2080, 4096, 16384):
        pad = _configs.sm90_bwd_sq_pad(sq, 80)
        assert pad % _configs.BWD_ROW_PAD == 0 and -(-sq // 80) * 80 <= pad < -(-sq // 80) * 80 + 128
        assert _configs.sm90_bwd_sq_pad(sq, 64) == -(-sq // 128) * 128


def test_m80_t_layout():
    """The T accumulator layout (cuda_src/attn/bwd.cuh) as the 80-row kernel stages it and as its convert reads it
    (cuda_src/flash_bwd.cu, flash_bwd_convert_dq_t_kernel, with their formulas): the same element at every float of a
    Q tile, every float once; and the dS stores (stmatrix.trans) put dS[q][key] where a K-major 128-byte-swizzled
    operand of 80 rows in 64-key chunks has it (the layout TMA writes Q in, which the S^T product reads)."""
    from cuflash._loader import source_dir

    src = (source_dir() / "flash_bwd_sm90.cu").read_text()
    assert "dq_stage + ((4 * cw + warp) * MF + nf) * 128 + 4 * lane" in src
    assert "stmatrix_x4_trans(dsb + q * 128 + (((2 * warp + j % 2) ^ c) << 4), dsa[k])" in src
    assert "const int q = 16 * k + 8 * (j / 2) + c;" in src
    conv = (source_dir() / "flash_bwd.cu").read_text()
    conv = conv[conv.index("flash_bwd_convert_dq_t_kernel(const"):]
    conv = conv[:conv.index("\n}\n")]
    assert "((2 * bp + f / 2) * (BM / 8) + 2 * qg + f % 2) * 32" in conv
    assert "const int r = 8 * (f % 2) + 2 * t, c = 16 * (f / 2) + g;" in conv
    bm, d, mf = 80, 128, 10
    staged = {}
    for cw in range(2):
        for w in range(4):
            for lane in range(32):
                g, t = lane // 4, lane % 4
                for nf in range(mf):
                    for e in range(4):  # acc_dq[nf][e]: dQ^T row (head-dim column) and column (query row)
                        col, row = 64 * cw + 16 * w + g + 8 * (e // 2), 8 * nf + 2 * t + e % 2
                        at = ((4 * cw + w) * mf + nf) * 128 + 4 * lane + e
                        assert at not in staged
                        staged[at] = (row, col)
                        # the header's formula
                        assert at == ((col // 16) * (bm // 8) + row // 8) * 128 + 4 * (4 * (col % 8) + (row % 8) // 2) \
                            + 2 * ((col // 8) % 2) + row % 2
    assert sorted(staged) == list(range(bm * d))
    read = {}
    for qg in range(bm // 16):
        for bp in range(d // 32):
            for lane in range(32):
                g, t = lane // 4, lane % 4
                for f in range(4):
                    base = 4 * (((2 * bp + f // 2) * (bm // 8) + 2 * qg + f % 2) * 32 + lane)
                    r, c = 8 * (f % 2) + 2 * t, 16 * (f // 2) + g
                    for comp, (dr, dc) in enumerate(((0, 0), (1, 0), (0, 8), (1, 8))):  # x, y, z, w
                        read[base + comp] = (16 * qg + r + dr, 32 * bp + c + dc)
    assert read == staged
    # the convert's 2-byte stores: one instruction's 32 lanes on distinct banks, or two lanes on one word
    pad = 40
    for f in range(4):
        for dr, dc in ((0, 0), (1, 0), (0, 8), (1, 8)):
            words = {}
            for lane in range(32):
                g, t = lane // 4, lane % 4
                r, c = 8 * (f % 2) + 2 * t + dr, 16 * (f // 2) + g + dc
                words.setdefault(((r * pad + c) // 2) % 32, set()).add((r * pad + c) // 2)
            assert all(len(ws) == 1 for ws in words.values())
    # dS: dsa[k][j] holds keys 16 w + 8 (j % 2) + a, queries 16 k + 8 (j / 2) + b at lane (a, b / 2), half b % 2
    # (frag_to_a of the dP^T accumulator); stmatrix.trans stores row b of matrix j (its column b: rows a = 0..7) at
    # the address lane 8 j + b gives
    mem = {}
    for cw in range(2):
        for w in range(4):
            for k in range(bm // 16):
                for lane in range(32):
                    j, c = lane // 8, lane % 8
                    q = 16 * k + 8 * (j // 2) + c
                    addr = cw * bm * 128 + q * 128 + (((2 * w + j % 2) ^ c) << 4)
                    for a in range(8):
                        key = 64 * cw + 16 * w + 8 * (j % 2) + a
                        mem[addr + 2 * a] = (q, key)
    tma = {}
    for q in range(bm):
        for key in range(128):
            tma[(key // 64) * bm * 128 + q * 128 + (((key % 64) // 8) ^ (q % 8)) * 16 + (key % 8) * 2] = (q, key)
    assert mem == tma


def test_m80_kernels_compile():
    """The 80-row kernels and their convert (both dtypes) compile for sm_90a with no spill, no local memory and no ptxas
    performance note under both NVRTCs."""
    from conftest import compile_problems

    assert compile_problems(_configs.sm90_bwd_m80_specs()) == []


def test_dkdv_store_forms_in_the_sass():
    """The dK / dV epilogue each configured form compiles to (an offline sm_90a build of five kernels in one program):
    one block per tile above head dim 64 -- the 64-row, 80-row and column-split kernels -- stores both tiles by TMA,
    one UTMASTG per 64-column chunk of dK and of dV (and nothing else in the backward issues one); head dim 64 and the
    persistent form keep the 16-byte stores. None spills or uses local memory."""
    import re

    from bench.bench_micro import cubin_sass
    from cuflash._loader import compile_offline

    dt = "bfloat16"
    cases = {  # spec -> UTMASTG count
        _configs.sm90_bwd_spec(dt, 128, True, group=_configs.sm90_bwd_causal_group(128, 4096)): 4,
        _configs.sm90_bwd_spec(dt, 128, False, _configs.sm90_bwd_m80_tile(128)): 4,
        _configs.sm90_bwd_spec(dt, 256, True): 8,
        _configs.sm90_bwd_spec(dt, 64, False): 0,
        _configs.sm90_bwd_spec(dt, 128, True, _configs.sm90_bwd_persist_tile(128)): 0,
    }
    specs = list(cases)
    res = compile_offline(specs[0].filename, [s.name for s in specs], "90a")
    for s in specs:
        info = res["kernels"][s.name]
        assert info["stack"] == 0 and info["spill_st"] == 0 and info["spill_ld"] == 0, s.name
    sass, why = cubin_sass(res["cubin"])
    assert sass is not None, why  # (the test extra installs cuobjdump)
    bodies = re.split(r"\n\s*Function : ", sass)[1:]
    lowered = {res["kernels"][s.name]["lowered"]: s for s in specs}
    seen = set()
    for body in bodies:
        name = body.split("\n", 1)[0].strip()
        spec = lowered[name]
        ops = re.findall(r"\b([A-Z][A-Z0-9]+)[.\s]", body)
        assert ops.count("UTMASTG") == cases[spec], (spec.name, ops.count("UTMASTG"))
        if "split" not in spec.name:  # (the 128-key kernels hand dQ to bulk operations: their STGs are dK, dV's)
            assert ("STG" in ops) == (cases[spec] == 0), spec.name
        assert not {"LDL", "STL"} & set(ops), spec.name
        seen.add(spec.name)
    assert seen == {s.name for s in specs}
