"""CPU tests of the benchmark harness (bench/harness.py: time_rounds, record, the FLOP formula), the suite registry
and the command line (bench/__main__.py, bench/suites.py), the report (tables, README blocks, plots without
matplotlib), merging runs (bench/merge.py) and the before / after comparison's pure parts (bench/compare.py).
No GPU: time_ms is replaced by a stand-in where timing is involved."""
import builtins
import json
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from bench import compare, harness, merge, report, suites

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"


# ------------------------------------------------------------------------------------------- harness
def test_time_rounds_interleaves_and_takes_the_median(monkeypatch):
    calls = []
    times = {"a": iter([3.0, 1.0, 2.0]), "b": iter([10.0, 30.0, 20.0])}

    def fake_time_ms(fn, **kw):
        name = fn()
        calls.append((name, kw))
        return next(times[name])

    monkeypatch.setattr(harness, "time_ms", fake_time_ms)
    out = harness.time_rounds({"a": lambda: "a", "b": lambda: "b"}, rounds=3, rep=10)
    assert [c[0] for c in calls] == ["a", "b", "a", "b", "a", "b"]  # A, B, A, B, ...: not A, A, A, B, B, B
    assert all(kw == {"rep": 10} for _, kw in calls)
    assert out == {"a": (2.0, [3.0, 1.0, 2.0]), "b": (20.0, [10.0, 30.0, 20.0])}


def test_time_rounds_rotates_the_order(monkeypatch):
    """rotate=True: round r starts at the r-th provider; each provider's list keeps its own rounds in order."""
    calls = []
    times = {"a": iter([1.0, 2.0, 3.0, 4.0]), "b": iter([5.0, 6.0, 7.0, 8.0]), "c": iter([9.0, 10.0, 11.0, 12.0])}

    def fake_time_ms(fn, **kw):
        name = fn()
        calls.append(name)
        return next(times[name])

    monkeypatch.setattr(harness, "time_ms", fake_time_ms)
    fns = {n: (lambda n=n: n) for n in "abc"}
    out = harness.time_rounds(fns, rounds=4, rotate=True)
    assert calls == list("abc" "bca" "cab" "abc")
    want = {"a": [1.0, 2.0, 3.0, 4.0], "b": [5.0, 6.0, 7.0, 8.0], "c": [9.0, 10.0, 11.0, 12.0]}
    assert out == {n: (harness.median(v), v) for n, v in want.items()}
    calls.clear()
    times.update(a=iter([1.0]), b=iter([2.0]), c=iter([3.0]))
    harness.time_rounds(fns, rounds=1, rotate=True)
    assert calls == list("abc")


def test_time_ms_counts_the_warm_up_on_the_gpu(monkeypatch):
    """A long kernel gets a few waited-for warm-up calls, not 200 launches queued while the host loop counts its own
    time (torch stood in: each call queues 10 ms of work that synchronize() waits for)."""
    import time
    import types

    pending, calls = [0], []

    def sync():
        time.sleep(0.01 * pending[0])
        pending[0] = 0

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(synchronize=sync))
    monkeypatch.setitem(sys.modules, "torch", fake)
    monkeypatch.setattr(harness, "event_median_ms", lambda fn, rep: (calls.append("timed"), 7.0)[1])

    def fn():
        calls.append("call")
        pending[0] += 1

    assert harness.time_ms(fn, warmup=3, rep=5, min_warmup_ms=20.0) == 7.0
    # the first call, then warm-up calls until 3 calls and 20 ms: 3 (30 ms), then the timed part
    assert calls == ["call"] * 4 + ["timed"]


def test_time_rounds_drops_a_refusing_provider(monkeypatch):
    def fake_time_ms(fn, **kw):
        return fn()

    def refuses():
        raise RuntimeError("no kernel for this case")

    monkeypatch.setattr(harness, "time_ms", fake_time_ms)
    out = harness.time_rounds({"ok": lambda: 1.5, "refuses": refuses}, rounds=2)
    assert out["ok"] == (1.5, [1.5, 1.5]) and out["refuses"] == (None, [])


def test_time_rounds_log_prints_each_timing(capsys):
    """log=label: one line per timing as it ends (round, provider, ms); without it nothing is printed; a refusing
    provider is reported once and not logged."""
    def refuses():
        raise RuntimeError("no kernel")

    out = harness.time_rounds({"a": lambda: 2.0, "r": refuses}, rounds=2, timer=lambda fn: fn(), log="pt")
    lines = capsys.readouterr().out.splitlines()
    assert out["a"] == (2.0, [2.0, 2.0]) and out["r"] == (None, [])
    assert lines[0] == "  pt round 0: a 2.000 ms (0.0 s)" and lines[1] == "r failed: no kernel"
    assert lines[2] == "  pt round 1: a 2.000 ms (0.0 s)" and len(lines) == 3
    harness.time_rounds({"a": lambda: 2.0}, rounds=2, timer=lambda fn: fn())
    assert capsys.readouterr().out == ""


def test_time_rounds_with_another_timer():
    seen = []
    out = harness.time_rounds({"x": lambda: 7.0, "y": lambda: 9.0}, rounds=2, timer=lambda fn: seen.append(1) or fn())
    assert out == {"x": (7.0, [7.0, 7.0]), "y": (9.0, [9.0, 9.0])} and len(seen) == 4


