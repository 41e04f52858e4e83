"""Diagnostic (GPU, compute capability 9.0): where the Hopper kernels take their exponentials, and the soft-cap's
backward derivative, checked and timed.

    python -m bench.diag.softcap_probe [--rounds N] [--quick] [--time-limit S]

The variants are the Sm90FwdTile / Sm90BwdTile fields `exp` and `cap_exp` (cuda_src/attn/softmax.cuh ExpVariant:
0 = every exponential on MUFU, 3 = every other one on the FMA pipe, 4 = one in four), set in the configuration tables
for the duration of a timing (the plan memos cleared on entry, so each variant's calls run through their own plans).

1. Correctness of every variant against a float64 reference (forward: out and LSE; backward: dq, dk, dv), each
   error next to torch's own in the inputs' dtype (the tests' rule: out within 2x, gradients within 3x of torch's
   error + 2^-10 of the reference's scale; LSE within 2e-4): soft-cap 30 alone, with ALiBi, with a window, and the
   plain kernels with `exp`; fp16 and bf16, head dims 64 and 128 (96 for the backward), seqlen_q != seqlen_k with
   ragged tails, GQA.
2. Timing (fp16, causal, batch x seqlen = 16k tokens, hidden 2048, 4k and 16k; bench.harness.time_rounds, medians
   of rounds, every variant in turn): the forward (plain with exp 0 / 3 / 4, soft-cap 50 with cap_exp 0 / 3 / 4)
   and the backward (plain, soft-cap with cap_exp 0 / 3 / 4). The last table: ms of each, and each soft-cap
   variant's cost over the plain kernel (the aim: <= +10%)."""
from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
from dataclasses import replace

TOKENS, HIDDEN = 16384, 2048


@contextlib.contextmanager
def variant(d, fwd=None, bwd=None):
    """SM90_FWD_TILES[d] / SM90_BWD_TILES[d] with the fields of `fwd` / `bwd` (dicts) replaced, memos cleared."""
    from cuflash import _configs, _fwd, backward

    old_f, old_b = _configs.SM90_FWD_TILES.get(d), _configs.SM90_BWD_TILES.get(d)

    def clear():
        _fwd._PLANS.clear()
        _fwd._KV_PLANS.clear()
        backward._PLANS.clear()

    if fwd:
        _configs.SM90_FWD_TILES[d] = replace(old_f, **fwd)
    if bwd:
        _configs.SM90_BWD_TILES[d] = replace(old_b, **bwd)
    clear()
    try:
        yield
    finally:
        if old_f is not None:
            _configs.SM90_FWD_TILES[d] = old_f
        if old_b is not None:
            _configs.SM90_BWD_TILES[d] = old_b
        clear()


