"""CPU: the pure-Python half of bench/bench_traffic.py (ncu CSV parsing, unit normalisation, marker
segments, per-version records, the case list, the driver against a fake `ncu`, the report table). Needs
neither a GPU nor Nsight Compute."""
import json
import os
import re
import stat
import sys
import textwrap

import pytest

import bench.bench_traffic as bt
from bench import bench_v1, report

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
          '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')
RANDN = ("void at::native::(anonymous namespace)::distribution_elementwise_grid_stride_kernel<float, (int)4, "
         "at::native::templates::cuda::normal_and_transform<c10::Half, float>(at::TensorIteratorBase &)>(long, "
         "at::PhiloxCudaState, T3, T4)")
FWD_V2 = "void cuflash::flash_fwd_kernel<__half, 64, 128, 64, 4, false, false, 0>(cuflash::FwdParams)"
BWD_PRE = "void cuflash::flash_bwd_preprocess_kernel<__half, 64>(cuflash::BwdParams)"
BWD_MAIN = "void cuflash::flash_bwd_kernel<__half, 64, 64, 128, 8, false, 0>(cuflash::BwdParams)"
BWD_CONV = "void cuflash::flash_bwd_convert_dq_kernel<__half, 64, false, 128>(cuflash::BwdParams)"


def _rows(kid, name, read, write, ns, units=("byte", "byte", "nsecond"), grid="(256, 1, 1)"):
    """The three metric rows ncu --csv (details page) prints for one kernel."""
    out = []
    for metric, unit, val in zip(bt.METRICS, units, (read, write, ns)):
        out.append(f'"{kid}","4711","python3","gpu-host","{name}","1","7","(128, 1, 1)","{grid}","0","9.0",'
                   f'"Command line profiler metrics","{metric}","{unit}","{val}"')
    return out


def _details_csv():
    """Realistic `ncu --csv --print-units base` stdout: warm-up and input kernels outside the markers, two
    measured versions (forward: one kernel; backward: three), thousands separators in values."""
    lines = ["==PROF== Connected to process 4711 (/usr/bin/python3.12)"]
    lines += [f'==PROF== Profiling "{n}" - {i}: 0%....50%....100% - 1 pass' for i, n in enumerate(("a", "b"))]
    lines.append(HEADER)
    kid = 0
    for _ in range(4):  # q, k, v, dout
        lines += _rows(kid, RANDN, "1,024", "67,108,864", "41,280")
        kid += 1
    lines += _rows(kid, FWD_V2, "999", "999", "999")  # warm-up of fwd v2: excluded
    kid += 1
    lines += _rows(kid, bt.MARK_BEGIN + "fwd__v2", "0", "0", "1,504")
    kid += 1
    lines += _rows(kid, FWD_V2, "201,326,592", "67,633,152", "1,250,000")
    kid += 1
    lines += _rows(kid, bt.MARK_END, "0", "0", "1,440")
    kid += 1
    lines += _rows(kid, FWD_V2, "5", "5", "5")  # the backward runner's own forward: excluded
    kid += 1
    for n in (BWD_PRE, BWD_MAIN, BWD_CONV):  # warm-up of bwd v2: excluded
        lines += _rows(kid, n, "7", "7", "7")
        kid += 1
    lines += _rows(kid, bt.MARK_BEGIN + "bwd__v2", "0", "0", "1,504")
    kid += 1
    for n, r, w, t in ((BWD_PRE, "134,742,016", "136,314,880", "80,000"),
                       (BWD_MAIN, "1,000,000,000", "500,000,000", "4,000,000"),
                       (BWD_CONV, "134,217,728", "67,108,864", "60,000")):
        lines += _rows(kid, n, r, w, t)
        kid += 1
    lines += _rows(kid, bt.MARK_END, "0", "0", "1,440")
    lines.append("==PROF== Disconnected from process 4711")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------- units
def test_parse_value():
    assert bt.parse_value("67,108,864") == 67108864.0
    assert bt.parse_value(" 2.5 ") == 2.5
    assert bt.parse_value("1.5e+09") == 1.5e9
    for bad in ("", "n/a", "N/A", "nan", "-", None, "abc"):
        assert bt.parse_value(bad) is None