def test_decode_times_every_provider_in_turn_by_events_and_graphs(monkeypatch):
    """bench_decode._time_in_turn: event times and graph times each in rounds A, B, A, B; a call over 1 ms captured
    2 to a graph, else GRAPH_CALLS; graph time divided by the calls in the graph; a provider that refuses (event
    timing raises) and one whose capture fails have no graph time."""
    from bench import bench_decode as bd

    event_ms = {"fast": [0.03, 0.05, 0.04], "slow": [5.0, 6.0, 4.0], "nocap": [0.1, 0.1, 0.1]}
    per_call_ms = {"fast": [0.02, 0.01, 0.03], "slow": [4.0, 3.0, 5.0]}
    order, captured = [], {}

    def fake_time_ms(fn, **kw):
        return fn()

    def timed(name):
        def fn():
            if name == "refuses":
                raise RuntimeError("backend refuses the case")
            order.append(("event", name))
            return event_ms[name][sum(1 for o in order if o == ("event", name)) - 1]
        fn.provider = name
        return fn

    class Graph:
        def __init__(self, name, calls):
            self.name, self.calls, self.n = name, calls, 0

        def replay(self):
            order.append(("graph", self.name))
            self.n += 1
            return per_call_ms[self.name][self.n - 1] * self.calls

    def fake_capture(fn, calls):
        name = fn.provider
        captured[name] = calls
        if name == "nocap":
            raise RuntimeError("operation not permitted when stream is capturing")
        return Graph(name, calls)

    monkeypatch.setattr(harness, "time_ms", fake_time_ms)
    monkeypatch.setattr(bd, "capture_graph", fake_capture)
    ev, gr = bd._time_in_turn({n: timed(n) for n in ("fast", "slow", "refuses", "nocap")}, rounds=3)
    events = [n for kind, n in order if kind == "event"]
    graphs = [n for kind, n in order if kind == "graph"]
    assert events == ["fast", "slow", "nocap"] * 3  # in turn; the refusing provider dropped after its first try
    assert graphs == ["fast", "slow"] * 3
    assert captured == {"fast": bd.GRAPH_CALLS, "slow": 2, "nocap": bd.GRAPH_CALLS}
    assert ev["fast"] == (pytest.approx(40.0), pytest.approx([30.0, 50.0, 40.0]))
    assert ev["slow"][0] == pytest.approx(5000.0) and ev["refuses"] == (None, [])
    assert gr["fast"] == (pytest.approx(20.0), pytest.approx([20.0, 10.0, 30.0]))
    assert gr["slow"] == (pytest.approx(4000.0), pytest.approx([4000.0, 3000.0, 5000.0]))
    assert set(gr) == {"fast", "slow"}


def test_one_flop_formula():
    """FlashAttention-2's count: 4 B H Sq Sk D, halved for causal, x2.5 for the backward; record() uses it."""
    from cuflash.reference import attention_flops

    assert harness.flops(2, 16, 1024, 1024, 128) == 4.0 * 2 * 16 * 1024 * 1024 * 128
    assert harness.flops(2, 16, 1024, 1024, 128, causal=True) == 2.0 * 2 * 16 * 1024 * 1024 * 128
    assert harness.flops(2, 16, 1024, 1024, 128, mode="bwd") == 2.5 * 4.0 * 2 * 16 * 1024 * 1024 * 128
    assert harness.flops(1, 8, 100, 300, 64, True, "bwd") == attention_flops(1, 8, 100, 300, 64, True, "bwd")
    r = harness.record("flash", "sdpa", "bwd", "float16", 4, 16, 4096, 4096, 128, True, 2.0)
    assert r["tflops"] == pytest.approx(harness.flops(4, 16, 4096, 4096, 128, True, "bwd") / 2e-3 / 1e12)
    assert harness.record("cuflash", "decode-split", "decode", "float16", 1, 32, 1, 4096, 128, False, 0.1)["tflops"] is None
    # no other definition in bench/: the count 4 * b * h * sq * sk * d appears nowhere else
    pattern = re.compile(r"4(\.0)?\s*\*\s*\w*b\w*\s*\*\s*\w*h\w*\s*\*", re.I)
    hits = [str(p.relative_to(ROOT)) for p in BENCH.rglob("*.py") if pattern.search(p.read_text())]
    assert hits in ([], ["bench/harness.py"]), hits  # harness.py: its docstring states the formula
    defs = [str(p.relative_to(ROOT)) for p in BENCH.rglob("*.py") if re.search(r"def \w*flops\w*\(", p.read_text())]
    assert defs == ["bench/harness.py"], defs


def test_records_name_the_backend():
    rec = harness.record
    assert rec("cuflash", "v2", "fwd", "float16", 1, 8, 128, 128, 64, False, 1.0)["backend"] == "sm80"
    assert rec("cuflash", "v2-atomic", "bwd", "float16", 1, 8, 128, 128, 64, False, 1.0)["backend"] == "sm80"
    assert rec("cuflash", "v1-splitq", "fwd", "float16", 1, 8, 128, 128, 64, False, 1.0)["backend"] == "v1"
    assert rec("cuflash", "decode-split", "decode", "float16", 1, 8, 1, 128, 64, False, 1.0)["backend"] == "decode"
    assert rec("cuflash", "v2", "fwd", "float16", 1, 8, 128, 128, 64, False, 1.0, backend="sm90")["backend"] == "sm90"
    assert "backend" not in rec("flash", "sdpa", "fwd", "float16", 1, 8, 128, 128, 64, False, 1.0)


