"""On the GPU machine: what the run-time compile (CuPy RawModule + NVRTC) makes of a few kernels, with the
loader's options and with -ftz=true (the offline check's), and the forward's speed under each.

    PYTHONPATH=. python -m bench.compile_check_device            # registers / local memory per option set
    PYTHONPATH=. python -m bench.compile_check_device --time OPTS  # (internal) one timing run
"""
from __future__ import annotations

import subprocess
import sys

OPTION_SETS = {"loader": ("-std=c++17",), "ftz": ("-std=c++17", "-ftz=true")}


def _specs():
    from cuflash import _configs as c

    return [c.fwd_spec("float16", 128, False, False), c.fwd_spec("float16", 128, True, False),
            c.bwd_spec("float16", 128, False, c.BWD_TILES[128], "kv")]


def resources():
    import cupy
    from cupy.cuda import nvrtc

    from cuflash import _loader

    print("nvrtc", nvrtc.getVersion(), "cupy", cupy.__version__, flush=True)
    for key, opts in OPTION_SETS.items():
        for spec in _specs():
            mod = cupy.RawModule(code=_loader.assemble(spec.filename), options=opts, name_expressions=(spec.name,))
            f = mod.get_function(spec.name)
            print(f"{key:7s} regs={f.num_regs:3d} local={f.local_size_bytes:3d}  {spec.name}", flush=True)


def timing(key):
    import torch

    from cuflash import _loader

    _loader.NVRTC_OPTIONS = OPTION_SETS[key]
    import cuflash

    from .harness import sdpa, time_ms

    d, s, h, b = 128, 16384, 16, 1
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.float16) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    for causal in (False, True):
        ms = time_ms(lambda: cuflash.flash_attn_func(q, k, v, causal=causal), rep=10)
        fl = time_ms(lambda: sdpa("flash")(qt, kt, vt, causal), rep=10)
        fl_ = 4 * b * h * s * s * d / (2 if causal else 1) / 1e9
        print(f"{key:7s} fwd d128 16k causal={causal}: cuflash {fl_ / ms:.0f} TFLOP/s, FLASH {fl_ / fl:.0f} "
              f"({fl / ms:.2f}x)", flush=True)


def main(argv):
    if argv[:1] == ["--time"]:
        return timing(argv[1])
    resources()
    for key in OPTION_SETS:
        subprocess.run([sys.executable, "-m", "bench.compile_check_device", "--time", key], check=False)


if __name__ == "__main__":
    main(sys.argv[1:])
