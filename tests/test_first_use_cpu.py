"""CPU: what a first use shows and what it leaves behind -- the one log line of a process's first kernel
compile, the cubin disk cache under processes that compile the same kernel at once (torchrun ranks), and
`python -m cuflash.precompile`'s per-model selection of kernels."""
import hashlib
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cuflash import _configs, _loader, precompile

ROOT = Path(__file__).resolve().parent.parent


def test_first_compile_says_so_once(caplog, monkeypatch):
    monkeypatch.setattr(_loader, "_first_compile", [True])
    with caplog.at_level(logging.DEBUG, logger="cuflash"):
        _loader._note_compile("k1", 2.5)
        _loader._note_compile("k2", 3.0)
        _loader._note_compile("k3", 0.01)  # a load from the disk cache
    levels = [(r.levelno, r.getMessage().split(" ")[1]) for r in caplog.records]
    assert [lv for lv, _ in levels] == [logging.WARNING, logging.INFO, logging.DEBUG]
    assert "first use" in caplog.records[0].getMessage() and "k1" in caplog.records[0].getMessage()
    assert "precompile" in caplog.records[0].getMessage()


def _nvrtc():
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
    except Exception as e:  # noqa: BLE001 - no NVRTC: nothing to compile with
        pytest.skip(f"NVRTC not available: {e}")


_WORKER = r"""
import hashlib, sys, time
sys.path.insert(0, ROOT)
from cuflash import _loader
barrier = float(sys.argv[1])
while time.time() < barrier:  # start together
    time.sleep(0.001)
cubin, lowered = _loader.cached_cubin("flash_fwd_sm90.cu", NAME, "90a")
print(hashlib.sha256(cubin).hexdigest(), lowered)
"""


def test_cubin_cache_under_concurrent_compiles(tmp_path):
    """Four processes compile one sm_90a kernel into an empty cache at the same moment: each gets a cubin of
    the kernel, the cache holds exactly one whole entry, one of theirs (no temporary files left), and a fifth
    process reads it without compiling."""
    _nvrtc()
    import time

    spec = _configs.sm90_fwd_spec("float16", 64, True)
    code = _WORKER.replace("ROOT", repr(str(ROOT))).replace("NAME", repr(spec.name))
    env = dict(os.environ, CUFLASH_CACHE_DIR=str(tmp_path))
    start = str(time.time() + 2.0)
    procs = [subprocess.Popen([sys.executable, "-c", code, start], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-2000:] for _, e in outs]
    assert len({o.split()[1] for o, _ in outs}) == 1  # one kernel name (NVRTC's cubins differ in a build id)
    files = sorted(f.name for f in tmp_path.iterdir())
    assert len(files) == 2 and files[0].endswith(".cubin") and files[1].endswith(".name"), files
    digest = hashlib.sha256((tmp_path / files[0]).read_bytes()).hexdigest()
    assert digest in {o.split()[0] for o, _ in outs}  # one writer's whole file, not a mix
    # a later process: from the cache (compiling would fail: compile_offline is broken in it)
    later = code.replace("from cuflash import _loader\n", "from cuflash import _loader\n"
                         "_loader.compile_offline = lambda *a, **k: (_ for _ in ()).throw(AssertionError('compiled'))\n")
    p = subprocess.run([sys.executable, "-c", later, "0"], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split()[0] == digest


def test_model_specs_select_a_models_kernels():
    every = set(_configs.all_specs())
    m = _configs.model_specs(("bfloat16",), (128,), (True,), backward=False, decode=False, arch=90)
    assert m == [_configs.fwd_spec("bfloat16", 128, True, split=False), _configs.sm90_fwd_spec("bfloat16", 128, True)]
    full = _configs.model_specs(("float16",), (64,), (False, True), arch=90)
    assert set(full) <= every and all("__half" in s.name and "bfloat16" not in s.name for s in full)
    assert {s.filename for s in full} == {"flash_fwd.cu", "flash_fwd_sm90.cu", "flash_bwd.cu", "flash_bwd_sm90.cu",
                                          "flash_decode.cu"}
    assert _configs.sm90_bwd_spec("float16", 64, True) in full  # the Hopper backward of the model's head dim
    assert not [s for s in _configs.model_specs(arch=80) if s.arch_suffix or s.min_arch > 80]
    assert set(_configs.model_specs()) <= every
    packed = _configs.model_specs(("float16",), (64, 104), (True,), decode=False, arch=90, varlen=True)
    assert set(packed) <= every
    assert _configs.fwd_spec("float16", 128, True, split=False, varlen=True) in packed  # (104 runs on 128)
    for d in (64, 128):
        tile = _configs.bwd_tile(d, "2d", 90, "float16", 0, varlen=True)
        assert _configs.bwd_spec("float16", d, True, tile, "2d", varlen=True) in packed


def test_precompile_command_line_selects(monkeypatch):
    monkeypatch.setattr(_loader, "device_cc", lambda dev: 90)
    p = precompile.parser()
    assert precompile.select_specs(p.parse_args([])) == _configs.all_specs()
    sel = precompile.select_specs(p.parse_args(["--dtypes", "bfloat16", "--headdims", "128", "--causal", "yes",
                                                "--no-backward", "--no-decode"]))
    assert sel == _configs.model_specs(("bfloat16",), (128,), (True,), False, False, 90)
    with pytest.raises(SystemExit, match="--headdims"):
        precompile.select_specs(p.parse_args(["--headdims", "520"]))
    # a head dim that is not a multiple of 8: its UA kernels too
    odd = precompile.select_specs(p.parse_args(["--headdims", "59", "--no-decode"]))
    assert any(s.name.endswith(", true>") and "flash_fwd_kernel" in s.name for s in odd)
    assert any(s.name.endswith(", true>") and "flash_bwd_kernel" in s.name for s in odd)
    with pytest.raises(SystemExit, match="--dtypes"):
        precompile.select_specs(p.parse_args(["--dtypes", "float32"]))
