"""Compile every kernel configuration the package can launch, without a GPU, and read ptxas' report.

Used by CI (tests/test_compile.py) and by hand: `python -m cuflash._compile_check` prints a table of
registers / stack / spills per kernel for sm_80 and sm_90 (`--json`: the reports as JSON, by arch).

Register allocation differs between NVRTC releases: NVRTC 13.0 (the H200 image's, what the GPU runs) spilled
kernels that 13.5 fitted. `report_with_nvrtc(libdir)` runs this check in a child process against the
libnvrtc.so.13 in `libdir` (e.g. the lib folder of `pip install --target D nvidia-cuda-nvrtc==13.0.88`), so CI
checks both the newest NVRTC and the one on the GPU machine.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict

ARCHS = (80, 90)


def specs_by_file(specs=None, arch=None):
    """{filename: [name expressions]}; with `arch`, only the specs that compile for sm_<arch> (min_arch)."""
    if specs is None:
        from ._configs import all_specs

        specs = all_specs()
    by_file = defaultdict(list)
    for s in specs:
        if arch is not None and s.min_arch > arch:
            continue
        if s.name not in by_file[s.filename]:
            by_file[s.filename].append(s.name)
    return by_file


def resource_report(arch: int, specs=None) -> dict:
    """{name_expression: {"regs", "stack", "spill_st", "spill_ld", "lowered"[, "alone"]}} for one arch.

    One NVRTC program per source file (fast), then every kernel that spilled or used local memory there again in
    a program of its own, as the run-time loader compiles it (one name expression per program): ptxas can
    allocate the same kernel differently in the two (e.g. 255 registers and 16 B of stack in the file-wide
    program, 254 and none alone). The second report ("alone": True) is the one the GPU runs, so it counts."""
    from ._loader import compile_offline

    report = {}
    for filename, names in specs_by_file(specs, arch).items():
        kernels = compile_offline(filename, names, arch)["kernels"]
        for name in names:
            info = kernels.get(name, {})
            if info.get("stack", 1) or info.get("spill_st", 1) or info.get("spill_ld", 1):
                kernels[name] = dict(compile_offline(filename, [name], arch)["kernels"][name], alone=True)
        report.update(kernels)
    return report


def nvrtc_version() -> str:
    from cupy.cuda import nvrtc

    return "%d.%d" % nvrtc.getVersion()


def report_with_nvrtc(libdir: str) -> dict:
    """{"nvrtc": "13.0", "reports": {arch: resource_report(arch)}} from a child process that loads the
    libnvrtc.so.13 of `libdir` (LD_PRELOAD; its builtins library is found through LD_LIBRARY_PATH)."""
    lib = os.path.join(libdir, "libnvrtc.so.13")
    if not os.path.isfile(lib):
        raise FileNotFoundError(f"no libnvrtc.so.13 in {libdir}")
    env = dict(os.environ, LD_PRELOAD=lib,
               LD_LIBRARY_PATH=os.pathsep.join(x for x in (libdir, os.environ.get("LD_LIBRARY_PATH")) if x))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(x for x in (root, os.environ.get("PYTHONPATH")) if x)
    out = subprocess.run([sys.executable, "-m", "cuflash._compile_check", "--json"], env=env, check=True,
                         capture_output=True, text=True).stdout
    data = json.loads(out)
    data["reports"] = {int(a): r for a, r in data["reports"].items()}
    return data


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--json"]:
        json.dump({"nvrtc": nvrtc_version(), "reports": {a: resource_report(a) for a in ARCHS}}, sys.stdout)
        return 0
    print(f"NVRTC {nvrtc_version()}")
    bad = 0
    for arch in ARCHS:
        for name, info in resource_report(arch).items():
            flag = "" if info.get("stack", 1) == 0 and info.get("spill_st", 1) == 0 else "  <-- SPILL/LOCAL"
            bad += bool(flag)
            print(f"sm_{arch} regs={info.get('regs', '?'):>3} stack={info.get('stack', '?'):>4} "
                  f"spill={info.get('spill_st', '?')}/{info.get('spill_ld', '?')}  {name}{flag}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
