"""Measured device-memory traffic of the V1 -> V2 ladder (suite traffic): Nsight Compute's `dram__bytes` next to
the bytes bench_v1 counts (`bench_v1.DRAM_BYTES`) and the kernel time.

Two halves:

* worker (`python -m bench.bench_traffic --worker CASE_JSON`, meant to run under ncu): one grid point of
  the ladder (fp16, batch x seqlen = 16k tokens, hidden 2048). For every version of the case it builds the
  rung's call exactly as bench_v1 times it, runs it once as warm-up (kernel load, the backward's own
  forward), then launches an empty marker kernel `cuflash_traffic_begin__<tag>`, the measured call, and the
  marker `cuflash_traffic_end` (device synchronised in between). ncu profiles every kernel of the process;
  the parser keeps only the kernels between a begin marker and the next end marker, so warm-up, input
  generation and the markers themselves are excluded by construction and do not depend on NVTX injection
  (an NVTX range with the tag is pushed around the measured call too, for people opening a report in the
  GUI). The worker writes nothing to stdout (ncu's CSV goes there); it reports one status line per version
  on stderr (`CUFLASH_TRAFFIC_STATUS {json}`).
* driver `traffic()` (suite "traffic" of `python -m bench`): one ncu process per grid point,

      ncu --clock-control none --cache-control all --replay-mode kernel --target-processes all --csv
          --print-units base --print-metric-name name
          --metrics dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum
          python -m bench.bench_traffic --worker '{"dtype":...,"versions":[...]}'

  parses the CSV (header-keyed, either ncu's "details" page, one row per kernel and metric, or the "raw"
  page, one row per kernel; units normalised to bytes / nanoseconds; thousands separators stripped),
  sums the bytes and times per version and returns one record per (grid point, version) with the counted
  bytes and measured / counted. A missing ncu, a failed or timed-out run, or a version the worker could not
  run becomes a record with `error` set, never an exception.

Profiler settings: `--clock-control none` keeps the clocks the GPU runs at (the profiler must not lock or
change the machine's clock settings). `--cache-control all` (ncu's default, kept on purpose) flushes and
invalidates the caches before every kernel (and every replay pass): each kernel starts with a cold L2, as
the analytic count assumes for the first touch of every tensor, and what a version moves does not depend on
what the warm-up or the previous kernel left in L2. Re-reads that L2 catches within a kernel are not device
traffic and are not counted by ncu (the analytic count assumes L2 never helps, so measured <= counted is the
expected direction for the K/V and O_i re-reads). Two things the measurement can miss (to be checked against
the counted bytes on the GPU): dirty lines still in L2 when a kernel ends may be written back after its
measurement window (write bytes short by up to the L2 size, ~50 MB), and a memset or copy is not a kernel, so
ncu does not profile it (V1's backward zeroes its fp32 dQ accumulator with torch.zeros: a fill kernel is
counted, a cudaMemset would not be).
"""
from __future__ import annotations

import csv
import glob
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

from . import bench_v1
from .harness import record

METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum", "gpu__time_duration.sum")
READ, WRITE, DURATION = METRICS
DTYPE = "float16"
# Grid points: (head dim, seqlen, causal); the first ones are the most telling, so a time limit that
# runs out drops the causal points first.
GRID = ((64, 2048, False), (128, 2048, False), (128, 2048, True), (64, 8192, False), (128, 8192, False),
        (128, 8192, True))
MARK_BEGIN = "cuflash_traffic_begin__"
MARK_END = "cuflash_traffic_end"
STATUS_PREFIX = "CUFLASH_TRAFFIC_STATUS "
TIMEOUT_S = 80.0  # one ncu process (one grid point, every version)
TIME_LIMIT_S = 90.0  # no new grid point is started past this (the section's time guard)
NCU_CANDIDATES = ("/opt/nvidia/nsight-compute/*/ncu", "/usr/local/cuda/bin/ncu", "/usr/local/cuda-*/bin/ncu")


