"""CPU tests of the benchmark harness' interleaved timing (bench/harness.py: time_rounds) and of the report's
tables for the sections that use it (fwd_rounds, bwd_rounds). No GPU: time_ms is replaced by a stand-in."""
import pytest

from bench import harness, report


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


def test_time_rounds_drops_a_refusing_provider(monkeypatch):
    def fake_time_ms(fn, **kw):
        return fn()

    def refuses():
        raise RuntimeError("no kernel for this case")

    monkeypatch.setattr(harness, "time_ms", fake_time_ms)
    out = harness.time_rounds({"ok": lambda: 1.5, "refuses": refuses}, rounds=2)
    assert out["ok"] == (1.5, [1.5, 1.5]) and out["refuses"] == (None, [])


@pytest.mark.parametrize("mode,section", [("fwd", "fwd_rounds"), ("bwd", "bwd_rounds")])
def test_report_renders_the_rounds_sections(mode, section):
    recs = []
    for prov, algo, ms in (("cuflash", "v2" if mode == "fwd" else "v2-atomic", 1.0), ("flash", "sdpa", 1.25),
                           ("cudnn", "sdpa", 0.5)):
        recs.append(dict(harness.record(prov, algo, mode, "float16", 4, 16, 4096, 4096, 128, False, ms),
                         section=section, rounds=3, round_ms=[ms, ms, ms]))
    md = report.markdown({"gpu": "test"}, recs)
    title = f"section {section}"
    assert title in md
    table = md[md.index(title):]
    name = f"cuflash-{recs[0]['algo']}"
    assert f"**{name} / flash** | 1.25" in table and f"**{name} / cudnn** | 0.50" in table


def test_merge_results_takes_and_renames_sections(tmp_path):
    """bench.merge_results: `SRC:a,b` keeps only those sections; `SRC:a=c` files section a as c (a repeat of a
    section from a later call, kept next to the first); each record keeps its own call."""
    import json

    from bench import merge_results

    def write(name, secs):
        p = tmp_path / name
        recs = [dict(section=s, provider="flash", mode="x", ms=float(i)) for i, s in enumerate(secs)]
        p.write_text(json.dumps(dict(header=dict(gpu="g", date=name), records=recs)))
        return str(p)

    a = write("a.json", ["bwd_rounds", "bwd_quick", "ceilings"])
    b = write("b.json", ["bwd_rounds", "fwd"])
    merge_results.main([str(tmp_path / "out"), a + ":bwd_rounds,ceilings", b + ":bwd_rounds=bwd_rounds_repeat"])
    out = json.loads((tmp_path / "out" / "results.json").read_text())
    got = [(r["section"], r["call"], r["ms"]) for r in out["records"]]
    assert got == [("bwd_rounds", 0, 0.0), ("ceilings", 0, 2.0), ("bwd_rounds_repeat", 1, 0.0)]
    assert [c["date"] for c in out["header"]["calls"]] == ["a.json", "b.json"]
