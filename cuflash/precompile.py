"""Fill CuPy's kernel disk cache for every configuration, in parallel processes (a GPU run then compiles
nothing twice): `python -m cuflash.precompile [-j JOBS]`.

`compile_specs(specs, jobs)` compiles any list of KernelSpecs the same way (the benchmarks pass their sweep
variants to it; the library itself never imports bench/).
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor


def _compile(spec):
    from . import _loader

    t = time.perf_counter()
    fn = _loader.get_function(spec.filename, spec.name, 0, spec.arch_suffix)
    return spec.name, fn.num_regs, fn.local_size_bytes, time.perf_counter() - t


def compile_specs(specs, jobs: int | None = None) -> int:
    """Compile `specs` (those device 0 supports: min_arch <= its compute capability) in `jobs` processes,
    printing each kernel's time, registers and local memory; returns how many were compiled."""
    from ._loader import device_cc

    arch = device_cc(0)
    specs = [s for s in specs if s.min_arch <= arch and (not s.arch_suffix or s.min_arch == arch)]
    jobs = jobs or os.cpu_count()
    t0 = time.perf_counter()
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as ex:
        for name, regs, local, dt in ex.map(_compile, specs):
            print(f"{dt:6.2f}s regs={regs:3d} local={local}  {name}")
    print(f"compiled {len(specs)} kernels in {time.perf_counter() - t0:.1f}s with {jobs} processes")
    return len(specs)


def main(argv=None, extra_specs=()):
    """The command line; `extra_specs` are compiled too (e.g. a benchmark's sweep variants)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count())
    args = ap.parse_args(argv)
    from ._configs import all_specs

    specs = all_specs()
    specs += [s for s in extra_specs if s not in specs]
    compile_specs(specs, args.jobs)


if __name__ == "__main__":
    main()
