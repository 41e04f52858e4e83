"""CPU: the GPU-test run's outcome stream and the JUnit XML made from it (bench/junit.py), and `bench.run.gpu_tests`
stopping pytest at a deadline with the XML of what ran -- on a small test file of its own (marked gpu, so the
run's `-m gpu` selects it; no GPU needed)."""
import json
import os
import time
import xml.etree.ElementTree as ET

import pytest

from bench import junit, run

_TESTS = '''
import time
import pytest

pytestmark = pytest.mark.gpu

@pytest.fixture
def broken_teardown():
    yield
    raise RuntimeError("teardown broke")

def test_passes():
    assert True

@pytest.mark.parametrize("x", [1, 2])
def test_param(x):
    assert x == 1, "only one"

def test_skips():
    pytest.skip("not here")

@pytest.mark.skipif(True, reason="never")
def test_skipped_at_setup():
    pass

def test_teardown(broken_teardown):
    pass

class TestGroup:
    def test_in_class(self):
        pass

def test_zz_slow():
    time.sleep(SLEEP)
'''


def _cases(xml):
    root = ET.parse(xml).getroot()
    suite = root.find("testsuite")
    cases = {}
    for c in suite.iter("testcase"):
        kinds = [k.tag for k in c]
        cases[(c.get("classname").split(".")[-1], c.get("name"))] = kinds[0] if kinds else "passed"
    props = {p.get("name"): p.get("value") for p in suite.iter("property")}
    return suite, cases, props


def _write_tests(tmp_path, sleep):
    path = tmp_path / "test_sample.py"
    path.write_text(_TESTS.replace("SLEEP", str(sleep)))
    return str(path)


def test_results_from_records():
    recs = [dict(nodeid="tests/test_a.py::test_ok", when="call", outcome="passed", duration=0.5),
            dict(nodeid="tests/test_a.py::test_bad[1]", when="call", outcome="failed", duration=0.1,
                 message="E   assert 1 == 2"),
            dict(nodeid="tests/test_a.py::test_skip", when="setup", outcome="skipped", duration=0.0, message="no"),
            dict(nodeid="tests/test_a.py::test_td", when="call", outcome="passed", duration=0.2),
            dict(nodeid="tests/test_a.py::test_td", when="teardown", outcome="failed", duration=0.0, message="boom"),
            dict(nodeid="tests/test_a.py::TestC::test_m", when="call", outcome="passed", duration=0.0)]
    res = junit.results(recs)
    assert [v[0] for v in res.values()] == ["passed", "failed", "skipped", "error", "passed"]
    assert abs(res["tests/test_a.py::test_td"][1] - 0.2) < 1e-9
    assert junit._names("tests/test_a.py::TestC::test_m") == ("tests.test_a.TestC", "test_m")
    assert junit._names("tests/test_a.py::test_bad[1]") == ("tests.test_a", "test_bad[1]")


def test_stream_to_junit_drops_a_cut_line(tmp_path):
    stream = tmp_path / "s.jsonl"
    stream.write_text(json.dumps(dict(nodeid="t.py::a", when="call", outcome="passed", duration=1.0)) + "\n" +
                      json.dumps(dict(nodeid="t.py::b", when="call", outcome="failed", duration=1.0, message="x")) +
                      "\n" + '{"nodeid": "t.py::c", "wh')
    counts = junit.stream_to_junit(str(stream), str(tmp_path / "o.xml"), note="stopped by the time limit")
    assert counts == dict(tests=2, passed=1, failures=1, errors=0, skipped=0)
    suite, cases, props = _cases(str(tmp_path / "o.xml"))
    assert suite.get("tests") == "2" and suite.get("failures") == "1" and props["note"] == "stopped by the time limit"
    assert cases == {("t", "a"): "passed", ("t", "b"): "failure"}


