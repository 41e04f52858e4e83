"""CPU: the parsers of two diagnostics -- bench.diag.sass_fp64 (FP64 instructions of a kernel's SASS, and those
inside a loop) on hand-written SASS, and bench.diag.ncu_sass_summary's table of the instructions that hold the most
stall samples on a hand-written Nsight Compute source table. The scan on real kernels (none has an FP64 instruction
since the parameter blocks' scalars are float32): tests/test_fp64_sass_cpu.py."""
from __future__ import annotations

import csv

from bench.diag import ncu_sass_summary, sass_fp64


def _sass(lines):
    return "\n".join(f"        /*{addr:04x}*/ {text} ;  /* 0x0 */" for addr, text in lines)


def test_fp64_scan_separates_loops():
    sass = _sass([
        (0x10, "F2F.F32.F64 R3, UR8"),                         # before any loop
        (0x20, "HGMMA.64x128x16.F32 R24, gdesc[UR16], R24"),   # loop 1 starts here
        (0x30, "@!P2 DSETP.LEU.AND P0, PT, R8, |UR16|, PT"),
        (0x40, "WARPGROUP.DEPBAR.LE gsb0, 0x1"),               # not FP64 (DEPBAR)
        (0x50, "FFMA.FTZ R15, R89, UR6, -R13"),
        (0x60, "@P0 BRA 0x20"),                                # backward branch: loop [0x20, 0x60]
        (0x70, "DFMA R2, R4, R6, R2"),                         # after it
        (0x80, "@P1 BRA 0x90"),                                # forward branch: no loop
        (0x90, "EXIT"),
    ])
    every, looped = sass_fp64.fp64_in_loops(sass)
    assert [a for a, _ in every] == [0x10, 0x30, 0x70]
    assert looped == [(0x30, "@!P2 DSETP.LEU.AND P0, PT, R8, |UR16|, PT")]


def test_top_stalls_table(tmp_path):
    cols = ["Address", "Source", ncu_sass_summary.SAMPLES, ncu_sass_summary.EXECUTED, "stall_math", "stall_wait",
            "stall_math (Not Issued)"]
    rows = [["0x0", "FFMA R1, R2, R3, R4", "10", "100", "2", "8", "0"],
            ["0x10", "@!P2 DSETP.LEU.AND P0, PT, R8, |UR16|, PT", "70", "100", "65", "5", "0"],
            ["0x20", "MUFU.EX2 R5, R5", "20", "100", "0", "20", "0"]]
    path = tmp_path / "t_sass.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "k"])
        w.writerow(cols)
        w.writerows(rows)
    out = ncu_sass_summary.top_stalls(str(path), 2)
    assert out[0] == "the 2 instructions with the most stall samples:"
    assert "DSETP" in out[1] and "70.0%" in out[1] and "x100" in out[1] and "math 65, wait 5" in out[1]
    assert "MUFU.EX2" in out[2] and "20.0%" in out[2] and "wait 20" in out[2] and "math" not in out[2]
