"""cuflash benchmarks; `python -m bench.run_all --out DIR` runs everything on a GPU machine."""


def sweep_specs():
    """Kernel variants that benchmarks compile beyond the package's own configurations."""
    specs = []
    for mod in ("bench_fwd", "bench_bwd", "bench_decode", "bench_v1", "bench_micro"):
        try:
            m = __import__(f"bench.{mod}", fromlist=["sweep_specs"])
        except Exception:  # noqa: BLE001 - a broken optional module must not stop precompilation
            continue
        if hasattr(m, "sweep_specs"):
            specs += m.sweep_specs()
    return specs