@pytest.mark.parametrize("unit,factor,base", [
    ("byte", 1, "byte"), ("Kbyte", 1e3, "byte"), ("Mbyte", 1e6, "byte"), ("Gbyte", 1e9, "byte"),
    ("Tbyte", 1e12, "byte"), ("KiB", 1024, "byte"), ("MiB", 2 ** 20, "byte"), ("GiB", 2 ** 30, "byte"),
    ("nsecond", 1, "ns"), ("usecond", 1e3, "ns"), ("msecond", 1e6, "ns"), ("second", 1e9, "ns"),
    ("ns", 1, "ns"), ("us", 1e3, "ns"), ("ms", 1e6, "ns"),
])
def test_to_base(unit, factor, base):
    v, b = bt.to_base(2.5, unit)
    assert b == base and v == pytest.approx(2.5 * factor)


def test_to_base_other_units_pass_and_unknown_byte_units_fail():
    assert bt.to_base(62.5, "%") == (62.5, "%")
    assert bt.to_base(3.0, "") == (3.0, "")
    assert bt.to_base(None, "Mbyte") == (None, "byte")
    with pytest.raises(ValueError, match="unknown ncu unit"):
        bt.to_base(1.0, "Pbyte")
    with pytest.raises(ValueError, match="unknown ncu unit"):
        bt.to_base(1.0, "psecond")


# -------------------------------------------------------------------------------------------- parser
def test_parse_details_page():
    ks = bt.parse_ncu_csv(_details_csv())
    assert [k["id"] for k in ks] == list(range(len(ks)))
    assert len(ks) == 4 + 1 + 3 + 1 + 3 + 1 + 3 + 1
    assert ks[0]["name"] == RANDN  # quoted commas and parentheses survive
    assert ks[0]["metrics"][bt.WRITE] == 67108864.0
    assert ks[0]["units"] == {bt.READ: "byte", bt.WRITE: "byte", bt.DURATION: "ns"}
    assert ks[0]["pid"] == "4711"


def test_parse_auto_units_and_old_column_set():
    """Without --print-units base ncu scales per row (Mbyte, usecond); ncu before 2023 had a "Kernel Time"
    column and no launch columns. The parser keys on header names, so both read the same."""
    head = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Kernel Time","Context","Stream",'
            '"Section Name","Metric Name","Metric Unit","Metric Value"')
    body = [
        '"0","1","python3","h","k1","2025-01-01 00:00:00","1","7","","dram__bytes_read.sum","Mbyte","2.5"',
        '"0","1","python3","h","k1","2025-01-01 00:00:00","1","7","","dram__bytes_write.sum","Kbyte","640"',
        '"0","1","python3","h","k1","2025-01-01 00:00:00","1","7","","gpu__time_duration.sum","usecond","41.28"',
        '"1","1","python3","h","k2","2025-01-01 00:00:00","1","7","","dram__bytes_read.sum","Gbyte","1.25"',
        '"1","1","python3","h","k2","2025-01-01 00:00:00","1","7","","dram__bytes_write.sum","byte","0"',
        '"1","1","python3","h","k2","2025-01-01 00:00:00","1","7","","gpu__time_duration.sum","msecond","2"',
    ]
    ks = bt.parse_ncu_csv("\n".join(["==PROF== Connected", head] + body))
    assert [k["name"] for k in ks] == ["k1", "k2"]
    assert ks[0]["metrics"] == {bt.READ: pytest.approx(2.5e6), bt.WRITE: pytest.approx(640e3),
                                bt.DURATION: pytest.approx(41280.0)}
    s = bt.summarise(ks)
    assert s["read"] == pytest.approx(2.5e6 + 1.25e9)
    assert s["time_ns"] == pytest.approx(41280.0 + 2e6)
    assert s["n"] == 2


def test_parse_rule_columns_and_noise_lines():
    """ncu 2023.2+ appends rule columns; stray non-table lines between rows are ignored."""
    head = HEADER + ',"Rule Name","Rule Type","Rule Description","Estimated Speedup Type","Estimated Speedup"'
    rows = [r + ',"","","","",""' for r in _rows(0, "k", "10", "20", "30")]
    text = "\n".join([head, rows[0], "==WARNING== something, with, commas", rows[1], "some app output", rows[2]])
    ks = bt.parse_ncu_csv(text)
    assert len(ks) == 1 and ks[0]["metrics"] == {bt.READ: 10.0, bt.WRITE: 20.0, bt.DURATION: 30.0}


