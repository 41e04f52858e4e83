"""Diagnostic (GPU, under Nsight Compute): one backward per provider to profile: cuflash's configured kernel (and the "kv" partition)
next to SDPA FLASH's backward on the same inputs (fp16; default head dim 128, 4k tokens x 4, 16 heads;
`python -m bench.diag.ncu_bwd SEQLEN [causal|nc] [HEADDIM]`: batch x seqlen = 16k tokens, hidden 2048).

    ncu --clock-control none -k regex:"flash_bwd_kernel|dq_dk_dv" --launch-skip 0 \\
        --section SpeedOfLight --section SchedulerStats --section WarpStateStats --section InstructionStats \\
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables python -m bench.diag.ncu_bwd

Each provider runs twice (warm-up, then the call to read); both are profiled."""
from __future__ import annotations

import sys


def main(argv):
    import torch

    import cuflash

    s = int(argv[0]) if argv else 4096
    causal = len(argv) > 1 and argv[1] == "causal"
    d = int(argv[2]) if len(argv) > 2 else 128
    h, b = 2048 // d, 16384 // s
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.float16) for _ in range(4))
    for x in (q, k, v):
        x.requires_grad_()
    for part in ("auto", "kv"):
        for _ in range(2):
            out = cuflash.flash_attn_func(q, k, v, causal=causal, warp_partition=part)
            torch.autograd.grad(out, (q, k, v), dout)
    from ..bench_bwd import _sdpa_inputs
    from ..harness import sdpa

    qt, kt, vt, dt = _sdpa_inputs(q, k, v, dout)
    for _ in range(2):
        torch.autograd.grad(sdpa("flash")(qt, kt, vt, causal), (qt, kt, vt), dt)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(sys.argv[1:])
