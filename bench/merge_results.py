"""Merge the results.json of several device calls into one: python -m bench.merge_results OUT_DIR SRC[:sections] ...

Each SRC is a results.json (or the folder holding it), optionally followed by ':' and a comma list of the
sections to take from it; `name=new` takes section `name` and files it as section `new` (a repeat of a section
in a later call, kept next to the first). Records keep their own call's header under `call` (a ratio to SDPA is
only ever formed inside one call), and the report (results.md, plots) is written for the merged set."""
from __future__ import annotations

import json
import os
import sys


def load(src: str):
    path, _, secs = src.partition(":")
    if os.path.isdir(path):
        path = os.path.join(path, "results.json")
    data = json.load(open(path))
    rename = dict(s.partition("=")[::2] for s in secs.split(",")) if secs else None
    recs = []
    for r in data["records"]:
        if rename is None:
            recs.append(r)
        elif r.get("section") in rename:
            recs.append(dict(r, section=rename[r["section"]] or r["section"]))
    return data["header"], recs


def main(argv):
    from . import report

    out_dir, srcs = argv[0], argv[1:]
    calls, records = [], []
    for src in srcs:
        head, recs = load(src)
        base = len(calls)
        if head.get("calls"):  # an already merged file: keep its calls, renumbered after the ones so far
            calls += [dict(c) for c in head["calls"]]
        else:
            calls.append(dict(head, source=src))
        for r in recs:
            r = dict(r)
            r["call"] = base + r.get("call", 0)
            records.append(r)
    head = dict({k: v for k, v in calls[0].items() if k != "calls"}, calls=calls)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(dict(header=head, records=records), f, indent=1)
    report.write_all(head, records, out_dir)
    print(f"{len(records)} records from {len(srcs)} calls -> {out_dir}")


if __name__ == "__main__":
    main(sys.argv[1:])
