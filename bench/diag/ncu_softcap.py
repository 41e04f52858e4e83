"""Diagnostic (GPU, under Nsight Compute): one FA2-grid point (batch x seqlen = 16k tokens, hidden 2048) forward or
backward through the public API, with or without the soft-cap, three calls, so that bench/diag/ncu_source.sh can
sample the third launch of the main kernel and the two tables can be read side by side (what the soft-capped tiles
wait on that the plain ones do not):

    bench/diag/ncu_source.sh /tmp/cap0 flash_fwd_sm90 2 python3 -m bench.diag.ncu_softcap --softcap 0
    bench/diag/ncu_source.sh /tmp/cap50 flash_fwd_sm90 2 python3 -m bench.diag.ncu_softcap --softcap 50
    python -m bench.diag.ncu_sass_summary /tmp/cap0_sass.csv; python -m bench.diag.ncu_sass_summary /tmp/cap50_sass.csv

`--mode bwd` runs the backward through autograd (its main kernel: flash_bwd_sm90). `--window L,R` and `--alibi` take the
other score modifiers (the window with `--causal` off is the band alone; `--window SEQLEN,0` hides nothing the causal
mask does not, so its table against the plain causal one is the modifier kernel's own cost at equal work; `--alibi`
takes BLOOM's slopes). Every call is the public one
(`cuflash.flash_attn_func`), so the kernels profiled are the ones a caller gets at this point."""
from __future__ import annotations

import argparse

from .alibi_check import bloom_slopes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--headdim", type=int, default=128)
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--softcap", type=float, default=0.0, help="0: the plain kernel")
    ap.add_argument("--window", default="-1,-1", help="window_size as L,R (-1: unbounded)")
    ap.add_argument("--alibi", action="store_true", help="ALiBi with BLOOM's slopes")
    ap.add_argument("--mode", default="fwd", choices=("fwd", "bwd"))
    ap.add_argument("--backend", default="sm90", choices=("auto", "sm80", "sm90"))
    ap.add_argument("--calls", type=int, default=3)
    args = ap.parse_args(argv)
    s, d = args.seqlen, args.headdim
    if s <= 0 or 16384 % s or 2048 % d:
        raise ValueError(f"--seqlen must divide 16384 and --headdim divide 2048; got {s}, {d}")
    if args.softcap < 0:
        raise ValueError(f"--softcap must be >= 0; got {args.softcap}")
    try:
        window = tuple(int(x) for x in args.window.split(","))
    except ValueError:
        window = ()
    if len(window) != 2:
        raise ValueError(f"--window must be two integers L,R; got {args.window!r}")

    import torch

    import cuflash

    h, b = 2048 // d, 16384 // s
    torch.manual_seed(0)
    dt = getattr(torch, args.dtype)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dt, requires_grad=args.mode == "bwd") for _ in range(3))
    dout = torch.randn(b, s, h, d, device="cuda", dtype=dt)
    slopes = None
    if args.alibi:
        slopes = bloom_slopes(h, "cuda")
    kw = dict(causal=args.causal, softcap=args.softcap, window_size=window, alibi_slopes=slopes, backend=args.backend)
    for _ in range(args.calls):
        out = cuflash.flash_attn_func(q, k, v, **kw)
        if args.mode == "bwd":
            out.backward(dout)
    torch.cuda.synchronize()
    print(f"{args.mode} b{b} h{h} s{s} d{d} {args.dtype} causal={args.causal} softcap={args.softcap} "
          f"window={window} alibi={args.alibi}: "
          f"{args.calls} calls", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
