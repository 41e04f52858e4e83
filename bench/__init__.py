"""cuflash benchmarks. One entry point: `python -m bench` (`python -m bench --help`, `python -m bench list`).

    python -m bench all --out DIR [--suites fwd,bwd,...] [--tests PATHS]   # GPU tests + suites, one run
    python -m bench compare --base OLD_CHECKOUT --out DIR                   # two trees timed in turn
    python -m bench.report --results bench/results/results.json --readme README.md

Layout: harness.py (timing, the FLOP formula, records, result headers), suites.py (the suite registry),
bench_*.py (the suites), compare.py, report.py, merge.py, run.py (the one-command run), diag/ (tools run by
hand: Nsight Compute helpers, SASS dumps, timing checks, CPU emulations), results/ (the committed results),
NOTES.md (what was tried and measured, by topic). Nothing imports torch or CuPy at import time."""


def sweep_specs():
    """Kernel variants that benchmarks compile beyond the package's own configurations (for
    cuflash.precompile.main(argv, extra_specs=sweep_specs()))."""
    specs = []
    for mod in ("bench_fwd", "bench_bwd", "bench_decode", "bench_v1", "bench_micro"):
        try:
            m = __import__(f"bench.{mod}", fromlist=["sweep_specs"])
        except Exception:  # noqa: BLE001 - a broken optional module must not stop precompilation
            continue
        if hasattr(m, "sweep_specs"):
            specs += m.sweep_specs()
    return specs
