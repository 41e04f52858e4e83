"""python -m bench: the benchmarks' one entry point.

    python -m bench list                                  # the suites, what each measures, rough minutes
    python -m bench fwd --out DIR [--seqlens 1024,4096]   # one suite (or a comma list) -> DIR/results.json, .md
    python -m bench all --out DIR [--suites fwd,bwd,...] [--tests PATHS|@FILE|none] [--test-part K/N] [--time-limit M]
                                                          # precompile, GPU tests (DIR/gpu-tests.xml, tests.log),
                                                          # the suites, DIR/results.json, results.md, plots
    python -m bench compare --base OLD_CHECKOUT --out DIR [--suites fwd,bwd,decode,latency]
                                                          # the same public calls timed on two trees in turn
    python -m bench merge OUT_DIR SRC[:suites] ...        # several runs' results.json into one
    python -m bench report --results FILE [--readme README.md]   # tables, plots, README blocks
    python -m bench junit DIR/tests.jsonl DIR/gpu-tests.xml        # the JUnit XML of a GPU-test run that was stopped
    python -m bench junit --merge OUT.xml A.xml B.xml ... [--replace]  # several parts' XML as one (--replace: a
                                                          # later part's outcome of an id replaces an earlier one's)
    python -m bench test-times XML ... [--out FILE]                # per-file test times for --test-part / --test-jobs

Suite options (passed to the suites whose function takes them): --seqlens, --dtypes, --headdims, --rounds, and for
the decode grid (suite decode) --kv-heads, --batches, --cache-lens, so that its 42 cases can be run in parts, and
--calls (backward suites: calls per event pair, back to back; bwd90 --calls 5 times the backward as a training
loop calls it, without autograd's hand-off before each single call)."""
from __future__ import annotations

import argparse
import os
import sys
import time


def _ints(text):
    return tuple(int(x) for x in text.split(",") if x) if text else None


def _strs(text):
    return tuple(x for x in text.split(",") if x) if text else None


def parser():
    from .suites import DEFAULT_ALL

    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", help="'list', 'all', a suite name or a comma list of suites; also 'compare', "
                                    "'merge', 'report', 'junit' (each has its own --help)")
    ap.add_argument("--out", default="bench-out", help="output directory (default: ./bench-out)")
    ap.add_argument("--suites", default=None,
                    help=f"with 'all': comma list of suites, 'every' or 'none' (default: {','.join(DEFAULT_ALL)})")
    ap.add_argument("--tests", default="tests",
                    help="with 'all': pytest paths of the GPU tests (comma list; @FILE: the list in FILE), or 'none'")
    ap.add_argument("--test-jobs", type=int, default=1,
                    help="with 'all': pytest processes at once, one per visible GPU in turn, the test files sharded by "
                         "the times of bench/test_times.json (default 1; for machines of several GPUs: on one "
                         "GPU, processes at once slow every test down more than they gain)")
    ap.add_argument("--test-part", default=None, metavar="K/N",
                    help="with 'all': only part K of N of the test files, split by bench/test_times.json (N runs, one "
                         "part each, run every GPU test once: for a suite longer than one run's time)")
    ap.add_argument("--no-precompile", action="store_true", help="with 'all': skip the parallel precompile")
    ap.add_argument("--jobs", type=int, default=None, help="precompile processes (default: CPU count)")
    ap.add_argument("--seqlens", type=_ints, default=None, help="comma list, e.g. 1024,4096,16384")
    ap.add_argument("--dtypes", type=_strs, default=None, help="comma list: float16,bfloat16")
    ap.add_argument("--headdims", type=_ints, default=None, help="comma list: 64,128")
    ap.add_argument("--rounds", type=int, default=None, help="rounds timed in turn (suites that take it)")
    ap.add_argument("--kv-heads", type=_ints, default=None, help="decode grid: comma list of KV head counts, e.g. 8,1")
    ap.add_argument("--batches", type=_ints, default=None, help="decode grid: comma list of batch sizes")
    ap.add_argument("--cache-lens", type=_ints, default=None, help="decode grid: comma list of cache lengths")
    ap.add_argument("--calls", type=int, default=None,
                    help="backward suites: calls per event pair (back to back; bwd, bwd90: default 1, bwd_loop: 10)")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="minutes for the whole run (with 'all': precompile and tests included; the GPU tests are "
                         "stopped there, their XML written from what ran): a suite whose rough time (python -m bench "
                         "list) would end past them is skipped, the next ones may still fit")
    return ap


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "test-times":
        from .run import times_main

        return times_main(argv[1:])
    if argv and argv[0] in ("compare", "merge", "report", "junit"):
        mod = __import__(f"bench.{argv[0]}", fromlist=["main"])
        return mod.main(argv[1:])
    args = parser().parse_args(argv)
    from . import run, suites

    if args.command == "list":
        print(suites.listing())
        return 0
    options = dict(seqlens=args.seqlens, dtypes=args.dtypes, headdims=args.headdims, rounds=args.rounds,
                   kv_heads=args.kv_heads, batches=args.batches, cache_lens=args.cache_lens, calls=args.calls)
    if args.command == "all":
        run.run_all(args.out, suites.resolve_list(args.suites), args.tests, options, not args.no_precompile, args.jobs,
                    args.time_limit, test_jobs=args.test_jobs, test_part=args.test_part)
        return 0
    names = suites.resolve_list(args.command)
    os.makedirs(args.out, exist_ok=True)
    deadline = None if args.time_limit is None else time.time() + 60.0 * args.time_limit
    head, records = run.run_suites(names, args.out, options, deadline=deadline)
    run.write_report(head, records, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
