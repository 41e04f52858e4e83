"""CPU: the demo (`python -m cuflash`) says clearly that it needs a GPU and exits with status 2."""
import os
import subprocess
import sys

import pytest

from conftest import gpu_available


@pytest.mark.skipif(gpu_available(), reason="a GPU is present: the demo runs for real (bench.run_all covers it)")
def test_demo_without_gpu_says_it_needs_one():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "cuflash"], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "needs a CUDA GPU" in p.stdout
    if not _nvidia_driver():  # the CPU machines: no driver library at all
        assert "no NVIDIA driver / GPU found" in p.stdout, p.stdout
        assert "insufficient" not in p.stdout, p.stdout


def _nvidia_driver() -> bool:
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False
