"""Diagnostic (GPU): how close out and out + residual come to the float64 output, and D = rowsum(dO * O) formed
from each, on the large-logit problems of tests/test_bwd_numerics.py (one query row against 1999 keys, inputs
x3, softmax_scale 0.3, 256 (batch, head) problems), per backend, dtype and head dim.

    python -m bench.diag.delta_precision

Columns: the median and the largest over problems of max |O - O_ref| for out and for out + res (in float64), and
of |D - D_ref| with D from out and from out + res. The residual is right where out + res is far closer to O_ref
than out (by about 2^-11 for fp16, 2^-8 for bf16, relative).
"""
from __future__ import annotations


def main():
    import torch

    import cuflash
    from cuflash import _fwd_sm90

    backends = ["sm80"] + (["sm90"] if _fwd_sm90.device_cc(0) == 90 else [])
    scale = 0.3
    print(f"{'backend':7s} {'dtype':9s} {'d':>4s} | {'|out-O| med':>11s} {'max':>9s} | {'|out+r-O| med':>13s} "
          f"{'max':>9s} | {'|D16-D| med':>11s} {'max':>9s} | {'|D32-D| med':>11s} {'max':>9s}")
    for dtype, d in (("float16", 64), ("float16", 128), ("bfloat16", 64), ("bfloat16", 128)):
        g = torch.Generator(device="cuda").manual_seed(20261201 + d)
        dt = getattr(torch, dtype)
        q = (torch.randn((2, 1, 128, d), device="cuda", generator=g) * 3).to(dt)
        k = (torch.randn((2, 1999, 128, d), device="cuda", generator=g) * 3).to(dt)
        v = torch.randn((2, 1999, 128, d), device="cuda", generator=g).to(dt)
        dout = torch.randn((2, 1, 128, d), device="cuda", generator=g).to(dt)
        qh, kh, vh = (x.double().transpose(1, 2) for x in (q, k, v))
        p = torch.softmax(qh @ kh.transpose(-1, -2) * scale, dim=-1)
        o_ref = (p @ vh).transpose(1, 2)  # [b, 1, h, d]
        d_ref = (dout.double() * o_ref).sum(-1)
        for backend in backends:
            out, res = cuflash.flash_attn_func(q, k, v, softmax_scale=scale, backend=backend, return_residual=True)
            o16 = out.double()
            o32 = out.double() + res.double()
            e16 = (o16 - o_ref).abs().amax(dim=(1, 3)).flatten()
            e32 = (o32 - o_ref).abs().amax(dim=(1, 3)).flatten()
            d16 = ((dout.double() * o16).sum(-1) - d_ref).abs().flatten()
            d32 = ((dout.double() * o32).sum(-1) - d_ref).abs().flatten()
            print(f"{backend:7s} {dtype:9s} {d:4d} | {e16.median():11.3e} {e16.max():9.3e} | {e32.median():13.3e} "
                  f"{e32.max():9.3e} | {d16.median():11.3e} {d16.max():9.3e} | {d32.median():11.3e} "
                  f"{d32.max():9.3e}", flush=True)


if __name__ == "__main__":
    main()
