"""CPU: the Hopper backward's host path (cuflash/_bwd_sm90.py) through the public API with the GPU replaced by
bench/diag/host_overhead.py's stand-ins (a compute capability 9.0 device, launches recorded, nothing compiled):
which calls take it, the three launches it makes (preprocess, the sm90 main kernel, the dQ convert: one parameter
block, the four tensor maps after it), the grid and the seqpar buffers of its 128-key tiles, the memoized maps,
and the refusals of backend="sm90" that name why. Its kernels' compilation is CI's (all_specs)."""
import struct

import pytest

from cuflash import _configs
from cuflash._bwd_sm90 import ARGS_BYTES, MAPS_OFFSET
from cuflash._params import BWD_PARAMS
from conftest import run_with_stand_ins

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
res["forced d256"] = err(lambda: cuflash.flash_attn_backward(*tensors(1, 200, 200, 4, 4, 256), backend="sm90"))
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
    if d > _configs.SM80_ONLY_MAX_HEADDIM and kd in _configs.SM90_BWD_HEADDIMS:
        spec = _configs.sm90_bwd_spec(dt, kd, causal)
        assert rec[1][0] == spec.name
        assert rec[1][1] == [-(-777 // 128), 2, 2]  # (KV tiles of 128 keys, KV heads, batch)
        assert rec[2][0] == _configs.bwd_convert_spec(dt, kd, causal, 128).name
        # one parameter block for the three kernels; the main kernel's maps after it: q, k, v, dout, whose boxes are
        # 64 columns by the tile's rows, their dims the inputs' (head dim, seqlen, heads, batch)
        assert rec[0][2][:2 * BWD_PARAMS.size] == rec[1][2][:2 * BWD_PARAMS.size] == rec[2][2][:2 * BWD_PARAMS.size]
        bm = _configs.sm90_bwd_tile(kd).block_m
        shapes = [(d, 300, 8, 2), (d, 777, 2, 2), (d, 777, 2, 2), (d, 300, 8, 2)]
        for m, rows, dims in zip(_maps(rec[1][2]), (bm, 128, 128, bm), shapes):
            ptr, _, got_dims, box = _map_fields(m)
            assert ptr and tuple(got_dims) == dims and box == [64, rows, 1, 1]
    else:
        assert "bwd_sm90" not in rec[1][0] and "flash_bwd_kernel" in rec[1][0]


@pytest.mark.parametrize("name,why", [("dropout", "dropout"), ("loop", "dq_strategy='loop'"),
                                      ("kv", "warp_partition='kv'")])
def test_options_of_the_sm80_kernels(res, name, why):
    assert "flash_bwd_kernel" in res["opt " + name][1][0]
    kind, msg = res["forced " + name]
    assert kind == "ValueError" and "backend='sm90'" in msg and why in msg


def test_refusals_name_the_reason(res):
    assert res["forced d256"][0] == "ValueError" and "head dim 256" in res["forced d256"][1]
    assert res["forced d32"][0] == "ValueError" and "head dim 32" in res["forced d32"][1]
    assert res["bad backend"][0] == "ValueError" and "backend" in res["bad backend"][1]
    assert "flash_bwd_kernel" in res["expanded"][1][0]
    assert res["forced expanded"][0] == "ValueError" and "k's base address or strides" in res["forced expanded"][1]


def _fields(rec):
    return dict(zip(BWD_PARAMS.names, BWD_PARAMS.struct.unpack_from(bytes.fromhex(rec[1][2]), 0)))


def test_deterministic_strategies(res):
    """deterministic=True: "ordered" (3, one accumulator) without modifiers, seqpar (1) with 128-key buffers with a
    window or when asked for; "ordered" refused with a window or on the sm80 kernels."""
    for name, strategy, splits in (("deterministic", 3, 1), ("deterministic window", 1, -(-777 // 128)),
                                   ("seqpar", 1, -(-777 // 128))):
        rec = res[name]
        assert "bwd_sm90" in rec[1][0], name
        f = _fields(rec)
        assert (f["dq_strategy"], f["num_dq_splits"]) == (strategy, splits), name
    for name in ("ordered window", "ordered sm80"):
        kind, msg = res[name]
        assert kind == "ValueError" and "ordered" in msg, name


def test_memoized_maps(res):
    r1, r2, r3, p1, p2 = res["memo"]
    m1, m2, m3 = _maps(r1[1][2]), _maps(r2[1][2]), _maps(r3[1][2])
    assert m1 == m2 and [r[0] for r in r1] == [r[0] for r in r2]  # the same pointers: the same maps
    # map order q, k, v, dout; the tensors' order in the call: dout, q, k, v, out, lse
    assert [_map_fields(m)[0] for m in m1] == [p1[1], p1[2], p1[3], p1[0]]
    assert [_map_fields(m)[0] for m in m3] == [p2[1], p2[2], p2[3], p2[0]]
