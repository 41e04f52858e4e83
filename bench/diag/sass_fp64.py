"""Diagnostic (CPU: offline NVRTC compile, SASS by cuobjdump): the FP64 instructions of the launchable kernels, and
which of them lie inside a loop (a range from a backward branch's target to the branch):

    python -m bench.diag.sass_fp64 [--files REGEX] [--names REGEX] [--jobs 2]

When the parameter blocks' float scalars (scale_log2, softmax_scale, softcap_pre, alibi_mul, dropout_scale) were
doubles, device code converted them: F2F.F32.F64 and, under -ftz, an FP64 compare (DSETP, the denormal test). Where
ptxas put a pair inside a main loop it cost: in the Hopper backward's score-modifier kernel at head dim 64 one such
DSETP, issued right after the S^T / dP^T wgmma, held 10% of the kernel's warp-stall samples on the math pipe
(bench/NOTES.md, "Score modifiers"). They are float32 slots now, and this scan finds no FP64 instruction in any kernel
(tests/test_fp64_sass_cpu.py checks a sample). One line per kernel with FP64 inside a loop: its FP64 instruction
count, how many are in loops, the first few; the
sm90 kernels compile for sm_90a, the rest for sm_90."""
from __future__ import annotations

import argparse
import re
from concurrent.futures import ProcessPoolExecutor

_INS = re.compile(r"/\*([0-9a-f]{4,})\*/\s*(.*?)\s*;")
_FP64 = re.compile(r"(?:^|\s)(?:D(?:ADD|MUL|FMA|SETP|MNMX|SET)|F2F\.\S*F64|I2F\.\S*F64|F2I\.\S*F64|DMMA)\b")
_BRA = re.compile(r"\bBRA\s+(?:`\()?0x([0-9a-f]+)")


def fp64_in_loops(sass: str) -> tuple:
    """(every FP64 instruction, those inside a loop) of one kernel's SASS, as (address, text) pairs."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in _INS.finditer(sass)]
    loops = []
    for addr, text in ins:
        m = _BRA.search(text)
        if m and int(m.group(1), 16) < addr:
            loops.append((int(m.group(1), 16), addr))
    fp64 = [(a, t) for a, t in ins if _FP64.search(t)]
    return fp64, [(a, t) for a, t in fp64 if any(lo <= a <= hi for lo, hi in loops)]


def _one(spec):
    from .sass_dump import dump

    sass = dump(spec, "90a" if spec.arch_suffix == "a" else 90)
    if sass.startswith("cuobjdump "):  # (dump's text when cuobjdump is missing or fails)
        return spec.name, sass
    return spec.name, fp64_in_loops(sass)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", default="", help="regex on the kernel source file names")
    ap.add_argument("--names", default="", help="regex on the kernels' name expressions")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args(argv)
    from cuflash import _configs

    specs = [s for s in _configs.all_specs() if re.search(args.files, s.filename) and re.search(args.names, s.name)]
    print(f"{len(specs)} kernels", flush=True)
    hit = 0
    with ProcessPoolExecutor(args.jobs) as ex:
        for name, res in ex.map(_one, specs):
            if isinstance(res, str):
                print(f"{name}: {res}")
                continue
            every, looped = res
            if looped:
                hit += 1
                print(f"{name}: {len(every)} FP64, {len(looped)} in loops: "
                      + "; ".join(f"{a:#x} {t}" for a, t in looped[:4]), flush=True)
    print(f"{hit} of {len(specs)} kernels with FP64 instructions inside a loop")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
