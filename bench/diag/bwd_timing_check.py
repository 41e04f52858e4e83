"""Diagnostic (GPU): why the backward measures slower through autograd (suites bwd, bwd_partition) than called
directly (suite bwd_tiles): one shape, timed four ways, plus the kernels' own GPU times from torch.profiler.

    python -m bench.diag.bwd_timing_check [seqlen] [headdim]
"""
from __future__ import annotations

import sys
import time


def main(argv):
    import torch

    import cuflash
    from cuflash import backward as bwd_mod

    from ..bench_bwd import _grad_fn, _sdpa_inputs
    from ..harness import sdpa, time_ms

    s = int(argv[0]) if argv else 1024
    d = int(argv[1]) if len(argv) > 1 else 128
    h, b = 2048 // d, 16384 // s
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.float16) for _ in range(4))
    for x in (q, k, v):
        x.requires_grad_()
    out = cuflash.flash_attn_func(q, k, v)
    with torch.no_grad():
        o2, lse, _ = cuflash.flash_attn_func(q, k, v, return_attn_probs=True)
    views = bwd_mod.check_backward_inputs(dout, q.detach(), k.detach(), v.detach(), o2, lse)
    direct = lambda: bwd_mod.backward(*views, None, False, "atomic")  # noqa: E731
    api = lambda: cuflash.flash_attn_backward(dout, q.detach(), k.detach(), v.detach(), o2, lse)  # noqa: E731
    auto = _grad_fn(out, (q, k, v), dout)

    def loop10(fn):
        return lambda: [fn() for _ in range(10)]

    for name, fn, n in (("direct backward()", direct, 1), ("flash_attn_backward", api, 1),
                        ("autograd", auto, 1), ("autograd x10 per event pair", loop10(auto), 10),
                        ("direct x10 per event pair", loop10(direct), 10)):
        print(f"{name:32s} {time_ms(fn, rep=10) / n:.3f} ms", flush=True)
    qt, kt, vt, dt = _sdpa_inputs(q, k, v, dout)
    flash = _grad_fn(sdpa("flash")(qt, kt, vt), (qt, kt, vt), dt)
    print(f"{'SDPA FLASH autograd':32s} {time_ms(flash, rep=10):.3f} ms", flush=True)

    def host_us(fn, n=30):  # wall time of the call itself (launches are asynchronous), GPU idle before it
        ts = []
        for _ in range(n):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        return sorted(ts)[n // 2] * 1e6

    for name, fn in (("host: direct backward()", direct), ("host: flash_attn_backward", api),
                     ("host: autograd", auto), ("host: SDPA FLASH autograd", flash)):
        print(f"{name:32s} {host_us(fn):.1f} us", flush=True)
    from torch.profiler import ProfilerActivity, profile

    for name, fn in (("direct", direct), ("autograd", auto)):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        print(f"--- {name}: GPU kernels over 5 calls")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=60))


if __name__ == "__main__":
    main(sys.argv[1:])