def test_parse_raw_page():
    """`--page raw`: one row per kernel, one column per metric, a units row under the header."""
    head = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
            '"Grid Size","Device","CC","dram__bytes_read.sum","dram__bytes_write.sum","gpu__time_duration.sum"')
    units = '"","","","","","","","","","","","Mbyte","byte","usecond"'
    r0 = '"0","9","python3","h","kern<int, 2>(int)","1","7","(128, 1, 1)","(4, 1, 1)","0","9.0","1.5","2,048","3"'
    ks = bt.parse_ncu_csv("\n".join([head, units, r0]))
    assert len(ks) == 1
    assert ks[0]["name"] == "kern<int, 2>(int)"
    assert ks[0]["metrics"] == {bt.READ: pytest.approx(1.5e6), bt.WRITE: 2048.0, bt.DURATION: pytest.approx(3000.0)}


def test_parse_without_table():
    assert bt.parse_ncu_csv("") == []
    assert bt.parse_ncu_csv("==PROF== Connected to process 1\n==ERROR== ERR_NVGPUCTRPERM\n") == []


def test_short_name():
    assert bt.short_name(FWD_V2) == "cuflash::flash_fwd_kernel"
    assert bt.short_name(bt.MARK_END) == bt.MARK_END
    assert bt.short_name(bt.MARK_BEGIN + "fwd__v2(int)") == bt.MARK_BEGIN + "fwd__v2"


def test_segments_select_only_the_measured_calls():
    segs = bt.split_segments(bt.parse_ncu_csv(_details_csv()))
    assert set(segs) == {"fwd__v2", "bwd__v2"}
    assert [bt.short_name(k["name"]) for k in segs["fwd__v2"]] == ["cuflash::flash_fwd_kernel"]
    fwd = bt.summarise(segs["fwd__v2"])
    assert (fwd["read"], fwd["write"], fwd["time_ns"], fwd["n"]) == (201326592.0, 67633152.0, 1250000.0, 1)
    bwd = bt.summarise(segs["bwd__v2"])
    assert bwd["n"] == 3
    assert bwd["read"] == 134742016 + 1_000_000_000 + 134217728
    assert bwd["write"] == 136314880 + 500_000_000 + 67108864
    assert bwd["names"] == ["cuflash::flash_bwd_preprocess_kernel", "cuflash::flash_bwd_kernel",
                            "cuflash::flash_bwd_convert_dq_kernel"]


def test_segments_unclosed_and_stray_markers():
    def k(i, name):
        return dict(id=i, pid="1", name=name, metrics={m: 1.0 for m in bt.METRICS}, units={})

    ks = [k(0, bt.MARK_END), k(1, "x"), k(2, bt.MARK_BEGIN + "a"), k(3, "y"), k(4, bt.MARK_BEGIN + "b"), k(5, "z")]
    segs = bt.split_segments(ks)
    assert {t: [x["name"] for x in v] for t, v in segs.items()} == {"a": ["y"], "b": ["z"]}


def test_summarise_missing_metric_is_none_not_zero():
    ks = [dict(id=0, pid="", name="k", metrics={bt.READ: 5.0, bt.WRITE: None, bt.DURATION: 1.0}, units={})]
    s = bt.summarise(ks)
    assert s["read"] == 5.0 and s["write"] is None


# ------------------------------------------------------------------------------------------ the cases
def test_cases_are_well_formed():
    cs = bt.cases()
    assert cs, "no cases"
    seen = set()
    for c in cs:
        assert json.loads(json.dumps(c)) == c  # travels as JSON on the command line
        assert c["dtype"] == "float16"
        assert c["batch"] * c["seqlen"] == 16384 and c["heads"] * c["headdim"] == 2048
        assert c["batch"] * c["seqlen"] == bench_v1.TOKENS and c["heads"] * c["headdim"] == bench_v1.HIDDEN
        key = (c["headdim"], c["seqlen"], c["causal"])
        assert key not in seen
        seen.add(key)
        vs = [tuple(v) for v in c["versions"]]
        assert vs == [("fwd", a) for a in bench_v1.FWD_RUNGS] + [("bwd", a) for a in bench_v1.BWD_RUNGS]
        tags = [bt.tag(m, a) for m, a in vs]
        assert len(set(tags)) == len(tags)
        for (m, a), t in zip(vs, tags):
            assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", bt.MARK_BEGIN + t)
            n = bt.counted_bytes(m, a, c)
            assert isinstance(n, int) and n > 0, (m, a, c)
            assert bt.rung_of(m, a) is not None
    assert {d for d, _, _ in seen} == {64, 128}
    assert {s for _, s, _ in seen} == {2048, 8192}
    assert any(c for _, _, c in seen) and any(not c for _, _, c in seen)
    # both causal settings at one head dim at least
    assert any({(d, s, False), (d, s, True)} <= seen for d, s, _ in seen)


