"""Diagnostic (GPU): ALiBi's cost over the plain kernel, with a correctness check of the same kernels first.

    python -m bench.diag.alibi_check [--quick] [--rounds N]

1. Correctness at lengths where most KV tiles lie inside the band on one side of the diagonal (the tiles that
   take Mask::apply_side, attn/mask.cuh): forward (sm90, sm80; out and LSE) and backward (sm90, sm80 kernels;
   dq, dk, dv) against a float64 reference, each error next to torch's own in the inputs' dtype (the tests' rule:
   out within 2x, gradients within 3x of torch's error + 2^-10 relative to the reference's scale; LSE within
   2e-4), causal and not, head dims 64 and 128, seqlen_q != seqlen_k, per-batch slopes.
2. Timing: fwd sm90, fwd sm80, bwd sm90, bwd sm80; ALiBi (BLOOM's slopes) and the plain kernel timed in turn
   (bench.harness.time_rounds, medians of `rounds` rounds), fp16, causal and not, head dims 64 and 128, seqlen
   4k and 16k at batch x seqlen = 16k tokens, hidden 2048. The last table: ms plain, ms ALiBi, cost (ALiBi / plain
   - 1; the aim is <= 10%).

Runs in about 3 minutes on an H200 (the kernels compiled at first use included); --quick: seqlen 4k only."""
from __future__ import annotations

import argparse
import math
import sys

TOKENS, HIDDEN = 16384, 2048


def bloom_slopes(h, device, b=None):
    import torch

    base = torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], device=device, dtype=torch.float32)
    if b is None:
        return base
    return (base[None, :] * torch.linspace(0.5, 1.5, b, device=device)[:, None]).contiguous()


def reference(q, k, v, slopes, causal, scale, dtype=None):
    """Attention with ALiBi, [b, s, h, d] layout, in float64 (dtype None) or in `dtype` (torch's own low-precision
    error: products in that dtype, softmax in float32 as torch's math path). Returns (out, lse)."""
    import torch

    dt = torch.float64 if dtype is None else dtype
    qt, kt, vt = (x.to(dt).transpose(1, 2) for x in (q, k, v))  # [b, h, s, d]
    sq, sk = q.shape[1], k.shape[1]
    s = torch.matmul(qt, kt.transpose(-1, -2)).float() if dtype is not None else torch.matmul(qt, kt.transpose(-1, -2))
    s = s * scale
    i = torch.arange(sq, device=q.device)[:, None]
    j = torch.arange(sk, device=q.device)[None, :]
    dist = (i + sk - sq - j).abs().to(s.dtype)
    sl = slopes.to(s.dtype)
    sl = sl[None, :, None, None] if sl.dim() == 1 else sl[:, :, None, None]
    s = s - sl * dist
    if causal:
        s = s.masked_fill(j > i + sk - sq, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1)
    out = torch.matmul(p.to(dt), vt)
    return out.transpose(1, 2), lse


