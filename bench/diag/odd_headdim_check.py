"""GPU: head dims that are not multiples of 8 and views whose strides are not 16-byte units (the UA kernels,
cuda_src/common/tile.cuh: PAD_ELEM). Runs the GPU tests of tests/test_headdims.py that cover them (-k odd), then
times flash_attn_func forward and forward + backward at head dims 59 and 111 against 64 and 128 (aligned kernels),
and 64 with rows of 67 elements (the UA kernel by the strides alone): batch 2 x 16 heads x 4k, causal, fp16, medians
of CUDA-event timings after warm-up, SDPA FLASH timed in the same call at the aligned head dims. The table is last.

    PYTHONPATH=. python3 bench/diag/odd_headdim_check.py [--no-tests] [--seqlen 4096]
"""
from __future__ import annotations

import argparse
import subprocess
import sys


def timed(fn, warmup=5, iters=20):
    import torch

    from bench.harness import event_median_ms

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return event_median_ms(fn, iters)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-tests", action="store_true")
    ap.add_argument("--seqlen", type=int, default=4096)
    args = ap.parse_args(argv)
    rc = 0
    if not args.no_tests:
        rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-x", "tests/test_headdims.py", "-k",
                              "odd or headdim_validation", "-p", "no:cacheprovider"])
        print(f"tests: {'PASS' if rc == 0 else 'FAIL'} (rc {rc})")

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cuflash
    from bench.harness import tflops

    b, h, s = 2, 16, args.seqlen
    rows = []
    for d, pad in ((64, 0), (59, 0), (64, 3), (128, 0), (111, 0)):
        big = [torch.randn(b, s, h, d + pad, device="cuda", dtype=torch.float16) for _ in range(3)]
        q, k, v = (x[..., :d].requires_grad_() if pad else x.requires_grad_() for x in big)
        tf_fwd = lambda ms: tflops(ms, b, h, s, s, d, True, "fwd")  # noqa: E731
        tf_fb = lambda ms: tflops(ms, b, h, s, s, d, True, "fwd_bwd")  # noqa: E731
        fwd = timed(lambda: cuflash.flash_attn_func(q, k, v, causal=True))
        out = cuflash.flash_attn_func(q, k, v, causal=True)
        dout = torch.randn_like(out)

        def fb():
            o = cuflash.flash_attn_func(q, k, v, causal=True)
            torch.autograd.grad(o, (q, k, v), dout)
        fwdbwd = timed(fb)
        sdpa = float("nan")
        if d % 8 == 0 and not pad:
            qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))

            def sfb():
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
                torch.autograd.grad(o, (qt, kt, vt), dout.transpose(1, 2))
            sdpa = timed(sfb)
        rows.append((d, pad, fwd, fwdbwd, tf_fwd(fwd), tf_fb(fwdbwd), sdpa))
    print(f"\nUA cost, b={b} h={h} s={s} causal fp16 (ms medians; TFLOP/s at the inputs' head dim)")
    print(f"{'d':>4} {'row':>4} {'kernel':>8} {'fwd ms':>8} {'fwd TF':>7} {'f+b ms':>8} {'f+b TF':>7} {'sdpa f+b':>9}")
    for d, pad, fwd, fb_, tf, tfb, sd in rows:
        kind = "UA" if d % 8 or pad else "aligned"
        print(f"{d:>4} {d + pad:>4} {kind:>8} {fwd:8.3f} {tf:7.1f} {fb_:8.3f} {tfb:7.1f} {sd:9.3f}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
