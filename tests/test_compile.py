"""CPU: every kernel configuration the package can launch compiles with NVRTC for sm_80 and sm_90,
with no register spills and no local memory (ptxas -v report) -- with the installed NVRTC and, where
CUFLASH_NVRTC_ALT names the lib folder of a second one (`.ci/run`: NVRTC 13.0.88, the compiler of the H200
test machine's image), with that one too: register allocation differs between releases (13.0 spilled kernels
that 13.5 fitted). Each kernel is compiled in a program of its own, as the run-time loader does; the compiles
run in one parallel pass shared by all test files (tests/conftest.py)."""
import os
from pathlib import Path

import pytest

from cuflash import _compile_check, _configs, _loader

ALT_NVRTC = os.environ.get("CUFLASH_NVRTC_ALT")

# the compiles each test reads (tests/conftest.py: kernel_report)
KERNEL_TASKS = {
    "test_all_kernels_compile_without_spills": lambda arch: _compile_check.tasks(None, (arch,)),
    "test_all_kernels_compile_without_spills_alt_nvrtc":
        lambda arch: _compile_check.tasks(None, (arch,), ALT_NVRTC) if ALT_NVRTC else [],
}


def _check_no_spills(report, arch):
    names = {s.name for s in _configs.all_specs() if s.min_arch <= arch}
    assert names and set(report) >= names
    bad = {}
    for name in names:
        info = report[name]
        assert "error" not in info, f"{name}: {info['error']}"
        assert "regs" in info, f"no ptxas report for {name}"
        assert info["regs"] <= 255
        if info["stack"] or info["spill_st"] or info["spill_ld"]:
            bad[name] = {k: info[k] for k in ("regs", "stack", "spill_st", "spill_ld", "nvrtc")}
    assert not bad, "spills or local memory (each kernel compiled alone):\n" + "\n".join(
        f"  {n}: {b}" for n, b in sorted(bad.items()))


@pytest.mark.parametrize("arch", _compile_check.ARCHS)
def test_all_kernels_compile_without_spills(kernel_report, arch):
    assert {info["nvrtc"] for info in kernel_report.values()} == {_compile_check.nvrtc_version()}
    _check_no_spills(kernel_report, arch)


@pytest.mark.parametrize("arch", _compile_check.ARCHS)
def test_all_kernels_compile_without_spills_alt_nvrtc(alt_nvrtc, kernel_report, arch):
    """The same check under the second NVRTC; it must really be another release than the installed one."""
    errors = {name: info["error"] for name, info in kernel_report.items() if "error" in info}
    assert not errors, next(iter(errors.values()))
    versions = {info["nvrtc"] for info in kernel_report.values()}
    assert len(versions) == 1 and _compile_check.nvrtc_version() not in versions, versions
    _check_no_spills(kernel_report, arch)


def test_compile_pass_runs_each_task_once_and_reports_errors():
    """The parallel pass: a task submitted twice compiles once; a compile error is a result carrying NVRTC's
    log, not an exception that would take the other tasks down."""
    spec = _configs.softmax_spec("float16")
    p = _compile_check.CompilePass(jobs=2)
    good = _compile_check.tasks([spec], (80,))
    bad = [_compile_check.Task("no_such_file.cu", "k", 80)]
    res = p.result(good + good + bad)
    assert len(res) == 2 and len(p.results) == 2
    info = res[good[0]]
    assert info["regs"] > 0 and info["stack"] == 0 and info["nvrtc"] == _compile_check.nvrtc_version()
    assert info["lowered"] == _loader.compile_offline(spec.filename, [spec.name], 80)["kernels"][spec.name]["lowered"]
    assert "no_such_file.cu" in res[bad[0]]["error"]
    assert p.result(good) == {good[0]: info}  # answered from the pass, nothing compiled again
    assert _compile_check.bad_kernels(_compile_check.by_name(p.result(bad)))


def test_compile_worker_outside_the_callers_process_group():
    """A signal to the caller's process group (Ctrl-C, `timeout -s INT` around pytest) must not reach the compile
    workers: killed under a running task, they would turn it into a compile error. A caller in a process group of its
    own starts a worker, ignores SIGINT itself, sends SIGINT to its whole process group, then compiles a kernel
    through the worker: it must get ptxas' report, not a dead worker."""
    import subprocess
    import sys

    script = (
        "import os, signal\n"
        "from cuflash import _compile_check, _configs\n"
        "w = _compile_check._Worker(None)\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "os.killpg(os.getpgrp(), signal.SIGINT)\n"
        "res = w.run(_compile_check.tasks([_configs.softmax_spec('float16')], (80,))[0])\n"
        "w.close()\n"
        "print(res['info']['regs'])\n")
    out = subprocess.run([sys.executable, "-c", script], env=_compile_check._worker_env(None), capture_output=True,
                         text=True, timeout=600, start_new_session=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.split()[-1]) > 0


def test_pyproject_ships_every_kernel_source():
    """The wheel holds cuda_src/ as cuflash/cuda_src: every folder under it with .cu/.cuh files is a listed
    package (mapped through package-dir) and the package-data globs match every .cu/.cuh file."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    root = Path(__file__).resolve().parents[1]
    cfg = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    src = root / "cuda_src"
    assert (root / cfg["package-dir"]["cuflash.cuda_src"]).resolve() == src.resolve()
    files = {p.relative_to(src) for p in src.rglob("*") if p.suffix in (".cu", ".cuh") and p.is_file()}
    assert files
    folders = {f.parent for f in files}
    missing = {".".join(("cuflash", "cuda_src") + d.parts) for d in folders} - set(cfg["packages"])
    assert not missing, f"add to [tool.setuptools] packages in pyproject.toml: {sorted(missing)}"
    shipped = {p.relative_to(src) for pat in cfg["package-data"]["cuflash.cuda_src"] for p in src.glob(pat)}
    assert files <= shipped, sorted(map(str, files - shipped))


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
        if s.min_arch > arch or (s.arch_suffix and s.min_arch != arch):
            continue
        fn = _loader.get_function(s.filename, s.name, 0, s.arch_suffix)
        if fn.local_size_bytes:
            bad[s.name] = (fn.num_regs, fn.local_size_bytes)
    assert not bad, bad