def reference(q, k, v, causal, scale, softcap=0.0, slopes=None, window=(-1, -1), dtype=None):
    """Attention [b, s, h, d] (k, v already with the query heads' count) in float64 (dtype None) or with products
    in `dtype` and the softmax in float32 (torch's own low-precision error). Returns (out, lse)."""
    import torch

    dt = torch.float64 if dtype is None else dtype
    qt, kt, vt = (x.to(dt).transpose(1, 2) for x in (q, k, v))
    sq, sk = q.shape[1], k.shape[1]
    s = torch.matmul(qt, kt.transpose(-1, -2))
    s = (s.float() if dtype is not None else s) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(sq, device=q.device)[:, None]
    j = torch.arange(sk, device=q.device)[None, :]
    rel = i + sk - sq - j  # i + diag - j
    if slopes is not None:
        s = s - slopes.to(s.dtype)[None, :, None, None] * rel.abs().to(s.dtype)
    hidden = torch.zeros_like(rel, dtype=torch.bool)
    if causal:
        hidden |= rel < 0
    if window[0] >= 0:
        hidden |= rel > window[0]
    if window[1] >= 0:
        hidden |= rel < -window[1]
    s = s.masked_fill(hidden, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.matmul(p.to(dt), vt).transpose(1, 2), lse


FWD_VARIANTS = (("exp0", dict(exp=0)), ("exp3", dict(exp=3)), ("exp4", dict(exp=4)), ("cap0", dict(cap_exp=0)),
                ("cap3", dict(cap_exp=3)), ("cap4", dict(cap_exp=4)))
BWD_VARIANTS = (("cap0", dict(cap_exp=0)), ("cap3", dict(cap_exp=3)), ("cap4", dict(cap_exp=4)))


def specs():
    """The kernels of every variant (compiled in parallel before the first launch)."""
    from cuflash._configs import (DTYPES, MOD_SCORE, SM90_BWD_TILES, SM90_FWD_TILES, sm90_bwd_spec,
                                  sm90_fwd_spec)

    out = []
    for dt in DTYPES:
        for d in (64, 128):
            for _, fv in FWD_VARIANTS:
                t = replace(SM90_FWD_TILES[d], **fv)
                out += [sm90_fwd_spec(dt, d, False, t, MOD_SCORE)] if "cap_exp" in fv else \
                    [sm90_fwd_spec(dt, d, c, t) for c in (False, True)]
        for d in (64, 96, 128):
            out += [sm90_bwd_spec(dt, d, False, replace(SM90_BWD_TILES[d], **bv), MOD_SCORE) for _, bv in BWD_VARIANTS]
    return list(dict.fromkeys(out))


def check(quick):
    """Correctness lines; returns the number of failures."""
    import torch

    import cuflash

    fails = 0
    cases = [(2, 700, 1100), (1, 1500, 1024)] if not quick else [(2, 700, 1100)]
    opts = [("softcap", dict(softcap=30.0)), ("softcap+alibi", dict(softcap=30.0, alibi=True)),
            ("softcap+window", dict(softcap=30.0, window_size=(300, 0))), ("plain", {})]
    for dtype in (torch.float16, torch.bfloat16):
        for d in (64, 96, 128):
            for oname, o in opts:
                for causal in (True, False):
                    if "window" in oname and causal:
                        continue
                    for b, sq, sk in cases:
                        h, hk = 4, 2
                        g = torch.Generator(device="cuda").manual_seed(b * 7 + sq + d)
                        q, k, v, dout = (torch.randn(b, n, hh, d, device="cuda", dtype=dtype, generator=g) * sc
                                         for n, hh, sc in ((sq, h, 2.0), (sk, hk, 2.0), (sk, hk, 1.0), (sq, h, 1.0)))
                        slopes = (torch.rand(h, device="cuda", generator=g) * 0.2) if o.get("alibi") else None
                        window = o.get("window_size", (-1, -1))
                        kw = dict(causal=causal, softcap=o.get("softcap", 0.0), alibi_slopes=slopes,
                                  window_size=window)
                        scale = d ** -0.5
                        kr, vr = (x.repeat_interleave(h // hk, dim=2) for x in (k, v))
                        res = {}
                        for name, dt in (("ref", None), ("lowp", dtype)):
                            qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, kr, vr))
                            out_r, lse_r = reference(qq, kk, vv, causal, scale, kw["softcap"], slopes, window, dt)
                            out_r.backward(dout.to(out_r.dtype))
                            gk = kk.grad.view(b, sk, hk, h // hk, d).sum(3)
                            gv = vv.grad.view(b, sk, hk, h // hk, d).sum(3)
                            res[name] = (out_r.detach().double(), lse_r.detach().double(), qq.grad.double(),
                                         gk.double(), gv.double())
                        ref, lowp = res["ref"], res["lowp"]

                        def err(x, r):
                            fin = torch.isfinite(r)
                            return (x.double() - r).abs()[fin].max().item() if fin.any() else 0.0

                        def floor(r):
                            return 2.0 ** -10 * max(r.abs().max().item(), 1e-3)

                        field = "exp" if oname == "plain" else "cap_exp"
                        for label, val in (("0", 0), ("3", 3), ("4", 4)):
                            if d == 96 and oname == "plain":
                                continue
                            msg = f"{dtype} d={d} {oname} causal={causal} {b}x{sq}x{sk} {field}={label}:"
                            ok = True
                            with variant(d, fwd={field: val} if d in (64, 128) else None,
                                         bwd={"cap_exp": val} if oname != "plain" else None):
                                out, lse, _ = cuflash.flash_attn_func(q, k, v, return_attn_probs=True, backend="sm90",
                                                                      **kw)
                                e_o, e_t, e_l = err(out, ref[0]), err(lowp[0], ref[0]), err(lse, ref[1])
                                ok &= e_o <= 2 * e_t + floor(ref[0]) and e_l <= 2e-4 and not out.isnan().any()
                                msg += f" out {e_o:.2e} (torch {e_t:.2e}) lse {e_l:.1e}"
                                if oname != "plain":
                                    dq, dk, dv = cuflash.flash_attn_backward(dout, q, k, v, out, lse, backend="sm90",
                                                                             **kw)
                                    for gname, gx, gr, gl in zip(("dq", "dk", "dv"), (dq, dk, dv), ref[2:], lowp[2:]):
                                        e_g, e_gt = err(gx, gr), err(gl, gr)
                                        g_ok = e_g <= 3 * e_gt + floor(gr) and not gx.isnan().any()
                                        ok &= g_ok
                                        msg += f" {gname} {e_g:.2e} ({e_gt:.2e})"
                            fails += not ok
                            print(("ok   " if ok else "FAIL ") + msg, flush=True)
                        del q, k, v, dout, kr, vr, res
    torch.cuda.empty_cache()
    return fails


def timing(quick, rounds, deadline):
    import torch

    import cuflash

    from ..harness import time_ms, time_rounds

    rows = []
    for d in (64, 128):
        h = HIDDEN // d
        for s in ((4096,) if quick else (4096, 16384)):
            if time.time() > deadline:
                print(f"time limit: d={d} s={s} not timed", flush=True)
                continue
            b = max(1, TOKENS // s)
            q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.float16) for _ in range(4))
            fns = {}
            for name, fv in FWD_VARIANTS:
                cap = 50.0 if name.startswith("cap") else 0.0
                fns[f"fwd {name}"] = (d, fv, None, lambda cap=cap: cuflash.flash_attn_func(
                    q, k, v, causal=True, softcap=cap, backend="sm90"))
            for name, bv in (("plain", {}),) + BWD_VARIANTS:
                cap = 50.0 if name.startswith("cap") else 0.0
                out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=True, softcap=cap, return_attn_probs=True,
                                                      backend="sm90")
                fns[f"bwd {name}"] = (d, None, bv, lambda cap=cap, out=out, lse=lse: cuflash.flash_attn_backward(
                    dout, q, k, v, out, lse, causal=True, softcap=cap, backend="sm90"))

            def timer(entry):
                dd, fv, bv, fn = entry
                with variant(dd, fwd=fv, bwd=bv):
                    return time_ms(fn)

            res = time_rounds(fns, rounds, timer=timer)
            ms = {name: r[0] for name, r in res.items()}
            rows.append((d, s, ms))
            print(f"d={d} s={s}: " + ", ".join(f"{n} {m:.3f}" for n, m in ms.items() if m), flush=True)
            del q, k, v, dout
            torch.cuda.empty_cache()
    print("\n| hdim | seqlen | fwd exp0 / exp3 / exp4 ms | fwd softcap cap0 / cap3 / cap4 ms (cost over exp0) | "
          "bwd plain ms | bwd softcap cap0 / cap3 / cap4 ms (cost over plain) |")
    print("|---|---|---|---|---|---|")
    for d, s, ms in rows:
        f0 = ms["fwd exp0"]
        b0 = ms["bwd plain"]
        fe = " / ".join(f"{ms[f'fwd exp{x}']:.3f}" for x in (0, 3, 4))
        fc = " / ".join(f"{ms[f'fwd cap{x}']:.3f} ({100 * (ms[f'fwd cap{x}'] / f0 - 1):+.0f}%)" for x in (0, 3, 4))
        bc = " / ".join(f"{ms[f'bwd cap{x}']:.3f} ({100 * (ms[f'bwd cap{x}'] / b0 - 1):+.0f}%)" for x in (0, 3, 4))
        print(f"| {d} | {s} | {fe} | {fc} | {b0:.3f} | {bc} |")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.diag.softcap_probe")
    ap.add_argument("--quick", action="store_true", help="one correctness shape, seqlen 4k only")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--time-limit", type=float, default=600.0, help="seconds; no new timing point after it")
    a = ap.parse_args(argv)
    deadline = time.time() + a.time_limit
    from cuflash.precompile import compile_specs

    compile_specs(specs(), progress=True)
    fails = check(a.quick)
    timing(a.quick, a.rounds, deadline)
    print(f"correctness: {'all ok' if not fails else f'{fails} FAILED'}")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
