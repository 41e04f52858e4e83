"""Diagnostic (CPU): a summary of the per-instruction table that bench/diag/ncu_source.sh writes (OUT_sass.csv):
the share of each warp-stall reason, the main loop (the span of the instructions executed most often, at least
--min-loop of them at one count) and its share of the samples, each wgmma wait in it (WARPGROUP.DEPBAR) with its share, and where the
softmax's exponentials (MUFU.EX2) lie in the loop's instruction order -- e.g. whether the wait for O += P V comes
before or after them; with --opcodes, the executed (warp) instructions by opcode per MUFU.EX2 executed (per score in
the attention kernels, which take one exponential per score), and each opcode's share of the stall samples; with
--top, the instructions that hold the most stall samples, each with its three largest reasons (an FP64 compare that
held 10% of a kernel's samples, stalled on the math pipe, was found so):

    python -m bench.diag.ncu_sass_summary /tmp/p_sass.csv [--label TEXT] [--min-loop 300] [--opcodes 16] [--top 12]"""
from __future__ import annotations

import argparse
import csv

SAMPLES, EXECUTED = "Warp Stall Sampling (All Samples)", "Instructions Executed"


def _table(path: str):
    """(rows with every column, {column: index}, the stall-reason columns, num(row, column) -> int) of a table."""
    rows = list(csv.reader(open(path)))
    hdr = rows[1]
    ix = {h: i for i, h in enumerate(hdr)}
    data = [r for r in rows[2:] if len(r) >= len(hdr)]
    stall_cols = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    return data, ix, stall_cols, lambda r, c: int(r[ix[c]] or 0)


def summary(path: str, min_loop: int = 300) -> list:
    """The summary's lines for one table."""
    data, ix, stall_cols, num = _table(path)
    total = sum(num(r, SAMPLES) for r in data)
    if not total:
        return [f"{path}: no stall samples"]
    by_reason = sorted(((sum(num(r, c) for r in data), c[len("stall_"):]) for c in stall_cols), reverse=True)
    out = [f"stall samples {total}; reasons: " + ", ".join(f"{n_} {s / total * 100:.1f}%" for s, n_ in by_reason[:8])]
    counts = [num(r, EXECUTED) for r in data]
    loop_n = max((n for n in set(counts) if n and counts.count(n) >= min_loop), default=None)
    if loop_n is None:
        return out + [f"no count shared by {min_loop} instructions (no main loop found)"]
    # the loop's span: from the first to the last instruction executed loop_n times (branch arms inside it run
    # fewer times and are counted in it)
    first = counts.index(loop_n)
    last = len(counts) - 1 - counts[::-1].index(loop_n)
    loop = data[first:last + 1]
    share = sum(num(r, SAMPLES) for r in loop) / total * 100
    out.append(f"main loop (from the first to the last instruction executed {loop_n} times): {len(loop)} "
               f"instructions, {share:.1f}% of the samples")
    for k, r in enumerate(loop):
        src = r[ix["Source"]].strip()
        if "WARPGROUP.DEPBAR" in src:
            out.append(f"  loop instruction {k}: {src.split(';')[0]:32s} {num(r, SAMPLES) / total * 100:4.1f}% of the "
                       f"samples (executed {num(r, EXECUTED)} times)")
    ex2 = [k for k, r in enumerate(loop) if "MUFU.EX2" in r[ix["Source"]]]
    if ex2:
        out.append(f"  MUFU.EX2 (the softmax's exponentials): loop instructions {ex2[0]}-{ex2[-1]}")
    return out


def opcode_mix(path: str, top: int = 16) -> list:
    """Lines: executed warp instructions per MUFU.EX2 executed, in all and by opcode (MUFU by function, others by
    their first name), with each opcode's share of the stall samples; the `top` opcodes by count."""
    rows = list(csv.reader(open(path)))
    hdr = rows[1]
    ix = {h: i for i, h in enumerate(hdr)}
    count, samples = {}, {}
    for r in rows[2:]:
        if len(r) < len(hdr):
            continue
        toks = r[ix["Source"]].split()
        if not toks:
            continue
        op = toks[1] if toks[0].startswith("@") and len(toks) > 1 else toks[0]
        op = op if op.startswith("MUFU") else op.split(".")[0]
        count[op] = count.get(op, 0) + int(r[ix[EXECUTED]] or 0)
        samples[op] = samples.get(op, 0) + int(r[ix[SAMPLES]] or 0)
    ex2, total, stalls = count.get("MUFU.EX2", 0), sum(count.values()), sum(samples.values()) or 1
    if not ex2:
        return [f"{path}: no MUFU.EX2 executed"]
    out = [f"executed warp instructions {total}, per MUFU.EX2 {total / ex2:.2f}"]
    for op in sorted(count, key=lambda o: -count[o])[:top]:
        out.append(f"  {op:14s} {count[op] / ex2:6.2f} per MUFU.EX2   "
                   f"{samples[op] / stalls * 100:5.1f}% of the samples")
    return out


def top_stalls(path: str, top: int = 12) -> list:
    """Lines: the `top` instructions by stall samples (index in the table, share of the samples, executions, the
    three largest reasons)."""
    data, ix, stall_cols, num = _table(path)
    total = sum(num(r, SAMPLES) for r in data) or 1
    out = [f"the {top} instructions with the most stall samples:"]
    for k in sorted(range(len(data)), key=lambda k: -num(data[k], SAMPLES))[:top]:
        r = data[k]
        why = sorted(((num(r, c), c[len("stall_"):]) for c in stall_cols), reverse=True)[:3]
        out.append(f"  {k:5d} {r[ix['Source']].strip().split(';')[0][:56]:56s} {num(r, SAMPLES) / total * 100:5.1f}%  "
                   f"x{num(r, EXECUTED)}  " + ", ".join(f"{n_} {s}" for s, n_ in why if s))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", nargs="+", help="OUT_sass.csv tables of bench/diag/ncu_source.sh")
    ap.add_argument("--label", action="append", default=[], help="a heading per table, in order")
    ap.add_argument("--min-loop", type=int, default=300)
    ap.add_argument("--opcodes", type=int, default=0, help="also the N most executed opcodes per MUFU.EX2")
    ap.add_argument("--top", type=int, default=0, help="also the N instructions with the most stall samples")
    args = ap.parse_args(argv)
    for i, path in enumerate(args.csv):
        print(f"## {args.label[i] if i < len(args.label) else path}")
        print("\n".join(summary(path, args.min_loop)))
        if args.opcodes:
            print("\n".join(opcode_mix(path, args.opcodes)))
        if args.top:
            print("\n".join(top_stalls(path, args.top)))
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
