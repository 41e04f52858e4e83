"""Diagnostic (GPU, under Nsight Compute): the decode kernel on the large decode step (b8, 32 heads, 32 KV heads,
16k cache, d128, fp16: 2 GiB of K/V, one split), launched twice (a warm-up, then the call to profile):

    ncu --clock-control none -k regex:flash_decode_kernel --launch-skip 1 --launch-count 1 --section SchedulerStats \\
        --section WarpStateStats --section MemoryWorkloadAnalysis --section Occupancy python -m bench.diag.ncu_decode
    bench/diag/ncu_source.sh /tmp/decode flash_decode_kernel 1 python3 -m bench.diag.ncu_decode   # per SASS line

What to read: the warps' stall reasons (WarpStateStats: "Long Scoreboard" at the DEPBAR of the ring's wait against
the products' "Math Pipe Throttle" / "Short Scoreboard" / "MIO Throttle"), issue slots busy per scheduler (one warp
per scheduler), DRAM throughput and L2 hit rate, and per SASS line (ncu_source.sh) where the samples fall."""
from __future__ import annotations

import sys


def main(argv) -> int:
    import torch

    from cuflash.decode import plan_for, run_plan

    b, h, hk, s, d = 8, 32, 32, 16384, 128
    kc = torch.randn(b, s, hk, d, device="cuda", dtype=torch.float16)
    vc = torch.randn_like(kc)
    q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.float16)
    seqlens = torch.full((b,), s, dtype=torch.int32, device="cuda")
    plan = plan_for(q, kc, vc, cache_seqlens=seqlens)
    for _ in range(2):
        run_plan(plan, q, kc, vc, cache_seqlens=seqlens)
    torch.cuda.synchronize()
    print(f"decode b{b} h{h} hk{hk} s{s} d{d}: {plan.num_splits} split(s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
