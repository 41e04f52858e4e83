"""CPU: every kernel configuration the package can launch compiles with NVRTC for sm_80 and sm_90,
with no register spills and no local memory (ptxas -v report)."""
import pytest

from cuflash import _compile_check, _configs, _loader


@pytest.mark.parametrize("arch", _compile_check.ARCHS)
def test_all_kernels_compile_without_spills(arch):
    report = _compile_check.resource_report(arch)
    names = {s.name for s in _configs.all_specs()}
    assert set(report) >= names
    for name in names:
        info = report[name]
        assert "regs" in info, f"no ptxas report for {name}"
        assert info["stack"] == 0 and info["spill_st"] == 0 and info["spill_ld"] == 0, (name, info)
        assert info["regs"] <= 255


def test_cache_key_sees_every_source_file(tmp_path, monkeypatch):
    """The assembled source inlines local headers and carries a hash of the whole cuda_src/ tree."""
    src = _loader.assemble("flash_fwd.cu")
    assert '#include "' not in src  # every local include was inlined
    assert "mma.sync.aligned.m16n8k16" in src and f"0x{_loader.tree_hash()}" in src
    # a change to any file under cuda_src/ changes the tree hash (hence CuPy's cache key)
    import shutil

    copy = tmp_path / "cuda_src"
    shutil.copytree(_loader.source_dir(), copy)
    monkeypatch.setattr(_loader, "source_dir", lambda: copy)
    _loader.tree_hash.cache_clear()
    h0 = _loader.tree_hash()
    (copy / "common" / "ptx.cuh").write_text((copy / "common" / "ptx.cuh").read_text() + "\n// edit\n")
    _loader.tree_hash.cache_clear()
    assert _loader.tree_hash() != h0
    _loader.tree_hash.cache_clear()


def test_compile_error_carries_nvrtc_log(tmp_path, monkeypatch):
    bad = tmp_path / "cuda_src"
    bad.mkdir()
    (bad / "broken.cu").write_text("__global__ void k() { this_is_not_declared = 1; }\n")
    monkeypatch.setattr(_loader, "source_dir", lambda: bad)
    _loader.assemble.cache_clear()
    _loader.tree_hash.cache_clear()
    with pytest.raises(RuntimeError, match="this_is_not_declared"):
        _loader.compile_offline("broken.cu", [], 90)
    _loader.assemble.cache_clear()
    _loader.tree_hash.cache_clear()