def test_committed_results_name_the_backend_and_their_runs():
    data = json.loads((BENCH / "results" / "results.json").read_text())
    cu = [r for r in data["records"] if r.get("provider") == "cuflash" and r.get("kind") != "traffic_error"]
    # "sm90+sm80": a forward + backward (or whole-model step) record of the default path on an sm_90 GPU (the
    # Hopper forward, the mma.sync backward and decode)
    assert cu and all(r.get("backend") in ("sm80", "sm90", "v1", "decode", "sm90+sm80") for r in cu)
    assert all(r["mode"] in ("fwd_bwd", "step") for r in cu if r["backend"] == "sm90+sm80")
    assert all(r["backend"] == "sm90" for r in cu if "sm90" in str(r.get("algo")))
    runs = data["header"]["runs"]
    assert all(0 <= r["run"] < len(runs) for r in data["records"])


# ------------------------------------------------------------------------------------ suites, CLI
def test_every_suite_resolves():
    for s in suites.SUITES.values():
        fn = s.resolve()
        assert callable(fn), s.name
        params = set(s.accepts())
        assert set(s.defaults) <= params, (s.name, set(s.defaults) - params)
    assert set(suites.DEFAULT_ALL) <= set(suites.SUITES)
    assert suites.resolve_list("fwd,bwd") == ["fwd", "bwd"] and suites.resolve_list("none") == []
    with pytest.raises(SystemExit):
        suites.resolve_list("fwd,nonsense")


def test_suite_options_reach_only_the_functions_that_take_them(monkeypatch):
    got = {}

    def fake(seqlens=(1,), rounds=1):
        got.update(seqlens=seqlens, rounds=rounds)
        return []

    s = suites.Suite("x", "harness", "time_ms", 0.0, "doc", dict(rounds=3))
    monkeypatch.setattr(suites.Suite, "resolve", lambda self: fake)
    s.run(seqlens=(2048,), dtypes=("bfloat16",), rounds=None)
    assert got == {"seqlens": (2048,), "rounds": 3}


def test_decode_grid_options_reach_the_decode_suite(monkeypatch, tmp_path):
    """python -m bench decode --kv-heads 8,1 --batches 64 --cache-lens 1024,4096: the grid's parts reach decode()."""
    import inspect

    import bench.__main__ as bm
    from bench import bench_decode, run

    params = inspect.signature(bench_decode.decode).parameters
    assert {"kv_heads", "batches", "cache_lens"} <= set(params)
    got = {}

    def fake(batches=(1,), cache_lens=(1,), kv_heads=(1,), rounds=3):
        got.update(batches=batches, cache_lens=cache_lens, kv_heads=kv_heads, rounds=rounds)
        return []

    monkeypatch.setattr(suites.Suite, "resolve", lambda self: fake)
    monkeypatch.setattr(run, "write_report", lambda *a, **k: None)
    monkeypatch.setattr("bench.harness.header", lambda: {})
    assert bm.main(["decode", "--out", str(tmp_path), "--kv-heads", "8,1", "--batches", "64",
                    "--cache-lens", "1024,4096"]) == 0
    assert got == {"batches": (64,), "cache_lens": (1024, 4096), "kv_heads": (8, 1), "rounds": 3}


def test_calls_option_reaches_the_backward_suites(monkeypatch, tmp_path):
    """python -m bench bwd90 --calls 5: the backward suite times 5 back-to-back calls per event pair (ms per call,
    max(3, 10 // calls) timings); without it single calls, 10 timings; a bad count is refused."""
    import inspect

    import bench.__main__ as bm
    from bench import bench_bwd, run

    assert "calls" in inspect.signature(bench_bwd.bwd).parameters
    got = {}

    def fake(seqlens=(1,), rounds=3, calls=1, **defaults):  # (the suite's other defaults)
        got.update(calls=calls, rounds=rounds)
        return []

    monkeypatch.setattr(suites.Suite, "resolve", lambda self: fake)
    monkeypatch.setattr(run, "write_report", lambda *a, **k: None)
    monkeypatch.setattr("bench.harness.header", lambda: {})
    assert bm.main(["bwd90", "--out", str(tmp_path), "--calls", "5"]) == 0
    assert got == {"calls": 5, "rounds": 3}
    assert bench_bwd._timing(1) == {"rep": 10}
    seen = []
    monkeypatch.setattr(bench_bwd, "time_ms", lambda fn, rep: (seen.append(rep), fn(), 10.0)[2])
    n = []
    timer = bench_bwd._timing(5)["timer"]
    assert timer(lambda: n.append(1)) == 2.0 and len(n) == 5 and seen == [3]
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match="calls"):
            bench_bwd._timing(bad)
    # queued: single calls through harness.time_queued_ms; not with back-to-back calls
    monkeypatch.setattr(harness, "time_queued_ms", lambda fn, rep: (seen.append(("q", rep)), fn(), 7.0)[2])
    n.clear()
    assert bench_bwd._timing(1, queued=True)["timer"](lambda: n.append(1)) == 7.0 and n == [1]
    assert seen[-1] == ("q", 10)
    with pytest.raises(ValueError, match="queued"):
        bench_bwd._timing(5, queued=True)
    assert suites.SUITES["bwd90_queued"].defaults["queued"] is True
    assert {k: v for k, v in suites.SUITES["bwd90_queued"].defaults.items() if k != "queued"} == \
        suites.SUITES["bwd90"].defaults


