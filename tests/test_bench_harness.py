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
