"""CPU: the head-dim rule. Which compiled kernel runs a head dim (kernel_headdim), the errors for the others, the
forward-only head dims above 256 (head dim 512: two blocks of O columns; its shared memory; its kernels listed for
CI's compile pass in every mask mode; no backward, decode or Hopper kernels in a model's kernel list)."""
import pytest

from cuflash import _configs, _validate


def test_kernel_headdim():
    assert [_configs.kernel_headdim(d) for d in (8, 32, 40, 64, 72, 96, 104, 128, 136, 248, 256)] == [
        32, 32, 64, 64, 96, 96, 128, 128, 256, 256, 256]
    assert _configs.kernel_headdim(264) is None and _configs.kernel_headdim(0) is None
    assert [_configs.kernel_headdim(d) for d in (1, 3, 59, 83, 127, 255)] == [32, 32, 64, 96, 128, 256]
    assert _configs.kernel_headdim(40, _configs.SM90_HEADDIMS) == 64
    assert [_configs.kernel_headdim(d, _configs.FWD_HEADDIMS) for d in (256, 264, 384, 512)] == [256, 512, 512, 512]
    assert _configs.kernel_headdim(520, _configs.FWD_HEADDIMS) is None


def test_headdim_errors():
    for d in (520, 0):
        with pytest.raises(ValueError, match=f"head dim {d} of q"):
            _validate.check_headdim(d)
    for d in (1, 3, 59, 80, 111, 255, 264, 511, 512):
        _validate.check_headdim(d)
    with pytest.raises(NotImplementedError, match="head dim 264: the backward"):
        _validate.check_backward_headdim(264, "the backward")
    _validate.check_backward_headdim(256, "the backward")


def test_headdim_512_forward_kernels():
    """Two O column slices of 256 (the grid's split index), sm_80's whole shared memory, every mask mode listed."""
    tile = _configs.fwd_tile(512, False)
    assert tile.o_split == 2 and _configs.fwd_smem_bytes(512, tile) == _configs.SM80_MAX_SMEM
    names = {s.name for s in _configs.all_specs()}
    for dt in _configs.DTYPES:
        for causal, mod in (*_configs.MASK_MODES, (False, _configs.MOD_SCORE_DROPOUT)):
            spec = _configs.fwd_spec(dt, 512, causal, False, mod=mod)
            assert spec.name in names and spec.name.endswith(", 256>"), spec.name
    with pytest.raises(ValueError, match="split"):
        _configs.fwd_spec("float16", 512, False, True)
    specs = _configs.model_specs(headdims=(384,), arch=90)
    assert specs and all("flash_fwd_kernel<" in s.name and ", 512, " in s.name for s in specs)
    # head dims up to 32 have no Hopper kernel in a model's list (the sm80 kernels' own 32 runs them)
    assert not any("sm90" in s.name for s in _configs.model_specs(headdims=(24,), arch=90))


# ------------------------------------------------------------ rows that are not 16-byte units (the UA kernels)
def _view(shape, strides, ptr=0x10000):
    from cuflash._interop import Arr

    return Arr("torch", None, ptr, shape, strides, "float16", 0)


def test_unaligned_rule_and_layout():
    """unaligned: the head dim, a base address or a stride of a dimension longer than 1 (not the last); check_layout
    takes such views and still refuses negative strides and a last dim that is not contiguous."""
    ok = _view((2, 64, 4, 64), (64 * 256, 256, 64, 1))
    assert not _configs.unaligned(64, ok, None)
    assert _configs.unaligned(59, ok)
    assert _configs.unaligned(64, _view((2, 64, 4, 64), (64 * 257, 257, 64, 1)))  # odd row stride
    assert _configs.unaligned(64, _view((2, 64, 4, 64), (64 * 256, 256, 64, 1), ptr=0x10002))  # 2-byte aligned data
    assert not _configs.unaligned(64, _view((1, 64, 1, 64), (3, 256, 5, 1)))  # strides of size-1 dims do not count
    for a in (_view((2, 64, 4, 59), (64 * 236, 236, 59, 1)), _view((2, 64, 4, 64), (64 * 256, 257, 64, 1), 0x10002)):
        _validate.check_layout(a, "q")
    with pytest.raises(ValueError, match="negative stride"):
        _validate.check_layout(_view((2, 64, 4, 59), (64 * 236, -236, 59, 1)), "q")
    with pytest.raises(ValueError, match="last dimension"):
        _validate.check_layout(_view((2, 64, 4, 59), (64 * 236 * 2, 236 * 2, 59 * 2, 2)), "q")
    with pytest.raises(ValueError, match="16-byte aligned"):
        _validate.check_layout(_view((2, 64, 4, 59), (64 * 236, 236, 59, 1)), "q", aligned=True)
    with pytest.raises(NotImplementedError, match="head dim 59: algorithm='v1'"):
        _validate.check_aligned(59, (), "algorithm='v1'")


def test_ua_specs_listed():
    """The UA kernels: the score modifiers' modes only (plain and causal calls as bands), the V2 forward of every
    head dim (plain and packed), the default backward of every backward head dim, the append; all in all_specs."""
    ua = _configs.ua_specs()
    names = {s.name for s in _configs.all_specs()}
    assert ua and all(s.name in names for s in ua)
    assert all(s.name.endswith(", true>") for s in ua)
    for dt in _configs.DTYPES:
        for d in _configs.FWD_HEADDIMS:
            for m in _configs.UA_MODS:
                spec = _configs.fwd_spec(dt, d, False, False, _configs.ua_fwd_tile(d, m), mod=m, ua=True)
                assert spec in ua
                if d in _configs.HEADDIMS:
                    part, tile = _configs.ua_bwd_tile(d, dt, m)
                    assert not tile.dq_bulk and _configs.bwd_spec(dt, d, False, tile, part, mod=m, ua=True) in ua
    for bad in (dict(causal=True, mod=0), dict(causal=False, mod=0)):
        with pytest.raises(ValueError, match="UA forward"):
            _configs.fwd_spec("float16", 64, bad["causal"], False, mod=bad["mod"], ua=True)
    # the aligned kernels keep their names (no UA argument)
    assert not _configs.fwd_spec("float16", 64, True, False).name.endswith(", true>")


def test_host_picks_ua_kernel():
    """_launch_setup (the V2 forward's launch) picks the UA kernel, as a band, for an odd head dim or an odd stride,
    and the aligned plain / causal kernel otherwise; the Hopper paths refuse such views."""
    from cuflash import _fwd, _fwd_sm90

    def names(d, row_stride, causal):
        q = _view((2, 100, 4, d), (100 * row_stride * 4, row_stride * 4, row_stride, 1))
        k = _view((2, 120, 4, d), (120 * row_stride * 4, row_stride * 4, row_stride, 1))
        captured = {}
        real = _fwd.get_launcher
        _fwd.get_launcher = lambda spec, dev: captured.setdefault("spec", spec)
        try:
            _fwd._launch_setup(q, k, k, None, causal, "qtile", (100 * 4 * d, 4 * d, d))
        except Exception:
            pass
        finally:
            _fwd.get_launcher = real
        return captured["spec"].name, _fwd_sm90.ineligible(q, k, k)

    n, why = names(59, 59, True)
    assert n.startswith("cuflash::flash_fwd_kernel<__half, 64,") and n.endswith(", false, true>") and why
    n, why = names(64, 72, False)  # aligned rows, odd stride? 72 is a multiple of 8: aligned
    assert not n.endswith(", true>")
    n, why = names(64, 67, False)
    assert n.endswith(", true>") and "16-byte" in why