def test_ncu_command():
    c = bt.cases()[0]
    cmd = bt.ncu_command("/x/ncu", c, python="/usr/bin/python3")
    assert cmd[0] == "/x/ncu"
    for opt, val in (("--clock-control", "none"), ("--cache-control", "all"), ("--replay-mode", "kernel"),
                     ("--print-units", "base"), ("--metrics", ",".join(bt.METRICS))):
        assert cmd[cmd.index(opt) + 1] == val
    assert "--csv" in cmd
    i = cmd.index("/usr/bin/python3")
    assert cmd[i:i + 4] == ["/usr/bin/python3", "-m", "bench.bench_traffic", "--worker"]
    assert json.loads(cmd[i + 4]) == c
    assert all(x.startswith("-") or x in ("none", "all", "kernel", "base", "name") for x in cmd[1:i]
               if x != ",".join(bt.METRICS))


def test_marker_source_compiles():
    try:
        from cupy.cuda import nvrtc
    except Exception as e:  # noqa: BLE001 - no CuPy here
        pytest.skip(f"cupy.cuda.nvrtc unavailable: {e}")
    tags = [bt.tag(m, a) for m, a in bt.ladder_versions()]
    src = bt.marker_source(tags)
    try:
        prog = nvrtc.createProgram(src, "markers.cu", [], [])
    except Exception as e:  # noqa: BLE001 - no NVRTC library on this machine
        pytest.skip(f"NVRTC unavailable: {e}")
    try:
        nvrtc.compileProgram(prog, ["-arch=compute_80"])
        ptx = nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    text = ptx.decode() if isinstance(ptx, bytes) else ptx
    for t in tags:
        assert f".entry {bt.MARK_BEGIN}{t}(" in text
    assert f".entry {bt.MARK_END}(" in text


# --------------------------------------------------------------------------------- records (canned)
def _status(case, fail=()):
    out = []
    for m, a in case["versions"]:
        t = bt.tag(m, a)
        st = dict(tag=t, mode=m, algo=a, ok=t not in fail)
        if t in fail:
            st["error"] = "RuntimeError: boom"
        out.append(bt.STATUS_PREFIX + json.dumps(st))
    return "\n".join(out) + "\n"


def _case(versions):
    c = bt.cases(grid=((64, 2048, False),))[0]
    c["versions"] = [list(v) for v in versions]
    return c


def test_case_records_from_canned_output():
    c = _case([("fwd", "v2"), ("bwd", "v2"), ("fwd", "v1-splitk")])
    recs = bt.case_records(c, 0, _details_csv(), "some torch warning\n" + _status(c, fail={"fwd__v1_splitk"}))
    by = {(r["mode"], r["algo"]): r for r in recs}
    f = by[("fwd", "v2")]
    assert f["error"] is None and f["kind"] == "traffic"
    assert f["dram_read_bytes"] == 201326592 and f["dram_write_bytes"] == 67633152
    assert f["dram_bytes_measured"] == 201326592 + 67633152
    assert f["dram_bytes_counted"] == bench_v1.v2_fwd_bytes(8, 32, 2048, 2048, 64, False)
    assert f["measured_over_counted"] == pytest.approx(f["dram_bytes_measured"] / f["dram_bytes_counted"])
    assert f["ms"] == pytest.approx(1.25) and f["kernels"] == 1 and f["rung"] == len(bench_v1.FWD_RUNGS)
    assert (f["headdim"], f["seqlen_q"], f["causal"], f["dtype"], f["batch"], f["heads"]) == (
        64, 2048, False, "float16", 8, 32)
    b = by[("bwd", "v2")]
    assert b["error"] is None and b["kernels"] == 3 and b["ms"] == pytest.approx(4.14)
    assert b["dram_bytes_counted"] == bench_v1.v2_bwd_bytes(8, 32, 2048, 2048, 64, False)
    e = by[("fwd", "v1-splitk")]
    assert e["error"] == "RuntimeError: boom" and e["dram_bytes_measured"] is None
    assert e["dram_bytes_counted"] == bench_v1.v1_fwd_bytes(8, 32, 2048, 2048, 64, False)