def test_time_queued_ms_records_start_after_the_spin(monkeypatch):
    """harness.time_queued_ms: after warm-up, each timing enqueues the spin kernel before its start event, so the
    host work of fn lies under the spin (a fake torch.cuda records the order of the calls)."""
    import sys
    import types

    from bench import harness

    log = []

    class Event:
        def __init__(self, enable_timing=False):
            pass

        def record(self):
            log.append("record")

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return 1.0

    cuda = types.SimpleNamespace(Event=Event, synchronize=lambda: log.append("sync"),
                                 _sleep=lambda n: log.append(("sleep", n)), current_device=lambda: 0)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    monkeypatch.setattr(harness, "_SPIN_CYCLES", {})
    assert harness.time_queued_ms(lambda: log.append("fn"), warmup=1, rep=2, spin_ms=3.0) == 1.0
    first = log.index(("sleep", 3_000_000))  # 1e6 cycles measured as 1 ms -> 3e6 for 3 ms
    assert log[first - 1:] == ["sync", ("sleep", 3_000_000), "record", "fn", "record"] * 2


def test_a_failing_suite_does_not_stop_the_others(tmp_path, monkeypatch, capsys):
    from bench import run

    def boom():
        raise ValueError("broken suite")

    monkeypatch.setitem(suites.SUITES, "t_bad", suites.Suite("t_bad", "harness", "x", 0, "doc"))
    monkeypatch.setitem(suites.SUITES, "t_ok", suites.Suite("t_ok", "harness", "x", 0, "doc"))
    monkeypatch.setattr(suites.Suite, "resolve", lambda self: boom if self.name == "t_bad" else (
        lambda: [dict(provider="flash", mode="x", ms=1.0)]))
    head, recs = run.run_suites(["t_bad", "t_ok"], str(tmp_path), head={"gpu": "test"})
    assert [(r["section"], r["provider"]) for r in recs] == [("t_bad", "error"), ("t_ok", "flash")]
    assert "broken suite" in recs[0]["error"] and "Traceback" in capsys.readouterr().err
    saved = json.loads((tmp_path / "results.json").read_text())
    assert len(saved["records"]) == 2 and set(saved["header"]["suite_seconds"]) == {"t_bad", "t_ok"}


def test_a_time_limit_skips_the_suites_that_would_end_past_it(tmp_path, monkeypatch, capsys):
    """run_suites(deadline=): a suite whose rough minutes end past the deadline is not started and is marked
    "skipped (time limit)"; a later, shorter one still runs; without a deadline every suite runs."""
    import time

    from bench import run

    for name, minutes in (("t_short", 0.001), ("t_long", 30.0), ("t_after", 0.001)):
        monkeypatch.setitem(suites.SUITES, name, suites.Suite(name, "harness", "x", minutes, "doc"))
    monkeypatch.setattr(suites.Suite, "resolve", lambda self: (lambda: [dict(provider="flash", mode=self.name, ms=1.0)]))
    head, recs = run.run_suites(["t_short", "t_long", "t_after"], str(tmp_path), head={"gpu": "test"},
                                deadline=time.time() + 60.0)
    assert [r["section"] for r in recs] == ["t_short", "t_after"]
    assert head["suite_status"] == {"t_short": "done", "t_long": "skipped (time limit)", "t_after": "done"}
    assert "t_long skipped: about 30.0 min" in capsys.readouterr().out
    head, recs = run.run_suites(["t_short", "t_long"], str(tmp_path), head={"gpu": "test"})
    assert [r["section"] for r in recs] == ["t_short", "t_long"]


def test_a_suite_stopped_by_sigterm_keeps_its_points(tmp_path):
    """A time limit's SIGTERM in the middle of a suite: the records it had made are saved, marked stopped, and
    the suites after it do not run (a real process, killed by a real signal)."""
    script = f"""
import sys, time, os, signal
sys.path.insert(0, {str(ROOT)!r})
from bench import harness, run, suites

def slow():
    for i in range(1000):
        harness.record("cuflash", "v2-sm90", "fwd", "float16", 1, 1, 128, 128, 64, False, 1.0, backend="sm90")
        if i == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
    return []

suites.SUITES["t_slow"] = suites.Suite("t_slow", "harness", "x", 0, "doc")
suites.SUITES["t_next"] = suites.Suite("t_next", "harness", "x", 0, "doc")
suites.Suite.resolve = lambda self: slow if self.name == "t_slow" else (lambda: [dict(provider="x")])
run.run_suites(["t_slow", "t_next"], {str(tmp_path)!r}, head={{"gpu": "test"}})
"""
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    saved = json.loads((tmp_path / "results.json").read_text())
    assert [r["section"] for r in saved["records"]] == ["t_slow"] * 3
    assert saved["header"]["suite_status"] == {"t_slow": "stopped"}


