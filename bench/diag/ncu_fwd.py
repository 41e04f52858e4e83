"""Diagnostic (GPU, under Nsight Compute): one call of the V2 forward per (head dim, mask) to profile.

    ncu --clock-control none -k regex:flash_fwd_kernel --section SchedulerStats --section WarpStateStats \\
        python -m bench.diag.ncu_fwd       # 4 kernels: d64/d128 x non-causal/causal, 4k tokens, fp16
        python -m bench.diag.ncu_fwd 4096 --backend sm80   # the same on the mma.sync kernels (on a Hopper GPU)

The warm-up call runs before the profiled one; give ncu `--launch-skip 1 --launch-count 1` per case, or
profile every launch (each case is launched twice: warm-up, then the measured call)."""
from __future__ import annotations

import sys


def pair(s=4096, d=128, causal=False, backend="auto"):
    """cuflash's forward, then SDPA FLASH's (FlashAttention-2's flash_fwd_kernel) on the same inputs, each launched
    twice: with -k regex:flash_fwd_kernel, launches 1 and 3 are the warm calls of each."""
    import torch

    import cuflash

    from ..harness import sdpa

    h, b = 2048 // d, 16384 // s
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.float16) for _ in range(3))
    for _ in range(2):
        cuflash.flash_attn_func(q, k, v, causal=causal, backend=backend)
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    for _ in range(2):
        sdpa("flash")(qt, kt, vt, causal)
    torch.cuda.synchronize()


def main(argv):
    import torch

    import cuflash

    backend = "auto"
    if "--backend" in argv:
        i = argv.index("--backend")
        backend, argv = argv[i + 1], argv[:i] + argv[i + 2:]
    if argv and argv[0] == "pair":  # python -m bench.diag.ncu_fwd pair [seqlen [headdim [causal]]]
        a = argv[1:]
        return pair(int(a[0]) if a else 4096, int(a[1]) if len(a) > 1 else 128, len(a) > 2 and a[2] == "causal",
                    backend)
    s = int(argv[0]) if argv else 4096
    for d in (64, 128):
        h, b = 2048 // d, 16384 // s
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.float16) for _ in range(3))
        for causal in (False, True):
            for _ in range(2):
                cuflash.flash_attn_func(q, k, v, causal=causal, backend=backend)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(sys.argv[1:])
