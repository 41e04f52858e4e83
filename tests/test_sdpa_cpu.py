"""CPU: cuflash.scaled_dot_product_attention launches exactly what flash_attn_func launches on the [b, s, h, d]
views of torch-layout [b, h, s, d] inputs (no copy: the views' pointers and strides reach the kernel), returns
a [b, h, s, d] view, and refuses what it does not do before anything is launched. The GPU is replaced by bench's
host_overhead stand-ins in a subprocess; GPU tests: tests/test_sdpa.py."""
import struct

import pytest

from conftest import launch_params, run_with_stand_ins
from cuflash._launch import FWD_FORMAT, FWD_PARAMS

NAMES = [n for n, _ in FWD_PARAMS]

_BODY = r"""
q = T((2, 8, 300, 128), torch.bfloat16)
k = T((2, 2, 300, 128), torch.bfloat16)
v = T((2, 2, 300, 128), torch.bfloat16)
a, out = launches(lambda: cuflash.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
b, ref = launches(lambda: cuflash.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True))
res["same"] = [a, b, list(out.shape), list(out.stride()), q.data_ptr(), k.data_ptr()]
res["bad"] = {
    "gqa": err(lambda: cuflash.scaled_dot_product_attention(q, k, v)),
    "mask": err(lambda: cuflash.scaled_dot_product_attention(q, q, q, attn_mask=q)),
    "causal_lengths": err(lambda: cuflash.scaled_dot_product_attention(T((2, 8, 1, 128), torch.bfloat16), q, q,
                                                                      is_causal=True)),
    "rank": err(lambda: cuflash.scaled_dot_product_attention(T((8, 300, 128), torch.bfloat16), q, q)),
}
res["bad_launches"] = len(ho.LAUNCHES)
"""


@pytest.fixture(scope="module")
def host():
    return run_with_stand_ins(_BODY)


def test_sdpa_layout_launch_equals_flash_attn_func(host):
    a, b, shape, stride, qp, kp = host["same"]
    assert len(a) == len(b) == 1
    assert launch_params(a[0]) == launch_params(b[0])  # the whole parameter buffer: the tensor maps too
    p = dict(zip(NAMES, struct.unpack_from(FWD_FORMAT, launch_params(a[0])[2], 0)))
    assert (p["q"], p["k"]) == (qp, kp)  # the caller's memory, read in place
    assert (p["q_row_stride"], p["q_head_stride"], p["k_head_stride"]) == (128, 300 * 128, 300 * 128)
    assert shape == [2, 8, 300, 128] and stride == [300 * 8 * 128, 128, 8 * 128, 1]  # a view of [b, s, h, d]


@pytest.mark.parametrize("tag,exc,word", [("gqa", "ValueError", "enable_gqa"), ("mask", "NotImplementedError",
                                                                                 "attn_mask"),
                                          ("causal_lengths", "NotImplementedError", "top-left"),
                                          ("rank", "ValueError", "query")])
def test_refused_before_launch(host, tag, exc, word):
    got, msg = host["bad"][tag]
    assert got == exc and word in msg, (got, msg)
    assert host["bad_launches"] == 0