# ------------------------------------------------------------------------------------------ the cases
def ladder_versions():
    """Every (mode, algo) of the ladder bench_v1 measures, forward then backward, in rung order."""
    return [("fwd", a) for a in bench_v1.FWD_RUNGS] + [("bwd", a) for a in bench_v1.BWD_RUNGS]


def tag(mode: str, algo: str) -> str:
    """Identifier of one version inside a marker kernel's name: 'fwd__v1_splitk_matched'."""
    return f"{mode}__{algo.replace('-', '_')}"


def cases(grid=GRID, versions=None) -> list[dict]:
    """One worker case per grid point: the FlashAttention-2 grid's shape at that point, every version."""
    vs = [list(v) for v in (versions or ladder_versions())]
    out = []
    for d, s, causal in grid:
        out.append(dict(dtype=DTYPE, headdim=d, seqlen=s, causal=bool(causal), batch=bench_v1.TOKENS // s,
                        heads=bench_v1.HIDDEN // d, versions=vs))
    return out


def counted_bytes(mode, algo, case) -> int | None:
    """bench_v1's analytic count for this version at this case (None without a model)."""
    fn = bench_v1.DRAM_BYTES.get((algo, mode))
    if fn is None:
        return None
    s = case["seqlen"]
    return int(fn(case["batch"], case["heads"], s, s, case["headdim"], case["causal"]))


def rung_of(mode, algo) -> int | None:
    rungs = bench_v1.FWD_RUNGS if mode == "fwd" else bench_v1.BWD_RUNGS
    return rungs.index(algo) + 1 if algo in rungs else None


# ----------------------------------------------------------------------------------- ncu CSV parsing
_SCALE = {
    # bytes: ncu scales with SI factors (Kbyte = 1000 bytes); binary spellings accepted as well
    "byte": (1.0, "byte"), "bytes": (1.0, "byte"), "B": (1.0, "byte"),
    "Kbyte": (1e3, "byte"), "KB": (1e3, "byte"), "kB": (1e3, "byte"),
    "Mbyte": (1e6, "byte"), "MB": (1e6, "byte"),
    "Gbyte": (1e9, "byte"), "GB": (1e9, "byte"),
    "Tbyte": (1e12, "byte"), "TB": (1e12, "byte"),
    "KiB": (2.0 ** 10, "byte"), "Kibyte": (2.0 ** 10, "byte"),
    "MiB": (2.0 ** 20, "byte"), "Mibyte": (2.0 ** 20, "byte"),
    "GiB": (2.0 ** 30, "byte"), "Gibyte": (2.0 ** 30, "byte"),
    "TiB": (2.0 ** 40, "byte"), "Tibyte": (2.0 ** 40, "byte"),
    # time, to nanoseconds
    "nsecond": (1.0, "ns"), "ns": (1.0, "ns"),
    "usecond": (1e3, "ns"), "us": (1e3, "ns"),
    "msecond": (1e6, "ns"), "ms": (1e6, "ns"),
    "second": (1e9, "ns"), "s": (1e9, "ns"),
}
_BYTE_OR_TIME_RE = re.compile(r"byte|second", re.IGNORECASE)


def parse_value(text):
    """A metric value as ncu prints it ('1,234,567', '2.5', 'n/a', '') -> float or None."""
    t = (text or "").strip().replace(",", "")
    if not t or t.lower() in ("n/a", "nan", "-"):
        return None
    try:
        return float(t)
    except ValueError:
        return None


def to_base(value, unit):
    """(value in base units, base unit): bytes for byte units, nanoseconds for time units, anything else as
    given. Raises ValueError for a byte or time unit it does not know (a silent factor-1000 error otherwise)."""
    u = (unit or "").strip()
    if value is None:
        return None, _SCALE.get(u, (1.0, u))[1]
    if u in _SCALE:
        f, base = _SCALE[u]
        return value * f, base
    if _BYTE_OR_TIME_RE.search(u):
        raise ValueError(f"unknown ncu unit {u!r}")
    return value, u


def _find_header(lines):
    for i, line in enumerate(lines):
        s = line.lstrip()
        if s.startswith('"ID",') or s.startswith("ID,"):
            return i
    return None


def _int_id(text):
    t = (text or "").strip().replace(",", "")
    return int(t) if t.isdigit() else None


def parse_ncu_csv(text: str) -> list[dict]:
    """Kernels of an `ncu --csv` output, in launch (ID) order: [{"id", "pid", "name", "metrics": {metric:
    value in base units or None}, "units": {metric: base unit}}]. Lines that are not CSV rows of the table
    (==PROF==, ==WARNING==, the application's own output) are skipped. Accepts the details page (columns
    "Metric Name", "Metric Unit", "Metric Value") and the raw page (one column per metric, a units row
    under the header). Returns [] when there is no table."""
    lines = text.splitlines()
    h = _find_header(lines)
    if h is None:
        return []
    rows = list(csv.reader(lines[h:]))
    header, body = rows[0], rows[1:]
    col = {name: i for i, name in enumerate(header)}
    if "ID" not in col:
        return []
    n = len(header)
    body = [r for r in body if len(r) == n and r != header]
    kernels: dict = {}

    def kernel(r):
        key = (r[col["Process ID"]] if "Process ID" in col else "", _int_id(r[col["ID"]]))
        k = kernels.get(key)
        if k is None:
            name = r[col["Kernel Name"]] if "Kernel Name" in col else ""
            k = kernels[key] = dict(id=key[1], pid=key[0], name=name, metrics={}, units={})
        return k

    if {"Metric Name", "Metric Value"} <= col.keys():  # details page: one row per (kernel, metric)
        for r in body:
            if _int_id(r[col["ID"]]) is None:
                continue
            unit = r[col["Metric Unit"]] if "Metric Unit" in col else ""
            v, base = to_base(parse_value(r[col["Metric Value"]]), unit)
            k = kernel(r)
            k["metrics"][r[col["Metric Name"]]] = v
            k["units"][r[col["Metric Name"]]] = base
    else:  # raw page: one column per metric, the first row without an ID holds the units
        metric_cols = [c for c in header if "__" in c]
        units = {}
        for r in body:
            if _int_id(r[col["ID"]]) is None:
                if not units:
                    units = {c: r[col[c]] for c in metric_cols}
                continue
            k = kernel(r)
            for c in metric_cols:
                v, base = to_base(parse_value(r[col[c]]), units.get(c, ""))
                k["metrics"][c] = v
                k["units"][c] = base
    return sorted(kernels.values(), key=lambda k: (k["id"] is None, k["id"] if k["id"] is not None else 0))


def short_name(name: str) -> str:
    """'void cuflash::flash_fwd_kernel<__half, 128, ...>(cuflash::FwdParams)' -> 'cuflash::flash_fwd_kernel'."""
    s = name.strip()
    if s.startswith("void "):
        s = s[5:]
    return s.split("<", 1)[0].split("(", 1)[0].strip()


def split_segments(kernels: list[dict]) -> dict:
    """{tag: [kernels between `cuflash_traffic_begin__<tag>` and the next `cuflash_traffic_end`]}. A begin
    without its end (a crashed measured call) closes at the next begin or at the end of the output."""
    segs: dict = {}
    cur = None
    for k in kernels:
        base = short_name(k["name"])
        if base.startswith(MARK_BEGIN):
            cur = base[len(MARK_BEGIN):]
            segs[cur] = []
        elif base == MARK_END:
            cur = None
        elif cur is not None:
            segs[cur].append(k)
    return segs


def summarise(kernels: list[dict]) -> dict:
    """Sum of read bytes, write bytes and duration over kernels; None where any kernel lacks the metric."""
    def total(m):
        vals = [k["metrics"].get(m) for k in kernels]
        return None if any(v is None for v in vals) else sum(vals)

    return dict(read=total(READ), write=total(WRITE), time_ns=total(DURATION), n=len(kernels),
                names=[short_name(k["name"]) for k in kernels])


def parse_status(text: str) -> dict:
    """{tag: status dict} from the worker's `CUFLASH_TRAFFIC_STATUS {json}` lines."""
    out = {}
    for line in text.splitlines():
        i = line.find(STATUS_PREFIX)
        if i < 0:
            continue
        try:
            st = json.loads(line[i + len(STATUS_PREFIX):])
        except ValueError:
            continue
        if isinstance(st, dict) and "tag" in st:
            out[st["tag"]] = st
    return out


# ------------------------------------------------------------------------------------------- worker
def marker_source(tags) -> str:
    """Empty kernels whose names mark the measured calls (extern "C": the name ncu prints is the name)."""
    names = [MARK_BEGIN + t for t in tags] + [MARK_END]
    return "\n".join(f'extern "C" __global__ void {n}(int unused) {{ }}' for n in names) + "\n"


def _load_case(arg: str) -> dict:
    arg = arg.strip()
    if arg.startswith("{"):
        return json.loads(arg)
    with open(arg) as f:
        return json.load(f)


def worker(case: dict) -> int:
    """Run every version of one case once after one warm-up, the measured call between marker kernels."""
    import cupy
    import numpy as np
    import torch

    from cuflash._validate import check_qkv

    real_stdout, sys.stdout = sys.stdout, sys.stderr  # stdout carries ncu's CSV: keep it clean
    try:
        d, s, causal = case["headdim"], case["seqlen"], case["causal"]
        b, h = case["batch"], case["heads"]
        versions = [tuple(v) for v in case["versions"]]
        tags = [tag(m, a) for m, a in versions]
        dt = getattr(torch, case.get("dtype", DTYPE))
        torch.manual_seed(0)
        q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=dt) for _ in range(4))
        qa, ka, va = check_qkv(q, k, v)
        mod = cupy.RawModule(code=marker_source(tags))
        begin = {t: mod.get_function(MARK_BEGIN + t) for t in tags}
        end = mod.get_function(MARK_END)
        for fn in (*begin.values(), end):
            fn.kernel  # compile + load now: no module load inside a measured segment

        def mark(fn):
            fn((1,), (1,), (np.int32(0),))
            cupy.cuda.runtime.deviceSynchronize()

        def nvtx(name=None):
            try:
                if name:
                    torch.cuda.nvtx.range_push(name)
                else:
                    torch.cuda.nvtx.range_pop()
            except Exception:  # noqa: BLE001 - the range is a convenience for the GUI only
                pass

        for (mode, algo), t in zip(versions, tags):
            st = dict(tag=t, mode=mode, algo=algo, ok=False)
            fn = None
            try:
                fn = (bench_v1._fwd_runner(algo, qa, ka, va, causal) if mode == "fwd"
                      else bench_v1._bwd_runner(algo, q, k, v, dout, causal))
                fn()  # warm-up: kernel load, first-touch allocations
                torch.cuda.synchronize()
                mark(begin[t])
                nvtx(t)
                try:
                    fn()
                    torch.cuda.synchronize()
                finally:
                    nvtx()
                    mark(end)
                st["ok"] = True
            except Exception as e:  # noqa: BLE001 - reported per version, the others still run
                st["error"] = f"{type(e).__name__}: {e}"[-1500:]
            fn = None  # free the runner's buffers before the next version
            try:
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - a broken context: say so, the next versions will fail too
                st["ok"], st["error"] = False, st.get("error") or f"{type(e).__name__}: {e}"[-1500:]
            print(STATUS_PREFIX + json.dumps(st), file=sys.stderr, flush=True)
    finally:
        sys.stdout = real_stdout
    return 0


