#!/usr/bin/env bash
# Diagnostic (GPU): per-instruction (SASS) stall sampling of one kernel launch with Nsight Compute, as CSV.
#   bench/diag/ncu_source.sh OUT_PREFIX KERNEL_REGEX LAUNCH_SKIP python -m MODULE [ARGS...]
# e.g. bench/diag/ncu_source.sh /tmp/bwd2d flash_bwd_kernel 1 python3 -m bench.diag.ncu_bwd 4096
# Writes OUT_PREFIX.ncu-rep (the report), OUT_PREFIX_sass.csv (one row per SASS instruction: executed
# instructions, warp-stall samples by reason) and OUT_PREFIX_stalls.txt (the kernel's WarpStateStats).
set -euo pipefail
out=$1 regex=$2 skip=$3
shift 3
ncu --clock-control none -k "regex:$regex" --launch-skip "$skip" --launch-count 1 \
    --section SourceCounters --section WarpStateStats --section InstructionStats -f -o "$out" "$@" > /dev/null
ncu -i "$out.ncu-rep" --page source --print-source sass --csv > "${out}_sass.csv"
ncu -i "$out.ncu-rep" --section WarpStateStats --section InstructionStats > "${out}_stalls.txt"
