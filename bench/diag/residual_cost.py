"""Diagnostic (GPU): what the output residual costs (the forward writing out's rounding error, the backward's
preprocess reading it: cuflash._autograd). For each backend, head dim, causal flag and sequence length of the FA2
grid (batch x seqlen = 16k, hidden 2048, fp16): the forward with and without the residual, and the backward
(flash_attn_backward, deterministic=False) with and without it, medians of CUDA-event timings after warm-up,
rounds of each pair timed in turn.

    python -m bench.diag.residual_cost [--json FILE]

What it should show: the residual adds one store of an array the size of out to the forward (hidden under the
other blocks' products from a few thousand keys on; visible at 1k) and one load of it to the backward's preprocess
(a few percent of a backward at 1k, less from 4k on).
"""
from __future__ import annotations

import argparse
import json
import statistics


def _time(fns, rounds=5, rep=10):
    """{name: median ms} of each fn, rounds timed in turn (each round: rep calls between two events)."""
    import torch

    out = {n: [] for n in fns}
    for fn in fns.values():  # warm-up (compiles, plans)
        fn()
    torch.cuda.synchronize()
    for _ in range(rounds):
        for name, fn in fns.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(rep):
                fn()
            b.record()
            b.synchronize()
            out[name].append(a.elapsed_time(b) / rep)
    return {n: statistics.median(v) for n, v in out.items()}


def main(argv=None):
    import torch

    import cuflash
    from cuflash import _fwd_sm90

    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--seqlens", default="1024,4096,16384")
    args = ap.parse_args(argv)
    backends = ["sm80"] + (["sm90"] if _fwd_sm90.device_cc(0) == 90 else [])
    recs = []
    print(f"{'backend':7s} {'d':>4s} {'causal':>6s} {'seqlen':>6s} {'fwd ms':>8s} {'+res':>8s} {'ratio':>6s} "
          f"{'bwd ms':>8s} {'+res':>8s} {'ratio':>6s}")
    for backend in backends:
        for d in (64, 128):
            for causal in (False, True):
                for s in (int(x) for x in args.seqlens.split(",")):
                    h, b = 2048 // d, 16384 // s
                    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.float16) for _ in range(4))
                    out, lse, _, res = cuflash.flash_attn_func(q, k, v, causal=causal, backend=backend,
                                                               return_attn_probs=True, return_residual=True)
                    t = _time({
                        "fwd": lambda: cuflash.flash_attn_func(q, k, v, causal=causal, backend=backend,
                                                               return_attn_probs=True),
                        "fwd_res": lambda: cuflash.flash_attn_func(q, k, v, causal=causal, backend=backend,
                                                                   return_residual=True),
                        "bwd": lambda: cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=causal,
                                                                   backend=backend),
                        "bwd_res": lambda: cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=causal,
                                                                       backend=backend, out_residual=res),
                    })
                    rec = dict(backend=backend, headdim=d, causal=causal, seqlen=s, batch=b, nheads=h, **t)
                    recs.append(rec)
                    print(f"{backend:7s} {d:4d} {str(causal):>6s} {s:6d} {t['fwd']:8.3f} {t['fwd_res']:8.3f} "
                          f"{t['fwd'] / t['fwd_res']:6.3f} {t['bwd']:8.3f} {t['bwd_res']:8.3f} "
                          f"{t['bwd'] / t['bwd_res']:6.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, records=recs), f, indent=1)


if __name__ == "__main__":
    main()
