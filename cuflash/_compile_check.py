"""Compile every kernel configuration the package can launch, without a GPU, and read ptxas' report.

Used by CI (tests/test_compile.py) and by hand: `python -m cuflash._compile_check` prints a table of
registers / stack / spills per kernel for sm_80 and sm_90.
"""
from __future__ import annotations

import sys
from collections import defaultdict

ARCHS = (80, 90)


def specs_by_file(specs=None):
    if specs is None:
        from ._configs import all_specs

        specs = all_specs()
    by_file = defaultdict(list)
    for s in specs:
        if s.name not in by_file[s.filename]:
            by_file[s.filename].append(s.name)
    return by_file


def resource_report(arch: int, specs=None) -> dict:
    """{name_expression: {"regs", "stack", "spill_st", "spill_ld", "lowered"}} for one arch."""
    from ._loader import compile_offline

    report = {}
    for filename, names in specs_by_file(specs).items():
        report.update(compile_offline(filename, names, arch)["kernels"])
    return report


def main() -> int:
    bad = 0
    for arch in ARCHS:
        for name, info in resource_report(arch).items():
            flag = "" if info.get("stack", 1) == 0 and info.get("spill_st", 1) == 0 else "  <-- SPILL/LOCAL"
            bad += bool(flag)
            print(f"sm_{arch} regs={info.get('regs', '?'):>3} stack={info.get('stack', '?'):>4} "
                  f"spill={info.get('spill_st', '?')}/{info.get('spill_ld', '?')}  {name}{flag}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
