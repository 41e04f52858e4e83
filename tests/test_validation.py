"""Bad input -> TypeError / ValueError naming the argument, before anything is launched (CPU: views are
made by hand, so the real validation code runs without a GPU)."""
import numpy as np
import pytest

import cuflash
from cuflash._interop import CUPY, TORCH, Arr
from cuflash._validate import check_qkv_views, check_softmax_scale, check_unsupported


def view(shape, dtype="float16", kind=CUPY, device=0, strides=None, ptr=0x10000):
    if strides is None:
        strides, acc = [], 1
        for s in reversed(shape):
            strides.insert(0, acc)
            acc *= s
    return Arr(kind, None, ptr, tuple(shape), tuple(strides), dtype, device)


def qkv(**over):
    q = over.pop("q", view((2, 33, 8, 64)))
    k = over.pop("k", view((2, 40, 2, 64)))
    v = over.pop("v", view((2, 40, 2, 64)))
    return q, k, v


def test_valid_inputs_pass():
    check_qkv_views(*qkv())


@pytest.mark.parametrize("over", [
    dict(q=view((2, 33, 8, 84)), k=view((2, 40, 2, 84)), v=view((2, 40, 2, 84))),  # not a multiple of 8
    dict(q=view((2, 33, 8, 59)), k=view((2, 40, 2, 59)), v=view((2, 40, 2, 59))),
    dict(k=view((2, 40, 2, 64), strides=(40 * 2 * 68, 2 * 68, 68, 1))),  # strides that are not 16-byte units
    dict(v=view((2, 40, 2, 64), ptr=0x10002)),  # data that is not 16-byte aligned
])
def test_rows_that_are_not_16_byte_units_pass(over):
    """They run on the UA kernels (cuflash._configs.unaligned; tests/test_headdims_cpu.py checks the choice)."""
    check_qkv_views(*qkv(**over))


@pytest.mark.parametrize(
    "over, exc, words",
    [
        (dict(q=view((2, 33, 8, 64), dtype="float32")), TypeError, ["q", "float16 or bfloat16", "float32"]),
        (dict(k=view((2, 40, 2, 64), dtype="bfloat16")), TypeError, ["k", "dtype of q"]),
        (dict(v=view((2, 40, 2, 64), kind=TORCH)), TypeError, ["v", "torch", "cupy"]),
        (dict(k=view((2, 40, 2, 64), device=1)), ValueError, ["k", "cuda:1", "cuda:0"]),
        (dict(q=view((33, 8, 64))), ValueError, ["q", "4 dimensions"]),
        (dict(k=view((3, 40, 2, 64))), ValueError, ["k", "batch"]),
        (dict(v=view((2, 41, 2, 64))), ValueError, ["v", "shape of k"]),
        (dict(k=view((2, 40, 2, 128)), v=view((2, 40, 2, 128))), ValueError, ["k", "head dim"]),
        (dict(q=view((2, 33, 8, 520)), k=view((2, 40, 2, 520)), v=view((2, 40, 2, 520))), ValueError,
         ["head dim 520", "512"]),
        (dict(k=view((2, 40, 3, 64)), v=view((2, 40, 3, 64))), ValueError, ["heads", "multiple"]),
        (dict(q=view((2, 33, 8, 64), strides=(33 * 8 * 128, 8 * 128, 128, 2))), ValueError,
         ["q", "last dimension", "stride 1"]),
        (dict(q=view((2, 0, 8, 64))), ValueError, ["q", "seqlen"]),
        (dict(k=view((2, 40, 2, 64), strides=(40 * 2**30, 2**30, 64, 1)), v=view((2, 40, 2, 64),
                                                                            strides=(40 * 2**30, 2**30, 64, 1))),
         ValueError, ["k", "sequence stride", str(2**30)]),
    ],
)
def test_bad_inputs(over, exc, words):
    with pytest.raises(exc) as ei:
        check_qkv_views(*qkv(**over))
    for w in words:
        assert w in str(ei.value), (w, str(ei.value))


def test_host_arrays_rejected():
    x = np.zeros((1, 4, 1, 64), np.float16)
    with pytest.raises(TypeError, match="q must be a CUDA array"):
        cuflash.flash_attn_func(x, x, x)


def test_non_array_rejected():
    with pytest.raises(TypeError, match="q must be a CUDA array"):
        cuflash.flash_attn_func([1.0], [1.0], [1.0])


