"""Diagnostic (GPU, under Nsight Compute): the decode kernel on the large decode step (b8, 32 heads, 32 KV heads,
16k cache, d128, fp16: 2 GiB of K/V, one split), the default plan and the ring refilled before the wait
(plan_for(..., refill="early")), each launched twice (a warm-up, then the call to profile):

    ncu --clock-control none -k regex:flash_decode_kernel --section SchedulerStats --section WarpStateStats \\
        --section MemoryWorkloadAnalysis python -m bench.diag.ncu_decode   # launches 2 (default) and 4 (early)
    bench/diag/ncu_source.sh /tmp/decode flash_decode_kernel 1 python3 -m bench.diag.ncu_decode   # default, per SASS
    bench/diag/ncu_source.sh /tmp/decode_early flash_decode_kernel 3 python3 -m bench.diag.ncu_decode  # early

What to read: the warps' stall reasons (WarpStateStats: "Long Scoreboard" / "Barrier" at the DEPBAR of the ring's
wait against the products' "Math Pipe Throttle" / "Short Scoreboard"), issue slots busy per scheduler (one warp
per scheduler), and per SASS line (ncu_source.sh) where the samples fall: the wait before the refill (default) or
before the products (early)."""
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
    for refill in ("wait", "early"):
        plan = plan_for(q, kc, vc, cache_seqlens=seqlens, refill=refill)
        for _ in range(2):
            run_plan(plan, q, kc, vc, cache_seqlens=seqlens)
        print(f"refill={refill}: {plan.num_splits} split(s)", flush=True)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