def test_gpu_tests_keeps_pytests_own_xml_and_streams(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    rc = run.gpu_tests(str(out), _write_tests(tmp_path, 0))
    assert rc == 1  # two failures
    suite, cases, props = _cases(str(out / "gpu-tests.xml"))
    assert "note" not in props  # pytest's own XML, written at its end
    assert cases[("test_sample", "test_passes")] == "passed" and cases[("test_sample", "test_param[2]")] == "failure"
    assert cases[("test_sample", "test_skips")] == "skipped" and cases[("TestGroup", "test_in_class")] == "passed"
    assert cases[("test_sample", "test_teardown")] == "error"
    streamed = junit.results(junit.read_stream(str(out / "tests.jsonl")))
    assert len(streamed) == len(cases) == 8
    assert {k.split("::")[-1]: v[0] for k, v in streamed.items()} == {
        "test_passes": "passed", "test_param[1]": "passed", "test_param[2]": "failed", "test_skips": "skipped",
        "test_skipped_at_setup": "skipped", "test_teardown": "error", "test_in_class": "passed",
        "test_zz_slow": "passed"}


def test_gpu_tests_stopped_at_the_deadline(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    t0 = time.time()
    rc = run.gpu_tests(str(out), _write_tests(tmp_path, 120), deadline=t0 + 12)
    assert rc == "stopped" and time.time() - t0 < 40
    suite, cases, props = _cases(str(out / "gpu-tests.xml"))
    assert props["note"].startswith("stopped by the time limit")
    assert ("test_sample", "test_zz_slow") not in cases and len(cases) == 7  # every test but the one cut off
    assert suite.get("failures") == "1" and suite.get("errors") == "1" and suite.get("skipped") == "2"
    log = (out / "tests.log").read_text()
    assert "stopped by the time limit" in log and "3 passed, 1 failed, 1 errors, 2 skipped (7 tests)" in log
    assert os.path.getsize(out / "tests.jsonl") > 0


def test_gpu_tests_stopped_after_pytest_wrote_its_xml(tmp_path):
    """A deadline that falls after pytest wrote its XML (the interpreter still exiting: here a conftest that sleeps in
    pytest_unconfigure) keeps pytest's own XML, every test in it, and notes the stop in tests.log."""
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "conftest.py").write_text("import time\n\ndef pytest_unconfigure(config):\n    time.sleep(60)\n")
    t0 = time.time()
    rc = run.gpu_tests(str(out), _write_tests(tmp_path, 0), deadline=t0 + 12)
    assert rc == "stopped" and time.time() - t0 < 40
    suite, cases, props = _cases(str(out / "gpu-tests.xml"))
    assert "note" not in props and len(cases) == 8 and cases[("test_sample", "test_zz_slow")] == "passed"
    log = (out / "tests.log").read_text()
    assert "after pytest had written" in log and "kept" in log


def test_shard_balances_by_time_and_keeps_order():
    files = ["tests/test_a.py", "tests/test_b.py", "tests/test_c.py", "tests/test_d.py", "tests/test_e.py"]
    seconds = {"test_a.py": 100.0, "test_b.py": 60.0, "test_c.py": 50.0, "test_d.py": 45.0}  # test_e: the default
    groups = run.shard(files, 2, seconds, default=5.0)
    assert sorted(f for g in groups for f in g) == files  # each file once
    # longest first onto the lighter group: a | b, c (110) | a, d (145) | b, c, e (115)
    assert groups == [["tests/test_a.py", "tests/test_d.py"], ["tests/test_b.py", "tests/test_c.py", "tests/test_e.py"]]
    assert run.shard(files[:1], 4, seconds) == [["tests/test_a.py"]]  # no empty groups
    assert run.shard(files, 1) == [files]


def test_file_seconds_sums_per_module(tmp_path):
    xml = tmp_path / "t.xml"
    xml.write_text('<testsuites><testsuite><testcase classname="tests.test_a" name="x" time="1.5"/>'
                   '<testcase classname="tests.test_a.TestB" name="y" time="2"/>'
                   '<testcase classname="tests.test_b" name="z" time="0.25"/></testsuite></testsuites>')
    assert run.file_seconds(str(xml)) == {"test_a.py": 3.5, "test_b.py": 0.25}
    assert run.file_seconds(str(tmp_path / "missing.xml")) == {}


def test_list_test_files_expands_directories(tmp_path):
    (tmp_path / "test_b.py").write_text("")
    (tmp_path / "test_a.py").write_text("")
    (tmp_path / "util.py").write_text("")
    assert run.list_test_files(f"{tmp_path},x/test_c.py::test_n") == [
        str(tmp_path / "test_a.py"), str(tmp_path / "test_b.py"), "x/test_c.py::test_n"]


def _two_files(tmp_path, sleep):
    a = _write_tests(tmp_path, sleep)
    b = tmp_path / "test_other.py"
    b.write_text("import pytest\n\npytestmark = pytest.mark.gpu\n\n"
                 "@pytest.mark.parametrize('n', range(3))\ndef test_more(n):\n    assert n != 2\n")
    return a, str(b)


def test_gpu_tests_in_parallel_parts_merged(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    a, b = _two_files(tmp_path, 0)
    rc = run.gpu_tests(str(out), f"{a},{b}", jobs=2, times=None)
    assert rc == 1
    suite, cases, props = _cases(str(out / "gpu-tests.xml"))
    assert "note" not in props and len(cases) == 11
    assert cases[("test_other", "test_more[1]")] == "passed" and cases[("test_other", "test_more[2]")] == "failure"
    assert cases[("test_sample", "test_teardown")] == "error"
    counts = tuple(suite.get(k) for k in ("tests", "failures", "errors", "skipped"))
    assert counts == ("11", "2", "1", "2")
    assert len(junit.results(junit.read_stream(str(out / "tests.jsonl")))) == 11
    log = (out / "tests.log").read_text()
    assert "2 pytest processes" in log and "part 1" in log
    assert "6 passed, 2 failed, 1 errors, 2 skipped (11 tests)" in log
    assert (out / "gpu-tests.part0.xml").is_file() and (out / "gpu-tests.part1.xml").is_file()


def test_gpu_tests_in_parallel_stopped_at_the_deadline(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    a, b = _two_files(tmp_path, 120)
    t0 = time.time()
    rc = run.gpu_tests(str(out), f"{a},{b}", deadline=t0 + 12, jobs=2, times=None)
    assert rc == "stopped" and time.time() - t0 < 40
    suite, cases, props = _cases(str(out / "gpu-tests.xml"))
    assert props["note"].startswith("stopped by the time limit")
    assert ("test_sample", "test_zz_slow") not in cases and len(cases) == 10  # the other part finished whole
    assert cases[("test_other", "test_more[0]")] == "passed"


def test_gpu_tests_in_parallel_one_gpu_each(tmp_path, monkeypatch):
    """Parts run on the visible GPUs in turn: each part's CUDA_VISIBLE_DEVICES, as the tests see it."""
    out = tmp_path / "out"
    out.mkdir()
    for name in ("a", "b", "c"):
        (tmp_path / f"test_{name}.py").write_text(
            "import os, pytest\n\npytestmark = pytest.mark.gpu\n\n"
            f"def test_device():\n    assert False, 'part {name} on ' + os.environ['CUDA_VISIBLE_DEVICES']\n")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert run.visible_devices() == ["3", "5"]
    paths = ",".join(str(tmp_path / f"test_{n}.py") for n in "abc")
    assert run.gpu_tests(str(out), paths, jobs=3, times=None) == 1
    messages = " ".join(junit.results(junit.read_stream(str(out / "tests.jsonl")))[k][2]
                        for k in junit.results(junit.read_stream(str(out / "tests.jsonl"))))
    assert "part a on 3" in messages and "part b on 5" in messages and "part c on 3" in messages


def test_part_test_files_split_every_file_once(tmp_path):
    for name in ("a", "b", "c", "d"):
        (tmp_path / f"test_{name}.py").write_text("")
    seconds = {"test_a.py": 50.0, "test_b.py": 40.0, "test_c.py": 30.0}  # test_d: no GPU tests (1 s)
    parts = [run.part_test_files(str(tmp_path), f"{k}/2", seconds) for k in (1, 2)]
    assert sorted(f for p in parts for f in p) == [str(tmp_path / f"test_{n}.py") for n in "abcd"]
    assert parts[0] == [str(tmp_path / "test_a.py"), str(tmp_path / "test_d.py")]  # 51 s against 70 s
    assert run.part_test_files(str(tmp_path), "3/3", {"test_a.py": 1.0}) != []  # each of 3 parts gets a file
    assert run.part_test_files(str(tmp_path / "test_a.py"), "2/2", seconds) == []  # fewer files than parts
    for bad in ("0/2", "3/2", "1", "a/b"):
        with pytest.raises(ValueError, match="test part"):
            run.part_test_files(str(tmp_path), bad, seconds)


def test_committed_test_times_cover_every_gpu_test_file():
    """bench/test_times.json (the weights of --test-part) names every test file that has GPU tests."""
    import ast

    times = run.load_test_times()
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
    for name in sorted(os.listdir(root)):
        if not (name.startswith("test_") and name.endswith(".py")):
            continue
        tree = ast.parse(open(os.path.join(root, name)).read())
        marked = any(isinstance(n, ast.Attribute) and n.attr == "gpu" for n in ast.walk(tree))
        if marked:
            assert name in times, f"{name} has GPU tests but no time in bench/test_times.json"
    assert all(v >= 0 for v in times.values()) and sum(times.values()) > 300


def test_run_all_rejects_a_bad_part_before_running(tmp_path):
    with pytest.raises(ValueError, match="test part"):
        run.run_all(str(tmp_path / "out"), [], tests="tests", do_precompile=False, test_part="2/1")
    assert not (tmp_path / "out" / "gpu-tests.xml").exists()


def test_times_and_merge_commands(tmp_path, capsys):
    from bench.__main__ import main

    a, b = tmp_path / "a.xml", tmp_path / "b.xml"
    a.write_text('<testsuites><testsuite tests="2" time="3.0"><testcase classname="tests.test_a" name="x" time="1"/>'
                 '<testcase classname="tests.test_a" name="y" time="2"><skipped/></testcase></testsuite></testsuites>')
    b.write_text('<testsuites><testsuite tests="1" time="5.0"><testcase classname="tests.test_b" name="z" time="5">'
                 '<failure message="no"/></testcase></testsuite></testsuites>')
    assert main(["test-times", str(a), str(b), "--out", str(tmp_path / "t.json")]) == 0
    assert json.loads((tmp_path / "t.json").read_text()) == {"test_a.py": 3.0, "test_b.py": 5.0}
    assert main(["junit", "--merge", str(tmp_path / "m.xml"), str(a), str(b), "--note", "two parts"]) == 0
    suite, cases, props = _cases(str(tmp_path / "m.xml"))
    assert props["note"] == "two parts" and cases == {("test_a", "x"): "passed", ("test_a", "y"): "skipped",
                                                      ("test_b", "z"): "failure"}
    counts = tuple(suite.get(k) for k in ("tests", "failures", "skipped", "time"))
    assert counts == ("3", "1", "1", "8.000")
    assert "1 passed, 1 failed, 0 errors, 1 skipped (3 tests) from 2 parts" in capsys.readouterr().out
    # --replace: a later run's outcome of the same id takes its place; other ids stay
    c = tmp_path / "c.xml"
    c.write_text('<testsuites><testsuite tests="2" time="4.0"><testcase classname="tests.test_b" name="z" time="3"/>'
                 '<testcase classname="tests.test_c" name="w" time="1"><skipped/></testcase></testsuite></testsuites>')
    assert main(["junit", "--merge", str(tmp_path / "r.xml"), str(tmp_path / "m.xml"), str(c), "--replace"]) == 0
    suite, cases, _ = _cases(str(tmp_path / "r.xml"))
    assert cases == {("test_a", "x"): "passed", ("test_a", "y"): "skipped", ("test_b", "z"): "passed",
                     ("test_c", "w"): "skipped"}
    assert [c.get("name") for c in suite.iter("testcase")] == ["x", "y", "z", "w"]
    counts = tuple(suite.get(k) for k in ("tests", "failures", "skipped", "time"))
    assert counts == ("4", "0", "2", "7.000")


def test_read_paths_from_a_file(tmp_path):
    listing = tmp_path / "list.txt"
    listing.write_text("tests/test_a.py\ntests/test_b.py::test_x,--deselect=tests/test_b.py::test_y\n\n")
    assert run.read_paths(f"@{listing}") == "tests/test_a.py,tests/test_b.py::test_x,--deselect=tests/test_b.py::test_y"
    assert run.read_paths("tests") == "tests"
