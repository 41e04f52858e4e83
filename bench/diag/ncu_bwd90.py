"""Diagnostic (GPU, under Nsight Compute): the backward on Hopper, cuflash's sm90 kernels next to SDPA's cuDNN
backend on the same inputs (FA2 grid: batch x seqlen = 16k tokens, hidden 2048; fp16). Each provider's forward runs
outside the profiled range; its backward runs twice to warm up, then once between torch.cuda.profiler.start() and
stop(), so that ncu profiles every kernel of exactly that backward (cuflash: the dQ accumulator's clear, the
preprocess D = rowsum(dO * O), the main kernel, the dQ convert; cuDNN: whatever it launches):

    ncu --profile-from-start off --clock-control none --section SpeedOfLight --section ComputeWorkloadAnalysis \\
        --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section SchedulerStats \\
        python -m bench.diag.ncu_bwd90 --seqlen 16384 [--causal] [--headdim 128] [--what cuflash,cudnn]

    bench/diag/ncu_source.sh /tmp/bwd90 flash_bwd_sm90 2 python3 -m bench.diag.ncu_bwd90 --what cuflash --no-range

What to read: per kernel its duration, the tensor pipe's and shared memory's share of their peaks (wgmma with both
operands in shared memory at N = 64 reads 4 KB per 32 tensor-core cycles, shared memory's 128 bytes per cycle), the
warps' stall reasons; the clear / preprocess / convert kernels' durations against the main kernel's (they cost the
same at every seqlen of the grid, so their share is largest at 2k)."""
from __future__ import annotations

import argparse

WHAT = ("cuflash", "cudnn")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--headdim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--what", default=",".join(WHAT), help=f"comma list of {', '.join(WHAT)}")
    ap.add_argument("--no-range", action="store_true",
                    help="no profiler start / stop (for ncu -k ... --launch-skip: every launch is visible)")
    args = ap.parse_args(argv)
    what = [w for w in args.what.split(",") if w]
    bad = [w for w in what if w not in WHAT]
    if bad:
        raise ValueError(f"--what: unknown {bad}; choose from {WHAT}")
    if args.seqlen <= 0 or 16384 % args.seqlen or args.headdim not in (64, 96, 128, 256):
        raise ValueError(f"--seqlen must divide 16384 and --headdim be 64, 96, 128 or 256; got {args.seqlen}, "
                         f"{args.headdim}")

    import torch

    import cuflash
    from bench.bench_bwd import _sdpa_inputs
    from bench.harness import sdpa

    s, d = args.seqlen, args.headdim
    h, b = 2048 // d, 16384 // s
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.float16) for _ in range(4))
    for x in (q, k, v):
        x.requires_grad_()
    calls = {}
    if "cuflash" in what:
        out = cuflash.flash_attn_func(q, k, v, causal=args.causal)
        calls["cuflash"] = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    if "cudnn" in what:
        qt, kt, vt, dt = _sdpa_inputs(q, k, v, dout)
        out_t = sdpa("cudnn")(qt, kt, vt, args.causal)
        calls["cudnn"] = lambda: torch.autograd.grad(out_t, (qt, kt, vt), dt, retain_graph=True)
    for name, fn in calls.items():
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        if not args.no_range:
            torch.cuda.profiler.start()
        fn()
        torch.cuda.synchronize()
        if not args.no_range:
            torch.cuda.profiler.stop()
        print(f"{name}: profiled one backward (b{b} h{h} s{s} d{d} causal={args.causal})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