def test_case_records_failures_never_raise():
    c = _case([("fwd", "v2"), ("bwd", "v1")])
    # ncu failed before profiling anything
    recs = bt.case_records(c, 1, "", "==ERROR== ERR_NVGPUCTRPERM - no permission\n")
    assert len(recs) == 2 and all("no ncu CSV rows (rc=1)" in r["error"] for r in recs)
    assert all("ERR_NVGPUCTRPERM" in r["error"] for r in recs)
    assert all(r["dram_bytes_counted"] for r in recs)
    # timed out
    recs = bt.case_records(c, -9, _details_csv(), "", timed_out=True)
    assert all(r["error"].startswith("ncu timed out") for r in recs)
    # the worker died before reporting (bwd v1 has no status and no segment)
    recs = bt.case_records(c, 1, _details_csv(), _status(_case([("fwd", "v2")])))
    by = {(r["mode"], r["algo"]): r for r in recs}
    assert by[("fwd", "v2")]["error"] is None
    assert "did not report" in by[("bwd", "v1")]["error"]
    # reported ok but no marker in the CSV (e.g. ncu filtered it out)
    recs = bt.case_records(c, 0, _details_csv(), _status(c))
    assert "no begin marker" in {(r["mode"], r["algo"]): r for r in recs}[("bwd", "v1")]["error"]
    # a unit the parser does not know: an error, not a silently wrong number
    bad = _details_csv().replace('"byte","67,633,152"', '"Pbyte","1"')
    recs = bt.case_records(c, 0, bad, _status(c))
    assert all(r["error"].startswith("ncu CSV: unknown ncu unit") for r in recs)
    # metric labels instead of names (an ncu that ignored --print-metric-name name): said so, with what it saw
    labelled = _details_csv().replace('"dram__bytes_read.sum"', '"DRAM Bytes Read"')
    recs = bt.case_records(c, 0, labelled, _status(c))
    e = {(r["mode"], r["algo"]): r for r in recs}[("fwd", "v2")]["error"]
    assert "metric unavailable" in e and "DRAM Bytes Read" in e
    # forced error: counted bytes still there
    recs = bt.case_records(c, None, "", "", error="skipped")
    assert all(r["error"] == "skipped" and r["dram_bytes_counted"] for r in recs)


def test_csv_on_stderr_is_found_too():
    c = _case([("fwd", "v2")])
    recs = bt.case_records(c, 0, "", _details_csv() + _status(c))
    assert recs[0]["error"] is None and recs[0]["kernels"] == 1


# ----------------------------------------------------------------------------- driver with a fake ncu
FAKE_NCU = r'''#!{python}
"""Stands in for ncu: checks the options, then prints a CSV the way ncu does for the case it was given."""
import json, sys, time
args = sys.argv[1:]
mode = {mode!r}
if mode == "sleep":
    time.sleep(30)
if mode == "fail":
    print("==ERROR== ERR_NVGPUCTRPERM - The user does not have permission to access NVIDIA GPU Performance Counters",
          file=sys.stderr)
    sys.exit(1)
assert args[args.index("--clock-control") + 1] == "none", args
case = json.loads(args[args.index("--worker") + 1])
rows, kid = [], 0
def kern(name, r, w, t):
    global kid
    for metric, unit, val in (("dram__bytes_read.sum", "byte", r), ("dram__bytes_write.sum", "byte", w),
                              ("gpu__time_duration.sum", "nsecond", t)):
        rows.append(f'"{{kid}}","77","python3","h","{{name}}","1","7","(128, 1, 1)","(8, 1, 1)","0","9.0",'
                    f'"Command line profiler metrics","{{metric}}","{{unit}}","{{val}}"')
    kid += 1
print("==PROF== Connected to process 77", file=sys.stderr)
for m, a in case["versions"]:
    tag = m + "__" + a.replace("-", "_")
    kern("void cuflash::k<1, 2>(P)", 1, 1, 1)  # warm-up
    kern("cuflash_traffic_begin__" + tag, 0, 0, 1000)
    kern("void cuflash::k<1, 2>(P)", "1,000,000,000", "250,000,000", "2,000,000")
    kern("cuflash_traffic_end", 0, 0, 1000)
    print("CUFLASH_TRAFFIC_STATUS " + json.dumps(dict(tag=tag, mode=m, algo=a, ok=True)), file=sys.stderr)
print({header!r})
print("\n".join(rows))
'''


