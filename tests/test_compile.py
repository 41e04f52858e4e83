"""CPU: every kernel configuration the package can launch compiles with NVRTC for sm_80 and sm_90,
with no register spills and no local memory (ptxas -v report) -- with the installed NVRTC and, where
CUFLASH_NVRTC_ALT names the lib folder of a second one (`.ci/run`: NVRTC 13.0.88, the H200 image's), with
that one too: register allocation differs between releases (13.0 spilled kernels that 13.5 fitted)."""
import os

import pytest

from cuflash import _compile_check, _configs, _loader

ALT_NVRTC = os.environ.get("CUFLASH_NVRTC_ALT")


def _check_no_spills(report, arch):
    names = {s.name for s in _configs.all_specs() if s.min_arch <= arch}
    assert set(report) >= names
    bad = {}
    for name in names:
        info = report[name]
        assert "regs" in info, f"no ptxas report for {name}"
        assert info["regs"] <= 255
        if info["stack"] or info["spill_st"] or info["spill_ld"]:
            bad[name] = info
    assert not bad, bad


@pytest.mark.parametrize("arch", _compile_check.ARCHS)
def test_all_kernels_compile_without_spills(arch):
    _check_no_spills(_compile_check.resource_report(arch), arch)


@pytest.fixture(scope="module")
def alt_report():
    if not ALT_NVRTC:
        pytest.skip("CUFLASH_NVRTC_ALT not set (.ci/run sets it to NVRTC 13.0's lib folder)")
    return _compile_check.report_with_nvrtc(ALT_NVRTC)


@pytest.mark.parametrize("arch", _compile_check.ARCHS)
def test_all_kernels_compile_without_spills_alt_nvrtc(alt_report, arch):
    """The same check under the second NVRTC; it must really be another release than the installed one."""
    assert alt_report["nvrtc"] != _compile_check.nvrtc_version()
    _check_no_spills(alt_report["reports"][arch], arch)


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


@pytest.mark.gpu
def test_runtime_compile_has_no_local_memory():
    """What the GPU runs: CuPy's run-time NVRTC compile of every configuration (the offline checks above use
    the same options, but the GPU machine's NVRTC may be another release)."""
    bad = {}
    arch = _loader.device_cc(0)
    for s in _configs.all_specs():
        if s.min_arch > arch:
            continue
        fn = _loader.get_function(s.filename, s.name, 0)
        if fn.local_size_bytes:
            bad[s.name] = (fn.num_regs, fn.local_size_bytes)
    assert not bad, bad
