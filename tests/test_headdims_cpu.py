"""CPU: the head-dim rule. Which compiled kernel runs a head dim (kernel_headdim), the errors for the others, the
forward-only head dims above 256 (head dim 512: two blocks of O columns; its shared memory; its kernels listed for
CI's compile pass in every mask mode; no backward, decode or Hopper kernels in a model's kernel list)."""
import pytest

from cuflash import _configs, _validate


def test_kernel_headdim():
    assert [_configs.kernel_headdim(d) for d in (8, 32, 40, 64, 72, 96, 104, 128, 136, 248, 256)] == [
        32, 32, 64, 64, 96, 96, 128, 128, 256, 256, 256]
    assert _configs.kernel_headdim(264) is None and _configs.kernel_headdim(59) is None
    assert _configs.kernel_headdim(40, _configs.SM90_HEADDIMS) == 64
    assert [_configs.kernel_headdim(d, _configs.FWD_HEADDIMS) for d in (256, 264, 384, 512)] == [256, 512, 512, 512]
    assert _configs.kernel_headdim(520, _configs.FWD_HEADDIMS) is None


def test_headdim_errors():
    with pytest.raises(ValueError, match="at most 512"):
        _validate.check_headdim(520)
    with pytest.raises(NotImplementedError, match="multiples of 8"):
        _validate.check_headdim(59)
    for d in (80, 264, 512):
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
