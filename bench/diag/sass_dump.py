"""Diagnostic (CPU, offline NVRTC compile): dump the SASS of package kernels and count their opcodes:
python -m bench.diag.sass_dump OUT_DIR.

Answers without a GPU: are the matrix instructions HMMA, the loads LDSM / LDGSTS, the exps
MUFU.EX2, and is there any local memory (LDL / STL)?"""
from __future__ import annotations

import collections
import os
import sys


def dump(spec, arch=90) -> str:
    from cuflash import _loader

    from ..bench_micro import cubin_sass

    sass, status = cubin_sass(_loader.compile_offline(spec.filename, [spec.name], arch)["cubin"])
    return sass if sass is not None else f"cuobjdump {status}"


def opcode_counts(sass: str) -> collections.Counter:
    c = collections.Counter()
    for line in sass.splitlines():
        parts = line.strip().split("*/")
        if len(parts) >= 2 and parts[0].startswith("/*") and parts[1].strip():
            op = parts[1].strip().split()[0]
            if op.startswith("@"):
                op = parts[1].strip().split()[1]
            c[op.split(".")[0]] += 1
    return c


def main(out_dir):
    from cuflash._configs import bwd_spec, fwd_spec

    os.makedirs(out_dir, exist_ok=True)
    for name, spec in (("fwd_d128", fwd_spec("float16", 128, False, False)),
                       ("fwd_d64", fwd_spec("float16", 64, False, False)),
                       ("bwd_d128", bwd_spec("float16", 128, False)),
                       ("bwd_q_d128", bwd_spec("float16", 128, False, warp_partition="q"))):
        text = dump(spec)
        open(os.path.join(out_dir, f"{name}.sass"), "w").write(text)
        print(name, dict(opcode_counts(text).most_common(25)))


if __name__ == "__main__":
    main(sys.argv[1])
