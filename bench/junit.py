"""Test outcomes that survive a stopped run: a pytest plugin that appends each test's outcome to a file as it is
known, and that file turned into JUnit XML.

pytest writes its --junitxml when its run ends, so a run stopped by a time limit leaves no XML at all, even
after thousands of tests. `python -m bench all` loads this module as a plugin (`-p bench.junit`) with
CUFLASH_TEST_STREAM=<file>: every test's outcome goes to that file as one JSON line, flushed at once. When pytest
does not finish, `stream_to_junit` writes the XML of the tests that did run, marked as stopped:

    python -m bench junit STREAM.jsonl OUT.xml [--note TEXT]

and merges the XML of runs made in parts (`python -m bench all --test-part K/N`) into one:

    python -m bench junit --merge OUT.xml PART1.xml PART2.xml ... [--note TEXT]

A record: {"nodeid", "when" ("setup" / "call" / "teardown"), "outcome" ("passed" / "failed" / "skipped"),
"duration" (s), "message" (a skip's reason, a failure's last 2000 characters)}. A test's result is its call phase,
or the setup phase when that skipped or failed (the call then never runs); a failed teardown is an error.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import xml.etree.ElementTree as ET

STREAM_ENV = "CUFLASH_TEST_STREAM"
MESSAGE_CHARS = 2000


# ------------------------------------------------------------------------------------------- the plugin
def _message(report) -> str:
    if report.skipped and isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
        return str(report.longrepr[2])  # (path, line, reason)
    return str(report.longrepr)[-MESSAGE_CHARS:] if report.longrepr else ""


def pytest_runtest_logreport(report):
    path = os.environ.get(STREAM_ENV)
    if not path:
        return
    if report.when == "call" or (report.when == "setup" and not report.passed) or \
            (report.when == "teardown" and report.failed):
        rec = dict(nodeid=report.nodeid, when=report.when, outcome=report.outcome,
                   duration=round(float(report.duration), 4))
        if not report.passed:
            rec["message"] = _message(report)
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")


# ------------------------------------------------------------------------------------------- the XML
def read_stream(path) -> list:
    """The records of a stream file, one per line; a last line cut off mid-write is dropped."""
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def _names(nodeid: str):
    """pytest's JUnit names: 'tests/test_a.py::TestB::test_c[x]' -> ('tests.test_a.TestB', 'test_c[x]')."""
    parts = nodeid.split("::")
    module = parts[0][:-3] if parts[0].endswith(".py") else parts[0]
    return ".".join([module.replace("/", ".").replace("\\", ".")] + parts[1:-1]), parts[-1]


def results(records) -> dict:
    """{nodeid: (status, duration, message)} with status 'passed', 'failed', 'error' or 'skipped', in the order the
    tests first appear."""
    out = {}
    for r in records:
        nid, when, outcome = r["nodeid"], r["when"], r["outcome"]
        status, dur, msg = out.get(nid, ("passed", 0.0, ""))
        dur += float(r.get("duration", 0.0))
        if when == "teardown":  # only failed teardowns are recorded
            status, msg = "error", r.get("message", "")
        elif when == "setup":
            status, msg = ("skipped" if outcome == "skipped" else "error"), r.get("message", "")
        elif status != "error":  # the call phase
            status, msg = outcome, r.get("message", "")
        out[nid] = (status, dur, msg)
    return out


def stream_to_junit(stream, xml_path, note: str | None = None) -> dict:
    """Write the JUnit XML of a stream file (one testsuite; `note`, e.g. why the run stopped, as its property
    'note'). Returns the counts {'tests', 'passed', 'failures', 'errors', 'skipped'}."""
    res = results(read_stream(stream))
    counts = dict(tests=len(res), passed=0, failures=0, errors=0, skipped=0)
    total = 0.0
    suite = ET.Element("testsuite", name="pytest")
    if note:
        props = ET.SubElement(suite, "properties")
        ET.SubElement(props, "property", name="note", value=note)
    for nid, (status, dur, msg) in res.items():
        cls, name = _names(nid)
        case = ET.SubElement(suite, "testcase", classname=cls, name=name, time=f"{dur:.3f}")
        total += dur
        if status == "passed":
            counts["passed"] += 1
        elif status == "skipped":
            counts["skipped"] += 1
            ET.SubElement(case, "skipped", type="pytest.skip", message=msg[:500])
        elif status == "failed":
            counts["failures"] += 1
            ET.SubElement(case, "failure", message=msg.strip().splitlines()[-1][:500] if msg.strip() else "").text = msg
        else:
            counts["errors"] += 1
            ET.SubElement(case, "error", message=msg.strip().splitlines()[-1][:500] if msg.strip() else "").text = msg
    suite.set("errors", str(counts["errors"]))
    suite.set("failures", str(counts["failures"]))
    suite.set("skipped", str(counts["skipped"]))
    suite.set("tests", str(counts["tests"]))
    suite.set("time", f"{total:.3f}")
    root = ET.Element("testsuites", name="pytest tests")
    root.append(suite)
    ET.ElementTree(root).write(xml_path, encoding="utf-8", xml_declaration=True)
    return counts


