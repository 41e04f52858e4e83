"""What flash-attn parity costs (suites dropout, headdims and varlen).

dropout: attention dropout (p = 0.1) next to the same call without it, forward and forward + backward through
autograd, fp16 causal and not, head dims 64 and 128, seqlen 2k and 8k (batch x seqlen = 16k, hidden 2048), with
SDPA's FLASH and CUDNN backends given the same dropout_p, timed in turn, medians of `rounds` rounds. The cuflash
dropout call takes the default path (default_backend: on sm_90 the Hopper forward, the mma.sync backward);
`ratio_to_plain` = the time of the same path without dropout / with it (cuflash's plain record is its default path;
"sm80-plain" the mma.sync kernels' for comparison).

headdims: head dims that are not compiled (80, 160, 192, 224, 384: run on the kernel of the next compiled head
dim, zero-padded in shared memory) next to the compiled ones around them and SDPA FLASH / CUDNN at the same head
dim, forward (backend auto) and forward + backward (up to 256), fp16, seqlen 4k, causal and not; 384 and 512 on
the forward-only head-dim-512 kernel. TFLOP/s counts the inputs' own head dim (FlashAttention-2's formula), so a
padded head dim's rate is what the user gets (and the 512 kernel's repeated Q K^T is not counted).

varlen: packed sequences of three length mixtures (VARLEN_MIXES) against the padded batch they make (see `varlen`).
"""
from __future__ import annotations

import gc

from .harness import flops, record, time_rounds

TOKENS, HIDDEN = 16384, 2048


def _sdpa(provider, dropout_p=0.0):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[provider]

    def call(q, k, v, causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=dropout_p)

    return call


def _inputs(b, s, h, d):
    """q, k, v [b, s, h, d] fp16 requiring grad, their [b, h, s, d] copies for SDPA, and a dout for each layout."""
    import torch

    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
    qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
    return q, k, v, qt, kt, vt, torch.randn_like(q), torch.randn_like(qt)


def _fwd_bwd(fn, dout, inputs):
    def run():
        for x in inputs:
            x.grad = None
        fn().backward(dout)

    return run