@pytest.mark.parametrize("args", [["--help"], ["compare", "--help"], ["list"], ["merge", "--help"]])
def test_command_line_without_a_gpu(args):
    p = subprocess.run([sys.executable, "-m", "bench", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "torch" not in p.stderr
    if args == ["list"]:
        assert all(name in p.stdout for name in suites.SUITES)
    if args[0] == "compare":
        assert "--base" in p.stdout and "--suites" in p.stdout


def test_sanitizer_runs_skip_off_hopper_and_without_the_tool(tmp_path, capsys, monkeypatch):
    from bench import run

    assert run.sanitize(str(tmp_path), cc=80, tool="/bin/true") is None
    assert "sm_80" in capsys.readouterr().out
    monkeypatch.setattr(run, "find_sanitizer", lambda: None)
    assert run.sanitize(str(tmp_path), cc=90) is None
    assert "compute-sanitizer not found" in capsys.readouterr().out
    assert not (tmp_path / "sanitizer-sm90-synccheck.log").exists()


def test_sanitizer_runs_call_the_tool_on_sm90_check_and_log_each_status(tmp_path):
    """A stand-in compute-sanitizer (a script printing its arguments, failing on the persistent form's run): every run
    of SANITIZER_RUNS in one log, each command line and exit status written, and a deadline already past runs none."""
    from bench import run

    tool = tmp_path / "compute-sanitizer"
    tool.write_text('#!/bin/sh\necho "args: $*"\ncase "$*" in *--persist*) exit 1;; esac\nexit 0\n')
    tool.chmod(0o755)
    cmds = run.sanitizer_commands(str(tool))
    assert [c[1:5] for c in cmds] == [["--tool", "synccheck", "--error-exitcode", "1"]] * 2
    assert [c[6:8] for c in cmds] == [["-m", "bench.diag.sm90_check"]] * 2
    assert [c[8:] for c in cmds] == [["--quick"], ["--persist", "--quick"]]
    assert run.sanitize(str(tmp_path), cc=90, tool=str(tool)) == [0, 1]
    log = (tmp_path / "sanitizer-sm90-synccheck.log").read_text()
    assert log.count("args: --tool synccheck --error-exitcode 1") == 2 and "bench.diag.sm90_check --persist" in log
    assert "# exit status 0" in log and "# exit status 1" in log
    import time

    assert run.sanitize(str(tmp_path), deadline=time.time(), cc=90, tool=str(tool)) == ["stopped", "stopped"]
    assert "args:" not in (tmp_path / "sanitizer-sm90-synccheck.log").read_text()


def test_bench_imports_nothing_from_tests_and_names_no_removed_options():
    for p in list(BENCH.rglob("*.py")) + list(BENCH.rglob("*.sh")):
        text = p.read_text()
        assert not re.search(r"^\s*(from|import)\s+(tests|test_|conftest)", text, re.M), p
        assert 'sys.path.insert(0, "tests")' not in text, p
        assert "dq_issue" not in text and "do_stages" not in text, p


# ------------------------------------------------------------------------------------------- report
@pytest.mark.parametrize("mode", ["fwd", "bwd"])
def test_report_renders_the_rounds_suites(mode):
    recs = []
    for prov, algo, ms in (("cuflash", "v2" if mode == "fwd" else "v2-atomic", 1.0), ("flash", "sdpa", 1.25),
                           ("cudnn", "sdpa", 0.5)):
        recs.append(dict(harness.record(prov, algo, mode, "float16", 4, 16, 4096, 4096, 128, False, ms),
                         section=mode, rounds=3, round_ms=[ms, ms, ms]))
    md = report.markdown({"gpu": "test"}, recs)
    title = f"(suite {mode})"
    assert title in md
    table = md[md.index(title):]
    name = f"cuflash-{recs[0]['algo']}"
    assert f"**{name} / flash** | 1.25" in table and f"**{name} / cudnn** | 0.50" in table


def _grid_records():
    recs = []
    for s, (cu, fl, cd) in ((2048, (1.0, 1.10, 0.70)), (4096, (2.0, 2.04, 1.30))):
        for prov, ms in (("cuflash", cu), ("flash", fl), ("cudnn", cd)):
            recs.append(dict(harness.record(prov, "v2", "fwd", "float16", 16384 // s, 16, s, s, 128, False, ms),
                             section="fwd"))
    recs.append(dict(harness.record("cuflash", "v2", "latency", "float16", 1, 8, 128, 128, 64, False, 0.018,
                                    us_per_call=18.1), section="latency"))
    recs.append(dict(harness.record("flash", "sdpa", "latency", "float16", 1, 8, 128, 128, 64, False, 0.037,
                                    us_per_call=37.1), section="latency"))
    return recs


README = """# project

Intro text.

<!-- results:fwd -->
| stale | table |
<!-- /results:fwd -->

Prose between the blocks stays.

<!-- results:latency -->
<!-- /results:latency -->

<!-- results:nosuchblock -->
kept as is
<!-- /results:nosuchblock -->

<!-- results:decode -->
no decode records: kept
<!-- /results:decode -->
"""


def test_readme_blocks_are_replaced_between_the_markers():
    new, filled, skipped = report.fill_readme(README, _grid_records())
    assert filled == ["fwd", "latency"] and skipped == ["nosuchblock", "decode"]
    assert "stale" not in new
    assert new.startswith("# project\n\nIntro text.\n\n<!-- results:fwd -->\n| dtype | hdim | causal | 2048 | 4096 |")
    fwd = new[new.index("<!-- results:fwd -->"):new.index("<!-- /results:fwd -->")]
    cu = harness.tflops(1.0, 8, 16, 2048, 2048, 128)
    assert f"| float16 | 128 | False | {cu:.0f} (1.10 / 0.70) |" in fwd
    lat = new[new.index("<!-- results:latency -->"):new.index("<!-- /results:latency -->")]
    assert "| False | 18.1 us | 37.1 us |" in lat
    assert "Prose between the blocks stays." in new and "kept as is" in new and "no decode records: kept" in new
    assert new.endswith("<!-- /results:decode -->\n")
    again, filled2, _ = report.fill_readme(new, _grid_records())
    assert again == new and filled2 == filled  # idempotent


def test_readme_marker_without_its_partner_is_reported():
    text = "<!-- results:fwd -->\nold\n"
    new, filled, skipped = report.fill_readme(text, _grid_records())
    assert new == text and filled == [] and skipped == ["fwd"]


def test_report_cli_updates_the_readme_without_matplotlib(tmp_path, monkeypatch, capsys):
    real_import = builtins.__import__

    def no_matplotlib(name, *a, **kw):
        if name.split(".")[0] == "matplotlib":
            raise ImportError("no matplotlib here")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    monkeypatch.setattr(report, "_NOTED", [])
    res = tmp_path / "results.json"
    res.write_text(json.dumps(dict(header={"gpu": "test"}, records=_grid_records())))
    readme = tmp_path / "README.md"
    readme.write_text(README)
    assert report.main(["--results", str(res), "--readme", str(readme)]) == 0
    assert "(1.10 / 0.70)" in readme.read_text()
    assert (tmp_path / "results.md").exists() and not list(tmp_path.glob("*.png"))
    assert "matplotlib not installed" in capsys.readouterr().out


def test_report_module_does_not_import_matplotlib_at_import_time():
    code = "import sys, bench.report; assert 'matplotlib' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


def test_committed_micro_numbers_render():
    data = json.loads((BENCH / "results" / "results.json").read_text())
    table = report.micro_table(data["records"])
    assert "| HMMA.16816 f16 -> f32 latency |" in table and "{{" not in table


# -------------------------------------------------------------------------------------------- merge
def test_merge_takes_and_renames_sections(tmp_path):
    """bench.merge: `SRC:a,b` keeps only those sections; `SRC:a=c` files section a as c (a second run of a suite,
    kept next to the first); each record keeps its own run."""
    def write(name, secs):
        p = tmp_path / name
        recs = [dict(section=s, provider="flash", mode="x", ms=float(i)) for i, s in enumerate(secs)]
        p.write_text(json.dumps(dict(header=dict(gpu="g", date=name), records=recs)))
        return str(p)

    a = write("a.json", ["bwd", "bwd_strategies", "ceilings"])
    b = write("b.json", ["bwd", "fwd"])
    assert merge.main([str(tmp_path / "out"), a + ":bwd,ceilings", b + ":bwd=bwd_run2"]) == 0
    out = json.loads((tmp_path / "out" / "results.json").read_text())
    got = [(r["section"], r["run"], r["ms"]) for r in out["records"]]
    assert got == [("bwd", 0, 0.0), ("ceilings", 0, 2.0), ("bwd_run2", 1, 0.0)]
    assert [c["date"] for c in out["header"]["runs"]] == ["a.json", "b.json"]
    # a merged file merged again keeps its runs
    head, recs = merge.merge([str(tmp_path / "out"), b + ":fwd"])
    assert len(head["runs"]) == 3 and [r["run"] for r in recs] == [0, 0, 1, 2]


# ------------------------------------------------------------------------------------------ compare
def _compare_records():
    recs = []
    for s, (base, new) in ((1024, (1.00, 0.99)), (2048, (2.00, 2.02)), (4096, (4.0, 4.4))):
        for tree, ms in (("base", base), ("new", new)):
            recs.append(dict(harness.record("cuflash", "v2", "fwd", "float16", 16384 // s, 16, s, s, 128, False, ms,
                                            tree=tree), section="fwd"))
        recs.append(dict(harness.record("flash", "sdpa", "fwd", "float16", 16384 // s, 16, s, s, 128, False, base),
                         section="fwd"))
    for tree, us in (("base", 20.0), ("new", 19.0)):
        recs.append(dict(harness.record("cuflash", "v2", "latency", "float16", 1, 8, 128, 128, 64, False, us / 1e3,
                                        us=us, us_per_call=us, tree=tree, case="fwd"), section="latency"))
    return recs


def test_compare_summary_and_table():
    summ = compare.summarize(_compare_records())
    fwd = summ["fwd"]
    assert fwd["n"] == 3
    assert fwd["median"] == pytest.approx(2.0 / 2.02)  # speed new / base: 1/0.99, 2/2.02, 4/4.4
    assert fwd["worst"] == pytest.approx(4.0 / 4.4) and fwd["worst_point"] == "float16 d128 s4096 non-causal"
    assert fwd["ok"] is False  # 9% slower at one point
    assert summ["latency"]["median"] == pytest.approx(20.0 / 19.0) and summ["latency"]["ok"] is False
    md = compare.markdown({"gpu": "test"}, _compare_records())
    assert "| fwd | 3 |" in md and "FAIL" in md
    assert "| float16 d128 s2048 non-causal |" in md and "| flash |" in md.replace(" | new/flash", "")
    lines = compare.summary_lines(_compare_records())
    assert lines[0].startswith("fwd: median new/base 0.990 over 3 points, worst 0.909")


def test_compare_passes_within_tolerance():
    recs = [r for r in _compare_records() if r.get("seqlen_q") != 4096 and r["section"] == "fwd"]
    assert compare.summarize(recs)["fwd"]["ok"] is True


def test_compare_loads_the_old_tree_with_its_own_kernels(tmp_path):
    base = tmp_path / "old"
    shutil.copytree(ROOT / "cuflash", base / "cuflash", ignore=shutil.ignore_patterns("__pycache__"))
    (base / "cuda_src").mkdir()
    name = "cuflash_base_cpu_test"
    try:
        mod = compare.load_tree(base, name=name)
        assert mod.__name__ == name and pathlib.Path(mod.__file__).resolve() == (base / "cuflash" / "__init__.py").resolve()
        assert callable(mod.flash_attn_func) and callable(mod.flash_attn_with_kvcache)
        assert compare.kernel_dir(mod) == str((base / "cuda_src").resolve())
        import cuflash

        assert compare.kernel_dir(cuflash) == str((ROOT / "cuda_src").resolve())
        assert mod.flash_attn_func is not cuflash.flash_attn_func
        assert all(not m.startswith(name) or sys.modules[m].__file__.startswith(str(base))
                   for m in list(sys.modules) if m.startswith(name + "."))
    finally:
        for m in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[m]


def test_compare_calls_only_the_shared_public_api():
    """The calls the comparison makes exist with these keywords in the current tree."""
    import inspect

    import cuflash

    fa = inspect.signature(cuflash.flash_attn_func).parameters
    kv = inspect.signature(cuflash.flash_attn_with_kvcache).parameters
    assert "causal" in fa and "cache_seqlens" in kv
    src = (BENCH / "compare.py").read_text()
    used = set(re.findall(r"flash_attn_func\([^)]*?(\w+)=", src)) | set(re.findall(r"flash_attn_with_kvcache\([^)]*?(\w+)=", src))
    assert used <= {"causal", "cache_seqlens"}, used


def test_compare_suites_run_on_stubs(monkeypatch, tmp_path):
    """compare's suites end to end with torch, SDPA and the two trees stubbed: every public call is made with
    the shared keywords, each provider is timed in turn, and the records pair up."""
    import contextlib
    import types

    class T:
        def __init__(self, *shape, **kw):
            self.shape = shape

        def transpose(self, *a):
            return self

        def contiguous(self):
            return self

        def detach(self):
            return self

        def requires_grad_(self, *a):
            return self

    calls = []

    class Graph:
        def replay(self):
            calls.append("replay")

    cuda = types.SimpleNamespace(
        empty_cache=lambda: None, synchronize=lambda: None, Stream=lambda: types.SimpleNamespace(wait_stream=lambda s: 0),
        current_stream=lambda: None, stream=lambda s: contextlib.nullcontext(), CUDAGraph=Graph,
        graph=lambda g, stream=None: contextlib.nullcontext(), get_device_capability=lambda: (9, 0))
    fake_torch = types.SimpleNamespace(
        float16="f16", bfloat16="bf16", int32="i32", cuda=cuda,
        randn=lambda *shape, **kw: T(*shape), randn_like=lambda x: T(), full=lambda *a, **kw: T(),
        autograd=types.SimpleNamespace(grad=lambda out, inputs, g, retain_graph=False: calls.append(("grad", out))))
    monkeypatch.setitem(sys.modules, "torch", fake_torch)

    def tree(name):
        def fa(q, k, v, causal=False):
            calls.append((name, "fwd", causal))
            return name

        def kv(q, k_cache, v_cache, cache_seqlens=None):
            calls.append((name, "decode"))
            return name
        return types.SimpleNamespace(flash_attn_func=fa, flash_attn_with_kvcache=kv)

    trees = {"base": tree("base"), "new": tree("new")}
    order, timers = [], []

    def fake_rounds(fns, rounds=1, timer=None, **kw):
        timers.append((timer, kw.get("rep")))
        out = {}
        for _ in range(rounds):
            for name, fn in fns.items():
                order.append(name)
                fn()
        for i, name in enumerate(fns):
            out[name] = (1.0 + 0.01 * i, [1.0 + 0.01 * i] * rounds)
        return out

    monkeypatch.setattr(compare, "time_rounds", fake_rounds)
    monkeypatch.setattr(compare, "sdpa", lambda p: (lambda *a, **kw: p))
    grid = dict(seqlens=(2048,), dtypes=("float16",), headdims=(128,))
    recs = []
    for name, fn in (("fwd", lambda: compare.fwd(trees, rounds=2, **grid)),
                     ("bwd", lambda: compare.bwd(trees, rounds=2, **grid)),
                     ("decode", lambda: compare.decode(trees, cases=((1, 4096, 8),), rounds=2)),
                     ("latency", lambda: compare.latency(trees, rounds=2))):
        for r in fn():
            r["section"] = name
            recs.append(r)
    assert order[:8] == ["base", "new", "flash", "cudnn"] * 2
    assert ("base", "fwd", True) in calls and ("new", "decode") in calls and "replay" in calls
    summ = compare.summarize(recs)
    assert set(summ) == {"fwd", "bwd", "decode", "latency"}
    assert summ["fwd"]["n"] == 2 and summ["decode"]["n"] == 1 and summ["latency"]["n"] == 3
    # the auto path on a compute capability 9.0 GPU: the Hopper kernels for these head dims (64, 128); decode's own
    assert all(r["backend"] == ("decode" if r.get("case") == "decode" or r["section"] == "decode" else "sm90")
               for r in recs if r.get("tree"))
    md = compare.markdown({"gpu": "stub"}, recs)
    assert "## decode (us per call)" in md and "## bwd (TFLOP/s)" in md
    assert "queued" not in md and not any("timing" in r for r in recs if r["section"] in ("fwd", "bwd"))
    assert timers[:4] == [(None, None)] * 2 + [(None, 10)] * 2  # fwd: time_ms's default; bwd: 10 repetitions
    # --queued: fwd and bwd through harness.time_queued_ms (10 calls after the spin), records marked
    timers.clear()
    queued = compare.fwd(trees, rounds=1, queued=True, **grid) + compare.bwd(trees, rounds=1, queued=True, **grid)
    assert timers == [(compare.time_queued_ms, 10)] * 4
    assert len(queued) == 16 and all(r["timing"] == "queued" for r in queued)
    for r in queued:
        r["section"] = r["mode"]
    assert "queued behind a ~3 ms spin kernel" in compare.markdown({"timing": "queued"}, queued)
    assert compare.parser().parse_args(["--base", "B", "--out", "O", "--queued"]).queued


def test_source_trees_name_the_code_as_it_ran(tmp_path):
    """harness.source_trees: the trees of cuflash/ and cuda_src/ in the working tree, uncommitted and untracked
    files included (ignored ones not), equal to those of the commit that holds the same files, whatever HEAD is;
    the checkout's own index untouched; the same trees for a copy of the files outside any checkout (an exported
    base tree, its __pycache__ left out), None without the folders. harness.git_commit: a checkout's HEAD at its
    top level only, None for a folder inside it or for a copy outside it."""
    import os
    import shutil

    repo = tmp_path / "repo"
    repo.mkdir()

    def git(*args):
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True,
                              env=dict(os.environ, GIT_AUTHOR_NAME="a", GIT_AUTHOR_EMAIL="a@b", GIT_COMMITTER_NAME="a",
                                       GIT_COMMITTER_EMAIL="a@b")).stdout.strip()

    git("init", "-q")
    for d in harness.SOURCE_DIRS:
        (repo / d).mkdir()
        (repo / d / "a.txt").write_text(d)
    (repo / ".gitignore").write_text("*.pyc\n")
    git("add", "-A")
    git("commit", "-qm", "one")
    first = harness.source_trees(repo)
    assert first == {d: git("rev-parse", f"HEAD:{d}") for d in harness.SOURCE_DIRS}
    assert harness.git_commit(repo) == git("rev-parse", "HEAD")
    assert harness.git_commit(repo / "cuflash") is None  # a folder inside the checkout is not its HEAD
    (repo / "cuflash" / "a.txt").write_text("changed")  # an uncommitted change
    (repo / "cuflash" / "new.txt").write_text("new")  # an untracked file
    (repo / "cuflash" / "x.pyc").write_text("ignored")
    now = harness.source_trees(repo)
    assert now["cuflash"] != first["cuflash"] and now["cuda_src"] == first["cuda_src"]
    assert harness.git_commit(repo).endswith("+dirty")
    assert git("diff", "--cached", "--name-only") == ""  # nothing staged in the checkout's own index
    git("add", "-A")
    git("commit", "-qm", "two")
    assert now == {d: git("rev-parse", f"HEAD:{d}") for d in harness.SOURCE_DIRS}
    outside = tmp_path / "export"  # the committed files, no checkout, as `git archive` writes them
    for d in harness.SOURCE_DIRS:
        shutil.copytree(repo / d, outside / d, ignore=shutil.ignore_patterns("*.pyc"))
    (outside / "cuflash" / "__pycache__").mkdir()
    (outside / "cuflash" / "__pycache__" / "m.pyc").write_text("compiled")
    assert harness.source_trees(outside) == now
    assert harness.git_commit(outside) is None
    (outside / "COMMIT").write_text("abc123\n")
    assert harness.git_commit(outside) == "abc123"
    bare = tmp_path / "plain"
    bare.mkdir()
    assert harness.source_trees(bare) is None


def test_bwd_handoff_parsing():
    """bench.diag.bwd_handoff: its shape syntax, and the first launch / first kernel of each profiled backward
    measured from its own mark (events after the next mark excluded; memsets and copies are not kernels)."""
    from bench.diag.bwd_handoff import _parse_shape, first_times

    assert _parse_shape("d128:2048") == (128, 2048, True)
    assert _parse_shape("d64:4096n") == (64, 4096, False)
    ev = [("bwd0", 100.0, False), ("cudaLaunchKernel", 150.0, False), ("Memset (Device)", 120.0, True),
          ("kernel_a", 170.0, True), ("cuLaunchKernel", 160.0, False),
          ("bwd1", 1000.0, False), ("cuLaunchKernelEx", 1300.0, False), ("kernel_b", 1340.0, True),
          ("bwd2", 2000.0, False)]
    launch, first = first_times(ev, 3)
    assert launch == (50.0 + 300.0) / 2 and first == (70.0 + 340.0) / 2  # bwd2 has neither: left out
    assert first_times([("bwd0", 0.0, False)], 1) == (None, None)


def test_compare_decode_cases():
    """--decode-cases parsing: (batch, cache length, KV heads) triples; malformed or impossible ones exit with a
    message naming the option."""
    assert compare.parse_decode_cases("1,1024,1;64,1024,8") == ((1, 1024, 1), (64, 1024, 8))
    assert compare.parse_decode_cases(" 8,4096,32 ;") == ((8, 4096, 32),)
    for bad in ("1,1024", "1,1024,3", "0,1024,8", "a,b,c", ";"):
        with pytest.raises(SystemExit, match="--decode-cases"):
            compare.parse_decode_cases(bad)