def test_dropout_refused_on_v1():
    with pytest.raises(NotImplementedError, match="dropout_p"):
        check_unsupported(dropout_p=0.1, scores=False)
    with pytest.raises(NotImplementedError, match="dropout_p"):
        cuflash.flash_attn_func(None, None, None, dropout_p=0.1, algorithm="v1")


@pytest.mark.parametrize("kw, word", [
    (dict(window_size=(4, 0)), "window_size"), (dict(softcap=30.0), "softcap"), (dict(alibi_slopes=[0.1]), "alibi_slopes"),
])
def test_score_modifiers_v2_only(kw, word):
    """The score modifiers run on the V2 kernels: algorithm="v1" refuses them by name; with "v2" the call goes on
    to the arrays (here: not CUDA arrays, a TypeError naming q)."""
    with pytest.raises(NotImplementedError, match=word):
        check_unsupported(**kw, scores=False)
    check_unsupported(**kw)
    with pytest.raises(NotImplementedError, match=word):
        cuflash.flash_attn_func(None, None, None, algorithm="v1", **kw)
    with pytest.raises(TypeError, match="q must be a CUDA array"):
        cuflash.flash_attn_func(None, None, None, **kw)


@pytest.mark.parametrize("kw,exc,word", [
    (dict(dropout_p=1.0), ValueError, "dropout_p"), (dict(dropout_p=-0.1), ValueError, "dropout_p"),
    (dict(dropout_p="0.1"), TypeError, "dropout_p"), (dict(window_size=(-2, 0)), ValueError, "window_size left"),
    (dict(window_size=(4, -5)), ValueError, "window_size right"), (dict(window_size=(1.5, 0)), TypeError, "left"),
    (dict(window_size=7), TypeError, "window_size"), (dict(window_size=(1, 2, 3)), TypeError, "window_size"),
    (dict(softcap=-1.0), ValueError, "softcap"), (dict(softcap=float("inf")), ValueError, "softcap"),
    (dict(softcap=None), TypeError, "softcap"),
])
def test_bad_option_values_refused_by_name(kw, exc, word):
    """A value no implementation could accept is a TypeError / ValueError, before anything else."""
    with pytest.raises(exc, match=word):
        check_unsupported(**kw)
    with pytest.raises(exc, match=word):
        cuflash.flash_attn_func(None, None, None, **kw)


def test_bad_keyword_extras():
    with pytest.raises(ValueError, match="grid_order"):
        cuflash.flash_attn_func(None, None, None, grid_order="zigzag")
    with pytest.raises(ValueError, match="algorithm"):
        cuflash.flash_attn_func(None, None, None, algorithm="v3")


def test_row_stride_just_below_the_limit_passes():
    st = (40 * (2**30 - 8), 2**30 - 8, 64, 1)
    check_qkv_views(*qkv(k=view((2, 40, 2, 64), strides=st), v=view((2, 40, 2, 64), strides=st)))


@pytest.mark.parametrize("scale, exc", [(0.0, ValueError), (-0.125, ValueError), (float("nan"), ValueError),
                                        (float("inf"), ValueError), ("0.1", TypeError), (True, TypeError)])
def test_softmax_scale_refused(scale, exc):
    with pytest.raises(exc, match="softmax_scale"):
        check_softmax_scale(scale)
    q = np.zeros((1, 4, 1, 64), np.float16)
    with pytest.raises(exc, match="softmax_scale"):  # refused at the API before any array is looked at
        cuflash.flash_attn_func(q, q, q, softmax_scale=scale)


@pytest.mark.parametrize("scale", [None, 0.125, 1, np.float32(0.5), np.float64(2.0)])
def test_softmax_scale_accepted(scale):
    check_softmax_scale(scale)


def test_auto_grid_order_resolution():
    from cuflash.flash import AUTO_BH_MIN_ROWS, resolve_grid_order

    assert resolve_grid_order("auto", True, AUTO_BH_MIN_ROWS) == "bh"
    assert resolve_grid_order("auto", True, AUTO_BH_MIN_ROWS - 1) == "qtile"
    assert resolve_grid_order("auto", False, 10 * AUTO_BH_MIN_ROWS) == "qtile"
    assert resolve_grid_order("qtile", True, 10 * AUTO_BH_MIN_ROWS) == "qtile"
    assert resolve_grid_order("bh", False, 1) == "bh"
    assert resolve_grid_order("auto", True, AUTO_BH_MIN_ROWS, 64) == "qtile"  # measured: d64 keeps qtile
    assert resolve_grid_order("auto", True, AUTO_BH_MIN_ROWS, 128) == "bh"