def check(quick):
    """Correctness: prints one line per case, returns the number of failures."""
    import torch

    import cuflash

    fails = 0
    cases = [(1, 1500, 2100), (2, 2048, 1024)] if not quick else [(1, 1500, 2100)]
    for d in (64, 128):
        for causal in (True, False):
            for b, sq, sk in cases:
                h, hk = 4, 2
                dtype = torch.float16
                q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype)
                k = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype)
                v = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype)
                dout = torch.randn(b, sq, h, d, device="cuda", dtype=dtype)
                slopes = bloom_slopes(h, q.device, b)
                scale = d ** -0.5
                kr, vr = (x.repeat_interleave(h // hk, dim=2) for x in (k, v))
                # float64 reference and torch's low-precision one, with gradients
                grads = {}
                for name, dt in (("ref", None), ("lowp", dtype)):
                    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, kr, vr))
                    o, lse = reference(qq, kk, vv, slopes, causal, scale, dt)
                    o.backward(dout.to(o.dtype))
                    gk = kk.grad.view(b, sk, hk, h // hk, d).sum(3)
                    gv = vv.grad.view(b, sk, hk, h // hk, d).sum(3)
                    grads[name] = (o.detach().double(), lse.detach().double(), qq.grad.double(), gk.double(),
                                   gv.double())
                ref, lowp = grads["ref"], grads["lowp"]

                def err(x, r):
                    return (x.double() - r).abs().max().item()

                def floor(r):
                    return 2.0 ** -10 * max(r.abs().max().item(), 1e-3)

                for be in ("sm90", "sm80"):
                    out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=causal, alibi_slopes=slopes,
                                                          return_attn_probs=True, backend=be)
                    e_o, e_t = err(out, ref[0]), err(lowp[0], ref[0])
                    e_l = err(lse, ref[1])
                    ok = e_o <= 2 * e_t + floor(ref[0]) and e_l <= 2e-4 and not torch.isnan(out).any()
                    msg = f"fwd {be} d={d} causal={causal} {b}x{sq}x{sk}: out {e_o:.2e} (torch {e_t:.2e}) lse {e_l:.1e}"
                    for bbe in ("sm90", "sm80"):
                        try:
                            dq, dk, dv = cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=causal,
                                                                     alibi_slopes=slopes, backend=bbe)
                        except (ValueError, NotImplementedError) as e:
                            msg += f" | bwd {bbe}: n/a ({e})"
                            continue
                        for gname, gx, gr, gl in zip(("dq", "dk", "dv"), (dq, dk, dv), ref[2:], lowp[2:]):
                            e_g, e_gt = err(gx, gr), err(gl, gr)
                            g_ok = e_g <= 3 * e_gt + floor(gr) and not torch.isnan(gx).any()
                            ok &= g_ok
                            if not g_ok or gname == "dq":
                                msg += f" | bwd {bbe} {gname} {e_g:.2e} (torch {e_gt:.2e})"
                    fails += not ok
                    print(("ok   " if ok else "FAIL ") + msg, flush=True)
                del q, k, v, dout, kr, vr, grads
                torch.cuda.empty_cache()
    return fails


def timing(quick, rounds):
    import torch

    import cuflash

    from ..harness import time_rounds

    rows = []
    for d in (64, 128):
        h = HIDDEN // d
        for s in ((4096,) if quick else (4096, 16384)):
            b = max(1, TOKENS // s)
            q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.float16) for _ in range(4))
            slopes = bloom_slopes(h, q.device)
            for causal in (True, False):
                fns = {}
                for be in ("sm90", "sm80"):
                    for opt, kw in (("plain", {}), ("alibi", dict(alibi_slopes=slopes))):
                        fns[f"fwd {be}/{opt}"] = (lambda be=be, kw=kw: cuflash.flash_attn_func(
                            q, k, v, causal=causal, backend=be, **kw))
                        out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True, **kw)
                        fns[f"bwd {be}/{opt}"] = (lambda be=be, kw=kw, out=out, lse=lse: cuflash.flash_attn_backward(
                            dout, q, k, v, out, lse, causal=causal, backend=be, **kw))
                res = time_rounds(fns, rounds)
                for mode in ("fwd sm90", "fwd sm80", "bwd sm90", "bwd sm80"):
                    p, a = res[f"{mode}/plain"][0], res[f"{mode}/alibi"][0]
                    rows.append((mode, d, s, causal, p, a))
                    print(f"{mode} d={d} s={s} causal={causal}: plain {p} ms, alibi {a} ms", flush=True)
    print("\n| mode | hdim | seqlen | causal | plain ms | alibi ms | cost |")
    print("|---|---|---|---|---|---|---|")
    worst = 0.0
    for mode, d, s, causal, p, a in rows:
        cost = (a / p - 1) if p and a else None
        if cost is not None:
            worst = max(worst, cost)
        c = f"{100 * cost:+.1f}%" if cost is not None else "n/a"
        ps, as_ = (f"{x:.3f}" if x else "n/a" for x in (p, a))
        print(f"| {mode} | {d} | {s} | {causal} | {ps} | {as_} | {c} |")
    print(f"worst ALiBi cost: {100 * worst:+.1f}% (aim: <= +10%)")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.diag.alibi_check")
    ap.add_argument("--quick", action="store_true", help="seqlen 4k only, one correctness shape")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    fails = check(a.quick)
    timing(a.quick, a.rounds)
    print(f"correctness: {'all ok' if not fails else f'{fails} FAILED'}")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
