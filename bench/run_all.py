"""The one command for a GPU machine: GPU test suite + every benchmark, results under --out.

    PYTHONPATH=. python -m bench.run_all --out $OUT/run        # everything
    PYTHONPATH=. python -m bench.run_all --out DIR --sections fwd,latency --tests tests/test_flash_fwd.py

Writes DIR/tests.log (pytest -m gpu), DIR/results.json (header + one record per measurement),
DIR/results.md (tables, via bench/report.py) and DIR/*.png, and packs DIR into DIR.tar.gz.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import time
import traceback


def _sections():
    from . import bench_fwd

    secs = {
        "ceilings": lambda: __import__("bench.harness", fromlist=["x"]).measure_ceilings(),
        "latency": bench_fwd.small_latency,
        "fwd": bench_fwd.fa2_grid,
        "grid_order": bench_fwd.grid_order,
        "tile_sweep": bench_fwd.tile_sweep,
        "fwd_interleaved": bench_fwd.interleaved,
        "layout": bench_fwd.layout,
        "memory": bench_fwd.peak_memory,
        "fwd_quick": lambda: bench_fwd.fa2_grid(dtypes=("float16",), seqlens=(1024, 4096, 16384), naive=False),
        # the grid with cuflash, FLASH and cuDNN timed in turn, 3 rounds, medians (seqlen >= 1k: the target's points)
        "fwd_rounds": lambda: bench_fwd.fa2_grid(seqlens=(1024, 2048, 4096, 8192, 16384), naive=(), rounds=3,
                                                 providers=("flash", "cudnn")),
    }
    for mod, names in (("bench_bwd", ("bwd", "bwd_loop", "bwd_partition", "bwd_tile_sweep", "dq_memory")), ("bench_decode", ("decode", "decode_sweep", "decode_big_gqa")),
                       ("bench_micro", ("micro",)), ("bench_v1", ("v1_ladder",)),
                       ("bench_traffic", ("traffic",))):
        try:
            m = __import__(f"bench.{mod}", fromlist=["x"])
        except ModuleNotFoundError:
            continue
        except Exception:  # noqa: BLE001 - a broken optional section must not stop the run
            traceback.print_exc()
            continue
        for n in names:
            if hasattr(m, n):
                secs[n] = getattr(m, n)
    if "decode" in secs:  # the GQA / MQA cases the split heuristic decides (batch 1 and 8, 32k and 128k)
        secs["decode_quick"] = lambda: secs["decode"](batches=(1, 8), cache_lens=(32768, 131072), kv_heads=(8, 1))
    if "bwd" in secs:
        secs["bwd_quick"] = lambda: secs["bwd"](dtypes=("float16", "bfloat16"), seqlens=(1024, 4096, 16384))
        secs["bwd_tile_sweep_bf16"] = lambda: secs["bwd_tile_sweep"](dtype="bfloat16")
        # the configured tiles and their alternatives (bench_bwd._bwd_sweep_tiles) with dq_issue 2, 3 rounds
        secs["bwd_tile_rounds"] = lambda: secs["bwd_tile_sweep"](seqlens=(4096, 16384), rounds=3,
                                                                 keep=lambda t: t.dq_issue >= 2)
        secs["bwd_tile_rounds_bf16"] = lambda: secs["bwd_tile_sweep"](seqlens=(4096, 16384), rounds=3,
                                                                      dtype="bfloat16",
                                                                      keep=lambda t: t.dq_issue >= 2)
        # session 9: the candidates of one head dim at 2k, 4k, 16k, 3 rounds (bwd_tile_rounds_d64, ..._d128_bf16)
        for hd in (64, 128):
            for dt, suffix in (("float16", ""), ("bfloat16", "_bf16")):
                secs[f"bwd_tile_rounds_d{hd}" + suffix] = lambda dt=dt, hd=hd: secs["bwd_tile_sweep"](
                    seqlens=(2048, 4096, 16384), rounds=3, dtype=dt, headdims=(hd,))
        # the default strategy on the grid points of the backward's target (seqlen >= 2k) and 1k
        secs["bwd_grid"] = lambda: secs["bwd"](seqlens=(1024, 2048, 4096, 8192, 16384), strategies=("atomic",))
        # the same with cuflash, FLASH and cuDNN timed in turn, 3 rounds, medians
        secs["bwd_rounds"] = lambda: secs["bwd"](seqlens=(2048, 4096, 8192, 16384), strategies=("atomic",), rounds=3,
                                                 providers=("flash", "cudnn"))
    return secs


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--sections", default="all", help="comma list of benchmark sections, 'all' or 'none'")
    ap.add_argument("--tests", default="tests", help="pytest paths for the GPU suite ('none' to skip)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count())
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")

    t0 = time.time()
    subprocess.run([sys.executable, "-m", "cuflash.precompile", "-j", str(args.jobs), "--with-sweeps"], env=env,
                   cwd=root, check=False, stdout=open(os.path.join(args.out, "precompile.log"), "w"),
                   stderr=subprocess.STDOUT)
    print(f"precompile done in {time.time() - t0:.0f}s", flush=True)

    if args.tests != "none":
        t1 = time.time()
        with open(os.path.join(args.out, "tests.log"), "w") as log:
            rc = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rfEs", "-p", "no:cacheprovider",
                                 *args.tests.split(",")], env=env, cwd=root, stdout=log, stderr=subprocess.STDOUT).returncode
        tail = open(os.path.join(args.out, "tests.log")).read().strip().splitlines()[-25:]
        print("\n".join(tail))
        print(f"GPU tests rc={rc} in {time.time() - t1:.0f}s", flush=True)

    from . import harness, report

    head = harness.header()
    records = []
    secs = _sections()
    chosen = list(secs) if args.sections == "all" else [] if args.sections == "none" else args.sections.split(",")
    chosen = (["ceilings"] if "ceilings" not in chosen and chosen else []) + chosen
    for name in chosen:
        t1 = time.time()
        print(f"== {name}", flush=True)
        try:
            recs = secs[name]()
            for r in recs:
                r.setdefault("section", name)
            records += recs
        except Exception:  # noqa: BLE001 - one broken section must not lose the others
            traceback.print_exc()
            records.append(dict(section=name, provider="error", error=traceback.format_exc()[-2000:]))
        print(f"== {name} done in {time.time() - t1:.0f}s", flush=True)
        harness.save(os.path.join(args.out, "results.json"), head, records)
    report.write_all(head, records, args.out)
    with tarfile.open(args.out.rstrip("/") + ".tar.gz", "w:gz") as tar:
        tar.add(args.out, arcname=os.path.basename(args.out.rstrip("/")))
    print(f"total {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
