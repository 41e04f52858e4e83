"""Merge the results.json of several runs into one: python -m bench merge OUT_DIR SRC[:suites] ...

Each SRC is a results.json (or the folder holding it), optionally followed by ':' and a comma list of the
sections to take from it; `name=new` takes section `name` and files it as section `new` (a second run of a
suite, kept next to the first). Records keep the header of their own run: the merged header lists the runs'
headers under `runs` and every record's `run` indexes that list (a ratio to SDPA is only ever formed inside one
run). The report (results.md, plots) is written for the merged set."""
from __future__ import annotations

import json
import os
import sys


def load(src: str):
    path, _, secs = src.partition(":")
    if os.path.isdir(path):
        path = os.path.join(path, "results.json")
    with open(path) as f:
        data = json.load(f)
    rename = dict(s.partition("=")[::2] for s in secs.split(",")) if secs else None
    recs = []
    for r in data["records"]:
        if rename is None:
            recs.append(r)
        elif r.get("section") in rename:
            recs.append(dict(r, section=rename[r["section"]] or r["section"]))
    return data["header"], recs


def merge(srcs):
    """(merged header, records) of the sources, in order."""
    runs, records = [], []
    for src in srcs:
        head, recs = load(src)
        first = len(runs)
        if head.get("runs"):  # an already merged file: keep its runs, renumbered after the ones so far
            runs += [dict(r) for r in head["runs"]]
        else:
            runs.append(dict(head))
        for r in recs:
            r = dict(r)
            r["run"] = first + r.get("run", 0)
            records.append(r)
    head = dict({k: v for k, v in runs[0].items() if k != "runs"}, runs=runs)
    return head, records


def main(argv=None):
    from . import report

    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2 or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    out_dir, srcs = argv[0], argv[1:]
    head, records = merge(srcs)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(dict(header=head, records=records), f, indent=1)
    report.write_all(head, records, out_dir)
    print(f"{len(records)} records from {len(srcs)} sources -> {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