def dropout(headdims=(64, 128), seqlens=(2048, 8192), rounds=3, p=0.1):
    import torch

    import cuflash

    recs = []
    for d in headdims:
        h = HIDDEN // d
        for s in seqlens:
            b = max(1, TOKENS // s)
            for causal in (False, True):
                q, k, v, qt, kt, vt, dout, doutt = _inputs(b, s, h, d)
                fns = {
                    "cuflash/plain": lambda: cuflash.flash_attn_func(q, k, v, causal=causal),
                    "cuflash/sm80-plain": lambda: cuflash.flash_attn_func(q, k, v, causal=causal, backend="sm80"),
                    "cuflash/dropout": lambda: cuflash.flash_attn_func(q, k, v, p, causal=causal),
                }
                for prov in ("flash", "cudnn"):
                    fn0, fn1 = _sdpa(prov), _sdpa(prov, p)
                    fns[f"{prov}/plain"] = lambda fn=fn0: fn(qt, kt, vt, causal)
                    fns[f"{prov}/dropout"] = lambda fn=fn1: fn(qt, kt, vt, causal)
                with torch.no_grad():
                    res = time_rounds(fns, rounds)
                recs += _records(res, "fwd", b, h, s, d, causal, rounds, p)
                res = time_rounds({key: _fwd_bwd(fn, dout, (q, k, v)) if key.startswith("cuflash")
                                   else _fwd_bwd(fn, doutt, (qt, kt, vt)) for key, fn in fns.items()}, rounds)
                recs += _records(res, "fwd_bwd", b, h, s, d, causal, rounds, p)
                gc.collect()
    return recs


def _records(res, mode, b, h, s, d, causal, rounds, p):
    out = []
    for key, (ms, per) in res.items():
        prov, name = key.split("/")
        base = res.get(f"{prov}/plain", (None,))[0]  # the same path without dropout
        ratio = (base / ms) if (name == "dropout" and base and ms) else None
        drop = p if name == "dropout" else 0.0
        if prov == "cuflash":
            be = "sm80" if name == "sm80-plain" else default_backend(d, mode, dropout=name == "dropout")
            out.append(record("cuflash", f"v2-{name}", mode, "float16", b, h, s, s, d, causal, ms, backend=be, rounds=rounds,
                              round_ms=per, dropout_p=drop, ratio_to_plain=ratio))
        else:
            out.append(record(prov, "sdpa", mode, "float16", b, h, s, s, d, causal, ms, rounds=rounds, round_ms=per,
                              dropout_p=drop, ratio_to_plain=ratio))
    line = " ".join(f"{k}={v[0]:.3f}ms" if v[0] else f"{k}=n/a" for k, v in res.items())
    print(f"dropout {mode} d={d} s={s} causal={causal}: {line}", flush=True)
    return out


def default_backend(d, mode, dropout=False) -> str:
    """The kernel path of a default cuflash call (backend "auto"), forward or forward + backward ("fwd+bwd" where
    the two differ): on an sm_90 GPU the Hopper forward from head dim 40 to 256 (dropout included) and the Hopper
    backward at kernel head dims 64-128 without dropout; the mma.sync kernels otherwise."""
    from cuflash._configs import SM80_ONLY_MAX_HEADDIM, SM90_BWD_HEADDIMS, kernel_headdim
    from cuflash._fwd_sm90 import device_cc

    hopper = device_cc(0) == 90 and SM80_ONLY_MAX_HEADDIM < d <= 256
    fwd = "sm90" if hopper else "sm80"
    if mode == "fwd":
        return fwd
    bwd = "sm90" if hopper and not dropout and kernel_headdim(d) in SM90_BWD_HEADDIMS else "sm80"
    return fwd if fwd == bwd else f"{fwd}+{bwd}"


def headdims(dims=(64, 80, 96, 128, 160, 192, 224, 256, 384, 512), seqlen=4096, rounds=3):
    import torch

    import cuflash
    from cuflash._configs import FWD_HEADDIMS, kernel_headdim

    recs = []
    for d in dims:
        h = max(1, HIDDEN // d)
        b = max(1, TOKENS // seqlen)
        for causal in (False, True):
            q, k, v, qt, kt, vt, dout, doutt = _inputs(b, seqlen, h, d)
            fns = {"cuflash": lambda: cuflash.flash_attn_func(q, k, v, causal=causal)}
            for prov in ("flash", "cudnn"):
                fn = _sdpa(prov)
                fns[prov] = lambda fn=fn: fn(qt, kt, vt, causal)
            for mode in ("fwd", "fwd_bwd") if d <= 256 else ("fwd",):  # (above 256: the forward only)
                if mode == "fwd":
                    with torch.no_grad():
                        res = time_rounds(fns, rounds)
                else:
                    res = time_rounds({key: _fwd_bwd(fn, dout if key == "cuflash" else doutt,
                                                     (q, k, v) if key == "cuflash" else (qt, kt, vt))
                                       for key, fn in fns.items()}, rounds)
                for key, (ms, per) in res.items():
                    if key == "cuflash":
                        recs.append(record("cuflash", "v2", mode, "float16", b, h, seqlen, seqlen, d, causal, ms,
                                           backend=default_backend(d, mode), rounds=rounds, round_ms=per,
                                           kernel_headdim=kernel_headdim(d, FWD_HEADDIMS)))
                    else:
                        recs.append(record(key, "sdpa", mode, "float16", b, h, seqlen, seqlen, d, causal, ms,
                                           rounds=rounds, round_ms=per))
                line = " ".join(f"{k}={v[0]:.3f}ms" if v[0] else f"{k}=n/a" for k, v in res.items())
                print(f"headdims {mode} d={d} causal={causal}: {line}", flush=True)
            gc.collect()
    return recs


# ------------------------------------------------------------------------------------------------- varlen
VARLEN_MIXES = {
    # name: (lengths, seed) -- random mixtures are drawn once from a seeded generator
    "uniform-512-4k": ("uniform", 16, 512, 4096, 1),
    "one-long-4k+15x256": ("fixed", (4096,) + (256,) * 15),
    "short-64x64-512": ("uniform", 64, 64, 512, 2),
}


def mix_lengths(spec) -> list:
    import numpy as np

    if spec[0] == "fixed":
        return list(spec[1])
    _, n, lo, hi, seed = spec
    return [int(x) for x in np.random.default_rng(seed).integers(lo, hi + 1, size=n)]


def real_token_work(lens, h, d, causal, mode) -> float:
    """FlashAttention-2's count (bench.harness.flops) summed over the sequences: the real tokens only."""
    return sum(flops(1, h, n, n, d, causal, mode) for n in lens)


def varlen(headdim=128, heads=16, heads_k=16, rounds=3):
    """Packed sequences (flash_attn_varlen_func, backend auto) against the padded batch the same sequences make
    ([b, max_len]: what a caller without varlen runs): cuflash's fixed-length kernels and SDPA FLASH / CUDNN on it,
    forward and forward + backward, fp16, causal and not, timed in turn. TFLOP/s counts the real tokens only
    (real_token_work) for every provider, so padding's waste shows as a lower rate."""
    import torch

    import cuflash

    recs = []
    d, h, hk = headdim, heads, heads_k
    for name, spec in VARLEN_MIXES.items():
        lens = mix_lengths(spec)
        b, mx, total = len(lens), max(lens), sum(lens)
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device="cuda")
        q, k, v = (torch.randn(total, n, d, device="cuda", dtype=torch.float16, requires_grad=True)
                   for n in (h, hk, hk))
        qp, kp, vp = (torch.randn(b, mx, n, d, device="cuda", dtype=torch.float16, requires_grad=True)
                      for n in (h, hk, hk))
        qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (qp, kp, vp))
        dout, doutp, doutt = torch.randn_like(q), torch.randn_like(qp), torch.randn_like(qt)
        for causal in (False, True):
            fns = {
                "cuflash/varlen": lambda: cuflash.flash_attn_varlen_func(q, k, v, cu, cu, mx, mx, causal=causal),
                "cuflash/padded": lambda: cuflash.flash_attn_func(qp, kp, vp, causal=causal),
            }
            for prov in ("flash", "cudnn"):
                fn = _sdpa(prov)
                fns[f"{prov}/padded"] = lambda fn=fn: fn(qt, kt, vt, causal)
            grads = {"cuflash/varlen": (dout, (q, k, v)), "cuflash/padded": (doutp, (qp, kp, vp)),
                     "flash/padded": (doutt, (qt, kt, vt)), "cudnn/padded": (doutt, (qt, kt, vt))}
            for mode in ("fwd", "fwd_bwd"):
                if mode == "fwd":
                    with torch.no_grad():
                        res = time_rounds(fns, rounds)
                else:
                    res = time_rounds({key: _fwd_bwd(fn, *grads[key]) for key, fn in fns.items()}, rounds)
                varlen_ms = res["cuflash/varlen"][0]
                for key, (ms, per) in res.items():
                    prov, layout = key.split("/")
                    extra = dict(mix=name, lengths=lens, total_tokens=total, max_len=mx, layout=layout, rounds=rounds,
                                 round_ms=per, varlen_speedup=(ms / varlen_ms) if ms and varlen_ms else None)
                    if prov == "cuflash":
                        be = default_backend(d, mode)
                        r = record("cuflash", f"v2-{layout}", mode, "float16", b, h, mx, mx, d, causal, ms,
                                   backend=be, heads_k=hk, **extra)
                    else:
                        r = record(prov, "sdpa", mode, "float16", b, h, mx, mx, d, causal, ms, heads_k=hk, **extra)
                    r["tflops"] = real_token_work(lens, h, d, causal, mode) / (ms * 1e-3) / 1e12 if ms else None
                    recs.append(r)
                line = " ".join(f"{k}={v[0]:.3f}ms" if v[0] else f"{k}=n/a" for k, v in res.items())
                print(f"varlen {mode} {name} causal={causal}: {line}", flush=True)
        del q, k, v, qp, kp, vp, qt, kt, vt
        gc.collect()
    return recs