def _fake_ncu(tmp_path, mode="ok"):
    p = tmp_path / "ncu"
    p.write_text(FAKE_NCU.format(python=sys.executable, mode=mode, header=HEADER))
    p.chmod(p.stat().st_mode | stat.S_IEXEC)
    return str(p)


def test_driver_with_fake_ncu(tmp_path, capsys):
    grid = ((64, 2048, False), (128, 8192, True))
    out = []
    recs = bt.traffic(out, grid=grid, ncu=_fake_ncu(tmp_path), raw_dir=str(tmp_path / "raw"))
    assert recs is out
    assert len(recs) == len(grid) * len(bt.ladder_versions())
    for r in recs:
        assert r["error"] is None, r["error"]
        assert r["dram_read_bytes"] == 1e9 and r["dram_write_bytes"] == 2.5e8 and r["kernels"] == 1
        assert r["ms"] == pytest.approx(2.0)
        assert r["measured_over_counted"] == pytest.approx(1.25e9 / r["dram_bytes_counted"])
    assert sorted(os.listdir(tmp_path / "raw")) == sorted(
        ["ncu_d64_s2048_full.stdout.csv", "ncu_d64_s2048_full.stderr.txt",
         "ncu_d128_s8192_causal.stdout.csv", "ncu_d128_s8192_causal.stderr.txt"])
    # the section's table
    md = report.markdown({}, [dict(r, section="traffic") for r in recs])
    assert "Device-memory traffic of the V1 -> V2 ladder" in md
    assert "| 1 v1-splitk | fwd | 64 | 2048 | False | 1.00 | 0.25 | 1.25 |" in md


def test_driver_ncu_failing(tmp_path):
    recs = bt.traffic(grid=((64, 2048, False),), ncu=_fake_ncu(tmp_path, "fail"))
    assert len(recs) == len(bt.ladder_versions())
    assert all("ERR_NVGPUCTRPERM" in r["error"] for r in recs)


def test_driver_timeout_and_time_limit(tmp_path):
    recs = bt.traffic(grid=((64, 2048, False), (128, 2048, False)), ncu=_fake_ncu(tmp_path, "sleep"), timeout_s=1,
                      time_limit_s=0.5)
    n = len(bt.ladder_versions())
    assert len(recs) == 2 * n
    assert all(r["error"].startswith("ncu timed out") for r in recs[:n])
    assert all(r["error"].startswith("skipped: the section's time limit") for r in recs[n:])


def test_driver_without_ncu(monkeypatch):
    monkeypatch.setattr(bt, "find_ncu", lambda explicit=None: None)
    recs = bt.traffic(grid=((64, 2048, False),))
    assert recs[0]["kind"] == "traffic_error" and "ncu (Nsight Compute CLI) not found" in recs[0]["error"]
    assert all(r["error"] == "not measured: ncu not found" for r in recs[1:])
    assert all(r["dram_bytes_counted"] for r in recs[1:])
    md = report.markdown({}, [dict(r, section="traffic") for r in recs])
    assert "Not measured:" in md and "ncu (Nsight Compute CLI) not found" in md


def test_find_ncu(tmp_path, monkeypatch):
    fake = _fake_ncu(tmp_path)
    assert bt.find_ncu(fake) == fake
    monkeypatch.setenv("CUFLASH_NCU", fake)
    assert bt.find_ncu() == fake
    assert bt.find_ncu(str(tmp_path / "missing")) == fake  # falls through to $CUFLASH_NCU


# -------------------------------------------------------------------------------------------- report
def test_report_without_the_section():
    recs = [dict(section="ladder", provider="cuflash", algo="v2", mode="fwd", kind="time", ms=1.0)]
    assert report.traffic_table(recs) == ""
    assert "Device-memory traffic" not in report.markdown({}, recs)
    assert report.traffic_table([]) == ""
    # a suite that crashed as a whole: the runner's error record, shown by errors(), no traffic table
    crashed = [dict(section="traffic", provider="error", error="Traceback ...")]
    assert report.traffic_table(crashed) == ""
    assert "suite traffic FAILED" in report.markdown({}, crashed)


