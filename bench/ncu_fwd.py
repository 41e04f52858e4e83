"""One call of the V2 forward per (head dim, mask) for Nsight Compute to profile.

    ncu --clock-control none -k regex:flash_fwd_kernel --section SchedulerStats --section WarpStateStats \\
        python -m bench.ncu_fwd            # 4 kernels: d64/d128 x non-causal/causal, 4k tokens, fp16

The warm-up call runs before the profiled one; give ncu `--launch-skip 1 --launch-count 1` per case, or
profile every launch (each case is launched twice: warm-up, then the measured call)."""
from __future__ import annotations

import sys


def main(argv):
    import torch

    import cuflash

    s = int(argv[0]) if argv else 4096
    for d in (64, 128):
        h, b = 2048 // d, 16384 // s
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.float16) for _ in range(3))
        for causal in (False, True):
            for _ in range(2):
                cuflash.flash_attn_func(q, k, v, causal=causal)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(sys.argv[1:])
