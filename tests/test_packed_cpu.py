"""CPU: flash_attn_qkvpacked_func / flash_attn_kvpacked_func make exactly the launches flash_attn_func makes on
the packed tensor's views (kernel, grid, parameter bytes: the view pointers and strides, tensor maps included),
and refuse bad packed shapes by name before anything is launched. The GPU is replaced by bench's host_overhead
stand-ins in a subprocess; GPU tests: tests/test_packed.py."""
import struct

import numpy as np
import pytest

import cuflash
from conftest import launch_params, run_with_stand_ins
from cuflash._launch import FWD_FORMAT, FWD_PARAMS

NAMES = [n for n, _ in FWD_PARAMS]

_BODY = r"""
for tag, d, causal, backend in (("d64", 64, True, "auto"), ("d128_sm80", 128, False, "sm80"), ("d32", 32, True, "auto")):
    qkv = T((2, 200, 3, 8, d), torch.float16)
    v3 = [qkv.select(2, i) for i in range(3)]
    res["qkv_" + tag] = [launches(lambda: cuflash.flash_attn_qkvpacked_func(qkv, causal=causal, backend=backend))[0],
                         launches(lambda: cuflash.flash_attn_func(*v3, causal=causal, backend=backend))[0],
                         [x.data_ptr() for x in v3], list(v3[0].stride())]
    q = T((2, 150, 8, d), torch.float16)
    kv = T((2, 300, 2, 2, d), torch.float16)
    v2 = [kv.select(2, i) for i in range(2)]
    res["kv_" + tag] = [launches(lambda: cuflash.flash_attn_kvpacked_func(q, kv, causal=causal, backend=backend))[0],
                        launches(lambda: cuflash.flash_attn_func(q, *v2, causal=causal, backend=backend))[0],
                        [q.data_ptr()] + [x.data_ptr() for x in v2], list(v2[0].stride())]
res["bad"] = {
    "qkv_rank": err(lambda: cuflash.flash_attn_qkvpacked_func(T((2, 200, 8, 64), torch.float16))),
    "qkv_three": err(lambda: cuflash.flash_attn_qkvpacked_func(T((2, 200, 2, 8, 64), torch.float16))),
    "kv_two": err(lambda: cuflash.flash_attn_kvpacked_func(T((2, 20, 8, 64), torch.float16),
                                                         T((2, 20, 3, 8, 64), torch.float16))),
}
res["bad_launches"] = len(ho.LAUNCHES)
"""


@pytest.fixture(scope="module")
def host():
    return run_with_stand_ins(_BODY)


@pytest.mark.parametrize("tag", ["qkv_d64", "qkv_d128_sm80", "qkv_d32", "kv_d64", "kv_d128_sm80", "kv_d32"])
def test_packed_launch_equals_the_views_launch(host, tag):
    packed, views, ptrs, stride = host[tag]
    assert len(packed) == len(views) == 1
    assert launch_params(packed[0]) == launch_params(views[0])
    p = dict(zip(NAMES, struct.unpack_from(FWD_FORMAT, bytes.fromhex(packed[0][2]), 0)))
    d = 64 if tag.endswith("d64") else 128 if "d128" in tag else 32
    if tag.startswith("qkv"):
        assert [p["q"], p["k"], p["v"]] == ptrs and ptrs[1] - ptrs[0] == 8 * d * 2  # one head group apart
        assert stride == [200 * 3 * 8 * d, 3 * 8 * d, d, 1] and p["q_row_stride"] == 3 * 8 * d
    else:
        assert [p["q"], p["k"], p["v"]] == ptrs and p["k_row_stride"] == 2 * 2 * d and p["heads_per_kv"] == 4
    assert ("sm90" in packed[0][0]) == (not tag.endswith(("sm80", "d32")))


@pytest.mark.parametrize("tag,words", [("qkv_rank", ["qkv", "[batch, seqlen, 3"]), ("qkv_three", ["qkv", "3"]),
                                       ("kv_two", ["kv", "[batch, seqlen, 2"])])
def test_bad_packed_shapes(host, tag, words):
    exc, msg = host["bad"][tag]
    assert exc == "ValueError" and all(w in msg for w in words), msg
    assert host["bad_launches"] == 0


def test_host_arrays_refused_by_name():
    x = np.zeros((1, 4, 3, 1, 64), np.float16)
    with pytest.raises(TypeError, match="qkv"):
        cuflash.flash_attn_qkvpacked_func(x)
    with pytest.raises(TypeError, match="kv"):
        cuflash.flash_attn_kvpacked_func(np.zeros((1, 4, 1, 64), np.float16), np.zeros((1, 4, 2, 1, 64), np.float16))