def test_report_joins_the_ladder_time():
    c = _case([("fwd", "v2")])
    r = bt.case_records(c, 0, _details_csv(), _status(c))[0]
    ladder = dict(section="ladder", provider="cuflash", algo="v2", mode="fwd", dtype="float16", headdim=64,
                  seqlen_q=2048, causal=False, kind="time", ms=0.987)
    md = report.traffic_table([dict(r, section="traffic"), ladder])
    row = [line for line in md.splitlines() if line.startswith("| 6 v2 |")]
    assert len(row) == 1 and row[0].endswith("| 1 | 1.25 | 0.99 |"), row


def test_the_suite_is_registered():
    from bench.suites import SUITES

    assert SUITES["traffic"].resolve() is bt.traffic


def test_module_docstring_states_the_command():
    doc = textwrap.dedent(bt.__doc__)
    assert "--clock-control none" in doc and "--cache-control all" in doc


# ------------------------------------------------------------------------------- worker (stubbed GPU)
def test_worker_order_of_launches(monkeypatch, capsys):
    """The worker's control flow with torch, CuPy and the runners stubbed: per version one warm-up call, then
    begin marker, the measured call, end marker; a failing version is reported and the others still run;
    nothing reaches stdout (ncu's CSV goes there)."""
    import types

    import cuflash._validate

    log = []

    class Kernel:
        def __init__(self, name):
            self.name = name

        @property
        def kernel(self):
            log.append(("load", self.name))

        def __call__(self, grid, block, args):
            log.append(("mark", self.name))

    class Module:
        def __init__(self, code):
            self.code = code

        def get_function(self, name):
            assert f"void {name}(" in self.code
            return Kernel(name)

    def sync():
        log.append("sync")

    fake_cupy = types.SimpleNamespace(RawModule=Module, cuda=types.SimpleNamespace(
        runtime=types.SimpleNamespace(deviceSynchronize=sync)))
    fake_torch = types.SimpleNamespace(
        float16="f16", manual_seed=lambda s: None,
        randn=lambda *a, **kw: log.append(("randn", a, kw["dtype"])) or object(),
        cuda=types.SimpleNamespace(synchronize=sync, nvtx=types.SimpleNamespace(
            range_push=lambda n: log.append(("push", n)), range_pop=lambda: log.append("pop"))))
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    monkeypatch.setattr(cuflash._validate, "check_qkv", lambda q, k, v: (q, k, v))

    def runner(mode):
        def make(algo, *args):
            if algo == "v1-splitq":
                raise RuntimeError("no kernel")

            def call():
                print("stray print from a runner")
                log.append(("call", mode, algo))
            return call
        return make

    monkeypatch.setattr(bench_v1, "_fwd_runner", runner("fwd"))
    monkeypatch.setattr(bench_v1, "_bwd_runner", runner("bwd"))
    c = _case([("fwd", "v2"), ("fwd", "v1-splitq"), ("bwd", "v1")])
    assert bt.worker(json.loads(json.dumps(c))) == 0
    out, err = capsys.readouterr()
    assert out == ""
    st = bt.parse_status(err)
    assert st["fwd__v2"]["ok"] and st["bwd__v1"]["ok"]
    assert not st["fwd__v1_splitq"]["ok"] and "no kernel" in st["fwd__v1_splitq"]["error"]
    assert [x for x in log if x[0] == "randn"] == [("randn", (8, 2048, 32, 64), "f16")] * 4
    events = [x for x in log if x != "sync" and x[0] not in ("randn", "load")]
    assert events == [
        ("call", "fwd", "v2"), ("mark", bt.MARK_BEGIN + "fwd__v2"), ("push", "fwd__v2"), ("call", "fwd", "v2"),
        "pop", ("mark", bt.MARK_END),
        ("call", "bwd", "v1"), ("mark", bt.MARK_BEGIN + "bwd__v1"), ("push", "bwd__v1"), ("call", "bwd", "v1"),
        "pop", ("mark", bt.MARK_END),
    ]
    # every marker is loaded before the first call
    first_call = next(i for i, x in enumerate(log) if x[0] == "call")
    assert {x[1] for x in log[:first_call] if x[0] == "load"} == {bt.MARK_BEGIN + bt.tag(m, a) for m, a in
                                                                   c["versions"]} | {bt.MARK_END}
