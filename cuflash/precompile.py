"""Fill CuPy's kernel disk cache for every configuration, in parallel processes (one GPU machine call
then compiles nothing twice): `python -m cuflash.precompile [-j JOBS]`."""
from __future__ import annotations

import argparse
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor


def _compile(spec):
    from . import _loader

    t = time.perf_counter()
    fn = _loader.get_function(spec.filename, spec.name, 0)
    return spec.name, fn.num_regs, fn.local_size_bytes, time.perf_counter() - t


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count())
    ap.add_argument("--with-sweeps", action="store_true", help="also the tile variants bench/ sweeps")
    args = ap.parse_args(argv)
    from ._configs import all_specs

    specs = all_specs()
    if args.with_sweeps:
        try:
            from bench import sweep_specs
        except ImportError:
            sweep_specs = list
        specs += [s for s in sweep_specs() if s not in specs]
    from ._loader import device_cc

    arch = device_cc(0)
    specs = [s for s in specs if s.min_arch <= arch]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as ex:
        for name, regs, local, dt in ex.map(_compile, specs):
            print(f"{dt:6.2f}s regs={regs:3d} local={local}  {name}")
    print(f"compiled {len(specs)} kernels in {time.perf_counter() - t0:.1f}s with {args.jobs} processes")


if __name__ == "__main__":
    main()
