"""The score modifiers' cost (suite scores): sliding window, soft-cap and ALiBi next to the plain causal kernels,
forward (both backends) and backward, causal as language models use them, at seqlen 4k-16k.

Each point is timed in turn with its plain causal counterpart and SDPA's FLASH and CUDNN backends on the plain
causal problem (SDPA's fused backends take no window, soft-cap or ALiBi argument), medians of `rounds` rounds.
TFLOP/s is FlashAttention-2's causal formula for every record (so a window's rate is the causal problem's FLOPs
over its time, and its speed-up is its time ratio); `visible_fraction` is the share of the causal problem's
(query, key) pairs the window keeps: a kernel whose cost follows the band runs in about that fraction of the
plain causal time. `ratio_to_plain` = the plain causal time / this record's time (> 1: faster).

queued (suite scores_queued): every call queued behind a spin kernel (harness.time_queued_ms), so that each time is
the kernels' GPU time without what a lone call's host path does before its first kernel starts (at 4k, batch 4, a
forward of about half a millisecond, that host time is a visible share of a single call's time); records carry
timing="queued"."""
from __future__ import annotations

import gc

from .harness import queued_timer, record, sdpa, time_rounds

TOKENS, HIDDEN = 16384, 2048
WINDOW = 4096  # Mistral's sliding window
SOFTCAP = 50.0  # Gemma 2's attention soft-cap


def visible_fraction(s: int, left: int) -> float:
    """Visible pairs of a causal window (left, 0) over those of plain causal attention, seqlen s x s."""
    causal = s * (s + 1) // 2
    if left < 0 or left >= s:
        return 1.0
    band = sum(min(i, left) + 1 for i in range(s))
    return band / causal


def options(h, device):
    import torch

    slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], device=device)
    return {
        "window": dict(window_size=(WINDOW, 0)),
        "softcap": dict(softcap=SOFTCAP),
        "alibi": dict(alibi_slopes=slopes),
        "all": dict(window_size=(WINDOW, 0), softcap=SOFTCAP, alibi_slopes=slopes),
    }


def scores(dtypes=("float16",), headdims=(64, 128), seqlens=(4096, 8192, 16384), rounds=3, queued=False):
    import torch

    import cuflash

    timer = queued_timer() if queued else {}
    recs = []
    for dtype in dtypes:
        dt = getattr(torch, dtype)
        for d in headdims:
            h = HIDDEN // d
            for s in seqlens:
                b = max(1, TOKENS // s)
                q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dt) for _ in range(3))
                qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
                dout = torch.randn_like(q)
                opts = options(h, q.device)
                # forward: each backend's plain causal kernel and its modifier kernels, timed in turn
                fns = {}
                for be in ("sm90", "sm80"):
                    fns[f"{be}/plain"] = lambda be=be: cuflash.flash_attn_func(q, k, v, causal=True, backend=be)
                    for name, kw in opts.items():
                        fns[f"{be}/{name}"] = lambda be=be, kw=kw: cuflash.flash_attn_func(q, k, v, causal=True,
                                                                                            backend=be, **kw)
                for prov in ("flash", "cudnn"):
                    fn = sdpa(prov)
                    fns[f"sdpa/{prov}"] = lambda fn=fn: fn(qt, kt, vt, True)
                res = time_rounds(fns, rounds, **timer)
                recs += _records(res, "fwd", dtype, b, h, s, d, rounds, queued)
                # backward, each backend: from each forward's own out and LSE
                fns = {}
                for name, kw in [("plain", {})] + list(opts.items()):
                    out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, **kw)
                    for be in ("sm90", "sm80"):
                        fns[f"{be}/{name}"] = (lambda out=out, lse=lse, kw=kw, be=be: cuflash.flash_attn_backward(
                            dout, q, k, v, out, lse, causal=True, backend=be, **kw))
                res = time_rounds(fns, rounds, **timer)
                recs += _records(res, "bwd", dtype, b, h, s, d, rounds, queued)
                del q, k, v, qt, kt, vt, dout
                gc.collect()
    return recs


def _records(res, mode, dtype, b, h, s, d, rounds, queued=False):
    out = []
    timing = dict(timing="queued") if queued else {}
    plain = {key.split("/")[0]: ms for key, (ms, _) in res.items() if key.endswith("/plain")}
    for key, (ms, per) in res.items():
        prov, name = key.split("/")
        if prov == "sdpa":
            out.append(record(name, "sdpa", mode, dtype, b, h, s, s, d, True, ms, rounds=rounds, round_ms=per,
                              option="plain", **timing))
            continue
        base = plain.get(prov)
        frac = visible_fraction(s, WINDOW) if name in ("window", "all") else 1.0
        out.append(record("cuflash", f"v2-{prov}-{name}" if prov == "sm90" else f"v2-{name}", mode, dtype, b, h, s,
                          s, d, True, ms, backend=prov, rounds=rounds, round_ms=per, option=name,
                          visible_fraction=frac, ratio_to_plain=(base / ms) if base and ms else None, **timing))
    line = " ".join(f"{k}={v[0]:.3f}ms" if v[0] else f"{k}=n/a" for k, v in res.items())
    print(f"{mode} {dtype} d={d} s={s}: {line}", flush=True)
    return out
