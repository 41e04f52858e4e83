"""Fill the kernel disk caches for every configuration, in parallel processes (a GPU run then compiles
nothing twice): `python -m cuflash.precompile [-j JOBS]`, or only what a model needs:
`python -m cuflash.precompile --dtypes bfloat16 --headdims 128 --causal yes --no-decode` (cuflash._configs.
model_specs: the default forward, backward and decode kernels of those shapes on this GPU).

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


def compile_specs(specs, jobs: int | None = None, progress: bool = False) -> int:
    """Compile `specs` (those device 0 supports: min_arch <= its compute capability) in `jobs` processes,
    printing each kernel's time, registers and local memory (progress=True: a one-line counter on stderr
    instead); returns how many were compiled."""
    import sys

    from ._loader import device_cc

    arch = device_cc(0)
    specs = [s for s in specs if s.min_arch <= arch and (not s.arch_suffix or s.min_arch == arch)]
    jobs = jobs or os.cpu_count()
    t0 = time.perf_counter()
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as ex:
        for i, (name, regs, local, dt) in enumerate(ex.map(_compile, specs), 1):
            if progress:
                sys.stderr.write(f"\r[{i}/{len(specs)}] {time.perf_counter() - t0:5.0f} s  {name[:60]:60s}")
                sys.stderr.flush()
            else:
                print(f"{dt:6.2f}s regs={regs:3d} local={local}  {name}")
    if progress:
        sys.stderr.write("\n")
    print(f"compiled {len(specs)} kernels in {time.perf_counter() - t0:.1f}s with {jobs} processes")
    return len(specs)


def _csv(kind):
    return lambda text: tuple(kind(x) for x in text.split(",") if x)


def select_specs(args) -> list:
    """The specs the command line asks for: every configuration, or model_specs() of the given shapes."""
    from . import _configs

    if not (args.dtypes or args.headdims or args.causal != "both" or args.no_backward or args.no_decode
            or args.scores or args.varlen):
        return _configs.all_specs()
    for d in args.headdims or ():
        if _configs.kernel_headdim(d, _configs.FWD_HEADDIMS) is None:
            raise SystemExit(f"--headdims: {d} is not a head dim cuflash runs (1 to "
                             f"{_configs.MAX_FWD_HEADDIM}; above "
                             f"{_configs.MAX_HEADDIM} the forward only)")
    for dt in args.dtypes or ():
        if dt not in _configs.DTYPES:
            raise SystemExit(f"--dtypes: {dt} is not one of {_configs.DTYPES}")
    causal = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    from ._loader import device_cc

    return _configs.model_specs(args.dtypes or _configs.DTYPES, args.headdims or _configs.HEADDIMS, causal,
                                not args.no_backward, not args.no_decode, device_cc(0), args.scores, args.varlen)


def parser():
    ap = argparse.ArgumentParser(prog="python -m cuflash.precompile")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count())
    ap.add_argument("--dtypes", type=_csv(str), default=None, help="comma list: float16,bfloat16")
    ap.add_argument("--headdims", type=_csv(int), default=None, help="comma list, e.g. 64,128")
    ap.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    ap.add_argument("--no-backward", action="store_true", help="forward only (inference)")
    ap.add_argument("--no-decode", action="store_true", help="no KV-cache decoding kernels")
    ap.add_argument("--scores", action="store_true",
                    help="also the kernels of the score modifiers (window_size, softcap, alibi_slopes)")
    ap.add_argument("--varlen", action="store_true",
                    help="also the packed-sequence kernels (flash_attn_varlen_func and its backward)")
    ap.add_argument("--progress", action="store_true", help="a one-line counter instead of a line per kernel")
    return ap


def for_device(specs, device: int = 0) -> list:
    """`specs` as the device launches them: on a GPU of less shared memory per block than some of them take (99 KB:
    sm_86 / sm_89 / sm_120), those are left out and the fitted kernels it takes instead are added
    (cuflash._configs.fitted_specs)."""
    from . import _configs
    from ._launch import smem_per_block
    from ._loader import device_cc

    arch, limit = device_cc(device), smem_per_block(device)
    specs = [s for s in specs if s.min_arch <= arch and (not s.arch_suffix or s.min_arch == arch)]
    if all(s.smem <= limit for s in specs):
        return specs
    return [s for s in specs if s.smem <= limit] + [s for s in _configs.fitted_specs(limit) if s not in specs]


def main(argv=None, extra_specs=()):
    """The command line; `extra_specs` are compiled too (e.g. a benchmark's sweep variants)."""
    args = parser().parse_args(argv)
    specs = for_device(select_specs(args))
    specs += [s for s in extra_specs if s not in specs]
    compile_specs(specs, args.jobs, args.progress)


if __name__ == "__main__":
    main()