# ------------------------------------------------------------------------------------------- driver
def find_ncu(explicit=None):
    """Path of ncu: the argument, $CUFLASH_NCU, PATH, then the usual install directories (newest first)."""
    cands = [explicit, os.environ.get("CUFLASH_NCU"), shutil.which("ncu")]
    for pat in NCU_CANDIDATES:
        cands += sorted(glob.glob(pat), reverse=True)
    for c in cands:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def ncu_command(ncu: str, case: dict, python=None, metrics=METRICS) -> list[str]:
    """The exact command line of one grid point (see the module docstring for the choice of options)."""
    return [ncu, "--clock-control", "none", "--cache-control", "all", "--replay-mode", "kernel",
            "--target-processes", "all", "--csv", "--print-units", "base", "--print-metric-name", "name",
            "--metrics", ",".join(metrics),
            python or sys.executable, "-m", "bench.bench_traffic", "--worker", json.dumps(case, separators=(",", ":"))]


def _root():
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(cmd, timeout_s):
    """(rc, stdout, stderr, timed_out); the whole process group is killed on timeout (ncu and its target)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = _root() + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.Popen(cmd, cwd=_root(), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout_s)
        return p.returncode, out, err, False
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except OSError:
            p.kill()
        out, err = p.communicate()
        return p.returncode, out, err, True


def _tail(text, n=1500):
    text = (text or "").strip()
    return text[-n:]


def case_records(case: dict, rc, out: str, err: str, timed_out=False, elapsed_s=None, error=None) -> list[dict]:
    """One record per version of `case` from ncu's output (pure: the unit tests feed it canned text).
    `error` set: every version gets it and no measurement (the counted bytes are still filled in)."""
    kernels = []
    if error is None:
        try:
            kernels = parse_ncu_csv(out) or parse_ncu_csv(err)
        except ValueError as e:
            error = f"ncu CSV: {e}"
    segs = split_segments(kernels)
    status = parse_status(err + "\n" + out)
    if error is None and timed_out:
        error = f"ncu timed out; stderr tail: {_tail(err, 600)}"
    elif error is None and not kernels:
        error = f"no ncu CSV rows (rc={rc}); stderr tail: {_tail(err)}; stdout tail: {_tail(out, 400)}"
    recs = []
    s, d = case["seqlen"], case["headdim"]
    for mode, algo in case["versions"]:
        t = tag(mode, algo)
        counted = counted_bytes(mode, algo, case)
        st = status.get(t)
        e = error
        summ = None
        if e is None:
            if st is None:
                e = f"the worker did not report this version (rc={rc}); stderr tail: {_tail(err, 600)}"
            elif not st.get("ok"):
                e = st.get("error") or "failed"
            elif t not in segs:
                e = "no begin marker in ncu's output for this version"
            else:
                summ = summarise(segs[t])
                if summ["n"] == 0:
                    e, summ = "no kernel profiled between the markers", None
                elif summ["read"] is None or summ["write"] is None:
                    seen = sorted({m for k in segs[t] for m, v in k["metrics"].items() if v is not None})
                    e = f"ncu reported no {READ} / {WRITE} for some kernel (metric unavailable?); metrics seen: {seen}"
        measured = (summ["read"] + summ["write"]) if summ and summ["read"] is not None and \
            summ["write"] is not None else None
        ms = summ["time_ns"] / 1e6 if summ and summ["time_ns"] is not None else None
        recs.append(record(
            "cuflash", algo, mode, case.get("dtype", DTYPE), case["batch"], case["heads"], s, s, d, case["causal"],
            ms, kind="traffic", rung=rung_of(mode, algo),
            dram_read_bytes=summ["read"] if summ else None, dram_write_bytes=summ["write"] if summ else None,
            dram_bytes_measured=measured, dram_bytes_counted=counted,
            measured_over_counted=(measured / counted) if measured is not None and counted else None,
            kernels=summ["n"] if summ else None, kernel_names=summ["names"] if summ else None,
            ncu_clock_control="none", ncu_cache_control="all", ncu_wall_s=elapsed_s, error=e))
    return recs


def traffic(out_records=None, grid=GRID, versions=None, ncu=None, timeout_s=TIMEOUT_S, time_limit_s=TIME_LIMIT_S,
            raw_dir=None) -> list[dict]:
    """Suite "traffic": measured vs counted device-memory traffic of every ladder version at
    each grid point. Appends to out_records (if given) and returns the list. Never raises for ncu trouble:
    the reason lands in the records' `error`. raw_dir (or $CUFLASH_TRAFFIC_RAW_DIR): keep ncu's raw
    stdout / stderr per grid point there."""
    recs = out_records if out_records is not None else []
    path = find_ncu(ncu)
    todo = cases(grid, versions)
    if path is None:
        msg = ("ncu (Nsight Compute CLI) not found: looked at $CUFLASH_NCU, PATH and " + ", ".join(NCU_CANDIDATES))
        print(f"traffic: {msg}", flush=True)
        recs.append(dict(provider="cuflash", algo="ncu", mode="traffic", kind="traffic_error", error=msg))
        for c in todo:  # the counted bytes still go in, without a measurement
            recs += case_records(c, None, "", "", error="not measured: ncu not found")
        return recs
    raw_dir = raw_dir or os.environ.get("CUFLASH_TRAFFIC_RAW_DIR")
    if "torch" in sys.modules:  # python -m bench all: hand the earlier suites' cached blocks back before the workers start
        try:
            sys.modules["torch"].cuda.empty_cache()
        except Exception:  # noqa: BLE001 - best effort
            pass
    t0 = time.time()
    for c in todo:
        label = f"d={c['headdim']} s={c['seqlen']} causal={c['causal']}"
        if time.time() - t0 > time_limit_s:
            msg = f"skipped: the section's time limit ({time_limit_s:.0f} s) reached"
            recs += case_records(c, None, "", "", error=msg)
            print(f"traffic {label}: skipped (time limit)", flush=True)
            continue
        cmd = ncu_command(path, c)
        t1 = time.time()
        try:
            rc, out, err, timed_out = _run(cmd, timeout_s)
        except OSError as e:
            rc, out, err, timed_out = None, "", f"cannot run ncu: {e}", False
        dt = time.time() - t1
        if raw_dir:
            try:
                os.makedirs(raw_dir, exist_ok=True)
                kind = "causal" if c["causal"] else "full"
                stem = os.path.join(raw_dir, f"ncu_d{c['headdim']}_s{c['seqlen']}_{kind}")
                with open(stem + ".stdout.csv", "w") as f:
                    f.write(out or "")
                with open(stem + ".stderr.txt", "w") as f:
                    f.write(" ".join(cmd) + "\n\n" + (err or ""))
            except OSError:
                pass
        new = case_records(c, rc, out or "", err or "", timed_out, round(dt, 1))
        recs += new
        line = " ".join(f"{r['algo']}/{r['mode']}="
                        + (f"{r['dram_bytes_measured'] / 1e9:.2f}GB" if r["dram_bytes_measured"] is not None else "ERR")
                        for r in new)
        print(f"traffic {label} ({dt:.0f}s, rc={rc}): {line}", flush=True)
        errs = {r["error"] for r in new if r["error"]}
        for e in sorted(errs)[:3]:
            print(f"  error: {e[:400]}", flush=True)
    return recs


def main(argv=None):
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", metavar="CASE_JSON", help="run one case (JSON text or a file); meant for ncu")
    ap.add_argument("--ncu", help="path of ncu (default: $CUFLASH_NCU, PATH, /opt/nvidia/nsight-compute/*/ncu)")
    ap.add_argument("--out", help="write the records to this JSON file")
    ap.add_argument("--raw-dir", help="keep ncu's raw output per grid point here")
    ap.add_argument("--print-cmd", action="store_true", help="print the ncu command of every case and exit")
    args = ap.parse_args(argv)
    if args.worker:
        return worker(_load_case(args.worker))
    if args.print_cmd:
        for c in cases():
            print(shlex.join(ncu_command(find_ncu(args.ncu) or "ncu", c)))
        return 0
    recs = traffic(ncu=args.ncu, raw_dir=args.raw_dir)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"records": recs}, f, indent=1)
    from .report import traffic_table

    print(traffic_table([dict(r, section="traffic") for r in recs]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