def complete_xml(xml_path, stream) -> bool:
    """Whether pytest's own --junitxml at `xml_path` was written whole for every test of the stream (a run stopped
    after pytest wrote it, while the interpreter was still exiting): it parses and holds as many test cases."""
    try:
        root = ET.parse(xml_path).getroot()
    except (OSError, ET.ParseError):
        return False
    return sum(1 for _ in root.iter("testcase")) == len(results(read_stream(stream)))


def merge_xml(parts, xml_path, note=None, at_once=False, replace=False) -> dict:
    """The JUnit XML files `parts` (one pytest process each) as one testsuite at xml_path: every test case in the
    parts' order, counts summed, time the parts' sum (or, `at_once`: they ran at the same time, the longest part's),
    `note` as property 'note'. `replace`: the parts are runs of different times, and a test id (classname, name)
    that a later part holds takes that part's outcome, in the place of its first appearance (e.g. the whole suite,
    then the files run again on a newer tree). Returns the counts as stream_to_junit does."""
    suite = ET.Element("testsuite", name="pytest")
    if note:
        ET.SubElement(ET.SubElement(suite, "properties"), "property", name="note", value=note)
    cases, longest, total = {}, 0.0, 0.0
    for n, part in enumerate(parts):
        root = ET.parse(part).getroot()
        for s in ([root] if root.tag == "testsuite" else root.iter("testsuite")):
            longest = max(longest, float(s.get("time") or 0.0))
            total += float(s.get("time") or 0.0)
            for case in s.iter("testcase"):
                cases[(case.get("classname"), case.get("name")) if replace else (n, len(cases))] = case
    counts = dict(tests=0, passed=0, failures=0, errors=0, skipped=0)
    for case in cases.values():
        suite.append(case)
        kinds = {k.tag for k in case}
        key = ("failures" if "failure" in kinds else "errors" if "error" in kinds else
               "skipped" if "skipped" in kinds else "passed")
        counts[key] += 1
        counts["tests"] += 1
    if replace:
        total = sum(float(c.get("time") or 0.0) for c in cases.values())
    for k in ("errors", "failures", "skipped", "tests"):
        suite.set(k, str(counts[k]))
    suite.set("time", f"{longest if at_once else total:.3f}")
    root = ET.Element("testsuites", name="pytest tests")
    root.append(suite)
    ET.ElementTree(root).write(xml_path, encoding="utf-8", xml_declaration=True)
    return counts


def summary(counts: dict) -> str:
    return (f"{counts['passed']} passed, {counts['failures']} failed, {counts['errors']} errors, "
            f"{counts['skipped']} skipped ({counts['tests']} tests)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench junit", description=__doc__.split("\n\n")[0])
    ap.add_argument("stream", nargs="?", help=f"the JSON-lines file a run wrote through {STREAM_ENV}")
    ap.add_argument("xml", nargs="?", help="the JUnit XML to write")
    ap.add_argument("--merge", nargs="+", metavar="XML", default=None,
                    help="OUT.xml A.xml B.xml ...: the XML of runs one after another (e.g. python -m bench all "
                         "--test-part 1/2, then 2/2) as one testsuite in OUT.xml")
    ap.add_argument("--replace", action="store_true",
                    help="with --merge: a test id that a later part holds takes that part's outcome (parts run at "
                         "different times, e.g. the whole suite, then some files again on a newer tree)")
    ap.add_argument("--note", default=None, help="a testsuite property 'note' (e.g. where the run stopped)")
    args = ap.parse_args(argv)
    if args.merge:
        if len(args.merge) < 2 or args.stream or args.xml:
            ap.error("--merge takes OUT.xml and at least one part's XML, and no stream")
        out, parts = args.merge[0], args.merge[1:]
        counts = merge_xml(parts, out, args.note, replace=args.replace)
        print(f"{out}: {summary(counts)} from {len(parts)} parts")
        return 0
    if not (args.stream and args.xml):
        ap.error("give STREAM and XML, or --merge OUT.xml PARTS...")
    counts = stream_to_junit(args.stream, args.xml, args.note)
    print(f"{args.xml}: {summary(counts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
